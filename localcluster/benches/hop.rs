//! The cost of the data plane, every path measured in the same run, rounds interleaved:
//! (a) client → trivial agent directly;
//! (b) client → owner's sidecar → agent (local dispatch, lease fresh);
//! (c) client → non-owner sidecar → owner's sidecar → agent (one authenticated hop);
//! (d) client → nginx (plain reverse proxy) → owner's sidecar → agent: the same hop as
//!     (c), with nginx in place of our forwarding sidecar;
//! (e) the same hop through the thinnest hyper proxy (localcluster::bare_proxy): what
//!     hyper and tokio alone cost, so (c) / (e) is what our forwarding adds.
//! Also counts database transactions and the owner's fast-path resolutions during path
//! (b), and the CPU time each forwarder ((c) our non-owner sidecar, (d) nginx's master and
//! workers, (e) the bare proxy) and the owner's sidecar spend per turn of their path
//! (utime + stime from `/proc`, read before and after each path's load).
//!
//! Run: `make bench` (needs nginx: `apt-get install nginx-light`; DATABASE_URL is set by
//! scripts/with-postgres.sh). Switches (environment):
//! - `LEASEHOLD_BENCH_PATH=c LEASEHOLD_BENCH_CLIENTS=16 LEASEHOLD_BENCH_ROUND_SECS=20`:
//!   hold one path under a profiler;
//! - `LEASEHOLD_BENCH_PROOFS=off`: every sidecar `--insecure-peer` (no peer proof), and
//!   nginx (d) and the bare proxy (e) sent to the owner's *peer* port (`/peer/v1/…`), so
//!   all three hops reach the same unauthenticated listener;
//! - `LEASEHOLD_BENCH_FORWARDER_THREADS=N`: only the forwarding sidecar (node-b, path (c))
//!   on N runtime threads (`LEASEHOLD_WORKER_THREADS`); to put every sidecar on N, set
//!   `LEASEHOLD_WORKER_THREADS=N` itself (the sidecars inherit it).

use std::{net::Ipv4Addr, time::Duration};

use localcluster::{
    cluster::{PEER_PORT, PUBLIC_PORT},
    loadgen::{cpu_of_tree, load, ms, transactions},
    Cluster, ClusterOptions, Node, Proc,
};

const CONCURRENCY: [usize; 2] = [1, 16];
const ROUND: Duration = Duration::from_secs(3);
const ROUNDS: usize = 3;
const NGINX_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 31);
/// Where the bare hyper proxy baseline (e) listens.
const BARE_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 32);
const SESSION: &str = "bench-session";

/// `LEASEHOLD_BENCH_*` settings: run one path, one client count, longer rounds; proofs
/// off; the forwarder's runtime threads.
struct Only {
    path: Option<char>,
    clients: Option<usize>,
    round: Duration,
    proofs: bool,
    forwarder_threads: Option<u16>,
}

impl Only {
    fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok();
        Only {
            path: var("LEASEHOLD_BENCH_PATH").and_then(|p| p.chars().next()),
            clients: var("LEASEHOLD_BENCH_CLIENTS").map(|c| c.parse().expect("LEASEHOLD_BENCH_CLIENTS")),
            round: var("LEASEHOLD_BENCH_ROUND_SECS")
                .map_or(ROUND, |s| Duration::from_secs(s.parse().expect("LEASEHOLD_BENCH_ROUND_SECS"))),
            proofs: match var("LEASEHOLD_BENCH_PROOFS").as_deref() {
                None | Some("on") => true,
                Some("off") => false,
                Some(other) => panic!("LEASEHOLD_BENCH_PROOFS is on or off, not {other:?}"),
            },
            forwarder_threads: var("LEASEHOLD_BENCH_FORWARDER_THREADS")
                .map(|n| n.parse().expect("LEASEHOLD_BENCH_FORWARDER_THREADS")),
        }
    }

    fn all_paths(&self) -> bool {
        self.path.is_none()
    }
}

fn start_nginx(upstream: std::net::SocketAddr, dir: &std::path::Path) -> Proc {
    let conf = format!(
        "worker_processes auto;\npid {dir}/nginx.pid;\nerror_log {dir}/error.log;\nevents {{ worker_connections 1024; }}\n\
         http {{\n  access_log off;\n  upstream owner {{ server {upstream}; keepalive 64; }}\n\
           server {{\n    listen {NGINX_IP}:{PUBLIC_PORT};\n    location / {{\n      proxy_pass http://owner;\n\
               proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n",
        dir = dir.display()
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf).unwrap();
    let mut cmd = std::process::Command::new("nginx");
    cmd.args(["-p", &dir.to_string_lossy(), "-c", &path.to_string_lossy(), "-g", "daemon off;"]);
    Proc::spawn("nginx", cmd, &dir.join("stdout.log"))
        .expect("nginx is installed (apt-get install nginx-light)")
}

/// The owner's fast-path resolutions so far (a counter of every path that reaches it).
async fn fast_path(owner: &Node) -> f64 {
    owner.metric("leasehold_resolutions_total", "fast_path").await
}

#[tokio::main]
async fn main() {
    if localcluster::trivial_agent::serve_if_requested().await
        || localcluster::bare_proxy::serve_if_requested().await
    {
        return;
    }
    let admin = std::env::var("DATABASE_URL").expect("DATABASE_URL: run with `make bench`");
    let db = localcluster::postgres::fresh_database(&admin).await.unwrap();
    let only = Only::from_env();
    let forwarder_env = only
        .forwarder_threads
        .map(|n| vec![("LEASEHOLD_WORKER_THREADS".to_owned(), n.to_string())])
        .unwrap_or_default();
    let options = ClusterOptions {
        nodes: 2,
        lease_ttl: Duration::from_secs(15),
        heartbeat: Duration::from_secs(5),
        agent_command: Some(localcluster::trivial_agent::command()),
        sidecar_env: vec![Vec::new(), forwarder_env],
        ..ClusterOptions::default()
    };
    let options = if only.proofs { options } else { ClusterOptions { cluster_secret: None, ..options } };
    let cluster = Cluster::start(&db, options).await.unwrap();
    let (owner, other) = (&cluster.nodes[0], &cluster.nodes[1]);
    // With proofs off, nginx and the bare proxy reach the owner's peer port, as (c) does.
    let (upstream_port, baseline_prefix) = if only.proofs { (PUBLIC_PORT, "") } else { (PEER_PORT, "/peer") };
    let upstream = (owner.ip, upstream_port).into();
    let nginx_dir = tempfile::tempdir().unwrap();
    let mut nginx = start_nginx(upstream, nginx_dir.path());
    let bare_cmd = localcluster::bare_proxy::command((BARE_IP, PUBLIC_PORT).into(), upstream);
    let mut bare = Proc::spawn("bare-proxy", bare_cmd, &nginx_dir.path().join("bare.log")).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The owner claims the session once; from here its lease is fresh.
    let first = reqwest::Client::new()
        .post(format!("{}/v1/sessions/{SESSION}/turns", owner.public_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(first.headers()["leasehold-owner"], "node-a");

    let turns = format!("/v1/sessions/{SESSION}/turns");
    let paths: [(&str, String); 5] = [
        (
            "(a) direct to agent",
            format!(
                "http://{}:{}/sessions/{SESSION}/turns",
                owner.ip,
                localcluster::cluster::DEMO_AGENT_PORT
            ),
        ),
        ("(b) owner sidecar", format!("{}{turns}", owner.public_url())),
        ("(c) non-owner sidecar, one hop", format!("{}{turns}", other.public_url())),
        (
            "(d) nginx hop to owner sidecar",
            format!("http://{NGINX_IP}:{PUBLIC_PORT}{baseline_prefix}{turns}"),
        ),
        ("(e) bare hyper proxy hop", format!("http://{BARE_IP}:{PUBLIC_PORT}{baseline_prefix}{turns}")),
    ];
    // The process that forwards on each path ((a) and (b) have none) and the owner's sidecar.
    let forwarders: [Option<u32>; 5] =
        [None, None, Some(other.sidecar.pid()), Some(nginx.pid()), Some(bare.pid())];
    let owner_pid = owner.sidecar.pid();
    println!(
        "Peer proofs {}; forwarding sidecar threads: {}\n",
        if only.proofs { "on" } else { "off (--insecure-peer; (d) and (e) to the owner's peer port)" },
        only.forwarder_threads.map_or("default (one per core)".to_owned(), |n| n.to_string())
    );
    let round_time = only.round;
    let (mut b_turns, mut b_txns, mut b_fast) = (0usize, 0i64, 0.0);
    // Per path, over every round and client count: turns, forwarder CPU, owner CPU.
    let mut cpu = [(0usize, Duration::ZERO, Duration::ZERO); 5];
    for concurrency in CONCURRENCY.into_iter().filter(|c| only.clients.is_none_or(|n| n == *c)) {
        println!("## Data plane: {concurrency} concurrent client(s), {ROUNDS} rounds of {round_time:?} per path, interleaved\n");
        println!("| round | path | p50 ms | p90 ms | p99 ms | turns/s |");
        println!("|---|---|---|---|---|---|");
        let mut p90 = [Duration::ZERO; 5];
        let mut rate = [0.0; 5];
        for round in 0..ROUNDS {
            for (i, (name, url)) in paths.iter().enumerate() {
                if only.path.is_some_and(|p| !name.starts_with(&format!("({p})"))) {
                    continue;
                }
                let before = if i == 1 { transactions(&db).await } else { 0 };
                let fast_before = if i == 1 { fast_path(owner).await } else { 0.0 };
                let (forwarder_before, owner_before) =
                    (forwarders[i].map(cpu_of_tree), cpu_of_tree(owner_pid));
                let s = load(url, concurrency, round_time).await;
                cpu[i].0 += s.n;
                cpu[i].1 += forwarders[i]
                    .map(cpu_of_tree)
                    .zip(forwarder_before)
                    .map_or(Duration::ZERO, |(a, b)| a - b);
                cpu[i].2 += cpu_of_tree(owner_pid) - owner_before;
                if i == 1 {
                    b_txns += transactions(&db).await - before - 1; // minus our own read
                    b_fast += fast_path(owner).await - fast_before;
                    b_turns += s.n;
                }
                p90[i] += s.p90 / ROUNDS as u32;
                rate[i] += s.per_sec / ROUNDS as f64;
                println!(
                    "| {round} | {name} | {} | {} | {} | {:.0} |",
                    ms(s.p50),
                    ms(s.p90),
                    ms(s.p99),
                    s.per_sec
                );
            }
        }
        if !only.all_paths() {
            continue;
        }
        println!(
            "\nMean p90 over rounds: (a) {} (b) {} (c) {} (d) {} ms",
            ms(p90[0]),
            ms(p90[1]),
            ms(p90[2]),
            ms(p90[3])
        );
        println!(
            "Added by our hop, (c) - (a) at p90: {} ms (target <= 0.5 ms)",
            ms(p90[2].saturating_sub(p90[0]))
        );
        println!(
            "Baseline: the bare hyper proxy's hop vs nginx's, (e) / (d) at p90: {:.3}; ours vs the bare proxy, (c) / (e): {:.3}",
            p90[4].as_secs_f64() / p90[3].as_secs_f64(),
            p90[2].as_secs_f64() / p90[4].as_secs_f64()
        );
        println!("Added by the owner sidecar, (b) - (a) at p90: {} ms", ms(p90[1].saturating_sub(p90[0])));
        println!(
            "Our hop vs nginx's hop, (c) / (d) at p90: {:.3} (target <= 1.0); throughput (c)/(d): {:.3}\n",
            p90[2].as_secs_f64() / p90[3].as_secs_f64(),
            rate[2] / rate[3]
        );
    }
    if b_turns > 0 {
        println!(
            "Path (b): {b_turns} turns, {b_txns} database transactions in that time ({:.4} per turn, heartbeats included), {b_fast} fast-path resolutions on the owner during (b)",
            b_txns as f64 / b_turns as f64
        );
        let fast = fast_path(owner).await;
        let claims = owner.metric("leasehold_resolutions_total", "").await - fast;
        println!(
            "Owner over the whole run, every path ((b)-(e) all reach it): {fast} fast-path resolutions, {claims} claims\n"
        );
    }
    println!("## CPU per turn (utime + stime during each path's load, all rounds)\n");
    println!("| path | turns | forwarder µs/turn | owner sidecar µs/turn |");
    println!("|---|---|---|---|");
    for (i, (name, _)) in paths.iter().enumerate() {
        let (n, forwarder, owner_cpu) = cpu[i];
        if n == 0 {
            continue;
        }
        let per = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1e6 / n as f64);
        let forwarder = forwarders[i].map_or("-".to_owned(), |_| per(forwarder));
        println!("| {name} | {n} | {forwarder} | {} |", per(owner_cpu));
    }
    println!();
    // SIGTERM lets the nginx master stop its workers (SIGKILL would orphan them).
    nginx.terminate(Duration::from_secs(5));
    bare.terminate(Duration::from_secs(1));
    drop(cluster);
}
