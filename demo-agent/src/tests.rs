//! The demo agent's contract (CONTRACT §4, §4a) against a fake sidecar: a small axum
//! server on loopback that speaks just enough of the agent API (§5) — checkpoint, events,
//! and the journal of a turn's earlier attempts — and records what the agent sent.
//!
//! The sidecar's side of resume and cancel (the turn journal, `Leasehold-Resume`, the
//! cancel call) is being built concurrently; the end-to-end version of these tests, against
//! real sidecars, comes with it. Here the fake plays the sidecar exactly as specified:
//! `GET /v1/sessions/{key}/turns/{id}/events` with `Leasehold-Epoch: n` answers the
//! canned journal of the earlier attempts.

use std::{
    future::Future,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    body::Bytes,
    extract::{Path, State},
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use serde_json::{json, Value};
use tokio::{net::TcpListener, sync::watch, task::JoinHandle};

use crate::{
    agent::{Agent, StatsView},
    router,
    sidecar::Sidecar,
};

/// Generous: only reached when a test fails.
const WAIT: Duration = Duration::from_secs(10);
/// A think time no test waits out: a turn with it is still running when the test acts.
const FOREVER_MS: u64 = 600_000;

#[derive(Debug, Clone, PartialEq)]
struct Published {
    epoch: i64,
    kind: String,
    data: Value,
}

#[derive(Default)]
struct Fake {
    published: Mutex<Vec<Published>>,
    /// The number of events published so far, to await.
    count: Option<watch::Sender<usize>>,
    checkpoint: Mutex<Option<Vec<u8>>>,
    /// `Leasehold-Checkpoint-Turn` on a checkpoint read: the turn that wrote it.
    checkpoint_turn: Mutex<Option<String>>,
    checkpoint_puts: Mutex<Vec<i64>>,
    /// Checkpoint writes still to answer `503 store_unavailable` with a directive, after
    /// storing them (the store took the write; its answer was lost).
    checkpoint_lost_answers: Mutex<usize>,
    journal: Mutex<Value>,
    /// Every journal read: (turn id, its `Leasehold-Epoch`).
    journal_reads: Mutex<Vec<(String, Option<String>)>>,
}

fn epoch_of(headers: &HeaderMap) -> Option<i64> {
    headers.get("leasehold-epoch")?.to_str().ok()?.parse().ok()
}

async fn get_checkpoint(State(fake): State<Arc<Fake>>) -> Response {
    let Some(bytes) = fake.checkpoint.lock().unwrap().clone() else {
        return (StatusCode::NOT_FOUND, Json(json!({"error": "no_checkpoint"}))).into_response();
    };
    let mut response = (StatusCode::OK, [("leasehold-checkpoint-epoch", "1")], bytes).into_response();
    if let Some(turn) = fake.checkpoint_turn.lock().unwrap().as_deref() {
        response.headers_mut().insert("leasehold-checkpoint-turn", turn.parse().unwrap());
    }
    response
}

async fn put_checkpoint(State(fake): State<Arc<Fake>>, headers: HeaderMap, body: Bytes) -> Response {
    let Some(epoch) = epoch_of(&headers) else { return StatusCode::BAD_REQUEST.into_response() };
    fake.checkpoint_puts.lock().unwrap().push(epoch);
    *fake.checkpoint.lock().unwrap() = Some(body.to_vec());
    let mut lost = fake.checkpoint_lost_answers.lock().unwrap();
    if *lost > 0 {
        *lost -= 1;
        let refusal = json!({"error": "store_unavailable", "retry": {"delay_ms": 10, "budget_ms": 30000}});
        return (StatusCode::SERVICE_UNAVAILABLE, Json(refusal)).into_response();
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn publish(State(fake): State<Arc<Fake>>, headers: HeaderMap, Json(event): Json<Value>) -> Response {
    let Some(epoch) = epoch_of(&headers) else { return StatusCode::BAD_REQUEST.into_response() };
    let kind = event["type"].as_str().unwrap_or_default().to_owned();
    let n = {
        let mut published = fake.published.lock().unwrap();
        published.push(Published { epoch, kind, data: event["data"].clone() });
        published.len()
    };
    fake.count.as_ref().expect("count").send_replace(n);
    (StatusCode::ACCEPTED, Json(json!({ "id": format!("{epoch}-{n}") }))).into_response()
}

async fn journal(
    State(fake): State<Arc<Fake>>,
    Path((_key, turn_id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Json<Value> {
    let epoch = headers.get("leasehold-epoch").and_then(|v| v.to_str().ok()).map(str::to_owned);
    fake.journal_reads.lock().unwrap().push((turn_id, epoch));
    Json(fake.journal.lock().unwrap().clone())
}

/// Kills its server task when dropped.
struct Server(JoinHandle<()>);

impl Drop for Server {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn serve(app: Router) -> (String, Server) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, Server(task))
}

/// A demo agent in front of a fake sidecar.
struct Harness {
    fake: Arc<Fake>,
    count: watch::Receiver<usize>,
    agent: Arc<Agent>,
    agent_url: String,
    http: reqwest::Client,
    _servers: [Server; 2],
}

impl Harness {
    async fn new() -> Harness {
        let (tx, count) = watch::channel(0);
        let fake = Arc::new(Fake { count: Some(tx), journal: Mutex::new(json!([])), ..Fake::default() });
        let sidecar_app = Router::new()
            .route("/v1/sessions/{key}/checkpoint", get(get_checkpoint).put(put_checkpoint))
            .route("/v1/sessions/{key}/events", post(publish))
            .route("/v1/sessions/{key}/turns/{turn_id}/events", get(journal))
            .with_state(fake.clone());
        let (sidecar_url, sidecar) = serve(sidecar_app).await;
        let agent = Arc::new(Agent::new(Sidecar::new(&sidecar_url), "node-t".to_owned()));
        let (agent_url, agent_server) = serve(router(agent.clone())).await;
        Harness {
            fake,
            count,
            agent,
            agent_url,
            http: reqwest::Client::new(),
            _servers: [sidecar, agent_server],
        }
    }

    /// Send a turn as the sidecar does; its answer (status, JSON body).
    fn turn(
        &self,
        key: &str,
        epoch: i64,
        turn_id: &str,
        resume: bool,
        body: Value,
    ) -> impl Future<Output = (StatusCode, Value)> + 'static {
        let mut request = self
            .http
            .post(format!("{}/sessions/{key}/turns", self.agent_url))
            .header("leasehold-epoch", epoch)
            .header("leasehold-turn-id", turn_id)
            .json(&body);
        if resume {
            request = request.header("leasehold-resume", turn_id);
        }
        async move {
            let response = request.send().await.unwrap();
            let status = response.status();
            (status, response.json().await.unwrap())
        }
    }

    async fn cancel(&self, key: &str, turn_id: &str) -> StatusCode {
        let url = format!("{}/sessions/{key}/turns/{turn_id}/cancel", self.agent_url);
        self.http.post(url).send().await.unwrap().status()
    }

    async fn stats(&self) -> StatsView {
        let response = self.http.get(format!("{}/stats", self.agent_url)).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        response.json().await.unwrap()
    }

    /// Wait until at least `n` events were published.
    async fn published_at_least(&mut self, n: usize) {
        let reached = tokio::time::timeout(WAIT, self.count.wait_for(|c| *c >= n)).await.is_ok();
        assert!(reached, "{n} events published; saw {:?}", self.published());
    }

    fn published(&self) -> Vec<Published> {
        self.fake.published.lock().unwrap().clone()
    }

    fn kinds(&self) -> Vec<String> {
        self.published().into_iter().map(|p| p.kind).collect()
    }

    fn checkpoint(&self) -> Option<Value> {
        self.fake.checkpoint.lock().unwrap().as_ref().map(|b| serde_json::from_slice(b).unwrap())
    }

    fn set_checkpoint(&self, state: Value) {
        *self.fake.checkpoint.lock().unwrap() = Some(serde_json::to_vec(&state).unwrap());
    }
}

/// Await `condition` (checked every few ms), failing the test after `WAIT`.
async fn until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !condition() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_turn_publishes_started_indexed_tokens_finished_and_checkpoints() {
    let h = Harness::new().await;
    let (status, answer) = h.turn("s", 1, "t-1", false, json!({"text": "hi", "tokens": 3})).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer, json!({"history_len": 1, "epoch": 1, "node": "node-t"}));
    assert_eq!(h.kinds(), ["turn_started", "token", "token", "token", "turn_finished"]);
    let tokens: Vec<Value> =
        h.published().into_iter().filter(|p| p.kind == "token").map(|p| p.data).collect();
    assert_eq!(
        tokens,
        [json!({"i": 0, "text": "tok0"}), json!({"i": 1, "text": "tok1"}), json!({"i": 2, "text": "tok2"})]
    );
    assert_eq!(h.checkpoint(), Some(json!({"history": ["hi"], "last_turn": "t-1"})));
    assert!(h.fake.journal_reads.lock().unwrap().is_empty(), "a first attempt reads no journal");
    assert_eq!(h.stats().await, StatsView { turns: 1, resumes: 0, cancels: 0, overlapping_turns: 0 });
}

/// A checkpoint write refused with a directive may have landed: the agent writes it
/// again rather than tell the client the turn did not run.
#[tokio::test]
async fn a_checkpoint_refused_with_a_directive_is_written_again_not_passed_on() {
    let h = Harness::new().await;
    *h.fake.checkpoint_lost_answers.lock().unwrap() = 2;
    let (status, answer) = h.turn("s", 3, "t-1", false, json!({"text": "hi", "tokens": 0})).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer, json!({"history_len": 1, "epoch": 3, "node": "node-t"}));
    assert_eq!(*h.fake.checkpoint_puts.lock().unwrap(), [3, 3, 3], "written three times, at its epoch");
    assert_eq!(h.checkpoint(), Some(json!({"history": ["hi"], "last_turn": "t-1"})), "once in the history");
}

#[tokio::test]
async fn the_session_epochs_of_the_turns_sent_are_listed_once_each() {
    let h = Harness::new().await;
    for (key, epoch, id) in [("s", 1, "t-1"), ("s", 1, "t-2"), ("s", 2, "t-3"), ("r", 7, "t-4")] {
        let (status, answer) = h.turn(key, epoch, id, false, json!({"text": id, "tokens": 0})).await;
        assert_eq!(status, StatusCode::OK, "{answer}");
    }
    let response = h.http.get(format!("{}/session-epochs", h.agent_url)).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let listed: Value = response.json().await.unwrap();
    assert_eq!(
        listed,
        json!({"pairs": [
            {"session": "r", "epoch": 7},
            {"session": "s", "epoch": 1},
            {"session": "s", "epoch": 2}
        ], "dropped": 0})
    );
}

#[tokio::test]
async fn a_resumed_turn_publishes_only_what_its_earlier_attempt_did_not() {
    let h = Harness::new().await;
    h.set_checkpoint(json!({"history": ["before"]}));
    // Epoch 1 published turn_started and two tokens, then its owner was lost.
    *h.fake.journal.lock().unwrap() = json!([
        {"id": "1-1", "type": "turn_started", "data": {"text": "hi", "node": "node-a"}},
        {"id": "1-2", "type": "token", "data": {"i": 0, "text": "tok0"}},
        {"id": "1-3", "type": "token", "data": {"i": 1, "text": "tok1"}},
    ]);
    let (status, answer) = h.turn("s", 2, "t-9", true, json!({"text": "hi", "tokens": 5})).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer, json!({"history_len": 2, "epoch": 2, "node": "node-t"}));
    let published = h.published();
    let expected: Vec<Published> = (2..5)
        .map(|i| Published {
            epoch: 2,
            kind: "token".into(),
            data: json!({"i": i, "text": format!("tok{i}")}),
        })
        .chain([Published { epoch: 2, kind: "turn_finished".into(), data: json!({"history_len": 2}) }])
        .collect();
    assert_eq!(published, expected, "no turn_started again, only the tokens not journaled");
    assert_eq!(*h.fake.journal_reads.lock().unwrap(), [("t-9".to_owned(), Some("2".to_owned()))]);
    assert_eq!(h.checkpoint(), Some(json!({"history": ["before", "hi"], "last_turn": "t-9"})));
    assert_eq!(h.stats().await, StatsView { turns: 1, resumes: 1, cancels: 0, overlapping_turns: 0 });
}

#[tokio::test]
async fn a_resumed_turn_whose_attempt_had_checkpointed_appends_nothing_twice() {
    let h = Harness::new().await;
    // Epoch 1 did everything but answer: its checkpoint names the turn.
    h.set_checkpoint(json!({"history": ["a", "hi"], "last_turn": "t-2"}));
    *h.fake.journal.lock().unwrap() = json!([
        {"id": "1-1", "type": "turn_started", "data": {}},
        {"id": "1-2", "type": "token", "data": {"i": 0, "text": "tok0"}},
        {"id": "1-3", "type": "turn_finished", "data": {"history_len": 2}},
    ]);
    let (status, answer) = h.turn("s", 2, "t-2", true, json!({"text": "hi", "tokens": 1})).await;
    assert_eq!((status, answer), (StatusCode::OK, json!({"history_len": 2, "epoch": 2, "node": "node-t"})));
    assert_eq!(h.kinds(), Vec::<String>::new(), "everything was journaled already");
    assert!(h.fake.checkpoint_puts.lock().unwrap().is_empty(), "no second checkpoint");
    assert_eq!(h.checkpoint(), Some(json!({"history": ["a", "hi"], "last_turn": "t-2"})));
}

#[tokio::test]
async fn a_cancelled_turn_stops_at_once_and_publishes_nothing_more() {
    let mut h = Harness::new().await;
    let running = tokio::spawn(h.turn(
        "s",
        1,
        "t-long",
        false,
        json!({"text": "long", "tokens": 3, "think_ms": FOREVER_MS}),
    ));
    h.published_at_least(1).await; // turn_started: it is running, waiting for its first token
    assert_eq!(h.cancel("s", "t-long").await, StatusCode::NO_CONTENT);
    // The cancel is answered once the turn has stopped: its answer is already decided.
    let (status, answer) = tokio::time::timeout(WAIT, running).await.expect("the turn stops").unwrap();
    assert_eq!((status, answer), (StatusCode::CONFLICT, json!({"error": "interrupted"})));
    assert_eq!(h.kinds(), ["turn_started"]);
    assert!(h.fake.checkpoint_puts.lock().unwrap().is_empty(), "a cancelled turn checkpoints nothing");
    assert_eq!(h.stats().await.cancels, 1);

    // The next turn of the session runs as usual, on the state still held.
    let (status, answer) = h.turn("s", 1, "t-next", false, json!({"text": "next", "tokens": 0})).await;
    assert_eq!((status, answer["history_len"].clone()), (StatusCode::OK, json!(1)));
    assert_eq!(h.kinds(), ["turn_started", "turn_started", "turn_finished"]);
    assert_eq!(h.checkpoint(), Some(json!({"history": ["next"], "last_turn": "t-next"})));
}

#[tokio::test]
async fn a_cancel_that_overtook_its_turn_stops_it_before_it_starts() {
    let h = Harness::new().await;
    assert_eq!(h.cancel("s", "t-late").await, StatusCode::NO_CONTENT, "no such turn: still 2xx");
    let (status, answer) = h.turn("s", 1, "t-late", false, json!({"text": "late", "tokens": 2})).await;
    assert_eq!((status, answer), (StatusCode::CONFLICT, json!({"error": "interrupted"})));
    assert!(h.kinds().is_empty(), "it published nothing");
    assert_eq!(h.stats().await.cancels, 1, "cancels received");
    // Another turn of the session is not affected.
    let (status, _) = h.turn("s", 1, "t-other", false, json!({"tokens": 0})).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn a_second_turn_of_a_session_in_flight_is_counted_as_an_overlap() {
    let mut h = Harness::new().await;
    let first =
        tokio::spawn(h.turn("s", 1, "t-a", false, json!({"text": "a", "tokens": 1, "think_ms": FOREVER_MS})));
    h.published_at_least(1).await;
    // Another session's turn at the same time is no overlap.
    let (status, _) = h.turn("other", 1, "t-x", false, json!({"text": "x", "tokens": 0})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(h.stats().await.overlapping_turns, 0);

    // A second turn of "s" while "t-a" runs: the sidecar must never do this.
    let second = tokio::spawn(h.turn("s", 1, "t-b", false, json!({"text": "b", "tokens": 0})));
    let agent = h.agent.clone();
    until("the overlap to be counted", || agent.stats().overlapping_turns == 1).await;
    assert_eq!(h.kinds(), ["turn_started", "turn_started", "turn_finished"], "t-b waits its turn");

    assert_eq!(h.cancel("s", "t-a").await, StatusCode::NO_CONTENT);
    assert_eq!(first.await.unwrap().0, StatusCode::CONFLICT);
    let (status, answer) = tokio::time::timeout(WAIT, second).await.expect("t-b runs").unwrap();
    assert_eq!((status, answer["history_len"].clone()), (StatusCode::OK, json!(1)));
    // One after the other is no overlap; the counter is never reset.
    let (status, _) = h.turn("s", 1, "t-c", false, json!({"text": "c", "tokens": 0})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(h.stats().await, StatsView { turns: 4, resumes: 0, cancels: 1, overlapping_turns: 1 });
}

/// What the sidecar does on `interrupt`: it drops its request to the agent (the
/// connection closes), then sends the cancel, then the next turn.
#[tokio::test]
async fn a_turn_whose_request_was_dropped_then_cancelled_publishes_nothing_more() {
    let mut h = Harness::new().await;
    let running = tokio::spawn(h.turn(
        "s",
        1,
        "t-cut",
        false,
        json!({"text": "cut", "tokens": 2, "think_ms": FOREVER_MS}),
    ));
    h.published_at_least(1).await;
    running.abort(); // the connection to the agent is closed mid-turn
    assert!(running.await.unwrap_err().is_cancelled());
    assert_eq!(h.cancel("s", "t-cut").await, StatusCode::NO_CONTENT);
    assert_eq!(h.kinds(), ["turn_started"], "nothing of it after the cancel was answered");

    let (status, answer) = h.turn("s", 1, "t-next", false, json!({"text": "next", "tokens": 0})).await;
    assert_eq!((status, answer["history_len"].clone()), (StatusCode::OK, json!(1)));
    assert_eq!(h.kinds(), ["turn_started", "turn_started", "turn_finished"]);
    let stats = h.stats().await;
    assert_eq!((stats.cancels, stats.overlapping_turns), (1, 0), "{stats:?}");
}

#[tokio::test]
async fn the_sidecars_checkpoint_turn_tells_a_resume_its_attempt_checkpointed() {
    let h = Harness::new().await;
    // A checkpoint without `last_turn` (written by another agent version), but the sidecar
    // says turn t-3 wrote it.
    h.set_checkpoint(json!({"history": ["a", "hi"]}));
    *h.fake.checkpoint_turn.lock().unwrap() = Some("t-3".to_owned());
    *h.fake.journal.lock().unwrap() = json!([{"id": "1-1", "type": "turn_started", "data": {}}]);
    let (status, answer) = h.turn("s", 2, "t-3", true, json!({"text": "hi", "tokens": 1})).await;
    assert_eq!((status, answer["history_len"].clone()), (StatusCode::OK, json!(2)));
    assert!(h.fake.checkpoint_puts.lock().unwrap().is_empty(), "not appended twice");
    assert_eq!(h.kinds(), ["token", "turn_finished"]);

    // Another turn's checkpoint: a resume of t-4 appends as usual.
    let (status, answer) = h.turn("s", 3, "t-4", true, json!({"text": "next", "tokens": 0})).await;
    assert_eq!((status, answer["history_len"].clone()), (StatusCode::OK, json!(3)));
    assert_eq!(h.checkpoint(), Some(json!({"history": ["a", "hi", "next"], "last_turn": "t-4"})));
}
