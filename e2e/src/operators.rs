//! The operator as leader election sees it: the chart's Deployment (scaled by the
//! leader-election scenario), operator processes the scenario starts itself beside it
//! (same binary, same Lease), each replica's reconcile counter, and the Lease's holder.

use std::{
    net::SocketAddr,
    process::Stdio,
    sync::{Arc, Mutex},
    time::Duration,
};

use k8s_openapi::api::{apps::v1::Deployment, coordination::v1::Lease, core::v1::Pod};
use kube::{
    api::{ListParams, Patch, PatchParams},
    Api, ResourceExt,
};
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
};

use crate::{install::NAMESPACE, proxy::PodProxy, settings::Settings};

/// The leader-election Lease: the operator's default `--leader-lease`, which the chart
/// does not change, in the release namespace.
pub const LEADER_LEASE: &str = "leasehold-operator";
/// The counter every reconcile increments (`operator/src/metrics.rs`).
pub const RECONCILES: &str = "leasehold_operator_reconciles_total";
/// The chart's operator metrics port (`metrics.port`).
pub const CHART_METRICS_PORT: u16 = 8080;
/// The label the chart puts on the operator's pods.
pub const OPERATOR_POD_LABEL: &str = "leasehold.dev/role=operator";

/// The value of a counter without labels in a Prometheus text exposition.
pub fn counter(exposition: &str, name: &str) -> Option<u64> {
    exposition.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?.strip_prefix(' ')?;
        rest.split_whitespace().next()?.parse::<f64>().ok().map(|v| v as u64)
    })
}

/// What the Lease says at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRecord {
    pub holder: Option<String>,
    pub duration: Duration,
    pub transitions: i32,
}

/// Read the leader-election Lease (`None` if it does not exist).
pub async fn leader(client: &kube::Client) -> kube::Result<Option<LeaseRecord>> {
    let lease = Api::<Lease>::namespaced(client.clone(), NAMESPACE).get_opt(LEADER_LEASE).await?;
    Ok(lease.map(|lease| {
        let spec = lease.spec.unwrap_or_default();
        LeaseRecord {
            holder: spec.holder_identity.filter(|h| !h.is_empty()),
            duration: Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(0) as u64),
            transitions: spec.lease_transitions.unwrap_or(0),
        }
    }))
}

/// The chart's operator Deployment (the only Deployment of the release namespace).
pub async fn chart_deployment(client: &kube::Client) -> String {
    let deployments = Api::<Deployment>::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default())
        .await
        .expect("list the operator's Deployments");
    let names: Vec<String> = deployments.items.iter().map(ResourceExt::name_any).collect();
    assert_eq!(names.len(), 1, "one operator Deployment in {NAMESPACE}: {names:?}");
    names[0].clone()
}

/// Set the chart's operator replicas.
pub async fn scale_chart(client: &kube::Client, replicas: i32) {
    let name = chart_deployment(client).await;
    Api::<Deployment>::namespaced(client.clone(), NAMESPACE)
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": { "replicas": replicas } })),
        )
        .await
        .unwrap_or_else(|e| panic!("scale {NAMESPACE}/{name} to {replicas}: {e}"));
}

/// The chart's operator pods: (name, Ready and not terminating).
pub async fn chart_pods(client: &kube::Client) -> Vec<(String, bool)> {
    let pods = Api::<Pod>::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default().labels(OPERATOR_POD_LABEL))
        .await
        .expect("list the operator's pods");
    pods.items.iter().map(|p| (p.name_any(), crate::pods::is_ready(p))).collect()
}

/// A metrics read that takes longer than this counts as unreachable (a pod going away),
/// so one slow read does not hold up the samples.
pub const METRICS_READ_WITHIN: Duration = Duration::from_secs(2);

/// A chart operator pod's reconcile counter, through the pod proxy (`None`: unreachable).
pub async fn chart_reconciles(client: &kube::Client, pod: &str) -> Option<u64> {
    let proxy = PodProxy::new(client.clone(), NAMESPACE);
    let read = proxy.get(pod, CHART_METRICS_PORT, "/metrics");
    let reply = tokio::time::timeout(METRICS_READ_WITHIN, read).await.ok()?.ok()?;
    if reply.status != 200 {
        return None;
    }
    counter(&reply.text(), RECONCILES)
}

/// The series of the operator's drains that succeeded and failed
/// (`leasehold_operator_drains_total{outcome}`).
pub const DRAINS_OK: &str = "leasehold_operator_drains_total{outcome=\"ok\"}";
pub const DRAINS_FAILED: &str = "leasehold_operator_drains_total{outcome=\"failed\"}";

/// Counters of the leading operator (the chart's pod the Lease names), read through the
/// pod proxy: `series` in order, each 0 when absent (a counter family shows a series
/// only once it was incremented). Panics if the leader cannot be read.
pub async fn leader_counters<const N: usize>(client: &kube::Client, series: [&str; N]) -> [u64; N] {
    let holder = leader(client).await.expect("read the Lease").and_then(|l| l.holder).expect("a leader");
    let proxy = PodProxy::new(client.clone(), NAMESPACE);
    let reply = proxy
        .get(&holder, CHART_METRICS_PORT, "/metrics")
        .await
        .unwrap_or_else(|e| panic!("metrics of the leading operator {holder}: {e}"));
    assert_eq!(reply.status, 200, "metrics of the leading operator {holder}: {}", reply.text());
    let text = reply.text();
    series.map(|name| counter(&text, name).unwrap_or(0))
}

/// An operator process started by the suite, on loopback for its metrics, with the
/// admin kubeconfig, in the chart's namespace and Lease. Killed on drop.
#[derive(Debug)]
pub struct OperatorProcess {
    pub identity: String,
    pub metrics: SocketAddr,
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
    http: reqwest::Client,
}

/// A free loopback port (bound then released: nothing else on this machine picks ports
/// in the meantime but the kernel's ephemeral range).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    listener.local_addr().expect("its address").port()
}

impl OperatorProcess {
    /// Start `leasehold-operator` with the chart's arguments (so whatever it applies is
    /// what the chart's operator would) and identity `identity`.
    pub fn start(settings: &Settings, identity: &str) -> OperatorProcess {
        let bin = settings.operator_bin.clone().unwrap_or_else(|| {
            panic!("LEASEHOLD_E2E_OPERATOR_BIN is not set (the operator binary; scripts/e2e.sh sets it)")
        });
        let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut child = Command::new(&bin)
            .args(["--metrics-listen", &metrics.to_string()])
            .args(["--sidecar-image", &settings.sidecar_image()])
            .args(["--log-level", "info"])
            .args(["--identity", identity])
            .env("KUBECONFIG", &settings.kubeconfig)
            .env("POD_NAMESPACE", NAMESPACE)
            .env_remove("POD_NAME")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
        let log = Arc::new(Mutex::new(Vec::new()));
        for out in [
            child.stdout.take().map(|o| Box::new(o) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
            child.stderr.take().map(|o| Box::new(o) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let log = log.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(out).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    log.lock().expect("log lock").push(line);
                }
            });
        }
        eprintln!("e2e: started operator {identity} (pid {:?}, metrics {metrics})", child.id());
        OperatorProcess {
            identity: identity.to_owned(),
            metrics,
            child,
            log,
            http: reqwest::Client::builder().timeout(METRICS_READ_WITHIN).build().expect("a client"),
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Its reconcile counter (`None`: not answering, e.g. dead).
    pub async fn reconciles(&self) -> Option<u64> {
        let response = self.http.get(format!("http://{}/metrics", self.metrics)).send().await.ok()?;
        counter(&response.text().await.ok()?, RECONCILES)
    }

    /// SIGKILL, as a crash: nothing is released.
    pub async fn kill(&mut self) {
        self.child.start_kill().expect("SIGKILL the operator");
        let _ = self.child.wait().await;
    }

    /// SIGTERM, as a rollout would: the operator stops and releases the Lease. Waits
    /// up to `within` for the exit.
    pub async fn terminate(&mut self, within: Duration) -> bool {
        let pid = self.pid().expect("the operator is running");
        let sent = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
        assert!(sent.is_ok_and(|s| s.success()), "kill -TERM {pid}");
        tokio::time::timeout(within, self.child.wait()).await.is_ok()
    }

    pub fn log(&self) -> Vec<String> {
        self.log.lock().expect("log lock").clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_read_by_exact_name() {
        let text = "# HELP leasehold_operator_reconciles AgentCluster reconciliations\n\
                    # TYPE leasehold_operator_reconciles counter\n\
                    leasehold_operator_reconciles_total 17\n\
                    leasehold_operator_reconciles_total_extra 3\n\
                    leasehold_operator_revocations_total 0\n";
        assert_eq!(counter(text, RECONCILES), Some(17));
        assert_eq!(counter(text, "leasehold_operator_revocations_total"), Some(0));
        assert_eq!(counter(text, "leasehold_operator_drains_total"), None);
        assert_eq!(counter("leasehold_operator_reconciles_total 2.0e0\n", RECONCILES), Some(2));
        let drains = "leasehold_operator_drains_total{outcome=\"ok\"} 5\n\
                      leasehold_operator_drains_total{outcome=\"failed\"} 1\n";
        assert_eq!(counter(drains, DRAINS_OK), Some(5));
        assert_eq!(counter(drains, DRAINS_FAILED), Some(1));
    }
}
