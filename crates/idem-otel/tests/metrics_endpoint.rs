//! The scrape endpoint when the process runs out of file descriptors (the descriptors it
//! shares with the gRPC server): accept fails with a real `EMFILE`, the endpoint logs it
//! once and keeps serving once a descriptor is free again.
//!
//! Alone in its binary: it lowers the process's descriptor limit, and it asserts on a log
//! line (tracing's callsite interest is process-wide).

use std::fs::File;
use std::time::Duration;

use idem_otel::prometheus::{Prometheus, serve};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[test]
fn an_accept_error_is_logged_and_serving_goes_on() {
    let mut answer = String::new();
    let logs = idem_test_support::logs::capture(tracing::Level::INFO, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let prometheus = Prometheus::new();
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(serve(listener, prometheus));

            // Take every descriptor but one (the soft limit lowered so that is quick),
            // then let the client's socket take the last one.
            let (soft, hard) = rlimit::Resource::NOFILE.get().unwrap();
            rlimit::Resource::NOFILE.set(soft.min(256), hard).unwrap();
            let mut fillers = Vec::new();
            while let Ok(f) = File::open("/dev/null") {
                fillers.push(f);
            }
            fillers.pop();
            let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
            client
                .write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .unwrap();

            // The endpoint meets EMFILE on accept; give it a few backoffs of it.
            tokio::time::sleep(Duration::from_millis(200)).await;
            drop(fillers);
            let read =
                tokio::time::timeout(Duration::from_secs(30), client.read_to_string(&mut answer))
                    .await;
            rlimit::Resource::NOFILE.set(soft, hard).unwrap();
            assert!(read.is_ok(), "no answer once descriptors were free again");
        });
    });
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert_eq!(
        logs.matches("metrics endpoint cannot accept a connection")
            .count(),
        1,
        "one warning for the run of errors: {logs}"
    );
    assert!(logs.contains("Too many open files"), "{logs}");
    assert!(
        logs.contains("metrics endpoint accepting connections again"),
        "{logs}"
    );
}
