//! Routing a turn to its single owner (CONTRACT §3, §7): run it here when we own the
//! session, forward it one hop when another live owner does, refuse with a directive when
//! neither is possible now. No path runs a turn without a lease.

use std::{sync::Arc, time::Duration};

use http_body_util::BodyExt;

use leasehold_core::{directive::RefusalBody, headers, store::Holder, Epoch, Owner, SessionKey};
use tracing::Instrument;

use super::{
    agent::AgentClient,
    directive::Refusal,
    inflight::{InFlight, InFlightGuard},
    outcome::Outcome,
    run::{Cancelled, Early, Ran, Runner},
    Door, Turn,
};
use crate::{
    forward::{ForwardError, Forwarder},
    metrics::{status_label, Metrics},
    ownership::{LocalLease, Ownership, ResolveError, Route},
    upstream,
};

/// What happens to a turn.
#[derive(Debug)]
pub enum Reply {
    /// The turn ran (or settled otherwise) here, at its owner, `node`.
    Local { ran: Ran, node: Owner },
    /// The owner's sidecar answered a forwarded turn: pass it through.
    Forwarded(upstream::Response),
    /// Not now; the client may retry as the directive says.
    Refused(Refusal),
    /// It may have run remotely (or on our agent): `502 owner_failed`, never retried.
    OwnerFailed,
    /// The owner's sidecar refused with a directive: passed through as it is.
    PeerRefused(RefusalBody),
    /// The owner's sidecar did not accept our peer proof (`401`): nothing ran there, but
    /// a retry fails the same way until the pods agree on the secret (and their clocks):
    /// `502`, never retried, saying why.
    PeerRejected,
}

/// Why a forwarded turn was answered [`Reply::PeerRejected`] (logged, and told to the client).
pub const PEER_REJECTED: &str = "the owner's sidecar rejected this node's peer proof: the pods' cluster \
     secrets differ, or their clocks are apart by more than the proof window";

impl Reply {
    /// The turn was halted because ownership moved mid-turn, here or at the owner we
    /// forwarded it to.
    fn is_fenced(&self) -> bool {
        match self {
            Reply::Local { ran: Ran::Settled(Outcome::Refused(Refusal::Fenced { .. })), .. }
            | Reply::Refused(Refusal::Fenced { .. }) => true,
            Reply::PeerRefused(body) => body.error == Refusal::Fenced { ttl: Duration::ZERO }.code(),
            _ => false,
        }
    }

    /// A directive: nothing ran for this request (here or at the owner).
    fn is_refusal(&self) -> bool {
        match self {
            Reply::Local { ran: Ran::Settled(Outcome::Refused(_)), .. }
            | Reply::Refused(_)
            | Reply::PeerRefused(_) => true,
            Reply::Forwarded(response) => response.headers().contains_key(headers::REFUSAL),
            _ => false,
        }
    }

    /// For the turn-duration histogram: where the turn went (`local`, `forwarded`, or
    /// `none`: refused before either) and the class of its outcome (`answered`, `refused`:
    /// a directive or a client error, nothing ran; `failed`: it may have run, never
    /// retried; `interrupted`: halted or cancelled).
    fn classes(&self) -> (&'static str, &'static str) {
        match self {
            Reply::Local { ran, .. } => (
                "local",
                match ran {
                    Ran::Settled(Outcome::Answered { .. }) => "answered",
                    Ran::Settled(Outcome::Refused(_)) | Ran::Early(Early::KeyReused | Early::Busy { .. }) => {
                        "refused"
                    }
                    Ran::Settled(Outcome::OwnerFailed) => "failed",
                    Ran::Settled(Outcome::Interrupted) | Ran::Early(Early::Cancelled) => "interrupted",
                },
            ),
            Reply::Forwarded(response) if response.headers().contains_key(headers::REFUSAL) => {
                ("forwarded", "refused")
            }
            Reply::Forwarded(_) => ("forwarded", "answered"),
            Reply::PeerRefused(_) => ("forwarded", "refused"),
            Reply::OwnerFailed | Reply::PeerRejected => ("forwarded", "failed"),
            Reply::Refused(_) => ("none", "refused"),
        }
    }

    /// What a client is told of a [`Reply::PeerRejected`], the proof window included.
    pub fn peer_rejected_message() -> String {
        format!("{PEER_REJECTED} ({} s)", leasehold_core::proof::PROOF_WINDOW.as_secs())
    }
}

/// Peer refusals that mean "not here": nothing ran, the session may have moved (an owner
/// whose agent is down hands the session back).
const MOVED_CODES: [&str; 3] = ["draining", "owner_unreachable", "agent_unavailable"];

/// While a forwarded turn waits for its answer, the owner's lease is read again just
/// after it would lapse without a renewal; this much later, so a renewal in flight counts.
const OWNER_CHECK_SLACK: Duration = Duration::from_millis(200);
/// Read again this soon when the lease store could not be read.
const OWNER_CHECK_RETRY: Duration = Duration::from_secs(1);

/// The outcome of one hop.
#[derive(Debug)]
enum Hop {
    Answered(Reply),
    NotConnected,
    Moved(RefusalBody),
}

#[derive(Debug)]
pub struct TurnRouter {
    pub ownership: Arc<Ownership>,
    pub agent: AgentClient,
    pub runner: Arc<Runner>,
    pub forwarder: Arc<Forwarder>,
    pub inflight: Arc<InFlight>,
    pub metrics: Arc<Metrics>,
    pub ttl: Duration,
    /// `--connection-liveness`: an owner that refuses connections is asked about in
    /// Postgres (is its liveness lock gone?) before a client is told to wait its TTL.
    pub connection_liveness: bool,
    pub draining: tokio::sync::watch::Receiver<bool>,
    pub drain_timeout: Duration,
}

impl TurnRouter {
    fn refuse(&self, path: &'static str, refusal: Refusal) -> Reply {
        self.metrics.turn(path, refusal.code());
        Reply::Refused(refusal)
    }

    fn unresolved(&self, e: ResolveError) -> Reply {
        tracing::warn!(error = %e, "cannot resolve ownership");
        self.refuse("none", Refusal::StoreUnavailable)
    }

    /// Route one turn entering at `door`. A turn halted because ownership moved mid-turn
    /// (`fenced`) was journaled first, so its next owner resumes it: the public door follows
    /// it there once, under its id (as a repeat of that id, which attaches to or replays
    /// the resumed attempt), instead of handing the client a directive whose re-send,
    /// without a key, would be a second turn.
    pub async fn route(&self, turn: Turn, door: Door) -> Reply {
        let started = tokio::time::Instant::now();
        let reply = self.route_following(turn, door).await;
        let (path, class) = reply.classes();
        self.metrics.turn_took(path, class, started.elapsed());
        reply
    }

    async fn route_following(&self, mut turn: Turn, door: Door) -> Reply {
        let reply = self.route_once(turn.clone(), door, false).await;
        if door != Door::Public || !reply.is_fenced() {
            return reply;
        }
        tracing::info!(key = %turn.key, turn = %turn.id, "turn halted by a move of its session: following it to the next owner");
        self.metrics.turn_journal("followed");
        turn.keyed = true;
        match self.route_once(turn, door, true).await {
            // This node cannot route it now (draining, its own node lease lapsed, the store
            // out of reach, the new owner not reachable yet), or the owner refused the
            // repeat with a directive: the halt is the truer answer (a directive would
            // say "not run", and the first attempt may be journaled); the next owner
            // still resumes the turn.
            followed if followed.is_refusal() => reply,
            followed => followed,
        }
    }

    /// Route once; `fresh`: read the lease again rather than trust what this node knew.
    async fn route_once(&self, turn: Turn, door: Door, fresh: bool) -> Reply {
        let Some(admitted) = self.inflight.admit(&self.draining) else {
            return self.draining_refusal();
        };
        if self.agent.is_down().await {
            drop(admitted);
            return self.route_without_agent(turn, door).await;
        }
        let resolved =
            self.ownership.resolve(&turn.key, fresh).instrument(tracing::info_span!("resolve", fresh));
        match resolved.await {
            // Our node lease lapsed (revoked, or lost to a partition): a peer asking us is
            // told we are not the owner, so it looks again, rather than that the store is down.
            Err(ResolveError::NodeNotLive) if door == Door::Peer => {
                self.refuse("none", Refusal::OwnerUnreachable { ttl: self.ttl })
            }
            Err(e) => self.unresolved(e),
            Ok(Route::Local(lease)) => self.run_local(turn, lease, admitted).await,
            // A peer that is no longer the owner does not forward again.
            Ok(Route::Remote(_)) if door == Door::Peer => {
                self.refuse("none", Refusal::OwnerUnreachable { ttl: self.ttl })
            }
            // A forwarded turn runs on the owner's agent, not ours: not counted here.
            Ok(Route::Remote(holder)) => {
                drop(admitted);
                self.forward(turn, holder).await
            }
        }
    }

    fn draining_refusal(&self) -> Reply {
        self.refuse("none", Refusal::Draining { drain_timeout: self.drain_timeout })
    }

    /// Resolves once `holder` can no longer be serving `key`: its node lease lapsed
    /// (frozen, partitioned from the store, dead) or the session moved. A frozen process
    /// still accepts connections in its kernel, so without this a turn forwarded to it
    /// would wait for the response timeout. Costs one read per lease period, only while
    /// a forwarded turn is waiting.
    async fn owner_gone(&self, key: &SessionKey, holder: &Holder) {
        let mut wait = holder.remaining + OWNER_CHECK_SLACK;
        loop {
            tokio::time::sleep(wait).await;
            wait = match self.ownership.lookup(key).await {
                Ok(info) => match info.holder {
                    Some(now) if now.owner == holder.owner => now.remaining + OWNER_CHECK_SLACK,
                    _ => return,
                },
                Err(_) => OWNER_CHECK_RETRY,
            };
        }
    }

    /// One hop to `holder`: its answer, or why we should re-resolve.
    async fn hop(&self, turn: &Turn, holder: &Holder) -> Hop {
        let path = turn.peer_path();
        let started = tokio::time::Instant::now();
        let forwarded = tokio::select! {
            forwarded = self
                .forwarder
                .forward(holder, &path, turn.headers(), turn.body.clone())
                .instrument(tracing::info_span!("forward", owner = %holder.owner, peer = %holder.peer_addr)) => forwarded,
            () = self.owner_gone(&turn.key, holder) => {
                self.metrics.hop_took("owner_gone", started.elapsed());
                // It may have run (and may still finish; the fence stops its writes once
                // another node takes over): `owner_failed`, and forget that holder.
                tracing::warn!(key = %turn.key, owner = %holder.owner, "owner's lease lapsed while a forwarded turn waited");
                self.ownership.forget_holder(&holder.owner);
                self.metrics.turn("forwarded", "owner_failed");
                return Hop::Answered(Reply::OwnerFailed);
            }
        };
        self.metrics.hop_took(
            match &forwarded {
                Ok(_) => "answered",
                Err(ForwardError::Failed { .. }) => "failed",
                Err(ForwardError::NotConnected { .. }) => "not_connected",
            },
            started.elapsed(),
        );
        let response = match forwarded {
            Ok(response) => response,
            Err(ForwardError::Failed { addr, source }) => {
                tracing::warn!(%addr, error = %source, "forward failed after sending");
                self.metrics.turn("forwarded", "owner_failed");
                return Hop::Answered(Reply::OwnerFailed);
            }
            Err(ForwardError::NotConnected { addr, source }) => {
                tracing::info!(%addr, error = %source, "owner unreachable");
                return Hop::NotConnected;
            }
        };
        // Only the owner sidecar's own refusals mean something here; its agent's answer,
        // whatever its status (a 401 of its own, a 503 without a directive), goes back as is.
        let refused_by_sidecar = response.headers().contains_key(headers::REFUSAL);
        if refused_by_sidecar && response.status() == http::StatusCode::UNAUTHORIZED {
            tracing::error!(addr = %holder.peer_addr, owner = %holder.owner, "{PEER_REJECTED}");
            self.metrics.peer_rejected();
            self.metrics.turn("forwarded", "peer_rejected");
            return Hop::Answered(Reply::PeerRejected);
        }
        if !refused_by_sidecar || response.status() != http::StatusCode::SERVICE_UNAVAILABLE {
            self.metrics.turn("forwarded", status_label(response.status()));
            return Hop::Answered(Reply::Forwarded(response));
        }
        // A refusal from the peer: if it refused before running anything because it no
        // longer owns the session (or is draining), the lease may have moved: re-resolve.
        let bytes = match response.into_body().collect().await {
            Ok(body) => body.to_bytes(),
            Err(_) => bytes::Bytes::new(),
        };
        match serde_json::from_slice::<RefusalBody>(&bytes) {
            Ok(body) if body.retry.is_some() && MOVED_CODES.contains(&body.error.as_str()) => {
                Hop::Moved(body)
            }
            Ok(body) => {
                self.metrics.turn("forwarded", body.error.clone());
                Hop::Answered(Reply::PeerRefused(body))
            }
            Err(_) => {
                self.metrics.turn("forwarded", "owner_failed");
                Hop::Answered(Reply::OwnerFailed)
            }
        }
    }

    /// Forward to the owner; if it was unreachable or refused as not (or no longer) the
    /// owner, re-claim once and act on that: run here, or one more hop to a new owner.
    async fn forward(&self, turn: Turn, holder: Holder) -> Reply {
        let first = match self.hop(&turn, &holder).await {
            Hop::Answered(reply) => return reply,
            other => other,
        };
        // The re-claim may make us the owner: admitted first, so a drain begun meanwhile
        // either waits for this turn (and hands the new lease back) or refuses it unclaimed.
        let Some(admitted) = self.inflight.admit(&self.draining) else {
            return self.draining_refusal();
        };
        // Its port refuses connections: if Postgres has also seen its connection close, it
        // is dead. Expire its node lease first, so the claim below takes the session over
        // rather than telling the client to wait out the TTL.
        if matches!(first, Hop::NotConnected) && self.connection_liveness {
            self.ownership.reap_dead(&holder.owner, self.ttl).await;
        }
        let next = match self.ownership.resolve(&turn.key, true).await {
            Err(e) => return self.unresolved(e),
            Ok(Route::Local(lease)) => return self.run_local(turn, lease, admitted).await,
            Ok(Route::Remote(next)) => next,
        };
        drop(admitted);
        if next.owner == holder.owner {
            return match first {
                // Its lease is live but it is unreachable: claimable when it expires.
                Hop::NotConnected => self.refuse(
                    "forwarded",
                    Refusal::TakeoverPending { remaining: next.remaining, ttl: self.ttl },
                ),
                // Still its lease (e.g. draining, not handed back yet): its directive stands.
                Hop::Moved(body) | Hop::Answered(Reply::PeerRefused(body)) => {
                    self.metrics.turn("forwarded", body.error.clone());
                    Reply::PeerRefused(body)
                }
                Hop::Answered(reply) => reply,
            };
        }
        match self.hop(&turn, &next).await {
            Hop::Answered(reply) => reply,
            Hop::NotConnected | Hop::Moved(_) => {
                self.refuse("forwarded", Refusal::OwnerUnreachable { ttl: self.ttl })
            }
        }
    }

    /// Our agent refused the connection (crashed, restarting, OOM-killed): the turn did
    /// not start. Hand the session back so another pod's agent can serve it at once
    /// rather than the session waiting on this one (a crash-looping agent would hold it
    /// for minutes); a forwarding node re-claims on this refusal, a client retries.
    async fn agent_unavailable(&self, key: &SessionKey, epoch: Epoch) -> Reply {
        tracing::warn!(%key, %epoch, "agent refused the connection: handing the session back");
        if let Err(e) = self.ownership.release(key, epoch).await {
            tracing::warn!(%key, error = %e, "hand-back of a session whose agent is down failed");
        }
        self.refuse("local", Refusal::AgentUnavailable)
    }

    /// Our agent is down: never claim (the session would only be handed back). A live
    /// owner elsewhere gets the turn; a session still held here is handed back; anything
    /// else is refused so the client (or the forwarding node) takes it elsewhere.
    async fn route_without_agent(&self, turn: Turn, door: Door) -> Reply {
        let holder = match self.ownership.lookup(&turn.key).await {
            Ok(info) => info.holder,
            Err(e) => return self.unresolved(ResolveError::Store(e)),
        };
        match holder {
            Some(holder) if holder.owner == self.ownership.node().owner => {
                self.agent_unavailable(&turn.key, holder.epoch).await
            }
            Some(holder) if door == Door::Public => self.forward(turn, holder).await,
            _ => self.refuse("none", Refusal::AgentUnavailable),
        }
    }

    /// Run it here: the owner's queue, journal and agent.
    async fn run_local(&self, turn: Turn, lease: LocalLease, guard: InFlightGuard) -> Reply {
        let ran = self.runner.run(turn, lease.clone(), guard).await;
        self.metrics.turn("local", ran.label());
        Reply::Local { ran, node: lease.owner }
    }
}

/// What a `DELETE …/turns/{id}` came to.
#[derive(Debug)]
pub enum CancelReply {
    Done(Cancelled),
    /// The owner's sidecar answered (a forwarded cancel): passed through.
    Forwarded(upstream::Response),
    Refused(Refusal),
    OwnerFailed,
}

impl TurnRouter {
    /// Cancel a turn at its session's owner: here, or one hop to the owner (never a
    /// second hop).
    pub async fn cancel(&self, key: &SessionKey, turn_id: &str, door: Door) -> CancelReply {
        let Some(admitted) = self.inflight.admit(&self.draining) else {
            return CancelReply::Refused(Refusal::Draining { drain_timeout: self.drain_timeout });
        };
        match self.ownership.resolve(key, false).await {
            Err(e) => {
                tracing::warn!(error = %e, "cannot resolve ownership");
                CancelReply::Refused(Refusal::StoreUnavailable)
            }
            Ok(Route::Local(lease)) => {
                let done = self.runner.cancel(&lease, turn_id).await;
                drop(admitted);
                match done {
                    Ok(done) => CancelReply::Done(done),
                    Err(Outcome::Refused(refusal)) => CancelReply::Refused(refusal),
                    Err(_) => CancelReply::OwnerFailed,
                }
            }
            Ok(Route::Remote(_)) if door == Door::Peer => {
                CancelReply::Refused(Refusal::OwnerUnreachable { ttl: self.ttl })
            }
            Ok(Route::Remote(holder)) => {
                drop(admitted);
                let path = format!("/peer/v1/sessions/{key}/turns/{}/cancel", super::path_segment(turn_id));
                match self.forwarder.forward(&holder, &path, std::iter::empty(), bytes::Bytes::new()).await {
                    Ok(response) => CancelReply::Forwarded(response),
                    Err(ForwardError::NotConnected { .. }) => {
                        CancelReply::Refused(Refusal::TakeoverPending {
                            remaining: holder.remaining,
                            ttl: self.ttl,
                        })
                    }
                    Err(ForwardError::Failed { .. }) => CancelReply::OwnerFailed,
                }
            }
        }
    }
}

/// How often each node looks for turns whose owner is gone and that no request touches:
/// such a turn is resumed within its owner's TTL (or at once after a revocation or a
/// hand-back) plus this. One indexed query per node per period.
pub const ORPHAN_SWEEP: Duration = Duration::from_secs(2);
/// Sessions taken per sweep: a burst of orphans (a pod lost with many) is spread over
/// a few sweeps and over the nodes that race to claim them.
const ORPHAN_BATCH: i64 = 32;

impl TurnRouter {
    /// Forever: claim sessions with an unfinished turn and no live owner, and resume the
    /// turn here (an accepted turn finishes even if its client is gone). Not while
    /// draining or while our agent is down.
    pub async fn resume_orphans(self: Arc<Self>) {
        loop {
            tokio::time::sleep(ORPHAN_SWEEP).await;
            if *self.draining.borrow() || self.agent.is_down().await {
                continue;
            }
            let orphans = match self.ownership.orphaned_turns(ORPHAN_BATCH).await {
                Ok(orphans) => orphans,
                Err(e) => {
                    tracing::debug!(error = %e, "looking for orphaned turns failed");
                    continue;
                }
            };
            for key in orphans {
                let Some(admitted) = self.inflight.admit(&self.draining) else { break };
                match self.ownership.resolve(&key, true).await {
                    Ok(Route::Local(lease)) => {
                        tracing::info!(%key, epoch = %lease.epoch, "claimed a session with an orphaned turn");
                        tokio::spawn({
                            let runner = self.runner.clone();
                            async move { runner.resume_orphaned(lease, admitted).await }
                        });
                    }
                    Ok(Route::Remote(_)) => {} // another node claimed it first
                    Err(e) => tracing::debug!(%key, error = %e, "claiming an orphaned session failed"),
                }
            }
        }
    }
}
