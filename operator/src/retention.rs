//! Retention: sessions nobody holds are deleted after the cluster's `sessionRetention`,
//! node rows of sidecar processes dead for a day once no session names them
//! (`LeaseStore::collect`), and finished turns with their recorded answers and events
//! after the cluster's `turns.answerRetention` (`LeaseStore::collect_turns`); in small
//! batches, at most once per interval per database.
//!
//! Like sessions, answers are collected with the retention of the cluster whose reconcile
//! found the database due: a database belongs to one AgentCluster (docs/install.md), and
//! the journal does not record which cluster wrote a turn.

use std::{
    collections::HashMap,
    sync::Mutex,
    time::{Duration, Instant},
};

use leasehold_core::store::LeaseStore;

use crate::{error::Result, metrics::Metrics};

/// A database is collected at most this often: deletion can wait, and the work stays
/// small and spread out.
pub const INTERVAL: Duration = Duration::from_secs(600);
/// A sidecar process whose node lease expired this long ago will not come back (its pod
/// is long gone; a restart registers a new boot).
pub const NODE_RETENTION: Duration = Duration::from_secs(24 * 3600);
/// Rows per statement: short locks, short transactions.
const BATCH: i64 = 1000;
/// Statements per pass; what is left waits for the next pass.
const MAX_BATCHES: usize = 20;

/// When each database was last collected.
#[derive(Debug, Default)]
pub struct Schedule {
    last: Mutex<HashMap<String, Instant>>,
}

impl Schedule {
    /// Whether `database_url` is due, marking it collected now if so.
    pub fn due(&self, database_url: &str, now: Instant) -> bool {
        let mut last = self.last.lock().expect("retention schedule lock");
        match last.get(database_url) {
            Some(at) if now.duration_since(*at) < INTERVAL => false,
            _ => {
                last.insert(database_url.to_owned(), now);
                true
            }
        }
    }
}

/// The retentions of one cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retentions {
    /// `spec.sessionRetention`.
    pub sessions: Duration,
    /// `spec.turns.answerRetention`.
    pub answers: Duration,
}

/// What one pass deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Collected {
    pub sessions: u64,
    pub nodes: u64,
    /// Finished or cancelled turns, with their answers and events.
    pub turns: u64,
}

/// One pass over `store`: sessions (with their turns) first, then the answers of the
/// sessions left; each in batches until one is not full (or the pass's limit).
pub async fn collect(store: &LeaseStore, retentions: Retentions, metrics: &Metrics) -> Result<Collected> {
    let mut total = Collected::default();
    for _ in 0..MAX_BATCHES {
        let batch = store.collect(retentions.sessions, NODE_RETENTION, BATCH).await?;
        metrics.collected(batch.sessions, batch.nodes);
        total.sessions += batch.sessions;
        total.nodes += batch.nodes;
        if batch.sessions < BATCH as u64 && batch.nodes < BATCH as u64 {
            break;
        }
    }
    for _ in 0..MAX_BATCHES {
        let turns = store.collect_turns(retentions.answers, BATCH).await?;
        metrics.collected_turns(turns);
        total.turns += turns;
        if turns < BATCH as u64 {
            break;
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_is_due_once_per_interval() {
        let schedule = Schedule::default();
        let start = Instant::now();
        assert!(schedule.due("db-a", start));
        assert!(!schedule.due("db-a", start + INTERVAL / 2));
        assert!(schedule.due("db-b", start), "each database on its own");
        assert!(schedule.due("db-a", start + INTERVAL));
    }
}
