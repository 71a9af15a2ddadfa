//! Cost of hostile request bodies through the idempotency layer, as a ratio to a normal
//! 4 MiB request measured in the same run.
//!
//! `cargo bench -p idem-server --bench hostile` (release). Each row times the layer
//! (`Idempotency` over a `MemoryStore` and a handler that answers at once) on one body;
//! the "before" column times, on the same bodies, the de-framer the layer used before
//! its work was bounded (a decoder and a `Bytes` per message, then the hash), kept here
//! as a copy for comparison.

use std::convert::Infallible;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use http::{HeaderValue, Request, Response};
use http_body_util::Full;
use idem_core::config::{
    Compression, CompressionSet, IdemSettings, IdempotencyPolicy, MethodConfig, ServiceConfig,
};
use idem_server::idempotency::{IdempotencyLayer, tenant::SingleTenant};
use idem_store::memory::MemoryStore;
use idem_test_support::deflate::empty_fixed_blocks;
use sha2::{Digest, Sha256};
use tonic::body::Body;
use tower::{Layer, Service, ServiceExt};

const MIB4: usize = 4 * 1024 * 1024;
const PATH: &str = "/shop.v1.Orders/CreateOrder";

fn frame(flag: u8, msg: &[u8]) -> Vec<u8> {
    let mut v = vec![flag];
    v.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    v.extend_from_slice(msg);
    v
}

/// `frame` repeated while the body stays within 4 MiB.
fn repeated(frame: &[u8]) -> Bytes {
    Bytes::from(frame.repeat(MIB4 / frame.len()))
}

const EMPTY_GZIP: [u8; 20] = [
    0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff, 0x03, 0x00, 0, 0, 0, 0, 0, 0, 0, 0,
];
const EMPTY_ZLIB: [u8; 8] = [0x78, 0x9c, 0x03, 0x00, 0, 0, 0, 1];

fn gzip(msg: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(msg).unwrap();
    e.finish().unwrap()
}

/// Text-like bytes that compress about 3:1.
fn text(n: usize) -> Vec<u8> {
    let words = [
        &b"order "[..],
        b"sku-1234 ",
        b"quantity ",
        b"customer ",
        b"note ",
    ];
    let mut x = 0x9e37_79b9u32;
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        v.extend_from_slice(words[x as usize % words.len()]);
        v.push(b'0' + (x >> 8) as u8 % 10);
    }
    v.truncate(n);
    v
}

/// A protobuf message of exactly `n` bytes (`n` ≥ 3): field 1, text-like bytes.
fn message(n: usize) -> Vec<u8> {
    let varint_len = |v: usize| (usize::BITS - (v | 1).leading_zeros()).div_ceil(7) as usize;
    let mut payload = n - 2;
    while 1 + varint_len(payload) + payload > n {
        payload -= 1;
    }
    let mut v = vec![0x0a];
    let mut len = payload;
    while len >= 0x80 {
        v.push(len as u8 | 0x80);
        len >>= 7;
    }
    v.push(len as u8);
    v.extend_from_slice(&text(payload));
    assert_eq!(v.len(), n);
    v
}

/// The de-framer before: a decoder per message, a `Bytes` per message, then the hash.
fn before(body: &Bytes, encoding: Option<&[u8]>, max: usize) -> Result<[u8; 32], String> {
    let mut b = body.clone();
    let mut out = Vec::new();
    let mut total = 0usize;
    while b.has_remaining() {
        if b.remaining() < 5 {
            return Err("truncated".into());
        }
        let flag = b.get_u8();
        let len = b.get_u32() as usize;
        if len > b.remaining() {
            return Err("truncated".into());
        }
        let raw = b.split_to(len);
        let msg = match flag {
            0 => raw,
            1 => {
                let limit = (max.saturating_sub(total) as u64).saturating_add(1);
                let mut o = Vec::new();
                match encoding {
                    Some(b"gzip") => flate2::read::GzDecoder::new(&raw[..])
                        .take(limit)
                        .read_to_end(&mut o),
                    Some(b"deflate") => flate2::read::ZlibDecoder::new(&raw[..])
                        .take(limit)
                        .read_to_end(&mut o),
                    _ => return Err("unsupported".into()),
                }
                .map_err(|e| e.to_string())?;
                if o.len() as u64 >= limit {
                    return Err("too large".into());
                }
                Bytes::from(o)
            }
            _ => return Err("flag".into()),
        };
        total += msg.len();
        if total > max {
            return Err("too large".into());
        }
        out.push(msg);
    }
    let mut h = Sha256::new();
    h.update(b"idem-fp-v1");
    for m in &out {
        h.update((m.len() as u64).to_be_bytes());
        h.update(m);
    }
    Ok(h.finalize().into())
}

struct Case {
    name: &'static str,
    body: Bytes,
    encoding: Option<&'static str>,
    policy: IdempotencyPolicy,
}

fn policy(accept: &[Compression], max_frames: usize) -> IdempotencyPolicy {
    IdempotencyPolicy {
        accept_compressed: accept.iter().copied().collect::<CompressionSet>(),
        max_request_frames: max_frames,
        ..IdempotencyPolicy::default()
    }
}

/// Median wall time of one call of `f` over `runs`.
fn median(runs: usize, mut f: impl FnMut()) -> Duration {
    let mut t: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    t.sort();
    t[runs / 2]
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let gz = [Compression::Gzip];
    let zl = [Compression::Deflate];
    let unlimited = usize::MAX;
    let default_frames = IdempotencyPolicy::default().max_request_frames;
    let bomb = {
        // 1 GiB of zeros is about 1 MiB of gzip.
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..1024 {
            e.write_all(&zeros).unwrap();
        }
        Bytes::from(frame(1, &e.finish().unwrap()))
    };
    let cases = vec![
        Case {
            name: "normal 4 MiB, one plain message (baseline)",
            body: Bytes::from(frame(0, &message(MIB4 - 5))),
            encoding: None,
            policy: policy(&[], default_frames),
        },
        Case {
            name: "normal 4 MiB decompressed, one gzip message",
            body: Bytes::from(frame(1, &gzip(&message(MIB4 - 64)))),
            encoding: Some("gzip"),
            policy: policy(&gz, default_frames),
        },
        Case {
            name: "gzip empty members, maxRequestFrames default",
            body: repeated(&frame(1, &EMPTY_GZIP)),
            encoding: Some("gzip"),
            policy: policy(&gz, default_frames),
        },
        Case {
            name: "gzip empty members, exactly maxRequestFrames (1.6 MiB)",
            body: Bytes::from(frame(1, &EMPTY_GZIP).repeat(default_frames)),
            encoding: Some("gzip"),
            policy: policy(&gz, default_frames),
        },
        Case {
            name: "gzip empty members, frames unlimited",
            body: repeated(&frame(1, &EMPTY_GZIP)),
            encoding: Some("gzip"),
            policy: policy(&gz, unlimited),
        },
        Case {
            name: "deflate empty streams, maxRequestFrames default",
            body: repeated(&frame(1, &EMPTY_ZLIB)),
            encoding: Some("deflate"),
            policy: policy(&zl, default_frames),
        },
        Case {
            name: "deflate empty streams, frames unlimited",
            body: repeated(&frame(1, &EMPTY_ZLIB)),
            encoding: Some("deflate"),
            policy: policy(&zl, unlimited),
        },
        Case {
            name: "uncompressed empty frames, maxRequestFrames default",
            body: repeated(&frame(0, b"")),
            encoding: None,
            policy: policy(&[], default_frames),
        },
        Case {
            name: "uncompressed empty frames, frames unlimited",
            body: repeated(&frame(0, b"")),
            encoding: None,
            policy: policy(&[], unlimited),
        },
        Case {
            name: "gzip bomb (1 MiB -> 1 GiB)",
            body: bomb,
            encoding: Some("gzip"),
            policy: policy(&gz, default_frames),
        },
        Case {
            name: "gzip empty members, gzip not accepted",
            body: repeated(&frame(1, &EMPTY_GZIP)),
            encoding: Some("gzip"),
            policy: policy(&[], default_frames),
        },
        Case {
            name: "deflate, one message of empty fixed blocks",
            body: Bytes::from(frame(1, &empty_fixed_blocks((MIB4 - 64) * 8 / 10))),
            encoding: Some("deflate"),
            policy: policy(&zl, default_frames),
        },
    ];

    let runs = std::env::var("HOSTILE_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    println!(
        "| body (4 MiB unless noted) | before: ms | before: × normal | after: ms | after: × normal | after: answer |"
    );
    println!("|---|---:|---:|---:|---:|---|");
    let (mut before_base, mut after_base) = (None, None);
    for (i, case) in cases.iter().enumerate() {
        let b = median(runs, || {
            let _ =
                std::hint::black_box(before(&case.body, case.encoding.map(str::as_bytes), MIB4));
        });
        let (after, answer) = rt.block_on(through_layer(case, runs, i));
        let before_base = *before_base.get_or_insert(b);
        let after_base = *after_base.get_or_insert(after);
        println!(
            "| {} | {:.2} | {:.1} | {:.2} | {:.2} | {} |",
            case.name,
            ms(b),
            ms(b) / ms(before_base),
            ms(after),
            ms(after) / ms(after_base),
            answer
        );
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Median time of one call through the layer, and the gRPC answer it gave.
async fn through_layer(case: &Case, runs: usize, n: usize) -> (Duration, String) {
    let config = ServiceConfig::from_parts(
        vec![
            MethodConfig::empty()
                .with_name("shop.v1.Orders", "CreateOrder")
                .with_idempotency(case.policy.clone()),
        ],
        None,
        IdemSettings::default(),
    )
    .unwrap();
    let layer =
        IdempotencyLayer::new(MemoryStore::default(), &config).tenant(SingleTenant::new("t"));
    let handler = tower::service_fn(|_req: Request<Body>| async {
        let mut r = Response::new(Body::empty());
        r.headers_mut()
            .insert("grpc-status", HeaderValue::from_static("0"));
        Ok::<_, Infallible>(r)
    });
    let mut svc = layer.layer(handler);
    let mut times = Vec::with_capacity(runs);
    let mut answer = String::new();
    for run in 0..runs {
        let mut req = Request::new(Body::new(Full::new(case.body.clone())));
        *req.uri_mut() = PATH.parse().unwrap();
        *req.method_mut() = http::Method::POST;
        let h = req.headers_mut();
        h.insert("content-type", HeaderValue::from_static("application/grpc"));
        let key = format!("bench-key-{n:04}-{run:04}");
        h.insert("x-idempotency-key", key.parse().unwrap());
        if let Some(e) = case.encoding {
            h.insert("grpc-encoding", HeaderValue::from_static(e));
        }
        let start = Instant::now();
        let resp = svc.ready().await.unwrap().call(req).await.unwrap();
        times.push(start.elapsed());
        let status = resp
            .headers()
            .get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<i32>().ok())
            .map_or(tonic::Code::Ok, tonic::Code::from_i32);
        answer = format!("{status:?}");
    }
    times.sort();
    (times[runs / 2], answer)
}
