//! The identities a session's history is ordered by: the lease's [`Epoch`], the sidecar
//! process that holds it ([`Owner`]), and the id of each published event ([`EventId`]).

use std::{fmt, sync::Arc};

/// A session lease's generation. Grows by one at every change of hands, never shrinks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Epoch(pub i64);

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The identity of one sidecar process: `<node-id>/<boot-id>`. Cheap to clone: it is
/// copied into every local lease and remembered holder.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Owner(Arc<OwnerParts>);

#[derive(Debug, PartialEq, Eq, Hash)]
struct OwnerParts {
    full: String,
    /// Byte index of the `/` between node id and boot id.
    split: usize,
}

impl Owner {
    /// A fresh boot of `node_id` with a random boot id.
    pub fn new_boot(node_id: &str) -> Self {
        Self::from_parts(node_id, &uuid::Uuid::new_v4().simple().to_string()[..12])
    }

    pub fn from_parts(node_id: &str, boot_id: &str) -> Self {
        Owner(Arc::new(OwnerParts { full: format!("{node_id}/{boot_id}"), split: node_id.len() }))
    }

    /// Parse `<node-id>/<boot-id>` as stored in the database. The node id may not
    /// contain `/` (pod names cannot), so the last `/` separates the two.
    pub fn parse(full: &str) -> Option<Self> {
        let (node, boot) = full.rsplit_once('/')?;
        (!node.is_empty() && !boot.is_empty()).then(|| Self::from_parts(node, boot))
    }

    pub fn node_id(&self) -> &str {
        &self.0.full[..self.0.split]
    }

    pub fn boot_id(&self) -> &str {
        &self.0.full[self.0.split + 1..]
    }

    pub fn as_str(&self) -> &str {
        &self.0.full
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `<epoch>-<seq>`: strictly increasing per session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventId {
    pub epoch: Epoch,
    pub seq: u64,
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.epoch, self.seq)
    }
}

impl EventId {
    pub fn parse(s: &str) -> Option<Self> {
        let (epoch, seq) = s.split_once('-')?;
        Some(EventId { epoch: Epoch(epoch.parse().ok()?), seq: seq.parse().ok()? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_parts_round_trip() {
        let owner = Owner::parse("agents-7d9f-x2/3f2a9c").unwrap();
        assert_eq!((owner.node_id(), owner.boot_id()), ("agents-7d9f-x2", "3f2a9c"));
        assert_eq!(owner.to_string(), "agents-7d9f-x2/3f2a9c");
        assert_eq!(Owner::new_boot("n").node_id(), "n");
        assert!(
            Owner::parse("no-slash").is_none()
                && Owner::parse("/b").is_none()
                && Owner::parse("a/").is_none()
        );
    }

    #[test]
    fn event_ids_order_by_epoch_then_seq_and_round_trip() {
        let (a, b) = (EventId::parse("2-9").unwrap(), EventId::parse("3-1").unwrap());
        assert!(a < b);
        assert_eq!(a.to_string(), "2-9");
        assert_eq!(EventId::parse("x-1"), None);
        assert_eq!(EventId::parse("1"), None);
    }
}
