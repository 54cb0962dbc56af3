//! What the turn journal costs, every figure beside a baseline measured in the same run,
//! rounds interleaved. Each setup is a one-node cluster of its own (a real sidecar and the
//! workspace's demo agent on 127.X.Y.Z) with a fresh database on the same Postgres:
//! - **journal**: this workspace's sidecar (turns journaled before dispatch, events in
//!   group commits, the answer recorded before the client sees it);
//! - **baseline**: the previous release's checkpoint-only sidecar, built from commit
//!   `bbb3b87` (the last commit before the journal's turn path, edb6bbe), run with the
//!   *same* demo agent binary (it sends the resume header only when it gets one);
//! - **per-event**: this workspace's sidecar with `LEASEHOLD_JOURNAL_MAX_BATCH=1` (one
//!   INSERT per event, no linger), for the group commit figure.
//!
//! The journal setups run the sidecar's defaults (the adaptive group commit, no linger);
//! a `LEASEHOLD_JOURNAL_LINGER` in the bench's environment reaches them (e.g. `5ms`, the
//! previous default), not the per-event setup, which sets its own.
//!
//! Measured:
//! 1. turn latency p50/p99 and turns/s of a 50-token turn (`think_ms` 0) through the
//!    owner's public port, journal vs baseline, at 1 client and at 8 clients on 8
//!    distinct sessions; every turn carries an `Idempotency-Key` (as the SDK clients
//!    send; the baseline ignores it). Measured twice: with the demo agent, and with the
//!    bench's burst agent (the same writes without the demo agent's per-token sleep,
//!    which costs a 1 ms timer tick even at `think_ms` 0: see [`burst_agent`]);
//! 2. journaled events per second on one node: 32 sessions, each a client looping turns
//!    of 200 tokens with `think_ms` 0 (the agent publishes as fast as it can), the group
//!    commit vs one INSERT per event (and the baseline's published events/s as the
//!    ceiling without a journal); events per statement from the admin port's
//!    `leasehold_journal_events_total` / `leasehold_journal_batches_total`;
//! 3. Postgres work per 50-token turn, journal vs baseline: `pg_stat_user_tables`
//!    inserted/updated rows, `pg_total_relation_size` growth of every table, WAL bytes
//!    (`pg_current_wal_lsn` difference) and committed transactions, over N sequential
//!    turns of one session (the stats are read after Postgres' 10 s idle flush).
//! 4. replay of 10 000 journaled events (one turn's, burst agent) to a late observer
//!    with `Last-Event-ID` (the journal in pages of 1000, then the last 1024 from
//!    memory), beside the last 1000 replayed from memory alone and the same rows read
//!    with raw SQL.
//!
//! Run (from the workspace root):
//! ```text
//! git worktree add /work/wt-prejournal bbb3b87
//! (cd /work/wt-prejournal && CARGO_TARGET_DIR=/work/target-prejournal \
//!    cargo build --release --locked -p leasehold-sidecar)
//! cargo build --release --locked --bins
//! LEASEHOLD_BENCH_BASELINE_BIN_DIR=/work/target-prejournal/release \
//!   scripts/with-postgres.sh cargo bench -p leasehold-localcluster --bench journal
//! ```
//! `LEASEHOLD_BENCH_BASELINE_BIN_DIR` is the directory holding the baseline
//! `leasehold-sidecar`; without it the bench runs the journal-only parts (2 without the
//! ceiling, 3 without the baseline). Other switches (environment):
//! - `LEASEHOLD_BENCH_ONLY=latency|throughput|rows|replay`: one part;
//! - `LEASEHOLD_BENCH_ROUND_SECS` (default 5) and `LEASEHOLD_BENCH_ROUNDS` (default 3);
//! - `LEASEHOLD_BENCH_TURNS` (default 500): turns of part 3;
//! - `LEASEHOLD_BENCH_STREAMS` (default 32): sessions of part 2.
//!
//! The bench prints; it asserts only that turns succeed.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    time::{Duration, Instant},
};

use localcluster::{Cluster, ClusterOptions, Node};
use sqlx::{Connection, PgConnection, Row};

/// The turn of parts 1 and 3: 50 tokens, no thinking.
const TURN: &str = r#"{"text":"bench","think_ms":0,"tokens":50}"#;
/// The turn of part 2: a long burst of tokens.
const STREAM_TURN: &str = r#"{"text":"stream","think_ms":0,"tokens":200}"#;
const CONCURRENCY: [usize; 2] = [1, 8];
/// Longer than Postgres' idle stats flush (PGSTAT_IDLE_INTERVAL, 10 s): a backend's
/// counters are in pg_stat_user_tables by then.
const STATS_FLUSH: Duration = Duration::from_secs(11);
const TABLES: [&str; 3] = ["agent_turns", "agent_turn_events", "agent_checkpoints"];

struct Settings {
    baseline_dir: Option<PathBuf>,
    only: Option<String>,
    round: Duration,
    rounds: usize,
    turns: usize,
    streams: usize,
}

impl Settings {
    fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let num = |name: &str, default: u64| var(name).map_or(default, |v| v.parse().expect(name));
        Settings {
            baseline_dir: var("LEASEHOLD_BENCH_BASELINE_BIN_DIR").map(PathBuf::from),
            only: var("LEASEHOLD_BENCH_ONLY"),
            round: Duration::from_secs(num("LEASEHOLD_BENCH_ROUND_SECS", 5)),
            rounds: num("LEASEHOLD_BENCH_ROUNDS", 3) as usize,
            turns: num("LEASEHOLD_BENCH_TURNS", 500) as usize,
            streams: num("LEASEHOLD_BENCH_STREAMS", 32) as usize,
        }
    }

    fn part(&self, name: &str) -> bool {
        self.only.as_deref().is_none_or(|only| only == name)
    }
}

/// The agent behind a setup's sidecar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Agent {
    /// The workspace's `leasehold-demo-agent`.
    Demo,
    /// [`burst_agent`]: the demo agent's writes without its pauses.
    Burst,
}

/// An agent that makes the demo agent's writes for a turn (`turn_started`, `tokens` token
/// events, `turn_finished`, a checkpoint, then the answer), each awaited in turn as the
/// demo agent does, but with no pause between tokens: the demo agent sleeps
/// `think_ms / tokens` before each token, and tokio's `sleep(0)` still waits for the next
/// 1 ms timer tick (52 of them measured 58-92 ms here), so with the demo agent a 50-token
/// turn is mostly the agent's timer. The bench binary runs itself in this role
/// (`LEASEHOLD_BENCH_ROLE=journal-burst-agent`).
mod burst_agent {
    use std::{
        collections::HashMap,
        path::PathBuf,
        sync::{Arc, Mutex},
    };

    use axum::{
        body::Bytes,
        extract::{Path, State},
        http::{HeaderMap, StatusCode},
        response::{IntoResponse, Response},
        routing::post,
        Json, Router,
    };
    use serde_json::json;

    const ROLE_ENV: &str = "LEASEHOLD_BENCH_ROLE";
    const ROLE: &str = "journal-burst-agent";
    const SIDECAR_ENV: &str = "LEASEHOLD_SIDECAR_URL";

    struct Burst {
        http: reqwest::Client,
        sidecar: String,
        /// Turns answered per session: the checkpointed state.
        turns: Mutex<HashMap<String, u64>>,
    }

    /// If this process was started as the burst agent, serve until killed and return true.
    pub(crate) async fn serve_if_requested() -> bool {
        if std::env::var(ROLE_ENV).as_deref() != Ok(ROLE) {
            return false;
        }
        let listen = std::env::args().skip_while(|a| a != "--listen").nth(1).expect("--listen");
        let sidecar = std::env::var(SIDECAR_ENV).expect(SIDECAR_ENV);
        let agent = Arc::new(Burst { http: reqwest::Client::new(), sidecar, turns: Mutex::default() });
        let app = Router::new().route("/sessions/{key}/turns", post(turn)).with_state(agent);
        let listener = tokio::net::TcpListener::bind(listen).await.expect("bind the burst agent");
        axum::serve(listener, app).await.expect("serve the burst agent");
        true
    }

    /// The `agent_command` that runs this executable as the burst agent of the sidecar
    /// whose agent API is at `sidecar`.
    pub(crate) fn command(sidecar: &str) -> (PathBuf, Vec<(String, String)>) {
        let env = vec![(ROLE_ENV.into(), ROLE.into()), (SIDECAR_ENV.into(), sidecar.into())];
        (std::env::current_exe().expect("current exe"), env)
    }

    async fn turn(
        State(agent): State<Arc<Burst>>,
        Path(key): Path<String>,
        headers: HeaderMap,
        body: Bytes,
    ) -> Response {
        let Some(epoch) = headers.get("leasehold-epoch").and_then(|v| v.to_str().ok()?.parse::<i64>().ok())
        else {
            return (StatusCode::BAD_REQUEST, "no Leasehold-Epoch").into_response();
        };
        let input: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let tokens = input["tokens"].as_u64().unwrap_or(5);
        let events = format!("{}/v1/sessions/{key}/events", agent.sidecar);
        let mut writes = vec![("turn_started", json!({ "text": input["text"] }))];
        writes.extend((0..tokens).map(|i| ("token", json!({ "i": i, "text": format!("tok{i}") }))));
        let history_len = agent.turns.lock().unwrap().get(&key).copied().unwrap_or(0) + 1;
        writes.push(("turn_finished", json!({ "history_len": history_len })));
        for (kind, data) in writes {
            let sent = agent
                .http
                .post(&events)
                .header("leasehold-epoch", epoch)
                .json(&json!({ "type": kind, "data": data }))
                .send()
                .await;
            if let Some(refused) = refused(sent) {
                return refused;
            }
        }
        let checkpoint = json!({ "history_len": history_len }).to_string();
        let sent = agent
            .http
            .put(format!("{}/v1/sessions/{key}/checkpoint", agent.sidecar))
            .header("leasehold-epoch", epoch)
            .body(checkpoint)
            .send()
            .await;
        if let Some(refused) = refused(sent) {
            return refused;
        }
        agent.turns.lock().unwrap().insert(key, history_len);
        Json(json!({ "history_len": history_len, "epoch": epoch })).into_response()
    }

    /// A write the sidecar refused (409 when fenced), as this turn's answer.
    fn refused(sent: reqwest::Result<reqwest::Response>) -> Option<Response> {
        match sent {
            Ok(r) if r.status().is_success() => None,
            Ok(r) => Some(StatusCode::from_u16(r.status().as_u16()).unwrap().into_response()),
            Err(e) => Some((StatusCode::BAD_GATEWAY, e.to_string()).into_response()),
        }
    }
}

/// One compared setup: a one-node cluster with a database of its own.
struct Setup {
    name: &'static str,
    cluster: Cluster,
    db: String,
    /// Whether its sidecar journals (has the journal metrics).
    journals: bool,
}

impl Setup {
    async fn start(
        name: &'static str,
        admin: &str,
        sidecar_binary: Option<PathBuf>,
        env: Vec<(String, String)>,
        agent: Agent,
    ) -> Setup {
        let db = localcluster::postgres::fresh_database(admin).await.unwrap();
        let journals = sidecar_binary.is_none();
        let ip = localcluster::cluster::next_ip();
        let agent_command = match agent {
            Agent::Demo => None,
            Agent::Burst => {
                Some(burst_agent::command(&format!("http://{ip}:{}", localcluster::cluster::AGENT_API_PORT)))
            }
        };
        let options = ClusterOptions {
            nodes: 1,
            lease_ttl: Duration::from_secs(15),
            heartbeat: Duration::from_secs(5),
            sidecar_env: vec![env],
            sidecar_binary,
            ips: Some(vec![ip]),
            agent_command,
            ..ClusterOptions::default()
        };
        let cluster = Cluster::start(&db, options).await.unwrap();
        Setup { name, cluster, db, journals }
    }

    fn node(&self) -> &Node {
        &self.cluster.nodes[0]
    }

    fn turn_url(&self, key: &str) -> String {
        format!("{}/v1/sessions/{key}/turns", self.node().public_url())
    }

    /// One turn of each session, so the measured turns find their leases held and their
    /// state thawed.
    async fn warm(&self, http: &reqwest::Client, keys: &[String]) {
        for key in keys {
            turn(http, &self.turn_url(key), TURN).await;
        }
    }
}

async fn turn(http: &reqwest::Client, url: &str, body: &'static str) {
    let response = http
        .post(url)
        .header("idempotency-key", uuid::Uuid::new_v4().to_string())
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = response.status();
    let text = response.text().await.unwrap();
    assert!(status.is_success(), "{url}: {status} {text}");
}

fn http_client(concurrency: usize) -> reqwest::Client {
    reqwest::Client::builder().tcp_nodelay(true).pool_max_idle_per_host(concurrency).build().unwrap()
}

/// `clients` clients, client i looping turns of session `keys[i]` until `round` is up
/// (each finishes the turn it is in); every turn's latency, and the wall time.
async fn load(
    setup: &Setup,
    keys: &[String],
    body: &'static str,
    round: Duration,
) -> (Vec<Duration>, Duration) {
    let http = http_client(keys.len());
    let started = Instant::now();
    let deadline = started + round;
    let tasks: Vec<_> = keys
        .iter()
        .map(|key| {
            let (http, url) = (http.clone(), setup.turn_url(key));
            tokio::spawn(async move {
                let mut samples = Vec::new();
                while Instant::now() < deadline {
                    let t0 = Instant::now();
                    turn(&http, &url, body).await;
                    samples.push(t0.elapsed());
                }
                samples
            })
        })
        .collect();
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    (all, started.elapsed())
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

/// Journal and baseline in order, the order flipped every round so drift hits both.
fn in_round_order<'a>(setups: &'a [&'a Setup], round: usize) -> Vec<&'a Setup> {
    let mut order = setups.to_vec();
    if round % 2 == 1 {
        order.reverse();
    }
    order
}

async fn latency(settings: &Settings, journal: &Setup, baseline: Option<&Setup>) {
    let setups: Vec<&Setup> = [Some(journal), baseline].into_iter().flatten().collect();
    let http = http_client(1);
    let keys: Vec<String> = (0..*CONCURRENCY.iter().max().unwrap()).map(|i| format!("latency-{i}")).collect();
    for setup in &setups {
        setup.warm(&http, &keys).await;
    }
    println!(
        "## 1. Turn latency: a 50-token turn (think_ms 0), {} rounds of {:?} per setup, interleaved\n",
        settings.rounds, settings.round
    );
    let mut summary = Vec::new();
    for clients in CONCURRENCY {
        println!("### {clients} client(s), each on a session of its own\n");
        println!("| round | setup | turns | p50 ms | p99 ms | turns/s |");
        println!("|---|---|---|---|---|---|");
        // Per setup: every sample of every round, and the summed turns and wall time.
        // The journal's (events, statements) over its rounds.
        let mut statements = (0.0, 0.0);
        let mut pooled: Vec<(Vec<Duration>, usize, Duration)> =
            vec![(Vec::new(), 0, Duration::ZERO); setups.len()];
        for round in 0..settings.rounds {
            for setup in in_round_order(&setups, round) {
                let at = setups.iter().position(|s| std::ptr::eq(*s, setup)).unwrap();
                let counters = if setup.journals { journal_counters(setup.node()).await } else { (0.0, 0.0) };
                let (mut samples, wall) = load(setup, &keys[..clients], TURN, settings.round).await;
                if setup.journals {
                    let after = journal_counters(setup.node()).await;
                    statements.0 += after.0 - counters.0;
                    statements.1 += after.1 - counters.1;
                }
                samples.sort();
                println!(
                    "| {round} | {} | {} | {} | {} | {:.1} |",
                    setup.name,
                    samples.len(),
                    ms(quantile(&samples, 0.5)),
                    ms(quantile(&samples, 0.99)),
                    samples.len() as f64 / wall.as_secs_f64()
                );
                pooled[at].1 += samples.len();
                pooled[at].2 += wall;
                pooled[at].0.extend(samples);
            }
        }
        let journal_turns = pooled[0].1 as f64;
        println!(
            "\nJournal: {} events in {} statements over {journal_turns} turns: {:.1} events/statement, {:.2} event statements per turn",
            statements.0,
            statements.1,
            statements.0 / statements.1.max(1.0),
            statements.1 / journal_turns.max(1.0)
        );
        println!("\nAll rounds pooled:\n");
        println!("| setup | turns | p50 ms | p99 ms | turns/s |");
        println!("|---|---|---|---|---|");
        let mut figures = Vec::new();
        for (setup, (samples, n, wall)) in setups.iter().zip(pooled.iter_mut()) {
            samples.sort();
            let (p50, p99, rate) =
                (quantile(samples, 0.5), quantile(samples, 0.99), *n as f64 / wall.as_secs_f64());
            println!("| {} | {n} | {} | {} | {rate:.1} |", setup.name, ms(p50), ms(p99));
            figures.push((p50, p99, rate));
        }
        if let [j, b] = figures[..] {
            let line = format!(
                "{clients} client(s): journal / baseline p50 {:.3} (target <= 1.15), p99 {:.3}; turns/s {:.3}",
                j.0.as_secs_f64() / b.0.as_secs_f64(),
                j.1.as_secs_f64() / b.1.as_secs_f64(),
                j.2 / b.2
            );
            println!("\n{line}\n");
            summary.push(line);
        } else {
            println!();
        }
    }
    for line in summary {
        println!("Ratio, {line}");
    }
    println!();
}

/// The journal counters of a node: (events, statements).
async fn journal_counters(node: &Node) -> (f64, f64) {
    (
        node.metric("leasehold_journal_events_total", "").await,
        node.metric("leasehold_journal_batches_total", "").await,
    )
}

async fn throughput(settings: &Settings, setups: &[&Setup]) {
    let keys: Vec<String> = (0..settings.streams).map(|i| format!("stream-{i}")).collect();
    let http = http_client(1);
    for setup in setups {
        setup.warm(&http, &keys).await;
    }
    println!(
        "## 2. Journaled events per second, one node: {} sessions, each a client looping 200-token turns (think_ms 0); {} rounds of {:?}, interleaved\n",
        settings.streams, settings.rounds, settings.round
    );
    println!("| round | setup | turns | events | statements | events/statement | events/s |");
    println!("|---|---|---|---|---|---|---|");
    let mut totals = vec![(0.0, 0.0, Duration::ZERO); setups.len()];
    for round in 0..settings.rounds {
        for setup in in_round_order(setups, round) {
            let at = setups.iter().position(|s| std::ptr::eq(*s, setup)).unwrap();
            let before = if setup.journals { journal_counters(setup.node()).await } else { (0.0, 0.0) };
            // Every client ends the turn it is in: its answer comes after its events are
            // journaled, so the wall time covers every event counted.
            let (samples, wall) = load(setup, &keys, STREAM_TURN, settings.round).await;
            let (events, statements) = if setup.journals {
                let after = journal_counters(setup.node()).await;
                (after.0 - before.0, after.1 - before.1)
            } else {
                // Published, not journaled: turn_started, 200 tokens, turn_finished.
                ((samples.len() * 202) as f64, 0.0)
            };
            let per_statement =
                if statements > 0.0 { format!("{:.1}", events / statements) } else { "-".to_owned() };
            println!(
                "| {round} | {} | {} | {events} | {statements} | {per_statement} | {:.0} |",
                setup.name,
                samples.len(),
                events / wall.as_secs_f64()
            );
            totals[at].0 += events;
            totals[at].1 += statements;
            totals[at].2 += wall;
        }
    }
    println!("\nAll rounds:\n");
    println!("| setup | events/s | events/statement |");
    println!("|---|---|---|");
    let rate = |t: &(f64, f64, Duration)| t.0 / t.2.as_secs_f64();
    for (setup, t) in setups.iter().zip(&totals) {
        let per = if t.1 > 0.0 { format!("{:.1}", t.0 / t.1) } else { "- (no journal)".to_owned() };
        println!("| {} | {:.0} | {per} |", setup.name, rate(t));
    }
    let find = |name: &str| setups.iter().position(|s| s.name == name).map(|i| &totals[i]);
    if let (Some(group), Some(single)) = (find("journal"), find("per-event")) {
        let per = single.0 / single.1.max(1.0);
        if (per - 1.0).abs() > 0.01 {
            println!(
                "\nNOTE: per-event averaged {per:.2} events per statement, not 1: this sidecar ignores LEASEHOLD_JOURNAL_MAX_BATCH (built without --journal-max-batch?)"
            );
        }
        println!(
            "\nRatio, group commit / one INSERT per event: events/s {:.2}; statements per event {:.4} vs {:.4}",
            rate(group) / rate(single),
            group.1 / group.0,
            single.1 / single.0
        );
    }
    if let (Some(group), Some(ceiling)) = (find("journal"), find("baseline")) {
        println!(
            "Ratio, journaled events/s (group commit) / the baseline's published events/s (no journal): {:.3}",
            rate(group) / rate(ceiling)
        );
    }
    println!();
}

/// What Postgres holds and has done, for one database: per table (rows inserted, rows
/// updated, total bytes), committed transactions, and the server's WAL position.
struct Snapshot {
    tables: BTreeMap<String, (i64, i64, i64)>,
    xacts: i64,
    wal: String,
}

async fn snapshot(conn: &mut PgConnection) -> Snapshot {
    let rows = sqlx::query(
        "SELECT relname::text AS name, n_tup_ins, n_tup_upd, pg_total_relation_size(relid) AS bytes
         FROM pg_stat_user_tables",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    let tables = rows
        .iter()
        .map(|r| (r.get::<String, _>("name"), (r.get("n_tup_ins"), r.get("n_tup_upd"), r.get("bytes"))))
        .collect();
    let xacts =
        sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    let wal = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text").fetch_one(&mut *conn).await.unwrap();
    Snapshot { tables, xacts, wal }
}

async fn wal_bytes(conn: &mut PgConnection, from: &str, to: &str) -> i64 {
    sqlx::query_scalar("SELECT pg_wal_lsn_diff($2::pg_lsn, $1::pg_lsn)::bigint")
        .bind(from)
        .bind(to)
        .fetch_one(conn)
        .await
        .unwrap()
}

/// Per turn, for one setup: (table → (inserted, updated, bytes)), WAL bytes, transactions,
/// and the journal's event statements (its group commits).
struct PerTurn {
    tables: BTreeMap<String, (f64, f64, f64)>,
    wal: f64,
    xacts: f64,
    event_statements: Option<f64>,
}

async fn rows_of(setup: &Setup, turns: usize) -> PerTurn {
    let http = http_client(1);
    let key = "rows-0".to_owned();
    setup.warm(&http, std::slice::from_ref(&key)).await;
    let mut conn = PgConnection::connect(&setup.db).await.unwrap();
    tokio::time::sleep(STATS_FLUSH).await; // the warm-up's counters land first
    let before = snapshot(&mut conn).await;
    let counters = if setup.journals { Some(journal_counters(setup.node()).await) } else { None };
    let url = setup.turn_url(&key);
    for _ in 0..turns {
        turn(&http, &url, TURN).await;
    }
    // WAL and sizes at once (the other setups only renew their node lease meanwhile).
    let wal_after: String =
        sqlx::query_scalar("SELECT pg_current_wal_lsn()::text").fetch_one(&mut conn).await.unwrap();
    let sized = snapshot(&mut conn).await;
    let event_statements = match counters {
        Some((_, batches)) => Some((journal_counters(setup.node()).await.1 - batches) / turns as f64),
        None => None,
    };
    tokio::time::sleep(STATS_FLUSH).await;
    let counted = snapshot(&mut conn).await;
    let n = turns as f64;
    let tables = counted
        .tables
        .iter()
        .map(|(name, (ins, upd, _))| {
            let (ins0, upd0, bytes0) = before.tables.get(name).copied().unwrap_or_default();
            let bytes = sized.tables.get(name).map_or(0, |t| t.2);
            (name.clone(), ((ins - ins0) as f64 / n, (upd - upd0) as f64 / n, (bytes - bytes0) as f64 / n))
        })
        .collect();
    let wal = wal_bytes(&mut conn, &before.wal, &wal_after).await as f64 / n;
    // Minus this function's own two snapshot transactions in between.
    let xacts = (counted.xacts - before.xacts - 2) as f64 / n;
    PerTurn { tables, wal, xacts, event_statements }
}

async fn rows(settings: &Settings, journal: &Setup, baseline: Option<&Setup>) {
    let setups: Vec<&Setup> = [Some(journal), baseline].into_iter().flatten().collect();
    println!(
        "## 3. Postgres work per 50-token turn: {} sequential turns of one session per setup\n",
        settings.turns
    );
    let mut results = Vec::new();
    for setup in &setups {
        results.push(rows_of(setup, settings.turns).await);
    }
    println!("| setup | table | rows inserted/turn | rows updated/turn | bytes/turn (total relation size growth) |");
    println!("|---|---|---|---|---|");
    for (setup, r) in setups.iter().zip(&results) {
        let mut bytes = 0.0;
        for (name, (ins, upd, b)) in &r.tables {
            bytes += b;
            if TABLES.contains(&name.as_str()) || *ins != 0.0 || *upd != 0.0 || *b != 0.0 {
                println!("| {} | {name} | {ins:.2} | {upd:.2} | {b:.0} |", setup.name);
            }
        }
        println!("| {} | all tables | | | {bytes:.0} |", setup.name);
    }
    println!("\n| setup | WAL bytes/turn | transactions/turn (heartbeats and sweeps included) | event INSERTs/turn |");
    println!("|---|---|---|---|");
    for (setup, r) in setups.iter().zip(&results) {
        let inserts = r.event_statements.map_or("-".to_owned(), |n| format!("{n:.2}"));
        println!("| {} | {:.0} | {:.2} | {inserts} |", setup.name, r.wal, r.xacts);
    }
    if let [j, b] = &results[..] {
        let rows = |r: &PerTurn| r.tables.values().map(|t| t.0).sum::<f64>();
        println!(
            "\nRatio, journal / baseline: WAL bytes per turn {:.2}; rows inserted per turn {:.2} vs {:.2}; transactions per turn {:.2} vs {:.2}",
            j.wal / b.wal,
            rows(j),
            rows(b),
            j.xacts,
            b.xacts
        );
    }
    println!();
}

/// A late observer: `GET …/stream` with `Last-Event-ID: after`; the time to the first and
/// to the `expect`-th event frame (the stream is dropped then).
async fn observe_replay(setup: &Setup, key: &str, after: &str, expect: usize) -> (Duration, Duration) {
    use futures_util::StreamExt;
    let started = Instant::now();
    let response = reqwest::Client::new()
        .get(format!("{}/v1/sessions/{key}/stream", setup.node().public_url()))
        .header("accept", "text/event-stream")
        .header("last-event-id", after)
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success(), "stream: {}", response.status());
    let mut body = response.bytes_stream();
    let (mut events, mut first, mut line) = (0, None, Vec::new());
    while events < expect {
        let chunk = tokio::time::timeout(Duration::from_secs(60), body.next())
            .await
            .expect("replay stalled")
            .expect("stream ended early")
            .unwrap();
        for b in chunk {
            if b != b'\n' {
                line.push(b);
                continue;
            }
            if line.starts_with(b"id: ") {
                events += 1;
                first.get_or_insert_with(|| started.elapsed());
            } else if line.starts_with(b"event: overflow") || line.starts_with(b"event: missed") {
                panic!("replay cut short: {}", String::from_utf8_lossy(&line));
            }
            line.clear();
        }
    }
    (first.unwrap_or_default(), started.elapsed())
}

/// The same rows read straight from the store, in pages of 1000 as the sidecar reads them.
async fn raw_read(db: &str, key: &str, epoch: i64, after_seq: i64, rows: usize) -> Duration {
    let mut conn = PgConnection::connect(db).await.unwrap();
    let started = Instant::now();
    let (mut seq, mut read) = (after_seq, 0);
    while read < rows {
        let page = sqlx::query(
            "SELECT epoch, seq, turn_id, kind, data FROM agent_turn_events
             WHERE agent_key = $1 AND (epoch, seq) > ($2, $3) ORDER BY epoch, seq LIMIT 1000",
        )
        .bind(key)
        .bind(epoch)
        .bind(seq)
        .fetch_all(&mut conn)
        .await
        .unwrap();
        assert!(!page.is_empty(), "the journal has fewer than {rows} events after {epoch}-{after_seq}");
        read += page.len();
        seq = page.last().unwrap().get("seq");
    }
    started.elapsed()
}

/// The newest journaled event of `key`: (epoch, seq).
async fn last_event(conn: &mut PgConnection, key: &str) -> (i64, i64) {
    let row = sqlx::query(
        "SELECT epoch, max(seq) AS seq FROM agent_turn_events WHERE agent_key = $1
         GROUP BY epoch ORDER BY epoch DESC LIMIT 1",
    )
    .bind(key)
    .fetch_one(conn)
    .await
    .unwrap();
    (row.get("epoch"), row.get("seq"))
}

/// Part 4: 10 000 journaled events replayed to a late observer.
async fn replay(settings: &Settings, setup: &Setup) {
    const EVENTS: usize = 10_000;
    /// What the hub keeps in memory: the last 1024 events (observe::REPLAY_CAPACITY).
    const FROM_MEMORY: usize = 1_000;
    let key = "replay-0";
    let http = http_client(1);
    setup.warm(&http, &[key.to_owned()]).await;
    let mut conn = PgConnection::connect(&setup.db).await.unwrap();
    let (epoch, before) = last_event(&mut conn, key).await;
    // One turn of turn_started, 9 998 tokens and turn_finished: 10 000 events.
    let body: &'static str = r#"{"text":"replay","think_ms":0,"tokens":9998}"#;
    let started = Instant::now();
    turn(&http, &setup.turn_url(key), body).await;
    let published = started.elapsed();
    let (end_epoch, end) = last_event(&mut conn, key).await;
    assert_eq!((end_epoch, end - before), (epoch, EVENTS as i64), "one turn of {EVENTS} events");
    println!(
        "## 4. Replay of {EVENTS} journaled events to a late observer (`Last-Event-ID`), {} repetitions interleaved\n",
        settings.rounds.max(5)
    );
    println!("The 10 000-event turn itself (burst agent): {} ms\n", ms(published));
    println!("| round | what | events | first event ms | all events ms | events/s |");
    println!("|---|---|---|---|---|---|");
    let memory_after = format!("{epoch}-{}", end - FROM_MEMORY as i64);
    let all_after = format!("{epoch}-{before}");
    let mut totals = [Vec::new(), Vec::new(), Vec::new()];
    for round in 0..settings.rounds.max(5) {
        let (first, all) = observe_replay(setup, key, &all_after, EVENTS).await;
        println!(
            "| {round} | late observer, journal then memory | {EVENTS} | {} | {} | {:.0} |",
            ms(first),
            ms(all),
            EVENTS as f64 / all.as_secs_f64()
        );
        totals[0].push(all);
        let (first, all) = observe_replay(setup, key, &memory_after, FROM_MEMORY).await;
        println!(
            "| {round} | baseline: the last {FROM_MEMORY} from memory | {FROM_MEMORY} | {} | {} | {:.0} |",
            ms(first),
            ms(all),
            FROM_MEMORY as f64 / all.as_secs_f64()
        );
        totals[1].push(all);
        let raw = raw_read(&setup.db, key, epoch, before, EVENTS).await;
        println!(
            "| {round} | baseline: the same rows, raw SQL pages of 1000 | {EVENTS} | - | {} | {:.0} |",
            ms(raw),
            EVENTS as f64 / raw.as_secs_f64()
        );
        totals[2].push(raw);
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let (journal, memory, raw) = (median(&mut totals[0]), median(&mut totals[1]), median(&mut totals[2]));
    let per_event = |d: Duration, n: usize| d.as_secs_f64() * 1e6 / n as f64;
    println!(
        "\nMedian: {EVENTS} replayed in {} ms ({:.1} µs/event); memory {:.1} µs/event; raw SQL {:.1} µs/event. Ratio per event: replay / memory {:.2}, replay / raw SQL {:.2}\n",
        ms(journal),
        per_event(journal, EVENTS),
        per_event(memory, FROM_MEMORY),
        per_event(raw, EVENTS),
        per_event(journal, EVENTS) / per_event(memory, FROM_MEMORY),
        per_event(journal, EVENTS) / per_event(raw, EVENTS)
    );
}

#[tokio::main]
async fn main() {
    if burst_agent::serve_if_requested().await {
        return;
    }
    let admin = std::env::var("DATABASE_URL").expect("DATABASE_URL: run with scripts/with-postgres.sh");
    let settings = Settings::from_env();
    let baseline_binary = settings.baseline_dir.as_ref().map(|dir| {
        let path = dir.join("leasehold-sidecar");
        assert!(path.exists(), "LEASEHOLD_BENCH_BASELINE_BIN_DIR: no {}", path.display());
        path
    });
    let journal = Setup::start("journal", &admin, None, Vec::new(), Agent::Demo).await;
    let baseline = match &baseline_binary {
        Some(path) => {
            Some(Setup::start("baseline", &admin, Some(path.clone()), Vec::new(), Agent::Demo).await)
        }
        None => None,
    };
    let (journal_burst, baseline_burst) = if settings.part("latency") || settings.part("replay") {
        let journal = Setup::start("journal", &admin, None, Vec::new(), Agent::Burst).await;
        let baseline = match &baseline_binary {
            Some(path) => {
                Some(Setup::start("baseline", &admin, Some(path.clone()), Vec::new(), Agent::Burst).await)
            }
            None => None,
        };
        (Some(journal), baseline)
    } else {
        (None, None)
    };
    let per_event_env = vec![
        ("LEASEHOLD_JOURNAL_LINGER".to_owned(), "0s".to_owned()),
        ("LEASEHOLD_JOURNAL_MAX_BATCH".to_owned(), "1".to_owned()),
    ];
    let per_event = if settings.part("throughput") {
        Some(Setup::start("per-event", &admin, None, per_event_env, Agent::Demo).await)
    } else {
        None
    };
    println!(
        "Journal sidecar: {}; baseline sidecar: {}; demo agent: {} (both)\n",
        localcluster::cluster::binary("leasehold-sidecar").display(),
        settings
            .baseline_dir
            .as_ref()
            .map_or("none (LEASEHOLD_BENCH_BASELINE_BIN_DIR unset)".to_owned(), |d| {
                d.join("leasehold-sidecar").display().to_string()
            }),
        localcluster::cluster::binary("leasehold-demo-agent").display()
    );
    if settings.part("latency") {
        println!("# With the demo agent\n");
        latency(&settings, &journal, baseline.as_ref()).await;
        println!("# With the burst agent (the demo agent's writes, no pause between tokens)\n");
        latency(&settings, journal_burst.as_ref().unwrap(), baseline_burst.as_ref()).await;
    }
    if settings.part("throughput") {
        let setups: Vec<&Setup> =
            [Some(&journal), per_event.as_ref(), baseline.as_ref()].into_iter().flatten().collect();
        throughput(&settings, &setups).await;
    }
    if settings.part("rows") {
        rows(&settings, &journal, baseline.as_ref()).await;
    }
    if settings.part("replay") {
        replay(&settings, journal_burst.as_ref().unwrap()).await;
    }
    drop((journal_burst, baseline_burst));
    drop(per_event);
    drop(baseline);
    drop(journal);
}
