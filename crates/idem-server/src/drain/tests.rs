use std::time::Duration;

use super::*;

/// A drain over runs of its own (other tests of this binary run protected calls).
fn drain(timeout: Duration) -> (Drain, &'static runs::Runs) {
    let runs: &'static runs::Runs = Box::leak(Box::new(runs::Runs::new()));
    let drain = Drain {
        runs,
        ..Drain::new().timeout(timeout)
    };
    (drain, runs)
}

#[tokio::test(start_paused = true)]
async fn a_drain_waits_for_the_server_then_its_runs_within_the_timeout() {
    let (drain, runs) = drain(Duration::from_secs(5));
    let (finish, finished) = tokio::sync::oneshot::channel::<()>();
    // A protected run whose caller went away: it ends when `finish` fires.
    let run = tokio::spawn(runs.protect(async move {
        let _ = finished.await;
    }));
    assert_eq!(runs.count(), 1);
    let signal = drain.signal();
    let server = async move {
        signal.await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        Ok::<(), std::io::Error>(())
    };
    let d = drain.clone();
    let drained = tokio::spawn(async move { d.run(server).await });
    tokio::time::sleep(Duration::from_millis(10)).await;
    drain.start();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!drained.is_finished(), "the run is still going");
    finish.send(()).unwrap();
    run.await.unwrap();
    let drained = drained.await.unwrap().unwrap();
    assert!(!drained.timed_out);
    assert_eq!(drained.took, Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn a_drain_ends_at_its_timeout_with_the_runs_left() {
    let (drain, runs) = drain(Duration::from_secs(2));
    let _stuck = tokio::spawn(runs.protect(std::future::pending()));
    drain.start();
    let drained = drain
        .run(async { Ok::<(), std::io::Error>(()) })
        .await
        .unwrap();
    assert!(drained.timed_out);
    assert_eq!(drained.runs_left, 1);
    assert_eq!(drained.took, Duration::from_secs(2));
}

/// A real tonic server whose first layer is `drain`'s; its `Orders` fake counts runs.
async fn serve_with(drain: &Drain) -> (std::net::SocketAddr, idem_test_support::shop_fake::Shop) {
    use idem_test_support::shop::orders_server::OrdersServer;
    let shop = idem_test_support::shop_fake::Shop::new();
    let (addr, incoming) = idem_test_support::net::bind().await;
    let router = tonic::transport::Server::builder()
        .layer(drain.layer())
        .add_service(OrdersServer::new(shop.clone()));
    tokio::spawn(router.serve_with_incoming(incoming));
    (addr, shop)
}

/// One `CreateOrder` on `client`, as a raw h2 request: its response head, or the h2
/// error its stream ended with.
async fn create_order(
    client: &mut h2::client::SendRequest<bytes::Bytes>,
) -> Result<http::Response<h2::RecvStream>, h2::Error> {
    use prost::Message;
    let req = http::Request::builder()
        .method("POST")
        .uri("http://localhost/shop.v1.Orders/CreateOrder")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let msg = idem_test_support::shop_fake::create("s").encode_to_vec();
    let mut framed = vec![0u8];
    framed.extend_from_slice(&u32::try_from(msg.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(&msg);
    let mut ready = client.clone().ready().await?;
    let (response, mut send) = ready.send_request(req, false)?;
    send.send_data(framed.into(), true)?;
    response.await
}

/// Issue 32: "GOAWAY, then REFUSED_STREAM". A stream that reaches the server after the
/// drain started is reset with `RST_STREAM(REFUSED_STREAM)` on the wire (what the client's
/// h2 reports: a remote reset with that reason), and the service never sees it.
#[tokio::test]
async fn once_the_drain_starts_new_streams_are_reset_with_refused_stream() {
    let drain = Drain::new();
    let (addr, shop) = serve_with(&drain).await;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let answered = create_order(&mut client)
        .await
        .expect("answered before the drain");
    assert_eq!(answered.status(), http::StatusCode::OK);
    assert_eq!(shop.runs(), 1);
    drain.start();
    let err = create_order(&mut client)
        .await
        .expect_err("refused once the drain started");
    assert!(err.is_reset() && err.is_remote(), "{err:?}");
    assert_eq!(err.reason(), Some(h2::Reason::REFUSED_STREAM), "{err:?}");
    assert_eq!(
        shop.runs(),
        1,
        "the refused stream never reached the service"
    );
}

/// The error tonic's `RecoverError` and hyper see: not a `Status` or an `h2::Error`
/// itself (tonic would answer those with a gRPC status), an `h2::Error` in its source.
#[test]
fn the_refusal_carries_refused_stream_in_its_source_only() {
    let err: Box<dyn std::error::Error + Send + Sync> = StreamRefused::new().into();
    assert!(err.downcast_ref::<h2::Error>().is_none());
    assert!(err.downcast_ref::<tonic::Status>().is_none());
    let source = err.source().and_then(|s| s.downcast_ref::<h2::Error>());
    assert_eq!(
        source.and_then(h2::Error::reason),
        Some(h2::Reason::REFUSED_STREAM)
    );
}
