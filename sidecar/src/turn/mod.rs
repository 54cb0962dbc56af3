//! A turn's way through this node (CONTRACT §3, §7): admitted unless draining, routed to
//! the session's single owner (run here, forwarded one hop, or refused with a retry
//! directive), dispatched to the agent. Nothing here runs a turn without a lease.

pub mod agent;
pub mod directive;
pub mod inflight;
pub mod router;

use bytes::Bytes;
use http::{header::CONTENT_TYPE, HeaderName, HeaderValue};
use leasehold_core::{headers, SessionKey};

/// Whether the request was a turn from the session's user or an event from elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Turn,
    Event,
}

impl Kind {
    /// The path segment in every API: `/sessions/{key}/turns` or `/events`.
    pub fn segment(self) -> &'static str {
        match self {
            Kind::Turn => "turns",
            Kind::Event => "events",
        }
    }
}

/// A turn or event as received: opaque body, content type preserved.
#[derive(Debug, Clone)]
pub struct Turn {
    pub kind: Kind,
    pub key: SessionKey,
    pub id: String,
    pub content_type: Option<HeaderValue>,
    pub body: Bytes,
}

impl Turn {
    /// The path this turn takes on the owner's peer listener.
    pub fn peer_path(&self) -> String {
        format!("/peer/v1/sessions/{}/{}", self.key, self.kind.segment())
    }

    /// The headers a turn travels with: its id and, when given, its content type.
    pub fn headers(&self) -> impl Iterator<Item = (HeaderName, HeaderValue)> {
        let id = HeaderValue::try_from(self.id.as_str()).expect("a turn id is a UUID");
        std::iter::once((headers::TURN_ID, id)).chain(self.content_type.clone().map(|ct| (CONTENT_TYPE, ct)))
    }
}

/// Where the request entered: the public door may forward once; the peer door never
/// forwards again (one hop).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Door {
    Public,
    Peer,
}
