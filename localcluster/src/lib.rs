//! Real sidecar + demo-agent processes on loopback addresses (127.0.0.0/8), against a real
//! Postgres: the local demo and the cluster tests share it. Every process is stopped by
//! PID when its handle is dropped.

pub mod bare_proxy;
pub mod blackhole;
pub mod centrifugo;
pub mod chaos;
pub mod cluster;
pub mod dapr;
pub mod fanout;
pub mod link;
pub mod loadgen;
pub mod observer;
pub mod postgres;
pub mod process;
pub mod trivial_agent;

pub use blackhole::Blackhole;
pub use cluster::{Cluster, ClusterOptions, Node};
pub use link::Link;
pub use observer::Observer;
pub use postgres::Postgres;
pub use process::Proc;
