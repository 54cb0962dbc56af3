//! Client API (CONTRACT §3), public port.

use std::sync::Arc;

use axum::{
    extract::{FromRef, Path, Query, State},
    http::HeaderMap,
    response::{IntoResponse, Response},
    routing::get,
    Json, Router,
};
use serde::Serialize;

use super::{
    reply, session_key,
    stream::{self, StreamQuery},
    BadRequest, Turns,
};
use crate::{
    drain::Drain,
    observe::{NotOpened, Observe},
    ownership::Ownership,
    turn::{directive::Refusal, Door, Kind},
};

/// The domain parts the public listener calls.
#[derive(Debug, Clone)]
pub struct Public {
    pub turns: Turns,
    pub observe: Arc<Observe>,
    pub ownership: Arc<Ownership>,
    pub drain: Arc<Drain>,
}

impl FromRef<Public> for Turns {
    fn from_ref(public: &Public) -> Turns {
        public.turns.clone()
    }
}

pub fn router(public: Public) -> Router {
    Router::new()
        .route("/v1/sessions/{key}/turns", super::turns::route(Kind::Turn, Door::Public))
        .route("/v1/sessions/{key}/events", super::turns::route(Kind::Event, Door::Public))
        .route("/v1/sessions/{key}/turns/{turn_id}", super::turns::by_id(Door::Public))
        .route("/v1/sessions/{key}/stream", get(observe))
        .route("/v1/sessions/{key}", get(session))
        .fallback(super::not_found)
        .method_not_allowed_fallback(super::method_not_allowed)
        .layer(super::close_when_draining(public.drain.clone()))
        .with_state(public)
}

/// Observe a session from this node, whoever owns it.
async fn observe(
    State(public): State<Public>,
    Path(key): Path<String>,
    Query(query): Query<StreamQuery>,
    headers: HeaderMap,
) -> Result<Response, BadRequest> {
    let key = session_key(&key)?;
    let after = stream::after(&headers, &query)?;
    Ok(match public.observe.open(key, after) {
        Ok(reading) => stream::sse(reading),
        Err(NotOpened::Overloaded) => reply::refusal(&Refusal::Overloaded),
        Err(_) => reply::refusal(&Refusal::Draining { drain_timeout: public.drain.timeout }),
    })
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
async fn session(State(public): State<Public>, Path(key): Path<String>) -> Result<Response, BadRequest> {
    let key = session_key(&key)?;
    Ok(match public.ownership.lookup(&key).await {
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
            reply::refusal(&Refusal::StoreUnavailable)
        }
    })
}
