//! The agent side of the sidecar's agent API (CONTRACT §5).

use bytes::Bytes;
use reqwest::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::json;

/// How a write through the sidecar ended, when it did not land.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// `409`: this node no longer owns the session; stop at once.
    #[error("fenced")]
    Fenced,
    /// Not a sidecar answer: the sidecar cancelled the turn (`POST …/turns/{id}/cancel`,
    /// a newer turn interrupted it). It stops at once and publishes nothing more.
    #[error("cancelled: a newer turn interrupted it")]
    Cancelled,
    /// Any other refusal (e.g. `503 store_unavailable`): passed back to the client as is.
    #[error("sidecar refused with {status}")]
    Refused { status: StatusCode, retry_after: Option<String>, body: Bytes },
    #[error("sidecar unreachable")]
    Http(#[from] reqwest::Error),
    /// The checkpoint is not this agent's `{"history":[...]}`: the turn stops rather
    /// than start over from nothing (which would overwrite the history with one entry).
    #[error("the checkpoint is not {{\"history\":[...]}}: {0}")]
    BadCheckpoint(String),
    /// The journal of a resumed turn is not `[{"id","type","data"}…]`.
    #[error("the turn's journal is malformed: {0}")]
    BadJournal(String),
}

/// The conversation state kept in the checkpoint.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct State {
    pub history: Vec<String>,
    /// The id of the turn whose entry is the last of `history`: a resumed turn whose
    /// earlier attempt already checkpointed must not append its entry a second time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_turn: Option<String>,
}

/// One journaled event of a turn's earlier attempt (`GET …/turns/{id}/events`).
#[derive(Debug, Clone, Deserialize)]
pub struct JournalEvent {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub data: serde_json::Value,
}

#[derive(Debug, Clone)]
pub struct Sidecar {
    http: reqwest::Client,
    base: String,
}

/// A path segment with everything but RFC 3986's unreserved characters escaped (turn
/// ids are any visible ASCII: a `/` or `?` must not change the path).
fn segment(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    for b in raw.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Sidecar {
    pub fn new(base: &str) -> Self {
        Sidecar { http: reqwest::Client::new(), base: base.trim_end_matches('/').to_owned() }
    }

    fn url(&self, key: &str, rest: &str) -> String {
        format!("{}/v1/sessions/{key}/{rest}", self.base)
    }

    async fn check(response: reqwest::Response) -> Result<reqwest::Response, WriteError> {
        match response.status() {
            s if s.is_success() => Ok(response),
            StatusCode::CONFLICT => Err(WriteError::Fenced),
            status => {
                let retry_after =
                    response.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_owned);
                Err(WriteError::Refused { status, retry_after, body: response.bytes().await? })
            }
        }
    }

    /// Thaw: the checkpointed state, or a fresh one when there is none. `last_turn` is the
    /// sidecar's `Leasehold-Checkpoint-Turn` (the turn that wrote the checkpoint) when it
    /// sends one, else what the checkpoint itself says.
    pub async fn thaw(&self, key: &str) -> Result<State, WriteError> {
        let response = self.http.get(self.url(key, "checkpoint")).send().await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(State::default());
        }
        let response = Self::check(response).await?;
        let turn = response
            .headers()
            .get("leasehold-checkpoint-turn")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let bytes = response.bytes().await?;
        let mut state: State =
            serde_json::from_slice(&bytes).map_err(|e| WriteError::BadCheckpoint(e.to_string()))?;
        if turn.is_some() {
            state.last_turn = turn;
        }
        Ok(state)
    }

    pub async fn checkpoint(&self, key: &str, epoch: i64, state: &State) -> Result<(), WriteError> {
        let body = serde_json::to_vec(state).expect("state serialises");
        let response = self
            .http
            .put(self.url(key, "checkpoint"))
            .header("leasehold-epoch", epoch)
            .body(body)
            .send()
            .await?;
        Self::check(response).await.map(drop)
    }

    pub async fn publish(
        &self,
        key: &str,
        epoch: i64,
        kind: &str,
        data: serde_json::Value,
    ) -> Result<(), WriteError> {
        let response = self
            .http
            .post(self.url(key, "events"))
            .header("leasehold-epoch", epoch)
            .json(&json!({ "type": kind, "data": data }))
            .send()
            .await?;
        Self::check(response).await.map(drop)
    }

    /// The journaled events of `turn_id`'s earlier attempts (epochs below `epoch`), oldest
    /// first. `404` (no such turn in the journal) reads as none.
    pub async fn journal(
        &self,
        key: &str,
        turn_id: &str,
        epoch: i64,
    ) -> Result<Vec<JournalEvent>, WriteError> {
        let url = self.url(key, &format!("turns/{}/events", segment(turn_id)));
        let response = self.http.get(url).header("leasehold-epoch", epoch).send().await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(Vec::new());
        }
        let bytes = Self::check(response).await?.bytes().await?;
        serde_json::from_slice(&bytes).map_err(|e| WriteError::BadJournal(e.to_string()))
    }

    pub async fn release(&self, key: &str, epoch: i64) -> Result<(), WriteError> {
        let response =
            self.http.delete(self.url(key, "lease")).header("leasehold-epoch", epoch).send().await?;
        Self::check(response).await.map(drop)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_turn_id_is_one_escaped_path_segment() {
        assert_eq!(super::segment("3f2a-b_c.d~e"), "3f2a-b_c.d~e");
        assert_eq!(super::segment("a/b?c#d%"), "a%2Fb%3Fc%23d%25");
    }
}
