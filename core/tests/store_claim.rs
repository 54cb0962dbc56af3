//! The four claim cases of CONTRACT §7 and their epoch rules, on a real Postgres.

mod support;

use std::time::Duration;

use leasehold_core::{
    store::{Claim, Error},
    Epoch,
};
use support::{boot, key, store, LONG_TTL};

#[tokio::test]
async fn case1_no_row_claims_epoch_one() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    assert_eq!(store.claim(&key("s1"), &a).await.unwrap(), Claim::Claimed { epoch: Epoch(1) });
    let info = store.lookup(&key("s1")).await.unwrap();
    assert_eq!(info.holder.unwrap().owner, a);
    assert_eq!(info.epoch, Some(Epoch(1)));
}

#[tokio::test]
async fn case2_own_live_row_keeps_the_epoch() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    store.claim(&key("s1"), &a).await.unwrap();
    for _ in 0..3 {
        assert_eq!(store.claim(&key("s1"), &a).await.unwrap(), Claim::Extended { epoch: Epoch(1) });
    }
}

#[tokio::test]
async fn case3_expired_row_of_another_is_taken_over_with_epoch_plus_one() {
    let store = store().await;
    let a = boot(&store, "node-a", Duration::from_millis(300)).await;
    let b = boot(&store, "node-b", LONG_TTL).await;
    store.claim(&key("s1"), &a).await.unwrap();
    assert!(matches!(store.claim(&key("s1"), &b).await.unwrap(), Claim::Held(_)));
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(store.claim(&key("s1"), &b).await.unwrap(), Claim::TookOver { epoch: Epoch(2) });
    assert_eq!(store.lookup(&key("s1")).await.unwrap().holder.unwrap().owner, b);
}

#[tokio::test]
async fn case3_own_expired_row_is_a_new_epoch_too() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    store.claim(&key("s1"), &a).await.unwrap();
    // Our own node lease is gone (revoked): the row is not live; a new boot of the same
    // node must take it over with the next epoch, never silently continue epoch 1.
    store.revoke_node("node-a").await.unwrap();
    assert!(matches!(store.claim(&key("s1"), &a).await, Err(Error::NodeNotLive { .. })));
    let a2 = boot(&store, "node-a", LONG_TTL).await;
    assert_eq!(store.claim(&key("s1"), &a2).await.unwrap(), Claim::TookOver { epoch: Epoch(2) });
}

#[tokio::test]
async fn case3_handed_back_row_is_claimable_at_once() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    let b = boot(&store, "node-b", LONG_TTL).await;
    for k in ["s1", "s2", "s3"] {
        store.claim(&key(k), &a).await.unwrap();
    }
    assert_eq!(store.hand_back_all(&a).await.unwrap(), 3);
    for k in ["s1", "s2", "s3"] {
        assert!(store.lookup(&key(k)).await.unwrap().claimable(), "{k} claimable right after hand-back");
        assert_eq!(store.claim(&key(k), &b).await.unwrap(), Claim::TookOver { epoch: Epoch(2) });
    }
    // The handed-back boot may not claim any more: it is shutting down.
    assert!(matches!(store.claim(&key("s4"), &a).await, Err(Error::NodeNotLive { .. })));
}

#[tokio::test]
async fn case3_released_row_is_claimable_at_once_by_anyone() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    let b = boot(&store, "node-b", LONG_TTL).await;
    store.claim(&key("s1"), &a).await.unwrap();
    assert!(!store.release(&key("s1"), &a, Epoch(7)).await.unwrap(), "wrong epoch changes nothing");
    assert!(!store.release(&key("s1"), &b, Epoch(1)).await.unwrap(), "not the owner changes nothing");
    assert!(store.release(&key("s1"), &a, Epoch(1)).await.unwrap());
    assert!(store.lookup(&key("s1")).await.unwrap().claimable());
    assert!(store.release(&key("s1"), &a, Epoch(1)).await.unwrap(), "a repeated release is done again");
    assert!(!store.release(&key("s1"), &b, Epoch(1)).await.unwrap(), "but never someone else's");
    // own released row: +1 as well
    assert_eq!(store.claim(&key("s1"), &a).await.unwrap(), Claim::TookOver { epoch: Epoch(2) });
    assert!(store.release(&key("s1"), &a, Epoch(2)).await.unwrap());
    assert_eq!(store.claim(&key("s1"), &b).await.unwrap(), Claim::TookOver { epoch: Epoch(3) });
    assert!(!store.release(&key("s1"), &a, Epoch(2)).await.unwrap(), "claimed since: not ours to release");
    assert!(!store.lookup(&key("s1")).await.unwrap().claimable(), "b's lease stands");
}

#[tokio::test]
async fn case4_another_live_owner_is_reported_and_nothing_changes() {
    let store = store().await;
    let a = boot(&store, "node-a", Duration::from_secs(30)).await;
    let b = boot(&store, "node-b", LONG_TTL).await;
    store.claim(&key("s1"), &a).await.unwrap();
    let Claim::Held(holder) = store.claim(&key("s1"), &b).await.unwrap() else {
        panic!("b must not get a live lease of a");
    };
    assert_eq!(holder.owner, a);
    assert_eq!(holder.epoch, Epoch(1));
    assert_eq!(holder.peer_addr, "127.0.0.1:7006");
    assert!(holder.remaining > Duration::from_secs(25) && holder.remaining <= Duration::from_secs(30));
    // still a's, still epoch 1
    assert_eq!(store.claim(&key("s1"), &a).await.unwrap(), Claim::Extended { epoch: Epoch(1) });
}

#[tokio::test]
async fn a_claimer_without_a_live_node_lease_writes_nothing() {
    let store = store().await;
    let a = boot(&store, "node-a", Duration::from_millis(100)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(matches!(store.claim(&key("s1"), &a).await, Err(Error::NodeNotLive { .. })));
    let info = store.lookup(&key("s1")).await.unwrap();
    assert_eq!((info.holder, info.epoch), (None, None));
}

#[tokio::test]
async fn lookup_never_claims() {
    let store = store().await;
    let info = store.lookup(&key("nobody")).await.unwrap();
    assert!(info.claimable());
    assert_eq!(info.epoch, None);
    let a = boot(&store, "node-a", LONG_TTL).await;
    assert_eq!(store.claim(&key("nobody"), &a).await.unwrap(), Claim::Claimed { epoch: Epoch(1) });
}

#[tokio::test]
async fn the_schema_rejects_invalid_keys_even_past_the_type() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    let err = sqlx::query("INSERT INTO agent_leases VALUES ('bad key', $1, 1, false, now(), now())")
        .bind(a.as_str())
        .execute(store.pool())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("agent_leases_key_format"), "{err}");
}
