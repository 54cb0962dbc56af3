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

/// The Python reference agent's container (`leasehold/python-agent`): the demo agent's,
/// plus the readiness probe docs/agents-python.md asks for. The interpreter takes about
/// a second to start and the sidecar is Ready at once, so without it a pod would be
/// Ready (and an old pod drained) before its agent accepts connections. The image puts
/// `python3` on PATH; the probe runs every second so a rollout does not wait for it.
pub fn python_agent_container(image: &str, env: &[(&str, &str)]) -> serde_json::Value {
    let mut container = agent_container(image, env);
    container["readinessProbe"] = json!({
        "exec": { "command": [
            "python3", "-c", "import socket; socket.create_connection(('127.0.0.1', 3000), 1).close()"
        ] },
        "periodSeconds": 1,
        "timeoutSeconds": 5,
    });
    container
}

/// The spec as JSON (tests of the CEL rules edit it before sending).
pub fn spec_json(agent_image: &str, replicas: i32) -> serde_json::Value {
    spec_json_with(agent_container(agent_image, &[]), replicas)
}

/// The spec as JSON, with `agent` as the pod's one container.
pub fn spec_json_with(agent: serde_json::Value, replicas: i32) -> serde_json::Value {
    json!({
        "replicas": replicas,
        "template": { "spec": { "containers": [agent] } },
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
    fn the_python_agent_is_probed_on_its_port() {
        let ac = agent_cluster("agents", spec_json_with(python_agent_container("py", &[]), 3));
        let pod = ac.spec.template.spec.unwrap();
        let probe = pod.containers[0].readiness_probe.clone().expect("a readiness probe");
        let command = probe.exec.and_then(|e| e.command).expect("an exec probe");
        assert_eq!(command[0], "python3");
        assert!(command[2].contains("('127.0.0.1', 3000)"), "{command:?}");
        assert_eq!(pod.containers[0].args, Some(vec!["--listen".to_owned(), "127.0.0.1:3000".to_owned()]));
    }

    #[test]
    fn extra_env_reaches_the_container() {
        let c = agent_container("img", &[("E2E_ROLL", "1")]);
        assert_eq!(c["env"], json!([{ "name": "E2E_ROLL", "value": "1" }]));
    }
}
