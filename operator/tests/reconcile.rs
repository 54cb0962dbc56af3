//! The apply/status path and the pod watcher against a mocked API server
//! (`tower_test::mock::pair`), with the lease store on a real Postgres and, for the drain,
//! a real sidecar.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use http::{Request, Response};
use k8s_openapi::api::core::v1::Pod;
use kube::{
    client::Body,
    runtime::events::{Recorder, Reporter},
    Client,
};
use leasehold_core::{
    store::{Claim, LeaseStore},
    Owner, SessionKey,
};
use leasehold_crds::AgentCluster;
use leasehold_operator::{
    build::TEMPLATE_HASH,
    controller::{reconcile, Context},
    metrics::Metrics,
    pods::{self, Seen},
    stores::Stores,
};
use localcluster::{Cluster as LocalCluster, ClusterOptions, Link};
use serde_json::{json, Value};
use sqlx::{Connection, PgConnection};

// A real Postgres that accepts TLS connections only, shared with the store's tests.
#[path = "../../core/tests/support/tls_postgres.rs"]
mod tls_postgres;

/// One request the operator made.
#[derive(Debug, Clone)]
struct Call {
    method: String,
    path: String,
    body: Value,
}

impl Call {
    /// The path without the query.
    fn route(&self) -> &str {
        self.path.split('?').next().unwrap_or_default()
    }
}

/// A fake API server: answers by route, records every call.
#[derive(Clone)]
struct FakeApi {
    calls: Arc<Mutex<Vec<Call>>>,
    cluster: Value,
    database_url: String,
    pods: Vec<Value>,
    /// The generated cluster secret's value, when it exists.
    cluster_secret: Option<String>,
    /// The value of the cluster secret the operator created here, read back like the
    /// API server would.
    created_secret: Arc<Mutex<Option<String>>>,
    /// When set, the API server refuses the Deployment's apply with this message (422).
    refuse_deployment: Option<String>,
}

fn respond(status: u16, body: &Value) -> Response<Body> {
    Response::builder().status(status).body(Body::from(body.to_string().into_bytes())).unwrap()
}

fn not_found() -> Value {
    json!({"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404,"message":"not found"})
}

impl FakeApi {
    fn answer(&self, call: &Call) -> (u16, Value) {
        let path = call.path.split('?').next().unwrap_or_default();
        let method = call.method.as_str();
        match (method, path) {
            ("GET", p) if p.ends_with("/secrets/chat-cluster-secret") => {
                match self.cluster_secret.clone().or_else(|| self.created_secret.lock().unwrap().clone()) {
                    Some(secret) => {
                        use base64::Engine;
                        let value = base64::engine::general_purpose::STANDARD.encode(secret);
                        let data = json!({ leasehold_crds::CLUSTER_SECRET_KEY: value });
                        (
                            200,
                            json!({"apiVersion":"v1","kind":"Secret","metadata":{"name":"chat-cluster-secret"},"data": data}),
                        )
                    }
                    None => (404, not_found()),
                }
            }
            ("POST", p) if p.ends_with("/secrets") => {
                let value = call.body["stringData"][leasehold_crds::CLUSTER_SECRET_KEY].as_str();
                *self.created_secret.lock().unwrap() = value.map(str::to_owned);
                (201, call.body.clone())
            }
            ("GET", p) if p.ends_with("/secrets/chat-db") => {
                use base64::Engine;
                let url = base64::engine::general_purpose::STANDARD.encode(&self.database_url);
                (
                    200,
                    json!({"apiVersion":"v1","kind":"Secret","metadata":{"name":"chat-db"},"data":{"DATABASE_URL": url}}),
                )
            }
            ("PATCH", p) if p.contains("/deployments/") && self.refuse_deployment.is_some() => (
                422,
                json!({"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Invalid","code":422,
                       "message": self.refuse_deployment.clone()}),
            ),
            ("PATCH", p) if p.contains("/deployments/") => {
                let mut d = call.body.clone();
                d["metadata"]["generation"] = json!(1);
                d["status"] =
                    json!({"replicas":3,"readyReplicas":2,"updatedReplicas":3,"observedGeneration":1});
                (200, d)
            }
            ("PATCH", p) if p.ends_with("/status") => {
                let mut ac = self.cluster.clone();
                ac["status"] = call.body["status"].clone();
                (200, ac)
            }
            ("PATCH", p) if p.contains("/pods/") => {
                (200, json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":"x"}}))
            }
            ("PATCH", _) => (200, call.body.clone()),
            ("GET", p) if p.ends_with("/pods") => {
                (200, json!({"apiVersion":"v1","kind":"PodList","metadata":{},"items": self.pods}))
            }
            ("GET", p) if p.contains("/agentclusters/") => (200, self.cluster.clone()),
            ("POST", p) if p.contains("/events") => (201, call.body.clone()),
            _ => (404, not_found()),
        }
    }

    /// Serve the mock handle until the client is dropped.
    fn spawn(self, mut handle: tower_test::mock::Handle<Request<Body>, Response<Body>>) {
        tokio::spawn(async move {
            while let Some((request, send)) = handle.next_request().await {
                let (parts, body) = request.into_parts();
                let bytes = body.collect_bytes().await.unwrap_or_default();
                let call = Call {
                    method: parts.method.to_string(),
                    path: parts.uri.path_and_query().map(|p| p.to_string()).unwrap_or_default(),
                    body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
                };
                let (status, body) = self.answer(&call);
                self.calls.lock().unwrap().push(call);
                send.send_response(respond(status, &body));
            }
        });
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }
}

fn fixture(name: &str) -> Value {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

async fn database() -> String {
    let admin = std::env::var("DATABASE_URL").expect("DATABASE_URL: run with `make test`");
    let name = format!("op_{}", uuid::Uuid::new_v4().simple());
    let mut conn = PgConnection::connect(&admin).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut conn).await.unwrap();
    let (base, query) = admin.split_once('?').unwrap_or((&admin, ""));
    let url = format!("{}/{name}?{query}", base.rsplit_once('/').unwrap().0);
    LeaseStore::connect(&url, 2).await.unwrap().migrate().await.unwrap();
    url
}

fn pod(name: &str, extra: Value) -> Value {
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": "team-a", "uid": format!("uid-{name}"),
                      "labels": { "leasehold.dev/cluster": "chat" } },
        "status": { "phase": "Running", "podIP": "127.0.0.1" }
    });
    json_merge(&mut pod, extra);
    pod
}

fn json_merge(into: &mut Value, from: Value) {
    match (into, from) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                json_merge(a.entry(k).or_insert(Value::Null), v);
            }
        }
        (slot, v) => *slot = v,
    }
}

fn context(fake: &FakeApi) -> Arc<Context> {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    fake.clone().spawn(handle);
    let client = Client::new(service, "default");
    Arc::new(Context {
        client: client.clone(),
        sidecar_image: "leasehold/sidecar:test".into(),
        admin_callers: leasehold_operator::build::AdminCallers {
            operator_namespace: "leasehold-system".into(),
            ..Default::default()
        },
        metrics: Arc::new(Metrics::default()),
        retention: Default::default(),
        stores: Stores::default(),
        recorder: Recorder::new(client, Reporter { controller: "leasehold-operator".into(), instance: None }),
        http: pods::drain_client().unwrap(),
    })
}

async fn live_leases(store: &LeaseStore, node: &str, n: usize) -> Owner {
    let owner = Owner::new_boot(node);
    store.register_boot(&owner, "127.0.0.1:1", Duration::from_secs(60)).await.unwrap();
    for i in 0..n {
        let key = SessionKey::parse(&format!("{node}-s{i}")).unwrap();
        assert!(matches!(store.claim(&key, &owner).await.unwrap(), Claim::Claimed { .. }));
    }
    owner
}

fn fake(database_url: &str, pods: Vec<Value>) -> FakeApi {
    FakeApi {
        calls: Arc::default(),
        cluster: fixture("basic.yaml"),
        database_url: database_url.to_owned(),
        pods,
        cluster_secret: None,
        created_secret: Arc::default(),
        refuse_deployment: None,
    }
}

fn patches<'a>(calls: &'a [Call], kind: &str) -> Vec<&'a Call> {
    calls.iter().filter(|c| c.method == "PATCH" && c.path.contains(kind)).collect()
}

/// Reconciling a cluster collects its database's sessions nobody holds idle past the
/// cluster's retention (once per interval), and never a live one.
#[tokio::test]
async fn reconcile_collects_sessions_idle_past_the_retention() {
    let db = database().await;
    let store = LeaseStore::connect(&db, 2).await.unwrap();
    live_leases(&store, "chat-0", 1).await;
    let live_owner: String =
        sqlx::query_scalar("SELECT owner FROM agent_leases LIMIT 1").fetch_one(store.pool()).await.unwrap();
    sqlx::query(
        "INSERT INTO agent_leases (agent_key, owner, epoch, released, acquired_at, updated_at) \
         SELECT 'old-' || i, $1, 1, true, now(), now() - interval '40 days' FROM generate_series(1, 3) i",
    )
    .bind(&live_owner)
    .execute(store.pool())
    .await
    .unwrap();
    sqlx::query("UPDATE agent_leases SET updated_at = now() - interval '40 days' WHERE NOT released")
        .execute(store.pool())
        .await
        .unwrap();
    let count = |sql: &'static str| {
        let pool = store.pool().clone();
        async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(&pool).await.unwrap() }
    };
    let fake = fake(&db, vec![pod("chat-0", json!({}))]);
    let ctx = context(&fake);
    let ac: Arc<AgentCluster> = Arc::new(serde_json::from_value(fake.cluster.clone()).unwrap());
    reconcile(ac.clone(), ctx.clone()).await.unwrap();
    assert_eq!(
        count("SELECT count(*) FROM agent_leases WHERE released").await,
        0,
        "the 3 idle ones collected"
    );
    assert_eq!(
        count("SELECT count(*) FROM agent_leases WHERE NOT released").await,
        1,
        "the live one, however old, kept"
    );
    let metrics = ctx.metrics.encode();
    assert!(metrics.contains("leasehold_operator_collected_sessions_total 3"), "{metrics}");
    // Not due again within the interval: nothing collected on the next reconcile.
    sqlx::query("UPDATE agent_leases SET released = true").execute(store.pool()).await.unwrap();
    reconcile(ac, ctx).await.unwrap();
    assert_eq!(count("SELECT count(*) FROM agent_leases").await, 1, "once per interval per database");
}

/// Reconciling a cluster also collects the journal: turns finished (or cancelled) before
/// the cluster's `turns.answerRetention`, with their events, in batches until none is
/// left; a running turn, however old, and a turn finished within the retention stay.
#[tokio::test]
async fn reconcile_collects_answers_past_the_answer_retention() {
    /// More than two full batches (1000 a statement): the pass goes on while they are full.
    const OLD: i64 = 2500;
    let db = database().await;
    let store = LeaseStore::connect(&db, 2).await.unwrap();
    live_leases(&store, "chat-0", 1).await;
    let turn = |id: &str, state: &str, finished: Option<&str>| {
        let pool = store.pool().clone();
        let (id, state, finished) = (id.to_owned(), state.to_owned(), finished.map(str::to_owned));
        async move {
            sqlx::query(
                "INSERT INTO agent_turns (agent_key, turn_id, kind, digest, request, epoch, state, status, \
                 answer, created_at, finished_at) \
                 VALUES ('chat-0-s0', $1, 'turn', '\\x00', 'q', 1, $2, 200, 'a', now() - interval '3 hours', \
                 now() - $3::interval)",
            )
            .bind(&id)
            .bind(&state)
            .bind(finished)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    // 2h ago: past the spec's 1h, within the 24h default (so the spec's value is the one used).
    sqlx::query(
        "INSERT INTO agent_turns (agent_key, turn_id, kind, digest, request, epoch, state, status, answer, \
         created_at, finished_at) \
         SELECT 'chat-0-s0', 'old-' || i, 'turn', '\\x00', 'q', 1, 'finished', 200, 'a', \
         now() - interval '3 hours', now() - interval '2 hours' FROM generate_series(1, $1) i",
    )
    .bind(OLD)
    .execute(store.pool())
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO agent_turn_events (agent_key, epoch, seq, turn_id, kind, data, created_at) \
         SELECT 'chat-0-s0', 1, i, 'old-' || i, 'token', '{}', now() - interval '2 hours' \
         FROM generate_series(1, $1) i",
    )
    .bind(OLD)
    .execute(store.pool())
    .await
    .unwrap();
    turn("cancelled-old", "cancelled", Some("2 hours")).await;
    turn("finished-recent", "finished", Some("30 minutes")).await;
    turn("running-old", "running", None).await;
    sqlx::query(
        "INSERT INTO agent_turn_events (agent_key, epoch, seq, turn_id, kind, data) \
         VALUES ('chat-0-s0', 1, 100000, 'running-old', 'token', '{}')",
    )
    .execute(store.pool())
    .await
    .unwrap();

    let mut fake = fake(&db, vec![pod("chat-0", json!({}))]);
    fake.cluster["spec"]["turns"] = json!({ "answerRetention": "1h" });
    let ctx = context(&fake);
    let ac: Arc<AgentCluster> = Arc::new(serde_json::from_value(fake.cluster.clone()).unwrap());
    reconcile(ac, ctx.clone()).await.unwrap();

    let left: Vec<String> = sqlx::query_scalar("SELECT turn_id FROM agent_turns ORDER BY turn_id")
        .fetch_all(store.pool())
        .await
        .unwrap();
    assert!(left.len() <= 2, "{} turns left, first {:?}", left.len(), &left[..5.min(left.len())]);
    assert_eq!(left, ["finished-recent", "running-old"], "every old finished or cancelled turn collected");
    let events: Vec<Option<String>> =
        sqlx::query_scalar("SELECT turn_id FROM agent_turn_events").fetch_all(store.pool()).await.unwrap();
    assert_eq!(events, [Some("running-old".to_owned())], "the collected turns' events went with them");
    let metrics = ctx.metrics.encode();
    let expected = format!("leasehold_operator_collected_turns_total {}", OLD + 1);
    assert!(metrics.contains(&expected), "{expected:?} in\n{metrics}");
    let live: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_leases WHERE NOT released")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(live, 1, "the session itself is untouched");
}

#[tokio::test]
async fn a_new_cluster_gets_every_child_and_a_status_from_postgres() {
    let db = database().await;
    let store = LeaseStore::connect(&db, 2).await.unwrap();
    live_leases(&store, "chat-0", 2).await;
    let fake = fake(&db, vec![pod("chat-0", json!({})), pod("chat-1", json!({}))]);
    let ctx = context(&fake);
    let ac: AgentCluster = serde_json::from_value(fake.cluster.clone()).unwrap();
    reconcile(Arc::new(ac), ctx).await.unwrap();

    let calls = fake.calls();
    // The generated cluster secret is created once (it did not exist).
    assert!(calls.iter().any(|c| c.method == "POST" && c.route().ends_with("/namespaces/team-a/secrets")));
    for kind in ["/deployments/chat", "/services/chat", "/poddisruptionbudgets/chat", "/networkpolicies/chat"]
    {
        let applied = patches(&calls, kind);
        assert_eq!(applied.len(), 1, "{kind} applied once");
        assert!(applied[0].path.contains("fieldManager=leasehold-operator"), "{}", applied[0].path);
        assert!(applied[0].path.contains("force=true"), "server-side apply, forced");
    }
    let status = &patches(&calls, "/agentclusters/chat/status")[0].body["status"];
    assert_eq!(status["leases"], 2, "counted in Postgres");
    assert_eq!((status["replicas"].clone(), status["readyReplicas"].clone()), (json!(3), json!(2)));
    assert_eq!(status["observedGeneration"], 3);
    let condition =
        |t: &str| status["conditions"].as_array().unwrap().iter().find(|c| c["type"] == t).unwrap().clone();
    assert_eq!(condition("Available")["status"], "True");
    assert_eq!(condition("Degraded")["status"], "False");
    // pod-deletion-cost follows each pod's lease count.
    let costs: Vec<(String, Value)> = patches(&calls, "/pods/")
        .iter()
        .map(|c| {
            (
                c.path.clone(),
                c.body["metadata"]["annotations"]["controller.kubernetes.io/pod-deletion-cost"].clone(),
            )
        })
        .collect();
    assert!(costs.iter().any(|(p, v)| p.contains("/pods/chat-0") && v == "2"), "{costs:?}");
    assert!(costs.iter().any(|(p, v)| p.contains("/pods/chat-1") && v == "0"), "{costs:?}");
}

/// The status carries the pods' selector (for the scale subresource) and is patched, like
/// the deletion costs, under a field manager of its own.
#[tokio::test]
async fn status_and_deletion_cost_patches_are_managed_and_name_the_selector() {
    let db = database().await;
    let fake = fake(&db, vec![pod("chat-0", json!({}))]);
    let ac: AgentCluster = serde_json::from_value(fake.cluster.clone()).unwrap();
    reconcile(Arc::new(ac), context(&fake)).await.unwrap();
    let calls = fake.calls();
    let status = patches(&calls, "/agentclusters/chat/status")[0];
    assert!(status.path.contains("fieldManager=leasehold-operator-status"), "{}", status.path);
    assert_eq!(status.body["status"]["selector"], "leasehold.dev/cluster=chat");
    let cost = patches(&calls, "/pods/chat-0")[0];
    assert!(cost.path.contains("fieldManager=leasehold-operator-deletion-cost"), "{}", cost.path);
}

/// An apply the API server refuses becomes a Warning event and a `Degraded` condition,
/// both with the API server's message; the reconcile fails (and is retried).
#[tokio::test]
async fn a_refused_apply_is_an_event_and_a_degraded_condition_with_the_servers_message() {
    const REFUSAL: &str = "admission webhook \"policy.example\" denied the request: no latest tags";
    let db = database().await;
    let mut fake = fake(&db, vec![]);
    fake.cluster_secret = Some("s".into());
    fake.refuse_deployment = Some(REFUSAL.to_owned());
    let ac: AgentCluster = serde_json::from_value(fake.cluster.clone()).unwrap();
    let result = reconcile(Arc::new(ac), context(&fake)).await;
    assert!(result.is_err(), "the reconcile fails, so it is retried");
    let calls = fake.calls();
    let status = &patches(&calls, "/agentclusters/chat/status")[0].body["status"];
    let degraded = status["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Degraded").unwrap();
    assert_eq!(
        (degraded["status"].as_str(), degraded["reason"].as_str()),
        (Some("True"), Some("ApplyFailed"))
    );
    let message = degraded["message"].as_str().unwrap();
    assert!(message.contains("denied the request: no latest tags"), "{message}");
    let event = calls
        .iter()
        .find(|c| {
            c.method == "POST" && c.path.contains("/events") && c.body.to_string().contains("ApplyFailed")
        })
        .expect("an ApplyFailed event");
    assert!(event.body.to_string().contains("no latest tags"), "{}", event.body);
    assert_eq!(event.body["type"], "Warning");
    assert!(patches(&calls, "/services/chat").is_empty(), "nothing applied after the refusal");
}

#[tokio::test]
async fn a_spec_change_rolls_the_deployment() {
    let db = database().await;
    let hash_after = |fake: &FakeApi| {
        let calls = fake.calls();
        let d = &patches(&calls, "/deployments/chat")[0].body;
        d["spec"]["template"]["metadata"]["annotations"][TEMPLATE_HASH].as_str().unwrap().to_owned()
    };
    let first = fake(&db, vec![]);
    reconcile(Arc::new(serde_json::from_value(first.cluster.clone()).unwrap()), context(&first))
        .await
        .unwrap();
    let mut second = fake(&db, vec![]);
    second.cluster["spec"]["template"]["spec"]["containers"][0]["env"] =
        json!([{"name":"MODEL","value":"next"}]);
    second.cluster_secret = Some("s".into());
    reconcile(Arc::new(serde_json::from_value(second.cluster.clone()).unwrap()), context(&second))
        .await
        .unwrap();
    assert_ne!(hash_after(&first), hash_after(&second), "the new template is applied with a new hash");
    let calls = second.calls();
    let env =
        &patches(&calls, "/deployments/chat")[0].body["spec"]["template"]["spec"]["containers"][0]["env"];
    assert_eq!(env[0]["value"], "next");
    assert!(
        !second.calls().iter().any(|c| c.method == "POST" && c.route().ends_with("/secrets")),
        "existing secret kept"
    );
}

#[tokio::test]
async fn an_invalid_spec_is_degraded_and_touches_no_child() {
    let db = database().await;
    let mut fake = fake(&db, vec![]);
    fake.cluster = fixture("invalid.yaml");
    let ac: AgentCluster = serde_json::from_value(fake.cluster.clone()).unwrap();
    reconcile(Arc::new(ac), context(&fake)).await.unwrap();
    let calls = fake.calls();
    let touched: Vec<_> = calls
        .iter()
        .filter(|c| c.method != "GET" && !c.path.contains("/events") && !c.route().ends_with("/status"))
        .collect();
    assert!(touched.is_empty(), "no child touched: {touched:?}");
    let status = &patches(&calls, "/agentclusters/broken/status")[0].body["status"];
    let degraded = status["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Degraded").unwrap();
    assert_eq!(
        (degraded["status"].as_str(), degraded["reason"].as_str()),
        (Some("True"), Some("InvalidSpec"))
    );
    let message = degraded["message"].as_str().unwrap();
    assert!(message.contains("spec.replicas"), "{message}");
    assert!(message.contains("spec.turns.answerRetention: \"someday\""), "{message}");
    assert!(calls.iter().any(|c| c.method == "POST" && c.path.contains("/events")), "a Warning event");
}

/// A database that refuses the operator's TLS (a CA that did not sign its certificate)
/// degrades the cluster with `StoreUnavailable`, and the condition names the cause
/// (before, it said "lease store failed" alone).
#[tokio::test]
async fn a_tls_refusal_is_named_in_the_store_unavailable_condition() {
    let pg = tls_postgres::TlsPostgres::start();
    let fake =
        fake(&pg.url_with_ca("localhost", "verify-full", "other-ca.crt"), vec![pod("chat-0", json!({}))]);
    let ac: AgentCluster = serde_json::from_value(fake.cluster.clone()).unwrap();
    reconcile(Arc::new(ac), context(&fake)).await.unwrap();
    let calls = fake.calls();
    let status = &patches(&calls, "/agentclusters/chat/status")[0].body["status"];
    let degraded = status["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Degraded").unwrap();
    assert_eq!(
        (degraded["status"].as_str(), degraded["reason"].as_str()),
        (Some("True"), Some("StoreUnavailable"))
    );
    let message = degraded["message"].as_str().unwrap();
    assert!(message.contains("not signed by a CA this process trusts"), "{message}");
    assert!(message.contains("UnknownIssuer"), "the driver's own words follow: {message}");
    assert_eq!(message.lines().count(), 1, "{message}");
}

/// The operator drains a terminating pod through a real sidecar's admin port, signing
/// the drain with the cluster secret for that pod; with another secret the sidecar
/// refuses it and the operator records `DrainFailed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminating_pod_is_drained_through_its_admin_port() {
    let db = database().await;
    let options = ClusterOptions { nodes: 1, ..ClusterOptions::default() };
    let secret = options.cluster_secret.clone().unwrap();
    let cluster = LocalCluster::start(&db, options).await.unwrap();
    let node = &cluster.nodes[0];
    cluster.client().turn("held", &json!({ "text": "x" })).await.unwrap();
    // The pod's IP: the sidecar's admin port, reached on the port the operator uses.
    let pod_ip = localcluster::cluster::next_ip();
    let admin = std::net::SocketAddr::from((node.ip, localcluster::cluster::ADMIN_PORT));
    let _link = Link::start((pod_ip, 9090).into(), admin).await.unwrap();
    let terminating: Pod = serde_json::from_value(pod(
        &node.name,
        json!({"metadata": {"deletionTimestamp": "2026-12-01T00:00:00Z"}, "status": {"podIP": pod_ip.to_string()}}),
    ))
    .unwrap();
    let readyz = format!("{}/readyz", node.admin_url());

    let mut wrong = fake(&db, vec![]);
    wrong.cluster_secret = Some("another-secret".into());
    pods::handle(&context(&wrong), &terminating, false, &Seen::default()).await;
    assert!(wrong
        .calls()
        .iter()
        .any(|c| c.path.contains("/events") && c.body.to_string().contains("DrainFailed")));
    assert_eq!(reqwest::get(&readyz).await.unwrap().status(), 200, "a drain with another secret is refused");

    let mut right = fake(&db, vec![]);
    right.cluster_secret = Some(secret);
    let (ctx, seen) = (context(&right), Seen::default());
    pods::handle(&ctx, &terminating, false, &seen).await;
    pods::handle(&ctx, &terminating, false, &seen).await; // the same pod again: drained once
    assert_eq!(reqwest::get(&readyz).await.unwrap().status(), 503, "drained");
    let drained: Vec<_> = right
        .calls()
        .into_iter()
        .filter(|c| c.path.contains("/events") && c.body.to_string().contains("Drained"))
        .collect();
    assert_eq!(drained.len(), 1, "one Drained event");
    assert!(drained[0].body.to_string().contains(r#"\"handed_back\":1"#), "{}", drained[0].body);
}

#[tokio::test]
async fn a_deleted_or_failed_pod_has_its_leases_revoked_at_once() {
    let db = database().await;
    let store = LeaseStore::connect(&db, 2).await.unwrap();
    live_leases(&store, "chat-1", 3).await;
    live_leases(&store, "chat-2", 2).await;
    let other = live_leases(&store, "chat-3", 1).await;
    let fake = fake(&db, vec![]);
    let ctx = context(&fake);
    let seen = Seen::default();

    let gone: Pod = serde_json::from_value(pod("chat-1", json!({}))).unwrap();
    pods::handle(&ctx, &gone, true, &seen).await;
    let failed: Pod = serde_json::from_value(pod("chat-2", json!({"status": {"phase": "Failed"}}))).unwrap();
    pods::handle(&ctx, &failed, false, &seen).await;

    let nodes = ["chat-1".to_owned(), "chat-2".to_owned(), "chat-3".to_owned()];
    let counts = store.live_leases_by_node(&nodes).await.unwrap();
    assert_eq!(counts.get("chat-1"), None, "revoked: claimable without waiting for the TTL");
    assert_eq!(counts.get("chat-2"), None);
    assert_eq!(counts.get("chat-3"), Some(&1), "other pods untouched");
    let claim = store.claim(&SessionKey::parse("chat-1-s0").unwrap(), &other).await.unwrap();
    assert!(matches!(claim, Claim::TookOver { .. }), "{claim:?}");
    assert!(fake
        .calls()
        .iter()
        .any(|c| c.path.contains("/events") && c.body.to_string().contains("LeasesRevoked")));
}

/// A listener on `ip`'s admin port that completes no connect: its accept queue is full
/// and never drained, so the kernel drops further SYNs and a connect hangs until the
/// client's connect timeout (a pod on a partitioned node, without a firewall). Keep both
/// values alive.
async fn blackholed_admin_port(
    ip: std::net::Ipv4Addr,
) -> (tokio::net::TcpListener, Vec<tokio::net::TcpStream>) {
    /// A connect to a full queue hangs; one that fits completes at once on loopback.
    const FILL_CONNECT: Duration = Duration::from_millis(200);
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind((ip, 9090).into()).unwrap();
    let listener = socket.listen(0).unwrap();
    let mut queued = Vec::new();
    for _ in 0..4 {
        let connect = tokio::net::TcpStream::connect((ip, 9090));
        if let Ok(Ok(stream)) = tokio::time::timeout(FILL_CONNECT, connect).await {
            queued.push(stream);
        }
    }
    // The queue is full: a connect now hangs.
    let probe = tokio::time::timeout(FILL_CONNECT, tokio::net::TcpStream::connect((ip, 9090))).await;
    assert!(probe.is_err(), "the admin port at {ip} still completes connects");
    (listener, queued)
}

/// Sixteen terminating pods whose admin ports accept and never answer (a partitioned
/// node's pods), and four whose admin ports complete no connect, do not hold back the
/// revocation of a failed pod's leases; the four are given up on (`DrainFailed`) within
/// the drain client's connect timeout, and a gone pod leaves nothing remembered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_drains_do_not_delay_revoking_a_failed_pod() {
    const HANGING: usize = 16;
    const BLACKHOLED: usize = 4;
    /// Scheduling and the event's round trip to the fake API, on a loaded two-core host.
    const SLACK: Duration = Duration::from_secs(2);
    let db = database().await;
    let store = LeaseStore::connect(&db, 2).await.unwrap();
    live_leases(&store, "failed-0", 2).await;
    let mut fake = fake(&db, vec![]);
    fake.cluster_secret = Some("s".into()); // the drains are signed and sent
    let ctx = context(&fake);
    let metrics = ctx.metrics.clone();
    // Admin ports that accept (the kernel completes the handshake) and never answer.
    let mut silent = Vec::new();
    let mut events = Vec::new();
    let terminating = |name: String, ip: std::net::Ipv4Addr| {
        let pod = pod(
            &name,
            json!({"metadata": {"deletionTimestamp": "2026-12-01T00:00:00Z"}, "status": {"podIP": ip.to_string()}}),
        );
        Ok(kube::runtime::watcher::Event::Apply(serde_json::from_value(pod).unwrap()))
    };
    for i in 0..HANGING {
        let ip = localcluster::cluster::next_ip();
        silent.push(std::net::TcpListener::bind((ip, 9090)).unwrap());
        events.push(terminating(format!("hanging-{i}"), ip));
    }
    // Admin ports that complete no connect at all.
    let mut blackholed = Vec::new();
    for i in 0..BLACKHOLED {
        let ip = localcluster::cluster::next_ip();
        blackholed.push(blackholed_admin_port(ip).await);
        events.push(terminating(format!("blackholed-{i}"), ip));
    }
    let failed: Pod =
        serde_json::from_value(pod("failed-0", json!({"status": {"phase": "Failed"}}))).unwrap();
    events.push(Ok(kube::runtime::watcher::Event::Apply(failed)));
    let gone: Pod = serde_json::from_value(pod("gone-0", json!({}))).unwrap();
    events.push(Ok(kube::runtime::watcher::Event::Delete(gone)));

    let seen = Arc::new(Seen::default());
    let started = std::time::Instant::now();
    tokio::spawn(pods::handle_events(ctx, futures_util::stream::iter(events), seen.clone()));
    let nodes = ["failed-0".to_owned()];
    while store.live_leases_by_node(&nodes).await.unwrap().contains_key("failed-0") {
        assert!(started.elapsed() < Duration::from_secs(2), "the failed pod's leases not revoked within 2 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("failed pod revoked {:?} after its event, behind {HANGING} hanging drains", started.elapsed());
    assert_eq!(
        seen.len(),
        HANGING + BLACKHOLED + 1,
        "the hanging and blackholed pods (drained) and the failed pod (revoked); the gone one forgotten"
    );

    // The blackholed pods' drains fail at the connect timeout; the hanging ones (connected,
    // waiting for an answer) do not, so the failures are the connect timeout's. Counted by
    // the drain metric (the events recorder folds alike events into one series).
    let failed_drains = || {
        let text = metrics.encode();
        let line =
            text.lines().find(|l| l.starts_with(r#"leasehold_operator_drains_total{outcome="failed"}"#));
        line.and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).unwrap_or(0.0) as usize
    };
    let bound = pods::DRAIN_CONNECT_TIMEOUT + SLACK;
    while failed_drains() < BLACKHOLED {
        assert!(
            started.elapsed() < bound,
            "{} of {BLACKHOLED} unreachable pods given up on (DrainFailed) within {bound:?}",
            failed_drains()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let given_up = started.elapsed();
    eprintln!("{BLACKHOLED} unreachable pods given up on {given_up:?} after their events");
    assert!(given_up >= pods::DRAIN_CONNECT_TIMEOUT, "given up only at the connect timeout: {given_up:?}");
    tokio::time::sleep(SLACK).await; // the events' round trips; and any later failure
    assert_eq!(failed_drains(), BLACKHOLED, "only the unreachable pods' drains failed");
    let events = fake.calls().into_iter().filter(|c| c.path.contains("/events")).map(|c| c.body.to_string());
    let events: Vec<_> = events.filter(|b| b.contains("DrainFailed")).collect();
    assert!(events.iter().any(|b| b.contains("blackholed-")), "a DrainFailed event: {events:?}");
    assert!(
        !events.iter().any(|b| b.contains("hanging-")),
        "a connected drain waits for its answer: {events:?}"
    );
    drop((silent, blackholed));
}

#[test]
fn pod_events_map_to_the_right_actions_once() {
    let seen = Seen::default();
    let running: Pod = serde_json::from_value(pod("p", json!({}))).unwrap();
    assert!(pods::decide(&running, false, &seen).is_empty());
    let terminating: Pod =
        serde_json::from_value(pod("p", json!({"metadata": {"deletionTimestamp": "2026-12-01T00:00:00Z"}})))
            .unwrap();
    assert_eq!(
        pods::decide(&terminating, false, &seen),
        [pods::PodAction::Drain { url: "http://127.0.0.1:9090/drain".into() }]
    );
    assert!(pods::decide(&terminating, false, &seen).is_empty(), "once");
    assert_eq!(pods::decide(&terminating, true, &seen), [pods::PodAction::Revoke]);
    assert!(pods::decide(&terminating, true, &seen).is_empty(), "once");
}

/// A fake `coordination.k8s.io` Lease endpoint with resourceVersion compare-and-swap.
fn spawn_lease_api(
    mut handle: tower_test::mock::Handle<Request<Body>, Response<Body>>,
    lease: Arc<Mutex<Option<Value>>>,
) {
    tokio::spawn(async move {
        while let Some((request, send)) = handle.next_request().await {
            let (parts, body) = request.into_parts();
            let body: Value = serde_json::from_slice(&body.collect_bytes().await.unwrap_or_default())
                .unwrap_or(Value::Null);
            let mut stored = lease.lock().unwrap();
            let conflict = json!({"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Conflict","code":409,"message":"conflict"});
            let (status, answer) = match parts.method.as_str() {
                "GET" => match stored.as_ref() {
                    Some(l) => (200, l.clone()),
                    None => (404, not_found()),
                },
                "POST" if stored.is_some() => (409, conflict),
                "POST" | "PUT" => {
                    let current = stored.as_ref().map(|l| l["metadata"]["resourceVersion"].clone());
                    if parts.method == "PUT" && current.as_ref() != Some(&body["metadata"]["resourceVersion"])
                    {
                        (409, conflict)
                    } else {
                        let version = current.and_then(|v| v.as_str()?.parse::<u64>().ok()).unwrap_or(0) + 1;
                        let mut next = body.clone();
                        next["metadata"]["resourceVersion"] = json!(version.to_string());
                        *stored = Some(next.clone());
                        (200, next)
                    }
                }
                _ => (404, not_found()),
            };
            send.send_response(respond(status, &answer));
        }
    });
}

/// A leader-election candidate against the fake Lease API holding `lease`.
fn candidate(
    lease: &Arc<Mutex<Option<Value>>>,
    identity: &str,
) -> leasehold_operator::leader::LeaderElection {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    spawn_lease_api(handle, lease.clone());
    let api = kube::Api::namespaced(Client::new(service, "default"), "leasehold-system");
    leasehold_operator::leader::LeaderElection::new(api, "leasehold-operator".into(), identity.into())
}

/// Two candidates against one Lease: never both lead; a holder that stops renewing is
/// replaced once its record has not changed for the lease duration on the candidate's own
/// clock, whatever wall-clock times it wrote.
#[tokio::test(start_paused = true)]
async fn only_one_of_two_operator_replicas_leads_until_the_lease_lapses() {
    use leasehold_operator::leader::LEASE_DURATION;
    let lease = Arc::new(Mutex::new(None));
    let (a, b) = (candidate(&lease, "operator-a"), candidate(&lease, "operator-b"));
    assert!(a.try_acquire_or_renew().await.unwrap(), "a creates the lease and leads");
    assert!(!b.try_acquire_or_renew().await.unwrap(), "b must not lead while a's lease is fresh");
    // a keeps renewing but its clock is a year behind: its renewTime looks ancient to b,
    // yet every renewal changes the record, so b never takes over.
    for i in 0..4 {
        tokio::time::advance(LEASE_DURATION).await;
        assert!(a.try_acquire_or_renew().await.unwrap(), "a renews");
        lease.lock().unwrap().as_mut().unwrap()["spec"]["renewTime"] =
            json!(format!("2025-01-01T00:00:0{i}.000000Z"));
        assert!(!b.try_acquire_or_renew().await.unwrap(), "b must not judge a by wall-clock times");
    }
    // a stops renewing (crash): once the record has not changed for the duration on b's
    // clock, b takes over.
    tokio::time::advance(LEASE_DURATION / 2).await;
    assert!(!b.try_acquire_or_renew().await.unwrap(), "not yet: half the duration");
    tokio::time::advance(LEASE_DURATION / 2 + Duration::from_secs(1)).await;
    assert!(b.try_acquire_or_renew().await.unwrap(), "b takes the lapsed lease");
    let stored = lease.lock().unwrap().clone().unwrap();
    assert_eq!(stored["spec"]["holderIdentity"], "operator-b");
    assert_eq!(stored["spec"]["leaseTransitions"], 1);
    assert!(!a.try_acquire_or_renew().await.unwrap(), "a, back, does not lead any more");
}

/// A leader that stops releases the lease: the other candidate leads at its next attempt,
/// without waiting out the duration.
#[tokio::test(start_paused = true)]
async fn a_stopping_leader_releases_the_lease_to_the_next_candidate_at_once() {
    let lease = Arc::new(Mutex::new(None));
    let (a, b) = (candidate(&lease, "operator-a"), candidate(&lease, "operator-b"));
    assert!(a.try_acquire_or_renew().await.unwrap());
    assert!(!b.try_acquire_or_renew().await.unwrap());
    b.release().await.unwrap(); // not the holder: changes nothing
    assert_eq!(lease.lock().unwrap().as_ref().unwrap()["spec"]["holderIdentity"], "operator-a");
    a.release().await.unwrap();
    assert!(b.try_acquire_or_renew().await.unwrap(), "b leads at once after a's release");
    assert!(!a.try_acquire_or_renew().await.unwrap());
}

#[test]
fn operator_metrics_name_what_it_does() {
    let metrics = Metrics::default();
    metrics.reconcile();
    metrics.error("kube");
    metrics.drain("ok");
    metrics.revoked(3);
    metrics.leases("team-a", "chat", 7);
    metrics.collected_turns(5);
    leasehold_core::store::StatementObserver::statement(
        &metrics,
        "count leases by node",
        Duration::from_millis(3),
        leasehold_core::store::StatementOutcome::Ok,
    );
    let text = metrics.encode();
    for line in [
        "leasehold_operator_reconciles_total 1",
        "leasehold_operator_errors_total{error=\"kube\"} 1",
        "leasehold_operator_drains_total{outcome=\"ok\"} 1",
        "leasehold_operator_revocations_total 3",
        "leasehold_operator_leases{namespace=\"team-a\",agentcluster=\"chat\"} 7",
        "leasehold_operator_collected_turns_total 5",
        "leasehold_store_statement_seconds_count{statement=\"count leases by node\",outcome=\"ok\"} 1",
        "leasehold_store_statement_seconds_bucket{le=\"0.0025\",statement=\"count leases by node\",outcome=\"ok\"} 0",
        "leasehold_store_statement_seconds_bucket{le=\"0.005\",statement=\"count leases by node\",outcome=\"ok\"} 1",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    assert!(
        text.lines().any(|l| l.starts_with("leasehold_build_info{version=\"") && l.ends_with("} 1")),
        "no leasehold_build_info in\n{text}"
    );
    assert!(
        !text.contains("{cluster=\"") && !text.contains(",cluster=\""),
        "a label named cluster collides with external labels:\n{text}"
    );
}

/// Lease counts (status, `pod-deletion-cost`) are refreshed when leases change, not only
/// on the periodic refresh: a claim in a database the operator uses wakes the trigger
/// the controller reconciles on; a quiet database does not.
#[tokio::test]
async fn a_lease_change_in_a_database_in_use_triggers_a_refresh() {
    use futures_util::StreamExt;
    const COALESCE: Duration = Duration::from_millis(50);
    let db = database().await;
    let stores = Stores::default();
    let store = stores.get(&db).unwrap();
    let mut refreshes = Box::pin(stores.lease_changes(COALESCE));
    let quiet = tokio::time::timeout(Duration::from_millis(500), refreshes.next()).await;
    assert!(quiet.is_err(), "no refresh while nothing changes");
    // The listener connects in the background: claim until one is seen (a claim made
    // before it listens is, by design, covered by the periodic refresh instead).
    let owner = Owner::new_boot("chat-0");
    store.register_boot(&owner, "127.0.0.1:1", Duration::from_secs(60)).await.unwrap();
    let mut seen = false;
    for i in 0..50 {
        let key = SessionKey::parse(&format!("s{i}")).unwrap();
        assert!(matches!(store.claim(&key, &owner).await.unwrap(), Claim::Claimed { .. }));
        if tokio::time::timeout(Duration::from_millis(200), refreshes.next()).await.is_ok() {
            seen = true;
            break;
        }
    }
    assert!(seen, "a claim triggered a refresh");
    // A burst of 20 changes makes a few refreshes (one per pause in which some arrived),
    // not 20, then nothing.
    for i in 100..120 {
        store.claim(&SessionKey::parse(&format!("s{i}")).unwrap(), &owner).await.unwrap();
    }
    let mut after_burst = 0;
    while tokio::time::timeout(Duration::from_millis(500), refreshes.next()).await.is_ok() {
        after_burst += 1;
        assert!(after_burst <= 5, "a burst is coalesced: {after_burst} refreshes");
    }
    assert!(after_burst >= 1, "the burst was seen");
}
