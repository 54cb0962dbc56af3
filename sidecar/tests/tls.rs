//! The sidecar binary against a real TLS-only Postgres: a TLS refusal at start is one log
//! line naming its cause, repeated while the sidecar keeps retrying (it does not exit);
//! `migrate` honours PGSSLMODE and PGSSLROOTCERT, the URL's own parameters winning.

// The store tests' support (the TLS-only Postgres), shared rather than copied.
#[path = "../../core/tests/support/mod.rs"]
mod support;

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use support::tls_postgres::TlsPostgres;

const BIN: &str = env!("CARGO_BIN_EXE_leasehold-sidecar");

/// Start-up retries every 2 s (`STARTUP_RETRY`): three attempts fit well within this.
const THREE_ATTEMPTS: Duration = Duration::from_secs(20);

/// A sidecar process, killed by its PID on drop.
struct Sidecar(std::process::Child);

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_distrusted_ca_at_start_is_one_line_per_attempt_and_the_sidecar_keeps_retrying() {
    let pg = TlsPostgres::start();
    let mut cmd = Command::new(BIN);
    cmd.args(["--insecure-peer", "--node-id", "tls-a", "--advertise-peer-addr", "127.0.0.1:1"])
        .args(["--public-listen", "127.0.0.1:0", "--peer-listen", "127.0.0.1:0"])
        .args(["--agent-listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .env("DATABASE_URL", pg.url_with_ca("localhost", "verify-full", "other-ca.crt"))
        .env("LEASEHOLD_LOG", "warn")
        .env_remove("PGSSLMODE")
        .env_remove("PGSSLROOTCERT")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut sidecar = Sidecar(cmd.spawn().expect("start the sidecar"));
    let stderr = sidecar.0.stderr.take().unwrap();
    let (lines_tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });

    let deadline = Instant::now() + THREE_ATTEMPTS;
    let mut attempts = Vec::new();
    while attempts.len() < 3 {
        let left = deadline.saturating_duration_since(Instant::now());
        let line =
            lines.recv_timeout(left).unwrap_or_else(|_| panic!("3 attempts logged in time: {attempts:?}"));
        attempts.push(line);
    }
    for line in &attempts {
        assert!(line.contains("lease store not usable yet; retrying"), "{line}");
        assert!(line.contains("not signed by a CA this process trusts"), "names the cause: {line}");
    }
    assert!(sidecar.0.try_wait().unwrap().is_none(), "still running, retrying");
}

/// `leasehold-sidecar migrate` with `DATABASE_URL` and the given extra environment.
fn migrate(url: &str, env: &[(&str, &std::path::Path)]) -> std::process::Output {
    let mut cmd = Command::new(BIN);
    cmd.arg("migrate").env("DATABASE_URL", url).env_remove("PGSSLMODE").env_remove("PGSSLROOTCERT");
    for (name, value) in env {
        cmd.env(name, value);
    }
    cmd.output().expect("run migrate")
}

#[test]
fn migrate_honours_pgsslmode_and_pgsslrootcert_and_the_url_wins() {
    let pg = TlsPostgres::start();
    let plain = pg.url("localhost", "");
    let verify_full = std::path::Path::new("verify-full");
    let (ca, other) = (pg.file("ca.crt"), pg.file("other-ca.crt"));

    let out = migrate(&plain, &[("PGSSLMODE", verify_full), ("PGSSLROOTCERT", &ca)]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // The environment's CA is the one checked: a wrong one is refused, in one line.
    let out = migrate(&plain, &[("PGSSLMODE", verify_full), ("PGSSLROOTCERT", &other)]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("not signed by a CA this process trusts"), "{err}");

    // The URL's parameters win over the environment's.
    let out = migrate(
        &pg.url_with_ca("localhost", "verify-full", "ca.crt"),
        &[("PGSSLMODE", verify_full), ("PGSSLROOTCERT", &other)],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = migrate(
        &pg.url("localhost", "sslmode=disable"),
        &[("PGSSLMODE", verify_full), ("PGSSLROOTCERT", &ca)],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("accepts TLS connections only"), "{err}");
}
