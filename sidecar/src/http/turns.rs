//! `POST …/turns` and `POST …/events`, the same on the public and the peer listener:
//! parse the request into a [`Turn`], route it, reply. And a turn by its id: `GET` (any
//! node reads the journal) and `DELETE` (cancelled at the owner).

use std::sync::Arc;

use axum::{
    extract::{FromRef, Path, Request, State},
    http::{header, HeaderMap, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    routing::{post, MethodRouter},
    Json,
};
use leasehold_core::headers;
use serde_json::{json, value::RawValue};

use tracing::Instrument;

use super::{read_body, reply, session_key, BadRequest};
use crate::telemetry;
use crate::turn::{
    client_headers::ForwardHeaders,
    directive::Refusal,
    queue::Multitask,
    router::{CancelReply, TurnRouter},
    run::{Cancelled, TurnStatus},
    Door, Kind, Turn,
};

/// What a listener needs to take turns.
#[derive(Debug, Clone)]
pub struct Turns {
    pub router: Arc<TurnRouter>,
    /// Largest accepted body (`413` above).
    pub max_body: usize,
    /// The client headers a turn carries to the agent.
    pub forward_headers: ForwardHeaders,
}

/// The route for a turn (or event) entering at `door`.
pub fn route<S>(kind: Kind, door: Door) -> MethodRouter<S>
where
    S: Clone + Send + Sync + 'static,
    Turns: FromRef<S>,
{
    post(move |State(turns): State<Turns>, Path(key): Path<String>, request: Request| async move {
        turns.take(key, request, kind, door).await
    })
}

/// Longest idempotency key (CONTRACT §3).
pub const MAX_IDEMPOTENCY_KEY: usize = 255;

/// The turn's id and whether it is the client's idempotency key: the key when given
/// (1–255 visible ASCII), else the id a forwarding sidecar gave (any attempt of a turn
/// carries the same), else a new one.
fn turn_id(headers: &HeaderMap) -> Result<(String, bool), BadRequest> {
    if let Some(key) = headers.get(headers::IDEMPOTENCY_KEY) {
        let key = key.as_bytes();
        if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY || !key.iter().all(|b| (0x21..=0x7e).contains(b))
        {
            return Err(BadRequest::new(
                StatusCode::BAD_REQUEST,
                "invalid_idempotency_key",
                format!("Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} visible ASCII characters"),
            ));
        }
        return Ok((String::from_utf8_lossy(key).into_owned(), true));
    }
    let id = headers
        .get(headers::TURN_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|id| uuid::Uuid::parse_str(id).is_ok())
        .map_or_else(|| uuid::Uuid::new_v4().to_string(), str::to_owned);
    Ok((id, false))
}

/// The client's multitask policy for this turn, if it named one.
fn multitask(headers: &HeaderMap) -> Result<Option<Multitask>, BadRequest> {
    let Some(value) = headers.get(headers::MULTITASK) else { return Ok(None) };
    let invalid = |message: String| BadRequest::new(StatusCode::BAD_REQUEST, "invalid_multitask", message);
    let value = value.to_str().map_err(|_| invalid("Leasehold-Multitask is not text".to_owned()))?;
    value.parse().map(Some).map_err(|e: String| invalid(format!("Leasehold-Multitask: {e}")))
}

impl Turns {
    async fn take(
        &self,
        key: String,
        request: Request,
        kind: Kind,
        door: Door,
    ) -> Result<Response, BadRequest> {
        let key = session_key(&key)?;
        let (parts, body) = request.into_parts();
        let body = read_body(&parts.headers, body, self.max_body).await?;
        let (id, keyed) = turn_id(&parts.headers)?;
        let multitask = multitask(&parts.headers)?;
        let content_type = parts.headers.get(header::CONTENT_TYPE).cloned();
        let id_header = HeaderValue::try_from(id.as_str()).expect("a turn id is visible ASCII");
        let client_headers = match door {
            Door::Public => self.forward_headers.from_client(&parts.headers),
            Door::Peer => self.forward_headers.from_peer(&parts.headers),
        };
        let span =
            tracing::info_span!("turn", session = %key, turn_id = %id, kind = kind.segment(), door = ?door);
        // The client's trace (public door) or the forwarding sidecar's span (peer door).
        telemetry::continue_from(&span, &parts.headers);
        let turn = Turn { kind, key, id, keyed, multitask, content_type, client_headers, body };
        let mut response = reply::reply(self.router.route(turn, door).instrument(span).await);
        // Every answer names its turn: a client without a key can read its fate
        // (`GET …/turns/{id}`) or re-send it as a repeat of that id.
        response.headers_mut().entry(headers::TURN_ID).or_insert(id_header);
        Ok(response)
    }
}

/// `GET …/turns/{id}` (public) and `DELETE …/turns/{id}`.
pub fn by_id<S>(door: Door) -> MethodRouter<S>
where
    S: Clone + Send + Sync + 'static,
    Turns: FromRef<S>,
{
    let cancel = move |State(turns): State<Turns>, Path((key, id)): Path<(String, String)>| async move {
        turns.cancel(key, id, door).await
    };
    match door {
        Door::Public => axum::routing::get(
            |State(turns): State<Turns>, Path((key, id)): Path<(String, String)>| async move {
                turns.status(key, id).await
            },
        )
        .delete(cancel),
        Door::Peer => post(cancel),
    }
}

impl Turns {
    async fn status(&self, key: String, id: String) -> Result<Response, BadRequest> {
        let key = session_key(&key)?;
        Ok(match self.router.runner.status(&key, &id).await {
            Ok(Some(status)) => Json(status_body(&status)).into_response(),
            Ok(None) => reply::error(StatusCode::NOT_FOUND, "no_turn", None),
            Err(e) => {
                tracing::warn!(error = %e, "journal read failed");
                reply::refusal(&Refusal::StoreUnavailable)
            }
        })
    }

    async fn cancel(&self, key: String, id: String, door: Door) -> Result<Response, BadRequest> {
        let key = session_key(&key)?;
        Ok(match self.router.cancel(&key, &id, door).await {
            CancelReply::Done(Cancelled::Cancelled) => {
                Json(json!({ "turn_id": id, "state": "cancelled" })).into_response()
            }
            CancelReply::Done(Cancelled::Finished) => reply::error(
                StatusCode::CONFLICT,
                "finished",
                "the turn finished before it could be cancelled: its answer stands".to_owned(),
            ),
            CancelReply::Done(Cancelled::NotFound) => reply::error(StatusCode::NOT_FOUND, "no_turn", None),
            CancelReply::Forwarded(response) => reply::passed_through(response),
            CancelReply::Refused(refusal) => reply::refusal(&refusal),
            CancelReply::OwnerFailed => reply::owner_failed(),
        })
    }
}

/// `{"turn_id","state","epoch","attempts"}` and, once finished, the recorded answer: its
/// body as JSON when it is JSON, else as text.
fn status_body(status: &TurnStatus) -> serde_json::Value {
    let record = &status.record;
    let state = if status.interrupted { "interrupted" } else { record.state.as_str() };
    let mut body = json!({
        "turn_id": record.turn_id,
        "state": state,
        "epoch": record.epoch.0,
        "attempts": record.attempts,
    });
    if let Some(answer) = &record.answer {
        let text = String::from_utf8_lossy(&answer.body);
        let json_body = answer.content_type.as_deref().is_some_and(|ct| ct.contains("json"));
        let value = match json_body.then(|| serde_json::from_str::<Box<RawValue>>(&text).ok()).flatten() {
            Some(raw) => serde_json::to_value(raw).unwrap_or(serde_json::Value::Null),
            None => serde_json::Value::String(text.into_owned()),
        };
        body["answer"] =
            json!({ "status": answer.status, "content_type": answer.content_type, "body": value });
    }
    body
}
