//! The HTTP/1 client of the hot paths, a turn to the owner's peer port and a turn to the
//! agent: hyper's connection API under a small keep-alive pool of our own. A pooled
//! request costs one lock, no URI parsing and no spawned task (hyper-util's legacy
//! client and reqwest each showed in profiles of the forwarding hop).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{header::HOST, HeaderValue};
use http_body_util::Full;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// An answer whose body is still arriving.
pub type Response = http::Response<hyper::body::Incoming>;

type Sender = SendRequest<Full<Bytes>>;

/// A peer that goes silent (partitioned, or its node gone without a reset) must not hold
/// a forwarded turn or a followed stream until the kernel's ~15 minutes of retransmits:
/// keep-alive probes start after this much silence on a connection...
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
/// ...are sent this often...
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
/// ...and this many unanswered ones close the connection.
pub const KEEPALIVE_RETRIES: u32 = 3;
/// Data sent but unacknowledged for this long closes the connection (a request stuck in
/// a partition); a long turn with nothing in flight is not affected.
pub const USER_TIMEOUT: Duration = Duration::from_secs(10);

/// Idle connections kept per upstream address; more concurrent turns than this open
/// connections that are closed when they finish (bounds sockets held by a quiet pod).
const MAX_IDLE_PER_UPSTREAM: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: String, reason: String },
    #[error(transparent)]
    Http(#[from] hyper::Error),
    #[error("invalid request: {0}")]
    Request(String),
    #[error("answered {0}")]
    Status(http::StatusCode),
}

impl Error {
    /// The connection could not be made: the request was never sent.
    pub fn is_connect(&self) -> bool {
        matches!(self, Error::Connect { .. })
    }
}

#[derive(Debug, Clone)]
pub struct Upstream {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Connections by `host:port` with when each was put back; each may still be
    /// reading an earlier answer.
    idle: Mutex<HashMap<String, Vec<(Sender, Instant)>>>,
    connect_timeout: Duration,
    /// A connection unused for this long is not reused: below the upstream's own idle
    /// close, so a request is never sent into a connection the upstream is closing.
    pool_idle: Duration,
    /// Longest wait for the answer's head; `None` waits as long as it takes.
    response_timeout: Option<Duration>,
}

/// `http://host:port/path` → (`host:port`, `/path`).
pub(crate) fn split(uri: &str) -> Result<(&str, &str), Error> {
    let rest = uri.strip_prefix("http://").ok_or_else(|| Error::Request(format!("{uri}: not http://")))?;
    let (authority, path) = rest.find('/').map_or((rest, "/"), |i| rest.split_at(i));
    if authority.is_empty() {
        return Err(Error::Request(format!("{uri}: no host")));
    }
    Ok((authority, path))
}

impl Upstream {
    pub fn new(connect_timeout: Duration, response_timeout: Option<Duration>, pool_idle: Duration) -> Self {
        let inner = Inner { idle: Mutex::default(), connect_timeout, pool_idle, response_timeout };
        Upstream { inner: Arc::new(inner) }
    }

    /// `POST uri` (`http://host:port/path`) with `headers` and `body` (sent with its length).
    pub async fn post(
        &self,
        uri: &str,
        headers: impl IntoIterator<Item = (http::HeaderName, http::HeaderValue)>,
        body: Bytes,
    ) -> Result<Response, Error> {
        let (authority, path) = split(uri)?;
        let host = HeaderValue::try_from(authority).map_err(|e| Error::Request(format!("{uri}: {e}")))?;
        let mut request = http::Request::post(path)
            .header(HOST, host)
            .body(Full::new(body))
            .map_err(|e| Error::Request(format!("{uri}: {e}")))?;
        request.headers_mut().extend(headers);
        let sent = self.send(authority, request);
        match self.inner.response_timeout {
            Some(limit) => tokio::time::timeout(limit, sent).await.map_err(|_| Error::Timeout(limit))?,
            None => sent.await,
        }
    }

    async fn send(&self, authority: &str, request: http::Request<Full<Bytes>>) -> Result<Response, Error> {
        let mut request = request;
        // A pooled connection the upstream closed meanwhile hands the request back unsent:
        // it goes on a fresh connection instead (never twice on the wire).
        while let Some(mut sender) = self.checkout(authority) {
            match sender.try_send_request(request).await {
                Ok(response) => {
                    self.checkin(authority, sender);
                    return Ok(response);
                }
                Err(mut e) => match e.take_message() {
                    Some(unsent) => request = unsent,
                    None => return Err(Error::Http(e.into_error())),
                },
            }
        }
        let mut sender = self.connect(authority).await?;
        match sender.try_send_request(request).await {
            Ok(response) => {
                self.checkin(authority, sender);
                Ok(response)
            }
            Err(mut e) => match e.take_message() {
                // Closed before a byte of the request went out: as good as never connected.
                Some(_unsent) => Err(Error::Connect {
                    addr: authority.to_owned(),
                    reason: format!("closed before the request was sent: {}", e.into_error()),
                }),
                None => Err(Error::Http(e.into_error())),
            },
        }
    }

    /// An idle connection to `authority` ready for a request; closed ones, and ones
    /// unused for the pool's idle bound, are dropped.
    fn checkout(&self, authority: &str) -> Option<Sender> {
        let mut idle = self.inner.idle.lock().expect("upstream pool lock");
        let conns = idle.get_mut(authority)?;
        let now = Instant::now();
        conns.retain(|(c, since)| !c.is_closed() && now.duration_since(*since) < self.inner.pool_idle);
        if conns.is_empty() {
            idle.remove(authority); // an upstream that went away leaves nothing behind
            return None;
        }
        let ready = conns.iter().rposition(|(c, _)| c.is_ready())?;
        Some(conns.swap_remove(ready).0)
    }

    /// Back into the pool: ready again once its answer has been read.
    fn checkin(&self, authority: &str, sender: Sender) {
        let since = Instant::now();
        let mut idle = self.inner.idle.lock().expect("upstream pool lock");
        match idle.get_mut(authority) {
            Some(conns) if conns.len() >= MAX_IDLE_PER_UPSTREAM => {}
            Some(conns) => conns.push((sender, since)),
            None => {
                idle.insert(authority.to_owned(), vec![(sender, since)]);
            }
        }
    }

    async fn connect(&self, authority: &str) -> Result<Sender, Error> {
        let failed = |reason: String| Error::Connect { addr: authority.to_owned(), reason };
        let limit = self.inner.connect_timeout;
        let stream = tokio::time::timeout(limit, TcpStream::connect(authority))
            .await
            .map_err(|_| failed(format!("no connection within {limit:?}")))?
            .map_err(|e| failed(e.to_string()))?;
        stream.set_nodelay(true).map_err(|e| failed(e.to_string()))?;
        notice_silence(&stream).map_err(|e| failed(e.to_string()))?;
        let (sender, conn) =
            http1::handshake(TokioIo::new(stream)).await.map_err(|e| failed(e.to_string()))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "upstream connection ended with an error");
            }
        });
        Ok(sender)
    }
}

/// Keep-alive probes and a user timeout: a silent peer ends the connection with an error
/// within about [`KEEPALIVE_IDLE`] + [`USER_TIMEOUT`].
fn notice_silence(stream: &TcpStream) -> std::io::Result<()> {
    let socket = socket2::SockRef::from(stream);
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_RETRIES);
    socket.set_tcp_keepalive(&keepalive)?;
    socket.set_tcp_user_timeout(Some(USER_TIMEOUT))
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpListener,
    };

    use super::*;

    /// Longer than any test here runs: pooled connections stay reusable.
    const POOL_IDLE: Duration = Duration::from_secs(60);

    #[tokio::test]
    async fn a_connection_is_set_to_notice_a_silent_peer() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        notice_silence(&stream).unwrap();
        let socket = socket2::SockRef::from(&stream);
        assert!(socket.keepalive().unwrap());
        assert_eq!(socket.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
        assert_eq!(socket.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
        assert_eq!(socket.tcp_keepalive_retries().unwrap(), KEEPALIVE_RETRIES);
        assert_eq!(socket.tcp_user_timeout().unwrap(), Some(USER_TIMEOUT));
    }

    /// A one-shot HTTP/1 server on loopback: returns its address and the request it read.
    async fn answer_once(reply: &'static [u8]) -> (String, tokio::task::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let task = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = vec![0; 4096];
            let n = socket.read(&mut buf).await.unwrap();
            socket.write_all(reply).await.unwrap();
            String::from_utf8_lossy(&buf[..n]).into_owned()
        });
        (addr, task)
    }

    #[tokio::test]
    async fn posts_with_headers_and_length_and_reads_the_answer() {
        let (addr, server) = answer_once(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
        let upstream = Upstream::new(Duration::from_secs(1), Some(Duration::from_secs(5)), POOL_IDLE);
        let headers = [(http::HeaderName::from_static("x-probe"), http::HeaderValue::from_static("1"))];
        let response =
            upstream.post(&format!("http://{addr}/p"), headers, Bytes::from_static(b"body")).await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.into_body().collect().await.unwrap().to_bytes(), "ok");
        let request = server.await.unwrap().to_ascii_lowercase();
        assert!(request.starts_with("post /p http/1.1"), "{request}");
        assert!(request.contains("x-probe: 1") && request.contains("content-length: 4"), "{request}");
        assert!(request.ends_with("body"), "{request}");
    }

    /// Accepts connections on loopback and answers every request on them with `ok`,
    /// closing each connection after `per_conn` answers; counts the connections.
    async fn keep_alive_server(per_conn: usize) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        use std::sync::atomic::Ordering;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = vec![0; 4096];
                    for _ in 0..per_conn {
                        match socket.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) => {}
                        }
                        let reply: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if socket.write_all(reply).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    #[tokio::test]
    async fn sequential_requests_share_one_connection() {
        let (addr, accepted) = keep_alive_server(usize::MAX).await;
        let upstream = Upstream::new(Duration::from_secs(1), Some(Duration::from_secs(5)), POOL_IDLE);
        for _ in 0..20 {
            let response =
                upstream.post(&format!("http://{addr}/p"), [], Bytes::from_static(b"x")).await.unwrap();
            assert_eq!(response.into_body().collect().await.unwrap().to_bytes(), "ok");
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_connection_unused_past_the_pool_idle_bound_is_not_reused() {
        let (addr, accepted) = keep_alive_server(usize::MAX).await;
        let upstream =
            Upstream::new(Duration::from_secs(1), Some(Duration::from_secs(5)), Duration::from_millis(300));
        let post = async || {
            let response = upstream.post(&format!("http://{addr}/p"), [], Bytes::new()).await.unwrap();
            assert_eq!(response.into_body().collect().await.unwrap().to_bytes(), "ok");
            accepted.load(std::sync::atomic::Ordering::SeqCst)
        };
        assert_eq!(post().await, 1);
        assert_eq!(post().await, 1, "reused within the bound");
        tokio::time::sleep(Duration::from_millis(500)).await; // the server still holds it open
        assert_eq!(post().await, 2, "a new connection after the bound");
        assert_eq!(post().await, 2, "and that one is pooled");
    }

    #[tokio::test]
    async fn a_connection_the_upstream_closed_is_replaced_without_an_error() {
        let (addr, accepted) = keep_alive_server(1).await;
        let upstream = Upstream::new(Duration::from_secs(1), Some(Duration::from_secs(5)), POOL_IDLE);
        for _ in 0..5 {
            let response =
                upstream.post(&format!("http://{addr}/p"), [], Bytes::from_static(b"x")).await.unwrap();
            assert_eq!(response.into_body().collect().await.unwrap().to_bytes(), "ok");
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 5, "one answer per connection");
    }

    #[tokio::test]
    async fn an_upstream_that_went_away_leaves_no_pool_entry() {
        let (addr, _) = keep_alive_server(1).await;
        let upstream = Upstream::new(Duration::from_secs(1), Some(Duration::from_secs(5)), POOL_IDLE);
        let response = upstream.post(&format!("http://{addr}/p"), [], Bytes::new()).await.unwrap();
        response.into_body().collect().await.unwrap();
        assert!(upstream.inner.idle.lock().unwrap().contains_key(&addr), "pooled after the answer");
        // The server closes after its one answer; the pool forgets the address.
        for _ in 0..200 {
            let gone = upstream.checkout(&addr).is_none()
                && !upstream.inner.idle.lock().unwrap().contains_key(&addr);
            if gone {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the closed connection's address is still pooled");
    }

    #[tokio::test]
    async fn concurrent_requests_each_get_a_connection_and_all_are_answered() {
        let (addr, accepted) = keep_alive_server(usize::MAX).await;
        let upstream = Upstream::new(Duration::from_secs(1), Some(Duration::from_secs(5)), POOL_IDLE);
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let (upstream, uri) = (upstream.clone(), format!("http://{addr}/p"));
                tokio::spawn(async move {
                    let response = upstream.post(&uri, [], Bytes::new()).await.unwrap();
                    response.into_body().collect().await.unwrap().to_bytes()
                })
            })
            .collect();
        for task in tasks {
            assert_eq!(task.await.unwrap(), "ok");
        }
        let opened = accepted.load(std::sync::atomic::Ordering::SeqCst);
        assert!((1..=8).contains(&opened), "{opened}");
    }

    #[test]
    fn only_plain_http_uris_are_accepted() {
        assert_eq!(split("http://10.0.0.1:8081/peer/x").unwrap(), ("10.0.0.1:8081", "/peer/x"));
        assert_eq!(split("http://[::1]:3000").unwrap(), ("[::1]:3000", "/"));
        assert!(matches!(split("https://a:1/x"), Err(Error::Request(_))));
        assert!(matches!(split("http:///x"), Err(Error::Request(_))));
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let upstream = Upstream::new(Duration::from_secs(1), None, POOL_IDLE);
        let err = upstream.post(&format!("http://{addr}/"), [], Bytes::new()).await.unwrap_err();
        assert!(err.is_connect(), "{err:?}");
    }

    #[tokio::test]
    async fn a_silent_peer_times_out_and_is_not_a_connect_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let upstream = Upstream::new(Duration::from_secs(1), Some(Duration::from_millis(100)), POOL_IDLE);
        let err = upstream.post(&format!("http://{addr}/"), [], Bytes::new()).await.unwrap_err();
        assert!(matches!(err, Error::Timeout(_)) && !err.is_connect(), "{err:?}");
        drop(listener);
    }
}
