//! Shared test fixtures of the idem workspace, one home per concept: the example
//! `shop.v1.Orders` and `stream.v1` protos, loopback helpers ([`net`]), log capture
//! ([`logs`]), store call shorthands ([`store`]), the scripted `Orders` fakes
//! ([`shop_fake`], [`create_only_orders!`]), a one-worker server ([`one_worker`]) and
//! hand-built compressed streams ([`deflate`]). Used by the workspace's tests, examples
//! and benchmarks; not published.
//!
//! Behind features, private servers started from the installed binaries: `redis`
//! (`redis::RedisServer`, `redis::RedisCluster`) and `postgres`
//! (`postgres::PostgresServer`). The fault-injecting store double is
//! `idem_store::faulty::FaultyStore` (idem-store's `testing` feature); the demo
//! application is the `idem-demo` crate.

pub mod deflate;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod launch;
pub mod logs;
pub mod net;
pub mod one_worker;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
pub mod shop_fake;
pub mod store;

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

    /// A `Number` with no note.
    pub fn number(value: i64) -> Number {
        Number {
            value,
            note: String::new(),
        }
    }

    /// A `Number` whose encoded message is about `bytes` long.
    pub fn padded(value: i64, bytes: usize) -> Number {
        Number {
            value,
            note: "x".repeat(bytes),
        }
    }
}

/// A valid retry policy that retries `UNAVAILABLE` only, for the client layer's tests.
pub fn unavailable_policy(
    max_attempts: u32,
    initial: std::time::Duration,
    max: std::time::Duration,
    multiplier: f64,
) -> idem_core::config::RetryPolicy {
    use idem_core::code::{Code, CodeSet};
    idem_core::config::RetryPolicy::new(
        max_attempts,
        initial,
        max,
        multiplier,
        CodeSet::of(Code::Unavailable),
    )
    .expect("a valid retry policy")
}

/// The `ListOrdersStream` of the [`create_only_orders!`] doubles: they list nothing.
pub type NoOrders = tokio_stream::Empty<Result<shop::Order, tonic::Status>>;

/// Implements `shop.v1.Orders` for a double that only creates orders: `create_order` runs
/// the given body; `get_order` runs its body when one is given, else answers
/// UNIMPLEMENTED with the message `why`, like `list_orders`. The caller names the
/// receiver (`&self`) and the request, so the bodies read as methods:
///
/// ```text
/// idem_test_support::create_only_orders! {
///     Shop, why = "not in these tests";
///     create_order(&self, request) { Ok(tonic::Response::new(self.order(request))) }
/// }
/// ```
#[macro_export]
macro_rules! create_only_orders {
    (
        $ty:ty, why = $why:expr;
        create_order(&$this:ident, $request:pat) $create:block
    ) => {
        $crate::create_only_orders! {
            $ty, why = $why;
            create_order(&$this, $request) $create
            get_order(&self, _) { Err(::tonic::Status::unimplemented($why)) }
        }
    };
    (
        $ty:ty, why = $why:expr;
        create_order(&$this:ident, $request:pat) $create:block
        get_order(&$this_get:ident, $get_request:pat) $get:block
    ) => {
        #[::tonic::async_trait]
        impl $crate::shop::orders_server::Orders for $ty {
            async fn create_order(
                &$this,
                $request: ::tonic::Request<$crate::shop::CreateOrderRequest>,
            ) -> ::std::result::Result<::tonic::Response<$crate::shop::Order>, ::tonic::Status>
            $create

            async fn get_order(
                &$this_get,
                $get_request: ::tonic::Request<$crate::shop::GetOrderRequest>,
            ) -> ::std::result::Result<::tonic::Response<$crate::shop::Order>, ::tonic::Status>
            $get

            type ListOrdersStream = $crate::NoOrders;

            async fn list_orders(
                &self,
                _: ::tonic::Request<$crate::shop::ListOrdersRequest>,
            ) -> ::std::result::Result<::tonic::Response<$crate::NoOrders>, ::tonic::Status> {
                Err(::tonic::Status::unimplemented($why))
            }
        }
    };
}
