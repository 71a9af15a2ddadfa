//! Reading a protected request: refuse an encoding the method does not accept before
//! reading anything, buffer the body, check that the service will be able to decode it,
//! and fingerprint its messages (see [`fingerprint`](super::fingerprint)).

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use idem_core::config::IdempotencyPolicy;
use idem_store::Fingerprint;
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
    // no copy; a second frame gathers them all into one buffer. An empty frame carries
    // nothing: a tonic client ends its request stream with one, after the
    // frame with the message, and it must not cost the single-frame body its copy.
    let (mut len, mut first, mut buf) = (0, None::<Bytes>, BytesMut::new());
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            if data.is_empty() {
                continue;
            }
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

#[cfg(test)]
mod tests {
    use super::*;

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
        // The body a tonic client sends: its message, then an empty frame that ends the
        // stream. The message's bytes are kept as they came (the same memory), not copied.
        let ended = read_request(body_of(&[whole, &[]]), &headers, &policy, None)
            .await
            .unwrap();
        assert_eq!(ended.body, whole);
        assert_eq!(
            ended.body.as_ptr(),
            whole.as_ptr(),
            "the one frame was copied"
        );
        assert_eq!(ended.fingerprint, one.fingerprint);
        // Empty frames anywhere, many of them, change nothing: the body and fingerprint
        // are the message's, and they count nothing against `maxRequestBytes`.
        let empties: Vec<&'static [u8]> = std::iter::repeat_n(&[][..], 1000)
            .chain([whole])
            .chain(std::iter::repeat_n(&[][..], 1000))
            .collect();
        let padded = read_request(
            body_of(&empties),
            &headers,
            &IdempotencyPolicy {
                max_request_bytes: whole.len(),
                ..policy
            },
            None,
        )
        .await
        .unwrap();
        assert_eq!(padded.body.as_ptr(), whole.as_ptr());
        assert_eq!(padded.fingerprint, one.fingerprint);
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
}
