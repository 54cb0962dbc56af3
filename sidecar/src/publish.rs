//! Publishing the agent's events (CONTRACT §9): numbered at once, journaled in group
//! commits, fanned out to observers only once journaled.
//!
//! One writer task per node takes every pending event of every session into one fenced
//! INSERT (each event under its own lease's fence). The flush rule: the first event
//! into an empty queue waits [`LINGER`] for company, then everything pending (up to
//! [`MAX_BATCH`]) goes in one statement; events arriving while a statement runs make up
//! the next one. A token stream therefore never waits on a round trip per token: its
//! publishes return as soon as the event is numbered, and N concurrent streams share one
//! statement. A flush (the turn's answer is recorded only after one) cuts the linger.
//!
//! An event whose lease moved is not journaled and reaches nobody; its session is stood
//! down, so its turn halts and a later flush for it reports the loss.

use std::{collections::HashSet, sync::Arc, time::Duration};

use leasehold_core::{
    store::{Append, JournalEvent},
    Epoch, EventId, SessionKey,
};
use tokio::{
    sync::{mpsc, oneshot},
    time::Instant,
};

use crate::{
    metrics::Metrics,
    observe::{Event, Hubs},
    ownership::{LocalLease, Ownership, StandDownReason},
};

/// How long the first event into an empty queue waits for others (`--journal-linger`): a
/// model's tokens come tens of milliseconds apart per stream, so 5 ms gathers many
/// streams' tokens into one statement at a delay no observer can perceive.
pub const LINGER: Duration = Duration::from_millis(5);
/// Events per statement at most (`--journal-max-batch`): bounds one statement's size and
/// duration.
pub const MAX_BATCH: usize = 1000;

/// The flush rule: how long to wait for company, and how many events at most.
#[derive(Debug, Clone, Copy)]
pub struct GroupCommit {
    pub linger: Duration,
    pub max_batch: usize,
}

impl Default for GroupCommit {
    fn default() -> Self {
        GroupCommit { linger: LINGER, max_batch: MAX_BATCH }
    }
}
/// Pause between attempts while the store cannot take a batch.
const RETRY_PAUSE: Duration = Duration::from_millis(200);
/// Sessions remembered as having lost an event, at most: a lost session is stood down
/// and never written at that epoch again, so forgetting old entries only matters to a
/// flush that comes this many losses later.
const LOST_MEMORY: usize = 65_536;

#[derive(Debug)]
enum Op {
    Event(Append),
    /// Answer once every event of `key` at `epoch` published before it is journaled:
    /// true if all of them landed.
    Flush {
        key: SessionKey,
        epoch: Epoch,
        done: oneshot::Sender<bool>,
    },
}

/// The node's event publisher.
#[derive(Debug)]
pub struct Publisher {
    tx: mpsc::UnboundedSender<Op>,
    hubs: Arc<Hubs>,
}

impl Publisher {
    /// Start the writer task. `give_up` bounds how long a batch is retried while the
    /// store is unreachable (the lease TTL: after it, the sessions are not ours anyway).
    pub fn start(
        ownership: Arc<Ownership>,
        hubs: Arc<Hubs>,
        metrics: Arc<Metrics>,
        give_up: Duration,
        rule: GroupCommit,
    ) -> Arc<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        let writer = Writer { ownership, hubs: hubs.clone(), metrics, give_up, rule, lost: HashSet::new() };
        tokio::spawn(writer.run(rx));
        Arc::new(Publisher { tx, hubs })
    }

    /// Number an event of `lease`'s session and queue it for the journal. It reaches
    /// observers once journaled.
    pub fn publish(
        &self,
        lease: &LocalLease,
        turn_id: Option<String>,
        kind: String,
        data: String,
    ) -> EventId {
        let id = self.hubs.allocate(&lease.key, lease.epoch);
        let event = JournalEvent { id, turn_id, kind, data };
        let append = Append { key: lease.key.clone(), owner: lease.owner.clone(), event };
        // The writer lives as long as the runtime; a send fails only at shutdown.
        let _ = self.tx.send(Op::Event(append));
        id
    }

    /// The newest event of `key` this node's observers have seen, if any.
    pub fn last_seen(&self, key: &SessionKey) -> Option<EventId> {
        self.hubs.last_delivered(key)
    }

    /// Hand this node's observers what an earlier owner journaled but never fanned out
    /// (it died in between): `events` from the journal, up to the start of `epoch`.
    pub fn catch_up(&self, key: &SessionKey, epoch: Epoch, events: Vec<JournalEvent>) -> usize {
        events
            .into_iter()
            .take_while(|e| e.id.epoch < epoch)
            .filter(|e| self.hubs.ingest_journaled(key, Event::new(e.id, &e.kind, &e.data)))
            .count()
    }

    /// Wait until every event of `key` at `epoch` published so far is journaled: true if
    /// all landed, false if one was fenced or could not be written.
    pub async fn flush(&self, key: &SessionKey, epoch: Epoch) -> bool {
        let (done, answer) = oneshot::channel();
        if self.tx.send(Op::Flush { key: key.clone(), epoch, done }).is_err() {
            return false;
        }
        answer.await.unwrap_or(false)
    }
}

struct Writer {
    ownership: Arc<Ownership>,
    hubs: Arc<Hubs>,
    metrics: Arc<Metrics>,
    give_up: Duration,
    rule: GroupCommit,
    /// Sessions (at an epoch) an event of which did not land.
    lost: HashSet<(SessionKey, Epoch)>,
}

impl Writer {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Op>) {
        while let Some(first) = rx.recv().await {
            let mut ops = vec![first];
            let deadline = Instant::now() + self.rule.linger;
            while ops.len() < self.rule.max_batch && !matches!(ops.last(), Some(Op::Flush { .. })) {
                match rx.try_recv() {
                    Ok(op) => ops.push(op),
                    Err(mpsc::error::TryRecvError::Empty) => {
                        match tokio::time::timeout_at(deadline, rx.recv()).await {
                            Ok(Some(op)) => ops.push(op),
                            Ok(None) | Err(_) => break,
                        }
                    }
                    Err(mpsc::error::TryRecvError::Disconnected) => break,
                }
            }
            self.commit(ops).await;
        }
    }

    async fn commit(&mut self, ops: Vec<Op>) {
        let mut batch = Vec::new();
        let mut flushes = Vec::new();
        for op in ops {
            match op {
                Op::Event(append) => batch.push(append),
                Op::Flush { key, epoch, done } => flushes.push((key, epoch, done)),
            }
        }
        if !batch.is_empty() {
            crate::failpoint::stop_before_journal(batch.iter().map(|a| &a.key));
            let landed = self.append(&batch).await;
            crate::failpoint::stop_after_journal(batch.iter().map(|a| &a.key));
            for append in batch {
                let Append { key, event, .. } = append;
                if landed.contains(&(key.clone(), event.id)) {
                    self.hubs.deliver(&key, Event::new(event.id, &event.kind, &event.data));
                } else {
                    self.lose(key, event.id.epoch);
                }
            }
        }
        for (key, epoch, done) in flushes {
            let _ = done.send(!self.lost.contains(&(key, epoch)));
        }
    }

    /// One statement, retried while the store is unreachable, up to `give_up`.
    async fn append(&self, batch: &[Append]) -> HashSet<(SessionKey, EventId)> {
        let started = Instant::now();
        loop {
            match self.ownership.append_events(batch).await {
                Ok(landed) => {
                    self.metrics.journal_batch(batch.len());
                    return landed.into_iter().collect();
                }
                Err(e) if started.elapsed() < self.give_up => {
                    tracing::warn!(error = %e, events = batch.len(), "journal write failed; retrying");
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
                Err(e) => {
                    tracing::error!(error = %e, events = batch.len(), "journal write failed; the sessions are stood down");
                    return HashSet::new();
                }
            }
        }
    }

    fn lose(&mut self, key: SessionKey, epoch: Epoch) {
        if self.lost.len() >= LOST_MEMORY {
            self.lost.clear();
        }
        if self.lost.insert((key.clone(), epoch)) {
            self.metrics.fenced_write();
            self.ownership.stand_down(&key, epoch, StandDownReason::Fenced);
        }
    }
}
