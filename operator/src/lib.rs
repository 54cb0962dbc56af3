//! leasehold operator: reconciles AgentCluster into agent pods with the sidecar injected,
//! drives drains, revokes dead pods' leases, and reports status from Postgres.

pub mod args;
pub mod build;
pub mod cluster_keys;
pub mod controller;
pub mod error;
pub mod leader;
pub mod metrics;
pub mod pods;
pub mod rbac;
pub mod retention;
pub mod run;
pub mod stores;
pub mod validate;
