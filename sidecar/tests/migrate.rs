//! `leasehold-sidecar migrate`: idempotent and safe from several processes at once.

// The store tests' support (a database of its own per test), shared rather than copied.
#[path = "../../core/tests/support/mod.rs"]
mod support;

use std::process::{Command, Stdio};

use sqlx::{Connection, PgConnection};

const BIN: &str = env!("CARGO_BIN_EXE_leasehold-sidecar");

fn migrate_cmd(url: &str) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(["migrate", "--database-url", url]).stdout(Stdio::null()).stderr(Stdio::piped());
    cmd.env_remove("DATABASE_URL");
    cmd
}

async fn applied(url: &str) -> (i64, i64) {
    let mut conn = PgConnection::connect(url).await.unwrap();
    let migrations: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_tables WHERE tablename IN ('agent_nodes','agent_leases','agent_checkpoints')",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    (migrations, tables)
}

#[tokio::test]
async fn running_twice_is_a_no_op() {
    let url = support::create_database().await;
    for _ in 0..2 {
        let out = migrate_cmd(&url).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let expected = leasehold_core::store::MIGRATOR.iter().count() as i64;
    assert_eq!(applied(&url).await, (expected, 3));
}

#[tokio::test]
async fn eight_processes_at_once_all_succeed() {
    let url = support::create_database().await;
    let children: Vec<_> = (0..8).map(|_| migrate_cmd(&url).spawn().unwrap()).collect();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let expected = leasehold_core::store::MIGRATOR.iter().count() as i64;
    assert_eq!(applied(&url).await, (expected, 3));
}

#[test]
fn a_missing_or_unreachable_database_is_one_clear_line() {
    let out = Command::new(BIN).arg("migrate").env_remove("DATABASE_URL").output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("--database-url"), "{err}");

    let out = migrate_cmd("postgres://nobody@127.0.0.1:1/none").output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.lines().last().unwrap().contains("--database-url"), "{err}");
}

#[test]
fn bad_flags_exit_non_zero_with_one_line_naming_the_flag() {
    for (args, flag) in [
        (&["--insecure-peer", "--database-url", "x", "--lease-ttl", "soon"][..], "--lease-ttl"),
        (
            &[
                "--insecure-peer",
                "--database-url",
                "x",
                "--lease-ttl",
                "10s",
                "--heartbeat-interval",
                "6s",
                "--node-id",
                "n",
                "--advertise-peer-addr",
                "127.0.0.1:1",
            ][..],
            "--heartbeat-interval",
        ),
        (&["--database-url", "x"][..], "--cluster-secret"),
        (&["--insecure-peer", "--database-url", "x", "--public-listen", "nowhere"][..], "--public-listen"),
    ] {
        let out = Command::new(BIN).args(args).env_clear().output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}
