//! Client headers across the hop, with real processes: the headers `--forward-headers`
//! names reach the agent with a turn, whether it runs on the pod it entered or is
//! forwarded to the owner's sidecar; any other header does not; a peer request may carry
//! only the listed headers its proof covers.

mod support;

use leasehold_core::proof::{PeerAuth, Signed};
use localcluster::{Cluster, ClusterOptions, Node};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::json;

/// Sends one turn for `key` to `node`'s public port with `headers`; asserts it ran on
/// node-a (the owner).
async fn turn_via(node: &Node, key: &str, text: &str, headers: &[(&str, &str)]) {
    let request = reqwest::Client::new()
        .post(format!("{}/v1/sessions/{key}/turns", node.public_url()))
        .body(json!({ "text": text, "tokens": 2 }).to_string());
    let request = headers.iter().fold(request, |r, (name, value)| r.header(*name, *value));
    let response = request.send().await.unwrap();
    let owner = response.headers().get("leasehold-owner").map(|v| v.to_str().unwrap().to_owned());
    assert_eq!(response.status(), 200, "{text}: {:?}", response.text().await);
    assert_eq!(owner.as_deref(), Some("node-a"), "{text} ran on the owner");
}

/// The headers the recording agent of `node` got with the turn whose text is `text`, as
/// (lower-case name, value) pairs in order.
fn headers_of(record: &std::path::Path, node: &Node, key: &str, text: &str) -> Vec<(String, String)> {
    let turns = support::received(record, node, &format!("/sessions/{key}/turns"));
    let turn = turns
        .iter()
        .find(|r| {
            serde_json::from_str::<serde_json::Value>(r["body"].as_str().unwrap()).unwrap()["text"] == text
        })
        .unwrap_or_else(|| panic!("{} never got {text:?}: {turns:?}", node.name));
    let pairs = turn["headers"].as_array().expect("the record names the headers");
    pairs.iter().map(|p| (p[0].as_str().unwrap().to_owned(), p[1].as_str().unwrap().to_owned())).collect()
}

fn values<'a>(headers: &'a [(String, String)], name: &str) -> Vec<&'a str> {
    headers.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_str()).collect()
}

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// Two pods with the recording hold agent, each sidecar given `env`.
async fn cluster(db: &str, record: &std::path::Path, env: Vec<(String, String)>) -> Cluster {
    let options = ClusterOptions {
        nodes: 2,
        agent_command: support::recording_hold_agent(record),
        sidecar_env: vec![env.clone(), env],
        ..Default::default()
    };
    Cluster::start(db, options).await.unwrap()
}

/// With the default list: Authorization, traceparent, X-Request-Id and Accept (both of
/// its values) reach node-a's agent for a turn sent to node-a and for one sent to node-b
/// and forwarded; a header not in the list reaches it on neither path; node-b's agent
/// gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn listed_headers_reach_the_agent_on_the_local_and_the_forwarded_path_and_others_do_not() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let record = tempfile::tempdir().unwrap();
    let cluster = cluster(&db, record.path(), Vec::new()).await;
    let (a, b) = (&cluster.nodes[0], &cluster.nodes[1]);
    let sent = [
        ("Authorization", "Bearer user-7"),
        ("traceparent", TRACEPARENT),
        ("X-Request-Id", "req-42"),
        ("Accept", "application/json"),
        ("Accept", "text/event-stream"),
        ("X-Not-Listed", "secret-ish"),
    ];
    turn_via(a, "carried", "local", &sent).await;
    turn_via(b, "carried", "forwarded", &sent).await;
    assert!(b.metric("leasehold_turns_total", "path=\"forwarded\"").await >= 1.0, "node-b forwarded it");

    for text in ["local", "forwarded"] {
        let got = headers_of(record.path(), a, "carried", text);
        assert_eq!(values(&got, "authorization"), ["Bearer user-7"], "{text}: {got:?}");
        assert_eq!(values(&got, "traceparent"), [TRACEPARENT], "{text}: {got:?}");
        assert_eq!(values(&got, "x-request-id"), ["req-42"], "{text}: {got:?}");
        assert_eq!(values(&got, "accept"), ["application/json", "text/event-stream"], "{text}: {got:?}");
        assert!(values(&got, "x-not-listed").is_empty(), "{text}: an unlisted header reached the agent");
        assert!(values(&got, "leasehold-peer-signature").is_empty(), "{text}: the proof is the sidecars'");
    }
    let b_turns = support::received(record.path(), b, "/sessions/carried/turns");
    assert!(b_turns.is_empty(), "the non-owner's agent ran nothing: {b_turns:?}");
}

/// `LEASEHOLD_FORWARD_HEADERS` replaces the default list: X-Tenant reaches the agent on
/// both paths, Authorization (a default) no longer does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_custom_list_replaces_the_default() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let record = tempfile::tempdir().unwrap();
    let env = vec![("LEASEHOLD_FORWARD_HEADERS".to_owned(), "x-TENANT".to_owned())];
    let cluster = cluster(&db, record.path(), env).await;
    let (a, b) = (&cluster.nodes[0], &cluster.nodes[1]);
    let sent = [("X-Tenant", "acme"), ("Authorization", "Bearer user-7"), ("traceparent", TRACEPARENT)];
    turn_via(a, "custom", "local", &sent).await;
    turn_via(b, "custom", "forwarded", &sent).await;
    for text in ["local", "forwarded"] {
        let got = headers_of(record.path(), a, "custom", text);
        assert_eq!(values(&got, "x-tenant"), ["acme"], "{text}: {got:?}");
        assert!(values(&got, "authorization").is_empty(), "{text}: not listed any more: {got:?}");
        assert!(values(&got, "traceparent").is_empty(), "{text}: not listed any more: {got:?}");
    }
}

/// A peer request whose proof does not cover a listed header (one added after signing,
/// by anything between the pods) runs, but that header does not reach the agent; one
/// the proof covers does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_listed_header_the_peer_proof_does_not_cover_is_dropped() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let record = tempfile::tempdir().unwrap();
    let secret = format!("secret-{}", uuid::Uuid::new_v4().simple());
    let options = ClusterOptions {
        nodes: 1,
        agent_command: support::recording_hold_agent(record.path()),
        cluster_secret: Some(secret.clone()),
        ..Default::default()
    };
    let cluster = Cluster::start(&db, options).await.unwrap();
    let a = &cluster.nodes[0];
    let path = "/peer/v1/sessions/proved/turns";
    let body = json!({ "text": "via the peer port", "tokens": 2 }).to_string();
    let mut headers = HeaderMap::new();
    headers.insert("leasehold-turn-id", uuid::Uuid::new_v4().to_string().parse().unwrap());
    headers.insert("x-request-id", HeaderValue::from_static("covered-1"));
    let signed =
        Signed { method: "POST", path, destination: "node-a", headers: &headers, body: body.as_bytes() };
    let proof = PeerAuth::new(Some(&secret), None).sign(&signed, &[HeaderName::from_static("x-request-id")]);
    headers.insert("authorization", HeaderValue::from_static("Bearer injected"));
    let request = reqwest::Client::new().post(format!("{}{path}", a.peer_url())).body(body);
    let request =
        headers.iter().chain(proof.iter().map(|(n, v)| (n, v))).fold(request, |r, (n, v)| r.header(n, v));
    let response = request.send().await.unwrap();
    assert_eq!(response.status(), 200, "{:?}", response.text().await);
    let got = headers_of(record.path(), a, "proved", "via the peer port");
    assert_eq!(values(&got, "x-request-id"), ["covered-1"], "{got:?}");
    assert!(values(&got, "authorization").is_empty(), "an uncovered header reached the agent: {got:?}");
}
