//! The command line: no help text ever shows a secret taken from the environment.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_leasehold-sidecar");

#[test]
fn help_never_prints_a_secret_from_the_environment() {
    for args in [&["--help"][..], &["migrate", "--help"], &["drain", "--help"]] {
        let out = Command::new(BIN)
            .args(args)
            .env("DATABASE_URL", "postgres://app:hunter2-db@db.internal:5432/leases")
            .env("LEASEHOLD_CLUSTER_SECRET", "hunter2-cluster")
            .env("LEASEHOLD_CLUSTER_SECRET_PREVIOUS", "hunter2-previous")
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}");
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(help.contains("Usage"), "{args:?}: {help}");
        assert!(!help.contains("hunter2"), "{args:?} printed a secret:\n{help}");
    }
}

#[test]
fn the_drain_command_needs_the_cluster_secret() {
    let out = Command::new(BIN)
        .args(["drain", "--admin-url", "http://127.0.0.1:1"])
        .env_remove("LEASEHOLD_CLUSTER_SECRET")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--cluster-secret"), "{err}");
}

/// A `--forward-headers` (or `LEASEHOLD_FORWARD_HEADERS`) that names a hop-by-hop header
/// or one of the sidecar's own fails at start, in one line naming the flag and why.
#[test]
fn a_forward_headers_list_naming_a_header_that_cannot_be_forwarded_fails_at_start() {
    let base = ["--database-url", "postgres://127.0.0.1:1/none", "--insecure-peer"];
    for (flag, env, why) in [
        (Some("Authorization,Connection"), None, "hop-by-hop"),
        (None, Some("Accept,Leasehold-Epoch"), "the sidecar's own"),
        (Some("Transfer-Encoding"), None, "hop-by-hop"),
        (Some("bad header"), None, "not a header name"),
    ] {
        let mut command = Command::new(BIN);
        command.args(base).env_remove("LEASEHOLD_FORWARD_HEADERS");
        if let Some(flag) = flag {
            command.args(["--forward-headers", flag]);
        }
        if let Some(env) = env {
            command.env("LEASEHOLD_FORWARD_HEADERS", env);
        }
        let out = command.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag:?} {env:?} started: {err}");
        assert!(err.contains("--forward-headers") && err.contains(why), "{flag:?} {env:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    }
}

/// How long the sidecar may take to write its first log line (the start-up warning
/// about an unreachable database, which it retries): a start on a loaded machine.
const FIRST_LOG_LINE_WITHIN: std::time::Duration = std::time::Duration::from_secs(20);

/// Start the sidecar against a database port that refuses connections (it logs a
/// warning and retries), with `format` given as the flag (`Some`) or not at all, and
/// `env` for `LEASEHOLD_LOG_FORMAT`; its first stderr line, then it is killed.
fn first_log_line(format: Option<&str>, env: Option<&str>) -> String {
    use std::io::BufRead;
    let mut command = Command::new(BIN);
    command
        .args(["--database-url", "postgres://postgres@127.0.0.1:1/none", "--insecure-peer"])
        .args(["--node-id", "log-format", "--public-listen", "127.0.0.1:0", "--peer-listen", "127.0.0.1:0"])
        .args(["--agent-listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .env_remove("LEASEHOLD_LOG")
        .env_remove("LEASEHOLD_LOG_FORMAT")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    if let Some(format) = format {
        command.args(["--log-format", format]);
    }
    if let Some(env) = env {
        command.env("LEASEHOLD_LOG_FORMAT", env);
    }
    let mut child = command.spawn().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::BufReader::new(stderr).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(FIRST_LOG_LINE_WITHIN);
    child.kill().unwrap();
    child.wait().unwrap();
    line.expect("the sidecar logged within the limit")
}

/// `--log-format json` (or `LEASEHOLD_LOG_FORMAT=json`) writes one JSON object per line;
/// `text`, and no setting at all, a plain line that is not JSON.
#[test]
fn the_log_format_flag_picks_json_or_text_lines() {
    for (flag, env) in [(Some("json"), None), (None, Some("json"))] {
        let line = first_log_line(flag, env);
        let json: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("{flag:?} {env:?}: not JSON ({e}): {line}"));
        assert_eq!(json["level"], "WARN", "{line}");
        assert!(json["fields"]["message"].as_str().unwrap().contains("lease store not usable yet"), "{line}");
    }
    for (flag, env) in [(Some("text"), None), (None, Some("text")), (None, None)] {
        let line = first_log_line(flag, env);
        assert!(serde_json::from_str::<serde_json::Value>(&line).is_err(), "{flag:?} {env:?}: JSON: {line}");
        assert!(line.contains(" WARN ") && line.contains("lease store not usable yet"), "{line}");
        assert!(!line.contains('\u{1b}'), "no colours off a terminal: {line:?}");
    }
}

/// A `--log-format` that is neither `json` nor `text` is refused by the flag parser, in
/// one line naming the flag and the possible values.
#[test]
fn an_unknown_log_format_is_refused_naming_the_choices() {
    for (flag, env) in [(Some("xml"), None), (None, Some("JSONL"))] {
        let mut command = Command::new(BIN);
        command
            .args(["--database-url", "postgres://127.0.0.1:1/none", "--insecure-peer"])
            .env_remove("LEASEHOLD_LOG_FORMAT");
        if let Some(flag) = flag {
            command.args(["--log-format", flag]);
        }
        if let Some(env) = env {
            command.env("LEASEHOLD_LOG_FORMAT", env);
        }
        let out = command.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(err.contains("--log-format") && err.contains("json") && err.contains("text"), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    }
}

/// With an OTLP endpoint set, a protocol other than http/protobuf fails at start in one
/// line that says which one is spoken.
#[test]
fn an_otlp_protocol_other_than_http_protobuf_fails_at_start() {
    let out = Command::new(BIN)
        .args(["--database-url", "postgres://127.0.0.1:1/none", "--insecure-peer", "--node-id", "otel"])
        .args(["--peer-listen", "127.0.0.1:0"])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("OTEL_EXPORTER_OTLP_PROTOCOL") && err.contains("http/protobuf"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
}
