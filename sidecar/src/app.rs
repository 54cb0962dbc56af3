//! The sidecar assembled: domain parts shared by the four listeners.

use std::sync::Arc;

use tokio::{net::TcpListener, sync::mpsc};
use tokio_util::sync::CancellationToken;

use crate::{
    agent_api::AgentApi,
    config::Config,
    dispatch::Agent,
    drain::Drain,
    forward::Forwarder,
    heartbeat::HeartbeatHandle,
    http,
    inflight::InFlight,
    key::SessionKey,
    metrics::Metrics,
    observe::{Follow, Hubs},
    ownership::Ownership,
    route::TurnRouter,
    store::notify::Change,
    store::LeaseStore,
};

#[derive(Debug)]
pub struct Sidecar {
    pub node_id: String,
    pub max_body: usize,
    pub router: TurnRouter,
    pub agent_api: AgentApi,
    pub ownership: Arc<Ownership>,
    pub hubs: Arc<Hubs>,
    pub metrics: Arc<Metrics>,
    pub drain: Drain,
    pub follow: Arc<Follow>,
}

/// The listeners, bound before anything is served so a port conflict fails start-up.
#[derive(Debug)]
pub struct Listeners {
    pub public: TcpListener,
    pub peer: TcpListener,
    pub agent: TcpListener,
    pub admin: TcpListener,
}

impl Sidecar {
    /// Assemble the domain around a started heartbeat. Returns the receiver of sessions
    /// the agent must be told to stand down.
    pub fn new(
        config: &Config,
        store: LeaseStore,
        heartbeat: &HeartbeatHandle,
    ) -> (Arc<Sidecar>, mpsc::UnboundedReceiver<SessionKey>) {
        let metrics = Arc::new(Metrics::new());
        let (stood_down_tx, stood_down) = mpsc::unbounded_channel();
        let ownership =
            Arc::new(Ownership::new(store, heartbeat.state.clone(), stood_down_tx, metrics.clone()));
        let inflight = InFlight::new(metrics.clone());
        let hubs = Arc::new(Hubs::default());
        let args = &config.args;
        let drain = Drain::new(
            ownership.clone(),
            inflight.clone(),
            heartbeat.stopper(),
            metrics.clone(),
            hubs.clone(),
            args.drain_timeout,
        );
        let secret = if args.insecure_peer { None } else { args.cluster_secret.as_deref() };
        let forwarder = Arc::new(Forwarder::new(secret));
        let follow = Arc::new(Follow {
            hubs: hubs.clone(),
            ownership: ownership.clone(),
            forwarder: forwarder.clone(),
            metrics: metrics.clone(),
            draining: drain.subscribe(),
        });
        let router = TurnRouter {
            ownership: ownership.clone(),
            agent: Agent::new(&args.agent_url),
            forwarder,
            inflight,
            metrics: metrics.clone(),
            ttl: args.lease_ttl,
            draining: drain.subscribe(),
            drain_timeout: args.drain_timeout,
        };
        let agent_api =
            AgentApi { ownership: ownership.clone(), hubs: hubs.clone(), metrics: metrics.clone() };
        let app = Sidecar {
            node_id: config.node_id.clone(),
            max_body: args.max_body_bytes,
            router,
            agent_api,
            ownership,
            hubs,
            metrics,
            drain,
            follow,
        };
        (Arc::new(app), stood_down)
    }

    /// Serve the four listeners until `shutdown`.
    pub async fn serve(self: Arc<Self>, listeners: Listeners, shutdown: CancellationToken) {
        tokio::join!(
            http::server::serve(listeners.public, http::public::router(self.clone()), shutdown.clone()),
            http::server::serve(listeners.peer, http::peer::router(self.clone()), shutdown.clone()),
            http::server::serve(listeners.agent, http::agent::router(self.clone()), shutdown.clone()),
            http::server::serve(listeners.admin, http::admin::router(self.clone()), shutdown),
        );
    }
}

/// Tell the agent about every session it must drop (best effort: the fence protects the
/// data even if the agent never hears it), and end the peer streams we served for it.
pub async fn notify_stand_downs(
    agent: Agent,
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
const LISTEN_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// Follow ownership changes (LISTEN/NOTIFY): forget stale holders, stand down sessions
/// that moved away, wake the followers of observed sessions.
pub async fn watch_ownership(app: Arc<Sidecar>) {
    loop {
        let mut changes = match app.ownership.store().listen().await {
            Ok(changes) => changes,
            Err(e) => {
                tracing::debug!(error = %e, "cannot listen for ownership changes yet");
                tokio::time::sleep(LISTEN_RETRY).await;
                continue;
            }
        };
        // Anything may have changed while we were not listening.
        app.ownership.forget_all_holders();
        app.hubs.changed_all();
        loop {
            match changes.next().await {
                Ok(Change::Lease { key, owner, .. }) => {
                    app.ownership.lease_changed(&key, owner.as_ref());
                    app.hubs.changed(&key);
                }
                Ok(Change::Node { owner }) => {
                    app.ownership.forget_holder(&owner);
                    if owner == app.ownership.node().owner && !app.drain.is_draining() {
                        // We were revoked (thought dead): stop at once, before the heartbeat.
                        app.ownership.lose_boot(&owner);
                    }
                    app.hubs.changed_all();
                }
                Ok(Change::Resync) => {
                    app.ownership.forget_all_holders();
                    app.hubs.changed_all();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "ownership notifications interrupted");
                    tokio::time::sleep(LISTEN_RETRY).await;
                }
            }
        }
    }
}
