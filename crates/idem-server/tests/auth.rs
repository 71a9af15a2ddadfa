//! Authentication in front of the idempotency layer, the way tonic users write it: a
//! real tonic `Orders` server on 127.0.0.1, the tenant established by
//! - `tonic::service::InterceptorLayer` before `IdempotencyLayer` (a sync interceptor
//!   that puts the tenant into a request extension),
//! - an async tower layer before it (`tower::filter::AsyncFilterLayer`, as a token
//!   lookup over the network would need),
//! - and, as the pitfall, `OrdersServer::with_interceptor`, which runs *after* the
//!   layer: the refusal tells the caller how to fix it.

use idem_test_support::net;
use idem_test_support::shop::orders_client::OrdersClient;
use idem_test_support::shop::orders_server::OrdersServer;
use idem_test_support::shop_fake::{Shop, create};

use std::net::SocketAddr;

use idem_core::config::ServiceConfig;
use idem_core::headers::reason;
use idem_server::idempotency::{IdempotencyLayer, tenant::FromExtension};
use idem_store::memory::MemoryStore;
use tonic::transport::{Channel, Server};
use tonic::{Code, Request, Status};
use tonic_types::StatusExt;

/// What the auth step establishes; `FromExtension` needs `AsRef<str>`.
#[derive(Clone)]
struct Tenant(String);

impl AsRef<str> for Tenant {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

const KEY: &str = "order-key-0001";

fn config() -> ServiceConfig {
    ServiceConfig::from_json(
        r#"{"methodConfig": [{
            "name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}],
            "idempotency": {}
        }]}"#,
    )
    .unwrap()
}

/// `authorization: Bearer token-<tenant>` → `Tenant(<tenant>)`.
fn tenant_of_token(metadata: &tonic::metadata::MetadataMap) -> Option<Tenant> {
    let v = metadata.get("authorization")?.to_str().ok()?;
    let tenant = v.strip_prefix("Bearer token-")?;
    Some(Tenant(tenant.to_owned()))
}

/// The usual tonic interceptor, extended to record who the caller is.
fn auth_interceptor(mut req: Request<()>) -> Result<Request<()>, Status> {
    let tenant =
        tenant_of_token(req.metadata()).ok_or_else(|| Status::unauthenticated("bad token"))?;
    req.extensions_mut().insert(tenant);
    Ok(req)
}

fn idempotency() -> IdempotencyLayer<MemoryStore> {
    IdempotencyLayer::new(MemoryStore::default(), &config())
        .tenant(FromExtension::<Tenant>::new())
        .check()
        .expect("a tenant source is set")
}

fn call(tenant: Option<&str>) -> Request<idem_test_support::shop::CreateOrderRequest> {
    let mut r = Request::new(create("ok"));
    r.metadata_mut()
        .insert("x-idempotency-key", KEY.parse().unwrap());
    if let Some(t) = tenant {
        r.metadata_mut().insert(
            "authorization",
            format!("Bearer token-{t}").parse().unwrap(),
        );
    }
    r
}

fn client(addr: SocketAddr) -> OrdersClient<Channel> {
    OrdersClient::new(net::channel(addr))
}

fn replayed(md: &tonic::metadata::MetadataMap) -> bool {
    md.get("x-idempotency-replayed")
        .is_some_and(|v| v == "true")
}

/// Two tenants with the same key: each runs once and replays its own response.
async fn replays_per_tenant(addr: SocketAddr, shop: &Shop) {
    let mut c = client(addr);
    let a1 = c.create_order(call(Some("acme"))).await.unwrap();
    let a2 = c.create_order(call(Some("acme"))).await.unwrap();
    assert!(!replayed(a1.metadata()));
    assert!(
        replayed(a2.metadata()),
        "the same tenant's duplicate replays"
    );
    assert_eq!(a1.get_ref(), a2.get_ref());
    assert_eq!(shop.runs(), 1);

    let b1 = c.create_order(call(Some("globex"))).await.unwrap();
    assert!(!replayed(b1.metadata()), "another tenant's key is its own");
    assert_eq!(shop.runs(), 2);
    assert_ne!(a1.get_ref().order_id, b1.get_ref().order_id);
    let b2 = c.create_order(call(Some("globex"))).await.unwrap();
    assert!(replayed(b2.metadata()));
    assert_eq!(b1.get_ref(), b2.get_ref());
    assert_eq!(shop.runs(), 2);
}

/// After [`replays_per_tenant`]: the auth layer refuses a caller without credentials
/// before idem sees it, so nothing more runs.
async fn refused_without_credentials(addr: SocketAddr, shop: &Shop) {
    let err = client(addr).create_order(call(None)).await.unwrap_err();
    assert_eq!(
        (err.code(), err.message()),
        (Code::Unauthenticated, "bad token")
    );
    assert_eq!(shop.runs(), 2);
}

#[tokio::test]
async fn an_interceptor_layer_before_idem_sets_the_tenant_and_replays_per_tenant() {
    let shop = Shop::new();
    let (addr, incoming) = net::bind().await;
    let router = Server::builder()
        .layer(tonic::service::InterceptorLayer::new(auth_interceptor))
        .layer(idempotency())
        .add_service(OrdersServer::new(shop.clone()));
    tokio::spawn(router.serve_with_incoming(incoming));

    replays_per_tenant(addr, &shop).await;

    refused_without_credentials(addr, &shop).await;
}

/// Stands for a token check that needs I/O (an auth server, a database).
async fn lookup_tenant(headers: &http::HeaderMap) -> Option<Tenant> {
    tokio::task::yield_now().await;
    tenant_of_token(&tonic::metadata::MetadataMap::from_headers(headers.clone()))
}

#[tokio::test]
async fn an_async_auth_layer_before_idem_sets_the_tenant_and_replays_per_tenant() {
    let shop = Shop::new();
    let (addr, incoming) = net::bind().await;
    let auth = tower::filter::AsyncFilterLayer::new(
        |mut req: http::Request<tonic::body::Body>| async move {
            match lookup_tenant(req.headers()).await {
                Some(tenant) => {
                    req.extensions_mut().insert(tenant);
                    Ok(req)
                }
                // tonic answers a `Status` error with that status.
                None => Err(Status::unauthenticated("bad token")),
            }
        },
    );
    let router = Server::builder()
        .layer(auth)
        .layer(idempotency())
        .add_service(OrdersServer::new(shop.clone()));
    tokio::spawn(router.serve_with_incoming(incoming));

    replays_per_tenant(addr, &shop).await;

    refused_without_credentials(addr, &shop).await;
}

#[tokio::test]
async fn with_interceptor_runs_after_idem_and_the_refusal_names_the_fix() {
    let shop = Shop::new();
    let (addr, incoming) = net::bind().await;
    let router =
        Server::builder()
            .layer(idempotency())
            .add_service(OrdersServer::with_interceptor(
                shop.clone(),
                auth_interceptor,
            ));
    tokio::spawn(router.serve_with_incoming(incoming));

    let err = client(addr)
        .create_order(call(Some("acme")))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    let info = err.get_details_error_info().expect("ErrorInfo");
    assert_eq!(
        (info.domain.as_str(), info.reason.as_str()),
        ("idem", reason::TENANT_MISSING)
    );
    for hint in [
        "with_interceptor",
        "runs after this layer",
        "before `IdempotencyLayer`",
        "tonic::service::InterceptorLayer",
    ] {
        assert!(
            err.message().contains(hint),
            "{hint:?} in {:?}",
            err.message()
        );
    }
    assert_eq!(shop.runs(), 0);
}

#[test]
fn a_layer_without_a_tenant_source_fails_its_check() {
    let layer = IdempotencyLayer::new(MemoryStore::default(), &config());
    let err = layer.clone().check().unwrap_err();
    assert_eq!(
        err.to_string(),
        "no tenant source configured, but the config protects shop.v1.Orders/CreateOrder: \
         set idem.tenant in the config or call IdempotencyLayer::tenant (e.g. \
         FromExtension after an auth layer)"
    );
    // Any source will do: one set in code, or the config's.
    assert!(layer.tenant(FromExtension::<Tenant>::new()).check().is_ok());
    let single = ServiceConfig::from_json(
        r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders"}], "idempotency": {}}],
            "idem": {"tenant": {"single": "acme"}}}"#,
    )
    .unwrap();
    assert!(IdempotencyLayer::from_config(&single).check().is_ok());
    // A config that protects nothing needs no tenant.
    let none = ServiceConfig::from_json(r#"{"methodConfig": []}"#).unwrap();
    assert!(IdempotencyLayer::from_config(&none).check().is_ok());
}
