//! Routing with real processes: every turn reaches the one owner; the peer port admits
//! only authenticated requests; bad input is refused and breaks nothing.

mod support;

use std::collections::BTreeSet;

use leasehold_core::proof::{PeerAuth, Signed};
use leasehold_sidecar::client::Client;
use localcluster::{Cluster, ClusterOptions, Node};
use rand::Rng;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn turns_sent_anywhere_land_on_one_owner_in_order() {
    const SESSIONS: usize = 20;
    const TURNS: usize = 10;
    let _serial = support::serial().await;
    let db = support::database().await;
    let cluster = Cluster::start(&db, ClusterOptions::default()).await.unwrap();
    let client = std::sync::Arc::new(cluster.client());
    let tasks: Vec<_> = (0..SESSIONS)
        .map(|s| {
            let client = client.clone();
            tokio::spawn(async move {
                let key = format!("chat-{s}");
                let mut owners = BTreeSet::new();
                for t in 0..TURNS {
                    let node = rand::rng().random_range(0..3);
                    let body = json!({ "text": format!("{key}/{t}"), "tokens": 2 }).to_string();
                    let answer =
                        client.post(&format!("/v1/sessions/{key}/turns"), body.into(), Some(node)).await;
                    let answer = answer.unwrap_or_else(|e| panic!("{key} turn {t}: {e}"));
                    assert_eq!(answer.status, 200, "{key} turn {t}: {:?}", answer.json());
                    assert!(answer.directives.is_empty(), "no refusal expected: {:?}", answer.directives);
                    let json = answer.json().unwrap();
                    assert_eq!(
                        json["history_len"],
                        t + 1,
                        "{key}: each turn answered exactly once, in order"
                    );
                    assert_eq!(answer.epoch, Some(1));
                    owners.insert(answer.owner.clone().unwrap());
                }
                (key, owners)
            })
        })
        .collect();
    for task in tasks {
        let (key, owners) = task.await.unwrap();
        assert_eq!(owners.len(), 1, "{key} had one owner the whole time: {owners:?}");
        let expected: Vec<String> = (0..TURNS).map(|t| format!("{key}/{t}")).collect();
        assert_eq!(support::history(&db, &key).await, expected, "{key}: checkpoint = acknowledged turns");
        assert_eq!(support::epoch(&db, &key).await, Some(1));
    }
    let mut forwarded = 0.0;
    for node in &cluster.nodes {
        forwarded += node.metric("leasehold_turns_total", "path=\"forwarded\"").await;
    }
    assert!(forwarded > 0.0, "some turns entered on a non-owner and were forwarded one hop");
}

/// A proof for `destination` over a request with `headers` and `body`.
fn proof(
    auth: &PeerAuth,
    method: &str,
    path: &str,
    destination: &str,
    headers: &reqwest::header::HeaderMap,
    body: &[u8],
) -> Vec<(reqwest::header::HeaderName, reqwest::header::HeaderValue)> {
    auth.sign(&Signed { method, path, destination, headers, body }, &[])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_port_admits_only_a_fresh_proof_of_the_secret() {
    let db = support::database().await;
    let options = ClusterOptions { nodes: 1, ..ClusterOptions::default() };
    let secret = options.cluster_secret.clone().unwrap();
    let cluster = Cluster::start(&db, options).await.unwrap();
    let node = &cluster.nodes[0];
    let http = reqwest::Client::new();
    let path = "/peer/v1/sessions/peer-test/turns";
    let body = br#"{"text":"via peer"}"#;
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert("content-type", "application/json".parse().unwrap());
    headers.insert("leasehold-turn-id", uuid::Uuid::new_v4().to_string().parse().unwrap());
    let send = |extra: Vec<(reqwest::header::HeaderName, reqwest::header::HeaderValue)>,
                headers: reqwest::header::HeaderMap| {
        let req = http.post(format!("{}{path}", node.peer_url())).headers(headers).body(body.to_vec());
        let req = extra.into_iter().fold(req, |req, (k, v)| req.header(k, v));
        async move { req.send().await.unwrap().status().as_u16() }
    };

    let h = headers.clone();
    assert_eq!(send(vec![], h.clone()).await, 401, "no proof");
    let wrong = PeerAuth::new(Some("wrong-secret"), None);
    assert_eq!(send(proof(&wrong, "POST", path, "node-a", &h, body), h.clone()).await, 401, "wrong secret");
    let auth = PeerAuth::new(Some(&secret), None);
    let stale_ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()
        as u64
        - 60_000;
    let stale = auth.sign_at(
        &Signed { method: "POST", path, destination: "node-a", headers: &h, body },
        &[],
        stale_ts,
    );
    assert_eq!(send(stale, h.clone()).await, 401, "stale proof");
    let other_path = proof(&auth, "POST", "/peer/v1/sessions/other/turns", "node-a", &h, body);
    assert_eq!(send(other_path, h.clone()).await, 401, "proof for another path");
    let other_node = proof(&auth, "POST", path, "node-b", &h, body);
    assert_eq!(send(other_node, h.clone()).await, 401, "proof made for another pod (a replay there)");
    let mut other_turn = h.clone();
    other_turn.insert("leasehold-turn-id", uuid::Uuid::new_v4().to_string().parse().unwrap());
    assert_eq!(
        send(proof(&auth, "POST", path, "node-a", &h, body), other_turn).await,
        401,
        "another turn id"
    );

    let good = proof(&auth, "POST", path, "node-a", &h, body);
    assert_eq!(send(good.clone(), h.clone()).await, 200, "a fresh proof is admitted and the turn runs");
    assert_eq!(send(good, h).await, 401, "the same proof replayed");
    assert!(node.metric("leasehold_peer_auth_failures_total", "").await >= 7.0);
}

/// The admin port: health, readiness and metrics for anyone; the leases held and the
/// drain only with a fresh proof of the cluster secret made for this node; `GET /drain`
/// is not a drain; the drain command refuses to drain with a wrong secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_port_drains_and_lists_leases_only_for_a_proof_of_the_secret() {
    let db = support::database().await;
    let options = ClusterOptions { nodes: 1, ..ClusterOptions::default() };
    let secret = options.cluster_secret.clone().unwrap();
    let cluster = Cluster::start(&db, options).await.unwrap();
    let node = &cluster.nodes[0];
    cluster.client().turn("listed", &json!({ "text": "x" })).await.unwrap();
    let http = reqwest::Client::new();
    let admin = node.admin_url();
    let none = reqwest::header::HeaderMap::new();
    for open in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(http.get(format!("{admin}{open}")).send().await.unwrap().status(), 200, "{open}");
    }
    let status =
        |request: reqwest::RequestBuilder| async move { request.send().await.unwrap().status().as_u16() };
    assert_eq!(status(http.post(format!("{admin}/drain"))).await, 401, "a drain without proof");
    assert_eq!(status(http.get(format!("{admin}/drain"))).await, 405, "GET is not a drain");
    assert_eq!(status(http.get(format!("{admin}/leases"))).await, 401, "leases without proof");
    let wrong = PeerAuth::new(Some("wrong"), None);
    let signed = |auth: &PeerAuth, method: &str, path: &str, destination: &str| {
        let request = match method {
            "GET" => http.get(format!("{admin}{path}")),
            _ => http.post(format!("{admin}{path}")),
        };
        proof(auth, method, path, destination, &none, b"")
            .into_iter()
            .fold(request, |r, (k, v)| r.header(k, v))
    };
    assert_eq!(status(signed(&wrong, "POST", "/drain", "node-a")).await, 401, "wrong secret");
    let auth = PeerAuth::new(Some(&secret), None);
    assert_eq!(status(signed(&auth, "POST", "/drain", "node-b")).await, 401, "made for another pod");
    let leases = signed(&auth, "GET", "/leases", "node-a").send().await.unwrap();
    assert_eq!(leases.status(), 200);
    let leases: serde_json::Value = leases.json().await.unwrap();
    assert_eq!(leases[0]["key"], "listed", "{leases}");

    let refused = tokio::process::Command::new(localcluster::cluster::binary("leasehold-sidecar"))
        .args(["drain", "--admin-url", &admin, "--cluster-secret", "wrong"])
        .output()
        .await
        .unwrap();
    assert!(!refused.status.success(), "the drain command with a wrong secret must fail");
    assert_eq!(http.get(format!("{admin}/readyz")).send().await.unwrap().status(), 200, "not drained");
    assert!(node.metric("leasehold_peer_auth_failures_total", "").await >= 5.0);

    let report = node.drain().await;
    assert_eq!(report["handed_back"], 1, "{report}");
    assert_eq!(http.get(format!("{admin}/readyz")).send().await.unwrap().status(), 503, "drained");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_with_another_secret_gets_a_502_saying_so_never_a_401() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let options = ClusterOptions { nodes: 2, ..ClusterOptions::default() };
    let mut cluster = Cluster::start(&db, options).await.unwrap();
    let key = "mid-rotation";
    let client = cluster.client();
    let body = |text: &str| json!({ "text": text, "tokens": 0 }).to_string();
    let first = client.post(&format!("/v1/sessions/{key}/turns"), body("one").into(), Some(0)).await.unwrap();
    assert_eq!(first.owner.as_deref(), Some("node-a"));

    // node-b comes back with a rotated secret while node-a still has the old one.
    cluster.nodes[1].restart_sidecar_with("--cluster-secret", "rotated-secret");
    cluster.nodes[1].wait_ready().await.unwrap();
    let url = format!("{}/v1/sessions/{key}/turns", cluster.nodes[1].public_url());
    let response = reqwest::Client::new().post(url).body(body("two")).send().await.unwrap();
    assert_eq!(response.status(), 502, "a server-side fault, not the client's credentials");
    assert!(response.headers().get("retry-after").is_none(), "no directive: a retry fails the same way");
    let json: serde_json::Value = response.json().await.unwrap();
    assert_eq!(json["error"], "owner_failed");
    let message = json["message"].as_str().unwrap_or_default();
    assert!(message.contains("cluster secrets differ"), "says why: {json}");

    let (a, b) = (&cluster.nodes[0], &cluster.nodes[1]);
    assert!(a.metric("leasehold_peer_auth_failures_total", "").await >= 1.0, "the owner counted it");
    assert_eq!(b.metric("leasehold_peer_rejections_total", "").await, 1.0, "so did the forwarder");
    assert_eq!(b.metric("leasehold_turns_total", "peer_rejected").await, 1.0);
    assert_eq!(support::history(&db, key).await, ["one"], "nothing ran on the owner");

    // An observer on node-b: its follower is refused the owner's stream and counts it.
    let stream = format!("{}/v1/sessions/{key}/stream", b.public_url());
    let _observer = localcluster::Observer::open(&stream, None).await.unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while b.metric("leasehold_peer_rejections_total", "").await < 2.0 {
        assert!(std::time::Instant::now() < deadline, "the follower's refused stream is counted");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// A one-step rotation (`current: new, previous: old`) while pods roll: restarted pods
/// reach pods not yet restarted by falling back to the old secret, and are reached with
/// it; turns, followers and drains all keep working, and nothing runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotation_mid_roll_loses_no_turn() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let options =
        ClusterOptions { nodes: 2, cluster_secret: Some("old-secret".into()), ..ClusterOptions::default() };
    let mut cluster = Cluster::start(&db, options).await.unwrap();
    let client = cluster.client();
    let body = |text: &str| json!({ "text": text, "tokens": 0 }).to_string();
    let urls: Vec<String> = cluster.nodes.iter().map(|n| n.public_url()).collect();
    let turn = |node: usize, key: &str, text: &str| {
        let url = format!("{}/v1/sessions/{key}/turns", urls[node]);
        reqwest::Client::new().post(url).body(body(text)).send()
    };
    // "on-old" is owned by node-a, which keeps the old secret.
    let first = client.post("/v1/sessions/on-old/turns", body("one").into(), Some(0)).await.unwrap();
    assert_eq!(first.owner.as_deref(), Some("node-a"));

    // node-b restarts mid-rotation: signs with the new secret, still accepts the old one.
    cluster.nodes[1].restart_sidecar_with("--cluster-secret-previous", "old-secret");
    cluster.nodes[1].restart_sidecar_with("--cluster-secret", "new-secret");
    cluster.nodes[1].wait_ready().await.unwrap();
    let (a, b) = (&cluster.nodes[0], &cluster.nodes[1]);
    let failures_before = a.metric("leasehold_peer_auth_failures_total", "").await;

    // new → old: refused with the new secret, sent again with the previous one.
    let forwarded = turn(1, "on-old", "two").await.unwrap();
    assert_eq!(forwarded.status(), 200, "{:?}", forwarded.text().await);
    assert!(a.metric("leasehold_peer_auth_failures_total", "").await > failures_before, "fell back");
    // old → new: node-a's old proof is accepted as the previous secret.
    let owned_by_b = turn(1, "on-new", "three").await.unwrap();
    assert_eq!(owned_by_b.status(), 200);
    let via_a = turn(0, "on-new", "four").await.unwrap();
    assert_eq!(via_a.status(), 200, "{:?}", via_a.text().await);
    assert_eq!(support::history(&db, "on-old").await, ["one", "two"], "each turn ran once");
    assert_eq!(support::history(&db, "on-new").await, ["three", "four"], "each turn ran once");
    assert_eq!(b.metric("leasehold_peer_rejections_total", "").await, 0.0, "no turn was refused");

    // A follower on node-b streams node-a's session (GET, same fallback).
    let stream = format!("{}/v1/sessions/on-old/stream", b.public_url());
    let mut observer = localcluster::Observer::open(&stream, None).await.unwrap();
    let five = turn(0, "on-old", "five").await.unwrap();
    assert_eq!(five.status(), 200);
    let finished = localcluster::observer::turn_finished(3);
    observer.until(std::time::Duration::from_secs(10), finished).await.unwrap();

    // The drain command with the new secret on node-b (it knows both), and with the old
    // one on node-a: neither is refused.
    let report = b.drain().await;
    assert_eq!(report["handed_back"], 1, "{report}");
    let report = a.drain().await;
    assert_eq!(report["handed_back"], 1, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_its_documented_status_and_breaks_nothing() {
    let db = support::database().await;
    let cluster =
        Cluster::start(&db, ClusterOptions { nodes: 1, ..ClusterOptions::default() }).await.unwrap();
    let node = &cluster.nodes[0];
    let http = reqwest::Client::new();
    let public = node.public_url();
    let agent = node.agent_api_url();
    let two_mib = vec![b'x'; 2 * 1024 * 1024];
    let long_key = "k".repeat(201);
    let cases: Vec<(reqwest::RequestBuilder, u16, &str)> = vec![
        (http.post(format!("{public}/v1/sessions/bad%20key/turns")), 400, "space in key"),
        (http.post(format!("{public}/v1/sessions/{long_key}/turns")), 400, "key too long"),
        (http.post(format!("{public}/v1/sessions/a%2Fb/turns")), 400, "slash in key"),
        (http.get(format!("{public}/v1/sessions/b%C3%A4d")), 400, "non-ascii key"),
        (http.post(format!("{public}/v1/sessions/big/turns")).body(two_mib.clone()), 413, "2 MiB body"),
        (http.post(format!("{public}/v1/sessions/big/events")).body(two_mib), 413, "2 MiB event"),
        (
            http.post(format!("{public}/v1/sessions/json/turns")).body("{not json"),
            400,
            "malformed JSON reaches the agent",
        ),
        (http.get(format!("{public}/v1/nothing")), 404, "unknown route"),
        (http.get(format!("{public}/v1/sessions/x/turns")), 405, "wrong method"),
        (http.delete(format!("{public}/v1/sessions/x")), 405, "wrong method on session"),
        (http.put(format!("{agent}/v1/sessions/x/checkpoint")).body("{}"), 400, "write without epoch"),
        (
            http.put(format!("{agent}/v1/sessions/x/checkpoint"))
                .header("leasehold-epoch", "zero")
                .body("{}"),
            400,
            "bad epoch",
        ),
        (
            http.put(format!("{agent}/v1/sessions/x/checkpoint")).header("leasehold-epoch", "7").body("{}"),
            409,
            "epoch not held: fenced",
        ),
        (
            http.post(format!("{agent}/v1/sessions/x/events")).header("leasehold-epoch", "1").body("[1,"),
            400,
            "malformed event",
        ),
        (http.get(format!("{agent}/v1/sessions/never/checkpoint")), 404, "no checkpoint yet"),
        (http.post(format!("{}/drain", node.public_url())), 404, "admin route on the public port"),
    ];
    for (request, status, what) in cases {
        let response = request.send().await.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(response.status().as_u16(), status, "{what}");
        let body: serde_json::Value =
            response.json().await.unwrap_or_else(|e| panic!("{what}: JSON error body: {e}"));
        assert!(body["error"].is_string(), "{what}: {body}");
        let health = http.get(format!("{}/healthz", node.admin_url())).send().await.unwrap();
        assert_eq!(health.status(), 200, "{what}: the process stays healthy");
    }
    // Oversized headers are refused by the server, not by a crash.
    let status_line = raw_request(
        node.ip,
        &format!("GET /v1/sessions/x HTTP/1.1\r\nhost: x\r\nx-huge: {}\r\n\r\n", "h".repeat(100 * 1024)),
    )
    .await;
    assert!(status_line.starts_with("HTTP/1.1 431"), "oversized head: {status_line:?}");
    // And the node still serves a well-formed turn after all of that.
    let ok = cluster.client().turn("after-bad-input", &json!({ "text": "fine" })).await.unwrap();
    assert_eq!(ok.status, 200);
    let mut cluster = cluster;
    assert!(cluster.nodes[0].sidecar.is_running(), "never crashed");
}

/// Send raw bytes to the public port and return the response's status line.
async fn raw_request(ip: std::net::Ipv4Addr, request: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect((ip, localcluster::cluster::PUBLIC_PORT)).await.unwrap();
    let _ = stream.write_all(request.as_bytes()).await; // the server may stop reading early
    let mut buf = vec![0; 256];
    let n = stream.read(&mut buf).await.unwrap_or(0);
    String::from_utf8_lossy(&buf[..n]).lines().next().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_is_cut_off_and_others_are_served_meanwhile() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let db = support::database().await;
    let cluster =
        Cluster::start(&db, ClusterOptions { nodes: 1, ..ClusterOptions::default() }).await.unwrap();
    let node = &cluster.nodes[0];
    // Half a request head, then silence (slowloris).
    let mut slow =
        tokio::net::TcpStream::connect((node.ip, localcluster::cluster::PUBLIC_PORT)).await.unwrap();
    slow.write_all(b"POST /v1/sessions/slow/turns HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    let ok = cluster.client().turn("meanwhile", &json!({ "text": "fine" })).await.unwrap();
    assert_eq!(ok.status, 200, "other clients are served while the slow one dawdles");
    let started = std::time::Instant::now();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(30), slow.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the server closed the connection");
    let waited = started.elapsed();
    assert!(
        waited >= std::time::Duration::from_secs(5),
        "cut by the header timeout, not at once: {waited:?}"
    );
}

/// Send turn `a` for `key` to node 0; the node that answered (the owner, epoch 1).
async fn first_turn<'c>(cluster: &'c Cluster, client: &Client, key: &str) -> &'c Node {
    let answer = client.post(&format!("/v1/sessions/{key}/turns"), r#"{"text":"a"}"#.into(), Some(0)).await;
    let answer = answer.unwrap();
    assert_eq!((answer.status, answer.epoch), (200, Some(1)), "{:?}", answer.json());
    cluster.node(answer.owner.as_deref().unwrap())
}

/// CONTRACT §5 `DELETE /v1/sessions/{key}/lease`: the idle session is claimable at once;
/// a repeated DELETE (its answer lost) is done again; a stale epoch is `fenced`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_release_is_claimable_at_once_and_idempotent() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let cluster = Cluster::start(&db, ClusterOptions::default()).await.unwrap();
    let client = cluster.client();
    let owner = first_turn(&cluster, &client, "idle-1").await;
    let http = reqwest::Client::new();
    let release = |epoch: i64| {
        http.delete(format!("{}/v1/sessions/idle-1/lease", owner.agent_api_url()))
            .header("leasehold-epoch", epoch)
            .send()
    };
    assert_eq!(release(1).await.unwrap().status(), 204);
    let view: serde_json::Value = http
        .get(format!("{}/v1/sessions/idle-1", cluster.nodes[2].public_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(view["claimable"], true, "{view}");
    assert_eq!(view["owner"], serde_json::Value::Null, "{view}");
    assert_eq!(release(1).await.unwrap().status(), 204, "a repeated release is done again");
    let stale = release(7).await.unwrap();
    assert_eq!(stale.status(), 409);
    assert_eq!(stale.json::<serde_json::Value>().await.unwrap()["error"], "fenced");
    // The next turn (from any node) takes the session over at the next epoch.
    let answer = client.post("/v1/sessions/idle-1/turns", r#"{"text":"b"}"#.into(), Some(2)).await.unwrap();
    assert_eq!((answer.status, answer.epoch), (200, Some(2)));
    assert_eq!(release(1).await.unwrap().status(), 409, "claimed since: the old epoch is fenced");
    assert_eq!(support::history(&db, "idle-1").await, ["a", "b"]);
}

/// The demo agent (CONTRACT §4a) never starts over from a checkpoint it cannot read:
/// the turn fails with `500 bad_checkpoint` and the stored checkpoint is left as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_checkpoint_fails_the_turn_and_is_kept() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let cluster = Cluster::start(&db, ClusterOptions::default()).await.unwrap();
    let client = cluster.client();
    let owner = first_turn(&cluster, &client, "cp-1").await;
    let http = reqwest::Client::new();
    let checkpoint = format!("{}/v1/sessions/cp-1/checkpoint", owner.agent_api_url());
    let put = http.put(&checkpoint).header("leasehold-epoch", 1).body("not json").send().await.unwrap();
    assert_eq!(put.status(), 204);
    // The agent forgets what it holds, so the next turn thaws from the checkpoint.
    let agent = format!("http://{}:{}", owner.ip, localcluster::cluster::DEMO_AGENT_PORT);
    let dropped = http.post(format!("{agent}/sessions/cp-1/stand-down")).send().await.unwrap();
    assert!(dropped.status().is_success(), "{}", dropped.status());
    let answer = client.post("/v1/sessions/cp-1/turns", r#"{"text":"b"}"#.into(), Some(0)).await.unwrap();
    assert_eq!(answer.status, 500, "{:?}", answer.json());
    assert_eq!(answer.json().unwrap()["error"], "bad_checkpoint");
    let kept = http.get(&checkpoint).send().await.unwrap().text().await.unwrap();
    assert_eq!(kept, "not json", "nothing overwrote the checkpoint");
}

/// `/metrics`: the classic Prometheus text by default, OpenMetrics when asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_come_in_the_format_asked_for() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let cluster = Cluster::start(&db, ClusterOptions::default()).await.unwrap();
    let url = format!("{}/metrics", cluster.nodes[0].admin_url());
    let http = reqwest::Client::new();
    let classic = http.get(&url).send().await.unwrap();
    assert_eq!(classic.headers()["content-type"], "text/plain; version=0.0.4; charset=utf-8");
    let text = classic.text().await.unwrap();
    assert!(text.contains("# TYPE leasehold_fenced_writes_total counter"), "{text}");
    assert!(!text.contains("# EOF"), "{text}");
    let open = http
        .get(&url)
        .header("accept", "application/openmetrics-text;version=1.0.0,text/plain;q=0.5")
        .send()
        .await
        .unwrap();
    assert!(open.headers()["content-type"].to_str().unwrap().starts_with("application/openmetrics-text"));
    let text = open.text().await.unwrap();
    assert!(
        text.contains("# TYPE leasehold_fenced_writes counter") && text.trim_end().ends_with("# EOF"),
        "{text}"
    );
}

/// Two nodes whose agents are the recording hold agent (what each agent was sent is in
/// `record`); `key` owned by node-a at epoch 1 after a turn "first".
async fn recorded_pair(db: &str, record: &std::path::Path, key: &str) -> Cluster {
    let options = ClusterOptions {
        nodes: 2,
        agent_command: support::recording_hold_agent(record),
        ..Default::default()
    };
    let cluster = Cluster::start(db, options).await.unwrap();
    let (client, path) = (cluster.client(), format!("/v1/sessions/{key}/turns"));
    let answer = client.post(&path, r#"{"text":"first"}"#.into(), Some(0)).await.unwrap();
    assert_eq!((answer.status, answer.owner.as_deref()), (200, Some("node-a")), "{:?}", answer.json());
    cluster
}

/// CONTRACT §3 `POST /v1/sessions/{key}/events`: routed like a turn and dispatched to the
/// agent's `/sessions/{key}/events`, body and content type unchanged, whether sent to the
/// owner or forwarded by another node; with the epoch and a turn id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_reaches_the_agent_with_its_content_type_locally_and_across_the_hop() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let record = tempfile::tempdir().unwrap();
    let key = "evented";
    let cluster = recorded_pair(&db, record.path(), key).await;
    let http = reqwest::Client::new();
    let sent = [
        (0, "text/plain; charset=utf-8", "a webhook said hello"),
        (1, "application/cloudevents+json", r#"{"specversion":"1.0","type":"job.done"}"#),
    ];
    for (node, content_type, body) in sent {
        let response = http
            .post(format!("{}/v1/sessions/{key}/events", cluster.nodes[node].public_url()))
            .header("content-type", content_type)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "sent to node {node}");
        assert_eq!(response.headers()["leasehold-owner"], "node-a");
    }
    let got = support::received(record.path(), &cluster.nodes[0], &format!("/sessions/{key}/events"));
    assert_eq!(got.len(), 2, "both events reached the owner's agent: {got:?}");
    for (recorded, (_, content_type, body)) in got.iter().zip(sent) {
        assert_eq!(recorded["content_type"], content_type, "{recorded}");
        assert_eq!(recorded["body"], body, "{recorded}");
        assert_eq!(recorded["epoch"], "1", "{recorded}");
        assert!(uuid::Uuid::parse_str(recorded["turn_id"].as_str().unwrap_or("")).is_ok(), "{recorded}");
    }
    let on_b = support::received(record.path(), &cluster.nodes[1], &format!("/sessions/{key}/events"));
    assert!(on_b.is_empty(), "node-b's agent got nothing: {on_b:?}");
}

/// CONTRACT §4 and §5: every turn reaches the agent with `Leasehold-Turn-Id` (the
/// caller's when it sent a valid one, the same on every attempt; else a new UUID per turn)
/// and `Leasehold-Epoch`; the agent's thaw gets `Leasehold-Checkpoint-Epoch`, the epoch
/// the checkpoint was written at, also after the session moved to another epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_reach_the_agent_with_a_turn_id_and_the_thaw_sees_the_checkpoint_epoch() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let record = tempfile::tempdir().unwrap();
    let key = "identified";
    let cluster = recorded_pair(&db, record.path(), key).await;
    let (a, b) = (&cluster.nodes[0], &cluster.nodes[1]);
    let http = reqwest::Client::new();
    let post = |node: &Node, text: &str, turn_id: Option<&str>| {
        let mut request = http
            .post(format!("{}/v1/sessions/{key}/turns", node.public_url()))
            .body(json!({ "text": text }).to_string());
        if let Some(id) = turn_id {
            request = request.header("leasehold-turn-id", id);
        }
        request.send()
    };
    let given = uuid::Uuid::new_v4().to_string();
    assert_eq!(post(b, "given id", Some(&given)).await.unwrap().status(), 200, "forwarded to node-a");
    assert_eq!(post(a, "no id", None).await.unwrap().status(), 200);
    // node-a hands the session back; node-b takes it over at epoch 2 and thaws epoch 1's
    // checkpoint, then its own.
    a.drain().await;
    for text in ["moved", "moved again"] {
        let response = post(b, text, None).await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["leasehold-epoch"], "2");
    }

    let turns = format!("/sessions/{key}/turns");
    let ids = |node: &Node| -> Vec<String> {
        let got = support::received(record.path(), node, &turns);
        got.iter().map(|r| r["turn_id"].as_str().unwrap_or_default().to_owned()).collect()
    };
    let (on_a, on_b) = (ids(a), ids(b));
    assert_eq!((on_a.len(), on_b.len()), (3, 2), "first, given id, no id on node-a; two on node-b");
    assert_eq!(on_a[1], given, "the caller's turn id reaches the agent across the hop");
    let all: BTreeSet<&String> = on_a.iter().chain(&on_b).collect();
    assert_eq!(all.len(), 5, "a new id for every turn without one: {on_a:?} {on_b:?}");
    assert!(all.iter().all(|id| uuid::Uuid::parse_str(id).is_ok()), "{all:?}");
    let epochs: Vec<serde_json::Value> =
        support::received(record.path(), b, &turns).iter().map(|r| r["epoch"].clone()).collect();
    assert_eq!(epochs, ["2", "2"]);

    let thaws = |node: &Node| -> Vec<serde_json::Value> {
        let record = support::agent_record(record.path(), node);
        record.iter().filter(|r| r["thawed"] == key).map(|r| r["checkpoint_epoch"].clone()).collect()
    };
    assert_eq!(thaws(a), [json!(null), json!("1"), json!("1")], "none yet, then epoch 1's");
    assert_eq!(thaws(b), [json!("1"), json!("2")], "the checkpoint of epoch 1, then its own");
    assert_eq!(support::history(&db, key).await, ["first", "given id", "no id", "moved", "moved again"]);
}

/// The histograms move on the node that did the work: a turn entering at its owner is
/// `local` there; one entering elsewhere is `forwarded` (with one hop) at the entry node
/// and `local` at the owner. Store statements are timed by their label; every node
/// reports its build, and its heartbeat age stays below the node lease TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_histograms_count_local_and_forwarded_turns_on_the_right_nodes() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let options = ClusterOptions { nodes: 2, ..ClusterOptions::default() };
    let ttl = options.lease_ttl.as_secs_f64();
    let cluster = Cluster::start(&db, options).await.unwrap();
    let client = cluster.client();
    let owner = first_turn(&cluster, &client, "metered").await;
    let other = cluster.nodes.iter().position(|n| n.name != owner.name).unwrap();
    let entry = &cluster.nodes[other];
    let turns = "leasehold_turn_duration_seconds_count";
    let (local, forwarded) = (r#"path="local",outcome="answered""#, r#"path="forwarded",outcome="answered""#);
    assert_eq!(owner.metric(turns, local).await, 1.0, "the first turn ran at its owner");
    assert_eq!(entry.metric(turns, "").await, 0.0, "nothing reached the other node");

    let answer =
        client.post("/v1/sessions/metered/turns", r#"{"text":"b"}"#.into(), Some(other)).await.unwrap();
    assert_eq!(
        (answer.status, answer.owner.as_deref()),
        (200, Some(owner.name.as_str())),
        "{:?}",
        answer.json()
    );
    assert_eq!(entry.metric(turns, forwarded).await, 1.0, "the entry node forwarded it");
    assert_eq!(entry.metric(turns, "path=\"local\"").await, 0.0, "and ran nothing itself");
    assert_eq!(entry.metric("leasehold_forward_hop_seconds_count", r#"result="answered""#).await, 1.0);
    assert_eq!(owner.metric(turns, local).await, 2.0, "the owner ran it, arriving at its peer port");
    assert_eq!(owner.metric(turns, "path=\"forwarded\"").await, 0.0);
    assert_eq!(owner.metric("leasehold_forward_hop_seconds_count", "").await, 0.0);
    let claims = r#"statement="claim",outcome="ok""#;
    assert!(
        owner.metric("leasehold_store_statement_seconds_count", claims).await >= 1.0,
        "the claim was timed"
    );

    for node in &cluster.nodes {
        assert_eq!(node.metric("leasehold_build_info", "version=").await, 1.0, "{}", node.name);
        assert_eq!(node.metric("leasehold_node_lease_ttl_seconds", "").await, ttl, "{}", node.name);
    }
    // Over a few heartbeat intervals, each node's age since its last renewal stays below
    // the TTL (with renewals every interval, below half of it).
    for _ in 0..8 {
        for node in &cluster.nodes {
            let age = node.metric("leasehold_heartbeat_age_seconds", "").await;
            assert!(age > 0.0 && age < ttl / 2.0, "{}: heartbeat age {age} s, TTL {ttl} s", node.name);
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    // Those 2 s spanned several heartbeat intervals: the heartbeat's statements are timed
    // too (on its own pool), the registration once.
    for node in &cluster.nodes {
        let statements = "leasehold_store_statement_seconds_count";
        let renewals = node.metric(statements, r#"statement="renew node lease",outcome="ok""#).await;
        assert!(renewals >= 1.0, "{}: {renewals} renewals timed", node.name);
        assert_eq!(
            node.metric(statements, r#"statement="register boot",outcome="ok""#).await,
            1.0,
            "{}",
            node.name
        );
    }
}
