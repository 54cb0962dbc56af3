//! The drain (CONTRACT §6): stop being ready → refuse new work with `draining` → let
//! in-flight turns finish up to the drain timeout, stand the rest down → hand every lease
//! back in one statement → tell streams to reconnect → report.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, OnceLock,
    },
    time::Duration,
};

use serde::Serialize;
use tokio::{
    sync::{watch, OnceCell},
    time::Instant,
};

use crate::{
    heartbeat::Stopper,
    metrics::Metrics,
    observe::Hubs,
    ownership::{Ownership, StandDownReason, HOLDER_MAX_TRUST},
    turn::inflight::InFlight,
};

/// Attempts at the hand-back statement before giving up (the leases then lapse by TTL).
const HAND_BACK_ATTEMPTS: u32 = 3;
/// Pause between hand-back attempts: long enough to ride out a brief store blip.
const HAND_BACK_RETRY: Duration = Duration::from_millis(500);
/// Added to the holder-trust horizon in `linger`: a forwarder's claim-to-send time.
const LINGER_MARGIN: Duration = Duration::from_millis(500);

/// A drained sidecar exits only once no answer has gone out on its public or peer port
/// for this long: a client still sending to it (a load balancer or an endpoint list not
/// yet updated) holds pooled keep-alive connections, and one sent on at the instant they
/// are closed at exit is lost. Past this much quiet the client has stopped.
pub const EXIT_QUIET: Duration = Duration::from_secs(1);
/// The wait for quiet ends this long after the drain however busy the ports still are:
/// together with the listeners' graceful shutdown it must stay within
/// `leasehold_core::lifecycle::MAX_EXIT_AFTER_DRAIN`, past the longest `linger` (5.5 s).
pub const EXIT_QUIET_WAIT_MAX: Duration = Duration::from_secs(8);

/// How long a drained sidecar keeps its ports open before exiting. Another node may
/// still forward a turn to us from its remembered holders until the hand-back's
/// notification reaches it, at worst until that memory's trust runs out (half the
/// remaining lease, capped). Open, we refuse such a turn with `draining` and the
/// forwarder re-claims; closing the connection under it would make the forwarder answer
/// `502 owner_failed` for a turn that never ran.
pub fn linger(ttl: Duration) -> Duration {
    (ttl / 2).min(HOLDER_MAX_TRUST) + LINGER_MARGIN
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DrainReport {
    pub handed_back: u64,
    pub in_flight_finished: usize,
    pub in_flight_stood_down: usize,
}

#[derive(Debug, Clone, thiserror::Error)]
#[error("hand-back failed; leases will lapse after their TTL: {0}")]
pub struct DrainError(String);

#[derive(Debug)]
pub struct Drain {
    draining: watch::Sender<bool>,
    /// Set once the sequence has ended (successfully or not).
    ended: watch::Sender<bool>,
    done: OnceCell<Result<DrainReport, DrainError>>,
    /// When the sequence ended (leases handed back, or the attempt given up).
    ended_at: OnceLock<Instant>,
    /// Since `created`, in ms: the last answer on the public or peer port while draining.
    last_answer_ms: AtomicU64,
    created: Instant,
    pub ownership: Arc<Ownership>,
    pub inflight: Arc<InFlight>,
    pub heartbeat: Stopper,
    pub metrics: Arc<Metrics>,
    pub hubs: Arc<Hubs>,
    pub timeout: Duration,
}

impl Drain {
    pub fn new(
        ownership: Arc<Ownership>,
        inflight: Arc<InFlight>,
        heartbeat: Stopper,
        metrics: Arc<Metrics>,
        hubs: Arc<Hubs>,
        timeout: Duration,
    ) -> Self {
        let draining = watch::Sender::new(false);
        Drain {
            draining,
            ended: watch::Sender::new(false),
            done: OnceCell::new(),
            ended_at: OnceLock::new(),
            last_answer_ms: AtomicU64::new(0),
            created: Instant::now(),
            ownership,
            inflight,
            heartbeat,
            metrics,
            hubs,
            timeout,
        }
    }

    /// Observed by the router: `true` refuses new work with `draining`.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.draining.subscribe()
    }

    pub fn is_draining(&self) -> bool {
        *self.draining.borrow()
    }

    pub fn is_done(&self) -> bool {
        self.done.initialized()
    }

    /// Run the drain once; concurrent and later calls wait for and return the same result.
    pub async fn run(&self) -> Result<DrainReport, DrainError> {
        self.done
            .get_or_init(|| async {
                let result = self.sequence().await;
                self.ended_at.get_or_init(Instant::now);
                self.ended.send_replace(true);
                result
            })
            .await
            .clone()
    }

    /// Wait for a drain someone else runs: for it to start (at most `start_within`), then
    /// to end (at most `timeout` more). Its report, or `None` if none started or it did
    /// not end in time. Starts nothing.
    pub async fn wait_done(&self, start_within: Duration) -> Option<Result<DrainReport, DrainError>> {
        let mut draining = self.draining.subscribe();
        tokio::time::timeout(start_within, draining.wait_for(|d| *d)).await.ok()?.ok()?;
        let mut ended = self.ended.subscribe();
        let wait = self.timeout + HAND_BACK_RETRY * HAND_BACK_ATTEMPTS + LINGER_MARGIN;
        tokio::time::timeout(wait, ended.wait_for(|e| *e)).await.ok()?.ok()?;
        self.done.get().cloned()
    }

    /// An answer went out on the public or peer port (counted while draining).
    pub fn answered(&self) {
        let ms = u64::try_from(self.created.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_answer_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// Wait until neither an answer nor the drain's end is more recent than `quiet`,
    /// giving up `max` after the drain ended (at once if it has not run).
    pub async fn quiet_for(&self, quiet: Duration, max: Duration) {
        let Some(&ended) = self.ended_at.get() else { return };
        let give_up = ended + max;
        loop {
            let last_answer =
                self.created + Duration::from_millis(self.last_answer_ms.load(Ordering::Relaxed));
            let until = (last_answer.max(ended) + quiet).min(give_up);
            if Instant::now() >= until {
                return;
            }
            tokio::time::sleep_until(until).await;
        }
    }

    /// Wait until `period` has passed since the drain ended (at once if it has already).
    pub async fn linger_after(&self, period: Duration) {
        if let Some(ended) = self.ended_at.get() {
            tokio::time::sleep_until(*ended + period).await;
        }
    }

    async fn sequence(&self) -> Result<DrainReport, DrainError> {
        self.draining.send_replace(true);
        let started_with = self.inflight.count();
        tracing::info!(in_flight = started_with, "draining");
        let idle = self.inflight.wait_idle(self.timeout).await;
        let still_running = if idle { 0 } else { self.inflight.count() };
        if still_running > 0 {
            tracing::warn!(still_running, "drain timeout: standing the rest down");
            self.metrics.drain_timed_out();
            self.ownership.stand_down_everything(StandDownReason::Drain);
        }
        // No renewal may race the hand-back (it would register a new boot).
        self.heartbeat.stop().await;
        let handed_back = self.hand_back().await?;
        self.ownership.forget_all();
        self.metrics.handed_back(handed_back);
        self.hubs.reconnect_all();
        self.hubs.forget_unobserved();
        let report = DrainReport {
            handed_back,
            in_flight_finished: started_with.saturating_sub(still_running),
            in_flight_stood_down: still_running,
        };
        tracing::info!(?report, "drained");
        Ok(report)
    }

    async fn hand_back(&self) -> Result<u64, DrainError> {
        let mut last = None;
        for _ in 0..HAND_BACK_ATTEMPTS {
            match self.ownership.hand_back_all().await {
                Ok(n) => return Ok(n),
                Err(e) => {
                    tracing::warn!(error = %e, "hand-back failed; retrying");
                    last = Some(e.to_string());
                    tokio::time::sleep(HAND_BACK_RETRY).await;
                }
            }
        }
        Err(DrainError(last.unwrap_or_default()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Behaviour, not the formula: another node remembers us through the real holder
    /// cache, at the worst moment (just before our hand-back, our node lease freshly
    /// renewed so `ttl` remains). By the time we close our ports (`linger`) that memory no
    /// longer routes a turn to us, with a forwarder's claim-to-send time to spare.
    #[tokio::test(start_paused = true)]
    async fn linger_outlasts_what_another_node_may_remember_of_us() {
        use leasehold_core::{store::Holder, Epoch, Owner, SessionKey};

        use crate::ownership::holders::Holders;

        let us = Owner::parse("draining-node/boot-1").unwrap();
        for ttl in [1, 2, 3, 10, 15, 60, 3600].map(Duration::from_secs) {
            let their_cache = Holders::default();
            let key = SessionKey::parse("s").unwrap();
            let holder = Holder {
                owner: us.clone(),
                epoch: Epoch(1),
                peer_addr: "127.0.0.1:1".into(),
                remaining: ttl,
            };
            their_cache.remember(&key, &holder);
            assert!(their_cache.get(&key).is_some(), "{ttl:?}: remembered at first");

            let closed_at = Instant::now() + linger(ttl);
            // A forwarder that looked us up just before trust ran out still needs
            // `LINGER_MARGIN` to send: the memory must be gone that long before we close.
            tokio::time::advance(linger(ttl).saturating_sub(LINGER_MARGIN)).await;
            assert!(
                their_cache.get(&key).is_none(),
                "{ttl:?}: another node still routes to us {:?} before we close",
                closed_at - Instant::now()
            );
            tokio::time::advance(closed_at - Instant::now()).await;
            assert!(their_cache.get(&key).is_none(), "{ttl:?}: still trusted when we close");
        }
    }

    #[test]
    fn the_wait_for_quiet_outlasts_any_linger() {
        for ttl in [1, 2, 10, 15, 60, 3600].map(Duration::from_secs) {
            assert!(EXIT_QUIET_WAIT_MAX >= linger(ttl) + EXIT_QUIET, "{ttl:?}");
        }
    }
}
