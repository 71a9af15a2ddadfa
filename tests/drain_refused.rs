//! Issue 32: a draining idem server refuses new streams with `RST_STREAM(REFUSED_STREAM)`
//! (`Drain::layer`), and idem's `RetryLayer` sends a refused call again transparently,
//! with no retry policy, to another server: its application saw the call once.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use idem::client::retry::{CallOutcome, CallReport, RetryLayer};
use idem::core::config::ServiceConfig;
use idem::server::drain::Drain;
use idem_test_support::shop::orders_client::OrdersClient;
use idem_test_support::shop::orders_server::OrdersServer;
use idem_test_support::shop_fake::{Shop, create};
use tonic::transport::{Channel, Server};
use tower::{Service, ServiceBuilder, ServiceExt};

/// An instance: a tonic server whose first layer is its drain's, over an `Orders` fake.
async fn instance() -> (Channel, Drain, Shop) {
    let drain = Drain::new();
    let shop = Shop::new();
    let (addr, incoming) = idem_test_support::net::bind().await;
    let router = Server::builder()
        .layer(drain.layer())
        .add_service(OrdersServer::new(shop.clone()));
    tokio::spawn(router.serve_with_incoming(incoming));
    (idem_test_support::net::channel(addr), drain, shop)
}

/// Sends the first request to `first`, every later one to `then`: a load balancer whose
/// pick for the resend is known.
#[derive(Clone)]
struct FirstThen {
    first: Channel,
    then: Channel,
    sent: Arc<AtomicUsize>,
}

type Fut = Pin<
    Box<
        dyn Future<Output = Result<http::Response<tonic::body::Body>, tonic::transport::Error>>
            + Send,
    >,
>;

impl Service<http::Request<tonic::body::Body>> for FirstThen {
    type Response = http::Response<tonic::body::Body>;
    type Error = tonic::transport::Error;
    type Future = Fut;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Fut {
        let to = match self.sent.fetch_add(1, Ordering::SeqCst) {
            0 => self.first.clone(),
            _ => self.then.clone(),
        };
        Box::pin(to.oneshot(req))
    }
}

#[tokio::test]
async fn a_stream_refused_by_a_draining_server_is_sent_again_transparently_elsewhere() {
    let (a, a_drain, a_shop) = instance().await;
    let (b, _, b_shop) = instance().await;
    // The client's connection to `a` is up and has carried a call.
    OrdersClient::new(a.clone())
        .create_order(create("s"))
        .await
        .expect("a answers before its drain");
    a_drain.start();
    // No retry policy: only a transparent resend can save the call.
    let config = ServiceConfig::from_json(
        r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders"}], "timeout": "30s",
            "idempotency": {}}]}"#,
    )
    .unwrap();
    let layer = RetryLayer::from_config(&config);
    let sent = Arc::new(AtomicUsize::new(0));
    let balancer = FirstThen {
        first: a,
        then: b,
        sent: sent.clone(),
    };
    let mut client =
        OrdersClient::new(ServiceBuilder::new().layer(layer.clone()).service(balancer));
    let resp = client
        .create_order(create("s"))
        .await
        .expect("the resend to b answers");
    let report = CallReport::from_response(&resp).unwrap();
    assert_eq!(
        (report.outcome, report.attempts, report.transparent),
        (CallOutcome::NoRetryPolicy, 1, 1),
        "{report}"
    );
    assert_eq!(sent.load(Ordering::SeqCst), 2);
    assert_eq!(
        a_shop.runs(),
        1,
        "the draining server ran only the call before"
    );
    assert_eq!(b_shop.runs(), 1, "the other server ran the call once");
    assert_eq!(layer.stats().snapshot().transparent, 1);
}
