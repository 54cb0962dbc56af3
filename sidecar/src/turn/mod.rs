//! A turn's way through this node (CONTRACT §3, §7): admitted unless draining, routed to
//! the session's single owner (run here, forwarded one hop, or refused with a retry
//! directive), dispatched to the agent. Nothing here runs a turn without a lease.

pub mod agent;
pub mod client_headers;
pub mod directive;
pub mod inflight;
pub mod outcome;
pub mod queue;
pub mod router;
pub mod run;

use bytes::Bytes;
use http::{header::CONTENT_TYPE, HeaderName, HeaderValue};
use leasehold_core::{
    headers,
    store::journal::{request_digest, TurnKind},
    SessionKey,
};

use self::queue::Multitask;

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

impl From<Kind> for TurnKind {
    fn from(kind: Kind) -> Self {
        match kind {
            Kind::Turn => TurnKind::Turn,
            Kind::Event => TurnKind::Event,
        }
    }
}

/// A turn or event as received: opaque body, content type preserved.
#[derive(Debug, Clone)]
pub struct Turn {
    pub kind: Kind,
    pub key: SessionKey,
    /// The client's idempotency key when it gave one, else generated.
    pub id: String,
    /// Whether `id` is the client's idempotency key (a repeat may come).
    pub keyed: bool,
    /// The client's multitask policy for this turn, if it named one.
    pub multitask: Option<Multitask>,
    pub content_type: Option<HeaderValue>,
    /// The client's headers that reach the agent (`--forward-headers`); none for a turn
    /// resumed from the journal.
    pub client_headers: Vec<(HeaderName, HeaderValue)>,
    pub body: Bytes,
}

impl Turn {
    /// The path this turn takes on the owner's peer listener.
    pub fn peer_path(&self) -> String {
        format!("/peer/v1/sessions/{}/{}", self.key, self.kind.segment())
    }

    /// The headers a turn travels with: its id (and idempotency key), when given its
    /// content type and multitask policy, and the client's headers it carries.
    pub fn headers(&self) -> impl Iterator<Item = (HeaderName, HeaderValue)> + '_ {
        let id = HeaderValue::try_from(self.id.as_str()).expect("a turn id is visible ASCII");
        let key = self.keyed.then(|| (headers::IDEMPOTENCY_KEY, id.clone()));
        let multitask = self.multitask.map(|m| (headers::MULTITASK, HeaderValue::from_static(m.as_str())));
        std::iter::once((headers::TURN_ID, id))
            .chain(key)
            .chain(multitask)
            .chain(self.content_type.clone().map(|ct| (CONTENT_TYPE, ct)))
            .chain(self.client_headers.iter().cloned())
    }

    /// What a repeat of its idempotency key is compared by.
    pub fn digest(&self) -> Vec<u8> {
        request_digest(self.kind.into(), self.content_type(), &self.body)
    }

    pub fn content_type(&self) -> Option<&str> {
        self.content_type.as_ref().and_then(|ct| ct.to_str().ok())
    }

    /// The policy it runs under: events from elsewhere in the product always enqueue.
    pub fn policy(&self, default: Multitask) -> Multitask {
        match self.kind {
            Kind::Event => Multitask::Enqueue,
            Kind::Turn => self.multitask.unwrap_or(default),
        }
    }
}

/// Where the request entered: the public door may forward once; the peer door never
/// forwards again (one hop).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Door {
    Public,
    Peer,
}

/// A turn id (a client's idempotency key: any visible ASCII) as one URL path segment.
pub fn path_segment(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    for byte in id.bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => out.push(char::from(byte)),
            other => out.push_str(&format!("%{other:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_turn_id_becomes_one_path_segment() {
        assert_eq!(super::path_segment("a-b_c.d~9"), "a-b_c.d~9");
        assert_eq!(super::path_segment("a/b?c#d%e f"), "a%2Fb%3Fc%23d%25e%20f");
    }
}
