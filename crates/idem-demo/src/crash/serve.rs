//! The instance process: serves the demo's `shop.v1.Orders` behind the fault injector
//! and (with idem) the idempotency layer, until it is killed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use idem_client::retry::{Retry, RetryLayer};
use idem_core::config::ServiceConfig;
use idem_server::drain::Drain;
use idem_server::idempotency::tenant::SingleTenant;
use idem_server::inbound::InboundLayer;
use idem_store::memory::MemoryStore;
use idem_test_support::shop::orders_client::OrdersClient;
use idem_test_support::shop::orders_server::{Orders, OrdersServer};
use tokio::signal::unix::{SignalKind, signal};
use tonic::transport::{Channel, Server};
use tonic::{Request, Response};
use tower::ServiceBuilder;

use super::args::{Pause, PausePoint, SERVE_ENV, ServeArgs, StoreKind};
use crate::faults::Faults;
use crate::fleet::serve_idem_until;
use crate::metrics::InstanceMetrics;
use crate::orders::{Ledger, LedgerOrders};
#[cfg(feature = "postgres")]
use crate::pg_orders::PgOrders;
use crate::store::PgStore;
#[cfg(feature = "redis")]
use crate::store::connect_redis;
use crate::{BoxError, Options};

/// In a test binary started by [`Launch::Test`](super::Launch::Test): serves the instance its environment
/// describes until the process is killed. Returns at once (doing nothing) when the
/// variable is not set, so the test that calls it passes in a normal run.
pub fn serve_from_env() {
    let Ok(text) = std::env::var(SERVE_ENV) else {
        return;
    };
    let args: Vec<String> = text.split('\n').map(str::to_owned).collect();
    let args = ServeArgs::parse(&args).expect("instance arguments");
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    if let Err(e) = runtime.block_on(serve(args)) {
        eprintln!("instance: {e}");
        std::process::exit(2);
    }
}

/// How long a SIGTERM'd instance may drain before it exits anyway.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Connection pool size of an instance's PostgreSQL store: handlers hold one for their
/// transaction, so it bounds the handlers that can write at once.
#[cfg(feature = "postgres")]
const PG_POOL: u32 = 24;

/// Serves one instance until the process is killed; prints `ready` on standard output
/// once it listens.
pub async fn serve(args: ServeArgs) -> Result<(), BoxError> {
    let config = ServiceConfig::from_file(&args.config)?;
    let pause = Arc::new(Pause::new(args.pause_at));
    let name = format!("instance-{}", args.instance);
    if let Some(port) = args.downstream {
        let svc = Chained {
            next: OrdersClient::new(
                ServiceBuilder::new()
                    .layer(RetryLayer::from_config(&config))
                    .service(idem_test_support::net::channel(SocketAddr::from((
                        [127, 0, 0, 1],
                        port,
                    )))),
            ),
            pause,
        };
        return serve_service(&args, &config, svc, None).await;
    }
    #[cfg(not(feature = "postgres"))]
    if let StoreKind::Postgres(_) = &args.store {
        return Err(crate::store::missing_feature("postgres", "postgres"));
    }
    #[cfg(feature = "postgres")]
    if let StoreKind::Postgres(url) = &args.store {
        let store = until_connected(|| {
            PgStore::builder(url.clone())
                .max_connections(PG_POOL)
                .connect()
        })
        .await?;
        let svc = PgOrders::new(
            store.pool().clone(),
            args.with_idem.then(|| store.clone()),
            name,
            pause,
        );
        return serve_service(&args, &config, svc, Some(store)).await;
    }
    let ledger = Arc::new(Ledger::append_to(&args.ledger)?);
    serve_service(&args, &config, LedgerOrders::new(ledger, name), None).await
}

/// Serves `svc` behind the fault injector, `InboundLayer` and (with idem) the
/// idempotency layer on the instance's store.
async fn serve_service<T: Orders>(
    args: &ServeArgs,
    config: &ServiceConfig,
    svc: T,
    postgres: Option<PgStore>,
) -> Result<(), BoxError> {
    let o = Options {
        unavailable: args.unavailable,
        drop: args.drop,
        latency: Duration::from_millis(args.latency_ms),
        ..Options::default()
    };
    let faults = Faults::new(&o, args.seed);
    let listener = bind_with_retries(SocketAddr::from(([127, 0, 0, 1], args.port))).await?;
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let svc = OrdersServer::new(svc);
    // SIGTERM (a rolling restart) drains: GOAWAY (and REFUSED_STREAM for streams that
    // still arrive, with idem), the calls in flight finish and record their outcome, then
    // the process exits. SIGKILL (a crash) does not.
    let drain = Drain::new().timeout(DRAIN_TIMEOUT);
    let mut sigterm = signal(SignalKind::terminate())?;
    let on_term = drain.clone();
    tokio::spawn(async move {
        sigterm.recv().await;
        on_term.start();
    });
    println!("ready");
    if !args.with_idem {
        // A plain tonic server, as users run one today: `serve_with_shutdown` on SIGTERM.
        let server = Server::builder()
            .layer(faults)
            .layer(InboundLayer::new())
            .add_service(svc)
            .serve_with_incoming_shutdown(incoming, drain.signal());
        drain.run(server).await?;
        return Ok(());
    }
    let metrics = InstanceMetrics::new(config);
    if let Some(port) = args.metrics_port {
        metrics.serve(port).await?;
    }
    let tenant = SingleTenant::new("demo");
    let server = async {
        match (&args.store, postgres) {
            #[cfg(not(feature = "postgres"))]
            (_, Some(never)) => match never {},
            #[cfg(feature = "postgres")]
            (_, Some(store)) => {
                let layer = metrics.server(store, "postgres", config).tenant(tenant);
                serve_idem_until(faults, layer, svc, incoming, &drain).await?;
            }
            #[cfg(not(feature = "redis"))]
            (StoreKind::Redis(_), None) => {
                return Err(crate::store::missing_feature("redis", "redis"));
            }
            #[cfg(feature = "redis")]
            (StoreKind::Redis(url), None) => {
                let store = until_connected(|| connect_redis(url)).await?;
                let layer = metrics.server(store, "redis", config).tenant(tenant);
                serve_idem_until(faults, layer, svc, incoming, &drain).await?;
            }
            _ => {
                // The one tenant gets the whole store.
                let settings = config.settings().memory_store.clone().for_single_tenant();
                let store = MemoryStore::new(settings);
                let layer = metrics.server(store, "memory", config).tenant(tenant);
                serve_idem_until(faults, layer, svc, incoming, &drain).await?;
            }
        }
        Ok::<(), BoxError>(())
    };
    let drained = drain.run(server).await?;
    if drained.timed_out {
        eprintln!("instance {}: {drained:?}", args.instance);
    }
    Ok(())
}

/// The first hop of a chain: forwards `CreateOrder` downstream (its key derived from
/// this call's record), then answers with the downstream's order.
struct Chained {
    next: OrdersClient<Retry<Channel>>,
    pause: Arc<Pause>,
}

idem_test_support::create_only_orders! {
    Chained, why = "the demo only creates orders";
    create_order(&self, request) {
        let order = self
            .next
            .clone()
            .create_order(Request::new(request.into_inner()))
            .await?
            .into_inner();
        self.pause.at(PausePoint::AfterDownstream).await;
        Ok(Response::new(order))
    }
}

/// Connects to the store, trying again for up to 30 s: an instance started while its
/// store is cut off (`--net-faults`) waits for it, as a deployed one would (used by the
/// Redis and PostgreSQL stores only).
#[cfg(any(feature = "redis", feature = "postgres"))]
async fn until_connected<T, E, F>(connect: impl Fn() -> F) -> Result<T, BoxError>
where
    F: std::future::Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    let mut tries = 0;
    loop {
        match connect().await {
            Ok(store) => return Ok(store),
            Err(_) if tries < 150 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

async fn bind_with_retries(addr: SocketAddr) -> Result<tokio::net::TcpListener, BoxError> {
    let mut tries = 0;
    loop {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => return Ok(l),
            Err(_) if tries < 300 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => return Err(format!("cannot bind {addr}: {e}").into()),
        }
    }
}
