//! `make chaos`: a long randomized fault run against real sidecars and demo agents on
//! loopback with a private Postgres, then a check of every session's history.
//!
//! Prints the seed first (replay a run with `--seed`), progress on stderr, the report at
//! the end. Exits 0 with no anomaly, 1 with any (or, with keyed clients, with any turn
//! left ambiguous or in flight), 2 when the run itself could not be done.
//! Every process is stopped (by PID) at the end, on error and on Ctrl-C.

use std::{process::ExitCode, time::Duration};

use clap::Parser;
use localcluster::chaos::{self, ChaosOptions, FaultKind};

#[derive(Debug, Parser)]
#[command(
    name = "leasehold-chaos",
    about = "Randomized faults against a local cluster, then a history check"
)]
struct Args {
    /// Seed of the fault schedule (random when absent; printed first either way).
    #[arg(long)]
    seed: Option<u64>,
    /// Faults to inject, one after another.
    #[arg(long, default_value_t = 1000)]
    faults: usize,
    /// Sessions, each a client sending sequential turns.
    #[arg(long, default_value_t = 8)]
    sessions: usize,
    /// Whether clients send every turn with an idempotency key (`--keyed false`: no
    /// key; a turn that may have been received is never re-sent and may end ambiguous).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    keyed: bool,
    /// The checker's self-test: every sidecar runs with its checkpoint fence off (a
    /// debug-build failpoint); the run should then report anomalies (exit 1).
    #[arg(long)]
    without_fence: bool,
    /// Each turn asks the agent to think up to this long (e.g. `0ms`: turns are all
    /// store writes, so faults land on writes more often).
    #[arg(long, default_value = "150ms", value_parser = humantime::parse_duration)]
    max_think: Duration,
    /// Bound on the fault phase (e.g. `90m`, `150s`): the schedule stops early rather
    /// than overrun it.
    #[arg(long, default_value = "90m", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Only these fault kinds (comma-separated), e.g. `store_partition,pause_past_ttl`.
    #[arg(long, value_delimiter = ',')]
    kinds: Vec<FaultKind>,
    /// Print every turn that did not end acknowledged.
    #[arg(long)]
    verbose: bool,
    /// Keep every process's log, the histories and the clients' logs even without an
    /// anomaly (they are kept with one).
    #[arg(long)]
    keep_logs: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(rand::random);
    println!("chaos: seed {seed} (replay with --seed {seed})");
    let mut cluster = ChaosOptions::short_leases();
    if args.without_fence {
        cluster.sidecar_env =
            vec![vec![(chaos::NO_FENCE_FAILPOINT.to_owned(), "1".to_owned())]; cluster.nodes];
    }
    let options = ChaosOptions {
        seed,
        faults: args.faults,
        sessions: args.sessions,
        keyed: args.keyed,
        max_think: args.max_think,
        duration: args.duration,
        kinds: if args.kinds.is_empty() { FaultKind::ALL.to_vec() } else { args.kinds },
        cluster,
        verbose: args.verbose,
        keep_logs: args.keep_logs,
    };
    let report = tokio::select! {
        report = chaos::run(options) => report,
        _ = tokio::signal::ctrl_c() => {
            // The run is dropped here: processes killed, links closed, firewall rules
            // removed, Postgres stopped.
            eprintln!("chaos: interrupted (seed {seed})");
            return ExitCode::from(2);
        }
    };
    match report {
        Ok(report) => {
            println!("{report}");
            if !report.anomalies.is_empty() {
                println!("chaos: {} anomalies with seed {seed}", report.anomalies.len());
                ExitCode::from(1)
            } else if report.keyed && report.unresolved() > 0 {
                // Keyed clients re-send until they have every turn's answer: a turn left
                // without one is a turn the cluster never answered within the deadline.
                println!("chaos: {} turns left without an answer with seed {seed}", report.unresolved());
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("chaos: the run failed (seed {seed}): {e:#}");
            ExitCode::from(2)
        }
    }
}
