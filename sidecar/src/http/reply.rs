//! Turning domain outcomes into HTTP responses.

use axum::{
    body::Body,
    http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    Json,
};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use leasehold_core::{directive::RefusalBody, headers, Owner};

use super::relay::Relay;
use crate::{
    turn::{
        directive::Refusal,
        outcome::Outcome,
        router::Reply,
        run::{Early, Ran},
    },
    upstream,
};

/// A JSON error `{"error": code, "message": ...}`.
pub fn error(status: StatusCode, code: &str, message: impl Into<Option<String>>) -> Response {
    let body = match message.into() {
        Some(message) => json!({ "error": code, "message": message }),
        None => json!({ "error": code }),
    };
    (status, Json(body)).into_response()
}

pub fn refusal(refusal: &Refusal) -> Response {
    refusal_body(refusal.body())
}

/// A `503` with its directive: `Retry-After` in whole seconds, rounded up.
pub fn refusal_body(body: RefusalBody) -> Response {
    let secs = body.retry.map_or(1, |r| r.after_secs());
    let code = HeaderValue::from_str(&body.error).unwrap_or(HeaderValue::from_static("refused"));
    let headers = [(header::RETRY_AFTER, HeaderValue::from(secs)), (headers::REFUSAL, code)];
    (StatusCode::SERVICE_UNAVAILABLE, headers, Json(body)).into_response()
}

pub fn owner_failed() -> Response {
    error(StatusCode::BAD_GATEWAY, "owner_failed", None)
}

/// Hop-by-hop headers are not passed through, nor the length: the server sets it again
/// from the relayed body's exact size, or frames the body as chunks when it is unknown.
fn passes_through(name: &HeaderName) -> bool {
    !matches!(
        name.as_str(),
        "connection" | "keep-alive" | "transfer-encoding" | "te" | "trailer" | "upgrade" | "content-length"
    )
}

fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        if passes_through(name) {
            to.append(name.clone(), value.clone());
        }
    }
}

/// Stream an upstream response back unchanged (status, headers, body; a known length
/// stays known), holding `guard` until the body is done and cutting it off when `halt`
/// fires.
fn stream_back<G: Send + Unpin + 'static>(
    upstream: upstream::Response,
    guard: G,
    halt: Option<CancellationToken>,
) -> Response {
    let (parts, body) = upstream.into_parts();
    let mut response = Response::new(Body::new(Relay::new(body, guard, halt)));
    *response.status_mut() = parts.status;
    copy_headers(&parts.headers, response.headers_mut());
    response
}

/// An owner sidecar's answer to a forwarded request, passed back as it is.
pub fn passed_through(upstream: upstream::Response) -> Response {
    stream_back(upstream, (), None)
}

pub fn reply(reply: Reply) -> Response {
    match reply {
        Reply::Refused(r) => refusal(&r),
        Reply::OwnerFailed => owner_failed(),
        Reply::PeerRejected => error(StatusCode::BAD_GATEWAY, "owner_failed", Reply::peer_rejected_message()),
        Reply::PeerRefused(body) => refusal_body(body),
        Reply::Forwarded(upstream) => stream_back(upstream, (), None),
        Reply::Local { ran, node } => ran_here(ran, &node),
    }
}

/// A turn settled at its owner (this node).
fn ran_here(ran: Ran, node: &Owner) -> Response {
    match ran {
        Ran::Settled(Outcome::Answered { answer, epoch, replayed }) => {
            let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::BAD_GATEWAY);
            let mut out = Response::new(Body::from(answer.body.clone()));
            *out.status_mut() = status;
            let headers = out.headers_mut();
            if let Some(ct) = answer.content_type.as_deref().and_then(|ct| HeaderValue::from_str(ct).ok()) {
                headers.insert(header::CONTENT_TYPE, ct);
            }
            let owner = HeaderValue::from_str(node.node_id()).expect("node id is a header value");
            headers.insert(headers::OWNER, owner);
            headers.insert(headers::EPOCH, HeaderValue::from(epoch.0));
            if replayed {
                headers.insert(headers::REPLAYED, HeaderValue::from_static("true"));
            }
            out
        }
        Ran::Settled(Outcome::Interrupted) => error(
            StatusCode::CONFLICT,
            "interrupted",
            "a newer turn of this session interrupted this one".to_owned(),
        ),
        Ran::Settled(Outcome::Refused(r)) => refusal(&r),
        Ran::Settled(Outcome::OwnerFailed) => owner_failed(),
        Ran::Early(Early::KeyReused) => error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency_key_reused",
            "this Idempotency-Key was used for another request of this session".to_owned(),
        ),
        Ran::Early(Early::Busy { running }) => {
            (StatusCode::CONFLICT, Json(json!({ "error": "busy", "turn_id": running }))).into_response()
        }
        Ran::Early(Early::Cancelled) => {
            error(StatusCode::CONFLICT, "cancelled", "this turn was cancelled before it finished".to_owned())
        }
    }
}
