//! The pods of an AgentCluster: readiness, and a list of Ready pods refreshed every
//! second for clients that pick a pod at random, as a Service would.

use std::{
    sync::{Arc, RwLock},
    time::Duration,
};

use k8s_openapi::api::core::v1::Pod;
use kube::{api::ListParams, Api, ResourceExt};
use rand::seq::IndexedRandom;

/// The label the operator puts on every pod of a cluster (operator `build.rs`).
pub const CLUSTER_LABEL: &str = "leasehold.dev/cluster";
/// The annotation the operator sets from each pod's lease count.
pub const DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";
/// The injected container.
pub const SIDECAR_CONTAINER: &str = "leasehold-sidecar";

/// Ready (condition `Ready=True`) and not terminating: what an EndpointSlice serves.
pub fn is_ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

pub fn is_terminating(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
}

/// Every pod of cluster `name`, sorted by name.
pub async fn list(api: &Api<Pod>, name: &str) -> kube::Result<Vec<Pod>> {
    let mut pods = api.list(&ListParams::default().labels(&format!("{CLUSTER_LABEL}={name}"))).await?.items;
    pods.sort_by_key(|p| p.name_any());
    Ok(pods)
}

/// Names of the Ready pods of cluster `name`, sorted.
pub async fn ready_names(api: &Api<Pod>, name: &str) -> kube::Result<Vec<String>> {
    Ok(list(api, name).await?.iter().filter(|p| is_ready(p)).map(ResourceExt::name_any).collect())
}

/// A random name of `names` not in `exclude`.
pub fn pick(names: &[String], exclude: &[String]) -> Option<String> {
    let fresh: Vec<&String> = names.iter().filter(|n| !exclude.contains(n)).collect();
    fresh.choose(&mut rand::rng()).map(|s| (*s).clone())
}

/// A list of Ready pods, refreshed in the background every second.
#[derive(Debug, Clone)]
pub struct ReadyPods {
    names: Arc<RwLock<Vec<String>>>,
    task: Arc<tokio::task::JoinHandle<()>>,
}

impl ReadyPods {
    pub async fn watch(api: Api<Pod>, cluster: &str) -> ReadyPods {
        let first = ready_names(&api, cluster).await.expect("list pods");
        let names = Arc::new(RwLock::new(first));
        let cluster = cluster.to_owned();
        let task = tokio::spawn({
            let names = names.clone();
            async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    match ready_names(&api, &cluster).await {
                        Ok(ready) => *names.write().expect("pods lock") = ready,
                        Err(e) => eprintln!("e2e: listing pods failed (keeping the last list): {e}"),
                    }
                }
            }
        });
        ReadyPods { names, task: Arc::new(task) }
    }

    pub fn names(&self) -> Vec<String> {
        self.names.read().expect("pods lock").clone()
    }

    /// A random Ready pod not in `exclude`.
    pub fn pick(&self, exclude: &[String]) -> Option<String> {
        pick(&self.names(), exclude)
    }
}

impl Drop for ReadyPods {
    fn drop(&mut self) {
        if Arc::strong_count(&self.task) == 1 {
            self.task.abort();
        }
    }
}
