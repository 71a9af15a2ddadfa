//! What a plain `tracing_subscriber::fmt()` prints for idem's calls. Alone in its test
//! binary: a subscriber set per thread (`set_default`) shares tracing's global callsite
//! interest with every other test of the binary, which made this one flaky beside them.

use std::time::Duration;

use idem_client::retry::RetryLayer;
use idem_server::idempotency::IdempotencyLayer;
use idem_store::memory::MemoryStore;
use idem_test_support::logs::Sink;
use idem_test_support::net;
use idem_test_support::shop::orders_client::OrdersClient;

mod support;
use support::{config, keyed, serve};

/// One INFO line per protected call, with its outcome, record and status, inside a span
/// with the RPC attributes; the client's span has attempts, delay and stop reason; no
/// raw key anywhere.
#[tokio::test]
async fn logs_tell_the_story_without_keys() {
    let sink = Sink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let cfg = config(false);
    let addr = serve(IdempotencyLayer::new(MemoryStore::default(), &cfg), 1).await;
    let layer = RetryLayer::builder()
        .service_config(cfg.clone())
        .seed(1)
        .build()
        .unwrap();
    let mut c = OrdersClient::new(tower::Layer::layer(&layer, net::channel(addr)));
    let key = "key-log-0123456789";
    c.create_order(keyed("a", key))
        .await
        .expect("ok after a retry");
    let mut raw = OrdersClient::new(net::channel(addr));
    raw.create_order(keyed("a", key)).await.expect("replay");
    let mut lines = Vec::new();
    for _ in 0..200 {
        let text = sink.text();
        lines = text.lines().map(str::to_owned).collect::<Vec<_>>();
        if lines
            .iter()
            .filter(|l| l.contains("idempotent call"))
            .count()
            == 2
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let calls: Vec<_> = lines
        .iter()
        .filter(|l| l.contains("idempotent call"))
        .collect();
    assert_eq!(calls.len(), 2, "{lines:#?}");
    assert!(calls[0].contains(" INFO "), "{}", calls[0]);
    for want in [
        "rpc.system=\"grpc\"",
        "rpc.service=\"shop.v1.Orders\"",
        "rpc.method=\"CreateOrder\"",
        "outcome=\"executed\"",
        "record=\"stored\"",
        "grpc.status=\"OK\"",
    ] {
        assert!(calls[0].contains(want), "{want} in {}", calls[0]);
    }
    assert!(calls[1].contains("outcome=\"replayed\""), "{}", calls[1]);
    let client_span = lines
        .iter()
        .find(|l| l.contains("idem_retry{") && l.contains("close"))
        .unwrap_or_else(|| panic!("{lines:#?}"));
    for want in [
        "attempts=2",
        "retry_delay_ms=",
        "outcome=\"committed\"",
        "rpc.service=\"shop.v1.Orders\"",
        "rpc.method=\"CreateOrder\"",
    ] {
        assert!(client_span.contains(want), "{want} in {client_span}");
    }
    assert!(
        lines.iter().all(|l| !l.contains(key)),
        "a raw key was logged"
    );
}
