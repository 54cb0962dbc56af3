//! Forwarding a turn to the session's owner over its peer port: one hop, authenticated.

pub mod auth;

use std::time::Duration;

pub use self::auth::{AuthError, PeerAuth};
use crate::{
    dispatch::Turn,
    key::SessionKey,
    observe::EventId,
    upstream::{self, Upstream},
};

/// Pod-network connect: a peer that does not accept within this is treated as down.
const PEER_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Longest a forwarded turn may take to start answering; long agent turns are normal,
/// and a timeout here is surfaced as `owner_failed` (the turn may still be running).
const PEER_RESPONSE_TIMEOUT: Duration = Duration::from_secs(300);
/// A connection to a peer unused this long is not reused: half the peer's own idle close
/// (`http::server::IDLE_TIMEOUT`), so no turn is sent into a connection being closed.
const PEER_POOL_IDLE: Duration = Duration::from_secs(crate::http::server::IDLE_TIMEOUT.as_secs() / 2);

/// The path a turn takes on the owner's peer listener.
pub fn peer_path(turn: &Turn) -> String {
    format!("/peer/v1/sessions/{}/{}", turn.key, turn.kind.segment())
}

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// Refused or unreachable before the request was sent: the turn did not run there.
    #[error("owner at {addr} is not reachable")]
    NotConnected {
        addr: String,
        #[source]
        source: upstream::Error,
    },
    /// Timed out or failed after sending: the turn may be running there.
    #[error("forward to owner at {addr} failed")]
    Failed {
        addr: String,
        #[source]
        source: upstream::Error,
    },
}

#[derive(Debug)]
pub struct Forwarder {
    client: Upstream,
    /// For long-lived upstream event streams: no total timeout.
    streams: reqwest::Client,
    auth: PeerAuth,
}

impl Forwarder {
    pub fn new(secret: Option<&str>) -> Self {
        let client = Upstream::new(PEER_CONNECT_TIMEOUT, Some(PEER_RESPONSE_TIMEOUT), PEER_POOL_IDLE);
        let streams = reqwest::Client::builder()
            .connect_timeout(PEER_CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .tcp_keepalive(upstream::KEEPALIVE_IDLE)
            .tcp_keepalive_interval(upstream::KEEPALIVE_INTERVAL)
            .tcp_keepalive_retries(upstream::KEEPALIVE_RETRIES)
            .tcp_user_timeout(upstream::USER_TIMEOUT)
            .build()
            .expect("static client configuration");
        Forwarder { client, streams, auth: PeerAuth::new(secret) }
    }

    pub fn auth(&self) -> &PeerAuth {
        &self.auth
    }

    /// Open the owner's event stream for `key`, after `after` when given.
    pub async fn subscribe(
        &self,
        addr: &str,
        key: &SessionKey,
        after: Option<EventId>,
    ) -> reqwest::Result<reqwest::Response> {
        let mut path = format!("/peer/v1/sessions/{key}/stream");
        if let Some(after) = after {
            path.push_str(&format!("?after={after}"));
        }
        let mut req = self.streams.get(format!("http://{addr}{path}"));
        for (name, value) in self.auth.sign("GET", &path, b"") {
            req = req.header(name, value);
        }
        req.send().await
    }

    pub async fn forward(&self, addr: &str, turn: &Turn) -> Result<upstream::Response, ForwardError> {
        let path = peer_path(turn);
        let proof = self.auth.sign("POST", &path, &turn.body);
        let headers = turn.headers().chain(proof);
        self.client.post(&format!("http://{addr}{path}"), headers, turn.body.clone()).await.map_err(
            |source| {
                let addr = addr.to_owned();
                if source.is_connect() {
                    ForwardError::NotConnected { addr, source }
                } else {
                    ForwardError::Failed { addr, source }
                }
            },
        )
    }
}
