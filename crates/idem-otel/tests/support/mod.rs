//! What the metrics and log tests share: the config, a plain Orders service, a server
//! on 127.0.0.1 that fails its first calls on demand, and keyed requests.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem_core::config::ServiceConfig;
use idem_server::idempotency::IdempotencyLayer;
use idem_store::Store;
use idem_test_support::net;
use idem_test_support::shop::{CreateOrderRequest, Order};
use idem_test_support::shop_fake::create_only;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

pub(crate) fn config(throttle: bool) -> ServiceConfig {
    let throttling = if throttle {
        r#","retryThrottling": {"maxTokens": 2, "tokenRatio": 0.1}"#
    } else {
        ""
    };
    ServiceConfig::from_json(&format!(
        r#"{{"methodConfig": [{{
              "name": [{{"service": "shop.v1.Orders", "method": "CreateOrder"}}],
              "retryPolicy": {{"maxAttempts": 5, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
                              "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}},
              "idempotency": {{}}
            }}],
            "idem": {{"tenant": {{"single": "t"}}}}{throttling}}}"#
    ))
    .expect("test config")
}

pub(crate) async fn serve<St: Store>(layer: IdempotencyLayer<St>, fail_first: usize) -> SocketAddr {
    let (addr, incoming) = net::bind().await;
    let seen = Arc::new(AtomicUsize::new(0));
    let faults = tonic::service::InterceptorLayer::new(move |req: Request<()>| {
        if seen.fetch_add(1, Ordering::Relaxed) < fail_first {
            return Err(Status::unavailable("injected"));
        }
        Ok(req)
    });
    tokio::spawn(
        Server::builder()
            .layer(faults)
            .layer(layer)
            .add_service(create_only(|r: Request<CreateOrderRequest>| async move {
                let r = r.into_inner();
                Ok(Response::new(Order {
                    order_id: "o".into(),
                    sku: r.sku,
                    ..Order::default()
                }))
            }))
            .serve_with_incoming(incoming),
    );
    addr
}

pub(crate) fn order(sku: &str) -> CreateOrderRequest {
    CreateOrderRequest {
        customer_id: "c".into(),
        sku: sku.into(),
        quantity: 1,
        note: String::new(),
    }
}

pub(crate) fn keyed(sku: &str, key: &str) -> Request<CreateOrderRequest> {
    let mut r = Request::new(order(sku));
    r.metadata_mut()
        .insert("x-idempotency-key", key.parse().unwrap());
    r
}
