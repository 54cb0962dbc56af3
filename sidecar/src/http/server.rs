//! Serving a router on a listener with the limits every listener needs: slow clients
//! cannot hold a connection open forever, oversized headers are refused, and shutdown is
//! graceful.

use std::{sync::Arc, time::Duration};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::{rt::TokioIo, server::graceful::GracefulShutdown, service::TowerToHyperService};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::Semaphore,
};
use tokio_util::sync::CancellationToken;

use super::head_timer::{self, HeadTimeouts};
use crate::turn::directive::Refusal;

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

/// Connections answered `503 overloaded` at once while a listener is at its cap; past
/// this many such answers in flight, further connections are closed unanswered.
const MAX_REFUSALS_IN_FLIGHT: usize = 256;
/// A refused connection's request head is awaited this long before the answer goes out
/// (an HTTP client takes an answer that comes before its request as a broken exchange)...
const REFUSAL_HEAD_WAIT: Duration = Duration::from_millis(200);
/// ...writing the canned `overloaded` answer may take this long...
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// ...and then what the client still sends is read for this long before the close, so
/// the close is not a reset that loses the answer on its way.
const REFUSAL_LINGER: Duration = Duration::from_millis(100);
/// At most this much of a refused connection's request is read and dropped.
const REFUSAL_DRAIN_BYTES: usize = 64 * 1024;

/// Serve `router` on `listener` with at most `max_connections` open at once.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
    max_connections: usize,
) {
    let timeouts = HeadTimeouts { header_read: HEADER_READ_TIMEOUT, idle: IDLE_TIMEOUT };
    serve_with(listener, router, shutdown, timeouts, max_connections, None).await;
}

/// Connections the admin listener admits past its cap, for `probes` only: a flood of idle
/// connections that fills the cap must not lock the kubelet's probes out (a failed
/// liveness probe restarts the pod).
pub const PROBE_RESERVE: usize = 32;
/// A connection on the probe reserve sends its one request within this, or is closed: it
/// frees its place quickly (a probe sends at once).
pub const PROBE_HEADER_READ_TIMEOUT: Duration = Duration::from_millis(500);

/// [`serve`], and past the cap up to [`PROBE_RESERVE`] more connections, each served one
/// request by `probes` (health and readiness) and then closed.
pub async fn serve_with_probe_reserve(
    listener: TcpListener,
    router: Router,
    probes: Router,
    shutdown: CancellationToken,
    max_connections: usize,
) {
    let timeouts = HeadTimeouts { header_read: HEADER_READ_TIMEOUT, idle: IDLE_TIMEOUT };
    serve_with(listener, router, shutdown, timeouts, max_connections, Some(probes)).await;
}

/// The answer to a connection over the cap: `503` with the `overloaded` directive.
fn overloaded_answer() -> Vec<u8> {
    let refusal = Refusal::Overloaded;
    let body = serde_json::to_string(&refusal.body()).expect("a refusal serializes");
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: {}\r\n\
         leasehold-refusal: {}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        refusal.retry_after_secs(),
        refusal.code(),
        body.len()
    )
    .into_bytes()
}

/// Read and drop what `stream` sends, up to the end of a request head (or `limit` bytes,
/// or the end of the stream).
async fn read_head(stream: &mut TcpStream, limit: usize) {
    let (mut seen, mut buf) = (Vec::new(), [0u8; 4096]);
    while seen.len() < limit && !seen.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    }
}

/// Answer a connection over the cap, bounded in time and in how many are answered at once.
fn refuse(mut stream: TcpStream, refusals: &Arc<Semaphore>) {
    let Ok(permit) = refusals.clone().try_acquire_owned() else { return }; // closed unanswered
    tokio::spawn(async move {
        let _ = tokio::time::timeout(REFUSAL_HEAD_WAIT, read_head(&mut stream, REFUSAL_DRAIN_BYTES)).await;
        let answer = overloaded_answer();
        let written = async {
            stream.write_all(&answer).await?;
            stream.shutdown().await
        };
        if let Ok(Ok(())) = tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, written).await {
            let _ = tokio::time::timeout(REFUSAL_LINGER, read_head(&mut stream, REFUSAL_DRAIN_BYTES)).await;
        }
        drop(permit);
    });
}

/// [`serve`] with other bounds on waiting for a request head.
pub async fn serve_with(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
    timeouts: HeadTimeouts,
    max_connections: usize,
    probes: Option<Router>,
) {
    let open = Arc::new(Semaphore::new(max_connections));
    let reserve = Arc::new(Semaphore::new(PROBE_RESERVE));
    let probe_timeouts =
        HeadTimeouts { header_read: PROBE_HEADER_READ_TIMEOUT, idle: PROBE_HEADER_READ_TIMEOUT };
    let refusals = Arc::new(Semaphore::new(MAX_REFUSALS_IN_FLIGHT));
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
        let admitted = match (open.clone().try_acquire_owned(), &probes) {
            (Ok(permit), _) => Some((permit, &router, timeouts, true)),
            (Err(_), Some(probes)) => {
                reserve.clone().try_acquire_owned().ok().map(|permit| (permit, probes, probe_timeouts, false))
            }
            (Err(_), None) => None,
        };
        let Some((permit, router, timeouts, keep_alive)) = admitted else {
            refuse(stream, &refusals);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let (stream, timer) = head_timer::watch(stream, timeouts);
        let mut builder = builder.clone();
        builder.keep_alive(keep_alive);
        let conn = builder.timer(timer).serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(permit);
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
