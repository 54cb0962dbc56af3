//! Drain: hand every lease back before shutdown so nobody waits for a TTL.

mod support;

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use leasehold_sidecar::client::Client;
use localcluster::{Cluster, ClusterOptions, Observer};
use rand::Rng;
use serde_json::json;

/// Long enough that any session waiting for it would show.
const TTL: Duration = Duration::from_secs(15);

fn options() -> ClusterOptions {
    ClusterOptions { lease_ttl: TTL, heartbeat: Duration::from_secs(1), ..ClusterOptions::default() }
}

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
    let mut observer = Observer::open(
        &format!("{}/v1/sessions/{}/stream", cluster.nodes[0].public_url(), owned_by_a[0]),
        None,
    )
    .await
    .unwrap();

    let stop = Instant::now() + Duration::from_secs(5);
    let drivers: Vec<_> =
        keys.iter().cloned().map(|key| tokio::spawn(drive(client.clone(), key, stop))).collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let in_flight_before = cluster.nodes[0].metric("leasehold_in_flight_turns", "").await;
    let drained_at = Instant::now();
    let report = cluster.nodes[0].drain(false).await;
    let drain_took = drained_at.elapsed();
    assert!(report["handed_back"].as_u64().unwrap() >= 1, "{report}");
    assert_eq!(report["in_flight_stood_down"], 0, "every in-flight turn finished: {report}");
    assert!(drain_took < TTL, "the drain itself is quick: {drain_took:?}");
    eprintln!("drain report {report} in {drain_took:?} (in flight when called: {in_flight_before})");

    // The drained node streams `reconnect` and refuses new work with a directive.
    observer.until(Duration::from_secs(5), |f| f.event.as_deref() == Some("reconnect")).await.unwrap();
    let ready = reqwest::get(format!("{}/readyz", cluster.nodes[0].admin_url())).await.unwrap();
    assert_eq!(ready.status(), 503);
    let leases: Vec<serde_json::Value> =
        reqwest::get(format!("{}/leases", cluster.nodes[0].admin_url())).await.unwrap().json().await.unwrap();
    assert!(leases.is_empty(), "nothing held after the hand-back: {leases:?}");

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
async fn sigterm_drains_first_and_sigterm_after_a_drain_exits_at_once() {
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
    // SIGTERM without a drain: the sidecar drains, then exits cleanly.
    let status = cluster.nodes[0].sidecar.terminate(Duration::from_secs(10)).expect("exited");
    assert!(status.success(), "{status:?}");
    for key in ["t-1", "t-2"] {
        assert_eq!(
            client.session(key, 1).await.unwrap()["claimable"],
            true,
            "{key} handed back, no TTL to wait"
        );
    }

    // A drain first, then SIGTERM: exits within a second.
    client.post("/v1/sessions/t-3/turns", json!({"text": "x"}).to_string().into(), Some(1)).await.unwrap();
    let report = cluster.nodes[1].drain(false).await;
    assert_eq!(report["handed_back"], 1);
    // The kubelet's preStop hook can only GET: the same idempotent drain.
    let again = cluster.nodes[1].drain(true).await;
    assert_eq!(again, report, "drain is idempotent");
    let started = Instant::now();
    let status = cluster.nodes[1].sidecar.terminate(Duration::from_secs(5)).expect("exited");
    assert!(status.success());
    assert!(started.elapsed() < Duration::from_secs(1), "exit after a drain took {:?}", started.elapsed());
}
