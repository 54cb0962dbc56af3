//! Drain: hand every lease back before shutdown so nobody waits for a TTL.

mod support;

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use leasehold_sidecar::client::Client;
use localcluster::{process::Signal, Cluster, ClusterOptions, Observer};
use rand::Rng;
use serde_json::json;

/// Long enough that any session waiting for it would show.
const TTL: Duration = Duration::from_secs(15);

fn options() -> ClusterOptions {
    ClusterOptions { lease_ttl: TTL, heartbeat: Duration::from_secs(1), ..ClusterOptions::default() }
}

/// How long the turn that is in flight during a drain thinks: well inside the drain
/// timeout (5 s), so the drain waits for it rather than standing it down.
const LONG_THINK: Duration = Duration::from_millis(2000);

/// One session's acknowledged turns: (text, owner, epoch, when acknowledged, when sent).
type Log = Vec<(String, String, i64, Instant, Instant)>;

async fn drive(client: Arc<Client>, key: String, stop: Instant) -> Log {
    let mut log = Log::new();
    let mut i = 0;
    while Instant::now() < stop {
        let text = format!("{key}/{i}");
        let node = rand::rng().random_range(0..client.nodes().len());
        let body = json!({ "text": text, "think_ms": 150, "tokens": 3 }).to_string();
        let sent = Instant::now();
        let answer = client.post(&format!("/v1/sessions/{key}/turns"), body.into(), Some(node)).await;
        let answer = answer.unwrap_or_else(|e| panic!("{text}: failed instead of a directive: {e}"));
        assert_eq!(answer.status, 200, "{text}: {:?}", answer.json());
        for code in &answer.directives {
            assert!(
                ["draining", "owner_unreachable", "takeover_pending"].contains(&code.as_str()),
                "{text}: {code}"
            );
        }
        log.push((text, answer.owner.unwrap(), answer.epoch.unwrap(), Instant::now(), sent));
        i += 1;
    }
    log
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drain_under_load_hands_every_lease_back_with_zero_failed_turns() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let cluster = Cluster::start(&db, options()).await.unwrap();
    let client = Arc::new(cluster.client());
    let keys: Vec<String> = (0..9).map(|i| format!("drain-{i}")).collect();
    // node-a owns a third of the sessions to begin with.
    for (i, key) in keys.iter().enumerate() {
        client
            .post(
                &format!("/v1/sessions/{key}/turns"),
                json!({"text": "start"}).to_string().into(),
                Some(i % 3),
            )
            .await
            .unwrap();
    }
    let owned_by_a: Vec<String> = keys.iter().filter(|k| k.ends_with(['0', '3', '6'])).cloned().collect();
    // One more session of node-a's, for a turn that is certainly in flight when the drain
    // runs: it thinks for less than the drain timeout, so the drain waits for it.
    let long = "drain-long";
    let body = json!({"text": "start"}).to_string();
    client.post(&format!("/v1/sessions/{long}/turns"), body.into(), Some(0)).await.unwrap();
    let mut long_observer =
        Observer::open(&format!("{}/v1/sessions/{long}/stream", cluster.nodes[0].public_url()), None)
            .await
            .unwrap();
    let mut observer = Observer::open(
        &format!("{}/v1/sessions/{}/stream", cluster.nodes[0].public_url(), owned_by_a[0]),
        None,
    )
    .await
    .unwrap();

    let stop = Instant::now() + Duration::from_secs(5);
    let drivers: Vec<_> =
        keys.iter().cloned().map(|key| tokio::spawn(drive(client.clone(), key, stop))).collect();
    // The load runs a while (the fault itself is the drain in the middle of it).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let long_turn = {
        let client = client.clone();
        let body = json!({ "text": "long", "think_ms": LONG_THINK.as_millis() as u64, "tokens": 3 });
        tokio::spawn(async move {
            client.post(&format!("/v1/sessions/{long}/turns"), body.to_string().into(), Some(0)).await
        })
    };
    long_observer
        .until(support::CONDITION_WITHIN, |f| {
            f.event.as_deref() == Some("turn_started") && f.data.contains("\"long\"")
        })
        .await
        .expect("the long turn started on node-a");
    let drained_at = Instant::now();
    let report = cluster.nodes[0].drain().await;
    let drain_took = drained_at.elapsed();
    eprintln!("drain report {report} in {drain_took:?}");
    assert!(report["handed_back"].as_u64().unwrap() >= 1, "{report}");
    assert!(report["in_flight_finished"].as_u64().unwrap() >= 1, "the long turn was in flight: {report}");
    assert_eq!(report["in_flight_stood_down"], 0, "every in-flight turn finished: {report}");
    assert!(drain_took < TTL, "the drain itself is quick: {drain_took:?}");
    let long_answer = long_turn.await.unwrap().expect("the long turn answered");
    assert_eq!(
        (long_answer.status, long_answer.owner.as_deref(), long_answer.epoch),
        (200, Some("node-a"), Some(1)),
        "the turn in flight when the drain ran finished on node-a: {:?}",
        long_answer.json()
    );
    assert_eq!(support::history(&db, long).await, ["start", "long"]);

    // The drained node streams `reconnect` and refuses new work with a directive.
    observer.until(Duration::from_secs(5), |f| f.event.as_deref() == Some("reconnect")).await.unwrap();
    let ready = reqwest::get(format!("{}/readyz", cluster.nodes[0].admin_url())).await.unwrap();
    assert_eq!(ready.status(), 503);
    let held = cluster.nodes[0].metric("leasehold_leases_held", "").await;
    assert_eq!(held, 0.0, "nothing held after the hand-back");

    let mut logs = HashMap::new();
    for (key, driver) in keys.iter().zip(drivers) {
        logs.insert(key.clone(), driver.await.unwrap());
    }
    for (key, log) in &logs {
        let mut expected = vec!["start".to_owned()];
        expected.extend(log.iter().map(|(text, ..)| text.clone()));
        assert_eq!(
            support::history(&db, key).await,
            expected,
            "{key}: every acknowledged turn, once, in order"
        );
        // Judged by when the turn was sent, not when its answer was read: a turn node-a
        // admitted before the drain may be read by this task after the drain returned.
        let drain_done = drained_at + drain_took;
        assert!(
            log.iter().all(|(_, owner, _, _, sent)| owner != "node-a" || *sent < drain_done),
            "{key}: node-a served nothing sent after its drain"
        );
    }
    // The hand-off gap: time between the last turn acknowledged before the drain ended
    // and the first after, per session that node-a owned. A crash would cost the TTL.
    let mut worst = Duration::ZERO;
    for key in &owned_by_a {
        let log = &logs[key];
        let after = log.iter().position(|(_, owner, ..)| owner != "node-a").expect("moved off node-a");
        assert!(log[after].2 >= 2, "{key}: a new epoch after the hand-back");
        if after > 0 {
            worst = worst.max(log[after].3 - log[after - 1].3);
        }
    }
    eprintln!("worst hand-off gap between consecutive acknowledged turns: {worst:?} (TTL {TTL:?})");
    assert!(worst < TTL / 3, "no session waited for the TTL: worst gap {worst:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_drains_first_then_lingers_and_exits() {
    use leasehold_sidecar::drain::EXIT_QUIET;
    let _serial = support::serial().await;
    let db = support::database().await;
    let mut cluster = Cluster::start(&db, options()).await.unwrap();
    let client = cluster.client();
    for key in ["t-1", "t-2"] {
        client
            .post(&format!("/v1/sessions/{key}/turns"), json!({"text": "x"}).to_string().into(), Some(0))
            .await
            .unwrap();
    }
    // SIGTERM without a drain: the sidecar drains, keeps its ports open for the linger
    // (refusing with `draining`), then exits cleanly.
    let linger = leasehold_sidecar::drain::linger(TTL);
    let signalled = Instant::now();
    cluster.nodes[0].sidecar.signal(Signal::SIGTERM);
    tokio::time::sleep(linger / 2).await;
    assert_refuses_draining(&cluster.nodes[0].public_url()).await;
    let status = cluster.nodes[0].sidecar.wait_exit(linger + Duration::from_secs(5)).expect("exited");
    assert!(status.success(), "{status:?}");
    let took = signalled.elapsed();
    assert!(took >= linger, "exited {took:?} after SIGTERM, before the linger {linger:?}");
    for key in ["t-1", "t-2"] {
        assert_eq!(
            client.session(key, 1).await.unwrap()["claimable"],
            true,
            "{key} handed back, no TTL to wait"
        );
    }

    // A drain first, then SIGTERM: exits within a second (refusing until then) once the
    // ports have been quiet for `EXIT_QUIET`.
    client.post("/v1/sessions/t-3/turns", json!({"text": "x"}).to_string().into(), Some(1)).await.unwrap();
    let report = cluster.nodes[1].drain().await;
    assert_eq!(report["handed_back"], 1);
    // The drain is idempotent, and an agent container's hook (GET /drained) gets its report.
    let again = cluster.nodes[1].drain().await;
    assert_eq!(again, report, "drain is idempotent");
    assert_eq!(cluster.nodes[1].drained().await, (200, report.clone()), "the hook's wait ends with it");
    tokio::time::sleep(EXIT_QUIET).await;
    let started = Instant::now();
    cluster.nodes[1].sidecar.signal(Signal::SIGTERM);
    let status = cluster.nodes[1].sidecar.wait_exit(Duration::from_secs(5)).expect("exited");
    assert!(status.success());
    assert!(started.elapsed() < Duration::from_secs(1), "exit after a drain took {:?}", started.elapsed());

    // The same while a client still sends to the drained node (a load balancer not yet
    // told): every send is answered `draining` — none meets a connection closed under
    // it — and the node exits only once they have stopped.
    client.post("/v1/sessions/t-4/turns", json!({"text": "x"}).to_string().into(), Some(2)).await.unwrap();
    cluster.nodes[2].drain().await;
    cluster.nodes[2].sidecar.signal(Signal::SIGTERM);
    let started = Instant::now();
    let mut last_send = Instant::now();
    while started.elapsed() < 3 * EXIT_QUIET {
        assert_refuses_draining(&cluster.nodes[2].public_url()).await;
        last_send = Instant::now();
        tokio::time::sleep(EXIT_QUIET / 10).await;
    }
    assert!(cluster.nodes[2].sidecar.is_running(), "still answering while a client sends");
    let status = cluster.nodes[2].sidecar.wait_exit(Duration::from_secs(10)).expect("exited");
    assert!(status.success());
    // (The node timed its quiet from just before our last answer arrived.)
    let quiet = last_send.elapsed();
    assert!(
        quiet >= EXIT_QUIET * 4 / 5,
        "exited {quiet:?} after the last send, before {EXIT_QUIET:?} of quiet"
    );
}

/// A turn to a drained node that has not exited yet: `503 draining`.
async fn assert_refuses_draining(public_url: &str) {
    let refused = reqwest::Client::new()
        .post(format!("{public_url}/v1/sessions/t-x/turns"))
        .body("{}")
        .send()
        .await
        .expect("still listening");
    assert_eq!(refused.status(), 503);
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["error"], "draining", "{body}");
}

/// Other nodes forward to the draining node over pooled keep-alive connections, and
/// remember it as the holder until the hand-back's notification reaches them. None of
/// those turns may come back `502 owner_failed` (which says "it may have run"): the
/// drained node keeps its ports open and refuses them with `draining`, and the
/// forwarder re-claims and serves them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_under_forwarded_load_fails_no_turn() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let mut cluster = Cluster::start(&db, options()).await.unwrap();
    let client = Arc::new(cluster.client());
    let keys: Vec<String> = (0..32).map(|i| format!("fwd-{i}")).collect();
    for key in &keys {
        let answer = client
            .post(&format!("/v1/sessions/{key}/turns"), json!({"text": "start"}).to_string().into(), Some(0))
            .await
            .unwrap();
        assert_eq!(answer.owner.as_deref(), Some("node-a"));
    }
    // One more of node-a's sessions gets a long turn forwarded through node-b that is
    // running on node-a's agent when the SIGTERM comes: a turn certainly hits node-a while
    // it shuts down, and the drain waits for it.
    let long = "fwd-long";
    client
        .post(&format!("/v1/sessions/{long}/turns"), json!({"text": "start"}).to_string().into(), Some(0))
        .await
        .unwrap();
    let mut long_observer =
        Observer::open(&format!("{}/v1/sessions/{long}/stream", cluster.nodes[0].public_url()), None)
            .await
            .unwrap();
    // Each session sends back to back through node-b and node-c, which forward to node-a
    // until it hands back: many pooled connections are busy as node-a shuts down. They
    // go on until a second after node-a has exited.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let drivers: Vec<_> = keys
        .iter()
        .cloned()
        .map(|key| {
            let (client, stop) = (client.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut acked, mut failed) = (vec!["start".to_owned()], Vec::new());
                let mut i = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let text = format!("{key}/{i}");
                    let body = json!({ "text": text, "think_ms": 0, "tokens": 1 }).to_string();
                    match client
                        .post(&format!("/v1/sessions/{key}/turns"), body.into(), Some(1 + i % 2))
                        .await
                    {
                        Ok(answer) if answer.status == 200 => acked.push(text),
                        Ok(answer) => failed.push(format!("{text}: {} {:?}", answer.status, answer.json())),
                        Err(e) => failed.push(format!("{text}: {e}")),
                    }
                    i += 1;
                }
                (key, acked, failed)
            })
        })
        .collect();
    // The load runs a while (the fault itself is the SIGTERM in the middle of it).
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let long_turn = {
        let client = client.clone();
        let body = json!({ "text": "long", "think_ms": LONG_THINK.as_millis() as u64, "tokens": 3 });
        tokio::spawn(async move {
            let path = format!("/v1/sessions/{long}/turns");
            let answer = client.post(&path, body.to_string().into(), Some(1)).await;
            (answer, Instant::now())
        })
    };
    long_observer
        .until(support::CONDITION_WITHIN, |f| {
            f.event.as_deref() == Some("turn_started") && f.data.contains("\"long\"")
        })
        .await
        .expect("the long turn started on node-a");
    let signalled = Instant::now();
    let status = tokio::task::block_in_place(|| cluster.nodes[0].sidecar.terminate(Duration::from_secs(15)));
    assert!(status.expect("node-a exited").success());
    // The load goes on a second after node-a exited (a duration of the scenario).
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (long_answer, answered) = long_turn.await.unwrap();
    let long_answer = long_answer.expect("the long turn answered");
    assert_eq!(
        (long_answer.status, long_answer.owner.as_deref(), long_answer.epoch),
        (200, Some("node-a"), Some(1)),
        "the forwarded turn running on node-a when it got SIGTERM finished there: {:?}",
        long_answer.json()
    );
    assert!(answered > signalled, "it was answered while node-a shut down");
    assert_eq!(support::history(&db, long).await, ["start", "long"]);
    let mut total = 0;
    for driver in drivers {
        let (key, acked, failed) = driver.await.unwrap();
        assert!(failed.is_empty(), "{key}: {failed:?}");
        total += acked.len();
        assert_eq!(
            support::history(&db, &key).await,
            acked,
            "{key}: every acknowledged turn, once, in order"
        );
    }
    eprintln!("{total} turns acknowledged, none failed, across node-a's shutdown");
}

/// What a keep-alive client sees of one request: the answer's text, and whether the
/// server closed the connection after it (EOF within a second).
async fn keep_alive_exchange(ip: std::net::Ipv4Addr, port: u16, request: &str) -> (String, bool) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect((ip, port)).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let (mut answer, mut buf) = (Vec::new(), [0u8; 4096]);
    loop {
        match tokio::time::timeout(Duration::from_secs(1), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&answer).into_owned(), true),
            Ok(Ok(n)) => answer.extend_from_slice(&buf[..n]),
            Err(_) => return (String::from_utf8_lossy(&answer).into_owned(), false), // left open
        }
    }
}

/// A drained pod answers `Connection: close` and closes each connection after its answer,
/// so keep-alive clients (a load balancer, the API server's proxy, other pods) leave it
/// while it still answers, instead of having idle connections closed under them when it
/// exits. Before the drain, connections stay open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_pod_closes_each_keep_alive_connection_after_its_answer() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let cluster = Cluster::start(&db, ClusterOptions { nodes: 1, ..options() }).await.unwrap();
    let node = &cluster.nodes[0];
    let body = json!({ "text": "kept alive", "tokens": 0 }).to_string();
    let turn = format!(
        "POST /v1/sessions/keep-alive/turns HTTP/1.1\r\nhost: pod\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let peer = "POST /peer/v1/sessions/keep-alive/turns HTTP/1.1\r\nhost: pod\r\ncontent-length: 0\r\n\r\n";
    let (public, peer_port) = (localcluster::cluster::PUBLIC_PORT, localcluster::cluster::PEER_PORT);

    let (answer, closed) = keep_alive_exchange(node.ip, public, &turn).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(!closed && !answer.to_ascii_lowercase().contains("connection: close"), "kept open: {answer}");
    let (answer, closed) = keep_alive_exchange(node.ip, peer_port, peer).await;
    assert!(answer.starts_with("HTTP/1.1 401") && !closed, "no proof, kept open: {answer}");

    node.drain().await;
    for (port, request, status) in [(public, &turn[..], "503"), (peer_port, peer, "401")] {
        let (answer, closed) = keep_alive_exchange(node.ip, port, request).await;
        assert!(answer.starts_with(&format!("HTTP/1.1 {status}")), "port {port}: {answer}");
        assert!(answer.to_ascii_lowercase().contains("connection: close"), "port {port}: {answer}");
        assert!(closed, "port {port}: the server closed the connection after the answer");
    }
}

/// CONTRACT §6 drain order: a turn still running at the drain timeout is stood down — the
/// agent gets `POST /sessions/{key}/stand-down` — and counted in `in_flight_stood_down`;
/// the lease is handed back all the same, and nothing of the turn lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_outlasting_the_drain_timeout_is_stood_down_and_its_agent_told() {
    /// Short, so the held turn outlasts it by far.
    const DRAIN_TIMEOUT: Duration = Duration::from_secs(1);
    let _serial = support::serial().await;
    let db = support::database().await;
    let record = tempfile::tempdir().unwrap();
    let options = ClusterOptions {
        nodes: 1,
        drain_timeout: DRAIN_TIMEOUT,
        agent_command: support::recording_hold_agent(record.path()),
        ..options()
    };
    let cluster = Cluster::start(&db, options).await.unwrap();
    let node = &cluster.nodes[0];
    let key = "outlasting";
    let turns = format!("{}/v1/sessions/{key}/turns", node.public_url());
    let http = reqwest::Client::new();
    let first = http.post(&turns).body(json!({"text": "first"}).to_string()).send().await.unwrap();
    assert_eq!(first.status(), 200);
    // The agent thinks four drain timeouts before it would checkpoint.
    let think_ms = (DRAIN_TIMEOUT * 4).as_millis() as u64;
    let held = tokio::spawn({
        let request = http.post(&turns).body(json!({ "text": "held", "think_ms": think_ms }).to_string());
        async move {
            let response = request.send().await.unwrap();
            (response.status().as_u16(), response.text().await.unwrap_or_default())
        }
    });
    support::eventually("the held turn runs on the agent", || async {
        node.metric("leasehold_in_flight_turns", "").await >= 1.0
    })
    .await;

    let report = node.drain().await;
    assert_eq!(report["in_flight_stood_down"], 1, "{report}");
    assert_eq!(report["in_flight_finished"], 0, "{report}");
    assert_eq!(report["handed_back"], 1, "{report}");
    let stand_down = format!("/sessions/{key}/stand-down");
    support::eventually("the agent was told to stand the session down", || {
        let told = !support::received(record.path(), node, &stand_down).is_empty();
        async move { told }
    })
    .await;
    let (status, body) = held.await.unwrap();
    assert_ne!(status, 200, "a stood-down turn is not acknowledged: {body}");
    assert_eq!(support::history(&db, key).await, ["first"], "nothing of the held turn landed");
    let view = cluster.client().session(key, 0).await.unwrap();
    assert_eq!(view["claimable"], true, "handed back: {view}");
}

/// CONTRACT §3: the client library re-sends after each directive's delay and gives up
/// once the budget would be overrun, with the last refusal: here a drained node's
/// `draining` (budget: the drain timeout), asked again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_gives_up_at_the_retry_budget_of_a_draining_node() {
    use leasehold_sidecar::client::ClientError;
    const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);
    /// A deadline, not a speed claim: a client that never gave up would hang here.
    const GIVE_UP_WITHIN: Duration = Duration::from_secs(30);
    let _serial = support::serial().await;
    let db = support::database().await;
    let options = ClusterOptions { nodes: 1, drain_timeout: DRAIN_TIMEOUT, ..options() };
    let cluster = Cluster::start(&db, options).await.unwrap();
    cluster.nodes[0].drain().await;

    let (client, body) = (cluster.client(), json!({"text": "x"}));
    let asked = tokio::time::timeout(GIVE_UP_WITHIN, client.turn("refused", &body));
    let outcome = asked.await.expect("the client never gave up: it retried past its budget");
    let Err(ClientError::GaveUp(last, directives)) = outcome else {
        panic!("expected the client to give up: {outcome:?}")
    };
    assert_eq!(last.error, "draining");
    let retry = last.retry.expect("the last refusal's directive");
    assert_eq!(retry.budget_ms, DRAIN_TIMEOUT.as_millis() as u64);
    // Every attempt but the first waited one delay, all within the budget.
    let most = (retry.budget_ms / retry.delay_ms + 1) as usize;
    assert!(
        directives.len() >= 2 && directives.len() <= most,
        "re-sent after each delay until the budget ran out: {} attempts (at most {most})",
        directives.len()
    );
    assert!(directives.iter().all(|d| d == "draining"), "{directives:?}");
    assert!(support::history(&db, "refused").await.is_empty(), "nothing ran");
}

/// The agent container's preStop hook under the native-sidecar layout (a kubelet GET,
/// which cannot sign): with the cluster's drain-hook token made for its user hook it
/// starts the drain itself, then the sidecar runs that user hook (a GET on the pod's
/// loopback), which sees the pod already draining. Without that token, `401` at once:
/// another cluster's token, `then_*` without a token, or the cluster's token for another
/// user hook start no drain, send no GET to the pod's loopback, and hold no connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_hook_with_the_cluster_token_drains_then_runs_the_users_hook() {
    use leasehold_core::proof::{drain_hook_token, DrainThen};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    /// A refusal is immediate; a sidecar that ran a user's GET against our listener
    /// (which never answers while refusals are tested) or a `then_sleep` would hang past it.
    const REFUSED_WITHIN: Duration = Duration::from_secs(3);
    /// The handler runs a user's GET before it answers, so a connection it made is already
    /// in the listener's backlog when the answer arrives and `accept` returns it at once:
    /// this only covers the runtime's wake-up.
    const BACKLOG_CHECK: Duration = Duration::from_millis(200);
    let _serial = support::serial().await;
    let db = support::database().await;
    let options = ClusterOptions { nodes: 1, ..options() };
    let secret = options.cluster_secret.clone().expect("a secure cluster");
    let cluster = Cluster::start(&db, options).await.unwrap();
    let node = &cluster.nodes[0];
    cluster
        .client()
        .post("/v1/sessions/h-1/turns", json!({"text": "x"}).to_string().into(), Some(0))
        .await
        .unwrap();
    let hook = |token: Option<String>, query: String| {
        let url = format!("{}/drained{query}", node.admin_url());
        async move {
            let mut request = reqwest::Client::new().get(url);
            if let Some(token) = token {
                request = request.header(leasehold_core::proof::DRAIN_HOOK_HEADER, token);
            }
            let response = request.send().await.expect("admin port reachable");
            (response.status().as_u16(), response.json::<serde_json::Value>().await.unwrap_or_default())
        }
    };
    let readyz = format!("{}/readyz", node.admin_url());

    // The user's hook: a GET on the pod's loopback, on a port this test owns.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let then = DrainThen { port: Some(port), path: Some("/flush?why=stop".into()), sleep: None };
    let query = format!("?{}", then.query());
    assert_eq!(query, format!("?then_port={port}&then_path=%2Fflush%3Fwhy%3Dstop"));
    let elsewhere = DrainThen { path: Some("/admin/shutdown".into()), ..then.clone() };
    let sleep = DrainThen { sleep: Some(3600), ..Default::default() };
    let refused = [
        (
            "another cluster's token",
            Some(drain_hook_token("another-cluster", &DrainThen::default())),
            String::new(),
        ),
        ("another cluster's token, a GET", Some(drain_hook_token("another-cluster", &then)), query.clone()),
        ("no token, a GET", None, query.clone()),
        (
            "this cluster's token for no user hook, a GET",
            Some(drain_hook_token(&secret, &DrainThen::default())),
            query.clone(),
        ),
        (
            "this cluster's token for another path",
            Some(drain_hook_token(&secret, &then)),
            format!("?{}", elsewhere.query()),
        ),
        ("no token, an hour's sleep", None, format!("?{}", sleep.query())),
        (
            "another cluster's token, an hour's sleep",
            Some(drain_hook_token("another-cluster", &sleep)),
            format!("?{}", sleep.query()),
        ),
    ];
    let failures_before = node.metric("leasehold_peer_auth_failures_total", "").await;
    for (case, token, query) in refused {
        let answered = tokio::time::timeout(REFUSED_WITHIN, hook(token, query)).await;
        let (status, body) =
            answered.unwrap_or_else(|_| panic!("{case}: no answer within {REFUSED_WITHIN:?}"));
        assert_eq!((status, body["error"].as_str()), (401, Some("unauthorized")), "{case}: {body}");
        let reached = tokio::time::timeout(BACKLOG_CHECK, listener.accept()).await;
        assert!(reached.is_err(), "{case}: the sidecar connected to the user's port");
        assert_eq!(reqwest::get(&readyz).await.unwrap().status(), 200, "{case}: no drain started");
    }
    let failures = node.metric("leasehold_peer_auth_failures_total", "").await - failures_before;
    assert_eq!(failures, 7.0, "each refusal counted");

    // The user's hook answers, with whether the pod was already draining when it arrived.
    let user_hook = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut request = vec![0; 4096];
        let n = socket.read(&mut request).await.unwrap();
        let draining = reqwest::get(&readyz).await.unwrap().status() == 503;
        socket.write_all(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n").await.unwrap();
        (String::from_utf8_lossy(&request[..n]).lines().next().unwrap_or_default().to_owned(), draining)
    });
    let (status, report) = hook(Some(drain_hook_token(&secret, &then)), query).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["handed_back"], 1, "the hook drained the pod: {report}");
    let (request_line, draining) = user_hook.await.unwrap();
    assert_eq!(request_line, "GET /flush?why=stop HTTP/1.1");
    assert!(draining, "the user's hook ran after the drain had started");
    assert_eq!(node.drained().await, (200, report), "the drain is the one drain");
}
