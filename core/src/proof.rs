//! The proof of the cluster secret that every request between leasehold components
//! carries (forwarded turns, followers' streams, the admin port's `/drain` and
//! `/leases`): an HMAC-SHA256 keyed with the cluster secret over
//!
//! ```text
//! leasehold-peer-v2 \n method \n path \n timestamp \n nonce \n destination \n
//! name:value \n ... (each signed header, in the order listed, one line per value) \n sha256(body) in hex
//! ```
//!
//! `destination` is the node id of the sidecar the request is for, so a captured request
//! cannot be replayed to another pod; the signed headers are listed in
//! `Leasehold-Peer-Signed-Headers` and always include `leasehold-turn-id` and
//! `content-type` (an absent header signs as an empty value). The receiver accepts a
//! proof only within a short window of its own clock and only once (nonces are
//! remembered for the window).
//!
//! # Rotation
//!
//! A sidecar may hold a previous secret besides the current one. It accepts proofs made
//! with either, signs with the current one, and when a peer refuses that proof (a `401`
//! marked as a sidecar refusal) signs once more with the previous one
//! ([`PeerAuth::sign_previous`]): a refused proof means the request was not run, so
//! re-sending it is safe. That makes a one-step rotation (`current: new, previous: old`)
//! safe while pods roll: new pods reach old pods with the old secret, old pods reach new
//! ones with it too, and nobody waits for every pod to restart.

use std::{
    collections::HashSet,
    sync::Mutex,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use hmac::{Hmac, Mac};
use http::{HeaderMap, HeaderName, HeaderValue};
use sha2::{Digest, Sha256};

pub const TIMESTAMP_HEADER: &str = "leasehold-peer-timestamp";
pub const NONCE_HEADER: &str = "leasehold-peer-nonce";
pub const SIGNATURE_HEADER: &str = "leasehold-peer-signature";
pub const SIGNED_HEADERS_HEADER: &str = "leasehold-peer-signed-headers";
const TIMESTAMP_NAME: HeaderName = HeaderName::from_static(TIMESTAMP_HEADER);
const NONCE_NAME: HeaderName = HeaderName::from_static(NONCE_HEADER);
const SIGNATURE_NAME: HeaderName = HeaderName::from_static(SIGNATURE_HEADER);
const SIGNED_HEADERS_NAME: HeaderName = HeaderName::from_static(SIGNED_HEADERS_HEADER);

/// Headers every proof covers: they change what a turn means.
pub const ALWAYS_SIGNED: [&str; 2] = ["leasehold-turn-id", "content-type"];

/// How far a proof's timestamp may be from the receiver's wall clock: covers pod clock
/// skew under NTP and queueing, short enough that a captured request soon goes stale.
pub const PROOF_WINDOW: Duration = Duration::from_secs(10);

type HmacSha256 = Hmac<Sha256>;

/// The header a pod's preStop hook sends `GET /drained` with, to start its own sidecar's
/// drain: a kubelet `httpGet` hook carries fixed headers and cannot sign a request.
pub const DRAIN_HOOK_HEADER: &str = "leasehold-drain-hook";
/// Domain of the drain-hook token: it authorises nothing but starting a drain (and the
/// one user hook it was made for, see [`DrainThen`]).
const DRAIN_HOOK_DOMAIN: &[u8] = b"leasehold-drain-hook-v1";

/// A user's own preStop hook that `GET /drained` carries out after the drain (the query
/// parameters `then_port`, `then_path`, `then_sleep`). A drain-hook token covers these
/// values, so the token in a pod's hook runs that hook and no other: whoever reads the
/// token from the pod spec cannot make the sidecar GET another loopback port or path,
/// nor sleep longer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DrainThen {
    /// Port of a GET on the pod's loopback.
    pub port: Option<u16>,
    /// Path (and query) of that GET, as the sidecar receives it (decoded).
    pub path: Option<String>,
    /// Seconds to sleep.
    pub sleep: Option<u64>,
}

impl DrainThen {
    /// No user hook.
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }

    /// The query string `GET /drained` takes for it (without `?`; empty for none).
    pub fn query(&self) -> String {
        let mut parts = Vec::new();
        if let Some(port) = self.port {
            parts.push(format!("then_port={port}"));
        }
        if let Some(path) = &self.path {
            parts.push(format!("then_path={}", query_escape(path)));
        }
        if let Some(sleep) = self.sleep {
            parts.push(format!("then_sleep={sleep}"));
        }
        parts.join("&")
    }

    /// Feed the values to a MAC, unambiguously: each present field under its own marker,
    /// in a fixed order, the one free-form value (the path) length-prefixed. Nothing for
    /// an empty hook, so a hook without a user hook keeps the plain token.
    fn sign_into(&self, mac: &mut HmacSha256) {
        if let Some(port) = self.port {
            mac.update(format!("\nthen_port={port}").as_bytes());
        }
        if let Some(path) = &self.path {
            mac.update(format!("\nthen_path={}:", path.len()).as_bytes());
            mac.update(path.as_bytes());
        }
        if let Some(sleep) = self.sleep {
            mac.update(format!("\nthen_sleep={sleep}").as_bytes());
        }
    }
}

/// Query-escape a value (RFC 3986 unreserved characters kept).
fn query_escape(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn drain_hook_mac(key: &HmacSha256, then: &DrainThen) -> HmacSha256 {
    let mut mac = key.clone();
    mac.update(DRAIN_HOOK_DOMAIN);
    then.sign_into(&mut mac);
    mac
}

/// The drain-hook token of a cluster secret for a hook that then runs `then`: an HMAC of
/// a fixed domain string and the `then` values, so it shows nothing of the secret and
/// opens nothing but the drain of a pod of that cluster followed by that one user hook.
/// It stands in the pod spec (the operator writes it into the hook).
pub fn drain_hook_token(secret: &str, then: &DrainThen) -> String {
    let key = HmacSha256::new_from_slice(secret.as_bytes()).expect("HMAC takes any key length");
    hex(&drain_hook_mac(&key, then).finalize().into_bytes())
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("missing or malformed peer proof header {0}")]
    Missing(&'static str),
    #[error("peer proof does not cover header {0}")]
    Uncovered(&'static str),
    #[error("peer proof timestamp is outside the {PROOF_WINDOW:?} window")]
    Stale,
    #[error(
        "peer proof signature does not match (another secret, another destination, or an altered request)"
    )]
    BadSignature,
    #[error("peer proof was already used (replay)")]
    Replayed,
}

/// One request as the proof sees it.
#[derive(Debug, Clone, Copy)]
pub struct Signed<'a> {
    pub method: &'a str,
    /// Path and query, as sent.
    pub path: &'a str,
    /// The node id of the sidecar the request is for.
    pub destination: &'a str,
    pub headers: &'a HeaderMap,
    pub body: &'a [u8],
}

/// Signs outgoing requests and verifies incoming ones. No secret: insecure mode, nothing
/// is signed and everything is accepted (development only).
pub struct PeerAuth {
    /// HMACs keyed once (a clone per request skips re-keying): the current secret first,
    /// then the previous one during a rotation.
    keys: Vec<HmacSha256>,
    seen: Mutex<Nonces>,
}

/// Never prints a key: a `{:?}` of the sidecar must not leak the cluster secret.
impl std::fmt::Debug for PeerAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerAuth")
            .field("secure", &!self.keys.is_empty())
            .field("keys", &self.keys.len())
            .finish_non_exhaustive()
    }
}

/// Nonces of accepted proofs in two generations: a nonce is remembered for at least one
/// generation, 2 × PROOF_WINDOW, which is as long as any accepted proof (timestamp within
/// PROOF_WINDOW either side of now) can stay fresh. O(1) per request, no scanning.
#[derive(Debug, Default)]
struct Nonces {
    current: HashSet<String>,
    previous: HashSet<String>,
    current_since_ms: u64,
}

impl Nonces {
    /// Record `nonce`; false if it was already seen.
    fn insert(&mut self, nonce: &str, now_ms: u64) -> bool {
        if now_ms.saturating_sub(self.current_since_ms) > 2 * window_ms() {
            self.previous = std::mem::take(&mut self.current);
            self.current_since_ms = now_ms;
        }
        !self.previous.contains(nonce) && self.current.insert(nonce.to_owned())
    }
}

/// Lower-case hex, without `hex::encode`'s char-by-char collect (this runs twice per hop).
fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = Vec::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.extend_from_slice(&[DIGITS[usize::from(b >> 4)], DIGITS[usize::from(b & 0xf)]]);
    }
    String::from_utf8(out).expect("hex digits are ASCII")
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn window_ms() -> u64 {
    PROOF_WINDOW.as_millis() as u64
}

impl PeerAuth {
    /// `current` signs and verifies; `previous` (during a rotation) only verifies.
    pub fn new(current: Option<&str>, previous: Option<&str>) -> Self {
        let key = |s: &str| HmacSha256::new_from_slice(s.as_bytes()).expect("HMAC takes any key length");
        let keys = match current {
            Some(current) => std::iter::once(current).chain(previous).map(key).collect(),
            None => Vec::new(),
        };
        PeerAuth { keys, seen: Mutex::new(Nonces::default()) }
    }

    fn mac(key: &HmacSha256, request: &Signed<'_>, ts: &str, nonce: &str, covered: &[&str]) -> HmacSha256 {
        let mut mac = key.clone();
        for part in [b"leasehold-peer-v2".as_slice(), request.method.as_bytes(), request.path.as_bytes()] {
            mac.update(part);
            mac.update(b"\n");
        }
        for part in [ts, nonce, request.destination] {
            mac.update(part.as_bytes());
            mac.update(b"\n");
        }
        for name in covered {
            // One line per value (a value holds no newline), an absent header as one
            // empty line: a value added to a covered header breaks the proof too.
            let mut values = request.headers.get_all(*name).iter().map(HeaderValue::as_bytes).peekable();
            let absent = values.peek().is_none().then_some(b"".as_slice());
            for value in values.chain(absent) {
                mac.update(name.as_bytes());
                mac.update(b":");
                mac.update(value);
                mac.update(b"\n");
            }
        }
        mac.update(hex(&Sha256::digest(request.body)).as_bytes());
        mac
    }

    /// The proof headers for a request (none in insecure mode), covering
    /// [`ALWAYS_SIGNED`] and `extra` headers.
    pub fn sign(&self, request: &Signed<'_>, extra: &[HeaderName]) -> Vec<(HeaderName, HeaderValue)> {
        self.sign_at(request, extra, now_ms())
    }

    /// The proof made with the previous secret, for a peer that refused the current one;
    /// `None` without a previous secret (nothing else to try).
    pub fn sign_previous(
        &self,
        request: &Signed<'_>,
        extra: &[HeaderName],
    ) -> Option<Vec<(HeaderName, HeaderValue)>> {
        let key = self.keys.get(1)?;
        Some(Self::sign_with(key, request, extra, now_ms()))
    }

    pub fn sign_at(
        &self,
        request: &Signed<'_>,
        extra: &[HeaderName],
        ts_ms: u64,
    ) -> Vec<(HeaderName, HeaderValue)> {
        match self.keys.first() {
            Some(key) => Self::sign_with(key, request, extra, ts_ms),
            None => Vec::new(),
        }
    }

    fn sign_with(
        key: &HmacSha256,
        request: &Signed<'_>,
        extra: &[HeaderName],
        ts_ms: u64,
    ) -> Vec<(HeaderName, HeaderValue)> {
        let covered: Vec<&str> =
            ALWAYS_SIGNED.into_iter().chain(extra.iter().map(HeaderName::as_str)).collect();
        let ts = ts_ms.to_string();
        let mut buffer = uuid::Uuid::encode_buffer();
        let nonce: &str = uuid::Uuid::new_v4().simple().encode_lower(&mut buffer);
        let signature = hex(&Self::mac(key, request, &ts, nonce, &covered).finalize().into_bytes());
        let value =
            |v: &str| HeaderValue::from_str(v).expect("digits, hex and header names are header values");
        vec![
            (TIMESTAMP_NAME, value(&ts)),
            (NONCE_NAME, value(nonce)),
            (SIGNED_HEADERS_NAME, value(&covered.join(","))),
            (SIGNATURE_NAME, value(&signature)),
        ]
    }

    /// Whether `token` is the drain-hook token of the current or the previous secret for
    /// exactly the user hook `then` (any token in insecure mode, like every proof).
    pub fn accepts_drain_hook(&self, token: &str, then: &DrainThen) -> bool {
        if self.keys.is_empty() {
            return true;
        }
        let Ok(bytes) = hex::decode(token) else { return false };
        self.keys.iter().any(|key| drain_hook_mac(key, then).verify_slice(&bytes).is_ok())
    }

    /// Check an incoming request's proof, made for `request.destination` (our node id).
    pub fn verify(&self, request: &Signed<'_>) -> Result<(), AuthError> {
        if self.keys.is_empty() {
            return Ok(());
        }
        let header = |name: &'static str| {
            request
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .filter(|v| !v.is_empty())
                .ok_or(AuthError::Missing(name))
        };
        let (ts, nonce, signature, covered) = (
            header(TIMESTAMP_HEADER)?,
            header(NONCE_HEADER)?,
            header(SIGNATURE_HEADER)?,
            header(SIGNED_HEADERS_HEADER)?,
        );
        let covered: Vec<&str> = covered.split(',').collect();
        if let Some(missing) = ALWAYS_SIGNED.into_iter().find(|name| !covered.contains(name)) {
            return Err(AuthError::Uncovered(missing));
        }
        let ts_ms: u64 = ts.parse().map_err(|_| AuthError::Missing(TIMESTAMP_HEADER))?;
        let now = now_ms();
        if now.abs_diff(ts_ms) > window_ms() {
            return Err(AuthError::Stale);
        }
        let signature = hex::decode(signature).map_err(|_| AuthError::BadSignature)?;
        let valid = self
            .keys
            .iter()
            .any(|key| Self::mac(key, request, ts, nonce, &covered).verify_slice(&signature).is_ok());
        if !valid {
            return Err(AuthError::BadSignature);
        }
        // Only a correctly signed proof reaches the nonce cache, so it cannot be flooded.
        if !self.seen.lock().expect("nonce cache lock").insert(nonce, now) {
            return Err(AuthError::Replayed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_drain_hook_token_opens_only_for_its_secrets() {
        let none = DrainThen::default();
        let token = drain_hook_token("current", &none);
        assert_eq!(token, drain_hook_token("current", &none), "stable: it stands in the pod spec");
        assert!(!token.contains("current"));
        let rotating = PeerAuth::new(Some("current"), Some("before"));
        assert!(rotating.accepts_drain_hook(&token, &none));
        assert!(
            rotating.accepts_drain_hook(&drain_hook_token("before", &none), &none),
            "pods started before a rotation"
        );
        assert!(!rotating.accepts_drain_hook(&drain_hook_token("other", &none), &none));
        assert!(!rotating.accepts_drain_hook("not hex", &none));
        assert!(!rotating.accepts_drain_hook("", &none));
        assert!(PeerAuth::new(None, None).accepts_drain_hook("", &none), "insecure mode accepts everything");
    }

    /// The token covers the user hook it was made for: the same token with another port,
    /// path or sleep (or with a user hook added or removed) opens nothing.
    #[test]
    fn the_drain_hook_token_covers_its_user_hook() {
        let auth = PeerAuth::new(Some("current"), None);
        let get = DrainThen { port: Some(3000), path: Some("/flush?why=stop".into()), sleep: None };
        let token = drain_hook_token("current", &get);
        assert!(auth.accepts_drain_hook(&token, &get));
        let others = [
            DrainThen::default(),
            DrainThen { port: Some(3001), ..get.clone() },
            DrainThen { path: Some("/admin/shutdown".into()), ..get.clone() },
            DrainThen { path: None, ..get.clone() },
            DrainThen { sleep: Some(3600), ..get.clone() },
        ];
        for other in &others {
            assert!(!auth.accepts_drain_hook(&token, other), "{other:?}");
        }
        let plain = drain_hook_token("current", &DrainThen::default());
        assert!(!auth.accepts_drain_hook(&plain, &get), "the plain token runs no user hook");
        // The path is length-prefixed: a path cannot pose as a later field.
        let sleep = DrainThen { port: Some(1), path: Some("a".into()), sleep: Some(5) };
        let forged = DrainThen { port: Some(1), path: Some("a\nthen_sleep=5".into()), sleep: None };
        assert_ne!(drain_hook_token("current", &sleep), drain_hook_token("current", &forged));
        assert_eq!(get.query(), "then_port=3000&then_path=%2Fflush%3Fwhy%3Dstop");
        assert_eq!(DrainThen { sleep: Some(7), ..Default::default() }.query(), "then_sleep=7");
    }
    use super::*;

    fn headers(pairs: &[(HeaderName, HeaderValue)]) -> HeaderMap {
        pairs.iter().cloned().collect()
    }

    const PATH: &str = "/peer/v1/sessions/a/turns";

    /// A turn for node-b with a turn id and a content type.
    fn turn_headers() -> HeaderMap {
        headers(&[
            (crate::headers::TURN_ID, HeaderValue::from_static("11111111-2222-3333-4444-555555555555")),
            (http::header::CONTENT_TYPE, HeaderValue::from_static("application/json")),
        ])
    }

    fn request<'a>(headers: &'a HeaderMap, destination: &'a str, body: &'a [u8]) -> Signed<'a> {
        Signed { method: "POST", path: PATH, destination, headers, body }
    }

    /// The request as it arrives: its own headers plus the proof.
    fn signed(auth: &PeerAuth, headers: &HeaderMap, destination: &str, body: &[u8]) -> HeaderMap {
        let mut sent = headers.clone();
        sent.extend(auth.sign(&request(headers, destination, body), &[]));
        sent
    }

    #[test]
    fn hex_matches_the_hex_crate() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(hex(&bytes), ::hex::encode(&bytes));
    }

    #[test]
    fn the_signature_covers_the_documented_message() {
        let auth = PeerAuth::new(Some("k"), None);
        let (ts, nonce) = ("1700000000000", "0123456789abcdef0123456789abcdef");
        let h = turn_headers();
        let covered = ["leasehold-turn-id", "content-type"];
        let got = hex(&PeerAuth::mac(&auth.keys[0], &request(&h, "node-b", b"hi"), ts, nonce, &covered)
            .finalize()
            .into_bytes());
        let mut want = HmacSha256::new_from_slice(b"k").unwrap();
        let digest = ::hex::encode(Sha256::digest(b"hi"));
        want.update(
            format!(
                "leasehold-peer-v2\nPOST\n{PATH}\n{ts}\n{nonce}\nnode-b\n\
                 leasehold-turn-id:11111111-2222-3333-4444-555555555555\ncontent-type:application/json\n{digest}"
            )
            .as_bytes(),
        );
        assert_eq!(got, ::hex::encode(want.finalize().into_bytes()));
    }

    #[test]
    fn debug_output_does_not_show_the_secret() {
        let shown = format!("{:?}", PeerAuth::new(Some("hunter2-secret"), Some("old-secret")));
        let bytes = format!("{:?}", b"hunter2-secret".to_vec());
        assert!(!shown.contains("hunter2") && !shown.contains("old-secret"), "{shown}");
        assert!(!shown.contains(&bytes[1..20]), "{shown}");
        assert!(shown.contains("secure: true"), "{shown}");
    }

    #[test]
    fn a_fresh_proof_is_accepted_once() {
        let auth = PeerAuth::new(Some("s3cret"), None);
        let h = signed(&auth, &turn_headers(), "node-b", b"hi");
        assert_eq!(auth.verify(&request(&h, "node-b", b"hi")), Ok(()));
        assert_eq!(auth.verify(&request(&h, "node-b", b"hi")), Err(AuthError::Replayed));
    }

    #[test]
    fn anything_else_is_rejected() {
        let auth = PeerAuth::new(Some("s3cret"), None);
        let other = PeerAuth::new(Some("other"), None);
        let empty = HeaderMap::new();
        assert_eq!(auth.verify(&request(&empty, "node-b", b"")), Err(AuthError::Missing(TIMESTAMP_HEADER)));
        let h = signed(&other, &turn_headers(), "node-b", b"hi");
        assert_eq!(auth.verify(&request(&h, "node-b", b"hi")), Err(AuthError::BadSignature), "wrong secret");
        let h = signed(&auth, &turn_headers(), "node-b", b"hi");
        assert_eq!(auth.verify(&request(&h, "node-b", b"tampered")), Err(AuthError::BadSignature), "body");
        let other_path = Signed { path: "/peer/v1/sessions/b/turns", ..request(&h, "node-b", b"hi") };
        assert_eq!(auth.verify(&other_path), Err(AuthError::BadSignature), "path");
        let other_method = Signed { method: "GET", ..request(&h, "node-b", b"hi") };
        assert_eq!(auth.verify(&other_method), Err(AuthError::BadSignature), "method");
        let old = {
            let mut sent = turn_headers();
            sent.extend(auth.sign_at(&request(&turn_headers(), "node-b", b"hi"), &[], now_ms() - 60_000));
            sent
        };
        assert_eq!(auth.verify(&request(&old, "node-b", b"hi")), Err(AuthError::Stale));
    }

    /// Mid-rotation: a new pod (current new, previous old) and an old pod (old only).
    #[test]
    fn a_rotation_reaches_old_pods_with_the_previous_secret() {
        let new_pod = PeerAuth::new(Some("new"), Some("old"));
        let old_pod = PeerAuth::new(Some("old"), None);
        let (h, body) = (turn_headers(), b"hi".as_slice());
        let sent = signed(&new_pod, &h, "node-b", body);
        assert_eq!(old_pod.verify(&request(&sent, "node-b", body)), Err(AuthError::BadSignature));
        let mut retried = h.clone();
        retried.extend(new_pod.sign_previous(&request(&h, "node-b", body), &[]).expect("a previous secret"));
        assert_eq!(old_pod.verify(&request(&retried, "node-b", body)), Ok(()));
        let from_old = signed(&old_pod, &h, "node-b", body);
        assert_eq!(new_pod.verify(&request(&from_old, "node-b", body)), Ok(()), "old proofs still accepted");
        assert!(old_pod.sign_previous(&request(&h, "node-b", body), &[]).is_none(), "nothing else to try");
    }

    #[test]
    fn a_captured_request_cannot_be_replayed_to_another_pod_or_with_other_headers() {
        let auth = PeerAuth::new(Some("s3cret"), None);
        let h = signed(&auth, &turn_headers(), "node-b", b"hi");
        assert_eq!(auth.verify(&request(&h, "node-c", b"hi")), Err(AuthError::BadSignature), "destination");
        for (name, value) in [
            (crate::headers::TURN_ID, "99999999-2222-3333-4444-555555555555"),
            (http::header::CONTENT_TYPE, "text/plain"),
        ] {
            let mut altered = h.clone();
            altered.insert(name.clone(), HeaderValue::from_static(value));
            assert_eq!(
                auth.verify(&request(&altered, "node-b", b"hi")),
                Err(AuthError::BadSignature),
                "{name}"
            );
        }
        let mut narrowed = h.clone();
        narrowed.insert(SIGNED_HEADERS_NAME, HeaderValue::from_static("content-type"));
        assert_eq!(
            auth.verify(&request(&narrowed, "node-b", b"hi")),
            Err(AuthError::Uncovered("leasehold-turn-id")),
            "a proof must cover the turn id"
        );
    }

    #[test]
    fn extra_headers_are_covered_when_signed() {
        let auth = PeerAuth::new(Some("s3cret"), None);
        let mut h = turn_headers();
        h.insert(http::header::AUTHORIZATION, HeaderValue::from_static("Bearer a"));
        let proof = auth.sign(&request(&h, "node-b", b""), &[http::header::AUTHORIZATION]);
        h.extend(proof);
        let mut altered = h.clone();
        altered.insert(http::header::AUTHORIZATION, HeaderValue::from_static("Bearer b"));
        assert_eq!(auth.verify(&request(&altered, "node-b", b"")), Err(AuthError::BadSignature));
        assert_eq!(auth.verify(&request(&h, "node-b", b"")), Ok(()));
    }

    #[test]
    fn a_covered_header_cannot_be_added_nor_given_a_second_value() {
        let auth = PeerAuth::new(Some("s3cret"), None);
        let (accept, tenant) = (http::header::ACCEPT, HeaderName::from_static("x-tenant"));
        let mut h = turn_headers();
        h.append(accept.clone(), HeaderValue::from_static("a/b"));
        h.append(accept.clone(), HeaderValue::from_static("c/d"));
        let proof = auth.sign(&request(&h, "node-b", b""), &[accept.clone(), tenant.clone()]);
        h.extend(proof);
        let mut added = h.clone();
        added.insert(tenant, HeaderValue::from_static("t1"));
        assert_eq!(auth.verify(&request(&added, "node-b", b"")), Err(AuthError::BadSignature), "added");
        let mut appended = h.clone();
        appended.append(accept.clone(), HeaderValue::from_static("e/f"));
        assert_eq!(auth.verify(&request(&appended, "node-b", b"")), Err(AuthError::BadSignature), "appended");
        let mut dropped = h.clone();
        dropped.insert(accept, HeaderValue::from_static("a/b"));
        assert_eq!(auth.verify(&request(&dropped, "node-b", b"")), Err(AuthError::BadSignature), "dropped");
        assert_eq!(auth.verify(&request(&h, "node-b", b"")), Ok(()), "both values as signed");
    }

    #[test]
    fn during_a_rotation_both_secrets_verify_and_the_current_one_signs() {
        let old = PeerAuth::new(Some("old"), None);
        let rotating = PeerAuth::new(Some("new"), Some("old"));
        let new = PeerAuth::new(Some("new"), None);
        let from_old = signed(&old, &turn_headers(), "node-b", b"");
        assert_eq!(rotating.verify(&request(&from_old, "node-b", b"")), Ok(()), "old pods' proofs");
        let from_rotating = signed(&rotating, &turn_headers(), "node-b", b"");
        assert_eq!(new.verify(&request(&from_rotating, "node-b", b"")), Ok(()), "signed with the current");
        let from_rotating = signed(&rotating, &turn_headers(), "node-b", b"");
        assert_eq!(old.verify(&request(&from_rotating, "node-b", b"")), Err(AuthError::BadSignature));
    }

    #[test]
    fn insecure_mode_signs_nothing_and_accepts_all() {
        let auth = PeerAuth::new(None, None);
        let empty = HeaderMap::new();
        assert!(auth.sign(&request(&empty, "x", b""), &[]).is_empty());
        assert_eq!(auth.verify(&request(&empty, "x", b"")), Ok(()));
    }
}
