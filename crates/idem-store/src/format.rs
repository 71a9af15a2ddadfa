//! The stored record format: what a store keeps for one record, and the rules that let
//! records written by one version of idem be read by the next.
//!
//! # The response: `IDR1`
//! A completed record keeps the response the handler gave, encoded by
//! [`StoredResponse::encode`](crate::response::StoredResponse::encode) and replayed byte
//! for byte:
//!
//! ```text
//! "IDR1" status:u16 headers frames trailers
//! headers  = count:u32 (name_len:u16 name value_len:u32 value)*
//! frames   = count:u32 (len:u32 bytes)*          // raw HTTP/2 DATA payloads
//! trailers = 0:u8 | 1:u8 headers                 // 0: Trailers-Only (status in headers)
//! ```
//! Big-endian integers; header names lower case, values as sent (binary `-bin` values
//! base64, as on the wire). The frames carry the gRPC message framing: concatenated,
//! they are messages of `compressed:u8 len:u32 bytes` ([`grpc_messages`]), compressed
//! with the response's `grpc-encoding` when the flag is 1. The gRPC status is the
//! `grpc-status` / `grpc-message` of the trailers (or of the headers, Trailers-Only).
//!
//! # Around it, per store
//! - **Memory**: in process only; nothing outlives the process.
//! - **Redis**: one hash per record at `<prefix>{<scope hex>}`, fields `s f fp c l k o t0
//!   t1` (`idem-redis`, `scripts.rs`, "Record layout"); `o` holds the `IDR1` bytes.
//! - **PostgreSQL**: one row of `<prefix>records` (`idem-postgres`, `schema.sql`,
//!   versioned by `<prefix>schema_version`); `outcome` holds the `IDR1` bytes.
//!
//! A record that completed without keeping its response (over the size limit) has
//! outcome kind `n` and no bytes.
//!
//! # Compatibility rules
//! - The 4-byte magic is the version. A change to the layout of the bytes after it is a
//!   new version (`IDR2`, …); the version that writes `IDRn+1` first ships a reader for
//!   it, so during a rolling upgrade every instance reads what any other writes. Old
//!   versions stay readable for at least the longest record TTL in use.
//! - A reader that meets a version it does not know says so ([`ReadError::UnknownVersion`])
//!   and never guesses; the server layer treats such a record as corrupt (it answers the
//!   call with an error and never runs the handler again on its account).
//! - Store-level fields may be added (Redis `t0`/`t1` were): readers treat a missing
//!   field as "not known", never as an error. Fields are never reused for another
//!   meaning.
//! - `tests/testdata/record-idr1.bin` is a record written by the `IDR1` encoder; a
//!   test reads it on every build, so a change that breaks reading it fails CI.

use bytes::{Buf, Bytes};

use crate::response::{CorruptResponse, StoredResponse};

/// The format version this crate writes.
pub const CURRENT_VERSION: &[u8; 4] = b"IDR1";

/// Why stored bytes could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// The bytes are a record format this version does not read.
    #[error(
        "stored response in format {0:?}, which this idem does not read (it reads IDR1): \
         written by a newer idem? use that version's tools"
    )]
    UnknownVersion(String),
    /// The bytes are `IDR1` but do not decode.
    #[error(transparent)]
    Corrupt(#[from] CorruptResponse),
}

/// Decodes stored response bytes, telling an unknown version apart from corruption.
///
/// # Errors
/// [`ReadError`].
pub fn read(bytes: Bytes) -> Result<StoredResponse, ReadError> {
    if bytes.len() >= 4 && &bytes[..4] != CURRENT_VERSION {
        let magic = &bytes[..4];
        if magic.starts_with(b"IDR") {
            return Err(ReadError::UnknownVersion(
                String::from_utf8_lossy(magic).into_owned(),
            ));
        }
    }
    Ok(StoredResponse::decode(bytes)?)
}

/// One gRPC message of a stored response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcMessage {
    /// Whether it is compressed (with the response's `grpc-encoding`).
    pub compressed: bool,
    /// The message bytes (protobuf, unless compressed).
    pub bytes: Bytes,
}

/// The gRPC messages in a response's DATA frames (a message may span frames).
///
/// # Errors
/// [`CorruptResponse`] when the frames end inside a message or a flag is not 0 or 1.
pub fn grpc_messages(frames: &[Bytes]) -> Result<Vec<GrpcMessage>, CorruptResponse> {
    let mut all = bytes::BytesMut::new();
    for f in frames {
        all.extend_from_slice(f);
    }
    let mut b = all.freeze();
    let mut out = Vec::new();
    while b.has_remaining() {
        if b.remaining() < 5 {
            return Err(CorruptResponse("frames end inside a gRPC message prefix"));
        }
        let compressed = match b.get_u8() {
            0 => false,
            1 => true,
            _ => return Err(CorruptResponse("gRPC message flag is not 0 or 1")),
        };
        let len = b.get_u32() as usize;
        if len > b.remaining() {
            return Err(CorruptResponse("frames end inside a gRPC message"));
        }
        out.push(GrpcMessage {
            compressed,
            bytes: b.split_to(len),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderMap, HeaderValue, StatusCode};

    /// The fixture: a response as the layer records it, with metadata, two messages
    /// (the second split across frames) and a status message.
    fn fixture_response() -> StoredResponse {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/grpc"));
        headers.insert("x-run", HeaderValue::from_static("7"));
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        trailers.insert("grpc-message", HeaderValue::from_static("fine"));
        StoredResponse {
            status: StatusCode::OK,
            headers,
            frames: vec![
                Bytes::from_static(b"\0\0\0\0\x03\x0a\x01x\0\0\0"),
                Bytes::from_static(b"\0\x02\x10\x05"),
            ],
            trailers: Some(trailers),
        }
    }

    const FIXTURE: &[u8] = include_bytes!("../tests/testdata/record-idr1.bin");

    #[test]
    fn a_record_written_in_idr1_reads_back() {
        let r = read(Bytes::from_static(FIXTURE)).expect("the committed IDR1 record reads");
        assert_eq!(r, fixture_response());
        // And today's encoder still writes exactly these bytes.
        assert_eq!(&fixture_response().encode()[..], FIXTURE);
        let m = grpc_messages(&r.frames).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(&m[0].bytes[..], b"\x0a\x01x");
        assert_eq!(&m[1].bytes[..], b"\x10\x05");
        assert!(!m[0].compressed);
    }

    #[test]
    fn unknown_versions_and_corruption_are_told_apart() {
        let mut next = FIXTURE.to_vec();
        next[3] = b'2';
        assert_eq!(
            read(Bytes::from(next)),
            Err(ReadError::UnknownVersion("IDR2".into()))
        );
        assert!(matches!(
            read(Bytes::from_static(b"nope, not a record")),
            Err(ReadError::Corrupt(_))
        ));
        assert!(grpc_messages(&[Bytes::from_static(b"\0\0\0\0\x09ab")]).is_err());
        assert!(grpc_messages(&[Bytes::from_static(b"\x07\0\0\0\0")]).is_err());
        assert!(grpc_messages(&[]).unwrap().is_empty());
    }
}
