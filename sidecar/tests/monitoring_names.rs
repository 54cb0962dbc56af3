//! Every metric the chart's alerts and Grafana dashboard query exists: a misspelled or
//! renamed metric would leave an alert that never fires and an empty panel. The sidecar's
//! side: each `leasehold_*` name outside `leasehold_operator_*` must be a series of the
//! sidecar's real exposition (the operator's tests check the rest).

use std::time::Duration;

use leasehold_core::{
    exposition::{names_used, series_names},
    store::{StatementObserver, StatementOutcome},
};
use leasehold_sidecar::metrics::Metrics;

/// The sidecar's metrics with a sample in every labelled family: a family without one
/// has no `# TYPE` line yet.
fn exposition() -> String {
    let m = Metrics::new();
    m.resolved("fast_path");
    m.turn("local", "200");
    m.stood_down("lapsed");
    m.turn_journal("started");
    m.turn_took("local", "answered", Duration::from_millis(5));
    m.hop_took("answered", Duration::from_millis(5));
    m.statement("claim", Duration::from_millis(1), StatementOutcome::Ok);
    m.encode()
}

const FILES: [&str; 3] = ["prometheus-rules.yaml", "prometheus-rules.test.yaml", "dashboard.json"];

#[test]
fn every_sidecar_metric_the_alerts_and_dashboard_use_exists() {
    let exposed = series_names(&exposition());
    assert!(exposed.contains("leasehold_turn_duration_seconds_count"), "{exposed:?}");
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../charts/leasehold/files");
    let mut checked = 0;
    for file in FILES {
        let text = std::fs::read_to_string(format!("{dir}/{file}")).unwrap_or_else(|e| panic!("{file}: {e}"));
        let used = names_used(&text, "leasehold_");
        let missing: Vec<_> = used
            .iter()
            .filter(|name| !name.starts_with("leasehold_operator_") && !exposed.contains(**name))
            .collect();
        assert!(missing.is_empty(), "{file} queries metrics the sidecar does not expose: {missing:?}");
        checked += used.len();
    }
    assert!(checked > 10, "only {checked} metric names found: is the extraction broken?");
}
