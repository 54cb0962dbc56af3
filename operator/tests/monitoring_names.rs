//! Every `leasehold_operator_*` metric the chart's alerts and Grafana dashboard query is a
//! series of the operator's real exposition (the sidecar's tests check the other names).

use std::time::Duration;

use leasehold_core::{
    exposition::{names_used, series_names},
    store::{StatementObserver, StatementOutcome},
};
use leasehold_operator::metrics::Metrics;

/// The operator's metrics with a sample in every labelled family: a family without one
/// has no `# TYPE` line yet.
fn exposition() -> String {
    let m = Metrics::default();
    m.error("kube");
    m.drain("failed");
    m.leases("team-a", "chat", 1);
    m.statement("count leases by node", Duration::from_millis(1), StatementOutcome::Ok);
    m.encode()
}

const FILES: [&str; 3] = ["prometheus-rules.yaml", "prometheus-rules.test.yaml", "dashboard.json"];

#[test]
fn every_operator_metric_the_alerts_and_dashboard_use_exists() {
    let exposed = series_names(&exposition());
    assert!(exposed.contains("leasehold_build_info"), "{exposed:?}");
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../charts/leasehold/files");
    let mut checked = 0;
    for file in FILES {
        let text = std::fs::read_to_string(format!("{dir}/{file}")).unwrap_or_else(|e| panic!("{file}: {e}"));
        let used = names_used(&text, "leasehold_operator_");
        let missing: Vec<_> = used.iter().filter(|name| !exposed.contains(**name)).collect();
        assert!(missing.is_empty(), "{file} queries metrics the operator does not expose: {missing:?}");
        checked += used.len();
    }
    assert!(checked >= 4, "only {checked} operator metric names found: is the extraction broken?");
}
