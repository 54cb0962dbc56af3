//! Ownership-change notifications (LISTEN `leasehold_ownership`; see the migration).

use serde::Deserialize;
use sqlx::postgres::PgListener;

use super::{db, Epoch, LeaseStore, Owner, Result};
use crate::key::SessionKey;

pub const CHANNEL: &str = "leasehold_ownership";

/// One ownership change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A session was claimed, taken over (`owner` set) or released (`owner` none).
    Lease { key: SessionKey, epoch: Epoch, owner: Option<Owner> },
    /// A boot handed everything back or was revoked: all its sessions are claimable.
    Node { owner: Owner },
    /// The listening connection was lost and re-established: changes may have been
    /// missed, so everything cached must be re-checked.
    Resync,
}

#[derive(Debug, Deserialize)]
struct Payload {
    key: Option<String>,
    epoch: Option<i64>,
    owner: Option<String>,
    node: Option<String>,
}

/// Parse a notification payload; `None` for anything malformed (logged by the caller).
pub fn parse(payload: &str) -> Option<Change> {
    let p: Payload = serde_json::from_str(payload).ok()?;
    if let Some(node) = p.node {
        return Some(Change::Node { owner: Owner::parse(&node)? });
    }
    let key = SessionKey::parse(&p.key?).ok()?;
    let owner = match p.owner {
        Some(owner) => Some(Owner::parse(&owner)?),
        None => None,
    };
    Some(Change::Lease { key, epoch: Epoch(p.epoch?), owner })
}

/// A subscription to ownership changes. It reconnects by itself after a lost
/// connection and then reports `Resync`.
#[derive(Debug)]
pub struct Changes {
    listener: PgListener,
}

impl LeaseStore {
    /// Subscribe on a connection of its own (a one-connection pool beside the request
    /// pool: the listener keeps its connection for good and re-takes it after a loss, and
    /// neither may wait behind request traffic).
    pub async fn listen(&self) -> Result<Changes> {
        let own = self.dedicated(1);
        let mut listener = PgListener::connect_with(own.pool()).await.map_err(db("listen connect"))?;
        listener.listen(CHANNEL).await.map_err(db("listen"))?;
        Ok(Changes { listener })
    }
}

impl Changes {
    /// The next change. Errors only when the database cannot be reached (the caller
    /// retries after a pause; the next successful call reports `Resync`).
    pub async fn next(&mut self) -> Result<Change> {
        loop {
            match self.listener.try_recv().await.map_err(db("receive notification"))? {
                None => return Ok(Change::Resync), // reconnected: we may have missed some
                Some(n) => match parse(n.payload()) {
                    Some(change) => return Ok(change),
                    None => {
                        tracing::warn!(payload = n.payload(), "ignoring malformed ownership notification")
                    }
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_of_both_triggers_parse() {
        assert_eq!(
            parse(r#"{"key":"s1","epoch":3,"owner":"pod-a/b1"}"#),
            Some(Change::Lease {
                key: SessionKey::parse("s1").unwrap(),
                epoch: Epoch(3),
                owner: Owner::parse("pod-a/b1")
            })
        );
        assert!(matches!(
            parse(r#"{"key":"s1","epoch":3,"owner":null}"#),
            Some(Change::Lease { owner: None, .. })
        ));
        assert_eq!(
            parse(r#"{"node":"pod-a/b1"}"#),
            Some(Change::Node { owner: Owner::parse("pod-a/b1").unwrap() })
        );
        assert_eq!(parse("garbage"), None);
        assert_eq!(parse(r#"{"key":"bad key","epoch":1}"#), None);
    }
}
