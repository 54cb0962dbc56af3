//! What a session's client saw: one record per turn, in the order the turns were sent.
//! The driver writes these; the checker reads them next to the histories.

use serde::Deserialize;

/// The demo agent's answer to a turn (CONTRACT §4a): `history_len` is the 1-based index
/// of the turn's text in the session's history when it was written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Ack {
    pub history_len: usize,
    pub epoch: i64,
    pub node: String,
}

/// How a turn ended for its client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Still in flight when the run ended (the client was stopped): it may have run.
    Pending,
    /// `200` with the agent's answer: the turn ran and is durable.
    Acknowledged(Ack),
    /// It may have run: a timeout or a broken connection after the request was sent, a
    /// body cut short, or `502 owner_failed`. Never sent again.
    Ambiguous(String),
    /// It did not run: the last directive's budget ran out, or no node accepted a
    /// connection (so nothing was sent).
    Refused(String),
    /// An answer the contract does not allow for a turn (a non-`200` without a
    /// directive other than `502 owner_failed`, or a `200` that is not the agent's
    /// answer). It may have run; the checker reports it.
    Unexpected { status: u16, body: String },
}

impl Outcome {
    /// Whether the turn may be in the history without anything being wrong.
    pub fn may_have_run(&self) -> bool {
        matches!(self, Outcome::Pending | Outcome::Ambiguous(_) | Outcome::Unexpected { .. })
    }
}

/// One turn of a session: its number (1, 2, ...), its unique text, the directives its
/// client obeyed on the way, and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnRecord {
    pub n: u32,
    pub text: String,
    pub directives: Vec<String>,
    pub outcome: Outcome,
}

/// Every turn one session's client sent, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionLog {
    pub key: String,
    pub turns: Vec<TurnRecord>,
}

/// The text of turn `n` of session `key`: unique across the run (`s3-t17`).
pub fn turn_text(key: &str, n: u32) -> String {
    format!("{key}-t{n}")
}
