//! The four listeners (CONTRACT §2): thin handlers that parse, call one domain function
//! and reply. Each listener's router takes the domain parts it uses as its state; nothing
//! here holds domain state of its own.

pub mod admin;
pub mod agent;
pub mod head_timer;
pub mod peer;
mod proof;
pub mod public;
pub mod relay;
pub mod reply;
pub mod server;
mod stream;
mod turns;

use axum::{
    body::{Body, Bytes},
    http::{header, HeaderMap, StatusCode},
    response::{IntoResponse, Response},
};

use futures_util::StreamExt;
use leasehold_core::SessionKey;
use std::sync::Arc;

use crate::drain::Drain;

pub use self::turns::Turns;

/// Once this pod drains, every answer on the public and peer ports says `Connection:
/// close` (as Envoy and nginx do in a drain): a client's pooled keep-alive connections to
/// the pod are retired one by one as they are used, rather than all closed under it when
/// the process exits, where a request sent at that instant is lost to the race (HTTP/1.1
/// has no other way to tell a client to stop using an idle connection). Each such answer
/// also tells the drain that clients are still sending (`Drain::quiet_for`).
pub fn close_when_draining(
    drain: Arc<Drain>,
) -> tower::util::MapResponseLayer<impl Fn(Response) -> Response + Clone> {
    tower::util::MapResponseLayer::new(move |mut response: Response| {
        if drain.is_draining() {
            response.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
            drain.answered();
        }
        response
    })
}

/// A request refused before it reached the domain: bad input, with a JSON body.
#[derive(Debug)]
pub struct BadRequest {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl BadRequest {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        BadRequest { status, code, message: message.into() }
    }
}

impl IntoResponse for BadRequest {
    fn into_response(self) -> Response {
        reply::error(self.status, self.code, self.message)
    }
}

/// Parse the `{key}` path segment or answer `400`.
pub fn session_key(raw: &str) -> Result<SessionKey, BadRequest> {
    SessionKey::parse(raw).map_err(|e| BadRequest::new(StatusCode::BAD_REQUEST, "invalid_key", e.to_string()))
}

/// Read a whole request body of at most `limit` bytes, or answer `413` / `400`.
pub async fn read_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, BadRequest> {
    let too_large = || {
        BadRequest::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("the limit is {limit} bytes"),
        )
    };
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        discard(body.into_data_stream(), limit.saturating_mul(DISCARD_FACTOR)).await;
        return Err(too_large());
    }
    let mut stream = body.into_data_stream();
    // Chunks are kept as they arrive: a body in one chunk (the common case) is not copied.
    let (mut chunks, mut read) = (Vec::with_capacity(1), 0usize);
    while let Some(chunk) = stream.next().await {
        let chunk: Bytes =
            chunk.map_err(|e| BadRequest::new(StatusCode::BAD_REQUEST, "body_read_failed", e.to_string()))?;
        if read + chunk.len() > limit {
            discard(stream, limit.saturating_mul(DISCARD_FACTOR)).await;
            return Err(too_large());
        }
        read += chunk.len();
        chunks.push(chunk);
    }
    Ok(match chunks.len() {
        1 => chunks.swap_remove(0),
        _ => Bytes::from(chunks.concat()),
    })
}

/// An oversized body is read and dropped, up to this many times the limit, before the
/// `413` goes out: a client still sending would otherwise see a reset instead of the
/// answer. Beyond that the connection is simply closed.
const DISCARD_FACTOR: usize = 8;

async fn discard(mut stream: axum::body::BodyDataStream, cap: usize) {
    let mut seen = 0usize;
    while let Some(Ok(chunk)) = stream.next().await {
        seen += chunk.len();
        if seen > cap {
            break;
        }
    }
}

/// `404` for unknown routes, with a JSON body like every other error.
pub async fn not_found() -> Response {
    reply::error(StatusCode::NOT_FOUND, "not_found", None)
}

/// `405` for a known path with the wrong method.
pub async fn method_not_allowed() -> Response {
    reply::error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", None)
}
