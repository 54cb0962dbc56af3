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

/// The ids `(epoch, first..=last)`.
fn run(epoch: i64, seqs: std::ops::RangeInclusive<u64>) -> Vec<(i64, u64)> {
    seqs.map(|s| (epoch, s)).collect()
}

/// CONTRACT §9: `Last-Event-ID` replays from the journal when memory no longer has it. The
/// owner is killed; the new owner (and a node that follows it) hold nothing of epoch 1 in
/// memory, yet an observer resuming after an event of epoch 1 gets the rest of epoch 1
/// from the journal, then epoch 2 (memory), then a turn running as it connects (live):
/// each event once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn last_event_id_of_a_dead_owners_epoch_replays_the_rest_from_the_journal() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let options = ClusterOptions { lease_ttl: Duration::from_secs(2), ..ClusterOptions::default() };
    let mut cluster = Cluster::start(&db, options).await.unwrap();
    let key = "journal-after-failover";
    // Epoch 1: 1-1 started, 1-2..1-6 tokens, 1-7 finished.
    let first = turn_at(&cluster, 0, key, json!({ "text": "one", "tokens": 5 })).await;
    assert_eq!((first.status, first.epoch), (200, Some(1)));

    cluster.nodes[0].kill9();
    let survivors = leasehold_sidecar::client::Client::new(vec![
        cluster.nodes[1].public_url(),
        cluster.nodes[2].public_url(),
    ]);
    // Epoch 2: 2-1 started, 2-2..2-4 tokens, 2-5 finished.
    let second = survivors.turn(key, &json!({ "text": "two", "tokens": 3 })).await.unwrap();
    assert_eq!((second.status, second.epoch), (200, Some(2)));
    let owner = cluster.index_of(second.owner.as_deref().expect("the answer names its owner"));
    let other = if owner == 1 { 2 } else { 1 };

    // A third turn is running while they connect (2-6 started, 2-7..2-16, 2-17 finished).
    let mut watcher = Observer::open(&stream_url(&cluster, owner, key), None).await.unwrap();
    let third = tokio::spawn({
        let client = cluster.client();
        async move {
            let body = json!({ "text": "three", "tokens": 10, "think_ms": 1000 }).to_string();
            client.post(&format!("/v1/sessions/{key}/turns"), body.into(), Some(owner)).await.unwrap()
        }
    });
    watcher.until(WAIT, |f| f.id.as_deref() == Some("2-7")).await.unwrap();
    let mut on_owner = Observer::open(&stream_url(&cluster, owner, key), Some("1-2")).await.unwrap();
    let mut on_other = Observer::open(&stream_url(&cluster, other, key), Some("1-2")).await.unwrap();
    assert_eq!(third.await.unwrap().status, 200);

    let expected: Vec<(i64, u64)> = [run(1, 3..=7), run(2, 1..=17)].concat();
    for (name, observer) in [("owner", &mut on_owner), ("follower", &mut on_other)] {
        observer.until(WAIT, turn_finished(3)).await.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            support::strictly_increasing(&observer.ids()),
            expected,
            "{name}: the rest of epoch 1 (journal), epoch 2 so far (memory), the rest live; {:?}",
            observer.seen
        );
        let controls: Vec<_> = observer.seen.iter().filter(|f| f.id.is_none()).collect();
        assert!(controls.is_empty(), "{name}: no gap reported, nothing cut: {controls:?}");
    }
}

/// A late observer resuming from the start of a session with 10 002 journaled events and
/// no owner (so nothing in any node's memory) gets the first 10 000 from the journal in
/// one connection, then `overflow` (the per-connect bound), and the rest by resuming.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_journaled_events_replay_to_a_late_observer() {
    /// Replaying 10 000 small events from the journal must not take longer than this
    /// (debug build, shared 2-core machine); the measured time is printed.
    const REPLAY_BOUND: Duration = Duration::from_secs(20);
    let _serial = support::serial().await;
    let db = support::database().await;
    let options = ClusterOptions { nodes: 2, ..ClusterOptions::default() };
    let cluster = Cluster::start(&db, options).await.unwrap();
    let key = "ten-thousand";
    let turn = turn_at(&cluster, 0, key, json!({ "text": "long", "tokens": 10_000 })).await;
    assert_eq!(turn.status, 200);
    // Hand the session back: no owner, and no node keeps its events in memory.
    cluster.nodes[0].drain().await;

    let started = tokio::time::Instant::now();
    let mut late = Observer::open(&stream_url(&cluster, 1, key), Some("1-0")).await.unwrap();
    late.until(WAIT * 2, |f| f.id.as_deref() == Some("1-10000")).await.unwrap();
    let took = started.elapsed();
    eprintln!("10 000 journaled events replayed to a late observer in {took:?}");
    assert!(took < REPLAY_BOUND, "replay took {took:?}");
    assert_eq!(support::strictly_increasing(&late.ids()), run(1, 1..=10_000));
    let overflow = late.until(WAIT, |f| f.id.is_none() && f.event.as_deref() != Some("idle")).await.unwrap();
    assert_eq!(overflow.event.as_deref(), Some("overflow"), "{overflow:?}");
    let data: serde_json::Value = serde_json::from_str(&overflow.data).unwrap();
    assert_eq!(data["last_event_id"], "1-10000");
    assert!(late.next(WAIT).await.is_none(), "the stream closes after overflow");

    let mut resumed = Observer::open(&stream_url(&cluster, 1, key), Some("1-10000")).await.unwrap();
    resumed.until(WAIT, turn_finished(1)).await.unwrap();
    assert_eq!(support::strictly_increasing(&resumed.ids()), run(1, 10_001..=10_002));
}

/// The journal cannot be read (node-b is cut off from the store) when an observer resumes
/// after an id node-b's memory no longer reaches: the stream says what it missed
/// (`missed`) and goes on with what memory holds, then live; it is not failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_outage_during_the_journal_read_serves_memory_and_says_what_is_missing() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let link = localcluster::Link::to_database(&db).await.unwrap();
    let options = ClusterOptions {
        nodes: 2,
        database_urls: vec![None, Some(link.database_url(&db))],
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start(&db, options).await.unwrap();
    let key = "journal-unreachable";
    // 1-1 started, 1-2..1-1101 tokens, 1-1102 finished: memory keeps the last 1024.
    turn_at(&cluster, 0, key, json!({ "text": "long", "tokens": 1100 })).await;
    let oldest_kept = 1102 - leasehold_sidecar::observe::REPLAY_CAPACITY as u64 + 1;
    // node-b follows node-a and holds its buffer.
    let mut watcher = Observer::open(&stream_url(&cluster, 1, key), None).await.unwrap();
    watcher.until(WAIT, turn_finished(1)).await.unwrap();

    link.cut();
    let mut resumed = Observer::open(&stream_url(&cluster, 1, key), Some("1-1")).await.unwrap();
    let notice = resumed.next(WAIT).await.expect("a first frame");
    assert_eq!((notice.id.as_deref(), notice.event.as_deref()), (None, Some("missed")), "{notice:?}");
    let data: serde_json::Value = serde_json::from_str(&notice.data).unwrap();
    assert_eq!(data["last_event_id"], "1-1");
    assert_eq!(data["next_event_id"], format!("1-{oldest_kept}"));
    assert_eq!(data["missed"], oldest_kept - 2);
    assert_eq!(data["reason"], "store_unavailable");
    resumed.until(WAIT, turn_finished(1)).await.unwrap();
    assert_eq!(support::strictly_increasing(&resumed.ids()), run(1, oldest_kept..=1102), "memory, all of it");
    link.mend();
    // Live goes on (node-a owns the session and its store link is whole).
    turn_at(&cluster, 0, key, json!({ "text": "more", "tokens": 1 })).await;
    resumed.until(WAIT, turn_finished(2)).await.unwrap();
    assert!(!resumed.closed(), "the stream was not failed");
}
