//! [`OneWorker`]: an idem server with a memory store on a runtime of its own with one
//! worker thread, and [`InProgress`], the server observer that counts its protected
//! calls in progress. For measuring what parked calls cost the server (its tasks, its
//! throughput for other calls).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use idem_core::config::ServiceConfig;
use idem_server::idempotency::IdempotencyLayer;
use idem_server::idempotency::tenant::SingleTenant;
use idem_server::metrics::{ProtectedCallEnded, ServerObserver};
use idem_store::memory::MemoryStore;
use tonic::transport::Server;

use crate::net;
use crate::shop::orders_server::OrdersServer;
use crate::shop_fake::Shop;

/// Protected calls in progress on a server: started and not yet ended (the layer ends a
/// call when its response ended or was dropped, and its outcome, if it ran, is
/// recorded). Clones share the count.
#[derive(Clone, Debug, Default)]
pub struct InProgress(Arc<AtomicI64>);

impl InProgress {
    /// The calls in progress now.
    pub fn count(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}

impl ServerObserver for InProgress {
    fn call_started(&self, _: &str) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn call_ended(&self, _: &ProtectedCallEnded<'_>) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// An idem server ([`Shop`] behind the layer, tenant `t`) on a runtime of its own with
/// one worker thread; the runtime shuts down when this drops.
pub struct OneWorker {
    /// Where it listens.
    pub addr: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
    /// The service behind the layer.
    pub shop: Shop,
    /// The layer (clones share its state).
    pub layer: IdempotencyLayer<MemoryStore>,
    in_progress: InProgress,
}

impl OneWorker {
    /// Starts the server with the layer made from `config`.
    pub async fn start(config: &ServiceConfig) -> Self {
        let shop = Shop::new();
        let in_progress = InProgress::default();
        let layer = IdempotencyLayer::new(MemoryStore::default(), config)
            .tenant(SingleTenant::new("t"))
            .observer(in_progress.clone());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (addr, incoming) = runtime.spawn(net::bind()).await.unwrap();
        let server = Server::builder()
            .layer(layer.clone())
            .add_service(OrdersServer::new(shop.clone()))
            .serve_with_incoming(incoming);
        runtime.spawn(server);
        OneWorker {
            addr,
            runtime: Some(runtime),
            shop,
            layer,
            in_progress,
        }
    }

    /// Tasks alive on the server's runtime (the server's, its connections', its
    /// requests', the layer's).
    pub fn alive_tasks(&self) -> usize {
        self.runtime
            .as_ref()
            .unwrap()
            .handle()
            .metrics()
            .num_alive_tasks()
    }

    /// Protected calls in progress on the server now ([`InProgress`]).
    pub fn in_progress(&self) -> i64 {
        self.in_progress.count()
    }
}

impl Drop for OneWorker {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}
