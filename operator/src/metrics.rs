//! Operator metrics (`/metrics`) and health (`/healthz`).

use std::{net::SocketAddr, sync::Arc};

use axum::{routing::get, Router};
use leasehold_core::exposition;
use std::time::Duration;

use leasehold_core::store::{StatementObserver, StatementOutcome};
use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

/// Store statements are single-row or small indexed scans: sub-millisecond on a healthy
/// database, up to the 5 s statement timeout when it is not (the sidecar's buckets).
const STATEMENT_BUCKETS: [f64; 13] =
    [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabel {
    error: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClusterLabel {
    namespace: String,
    /// Not `cluster`: that name is a common Prometheus external label, and would collide.
    agentcluster: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatementLabels {
    statement: &'static str,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    outcome: String,
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciles: Counter,
    errors: Family<ErrorLabel, Counter>,
    drains: Family<Outcome, Counter>,
    revocations: Counter,
    leases: Family<ClusterLabel, Gauge>,
    collected_sessions: Counter,
    collected_nodes: Counter,
    collected_turns: Counter,
    statement_seconds: Family<StatementLabels, Histogram, fn() -> Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut root = Registry::default();
        let build_info = Family::<Vec<(&'static str, &'static str)>, Gauge>::default();
        build_info.get_or_create(&leasehold_core::build::labels()).set(1);
        let leasehold = root.sub_registry_with_prefix("leasehold");
        leasehold.register(
            "build_info",
            "The running build: version, and commit when known; always 1",
            build_info,
        );
        let m = Metrics {
            registry: Registry::default(),
            reconciles: Counter::default(),
            errors: Family::default(),
            drains: Family::default(),
            revocations: Counter::default(),
            leases: Family::default(),
            collected_sessions: Counter::default(),
            collected_nodes: Counter::default(),
            collected_turns: Counter::default(),
            statement_seconds: Family::new_with_constructor(|| Histogram::new(STATEMENT_BUCKETS)),
        };
        leasehold.register(
            "store_statement_seconds",
            "Lease store statements by statement (its context label) and outcome (ok, error, timeout)",
            m.statement_seconds.clone(),
        );
        let registry = root.sub_registry_with_prefix("leasehold_operator");
        registry.register("reconciles", "AgentCluster reconciliations", m.reconciles.clone());
        registry.register("errors", "Reconcile and pod-handling errors by kind", m.errors.clone());
        registry.register("drains", "Pod drains driven through the admin port, by outcome", m.drains.clone());
        registry.register(
            "revocations",
            "Leases revoked for pods reported gone or failed",
            m.revocations.clone(),
        );
        registry.register("leases", "Live session leases per AgentCluster", m.leases.clone());
        registry.register(
            "collected_sessions",
            "Sessions deleted by retention (nobody held them; idle past sessionRetention)",
            m.collected_sessions.clone(),
        );
        registry.register(
            "collected_nodes",
            "Node rows of long-dead sidecar processes deleted by retention",
            m.collected_nodes.clone(),
        );
        registry.register(
            "collected_turns",
            "Finished turns deleted with their answers and events by retention (past turns.answerRetention)",
            m.collected_turns.clone(),
        );
        Metrics { registry: root, ..m }
    }
}

impl Metrics {
    pub fn reconcile(&self) {
        self.reconciles.inc();
    }
    pub fn error(&self, label: &str) {
        self.errors.get_or_create(&ErrorLabel { error: label.to_owned() }).inc();
    }
    pub fn drain(&self, outcome: &str) {
        self.drains.get_or_create(&Outcome { outcome: outcome.to_owned() }).inc();
    }
    pub fn revoked(&self, sessions: u64) {
        self.revocations.inc_by(sessions);
    }
    pub fn collected(&self, sessions: u64, nodes: u64) {
        self.collected_sessions.inc_by(sessions);
        self.collected_nodes.inc_by(nodes);
    }
    pub fn collected_turns(&self, turns: u64) {
        self.collected_turns.inc_by(turns);
    }
    pub fn leases(&self, namespace: &str, cluster: &str, n: i64) {
        self.leases
            .get_or_create(&ClusterLabel {
                namespace: namespace.to_owned(),
                agentcluster: cluster.to_owned(),
            })
            .set(n);
    }
    pub fn encode(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

impl StatementObserver for Metrics {
    fn statement(&self, statement: &'static str, elapsed: Duration, outcome: StatementOutcome) {
        self.statement_seconds
            .get_or_create(&StatementLabels { statement, outcome: outcome.as_str() })
            .observe(elapsed.as_secs_f64());
    }
}

/// Serve `/metrics` and `/healthz` until the process ends.
pub async fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> std::io::Result<()> {
    let app = Router::new().route("/healthz", get(|| async { "ok" })).route(
        "/metrics",
        get(move |headers: http::HeaderMap| async move {
            let (content_type, body) = exposition::negotiate(&headers, metrics.encode());
            ([(http::header::CONTENT_TYPE, content_type)], body)
        }),
    );
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, app).await
}
