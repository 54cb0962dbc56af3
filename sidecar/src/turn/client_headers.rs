//! The client request headers a turn carries to the agent (`--forward-headers`): picked
//! from the client's request at the public door, sent along the one hop to the owner
//! (covered by the peer proof, so no one on the way can add or alter one), and given to
//! the agent with the turn. A turn resumed from the journal after a failover has none:
//! they are not journaled.

use std::{fmt, str::FromStr, sync::Arc};

use http::{HeaderMap, HeaderName, HeaderValue};
use leasehold_core::proof::SIGNED_HEADERS_HEADER;

/// What `--forward-headers` is when not given.
pub const DEFAULT_FORWARD_HEADERS: &str = "Authorization,traceparent,tracestate,baggage,X-Request-Id,Accept";

/// Headers that belong to one connection or one message (RFC 9110 §7.6.1, and those
/// every HTTP client sets itself): never passed on.
const PER_HOP: [&str; 12] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "expect",
];

/// Headers the sidecar already carries with every turn, by its own rules.
const CARRIED: [&str; 2] = ["content-type", "idempotency-key"];

/// The sidecar's own headers (`Leasehold-Epoch`, `Leasehold-Turn-Id`, the peer proof…).
const OWN_PREFIX: &str = "leasehold-";

/// The names of the client headers that reach the agent, lower-case, each once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardHeaders(Arc<[HeaderName]>);

/// A `--forward-headers` value that names a header that may not be forwarded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForwardHeadersError {
    #[error("{0:?} is not a header name")]
    NotAName(String),
    #[error("{0:?} is a hop-by-hop header: it belongs to one connection and is never forwarded")]
    PerHop(String),
    #[error("{0:?} is one of the sidecar's own Leasehold-* headers: it cannot come from a client")]
    Own(String),
    #[error("{0:?} already travels with every turn by the sidecar's own rules")]
    Carried(String),
}

impl FromStr for ForwardHeaders {
    type Err = ForwardHeadersError;

    /// Comma-separated, case-insensitive, blanks around names ignored; empty: none.
    fn from_str(list: &str) -> Result<Self, Self::Err> {
        let mut names: Vec<HeaderName> = Vec::new();
        for raw in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let name = HeaderName::from_bytes(raw.as_bytes())
                .map_err(|_| ForwardHeadersError::NotAName(raw.into()))?;
            let lower = name.as_str();
            if PER_HOP.contains(&lower) {
                return Err(ForwardHeadersError::PerHop(raw.into()));
            }
            if lower.starts_with(OWN_PREFIX) {
                return Err(ForwardHeadersError::Own(raw.into()));
            }
            if CARRIED.contains(&lower) {
                return Err(ForwardHeadersError::Carried(raw.into()));
            }
            if !names.contains(&name) {
                names.push(name);
            }
        }
        Ok(ForwardHeaders(names.into()))
    }
}

impl fmt::Display for ForwardHeaders {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.0.iter().map(HeaderName::as_str).collect();
        f.write_str(&names.join(","))
    }
}

impl Default for ForwardHeaders {
    fn default() -> Self {
        DEFAULT_FORWARD_HEADERS.parse().expect("the default list is valid")
    }
}

impl ForwardHeaders {
    /// The names, for the peer proof to cover (an absent one is covered as empty, so a
    /// header cannot be added on the way either).
    pub fn names(&self) -> &[HeaderName] {
        &self.0
    }

    /// The listed headers of a request entering at the public door, every value of each.
    pub fn from_client(&self, headers: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
        self.pick(headers, |_| true)
    }

    /// The listed headers of a request forwarded by a peer, keeping only those its proof
    /// covers (`Leasehold-Peer-Signed-Headers`, which the proof check has verified). A
    /// request without that header came in insecure mode, where nothing is covered and
    /// everything is accepted.
    pub fn from_peer(&self, headers: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
        let Some(covered) = headers.get(SIGNED_HEADERS_HEADER) else { return self.from_client(headers) };
        let covered: Vec<&str> = covered.to_str().unwrap_or("").split(',').collect();
        self.pick(headers, |name| covered.contains(&name.as_str()))
    }

    fn pick(
        &self,
        headers: &HeaderMap,
        keep: impl Fn(&HeaderName) -> bool,
    ) -> Vec<(HeaderName, HeaderValue)> {
        self.0
            .iter()
            .filter(|name| keep(name))
            .flat_map(|name| headers.get_all(name).iter().map(move |value| (name.clone(), value.clone())))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &ForwardHeaders) -> Vec<&str> {
        list.names().iter().map(HeaderName::as_str).collect()
    }

    #[test]
    fn the_default_names_six_headers_lower_case() {
        let list = ForwardHeaders::default();
        assert_eq!(
            names(&list),
            ["authorization", "traceparent", "tracestate", "baggage", "x-request-id", "accept"]
        );
    }

    #[test]
    fn a_list_is_case_insensitive_trimmed_deduplicated_and_may_be_empty() {
        let list: ForwardHeaders = " X-Tenant , x-tenant,Accept-Language,".parse().unwrap();
        assert_eq!(names(&list), ["x-tenant", "accept-language"]);
        assert!("".parse::<ForwardHeaders>().unwrap().names().is_empty());
    }

    #[test]
    fn hop_by_hop_own_and_carried_headers_are_refused_by_name() {
        for (list, error) in [
            ("Accept,Connection", ForwardHeadersError::PerHop("Connection".into())),
            ("Transfer-Encoding", ForwardHeadersError::PerHop("Transfer-Encoding".into())),
            ("Host", ForwardHeadersError::PerHop("Host".into())),
            ("Leasehold-Epoch", ForwardHeadersError::Own("Leasehold-Epoch".into())),
            ("leasehold-peer-signature", ForwardHeadersError::Own("leasehold-peer-signature".into())),
            ("Content-Type", ForwardHeadersError::Carried("Content-Type".into())),
            ("a b", ForwardHeadersError::NotAName("a b".into())),
        ] {
            assert_eq!(list.parse::<ForwardHeaders>(), Err(error), "{list}");
        }
    }

    #[test]
    fn from_a_peer_only_covered_headers_are_taken() {
        let list: ForwardHeaders = "accept,x-tenant".parse().unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("accept", HeaderValue::from_static("text/plain"));
        headers.insert("x-tenant", HeaderValue::from_static("t1"));
        headers.insert("x-other", HeaderValue::from_static("o"));
        assert_eq!(list.from_peer(&headers).len(), 2, "insecure mode: no proof, all listed ones");
        headers
            .insert(SIGNED_HEADERS_HEADER, HeaderValue::from_static("leasehold-turn-id,content-type,accept"));
        assert_eq!(
            list.from_peer(&headers),
            [(http::header::ACCEPT, HeaderValue::from_static("text/plain"))]
        );
    }

    #[test]
    fn every_value_of_a_repeated_header_is_taken() {
        let list: ForwardHeaders = "accept".parse().unwrap();
        let mut headers = HeaderMap::new();
        headers.append("accept", HeaderValue::from_static("a/b"));
        headers.append("accept", HeaderValue::from_static("c/d"));
        assert_eq!(list.from_client(&headers).len(), 2);
    }
}
