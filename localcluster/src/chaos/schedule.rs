//! The seeded list of faults a run injects, one after another. Pure: the same seed, count,
//! kinds, node count and TTL always give the same schedule, so a failing run replays.

use std::{fmt, str::FromStr, time::Duration};

use rand::{rngs::StdRng, seq::SliceRandom, Rng, SeedableRng};

/// What is done to the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// `kill -9` of a pod's sidecar and agent; both start again after `hold`.
    Kill9Restart,
    /// SIGSTOP of a pod (or of its sidecar alone) for less than the lease TTL, then SIGCONT.
    PauseUnderTtl,
    /// SIGSTOP of a pod (or of its sidecar alone) past the lease TTL (its sessions are
    /// taken over), then SIGCONT.
    PausePastTtl,
    /// `leasehold-sidecar drain` of a pod, then its containers restart after `hold`.
    DrainRestart,
    /// The lease store stops (every connection breaks) and starts again after `hold`.
    PostgresRestart,
    /// One pod's connection to the store holds every byte for `hold` (statements hang).
    StorePartition,
    /// The same, beginning as the next checkpoint write (of whichever pod writes first)
    /// passes: that write is held and arrives when the partition heals, perhaps after a
    /// takeover. The scheduled pod's link is cut if no write comes.
    StorePartitionMidWrite,
    /// The kernel drops all traffic to and from one pod's peer port for `hold` (root).
    PeerPartition,
}

impl FaultKind {
    pub const ALL: [FaultKind; 8] = [
        FaultKind::Kill9Restart,
        FaultKind::PauseUnderTtl,
        FaultKind::PausePastTtl,
        FaultKind::DrainRestart,
        FaultKind::PostgresRestart,
        FaultKind::StorePartition,
        FaultKind::StorePartitionMidWrite,
        FaultKind::PeerPartition,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Kill9Restart => "kill9_restart",
            FaultKind::PauseUnderTtl => "pause_under_ttl",
            FaultKind::PausePastTtl => "pause_past_ttl",
            FaultKind::DrainRestart => "drain_restart",
            FaultKind::PostgresRestart => "postgres_restart",
            FaultKind::StorePartition => "store_partition",
            FaultKind::StorePartitionMidWrite => "store_partition_mid_write",
            FaultKind::PeerPartition => "peer_partition",
        }
    }

    /// How long the fault lasts, as a range of fractions of the lease TTL.
    fn hold_in_ttls(self) -> (f64, f64) {
        match self {
            FaultKind::Kill9Restart => (0.0, 1.0),
            FaultKind::PauseUnderTtl => (0.1, 0.7),
            FaultKind::PausePastTtl => (1.2, 2.0),
            FaultKind::DrainRestart => (0.0, 0.5),
            FaultKind::PostgresRestart => (0.0, 1.5),
            FaultKind::StorePartition | FaultKind::PeerPartition => (0.25, 2.0),
            // Mostly past the TTL: the held write then arrives after a takeover.
            FaultKind::StorePartitionMidWrite => (0.5, 3.0),
        }
    }

    /// Whether the fault is about one pod (all but the store's restart).
    pub fn targets_a_node(self) -> bool {
        self != FaultKind::PostgresRestart
    }

    /// Whether the fault may be done to the sidecar alone (a freeze of one container:
    /// its agent carries on and its calls to the sidecar wait).
    fn may_spare_the_agent(self) -> bool {
        matches!(self, FaultKind::PauseUnderTtl | FaultKind::PausePastTtl)
    }
}

/// Which containers of the pod a fault is done to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Pod,
    SidecarOnly,
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown fault kind {0:?} (known: {known})", known = known_kinds())]
pub struct UnknownKind(String);

fn known_kinds() -> String {
    FaultKind::ALL.map(FaultKind::name).join(", ")
}

impl FromStr for FaultKind {
    type Err = UnknownKind;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        FaultKind::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| UnknownKind(s.to_owned()))
    }
}

/// One fault: after `gap` of quiet, `kind` is done to `part` of node `node` (both
/// ignored for the store) and lasts `hold`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub kind: FaultKind,
    pub node: usize,
    pub part: Part,
    pub hold: Duration,
    pub gap: Duration,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hold = self.hold.as_millis();
        if self.kind.targets_a_node() {
            let node = (b'a' + self.node as u8) as char;
            let part = if self.part == Part::SidecarOnly { "'s sidecar" } else { "" };
            write!(f, "{} node-{node}{part} for {hold} ms", self.kind)
        } else {
            write!(f, "{} for {hold} ms", self.kind)
        }
    }
}

/// The quiet before a fault, as a range of fractions of the TTL: short, so faults often
/// land on the aftermath of the previous one.
const GAP_IN_TTLS: (f64, f64) = (0.0, 0.5);

/// `count` faults from `kinds` for a cluster of `nodes` pods whose lease TTL is `ttl`:
/// each kind once first, in a random order (so a run of at least as many faults as
/// kinds injects every kind: drawn uniformly, 32 faults of 8 kinds missed one in about
/// one seed in ten), then drawn uniformly. Empty when `kinds` is.
pub fn generate(seed: u64, count: usize, kinds: &[FaultKind], nodes: usize, ttl: Duration) -> Vec<Fault> {
    if kinds.is_empty() || nodes == 0 {
        return Vec::new();
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut faults = Vec::with_capacity(count);
    let mut each_once = kinds.to_vec();
    each_once.shuffle(&mut rng);
    for i in 0..count {
        let gap = fraction_of(ttl, GAP_IN_TTLS, &mut rng);
        let kind = match each_once.get(i) {
            Some(&kind) => kind,
            None => kinds[rng.random_range(0..kinds.len())],
        };
        let node = rng.random_range(0..nodes);
        let part =
            if kind.may_spare_the_agent() && rng.random_bool(0.5) { Part::SidecarOnly } else { Part::Pod };
        let hold = fraction_of(ttl, kind.hold_in_ttls(), &mut rng);
        faults.push(Fault { kind, node, part, hold, gap });
    }
    faults
}

/// A random duration between `lo` and `hi` TTLs, in whole milliseconds.
fn fraction_of(ttl: Duration, (lo, hi): (f64, f64), rng: &mut StdRng) -> Duration {
    Duration::from_millis(ttl.mul_f64(rng.random_range(lo..hi)).as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(2);

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        let a = generate(7, 50, &FaultKind::ALL, 3, TTL);
        assert_eq!(a, generate(7, 50, &FaultKind::ALL, 3, TTL));
        assert_ne!(a, generate(8, 50, &FaultKind::ALL, 3, TTL));
        assert_eq!(a.len(), 50);
    }

    #[test]
    fn every_kind_is_drawn_and_holds_are_under_or_past_the_ttl_as_named() {
        let faults = generate(1, 500, &FaultKind::ALL, 3, TTL);
        for kind in FaultKind::ALL {
            assert!(faults.iter().any(|f| f.kind == kind), "{kind} never drawn");
        }
        let sidecar_only = |kind| faults.iter().any(|f| f.kind == kind && f.part == Part::SidecarOnly);
        assert!(sidecar_only(FaultKind::PauseUnderTtl) && sidecar_only(FaultKind::PausePastTtl));
        for f in &faults {
            assert!(f.node < 3);
            assert!(f.part == Part::Pod || f.kind.may_spare_the_agent(), "{f}");
            assert!(f.gap < TTL / 2, "{f}");
            match f.kind {
                FaultKind::PauseUnderTtl => assert!(f.hold < TTL, "{f}"),
                FaultKind::PausePastTtl => assert!(f.hold > TTL, "{f}"),
                _ => assert!(f.hold <= TTL * 3, "{f}"),
            }
        }
    }

    #[test]
    fn every_kind_comes_once_before_any_comes_twice() {
        for seed in 0..200 {
            let faults = generate(seed, FaultKind::ALL.len(), &FaultKind::ALL, 3, TTL);
            let mut kinds: Vec<FaultKind> = faults.iter().map(|f| f.kind).collect();
            kinds.sort();
            assert_eq!(kinds, FaultKind::ALL, "seed {seed}: every kind exactly once");
        }
        // Not always in the same order.
        let first = |seed| generate(seed, 8, &FaultKind::ALL, 3, TTL)[0].kind;
        assert!((0..20).any(|seed| first(seed) != first(0)));
        // Fewer faults than kinds: distinct kinds.
        let three = generate(5, 3, &FaultKind::ALL, 3, TTL);
        assert!(
            three[0].kind != three[1].kind
                && three[1].kind != three[2].kind
                && three[0].kind != three[2].kind
        );
    }

    #[test]
    fn only_the_given_kinds_are_drawn() {
        let kinds = [FaultKind::StorePartition, FaultKind::PausePastTtl];
        let faults = generate(3, 100, &kinds, 3, TTL);
        assert!(faults.iter().all(|f| kinds.contains(&f.kind)));
        assert!(generate(3, 100, &[], 3, TTL).is_empty());
    }

    #[test]
    fn kinds_parse_from_their_names() {
        for kind in FaultKind::ALL {
            assert_eq!(kind.name().parse::<FaultKind>().unwrap(), kind);
        }
        assert!("kill".parse::<FaultKind>().is_err());
    }
}
