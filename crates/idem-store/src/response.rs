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

fn put_headers(out: &mut impl BufMut, h: &HeaderMap) {
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
        let mut out =
            ResponseEncoder::with_capacity(self.status, &self.headers, self.encoded_len());
        for f in &self.frames {
            out.frame(f);
        }
        out.finish(self.trailers.as_ref())
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

/// Room kept after a response's head and after its first frame for the trailers of a
/// successful call (the flag, then the map `grpc-status: 0`).
const TRAILERS_ROOM: usize = 1 + 4 + 2 + "grpc-status".len() + 4 + 1;

/// Room kept after a response's head for a first frame of up to this many bytes (its
/// length prefix included), so that a small unary OK response's record is allocated once,
/// at its head; [`ResponseEncoder::finish`] gives back what it did not use (a shrink in
/// place). A larger first frame grows the record once, exactly, as it arrives.
const FIRST_FRAME_ROOM: usize = 4 + 256;

/// A [`StoredResponse`] encoded as it arrives: the head when the response starts, each
/// DATA frame as it comes, the trailers at the end. [`finish`](Self::finish) gives the
/// bytes [`StoredResponse::encode`] gives for the same parts, without a copy of the
/// head or a list of the frames kept on the way.
///
/// ```
/// use idem_store::response::{ResponseEncoder, StoredResponse};
///
/// let reply = StoredResponse::unary_ok(&[0x0a, 0x01, b'x']);
/// let mut out = ResponseEncoder::new(reply.status, &reply.headers);
/// for frame in &reply.frames {
///     out.frame(frame);
/// }
/// assert_eq!(out.finish(reply.trailers.as_ref()), reply.encode());
/// ```
#[derive(Debug)]
pub struct ResponseEncoder {
    out: Vec<u8>,
    /// Where the frame count goes; written by `finish`.
    count_at: usize,
    frames: u32,
}

impl ResponseEncoder {
    /// Starts a response with its status and headers.
    pub fn new(status: StatusCode, headers: &HeaderMap) -> Self {
        let head = MAGIC.len() + 2 + headers_len(headers) + 4;
        ResponseEncoder::with_capacity(status, headers, head + FIRST_FRAME_ROOM + TRAILERS_ROOM)
    }

    fn with_capacity(status: StatusCode, headers: &HeaderMap, capacity: usize) -> Self {
        let mut out = Vec::with_capacity(capacity);
        out.put_slice(MAGIC);
        out.put_u16(status.as_u16());
        put_headers(&mut out, headers);
        let count_at = out.len();
        out.put_u32(0);
        ResponseEncoder {
            out,
            count_at,
            frames: 0,
        }
    }

    /// Appends one DATA frame as sent (gRPC message framing included).
    pub fn frame(&mut self, frame: &[u8]) {
        let need = 4 + frame.len();
        if self.out.capacity() - self.out.len() < need {
            if self.frames == 0 {
                // Exactly: most responses have this one frame and then their trailers.
                self.out.reserve_exact(need + TRAILERS_ROOM);
            } else {
                self.out.reserve(need);
            }
        }
        self.frames = self.frames.saturating_add(1);
        self.out.put_u32(frame.len() as u32);
        self.out.put_slice(frame);
    }

    /// Ends the response with its trailers (`None`: Trailers-Only) and gives the bytes.
    pub fn finish(mut self, trailers: Option<&HeaderMap>) -> Bytes {
        let count = self.frames.to_be_bytes();
        self.out[self.count_at..self.count_at + 4].copy_from_slice(&count);
        match trailers {
            None => self.out.put_u8(0),
            Some(t) => {
                self.out.reserve_exact(1 + headers_len(t));
                self.out.put_u8(1);
                put_headers(&mut self.out, t);
            }
        }
        // A store keeps these bytes as they are: give back any room not used (none for
        // a unary OK response), so a record holds no more memory than its length.
        self.out.shrink_to_fit();
        Bytes::from(self.out)
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

    #[test]
    fn the_encoder_writes_what_encode_writes() {
        let many = StoredResponse {
            frames: (0..40).map(|i| Bytes::from(vec![i as u8; i * 7])).collect(),
            ..sample()
        };
        let trailers_only = StoredResponse {
            frames: vec![],
            trailers: None,
            ..sample()
        };
        let big_trailers = {
            let mut r = sample();
            let t = r.trailers.as_mut().unwrap();
            t.insert("grpc-message", HeaderValue::from_static("x"));
            t.insert("x-long", HeaderValue::from_bytes(&[b'v'; 300]).unwrap());
            r
        };
        for r in [sample(), many, trailers_only, big_trailers] {
            let mut out = ResponseEncoder::new(r.status, &r.headers);
            for f in &r.frames {
                out.frame(f);
            }
            let bytes = out.finish(r.trailers.as_ref());
            assert_eq!(bytes, r.encode());
            assert_eq!(StoredResponse::decode(bytes).unwrap(), r);
        }
    }

    #[test]
    fn a_small_unary_ok_record_is_allocated_once_and_a_large_one_grown_once_exactly() {
        // A small reply fits the room kept at the head: its frame and trailers need no
        // second allocation, and what is left is given back at the end.
        let r = StoredResponse::unary_ok(&[7; 40]);
        let mut out = ResponseEncoder::new(r.status, &r.headers);
        let at_head = out.out.capacity();
        assert_eq!(at_head, out.out.len() + FIRST_FRAME_ROOM + TRAILERS_ROOM);
        out.frame(&r.frames[0]);
        assert_eq!(
            out.out.capacity(),
            at_head,
            "a 40-byte reply grew the record"
        );
        let trailers = r.trailers.as_ref().unwrap();
        assert_eq!(1 + headers_len(trailers), TRAILERS_ROOM);
        let before_finish = out.out.len() + TRAILERS_ROOM;
        assert!(out.out.capacity() >= before_finish);
        assert_eq!(out.finish(Some(trailers)), r.encode());

        // A first frame over the room grows the record once, to exactly what the frame
        // and the trailers of a successful call need.
        let big = StoredResponse::unary_ok(&[7; 1000]);
        let mut out = ResponseEncoder::new(big.status, &big.headers);
        out.frame(&big.frames[0]);
        assert_eq!(out.out.capacity(), out.out.len() + TRAILERS_ROOM);
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
