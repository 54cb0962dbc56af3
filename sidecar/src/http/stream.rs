//! SSE on the wire: where a reader resumes (`Last-Event-ID` or `?after=`) and the
//! streaming response around an open [`Reading`].

use std::convert::Infallible;

use axum::{
    body::Body,
    http::{header, HeaderMap, HeaderName, StatusCode},
    response::{IntoResponse, Response},
};
use futures_util::StreamExt;
use leasehold_core::EventId;
use serde::Deserialize;

use super::BadRequest;
use crate::observe::Reading;

#[derive(Debug, Deserialize)]
pub struct StreamQuery {
    after: Option<String>,
}

/// `Last-Event-ID` (what a reconnecting browser sends) or `?after=`.
pub fn after(headers: &HeaderMap, query: &StreamQuery) -> Result<Option<EventId>, BadRequest> {
    let raw = headers.get("last-event-id").and_then(|v| v.to_str().ok()).or(query.after.as_deref());
    raw.filter(|s| !s.is_empty())
        .map(|s| {
            EventId::parse(s).ok_or_else(|| {
                BadRequest::new(StatusCode::BAD_REQUEST, "invalid_event_id", "expected <epoch>-<seq>")
            })
        })
        .transpose()
}

/// The `text/event-stream` answer carrying `reading`'s frames.
pub fn sse(reading: Reading) -> Response {
    let headers = [
        (header::CONTENT_TYPE, "text/event-stream"),
        (header::CACHE_CONTROL, "no-cache"),
        // Ask proxies (nginx) not to buffer the stream.
        (HeaderName::from_static("x-accel-buffering"), "no"),
    ];
    let body = Body::from_stream(reading.frames().map(Ok::<_, Infallible>));
    (headers, body).into_response()
}
