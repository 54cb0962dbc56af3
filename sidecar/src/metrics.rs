//! Prometheus metrics of the sidecar (`GET /metrics` on the admin port).

use std::{
    borrow::Cow,
    sync::{atomic::AtomicU64, OnceLock},
    time::Duration,
};

use leasehold_core::store::{StatementObserver, StatementOutcome};
use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};
use tokio::sync::watch;

use crate::heartbeat::NodeState;

/// Turn durations: an agent turn is a model call, from milliseconds (a cached or refused
/// turn) to minutes; up to the 300 s peer response timeout.
const TURN_BUCKETS: [f64; 15] =
    [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];
/// A forward hop waits for the owner's answer, so it spans the turn's own range; its low
/// end (a refusal, an unreachable owner) is the hop's overhead: the same buckets.
const HOP_BUCKETS: [f64; 15] = TURN_BUCKETS;
/// Store statements are single-row and indexed: sub-millisecond on a healthy database, up
/// to the 5 s statement timeout when it is not.
const STATEMENT_BUCKETS: [f64; 13] =
    [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

fn histograms<L: Clone + std::hash::Hash + Eq>(buckets: fn() -> Histogram) -> Histograms<L> {
    Family::new_with_constructor(buckets)
}

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

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HopLabels {
    result: Label,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatementLabels {
    statement: Label,
    outcome: Label,
}

/// The labels of `leasehold_build_info`.
type BuildLabels = Vec<(&'static str, &'static str)>;

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
    drain_timeouts: Counter,
    observers: Gauge,
    upstreams: Gauge,
    observers_cut: Counter,
    hubs: Gauge,
    streams_refused: Counter,
    journal_batches: Counter,
    journal_events: Counter,
    turn_journal: Family<Outcome, Counter>,
    turn_seconds: Histograms<TurnLabels>,
    hop_seconds: Histograms<HopLabels>,
    statement_seconds: Histograms<StatementLabels>,
    heartbeat_age: Gauge<f64, AtomicU64>,
    lease_ttl: Gauge<f64, AtomicU64>,
    /// The heartbeat's state, read at each scrape for the age of the last renewal.
    node: OnceLock<watch::Receiver<NodeState>>,
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
            drain_timeouts: Counter::default(),
            observers: Gauge::default(),
            upstreams: Gauge::default(),
            observers_cut: Counter::default(),
            hubs: Gauge::default(),
            streams_refused: Counter::default(),
            journal_batches: Counter::default(),
            journal_events: Counter::default(),
            turn_journal: Family::default(),
            turn_seconds: histograms(|| Histogram::new(TURN_BUCKETS)),
            hop_seconds: histograms(|| Histogram::new(HOP_BUCKETS)),
            statement_seconds: histograms(|| Histogram::new(STATEMENT_BUCKETS)),
            heartbeat_age: Gauge::default(),
            lease_ttl: Gauge::default(),
            node: OnceLock::new(),
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
        registry.register(
            "drain_timeouts",
            "Drains whose in-flight turns did not finish within the drain timeout (the rest were stood down)",
            m.drain_timeouts.clone(),
        );
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
             reused (422), interrupted, cancelled, exhausted (recorded as attempts_exhausted), \
             followed (a fenced turn taken to the next owner)",
            m.turn_journal.clone(),
        );
        registry.register(
            "turn_duration_seconds",
            "Time from a turn's arrival to its answer, by path (local: ran on this node's agent; \
             forwarded: sent to its owner; none: refused before either) and outcome class \
             (answered, refused, failed, interrupted)",
            m.turn_seconds.clone(),
        );
        registry.register(
            "forward_hop_seconds",
            "One forward hop to the owner's peer port, until its answer (so it includes the \
             turn there), by result (answered, failed, not_connected, owner_gone)",
            m.hop_seconds.clone(),
        );
        registry.register(
            "store_statement_seconds",
            "Lease store statements by statement (its context label) and outcome (ok, error, timeout)",
            m.statement_seconds.clone(),
        );
        registry.register(
            "heartbeat_age_seconds",
            "Seconds since the last successful node-lease renewal was sent; the node lease \
             lapses when it passes leasehold_node_lease_ttl_seconds",
            m.heartbeat_age.clone(),
        );
        registry.register("node_lease_ttl_seconds", "The node lease TTL (--lease-ttl)", m.lease_ttl.clone());
        let build_info = Family::<BuildLabels, Gauge>::default();
        build_info.get_or_create(&leasehold_core::build::labels()).set(1);
        registry.register(
            "build_info",
            "The running build: version, and commit when known; always 1",
            build_info,
        );
        Metrics { registry, ..m }
    }

    /// Report the heartbeat's renewals (their age, at each scrape) against `ttl`.
    pub fn watch_heartbeat(&self, node: watch::Receiver<NodeState>, ttl: Duration) {
        self.lease_ttl.set(ttl.as_secs_f64());
        let _ = self.node.set(node); // one heartbeat per process; a second call changes nothing
    }

    /// A turn answered after `elapsed`, by path and outcome class.
    pub fn turn_took(&self, path: &'static str, class: &'static str, elapsed: Duration) {
        self.turn_seconds
            .get_or_create(&TurnLabels { path: path.into(), outcome: class.into() })
            .observe(elapsed.as_secs_f64());
    }

    /// One forward hop took `elapsed`, ending in `result`.
    pub fn hop_took(&self, result: &'static str, elapsed: Duration) {
        self.hop_seconds.get_or_create(&HopLabels { result: result.into() }).observe(elapsed.as_secs_f64());
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

    pub fn drain_timed_out(&self) {
        self.drain_timeouts.inc();
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
        if let Some(renewed) = self.node.get().and_then(|node| node.borrow().renewed) {
            self.heartbeat_age.set(renewed.elapsed().as_secs_f64());
        }
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

impl StatementObserver for Metrics {
    fn statement(&self, statement: &'static str, elapsed: Duration, outcome: StatementOutcome) {
        self.statement_seconds
            .get_or_create(&StatementLabels { statement: statement.into(), outcome: outcome.as_str().into() })
            .observe(elapsed.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    /// The value of the sample `name{labels}` in `text`, if exposed.
    fn sample(text: &str, name: &str, labels: &str) -> Option<f64> {
        let want = if labels.is_empty() { name.to_owned() } else { format!("{name}{{{labels}}}") };
        text.lines().find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            (series == want).then(|| value.parse().ok())?
        })
    }

    #[test]
    fn the_histograms_record_into_their_buckets() {
        let m = Metrics::new();
        m.turn_took("local", "answered", Duration::from_millis(30));
        m.turn_took("local", "answered", Duration::from_secs(3));
        m.hop_took("answered", Duration::from_millis(7));
        m.statement("claim", Duration::from_micros(800), StatementOutcome::Ok);
        m.statement("claim", Duration::from_secs(5), StatementOutcome::Timeout);
        let text = m.encode();
        let turn = "leasehold_turn_duration_seconds";
        assert_eq!(sample(&text, &format!("{turn}_count"), r#"path="local",outcome="answered""#), Some(2.0));
        let sum = sample(&text, &format!("{turn}_sum"), r#"path="local",outcome="answered""#).unwrap();
        assert!((sum - 3.03).abs() < 1e-9, "{sum}");
        // 30 ms is above the 25 ms bucket and within 50 ms; 3 s within 5 s.
        let bucket = |le: &str| {
            sample(&text, &format!("{turn}_bucket"), &format!(r#"le="{le}",path="local",outcome="answered""#))
        };
        assert_eq!(
            (bucket("0.025"), bucket("0.05"), bucket("2.5"), bucket("5.0")),
            (Some(0.0), Some(1.0), Some(1.0), Some(2.0))
        );
        assert_eq!(sample(&text, "leasehold_forward_hop_seconds_count", r#"result="answered""#), Some(1.0));
        let statement = "leasehold_store_statement_seconds_count";
        assert_eq!(sample(&text, statement, r#"statement="claim",outcome="ok""#), Some(1.0));
        assert_eq!(sample(&text, statement, r#"statement="claim",outcome="timeout""#), Some(1.0));
    }

    #[test]
    fn build_info_is_one_with_the_version() {
        let text = Metrics::new().encode();
        let labels = match leasehold_core::build::COMMIT {
            Some(commit) if !commit.is_empty() => {
                format!(r#"version="{}",commit="{commit}""#, env!("CARGO_PKG_VERSION"))
            }
            _ => format!(r#"version="{}""#, env!("CARGO_PKG_VERSION")),
        };
        assert_eq!(sample(&text, "leasehold_build_info", &labels), Some(1.0), "{text}");
    }

    #[tokio::test(start_paused = true)]
    async fn heartbeat_age_is_the_time_since_the_last_renewal() {
        let m = Metrics::new();
        let renewed = Instant::now();
        let owner = leasehold_core::Owner::from_parts("n", "b");
        let (tx, rx) = watch::channel(NodeState {
            owner,
            live_until: None,
            store_reachable: true,
            renewed: Some(renewed),
        });
        m.watch_heartbeat(rx, Duration::from_secs(15));
        tokio::time::advance(Duration::from_secs(4)).await;
        let text = m.encode();
        assert_eq!(sample(&text, "leasehold_heartbeat_age_seconds", ""), Some(4.0));
        assert_eq!(sample(&text, "leasehold_node_lease_ttl_seconds", ""), Some(15.0));
        tx.send_modify(|s| s.renewed = Some(Instant::now()));
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(sample(&m.encode(), "leasehold_heartbeat_age_seconds", ""), Some(0.5));
    }

    #[test]
    fn status_labels_are_the_three_digits() {
        for code in [200u16, 202, 409, 418, 502, 503] {
            let status = http::StatusCode::from_u16(code).unwrap();
            assert_eq!(status_label(status), code.to_string());
        }
        assert!(matches!(status_label(http::StatusCode::OK), Cow::Borrowed(_)));
    }
}
