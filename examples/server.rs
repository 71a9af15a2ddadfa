//! A `shop.v1.Orders` server protected by idem.
//!
//! ```text
//! cargo run --example server                       # 127.0.0.1:50051, in-memory store
//! cargo run --example server -- --addr 127.0.0.1:50052 --redis redis://127.0.0.1:6379
//! cargo run --example server -- --metrics-addr 127.0.0.1:9464   # Prometheus: GET /metrics
//! ```
//!
//! It reads `examples/service_config.json` (or `--config FILE`): `CreateOrder` is protected
//! (it has an `idempotency` object), the tenant is the config's single tenant. Try it with
//! `cargo run --example client`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;

use idem::core::config::ServiceConfig;
use idem::otel::ServerMetrics;
use idem::otel::prometheus::Prometheus;
use idem::redis::RedisStore;
use idem::server::idempotency::RecordFence;
use idem::server::{idempotency::IdempotencyLayer, inbound::InboundLayer};
use idem::store::{Store, memory::MemoryStore};
use tonic::transport::Server;
use tonic::{Request, Response, Status};

// The code generated from proto/shop/v1/orders.proto (in your project: your own
// `tonic::include_proto!`).
use idem_test_support::shop;
use shop::orders_server::{Orders, OrdersServer};
use shop::{CreateOrderRequest, GetOrderRequest, ListOrdersRequest, Order};

#[derive(Default)]
struct Shop {
    orders: Mutex<Vec<Order>>,
}

#[tonic::async_trait]
impl Orders for Shop {
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        // The fence of this run, to pass to downstream writes that can check it.
        let fence = request.extensions().get::<RecordFence>().map(|f| f.0);
        let r = request.into_inner();
        if r.quantity == 0 {
            // A rejection: nothing was done, so idem releases the key (a fixed request may
            // reuse it).
            return Err(Status::invalid_argument("quantity must be > 0"));
        }
        let mut orders = self.orders.lock().expect("orders lock");
        let order = Order {
            order_id: format!("ord-{}", orders.len() + 1),
            customer_id: r.customer_id,
            sku: r.sku,
            quantity: r.quantity,
            created_by: format!("example server (fence {fence:?})"),
        };
        orders.push(order.clone());
        println!(
            "created {} ({} orders so far)",
            order.order_id,
            orders.len()
        );
        Ok(Response::new(order))
    }

    async fn get_order(
        &self,
        request: Request<GetOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        let id = request.into_inner().order_id;
        let orders = self.orders.lock().expect("orders lock");
        orders
            .iter()
            .find(|o| o.order_id == id)
            .cloned()
            .map(Response::new)
            .ok_or_else(|| Status::not_found(format!("no order {id}")))
    }

    type ListOrdersStream = tokio_stream::Iter<std::vec::IntoIter<Result<Order, Status>>>;

    async fn list_orders(
        &self,
        request: Request<ListOrdersRequest>,
    ) -> Result<Response<Self::ListOrdersStream>, Status> {
        let customer = request.into_inner().customer_id;
        let orders: Vec<Result<Order, Status>> = self
            .orders
            .lock()
            .expect("orders lock")
            .iter()
            .filter(|o| o.customer_id == customer)
            .cloned()
            .map(Ok)
            .collect();
        Ok(Response::new(tokio_stream::iter(orders)))
    }
}

fn arg(args: &HashMap<String, String>, name: &str, default: &str) -> String {
    args.get(name)
        .cloned()
        .unwrap_or_else(|| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args: HashMap<String, String> = argv
        .chunks(2)
        .filter_map(|c| Some((c.first()?.clone(), c.get(1)?.clone())))
        .collect();
    let addr: SocketAddr = arg(&args, "--addr", "127.0.0.1:50051").parse()?;
    // The example's own config, found from its manifest so it runs from any directory.
    let default_config = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/service_config.json");
    let path = arg(&args, "--config", default_config);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let parsed = ServiceConfig::from_json_with_warnings(&text)?;
    for w in &parsed.warnings {
        eprintln!("config warning: {w}");
    }
    let config = parsed.config;

    println!("shop.v1.Orders on {addr} (config {path})");
    let metrics = match args.get("--metrics-addr") {
        Some(metrics_addr) => {
            let listener = tokio::net::TcpListener::bind(metrics_addr.as_str()).await?;
            println!("metrics on http://{}/metrics", listener.local_addr()?);
            Some(serve_metrics(listener, &config))
        }
        None => None,
    };
    match args.get("--redis") {
        Some(url) => {
            let store = RedisStore::connect(url.clone()).await?;
            serve(addr, &config, store, "redis", metrics).await?;
        }
        None => {
            let store = MemoryStore::new(config.settings().memory_store.clone());
            if let Some(m) = &metrics {
                m.watch_memory_store(&store);
            }
            serve(addr, &config, store, "memory", metrics).await?;
        }
    }
    Ok(())
}

/// Serves the Prometheus exposition of the server's metrics on `listener`; the metrics
/// to give the layer.
fn serve_metrics(listener: tokio::net::TcpListener, config: &ServiceConfig) -> ServerMetrics {
    let prometheus = Prometheus::new();
    let metrics = ServerMetrics::new(&prometheus.meter("idem"), config);
    tokio::spawn(idem::otel::prometheus::serve(listener, prometheus));
    metrics
}

/// Serves the shop behind `InboundLayer` and `IdempotencyLayer` (observed and with its
/// store timed when there are metrics).
async fn serve<St: Store>(
    addr: SocketAddr,
    config: &ServiceConfig,
    store: St,
    kind: &'static str,
    metrics: Option<ServerMetrics>,
) -> Result<(), Box<dyn std::error::Error>> {
    let shop = OrdersServer::new(Shop::default());
    let server = Server::builder().layer(InboundLayer::new());
    match metrics {
        Some(m) => {
            let layer = IdempotencyLayer::new(m.instrument_store(store, kind), config)
                .observer(m.clone())
                .check()?;
            m.watch(&layer);
            server.layer(layer).add_service(shop).serve(addr).await?;
        }
        None => {
            let layer = IdempotencyLayer::new(store, config).check()?;
            server.layer(layer).add_service(shop).serve(addr).await?;
        }
    }
    Ok(())
}
