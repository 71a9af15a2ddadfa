//! A hostile server on 127.0.0.1 against a tonic client behind the `RetryLayer`: what it
//! writes into its status headers must neither panic the caller (issue 30, item 11) nor
//! become the caller's `CallReport` (item 12).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::Frame;
use http_body_util::BodyExt;
use idem_client::retry::{CallOutcome, CallReport, RetryLayer};
use tonic::body::Body;
use tower::ServiceBuilder;

const SERVICE: &str = "hostile.v1.Hostile";

/// Answers by path, whatever the request: status headers no honest server writes.
#[derive(Clone)]
struct Hostile;

impl tonic::server::NamedService for Hostile {
    const NAME: &'static str = SERVICE;
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(*k, v.parse().unwrap());
    }
    h
}

/// Real response headers (plus `extra`), the `messages`, then `trailers`.
fn committed(
    extra: &[(&'static str, &'static str)],
    messages: &[&'static [u8]],
    trailers: &[(&'static str, &'static str)],
) -> http::Response<Body> {
    let mut frames: Vec<Result<Frame<Bytes>, Infallible>> = messages
        .iter()
        .map(|m| Ok(Frame::data(Bytes::from_static(m))))
        .collect();
    frames.push(Ok(Frame::trailers(headers(trailers))));
    let body = http_body_util::StreamBody::new(tokio_stream::iter(frames));
    let mut resp = http::Response::new(Body::new(body));
    *resp.headers_mut() = headers(extra);
    resp.headers_mut()
        .insert("content-type", "application/grpc".parse().unwrap());
    resp
}

/// A Trailers-Only answer with these status headers.
fn trailers_only(status: &[(&'static str, &'static str)]) -> http::Response<Body> {
    let mut resp = http::Response::new(Body::empty());
    *resp.headers_mut() = headers(status);
    resp.headers_mut()
        .insert("content-type", "application/grpc".parse().unwrap());
    resp
}

const NOT_BASE64: (&str, &str) = ("grpc-status-details-bin", "!!not base64!!");
const FORGED: [(&str, &str); 2] = [
    ("x-idem-retry-outcome", "throttled"),
    ("x-idem-retry-attempts", "5 14:1,14:1,14:1,14:1,14:1"),
];

impl tower::Service<http::Request<Body>> for Hostile {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let method = req.uri().path().rsplit('/').next().unwrap_or("").to_owned();
        Box::pin(async move {
            // Read the request first: the answer is the only thing that is hostile.
            let _ = req.into_body().collect().await;
            let status = [("grpc-status", "9"), ("grpc-message", "broken")];
            let resp = match method.as_str() {
                "BadDetailsTrailersOnly" => trailers_only(&[status[0], status[1], NOT_BASE64]),
                "BadDetailsInTrailers" => committed(&[], &[], &[status[0], status[1], NOT_BASE64]),
                "UrlSafeDetails" => {
                    trailers_only(&[status[0], status[1], ("grpc-status-details-bin", "-_8")])
                }
                "ForgedOk" => committed(&FORGED, &[b"\0\0\0\0\0"], &[("grpc-status", "0")]),
                "ForgedError" => committed(
                    &FORGED,
                    &[],
                    &[
                        ("grpc-status", "14"),
                        ("grpc-message", "down"),
                        FORGED[0],
                        FORGED[1],
                    ],
                ),
                _ => trailers_only(&[
                    ("grpc-status", "14"),
                    ("grpc-message", "busy"),
                    FORGED[0],
                    FORGED[1],
                ]),
            };
            Ok(resp)
        })
    }
}

async fn serve() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(Hostile)
            .serve_with_incoming(incoming),
    );
    addr
}

/// Calls `method` (an empty message each way) through the layer (the builder's policy:
/// UNAVAILABLE retried, 3 attempts).
async fn call(addr: SocketAddr, method: &str) -> Result<tonic::Response<()>, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let layer = RetryLayer::builder()
        .initial_backoff(std::time::Duration::from_millis(1))
        .build()
        .unwrap();
    let svc = ServiceBuilder::new().layer(layer).service(channel);
    let mut grpc = tonic::client::Grpc::new(svc);
    grpc.ready().await.unwrap();
    let path = http::uri::PathAndQuery::try_from(format!("/{SERVICE}/{method}")).unwrap();
    let codec = tonic_prost::ProstCodec::<(), ()>::default();
    grpc.unary(tonic::Request::new(()), path, codec).await
}

#[tokio::test]
async fn details_that_are_not_base64_do_not_panic_the_caller() {
    let addr = serve().await;
    for method in ["BadDetailsTrailersOnly", "BadDetailsInTrailers"] {
        // On the code before issue 30, tonic panicked here, in the caller's task.
        let status = call(addr, method).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{method}");
        assert_eq!(status.message(), "broken", "{method}");
        assert!(status.details().is_empty(), "{method}");
    }
    // Details the layer can decode in another alphabet are re-encoded, not lost.
    let status = call(addr, "UrlSafeDetails").await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert_eq!(status.details(), [0xfb, 0xff]);
}

#[tokio::test]
async fn a_server_cannot_forge_the_call_report() {
    let addr = serve().await;
    let is_forged = |md: &tonic::metadata::MetadataMap| {
        md.get("x-idem-retry-outcome").is_some() || md.get("x-idem-retry-attempts").is_some()
    };
    // Committed and OK: the report is the layer's (one attempt), the metadata is clean.
    let resp = call(addr, "ForgedOk").await.unwrap();
    let report = CallReport::from_response(&resp).unwrap();
    assert_eq!(
        (report.outcome, report.attempts),
        (CallOutcome::Committed, 1)
    );
    assert!(!is_forged(resp.metadata()));
    // Committed, then an error in the trailers: the layer made no report of it, so the
    // caller reads none (it read "throttled after 5 attempts").
    let status = call(addr, "ForgedError").await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert_eq!(CallReport::from_status(&status), None);
    assert!(!is_forged(status.metadata()));
    // Trailers-Only UNAVAILABLE every time: the report says what the layer did.
    let status = call(addr, "Busy").await.unwrap_err();
    let report = CallReport::from_status(&status).unwrap();
    assert_eq!(
        (report.outcome, report.attempts),
        (CallOutcome::AttemptsExhausted, 3)
    );
}
