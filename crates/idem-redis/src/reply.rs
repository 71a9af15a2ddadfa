//! Decoding the scripts' replies: every reply is checked for its shape, and one of the
//! wrong shape is `StoreError::Corrupt`, never a panic; and the mapping of client errors
//! to `Unavailable` or `Corrupt`.

use std::time::Duration;

use bytes::Bytes;
use idem_store::{Cause, Fence, Fingerprint, StoreError, StoredOutcome};
use redis::{ErrorKind, RedisError, ServerErrorKind, Value};

/// Maps a client error: connection trouble, timeouts and server conditions that pass
/// (loading, OOM, read-only replica, cluster down…) are `Unavailable`; a reply of the
/// wrong shape, a key of the wrong type or a script error on a record is `Corrupt`.
pub(crate) fn map_error(e: RedisError) -> StoreError {
    let code = e.code().unwrap_or("");
    let corrupt_reply = matches!(e.kind(), ErrorKind::Parse | ErrorKind::UnexpectedReturnType)
        || code == "WRONGTYPE"
        || code == "IDEMCORRUPT"
        || (e.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
            && e.detail().is_some_and(|d| d.contains("user_script")));
    let cause = Cause::new(e.to_string(), e);
    if corrupt_reply {
        StoreError::Corrupt(cause)
    } else {
        StoreError::Unavailable(cause)
    }
}

/// Lower-case hex of `b` appended to `out` (a table, not `fmt`: keys are made on every
/// call).
pub(crate) fn push_hex(out: &mut String, b: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    // Written into a buffer on the stack and appended once per 32 bytes: a `push` per
    // digit checks the capacity and encodes a `char` each time (a record's key, built
    // twice per fresh call, spent about 900 instructions here).
    let mut buf = [0u8; 64];
    for chunk in b.chunks(32) {
        for (pair, &x) in buf.chunks_exact_mut(2).zip(chunk) {
            pair[0] = DIGITS[usize::from(x >> 4)];
            pair[1] = DIGITS[usize::from(x & 0xf)];
        }
        // Hex digits only: always UTF-8.
        if let Ok(hex) = std::str::from_utf8(&buf[..chunk.len() * 2]) {
            out.push_str(hex);
        }
    }
}

/// A number in decimal on the stack, for script arguments (no `fmt`, no allocation).
pub(crate) struct Decimal {
    buf: [u8; 20],
    start: usize,
}

impl Decimal {
    pub(crate) fn new(mut n: u64) -> Self {
        let mut buf = [0u8; 20];
        let mut start = buf.len();
        loop {
            start -= 1;
            buf[start] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        Decimal { buf, start }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.buf[self.start..]
    }
}

pub(crate) fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("redis: {what}").into())
}

/// The fields of the read script's reply: `None` when the record is absent (an empty
/// reply), else exactly `len` of them.
pub(crate) fn read_items(
    v: Value,
    len: usize,
) -> Result<Option<std::vec::IntoIter<Value>>, StoreError> {
    let items = array(v)?;
    if items.is_empty() {
        return Ok(None);
    }
    if items.len() != len {
        return Err(corrupt("read reply of unexpected length"));
    }
    Ok(Some(items.into_iter()))
}

/// The state, fence and lease left that begin every reply of the read script.
pub(crate) fn read_head(
    it: &mut impl Iterator<Item = Value>,
) -> Result<(u8, Fence, Duration), StoreError> {
    Ok((
        state_byte(it.next())?,
        fence(it.next())?,
        millis(it.next())?,
    ))
}

pub(crate) fn array(v: Value) -> Result<Vec<Value>, StoreError> {
    match v {
        Value::Array(items) | Value::Set(items) => Ok(items),
        Value::Nil => Ok(Vec::new()),
        _ => Err(corrupt("expected an array reply")),
    }
}

pub(crate) fn bytes(v: Option<Value>) -> Result<Vec<u8>, StoreError> {
    match v {
        Some(Value::BulkString(b)) => Ok(b),
        Some(Value::SimpleString(s)) => Ok(s.into_bytes()),
        Some(Value::Okay) => Ok(b"OK".to_vec()),
        _ => Err(corrupt("expected a string in the reply")),
    }
}

pub(crate) fn tag(v: Option<Value>) -> Result<Vec<u8>, StoreError> {
    bytes(v)
}

pub(crate) fn int(v: Option<Value>) -> Result<i64, StoreError> {
    match v {
        Some(Value::Int(i)) => Ok(i),
        Some(Value::BulkString(b)) => std::str::from_utf8(&b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| corrupt("expected an integer in the reply")),
        _ => Err(corrupt("expected an integer in the reply")),
    }
}

pub(crate) fn fence(v: Option<Value>) -> Result<Fence, StoreError> {
    let i = int(v)?;
    // The scripts compute fences in Lua numbers (doubles): exact below 2^53.
    Fence::try_from(i)
        .ok()
        .filter(|f| *f > 0 && *f < (1 << 53) - 1)
        .ok_or_else(|| corrupt("fence out of range"))
}

pub(crate) fn millis(v: Option<Value>) -> Result<Duration, StoreError> {
    let i = int(v)?;
    Ok(Duration::from_millis(u64::try_from(i).unwrap_or(0)))
}

pub(crate) fn state_byte(v: Option<Value>) -> Result<u8, StoreError> {
    match bytes(v)?.as_slice() {
        [s @ (b'i' | b'c' | b'r')] => Ok(*s),
        _ => Err(corrupt("unknown record state")),
    }
}

pub(crate) fn fingerprint(b: &[u8]) -> Result<Fingerprint, StoreError> {
    <[u8; 32]>::try_from(b)
        .map(Fingerprint)
        .map_err(|_| corrupt("fingerprint is not 32 bytes"))
}

pub(crate) fn outcome(kind: &[u8], body: Vec<u8>) -> Result<StoredOutcome, StoreError> {
    match kind {
        b"r" => Ok(StoredOutcome::Response(Bytes::from(body))),
        b"n" => Ok(StoredOutcome::NotRetained),
        _ => Err(corrupt("unknown outcome kind")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_of_the_wrong_shape_are_corrupt_not_panics() {
        assert!(matches!(array(Value::Int(3)), Err(StoreError::Corrupt(_))));
        assert!(matches!(bytes(None), Err(StoreError::Corrupt(_))));
        assert!(matches!(
            fence(Some(Value::Int(0))),
            Err(StoreError::Corrupt(_))
        ));
        assert!(matches!(
            fence(Some(Value::Int(-4))),
            Err(StoreError::Corrupt(_))
        ));
        assert!(matches!(
            int(Some(Value::BulkString(b"x1".to_vec()))),
            Err(StoreError::Corrupt(_))
        ));
        assert!(matches!(
            state_byte(Some(Value::BulkString(b"z".to_vec()))),
            Err(StoreError::Corrupt(_))
        ));
        assert!(matches!(fingerprint(&[1, 2]), Err(StoreError::Corrupt(_))));
        assert!(matches!(outcome(b"?", vec![]), Err(StoreError::Corrupt(_))));
        assert_eq!(fence(Some(Value::Int(7))).ok(), Some(7));
        assert_eq!(millis(Some(Value::Int(-5))).ok(), Some(Duration::ZERO));
    }

    #[test]
    fn decimals_and_hex_match_fmt() {
        for n in [0u64, 7, 10, 999, 1_764_651_234_567_890, u64::MAX] {
            assert_eq!(Decimal::new(n).as_bytes(), n.to_string().as_bytes());
        }
        let mut s = String::new();
        push_hex(&mut s, &0x0123_4567_89ab_cdef_u64.to_be_bytes());
        assert_eq!(s, format!("{:016x}", 0x0123_4567_89ab_cdef_u64));
        // Lengths around the 32-byte chunks it writes in, appended to what is there.
        for len in [0usize, 1, 31, 32, 33, 64, 65] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
            let mut s = String::from("p{");
            push_hex(&mut s, &bytes);
            let want: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(s, format!("p{{{want}"), "{len} bytes");
        }
    }

    #[test]
    fn client_errors_map_to_unavailable_or_corrupt() {
        let e = |kind, what: &'static str| map_error(RedisError::from((kind, what)));
        assert!(matches!(
            e(ErrorKind::Io, "reset"),
            StoreError::Unavailable(_)
        ));
        assert!(matches!(
            e(ErrorKind::Server(ServerErrorKind::BusyLoading), "loading"),
            StoreError::Unavailable(_)
        ));
        assert!(matches!(
            e(ErrorKind::Server(ServerErrorKind::ReadOnly), "replica"),
            StoreError::Unavailable(_)
        ));
        assert!(matches!(
            e(ErrorKind::AuthenticationFailed, "auth"),
            StoreError::Unavailable(_)
        ));
        assert!(matches!(
            e(ErrorKind::UnexpectedReturnType, "type"),
            StoreError::Corrupt(_)
        ));
        let io = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(matches!(map_error(io), StoreError::Unavailable(_)));
    }
}
