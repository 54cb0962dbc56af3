//! One session's client: sequential turns, each with a unique text, sent round-robin over
//! the nodes' public ports, each with its text as its `Idempotency-Key`. It obeys retry
//! directives (re-sends after `delay_ms`), and re-sends with the same key whatever may
//! have been received (a timeout or a broken connection after sending, a body cut short,
//! `502 owner_failed`): the journal runs a turn once however often it is sent, so the
//! client keeps at it until it has the turn's answer, for up to [`TURN_DEADLINE`]. Only
//! then is a turn recorded as ambiguous or refused. A refused connection (nothing was
//! sent) goes to the next node at once.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use leasehold_core::directive::{directive_in, Obeying};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde_json::json;
use tokio::sync::watch;

use super::record::{turn_text, Ack, Outcome, SessionLog, TurnRecord};

/// A node that does not accept a connection within this is down: nothing was sent.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Longer than the longest freeze a run injects (2 TTLs) plus a forwarded turn's bound
/// when its owner freezes (about 3 TTLs): an answer still missing after this is ambiguous.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// Up to this long between a session's turns, so the cluster is busy but not saturated.
const MAX_TURN_GAP_MS: u64 = 100;
/// How long a client keeps re-sending one turn (with its key) before it records it as
/// unresolved: longer than any fault of a run and its recovery (a store outage's 30 s
/// budget), shorter than the run's stop grace.
pub const TURN_DEADLINE: Duration = Duration::from_secs(45);
/// Pause before re-sending a turn whose answer was lost (no directive to say how long).
const RESEND_PAUSE: Duration = Duration::from_millis(200);
/// How much of an unexpected body a record keeps.
const BODY_EXCERPT: usize = 200;

/// A session's log, shared with the run so that a turn in flight when the run ends is
/// still seen (as `Pending`).
pub type SharedLog = Arc<Mutex<SessionLog>>;

/// The client of one session.
#[derive(Debug)]
pub struct Driver {
    key: String,
    nodes: Vec<String>,
    http: reqwest::Client,
    next_node: usize,
    max_think: Duration,
    rng: StdRng,
    log: SharedLog,
}

impl Driver {
    /// The client of session `key` over `nodes` (public base URLs), starting at node
    /// `first`; each turn asks the agent to think up to `max_think`; `seed` varies the
    /// think times and the pauses between turns.
    pub fn new(
        key: &str,
        nodes: Vec<String>,
        first: usize,
        max_think: Duration,
        seed: u64,
    ) -> reqwest::Result<Driver> {
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            // A fresh connection per request: a pooled one to a process that died since
            // would fail after sending, and be recorded as ambiguous for no reason.
            .pool_max_idle_per_host(0)
            .build()?;
        let log = Arc::new(Mutex::new(SessionLog { key: key.to_owned(), turns: Vec::new() }));
        let rng = StdRng::seed_from_u64(seed);
        Ok(Driver { key: key.to_owned(), nodes, http, next_node: first, max_think, rng, log })
    }

    pub fn log(&self) -> SharedLog {
        self.log.clone()
    }

    /// Send turns one after another until `stop` turns true (checked between turns).
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut n = 0;
        while !*stop.borrow_and_update() {
            n += 1;
            let text = turn_text(&self.key, n);
            let record =
                TurnRecord { n, text: text.clone(), directives: Vec::new(), outcome: Outcome::Pending };
            let at = self.with_log(|log| {
                log.turns.push(record);
                log.turns.len() - 1
            });
            let (outcome, directives) = self.turn(&text).await;
            self.with_log(|log| {
                log.turns[at].outcome = outcome;
                log.turns[at].directives = directives;
            });
            let gap = Duration::from_millis(self.rng.random_range(0..=MAX_TURN_GAP_MS));
            tokio::select! {
                _ = tokio::time::sleep(gap) => {}
                _ = stop.changed() => {}
            }
        }
    }

    fn with_log<T>(&self, f: impl FnOnce(&mut SessionLog) -> T) -> T {
        f(&mut self.log.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    fn next_url(&mut self) -> String {
        let node = &self.nodes[self.next_node % self.nodes.len()];
        self.next_node += 1;
        format!("{node}/v1/sessions/{}/turns", self.key)
    }

    /// One turn to its final outcome, and the directives obeyed (and re-sends made, as
    /// `resent: <why>`) on the way.
    async fn turn(&mut self, text: &str) -> (Outcome, Vec<String>) {
        let think_ms = self.rng.random_range(0..=self.max_think.as_millis() as u64);
        let body = json!({ "text": text, "think_ms": think_ms, "tokens": 2 }).to_string();
        let deadline = tokio::time::Instant::now() + TURN_DEADLINE;
        let mut obeying = Obeying::default();
        let mut resent = Vec::new();
        let mut refused_connections = 0;
        // Whether any attempt may have reached a node: then nothing is a clean refusal.
        let mut reached = false;
        let mut last: Outcome;
        loop {
            let url = self.next_url();
            let sent = self
                .http
                .post(url)
                .header("content-type", "application/json")
                .header("idempotency-key", text)
                .body(body.clone())
                .send()
                .await;
            last = match sent {
                Ok(response) => {
                    refused_connections = 0;
                    reached = true;
                    let status = response.status().as_u16();
                    match response.bytes().await {
                        Err(e) => Outcome::Ambiguous(format!("{status}, then {}", describe(&e))),
                        Ok(body) => match directive_in(status, &body) {
                            None => classify(status, &body),
                            Some(refusal) => {
                                // The budget is the directive's advice; the key makes a
                                // re-send past it safe, so only the deadline ends a turn.
                                let delay = match obeying.obey(refusal) {
                                    Ok(delay) => delay,
                                    Err(last) => {
                                        resent.extend(std::mem::take(&mut obeying).directives);
                                        resent.push(format!("resent: past the budget of {}", last.error));
                                        RESEND_PAUSE
                                    }
                                };
                                tokio::time::sleep(delay).await;
                                continue;
                            }
                        },
                    }
                }
                Err(e) if e.is_connect() => {
                    refused_connections += 1;
                    if refused_connections < self.nodes.len() {
                        continue;
                    }
                    refused_connections = 0;
                    match reached {
                        true => Outcome::Ambiguous(
                            "no node accepted a connection after an earlier attempt".into(),
                        ),
                        false => Outcome::Refused("no node accepted a connection".into()),
                    }
                }
                Err(e) => {
                    reached = true;
                    Outcome::Ambiguous(describe(&e))
                }
            };
            let settled = matches!(last, Outcome::Acknowledged(_) | Outcome::Unexpected { .. });
            if settled || tokio::time::Instant::now() >= deadline {
                break;
            }
            resent.push(format!("resent: {}", reason(&last)));
            tokio::time::sleep(RESEND_PAUSE).await;
        }
        let mut directives = obeying.directives;
        directives.extend(resent);
        (last, directives)
    }
}

/// Why a turn is sent again, in a few words.
fn reason(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Ambiguous(why) | Outcome::Refused(why) => why.clone(),
        other => format!("{other:?}"),
    }
}

/// The outcome of an answer that carries no directive.
pub fn classify(status: u16, body: &[u8]) -> Outcome {
    let unexpected = || Outcome::Unexpected { status, body: excerpt(body) };
    match status {
        200 => {
            serde_json::from_slice::<Ack>(body).map(Outcome::Acknowledged).unwrap_or_else(|_| unexpected())
        }
        502 => {
            let error = serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .and_then(|v| v["error"].as_str().map(str::to_owned));
            match error.as_deref() {
                Some("owner_failed") => Outcome::Ambiguous("502 owner_failed".into()),
                // Lost mid-turn at every attempt: one of them may have checkpointed it.
                Some("attempts_exhausted") => Outcome::Ambiguous("502 attempts_exhausted".into()),
                _ => unexpected(),
            }
        }
        _ => unexpected(),
    }
}

fn excerpt(body: &[u8]) -> String {
    String::from_utf8_lossy(body).chars().take(BODY_EXCERPT).collect()
}

/// Why a request that may have been received failed, in a few words.
fn describe(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timed out after sending".into()
    } else {
        format!("broken after sending: {e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_without_a_directive_are_classified() {
        let ack = br#"{"history_len":3,"epoch":2,"node":"node-b"}"#;
        assert_eq!(
            classify(200, ack),
            Outcome::Acknowledged(Ack { history_len: 3, epoch: 2, node: "node-b".into() })
        );
        assert_eq!(
            classify(502, br#"{"error":"owner_failed"}"#),
            Outcome::Ambiguous("502 owner_failed".into())
        );
        assert_eq!(
            classify(502, br#"{"error":"attempts_exhausted","message":"lost at each of its 5 attempts"}"#),
            Outcome::Ambiguous("502 attempts_exhausted".into())
        );
        for (status, body) in [
            (502, &br#"{"error":"sidecar_unreachable"}"#[..]),
            (503, br#"{"error":"store_unavailable"}"#),
            (500, b"oops"),
            (409, br#"{"error":"busy"}"#),
            (200, b"{}"),
        ] {
            assert!(matches!(classify(status, body), Outcome::Unexpected { .. }), "{status}");
        }
    }
}
