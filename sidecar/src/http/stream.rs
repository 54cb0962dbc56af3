//! Event streams: `GET /v1/sessions/{key}/stream` on the public port (any node) and
//! `GET /peer/v1/sessions/{key}/stream` on the peer port (the owner, for followers).

use std::{collections::VecDeque, convert::Infallible, sync::Arc, time::Duration};

use axum::{
    body::{Body, Bytes},
    extract::{Path, Query, State},
    http::{header, HeaderMap, HeaderName, StatusCode},
    response::{IntoResponse, Response},
};
use futures_util::Stream;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::broadcast::error::RecvError;

use super::{reply, session_key, BadRequest};
use crate::{
    app::Sidecar,
    directive::Refusal,
    key::SessionKey,
    observe::{sse as frames, Event, EventId, Message, Subscription},
};

/// A comment line this often keeps idle streams open through proxies and lets us notice
/// observers that went away.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

fn keep_alive() -> tokio::time::Interval {
    let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + KEEP_ALIVE, KEEP_ALIVE);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval
}

#[derive(Debug, Deserialize)]
pub struct StreamQuery {
    after: Option<String>,
}

/// `Last-Event-ID` (what a reconnecting browser sends) or `?after=`.
fn after(headers: &HeaderMap, query: &StreamQuery) -> Result<Option<EventId>, BadRequest> {
    let raw = headers.get("last-event-id").and_then(|v| v.to_str().ok()).or(query.after.as_deref());
    raw.filter(|s| !s.is_empty())
        .map(|s| {
            EventId::parse(s).ok_or_else(|| {
                BadRequest::new(StatusCode::BAD_REQUEST, "invalid_event_id", "expected <epoch>-<seq>")
            })
        })
        .transpose()
}

/// Who reads the stream: they react differently to `Moved`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reader {
    /// A client: follows the session wherever it goes.
    Observer,
    /// Another node's follower: ends when we stop owning the session.
    Peer,
}

/// Counts an observer while its stream lives.
struct ObserverGuard {
    app: Arc<Sidecar>,
    key: SessionKey,
}

impl Drop for ObserverGuard {
    fn drop(&mut self) {
        self.app.hubs.observer_left(&self.key);
        self.app.metrics.observers(-1);
    }
}

struct Reading {
    key: SessionKey,
    replay: VecDeque<Event>,
    sub: Subscription,
    last: Option<EventId>,
    /// What the reader asked to resume after (for a replay computed once primed).
    after: Option<EventId>,
    announce_idle: bool,
    /// Peer readers learn when the replay part is over.
    announce_primed: bool,
    keep_alive: tokio::time::Interval,
    done: bool,
    reader: Reader,
    app: Arc<Sidecar>,
    _guard: Option<ObserverGuard>,
}

/// Replay, then live; never an id at or below one already delivered.
fn events(state: Reading) -> impl Stream<Item = Result<Bytes, Infallible>> + Send {
    futures_util::stream::unfold(state, |mut s| async move {
        if s.done {
            return None;
        }
        if let Some(event) = s.replay.pop_front() {
            s.last = Some(event.id);
            return Some((Ok(event.frame.clone()), s));
        }
        if std::mem::take(&mut s.announce_primed) {
            return Some((Ok(frames::control("primed", json!({}))), s));
        }
        if std::mem::take(&mut s.announce_idle) {
            return Some((Ok(frames::control("idle", json!({}))), s));
        }
        loop {
            // One timer per stream for the keep-alive, not one per message.
            let next = tokio::select! {
                biased;
                next = s.sub.live.recv() => next,
                _ = s.keep_alive.tick() => return Some((Ok(Bytes::from_static(frames::KEEP_ALIVE)), s)),
            };
            match next {
                // Not primed yet: the backfill arriving now is taken as a whole below.
                Ok(Message::Event(_)) if !s.sub.primed => continue,
                Ok(Message::Primed) if !s.sub.primed => {
                    s.sub.primed = true;
                    s.replay = s.app.hubs.replay(&s.key, s.after).into();
                    if let Some(event) = s.replay.pop_front() {
                        s.last = Some(event.id);
                        return Some((Ok(event.frame.clone()), s));
                    }
                }
                Ok(Message::Primed) => continue,
                Ok(Message::Event(event)) if s.last.is_none_or(|last| event.id > last) => {
                    s.last = Some(event.id);
                    return Some((Ok(event.frame.clone()), s));
                }
                Ok(Message::Event(_)) => continue, // stale epoch or duplicate: the observe fence
                Ok(Message::Idle) => return Some((Ok(frames::control("idle", json!({}))), s)),
                Ok(Message::Moved) if s.reader == Reader::Peer => {
                    s.done = true;
                    return Some((Ok(frames::control("moved", json!({}))), s));
                }
                Ok(Message::Moved) => continue,
                Ok(Message::Reconnect) => {
                    s.done = true;
                    return Some((Ok(frames::control("reconnect", json!({}))), s));
                }
                Err(RecvError::Lagged(missed)) => {
                    s.done = true;
                    s.app.metrics.observer_cut();
                    let last = s.last.map(|id| id.to_string());
                    let data = json!({ "missed": missed, "last_event_id": last, "hint": "reconnect with Last-Event-ID" });
                    return Some((Ok(frames::control("overflow", data)), s));
                }
                Err(RecvError::Closed) => return None,
            }
        }
    })
}

fn sse_response(state: Reading) -> Response {
    let headers = [
        (header::CONTENT_TYPE, "text/event-stream"),
        (header::CACHE_CONTROL, "no-cache"),
        // Ask proxies (nginx) not to buffer the stream.
        (HeaderName::from_static("x-accel-buffering"), "no"),
    ];
    (headers, Body::from_stream(events(state))).into_response()
}

/// Observe a session from this node, whoever owns it.
pub async fn observe(
    State(app): State<Arc<Sidecar>>,
    Path(key): Path<String>,
    Query(query): Query<StreamQuery>,
    headers: HeaderMap,
) -> Result<Response, BadRequest> {
    let key = session_key(&key)?;
    let after = after(&headers, &query)?;
    let mut sub = app.hubs.subscribe(&key, after);
    // Read after subscribing: a drain sets the flag before it tells every subscriber to
    // reconnect, so a stream either gets that `reconnect` or sees the flag here.
    if app.drain.is_draining() {
        return Ok(reply::refusal(&Refusal::Draining { drain_timeout: app.drain.timeout }));
    }
    app.metrics.observers(1);
    let guard = ObserverGuard { app: app.clone(), key: key.clone() };
    if app.hubs.observer_joined(&key) {
        app.follow.start(key.clone());
    }
    let state = Reading {
        key: key.clone(),
        replay: std::mem::take(&mut sub.replay).into(),
        announce_idle: sub.idle,
        announce_primed: false,
        keep_alive: keep_alive(),
        sub,
        last: after,
        after,
        done: false,
        reader: Reader::Observer,
        app,
        _guard: Some(guard),
    };
    Ok(sse_response(state))
}

/// The owner's side of a follower's upstream.
pub async fn peer(
    State(app): State<Arc<Sidecar>>,
    Path(key): Path<String>,
    Query(query): Query<StreamQuery>,
    headers: HeaderMap,
) -> Result<Response, BadRequest> {
    let key = session_key(&key)?;
    let after = after(&headers, &query)?;
    if !app.ownership.holds(&key) {
        return Ok(reply::error(StatusCode::CONFLICT, "not_owner", None));
    }
    let mut sub = app.hubs.subscribe(&key, after);
    sub.primed = true; // we own it: our buffer is the truth
    let state = Reading {
        key,
        replay: std::mem::take(&mut sub.replay).into(),
        announce_idle: false,
        announce_primed: true,
        keep_alive: keep_alive(),
        sub,
        last: after,
        after,
        done: false,
        reader: Reader::Peer,
        app,
        _guard: None,
    };
    Ok(sse_response(state))
}
