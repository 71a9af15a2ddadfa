//! The proto decides what is protected (issue 29), through both layers with real tonic
//! servers and clients on 127.0.0.1: the issue's three typos are refused by the
//! server's `check()` and the client's `build()`; a key sent to a side-effecting method
//! that has no config entry is honoured.
//!
//! The shop proto's methods carry no `idempotency_level`, so the descriptors here are
//! built in code with the levels a real `orders.proto` would declare.

use std::sync::Arc;
use std::time::Duration;

use idem_client::retry::{BuildError, RetryLayer};
use idem_core::config::ServiceConfig;
use idem_core::descriptor::{Descriptors, IdempotencyLevel, Streaming};
use idem_server::idempotency::{CheckError, IdempotencyLayer};
use idem_store::memory::MemoryStore;
use idem_test_support::net;
use idem_test_support::shop::GetOrderRequest;
use idem_test_support::shop::orders_client::OrdersClient;
use idem_test_support::shop::orders_server::OrdersServer;
use idem_test_support::shop_fake::{Shop, keyed_create};
use tonic::transport::Server;

fn orders() -> Arc<Descriptors> {
    use IdempotencyLevel::*;
    Arc::new(
        Descriptors::default()
            .with_service(
                "shop.v1.Orders",
                [
                    (
                        "CreateOrder".to_owned(),
                        IdempotencyUnknown,
                        Streaming::Unary,
                    ),
                    ("GetOrder".to_owned(), NoSideEffects, Streaming::Unary),
                    ("ListOrders".to_owned(), NoSideEffects, Streaming::Server),
                ],
            )
            .unwrap(),
    )
}

/// The issue's typos, on the shop service: method, service, field.
const TYPOS: [(&str, &str); 3] = [
    (
        r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders", "method": "CreateOrdr"}], "idempotency": {}}], "idem": {"tenant": {"single": "t"}}}"#,
        "methodConfig[0].name[0]: no method `shop.v1.Orders/CreateOrdr` in the descriptors; did you mean `shop.v1.Orders/CreateOrder`?",
    ),
    (
        r#"{"methodConfig": [{"name": [{"service": "shop.v1.Order", "method": "CreateOrder"}], "idempotency": {}}], "idem": {"tenant": {"single": "t"}}}"#,
        "methodConfig[0].name[0]: no service `shop.v1.Order` in the descriptors; did you mean `shop.v1.Orders/CreateOrder`?",
    ),
    (
        r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}], "idempotence": {}}], "idem": {"tenant": {"single": "t"}}}"#,
        "methodConfig[0].idempotence: unknown field, ignored; did you mean \"idempotency\"?",
    ),
];

#[test]
fn each_typo_is_refused_by_the_servers_check() {
    for (text, expected) in TYPOS {
        let config = ServiceConfig::from_json(text).unwrap();
        // Without descriptors: accepted, and nothing is protected (main's behaviour).
        let plain = IdempotencyLayer::from_config(&config).check().unwrap();
        assert!(
            plain
                .config()
                .lookup("shop.v1.Orders", "CreateOrder")
                .is_none_or(|m| m.idempotency().is_none())
        );

        let err = IdempotencyLayer::from_config(&config)
            .descriptors(orders())
            .check()
            .unwrap_err();
        assert!(matches!(err, CheckError::Descriptors(_)), "{err}");
        assert!(err.to_string().contains(expected), "{err}");
    }
}

#[test]
fn each_typo_is_refused_by_the_clients_build() {
    for (text, expected) in TYPOS {
        let config = ServiceConfig::from_json(text).unwrap();
        assert!(
            RetryLayer::builder()
                .service_config(config.clone())
                .build()
                .is_ok()
        );
        let err = RetryLayer::builder()
            .service_config(config)
            .descriptors(orders())
            .build()
            .unwrap_err();
        assert!(matches!(err, BuildError::Descriptors(_)), "{err}");
        assert!(err.to_string().contains(expected), "{err}");
    }
}

#[test]
fn a_reload_that_does_not_match_the_descriptors_is_refused() {
    let ok = ServiceConfig::from_json(r#"{"idem": {"tenant": {"single": "t"}}}"#).unwrap();
    let layer = IdempotencyLayer::from_config(&ok)
        .descriptors(orders())
        .check()
        .unwrap();
    let typo = ServiceConfig::from_json(TYPOS[0].0).unwrap();
    let err = layer.reload(&typo).unwrap_err();
    assert!(matches!(err, CheckError::Descriptors(_)), "{err}");
    // The layer keeps the config it had: CreateOrder protected by its level.
    let kept = layer.config();
    assert!(
        kept.lookup("shop.v1.Orders", "CreateOrder")
            .unwrap()
            .idempotency()
            .is_some()
    );
}

/// A server with `layer` over a fresh `Shop`.
async fn serve(layer: IdempotencyLayer<MemoryStore>) -> (Shop, std::net::SocketAddr) {
    let shop = Shop::new();
    let (addr, incoming) = net::bind().await;
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(OrdersServer::new(shop.clone()))
            .serve_with_incoming(incoming),
    );
    (shop, addr)
}

/// No methodConfig at all: only the tenant.
const BARE: &str = r#"{"idem": {"tenant": {"single": "t"}}}"#;

#[tokio::test]
async fn a_key_sent_to_an_unconfigured_side_effecting_method_is_replayed() {
    let config = ServiceConfig::from_json(BARE).unwrap();
    let layer = IdempotencyLayer::from_config(&config)
        .descriptors(orders())
        .check()
        .unwrap();
    let (shop, addr) = serve(layer).await;
    let mut client = OrdersClient::new(net::channel(addr));
    let first = client
        .create_order(keyed_create(
            "intent-0001-charge",
            "",
            Duration::from_secs(30),
        ))
        .await
        .unwrap();
    let second = client
        .create_order(keyed_create(
            "intent-0001-charge",
            "",
            Duration::from_secs(30),
        ))
        .await
        .unwrap();
    assert_eq!(shop.runs(), 1, "the second call is a replay");
    assert!(!idem_client::is_replayed(&first));
    assert!(idem_client::is_replayed(&second));
    assert_eq!(first.get_ref(), second.get_ref());
    // Key optional: a call without one passes through (and runs).
    let mut plain = tonic::Request::new(idem_test_support::shop_fake::create("sku-1"));
    plain.set_timeout(Duration::from_secs(30));
    client.create_order(plain).await.unwrap();
    assert_eq!(shop.runs(), 2);
    // A read needs no key and is not recorded.
    client
        .get_order(GetOrderRequest {
            order_id: "o".into(),
        })
        .await
        .unwrap();
    client
        .get_order(GetOrderRequest {
            order_id: "o".into(),
        })
        .await
        .unwrap();
    assert_eq!(shop.runs(), 4);
}

#[tokio::test]
async fn without_descriptors_the_same_key_runs_twice() {
    // main's behaviour, kept: the WARN and the metric say so (tests/key_ignored.rs).
    let config = ServiceConfig::from_json(BARE).unwrap();
    let (shop, addr) = serve(IdempotencyLayer::from_config(&config).check().unwrap()).await;
    let mut client = OrdersClient::new(net::channel(addr));
    for _ in 0..2 {
        client
            .create_order(keyed_create(
                "intent-0001-charge",
                "",
                Duration::from_secs(30),
            ))
            .await
            .unwrap();
    }
    assert_eq!(shop.runs(), 2);
}

#[tokio::test]
async fn the_client_keys_side_effecting_methods_by_their_level() {
    // Both sides from one config with no idempotency object: the client generates a key
    // for CreateOrder (protected by its level), so the server records it.
    let config = ServiceConfig::from_json(
        r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders"}], "retryPolicy": {
            "maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.1s",
            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}],
            "idem": {"tenant": {"single": "t"}}}"#,
    )
    .unwrap();
    let server = IdempotencyLayer::from_config(&config)
        .descriptors(orders())
        .check()
        .unwrap();
    let stats = server.stats();
    let (shop, addr) = serve(server).await;
    let retry = RetryLayer::builder()
        .service_config(config)
        .descriptors(orders())
        .build()
        .unwrap();
    let mut client = OrdersClient::new(
        tower::ServiceBuilder::new()
            .layer(retry)
            .service(net::channel(addr)),
    );
    let mut req = tonic::Request::new(idem_test_support::shop_fake::create("sku-1"));
    req.set_timeout(Duration::from_secs(30));
    client.create_order(req).await.unwrap();
    client
        .get_order(GetOrderRequest {
            order_id: "o".into(),
        })
        .await
        .unwrap();
    assert_eq!(shop.runs(), 2);
    let s = stats.snapshot();
    assert_eq!(
        s.executed, 1,
        "CreateOrder carried a key and was recorded: {s:?}"
    );
}
