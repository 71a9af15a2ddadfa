//! The idempotency key: one business intent, one key.
//!
//! A key is 8 to 64 characters of `[A-Za-z0-9_-]` (a UUID fits, with or without
//! dashes). Generated keys carry 128 random bits as 32 lower-case hex characters.

use std::fmt;

/// Shortest valid key.
pub const MIN_LEN: usize = 8;
/// Longest valid key.
pub const MAX_LEN: usize = 64;

/// The rule a key must follow, as error messages state it.
pub const KEY_RULE: &str = "must be one value of 8 to 64 characters from [A-Za-z0-9_-]";

/// The bytes a key may hold, `[A-Za-z0-9_-]`, as a table: one load per byte of a key
/// that every protected call checks.
const KEY_BYTES: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric() || c == b'-' || c == b'_';
        b += 1;
    }
    table
};

/// A validated idempotency key.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

/// Why a key was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidKey {
    reason: &'static str,
}

impl InvalidKey {
    /// What was wrong with the key (`"too short"`, …).
    pub fn reason(&self) -> &'static str {
        self.reason
    }
}

impl fmt::Display for InvalidKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "idempotency key {}: {KEY_RULE}", self.reason)
    }
}

impl std::error::Error for InvalidKey {}

impl IdempotencyKey {
    /// Validates `bytes` (a header value) as a key.
    ///
    /// ```
    /// use idem_core::key::IdempotencyKey;
    /// assert!(IdempotencyKey::parse(b"order-2024-0001").is_ok());
    /// assert!(IdempotencyKey::parse(b"short").is_err());
    /// assert!(IdempotencyKey::parse(b"has space in it").is_err());
    /// ```
    pub fn parse(bytes: &[u8]) -> Result<Self, InvalidKey> {
        Self::validate(bytes).map(|k| IdempotencyKey(k.to_owned()))
    }

    /// Checks `bytes` as [`parse`](Self::parse) does, and returns them as the key's
    /// text without copying them.
    ///
    /// ```
    /// use idem_core::key::IdempotencyKey;
    /// assert_eq!(IdempotencyKey::validate(b"order-2024-0001"), Ok("order-2024-0001"));
    /// assert!(IdempotencyKey::validate(b"has space in it").is_err());
    /// ```
    pub fn validate(bytes: &[u8]) -> Result<&str, InvalidKey> {
        if bytes.len() < MIN_LEN {
            return Err(InvalidKey {
                reason: "is too short",
            });
        }
        if bytes.len() > MAX_LEN {
            return Err(InvalidKey {
                reason: "is too long",
            });
        }
        if !bytes.iter().all(|&b| KEY_BYTES[usize::from(b)]) {
            return Err(InvalidKey {
                reason: "has a character outside [A-Za-z0-9_-]",
            });
        }
        // Every byte is ASCII, so this cannot fail.
        std::str::from_utf8(bytes).map_err(|_| InvalidKey {
            reason: "has a character outside [A-Za-z0-9_-]",
        })
    }

    /// A fresh random key: 128 bits from the thread-local CSPRNG, as 32 hex characters.
    pub fn generate() -> Self {
        let bits: u128 = rand::random();
        IdempotencyKey(format!("{bits:032x}"))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.0).finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for IdempotencyKey {
    type Err = InvalidKey;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rule() {
        for ok in [
            "abcdefgh",
            "550e8400-e29b-41d4-a716-446655440000",
            "A_b-9___",
            &"x".repeat(64),
        ] {
            assert!(IdempotencyKey::parse(ok.as_bytes()).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "abcdefg",
            &"x".repeat(65),
            "abc,defgh",
            "abc defgh",
            "abcdéfgh",
            "abc\ndefgh",
            "abc\0defgh",
        ] {
            let err = IdempotencyKey::parse(bad.as_bytes()).unwrap_err();
            assert!(err.to_string().contains("[A-Za-z0-9_-]"), "{bad:?}");
        }
    }

    #[test]
    fn every_byte_is_judged_by_the_rule() {
        for b in 0..=u8::MAX {
            let key = [b'a', b'b', b'c', b, b'd', b'e', b'f', b'g'];
            let allowed = b.is_ascii_alphanumeric() || b == b'-' || b == b'_';
            assert_eq!(IdempotencyKey::validate(&key).is_ok(), allowed, "{b:#04x}");
        }
    }

    #[test]
    fn generated_keys_are_valid_and_distinct() {
        let a = IdempotencyKey::generate();
        let b = IdempotencyKey::generate();
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), 32);
        assert!(IdempotencyKey::parse(a.as_str().as_bytes()).is_ok());
    }
}
