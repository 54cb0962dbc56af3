//! Node leases: renew_all in one statement, hand-back, revocation of dead boots.

mod support;

use std::{collections::BTreeSet, time::Duration};

use leasehold_core::{store::Claim, Epoch, Owner};
use support::{boot, key, store, LONG_TTL};

#[tokio::test]
async fn renew_all_keeps_100k_leases_live_with_one_single_row_statement() {
    const N: i64 = 100_000;
    let store = store().await;
    let ttl = Duration::from_secs(2);
    let a = boot(&store, "node-a", LONG_TTL).await;
    // Setup only: attach 100k sessions to a's boot in bulk.
    sqlx::query(
        "INSERT INTO agent_leases (agent_key, owner, epoch, acquired_at, updated_at) \
         SELECT 'k' || i, $1, 1, now(), now() FROM generate_series(1, $2) i",
    )
    .bind(a.as_str())
    .bind(N)
    .execute(store.pool())
    .await
    .unwrap();
    for i in 1..=100 {
        assert!(store.release(&key(&format!("k{i}")), &a, Epoch(1)).await.unwrap());
    }

    // From now on a short TTL; renew past several of them: every session stays live.
    store.renew_all(&a, ttl).await.unwrap().expect("live");
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let lease = store.renew_all(&a, ttl).await.unwrap().expect("still live");
        assert!(lease.remaining > Duration::from_millis(1900), "{lease:?}");
    }
    // Back to a long TTL before reading 100k rows, which a loaded machine may take longer
    // than the short one over.
    store.renew_all(&a, LONG_TTL).await.unwrap().expect("still live");
    let held: BTreeSet<String> =
        store.held(&a).await.unwrap().into_iter().map(|(k, _)| k.to_string()).collect();
    let expected: BTreeSet<String> = (101..=N).map(|i| format!("k{i}")).collect();
    assert_eq!(held.len(), expected.len());
    assert_eq!(held, expected, "exactly the unreleased sessions are held");
    let b = boot(&store, "node-b", LONG_TTL).await;
    assert!(matches!(store.claim(&key("k5000"), &b).await.unwrap(), Claim::Held(_)));
    assert!(matches!(store.claim(&key("k50"), &b).await.unwrap(), Claim::TookOver { .. }), "released");

    // The renewal the heartbeat sends is one statement updating one row, by index, and
    // reading no session row, whatever the number of sessions.
    let explain = format!("EXPLAIN (ANALYZE, FORMAT JSON) {}", leasehold_core::store::nodes::RENEW_SQL);
    let plan: (serde_json::Value,) = sqlx::query_as(&explain)
        .bind(a.as_str())
        .bind(2000_i64)
        .bind(false)
        .fetch_one(store.pool())
        .await
        .unwrap();
    let text = plan.0.to_string();
    assert!(!text.contains("agent_leases"), "renewal must not touch session rows: {text}");
    let update = &plan.0[0]["Plan"];
    assert_eq!(update["Operation"], "Update", "{text}");
    let scan = &update["Plans"][0];
    assert_eq!(
        (scan["Relation Name"].as_str(), scan["Actual Rows"].as_f64()),
        (Some("agent_nodes"), Some(1.0)),
        "{text}"
    );
    assert!(scan["Node Type"].as_str().unwrap().contains("Index"), "found by its key, not a scan: {text}");
}

#[tokio::test]
async fn an_expired_node_lease_is_never_renewed() {
    let store = store().await;
    let ttl = Duration::from_millis(200);
    let a = boot(&store, "node-a", ttl).await;
    store.claim(&key("s1"), &a).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.renew_all(&a, LONG_TTL).await.unwrap(), None, "expired: lost, not resurrected");
    assert!(store.lookup(&key("s1")).await.unwrap().claimable());
    let b = boot(&store, "node-b", LONG_TTL).await;
    assert_eq!(store.claim(&key("s1"), &b).await.unwrap(), Claim::TookOver { epoch: Epoch(2) });
}

#[tokio::test]
async fn a_restart_revokes_the_earlier_boot_at_once() {
    let store = store().await;
    let old = boot(&store, "pod-x", LONG_TTL).await;
    for k in ["s1", "s2"] {
        store.claim(&key(k), &old).await.unwrap();
    }
    // The container restarts: a new boot of the same node id registers.
    let new = Owner::new_boot("pod-x");
    assert_ne!(new, old);
    assert_eq!(store.register_boot(&new, "127.0.0.1:1", LONG_TTL).await.unwrap(), 1);
    for k in ["s1", "s2"] {
        assert!(store.lookup(&key(k)).await.unwrap().claimable(), "{k} claimable without waiting for TTL");
    }
    assert_eq!(store.renew_all(&old, LONG_TTL).await.unwrap(), None);
    assert_eq!(store.claim(&key("s1"), &new).await.unwrap(), Claim::TookOver { epoch: Epoch(2) });
}

#[tokio::test]
async fn revoke_node_expires_every_boot_of_a_dead_pod_only() {
    let store = store().await;
    let dead = boot(&store, "pod-dead", LONG_TTL).await;
    let alive = boot(&store, "pod-alive", LONG_TTL).await;
    store.claim(&key("d1"), &dead).await.unwrap();
    store.claim(&key("d2"), &dead).await.unwrap();
    store.claim(&key("a1"), &alive).await.unwrap();
    assert_eq!(store.revoke_node("pod-dead").await.unwrap(), 2);
    assert_eq!(store.revoke_node("pod-dead").await.unwrap(), 0, "idempotent");
    assert!(store.lookup(&key("d1")).await.unwrap().claimable());
    assert!(store.lookup(&key("d2")).await.unwrap().claimable());
    assert_eq!(store.lookup(&key("a1")).await.unwrap().holder.unwrap().owner, alive);
    assert!(store.renew_all(&alive, LONG_TTL).await.unwrap().is_some());
}

#[tokio::test]
async fn hand_back_counts_only_held_sessions_and_is_idempotent() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    for k in ["s1", "s2", "s3"] {
        store.claim(&key(k), &a).await.unwrap();
    }
    store.release(&key("s3"), &a, Epoch(1)).await.unwrap();
    assert_eq!(store.hand_back_all(&a).await.unwrap(), 2);
    assert_eq!(store.hand_back_all(&a).await.unwrap(), 0);
}

#[tokio::test]
async fn live_leases_are_counted_per_node() {
    let store = store().await;
    let a = boot(&store, "pod-a", LONG_TTL).await;
    let b = boot(&store, "pod-b", LONG_TTL).await;
    for k in ["a1", "a2", "a3"] {
        store.claim(&key(k), &a).await.unwrap();
    }
    store.claim(&key("b1"), &b).await.unwrap();
    store.release(&key("a3"), &a, Epoch(1)).await.unwrap();
    let nodes = ["pod-a".to_owned(), "pod-b".to_owned(), "pod-c".to_owned()];
    let counts = store.live_leases_by_node(&nodes).await.unwrap();
    assert_eq!(counts.get("pod-a"), Some(&2));
    assert_eq!(counts.get("pod-b"), Some(&1));
    assert_eq!(counts.get("pod-c"), None);
    store.revoke_node("pod-b").await.unwrap();
    assert_eq!(store.live_leases_by_node(&nodes).await.unwrap().get("pod-b"), None);
}

/// A renewal whose statement began before a revocation it then waits behind (or, as
/// here, runs after, in a transaction that began before it) must not extend the revoked
/// lease: its liveness check is on the clock when it touches the row, not when it began.
#[tokio::test]
async fn a_renewal_never_resurrects_a_lease_revoked_after_it_began() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    let mut renewal = store.pool().begin().await.unwrap();
    sqlx::query("SELECT now()").execute(&mut *renewal).await.unwrap(); // the transaction's clock starts
    tokio::time::sleep(Duration::from_millis(50)).await;
    store.revoke_node("node-a").await.unwrap();
    let renewed = sqlx::query(leasehold_core::store::nodes::RENEW_SQL)
        .bind(a.as_str())
        .bind(60_000_i64)
        .bind(false)
        .fetch_optional(&mut *renewal)
        .await
        .unwrap();
    renewal.commit().await.unwrap();
    assert!(renewed.is_none(), "a revoked node lease was renewed");
    assert_eq!(store.renew_all(&a, LONG_TTL).await.unwrap(), None, "and stays lost");
}
