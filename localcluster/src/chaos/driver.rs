//! One session's client: sequential turns, each with a unique text, sent round-robin over
//! the nodes' public ports. It obeys retry directives (re-sends after `delay_ms`); a
//! refused connection (nothing was sent) goes to the next node at once. Two kinds:
//!
//! - **Keyed** (the text is the turn's `Idempotency-Key`): it re-sends with the same key
//!   whatever may have been received (a timeout or a broken connection after sending, a
//!   body cut short, `502 owner_failed`) and past a directive's budget: the journal runs
//!   a turn once however often it is sent, so the client keeps at it until it has the
//!   turn's answer, for up to [`TURN_DEADLINE`]. Only then is a turn recorded as
//!   ambiguous or refused.
//! - **Unkeyed** (no key: each attempt is a new turn to the sidecar): it never re-sends a
//!   request that may have been received (that turn is ambiguous), nor one refused with
//!   a directive of [`MAY_BE_RESUMED`]; it obeys other directives until their budget (or
//!   [`UNKEYED_DIRECTIVE_BUDGET`]) runs out, and the turn is then refused.
//!
//! In both, a turn ends refused only when nothing of it may have run; the checker
//! verifies a refused turn is not in the history.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use leasehold_core::directive::{directive_in, Obeying, RefusalBody};
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
/// A client without a key gives up on a turn refused with directives for this long in
/// all (or the directive's own budget, when shorter): about as long as the longer faults
/// of a run (a held store partition lasts up to 3 TTLs, 6 s), so that some turns do end
/// refused and the checker verifies that they did not run.
pub const UNKEYED_DIRECTIVE_BUDGET: Duration = Duration::from_secs(5);
/// Directives that may come for a turn already journaled and halted, which the next
/// owner resumes (docs/http-api.md, retry directives): without a key such a turn may
/// still run, so it is ambiguous, never re-sent and never a clean refusal.
pub const MAY_BE_RESUMED: [&str; 2] = ["fenced", "agent_unavailable"];
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
    /// Whether turns carry an idempotency key (see the module's doc).
    keyed: bool,
    max_think: Duration,
    rng: StdRng,
    log: SharedLog,
}

impl Driver {
    /// The client of session `key` over `nodes` (public base URLs), starting at node
    /// `first`, with or without idempotency keys (`keyed`); each turn asks the agent to
    /// think up to `max_think`; `seed` varies the think times and the pauses between turns.
    pub fn new(
        key: &str,
        nodes: Vec<String>,
        first: usize,
        keyed: bool,
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
        Ok(Driver { key: key.to_owned(), nodes, http, next_node: first, keyed, max_think, rng, log })
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
        let started = tokio::time::Instant::now();
        let deadline = started + TURN_DEADLINE;
        let mut obeying = Obeying::default();
        let mut resent = Vec::new();
        let mut refused_connections = 0;
        // Whether the turn may have run (or may yet run) whatever comes next: an attempt
        // that may have been received, or a directive that says a halted turn will be
        // resumed. Then nothing is a clean refusal.
        let mut may_have_run = false;
        let mut last: Outcome;
        loop {
            let url = self.next_url();
            let mut request = self.http.post(url).header("content-type", "application/json");
            if self.keyed {
                request = request.header("idempotency-key", text);
            }
            let sent = request.body(body.clone()).send().await;
            last = match sent {
                Ok(response) => {
                    refused_connections = 0;
                    let status = response.status().as_u16();
                    match response.bytes().await {
                        Err(e) => {
                            may_have_run = true;
                            Outcome::Ambiguous(format!("{status}, then {}", describe(&e)))
                        }
                        Ok(body) => match directive_in(status, &body) {
                            None => {
                                may_have_run = true;
                                classify(status, &body)
                            }
                            Some(refusal) => {
                                let code = refusal.error.clone();
                                may_have_run |= MAY_BE_RESUMED.contains(&code.as_str());
                                match self.obey(&mut obeying, refusal, may_have_run, started, &mut resent) {
                                    Next::Resend(delay) => {
                                        tokio::time::sleep(delay).await;
                                        continue;
                                    }
                                    Next::End(outcome) => {
                                        last = outcome;
                                        break;
                                    }
                                }
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
                    match may_have_run {
                        true => Outcome::Ambiguous(
                            "no node accepted a connection after an earlier attempt".into(),
                        ),
                        false => Outcome::Refused("no node accepted a connection".into()),
                    }
                }
                Err(e) => {
                    may_have_run = true;
                    Outcome::Ambiguous(describe(&e))
                }
            };
            let settled = matches!(last, Outcome::Acknowledged(_) | Outcome::Unexpected { .. });
            // Without a key, nothing is re-sent once it may have been received: a re-send
            // would be another turn.
            if settled || !self.keyed || tokio::time::Instant::now() >= deadline {
                break;
            }
            resent.push(format!("resent: {}", reason(&last)));
            tokio::time::sleep(RESEND_PAUSE).await;
        }
        let mut directives = obeying.directives;
        directives.extend(resent);
        (last, directives)
    }

    /// What a directive leads to: a re-send after a delay, or the end of the turn.
    ///
    /// Keyed, the directive's budget is advice: the key makes a re-send past it safe, so
    /// only [`TURN_DEADLINE`] ends the turn. Unkeyed, the client gives up once the
    /// directive's budget, or its own [`UNKEYED_DIRECTIVE_BUDGET`], would be overrun, and
    /// at once on a directive for a turn that may be resumed ([`MAY_BE_RESUMED`]): its
    /// re-send would be a second turn. The turn ends refused when nothing of it may
    /// have run (the checker then verifies it is not in the history), else ambiguous.
    fn obey(
        &self,
        obeying: &mut Obeying,
        refusal: RefusalBody,
        may_have_run: bool,
        started: tokio::time::Instant,
        resent: &mut Vec<String>,
    ) -> Next {
        let code = refusal.error.clone();
        let ends = |why: String| match may_have_run {
            true => Next::End(Outcome::Ambiguous(why)),
            false => Next::End(Outcome::Refused(why)),
        };
        if !self.keyed && MAY_BE_RESUMED.contains(&code.as_str()) {
            obeying.directives.push(code.clone());
            return ends(format!("503 {code}: may be resumed, not re-sent without a key"));
        }
        let now = tokio::time::Instant::now();
        let delay = match obeying.obey(refusal) {
            Ok(delay) if !self.keyed && now + delay > started + UNKEYED_DIRECTIVE_BUDGET => {
                return ends(format!("gave up after {code}: past the client's budget"));
            }
            Ok(delay) => delay,
            Err(_) if !self.keyed => return ends(format!("gave up after {code}: past its budget")),
            Err(last) => {
                resent.extend(std::mem::take(obeying).directives);
                resent.push(format!("resent: past the budget of {}", last.error));
                RESEND_PAUSE
            }
        };
        if now + delay >= started + TURN_DEADLINE {
            return ends(format!("gave up after {code}: past the turn's deadline"));
        }
        Next::Resend(delay)
    }
}

/// After a directive: re-send after this long, or the turn ends so.
enum Next {
    Resend(Duration),
    End(Outcome),
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
