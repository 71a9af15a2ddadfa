//! What becomes of a handler's outcome: recorded for duplicates, or released so a retry
//! runs again. A pure decision over the response's code, the method's code lists and
//! the handler's own [`IdemDecision`], apart from the machinery that records it.

use http::HeaderMap;
use idem_core::code::CodeSet;
pub(crate) use idem_core::code::grpc_status_code as grpc_status;
use tonic::{Code, Status};

/// Response header a handler may set to override the method's code lists for this one
/// response: `store` (record and replay it) or `release` (nothing was committed; let a
/// retry run again). Works on OK responses and on errors (as `Status` metadata). The
/// layer removes it (from headers and trailers) before the response leaves.
/// A `&str` because tonic's `MetadataMap::insert` takes one.
pub const DECISION_HEADER: &str = "x-idempotency-decision";

/// [`DECISION_HEADER`] parsed once: a lookup by `&str` parses the name every time.
const DECISION: http::HeaderName = http::HeaderName::from_static(DECISION_HEADER);

/// A handler's verdict on its own response, overriding the method's
/// `cacheableStatusCodes` / `releaseStatusCodes`. Insert it as a response extension
/// (`tonic::Response::extensions_mut`), or send [`DECISION_HEADER`] (needed for errors,
/// which carry no extensions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdemDecision {
    /// Record this response and replay it to duplicates.
    Store,
    /// Nothing was committed: release the record so a retry runs again.
    Release,
}

/// Removes every [`DECISION_HEADER`] from `h` and returns the last valid one.
pub(crate) fn take_decision(h: &mut HeaderMap) -> Option<IdemDecision> {
    // A read-only lookup first: `entry` would reserve room for an insert (and may grow
    // the map) on every response, which almost never carries the header.
    let mut values = h.get_all(&DECISION).iter().peekable();
    values.peek()?;
    let decision = values.fold(None, |d, v| match v.as_bytes() {
        b"store" => Some(IdemDecision::Store),
        b"release" => Some(IdemDecision::Release),
        _ => d,
    });
    // `remove` takes every value of the header out.
    h.remove(&DECISION);
    decision
}

/// What the response says about who made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// The handler produced it (or may have: its side effects may have happened).
    Handler,
    /// The service refused the request before the handler ran (tonic could not decode
    /// the request message): nothing was done.
    BeforeHandler,
    /// The response body failed mid-way: no complete response exists to replay.
    Broken,
}

/// Whether a Trailers-Only response with `headers` is tonic's answer to a request it
/// could not decode, which it makes before calling the handler: the request has no
/// message (a unary or server-streaming method needs exactly one), or the message does
/// not decode as the method's type.
pub(crate) fn is_decode_refusal(headers: &HeaderMap) -> bool {
    if grpc_status(headers) != Some(Code::Internal) {
        return false;
    }
    let Some(status) = Status::from_header_map(headers) else {
        return false;
    };
    let m = status.message();
    m == "Missing request message." || m.starts_with("failed to decode Protobuf message: ")
}

/// Record the outcome (`true`) or release the record (`false`).
pub(crate) fn keep(
    origin: Origin,
    code: Code,
    decision: Option<IdemDecision>,
    cacheable: CodeSet,
) -> bool {
    match origin {
        Origin::BeforeHandler | Origin::Broken => false,
        Origin::Handler => match decision {
            Some(IdemDecision::Store) => true,
            Some(IdemDecision::Release) => false,
            None => cacheable.contains(code),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use idem_core::config::IdempotencyPolicy;

    #[test]
    fn the_handler_overrides_the_lists_but_not_a_refusal_or_a_broken_body() {
        let cacheable = IdempotencyPolicy::DEFAULT_CACHEABLE;
        assert!(keep(Origin::Handler, Code::Ok, None, cacheable));
        assert!(!keep(Origin::Handler, Code::Unavailable, None, cacheable));
        let store = Some(IdemDecision::Store);
        let release = Some(IdemDecision::Release);
        assert!(keep(Origin::Handler, Code::Unavailable, store, cacheable));
        assert!(!keep(Origin::Handler, Code::Ok, release, cacheable));
        for code in idem_core::code::ALL_CODES {
            for d in [None, store, release] {
                assert!(!keep(Origin::BeforeHandler, code, d, cacheable));
                assert!(!keep(Origin::Broken, code, d, cacheable));
            }
        }
    }

    #[test]
    fn decisions_are_taken_out_of_the_headers() {
        let mut h = HeaderMap::new();
        h.append(DECISION_HEADER, HeaderValue::from_static("store"));
        h.append(DECISION_HEADER, HeaderValue::from_static("bogus"));
        assert_eq!(take_decision(&mut h), Some(IdemDecision::Store));
        assert!(h.is_empty());
        // The last value that says something wins; every value is taken out.
        h.append(DECISION_HEADER, HeaderValue::from_static("store"));
        h.append(DECISION_HEADER, HeaderValue::from_static("release"));
        h.append(DECISION_HEADER, HeaderValue::from_static("bogus"));
        h.insert("x-other", HeaderValue::from_static("kept"));
        assert_eq!(take_decision(&mut h), Some(IdemDecision::Release));
        assert_eq!(h.len(), 1);
        // Values that say nothing are taken out too.
        h.append(DECISION_HEADER, HeaderValue::from_static("bogus"));
        assert_eq!(take_decision(&mut h), None);
        assert!(!h.contains_key(DECISION_HEADER));
        // No header: nothing changes.
        assert_eq!(take_decision(&mut h), None);
        assert_eq!(h.len(), 1);
    }

    #[test]
    fn tonic_decode_refusals_are_recognised() {
        let refusal = |s: Status| is_decode_refusal(s.into_http::<()>().headers());
        assert!(refusal(Status::internal("Missing request message.")));
        assert!(refusal(Status::internal(
            "failed to decode Protobuf message: invalid wire type: Varint (expected LengthDelimited)"
        )));
        assert!(!refusal(Status::internal("handler failed")));
        assert!(!refusal(Status::invalid_argument(
            "Missing request message."
        )));
        let mut h = HeaderMap::new();
        h.insert("grpc-status", HeaderValue::from_static("13"));
        assert!(!is_decode_refusal(&h));
    }
}
