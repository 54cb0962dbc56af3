//! Peer authentication: a forwarded request carries an HMAC-SHA256 of the cluster secret
//! over method, path, timestamp, a nonce and the body digest. The peer listener accepts it
//! only within a short window and only once (nonces are remembered for the window).

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
const TIMESTAMP_NAME: HeaderName = HeaderName::from_static(TIMESTAMP_HEADER);
const NONCE_NAME: HeaderName = HeaderName::from_static(NONCE_HEADER);
const SIGNATURE_NAME: HeaderName = HeaderName::from_static(SIGNATURE_HEADER);

/// How far a proof's timestamp may be from the receiver's wall clock: covers pod clock
/// skew under NTP and queueing, short enough that a captured request soon goes stale.
pub const PROOF_WINDOW: Duration = Duration::from_secs(10);

type HmacSha256 = Hmac<Sha256>;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("missing or malformed peer proof header {0}")]
    Missing(&'static str),
    #[error("peer proof timestamp is outside the {PROOF_WINDOW:?} window")]
    Stale,
    #[error("peer proof signature does not match")]
    BadSignature,
    #[error("peer proof was already used (replay)")]
    Replayed,
}

/// Signs outgoing peer requests and verifies incoming ones. `None` secret: insecure mode,
/// nothing is signed and everything is accepted (development only).
pub struct PeerAuth {
    /// The HMAC keyed with the cluster secret once (a clone per request skips re-keying).
    key: Option<HmacSha256>,
    seen: Mutex<Nonces>,
}

/// Never prints the key: a `{:?}` of the sidecar must not leak the cluster secret.
impl std::fmt::Debug for PeerAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerAuth").field("secure", &self.key.is_some()).finish_non_exhaustive()
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
    pub fn new(secret: Option<&str>) -> Self {
        let key =
            secret.map(|s| HmacSha256::new_from_slice(s.as_bytes()).expect("HMAC takes any key length"));
        PeerAuth { key, seen: Mutex::new(Nonces::default()) }
    }

    fn mac(key: &HmacSha256, method: &str, path: &str, ts: &str, nonce: &str, body: &[u8]) -> HmacSha256 {
        let mut mac = key.clone();
        let digest = hex(&Sha256::digest(body));
        // "leasehold-peer-v1\n{method}\n{path}\n{ts}\n{nonce}\n{digest}", fed in pieces.
        for part in [
            b"leasehold-peer-v1".as_slice(),
            method.as_bytes(),
            path.as_bytes(),
            ts.as_bytes(),
            nonce.as_bytes(),
        ] {
            mac.update(part);
            mac.update(b"\n");
        }
        mac.update(digest.as_bytes());
        mac
    }

    /// The proof headers for a request (none in insecure mode).
    pub fn sign(&self, method: &str, path: &str, body: &[u8]) -> Vec<(HeaderName, HeaderValue)> {
        self.sign_at(method, path, body, now_ms())
    }

    pub fn sign_at(
        &self,
        method: &str,
        path: &str,
        body: &[u8],
        ts_ms: u64,
    ) -> Vec<(HeaderName, HeaderValue)> {
        let Some(key) = &self.key else { return Vec::new() };
        let ts = ts_ms.to_string();
        let mut buffer = uuid::Uuid::encode_buffer();
        let nonce: &str = uuid::Uuid::new_v4().simple().encode_lower(&mut buffer);
        let signature = hex(&Self::mac(key, method, path, &ts, nonce, body).finalize().into_bytes());
        let value = |v: &str| HeaderValue::from_str(v).expect("digits and hex are header values");
        vec![(TIMESTAMP_NAME, value(&ts)), (NONCE_NAME, value(nonce)), (SIGNATURE_NAME, value(&signature))]
    }

    /// Check an incoming request's proof.
    pub fn verify(
        &self,
        method: &str,
        path: &str,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<(), AuthError> {
        let Some(key) = &self.key else { return Ok(()) };
        let header = |name: &'static str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .filter(|v| !v.is_empty())
                .ok_or(AuthError::Missing(name))
        };
        let (ts, nonce, signature) =
            (header(TIMESTAMP_HEADER)?, header(NONCE_HEADER)?, header(SIGNATURE_HEADER)?);
        let ts_ms: u64 = ts.parse().map_err(|_| AuthError::Missing(TIMESTAMP_HEADER))?;
        let now = now_ms();
        if now.abs_diff(ts_ms) > window_ms() {
            return Err(AuthError::Stale);
        }
        let signature = hex::decode(signature).map_err(|_| AuthError::BadSignature)?;
        Self::mac(key, method, path, ts, nonce, body)
            .verify_slice(&signature)
            .map_err(|_| AuthError::BadSignature)?;
        // Only a correctly signed proof reaches the nonce cache, so it cannot be flooded.
        if !self.seen.lock().expect("nonce cache lock").insert(nonce, now) {
            return Err(AuthError::Replayed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(proof: &[(HeaderName, HeaderValue)]) -> HeaderMap {
        proof.iter().cloned().collect()
    }

    #[test]
    fn hex_matches_the_hex_crate() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(hex(&bytes), ::hex::encode(&bytes));
    }

    #[test]
    fn the_signature_covers_the_documented_message() {
        let auth = PeerAuth::new(Some("k"));
        let (ts, nonce) = ("1700000000000", "0123456789abcdef0123456789abcdef");
        let key = auth.key.as_ref().unwrap();
        let got = hex(&PeerAuth::mac(key, "POST", "/p", ts, nonce, b"hi").finalize().into_bytes());
        let mut want = HmacSha256::new_from_slice(b"k").unwrap();
        let digest = ::hex::encode(Sha256::digest(b"hi"));
        want.update(format!("leasehold-peer-v1\nPOST\n/p\n{ts}\n{nonce}\n{digest}").as_bytes());
        assert_eq!(got, ::hex::encode(want.finalize().into_bytes()));
    }

    #[test]
    fn debug_output_does_not_show_the_secret() {
        let shown = format!("{:?}", PeerAuth::new(Some("hunter2-secret")));
        let bytes = format!("{:?}", b"hunter2-secret".to_vec());
        assert!(!shown.contains("hunter2") && !shown.contains(&bytes[1..20]), "{shown}");
        assert!(shown.contains("secure: true"), "{shown}");
    }

    #[test]
    fn a_fresh_proof_is_accepted_once() {
        let auth = PeerAuth::new(Some("s3cret"));
        let h = headers(&auth.sign("POST", "/peer/v1/sessions/a/turns", b"hi"));
        assert_eq!(auth.verify("POST", "/peer/v1/sessions/a/turns", &h, b"hi"), Ok(()));
        assert_eq!(auth.verify("POST", "/peer/v1/sessions/a/turns", &h, b"hi"), Err(AuthError::Replayed));
    }

    #[test]
    fn anything_else_is_rejected() {
        let auth = PeerAuth::new(Some("s3cret"));
        let other = PeerAuth::new(Some("other"));
        let path = "/peer/v1/sessions/a/turns";
        assert_eq!(
            auth.verify("POST", path, &HeaderMap::new(), b""),
            Err(AuthError::Missing(TIMESTAMP_HEADER))
        );
        let h = headers(&other.sign("POST", path, b"hi"));
        assert_eq!(auth.verify("POST", path, &h, b"hi"), Err(AuthError::BadSignature), "wrong secret");
        let h = headers(&auth.sign("POST", path, b"hi"));
        assert_eq!(auth.verify("POST", path, &h, b"tampered"), Err(AuthError::BadSignature), "body");
        assert_eq!(auth.verify("POST", "/peer/v1/sessions/b/turns", &h, b"hi"), Err(AuthError::BadSignature));
        assert_eq!(auth.verify("GET", path, &h, b"hi"), Err(AuthError::BadSignature), "method");
        let old = headers(&auth.sign_at("POST", path, b"hi", now_ms() - 60_000));
        assert_eq!(auth.verify("POST", path, &old, b"hi"), Err(AuthError::Stale));
    }

    #[test]
    fn insecure_mode_signs_nothing_and_accepts_all() {
        let auth = PeerAuth::new(None);
        assert!(auth.sign("POST", "/x", b"").is_empty());
        assert_eq!(auth.verify("POST", "/x", &HeaderMap::new(), b""), Ok(()));
    }
}
