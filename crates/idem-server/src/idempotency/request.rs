//! Reading a protected request: refuse an encoding the method does not accept before
//! reading anything, buffer the body, check that the service will be able to decode it,
//! and fingerprint its messages (see [`fingerprint`](super::fingerprint)).

use bytes::{Buf, Bytes, BytesMut};
use http_body_util::BodyExt;
use idem_core::config::IdempotencyPolicy;
use idem_store::Fingerprint;
use prost::encoding::{DecodeContext, decode_key, skip_field};
use tonic::Status;
use tonic::body::Body;

use super::fingerprint::{compression, fingerprint};
use super::layer::FingerprintHook;
use super::status;

/// A protected request's body, buffered, and its fingerprint.
pub(crate) struct ReadRequest {
    pub(crate) body: Bytes,
    pub(crate) fingerprint: Fingerprint,
}

/// Buffers `body` (up to `maxRequestBytes`) and fingerprints its messages, with `hook`
/// when the method has one.
///
/// A request in an encoding the method does not accept is refused before its body is
/// read. A request whose messages are not well-formed protobuf is refused here, before
/// any record exists: the service would refuse it before its handler ran, and a key must
/// not be spent on a call that did nothing (the corrected request, sent with the same
/// key, runs).
///
/// # Errors
/// The status to answer: ENCODING_UNSUPPORTED, the body's own error, REQUEST_TOO_LARGE,
/// a body that is not gRPC framing, or REQUEST_MALFORMED.
pub(crate) async fn read_request(
    mut body: Body,
    headers: &http::HeaderMap,
    policy: &IdempotencyPolicy,
    hook: Option<&FingerprintHook>,
) -> Result<ReadRequest, Status> {
    let compression = compression(headers, policy)?;
    let max = policy.max_request_bytes;
    // A body that arrives in one frame (a small unary request) is kept as it came, with
    // no copy; a second frame gathers them all into one buffer.
    let (mut len, mut first, mut buf) = (0, None::<Bytes>, BytesMut::new());
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            len += data.len();
            if len > max {
                return Err(status::request_too_large(max));
            }
            if len == data.len() && first.is_none() {
                first = Some(data);
                continue;
            }
            buf.extend_from_slice(&first.take().unwrap_or_default());
            buf.extend_from_slice(&data);
        }
    }
    let body = first.unwrap_or_else(|| buf.freeze());
    let protobuf = is_protobuf(headers);
    let fingerprint = fingerprint(&body, compression, policy, hook, protobuf).await?;
    Ok(ReadRequest { body, fingerprint })
}

/// Whether the request's messages are protobuf (`application/grpc`, or `+proto`), as
/// opposed to another codec's (`application/grpc+json`…), which the layer leaves alone.
fn is_protobuf(headers: &http::HeaderMap) -> bool {
    let Some(ct) = headers.get(http::header::CONTENT_TYPE) else {
        return false;
    };
    let ct = ct.as_bytes();
    let ct = ct.split(|b| *b == b';').next().unwrap_or_default();
    ct.eq_ignore_ascii_case(b"application/grpc")
        || ct.eq_ignore_ascii_case(b"application/grpc+proto")
}

/// Checks that `msg` is well-formed protobuf wire format (keys, wire types, varints,
/// lengths, balanced groups) without knowing its type. Every encoding of any message
/// passes; bytes no protobuf decoder would accept do not. Linear in the message's size.
pub(crate) fn check_protobuf(mut msg: &[u8]) -> Result<(), prost::DecodeError> {
    while msg.has_remaining() {
        let (tag, wire_type) = decode_key(&mut msg)?;
        skip_field(wire_type, tag, &mut msg, DecodeContext::default())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use prost::Message;

    #[derive(Clone, PartialEq, prost::Message)]
    struct Sample {
        #[prost(string, tag = "1")]
        name: String,
        #[prost(uint64, tag = "2")]
        n: u64,
        #[prost(fixed32, tag = "3")]
        f: u32,
        #[prost(double, tag = "4")]
        d: f64,
        #[prost(bytes = "vec", repeated, tag = "536870911")]
        blobs: Vec<Vec<u8>>,
    }

    #[test]
    fn wire_format_is_checked_without_the_schema() {
        let m = Sample {
            name: "x".into(),
            n: u64::MAX,
            f: 7,
            d: 1.5,
            blobs: vec![vec![1, 2, 3], vec![]],
        };
        let bytes = m.encode_to_vec();
        assert!(check_protobuf(&bytes).is_ok());
        assert!(check_protobuf(&[]).is_ok(), "an empty message is valid");
        for n in 1..bytes.len() {
            let cut = &bytes[..n];
            assert_eq!(
                check_protobuf(cut).is_ok(),
                Sample::decode(cut).is_ok(),
                "prefix {n}"
            );
        }
        for bad in [
            &b"\xff\xff\xff"[..],
            b"\x00",
            b"\x0f",
            b"\x0a\x05ab",
            b"\x0b",
            b"\x0c",
        ] {
            assert!(check_protobuf(bad).is_err(), "{bad:?}");
        }
        // Groups are balanced (proto2).
        assert!(check_protobuf(b"\x0b\x10\x01\x0c").is_ok());
    }

    /// A body of `frames`, as the transport hands it over.
    fn body_of(frames: &[&'static [u8]]) -> Body {
        let frames: Vec<Result<http_body::Frame<Bytes>, Status>> = frames
            .iter()
            .map(|f| Ok(http_body::Frame::data(Bytes::from_static(f))))
            .collect();
        Body::new(http_body_util::StreamBody::new(futures_util::stream::iter(
            frames,
        )))
    }

    #[tokio::test]
    async fn a_body_in_one_frame_or_many_reads_and_fingerprints_the_same() {
        let mut headers = http::HeaderMap::new();
        headers.insert("content-type", "application/grpc".parse().unwrap());
        let policy = IdempotencyPolicy::default();
        let whole: &'static [u8] = b"\x00\x00\x00\x00\x06\x0a\x04abcd";
        let one = read_request(body_of(&[whole]), &headers, &policy, None)
            .await
            .unwrap();
        let split = [&whole[..2], &whole[2..7], &[][..], &whole[7..]];
        let many = read_request(body_of(&split), &headers, &policy, None)
            .await
            .unwrap();
        assert_eq!(one.body, whole);
        assert_eq!(many.body, whole);
        assert_eq!(one.fingerprint, many.fingerprint);

        let small = IdempotencyPolicy {
            max_request_bytes: whole.len() - 1,
            ..policy
        };
        for frames in [&[whole][..], &split[..]] {
            let err = read_request(body_of(frames), &headers, &small, None)
                .await
                .err()
                .expect("over the limit");
            assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
        }
    }

    proptest! {
        #[test]
        fn never_panics_and_accepts_whatever_prost_accepts(
            bytes in proptest::collection::vec(any::<u8>(), 0..128)
        ) {
            let ok = check_protobuf(&bytes).is_ok();
            // A message made only of unknown fields decodes iff the wire format is valid.
            #[derive(Clone, PartialEq, prost::Message)]
            struct Empty {}
            prop_assert_eq!(ok, Empty::decode(&bytes[..]).is_ok());
        }
    }
}
