//! Operator configuration: clap with env.

use std::{collections::BTreeMap, net::SocketAddr};

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

    /// Labels (`k=v,k2=v2`) of the namespaces whose monitoring pods may reach the
    /// sidecars' admin ports (`/metrics`); with neither monitoring flag, only the operator may.
    #[arg(long, env = "LEASEHOLD_MONITORING_NAMESPACE_LABELS", value_parser = labels)]
    pub monitoring_namespace_labels: Option<BTreeMap<String, String>>,

    /// Labels (`k=v,k2=v2`) of the monitoring pods that may reach the admin ports.
    #[arg(long, env = "LEASEHOLD_MONITORING_POD_LABELS", value_parser = labels)]
    pub monitoring_pod_labels: Option<BTreeMap<String, String>>,

    /// Log filter, e.g. `info` or `info,leasehold_operator=debug`.
    #[arg(long, env = "LEASEHOLD_LOG", default_value = "info")]
    pub log_level: String,
}

/// Parse `k=v,k2=v2` into labels.
fn labels(s: &str) -> Result<BTreeMap<String, String>, String> {
    s.split(',')
        .filter(|pair| !pair.trim().is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.trim().to_owned())),
            _ => Err(format!("{pair:?} is not key=value")),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_lists_parse_and_bad_ones_are_named() {
        let parsed = labels("kubernetes.io/metadata.name=monitoring, app=prometheus").unwrap();
        assert_eq!(parsed.get("app").map(String::as_str), Some("prometheus"));
        assert_eq!(parsed.len(), 2);
        assert!(labels("app").unwrap_err().contains("\"app\""));
    }
}
