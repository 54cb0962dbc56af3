//! Talking to pods through the API server's pod proxy only, so the suite needs nothing
//! but a kubeconfig (pod IPs are not routable from a kind host).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request};
use kube::client::Body;

/// The sidecar's ports (CONTRACT §2; operator `validate.rs`).
pub const PUBLIC_PORT: u16 = 8080;
pub const ADMIN_PORT: u16 = 9090;

/// One request through the proxy may take this long (turns are short in the suite).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// `/api/v1/namespaces/{ns}/pods/{pod}:{port}/proxy{path}`; `path` starts with `/`.
pub fn proxy_path(ns: &str, pod: &str, port: u16, path: &str) -> String {
    debug_assert!(path.starts_with('/'), "{path}");
    format!("/api/v1/namespaces/{ns}/pods/{pod}:{port}/proxy{path}")
}

/// A complete answer read through the proxy.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned)
    }

    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.body).ok()
    }

    /// The answer was written by the API server (a `kind: Status`), not by the pod.
    pub fn apiserver_status(&self) -> Option<kube::core::Status> {
        let value = self.json()?;
        if value.get("kind")?.as_str()? != "Status" {
            return None;
        }
        serde_json::from_value(value).ok()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Whether an API-server error for a proxied request means the request never reached the
/// pod's server: safe to send elsewhere, like a refused connection behind a load
/// balancer. Anything else may have reached it and is surfaced.
///
/// Besides a pod that is gone, has no address or refuses connections, this counts the
/// two ways the API server's pooled keep-alive connection to a pod can turn out to be
/// closed by the pod when the request is sent on it (`write: broken pipe` while writing
/// the request, Go's `server closed idle connection`): the sidecar's server closes only
/// idle connections when it shuts down, never one with a request it has read. The
/// scenarios check every session's history against its acknowledged turns, so a request
/// that did run would show up twice there.
pub fn never_reached(status: &kube::core::Status) -> bool {
    let message = status.message.to_ascii_lowercase();
    status.reason == "NotFound"
        || status.code == 404
        || message.contains("dial tcp")
        || message.contains("connection refused")
        || message.contains("no route to host")
        || message.contains("does not have a host assigned")
        || message.contains("no endpoints available")
        || message.contains("has no ip")
        || closed_pooled_connection(status)
}

/// The API server sent the request on a keep-alive connection the pod had closed.
pub fn closed_pooled_connection(status: &kube::core::Status) -> bool {
    let message = status.message.to_ascii_lowercase();
    message.contains("server closed idle connection") || message.contains("write: broken pipe")
}

#[derive(Debug)]
pub enum ProxyError {
    /// The API server could not be reached or the exchange broke.
    Kube(kube::Error),
    /// No answer within the request timeout.
    Timeout,
}

impl std::error::Error for ProxyError {}

impl std::fmt::Display for ProxyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProxyError::Kube(e) => write!(f, "through the API server: {e}"),
            ProxyError::Timeout => write!(f, "no answer within {REQUEST_TIMEOUT:?}"),
        }
    }
}

/// Requests to the pods of one namespace. The client must have kube's default retry
/// off (`Config::default_retry = false`): it would re-send a POST on a `503`.
#[derive(Clone)]
pub struct PodProxy {
    pub client: kube::Client,
    pub ns: String,
}

impl std::fmt::Debug for PodProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodProxy").field("ns", &self.ns).finish()
    }
}

impl PodProxy {
    pub fn new(client: kube::Client, ns: &str) -> Self {
        PodProxy { client, ns: ns.to_owned() }
    }

    fn build(
        &self,
        method: Method,
        pod: &str,
        port: u16,
        path: &str,
        body: Option<Bytes>,
        idempotency_key: Option<&str>,
    ) -> Request<Body> {
        let mut builder = Request::builder().method(method).uri(proxy_path(&self.ns, pod, port, path));
        if body.is_some() {
            builder = builder.header(http::header::CONTENT_TYPE, "application/json");
        }
        if let Some(key) = idempotency_key {
            builder = builder.header("idempotency-key", key);
        }
        builder.body(Body::from(body.unwrap_or_default())).expect("a valid request")
    }

    /// Send and read the whole answer.
    pub async fn request(
        &self,
        method: Method,
        pod: &str,
        port: u16,
        path: &str,
        body: Option<Bytes>,
    ) -> Result<Reply, ProxyError> {
        self.request_keyed(method, pod, port, path, body, None).await
    }

    /// [`Self::request`] with an `Idempotency-Key`.
    pub async fn request_keyed(
        &self,
        method: Method,
        pod: &str,
        port: u16,
        path: &str,
        body: Option<Bytes>,
        idempotency_key: Option<&str>,
    ) -> Result<Reply, ProxyError> {
        let request = self.build(method, pod, port, path, body, idempotency_key);
        let exchange = async {
            let response = self.client.send(request).await?;
            let (parts, body) = response.into_parts();
            let body = body.collect_bytes().await?;
            Ok::<_, kube::Error>(Reply { status: parts.status.as_u16(), headers: parts.headers, body })
        };
        match tokio::time::timeout(REQUEST_TIMEOUT, exchange).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => Err(ProxyError::Kube(e)),
            Err(_) => Err(ProxyError::Timeout),
        }
    }

    pub async fn post_json(
        &self,
        pod: &str,
        port: u16,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<Reply, ProxyError> {
        self.request(Method::POST, pod, port, path, Some(body.to_string().into())).await
    }

    pub async fn get(&self, pod: &str, port: u16, path: &str) -> Result<Reply, ProxyError> {
        self.request(Method::GET, pod, port, path, None).await
    }

    /// Open a streaming GET (Server-Sent Events): the response with its body unread.
    pub async fn open_stream(
        &self,
        pod: &str,
        port: u16,
        path: &str,
        headers: &[(&str, String)],
    ) -> Result<http::Response<Body>, ProxyError> {
        let mut request = self.build(Method::GET, pod, port, path, None, None);
        request.headers_mut().insert(http::header::ACCEPT, "text/event-stream".parse().expect("static"));
        for (name, value) in headers {
            let name: http::HeaderName = name.parse().expect("a valid header name");
            request.headers_mut().insert(name, value.parse().expect("a valid header value"));
        }
        match tokio::time::timeout(REQUEST_TIMEOUT, self.client.send(request)).await {
            Ok(Ok(response)) => Ok(response),
            Ok(Err(e)) => Err(ProxyError::Kube(e)),
            Err(_) => Err(ProxyError::Timeout),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16, reason: &str, message: &str) -> kube::core::Status {
        serde_json::from_value(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure",
            "code": code, "reason": reason, "message": message
        }))
        .unwrap()
    }

    #[test]
    fn the_proxy_path_names_pod_and_port() {
        assert_eq!(
            proxy_path("e2e-x", "agents-1", 8080, "/v1/sessions/k/turns"),
            "/api/v1/namespaces/e2e-x/pods/agents-1:8080/proxy/v1/sessions/k/turns"
        );
    }

    #[test]
    fn apiserver_errors_are_told_from_pod_answers() {
        let sidecar = Reply {
            status: 503,
            headers: HeaderMap::new(),
            body: Bytes::from_static(br#"{"error":"draining","retry":{"delay_ms":100,"budget_ms":10000}}"#),
        };
        assert!(sidecar.apiserver_status().is_none());
        let apiserver = Reply {
            status: 503,
            headers: HeaderMap::new(),
            body: Bytes::from(
                serde_json::json!({"kind":"Status","apiVersion":"v1","status":"Failure","code":503,
                    "message":"error trying to reach service: dial tcp 10.0.0.5:8080: connect: connection refused"})
                .to_string(),
            ),
        };
        let status = apiserver.apiserver_status().expect("a Status");
        assert!(never_reached(&status));
    }

    #[test]
    fn only_errors_before_the_pod_count_as_never_reached() {
        assert!(never_reached(&status(404, "NotFound", "pods \"agents-1\" not found")));
        assert!(never_reached(&status(503, "", "error trying to reach service: dial tcp: i/o timeout")));
        assert!(!never_reached(&status(503, "", "error trying to reach service: EOF")));
        assert!(!never_reached(&status(
            503,
            "",
            "error trying to reach service: read: connection reset by peer"
        )));
        let closed = status(
            503,
            "ServiceUnavailable",
            "error trying to reach service: http: server closed idle connection",
        );
        assert!(never_reached(&closed) && closed_pooled_connection(&closed));
        assert!(never_reached(&status(
            503,
            "ServiceUnavailable",
            "error trying to reach service: readfrom tcp 10.88.0.1:49540->10.88.0.30:8080: write tcp \
             10.88.0.1:49540->10.88.0.30:8080: write: broken pipe"
        )));
        assert!(!never_reached(&status(500, "InternalError", "unexpected EOF")));
    }
}
