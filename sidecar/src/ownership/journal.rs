//! The turn journal's door (CONTRACT §9): every journal write goes through the fence at a
//! local lease's owner and epoch; reads are plain.

use leasehold_core::{
    store::{self, Answer, Append, Begun, JournalEvent, NewTurn, TurnRecord},
    Epoch, EventId, SessionKey,
};

use super::{LocalLease, Ownership};

impl Ownership {
    /// Journal a turn before its dispatch (or take an interrupted one over).
    pub async fn begin_turn(&self, lease: &LocalLease, turn: &NewTurn<'_>) -> Result<Begun, store::Error> {
        self.counted(self.store.begin_turn(&lease.key, &lease.owner, lease.epoch, turn).await)
    }

    /// Take an interrupted turn over at `lease`'s epoch; `None` when it is not interrupted.
    pub async fn resume_turn(
        &self,
        lease: &LocalLease,
        turn_id: &str,
    ) -> Result<Option<TurnRecord>, store::Error> {
        self.counted(self.store.resume_turn(&lease.key, &lease.owner, lease.epoch, turn_id).await)
    }

    /// Record a turn's answer; `Err(Fenced)` when the lease moved or the turn is no
    /// longer ours to finish.
    pub async fn finish_turn(
        &self,
        lease: &LocalLease,
        turn_id: &str,
        answer: &Answer,
    ) -> Result<(), store::Error> {
        self.counted(self.store.finish_turn(&lease.key, &lease.owner, lease.epoch, turn_id, answer).await)
    }

    /// Cancel an unfinished turn; false when it was not running.
    pub async fn cancel_turn(&self, lease: &LocalLease, turn_id: &str) -> Result<bool, store::Error> {
        self.counted(self.store.cancel_turn(&lease.key, &lease.owner, lease.epoch, turn_id).await)
    }

    /// One group commit of published events, each fenced by its own lease.
    pub async fn append_events(&self, batch: &[Append]) -> Result<Vec<(SessionKey, EventId)>, store::Error> {
        self.counted(self.store.append_events(batch).await)
    }

    pub async fn get_turn(
        &self,
        key: &SessionKey,
        turn_id: &str,
    ) -> Result<Option<TurnRecord>, store::Error> {
        self.counted(self.store.get_turn(key, turn_id).await)
    }

    pub async fn unfinished_turns(&self, key: &SessionKey) -> Result<Vec<TurnRecord>, store::Error> {
        self.counted(self.store.unfinished_turns(key).await)
    }

    /// Journaled events after `after`, in id order, at most `limit` (observer replay).
    pub async fn events_after(
        &self,
        key: &SessionKey,
        after: Option<EventId>,
        limit: i64,
    ) -> Result<Vec<JournalEvent>, store::Error> {
        self.counted(self.store.events_after(key, after, limit).await)
    }

    /// The journaled events of a turn's attempts before `epoch` (for a resuming agent).
    pub async fn turn_events(
        &self,
        key: &SessionKey,
        turn_id: &str,
        epoch: Epoch,
    ) -> Result<Vec<JournalEvent>, store::Error> {
        self.counted(self.store.turn_events(key, turn_id, epoch).await)
    }

    /// Sessions with an unfinished turn and no live owner, at most `limit`.
    pub async fn orphaned_turns(&self, limit: i64) -> Result<Vec<SessionKey>, store::Error> {
        self.counted(self.store.orphaned_turns(limit).await)
    }
}
