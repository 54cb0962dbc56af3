//! Reading a session's events: `/stream` observers on any node and the owner's side of a
//! follower's upstream. Replay first, then live; never an id at or below one already
//! delivered.
//!
//! A reader that resumes after an id memory no longer reaches back to (a failover: the new
//! owner holds nothing of the earlier epoch; more than the buffer since) gets the missing
//! events from the turn journal first (CONTRACT §9), read on this node whoever owns the
//! session, then memory, then live. The live subscription is taken before the journal is
//! read, so an event published meanwhile comes either from the journal or live; the
//! stream's own fence (ids only grow) drops the second copy.

use std::{collections::VecDeque, sync::Arc, time::Duration};

use bytes::Bytes;
use futures_util::Stream;
use leasehold_core::{Epoch, EventId, SessionKey};
use serde_json::json;
use tokio::sync::{broadcast::error::RecvError, watch};

use super::{sse as frames, Event, Follow, Gap, Hubs, Message, Replay, Subscription};
use crate::{metrics::Metrics, ownership::Ownership};

/// A comment line this often keeps idle streams open through proxies and lets us notice
/// observers that went away.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

fn keep_alive() -> tokio::time::Interval {
    let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + KEEP_ALIVE, KEEP_ALIVE);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval
}

/// Journaled events read per statement: bounds one read's rows and memory.
pub const JOURNAL_PAGE: usize = 1000;
/// Journaled events replayed per connect at most: one reader cannot hold the store (or
/// its memory) for longer. A reader further behind gets `overflow` and resumes from its
/// `Last-Event-ID` with a new connection, which continues where this one stopped.
pub const JOURNAL_REPLAY_MAX: usize = 10_000;

/// Who reads the stream: they react differently to `Moved`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reader {
    /// A client: follows the session wherever it goes.
    Observer,
    /// Another node's follower: ends when we stop owning the session.
    Peer,
}

/// Opens streams of this node's hubs.
#[derive(Debug)]
pub struct Observe {
    pub hubs: Arc<Hubs>,
    pub follow: Arc<Follow>,
    pub ownership: Arc<Ownership>,
    pub metrics: Arc<Metrics>,
    pub draining: watch::Receiver<bool>,
    pub limits: StreamLimits,
}

/// How many `/stream`s this node keeps open.
#[derive(Debug, Clone, Copy)]
pub struct StreamLimits {
    pub per_node: usize,
    pub per_session: usize,
}

/// Why a stream was not opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotOpened {
    /// This node is draining: the observer should connect elsewhere.
    Draining,
    /// A follower asked a node that does not own the session.
    NotOwner,
    /// A stream limit is reached (`503 overloaded`).
    Overloaded,
}

impl Observe {
    /// Observe a session from this node, whoever owns it: replay after `after` (or the
    /// current turn so far), then live, following the session wherever it moves.
    pub fn open(&self, key: SessionKey, after: Option<EventId>) -> Result<Reading, NotOpened> {
        let sub = self.hubs.subscribe(&key, after);
        // Read after subscribing: a drain sets the flag before it tells every subscriber to
        // reconnect, so a stream either gets that `reconnect` or sees the flag here.
        if *self.draining.borrow() {
            return Err(NotOpened::Draining);
        }
        let Some(start_follower) = self.hubs.observer_joined(&key, self.limits) else {
            self.metrics.stream_refused();
            return Err(NotOpened::Overloaded);
        };
        self.metrics.observers(1);
        let guard =
            ObserverGuard { hubs: self.hubs.clone(), metrics: self.metrics.clone(), key: key.clone() };
        if start_follower {
            self.follow.start(key.clone());
        }
        Ok(self.reading(key, sub, after, Reader::Observer, Some(guard)))
    }

    /// The owner's side of a follower's upstream: ends with `moved` when we stop owning it.
    pub fn open_peer(&self, key: SessionKey, after: Option<EventId>) -> Result<Reading, NotOpened> {
        if !self.ownership.holds(&key) {
            return Err(NotOpened::NotOwner);
        }
        let mut sub = self.hubs.subscribe(&key, after);
        sub.primed = true; // we own it: our buffer is the truth
        Ok(self.reading(key, sub, after, Reader::Peer, None))
    }

    fn reading(
        &self,
        key: SessionKey,
        mut sub: Subscription,
        after: Option<EventId>,
        reader: Reader,
        guard: Option<ObserverGuard>,
    ) -> Reading {
        let replay = std::mem::replace(&mut sub.replay, Replay { events: Vec::new(), gap: Gap::None });
        let mut reading = Reading {
            key,
            replay: VecDeque::new(),
            backlog: VecDeque::new(),
            fill: None,
            ownership: self.ownership.clone(),
            announce_idle: reader == Reader::Observer && sub.idle,
            announce_primed: reader == Reader::Peer,
            keep_alive: keep_alive(),
            sub,
            last: after,
            after,
            done: false,
            reader,
            hubs: self.hubs.clone(),
            metrics: self.metrics.clone(),
            _guard: guard,
        };
        reading.start_replay(replay);
        reading
    }
}

/// A journal read still to do: from the reader's last id up to `until`.
#[derive(Debug, Clone, Copy)]
struct Fill {
    /// The first id memory holds (exclusive bound), or `None`: to the journal's end.
    until: Option<EventId>,
    /// Events read from the journal so far on this connection.
    read: usize,
}

impl Fill {
    fn before_until(&self, id: EventId) -> bool {
        self.until.is_none_or(|until| id < until)
    }
}

/// How many ids lie strictly between `last` and `until`, when countable (same epoch).
fn between(last: Option<EventId>, until: Option<EventId>) -> Option<u64> {
    match (last, until) {
        (Some(last), Some(until)) if last.epoch == until.epoch => until.seq.checked_sub(last.seq + 1),
        _ => None,
    }
}

/// Counts an observer while its stream lives.
#[derive(Debug)]
struct ObserverGuard {
    hubs: Arc<Hubs>,
    metrics: Arc<Metrics>,
    key: SessionKey,
}

impl Drop for ObserverGuard {
    fn drop(&mut self) {
        self.hubs.observer_left(&self.key);
        self.metrics.observers(-1);
    }
}

/// One open stream: turn it into SSE bytes with [`Reading::frames`].
#[derive(Debug)]
pub struct Reading {
    key: SessionKey,
    /// Journaled events read and not yet sent: they come before `replay`.
    backlog: VecDeque<Event>,
    /// The journal read still to do before `replay`.
    fill: Option<Fill>,
    /// From memory.
    replay: VecDeque<Event>,
    ownership: Arc<Ownership>,
    sub: Subscription,
    last: Option<EventId>,
    /// What the reader asked to resume after (for a replay computed once primed).
    after: Option<EventId>,
    announce_idle: bool,
    /// Peer readers learn when the replay part is over.
    announce_primed: bool,
    keep_alive: tokio::time::Interval,
    done: bool,
    reader: Reader,
    hubs: Arc<Hubs>,
    metrics: Arc<Metrics>,
    _guard: Option<ObserverGuard>,
}

impl Reading {
    /// The stream's SSE frames: replay, then live.
    pub fn frames(self) -> impl Stream<Item = Bytes> + Send {
        futures_util::stream::unfold(self, |mut s| async move {
            let frame = s.next_frame().await?;
            Some((frame, s))
        })
    }

    async fn next_frame(&mut self) -> Option<Bytes> {
        'replay: loop {
            if self.done {
                return None;
            }
            if let Some(frame) = self.replayed().await {
                return Some(frame);
            }
            if std::mem::take(&mut self.announce_primed) {
                return Some(frames::control("primed", json!({})));
            }
            if std::mem::take(&mut self.announce_idle) {
                return Some(frames::control("idle", json!({})));
            }
            loop {
                // One timer per stream for the keep-alive, not one per message.
                let next = tokio::select! {
                    biased;
                    next = self.sub.live.recv() => next,
                    _ = self.keep_alive.tick() => return Some(Bytes::from_static(frames::KEEP_ALIVE)),
                };
                match next {
                    // Not primed yet: the backfill arriving now is taken as a whole below.
                    Ok(Message::Event(_)) if !self.sub.primed => continue,
                    Ok(Message::Primed) if !self.sub.primed => {
                        self.sub.primed = true;
                        let replay = self.hubs.replay(&self.key, self.after);
                        self.start_replay(replay);
                        continue 'replay;
                    }
                    Ok(Message::Primed) => continue,
                    Ok(Message::Event(event)) if self.last.is_none_or(|last| event.id > last) => {
                        self.last = Some(event.id);
                        return Some(event.frame);
                    }
                    Ok(Message::Event(_)) => continue, // stale epoch or duplicate: the observe fence
                    Ok(Message::Idle) => return Some(frames::control("idle", json!({}))),
                    Ok(Message::Moved) if self.reader == Reader::Peer => {
                        self.done = true;
                        return Some(frames::control("moved", json!({})));
                    }
                    Ok(Message::Moved) => continue,
                    Ok(Message::Reconnect) => {
                        self.done = true;
                        return Some(frames::control("reconnect", json!({})));
                    }
                    Err(RecvError::Lagged(missed)) => {
                        self.done = true;
                        self.metrics.observer_cut();
                        let last = self.last.map(|id| id.to_string());
                        let data = json!({ "missed": missed, "last_event_id": last, "hint": "reconnect with Last-Event-ID" });
                        return Some(frames::control("overflow", data));
                    }
                    Err(RecvError::Closed) => return None,
                }
            }
        }
    }
}

impl Reading {
    /// The next event of the replay (journal, then memory), or a notice about it; `None`
    /// once it is all sent.
    async fn replayed(&mut self) -> Option<Bytes> {
        loop {
            if let Some(event) = self.backlog.pop_front() {
                self.last = Some(event.id);
                return Some(event.frame);
            }
            if let Some(fill) = self.fill.take() {
                match self.read_journal(fill).await {
                    Some(notice) => return Some(notice),
                    None => continue,
                }
            }
            let event = self.replay.pop_front()?;
            // The stream's fence (memory starts where the journal read stopped).
            if self.last.is_none_or(|last| event.id > last) {
                self.last = Some(event.id);
                return Some(event.frame);
            }
        }
    }

    /// Take the replay from memory, and plan the journal read for what memory lacks.
    fn start_replay(&mut self, replay: Replay) {
        self.replay = replay.events.into();
        let until = match replay.gap {
            Gap::None => return,
            Gap::Before(first) => Some(first),
            Gap::ToEnd => None,
        };
        // A follower with nothing yet asks the owner for its buffer (`0-0`), not for the
        // session's whole history: its own readers fill in from the journal themselves.
        if self.reader == Reader::Peer && self.after.is_some_and(|after| after.epoch == Epoch(0)) {
            return;
        }
        if self.after.is_some() {
            self.fill = Some(Fill { until, read: 0 });
        }
    }

    /// Read the next page of the journal into `backlog`. A frame to send instead when the
    /// read stops short: `overflow` (and the stream closes) past [`JOURNAL_REPLAY_MAX`],
    /// `missed` (and memory, then live, follow) when the store cannot be read.
    async fn read_journal(&mut self, fill: Fill) -> Option<Bytes> {
        let after = self.last.or(self.after)?;
        let budget = JOURNAL_REPLAY_MAX.saturating_sub(fill.read);
        // At the budget, one more row says whether anything is left before memory.
        let limit = budget.clamp(1, JOURNAL_PAGE);
        let events = match self.ownership.events_after(&self.key, Some(after), limit as i64).await {
            Ok(events) => events,
            Err(e) => {
                tracing::warn!(key = %self.key, error = %e, "journal replay unavailable; serving memory");
                let until = fill.until.map(|id| id.to_string());
                let data = json!({
                    "missed": between(Some(after), fill.until),
                    "last_event_id": after.to_string(),
                    "next_event_id": until,
                    "reason": "store_unavailable",
                    "hint": "reconnect with Last-Event-ID later to get them",
                });
                return Some(frames::control("missed", data));
            }
        };
        let rows = events.len();
        let wanted: Vec<Event> = events
            .into_iter()
            .take_while(|e| fill.before_until(e.id))
            .map(|e| Event::new(e.id, &e.kind, &e.data))
            .collect();
        let reached = wanted.len() < rows || rows < limit;
        if budget == 0 {
            if wanted.is_empty() {
                return None; // nothing was left before memory
            }
            self.done = true;
            let data = json!({
                "missed": between(Some(after), fill.until),
                "last_event_id": after.to_string(),
                "hint": "reconnect with Last-Event-ID",
            });
            return Some(frames::control("overflow", data));
        }
        self.backlog.extend(wanted);
        if !reached {
            self.fill = Some(Fill { read: fill.read + rows, ..fill });
        }
        None
    }
}
