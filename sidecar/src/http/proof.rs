//! The proof of the cluster secret on the peer and admin ports: verified over the whole
//! request (its body read first, within a limit) before anything else runs.

use axum::{
    body::Body,
    extract::Request,
    http::{HeaderValue, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
};
use leasehold_core::{
    headers,
    proof::{PeerAuth, Signed},
};

use super::{read_body, reply};
use crate::metrics::Metrics;

/// Who checks a proof: the secret(s), the node id a proof must be made for, where a
/// failure is counted, and the largest body read to check it.
#[derive(Debug, Clone, Copy)]
pub struct Verifier<'a> {
    /// Which port: `peer` or `admin` (in the log line of a rejection).
    pub port: &'static str,
    pub auth: &'a PeerAuth,
    pub node_id: &'a str,
    pub metrics: &'a Metrics,
    pub max_body: usize,
}

impl Verifier<'_> {
    /// Run `next` only for a request with a valid proof made for this node; else `401`.
    pub async fn admit(self, request: Request, next: Next) -> Response {
        let (parts, body) = request.into_parts();
        let body = match read_body(&parts.headers, body, self.max_body).await {
            Ok(body) => body,
            Err(rejected) => return rejected.into_response(),
        };
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let signed = Signed {
            method: parts.method.as_str(),
            path,
            destination: self.node_id,
            headers: &parts.headers,
            body: &body,
        };
        if let Err(e) = self.auth.verify(&signed) {
            tracing::warn!(%path, error = %e, "rejected {} request", self.port);
            self.metrics.peer_auth_failure();
            let mut rejected = reply::error(StatusCode::UNAUTHORIZED, "unauthorized", e.to_string());
            rejected.headers_mut().insert(headers::REFUSAL, HeaderValue::from_static("unauthorized"));
            return rejected;
        }
        next.run(Request::from_parts(parts, Body::from(body))).await
    }
}
