//! Centrifugo (v6, the fan-out peer of issue 20) as a real process on a loopback address
//! of its own, started with the configuration checked in at
//! `bench/peers/centrifugo/config.json`; killed by PID when dropped.

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::Context;
use serde_json::json;
use tempfile::TempDir;

use crate::{cluster::next_ip, fanout::stamped, process::Proc};

/// Where `scripts/ensure-centrifugo.sh` installs the pinned binary.
pub const PINNED: &str = "go/bin/centrifugo-v6.9.1";
/// Overrides the binary's path.
pub const BINARY_ENV: &str = "LEASEHOLD_BENCH_CENTRIFUGO";
/// The HTTP API key in the checked-in configuration (a fixture: loopback only).
pub const API_KEY: &str = "leasehold-bench-api-key";
/// The port on its own loopback address (one [`next_ip`] checks is free).
const PORT: u16 = crate::cluster::PUBLIC_PORT;
/// How long Centrifugo may take to answer `/health` after its start (it starts in well
/// under a second; a busy shared machine may delay it).
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause between `/health` probes while it starts.
const READY_POLL: Duration = Duration::from_millis(50);

/// The checked-in configuration.
pub fn config_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/peers/centrifugo/config.json")
}

/// The binary: `$LEASEHOLD_BENCH_CENTRIFUGO`, else `~/go/bin/centrifugo-v6.9.1`.
pub fn binary() -> anyhow::Result<PathBuf> {
    let path = match std::env::var(BINARY_ENV) {
        Ok(path) => PathBuf::from(path),
        Err(_) => PathBuf::from(std::env::var("HOME").context("HOME")?).join(PINNED),
    };
    anyhow::ensure!(path.exists(), "{} is missing: run scripts/ensure-centrifugo.sh", path.display());
    Ok(path)
}

#[derive(Debug)]
pub struct Centrifugo {
    pub ip: Ipv4Addr,
    pub process: Proc,
    http: reqwest::Client,
    _logs: TempDir,
}

impl Centrifugo {
    /// Start `binary` with the checked-in configuration on a fresh loopback address; return
    /// once `/health` answers.
    pub async fn start(binary: &Path) -> anyhow::Result<Centrifugo> {
        let ip = next_ip();
        let logs = tempfile::Builder::new().prefix("leasehold-centrifugo.").tempdir()?;
        let mut cmd = Command::new(binary);
        cmd.arg("--config")
            .arg(config_path())
            .env("CENTRIFUGO_HTTP_SERVER_ADDRESS", ip.to_string())
            .env("CENTRIFUGO_HTTP_SERVER_PORT", PORT.to_string());
        let mut process = Proc::spawn("centrifugo", cmd, &logs.path().join("centrifugo.log"))
            .with_context(|| format!("starting {}", binary.display()))?;
        let http = reqwest::Client::new();
        let health = format!("http://{ip}:{PORT}/health");
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if http.get(&health).send().await.is_ok_and(|r| r.status().is_success()) {
                break;
            }
            anyhow::ensure!(process.is_running(), "centrifugo exited at start: {}", process.log_tail(20));
            anyhow::ensure!(
                Instant::now() < deadline,
                "centrifugo not healthy within {READY_TIMEOUT:?}: {}",
                process.log_tail(20)
            );
            tokio::time::sleep(READY_POLL).await;
        }
        Ok(Centrifugo { ip, process, http, _logs: logs })
    }

    /// `host:port` of its HTTP server.
    pub fn authority(&self) -> String {
        format!("{}:{PORT}", self.ip)
    }

    /// The request target of a unidirectional SSE connection subscribed to `channel`
    /// (the connect request in the URL, as a browser's EventSource passes it).
    pub fn uni_sse_target(channel: &str) -> String {
        let connect = json!({ "subs": { channel: {} } }).to_string();
        let url = reqwest::Url::parse_with_params("http://x/connection/uni_sse", [("cf_connect", connect)])
            .expect("a valid URL");
        format!("{}?{}", url.path(), url.query().unwrap_or_default())
    }

    /// Publish one stamped event into `channel` through the server HTTP API.
    pub async fn publish(&self, channel: &str) -> anyhow::Result<()> {
        let response = self
            .http
            .post(format!("http://{}/api/publish", self.authority()))
            .header("x-api-key", API_KEY)
            .json(&json!({ "channel": channel, "data": stamped() }))
            .send()
            .await
            .with_context(|| format!("publishing to centrifugo channel {channel}"))?;
        let status = response.status();
        let body = response.text().await.unwrap_or_default();
        // The API answers 200 with `{"error": ...}` when it refuses.
        anyhow::ensure!(status == 200 && !body.contains("\"error\""), "centrifugo publish: {status} {body}");
        Ok(())
    }
}
