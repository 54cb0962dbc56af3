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

#[test]
fn turns_default_and_parse_in_camel_case() {
    let minimal: AgentClusterSpec = serde_json::from_value(serde_json::json!({
        "replicas": 1,
        "template": {},
        "database": { "secretName": "db" }
    }))
    .unwrap();
    assert_eq!(minimal.turns, TurnsSpec::default());
    assert_eq!(
        (minimal.turns.multitask, minimal.turns.queue_limit, minimal.turns.answer_retention.as_str()),
        (Multitask::Enqueue, 16, "24h")
    );
    assert_eq!(minimal.turns.max_answer_bytes, None);

    let set: TurnsSpec = serde_json::from_value(serde_json::json!({
        "multitask": "interrupt", "queueLimit": 3, "answerRetention": "1h", "maxAnswerBytes": 1024
    }))
    .unwrap();
    assert_eq!(
        set,
        TurnsSpec {
            multitask: Multitask::Interrupt,
            queue_limit: 3,
            answer_retention: "1h".into(),
            max_answer_bytes: Some(1024),
            max_attempts: None,
        }
    );
    assert_eq!(Multitask::Reject.as_str(), "reject");
    let bad = serde_json::from_value::<TurnsSpec>(serde_json::json!({ "multitask": "parallel" }));
    assert!(bad.is_err(), "not a policy");
}

/// What the API server enforces on `spec.turns`: the policy is one of three, the queue
/// limit is 1..=10000, the answer size 1 byte..1 GiB, the retention a duration of at least
/// 5m, each with its default.
#[test]
fn the_schema_bounds_the_turn_settings() {
    let crd = serde_json::to_value(AgentCluster::crd()).unwrap();
    let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
    let turns = &spec["turns"]["properties"];
    assert_eq!(turns["multitask"]["enum"], serde_json::json!(["enqueue", "reject", "interrupt"]), "{turns}");
    assert_eq!(turns["multitask"]["default"], "enqueue", "{turns}");
    let limit = &turns["queueLimit"];
    assert_eq!(
        (limit["minimum"].as_f64(), limit["maximum"].as_f64()),
        (Some(1.0), Some(10_000.0)),
        "{limit}"
    );
    assert_eq!(limit["default"], 16);
    let bytes = &turns["maxAnswerBytes"];
    assert_eq!(
        (bytes["minimum"].as_f64(), bytes["maximum"].as_f64()),
        (Some(1.0), Some(MAX_ANSWER_BYTES_LIMIT as f64)),
        "{bytes}"
    );
    let attempts = &turns["maxAttempts"];
    assert_eq!(
        (attempts["minimum"].as_f64(), attempts["maximum"].as_f64()),
        (Some(1.0), Some(f64::from(crate::MAX_TURN_ATTEMPTS))),
        "{attempts}"
    );
    let retention = &turns["answerRetention"];
    assert_eq!(retention["default"], "24h");
    assert_eq!(retention["pattern"], spec["sessionRetention"]["pattern"], "a duration like the others");
    let rules = retention["x-kubernetes-validations"].to_string();
    assert!(rules.contains("duration(self) >= duration('5m')"), "{retention}");
    assert!(rules.contains("answerRetention must be at least 5m"), "{retention}");
}

/// `kubectl explain agentcluster` reads the root description; the HPA reads the scale
/// subresource's selector path; server-side apply merges conditions by `type`.
#[test]
fn the_crd_follows_the_api_conventions() {
    let crd = AgentCluster::crd();
    let version = &crd.spec.versions[0];
    let root = version.schema.as_ref().unwrap().open_api_v3_schema.as_ref().unwrap();
    let description = root.description.as_deref().unwrap_or_default();
    assert!(description.starts_with("A fleet of agent pods"), "{description}");
    assert!(!description.contains("Auto-generated"), "{description}");
    let scale = version.subresources.as_ref().unwrap().scale.as_ref().unwrap();
    assert_eq!(scale.label_selector_path.as_deref(), Some(".status.selector"));
    let status = &root.properties.as_ref().unwrap()["status"];
    let conditions = &status.properties.as_ref().unwrap()["conditions"];
    assert_eq!(conditions.x_kubernetes_list_type.as_deref(), Some("map"));
    assert_eq!(conditions.x_kubernetes_list_map_keys, Some(vec!["type".to_owned()]));
    assert!(status.properties.as_ref().unwrap().contains_key("selector"));
}

#[test]
fn the_disruption_budget_takes_one_of_its_two_forms() {
    let yaml = crd_yaml();
    assert!(yaml.contains("set one of minAvailable and maxUnavailable"));
    let spec: AgentClusterSpec = serde_json::from_value(serde_json::json!({
        "replicas": 1,
        "template": {},
        "database": { "secretName": "db" }
    }))
    .unwrap();
    assert_eq!(spec.disruption_budget, DisruptionBudgetSpec::default());
    assert!(spec.disruption_budget.enabled, "a budget by default");
    assert!(!spec.topology_spread, "no spread by default");
}
