//! Per-session event hubs: the owner numbers each published event `<epoch>-<seq>`, keeps
//! the recent ones for replay and fans them out to local subscribers.

use std::{
    collections::{HashMap, VecDeque},
    fmt,
    sync::Mutex,
};

use serde_json::value::RawValue;
use tokio::sync::broadcast;

use crate::{key::SessionKey, store::Epoch};

/// Events kept per session for late joiners.
pub const REPLAY_CAPACITY: usize = 1024;
/// Events a slow local subscriber may lag before it is cut.
pub const SUBSCRIBER_CAPACITY: usize = 1024;

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

/// One published event.
#[derive(Debug, Clone)]
pub struct Event {
    pub id: EventId,
    pub kind: String,
    pub data: Box<RawValue>,
}

#[derive(Debug)]
struct Hub {
    last: Option<EventId>,
    recent: VecDeque<Event>,
    tx: broadcast::Sender<Event>,
}

impl Hub {
    fn new() -> Self {
        Hub { last: None, recent: VecDeque::new(), tx: broadcast::channel(SUBSCRIBER_CAPACITY).0 }
    }
}

/// All hubs of this node.
#[derive(Debug, Default)]
pub struct Hubs {
    hubs: Mutex<HashMap<SessionKey, Hub>>,
}

impl Hubs {
    /// Number and fan out an event of `epoch`. The caller has already passed the fence.
    pub fn publish(&self, key: &SessionKey, epoch: Epoch, kind: String, data: Box<RawValue>) -> EventId {
        let mut hubs = self.hubs.lock().expect("hubs lock");
        let hub = hubs.entry(key.clone()).or_insert_with(Hub::new);
        let seq = match hub.last {
            Some(last) if last.epoch == epoch => last.seq + 1,
            _ => 1,
        };
        let id = EventId { epoch, seq };
        hub.last = Some(id);
        let event = Event { id, kind, data };
        if hub.recent.len() == REPLAY_CAPACITY {
            hub.recent.pop_front();
        }
        hub.recent.push_back(event.clone());
        let _ = hub.tx.send(event); // no subscriber is fine
        id
    }

    /// Events still buffered for `key` after `after` (all buffered when `None`).
    pub fn replay(&self, key: &SessionKey, after: Option<EventId>) -> Vec<Event> {
        let hubs = self.hubs.lock().expect("hubs lock");
        hubs.get(key)
            .map(|hub| hub.recent.iter().filter(|e| after.is_none_or(|a| e.id > a)).cloned().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(s: &str) -> Box<RawValue> {
        RawValue::from_string(s.to_owned()).unwrap()
    }

    #[test]
    fn ids_grow_per_epoch_and_restart_at_a_new_epoch() {
        let hubs = Hubs::default();
        let k = SessionKey::parse("s").unwrap();
        let ids: Vec<String> = [1, 1, 2, 2]
            .into_iter()
            .map(|e| hubs.publish(&k, Epoch(e), "token".into(), raw("{}")).to_string())
            .collect();
        assert_eq!(ids, ["1-1", "1-2", "2-1", "2-2"]);
        let after = EventId::parse("1-2").unwrap();
        let replay: Vec<_> = hubs.replay(&k, Some(after)).into_iter().map(|e| e.id.to_string()).collect();
        assert_eq!(replay, ["2-1", "2-2"]);
        assert!(EventId::parse("x-1").is_none());
    }
}
