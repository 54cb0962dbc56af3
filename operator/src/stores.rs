//! One lease-store pool per database URL, shared by every AgentCluster using it.

use std::{collections::HashMap, sync::Mutex};

use leasehold_sidecar::store::{self, LeaseStore};

/// Connections per database: the operator runs a few statements per reconcile.
const POOL_SIZE: u32 = 4;

#[derive(Debug, Default)]
pub struct Stores {
    pools: Mutex<HashMap<String, LeaseStore>>,
}

impl Stores {
    pub fn get(&self, database_url: &str) -> Result<LeaseStore, store::Error> {
        let mut pools = self.pools.lock().expect("stores lock");
        if let Some(store) = pools.get(database_url) {
            return Ok(store.clone());
        }
        let store = LeaseStore::connect_lazy(database_url, POOL_SIZE)?;
        pools.insert(database_url.to_owned(), store.clone());
        Ok(store)
    }
}
