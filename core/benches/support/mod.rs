//! What the store benches share: a fresh schema on the throwaway Postgres of
//! `scripts/with-postgres.sh`, latency statistics, and background lease rows made in one
//! statement.

use std::time::Duration;

use leasehold_core::{store::LeaseStore, Owner};
use sqlx::{postgres::PgPoolOptions, PgPool};

pub struct Stats {
    pub p50: Duration,
    pub p99: Duration,
    pub per_sec: f64,
}

pub fn stats(mut samples: Vec<Duration>, wall: Duration) -> Stats {
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    Stats { p50: at(0.50), p99: at(0.99), per_sec: samples.len() as f64 / wall.as_secs_f64() }
}

pub fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

/// A pool of `connections` on `DATABASE_URL`, the schema migrated and every table empty.
pub async fn fresh_pool(connections: u32) -> PgPool {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL: run with `make bench`");
    let pool = PgPoolOptions::new().max_connections(connections).connect(&url).await.unwrap();
    LeaseStore::from_pool(pool.clone()).migrate().await.unwrap();
    sqlx::query("TRUNCATE agent_leases, agent_nodes, agent_checkpoints, agent_turns, agent_turn_events")
        .execute(&pool)
        .await
        .unwrap();
    pool
}

/// Lease rows `<prefix><i>` for i in `from..=to`, held by `owner`, in one statement; then
/// VACUUM ANALYZE so the planner and the visibility map see them.
pub async fn insert_leases(pool: &PgPool, owner: &Owner, prefix: &str, from: i64, to: i64) {
    sqlx::query(
        "INSERT INTO agent_leases (agent_key, owner, epoch, acquired_at, updated_at) \
         SELECT $2 || i, $1, 1, now(), now() FROM generate_series($3::bigint, $4::bigint) i",
    )
    .bind(owner.as_str())
    .bind(prefix)
    .bind(from)
    .bind(to)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("VACUUM ANALYZE agent_leases").execute(pool).await.unwrap();
}
