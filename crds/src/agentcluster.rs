//! `AgentCluster` (leasehold.dev/v1alpha1): a fleet of agent pods, each with the
//! leasehold sidecar injected, so every session has exactly one writer.

use k8s_openapi::{
    api::core::v1::{PodTemplateSpec, ResourceRequirements},
    apimachinery::pkg::{apis::meta::v1::Condition, util::intstr::IntOrString},
};
use kube::{CustomResource, KubeSchema};
use schemars::{json_schema, JsonSchema};
use serde::{Deserialize, Serialize};

/// A fleet of agent pods behind one Service. The operator injects the leasehold sidecar
/// into every pod, drains pods before they stop, and revokes the leases of pods that die.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[kube(
    group = "leasehold.dev",
    version = "v1alpha1",
    kind = "AgentCluster",
    plural = "agentclusters",
    shortname = "ac",
    namespaced,
    status = "AgentClusterStatus",
    doc = "A fleet of agent pods behind one Service, each with the leasehold sidecar injected (a native sidecar) so that every agent session has exactly one writer: a Postgres lease and an epoch fence per session, drains before pods stop, lease revocation when pods die.",
    scale = r#"{"specReplicasPath":".spec.replicas","statusReplicasPath":".status.replicas","labelSelectorPath":".status.selector"}"#,
    printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".spec.replicas"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"Leases","type":"integer","jsonPath":".status.leases"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct AgentClusterSpec {
    /// Number of agent pods. Sessions are spread over them; scaling down removes the pods
    /// holding the fewest sessions first.
    #[x_kube(validation = Rule::new("self >= 0").message("replicas must be >= 0"))]
    pub replicas: i32,

    /// Pod template for the agent containers (a standard PodTemplateSpec). The operator adds
    /// the `leasehold-sidecar` native sidecar (an init container with `restartPolicy:
    /// Always`), a preStop drain hook on every agent container (a user's own `httpGet` or
    /// `sleep` preStop hook runs after the drain), and a termination grace period that
    /// covers the drain.
    #[schemars(schema_with = "pod_template_schema")]
    pub template: PodTemplateSpec,

    /// Port on which the agent container serves turns (CONTRACT §4); the sidecar dispatches
    /// to 127.0.0.1 on this port.
    #[serde(default = "default_agent_port")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65535").message("agentPort must be a TCP port"))]
    pub agent_port: i32,

    /// The injected sidecar.
    #[serde(default)]
    pub sidecar: SidecarSpec,

    /// Where the lease store is: a Secret holding the Postgres URL.
    pub database: DatabaseRef,

    /// The shared secret that authenticates peer requests between sidecars. When absent,
    /// the operator creates a Secret `<name>-cluster-secret` with a random value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_secret: Option<ClusterSecretRef>,

    /// The Service in front of the public (client) port.
    #[serde(default)]
    pub service: ServiceSpec,

    /// How the Deployment rolls. Drains make a rolling deploy hand every session over
    /// without waiting for a TTL.
    #[serde(default)]
    pub rollout: RolloutSpec,

    /// How long a session nobody holds (released, or its pod long gone) is kept after its
    /// last change before the operator deletes it with its checkpoint, in small batches;
    /// a session held by a live pod is never deleted. At least 1h; default 720h (30 days).
    #[serde(default = "default_session_retention")]
    #[schemars(regex(pattern = DURATION_PATTERN))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1h')").message("sessionRetention must be at least 1h"))]
    pub session_retention: String,

    /// How each pod's sidecar runs a session's turns (one at a time) and how long their
    /// recorded answers are kept (CONTRACT §9).
    #[serde(default)]
    pub turns: TurnsSpec,

    /// Spread the pods over nodes (`kubernetes.io/hostname`, at most one pod more on any
    /// node, scheduled anyway when it cannot be met), so one node going down takes few
    /// sessions' owners with it. Ignored when the template has its own
    /// `topologySpreadConstraints`. Default: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub topology_spread: bool,

    /// The PodDisruptionBudget the operator keeps for the pods (voluntary disruptions:
    /// node drains, evictions).
    #[serde(default)]
    pub disruption_budget: DisruptionBudgetSpec,
}

/// The PodDisruptionBudget of the cluster's pods.
#[derive(KubeSchema, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.minAvailable) || !has(self.maxUnavailable)").message("set one of minAvailable and maxUnavailable"))]
pub struct DisruptionBudgetSpec {
    /// Whether the operator creates the budget at all. Default: true.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Pods that may be evicted at a time (number or percentage). Default: 1 (each drain
    /// hands its sessions over before the next pod goes), unless minAvailable is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unavailable: Option<IntOrString>,
    /// Pods that must stay available (number or percentage); instead of maxUnavailable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_available: Option<IntOrString>,
}

fn default_true() -> bool {
    true
}

impl Default for DisruptionBudgetSpec {
    fn default() -> Self {
        DisruptionBudgetSpec { enabled: true, max_unavailable: None, min_available: None }
    }
}

fn default_session_retention() -> String {
    "720h".into()
}

fn default_agent_port() -> i32 {
    3000
}

/// Any PodTemplateSpec: validated by the API server when it reaches the Deployment, kept
/// out of the CRD schema so the CRD stays small.
fn pod_template_schema(_: &mut schemars::generate::SchemaGenerator) -> schemars::Schema {
    json_schema!({
        "description": "Pod template for the agent containers (a standard PodTemplateSpec).",
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true
    })
}

fn resources_schema(_: &mut schemars::generate::SchemaGenerator) -> schemars::Schema {
    json_schema!({
        "description": "Compute resources of the sidecar container (a standard ResourceRequirements).",
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true
    })
}

/// A Go-style duration: `15s`, `500ms`, `2m`.
const DURATION_PATTERN: &str = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$";

/// Settings of the injected `leasehold-sidecar` container.
#[derive(KubeSchema, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("duration(self.heartbeatInterval) + duration(self.heartbeatInterval) < duration(self.leaseTtl)")
        .message("heartbeatInterval must be less than half of leaseTtl"),
    validation = Rule::new("duration(self.drainTimeout) >= duration('1s') && duration(self.drainTimeout) <= duration('1h')")
        .message("drainTimeout must be between 1s and 1h"),
)]
pub struct SidecarSpec {
    /// Sidecar image. Defaults to the image the operator was installed with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,

    /// Compute resources of the sidecar container. Default: requests of 50m CPU and 64Mi
    /// memory, a memory limit of 256Mi; when set, it replaces the default as a whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "resources_schema")]
    pub resources: Option<ResourceRequirements>,

    /// Lifetime of a pod's node lease without renewal: how long a crashed pod's sessions
    /// wait when the operator cannot revoke them first.
    #[serde(default = "default_lease_ttl")]
    #[schemars(regex(pattern = DURATION_PATTERN))]
    pub lease_ttl: String,

    /// How often the node lease is renewed; less than half of leaseTtl.
    #[serde(default = "default_heartbeat")]
    #[schemars(regex(pattern = DURATION_PATTERN))]
    pub heartbeat_interval: String,

    /// How long a drain lets in-flight turns finish before standing them down.
    #[serde(default = "default_drain_timeout")]
    #[schemars(regex(pattern = DURATION_PATTERN))]
    pub drain_timeout: String,

    /// Sidecar log level (`LEASEHOLD_LOG`), e.g. `info` or `info,leasehold_sidecar=debug`.
    #[serde(default = "default_log_level")]
    pub log_level: String,

    /// Client request headers that reach the agent with a turn
    /// (`LEASEHOLD_FORWARD_HEADERS`, comma-separated). Unset: the sidecar's default
    /// (Authorization, traceparent, tracestate, baggage, X-Request-Id, Accept); empty:
    /// none. A hop-by-hop or `Leasehold-*` header makes the sidecar refuse to start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forward_headers: Option<String>,

    /// Sidecar log lines (`LEASEHOLD_LOG_FORMAT`): `text` or `json` (one object per
    /// line). Unset: the sidecar's default, `text`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = "^(text|json)$"))]
    pub log_format: Option<String>,

    /// Connection liveness (`LEASEHOLD_CONNECTION_LIVENESS`): a pod whose sidecar process
    /// died is judged dead as soon as Postgres sees its connection close, and its sessions
    /// move at once instead of after `leaseTtl`. Unset: the sidecar's default, on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connection_liveness: Option<bool>,
}

fn default_lease_ttl() -> String {
    "15s".into()
}
fn default_heartbeat() -> String {
    "5s".into()
}
fn default_drain_timeout() -> String {
    "25s".into()
}
fn default_log_level() -> String {
    "info".into()
}

impl Default for SidecarSpec {
    fn default() -> Self {
        SidecarSpec {
            image: None,
            resources: None,
            lease_ttl: default_lease_ttl(),
            heartbeat_interval: default_heartbeat(),
            drain_timeout: default_drain_timeout(),
            log_level: default_log_level(),
            forward_headers: None,
            log_format: None,
            connection_liveness: None,
        }
    }
}

/// The Secret (in the AgentCluster's namespace) holding the Postgres URL.
#[derive(JsonSchema, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct DatabaseRef {
    /// Name of the Secret.
    #[schemars(length(min = 1))]
    pub secret_name: String,
    /// Key within the Secret whose value is the Postgres URL.
    #[serde(default = "default_database_key")]
    pub key: String,
    /// The CA bundle (PEM) that signed the database server's certificate, for a database
    /// whose CA is private (most managed ones). Mounted read-only into the sidecar at
    /// /etc/leasehold/postgres-ca/ca.crt, which PGSSLROOTCERT names, with PGSSLMODE
    /// verify-full; an sslmode or sslrootcert in the URL wins over both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret: Option<CaSecretRef>,
}

fn default_database_key() -> String {
    "DATABASE_URL".into()
}

/// The Secret (in the AgentCluster's namespace) holding a CA bundle.
#[derive(JsonSchema, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CaSecretRef {
    /// Name of the Secret.
    #[schemars(length(min = 1))]
    pub secret_name: String,
    /// Key within the Secret whose value is the PEM bundle.
    #[serde(default = "default_ca_key")]
    pub key: String,
}

fn default_ca_key() -> String {
    "ca.crt".into()
}

/// The Secret (in the AgentCluster's namespace) holding the cluster secret.
#[derive(JsonSchema, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterSecretRef {
    /// Name of the Secret.
    #[schemars(length(min = 1))]
    pub secret_name: String,
    /// Key within the Secret whose value is the shared secret.
    #[serde(default = "default_cluster_secret_key")]
    pub key: String,
    /// Key within the Secret whose value, when present, is the secret before a rotation:
    /// sidecars still accept it, and fall back to it for peers that refuse the new one.
    #[serde(default = "default_previous_cluster_secret_key")]
    pub previous_key: String,
}

/// The key the operator uses in a cluster secret it creates.
pub const CLUSTER_SECRET_KEY: &str = "cluster-secret";
/// The key holding the secret before a rotation, unless the spec names another.
pub const PREVIOUS_CLUSTER_SECRET_KEY: &str = "cluster-secret-previous";

fn default_cluster_secret_key() -> String {
    CLUSTER_SECRET_KEY.into()
}

fn default_previous_cluster_secret_key() -> String {
    PREVIOUS_CLUSTER_SECRET_KEY.into()
}

/// The Service for the public port.
#[derive(JsonSchema, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ServiceSpec {
    /// Service type.
    #[serde(default, rename = "type")]
    pub type_: ServiceType,
    /// Port the Service exposes; it targets the sidecar's public port.
    #[serde(default = "default_service_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
}

fn default_service_port() -> i32 {
    80
}

impl Default for ServiceSpec {
    fn default() -> Self {
        ServiceSpec { type_: ServiceType::default(), port: default_service_port() }
    }
}

/// Kubernetes Service types.
#[derive(JsonSchema, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ServiceType {
    #[default]
    ClusterIP,
    NodePort,
    LoadBalancer,
}

impl ServiceType {
    pub fn as_str(self) -> &'static str {
        match self {
            ServiceType::ClusterIP => "ClusterIP",
            ServiceType::NodePort => "NodePort",
            ServiceType::LoadBalancer => "LoadBalancer",
        }
    }
}

/// Rolling update parameters of the Deployment.
#[derive(JsonSchema, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutSpec {
    /// Pods created above the desired count during a rollout (number or percentage).
    #[serde(default = "default_max_surge")]
    pub max_surge: IntOrString,
    /// Pods that may be unavailable during a rollout (number or percentage).
    #[serde(default = "default_max_unavailable")]
    pub max_unavailable: IntOrString,
}

fn default_max_surge() -> IntOrString {
    IntOrString::Int(1)
}
fn default_max_unavailable() -> IntOrString {
    IntOrString::Int(0)
}

impl Default for RolloutSpec {
    fn default() -> Self {
        RolloutSpec { max_surge: default_max_surge(), max_unavailable: default_max_unavailable() }
    }
}

/// What the owner does with a turn that arrives while another turn of its session runs.
#[derive(JsonSchema, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Multitask {
    /// Queue it behind the running turn (FIFO, up to `queueLimit`, then 503 queue_full).
    #[default]
    Enqueue,
    /// Refuse it: 409 busy.
    Reject,
    /// Cancel the running turn (its client gets 409 interrupted) and run this one.
    Interrupt,
}

impl Multitask {
    /// The sidecar's `--multitask` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Multitask::Enqueue => "enqueue",
            Multitask::Reject => "reject",
            Multitask::Interrupt => "interrupt",
        }
    }
}

/// The fewest turns a session may queue: one waiting behind the running one.
pub const MIN_QUEUE_LIMIT: i32 = 1;
/// The most turns a session may queue; the sidecar refuses to start above it
/// (`--queue-limit`).
pub const MAX_QUEUE_LIMIT: i32 = 10_000;
/// The largest `maxAnswerBytes`: a recorded answer is one Postgres `bytea` value, which
/// holds at most 1 GiB.
pub const MAX_ANSWER_BYTES_LIMIT: i64 = 1 << 30;
/// The largest `maxAttempts` the sidecar accepts.
pub const MAX_TURN_ATTEMPTS: i32 = 1000;

/// Turns: one at a time per session, journaled, their answers kept for repeats.
#[derive(KubeSchema, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TurnsSpec {
    /// What the owner does with a turn that arrives while another of the same session
    /// runs: `enqueue` (wait in arrival order), `reject` (409 busy) or `interrupt` (cancel
    /// the running one). A client may override it per turn with `Leasehold-Multitask`.
    #[serde(default)]
    pub multitask: Multitask,

    /// Turns that may wait per session at its owner under `enqueue`; above it a turn gets
    /// 503 queue_full. 1 to 10000.
    #[serde(default = "default_queue_limit")]
    #[schemars(range(min = MIN_QUEUE_LIMIT, max = MAX_QUEUE_LIMIT))]
    pub queue_limit: i32,

    /// How long a finished (or cancelled) turn's recorded answer and events are kept: a
    /// repeat of its Idempotency-Key within it gets the recorded answer instead of running
    /// again. At least 5m; default 24h.
    #[serde(default = "default_answer_retention")]
    #[schemars(regex(pattern = DURATION_PATTERN))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('5m')").message("answerRetention must be at least 5m"))]
    pub answer_retention: String,

    /// Largest agent answer the sidecar records, in bytes; a larger one fails its turn with
    /// 502 answer_too_large. Default: the sidecar's (4 MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = MAX_ANSWER_BYTES_LIMIT))]
    pub max_answer_bytes: Option<i64>,
    /// Attempts a turn gets: one, plus one each time a new owner takes it over unfinished
    /// (a crash, a drain, a partition). A turn that used them all is recorded as failed
    /// (502 attempts_exhausted) rather than resumed again. Default: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = MAX_TURN_ATTEMPTS))]
    pub max_attempts: Option<i32>,
}

/// The sidecar's own `--queue-limit` default: a session rarely has more turns in flight.
fn default_queue_limit() -> i32 {
    16
}
/// CONTRACT §8: a day of answers covers any client that repeats a request.
fn default_answer_retention() -> String {
    "24h".into()
}

impl Default for TurnsSpec {
    fn default() -> Self {
        TurnsSpec {
            multitask: Multitask::default(),
            queue_limit: default_queue_limit(),
            answer_retention: default_answer_retention(),
            max_answer_bytes: None,
            max_attempts: None,
        }
    }
}

/// Observed state, written by the operator.
#[derive(JsonSchema, Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct AgentClusterStatus {
    /// Pods of the current Deployment.
    #[serde(default)]
    pub replicas: i32,
    /// Pods whose sidecar reports ready.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Live session leases held by this cluster's pods, counted in Postgres.
    #[serde(default)]
    pub leases: i64,
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Available`, `Progressing` and `Degraded`, with reasons.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The label selector of the cluster's pods, as text (the scale subresource's
    /// `labelSelectorPath`: a HorizontalPodAutoscaler finds the pods by it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
}
