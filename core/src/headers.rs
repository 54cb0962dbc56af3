//! Header names of the leasehold protocol (client, agent and agent APIs), parsed once at
//! compile time for the hot paths.

use http::HeaderName;

/// The epoch a turn was dispatched with; every agent write carries it back.
pub const EPOCH: HeaderName = HeaderName::from_static("leasehold-epoch");
/// The id of one turn, the same on every attempt of it.
pub const TURN_ID: HeaderName = HeaderName::from_static("leasehold-turn-id");
/// The node id that ran a turn, on the client's answer.
pub const OWNER: HeaderName = HeaderName::from_static("leasehold-owner");
/// The epoch that wrote a checkpoint, on the agent API's checkpoint read.
pub const CHECKPOINT_EPOCH: HeaderName = HeaderName::from_static("leasehold-checkpoint-epoch");
/// On every refusal a sidecar makes itself (a `503` with its directive, a `401` for a
/// proof): tells a forwarding sidecar the answer is the owner sidecar's, not its agent's
/// (which is passed through unchanged whatever its status). The value is the code.
pub const REFUSAL: HeaderName = HeaderName::from_static("leasehold-refusal");
/// A client's key for one turn, scoped to the session (the IETF httpapi draft's header):
/// a repeat never runs the turn again.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// On an answer sent again from the journal (a repeated idempotency key): `true`.
pub const REPLAYED: HeaderName = HeaderName::from_static("leasehold-replayed");
/// What to do with a turn that arrives while another of its session runs:
/// `enqueue`, `reject` or `interrupt`.
pub const MULTITASK: HeaderName = HeaderName::from_static("leasehold-multitask");
/// On a turn re-dispatched after its owner was lost mid-turn: the turn's id.
pub const RESUME: HeaderName = HeaderName::from_static("leasehold-resume");
/// The turn that wrote a checkpoint, on the agent API's checkpoint read (absent when it
/// was written between turns): a resumed turn whose earlier attempt's checkpoint landed
/// finds its own id here.
pub const CHECKPOINT_TURN: HeaderName = HeaderName::from_static("leasehold-checkpoint-turn");
