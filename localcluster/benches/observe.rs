//! Observe and drain, every figure beside a baseline from the same run:
//! - publish → observer latency, observers on a non-owner node (one upstream hop) vs the
//!   same observers on the owner itself; at 1, 100 and 1000 observers of one session at a
//!   model's token rate (one event every 20 ms), 1000 observers spread over all three
//!   nodes, and at a burst pace (every 2 ms): 1000 observers, 1000 sessions with one each;
//! - events per second one node fans out;
//! - drain: `POST /drain` wall time with 1k and 10k leases held, and the hand-back
//!   statement alone vs releasing the same leases one statement each.
//!
//! Run: `make bench`.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use leasehold_core::{store::LeaseStore, Epoch, Owner, SessionKey};
use localcluster::{fanout, Cluster, ClusterOptions};
use tokio::sync::mpsc;

/// One event per session every 20 ms: 50 tokens/s, a fast model's streaming rate.
const PACE: Duration = Duration::from_millis(20);

/// Open `per_key` observers of each key at `base` (lean SSE readers, see
/// `localcluster::fanout`); each reports (latency µs) per event received.
async fn observers(base: &str, keys: &[String], per_key: usize, tx: &mpsc::UnboundedSender<u64>) {
    let authority = base.trim_start_matches("http://");
    for key in keys {
        fanout::lean_sse_readers(authority, &format!("/v1/sessions/{key}/stream"), per_key, tx)
            .await
            .unwrap();
    }
}

async fn publish(http: &reqwest::Client, agent_api: &str, key: &str, epoch: i64, kind: &str) {
    fanout::publish(http, agent_api, key, epoch, kind).await.unwrap();
}

fn pct(sorted: &[u64], q: f64) -> f64 {
    fanout::percentile_ms(sorted, q)
}

/// Publish `events` events round-robin over `keys`, one every `pace` (plus the publish's
/// own round trip), and collect every observer's latency.
async fn measure(
    cluster: &Cluster,
    observe_on: &[usize],
    keys: &[String],
    per_key: usize,
    events: usize,
    pace: Duration,
) -> Measured {
    let (tx, mut rx) = mpsc::unbounded_channel();
    // `per_key` observers of each key in all, split evenly over the `observe_on` nodes.
    for (i, node) in observe_on.iter().enumerate() {
        let share = per_key / observe_on.len() + usize::from(i < per_key % observe_on.len());
        observers(&cluster.nodes[*node].public_url(), keys, share, &tx).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await; // followers connected, replays done
    while rx.try_recv().is_ok() {} // drop replayed events
    let http = reqwest::Client::new();
    let owner = &cluster.nodes[0];
    let cpu_before = Cpu::now(cluster);
    for i in 0..events {
        publish(&http, &owner.agent_api_url(), &keys[i % keys.len()], 1, "token").await;
        tokio::time::sleep(pace).await;
    }
    let expected = events * per_key;
    let mut got = Vec::with_capacity(expected);
    let deadline = Instant::now() + Duration::from_secs(30);
    while got.len() < expected && Instant::now() < deadline {
        if let Ok(Some(l)) = tokio::time::timeout(Duration::from_millis(200), rx.recv()).await {
            got.push(l);
        }
    }
    let cpu = Cpu::now(cluster).since(&cpu_before);
    got.sort_unstable();
    Measured { p50: pct(&got, 0.5), p99: pct(&got, 0.99), n: got.len(), cpu }
}

struct Measured {
    p50: f64,
    p99: f64,
    n: usize,
    cpu: Cpu,
}

/// CPU time used so far by the sidecars (all nodes) and by this process (the observers
/// and the publisher): per delivery, it shows who the two cores were busy for.
struct Cpu {
    sidecars: Duration,
    bench: Duration,
}

impl Cpu {
    fn now(cluster: &Cluster) -> Cpu {
        let used = |pid| localcluster::process::cpu_time(pid).unwrap_or_default();
        Cpu {
            sidecars: cluster.nodes.iter().map(|n| used(n.sidecar.pid())).sum(),
            bench: used(std::process::id()),
        }
    }

    fn since(&self, before: &Cpu) -> Cpu {
        Cpu { sidecars: self.sidecars - before.sidecars, bench: self.bench - before.bench }
    }

    /// Microseconds per delivery: (sidecars, this process).
    fn per(&self, n: usize) -> (f64, f64) {
        let per = |d: Duration| d.as_secs_f64() * 1e6 / n.max(1) as f64;
        (per(self.sidecars), per(self.bench))
    }
}

async fn claim_all(cluster: &Cluster, keys: &[String]) {
    fanout::claim_all(cluster, keys).await.unwrap();
}

/// The burst pace: one event every 2 ms per key (500 events/s), well past a model's rate.
const BURST: Duration = Duration::from_millis(2);

/// Where observers sit: node indices (node 0 owns every session) and a label.
type Placement = (&'static [usize], &'static str);

/// Name, sessions, observers per session, events, pace, placements.
type Scenario = (&'static str, usize, usize, usize, Duration, &'static [Placement]);

/// Rounds per scenario: each round runs every placement once (remote, then the owner
/// baseline), so drift on the shared machine hits both alike, as the hop bench does.
/// `LEASEHOLD_BENCH_ROUNDS` overrides.
const ROUNDS: usize = 3;

async fn latency(db: &str) {
    let rounds: usize = std::env::var("LEASEHOLD_BENCH_ROUNDS")
        .map_or(ROUNDS, |r| r.parse().expect("LEASEHOLD_BENCH_ROUNDS"));
    println!("## Publish → observer latency ({rounds} rounds, placements interleaved)\n");
    println!(
        "| scenario | pace | round | observers on | p50 ms | p99 ms | deliveries | sidecars CPU µs/delivery | observers+publisher CPU µs/delivery |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    const REMOTE_OR_LOCAL: &[Placement] =
        &[(&[1], "non-owner node (remote)"), (&[0], "owner node (baseline)")];
    const SPREAD: &[Placement] = &[(&[0, 1, 2], "all 3 nodes (2 of them remote)")];
    let scenarios: [Scenario; 6] = [
        ("1 session, 1 observer", 1, 1, 200, PACE, REMOTE_OR_LOCAL),
        ("1 session, 100 observers", 1, 100, 200, PACE, REMOTE_OR_LOCAL),
        ("1 session, 1000 observers", 1, 1000, 200, PACE, REMOTE_OR_LOCAL),
        ("1 session, 1000 observers", 1, 1000, 200, PACE, SPREAD),
        ("1 session, 1000 observers (burst)", 1, 1000, 200, BURST, REMOTE_OR_LOCAL),
        ("1000 sessions, 1 observer each", 1000, 1, 2000, BURST, REMOTE_OR_LOCAL),
    ];
    // `LEASEHOLD_BENCH_SCENARIO=3` runs only the fourth row (e.g. under a profiler).
    let only: Option<usize> = std::env::var("LEASEHOLD_BENCH_SCENARIO").ok().and_then(|s| s.parse().ok());
    for (sc, (name, sessions, per_key, events, pace, placements)) in scenarios.into_iter().enumerate() {
        if only.is_some_and(|only| only != sc) {
            continue;
        }
        let mut p99 = vec![0.0; placements.len()];
        for round in 0..rounds {
            for (at, (observe_on, place)) in placements.iter().enumerate() {
                let cluster = Cluster::start(db, bench_options()).await.unwrap();
                let keys: Vec<String> =
                    (0..sessions).map(|i| format!("obs-{sc}-{round}-{}-{i}", observe_on[0])).collect();
                claim_all(&cluster, &keys).await;
                let m = measure(&cluster, observe_on, &keys, per_key, events, pace).await;
                let (sidecars, bench) = m.cpu.per(m.n);
                p99[at] += m.p99 / rounds as f64;
                println!(
                    "| {name} | {pace:?} | {round} | {place} | {:.3} | {:.3} | {} | {sidecars:.1} | {bench:.1} |",
                    m.p50, m.p99, m.n
                );
            }
        }
        let means: Vec<String> =
            placements.iter().zip(&p99).map(|((_, place), p)| format!("{place} {p:.3} ms")).collect();
        println!("| {name} | {pace:?} | mean p99 | {} | | | | | |", means.join("; "));
    }
    println!();
}

/// As fast as the publisher can go, with 100 remote observers: deliveries per second.
async fn fan_out(db: &str) {
    let cluster = Cluster::start(db, bench_options()).await.unwrap();
    let key = vec!["fan".to_owned()];
    claim_all(&cluster, &key).await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    observers(&cluster.nodes[1].public_url(), &key, 100, &tx).await;
    observers(&cluster.nodes[0].public_url(), &key, 100, &tx).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    while rx.try_recv().is_ok() {}
    const EVENTS: usize = 3000;
    let started = Instant::now();
    let http = reqwest::Client::new();
    let agent = cluster.nodes[0].agent_api_url();
    futures_util::stream::iter(0..EVENTS)
        .for_each_concurrent(8, |_| {
            let (http, agent) = (http.clone(), agent.clone());
            async move { publish(&http, &agent, "fan", 1, "token").await }
        })
        .await;
    let published = started.elapsed();
    let mut delivered = 0;
    while delivered < EVENTS * 200 {
        match tokio::time::timeout(Duration::from_secs(5), rx.recv()).await {
            Ok(Some(_)) => delivered += 1,
            _ => break,
        }
    }
    let took = started.elapsed();
    println!("## Fan-out\n");
    println!(
        "{EVENTS} events published in {:.2}s ({:.0} events/s through the fenced publish); {delivered} deliveries to 200 observers (100 local, 100 remote) in {:.2}s: {:.0} deliveries/s\n",
        published.as_secs_f64(),
        EVENTS as f64 / published.as_secs_f64(),
        took.as_secs_f64(),
        delivered as f64 / took.as_secs_f64()
    );
}

async fn drain(db: &str) {
    println!("## Drain\n");
    println!("| leases held | POST /drain wall ms | hand_back_all statement ms | one release per lease ms | ratio |");
    println!("|---|---|---|---|---|");
    for n in [1_000usize, 10_000] {
        let cluster = Cluster::start(db, bench_options()).await.unwrap();
        let keys: Vec<String> = (0..n).map(|i| format!("d{n}-{i}")).collect();
        claim_all(&cluster, &keys).await;
        let started = Instant::now();
        let report = cluster.nodes[0].drain().await;
        let wall = started.elapsed();
        assert_eq!(report["handed_back"], n);
        // The statement alone, and the per-lease baseline, on a boot of our own.
        let store = LeaseStore::connect(db, 2).await.unwrap();
        let owner = Owner::new_boot(&format!("drain-bench-{n}"));
        store.register_boot(&owner, "127.0.0.1:1", Duration::from_secs(600)).await.unwrap();
        sqlx::query("UPDATE agent_leases SET owner = $1, released = false WHERE agent_key LIKE $2")
            .bind(owner.as_str())
            .bind(format!("d{n}-%"))
            .execute(store.pool())
            .await
            .unwrap();
        let t0 = Instant::now();
        assert_eq!(store.hand_back_all(&owner).await.unwrap(), n as u64);
        let statement = t0.elapsed();
        let owner2 = Owner::new_boot(&format!("drain-bench-{n}-b"));
        store.register_boot(&owner2, "127.0.0.1:1", Duration::from_secs(600)).await.unwrap();
        sqlx::query("UPDATE agent_leases SET owner = $1 WHERE agent_key LIKE $2")
            .bind(owner2.as_str())
            .bind(format!("d{n}-%"))
            .execute(store.pool())
            .await
            .unwrap();
        let t0 = Instant::now();
        for key in &keys {
            store.release(&SessionKey::parse(key).unwrap(), &owner2, Epoch(1)).await.unwrap();
        }
        let per_lease = t0.elapsed();
        println!(
            "| {n} | {:.1} | {:.1} | {:.1} | {:.0}x |",
            wall.as_secs_f64() * 1e3,
            statement.as_secs_f64() * 1e3,
            per_lease.as_secs_f64() * 1e3,
            per_lease.as_secs_f64() / statement.as_secs_f64()
        );
    }
    println!();
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

#[tokio::main]
async fn main() {
    if localcluster::trivial_agent::serve_if_requested().await {
        return;
    }
    let admin = std::env::var("DATABASE_URL").expect("DATABASE_URL: run with `make bench`");
    let db = localcluster::postgres::fresh_database(&admin).await.unwrap();
    let only = std::env::var("LEASEHOLD_BENCH_ONLY").unwrap_or_default();
    if only.is_empty() || only == "latency" {
        latency(&db).await;
    }
    if only.is_empty() || only == "fan-out" {
        fan_out(&db).await;
    }
    if only.is_empty() || only == "drain" {
        drain(&db).await;
    }
}
