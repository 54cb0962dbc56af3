//! The demo agent's loop for one turn (CONTRACT §4a): thaw unless already held at this
//! epoch → publish `turn_started`, `token`s over `think_ms`, `turn_finished` → append to
//! history → checkpoint → answer. Any fenced write stops it at once.
//!
//! A resumed turn (`Leasehold-Resume`, its owner was lost mid-turn) reads what its earlier
//! attempts journaled and publishes only the rest: no second `turn_started`, the tokens
//! from the first index not yet journaled, `turn_finished` unless it was journaled. A
//! cancelled turn (`POST …/turns/{id}/cancel`) stops at once and publishes nothing more.

use std::{
    collections::{BTreeSet, HashMap, VecDeque},
    future::Future,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::sidecar::{JournalEvent, Sidecar, State, WriteError};

/// A turn's (or event's) body; every field optional.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Input {
    pub text: Option<String>,
    /// For events: the name recorded as `event:<name>`.
    pub name: Option<String>,
    pub think_ms: u64,
    pub tokens: Option<u32>,
}

/// Who a dispatched turn is: `Leasehold-Turn-Id` and `Leasehold-Resume`.
#[derive(Debug, Default, Clone)]
pub struct TurnIds {
    pub turn_id: Option<String>,
    /// Set when the turn is re-dispatched after its owner was lost mid-turn: the turn id.
    pub resume: Option<String>,
}

/// Tokens published when the body does not say.
const DEFAULT_TOKENS: u32 = 5;
/// Upper bound on `think_ms`, so one request cannot park a task for hours.
const MAX_THINK: Duration = Duration::from_secs(600);
/// How long a cancel waits for the turn to stop before it answers anyway.
/// Under the sidecar's 5 s limit on a cancel notification.
const CANCEL_WAIT: Duration = Duration::from_secs(3);
/// Cancels remembered for turns that had not arrived yet (the cancel overtook the turn).
const EARLY_CANCELS: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Turn,
    Event,
}

/// What the session holds in memory between turns.
#[derive(Debug, Default)]
struct Held {
    epoch: Option<i64>,
    state: State,
}

/// One session's slot: its turns run one at a time; a stand-down cancels `halt`.
#[derive(Debug, Default)]
struct Slot {
    held: tokio::sync::Mutex<Held>,
    halt: CancellationToken,
}

/// A turn between its arrival and its answer.
#[derive(Debug)]
struct Running {
    turn_id: Option<String>,
    /// Cancelled by `POST …/turns/{id}/cancel`.
    cancel: CancellationToken,
    /// Cancelled once the turn stopped (its answer is decided, it writes nothing more).
    done: CancellationToken,
}

/// Counters served at `GET /stats`; never reset.
#[derive(Debug, Default)]
pub struct Stats {
    /// Turns (and events) dispatched to this agent.
    pub turns: AtomicU64,
    /// Turns that arrived with `Leasehold-Resume`.
    pub resumes: AtomicU64,
    /// Cancels received (`POST …/turns/{id}/cancel`), whether or not the turn still ran
    /// here (the sidecar drops its request to the agent before it sends the cancel, which
    /// may already have ended the handler).
    pub cancels: AtomicU64,
    /// Turns that arrived while another turn of the same session was in flight here: the
    /// sidecar promises this never happens (CONTRACT §4), so anything but 0 is a bug.
    pub overlapping_turns: AtomicU64,
}

/// At most this many (session, epoch) pairs are kept for `GET /session-epochs`, so that
/// a long-lived demo agent's memory stays bounded; past it, new pairs are only counted.
const MAX_SESSION_EPOCHS: usize = 100_000;

/// The (session, epoch) pairs of the turns this agent was sent.
#[derive(Debug, Default)]
struct SessionEpochs {
    seen: BTreeSet<(String, i64)>,
    dropped: u64,
}

/// One (session, epoch) pair this agent was sent a turn (or event) at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionEpoch {
    pub session: String,
    pub epoch: i64,
}

/// `GET /session-epochs`: every (session, epoch) this agent was sent a turn at, since it
/// started. A sidecar sends turns only at an epoch it holds, so one pair seen by two
/// agents means two owners at one epoch (the randomized fault run checks this).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionEpochsView {
    pub pairs: Vec<SessionEpoch>,
    /// Pairs not kept because [`MAX_SESSION_EPOCHS`] were already.
    pub dropped: u64,
}

/// `GET /stats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsView {
    pub turns: u64,
    pub resumes: u64,
    pub cancels: u64,
    pub overlapping_turns: u64,
}

#[derive(Debug)]
pub struct Agent {
    pub sidecar: Sidecar,
    pub node_id: String,
    pub stats: Stats,
    sessions: Mutex<HashMap<String, Arc<Slot>>>,
    /// Turns in flight per session, kept apart from `sessions` so a stand-down (which
    /// forgets the slot) does not hide an overlap.
    running: Mutex<HashMap<String, Vec<Arc<Running>>>>,
    early_cancels: Mutex<VecDeque<(String, String)>>,
    session_epochs: Mutex<SessionEpochs>,
}

/// The answer of a successful turn.
#[derive(Debug, PartialEq, Eq)]
pub struct Done {
    pub history_len: usize,
    pub epoch: i64,
}

/// What stops a turn: a stand-down of its session (`halt`, answered as fenced) or a cancel
/// of the turn itself.
struct Stop<'a> {
    halt: &'a CancellationToken,
    cancel: &'a CancellationToken,
}

impl Stop<'_> {
    async fn guard<T>(&self, work: impl Future<Output = Result<T, WriteError>>) -> Result<T, WriteError> {
        tokio::select! {
            biased;
            _ = self.halt.cancelled() => Err(WriteError::Fenced),
            _ = self.cancel.cancelled() => Err(WriteError::Cancelled),
            result = work => result,
        }
    }
}

/// Deregisters a running turn when its handler ends, however it ends.
struct InFlight<'a> {
    agent: &'a Agent,
    key: &'a str,
    running: Arc<Running>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut running = self.agent.running.lock().expect("running lock");
        if let Some(list) = running.get_mut(self.key) {
            list.retain(|r| !Arc::ptr_eq(r, &self.running));
            if list.is_empty() {
                running.remove(self.key);
            }
        }
        drop(running);
        self.running.done.cancel();
    }
}

/// Where a resumed turn picks up, from its earlier attempts' journal.
#[derive(Debug, Default, PartialEq, Eq)]
struct Progress {
    /// The index of the first token not yet journaled.
    next_token: u32,
    finished: bool,
}

impl Progress {
    fn of(journal: &[JournalEvent]) -> Progress {
        let mut progress = Progress::default();
        let mut counted = 0u32;
        for event in journal {
            match event.kind.as_str() {
                "token" => {
                    counted += 1;
                    let i = event.data.get("i").and_then(serde_json::Value::as_u64);
                    if let Some(next) = i.and_then(|i| u32::try_from(i + 1).ok()) {
                        progress.next_token = progress.next_token.max(next);
                    }
                }
                "turn_finished" => progress.finished = true,
                _ => {}
            }
        }
        // Tokens journaled without an index (an older agent): count them.
        progress.next_token = progress.next_token.max(counted);
        progress
    }
}

impl Agent {
    pub fn new(sidecar: Sidecar, node_id: String) -> Self {
        Agent {
            sidecar,
            node_id,
            stats: Stats::default(),
            sessions: Mutex::new(HashMap::new()),
            running: Mutex::new(HashMap::new()),
            early_cancels: Mutex::new(VecDeque::new()),
            session_epochs: Mutex::new(SessionEpochs::default()),
        }
    }

    /// Write the turn's checkpoint. One the sidecar refused with a retry directive (`503
    /// store_unavailable`: the store did not answer) may still have landed: passing the
    /// directive on would tell the client the turn did not run, and its re-send without
    /// a key would run it twice (the randomized fault run's unkeyed clients saw it). So
    /// the same state is written again at the same epoch (landing twice is landing once)
    /// as the directive says, within its budget; only a refusal past it is passed on.
    /// A stand-down meanwhile answers `409`, which the sidecar reads as the fence.
    async fn write_checkpoint(&self, key: &str, epoch: i64, state: &State) -> Result<(), WriteError> {
        let started = tokio::time::Instant::now();
        loop {
            match self.sidecar.checkpoint(key, epoch, state).await {
                Err(WriteError::Refused { status, retry_after, body }) => {
                    let retry = serde_json::from_slice::<serde_json::Value>(&body).ok().and_then(|b| {
                        Some((b["retry"]["delay_ms"].as_u64()?, b["retry"]["budget_ms"].as_u64()?))
                    });
                    let again = retry
                        .map(|(delay, budget)| (Duration::from_millis(delay), Duration::from_millis(budget)));
                    match again {
                        Some((delay, budget)) if started.elapsed() + delay <= budget => {
                            tracing::warn!(
                                session = key,
                                epoch,
                                "checkpoint refused with a directive: writing it again"
                            );
                            tokio::time::sleep(delay).await;
                        }
                        _ => return Err(WriteError::Refused { status, retry_after, body }),
                    }
                }
                written => return written,
            }
        }
    }

    /// Every (session, epoch) this agent was sent a turn at (`GET /session-epochs`).
    pub fn session_epochs(&self) -> SessionEpochsView {
        let epochs = self.session_epochs.lock().expect("session epochs lock");
        let pairs = epochs
            .seen
            .iter()
            .map(|(session, epoch)| SessionEpoch { session: session.clone(), epoch: *epoch });
        SessionEpochsView { pairs: pairs.collect(), dropped: epochs.dropped }
    }

    fn saw_epoch(&self, key: &str, epoch: i64) {
        let mut epochs = self.session_epochs.lock().expect("session epochs lock");
        let pair = (key.to_owned(), epoch);
        if epochs.seen.contains(&pair) {
            return;
        }
        if epochs.seen.len() < MAX_SESSION_EPOCHS {
            epochs.seen.insert(pair);
        } else {
            epochs.dropped += 1;
        }
    }

    pub fn stats(&self) -> StatsView {
        StatsView {
            turns: self.stats.turns.load(Ordering::Relaxed),
            resumes: self.stats.resumes.load(Ordering::Relaxed),
            cancels: self.stats.cancels.load(Ordering::Relaxed),
            overlapping_turns: self.stats.overlapping_turns.load(Ordering::Relaxed),
        }
    }

    fn slot(&self, key: &str) -> Arc<Slot> {
        self.sessions.lock().expect("sessions lock").entry(key.to_owned()).or_default().clone()
    }

    /// Register an arriving turn; counts (and logs) an overlap with one already in flight.
    fn enter<'a>(&'a self, key: &'a str, turn_id: Option<&str>) -> InFlight<'a> {
        let running = Arc::new(Running {
            turn_id: turn_id.map(str::to_owned),
            cancel: CancellationToken::new(),
            done: CancellationToken::new(),
        });
        if let Some(id) = turn_id {
            let mut early = self.early_cancels.lock().expect("early cancels lock");
            if let Some(at) = early.iter().position(|(k, t)| k == key && t == id) {
                early.remove(at);
                running.cancel.cancel();
            }
        }
        let mut all = self.running.lock().expect("running lock");
        let list = all.entry(key.to_owned()).or_default();
        if !list.is_empty() {
            self.stats.overlapping_turns.fetch_add(1, Ordering::Relaxed);
            let others: Vec<_> = list.iter().map(|r| r.turn_id.as_deref().unwrap_or("-")).collect();
            tracing::error!(
                session = key,
                turn = turn_id.unwrap_or("-"),
                in_flight = ?others,
                "a second turn of this session arrived while one is in flight (the sidecar promises one at a time)"
            );
        }
        list.push(running.clone());
        InFlight { agent: self, key, running }
    }

    /// `POST /sessions/{key}/turns/{turn_id}/cancel`: stop that turn and wait (bounded)
    /// until it stopped, so nothing of it is published after the answer. A cancel for a
    /// turn not (yet) here is remembered, in case it overtook its turn. Returns whether
    /// the turn was running here.
    pub async fn cancel(&self, key: &str, turn_id: &str) -> bool {
        self.stats.cancels.fetch_add(1, Ordering::Relaxed);
        let found = {
            let all = self.running.lock().expect("running lock");
            all.get(key).and_then(|list| list.iter().find(|r| r.turn_id.as_deref() == Some(turn_id)).cloned())
        };
        let Some(running) = found else {
            let mut early = self.early_cancels.lock().expect("early cancels lock");
            if early.len() == EARLY_CANCELS {
                early.pop_front();
            }
            early.push_back((key.to_owned(), turn_id.to_owned()));
            return false;
        };
        running.cancel.cancel();
        if tokio::time::timeout(CANCEL_WAIT, running.done.cancelled()).await.is_err() {
            tracing::warn!(
                session = key,
                turn = turn_id,
                "the cancelled turn did not stop within {CANCEL_WAIT:?}"
            );
        }
        true
    }

    /// Drop a session: halt its in-flight turn and forget its state.
    pub fn stand_down(&self, key: &str) {
        if let Some(slot) = self.sessions.lock().expect("sessions lock").remove(key) {
            slot.halt.cancel();
        }
    }

    /// Forget a slot after a failed turn, unless a newer one replaced it already.
    fn forget(&self, key: &str, slot: &Arc<Slot>) {
        let mut sessions = self.sessions.lock().expect("sessions lock");
        if sessions.get(key).is_some_and(|s| Arc::ptr_eq(s, slot)) {
            sessions.remove(key);
        }
    }

    pub async fn run(
        &self,
        key: &str,
        epoch: i64,
        kind: Kind,
        ids: TurnIds,
        input: Input,
    ) -> Result<Done, WriteError> {
        self.stats.turns.fetch_add(1, Ordering::Relaxed);
        self.saw_epoch(key, epoch);
        if ids.resume.is_some() {
            self.stats.resumes.fetch_add(1, Ordering::Relaxed);
        }
        let in_flight = self.enter(key, ids.turn_id.as_deref().or(ids.resume.as_deref()));
        let slot = self.slot(key);
        let cancel = &in_flight.running.cancel;
        // One turn at a time per session, whatever the sidecar does; a turn cancelled
        // while it waits here never starts.
        let mut held = tokio::select! {
            biased;
            _ = cancel.cancelled() => return Err(WriteError::Cancelled),
            held = slot.held.lock() => held,
        };
        let stop = Stop { halt: &slot.halt, cancel };
        let result = self.run_held(key, epoch, kind, &ids, input, &stop, &mut held).await;
        match &result {
            // Nothing was checkpointed by a cancelled turn: what we hold is still the
            // session's state.
            Ok(_) | Err(WriteError::Cancelled) => {}
            Err(_) => {
                // Fenced or refused: what we hold may be stale; the next turn thaws again.
                *held = Held::default();
                drop(held);
                self.forget(key, &slot);
            }
        }
        drop(in_flight);
        result
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_held(
        &self,
        key: &str,
        epoch: i64,
        kind: Kind,
        ids: &TurnIds,
        input: Input,
        stop: &Stop<'_>,
        held: &mut Held,
    ) -> Result<Done, WriteError> {
        if held.epoch != Some(epoch) {
            held.state = stop.guard(self.sidecar.thaw(key)).await?;
            held.epoch = Some(epoch);
        }
        let progress = match &ids.resume {
            Some(turn_id) => Progress::of(&stop.guard(self.sidecar.journal(key, turn_id, epoch)).await?),
            None => Progress::default(),
        };
        let turn_id = ids.turn_id.as_ref().or(ids.resume.as_ref());
        let entry = match kind {
            Kind::Turn => input.text.clone().unwrap_or_default(),
            Kind::Event => format!("event:{}", input.name.as_deref().unwrap_or("event")),
        };
        // An earlier attempt that checkpointed this turn already (and died before its
        // answer was recorded): the history has its entry; answer without a second one.
        let checkpointed =
            ids.resume.is_some() && turn_id.is_some() && held.state.last_turn.as_ref() == turn_id;
        let publish = |kind: &'static str, data| stop.guard(self.sidecar.publish(key, epoch, kind, data));
        if ids.resume.is_none() {
            publish("turn_started", json!({ "text": entry, "node": self.node_id })).await?;
        }
        let tokens = input.tokens.unwrap_or(DEFAULT_TOKENS);
        let think = Duration::from_millis(input.think_ms).min(MAX_THINK);
        let pause = if tokens == 0 { think } else { think / tokens };
        for i in progress.next_token..tokens {
            stop.guard(async {
                tokio::time::sleep(pause).await;
                Ok(())
            })
            .await?;
            publish("token", json!({ "i": i, "text": format!("tok{i}") })).await?;
        }
        if tokens == 0 {
            stop.guard(async {
                tokio::time::sleep(pause).await;
                Ok(())
            })
            .await?;
        }
        let history_len = held.state.history.len() + usize::from(!checkpointed);
        if !progress.finished {
            publish("turn_finished", json!({ "history_len": history_len })).await?;
        }
        if !checkpointed {
            let mut next = held.state.clone();
            next.history.push(entry);
            next.last_turn = turn_id.cloned();
            stop.guard(self.write_checkpoint(key, epoch, &next)).await?;
            held.state = next;
        }
        Ok(Done { history_len: held.state.history.len(), epoch })
    }

    /// Release a session that has been idle (the sidecar stops renewing it).
    pub async fn release(&self, key: &str) -> Result<(), WriteError> {
        let slot = self.slot(key);
        let epoch = slot.held.lock().await.epoch;
        self.forget(key, &slot);
        match epoch {
            Some(epoch) => self.sidecar.release(key, epoch).await,
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::Progress;
    use crate::sidecar::JournalEvent;

    fn event(kind: &str, data: serde_json::Value) -> JournalEvent {
        JournalEvent { kind: kind.to_owned(), data }
    }

    #[test]
    fn progress_is_the_first_token_not_journaled() {
        assert_eq!(Progress::of(&[]), Progress { next_token: 0, finished: false });
        let journal = [
            event("turn_started", json!({})),
            event("token", json!({"i": 0})),
            event("token", json!({"i": 1})),
            // a second earlier attempt resumed at 2
            event("token", json!({"i": 2})),
        ];
        assert_eq!(Progress::of(&journal), Progress { next_token: 3, finished: false });
        let unindexed = [event("token", json!({"text": "a"})), event("token", json!({"text": "b"}))];
        assert_eq!(Progress::of(&unindexed).next_token, 2);
        let done = [event("token", json!({"i": 0})), event("turn_finished", json!({}))];
        assert_eq!(Progress::of(&done), Progress { next_token: 1, finished: true });
    }
}
