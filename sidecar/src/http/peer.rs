//! Peer listener: turns forwarded by other sidecars, accepted only with a valid proof of
//! the cluster secret (anything else: `401`, logged).

use std::sync::Arc;

use axum::{
    body::Body,
    extract::{Path, Request, State},
    http::StatusCode,
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::post,
    Router,
};

use super::{public::post_turn, read_body, reply, BadRequest};
use crate::{app::Sidecar, dispatch::Kind, route::Entry};

pub fn router(app: Arc<Sidecar>) -> Router {
    Router::new()
        .route("/peer/v1/sessions/{key}/turns", post(turn))
        .route("/peer/v1/sessions/{key}/events", post(event))
        .route("/peer/v1/sessions/{key}/stream", axum::routing::get(super::stream::peer))
        .fallback(super::not_found)
        .method_not_allowed_fallback(super::method_not_allowed)
        .layer(middleware::from_fn_with_state(app.clone(), authenticate))
        .layer(super::close_when_draining(app.clone()))
        .with_state(app)
}

/// Verify the proof over method, path and body before anything else runs.
async fn authenticate(State(app): State<Arc<Sidecar>>, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let body = match read_body(&parts.headers, body, app.max_body).await {
        Ok(body) => body,
        Err(rejected) => return rejected.into_response(),
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    if let Err(e) = app.router.forwarder.auth().verify(parts.method.as_str(), path, &parts.headers, &body) {
        tracing::warn!(%path, error = %e, "rejected peer request");
        app.metrics.peer_auth_failure();
        return reply::error(StatusCode::UNAUTHORIZED, "unauthorized", e.to_string());
    }
    next.run(Request::from_parts(parts, Body::from(body))).await
}

async fn turn(
    state: State<Arc<Sidecar>>,
    key: Path<String>,
    request: Request,
) -> Result<Response, BadRequest> {
    post_turn(state, key, request, Kind::Turn, Entry::Peer).await
}

async fn event(
    state: State<Arc<Sidecar>>,
    key: Path<String>,
    request: Request,
) -> Result<Response, BadRequest> {
    post_turn(state, key, request, Kind::Event, Entry::Peer).await
}
