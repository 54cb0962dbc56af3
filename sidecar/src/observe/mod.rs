//! Observe from anywhere (CONTRACT §3 `/stream`).
//!
//! Every node keeps a hub per observed session: a bounded buffer of recent events for
//! replay and a broadcast to local observers. On the owner, the agent's publishes feed the
//! hub. On any other node with observers, ONE follower task per session resolves the owner
//! and holds a single upstream stream from the owner's peer port, feeding the local hub,
//! so N observers on a node cost one upstream. Ownership changes (LISTEN/NOTIFY) move the
//! follower to the new owner; ids only grow, so a stale epoch is never delivered.

mod follow;
pub mod sse;
mod stream;

use std::{
    collections::{HashMap, VecDeque},
    sync::Mutex,
};

use leasehold_core::{Epoch, EventId, SessionKey};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{broadcast, watch};

pub use self::{
    follow::Follow,
    stream::{NotOpened, Observe, Reading, StreamLimits, JOURNAL_PAGE, JOURNAL_REPLAY_MAX},
};

/// Events kept per session for late joiners: the current turn and a tail before it...
pub const REPLAY_CAPACITY: usize = 1024;
/// ...and at most this many bytes of them (encoded frames), so a session of large events
/// cannot hold more than this.
pub const REPLAY_BYTES: usize = 1024 * 1024;
/// Messages a slow observer may lag behind before it is cut (it can reconnect with
/// `Last-Event-ID` and catch up from the replay buffer).
pub const OBSERVER_CAPACITY: usize = 1024;

/// The event type that opens a turn: replay without `Last-Event-ID` starts there.
pub const TURN_STARTED: &str = "turn_started";

/// One published event. Its SSE frame is encoded once, here, and shared by every
/// observer (fan-out copies a pointer, not the text); the frame is all that is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub id: EventId,
    /// Whether this event opens a turn (`turn_started`): replay without `Last-Event-ID`
    /// starts at the last one.
    pub opens_turn: bool,
    pub frame: bytes::Bytes,
}

impl Event {
    /// `data` is JSON text.
    pub fn new(id: EventId, kind: &str, data: &str) -> Self {
        Event { id, opens_turn: kind == TURN_STARTED, frame: sse::encode(Some(id), kind, data) }
    }
}

/// What a hub broadcasts to its observers.
#[derive(Debug, Clone)]
pub enum Message {
    Event(Event),
    /// No live owner right now; the stream stays open.
    Idle,
    /// This node no longer owns the session: peer streams end (their follower
    /// re-resolves); public observers keep going.
    Moved,
    /// This node is draining: every stream says `reconnect` and closes.
    Reconnect,
    /// The hub now holds what the owner had buffered: observers that joined before
    /// can compute their replay.
    Primed,
}

#[derive(Debug)]
struct Hub {
    /// The newest event delivered, or the floor an ended epoch left (nothing more of it
    /// is taken from a stream).
    last: Option<EventId>,
    /// The newest event delivered.
    seen: Option<EventId>,
    /// The last id given to an event of our agent not yet delivered (it is journaled
    /// first): ids are handed out in publish order, delivered in the same order.
    allocated: Option<EventId>,
    recent: VecDeque<Event>,
    /// Bytes of the frames in `recent`.
    recent_bytes: usize,
    /// The broadcast to this node's readers, made when the first one subscribes: a hub
    /// nobody reads (most sessions, on their owner) keeps no channel buffer.
    tx: Option<broadcast::Sender<Message>>,
    /// Bumped on every ownership change that concerns this session.
    changed: watch::Sender<u64>,
    /// Public observers on this node (peer streams are not counted: they do not keep a
    /// follower alive).
    observers: usize,
    following: bool,
    idle: bool,
    /// Holds the owner's buffer (we are the owner, or the upstream backfill arrived, or
    /// there is no owner to backfill from).
    primed: bool,
}

impl Hub {
    fn new() -> Self {
        Hub {
            last: None,
            seen: None,
            allocated: None,
            recent: VecDeque::new(),
            recent_bytes: 0,
            tx: None,
            changed: watch::Sender::new(0),
            observers: 0,
            following: false,
            idle: false,
            primed: false,
        }
    }

    /// Send to this node's readers, if any (nobody listening is fine).
    fn send(&self, message: Message) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(message);
        }
    }

    fn subscribe(&mut self) -> broadcast::Receiver<Message> {
        self.tx.get_or_insert_with(|| broadcast::channel(OBSERVER_CAPACITY).0).subscribe()
    }

    fn mark_primed(&mut self) {
        if !std::mem::replace(&mut self.primed, true) {
            self.send(Message::Primed);
        }
    }

    /// Add an event if it is newer than everything so far (the observe-path fence).
    fn push(&mut self, event: Event) -> bool {
        if self.last.is_some_and(|last| event.id <= last) {
            return false;
        }
        self.append(event);
        true
    }

    /// Add an event read from the journal if it is newer than everything delivered: it
    /// landed under the fence, so an ended epoch's floor does not hold it back.
    fn push_journaled(&mut self, event: Event) -> bool {
        if self.seen.is_some_and(|seen| event.id <= seen) {
            return false;
        }
        self.append(event);
        true
    }

    fn append(&mut self, event: Event) {
        self.last = self.last.max(Some(event.id));
        self.seen = Some(event.id);
        self.idle = false;
        self.recent_bytes += event.frame.len();
        self.recent.push_back(event.clone());
        while self.recent.len() > REPLAY_CAPACITY
            || (self.recent_bytes > REPLAY_BYTES && self.recent.len() > 1)
        {
            let dropped = self.recent.pop_front().expect("not empty");
            self.recent_bytes -= dropped.frame.len();
        }
        self.send(Message::Event(event));
    }

    /// What a new subscriber gets before the live stream, from memory, and what memory
    /// may lack (CONTRACT §9: the journal fills that in).
    fn replay(&self, after: Option<EventId>) -> Replay {
        let Some(after) = after else {
            let start = self.recent.iter().rposition(|e| e.opens_turn).unwrap_or(0);
            return Replay { events: self.recent.iter().skip(start).cloned().collect(), gap: Gap::None };
        };
        // Only the newest run of consecutive ids is known to be whole: before an epoch
        // boundary (or a hole an outage left) the journal may hold events we never got.
        let oldest = self.recent.get(whole_run_start(&self.recent)).map(|e| e.id);
        let gap = match memory_covers(oldest, after) {
            true => Gap::None,
            false => oldest.map_or(Gap::ToEnd, Gap::Before),
        };
        // All of memory after `after`: a reader that gets the journal's part first skips
        // what it already has; one that cannot read the journal gets at least this.
        Replay { events: self.recent.iter().filter(|e| e.id > after).cloned().collect(), gap }
    }
}

/// Whether `next` is the id right after `id` (same epoch, next seq).
fn follows(id: EventId, next: EventId) -> bool {
    next.epoch == id.epoch && id.seq.checked_add(1) == Some(next.seq)
}

/// Whether memory whose oldest buffered event (of a run of consecutive ids reaching the
/// newest) is `oldest` holds every event after `after`: `after` is at or after `oldest`,
/// or `oldest` is the very next id. Anything else (nothing buffered, a later seq, a later
/// epoch: the earlier epoch may have gone on past `after`) may miss events.
pub fn memory_covers(oldest: Option<EventId>, after: EventId) -> bool {
    oldest.is_some_and(|oldest| after >= oldest || follows(after, oldest))
}

/// Where the newest run of consecutive ids in `recent` starts (0 when empty).
fn whole_run_start(recent: &VecDeque<Event>) -> usize {
    let mut start = recent.len().saturating_sub(1);
    while start > 0 && follows(recent[start - 1].id, recent[start].id) {
        start -= 1;
    }
    start
}

/// What memory may lack of what a reader asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gap {
    /// Memory holds everything asked for.
    None,
    /// The journal may hold events after the reader's id and before this one (the oldest
    /// in the replay).
    Before(EventId),
    /// Memory holds nothing after the reader's id: the journal has whatever there is.
    ToEnd,
}

/// A replay from memory.
#[derive(Debug, Clone)]
pub struct Replay {
    pub events: Vec<Event>,
    pub gap: Gap,
}

/// A live subscription: the replay, then the broadcast.
#[derive(Debug)]
pub struct Subscription {
    pub replay: Replay,
    pub live: broadcast::Receiver<Message>,
    pub idle: bool,
    /// False: wait for `Message::Primed`, then take the replay with `Hubs::replay`.
    pub primed: bool,
}

/// The hubs of this node. A hub lives while its session is owned here or observed here;
/// a session released, moved or no longer observed takes its hub (and its replay buffer)
/// with it.
#[derive(Debug, Default)]
pub struct Hubs {
    hubs: Mutex<HashMap<SessionKey, Hub>>,
    observers: std::sync::atomic::AtomicUsize,
    /// How many hubs exist (`leasehold_hubs`).
    count: Gauge,
}

impl Hubs {
    /// Hubs that keep `count` at their number.
    pub fn counted(count: Gauge) -> Self {
        Hubs { count, ..Hubs::default() }
    }

    fn with<T>(&self, key: &SessionKey, f: impl FnOnce(&mut Hub) -> T) -> T {
        let mut hubs = self.hubs.lock().expect("hubs lock");
        let hub = match hubs.contains_key(key) {
            true => hubs.get_mut(key).expect("checked"),
            false => {
                self.count.set(i64::try_from(hubs.len() + 1).unwrap_or(i64::MAX));
                hubs.entry(key.clone()).or_insert_with(Hub::new)
            }
        };
        f(hub)
    }

    /// Drop `key`'s hub (under the caller's lock) and count.
    fn remove(&self, hubs: &mut HashMap<SessionKey, Hub>, key: &SessionKey) {
        hubs.remove(key);
        self.count.set(i64::try_from(hubs.len()).unwrap_or(i64::MAX));
    }

    /// How many hubs this node holds.
    pub fn len(&self) -> usize {
        self.hubs.lock().expect("hubs lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number an event our agent published at `epoch`: the next id of that epoch after
    /// everything numbered or delivered so far. It is delivered (after the journal took
    /// it) with [`Hubs::deliver`], in the same order.
    pub fn allocate(&self, key: &SessionKey, epoch: Epoch) -> EventId {
        self.with(key, |hub| {
            let seq = match hub.allocated.max(hub.last) {
                Some(last) if last.epoch == epoch => last.seq + 1,
                _ => 1,
            };
            let id = EventId { epoch, seq };
            hub.allocated = Some(id);
            id
        })
    }

    /// Fan out an event of our agent, numbered by [`Hubs::allocate`] and journaled.
    pub fn deliver(&self, key: &SessionKey, event: Event) -> bool {
        self.with(key, |hub| {
            hub.mark_primed();
            hub.push(event)
        })
    }

    /// Number and fan out at once (an event that needs no journal: tests, benches).
    pub fn publish(&self, key: &SessionKey, epoch: Epoch, kind: &str, data: &str) -> EventId {
        let id = self.allocate(key, epoch);
        self.deliver(key, Event::new(id, kind, data));
        id
    }

    /// An event relayed from the owner; dropped if not newer than what we have.
    pub fn ingest(&self, key: &SessionKey, event: Event) -> bool {
        self.with(key, |hub| hub.push(event))
    }

    /// An event read from the journal; dropped if not newer than what was delivered.
    pub fn ingest_journaled(&self, key: &SessionKey, event: Event) -> bool {
        self.with(key, |hub| hub.push_journaled(event))
    }

    /// The newest event this node delivered of `key`, if it has a hub for it.
    pub(crate) fn last_delivered(&self, key: &SessionKey) -> Option<EventId> {
        self.hubs.lock().expect("hubs lock").get(key).and_then(|h| h.seen)
    }

    /// Subscribe: replay after `after` (or the current turn so far), then live. Both
    /// taken under one lock, so nothing falls between them.
    pub fn subscribe(&self, key: &SessionKey, after: Option<EventId>) -> Subscription {
        self.with(key, |hub| Subscription {
            replay: if hub.primed {
                hub.replay(after)
            } else {
                Replay { events: Vec::new(), gap: Gap::None }
            },
            live: hub.subscribe(),
            idle: hub.idle,
            primed: hub.primed,
        })
    }

    /// The replay for a subscriber that waited for the hub to be primed.
    pub fn replay(&self, key: &SessionKey, after: Option<EventId>) -> Replay {
        self.with(key, |hub| hub.replay(after))
    }

    /// The hub holds what there is to hold (see `Message::Primed`).
    pub(crate) fn mark_primed(&self, key: &SessionKey) {
        self.with(key, Hub::mark_primed);
    }

    /// Register a public observer within `limits`: `None` when the node or the session
    /// already has as many as allowed (nothing registered), else whether a follower must
    /// be started. Decided under the hubs' lock, so concurrent joins cannot overshoot.
    pub fn observer_joined(&self, key: &SessionKey, limits: StreamLimits) -> Option<bool> {
        use std::sync::atomic::Ordering::Relaxed;
        self.with(key, |hub| {
            if self.observers.load(Relaxed) >= limits.per_node || hub.observers >= limits.per_session {
                return None;
            }
            self.observers.fetch_add(1, Relaxed);
            hub.observers += 1;
            Some(!std::mem::replace(&mut hub.following, true))
        })
    }

    pub fn observer_left(&self, key: &SessionKey) {
        self.observers.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        let mut hubs = self.hubs.lock().expect("hubs lock");
        if let Some(hub) = hubs.get_mut(key) {
            hub.observers = hub.observers.saturating_sub(1);
            if hub.observers == 0 {
                hub.changed.send_modify(|n| *n += 1); // let the follower notice and stop
            }
        }
    }

    /// Public observers on this node, all sessions.
    pub fn observer_count(&self) -> usize {
        self.observers.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn observers_of(&self, key: &SessionKey) -> usize {
        self.hubs.lock().expect("hubs lock").get(key).map_or(0, |h| h.observers)
    }

    /// The follower is done: drop the hub if nothing else needs it. Returns false (and
    /// keeps following) if an observer joined meanwhile.
    pub(crate) fn follower_done(&self, key: &SessionKey, owned_here: bool) -> bool {
        let mut hubs = self.hubs.lock().expect("hubs lock");
        let Some(hub) = hubs.get_mut(key) else { return true };
        if hub.observers > 0 {
            return false;
        }
        hub.following = false;
        if !owned_here {
            self.remove(&mut hubs, key);
        }
        true
    }

    pub(crate) fn last_id(&self, key: &SessionKey) -> Option<EventId> {
        self.hubs.lock().expect("hubs lock").get(key).and_then(|h| h.last)
    }

    pub(crate) fn changes(&self, key: &SessionKey) -> watch::Receiver<u64> {
        self.with(key, |hub| hub.changed.subscribe())
    }

    /// Announce `idle` once per idle period (nothing to backfill either: primed).
    /// `ended` is the latest epoch granted, now not live: nothing of it or before may
    /// reach an observer any more (a later owner's backfill would otherwise deliver
    /// turns that ended before the observer came, as if live).
    pub(crate) fn set_idle(&self, key: &SessionKey, ended: Option<Epoch>) {
        self.with(key, |hub| {
            if let Some(epoch) = ended {
                let floor = EventId { epoch, seq: u64::MAX };
                hub.last = hub.last.max(Some(floor));
            }
            hub.mark_primed();
            if !std::mem::replace(&mut hub.idle, true) {
                hub.send(Message::Idle);
            }
        });
    }

    /// Ownership of `key` changed somewhere: wake its follower.
    pub fn changed(&self, key: &SessionKey) {
        if let Some(hub) = self.hubs.lock().expect("hubs lock").get(key) {
            hub.changed.send_modify(|n| *n += 1);
        }
    }

    /// Changes may have been missed (or a whole boot moved): wake every follower.
    pub fn changed_all(&self) {
        for hub in self.hubs.lock().expect("hubs lock").values() {
            hub.changed.send_modify(|n| *n += 1);
        }
    }

    /// We no longer own `key` (stood down, released): end peer streams served from here,
    /// wake our follower, and drop the hub if no local observer needs it.
    pub fn moved(&self, key: &SessionKey) {
        let mut hubs = self.hubs.lock().expect("hubs lock");
        if let Some(hub) = hubs.get(key) {
            hub.send(Message::Moved);
            hub.changed.send_modify(|n| *n += 1);
            if hub.observers == 0 && !hub.following {
                self.remove(&mut hubs, key);
            }
        }
    }

    /// After a drain's hand-back nothing is owned here: drop every hub no observer holds.
    pub fn forget_unobserved(&self) {
        let mut hubs = self.hubs.lock().expect("hubs lock");
        hubs.retain(|_, hub| hub.observers > 0 || hub.following);
        self.count.set(i64::try_from(hubs.len()).unwrap_or(i64::MAX));
    }

    /// Drain: every stream on this node says `reconnect` and closes.
    pub fn reconnect_all(&self) {
        for hub in self.hubs.lock().expect("hubs lock").values() {
            hub.send(Message::Reconnect);
            hub.changed.send_modify(|n| *n += 1);
        }
    }
}

#[cfg(test)]
mod tests;
