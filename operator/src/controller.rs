//! The AgentCluster reconcile pipeline: read → validate → build (pure) → apply (server-side
//! apply, one field manager) → status.

use std::{collections::HashMap, sync::Arc, time::Duration};

use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        core::v1::{Pod, Secret, Service},
        networking::v1::NetworkPolicy,
        policy::v1::PodDisruptionBudget,
    },
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
};
use kube::{
    api::{ListParams, Patch, PatchParams, PostParams},
    runtime::{
        controller::Action,
        events::{Event, EventType, Recorder},
        reflector::ObjectRef,
    },
    Api, Client, Resource, ResourceExt,
};
use leasehold_crds::{AgentCluster, AgentClusterStatus};
use serde::{de::DeserializeOwned, Serialize};
use serde_json::json;

use crate::{
    build::{self, CLUSTER_LABEL},
    cluster_keys::ClusterKeys,
    error::{kube, Error, Result},
    metrics::Metrics,
    stores::Stores,
    validate::validate,
};

/// The field manager of every server-side apply.
pub const MANAGER: &str = "leasehold-operator";
/// The field manager of the status patches (`kubectl get --show-managed-fields`).
pub const STATUS_MANAGER: &str = "leasehold-operator-status";
/// The field manager of the pod-deletion-cost annotations on pods.
pub const DELETION_COST_MANAGER: &str = "leasehold-operator-deletion-cost";
/// The annotation the ReplicaSet controller reads to pick pods to remove on scale-down.
pub const DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";
/// Status (leases, readiness) refreshes at least this often without any event.
const STATUS_REFRESH: Duration = Duration::from_secs(15);
/// Back-off after a failed reconcile.
const ERROR_REQUEUE: Duration = Duration::from_secs(5);

pub struct Context {
    pub client: Client,
    pub sidecar_image: String,
    /// Who the admin ports' NetworkPolicy admits besides the kubelet.
    pub admin_callers: build::AdminCallers,
    /// When each database was last collected (retention).
    pub retention: crate::retention::Schedule,
    pub metrics: Arc<Metrics>,
    pub stores: Stores,
    pub recorder: Recorder,
    pub http: reqwest::Client,
}

impl Context {
    pub fn api<K>(&self, namespace: &str) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), namespace)
    }

    pub async fn event(&self, ac: &AgentCluster, type_: EventType, reason: &str, note: String) {
        let event =
            Event { type_, reason: reason.into(), note: Some(note), action: reason.into(), secondary: None };
        if let Err(e) = self.recorder.publish(&event, &build::reference(ac)).await {
            tracing::debug!(error = %e, "could not record event");
        }
    }
}

async fn apply<K>(api: &Api<K>, object: &K) -> Result<K>
where
    K: Resource + Serialize + DeserializeOwned + Clone + std::fmt::Debug,
{
    let name = object.meta().name.clone().expect("built objects are named");
    api.patch(&name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(object))
        .await
        .map_err(kube("apply child"))
}

/// The thin entry point: metrics and tracing around the pipeline.
pub async fn reconcile(ac: Arc<AgentCluster>, ctx: Arc<Context>) -> Result<Action> {
    ctx.metrics.reconcile();
    use tracing::Instrument;
    let span = tracing::info_span!("reconcile", cluster = %ac.name_any(), namespace = ac.namespace());
    reconcile_inner(&ac, &ctx).instrument(span).await
}

pub fn error_policy(ac: Arc<AgentCluster>, error: &Error, ctx: Arc<Context>) -> Action {
    tracing::warn!(cluster = %ac.name_any(), error = %crate::error::one_line(error), "reconcile failed");
    ctx.metrics.error(error.metric_label());
    Action::requeue(ERROR_REQUEUE)
}

async fn reconcile_inner(ac: &AgentCluster, ctx: &Context) -> Result<Action> {
    let ns = ac.namespace().ok_or(Error::NotNamespaced)?;
    let timings = match validate(&ac.spec) {
        Ok(timings) => timings,
        Err(problems) => {
            // Touch no child: the last good state keeps running.
            let message = problems.join("; ");
            ctx.event(ac, EventType::Warning, "InvalidSpec", message.clone()).await;
            let status = AgentClusterStatus {
                conditions: conditions(ac, None, Some(("InvalidSpec", message))),
                observed_generation: ac.metadata.generation,
                ..ac.status.clone().unwrap_or_default()
            };
            patch_status(ctx, &ns, ac, &status).await?;
            return Ok(Action::await_change());
        }
    };
    ensure_cluster_secret(ctx, &ns, ac).await?;
    // Read on every reconcile: an edit of the Secret triggers one (`secret_triggers`),
    // and a changed value rolls the pods through the version annotation.
    let keys = cluster_keys(ctx, &ns, ac).await?;
    let deployment = match apply_children(ctx, &ns, ac, &timings, &keys).await {
        Ok(deployment) => deployment,
        Err(e) => {
            // The API server's own words (an admission webhook, a quota, a field it
            // refuses), where `kubectl describe` and `kubectl get -o yaml` show them.
            let message = e.api_message();
            ctx.event(ac, EventType::Warning, "ApplyFailed", message.clone()).await;
            let status = AgentClusterStatus {
                conditions: conditions(ac, None, Some(("ApplyFailed", message))),
                observed_generation: ac.metadata.generation,
                selector: Some(build::selector_text(ac)),
                ..ac.status.clone().unwrap_or_default()
            };
            patch_status(ctx, &ns, ac, &status).await?;
            return Err(e);
        }
    };

    let pods = cluster_pods(ctx, &ns, ac).await?;
    let (leases, degraded) = match lease_counts(ctx, &ns, ac, &pods).await {
        Ok(leases) => (leases, None),
        Err(e) => {
            let cause = crate::error::one_line(&e);
            tracing::warn!(error = %cause, "cannot count leases");
            (HashMap::new(), Some(("StoreUnavailable", cause)))
        }
    };
    let total: i64 = leases.values().sum();
    ctx.metrics.leases(&ns, &ac.name_any(), total);
    if degraded.is_none() {
        let retentions = crate::retention::Retentions {
            sessions: timings.session_retention,
            answers: timings.answer_retention,
        };
        collect_expired(ctx, &ns, ac, retentions).await;
    }
    set_deletion_costs(ctx, &ns, &pods, &leases).await?;
    let d = deployment.status.unwrap_or_default();
    let status = AgentClusterStatus {
        replicas: d.replicas.unwrap_or(0),
        ready_replicas: d.ready_replicas.unwrap_or(0),
        leases: total,
        observed_generation: ac.metadata.generation,
        conditions: conditions(ac, Some(&deployment_progress(&deployment.metadata, ac, &d)), degraded),
        selector: Some(build::selector_text(ac)),
    };
    patch_status(ctx, &ns, ac, &status).await?;
    Ok(Action::requeue(STATUS_REFRESH))
}

/// Server-side apply of every child; the Deployment as the API server returned it.
async fn apply_children(
    ctx: &Context,
    ns: &str,
    ac: &AgentCluster,
    timings: &crate::validate::Timings,
    keys: &ClusterKeys,
) -> Result<Deployment> {
    let built = build::deployment_with_drain_token(ac, timings, &ctx.sidecar_image, keys);
    let deployment = apply(&ctx.api::<Deployment>(ns), &built).await?;
    apply(&ctx.api::<Service>(ns), &build::service(ac)).await?;
    let pdbs = ctx.api::<PodDisruptionBudget>(ns);
    match build::pod_disruption_budget(ac) {
        Some(pdb) => {
            apply(&pdbs, &pdb).await?;
        }
        None => match pdbs.delete(&ac.name_any(), &Default::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(kube("delete disruption budget")(e)),
        },
    }
    apply(&ctx.api::<NetworkPolicy>(ns), &build::network_policy(ac, &ctx.admin_callers)).await?;
    Ok(deployment)
}

/// Readiness facts for the conditions.
pub struct Progress {
    pub desired: i32,
    pub ready: i32,
    pub updated: i32,
    pub rolled_out: bool,
}

fn deployment_progress(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    ac: &AgentCluster,
    d: &k8s_openapi::api::apps::v1::DeploymentStatus,
) -> Progress {
    let desired = ac.spec.replicas;
    let updated = d.updated_replicas.unwrap_or(0);
    let observed = d.observed_generation.unwrap_or(0) >= meta.generation.unwrap_or(0);
    let rolled_out = observed && updated >= desired && d.replicas.unwrap_or(0) == desired;
    Progress { desired, ready: d.ready_replicas.unwrap_or(0), updated, rolled_out }
}

fn condition(ac: &AgentCluster, type_: &str, status: bool, reason: &str, message: String) -> Condition {
    let status = if status { "True" } else { "False" }.to_owned();
    // Keep the transition time while the status stays the same.
    let previous = ac.status.as_ref().and_then(|s| s.conditions.iter().find(|c| c.type_ == type_));
    let last_transition_time = match previous {
        Some(p) if p.status == status => p.last_transition_time.clone(),
        _ => Time(jiff::Timestamp::now()),
    };
    Condition {
        type_: type_.to_owned(),
        status,
        reason: reason.to_owned(),
        message,
        observed_generation: ac.metadata.generation,
        last_transition_time,
    }
}

/// `Available`, `Progressing`, `Degraded`. `progress` is `None` when nothing was applied.
pub fn conditions(
    ac: &AgentCluster,
    progress: Option<&Progress>,
    degraded: Option<(&str, String)>,
) -> Vec<Condition> {
    let mut out = Vec::new();
    if let Some(p) = progress {
        let available = p.desired == 0 || p.ready >= 1;
        out.push(condition(
            ac,
            "Available",
            available,
            if available { "PodsReady" } else { "NoPodReady" },
            format!("{}/{} pods ready", p.ready, p.desired),
        ));
        let progressing = !p.rolled_out;
        out.push(condition(
            ac,
            "Progressing",
            progressing,
            if progressing { "RollingOut" } else { "RolledOut" },
            format!("{}/{} pods updated", p.updated, p.desired),
        ));
    } else if let Some(old) = &ac.status {
        out.extend(old.conditions.iter().filter(|c| c.type_ != "Degraded").cloned());
    }
    out.push(match degraded {
        Some((reason, message)) => condition(ac, "Degraded", true, reason, message),
        None => condition(ac, "Degraded", false, "AsExpected", String::new()),
    });
    out
}

async fn patch_status(ctx: &Context, ns: &str, ac: &AgentCluster, status: &AgentClusterStatus) -> Result<()> {
    let api = ctx.api::<AgentCluster>(ns);
    let patch = Patch::Merge(json!({ "status": status }));
    api.patch_status(&ac.name_any(), &PatchParams::apply(STATUS_MANAGER), &patch)
        .await
        .map_err(kube("patch status"))?;
    Ok(())
}

/// Create the cluster secret once when the spec names none (never overwrite: pods use it).
async fn ensure_cluster_secret(ctx: &Context, ns: &str, ac: &AgentCluster) -> Result<()> {
    if ac.spec.cluster_secret.is_some() {
        return Ok(());
    }
    let api = ctx.api::<Secret>(ns);
    let name = build::cluster_secret_name(ac);
    if api.get_opt(&name).await.map_err(kube("get cluster secret"))?.is_some() {
        return Ok(());
    }
    match api
        .create(
            &PostParams { field_manager: Some(MANAGER.into()), ..Default::default() },
            &build::cluster_secret(ac),
        )
        .await
    {
        Ok(_) => {
            ctx.event(ac, EventType::Normal, "ClusterSecretCreated", format!("created Secret {name}")).await;
            Ok(())
        }
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()), // created concurrently
        Err(e) => Err(kube("create cluster secret")(e)),
    }
}

/// Retention of the cluster's database, when due: failures are logged and counted, never
/// a reason to fail the reconcile.
async fn collect_expired(
    ctx: &Context,
    ns: &str,
    ac: &AgentCluster,
    retentions: crate::retention::Retentions,
) {
    let collected = async {
        let url = database_url(ctx, ns, ac).await?;
        if !ctx.retention.due(&url, std::time::Instant::now()) {
            return Ok(None);
        }
        let store = ctx.stores.get(&url)?;
        crate::retention::collect(&store, retentions, &ctx.metrics).await.map(Some)
    };
    match collected.await {
        Ok(Some(done)) if done.sessions + done.nodes + done.turns > 0 => {
            tracing::info!(
                sessions = done.sessions,
                nodes = done.nodes,
                turns = done.turns,
                "retention collected"
            );
        }
        Ok(_) => {}
        Err(e) => {
            ctx.metrics.error(e.metric_label());
            tracing::warn!(error = %crate::error::one_line(&e), "retention failed");
        }
    }
}

/// Values of a Secret, as text: the first key is required, the others optional.
async fn secret_values<const N: usize>(
    ctx: &Context,
    ns: &str,
    name: &str,
    keys: [&str; N],
) -> Result<[Option<String>; N]> {
    let secret = ctx.api::<Secret>(ns).get_opt(name).await.map_err(kube("get secret"))?;
    let data = secret.and_then(|s| s.data).unwrap_or_default();
    let mut values = std::array::from_fn(|_| None);
    for (value, key) in values.iter_mut().zip(keys) {
        *value = match data.get(key) {
            None => None,
            Some(bytes) => Some(
                String::from_utf8(bytes.0.clone())
                    .map_err(|_| Error::SecretValue(name.to_owned(), key.to_owned()))?,
            ),
        };
    }
    if values[0].is_none() {
        return Err(Error::SecretValue(name.to_owned(), keys[0].to_owned()));
    }
    Ok(values)
}

/// One value of a Secret, as text.
async fn secret_value(ctx: &Context, ns: &str, name: &str, key: &str) -> Result<String> {
    let [value] = secret_values(ctx, ns, name, [key]).await?;
    Ok(value.expect("the first key is required"))
}

/// The Postgres URL from the cluster's database Secret.
pub async fn database_url(ctx: &Context, ns: &str, ac: &AgentCluster) -> Result<String> {
    secret_value(ctx, ns, &ac.spec.database.secret_name, &ac.spec.database.key).await
}

/// The cluster secret the cluster's sidecars share (and the previous one during a
/// rotation): the operator signs its drains with it and stamps the pods with its version.
pub async fn cluster_keys(ctx: &Context, ns: &str, ac: &AgentCluster) -> Result<ClusterKeys> {
    let (current, previous) = (build::cluster_secret_key(ac), build::previous_cluster_secret_key(ac));
    let [current, previous] =
        secret_values(ctx, ns, &build::cluster_secret_name(ac), [current.as_str(), previous.as_str()])
            .await?;
    Ok(ClusterKeys::new(current.expect("the first key is required"), previous))
}

/// The clusters that name the Secret `namespace/name` (cluster secret or database
/// Secret): an edit of it reconciles them, so a new cluster-secret value rolls their pods
/// at once and a fixed database Secret clears `StoreUnavailable`.
pub fn secret_users<'a>(
    clusters: impl IntoIterator<Item = &'a AgentCluster>,
    namespace: &str,
    name: &str,
) -> Vec<ObjectRef<AgentCluster>> {
    clusters
        .into_iter()
        .filter(|ac| ac.namespace().as_deref() == Some(namespace))
        .filter(|ac| build::cluster_secret_name(ac) == name || ac.spec.database.secret_name == name)
        .map(ObjectRef::from_obj)
        .collect()
}

pub async fn cluster_pods(ctx: &Context, ns: &str, ac: &AgentCluster) -> Result<Vec<Pod>> {
    let selector = format!("{CLUSTER_LABEL}={}", ac.name_any());
    let pods =
        ctx.api::<Pod>(ns).list(&ListParams::default().labels(&selector)).await.map_err(kube("list pods"))?;
    Ok(pods.items)
}

/// Live leases per pod, counted in Postgres.
async fn lease_counts(
    ctx: &Context,
    ns: &str,
    ac: &AgentCluster,
    pods: &[Pod],
) -> Result<HashMap<String, i64>> {
    let store = ctx.stores.get(&database_url(ctx, ns, ac).await?)?;
    let names: Vec<String> = pods.iter().map(|p| p.name_any()).collect();
    Ok(store.live_leases_by_node(&names).await?)
}

/// `pod-deletion-cost` = the pod's lease count, so a scale-down removes the least-loaded.
async fn set_deletion_costs(
    ctx: &Context,
    ns: &str,
    pods: &[Pod],
    leases: &HashMap<String, i64>,
) -> Result<()> {
    let api = ctx.api::<Pod>(ns);
    for pod in pods {
        if pod.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let cost = leases.get(&pod.name_any()).copied().unwrap_or(0).to_string();
        if pod.annotations().get(DELETION_COST) == Some(&cost) {
            continue;
        }
        let patch = Patch::Merge(json!({ "metadata": { "annotations": { DELETION_COST: cost } } }));
        api.patch(&pod.name_any(), &PatchParams::apply(DELETION_COST_MANAGER), &patch)
            .await
            .map_err(kube("set pod-deletion-cost"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(namespace: &str, name: &str, cluster_secret: Option<&str>, database: &str) -> AgentCluster {
        let mut spec = json!({
            "replicas": 1,
            "template": { "spec": { "containers": [{ "name": "agent", "image": "agent" }] } },
            "database": { "secretName": database },
        });
        if let Some(secret) = cluster_secret {
            spec["clusterSecret"] = json!({ "secretName": secret });
        }
        let mut ac: AgentCluster = serde_json::from_value(json!({
            "apiVersion": "leasehold.dev/v1alpha1",
            "kind": "AgentCluster",
            "metadata": { "name": name, "namespace": namespace },
            "spec": spec,
        }))
        .expect("an AgentCluster");
        ac.metadata.namespace = Some(namespace.to_owned());
        ac
    }

    fn names(refs: Vec<ObjectRef<AgentCluster>>) -> Vec<String> {
        let mut names: Vec<String> =
            refs.iter().map(|r| format!("{}/{}", r.namespace.as_deref().unwrap_or(""), r.name)).collect();
        names.sort();
        names
    }

    #[test]
    fn a_secret_edit_reconciles_exactly_the_clusters_that_name_it() {
        let clusters = [
            cluster("a", "chat", None, "db"),
            cluster("a", "search", Some("shared-peer"), "db"),
            cluster("a", "other", Some("shared-peer"), "db-2"),
            cluster("b", "chat", None, "db"),
        ];
        // The generated cluster secret `<name>-cluster-secret`, in its own namespace only.
        assert_eq!(names(secret_users(&clusters, "a", "chat-cluster-secret")), ["a/chat"]);
        assert_eq!(names(secret_users(&clusters, "b", "chat-cluster-secret")), ["b/chat"]);
        // A named cluster secret shared by two clusters.
        assert_eq!(names(secret_users(&clusters, "a", "shared-peer")), ["a/other", "a/search"]);
        // The database Secret.
        assert_eq!(names(secret_users(&clusters, "a", "db")), ["a/chat", "a/search"]);
        assert_eq!(names(secret_users(&clusters, "b", "db")), ["b/chat"]);
        // Anything else reconciles nothing.
        assert!(secret_users(&clusters, "a", "unrelated").is_empty());
        assert!(secret_users(&clusters, "c", "db").is_empty());
        assert!(secret_users(&clusters, "b", "shared-peer").is_empty());
    }
}
