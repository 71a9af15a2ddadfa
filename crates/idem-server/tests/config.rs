//! The layer and its config: a store built from `idem.memoryStore`, and `reload`.
//! A real tonic `Orders` server (the shared `shop_fake::Shop`) on 127.0.0.1.

use idem_test_support::net;
use idem_test_support::shop::orders_client::OrdersClient;
use idem_test_support::shop::orders_server::OrdersServer;
use idem_test_support::shop::{GetOrderRequest, Order};
use idem_test_support::shop_fake::{Shop, create};

use std::net::SocketAddr;

use idem_core::config::ServiceConfig;
use idem_core::headers::reason;
use idem_server::idempotency::{
    IdempotencyLayer,
    tenant::{FromExtension, SingleTenant},
};
use idem_store::{
    Store,
    memory::{MemoryStore, MemoryStoreSettings},
};
use tonic::transport::{Channel, Server};
use tonic::{Code, Request, Status};
use tonic_types::StatusExt;

fn serve<St: Store>(layer: IdempotencyLayer<St>, shop: &Shop) -> impl Future<Output = SocketAddr> {
    let shop = shop.clone();
    async move {
        let (addr, incoming) = net::bind().await;
        let router = Server::builder()
            .layer(layer)
            .add_service(OrdersServer::new(shop));
        tokio::spawn(router.serve_with_incoming(incoming));
        addr
    }
}

fn client(addr: SocketAddr) -> OrdersClient<Channel> {
    OrdersClient::new(net::channel(addr))
}

fn keyed<T>(msg: T, key: &str) -> Request<T> {
    let mut r = Request::new(msg);
    r.metadata_mut()
        .insert("x-idempotency-key", key.parse().unwrap());
    r
}

fn replayed(md: &tonic::metadata::MetadataMap) -> bool {
    md.get("x-idempotency-replayed")
        .is_some_and(|v| v == "true")
}

/// Sends `CreateOrder` for `sku` with `key`, which must be answered by a replay of
/// `original`.
async fn assert_replays(
    c: &mut OrdersClient<Channel>,
    sku: &str,
    key: &str,
    original: &tonic::Response<Order>,
) {
    let again = c.create_order(keyed(create(sku), key)).await.unwrap();
    assert!(replayed(again.metadata()));
    assert_eq!(again.get_ref(), original.get_ref());
}

fn assert_idem_error(s: &Status, code: Code, why: &str) {
    assert_eq!(s.code(), code, "{s:?}");
    let info = s.get_details_error_info().expect("ErrorInfo");
    assert_eq!((info.domain.as_str(), info.reason.as_str()), ("idem", why));
}

// ---------------------------------------------------------------- store from config

#[tokio::test]
async fn from_config_builds_the_memory_store_from_idem_memory_store() {
    let config = ServiceConfig::from_json(
        r#"{
          "methodConfig": [{"name": [{"service": "shop.v1.Orders"}], "idempotency": {}}],
          "idem": {
            "tenant": {"single": "acme"},
            "memoryStore": {"maxEntries": 10, "maxEntriesPerTenant": 10}
          }
        }"#,
    )
    .unwrap();
    let layer = IdempotencyLayer::from_config(&config).check().unwrap();
    assert_eq!(layer.store().settings(), &config.settings().memory_store);
    let store = layer.store().clone();
    let shop = Shop::new();
    let mut c = client(serve(layer, &shop).await);
    for i in 0..10 {
        c.create_order(keyed(create("ok"), &format!("order-key-{i:04}")))
            .await
            .unwrap();
    }
    assert_eq!(store.len(), 10);
    let err = c
        .create_order(keyed(create("ok"), "order-key-0010"))
        .await
        .unwrap_err();
    assert_idem_error(&err, Code::ResourceExhausted, reason::STORE_FULL);
    assert_eq!(shop.runs(), 10, "the 11th call did not run");
}

/// Collects what `tracing` writes (INFO and above) while `f` runs.
fn logs_of(f: impl FnOnce()) -> String {
    idem_test_support::logs::capture(tracing::Level::INFO, f)
}

#[tokio::test]
async fn a_memory_store_built_apart_from_the_configs_settings_is_warned_about() {
    let config = ServiceConfig::from_json(
        r#"{"methodConfig": [], "idem": {"memoryStore": {"maxEntries": 10}}}"#,
    )
    .unwrap();
    let logs = logs_of(|| {
        let layer = IdempotencyLayer::new(MemoryStore::default(), &config);
        assert_eq!(
            layer.store().settings().max_entries,
            idem_store::memory::DEFAULT_MAX_ENTRIES,
            "kept as given"
        );
    });
    assert!(logs.contains("WARN"), "{logs}");
    assert!(logs.contains("idem.memoryStore"), "{logs}");
    assert!(logs.contains("IdempotencyLayer::from_config"), "{logs}");

    // Same settings (or a store built from them): nothing to say.
    let logs = logs_of(|| {
        let store = MemoryStore::new(config.settings().memory_store.clone());
        IdempotencyLayer::new(store, &config);
        IdempotencyLayer::from_config(&config);
        let default = ServiceConfig::from_json(r#"{"methodConfig": []}"#).unwrap();
        IdempotencyLayer::new(MemoryStore::new(MemoryStoreSettings::default()), &default);
    });
    assert_eq!(logs, "");
}

// ---------------------------------------------------------------- one tenant, whole store

/// Protects Orders; `tenant` is the `idem.tenant` member (or none), 8 records at most.
fn eight_records(tenant: &str) -> ServiceConfig {
    ServiceConfig::from_json(&format!(
        r#"{{
          "methodConfig": [{{"name": [{{"service": "shop.v1.Orders"}}], "idempotency": {{}}}}],
          "idem": {{{tenant} "memoryStore": {{"maxEntries": 8}}}}
        }}"#
    ))
    .unwrap()
}

/// Serves `layer` and makes fresh calls until one is refused: how many ran, and the
/// `bound` the refusal named.
async fn calls_until_full(layer: IdempotencyLayer<MemoryStore>) -> (usize, String) {
    let shop = Shop::new();
    let mut c = client(serve(layer, &shop).await);
    for i in 0..9 {
        let key = format!("order-key-{i:04}");
        if let Err(s) = c.create_order(keyed(create("ok"), &key)).await {
            assert_idem_error(&s, Code::ResourceExhausted, reason::STORE_FULL);
            let info = s.get_details_error_info().expect("ErrorInfo");
            return (shop.runs(), info.metadata["bound"].clone());
        }
    }
    panic!("9 fresh calls fit in a store of 8 records");
}

#[tokio::test]
async fn a_single_tenant_in_the_file_gets_the_whole_store() {
    let config = eight_records(r#""tenant": {"single": "acme"},"#);
    let mut layer = None;
    let logs = logs_of(|| layer = Some(IdempotencyLayer::from_config(&config).check().unwrap()));
    assert_eq!(logs, "", "the store is the config's");
    let layer = layer.unwrap();
    let s = layer.store().settings();
    assert_eq!(
        (s.tenant_entries_bound(), s.tenant_in_flight_bound()),
        (8, 8)
    );
    assert_eq!(s.tenant_bytes_bound(), s.max_bytes);
    assert_eq!(calls_until_full(layer).await, (8, "store_entries".into()));
}

#[tokio::test]
async fn a_single_tenant_in_code_gets_the_whole_store_without_a_warning() {
    // No idem.tenant in the file: SingleTenant given to the layer built from it.
    let config = eight_records("");
    assert_eq!(config.settings().memory_store.tenant_entries_bound(), 2);
    let mut layer = None;
    let logs = logs_of(|| {
        let l = IdempotencyLayer::from_config(&config)
            .tenant(SingleTenant::new("acme"))
            .check()
            .unwrap();
        l.reload(&config).unwrap();
        // A store built apart for one tenant, as the docs say: accepted too.
        let apart = config.settings().memory_store.clone().for_single_tenant();
        IdempotencyLayer::new(MemoryStore::new(apart), &config).tenant(SingleTenant::new("a"));
        layer = Some(l);
    });
    assert_eq!(
        logs, "",
        "no 'settings differ' warning for the one tenant's store"
    );
    let layer = layer.unwrap();
    let s = layer.store().settings();
    assert_eq!(
        s,
        &config.settings().memory_store.clone().for_single_tenant()
    );
    assert_eq!(
        (s.tenant_entries_bound(), s.tenant_in_flight_bound()),
        (8, 8)
    );
    assert_eq!(calls_until_full(layer).await, (8, "store_entries".into()));
}

#[tokio::test]
async fn a_resolver_of_many_tenants_in_code_leaves_each_a_share() {
    let config = eight_records("");
    let layer = IdempotencyLayer::from_config(&config)
        .tenant(|_: &http::request::Parts| Some("acme".to_owned()))
        .check()
        .unwrap();
    assert_eq!(layer.store().settings(), &config.settings().memory_store);
    assert_eq!(calls_until_full(layer).await, (2, "tenant_entries".into()));
}

#[tokio::test]
async fn a_layer_without_a_tenant_source_logs_an_error_when_it_wraps_a_service() {
    let config = ServiceConfig::from_json(
        r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders"}], "idempotency": {}}]}"#,
    )
    .unwrap();
    let logs = logs_of(|| {
        let layer = IdempotencyLayer::from_config(&config);
        let _svc = tower::Layer::layer(&layer, OrdersServer::new(Shop::new()));
        let _again = tower::Layer::layer(&layer, OrdersServer::new(Shop::new()));
    });
    assert_eq!(logs.matches("ERROR").count(), 1, "once per layer: {logs}");
    assert!(logs.contains("no tenant source configured"), "{logs}");
}

// ---------------------------------------------------------------- reload

const ONLY_CREATE: &str = r#"{
  "methodConfig": [
    {"name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}], "idempotency": {}}
  ],
  "idem": {"tenant": {"single": "acme"}}
}"#;

/// GetOrder protected too; CreateOrder keeps no response over 1 byte.
const CREATE_AND_GET: &str = r#"{
  "methodConfig": [
    {"name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}],
     "idempotency": {"maxResponseBytes": 1}},
    {"name": [{"service": "shop.v1.Orders", "method": "GetOrder"}], "idempotency": {}}
  ],
  "idem": {"tenant": {"single": "acme"}}
}"#;

fn get(key: &str) -> Request<GetOrderRequest> {
    keyed(
        GetOrderRequest {
            order_id: "o".into(),
        },
        key,
    )
}

#[tokio::test]
async fn reload_protects_a_new_method_keeps_records_and_calls_in_flight_keep_their_policy() {
    let layer = IdempotencyLayer::from_config(&ServiceConfig::from_json(ONLY_CREATE).unwrap())
        .check()
        .unwrap();
    let stats = layer.stats();
    let shop = Shop::new();
    let addr = serve(layer.clone(), &shop).await;
    let mut c = client(addr);

    // Before: GetOrder is not protected; CreateOrder is.
    let g1 = c.get_order(get("get-key-0001")).await.unwrap();
    let g2 = c.get_order(get("get-key-0001")).await.unwrap();
    assert!(!replayed(g2.metadata()));
    assert_ne!(g1.get_ref(), g2.get_ref(), "ran twice");
    let kept = c
        .create_order(keyed(create("ok"), "order-key-kept"))
        .await
        .unwrap();
    // A call in flight across the reload.
    let in_flight = tokio::spawn({
        let mut c = c.clone();
        async move {
            c.create_order(keyed(create("gate"), "order-key-flight"))
                .await
        }
    });
    shop.started().await;
    let runs_before = shop.runs();

    layer
        .reload(&ServiceConfig::from_json(CREATE_AND_GET).unwrap())
        .unwrap();
    assert!(
        layer
            .config()
            .lookup("shop.v1.Orders", "GetOrder")
            .unwrap()
            .idempotency()
            .is_some()
    );

    // The newly protected method: the next call is protected.
    c.get_order(get("get-key-0002")).await.unwrap();
    let dup = c.get_order(get("get-key-0002")).await.unwrap();
    assert!(replayed(dup.metadata()), "protected after the reload");
    assert_eq!(shop.runs(), runs_before + 1);

    // Records made before the reload are kept.
    assert_replays(&mut c, "ok", "order-key-kept", &kept).await;

    // The call in flight finishes under the policy it started with: its response is
    // retained although the new policy keeps nothing over 1 byte.
    shop.open_gate(1);
    let first = in_flight.await.unwrap().unwrap();
    assert_replays(&mut c, "gate", "order-key-flight", &first).await;

    // A call started after the reload follows the new policy.
    c.create_order(keyed(create("ok"), "order-key-new"))
        .await
        .unwrap();
    let err = c
        .create_order(keyed(create("ok"), "order-key-new"))
        .await
        .unwrap_err();
    assert_idem_error(
        &err,
        Code::FailedPrecondition,
        reason::RESPONSE_NOT_RETAINED,
    );

    let s = stats.snapshot();
    assert_eq!(s.executed, 4, "counters kept across the reload: {s:?}");
}

#[tokio::test]
async fn a_reload_that_would_leave_no_tenant_source_is_refused_and_changes_nothing() {
    let config = ServiceConfig::from_json(ONLY_CREATE).unwrap();
    let layer = IdempotencyLayer::from_config(&config);
    let shop = Shop::new();
    let mut c = client(serve(layer.clone(), &shop).await);

    let no_tenant = ServiceConfig::from_json(
        r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders"}], "idempotency": {}}]}"#,
    )
    .unwrap();
    let err = layer.reload(&no_tenant).unwrap_err();
    assert!(err.to_string().contains("shop.v1.Orders/*"), "{err}");
    assert!(
        layer
            .config()
            .lookup("shop.v1.Orders", "GetOrder")
            .is_none(),
        "the old config stays"
    );
    c.create_order(keyed(create("ok"), "order-key-0001"))
        .await
        .unwrap();

    // A resolver set in code stays across reloads, so the same config is fine then.
    #[derive(Clone)]
    struct Tenant;
    impl AsRef<str> for Tenant {
        fn as_ref(&self) -> &str {
            "acme"
        }
    }
    let coded = IdempotencyLayer::from_config(&config).tenant(FromExtension::<Tenant>::new());
    coded.reload(&no_tenant).unwrap();
    coded.check().unwrap();
}

#[tokio::test]
async fn a_reload_reaches_services_made_before_it_and_every_clone() {
    let layer = IdempotencyLayer::from_config(&ServiceConfig::from_json(ONLY_CREATE).unwrap());
    let clone = layer.clone();
    let shop = Shop::new();
    let mut c = client(serve(layer, &shop).await);
    clone
        .reload(&ServiceConfig::from_json(CREATE_AND_GET).unwrap())
        .unwrap();
    c.get_order(get("get-key-0003")).await.unwrap();
    let dup = c.get_order(get("get-key-0003")).await.unwrap();
    assert!(replayed(dup.metadata()));
}
