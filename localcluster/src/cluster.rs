//! A cluster of nodes, each a real `leasehold-sidecar` plus a real `leasehold-demo-agent`
//! process on its own loopback address, sharing one Postgres.

use std::{
    net::Ipv4Addr,
    path::PathBuf,
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use leasehold_sidecar::client::Client;
use tempfile::TempDir;

use crate::process::Proc;

pub const PUBLIC_PORT: u16 = 18080;
pub const PEER_PORT: u16 = 18081;
pub const AGENT_API_PORT: u16 = 18082;
pub const ADMIN_PORT: u16 = 19090;
pub const DEMO_AGENT_PORT: u16 = 13000;

/// How long a node may take to become ready (first start compiles nothing, but the
/// database may be busy with other tests' migrations).
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the workspace's binaries are: next to this executable (or its `deps/` parent).
pub fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("LEASEHOLD_BIN_DIR") {
        return dir.into();
    }
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("exe has a directory");
    if dir.ends_with("deps") {
        dir.parent().expect("deps has a parent").to_owned()
    } else {
        dir.to_owned()
    }
}

/// A binary of the workspace (or of `$LEASEHOLD_BIN_DIR`).
pub fn binary(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(path.exists(), "{} is missing: run `cargo build --workspace --bins` first", path.display());
    path
}

/// Loopback addresses unique within this process (127.X.Y.Z, X from the PID), so tests
/// running in parallel threads never share a port; an address whose ports another
/// process holds (another test run whose PID shares X) is skipped.
pub fn next_ip() -> Ipv4Addr {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let x = 100 + (std::process::id() % 100) as u8;
        let ip = Ipv4Addr::new(127, x, (n / 200) as u8, (n % 200) as u8 + 10);
        let free = [PUBLIC_PORT, PEER_PORT, AGENT_API_PORT, ADMIN_PORT, DEMO_AGENT_PORT]
            .iter()
            .all(|port| std::net::TcpListener::bind((ip, *port)).is_ok());
        if free {
            return ip;
        }
    }
}

#[derive(Debug, Clone)]
pub struct ClusterOptions {
    pub nodes: usize,
    pub lease_ttl: Duration,
    pub heartbeat: Duration,
    pub drain_timeout: Duration,
    /// `None`: `--insecure-peer`.
    pub cluster_secret: Option<String>,
    /// Fixed addresses (the demo uses 127.0.0.x); `None` allocates unique ones.
    pub ips: Option<Vec<Ipv4Addr>>,
    /// The agent to run instead of the demo agent: program, arguments and environment;
    /// `--listen <ip:port>` is appended.
    pub agent_command: Option<(PathBuf, Vec<(String, String)>)>,
    /// Per node (by index), a database URL to use instead of the cluster's: the same
    /// database reached another way, e.g. through a [`crate::Link`] a test can cut.
    pub database_urls: Vec<Option<String>>,
    /// Per node (by index), extra environment for its sidecar (e.g. a failpoint).
    pub sidecar_env: Vec<Vec<(String, String)>>,
    /// The sidecar executable to run instead of the workspace's (e.g. an earlier
    /// release's, as a benchmark's baseline).
    pub sidecar_binary: Option<PathBuf>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            nodes: 3,
            lease_ttl: Duration::from_secs(3),
            heartbeat: Duration::from_millis(500),
            drain_timeout: Duration::from_secs(5),
            cluster_secret: Some(format!("secret-{}", uuid::Uuid::new_v4().simple())),
            ips: None,
            agent_command: None,
            database_urls: Vec::new(),
            sidecar_env: Vec::new(),
            sidecar_binary: None,
        }
    }
}

/// One pod: a sidecar and its agent.
#[derive(Debug)]
pub struct Node {
    pub name: String,
    pub ip: Ipv4Addr,
    pub sidecar: Proc,
    pub agent: Proc,
    sidecar_program: PathBuf,
    sidecar_cmd: Vec<String>,
    sidecar_env: Vec<(String, String)>,
    agent_cmd: AgentCommand,
    log_dir: PathBuf,
    /// What admin requests are signed with (`None`: the node runs `--insecure-peer`).
    cluster_secret: Option<String>,
}

/// How a node's agent is started: program, arguments, environment.
#[derive(Debug, Clone)]
struct AgentCommand {
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Node {
    pub fn public_url(&self) -> String {
        format!("http://{}:{PUBLIC_PORT}", self.ip)
    }

    pub fn admin_url(&self) -> String {
        format!("http://{}:{ADMIN_PORT}", self.ip)
    }

    pub fn peer_url(&self) -> String {
        format!("http://{}:{PEER_PORT}", self.ip)
    }

    /// The agent's own port (the demo agent's test hooks, e.g. `/sessions/{key}/release`).
    pub fn agent_url(&self) -> String {
        format!("http://{}:{DEMO_AGENT_PORT}", self.ip)
    }

    pub fn agent_api_url(&self) -> String {
        format!("http://{}:{AGENT_API_PORT}", self.ip)
    }

    fn spawn_sidecar(
        name: &str,
        program: &std::path::Path,
        args: &[String],
        env: &[(String, String)],
        log_dir: &std::path::Path,
    ) -> Proc {
        let mut cmd = Command::new(program);
        cmd.args(args).env("LEASEHOLD_LOG", "info,leasehold_sidecar=debug");
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        Proc::spawn(&format!("{name}/sidecar"), cmd, &log_dir.join(format!("{name}-sidecar.log")))
            .expect("spawn sidecar")
    }

    /// The pod dies: `kill -9` of both containers.
    pub fn kill9(&mut self) {
        self.sidecar.kill9();
        self.agent.kill9();
    }

    /// The pod freezes (both containers).
    pub fn pause(&self) {
        self.sidecar.pause();
        self.agent.pause();
    }

    pub fn resume(&self) {
        self.sidecar.resume();
        self.agent.resume();
    }

    fn spawn_agent(name: &str, agent: &AgentCommand, log_dir: &std::path::Path) -> Proc {
        let mut cmd = Command::new(&agent.program);
        cmd.args(&agent.args).envs(agent.env.iter().cloned());
        Proc::spawn(&format!("{name}/agent"), cmd, &log_dir.join(format!("{name}-agent.log")))
            .expect("spawn agent")
    }

    /// The agent container starts again (after a crash); its log is appended to.
    pub fn restart_agent(&mut self) {
        self.agent.kill9();
        self.agent = Self::spawn_agent(&self.name, &self.agent_cmd, &self.log_dir);
    }

    /// A container restart: the sidecar starts again with the same node id.
    pub fn restart_sidecar(&mut self) {
        self.sidecar.kill9();
        self.sidecar = Self::spawn_sidecar(
            &self.name,
            &self.sidecar_program,
            &self.sidecar_cmd,
            &self.sidecar_env,
            &self.log_dir,
        );
    }

    /// A container restart with one setting changed (e.g. a rotated `--cluster-secret`):
    /// `flag`'s value is replaced, or the flag added.
    pub fn restart_sidecar_with(&mut self, flag: &str, value: &str) {
        if flag == "--cluster-secret" {
            self.cluster_secret = Some(value.to_owned());
        }
        match self.sidecar_cmd.iter().position(|a| a == flag) {
            Some(at) => self.sidecar_cmd[at + 1] = value.to_owned(),
            None => self.sidecar_cmd.extend([flag.to_owned(), value.to_owned()]),
        }
        self.restart_sidecar();
    }

    /// Wait until `/readyz` answers 200 and the agent accepts connections; fails at once
    /// if the sidecar exited (e.g. its port is taken), with the end of its log.
    pub async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let http = reqwest::Client::new();
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let ready = http.get(format!("{}/readyz", self.admin_url())).send().await;
            // Like a pod's readiness: every container, so the agent accepts connections.
            let agent = tokio::net::TcpStream::connect((self.ip, DEMO_AGENT_PORT)).await;
            if ready.is_ok_and(|r| r.status().is_success()) && agent.is_ok() {
                return Ok(());
            }
            anyhow::ensure!(
                self.sidecar.is_running(),
                "{}'s sidecar exited before it was ready:\n{}",
                self.name,
                self.sidecar.log_tail(30)
            );
            anyhow::ensure!(
                Instant::now() < deadline,
                "{} not ready in {READY_TIMEOUT:?}:\n{}",
                self.name,
                self.sidecar.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Drain the node the way hooks and people do, with `leasehold-sidecar drain` (a
    /// real process, signing with the cluster secret); the report it printed.
    pub async fn drain(&self) -> serde_json::Value {
        let secret = self.cluster_secret.clone().unwrap_or_else(|| "insecure".to_owned());
        let output = tokio::process::Command::new(binary("leasehold-sidecar"))
            .args(["drain", "--admin-url", &self.admin_url(), "--cluster-secret", &secret])
            .kill_on_drop(true)
            .output()
            .await
            .expect("run leasehold-sidecar drain");
        assert!(
            output.status.success(),
            "drain of {} failed: {:?} {}",
            self.name,
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        serde_json::from_slice(&output.stdout).expect("the drain command prints the JSON report")
    }

    /// `GET /drained`: what an agent container's preStop hook does, waiting for the drain
    /// someone else runs. Its status and body.
    pub async fn drained(&self) -> (u16, serde_json::Value) {
        let response =
            reqwest::get(format!("{}/drained", self.admin_url())).await.expect("admin port reachable");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or_default())
    }

    /// A Prometheus counter or gauge from `/metrics` (sum over label sets matching `filter`).
    pub async fn metric(&self, name: &str, filter: &str) -> f64 {
        let text = reqwest::get(format!("{}/metrics", self.admin_url()))
            .await
            .expect("metrics reachable")
            .text()
            .await
            .expect("metrics text");
        text.lines()
            .filter(|l| l.starts_with(name) && l.contains(filter))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

#[derive(Debug)]
pub struct Cluster {
    pub nodes: Vec<Node>,
    pub database_url: String,
    pub options: ClusterOptions,
    logs: TempDir,
}

impl Cluster {
    /// Start every node and wait until all are ready.
    pub async fn start(database_url: &str, options: ClusterOptions) -> anyhow::Result<Cluster> {
        let logs = tempfile::Builder::new().prefix("leasehold-cluster.").tempdir()?;
        let mut nodes = Vec::new();
        for i in 0..options.nodes {
            let ip = options.ips.as_ref().map_or_else(next_ip, |ips| ips[i]);
            let name = format!("node-{}", (b'a' + i as u8) as char);
            let url = options.database_urls.get(i).cloned().flatten();
            let url = url.as_deref().unwrap_or(database_url);
            let env = options.sidecar_env.get(i).cloned().unwrap_or_default();
            nodes.push(Self::spawn_node(&name, ip, url, env, &options, logs.path()));
        }
        for node in &mut nodes {
            node.wait_ready().await?;
        }
        Ok(Cluster { nodes, database_url: database_url.to_owned(), options, logs })
    }

    fn spawn_node(
        name: &str,
        ip: Ipv4Addr,
        database_url: &str,
        sidecar_env: Vec<(String, String)>,
        options: &ClusterOptions,
        log_dir: &std::path::Path,
    ) -> Node {
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        let mut args: Vec<String> = [
            "--node-id",
            name,
            "--database-url",
            database_url,
            "--public-listen",
            &format!("{ip}:{PUBLIC_PORT}"),
            "--peer-listen",
            &format!("{ip}:{PEER_PORT}"),
            "--agent-listen",
            &format!("{ip}:{AGENT_API_PORT}"),
            "--admin-listen",
            &format!("{ip}:{ADMIN_PORT}"),
            "--agent-url",
            &format!("http://{ip}:{DEMO_AGENT_PORT}"),
            "--lease-ttl",
            &ms(options.lease_ttl),
            "--heartbeat-interval",
            &ms(options.heartbeat),
            "--drain-timeout",
            &ms(options.drain_timeout),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        match &options.cluster_secret {
            Some(secret) => args.extend(["--cluster-secret".to_owned(), secret.clone()]),
            None => args.push("--insecure-peer".to_owned()),
        }
        let sidecar_program = options.sidecar_binary.clone().unwrap_or_else(|| binary("leasehold-sidecar"));
        let sidecar = Node::spawn_sidecar(name, &sidecar_program, &args, &sidecar_env, log_dir);
        let listen = format!("{ip}:{DEMO_AGENT_PORT}");
        let agent_cmd = match &options.agent_command {
            Some((program, env)) => AgentCommand {
                program: program.clone(),
                args: vec!["--listen".to_owned(), listen],
                env: env.clone(),
            },
            None => AgentCommand {
                program: binary("leasehold-demo-agent"),
                args: vec![
                    "--sidecar-url".to_owned(),
                    format!("http://{ip}:{AGENT_API_PORT}"),
                    "--node-id".to_owned(),
                    name.to_owned(),
                    "--listen".to_owned(),
                    listen,
                ],
                env: Vec::new(),
            },
        };
        let agent = Node::spawn_agent(name, &agent_cmd, log_dir);
        Node {
            name: name.to_owned(),
            ip,
            sidecar,
            agent,
            sidecar_program,
            sidecar_cmd: args,
            sidecar_env,
            agent_cmd,
            log_dir: log_dir.to_owned(),
            cluster_secret: options.cluster_secret.clone(),
        }
    }

    /// A directive-honouring client over every node's public port.
    pub fn client(&self) -> Client {
        Client::new(self.nodes.iter().map(Node::public_url).collect())
    }

    /// The node whose name is `name`.
    pub fn node(&self, name: &str) -> &Node {
        self.nodes.iter().find(|n| n.name == name).expect("known node")
    }

    pub fn index_of(&self, name: &str) -> usize {
        self.nodes.iter().position(|n| n.name == name).expect("known node")
    }

    /// Every process's log tail, for a failing test's output.
    pub fn dump_logs(&self) -> String {
        let mut out = format!("logs in {}\n", self.logs.path().display());
        for node in &self.nodes {
            for p in [&node.sidecar, &node.agent] {
                out += &format!("----- {} (pid {})\n{}\n", p.name(), p.pid(), p.log_tail(40));
            }
        }
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.dump_logs());
        }
    }
}
