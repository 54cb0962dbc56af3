//! Closed-loop HTTP load and its latency summary, and the CPU a process tree used: what
//! the benches (benches/hop.rs, benches/peers_dapr.rs) share.

use std::time::{Duration, Instant};

/// Latency percentiles and throughput of one round of load.
#[derive(Debug, Clone, Copy)]
pub struct Stats {
    pub p50: Duration,
    pub p90: Duration,
    pub p99: Duration,
    pub per_sec: f64,
    pub n: usize,
}

/// `concurrency` clients, each sending `method url` with `body` back to back for `round`;
/// every answer must be a success.
pub async fn load_with(
    method: reqwest::Method,
    url: &str,
    body: &'static str,
    concurrency: usize,
    round: Duration,
) -> Stats {
    let http =
        reqwest::Client::builder().tcp_nodelay(true).pool_max_idle_per_host(concurrency).build().unwrap();
    let deadline = Instant::now() + round;
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (http, url, method) = (http.clone(), url.to_owned(), method.clone());
            tokio::spawn(async move {
                let mut samples = Vec::new();
                while Instant::now() < deadline {
                    let t0 = Instant::now();
                    let response = http.request(method.clone(), &url).body(body).send().await.unwrap();
                    assert!(response.status().is_success(), "{url}: {}", response.status());
                    response.bytes().await.unwrap();
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
    summarize(all, started.elapsed())
}

/// [`load_with`] of `POST url` with a small JSON turn.
pub async fn load(url: &str, concurrency: usize, round: Duration) -> Stats {
    load_with(reqwest::Method::POST, url, r#"{"text":"hi"}"#, concurrency, round).await
}

/// Percentiles of `samples` (taken over `wall`).
pub fn summarize(mut all: Vec<Duration>, wall: Duration) -> Stats {
    assert!(!all.is_empty(), "no samples in {wall:?}");
    all.sort();
    let at = |q: f64| all[((all.len() as f64 * q) as usize).min(all.len() - 1)];
    Stats {
        p50: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
        per_sec: all.len() as f64 / wall.as_secs_f64(),
        n: all.len(),
    }
}

/// Milliseconds with three decimals.
pub fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

/// CPU time (utime + stime) of `pid` and its direct children (nginx's workers).
pub fn cpu_of_tree(pid: u32) -> Duration {
    let own = crate::process::cpu_time(pid).unwrap_or_default();
    let children = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| parent_of(*child) == Some(pid));
    own + children.filter_map(crate::process::cpu_time).sum::<Duration>()
}

/// The parent PID of `pid`, from `/proc/<pid>/stat` (field 4, after the command name).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..].split(' ').nth(1)?.parse().ok()
}

/// Transactions committed in the database at `url` so far (`pg_stat_database`); the
/// difference over a run, minus one for each reading, is the run's.
pub async fn transactions(url: &str) -> i64 {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    sqlx::query_scalar::<_, i64>(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap()
}
