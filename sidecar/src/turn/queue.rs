//! One turn at a time per session (CONTRACT §9): the owner's per-session queue and the
//! multitask policy for a turn that arrives while another runs.
//!
//! `enqueue` waits in arrival order (a fair semaphore of one), at most `limit` waiting;
//! `reject` never waits; `interrupt` cancels the running turn and then waits for it to
//! be gone. The queue lives in this process's memory by design: when the owner dies, its
//! waiting turns' connections break and their clients get `502 owner_failed` from the
//! forwarding pod (or a reset), never silence; a keyed retry is safe. A session with
//! nothing running and nothing waiting has no entry.

use std::{
    collections::HashMap,
    str::FromStr,
    sync::{Arc, Mutex},
};

use leasehold_core::SessionKey;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use super::outcome::Outcome;

/// What happens to a turn that arrives while another of its session runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Multitask {
    /// Wait in arrival order behind it (bounded).
    #[default]
    Enqueue,
    /// Refuse at once: `409 busy`.
    Reject,
    /// Cancel the running turn (its client gets `409 interrupted`), then run.
    Interrupt,
}

impl Multitask {
    pub fn as_str(self) -> &'static str {
        match self {
            Multitask::Enqueue => "enqueue",
            Multitask::Reject => "reject",
            Multitask::Interrupt => "interrupt",
        }
    }
}

impl FromStr for Multitask {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "enqueue" => Ok(Multitask::Enqueue),
            "reject" => Ok(Multitask::Reject),
            "interrupt" => Ok(Multitask::Interrupt),
            other => Err(format!("{other:?} is not one of enqueue, reject, interrupt")),
        }
    }
}

/// A turn being dispatched at the owner.
#[derive(Debug, Clone)]
pub struct Running {
    pub turn_id: String,
    /// The request digest, for a repeat of its idempotency key.
    pub digest: Vec<u8>,
    /// Cancels it (interrupt, `DELETE …/turns/{id}`).
    pub cancel: CancellationToken,
    /// Its outcome once settled: attached repeats wait on it.
    pub outcome: watch::Receiver<Option<Outcome>>,
}

/// Why a turn was not queued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotQueued {
    /// `limit` turns already wait: `503 queue_full`.
    Full,
    /// `reject`: the running turn's id (empty if it is between turns).
    Busy { running: String },
}

#[derive(Debug)]
struct Slot {
    turn: Arc<Semaphore>,
    /// Turns waiting for the slot (changed under the queue's lock).
    waiting: usize,
    running: Option<Running>,
}

impl Slot {
    fn new() -> Self {
        Slot { turn: Arc::new(Semaphore::new(1)), waiting: 0, running: None }
    }
}

/// The queues of the sessions this node owns.
#[derive(Debug)]
pub struct TurnQueue {
    slots: Mutex<HashMap<SessionKey, Slot>>,
    /// Turns that may wait per session.
    limit: usize,
}

/// The right to dispatch one turn of a session. Dropping it lets the next one in.
#[derive(Debug)]
pub struct Place {
    queue: Arc<TurnQueue>,
    key: SessionKey,
    permit: Option<OwnedSemaphorePermit>,
}

impl TurnQueue {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(TurnQueue { slots: Mutex::default(), limit })
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<SessionKey, Slot>> {
        self.slots.lock().expect("turn queue lock")
    }

    /// Wait for the session's turn under `policy`.
    pub async fn enter(self: &Arc<Self>, key: &SessionKey, policy: Multitask) -> Result<Place, NotQueued> {
        let semaphore = {
            let mut slots = self.slots();
            let slot = slots.entry(key.clone()).or_insert_with(Slot::new);
            if let Ok(permit) = slot.turn.clone().try_acquire_owned() {
                return Ok(self.place(key, permit));
            }
            match policy {
                Multitask::Reject => {
                    let running = slot.running.as_ref().map(|r| r.turn_id.clone()).unwrap_or_default();
                    return Err(NotQueued::Busy { running });
                }
                _ if slot.waiting >= self.limit => return Err(NotQueued::Full),
                Multitask::Interrupt => {
                    if let Some(running) = &slot.running {
                        running.cancel.cancel();
                    }
                }
                Multitask::Enqueue => {}
            }
            slot.waiting += 1;
            slot.turn.clone()
        };
        // Counted as waiting until it gets in (or its caller gives up: the guard uncounts).
        let waiting = Waiting { queue: self.clone(), key: key.clone() };
        let permit = semaphore.acquire_owned().await.expect("the slot's semaphore is never closed");
        drop(waiting);
        Ok(self.place(key, permit))
    }

    fn place(self: &Arc<Self>, key: &SessionKey, permit: OwnedSemaphorePermit) -> Place {
        Place { queue: self.clone(), key: key.clone(), permit: Some(permit) }
    }

    /// The turn running for `key`, if any.
    pub fn running(&self, key: &SessionKey) -> Option<Running> {
        self.slots().get(key).and_then(|slot| slot.running.clone())
    }

    /// The id of the turn running for `key` (events the agent publishes belong to it).
    pub fn running_turn_id(&self, key: &SessionKey) -> Option<String> {
        self.slots().get(key).and_then(|slot| slot.running.as_ref().map(|r| r.turn_id.clone()))
    }

    /// Sessions with a queue entry (running or waiting): what this map holds.
    pub fn len(&self) -> usize {
        self.slots().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forget `key`'s entry if nothing runs or waits (the caller just let go).
    fn prune(&self, key: &SessionKey) {
        let mut slots = self.slots();
        if let Some(slot) = slots.get(key) {
            if slot.waiting == 0 && slot.running.is_none() && slot.turn.available_permits() == 1 {
                slots.remove(key);
            }
        }
    }
}

/// A waiting turn, uncounted when it gets in or its caller goes away.
struct Waiting {
    queue: Arc<TurnQueue>,
    key: SessionKey,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(slot) = self.queue.slots().get_mut(&self.key) {
            slot.waiting = slot.waiting.saturating_sub(1);
        }
    }
}

impl Place {
    /// This turn is now dispatched: repeats attach to it, interrupts cancel it.
    pub fn start(&self, running: Running) {
        if let Some(slot) = self.queue.slots().get_mut(&self.key) {
            slot.running = Some(running);
        }
    }

    /// Dispatched turn done (its outcome is in its watch).
    pub fn finish(&self) {
        if let Some(slot) = self.queue.slots().get_mut(&self.key) {
            slot.running = None;
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.finish();
        drop(self.permit.take());
        self.queue.prune(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn key() -> SessionKey {
        SessionKey::parse("s").unwrap()
    }

    fn running(id: &str) -> (Running, CancellationToken) {
        let cancel = CancellationToken::new();
        let (_tx, outcome) = watch::channel(None);
        (Running { turn_id: id.to_owned(), digest: Vec::new(), cancel: cancel.clone(), outcome }, cancel)
    }

    #[tokio::test]
    async fn turns_get_in_one_at_a_time_in_arrival_order() {
        let queue = TurnQueue::new(16);
        let first = queue.enter(&key(), Multitask::Enqueue).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for n in 0..5 {
            let (entering, order) = (queue.clone(), order.clone());
            waiters.push(tokio::spawn(async move {
                let place = entering.enter(&key(), Multitask::Enqueue).await.unwrap();
                order.lock().unwrap().push(n);
                tokio::task::yield_now().await;
                drop(place);
            }));
            // Each waiter is queued before the next is spawned.
            while queue.slots().get(&key()).unwrap().waiting < n + 1 {
                tokio::task::yield_now().await;
            }
        }
        assert!(order.lock().unwrap().is_empty(), "nobody gets in while the first runs");
        drop(first);
        for waiter in waiters {
            waiter.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 4]);
        assert!(queue.is_empty(), "an idle session keeps no entry");
    }

    #[tokio::test]
    async fn above_the_limit_a_turn_is_refused_not_queued() {
        let queue = TurnQueue::new(1);
        let _first = queue.enter(&key(), Multitask::Enqueue).await.unwrap();
        let waiter = tokio::spawn({
            let queue = queue.clone();
            async move { queue.enter(&key(), Multitask::Enqueue).await.map(drop) }
        });
        while queue.slots().get(&key()).unwrap().waiting < 1 {
            tokio::task::yield_now().await;
        }
        assert_eq!(queue.enter(&key(), Multitask::Enqueue).await.unwrap_err(), NotQueued::Full);
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(queue.slots().get(&key()).unwrap().waiting, 0, "a caller that went away is uncounted");
    }

    #[tokio::test]
    async fn reject_names_the_running_turn_and_interrupt_cancels_it() {
        let queue = TurnQueue::new(16);
        let first = queue.enter(&key(), Multitask::Enqueue).await.unwrap();
        let (run, cancel) = running("t1");
        first.start(run);
        assert_eq!(queue.running_turn_id(&key()).as_deref(), Some("t1"));
        let busy = queue.enter(&key(), Multitask::Reject).await.unwrap_err();
        assert_eq!(busy, NotQueued::Busy { running: "t1".to_owned() });
        assert!(!cancel.is_cancelled());
        let interrupter = tokio::spawn({
            let queue = queue.clone();
            async move { queue.enter(&key(), Multitask::Interrupt).await.map(drop) }
        });
        tokio::time::timeout(Duration::from_secs(5), cancel.cancelled()).await.expect("interrupt cancels");
        drop(first);
        interrupter.await.unwrap().unwrap();
        assert_eq!(queue.running_turn_id(&key()), None);
    }
}
