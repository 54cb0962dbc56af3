//! `POST …/turns` and `POST …/events`, the same on the public and the peer listener:
//! parse the request into a [`Turn`], route it, reply.

use std::sync::Arc;

use axum::{
    extract::{FromRef, Path, Request, State},
    http::{header, HeaderMap},
    response::Response,
    routing::{post, MethodRouter},
};
use leasehold_core::headers;

use super::{read_body, reply, session_key, BadRequest};
use crate::turn::{router::TurnRouter, Door, Kind, Turn};

/// What a listener needs to take turns.
#[derive(Debug, Clone)]
pub struct Turns {
    pub router: Arc<TurnRouter>,
    /// Largest accepted body (`413` above).
    pub max_body: usize,
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

/// The turn id the caller gave (any attempt of a turn carries the same), else a new one.
fn turn_id(headers: &HeaderMap) -> String {
    headers
        .get(headers::TURN_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|id| uuid::Uuid::parse_str(id).is_ok())
        .map_or_else(|| uuid::Uuid::new_v4().to_string(), str::to_owned)
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
        let id = turn_id(&parts.headers);
        let content_type = parts.headers.get(header::CONTENT_TYPE).cloned();
        let turn = Turn { kind, key, id, content_type, body };
        Ok(reply::reply(self.router.route(turn, door).await))
    }
}
