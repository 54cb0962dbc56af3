//! The lease-checked fence on checkpoints (CONTRACT §7).

mod support;

use std::time::Duration;

use leasehold_core::{
    store::{checkpoints::put_checkpoint, leases::claim_once, Claim, Error},
    Epoch,
};
use support::{backend_pid, boot, key, store, wait_for_lock_wait, LONG_TTL};

fn fenced<T: std::fmt::Debug>(r: Result<T, Error>) -> bool {
    matches!(r, Err(Error::Fenced { .. }))
}

#[tokio::test]
async fn the_owner_writes_and_reads_back() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    let s = key("s1");
    assert_eq!(store.get_checkpoint(&s).await.unwrap(), None);
    store.claim(&s, &a).await.unwrap();
    store.put_checkpoint(&s, &a, Epoch(1), b"one").await.unwrap();
    store.put_checkpoint(&s, &a, Epoch(1), b"two").await.unwrap();
    let cp = store.get_checkpoint(&s).await.unwrap().unwrap();
    assert_eq!((cp.epoch, cp.data.as_slice()), (Epoch(1), &b"two"[..]));
    store.check_fence(&s, &a, Epoch(1)).await.unwrap();
}

#[tokio::test]
async fn a_zombie_write_between_takeover_and_first_checkpoint_is_fenced() {
    let store = store().await;
    let a = boot(&store, "node-a", Duration::from_millis(300)).await;
    let b = boot(&store, "node-b", LONG_TTL).await;
    let s = key("s1");
    store.claim(&s, &a).await.unwrap();
    store.put_checkpoint(&s, &a, Epoch(1), b"a1").await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await; // a paused past its TTL
    assert_eq!(store.claim(&s, &b).await.unwrap(), Claim::TookOver { epoch: Epoch(2) });
    // b has not checkpointed yet: the stored checkpoint is still epoch 1, so a
    // checkpoint-only fence would accept a's write. The lease check rejects it.
    assert!(fenced(store.put_checkpoint(&s, &a, Epoch(1), b"zombie").await));
    assert!(fenced(store.check_fence(&s, &a, Epoch(1)).await));
    let cp = store.get_checkpoint(&s).await.unwrap().unwrap();
    assert_eq!((cp.epoch, cp.data.as_slice()), (Epoch(1), &b"a1"[..]), "nothing landed");
    // the new owner thaws a's last good state and writes on
    store.put_checkpoint(&s, &b, Epoch(2), b"a1+b2").await.unwrap();
    assert!(fenced(store.put_checkpoint(&s, &a, Epoch(1), b"zombie").await));
    assert_eq!(store.get_checkpoint(&s).await.unwrap().unwrap().data, b"a1+b2");
}

#[tokio::test]
async fn wrong_owner_wrong_epoch_released_or_unknown_are_fenced() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    let b = boot(&store, "node-b", LONG_TTL).await;
    let s = key("s1");
    assert!(fenced(store.put_checkpoint(&s, &a, Epoch(1), b"x").await), "no lease at all");
    store.claim(&s, &a).await.unwrap();
    assert!(fenced(store.put_checkpoint(&s, &b, Epoch(1), b"x").await), "not the owner");
    assert!(fenced(store.put_checkpoint(&s, &a, Epoch(2), b"x").await), "future epoch");
    store.release(&s, &a, Epoch(1)).await.unwrap();
    assert!(fenced(store.put_checkpoint(&s, &a, Epoch(1), b"x").await), "released");
    assert_eq!(store.get_checkpoint(&s).await.unwrap(), None);
}

#[tokio::test]
async fn a_checkpoint_ahead_of_the_writer_is_never_overwritten() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    let s = key("s1");
    store.claim(&s, &a).await.unwrap();
    // A checkpoint from a later epoch exists (e.g. epochs after GC of lease rows).
    sqlx::query("INSERT INTO agent_checkpoints VALUES ('s1', 5, 'later', now())")
        .execute(store.pool())
        .await
        .unwrap();
    assert!(fenced(store.put_checkpoint(&s, &a, Epoch(1), b"older").await));
    assert_eq!(store.get_checkpoint(&s).await.unwrap().unwrap().epoch, Epoch(5));
}

/// The lease row is locked against a concurrent takeover: a write racing an uncommitted
/// takeover waits for it and is then fenced against the committed version.
#[tokio::test]
async fn a_write_racing_a_takeover_waits_and_is_fenced() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    let b = boot(&store, "node-b", LONG_TTL).await;
    let s = key("s1");
    store.claim(&s, &a).await.unwrap();
    store.hand_back_all(&a).await.unwrap(); // a's lease is no longer live, a does not know

    let mut takeover = store.pool().begin().await.unwrap();
    let claim = claim_once(&mut *takeover, &s, &b).await.unwrap();
    assert_eq!(claim, Some(Claim::TookOver { epoch: Epoch(2) }));

    // The zombie writes on a connection of its own, whose backend we watch.
    let mut zombie_conn = store.pool().acquire().await.unwrap();
    let zombie_pid = backend_pid(&mut zombie_conn).await;
    let zombie = {
        let (s, a) = (s.clone(), a.clone());
        tokio::spawn(async move { put_checkpoint(&mut *zombie_conn, &s, &a, Epoch(1), b"zombie").await })
    };
    // The zombie's statement is seen waiting on the lease row's lock (not merely slow).
    wait_for_lock_wait(&store, zombie_pid).await;
    assert!(!zombie.is_finished(), "the zombie write must wait on the row lock");
    takeover.commit().await.unwrap();
    assert!(fenced(zombie.await.unwrap()));
    assert_eq!(store.get_checkpoint(&s).await.unwrap(), None);
}

/// And the other way round: a takeover racing an in-flight fenced write waits for it, so
/// the write is ordered entirely before the new epoch.
#[tokio::test]
async fn a_takeover_waits_for_an_in_flight_write() {
    let store = store().await;
    let a = boot(&store, "node-a", LONG_TTL).await;
    let b = boot(&store, "node-b", LONG_TTL).await;
    let s = key("s1");
    store.claim(&s, &a).await.unwrap();

    let mut write = store.pool().begin().await.unwrap();
    put_checkpoint(&mut *write, &s, &a, Epoch(1), b"last words").await.unwrap();
    store.hand_back_all(&a).await.unwrap(); // node rows are not locked by the write

    // The takeover claims on a connection of its own, whose backend we watch.
    let mut takeover_conn = store.pool().acquire().await.unwrap();
    let takeover_pid = backend_pid(&mut takeover_conn).await;
    let takeover = {
        let (s, b) = (s.clone(), b.clone());
        tokio::spawn(async move { claim_once(&mut *takeover_conn, &s, &b).await })
    };
    // The takeover's claim is seen waiting on the lease row's lock (the `FOR SHARE` of the
    // write's fence), not merely not yet started.
    wait_for_lock_wait(&store, takeover_pid).await;
    assert!(!takeover.is_finished(), "the takeover must wait for the in-flight write");
    write.commit().await.unwrap();
    assert_eq!(takeover.await.unwrap().unwrap(), Some(Claim::TookOver { epoch: Epoch(2) }));
    let cp = store.get_checkpoint(&s).await.unwrap().unwrap();
    assert_eq!((cp.epoch, cp.data.as_slice()), (Epoch(1), &b"last words"[..]));
    assert!(fenced(store.put_checkpoint(&s, &a, Epoch(1), b"after").await));
}
