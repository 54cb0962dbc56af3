//! Shared by the cluster tests.
#![allow(dead_code)]

use sqlx::{Connection, PgConnection};

/// A fresh database on the test Postgres (`make test` sets DATABASE_URL).
pub async fn database() -> String {
    let admin = std::env::var("DATABASE_URL")
        .expect("DATABASE_URL is not set: run with `make test` (scripts/with-postgres.sh)");
    localcluster::postgres::fresh_database(&admin).await.expect("create database")
}

/// Fault tests measure recovery against the TTL: run them one at a time so two clusters
/// do not compete for the two cores.
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// The checkpointed history of a session, read straight from the database.
pub async fn history(database_url: &str, key: &str) -> Vec<String> {
    let mut conn = PgConnection::connect(database_url).await.expect("connect");
    let data: Option<Vec<u8>> = sqlx::query_scalar("SELECT data FROM agent_checkpoints WHERE agent_key = $1")
        .bind(key)
        .fetch_optional(&mut conn)
        .await
        .expect("read checkpoint");
    let Some(data) = data else { return Vec::new() };
    let state: serde_json::Value = serde_json::from_slice(&data).expect("checkpoint is JSON");
    state["history"].as_array().expect("history").iter().map(|v| v.as_str().unwrap().to_owned()).collect()
}

/// The current epoch of a session's lease row.
pub async fn epoch(database_url: &str, key: &str) -> Option<i64> {
    let mut conn = PgConnection::connect(database_url).await.expect("connect");
    sqlx::query_scalar("SELECT epoch FROM agent_leases WHERE agent_key = $1")
        .bind(key)
        .fetch_optional(&mut conn)
        .await
        .expect("read lease")
}

/// Wait until the Postgres behind `database_url` has been up longer than `ttl`: until
/// then it judges no boot dead by its closed connection (a restart closed them all).
pub async fn postgres_up_for(database_url: &str, ttl: std::time::Duration) {
    let mut conn = PgConnection::connect(database_url).await.expect("connect");
    let up: f64 = sqlx::query_scalar("SELECT extract(epoch FROM now() - pg_postmaster_start_time())::float8")
        .fetch_one(&mut conn)
        .await
        .expect("read the postmaster's start");
    let wait = ttl.as_secs_f64() - up + 0.1;
    if wait > 0.0 {
        tokio::time::sleep(std::time::Duration::from_secs_f64(wait)).await;
    }
}

/// How long a test waits for a condition it synchronises on (an event, a metric, a
/// history row, readiness) before failing: generous, as other tests' clusters share the
/// two cores.
pub const CONDITION_WITHIN: std::time::Duration = std::time::Duration::from_secs(20);

/// Wait until `check` holds, polling; fails the test with `what` after [`CONDITION_WITHIN`].
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + CONDITION_WITHIN;
    while !check().await {
        assert!(std::time::Instant::now() < deadline, "not within {CONDITION_WITHIN:?}: {what}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The agent whose only database write of a turn is its checkpoint (`hold_agent.py`).
pub fn hold_agent() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/hold_agent.py")
}

/// The hold agent, keeping a record of what each pod's agent was sent in `dir` (read it
/// with [`agent_record`]): for `ClusterOptions::agent_command`.
pub fn recording_hold_agent(dir: &std::path::Path) -> Option<(std::path::PathBuf, Vec<(String, String)>)> {
    let env = vec![("HOLD_AGENT_RECORD_DIR".to_owned(), dir.display().to_string())];
    Some((hold_agent(), env))
}

/// What the recording hold agent of `node` has recorded so far, in order.
pub fn agent_record(dir: &std::path::Path, node: &localcluster::Node) -> Vec<serde_json::Value> {
    let path = dir.join(format!("{}.jsonl", node.ip));
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines().map(|line| serde_json::from_str(line).expect("a record line is JSON")).collect()
}

/// The requests `node`'s recording agent received on `path` (e.g. `/sessions/k/turns`).
pub fn received(dir: &std::path::Path, node: &localcluster::Node, path: &str) -> Vec<serde_json::Value> {
    agent_record(dir, node).into_iter().filter(|r| r["got"] == path).collect()
}

/// Ids as (epoch, seq), asserting they strictly increase.
pub fn strictly_increasing(ids: &[String]) -> Vec<(i64, u64)> {
    let parsed: Vec<(i64, u64)> = ids
        .iter()
        .map(|id| {
            let (e, s) = id.split_once('-').unwrap();
            (e.parse().unwrap(), s.parse().unwrap())
        })
        .collect();
    assert!(parsed.windows(2).all(|w| w[0] < w[1]), "ids must strictly increase: {ids:?}");
    parsed
}

/// Revoke `node_id`'s node lease as the operator does for a failed pod, through the very
/// call it makes (`LeaseStore::revoke_node`): its sessions are claimable at once. Returns
/// how many sessions became claimable.
pub async fn revoke_node(database_url: &str, node_id: &str) -> u64 {
    let store = leasehold_core::store::LeaseStore::connect(database_url, 1).await.expect("connect the store");
    let revoked = store.revoke_node(node_id).await.expect("revoke the node");
    store.pool().close().await;
    revoked
}
