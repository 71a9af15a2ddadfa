//! What the layer lets through of a server's status headers (the response head, and the
//! trailers): whatever a server writes, the caller's tonic client must not panic on it.
//!
//! tonic 0.14's `Status::from_header_map` panics on a `grpc-status-details-bin` that is
//! not base64 as its decoder reads it (standard alphabet, padding optional, no stray
//! bits). The layer already decodes that header for `RetryInfo`: a value it can decode
//! in another form (URL-safe, stray bits) is replaced by its canonical form; one it
//! cannot decode is dropped. `grpc-status` and `grpc-message` stay as they are, so the
//! caller still gets the server's code and message.
//!
//! Only the layer writes the [`CallReport`](crate::retry::CallReport)'s local headers
//! (`x-idem-retry-*`): a server's are removed, so they never become the caller's report
//! (nor its metadata).

use http::{HeaderMap, HeaderName, HeaderValue};
use idem_core::headers::{GRPC_STATUS_DETAILS, RETRY_ATTEMPTS, RETRY_OUTCOME};

use crate::retry::policy::pushback::base64_decode;

/// Makes the status headers of `headers` (a response head or its trailers) safe to
/// hand to tonic.
pub(crate) fn scrub(headers: &mut HeaderMap) {
    // Every response passes here twice (head and trailers), and almost none carries
    // either header: one pass over the few names a gRPC response has is cheaper than
    // the three hashed lookups below (about 1,000 instructions a call saved).
    if !headers.keys().any(needs_scrub) {
        return;
    }
    repair_details(headers);
    strip_report(headers);
}

/// Whether `name` is one that [`scrub`] looks at.
fn needs_scrub(name: &HeaderName) -> bool {
    let name = name.as_str();
    name == GRPC_STATUS_DETAILS.as_str() || name.starts_with(REPORT_PREFIX)
}

/// The prefix of the report's local headers ([`RETRY_OUTCOME`], [`RETRY_ATTEMPTS`]).
const REPORT_PREFIX: &str = "x-idem-retry-";

/// Removes every `x-idem-retry-*` header: those are the layer's to write.
fn strip_report(headers: &mut HeaderMap) {
    // The two the report is read from, without a scan of the map.
    headers.remove(RETRY_OUTCOME);
    headers.remove(RETRY_ATTEMPTS);
    if !headers
        .keys()
        .any(|k| k.as_str().starts_with(REPORT_PREFIX))
    {
        return;
    }
    let names: Vec<HeaderName> = headers
        .keys()
        .filter(|k| k.as_str().starts_with(REPORT_PREFIX))
        .cloned()
        .collect();
    for name in names {
        headers.remove(name);
    }
}

/// Keeps a canonical `grpc-status-details-bin`, re-encodes one the layer can decode,
/// drops one it cannot (and every value after the first, which tonic never reads).
fn repair_details(headers: &mut HeaderMap) {
    let mut values = headers.get_all(GRPC_STATUS_DETAILS).iter();
    let Some(first) = values.next() else {
        return;
    };
    let repeated = values.next().is_some();
    let raw = first.as_bytes();
    let canonical = base64_decode(raw).map(|bytes| base64_encode(&bytes));
    let keep = canonical
        .as_deref()
        .is_some_and(|c| !repeated && is_canonical(raw, c.as_bytes()));
    if keep {
        return;
    }
    match canonical.and_then(|c| HeaderValue::from_str(&c).ok()) {
        Some(value) => {
            headers.insert(GRPC_STATUS_DETAILS, value);
        }
        None => {
            headers.remove(GRPC_STATUS_DETAILS);
        }
    }
}

/// Whether `raw` is `canonical` (unpadded standard base64), with or without its padding.
fn is_canonical(raw: &[u8], canonical: &[u8]) -> bool {
    let Some(padding) = raw.strip_prefix(canonical) else {
        return false;
    };
    let expected = (4 - canonical.len() % 4) % 4;
    padding.is_empty() || (padding.len() == expected && padding.iter().all(|c| *c == b'='))
}

/// Standard base64 without padding, as gRPC writes binary headers.
fn base64_encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let mut acc = [0u8; 3];
        acc[..chunk.len()].copy_from_slice(chunk);
        let n = u32::from_be_bytes([0, acc[0], acc[1], acc[2]]);
        for i in 0..=chunk.len() {
            let index = (n >> (18 - 6 * i)) & 0x3f;
            out.push(char::from(ALPHABET[index as usize]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn scrubbed(value: &[u8]) -> Option<Vec<u8>> {
        let mut h = HeaderMap::new();
        h.insert("grpc-status", HeaderValue::from_static("9"));
        h.insert(GRPC_STATUS_DETAILS, HeaderValue::from_bytes(value).unwrap());
        scrub(&mut h);
        assert_eq!(h["grpc-status"], "9");
        // Whatever is left, tonic reads it without panicking.
        let status = tonic::Status::from_header_map(&h).unwrap();
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        h.get(GRPC_STATUS_DETAILS).map(|v| v.as_bytes().to_vec())
    }

    #[test]
    fn canonical_values_stay_others_are_repaired_or_dropped() {
        assert_eq!(scrubbed(b"aGVsbG8").unwrap(), b"aGVsbG8");
        assert_eq!(scrubbed(b"aGVsbG8=").unwrap(), b"aGVsbG8=");
        assert_eq!(scrubbed(b"").unwrap(), b"");
        // URL-safe, stray bits, padding where none is due: re-encoded.
        assert_eq!(scrubbed(b"-_8").unwrap(), b"+/8");
        assert_eq!(scrubbed(b"aGVsbG9").unwrap(), b"aGVsbG8");
        assert_eq!(scrubbed(b"AAAA====").unwrap(), b"AAAA");
        // Not base64 at all: dropped.
        assert_eq!(scrubbed(b"!!not base64!!"), None);
        assert_eq!(scrubbed(b"a"), None);
    }

    #[test]
    fn report_headers_are_the_layers_to_write() {
        let mut h = HeaderMap::new();
        h.insert("grpc-status", HeaderValue::from_static("14"));
        h.insert(RETRY_OUTCOME, HeaderValue::from_static("throttled"));
        h.append(RETRY_ATTEMPTS, HeaderValue::from_static("5"));
        h.append(RETRY_ATTEMPTS, HeaderValue::from_static("6"));
        h.insert("x-idem-retry-future", HeaderValue::from_static("1"));
        h.insert("x-idem-replayed", HeaderValue::from_static("kept"));
        scrub(&mut h);
        let names: Vec<_> = h.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["grpc-status", "x-idem-replayed"]);
    }

    proptest! {
        /// Whatever a server writes there, tonic reads the scrubbed headers without
        /// panicking, and valid details come through unchanged in meaning.
        #[test]
        fn tonic_never_panics_on_scrubbed_details(
            raw in proptest::collection::vec(0x20u8..0x7f, 0..24),
            bytes in proptest::collection::vec(any::<u8>(), 0..24),
        ) {
            scrubbed(&raw);
            let encoded = base64_encode(&bytes);
            prop_assert_eq!(base64_decode(encoded.as_bytes()).unwrap(), bytes.clone());
            let mut h = HeaderMap::new();
            h.insert("grpc-status", HeaderValue::from_static("9"));
            h.insert(GRPC_STATUS_DETAILS, HeaderValue::from_str(&encoded).unwrap());
            scrub(&mut h);
            let status = tonic::Status::from_header_map(&h).unwrap();
            prop_assert_eq!(status.details(), &bytes[..]);
        }
    }
}
