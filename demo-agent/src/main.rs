//! `leasehold-demo-agent`: a small, honest reference agent (CONTRACT §4a).

mod agent;
mod sidecar;
#[cfg(test)]
mod tests;

use std::{net::SocketAddr, sync::Arc};

use anyhow::Context;
use axum::{
    body::Bytes,
    extract::{Path, State},
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use clap::Parser;
use serde_json::json;

use crate::{
    agent::{Agent, Input, Kind, SessionEpochsView, StatsView, TurnIds},
    sidecar::{Sidecar, WriteError},
};

#[derive(Debug, Parser)]
#[command(name = "leasehold-demo-agent", version, about = "Reference agent for leasehold")]
struct Args {
    /// Where the agent listens for turns from its sidecar.
    #[arg(long, env = "DEMO_AGENT_LISTEN", default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// The sidecar's agent API.
    #[arg(long, env = "LEASEHOLD_SIDECAR_URL", default_value = "http://127.0.0.1:8082")]
    sidecar_url: String,
    /// The node name reported in answers [default: $POD_NAME, else the hostname].
    #[arg(long, env = "LEASEHOLD_NODE_ID")]
    node_id: Option<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let node_id = args
        .node_id
        .or_else(|| std::env::var("POD_NAME").ok())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "demo".to_owned());
    let agent = Arc::new(Agent::new(Sidecar::new(&args.sidecar_url), node_id));
    let app = router(agent);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("--listen: cannot listen on {}", args.listen))?;
    tracing::info!(listen = %args.listen, "demo agent ready");
    axum::serve(listener, app).await.context("serving")
}

/// The agent contract (CONTRACT §4) and the demo's own hooks.
fn router(agent: Arc<Agent>) -> Router {
    Router::new()
        .route("/sessions/{key}/turns", post(turn))
        .route("/sessions/{key}/events", post(event))
        .route("/sessions/{key}/turns/{turn_id}/cancel", post(cancel))
        .route("/sessions/{key}/stand-down", post(stand_down))
        .route("/sessions/{key}/release", post(release))
        .route("/stats", get(stats))
        .route("/session-epochs", get(session_epochs))
        .route("/hooks/pre-stop", get(pre_stop_hook))
        .with_state(agent)
}

/// A target for a user's own preStop hook (the e2e suite's): logs that it was called.
async fn pre_stop_hook(State(agent): State<Arc<Agent>>) -> Response {
    tracing::info!(node = %agent.node_id, "pre-stop hook called");
    Json(json!({ "hook": "pre-stop", "node": agent.node_id })).into_response()
}

fn error(status: StatusCode, code: &str, message: String) -> Response {
    (status, Json(json!({ "error": code, "message": message }))).into_response()
}

async fn turn(state: State<Arc<Agent>>, key: Path<String>, headers: HeaderMap, body: Bytes) -> Response {
    handle(state, key, headers, body, Kind::Turn).await
}

async fn event(state: State<Arc<Agent>>, key: Path<String>, headers: HeaderMap, body: Bytes) -> Response {
    handle(state, key, headers, body, Kind::Event).await
}

async fn handle(
    State(agent): State<Arc<Agent>>,
    Path(key): Path<String>,
    headers: HeaderMap,
    body: Bytes,
    kind: Kind,
) -> Response {
    let Some(epoch) = headers.get("leasehold-epoch").and_then(|v| v.to_str().ok()?.parse::<i64>().ok())
    else {
        return error(StatusCode::BAD_REQUEST, "missing_epoch", "Leasehold-Epoch header is required".into());
    };
    let input: Input = if body.iter().all(u8::is_ascii_whitespace) {
        Input::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(input) => input,
            Err(e) => return error(StatusCode::BAD_REQUEST, "malformed_json", e.to_string()),
        }
    };
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let ids = TurnIds { turn_id: header("leasehold-turn-id"), resume: header("leasehold-resume") };
    match agent.run(&key, epoch, kind, ids, input).await {
        Ok(done) => {
            Json(json!({ "history_len": done.history_len, "epoch": done.epoch, "node": agent.node_id }))
                .into_response()
        }
        Err(WriteError::Fenced) => (StatusCode::CONFLICT, Json(json!({ "error": "fenced" }))).into_response(),
        // The sidecar answers the interrupted turn's client itself; this answer is only
        // for the record.
        Err(WriteError::Cancelled) => {
            (StatusCode::CONFLICT, Json(json!({ "error": "interrupted" }))).into_response()
        }
        Err(WriteError::Refused { status, retry_after, body }) => {
            let mut response = (status, body).into_response();
            if let Some(retry_after) = retry_after.and_then(|v| v.parse().ok()) {
                response.headers_mut().insert("retry-after", retry_after);
            }
            response.headers_mut().insert("content-type", "application/json".parse().expect("static"));
            response
        }
        Err(WriteError::Http(e)) => error(StatusCode::BAD_GATEWAY, "sidecar_unreachable", e.to_string()),
        Err(e @ WriteError::BadCheckpoint(_)) => {
            error(StatusCode::INTERNAL_SERVER_ERROR, "bad_checkpoint", e.to_string())
        }
        Err(e @ WriteError::BadJournal(_)) => error(StatusCode::BAD_GATEWAY, "bad_journal", e.to_string()),
    }
}

async fn stand_down(State(agent): State<Arc<Agent>>, Path(key): Path<String>) -> StatusCode {
    agent.stand_down(&key);
    StatusCode::NO_CONTENT
}

/// Operator/test hook: the session idled out; release its lease now.
async fn release(State(agent): State<Arc<Agent>>, Path(key): Path<String>) -> Response {
    match agent.release(&key).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => error(StatusCode::CONFLICT, "release_failed", e.to_string()),
    }
}

/// `POST /sessions/{key}/turns/{turn_id}/cancel`: a newer turn interrupted this one. It
/// stops at once and publishes nothing more; answered once it has stopped.
async fn cancel(State(agent): State<Arc<Agent>>, Path((key, turn_id)): Path<(String, String)>) -> StatusCode {
    let running = agent.cancel(&key, &turn_id).await;
    tracing::info!(session = key, turn = turn_id, running, "turn cancelled");
    StatusCode::NO_CONTENT
}

/// `GET /session-epochs`: the (session, epoch) pairs of the turns this agent was sent.
async fn session_epochs(State(agent): State<Arc<Agent>>) -> Json<SessionEpochsView> {
    Json(agent.session_epochs())
}

/// `GET /stats`: the agent's counters (`overlapping_turns` must stay 0).
async fn stats(State(agent): State<Arc<Agent>>) -> Json<StatsView> {
    Json(agent.stats())
}
