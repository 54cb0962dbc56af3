//! Process wiring: tracing, the tokio runtime, start-up order and signals.

use std::process::ExitCode;

use anyhow::Context;
use leasehold_sidecar::{
    config::Config,
    heartbeat::Heartbeat,
    store::{LeaseStore, DEFAULT_POOL_SIZE},
};
use tokio::signal::unix::{signal, SignalKind};

pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LEASEHOLD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
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

pub fn block_on<F: std::future::Future<Output = anyhow::Result<()>>>(fut: F) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?
        .block_on(fut)
}

/// `leasehold-sidecar migrate`: apply the schema and exit.
pub async fn migrate(database_url: &str) -> anyhow::Result<()> {
    let store = LeaseStore::connect(database_url, 1).await.context("--database-url")?;
    store.migrate().await.context("--database-url: migrating")?;
    tracing::info!("migrations applied");
    Ok(())
}

/// Start-up order: migrate (unless disabled) → register this boot, revoking earlier
/// boots of the node id → heartbeat. Runs until SIGTERM/SIGINT, then hands every lease
/// back in one statement.
pub async fn serve(config: Config) -> anyhow::Result<()> {
    let store = LeaseStore::connect_lazy(&config.database_url, DEFAULT_POOL_SIZE)?;
    if config.args.migrate {
        store.migrate().await.context("applying migrations at start")?;
    }
    let heartbeat = Heartbeat {
        store: store.clone(),
        node_id: config.node_id.clone(),
        peer_addr: config.advertise_peer_addr.clone(),
        ttl: config.args.lease_ttl,
        interval: config.args.heartbeat_interval,
    };
    let mut heartbeat = heartbeat.start().await.context("registering the node lease")?;
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            result = &mut heartbeat.task => {
                anyhow::bail!("heartbeat stopped: {:?}", result.map(|r| r.map_err(|e| e.to_string())));
            }
            Some(lost) = heartbeat.lost.recv() => tracing::warn!(%lost, "lost every session of a boot"),
        }
    }
    heartbeat.stop().await.context("stopping the heartbeat")?;
    let owner = heartbeat.state.borrow().owner.clone();
    let handed_back = store.hand_back_all(&owner).await.context("handing leases back")?;
    tracing::info!(%owner, handed_back, "shut down");
    Ok(())
}
