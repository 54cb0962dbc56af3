//! Operator configuration: clap with env.

use std::net::SocketAddr;

use clap::Parser;

#[derive(Debug, Clone, Parser)]
#[command(name = "leasehold-operator", version, about = "Reconciles AgentCluster resources")]
pub struct Args {
    /// Serves /metrics and /healthz.
    #[arg(long, env = "LEASEHOLD_OPERATOR_METRICS_LISTEN", default_value = "0.0.0.0:8080")]
    pub metrics_listen: SocketAddr,

    /// Sidecar image injected when an AgentCluster does not name one.
    #[arg(long, env = "LEASEHOLD_SIDECAR_IMAGE", default_value = "leasehold/sidecar:0.1.0")]
    pub sidecar_image: String,

    /// Watch one namespace only (default: all).
    #[arg(long, env = "LEASEHOLD_WATCH_NAMESPACE")]
    pub watch_namespace: Option<String>,

    /// Namespace of the leader-election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub leader_namespace: String,

    /// Name of the leader-election Lease.
    #[arg(long, env = "LEASEHOLD_LEADER_LEASE", default_value = "leasehold-operator")]
    pub leader_lease: String,

    /// This replica's identity in the election [default: $POD_NAME or the hostname].
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,

    /// Log filter, e.g. `info` or `info,leasehold_operator=debug`.
    #[arg(long, env = "LEASEHOLD_LOG", default_value = "info")]
    pub log_level: String,
}
