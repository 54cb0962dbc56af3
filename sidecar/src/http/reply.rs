//! Turning domain outcomes into HTTP responses.

use axum::{
    body::Body,
    http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    Json,
};
use futures_util::StreamExt;
use serde_json::json;

use crate::{
    directive::{Refusal, RefusalBody},
    dispatch::{EPOCH_HEADER, OWNER_HEADER},
    route::Reply,
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
    (StatusCode::SERVICE_UNAVAILABLE, [(header::RETRY_AFTER, HeaderValue::from(secs))], Json(body))
        .into_response()
}

pub fn owner_failed() -> Response {
    error(StatusCode::BAD_GATEWAY, "owner_failed", None)
}

/// Hop-by-hop headers and the length (we re-frame the body) are not passed through.
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

/// Stream an upstream response back unchanged (status, headers, body).
fn stream_back(upstream: reqwest::Response, keep_alive: impl Send + 'static) -> Response {
    let status = upstream.status();
    let mut headers = HeaderMap::new();
    copy_headers(upstream.headers(), &mut headers);
    let body = upstream.bytes_stream().map(move |chunk| {
        let _ = &keep_alive; // held until the body is done
        chunk
    });
    let mut response = Response::new(Body::from_stream(body));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

/// A session stood down mid-answer is cut off with an error, so the client sees a broken
/// response rather than a complete-looking partial one.
fn halt_on(
    body: Body,
    halt: tokio_util::sync::CancellationToken,
) -> impl futures_util::Stream<Item = Result<bytes::Bytes, axum::BoxError>> + Send {
    let state = (body.into_data_stream(), Box::pin(halt.cancelled_owned()), false);
    futures_util::stream::unfold(state, |(mut data, mut halted, done)| async move {
        if done {
            return None;
        }
        tokio::select! {
            biased;
            _ = &mut halted => Some((Err("session stood down mid-answer".into()), (data, halted, true))),
            next = data.next() => next.map(|item| (item.map_err(Into::into), (data, halted, false))),
        }
    })
}

pub fn reply(reply: Reply, node_id: &str) -> Response {
    match reply {
        Reply::Refused(r) => refusal(&r),
        Reply::OwnerFailed => owner_failed(),
        Reply::PeerRefused(body) => refusal_body(body),
        Reply::Forwarded(upstream) => stream_back(upstream, ()),
        Reply::Local { response, lease, guard } => {
            let halt = lease.halt.clone();
            let epoch = lease.epoch;
            let mut out = stream_back(response, guard);
            let body = std::mem::replace(out.body_mut(), Body::empty());
            *out.body_mut() = Body::from_stream(halt_on(body, halt));
            let headers = out.headers_mut();
            headers.insert(OWNER_HEADER, HeaderValue::from_str(node_id).expect("node id is a header value"));
            headers.insert(EPOCH_HEADER, HeaderValue::from(epoch.0));
            out
        }
    }
}
