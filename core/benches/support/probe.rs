//! What one measured window cost on this machine, so a bottleneck is named from
//! measurement: CPU of every Postgres process (utime+stime from /proc of the postmaster
//! and all its children), of this client process and of the whole machine (other work on
//! the shared cores shows as the difference); WAL written (LSN difference); and what the
//! active client backends were doing, sampled from `pg_stat_activity`.

use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use sqlx::{Connection, PgConnection, PgPool, Row};
use tokio::{sync::oneshot, task::JoinHandle, time::Instant};

/// How often the active backends' wait events are sampled: often enough for a few hundred
/// samples per window, rarely enough that the sampling query costs Postgres little.
const WAIT_SAMPLE_EVERY: Duration = Duration::from_millis(50);

/// Active client backends (not the sampler itself), by what they wait on; `CPU` when
/// they wait on nothing (running or runnable).
const WAITS_SQL: &str = r#"
SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU') AS what, count(*)::bigint AS n
FROM pg_stat_activity
WHERE backend_type = 'client backend' AND state = 'active' AND pid <> pg_backend_pid()
GROUP BY 1
"#;

const LSN_SQL: &str = "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint AS at";

/// Reads the CPU counters of one Postgres server and of this process.
pub struct Probe {
    postmaster: u32,
    ticks_per_sec: f64,
    pool: PgPool,
}

/// CPU time, in clock ticks, of the whole machine (from the first line of /proc/stat).
#[derive(Clone, Copy)]
struct Machine {
    busy: u64,
    iowait: u64,
}

/// A window being measured.
pub struct Window {
    started: Instant,
    /// CPU ticks of each Postgres process when the window opened.
    pg: HashMap<u32, u64>,
    client: u64,
    machine: Machine,
    lsn: i64,
    stop: oneshot::Sender<()>,
    sampler: JoinHandle<(BTreeMap<String, u64>, HashMap<u32, u64>)>,
}

/// What a window cost, per second of wall time where it says `cores`.
pub struct Usage {
    pub wall: Duration,
    pub pg_cores: f64,
    pub client_cores: f64,
    pub machine_busy_cores: f64,
    pub iowait_cores: f64,
    pub wal_bytes: i64,
    /// Share of the active-backend samples per wait event, largest first.
    pub waits: Vec<(String, f64)>,
    /// Active client backends per sample, on average.
    pub active_backends: f64,
}

impl Usage {
    /// Postgres CPU seconds spent in the window.
    pub fn pg_cpu_seconds(&self) -> f64 {
        self.pg_cores * self.wall.as_secs_f64()
    }

    /// The `top` wait events as "CPU 60%, IO:WALSync 30%".
    pub fn top_waits(&self, top: usize) -> String {
        let shown: Vec<String> = self
            .waits
            .iter()
            .take(top)
            .map(|(what, share)| format!("{what} {:.0}%", share * 100.0))
            .collect();
        if shown.is_empty() {
            "none active".to_owned()
        } else {
            shown.join(", ")
        }
    }
}

fn stat_fields(path: &str) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(path).ok()?;
    // The command name is in parentheses and may hold spaces: split after the last ')'.
    let rest = &text[text.rfind(')')? + 2..];
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// utime + stime of a process (fields 14 and 15 of /proc/PID/stat; 12 and 13 after the name).
fn process_ticks(pid: &str) -> Option<(u32, u64)> {
    let f = stat_fields(&format!("/proc/{pid}/stat"))?;
    let ppid = f.get(1)?.parse().ok()?;
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some((ppid, ticks))
}

/// CPU ticks of `postmaster` and of each of its children, by PID.
fn pg_ticks(postmaster: u32) -> HashMap<u32, u64> {
    let mut ticks = HashMap::new();
    if let Some((_, t)) = process_ticks(&postmaster.to_string()) {
        ticks.insert(postmaster, t);
    }
    for entry in std::fs::read_dir("/proc").expect("read /proc").flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().filter(|n| n.bytes().all(|b| b.is_ascii_digit())) else { continue };
        if let Some((ppid, t)) = process_ticks(pid) {
            if ppid == postmaster {
                ticks.insert(pid.parse().unwrap_or(0), t);
            }
        }
    }
    ticks
}

fn machine() -> Machine {
    let text = std::fs::read_to_string("/proc/stat").expect("read /proc/stat");
    let line = text.lines().next().expect("/proc/stat has a cpu line");
    let v: Vec<u64> = line.split_whitespace().skip(1).map(|x| x.parse().unwrap_or(0)).collect();
    // user nice system idle iowait irq softirq steal
    let at = |i: usize| v.get(i).copied().unwrap_or(0);
    Machine { busy: at(0) + at(1) + at(2) + at(5) + at(6) + at(7), iowait: at(4) }
}

fn clock_ticks_per_sec() -> f64 {
    let out = std::process::Command::new("getconf").arg("CLK_TCK").output().expect("run getconf CLK_TCK");
    String::from_utf8_lossy(&out.stdout).trim().parse().expect("getconf CLK_TCK prints a number")
}

async fn lsn(conn: &mut PgConnection) -> i64 {
    sqlx::query(LSN_SQL).fetch_one(conn).await.unwrap().get("at")
}

impl Probe {
    /// The server behind `pool`: its postmaster is the parent of any backend.
    pub async fn new(pool: &PgPool) -> Self {
        let backend: i32 =
            sqlx::query("SELECT pg_backend_pid() AS pid").fetch_one(pool).await.unwrap().get("pid");
        let (postmaster, _) = process_ticks(&backend.to_string()).expect("the backend is visible in /proc");
        Self { postmaster, ticks_per_sec: clock_ticks_per_sec(), pool: pool.clone() }
    }

    /// CPU ticks of the postmaster and of every process it started (backends, WAL
    /// writer, checkpointer, autovacuum workers...), by PID.
    fn pg_ticks(&self) -> HashMap<u32, u64> {
        pg_ticks(self.postmaster)
    }

    pub async fn start(&self) -> Window {
        let mut conn = PgConnection::connect_with(&self.pool.connect_options()).await.unwrap();
        let lsn = lsn(&mut conn).await;
        let (stop, mut stopped) = oneshot::channel();
        let postmaster = self.postmaster;
        let sampler = tokio::spawn(async move {
            let mut waits = BTreeMap::new();
            // The last ticks seen of each Postgres process: one that exits mid-window
            // (an autovacuum worker) keeps what it spent up to its last sample.
            let mut seen = HashMap::new();
            let mut tick = tokio::time::interval(WAIT_SAMPLE_EVERY);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = &mut stopped => break,
                }
                seen.extend(pg_ticks(postmaster));
                *waits.entry("samples".to_owned()).or_insert(0) += 1;
                for row in sqlx::query(WAITS_SQL).fetch_all(&mut conn).await.unwrap() {
                    let n: i64 = row.get("n");
                    *waits.entry(row.get("what")).or_insert(0) += n.unsigned_abs();
                }
            }
            (waits, seen)
        });
        Window {
            started: Instant::now(),
            pg: self.pg_ticks(),
            client: process_ticks("self").map_or(0, |(_, t)| t),
            machine: machine(),
            lsn,
            stop,
            sampler,
        }
    }

    pub async fn finish(&self, window: Window) -> Usage {
        let wall = window.started.elapsed();
        let now = self.pg_ticks();
        let client = process_ticks("self").map_or(0, |(_, t)| t) - window.client;
        let m = machine();
        let _ = window.stop.send(());
        let (mut waits, mut seen) = window.sampler.await.unwrap();
        seen.extend(now);
        // Spent in the window: a process there at the start counts from its ticks then,
        // one started later from zero.
        let pg: u64 = seen
            .iter()
            .map(|(pid, last)| last.saturating_sub(window.pg.get(pid).copied().unwrap_or(0)))
            .sum();
        let mut conn = PgConnection::connect_with(&self.pool.connect_options()).await.unwrap();
        let wal_bytes = lsn(&mut conn).await - window.lsn;
        let samples = waits.remove("samples").unwrap_or(1).max(1);
        let active: u64 = waits.values().sum();
        let mut shares: Vec<(String, f64)> =
            waits.into_iter().map(|(what, n)| (what, n as f64 / active.max(1) as f64)).collect();
        shares.sort_by(|a, b| b.1.total_cmp(&a.1));
        let cores = |ticks: u64| ticks as f64 / self.ticks_per_sec / wall.as_secs_f64();
        Usage {
            wall,
            pg_cores: cores(pg),
            client_cores: cores(client),
            machine_busy_cores: cores(m.busy - window.machine.busy),
            iowait_cores: cores(m.iowait - window.machine.iowait),
            wal_bytes,
            waits: shares,
            active_backends: active as f64 / samples as f64,
        }
    }
}
