//! A trivial agent for benchmarks: answers every turn at once, writes nothing. The bench
//! binary runs itself in this role (`LEASEHOLD_BENCH_ROLE=trivial-agent`), so the cost
//! measured is the data plane's, not an agent's.
//!
//! The same process is also a Dapr actor host app doing the same trivial work, for the
//! side-by-side bench (benches/peers_dapr.rs): `GET /dapr/config` names the actor type,
//! `PUT /actors/{type}/{id}/method/{method}` answers at once, `DELETE /actors/{type}/{id}`
//! (deactivation) and `GET /healthz` answer 200. Every answer names the process
//! (`{"ok":true,"host":"<listen address>"}`) so a client sees who served it.
//!
//! With `LEASEHOLD_BENCH_RECORD_DIR` set, every call whose JSON body has a `call` field
//! is recorded, one line each, in `<dir>/<listen address>-<pid>.log`, written before the
//! answer: `<unix ns> call <entity> <call id>`; the Dapr routes also record
//! `<unix ns> activate <entity>` (the first call of an actor not active here) and
//! `<unix ns> deactivate <entity>`. [`read_records`] reads them back.

use std::{
    collections::{HashMap, HashSet},
    fs::File,
    io::Write,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use axum::{
    extract::{Path as UrlPath, State},
    routing::{delete, get, post, put},
    Json, Router,
};

const ROLE_ENV: &str = "LEASEHOLD_BENCH_ROLE";
const ROLE: &str = "trivial-agent";
/// Where calls are recorded (unset: nothing is).
pub const RECORD_DIR_ENV: &str = "LEASEHOLD_BENCH_RECORD_DIR";
/// The Dapr actor type the app hosts.
pub const ACTOR_TYPE: &str = "BenchActor";

struct Agent {
    host: String,
    record: Option<Mutex<Record>>,
}

struct Record {
    file: File,
    /// Actors active in this process (Dapr routes only).
    active: HashSet<String>,
}

impl Agent {
    /// Record a call (if it names one and recording is on); `dapr`: also its activation.
    fn call(&self, entity: &str, body: &[u8], dapr: bool) -> Json<serde_json::Value> {
        if let Some(record) = &self.record {
            let call = serde_json::from_slice::<serde_json::Value>(body).ok();
            let call = call.as_ref().and_then(|b| b["call"].as_str());
            let mut record = record.lock().expect("record lock");
            let now = unix_ns();
            let mut lines = String::new();
            if dapr && record.active.insert(entity.to_owned()) {
                lines += &format!("{now} activate {entity}\n");
            }
            if let Some(call) = call {
                lines += &format!("{now} call {entity} {call}\n");
            }
            record.file.write_all(lines.as_bytes()).expect("write the call record");
        }
        Json(serde_json::json!({ "ok": true, "host": self.host }))
    }

    fn deactivate(&self, entity: &str) {
        if let Some(record) = &self.record {
            let mut record = record.lock().expect("record lock");
            record.active.remove(entity);
            let line = format!("{} deactivate {entity}\n", unix_ns());
            record.file.write_all(line.as_bytes()).expect("write the deactivation record");
        }
    }
}

fn unix_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970").as_nanos()
}

/// If this process was started as the trivial agent, serve until killed and return true.
pub async fn serve_if_requested() -> bool {
    if std::env::var(ROLE_ENV).as_deref() != Ok(ROLE) {
        return false;
    }
    let listen = std::env::args().skip_while(|a| a != "--listen").nth(1).expect("--listen");
    let record = std::env::var_os(RECORD_DIR_ENV).map(|dir| {
        let path = Path::new(&dir).join(format!("{listen}-{}.log", std::process::id()));
        let file = File::options().create(true).append(true).open(&path).expect("open the record file");
        Mutex::new(Record { file, active: HashSet::new() })
    });
    let agent = Arc::new(Agent { host: listen.clone(), record });
    let app = Router::new()
        .route(
            "/sessions/{key}/turns",
            post(|State(a): State<Arc<Agent>>, UrlPath(key): UrlPath<String>, body: axum::body::Bytes| async move {
                a.call(&key, &body, false)
            }),
        )
        .route(
            "/dapr/config",
            get(|| async {
                Json(serde_json::json!({
                    "entities": [ACTOR_TYPE],
                    "actorIdleTimeout": "1h",
                    "drainOngoingCallTimeout": "5s",
                    "drainRebalancedActors": true,
                }))
            }),
        )
        .route(
            "/actors/{kind}/{id}/method/{method}",
            put(
                |State(a): State<Arc<Agent>>,
                 UrlPath((_, id, _)): UrlPath<(String, String, String)>,
                 body: axum::body::Bytes| async move { a.call(&id, &body, true) },
            ),
        )
        .route(
            "/actors/{kind}/{id}",
            delete(|State(a): State<Arc<Agent>>, UrlPath((_, id)): UrlPath<(String, String)>| async move {
                a.deactivate(&id);
            }),
        )
        .route("/healthz", get(|| async {}))
        .with_state(agent);
    let listener = tokio::net::TcpListener::bind(listen).await.expect("bind the trivial agent");
    axum::serve(listener, app).await.expect("serve the trivial agent");
    true
}

/// The `agent_command` of `ClusterOptions` that runs this executable as the agent.
pub fn command() -> (PathBuf, Vec<(String, String)>) {
    (std::env::current_exe().expect("current exe"), vec![(ROLE_ENV.into(), ROLE.into())])
}

/// [`command`] with every call recorded under `dir`.
pub fn recording_command(dir: &Path) -> (PathBuf, Vec<(String, String)>) {
    let (exe, mut env) = command();
    env.push((RECORD_DIR_ENV.into(), dir.to_string_lossy().into_owned()));
    (exe, env)
}

/// One recorded event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The record file it came from (one per agent process).
    pub process: String,
    pub at_ns: u128,
    pub kind: EventKind,
    pub entity: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKind {
    Call(String),
    Activate,
    Deactivate,
}

/// Every event recorded under `dir`, by every process, in time order.
pub fn read_records(dir: &Path) -> std::io::Result<Vec<Event>> {
    let mut events = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let process = path.file_stem().unwrap_or_default().to_string_lossy().into_owned();
        for line in std::fs::read_to_string(&path)?.lines() {
            let mut fields = line.split(' ');
            let (Some(at), Some(kind), Some(entity)) = (fields.next(), fields.next(), fields.next()) else {
                continue; // a line cut short by a kill -9
            };
            let Ok(at_ns) = at.parse() else { continue };
            let kind = match (kind, fields.next()) {
                ("call", Some(id)) => EventKind::Call(id.to_owned()),
                ("activate", _) => EventKind::Activate,
                ("deactivate", _) => EventKind::Deactivate,
                _ => continue,
            };
            events.push(Event { process: process.clone(), at_ns, kind, entity: entity.to_owned() });
        }
    }
    events.sort_by_key(|e| e.at_ns);
    Ok(events)
}

/// Executions beyond the first of every call id in `events`: the calls that ran twice.
pub fn extra_executions(events: &[Event]) -> usize {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for e in events {
        if let EventKind::Call(id) = &e.kind {
            *seen.entry(id).or_default() += 1;
        }
    }
    seen.values().map(|n| n - 1).sum()
}

/// Pairs of activations of one entity in two processes that overlap in time, and the
/// longest overlap. An activation lasts until its deactivation, else until the process
/// was stopped (`stopped_at`, by process), else until `now_ns`.
pub fn overlapping_activations(
    events: &[Event],
    stopped_at: &HashMap<String, u128>,
    now_ns: u128,
) -> (usize, Duration) {
    let mut open: HashMap<(&str, &str), u128> = HashMap::new();
    let mut intervals: HashMap<&str, Vec<(u128, u128, &str)>> = HashMap::new();
    for e in events {
        let key = (e.entity.as_str(), e.process.as_str());
        match e.kind {
            EventKind::Activate => {
                open.insert(key, e.at_ns);
            }
            EventKind::Deactivate => {
                if let Some(start) = open.remove(&key) {
                    intervals.entry(key.0).or_default().push((start, e.at_ns, key.1));
                }
            }
            EventKind::Call(_) => {}
        }
    }
    for ((entity, process), start) in open {
        let end = stopped_at.get(process).copied().unwrap_or(now_ns);
        intervals.entry(entity).or_default().push((start, end, process));
    }
    let (mut overlaps, mut longest) = (0, 0u128);
    for list in intervals.values() {
        for (i, a) in list.iter().enumerate() {
            for b in &list[i + 1..] {
                let overlap = a.1.min(b.1).saturating_sub(a.0.max(b.0));
                if a.2 != b.2 && overlap > 0 {
                    overlaps += 1;
                    longest = longest.max(overlap);
                }
            }
        }
    }
    (overlaps, Duration::from_nanos(u64::try_from(longest).unwrap_or(u64::MAX)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_read_back_in_time_order_and_a_cut_line_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("127.0.0.9:13000-7.log"),
            "30 call e1 c2\n10 activate e1\n20 call e1 c1\n40 ca",
        )
        .unwrap();
        std::fs::write(dir.path().join("127.0.0.8:13000-8.log"), "25 deactivate e1\n").unwrap();
        let events = read_records(dir.path()).unwrap();
        let at: Vec<u128> = events.iter().map(|e| e.at_ns).collect();
        assert_eq!(at, [10, 20, 25, 30]);
        assert_eq!(events[1].kind, EventKind::Call("c1".to_owned()));
        assert_eq!(events[0].process, "127.0.0.9:13000-7");
        assert_eq!(events[2].kind, EventKind::Deactivate);
    }

    fn event(process: &str, at_ns: u128, kind: EventKind) -> Event {
        Event { process: process.to_owned(), at_ns, kind, entity: "e".to_owned() }
    }

    #[test]
    fn a_call_id_run_twice_counts_once_extra() {
        let call = |id: &str| EventKind::Call(id.to_owned());
        let events = [event("a", 1, call("x")), event("b", 2, call("x")), event("a", 3, call("y"))];
        assert_eq!(extra_executions(&events), 1);
        assert_eq!(extra_executions(&events[2..]), 0);
    }

    #[test]
    fn activations_overlap_only_across_processes_and_until_stop_or_deactivation() {
        use EventKind::{Activate, Deactivate};
        // a: active 10..50 (deactivated); b: active 40.. until its stop at 45; c: 60.. now.
        let events = [
            event("a", 10, Activate),
            event("b", 40, Activate),
            event("a", 50, Deactivate),
            event("c", 60, Activate),
        ];
        let stopped = HashMap::from([("b".to_owned(), 45)]);
        assert_eq!(overlapping_activations(&events, &stopped, 100), (1, Duration::from_nanos(5)));
        // Without b's stop it stays active to now and also overlaps c.
        assert_eq!(overlapping_activations(&events, &HashMap::new(), 100), (2, Duration::from_nanos(40)));
        // One process re-activating after its own deactivation is no overlap.
        let again = [event("a", 10, Activate), event("a", 20, Deactivate), event("a", 30, Activate)];
        assert_eq!(overlapping_activations(&again, &HashMap::new(), 100), (0, Duration::ZERO));
    }
}
