//! The capacity envelope of one Postgres (issue 20, part 3), through the real store API
//! (`leasehold_core::store`), on a durable server (`make bench-postgres`: fsync,
//! synchronous_commit and full_page_writes on):
//! - claims/s (a new session: insert; a session already held: extend) and fenced
//!   checkpoints/s with 4 KiB and 64 KiB states, at 8 and 32 concurrent tasks, with
//!   10 000 and then 1 000 000 background lease rows present;
//! - turns/s through the turn journal as the sidecar writes it (begin, events
//!   group-committed by one committer with the sidecar's linger and batch limit, a flush,
//!   the answer), with and without a 4 KiB checkpoint per turn, and turns per Postgres
//!   core-second;
//! - the heartbeat of 100 nodes (100 sessions each) at the sidecar's default interval,
//!   beside the same 100 connections idle;
//! - for every case: Postgres CPU (all its processes, from /proc), client CPU, machine
//!   CPU and iowait, WAL bytes, and the active backends' wait events.
//!
//! Run: `make bench-postgres`.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use leasehold_core::{
    store::{liveness, Answer, Append, Begun, Claim, JournalEvent, LeaseStore, NewTurn, TurnKind},
    Epoch, EventId, Owner, SessionKey,
};
use rand::RngCore;
use sqlx::{PgPool, Row};
use tokio::{
    sync::{mpsc, oneshot},
    time::Instant,
};

mod support;
use support::{fresh_pool, insert_leases, ms, stats};
#[path = "support/probe.rs"]
mod probe;
use probe::{Probe, Usage};

/// How long each case runs: thousands of operations and many WAL flushes per case, and
/// all 24 cases within a few minutes on two shared cores.
const RUN_FOR: Duration = Duration::from_secs(6);
/// Concurrent tasks (requests in flight against the store).
const CONCURRENCIES: [usize; 2] = [8, 32];
/// Lease rows present besides the ones a case writes.
const BACKGROUNDS: [i64; 2] = [10_000, 1_000_000];
/// Sessions each task owns for the held-claim, checkpoint and turn cases.
const KEYS_PER_TASK: usize = 50;
const STATE_SIZES: [usize; 2] = [4 * 1024, 64 * 1024];
/// Events an agent publishes per turn.
const EVENTS_PER_TURN: u64 = 3;
/// The sidecar's defaults for the event group commit (`--journal-linger`,
/// `--journal-max-batch`).
const LINGER: Duration = Duration::from_millis(5);
const MAX_BATCH: usize = 1000;
/// The node lease of the bench's owners: they must stay live for the whole run.
const BENCH_TTL: Duration = Duration::from_secs(3600);
/// The heartbeat case: 100 nodes with 100 sessions each, the sidecar's default interval
/// and TTL (`--heartbeat-interval 5s`, `--lease-ttl 15s`).
const NODES: usize = 100;
const SESSIONS_PER_NODE: i64 = 100;
const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(5);
const LEASE_TTL: Duration = Duration::from_secs(15);
/// Six beats per node: enough renewals for a rate, short enough for the run.
const HEARTBEAT_WINDOW: Duration = Duration::from_secs(30);

const TURN_BODY: &[u8] =
    br#"{"input":"summarise the last three messages and propose a next step for the user","user":"u-42"}"#;
const EVENT_DATA: &str =
    r#"{"delta":"a token or tool call the agent streamed to its observers, about this long"}"#;

#[derive(Debug, Clone, Copy)]
enum Work {
    ClaimNew,
    ClaimHeld,
    Checkpoint(usize),
    Turn { checkpoint: Option<usize> },
}

impl Work {
    fn label(self) -> String {
        match self {
            Work::ClaimNew => "claim, new session (insert)".to_owned(),
            Work::ClaimHeld => "claim, held session (extend)".to_owned(),
            Work::Checkpoint(size) => format!("fenced checkpoint {} KiB", size / 1024),
            Work::Turn { checkpoint: None } => format!("turn (begin, {EVENTS_PER_TURN} events, answer)"),
            Work::Turn { checkpoint: Some(size) } => {
                format!("turn + {} KiB checkpoint", size / 1024)
            }
        }
    }
}

/// One event or a flush, as the sidecar's publisher queues them: a flush ends the batch
/// (the turn's answer waits for it) instead of lingering.
enum Op {
    Event(Append),
    Flush(oneshot::Sender<()>),
}

/// The group commit of the sidecar's publisher: the first op into an empty queue waits
/// up to [`LINGER`] for others, at most [`MAX_BATCH`], a flush cuts it short; one
/// `append_events` statement per batch. Every event must land (no lease moves here).
async fn committer(store: LeaseStore, mut rx: mpsc::UnboundedReceiver<Op>, batches: Arc<AtomicU64>) {
    while let Some(first) = rx.recv().await {
        let mut ops = vec![first];
        let deadline = Instant::now() + LINGER;
        while ops.len() < MAX_BATCH && !matches!(ops.last(), Some(Op::Flush(_))) {
            match rx.try_recv() {
                Ok(op) => ops.push(op),
                Err(mpsc::error::TryRecvError::Empty) => {
                    match tokio::time::timeout_at(deadline, rx.recv()).await {
                        Ok(Some(op)) => ops.push(op),
                        Ok(None) | Err(_) => break,
                    }
                }
                Err(mpsc::error::TryRecvError::Disconnected) => break,
            }
        }
        let mut batch = Vec::new();
        let mut flushes = Vec::new();
        for op in ops {
            match op {
                Op::Event(append) => batch.push(append),
                Op::Flush(done) => flushes.push(done),
            }
        }
        if !batch.is_empty() {
            let landed = store.append_events(&batch).await.unwrap();
            assert_eq!(landed.len(), batch.len(), "every event of the bench lands");
            batches.fetch_add(1, Ordering::Relaxed);
        }
        for done in flushes {
            let _ = done.send(());
        }
    }
}

/// What one task needs: its case and number (for fresh keys), its owner and the
/// sessions it holds at their epochs.
#[derive(Clone)]
struct Task {
    case: usize,
    t: usize,
    owner: Owner,
    keys: Vec<(SessionKey, Epoch)>,
}

/// A task's own buffers: the state it checkpoints, the last event seq per session.
struct Scratch {
    state: Vec<u8>,
    seqs: Vec<u64>,
}

/// One operation of `work` by task `t`, the `i`th; returns the statements it sent
/// itself (the events' statements are counted by the committer).
async fn one(
    store: &LeaseStore,
    work: Work,
    i: usize,
    task: &Task,
    scratch: &mut Scratch,
    events: &mpsc::UnboundedSender<Op>,
) -> u64 {
    let (case, t) = (task.case, task.t);
    let Scratch { state, seqs } = scratch;
    let (key, epoch) = &task.keys[i % task.keys.len()];
    match work {
        Work::ClaimNew => {
            let key = SessionKey::parse(&format!("c{case}-t{t}-n{i}")).unwrap();
            let claim = store.claim(&key, &task.owner).await.unwrap();
            assert!(matches!(claim, Claim::Claimed { .. }), "a new key is claimed: {claim:?}");
            1
        }
        Work::ClaimHeld => {
            let claim = store.claim(key, &task.owner).await.unwrap();
            assert_eq!(claim, Claim::Extended { epoch: *epoch });
            1
        }
        Work::Checkpoint(_) => {
            state[..8].copy_from_slice(&(i as u64).to_le_bytes());
            store.put_checkpoint(key, &task.owner, *epoch, state).await.unwrap();
            1
        }
        Work::Turn { checkpoint } => {
            let turn_id = format!("c{case}-t{t}-{i}");
            let new = NewTurn {
                turn_id: &turn_id,
                kind: TurnKind::Turn,
                content_type: Some("application/json"),
                body: TURN_BODY,
            };
            let begun = store.begin_turn(key, &task.owner, *epoch, &new).await.unwrap();
            assert_eq!(begun, Begun::Started);
            let seq = &mut seqs[i % task.keys.len()];
            for _ in 0..EVENTS_PER_TURN {
                *seq += 1;
                let event = JournalEvent {
                    id: EventId { epoch: *epoch, seq: *seq },
                    turn_id: Some(turn_id.clone()),
                    kind: "token".to_owned(),
                    data: EVENT_DATA.to_owned(),
                };
                let append = Append { key: key.clone(), owner: task.owner.clone(), event };
                events.send(Op::Event(append)).unwrap();
            }
            let mut sent = 2;
            if checkpoint.is_some() {
                state[..8].copy_from_slice(&(i as u64).to_le_bytes());
                store.put_turn_checkpoint(key, &task.owner, *epoch, Some(&turn_id), state).await.unwrap();
                sent += 1;
            }
            let (done, flushed) = oneshot::channel();
            events.send(Op::Flush(done)).unwrap();
            flushed.await.unwrap();
            let answer = Answer {
                status: 200,
                content_type: Some("application/json".to_owned()),
                body: br#"{"output":"an answer of a few hundred bytes, recorded before the client sees it"}"#
                    .to_vec(),
            };
            store.finish_turn(key, &task.owner, *epoch, &turn_id, &answer).await.unwrap();
            sent
        }
    }
}

struct Bench {
    pool: PgPool,
    store: LeaseStore,
    probe: Probe,
    owners: Vec<Owner>,
    cases: usize,
}

impl Bench {
    /// The sessions each of `tasks` tasks holds for case `case` (claimed before the window).
    async fn prepare(&self, case: usize, tasks: usize) -> Vec<Task> {
        let mut out = Vec::new();
        for (t, owner) in self.owners.iter().take(tasks).enumerate() {
            let mut keys = Vec::new();
            for k in 0..KEYS_PER_TASK {
                let key = SessionKey::parse(&format!("c{case}-t{t}-k{k}")).unwrap();
                let epoch = self.store.claim(&key, owner).await.unwrap().owned_epoch().unwrap();
                keys.push((key, epoch));
            }
            out.push(Task { case, t, owner: owner.clone(), keys });
        }
        out
    }

    async fn case(&mut self, work: Work, tasks: usize, background: i64) {
        self.cases += 1;
        let case = self.cases;
        let prepared = self.prepare(case, tasks).await;
        let (events, rx) = mpsc::unbounded_channel();
        let batches = Arc::new(AtomicU64::new(0));
        let committing = tokio::spawn(committer(self.store.clone(), rx, batches.clone()));
        // Every case starts from a checkpoint: the full-page images after it are part of
        // the cost, the same for every case.
        sqlx::query("CHECKPOINT").execute(&self.pool).await.unwrap();
        let window = self.probe.start().await;
        let started = Instant::now();
        let deadline = started + RUN_FOR;
        let running: Vec<_> = prepared
            .into_iter()
            .map(|task| {
                let (store, events) = (self.store.clone(), events.clone());
                tokio::spawn(async move {
                    let size = match work {
                        Work::Checkpoint(size) | Work::Turn { checkpoint: Some(size) } => size,
                        _ => 0,
                    };
                    let mut scratch =
                        Scratch { state: vec![0u8; size.max(8)], seqs: vec![0; task.keys.len()] };
                    // Random bytes: Postgres cannot compress them (a JSON state would
                    // compress; this is the dearer case).
                    rand::rng().fill_bytes(&mut scratch.state);
                    let (mut samples, mut statements, mut i) = (Vec::new(), 0u64, 0usize);
                    while Instant::now() < deadline {
                        let t0 = Instant::now();
                        statements += one(&store, work, i, &task, &mut scratch, &events).await;
                        samples.push(t0.elapsed());
                        i += 1;
                    }
                    (samples, statements)
                })
            })
            .collect();
        let (mut samples, mut statements) = (Vec::new(), 0);
        for task in running {
            let (s, n) = task.await.unwrap();
            samples.extend(s);
            statements += n;
        }
        let wall = started.elapsed();
        let usage = self.probe.finish(window).await;
        drop(events);
        committing.await.unwrap();
        statements += batches.load(Ordering::Relaxed);
        let s = stats(samples, wall);
        let ops = s.per_sec * wall.as_secs_f64();
        println!(
            "| {background} | {tasks} | {} | {:.0} | {} | {} | {:.2} | {:.0} | {:.2} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1} | {} | {:.1} |",
            work.label(),
            s.per_sec,
            ms(s.p50),
            ms(s.p99),
            usage.pg_cores,
            ops / usage.pg_cpu_seconds().max(1e-9),
            usage.client_cores,
            usage.machine_busy_cores,
            usage.iowait_cores,
            usage.wal_bytes as f64 / 1e6 / usage.wall.as_secs_f64(),
            usage.wal_bytes as f64 / 1024.0 / ops.max(1.0),
            statements as f64 / ops.max(1.0),
            usage.top_waits(3),
            usage.active_backends,
        );
    }
}

fn table_header() {
    println!("| lease rows | tasks | operation | ops/s | p50 ms | p99 ms | PG CPU cores | ops per PG core-s | client CPU cores | machine busy cores | iowait cores | WAL MB/s | WAL KiB/op | statements/op | active backends' waits | active backends |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
}

/// 100 nodes with their sessions, each beating on its own connection every
/// [`HEARTBEAT_INTERVAL`] as the sidecar's heartbeat does: the connection holds the
/// boot's liveness lock, and a beat is the renewal and then the look for dead peers
/// (`store::liveness`); beside the same connections idle.
async fn bench_heartbeat(bench: &Bench) {
    let mut nodes = Vec::new();
    for n in 0..NODES {
        let owner = Owner::new_boot(&format!("hb-node-{n}"));
        let mut conn = bench.store.liveness_connection().await.unwrap();
        assert!(liveness::try_lock(&mut conn, &owner).await.unwrap());
        nodes.push((owner, conn));
    }
    println!("## heartbeat of {NODES} nodes ({SESSIONS_PER_NODE} sessions each), every {HEARTBEAT_INTERVAL:?}, TTL {LEASE_TTL:?}\n");
    println!("| phase | window s | renewals/s | p50 ms | p99 ms | PG CPU % of one core | client CPU % | machine busy cores | WAL KB/s |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let row = |phase: &str, usage: &Usage, renewals: &[Duration]| {
        let (rate, p50, p99) = if renewals.is_empty() {
            (0.0, "-".to_owned(), "-".to_owned())
        } else {
            let s = stats(renewals.to_vec(), usage.wall);
            (s.per_sec, ms(s.p50), ms(s.p99))
        };
        println!(
            "| {phase} | {:.0} | {rate:.1} | {p50} | {p99} | {:.2} | {:.2} | {:.2} | {:.2} |",
            usage.wall.as_secs_f64(),
            usage.pg_cores * 100.0,
            usage.client_cores * 100.0,
            usage.machine_busy_cores,
            usage.wal_bytes as f64 / 1e3 / usage.wall.as_secs_f64(),
        );
    };
    let window = bench.probe.start().await;
    tokio::time::sleep(HEARTBEAT_WINDOW).await;
    row(&format!("{NODES} connections open, idle"), &bench.probe.finish(window).await, &[]);

    for (owner, conn) in &mut nodes {
        bench.store.register_boot_on(conn, owner, "127.0.0.1:1", LEASE_TTL, true).await.unwrap();
    }
    let owners: Vec<&str> = nodes.iter().map(|(o, _)| o.as_str()).collect();
    sqlx::query(
        "INSERT INTO agent_leases (agent_key, owner, epoch, acquired_at, updated_at) \
         SELECT 'hb-' || split_part(o, '/', 1) || '-' || i, o, 1, now(), now() \
         FROM unnest($1::text[]) o, generate_series(1, $2::bigint) i",
    )
    .bind(&owners)
    .bind(SESSIONS_PER_NODE)
    .execute(&bench.pool)
    .await
    .unwrap();
    sqlx::query("CHECKPOINT").execute(&bench.pool).await.unwrap();

    let window = bench.probe.start().await;
    let deadline = Instant::now() + HEARTBEAT_WINDOW;
    let beating: Vec<_> = nodes
        .into_iter()
        .enumerate()
        .map(|(n, (owner, mut conn))| {
            let store = bench.store.clone();
            // Spread the nodes over the interval, as independent pods are.
            let phase = HEARTBEAT_INTERVAL * n as u32 / NODES as u32;
            tokio::spawn(async move {
                let mut samples = Vec::new();
                let mut tick = tokio::time::interval_at(Instant::now() + phase, HEARTBEAT_INTERVAL);
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        // The connection goes back with the samples: a node whose
                        // window ended must not read as dead to one still beating.
                        () = tokio::time::sleep_until(deadline) => break (samples, conn),
                    }
                    let t0 = Instant::now();
                    let lease = store.renew_on(&mut conn, &owner, LEASE_TTL, true).await.unwrap();
                    assert!(lease.is_some(), "a node renewing on time stays live");
                    let dead = liveness::reap(&mut conn, &owner, None, LEASE_TTL).await.unwrap();
                    assert!(dead.is_empty(), "every node holds its lock: {dead:?}");
                    samples.push(t0.elapsed());
                }
            })
        })
        .collect();
    let (mut renewals, mut connections) = (Vec::new(), Vec::new());
    for node in beating {
        let (samples, conn) = node.await.unwrap();
        renewals.extend(samples);
        connections.push(conn);
    }
    row("beating (renewal, then the look for dead peers)", &bench.probe.finish(window).await, &renewals);
    drop(connections); // every lock goes now, after the window
    println!();
}

async fn settings(pool: &PgPool) {
    let version: String = sqlx::query("SHOW server_version").fetch_one(pool).await.unwrap().get(0);
    print!(
        "Postgres {version}, this machine: {} cores;",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    for name in [
        "fsync",
        "synchronous_commit",
        "full_page_writes",
        "wal_level",
        "shared_buffers",
        "max_wal_size",
        "checkpoint_timeout",
        "max_connections",
    ] {
        let value: String = sqlx::query(&format!("SHOW {name}")).fetch_one(pool).await.unwrap().get(0);
        print!(" {name}={value}");
    }
    println!("\n");
}

#[tokio::main]
async fn main() {
    let max_tasks = CONCURRENCIES.into_iter().max().unwrap_or(1);
    let pool = fresh_pool(max_tasks as u32 + 4).await;
    settings(&pool).await;
    let fsync: String = sqlx::query("SHOW fsync").fetch_one(&pool).await.unwrap().get(0);
    if fsync != "on" {
        println!("WARNING: fsync is {fsync}: these are not production figures (run `make bench-postgres`)\n");
    }
    let store = LeaseStore::from_pool(pool.clone());
    let probe = Probe::new(&pool).await;

    // Every sidecar LISTENs for ownership changes; one listener drains them here, so the
    // claims' notifications are delivered, not only queued.
    let notified = Arc::new(AtomicU64::new(0));
    let mut changes = store.listen().await.unwrap();
    let counting = notified.clone();
    let listening = tokio::spawn(async move {
        while changes.next().await.is_ok() {
            counting.fetch_add(1, Ordering::Relaxed);
        }
    });

    let mut owners = Vec::new();
    for t in 0..max_tasks {
        let owner = Owner::new_boot(&format!("cap-{t}"));
        store.register_boot(&owner, "127.0.0.1:1", BENCH_TTL).await.unwrap();
        owners.push(owner);
    }
    let background = Owner::new_boot("background");
    store.register_boot(&background, "127.0.0.1:1", BENCH_TTL).await.unwrap();
    let mut bench = Bench { pool: pool.clone(), store, probe, owners, cases: 0 };

    insert_leases(&pool, &background, "bg-", 1, BACKGROUNDS[0]).await;
    bench_heartbeat(&bench).await;

    let mut present = BACKGROUNDS[0];
    for rows in BACKGROUNDS {
        if rows > present {
            let t0 = Instant::now();
            insert_leases(&pool, &background, "bg-", present + 1, rows).await;
            println!(
                "({} background lease rows inserted in one statement + VACUUM ANALYZE: {:.1} s)\n",
                rows - present,
                t0.elapsed().as_secs_f64()
            );
        }
        present = rows;
        println!("## {rows} background lease rows, each case {RUN_FOR:?} per row\n");
        table_header();
        let works = [
            Work::ClaimNew,
            Work::ClaimHeld,
            Work::Checkpoint(STATE_SIZES[0]),
            Work::Checkpoint(STATE_SIZES[1]),
            Work::Turn { checkpoint: None },
            Work::Turn { checkpoint: Some(STATE_SIZES[0]) },
        ];
        for work in works {
            for tasks in CONCURRENCIES {
                bench.case(work, tasks, rows).await;
            }
        }
        println!();
    }
    let leases: i64 = sqlx::query("SELECT count(*) FROM agent_leases").fetch_one(&pool).await.unwrap().get(0);
    println!(
        "{leases} lease rows at the end; {} ownership notifications delivered to the one listener",
        notified.load(Ordering::Relaxed)
    );
    listening.abort();
}
