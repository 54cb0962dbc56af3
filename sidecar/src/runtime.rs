//! Process wiring: tracing, the tokio runtime, start-up order, the domain parts and the
//! listeners that call them, the background tasks, and signals. The one place that knows
//! every part; no part knows this one.

use std::{net::SocketAddr, process::ExitCode, sync::Arc, time::Duration};

use anyhow::Context;
use leasehold_core::{
    proof::{PeerAuth, Signed},
    store::{notify::Change, LeaseStore, DEFAULT_POOL_SIZE},
    SessionKey,
};
use tokio::{
    net::TcpListener,
    signal::unix::{signal, SignalKind},
    sync::mpsc,
};
use tokio_util::sync::CancellationToken;

use leasehold_sidecar::{
    config::{Config, DrainArgs, LogFormat, RunArgs},
    drain::{self, Drain},
    fence::Fence,
    forward::Forwarder,
    heartbeat::{Heartbeat, HeartbeatHandle},
    http,
    metrics::Metrics,
    observe::{Follow, Hubs, Observe, StreamLimits},
    ownership::Ownership,
    publish::{GroupCommit, Publisher},
    telemetry::Telemetry,
    turn::{agent::AgentClient, inflight::InFlight, queue::TurnQueue, router::TurnRouter, run::Runner},
};

/// Log lines on stderr in `format`, filtered by `LEASEHOLD_LOG` (default `info`), and,
/// with `telemetry`, the spans exported over OTLP.
pub fn init_tracing(format: LogFormat, telemetry: Option<&Telemetry>) {
    use tracing_subscriber::{fmt, layer::SubscriberExt, util::SubscriberInitExt, EnvFilter, Layer};
    let filter = EnvFilter::try_from_env("LEASEHOLD_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let lines = match format {
        LogFormat::Text => fmt::layer()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr)
            .boxed(),
        LogFormat::Json => fmt::layer().json().with_writer(std::io::stderr).boxed(),
    };
    let spans = telemetry.map(Telemetry::layer);
    tracing_subscriber::registry().with(lines).with(spans).with(filter).init();
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

/// How long `leasehold-sidecar drain` waits for the drain's answer: a drain waits for
/// in-flight turns up to its drain timeout (25 s by default); a hook's grace period
/// bounds it anyway.
const DRAIN_COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

/// `leasehold-sidecar drain`: ask the admin port which node it is, sign a drain for that
/// node with the cluster secret, print the answer; an error unless it succeeded.
pub async fn drain(args: &DrainArgs) -> anyhow::Result<()> {
    let http = reqwest::Client::builder().timeout(DRAIN_COMMAND_TIMEOUT).build()?;
    let base = args.admin_url.trim_end_matches('/');
    let health: serde_json::Value = http
        .get(format!("{base}/healthz"))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .with_context(|| format!("--admin-url: {base}/healthz"))?
        .json()
        .await
        .with_context(|| format!("--admin-url: {base}/healthz is not a sidecar's"))?;
    let node = health["node"].as_str().context("--admin-url: the sidecar did not name its node")?;
    let auth = PeerAuth::new(Some(&args.cluster_secret), None);
    let none = ::http::HeaderMap::new();
    let signed = Signed { method: "POST", path: "/drain", destination: node, headers: &none, body: b"" };
    let mut request = http.post(format!("{base}/drain"));
    for (name, value) in auth.sign(&signed, &[]) {
        request = request.header(name, value);
    }
    let response = request.send().await.with_context(|| format!("--admin-url: {base}/drain"))?;
    let status = response.status();
    println!("{}", response.text().await.unwrap_or_default().trim_end());
    anyhow::ensure!(status.is_success(), "the drain of {node} answered {status}");
    Ok(())
}

/// Pause between start-up attempts while the database is unreachable.
const STARTUP_RETRY: Duration = Duration::from_secs(2);
/// A SIGTERM after a completed drain (e.g. the preStop hook's) exits within a second:
/// the rest of the linger is cut to this.
const EXIT_AFTER_A_DRAIN: Duration = Duration::from_millis(900);

/// The listeners, bound before anything is served so a port conflict fails start-up.
#[derive(Debug)]
struct Listeners {
    public: TcpListener,
    peer: TcpListener,
    agent: TcpListener,
    admin: TcpListener,
}

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

/// Connections of the heartbeat's own pool: one beat at a time, and one spare for the
/// re-registration after a lost boot.
const HEARTBEAT_CONNECTIONS: u32 = 2;

/// Migrate (unless disabled) and register this boot, revoking earlier boots of the node
/// id; retried while the database is unreachable. The heartbeat renews on connections of
/// its own, so request traffic that holds every pooled connection cannot make this
/// process's node lease lapse.
async fn start_heartbeat(config: &Config, store: &LeaseStore) -> HeartbeatHandle {
    let own = store.dedicated(HEARTBEAT_CONNECTIONS);
    loop {
        let attempt = async {
            if config.args.migrate {
                store.migrate().await.context("applying migrations")?;
            }
            let heartbeat = Heartbeat {
                store: own.clone(),
                node_id: config.node_id.clone(),
                peer_addr: config.advertise_peer_addr.clone(),
                ttl: config.args.lease_ttl,
                interval: config.args.heartbeat_interval,
                liveness: config.args.connection_liveness,
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

/// The domain parts, assembled around a started heartbeat.
struct Parts {
    ownership: Arc<Ownership>,
    hubs: Arc<Hubs>,
    metrics: Arc<Metrics>,
    drain: Arc<Drain>,
    router: Arc<TurnRouter>,
    observe: Arc<Observe>,
    fence: Arc<Fence>,
    auth: Arc<PeerAuth>,
    node_id: String,
}

/// Assemble the domain. Returns the receiver of sessions the agent must be told to
/// stand down.
fn assemble(
    config: &Config,
    store: LeaseStore,
    heartbeat: &HeartbeatHandle,
    metrics: Arc<Metrics>,
) -> (Parts, mpsc::UnboundedReceiver<SessionKey>) {
    let args = &config.args;
    metrics.watch_heartbeat(heartbeat.state.clone(), args.lease_ttl);
    let (stood_down_tx, stood_down) = mpsc::unbounded_channel();
    let ownership = Arc::new(Ownership::new(store, heartbeat.state.clone(), stood_down_tx, metrics.clone()));
    let inflight = InFlight::new(metrics.clone());
    let hubs = Arc::new(Hubs::counted(metrics.hub_gauge()));
    let drain = Arc::new(Drain::new(
        ownership.clone(),
        inflight.clone(),
        heartbeat.stopper(),
        metrics.clone(),
        hubs.clone(),
        args.drain_timeout,
    ));
    let auth = Arc::new(match args.insecure_peer {
        true => PeerAuth::new(None, None),
        false => PeerAuth::new(
            args.cluster_secret.as_deref(),
            args.cluster_secret_previous.as_deref().filter(|s| !s.trim().is_empty()),
        ),
    });
    let forwarder = Arc::new(Forwarder::new(auth.clone(), args.forward_headers.names()));
    let follow = Arc::new(Follow {
        hubs: hubs.clone(),
        ownership: ownership.clone(),
        forwarder: forwarder.clone(),
        metrics: metrics.clone(),
        draining: drain.subscribe(),
    });
    let observe = Arc::new(Observe {
        hubs: hubs.clone(),
        follow,
        ownership: ownership.clone(),
        metrics: metrics.clone(),
        draining: drain.subscribe(),
        limits: StreamLimits {
            per_node: args.max_streams as usize,
            per_session: args.max_streams_per_session as usize,
        },
    });
    let agent = AgentClient::new(&args.agent_url);
    let rule = GroupCommit { linger: args.journal_linger, max_batch: args.journal_max_batch as usize };
    let publisher = Publisher::start(ownership.clone(), hubs.clone(), metrics.clone(), args.lease_ttl, rule);
    let queue = TurnQueue::new(args.queue_limit as usize);
    let runner = Arc::new(Runner {
        ownership: ownership.clone(),
        agent: agent.clone(),
        publisher: publisher.clone(),
        queue: queue.clone(),
        metrics: metrics.clone(),
        multitask: args.multitask,
        max_answer: args.max_answer_bytes,
        max_attempts: args.max_turn_attempts,
        ttl: args.lease_ttl,
    });
    let router = Arc::new(TurnRouter {
        ownership: ownership.clone(),
        agent,
        runner,
        forwarder,
        inflight,
        metrics: metrics.clone(),
        ttl: args.lease_ttl,
        connection_liveness: args.connection_liveness,
        draining: drain.subscribe(),
        drain_timeout: args.drain_timeout,
    });
    let fence = Arc::new(Fence {
        ownership: ownership.clone(),
        hubs: hubs.clone(),
        publisher,
        queue,
        metrics: metrics.clone(),
    });
    let node_id = config.node_id.clone();
    let parts = Parts { ownership, hubs, metrics, drain, router, observe, fence, auth, node_id };
    (parts, stood_down)
}

/// Serve the four listeners, each calling the parts it needs, until `shutdown`.
async fn serve_listeners(parts: &Parts, args: &RunArgs, listeners: Listeners, shutdown: CancellationToken) {
    let (max_body, cap) = (args.max_body_bytes, args.max_connections as usize);
    let turns =
        http::Turns { router: parts.router.clone(), max_body, forward_headers: args.forward_headers.clone() };
    let public = http::public::Public {
        turns: turns.clone(),
        observe: parts.observe.clone(),
        ownership: parts.ownership.clone(),
        drain: parts.drain.clone(),
    };
    let peer = http::peer::Peer {
        turns,
        observe: parts.observe.clone(),
        auth: parts.auth.clone(),
        drain: parts.drain.clone(),
        metrics: parts.metrics.clone(),
        node_id: parts.node_id.clone(),
    };
    let agent = http::agent::AgentPort { fence: parts.fence.clone(), max_body };
    let admin = http::admin::Admin {
        drain: parts.drain.clone(),
        ownership: parts.ownership.clone(),
        metrics: parts.metrics.clone(),
        auth: parts.auth.clone(),
        node_id: parts.node_id.clone(),
    };
    tokio::join!(
        http::server::serve(listeners.public, http::public::router(public), shutdown.clone(), cap),
        http::server::serve(listeners.peer, http::peer::router(peer), shutdown.clone(), cap),
        http::server::serve(listeners.agent, http::agent::router(agent), shutdown.clone(), cap),
        http::server::serve_with_probe_reserve(
            listeners.admin,
            http::admin::router(admin.clone()),
            http::admin::probe_router(admin),
            shutdown,
            cap
        ),
    );
}

/// Tell the agent about every session it must drop (best effort: the fence protects the
/// data even if the agent never hears it), and end the peer streams we served for it.
async fn notify_stand_downs(
    agent: AgentClient,
    hubs: Arc<Hubs>,
    mut stood_down: mpsc::UnboundedReceiver<SessionKey>,
) {
    while let Some(key) = stood_down.recv().await {
        hubs.moved(&key);
        let agent = agent.clone();
        tokio::spawn(async move {
            if let Err(e) = agent.stand_down(&key).await {
                tracing::warn!(%key, error = %e, "agent did not take the stand-down");
            }
        });
    }
}

/// Pause before listening again after the store could not be reached.
const LISTEN_RETRY: Duration = Duration::from_secs(1);

/// Follow ownership changes (LISTEN/NOTIFY): forget stale holders, stand down sessions
/// that moved away, wake the followers of observed sessions.
async fn watch_ownership(ownership: Arc<Ownership>, hubs: Arc<Hubs>, drain: Arc<Drain>) {
    loop {
        let mut changes = match ownership.listen().await {
            Ok(changes) => changes,
            Err(e) => {
                tracing::debug!(error = %e, "cannot listen for ownership changes yet");
                tokio::time::sleep(LISTEN_RETRY).await;
                continue;
            }
        };
        // Anything may have changed while we were not listening.
        ownership.forget_all_holders();
        hubs.changed_all();
        loop {
            match changes.next().await {
                Ok(Change::Lease { key, epoch, owner }) => {
                    ownership.lease_changed(&key, epoch, owner.as_ref());
                    hubs.changed(&key);
                }
                Ok(Change::Node { owner }) => {
                    ownership.forget_holder(&owner);
                    if owner == ownership.node().owner && !drain.is_draining() {
                        // We were revoked (thought dead): stop at once, before the heartbeat.
                        ownership.lose_boot(&owner);
                    }
                    hubs.changed_all();
                }
                Ok(Change::Resync) => {
                    ownership.forget_all_holders();
                    hubs.changed_all();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "ownership notifications interrupted");
                    tokio::time::sleep(LISTEN_RETRY).await;
                }
            }
        }
    }
}

/// Start-up order: bind → migrate → register this boot (revoking earlier boots) →
/// heartbeat → serve. Runs until SIGTERM/SIGINT; then drains (idempotent: a drain already
/// done through the admin port returns at once) and exits.
pub async fn serve(config: Config) -> anyhow::Result<()> {
    let listeners = bind(&config).await?;
    // Made first: the store reports every statement's latency to it from the start.
    let metrics = Arc::new(Metrics::new());
    let store = LeaseStore::connect_lazy_bounding_idle_transactions(
        &config.database_url,
        DEFAULT_POOL_SIZE,
        config.args.lease_ttl,
    )
    .context("--database-url")?
    .observed_by(metrics.clone());
    let mut heartbeat = start_heartbeat(&config, &store).await;
    let (parts, stood_down) = assemble(&config, store, &heartbeat, metrics);
    let parts = Arc::new(parts);
    let agent = AgentClient::new(&config.args.agent_url);
    tokio::spawn(notify_stand_downs(agent, parts.hubs.clone(), stood_down));
    tokio::spawn(watch_ownership(parts.ownership.clone(), parts.hubs.clone(), parts.drain.clone()));
    tokio::spawn(parts.ownership.clone().watch_lapse());
    tokio::spawn(parts.router.clone().resume_orphans());
    let shutdown = CancellationToken::new();
    let server = tokio::spawn({
        let (parts, shutdown) = (parts.clone(), shutdown.clone());
        let args = config.args.clone();
        async move { serve_listeners(&parts, &args, listeners, shutdown).await }
    });
    tracing::info!(node_id = %config.node_id, peer = %config.advertise_peer_addr, "ready to serve");

    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut heartbeat_running = true;
    let drain = &parts.drain;
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            ended = &mut heartbeat.task, if heartbeat_running => {
                heartbeat_running = false;
                // A drain stops the heartbeat on purpose; anything else is fatal.
                if !drain.is_draining() {
                    anyhow::bail!("heartbeat stopped: {:?}", ended.map(|r| r.map_err(|e| e.to_string())));
                }
            }
            Some(lost) = heartbeat.lost.recv() => parts.ownership.lose_boot(&lost),
        }
    }
    let drained_before = drain.is_done();
    let report = drain.run().await.context("draining at shutdown")?;
    let linger = drain::linger(config.args.lease_ttl);
    tracing::info!(?report, ?linger, "drained; refusing new work with `draining` before exiting");
    if drained_before {
        // The hand-back is already old news to most peers: exit within a second.
        let _ = tokio::time::timeout(EXIT_AFTER_A_DRAIN, drain.linger_after(linger)).await;
    } else {
        drain.linger_after(linger).await;
    }
    // Clients still sending (answered `draining`, each connection closed after its
    // answer) would meet their idle pooled connections closed under them: wait until
    // they have stopped.
    drain.quiet_for(drain::EXIT_QUIET, drain::EXIT_QUIET_WAIT_MAX).await;
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
    fn the_exit_after_a_drain_stays_within_what_the_operator_allows() {
        let exit = drain::EXIT_QUIET_WAIT_MAX + http::server::GRACEFUL_SHUTDOWN;
        assert!(exit <= leasehold_core::lifecycle::MAX_EXIT_AFTER_DRAIN, "{exit:?}");
    }

    #[test]
    fn more_threads_are_taken_as_given() {
        assert_eq!(shape(3), (RuntimeFlavor::MultiThread, 3));
    }
}
