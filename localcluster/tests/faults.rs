//! Real faults on real processes: kill -9, SIGSTOP/SIGCONT, the lease store going away,
//! a container restart. Run one at a time (they measure recovery against the TTL).

mod support;

use std::time::{Duration, Instant};

use leasehold_sidecar::{client::Client, turn::directive::Refusal};
use localcluster::{observer::turn_finished, Cluster, ClusterOptions, Postgres};
use serde_json::json;
use tokio::task::JoinHandle;

/// Slack on recovery bounds for scheduling on a loaded 2-core machine.
const SLACK: Duration = Duration::from_secs(2);

fn turn(text: &str) -> serde_json::Value {
    json!({ "text": text, "tokens": 2 })
}

/// A 2 s lease renewed every 400 ms, for the freeze and partition tests.
fn short_lease_options() -> ClusterOptions {
    ClusterOptions {
        lease_ttl: Duration::from_secs(2),
        heartbeat: Duration::from_millis(400),
        ..Default::default()
    }
}

/// A 30 s lease renewed every 2 s: a test that recovers well within it proves nothing
/// waited for a lease to expire.
fn long_lease_options() -> ClusterOptions {
    ClusterOptions {
        lease_ttl: Duration::from_secs(30),
        heartbeat: Duration::from_secs(2),
        ..Default::default()
    }
}

/// Three nodes with [`short_lease_options`], for the freeze tests; and the TTL.
async fn short_leases(db: &str) -> (Cluster, Duration) {
    let options = short_lease_options();
    let ttl = options.lease_ttl;
    (Cluster::start(db, options).await.unwrap(), ttl)
}

/// Turn `text` for `key`, sent to node-a, which becomes (or stays) the owner.
async fn turn_on_node_a(cluster: &Cluster, key: &str, text: &str) {
    let first = cluster
        .client()
        .post(&format!("/v1/sessions/{key}/turns"), turn(text).to_string().into(), Some(0))
        .await
        .unwrap();
    assert_eq!(first.owner.as_deref(), Some("node-a"));
}

/// Send `body` as a turn for `key` straight to node-a's public port, in the background,
/// without the client library (no directive is obeyed): its status and body.
fn post_on_node_a(cluster: &Cluster, key: &str, body: serde_json::Value) -> JoinHandle<(u16, String)> {
    let url = format!("{}/v1/sessions/{key}/turns", cluster.nodes[0].public_url());
    tokio::spawn(async move {
        let response = reqwest::Client::new().post(url).body(body.to_string()).send().await.unwrap();
        (response.status().as_u16(), response.text().await.unwrap_or_default())
    })
}

/// How many turns `node`'s demo agent has received. "Its agent has the turn" is this
/// count, not the sidecar's in-flight gauge: a turn counts in flight from its journal
/// entry on, before its dispatch.
async fn agent_turns(node: &localcluster::Node) -> u64 {
    let stats: serde_json::Value =
        reqwest::get(format!("{}/stats", node.agent_url())).await.unwrap().json().await.unwrap();
    stats["turns"].as_u64().unwrap()
}

/// A background request's status, body, and when its answer came.
type Answered = JoinHandle<(u16, String, Instant)>;

fn timed(request: JoinHandle<(u16, String)>) -> Answered {
    tokio::spawn(async move {
        let (status, body) = request.await.unwrap();
        (status, body, Instant::now())
    })
}

/// The longest a directive-following client's last wait can run past the lease's expiry:
/// `takeover_pending` waits exactly the remaining TTL (it ends at the expiry), but an
/// `owner_unreachable` told just before the expiry waits its whole delay after it.
fn one_directive_delay(ttl: Duration) -> Duration {
    Duration::from_millis(Refusal::OwnerUnreachable { ttl }.retry().delay_ms)
}

/// Sidecar environment turning connection liveness off on every node: the TTL alone
/// judges a boot (what a frozen or partitioned owner always gets).
fn ttl_only() -> Vec<Vec<(String, String)>> {
    vec![vec![("LEASEHOLD_CONNECTION_LIVENESS".to_owned(), "false".to_owned())]; 3]
}

/// Without connection liveness, after kill -9 of an owner its sessions are claimable once
/// its node's TTL has passed (no renewal comes), and a client following the directives is
/// served within the TTL, one directive delay and [`SLACK`].
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill9_of_an_owner_moves_its_sessions_after_at_most_one_ttl() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let options = ClusterOptions {
        lease_ttl: Duration::from_secs(3),
        sidecar_env: ttl_only(),
        ..ClusterOptions::default()
    };
    let ttl = options.lease_ttl;
    let mut cluster = Cluster::start(&db, options).await.unwrap();
    let client = cluster.client();
    let keys: Vec<String> = (0..5).map(|i| format!("crash-{i}")).collect();
    // One more session of node-a's that no client sends to: its view shows when the
    // lease became claimable, untouched by the takeovers of the others.
    let idle = "crash-idle";
    for key in keys.iter().map(String::as_str).chain([idle]) {
        let answer = client
            .post(&format!("/v1/sessions/{key}/turns"), turn("before").to_string().into(), Some(0))
            .await
            .unwrap();
        assert_eq!((answer.status, answer.owner.as_deref()), (200, Some("node-a")));
    }

    cluster.nodes[0].kill9();
    let killed = Instant::now();
    let client = std::sync::Arc::new(client);
    let tasks: Vec<_> = keys
        .iter()
        .cloned()
        .map(|key| {
            let client = client.clone();
            tokio::spawn(async move { (client.turn(&key, &turn("after")).await, key, killed.elapsed()) })
        })
        .collect();
    let survivor = Client::new(vec![cluster.nodes[1].public_url()]);
    while survivor.session(idle, 0).await.unwrap()["claimable"] != true {
        assert!(
            killed.elapsed() <= ttl + SLACK,
            "{idle} not claimable {:?} after the kill",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let bound = ttl + one_directive_delay(ttl) + SLACK;
    for task in tasks {
        let (answer, key, took) = task.await.unwrap();
        let answer = answer.unwrap_or_else(|e| panic!("{key}: {e}"));
        assert_eq!(
            answer.status,
            200,
            "{key}: only directives on the way, then success: {:?}",
            answer.json()
        );
        assert!(answer.owner.as_deref() != Some("node-a"));
        assert_eq!(answer.epoch, Some(2), "{key}: taken over with epoch + 1");
        for code in &answer.directives {
            assert!(["takeover_pending", "owner_unreachable"].contains(&code.as_str()), "{key}: {code}");
        }
        assert!(took <= bound, "{key}: served after {took:?}, bound {bound:?} ({:?})", answer.directives);
        assert_eq!(support::history(&db, &key).await, ["before", "after"], "{key}: history intact");
    }
}

/// Ten seconds of lease renewed every second, for the connection-liveness tests: long
/// enough that anything served well within it did not wait for the TTL.
fn liveness_options() -> ClusterOptions {
    ClusterOptions {
        lease_ttl: Duration::from_secs(10),
        heartbeat: Duration::from_secs(1),
        ..Default::default()
    }
}

/// A cluster with [`liveness_options`] on a Postgres up longer than its TTL (so it judges
/// closed connections), `keys` claimed on node-a with one turn each; its database URL.
async fn liveness_cluster(keys: &[&str]) -> (Cluster, String, ClusterOptions) {
    let db = support::database().await;
    let options = liveness_options();
    support::postgres_up_for(&db, options.lease_ttl).await;
    let cluster = Cluster::start(&db, options.clone()).await.unwrap();
    for key in keys {
        turn_on_node_a(&cluster, key, "before").await;
    }
    (cluster, db, options)
}

/// With connection liveness (the default), kill -9 of an owner closes its connections
/// and Postgres releases its liveness lock: the first turn sent for one of its sessions is
/// served by another pod with no directive at all (the forwarder finds the owner's port
/// refusing, asks Postgres, expires the dead boot and claims), not after the TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill9_of_an_owner_moves_its_sessions_at_once_when_postgres_sees_its_connection_close() {
    let _serial = support::serial().await;
    let keys = ["gone-0", "gone-1", "gone-2"];
    let (mut cluster, db, options) = liveness_cluster(&keys).await;
    let ttl = options.lease_ttl;

    cluster.nodes[0].kill9();
    let killed = Instant::now();
    let client = Client::new(vec![cluster.nodes[1].public_url()]);
    for key in keys {
        let answer = client.turn(key, &turn("after")).await.unwrap();
        assert_eq!(answer.status, 200, "{key}: {:?}", answer.json());
        assert!(answer.directives.is_empty(), "{key}: served at once, got {:?}", answer.directives);
        assert_ne!(answer.owner.as_deref(), Some("node-a"));
        assert_eq!(answer.epoch, Some(2), "{key}: taken over with epoch + 1");
        assert_eq!(support::history(&db, key).await, ["before", "after"], "{key}: history intact");
    }
    assert!(killed.elapsed() < ttl / 2, "served {:?} after the kill; TTL {ttl:?}", killed.elapsed());
}

/// Nobody sends a turn: the survivors' heartbeats find the dead boot's lock gone and expire
/// its node lease within a few beats, so a session nobody calls is claimable long before
/// the TTL (an observer waiting on it follows it to its next owner at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_owners_idle_sessions_become_claimable_by_the_peers_heartbeats() {
    let _serial = support::serial().await;
    let (mut cluster, _db, options) = liveness_cluster(&["idle-0"]).await;
    let (ttl, beat) = (options.lease_ttl, options.heartbeat);

    cluster.nodes[0].kill9();
    let killed = Instant::now();
    let survivor = Client::new(vec![cluster.nodes[1].public_url()]);
    while survivor.session("idle-0", 0).await.unwrap()["claimable"] != true {
        assert!(
            killed.elapsed() < ttl / 2,
            "not claimable {:?} after the kill; TTL {ttl:?}",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(killed.elapsed() <= beat * 2 + SLACK, "claimable {:?} after the kill", killed.elapsed());
}

/// A frozen owner (SIGSTOP) keeps its connection open, so it keeps its liveness lock:
/// the peers' heartbeats do not expire it, and when it wakes within its TTL it still owns
/// its session at the same epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_owner_keeps_its_sessions_while_its_connection_stays_open() {
    let _serial = support::serial().await;
    let (cluster, _db, options) = liveness_cluster(&["frozen-0"]).await;
    let beat = options.heartbeat;

    cluster.nodes[0].pause();
    tokio::time::sleep(beat * 4).await; // four beats of every survivor
    let survivor = Client::new(vec![cluster.nodes[1].public_url()]);
    let view = survivor.session("frozen-0", 0).await.unwrap();
    cluster.nodes[0].resume();
    assert_eq!(view["claimable"], false, "a frozen owner is not dead: {view}");
    let answer = cluster
        .client()
        .post("/v1/sessions/frozen-0/turns", turn("after").to_string().into(), Some(0))
        .await
        .unwrap();
    assert_eq!((answer.status, answer.owner.as_deref(), answer.epoch), (200, Some("node-a"), Some(1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_owner_is_fenced_when_it_wakes_and_none_of_its_output_lands() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let (cluster, ttl) = short_leases(&db).await;
    let key = "paused";
    let a = &cluster.nodes[0];
    turn_on_node_a(&cluster, key, "first").await;

    // A long turn starts on node-a; the whole pod freezes in the middle of it.
    let zombie = post_on_node_a(&cluster, key, json!({ "text": "zombie", "think_ms": 1500, "tokens": 5 }));
    // node-a's agent has it: its second turn.
    support::eventually("the zombie turn runs on node-a", || async { agent_turns(a).await >= 2 }).await;
    a.pause();
    // The fault itself, not a wait for something: frozen for longer than the TTL.
    tokio::time::sleep(ttl + Duration::from_millis(500)).await;

    // Another node takes over and serves turns while node-a is frozen.
    let others = Client::new(vec![cluster.nodes[1].public_url(), cluster.nodes[2].public_url()]);
    for text in ["after-1", "after-2"] {
        let answer = others.turn(key, &turn(text)).await.unwrap();
        assert_eq!(answer.status, 200, "{:?}", answer.json());
        assert_eq!(answer.epoch, Some(2));
    }

    a.resume();
    let (status, body) = tokio::time::timeout(Duration::from_secs(20), zombie).await.unwrap().unwrap();
    assert_ne!(status, 200, "the paused turn must not be acknowledged: {body}");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("\"fenced\""), "{body}");
    // node-a's heartbeat notices its lost lease and stands the session down.
    support::eventually("node-a stood the session down", || async {
        a.metric("leasehold_stand_downs_total", "").await >= 1.0
    })
    .await;
    assert_eq!(
        support::history(&db, key).await,
        ["first", "zombie", "after-1", "after-2"],
        "no write of node-a landed: the new owner resumed the journaled turn once, before the next"
    );
    assert_eq!(support::epoch(&db, key).await, Some(2));
    // The next turn anywhere continues the new owner's history.
    let answer = cluster
        .client()
        .post(&format!("/v1/sessions/{key}/turns"), turn("later").to_string().into(), Some(0))
        .await
        .unwrap();
    assert_eq!(answer.json().unwrap()["history_len"], 5);
}

/// A turn forwarded to an owner that freezes (its kernel still accepts the connection)
/// ends with `502 owner_failed` once the owner's lease lapses — not after the forward's
/// response timeout (minutes) — and the session is then taken over; the frozen owner's
/// agent is never sent the turn (its record of received turns shows it), even after it
/// wakes, and nothing of it lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_turn_forwarded_to_a_frozen_owner_fails_when_its_lease_lapses() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let record = tempfile::tempdir().unwrap();
    let options = ClusterOptions {
        agent_command: support::recording_hold_agent(record.path()),
        ..short_lease_options()
    };
    let ttl = options.lease_ttl;
    let cluster = Cluster::start(&db, options).await.unwrap();
    let key = "frozen";
    let turns = format!("/sessions/{key}/turns");
    turn_on_node_a(&cluster, key, "first").await;
    let a = &cluster.nodes[0];

    a.pause();
    let started = Instant::now();
    let others = Client::new(vec![cluster.nodes[1].public_url(), cluster.nodes[2].public_url()]);
    // The lost answer itself is under test: no re-send.
    let raw = Client::new(others.nodes().to_vec()).without_resends();
    let answer = raw.turn(key, &turn("into the freeze")).await.unwrap();
    let waited = started.elapsed();
    assert_eq!(answer.status, 502, "{:?}", answer.json());
    assert_eq!(answer.json().unwrap()["error"], "owner_failed");
    assert!(answer.directives.is_empty(), "no directive: it may have run");
    // Bounded by the lease (plus a check and scheduling), far below the 300 s timeout.
    assert!(waited < ttl * 3 + SLACK, "waited {waited:?}");

    // The next turn is taken over by a node that is awake.
    let answer = others.turn(key, &turn("after")).await.unwrap();
    assert_eq!((answer.status, answer.epoch), (200, Some(2)), "{:?}", answer.json());
    let new_owner = cluster.node(answer.owner.as_deref().unwrap());
    a.resume();
    // node-a wakes with the forwarded request in its socket: it finds its lease lost
    // (stands the session down) and is ready again; only then is its record judged.
    support::eventually("node-a stood the session down after waking", || async {
        a.metric("leasehold_stand_downs_total", "").await >= 1.0
    })
    .await;
    support::eventually("node-a ready again", || async {
        reqwest::get(format!("{}/readyz", a.admin_url())).await.is_ok_and(|r| r.status() == 200)
    })
    .await;
    let texts = |node| -> Vec<String> {
        support::received(record.path(), node, &turns)
            .iter()
            .map(|r| serde_json::from_str::<serde_json::Value>(r["body"].as_str().unwrap()).unwrap())
            .map(|body| body["text"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(texts(a), ["first"], "the frozen owner's agent never got the turn sent into the freeze");
    assert_eq!(texts(new_owner), ["after"], "the new owner's agent ran only the next turn");
    assert_eq!(support::history(&db, key).await, ["first", "after"]);
}

/// A turn whose checkpoint landed before its owner's sidecar froze is not answered with
/// a `fenced` directive (a client would send it again and it would be in the history
/// twice): it is acknowledged or `502 owner_failed`, never retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_turn_whose_write_landed_before_a_freeze_is_not_retried() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let options =
        ClusterOptions { agent_command: Some((support::hold_agent(), Vec::new())), ..short_lease_options() };
    let ttl = options.lease_ttl;
    let cluster = Cluster::start(&db, options).await.unwrap();
    let key = "landed";
    turn_on_node_a(&cluster, key, "first").await;

    // The agent checkpoints at once, then holds its answer for 6 s; the sidecar freezes.
    let held = post_on_node_a(&cluster, key, json!({ "text": "landed", "hold_ms": 6000 }));
    support::eventually("the held turn's checkpoint landed", || async {
        support::history(&db, key).await == ["first", "landed"]
    })
    .await;
    cluster.nodes[0].sidecar.pause();
    // The fault itself, not a wait for something: frozen for longer than the TTL.
    tokio::time::sleep(ttl + Duration::from_millis(500)).await;
    let others = Client::new(vec![cluster.nodes[1].public_url(), cluster.nodes[2].public_url()]);
    let answer = others.turn(key, &turn("after")).await.unwrap();
    assert_eq!((answer.status, answer.epoch), (200, Some(2)), "{:?}", answer.json());
    cluster.nodes[0].sidecar.resume(); // it finds its lease lost and halts the held turn

    let (status, body) = tokio::time::timeout(Duration::from_secs(20), held).await.unwrap().unwrap();
    assert!(!body.contains("\"fenced\""), "no retry directive for a turn that landed: {status} {body}");
    assert!(status == 200 || (status == 502 && body.contains("owner_failed")), "{status} {body}");
    assert_eq!(support::history(&db, key).await, ["first", "landed", "after"]);
}

/// The lease store stops: every node refuses turns with a `store_unavailable` directive
/// and is not ready, while `/healthz` stays 200 (a liveness probe must not restart a pod
/// for the database's outage); the same processes serve again when it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_outage_refuses_with_a_directive_keeps_healthz_and_service_resumes_after() {
    let _serial = support::serial().await;
    let pg = Postgres::start().unwrap();
    let mut cluster = Cluster::start(pg.url(), ClusterOptions::default()).await.unwrap();
    let key = "outage";
    let ok = cluster.client().turn(key, &turn("before")).await.unwrap();
    assert_eq!(ok.status, 200);

    pg.stop().unwrap();
    let http = reqwest::Client::new();
    for node in &cluster.nodes {
        // A few failed heartbeats: the node stops being ready, and stays alive.
        support::eventually(&format!("{} not ready while the store is down", node.name), || async {
            let ready = http.get(format!("{}/readyz", node.admin_url())).send().await;
            ready.is_ok_and(|r| r.status() == 503)
        })
        .await;
        let health = http.get(format!("{}/healthz", node.admin_url())).send().await.unwrap();
        assert_eq!(health.status(), 200, "{}: /healthz never depends on the database", node.name);
        let response = http
            .post(format!("{}/v1/sessions/{key}/turns", node.public_url()))
            .body(turn("during").to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 503, "{}", node.name);
        assert!(response.headers().get("retry-after").is_some());
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(body["error"], "store_unavailable");
        assert!(body["retry"]["delay_ms"].as_u64().unwrap() > 0);
        let ready = http.get(format!("{}/readyz", node.admin_url())).send().await.unwrap();
        assert_eq!(ready.status(), 503, "{} not ready while the store is down", node.name);
        let health = http.get(format!("{}/healthz", node.admin_url())).send().await.unwrap();
        assert_eq!(health.status(), 200, "{}: still alive after a refused turn", node.name);
    }

    pg.restart().unwrap();
    for node in &mut cluster.nodes {
        node.wait_ready().await.unwrap(); // the same processes recover
    }
    let answer = cluster.client().turn(key, &turn("after")).await.unwrap();
    assert_eq!(answer.status, 200, "{:?}", answer.json());
    assert_eq!(support::history(pg.url(), key).await, ["before", "after"], "nothing ran during the outage");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_container_restart_frees_the_earlier_boots_sessions_at_once() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let mut cluster = Cluster::start(&db, long_lease_options()).await.unwrap();
    let keys: Vec<String> = (0..3).map(|i| format!("restart-{i}")).collect();
    for key in &keys {
        turn_on_node_a(&cluster, key, "before").await;
    }
    let restarted = Instant::now();
    cluster.nodes[0].restart_sidecar();
    cluster.nodes[0].wait_ready().await.unwrap();
    let client = cluster.client();
    for key in &keys {
        let view = client.session(key, 1).await.unwrap();
        assert_eq!(view["claimable"], true, "{key}: {view}");
        let answer = client
            .post(&format!("/v1/sessions/{key}/turns"), turn("after").to_string().into(), Some(1))
            .await
            .unwrap();
        assert_eq!(answer.status, 200);
        assert!(answer.directives.is_empty(), "{key}: no waiting: {:?}", answer.directives);
        assert_eq!(answer.epoch, Some(2));
        assert_eq!(support::history(&db, key).await, ["before", "after"]);
    }
    assert!(restarted.elapsed() < Duration::from_secs(30), "served well within the TTL");
}

/// A partition between an owner and the lease store (a link that holds every byte, so
/// node-a's statements hang rather than fail). Node-a steps back when its node lease is no
/// longer certainly live, before anyone can take over: a turn whose checkpoint is held in
/// the partition is answered `502 owner_failed` (it may still land), one that wrote
/// nothing `503 fenced`; a turn sent to node-a meanwhile gets a directive, not a hang.
/// The other nodes take over after the TTL; when the link heals, the held checkpoint
/// arrives and is fenced, and node-a serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_owner_cut_off_from_the_store_steps_back_before_a_takeover_and_its_late_write_is_fenced() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let link = localcluster::Link::to_database(&db).await.unwrap();
    let record = tempfile::tempdir().unwrap();
    let options = ClusterOptions {
        agent_command: support::recording_hold_agent(record.path()),
        database_urls: vec![Some(link.database_url(&db))],
        ..short_lease_options()
    };
    let ttl = options.lease_ttl;
    let mut cluster = Cluster::start(&db, options).await.unwrap();
    let (writing, thinking) = ("cut-writing", "cut-thinking");
    turn_on_node_a(&cluster, writing, "first").await;
    turn_on_node_a(&cluster, thinking, "first").await;

    // Both turns thaw before the cut; one checkpoints during it, one would after node-a's
    // node lease stopped being certainly live.
    let held = timed(post_on_node_a(&cluster, writing, json!({ "text": "held", "think_ms": 800 })));
    let halted = timed(post_on_node_a(&cluster, thinking, json!({ "text": "halted", "think_ms": 4000 })));
    let thawed = |key: &str| {
        let node = &cluster.nodes[0];
        support::agent_record(record.path(), node).iter().filter(|r| r["thawed"] == key).count() >= 2
    };
    support::eventually("both turns thawed on node-a", || {
        let both = thawed(writing) && thawed(thinking);
        async move { both }
    })
    .await;
    link.cut();
    let cut = Instant::now();
    let direct = timed(post_on_node_a(&cluster, "cut-new", turn("direct")));

    // The other nodes take over once node-a's node lease expired in the database.
    let others = Client::new(vec![cluster.nodes[1].public_url(), cluster.nodes[2].public_url()]);
    let after = tokio::spawn({
        let others = Client::new(others.nodes().to_vec());
        async move { others.turn(thinking, &turn("after")).await }
    });
    // Taken over: the lease moved to another node at epoch 2 (its new owner then resumes
    // the turn node-a left unfinished before it serves "after").
    let took_over = loop {
        let session = others.session(thinking, 0).await.unwrap();
        if session["epoch"] == 2 && session["owner"].as_str().is_some_and(|o| o != "node-a") {
            break Instant::now();
        }
        assert!(cut.elapsed() < ttl * 4, "never taken over: {session}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(took_over - cut <= ttl + SLACK, "taken over {:?} after the cut", took_over - cut);
    let answer = after.await.unwrap().unwrap();
    assert_eq!((answer.status, answer.epoch), (200, Some(2)), "{:?}", answer.json());
    assert_ne!(answer.owner.as_deref(), Some("node-a"));
    eprintln!("store partition: another node served the session {:?} after the cut", took_over - cut);

    let (status, body, answered) = held.await.unwrap();
    eprintln!("store partition: node-a stepped back {:?} after the cut", answered - cut);
    assert_eq!(status, 502, "a turn whose write is in the partition may still land: {body}");
    assert!(body.contains("owner_failed"), "{body}");
    assert!(answered < took_over, "node-a stepped back before the takeover");
    let (status, body, answered) = halted.await.unwrap();
    assert_eq!(status, 503, "nothing written: the client may send it again: {body}");
    assert!(body.contains("\"fenced\""), "{body}");
    assert!(answered < took_over, "node-a stepped back before the takeover");
    let (status, body, answered) = direct.await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("store_unavailable") && body.contains("delay_ms"), "{body}");
    assert!(answered - cut <= Duration::from_secs(8), "refused, not hung: {:?}", answered - cut);
    let answer = others.turn(writing, &turn("after")).await.unwrap();
    assert_eq!((answer.status, answer.epoch), (200, Some(2)), "{:?}", answer.json());

    // The partition heals: the held checkpoint (epoch 1) arrives after the takeover.
    link.mend();
    cluster.nodes[0].wait_ready().await.unwrap();
    support::eventually("the held checkpoint arrived and the fence refused it", || async {
        cluster.nodes[0].metric("leasehold_fenced_writes_total", "").await >= 1.0
    })
    .await;
    // The held turn's own checkpoint was fenced; the new owner resumed the journaled turn.
    assert_eq!(support::history(&db, writing).await, ["first", "held", "after"], "the late write was fenced");
    assert_eq!(support::history(&db, thinking).await, ["first", "halted", "after"], "resumed once");
    let lapsed = cluster.nodes[0].metric("leasehold_stand_downs_total", "reason=\"lapsed\"").await;
    assert!(lapsed >= 2.0, "node-a stood both sessions down when its lease lapsed: {lapsed}");
    let via_a = Client::new(vec![cluster.nodes[0].public_url()]);
    for key in [writing, thinking] {
        let answer = via_a.turn(key, &turn("later")).await.unwrap();
        assert_eq!((answer.status, answer.epoch), (200, Some(2)), "{key}: {:?}", answer.json());
        let history = support::history(&db, key).await;
        assert_eq!(history.len(), 4, "{key}: {history:?}");
        assert_eq!(history.last().map(String::as_str), Some("later"), "{key}: {history:?}");
    }
}

/// The agent container dies (kill -9) while its sidecar lives on: the turn it was running
/// is `502 owner_failed` (it may have run); the next turns of its sessions are served by
/// other pods at once instead of waiting for the agent to come back — a turn forwarded to
/// node-a without the client seeing anything (the forwarder re-claims), one sent to
/// node-a itself after one `agent_unavailable` directive. Histories intact; the restarted
/// agent serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crashed_agent_hands_its_sessions_to_other_pods_at_once() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let mut cluster = Cluster::start(&db, long_lease_options()).await.unwrap();
    let keys = ["agent-0", "agent-1", "agent-2"];
    for key in keys {
        turn_on_node_a(&cluster, key, "before").await;
    }
    let running = post_on_node_a(&cluster, keys[0], json!({ "text": "cut", "think_ms": 3000, "tokens": 3 }));
    // The agent has it: its fourth turn.
    support::eventually("the turn runs on node-a's agent", || async {
        agent_turns(&cluster.nodes[0]).await >= 4
    })
    .await;
    cluster.nodes[0].agent.kill9();
    let crashed = Instant::now();
    let (status, body) = running.await.unwrap();
    assert_eq!(status, 502, "the agent died mid-turn: {body}");
    assert!(body.contains("owner_failed"), "{body}");

    let via_b = Client::new(vec![cluster.nodes[1].public_url()]);
    let answer = via_b.turn(keys[1], &turn("after")).await.unwrap();
    assert_eq!((answer.status, answer.epoch), (200, Some(2)), "{:?}", answer.json());
    assert_eq!(answer.owner.as_deref(), Some("node-b"), "node-b took the session over");
    assert!(answer.directives.is_empty(), "nothing for the client to do: {:?}", answer.directives);

    // keys[0] was handed back when its agent died mid-turn, and another pod resumed its
    // turn: served wherever it is sent.
    let answer = cluster.client().turn(keys[0], &turn("after")).await.unwrap();
    assert_eq!((answer.status, answer.epoch), (200, Some(2)), "{:?}", answer.json());
    assert_ne!(answer.owner.as_deref(), Some("node-a"));
    let client = cluster.client();
    for key in [keys[2]] {
        let path = format!("/v1/sessions/{key}/turns");
        let answer = client.post(&path, turn("after").to_string().into(), Some(0)).await.unwrap();
        assert_eq!((answer.status, answer.epoch), (200, Some(2)), "{key}: {:?}", answer.json());
        assert_ne!(answer.owner.as_deref(), Some("node-a"));
        assert!(
            !answer.directives.is_empty() && answer.directives.iter().all(|d| d == "agent_unavailable"),
            "{key}: refused by node-a (the round-robin may come back to it): {:?}",
            answer.directives
        );
    }
    eprintln!("agent crash: its three sessions served elsewhere {:?} after the kill", crashed.elapsed());
    assert!(crashed.elapsed() < Duration::from_secs(10), "served elsewhere well within the 30 s TTL");
    // The turn the agent died in was journaled: the next owner resumed it before
    // serving the next one, so it is in the history once.
    assert_eq!(support::history(&db, keys[0]).await, ["before", "cut", "after"], "{}", keys[0]);
    for key in &keys[1..] {
        assert_eq!(support::history(&db, key).await, ["before", "after"], "{key}");
    }
    let refused = cluster.nodes[0].metric("leasehold_turns_total", "outcome=\"agent_unavailable\"").await;
    assert!(refused >= 2.0, "node-a counts the turns its agent could not take: {refused}");

    cluster.nodes[0].restart_agent();
    let only_a = Client::new(vec![cluster.nodes[0].public_url()]);
    let answer = only_a.turn("agent-new", &turn("back")).await.unwrap();
    assert_eq!((answer.status, answer.owner.as_deref()), (200, Some("node-a")), "{:?}", answer.json());
}

/// For the partition tests, which change the firewall: `None` (said so) unless this
/// process may; else the serial guard, the database, and three nodes where node-a owns
/// `key` after turn `text`.
async fn partition_setup(
    key: &str,
    text: &str,
) -> Option<(tokio::sync::MutexGuard<'static, ()>, String, Cluster)> {
    if !localcluster::Blackhole::permitted() {
        eprintln!("SKIPPED: changing the firewall needs root");
        return None;
    }
    let serial = support::serial().await;
    let db = support::database().await;
    let cluster = Cluster::start(&db, ClusterOptions::default()).await.unwrap();
    turn_on_node_a(&cluster, key, text).await;
    Some((serial, db, cluster))
}

/// A partition between pods: the kernel drops all traffic to and from node-a's peer port
/// while node-a keeps renewing its lease. A turn forwarded over
/// node-b's pooled connection is answered `502 owner_failed` within seconds (the
/// connection's user timeout ends it) instead of after the 300 s peer response timeout;
/// the next one gets `takeover_pending` (node-a is still the live owner, unreachable);
/// healed, turns flow again. Needs root (iptables); CI runs as root.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_turn_forwarded_into_a_partition_between_pods_fails_in_seconds() {
    let key = "between-pods";
    let Some((_serial, db, cluster)) = partition_setup(key, "first").await else { return };
    let (a, b) = (&cluster.nodes[0], &cluster.nodes[1]);
    let via_b = Client::new(vec![b.public_url()]);
    let answer = via_b.turn(key, &turn("second")).await.unwrap(); // leaves a pooled connection
    assert_eq!((answer.status, answer.owner.as_deref()), (200, Some("node-a")));

    let hole = localcluster::Blackhole::port(a.ip, localcluster::cluster::PEER_PORT).unwrap();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let url = format!("{}/v1/sessions/{key}/turns", b.public_url());
    let sent = Instant::now();
    let response = http.post(&url).body(turn("lost").to_string()).send().await.unwrap();
    let took = sent.elapsed();
    let status = response.status().as_u16();
    let body = response.text().await.unwrap();
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("owner_failed"), "it may have run: {body}");
    eprintln!("a turn forwarded into the partition was answered after {took:?}");
    assert!(took < Duration::from_secs(30), "ended by the connection's timeouts: {took:?}");

    let response = http.post(&url).body(turn("lost").to_string()).send().await.unwrap();
    assert_eq!(response.status(), 503);
    let body = response.text().await.unwrap();
    assert!(body.contains("takeover_pending"), "node-a renews but cannot be reached: {body}");

    drop(hole);
    let answer = via_b.turn(key, &turn("third")).await.unwrap();
    assert_eq!((answer.status, answer.owner.as_deref()), (200, Some("node-a")), "{:?}", answer.json());
    assert_eq!(support::history(&db, key).await, ["first", "second", "third"]);
}

/// Longer than the follower's connection takes to notice a silent owner (keep-alive: 5 s
/// idle, then 3 probes 2 s apart), so the stream is re-opened, not merely resumed.
const PAST_KEEPALIVE: Duration = Duration::from_secs(14);
/// A re-opened upstream catches up within one 1 s connect attempt into the closing hole
/// and a 250 ms retry, plus slack; one left to TCP's retransmission back-off took ~12 s.
const CATCH_UP: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_observer_behind_a_partition_between_pods_catches_up_without_a_gap_when_it_heals() {
    let key = "watched-across-a-partition";
    let Some((_serial, _, cluster)) = partition_setup(key, "one").await else { return };
    let (a, b) = (&cluster.nodes[0], &cluster.nodes[1]);
    let stream = format!("{}/v1/sessions/{key}/stream", b.public_url());
    let mut on_b = localcluster::Observer::open(&stream, None).await.unwrap();
    on_b.until(SLACK * 5, turn_finished(1)).await.unwrap(); // node-b's upstream to node-a is live

    // Node-a's peer port goes silent both ways; its public port and the store stay up, so
    // it keeps the session and serves a turn that node-b's follower cannot see.
    let hole = localcluster::Blackhole::port(a.ip, localcluster::cluster::PEER_PORT).unwrap();
    turn_on_node_a(&cluster, key, "two").await;
    let crossed = on_b.next(PAST_KEEPALIVE).await;
    assert!(crossed.is_none(), "nothing crosses the partition: {crossed:?}");
    assert!(!on_b.closed(), "the observer's own connection stays open");

    drop(hole);
    let healed = Instant::now();
    on_b.until(SLACK * 10, turn_finished(2)).await.expect("the turn served during the partition, by replay");
    let caught_up = healed.elapsed();
    eprintln!("the observer caught up {caught_up:?} after the partition healed");
    assert!(caught_up < CATCH_UP, "the follower noticed the dead upstream and re-opened it: {caught_up:?}");
    turn_on_node_a(&cluster, key, "three").await;
    on_b.until(SLACK * 5, turn_finished(3)).await.expect("then live again");

    let ids: Vec<String> = on_b.ids();
    let expected: Vec<String> = (1..=12).map(|seq| format!("1-{seq}")).collect();
    assert_eq!(ids, expected, "every event of the three turns once, in order: no gap, no duplicate");
    assert!(
        !on_b.seen.iter().any(|f| f.event.as_deref() == Some("reconnect")),
        "no reconnect asked of the client"
    );
}

/// Backends of `database_url`'s database waiting on a lock.
async fn lock_waiters(conn: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()",
    )
    .fetch_one(conn)
    .await
    .unwrap()
}

/// Request traffic that holds every pooled connection of node-a for twice the TTL (each
/// turn's claim blocked on a locked lease table) never makes node-a's node lease lapse:
/// the heartbeat renews on connections of its own, and the session node-a holds is never
/// stood down.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_pool_held_busy_past_the_ttl_does_not_lapse_the_node_lease() {
    use sqlx::Connection;
    const FLOOD: usize = 40;
    let _serial = support::serial().await;
    let db = support::database().await;
    let (cluster, ttl) = short_leases(&db).await;
    turn_on_node_a(&cluster, "held", "first").await;
    let a = &cluster.nodes[0];
    assert_eq!(a.metric("leasehold_leases_held", "").await, 1.0);

    let mut locker = sqlx::PgConnection::connect(&db).await.unwrap();
    let mut lock = locker.begin().await.unwrap();
    sqlx::query("LOCK TABLE agent_leases IN ACCESS EXCLUSIVE MODE").execute(&mut *lock).await.unwrap();
    let held_until = Instant::now() + ttl * 2 + Duration::from_millis(500);
    let floods: Vec<_> = (0..FLOOD)
        .map(|i| {
            let url = format!("{}/v1/sessions/flood-{i}/turns", a.public_url());
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                while Instant::now() < held_until {
                    let _ = http.post(&url).body(turn("x").to_string()).send().await;
                }
            })
        })
        .collect();
    let mut watcher = sqlx::PgConnection::connect(&db).await.unwrap();
    let waiting_by = Instant::now() + Duration::from_secs(5);
    while lock_waiters(&mut watcher).await < 16 {
        assert!(Instant::now() < waiting_by, "the flood never held node-a's 16 pooled connections");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let readyz = format!("{}/readyz", a.admin_url());
    while Instant::now() < held_until {
        let ready = reqwest::get(&readyz).await.unwrap().status();
        assert_eq!(ready, 200, "node-a stopped being ready while its request pool was busy");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    lock.rollback().await.unwrap();
    for flood in floods {
        flood.await.unwrap();
    }
    assert_eq!(a.metric("leasehold_stand_downs_total", "").await, 0.0, "a session was stood down");
    let answer = cluster
        .client()
        .post("/v1/sessions/held/turns", turn("second").to_string().into(), Some(0))
        .await
        .unwrap();
    assert_eq!((answer.status, answer.owner.as_deref(), answer.epoch), (200, Some("node-a"), Some(1)));
}

/// A publish frozen between its acceptance and the journal (the failpoint stops node-a's
/// sidecar as its first event's group commit is about to be written) while another node
/// takes the session over: when node-a wakes, the journal's fence refuses its event, which
/// reaches no observer on any node; its turn is not acknowledged by node-a, and the new
/// owner, finding it unfinished in the journal, resumes it: it is in the history once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publish_frozen_between_fence_and_fan_out_never_reaches_an_observer() {
    const KEY: &str = "zombie-publish";
    let _serial = support::serial().await;
    let db = support::database().await;
    let stop_after_fence = vec![("LEASEHOLD_FAILPOINT_STOP_BEFORE_JOURNAL".to_owned(), KEY.to_owned())];
    let options = ClusterOptions { sidecar_env: vec![stop_after_fence], ..short_lease_options() };
    let cluster = Cluster::start(&db, options).await.unwrap();
    let (a, b) = (&cluster.nodes[0], &cluster.nodes[1]);
    let stream = |node: &localcluster::Node| format!("{}/v1/sessions/{KEY}/stream", node.public_url());
    let mut on_a = localcluster::Observer::open(&stream(a), None).await.unwrap();
    let mut on_b = localcluster::Observer::open(&stream(b), None).await.unwrap();

    let zombie = post_on_node_a(&cluster, KEY, turn("zombie"));
    let stopped_by = Instant::now() + Duration::from_secs(10);
    while !localcluster::process::is_stopped(a.sidecar.pid()) {
        assert!(Instant::now() < stopped_by, "node-a never reached the failpoint");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // node-b takes the session over once node-a's node lease has expired (and its frozen
    // fence hold is ended by the database), and serves a turn at epoch 2.
    let via_b = Client::new(vec![b.public_url()]);
    let claimable_by = Instant::now() + Duration::from_secs(10);
    // Claimable, or already claimed by a node sweeping for orphaned turns.
    loop {
        let session = via_b.session(KEY, 0).await.unwrap();
        if session["claimable"] == true || session["owner"].as_str().is_some_and(|o| o != "node-a") {
            break;
        }
        assert!(Instant::now() < claimable_by, "node-a's lease never expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let answer = via_b.turn(KEY, &turn("after")).await.unwrap();
    // node-b, or a node whose sweep for orphaned turns claimed the session first.
    assert_eq!((answer.status, answer.epoch), (200, Some(2)));
    assert_ne!(answer.owner.as_deref(), Some("node-a"));

    a.resume();
    let (status, body) = zombie.await.unwrap();
    assert_ne!(status, 200, "the frozen turn is not acknowledged: {body}");
    for observer in [&mut on_a, &mut on_b] {
        observer.until(Duration::from_secs(10), turn_finished(1)).await.unwrap();
        // Whatever else arrives in the next moments: no event of epoch 1.
        while observer.next(Duration::from_millis(500)).await.is_some() {}
        let ids = observer.ids();
        assert!(ids.iter().all(|id| id.starts_with("2-")), "a zombie's event was delivered: {ids:?}");
    }
    assert_eq!(
        support::history(&db, KEY).await,
        ["zombie", "after"],
        "the frozen turn resumed once by the new owner, before the next"
    );
    assert!(a.metric("leasehold_fenced_writes_total", "").await >= 1.0, "node-a counted its fenced publish");
}

/// An agent's own answers to a forwarded turn, whatever their status (a 401 of its own
/// authentication, a 503 without a directive), reach the client unchanged; only the
/// owner sidecar's refusals (marked `Leasehold-Refusal`) are acted on by the forwarder.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agents_own_401_and_503_pass_through_a_forwarding_pod_unchanged() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let options = ClusterOptions {
        nodes: 2,
        agent_command: Some((support::hold_agent(), Vec::new())),
        ..long_lease_options()
    };
    let cluster = Cluster::start(&db, options).await.unwrap();
    turn_on_node_a(&cluster, "agent-says", "first").await;
    let via_b = format!("{}/v1/sessions/agent-says/turns", cluster.nodes[1].public_url());
    for status in [401u16, 503] {
        let response = reqwest::Client::new()
            .post(&via_b)
            .body(json!({ "status": status }).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), status, "forwarded from node-b to node-a's agent");
        assert!(!response.headers().contains_key("leasehold-refusal"), "not a sidecar's refusal");
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(body, json!({ "error": "from_the_agent", "status": status }));
    }
    assert_eq!(cluster.nodes[1].metric("leasehold_peer_rejections_total", "").await, 0.0);
}

/// A loopback port that accepts no connection: a listener whose accept queue is full and
/// never drained, so the kernel drops further SYNs and a connect hangs until its timeout
/// (a pod whose peer port does not answer, without a firewall). Keep both values alive.
async fn unanswering_port() -> (std::net::SocketAddr, tokio::net::TcpListener, Vec<tokio::net::TcpStream>) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(0).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut queued = Vec::new();
    // Fill the accept queue; the connects that would not fit time out here.
    for _ in 0..4 {
        if let Ok(Ok(stream)) =
            tokio::time::timeout(Duration::from_millis(200), tokio::net::TcpStream::connect(addr)).await
        {
            queued.push(stream);
        }
    }
    (addr, listener, queued)
}

/// A loopback port nothing listens on: connections are refused.
fn refusing_port() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// CONTRACT §7 forward outcomes: the owner is unreachable before the request is sent, the
/// re-claim names another live owner, and that one is unreachable too: `503
/// owner_unreachable` with its directive, nothing run. Forced: node-a advertises a peer
/// address that never answers a connect (so node-b's first hop waits out its connect
/// timeout), node-c one that refuses; while node-b's first hop waits, node-a is revoked
/// (as the operator does) and node-c takes the session over.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_unreachable_hop_is_refused_owner_unreachable_with_a_directive() {
    let _serial = support::serial().await;
    let db = support::database().await;
    let (silent, _listener, _queued) = unanswering_port().await;
    let advertise =
        |addr: std::net::SocketAddr| vec![("LEASEHOLD_ADVERTISE_PEER_ADDR".to_owned(), addr.to_string())];
    let options = ClusterOptions {
        sidecar_env: vec![advertise(silent), Vec::new(), advertise(refusing_port())],
        ..long_lease_options()
    };
    let ttl = options.lease_ttl;
    let cluster = Cluster::start(&db, options).await.unwrap();
    let key = "twice-unreachable";
    turn_on_node_a(&cluster, key, "first").await;
    let (b, c) = (&cluster.nodes[1], &cluster.nodes[2]);

    let held_before = b.metric("leasehold_resolutions_total", "outcome=\"held\"").await;
    let via_b = tokio::spawn({
        let url = format!("{}/v1/sessions/{key}/turns", b.public_url());
        async move {
            let response =
                reqwest::Client::new().post(url).body(turn("lost").to_string()).send().await.unwrap();
            let retry_after = response.headers().get("retry-after").cloned();
            (response.status().as_u16(), retry_after, response.json::<serde_json::Value>().await.unwrap())
        }
    });
    // node-b has resolved node-a as the holder: its hop is now waiting to connect.
    support::eventually("node-b resolved node-a as the holder", || async {
        b.metric("leasehold_resolutions_total", "outcome=\"held\"").await > held_before
    })
    .await;
    assert!(support::revoke_node(&db, "node-a").await >= 1, "node-a held the session");
    let taken = Client::new(vec![c.public_url()]).turn(key, &turn("taken")).await.unwrap();
    assert_eq!((taken.status, taken.owner.as_deref(), taken.epoch), (200, Some("node-c"), Some(2)));

    let (status, retry_after, body) = via_b.await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"], "owner_unreachable", "{body}");
    let expected = Refusal::OwnerUnreachable { ttl }.retry();
    assert_eq!(body["retry"]["delay_ms"], expected.delay_ms, "{body}");
    assert_eq!(body["retry"]["budget_ms"], expected.budget_ms, "{body}");
    assert!(retry_after.is_some(), "a Retry-After header");
    let counted = b.metric("leasehold_turns_total", "outcome=\"owner_unreachable\"").await;
    assert_eq!(counted, 1.0, "node-b counted the refusal");
    assert_eq!(support::history(&db, key).await, ["first", "taken"], "the refused turn ran nowhere");
}

/// An owner dies between journaling a batch of events and fanning it out (the failpoint
/// stops node-a's sidecar right after the journal write; then the pod is killed). The
/// observer connected to the node that takes the session over still gets those events,
/// once and in order, before the new owner's own: the new owner reads them from the
/// journal before its first event of the epoch. (A follower re-subscribing elsewhere got
/// them from the journal already; the new owner's own observers did not.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn events_journaled_by_an_owner_that_died_before_sending_them_reach_the_next_owners_observers() {
    const KEY: &str = "journaled-unsent";
    let _serial = support::serial().await;
    let db = support::database().await;
    let stop_after_journal = vec![("LEASEHOLD_FAILPOINT_STOP_AFTER_JOURNAL".to_owned(), KEY.to_owned())];
    let options = ClusterOptions { sidecar_env: vec![stop_after_journal], ..short_lease_options() };
    let mut cluster = Cluster::start(&db, options).await.unwrap();
    let via_b = Client::new(vec![cluster.nodes[1].public_url()]);
    // node-b owns the session at epoch 1; the observer on node-c sees its events.
    let first = via_b.turn(KEY, &turn("first")).await.unwrap();
    assert_eq!((first.status, first.owner.as_deref(), first.epoch), (200, Some("node-b"), Some(1)));
    let stream = format!("{}/v1/sessions/{KEY}/stream", cluster.nodes[2].public_url());
    let mut on_c = localcluster::Observer::open(&stream, Some("1-0")).await.unwrap();
    on_c.until(Duration::from_secs(10), turn_finished(1)).await.unwrap();
    // node-b dies; once its lease lapses, node-a claims the session at epoch 2 with a turn
    // whose first batch of events is journaled, then node-a stops before sending it.
    cluster.nodes[1].kill9();
    let via_c = Client::new(vec![cluster.nodes[2].public_url()]);
    let claimable_by = Instant::now() + Duration::from_secs(10);
    while via_c.session(KEY, 0).await.unwrap()["claimable"] != true {
        assert!(Instant::now() < claimable_by, "node-b's lease never lapsed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let zombie = post_on_node_a(&cluster, KEY, json!({ "text": "cut", "think_ms": 400, "tokens": 4 }));
    let stopped_by = Instant::now() + Duration::from_secs(10);
    while !localcluster::process::is_stopped(cluster.nodes[0].sidecar.pid()) {
        assert!(Instant::now() < stopped_by, "node-a never reached the failpoint");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let journaled = journaled_ids(&db, KEY, 2).await;
    assert!(!journaled.is_empty(), "node-a journaled its first events at epoch 2");
    cluster.nodes[0].kill9();
    let _ = zombie.await;
    // node-c's sweep claims the session at epoch 3 and resumes the turn.
    on_c.until(Duration::from_secs(20), turn_finished(2)).await.unwrap();
    let ids = on_c.ids();
    support::strictly_increasing(&ids);
    for id in &journaled {
        assert_eq!(ids.iter().filter(|seen| *seen == id).count(), 1, "{id} seen once: {ids:?}");
    }
    assert_eq!(support::history(&db, KEY).await, ["first", "cut"], "the cut turn resumed once");
}

/// The ids of the journaled events of `key` at `epoch`.
async fn journaled_ids(db: &str, key: &str, epoch: i64) -> Vec<String> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(db).await.unwrap();
    let seqs: Vec<i64> = sqlx::query_scalar(
        "SELECT seq FROM agent_turn_events WHERE agent_key = $1 AND epoch = $2 ORDER BY seq",
    )
    .bind(key)
    .bind(epoch)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    seqs.into_iter().map(|seq| format!("{epoch}-{seq}")).collect()
}
