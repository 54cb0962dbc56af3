//! The sidecar assembled: domain parts shared by the four listeners.

use std::sync::Arc;

use tokio::{net::TcpListener, sync::mpsc};
use tokio_util::sync::CancellationToken;

use crate::{
    agent_api::AgentApi, config::Config, dispatch::Agent, drain::Drain, forward::Forwarder,
    heartbeat::HeartbeatHandle, http, inflight::InFlight, key::SessionKey, metrics::Metrics, observe::Hubs,
    ownership::Ownership, route::TurnRouter, store::LeaseStore,
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
            args.drain_timeout,
        );
        let router = TurnRouter {
            ownership: ownership.clone(),
            agent: Agent::new(&args.agent_url),
            forwarder: Forwarder::new(if args.insecure_peer { None } else { args.cluster_secret.as_deref() }),
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
/// data even if the agent never hears it).
pub async fn notify_stand_downs(agent: Agent, mut stood_down: mpsc::UnboundedReceiver<SessionKey>) {
    while let Some(key) = stood_down.recv().await {
        let agent = agent.clone();
        tokio::spawn(async move {
            if let Err(e) = agent.stand_down(&key).await {
                tracing::warn!(%key, error = %e, "agent did not take the stand-down");
            }
        });
    }
}
