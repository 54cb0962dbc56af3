//! An SSE observer of `/v1/sessions/{key}/stream` on one pod, through the pod proxy (the
//! API server streams `text/event-stream` unbuffered). Frames are parsed by the
//! sidecar's own parser.

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::BodyExt;
use leasehold_sidecar::observe::sse;
pub use leasehold_sidecar::observe::sse::Frame;
use tokio::{sync::mpsc, task::JoinHandle, time::Instant};

use crate::proxy::{PodProxy, PUBLIC_PORT};

#[derive(Debug)]
pub struct Observer {
    pub pod: String,
    frames: mpsc::UnboundedReceiver<(Frame, Instant)>,
    task: JoinHandle<()>,
    /// Every frame received so far, in order, with when it arrived.
    pub seen: Vec<(Frame, Instant)>,
}

impl Observer {
    /// Open the stream of `key` on `pod`, optionally resuming after `last_event_id`.
    pub async fn open(
        proxy: &PodProxy,
        pod: &str,
        key: &str,
        last_event_id: Option<&str>,
    ) -> anyhow::Result<Observer> {
        let headers: Vec<(&str, String)> =
            last_event_id.map(|id| ("last-event-id", id.to_owned())).into_iter().collect();
        let response =
            proxy.open_stream(pod, PUBLIC_PORT, &format!("/v1/sessions/{key}/stream"), &headers).await?;
        if !response.status().is_success() {
            let status = response.status();
            let body = response.into_body().collect_bytes().await.unwrap_or_default();
            anyhow::bail!("stream on {pod} refused: {status} {}", String::from_utf8_lossy(&body));
        }
        // The sidecar's parser reads a reqwest byte stream; feed it ours, ending at the
        // first transport error (the stream closed).
        let bytes = response
            .into_body()
            .into_data_stream()
            .take_while(|chunk| std::future::ready(chunk.is_ok()))
            .map(|chunk| Ok::<Bytes, reqwest::Error>(chunk.unwrap_or_default()));
        let (tx, frames) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            let mut parsed = sse::parse(Box::pin(bytes));
            while let Some(Ok(frame)) = parsed.next().await {
                if tx.send((frame, Instant::now())).is_err() {
                    break;
                }
            }
        });
        Ok(Observer { pod: pod.to_owned(), frames, task, seen: Vec::new() })
    }

    /// The next frame, or `None` on timeout or end of stream.
    pub async fn next(&mut self, timeout: Duration) -> Option<Frame> {
        let (frame, at) = tokio::time::timeout(timeout, self.frames.recv()).await.ok().flatten()?;
        self.seen.push((frame.clone(), at));
        Some(frame)
    }

    /// Read until a frame satisfies `done` (inclusive) or `timeout` passes in total.
    pub async fn until(&mut self, timeout: Duration, done: impl Fn(&Frame) -> bool) -> anyhow::Result<Frame> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next(left).await {
                Some(frame) if done(&frame) => return Ok(frame),
                Some(_) => continue,
                None => anyhow::bail!(
                    "stream on {} ended or timed out; seen so far: {:?}",
                    self.pod,
                    self.frames_seen()
                ),
            }
        }
    }

    pub fn frames_seen(&self) -> Vec<&Frame> {
        self.seen.iter().map(|(f, _)| f).collect()
    }

    /// Ids of the event frames seen, in order.
    pub fn ids(&self) -> Vec<String> {
        self.seen.iter().filter_map(|(f, _)| f.id.clone()).collect()
    }

    /// Event frames (those with an id) seen so far.
    pub fn events(&self) -> usize {
        self.seen.iter().filter(|(f, _)| f.id.is_some()).count()
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Parse `<epoch>-<seq>` ids, asserting they strictly increase.
pub fn strictly_increasing(ids: &[String]) -> Result<Vec<(i64, u64)>, String> {
    let mut parsed = Vec::with_capacity(ids.len());
    for id in ids {
        let (e, s) = id.split_once('-').ok_or_else(|| format!("malformed id {id:?}"))?;
        let pair = (
            e.parse().map_err(|_| format!("malformed id {id:?}"))?,
            s.parse().map_err(|_| format!("malformed id {id:?}"))?,
        );
        parsed.push(pair);
    }
    if parsed.windows(2).all(|w| w[0] < w[1]) {
        Ok(parsed)
    } else {
        Err(format!("ids must strictly increase: {ids:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_and_must_increase() {
        let ids: Vec<String> = ["1-1", "1-2", "2-1"].iter().map(|s| s.to_string()).collect();
        assert_eq!(strictly_increasing(&ids).unwrap(), vec![(1, 1), (1, 2), (2, 1)]);
        let back: Vec<String> = ["1-2", "1-1"].iter().map(|s| s.to_string()).collect();
        assert!(strictly_increasing(&back).is_err());
        assert!(strictly_increasing(&["x".to_owned()]).is_err());
    }
}
