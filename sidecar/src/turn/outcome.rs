//! How a turn dispatched at its owner settled: shared by its client and by every repeat
//! of its idempotency key that attached to it.

use std::sync::Arc;

use leasehold_core::{store::Answer, Epoch};

use super::directive::Refusal;

#[derive(Debug, Clone)]
pub enum Outcome {
    /// The agent answered and the answer is recorded (`replayed`: it was recorded by an
    /// earlier attempt and is sent again from the journal).
    Answered { answer: Arc<Answer>, epoch: Epoch, replayed: bool },
    /// Cancelled by a newer turn (`interrupt`) or `DELETE …/turns/{id}`: `409 interrupted`.
    Interrupted,
    /// Not run now; the directive says when to retry (fenced, agent unavailable, ...).
    Refused(Refusal),
    /// It may have run, nothing was recorded: `502 owner_failed`.
    OwnerFailed,
}
