//! leasehold sidecar: one writer per session, decided by a durable lease in Postgres and
//! enforced by an epoch fence at every write.

pub mod config;
pub mod heartbeat;
pub mod key;
pub mod store;
