//! Shared test support: a database of its own per test on the throwaway Postgres that
//! `scripts/with-postgres.sh` starts (`make test`), so tests run in parallel.
#![allow(dead_code)]

pub mod tls_postgres;

use std::time::Duration;

use leasehold_core::{store::LeaseStore, Owner, SessionKey};
use sqlx::{postgres::PgPoolOptions, Connection, PgConnection};

pub fn admin_url() -> String {
    std::env::var("DATABASE_URL").expect(
        "DATABASE_URL is not set: run the tests with `make test` (scripts/with-postgres.sh starts Postgres)",
    )
}

/// Replace the database name in a postgres URL.
pub fn url_for(db: &str) -> String {
    let admin = admin_url();
    let (base, query) = admin.split_once('?').map_or((admin.as_str(), ""), |(b, q)| (b, q));
    let (server, _) = base.rsplit_once('/').expect("DATABASE_URL has a database path");
    if query.is_empty() {
        format!("{server}/{db}")
    } else {
        format!("{server}/{db}?{query}")
    }
}

/// A fresh, empty database (not migrated). Returns its URL.
pub async fn create_database() -> String {
    let name = format!("lh_{}", uuid::Uuid::new_v4().simple());
    let mut admin = PgConnection::connect(&admin_url()).await.expect("connect to the test Postgres");
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut admin).await.expect("create database");
    url_for(&name)
}

/// A migrated database of its own and a store on it with `pool_size` connections.
pub async fn store_with_pool(pool_size: u32) -> LeaseStore {
    let url = create_database().await;
    let pool = PgPoolOptions::new().max_connections(pool_size).connect(&url).await.expect("connect");
    let store = LeaseStore::from_pool(pool);
    store.migrate().await.expect("migrate");
    store
}

pub async fn store() -> LeaseStore {
    store_with_pool(8).await
}

pub fn key(s: &str) -> SessionKey {
    SessionKey::parse(s).expect("valid test key")
}

pub const LONG_TTL: Duration = Duration::from_secs(60);

/// Register a new live boot of `node`.
pub async fn boot(store: &LeaseStore, node: &str, ttl: Duration) -> Owner {
    let owner = Owner::new_boot(node);
    store.register_boot(&owner, &format!("127.0.0.1:{}", 7000 + node.len()), ttl).await.expect("register");
    owner
}

/// How long a test waits for a statement to block on a lock before failing.
const LOCK_WAIT_WITHIN: Duration = Duration::from_secs(10);

/// The server process of `conn`, to watch that very connection in `pg_stat_activity`.
pub async fn backend_pid(conn: &mut PgConnection) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(conn).await.expect("read pg_backend_pid()")
}

/// Wait until the backend `pid` (a connection whose [`backend_pid`] was read before it
/// issued its statement) is waiting on a lock: the statement has started and is blocked,
/// rather than not yet sent. Fails after [`LOCK_WAIT_WITHIN`].
pub async fn wait_for_lock_wait(store: &LeaseStore, pid: i32) {
    let deadline = tokio::time::Instant::now() + LOCK_WAIT_WITHIN;
    loop {
        let waiting: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock')",
        )
        .bind(pid)
        .fetch_one(store.pool())
        .await
        .expect("read pg_stat_activity");
        if waiting {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "backend {pid} never waited for a lock");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
