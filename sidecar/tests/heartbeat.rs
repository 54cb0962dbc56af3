//! The supervised heartbeat against a real Postgres.

// The store tests' support (a database of its own per test), shared rather than copied.
#[path = "../../core/tests/support/mod.rs"]
mod support;

use std::time::Duration;

use leasehold_core::{
    store::{Claim, Error as StoreError, LeaseStore},
    Epoch,
};
use leasehold_sidecar::heartbeat::{Error, Heartbeat};
use support::{boot, key, store, LONG_TTL};
use tokio::time::{timeout, Instant};

fn heartbeat(store: &LeaseStore, node: &str, ttl_ms: u64, interval_ms: u64) -> Heartbeat {
    Heartbeat {
        store: store.clone(),
        node_id: node.into(),
        peer_addr: "127.0.0.1:9".into(),
        ttl: Duration::from_millis(ttl_ms),
        interval: Duration::from_millis(interval_ms),
        liveness: true,
    }
}

#[tokio::test]
async fn renews_on_its_own_timer_so_sessions_outlive_the_ttl() {
    let store = store().await;
    let hb = heartbeat(&store, "node-a", 400, 100).start().await.unwrap();
    let owner = hb.state.borrow().owner.clone();
    assert_eq!(store.claim(&key("s1"), &owner).await.unwrap(), Claim::Claimed { epoch: Epoch(1) });
    let first_deadline = hb.state.borrow().live_until.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await; // ~4 TTLs with no turn at all
    let info = store.lookup(&key("s1")).await.unwrap();
    assert_eq!(info.holder.expect("still live").owner, owner);
    let state = hb.state.borrow().clone();
    assert_eq!(state.owner, owner, "no loss, same boot");
    assert!(state.live_until.unwrap() > first_deadline + Duration::from_millis(1000));
    assert!(state.certainly_live(Instant::now()));
    hb.stop().await;
    // stopped: the lease now lapses on its own
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(store.lookup(&key("s1")).await.unwrap().claimable());
}

#[tokio::test]
async fn a_revoked_node_lease_is_reported_lost_and_a_new_boot_registers() {
    let store = store().await;
    let mut hb = heartbeat(&store, "node-a", 1000, 100).start().await.unwrap();
    let first = hb.state.borrow().owner.clone();
    store.claim(&key("s1"), &first).await.unwrap();
    store.revoke_node("node-a").await.unwrap(); // e.g. the operator thought the pod dead

    let lost = timeout(Duration::from_secs(2), hb.lost.recv()).await.expect("loss reported").unwrap();
    assert_eq!(lost, first);
    // A new boot follows; the old one is never resurrected.
    let mut state = hb.state.clone();
    let fresh =
        timeout(Duration::from_secs(2), state.wait_for(|s| s.owner != first && s.live_until.is_some()))
            .await
            .expect("new boot registered")
            .unwrap()
            .owner
            .clone();
    assert_eq!(fresh.node_id(), "node-a");
    assert_eq!(store.renew_all(&first, LONG_TTL).await.unwrap(), None);
    assert_eq!(store.claim(&key("s1"), &fresh).await.unwrap(), Claim::TookOver { epoch: Epoch(2) });
    hb.stop().await;
}

/// How often a waiting test re-reads the store.
const POLL: Duration = Duration::from_millis(20);
/// Node lease of the paused-process test.
const PAUSED_TTL_MS: u64 = 300;
/// Its renewal interval: over three TTLs, as a process paused between beats sees it.
const PAUSED_INTERVAL_MS: u64 = 1000;
/// The lapsed lease is claimable by then: the TTL plus a store round trip on a busy machine.
const LAPSE_BOUND: Duration = Duration::from_secs(2);
/// The loss is reported by the first renewal after the lapse: one interval, plus slack
/// for a renewal on a busy machine.
const LOSS_REPORT_BOUND: Duration = Duration::from_millis(PAUSED_INTERVAL_MS + 1500);

/// A running process whose renewals come too late (paused between beats: interval > TTL)
/// loses its node lease; another node takes its session over; the process learns the
/// loss from its own next renewal (reported on `lost`, the boot it had); its late write
/// is refused by the fence (the `Fenced` answer, not any error); a restart registers a
/// new, live boot of the same node while the paused boot stays expired.
#[tokio::test]
async fn a_paused_process_learns_its_loss_and_is_fenced() {
    let store = store().await;
    let started = Instant::now();
    let mut hb = heartbeat(&store, "node-a", PAUSED_TTL_MS, PAUSED_INTERVAL_MS).start().await.unwrap();
    let a = hb.state.borrow().owner.clone();
    store.claim(&key("s1"), &a).await.unwrap();

    let lapse_deadline = Instant::now() + LAPSE_BOUND;
    while !store.lookup(&key("s1")).await.unwrap().claimable() {
        assert!(Instant::now() < lapse_deadline, "the unrenewed node lease never lapsed");
        tokio::time::sleep(POLL).await;
    }
    let b = boot(&store, "node-b", LONG_TTL).await;
    assert_eq!(store.claim(&key("s1"), &b).await.unwrap(), Claim::TookOver { epoch: Epoch(2) });

    let lost = timeout(LOSS_REPORT_BOUND, hb.lost.recv())
        .await
        .expect("the running heartbeat reports the lapsed boot lost")
        .expect("lost channel open");
    assert_eq!(lost, a, "the boot that was paused is the one reported lost");
    assert!(started.elapsed() >= Duration::from_millis(PAUSED_INTERVAL_MS), "learnt at a renewal");
    let late = store.put_checkpoint(&key("s1"), &a, Epoch(1), b"late").await;
    assert!(matches!(late, Err(StoreError::Fenced { .. })), "{late:?}");
    hb.stop().await;

    let restarted = heartbeat(&store, "node-a", 300, 100).start().await.unwrap();
    let fresh = restarted.state.borrow().owner.clone();
    assert_eq!(fresh.node_id(), "node-a");
    assert!(store.renew_all(&fresh, LONG_TTL).await.unwrap().is_some(), "the new boot is live");
    assert_eq!(store.renew_all(&a, LONG_TTL).await.unwrap(), None, "the paused boot stays expired");
    restarted.stop().await;
}

#[tokio::test]
async fn the_process_notices_when_the_heartbeat_cannot_go_on() {
    let store = store().await;
    let mut hb = heartbeat(&store, "node-a", 1000, 100).start().await.unwrap();
    store.pool().close().await; // renewing has become impossible
    let ended = timeout(Duration::from_secs(2), &mut hb.task).await.expect("task ended").unwrap();
    assert!(matches!(ended, Err(Error::Store(_))), "{ended:?}");
    assert!(!hb.state.borrow().certainly_live(Instant::now() + Duration::from_secs(1)));
}

#[tokio::test]
async fn the_first_registration_failing_fails_start() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy("postgres://nobody@127.0.0.1:1/none")
        .unwrap();
    let store = LeaseStore::from_pool(pool);
    assert!(heartbeat(&store, "node-a", 1000, 100).start().await.is_err());
}

/// The backends holding a liveness lock for `owner`.
async fn lock_holders(store: &LeaseStore, owner: &leasehold_core::Owner) -> Vec<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2 \
         AND classid = $1::int4::oid AND objid = hashtext($2)::oid",
    )
    .bind(leasehold_core::store::liveness::LOCK_CLASS)
    .bind(owner.as_str())
    .fetch_all(store.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn a_heartbeat_whose_connection_was_killed_takes_its_lock_again() {
    let store = store().await;
    let hb = heartbeat(&store, "node-a", 60_000, 100).start().await.unwrap();
    let owner = hb.state.borrow().owner.clone();
    let holders = lock_holders(&store, &owner).await;
    assert_eq!(holders.len(), 1, "the heartbeat's connection holds the boot's lock");
    let row: (bool,) = sqlx::query_as("SELECT liveness_lock FROM agent_nodes WHERE owner = $1")
        .bind(owner.as_str())
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert!(row.0, "the node row says so");

    sqlx::query("SELECT pg_terminate_backend($1)").bind(holders[0]).execute(store.pool()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let owner = hb.state.borrow().owner.clone();
        let now = lock_holders(&store, &owner).await;
        if now.len() == 1 && now[0] != holders[0] && hb.state.borrow().certainly_live(Instant::now()) {
            break;
        }
        assert!(Instant::now() < deadline, "no lock taken again: {now:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    hb.stop().await;
    // Stopped (a drain): the lock stays held until the process exits, so the gap between
    // the heartbeat's stop and the hand-back never reads as a death.
    let owner = hb.state.borrow().owner.clone();
    assert_eq!(lock_holders(&store, &owner).await.len(), 1);
    drop(hb);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !lock_holders(&store, &owner).await.is_empty() {
        assert!(Instant::now() < deadline, "the lock went with the process");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
