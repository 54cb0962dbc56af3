//! Serving a router on a listener with the limits every listener needs: slow clients
//! cannot hold a connection open forever, oversized headers are refused, and shutdown is
//! graceful.

use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::{rt::TokioIo, server::graceful::GracefulShutdown, service::TowerToHyperService};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::head_timer::{self, HeadTimeouts};

/// A client must send its request headers within this of their first byte, or of
/// connecting for a connection's first request (slowloris protection).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// A keep-alive connection with no request for this long is closed (see the constant).
pub const IDLE_TIMEOUT: Duration = leasehold_core::lifecycle::IDLE_CONNECTION;
/// A request body must arrive within this once the headers are in.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Upper bound on the request head (request line + headers); larger gets 431.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// How long shutdown waits for open connections (streams, turns) to finish.
pub const GRACEFUL_SHUTDOWN: Duration = Duration::from_secs(1);
/// Back-off after a failed accept (e.g. out of file descriptors) so we do not spin.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(50);

pub async fn serve(listener: TcpListener, router: Router, shutdown: CancellationToken) {
    let timeouts = HeadTimeouts { header_read: HEADER_READ_TIMEOUT, idle: IDLE_TIMEOUT };
    serve_with(listener, router, shutdown, timeouts).await;
}

/// [`serve`] with other bounds on waiting for a request head.
pub async fn serve_with(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
    timeouts: HeadTimeouts,
) {
    let router = router.layer(tower_http::timeout::RequestBodyTimeoutLayer::new(BODY_READ_TIMEOUT));
    // HTTP/1 only: hyper-util's auto builder first waits, without a bound, for bytes to
    // tell HTTP/1 from HTTP/2, so a connection that sends nothing would be kept forever.
    let mut builder = http1::Builder::new();
    builder
        .header_read_timeout(timeouts.header_read)
        .max_header_size(MAX_HEAD_BYTES)
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
        let (stream, timer) = head_timer::watch(stream, timeouts);
        let conn = builder.clone().timer(timer).serve_connection(TokioIo::new(stream), service);
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

#[cfg(test)]
mod tests;
