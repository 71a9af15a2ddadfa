//! [`IdempotencyLayer`].

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use idem_core::ServiceConfig;
use idem_core::config::TenantSource;
use tokio::sync::Semaphore;
use tower_layer::Layer;

use super::Idempotency;
use super::stats::IdempotencyStats;
use super::tenant::{FromHeader, NoTenant, SingleTenant, TenantResolver};
use idem_store::Store;

/// A per-method fingerprint hook: maps the request's (decompressed) messages to the
/// canonical bytes that are digested instead of the messages themselves, e.g. the
/// message re-encoded with a client timestamp field cleared.
pub type FingerprintHook = Arc<dyn Fn(&[Bytes]) -> Vec<u8> + Send + Sync>;

/// What every clone of the layer and its services share.
#[derive(Clone)]
pub(crate) struct Shared<St> {
    pub(crate) store: St,
    pub(crate) config: Arc<ServiceConfig>,
    pub(crate) tenant: Arc<dyn TenantResolver>,
    pub(crate) hooks: HashMap<String, FingerprintHook>,
    pub(crate) stats: IdempotencyStats,
    /// One permit per handler run in progress (including runs whose caller went away).
    pub(crate) handlers: Arc<Semaphore>,
    pub(crate) max_handlers: usize,
    pub(crate) observer: Option<crate::metrics::SharedObserver>,
}

/// Applies [`Idempotency`] to a tonic server. Cheap to clone (one `Arc`); does no I/O.
///
/// See the [module docs](super) for the behaviour and an example.
pub struct IdempotencyLayer<St> {
    pub(crate) shared: Arc<Shared<St>>,
}

impl<St> Clone for IdempotencyLayer<St> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            shared: self.shared.clone(),
        }
    }
}

impl<St: fmt::Debug> fmt::Debug for IdempotencyLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("store", &self.shared.store)
            .field("hooks", &self.shared.hooks.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl<St: Store> IdempotencyLayer<St> {
    /// A layer protecting the methods whose entry in `config` has an `idempotency`
    /// object, keeping records in `store`.
    ///
    /// The tenant source is the config's `idem.tenant` (`single` → [`SingleTenant`],
    /// `header` → [`FromHeader`]); when the config leaves it unset, every protected call
    /// is refused (UNAUTHENTICATED) until [`tenant`](Self::tenant) sets a resolver.
    pub fn new(store: St, config: &ServiceConfig) -> Self {
        Self::from_arc(store, Arc::new(config.clone()))
    }

    /// [`new`](Self::new) with a shared config.
    pub fn from_arc(store: St, config: Arc<ServiceConfig>) -> Self {
        let tenant: Arc<dyn TenantResolver> = match &config.settings().tenant {
            TenantSource::Unset => Arc::new(NoTenant),
            TenantSource::Single(t) => Arc::new(SingleTenant::new(t.clone())),
            TenantSource::Header(h) => Arc::new(FromHeader::new(h.clone())),
        };
        let max_handlers = config
            .settings()
            .max_handlers_in_flight
            .min(Semaphore::MAX_PERMITS);
        IdempotencyLayer {
            shared: Arc::new(Shared {
                store,
                config,
                tenant,
                hooks: HashMap::new(),
                stats: IdempotencyStats::default(),
                handlers: Arc::new(Semaphore::new(max_handlers)),
                max_handlers,
                observer: None,
            }),
        }
    }

    fn edit(mut self, f: impl FnOnce(&mut Shared<St>)) -> Self {
        f(Arc::make_mut(&mut self.shared));
        self
    }

    /// Resolves tenants with `resolver` (replacing the config's source), e.g.
    /// [`FromExtension`](super::tenant::FromExtension) after an auth layer.
    pub fn tenant(self, resolver: impl TenantResolver) -> Self {
        let r: Arc<dyn TenantResolver> = Arc::new(resolver);
        self.edit(|s| s.tenant = r)
    }

    /// Fingerprints requests of `method_path` (`/shop.v1.Orders/CreateOrder`) with
    /// `hook` instead of their raw message bytes.
    pub fn fingerprint_with(
        self,
        method_path: impl Into<String>,
        hook: impl Fn(&[Bytes]) -> Vec<u8> + Send + Sync + 'static,
    ) -> Self {
        let (p, h): (String, FingerprintHook) = (method_path.into(), Arc::new(hook));
        self.edit(|s| {
            s.hooks.insert(p, h);
        })
    }

    /// Lets at most `max` handler runs be in progress at once (replacing the config's
    /// `idem.maxHandlersInFlight`, default 1024). A run counts from its claim until its
    /// outcome is recorded, also after its caller went away; past the bound, new
    /// protected calls are refused with RESOURCE_EXHAUSTED (`OVERLOADED`, with a retry
    /// delay) before they run. Duplicates answered from the store need no run.
    ///
    /// Each run also holds its request (up to `maxRequestBytes`) until the service has
    /// read it, so this bounds that memory too.
    pub fn max_handlers_in_flight(self, max: usize) -> Self {
        let max = max.min(Semaphore::MAX_PERMITS);
        let handlers = Arc::new(Semaphore::new(max));
        self.edit(|s| {
            s.handlers = handlers;
            s.max_handlers = max;
        })
    }

    /// The layer's counters (shared by every service it makes).
    pub fn stats(&self) -> IdempotencyStats {
        self.shared.stats.clone()
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.shared.store
    }
}

impl<S, St> Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            shared: self.shared.clone(),
        }
    }
}
