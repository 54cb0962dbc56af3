//! Reading a session's events: `/stream` observers on any node and the owner's side of a
//! follower's upstream. Replay first, then live; never an id at or below one already
//! delivered.

use std::{collections::VecDeque, sync::Arc, time::Duration};

use bytes::Bytes;
use futures_util::Stream;
use leasehold_core::{EventId, SessionKey};
use serde_json::json;
use tokio::sync::{broadcast::error::RecvError, watch};

use super::{sse as frames, Event, Follow, Hubs, Message, Subscription};
use crate::{metrics::Metrics, ownership::Ownership};

/// A comment line this often keeps idle streams open through proxies and lets us notice
/// observers that went away.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

fn keep_alive() -> tokio::time::Interval {
    let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + KEEP_ALIVE, KEEP_ALIVE);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval
}

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
        Reading {
            key,
            replay: std::mem::take(&mut sub.replay).into(),
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
        }
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
    replay: VecDeque<Event>,
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
        if self.done {
            return None;
        }
        if let Some(event) = self.replay.pop_front() {
            self.last = Some(event.id);
            return Some(event.frame);
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
                    self.replay = self.hubs.replay(&self.key, self.after).into();
                    if let Some(event) = self.replay.pop_front() {
                        self.last = Some(event.id);
                        return Some(event.frame);
                    }
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
