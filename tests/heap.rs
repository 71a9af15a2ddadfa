//! What protected calls hold on the heap, counted by a global allocator that tracks live
//! bytes (issue 30 item 3): a waiting duplicate holds its fingerprint, not its request,
//! and an in-flight protected call holds no more than the bare service's.
//!
//! The one test runs alone in this binary, on one thread with the clock paused, so the
//! counts are of its own calls. Counts, never timings.

use std::alloc::System;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use idem::core::config::{IdempotencyPolicy, MethodConfig, ServiceConfig};
use idem::server::idempotency::{IdempotencyLayer, tenant::SingleTenant};
use idem::store::memory::MemoryStore;
use idem_test_support::shop::orders_server::OrdersServer;
use idem_test_support::shop_fake::{Shop, create};
use prost::Message;
use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};
use tonic::body::Body;
use tower::{Service, ServiceExt};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Live heap bytes. `stats_alloc` counts a `realloc`'s growth (or shrink) in
/// `bytes_allocated` (or `bytes_deallocated`) already.
fn live() -> isize {
    let s = GLOBAL.stats();
    s.bytes_allocated as isize - s.bytes_deallocated as isize
}

const KEY: &str = "heap-key-0001";
const MIB: usize = 1024 * 1024;

/// A 1 MiB `CreateOrder` for the gated item, gRPC-framed once; every request shares it.
fn body() -> Bytes {
    let mut msg = create("gate");
    msg.customer_id = "c".repeat(MIB);
    let enc = msg.encode_to_vec();
    let mut b = BytesMut::new();
    b.put_u8(0);
    b.put_u32(enc.len() as u32);
    b.put_slice(&enc);
    b.freeze()
}

fn request(body: &Bytes, key: &str) -> http::Request<Body> {
    http::Request::builder()
        .method("POST")
        .uri("http://localhost/shop.v1.Orders/CreateOrder")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("x-idempotency-key", key)
        .body(Body::new(Full::new(body.clone())))
        .unwrap()
}

async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
}

/// Live heap bytes per call while one gated call per key runs on `svc` (whose shop is
/// `shop`).
async fn per_call<S>(svc: &S, shop: &Shop, keys: &[String], body: &Bytes) -> isize
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug + Send,
{
    settle().await;
    let before = live();
    let tasks: Vec<_> = keys
        .iter()
        .map(|k| {
            let svc = svc.clone();
            let req = request(body, k);
            tokio::spawn(async move {
                let resp = svc.oneshot(req).await.unwrap();
                let _ = resp.into_body().collect().await;
            })
        })
        .collect();
    while shop.runs() < keys.len() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    settle().await;
    let held = (live() - before) / keys.len() as isize;
    shop.open_gate(keys.len());
    for t in tasks {
        t.await.unwrap();
    }
    held
}

#[tokio::test(start_paused = true)]
async fn a_waiting_duplicate_holds_no_copy_of_its_request_and_a_run_no_more_than_bare_tonic() {
    let body = body();
    let config = ServiceConfig::from_parts(
        vec![
            MethodConfig::empty()
                .with_name("shop.v1.Orders", "CreateOrder")
                .with_idempotency(IdempotencyPolicy::default()),
        ],
        None,
        Default::default(),
    )
    .unwrap();
    let layer =
        IdempotencyLayer::new(MemoryStore::default(), &config).tenant(SingleTenant::new("t"));
    let stats = layer.stats();

    // Waiting duplicates: one gated run, then 16 duplicates of it.
    let shop = Shop::new();
    let svc = tower::Layer::layer(&layer, OrdersServer::new(shop.clone()));
    let first = tokio::spawn(svc.clone().oneshot(request(&body, KEY)));
    shop.started().await;
    settle().await;
    let before = live();
    let n = 16;
    let dups: Vec<_> = (0..n)
        .map(|_| tokio::spawn(svc.clone().oneshot(request(&body, KEY))))
        .collect();
    while stats.snapshot().waited < n as u64 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    settle().await;
    let per_waiter = (live() - before) / n as isize;
    shop.open_gate(1);
    let _ = first.await.unwrap().unwrap().into_body().collect().await;
    for d in dups {
        let _ = d.await.unwrap().unwrap().into_body().collect().await;
    }
    eprintln!(
        "heap per waiting duplicate of a {} B request: {per_waiter} B",
        body.len()
    );
    assert!(
        per_waiter <= 64 * 1024,
        "a waiting duplicate holds {per_waiter} B (its request is {} B)",
        body.len()
    );

    // In-flight runs: protected against the bare service, 8 each.
    let keys: Vec<String> = (0..8).map(|i| format!("heap-run-{i:04}")).collect();
    let bare_shop = Shop::new();
    let bare = OrdersServer::new(bare_shop.clone());
    let bare_per_call = per_call(&bare, &bare_shop, &keys, &body).await;
    let shop = Shop::new();
    let svc = tower::Layer::layer(&layer, OrdersServer::new(shop.clone()));
    let protected_per_call = per_call(&svc, &shop, &keys, &body).await;
    let ratio = protected_per_call as f64 / bare_per_call as f64;
    eprintln!(
        "heap per in-flight call of a {} B request: protected {protected_per_call} B, bare {bare_per_call} B, ratio {ratio:.3}",
        body.len()
    );
    assert!(
        ratio <= 1.5,
        "protected {protected_per_call} B against bare {bare_per_call} B"
    );
}
