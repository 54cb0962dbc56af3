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
