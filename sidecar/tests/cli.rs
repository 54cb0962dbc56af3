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
