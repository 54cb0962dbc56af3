//! What the fan-out benches share (`benches/observe.rs`, `benches/peers_centrifugo.rs`):
//! lean SSE readers that report publish → delivery latency, the publish timestamp they
//! read, leasehold's claim and publish, and percentiles.
//!
//! The method, the same for every server measured: the publisher puts its wall clock in
//! microseconds into the event's payload as `"t":<µs>`; each reader, on receiving a
//! complete SSE frame, subtracts that from its own clock (same machine, same clock).

use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use futures_util::StreamExt;
use serde_json::json;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    sync::mpsc,
};

use crate::Cluster;

/// The wall clock in microseconds since the epoch: the publish timestamp in payloads.
pub fn micros() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970").as_micros() as u64
}

/// The payload every publisher sends: `{"t": <now in µs>}`.
pub fn stamped() -> serde_json::Value {
    json!({ "t": micros() })
}

/// Open `count` SSE readers of `GET {target}` at `authority` (`host:port`); each sends
/// one latency (µs) into `tx` per event received. Returns once every reader's response
/// head said `200`.
///
/// The readers are lean (one socket each, frames scanned for the publish timestamp in
/// place) so that a bench measures delivery, not its own parsing: with reqwest + a full
/// SSE and JSON parse per frame, 1000 reader tasks cost more CPU than the sidecars on a
/// two-core machine (BENCHMARKS.md has both). Anything in a frame that reads `"t":<digits>`
/// counts as one event, so payloads must carry nothing else of that shape.
pub async fn lean_sse_readers(
    authority: &str,
    target: &str,
    count: usize,
    tx: &mpsc::UnboundedSender<u64>,
) -> anyhow::Result<()> {
    let request = format!("GET {target} HTTP/1.1\r\nhost: {authority}\r\naccept: text/event-stream\r\n\r\n");
    for _ in 0..count {
        let mut socket =
            TcpStream::connect(authority).await.with_context(|| format!("connecting to {authority}"))?;
        socket.set_nodelay(true)?;
        socket.write_all(request.as_bytes()).await.with_context(|| format!("GET {target}"))?;
        // The response head first, so that a refusal fails the bench rather than a task.
        let mut buf = Vec::with_capacity(16 * 1024);
        let end = loop {
            if let Some(end) = find(&buf, b"\r\n\r\n") {
                break end;
            }
            let read = socket.read_buf(&mut buf).await.with_context(|| format!("GET {target}: head"))?;
            anyhow::ensure!(read > 0, "GET {target}: closed before a response head");
        };
        anyhow::ensure!(
            buf.starts_with(b"HTTP/1.1 200"),
            "GET {target}: {}",
            String::from_utf8_lossy(&buf[..end])
        );
        buf.drain(..end + 4);
        let tx = tx.clone();
        tokio::spawn(async move {
            loop {
                // Complete SSE frames end with a blank line; chunk framing lies between them.
                if let Some(last) = rfind(&buf, b"\n\n") {
                    let now = micros();
                    for sent in timestamps(&buf[..last]) {
                        let _ = tx.send(now.saturating_sub(sent));
                    }
                    buf.drain(..last + 2);
                }
                match socket.read_buf(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        });
    }
    Ok(())
}

/// Every `"t":<digits>` in `frames`, in order.
fn timestamps(frames: &[u8]) -> Vec<u64> {
    let mut found = Vec::new();
    let mut rest = frames;
    while let Some(at) = find(rest, b"\"t\":") {
        rest = &rest[at + 4..];
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if let Some(t) = std::str::from_utf8(&rest[..digits]).ok().and_then(|d| d.parse().ok()) {
            found.push(t);
        }
    }
    found
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn rfind(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).rposition(|w| w == needle)
}

/// The `q` quantile of `sorted` latencies (µs), in milliseconds; `NaN` if there are none.
pub fn percentile_ms(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)] as f64 / 1000.0
}

/// Claim every key on node 0 (a turn each, 32 at a time): node 0 then owns them at epoch 1.
pub async fn claim_all(cluster: &Cluster, keys: &[String]) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let base = cluster.nodes[0].public_url();
    futures_util::stream::iter(keys.iter().cloned())
        .map(|key| {
            let (http, base) = (http.clone(), base.clone());
            async move {
                let r = http.post(format!("{base}/v1/sessions/{key}/turns")).send().await?;
                anyhow::ensure!(r.status().is_success(), "claiming {key}: {}", r.status());
                Ok(())
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<anyhow::Result<()>>>()
        .await
        .into_iter()
        .collect()
}

/// Publish one stamped event of `kind` through the agent API at `agent_api` (the owner's),
/// fenced at `epoch`.
pub async fn publish(
    http: &reqwest::Client,
    agent_api: &str,
    key: &str,
    epoch: i64,
    kind: &str,
) -> anyhow::Result<()> {
    let body = json!({ "type": kind, "data": stamped() }).to_string();
    let response = http
        .post(format!("{agent_api}/v1/sessions/{key}/events"))
        .header("leasehold-epoch", epoch)
        .body(body)
        .send()
        .await
        .with_context(|| format!("publishing to {key}"))?;
    anyhow::ensure!(response.status() == 202, "publishing to {key}: {}", response.status());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stamp_in_the_frames_is_read_in_order() {
        let leasehold =
            b"id: 3\nevent: token\ndata: {\"type\":\"token\",\"data\":{\"t\":1700000000000001}}\n\n";
        let centrifugo =
            b"\r\n3f\r\ndata: {\"channel\":\"c\",\"pub\":{\"data\":{\"t\":1700000000000002}}}\n\n\r\n";
        let ping = b"data: {}\n\n";
        let frames = [&leasehold[..], &centrifugo[..], &ping[..]].concat();
        assert_eq!(timestamps(&frames), [1_700_000_000_000_001, 1_700_000_000_000_002]);
        assert!(timestamps(b"data: {\"connect\":{\"client\":\"x\",\"ping\":25}}\n\n").is_empty());
    }

    #[test]
    fn percentiles_pick_from_the_sorted_latencies() {
        let sorted: Vec<u64> = (1..=100).map(|i| i * 1000).collect();
        assert_eq!(percentile_ms(&sorted, 0.5), 51.0);
        assert_eq!(percentile_ms(&sorted, 0.99), 100.0);
        assert!(percentile_ms(&[], 0.5).is_nan());
    }
}
