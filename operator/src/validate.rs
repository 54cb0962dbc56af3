//! Checks the API server cannot make (or that a CRD installed without CEL would miss):
//! an invalid spec marks the cluster `Degraded` and no child is touched.

use std::time::Duration;

use leasehold_crds::{
    AgentClusterSpec, MAX_ANSWER_BYTES_LIMIT, MAX_QUEUE_LIMIT, MAX_TURN_ATTEMPTS, MIN_QUEUE_LIMIT,
};

/// Ports the sidecar listens on inside every pod (CONTRACT §2 defaults).
pub const PUBLIC_PORT: i32 = 8080;
pub const PEER_PORT: i32 = 8081;
pub const AGENT_API_PORT: i32 = 8082;
pub const ADMIN_PORT: i32 = 9090;
pub const SIDECAR_PORTS: [i32; 4] = [PUBLIC_PORT, PEER_PORT, AGENT_API_PORT, ADMIN_PORT];

/// The injected container's name; a user container may not take it.
pub const SIDECAR_CONTAINER: &str = "leasehold-sidecar";

/// The shortest session retention: far longer than any write can be in flight.
pub const MIN_SESSION_RETENTION: Duration = Duration::from_secs(3600);

/// The shortest answer retention: a repeat of an Idempotency-Key must find its answer, and
/// clients re-send a turn for under a minute (the sidecar's retry budgets are 30–45 s).
pub const MIN_ANSWER_RETENTION: Duration = Duration::from_secs(300);

/// The sidecar timings and the retentions, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timings {
    pub lease_ttl: Duration,
    pub heartbeat: Duration,
    pub drain_timeout: Duration,
    pub session_retention: Duration,
    /// `spec.turns.answerRetention`: finished turns older than this are collected.
    pub answer_retention: Duration,
}

fn duration(field: &str, value: &str, problems: &mut Vec<String>) -> Option<Duration> {
    match humantime::parse_duration(value) {
        Ok(d) if !d.is_zero() => Some(d),
        _ => {
            problems.push(format!("spec.{field}: {value:?} is not a positive duration (e.g. 15s, 500ms)"));
            None
        }
    }
}

/// All problems of a spec at once, so a user fixes them in one go.
pub fn validate(spec: &AgentClusterSpec) -> Result<Timings, Vec<String>> {
    let mut problems = Vec::new();
    if spec.replicas < 0 {
        problems.push(format!("spec.replicas: {} must be >= 0", spec.replicas));
    }
    if !(1..=65535).contains(&spec.agent_port) || SIDECAR_PORTS.contains(&spec.agent_port) {
        problems.push(format!(
            "spec.agentPort: {} must be a TCP port not used by the sidecar ({SIDECAR_PORTS:?})",
            spec.agent_port
        ));
    }
    let sidecar = &spec.sidecar;
    let ttl = duration("sidecar.leaseTtl", &sidecar.lease_ttl, &mut problems);
    let heartbeat = duration("sidecar.heartbeatInterval", &sidecar.heartbeat_interval, &mut problems);
    let drain = duration("sidecar.drainTimeout", &sidecar.drain_timeout, &mut problems);
    let retention = duration("sessionRetention", &spec.session_retention, &mut problems);
    if retention.is_some_and(|r| r < MIN_SESSION_RETENTION) {
        problems.push("spec.sessionRetention must be at least 1h".to_owned());
    }
    let turns = &spec.turns;
    let answers = duration("turns.answerRetention", &turns.answer_retention, &mut problems);
    if answers.is_some_and(|r| r < MIN_ANSWER_RETENTION) {
        problems.push("spec.turns.answerRetention must be at least 5m".to_owned());
    }
    if !(MIN_QUEUE_LIMIT..=MAX_QUEUE_LIMIT).contains(&turns.queue_limit) {
        problems.push(format!(
            "spec.turns.queueLimit: {} must be between {MIN_QUEUE_LIMIT} and {MAX_QUEUE_LIMIT}",
            turns.queue_limit
        ));
    }
    if let Some(bytes) = turns.max_answer_bytes.filter(|b| !(1..=MAX_ANSWER_BYTES_LIMIT).contains(b)) {
        problems.push(format!(
            "spec.turns.maxAnswerBytes: {bytes} must be between 1 and {MAX_ANSWER_BYTES_LIMIT}"
        ));
    }
    if let Some(attempts) = turns.max_attempts.filter(|a| !(1..=MAX_TURN_ATTEMPTS).contains(a)) {
        problems
            .push(format!("spec.turns.maxAttempts: {attempts} must be between 1 and {MAX_TURN_ATTEMPTS}"));
    }
    if let (Some(ttl), Some(heartbeat)) = (ttl, heartbeat) {
        if heartbeat * 2 >= ttl {
            problems.push("spec.sidecar.heartbeatInterval must be less than half of leaseTtl".to_owned());
        }
    }
    if drain.is_some_and(|d| d < Duration::from_secs(1) || d > Duration::from_secs(3600)) {
        problems.push("spec.sidecar.drainTimeout must be between 1s and 1h".to_owned());
    }
    let containers = spec.template.spec.as_ref().map(|s| s.containers.as_slice()).unwrap_or_default();
    if containers.is_empty() {
        problems.push("spec.template.spec.containers: at least one agent container is required".to_owned());
    }
    for c in containers {
        if c.name == SIDECAR_CONTAINER {
            problems.push(format!(
                "spec.template: container name {SIDECAR_CONTAINER:?} is reserved for the sidecar"
            ));
        }
        for port in c.ports.iter().flatten() {
            if SIDECAR_PORTS.contains(&port.container_port) {
                problems.push(format!(
                    "spec.template: container {:?} port {} collides with the sidecar's ports",
                    c.name, port.container_port
                ));
            }
        }
    }
    if spec.database.secret_name.is_empty() {
        problems.push("spec.database.secretName is required".to_owned());
    }
    match (ttl, heartbeat, drain, retention, answers, problems.is_empty()) {
        (
            Some(lease_ttl),
            Some(heartbeat),
            Some(drain_timeout),
            Some(session_retention),
            Some(answer_retention),
            true,
        ) => Ok(Timings { lease_ttl, heartbeat, drain_timeout, session_retention, answer_retention }),
        _ => Err(problems),
    }
}
