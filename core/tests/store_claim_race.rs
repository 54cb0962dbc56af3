//! A claim must never take over a live lease from a boot whose node row is newer than the
//! claim statement's snapshot (CONTRACT §7: an invisible node row is not an expired one).
//! The race: C's claim takes its snapshot; boot B registers and claims S; C blocks on B's
//! row lock; B commits; C re-checks B's lease row but cannot see B's node row.

mod support;

use std::time::Duration;

use leasehold_core::{
    store::{leases::claim_once, nodes, Claim, LeaseStore},
    Owner,
};
use support::{backend_pid, boot, key, store, wait_for_lock_wait, LONG_TTL};

#[tokio::test]
async fn a_claim_never_takes_over_from_a_boot_that_registered_during_it() {
    let store = store().await;
    let c = boot(&store, "node-c", LONG_TTL).await;
    let b = Owner::new_boot("node-b");
    let s = key("raced");

    // B registers and claims S in one open transaction.
    let mut b_tx = store.pool().begin().await.unwrap();
    nodes::register(&mut *b_tx, &b, "127.0.0.1:7001", LONG_TTL, false).await.unwrap();
    let b_claim = claim_once(&mut *b_tx, &s, &b).await.unwrap();
    assert!(matches!(b_claim, Some(Claim::Claimed { .. })), "{b_claim:?}");

    // C's claim takes its snapshot now and blocks on B's uncommitted lease row.
    let mut c_conn = store.pool().acquire().await.unwrap();
    let c_pid = backend_pid(&mut c_conn).await;
    let c_claim = tokio::spawn({
        let (s, c) = (s.clone(), c.clone());
        async move { claim_once(&mut *c_conn, &s, &c).await }
    });
    wait_for_lock_wait(&store, c_pid).await;
    b_tx.commit().await.unwrap();

    // C may answer "held by B" or the empty answer (re-run), never "you own it".
    match c_claim.await.unwrap().unwrap() {
        None => {}
        Some(Claim::Held(holder)) => assert_eq!(holder.owner, b),
        Some(other) => panic!("C was told it owns a live lease of B: {other:?}"),
    }
    // Re-run as the store does: B holds it.
    match store.claim(&s, &c).await.unwrap() {
        Claim::Held(holder) => assert_eq!(holder.owner, b),
        other => panic!("B's live lease was taken: {other:?}"),
    }
}

/// The takeover condition still takes over a lease whose owner's node row is visible and
/// expired (the same statement, the other side of the fix).
#[tokio::test]
async fn a_claim_takes_over_a_lease_whose_owner_is_visibly_expired() {
    let store: LeaseStore = store().await;
    let b = boot(&store, "node-b", Duration::from_millis(200)).await;
    let c = boot(&store, "node-c", LONG_TTL).await;
    let s = key("expired");
    assert!(matches!(store.claim(&s, &b).await.unwrap(), Claim::Claimed { .. }));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(matches!(store.claim(&s, &c).await.unwrap(), Claim::TookOver { epoch } if epoch.0 == 2));
}

/// A checker inside the database: every change of a lease's epoch is recorded with
/// whether its previous owner's node lease was live at that moment, read with a fresh
/// snapshot (a trigger's statements see what is committed, not the claim's snapshot).
const AUDIT_SQL: &str = r#"
CREATE TABLE takeover_audit (
    agent_key text, old_owner text, new_owner text, old_epoch bigint, new_epoch bigint,
    old_released boolean, old_owner_live boolean
);
CREATE FUNCTION audit_takeover() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.epoch <> OLD.epoch THEN
        INSERT INTO takeover_audit VALUES (
            NEW.agent_key, OLD.owner, NEW.owner, OLD.epoch, NEW.epoch, OLD.released,
            EXISTS (SELECT 1 FROM agent_nodes n WHERE n.owner = OLD.owner AND n.expires_at > now()));
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER audit_takeover AFTER UPDATE ON agent_leases FOR EACH ROW EXECUTE FUNCTION audit_takeover();
"#;

/// Claims made per worker in the stress run.
const STRESS_CLAIMS_PER_WORKER: usize = 250;
const STRESS_WORKERS: usize = 16;
const STRESS_KEYS: [&str; 3] = ["hot-0", "hot-1", "hot-2"];

/// What one worker was told: (key, epoch, owner) for every claim that made it owner.
async fn stress_worker(store: LeaseStore, i: usize) -> Vec<(String, i64, Owner)> {
    use rand::Rng;
    let node = format!("stress-{i}");
    let mut owner = boot(&store, &node, Duration::from_millis(150)).await;
    let mut told = Vec::new();
    for n in 0..STRESS_CLAIMS_PER_WORKER {
        let (k, restart, ttl_ms, pause_ms) = {
            let mut rng = rand::rng();
            (
                STRESS_KEYS[rng.random_range(0..STRESS_KEYS.len())],
                rng.random_bool(0.2),
                rng.random_range(30..200),
                rng.random_range(0..4),
            )
        };
        let s = key(k);
        let claim = if restart {
            // A new boot registers and claims in one transaction: the pattern of the race.
            owner = Owner::new_boot(&node);
            let mut tx = store.pool().begin().await.unwrap();
            nodes::register(&mut *tx, &owner, "127.0.0.1:7000", Duration::from_millis(ttl_ms), false)
                .await
                .unwrap();
            let claim = claim_once(&mut *tx, &s, &owner).await;
            tx.commit().await.unwrap();
            match claim {
                Ok(Some(claim)) => claim,
                Ok(None) => continue, // the empty answer: the next iteration claims again
                Err(e) => panic!("worker {i} claim {n}: {e}"),
            }
        } else {
            match store.claim(&s, &owner).await {
                Ok(claim) => claim,
                Err(leasehold_core::store::Error::NodeNotLive { .. }) => {
                    owner = boot(&store, &node, Duration::from_millis(ttl_ms)).await;
                    continue;
                }
                Err(e) => panic!("worker {i} claim {n}: {e}"),
            }
        };
        if let Some(epoch) = claim.owned_epoch() {
            told.push((k.to_owned(), epoch.0, owner.clone()));
        }
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
    }
    told
}

/// Many concurrent claimers of a few keys while boots register (with a claim in the same
/// transaction) and expire: no claim ever takes over a lease whose owner was live, and no
/// two callers are told they own one key at one epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claimers_and_registering_boots_never_take_a_live_lease() {
    let store = support::store_with_pool(24).await;
    sqlx::raw_sql(AUDIT_SQL).execute(store.pool()).await.unwrap();
    let workers: Vec<_> =
        (0..STRESS_WORKERS).map(|i| tokio::spawn(stress_worker(store.clone(), i))).collect();
    let mut owner_of = std::collections::HashMap::<(String, i64), Owner>::new();
    let mut owned = 0;
    for worker in workers {
        for (k, epoch, owner) in worker.await.unwrap() {
            owned += 1;
            if let Some(earlier) = owner_of.insert((k.clone(), epoch), owner.clone()) {
                assert_eq!(earlier, owner, "{k} at epoch {epoch} was told to two owners");
            }
        }
    }
    let (takeovers, of_live): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE old_owner_live AND NOT old_released) FROM takeover_audit",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    eprintln!("stress: {owned} owning claims, {takeovers} epoch changes, {of_live} of a live lease");
    assert!(takeovers >= 100, "too few takeovers to prove anything: {takeovers}");
    assert_eq!(of_live, 0, "claims took over live leases");
}
