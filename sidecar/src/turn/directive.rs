//! Refusals and the retry directive (CONTRACT §3).
//!
//! A request that cannot run now but may succeed soon gets `503`, `Retry-After` (seconds,
//! rounded up) and `{"error":"<code>","retry":{"delay_ms":D,"budget_ms":B}}`, with D taken
//! from the real situation. A failure that may have run the turn remotely is `502
//! owner_failed` with no directive: retrying it could run the turn twice.

use std::time::Duration;

use leasehold_core::directive::{RefusalBody, Retry};

/// After a fenced turn the next owner is normally in place within a claim round trip.
pub const FENCED_DELAY: Duration = Duration::from_millis(100);
/// A draining pod: the next attempt lands on (or is forwarded to) another pod at once;
/// the delay only keeps a client from spinning. It is part of every hand-off gap (25 ms
/// instead of 100 cut the drain test's worst gap from ~390 to ~260 ms, BENCHMARKS.md).
pub const DRAINING_DELAY: Duration = Duration::from_millis(25);
/// The lease store is unreachable: retry at a pace that does not hammer it.
pub const STORE_DELAY: Duration = Duration::from_secs(1);
/// How long clients keep retrying a store outage before surfacing it.
pub const STORE_BUDGET: Duration = Duration::from_secs(30);
/// A limit of this pod is reached: wait long enough for connections or streams to end,
/// short enough that a client moved to another pod by its load balancer barely notices.
pub const OVERLOADED_DELAY: Duration = Duration::from_millis(1000);
/// The session's turn queue at its owner is full: about one short turn's time before a
/// place frees; the budget covers a queue's worth of them.
pub const QUEUE_FULL_DELAY: Duration = Duration::from_millis(500);
/// The agent container is not accepting connections (restarting); it is local, so a
/// short wait suffices.
pub const AGENT_DELAY: Duration = Duration::from_millis(500);

/// Why a request was refused, with the facts its delay is derived from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Another owner's lease is live but unreachable; it becomes claimable in `remaining`.
    TakeoverPending { remaining: Duration, ttl: Duration },
    /// The lease store cannot be reached; nothing runs unfenced.
    StoreUnavailable,
    /// This pod is draining.
    Draining { drain_timeout: Duration },
    /// A second hop was unreachable too.
    OwnerUnreachable { ttl: Duration },
    /// The turn was halted because ownership moved mid-turn.
    Fenced { ttl: Duration },
    /// The local agent container refused the connection; the turn did not start.
    AgentUnavailable,
    /// A connection or stream limit of this pod is reached: try again shortly (through
    /// the load balancer, likely another pod).
    Overloaded,
    /// The session's turn queue at its owner is full.
    QueueFull,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Refusal {
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::TakeoverPending { .. } => "takeover_pending",
            Refusal::StoreUnavailable => "store_unavailable",
            Refusal::Draining { .. } => "draining",
            Refusal::OwnerUnreachable { .. } => "owner_unreachable",
            Refusal::Fenced { .. } => "fenced",
            Refusal::AgentUnavailable => "agent_unavailable",
            Refusal::Overloaded => "overloaded",
            Refusal::QueueFull => "queue_full",
        }
    }

    /// Delay and budget. Budgets cover the whole recovery the delay waits for, plus one
    /// more TTL for the new owner to settle.
    pub fn retry(&self) -> Retry {
        let (delay, budget) = match *self {
            Refusal::TakeoverPending { remaining, ttl } => (remaining, remaining + ttl * 2),
            Refusal::StoreUnavailable => (STORE_DELAY, STORE_BUDGET),
            Refusal::Draining { drain_timeout } => (DRAINING_DELAY, drain_timeout),
            Refusal::OwnerUnreachable { ttl } => (ttl / 3, ttl * 3),
            Refusal::Fenced { ttl } => (FENCED_DELAY, ttl * 2),
            Refusal::AgentUnavailable => (AGENT_DELAY, STORE_BUDGET),
            Refusal::Overloaded => (OVERLOADED_DELAY, STORE_BUDGET),
            Refusal::QueueFull => (QUEUE_FULL_DELAY, STORE_BUDGET),
        };
        Retry { delay_ms: ms(delay).max(1), budget_ms: ms(budget).max(ms(delay)) }
    }

    /// `Retry-After` in whole seconds, rounded up.
    pub fn retry_after_secs(&self) -> u64 {
        self.retry().after_secs()
    }

    pub fn body(&self) -> RefusalBody {
        RefusalBody { error: self.code().to_owned(), retry: Some(self.retry()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(15);

    #[test]
    fn takeover_waits_exactly_the_remaining_ttl() {
        let r = Refusal::TakeoverPending { remaining: Duration::from_millis(7_250), ttl: TTL };
        assert_eq!(r.retry(), Retry { delay_ms: 7_250, budget_ms: 37_250 });
        assert_eq!(r.retry_after_secs(), 8, "rounded up");
    }

    #[test]
    fn every_code_has_a_directive_and_retry_after_rounds_up() {
        for r in [
            Refusal::TakeoverPending { remaining: Duration::ZERO, ttl: TTL },
            Refusal::StoreUnavailable,
            Refusal::Draining { drain_timeout: Duration::from_secs(25) },
            Refusal::OwnerUnreachable { ttl: TTL },
            Refusal::Fenced { ttl: TTL },
            Refusal::AgentUnavailable,
            Refusal::Overloaded,
            Refusal::QueueFull,
        ] {
            let retry = r.retry();
            assert!(retry.delay_ms >= 1 && retry.budget_ms >= retry.delay_ms, "{r:?}");
            assert!(r.retry_after_secs() * 1000 >= retry.delay_ms, "{r:?}");
            assert!(r.retry_after_secs() >= 1);
        }
    }

    #[test]
    fn body_has_the_contract_shape() {
        let body = serde_json::to_value(Refusal::Fenced { ttl: TTL }.body()).unwrap();
        assert_eq!(body, serde_json::json!({"error":"fenced","retry":{"delay_ms":100,"budget_ms":30000}}));
    }
}
