//! [`IdempotencyLayer`].

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use bytes::Bytes;
use idem_core::config::{ConfigError, ServiceConfig, TenantSource};
use idem_core::descriptor::Descriptors;
use idem_store::{Store, TenantId, memory::MemoryStore};
use tower_layer::Layer;

use super::Idempotency;
use super::admission::{Admission, Limits};
use super::digest::tenant_id;
use super::error::{CheckError, NoTenantSource};
use super::ignored::IgnoredKeys;
use super::stats::IdempotencyStats;
use super::tenant::{FromHeader, SingleTenant, TenantResolver};
use crate::metrics::ServerObserver;

/// A per-method fingerprint hook: maps the request's (decompressed) messages to the
/// canonical bytes that are digested instead of the messages themselves, e.g. the
/// message re-encoded with a client timestamp field cleared.
pub type FingerprintHook = Arc<dyn Fn(&[Bytes]) -> Vec<u8> + Send + Sync>;

/// One generation of what a reload replaces, read whole by each call when it starts:
/// a call keeps the policy and tenant it was routed with.
pub(crate) struct Current {
    pub(crate) config: Arc<ServiceConfig>,
    /// `None`: neither the config nor the builder chose a source.
    pub(crate) tenant: Option<Arc<dyn TenantResolver>>,
    /// The source is a single tenant (`SingleTenant`, `idem.tenant.single`): its share
    /// of the handler and waiter bounds is the whole, unless the config sets it.
    pub(crate) single_tenant: bool,
    /// The one tenant's name and store name, for a single tenant: a call then reads
    /// neither a resolver nor the tenant id cache.
    pub(crate) single: Option<(Arc<str>, TenantId)>,
}

impl Current {
    /// The resolver given in code wins over the config's `idem.tenant`, at build time
    /// and on every reload.
    fn new(config: Arc<ServiceConfig>, code: Option<&CodeTenant>) -> Self {
        let (tenant, single) = match code {
            Some((r, single)) => (Some(r.clone()), single.clone()),
            None => (
                config_tenant(&config),
                match &config.settings().tenant {
                    TenantSource::Single(t) => Some(Arc::from(t.as_str())),
                    _ => None,
                },
            ),
        };
        Current {
            config,
            tenant,
            single_tenant: single.is_some(),
            single: single.map(|name| {
                let id = tenant_id(&name);
                (name, id)
            }),
        }
    }

    /// `Err` when a method is protected but no tenant can ever be found for it.
    fn check(&self) -> Result<(), NoTenantSource> {
        if self.tenant.is_some() {
            return Ok(());
        }
        match first_protected(&self.config) {
            Some(method) => Err(NoTenantSource { method }),
            None => Ok(()),
        }
    }
}

/// A resolver set in code, with the one tenant's name when it is a [`SingleTenant`].
type CodeTenant = (Arc<dyn TenantResolver>, Option<Arc<str>>);

fn config_tenant(config: &ServiceConfig) -> Option<Arc<dyn TenantResolver>> {
    match &config.settings().tenant {
        TenantSource::Unset => None,
        TenantSource::Single(t) => Some(Arc::new(SingleTenant::new(t.clone()))),
        TenantSource::Header(h) => Some(Arc::new(FromHeader::new(h.clone()))),
    }
}

fn first_protected(config: &ServiceConfig) -> Option<String> {
    config
        .method_configs()
        .iter()
        .filter(|m| m.idempotency().is_some())
        .find_map(|m| m.names().first())
        .map(|n| n.to_string())
}

/// What every clone of the layer and its services share.
pub(crate) struct Shared<St> {
    pub(crate) store: St,
    current: RwLock<Arc<Current>>,
    /// The resolver set with [`IdempotencyLayer::tenant`] (and whether it is a
    /// [`SingleTenant`]); kept across reloads.
    code_tenant: Option<CodeTenant>,
    /// The store is a `MemoryStore` that [`IdempotencyLayer::from_config`] built from
    /// the config: [`IdempotencyLayer::tenant`] may rebuild it, still empty, for one
    /// tenant.
    store_from_config: bool,
    pub(crate) hooks: HashMap<String, FingerprintHook>,
    pub(crate) stats: IdempotencyStats,
    /// Handler runs in progress (including runs whose caller went away) and waiting
    /// duplicates, against the layer's bounds.
    pub(crate) admission: Arc<Admission>,
    /// The handler bounds set with the builder, which win over the config's.
    pins: HandlerPins,
    /// The missing tenant source was logged when the layer wrapped a service / when a
    /// call was refused for it (once each, so a misconfigured server does not flood).
    logged_at_layer: AtomicBool,
    logged_at_call: AtomicBool,
    pub(crate) observer: Option<Arc<dyn ServerObserver>>,
    /// Tenants' store names, computed once each.
    pub(crate) tenant_ids: Arc<super::digest::TenantIds>,
    /// The leases of records this layer's handlers hold, renewed by one task.
    pub(crate) renewals: Arc<super::renewal::Renewals>,
    /// The services' descriptors ([`IdempotencyLayer::descriptors`]), applied to the
    /// config at build and on every reload.
    descriptors: Option<Arc<Descriptors>>,
    /// Why the config did not match the descriptors (then it is kept as given).
    descriptor_error: Option<ConfigError>,
    /// The methods whose ignored keys were logged (once each).
    pub(crate) ignored_keys: Arc<IgnoredKeys>,
}

impl<St: Clone> Clone for Shared<St> {
    /// A copy for a builder method on a layer whose `Arc` is shared: it starts from the
    /// current generation and is reloaded on its own from then on.
    fn clone(&self) -> Self {
        Shared {
            store: self.store.clone(),
            current: RwLock::new(self.current()),
            code_tenant: self.code_tenant.clone(),
            store_from_config: self.store_from_config,
            hooks: self.hooks.clone(),
            stats: self.stats.clone(),
            admission: self.admission.clone(),
            pins: self.pins,
            logged_at_layer: AtomicBool::new(false),
            logged_at_call: AtomicBool::new(false),
            observer: self.observer.clone(),
            tenant_ids: self.tenant_ids.clone(),
            renewals: self.renewals.clone(),
            descriptors: self.descriptors.clone(),
            descriptor_error: self.descriptor_error.clone(),
            ignored_keys: self.ignored_keys.clone(),
        }
    }
}

impl<St: Store> Shared<St> {
    /// Rebuilds the `MemoryStore` that `from_config` built, if it holds no record yet,
    /// with the per-tenant bounds left unset at the store's own (one tenant).
    fn give_the_tenant_the_whole_store(&mut self) {
        if !self.store_from_config {
            return;
        }
        let Some(memory) = (&mut self.store as &mut dyn Any).downcast_mut::<MemoryStore>() else {
            return;
        };
        let whole = memory.settings().clone().for_single_tenant();
        if &whole == memory.settings() {
            return;
        }
        if memory.is_empty() {
            *memory = MemoryStore::new(whole);
        } else {
            tracing::warn!(
                records = memory.len(),
                "IdempotencyLayer::tenant(SingleTenant) after the layer served calls: its \
                 MemoryStore keeps per-tenant bounds of a share of the store; set the \
                 tenant before serving (or idem.tenant single in the config)"
            );
        }
    }
}

impl<St> Shared<St> {
    /// The generation a call starting now uses.
    pub(crate) fn current(&self) -> Arc<Current> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The generation a call starting now uses, read in place (hold it briefly: a
    /// reload waits for it).
    pub(crate) fn current_read(&self) -> std::sync::RwLockReadGuard<'_, Arc<Current>> {
        self.current.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn set_current(&self, current: Current) {
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(current);
    }

    /// Logs, once per layer, that protected calls are refused for want of a tenant
    /// source (called when a call is refused for it).
    pub(crate) fn log_no_tenant_source(&self, path: &str) {
        if !self.logged_at_call.swap(true, Ordering::Relaxed) {
            tracing::error!(
                method = path,
                "idempotency layer misconfigured: no tenant source (set idem.tenant or \
                 IdempotencyLayer::tenant); every protected call is refused with \
                 FAILED_PRECONDITION"
            );
        }
    }
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
            .field("limits", &self.shared.admission.limits)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer<MemoryStore> {
    /// A layer over a [`MemoryStore`] with the config's `idem.memoryStore` bounds: the
    /// usual start for a single-process server.
    ///
    /// With a single tenant (`idem.tenant` `single`, or a [`SingleTenant`] given to
    /// [`tenant`](IdempotencyLayer::tenant)) the tenant gets the whole store: each
    /// per-tenant bound the config leaves unset is the store's
    /// ([`MemoryStoreSettings::for_single_tenant`](idem_core::config::MemoryStoreSettings::for_single_tenant)).
    ///
    /// ```
    /// # use idem_core::config::ServiceConfig;
    /// # use idem_server::idempotency::IdempotencyLayer;
    /// let config = ServiceConfig::from_json(r#"{
    ///   "methodConfig": [{"name": [{"service": "shop.v1.Orders"}], "idempotency": {}}],
    ///   "idem": {"tenant": {"single": "acme"}, "memoryStore": {"maxEntries": 10}}
    /// }"#).unwrap();
    /// let layer = IdempotencyLayer::from_config(&config).check().unwrap();
    /// assert_eq!(layer.store().settings().max_entries, 10);
    /// ```
    pub fn from_config(config: &ServiceConfig) -> Self {
        let store = MemoryStore::new(config.settings().memory_store.clone());
        let mut layer = Self::new(store, config);
        Arc::make_mut(&mut layer.shared).store_from_config = true;
        layer
    }
}

impl<St: Store> IdempotencyLayer<St> {
    /// A layer protecting the methods whose entry in `config` has an `idempotency`
    /// object, keeping records in `store`. With a [`MemoryStore`],
    /// [`from_config`](IdempotencyLayer::from_config) builds the store from the config
    /// too; a `MemoryStore` whose bounds differ from the config's `idem.memoryStore` is
    /// kept as given, with a warning.
    ///
    /// The tenant source is the config's `idem.tenant` (`single` → [`SingleTenant`],
    /// `header` → [`FromHeader`]), unless [`tenant`](Self::tenant) sets a resolver.
    /// Call [`check`](Self::check) once built: with no source at all, every protected
    /// call would be refused.
    pub fn new(store: St, config: &ServiceConfig) -> Self {
        Self::from_arc(store, Arc::new(config.clone()))
    }

    /// [`new`](Self::new) with a shared config.
    pub fn from_arc(store: St, config: Arc<ServiceConfig>) -> Self {
        warn_if_memory_store_differs(&store, &config);
        let limits = Limits::new(config.settings());
        IdempotencyLayer {
            shared: Arc::new(Shared {
                store,
                current: RwLock::new(Arc::new(Current::new(config, None))),
                code_tenant: None,
                store_from_config: false,
                hooks: HashMap::new(),
                stats: IdempotencyStats::default(),
                admission: Admission::new(limits),
                pins: HandlerPins::default(),
                logged_at_layer: AtomicBool::new(false),
                logged_at_call: AtomicBool::new(false),
                observer: None,
                tenant_ids: Arc::default(),
                renewals: Arc::default(),
                descriptors: None,
                descriptor_error: None,
                ignored_keys: Arc::default(),
            }),
        }
    }

    fn edit(mut self, f: impl FnOnce(&mut Shared<St>)) -> Self {
        f(Arc::make_mut(&mut self.shared));
        self
    }

    /// Resolves tenants with `resolver` (replacing the config's source, also across
    /// [`reload`](Self::reload)s), e.g. [`FromExtension`](super::tenant::FromExtension)
    /// after an auth layer.
    ///
    /// A [`SingleTenant`] gets the whole memory store: on a layer made by
    /// [`from_config`](IdempotencyLayer::from_config), whose store holds no record yet,
    /// the store is rebuilt with the per-tenant bounds the config leaves unset set to
    /// the store's own (take [`store`](Self::store) after this call). A `MemoryStore`
    /// you build yourself for one tenant: `MemoryStore::new(config.settings()
    /// .memory_store.clone().for_single_tenant())`. It also gets the whole of the
    /// handler and waiter bounds (`maxHandlersInFlight`, `maxWaiters`) unless the config
    /// sets the per-tenant shares; any other resolver gets a quarter per tenant by
    /// default.
    pub fn tenant(self, resolver: impl TenantResolver) -> Self {
        let single = (&resolver as &dyn Any)
            .downcast_ref::<SingleTenant>()
            .map(|t| Arc::<str>::from(t.0.as_str()));
        let single_tenant = single.is_some();
        let r: CodeTenant = (Arc::new(resolver), single);
        self.edit(|s| {
            let config = s.current().config.clone();
            s.set_current(Current::new(config, Some(&r)));
            s.code_tenant = Some(r);
            if single_tenant {
                s.give_the_tenant_the_whole_store();
            }
        })
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
    /// A tenant's share (`idem.maxHandlersPerTenant`, by default a quarter) is of this
    /// `max`.
    ///
    /// Each run also holds its request (up to `maxRequestBytes`) until the service has
    /// read it, so this bounds that memory too.
    pub fn max_handlers_in_flight(self, max: usize) -> Self {
        self.edit(|s| {
            s.pins.in_flight = Some(max);
            s.admission = Admission::new(s.pins.limits(s.current().config.settings()));
        })
    }

    /// Lets one tenant hold at most `max` of the handler runs
    /// ([`max_handlers_in_flight`](Self::max_handlers_in_flight)), replacing the config's
    /// `idem.maxHandlersPerTenant` (default a quarter of the bound, all of it for a
    /// [`SingleTenant`]). Past it the tenant's new calls are refused with
    /// RESOURCE_EXHAUSTED (`OVERLOADED`, bound `tenant_handlers`, with a retry delay)
    /// while other tenants' run.
    pub fn max_handlers_per_tenant(self, max: usize) -> Self {
        self.edit(|s| {
            s.pins.per_tenant = Some(max);
            s.admission = Admission::new(s.pins.limits(s.current().config.settings()));
        })
    }

    /// Tells `observer` about every call (default none).
    pub fn observer(self, observer: impl ServerObserver) -> Self {
        let o: Arc<dyn ServerObserver> = Arc::new(observer);
        self.edit(|s| s.observer = Some(o))
    }

    /// Makes the services' descriptors the source of truth, now and on every
    /// [`reload`](Self::reload): every configured name must match a real service or
    /// method, and side-effecting methods (no `idempotency_level`) without an
    /// `idempotency` object are protected with a key optional, unless the config opts
    /// them out with `"idempotency": false`. See
    /// [`ServiceConfig::with_descriptors`] for every rule. Resolved here, once: a call
    /// costs what it did.
    ///
    /// A mismatch keeps the config as given and fails [`check`](Self::check).
    ///
    /// ```
    /// # use idem_core::config::ServiceConfig;
    /// # use idem_core::descriptor::{Descriptors, IdempotencyLevel, Streaming};
    /// # use idem_server::idempotency::IdempotencyLayer;
    /// let descriptors = Descriptors::default().with_service("payments.v1.Payments", [
    ///     ("Charge".to_owned(), IdempotencyLevel::IdempotencyUnknown, Streaming::Unary),
    /// ]).unwrap();
    /// // In a service: `Descriptors::from_file_descriptor_set(include_bytes!(..))`.
    /// let typo = ServiceConfig::from_json(r#"{"methodConfig": [
    ///   {"name": [{"service": "payments.v1.Payments", "method": "Charg"}], "idempotency": {}}
    /// ], "idem": {"tenant": {"single": "acme"}}}"#).unwrap();
    /// let err = IdempotencyLayer::from_config(&typo).descriptors(descriptors).check().unwrap_err();
    /// assert!(err.to_string().contains("did you mean `payments.v1.Payments/Charge`?"));
    /// ```
    pub fn descriptors(self, descriptors: impl Into<Arc<Descriptors>>) -> Self {
        let d = descriptors.into();
        self.edit(|s| {
            s.descriptors = Some(d.clone());
            let current = s.current();
            match current.config.apply_descriptors_logged(&d) {
                Ok(config) => {
                    s.descriptor_error = None;
                    s.set_current(Current::new(Arc::new(config), s.code_tenant.as_ref()));
                }
                Err(e) => s.descriptor_error = Some(e),
            }
        })
    }

    /// Checks that the layer can serve the methods it protects, and returns it: call it
    /// after the builder methods, before serving.
    ///
    /// # Errors
    /// [`CheckError::Descriptors`] when the config does not match the descriptors given
    /// to [`descriptors`](Self::descriptors) (every mismatch listed);
    /// [`CheckError::NoTenantSource`] when the config protects a method but neither its
    /// `idem.tenant` nor [`tenant`](Self::tenant) chose where tenants come from (every
    /// protected call would be refused).
    pub fn check(self) -> Result<Self, CheckError> {
        if let Some(e) = &self.shared.descriptor_error {
            return Err(CheckError::Descriptors(e.clone()));
        }
        self.shared.current().check()?;
        Ok(self)
    }

    /// Replaces the service config for every clone of this layer and every service
    /// made from it: which methods are protected, their policies, the key header and
    /// the config's tenant source (a resolver set with [`tenant`](Self::tenant) stays).
    /// Calls already running keep the policy and tenant they started with; records,
    /// counters and handler runs in progress are kept.
    ///
    /// Read once, at build: the store's settings (`idem.memoryStore`, `idem.redis`) and
    /// `idem.maxHandlersInFlight`. A reload that changes them logs a warning and leaves
    /// them as they are.
    ///
    /// # Errors
    /// [`CheckError::NoTenantSource`] when the new config protects a method and no
    /// tenant source would be left, [`CheckError::Descriptors`] when it does not match
    /// the layer's [`descriptors`](Self::descriptors); the layer then keeps its current
    /// config.
    pub fn reload(&self, config: &ServiceConfig) -> Result<(), CheckError> {
        let shared = &self.shared;
        let config = match &shared.descriptors {
            Some(d) => config
                .apply_descriptors_logged(d)
                .map_err(CheckError::Descriptors)?,
            None => config.clone(),
        };
        let next = Current::new(Arc::new(config.clone()), shared.code_tenant.as_ref());
        next.check()?;
        let configured = shared.pins.limits(config.settings());
        let in_use = shared.admission.limits;
        if configured != in_use {
            tracing::warn!(
                ?configured,
                ?in_use,
                "idem.maxHandlersInFlight, maxHandlersPerTenant, maxDetachedHandlers, maxWaiters and maxWaitersPerTenant are read at build: the reload leaves them unchanged"
            );
        }
        warn_if_memory_store_differs(&shared.store, &config);
        shared.set_current(next);
        Ok(())
    }

    /// The layer's counters (shared by every service it makes).
    pub fn stats(&self) -> IdempotencyStats {
        self.shared.stats.clone()
    }

    /// Handler runs in progress now: from their claim until their outcome is recorded,
    /// runs whose caller went away included (at most
    /// [`max_handlers_in_flight`](Self::max_handlers_in_flight)).
    pub fn handlers_in_flight(&self) -> usize {
        self.shared.admission.handlers_in_flight()
    }

    /// Handler runs in progress whose caller went away before it got its answer (they
    /// run on to record their outcome); while `idem.maxDetachedHandlers` of them run,
    /// new protected calls are refused.
    ///
    /// A detached run leaves [`handlers_in_flight`](Self::handlers_in_flight) as its
    /// handler's future ends and this count just after, when its task ends: the two are
    /// separate gauges, so a reader may see this one above the other for that moment.
    pub fn handlers_detached(&self) -> usize {
        self.shared.admission.detached_in_flight()
    }

    /// Duplicates waiting now for a call in progress with their key (at most
    /// `idem.maxWaiters`).
    pub fn waiters(&self) -> usize {
        self.shared.admission.waiting()
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.shared.store
    }

    /// The service config calls starting now are routed with (the last one given to
    /// [`new`](Self::new) or [`reload`](Self::reload)).
    pub fn config(&self) -> Arc<ServiceConfig> {
        self.shared.current().config.clone()
    }
}

/// Handler bounds set in code, applied over the config's.
#[derive(Debug, Clone, Copy, Default)]
struct HandlerPins {
    in_flight: Option<usize>,
    per_tenant: Option<usize>,
}

impl HandlerPins {
    fn limits(self, settings: &idem_core::config::IdemSettings) -> Limits {
        let mut s = settings.clone();
        if let Some(n) = self.in_flight {
            s.max_handlers_in_flight = n;
        }
        if let Some(n) = self.per_tenant {
            s.max_handlers_per_tenant = Some(n);
        }
        Limits::new(&s)
    }
}

/// A `MemoryStore` built with other bounds than the config's `idem.memoryStore` is kept
/// as given; say so, since the config reads as if it applied. The config's settings
/// for one tenant (`for_single_tenant`: what `from_config` builds for a [`SingleTenant`]
/// given in code) are the config's too.
fn warn_if_memory_store_differs<St: Any>(store: &St, config: &ServiceConfig) {
    let Some(memory) = (store as &dyn Any).downcast_ref::<MemoryStore>() else {
        return;
    };
    let configured = &config.settings().memory_store;
    if memory.settings() != configured
        && memory.settings() != &configured.clone().for_single_tenant()
    {
        tracing::warn!(
            store = ?memory.settings(),
            config = ?configured,
            "the MemoryStore's settings differ from the config's idem.memoryStore, which \
             does not apply to a store built apart: build it with \
             MemoryStore::new(config.settings().memory_store.clone()) (with \
             .for_single_tenant() for one tenant) or use IdempotencyLayer::from_config"
        );
    }
}

impl<S, St> Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        let failed = match &self.shared.descriptor_error {
            Some(e) => Some(CheckError::Descriptors(e.clone())),
            None => self.shared.current().check().err().map(CheckError::from),
        };
        if let Some(e) = failed
            && !self.shared.logged_at_layer.swap(true, Ordering::Relaxed)
        {
            tracing::error!(
                "idempotency layer misconfigured: {e}; every protected call will be refused"
            );
        }
        Idempotency {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The descriptors applied to a config, their warnings logged.
trait ApplyLogged {
    fn apply_descriptors_logged(&self, d: &Descriptors) -> Result<ServiceConfig, ConfigError>;
}

impl ApplyLogged for ServiceConfig {
    fn apply_descriptors_logged(&self, d: &Descriptors) -> Result<ServiceConfig, ConfigError> {
        let parsed = self.with_descriptors(d)?;
        for w in &parsed.warnings {
            tracing::warn!(path = %w.path, "service config: {}", w.message);
        }
        Ok(parsed.config)
    }
}
