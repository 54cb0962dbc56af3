//! Agent API (CONTRACT §5), loopback port. Every write carries `Leasehold-Epoch`.

use std::sync::Arc;

use axum::{
    body::Body,
    extract::{Path, State},
    http::{HeaderMap, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    routing::{delete, get, post},
    Json, Router,
};
use serde::Deserialize;
use serde_json::{json, value::RawValue};

use leasehold_core::{headers, Epoch, SessionKey};

use super::{read_body, reply, session_key, BadRequest};
use crate::{
    fence::{Fence, WriteError},
    turn::directive::Refusal,
};

/// Checkpoints hold a whole conversation's state: larger than one turn, still bounded.
pub const MAX_CHECKPOINT_BYTES: usize = 16 * 1024 * 1024;

/// The domain part the agent listener calls, and its body limit for events.
#[derive(Debug, Clone)]
pub struct AgentPort {
    pub fence: Arc<Fence>,
    pub max_body: usize,
}

pub fn router(app: AgentPort) -> Router {
    Router::new()
        .route("/v1/sessions/{key}/checkpoint", get(get_checkpoint).put(put_checkpoint))
        .route("/v1/sessions/{key}/events", post(publish))
        .route("/v1/sessions/{key}/turns/{turn_id}/events", get(turn_events))
        .route("/v1/sessions/{key}/lease", delete(release))
        .fallback(super::not_found)
        .method_not_allowed_fallback(super::method_not_allowed)
        .with_state(app)
}

fn epoch(headers: &HeaderMap) -> Result<Epoch, BadRequest> {
    headers
        .get(headers::EPOCH)
        .and_then(|v| v.to_str().ok()?.parse::<i64>().ok())
        .filter(|e| *e >= 1)
        .map(Epoch)
        .ok_or_else(|| {
            BadRequest::new(
                StatusCode::BAD_REQUEST,
                "missing_epoch",
                "Leasehold-Epoch header must be a positive integer",
            )
        })
}

fn key_and_epoch(key: &str, headers: &HeaderMap) -> Result<(SessionKey, Epoch), BadRequest> {
    Ok((session_key(key)?, epoch(headers)?))
}

fn write_error(e: WriteError) -> Response {
    match e {
        WriteError::Fenced => reply::error(StatusCode::CONFLICT, "fenced", None),
        WriteError::Unavailable(e) => {
            tracing::warn!(error = %e, "agent write failed");
            reply::refusal(&Refusal::StoreUnavailable)
        }
    }
}

async fn get_checkpoint(
    State(app): State<AgentPort>,
    Path(key): Path<String>,
) -> Result<Response, BadRequest> {
    let key = session_key(&key)?;
    Ok(match app.fence.checkpoint(&key).await {
        Ok(Some(cp)) => {
            let mut response = cp.data.clone().into_response();
            response.headers_mut().insert(headers::CHECKPOINT_EPOCH, HeaderValue::from(cp.epoch.0));
            if let Some(turn) = cp.turn_id.as_deref().and_then(|t| HeaderValue::from_str(t).ok()) {
                response.headers_mut().insert(headers::CHECKPOINT_TURN, turn);
            }
            response
        }
        Ok(None) => reply::error(StatusCode::NOT_FOUND, "no_checkpoint", None),
        Err(e) => {
            tracing::warn!(error = %e, "checkpoint read failed");
            reply::refusal(&Refusal::StoreUnavailable)
        }
    })
}

/// `GET …/turns/{turn-id}/events`: the journaled events of the turn's attempts before the
/// caller's epoch (`Leasehold-Epoch`; all of them without it), oldest first, for a resume.
async fn turn_events(
    State(app): State<AgentPort>,
    Path((key, turn_id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, BadRequest> {
    let key = session_key(&key)?;
    let before = match headers.contains_key(headers::EPOCH) {
        true => Some(epoch(&headers)?),
        false => None,
    };
    Ok(match app.fence.turn_events(&key, &turn_id, before).await {
        Ok(events) => {
            let events: Vec<_> = events
                .into_iter()
                .map(|e| {
                    let data = RawValue::from_string(e.data).unwrap_or_else(|_| null());
                    json!({ "id": e.id.to_string(), "type": e.kind, "data": data })
                })
                .collect();
            Json(events).into_response()
        }
        Err(e) => {
            tracing::warn!(error = %e, "journal read failed");
            reply::refusal(&Refusal::StoreUnavailable)
        }
    })
}

fn null() -> Box<RawValue> {
    RawValue::from_string("null".into()).expect("valid JSON")
}

async fn put_checkpoint(
    State(app): State<AgentPort>,
    Path(key): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, BadRequest> {
    let (key, epoch) = key_and_epoch(&key, &headers)?;
    let data = read_body(&headers, body, MAX_CHECKPOINT_BYTES).await?;
    let span = tracing::info_span!("checkpoint", session = %key, epoch = epoch.0);
    // An agent that passes on the turn's traceparent puts its checkpoint in the trace.
    crate::telemetry::continue_from(&span, &headers);
    let written = tracing::Instrument::instrument(app.fence.put_checkpoint(&key, epoch, &data), span);
    Ok(match written.await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => write_error(e),
    })
}

#[derive(Debug, Deserialize)]
struct Publish {
    #[serde(rename = "type")]
    kind: String,
    data: Option<Box<RawValue>>,
}

async fn publish(
    State(app): State<AgentPort>,
    Path(key): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, BadRequest> {
    let (key, epoch) = key_and_epoch(&key, &headers)?;
    let body = read_body(&headers, body, app.max_body).await?;
    let malformed = |message: String| BadRequest::new(StatusCode::BAD_REQUEST, "malformed_event", message);
    let event: Publish = serde_json::from_slice(&body).map_err(|e| malformed(e.to_string()))?;
    if event.kind.is_empty() || event.kind.contains(['\n', '\r']) {
        return Err(malformed("type must be one non-empty line".to_owned()));
    }
    let data = event.data.unwrap_or_else(null);
    Ok(match app.fence.publish(&key, epoch, event.kind, data).await {
        Ok(id) => (StatusCode::ACCEPTED, Json(json!({ "id": id.to_string() }))).into_response(),
        Err(e) => write_error(e),
    })
}

async fn release(
    State(app): State<AgentPort>,
    Path(key): Path<String>,
    headers: HeaderMap,
) -> Result<Response, BadRequest> {
    let (key, epoch) = key_and_epoch(&key, &headers)?;
    Ok(match app.fence.release(&key, epoch).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => write_error(e),
    })
}
