//! Recently seen live holders of sessions this node does not own, so a non-owner can
//! forward without a claim per turn. Safe: the owner re-resolves every forwarded turn
//! and never runs one without its lease; an entry is dropped on any sign it is stale
//! (owner unreachable, a refusal from it, an ownership change).

use std::{collections::HashMap, sync::Mutex, time::Duration};

use tokio::time::Instant;

use leasehold_core::{store::Holder, Owner, SessionKey};

/// Longest we trust a remembered holder without asking the store again.
pub const MAX_TRUST: Duration = Duration::from_secs(5);
/// Entries kept before expired ones are swept (bounds memory on busy routers).
const SWEEP_AT: usize = 10_000;

#[derive(Debug, Default)]
pub struct Holders {
    map: Mutex<HashMap<SessionKey, (Holder, Instant)>>,
}

impl Holders {
    pub fn get(&self, key: &SessionKey) -> Option<Holder> {
        let map = self.map.lock().expect("holders lock");
        map.get(key).filter(|(_, until)| Instant::now() < *until).map(|(holder, _)| holder.clone())
    }

    /// Remember `holder` for at most half its remaining lease, capped by `MAX_TRUST`.
    pub fn remember(&self, key: &SessionKey, holder: &Holder) {
        let now = Instant::now();
        let until = now + (holder.remaining / 2).min(MAX_TRUST);
        let mut map = self.map.lock().expect("holders lock");
        if map.len() >= SWEEP_AT {
            map.retain(|_, (_, until)| now < *until);
        }
        map.insert(key.clone(), (holder.clone(), until));
    }

    pub fn forget(&self, key: &SessionKey) {
        self.map.lock().expect("holders lock").remove(key);
    }

    pub fn clear(&self) {
        self.map.lock().expect("holders lock").clear();
    }

    /// Forget every session of a boot that handed back or was revoked.
    pub fn forget_owner(&self, owner: &Owner) {
        self.map.lock().expect("holders lock").retain(|_, (holder, _)| &holder.owner != owner);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold_core::Epoch;

    fn holder(owner: &str, remaining_ms: u64) -> Holder {
        Holder {
            owner: Owner::parse(owner).unwrap(),
            epoch: Epoch(1),
            peer_addr: "127.0.0.1:1".into(),
            remaining: Duration::from_millis(remaining_ms),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn trusted_for_half_the_remaining_lease_at_most() {
        let holders = Holders::default();
        let k = SessionKey::parse("s").unwrap();
        holders.remember(&k, &holder("a/1", 1000));
        assert!(holders.get(&k).is_some());
        tokio::time::advance(Duration::from_millis(501)).await;
        assert!(holders.get(&k).is_none(), "expired after half the remaining TTL");
        holders.remember(&k, &holder("a/1", 60_000));
        tokio::time::advance(MAX_TRUST).await;
        assert!(holders.get(&k).is_none(), "capped");
    }

    #[test]
    fn forgotten_by_key_and_by_owner() {
        let holders = Holders::default();
        let (k1, k2) = (SessionKey::parse("s1").unwrap(), SessionKey::parse("s2").unwrap());
        holders.remember(&k1, &holder("a/1", 10_000));
        holders.remember(&k2, &holder("b/1", 10_000));
        holders.forget(&k1);
        assert!(holders.get(&k1).is_none());
        holders.forget_owner(&Owner::parse("b/1").unwrap());
        assert!(holders.get(&k2).is_none());
    }
}
