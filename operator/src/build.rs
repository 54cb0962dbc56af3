//! The children of an AgentCluster, built as pure data (no client): Deployment (agent
//! containers + injected sidecar), Service, PodDisruptionBudget, NetworkPolicy and the
//! generated cluster Secret. Unit-tested from YAML fixtures.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::{
        apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment},
        core::v1::{
            Container, ContainerPort, EnvVar, EnvVarSource, ExecAction, HTTPGetAction, HTTPHeader, KeyToPath,
            Lifecycle, LifecycleHandler, ObjectFieldSelector, PodSpec, PodTemplateSpec, Probe,
            ResourceRequirements, SeccompProfile, SecretKeySelector, SecretVolumeSource, SecurityContext,
            Service, ServicePort, ServiceSpec, TopologySpreadConstraint, Volume, VolumeMount,
        },
        networking::v1::{
            NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
        },
        policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec},
    },
    apimachinery::pkg::{
        api::resource::Quantity,
        apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference},
        util::intstr::IntOrString,
    },
};
use kube::{Resource, ResourceExt};
use leasehold_core::proof::DrainThen;
use leasehold_crds::{AgentCluster, CLUSTER_SECRET_KEY, PREVIOUS_CLUSTER_SECRET_KEY};
use sha2::{Digest, Sha256};

use crate::{
    cluster_keys::SECRET_VERSION,
    validate::{Timings, ADMIN_PORT, PEER_PORT, PUBLIC_PORT, SIDECAR_CONTAINER},
};

/// Where the sidecar finds the database's CA bundle (`spec.database.caSecret`): the
/// Helm chart mounts the operator's own at the same path.
pub const POSTGRES_CA_DIR: &str = "/etc/leasehold/postgres-ca";
/// The bundle's file in [`POSTGRES_CA_DIR`], whatever the Secret's key.
pub const POSTGRES_CA_FILE: &str = "ca.crt";
/// The pod volume carrying it.
pub const POSTGRES_CA_VOLUME: &str = "leasehold-postgres-ca";

/// The label every child and pod carries; pods are found by it.
pub const CLUSTER_LABEL: &str = "leasehold.dev/cluster";
/// Hash of everything that shapes the pods: a change rolls the Deployment.
pub const TEMPLATE_HASH: &str = "leasehold.dev/template-hash";
/// Time on top of the drain timeout before SIGKILL: the hand-back, the sidecar's linger
/// after it (at most 5.5 s, `leasehold_sidecar::drain::linger`, or until clients stop
/// sending, at most 8 s, `EXIT_QUIET_WAIT_MAX`) and process exit.
pub const GRACE_MARGIN_SECS: i64 = 10;
/// Where the sidecar image has its binary (the images' entrypoint).
pub const SIDECAR_BINARY: &str = "/usr/local/bin/leasehold-sidecar";

/// Labels of all children of `ac`.
pub fn labels(ac: &AgentCluster) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), "leasehold-agent".to_owned()),
        ("app.kubernetes.io/instance".to_owned(), ac.name_any()),
        ("app.kubernetes.io/managed-by".to_owned(), "leasehold-operator".to_owned()),
        (CLUSTER_LABEL.to_owned(), ac.name_any()),
    ])
}

pub fn selector(ac: &AgentCluster) -> BTreeMap<String, String> {
    BTreeMap::from([(CLUSTER_LABEL.to_owned(), ac.name_any())])
}

/// The generated cluster secret's name, when the spec names none.
pub fn cluster_secret_name(ac: &AgentCluster) -> String {
    ac.spec
        .cluster_secret
        .as_ref()
        .map_or_else(|| format!("{}-cluster-secret", ac.name_any()), |s| s.secret_name.clone())
}

pub fn cluster_secret_key(ac: &AgentCluster) -> String {
    ac.spec.cluster_secret.as_ref().map_or_else(|| CLUSTER_SECRET_KEY.to_owned(), |s| s.key.clone())
}

pub fn previous_cluster_secret_key(ac: &AgentCluster) -> String {
    ac.spec
        .cluster_secret
        .as_ref()
        .map_or_else(|| PREVIOUS_CLUSTER_SECRET_KEY.to_owned(), |s| s.previous_key.clone())
}

fn meta(ac: &AgentCluster, name: String) -> ObjectMeta {
    let owner: OwnerReference = ac.controller_owner_ref(&()).expect("an AgentCluster from the API has a uid");
    ObjectMeta {
        name: Some(name),
        namespace: ac.namespace(),
        labels: Some(labels(ac)),
        owner_references: Some(vec![owner]),
        ..ObjectMeta::default()
    }
}

fn env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar { name: name.to_owned(), value: Some(value.into()), ..EnvVar::default() }
}

fn field_env(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector { field_path: path.to_owned(), ..Default::default() }),
            ..Default::default()
        }),
        ..EnvVar::default()
    }
}

/// An environment variable from a Secret key that may be absent (then it is unset).
fn optional_secret_env(name: &str, secret: &str, key: &str) -> EnvVar {
    let mut var = secret_env(name, secret, key);
    if let Some(selector) = var.value_from.as_mut().and_then(|from| from.secret_key_ref.as_mut()) {
        selector.optional = Some(true);
    }
    var
}

fn secret_env(name: &str, secret: &str, key: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.to_owned(),
                key: key.to_owned(),
                optional: None,
            }),
            ..Default::default()
        }),
        ..EnvVar::default()
    }
}

fn admin_get(path: &str) -> HTTPGetAction {
    HTTPGetAction {
        path: Some(path.to_owned()),
        port: IntOrString::String("admin".into()),
        ..Default::default()
    }
}

/// The sidecar container's preStop hook: drain this pod, signed with the cluster secret
/// from the container's environment (the operator drains it first when it sees the pod
/// terminating; this is the backstop).
fn sidecar_drain_hook() -> Lifecycle {
    let drain = ExecAction { command: Some(vec![SIDECAR_BINARY.to_owned(), "drain".to_owned()]) };
    Lifecycle {
        pre_stop: Some(LifecycleHandler { exec: Some(drain), ..Default::default() }),
        ..Default::default()
    }
}

/// What the drain hook does with a user's own preStop hook on an agent container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UserHook {
    /// None: the drain hook alone.
    None,
    /// Carried out by the sidecar after the drain: a GET on the pod's loopback, a sleep.
    /// `/drained` takes it in its query, and the drain-hook token covers it.
    AfterDrain(DrainThen),
    /// Kept as it is (an `exec` or `tcpSocket` hook, or a GET the sidecar cannot repeat
    /// faithfully: another host, HTTPS, headers): the container does not wait for the
    /// drain; the operator's drain on deletion and the sidecar's own hook remain.
    Kept,
}

/// How a user's preStop hook on `container` composes with the drain.
pub fn user_hook(container: &Container) -> UserHook {
    let Some(hook) = container.lifecycle.as_ref().and_then(|l| l.pre_stop.as_ref()) else {
        return UserHook::None;
    };
    if let Some(get) = &hook.http_get {
        let plain = get.host.as_deref().is_none_or(|h| h.is_empty())
            && get.scheme.as_deref().is_none_or(|s| s.eq_ignore_ascii_case("HTTP"))
            && get.http_headers.as_ref().is_none_or(Vec::is_empty);
        let port = match &get.port {
            IntOrString::Int(port) => u16::try_from(*port).ok(),
            IntOrString::String(name) => container
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(name.as_str()))
                .and_then(|p| u16::try_from(p.container_port).ok()),
        };
        return match (plain, port, hook.exec.is_none() && hook.sleep.is_none()) {
            (true, Some(port), true) => {
                let path = get.path.as_deref().unwrap_or("/").to_owned();
                UserHook::AfterDrain(DrainThen { port: Some(port), path: Some(path), sleep: None })
            }
            _ => UserHook::Kept,
        };
    }
    match &hook.sleep {
        Some(sleep) if hook.exec.is_none() && hook.tcp_socket.is_none() => {
            let seconds = u64::try_from(sleep.seconds).unwrap_or(0);
            UserHook::AfterDrain(DrainThen { sleep: Some(seconds), ..Default::default() })
        }
        _ => UserHook::Kept,
    }
}

/// An agent container's preStop hook: run the drain of this pod's sidecar (with the
/// cluster's drain-hook token; without one, wait for the operator's drain) and answer when
/// it is done, so the agent gets SIGTERM only once its sessions are handed back; then the
/// user's own hook, if it was moved there (`then`, which the token covers). The kubelet's
/// GET needs no proof.
fn agent_drain_hook(drain_token: Option<&str>, then: &DrainThen) -> LifecycleHandler {
    let path = match then.query() {
        query if query.is_empty() => "/drained".to_owned(),
        query => format!("/drained?{query}"),
    };
    let header = drain_token.map(|token| {
        vec![HTTPHeader {
            name: leasehold_core::proof::DRAIN_HOOK_HEADER.to_owned(),
            value: token.to_owned(),
        }]
    });
    let drained = HTTPGetAction {
        path: Some(path),
        port: IntOrString::Int(ADMIN_PORT),
        http_headers: header,
        ..Default::default()
    };
    LifecycleHandler { http_get: Some(drained), ..Default::default() }
}

fn port(name: &str, port: i32) -> ContainerPort {
    ContainerPort {
        name: Some(name.to_owned()),
        container_port: port,
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

fn sidecar(ac: &AgentCluster, image: &str) -> Container {
    let spec = &ac.spec;
    let s = &spec.sidecar;
    let mut env_vars = vec![
        field_env("POD_NAME", "metadata.name"),
        field_env("POD_NAMESPACE", "metadata.namespace"),
        field_env("POD_IP", "status.podIP"),
        secret_env("DATABASE_URL", &spec.database.secret_name, &spec.database.key),
        secret_env("LEASEHOLD_CLUSTER_SECRET", &cluster_secret_name(ac), &cluster_secret_key(ac)),
        optional_secret_env(
            "LEASEHOLD_CLUSTER_SECRET_PREVIOUS",
            &cluster_secret_name(ac),
            &previous_cluster_secret_key(ac),
        ),
        env("LEASEHOLD_AGENT_URL", format!("http://127.0.0.1:{}", spec.agent_port)),
        env("LEASEHOLD_LEASE_TTL", &s.lease_ttl),
        env("LEASEHOLD_HEARTBEAT_INTERVAL", &s.heartbeat_interval),
        env("LEASEHOLD_DRAIN_TIMEOUT", &s.drain_timeout),
        env("LEASEHOLD_LOG", &s.log_level),
        env("LEASEHOLD_MULTITASK", spec.turns.multitask.as_str()),
        env("LEASEHOLD_QUEUE_LIMIT", spec.turns.queue_limit.to_string()),
    ];
    // Unset, the sidecar's own default applies.
    if let Some(bytes) = spec.turns.max_answer_bytes {
        env_vars.push(env("LEASEHOLD_MAX_ANSWER_BYTES", bytes.to_string()));
    }
    if let Some(attempts) = spec.turns.max_attempts {
        env_vars.push(env("LEASEHOLD_MAX_TURN_ATTEMPTS", attempts.to_string()));
    }
    // libpq's variables, read by sqlx under the URL's own parameters.
    if spec.database.ca_secret.is_some() {
        env_vars.push(env("PGSSLROOTCERT", format!("{POSTGRES_CA_DIR}/{POSTGRES_CA_FILE}")));
        env_vars.push(env("PGSSLMODE", "verify-full"));
    }
    if let Some(names) = &s.forward_headers {
        env_vars.push(env("LEASEHOLD_FORWARD_HEADERS", names));
    }
    if let Some(format) = &s.log_format {
        env_vars.push(env("LEASEHOLD_LOG_FORMAT", format));
    }
    if let Some(on) = s.connection_liveness {
        env_vars.push(env("LEASEHOLD_CONNECTION_LIVENESS", on.to_string()));
    }
    Container {
        name: SIDECAR_CONTAINER.to_owned(),
        image: Some(s.image.clone().unwrap_or_else(|| image.to_owned())),
        env: Some(env_vars),
        ports: Some(vec![port("public", PUBLIC_PORT), port("peer", PEER_PORT), port("admin", ADMIN_PORT)]),
        // A native sidecar: started (its startup probe passed) before the agent
        // containers, stopped after them.
        restart_policy: Some("Always".to_owned()),
        startup_probe: Some(Probe {
            http_get: Some(admin_get("/healthz")),
            period_seconds: Some(STARTUP_PROBE_PERIOD_SECS),
            failure_threshold: Some(STARTUP_PROBE_FAILURES),
            ..Default::default()
        }),
        readiness_probe: Some(Probe {
            http_get: Some(admin_get("/readyz")),
            period_seconds: Some(2),
            failure_threshold: Some(2),
            ..Default::default()
        }),
        // The process serves: never the database (a Postgres outage must not restart
        // every sidecar; readiness reports it).
        liveness_probe: Some(Probe {
            http_get: Some(admin_get("/healthz")),
            period_seconds: Some(10),
            failure_threshold: Some(3),
            ..Default::default()
        }),
        // The drain on its own stop: a backstop (the agents' hooks drain first).
        lifecycle: Some(sidecar_drain_hook()),
        volume_mounts: spec.database.ca_secret.as_ref().map(|_| {
            vec![VolumeMount {
                name: POSTGRES_CA_VOLUME.to_owned(),
                mount_path: POSTGRES_CA_DIR.to_owned(),
                read_only: Some(true),
                ..Default::default()
            }]
        }),
        resources: Some(s.resources.clone().unwrap_or_else(default_sidecar_resources)),
        security_context: Some(SecurityContext {
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".to_owned(),
                localhost_profile: None,
            }),
            run_as_non_root: Some(true),
            run_as_user: Some(65532),
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: Some(k8s_openapi::api::core::v1::Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Container::default()
    }
}

/// The volume of `spec.database.caSecret`, its key as [`POSTGRES_CA_FILE`].
fn postgres_ca_volume(ac: &AgentCluster) -> Option<Volume> {
    let ca = ac.spec.database.ca_secret.as_ref()?;
    Some(Volume {
        name: POSTGRES_CA_VOLUME.to_owned(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(ca.secret_name.clone()),
            items: Some(vec![KeyToPath {
                key: ca.key.clone(),
                path: POSTGRES_CA_FILE.to_owned(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// The sidecar's startup probe period. The sidecar serves its admin port once its boot is
/// registered in Postgres, so "started" means the store was reached once.
pub const STARTUP_PROBE_PERIOD_SECS: i32 = 2;
/// Startup probe failures before the kubelet restarts the sidecar: 5 minutes for the
/// database to be reachable at pod start (a Postgres restart or failover takes less).
pub const STARTUP_PROBE_FAILURES: i32 = 150;

/// The sidecar's resources when the spec sets none: requests for scheduling, and a memory
/// limit (a leak is contained to one pod); no CPU limit, whose throttling would stretch
/// drains and heartbeats.
pub fn default_sidecar_resources() -> ResourceRequirements {
    let quantities = |pairs: &[(&str, &str)]| {
        Some(pairs.iter().map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned()))).collect())
    };
    ResourceRequirements {
        requests: quantities(&[("cpu", "50m"), ("memory", "64Mi")]),
        limits: quantities(&[("memory", "256Mi")]),
        ..Default::default()
    }
}

/// The pods' label selector as text (`status.selector`, read by autoscalers).
pub fn selector_text(ac: &AgentCluster) -> String {
    selector(ac).iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

/// A short, stable hash of what shapes the pods.
pub fn template_hash(ac: &AgentCluster, image: &str) -> String {
    let spec = &ac.spec;
    let shaping = serde_json::json!({
        "template": spec.template,
        "agentPort": spec.agent_port,
        "sidecar": spec.sidecar,
        "database": spec.database,
        "clusterSecret": spec.cluster_secret,
        // What the sidecar reads; answerRetention is the operator's alone and rolls nothing.
        "topologySpread": spec.topology_spread,
        "turns": {
            "multitask": spec.turns.multitask,
            "queueLimit": spec.turns.queue_limit,
            "maxAnswerBytes": spec.turns.max_answer_bytes,
            "maxAttempts": spec.turns.max_attempts,
        },
        "image": image,
    });
    hex::encode(&Sha256::digest(shaping.to_string().as_bytes())[..8])
}

/// The Deployment whose agents' preStop hooks start the drain themselves (the cluster's
/// drain-hook token in their header), stamped with the cluster secret's version.
pub fn deployment_with_drain_token(
    ac: &AgentCluster,
    timings: &Timings,
    image: &str,
    keys: &crate::cluster_keys::ClusterKeys,
) -> Deployment {
    pod_deployment(ac, timings, image, &keys.version(), Some(&keys.current))
}

/// `secret_version`: [`crate::cluster_keys::ClusterKeys::version`] of the cluster secret,
/// so that changing its values rolls the pods. The agents' hooks carry no drain-hook token
/// (they wait for the operator's drain), and a user's own preStop hook stays as it is
/// (only a token can let the sidecar run it): see [`deployment_with_drain_token`].
pub fn deployment(ac: &AgentCluster, timings: &Timings, image: &str, secret_version: &str) -> Deployment {
    pod_deployment(ac, timings, image, secret_version, None)
}

fn pod_deployment(
    ac: &AgentCluster,
    timings: &Timings,
    image: &str,
    secret_version: &str,
    drain_secret: Option<&str>,
) -> Deployment {
    let spec = &ac.spec;
    let mut template: PodTemplateSpec = spec.template.clone();
    let mut pod_meta = template.metadata.take().unwrap_or_default();
    pod_meta.labels.get_or_insert_with(BTreeMap::new).extend(labels(ac));
    let annotations = pod_meta.annotations.get_or_insert_with(BTreeMap::new);
    annotations.insert(TEMPLATE_HASH.to_owned(), template_hash(ac, image));
    annotations.insert(SECRET_VERSION.to_owned(), secret_version.to_owned());
    let mut pod: PodSpec = template.spec.take().unwrap_or_default();
    let mut user_sleep = 0;
    for container in &mut pod.containers {
        let then = match user_hook(container) {
            UserHook::Kept => continue,
            UserHook::None => DrainThen::default(),
            UserHook::AfterDrain(then) if drain_secret.is_some() => then,
            // Without the secret no token covers the user's hook: the sidecar would refuse it.
            UserHook::AfterDrain(_) => continue,
        };
        if let Some(sleep) = container.lifecycle.as_ref().and_then(|l| l.pre_stop.as_ref()?.sleep.as_ref()) {
            user_sleep = user_sleep.max(sleep.seconds.max(0));
        }
        let token = drain_secret.map(|secret| leasehold_core::proof::drain_hook_token(secret, &then));
        container.lifecycle.get_or_insert_with(Lifecycle::default).pre_stop =
            Some(agent_drain_hook(token.as_deref(), &then));
    }
    // After the user's own init containers, before the agent containers.
    pod.init_containers.get_or_insert_with(Vec::new).push(sidecar(ac, image));
    if let Some(volume) = postgres_ca_volume(ac) {
        pod.volumes.get_or_insert_with(Vec::new).push(volume);
    }
    if spec.topology_spread && pod.topology_spread_constraints.as_ref().is_none_or(Vec::is_empty) {
        pod.topology_spread_constraints = Some(vec![TopologySpreadConstraint {
            max_skew: 1,
            topology_key: "kubernetes.io/hostname".to_owned(),
            when_unsatisfiable: "ScheduleAnyway".to_owned(),
            label_selector: Some(LabelSelector { match_labels: Some(selector(ac)), ..Default::default() }),
            ..Default::default()
        }]);
    }
    let needed =
        i64::try_from(timings.drain_timeout.as_secs()).unwrap_or(i64::MAX) + GRACE_MARGIN_SECS + user_sleep;
    pod.termination_grace_period_seconds =
        Some(pod.termination_grace_period_seconds.unwrap_or(0).max(needed));
    Deployment {
        metadata: meta(ac, ac.name_any()),
        spec: DeploymentSpec {
            replicas: Some(spec.replicas),
            selector: LabelSelector { match_labels: Some(selector(ac)), ..Default::default() },
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(spec.rollout.max_surge.clone()),
                    max_unavailable: Some(spec.rollout.max_unavailable.clone()),
                }),
            }),
            template: PodTemplateSpec { metadata: Some(pod_meta), spec: Some(pod) },
            ..Default::default()
        },
        status: None,
    }
}

pub fn service(ac: &AgentCluster) -> Service {
    Service {
        metadata: meta(ac, ac.name_any()),
        spec: Some(ServiceSpec {
            type_: Some(ac.spec.service.type_.as_str().to_owned()),
            selector: Some(selector(ac)),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: ac.spec.service.port,
                target_port: Some(IntOrString::String("public".into())),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    }
}

/// The budget of voluntary disruptions (`spec.disruptionBudget`), `None` when disabled.
/// By default at most one pod at a time: each drain hands its sessions over before the
/// next pod goes.
pub fn pod_disruption_budget(ac: &AgentCluster) -> Option<PodDisruptionBudget> {
    let budget = &ac.spec.disruption_budget;
    if !budget.enabled {
        return None;
    }
    let max_unavailable = match (&budget.max_unavailable, &budget.min_available) {
        (Some(max), _) => Some(max.clone()),
        (None, Some(_)) => None,
        (None, None) => Some(IntOrString::Int(1)),
    };
    Some(PodDisruptionBudget {
        metadata: meta(ac, ac.name_any()),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable,
            min_available: if budget.max_unavailable.is_some() { None } else { budget.min_available.clone() },
            selector: Some(LabelSelector { match_labels: Some(selector(ac)), ..Default::default() }),
            ..Default::default()
        }),
        status: None,
    })
}

fn tcp(port: i32) -> NetworkPolicyPort {
    NetworkPolicyPort { port: Some(IntOrString::Int(port)), protocol: Some("TCP".into()), end_port: None }
}

/// The peer port admits only this cluster's pods; public and admin ports stay open to
/// clients, the operator and Prometheus; everything else (the agent's own port) is closed.
/// Who may reach a cluster's admin port besides the kubelet (probes and hooks come from
/// the node): the operator's pods, and a monitoring stack when one is configured.
#[derive(Debug, Clone, Default)]
pub struct AdminCallers {
    /// The operator's namespace; its pods carry [`OPERATOR_ROLE_LABEL`].
    pub operator_namespace: String,
    /// Namespaces of the monitoring stack (`None`: any namespace).
    pub monitoring_namespaces: Option<BTreeMap<String, String>>,
    /// Pods of the monitoring stack (`None`: no monitoring rule unless namespaces are set).
    pub monitoring_pods: Option<BTreeMap<String, String>>,
}

/// The label the chart puts on the operator's pods, for the admin port's NetworkPolicy.
pub const OPERATOR_ROLE_LABEL: (&str, &str) = ("leasehold.dev/role", "operator");

fn namespace_named(name: &str) -> LabelSelector {
    let labels = BTreeMap::from([("kubernetes.io/metadata.name".to_owned(), name.to_owned())]);
    LabelSelector { match_labels: Some(labels), ..Default::default() }
}

fn matching(labels: &BTreeMap<String, String>) -> LabelSelector {
    LabelSelector { match_labels: Some(labels.clone()), ..Default::default() }
}

/// Ingress: the public port from anywhere; the peer port from this cluster's pods; the
/// admin port (drain, leases, metrics) from the operator and the monitoring stack only.
pub fn network_policy(ac: &AgentCluster, admin: &AdminCallers) -> NetworkPolicy {
    let this_cluster = LabelSelector { match_labels: Some(selector(ac)), ..Default::default() };
    let operator_pods =
        BTreeMap::from([(OPERATOR_ROLE_LABEL.0.to_owned(), OPERATOR_ROLE_LABEL.1.to_owned())]);
    let mut admin_from = vec![NetworkPolicyPeer {
        namespace_selector: Some(namespace_named(&admin.operator_namespace)),
        pod_selector: Some(matching(&operator_pods)),
        ..Default::default()
    }];
    if admin.monitoring_namespaces.is_some() || admin.monitoring_pods.is_some() {
        admin_from.push(NetworkPolicyPeer {
            namespace_selector: Some(admin.monitoring_namespaces.as_ref().map(matching).unwrap_or_default()),
            pod_selector: admin.monitoring_pods.as_ref().map(matching),
            ..Default::default()
        });
    }
    NetworkPolicy {
        metadata: meta(ac, ac.name_any()),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(this_cluster.clone()),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule {
                    from: Some(vec![NetworkPolicyPeer {
                        pod_selector: Some(this_cluster),
                        ..Default::default()
                    }]),
                    ports: Some(vec![tcp(PEER_PORT)]),
                },
                NetworkPolicyIngressRule { from: Some(admin_from), ports: Some(vec![tcp(ADMIN_PORT)]) },
                NetworkPolicyIngressRule { from: None, ports: Some(vec![tcp(PUBLIC_PORT)]) },
            ]),
            ..Default::default()
        }),
    }
}

/// The cluster secret the operator creates when the spec names none: 256 random bits.
pub fn cluster_secret(ac: &AgentCluster) -> k8s_openapi::api::core::v1::Secret {
    let value = format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple());
    k8s_openapi::api::core::v1::Secret {
        metadata: meta(ac, cluster_secret_name(ac)),
        string_data: Some(BTreeMap::from([(CLUSTER_SECRET_KEY.to_owned(), value)])),
        type_: Some("Opaque".into()),
        ..Default::default()
    }
}

/// The object reference of an AgentCluster (events).
pub fn reference(ac: &AgentCluster) -> k8s_openapi::api::core::v1::ObjectReference {
    ac.object_ref(&())
}
