//! The e2e side of `leasehold_sidecar::client`, over the pod proxy: on a `503` with a
//! retry directive it re-sends after `delay_ms` (to a pod picked afresh, as a Service
//! would) and gives up after `budget_ms`; without a directive it surfaces the answer and
//! never invents a retry. A request the API server could not deliver to the pod (gone,
//! refused) never reached it, so another pod is tried, as a load balancer would.

use bytes::Bytes;
pub use leasehold_core::directive::Answer;
use leasehold_core::{
    directive::{directive_in, Obeying, RefusalBody},
    headers,
};

use crate::{
    pods::{self, ReadyPods},
    proxy::{never_reached, PodProxy, ProxyError, Reply, PUBLIC_PORT},
};

#[derive(Debug)]
pub enum ClientError {
    /// The directives' budget ran out; the last refusal is returned.
    GaveUp { last: RefusalBody, directives: Vec<String> },
    /// No pod could be reached.
    Unreachable { tried: Vec<String>, last: String },
    /// A failure with no directive (the exchange broke, or the API server failed after
    /// the request may have reached the pod).
    Failed(String),
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientError::GaveUp { last, directives } => {
                write!(
                    f,
                    "gave up after the retry budget: last refusal {} (obeyed {directives:?})",
                    last.error
                )
            }
            ClientError::Unreachable { tried, last } => {
                write!(f, "no pod reachable (tried {tried:?}): {last}")
            }
            ClientError::Failed(e) => write!(f, "request failed: {e}"),
        }
    }
}

impl std::error::Error for ClientError {}

/// Which pods a client may send to.
#[derive(Debug, Clone)]
pub enum Pods {
    /// A fixed list.
    Fixed(Vec<String>),
    /// The cluster's Ready pods, refreshed every second.
    Ready(ReadyPods),
}

impl Pods {
    fn pick(&self, exclude: &[String]) -> Option<String> {
        match self {
            Pods::Fixed(names) => pods::pick(names, exclude),
            Pods::Ready(ready) => ready.pick(exclude),
        }
    }
}

/// How one attempt ended.
enum Attempt {
    Final(Reply),
    Directive(RefusalBody),
    NotReached(String),
}

fn classify(reply: Reply) -> Attempt {
    if let Some(status) = reply.apiserver_status() {
        if never_reached(&status) {
            return Attempt::NotReached(format!("{} {}", status.code, status.message));
        }
        return Attempt::Final(reply);
    }
    match directive_in(reply.status, &reply.body) {
        Some(refusal) => Attempt::Directive(refusal),
        None => Attempt::Final(reply),
    }
}

#[derive(Debug, Clone)]
pub struct Client {
    pub proxy: PodProxy,
    pub pods: Pods,
}

impl Client {
    pub fn new(proxy: PodProxy, pods: Pods) -> Self {
        Client { proxy, pods }
    }

    /// POST a turn for `key` (JSON body), first to `first` (or a random pod).
    pub async fn turn(
        &self,
        key: &str,
        body: &serde_json::Value,
        first: Option<&str>,
    ) -> Result<Answer, ClientError> {
        self.post(&format!("/v1/sessions/{key}/turns"), body.to_string().into(), first).await
    }

    /// POST to the public `path`, starting at pod `first` (or a random pod). Like the
    /// shipped clients, every attempt of one call carries the same `Idempotency-Key`: a
    /// re-send after a directive can never run the turn a second time.
    pub async fn post(&self, path: &str, body: Bytes, first: Option<&str>) -> Result<Answer, ClientError> {
        let key = format!("e2e-{:032x}", rand::random::<u128>());
        let mut obeying = Obeying::default();
        let mut not_reached: Vec<(String, String)> = Vec::new();
        let mut tried: Vec<String> = Vec::new();
        let mut pod = first.map(str::to_owned).or_else(|| self.pods.pick(&[]));
        loop {
            let Some(current) = pod.take() else {
                return Err(ClientError::Unreachable { tried, last: "no pod left to try".into() });
            };
            let reply = self
                .proxy
                .request_keyed(
                    http::Method::POST,
                    &current,
                    PUBLIC_PORT,
                    path,
                    Some(body.clone()),
                    Some(&key),
                )
                .await;
            let reply = match reply {
                Ok(reply) => reply,
                Err(e @ (ProxyError::Kube(_) | ProxyError::Timeout)) => {
                    return Err(ClientError::Failed(format!("{current}: {e}")))
                }
            };
            match classify(reply) {
                Attempt::Final(reply) => {
                    return Ok(Answer {
                        status: reply.status,
                        owner: reply.header(headers::OWNER.as_str()),
                        epoch: reply.header(headers::EPOCH.as_str()).and_then(|e| e.parse().ok()),
                        body: reply.body,
                        directives: obeying.directives,
                        answered_by: current,
                        not_reached,
                    })
                }
                Attempt::NotReached(why) => {
                    tried.push(current.clone());
                    not_reached.push((current, why.clone()));
                    pod = self.pods.pick(&tried);
                    if pod.is_none() {
                        return Err(ClientError::Unreachable { tried, last: why });
                    }
                }
                Attempt::Directive(refusal) => {
                    match obeying.obey(refusal) {
                        Ok(delay) => tokio::time::sleep(delay).await,
                        Err(last) => {
                            return Err(ClientError::GaveUp { last, directives: obeying.directives })
                        }
                    }
                    tried.clear();
                    pod = self.pods.pick(&[]);
                }
            }
        }
    }

    /// `GET /v1/sessions/{key}` from `pod`: a read, never a claim.
    pub async fn session(&self, key: &str, pod: &str) -> Result<serde_json::Value, ClientError> {
        let reply = self
            .proxy
            .get(pod, PUBLIC_PORT, &format!("/v1/sessions/{key}"))
            .await
            .map_err(|e| ClientError::Failed(e.to_string()))?;
        reply.json().ok_or_else(|| ClientError::Failed(format!("{}: {}", reply.status, reply.text())))
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderMap;

    use super::*;

    fn reply(status: u16, body: serde_json::Value) -> Reply {
        Reply { status, headers: HeaderMap::new(), body: Bytes::from(body.to_string()) }
    }

    #[test]
    fn refusals_with_a_directive_are_retried_and_nothing_else() {
        let draining =
            reply(503, serde_json::json!({"error":"draining","retry":{"delay_ms":100,"budget_ms":25000}}));
        assert!(matches!(classify(draining), Attempt::Directive(r) if r.error == "draining"));
        let bare = reply(503, serde_json::json!({"error":"store_unavailable"}));
        assert!(matches!(classify(bare), Attempt::Final(_)), "no directive: surfaced");
        let failed = reply(502, serde_json::json!({"error":"owner_failed"}));
        assert!(matches!(classify(failed), Attempt::Final(_)));
        let ok = reply(200, serde_json::json!({"history_len":1}));
        assert!(matches!(classify(ok), Attempt::Final(r) if r.status == 200));
    }

    #[test]
    fn apiserver_errors_before_the_pod_try_another_pod_and_others_surface() {
        let gone = reply(
            404,
            serde_json::json!({"kind":"Status","apiVersion":"v1","status":"Failure","code":404,
                "reason":"NotFound","message":"pods \"a\" not found"}),
        );
        assert!(matches!(classify(gone), Attempt::NotReached(_)));
        let broken = reply(
            503,
            serde_json::json!({"kind":"Status","apiVersion":"v1","status":"Failure","code":503,
                "message":"error trying to reach service: EOF"}),
        );
        assert!(matches!(classify(broken), Attempt::Final(r) if r.status == 503));
    }
}
