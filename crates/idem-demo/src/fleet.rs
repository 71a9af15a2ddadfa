//! One run with every server instance in this process: the instances of a `Fleet`
//! share the demo's ledger, fault injector and store, and a client balances over them.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_client::retry::RetryLayer;
use idem_core::config::ServiceConfig;
use idem_server::idempotency::tenant::SingleTenant;
use idem_server::idempotency::{IdempotencyLayer, IdempotencyStats};
use idem_server::inbound::InboundLayer;
use idem_test_support::shop::orders_client::OrdersClient;
use idem_test_support::shop::orders_server::{Orders, OrdersServer};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::{Channel, Endpoint, Server};
use tower::ServiceBuilder;

use crate::faults::Faults;
use crate::metrics::DemoMetrics;
use crate::netfaults::Rig;
use crate::orders::{Ledger, LedgerOrders};
use crate::outage::Outage;
#[cfg(feature = "redis")]
use crate::store::connect_redis;
use crate::workload::{tally, workload_with_outage};
use crate::{BoxError, DemoStore, Options, RunReport};

/// One server instance of this process: its address and the task serving it.
struct InProcessInstance {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

/// What every instance of one run shares.
#[derive(Clone)]
struct Fleet {
    with_idem: bool,
    config: ServiceConfig,
    ledger: Arc<Ledger>,
    faults: Faults,
    store: DemoStore,
    /// With `--net-faults`: each instance's own connection to the store, through its
    /// own proxy (instance `i` uses entry `i`; `store` when there is none).
    instance_stores: Vec<DemoStore>,
    stats: Arc<Mutex<Vec<IdempotencyStats>>>,
    metrics: Option<DemoMetrics>,
}

impl Fleet {
    /// Calls the instances' layers answered from a stored record.
    fn replays(&self) -> u64 {
        let stats = self.stats.lock().expect("stats lock");
        stats.iter().map(|s| s.snapshot().replayed).sum()
    }

    /// Serves `svc` behind the fault injector, `InboundLayer` and `IdempotencyLayer`.
    fn serve_with_idem<St: idem_store::Store>(
        &self,
        store: St,
        svc: OrdersServer<LedgerOrders>,
        incoming: TcpListenerStream,
        kind: &'static str,
    ) -> JoinHandle<()> {
        if let Some(m) = &self.metrics {
            let layer = m.server_side().server(store, kind, &self.config);
            return self.serve_layer(layer, svc, incoming);
        }
        self.serve_layer(IdempotencyLayer::new(store, &self.config), svc, incoming)
    }

    fn serve_layer<St: idem_store::Store>(
        &self,
        layer: IdempotencyLayer<St>,
        svc: OrdersServer<LedgerOrders>,
        incoming: TcpListenerStream,
    ) -> JoinHandle<()> {
        let layer = layer.tenant(SingleTenant::new("demo"));
        self.stats.lock().expect("stats lock").push(layer.stats());
        let serving = serve_idem(self.faults.clone(), layer, svc, incoming);
        tokio::spawn(async move {
            let _ = serving.await;
        })
    }

    /// Serves instance `i` on `listener` until the task is aborted.
    fn spawn(&self, i: usize, listener: TcpListener) -> InProcessInstance {
        let addr = listener
            .local_addr()
            .expect("bound listener has an address");
        let incoming = TcpListenerStream::new(listener);
        let svc = OrdersServer::new(LedgerOrders::new(
            self.ledger.clone(),
            format!("instance-{i}"),
        ));
        let task = match self.instance_stores.get(i).unwrap_or(&self.store) {
            _ if !self.with_idem => {
                let faults = self.faults.clone();
                tokio::spawn(async move {
                    let _ = Server::builder()
                        .layer(faults)
                        .add_service(svc)
                        .serve_with_incoming(incoming)
                        .await;
                })
            }
            DemoStore::Memory(s) => self.serve_with_idem(s.clone(), svc, incoming, "memory"),
            #[cfg(feature = "redis")]
            DemoStore::Redis(s) => self.serve_with_idem(s.clone(), svc, incoming, "redis"),
            DemoStore::Faulty(s) => self.serve_with_idem(s.clone(), svc, incoming, "memory"),
        };
        InProcessInstance { addr, task }
    }
}

/// Serves `svc` on `incoming` behind the fault injector, `InboundLayer` and `layer`
/// (every demo server with idem, in this process or in an instance process).
pub(crate) async fn serve_idem<St: idem_store::Store, T: Orders>(
    faults: Faults,
    layer: IdempotencyLayer<St>,
    svc: OrdersServer<T>,
    incoming: TcpListenerStream,
) -> Result<(), tonic::transport::Error> {
    Server::builder()
        .layer(faults)
        .layer(InboundLayer::new())
        .layer(layer)
        .add_service(svc)
        .serve_with_incoming(incoming)
        .await
}

/// [`serve_idem`] until `drain` starts: tonic's graceful shutdown (GOAWAY), and the
/// drain's layer refuses the streams that still arrive (REFUSED_STREAM).
pub(crate) async fn serve_idem_until<St: idem_store::Store, T: Orders>(
    faults: Faults,
    layer: IdempotencyLayer<St>,
    svc: OrdersServer<T>,
    incoming: TcpListenerStream,
    drain: &idem_server::drain::Drain,
) -> Result<(), tonic::transport::Error> {
    Server::builder()
        .layer(drain.layer())
        .layer(faults)
        .layer(InboundLayer::new())
        .layer(layer)
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, drain.signal())
        .await
}

/// One channel balanced over the instances at `addrs`.
pub(crate) fn client_channel(addrs: &[SocketAddr], connect_timeout: Duration) -> Channel {
    let endpoints = addrs.iter().map(|a| {
        Endpoint::from_shared(format!("http://{a}"))
            .expect("valid endpoint")
            .connect_timeout(connect_timeout)
    });
    Channel::balance_list(endpoints)
}

/// The demo client's retry layer, observed by `metrics` when given. Without idem it
/// keeps the same retry policy, but no method is protected, so no key is sent.
pub(crate) fn retry_layer(
    config: &ServiceConfig,
    with_idem: bool,
    metrics: Option<&DemoMetrics>,
) -> RetryLayer {
    let retry = if with_idem {
        let builder = RetryLayer::builder().service_config(config.clone());
        let builder = match metrics {
            Some(m) => m.client(builder),
            None => builder,
        };
        builder.build().expect("a config needs no validation")
    } else {
        RetryLayer::from_config(&crate::options::strip_idempotency(config))
    };
    if let Some(m) = metrics {
        m.watch_client(&retry);
    }
    retry
}

/// Once `after` intents are done, kills `first` (its serving task aborted, its
/// connections dropped) and starts it again on the same port, so the client's balancer
/// reconnects to it.
async fn restart_after(
    after: usize,
    first: InProcessInstance,
    fleet: Fleet,
    done: Arc<AtomicU64>,
) -> InProcessInstance {
    while done.load(Ordering::Relaxed) < after as u64 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.task.abort();
    let _ = first.task.await;
    let mut tries = 0;
    let listener = loop {
        match TcpListener::bind(first.addr).await {
            Ok(l) => break l,
            Err(_) if tries < 200 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("cannot rebind {}: {e}", first.addr),
        }
    };
    fleet.spawn(0, listener)
}

/// With `--net-faults` on Redis: each instance's own store, connected to `o.redis`
/// through its own proxy (none for the other stores, and for a Redis Cluster: its nodes
/// tell the client where they are, so a private one is reached through
/// `o.store_proxies`, one per node, shared by every instance). Without the `redis` feature there is no
/// Redis store to proxy.
#[cfg(not(feature = "redis"))]
async fn proxied_stores(
    _: &Options,
    _: &DemoStore,
    _: &mut Rig,
) -> Result<Vec<DemoStore>, BoxError> {
    Ok(Vec::new())
}

/// With `--net-faults` on Redis: each instance's own store, connected to `o.redis`
/// through its own proxy (none for the other stores, and for a Redis Cluster: its nodes
/// tell the client where they are, so a private one is reached through
/// `o.store_proxies`, one per node, shared by every instance).
#[cfg(feature = "redis")]
async fn proxied_stores(
    o: &Options,
    store: &DemoStore,
    rig: &mut Rig,
) -> Result<Vec<DemoStore>, BoxError> {
    let DemoStore::Redis(_) = store else {
        return Ok(Vec::new());
    };
    let url = o
        .redis
        .as_deref()
        .ok_or("--net-faults on Redis needs Options::redis, the URL to proxy")?;
    let mut stores = Vec::new();
    if url.contains(',') {
        // A cluster behind proxies of its own (`o.store_proxies`): each instance its own
        // cluster connection through them, as separate processes would have.
        if !o.store_proxies.is_empty() {
            for _ in 0..o.instances {
                stores.push(DemoStore::Redis(connect_redis(url).await?));
            }
        }
        return Ok(stores);
    }
    for i in 0..o.instances {
        let via = rig.front_url(format!("instance-{i} -> redis"), url).await?;
        stores.push(DemoStore::Redis(connect_redis(&via).await?));
    }
    Ok(stores)
}

/// `with idem` or `without idem`.
pub(crate) fn label(with_idem: bool) -> &'static str {
    if with_idem {
        "with idem"
    } else {
        "without idem"
    }
}

/// Runs the workload once (with idem or without) and counts what happened.
///
/// With `o.restart_after = Some(n)`, instance 0 is killed (its serving task aborted, its
/// connections dropped) once `n` intents are done, and started again on the same port.
pub async fn run(
    o: &Options,
    with_idem: bool,
    config: &ServiceConfig,
    store: &DemoStore,
) -> Result<RunReport, BoxError> {
    let label = label(with_idem);
    let outage = Outage::default();
    let mut fleet = Fleet {
        with_idem,
        config: config.clone(),
        ledger: Arc::new(Ledger::default()),
        faults: Faults::new(o, o.seed).with_outage(outage.clone()),
        store: store.clone(),
        instance_stores: Vec::new(),
        stats: Arc::new(Mutex::new(Vec::new())),
        metrics: o
            .metrics_out
            .as_ref()
            .filter(|_| with_idem)
            .map(|_| DemoMetrics::new(config)),
    };
    let mut rig = Rig::default();
    if o.net_faults.is_some() {
        fleet.instance_stores = proxied_stores(o, store, &mut rig).await?;
        rig.adopt(&o.store_proxies);
    }
    let mut instances = Vec::new();
    let mut addrs = Vec::new();
    for i in 0..o.instances {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let instance = fleet.spawn(i, listener);
        addrs.push(match o.net_faults {
            Some(_) => {
                rig.front(format!("client -> instance-{i}"), instance.addr)
                    .await?
            }
            None => instance.addr,
        });
        instances.push(instance);
    }
    let driver = o
        .net_faults
        .as_ref()
        .map(|spec| rig.drive(spec, o.progress));

    let client = OrdersClient::new(
        ServiceBuilder::new()
            .layer(retry_layer(config, with_idem, fleet.metrics.as_ref()))
            .service(client_channel(&addrs, Duration::from_secs(2))),
    );

    let done = Arc::new(AtomicU64::new(0));
    let restarter = o.restart_after.map(|after| {
        let first = instances.remove(0);
        tokio::spawn(restart_after(after, first, fleet.clone(), done.clone()))
    });

    let outage_starter = o.outage_after.map(|after| {
        let (outage, done, length) = (outage.clone(), done.clone(), o.outage_for);
        tokio::spawn(async move {
            while done.load(Ordering::Relaxed) < after as u64 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            outage.start(length);
        })
    });
    let w = workload_with_outage(o, with_idem, label, &client, done, outage.clone()).await?;
    if let Some(starter) = outage_starter {
        starter.abort();
    }
    let net_faults = driver.map(|d| d.stop());
    let mut restarted = false;
    if let Some(r) = restarter {
        instances.push(r.await?);
        restarted = true;
    }
    for i in &instances {
        i.task.abort();
    }
    let mut report = tally(o, label, &fleet.ledger.orders(), w);
    report.attempts = fleet.faults.attempts();
    report.replays = fleet.replays();
    report.restarted = restarted;
    report.outage = outage.report();
    report.net_faults = net_faults;
    if let (Some(m), Some(path)) = (&fleet.metrics, &o.metrics_out) {
        // Server metrics of a call are recorded just after its response: let them land.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let m = m.clone();
        let path = path.clone();
        tokio::task::spawn_blocking(move || m.write(&path)).await??;
    }
    Ok(report)
}
