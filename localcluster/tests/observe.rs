//! Observe from any node: replay, live, following ownership, one upstream per node.

mod support;

use std::time::Duration;

use localcluster::{observer::turn_finished, Cluster, ClusterOptions, Observer};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(15);

fn stream_url(cluster: &Cluster, node: usize, key: &str) -> String {
    format!("{}/v1/sessions/{key}/stream", cluster.nodes[node].public_url())
}

async fn turn_at(
    cluster: &Cluster,
    node: usize,
    key: &str,
    body: serde_json::Value,
) -> leasehold_sidecar::client::Answer {
    cluster
        .client()
        .post(&format!("/v1/sessions/{key}/turns"), body.to_string().into(), Some(node))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn observers_on_other_nodes_see_the_owners_turn_in_order_with_replay_for_late_joiners() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let cluster = Cluster::start(&db, ClusterOptions::default()).await.unwrap();
    let key = "watched";
    assert_eq!(
        turn_at(&cluster, 0, key, json!({ "text": "one", "tokens": 0 })).await.owner.as_deref(),
        Some("node-a")
    );

    let mut on_b = Observer::open(&stream_url(&cluster, 1, key), None).await.unwrap();
    let mut on_c = Observer::open(&stream_url(&cluster, 2, key), None).await.unwrap();
    for observer in [&mut on_b, &mut on_c] {
        observer.until(WAIT, turn_finished(1)).await.unwrap(); // replay of the last turn: upstream is live
    }
    let turn = tokio::spawn({
        let client = cluster.client();
        async move {
            let body = json!({ "text": "two", "tokens": 10, "think_ms": 1000 }).to_string();
            client.post(&format!("/v1/sessions/{key}/turns"), body.into(), Some(0)).await.unwrap()
        }
    });
    // The late observer joins once turn two has begun (C has seen its `turn_started`).
    on_c.until(WAIT, |f| f.event.as_deref() == Some("turn_started") && f.id.as_deref() == Some("1-3"))
        .await
        .unwrap();
    let mut late_on_c = Observer::open(&stream_url(&cluster, 2, key), None).await.unwrap();
    assert_eq!(turn.await.unwrap().status, 200);

    for (name, observer) in [("B", &mut on_b), ("C", &mut on_c), ("late C", &mut late_on_c)] {
        observer.until(WAIT, turn_finished(2)).await.unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    // Turn one: 1-1 started, 1-2 finished. Turn two: 1-3 started, 1-4..1-13 tokens, 1-14 finished.
    let all: Vec<(i64, u64)> = (1..=14).map(|s| (1, s)).collect();
    assert_eq!(
        support::strictly_increasing(&on_b.ids()),
        all,
        "B: from the first event, no gap, no duplicate"
    );
    assert_eq!(support::strictly_increasing(&on_c.ids()), all, "C: the same");
    let late: Vec<(i64, u64)> = (3..=14).map(|s| (1, s)).collect();
    assert_eq!(
        support::strictly_increasing(&late_on_c.ids()),
        late,
        "late joiner: the current turn by replay, then live"
    );
    assert_eq!(cluster.nodes[1].metric("leasehold_upstreams", "").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn observers_follow_the_session_when_its_owner_dies() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let options = ClusterOptions { lease_ttl: Duration::from_secs(2), ..ClusterOptions::default() };
    let mut cluster = Cluster::start(&db, options).await.unwrap();
    let key = "failover";
    turn_at(&cluster, 0, key, json!({ "text": "one", "tokens": 3 })).await;
    let mut on_b = Observer::open(&stream_url(&cluster, 1, key), None).await.unwrap();
    let mut on_c = Observer::open(&stream_url(&cluster, 2, key), None).await.unwrap();
    for observer in [&mut on_b, &mut on_c] {
        observer.until(WAIT, turn_finished(1)).await.unwrap();
    }

    cluster.nodes[0].kill9();
    let survivors = leasehold_sidecar::client::Client::new(vec![
        cluster.nodes[1].public_url(),
        cluster.nodes[2].public_url(),
    ]);
    let answer = survivors.turn(key, &json!({ "text": "two", "tokens": 3 })).await.unwrap();
    assert_eq!((answer.status, answer.epoch), (200, Some(2)));

    for (name, observer) in [("B", &mut on_b), ("C", &mut on_c)] {
        observer.until(WAIT, turn_finished(2)).await.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            !observer.seen.iter().any(|f| f.event.as_deref() == Some("reconnect")),
            "{name} kept its connection"
        );
        let ids = support::strictly_increasing(&observer.ids());
        let first_new = ids.iter().position(|(e, _)| *e == 2).expect("saw epoch 2");
        assert!(
            ids[first_new..].iter().all(|(e, _)| *e == 2),
            "{name}: nothing of epoch 1 after epoch 2 began"
        );
        assert_eq!(ids[first_new..].len(), 5, "{name}: the whole new turn (started, 3 tokens, finished)");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_observers_over_three_nodes_cost_one_upstream_per_node() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let cluster = Cluster::start(&db, ClusterOptions::default()).await.unwrap();
    let key = "crowd";
    turn_at(&cluster, 0, key, json!({ "text": "one", "tokens": 0 })).await;
    let mut observers = Vec::new();
    for i in 0..1000 {
        observers.push(Observer::open(&stream_url(&cluster, i % 3, key), None).await.unwrap());
    }
    for observer in &mut observers {
        observer.until(WAIT, turn_finished(1)).await.unwrap();
    }
    assert_eq!(cluster.nodes[0].metric("leasehold_upstreams", "").await, 0.0, "the owner needs none");
    for node in &cluster.nodes[1..] {
        assert_eq!(
            node.metric("leasehold_upstreams", "").await,
            1.0,
            "{}: one upstream for 333 observers",
            node.name
        );
    }
    let mut total = 0.0;
    for node in &cluster.nodes {
        total += node.metric("leasehold_observers", "").await;
    }
    assert_eq!(total, 1000.0);

    turn_at(&cluster, 1, key, json!({ "text": "two", "tokens": 2 })).await;
    for observer in &mut observers {
        observer.until(WAIT, turn_finished(2)).await.unwrap();
        assert_eq!(observer.ids().len(), 6, "replayed turn (2 events) + live turn (4 events)");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_with_no_owner_stays_open_and_says_idle() {
    let db = support::database().await;
    let cluster = Cluster::start(&db, ClusterOptions { nodes: 2, ..Default::default() }).await.unwrap();
    let mut observer = Observer::open(&stream_url(&cluster, 1, "nobody-yet"), None).await.unwrap();
    observer.until(WAIT, |f| f.event.as_deref() == Some("idle")).await.unwrap();
    // The first turn gives it an owner; the observer sees it without reconnecting.
    turn_at(&cluster, 0, "nobody-yet", json!({ "text": "hi", "tokens": 1 })).await;
    observer.until(WAIT, turn_finished(1)).await.unwrap();
    assert_eq!(support::strictly_increasing(&observer.ids()), [(1, 1), (1, 2), (1, 3)]);
}

/// An observer that joins while the session is idle (released) sees the next owner's
/// turn live, and nothing of the turns that ended before it came.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_observer_joining_an_idle_session_gets_only_what_comes_after() {
    let db = support::database().await;
    let cluster = Cluster::start(&db, ClusterOptions { nodes: 2, ..Default::default() }).await.unwrap();
    let key = "idle-then-busy";
    // An observer on the owner keeps its buffer of the old turns alive.
    let _on_owner = Observer::open(&stream_url(&cluster, 0, key), None).await.unwrap();
    turn_at(&cluster, 0, key, json!({ "text": "old-1", "tokens": 2 })).await;
    turn_at(&cluster, 0, key, json!({ "text": "old-2", "tokens": 2 })).await;
    let released = reqwest::Client::new()
        .delete(format!("{}/v1/sessions/{key}/lease", cluster.nodes[0].agent_api_url()))
        .header("leasehold-epoch", 1)
        .send()
        .await
        .unwrap();
    assert_eq!(released.status(), 204);
    let mut observer = Observer::open(&stream_url(&cluster, 1, key), None).await.unwrap();
    observer.until(WAIT, |f| f.event.as_deref() == Some("idle")).await.unwrap();
    turn_at(&cluster, 0, key, json!({ "text": "new", "tokens": 1 })).await;
    observer.until(WAIT, turn_finished(3)).await.unwrap();
    assert_eq!(
        support::strictly_increasing(&observer.ids()),
        [(2, 1), (2, 2), (2, 3)],
        "{:?}",
        observer.seen
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn resuming_with_last_event_id_and_bad_ids() {
    let db = support::database().await;
    let cluster = Cluster::start(&db, ClusterOptions { nodes: 2, ..Default::default() }).await.unwrap();
    let key = "resume";
    turn_at(&cluster, 0, key, json!({ "text": "one", "tokens": 2 })).await;
    turn_at(&cluster, 0, key, json!({ "text": "two", "tokens": 2 })).await;
    let mut observer = Observer::open(&stream_url(&cluster, 1, key), Some("1-2")).await.unwrap();
    observer.until(WAIT, turn_finished(2)).await.unwrap();
    let expected: Vec<(i64, u64)> = (3..=8).map(|s| (1, s)).collect();
    assert_eq!(
        support::strictly_increasing(&observer.ids()),
        expected,
        "everything after 1-2, across both turns"
    );
    let bad = reqwest::get(format!("{}?after=banana", stream_url(&cluster, 0, key))).await.unwrap();
    assert_eq!(bad.status(), 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_observer_is_cut_with_a_clear_event_and_slows_nobody() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let db = support::database().await;
    let cluster = Cluster::start(&db, ClusterOptions { nodes: 1, ..Default::default() }).await.unwrap();
    let node = &cluster.nodes[0];
    let key = "firehose";
    let epoch = turn_at(&cluster, 0, key, json!({ "text": "one", "tokens": 0 })).await.epoch.unwrap();
    // A reader that connects and then does not read.
    let mut slow =
        tokio::net::TcpStream::connect((node.ip, localcluster::cluster::PUBLIC_PORT)).await.unwrap();
    slow.write_all(format!("GET /v1/sessions/{key}/stream HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut fast = Observer::open(&stream_url(&cluster, 0, key), None).await.unwrap();
    // Both observers are subscribed before anything is published.
    support::eventually("both observers open on the node", || async {
        node.metric("leasehold_observers", "").await == 2.0
    })
    .await;
    // Publish far more than socket buffers and the observer queue hold.
    let http = reqwest::Client::new();
    let payload = json!({ "type": "token", "data": { "pad": "x".repeat(16 * 1024) } }).to_string();
    for _ in 0..3000 {
        let response = http
            .post(format!("{}/v1/sessions/{key}/events", node.agent_api_url()))
            .header("leasehold-epoch", epoch)
            .body(payload.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 202, "publishing is never slowed into failure");
    }
    // The fast observer got everything.
    fast.until(WAIT, |f| f.id.as_deref() == Some(&format!("{epoch}-3002"))).await.unwrap();
    // The slow one, once it reads, finds it was cut with a clear event.
    let mut text = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), slow.read_to_end(&mut text)).await;
    let text = String::from_utf8_lossy(&text);
    assert!(text.contains("event: overflow"), "cut with an overflow event (got {} bytes)", text.len());
    assert!(node.metric("leasehold_observers_cut_total", "").await >= 1.0);
}

/// Resident memory of a process, from `/proc/<pid>/status`.
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// Turn each of `keys` once on `node` and have its agent release it (the session idled out).
async fn turn_and_release(node: &localcluster::Node, keys: std::ops::Range<usize>) {
    const TASKS: usize = 16;
    let keys: Vec<usize> = keys.collect();
    let tasks: Vec<_> = keys
        .chunks(keys.len().div_ceil(TASKS))
        .map(|chunk| {
            let (public, agent, chunk) = (node.public_url(), node.agent_url(), chunk.to_vec());
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                for i in chunk {
                    let turn = http.post(format!("{public}/v1/sessions/idle-{i}/turns"));
                    let answer =
                        turn.body(json!({"text": "x", "tokens": 0}).to_string()).send().await.unwrap();
                    assert_eq!(answer.status(), 200, "idle-{i}");
                    let released =
                        http.post(format!("{agent}/sessions/idle-{i}/release")).send().await.unwrap();
                    assert!(released.status().is_success(), "idle-{i} released: {}", released.status());
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
}

/// 10 000 sessions, each turned once on one node and released by its agent: no hub (and
/// no replay buffer) is left for any of them, and the sidecar's memory after the last
/// 9 000 is within a few MiB of what it was after the first 1 000.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_turned_once_and_released_leave_no_hub_behind() {
    /// Growth allowed from 1 000 to 10 000 released sessions: allocator slack, not per
    /// session state (a hub per session, as before, was ~100 KiB each: ~900 MiB here).
    const RSS_GROWTH_BOUND: u64 = 16 * 1024 * 1024;
    let _serial = support::serial().await;
    let db = support::database().await;
    let cluster =
        Cluster::start(&db, ClusterOptions { nodes: 1, ..ClusterOptions::default() }).await.unwrap();
    let node = &cluster.nodes[0];
    turn_and_release(node, 0..1_000).await;
    let warm = rss_bytes(node.sidecar.pid());
    turn_and_release(node, 1_000..10_000).await;
    assert_eq!(node.metric("leasehold_hubs", "").await, 0.0, "hubs of released sessions are dropped");
    assert_eq!(node.metric("leasehold_leases_held", "").await, 0.0);
    let after = rss_bytes(node.sidecar.pid());
    eprintln!("sidecar RSS after 1 000 released sessions {warm} B, after 10 000 {after} B");
    assert!(after <= warm + RSS_GROWTH_BOUND, "RSS grew from {warm} to {after} bytes");
}
