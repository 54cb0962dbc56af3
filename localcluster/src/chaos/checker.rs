//! The history checker: every session's final history (its checkpoint) against what its
//! client was told. Pure: no process, no database; unit-tested on hand-made histories.
//!
//! The rules. An acknowledged turn is in the history exactly once, at the 1-based index
//! its answer reported (`history_len`), after every earlier acknowledged turn; epochs
//! never go backwards across a session's acknowledgements, and one epoch is one node's.
//! A turn that may have run (ambiguous, still pending, or answered against the contract)
//! is in the history at most once, and only after the last acknowledged turn sent before
//! it. A turn whose final outcome was a refusal is not in the history. Every entry of a
//! history is a turn some client sent. Every answer a turn gets is `200`, a directive
//! (obeyed), or `502 owner_failed`. One epoch of a session is one node's: no two nodes
//! acknowledged turns at it, nor were their agents sent turns at it (the demo agents'
//! `GET /session-epochs`).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt,
};

use super::record::{Outcome, SessionLog, TurnRecord};

/// Per node name, the (session, epoch) pairs its agents (all its boots) were sent turns at.
pub type AgentEpochs = BTreeMap<String, BTreeSet<(String, i64)>>;

/// Something that must never happen. Positions are 1-based, like `history_len`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Anomaly {
    /// A turn's text is in the history more than once: it ran twice.
    Duplicated { session: String, text: String, positions: Vec<usize> },
    /// An acknowledged turn is not in the history: a durable write was lost.
    Missing { session: String, text: String },
    /// An acknowledged turn is not where its answer said it was.
    WrongPosition { session: String, text: String, reported: usize, actual: usize },
    /// Two acknowledged turns are in the history in the other order than they were sent.
    OutOfOrder { session: String, earlier: String, later: String },
    /// A later acknowledgement carries a lower epoch than an earlier one.
    EpochBackwards { session: String, text: String, epoch: i64, before: i64 },
    /// Two nodes acknowledged turns of one session at the same epoch, or their agents
    /// were sent turns of it at the same epoch: two writers.
    TwoWritersAtEpoch { session: String, epoch: i64, nodes: Vec<String> },
    /// A turn whose final outcome was a refusal (or giving up) is in the history.
    RefusedButApplied { session: String, text: String, reason: String },
    /// A turn that may have run is in the history before the last acknowledged turn
    /// sent before it.
    AmbiguousMisplaced {
        session: String,
        text: String,
        position: usize,
        after: String,
        after_position: usize,
    },
    /// A history entry no client sent.
    Unknown { session: String, text: String, position: usize },
    /// An answer without a directive other than `502 owner_failed` or `502
    /// attempts_exhausted` (a `5xx` or `4xx`),
    /// or a `200` that is not the agent's answer.
    UnexpectedAnswer { session: String, text: String, status: u16, body: String },
}

impl Anomaly {
    /// A short name per kind, for the report's counts.
    pub fn kind(&self) -> &'static str {
        match self {
            Anomaly::Duplicated { .. } => "duplicated",
            Anomaly::Missing { .. } => "missing",
            Anomaly::WrongPosition { .. } => "wrong_position",
            Anomaly::OutOfOrder { .. } => "out_of_order",
            Anomaly::EpochBackwards { .. } => "epoch_backwards",
            Anomaly::TwoWritersAtEpoch { .. } => "two_writers_at_epoch",
            Anomaly::RefusedButApplied { .. } => "refused_but_applied",
            Anomaly::AmbiguousMisplaced { .. } => "ambiguous_misplaced",
            Anomaly::Unknown { .. } => "unknown_entry",
            Anomaly::UnexpectedAnswer { .. } => "unexpected_answer",
        }
    }
}

impl fmt::Display for Anomaly {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Anomaly::Duplicated { session, text, positions } => {
                write!(f, "{session}: {text} is in the history {} times, at {positions:?}", positions.len())
            }
            Anomaly::Missing { session, text } => {
                write!(f, "{session}: {text} was acknowledged but is not in the history")
            }
            Anomaly::WrongPosition { session, text, reported, actual } => {
                write!(f, "{session}: {text} was acknowledged at {reported} but is at {actual}")
            }
            Anomaly::OutOfOrder { session, earlier, later } => {
                write!(f, "{session}: {later} is in the history before {earlier}, acknowledged before it")
            }
            Anomaly::EpochBackwards { session, text, epoch, before } => {
                write!(f, "{session}: {text} was acknowledged at epoch {epoch} after one at epoch {before}")
            }
            Anomaly::TwoWritersAtEpoch { session, epoch, nodes } => {
                write!(
                    f,
                    "{session}: epoch {epoch} was held by {} (acknowledged or sent to their agents)",
                    nodes.join(" and ")
                )
            }
            Anomaly::RefusedButApplied { session, text, reason } => {
                write!(f, "{session}: {text} ended refused ({reason}) but is in the history")
            }
            Anomaly::AmbiguousMisplaced { session, text, position, after, after_position } => write!(
                f,
                "{session}: {text} (may have run) is at {position}, before {after} at {after_position}, \
                 acknowledged before it was sent"
            ),
            Anomaly::Unknown { session, text, position } => {
                write!(f, "{session}: {text} at {position} was never sent")
            }
            Anomaly::UnexpectedAnswer { session, text, status, body } => {
                write!(f, "{session}: {text} was answered {status} without a directive: {body}")
            }
        }
    }
}

/// Every anomaly of the run: `histories` (session key → its history) against `logs`, and
/// the (session, epoch) pairs each node's agents were sent turns at (`agents`). A session
/// with a log and no history has an empty one.
pub fn check(
    histories: &BTreeMap<String, Vec<String>>,
    logs: &[SessionLog],
    agents: &AgentEpochs,
) -> Vec<Anomaly> {
    // Session → epoch → the nodes whose agents were sent turns at it.
    let mut dispatched: BTreeMap<&str, Epochs> = BTreeMap::new();
    for (node, pairs) in agents {
        for (session, epoch) in pairs {
            dispatched.entry(session.as_str()).or_default().entry(*epoch).or_default().insert(node.as_str());
        }
    }
    let none = Epochs::new();
    let empty = Vec::new();
    let mut anomalies = Vec::new();
    let logged: BTreeSet<&str> = logs.iter().map(|l| l.key.as_str()).collect();
    for log in logs {
        let history = histories.get(&log.key).unwrap_or(&empty);
        let sent = dispatched.get(log.key.as_str()).unwrap_or(&none);
        anomalies.extend(check_session_with(&log.key, history, &log.turns, sent));
    }
    let unlogged: BTreeSet<&str> = histories
        .keys()
        .map(String::as_str)
        .chain(dispatched.keys().copied())
        .filter(|key| !logged.contains(key))
        .collect();
    for session in unlogged {
        let history = histories.get(session).unwrap_or(&empty);
        let sent = dispatched.get(session).unwrap_or(&none);
        anomalies.extend(check_session_with(session, history, &[], sent));
    }
    anomalies
}

/// Epoch → the nodes seen at it.
type Epochs<'a> = BTreeMap<i64, BTreeSet<&'a str>>;

/// The anomalies of one session, from its history and its client's log alone.
pub fn check_session(session: &str, history: &[String], turns: &[TurnRecord]) -> Vec<Anomaly> {
    check_session_with(session, history, turns, &Epochs::new())
}

/// The anomalies of one session; `sent`: the nodes whose agents were sent turns of it,
/// by epoch.
fn check_session_with(
    session: &str,
    history: &[String],
    turns: &[TurnRecord],
    sent: &Epochs,
) -> Vec<Anomaly> {
    let mut found = Vec::new();
    let session = session.to_owned();
    // Where each text is (1-based), in history order.
    let mut positions: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, text) in history.iter().enumerate() {
        positions.entry(text.as_str()).or_default().push(i + 1);
    }
    let by_text: HashMap<&str, &TurnRecord> = turns.iter().map(|t| (t.text.as_str(), t)).collect();
    for (i, text) in history.iter().enumerate() {
        let first = positions[text.as_str()][0];
        if first == i + 1 && positions[text.as_str()].len() > 1 {
            let positions = positions[text.as_str()].clone();
            found.push(Anomaly::Duplicated { session: session.clone(), text: text.clone(), positions });
        }
        if !by_text.contains_key(text.as_str()) {
            found.push(Anomaly::Unknown { session: session.clone(), text: text.clone(), position: i + 1 });
        }
    }
    let at = |text: &str| positions.get(text).map(|p| p[0]);

    let mut ordered: Vec<&TurnRecord> = turns.iter().collect();
    ordered.sort_by_key(|t| t.n);
    // The last acknowledged turn so far that is in the history: (text, position).
    let mut last_present: Option<(&str, usize)> = None;
    // The last acknowledged turn so far: (text, epoch).
    let mut last_epoch: Option<(&str, i64)> = None;
    let mut writers: Epochs = sent.clone();
    for turn in ordered {
        let text = turn.text.as_str();
        match &turn.outcome {
            Outcome::Acknowledged(ack) => {
                writers.entry(ack.epoch).or_default().insert(ack.node.as_str());
                if let Some((_, before)) = last_epoch.filter(|(_, before)| ack.epoch < *before) {
                    found.push(Anomaly::EpochBackwards {
                        session: session.clone(),
                        text: text.to_owned(),
                        epoch: ack.epoch,
                        before,
                    });
                }
                last_epoch = Some((text, ack.epoch));
                let Some(actual) = at(text) else {
                    found.push(Anomaly::Missing { session: session.clone(), text: text.to_owned() });
                    continue;
                };
                if actual != ack.history_len {
                    found.push(Anomaly::WrongPosition {
                        session: session.clone(),
                        text: text.to_owned(),
                        reported: ack.history_len,
                        actual,
                    });
                }
                if let Some((earlier, _)) = last_present.filter(|(_, position)| actual < *position) {
                    found.push(Anomaly::OutOfOrder {
                        session: session.clone(),
                        earlier: earlier.to_owned(),
                        later: text.to_owned(),
                    });
                }
                if last_present.is_none_or(|(_, position)| actual > position) {
                    last_present = Some((text, actual));
                }
            }
            Outcome::Refused(reason) => {
                if at(text).is_some() {
                    found.push(Anomaly::RefusedButApplied {
                        session: session.clone(),
                        text: text.to_owned(),
                        reason: reason.clone(),
                    });
                }
            }
            may_have_run => {
                if let Outcome::Unexpected { status, body } = may_have_run {
                    found.push(Anomaly::UnexpectedAnswer {
                        session: session.clone(),
                        text: text.to_owned(),
                        status: *status,
                        body: body.clone(),
                    });
                }
                let (Some(position), Some((after, after_position))) = (at(text), last_present) else {
                    continue;
                };
                if position < after_position {
                    found.push(Anomaly::AmbiguousMisplaced {
                        session: session.clone(),
                        text: text.to_owned(),
                        position,
                        after: after.to_owned(),
                        after_position,
                    });
                }
            }
        }
    }
    for (epoch, nodes) in writers.into_iter().filter(|(_, nodes)| nodes.len() > 1) {
        let nodes = nodes.into_iter().map(str::to_owned).collect();
        found.push(Anomaly::TwoWritersAtEpoch { session: session.clone(), epoch, nodes });
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::record::{turn_text, Ack};

    const KEY: &str = "s0";

    fn text(n: u32) -> String {
        turn_text(KEY, n)
    }

    fn ack(n: u32, history_len: usize, epoch: i64, node: &str) -> TurnRecord {
        let outcome = Outcome::Acknowledged(Ack { history_len, epoch, node: node.to_owned() });
        TurnRecord { n, text: text(n), directives: Vec::new(), outcome }
    }

    fn ended(n: u32, outcome: Outcome) -> TurnRecord {
        TurnRecord { n, text: text(n), directives: Vec::new(), outcome }
    }

    fn ambiguous(n: u32) -> TurnRecord {
        ended(n, Outcome::Ambiguous("502 owner_failed".into()))
    }

    fn refused(n: u32) -> TurnRecord {
        ended(n, Outcome::Refused("gave up after takeover_pending".into()))
    }

    fn history(turns: &[u32]) -> Vec<String> {
        turns.iter().map(|&n| text(n)).collect()
    }

    fn kinds(history: &[String], turns: &[TurnRecord]) -> Vec<&'static str> {
        check_session(KEY, history, turns).iter().map(Anomaly::kind).collect()
    }

    /// Acknowledged, ambiguous (in and out), refused (out), across a takeover.
    fn clean_run() -> (Vec<String>, Vec<TurnRecord>) {
        let turns = vec![
            ack(1, 1, 1, "node-a"),
            ambiguous(2), // ran before the freeze
            ack(3, 3, 2, "node-b"),
            refused(4),
            ambiguous(5), // did not run
            ack(6, 4, 2, "node-b"),
            ambiguous(7), // timed out on the way, reached the owner after the next one
            ack(8, 5, 2, "node-b"),
            ended(9, Outcome::Pending),
        ];
        (history(&[1, 2, 3, 6, 8, 7]), turns)
    }

    #[test]
    fn a_clean_run_has_no_anomaly() {
        let (history, turns) = clean_run();
        assert_eq!(check_session(KEY, &history, &turns), []);
        let histories = BTreeMap::from([(KEY.to_owned(), history)]);
        assert_eq!(check(&histories, &[SessionLog { key: KEY.into(), turns }], &AgentEpochs::new()), []);
    }

    #[test]
    fn a_turn_twice_in_the_history_is_duplicated() {
        let turns = [ack(1, 1, 1, "node-a"), ambiguous(2), ack(3, 4, 1, "node-a")];
        let found = check_session(KEY, &history(&[1, 2, 2, 3]), &turns);
        assert_eq!(
            found,
            [Anomaly::Duplicated { session: KEY.into(), text: text(2), positions: vec![2, 3] }],
            "an ambiguous turn at most once"
        );
        let turns = [ack(1, 1, 1, "node-a"), ack(2, 3, 2, "node-b")];
        assert_eq!(kinds(&history(&[1, 2, 1]), &turns), ["duplicated", "wrong_position"]);
    }

    #[test]
    fn an_acknowledged_turn_not_in_the_history_is_missing() {
        let turns = [ack(1, 1, 1, "node-a"), ack(2, 2, 1, "node-a"), ack(3, 2, 2, "node-b")];
        let found = check_session(KEY, &history(&[1, 3]), &turns);
        assert_eq!(found, [Anomaly::Missing { session: KEY.into(), text: text(2) }]);
        assert_eq!(kinds(&[], &turns), ["missing", "missing", "missing"], "no checkpoint at all");
    }

    #[test]
    fn an_acknowledged_turn_elsewhere_than_reported_is_at_the_wrong_position() {
        let turns = [ack(1, 1, 1, "node-a"), ambiguous(2), ack(3, 2, 1, "node-a")];
        let found = check_session(KEY, &history(&[1, 2, 3]), &turns);
        assert_eq!(
            found,
            [Anomaly::WrongPosition { session: KEY.into(), text: text(3), reported: 2, actual: 3 }]
        );
    }

    #[test]
    fn acknowledged_turns_in_the_other_order_are_out_of_order() {
        let turns = [ack(1, 1, 1, "node-a"), ack(2, 2, 1, "node-a")];
        let found = check_session(KEY, &history(&[2, 1]), &turns);
        assert!(
            found.contains(&Anomaly::OutOfOrder { session: KEY.into(), earlier: text(1), later: text(2) }),
            "{found:?}"
        );
        // Out of order even when each is where its answer said (the history was rewritten).
        let turns = [ack(1, 2, 1, "node-a"), ack(2, 1, 1, "node-a")];
        assert_eq!(kinds(&history(&[2, 1]), &turns), ["out_of_order"]);
    }

    #[test]
    fn a_lower_epoch_after_a_higher_one_goes_backwards() {
        let turns = [ack(1, 1, 2, "node-b"), ack(2, 2, 1, "node-a")];
        let found = check_session(KEY, &history(&[1, 2]), &turns);
        assert_eq!(
            found,
            [Anomaly::EpochBackwards { session: KEY.into(), text: text(2), epoch: 1, before: 2 }]
        );
    }

    #[test]
    fn two_nodes_acknowledging_one_epoch_are_two_writers() {
        let turns = [ack(1, 1, 1, "node-a"), ack(2, 2, 1, "node-b"), ack(3, 3, 1, "node-a")];
        let found = check_session(KEY, &history(&[1, 2, 3]), &turns);
        assert_eq!(
            found,
            [Anomaly::TwoWritersAtEpoch {
                session: KEY.into(),
                epoch: 1,
                nodes: vec!["node-a".into(), "node-b".into()]
            }]
        );
    }

    fn agents(seen: &[(&str, &[(&str, i64)])]) -> AgentEpochs {
        seen.iter()
            .map(|(node, pairs)| (node.to_string(), pairs.iter().map(|(s, e)| (s.to_string(), *e)).collect()))
            .collect()
    }

    #[test]
    fn two_agents_sent_turns_of_one_epoch_are_two_writers() {
        let (history, turns) = clean_run(); // epoch 1 on node-a, 2 on node-b
        let logs = [SessionLog { key: KEY.into(), turns }];
        let histories = BTreeMap::from([(KEY.to_owned(), history)]);
        // What the agents saw agrees with the acknowledgements (and node-c saw another
        // session, and an epoch of ours nobody acknowledged): clean.
        let agreeing =
            agents(&[("node-a", &[(KEY, 1)]), ("node-b", &[(KEY, 2), (KEY, 3)]), ("node-c", &[("s1", 2)])]);
        assert_eq!(check(&histories, &logs, &agreeing), []);
        // node-c's agent was sent a turn of ours at epoch 2, which node-b acknowledged.
        let planted = agents(&[("node-a", &[(KEY, 1)]), ("node-b", &[(KEY, 2)]), ("node-c", &[(KEY, 2)])]);
        assert_eq!(
            check(&histories, &logs, &planted),
            [Anomaly::TwoWritersAtEpoch {
                session: KEY.into(),
                epoch: 2,
                nodes: vec!["node-b".into(), "node-c".into()]
            }]
        );
        // Two agents at an epoch no client was acknowledged at, of a session no client
        // logged: still two writers.
        let unlogged = agents(&[("node-a", &[("s7", 4)]), ("node-b", &[("s7", 4)])]);
        let found = check(&histories, &logs, &unlogged);
        assert_eq!(
            found,
            [Anomaly::TwoWritersAtEpoch {
                session: "s7".into(),
                epoch: 4,
                nodes: vec!["node-a".into(), "node-b".into()]
            }]
        );
        assert!(found[0].to_string().contains("s7: epoch 4 was held by node-a and node-b"), "{}", found[0]);
    }

    #[test]
    fn a_refused_turn_in_the_history_was_applied() {
        let turns = [ack(1, 1, 1, "node-a"), refused(2), ack(3, 3, 1, "node-a")];
        let found = check_session(KEY, &history(&[1, 2, 3]), &turns);
        assert_eq!(
            found,
            [Anomaly::RefusedButApplied {
                session: KEY.into(),
                text: text(2),
                reason: "gave up after takeover_pending".into()
            }]
        );
        let unreachable = ended(2, Outcome::Refused("no node accepted a connection".into()));
        assert_eq!(kinds(&history(&[1, 2]), &[ack(1, 1, 1, "node-a"), unreachable]), ["refused_but_applied"]);
    }

    #[test]
    fn a_turn_that_may_have_run_before_an_earlier_acknowledgement_is_misplaced() {
        let turns = [ack(1, 1, 1, "node-a"), ack(2, 3, 1, "node-a"), ambiguous(3)];
        let found = check_session(KEY, &history(&[1, 3, 2]), &turns);
        assert!(
            found.contains(&Anomaly::AmbiguousMisplaced {
                session: KEY.into(),
                text: text(3),
                position: 2,
                after: text(2),
                after_position: 3
            }),
            "{found:?}"
        );
        let pending = [ack(1, 2, 1, "node-a"), ended(2, Outcome::Pending)];
        assert_eq!(kinds(&history(&[2, 1]), &pending), ["ambiguous_misplaced"], "pending alike");
    }

    #[test]
    fn an_entry_no_client_sent_is_unknown() {
        let turns = [ack(1, 1, 1, "node-a")];
        let mut entries = history(&[1]);
        entries.push("event:zombie".into());
        let found = check_session(KEY, &entries, &turns);
        assert_eq!(
            found,
            [Anomaly::Unknown { session: KEY.into(), text: "event:zombie".into(), position: 2 }]
        );
        let histories = BTreeMap::from([("s9".to_owned(), vec!["s9-t1".to_owned()])]);
        assert_eq!(
            check(&histories, &[], &AgentEpochs::new()).iter().map(Anomaly::kind).collect::<Vec<_>>(),
            ["unknown_entry"]
        );
    }

    #[test]
    fn an_error_without_a_directive_is_unexpected_whether_or_not_it_ran() {
        let undirected =
            |n| ended(n, Outcome::Unexpected { status: 500, body: "{\"error\":\"internal\"}".into() });
        let turns = [ack(1, 1, 1, "node-a"), undirected(2), undirected(3)];
        let found = check_session(KEY, &history(&[1, 2]), &turns);
        assert_eq!(
            found.iter().map(Anomaly::kind).collect::<Vec<_>>(),
            ["unexpected_answer", "unexpected_answer"]
        );
        assert!(found[0].to_string().contains("answered 500 without a directive"), "{}", found[0]);
    }
}
