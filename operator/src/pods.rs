//! The pod watcher: drain a pod the moment it starts terminating (the preStop hook is the
//! backstop), and revoke the leases of pods Kubernetes reports gone or failed, so their
//! sessions move in seconds instead of a TTL (safe: the fence rejects any zombie write).

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
    time::Duration,
};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::{
    runtime::{events::EventType, watcher, WatchStreamExt},
    Api, ResourceExt,
};
use leasehold_core::proof::Signed;
use leasehold_crds::AgentCluster;

use crate::{
    build::CLUSTER_LABEL,
    controller::{cluster_keys, database_url, Context},
    error::{kube, Result},
    validate::ADMIN_PORT,
};

/// A drain waits for in-flight turns up to the cluster's drain timeout; this bounds the
/// call when the spec cannot be read.
const DRAIN_CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// A sidecar's admin port that does not accept within this is not draining anything
/// (its node is gone or partitioned): give up, the preStop hook and revocation remain.
pub const DRAIN_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The HTTP client the operator drains pods with: a connect that does not complete within
/// [`DRAIN_CONNECT_TIMEOUT`] fails, so a pod at an address that drops packets is given up
/// on quickly rather than after [`DRAIN_CALL_TIMEOUT`].
pub fn drain_client() -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder().connect_timeout(DRAIN_CONNECT_TIMEOUT).build()
}

/// Pod events handled at once: a drain may wait long (or hang on a partitioned node),
/// and no number of those may hold back another pod's revocation.
const CONCURRENT_POD_EVENTS: usize = 1024;

/// What to do about a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodAction {
    /// It started terminating: call its sidecar's drain at this address.
    Drain { url: String },
    /// It is gone or failed: expire its node leases.
    Revoke,
}

/// Pods already handled, by uid, so each action happens once per pod.
#[derive(Debug, Default)]
pub struct Seen {
    drained: Mutex<HashSet<String>>,
    revoked: Mutex<HashSet<String>>,
}

fn first(set: &Mutex<HashSet<String>>, uid: &str) -> bool {
    set.lock().expect("seen lock").insert(uid.to_owned())
}

impl Seen {
    /// A pod is gone for good (uids are never reused): remember nothing of it.
    fn forget(&self, uid: &str) {
        self.drained.lock().expect("seen lock").remove(uid);
        self.revoked.lock().expect("seen lock").remove(uid);
    }

    /// How many pods are remembered (drained or revoked).
    pub fn len(&self) -> usize {
        self.drained.lock().expect("seen lock").len() + self.revoked.lock().expect("seen lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Decide (pure but for the once-only bookkeeping) what a pod event calls for.
pub fn decide(pod: &Pod, gone: bool, seen: &Seen) -> Vec<PodAction> {
    let uid = pod.uid().unwrap_or_default();
    let mut actions = Vec::new();
    let terminating = pod.metadata.deletion_timestamp.is_some();
    let ip = pod.status.as_ref().and_then(|s| s.pod_ip.clone());
    let failed = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed");
    if terminating && !gone && !failed {
        if let Some(ip) = ip {
            if first(&seen.drained, &uid) {
                actions.push(PodAction::Drain { url: format!("http://{ip}:{ADMIN_PORT}/drain") });
            }
        }
    }
    if (gone || failed) && first(&seen.revoked, &uid) {
        actions.push(PodAction::Revoke);
    }
    actions
}

fn cluster_of(pod: &Pod) -> Option<(String, String)> {
    Some((pod.namespace()?, pod.labels().get(CLUSTER_LABEL)?.clone()))
}

/// Drain `pod` through its admin port, signed with the cluster secret for that pod (its
/// node id is its name).
async fn drain(ctx: &Context, pod: &Pod, ac: &AgentCluster, url: &str) -> Result<serde_json::Value> {
    let ns = pod.namespace().unwrap_or_default();
    let auth = cluster_keys(ctx, &ns, ac).await?.auth();
    let name = pod.name_any();
    let none = http::HeaderMap::new();
    let signed = Signed { method: "POST", path: "/drain", destination: &name, headers: &none, body: b"" };
    let send = |proof: Vec<(http::HeaderName, http::HeaderValue)>| {
        let request = proof.into_iter().fold(ctx.http.post(url), |r, (k, v)| r.header(k, v));
        request.timeout(DRAIN_CALL_TIMEOUT).send()
    };
    let report = async {
        let mut response = send(auth.sign(&signed, &[])).await?;
        // Mid-rotation, a pod started before it knows only the previous secret; its
        // refusal ran nothing, so the drain is sent again signed with that one.
        let refused = response.status() == http::StatusCode::UNAUTHORIZED
            && response.headers().contains_key(leasehold_core::headers::REFUSAL);
        if let (true, Some(proof)) = (refused, auth.sign_previous(&signed, &[])) {
            response = send(proof).await?;
        }
        response.error_for_status()?.json::<serde_json::Value>().await
    };
    report.await.map_err(|source| crate::error::Error::Drain { pod: name, source })
}

async fn revoke(ctx: &Context, pod: &Pod, ac: &AgentCluster) -> Result<u64> {
    let ns = pod.namespace().unwrap_or_default();
    let store = ctx.stores.get(&database_url(ctx, &ns, ac).await?)?;
    Ok(store.revoke_node(&pod.name_any()).await?)
}

/// Carry out what `decide` asked for, with events and metrics.
pub async fn handle(ctx: &Context, pod: &Pod, gone: bool, seen: &Seen) {
    let actions = decide(pod, gone, seen);
    if gone {
        seen.forget(&pod.uid().unwrap_or_default());
    }
    if actions.is_empty() {
        return;
    }
    let Some((ns, cluster)) = cluster_of(pod) else { return };
    let ac = match ctx.api::<AgentCluster>(&ns).get_opt(&cluster).await.map_err(kube("get cluster of pod")) {
        Ok(Some(ac)) => ac,
        Ok(None) => return, // the cluster itself is gone
        Err(e) => {
            ctx.metrics.error(e.metric_label());
            return tracing::warn!(error = %e, pod = %pod.name_any(), "cannot read the pod's cluster");
        }
    };
    for action in actions {
        match action {
            PodAction::Drain { url } => match drain(ctx, pod, &ac, &url).await {
                Ok(report) => {
                    ctx.metrics.drain("ok");
                    let note = format!("drained pod {} before shutdown: {report}", pod.name_any());
                    ctx.event(&ac, EventType::Normal, "Drained", note).await;
                }
                Err(e) => {
                    // The preStop hook still drains; the lease TTL is the last resort.
                    ctx.metrics.drain("failed");
                    ctx.event(&ac, EventType::Warning, "DrainFailed", format!("{e}: {:?}", e.to_string()))
                        .await;
                }
            },
            PodAction::Revoke => match revoke(ctx, pod, &ac).await {
                Ok(n) => {
                    ctx.metrics.revoked(n);
                    if n > 0 {
                        let note = format!("revoked {n} leases of pod {} (gone or failed)", pod.name_any());
                        ctx.event(&ac, EventType::Normal, "LeasesRevoked", note).await;
                    }
                }
                Err(e) => {
                    ctx.metrics.error(e.metric_label());
                    ctx.event(&ac, EventType::Warning, "RevokeFailed", e.to_string()).await;
                }
            },
        }
    }
}

/// Watch every leasehold pod until the stream ends.
pub async fn watch(ctx: Arc<Context>, api: Api<Pod>) {
    let events = watcher(api, watcher::Config::default().labels(CLUSTER_LABEL)).default_backoff();
    handle_events(ctx, events, Arc::new(Seen::default())).await;
}

/// Handle pod events as they come, many at once (see [`CONCURRENT_POD_EVENTS`]).
pub async fn handle_events(
    ctx: Arc<Context>,
    events: impl futures_util::Stream<Item = Result<watcher::Event<Pod>, watcher::Error>>,
    seen: Arc<Seen>,
) {
    events
        .for_each_concurrent(CONCURRENT_POD_EVENTS, |event| {
            let (ctx, seen) = (ctx.clone(), seen.clone());
            async move {
                match event {
                    Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => {
                        handle(&ctx, &pod, false, &seen).await
                    }
                    Ok(watcher::Event::Delete(pod)) => handle(&ctx, &pod, true, &seen).await,
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "pod watch interrupted"),
                }
            }
        })
        .await;
}
