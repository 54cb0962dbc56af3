//! Admin port (CONTRACT §6): health, readiness, metrics, leases held, drain.

use std::sync::Arc;

use axum::{
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use serde_json::json;
use tokio::time::Instant;

use super::reply;
use crate::{drain::Drain, metrics::Metrics, ownership::Ownership};

/// The domain parts the admin listener calls.
#[derive(Debug, Clone)]
pub struct Admin {
    pub drain: Arc<Drain>,
    pub ownership: Arc<Ownership>,
    pub metrics: Arc<Metrics>,
}

pub fn router(app: Admin) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/leases", get(leases))
        // GET too: a kubelet preStop httpGet hook can only GET (the drain is idempotent).
        .route("/drain", post(drain).get(drain))
        .fallback(super::not_found)
        .method_not_allowed_fallback(super::method_not_allowed)
        .with_state(app)
}

async fn healthz() -> Response {
    Json(json!({ "status": "ok" })).into_response()
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

/// Idempotent: every call returns when the one drain is done, with its counts.
async fn drain(State(app): State<Admin>) -> Response {
    match app.drain.run().await {
        Ok(report) => Json(report).into_response(),
        Err(e) => reply::error(StatusCode::INTERNAL_SERVER_ERROR, "drain_failed", e.to_string()),
    }
}
