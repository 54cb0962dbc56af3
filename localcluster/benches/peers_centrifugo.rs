//! Fan-out side by side with Centrifugo v6.9.1 (issue 20, part 2), on loopback, in one
//! run with the rounds interleaved: 1, 100 and 1000 subscribers of one channel over SSE,
//! one event every 20 ms (the observe bench's pace), through
//! - leasehold, subscribers on a non-owner sidecar (one upstream hop; the owner publishes
//!   through its agent API, fenced, and journals each event in Postgres before fan-out);
//! - the same with the previous default, a fixed 5 ms journal linger
//!   (`LEASEHOLD_JOURNAL_LINGER=5ms`: the first event into an empty queue waits that long
//!   for company), beside the default adaptive group commit (no wait);
//! - leasehold, subscribers on the owner itself;
//! - Centrifugo, subscribers on its unidirectional SSE transport (`/connection/uni_sse`,
//!   subscribed in the connect request), events published with its HTTP API
//!   (`POST /api/publish`); memory engine, no history.
//!
//! The same method for all: the publisher stamps its clock (µs) into the payload as
//! `"t"`, the same lean SSE readers (`localcluster::fanout`) subtract it from theirs on
//! receipt. Each run starts its server(s) afresh. Figures per run: publish → delivery
//! p50/p99 and CPU per delivery (utime + stime from `/proc/<pid>/stat`, before and after
//! the publishing, divided by deliveries) of the server processes: the three sidecars for
//! leasehold, the centrifugo process; also the Postgres server's (postmaster and its
//! backends; leasehold's journal writes there, Centrifugo uses none) and this process's
//! (readers and publisher). In each round the three servers take turns, the order rotated
//! from round to round so that drift on the shared machine hits all alike.
//!
//! Paths and switches:
//! - `DATABASE_URL`: a Postgres server of this bench's own (`scripts/with-postgres.sh`);
//!   its CPU is read, so it must not be shared.
//! - `LEASEHOLD_BIN_DIR`: leasehold's binaries (`make bench-centrifugo`: the release build).
//! - `LEASEHOLD_BENCH_CENTRIFUGO`: the Centrifugo binary; default
//!   `~/go/bin/centrifugo-v6.9.1`, which `scripts/ensure-centrifugo.sh` builds.
//! - Centrifugo's configuration: `bench/peers/centrifugo/config.json` (its address and
//!   port are set per run through `CENTRIFUGO_HTTP_SERVER_*`).
//! - `LEASEHOLD_BENCH_ROUNDS` (default 3), `LEASEHOLD_BENCH_SIZES` (subscriber counts,
//!   default `1,100,1000`), `LEASEHOLD_BENCH_EVENTS` (events per run, default 200).
//!
//! Run: `make bench-centrifugo` (builds Centrifugo if missing, builds leasehold in release,
//! runs this on a throwaway Postgres).

use std::{
    fmt,
    path::PathBuf,
    time::{Duration, Instant},
};

use localcluster::{
    centrifugo::{self, Centrifugo},
    fanout,
    process::{cpu_time, cpu_time_with_children, parent_pid},
    Cluster, ClusterOptions,
};
use sqlx::{Connection, PgConnection};
use tokio::sync::mpsc;

/// One event every 20 ms: 50 tokens/s, a fast model's streaming rate (as the observe bench).
const PACE: Duration = Duration::from_millis(20);
/// Events published per run (`LEASEHOLD_BENCH_EVENTS` overrides).
const EVENTS: usize = 200;
/// Rounds (`LEASEHOLD_BENCH_ROUNDS` overrides).
const ROUNDS: usize = 3;
/// Subscriber counts (`LEASEHOLD_BENCH_SIZES` overrides).
const SIZES: [usize; 3] = [1, 100, 1000];
/// Between the subscribers' connecting and the first publish: every subscription is in
/// place (leasehold's remote followers connected upstream, replays done).
const SETTLE: Duration = Duration::from_secs(2);
/// After the last publish, how long deliveries may still trickle in at most.
const COLLECT_WITHIN: Duration = Duration::from_secs(30);
/// A gap this long without any delivery ends the collection early (lost events).
const COLLECT_IDLE: Duration = Duration::from_secs(5);
/// The channel (Centrifugo) and session key prefix (leasehold).
const CHANNEL: &str = "bench";

#[derive(Debug, Clone, Copy, PartialEq)]
enum Server {
    LeaseholdRemote,
    LeaseholdRemoteLinger5ms,
    LeaseholdOwner,
    Centrifugo,
}

impl fmt::Display for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Server::LeaseholdRemote => "leasehold, non-owner sidecar",
            Server::LeaseholdRemoteLinger5ms => "leasehold, non-owner sidecar, 5 ms journal linger",
            Server::LeaseholdOwner => "leasehold, owner sidecar",
            Server::Centrifugo => "Centrifugo v6.9.1 uni_sse",
        })
    }
}

const SERVERS: [Server; 4] =
    [Server::LeaseholdRemote, Server::LeaseholdRemoteLinger5ms, Server::LeaseholdOwner, Server::Centrifugo];

/// The server of one run, started afresh.
enum Running {
    Leasehold { cluster: Cluster, key: String, observe_on: usize },
    Centrifugo(Centrifugo),
}

impl Running {
    async fn start(server: Server, ctx: &Context, run: usize) -> anyhow::Result<Running> {
        Ok(match server {
            Server::Centrifugo => Running::Centrifugo(Centrifugo::start(&ctx.centrifugo).await?),
            Server::LeaseholdRemote | Server::LeaseholdRemoteLinger5ms | Server::LeaseholdOwner => {
                let mut options = bench_options();
                if server == Server::LeaseholdRemoteLinger5ms {
                    // The fixed wait the sidecar had by default before the adaptive group commit.
                    let env = vec![("LEASEHOLD_JOURNAL_LINGER".to_owned(), "5ms".to_owned())];
                    options.sidecar_env = vec![env; options.nodes];
                }
                let cluster = Cluster::start(&ctx.db, options).await?;
                let key = format!("{CHANNEL}-{run}");
                fanout::claim_all(&cluster, std::slice::from_ref(&key)).await?;
                let observe_on = if server == Server::LeaseholdOwner { 0 } else { 1 };
                Running::Leasehold { cluster, key, observe_on }
            }
        })
    }

    async fn subscribe(&self, count: usize, tx: &mpsc::UnboundedSender<u64>) -> anyhow::Result<()> {
        match self {
            Running::Leasehold { cluster, key, observe_on } => {
                let base = cluster.nodes[*observe_on].public_url();
                let authority = base.trim_start_matches("http://");
                fanout::lean_sse_readers(authority, &format!("/v1/sessions/{key}/stream"), count, tx).await
            }
            Running::Centrifugo(c) => {
                fanout::lean_sse_readers(&c.authority(), &Centrifugo::uni_sse_target(CHANNEL), count, tx)
                    .await
            }
        }
    }

    async fn publish(&self, http: &reqwest::Client) -> anyhow::Result<()> {
        match self {
            Running::Leasehold { cluster, key, .. } => {
                fanout::publish(http, &cluster.nodes[0].agent_api_url(), key, 1, "token").await
            }
            Running::Centrifugo(c) => c.publish(CHANNEL).await,
        }
    }

    /// CPU used so far by the server's processes.
    fn server_cpu(&self) -> Duration {
        let used = |pid| cpu_time(pid).unwrap_or_default();
        match self {
            Running::Leasehold { cluster, .. } => cluster.nodes.iter().map(|n| used(n.sidecar.pid())).sum(),
            Running::Centrifugo(c) => used(c.process.pid()),
        }
    }
}

/// What a run needs: the database, the Postgres server's PID, the Centrifugo binary.
struct Context {
    db: String,
    postmaster: u32,
    centrifugo: PathBuf,
}

/// CPU used so far by the server, the Postgres server and this process.
#[derive(Clone, Copy)]
struct Cpu {
    server: Duration,
    postgres: Duration,
    bench: Duration,
}

impl Cpu {
    fn now(running: &Running, ctx: &Context) -> Cpu {
        Cpu {
            server: running.server_cpu(),
            postgres: cpu_time_with_children(ctx.postmaster).unwrap_or_default(),
            bench: cpu_time(std::process::id()).unwrap_or_default(),
        }
    }

    fn since(self, before: Cpu) -> Cpu {
        Cpu {
            server: self.server.saturating_sub(before.server),
            postgres: self.postgres.saturating_sub(before.postgres),
            bench: self.bench.saturating_sub(before.bench),
        }
    }
}

struct Measured {
    latencies: Vec<u64>,
    expected: usize,
    cpu: Cpu,
}

impl Measured {
    fn per_delivery(&self, d: Duration) -> f64 {
        d.as_secs_f64() * 1e6 / self.latencies.len().max(1) as f64
    }
}

async fn measure(
    server: Server,
    ctx: &Context,
    run: usize,
    subscribers: usize,
    events: usize,
) -> anyhow::Result<Measured> {
    let running = Running::start(server, ctx, run).await?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    running.subscribe(subscribers, &tx).await?;
    tokio::time::sleep(SETTLE).await;
    while rx.try_recv().is_ok() {} // nothing published yet; drop anything replayed
    let http = reqwest::Client::new();
    let before = Cpu::now(&running, ctx);
    for _ in 0..events {
        running.publish(&http).await?;
        tokio::time::sleep(PACE).await;
    }
    let expected = events * subscribers;
    let mut latencies = Vec::with_capacity(expected);
    let deadline = Instant::now() + COLLECT_WITHIN;
    while latencies.len() < expected && Instant::now() < deadline {
        match tokio::time::timeout(COLLECT_IDLE, rx.recv()).await {
            Ok(Some(l)) => latencies.push(l),
            _ => break,
        }
    }
    let cpu = Cpu::now(&running, ctx).since(before);
    latencies.sort_unstable();
    Ok(Measured { latencies, expected, cpu })
}

/// Per server and size, over all rounds.
#[derive(Default, Clone)]
struct Totals {
    p50_sum: f64,
    p99_sum: f64,
    runs: usize,
    deliveries: usize,
    expected: usize,
    server: Duration,
    postgres: Duration,
}

impl Totals {
    fn add(&mut self, m: &Measured) {
        self.p50_sum += fanout::percentile_ms(&m.latencies, 0.5);
        self.p99_sum += fanout::percentile_ms(&m.latencies, 0.99);
        self.runs += 1;
        self.deliveries += m.latencies.len();
        self.expected += m.expected;
        self.server += m.cpu.server;
        self.postgres += m.cpu.postgres;
    }

    fn p50(&self) -> f64 {
        self.p50_sum / self.runs.max(1) as f64
    }

    fn p99(&self) -> f64 {
        self.p99_sum / self.runs.max(1) as f64
    }

    fn per_delivery(&self, d: Duration) -> f64 {
        d.as_secs_f64() * 1e6 / self.deliveries.max(1) as f64
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{name}: {v:?}")))
}

fn bench_options() -> ClusterOptions {
    ClusterOptions {
        nodes: 3,
        lease_ttl: Duration::from_secs(15),
        heartbeat: Duration::from_secs(5),
        drain_timeout: Duration::from_secs(5),
        agent_command: Some(localcluster::trivial_agent::command()),
        ..ClusterOptions::default()
    }
}

/// The Postgres server's PID: the parent of our own backend.
async fn postmaster(admin: &str) -> anyhow::Result<u32> {
    let mut conn = PgConnection::connect(admin).await?;
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut conn).await?;
    let backend = u32::try_from(backend)?;
    parent_pid(backend)
        .ok_or_else(|| anyhow::anyhow!("the Postgres backend {backend} is not readable in /proc"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    if localcluster::trivial_agent::serve_if_requested().await {
        return Ok(());
    }
    let admin = std::env::var("DATABASE_URL").expect("DATABASE_URL: run with `make bench-centrifugo`");
    let ctx = Context {
        db: localcluster::postgres::fresh_database(&admin).await?,
        postmaster: postmaster(&admin).await?,
        centrifugo: centrifugo::binary()?,
    };
    let rounds: usize = env_or("LEASEHOLD_BENCH_ROUNDS", ROUNDS);
    let events: usize = env_or("LEASEHOLD_BENCH_EVENTS", EVENTS);
    let sizes: Vec<usize> = std::env::var("LEASEHOLD_BENCH_SIZES").map_or(SIZES.to_vec(), |s| {
        s.split(',').map(|n| n.trim().parse().expect("LEASEHOLD_BENCH_SIZES: numbers")).collect()
    });
    println!(
        "## Fan-out side by side with Centrifugo: {rounds} rounds, {events} events per run, one every {PACE:?}\n"
    );
    println!(
        "centrifugo: {}; configuration {}\n",
        ctx.centrifugo.display(),
        centrifugo::config_path().display()
    );
    println!(
        "| subscribers | round | server | p50 ms | p99 ms | deliveries | server CPU µs/delivery | Postgres CPU µs/delivery | readers+publisher CPU µs/delivery |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut summary = Vec::new();
    let mut run = 0;
    for &subscribers in &sizes {
        let mut totals = vec![Totals::default(); SERVERS.len()];
        for round in 0..rounds {
            let mut order: Vec<usize> = (0..SERVERS.len()).collect();
            order.rotate_left(round % SERVERS.len());
            for at in order {
                let server = SERVERS[at];
                run += 1;
                let m = measure(server, &ctx, run, subscribers, events).await?;
                anyhow::ensure!(
                    !m.latencies.is_empty(),
                    "{server}: nothing delivered to {subscribers} subscribers"
                );
                println!(
                    "| {subscribers} | {round} | {server} | {:.3} | {:.3} | {}/{} | {:.1} | {:.1} | {:.1} |",
                    fanout::percentile_ms(&m.latencies, 0.5),
                    fanout::percentile_ms(&m.latencies, 0.99),
                    m.latencies.len(),
                    m.expected,
                    m.per_delivery(m.cpu.server),
                    m.per_delivery(m.cpu.postgres),
                    m.per_delivery(m.cpu.bench),
                );
                totals[at].add(&m);
            }
        }
        summary.push((subscribers, totals));
    }
    println!("\n### Means over the rounds (p50/p99: mean of the runs'; CPU: total over total deliveries)\n");
    println!(
        "| subscribers | server | p50 ms | p99 ms | delivered | server CPU µs/delivery | + Postgres µs/delivery | p99 ÷ Centrifugo's | server CPU ÷ Centrifugo's | (server + Postgres) ÷ Centrifugo's |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (subscribers, totals) in &summary {
        let peer = &totals[SERVERS.iter().position(|s| *s == Server::Centrifugo).expect("listed")];
        let peer_cpu = peer.per_delivery(peer.server + peer.postgres);
        for (server, t) in SERVERS.iter().zip(totals) {
            println!(
                "| {subscribers} | {server} | {:.3} | {:.3} | {}/{} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} |",
                t.p50(),
                t.p99(),
                t.deliveries,
                t.expected,
                t.per_delivery(t.server),
                t.per_delivery(t.server + t.postgres),
                t.p99() / peer.p99(),
                t.per_delivery(t.server) / peer.per_delivery(peer.server),
                t.per_delivery(t.server + t.postgres) / peer_cpu,
            );
        }
    }
    println!();
    Ok(())
}
