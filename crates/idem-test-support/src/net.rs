//! Loopback helpers: a listener on a free port and a channel to it.

use std::net::SocketAddr;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

/// Binds 127.0.0.1:0 and returns the listener's address and an incoming stream for
/// `Server::serve_with_incoming`.
pub async fn bind() -> (SocketAddr, TcpListenerStream) {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().expect("local addr");
    (addr, TcpListenerStream::new(listener))
}

/// A port on 127.0.0.1 that was free a moment ago (for a server process to listen on).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

/// A lazily-connecting channel to `addr`.
pub fn channel(addr: SocketAddr) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect_lazy()
}
