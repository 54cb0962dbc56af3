//! A node under floods of connections and streams stays bounded and ready: past its caps
//! it answers `503 overloaded` with a retry directive and queues nothing; observers of
//! idle sessions cost the database no periodic reads.

mod support;

use std::time::{Duration, Instant};

use localcluster::{Cluster, ClusterOptions, Node};
use serde_json::json;
use sqlx::Connection;

const MAX_CONNECTIONS: usize = 300;
const MAX_STREAMS: usize = 200;
const MAX_STREAMS_PER_SESSION: usize = 50;
/// Fewer transactions than this in a second: the set-up's effects are over (heartbeats
/// alone are 4 a second here).
const QUIET_PER_SECOND: i64 = 20;

fn limited() -> Vec<(String, String)> {
    [
        ("LEASEHOLD_MAX_CONNECTIONS", MAX_CONNECTIONS),
        ("LEASEHOLD_MAX_STREAMS", MAX_STREAMS),
        ("LEASEHOLD_MAX_STREAMS_PER_SESSION", MAX_STREAMS_PER_SESSION),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_string()))
    .to_vec()
}

/// The kubelet's probes must be answered within this of a flood of idle admin
/// connections: well under the 10 s the flood would hold the connection cap for (the
/// sidecar's header-read timeout), and within a probe's default timeout plus a retry.
const PROBES_ANSWERED_WITHIN: Duration = Duration::from_secs(4);

/// Longest a Postgres 15 backend holds its statistics before reporting them once idle
/// (PGSTAT_IDLE_INTERVAL, 10 s), and a second more.
const STATS_FLUSH: std::time::Duration = std::time::Duration::from_secs(11);

/// Open a stream of `key` on `node`: the response (streaming, kept open while held).
async fn stream(http: &reqwest::Client, node: &Node, key: &str) -> reqwest::Response {
    http.get(format!("{}/v1/sessions/{key}/stream", node.public_url())).send().await.unwrap()
}

/// Raise this test process's open-file limit to its hard limit: the floods below hold
/// thousands of sockets at once.
fn raise_fd_limit(needed: u64) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).expect("setrlimit NOFILE to the hard limit");
    }
    assert!(hard >= needed, "RLIMIT_NOFILE hard limit {hard} < {needed}: raise it to run this test");
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

/// Connections waiting in the accept queue of the listener on `ip:port`, as the kernel
/// reports it for a listening socket (`rx_queue` in `/proc/net/tcp`): 0 once the process
/// has accepted every connection made to it.
fn accept_backlog(ip: std::net::Ipv4Addr, port: u16) -> usize {
    let local = format!("{:08X}:{port:04X}", u32::from_ne_bytes(ip.octets()));
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let listener = table
        .lines()
        .skip(1)
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 4 && f[1] == local && f[3] == "0A")
        .unwrap_or_else(|| panic!("no listener on {ip}:{port} in /proc/net/tcp"));
    let (_, rx_queue) = listener[4].split_once(':').unwrap();
    usize::from_str_radix(rx_queue, 16).unwrap()
}

/// Connections over a listener's cap answered `overloaded` at once, each for at most
/// ~1.3 s (200 ms for a request head, 1 s to write, 100 ms linger): the sidecar's
/// MAX_REFUSALS_IN_FLIGHT, so at most this many extra descriptors...
const REFUSALS_IN_FLIGHT: usize = 256;
/// ...and all of them closed within this: their 1.3 s, with slack for a loaded machine.
const REFUSALS_SETTLE: Duration = Duration::from_secs(5);
/// How often the settling descriptors are counted.
const FDS_POLL: Duration = Duration::from_millis(50);

async fn transactions(db: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
        .fetch_one(db)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn floods_of_streams_and_connections_are_refused_with_a_directive_and_stay_bounded() {
    const SESSIONS: usize = 160;
    /// Stream attempts in all: the first fill the caps, the rest are refused.
    const STREAM_ATTEMPTS: usize = 1_000;
    /// Connections opened at once to node-b's public port, past its cap.
    const FLOOD_CONNECTIONS: usize = 2_000;
    raise_fd_limit((FLOOD_CONNECTIONS + STREAM_ATTEMPTS + 1_000) as u64);
    let _serial = support::serial().await;
    let db = support::database().await;
    let options =
        ClusterOptions { nodes: 2, sidecar_env: vec![vec![], limited()], ..ClusterOptions::default() };
    let cluster = Cluster::start(&db, options).await.unwrap();
    let (a, b) = (&cluster.nodes[0], &cluster.nodes[1]);
    // Sessions turned on node-a, then released: idle, no owner.
    let http = reqwest::Client::new();
    for i in 0..SESSIONS {
        let turn = http.post(format!("{}/v1/sessions/s-{i}/turns", a.public_url()));
        assert_eq!(
            turn.body(json!({"text": "x", "tokens": 0}).to_string()).send().await.unwrap().status(),
            200
        );
        assert!(http
            .post(format!("{}/sessions/s-{i}/release", a.agent_url()))
            .send()
            .await
            .unwrap()
            .status()
            .is_success());
    }

    // Streams: per session, then per node.
    let mut open = Vec::new();
    for _ in 0..MAX_STREAMS_PER_SESSION {
        let response = stream(&http, b, "s-0").await;
        assert_eq!(response.status(), 200);
        open.push(response);
    }
    let refused = stream(&http, b, "s-0").await;
    assert_eq!(refused.status(), 503, "past the per-session limit");
    assert_eq!(refused.headers()["retry-after"], "1");
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(
        (body["error"].as_str(), body["retry"]["delay_ms"].as_u64()),
        (Some("overloaded"), Some(1000))
    );
    let mut refusals = 1;
    for i in 1..SESSIONS {
        let response = stream(&http, b, &format!("s-{i}")).await;
        if open.len() < MAX_STREAMS {
            assert_eq!(response.status(), 200, "s-{i}");
            open.push(response);
        } else {
            assert_eq!(response.status(), 503, "s-{i}: past the node limit");
            refusals += 1;
        }
    }
    assert!(refusals > 1, "the node limit was reached");
    // More attempts, on sessions already observed: every one is refused at once, none queued.
    let mut attempts = MAX_STREAMS_PER_SESSION + SESSIONS;
    for i in 0.. {
        if attempts >= STREAM_ATTEMPTS {
            break;
        }
        let response = stream(&http, b, &format!("s-{}", i % SESSIONS)).await;
        assert_eq!(response.status(), 503, "attempt {attempts}: past the node limit");
        assert_eq!(response.headers()["leasehold-refusal"], "overloaded");
        refusals += 1;
        attempts += 1;
    }
    eprintln!("{attempts} stream attempts: {} open, {refusals} refused", open.len());
    assert_eq!(b.metric("leasehold_observers", "").await, MAX_STREAMS as f64);
    assert_eq!(b.metric("leasehold_streams_refused_total", "").await, refusals as f64);

    // Followers of idle sessions cost no periodic database reads (they wait for a
    // notification). First let what the set-up caused settle (node-b's followers read
    // each lease once, and once more per notification of the turns and releases above,
    // which a loaded machine delivers late): until a second passes with few transactions.
    let mut watcher = sqlx::PgConnection::connect(&db).await.unwrap();
    // A Postgres backend that goes idle reports its transaction counts up to 10 s later
    // (PGSTAT_IDLE_INTERVAL): what the set-up's turns did would be counted in the window.
    tokio::time::sleep(STATS_FLUSH).await;
    let settle_by = Instant::now() + Duration::from_secs(30);
    let mut last = transactions(&mut watcher).await;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = transactions(&mut watcher).await;
        let quiet = now - last < QUIET_PER_SECOND;
        last = now;
        if quiet || Instant::now() > settle_by {
            break;
        }
    }
    // Then count the transactions of the whole test database for 5 s.
    let before = transactions(&mut watcher).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let during = transactions(&mut watcher).await - before;
    eprintln!(
        "{} observed idle sessions: {during} transactions in 5 s",
        MAX_STREAMS - MAX_STREAMS_PER_SESSION + 1
    );
    // Two heartbeats a second per node and this query; a read per observed session per
    // second (as before) would be ~750.
    assert!(during < 100, "{during} transactions in 5 s with nothing happening");

    // Connections: 2000 more to node-b's public port, past its cap of 300 (200 are the
    // streams): file descriptors stay bounded, those past the cap are answered
    // `overloaded`, and node-b stays ready.
    let fds_before = open_fds(b.sidecar.pid());
    let mut flood = Vec::new();
    for _ in 0..FLOOD_CONNECTIONS {
        if let Ok(conn) = tokio::net::TcpStream::connect((b.ip, localcluster::cluster::PUBLIC_PORT)).await {
            flood.push(conn);
        }
    }
    // Every one of them taken off the listener's accept queue: the sidecar has seen the
    // whole flood (admitted to the cap, the rest refused or closed).
    support::eventually("node-b accepted the whole flood", || async {
        accept_backlog(b.ip, localcluster::cluster::PUBLIC_PORT) == 0
    })
    .await;
    let admitted = MAX_CONNECTIONS - MAX_STREAMS;
    let fds = open_fds(b.sidecar.pid());
    eprintln!(
        "node-b fds: {fds_before} with the streams, {fds} with {} more connections accepted",
        flood.len()
    );
    assert_eq!(flood.len(), FLOOD_CONNECTIONS, "every flood connection was opened");
    assert!(fds <= fds_before + admitted + REFUSALS_IN_FLIGHT + 100, "{fds} fds open");
    // Once the refusals are answered, only the admitted connections stay open.
    let settle_by = Instant::now() + REFUSALS_SETTLE;
    let fds = loop {
        let fds = open_fds(b.sidecar.pid());
        if fds <= fds_before + admitted + 100 || Instant::now() > settle_by {
            break fds;
        }
        tokio::time::sleep(FDS_POLL).await;
    };
    eprintln!("node-b fds: {fds} once the refusals were answered");
    assert!(fds <= fds_before + admitted + 100, "{fds} fds open");
    let ready = http.get(format!("{}/readyz", b.admin_url())).send().await.unwrap().status();
    assert_eq!(ready, 200, "node-b stays ready");
    // A new connection (not one already admitted and pooled) past the cap.
    let fresh = reqwest::Client::new();
    let turn =
        fresh.post(format!("{}/v1/sessions/s-1/turns", b.public_url())).body("{}").send().await.unwrap();
    assert_eq!(turn.status(), 503, "a request past the cap is refused, not queued");
    let body: serde_json::Value = turn.json().await.unwrap();
    assert_eq!(body["error"], "overloaded");

    drop(flood);
    drop(open);
    let served_by = Instant::now() + Duration::from_secs(10);
    loop {
        let turn = http.post(format!("{}/v1/sessions/s-1/turns", b.public_url())).body("{}").send().await;
        if turn.is_ok_and(|t| t.status() == 200) {
            break;
        }
        assert!(Instant::now() < served_by, "node-b never served again after the flood");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The admin port under a flood of idle connections past its cap: the kubelet's probes
    // (each a new connection) are still answered, soon, and file descriptors stay bounded.
    let admin_fds_before = open_fds(b.sidecar.pid());
    let mut admin_flood = Vec::new();
    for _ in 0..FLOOD_CONNECTIONS {
        if let Ok(conn) = tokio::net::TcpStream::connect((b.ip, localcluster::cluster::ADMIN_PORT)).await {
            admin_flood.push(conn);
        }
    }
    assert_eq!(admin_flood.len(), FLOOD_CONNECTIONS, "every admin flood connection was opened");
    let flooded_at = Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await; // the refusals' answers go out
    let fds = open_fds(b.sidecar.pid());
    eprintln!("node-b fds: {admin_fds_before} before, {fds} with {FLOOD_CONNECTIONS} idle admin connections");
    assert!(fds <= admin_fds_before + MAX_CONNECTIONS + 100, "{fds} fds open");
    let probe = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    for path in ["/readyz", "/healthz"] {
        loop {
            let answer = probe.get(format!("{}{path}", b.admin_url())).send().await;
            if answer.as_ref().is_ok_and(|a| a.status() == 200) {
                break;
            }
            let status = answer.map(|a| a.status().to_string()).unwrap_or_else(|e| e.to_string());
            assert!(
                flooded_at.elapsed() < PROBES_ANSWERED_WITHIN,
                "{path} not answered 200 within {PROBES_ANSWERED_WITHIN:?} of the admin flood: {status}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    eprintln!("probes answered {:?} into the admin flood", flooded_at.elapsed());
    drop(admin_flood);
}
