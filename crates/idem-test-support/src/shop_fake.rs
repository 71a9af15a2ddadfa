//! The scripted `shop.v1.Orders` fake for server tests: what each call does is chosen by
//! its request, and it counts what ran.
//!
//! `CreateOrder` by `sku`:
//! - `"gate"`: signals [`Shop::started`], then waits for [`Shop::open_gate`];
//! - `"gate-unavailable"`: as `"gate"`, then answers UNAVAILABLE (released by default);
//! - `"panic"`: panics in the handler;
//! - `"block-<ms>"`: signals [`Shop::started`], then blocks its thread for `<ms>`
//!   milliseconds (as a synchronous driver would);
//! - `"unavailable"`, `"internal"`: that status;
//! - `"unavailable-store"`: UNAVAILABLE with `x-idempotency-decision: store`;
//! - `"internal-release"`: INTERNAL with `x-idempotency-decision: release`;
//! - `"ok-release"`: OK with the [`IdemDecision::Release`] response extension;
//! - anything else: OK.
//!
//! A successful `CreateOrder` answers `order-<n>` (its run number) with an `x-run: <n>`
//! header. `GetOrder` answers `<order_id>-<n>`. `ListOrders` streams three orders
//! `order-<n>-0..3`; with `customer_id` `"panic-mid-stream"` the second one panics
//! while the stream is polled, and with `"count-<k>"` it streams `k` orders (at most
//! 10,000), yielding before each, so each leaves in a frame of its own.
//!
//! Every run records the [`RecordFence`] it saw and whether an inbound deadline was in
//! scope.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_server::idempotency::{IdemDecision, RecordFence};
use idem_store::Fence;
use tokio::sync::{Notify, Semaphore};
use tokio_stream::{Stream, StreamExt};
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Code, Request, Response, Status};

use crate::shop::orders_server::{Orders, OrdersServer};
use crate::shop::{CreateOrderRequest, GetOrderRequest, ListOrdersRequest, Order};

struct ShopState {
    runs: AtomicUsize,
    finished: AtomicUsize,
    started: Notify,
    gate: Semaphore,
    fences: Mutex<Vec<Fence>>,
    saw_deadline: Mutex<Vec<bool>>,
}

/// The fake `Orders` service; clones share their counters.
#[derive(Clone)]
pub struct Shop(Arc<ShopState>);

impl Default for Shop {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Shop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shop")
            .field("runs", &self.runs())
            .field("finished", &self.finished())
            .finish()
    }
}

impl Shop {
    /// A fake with no runs and a closed gate.
    pub fn new() -> Self {
        Shop(Arc::new(ShopState {
            runs: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            started: Notify::new(),
            gate: Semaphore::new(0),
            fences: Mutex::new(Vec::new()),
            saw_deadline: Mutex::new(Vec::new()),
        }))
    }

    /// Handler runs started, every method together.
    pub fn runs(&self) -> usize {
        self.0.runs.load(Ordering::SeqCst)
    }

    /// Handler runs that got past their script (returned or are about to).
    pub fn finished(&self) -> usize {
        self.0.finished.load(Ordering::SeqCst)
    }

    /// Lets `n` `"gate"` runs through.
    pub fn open_gate(&self, n: usize) {
        self.0.gate.add_permits(n);
    }

    /// Resolves when a `"gate"` or `"block-<ms>"` run has started (one signal per run;
    /// a signal sent before anyone waits is kept for the next waiter).
    pub async fn started(&self) {
        self.0.started.notified().await;
    }

    /// The fence each run saw in its [`RecordFence`] extension, in run order (runs
    /// without one are left out).
    pub fn fences(&self) -> Vec<Fence> {
        self.0.fences.lock().unwrap().clone()
    }

    /// Whether each run had an inbound deadline in scope, in run order.
    pub fn saw_deadline(&self) -> Vec<bool> {
        self.0.saw_deadline.lock().unwrap().clone()
    }

    fn record<T>(&self, req: &Request<T>) -> usize {
        if let Some(f) = req.extensions().get::<RecordFence>() {
            self.0.fences.lock().unwrap().push(f.0);
        }
        self.0
            .saw_deadline
            .lock()
            .unwrap()
            .push(idem_core::deadline::inbound_deadline().is_some());
        self.0.runs.fetch_add(1, Ordering::SeqCst) + 1
    }
}

/// A `CreateOrder` request (customer `c-1`, sku `sku-42`, quantity 1) with `note`, the
/// idempotency key `key` and a deadline `timeout` away.
pub fn keyed_create(key: &str, note: &str, timeout: Duration) -> Request<CreateOrderRequest> {
    let mut req = Request::new(CreateOrderRequest {
        customer_id: "c-1".into(),
        sku: "sku-42".into(),
        quantity: 1,
        note: note.into(),
    });
    idem_client::with_key(&mut req, &key.parse().expect("valid key"));
    req.set_timeout(timeout);
    req
}

/// A `CreateOrder` request for `sku` (customer `c-1`, quantity 2).
pub fn create(sku: &str) -> CreateOrderRequest {
    CreateOrderRequest {
        customer_id: "c-1".into(),
        sku: sku.into(),
        quantity: 2,
        note: String::new(),
    }
}

fn with_decision(code: Code, decision: &'static str) -> Status {
    let mut md = MetadataMap::new();
    md.insert(
        "x-idempotency-decision",
        MetadataValue::from_static(decision),
    );
    Status::with_metadata(code, "scripted", md)
}

#[tonic::async_trait]
impl Orders for Shop {
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        let n = self.record(&request);
        let req = request.into_inner();
        let result = match req.sku.as_str() {
            "gate" | "gate-unavailable" => {
                self.0.started.notify_one();
                let permit = self.0.gate.acquire().await.expect("gate open");
                permit.forget();
                match req.sku.as_str() {
                    "gate" => Ok(()),
                    _ => Err(Status::unavailable("scripted")),
                }
            }
            "panic" => panic!("scripted panic"),
            sku if sku.starts_with("block-") => {
                let ms = sku["block-".len()..].parse().expect("block-<ms>");
                self.0.started.notify_one();
                std::thread::sleep(Duration::from_millis(ms));
                Ok(())
            }
            "unavailable" => Err(Status::unavailable("scripted")),
            "internal" => Err(Status::internal("scripted")),
            "unavailable-store" => Err(with_decision(Code::Unavailable, "store")),
            "internal-release" => Err(with_decision(Code::Internal, "release")),
            _ => Ok(()),
        };
        self.0.finished.fetch_add(1, Ordering::SeqCst);
        result?;
        let mut resp = Response::new(Order {
            order_id: format!("order-{n}"),
            customer_id: req.customer_id,
            sku: req.sku.clone(),
            quantity: req.quantity,
            created_by: "server-a".into(),
        });
        resp.metadata_mut()
            .insert("x-run", n.to_string().parse().unwrap());
        if req.sku == "ok-release" {
            resp.extensions_mut().insert(IdemDecision::Release);
        }
        Ok(resp)
    }

    async fn get_order(
        &self,
        request: Request<GetOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        let n = self.record(&request);
        self.0.finished.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(Order {
            order_id: format!("{}-{n}", request.into_inner().order_id),
            ..Order::default()
        }))
    }

    type ListOrdersStream = Pin<Box<dyn Stream<Item = Result<Order, Status>> + Send>>;

    async fn list_orders(
        &self,
        request: Request<ListOrdersRequest>,
    ) -> Result<Response<Self::ListOrdersStream>, Status> {
        let n = self.record(&request);
        let customer = request.into_inner().customer_id;
        let panics = customer == "panic-mid-stream";
        let counted = customer
            .strip_prefix("count-")
            .and_then(|k| k.parse::<u32>().ok());
        let count = counted.map_or(3, |k| k.min(10_000));
        let items = tokio_stream::iter(0..count).map(move |i| {
            assert!(!(panics && i == 1), "scripted panic in the response stream");
            Ok(Order {
                order_id: format!("order-{n}-{i}"),
                customer_id: customer.clone(),
                ..Order::default()
            })
        });
        self.0.finished.fetch_add(1, Ordering::SeqCst);
        if counted.is_none() {
            return Ok(Response::new(Box::pin(items)));
        }
        Ok(Response::new(Box::pin(items.then(|item| async {
            tokio::task::yield_now().await;
            item
        }))))
    }
}

/// An `Orders` service whose `CreateOrder` is a closure; `GetOrder` and `ListOrders`
/// answer UNIMPLEMENTED. For tests and benches whose handler is their subject (a relay,
/// a counting or failing handler, a busy one) and which need no other method.
///
/// ```
/// use idem_test_support::shop::Order;
/// use idem_test_support::shop_fake::create_only;
/// use tonic::Response;
///
/// let server = create_only(|req| async move {
///     let sku = req.into_inner().sku;
///     Ok(Response::new(Order { order_id: format!("order-{sku}"), ..Order::default() }))
/// });
/// # let _ = server;
/// ```
pub struct CreateOnly<F>(F);

/// The server of a [`CreateOnly`] service.
pub fn create_only<F, Fut>(f: F) -> OrdersServer<CreateOnly<F>>
where
    F: Fn(Request<CreateOrderRequest>) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Response<Order>, Status>> + Send + 'static,
{
    OrdersServer::new(CreateOnly(f))
}

#[tonic::async_trait]
impl<F, Fut> Orders for CreateOnly<F>
where
    F: Fn(Request<CreateOrderRequest>) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Response<Order>, Status>> + Send + 'static,
{
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        (self.0)(request).await
    }

    async fn get_order(&self, _: Request<GetOrderRequest>) -> Result<Response<Order>, Status> {
        Err(Status::unimplemented("this fake only creates orders"))
    }

    type ListOrdersStream = Pin<Box<dyn Stream<Item = Result<Order, Status>> + Send + 'static>>;

    async fn list_orders(
        &self,
        _: Request<ListOrdersRequest>,
    ) -> Result<Response<Self::ListOrdersStream>, Status> {
        Err(Status::unimplemented("this fake only creates orders"))
    }
}
