//! Forwarding a turn to the session's owner over its peer port: one hop, authenticated.

use std::{sync::Arc, time::Duration};

use leasehold_core::{
    lifecycle::IDLE_CONNECTION,
    proof::{PeerAuth, Signed},
    store::Holder,
    EventId, SessionKey,
};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::upstream::{self, Upstream};

/// Pod-network connect: a peer that does not accept within this is treated as down.
const PEER_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Longest a forwarded turn may take to start answering; long agent turns are normal,
/// and a timeout here is surfaced as `owner_failed` (the turn may still be running).
const PEER_RESPONSE_TIMEOUT: Duration = Duration::from_secs(300);
/// A connection to a peer unused this long is not reused: half the peer's own idle close,
/// so no turn is sent into a connection being closed.
const PEER_POOL_IDLE: Duration = Duration::from_secs(IDLE_CONNECTION.as_secs() / 2);

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
    auth: Arc<PeerAuth>,
    /// Every forwarded turn's proof covers these (present or not): the client headers a
    /// turn may carry, so none is added or altered on the way.
    covered: Arc<[HeaderName]>,
}

impl Forwarder {
    /// `auth` signs every request (the same proof the peer listener checks), covering
    /// `covered` on every forwarded turn.
    pub fn new(auth: Arc<PeerAuth>, covered: &[HeaderName]) -> Self {
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
        Forwarder { client, streams, auth, covered: covered.into() }
    }

    /// Open `owner`'s event stream for `key`, after `after` when given.
    pub async fn subscribe(
        &self,
        owner: &Holder,
        key: &SessionKey,
        after: Option<EventId>,
    ) -> reqwest::Result<reqwest::Response> {
        let mut path = format!("/peer/v1/sessions/{key}/stream");
        if let Some(after) = after {
            path.push_str(&format!("?after={after}"));
        }
        let url = format!("http://{}{path}", owner.peer_addr);
        let none = HeaderMap::new();
        let signed = Signed {
            method: "GET",
            path: &path,
            destination: owner.owner.node_id(),
            headers: &none,
            body: b"",
        };
        let send = |proof: Vec<(HeaderName, HeaderValue)>| {
            proof
                .into_iter()
                .fold(self.streams.get(&url), |req, (name, value)| req.header(name, value))
                .send()
        };
        let response = send(self.auth.sign(&signed, &[])).await?;
        if refused_proof(response.status(), response.headers()) {
            if let Some(proof) = self.auth.sign_previous(&signed, &[]) {
                return send(proof).await;
            }
        }
        Ok(response)
    }

    /// POST `body` to `path` on `owner`'s peer listener, with `headers`, signed with the
    /// peer proof for that node.
    pub async fn forward(
        &self,
        owner: &Holder,
        path: &str,
        headers: impl IntoIterator<Item = (HeaderName, HeaderValue)>,
        body: Bytes,
    ) -> Result<upstream::Response, ForwardError> {
        let mut headers: HeaderMap = headers.into_iter().collect();
        // The forward span's context replaces the client's, before the proof covers it.
        crate::telemetry::propagate(&mut headers);
        let signed = Signed {
            method: "POST",
            path,
            destination: owner.owner.node_id(),
            headers: &headers,
            body: &body,
        };
        let addr = &owner.peer_addr;
        let url = format!("http://{addr}{path}");
        let send = |proof: Vec<(HeaderName, HeaderValue)>, body: Bytes| {
            let headers = headers.iter().map(|(name, value)| (name.clone(), value.clone())).chain(proof);
            self.client.post(&url, headers, body)
        };
        let failed = |source: upstream::Error| {
            let addr = addr.to_owned();
            if source.is_connect() {
                ForwardError::NotConnected { addr, source }
            } else {
                ForwardError::Failed { addr, source }
            }
        };
        let response = send(self.auth.sign(&signed, &self.covered), body.clone()).await.map_err(failed)?;
        if refused_proof(response.status(), response.headers()) {
            if let Some(proof) = self.auth.sign_previous(&signed, &self.covered) {
                // The peer refused the proof before running anything: safe to send again.
                return send(proof, body).await.map_err(failed);
            }
        }
        Ok(response)
    }
}

/// The peer's proof check refused the request (a sidecar's `401`, not an agent's): during
/// a rotation it may know only the previous secret.
fn refused_proof(status: http::StatusCode, headers: &HeaderMap) -> bool {
    status == http::StatusCode::UNAUTHORIZED && headers.contains_key(leasehold_core::headers::REFUSAL)
}
