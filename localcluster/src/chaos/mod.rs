//! The randomized fault run (`make chaos`; a short one in `make test`): real sidecars and
//! demo agents on loopback with a private Postgres; sessions of sequential turns from
//! clients that obey retry directives and never re-send a request that may have been
//! received; a seeded schedule of faults; afterwards, every session's history checked
//! against what its client was told.
//!
//! - [`schedule`]: the seeded list of faults (pure).
//! - [`testbed`]: the cluster with the handles faults need (private store, store links).
//! - [`inject`]: doing one fault, and undoing it.
//! - [`driver`]: one session's client; [`record`]: what it logs.
//! - [`checker`]: histories and logs to anomalies (pure).
//! - [`report`]: the counts and the table a run prints.
//! - [`run`]: all of it, in order.

pub mod checker;
pub mod driver;
pub mod inject;
pub mod record;
pub mod report;
pub mod run;
pub mod schedule;
pub mod testbed;

pub use checker::{check, Anomaly};
pub use report::Report;
pub use run::{run, ChaosOptions};
pub use schedule::FaultKind;
