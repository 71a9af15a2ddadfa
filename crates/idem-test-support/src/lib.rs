//! Shared test code of the idem workspace, one home per concept: the example
//! `shop.v1.Orders` proto, loopback helpers, a private `redis-server`, store doubles and
//! the demo harness. Used by the workspace's tests, examples and benchmarks; not
//! published.

pub mod crash;
pub mod demo;
pub mod demo_metrics;
pub mod faulty_store;
pub mod net;
pub mod pg_orders;
pub mod postgres;
pub mod redis;
pub mod shop_fake;

/// The generated code of `proto/shop/v1/orders.proto` (messages, client and server).
pub mod shop {
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    tonic::include_proto!("shop.v1");
}

/// The generated code of `proto/stream/v1/stream.proto`: a client-streaming and a
/// bidirectional method, for the client layer's streaming tests.
pub mod stream {
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    tonic::include_proto!("stream.v1");
}
