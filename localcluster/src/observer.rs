//! A test observer: an SSE client of `/v1/sessions/{key}/stream` that collects frames.

use std::time::Duration;

use futures_util::StreamExt;
use leasehold_sidecar::observe::sse;
pub use leasehold_sidecar::observe::sse::Frame;
use tokio::{sync::mpsc, task::JoinHandle};

/// Whether `frame` is the demo agent's `turn_finished` for the turn that made the
/// session's history `history_len` long.
pub fn turn_finished(history_len: u64) -> impl Fn(&Frame) -> bool {
    move |f| {
        f.event.as_deref() == Some("turn_finished")
            && f.data.contains(&format!("\"history_len\":{history_len}"))
    }
}

#[derive(Debug)]
pub struct Observer {
    frames: mpsc::UnboundedReceiver<Frame>,
    task: JoinHandle<()>,
    /// Every frame received so far, in order.
    pub seen: Vec<Frame>,
}

impl Observer {
    /// Connect to `url` (a stream URL), optionally resuming after `last_event_id`.
    pub async fn open(url: &str, last_event_id: Option<&str>) -> anyhow::Result<Observer> {
        let mut req = reqwest::Client::new().get(url);
        if let Some(id) = last_event_id {
            req = req.header("last-event-id", id);
        }
        let response = req.send().await?;
        anyhow::ensure!(response.status().is_success(), "stream refused: {}", response.status());
        let (tx, frames) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            let mut parsed = sse::parse(response.bytes_stream());
            while let Some(Ok(frame)) = parsed.next().await {
                if tx.send(frame).is_err() {
                    break;
                }
            }
        });
        Ok(Observer { frames, task, seen: Vec::new() })
    }

    /// The next frame, or `None` on timeout or end of stream.
    pub async fn next(&mut self, timeout: Duration) -> Option<Frame> {
        let frame = tokio::time::timeout(timeout, self.frames.recv()).await.ok().flatten()?;
        self.seen.push(frame.clone());
        Some(frame)
    }

    /// Read until a frame satisfies `done` (inclusive) or `timeout` passes in total.
    pub async fn until(&mut self, timeout: Duration, done: impl Fn(&Frame) -> bool) -> anyhow::Result<Frame> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.next(left).await {
                Some(frame) if done(&frame) => return Ok(frame),
                Some(_) => continue,
                None => anyhow::bail!("stream ended or timed out; seen so far: {:?}", self.seen),
            }
        }
    }

    /// Whether the stream has ended (the server closed it).
    pub fn closed(&self) -> bool {
        self.task.is_finished() && self.frames.is_empty()
    }

    /// Ids of the event frames seen, in order.
    pub fn ids(&self) -> Vec<String> {
        self.seen.iter().filter_map(|f| f.id.clone()).collect()
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
