//! The tiny blocking RESP client of the harness: a command out, a [`RedisReply`] back.

use std::io::{BufRead, Write};
use std::net::TcpStream;
use std::time::Duration;

/// A connection to the server on 127.0.0.1:`port`, with a 5 s read timeout.
pub(crate) fn connect(port: u16) -> Result<TcpStream, String> {
    let s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    Ok(s)
}

/// A reply of the tiny RESP client (RESP2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisReply {
    /// A simple string (`+OK`).
    Simple(String),
    /// An error (`-ERR …`).
    Error(String),
    /// An integer (`:1`).
    Int(i64),
    /// A bulk string, `None` for nil.
    Bulk(Option<Vec<u8>>),
    /// An array, `None` for nil.
    Array(Option<Vec<RedisReply>>),
}

impl RedisReply {
    /// The reply as text: strings as they are, integers in decimal, arrays joined with
    /// spaces, nils empty.
    pub fn text(&self) -> String {
        match self {
            RedisReply::Simple(s) | RedisReply::Error(s) => s.clone(),
            RedisReply::Int(i) => i.to_string(),
            RedisReply::Bulk(Some(b)) => String::from_utf8_lossy(b).into_owned(),
            RedisReply::Bulk(None) | RedisReply::Array(None) => String::new(),
            RedisReply::Array(Some(items)) => items
                .iter()
                .map(RedisReply::text)
                .collect::<Vec<_>>()
                .join(" "),
        }
    }

    /// A bulk string reply as text, `None` for a nil one; panics with `what` and the
    /// reply on any other.
    pub fn bulk(self, what: &str) -> Option<String> {
        match self {
            RedisReply::Bulk(Some(b)) => Some(String::from_utf8_lossy(&b).into_owned()),
            RedisReply::Bulk(None) => None,
            other => panic!("{what}: {other:?}"),
        }
    }
}

/// Sends the command `args` on `w` and reads its reply from `r`.
pub(crate) fn round_trip<A: AsRef<[u8]>>(
    w: &mut impl Write,
    r: &mut impl BufRead,
    args: &[A],
) -> Result<RedisReply, String> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        let a = a.as_ref();
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    w.write_all(&out).map_err(|e| e.to_string())?;
    read_reply(r)
}

fn read_line(r: &mut impl BufRead) -> Result<String, String> {
    let mut line = String::new();
    let n = r.read_line(&mut line).map_err(|e| e.to_string())?;
    if n == 0 {
        return Err("connection closed".into());
    }
    Ok(line.trim_end_matches(['\r', '\n']).to_owned())
}

fn read_reply(r: &mut impl BufRead) -> Result<RedisReply, String> {
    let line = read_line(r)?;
    let (kind, rest) = line.split_at(line.len().min(1));
    let num = || {
        rest.parse::<i64>()
            .map_err(|e| format!("bad RESP length {rest:?}: {e}"))
    };
    Ok(match kind {
        "+" => RedisReply::Simple(rest.to_owned()),
        "-" => RedisReply::Error(rest.to_owned()),
        ":" => RedisReply::Int(num()?),
        "$" => {
            let n = num()?;
            if n < 0 {
                RedisReply::Bulk(None)
            } else {
                let mut buf = vec![0; n as usize + 2];
                r.read_exact(&mut buf).map_err(|e| e.to_string())?;
                buf.truncate(n as usize);
                RedisReply::Bulk(Some(buf))
            }
        }
        "*" => {
            let n = num()?;
            if n < 0 {
                RedisReply::Array(None)
            } else {
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(read_reply(r)?);
                }
                RedisReply::Array(Some(items))
            }
        }
        _ => return Err(format!("unexpected RESP line {line:?}")),
    })
}
