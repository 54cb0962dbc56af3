//! The client of the local agent container: dispatch a turn, tell it to stand a session
//! down, notice when it is down.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use bytes::Bytes;
use http::HeaderValue;
use leasehold_core::{headers, Epoch, SessionKey};
use tracing::Instrument;

use super::Turn;
use crate::upstream::{self, Upstream};

/// The agent is on loopback: a connection that takes longer than this is not coming.
const AGENT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// A connection to the agent unused this long is not reused: agents' servers close idle
/// keep-alive connections early (gunicorn after 2 s, uvicorn and Node after 5 s) and a
/// turn sent into that close would be lost; a new loopback connection is cheap next to a turn.
const AGENT_POOL_IDLE: Duration = Duration::from_secs(1);
/// A stand-down or cancel is a notification; an agent that cannot take it in this time
/// is stuck, and the fence protects the data anyway.
const STAND_DOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Client of the agent container.
#[derive(Debug, Clone)]
pub struct AgentClient {
    client: Upstream,
    base: String,
    /// Set when a dispatch could not connect (the agent crashed or is restarting),
    /// cleared when one connects again.
    down: Arc<AtomicBool>,
}

impl AgentClient {
    pub fn new(base: &str) -> Self {
        // A turn runs as long as the agent needs: no response timeout.
        let client = Upstream::new(AGENT_CONNECT_TIMEOUT, None, AGENT_POOL_IDLE);
        AgentClient { client, base: base.trim_end_matches('/').to_owned(), down: Arc::default() }
    }

    /// Dispatch a turn at `epoch` (`resume`: re-dispatched after an earlier owner lost it
    /// mid-turn). The caller reads the answer.
    pub async fn dispatch(
        &self,
        turn: &Turn,
        epoch: Epoch,
        resume: bool,
    ) -> Result<upstream::Response, upstream::Error> {
        let url = format!("{}/sessions/{}/{}", self.base, turn.key, turn.kind.segment());
        let span = tracing::info_span!("agent", session = %turn.key, epoch = epoch.0, resume);
        let epoch = (headers::EPOCH, HeaderValue::from(epoch.0));
        let resume = resume
            .then(|| (headers::RESUME, HeaderValue::try_from(turn.id.as_str()).expect("visible ASCII")));
        let mut headers: http::HeaderMap = turn.headers().chain([epoch]).chain(resume).collect();
        let sent = async {
            // The agent's parent is this span: its context replaces the client's.
            crate::telemetry::propagate(&mut headers);
            let headers = headers.iter().map(|(name, value)| (name.clone(), value.clone()));
            self.client.post(&url, headers, turn.body.clone()).await
        }
        .instrument(span)
        .await;
        self.down.store(sent.as_ref().is_err_and(upstream::Error::is_connect), Ordering::Relaxed);
        sent
    }

    /// Whether the agent refused the last connection and still does (one loopback
    /// connect, made only while it is known down).
    pub async fn is_down(&self) -> bool {
        if !self.down.load(Ordering::Relaxed) {
            return false;
        }
        // A base that is not `http://host:port` fails every dispatch the same way.
        let Ok((authority, _)) = upstream::split(&self.base) else { return true };
        let connect = tokio::net::TcpStream::connect(authority);
        let up = tokio::time::timeout(AGENT_CONNECT_TIMEOUT, connect).await.is_ok_and(|c| c.is_ok());
        if up {
            self.down.store(false, Ordering::Relaxed);
        }
        !up
    }

    /// Tell the agent to halt and drop a session it no longer owns.
    pub async fn stand_down(&self, key: &SessionKey) -> Result<(), upstream::Error> {
        self.notify(format!("{}/sessions/{key}/stand-down", self.base)).await
    }

    /// Tell the agent a turn was cancelled (a newer one interrupted it, or `DELETE`).
    pub async fn cancel(&self, key: &SessionKey, turn_id: &str) -> Result<(), upstream::Error> {
        let turn = super::path_segment(turn_id);
        self.notify(format!("{}/sessions/{key}/turns/{turn}/cancel", self.base)).await
    }

    /// A notification: an empty POST, answered 2xx within [`STAND_DOWN_TIMEOUT`].
    async fn notify(&self, url: String) -> Result<(), upstream::Error> {
        let sent = self.client.post(&url, [], Bytes::new());
        let response = tokio::time::timeout(STAND_DOWN_TIMEOUT, sent)
            .await
            .map_err(|_| upstream::Error::Timeout(STAND_DOWN_TIMEOUT))??;
        match response.status() {
            status if status.is_success() => Ok(()),
            status => Err(upstream::Error::Status(status)),
        }
    }
}
