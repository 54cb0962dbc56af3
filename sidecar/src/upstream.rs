//! The HTTP/1 client of the hot paths, a turn to the owner's peer port and a turn to the
//! agent: hyper's pooled client, without reqwest's per-request URL parsing and layers
//! (they showed in profiles of the forwarding hop).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::{TokioExecutor, TokioTimer},
};

/// An answer whose body is still arriving.
pub type Response = http::Response<hyper::body::Incoming>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error(transparent)]
    Http(#[from] hyper_util::client::legacy::Error),
    #[error("invalid request")]
    Request(#[from] http::Error),
    #[error("answered {0}")]
    Status(http::StatusCode),
}

impl Error {
    /// The connection could not be made: the request was never sent.
    pub fn is_connect(&self) -> bool {
        matches!(self, Error::Http(e) if e.is_connect())
    }
}

#[derive(Debug, Clone)]
pub struct Upstream {
    client: Client<HttpConnector, Full<Bytes>>,
    /// Longest wait for the answer's head; `None` waits as long as it takes.
    response_timeout: Option<Duration>,
}

impl Upstream {
    pub fn new(connect_timeout: Duration, response_timeout: Option<Duration>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        let client = Client::builder(TokioExecutor::new()).pool_timer(TokioTimer::new()).build(connector);
        Upstream { client, response_timeout }
    }

    /// `POST uri` with `headers` and `body` (sent with its length).
    pub async fn post(
        &self,
        uri: &str,
        headers: impl IntoIterator<Item = (http::HeaderName, http::HeaderValue)>,
        body: Bytes,
    ) -> Result<Response, Error> {
        let mut request = http::Request::post(uri).body(Full::new(body))?;
        request.headers_mut().extend(headers);
        let sent = self.client.request(request);
        match self.response_timeout {
            Some(limit) => tokio::time::timeout(limit, sent).await.map_err(|_| Error::Timeout(limit))?,
            None => sent.await,
        }
        .map_err(Error::Http)
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpListener,
    };

    use super::*;

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
        let upstream = Upstream::new(Duration::from_secs(1), Some(Duration::from_secs(5)));
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

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let upstream = Upstream::new(Duration::from_secs(1), None);
        let err = upstream.post(&format!("http://{addr}/"), [], Bytes::new()).await.unwrap_err();
        assert!(err.is_connect(), "{err:?}");
    }

    #[tokio::test]
    async fn a_silent_peer_times_out_and_is_not_a_connect_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let upstream = Upstream::new(Duration::from_secs(1), Some(Duration::from_millis(100)));
        let err = upstream.post(&format!("http://{addr}/"), [], Bytes::new()).await.unwrap_err();
        assert!(matches!(err, Error::Timeout(_)) && !err.is_connect(), "{err:?}");
        drop(listener);
    }
}
