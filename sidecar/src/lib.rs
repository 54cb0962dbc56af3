//! leasehold sidecar: one writer per session, decided by a durable lease in Postgres and
//! enforced by an epoch fence at every write.

pub mod agent_api;
pub mod app;
pub mod client;
pub mod config;
pub mod directive;
pub mod dispatch;
pub mod drain;
pub mod forward;
pub mod heartbeat;
pub mod http;
pub mod inflight;
pub mod key;
pub mod metrics;
pub mod observe;
pub mod ownership;
pub mod route;
pub mod store;
pub mod upstream;
