//! A whole run: the testbed, one driver per session, the schedule injected fault after
//! fault, then the cluster healed, the clients stopped, and the histories checked.

use std::{collections::BTreeMap, time::Duration};

use tokio::{sync::watch, task::JoinSet, time::Instant};

use super::{
    checker,
    driver::{Driver, SharedLog},
    inject::inject,
    record::SessionLog,
    report::{tallies, Report, Turns},
    schedule::{self, FaultKind},
    testbed::Testbed,
};
use crate::{Blackhole, ClusterOptions};
pub use leasehold_core::store::checkpoints::NO_FENCE_FAILPOINT;

/// Turns think up to this long by default: faults land in the middle of turns as well as
/// on their writes.
pub const DEFAULT_MAX_THINK: Duration = Duration::from_millis(150);
/// Sessions get going before the first fault.
const WARM_UP: Duration = Duration::from_secs(1);
/// After the last fault, the healed cluster serves this many TTLs before the clients
/// stop, so every session has turns after the aftermath.
const QUIET_TTLS: u32 = 2;
/// The longest a turn can still take once the clients are told to stop: a client's
/// deadline for one turn (45 s) plus one request timeout (15 s), with margin. Clients
/// still busy after it are abandoned; their turn counts as pending.
const STOP_GRACE: Duration = Duration::from_secs(75);
/// After the clients stop, a turn one of them gave up waiting for may still be running
/// or being fenced somewhere; this many TTLs and it has ended either way.
const SETTLE_TTLS: u32 = 2;

/// What to run.
#[derive(Debug, Clone)]
pub struct ChaosOptions {
    pub seed: u64,
    /// Faults in the schedule.
    pub faults: usize,
    pub sessions: usize,
    /// Whether the clients send each turn with an idempotency key (and so may re-send
    /// it); without, a turn that may have been received is never re-sent and ends
    /// ambiguous (see [`super::driver`]).
    pub keyed: bool,
    /// Each turn asks the agent to think up to this long (so faults land mid-turn); the
    /// shorter, the larger the share of a turn spent writing to the store.
    pub max_think: Duration,
    /// Bound on the fault phase: the schedule stops early rather than overrun it.
    pub duration: Duration,
    /// The kinds to draw from; a kind this process cannot inject is left out (and said so).
    pub kinds: Vec<FaultKind>,
    pub cluster: ClusterOptions,
    /// Print every turn that did not end acknowledged, at the end.
    pub verbose: bool,
    /// Keep the processes' logs, histories and client logs even without an anomaly.
    pub keep_logs: bool,
}

impl ChaosOptions {
    /// A 2 s lease renewed every 400 ms (as the fault tests' `short_lease_options`), so
    /// faults past the TTL take seconds.
    pub fn short_leases() -> ClusterOptions {
        ClusterOptions {
            lease_ttl: Duration::from_secs(2),
            heartbeat: Duration::from_millis(400),
            drain_timeout: Duration::from_secs(3),
            ..ClusterOptions::default()
        }
    }

    /// The run `make test` does: 32 faults with 6 sessions, about 90 s; its fault phase is
    /// bounded at 130 s so that the whole run fits in 3 minutes on 2 cores.
    pub fn short(seed: u64) -> ChaosOptions {
        ChaosOptions {
            seed,
            faults: 32,
            sessions: 6,
            keyed: true,
            max_think: DEFAULT_MAX_THINK,
            duration: Duration::from_secs(130),
            kinds: FaultKind::ALL.to_vec(),
            cluster: Self::short_leases(),
            verbose: false,
            keep_logs: false,
        }
    }

    /// The short run with clients that send no idempotency key: 16 faults (at least one
    /// of each kind), its fault phase bounded at 60 s, so that it adds under 2 minutes.
    pub fn short_unkeyed(seed: u64) -> ChaosOptions {
        ChaosOptions { faults: 16, keyed: false, duration: Duration::from_secs(60), ..Self::short(seed) }
    }

    /// The checker's self-test: a short run of `store_partition_mid_write` faults only,
    /// turns that are all store writes, against sidecars whose checkpoint fence is off
    /// ([`NO_FENCE_FAILPOINT`], honoured by debug builds only). It must report anomalies.
    pub fn without_fence(seed: u64) -> ChaosOptions {
        let mut cluster = Self::short_leases();
        cluster.sidecar_env = vec![vec![(NO_FENCE_FAILPOINT.to_owned(), "1".to_owned())]; cluster.nodes];
        ChaosOptions {
            faults: SELF_TEST_FAULTS,
            max_think: Duration::ZERO,
            duration: Duration::from_secs(70),
            kinds: vec![FaultKind::StorePartitionMidWrite],
            cluster,
            ..Self::short(seed)
        }
    }
}

/// Faults in the checker's self-test ([`ChaosOptions::without_fence`]): enough that a
/// held write lands after a takeover in every run tried (see `chaos/mod.rs`).
const SELF_TEST_FAULTS: usize = 16;

/// The kinds of `wanted` this process can inject, and the others with why not.
fn usable(wanted: &[FaultKind]) -> (Vec<FaultKind>, Vec<(FaultKind, String)>) {
    let mut kinds = Vec::new();
    let mut skipped = Vec::new();
    for &kind in wanted {
        if kind == FaultKind::PeerPartition && !Blackhole::permitted() {
            skipped.push((kind, "skipped: changing the firewall needs root".to_owned()));
        } else {
            kinds.push(kind);
        }
    }
    (kinds, skipped)
}

/// Keep what a run (with anomalies) leaves behind (every process's log, the histories, the
/// clients' logs) in a directory named for its seed, and say where.
fn keep_evidence(bed: &Testbed, seed: u64, histories: &BTreeMap<String, Vec<String>>, logs: &[SessionLog]) {
    let dir = std::env::temp_dir().join(format!("leasehold-chaos-{seed}-{}", std::process::id()));
    let kept = bed.keep_logs(&dir).and_then(|()| {
        std::fs::write(dir.join("histories.txt"), format!("{histories:#?}"))?;
        std::fs::write(dir.join("clients.txt"), format!("{logs:#?}"))
    });
    match kept {
        Ok(()) => eprintln!("chaos: logs, histories and client logs kept in {}", dir.display()),
        Err(e) => eprintln!("chaos: could not keep the logs in {}: {e}", dir.display()),
    }
}

/// Run it. `Err` only when the testbed could not be set up or healed; anomalies are in
/// the report.
pub async fn run(options: ChaosOptions) -> anyhow::Result<Report> {
    let (kinds, skipped) = usable(&options.kinds);
    anyhow::ensure!(!kinds.is_empty(), "no fault kind left to inject: {skipped:?}");
    let cluster = options.cluster.clone();
    let (ttl, nodes) = (cluster.lease_ttl, cluster.nodes);
    let schedule = schedule::generate(options.seed, options.faults, &kinds, nodes, ttl);
    let started = Instant::now();
    let stamp = move || format!("[{:>7.1}s]", started.elapsed().as_secs_f64());

    let mut bed = Testbed::start(cluster.clone()).await?;
    eprintln!("{} cluster ready: {} nodes, store {}", stamp(), nodes, bed.database_url);
    let (stop, stopped) = watch::channel(false);
    let mut clients = JoinSet::new();
    let mut logs: Vec<SharedLog> = Vec::new();
    for i in 0..options.sessions {
        let seed = options.seed.wrapping_add(i as u64 + 1);
        let driver =
            Driver::new(&format!("s{i}"), bed.public_urls(), i, options.keyed, options.max_think, seed)?;
        logs.push(driver.log());
        clients.spawn(driver.run(stopped.clone()));
    }
    tokio::time::sleep(WARM_UP).await;

    let mut faults = BTreeMap::new();
    let mut fault_errors = Vec::new();
    let fault_phase = Instant::now();
    for (i, fault) in schedule.iter().enumerate() {
        if fault_phase.elapsed() + fault.gap + fault.hold > options.duration {
            eprintln!("{} the duration ({:?}) ends the schedule after {i} faults", stamp(), options.duration);
            break;
        }
        tokio::time::sleep(fault.gap).await;
        eprintln!("{} fault {}/{}: {fault}", stamp(), i + 1, schedule.len());
        *faults.entry(fault.kind).or_default() += 1;
        if let Err(e) = inject(&mut bed, fault).await {
            eprintln!("{} fault {}: {e}", stamp(), i + 1);
            fault_errors.push(format!("fault {} ({fault}): {e}", i + 1));
        }
    }

    bed.heal().await?;
    eprintln!("{} healed; the clients run on for {QUIET_TTLS} TTLs", stamp());
    tokio::time::sleep(ttl * QUIET_TTLS).await;
    stop.send_replace(true);
    let all_stopped =
        tokio::time::timeout(STOP_GRACE, async { while clients.join_next().await.is_some() {} });
    if all_stopped.await.is_err() {
        eprintln!("{} clients still busy after {STOP_GRACE:?}: their turns count as pending", stamp());
        clients.abort_all();
    }
    tokio::time::sleep(ttl * SETTLE_TTLS).await;

    for i in 0..nodes {
        bed.collect_agent_epochs(i).await;
    }
    fault_errors.extend(bed.agent_epochs_lost.iter().cloned());
    let histories = bed.histories().await?;
    let logs: Vec<SessionLog> =
        logs.iter().map(|log| log.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone()).collect();
    if options.verbose {
        for turn in logs.iter().flat_map(|log| &log.turns) {
            if !matches!(turn.outcome, super::record::Outcome::Acknowledged(_)) {
                eprintln!("  {}: {:?} after {:?}", turn.text, turn.outcome, turn.directives);
            }
        }
    }
    let anomalies = checker::check(&histories, &logs, &bed.agent_epochs);
    if !anomalies.is_empty() || options.keep_logs {
        keep_evidence(&bed, options.seed, &histories, &logs);
    }
    let (directives, reasons) = tallies(&logs);
    Ok(Report {
        seed: options.seed,
        nodes,
        sessions: options.sessions,
        keyed: options.keyed,
        lease_ttl: ttl,
        heartbeat: cluster.heartbeat,
        elapsed: started.elapsed(),
        planned: schedule.len(),
        faults,
        fault_errors,
        skipped,
        turns: Turns::of(&logs),
        directives,
        reasons,
        anomalies,
    })
}
