//! What a run found: faults by kind, turns by outcome, directives obeyed, anomalies; and
//! the table it prints.

use std::{collections::BTreeMap, fmt, time::Duration};

use super::{
    checker::Anomaly,
    record::{Outcome, SessionLog},
    schedule::FaultKind,
};

/// Anomalies listed one by one in the table (all are counted).
const LISTED_ANOMALIES: usize = 50;

/// Turns by final outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Turns {
    pub acknowledged: usize,
    pub ambiguous: usize,
    pub refused: usize,
    /// Still in flight when the run ended (counted as ambiguous by the checker).
    pub pending: usize,
    /// Answered against the contract (each is an anomaly too).
    pub unexpected: usize,
}

impl Turns {
    pub fn of(logs: &[SessionLog]) -> Turns {
        let mut turns = Turns::default();
        for turn in logs.iter().flat_map(|log| &log.turns) {
            match turn.outcome {
                Outcome::Acknowledged(_) => turns.acknowledged += 1,
                Outcome::Ambiguous(_) => turns.ambiguous += 1,
                Outcome::Refused(_) => turns.refused += 1,
                Outcome::Pending => turns.pending += 1,
                Outcome::Unexpected { .. } => turns.unexpected += 1,
            }
        }
        turns
    }

    pub fn total(&self) -> usize {
        self.acknowledged + self.ambiguous + self.refused + self.pending + self.unexpected
    }
}

#[derive(Debug, Clone)]
pub struct Report {
    pub seed: u64,
    pub nodes: usize,
    pub sessions: usize,
    /// Whether the clients sent idempotency keys.
    pub keyed: bool,
    pub lease_ttl: Duration,
    pub heartbeat: Duration,
    pub elapsed: Duration,
    /// Faults in the schedule; fewer are injected when the run's duration cut it short.
    pub planned: usize,
    /// Faults injected, by kind.
    pub faults: BTreeMap<FaultKind, usize>,
    /// Faults that could not be done or undone as planned (not anomalies of the system
    /// under test, but worth a look).
    pub fault_errors: Vec<String>,
    /// Kinds left out of the schedule, and why.
    pub skipped: Vec<(FaultKind, String)>,
    pub turns: Turns,
    /// Directives obeyed, by code.
    pub directives: BTreeMap<String, usize>,
    /// Why turns ended ambiguous or refused, by reason (a timeout, `502 owner_failed`...).
    pub reasons: BTreeMap<String, usize>,
    pub anomalies: Vec<Anomaly>,
}

impl Report {
    pub fn faults_injected(&self) -> usize {
        self.faults.values().sum()
    }

    /// Turns left without a known outcome (ambiguous, or in flight at the end). Keyed
    /// clients re-send until they know, so with them any is a failure of the run;
    /// without keys ambiguous turns are allowed.
    pub fn unresolved(&self) -> usize {
        self.turns.ambiguous + self.turns.pending
    }

    /// Anomalies by kind.
    pub fn anomaly_counts(&self) -> BTreeMap<&'static str, usize> {
        let mut counts = BTreeMap::new();
        for anomaly in &self.anomalies {
            *counts.entry(anomaly.kind()).or_default() += 1;
        }
        counts
    }
}

/// Directives and reasons of `logs`, by code and by reason (reasons shortened to their
/// first words so that a count means something).
pub fn tallies(logs: &[SessionLog]) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
    let (mut directives, mut reasons) = (BTreeMap::new(), BTreeMap::new());
    for turn in logs.iter().flat_map(|log| &log.turns) {
        for code in &turn.directives {
            *directives.entry(code.clone()).or_default() += 1;
        }
        let (outcome, why) = match &turn.outcome {
            Outcome::Ambiguous(why) => ("ambiguous", why),
            Outcome::Refused(why) => ("refused", why),
            _ => continue,
        };
        let reason = format!("{outcome}: {}", why.split(':').next().unwrap_or(why));
        *reasons.entry(reason).or_default() += 1;
    }
    (directives, reasons)
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Duration| d.as_millis();
        writeln!(f, "chaos run, seed {}", self.seed)?;
        writeln!(
            f,
            "  {} nodes, {} sessions ({}), lease ttl {} ms, heartbeat {} ms, {:.1} s",
            self.nodes,
            self.sessions,
            if self.keyed { "keyed clients" } else { "clients without idempotency keys" },
            ms(self.lease_ttl),
            ms(self.heartbeat),
            self.elapsed.as_secs_f64()
        )?;
        writeln!(f, "faults injected: {} of {} planned", self.faults_injected(), self.planned)?;
        for (kind, n) in &self.faults {
            writeln!(f, "  {:<24} {n:>6}", kind.name())?;
        }
        for (kind, why) in &self.skipped {
            writeln!(f, "  {:<24} {:>6}  ({why})", kind.name(), "-")?;
        }
        if !self.fault_errors.is_empty() {
            writeln!(f, "faults not done as planned: {}", self.fault_errors.len())?;
            for error in &self.fault_errors {
                writeln!(f, "  {error}")?;
            }
        }
        let t = &self.turns;
        writeln!(f, "turns: {}", t.total())?;
        writeln!(f, "  {:<24} {:>6}", "acknowledged", t.acknowledged)?;
        writeln!(f, "  {:<24} {:>6}", "ambiguous", t.ambiguous + t.pending)?;
        writeln!(f, "  {:<24} {:>6}", "refused", t.refused)?;
        writeln!(f, "  {:<24} {:>6}", "unexpected answer", t.unexpected)?;
        for (reason, n) in &self.reasons {
            writeln!(f, "    {reason:<40} {n:>6}")?;
        }
        if t.pending > 0 {
            writeln!(f, "    {:<40} {:>6}", "ambiguous: in flight at the end", t.pending)?;
        }
        writeln!(f, "directives obeyed: {}", self.directives.values().sum::<usize>())?;
        for (code, n) in &self.directives {
            writeln!(f, "  {code:<24} {n:>6}")?;
        }
        writeln!(f, "anomalies: {}", self.anomalies.len())?;
        for (kind, n) in self.anomaly_counts() {
            writeln!(f, "  {kind:<24} {n:>6}")?;
        }
        for anomaly in self.anomalies.iter().take(LISTED_ANOMALIES) {
            writeln!(f, "  - {anomaly}")?;
        }
        if self.anomalies.len() > LISTED_ANOMALIES {
            writeln!(f, "  ... and {} more", self.anomalies.len() - LISTED_ANOMALIES)?;
        }
        Ok(())
    }
}
