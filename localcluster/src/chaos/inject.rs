//! Doing one fault to the testbed, and undoing it before returning: after [`inject`] the
//! cluster is whole again (processes running, store up, links mended, no firewall rule),
//! though perhaps not yet recovered.

use std::time::Duration;

use super::{
    schedule::{Fault, FaultKind, Part},
    store_link::StoreLink,
    testbed::Testbed,
};
use crate::{
    blackhole::{Blackhole, BlackholeError},
    cluster::{binary, PEER_PORT},
    Node,
};

/// Every turn ends with a checkpoint write: if none passes any store link in this long,
/// no turn is running, and the scheduled node's link is cut anyway.
const WRITE_WAIT: Duration = Duration::from_secs(5);
/// The drain command waits for in-flight turns up to the cluster's drain timeout; past
/// that plus this, it is hung.
const DRAIN_MARGIN: Duration = Duration::from_secs(10);

/// A fault that could not be done (or undone) as planned. The run goes on and reports it.
#[derive(Debug, thiserror::Error)]
pub enum InjectError {
    #[error("{node} not ready after its restart: {reason}")]
    NotReady { node: String, reason: String },
    #[error("drain of {node} failed: {reason}")]
    Drain { node: String, reason: String },
    #[error("postgres: {0}")]
    Postgres(String),
    #[error(transparent)]
    Firewall(#[from] BlackholeError),
    #[error("no checkpoint write in {WRITE_WAIT:?}; {node}'s store link cut anyway")]
    NoWriteToHold { node: String },
}

/// Do `fault` to `bed`, hold it, undo it.
pub async fn inject(bed: &mut Testbed, fault: &Fault) -> Result<(), InjectError> {
    let hold = fault.hold;
    match fault.kind {
        FaultKind::Kill9Restart => {
            // What its agent was sent so far, before the kill loses it.
            bed.collect_agent_epochs(fault.node).await;
            let node = &mut bed.cluster.nodes[fault.node];
            node.kill9();
            tokio::time::sleep(hold).await;
            restart(node).await
        }
        FaultKind::PauseUnderTtl | FaultKind::PausePastTtl => {
            let node = &bed.cluster.nodes[fault.node];
            match fault.part {
                Part::Pod => node.pause(),
                Part::SidecarOnly => node.sidecar.pause(),
            }
            tokio::time::sleep(hold).await;
            node.resume(); // both: resuming a running process does nothing
            Ok(())
        }
        FaultKind::DrainRestart => {
            let drain_timeout = bed.cluster.options.drain_timeout;
            let secret = bed.cluster.options.cluster_secret.clone();
            let drained =
                drain(&bed.cluster.nodes[fault.node], secret.as_deref(), drain_timeout + DRAIN_MARGIN).await;
            tokio::time::sleep(hold).await;
            bed.collect_agent_epochs(fault.node).await;
            let node = &mut bed.cluster.nodes[fault.node];
            // The pod goes away whether or not its drain succeeded (as Kubernetes does
            // after the grace period); the report still says the drain failed.
            let restarted = restart(node).await;
            drained.and(restarted)
        }
        FaultKind::PostgresRestart => {
            bed.stop_postgres().await.map_err(|e| InjectError::Postgres(format!("stop: {e:#}")))?;
            tokio::time::sleep(hold).await;
            bed.start_postgres().await.map_err(|e| InjectError::Postgres(format!("start: {e:#}")))
        }
        FaultKind::StorePartition => {
            let link = &bed.links[fault.node];
            link.cut();
            tokio::time::sleep(hold).await;
            link.mend();
            Ok(())
        }
        FaultKind::StorePartitionMidWrite => {
            let held = cut_at_next_write(&bed.links).await;
            if held.is_none() {
                bed.links[fault.node].cut();
            }
            tokio::time::sleep(hold).await;
            for link in &bed.links {
                link.mend();
            }
            match held {
                Some(node) => {
                    eprintln!("    {}'s checkpoint write is held", bed.cluster.nodes[node].name);
                    Ok(())
                }
                None => Err(InjectError::NoWriteToHold { node: bed.cluster.nodes[fault.node].name.clone() }),
            }
        }
        FaultKind::PeerPartition => {
            let hole = Blackhole::port(bed.cluster.nodes[fault.node].ip, PEER_PORT)?;
            tokio::time::sleep(hold).await;
            drop(hole);
            Ok(())
        }
    }
}

/// Arm every node's store link; the first checkpoint write to pass one cuts that link
/// and disarms the others. Which node's write is held, if one came within [`WRITE_WAIT`].
async fn cut_at_next_write(links: &[StoreLink]) -> Option<usize> {
    for link in links {
        link.arm();
    }
    let first = futures_util::future::select_all(links.iter().map(|link| Box::pin(link.tripped())));
    let tripped = tokio::time::timeout(WRITE_WAIT, first).await.ok().map(|((), node, _)| node);
    for link in links {
        link.disarm();
    }
    tripped
}

/// A new pod in the old one's place: both containers start again; wait until ready.
async fn restart(node: &mut Node) -> Result<(), InjectError> {
    node.restart_sidecar();
    node.restart_agent();
    node.wait_ready()
        .await
        .map_err(|e| InjectError::NotReady { node: node.name.clone(), reason: format!("{e:#}") })
}

/// `leasehold-sidecar drain` of `node`, as a preStop hook runs it (signed with the
/// cluster secret), bounded by `bound`.
async fn drain(node: &Node, secret: Option<&str>, bound: Duration) -> Result<(), InjectError> {
    let failed = |reason: String| InjectError::Drain { node: node.name.clone(), reason };
    let command = tokio::process::Command::new(binary("leasehold-sidecar"))
        .args(["drain", "--admin-url", &node.admin_url(), "--cluster-secret", secret.unwrap_or("insecure")])
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(bound, command)
        .await
        .map_err(|_| failed(format!("no answer in {bound:?}")))?
        .map_err(|e| failed(e.to_string()))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(failed(format!("{}: {}", output.status, String::from_utf8_lossy(&output.stderr).trim())))
    }
}
