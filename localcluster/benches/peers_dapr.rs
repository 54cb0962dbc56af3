//! Leasehold side by side with Dapr actors v1.14.0 (issue 20, part 1): the same work
//! through both systems, on this machine, in one run, on loopback (127.0.0.0/8) only.
//!
//! What runs (every process started here and killed by PID at the end, also on panic):
//! - leasehold: 3 nodes (`leasehold-sidecar` + the trivial agent each, localcluster's
//!   `Cluster`), lease TTL [`LEASE_TTL`], heartbeat [`HEARTBEAT`], peer proofs on;
//! - Dapr: the placement service (one member, in-memory Raft), 3 actor hosts (daprd +
//!   the trivial agent in its Dapr actor host role, app id `bench-host`, actor type
//!   `BenchActor`), and 1 client daprd with no app (app id `bench-client`), all with
//!   bench/peers/dapr/config.yaml and the PostgreSQL actor state store of
//!   bench/peers/dapr/resources on a database of their own on the same Postgres.
//!
//! Both systems' hosts run the same app binary (localcluster::trivial_agent): it answers
//! every call at once with its own address and records every call id it executes (and,
//! for Dapr, each actor activation and deactivation) so duplicates can be counted.
//!
//! (a) Hop latency: one call to a single-activation entity through two sidecars.
//!     - direct (the common baseline): client → the app (POST /sessions/{key}/turns);
//!     - leasehold: client → non-owner sidecar (node-b) → owner sidecar (node-a) → agent;
//!     - Dapr: client → client daprd (`POST /v1.0/actors/BenchActor/{id}/method/turn`)
//!       → the host daprd that placement gives the actor → its app.
//!
//!     [`ROUNDS`] rounds of [`ROUND`] per path at 1 and 16 closed-loop clients, paths
//!     interleaved within each round; p50/p90/p99 and calls/s, and the CPU (utime+stime
//!     from /proc) both sidecars of the path spent per call. "Added hop latency at p90" =
//!     path p90 − direct p90 (each the mean over the rounds).
//! (b) Failover: [`ENTITIES`] entities called continuously (one sequential caller per
//!     entity); `kill -9` of the host holding the most of them (leasehold: the owner's
//!     sidecar and agent; Dapr: the host's daprd and app); per entity it held, the time
//!     from the kill until a call for it is answered by another host. Then the host is
//!     started again. Failure detection: leasehold's node lease TTL [`LEASE_TTL`] renewed
//!     every [`HEARTBEAT`]; Dapr v1.14 has no flag for it: daprd reports to placement
//!     every 1 s, placement drops a host when its stream breaks (a killed process's
//!     socket is closed by the kernel, so at once) or its gRPC keepalive (2 s, timeout
//!     3 s) fails, and disseminates the new table 2 s after the last change
//!     (`disseminateTimeout`), all constants in pkg/placement and pkg/actors/placement.
//!     Run twice per system: the killed host stays down (time until served by another
//!     host), and the killed host is started again at once, as a kubelet restarts a
//!     crashed container (time until served by any host; leasehold's restarted sidecar
//!     revokes its earlier boot's leases when it registers, its operator-less path).
//! (c) Rolling restart of the three hosts under the same continuous load: each host in
//!     turn is stopped gracefully, started again and waited for (leasehold: `POST /drain`
//!     signed as the operator's preStop does, via `leasehold-sidecar drain`, then SIGTERM
//!     to sidecar and agent, restart, `/readyz`; Dapr: SIGTERM to daprd (it leaves
//!     placement and drains its actors, default 5 s graceful shutdown) and then the app,
//!     restart, daprd's `/v1.0/healthz`). Counted: calls failed (never succeeded within
//!     [`CALL_BUDGET`]), call ids executed more than once across all hosts, the worst
//!     per-entity gap between successful calls, and for Dapr, overlapping activations
//!     (an actor active on two hosts at once, from the apps' activation and deactivation
//!     records; a host stopped without deactivating counts as active until its stop).
//!
//! Clients: leasehold calls go through the shipped Rust client (sidecar crate, `client`
//! module) over the three nodes' public ports, as a load balancer would: an
//! `Idempotency-Key` per call and the documented retry directives (docs/http-api.md).
//! Dapr calls go through the client daprd, with the same call id in the body on every
//! attempt, retried after [`DAPR_RETRY_PAUSE`] on any error or non-2xx answer (each
//! attempt bounded by [`ATTEMPT_TIMEOUT`]), as a Dapr client with a retry policy would,
//! until [`CALL_BUDGET`].
//!
//! Run: `make bench-dapr` (builds Dapr once via scripts/ensure-dapr.sh; DATABASE_URL is
//! set by scripts/with-postgres.sh, which runs Postgres with fsync=off). Switches
//! (environment):
//! - `LEASEHOLD_BENCH_SCENARIOS=abc`: which scenarios run (default all three);
//! - `LEASEHOLD_BENCH_ROUND_SECS=N`: the length of one round of (a) (default 3);
//! - `LEASEHOLD_DAPR_BIN_DIR=dir`: where `daprd-v1.14.0` and `placement-v1.14.0` are
//!   (default ~/go/bin);
//! - `LEASEHOLD_BIN_DIR=dir`: where the leasehold binaries are (the release build).

use std::{
    collections::{BTreeMap, HashMap},
    net::Ipv4Addr,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use localcluster::{
    cluster::{next_ip, DEMO_AGENT_PORT},
    dapr::{self, DaprFiles, DaprNode},
    loadgen::{cpu_of_tree, load_with, ms, transactions, Stats},
    trivial_agent::{self, ACTOR_TYPE},
    Cluster, ClusterOptions, Proc,
};

const CONCURRENCY: [usize; 2] = [1, 16];
/// One round of load per path in (a); short, so rounds interleave often on a noisy machine.
const ROUND: Duration = Duration::from_secs(3);
const ROUNDS: usize = 3;
/// leasehold's node lease TTL in this bench: three heartbeats, the harness's default.
const LEASE_TTL: Duration = Duration::from_secs(3);
/// leasehold's heartbeat, equal to daprd's fixed 1 s report to placement.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// Entities called continuously in (b) and (c).
const ENTITIES: usize = 8;
/// A call that has not succeeded this long after its first attempt counts as failed
/// (leasehold's longest directive budgets are about this long too).
const CALL_BUDGET: Duration = Duration::from_secs(30);
/// One Dapr attempt: generous for a trivial call, short enough to retry a hung one.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause before a Dapr call is retried (Dapr's SDKs' retry policies start near this).
const DAPR_RETRY_PAUSE: Duration = Duration::from_millis(100);
/// Continuous load before the kill in (b) and before the first restart in (c).
const STEADY: Duration = Duration::from_secs(2);
/// (b) gives up waiting for the victim's entities after this long.
const FAILOVER_CAP: Duration = Duration::from_secs(60);
/// How long a graceful stop may take before the process is killed: past both systems'
/// drain and shutdown times (leasehold's drain timeout, daprd's 5 s graceful shutdown).
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// Warm-up: the first calls wait for placement's table and leasehold's claim.
const WARMUP_BUDGET: Duration = Duration::from_secs(60);

fn unix_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970").as_nanos()
}

/// The two systems under test, behind one interface for the callers of (b) and (c).
#[derive(Clone)]
enum System {
    Leasehold(Arc<leasehold_sidecar::client::Client>),
    /// The client daprd's HTTP API.
    Dapr(reqwest::Client, String),
}

/// How one logical call ended.
struct Outcome {
    ok: bool,
    /// The host that answered (the app's listen address).
    host: Option<String>,
    /// When it ended.
    at: Instant,
}

impl System {
    fn name(&self) -> &'static str {
        match self {
            System::Leasehold(_) => "leasehold",
            System::Dapr(..) => "Dapr",
        }
    }

    /// One logical call for `entity`, with its retries.
    async fn call(&self, entity: &str) -> Outcome {
        let body = serde_json::json!({ "call": uuid::Uuid::new_v4().simple().to_string() }).to_string();
        let host_of = |bytes: &[u8]| {
            serde_json::from_slice::<serde_json::Value>(bytes).ok()?["host"].as_str().map(str::to_owned)
        };
        match self {
            System::Leasehold(client) => {
                let path = format!("/v1/sessions/{entity}/turns");
                match client.post_keyed(&path, body.into(), None, None).await {
                    Ok(answer) if (200..300).contains(&answer.status) => {
                        Outcome { ok: true, host: host_of(&answer.body), at: Instant::now() }
                    }
                    _ => Outcome { ok: false, host: None, at: Instant::now() },
                }
            }
            System::Dapr(http, base) => {
                let url = format!("{base}/v1.0/actors/{ACTOR_TYPE}/{entity}/method/turn");
                let started = Instant::now();
                loop {
                    let sent = http.post(&url).body(body.clone()).timeout(ATTEMPT_TIMEOUT).send().await;
                    if let Ok(response) = sent {
                        if response.status().is_success() {
                            if let Ok(bytes) = response.bytes().await {
                                return Outcome { ok: true, host: host_of(&bytes), at: Instant::now() };
                            }
                        }
                    }
                    if started.elapsed() + DAPR_RETRY_PAUSE > CALL_BUDGET {
                        return Outcome { ok: false, host: None, at: Instant::now() };
                    }
                    tokio::time::sleep(DAPR_RETRY_PAUSE).await;
                }
            }
        }
    }

    /// Call until a call succeeds (startup: placement's first table, the first claim).
    async fn warm(&self, entity: &str) -> String {
        let deadline = Instant::now() + WARMUP_BUDGET;
        loop {
            let outcome = self.call(entity).await;
            if let (true, Some(host)) = (outcome.ok, outcome.host) {
                return host;
            }
            assert!(Instant::now() < deadline, "{}: {entity} never answered", self.name());
        }
    }
}

/// Continuous sequential callers, one per entity, until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    /// Per entity, every call's outcome in order.
    tasks: Vec<(String, tokio::task::JoinHandle<Vec<Outcome>>)>,
}

impl Load {
    fn start(system: &System, entities: &[String]) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = entities
            .iter()
            .map(|entity| {
                let (system, entity2, stop) = (system.clone(), entity.clone(), stop.clone());
                let task = tokio::spawn(async move {
                    let mut outcomes = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        outcomes.push(system.call(&entity2).await);
                    }
                    outcomes
                });
                (entity.clone(), task)
            })
            .collect();
        Load { stop, tasks }
    }

    async fn finish(self) -> BTreeMap<String, Vec<Outcome>> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = BTreeMap::new();
        for (entity, task) in self.tasks {
            all.insert(entity, task.await.expect("caller task"));
        }
        all
    }
}

/// What the load saw: calls, failures, worst gap between successes of one entity.
struct LoadReport {
    calls: usize,
    failed: usize,
    worst_gap: Duration,
}

fn report(outcomes: &BTreeMap<String, Vec<Outcome>>, since: Instant) -> LoadReport {
    let mut report = LoadReport { calls: 0, failed: 0, worst_gap: Duration::ZERO };
    for calls in outcomes.values() {
        report.calls += calls.len();
        report.failed += calls.iter().filter(|o| !o.ok).count();
        let mut last = since;
        for o in calls.iter().filter(|o| o.ok) {
            report.worst_gap = report.worst_gap.max(o.at.saturating_duration_since(last));
            last = o.at;
        }
    }
    report
}

/// From the apps' records under `dir`, of the entities named `prefix…`: call ids
/// executed more than once (extra executions), and overlapping activations (count,
/// longest), a process stopped without deactivating an actor counting it active until
/// `stopped_at[process]` (or now, if it still runs).
fn records(dir: &Path, prefix: &str, stopped_at: &HashMap<String, u128>) -> (usize, usize, Duration) {
    let mut events = trivial_agent::read_records(dir).expect("read the call records");
    events.retain(|e| e.entity.starts_with(prefix));
    let (overlaps, longest) = trivial_agent::overlapping_activations(&events, stopped_at, unix_ns());
    (trivial_agent::extra_executions(&events), overlaps, longest)
}

/// The record file stem of the app listening on `ip` with `pid` (see trivial_agent).
fn record_name(ip: Ipv4Addr, pid: u32) -> String {
    format!("{ip}:{DEMO_AGENT_PORT}-{pid}")
}

struct Everything {
    cluster: Cluster,
    placement: Proc,
    placement_ip: Ipv4Addr,
    hosts: Vec<DaprNode>,
    client: DaprNode,
    lh_records: PathBuf,
    dapr_records: PathBuf,
    /// Per app record file, when the bench stopped that app.
    stopped_at: HashMap<String, u128>,
    /// leasehold's database and Dapr's.
    databases: [String; 2],
}

impl Everything {
    fn leasehold(&self) -> System {
        System::Leasehold(Arc::new(self.cluster.client()))
    }

    fn dapr(&self) -> System {
        System::Dapr(reqwest::Client::builder().tcp_nodelay(true).build().unwrap(), self.client.http_url())
    }

    fn note_lh_stop(&mut self, i: usize) {
        let node = &self.cluster.nodes[i];
        self.stopped_at.insert(record_name(node.ip, node.agent.pid()), unix_ns());
    }

    fn note_dapr_stop(&mut self, i: usize) {
        let host = &self.hosts[i];
        let pid = host.app.as_ref().expect("a host has an app").pid();
        self.stopped_at.insert(record_name(host.ip, pid), unix_ns());
    }
}

async fn start(admin_url: &str, logs: &Path) -> Everything {
    // The apps' call records, beside the logs (kept with them).
    let (lh_records, dapr_records) = (logs.join("records-leasehold"), logs.join("records-dapr"));
    std::fs::create_dir_all(&lh_records).unwrap();
    std::fs::create_dir_all(&dapr_records).unwrap();
    let lh_db = localcluster::postgres::fresh_database(admin_url).await.unwrap();
    let dapr_db = localcluster::postgres::fresh_database(admin_url).await.unwrap();
    let options = ClusterOptions {
        nodes: 3,
        lease_ttl: LEASE_TTL,
        heartbeat: HEARTBEAT,
        agent_command: Some(trivial_agent::recording_command(&lh_records)),
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start(&lh_db, options).await.unwrap();
    let files = DaprFiles::write(logs, &dapr_db).unwrap();
    let placement_ip = next_ip();
    let mut placement = dapr::start_placement(placement_ip, logs);
    dapr::wait_placement(placement_ip, &mut placement).await.unwrap();
    let app = trivial_agent::recording_command(&dapr_records);
    let mut hosts: Vec<DaprNode> = (0..3)
        .map(|i| {
            let name = format!("dapr-host-{i}");
            DaprNode::start(&name, "bench-host", next_ip(), placement_ip, &files, Some(app.clone()), logs)
        })
        .collect();
    let mut client =
        DaprNode::start("dapr-client", "bench-client", next_ip(), placement_ip, &files, None, logs);
    for node in hosts.iter_mut().chain([&mut client]) {
        node.wait_ready().await.unwrap_or_else(|e| panic!("{}: {e:#}", node.name));
    }
    for host in &mut hosts {
        host.wait_serving(placement_ip).await.unwrap_or_else(|e| panic!("{}: {e:#}", host.log_tail()));
    }
    Everything {
        cluster,
        placement,
        placement_ip,
        hosts,
        client,
        lh_records,
        dapr_records,
        stopped_at: HashMap::new(),
        databases: [lh_db, dapr_db],
    }
}

/// (a): the hop, both systems and the direct baseline, rounds interleaved.
async fn hop(all: &Everything, round: Duration) -> Vec<(usize, [Duration; 3], [f64; 3])> {
    let entity = "hop-entity";
    let (owner, other) = (&all.cluster.nodes[0], &all.cluster.nodes[1]);
    // node-a claims the session with the first turn; from here its lease is fresh.
    let first = reqwest::Client::new()
        .post(format!("{}/v1/sessions/{entity}/turns", owner.public_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(first.headers()["leasehold-owner"], "node-a");
    let dapr_host = all.dapr().warm(entity).await;
    let host = all.hosts.iter().find(|h| dapr_host.starts_with(&h.ip.to_string())).expect("a known host");
    let direct = format!("http://{}:{DEMO_AGENT_PORT}/sessions/{entity}/turns", owner.ip);
    let paths: [(&str, String, Vec<u32>); 3] = [
        ("direct to the app", direct, vec![]),
        (
            "leasehold: non-owner → owner sidecar",
            format!("{}/v1/sessions/{entity}/turns", other.public_url()),
            vec![other.sidecar.pid(), owner.sidecar.pid()],
        ),
        (
            "Dapr: client daprd → host daprd",
            format!("{}/v1.0/actors/{ACTOR_TYPE}/{entity}/method/turn", all.client.http_url()),
            vec![all.client.daprd.pid(), host.daprd.pid()],
        ),
    ];
    let mut summary = Vec::new();
    // Per path: calls, both sidecars' CPU, the system's Postgres transactions.
    let mut cpu = [(0usize, Duration::ZERO, 0i64); 3];
    for concurrency in CONCURRENCY {
        println!("### (a) {concurrency} concurrent client(s), {ROUNDS} rounds of {round:?} per path, interleaved\n");
        println!("| round | path | p50 ms | p90 ms | p99 ms | calls/s |");
        println!("|---|---|---|---|---|---|");
        let mut p90 = [Duration::ZERO; 3];
        let mut rate = [0.0; 3];
        for r in 0..ROUNDS {
            for (i, (name, url, pids)) in paths.iter().enumerate() {
                let db = (i > 0).then(|| &all.databases[i - 1]);
                let txns_before = match db {
                    Some(db) => transactions(db).await,
                    None => 0,
                };
                let before: Duration = pids.iter().map(|p| cpu_of_tree(*p)).sum();
                let s: Stats =
                    load_with(reqwest::Method::POST, url, r#"{"text":"hi"}"#, concurrency, round).await;
                let after: Duration = pids.iter().map(|p| cpu_of_tree(*p)).sum();
                if let Some(db) = db {
                    cpu[i].2 += transactions(db).await - txns_before - 1; // minus our own reading
                }
                cpu[i].0 += s.n;
                cpu[i].1 += after.saturating_sub(before);
                p90[i] += s.p90 / ROUNDS as u32;
                rate[i] += s.per_sec / ROUNDS as f64;
                println!(
                    "| {r} | {name} | {} | {} | {} | {:.0} |",
                    ms(s.p50),
                    ms(s.p90),
                    ms(s.p99),
                    s.per_sec
                );
            }
        }
        let added = |i: usize| p90[i].saturating_sub(p90[0]);
        println!(
            "\nMean p90: direct {} ms, leasehold {} ms, Dapr {} ms. Added hop latency at p90: leasehold {} ms, Dapr {} ms; ours / Dapr's = {:.3} (target <= 0.333). calls/s: direct {:.0}, leasehold {:.0}, Dapr {:.0}\n",
            ms(p90[0]),
            ms(p90[1]),
            ms(p90[2]),
            ms(added(1)),
            ms(added(2)),
            added(1).as_secs_f64() / added(2).as_secs_f64(),
            rate[0],
            rate[1],
            rate[2]
        );
        summary.push((concurrency, p90, rate));
    }
    println!("### (a) Per call: CPU of the path's two sidecars (utime + stime) and Postgres transactions of the system's database (heartbeats included), all rounds\n");
    println!("| path | calls | both sidecars µs/call | Postgres transactions/call |");
    println!("|---|---|---|---|");
    for (i, (name, _, _)) in paths.iter().enumerate().skip(1) {
        let (n, used, txns) = cpu[i];
        println!(
            "| {name} | {n} | {:.1} | {:.3} |",
            used.as_secs_f64() * 1e6 / n as f64,
            txns as f64 / n as f64
        );
    }
    println!();
    summary
}

fn entities(prefix: &str) -> Vec<String> {
    (0..ENTITIES).map(|i| format!("{prefix}-{i}")).collect()
}

/// (b) for one system: how many entities the killed host held, per such entity the time
/// until it was served elsewhere (`restart_at_once`: the host is started again right
/// after the kill, as a kubelet restarts a container, and any host serving it counts),
/// the load's report, duplicates.
async fn failover(
    all: &mut Everything,
    leasehold: bool,
    restart_at_once: bool,
) -> (usize, Vec<Duration>, LoadReport, usize) {
    let system = if leasehold { all.leasehold() } else { all.dapr() };
    let prefix = match (leasehold, restart_at_once) {
        (true, false) => "fo-lh",
        (false, false) => "fo-dapr",
        (true, true) => "fr-lh",
        (false, true) => "fr-dapr",
    };
    let names = entities(prefix);
    let mut holder = HashMap::new();
    for entity in &names {
        if leasehold {
            // Every session claimed by node-a: its first turn lands there.
            let client = all.cluster.client();
            let path = format!("/v1/sessions/{entity}/turns");
            let answer = client.post(&path, r#"{"text":"claim"}"#.into(), Some(0)).await.unwrap();
            assert_eq!(answer.owner.as_deref(), Some("node-a"), "{entity}");
        }
        holder.insert(entity.clone(), system.warm(entity).await);
    }
    let ips: Vec<Ipv4Addr> = if leasehold {
        all.cluster.nodes.iter().map(|n| n.ip).collect()
    } else {
        all.hosts.iter().map(|h| h.ip).collect()
    };
    let index_of =
        |host: &str| ips.iter().position(|ip| host.starts_with(&format!("{ip}:"))).expect("known host");
    let mut held = [0usize; 3];
    for host in holder.values() {
        held[index_of(host)] += 1;
    }
    let victim = (0..3).max_by_key(|i| held[*i]).unwrap();
    let victims: Vec<&String> = names.iter().filter(|e| index_of(&holder[*e]) == victim).collect();
    let load = Load::start(&system, &names);
    tokio::time::sleep(STEADY).await;
    let killed = Instant::now();
    if leasehold {
        all.note_lh_stop(victim);
        all.cluster.nodes[victim].kill9();
    } else {
        all.note_dapr_stop(victim);
        all.hosts[victim].kill9();
    }
    if restart_at_once {
        spawn_host(all, leasehold, victim);
    }
    // Wait until every victim entity was served by another host (or the cap).
    let deadline = killed + FAILOVER_CAP;
    let victim_ip = format!("{}:", ips[victim]);
    let served_elsewhere = |entity: &str| {
        let system = system.clone();
        let (entity, victim_ip) = (entity.to_owned(), victim_ip.clone());
        async move {
            // A probe through the same client path: answered by another host?
            let o = system.call(&entity).await;
            o.ok && o.host.is_some_and(|h| restart_at_once || !h.starts_with(&victim_ip))
        }
    };
    // The load's own outcomes decide the times; the probe only tells when to stop.
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut all_moved = true;
        for e in &victims {
            if !served_elsewhere(e).await {
                all_moved = false;
                break;
            }
        }
        if all_moved || Instant::now() > deadline {
            break;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let outcomes = load.finish().await;
    let times = victims
        .iter()
        .map(|e| {
            outcomes[*e]
                .iter()
                .find(|o| {
                    o.ok && o.at > killed
                        && o.host.as_deref().is_some_and(|h| restart_at_once || !h.starts_with(&victim_ip))
                })
                .map_or(FAILOVER_CAP, |o| o.at - killed)
        })
        .collect();
    let rep = report(&outcomes, killed - STEADY);
    // The host comes back (for the next scenario).
    restart_host(all, leasehold, victim, !restart_at_once).await;
    let dir = if leasehold { &all.lh_records } else { &all.dapr_records };
    let (duplicates, _, _) = records(dir, prefix, &all.stopped_at);
    (held[victim], times, rep, duplicates)
}

/// Start host `i`'s processes again (after a kill or a stop), without waiting.
fn spawn_host(all: &mut Everything, leasehold: bool, i: usize) {
    if leasehold {
        let node = &mut all.cluster.nodes[i];
        node.restart_agent();
        node.restart_sidecar();
    } else {
        all.hosts[i].restart();
    }
}

/// Start host `i` again (`spawn`; else it already was) and wait until it is ready.
async fn restart_host(all: &mut Everything, leasehold: bool, i: usize, spawn: bool) {
    if spawn {
        spawn_host(all, leasehold, i);
    }
    if leasehold {
        all.cluster.nodes[i].wait_ready().await.unwrap();
    } else {
        let placement = all.placement_ip;
        let host = &mut all.hosts[i];
        host.wait_serving(placement).await.unwrap_or_else(|e| panic!("{}: {e:#}", host.log_tail()));
    }
}

/// (c) for one system: the load's report, duplicates, overlapping activations.
async fn rolling(all: &mut Everything, leasehold: bool) -> (LoadReport, usize, usize, Duration, Duration) {
    let system = if leasehold { all.leasehold() } else { all.dapr() };
    let prefix = if leasehold { "rr-lh" } else { "rr-dapr" };
    let names = entities(prefix);
    for entity in &names {
        system.warm(entity).await;
    }
    let load = Load::start(&system, &names);
    tokio::time::sleep(STEADY).await;
    let started = Instant::now();
    for i in 0..3 {
        if leasehold {
            all.cluster.nodes[i].drain().await;
            all.note_lh_stop(i);
            let node = &mut all.cluster.nodes[i];
            if node.sidecar.terminate(STOP_TIMEOUT).is_none() {
                node.sidecar.kill9();
            }
            if node.agent.terminate(STOP_TIMEOUT).is_none() {
                node.agent.kill9();
            }
        } else {
            all.note_dapr_stop(i);
            all.hosts[i].terminate(STOP_TIMEOUT);
        }
        restart_host(all, leasehold, i, true).await;
    }
    let took = started.elapsed();
    tokio::time::sleep(STEADY).await;
    let outcomes = load.finish().await;
    let rep = report(&outcomes, started - STEADY);
    let dir = if leasehold { &all.lh_records } else { &all.dapr_records };
    let (duplicates, overlaps, longest) = records(dir, prefix, &all.stopped_at);
    (rep, duplicates, overlaps, longest, took)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    if trivial_agent::serve_if_requested().await {
        return;
    }
    let admin = std::env::var("DATABASE_URL").expect("DATABASE_URL: run with `make bench-dapr`");
    let scenarios = std::env::var("LEASEHOLD_BENCH_SCENARIOS").unwrap_or_else(|_| "abc".to_owned());
    let round = std::env::var("LEASEHOLD_BENCH_ROUND_SECS")
        .map_or(ROUND, |s| Duration::from_secs(s.parse().expect("LEASEHOLD_BENCH_ROUND_SECS")));
    let logs = tempfile::Builder::new().prefix("peers-dapr.").tempdir().unwrap();
    let mut all = start(&admin, logs.path()).await;
    println!(
        "Settings: leasehold lease TTL {LEASE_TTL:?}, heartbeat {HEARTBEAT:?}, peer proofs on; Dapr {} (placement: 1 s daprd reports, stream break or 2 s/3 s keepalive, 2 s disseminateTimeout; fixed in v1.14); {ENTITIES} entities in (b) and (c); call budget {CALL_BUDGET:?}; Dapr retry pause {DAPR_RETRY_PAUSE:?}, attempt timeout {ATTEMPT_TIMEOUT:?}. Logs: {}\n",
        dapr::DAPR_VERSION,
        logs.path().display()
    );
    let _keep =
        if std::env::var_os("LEASEHOLD_BENCH_KEEP_LOGS").is_some() { Some(logs.keep()) } else { None };
    if scenarios.contains('a') {
        hop(&all, round).await;
    }
    if scenarios.contains('b') {
        println!("### (b) Failover after kill -9 of the host holding the most entities\n");
        println!("| system | killed host | entities on it | served again after: median | max | calls | failed | ran twice |");
        println!("|---|---|---|---|---|---|---|---|");
        for (restart_at_once, leasehold) in [(false, true), (false, false), (true, true), (true, false)] {
            let (held, times, rep, dups) = failover(&mut all, leasehold, restart_at_once).await;
            println!(
                "| {} | {} | {held} of {ENTITIES} | {} ms | {} ms | {} | {} | {dups} |",
                if leasehold { "leasehold" } else { "Dapr" },
                if restart_at_once {
                    "restarted at once (served anywhere)"
                } else {
                    "stays down (served elsewhere)"
                },
                ms(median(times.clone())),
                ms(*times.iter().max().unwrap()),
                rep.calls,
                rep.failed
            );
        }
        println!();
    }
    if scenarios.contains('c') {
        println!("### (c) Rolling restart of the three hosts under continuous load\n");
        println!("| system | calls | failed | ran twice | overlapping activations (longest) | worst per-entity gap | restart of 3 hosts took |");
        println!("|---|---|---|---|---|---|---|");
        for leasehold in [true, false] {
            let (rep, dups, overlaps, longest, took) = rolling(&mut all, leasehold).await;
            let overlaps = if leasehold {
                "not recorded".to_owned()
            } else {
                format!("{overlaps} ({} ms)", ms(longest))
            };
            println!(
                "| {} | {} | {} | {dups} | {overlaps} | {} ms | {:.1} s |",
                if leasehold { "leasehold" } else { "Dapr" },
                rep.calls,
                rep.failed,
                ms(rep.worst_gap),
                took.as_secs_f64()
            );
        }
        println!();
    }
    // Everything is stopped by PID: the Procs' Drop (clients first, then the hosts).
    drop(all.client);
    drop(all.hosts);
    drop(all.placement);
    drop(all.cluster);
}
