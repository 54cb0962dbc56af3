//! Peer listener: turns forwarded by other sidecars and followers' streams, accepted only
//! with a valid proof of the cluster secret (anything else: `401`, logged).

use std::sync::Arc;

use axum::{
    extract::{FromRef, Path, Query, Request, State},
    http::{HeaderMap, StatusCode},
    middleware::{self, Next},
    response::Response,
    routing::get,
    Router,
};
use leasehold_core::proof::PeerAuth;

use super::{
    proof::Verifier,
    reply, session_key,
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
        .route("/peer/v1/sessions/{key}/turns/{turn_id}/cancel", super::turns::by_id(Door::Peer))
        .route("/peer/v1/sessions/{key}/stream", get(follow))
        .fallback(super::not_found)
        .method_not_allowed_fallback(super::method_not_allowed)
        .layer(middleware::from_fn_with_state(peer.clone(), authenticate))
        .layer(super::close_when_draining(peer.drain.clone()))
        .with_state(peer)
}

/// Verify the proof over method, path, headers and body before anything else runs.
async fn authenticate(State(peer): State<Peer>, request: Request, next: Next) -> Response {
    let verifier = Verifier {
        port: "peer",
        auth: &peer.auth,
        node_id: &peer.node_id,
        metrics: &peer.metrics,
        max_body: peer.turns.max_body,
    };
    verifier.admit(request, next).await
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
