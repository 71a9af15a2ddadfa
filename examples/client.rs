//! A client of the example server that shows idem at work.
//!
//! ```text
//! cargo run --example server &
//! cargo run --example client                       # or: -- --addr http://127.0.0.1:50051
//! ```
//!
//! It creates an order, sends the same intent again (the server replays the stored
//! response: one order, not two), reuses the key for a different request (refused), and
//! reads the orders back. The retry layer reads `examples/service_config.json`.

use idem::client::{
    retry::{CallReport, RetryLayer},
    with_key,
};
use idem::core::{config::ServiceConfig, key::IdempotencyKey};
use tonic::Request;
use tower::ServiceBuilder;

// The code generated from proto/shop/v1/orders.proto (in your project: your own
// `tonic::include_proto!`).
use idem_test_support::shop;
use shop::orders_client::OrdersClient;
use shop::{CreateOrderRequest, ListOrdersRequest};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut addr = "http://127.0.0.1:50051".to_owned();
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--addr", Some(a)) => addr = a,
            _ => return Err(format!("usage: client [--addr http://HOST:PORT]; got {flag}").into()),
        }
    }
    let config = ServiceConfig::from_file(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/service_config.json"
    ))?;
    let channel = tonic::transport::Endpoint::from_shared(addr)?
        .connect()
        .await?;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::from_config(&config))
        .service(channel);
    let mut client = OrdersClient::new(svc);

    let intent = CreateOrderRequest {
        customer_id: "alice".into(),
        sku: "sku-42".into(),
        quantity: 2,
        note: "birthday".into(),
    };
    // One business intent, one key.
    let key = IdempotencyKey::generate();
    println!("key {key}");

    for attempt in ["first call", "same intent again"] {
        let mut req = Request::new(intent.clone());
        with_key(&mut req, &key);
        let res = client.create_order(req).await?;
        let replayed = res.metadata().get("x-idempotency-replayed").is_some();
        let report = CallReport::from_response(&res);
        println!(
            "{attempt}: {} (replayed: {replayed}, attempts: {:?})",
            res.get_ref().order_id,
            report.map(|r| r.attempts)
        );
    }

    let mut other = Request::new(CreateOrderRequest {
        quantity: 3,
        ..intent.clone()
    });
    with_key(&mut other, &key);
    match client.create_order(other).await {
        Ok(o) => println!("unexpected: {:?}", o.into_inner()),
        Err(s) => println!(
            "same key, different request: {:?}: {}",
            s.code(),
            s.message()
        ),
    }

    let mut stream = client
        .list_orders(ListOrdersRequest {
            customer_id: "alice".into(),
        })
        .await?
        .into_inner();
    let mut n = 0;
    while let Some(order) = stream.message().await? {
        n += 1;
        println!(
            "alice has {} ({} x {})",
            order.order_id, order.quantity, order.sku
        );
    }
    println!("{n} order(s) for this and earlier runs; one per key");
    Ok(())
}
