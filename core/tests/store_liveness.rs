//! Liveness by connection: a boot whose lock connection closed is expired by a peer at
//! once; a boot whose connection is open, a boot without a lock, the caller itself and a
//! freshly restarted Postgres are never judged by it.

mod support;

use std::time::{Duration, Instant};

use leasehold_core::{
    store::{liveness, Claim, LeaseStore},
    Epoch, Owner,
};
use sqlx::{Connection, PgConnection};
use support::{boot, key, store, LONG_TTL};

/// As the guard's TTL: Postgres has been up longer than this, so the guard lets judging
/// happen.
const GUARD_OFF: Duration = Duration::from_millis(1);

/// As the guard's TTL: longer than this test Postgres has been up, so nobody is judged.
const GUARD_ON: Duration = Duration::from_secs(365 * 24 * 3600);

/// How long a closed connection's backend may take to exit and release its locks.
const BACKEND_EXIT: Duration = Duration::from_secs(10);

/// Register `node` on a connection of its own that holds its liveness lock.
async fn locked_boot(store: &LeaseStore, node: &str) -> (Owner, PgConnection) {
    let owner = Owner::new_boot(node);
    let mut conn = store.liveness_connection().await.unwrap();
    assert!(liveness::try_lock(&mut conn, &owner).await.unwrap());
    store.register_boot_on(&mut conn, &owner, "127.0.0.1:1", LONG_TTL, true).await.unwrap();
    (owner, conn)
}

/// Reap (only `only`, if given) until something is expired or the backend had time to exit.
async fn reap_until_some(store: &LeaseStore, me: &Owner, only: Option<&Owner>) -> Vec<Owner> {
    let started = Instant::now();
    loop {
        let dead = store.reap_dead_boots(me, only, GUARD_OFF).await.unwrap();
        if !dead.is_empty() || started.elapsed() > BACKEND_EXIT {
            return dead;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_boot_whose_lock_connection_closed_is_expired_by_a_peer_and_no_other() {
    let store = store().await;
    let me = boot(&store, "node-me", LONG_TTL).await;
    let (a, conn_a) = locked_boot(&store, "node-a").await;
    let (c, conn_c) = locked_boot(&store, "node-c").await;
    let (d, mut conn_d) = locked_boot(&store, "node-d").await;
    // An earlier version's boot: no lock, the TTL alone judges it.
    let b = boot(&store, "node-b", LONG_TTL).await;
    for (session, owner) in [("ka", &a), ("kb", &b), ("kc", &c), ("kd", &d)] {
        assert!(store.claim(&key(session), owner).await.unwrap().owned_epoch().is_some());
    }

    assert_eq!(
        store.reap_dead_boots(&me, None, GUARD_OFF).await.unwrap(),
        Vec::<Owner>::new(),
        "every lock held"
    );
    let mut other = store.liveness_connection().await.unwrap();
    assert!(!liveness::try_lock(&mut other, &a).await.unwrap(), "a's lock is a's alone");

    // a and c die (their connections close); d says it no longer holds its lock.
    conn_a.close().await.unwrap();
    conn_c.close().await.unwrap();
    store.renew_on(&mut conn_d, &d, LONG_TTL, false).await.unwrap().expect("d live");
    assert!(liveness::unlock(&mut conn_d, &d).await.unwrap());

    // A Postgres up for less than the guard's TTL judges nobody.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(store.reap_dead_boots(&me, None, GUARD_ON).await.unwrap().is_empty());
    // Only the boot asked about.
    assert_eq!(reap_until_some(&store, &me, Some(&a)).await, vec![a.clone()]);
    assert_eq!(reap_until_some(&store, &me, None).await, vec![c.clone()]);
    assert!(store.reap_dead_boots(&me, None, GUARD_OFF).await.unwrap().is_empty(), "b and d keep their TTL");

    // a's and c's sessions are claimable at once; b's and d's are not.
    assert_eq!(store.claim(&key("ka"), &me).await.unwrap(), Claim::TookOver { epoch: Epoch(2) });
    assert_eq!(store.claim(&key("kc"), &me).await.unwrap(), Claim::TookOver { epoch: Epoch(2) });
    assert!(matches!(store.claim(&key("kb"), &me).await.unwrap(), Claim::Held(h) if h.owner == b));
    assert!(matches!(store.claim(&key("kd"), &me).await.unwrap(), Claim::Held(h) if h.owner == d));
    // A dead boot's node lease is never resurrected by a late renewal.
    let mut late = store.liveness_connection().await.unwrap();
    assert_eq!(store.renew_on(&mut late, &a, LONG_TTL, true).await.unwrap(), None);
}

#[tokio::test]
async fn the_caller_is_never_judged_even_without_its_lock() {
    let store = store().await;
    let (me, conn) = locked_boot(&store, "node-me").await;
    conn.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(store.reap_dead_boots(&me, None, GUARD_OFF).await.unwrap().is_empty());
    let peer = boot(&store, "node-peer", LONG_TTL).await;
    assert_eq!(reap_until_some(&store, &peer, None).await, vec![me], "a peer judges it");
}
