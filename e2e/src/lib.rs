//! The leasehold end-to-end harness: a real Kubernetes cluster (any kubeconfig), the
//! operator installed with the Helm chart, and per-scenario namespaces, databases and
//! AgentClusters of the demo agent. Pods are reached only through the API server's pod
//! proxy. The scenarios are in `tests/e2e.rs` (feature `e2e`).

pub mod client;
pub mod database;
pub mod dump;
pub mod fixture;
pub mod install;
pub mod logs;
pub mod observer;
pub mod operators;
pub mod pods;
pub mod proxy;
pub mod report;
pub mod settings;
pub mod spec;

pub use fixture::{Fixture, CLUSTER};
