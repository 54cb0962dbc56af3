use super::*;

fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
    let mut argv = vec!["leasehold-sidecar"];
    argv.extend_from_slice(args);
    Cli::try_parse_from(argv)
}

fn no_env(_: &str) -> Option<String> {
    None
}

const BASE: &[&str] = &["--database-url", "postgres://x", "--insecure-peer", "--node-id", "pod-a"];

fn run(extra: &[&str]) -> RunArgs {
    let mut args = BASE.to_vec();
    args.extend_from_slice(extra);
    parse(&args).expect("parses").run
}

#[test]
fn defaults_match_the_contract() {
    let args = run(&["--advertise-peer-addr", "10.0.0.1:8081"]);
    assert_eq!(args.public_listen.to_string(), "0.0.0.0:8080");
    assert_eq!(args.peer_listen.to_string(), "0.0.0.0:8081");
    assert_eq!(args.agent_listen.to_string(), "127.0.0.1:8082");
    assert_eq!(args.admin_listen.to_string(), "0.0.0.0:9090");
    assert_eq!(args.agent_url, "http://127.0.0.1:3000");
    assert_eq!(args.lease_ttl, Duration::from_secs(15));
    assert_eq!(args.heartbeat_interval, Duration::from_secs(5));
    assert_eq!(args.drain_timeout, Duration::from_secs(25));
    assert!(args.migrate);
    assert_eq!(args.worker_threads, 0, "one runtime thread per core");
    assert_eq!(args.max_body_bytes, 1024 * 1024);
    assert_eq!(args.journal_linger, Duration::ZERO, "the adaptive group commit");
    assert_eq!(args.journal_linger, crate::publish::LINGER);
    assert_eq!(args.journal_max_batch as usize, crate::publish::MAX_BATCH);
}

#[test]
fn the_journal_linger_takes_zero_and_a_fixed_wait() {
    assert_eq!(run(&["--journal-linger", "0s"]).journal_linger, Duration::ZERO);
    assert_eq!(run(&["--journal-linger", "5ms"]).journal_linger, Duration::from_millis(5));
    let mut args = BASE.to_vec();
    args.extend_from_slice(&["--journal-linger", "soon"]);
    assert!(parse(&args).is_err(), "not a duration");
}

#[test]
fn durations_accept_the_documented_forms() {
    let args = run(&["--lease-ttl", "2m", "--heartbeat-interval", "500ms", "--drain-timeout", "15s"]);
    assert_eq!(args.lease_ttl, Duration::from_secs(120));
    assert_eq!(args.heartbeat_interval, Duration::from_millis(500));
    assert_eq!(args.drain_timeout, Duration::from_secs(15));
    let err = parse(&[BASE, &["--lease-ttl", "fifteen"]].concat()).unwrap_err();
    assert!(err.to_string().contains("--lease-ttl"), "{err}");
    let err = parse(&[BASE, &["--lease-ttl", "0s"]].concat()).unwrap_err();
    assert!(err.to_string().contains("greater than zero"), "{err}");
}

#[test]
fn heartbeat_must_be_below_half_the_ttl() {
    let err = run(&["--lease-ttl", "10s", "--heartbeat-interval", "5s"]).resolve(no_env).unwrap_err();
    assert_eq!(err.flag, "--heartbeat-interval");
    assert!(run(&["--lease-ttl", "10s", "--heartbeat-interval", "4999ms", "--peer-listen", "127.0.0.1:1"])
        .resolve(no_env)
        .is_ok());
}

#[test]
fn secret_is_required_unless_insecure() {
    let err = parse(&["--database-url", "postgres://x"]).unwrap_err();
    assert!(err.to_string().contains("--cluster-secret"), "{err}");
    assert!(parse(&["--database-url", "postgres://x", "--cluster-secret", "s"]).is_ok());
}

#[test]
fn an_empty_secret_is_refused() {
    let base = ["--database-url", "postgres://x", "--node-id", "a", "--peer-listen", "127.0.0.1:1"];
    for empty in ["", "  "] {
        let args = parse(&[&base[..], &["--cluster-secret", empty]].concat()).unwrap().run;
        let err = args.resolve(no_env).unwrap_err();
        assert_eq!(err.flag, "--cluster-secret", "{empty:?}");
    }
    let args = parse(&[&base[..], &["--cluster-secret", "s3cret"]].concat()).unwrap().run;
    assert!(args.resolve(no_env).is_ok());
}

#[test]
fn node_id_falls_back_to_the_host_name() {
    let args = parse(&["--database-url", "postgres://x", "--insecure-peer", "--peer-listen", "127.0.0.1:1"])
        .unwrap()
        .run;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_owned();
    assert_eq!(args.resolve(no_env).unwrap().node_id, host);
}

#[test]
fn migrate_is_a_subcommand_with_its_own_database_url() {
    // (That --database-url is required is checked on the real binary with a clean env.)
    let cli = parse(&["migrate", "--database-url", "postgres://y"]).expect("migrate parses");
    assert!(matches!(cli.command, Some(Command::Migrate(m)) if m.database_url == "postgres://y"));
}

#[test]
fn node_id_and_peer_address_fall_back_to_the_downward_api() {
    let env = |name: &str| match name {
        "POD_NAME" => Some("agents-7d9f-x2".to_owned()),
        "POD_IP" => Some("10.1.2.3".to_owned()),
        _ => None,
    };
    let args = parse(&["--database-url", "postgres://x", "--insecure-peer"]).unwrap().run;
    let config = args.resolve(env).unwrap();
    assert_eq!(config.node_id, "agents-7d9f-x2");
    assert_eq!(config.advertise_peer_addr, "10.1.2.3:8081");
}

#[test]
fn peer_address_needs_a_source() {
    let err = run(&[]).resolve(no_env).unwrap_err();
    assert_eq!(err.flag, "--advertise-peer-addr");
    let config = run(&["--peer-listen", "127.0.0.2:7001"]).resolve(no_env).unwrap();
    assert_eq!(config.advertise_peer_addr, "127.0.0.2:7001");
}

#[test]
fn node_id_may_not_contain_a_slash() {
    let args = parse(&["--database-url", "postgres://x", "--insecure-peer", "--node-id", "a/b"]).unwrap().run;
    let err = args.resolve(no_env).unwrap_err();
    assert_eq!(err.flag, "--node-id");
}
