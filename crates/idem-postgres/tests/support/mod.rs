//! Shared by the tests that call through a tonic server: `shop.v1.Orders` behind an
//! `IdempotencyLayer` on a `PostgresStore`.

use idem_core::config::ServiceConfig;
use idem_postgres::{PostgresStore, RecordTx, TxError};
use idem_server::idempotency::{IdempotencyLayer, tenant::SingleTenant};
use idem_test_support::net;
use idem_test_support::shop::Order;
use idem_test_support::shop::orders_client::OrdersClient;
use idem_test_support::shop::orders_server::{Orders, OrdersServer};
use tonic::transport::{Channel, Server};
use tonic::{Response, Status};

/// Every `shop.v1.Orders` method protected, for the single tenant `t`.
pub(crate) const CONFIG: &str = r#"{
  "methodConfig": [{
    "name": [{"service": "shop.v1.Orders"}],
    "idempotency": {"leaseTtl": "10s"}
  }],
  "idem": {"tenant": {"single": "t"}}
}"#;

/// Serves `shop` on 127.0.0.1 behind an idempotency layer on `store` configured with
/// [`CONFIG`], and returns a client of it.
pub(crate) async fn serve<S: Orders>(store: &PostgresStore, shop: S) -> OrdersClient<Channel> {
    let config = ServiceConfig::from_json(CONFIG).unwrap();
    let layer = IdempotencyLayer::new(store.clone(), &config).tenant(SingleTenant::new("t"));
    let (addr, incoming) = net::bind().await;
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(OrdersServer::new(shop))
            .serve_with_incoming(incoming),
    );
    OrdersClient::new(net::channel(addr))
}

/// The order a test handler replies with for `note`.
pub(crate) fn order(note: &str) -> Order {
    Order {
        order_id: format!("ord-{note}"),
        customer_id: "c".into(),
        sku: "s".into(),
        quantity: 1,
        created_by: "shop".into(),
    }
}

/// What a transactional handler does once it has begun: `insert` (its one parameter is
/// the note) in the call's transaction, then the reply committed with it.
pub(crate) async fn insert_and_commit(
    mut tx: RecordTx,
    insert: &str,
    note: &str,
) -> Result<Response<Order>, Status> {
    sqlx::query(insert)
        .bind(note)
        .execute(&mut *tx)
        .await
        .map_err(TxError::from)?;
    let reply = order(note);
    tx.commit_reply(&reply).await?;
    Ok(Response::new(reply))
}
