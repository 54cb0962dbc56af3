//! The permissions the operator uses, and why; the chart's ClusterRole and Role must grant
//! exactly these (`tests/chart_rbac.rs` renders the chart and compares).

/// (API group, resource, verbs) granted cluster-wide.
pub const CLUSTER_RULES: &[(&str, &str, &[&str])] = &[
    // The controller lists and watches clusters; the pod watcher gets a pod's cluster.
    ("leasehold.dev", "agentclusters", &["get", "list", "watch"]),
    // Status is written with a merge patch (field manager `leasehold-operator-status`).
    ("leasehold.dev", "agentclusters/status", &["patch"]),
    // Children carry blockOwnerDeletion owner references to their cluster.
    ("leasehold.dev", "agentclusters/finalizers", &["update"]),
    // Children are server-side applied (create + patch) and watched (`owns`).
    ("apps", "deployments", &["list", "watch", "create", "patch"]),
    ("", "services", &["list", "watch", "create", "patch"]),
    // A budget is deleted when `spec.disruptionBudget.enabled` turns false.
    ("policy", "poddisruptionbudgets", &["list", "watch", "create", "patch", "delete"]),
    ("networking.k8s.io", "networkpolicies", &["list", "watch", "create", "patch"]),
    // The database URL and the cluster secret are read; the cluster secret is created once
    // if absent; Secrets are watched (metadata only) so an edit of one a cluster names is
    // acted on at once (a cluster-secret rotation rolls the pods).
    ("", "secrets", &["get", "list", "watch", "create"]),
    // Pods are listed (status, leases) and watched (drain, revoke); deletion cost patched.
    ("", "pods", &["list", "watch", "patch"]),
    // Kubernetes Events for drains, revocations and errors (series are patched).
    ("events.k8s.io", "events", &["create", "patch"]),
];

/// (API group, resource, verbs) granted in the operator's own namespace.
pub const NAMESPACE_RULES: &[(&str, &str, &[&str])] = &[
    // Leader election: read, create once, then renew or take over by update.
    ("coordination.k8s.io", "leases", &["get", "create", "update"]),
];
