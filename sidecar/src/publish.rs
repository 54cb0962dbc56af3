//! Publishing the agent's events (CONTRACT §9): numbered at once, journaled in group
//! commits, fanned out to observers only once journaled.
//!
//! One writer task per node takes every pending event of every session into one fenced
//! INSERT (each event under its own lease's fence). The flush rule is the classic group
//! commit (Postgres' with `commit_delay = 0`): when no statement is in flight, the first
//! event is written at once; the events that arrive while a statement runs make up the
//! next one (up to [`MAX_BATCH`]). A lone event thus waits for nothing but its own round
//! trip, and a busy node still shares statements: the busier it is, the more each one
//! carries. A token stream never waits on a round trip per token either: its publishes
//! return as soon as the event is numbered.
//!
//! `--journal-linger` above zero restores a fixed wait: the first event into an empty
//! queue then waits that long for company before its statement (fewer, larger statements
//! when events trickle in, at that much added delivery latency). A flush (the turn's
//! answer is recorded only after one) cuts the wait.
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

/// How long the first event into an empty queue waits for others (`--journal-linger`):
/// zero, the adaptive group commit. A fixed wait delayed every delivery by it (5 ms, the
/// previous default, was most of a lone subscriber's latency, BENCHMARKS.md), while the
/// statements in flight already gather a busy node's events.
pub const LINGER: Duration = Duration::ZERO;
/// Events per statement at most (`--journal-max-batch`): bounds one statement's size and
/// duration.
pub const MAX_BATCH: usize = 1000;

/// The flush rule: how long to wait for company (zero: not at all, only what queued while
/// the previous statement ran), and how many events at most.
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
        while let Some(ops) = gather(&mut rx, self.rule).await {
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

/// The next statement's ops: the first op to come, then whatever else is queued (the
/// events that arrived while the previous statement ran), up to `max_batch`; with a
/// linger, also what arrives within it of the first. A flush ends the batch, so the
/// turn waiting on it is answered by this statement. None once the publishers are gone.
async fn gather(rx: &mut mpsc::UnboundedReceiver<Op>, rule: GroupCommit) -> Option<Vec<Op>> {
    let first = rx.recv().await?;
    let mut ops = vec![first];
    let deadline = (!rule.linger.is_zero()).then(|| Instant::now() + rule.linger);
    while ops.len() < rule.max_batch && !matches!(ops.last(), Some(Op::Flush { .. })) {
        match rx.try_recv() {
            Ok(op) => ops.push(op),
            Err(mpsc::error::TryRecvError::Empty) => {
                let Some(deadline) = deadline else { break };
                match tokio::time::timeout_at(deadline, rx.recv()).await {
                    Ok(Some(op)) => ops.push(op),
                    Ok(None) | Err(_) => break,
                }
            }
            Err(mpsc::error::TryRecvError::Disconnected) => break,
        }
    }
    Some(ops)
}

#[cfg(test)]
mod tests {
    use leasehold_core::Owner;
    use tokio::time::sleep;

    use super::*;

    /// A statement's duration in the pipeline test: longer than the gap between events,
    /// so several queue up behind each statement.
    const STATEMENT: Duration = Duration::from_millis(3);
    /// The gap between one publisher's events in the pipeline test.
    const EVENT_GAP: Duration = Duration::from_millis(1);
    /// The fixed wait of the linger tests (the previous default).
    const FIXED: Duration = Duration::from_millis(5);

    fn adaptive() -> GroupCommit {
        GroupCommit::default()
    }

    fn event(seq: u64) -> Op {
        Op::Event(Append {
            key: SessionKey::parse("s").unwrap(),
            owner: Owner::new_boot("node-a"),
            event: JournalEvent {
                id: EventId { epoch: Epoch(1), seq },
                turn_id: None,
                kind: "token".into(),
                data: "{}".into(),
            },
        })
    }

    fn flush() -> (Op, oneshot::Receiver<bool>) {
        let (done, answer) = oneshot::channel();
        (Op::Flush { key: SessionKey::parse("s").unwrap(), epoch: Epoch(1), done }, answer)
    }

    fn seqs(ops: &[Op]) -> Vec<u64> {
        ops.iter()
            .filter_map(|op| match op {
                Op::Event(a) => Some(a.event.id.seq),
                Op::Flush { .. } => None,
            })
            .collect()
    }

    #[test]
    fn the_default_is_adaptive() {
        assert_eq!(adaptive().linger, Duration::ZERO);
        assert_eq!(adaptive().max_batch, MAX_BATCH);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lone_event_is_written_without_waiting() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        tx.send(event(1)).unwrap();
        let started = Instant::now();
        let ops = gather(&mut rx, adaptive()).await.unwrap();
        assert_eq!(seqs(&ops), [1]);
        assert_eq!(started.elapsed(), Duration::ZERO, "no linger (the clock is paused: any wait shows)");
    }

    #[tokio::test(start_paused = true)]
    async fn what_queued_meanwhile_goes_in_one_statement_up_to_the_maximum() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        for seq in 0..2500 {
            tx.send(event(seq)).unwrap();
        }
        drop(tx);
        let mut sizes = Vec::new();
        let mut next = 0;
        while let Some(ops) = gather(&mut rx, adaptive()).await {
            let got = seqs(&ops);
            assert_eq!(got, (next..next + got.len() as u64).collect::<Vec<_>>(), "in publish order");
            next += got.len() as u64;
            sizes.push(got.len());
        }
        assert_eq!(sizes, [MAX_BATCH, MAX_BATCH, 500]);
    }

    /// The classic group commit end to end: a publisher sends an event every millisecond
    /// while each statement takes three. The first event goes out alone and at once; the
    /// ones that arrive while a statement runs share the next statement.
    #[tokio::test(start_paused = true)]
    async fn events_arriving_while_a_statement_runs_share_the_next() {
        const EVENTS: u64 = 60;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let start = Instant::now();
        let publisher = tokio::spawn(async move {
            for seq in 0..EVENTS {
                tx.send(event(seq)).unwrap();
                sleep(EVENT_GAP).await;
            }
        });
        let mut statements: Vec<(Duration, Vec<u64>)> = Vec::new();
        while let Some(ops) = gather(&mut rx, adaptive()).await {
            statements.push((start.elapsed(), seqs(&ops)));
            sleep(STATEMENT).await; // the statement in flight
        }
        publisher.await.unwrap();
        assert_eq!(statements[0], (Duration::ZERO, vec![0]), "the first event alone, at once");
        let all: Vec<u64> = statements.iter().flat_map(|(_, s)| s.clone()).collect();
        assert_eq!(all, (0..EVENTS).collect::<Vec<_>>(), "every event once, in order");
        assert!(
            statements.len() as u64 <= EVENTS / 2,
            "{} statements for {EVENTS} events: not batched",
            statements.len()
        );
        assert!(statements[1..].iter().all(|(_, s)| s.len() >= 2 || s.last() == Some(&(EVENTS - 1))));
    }

    #[tokio::test(start_paused = true)]
    async fn a_flush_ends_the_batch() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (f, _answer) = flush();
        tx.send(event(1)).unwrap();
        tx.send(f).unwrap();
        tx.send(event(2)).unwrap();
        let first = gather(&mut rx, adaptive()).await.unwrap();
        assert_eq!((seqs(&first), first.len()), (vec![1], 2), "the event and its flush");
        assert_eq!(seqs(&gather(&mut rx, adaptive()).await.unwrap()), [2]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_fixed_linger_waits_for_company_unless_a_flush_cuts_it() {
        let rule = GroupCommit { linger: FIXED, max_batch: MAX_BATCH };
        let (tx, mut rx) = mpsc::unbounded_channel();
        tx.send(event(1)).unwrap();
        let late = tx.clone();
        tokio::spawn(async move {
            sleep(FIXED / 2).await;
            late.send(event(2)).unwrap();
        });
        let started = Instant::now();
        let ops = gather(&mut rx, rule).await.unwrap();
        assert_eq!(seqs(&ops), [1, 2], "company within the linger joins");
        assert!(started.elapsed() >= FIXED, "waited the linger out: {:?}", started.elapsed());

        let (f, _answer) = flush();
        tx.send(event(3)).unwrap();
        tx.send(f).unwrap();
        let started = Instant::now();
        assert_eq!(seqs(&gather(&mut rx, rule).await.unwrap()), [3]);
        assert_eq!(started.elapsed(), Duration::ZERO, "the flush cut the linger");
    }

    #[tokio::test]
    async fn no_batch_once_the_publishers_are_gone() {
        let (tx, mut rx) = mpsc::unbounded_channel::<Op>();
        drop(tx);
        assert!(gather(&mut rx, adaptive()).await.is_none());
    }
}
