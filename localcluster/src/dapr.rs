//! Dapr's actor runtime as real processes on loopback, for the side-by-side bench
//! (benches/peers_dapr.rs): the placement service, and daprd sidecars, each with or
//! without an actor host app (the trivial agent in its Dapr role). Binaries are the ones
//! scripts/ensure-dapr.sh installs (pinned at [`DAPR_VERSION`]); the Configuration and the
//! PostgreSQL actor state store are checked in under bench/peers/dapr.

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use crate::process::Proc;

pub const DAPR_VERSION: &str = "v1.14.0";
/// daprd's HTTP API (the one clients call).
pub const HTTP_PORT: u16 = 3500;
/// daprd's gRPC API (unused by the bench, but daprd always listens).
pub const GRPC_PORT: u16 = 50001;
/// daprd's internal gRPC port: sidecar to sidecar, the actor call's hop.
pub const INTERNAL_GRPC_PORT: u16 = 50002;
/// The port the actor host app listens on (the cluster's agent port, known free).
pub const APP_PORT: u16 = crate::cluster::DEMO_AGENT_PORT;
pub const PLACEMENT_PORT: u16 = 50005;
/// Placement's health port. v1.14.0 binds it on every interface (`[::]`) whatever
/// `--healthz-listen-address` says (cmd/placement/app/app.go does not pass the flag on):
/// the one listener of the bench not confined to its loopback address; an unusual port so
/// it meets no other process. The bench only ever connects to it on 127.0.0.x.
const PLACEMENT_HEALTHZ_PORT: u16 = 58080;
const PLACEMENT_RAFT_PORT: u16 = 8201;
/// daprd may take this long to be healthy: it connects to Postgres, creates its tables
/// and loads its components on a machine shared with builds.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Pause between readiness polls.
const POLL: Duration = Duration::from_millis(50);

/// `$LEASEHOLD_DAPR_BIN_DIR` or `~/go/bin`, where ensure-dapr.sh puts the binaries.
fn dapr_binary(name: &str) -> PathBuf {
    let dir = std::env::var_os("LEASEHOLD_DAPR_BIN_DIR")
        .map_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME")).join("go/bin"), PathBuf::from);
    let path = dir.join(format!("{name}-{DAPR_VERSION}"));
    assert!(path.exists(), "{} is missing: run scripts/ensure-dapr.sh", path.display());
    path
}

/// The checked-in Dapr files (bench/peers/dapr).
fn peer_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/peers/dapr")
}

/// The placement service on `ip` (in-memory Raft, one member, no TLS, no metrics).
pub fn start_placement(ip: Ipv4Addr, log_dir: &Path) -> Proc {
    let mut cmd = Command::new(dapr_binary("placement"));
    cmd.args([
        "--id",
        "dapr-placement-0",
        "--initial-cluster",
        &format!("dapr-placement-0={ip}:{PLACEMENT_RAFT_PORT}"),
        "--listen-address",
        &ip.to_string(),
        "--port",
        &PLACEMENT_PORT.to_string(),
        "--healthz-listen-address",
        &ip.to_string(),
        "--healthz-port",
        &PLACEMENT_HEALTHZ_PORT.to_string(),
        "--metadata-enabled",
        "--enable-metrics=false",
        "--log-level",
        "info",
    ]);
    Proc::spawn("placement", cmd, &log_dir.join("placement.log")).expect("spawn placement")
}

/// Placement table dissemination after a membership change: placement waits 2 s after
/// the last change, on a 500 ms tick; a little more for a loaded machine.
const DISSEMINATION_WAIT: Duration = Duration::from_secs(5);
/// The line daprd logs when it installs a placement table.
const TABLE_UPDATED: &str = "Placement tables updated";

/// Wait until the placement service answers its health check.
pub async fn wait_placement(ip: Ipv4Addr, placement: &mut Proc) -> anyhow::Result<()> {
    let url = format!("http://{ip}:{PLACEMENT_HEALTHZ_PORT}/healthz");
    wait_for(&url, placement).await
}

/// Where the Dapr files are written for one run: the Configuration (copied) and the
/// resources directory with the state store's connection string filled in.
#[derive(Debug, Clone)]
pub struct DaprFiles {
    pub config: PathBuf,
    pub resources: PathBuf,
}

impl DaprFiles {
    pub fn write(dir: &Path, database_url: &str) -> std::io::Result<DaprFiles> {
        let config = dir.join("config.yaml");
        std::fs::copy(peer_dir().join("config.yaml"), &config)?;
        let resources = dir.join("resources");
        std::fs::create_dir_all(&resources)?;
        let store = std::fs::read_to_string(peer_dir().join("resources/statestore.yaml"))?;
        std::fs::write(
            resources.join("statestore.yaml"),
            store.replace("{{CONNECTION_STRING}}", database_url),
        )?;
        Ok(DaprFiles { config, resources })
    }
}

/// One daprd and, for an actor host, its app: like a pod with the Dapr sidecar.
#[derive(Debug)]
pub struct DaprNode {
    pub name: String,
    pub ip: Ipv4Addr,
    pub daprd: Proc,
    pub app: Option<Proc>,
    daprd_cmd: Vec<String>,
    app_cmd: Option<(PathBuf, Vec<(String, String)>)>,
    log_dir: PathBuf,
}

impl DaprNode {
    /// Start daprd (app id `app_id`) on `ip`, with `app` (program and environment, given
    /// `--listen <ip>:APP_PORT`) as its actor host app when there is one.
    pub fn start(
        name: &str,
        app_id: &str,
        ip: Ipv4Addr,
        placement: Ipv4Addr,
        files: &DaprFiles,
        app: Option<(PathBuf, Vec<(String, String)>)>,
        log_dir: &Path,
    ) -> DaprNode {
        let mut args: Vec<String> = [
            "--mode",
            "standalone",
            "--app-id",
            app_id,
            "--dapr-http-port",
            &HTTP_PORT.to_string(),
            "--dapr-grpc-port",
            &GRPC_PORT.to_string(),
            "--dapr-internal-grpc-port",
            &INTERNAL_GRPC_PORT.to_string(),
            "--dapr-listen-addresses",
            &ip.to_string(),
            "--dapr-internal-grpc-listen-address",
            &ip.to_string(),
            "--placement-host-address",
            &format!("{placement}:{PLACEMENT_PORT}"),
            "--resources-path",
            &files.resources.to_string_lossy(),
            "--config",
            &files.config.to_string_lossy(),
            "--enable-metrics=false",
            "--log-level",
            "info",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if app.is_some() {
            args.extend(
                [
                    "--app-port",
                    &APP_PORT.to_string(),
                    "--app-channel-address",
                    &ip.to_string(),
                    "--app-protocol",
                    "http",
                ]
                .map(str::to_owned),
            );
        }
        let (daprd, app_proc) = Self::spawn(name, ip, &args, app.as_ref(), log_dir);
        DaprNode {
            name: name.to_owned(),
            ip,
            daprd,
            app: app_proc,
            daprd_cmd: args,
            app_cmd: app,
            log_dir: log_dir.to_owned(),
        }
    }

    /// Start the app (if any), then daprd (which reads the app's /dapr/config at start).
    fn spawn(
        name: &str,
        ip: Ipv4Addr,
        daprd_args: &[String],
        app: Option<&(PathBuf, Vec<(String, String)>)>,
        log_dir: &Path,
    ) -> (Proc, Option<Proc>) {
        let app = app.map(|(program, env)| {
            let mut cmd = Command::new(program);
            cmd.args(["--listen", &format!("{ip}:{APP_PORT}")]).envs(env.iter().cloned());
            Proc::spawn(&format!("{name}/app"), cmd, &log_dir.join(format!("{name}-app.log")))
                .expect("spawn the actor host app")
        });
        let mut cmd = Command::new(dapr_binary("daprd"));
        // daprd registers `DAPR_HOST_IP:internal port` with placement; without it, it picks
        // an address of a non-loopback interface.
        cmd.args(daprd_args).env("DAPR_HOST_IP", ip.to_string());
        let daprd = Proc::spawn(&format!("{name}/daprd"), cmd, &log_dir.join(format!("{name}-daprd.log")))
            .expect("spawn daprd");
        (daprd, app)
    }

    /// daprd's HTTP API.
    pub fn http_url(&self) -> String {
        format!("http://{}:{HTTP_PORT}", self.ip)
    }

    /// The app's own address (the direct baseline).
    pub fn app_url(&self) -> String {
        format!("http://{}:{APP_PORT}", self.ip)
    }

    /// The host dies: `kill -9` of daprd and its app.
    pub fn kill9(&mut self) {
        self.daprd.kill9();
        if let Some(app) = &mut self.app {
            app.kill9();
        }
    }

    /// A graceful stop, as Kubernetes does it: SIGTERM to daprd (it leaves placement and
    /// drains its actors within its graceful shutdown time) and the app, at most `timeout`
    /// each; anything still running then is killed.
    pub fn terminate(&mut self, timeout: Duration) {
        if self.daprd.terminate(timeout).is_none() {
            self.daprd.kill9();
        }
        if let Some(app) = &mut self.app {
            if app.terminate(timeout).is_none() {
                app.kill9();
            }
        }
    }

    /// Start both processes again with the same settings.
    pub fn restart(&mut self) {
        let (daprd, app) =
            Self::spawn(&self.name, self.ip, &self.daprd_cmd, self.app_cmd.as_ref(), &self.log_dir);
        (self.daprd, self.app) = (daprd, app);
    }

    /// Wait until daprd reports healthy (`/v1.0/healthz` answers 2xx).
    pub async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let url = format!("{}/v1.0/healthz", self.http_url());
        wait_for(&url, &mut self.daprd).await
    }

    /// Wait until this actor host serves actors: daprd healthy, a member in placement's
    /// table (`/placement/state` on `placement`'s health port), and a table that
    /// includes it installed here. Dapr exposes no signal for the last step (healthz and
    /// the metadata API's `hostReady` only say "connected"), so it is daprd's own log line
    /// "Placement tables updated" after the membership was seen, or
    /// [`DISSEMINATION_WAIT`], whichever comes first.
    pub async fn wait_serving(&mut self, placement: Ipv4Addr) -> anyhow::Result<()> {
        self.wait_ready().await?;
        let state = format!("http://{placement}:{PLACEMENT_HEALTHZ_PORT}/placement/state");
        let me = format!("{}:{INTERNAL_GRPC_PORT}", self.ip);
        let http = reqwest::Client::new();
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let body = match http.get(&state).send().await {
                Ok(response) => response.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            if body.contains(&format!("\"{me}\"")) {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{me} not in placement's table in {READY_TIMEOUT:?}: {body}"
            );
            tokio::time::sleep(POLL).await;
        }
        let installed = || self.daprd.log_tail(usize::MAX).matches(TABLE_UPDATED).count();
        let before = installed();
        let until = Instant::now() + DISSEMINATION_WAIT;
        while installed() == before && Instant::now() < until {
            tokio::time::sleep(POLL).await;
        }
        Ok(())
    }

    /// The end of daprd's log, for an error message.
    pub fn log_tail(&self) -> String {
        self.daprd.log_tail(30)
    }
}

/// Poll `url` until it answers 2xx; fail early if `process` exited.
async fn wait_for(url: &str, process: &mut Proc) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if http.get(url).send().await.is_ok_and(|r| r.status().is_success()) {
            return Ok(());
        }
        anyhow::ensure!(
            process.is_running(),
            "{} exited before {url} answered:\n{}",
            process.name(),
            process.log_tail(30)
        );
        anyhow::ensure!(
            Instant::now() < deadline,
            "{url} not healthy in {READY_TIMEOUT:?}:\n{}",
            process.log_tail(30)
        );
        tokio::time::sleep(POLL).await;
    }
}
