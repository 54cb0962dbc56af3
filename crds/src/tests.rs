use std::path::Path;

use kube::CustomResourceExt;

use super::*;

#[test]
fn checked_in_crds_are_fresh() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for path in CRD_PATHS {
        let on_disk = std::fs::read_to_string(root.join(path)).unwrap_or_default();
        assert!(on_disk == crd_yaml(), "{path} is stale: run `make generate` and commit the result");
    }
}

#[test]
fn names_match_the_contract() {
    let crd = AgentCluster::crd();
    assert_eq!(crd.metadata.name.as_deref(), Some("agentclusters.leasehold.dev"));
    assert_eq!(crd.spec.names.kind, "AgentCluster");
    assert_eq!(crd.spec.names.short_names, Some(vec!["ac".to_owned()]));
    assert_eq!(crd.spec.scope, "Namespaced");
    let version = &crd.spec.versions[0];
    assert_eq!(version.name, "v1alpha1");
    let columns: Vec<_> =
        version.additional_printer_columns.as_ref().unwrap().iter().map(|c| c.name.as_str()).collect();
    assert_eq!(columns, ["Replicas", "Ready", "Leases", "Age"]);
}

#[test]
fn the_schema_carries_the_cross_field_rules_and_docs() {
    let yaml = crd_yaml();
    assert!(yaml.contains("heartbeatInterval must be less than half of leaseTtl"));
    assert!(yaml.contains(
        "duration(self.heartbeatInterval) + duration(self.heartbeatInterval) < duration(self.leaseTtl)"
    ));
    assert!(yaml.contains("drainTimeout must be between 1s and 1h"));
    assert!(yaml.contains("replicas must be >= 0"));
    assert!(yaml.contains("x-kubernetes-preserve-unknown-fields: true"));
    // `kubectl explain agentcluster.spec` reads these.
    assert!(yaml.contains("Number of agent pods."));
    assert!(yaml.contains("Where the lease store is"));
}

#[test]
fn a_minimal_spec_takes_the_documented_defaults() {
    let spec: AgentClusterSpec = serde_json::from_value(serde_json::json!({
        "replicas": 3,
        "template": { "spec": { "containers": [{ "name": "agent", "image": "a" }] } },
        "database": { "secretName": "db" }
    }))
    .unwrap();
    assert_eq!(spec.agent_port, 3000);
    assert_eq!(spec.sidecar, SidecarSpec::default());
    assert_eq!(spec.sidecar.lease_ttl, "15s");
    assert_eq!(spec.database.key, "DATABASE_URL");
    assert_eq!(spec.service, ServiceSpec { type_: ServiceType::ClusterIP, port: 80 });
    assert_eq!(spec.cluster_secret, None);
}
