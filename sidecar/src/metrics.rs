//! Prometheus metrics of the sidecar (`GET /metrics` on the admin port).

use std::borrow::Cow;

use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

/// Label values: static names borrow, only dynamic ones (a peer's error code) allocate.
type Label = Cow<'static, str>;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    outcome: Label,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TurnLabels {
    path: Label,
    outcome: Label,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: Label,
}

/// A status code as a label value, without allocating for the usual ones.
pub fn status_label(status: http::StatusCode) -> Label {
    match status.as_u16() {
        200 => "200".into(),
        201 => "201".into(),
        202 => "202".into(),
        204 => "204".into(),
        400 => "400".into(),
        404 => "404".into(),
        409 => "409".into(),
        413 => "413".into(),
        422 => "422".into(),
        500 => "500".into(),
        _ => status.as_str().to_owned().into(),
    }
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    resolutions: Family<Outcome, Counter>,
    turns: Family<TurnLabels, Counter>,
    stand_downs: Family<Reason, Counter>,
    fenced_writes: Counter,
    store_errors: Counter,
    peer_auth_failures: Counter,
    peer_rejections: Counter,
    leases_held: Gauge,
    in_flight: Gauge,
    handed_back: Counter,
    observers: Gauge,
    upstreams: Gauge,
    observers_cut: Counter,
    hubs: Gauge,
    streams_refused: Counter,
    journal_batches: Counter,
    journal_events: Counter,
    turn_journal: Family<Outcome, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("leasehold");
        let m = Metrics {
            registry: Registry::default(),
            resolutions: Family::default(),
            turns: Family::default(),
            stand_downs: Family::default(),
            fenced_writes: Counter::default(),
            store_errors: Counter::default(),
            peer_auth_failures: Counter::default(),
            peer_rejections: Counter::default(),
            leases_held: Gauge::default(),
            in_flight: Gauge::default(),
            handed_back: Counter::default(),
            observers: Gauge::default(),
            upstreams: Gauge::default(),
            observers_cut: Counter::default(),
            hubs: Gauge::default(),
            streams_refused: Counter::default(),
            journal_batches: Counter::default(),
            journal_events: Counter::default(),
            turn_journal: Family::default(),
        };
        registry.register(
            "resolutions",
            "Ownership resolutions by outcome (fast_path costs no database statement)",
            m.resolutions.clone(),
        );
        registry.register(
            "turns",
            "Turns and events by path (local, forwarded) and outcome",
            m.turns.clone(),
        );
        registry.register("stand_downs", "Sessions stood down, by reason", m.stand_downs.clone());
        registry.register("fenced_writes", "Agent writes rejected by the fence", m.fenced_writes.clone());
        registry.register("store_errors", "Lease store statements that failed", m.store_errors.clone());
        registry.register(
            "peer_auth_failures",
            "Peer requests rejected with 401",
            m.peer_auth_failures.clone(),
        );
        registry.register(
            "peer_rejections",
            "Requests to other sidecars rejected with 401: this node's proof did not pass there \
             (cluster secrets differ, or clocks are apart by more than the proof window)",
            m.peer_rejections.clone(),
        );
        registry.register("leases_held", "Sessions held by this process", m.leases_held.clone());
        registry.register(
            "in_flight_turns",
            "Turns and events running on this node's agent",
            m.in_flight.clone(),
        );
        registry.register("handed_back", "Sessions handed back by drains", m.handed_back.clone());
        registry.register("observers", "Open /stream connections on this node", m.observers.clone());
        registry.register(
            "upstreams",
            "Upstream streams this node holds to other owners",
            m.upstreams.clone(),
        );
        registry.register(
            "observers_cut",
            "Observers cut for falling behind the buffer",
            m.observers_cut.clone(),
        );
        registry.register(
            "hubs",
            "Sessions with a hub on this node (owned or observed here, with their replay buffer)",
            m.hubs.clone(),
        );
        registry.register(
            "streams_refused",
            "Streams refused 503 overloaded: a node or per-session stream limit was reached",
            m.streams_refused.clone(),
        );
        registry.register(
            "journal_batches",
            "Statements that journaled published events (one group commit each)",
            m.journal_batches.clone(),
        );
        registry.register("journal_events", "Published events journaled", m.journal_events.clone());
        registry.register(
            "turn_journal",
            "Turns by what the journal made of them: started, resumed, replayed (a repeated \
             idempotency key answered from the journal), attached (to the running attempt), \
             reused (422), interrupted, cancelled",
            m.turn_journal.clone(),
        );
        Metrics { registry, ..m }
    }

    pub fn resolved(&self, outcome: &'static str) {
        self.resolutions.get_or_create(&Outcome { outcome: outcome.into() }).inc();
    }

    pub fn turn(&self, path: &'static str, outcome: impl Into<Label>) {
        self.turns.get_or_create(&TurnLabels { path: path.into(), outcome: outcome.into() }).inc();
    }

    /// A session stood down, for `reason` (`ownership::StandDownReason::as_str`).
    pub fn stood_down(&self, reason: &'static str) {
        self.stand_downs.get_or_create(&Reason { reason: reason.into() }).inc();
    }

    pub fn fenced_write(&self) {
        self.fenced_writes.inc();
    }

    pub fn store_error(&self) {
        self.store_errors.inc();
    }

    pub fn peer_auth_failure(&self) {
        self.peer_auth_failures.inc();
    }

    pub fn peer_rejected(&self) {
        self.peer_rejections.inc();
    }

    pub fn set_leases_held(&self, n: usize) {
        self.leases_held.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub fn set_in_flight(&self, n: usize) {
        self.in_flight.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub fn handed_back(&self, n: u64) {
        self.handed_back.inc_by(n);
    }

    pub fn observers(&self, delta: i64) {
        self.observers.inc_by(delta);
    }

    pub fn upstreams(&self, delta: i64) {
        self.upstreams.inc_by(delta);
    }

    pub fn observer_cut(&self) {
        self.observers_cut.inc();
    }

    pub fn stream_refused(&self) {
        self.streams_refused.inc();
    }

    /// One group commit of `events` published events.
    pub fn journal_batch(&self, events: usize) {
        self.journal_batches.inc();
        self.journal_events.inc_by(u64::try_from(events).unwrap_or(u64::MAX));
    }

    /// A turn's fate in the journal (`started`, `resumed`, `replayed`, ...).
    pub fn turn_journal(&self, outcome: &'static str) {
        self.turn_journal.get_or_create(&Outcome { outcome: outcome.into() }).inc();
    }

    /// The gauge the hubs keep at their number.
    pub fn hub_gauge(&self) -> Gauge {
        self.hubs.clone()
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_labels_are_the_three_digits() {
        for code in [200u16, 202, 409, 418, 502, 503] {
            let status = http::StatusCode::from_u16(code).unwrap();
            assert_eq!(status_label(status), code.to_string());
        }
        assert!(matches!(status_label(http::StatusCode::OK), Cow::Borrowed(_)));
    }
}
