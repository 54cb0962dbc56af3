//! leasehold sidecar: one writer per session, decided by a durable lease in Postgres and
//! enforced by an epoch fence at every write.
//!
//! Layers, each depending only on those below it (docs/architecture.md):
//! `leasehold_core` (vocabulary, the store) ← `heartbeat`, `ownership` ← `turn`,
//! `forward`, `observe`, `fence`, `drain` ← `http` ← the binary's `runtime`.

pub mod client;
pub mod config;
pub mod drain;
pub mod failpoint;
pub mod fence;
pub mod forward;
pub mod heartbeat;
pub mod http;
pub mod metrics;
pub mod observe;
pub mod ownership;
pub mod publish;
pub mod telemetry;
pub mod turn;
pub mod upstream;
