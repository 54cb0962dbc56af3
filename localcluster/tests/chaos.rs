//! A short randomized fault run (the long one is `make chaos`): at least 30 faults of
//! every kind against three real sidecars and demo agents with a private Postgres, then
//! every session's history checked against what its client was told. No anomaly allowed,
//! and, with clients that send every turn with an idempotency key, no turn left ambiguous.
//! The seed is printed; `LEASEHOLD_CHAOS_SEED=<seed>` replays a run's schedule.

use std::time::{Duration, Instant};

use localcluster::chaos::{self, ChaosOptions};

/// The short run must fit in this on 2 cores (its fault phase is bounded below it).
const BUDGET: Duration = Duration::from_secs(180);
const MIN_FAULTS: usize = 30;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_short_chaos_run_finds_no_anomaly() {
    let seed = match std::env::var("LEASEHOLD_CHAOS_SEED") {
        Ok(seed) => seed.parse().expect("LEASEHOLD_CHAOS_SEED is a u64"),
        Err(_) => rand::random(),
    };
    eprintln!("chaos: seed {seed} (replay with LEASEHOLD_CHAOS_SEED={seed})");
    let started = Instant::now();
    let report = chaos::run(ChaosOptions::short(seed)).await.expect("the run itself");
    eprintln!("{report}");
    assert!(report.faults_injected() >= MIN_FAULTS, "seed {seed}: only {} faults", report.faults_injected());
    assert!(report.turns.acknowledged > 0, "seed {seed}: nothing was acknowledged");
    assert!(
        report.anomalies.is_empty(),
        "seed {seed}: {} anomalies: {:?}",
        report.anomalies.len(),
        report.anomaly_counts()
    );
    // Idempotent clients re-send until they have every turn's answer: none is left
    // ambiguous (nor in flight when the clients stopped).
    assert_eq!(
        (report.turns.ambiguous, report.turns.pending),
        (0, 0),
        "seed {seed}: turns left without a known outcome"
    );
    assert!(started.elapsed() < BUDGET, "seed {seed}: took {:?}", started.elapsed());
}
