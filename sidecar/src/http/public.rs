//! Client API (CONTRACT §3), public port.

use std::sync::Arc;

use axum::{
    extract::{Path, Request, State},
    http::header,
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use serde::Serialize;

use super::{read_body, reply, session_key, BadRequest};
use crate::{
    app::Sidecar,
    dispatch::{Kind, Turn, TURN_ID_HEADER},
    route::Entry,
};

pub fn router(app: Arc<Sidecar>) -> Router {
    Router::new()
        .route("/v1/sessions/{key}/turns", post(turn))
        .route("/v1/sessions/{key}/events", post(event))
        .route("/v1/sessions/{key}/stream", get(super::stream::observe))
        .route("/v1/sessions/{key}", get(session))
        .fallback(super::not_found)
        .method_not_allowed_fallback(super::method_not_allowed)
        .layer(super::close_when_draining(app.clone()))
        .with_state(app)
}

async fn turn(
    state: State<Arc<Sidecar>>,
    key: Path<String>,
    request: Request,
) -> Result<Response, BadRequest> {
    post_turn(state, key, request, Kind::Turn, Entry::Public).await
}

async fn event(
    state: State<Arc<Sidecar>>,
    key: Path<String>,
    request: Request,
) -> Result<Response, BadRequest> {
    post_turn(state, key, request, Kind::Event, Entry::Public).await
}

/// Shared by the public and the peer listener: parse, route, answer.
pub async fn post_turn(
    State(app): State<Arc<Sidecar>>,
    Path(key): Path<String>,
    request: Request,
    kind: Kind,
    entry: Entry,
) -> Result<Response, BadRequest> {
    let key = session_key(&key)?;
    let (parts, body) = request.into_parts();
    let headers = parts.headers;
    let body = read_body(&headers, body, app.max_body).await?;
    let id = headers
        .get(TURN_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|id| uuid::Uuid::parse_str(id).is_ok())
        .map_or_else(|| uuid::Uuid::new_v4().to_string(), str::to_owned);
    let content_type = headers.get(header::CONTENT_TYPE).cloned();
    let turn = Turn { kind, key, id, content_type, body };
    Ok(reply::reply(app.router.route(turn, entry).await, &app.node_id))
}

#[derive(Debug, Serialize)]
struct SessionView {
    key: String,
    owner: Option<String>,
    epoch: Option<i64>,
    expires_in_ms: Option<u64>,
    claimable: bool,
}

/// A read of the session's lease; never a claim.
async fn session(State(app): State<Arc<Sidecar>>, Path(key): Path<String>) -> Result<Response, BadRequest> {
    let key = session_key(&key)?;
    Ok(match app.ownership.store().lookup(&key).await {
        Ok(info) => Json(SessionView {
            key: key.to_string(),
            owner: info.holder.as_ref().map(|h| h.owner.node_id().to_owned()),
            epoch: info.epoch.map(|e| e.0),
            expires_in_ms: info.holder.as_ref().map(|h| h.remaining.as_millis() as u64),
            claimable: info.claimable(),
        })
        .into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "session lookup failed");
            reply::refusal(&crate::directive::Refusal::StoreUnavailable)
        }
    })
}
