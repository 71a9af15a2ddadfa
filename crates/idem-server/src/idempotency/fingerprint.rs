//! Fingerprinting a protected request's buffered body, in work linear in the body's
//! size whatever its framing.
//!
//! 1. [`compression`]: before the body is read, the request's `grpc-encoding` must be
//!    identity or one the method accepts (`acceptCompressed`); anything else is refused
//!    with UNIMPLEMENTED, as tonic refuses it, with no decoding work.
//! 2. [`fingerprint`]: once the body is buffered, its gRPC frames (5-byte prefix:
//!    compressed flag, `u32` length) are counted first (over `maxRequestFrames` →
//!    RESOURCE_EXHAUSTED before anything is decoded), then decoded with one reusable
//!    decoder and hashed as they come. No per-message allocation: the handler gets the
//!    buffered body, the fingerprint needs only the hash. The message list is built
//!    only for a method with a [`FingerprintHook`].
//!
//! Work that may exceed [`INLINE_WORK`] bytes runs on tokio's blocking pool, so a large
//! request does not hold an async worker.

use std::ops::Range;

use bytes::{Buf, Bytes};
use http::HeaderMap;
use idem_core::config::{Compression, IdempotencyPolicy};
use idem_core::headers::reason;
use prost::encoding::{DecodeContext, decode_key, skip_field};
use tonic::{Code, Status};

use super::digest::{Fingerprinter, fingerprint_custom};
use super::inflate::{FrameError, Inflater};
use super::layer::FingerprintHook;
use super::status::{idem_status, request_malformed};
use idem_store::Fingerprint;

/// Most bytes of hashing or decoding done on the calling async task (about 0.5 ms);
/// a request that may need more is read on the blocking pool.
pub(crate) const INLINE_WORK: usize = 256 * 1024;
/// Most bytes one compressed byte can decode to (DEFLATE's bound is about 1032:1).
const MAX_INFLATE_RATIO: usize = 1032;

/// The method's bounds on a request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Most message bytes, after decompression (`maxRequestBytes`).
    pub(crate) max_bytes: usize,
    /// Most messages (`maxRequestFrames`).
    pub(crate) max_frames: usize,
    /// Check that each message is well-formed protobuf wire format.
    pub(crate) protobuf: bool,
}

impl Limits {
    pub(crate) fn of(policy: &IdempotencyPolicy) -> Self {
        Limits {
            max_bytes: policy.max_request_bytes,
            max_frames: policy.max_request_frames,
            protobuf: false,
        }
    }
}

/// What reading one body cost; tests bound it by the body's size.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Work {
    /// Frame headers read (the counting pass stops one past the limit).
    pub(crate) frames_scanned: u64,
    /// Compressed messages handed to the decoder.
    pub(crate) inflated: u64,
    /// Calls into the inflate engine.
    pub(crate) engine_calls: u64,
    /// Compressed bytes the inflate engine read.
    pub(crate) engine_input: u64,
    /// Bytes fed to SHA-256, length prefixes included.
    pub(crate) hashed: u64,
}

/// The compression of a protected request, from its `grpc-encoding`, decided before its
/// body is read: `None` for identity (or no header).
///
/// # Errors
/// UNIMPLEMENTED (`ENCODING_UNSUPPORTED`, with `grpc-accept-encoding`) for an encoding the
/// method does not list in `acceptCompressed`.
pub(crate) fn compression(
    headers: &HeaderMap,
    policy: &IdempotencyPolicy,
) -> Result<Option<Compression>, Status> {
    const GRPC_ENCODING: http::HeaderName = http::HeaderName::from_static("grpc-encoding");
    let Some(value) = headers.get(&GRPC_ENCODING) else {
        return Ok(None);
    };
    let name = value.as_bytes();
    if name == b"identity" {
        return Ok(None);
    }
    let accepted = policy.accept_compressed;
    if let Some(c) = Compression::from_name(name)
        && accepted.contains(c)
    {
        return Ok(Some(c));
    }
    let shown = String::from_utf8_lossy(name);
    let now = if accepted.is_empty() {
        "identity only".to_owned()
    } else {
        accepted
            .iter()
            .map(Compression::name)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let message = match Compression::from_name(name) {
        Some(_) => format!(
            "grpc-encoding {shown:?} is not accepted by this method (accepted: {now}); if the service accepts it, list it in the method's idempotency.acceptCompressed"
        ),
        None => format!(
            "grpc-encoding {shown:?} is not accepted by this method (accepted: {now}; idempotency.acceptCompressed can add gzip and deflate)"
        ),
    };
    let mut status = idem_status(Code::Unimplemented, message, reason::ENCODING_UNSUPPORTED);
    let accept = std::iter::once("identity")
        .chain(accepted.iter().map(Compression::name))
        .collect::<Vec<_>>()
        .join(",");
    if let Ok(v) = accept.parse() {
        status.metadata_mut().insert("grpc-accept-encoding", v);
    }
    Err(status)
}

/// The fingerprint of a buffered request: over its messages, or over what the method's
/// `hook` makes of them. Reads on the blocking pool when the work may exceed
/// [`INLINE_WORK`].
///
/// # Errors
/// The status to answer: RESOURCE_EXHAUSTED (`REQUEST_TOO_LARGE`) over `maxRequestBytes`
/// decompressed or `maxRequestFrames`; INTERNAL for a body that is not valid gRPC framing
/// or does not decompress.
pub(crate) async fn fingerprint(
    body: &Bytes,
    compression: Option<Compression>,
    policy: &IdempotencyPolicy,
    hook: Option<&FingerprintHook>,
    protobuf: bool,
) -> Result<Fingerprint, Status> {
    let limits = Limits {
        protobuf,
        ..Limits::of(policy)
    };
    let work_bound = match compression {
        None => body.len(),
        Some(_) => body.len().saturating_add(
            body.len()
                .saturating_mul(MAX_INFLATE_RATIO)
                .min(limits.max_bytes),
        ),
    };
    let result = if work_bound <= INLINE_WORK {
        read(body, compression, limits, hook, &mut Work::default())
    } else {
        // Off the async workers: the body and the hook are shared with the blocking task.
        let (body, hook) = (body.clone(), hook.cloned());
        let read = move || {
            read(
                &body,
                compression,
                limits,
                hook.as_ref(),
                &mut Work::default(),
            )
        };
        match tokio::task::spawn_blocking(read).await {
            Ok(r) => r,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => return Err(Status::unavailable("server shutting down")),
        }
    };
    result.map_err(|e| e.into_status(limits))
}

/// Reads `body` into a fingerprint, adding what it cost to `work`.
pub(crate) fn read(
    body: &Bytes,
    compression: Option<Compression>,
    limits: Limits,
    hook: Option<&FingerprintHook>,
    work: &mut Work,
) -> Result<Fingerprint, FrameError> {
    count(body, compression, limits, work)?;
    let mut inflater = Inflater::new();
    let result = match hook {
        None => {
            let mut fp = Fingerprinter::new();
            let r = each_message(body, compression, limits, &mut inflater, work, |m| {
                fp.message(m);
            });
            work.hashed += fp.hashed;
            r.map(|()| fp.finish())
        }
        Some(hook) => {
            let mut msgs = Vec::new();
            each_message(body, compression, limits, &mut inflater, work, |m| {
                msgs.push(Bytes::copy_from_slice(m));
            })
            .map(|()| fingerprint_custom(&hook(&msgs)))
        }
    };
    work.engine_calls += inflater.engine_calls;
    work.engine_input += inflater.budget.input;
    result
}

/// The first pass: frame headers only. Refuses too many frames, truncation, bad flags and
/// compressed frames without an encoding before any message is decoded or hashed.
fn count(
    body: &[u8],
    compression: Option<Compression>,
    limits: Limits,
    work: &mut Work,
) -> Result<(), FrameError> {
    let mut plain = 0usize;
    for (n, frame) in Frames::new(body).enumerate() {
        work.frames_scanned += 1;
        if n >= limits.max_frames {
            return Err(FrameError::TooManyFrames);
        }
        let (flag, range) = frame?;
        match flag {
            0 => plain += range.len(),
            1 if compression.is_none() => return Err(FrameError::CompressedWithoutEncoding),
            1 => {}
            _ => return Err(FrameError::Corrupt(format!("compressed flag {flag}"))),
        }
        if plain > limits.max_bytes {
            return Err(FrameError::TooLarge);
        }
    }
    Ok(())
}

/// The second pass: each message, decompressed, to `sink`, within `limits.max_bytes`.
fn each_message(
    body: &[u8],
    compression: Option<Compression>,
    limits: Limits,
    inflater: &mut Inflater,
    work: &mut Work,
    mut sink: impl FnMut(&[u8]),
) -> Result<(), FrameError> {
    let mut total = 0usize;
    for (i, frame) in Frames::new(body).enumerate() {
        let (flag, range) = frame?;
        let raw = &body[range];
        let message = match (flag, compression) {
            (0, _) => raw,
            (1, Some(c)) => {
                work.inflated += 1;
                inflater.message(c, raw, limits.max_bytes - total)?
            }
            (1, None) => return Err(FrameError::CompressedWithoutEncoding),
            _ => return Err(FrameError::Corrupt(format!("compressed flag {flag}"))),
        };
        total += message.len();
        if total > limits.max_bytes {
            return Err(FrameError::TooLarge);
        }
        if limits.protobuf {
            check_protobuf(message).map_err(|e| FrameError::Malformed(i, e.to_string()))?;
        }
        sink(message);
    }
    Ok(())
}

/// Checks that `msg` is well-formed protobuf wire format (keys, wire types, varints,
/// lengths, balanced groups) without knowing its type. Every encoding of any message
/// passes; bytes no protobuf decoder would accept do not. Linear in the message's size.
fn check_protobuf(mut msg: &[u8]) -> Result<(), prost::DecodeError> {
    while msg.has_remaining() {
        let (tag, wire_type) = decode_key(&mut msg)?;
        skip_field(wire_type, tag, &mut msg, DecodeContext::default())?;
    }
    Ok(())
}

/// The frames of a gRPC body: (compressed flag, payload range), or `Truncated` once.
struct Frames<'a> {
    body: &'a [u8],
    at: usize,
}

impl<'a> Frames<'a> {
    fn new(body: &'a [u8]) -> Self {
        Frames { body, at: 0 }
    }
}

impl Iterator for Frames<'_> {
    type Item = Result<(u8, Range<usize>), FrameError>;

    fn next(&mut self) -> Option<Self::Item> {
        let rest = self.body.get(self.at..).filter(|r| !r.is_empty())?;
        let Some(&[flag, a, b, c, d]) = rest.get(..5) else {
            self.at = self.body.len();
            return Some(Err(FrameError::Truncated));
        };
        let len = u32::from_be_bytes([a, b, c, d]) as usize;
        let start = self.at + 5;
        if len > self.body.len() - start {
            self.at = self.body.len();
            return Some(Err(FrameError::Truncated));
        }
        self.at = start + len;
        Some(Ok((flag, start..start + len)))
    }
}

impl FrameError {
    fn into_status(self, limits: Limits) -> Status {
        match self {
            FrameError::TooLarge => idem_status(
                Code::ResourceExhausted,
                format!(
                    "decompressed request over the idempotency buffer limit of {} bytes (idempotency.maxRequestBytes)",
                    limits.max_bytes
                ),
                reason::REQUEST_TOO_LARGE,
            ),
            FrameError::TooManyFrames => idem_status(
                Code::ResourceExhausted,
                format!(
                    "request has more than {} gRPC messages (idempotency.maxRequestFrames)",
                    limits.max_frames
                ),
                reason::REQUEST_TOO_LARGE,
            ),
            FrameError::Padded => idem_status(
                Code::ResourceExhausted,
                "compressed request much larger than what it decompresses to (empty DEFLATE blocks); no compressor writes this, send it uncompressed or compressed normally",
                reason::REQUEST_TOO_LARGE,
            ),
            FrameError::Malformed(i, why) => request_malformed(format_args!("message {i}: {why}")),
            FrameError::Truncated => Status::internal("request body ends inside a gRPC frame"),
            FrameError::CompressedWithoutEncoding => {
                Status::internal("compressed gRPC frame without a grpc-encoding")
            }
            FrameError::Corrupt(m) => {
                Status::internal(format!("request message does not decompress: {m}"))
            }
        }
    }
}

#[cfg(test)]
mod tests;
