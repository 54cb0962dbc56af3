//! The fence of the agent API (CONTRACT §5): the agent's thaw, fenced checkpoint, fenced
//! publish and idle release. Every write carries the epoch its turn was dispatched with,
//! and lands only while this node still holds the session at that epoch.

use std::sync::{atomic::Ordering, Arc};

use leasehold_core::{
    store::{self, Checkpoint, JournalEvent},
    Epoch, EventId, SessionKey,
};
use serde_json::value::RawValue;

use crate::{
    metrics::Metrics,
    observe::Hubs,
    ownership::{Ownership, StandDownReason},
    publish::Publisher,
    turn::queue::TurnQueue,
};

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// This node no longer owns the session at that epoch: the turn must halt.
    #[error("fenced")]
    Fenced,
    #[error("lease store unavailable")]
    Unavailable(#[source] store::Error),
}

#[derive(Debug)]
pub struct Fence {
    pub ownership: Arc<Ownership>,
    pub hubs: Arc<Hubs>,
    pub publisher: Arc<Publisher>,
    /// The sessions' turn queues: an event belongs to the turn running when it is published.
    pub queue: Arc<TurnQueue>,
    pub metrics: Arc<Metrics>,
}

impl Fence {
    fn fenced(&self, key: &SessionKey, epoch: Epoch) -> WriteError {
        self.metrics.fenced_write();
        self.ownership.stand_down(key, epoch, StandDownReason::Fenced);
        WriteError::Fenced
    }

    fn store_error(&self, key: &SessionKey, epoch: Epoch, e: store::Error) -> WriteError {
        match e {
            store::Error::Fenced { .. } => self.fenced(key, epoch),
            e => WriteError::Unavailable(e),
        }
    }

    pub async fn checkpoint(&self, key: &SessionKey) -> Result<Option<Checkpoint>, store::Error> {
        self.ownership.checkpoint(key).await
    }

    /// The journaled events of a turn's attempts before `before` (all when `None`): what
    /// an agent resuming the turn continues from.
    pub async fn turn_events(
        &self,
        key: &SessionKey,
        turn_id: &str,
        before: Option<Epoch>,
    ) -> Result<Vec<JournalEvent>, store::Error> {
        self.ownership.turn_events(key, turn_id, before.unwrap_or(Epoch(i64::MAX))).await
    }

    /// Write through the fence. A write for an epoch we do not hold never reaches the
    /// database; one the database rejects stands the session down.
    pub async fn put_checkpoint(
        &self,
        key: &SessionKey,
        epoch: Epoch,
        data: &[u8],
    ) -> Result<(), WriteError> {
        let Some(lease) = self.ownership.local(key, epoch) else {
            return Err(self.fenced(key, epoch));
        };
        // The events published before it are journaled first: a checkpoint that landed
        // implies they did (a resuming agent relies on it).
        if !self.publisher.flush(key, epoch).await {
            return Err(self.fenced(key, epoch));
        }
        // Counted before it is sent: once on the wire it may land even if we never hear
        // back (a timeout in a partition); only the fence's refusal says it did not.
        lease.landed.fetch_add(1, Ordering::SeqCst);
        let turn_id = self.queue.running_turn_id(key);
        let written = self.ownership.put_checkpoint(&lease, turn_id.as_deref(), data).await;
        if let Err(store::Error::Fenced { .. }) = written {
            lease.landed.fetch_sub(1, Ordering::SeqCst);
        }
        written.map_err(|e| self.store_error(key, epoch, e))
    }

    /// Publish an event of the running turn: numbered at once, journaled under the fence
    /// in the next group commit, and fanned out to every observer only once journaled
    /// (see [`crate::publish`]). Refused at once when this node no longer holds the
    /// session at `epoch`; an event the journal's fence refuses reaches nobody and stands
    /// the session down, so the turn halts and is not acknowledged.
    pub async fn publish(
        &self,
        key: &SessionKey,
        epoch: Epoch,
        kind: String,
        data: Box<RawValue>,
    ) -> Result<EventId, WriteError> {
        let Some(lease) = self.ownership.local(key, epoch) else {
            return Err(self.fenced(key, epoch));
        };
        if lease.halt.is_cancelled() {
            return Err(self.fenced(key, epoch));
        }
        let turn_id = self.queue.running_turn_id(key);
        Ok(self.publisher.publish(&lease, turn_id, kind, data.get().to_owned()))
    }

    /// The session idled out: release it (claimable at once), stop holding it, and let
    /// its hub go unless someone here observes it.
    pub async fn release(&self, key: &SessionKey, epoch: Epoch) -> Result<(), WriteError> {
        match self.ownership.release(key, epoch).await {
            Ok(true) => {
                self.hubs.moved(key);
                Ok(())
            }
            Ok(false) => Err(WriteError::Fenced),
            Err(e) => Err(self.store_error(key, epoch, e)),
        }
    }
}
