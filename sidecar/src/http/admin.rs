//! Admin port (CONTRACT §6): health, readiness and metrics for anyone; the leases held
//! and the drain only for a caller with proof of the cluster secret (the peer proof,
//! made for this node); and `/drained` for preStop hooks: a read-only wait for the drain,
//! or, with the drain-hook token, the drain and the user's own hook that token covers.

use std::{sync::Arc, time::Duration};

use axum::{
    extract::{Query, Request, State},
    http::{HeaderMap, HeaderValue, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use leasehold_core::{
    headers,
    proof::{DrainThen, PeerAuth},
};
use serde_json::json;
use tokio::time::Instant;

use super::{proof::Verifier, reply};
use crate::{drain::Drain, metrics::Metrics, ownership::Ownership};

/// The domain parts the admin listener calls.
#[derive(Debug, Clone)]
pub struct Admin {
    pub drain: Arc<Drain>,
    pub ownership: Arc<Ownership>,
    pub metrics: Arc<Metrics>,
    pub auth: Arc<PeerAuth>,
    /// This sidecar's node id: the destination an admin proof must name.
    pub node_id: String,
}

/// A body on the authenticated admin routes is tiny (they take none); more is refused.
const MAX_ADMIN_BODY: usize = 4096;

/// `GET /drained` waits this long for someone (the operator, the sidecar container's own
/// preStop hook) to start the drain before answering that none started.
const DRAIN_START_WAIT: Duration = Duration::from_secs(5);

pub fn router(app: Admin) -> Router {
    let authenticated = Router::new()
        .route("/leases", get(leases))
        .route("/drain", post(drain))
        .route_layer(middleware::from_fn_with_state(app.clone(), authenticate));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/drained", get(drained))
        .merge(authenticated)
        .fallback(super::not_found)
        .method_not_allowed_fallback(super::method_not_allowed)
        .with_state(app)
}

/// What the admin listener serves on its probe reserve (connections past its cap): the
/// kubelet's probes, and `503 overloaded` for anything else.
pub fn probe_router(app: Admin) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(|| async { reply::refusal(&crate::turn::directive::Refusal::Overloaded) })
        .with_state(app)
}

/// Only a proof of the cluster secret made for this node passes (`401` otherwise).
async fn authenticate(State(app): State<Admin>, request: Request, next: Next) -> Response {
    let verifier = Verifier {
        port: "admin",
        auth: &app.auth,
        node_id: &app.node_id,
        metrics: &app.metrics,
        max_body: MAX_ADMIN_BODY,
    };
    verifier.admit(request, next).await
}

/// The process is alive; never depends on the database. Names the node (an admin proof
/// is made for it).
async fn healthz(State(app): State<Admin>) -> Response {
    Json(json!({ "status": "ok", "node": app.node_id })).into_response()
}

/// Not ready while draining, or while the lease store is unreachable (no live node lease).
async fn readyz(State(app): State<Admin>) -> Response {
    if app.drain.is_draining() {
        return reply::error(StatusCode::SERVICE_UNAVAILABLE, "draining", None);
    }
    if !app.ownership.node().ready(Instant::now()) {
        return reply::error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", None);
    }
    Json(json!({ "status": "ready" })).into_response()
}

/// OpenMetrics for a scraper that asks for it (Prometheus does), else the classic text.
async fn metrics(State(app): State<Admin>, headers: HeaderMap) -> Response {
    let (content_type, body) = leasehold_core::exposition::negotiate(&headers, app.metrics.encode());
    ([(axum::http::header::CONTENT_TYPE, content_type)], body).into_response()
}

async fn leases(State(app): State<Admin>) -> Response {
    let held: Vec<_> = app
        .ownership
        .held()
        .into_iter()
        .map(|(key, epoch, left)| json!({ "key": key.as_str(), "epoch": epoch.0, "expires_in_ms": left.as_millis() as u64 }))
        .collect();
    Json(held).into_response()
}

/// For an agent container's preStop hook (a kubelet `httpGet`, which cannot carry a
/// proof): answer when the drain is done. With the cluster's drain-hook token
/// ([`leasehold_core::proof::DRAIN_HOOK_HEADER`]) made for this hook's `then_*` values, it
/// starts the drain itself (a native sidecar's own preStop runs only after the agent has
/// stopped) and then runs the user's own preStop hook that the operator moved here
/// (`then_port` + `then_path`: a GET on the pod's loopback; `then_sleep`: seconds), so
/// that hook still runs, after the drain. Without a token and without `then_*`, it only
/// waits for the drain someone else starts (read-only). Anything else (another token, or
/// `then_*` without a token) is `401` at once: nothing starts, nothing is sent, no wait.
async fn drained(State(app): State<Admin>, headers: HeaderMap, Query(then): Query<Then>) -> Response {
    let hook = then.hook();
    let token = headers.get(leasehold_core::proof::DRAIN_HOOK_HEADER).map(|v| v.to_str().unwrap_or(""));
    let refused = match token {
        Some(token) if app.auth.accepts_drain_hook(token, &hook) => None,
        Some(_) => Some("the drain-hook token is not this cluster's for these then_* parameters"),
        None if hook.is_empty() => {
            return match app.drain.wait_done(DRAIN_START_WAIT).await {
                Some(Ok(report)) => Json(report).into_response(),
                Some(Err(e)) => {
                    reply::error(StatusCode::INTERNAL_SERVER_ERROR, "drain_failed", e.to_string())
                }
                None => reply::error(StatusCode::SERVICE_UNAVAILABLE, "not_drained", None),
            };
        }
        None => Some("then_* parameters need the drain-hook token"),
    };
    if let Some(why) = refused {
        tracing::warn!(query = %hook.query(), "rejected admin request to /drained: {why}");
        app.metrics.peer_auth_failure();
        let mut rejected = reply::error(StatusCode::UNAUTHORIZED, "unauthorized", why.to_owned());
        rejected.headers_mut().insert(headers::REFUSAL, HeaderValue::from_static("unauthorized"));
        return rejected;
    }
    let done = app.drain.run().await;
    let user_hook = then.run().await;
    match (done, user_hook) {
        (Ok(report), Ok(())) => Json(report).into_response(),
        (Ok(_), Err(e)) => reply::error(StatusCode::BAD_GATEWAY, "prestop_hook_failed", e),
        (Err(e), _) => reply::error(StatusCode::INTERNAL_SERVER_ERROR, "drain_failed", e.to_string()),
    }
}

/// A user's preStop hook that runs after the drain (see [`drained`]).
#[derive(Debug, Default, serde::Deserialize)]
pub struct Then {
    /// Port of a GET on this pod's loopback (the agent's own hook).
    then_port: Option<u16>,
    /// Path (and query) of that GET.
    then_path: Option<String>,
    /// Seconds to sleep (a `sleep` hook).
    then_sleep: Option<u64>,
}

/// A user's GET hook may take this long; the pod's grace period bounds it anyway.
const USER_HOOK_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest `sleep` hook carried out, as Kubernetes' own bound on a grace period is
/// the only other one.
const USER_SLEEP_MAX: Duration = Duration::from_secs(3600);

impl Then {
    /// The values the drain-hook token must cover.
    fn hook(&self) -> DrainThen {
        DrainThen { port: self.then_port, path: self.then_path.clone(), sleep: self.then_sleep }
    }

    async fn run(&self) -> Result<(), String> {
        if let Some(port) = self.then_port {
            let path = self.then_path.as_deref().unwrap_or("/");
            let path = if path.starts_with('/') { path.to_owned() } else { format!("/{path}") };
            let url = format!("http://127.0.0.1:{port}{path}");
            let client = reqwest::Client::new();
            let response = client.get(&url).timeout(USER_HOOK_TIMEOUT).send().await;
            match response {
                Ok(r) if r.status().is_success() || r.status().is_redirection() => {}
                Ok(r) => return Err(format!("GET {url}: {}", r.status())),
                Err(e) => return Err(format!("GET {url}: {e}")),
            }
        }
        if let Some(seconds) = self.then_sleep {
            tokio::time::sleep(Duration::from_secs(seconds).min(USER_SLEEP_MAX)).await;
        }
        Ok(())
    }
}

/// Idempotent: every call returns when the one drain is done, with its counts.
async fn drain(State(app): State<Admin>) -> Response {
    match app.drain.run().await {
        Ok(report) => Json(report).into_response(),
        Err(e) => reply::error(StatusCode::INTERNAL_SERVER_ERROR, "drain_failed", e.to_string()),
    }
}
