//! Peer listener: turns forwarded by other sidecars and followers' streams, accepted only
//! with a valid proof of the cluster secret (anything else: `401`, logged).

use std::sync::Arc;

use axum::{
    body::Body,
    extract::{FromRef, Path, Query, Request, State},
    http::{HeaderMap, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use leasehold_core::proof::{PeerAuth, Signed};

use super::{
    read_body, reply, session_key,
    stream::{self, StreamQuery},
    BadRequest, Turns,
};
use crate::{
    drain::Drain,
    metrics::Metrics,
    observe::Observe,
    turn::{Door, Kind},
};

/// The domain parts the peer listener calls.
#[derive(Debug, Clone)]
pub struct Peer {
    pub turns: Turns,
    pub observe: Arc<Observe>,
    pub auth: Arc<PeerAuth>,
    pub drain: Arc<Drain>,
    pub metrics: Arc<Metrics>,
    /// This sidecar's node id: the destination every proof must name.
    pub node_id: String,
}

impl FromRef<Peer> for Turns {
    fn from_ref(peer: &Peer) -> Turns {
        peer.turns.clone()
    }
}

pub fn router(peer: Peer) -> Router {
    Router::new()
        .route("/peer/v1/sessions/{key}/turns", super::turns::route(Kind::Turn, Door::Peer))
        .route("/peer/v1/sessions/{key}/events", super::turns::route(Kind::Event, Door::Peer))
        .route("/peer/v1/sessions/{key}/stream", get(follow))
        .fallback(super::not_found)
        .method_not_allowed_fallback(super::method_not_allowed)
        .layer(middleware::from_fn_with_state(peer.clone(), authenticate))
        .layer(super::close_when_draining(peer.drain.clone()))
        .with_state(peer)
}

/// Verify the proof over method, path and body before anything else runs.
async fn authenticate(State(peer): State<Peer>, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let body = match read_body(&parts.headers, body, peer.turns.max_body).await {
        Ok(body) => body,
        Err(rejected) => return rejected.into_response(),
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let signed = Signed {
        method: parts.method.as_str(),
        path,
        destination: &peer.node_id,
        headers: &parts.headers,
        body: &body,
    };
    if let Err(e) = peer.auth.verify(&signed) {
        tracing::warn!(%path, error = %e, "rejected peer request");
        peer.metrics.peer_auth_failure();
        return reply::error(StatusCode::UNAUTHORIZED, "unauthorized", e.to_string());
    }
    next.run(Request::from_parts(parts, Body::from(body))).await
}

/// The owner's side of a follower's upstream.
async fn follow(
    State(peer): State<Peer>,
    Path(key): Path<String>,
    Query(query): Query<StreamQuery>,
    headers: HeaderMap,
) -> Result<Response, BadRequest> {
    let key = session_key(&key)?;
    let after = stream::after(&headers, &query)?;
    Ok(match peer.observe.open_peer(key, after) {
        Ok(reading) => stream::sse(reading),
        Err(_) => reply::error(StatusCode::CONFLICT, "not_owner", None),
    })
}
