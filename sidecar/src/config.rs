//! Configuration (CONTRACT §2): one clap struct, every flag also read from its env var.

use std::{net::SocketAddr, time::Duration};

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::turn::{
    client_headers::{ForwardHeaders, DEFAULT_FORWARD_HEADERS},
    queue::Multitask,
};

/// Parse `15s`, `500ms`, `2m`.
fn duration(s: &str) -> Result<Duration, String> {
    let d = duration_or_zero(s)?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(d)
}

fn duration_or_zero(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (use e.g. 15s, 500ms, 2m)"))
}

#[derive(Debug, Parser)]
#[command(
    name = "leasehold-sidecar",
    version,
    about = "One writer per session: leases in Postgres, fenced writes"
)]
#[command(subcommand_negates_reqs = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// How log lines on stderr are written: `text` (for people) or `json` (one object
    /// per line, for log collectors).
    #[arg(long, env = "LEASEHOLD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,

    #[command(flatten)]
    pub run: RunArgs,
}

/// The shape of the log lines on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (coloured on a terminal).
    Text,
    /// One JSON object per line: `timestamp`, `level`, `fields`, `target`, `span`.
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the database migrations and exit (safe to run concurrently and repeatedly).
    Migrate(MigrateArgs),
    /// Drain a sidecar through its admin port, print the drain's answer, exit 0 when it
    /// succeeded (what preStop hooks and people run).
    Drain(DrainArgs),
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// Postgres connection URL.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
}

#[derive(Debug, Args)]
pub struct DrainArgs {
    /// The sidecar's admin port.
    #[arg(long, env = "LEASEHOLD_ADMIN_URL", default_value = "http://127.0.0.1:9090")]
    pub admin_url: String,

    /// The cluster secret the drain request is signed with.
    #[arg(long, env = "LEASEHOLD_CLUSTER_SECRET", hide_env_values = true)]
    pub cluster_secret: String,
}

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Stable name of this pod [default: $POD_NAME, else the hostname].
    #[arg(long, env = "LEASEHOLD_NODE_ID")]
    pub node_id: Option<String>,

    /// Postgres connection URL (libpq style).
    #[arg(long, env = "DATABASE_URL", required = true, hide_env_values = true)]
    pub database_url: Option<String>,

    /// Client API listener.
    #[arg(long, env = "LEASEHOLD_PUBLIC_LISTEN", default_value = "0.0.0.0:8080")]
    pub public_listen: SocketAddr,

    /// Listener for turns and streams forwarded by other sidecars.
    #[arg(long, env = "LEASEHOLD_PEER_LISTEN", default_value = "0.0.0.0:8081")]
    pub peer_listen: SocketAddr,

    /// Listener for the local agent container (loopback only by default).
    #[arg(long, env = "LEASEHOLD_AGENT_LISTEN", default_value = "127.0.0.1:8082")]
    pub agent_listen: SocketAddr,

    /// Listener for /healthz /readyz /metrics /drain /leases.
    #[arg(long, env = "LEASEHOLD_ADMIN_LISTEN", default_value = "0.0.0.0:9090")]
    pub admin_listen: SocketAddr,

    /// host:port other sidecars use to reach this one [default: $POD_IP:<peer port>].
    #[arg(long, env = "LEASEHOLD_ADVERTISE_PEER_ADDR")]
    pub advertise_peer_addr: Option<String>,

    /// Where turns are dispatched.
    #[arg(long, env = "LEASEHOLD_AGENT_URL", default_value = "http://127.0.0.1:3000")]
    pub agent_url: String,

    /// Lifetime of this process's node lease without a renewal.
    #[arg(long, env = "LEASEHOLD_LEASE_TTL", default_value = "15s", value_parser = duration)]
    pub lease_ttl: Duration,

    /// How often the node lease is renewed; must be below lease-ttl / 2.
    #[arg(long, env = "LEASEHOLD_HEARTBEAT_INTERVAL", default_value = "5s", value_parser = duration)]
    pub heartbeat_interval: Duration,

    /// Judge liveness by connection too: hold an advisory lock on the heartbeat's own
    /// Postgres connection, and expire at once the node lease of a peer whose lock is
    /// gone (its process died), instead of waiting for its TTL. Frozen or partitioned
    /// peers keep their connection and still wait for the TTL.
    #[arg(long, env = "LEASEHOLD_CONNECTION_LIVENESS", default_value_t = true, action = clap::ArgAction::Set)]
    pub connection_liveness: bool,

    /// How long a drain waits for in-flight turns.
    #[arg(long, env = "LEASEHOLD_DRAIN_TIMEOUT", default_value = "25s", value_parser = duration)]
    pub drain_timeout: Duration,

    /// Shared secret that authenticates peer requests.
    #[arg(
        long,
        env = "LEASEHOLD_CLUSTER_SECRET",
        required_unless_present = "insecure_peer",
        hide_env_values = true
    )]
    pub cluster_secret: Option<String>,

    /// The cluster secret before a rotation: proofs made with it are still accepted, and
    /// a peer that refuses a proof made with --cluster-secret gets one made with this
    /// (so pods not yet restarted stay reachable). Empty means none.
    #[arg(long, env = "LEASEHOLD_CLUSTER_SECRET_PREVIOUS", hide_env_values = true)]
    pub cluster_secret_previous: Option<String>,

    /// Accept and send unauthenticated peer requests (development only).
    #[arg(long, env = "LEASEHOLD_INSECURE_PEER")]
    pub insecure_peer: bool,

    /// Connections open at once on each listener; past it a connection is answered
    /// `503 overloaded` (with a retry directive) and closed.
    #[arg(long, env = "LEASEHOLD_MAX_CONNECTIONS", default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,

    /// Open `/stream`s on this node; past it a new one is `503 overloaded`.
    #[arg(long, env = "LEASEHOLD_MAX_STREAMS", default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_streams: u32,

    /// Open `/stream`s of one session on this node; past it a new one is `503 overloaded`.
    #[arg(long, env = "LEASEHOLD_MAX_STREAMS_PER_SESSION", default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_streams_per_session: u32,

    /// Largest accepted turn or event body, in bytes (`413` above).
    #[arg(long, env = "LEASEHOLD_MAX_BODY_BYTES", default_value_t = 1024 * 1024)]
    pub max_body_bytes: usize,

    /// Runtime threads; 0 = one per core. 1 keeps the sidecar on one core (lowest hop
    /// latency) but caps stream fan-out to what one core can write (see BENCHMARKS.md).
    #[arg(long, env = "LEASEHOLD_WORKER_THREADS", default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=256))]
    pub worker_threads: u16,

    /// What a turn that arrives while another of its session runs does: enqueue (wait
    /// in arrival order), reject (409 busy) or interrupt (cancel the running one). A
    /// client's Leasehold-Multitask header overrides it per turn.
    #[arg(long, env = "LEASEHOLD_MULTITASK", default_value = "enqueue", value_parser = multitask)]
    pub multitask: Multitask,

    /// Client request headers (comma-separated, any case) that reach the agent with a
    /// turn or event, on this pod or forwarded one hop to the owner; empty: none.
    /// Hop-by-hop headers and the sidecar's own Leasehold-* ones cannot be named.
    #[arg(long, env = "LEASEHOLD_FORWARD_HEADERS", default_value = DEFAULT_FORWARD_HEADERS, value_parser = forward_headers)]
    pub forward_headers: ForwardHeaders,

    /// Turns that may wait per session at its owner; above it, 503 queue_full.
    #[arg(long, env = "LEASEHOLD_QUEUE_LIMIT", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub queue_limit: u32,

    /// Largest agent answer recorded in the journal; a larger one fails its turn with
    /// 502 answer_too_large (recorded, so a repeat of its key gets the same).
    #[arg(long, env = "LEASEHOLD_MAX_ANSWER_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub max_answer_bytes: usize,

    /// Attempts a turn gets: one, plus one each time a new owner takes it over unfinished
    /// (its agent failed, its pod died, was drained, paused or cut off). A turn that used
    /// them all is recorded as failed (502 attempts_exhausted) rather than resumed again,
    /// so a turn that crashes every agent stops; 0 (the default): no limit, since every
    /// takeover counts, not only the agent's failures.
    #[arg(long, env = "LEASEHOLD_MAX_TURN_ATTEMPTS", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub max_turn_attempts: u32,

    /// How long the first published event into an empty journal queue waits for others
    /// before its group commit. 0 (the default): no wait, the adaptive group commit (a
    /// lone event is written at once; what arrives while a statement runs makes up the
    /// next one).
    #[arg(long, env = "LEASEHOLD_JOURNAL_LINGER", default_value = "0s", value_parser = duration_or_zero, hide = true)]
    pub journal_linger: Duration,

    /// Events per journal statement at most.
    #[arg(long, env = "LEASEHOLD_JOURNAL_MAX_BATCH", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000), hide = true)]
    pub journal_max_batch: u32,

    /// Apply migrations at start.
    #[arg(long, env = "LEASEHOLD_MIGRATE", default_value_t = true, action = clap::ArgAction::Set)]
    pub migrate: bool,
}

fn multitask(s: &str) -> Result<Multitask, String> {
    s.parse()
}

fn forward_headers(s: &str) -> Result<ForwardHeaders, String> {
    s.parse().map_err(|e: crate::turn::client_headers::ForwardHeadersError| e.to_string())
}

/// A configuration error: one line naming the flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{flag}: {message}")]
pub struct ConfigError {
    pub flag: &'static str,
    pub message: String,
}

/// The kernel's host name (what `hostname` prints), when `HOSTNAME` is not exported.
fn system_hostname() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    Some(name.trim().to_owned()).filter(|n| !n.is_empty())
}

fn invalid(flag: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError { flag, message: message.into() }
}

/// Settings after defaults that depend on the environment are resolved and cross-flag
/// rules are checked.
#[derive(Debug, Clone)]
pub struct Config {
    pub node_id: String,
    pub database_url: String,
    pub advertise_peer_addr: String,
    pub args: RunArgs,
}

impl RunArgs {
    /// Resolve defaults from the environment (`POD_NAME`, `POD_IP`, hostname) and check
    /// the rules that span flags.
    pub fn resolve(self, env: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        if self.heartbeat_interval >= self.lease_ttl / 2 {
            return Err(invalid(
                "--heartbeat-interval",
                format!(
                    "{} must be less than half of --lease-ttl ({})",
                    humantime::format_duration(self.heartbeat_interval),
                    humantime::format_duration(self.lease_ttl)
                ),
            ));
        }
        if !self.insecure_peer && self.cluster_secret.as_deref().is_some_and(|s| s.trim().is_empty()) {
            return Err(invalid(
                "--cluster-secret",
                "is empty; peers would authenticate with a key anyone knows (set a secret, or --insecure-peer for development)",
            ));
        }
        let node_id = self
            .node_id
            .clone()
            .or_else(|| env("POD_NAME"))
            .or_else(|| env("HOSTNAME"))
            .or_else(system_hostname)
            .ok_or_else(|| invalid("--node-id", "not set, POD_NAME and HOSTNAME unset, and no hostname"))?;
        if node_id.is_empty() || node_id.len() > 253 || node_id.contains('/') {
            return Err(invalid("--node-id", format!("{node_id:?} must be 1-253 characters without '/'")));
        }
        let advertise_peer_addr = match (&self.advertise_peer_addr, env("POD_IP")) {
            (Some(addr), _) => addr.clone(),
            (None, Some(ip)) => SocketAddr::new(
                ip.parse()
                    .map_err(|_| invalid("--advertise-peer-addr", format!("POD_IP {ip:?} is not an IP")))?,
                self.peer_listen.port(),
            )
            .to_string(),
            (None, None) if !self.peer_listen.ip().is_unspecified() => self.peer_listen.to_string(),
            (None, None) => {
                return Err(invalid(
                    "--advertise-peer-addr",
                    "required when POD_IP is unset and --peer-listen is a wildcard address",
                ))
            }
        };
        let database_url = self.database_url.clone().ok_or_else(|| invalid("--database-url", "required"))?;
        Ok(Config { node_id, database_url, advertise_peer_addr, args: self })
    }
}

#[cfg(test)]
mod tests;
