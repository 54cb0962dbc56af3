//! One lease-store pool per database URL, shared by every AgentCluster using it, and a
//! trigger that fires when leases change in any of them.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use futures_util::Stream;
use leasehold_core::store::{self, LeaseStore, StatementObserver};
use tokio::sync::Notify;

/// Connections per database: the operator runs a few statements per reconcile.
const POOL_SIZE: u32 = 4;
/// Pause before listening again after a database could not be reached.
const LISTEN_RETRY: Duration = Duration::from_secs(1);

#[derive(Debug, Default)]
pub struct Stores {
    pools: Mutex<HashMap<String, LeaseStore>>,
    /// Woken by every lease change (claim, takeover, release, a boot handed back or
    /// revoked) in any database of `pools`.
    changed: Arc<Notify>,
    /// Told of every statement of every store (the operator's metrics).
    observer: Option<Arc<dyn StatementObserver>>,
}

impl Stores {
    /// Stores whose every statement is reported to `observer`.
    pub fn observed_by(observer: Arc<dyn StatementObserver>) -> Self {
        Self { observer: Some(observer), ..Self::default() }
    }

    /// The store for `database_url`; the first call also starts following its changes.
    pub fn get(&self, database_url: &str) -> Result<LeaseStore, store::Error> {
        let mut pools = self.pools.lock().expect("stores lock");
        if let Some(store) = pools.get(database_url) {
            return Ok(store.clone());
        }
        let mut store = LeaseStore::connect_lazy(database_url, POOL_SIZE)?;
        if let Some(observer) = &self.observer {
            store = store.observed_by(observer.clone());
        }
        tokio::spawn(follow_changes(store.clone(), self.changed.clone()));
        pools.insert(database_url.to_owned(), store.clone());
        Ok(store)
    }

    /// Yields after leases changed, at most once per `coalesce` however many changed:
    /// lease counts (status, `pod-deletion-cost`) are refreshed on it instead of waiting
    /// for the periodic refresh.
    pub fn lease_changes(&self, coalesce: Duration) -> impl Stream<Item = ()> + Send + 'static {
        futures_util::stream::unfold(self.changed.clone(), move |changed| async move {
            changed.notified().await;
            // Changes arriving meanwhile leave one permit: they make one more refresh.
            tokio::time::sleep(coalesce).await;
            Some(((), changed))
        })
    }
}

/// LISTEN for `store`'s ownership changes for as long as the operator runs.
async fn follow_changes(store: LeaseStore, changed: Arc<Notify>) {
    loop {
        match store.listen().await {
            Ok(mut changes) => loop {
                match changes.next().await {
                    // A reconnect (`Resync`) may have missed changes: refresh too.
                    Ok(_) => changed.notify_one(),
                    Err(e) => {
                        tracing::warn!(error = %e, "lease change notifications interrupted");
                        tokio::time::sleep(LISTEN_RETRY).await;
                    }
                }
            },
            Err(e) => {
                tracing::debug!(error = %e, "cannot listen for lease changes yet");
                tokio::time::sleep(LISTEN_RETRY).await;
            }
        }
    }
}
