//! gzip and zlib (`deflate`) decoding of one gRPC message at a time, with one decoder
//! and one output buffer reused for every message of a request.
//!
//! A decoder per message (what `flate2::read::GzDecoder::new` does) allocates and zeroes
//! a 32 KiB window each time, so a body of empty members cost far more than its size.
//! Here starting a message only resets a few fields of one `flate2::Decompress`, on the
//! `zlib-rs` backend: its reset keeps the window allocation without clearing it, and its
//! fixed-Huffman tables are static (the `miniz_oxide` backend rebuilds them for every
//! block, so a body of empty blocks cost seconds). Valid streams decode
//! to the same bytes whatever the backend, so fingerprints do not change.
//!
//! Rules, as tonic's decoders apply them: a message holds one complete stream (gzip: one
//! member; bytes after it are ignored); header and checksums are checked.
//!
//! One rule of our own bounds the decoder's work by what it produces. The engine's cost
//! grows with the DEFLATE *blocks* it reads, and an empty block takes 10 bits, so 4 MiB
//! can hold 3.3 million blocks that decode to nothing and cost 20× a normal 4 MiB
//! request. No compressor writes that: stored blocks add 5 bytes per 64 KiB, and even
//! fixed-Huffman coding of random bytes grows them by at most 1/8. So the compressed
//! bytes a request may spend beyond 9/8 of what they decode to are budgeted
//! ([`SLACK_PER_REQUEST`] plus [`SLACK_PER_MESSAGE`] for each message), and the engine
//! is fed [`INPUT_STEP`] bytes at a time so that a message over the budget stops within
//! one step: [`FrameError::Padded`].

use flate2::{Crc, Decompress, FlushDecompress, Status};
use idem_core::config::Compression;

/// First size of the output buffer; it doubles as a message needs, up to the limit.
const FIRST_BUFFER: usize = 64 * 1024;
/// Longest gzip `FNAME` / `FCOMMENT` field `flate2` accepts.
const MAX_GZIP_FIELD: usize = 65_535;

/// Compressed bytes a request may hold beyond what its messages decode to.
pub(crate) const SLACK_PER_REQUEST: u64 = 64 * 1024;
/// The same, added for each compressed message (zlib's wrapper and an empty message's
/// final block take 8 bytes).
pub(crate) const SLACK_PER_MESSAGE: u64 = 32;
/// Most compressed bytes handed to the engine in one call.
const INPUT_STEP: usize = 16 * 1024;

const FHCRC: u8 = 1 << 1;
const FEXTRA: u8 = 1 << 2;
const FNAME: u8 = 1 << 3;
const FCOMMENT: u8 = 1 << 4;
const FRESERVED: u8 = 0xe0;

/// Why a buffered request body could not be read as gRPC messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FrameError {
    /// The body ends inside a frame.
    Truncated,
    /// A frame is marked compressed but the request names no encoding (or `identity`).
    CompressedWithoutEncoding,
    /// Message `.0` is not well-formed protobuf (`.1` says why).
    Malformed(usize, String),
    /// The compressed bytes do not decode, or a frame's flag is neither 0 nor 1.
    Corrupt(String),
    /// Decompressed, the messages exceed the buffering limit.
    TooLarge,
    /// The body holds more messages than the method allows.
    TooManyFrames,
    /// Compressed messages far larger than what they decode to (empty DEFLATE blocks);
    /// see the [module docs](self).
    Padded,
}

/// One reusable decoder; see the [module docs](self).
pub(crate) struct Inflater {
    /// Made at the first compressed message: a decoder allocates and clears its window,
    /// which an uncompressed request must not pay for.
    state: Option<Decompress>,
    out: Vec<u8>,
    /// Calls into the inflate engine so far (each ends a stream, fills the buffer, uses
    /// up an input step, or fails).
    pub(crate) engine_calls: u64,
    /// The request's compressed bytes against their output.
    pub(crate) budget: Budget,
}

/// Compressed bytes against what they decode to, over one request; see the
/// [module docs](self).
#[derive(Debug, Default)]
pub(crate) struct Budget {
    /// Compressed bytes handed to the engine so far.
    pub(crate) input: u64,
    /// What those bytes decoded to.
    output: u64,
    /// Messages started so far.
    messages: u64,
}

impl Budget {
    /// Whether the compressed bytes read so far exceed 9/8 of their output by more than
    /// the request's slack.
    fn exceeded(&self) -> bool {
        let paid = self.output + self.output / 8;
        let slack = SLACK_PER_REQUEST + SLACK_PER_MESSAGE * self.messages;
        self.input > paid.saturating_add(slack)
    }
}

impl Inflater {
    pub(crate) fn new() -> Self {
        Inflater {
            state: None,
            out: Vec::new(),
            engine_calls: 0,
            budget: Budget::default(),
        }
    }

    /// Decodes one compressed message of at most `limit` bytes; the result lives until
    /// the next call.
    pub(crate) fn message(
        &mut self,
        compression: Compression,
        raw: &[u8],
        limit: usize,
    ) -> Result<&[u8], FrameError> {
        let len = match compression {
            Compression::Deflate => self.inflate(raw, true, limit)?.1,
            Compression::Gzip => {
                let header = gzip_header(raw)?;
                let body = &raw[header..];
                let (used, len) = self.inflate(body, false, limit)?;
                let trailer = body
                    .get(used..used + 8)
                    .ok_or_else(|| corrupt("gzip member ends before its trailer"))?;
                let mut crc = Crc::new();
                crc.update(&self.out[..len]);
                let (sum, size) = trailer.split_at(4);
                if u32::from_le_bytes(sum.try_into().expect("4 bytes")) != crc.sum()
                    || u32::from_le_bytes(size.try_into().expect("4 bytes")) != len as u32
                {
                    return Err(corrupt(
                        "corrupt gzip stream does not have a matching checksum",
                    ));
                }
                len
            }
        };
        Ok(&self.out[..len])
    }

    /// Runs the engine over one whole stream (zlib-wrapped or raw DEFLATE); returns
    /// (input used, output length).
    fn inflate(
        &mut self,
        input: &[u8],
        zlib: bool,
        limit: usize,
    ) -> Result<(usize, usize), FrameError> {
        self.budget.messages += 1;
        // One byte past the limit tells "exactly the limit" from "over it".
        let cap = limit.saturating_add(1);
        let state = match &mut self.state {
            Some(state) => {
                state.reset(zlib);
                state
            }
            None => self.state.insert(Decompress::new(zlib)),
        };
        let (mut used, mut len) = (0, 0);
        loop {
            if len == self.out.len() && len < cap {
                let grown = self.out.len().saturating_mul(2).max(FIRST_BUFFER).min(cap);
                self.out.resize(grown, 0);
            }
            let end = self.out.len().min(cap);
            let step = input.len().min(used + INPUT_STEP);
            self.engine_calls += 1;
            let (in0, out0) = (state.total_in(), state.total_out());
            let status = state
                .decompress(
                    &input[used..step],
                    &mut self.out[len..end],
                    FlushDecompress::None,
                )
                .map_err(|e| FrameError::Corrupt(e.to_string()))?;
            let (n_in, n_out) = (
                (state.total_in() - in0) as usize,
                (state.total_out() - out0) as usize,
            );
            used += n_in;
            len += n_out;
            self.budget.input += n_in as u64;
            self.budget.output += n_out as u64;
            if self.budget.exceeded() {
                return Err(FrameError::Padded);
            }
            match status {
                Status::StreamEnd => return Ok((used, len)),
                _ if len == end && end == cap => return Err(FrameError::TooLarge),
                _ if len == end => {}
                _ if used == input.len() || n_in + n_out == 0 => {
                    return Err(corrupt("compressed message ends inside its stream"));
                }
                _ => {}
            }
        }
    }
}

fn corrupt(why: &str) -> FrameError {
    FrameError::Corrupt(why.to_owned())
}

/// Length of the gzip member header at the start of `b` (RFC 1952 2.3), checked as
/// `flate2` checks it.
fn gzip_header(b: &[u8]) -> Result<usize, FrameError> {
    let short = || corrupt("gzip member ends inside its header");
    let fixed = b.get(..10).ok_or_else(short)?;
    if fixed[..3] != [0x1f, 0x8b, 8] || fixed[3] & FRESERVED != 0 {
        return Err(corrupt("invalid gzip header"));
    }
    let flags = fixed[3];
    let mut at = 10;
    if flags & FEXTRA != 0 {
        let xlen = b.get(at..at + 2).ok_or_else(short)?;
        at += 2 + usize::from(u16::from_le_bytes([xlen[0], xlen[1]]));
    }
    for field in [FNAME, FCOMMENT] {
        if flags & field != 0 {
            let rest = b.get(at..).ok_or_else(short)?;
            let nul = rest.iter().position(|&c| c == 0).ok_or_else(short)?;
            if nul > MAX_GZIP_FIELD {
                return Err(corrupt("gzip header field too long"));
            }
            at += nul + 1;
        }
    }
    if flags & FHCRC != 0 {
        let stored = b.get(at..at + 2).ok_or_else(short)?;
        let mut crc = Crc::new();
        crc.update(&b[..at]);
        if u16::from_le_bytes([stored[0], stored[1]]) != crc.sum() as u16 {
            return Err(corrupt("gzip header checksum does not match"));
        }
        at += 2;
    }
    if at > b.len() {
        return Err(short());
    }
    Ok(at)
}
