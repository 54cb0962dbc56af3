//! The pure `build` step from YAML fixtures: no client, no cluster.

use std::time::Duration;

use k8s_openapi::{api::core::v1::Container, apimachinery::pkg::util::intstr::IntOrString};
use leasehold_crds::{AgentCluster, Multitask};
use leasehold_operator::{
    build::{self, CLUSTER_LABEL, TEMPLATE_HASH},
    cluster_keys::{ClusterKeys, SECRET_VERSION},
    validate::{validate, Timings, MIN_ANSWER_RETENTION, SIDECAR_CONTAINER},
};

const IMAGE: &str = "leasehold/sidecar:default";
/// A cluster-secret version, as the reconcile computes it from the Secret.
const VERSION: &str = "0123456789abcdef";

fn fixture(name: &str) -> AgentCluster {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn sidecar_of(d: &k8s_openapi::api::apps::v1::Deployment) -> Container {
    let pod = d.spec.template.spec.as_ref().unwrap();
    pod.init_containers.iter().flatten().find(|c| c.name == SIDECAR_CONTAINER).unwrap().clone()
}

fn env_value(c: &Container, name: &str) -> Option<String> {
    c.env.as_ref().unwrap().iter().find(|e| e.name == name).and_then(|e| e.value.clone())
}

fn env<'a>(c: &'a Container, name: &str) -> &'a k8s_openapi::api::core::v1::EnvVar {
    c.env.as_ref().unwrap().iter().find(|e| e.name == name).unwrap_or_else(|| panic!("env {name}"))
}

/// The Secret key an env var of `c` is taken from.
fn secret_ref<'a>(c: &'a Container, name: &str) -> &'a k8s_openapi::api::core::v1::SecretKeySelector {
    env(c, name).value_from.as_ref().unwrap().secret_key_ref.as_ref().unwrap()
}

#[test]
fn the_deployment_injects_the_sidecar_and_drain_hooks() {
    let ac = fixture("basic.yaml");
    let timings = validate(&ac.spec).unwrap();
    assert_eq!(
        timings,
        Timings {
            lease_ttl: Duration::from_secs(15),
            heartbeat: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(25),
            session_retention: Duration::from_secs(720 * 3600),
            answer_retention: Duration::from_secs(24 * 3600),
        }
    );
    let d = build::deployment(&ac, &timings, IMAGE, VERSION);
    assert_eq!(d.metadata.name.as_deref(), Some("chat"));
    assert_eq!(d.metadata.namespace.as_deref(), Some("team-a"));
    let owner = &d.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.controller),
        ("AgentCluster", "chat", Some(true))
    );
    assert_eq!(d.spec.replicas, Some(3));
    let rolling = d.spec.strategy.as_ref().unwrap().rolling_update.as_ref().unwrap();
    assert_eq!(rolling.max_surge, Some(IntOrString::String("25%".into())));
    assert_eq!(rolling.max_unavailable, Some(IntOrString::Int(0)));

    let template = &d.spec.template;
    let labels = template.metadata.as_ref().unwrap().labels.as_ref().unwrap();
    assert_eq!(labels.get("team").map(String::as_str), Some("a"), "user labels kept");
    assert_eq!(labels.get(CLUSTER_LABEL).map(String::as_str), Some("chat"));
    assert_eq!(
        d.spec.selector.match_labels.as_ref().unwrap().get(CLUSTER_LABEL).map(String::as_str),
        Some("chat")
    );
    let pod = template.spec.as_ref().unwrap();
    assert_eq!(pod.termination_grace_period_seconds, Some(25 + build::GRACE_MARGIN_SECS));
    // The margin covers the sidecar's exit after the drain (its wait for quiet, its shutdown).
    let after_drain = leasehold_core::lifecycle::MAX_EXIT_AFTER_DRAIN;
    assert!(after_drain.as_secs_f64() < build::GRACE_MARGIN_SECS as f64, "{after_drain:?}");
    let names: Vec<_> = pod.containers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["agent"], "the sidecar is not a regular container");
    let init: Vec<_> = pod.init_containers.iter().flatten().map(|c| c.name.as_str()).collect();
    assert_eq!(init, [SIDECAR_CONTAINER], "a native sidecar");
    // The agent waits for the drain (without a token, GET /drained starts nothing); the
    // sidecar drains itself with the signed drain command when it stops.
    let pre_stop = |c: &k8s_openapi::api::core::v1::Container| c.lifecycle.clone().unwrap().pre_stop.unwrap();
    let hook = pre_stop(&pod.containers[0]).http_get.unwrap();
    assert_eq!((hook.path.as_deref(), &hook.port), (Some("/drained"), &IntOrString::Int(9090)));
    assert_eq!(hook.http_headers, None, "no drain-hook token without the cluster keys");
    let sidecar = &pod.init_containers.as_ref().unwrap()[0];
    let command = pre_stop(sidecar).exec.unwrap().command.unwrap();
    assert_eq!(command, [build::SIDECAR_BINARY, "drain"]);
    assert_eq!(sidecar.image.as_deref(), Some("leasehold/sidecar:9.9"), "the spec's image wins");
    assert_eq!(env(sidecar, "LEASEHOLD_AGENT_URL").value.as_deref(), Some("http://127.0.0.1:3000"));
    assert_eq!(env(sidecar, "LEASEHOLD_LEASE_TTL").value.as_deref(), Some("15s"));
    assert_eq!(env(sidecar, "LEASEHOLD_HEARTBEAT_INTERVAL").value.as_deref(), Some("5s"));
    assert_eq!(env(sidecar, "LEASEHOLD_DRAIN_TIMEOUT").value.as_deref(), Some("25s"));
    assert_eq!(env(sidecar, "LEASEHOLD_LOG").value.as_deref(), Some("debug"));
    let pod_name = env(sidecar, "POD_NAME").value_from.as_ref().unwrap().field_ref.as_ref().unwrap();
    assert_eq!(pod_name.field_path, "metadata.name");
    let pod_ip = env(sidecar, "POD_IP").value_from.as_ref().unwrap().field_ref.as_ref().unwrap();
    assert_eq!(pod_ip.field_path, "status.podIP");
    let db = secret_ref(sidecar, "DATABASE_URL");
    assert_eq!((db.name.as_str(), db.key.as_str()), ("chat-db", "DATABASE_URL"));
    let secret = secret_ref(sidecar, "LEASEHOLD_CLUSTER_SECRET");
    assert_eq!((secret.name.as_str(), secret.key.as_str()), ("chat-cluster-secret", "cluster-secret"));
    assert_eq!(secret.optional, None, "the current secret is required");
    let previous = secret_ref(sidecar, "LEASEHOLD_CLUSTER_SECRET_PREVIOUS");
    assert_eq!(
        (previous.name.as_str(), previous.key.as_str(), previous.optional),
        ("chat-cluster-secret", "cluster-secret-previous", Some(true)),
        "the previous secret is there only during a rotation"
    );
    let annotations = template.metadata.as_ref().unwrap().annotations.as_ref().unwrap();
    assert_eq!(annotations.get(SECRET_VERSION).map(String::as_str), Some(VERSION));
    let ready = sidecar.readiness_probe.as_ref().unwrap().http_get.as_ref().unwrap();
    assert_eq!(ready.path.as_deref(), Some("/readyz"));
    let live = sidecar.liveness_probe.as_ref().unwrap().http_get.as_ref().unwrap();
    assert_eq!(live.path.as_deref(), Some("/healthz"));
    let security = sidecar.security_context.as_ref().unwrap();
    assert_eq!((security.run_as_non_root, security.read_only_root_filesystem), (Some(true), Some(true)));
}

#[test]
fn a_spec_change_changes_the_template_hash_so_the_deployment_rolls() {
    let ac = fixture("basic.yaml");
    let timings = validate(&ac.spec).unwrap();
    let hash = |ac: &AgentCluster| {
        let d = build::deployment(ac, &timings, IMAGE, VERSION);
        d.spec.template.metadata.unwrap().annotations.unwrap()[TEMPLATE_HASH].clone()
    };
    let before = hash(&ac);
    assert_eq!(before, hash(&ac), "stable for the same spec");
    let mut changed = ac.clone();
    let pod = changed.spec.template.spec.as_mut().unwrap();
    pod.containers[0].env = Some(vec![k8s_openapi::api::core::v1::EnvVar {
        name: "MODEL".into(),
        value: Some("bigger".into()),
        ..Default::default()
    }]);
    assert_ne!(before, hash(&changed), "an env var change rolls");
    let mut scaled = ac.clone();
    scaled.spec.replicas = 7;
    assert_eq!(before, hash(&scaled), "scaling does not roll the pods");
}

/// A rotation changes the Secret's values, not the spec: the version annotation is what
/// rolls the pods, and it is the only thing that changes.
#[test]
fn a_new_cluster_secret_value_rolls_the_pods() {
    let ac = fixture("basic.yaml");
    let timings = validate(&ac.spec).unwrap();
    let template =
        |keys: &ClusterKeys| build::deployment(&ac, &timings, IMAGE, &keys.version()).spec.template;
    let before = template(&ClusterKeys::new("old".into(), None));
    let rotating = template(&ClusterKeys::new("new".into(), Some("old".into())));
    assert_ne!(before, rotating);
    let annotations = |t: &k8s_openapi::api::core::v1::PodTemplateSpec| {
        let mut a = t.metadata.as_ref().unwrap().annotations.clone().unwrap();
        a.remove(SECRET_VERSION);
        a
    };
    assert_eq!(annotations(&before), annotations(&rotating));
    assert_eq!(before.spec, rotating.spec, "only the annotation differs");
}

#[test]
fn existing_hooks_grace_and_named_secrets_are_respected() {
    let ac = fixture("custom-secret-long-grace.yaml");
    let timings = validate(&ac.spec).unwrap();
    let d = build::deployment(&ac, &timings, IMAGE, VERSION);
    let pod = d.spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.termination_grace_period_seconds, Some(600), "a longer user grace period is kept");
    let worker = &pod.containers[0];
    assert!(worker.lifecycle.as_ref().unwrap().post_start.is_some(), "the user's postStart hook is kept");
    assert!(worker.lifecycle.as_ref().unwrap().pre_stop.is_some());
    assert!(pod.containers[1].lifecycle.as_ref().unwrap().pre_stop.is_some(), "every agent container");
    let sidecar = &sidecar_of(&d);
    assert_eq!(sidecar.image.as_deref(), Some(IMAGE), "the operator's default image");
    let db = env(sidecar, "DATABASE_URL").value_from.as_ref().unwrap().secret_key_ref.as_ref().unwrap();
    assert_eq!((db.name.as_str(), db.key.as_str()), ("pg", "URL"));
    let secret = env(sidecar, "LEASEHOLD_CLUSTER_SECRET")
        .value_from
        .as_ref()
        .unwrap()
        .secret_key_ref
        .as_ref()
        .unwrap();
    assert_eq!((secret.name.as_str(), secret.key.as_str()), ("shared-secret", "token"));
}

#[test]
fn service_pdb_and_network_policy() {
    let ac = fixture("basic.yaml");
    let svc = build::service(&ac).spec.unwrap();
    assert_eq!(svc.type_.as_deref(), Some("LoadBalancer"));
    let port = &svc.ports.as_ref().unwrap()[0];
    assert_eq!((port.port, &port.target_port), (443, &Some(IntOrString::String("public".into()))));
    assert_eq!(svc.selector.as_ref().unwrap().get(CLUSTER_LABEL).map(String::as_str), Some("chat"));

    let pdb = build::pod_disruption_budget(&ac).unwrap().spec.unwrap();
    assert_eq!((pdb.max_unavailable, pdb.min_available), (Some(IntOrString::Int(1)), None));

    let callers = build::AdminCallers { operator_namespace: "leasehold-system".into(), ..Default::default() };
    let np = build::network_policy(&ac, &callers).spec.unwrap();
    let rules = np.ingress.unwrap();
    let peer = rules
        .iter()
        .find(|r| r.ports.as_ref().unwrap().iter().any(|p| p.port == Some(IntOrString::Int(8081))))
        .unwrap();
    let from = peer.from.as_ref().expect("the peer port is restricted");
    let selector = from[0].pod_selector.as_ref().unwrap().match_labels.as_ref().unwrap();
    assert_eq!(selector.get(CLUSTER_LABEL).map(String::as_str), Some("chat"), "only this cluster's pods");
    assert!(from[0].namespace_selector.is_none(), "and only from this namespace");
    let open: Vec<_> =
        rules.iter().filter(|r| r.from.is_none()).flat_map(|r| r.ports.clone().unwrap()).collect();
    let open_ports: Vec<_> = open.iter().map(|p| p.port.clone().unwrap()).collect();
    assert_eq!(
        open_ports,
        [IntOrString::Int(8080)],
        "only the public port is open; the agent port is closed"
    );
    let admin_from = |np: k8s_openapi::api::networking::v1::NetworkPolicySpec| {
        let rules = np.ingress.unwrap();
        let admin = rules
            .iter()
            .find(|r| r.ports.as_ref().unwrap().iter().any(|p| p.port == Some(IntOrString::Int(9090))))
            .expect("an admin rule");
        admin.from.clone().expect("the admin port is restricted")
    };
    let from = admin_from(build::network_policy(&ac, &callers).spec.unwrap());
    assert_eq!(from.len(), 1, "only the operator without a monitoring selector");
    let ns = from[0].namespace_selector.as_ref().unwrap().match_labels.as_ref().unwrap();
    assert_eq!(ns.get("kubernetes.io/metadata.name").map(String::as_str), Some("leasehold-system"));
    let pods = from[0].pod_selector.as_ref().unwrap().match_labels.as_ref().unwrap();
    assert_eq!(
        pods.get(build::OPERATOR_ROLE_LABEL.0).map(String::as_str),
        Some(build::OPERATOR_ROLE_LABEL.1)
    );

    let monitoring = build::AdminCallers {
        monitoring_namespaces: Some([("team".to_owned(), "observability".to_owned())].into()),
        monitoring_pods: Some([("app".to_owned(), "prometheus".to_owned())].into()),
        ..callers
    };
    let from = admin_from(build::network_policy(&ac, &monitoring).spec.unwrap());
    assert_eq!(from.len(), 2, "the operator and the monitoring stack");
    let prometheus = from[1].pod_selector.as_ref().unwrap().match_labels.as_ref().unwrap();
    assert_eq!(prometheus.get("app").map(String::as_str), Some("prometheus"));
    let ns = from[1].namespace_selector.as_ref().unwrap().match_labels.as_ref().unwrap();
    assert_eq!(ns.get("team").map(String::as_str), Some("observability"));
}

#[test]
fn the_generated_cluster_secret_is_random_and_owned() {
    let ac = fixture("basic.yaml");
    let (a, b) = (build::cluster_secret(&ac), build::cluster_secret(&ac));
    assert_eq!(a.metadata.name.as_deref(), Some("chat-cluster-secret"));
    assert!(a.metadata.owner_references.is_some());
    let value =
        |s: &k8s_openapi::api::core::v1::Secret| s.string_data.as_ref().unwrap()["cluster-secret"].clone();
    assert_eq!(value(&a).len(), 64);
    assert_ne!(value(&a), value(&b));
}

#[test]
fn invalid_specs_report_every_problem() {
    let ac = fixture("invalid.yaml");
    let problems = validate(&ac.spec).unwrap_err();
    let all = problems.join("\n");
    for expected in [
        "spec.replicas",
        "spec.agentPort",
        "drainTimeout",
        "reserved for the sidecar",
        "collides",
        "spec.turns.answerRetention",
        "spec.turns.queueLimit",
    ] {
        assert!(all.contains(expected), "missing {expected:?} in:\n{all}");
    }
    let mut hb = fixture("basic.yaml");
    hb.spec.sidecar.heartbeat_interval = "8s".into();
    assert!(validate(&hb.spec).unwrap_err()[0].contains("less than half"));
    let mut short = fixture("basic.yaml");
    short.spec.session_retention = "30m".into();
    assert_eq!(validate(&short.spec).unwrap_err(), ["spec.sessionRetention must be at least 1h"]);
    short.spec.session_retention = "soon".into();
    assert!(validate(&short.spec).unwrap_err()[0].starts_with("spec.sessionRetention: \"soon\""));
}

/// `spec.turns` reaches the sidecar as its flags' env: the documented defaults when the
/// spec says nothing (and no max answer size, so the sidecar's own applies), the spec's
/// values when it does.
#[test]
fn the_sidecar_gets_the_turn_settings_as_env() {
    let ac = fixture("basic.yaml");
    let timings = validate(&ac.spec).unwrap();
    let sidecar = sidecar_of(&build::deployment(&ac, &timings, IMAGE, VERSION));
    assert_eq!(env_value(&sidecar, "LEASEHOLD_MULTITASK").as_deref(), Some("enqueue"));
    assert_eq!(env_value(&sidecar, "LEASEHOLD_QUEUE_LIMIT").as_deref(), Some("16"));
    assert!(
        !sidecar.env.as_ref().unwrap().iter().any(|e| e.name == "LEASEHOLD_MAX_ANSWER_BYTES"),
        "unset: the sidecar's default"
    );
    assert_eq!(env_value(&sidecar, "LEASEHOLD_MAX_TURN_ATTEMPTS"), None, "unset: the sidecar's default");
    assert_eq!(timings.answer_retention, Duration::from_secs(24 * 3600), "answerRetention defaults to 24h");

    for (policy, value) in
        [(Multitask::Enqueue, "enqueue"), (Multitask::Reject, "reject"), (Multitask::Interrupt, "interrupt")]
    {
        let mut set = ac.clone();
        set.spec.turns.multitask = policy;
        set.spec.turns.queue_limit = 250;
        set.spec.turns.max_answer_bytes = Some(65_536);
        set.spec.turns.max_attempts = Some(7);
        let timings = validate(&set.spec).unwrap();
        let sidecar = sidecar_of(&build::deployment(&set, &timings, IMAGE, VERSION));
        assert_eq!(env_value(&sidecar, "LEASEHOLD_MULTITASK").as_deref(), Some(value));
        assert_eq!(env_value(&sidecar, "LEASEHOLD_QUEUE_LIMIT").as_deref(), Some("250"));
        assert_eq!(env_value(&sidecar, "LEASEHOLD_MAX_ANSWER_BYTES").as_deref(), Some("65536"));
        assert_eq!(env_value(&sidecar, "LEASEHOLD_MAX_TURN_ATTEMPTS").as_deref(), Some("7"));
        let names: Vec<_> = sidecar.env.as_ref().unwrap().iter().map(|e| e.name.as_str()).collect();
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "each variable once: {names:?}");
    }
}

/// `spec.sidecar.forwardHeaders` reaches the sidecar as `LEASEHOLD_FORWARD_HEADERS`,
/// exactly as written (an empty list too); unset, the variable is absent and the sidecar's
/// own default applies.
#[test]
fn the_sidecar_gets_the_forwarded_headers_as_env_only_when_set() {
    let ac = fixture("basic.yaml");
    let timings = validate(&ac.spec).unwrap();
    let sidecar = sidecar_of(&build::deployment(&ac, &timings, IMAGE, VERSION));
    assert_eq!(env_value(&sidecar, "LEASEHOLD_FORWARD_HEADERS"), None, "unset: the sidecar's default");
    for list in ["X-Tenant,Authorization", ""] {
        let mut set = ac.clone();
        set.spec.sidecar.forward_headers = Some(list.to_owned());
        let sidecar = sidecar_of(&build::deployment(&set, &timings, IMAGE, VERSION));
        assert_eq!(env_value(&sidecar, "LEASEHOLD_FORWARD_HEADERS").as_deref(), Some(list));
    }
}

/// `spec.sidecar.connectionLiveness` becomes `LEASEHOLD_CONNECTION_LIVENESS` only when set.
#[test]
fn the_sidecar_gets_connection_liveness_as_env_only_when_set() {
    let ac = fixture("basic.yaml");
    let timings = validate(&ac.spec).unwrap();
    let sidecar = sidecar_of(&build::deployment(&ac, &timings, IMAGE, VERSION));
    assert_eq!(env_value(&sidecar, "LEASEHOLD_CONNECTION_LIVENESS"), None, "unset: the sidecar's default");
    for on in [false, true] {
        let mut set = ac.clone();
        set.spec.sidecar.connection_liveness = Some(on);
        let sidecar = sidecar_of(&build::deployment(&set, &timings, IMAGE, VERSION));
        assert_eq!(env_value(&sidecar, "LEASEHOLD_CONNECTION_LIVENESS"), Some(on.to_string()));
    }
}

/// `spec.sidecar.logFormat` becomes `LEASEHOLD_LOG_FORMAT` only when set.
#[test]
fn the_sidecar_gets_the_log_format_as_env_only_when_set() {
    let ac = fixture("basic.yaml");
    let timings = validate(&ac.spec).unwrap();
    let sidecar = sidecar_of(&build::deployment(&ac, &timings, IMAGE, VERSION));
    assert_eq!(env_value(&sidecar, "LEASEHOLD_LOG_FORMAT"), None, "unset: the sidecar's default");
    let mut set = ac.clone();
    set.spec.sidecar.log_format = Some("json".to_owned());
    let sidecar = sidecar_of(&build::deployment(&set, &timings, IMAGE, VERSION));
    assert_eq!(env_value(&sidecar, "LEASEHOLD_LOG_FORMAT").as_deref(), Some("json"));
}

/// What the sidecar reads rolls the pods (the pod template and its hash change); the
/// answer retention is the operator's alone and leaves the template as it was.
#[test]
fn turn_settings_roll_the_pods_and_answer_retention_does_not() {
    let ac = fixture("basic.yaml");
    let template = |ac: &AgentCluster| {
        let timings = validate(&ac.spec).unwrap();
        build::deployment(ac, &timings, IMAGE, VERSION).spec.template
    };
    let hash = |t: &k8s_openapi::api::core::v1::PodTemplateSpec| {
        t.metadata.as_ref().unwrap().annotations.as_ref().unwrap()[TEMPLATE_HASH].clone()
    };
    let before = template(&ac);
    type Change = fn(&mut AgentCluster);
    let changes: [(&str, Change); 4] = [
        ("multitask", |ac| ac.spec.turns.multitask = Multitask::Interrupt),
        ("queueLimit", |ac| ac.spec.turns.queue_limit = 17),
        ("maxAnswerBytes", |ac| ac.spec.turns.max_answer_bytes = Some(1024)),
        ("maxAttempts", |ac| ac.spec.turns.max_attempts = Some(2)),
    ];
    for (field, change) in changes {
        let mut changed = ac.clone();
        change(&mut changed);
        let after = template(&changed);
        assert_ne!(before.spec, after.spec, "{field}: the sidecar's env changes");
        assert_ne!(hash(&before), hash(&after), "{field}: the template hash changes");
    }
    let mut kept = ac.clone();
    kept.spec.turns.answer_retention = "1h".into();
    assert_eq!(validate(&kept.spec).unwrap().answer_retention, Duration::from_secs(3600));
    assert_eq!(before, template(&kept), "answerRetention does not roll the pods");
}

#[test]
fn invalid_turn_settings_are_named() {
    let base = fixture("basic.yaml");
    let problems = |change: &dyn Fn(&mut AgentCluster)| {
        let mut ac = base.clone();
        change(&mut ac);
        validate(&ac.spec).unwrap_err()
    };
    assert_eq!(
        problems(&|ac| ac.spec.turns.answer_retention = "4m".into()),
        ["spec.turns.answerRetention must be at least 5m"]
    );
    let soon = problems(&|ac| ac.spec.turns.answer_retention = "soon".into());
    assert!(soon[0].starts_with("spec.turns.answerRetention: \"soon\""), "{soon:?}");
    for limit in [0, -1, 10_001] {
        let found = problems(&|ac| ac.spec.turns.queue_limit = limit);
        assert!(found[0].starts_with(&format!("spec.turns.queueLimit: {limit} ")), "{found:?}");
    }
    for bytes in [0, (1 << 30) + 1] {
        let found = problems(&|ac| ac.spec.turns.max_answer_bytes = Some(bytes));
        assert!(found[0].starts_with(&format!("spec.turns.maxAnswerBytes: {bytes} ")), "{found:?}");
    }
    for attempts in [0, 1001] {
        let found = problems(&|ac| ac.spec.turns.max_attempts = Some(attempts));
        assert!(found[0].starts_with(&format!("spec.turns.maxAttempts: {attempts} ")), "{found:?}");
    }
    // The bounds that pass: 1 and 10000, 5m, 1 byte and 1 GiB, 1 and 1000 attempts.
    let mut edge = base.clone();
    edge.spec.turns.queue_limit = 10_000;
    edge.spec.turns.answer_retention = "5m".into();
    edge.spec.turns.max_answer_bytes = Some(1 << 30);
    edge.spec.turns.max_attempts = Some(1000);
    assert!(validate(&edge.spec).is_ok());
    edge.spec.turns.queue_limit = 1;
    edge.spec.turns.max_answer_bytes = Some(1);
    edge.spec.turns.max_attempts = Some(1);
    assert!(validate(&edge.spec).is_ok());
    // The operator's minimum and the CRD's CEL rule say the same.
    assert_eq!(MIN_ANSWER_RETENTION, Duration::from_secs(300));
    assert!(leasehold_crds::crd_yaml().contains("duration(self) >= duration('5m')"));
}

#[test]
fn the_database_ca_secret_is_mounted_read_only_into_the_sidecar_and_named_by_pgsslrootcert() {
    let mut ac = fixture("basic.yaml");
    let timings = validate(&ac.spec).unwrap();
    let plain = build::deployment(&ac, &timings, IMAGE, VERSION);
    let plain_pod = plain.spec.template.spec.as_ref().unwrap();
    assert_eq!(plain_pod.volumes, None, "no CA, no volume");
    assert!(sidecar_of(&plain).volume_mounts.is_none());
    assert_eq!(env_value(&sidecar_of(&plain), "PGSSLROOTCERT"), None);

    // The key defaults to ca.crt (cert-manager's); here the Secret names another.
    let database: leasehold_crds::DatabaseRef =
        serde_json::from_value(serde_json::json!({"secretName": "chat-db", "caSecret": {"secretName": "x"}}))
            .unwrap();
    assert_eq!(database.ca_secret.unwrap().key, "ca.crt");
    ac.spec.database.ca_secret =
        Some(leasehold_crds::CaSecretRef { secret_name: "chat-db-ca".into(), key: "root.pem".into() });
    let d = build::deployment(&ac, &timings, IMAGE, VERSION);
    let pod = d.spec.template.spec.as_ref().unwrap();
    let volumes = pod.volumes.as_ref().expect("the CA volume");
    assert_eq!(volumes.len(), 1);
    let secret = volumes[0].secret.as_ref().unwrap();
    assert_eq!(secret.secret_name.as_deref(), Some("chat-db-ca"));
    let item = &secret.items.as_ref().unwrap()[0];
    assert_eq!((item.key.as_str(), item.path.as_str()), ("root.pem", build::POSTGRES_CA_FILE));

    let sidecar = sidecar_of(&d);
    let mounts = sidecar.volume_mounts.as_ref().expect("the sidecar mounts it");
    assert_eq!(mounts.len(), 1);
    assert_eq!(mounts[0].name, volumes[0].name);
    assert_eq!(mounts[0].mount_path, "/etc/leasehold/postgres-ca");
    assert_eq!(mounts[0].read_only, Some(true));
    assert_eq!(env_value(&sidecar, "PGSSLROOTCERT").as_deref(), Some("/etc/leasehold/postgres-ca/ca.crt"));
    assert_eq!(env_value(&sidecar, "PGSSLMODE").as_deref(), Some("verify-full"));
    let agent = pod.containers.iter().find(|c| c.name == "agent").unwrap();
    assert!(agent.volume_mounts.is_none(), "the agent container does not see it");
    let hash = |d: &k8s_openapi::api::apps::v1::Deployment| {
        d.spec.template.metadata.as_ref().unwrap().annotations.as_ref().unwrap()[TEMPLATE_HASH].clone()
    };
    assert_ne!(hash(&plain), hash(&d), "adding the CA rolls the pods");
}

fn pod_of(d: &k8s_openapi::api::apps::v1::Deployment) -> &k8s_openapi::api::core::v1::PodSpec {
    d.spec.template.spec.as_ref().unwrap()
}

fn pre_stop(c: &Container) -> k8s_openapi::api::core::v1::LifecycleHandler {
    c.lifecycle.clone().unwrap().pre_stop.unwrap()
}

/// The native-sidecar layout: an init container with `restartPolicy: Always` after the
/// user's own init containers, a startup probe, a liveness probe that never asks the
/// database (readiness does), default resources with a memory limit, a RuntimeDefault
/// seccomp profile, and the agents' hooks starting the drain with the cluster's token.
#[test]
fn the_sidecar_is_a_native_sidecar_started_first_and_stopped_last() {
    let mut ac = fixture("basic.yaml");
    let template = ac.spec.template.spec.as_mut().unwrap();
    template.init_containers = Some(vec![Container {
        name: "setup".into(),
        image: Some("example/setup".into()),
        ..Default::default()
    }]);
    let timings = validate(&ac.spec).unwrap();
    let keys = ClusterKeys::new("the-secret".into(), None);
    let d = build::deployment_with_drain_token(&ac, &timings, IMAGE, &keys);
    let pod = pod_of(&d);
    let init: Vec<_> = pod.init_containers.iter().flatten().map(|c| c.name.as_str()).collect();
    assert_eq!(init, ["setup", SIDECAR_CONTAINER], "after the user's init containers");
    let sidecar = sidecar_of(&d);
    assert_eq!(sidecar.restart_policy.as_deref(), Some("Always"));
    let startup = sidecar.startup_probe.as_ref().unwrap();
    assert_eq!(startup.http_get.as_ref().unwrap().path.as_deref(), Some("/healthz"));
    let budget = startup.period_seconds.unwrap() * startup.failure_threshold.unwrap();
    assert!(budget >= 120, "the database may be down for minutes at pod start: {budget} s");
    let live = sidecar.liveness_probe.as_ref().unwrap().http_get.as_ref().unwrap();
    assert_eq!(live.path.as_deref(), Some("/healthz"), "liveness never depends on the database");
    let ready = sidecar.readiness_probe.as_ref().unwrap().http_get.as_ref().unwrap();
    assert_eq!(ready.path.as_deref(), Some("/readyz"));
    let resources = sidecar.resources.as_ref().unwrap();
    let requests = resources.requests.as_ref().unwrap();
    assert!(requests.contains_key("cpu") && requests.contains_key("memory"), "{requests:?}");
    assert_eq!(resources.limits.as_ref().unwrap()["memory"].0, "256Mi");
    assert!(!resources.limits.as_ref().unwrap().contains_key("cpu"), "no CPU throttling of drains");
    let security = sidecar.security_context.as_ref().unwrap();
    assert_eq!(security.seccomp_profile.as_ref().unwrap().type_, "RuntimeDefault");
    assert_eq!(security.capabilities.as_ref().unwrap().drop, Some(vec!["ALL".to_owned()]));
    assert_eq!(security.allow_privilege_escalation, Some(false));
    // The agent's hook starts the drain: the token of the current secret, in a header.
    let hook = pre_stop(&pod.containers[0]).http_get.unwrap();
    let headers = hook.http_headers.unwrap();
    assert_eq!(headers[0].name, leasehold_core::proof::DRAIN_HOOK_HEADER);
    let no_user_hook = leasehold_core::proof::DrainThen::default();
    assert_eq!(headers[0].value, leasehold_core::proof::drain_hook_token("the-secret", &no_user_hook));
    assert!(!headers[0].value.contains("the-secret"));
    // The spec's resources replace the default.
    let mut sized = ac.clone();
    sized.spec.sidecar.resources = Some(k8s_openapi::api::core::v1::ResourceRequirements {
        limits: Some(
            [("memory".to_owned(), k8s_openapi::apimachinery::pkg::api::resource::Quantity("1Gi".into()))]
                .into(),
        ),
        ..Default::default()
    });
    let sized = sidecar_of(&build::deployment(&sized, &timings, IMAGE, VERSION));
    assert_eq!(sized.resources.as_ref().unwrap().limits.as_ref().unwrap()["memory"].0, "1Gi");
    assert_eq!(sized.resources.as_ref().unwrap().requests, None);
}

/// A user's own preStop hook is kept: a GET on the agent's port or a sleep runs after the
/// drain (the sidecar carries it out, the grace period grows by the sleep); an exec hook
/// stays on its container as it is.
#[test]
fn a_users_pre_stop_hook_runs_after_the_drain_or_is_kept() {
    use k8s_openapi::api::core::v1::{
        ContainerPort, ExecAction, HTTPGetAction, Lifecycle, LifecycleHandler, SleepAction,
    };
    let mut ac = fixture("basic.yaml");
    let hooked = |name: &str, hook: LifecycleHandler, ports: Option<Vec<ContainerPort>>| Container {
        name: name.into(),
        image: Some("example/agent".into()),
        ports,
        lifecycle: Some(Lifecycle { pre_stop: Some(hook), ..Default::default() }),
        ..Default::default()
    };
    let get = LifecycleHandler {
        http_get: Some(HTTPGetAction {
            path: Some("/flush?why=stop now".into()),
            port: IntOrString::String("http".into()),
            ..Default::default()
        }),
        ..Default::default()
    };
    let port = ContainerPort { name: Some("http".into()), container_port: 3000, ..Default::default() };
    let sleep = LifecycleHandler { sleep: Some(SleepAction { seconds: 7 }), ..Default::default() };
    let exec = LifecycleHandler {
        exec: Some(ExecAction { command: Some(vec!["/bin/flush".into()]) }),
        ..Default::default()
    };
    ac.spec.template.spec.as_mut().unwrap().containers = vec![
        hooked("getter", get, Some(vec![port])),
        hooked("sleeper", sleep, None),
        hooked("execer", exec.clone(), None),
    ];
    let timings = validate(&ac.spec).unwrap();
    // Without the cluster secret no token can cover a user's hook: each stays as it was.
    let tokenless = build::deployment(&ac, &timings, IMAGE, VERSION);
    let originals = &ac.spec.template.spec.as_ref().unwrap().containers;
    for (built, original) in pod_of(&tokenless).containers.iter().zip(originals) {
        assert_eq!(built.lifecycle, original.lifecycle, "{} kept without a token", built.name);
    }
    let keys = ClusterKeys::new("the-secret".into(), None);
    let d = build::deployment_with_drain_token(&ac, &timings, IMAGE, &keys);
    let pod = pod_of(&d);
    let path = |c: &Container| pre_stop(c).http_get.unwrap().path.unwrap();
    assert_eq!(path(&pod.containers[0]), "/drained?then_port=3000&then_path=%2Fflush%3Fwhy%3Dstop%20now");
    assert_eq!(path(&pod.containers[1]), "/drained?then_sleep=7");
    assert_eq!(pre_stop(&pod.containers[2]), exec, "an exec hook is kept as it is");
    // Each hook's token covers its own user hook, and only it.
    use leasehold_core::proof::{drain_hook_token, DrainThen};
    let token = |c: &Container| pre_stop(c).http_get.unwrap().http_headers.unwrap()[0].value.clone();
    let get = DrainThen { port: Some(3000), path: Some("/flush?why=stop now".into()), sleep: None };
    let sleep = DrainThen { sleep: Some(7), ..Default::default() };
    assert_eq!(token(&pod.containers[0]), drain_hook_token("the-secret", &get));
    assert_eq!(token(&pod.containers[1]), drain_hook_token("the-secret", &sleep));
    assert_ne!(token(&pod.containers[0]), token(&pod.containers[1]));
    assert_eq!(
        pod.termination_grace_period_seconds,
        Some(25 + build::GRACE_MARGIN_SECS + 7),
        "the grace period covers the drain and the user's sleep"
    );
    assert_eq!(build::user_hook(&pod.containers[2]), build::UserHook::Kept);
}

#[test]
fn topology_spread_and_the_disruption_budget_follow_the_spec() {
    let mut ac = fixture("basic.yaml");
    let timings = validate(&ac.spec).unwrap();
    let plain = build::deployment(&ac, &timings, IMAGE, VERSION);
    assert_eq!(pod_of(&plain).topology_spread_constraints, None, "no spread unless asked");
    ac.spec.topology_spread = true;
    let spread = build::deployment(&ac, &timings, IMAGE, VERSION);
    let constraint = &pod_of(&spread).topology_spread_constraints.as_ref().unwrap()[0];
    assert_eq!(constraint.topology_key, "kubernetes.io/hostname");
    assert_eq!((constraint.max_skew, constraint.when_unsatisfiable.as_str()), (1, "ScheduleAnyway"));
    let selector = constraint.label_selector.as_ref().unwrap().match_labels.as_ref().unwrap();
    assert_eq!(selector.get(CLUSTER_LABEL).map(String::as_str), Some("chat"));
    let hash = |d: &k8s_openapi::api::apps::v1::Deployment| {
        d.spec.template.metadata.as_ref().unwrap().annotations.as_ref().unwrap()[TEMPLATE_HASH].clone()
    };
    assert_ne!(hash(&plain), hash(&spread), "turning the spread on rolls the pods");

    ac.spec.disruption_budget.min_available = Some(IntOrString::String("50%".into()));
    let pdb = build::pod_disruption_budget(&ac).unwrap().spec.unwrap();
    assert_eq!((pdb.max_unavailable, pdb.min_available), (None, Some(IntOrString::String("50%".into()))));
    ac.spec.disruption_budget.min_available = None;
    ac.spec.disruption_budget.max_unavailable = Some(IntOrString::Int(2));
    let pdb = build::pod_disruption_budget(&ac).unwrap().spec.unwrap();
    assert_eq!((pdb.max_unavailable, pdb.min_available), (Some(IntOrString::Int(2)), None));
    ac.spec.disruption_budget.enabled = false;
    assert!(build::pod_disruption_budget(&ac).is_none());
    assert_eq!(build::selector_text(&ac), "leasehold.dev/cluster=chat");
}
