//! The cluster secret as the operator uses it: the current value and, during a rotation,
//! the previous one. The operator signs drains with them, and stamps the pod template
//! with a version of them so that changing the Secret's values rolls the pods.

use leasehold_core::proof::PeerAuth;
use sha2::{Digest, Sha256};

/// The pod-template annotation that changes whenever the cluster secret's values do.
pub const SECRET_VERSION: &str = "leasehold.dev/cluster-secret-version";

#[derive(Clone, PartialEq, Eq)]
pub struct ClusterKeys {
    pub current: String,
    /// The secret before a rotation, while the Secret still carries it.
    pub previous: Option<String>,
}

/// Never prints a key.
impl std::fmt::Debug for ClusterKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterKeys").field("previous", &self.previous.is_some()).finish_non_exhaustive()
    }
}

impl ClusterKeys {
    /// An empty previous value counts as none (a key left blank after a rotation).
    pub fn new(current: String, previous: Option<String>) -> Self {
        ClusterKeys { current, previous: previous.filter(|p| !p.trim().is_empty()) }
    }

    /// Signs with the current secret; can fall back to the previous one.
    pub fn auth(&self) -> PeerAuth {
        PeerAuth::new(Some(&self.current), self.previous.as_deref())
    }

    /// A short digest of both values (domain-separated, truncated): it changes with
    /// either value and shows neither. A guessable secret stays as guessable as from any
    /// proof on the wire; the operator's own secrets are 32 random bytes.
    pub fn version(&self) -> String {
        let mut digest = Sha256::new();
        digest.update(b"leasehold-cluster-secret-version\n");
        digest.update(self.current.as_bytes());
        digest.update(b"\n");
        if let Some(previous) = &self.previous {
            digest.update(previous.as_bytes());
        }
        hex::encode(&digest.finalize()[..8])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(current: &str, previous: Option<&str>) -> ClusterKeys {
        ClusterKeys::new(current.into(), previous.map(Into::into))
    }

    #[test]
    fn the_version_follows_either_value_and_shows_neither() {
        let before = keys("old-secret", None);
        let rotating = keys("new-secret", Some("old-secret"));
        let after = keys("new-secret", None);
        let versions = [before.version(), rotating.version(), after.version()];
        assert_ne!(versions[0], versions[1]);
        assert_ne!(versions[1], versions[2]);
        assert_ne!(versions[0], versions[2]);
        assert_eq!(before.version(), keys("old-secret", None).version(), "stable");
        assert_eq!(keys("a", Some("")).version(), keys("a", None).version(), "blank previous is none");
        for v in &versions {
            assert_eq!(v.len(), 16);
            assert!(!v.contains("secret"));
        }
        let shown = format!("{rotating:?}");
        assert!(!shown.contains("secret\""), "{shown}");
        assert!(!shown.contains("new-secret") && !shown.contains("old-secret"), "{shown}");
    }
}
