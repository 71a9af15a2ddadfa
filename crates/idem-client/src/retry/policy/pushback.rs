//! Server pushback: `grpc-retry-pushback-ms` (gRFC A6) and `google.rpc.RetryInfo` in
//! `grpc-status-details-bin`. Both come from untrusted headers: nothing here panics.

use std::time::Duration;

use http::HeaderMap;
use idem_core::headers::{GRPC_STATUS_DETAILS, RETRY_PUSHBACK_MS};
use prost::Message;

/// What `grpc-retry-pushback-ms` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pushback {
    /// No header: use the policy's backoff.
    Absent,
    /// One value ≥ 0: wait exactly this long, and reset the backoff exponent.
    Wait(Duration),
    /// Negative, unparseable or repeated: do not retry.
    Stop,
}

/// Reads `grpc-retry-pushback-ms` as A6 says: one value, a non-negative integer of
/// milliseconds; anything else means "do not retry".
pub(crate) fn pushback(headers: &HeaderMap) -> Pushback {
    let mut values = headers.get_all(RETRY_PUSHBACK_MS).iter();
    let Some(first) = values.next() else {
        return Pushback::Absent;
    };
    if values.next().is_some() {
        return Pushback::Stop;
    }
    let Ok(text) = first.to_str() else {
        return Pushback::Stop;
    };
    match text.parse::<i64>() {
        Ok(ms) if ms >= 0 => Pushback::Wait(Duration::from_millis(ms.unsigned_abs())),
        _ => Pushback::Stop,
    }
}

const RETRY_INFO_TYPE: &str = "google.rpc.RetryInfo";

/// `RetryInfo.retry_delay` from `grpc-status-details-bin`, if present and valid.
pub(crate) fn retry_info_delay(headers: &HeaderMap) -> Option<Duration> {
    let raw = headers.get(GRPC_STATUS_DETAILS)?;
    let bytes = base64_decode(raw.as_bytes())?;
    let status = tonic_types::pb::Status::decode(bytes.as_slice()).ok()?;
    status.details.iter().find_map(|any| {
        let name = any.type_url.rsplit('/').next()?;
        if name != RETRY_INFO_TYPE {
            return None;
        }
        let info = tonic_types::pb::RetryInfo::decode(any.value.as_slice()).ok()?;
        let d = info.retry_delay?;
        let secs = u64::try_from(d.seconds).ok()?;
        let nanos = u32::try_from(d.nanos).ok().filter(|n| *n < 1_000_000_000)?;
        Some(Duration::new(secs, nanos))
    })
}

/// Decodes base64 with or without padding, standard or URL-safe alphabet (gRPC binary
/// headers are unpadded standard base64; padded values are accepted too).
pub(crate) fn base64_decode(input: &[u8]) -> Option<Vec<u8>> {
    fn value(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return None,
        } as u32)
    }
    let trimmed = match input.iter().position(|c| *c == b'=') {
        Some(p) => {
            if input[p..].iter().any(|c| *c != b'=') || !input.len().is_multiple_of(4) {
                return None;
            }
            &input[..p]
        }
        None => input,
    };
    if trimmed.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(trimmed.len() / 4 * 3 + 2);
    for chunk in trimmed.chunks(4) {
        let mut acc = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            acc |= value(*c)? << (18 - 6 * i);
        }
        let bytes = acc.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(RETRY_PUSHBACK_MS, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn pushback_rules() {
        assert_eq!(pushback(&headers(&[])), Pushback::Absent);
        assert_eq!(
            pushback(&headers(&["300"])),
            Pushback::Wait(Duration::from_millis(300))
        );
        assert_eq!(pushback(&headers(&["0"])), Pushback::Wait(Duration::ZERO));
        for bad in [
            &["-1"][..],
            &["xxx"],
            &["100", "10"],
            &["100, 10"],
            &[""],
            &[" 5"],
            &["1.5"],
            &["99999999999999999999"],
        ] {
            assert_eq!(pushback(&headers(bad)), Pushback::Stop, "{bad:?}");
        }
    }

    #[test]
    fn base64_forms() {
        assert_eq!(base64_decode(b"aGVsbG8").unwrap(), b"hello");
        assert_eq!(base64_decode(b"aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode(b"").unwrap(), b"");
        assert_eq!(base64_decode(b"+/8").unwrap(), [0xfb, 0xff]);
        assert!(base64_decode(b"a").is_none());
        assert!(base64_decode(b"aGV*").is_none());
        assert!(base64_decode(b"aG=V").is_none());
    }

    #[test]
    fn retry_info_from_tonic_types() {
        use tonic_types::{ErrorDetails, StatusExt};
        let status = tonic::Status::with_error_details(
            tonic::Code::Unavailable,
            "busy",
            ErrorDetails::with_retry_info(Some(Duration::from_millis(1500))),
        );
        let resp = status.into_http::<tonic::body::Body>();
        assert_eq!(
            retry_info_delay(resp.headers()),
            Some(Duration::from_millis(1500))
        );
        let mut garbage = HeaderMap::new();
        garbage.insert(
            GRPC_STATUS_DETAILS,
            HeaderValue::from_static("!!!notbase64"),
        );
        assert_eq!(retry_info_delay(&garbage), None);
        garbage.insert(GRPC_STATUS_DETAILS, HeaderValue::from_static("AAAA"));
        assert_eq!(retry_info_delay(&garbage), None);
    }

    proptest::proptest! {
        #[test]
        fn untrusted_headers_never_panic(
            pushbacks in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 0..24), 0..3),
            details in proptest::collection::vec(proptest::num::u8::ANY, 0..200),
            as_base64 in proptest::bool::ANY,
        ) {
            let mut h = HeaderMap::new();
            for p in &pushbacks {
                if let Ok(v) = HeaderValue::from_bytes(p) {
                    h.append(RETRY_PUSHBACK_MS, v);
                }
            }
            let raw = if as_base64 { encode(&details) } else { details.clone() };
            if let Ok(v) = HeaderValue::from_bytes(&raw) {
                h.insert(GRPC_STATUS_DETAILS, v);
            }
            let _ = pushback(&h);
            let _ = retry_info_delay(&h);
            if as_base64 {
                proptest::prop_assert_eq!(base64_decode(&raw), Some(details));
            }
        }
    }

    /// Unpadded standard base64, for the round-trip property.
    fn encode(bytes: &[u8]) -> Vec<u8> {
        const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = Vec::new();
        for chunk in bytes.chunks(3) {
            let mut n = 0u32;
            for (i, b) in chunk.iter().enumerate() {
                n |= u32::from(*b) << (16 - 8 * i);
            }
            for i in 0..=chunk.len() {
                out.push(A[((n >> (18 - 6 * i)) & 63) as usize]);
            }
        }
        out
    }
}
