//! The encoding of a stored response: what `idem-server` keeps as
//! [`StoredOutcome::Response`](crate::StoredOutcome::Response) and replays byte for byte.
//!
//! Stores keep these bytes without reading them. The format lives here, below the server
//! layer, for the one case where something other than the layer writes them: a handler
//! that completes its record inside its own database transaction (see `idem-postgres`)
//! stores [`StoredResponse::unary_ok`]`(message).encode()`, exactly the bytes the layer
//! would have recorded for the same reply.
//!
//! ```text
//! "IDR1" status:u16 headers frames trailers
//! headers  = count:u32 (name_len:u16 name value_len:u32 value)*
//! frames   = count:u32 (len:u32 bytes)*          // raw HTTP/2 DATA payloads, gRPC framing included
//! trailers = 0:u8 | 1:u8 headers
//! ```
//! Big-endian integers. Decoding checks every length and every header, and never
//! panics: stored bytes come from a store, which may be shared, old, or corrupt.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

const MAGIC: &[u8; 4] = b"IDR1";

/// A response as it is stored and replayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The HTTP status (200 for every gRPC response).
    pub status: StatusCode,
    /// The response headers (Trailers-Only: the whole gRPC status is here).
    pub headers: HeaderMap,
    /// The DATA frames as sent, gRPC message framing included.
    pub frames: Vec<Bytes>,
    /// The trailers; `None` for a Trailers-Only response.
    pub trailers: Option<HeaderMap>,
}

/// Why stored bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("corrupt stored response: {0}")]
pub struct CorruptResponse(pub &'static str);

/// Encoded size of a header map: its count, then per entry the name and value with
/// their length prefixes.
fn headers_len(h: &HeaderMap) -> usize {
    4 + h
        .iter()
        .map(|(n, v)| 2 + n.as_str().len() + 4 + v.len())
        .sum::<usize>()
}

/// The encoded size of a response being collected, counted part by part as it arrives
/// (so the size limit is checked before the whole response is held).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodedSize(usize);

impl EncodedSize {
    /// Everything but the frames and the trailers' headers: magic, status, `headers`,
    /// the frame count and the trailers flag.
    pub fn of_head(headers: &HeaderMap) -> Self {
        EncodedSize(MAGIC.len() + 2 + headers_len(headers) + 4 + 1)
    }

    /// Adds one DATA frame (its length prefix and bytes).
    pub fn add_frame(&mut self, frame: &[u8]) {
        self.0 = self.0.saturating_add(4 + frame.len());
    }

    /// Adds the trailers' headers.
    pub fn add_trailers(&mut self, trailers: &HeaderMap) {
        self.0 = self.0.saturating_add(headers_len(trailers));
    }

    /// The size in bytes.
    pub fn bytes(self) -> usize {
        self.0
    }
}

fn put_headers(out: &mut BytesMut, h: &HeaderMap) {
    out.put_u32(h.len() as u32);
    for (n, v) in h {
        out.put_u16(n.as_str().len() as u16);
        out.put_slice(n.as_str().as_bytes());
        out.put_u32(v.len() as u32);
        out.put_slice(v.as_bytes());
    }
}

impl StoredResponse {
    /// What the layer records for a tonic unary handler that returned
    /// `Ok(tonic::Response::new(reply))` without metadata and without response
    /// compression: HTTP 200, `content-type: application/grpc`, one DATA frame holding
    /// `message` (the reply's protobuf encoding, `prost::Message::encode_to_vec`) behind
    /// the 5-byte gRPC message prefix, and the trailer `grpc-status: 0`.
    ///
    /// ```
    /// use idem_store::response::StoredResponse;
    /// let r = StoredResponse::unary_ok(&[0x0a, 0x01, b'x']);
    /// assert_eq!(&r.frames[0][..], &[0, 0, 0, 0, 3, 0x0a, 0x01, b'x']);
    /// assert_eq!(StoredResponse::decode(r.encode()).unwrap(), r);
    /// ```
    pub fn unary_ok(message: &[u8]) -> Self {
        let mut frame = BytesMut::with_capacity(5 + message.len());
        frame.put_u8(0);
        // gRPC caps a message at u32::MAX bytes; a larger one cannot be sent anyway.
        frame.put_u32(u32::try_from(message.len()).unwrap_or(u32::MAX));
        frame.put_slice(message);
        let mut headers = HeaderMap::with_capacity(1);
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        let mut trailers = HeaderMap::with_capacity(1);
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        StoredResponse {
            status: StatusCode::OK,
            headers,
            frames: vec![frame.freeze()],
            trailers: Some(trailers),
        }
    }

    /// Encoded size.
    pub fn encoded_len(&self) -> usize {
        let mut size = EncodedSize::of_head(&self.headers);
        for f in &self.frames {
            size.add_frame(f);
        }
        if let Some(t) = &self.trailers {
            size.add_trailers(t);
        }
        size.bytes()
    }

    /// The stored bytes.
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.encoded_len());
        out.put_slice(MAGIC);
        out.put_u16(self.status.as_u16());
        put_headers(&mut out, &self.headers);
        out.put_u32(self.frames.len() as u32);
        for f in &self.frames {
            out.put_u32(f.len() as u32);
            out.put_slice(f);
        }
        match &self.trailers {
            None => out.put_u8(0),
            Some(t) => {
                out.put_u8(1);
                put_headers(&mut out, t);
            }
        }
        out.freeze()
    }

    /// Decodes; frames share the input's allocation.
    pub fn decode(mut b: Bytes) -> Result<Self, CorruptResponse> {
        if b.len() < 6 || &b[..4] != MAGIC {
            return Err(CorruptResponse("bad magic"));
        }
        b.advance(4);
        let status =
            StatusCode::from_u16(b.get_u16()).map_err(|_| CorruptResponse("bad status"))?;
        let headers = get_headers(&mut b)?;
        let n = get_u32(&mut b)? as usize;
        // Each frame takes at least 4 bytes: bound the allocation by the input.
        if n > b.remaining() / 4 {
            return Err(CorruptResponse("frame count"));
        }
        let mut frames = Vec::with_capacity(n);
        for _ in 0..n {
            let len = get_u32(&mut b)? as usize;
            if len > b.remaining() {
                return Err(CorruptResponse("frame length"));
            }
            frames.push(b.split_to(len));
        }
        if !b.has_remaining() {
            return Err(CorruptResponse("missing trailers flag"));
        }
        let trailers = match b.get_u8() {
            0 => None,
            1 => Some(get_headers(&mut b)?),
            _ => return Err(CorruptResponse("bad trailers flag")),
        };
        if b.has_remaining() {
            return Err(CorruptResponse("trailing bytes"));
        }
        Ok(StoredResponse {
            status,
            headers,
            frames,
            trailers,
        })
    }
}

fn get_u32(b: &mut Bytes) -> Result<u32, CorruptResponse> {
    if b.remaining() < 4 {
        return Err(CorruptResponse("truncated"));
    }
    Ok(b.get_u32())
}

fn get_headers(b: &mut Bytes) -> Result<HeaderMap, CorruptResponse> {
    let n = get_u32(b)? as usize;
    if n > b.remaining() / 6 {
        return Err(CorruptResponse("header count"));
    }
    let mut h = HeaderMap::with_capacity(n);
    for _ in 0..n {
        if b.remaining() < 2 {
            return Err(CorruptResponse("truncated"));
        }
        let nl = b.get_u16() as usize;
        if nl > b.remaining() {
            return Err(CorruptResponse("header name length"));
        }
        let name =
            HeaderName::from_bytes(&b.split_to(nl)).map_err(|_| CorruptResponse("header name"))?;
        let vl = get_u32(b)? as usize;
        if vl > b.remaining() {
            return Err(CorruptResponse("header value length"));
        }
        let value = HeaderValue::from_maybe_shared(b.split_to(vl))
            .map_err(|_| CorruptResponse("header value"))?;
        h.append(name, value);
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> StoredResponse {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/grpc"));
        headers.append("x-multi", HeaderValue::from_static("a"));
        headers.append("x-multi", HeaderValue::from_static("b"));
        headers.insert("x-bin-bin", HeaderValue::from_static("AAEC"));
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        StoredResponse {
            status: StatusCode::OK,
            headers,
            frames: vec![Bytes::from_static(b"\0\0\0\0\x02hi"), Bytes::new()],
            trailers: Some(trailers),
        }
    }

    #[test]
    fn round_trip_keeps_everything_in_order() {
        let r = sample();
        let enc = r.encode();
        assert_eq!(enc.len(), r.encoded_len());
        let back = StoredResponse::decode(enc).unwrap();
        assert_eq!(back, r);
        let multi: Vec<_> = back.headers.get_all("x-multi").iter().collect();
        assert_eq!(multi, ["a", "b"]);
        let trailers_only = StoredResponse {
            frames: vec![],
            trailers: None,
            ..sample()
        };
        assert_eq!(
            StoredResponse::decode(trailers_only.encode()).unwrap(),
            trailers_only
        );
    }

    #[test]
    fn every_truncation_is_an_error() {
        let enc = sample().encode();
        for n in 0..enc.len() {
            assert!(
                StoredResponse::decode(enc.slice(..n)).is_err(),
                "prefix {n}"
            );
        }
        let mut extra = BytesMut::from(&enc[..]);
        extra.put_u8(0);
        assert!(StoredResponse::decode(extra.freeze()).is_err());
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = StoredResponse::decode(Bytes::from(bytes));
        }

        #[test]
        fn decode_of_mutated_never_panics(i in 0usize..200, v in any::<u8>()) {
            let mut enc = sample().encode().to_vec();
            let i = i % enc.len();
            enc[i] = v;
            let _ = StoredResponse::decode(Bytes::from(enc));
        }
    }
}
