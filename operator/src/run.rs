//! Wiring: metrics server, leader election, the AgentCluster controller and the pod
//! watcher. Returns when leadership is lost or a component stops.

use std::sync::Arc;

use futures_util::StreamExt;
use k8s_openapi::api::{
    apps::v1::Deployment,
    coordination::v1::Lease,
    core::v1::{Pod, Secret, Service},
    networking::v1::NetworkPolicy,
    policy::v1::PodDisruptionBudget,
};
use kube::{
    core::PartialObjectMeta,
    runtime::{
        controller::Controller,
        events::{Recorder, Reporter},
        watcher,
    },
    Api, Client, ResourceExt,
};
use leasehold_crds::AgentCluster;

use crate::{
    args::Args,
    controller::{error_policy, reconcile, secret_users, Context},
    leader::LeaderElection,
    metrics::{self, Metrics},
    pods,
    stores::Stores,
};

/// Lease changes re-count every AgentCluster's leases at most this often: a rollout
/// hands dozens of sessions over within a second, and one refresh covers them all.
const LEASE_CHANGES_COALESCE: std::time::Duration = std::time::Duration::from_secs(2);

fn api<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

pub async fn run(args: Args, client: Client) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::default());
    let server = tokio::spawn(metrics::serve(args.metrics_listen, metrics.clone()));
    let identity = args.identity.clone().unwrap_or_else(|| {
        std::env::var("HOSTNAME")
            .unwrap_or_else(|_| format!("leasehold-operator-{}", uuid::Uuid::new_v4().simple()))
    });
    let election = LeaderElection::new(
        Api::<Lease>::namespaced(client.clone(), &args.leader_namespace),
        args.leader_lease.clone(),
        identity.clone(),
    );
    election.acquire().await;

    let ns = args.watch_namespace.as_deref();
    let ctx = Arc::new(Context {
        client: client.clone(),
        sidecar_image: args.sidecar_image.clone(),
        admin_callers: crate::build::AdminCallers {
            operator_namespace: args.leader_namespace.clone(),
            monitoring_namespaces: args.monitoring_namespace_labels.clone(),
            monitoring_pods: args.monitoring_pod_labels.clone(),
        },
        stores: Stores::observed_by(metrics.clone()),
        metrics,
        retention: Default::default(),
        recorder: Recorder::new(
            client.clone(),
            Reporter { controller: "leasehold-operator".into(), instance: Some(identity) },
        ),
        http: crate::pods::drain_client().map_err(|e| anyhow::anyhow!("building the drain client: {e}"))?,
    });
    let config = watcher::Config::default();
    // Children are watched by the label the operator puts on each: the API server sends
    // only the operator's own objects, not every Deployment and Service in the cluster.
    let owned = watcher::Config::default().labels(crate::build::CLUSTER_LABEL);
    let lease_changes = ctx.stores.lease_changes(LEASE_CHANGES_COALESCE);
    let controller = Controller::new(api::<AgentCluster>(&client, ns), config.clone());
    // Secrets are watched by their metadata only (an `Api` of `PartialObjectMeta` asks
    // for no values): an edit of one a cluster names reconciles it (`secret_users`).
    let clusters = controller.store();
    let controller = controller
        .watches(api::<PartialObjectMeta<Secret>>(&client, ns), config.clone(), move |secret| {
            let (namespace, name) = (secret.namespace().unwrap_or_default(), secret.name_any());
            secret_users(clusters.state().iter().map(|ac| ac.as_ref()), &namespace, &name)
        })
        .owns(api::<Deployment>(&client, ns), owned.clone())
        .owns(api::<Service>(&client, ns), owned.clone())
        .owns(api::<PodDisruptionBudget>(&client, ns), owned.clone())
        .owns(api::<NetworkPolicy>(&client, ns), owned)
        .reconcile_all_on(lease_changes)
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx.clone())
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "reconcile loop");
            }
        });
    let watcher = pods::watch(ctx, api::<Pod>(&client, ns));
    tokio::select! {
        // SIGTERM/SIGINT (`shutdown_on_signal`): hand leadership over at once.
        _ = controller => {
            tracing::info!("controller stopped");
            if let Err(e) = election.release().await {
                tracing::warn!(error = %e, "could not release the leader lease; it lapses");
            }
        }
        _ = watcher => anyhow::bail!("pod watcher stopped"),
        _ = election.hold() => anyhow::bail!("lost leadership"),
        served = server => anyhow::bail!("metrics server stopped: {served:?}"),
    }
    Ok(())
}
