//! Without descriptors, a key sent to a method the server does not protect is ignored,
//! but never silently: one WARN per method naming the fix, and the outcome metric's
//! `passthrough` with reason `KEY_IGNORED` on every such call (issue 29).
//!
//! Alone in its binary: it asserts on a log line (see `idem_test_support::logs`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::config::ServiceConfig;
use idem_core::descriptor::{Descriptors, IdempotencyLevel, Streaming};
use idem_server::idempotency::IdempotencyLayer;
use idem_server::metrics::{KEY_IGNORED, ProtectedCallEnded, ServerObserver};
use idem_test_support::logs::Sink;
use idem_test_support::net;
use idem_test_support::shop::GetOrderRequest;
use idem_test_support::shop::orders_client::OrdersClient;
use idem_test_support::shop::orders_server::OrdersServer;
use idem_test_support::shop_fake::{Shop, keyed_create};
use tonic::transport::Server;

type Heard = (String, &'static str, Option<&'static str>);

#[derive(Clone, Default)]
struct Outcomes(Arc<Mutex<Vec<Heard>>>);

impl ServerObserver for Outcomes {
    fn call_ended(&self, call: &ProtectedCallEnded<'_>) {
        let entry = (call.method.to_owned(), call.outcome, call.reason);
        self.0.lock().unwrap().push(entry);
    }
}

async fn run(layer: IdempotencyLayer<idem_store::memory::MemoryStore>) -> Shop {
    let shop = Shop::new();
    let (addr, incoming) = net::bind().await;
    let server = tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(OrdersServer::new(shop.clone()))
            .serve_with_incoming(incoming),
    );
    let mut client = OrdersClient::new(net::channel(addr));
    for key in ["intent-0001-a", "intent-0001-a", "intent-0002-b"] {
        let req = keyed_create(key, "", Duration::from_secs(30));
        client.create_order(req).await.unwrap();
    }
    let mut read = tonic::Request::new(GetOrderRequest {
        order_id: "o".into(),
    });
    idem_client::with_key(&mut read, &"intent-0003-c".parse().unwrap());
    client.get_order(read).await.unwrap();
    // No key: nothing to say.
    client
        .get_order(GetOrderRequest {
            order_id: "o".into(),
        })
        .await
        .unwrap();
    server.abort();
    shop
}

#[test]
fn a_key_the_server_ignores_is_logged_once_per_method_and_counted() {
    let sink = Sink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();

    // Without descriptors: every keyed call to an unprotected method.
    let config = ServiceConfig::from_json(r#"{"idem": {"tenant": {"single": "t"}}}"#).unwrap();
    let outcomes = Outcomes::default();
    let layer = IdempotencyLayer::from_config(&config).observer(outcomes.clone());
    let shop = rt.block_on(run(layer));
    assert_eq!(
        shop.runs(),
        5,
        "nothing protected: the repeated key ran again"
    );
    let heard = outcomes.0.lock().unwrap().clone();
    let ignored = |m: &str| {
        heard
            .iter()
            .filter(|(method, o, r)| method == m && *o == "passthrough" && *r == Some(KEY_IGNORED))
            .count()
    };
    assert_eq!(ignored("/shop.v1.Orders/CreateOrder"), 3, "{heard:?}");
    assert_eq!(ignored("/shop.v1.Orders/GetOrder"), 1, "{heard:?}");
    assert_eq!(
        heard.iter().filter(|(_, _, r)| r.is_none()).count(),
        1,
        "the unkeyed read"
    );
    let logs = sink.text();
    let warned = |m: &str| {
        logs.lines()
            .filter(|l| l.contains("WARN") && l.contains(m))
            .count()
    };
    assert_eq!(
        warned("method=\"/shop.v1.Orders/CreateOrder\""),
        1,
        "once per method:\n{logs}"
    );
    assert_eq!(warned("method=\"/shop.v1.Orders/GetOrder\""), 1, "{logs}");
    assert!(
        logs.contains("IdempotencyLayer::descriptors"),
        "the fix is named:\n{logs}"
    );

    // With descriptors: CreateOrder is protected, and a key sent to the read (safe to
    // repeat by its level) is no news.
    use IdempotencyLevel::*;
    let d = Descriptors::default()
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
        .unwrap();
    let outcomes = Outcomes::default();
    let before = sink.text().len();
    let layer = IdempotencyLayer::from_config(&config)
        .descriptors(d)
        .observer(outcomes.clone())
        .check()
        .unwrap();
    let shop = rt.block_on(run(layer));
    assert_eq!(shop.runs(), 4, "the repeated key was replayed");
    let heard = outcomes.0.lock().unwrap().clone();
    assert!(
        heard.iter().all(|(_, _, r)| *r != Some(KEY_IGNORED)),
        "{heard:?}"
    );
    assert_eq!(
        heard.iter().filter(|(_, o, _)| *o == "replayed").count(),
        1,
        "{heard:?}"
    );
    let later = &sink.text()[before..];
    assert!(!later.contains("WARN"), "{later}");
}
