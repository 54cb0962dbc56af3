//! The follower: one task per observed session on a node, keeping its hub fed from the
//! session's current owner. It resolves with a read (never a claim), streams from the
//! owner's peer port, and re-resolves whenever ownership changes or the stream ends.

use std::{sync::Arc, time::Duration};

use futures_util::StreamExt;
use tokio::sync::watch;

use leasehold_core::{store::Holder, Epoch, EventId, SessionKey};

use super::{sse, Hubs};
use crate::{forward::Forwarder, metrics::Metrics, ownership::Ownership};

/// Without a notification, re-check ownership this often. Every change of a session's
/// owner is notified (a claim, takeover, release, hand-back or revocation; a lost LISTEN
/// connection re-checks everything), so this is only a backstop: a node's idle and owned
/// sessions cost no database reads while nothing changes.
const RECHECK: Duration = Duration::from_secs(30);
/// Pause before retrying after the store or the owner could not be reached.
const RETRY: Duration = Duration::from_millis(250);

#[derive(Debug)]
pub struct Follow {
    pub hubs: Arc<Hubs>,
    pub ownership: Arc<Ownership>,
    pub forwarder: Arc<Forwarder>,
    pub metrics: Arc<Metrics>,
    pub draining: watch::Receiver<bool>,
}

/// Wait for an ownership change (or for observers to leave), at most `timeout`.
async fn wait(changes: &mut watch::Receiver<u64>, timeout: Duration) {
    let _ = tokio::time::timeout(timeout, changes.changed()).await;
}

impl Follow {
    pub fn start(self: &Arc<Self>, key: SessionKey) {
        tokio::spawn(self.clone().run(key));
    }

    async fn run(self: Arc<Self>, key: SessionKey) {
        let mut changes = self.hubs.changes(&key);
        loop {
            let owned_here = self.ownership.holds(&key);
            if (self.hubs.observers_of(&key) == 0 || *self.draining.borrow())
                && self.hubs.follower_done(&key, owned_here)
            {
                return;
            }
            changes.borrow_and_update();
            let (holder, epoch) = match self.ownership.lookup(&key).await {
                Ok(info) => (info.holder, info.epoch),
                Err(e) => {
                    tracing::debug!(%key, error = %e, "follower cannot read the lease");
                    wait(&mut changes, RETRY).await;
                    continue;
                }
            };
            match holder {
                None => {
                    self.hubs.set_idle(&key, epoch);
                    wait(&mut changes, RECHECK).await;
                }
                // We own it: our agent's publishes feed the hub directly.
                Some(holder) if holder.owner == self.ownership.node().owner => {
                    self.hubs.mark_primed(&key);
                    wait(&mut changes, RECHECK).await;
                }
                Some(holder) => {
                    self.metrics.upstreams(1);
                    self.upstream(&key, &holder, &mut changes).await;
                    self.metrics.upstreams(-1);
                }
            }
        }
    }

    /// Relay the owner's stream into our hub until it ends or ownership changes.
    async fn upstream(&self, key: &SessionKey, holder: &Holder, changes: &mut watch::Receiver<u64>) {
        // Continue after what we have; with nothing yet, backfill all the owner buffers.
        let after = self.hubs.last_id(key).unwrap_or(EventId { epoch: Epoch(0), seq: 0 });
        let response = match self.forwarder.subscribe(holder, key, Some(after)).await {
            Ok(response) if response.status().is_success() => response,
            Ok(response) if response.status() == reqwest::StatusCode::UNAUTHORIZED => {
                // Counted, not logged per retry: the forwarded turns log it (and the
                // owner logs every rejection).
                self.metrics.peer_rejected();
                tracing::debug!(%key, owner = %holder.owner, "owner rejected this node's peer proof");
                return wait(changes, RECHECK).await;
            }
            Ok(response) => {
                tracing::debug!(%key, status = %response.status(), "owner refused the stream");
                return wait(changes, RETRY).await;
            }
            Err(e) => {
                // Its lease is live but it does not answer (dead, frozen, partitioned):
                // nothing changes before the lease runs out or someone takes over
                // (notified), so wait for that instead of re-reading the lease.
                tracing::debug!(%key, error = %e, "owner stream unreachable");
                return wait(changes, holder.remaining.clamp(RETRY, RECHECK)).await;
            }
        };
        let mut frames = sse::parse(response.bytes_stream());
        loop {
            tokio::select! {
                _ = changes.changed() => return,
                frame = frames.next() => match frame {
                    Some(Ok(frame)) => match frame.to_event() {
                        Some(event) => {
                            self.hubs.ingest(key, event);
                        }
                        None if frame.event.as_deref() == Some("primed") => self.hubs.mark_primed(key),
                        // `moved` or `reconnect`: the owner stopped serving it.
                        None if matches!(frame.event.as_deref(), Some("moved" | "reconnect")) => return,
                        None => {}
                    },
                    Some(Err(e)) => {
                        tracing::debug!(%key, error = %e, "owner stream broke");
                        return;
                    }
                    None => return,
                },
            }
        }
    }
}
