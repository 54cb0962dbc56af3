//! The AgentCluster the scenarios run: the demo agent, like
//! `charts/leasehold/examples/agentcluster.yaml`, with images from the environment and
//! `imagePullPolicy: Never`.

use std::time::Duration;

use kube::api::ObjectMeta;
use leasehold_crds::{AgentCluster, AgentClusterSpec};
use serde_json::json;

/// The documented default TTL: the scenarios compare recovery against it.
pub const LEASE_TTL: Duration = Duration::from_secs(15);
/// The spec's heartbeat interval: a node lease is renewed this often.
pub const HEARTBEAT: Duration = Duration::from_secs(5);
/// The soonest a session can come free by its owner's lease lapsing (the owner renewed
/// at most one heartbeat before it stopped): a session served elsewhere sooner than this
/// after its owner went away was freed on purpose (handed back or revoked), and one
/// that waited this long may have been left to lapse. The scenarios' recovery bounds.
pub const SHORTEST_LAPSE: Duration = LEASE_TTL.saturating_sub(HEARTBEAT);
/// The Secret and key holding the database URL.
pub const DB_SECRET: &str = "leasehold-db";
pub const DB_KEY: &str = "DATABASE_URL";
/// The agent container's name.
pub const AGENT_CONTAINER: &str = "agent";

/// The agent container, with extra environment variables.
pub fn agent_container(image: &str, env: &[(&str, &str)]) -> serde_json::Value {
    let env: Vec<serde_json::Value> = env.iter().map(|(k, v)| json!({ "name": k, "value": v })).collect();
    json!({
        "name": AGENT_CONTAINER,
        "image": image,
        "imagePullPolicy": "Never",
        "args": ["--listen", "127.0.0.1:3000"],
        "ports": [{ "containerPort": 3000, "name": "agent" }],
        "env": env,
    })
}

/// The spec as JSON (tests of the CEL rules edit it before sending).
pub fn spec_json(agent_image: &str, replicas: i32) -> serde_json::Value {
    json!({
        "replicas": replicas,
        "template": { "spec": { "containers": [agent_container(agent_image, &[])] } },
        "agentPort": 3000,
        "sidecar": {
            "leaseTtl": format!("{}s", LEASE_TTL.as_secs()),
            "heartbeatInterval": format!("{}s", HEARTBEAT.as_secs()),
            "drainTimeout": "10s",
            "logLevel": "info"
        },
        "database": { "secretName": DB_SECRET, "key": DB_KEY },
        "service": { "type": "ClusterIP", "port": 80 },
        "rollout": { "maxSurge": 1, "maxUnavailable": 0 }
    })
}

/// An AgentCluster named `name` from a spec in JSON.
pub fn agent_cluster(name: &str, spec: serde_json::Value) -> AgentCluster {
    let spec: AgentClusterSpec = serde_json::from_value(spec).expect("a well-typed AgentCluster spec");
    AgentCluster {
        metadata: ObjectMeta { name: Some(name.to_owned()), ..ObjectMeta::default() },
        spec,
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_takes_the_documented_timings_and_never_pulls() {
        let ac = agent_cluster("agents", spec_json("leasehold/demo-agent:e2e", 3));
        assert_eq!(ac.spec.replicas, 3);
        assert_eq!(ac.spec.sidecar.lease_ttl, "15s");
        assert_eq!(humantime_secs(&ac.spec.sidecar.lease_ttl), LEASE_TTL.as_secs());
        let pod = ac.spec.template.spec.unwrap();
        assert_eq!(pod.containers[0].image_pull_policy.as_deref(), Some("Never"));
        assert_eq!(pod.containers[0].image.as_deref(), Some("leasehold/demo-agent:e2e"));
        assert_eq!(ac.spec.database.secret_name, DB_SECRET);
    }

    fn humantime_secs(s: &str) -> u64 {
        s.trim_end_matches('s').parse().unwrap()
    }

    #[test]
    fn extra_env_reaches_the_container() {
        let c = agent_container("img", &[("E2E_ROLL", "1")]);
        assert_eq!(c["env"], json!([{ "name": "E2E_ROLL", "value": "1" }]));
    }
}
