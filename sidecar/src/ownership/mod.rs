//! Ownership resolution (CONTRACT §7): who may run a session, asked at every entry point.
//!
//! The local lease table remembers the sessions this process holds. A session held by the
//! current boot is served without a database round trip while the node lease is certainly
//! live (heartbeat deadline on the monotonic clock); otherwise the node claims. Anything
//! that shows a session is no longer ours (a fenced write, a lost boot, a claim naming
//! someone else) stands it down: its in-flight turn is halted and the agent is told.

pub(crate) mod holders;
mod journal;

pub use holders::MAX_TRUST as HOLDER_MAX_TRUST;

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use tokio::{
    sync::{mpsc, watch},
    time::Instant,
};
use tokio_util::sync::CancellationToken;

use leasehold_core::{
    store::{self, notify::Changes, Checkpoint, Claim, Holder, LeaseInfo, LeaseStore},
    Epoch, Owner, SessionKey,
};

use crate::{heartbeat::NodeState, metrics::Metrics};

/// A session this process may run now, at `epoch`.
#[derive(Debug, Clone)]
pub struct LocalLease {
    pub key: SessionKey,
    pub owner: Owner,
    pub epoch: Epoch,
    /// Cancelled when the session is stood down: in-flight work must halt.
    pub halt: CancellationToken,
    /// Checkpoints sent at this epoch from this node that may have landed (counted when
    /// sent, uncounted only when refused by the fence): a turn halted after one of them
    /// may be in the history, so it is not retried.
    pub landed: Arc<AtomicU64>,
    /// Set once the turns an earlier owner left unfinished were looked for at this epoch:
    /// held with the lease, not with the session's turn queue (whose entry goes whenever
    /// nothing runs or waits), so sequential turns do not read the journal each time.
    pub unfinished_checked: Arc<AtomicBool>,
}

impl LocalLease {
    /// True until [`LocalLease::unfinished_were_checked`] at this epoch: the moment to
    /// look for turns an earlier owner left unfinished. The caller holds the session's
    /// turn (its queue place), so no two turns of it look at once.
    pub fn unfinished_unchecked(&self) -> bool {
        !self.unfinished_checked.load(Ordering::Acquire)
    }

    /// The earlier owners' unfinished turns were looked for (and resumed) at this epoch.
    pub fn unfinished_were_checked(&self) {
        self.unfinished_checked.store(true, Ordering::Release);
    }
}

/// Where a session runs.
#[derive(Debug, Clone)]
pub enum Route {
    Local(LocalLease),
    Remote(Holder),
}

#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("lease store unavailable")]
    Store(#[source] store::Error),
    /// The last heartbeat could not reach the store.
    #[error("lease store unreachable at the last heartbeat")]
    StoreDown,
    /// Our node lease lapsed; the heartbeat is registering a new boot.
    #[error("this node holds no live node lease")]
    NodeNotLive,
}

/// Why a session was stood down (logged and counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StandDownReason {
    Fenced,
    LeaseLost,
    /// The node lease stopped being certainly live without a renewal (cut off from the
    /// store): stood down before anyone else may take the session over.
    Lapsed,
    Drain,
}

impl StandDownReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StandDownReason::Fenced => "fenced",
            StandDownReason::LeaseLost => "lease_lost",
            StandDownReason::Lapsed => "lapsed",
            StandDownReason::Drain => "drain",
        }
    }
}

/// A session in the lease table.
#[derive(Debug)]
struct Held {
    owner: Owner,
    epoch: Epoch,
    halt: CancellationToken,
    landed: Arc<AtomicU64>,
    unfinished_checked: Arc<AtomicBool>,
}

impl Held {
    fn lease(&self, key: &SessionKey) -> LocalLease {
        LocalLease {
            key: key.clone(),
            owner: self.owner.clone(),
            epoch: self.epoch,
            halt: self.halt.clone(),
            landed: self.landed.clone(),
            unfinished_checked: self.unfinished_checked.clone(),
        }
    }
}

/// The sessions this process holds, and the way to resolve any other.
#[derive(Debug)]
pub struct Ownership {
    store: LeaseStore,
    node: watch::Receiver<NodeState>,
    table: Mutex<HashMap<SessionKey, Held>>,
    stood_down: mpsc::UnboundedSender<SessionKey>,
    metrics: Arc<Metrics>,
    holders: holders::Holders,
}

impl Ownership {
    /// `stood_down` receives every session the agent must be told to drop.
    pub fn new(
        store: LeaseStore,
        node: watch::Receiver<NodeState>,
        stood_down: mpsc::UnboundedSender<SessionKey>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Ownership {
            store,
            node,
            table: Mutex::new(HashMap::new()),
            stood_down,
            metrics,
            holders: holders::Holders::default(),
        }
    }

    pub fn node(&self) -> NodeState {
        self.node.borrow().clone()
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<SessionKey, Held>> {
        self.table.lock().expect("lease table lock")
    }

    /// The session if the current boot holds it and the node lease is certainly live.
    fn fast_path(&self, key: &SessionKey) -> Option<LocalLease> {
        let node = self.node.borrow();
        if !node.ready(Instant::now()) {
            return None;
        }
        let table = self.table();
        table.get(key).filter(|e| e.owner == node.owner).map(|e| e.lease(key))
    }

    /// Resolve the owner of `key`: claim unless the fast path applies (we hold it, or we
    /// recently learned who does). `fresh` forces a claim (the re-claim after a forward
    /// found the owner unreachable or refusing).
    pub async fn resolve(&self, key: &SessionKey, fresh: bool) -> Result<Route, ResolveError> {
        if fresh {
            self.holders.forget(key);
        } else {
            if let Some(local) = self.fast_path(key) {
                self.metrics.resolved("fast_path");
                return Ok(Route::Local(local));
            }
            if let Some(holder) = self.holders.get(key) {
                self.metrics.resolved("known_holder");
                return Ok(Route::Remote(holder));
            }
        }
        let (owner, store_reachable) = {
            let node = self.node.borrow();
            (node.owner.clone(), node.store_reachable)
        };
        if !store_reachable {
            // The last heartbeat could not reach the store: fail fast rather than pile
            // requests onto a dead database; the next successful beat lifts this.
            return Err(ResolveError::StoreDown);
        }
        let claim = match self.counted(self.store.claim(key, &owner).await) {
            Ok(claim) => claim,
            Err(store::Error::NodeNotLive { .. }) => return Err(ResolveError::NodeNotLive),
            Err(e) => return Err(ResolveError::Store(e)),
        };
        self.metrics.resolved(match claim {
            Claim::Claimed { .. } => "claimed",
            Claim::Extended { .. } => "extended",
            Claim::TookOver { .. } => "took_over",
            Claim::Held(_) => "held",
        });
        match claim {
            Claim::Held(holder) => {
                // Someone else holds it live: whatever we remembered is stale.
                self.stand_down_any(key, StandDownReason::LeaseLost);
                self.holders.remember(key, &holder);
                Ok(Route::Remote(holder))
            }
            owned => {
                let epoch = owned.owned_epoch().expect("owned claim has an epoch");
                Ok(Route::Local(self.remember(key, owner, epoch)))
            }
        }
    }

    /// Record a lease we hold; a different epoch or boot replaces (and stands down) the old.
    fn remember(&self, key: &SessionKey, owner: Owner, epoch: Epoch) -> LocalLease {
        let mut table = self.table();
        if let Some(entry) = table.get(key) {
            if entry.owner == owner && entry.epoch == epoch {
                return entry.lease(key);
            }
        }
        let entry = Held {
            owner,
            epoch,
            halt: CancellationToken::new(),
            landed: Arc::default(),
            unfinished_checked: Arc::default(),
        };
        let lease = entry.lease(key);
        let old = table.insert(key.clone(), entry);
        self.metrics.set_leases_held(table.len());
        drop(table);
        if let Some(old) = old {
            self.halt(key, old, StandDownReason::LeaseLost);
        }
        lease
    }

    /// The local lease for an agent write at `epoch`, if we hold exactly that.
    pub fn local(&self, key: &SessionKey, epoch: Epoch) -> Option<LocalLease> {
        let table = self.table();
        table.get(key).filter(|e| e.epoch == epoch).map(|e| e.lease(key))
    }

    /// Stand a session down if we still hold it at `epoch` (a fenced write).
    pub fn stand_down(&self, key: &SessionKey, epoch: Epoch, reason: StandDownReason) {
        self.stand_down_if(key, |held| held.epoch == epoch, reason);
    }

    fn stand_down_any(&self, key: &SessionKey, reason: StandDownReason) {
        self.stand_down_if(key, |_| true, reason);
    }

    /// Stand `key` down if what we hold of it `matches`, decided and removed under one
    /// lock so a lease remembered meanwhile is never the one stood down.
    fn stand_down_if(&self, key: &SessionKey, matches: impl FnOnce(&Held) -> bool, reason: StandDownReason) {
        let mut table = self.table();
        if !table.get(key).is_some_and(matches) {
            return;
        }
        let entry = table.remove(key).expect("checked above");
        self.metrics.set_leases_held(table.len());
        drop(table);
        self.halt(key, entry, reason);
    }

    fn halt(&self, key: &SessionKey, entry: Held, reason: StandDownReason) {
        tracing::info!(%key, epoch = %entry.epoch, reason = reason.as_str(), "standing session down");
        entry.halt.cancel();
        self.metrics.stood_down(reason.as_str());
        let _ = self.stood_down.send(key.clone());
    }

    /// Whether the current boot holds `key` in its table.
    pub fn holds(&self, key: &SessionKey) -> bool {
        let owner = self.node.borrow().owner.clone();
        self.table().get(key).is_some_and(|e| e.owner == owner)
    }

    /// A notification says `key` at `epoch` now belongs to `owner` (or was released):
    /// forget any remembered holder, and stand our lease down if the notification is
    /// about it or a newer one and names someone else (or nobody). A notification about
    /// an older epoch than ours is stale (it was queued behind our re-claim) and never
    /// stands a newer lease down.
    pub fn lease_changed(&self, key: &SessionKey, epoch: Epoch, owner: Option<&Owner>) {
        self.holders.forget(key);
        let moved = |ours: &Held| ours.epoch <= epoch && owner != Some(&ours.owner);
        self.stand_down_if(key, moved, StandDownReason::LeaseLost);
    }

    /// Notifications may have been missed: trust no remembered holder.
    pub fn forget_all_holders(&self) {
        self.holders.clear();
    }

    /// Another boot handed its sessions back or was revoked: stop forwarding to it.
    pub fn forget_holder(&self, owner: &Owner) {
        self.holders.forget_owner(owner);
    }

    /// A boot's node lease was lost: every session it held is gone.
    pub fn lose_boot(&self, owner: &Owner) {
        self.stand_down_all(|e| &e.owner == owner, StandDownReason::LeaseLost);
    }

    /// The node lease of `owner` is no longer certainly live and no renewal came: stand
    /// its sessions down now, while no other node can have claimed them yet (a claim needs
    /// the lease expired on the database clock, which is later by the safety margin).
    /// A later claim finds our lease again if it was only the store that was slow.
    pub fn lapse(&self, owner: &Owner) -> usize {
        self.stand_down_all(|e| &e.owner == owner, StandDownReason::Lapsed)
    }

    /// Until the process ends: whenever the node lease passes its certainly-live deadline
    /// without a renewal, [`Ownership::lapse`] the current boot.
    pub async fn watch_lapse(self: Arc<Self>) {
        let mut node = self.node.clone();
        loop {
            let (owner, until) = {
                let state = node.borrow_and_update();
                (state.owner.clone(), state.live_until)
            };
            match until {
                Some(until) if Instant::now() < until => {
                    tokio::select! {
                        () = tokio::time::sleep_until(until) => {} // looked at again above
                        changed = node.changed() => if changed.is_err() { return },
                    }
                }
                _ => {
                    let n = self.lapse(&owner);
                    if n > 0 {
                        tracing::warn!(%owner, sessions = n, "node lease no longer certainly live: stood its sessions down");
                    }
                    if node.changed().await.is_err() {
                        return;
                    }
                }
            }
        }
    }

    /// Stand down every session (drain deadline). Returns how many.
    pub fn stand_down_everything(&self, reason: StandDownReason) -> usize {
        self.stand_down_all(|_| true, reason)
    }

    fn stand_down_all(&self, matches: impl Fn(&Held) -> bool, reason: StandDownReason) -> usize {
        let mut table = self.table();
        let keys: Vec<SessionKey> =
            table.iter().filter(|(_, e)| matches(e)).map(|(k, _)| k.clone()).collect();
        let gone: Vec<_> = keys.into_iter().filter_map(|k| table.remove(&k).map(|e| (k, e))).collect();
        self.metrics.set_leases_held(table.len());
        drop(table);
        let n = gone.len();
        for (key, entry) in gone {
            self.halt(&key, entry, reason);
        }
        n
    }

    /// Release an idle session (the agent asked): claimable at once, no longer renewed.
    /// `Ok(false)` if we did not hold it at that epoch. A repeated release (a DELETE
    /// whose answer was lost) finds the row still ours at that epoch and succeeds again.
    ///
    /// The session leaves the table before the statement is sent, so the notification of
    /// our own release never finds it there (it would stand the agent down for nothing);
    /// if the statement fails the lease is still ours in the store and the next turn's
    /// claim finds it again.
    pub async fn release(&self, key: &SessionKey, epoch: Epoch) -> Result<bool, store::Error> {
        let held = {
            let mut table = self.table();
            let ours = table.get(key).is_some_and(|e| e.epoch == epoch);
            let held = if ours { table.remove(key) } else { None };
            self.metrics.set_leases_held(table.len());
            held
        };
        let owner = held.map_or_else(|| self.node().owner, |held| held.owner);
        self.counted(self.store.release(key, &owner, epoch).await)
    }

    /// Forget every session without telling anyone (after the hand-back of a drain,
    /// where in-flight work has already finished or been stood down).
    pub fn forget_all(&self) {
        let mut table = self.table();
        table.clear();
        self.metrics.set_leases_held(0);
    }

    /// Expire `owner`'s node lease if Postgres says its connection is gone (its liveness
    /// lock is free): every session of that boot is claimable then. A store error reads
    /// as "not known to be dead".
    pub async fn reap_dead(&self, owner: &Owner, ttl: Duration) {
        let me = self.node.borrow().owner.clone();
        match self.counted(self.store.reap_dead_boots(&me, Some(owner), ttl).await) {
            Ok(dead) if !dead.is_empty() => {
                tracing::info!(%owner, "owner refused the connection and its connection to the lease store closed: expired its node lease");
                self.forget_holder(owner);
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(%owner, error = %e, "could not ask the lease store whether an unreachable owner is dead");
            }
        }
    }

    /// Count a failed store statement on its way to the caller.
    fn counted<T>(&self, result: Result<T, store::Error>) -> Result<T, store::Error> {
        if result.as_ref().is_err_and(store::Error::is_unavailable) {
            self.metrics.store_error();
        }
        result
    }

    /// Read a session's lease and its holder's liveness; never claims.
    pub async fn lookup(&self, key: &SessionKey) -> Result<LeaseInfo, store::Error> {
        self.counted(self.store.lookup(key).await)
    }

    /// A session's latest checkpoint (the agent's thaw).
    pub async fn checkpoint(&self, key: &SessionKey) -> Result<Option<Checkpoint>, store::Error> {
        self.counted(self.store.get_checkpoint(key).await)
    }

    /// Write a checkpoint through the fence at `lease`'s owner and epoch;
    /// `Err(Fenced)` when the lease has moved on.
    pub async fn put_checkpoint(
        &self,
        lease: &LocalLease,
        turn_id: Option<&str>,
        data: &[u8],
    ) -> Result<(), store::Error> {
        self.counted(
            self.store.put_turn_checkpoint(&lease.key, &lease.owner, lease.epoch, turn_id, data).await,
        )
    }

    /// Whether this process's node lease is certainly live right now (no other node can
    /// have taken over one of its sessions by expiry).
    pub fn certainly_live(&self) -> bool {
        self.node.borrow().certainly_live(Instant::now())
    }

    /// Subscribe to ownership changes (LISTEN/NOTIFY).
    pub async fn listen(&self) -> Result<Changes, store::Error> {
        self.store.listen().await
    }

    /// Hand every session of the current boot back in one statement (drain): claimable
    /// at once. Returns how many.
    pub async fn hand_back_all(&self) -> Result<u64, store::Error> {
        let owner = self.node().owner;
        self.counted(self.store.hand_back_all(&owner).await)
    }

    /// Sessions held here with the time our node lease is certainly live.
    pub fn held(&self) -> Vec<(SessionKey, Epoch, Duration)> {
        let node = self.node.borrow().clone();
        let left =
            node.live_until.map_or(Duration::ZERO, |until| until.saturating_duration_since(Instant::now()));
        let mut held: Vec<_> = self
            .table()
            .iter()
            .filter(|(_, e)| e.owner == node.owner)
            .map(|(k, e)| (k.clone(), e.epoch, left))
            .collect();
        held.sort_by(|a, b| a.0.cmp(&b.0));
        held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An ownership table with no database behind it (nothing here reaches the store),
    /// holding `key` for the current boot; the node state's sender drives the lapse.
    fn holding(key: &SessionKey) -> (Arc<Ownership>, watch::Sender<NodeState>, LocalLease) {
        let store = LeaseStore::connect_lazy("postgres://nobody@127.0.0.1:1/none", 1).unwrap();
        let owner = Owner::new_boot("node-a");
        let state = NodeState {
            owner: owner.clone(),
            live_until: Some(Instant::now() + Duration::from_secs(1)),
            store_reachable: true,
            renewed: Some(Instant::now()),
        };
        let (node_tx, node) = watch::channel(state);
        let (stood_down, _) = mpsc::unbounded_channel();
        let ownership = Arc::new(Ownership::new(store, node, stood_down, Arc::default()));
        let lease = ownership.remember(key, owner, Epoch(1));
        (ownership, node_tx, lease)
    }

    /// Release at epoch 1, re-claim at epoch 2, then the queued epoch-1 notification
    /// arrives: it describes a lease older than ours and must not stand epoch 2 down.
    #[tokio::test]
    async fn a_stale_notification_never_stands_down_a_newer_lease() {
        let key = SessionKey::parse("s").unwrap();
        let (ownership, _node, first) = holding(&key);
        let me = first.owner.clone();
        let second = ownership.remember(&key, me.clone(), Epoch(2));
        ownership.lease_changed(&key, Epoch(1), None); // epoch 1 released
        ownership.lease_changed(&key, Epoch(1), Some(&me)); // epoch 1 claimed
        assert!(!second.halt.is_cancelled() && ownership.holds(&key), "epoch 2 kept");

        let other = Owner::new_boot("node-b");
        ownership.lease_changed(&key, Epoch(2), Some(&me));
        assert!(!second.halt.is_cancelled(), "our own claim at our epoch");
        ownership.lease_changed(&key, Epoch(3), Some(&other));
        assert!(second.halt.is_cancelled() && !ownership.holds(&key), "a newer lease elsewhere");
    }

    #[tokio::test]
    async fn a_release_of_our_epoch_by_anyone_stands_it_down() {
        let key = SessionKey::parse("s").unwrap();
        let (ownership, _node, lease) = holding(&key);
        ownership.lease_changed(&key, Epoch(1), None);
        assert!(lease.halt.is_cancelled() && !ownership.holds(&key));
    }

    #[tokio::test(start_paused = true)]
    async fn sessions_are_stood_down_when_the_node_lease_lapses_unrenewed() {
        let key = SessionKey::parse("s").unwrap();
        let (ownership, _node, lease) = holding(&key);
        tokio::spawn(ownership.clone().watch_lapse());
        tokio::time::sleep(Duration::from_millis(990)).await;
        assert!(!lease.halt.is_cancelled() && ownership.holds(&key), "still certainly live");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(lease.halt.is_cancelled(), "the turn in flight is halted");
        assert!(!ownership.holds(&key), "and the session forgotten");
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_before_the_deadline_keeps_the_sessions() {
        let key = SessionKey::parse("s").unwrap();
        let (ownership, node, lease) = holding(&key);
        tokio::spawn(ownership.clone().watch_lapse());
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            node.send_modify(|s| s.live_until = Some(Instant::now() + Duration::from_secs(1)));
        }
        assert!(!lease.halt.is_cancelled() && ownership.holds(&key));
    }
}
