//! A trivial agent for benchmarks: answers every turn at once, writes nothing. The bench
//! binary runs itself in this role (`LEASEHOLD_BENCH_ROLE=trivial-agent`), so the cost
//! measured is the data plane's, not an agent's.

use std::path::PathBuf;

use axum::{routing::post, Json, Router};

const ROLE_ENV: &str = "LEASEHOLD_BENCH_ROLE";
const ROLE: &str = "trivial-agent";

/// If this process was started as the trivial agent, serve until killed and return true.
pub async fn serve_if_requested() -> bool {
    if std::env::var(ROLE_ENV).as_deref() != Ok(ROLE) {
        return false;
    }
    let listen = std::env::args().skip_while(|a| a != "--listen").nth(1).expect("--listen");
    let app = Router::new()
        .route("/sessions/{key}/turns", post(|| async { Json(serde_json::json!({ "ok": true })) }));
    let listener = tokio::net::TcpListener::bind(listen).await.expect("bind the trivial agent");
    axum::serve(listener, app).await.expect("serve the trivial agent");
    true
}

/// The `agent_command` of `ClusterOptions` that runs this executable as the agent.
pub fn command() -> (PathBuf, Vec<(String, String)>) {
    (std::env::current_exe().expect("current exe"), vec![(ROLE_ENV.into(), ROLE.into())])
}
