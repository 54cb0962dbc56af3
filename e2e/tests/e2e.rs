//! End-to-end scenarios on a real Kubernetes cluster. Run with
//! `cargo test -p leasehold-e2e --features e2e -- --test-threads=1 --nocapture`
//! after sourcing the e2e env file (see `leasehold_e2e::settings`).
//!
//! Each scenario has its own namespace, database and AgentCluster of 3 demo-agent pods
//! (`leasehold_e2e::Fixture`), talks to pods only through the API server's pod proxy, and
//! prints one `E2E-TIMING scenario=... seconds=...` line.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use k8s_openapi::api::core::v1::{Event, Pod};
use kube::{
    api::{DeleteParams, Patch, PatchParams, PostParams},
    Api, ResourceExt,
};
use leasehold_e2e::{
    client::{Client, Pods},
    database::node_of,
    logs::{drained_before_shutdown, LogFollower},
    observer::{strictly_increasing, Frame, Observer},
    pods::{is_ready, DELETION_COST, SIDECAR_CONTAINER},
    proxy::PUBLIC_PORT,
    report::{max_gap, ms, timing},
    spec, Fixture, CLUSTER,
};
use rand::distr::{Alphanumeric, SampleString};
use serde_json::{json, Value};
use tokio::time::Instant;

/// How long a stream may take to show what a scenario waits for.
const WAIT: Duration = Duration::from_secs(30);

fn suffix() -> String {
    Alphanumeric.sample_string(&mut rand::rng(), 6).to_ascii_lowercase()
}

fn turn_body(text: &str, think_ms: u64, tokens: u32) -> Value {
    json!({ "text": text, "think_ms": think_ms, "tokens": tokens })
}

fn turns_path(key: &str) -> String {
    format!("/v1/sessions/{key}/turns")
}

fn is_event(kind: &'static str) -> impl Fn(&Frame) -> bool {
    move |f| f.event.as_deref() == Some(kind)
}

/// A turn that must succeed (after any directives) and be served by `owner` if given.
async fn turn_ok(client: &Client, key: &str, text: &str, first: Option<&str>, owner: Option<&str>) -> i64 {
    let answer = client
        .turn(key, &turn_body(text, 0, 1), first)
        .await
        .unwrap_or_else(|e| panic!("{key} {text:?}: {e}"));
    assert_eq!(answer.status, 200, "{key} {text:?}: {}", answer.text());
    if let Some(owner) = owner {
        assert_eq!(answer.owner.as_deref(), Some(owner), "{key} {text:?} served by the expected pod");
    }
    answer.epoch.expect("Leasehold-Epoch header")
}

/// 1. A stream opened on pod B sees a turn served by pod A from its first event, in order;
///    a stream opened on pod C mid-turn gets the earlier events by replay, then the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_from_anywhere() {
    let f = Fixture::start("observe_from_anywhere").await;
    let started = Instant::now();
    let pods = f.ready_pods().await;
    let (a, b, c) = (pods[0].clone(), pods[1].clone(), pods[2].clone());
    let proxy = f.proxy();
    let client = f.client_over(Pods::Fixed(pods.clone()));
    let key = format!("watched-{}", suffix());

    // B observes a session nobody owns yet.
    let mut on_b = Observer::open(&proxy, &b, &key, None).await.expect("stream on B");
    let sent = Instant::now();
    let turn = tokio::spawn({
        let (client, key, a) = (client.clone(), key.clone(), a.clone());
        // 10 tokens over 3 s: turn_started, token x10, turn_finished = ids 1-1 .. 1-12.
        async move { client.turn(&key, &turn_body("slow", 3000, 10), Some(&a)).await }
    });
    on_b.until(WAIT, is_event("turn_started")).await.expect("B sees the turn start");
    let first_event = sent.elapsed();
    on_b.until(WAIT, |f| f.event.as_deref() == Some("token") && f.data.contains("\"i\":2"))
        .await
        .expect("B sees tokens");
    let b_had = on_b.events();
    let c_opened = Instant::now();
    let mut on_c = Observer::open(&proxy, &c, &key, None).await.expect("stream on C");

    let answer = turn.await.unwrap().expect("the turn");
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(answer.owner.as_deref(), Some(a.as_str()), "A claimed the fresh session and served it");
    assert_eq!(answer.epoch, Some(1));
    for (name, observer) in [("B", &mut on_b), ("C", &mut on_c)] {
        observer.until(WAIT, is_event("turn_finished")).await.unwrap_or_else(|e| panic!("{name}: {e}"));
    }

    let all: Vec<(i64, u64)> = (1..=12).map(|s| (1, s)).collect();
    assert_eq!(
        strictly_increasing(&on_b.ids()).unwrap(),
        all,
        "B: from the first event, no gap, no duplicate"
    );
    assert_eq!(strictly_increasing(&on_c.ids()).unwrap(), all, "C: earlier events by replay, then live");
    let kinds: Vec<String> = on_b
        .frames_seen()
        .iter()
        .filter(|f| f.id.is_some())
        .map(|f| f.event.clone().unwrap_or_default())
        .collect();
    let mut expected_kinds = vec!["turn_started".to_owned()];
    expected_kinds.extend(std::iter::repeat_n("token".to_owned(), 10));
    expected_kinds.push("turn_finished".to_owned());
    assert_eq!(kinds, expected_kinds);
    let started_frame =
        on_b.frames_seen().into_iter().find(|f| f.event.as_deref() == Some("turn_started")).cloned();
    assert!(started_frame.unwrap().data.contains(&a), "turn_started names the owner A");
    assert!((3..12).contains(&b_had), "C opened mid-turn (B had seen {b_had} events)");
    // C's earlier events arrived as one replay right after it connected, the rest live.
    let c_times: Vec<Instant> = on_c.seen.iter().filter(|(f, _)| f.id.is_some()).map(|(_, at)| *at).collect();
    let replayed =
        c_times.iter().filter(|at| at.duration_since(c_opened) < Duration::from_millis(250)).count();
    eprintln!("C: {replayed} events within 250 ms of connecting (B had seen {b_had} when C opened)");
    assert!(replayed >= b_had.min(3), "C got the earlier events by replay at once");
    timing(
        "observe_from_anywhere",
        started.elapsed(),
        &[("first_event_ms", ms(first_event)), ("replayed", replayed.to_string())],
    );
}

/// One acknowledged turn of the load.
#[derive(Debug, Clone)]
struct Ack {
    text: String,
    owner: String,
    at: Instant,
    /// How the answer was reached: pods tried, directives obeyed, time taken.
    path: String,
}

/// A turn that failed: no directive, an answer that may or may not mean it ran.
#[derive(Debug, Clone)]
struct Failure {
    text: String,
    /// Wall clock (UTC), to line up with the pods' logs.
    when: jiff::Timestamp,
    what: String,
}

#[derive(Debug, Default)]
struct SessionLog {
    acks: Vec<Ack>,
    failures: Vec<Failure>,
    directives: BTreeMap<String, usize>,
    /// Sends the API server could not deliver: pod gone / refused, and (separately) a
    /// pooled connection the pod had closed.
    not_reached: usize,
    closed_connections: usize,
}

/// Send turns for `key` back to back to random Ready pods until `stop`. A failed turn is
/// recorded and the session goes on (the check then tells whether it ran).
async fn drive(client: Client, key: String, stop: Arc<AtomicBool>) -> SessionLog {
    let mut log = SessionLog::default();
    let mut i = 0;
    while !stop.load(Ordering::Relaxed) {
        let text = format!("{key}/{i}");
        i += 1;
        let sent = Instant::now();
        let answer = client.turn(&key, &turn_body(&text, 100, 2), None).await;
        let when = jiff::Timestamp::now();
        let what = match answer {
            Ok(answer) if answer.status == 200 => {
                for d in &answer.directives {
                    *log.directives.entry(d.clone()).or_default() += 1;
                }
                for (_, why) in &answer.not_reached {
                    if why.contains("closed idle connection") || why.contains("broken pipe") {
                        log.closed_connections += 1;
                    } else {
                        log.not_reached += 1;
                    }
                }
                let path = format!(
                    "{:?} via {} (not reached: {:?}; directives: {:?})",
                    sent.elapsed(),
                    answer.answered_by,
                    answer.not_reached,
                    answer.directives
                );
                log.acks.push(Ack {
                    text,
                    owner: answer.owner.unwrap_or_default(),
                    at: Instant::now(),
                    path,
                });
                continue;
            }
            Ok(answer) => {
                format!("on {}: {} {}", answer.answered_by, answer.status, answer.text().trim_end())
            }
            Err(e) => e.to_string(),
        };
        log.failures.push(Failure { text, when, what });
    }
    log
}

/// 2. A rolling deploy under continuous load: zero failed turns, no session waits, every
///    acknowledged turn checkpointed once in order, every old pod drained before SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_deploy_under_load() {
    const SESSIONS: usize = 20;
    // The hand-off gap (the turn after an owner change): the target, against the
    // TTL (15 s) a crash costs.
    const MAX_HANDOFF_GAP: Duration = Duration::from_secs(1);
    // Between two turns served by the same pod nothing is handed off; this only catches
    // a session left waiting (a TTL, a retry loop) while tolerating a slow moment on a
    // loaded two-core node (one such turn took 1.16 s once, with no directive).
    const MAX_PLAIN_GAP: Duration = Duration::from_secs(3);
    let f = Fixture::start("rolling_deploy_under_load").await;
    let old = f.ready_pods().await;
    let followers: Vec<LogFollower> =
        old.iter().map(|pod| LogFollower::start(f.pods(), pod, SIDECAR_CONTAINER)).collect();
    let ready = f.watch_ready().await;
    let client = f.client_over(Pods::Ready(ready.clone()));
    let stop = Arc::new(AtomicBool::new(false));
    let keys: Vec<String> = (0..SESSIONS).map(|i| format!("roll-{i}")).collect();
    let drivers: Vec<_> =
        keys.iter().map(|key| tokio::spawn(drive(client.clone(), key.clone(), stop.clone()))).collect();
    tokio::time::sleep(Duration::from_secs(3)).await;

    let stamp = suffix();
    let patch = json!({ "spec": { "template": { "spec": { "containers": [
        spec::agent_container(&f.settings.agent_image(), &[("E2E_ROLL", &stamp)])
    ] } } } });
    f.clusters()
        .patch(CLUSTER, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("patch the template");
    let rollout = Instant::now();
    f.wait_pods("every pod replaced and Ready", Duration::from_secs(420), |pods| {
        pods.len() == 3 && pods.iter().all(|p| is_ready(p) && !old.contains(&p.name_any()))
    })
    .await;
    let rolled = rollout.elapsed();
    eprintln!("rollout done in {:.1}s; load goes on a few seconds more", rolled.as_secs_f64());
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::Relaxed);
    let mut logs = BTreeMap::new();
    for (key, driver) in keys.iter().zip(drivers) {
        logs.insert(key.clone(), driver.await.expect("driver"));
    }
    // Every check runs and reports; the test fails at the end with all problems found.
    let mut problems: Vec<String> = Vec::new();

    let mut directives: BTreeMap<String, usize> = BTreeMap::new();
    for log in logs.values() {
        for (d, n) in &log.directives {
            *directives.entry(d.clone()).or_default() += n;
        }
    }
    let turns: usize = logs.values().map(|l| l.acks.len()).sum();
    let not_reached: usize = logs.values().map(|l| l.not_reached).sum();
    let closed: usize = logs.values().map(|l| l.closed_connections).sum();
    let failed: usize = logs.values().map(|l| l.failures.len()).sum();
    eprintln!(
        "{turns} acknowledged turns, {failed} failed; directives obeyed {directives:?}; {not_reached} sends \
         to pods already gone; {closed} sends on a pooled connection the pod had closed (resent elsewhere)"
    );

    // Every session's checkpoint history is exactly its acknowledged turns, in order; a
    // failed turn is reported with whether it ran after all.
    let db = f.db();
    for (key, log) in &logs {
        let history = db.history(key).await;
        for failure in &log.failures {
            let ran = history.contains(&failure.text);
            problems.push(format!(
                "failed turn {} at {} (it {} run): {}",
                failure.text,
                failure.when,
                if ran { "DID" } else { "did not" },
                failure.what
            ));
        }
        let failed: Vec<&String> = log.failures.iter().map(|f| &f.text).collect();
        let checkpointed: Vec<String> = history.into_iter().filter(|t| !failed.contains(&t)).collect();
        let expected: Vec<String> = log.acks.iter().map(|a| a.text.clone()).collect();
        if expected.is_empty() {
            problems.push(format!("{key} made no progress"));
        }
        if checkpointed != expected {
            problems
                .push(format!("{key}: checkpoint != acknowledged turns: {checkpointed:?} vs {expected:?}"));
        }
    }

    // No session waited: the gap between consecutive acknowledged turns stays small, and
    // a hand-off (the next turn served by another pod) costs well under a second.
    let (mut worst, mut worst_handoff) = (Duration::ZERO, Duration::ZERO);
    for (key, log) in &logs {
        for w in log.acks.windows(2) {
            let gap = w[1].at - w[0].at;
            let handoff = w[0].owner != w[1].owner;
            if handoff {
                worst_handoff = worst_handoff.max(gap);
            }
            let limit = if handoff { MAX_HANDOFF_GAP } else { MAX_PLAIN_GAP };
            if gap >= limit {
                problems.push(format!(
                    "{key} waited {gap:?} (limit {limit:?}) between {} ({}) and {} ({}), the latter took {}",
                    w[0].text, w[0].owner, w[1].text, w[1].owner, w[1].path
                ));
            }
        }
        let at: Vec<Instant> = log.acks.iter().map(|a| a.at).collect();
        worst = worst.max(max_gap(&at));
    }
    let owners: BTreeSet<&str> =
        logs.values().flat_map(|l| l.acks.iter().map(|a| a.owner.as_str())).collect();
    if !owners.iter().any(|o| !old.iter().any(|p| p == o)) {
        problems.push(format!("no new pod served a turn: {owners:?}"));
    }

    // Every old pod handed its leases back before its containers got SIGTERM.
    let mut handed_back = 0;
    for follower in &followers {
        if !follower.ended(Duration::from_secs(90)).await {
            problems.push(format!("{}: the sidecar did not exit", follower.pod));
        }
        let lines = follower.lines();
        match drained_before_shutdown(&lines) {
            Ok(report) => {
                if report.in_flight_stood_down != 0 {
                    problems.push(format!("{}: in-flight turns stood down: {report:?}", follower.pod));
                }
                handed_back += report.handed_back;
            }
            Err(e) => problems.push(format!("{}: {e}", follower.pod)),
        }
    }
    let live = db.live_leases_of(&old).await;
    if !live.is_empty() {
        problems.push(format!("leases still naming an old pod: {live:?}"));
    }
    for node in db.nodes(&old, spec::LEASE_TTL).await {
        if node.live || !node.expired_on_purpose {
            problems.push(format!("{}: not handed back: {node:?}", node.owner));
        }
    }
    timing(
        "rolling_deploy",
        rolled,
        &[
            ("max_gap_ms", ms(worst)),
            ("max_handoff_gap_ms", ms(worst_handoff)),
            ("turns", turns.to_string()),
            ("failed", failed.to_string()),
            ("sessions", SESSIONS.to_string()),
            ("handed_back", handed_back.to_string()),
            ("directives", directives.values().sum::<usize>().to_string()),
            ("closed_connections", closed.to_string()),
        ],
    );
    if !problems.is_empty() {
        for follower in &followers {
            eprintln!("----- sidecar log of old pod {} -----\n{}", follower.pod, follower.lines().join("\n"));
        }
        panic!("{} problems:\n{}", problems.len(), problems.join("\n"));
    }
}

/// The set-up of the scenarios that take a pod away: `n` sessions owned by the first
/// Ready pod (the victim), each with `turns` acknowledged turns, and a client over the
/// other pods (the survivors).
struct Orphans {
    victim: String,
    survivors: Vec<String>,
    keys: Vec<String>,
    /// A client over every pod.
    client: Client,
    /// A client over the survivors only.
    elsewhere: Client,
}

async fn orphans(f: &Fixture, prefix: &str, n: usize, turns: &[&str]) -> Orphans {
    let pods = f.ready_pods().await;
    let (victim, survivors) = (pods[0].clone(), pods[1..].to_vec());
    let client = f.client_over(Pods::Fixed(pods.clone()));
    let keys: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    for key in &keys {
        for text in turns {
            assert_eq!(turn_ok(&client, key, text, Some(&victim), Some(&victim)).await, 1);
        }
    }
    let elsewhere = f.client_over(Pods::Fixed(survivors.clone()));
    Orphans { victim, survivors, keys, client, elsewhere }
}

/// How long the operator may take to record what it did about a pod as an Event.
const OPERATOR_EVENT_WITHIN: Duration = Duration::from_secs(10);

/// The reasons of the operator's Events about freeing `pod`'s leases, waiting until one
/// of `wanted` is among them (at most [`OPERATOR_EVENT_WITHIN`]).
async fn operator_events(f: &Fixture, pod: &str, wanted: &[&str]) -> Vec<String> {
    let deadline = Instant::now() + OPERATOR_EVENT_WITHIN;
    loop {
        let events =
            Api::<Event>::namespaced(f.client.clone(), &f.ns).list(&Default::default()).await.unwrap();
        let freed_by: Vec<String> = events
            .items
            .iter()
            .filter(|e| {
                let reason = e.reason.as_deref().unwrap_or("");
                ["Drained", "DrainFailed", "LeasesRevoked", "RevokeFailed"].contains(&reason)
                    && e.message.as_deref().unwrap_or("").contains(pod)
            })
            .map(|e| {
                eprintln!("operator event {:?}: {:?}", e.reason, e.message);
                e.reason.clone().unwrap_or_default()
            })
            .collect();
        if freed_by.iter().any(|r| wanted.contains(&r.as_str())) || Instant::now() >= deadline {
            return freed_by;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// 3. A force-deleted owner: the operator frees its leases (a drain of the terminating
///    pod, or a revocation of the pod gone); each of its sessions is served elsewhere
///    within 3 s (the TTL is 15 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_delete_owner() {
    const WITHIN: Duration = Duration::from_secs(3);
    let f = Fixture::start("force_delete_owner").await;
    let o = orphans(&f, "orphan", 4, &["t1", "t2"]).await;
    let control = "control";
    turn_ok(&o.client, control, "t1", Some(&o.survivors[0]), Some(&o.survivors[0])).await;

    let deleted = Instant::now();
    f.pods()
        .delete(&o.victim, &DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() })
        .await
        .expect("force-delete the owner");
    let tasks: Vec<_> = o
        .keys
        .iter()
        .map(|key| {
            let (client, key) = (o.elsewhere.clone(), key.clone());
            tokio::spawn(async move {
                let answer = client.turn(&key, &turn_body("t3", 0, 1), None).await;
                (key, answer, deleted.elapsed())
            })
        })
        .collect();
    let mut worst = Duration::ZERO;
    let mut per_session = Vec::new();
    for task in tasks {
        let (key, answer, took) = task.await.unwrap();
        let answer = answer.unwrap_or_else(|e| panic!("{key}: {e}"));
        assert_eq!(answer.status, 200, "{key}: {}", answer.text());
        let owner = answer.owner.clone().unwrap_or_default();
        assert!(o.survivors.contains(&owner), "{key} served by a survivor, not {owner}");
        assert_eq!(answer.epoch, Some(2), "{key}: taken over at the next epoch");
        eprintln!(
            "{key}: served by {owner} {took:?} after the force delete (directives {:?})",
            answer.directives
        );
        per_session.push(took.as_millis().to_string());
        worst = worst.max(took);
        assert_eq!(f.db().history(&key).await, ["t1", "t2", "t3"], "{key}: history intact");
    }
    turn_ok(&o.client, control, "t2", Some(&o.survivors[1]), Some(&o.survivors[0])).await;
    assert_eq!(f.db().history(control).await, ["t1", "t2"]);
    let freed_by = operator_events(&f, &o.victim, &["Drained", "LeasesRevoked"]).await;
    timing(
        "force_delete_owner",
        worst,
        &[
            ("max_ms", ms(worst)),
            ("per_session_ms", per_session.join(",")),
            ("ttl_ms", ms(spec::LEASE_TTL)),
            ("operator_events", freed_by.join(",")),
        ],
    );
    assert!(
        freed_by.iter().any(|r| r == "Drained" || r == "LeasesRevoked"),
        "the operator drained the deleted pod or revoked its leases: {freed_by:?}"
    );
    assert!(worst <= WITHIN, "a session of the deleted pod waited {worst:?} (> {WITHIN:?})");
}

/// 3b. A pod Kubernetes reports failed: the operator revokes its node leases (it does
///     not drain a failed pod), so its sessions are served elsewhere within 3 s. The
///     failure is reported through the pod's status (as a node-level failure would be);
///     the kubelet then stops the pod's containers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_pod_revoked() {
    const WITHIN: Duration = Duration::from_secs(3);
    let f = Fixture::start("failed_pod_revoked").await;
    let o = orphans(&f, "failed", 4, &["t1"]).await;
    let failed_at = Instant::now();
    let status = json!({ "status": { "phase": "Failed", "reason": "E2EFailed", "message": "failed by the e2e suite" } });
    f.pods()
        .patch_status(&o.victim, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("report the pod failed");
    let mut worst = Duration::ZERO;
    for key in &o.keys {
        // Until the revocation lands the failed pod is still the live owner, and a turn
        // forwarded to it is served there at its epoch: keep going until one is not.
        let mut acknowledged = vec!["t1".to_owned()];
        let answer = loop {
            let text = format!("t{}", acknowledged.len() + 1);
            let answer = o
                .elsewhere
                .turn(key, &turn_body(&text, 0, 1), None)
                .await
                .unwrap_or_else(|e| panic!("{key}: {e}"));
            assert_eq!(answer.status, 200, "{key}: {}", answer.text());
            acknowledged.push(text);
            if answer.owner.as_deref() != Some(o.victim.as_str()) {
                break answer;
            }
            assert_eq!(answer.epoch, Some(1), "{key}: the failed pod only ever served its own epoch");
            assert!(failed_at.elapsed() < WITHIN, "{key}: still served by the failed pod after {WITHIN:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let took = failed_at.elapsed();
        assert_eq!(answer.epoch, Some(2), "{key}: taken over at the next epoch");
        eprintln!(
            "{key}: served by {:?} {took:?} after the pod was reported failed ({:?}; {} turn(s) still on the failed pod before)",
            answer.owner,
            answer.directives,
            acknowledged.len() - 2
        );
        worst = worst.max(took);
        assert_eq!(f.db().history(key).await, acknowledged, "{key}: history intact");
    }
    let freed_by = operator_events(&f, &o.victim, &["LeasesRevoked"]).await;
    timing("failed_pod_revoked", worst, &[("max_ms", ms(worst)), ("operator_events", freed_by.join(","))]);
    assert!(
        freed_by.iter().any(|r| r == "LeasesRevoked"),
        "the operator revoked the failed pod's leases: {freed_by:?}"
    );
    assert!(worst <= WITHIN, "a session of the failed pod waited {worst:?} (> {WITHIN:?})");
}

fn deletion_cost(pod: &Pod) -> Option<&str> {
    pod.annotations().get(DELETION_COST).map(String::as_str)
}

/// 4. Scale-down removes the least-loaded pods: the operator publishes deletion costs
///    from lease counts; 3 → 1 keeps the busiest pod and every session keeps its history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_down_least_loaded() {
    let f = Fixture::start("scale_down_least_loaded").await;
    let started = Instant::now();
    let mut pods = f.list_pods().await;
    // The busiest pod is the youngest: without deletion costs, a ReplicaSet removes the
    // pods ready for the shortest time first, so only the costs can save it.
    pods.sort_by_key(|p| p.metadata.creation_timestamp.clone().map(|t| t.0));
    let names: Vec<String> = pods.iter().map(ResourceExt::name_any).collect();
    let loads = [(names[0].clone(), 1usize), (names[1].clone(), 3), (names[2].clone(), 10)];
    let busiest = names[2].clone();
    let client = f.client_over(Pods::Fixed(names.clone()));
    let mut keys = Vec::new();
    for (p, (pod, n)) in loads.iter().enumerate() {
        for i in 0..*n {
            let key = format!("load-{p}-{i}");
            turn_ok(&client, &key, "before", Some(pod), Some(pod)).await;
            keys.push(key);
        }
    }
    let costs = Instant::now();
    f.wait_pods("deletion costs from lease counts", Duration::from_secs(120), |pods| {
        loads.iter().all(|(name, n)| {
            pods.iter().any(|p| &p.name_any() == name && deletion_cost(p) == Some(n.to_string().as_str()))
        })
    })
    .await;
    let costs_published = costs.elapsed();

    let scaling = Instant::now();
    f.clusters()
        .patch(CLUSTER, &PatchParams::default(), &Patch::Merge(json!({ "spec": { "replicas": 1 } })))
        .await
        .expect("scale to 1");
    let left = f
        .wait_pods("one pod left", Duration::from_secs(240), |pods| pods.len() == 1 && is_ready(&pods[0]))
        .await;
    let scaled = scaling.elapsed();
    assert_eq!(left[0].name_any(), busiest, "the most-loaded pod survives");
    for key in &keys {
        turn_ok(&client, key, "after", Some(&busiest), Some(&busiest)).await;
        assert_eq!(f.db().history(key).await, ["before", "after"], "{key}: history intact");
    }
    timing(
        "scale_down_least_loaded",
        started.elapsed(),
        &[("costs_published_ms", ms(costs_published)), ("scale_down_ms", ms(scaled))],
    );
}

/// 5. The fence, with two real sidecars on the real database: a turn of an owner that
///    lost the session never lands.
///
/// Why it is built this way: a sidecar that loses a session is normally told at once
/// (LISTEN/NOTIFY on every takeover and every node-lease expiry), and its fast path
/// serves owned sessions without a database round trip while its own node lease is
/// certainly live. So "B takes over while A still believes it owns S" is made real in
/// two steps, each with a deterministic expectation:
///
/// - mid-turn takeover: A is in the middle of a long turn of S; A's node lease is
///   expired without the notification (as if A missed it), then B serves a turn of S
///   and takes it over at epoch 2 (its claim notifies). A's turn must answer `fenced`
///   (halted by the notification, or rejected by the fence at its next write, or
///   stood down by A's heartbeat finding its node lease gone: every path is `fenced`)
///   and nothing of it reaches the history.
/// - pure zombie: B owns S at epoch 2 and serves it from its fast path. The lease is
///   moved to C at epoch 3 exactly as C's takeover writes it, but without any
///   notification, and B's own node lease stays live, so nothing but the database
///   fence can stop B: B's next turn of S must come back `fenced`, with nothing in the
///   history; the directive then leads to C.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_canary() {
    let f = Fixture::start("fence_canary").await;
    let started = Instant::now();
    let pods = f.ready_pods().await;
    let (a, b, c) = (pods[0].clone(), pods[1].clone(), pods[2].clone());
    let proxy = f.proxy();
    let client = f.client_over(Pods::Fixed(pods.clone()));
    let db = f.db();
    let key = format!("canary-{}", suffix());
    assert_eq!(turn_ok(&client, &key, "t1", Some(&a), Some(&a)).await, 1);

    // Mid-turn takeover.
    let mut on_a = Observer::open(&proxy, &a, &key, None).await.expect("stream on A");
    let stale = tokio::spawn({
        let (proxy, a, path) = (proxy.clone(), a.clone(), turns_path(&key));
        // One attempt, no retry: the stale owner's own answer.
        async move { proxy.post_json(&a, PUBLIC_PORT, &path, &turn_body("t2-stale", 4000, 8)).await }
    });
    on_a.until(WAIT, |f| f.event.as_deref() == Some("turn_started") && f.data.contains("t2-stale"))
        .await
        .expect("A started the long turn");
    let lease = db.lease(&key).await.expect("a lease row");
    assert_eq!((node_of(&lease.owner), lease.epoch), (a.as_str(), 1));
    db.silently_expire_node(&lease.owner).await.expect("expire A's node lease");
    let takeover_at = Instant::now();
    let took_over =
        proxy.post_json(&b, PUBLIC_PORT, &turns_path(&key), &turn_body("t3", 0, 1)).await.unwrap();
    assert_eq!(took_over.status, 200, "B serves the turn: {}", took_over.text());
    assert_eq!(took_over.header("leasehold-owner").as_deref(), Some(b.as_str()));
    assert_eq!(took_over.header("leasehold-epoch").as_deref(), Some("2"), "B took over at the next epoch");
    let stale = stale.await.unwrap().expect("A answered");
    let fenced_after = takeover_at.elapsed();
    assert_eq!(stale.status, 503, "A's stale turn is refused: {}", stale.text());
    let body = stale.json().expect("a JSON refusal");
    assert_eq!(body["error"], "fenced", "{body}");
    assert!(body["retry"]["delay_ms"].is_u64(), "with a retry directive: {body}");
    assert_eq!(db.history(&key).await, ["t1", "t3"], "nothing of A's stale turn was checkpointed");
    assert_eq!(db.checkpoint_epoch(&key).await, Some(2));

    // Pure zombie: only the database fence stands between B and the history.
    let c_owner = db.live_owner(&c).await.expect("C has a live node lease");
    assert_eq!(db.silently_take_over(&key, &c_owner).await.expect("move the lease to C"), 3);
    let b_owner = db.live_owner(&b).await;
    assert!(b_owner.is_some(), "B's own node lease is still live: it believes it owns S");
    let zombie =
        proxy.post_json(&b, PUBLIC_PORT, &turns_path(&key), &turn_body("t4-zombie", 0, 1)).await.unwrap();
    assert_eq!(zombie.status, 503, "B's zombie turn is fenced: {}", zombie.text());
    let body = zombie.json().expect("a JSON refusal");
    assert_eq!(body["error"], "fenced", "{body}");
    assert_eq!(db.history(&key).await, ["t1", "t3"], "the zombie wrote nothing");
    assert_eq!(db.checkpoint_epoch(&key).await, Some(2));

    // Following the directive reaches the real owner.
    let answer = client.turn(&key, &turn_body("t4", 0, 1), Some(&b)).await.expect("t4");
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!((answer.owner.as_deref(), answer.epoch), (Some(c.as_str()), Some(3)));
    assert_eq!(db.history(&key).await, ["t1", "t3", "t4"]);
    assert_eq!(db.checkpoint_epoch(&key).await, Some(3));
    timing("fence_canary", started.elapsed(), &[("stale_fenced_ms", ms(fenced_after))]);
}

/// 6. The API server rejects every spec that breaks a CEL rule of the CRD, with the
///    rule's own message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_specs_rejected() {
    type Edit = fn(&mut Value);
    let f = Fixture::namespace("invalid_specs_rejected").await;
    let started = Instant::now();
    let image = f.settings.agent_image();
    let cases: [(&str, Edit, &str); 7] = [
        ("negative replicas", |s| s["replicas"] = json!(-1), "replicas must be >= 0"),
        ("agentPort 0", |s| s["agentPort"] = json!(0), "agentPort must be a TCP port"),
        ("agentPort 65536", |s| s["agentPort"] = json!(65536), "agentPort must be a TCP port"),
        (
            "heartbeat 8s of a 15s TTL",
            |s| s["sidecar"]["heartbeatInterval"] = json!("8s"),
            "heartbeatInterval must be less than half of leaseTtl",
        ),
        (
            "heartbeat exactly half the TTL",
            |s| s["sidecar"]["heartbeatInterval"] = json!("7500ms"),
            "heartbeatInterval must be less than half of leaseTtl",
        ),
        (
            "drainTimeout 500ms",
            |s| s["sidecar"]["drainTimeout"] = json!("500ms"),
            "drainTimeout must be between 1s and 1h",
        ),
        (
            "drainTimeout 2h",
            |s| s["sidecar"]["drainTimeout"] = json!("2h"),
            "drainTimeout must be between 1s and 1h",
        ),
    ];
    let api = f.clusters();
    for (i, (what, edit, message)) in cases.iter().enumerate() {
        let mut spec_json = spec::spec_json(&image, 3);
        edit(&mut spec_json);
        let ac = spec::agent_cluster(&format!("bad-{i}"), spec_json);
        match api.create(&PostParams::default(), &ac).await {
            Err(kube::Error::Api(status)) => {
                eprintln!("{what}: {} {}: {}", status.code, status.reason, status.message);
                assert_eq!(status.code, 422, "{what}: {status:?}");
                assert_eq!(status.reason, "Invalid", "{what}: {status:?}");
                assert!(status.message.contains(message), "{what}: {:?} lacks {message:?}", status.message);
            }
            Err(e) => panic!("{what}: unexpected error {e}"),
            Ok(_) => panic!("{what}: the API server accepted an invalid spec"),
        }
    }
    // The same spec without the edits is accepted (dry run): the rules, nothing else, refused.
    let valid = spec::agent_cluster("valid", spec::spec_json(&image, 3));
    api.create(&PostParams { dry_run: true, ..PostParams::default() }, &valid).await.expect("a valid spec");
    timing("invalid_specs_rejected", started.elapsed(), &[("cases", cases.len().to_string())]);
}
