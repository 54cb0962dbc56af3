//! Process wiring: tracing, the tokio runtime, start-up order and signals.

use std::process::ExitCode;

use anyhow::Context;
use std::{net::SocketAddr, time::Duration};

use leasehold_sidecar::{
    app::{notify_stand_downs, watch_ownership, Listeners, Sidecar},
    config::Config,
    dispatch::Agent,
    drain,
    heartbeat::{Heartbeat, HeartbeatHandle},
    store::{LeaseStore, DEFAULT_POOL_SIZE},
};
use tokio::{
    net::TcpListener,
    signal::unix::{signal, SignalKind},
};
use tokio_util::sync::CancellationToken;

pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LEASEHOLD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}

pub fn fail(line: &str) -> ExitCode {
    eprintln!("{line}");
    ExitCode::FAILURE
}

/// Fold clap's multi-line error (message, then usage) into its first paragraph on one line.
pub fn one_line(rendered: &str) -> String {
    let paragraph: Vec<&str> = rendered.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).collect();
    paragraph.join(" ")
}

/// Run `fut` on the runtime `--worker-threads` asks for (see [`build_runtime`]).
pub fn block_on<F: std::future::Future<Output = anyhow::Result<()>>>(
    threads: usize,
    fut: F,
) -> anyhow::Result<()> {
    build_runtime(threads)?.block_on(fut)
}

/// `threads` runtime threads: 0 = one per core (the default; tokio counts the cores this
/// process may use, cgroup limits included), 1 = a single-threaded runtime (no wake-ups
/// across threads: the lowest hop latency, but stream fan-out is capped by one core).
pub fn build_runtime(threads: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = match threads {
        1 => tokio::runtime::Builder::new_current_thread(),
        0 => tokio::runtime::Builder::new_multi_thread(),
        n => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(n);
            builder
        }
    };
    builder.enable_all().build().context("starting the tokio runtime")
}

/// `leasehold-sidecar migrate`: apply the schema and exit.
pub async fn migrate(database_url: &str) -> anyhow::Result<()> {
    let store = LeaseStore::connect(database_url, 1).await.context("--database-url")?;
    store.migrate().await.context("--database-url: migrating")?;
    tracing::info!("migrations applied");
    Ok(())
}

/// Pause between start-up attempts while the database is unreachable.
const STARTUP_RETRY: Duration = Duration::from_secs(2);
/// A SIGTERM after a completed drain (e.g. the preStop hook's) exits within a second:
/// the rest of the linger is cut to this.
const EXIT_AFTER_A_DRAIN: Duration = Duration::from_millis(900);

/// Bind every listener first, so a taken port fails start-up with the flag's name.
async fn bind(config: &Config) -> anyhow::Result<Listeners> {
    let args = &config.args;
    let bind = |flag: &'static str, addr: SocketAddr| async move {
        TcpListener::bind(addr).await.with_context(|| format!("{flag}: cannot listen on {addr}"))
    };
    Ok(Listeners {
        public: bind("--public-listen", args.public_listen).await?,
        peer: bind("--peer-listen", args.peer_listen).await?,
        agent: bind("--agent-listen", args.agent_listen).await?,
        admin: bind("--admin-listen", args.admin_listen).await?,
    })
}

/// Migrate (unless disabled) and register this boot, revoking earlier boots of the node
/// id; retried while the database is unreachable.
async fn start_heartbeat(config: &Config, store: &LeaseStore) -> HeartbeatHandle {
    loop {
        let attempt = async {
            if config.args.migrate {
                store.migrate().await.context("applying migrations")?;
            }
            let heartbeat = Heartbeat {
                store: store.clone(),
                node_id: config.node_id.clone(),
                peer_addr: config.advertise_peer_addr.clone(),
                ttl: config.args.lease_ttl,
                interval: config.args.heartbeat_interval,
            };
            heartbeat.start().await.context("registering the node lease")
        };
        match attempt.await {
            Ok(handle) => return handle,
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "start-up: lease store not usable yet; retrying");
                tokio::time::sleep(STARTUP_RETRY).await;
            }
        }
    }
}

/// Start-up order: bind → migrate → register this boot (revoking earlier boots) →
/// heartbeat → serve. Runs until SIGTERM/SIGINT; then drains (idempotent: a drain already
/// done through the admin port returns at once) and exits.
pub async fn serve(config: Config) -> anyhow::Result<()> {
    let listeners = bind(&config).await?;
    let store =
        LeaseStore::connect_lazy(&config.database_url, DEFAULT_POOL_SIZE).context("--database-url")?;
    let mut heartbeat = start_heartbeat(&config, &store).await;
    let (app, stood_down) = Sidecar::new(&config, store, &heartbeat);
    tokio::spawn(notify_stand_downs(Agent::new(&config.args.agent_url), app.hubs.clone(), stood_down));
    tokio::spawn(watch_ownership(app.clone()));
    tokio::spawn(app.ownership.clone().watch_lapse());
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(app.clone().serve(listeners, shutdown.clone()));
    tracing::info!(node_id = %config.node_id, peer = %config.advertise_peer_addr, "ready to serve");

    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut heartbeat_running = true;
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            ended = &mut heartbeat.task, if heartbeat_running => {
                heartbeat_running = false;
                // A drain stops the heartbeat on purpose; anything else is fatal.
                if !app.drain.is_draining() {
                    anyhow::bail!("heartbeat stopped: {:?}", ended.map(|r| r.map_err(|e| e.to_string())));
                }
            }
            Some(lost) = heartbeat.lost.recv() => app.ownership.lose_boot(&lost),
        }
    }
    let drained_before = app.drain.is_done();
    let report = app.drain.run().await.context("draining at shutdown")?;
    let linger = drain::linger(config.args.lease_ttl);
    tracing::info!(?report, ?linger, "drained; refusing new work with `draining` before exiting");
    if drained_before {
        // The hand-back is already old news to most peers: exit within a second.
        let _ = tokio::time::timeout(EXIT_AFTER_A_DRAIN, app.drain.linger_after(linger)).await;
    } else {
        app.drain.linger_after(linger).await;
    }
    // Clients still sending (answered `draining`, each connection closed after its
    // answer) would meet their idle pooled connections closed under them: wait until
    // they have stopped.
    app.drain.quiet_for(drain::EXIT_QUIET, drain::EXIT_QUIET_WAIT_MAX).await;
    tracing::info!("shutting down");
    shutdown.cancel();
    server.await.context("server task")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::runtime::RuntimeFlavor;

    fn shape(threads: usize) -> (RuntimeFlavor, usize) {
        let runtime = build_runtime(threads).unwrap();
        let handle = runtime.handle();
        (handle.runtime_flavor(), handle.metrics().num_workers())
    }

    #[test]
    fn zero_threads_means_one_per_core() {
        let cores = std::thread::available_parallelism().unwrap().get();
        assert_eq!(shape(0), (RuntimeFlavor::MultiThread, cores));
    }

    #[test]
    fn one_thread_is_a_single_threaded_runtime() {
        assert_eq!(shape(1), (RuntimeFlavor::CurrentThread, 1));
    }

    #[test]
    fn more_threads_are_taken_as_given() {
        assert_eq!(shape(3), (RuntimeFlavor::MultiThread, 3));
    }
}
