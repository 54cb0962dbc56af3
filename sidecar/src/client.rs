//! A small client of the public API that honours retry directives (CONTRACT §3): on a
//! `503` with a directive it re-sends after `delay_ms` and gives up after `budget_ms`. A
//! node that refuses the connection never saw the request, so the next node is tried, as
//! a load balancer would. Every turn carries an `Idempotency-Key` (the same on every
//! attempt), so an answer lost on the way (`502 owner_failed`, a connection broken after
//! sending) is safely asked for again, a few times ([`RESENDS`]): the journal runs the
//! turn once and answers every attempt with the one answer.

use std::{
    sync::atomic::{AtomicUsize, Ordering},
    time::Duration,
};

use bytes::Bytes;
pub use leasehold_core::directive::Answer;
use leasehold_core::{
    directive::{directive_in, Obeying, RefusalBody},
    headers,
};

/// A request that cannot even connect within this is treated as a node that is down.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Generous bound on one attempt: long turns are normal; a hung one is surfaced.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// Re-sends of a turn whose answer was lost: enough for an owner's failure and the next
/// owner's resume; a fault that outlasts them is surfaced.
pub const RESENDS: u32 = 3;
/// Pause before a re-send (no directive says how long): about one resume's claim.
const RESEND_PAUSE: Duration = Duration::from_millis(200);
/// How a re-send is listed among an answer's directives.
pub const RESENT: &str = "resent";

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The directives' budget ran out; the last refusal is returned.
    #[error("gave up after the retry budget: last refusal {}", .0.error)]
    GaveUp(RefusalBody, Vec<String>),
    /// No node accepted the connection.
    #[error("no node reachable")]
    Unreachable(#[source] reqwest::Error),
    /// A failure with no directive (e.g. the connection broke mid-answer).
    #[error("request failed")]
    Http(#[source] reqwest::Error),
}

/// Round-robin over a list of node base URLs (`http://127.0.0.2:8080`).
#[derive(Debug)]
pub struct Client {
    http: reqwest::Client,
    nodes: Vec<String>,
    next: AtomicUsize,
    resends: u32,
}

impl Client {
    pub fn new(nodes: Vec<String>) -> Self {
        assert!(!nodes.is_empty(), "a client needs at least one node");
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .build()
            .expect("static client configuration");
        Client { http, nodes, next: AtomicUsize::new(0), resends: RESENDS }
    }

    /// Surface a lost answer (`502 owner_failed`, a broken connection) at once instead of
    /// re-sending: for tests of those answers themselves.
    pub fn without_resends(mut self) -> Self {
        self.resends = 0;
        self
    }

    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// POST a turn for `key` (JSON body), to the next node in turn.
    pub async fn turn(&self, key: &str, body: &serde_json::Value) -> Result<Answer, ClientError> {
        self.post(&format!("/v1/sessions/{key}/turns"), body.to_string().into(), None).await
    }

    /// POST an event for `key`.
    pub async fn event(&self, key: &str, body: &serde_json::Value) -> Result<Answer, ClientError> {
        self.post(&format!("/v1/sessions/{key}/events"), body.to_string().into(), None).await
    }

    /// POST to `path`, starting at node `first` (or round-robin when `None`).
    pub async fn post(&self, path: &str, body: Bytes, first: Option<usize>) -> Result<Answer, ClientError> {
        self.post_keyed(path, body, first, None).await
    }

    /// [`Client::post`] with the caller's idempotency key (else a new one per call): a
    /// caller that lost this client's answer may send the same turn again safely.
    pub async fn post_keyed(
        &self,
        path: &str,
        body: Bytes,
        first: Option<usize>,
        key: Option<&str>,
    ) -> Result<Answer, ClientError> {
        let mut obeying = Obeying::default();
        let mut not_reached = Vec::new();
        let mut node = first.unwrap_or_else(|| self.next.fetch_add(1, Ordering::Relaxed)) % self.nodes.len();
        let mut refused_connections = 0;
        let mut resends_left = self.resends;
        // One id for every attempt, sent as the idempotency key: however often it is sent,
        // the turn runs once.
        let turn_id = key.map_or_else(|| uuid::Uuid::new_v4().to_string(), str::to_owned);
        loop {
            let url = format!("{}{path}", self.nodes[node]);
            let sent = self
                .http
                .post(url)
                .header("content-type", "application/json")
                .header(headers::TURN_ID, &turn_id)
                .header(headers::IDEMPOTENCY_KEY, &turn_id)
                .body(body.clone())
                .send()
                .await;
            let response = match sent {
                Ok(response) => response,
                Err(e) if e.is_connect() && refused_connections + 1 < self.nodes.len() => {
                    not_reached.push((self.nodes[node].clone(), e.to_string()));
                    refused_connections += 1;
                    node = (node + 1) % self.nodes.len();
                    continue;
                }
                Err(e) if e.is_connect() => return Err(ClientError::Unreachable(e)),
                Err(_) if resends_left > 0 => {
                    resends_left -= 1;
                    obeying.directives.push(RESENT.to_owned());
                    tokio::time::sleep(RESEND_PAUSE).await;
                    node = self.next.fetch_add(1, Ordering::Relaxed) % self.nodes.len();
                    continue;
                }
                Err(e) => return Err(ClientError::Http(e)),
            };
            refused_connections = 0;
            let status = response.status().as_u16();
            let header = |name| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
            let (owner, epoch) =
                (header(headers::OWNER), header(headers::EPOCH).and_then(|e| e.parse().ok()));
            let body = match response.bytes().await {
                Ok(body) => body,
                Err(_) if resends_left > 0 => {
                    resends_left -= 1;
                    obeying.directives.push(RESENT.to_owned());
                    tokio::time::sleep(RESEND_PAUSE).await;
                    continue;
                }
                Err(e) => return Err(ClientError::Http(e)),
            };
            if status == 502 && resends_left > 0 && is_owner_failed(&body) {
                resends_left -= 1;
                obeying.directives.push(RESENT.to_owned());
                tokio::time::sleep(RESEND_PAUSE).await;
                node = self.next.fetch_add(1, Ordering::Relaxed) % self.nodes.len();
                continue;
            }
            let Some(refusal) = directive_in(status, &body) else {
                let (directives, answered_by) = (obeying.directives, self.nodes[node].clone());
                return Ok(Answer { status, owner, epoch, body, directives, answered_by, not_reached });
            };
            match obeying.obey(refusal) {
                Ok(delay) => tokio::time::sleep(delay).await,
                Err(last) => return Err(ClientError::GaveUp(last, obeying.directives)),
            }
            node = self.next.fetch_add(1, Ordering::Relaxed) % self.nodes.len();
        }
    }

    /// GET `/v1/sessions/{key}` from node `node`.
    pub async fn session(&self, key: &str, node: usize) -> Result<serde_json::Value, ClientError> {
        let url = format!("{}/v1/sessions/{key}", self.nodes[node % self.nodes.len()]);
        let response = self.http.get(url).send().await.map_err(ClientError::Http)?;
        response.json().await.map_err(ClientError::Http)
    }
}

/// `{"error":"owner_failed"}`: the turn may have run, its answer was lost.
fn is_owner_failed(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body).is_ok_and(|v| v["error"] == "owner_failed")
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use axum::{http::HeaderMap, routing::post, Router};

    use super::*;

    /// Answers the first request `first` (status and body), every later one `200`;
    /// records the value of `header` on each.
    async fn first_answer(
        first: (axum::http::StatusCode, &'static str),
        header: http::HeaderName,
    ) -> (String, Arc<Mutex<Vec<String>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let app = Router::new().route(
            "/v1/sessions/{key}/turns",
            post(move |headers: HeaderMap| {
                let (log, header) = (log.clone(), header.clone());
                async move {
                    let value = headers.get(&header).map(|v| v.to_str().unwrap().to_owned());
                    let mut log = log.lock().unwrap();
                    log.push(value.unwrap_or_default());
                    match log.len() {
                        1 => first,
                        _ => (axum::http::StatusCode::OK, "{}"),
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (url, seen)
    }

    async fn refuse_once() -> (String, Arc<Mutex<Vec<String>>>) {
        let draining = r#"{"error":"draining","retry":{"delay_ms":1,"budget_ms":5000}}"#;
        first_answer((axum::http::StatusCode::SERVICE_UNAVAILABLE, draining), headers::TURN_ID).await
    }

    async fn fail_once() -> (String, Arc<Mutex<Vec<String>>>) {
        let failed = r#"{"error":"owner_failed"}"#;
        first_answer((axum::http::StatusCode::BAD_GATEWAY, failed), headers::IDEMPOTENCY_KEY).await
    }

    #[tokio::test]
    async fn a_lost_answer_is_asked_for_again_with_the_same_key() {
        let (url, seen) = fail_once().await;
        let answer = Client::new(vec![url.clone()]).turn("k", &serde_json::json!({})).await.unwrap();
        assert_eq!((answer.status, answer.directives.clone()), (200, vec![RESENT.to_owned()]));
        let keys = seen.lock().unwrap().clone();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0], keys[1], "the re-send carries the first attempt's key");
        assert!(!keys[0].is_empty());

        let (url, _) = fail_once().await;
        let raw = Client::new(vec![url]).without_resends().turn("k", &serde_json::json!({})).await.unwrap();
        assert_eq!(raw.status, 502, "surfaced when re-sends are off");
    }

    #[tokio::test]
    async fn a_retried_turn_keeps_its_turn_id() {
        let (url, seen) = refuse_once().await;
        let answer = Client::new(vec![url]).turn("k", &serde_json::json!({})).await.unwrap();
        assert_eq!((answer.status, answer.directives.clone()), (200, vec!["draining".to_owned()]));
        let ids = seen.lock().unwrap().clone();
        assert_eq!(ids.len(), 2);
        assert_eq!(ids[0], ids[1], "the retry carries the first attempt's id");
        assert!(uuid::Uuid::parse_str(&ids[0]).is_ok(), "{ids:?}");
    }

    /// A stand-in server that reads the first request in full and then drops the
    /// connection without a word (as an owner killed mid-turn); it answers every later
    /// request `200 {}`. Records each request's `Idempotency-Key`.
    async fn reset_once() -> (String, Arc<Mutex<Vec<String>>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                // The head, then the body its Content-Length announces.
                let mut request = Vec::new();
                let mut chunk = [0u8; 4096];
                let head_end = loop {
                    let n = socket.read(&mut chunk).await.unwrap();
                    assert!(n > 0, "the client closed before sending its request");
                    request.extend_from_slice(&chunk[..n]);
                    if let Some(at) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                        break at + 4;
                    }
                };
                let head = String::from_utf8_lossy(&request[..head_end]).to_lowercase();
                let header = |name: &str| {
                    head.lines()
                        .find_map(|line| line.strip_prefix(name).map(|v| v.trim().to_owned()))
                        .unwrap_or_default()
                };
                let length: usize = header("content-length:").parse().unwrap_or(0);
                while request.len() < head_end + length {
                    let n = socket.read(&mut chunk).await.unwrap();
                    assert!(n > 0, "the client closed mid-body");
                    request.extend_from_slice(&chunk[..n]);
                }
                let first = {
                    let mut log = log.lock().unwrap();
                    log.push(header("idempotency-key:"));
                    log.len() == 1
                };
                if first {
                    drop(socket); // read, never answered
                    continue;
                }
                let ok = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}";
                socket.write_all(ok.as_bytes()).await.unwrap();
                socket.shutdown().await.unwrap();
            }
        });
        (url, seen)
    }

    #[tokio::test]
    async fn a_connection_reset_after_sending_is_resent_with_the_same_key() {
        let (url, seen) = reset_once().await;
        let client = Client::new(vec![url]);
        let answer = client
            .post_keyed("/v1/sessions/k/turns", Bytes::from_static(b"{}"), None, Some("order-9"))
            .await
            .unwrap();
        assert_eq!((answer.status, answer.directives.clone()), (200, vec![RESENT.to_owned()]));
        assert_eq!(&answer.body[..], b"{}");
        let keys = seen.lock().unwrap().clone();
        assert_eq!(keys, ["order-9", "order-9"], "the re-send carries the caller's key");

        let (url, seen) = reset_once().await;
        let once = Client::new(vec![url]).without_resends();
        let raw =
            once.post_keyed("/v1/sessions/k/turns", Bytes::from_static(b"{}"), None, Some("order-9")).await;
        assert!(matches!(raw, Err(ClientError::Http(_))), "surfaced when re-sends are off: {raw:?}");
        assert_eq!(seen.lock().unwrap().len(), 1);
    }
}
