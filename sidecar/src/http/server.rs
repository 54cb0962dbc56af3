//! Serving a router on a listener with the limits every listener needs: slow clients
//! cannot hold a connection open forever, oversized headers are refused, and shutdown is
//! graceful.

use std::time::Duration;

use axum::Router;
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::{conn::auto, graceful::GracefulShutdown},
    service::TowerToHyperService,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// A client must send its request headers within this (slowloris protection).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// A request body must arrive within this once the headers are in.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Upper bound on the request head (request line + headers); larger gets 431.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// How long shutdown waits for open connections (streams, turns) to finish.
pub const GRACEFUL_SHUTDOWN: Duration = Duration::from_secs(1);
/// Back-off after a failed accept (e.g. out of file descriptors) so we do not spin.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(50);

pub async fn serve(listener: TcpListener, router: Router, shutdown: CancellationToken) {
    let router = router.layer(tower_http::timeout::RequestBodyTimeoutLayer::new(BODY_READ_TIMEOUT));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_HEAD_BYTES);
    let graceful = GracefulShutdown::new();
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service).into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    // Refuse new connections now (a clean "not connected" for a forwarder) rather than
    // leave them unanswered in the backlog while open ones finish.
    drop(listener);
    if tokio::time::timeout(GRACEFUL_SHUTDOWN, graceful.shutdown()).await.is_err() {
        tracing::debug!("connections still open at shutdown; closing them");
    }
}
