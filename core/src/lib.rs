//! What both leasehold binaries share, and nothing else: the session vocabulary (keys,
//! epochs, owners, event ids, header names, the refusal body), the peer proof, the
//! `/metrics` format negotiation, and the one door to Postgres (`store`).
//!
//! No transport and no Kubernetes client here: the sidecar and the operator depend on
//! this crate, never the reverse.

pub mod build;
pub mod directive;
pub mod exposition;
pub mod headers;
pub mod ids;
pub mod key;
pub mod lifecycle;
pub mod proof;
pub mod store;

pub use self::{
    ids::{Epoch, EventId, Owner},
    key::SessionKey,
};
