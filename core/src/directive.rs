//! The wire shape of a refusal (`503` with a retry directive), as the sidecar sends it
//! and every client reads it: `{"error":"<code>","retry":{"delay_ms":D,"budget_ms":B}}`,
//! and how a client obeys one.

use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// The JSON body of a refusal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefusalBody {
    pub error: String,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub retry: Option<Retry>,
}

/// What a client must do: re-send after `delay_ms`, give up after `budget_ms` in total.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retry {
    pub delay_ms: u64,
    pub budget_ms: u64,
}

impl Retry {
    /// `Retry-After` in whole seconds, rounded up (at least 1: the header has no fractions).
    pub fn after_secs(&self) -> u64 {
        self.delay_ms.div_ceil(1000).max(1)
    }
}

/// The refusal in a `503` answer, when it carries a directive: the only answer a client
/// may re-send on. Anything else (no directive, not JSON, another status) is surfaced.
pub fn directive_in(status: u16, body: &[u8]) -> Option<RefusalBody> {
    if status != 503 {
        return None;
    }
    serde_json::from_slice::<RefusalBody>(body).ok().filter(|refusal| refusal.retry.is_some())
}

/// A client's obedience to the directives of one request (CONTRACT §3): re-send after
/// `delay_ms`, give up once `budget_ms` since the first attempt would be exceeded.
#[derive(Debug)]
pub struct Obeying {
    started: tokio::time::Instant,
    /// The directive codes obeyed so far, in order.
    pub directives: Vec<String>,
}

impl Default for Obeying {
    fn default() -> Self {
        Obeying { started: tokio::time::Instant::now(), directives: Vec::new() }
    }
}

impl Obeying {
    /// Record `refusal` and say how long to wait before re-sending; `Err` (the refusal
    /// back) when waiting would overrun its budget: the client gives up.
    pub fn obey(&mut self, refusal: RefusalBody) -> Result<Duration, RefusalBody> {
        let Some(retry) = refusal.retry else { return Err(refusal) };
        self.directives.push(refusal.error.clone());
        let delay = Duration::from_millis(retry.delay_ms);
        if self.started.elapsed() + delay > Duration::from_millis(retry.budget_ms) {
            return Err(refusal);
        }
        Ok(delay)
    }
}

/// The final answer to a request, after any directed retries.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    /// `Leasehold-Owner`: the node that ran the turn.
    pub owner: Option<String>,
    /// `Leasehold-Epoch`: the lease epoch it ran at.
    pub epoch: Option<i64>,
    pub body: Bytes,
    /// The directive codes obeyed on the way, in order.
    pub directives: Vec<String>,
    /// Where the final answer came from (a node's URL, a pod's name).
    pub answered_by: String,
    /// Nodes the request never reached (refused connections, pods gone), with why.
    pub not_reached: Vec<(String, String)>,
}

impl Answer {
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.body).ok()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_503_with_a_directive_is_one() {
        let draining = br#"{"error":"draining","retry":{"delay_ms":100,"budget_ms":25000}}"#;
        assert_eq!(directive_in(503, draining).map(|r| r.error), Some("draining".to_owned()));
        assert_eq!(directive_in(503, br#"{"error":"store_unavailable"}"#), None, "no directive");
        assert_eq!(directive_in(502, br#"{"error":"owner_failed"}"#), None);
        assert_eq!(directive_in(503, b"<html>"), None);
        assert_eq!(directive_in(200, draining), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_directive_is_obeyed_until_its_budget_runs_out() {
        let refusal = |delay_ms, budget_ms| RefusalBody {
            error: "takeover_pending".into(),
            retry: Some(Retry { delay_ms, budget_ms }),
        };
        let mut obeying = Obeying::default();
        assert_eq!(obeying.obey(refusal(400, 1000)), Ok(Duration::from_millis(400)));
        tokio::time::advance(Duration::from_millis(700)).await;
        assert!(obeying.obey(refusal(400, 1000)).is_err(), "700 + 400 ms overruns the 1 s budget");
        assert_eq!(obeying.directives, ["takeover_pending", "takeover_pending"]);
    }
}
