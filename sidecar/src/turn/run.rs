//! Running a turn at its owner (CONTRACT §9): the idempotency check, the session's queue,
//! the journal entry before the dispatch, the dispatch (a resume for a turn an earlier
//! owner left unfinished), the answer recorded before anyone sees it.
//!
//! Once queued, a turn runs in a task of its own: a client that goes away (a reload, a
//! proxy timeout) does not abort it; its answer is recorded all the same, for a repeat
//! of its key or `GET …/turns/{id}`. Cancelling is explicit.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http::HeaderValue;
use http_body_util::{BodyExt, Limited};
use leasehold_core::{
    store::{self, Answer, Begun, NewTurn, TurnRecord, TurnState},
    SessionKey,
};
use serde_json::json;
use tokio::sync::{oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{
    agent::AgentClient,
    directive::Refusal,
    inflight::InFlightGuard,
    outcome::Outcome,
    queue::{Multitask, NotQueued, Place, Running, TurnQueue},
    Kind, Turn,
};
use crate::{
    metrics::Metrics,
    ownership::{LocalLease, Ownership, StandDownReason},
    publish::Publisher,
};

/// Events an earlier owner may have journaled and not fanned out: at most what its last
/// group commits held (a batch is bounded by `--journal-max-batch`).
const CATCH_UP_LIMIT: i64 = 10_000;

/// The event a new owner publishes before it re-dispatches an interrupted turn.
pub const TURN_RESUMED: &str = "turn_resumed";

/// How a turn ended before it settled: what its caller is told instead of an outcome.
#[derive(Debug)]
pub enum Early {
    /// The same idempotency key with another request: `422 idempotency_key_reused`.
    KeyReused,
    /// `reject` while another turn runs: `409 busy`.
    Busy { running: String },
    /// The turn was cancelled (`DELETE`) before this repeat came: `409 cancelled`.
    Cancelled,
}

/// What became of a turn at its owner.
#[derive(Debug)]
pub enum Ran {
    Settled(Outcome),
    Early(Early),
}

impl Ran {
    /// The outcome label of `leasehold_turns_total{path="local"}`.
    pub fn label(&self) -> std::borrow::Cow<'static, str> {
        match self {
            Ran::Settled(Outcome::Answered { answer, .. }) => {
                http::StatusCode::from_u16(answer.status).map_or("500".into(), crate::metrics::status_label)
            }
            Ran::Settled(Outcome::Interrupted) => "interrupted".into(),
            Ran::Settled(Outcome::Refused(refusal)) => refusal.code().into(),
            Ran::Settled(Outcome::OwnerFailed) => "owner_failed".into(),
            Ran::Early(Early::KeyReused) => "idempotency_key_reused".into(),
            Ran::Early(Early::Busy { .. }) => "busy".into(),
            Ran::Early(Early::Cancelled) => "cancelled".into(),
        }
    }
}

/// The owner's side of a turn.
#[derive(Debug)]
pub struct Runner {
    pub ownership: Arc<Ownership>,
    pub agent: AgentClient,
    pub publisher: Arc<Publisher>,
    pub queue: Arc<TurnQueue>,
    pub metrics: Arc<Metrics>,
    /// The cluster's policy for a turn that arrives while another runs.
    pub multitask: Multitask,
    /// Largest answer recorded; a larger one fails the turn (`502 answer_too_large`).
    pub max_answer: usize,
    /// Attempts a turn gets before it is recorded as failed (`502 attempts_exhausted`);
    /// 0: no limit.
    pub max_attempts: u32,
    pub ttl: Duration,
}

/// A request or a journaled turn, ready to dispatch.
#[derive(Debug, Clone)]
struct Dispatch {
    turn: Turn,
    /// Re-dispatched after an earlier owner lost it mid-turn.
    resume: bool,
    attempt: i32,
}

impl Dispatch {
    /// A journaled turn taken over at a new attempt: its own request, from the journal,
    /// dispatched as a resume.
    fn resume_of(key: &SessionKey, record: &TurnRecord) -> Self {
        let turn = Turn {
            kind: match record.kind {
                store::TurnKind::Event => Kind::Event,
                store::TurnKind::Turn => Kind::Turn,
            },
            key: key.clone(),
            id: record.turn_id.clone(),
            keyed: true,
            multitask: None,
            content_type: record.content_type.as_deref().and_then(|ct| HeaderValue::from_str(ct).ok()),
            // The client's headers are not journaled: a resumed turn reaches the agent
            // without them (documented in docs/http-api.md).
            client_headers: Vec::new(),
            body: Bytes::from(record.request.clone()),
        };
        Dispatch { turn, resume: true, attempt: record.attempts }
    }
}

impl Runner {
    /// Run `turn` here, where `lease` says we own its session. `guard` counts it in flight
    /// until it settles, whether or not the caller still waits.
    pub async fn run(self: &Arc<Self>, turn: Turn, lease: LocalLease, guard: InFlightGuard) -> Ran {
        if turn.keyed {
            if let Some(ran) = self.repeat(&turn).await {
                return ran;
            }
        }
        let (tx, rx) = oneshot::channel();
        let this = self.clone();
        tokio::spawn(
            async move {
                let ran = this.settle(turn, lease).await;
                drop(guard);
                let _ = tx.send(ran);
            }
            .in_current_span(),
        );
        rx.await.unwrap_or(Ran::Settled(Outcome::OwnerFailed))
    }

    /// A repeated key: attached to its attempt running here, or answered from the journal
    /// when it is finished. `None`: it must go through the queue (new, or interrupted).
    async fn repeat(&self, turn: &Turn) -> Option<Ran> {
        if let Some(running) = self.queue.running(&turn.key).filter(|r| r.turn_id == turn.id) {
            if running.digest != turn.digest() {
                return Some(self.early(Early::KeyReused));
            }
            self.metrics.turn_journal("attached");
            return Some(Ran::Settled(wait(running.outcome).await));
        }
        match self.ownership.get_turn(&turn.key, &turn.id).await {
            Ok(Some(record)) if record.state != TurnState::Running => Some(self.recorded(turn, record)),
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(key = %turn.key, error = %e, "journal read failed");
                Some(Ran::Settled(Outcome::Refused(Refusal::StoreUnavailable)))
            }
        }
    }

    fn early(&self, early: Early) -> Ran {
        self.metrics.turn_journal(match early {
            Early::KeyReused => "reused",
            Early::Busy { .. } => "busy",
            Early::Cancelled => "cancelled",
        });
        Ran::Early(early)
    }

    /// A journaled turn that is no longer running, for a repeat of its key.
    fn recorded(&self, turn: &Turn, record: TurnRecord) -> Ran {
        if record.digest != turn.digest() {
            return self.early(Early::KeyReused);
        }
        match (record.state, record.answer) {
            (TurnState::Finished, Some(answer)) => {
                self.metrics.turn_journal("replayed");
                Ran::Settled(Outcome::Answered {
                    answer: Arc::new(answer),
                    epoch: record.epoch,
                    replayed: true,
                })
            }
            _ => self.early(Early::Cancelled),
        }
    }

    /// Queue, journal, dispatch, record.
    async fn settle(self: &Arc<Self>, turn: Turn, lease: LocalLease) -> Ran {
        let place = match self.queue.enter(&turn.key, turn.policy(self.multitask)).await {
            Ok(place) => place,
            Err(NotQueued::Full) => return Ran::Settled(Outcome::Refused(Refusal::QueueFull)),
            Err(NotQueued::Busy { running }) => return self.early(Early::Busy { running }),
        };
        if lease.halt.is_cancelled() {
            return Ran::Settled(Outcome::Refused(Refusal::Fenced { ttl: self.ttl }));
        }
        if lease.unfinished_unchecked() {
            if let Err(outcome) = self.resume_unfinished(&place, &lease, Some(&turn.id)).await {
                return Ran::Settled(outcome);
            }
            lease.unfinished_were_checked();
        }
        let digest = turn.digest();
        let new = NewTurn {
            turn_id: &turn.id,
            kind: turn.kind.into(),
            content_type: turn.content_type(),
            body: &turn.body,
        };
        let begun = self.ownership.begin_turn(&lease, &new).instrument(tracing::info_span!("journal.begin"));
        match begun.await {
            Ok(Begun::Started) => {
                self.metrics.turn_journal("started");
                let dispatch = Dispatch { turn, resume: false, attempt: 1 };
                Ran::Settled(self.execute(&place, &lease, dispatch, digest).await)
            }
            Ok(Begun::Resumed(record)) if self.exhausted(&record) => {
                let outcome = self.give_up(&lease, &record).await;
                if record.digest == digest {
                    Ran::Settled(outcome)
                } else {
                    self.early(Early::KeyReused)
                }
            }
            Ok(Begun::Resumed(record)) if record.digest == digest => {
                self.metrics.turn_journal("resumed");
                let dispatch = Dispatch { turn, resume: true, attempt: record.attempts };
                Ran::Settled(self.execute(&place, &lease, dispatch, digest).await)
            }
            // The key names another request, which was running: it is taken over now, so
            // it runs (its own request, from the journal) before this one is refused.
            Ok(Begun::Resumed(record)) => {
                self.metrics.turn_journal("resumed");
                let dispatch = Dispatch::resume_of(&turn.key, &record);
                self.execute(&place, &lease, dispatch, record.digest.clone()).await;
                self.early(Early::KeyReused)
            }
            Ok(Begun::Existing(record)) => self.recorded(&turn, record),
            Err(e) => Ran::Settled(self.journal_failed(&lease, e)),
        }
    }

    /// Before the first turn of an epoch here: finish what an earlier owner left running
    /// (but `except`, which the caller is about to resume itself), oldest first, each a
    /// resume with no client waiting. `Err`: the session cannot be served now.
    async fn resume_unfinished(
        self: &Arc<Self>,
        place: &Place,
        lease: &LocalLease,
        except: Option<&str>,
    ) -> Result<(), Outcome> {
        self.catch_up_observers(lease).await;
        let unfinished =
            self.ownership.unfinished_turns(&lease.key).await.map_err(|e| self.journal_failed(lease, e))?;
        for record in
            unfinished.into_iter().filter(|r| Some(r.turn_id.as_str()) != except && r.epoch < lease.epoch)
        {
            let resumed = match self.ownership.resume_turn(lease, &record.turn_id).await {
                Ok(Some(resumed)) => resumed,
                Ok(None) => continue,
                Err(e) => return Err(self.journal_failed(lease, e)),
            };
            if self.exhausted(&resumed) {
                match self.give_up(lease, &resumed).await {
                    Outcome::Answered { .. } => continue,
                    other => return Err(other),
                }
            }
            self.metrics.turn_journal("resumed");
            tracing::info!(key = %lease.key, turn = %resumed.turn_id, attempt = resumed.attempts, "resuming an interrupted turn");
            let dispatch = Dispatch::resume_of(&lease.key, &resumed);
            match self.execute(place, lease, dispatch, resumed.digest.clone()).await {
                Outcome::Answered { .. } | Outcome::Interrupted => {}
                other => return Err(other),
            }
        }
        Ok(())
    }

    /// Before this epoch's first event: an earlier owner that died between journaling a
    /// batch of events and fanning it out left this node's live observers short of it
    /// (a follower re-subscribing elsewhere gets it from the journal; observers of the new
    /// owner's own hub would not). Read it from the journal and deliver it, in order.
    async fn catch_up_observers(&self, lease: &LocalLease) {
        let Some(after) = self.publisher.last_seen(&lease.key).filter(|id| id.epoch < lease.epoch) else {
            return;
        };
        match self.ownership.events_after(&lease.key, Some(after), CATCH_UP_LIMIT).await {
            Ok(events) => {
                let delivered = self.publisher.catch_up(&lease.key, lease.epoch, events);
                if delivered > 0 {
                    tracing::info!(key = %lease.key, delivered, "observers caught up on events the previous owner journaled but never sent");
                }
            }
            // They miss those events; a reconnect with Last-Event-ID gets them.
            Err(e) => {
                tracing::warn!(key = %lease.key, error = %e, "observers could not be caught up from the journal")
            }
        }
    }

    /// Resume the unfinished turns of a session claimed with no request waiting (the
    /// sweep for orphaned turns).
    pub async fn resume_orphaned(self: &Arc<Self>, lease: LocalLease, guard: InFlightGuard) {
        let Ok(place) = self.queue.enter(&lease.key, Multitask::Enqueue).await else { return };
        if lease.unfinished_unchecked() {
            match self.resume_unfinished(&place, &lease, None).await {
                Ok(()) => lease.unfinished_were_checked(),
                Err(outcome) => {
                    tracing::warn!(key = %lease.key, ?outcome, "an orphaned turn could not be resumed now")
                }
            }
        }
        drop(guard);
    }

    /// Taken over at an attempt beyond the last it may have.
    fn exhausted(&self, record: &TurnRecord) -> bool {
        self.max_attempts > 0
            && u32::try_from(record.attempts).is_ok_and(|attempts| attempts > self.max_attempts)
    }

    /// A turn whose every attempt was lost mid-turn (a poison turn: say, one that crashes
    /// its agent each time): record it as failed instead of dispatching it again, so it
    /// stops travelling from pod to pod; a repeat of its key gets this answer.
    async fn give_up(&self, lease: &LocalLease, record: &TurnRecord) -> Outcome {
        let tried = record.attempts - 1;
        tracing::warn!(key = %lease.key, turn = %record.turn_id, attempts = tried, "a turn lost mid-turn at every attempt: recorded as failed, not resumed again");
        let answer = attempts_exhausted(tried);
        match self.ownership.finish_turn(lease, &record.turn_id, &answer).await {
            Ok(()) => {
                self.metrics.turn_journal("exhausted");
                Outcome::Answered { answer: Arc::new(answer), epoch: lease.epoch, replayed: false }
            }
            Err(e) => self.journal_failed(lease, e),
        }
    }

    fn journal_failed(&self, lease: &LocalLease, e: store::Error) -> Outcome {
        match e {
            store::Error::Fenced { .. } => {
                self.ownership.stand_down(&lease.key, lease.epoch, StandDownReason::Fenced);
                Outcome::Refused(Refusal::Fenced { ttl: self.ttl })
            }
            // The journal row may be there (lost answer, timeout): then the turn runs
            // after all (resumed under its id), so `store_unavailable`'s "not run" would
            // be untrue. `fenced` says what is: it may run, under this id; the public door
            // follows it once, and a client re-sends as a repeat of that id.
            e if e.may_have_landed() => {
                tracing::warn!(key = %lease.key, error = %e, "journal write failed; it may have landed");
                Outcome::Refused(Refusal::Fenced { ttl: self.ttl })
            }
            e => {
                tracing::warn!(key = %lease.key, error = %e, "journal write failed");
                Outcome::Refused(Refusal::StoreUnavailable)
            }
        }
    }

    /// Dispatch a journaled turn and record its answer; runs with the session's place.
    async fn execute(
        &self,
        place: &Place,
        lease: &LocalLease,
        dispatch: Dispatch,
        digest: Vec<u8>,
    ) -> Outcome {
        let cancel = CancellationToken::new();
        let (done, outcome) = watch::channel(None);
        let turn_id = dispatch.turn.id.clone();
        place.start(Running { turn_id: turn_id.clone(), digest, cancel: cancel.clone(), outcome });
        if dispatch.resume {
            let data = json!({ "turn_id": turn_id, "attempt": dispatch.attempt }).to_string();
            self.publisher.publish(lease, Some(turn_id.clone()), TURN_RESUMED.to_owned(), data);
        }
        let settled = tokio::select! {
            settled = self.dispatch(lease, &dispatch) => settled,
            () = cancel.cancelled() => self.interrupted(lease, &dispatch.turn).await,
        };
        place.finish();
        done.send_replace(Some(settled.clone()));
        settled
    }

    /// The turn was cancelled (interrupt, `DELETE`): tell the agent, record it. If the
    /// cancel cannot be recorded, the journal still says running and a next owner would
    /// resume it: its client is told it may run (`owner_failed`), not that it stopped.
    async fn interrupted(&self, lease: &LocalLease, turn: &Turn) -> Outcome {
        if let Err(e) = self.agent.cancel(&turn.key, &turn.id).await {
            tracing::warn!(key = %turn.key, turn = %turn.id, error = %e, "the agent did not take the cancel");
        }
        match self.ownership.cancel_turn(lease, &turn.id).await {
            Ok(_) => {
                self.metrics.turn_journal("interrupted");
                Outcome::Interrupted
            }
            Err(e) => {
                tracing::warn!(key = %turn.key, turn = %turn.id, error = %e, "recording the cancel failed");
                Outcome::OwnerFailed
            }
        }
    }

    /// A turn halted because ownership moved (or may have): `fenced` (the next owner
    /// resumes it) if nothing of it was written; if a checkpoint was sent meanwhile it may
    /// be in the history already, so `owner_failed` instead of a directive that could run
    /// it twice for a client without a key.
    fn halted(&self, lease: &LocalLease, landed_before: u64) -> Outcome {
        if lease.landed.load(std::sync::atomic::Ordering::SeqCst) == landed_before {
            return Outcome::Refused(Refusal::Fenced { ttl: self.ttl });
        }
        tracing::warn!(key = %lease.key, epoch = %lease.epoch, "turn halted after a checkpoint was sent: it may have landed");
        Outcome::OwnerFailed
    }

    /// Our agent failed the turn without an answer: hand the session back, so the next
    /// owner (another pod's agent, or ours once it is back) resumes it.
    async fn hand_back(&self, lease: &LocalLease) {
        if let Err(e) = self.ownership.release(&lease.key, lease.epoch).await {
            tracing::warn!(key = %lease.key, error = %e, "hand-back after an agent failure failed");
        }
    }

    async fn dispatch(&self, lease: &LocalLease, dispatch: &Dispatch) -> Outcome {
        let landed = lease.landed.load(std::sync::atomic::Ordering::SeqCst);
        let turn = &dispatch.turn;
        let response = tokio::select! {
            response = self.agent.dispatch(turn, lease.epoch, dispatch.resume) => response,
            () = lease.halt.cancelled() => return self.halted(lease, landed),
        };
        let response = match response {
            Err(e) if e.is_connect() => {
                tracing::warn!(key = %turn.key, "agent refused the connection: handing the session back");
                self.hand_back(lease).await;
                return Outcome::Refused(Refusal::AgentUnavailable);
            }
            Err(e) => {
                tracing::warn!(key = %turn.key, error = %e, "agent failed mid-turn: handing the session back");
                self.hand_back(lease).await;
                return Outcome::OwnerFailed;
            }
            // The agent hit the fence: the next owner resumes the turn.
            Ok(r) if r.status() == http::StatusCode::CONFLICT => {
                self.ownership.stand_down(&turn.key, lease.epoch, StandDownReason::Fenced);
                return self.halted(lease, landed);
            }
            Ok(response) => response,
        };
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = tokio::select! {
            body = Limited::new(response.into_body(), self.max_answer).collect() => body,
            () = lease.halt.cancelled() => return self.halted(lease, landed),
        };
        let answer = match body {
            Ok(body) => Answer { status, content_type, body: body.to_bytes().to_vec() },
            Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
                too_large(self.max_answer)
            }
            Err(e) => {
                tracing::warn!(key = %turn.key, error = %e, "agent's answer broke off: handing the session back");
                self.hand_back(lease).await;
                return Outcome::OwnerFailed;
            }
        };
        // Everything the turn published is journaled before its answer is.
        if !self.publisher.flush(&lease.key, lease.epoch).await || lease.halt.is_cancelled() {
            return self.halted(lease, landed);
        }
        let finished = self
            .ownership
            .finish_turn(lease, &turn.id, &answer)
            .instrument(tracing::info_span!("journal.answer"));
        match finished.await {
            Ok(()) => Outcome::Answered { answer: Arc::new(answer), epoch: lease.epoch, replayed: false },
            Err(store::Error::Fenced { .. }) => {
                self.ownership.stand_down(&lease.key, lease.epoch, StandDownReason::Fenced);
                self.halted(lease, landed)
            }
            Err(e) => {
                // It ran; whether its answer is recorded is unknown.
                tracing::warn!(key = %turn.key, error = %e, "recording the answer failed");
                Outcome::OwnerFailed
            }
        }
    }
}

/// The answer recorded for an answer above the limit.
fn too_large(limit: usize) -> Answer {
    let body = json!({ "error": "answer_too_large", "message": format!("the agent's answer exceeded {limit} bytes") });
    Answer {
        status: 502,
        content_type: Some("application/json".to_owned()),
        body: body.to_string().into_bytes(),
    }
}

/// The answer recorded for a turn that used all its attempts.
fn attempts_exhausted(tried: i32) -> Answer {
    let message = format!(
        "the turn was lost mid-turn at each of its {tried} attempts (its agent failed or its pod died); it is not resumed again"
    );
    let body = json!({ "error": "attempts_exhausted", "message": message });
    Answer {
        status: 502,
        content_type: Some("application/json".to_owned()),
        body: body.to_string().into_bytes(),
    }
}

/// Wait for an attached turn's outcome.
async fn wait(mut outcome: watch::Receiver<Option<Outcome>>) -> Outcome {
    match outcome.wait_for(Option::is_some).await {
        Ok(settled) => settled.clone().expect("waited for Some"),
        Err(_) => Outcome::OwnerFailed,
    }
}

/// What `DELETE …/turns/{id}` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancelled {
    /// It is cancelled now (or already was).
    Cancelled,
    /// It had finished: its answer stands.
    Finished,
    /// No such turn in the journal (a turn still waiting in the queue is not journaled yet).
    NotFound,
}

/// A journaled turn as `GET …/turns/{id}` shows it.
#[derive(Debug, Clone)]
pub struct TurnStatus {
    pub record: TurnRecord,
    /// `running` at an epoch that is no longer live: the next owner resumes it.
    pub interrupted: bool,
}

impl Runner {
    /// Cancel a turn of a session we own at `lease`: the running attempt here is told to
    /// stop (its client gets `409 interrupted`); an interrupted one is marked cancelled
    /// so no owner resumes it.
    pub async fn cancel(&self, lease: &LocalLease, turn_id: &str) -> Result<Cancelled, Outcome> {
        if let Some(running) = self.queue.running(&lease.key).filter(|r| r.turn_id == turn_id) {
            running.cancel.cancel();
            return match wait(running.outcome).await {
                Outcome::Interrupted => Ok(Cancelled::Cancelled),
                // It finished before the cancel reached it: its answer stands.
                Outcome::Answered { .. } => Ok(Cancelled::Finished),
                other => Err(other),
            };
        }
        let record = match self.ownership.get_turn(&lease.key, turn_id).await {
            Ok(Some(record)) => record,
            Ok(None) => return Ok(Cancelled::NotFound),
            Err(e) => return Err(self.journal_failed(lease, e)),
        };
        match record.state {
            TurnState::Finished => Ok(Cancelled::Finished),
            TurnState::Cancelled => Ok(Cancelled::Cancelled),
            TurnState::Running => match self.ownership.cancel_turn(lease, turn_id).await {
                Ok(_) => {
                    self.metrics.turn_journal("cancelled");
                    Ok(Cancelled::Cancelled)
                }
                Err(e) => Err(self.journal_failed(lease, e)),
            },
        }
    }

    /// A turn as journaled, from any node (a read, never a claim).
    pub async fn status(&self, key: &SessionKey, turn_id: &str) -> Result<Option<TurnStatus>, store::Error> {
        let Some(record) = self.ownership.get_turn(key, turn_id).await? else { return Ok(None) };
        let interrupted = match record.state {
            TurnState::Running => {
                let lease = self.ownership.lookup(key).await?;
                lease.holder.is_none_or(|holder| holder.epoch != record.epoch)
            }
            _ => false,
        };
        Ok(Some(TurnStatus { record, interrupted }))
    }
}
