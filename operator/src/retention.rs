//! Retention: sessions nobody holds are deleted after the cluster's `sessionRetention`,
//! and node rows of sidecar processes dead for a day once no session names them; in
//! small batches, at most once per interval per database (`LeaseStore::collect`).

use std::{
    collections::HashMap,
    sync::Mutex,
    time::{Duration, Instant},
};

use leasehold_core::store::{retention::Collected, LeaseStore};

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

/// One pass over `store`: batches until one is not full (or the pass's limit).
pub async fn collect(store: &LeaseStore, sessions: Duration, metrics: &Metrics) -> Result<Collected> {
    let mut total = Collected::default();
    for _ in 0..MAX_BATCHES {
        let batch = store.collect(sessions, NODE_RETENTION, BATCH).await?;
        metrics.collected(batch.sessions, batch.nodes);
        total.sessions += batch.sessions;
        total.nodes += batch.nodes;
        if batch.sessions < BATCH as u64 && batch.nodes < BATCH as u64 {
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
