//! Scope and fingerprint digests, and the gRPC de-framing they need.

use std::io::Read;

use bytes::{Buf, Bytes};
use sha2::{Digest, Sha256};

use idem_store::{Fingerprint, Scope, TenantId};

/// The record name of a call: SHA-256 over the length-prefixed tenant, method path and
/// key (each as a big-endian `u64` length then the bytes), after a version tag. No
/// separator inside a value can make two triples collide.
///
/// ```
/// # use idem_server::scope_for;
/// assert_ne!(
///     scope_for("ab", "/s/m", "keykeykey"),
///     scope_for("a", "b/s/m", "keykeykey"),
/// );
/// ```
pub fn scope_for(tenant: &str, method_path: &str, key: &str) -> Scope {
    let mut h = Sha256::new();
    h.update(b"idem-scope-v1");
    for part in [tenant, method_path, key] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    Scope(h.finalize().into())
}

/// The store's name for a tenant: the first 16 bytes of SHA-256 over a version tag and
/// the tenant, so a store can keep per-tenant bounds without holding tenant names.
pub fn tenant_id(tenant: &str) -> TenantId {
    let mut h = Sha256::new();
    h.update(b"idem-tenant-v1");
    h.update(tenant.as_bytes());
    let d: [u8; 32] = h.finalize().into();
    let mut id = [0; 16];
    id.copy_from_slice(&d[..16]);
    TenantId(id)
}

/// Fingerprint of a request: SHA-256 over its messages, each as a big-endian `u64`
/// length then the (decompressed) message bytes.
pub(crate) fn fingerprint_messages(messages: &[Bytes]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"idem-fp-v1");
    for m in messages {
        h.update((m.len() as u64).to_be_bytes());
        h.update(m);
    }
    Fingerprint(h.finalize().into())
}

/// Fingerprint of the canonical bytes a custom hook returned.
pub(crate) fn fingerprint_custom(canonical: &[u8]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"idem-fp-custom-v1");
    h.update(canonical);
    Fingerprint(h.finalize().into())
}

/// Why a buffered request body could not be read as gRPC messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FrameError {
    /// The body ends inside a frame.
    Truncated,
    /// A frame is marked compressed but the request names no encoding (or `identity`).
    CompressedWithoutEncoding,
    /// A compressed frame uses an encoding the layer cannot decode.
    Unsupported(String),
    /// The compressed bytes do not decode.
    Corrupt(String),
    /// Decompressed, the messages exceed the buffering limit.
    TooLarge,
}

/// Splits a gRPC request body into messages (5-byte prefix: compressed flag + `u32`
/// length), decompressing flagged ones with `encoding` (`gzip` or `deflate`, as tonic
/// sends them). `max` bounds the decompressed total.
pub(crate) fn messages(
    body: &Bytes,
    encoding: Option<&[u8]>,
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
        let msg = match flag {
            0 => raw,
            1 => decompress(&raw, encoding, max.saturating_sub(total))?,
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

fn decompress(raw: &[u8], encoding: Option<&[u8]>, limit: usize) -> Result<Bytes, FrameError> {
    let mut out = Vec::new();
    let limit = (limit as u64).saturating_add(1);
    let read = match encoding {
        None | Some(b"identity") => return Err(FrameError::CompressedWithoutEncoding),
        Some(b"gzip") => flate2::read::GzDecoder::new(raw)
            .take(limit)
            .read_to_end(&mut out),
        Some(b"deflate") => flate2::read::ZlibDecoder::new(raw)
            .take(limit)
            .read_to_end(&mut out),
        Some(other) => {
            return Err(FrameError::Unsupported(
                String::from_utf8_lossy(other).into_owned(),
            ));
        }
    };
    read.map_err(|e| FrameError::Corrupt(e.to_string()))?;
    if out.len() as u64 >= limit {
        return Err(FrameError::TooLarge);
    }
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn frame(flag: u8, msg: &[u8]) -> Vec<u8> {
        let mut v = vec![flag];
        v.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        v.extend_from_slice(msg);
        v
    }

    #[test]
    fn scope_parts_are_length_prefixed() {
        assert_ne!(
            scope_for("t", "/a/b", "kkkkkkkk"),
            scope_for("t", "/a/b", "kkkkkkkK")
        );
        assert_ne!(scope_for("t1", "/a/b", "k"), scope_for("t", "1/a/b", "k"));
        assert_eq!(
            scope_for("t", "/a/b", "kkkkkkkk"),
            scope_for("t", "/a/b", "kkkkkkkk")
        );
    }

    #[test]
    fn compressed_and_plain_frames_fingerprint_alike() {
        let msg = b"hello hello hello hello";
        let plain = Bytes::from(frame(0, msg));
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(msg).unwrap();
        let gz = Bytes::from(frame(1, &gz.finish().unwrap()));
        let mut zl = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        zl.write_all(msg).unwrap();
        let zl = Bytes::from(frame(1, &zl.finish().unwrap()));
        let a = fingerprint_messages(&messages(&plain, None, 1024).unwrap());
        let b = fingerprint_messages(&messages(&gz, Some(b"gzip"), 1024).unwrap());
        let c = fingerprint_messages(&messages(&zl, Some(b"deflate"), 1024).unwrap());
        assert_eq!(a, b);
        assert_eq!(a, c);
        assert_eq!(
            messages(&gz, Some(b"zstd"), 1024),
            Err(FrameError::Unsupported("zstd".into()))
        );
        assert_eq!(
            messages(&gz, None, 1024),
            Err(FrameError::CompressedWithoutEncoding)
        );
        assert_eq!(messages(&gz, Some(b"gzip"), 5), Err(FrameError::TooLarge));
    }

    #[test]
    fn message_boundaries_matter_and_truncation_is_refused() {
        let one = Bytes::from(frame(0, b"abc"));
        let mut two = frame(0, b"ab");
        two.extend(frame(0, b"c"));
        let two = Bytes::from(two);
        assert_ne!(
            fingerprint_messages(&messages(&one, None, 100).unwrap()),
            fingerprint_messages(&messages(&two, None, 100).unwrap())
        );
        for n in 1..one.len() {
            assert_eq!(
                messages(&one.slice(..n), None, 100),
                Err(FrameError::Truncated)
            );
        }
        assert_eq!(messages(&Bytes::new(), None, 100), Ok(vec![]));
    }
}
