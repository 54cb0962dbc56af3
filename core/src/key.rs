//! Session keys: 1–200 bytes of `[A-Za-z0-9._:@-]` (CONTRACT §3).

use std::{fmt, str::FromStr};

/// Longest accepted key, in bytes.
pub const MAX_KEY_LEN: usize = 200;

/// A validated session key. Constructing one is the only way to name a session, so no
/// store statement or route ever sees an unchecked key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionKey(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidKey {
    #[error("session key is empty")]
    Empty,
    #[error("session key is {0} bytes long; the limit is {MAX_KEY_LEN}")]
    TooLong(usize),
    #[error("session key contains {0:?}; allowed are A-Z a-z 0-9 . _ : @ -")]
    BadChar(char),
    /// `.` and `..` are URL dot segments: every HTTP client library removes them from a
    /// path (`/sessions/../turns` becomes `/turns`), so no agent could be reached for them.
    #[error("session key {0:?} is a URL dot segment; use any other key")]
    DotSegment(&'static str),
}

fn allowed(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '@' | '-')
}

impl SessionKey {
    pub fn parse(s: &str) -> Result<Self, InvalidKey> {
        if s.is_empty() {
            return Err(InvalidKey::Empty);
        }
        if s.len() > MAX_KEY_LEN {
            return Err(InvalidKey::TooLong(s.len()));
        }
        match s.chars().find(|&c| !allowed(c)) {
            Some(c) => Err(InvalidKey::BadChar(c)),
            None if s == "." => Err(InvalidKey::DotSegment(".")),
            None if s == ".." => Err(InvalidKey::DotSegment("..")),
            None => Ok(SessionKey(s.to_owned())),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for SessionKey {
    type Err = InvalidKey;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_documented_alphabet() {
        for ok in ["a", "user@example.com:chat-1", "A.b_c:d@e-f", "...", ".a", "..b", &"x".repeat(200)] {
            assert_eq!(SessionKey::parse(ok).unwrap().as_str(), ok);
        }
    }

    #[test]
    fn rejects_everything_else() {
        assert_eq!(SessionKey::parse(""), Err(InvalidKey::Empty));
        assert_eq!(SessionKey::parse(&"x".repeat(201)), Err(InvalidKey::TooLong(201)));
        for (bad, c) in [("a/b", '/'), ("a b", ' '), ("ä", 'ä'), ("a%2F", '%'), ("a\0", '\0')] {
            assert_eq!(SessionKey::parse(bad), Err(InvalidKey::BadChar(c)), "{bad:?}");
        }
        assert_eq!(SessionKey::parse("."), Err(InvalidKey::DotSegment(".")));
        assert_eq!(SessionKey::parse(".."), Err(InvalidKey::DotSegment("..")));
    }
}
