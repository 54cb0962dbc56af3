//! The supervised heartbeat: renews this process's node lease on its own timer,
//! independent of any turn, in one single-row statement per beat (CONTRACT §7).
//!
//! It publishes how long the node lease is *certainly* live (measured on the monotonic
//! clock from before the renewal was sent), reports a lost boot on a channel, and, when the
//! node lease was lost, registers a new boot so the process can serve again. The task's
//! `JoinHandle` is returned so the process notices if it ever stops.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use sqlx::PgConnection;
use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
    time::{Instant, MissedTickBehavior},
};
use tokio_util::sync::CancellationToken;

use leasehold_core::{
    store::{self, liveness, LeaseStore},
    Owner,
};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("heartbeat could not reach the lease store")]
    Store(#[from] store::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Share of the TTL we never count on locally: covers clock-rate drift between this pod's
/// monotonic clock and the database's, and scheduling delay before we act on the value.
pub const SAFETY_MARGIN_DIVISOR: u32 = 10;

/// Lower bound of the safety margin, for very short (test) TTLs.
pub const MIN_SAFETY_MARGIN: Duration = Duration::from_millis(50);

/// How many lost boots may queue before the heartbeat waits for the consumer; a boot is
/// lost at most once per TTL, so this never fills in practice.
const LOST_CHANNEL_CAPACITY: usize = 16;

/// Until when a node lease renewed at `sent` (before the statement was sent) is certainly
/// live: the database set `expires_at = now() + ttl` with `now()` no earlier than `sent`.
pub fn certainly_live_until(sent: Instant, ttl: Duration) -> Instant {
    let margin = (ttl / SAFETY_MARGIN_DIVISOR).max(MIN_SAFETY_MARGIN);
    sent + ttl.saturating_sub(margin)
}

/// This process's identity and how long it may act without asking the database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeState {
    /// The current boot. Changes only after the previous boot's node lease was lost.
    pub owner: Owner,
    /// `None` while not registered or after a loss; otherwise the monotonic deadline.
    pub live_until: Option<Instant>,
    /// Whether the last beat reached the lease store.
    pub store_reachable: bool,
    /// When the last successful renewal (or registration) was sent; kept across a loss,
    /// so its age keeps growing until the next success (the heartbeat-age metric).
    pub renewed: Option<Instant>,
}

impl NodeState {
    pub fn certainly_live(&self, now: Instant) -> bool {
        self.live_until.is_some_and(|until| now < until)
    }

    /// Ready to take work: registered, certainly live, and the store answered last beat.
    pub fn ready(&self, now: Instant) -> bool {
        self.store_reachable && self.certainly_live(now)
    }
}

/// Settings of the heartbeat.
#[derive(Debug, Clone)]
pub struct Heartbeat {
    pub store: LeaseStore,
    pub node_id: String,
    pub peer_addr: String,
    pub ttl: Duration,
    pub interval: Duration,
    /// Hold the boot's liveness lock on the heartbeat's own connection and expire dead
    /// peers' node rows each beat (`--connection-liveness`, [`liveness`]).
    pub liveness: bool,
}

/// The heartbeat's own connection when it holds a liveness lock: outside every pool, so
/// nothing but a broken connection (or the process's death) lets go of the lock.
#[derive(Debug, Default)]
struct Link {
    conn: Option<PgConnection>,
    /// The boot whose lock `conn` holds.
    locked: Option<Owner>,
}

impl Link {
    /// Forget a connection that failed below the SQL level: the server may have closed
    /// it (and released the lock); the next beat connects and takes the lock again.
    fn checked<T>(&mut self, result: Result<T, store::Error>) -> Result<T, store::Error> {
        if let Err(store::Error::Database { source, .. }) = &result {
            if !matches!(source, sqlx::Error::Database(_)) {
                self.conn = None;
                self.locked = None;
            }
        }
        result
    }
}

/// What the process holds of a running heartbeat.
#[derive(Debug)]
pub struct HeartbeatHandle {
    pub state: watch::Receiver<NodeState>,
    /// Each boot whose node lease was lost: every session it held is gone.
    pub lost: mpsc::Receiver<Owner>,
    /// Ends with `Err` only on an unrecoverable failure; the process must exit then.
    pub task: JoinHandle<Result<()>>,
    stopper: Stopper,
    /// The liveness connection of a stopped heartbeat, kept open (and the lock held)
    /// until the process exits: a drain stops the heartbeat and then hands back, and no
    /// peer may read the gap between the two as a death.
    _parked: Arc<Mutex<Option<PgConnection>>>,
}

impl HeartbeatHandle {
    /// A handle that can stop the heartbeat from elsewhere (the drain).
    pub fn stopper(&self) -> Stopper {
        self.stopper.clone()
    }

    /// Stop renewing and wait until the current beat has finished.
    pub async fn stop(&self) {
        self.stopper.stop().await
    }
}

/// Stops the heartbeat: cancels the timer and waits until no beat is in flight, so a
/// hand-back that follows cannot race a renewal (which would register a new boot).
#[derive(Debug, Clone)]
pub struct Stopper {
    cancel: CancellationToken,
    finished: watch::Receiver<bool>,
}

impl Stopper {
    pub async fn stop(&self) {
        self.cancel.cancel();
        let mut finished = self.finished.clone();
        let _ = finished.wait_for(|done| *done).await; // Err: the task is gone, equally done
    }
}

/// Marks the task finished however it ends, panics included.
struct FinishedOnDrop(watch::Sender<bool>);

impl Drop for FinishedOnDrop {
    fn drop(&mut self) {
        self.0.send_replace(true);
    }
}

impl Heartbeat {
    /// Register the first boot (revoking earlier boots of this node id) and start the
    /// timer. Fails if the first registration fails: the sidecar does not become ready
    /// without a node lease.
    pub async fn start(self) -> Result<HeartbeatHandle> {
        let owner = Owner::new_boot(&self.node_id);
        let mut link = Link::default();
        let sent = Instant::now();
        let revoked = match self.liveness {
            true => {
                let registered = self.register_linked(&mut link, &owner).await;
                link.checked(registered)?
            }
            false => self.store.register_boot(&owner, &self.peer_addr, self.ttl).await?,
        };
        tracing::info!(%owner, revoked_earlier_boots = revoked, liveness_lock = link.locked.is_some(), "registered node lease");
        let live_until = Some(certainly_live_until(sent, self.ttl));
        let (state_tx, state) =
            watch::channel(NodeState { owner, live_until, store_reachable: true, renewed: Some(sent) });
        let (lost_tx, lost) = mpsc::channel(LOST_CHANNEL_CAPACITY);
        let cancel = CancellationToken::new();
        let (finished_tx, finished) = watch::channel(false);
        let parked = Arc::new(Mutex::new(None));
        let run = self.run(link, parked.clone(), state_tx, lost_tx, cancel.clone());
        let task = tokio::spawn(async move {
            let _finished = FinishedOnDrop(finished_tx);
            run.await
        });
        Ok(HeartbeatHandle { state, lost, task, stopper: Stopper { cancel, finished }, _parked: parked })
    }

    async fn run(
        self,
        mut link: Link,
        parked: Arc<Mutex<Option<PgConnection>>>,
        state: watch::Sender<NodeState>,
        lost: mpsc::Sender<Owner>,
        cancel: CancellationToken,
    ) -> Result<()> {
        let mut timer = tokio::time::interval_at(Instant::now() + self.interval, self.interval);
        timer.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut registered = true;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => {
                    *parked.lock().unwrap_or_else(|e| e.into_inner()) = link.conn.take();
                    return Ok(());
                }
                _ = timer.tick() => {}
            }
            let owner = state.borrow().owner.clone();
            let sent = Instant::now();
            // A beat that cannot finish within one interval has failed; the next starts fresh.
            // A beat left unfinished by the timeout leaves its connection to finish reading
            // the answer at the next use (sqlx), so the lock on it is kept.
            match tokio::time::timeout(self.interval, self.beat(&mut link, &owner, registered)).await {
                Ok(Ok(Some(live))) => {
                    if live != owner {
                        tracing::info!(owner = %live, "registered new boot after losing the node lease");
                    }
                    registered = true;
                    let live_until = Some(certainly_live_until(sent, self.ttl));
                    state.send_modify(|s| {
                        *s = NodeState {
                            owner: live.clone(),
                            live_until,
                            store_reachable: true,
                            renewed: Some(sent),
                        }
                    });
                    if link.locked.as_ref() == Some(&live) {
                        let _ = tokio::time::timeout(self.interval, self.reap(&mut link, &live)).await;
                    }
                }
                Ok(Ok(None)) => {
                    tracing::warn!(%owner, "node lease expired or was revoked: every session of this boot is lost");
                    registered = false;
                    state.send_modify(|s| {
                        s.live_until = None;
                        s.store_reachable = true;
                    });
                    if lost.send(owner).await.is_err() {
                        return Ok(()); // nobody listens: the process is shutting down
                    }
                }
                Ok(Err(e)) if is_fatal(&e) => return Err(e.into()),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "heartbeat failed; will retry");
                    state.send_modify(|s| s.store_reachable = false);
                }
                Err(_) => {
                    tracing::warn!(timeout = ?self.interval, "heartbeat timed out; will retry");
                    state.send_modify(|s| s.store_reachable = false);
                }
            }
        }
    }

    /// One beat: renew the current boot, or register a fresh boot after a loss.
    /// `Some(owner)`: `owner` is live now. `None`: the current boot's node lease is gone.
    async fn beat(
        &self,
        link: &mut Link,
        owner: &Owner,
        registered: bool,
    ) -> Result<Option<Owner>, store::Error> {
        if !self.liveness {
            if registered {
                return Ok(self.store.renew_all(owner, self.ttl).await?.map(|lease| lease.owner));
            }
            let fresh = Owner::new_boot(&self.node_id);
            self.store.register_boot(&fresh, &self.peer_addr, self.ttl).await?;
            return Ok(Some(fresh));
        }
        if self.store.pool().is_closed() {
            // The process closed its store (shutting down): renewing on the side would
            // outlive it.
            return Err(store::Error::Database {
                context: "renew node lease",
                source: sqlx::Error::PoolClosed,
            });
        }
        let beat = async {
            if registered {
                let (conn, holds) = self.lock(link, owner).await?;
                return Ok(self.store.renew_on(conn, owner, self.ttl, holds).await?.map(|lease| lease.owner));
            }
            let fresh = Owner::new_boot(&self.node_id);
            self.register_linked(link, &fresh).await?;
            Ok(Some(fresh))
        };
        let result = beat.await;
        link.checked(result)
    }

    /// Register `owner` on the heartbeat's connection, its liveness lock taken first (a
    /// row that says it holds a lock never exists without it).
    async fn register_linked(&self, link: &mut Link, owner: &Owner) -> Result<u64, store::Error> {
        let (conn, holds) = self.lock(link, owner).await?;
        self.store.register_boot_on(conn, owner, &self.peer_addr, self.ttl, holds).await
    }

    /// Connect if need be and hold `owner`'s liveness lock on the connection (letting go
    /// of an earlier boot's). `false`: another connection holds it (our own broken one,
    /// whose backend has not noticed yet); the boot says so and the next beat tries again.
    /// Returns the connection with the answer.
    async fn lock<'l>(
        &self,
        link: &'l mut Link,
        owner: &Owner,
    ) -> Result<(&'l mut PgConnection, bool), store::Error> {
        if link.conn.is_none() {
            link.locked = None;
            link.conn = Some(self.store.liveness_connection().await?);
        }
        let conn = link.conn.as_mut().expect("connected above");
        if link.locked.as_ref() == Some(owner) {
            return Ok((conn, true));
        }
        if let Some(earlier) = link.locked.take() {
            liveness::unlock(conn, &earlier).await?;
        }
        if liveness::try_lock(conn, owner).await? {
            link.locked = Some(owner.clone());
            return Ok((conn, true));
        }
        tracing::warn!(%owner, "liveness lock held by another connection; the TTL alone judges this boot until the next beat takes it");
        Ok((conn, false))
    }

    /// Expire the node rows of peers whose liveness lock is gone (they died): their
    /// sessions are claimable now rather than after their TTL.
    async fn reap(&self, link: &mut Link, me: &Owner) {
        let Some(conn) = link.conn.as_mut() else { return };
        let reaped = liveness::reap(conn, me, None, self.ttl).await;
        match link.checked(reaped) {
            Ok(dead) => {
                for owner in dead {
                    tracing::info!(%owner, "a peer's connection to the lease store closed: expired its node lease");
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not look for dead peers; next beat"),
        }
    }
}

/// A closed pool never comes back: renewing is impossible, so the process must stop.
fn is_fatal(e: &store::Error) -> bool {
    matches!(e, store::Error::Database { source: sqlx::Error::PoolClosed, .. })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certainly_live_keeps_a_margin() {
        let t = Instant::now();
        assert_eq!(certainly_live_until(t, Duration::from_secs(15)), t + Duration::from_millis(13_500));
        // very short TTLs keep at least the minimum margin
        assert_eq!(certainly_live_until(t, Duration::from_millis(200)), t + Duration::from_millis(150));
        assert_eq!(certainly_live_until(t, Duration::from_millis(10)), t);
    }

    #[test]
    fn live_only_before_the_deadline() {
        let now = Instant::now();
        let owner = Owner::from_parts("n", "b");
        let mut state = NodeState {
            owner: owner.clone(),
            live_until: Some(now + Duration::from_secs(1)),
            store_reachable: true,
            renewed: Some(now),
        };
        assert!(state.certainly_live(now) && state.ready(now));
        assert!(!state.certainly_live(now + Duration::from_secs(1)));
        state.store_reachable = false;
        assert!(state.certainly_live(now) && !state.ready(now), "live but the store is unreachable");
        assert!(
            !NodeState { owner, live_until: None, store_reachable: true, renewed: None }.certainly_live(now)
        );
    }
}
