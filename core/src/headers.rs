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
