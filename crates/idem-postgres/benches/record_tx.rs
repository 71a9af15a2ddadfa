//! What transactional completion costs: a `CreateOrder` that inserts one row, through a
//! real tonic server on loopback, with the records in memory (the baseline), in
//! PostgreSQL recorded by the layer after the handler (cache), and in PostgreSQL
//! completed in the handler's transaction (`RecordTx`). Fresh calls and replays, one
//! caller at a time (latency) and 32 at once (throughput). Ratios are to the memory
//! store measured in the same run.
//!
//! `cargo bench -p idem-postgres --bench record_tx` (release; needs PostgreSQL server
//! binaries, as the tests do). The private server runs with `fsync = off`: commits cost
//! a round trip, not a disk flush, so the numbers show idem's share.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::config::ServiceConfig;
use idem_postgres::{PostgresStore, TxError};
use idem_server::idempotency::{IdempotencyLayer, tenant::SingleTenant};
use idem_store::memory::MemoryStore;
use idem_test_support::net;
use idem_test_support::postgres::PostgresServer;
use idem_test_support::shop;
use shop::orders_client::OrdersClient;
use shop::orders_server::OrdersServer;
use shop::{CreateOrderRequest, Order};
use sqlx::postgres::PgPool;
use sqlx::{Executor, Row};
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};

const CONFIG: &str = r#"{
  "methodConfig": [{"name": [{"service": "shop.v1.Orders"}], "idempotency": {}}],
  "idem": {"tenant": {"single": "bench"}}
}"#;
const CALLS: usize = 2000;
const CONCURRENCY: usize = 32;

struct Shop {
    pool: PgPool,
    /// `Some`: complete the record in the handler's transaction.
    tx: Option<PostgresStore>,
}

fn db(e: sqlx::Error) -> Status {
    Status::from(TxError::from(e))
}

idem_test_support::create_only_orders! {
    Shop, why = "";
    create_order(&self, request) {
        let insert = "INSERT INTO orders (note) VALUES ($1) RETURNING id";
        let note = request.get_ref().note.clone();
        let Some(store) = &self.tx else {
            let row = sqlx::query(insert)
                .bind(&note)
                .fetch_one(&self.pool)
                .await
                .map_err(db)?;
            return Ok(Response::new(order(row.get(0))));
        };
        let mut tx = store.begin_for(&request).await?;
        let row = sqlx::query(insert)
            .bind(&note)
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
        let reply = order(row.get(0));
        tx.commit_reply(&reply).await?;
        Ok(Response::new(reply))
    }
}

fn order(id: i64) -> Order {
    Order {
        order_id: format!("ord-{id}"),
        ..Order::default()
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Memory,
    PostgresCache,
    PostgresTx,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Memory => "memory store",
            Mode::PostgresCache => "postgres, recorded after",
            Mode::PostgresTx => "postgres, in the handler's tx",
        }
    }
}

async fn serve(mode: Mode, url: &str) -> OrdersClient<Channel> {
    let config = ServiceConfig::from_json(CONFIG).unwrap();
    let store = PostgresStore::builder(url.to_owned())
        .max_connections(CONCURRENCY as u32 + 4)
        .connect()
        .await
        .unwrap();
    let shop = Shop {
        pool: store.pool().clone(),
        tx: (mode == Mode::PostgresTx).then(|| store.clone()),
    };
    let (addr, incoming) = net::bind().await;
    let svc = OrdersServer::new(shop);
    let tenant = SingleTenant::new("bench");
    if mode == Mode::Memory {
        let layer = IdempotencyLayer::new(MemoryStore::default(), &config).tenant(tenant);
        tokio::spawn(
            Server::builder()
                .layer(layer)
                .add_service(svc)
                .serve_with_incoming(incoming),
        );
    } else {
        let layer = IdempotencyLayer::new(store, &config).tenant(tenant);
        tokio::spawn(
            Server::builder()
                .layer(layer)
                .add_service(svc)
                .serve_with_incoming(incoming),
        );
    }
    OrdersClient::new(net::channel(addr))
}

fn request(key: &str) -> Request<CreateOrderRequest> {
    let mut r = Request::new(CreateOrderRequest {
        note: "n".into(),
        ..Default::default()
    });
    r.metadata_mut()
        .insert("x-idempotency-key", key.parse().unwrap());
    r
}

/// Mean latency of `CALLS` calls one at a time, and calls/s with `CONCURRENCY` callers,
/// for keys `prefix-0..`. Calls with keys already used are replays.
async fn measure(client: &OrdersClient<Channel>, prefix: &str) -> (Duration, f64) {
    let t = Instant::now();
    for i in 0..CALLS {
        client
            .clone()
            .create_order(request(&format!("{prefix}-seq-{i:06}")))
            .await
            .unwrap();
    }
    let latency = t.elapsed() / CALLS as u32;
    let t = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..CONCURRENCY {
        let (client, next, prefix) = (client.clone(), next.clone(), prefix.to_owned());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= CALLS * 2 {
                    return;
                }
                client
                    .clone()
                    .create_order(request(&format!("{prefix}-par-{i:06}")))
                    .await
                    .unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    (latency, (CALLS * 2) as f64 / t.elapsed().as_secs_f64())
}

#[tokio::main]
async fn main() {
    let Some(pg) = PostgresServer::start_with(&[("max_connections", "200")]) else {
        eprintln!("no PostgreSQL server binaries: nothing measured");
        return;
    };
    let admin = PgPool::connect(&pg.url()).await.unwrap();
    admin
        .execute("CREATE TABLE orders (id bigserial PRIMARY KEY, note text)")
        .await
        .unwrap();
    println!(
        "{CALLS} sequential calls (mean latency), then {} calls from {CONCURRENCY} callers (calls/s)",
        CALLS * 2
    );
    println!();
    println!("| store | fresh latency | fresh calls/s | replay latency | replay calls/s |");
    println!("|---|---|---|---|---|");
    let mut base = None;
    for (i, mode) in [Mode::Memory, Mode::PostgresCache, Mode::PostgresTx]
        .into_iter()
        .enumerate()
    {
        let client = serve(mode, &pg.url()).await;
        // Warm connections and prepared statements.
        measure_warm(&client, &format!("warm{i}")).await;
        let fresh = measure(&client, &format!("m{i}")).await;
        let replay = measure(&client, &format!("m{i}")).await;
        let (bf, br) = *base.get_or_insert((fresh, replay));
        let ratio = |d: Duration, b: Duration| d.as_secs_f64() / b.as_secs_f64();
        println!(
            "| {} | {:.0} µs ({:.2}×) | {:.0} ({:.2}×) | {:.0} µs ({:.2}×) | {:.0} ({:.2}×) |",
            mode.name(),
            fresh.0.as_secs_f64() * 1e6,
            ratio(fresh.0, bf.0),
            fresh.1,
            fresh.1 / bf.1,
            replay.0.as_secs_f64() * 1e6,
            ratio(replay.0, br.0),
            replay.1,
            replay.1 / br.1,
        );
    }
}

async fn measure_warm(client: &OrdersClient<Channel>, prefix: &str) {
    let mut tasks = Vec::new();
    for i in 0..CONCURRENCY * 4 {
        let client = client.clone();
        let key = format!("{prefix}-{i:06}");
        tasks.push(tokio::spawn(async move {
            client.clone().create_order(request(&key)).await.unwrap();
            client.clone().create_order(request(&key)).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}
