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
