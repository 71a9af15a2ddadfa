use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Buf;
use http::HeaderValue;
use idem_core::config::CompressionSet;
use idem_test_support::deflate::empty_fixed_blocks;
use proptest::prelude::*;
use prost::Message;

use super::*;
use crate::idempotency::digest::fingerprint_messages;
use crate::idempotency::inflate;

const MIB4: usize = 4 * 1024 * 1024;

/// The de-framer as it was before work was bounded by the body: a decoder per message,
/// a `Bytes` per message. The fingerprint of what it returns must not change.
fn reference(
    body: &Bytes,
    compression: Option<Compression>,
    max: usize,
) -> Result<Vec<Bytes>, FrameError> {
    let mut b = body.clone();
    let mut out = Vec::new();
    let mut total = 0usize;
    while b.has_remaining() {
        if b.remaining() < 5 {
            return Err(FrameError::Truncated);
        }
        let flag = b.get_u8();
        let len = b.get_u32() as usize;
        if len > b.remaining() {
            return Err(FrameError::Truncated);
        }
        let raw = b.split_to(len);
        let msg = match (flag, compression) {
            (0, _) => raw,
            (1, None) => return Err(FrameError::CompressedWithoutEncoding),
            (1, Some(c)) => {
                let limit = (max.saturating_sub(total) as u64).saturating_add(1);
                let mut out = Vec::new();
                let read = match c {
                    Compression::Gzip => flate2::read::GzDecoder::new(&raw[..])
                        .take(limit)
                        .read_to_end(&mut out),
                    Compression::Deflate => flate2::read::ZlibDecoder::new(&raw[..])
                        .take(limit)
                        .read_to_end(&mut out),
                };
                read.map_err(|e| FrameError::Corrupt(e.to_string()))?;
                if out.len() as u64 >= limit {
                    return Err(FrameError::TooLarge);
                }
                Bytes::from(out)
            }
            _ => return Err(FrameError::Corrupt(format!("compressed flag {flag}"))),
        };
        total += msg.len();
        if total > max {
            return Err(FrameError::TooLarge);
        }
        out.push(msg);
    }
    Ok(out)
}

fn frame(flag: u8, msg: &[u8]) -> Vec<u8> {
    let mut v = vec![flag];
    v.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    v.extend_from_slice(msg);
    v
}

fn gzip(msg: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(msg).unwrap();
    e.finish().unwrap()
}

fn zlib(msg: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(msg).unwrap();
    e.finish().unwrap()
}

fn compress(c: Compression, msg: &[u8]) -> Vec<u8> {
    match c {
        Compression::Gzip => gzip(msg),
        Compression::Deflate => zlib(msg),
    }
}

/// The smallest gzip member: header, an empty fixed-Huffman block, CRC and size 0.
const EMPTY_GZIP: [u8; 20] = [
    0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff, 0x03, 0x00, 0, 0, 0, 0, 0, 0, 0, 0,
];
/// The smallest zlib stream.
const EMPTY_ZLIB: [u8; 8] = [0x78, 0x9c, 0x03, 0x00, 0, 0, 0, 1];

/// `frame` repeated until the body would pass `size`.
fn repeated(frame: &[u8], size: usize) -> Bytes {
    Bytes::from(frame.repeat(size / frame.len()))
}

fn limits(max_bytes: usize, max_frames: usize) -> Limits {
    Limits {
        protobuf: false,
        max_bytes,
        max_frames,
    }
}

fn fp(body: &Bytes, c: Option<Compression>, l: Limits) -> (Result<Fingerprint, FrameError>, Work) {
    let mut work = Work::default();
    (read(body, c, l, None, &mut work), work)
}

fn reference_fp(
    body: &Bytes,
    c: Option<Compression>,
    max: usize,
) -> Result<Fingerprint, FrameError> {
    reference(body, c, max).map(|m| fingerprint_messages(&m))
}

fn policy(accept: CompressionSet) -> IdempotencyPolicy {
    IdempotencyPolicy {
        accept_compressed: accept,
        ..IdempotencyPolicy::default()
    }
}

#[test]
fn compressed_and_plain_frames_fingerprint_alike_and_as_before() {
    let msg = b"hello hello hello hello";
    let plain = Bytes::from(frame(0, msg));
    let gz = Bytes::from(frame(1, &gzip(msg)));
    let zl = Bytes::from(frame(1, &zlib(msg)));
    let l = limits(1024, 16);
    let a = fp(&plain, None, l).0.unwrap();
    assert_eq!(a, fp(&gz, Some(Compression::Gzip), l).0.unwrap());
    assert_eq!(a, fp(&zl, Some(Compression::Deflate), l).0.unwrap());
    assert_eq!(a, reference_fp(&gz, Some(Compression::Gzip), 1024).unwrap());
    assert_eq!(
        fp(&gz, None, l).0,
        Err(FrameError::CompressedWithoutEncoding)
    );
    assert_eq!(
        fp(&gz, Some(Compression::Gzip), limits(5, 16)).0,
        Err(FrameError::TooLarge)
    );
    // Exactly the limit is accepted, one byte under it is not.
    let n = msg.len();
    assert!(fp(&gz, Some(Compression::Gzip), limits(n, 1)).0.is_ok());
    assert!(fp(&zl, Some(Compression::Deflate), limits(n, 1)).0.is_ok());
    assert_eq!(
        fp(&zl, Some(Compression::Deflate), limits(n - 1, 1)).0,
        Err(FrameError::TooLarge)
    );
}

#[test]
fn message_boundaries_matter_and_truncation_is_refused() {
    let one = Bytes::from(frame(0, b"abc"));
    let mut two = frame(0, b"ab");
    two.extend(frame(0, b"c"));
    let two = Bytes::from(two);
    let l = limits(100, 100);
    assert_ne!(fp(&one, None, l).0.unwrap(), fp(&two, None, l).0.unwrap());
    for n in 1..one.len() {
        assert_eq!(fp(&one.slice(..n), None, l).0, Err(FrameError::Truncated));
    }
    assert_eq!(fp(&Bytes::new(), None, l).0, Ok(fingerprint_messages(&[])));
    assert!(matches!(
        fp(&Bytes::from(frame(2, b"x")), None, l).0,
        Err(FrameError::Corrupt(_))
    ));
}

#[test]
fn hooks_see_the_messages_decompressed() {
    let mut body = frame(1, &gzip(b"first"));
    body.extend(frame(0, b"second"));
    body.extend(frame(1, &gzip(b"")));
    let body = Bytes::from(body);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = seen.clone();
    let hook: FingerprintHook = Arc::new(move |m: &[Bytes]| {
        *s.lock().unwrap() = m.to_vec();
        b"canonical".to_vec()
    });
    let mut work = Work::default();
    let got = read(
        &body,
        Some(Compression::Gzip),
        limits(100, 10),
        Some(&hook),
        &mut work,
    );
    assert_eq!(got, Ok(fingerprint_custom(b"canonical")));
    assert_eq!(
        *seen.lock().unwrap(),
        reference(&body, Some(Compression::Gzip), 100).unwrap()
    );
}

#[test]
fn gzip_header_fields_are_read_and_checked() {
    let msg = b"with a name, a comment, extra bytes and a header crc";
    let mut e = flate2::GzBuilder::new()
        .filename("f.txt")
        .comment("a comment")
        .extra(vec![1, 2, 3])
        .write(Vec::new(), flate2::Compression::fast());
    e.write_all(msg).unwrap();
    let mut member = e.finish().unwrap();
    let body = Bytes::from(frame(1, &member));
    let l = limits(1024, 4);
    let want = reference_fp(&body, Some(Compression::Gzip), 1024).unwrap();
    assert_eq!(fp(&body, Some(Compression::Gzip), l).0, Ok(want));
    // A member with trailing bytes decodes as tonic's decoder reads it: the bytes are ignored.
    member.extend_from_slice(b"trailing");
    let body = Bytes::from(frame(1, &member));
    assert_eq!(fp(&body, Some(Compression::Gzip), l).0, Ok(want));
    // A wrong trailer CRC is refused.
    let mut bad = gzip(msg);
    let at = bad.len() - 8;
    bad[at] ^= 1;
    assert!(matches!(
        fp(&Bytes::from(frame(1, &bad)), Some(Compression::Gzip), l).0,
        Err(FrameError::Corrupt(_))
    ));
}

#[test]
fn an_encoding_the_method_does_not_accept_is_refused_from_the_headers() {
    let headers = |v: &'static str| {
        let mut h = HeaderMap::new();
        h.insert("grpc-encoding", HeaderValue::from_static(v));
        h
    };
    let identity = policy(CompressionSet::EMPTY);
    assert_eq!(compression(&HeaderMap::new(), &identity).unwrap(), None);
    assert_eq!(compression(&headers("identity"), &identity).unwrap(), None);

    let refused = compression(&headers("gzip"), &identity).unwrap_err();
    assert_eq!(refused.code(), Code::Unimplemented);
    assert!(
        refused.message().contains("idempotency.acceptCompressed"),
        "{}",
        refused.message()
    );
    assert_eq!(
        refused.metadata().get("grpc-accept-encoding").unwrap(),
        "identity"
    );

    let gzip_only = policy(CompressionSet::EMPTY.with(Compression::Gzip));
    assert_eq!(
        compression(&headers("gzip"), &gzip_only).unwrap(),
        Some(Compression::Gzip)
    );
    for other in ["deflate", "zstd", "GZIP"] {
        let refused = compression(&headers(other), &gzip_only).unwrap_err();
        assert_eq!(refused.code(), Code::Unimplemented, "{other}");
        assert_eq!(
            refused.metadata().get("grpc-accept-encoding").unwrap(),
            "identity,gzip"
        );
    }
}

/// 4 MiB of the smallest frames against 4 MiB in one message: the work counters, not the
/// clock, show the cost is linear in the body.
#[test]
fn tiny_frames_cost_work_linear_in_the_body() {
    let unlimited = limits(MIB4, usize::MAX);
    let normal = Bytes::from(frame(0, &vec![7u8; MIB4 - 5]));
    let (r, base) = fp(&normal, None, unlimited);
    r.unwrap();
    assert_eq!(base.frames_scanned, 1);

    let cases = [
        (
            repeated(&frame(1, &EMPTY_GZIP), MIB4),
            Some(Compression::Gzip),
        ),
        (
            repeated(&frame(1, &EMPTY_ZLIB), MIB4),
            Some(Compression::Deflate),
        ),
        (repeated(&frame(0, b""), MIB4), None),
    ];
    for (body, c) in cases {
        let (r, work) = fp(&body, c, unlimited);
        let n = work.frames_scanned;
        assert!(n > 160_000, "{c:?}: {n} frames");
        assert_eq!(r, reference_fp(&body, c, MIB4), "{c:?}");
        // One engine call per compressed message, no more.
        assert_eq!(work.engine_calls, work.inflated, "{c:?}");
        // SHA-256 sees an 8-byte prefix per message: at most 1.6× a body of 5-byte frames.
        assert!(
            work.hashed <= 2 * body.len() as u64,
            "{c:?}: {} bytes hashed",
            work.hashed
        );
    }
}

#[test]
fn too_many_frames_are_refused_before_any_is_decoded() {
    let body = repeated(&frame(1, &EMPTY_GZIP), 25 * 1000);
    let (r, work) = fp(&body, Some(Compression::Gzip), limits(MIB4, 100));
    assert_eq!(r, Err(FrameError::TooManyFrames));
    assert_eq!(
        work.frames_scanned, 101,
        "the count stops one past the limit"
    );
    assert_eq!(work.inflated, 0);
    assert_eq!(work.hashed, 0);
    let status = FrameError::TooManyFrames.into_status(limits(MIB4, 100));
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(status.message().contains("idempotency.maxRequestFrames"));
}

#[test]
fn a_decompression_bomb_stops_at_the_limit() {
    let bomb = gzip(&vec![0u8; 64 * 1024 * 1024]);
    assert!(bomb.len() < 100 * 1024, "{}", bomb.len());
    let body = Bytes::from(frame(1, &bomb));
    let (r, work) = fp(&body, Some(Compression::Gzip), limits(MIB4, 16));
    assert_eq!(r, Err(FrameError::TooLarge));
    // The buffer doubles from 64 KiB to the limit: a handful of engine calls.
    assert!(work.engine_calls <= 8, "{work:?}");
}

/// 4 MiB of empty DEFLATE blocks is valid (the reference decodes it), but the decoder
/// stops once the compressed bytes pass the slack, having read a small fraction.
#[test]
fn empty_deflate_blocks_are_refused_after_a_bounded_read() {
    let stream = empty_fixed_blocks((MIB4 - 64) * 8 / 10);
    let body = Bytes::from(frame(1, &stream));
    let c = Some(Compression::Deflate);
    assert!(reference_fp(&body, c, MIB4).is_ok(), "a valid stream");
    let (r, work) = fp(&body, c, limits(MIB4, 16));
    assert_eq!(r, Err(FrameError::Padded));
    let most = inflate::SLACK_PER_REQUEST + inflate::SLACK_PER_MESSAGE + 16 * 1024;
    assert!(
        work.engine_input <= most,
        "read {} of {} compressed bytes",
        work.engine_input,
        stream.len()
    );
    let status = FrameError::Padded.into_status(limits(MIB4, 16));
    assert_eq!(status.code(), Code::ResourceExhausted);

    // Spread over many messages, the slack is per request, not per message.
    let small = frame(1, &empty_fixed_blocks(100_000));
    let body = Bytes::from(small.repeat(40));
    let (r, work) = fp(&body, c, limits(MIB4, 100));
    assert_eq!(r, Err(FrameError::Padded));
    assert!(work.engine_input <= most + 40 * 32, "{work:?}");
}

/// What compressors write passes the budget: incompressible bytes stored or coded,
/// compressible ones, a stream flushed every KiB, and many one-byte messages.
#[test]
fn what_compressors_write_is_within_the_slack() {
    let mut random = vec![0u8; 2 * 1024 * 1024];
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for b in &mut random {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let text = b"the same order, the same key, the same answer. ".repeat(40_000);
    let flushed = {
        let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        for chunk in random[..512 * 1024].chunks(1024) {
            e.write_all(chunk).unwrap();
            e.flush().unwrap();
        }
        e.finish().unwrap()
    };
    let stored = |c: Compression, msg: &[u8]| -> Vec<u8> {
        let level = flate2::Compression::none();
        match c {
            Compression::Gzip => {
                let mut e = flate2::write::GzEncoder::new(Vec::new(), level);
                e.write_all(msg).unwrap();
                e.finish().unwrap()
            }
            Compression::Deflate => {
                let mut e = flate2::write::ZlibEncoder::new(Vec::new(), level);
                e.write_all(msg).unwrap();
                e.finish().unwrap()
            }
        }
    };
    for c in [Compression::Gzip, Compression::Deflate] {
        let tiny: Vec<u8> = (0..60_000u32)
            .flat_map(|i| frame(1, &compress(c, &[i as u8])))
            .collect();
        let mut bodies = vec![
            frame(1, &compress(c, &random)),
            frame(1, &stored(c, &random)),
            frame(1, &compress(c, &text)),
            tiny,
        ];
        if c == Compression::Deflate {
            bodies.push(frame(1, &flushed));
        }
        for (i, body) in bodies.into_iter().enumerate() {
            let body = Bytes::from(body);
            let (r, _) = fp(&body, Some(c), limits(MIB4, 65_536));
            assert_eq!(r, reference_fp(&body, Some(c), MIB4), "{c:?} body {i}");
            assert!(r.is_ok(), "{c:?} body {i}: {r:?}");
        }
    }
}

#[tokio::test]
async fn large_requests_are_read_off_the_async_workers_with_the_same_result() {
    let p = policy(CompressionSet::EMPTY.with(Compression::Deflate));
    let small = Bytes::from(frame(1, &zlib(b"x")));
    let large = repeated(&frame(1, &EMPTY_ZLIB), 2 * INLINE_WORK);
    let calls = Arc::new(AtomicUsize::new(0));
    for body in [small, large] {
        let want = reference_fp(&body, Some(Compression::Deflate), p.max_request_bytes).unwrap();
        let got = fingerprint(&body, Some(Compression::Deflate), &p, None, false)
            .await
            .unwrap();
        assert_eq!(got, want);
        let c = calls.clone();
        let hook: FingerprintHook = Arc::new(move |m: &[Bytes]| {
            c.fetch_add(1, Ordering::Relaxed);
            m.len().to_be_bytes().to_vec()
        });
        let n = reference(&body, Some(Compression::Deflate), p.max_request_bytes)
            .unwrap()
            .len();
        let got = fingerprint(&body, Some(Compression::Deflate), &p, Some(&hook), false)
            .await
            .unwrap();
        assert_eq!(got, fingerprint_custom(&n.to_be_bytes()));
    }
    assert_eq!(calls.load(Ordering::Relaxed), 2);
    let over = Bytes::from(frame(0, &[0; 32]));
    let tight = IdempotencyPolicy {
        max_request_bytes: 16,
        ..p
    };
    let e = fingerprint(&over, None, &tight, None, false)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(e.message().contains("idempotency.maxRequestBytes"));
}

// ---------------------------------------------------------------- properties

/// One frame of an arbitrary body: a message sent plain or compressed, possibly damaged,
/// or raw bytes.
#[derive(Debug, Clone)]
enum Part {
    Plain(Vec<u8>),
    Compressed(Compression, Vec<u8>),
    Damaged(Compression, Vec<u8>, usize, u8),
    Truncated(Compression, Vec<u8>, usize),
    Raw(u8, Vec<u8>),
    Tail(Vec<u8>),
}

fn compression_strategy() -> impl Strategy<Value = Compression> {
    prop_oneof![Just(Compression::Gzip), Just(Compression::Deflate)]
}

fn message() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64),
        (0u8..4, 0usize..4096).prop_map(|(b, n)| vec![b; n]),
    ]
}

fn part() -> impl Strategy<Value = Part> {
    prop_oneof![
        message().prop_map(Part::Plain),
        (compression_strategy(), message()).prop_map(|(c, m)| Part::Compressed(c, m)),
        (compression_strategy(), message(), any::<usize>(), 1u8..=255)
            .prop_map(|(c, m, at, x)| Part::Damaged(c, m, at, x)),
        (compression_strategy(), message(), any::<usize>())
            .prop_map(|(c, m, at)| Part::Truncated(c, m, at)),
        (0u8..3, prop::collection::vec(any::<u8>(), 0..40)).prop_map(|(f, b)| Part::Raw(f, b)),
        prop::collection::vec(any::<u8>(), 1..5).prop_map(Part::Tail),
    ]
}

fn build(parts: &[Part]) -> (Bytes, bool) {
    let mut body = Vec::new();
    let mut valid = true;
    for p in parts {
        match p {
            Part::Plain(m) => body.extend(frame(0, m)),
            Part::Compressed(c, m) => body.extend(frame(1, &compress(*c, m))),
            Part::Damaged(c, m, at, x) => {
                let mut z = compress(*c, m);
                let i = at % z.len();
                z[i] ^= x;
                body.extend(frame(1, &z));
                valid = false;
            }
            Part::Truncated(c, m, at) => {
                let z = compress(*c, m);
                body.extend(frame(1, &z[..at % z.len()]));
                valid = false;
            }
            Part::Raw(f, b) => {
                body.extend(frame(*f, b));
                valid = false;
            }
            Part::Tail(b) => {
                body.extend(b);
                valid = false;
            }
        }
    }
    (Bytes::from(body), valid)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Never panics; work within bounds; the same fingerprint as the old de-framer
    /// wherever the new one accepts, and refused wherever the old one refused.
    #[test]
    fn reads_any_body_in_bounded_work_as_the_reference_does(
        parts in prop::collection::vec(part(), 0..12),
        compression in prop_oneof![
            Just(None),
            Just(Some(Compression::Gzip)),
            Just(Some(Compression::Deflate)),
        ],
        max_bytes in prop_oneof![Just(MIB4), 1usize..20_000],
        max_frames in prop_oneof![Just(usize::MAX), 1usize..16],
    ) {
        let (body, valid) = build(&parts);
        let l = limits(max_bytes, max_frames);
        let (got, work) = fp(&body, compression, l);
        let want = reference_fp(&body, compression, max_bytes);

        // Bounded work: headers read once (up to the limit), one engine call per message
        // plus the buffer's doublings, SHA-256 over at most the limit plus prefixes.
        let frames = body.len() as u64 / 5 + 1;
        prop_assert!(work.frames_scanned <= frames.min((max_frames as u64).saturating_add(1)));
        prop_assert!(work.inflated <= work.frames_scanned);
        prop_assert!(work.engine_calls <= work.inflated * 2 + 8);
        prop_assert!(work.hashed <= 8 * work.frames_scanned + max_bytes as u64 + 8);

        match (&got, &want) {
            (Ok(g), Ok(w)) => prop_assert_eq!(g, w),
            (Ok(_), Err(e)) => prop_assert!(false, "accepted what the reference refused: {:?}", e),
            (Err(FrameError::TooManyFrames), _) => {}
            (Err(e), Ok(_)) => prop_assert!(
                !valid,
                "refused a valid body the reference accepted: {:?}", e
            ),
            (Err(_), Err(_)) => {}
        }
    }

    /// Arbitrary bytes as a compressed message never panic the decoders.
    #[test]
    fn decoders_never_panic(
        raw in prop::collection::vec(any::<u8>(), 0..512),
        c in compression_strategy(),
        limit in 0usize..100_000,
    ) {
        let mut inflater = Inflater::new();
        let _ = inflater.message(c, &raw, limit);
        // Reused after any outcome, it still decodes a valid message.
        let ok = compress(c, b"after");
        prop_assert_eq!(inflater.message(c, &ok, 100).unwrap(), b"after");
    }
}

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
