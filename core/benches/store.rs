//! Lease store benchmark, every figure beside its baseline from the same run:
//! - claim through `LeaseStore::claim` vs the same SQL statement driven raw with sqlx;
//! - renewing N sessions: the node-lease `renew_all` (one single-row statement) vs one
//!   statement per session vs one bulk statement over all session rows.
//!
//! Run: `make bench` (starts a throwaway Postgres and sets DATABASE_URL).

use std::time::{Duration, Instant};

use leasehold_core::{
    store::{leases::CLAIM_SQL, LeaseStore},
    Owner, SessionKey,
};
use sqlx::{Connection, PgConnection, PgPool};

mod support;
use support::{fresh_pool, insert_leases, ms, stats, Stats};

const CONCURRENCY: usize = 8;
const CLAIMS_PER_TASK: usize = 1_500;
const ROUNDS: usize = 3;

/// Each task claims its own keys in a cycle of 50: the first pass inserts (case 1), the
/// rest extend (case 2), the mix a busy sidecar sees for sessions it owns.
async fn run_claims(pool: &PgPool, store: &LeaseStore, owners: &[Owner], raw: bool, round: usize) -> Stats {
    let started = Instant::now();
    let tasks: Vec<_> = owners
        .iter()
        .cloned()
        .enumerate()
        .map(|(t, owner)| {
            let (pool, store) = (pool.clone(), store.clone());
            tokio::spawn(async move {
                let mut samples = Vec::with_capacity(CLAIMS_PER_TASK);
                for i in 0..CLAIMS_PER_TASK {
                    let key = SessionKey::parse(&format!("r{round}-{raw}-t{t}-k{}", i % 50)).unwrap();
                    let t0 = Instant::now();
                    if raw {
                        sqlx::query(CLAIM_SQL)
                            .bind(key.as_str())
                            .bind(owner.as_str())
                            .fetch_one(&pool)
                            .await
                            .unwrap();
                    } else {
                        store.claim(&key, &owner).await.unwrap();
                    }
                    samples.push(t0.elapsed());
                }
                samples
            })
        })
        .collect();
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    stats(all, started.elapsed())
}

async fn bench_claims(pool: &PgPool) {
    let store = LeaseStore::from_pool(pool.clone());
    let mut owners = Vec::new();
    for t in 0..CONCURRENCY {
        let owner = Owner::new_boot(&format!("bench-{t}"));
        store.register_boot(&owner, "127.0.0.1:1", Duration::from_secs(3600)).await.unwrap();
        owners.push(owner);
    }
    println!("## claim: store vs raw statement ({CONCURRENCY} tasks x {CLAIMS_PER_TASK} claims, {ROUNDS} rounds alternating)\n");
    println!("| round | path | p50 ms | p99 ms | claims/s |");
    println!("|---|---|---|---|---|");
    let (mut store_rate, mut raw_rate, mut store_p50, mut raw_p50) = (0.0, 0.0, 0.0, 0.0);
    for round in 0..ROUNDS {
        for raw in [true, false] {
            let s = run_claims(pool, &store, &owners, raw, round).await;
            let path = if raw { "raw sqlx, same SQL" } else { "LeaseStore::claim" };
            println!("| {round} | {path} | {} | {} | {:.0} |", ms(s.p50), ms(s.p99), s.per_sec);
            if raw {
                raw_rate += s.per_sec;
                raw_p50 += s.p50.as_secs_f64();
            } else {
                store_rate += s.per_sec;
                store_p50 += s.p50.as_secs_f64();
            }
        }
    }
    println!(
        "\nratio store/raw: p50 latency {:.3}; throughput raw/store {:.3} (target: both <= 1.15)\n",
        store_p50 / raw_p50,
        raw_rate / store_rate
    );
}

async fn bench_renew(pool: &PgPool) {
    let store = LeaseStore::from_pool(pool.clone());
    let ttl = Duration::from_secs(3600);
    let mut conn = PgConnection::connect_with(&pool.connect_options()).await.unwrap();
    println!("## renewing N sessions\n");
    println!("| sessions | renew_all (node row) ms | one statement per session ms | bulk UPDATE of session rows ms | per-session / renew_all | bulk / renew_all |");
    println!("|---|---|---|---|---|---|");
    for n in [1_000i64, 10_000, 100_000] {
        let owner = Owner::new_boot(&format!("renew-{n}"));
        store.register_boot(&owner, "127.0.0.1:1", ttl).await.unwrap();
        insert_leases(pool, &owner, &format!("n{n}-"), 1, n).await;

        // ours: best of 20 single-row renewals
        let mut best = Duration::MAX;
        for _ in 0..20 {
            let t0 = Instant::now();
            store.renew_all(&owner, ttl).await.unwrap().unwrap();
            best = best.min(t0.elapsed());
        }
        // baseline 1: a lease row per session renewed one statement each (per-key TTLs)
        let t0 = Instant::now();
        for i in 1..=n {
            sqlx::query("UPDATE agent_leases SET updated_at = now() WHERE agent_key = $1 AND owner = $2")
                .bind(format!("n{n}-{i}"))
                .bind(owner.as_str())
                .execute(&mut conn)
                .await
                .unwrap();
        }
        let per_row = t0.elapsed();
        // baseline 2: one bulk statement touching every session row
        let t0 = Instant::now();
        sqlx::query("UPDATE agent_leases SET updated_at = now() WHERE owner = $1 AND NOT released")
            .bind(owner.as_str())
            .execute(&mut conn)
            .await
            .unwrap();
        let bulk = t0.elapsed();
        println!(
            "| {n} | {} | {} | {} | {:.0}x | {:.0}x |",
            ms(best),
            ms(per_row),
            ms(bulk),
            per_row.as_secs_f64() / best.as_secs_f64(),
            bulk.as_secs_f64() / best.as_secs_f64()
        );
    }
    println!();
}

#[tokio::main]
async fn main() {
    let pool = fresh_pool(CONCURRENCY as u32 + 2).await;
    bench_claims(&pool).await;
    bench_renew(&pool).await;
}
