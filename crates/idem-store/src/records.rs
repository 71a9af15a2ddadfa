//! Reading and deleting one record by its scope: what an operator needs to see what a
//! call stored, and to remove a record that must run again (an outcome recorded by
//! mistake, a stuck in-flight record after an incident).
//!
//! [`Store::read_record`](crate::Store::read_record) and
//! [`Store::delete_record`](crate::Store::delete_record) are the contract; `idem records
//! show|delete` (the `idem-cli` crate) calls them on Redis and PostgreSQL, and a service
//! on the [`MemoryStore`](crate::memory::MemoryStore) calls them itself, behind its own
//! admin authentication.
//!
//! **A record holds the response the handler returned**, which may be personal data:
//! whoever can read the store can read every stored response. No store opens a network
//! endpoint for these calls.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use idem_store::memory::MemoryStore;
//! use idem_store::{DeleteMode, Deletion, Scope, Store};
//! let store = MemoryStore::default();
//! let scope = Scope::for_call("acme", "/shop.v1.Orders/CreateOrder", "key-0001");
//! assert!(store.read_record(&scope).await.unwrap().is_none());
//! let gone = store.delete_record(&scope, DeleteMode::UnlessInFlight).await.unwrap();
//! assert!(matches!(gone, Deletion::NotFound));
//! # }
//! ```

use std::fmt;
use std::time::{Duration, SystemTime};

use crate::RecordState;

/// What a forced delete of an in-flight record risks; the refusal to delete one says it.
pub const FORCE_DELETE_RISK: &str = "the record is in flight: a handler may be running \
    under it right now. Deleting it loses that run's outcome (its completion will be \
    refused as stale, and its response never recorded), and the next call with this key \
    runs the handler again, possibly while the first run is still going. Pass --force \
    (DeleteMode::Force) to delete it anyway";

/// One record as [`Store::read_record`](crate::Store::read_record) reports it.
///
/// Times a store does not keep are `None`. The memory store keeps the creation time to
/// the second (in space its compact records had free, see [`memory`](crate::memory)) and
/// the completion time while the completion is queued; PostgreSQL keeps both on the
/// database clock from schema 2 on (`None` for rows written under schema 1); Redis keeps
/// both for records written by this version on (older records have none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordInfo {
    /// State, fence, fingerprint, lease (in flight) and stored outcome (completed).
    pub state: RecordState,
    /// Time left until the store drops the record (its TTL, or for an in-flight record
    /// the lease plus the grace a stalled holder gets), when the store knows it.
    pub expires_in: Option<Duration>,
    /// When the record was first claimed (this run of it), on the store's clock.
    pub created_at: Option<SystemTime>,
    /// When it was completed, on the store's clock.
    pub completed_at: Option<SystemTime>,
}

impl RecordInfo {
    /// A record with only its state known.
    pub fn of(state: RecordState) -> Self {
        RecordInfo {
            state,
            expires_in: None,
            created_at: None,
            completed_at: None,
        }
    }

    /// Whether a claimant holds (or held, if its lease ended) the record's lease.
    pub fn is_in_flight(&self) -> bool {
        matches!(self.state, RecordState::InFlight { .. })
    }
}

/// Whether [`Store::delete_record`](crate::Store::delete_record) may delete an in-flight
/// record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeleteMode {
    /// Refuse an in-flight record ([`Deletion::RefusedInFlight`]); delete any other.
    UnlessInFlight,
    /// Delete whatever is there. For an in-flight record see [`FORCE_DELETE_RISK`].
    Force,
}

/// What [`Store::delete_record`](crate::Store::delete_record) did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Deletion {
    /// The record was deleted; this is what it held. The next claim of its scope runs
    /// the handler again, with a higher fence.
    Deleted(RecordInfo),
    /// There was no record (or it had expired).
    NotFound,
    /// The record is in flight and [`DeleteMode::UnlessInFlight`] was asked: nothing was
    /// changed. See [`FORCE_DELETE_RISK`].
    RefusedInFlight(RecordInfo),
}

impl fmt::Display for Deletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Deletion::Deleted(_) => f.write_str("deleted"),
            Deletion::NotFound => f.write_str("no such record"),
            Deletion::RefusedInFlight(_) => write!(f, "not deleted: {FORCE_DELETE_RISK}"),
        }
    }
}

/// Why a hex scope given by an operator is not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScopeHexError {
    /// A character that is not a hex digit.
    #[error("scope hex: {0:?} at offset {1} is not a hex digit (0-9, a-f)")]
    NotHex(char, usize),
    /// Too short to name a record, or longer than a scope.
    #[error(
        "scope hex: {0} digits; give the 16 digits the logs print (`scope=`), or up to \
         the full 64, an even number"
    )]
    Length(usize),
}

/// The bytes of a hex scope or scope prefix: 16 to 64 hex digits, an even number
/// (upper or lower case).
///
/// # Errors
/// [`ScopeHexError`] naming what is wrong.
pub fn parse_scope_hex(hex: &str) -> Result<Vec<u8>, ScopeHexError> {
    if let Some((i, c)) = hex.char_indices().find(|(_, c)| !c.is_ascii_hexdigit()) {
        return Err(ScopeHexError::NotHex(c, i));
    }
    let n = hex.len();
    if !(16..=64).contains(&n) || !n.is_multiple_of(2) {
        return Err(ScopeHexError::Length(n));
    }
    let digit = |b: u8| match b {
        b'0'..=b'9' => b - b'0',
        b'a'..=b'f' => b - b'a' + 10,
        _ => b - b'A' + 10,
    };
    Ok(hex
        .as_bytes()
        .chunks(2)
        .map(|p| (digit(p[0]) << 4) | digit(p[1]))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn scope_hex_is_checked() {
        assert_eq!(
            parse_scope_hex("00ff10AB00ff10ab").unwrap(),
            [0, 255, 16, 171, 0, 255, 16, 171]
        );
        assert_eq!(parse_scope_hex(&"a".repeat(64)).unwrap().len(), 32);
        assert!(matches!(
            parse_scope_hex("00ff10ab00ff10ag"),
            Err(ScopeHexError::NotHex('g', 15))
        ));
        assert!(matches!(
            parse_scope_hex("abc"),
            Err(ScopeHexError::Length(3))
        ));
        assert!(parse_scope_hex(&"a".repeat(17)).is_err());
        assert!(parse_scope_hex(&"a".repeat(66)).is_err());
        assert!(parse_scope_hex("é0000000000000000").is_err());
    }

    proptest! {
        #[test]
        fn scope_hex_never_panics(s in ".{0,80}") {
            let _ = parse_scope_hex(&s);
        }
    }
}
