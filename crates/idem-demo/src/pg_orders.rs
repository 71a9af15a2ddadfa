//! The demo's `shop.v1.Orders` on PostgreSQL: each order is a row of `idem_demo_orders`,
//! written in the same transaction as the idempotency record's completion when the
//! server keeps its records in the same database ([`idem_postgres::RecordTx`]).
//!
//! A process killed at any point then leaves either no order and a record that is taken
//! over (the retry runs the handler), or the order and the stored reply (the retry
//! replays it): never an order without its record.

use std::collections::HashMap;
use std::sync::Arc;

use idem_postgres::{PostgresStore, TxError};
use sqlx::postgres::PgPool;
use sqlx::{Executor, Row};
use tonic::{Response, Status};

use idem_test_support::shop::{CreateOrderRequest, Order};

use crate::crash::{Pause, PausePoint};

/// The demo's orders table (the intent id travels in the request's `note`).
pub const TABLE: &str = "idem_demo_orders";

/// Creates the orders table if needed and empties it.
pub async fn reset_table(pool: &PgPool) -> Result<(), sqlx::Error> {
    pool.execute(
        "CREATE TABLE IF NOT EXISTS idem_demo_orders (
            id bigserial PRIMARY KEY, intent text NOT NULL, created_by text NOT NULL)",
    )
    .await?;
    pool.execute("TRUNCATE idem_demo_orders").await?;
    Ok(())
}

/// Orders per intent.
pub async fn orders_by_intent(pool: &PgPool) -> Result<HashMap<String, u32>, sqlx::Error> {
    let rows = sqlx::query("SELECT intent, count(*) FROM idem_demo_orders GROUP BY intent")
        .fetch_all(pool)
        .await?;
    rows.iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get::<i64, _>(1)? as u32)))
        .collect()
}

/// Each order's intent and id (`ord-N`, as its reply names it).
pub async fn orders(pool: &PgPool) -> Result<Vec<(String, String)>, sqlx::Error> {
    let rows = sqlx::query("SELECT intent, id FROM idem_demo_orders")
        .fetch_all(pool)
        .await?;
    rows.iter()
        .map(|r| Ok((r.try_get(0)?, format!("ord-{}", r.try_get::<i64, _>(1)?))))
        .collect()
}

/// Inserts one order of `intent` on `conn` (a handler's [`idem_postgres::RecordTx`], so
/// it commits with the record); returns its id.
pub async fn insert_order(
    conn: &mut sqlx::PgConnection,
    intent: &str,
    created_by: &str,
) -> Result<i64, Status> {
    let row = sqlx::query(
        "INSERT INTO idem_demo_orders (intent, created_by) VALUES ($1, $2) RETURNING id",
    )
    .bind(intent)
    .bind(created_by)
    .fetch_one(conn)
    .await
    .map_err(db)?;
    Ok(row.get(0))
}

/// `shop.v1.Orders` writing to PostgreSQL.
pub struct PgOrders {
    pool: PgPool,
    /// With the idempotency layer on this store: orders commit with the record.
    store: Option<PostgresStore>,
    instance: String,
    pause: Arc<Pause>,
}

impl PgOrders {
    /// Orders written with `store`'s completion in one transaction (`Some`), or plain
    /// inserts on `pool` (`None`: no idempotency layer, or a layer on another store).
    pub fn new(
        pool: PgPool,
        store: Option<PostgresStore>,
        instance: String,
        pause: Arc<Pause>,
    ) -> Self {
        PgOrders {
            pool,
            store,
            instance,
            pause,
        }
    }
}

fn db(e: sqlx::Error) -> Status {
    Status::from(TxError::from(e))
}

idem_test_support::create_only_orders! {
    PgOrders, why = "the demo only creates orders";
    create_order(&self, request) {
        let insert =
            "INSERT INTO idem_demo_orders (intent, created_by) VALUES ($1, $2) RETURNING id";
        self.pause.at(PausePoint::BeforeWrite).await;
        let Some(store) = &self.store else {
            let r = request.into_inner();
            let row = sqlx::query(insert)
                .bind(&r.note)
                .bind(&self.instance)
                .fetch_one(&self.pool)
                .await
                .map_err(db)?;
            self.pause.at(PausePoint::AfterCommit).await;
            return Ok(Response::new(order(r, &self.instance, row.get(0))));
        };
        let mut tx = store.begin_for(&request).await?;
        let r = request.into_inner();
        let row = sqlx::query(insert)
            .bind(&r.note)
            .bind(&self.instance)
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
        self.pause.at(PausePoint::InTransaction).await;
        let reply = order(r, &self.instance, row.get(0));
        tx.commit_reply(&reply).await?;
        self.pause.at(PausePoint::AfterCommit).await;
        Ok(Response::new(reply))
    }
}

fn order(r: CreateOrderRequest, instance: &str, id: i64) -> Order {
    Order {
        order_id: format!("ord-{id}"),
        customer_id: r.customer_id,
        sku: r.sku,
        quantity: r.quantity,
        created_by: instance.to_owned(),
    }
}
