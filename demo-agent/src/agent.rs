//! The demo agent's loop for one turn (CONTRACT §4a): thaw unless already held at this
//! epoch → publish `turn_started`, `token`s over `think_ms`, `turn_finished` → append to
//! history → checkpoint → answer. Any fenced write stops it at once.

use std::{
    collections::HashMap,
    future::Future,
    sync::{Arc, Mutex},
    time::Duration,
};

use serde::Deserialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::sidecar::{Sidecar, State, WriteError};

/// A turn's (or event's) body; every field optional.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Input {
    pub text: Option<String>,
    /// For events: the name recorded as `event:<name>`.
    pub name: Option<String>,
    pub think_ms: u64,
    pub tokens: Option<u32>,
}

/// Tokens published when the body does not say.
const DEFAULT_TOKENS: u32 = 5;
/// Upper bound on `think_ms`, so one request cannot park a task for hours.
const MAX_THINK: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Turn,
    Event,
}

/// What the session holds in memory between turns.
#[derive(Debug, Default)]
struct Held {
    epoch: Option<i64>,
    state: State,
}

/// One session's slot: its turns run one at a time; a stand-down cancels `halt`.
#[derive(Debug, Default)]
struct Slot {
    held: tokio::sync::Mutex<Held>,
    halt: CancellationToken,
}

#[derive(Debug)]
pub struct Agent {
    pub sidecar: Sidecar,
    pub node_id: String,
    sessions: Mutex<HashMap<String, Arc<Slot>>>,
}

/// The answer of a successful turn.
#[derive(Debug, PartialEq, Eq)]
pub struct Done {
    pub history_len: usize,
    pub epoch: i64,
}

async fn unless_halted<T>(
    halt: &CancellationToken,
    work: impl Future<Output = Result<T, WriteError>>,
) -> Result<T, WriteError> {
    tokio::select! {
        biased;
        _ = halt.cancelled() => Err(WriteError::Fenced),
        result = work => result,
    }
}

impl Agent {
    pub fn new(sidecar: Sidecar, node_id: String) -> Self {
        Agent { sidecar, node_id, sessions: Mutex::new(HashMap::new()) }
    }

    fn slot(&self, key: &str) -> Arc<Slot> {
        self.sessions.lock().expect("sessions lock").entry(key.to_owned()).or_default().clone()
    }

    /// Drop a session: halt its in-flight turn and forget its state.
    pub fn stand_down(&self, key: &str) {
        if let Some(slot) = self.sessions.lock().expect("sessions lock").remove(key) {
            slot.halt.cancel();
        }
    }

    /// Forget a slot after a failed turn, unless a newer one replaced it already.
    fn forget(&self, key: &str, slot: &Arc<Slot>) {
        let mut sessions = self.sessions.lock().expect("sessions lock");
        if sessions.get(key).is_some_and(|s| Arc::ptr_eq(s, slot)) {
            sessions.remove(key);
        }
    }

    pub async fn run(&self, key: &str, epoch: i64, kind: Kind, input: Input) -> Result<Done, WriteError> {
        let slot = self.slot(key);
        let mut held = slot.held.lock().await; // one turn at a time per session
        let result = self.run_held(key, epoch, kind, input, &slot.halt, &mut held).await;
        if result.is_err() {
            // Fenced or refused: what we hold may be stale; the next turn thaws again.
            *held = Held::default();
            drop(held);
            self.forget(key, &slot);
        }
        result
    }

    async fn run_held(
        &self,
        key: &str,
        epoch: i64,
        kind: Kind,
        input: Input,
        halt: &CancellationToken,
        held: &mut Held,
    ) -> Result<Done, WriteError> {
        if held.epoch != Some(epoch) {
            held.state = unless_halted(halt, self.sidecar.thaw(key)).await?;
            held.epoch = Some(epoch);
        }
        let entry = match kind {
            Kind::Turn => input.text.clone().unwrap_or_default(),
            Kind::Event => format!("event:{}", input.name.as_deref().unwrap_or("event")),
        };
        let publish =
            |kind: &'static str, data| unless_halted(halt, self.sidecar.publish(key, epoch, kind, data));
        publish("turn_started", json!({ "text": entry, "node": self.node_id })).await?;
        let tokens = input.tokens.unwrap_or(DEFAULT_TOKENS);
        let think = Duration::from_millis(input.think_ms).min(MAX_THINK);
        let pause = if tokens == 0 { think } else { think / tokens };
        for i in 0..tokens {
            unless_halted(halt, async {
                tokio::time::sleep(pause).await;
                Ok(())
            })
            .await?;
            publish("token", json!({ "i": i, "text": format!("tok{i}") })).await?;
        }
        if tokens == 0 {
            tokio::time::sleep(pause).await;
        }
        publish("turn_finished", json!({ "history_len": held.state.history.len() + 1 })).await?;
        let mut next = held.state.clone();
        next.history.push(entry);
        unless_halted(halt, self.sidecar.checkpoint(key, epoch, &next)).await?;
        held.state = next;
        Ok(Done { history_len: held.state.history.len(), epoch })
    }

    /// Release a session that has been idle (the sidecar stops renewing it).
    pub async fn release(&self, key: &str) -> Result<(), WriteError> {
        let slot = self.slot(key);
        let epoch = slot.held.lock().await.epoch;
        self.forget(key, &slot);
        match epoch {
            Some(epoch) => self.sidecar.release(key, epoch).await,
            None => Ok(()),
        }
    }
}
