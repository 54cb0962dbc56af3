//! Short randomized fault runs (the long one is `make chaos`) against three real sidecars
//! and demo agents with a private Postgres, every session's history then checked against
//! what its client was told:
//!
//! - keyed clients (every turn with an idempotency key): at least 30 faults of every kind,
//!   no anomaly, and no turn left ambiguous;
//! - clients without a key: fewer faults, no anomaly (ambiguous turns allowed: such a
//!   client never re-sends a turn that may have been received);
//! - the checker's self-test: the same kind of run against sidecars whose checkpoint fence
//!   is turned off (a debug-build failpoint) must report anomalies, or the checker proves
//!   nothing.
//!
//! The seed is printed; `LEASEHOLD_CHAOS_SEED=<seed>` replays a run's schedule. The runs
//! take turns (each wants the two cores to itself).

use std::time::{Duration, Instant};

use localcluster::chaos::{self, ChaosOptions, FaultKind};

/// The keyed run must fit in this on 2 cores (its fault phase is bounded below it).
const BUDGET: Duration = Duration::from_secs(180);
/// The unkeyed run and the self-test are shorter (fewer faults): each must fit in this.
const SHORT_BUDGET: Duration = Duration::from_secs(120);
const MIN_FAULTS: usize = 30;

/// One run at a time: they share two cores, and a starved run's timings are not a test.
static ONE_RUN_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn seed() -> u64 {
    let seed = match std::env::var("LEASEHOLD_CHAOS_SEED") {
        Ok(seed) => seed.parse().expect("LEASEHOLD_CHAOS_SEED is a u64"),
        Err(_) => rand::random(),
    };
    eprintln!("chaos: seed {seed} (replay with LEASEHOLD_CHAOS_SEED={seed})");
    seed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_short_chaos_run_finds_no_anomaly() {
    let _turn = ONE_RUN_AT_A_TIME.lock().await;
    let seed = seed();
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

/// Clients without an idempotency key: a turn that may have been received is never
/// re-sent (ambiguous is allowed), one refused past its directives' budget must not have
/// run, and nothing else may go wrong either.
///
/// It found a defect: turns answered `503 store_unavailable` (a directive: "not run now")
/// that nevertheless ran, so an unkeyed client's obedient re-send ran them twice (seed
/// 11: 3 duplicated, 1 refused_but_applied). The sidecar's journal insert had committed
/// but its answer was lost to a store fault, and the journaled turn was then resumed as
/// an orphan. Such a failure is now answered `fenced` (it may run, under its id; the door
/// follows it once), never `store_unavailable` (`store::Error::may_have_landed`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_short_chaos_run_without_keys_finds_no_anomaly() {
    let _turn = ONE_RUN_AT_A_TIME.lock().await;
    let seed = seed();
    let started = Instant::now();
    let options = ChaosOptions::short_unkeyed(seed);
    let kinds = options.kinds.len();
    let report = chaos::run(options).await.expect("the run itself");
    eprintln!("{report}");
    assert!(!report.keyed);
    assert!(report.faults.len() + report.skipped.len() >= kinds, "seed {seed}: a kind was never injected");
    assert!(report.turns.acknowledged > 0, "seed {seed}: nothing was acknowledged");
    assert!(
        report.anomalies.is_empty(),
        "seed {seed}: {} anomalies: {:?}",
        report.anomalies.len(),
        report.anomaly_counts()
    );
    assert!(started.elapsed() < SHORT_BUDGET, "seed {seed}: took {:?}", started.elapsed());
}

/// The checker's self-test: with the checkpoint fence off, a write held by a store
/// partition lands after a takeover and clobbers the new owner's history.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_chaos_run_without_the_fence_reports_anomalies() {
    let _turn = ONE_RUN_AT_A_TIME.lock().await;
    let seed = seed();
    let started = Instant::now();
    let report = chaos::run(ChaosOptions::without_fence(seed)).await.expect("the run itself");
    eprintln!("{report}");
    assert!(report.faults.get(&FaultKind::StorePartitionMidWrite).is_some_and(|&n| n > 0));
    assert!(
        !report.anomalies.is_empty(),
        "seed {seed}: the fence was off and the checker saw nothing ({} turns acknowledged)",
        report.turns.acknowledged
    );
    assert!(started.elapsed() < SHORT_BUDGET, "seed {seed}: took {:?}", started.elapsed());
}
