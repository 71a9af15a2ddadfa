//! [`Idempotency`]: which calls are protected, and a protected call's key and tenant.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use idem_core::config::{IdempotencyPolicy, ServiceConfig};
use idem_core::key::IdempotencyKey;
use idem_store::{Scope, Store, TenantId};
use tonic::Status;
use tonic::body::Body;
use tower_service::Service;
use tracing::{Instrument, field};

use super::BoxError;
use super::context::Call;
use super::digest::scope_for;
use super::future::{Detach, ResponseFuture};
use super::layer::{Current, IdempotencyLayer, Shared};
use super::stats::Counter;
use super::status;
use crate::metrics::{self, CallTrace};

/// The idempotency middleware; see the [module docs](super).
pub struct Idempotency<S, St> {
    pub(crate) inner: S,
    pub(crate) shared: Arc<Shared<St>>,
}

impl<S: Clone, St> Clone for Idempotency<S, St> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, St: fmt::Debug> fmt::Debug for Idempotency<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("store", &self.shared.store)
            .finish_non_exhaustive()
    }
}

impl<S, St: Store> Idempotency<S, St> {
    /// Wraps `inner`, protecting the methods whose entry in `config` has an
    /// `idempotency` object and keeping records in `store`; the settings of
    /// [`IdempotencyLayer::new`]. To change them (tenant resolver, fingerprint hooks,
    /// handler bound), build the layer and apply it with `Layer::layer`.
    pub fn new(inner: S, store: St, config: &ServiceConfig) -> Self {
        Idempotency {
            inner,
            shared: IdempotencyLayer::new(store, config).shared,
        }
    }

    /// A layer that wraps services in `Idempotency`: [`IdempotencyLayer::new`].
    pub fn layer(store: St, config: &ServiceConfig) -> IdempotencyLayer<St> {
        IdempotencyLayer::new(store, config)
    }

    idem_core::define_inner_service_accessors!(inner);
}

/// What `call` decided before any I/O.
enum Route {
    Passthrough,
    Reject(Status),
    /// The record's scope (the key is read only to digest it), the caller's tenant as
    /// the store names it, and its name when a resolver gave one (a single tenant's is
    /// the layer's).
    Protect {
        scope: Scope,
        tenant: TenantId,
        name: Option<String>,
    },
}

/// Routes a call of a protected method by its key header and tenant. The key is checked
/// before the tenant, so a bad key is reported even to an unauthenticated caller; a
/// layer with no tenant source at all refuses first: nothing the caller sends can help.
fn route(
    shared: &Shared<impl Store>,
    current: &Current,
    policy: &IdempotencyPolicy,
    parts: &http::request::Parts,
) -> Route {
    let Some(resolver) = &current.tenant else {
        shared.log_no_tenant_source(parts.uri.path());
        return Route::Reject(status::tenant_source_missing());
    };
    let header = &current.config.settings().key_header;
    let mut values = parts.headers.get_all(header).iter();
    let key = match (values.next(), values.next()) {
        (None, _) if !policy.key_required => return Route::Passthrough,
        (None, _) => return Route::Reject(status::key_missing(header)),
        (Some(_), Some(_)) => return Route::Reject(status::key_repeated(header)),
        (Some(v), None) => match IdempotencyKey::validate(v.as_bytes()) {
            Ok(k) => k,
            Err(e) => return Route::Reject(status::key_invalid(e)),
        },
    };
    if let Some((name, id)) = &current.single {
        return Route::Protect {
            scope: scope_for(name, parts.uri.path(), key),
            tenant: *id,
            name: None,
        };
    }
    match resolver.tenant(parts) {
        Some(tenant) => Route::Protect {
            scope: scope_for(&tenant, parts.uri.path(), key),
            tenant: shared.tenant_ids.of(&tenant),
            name: Some(tenant),
        },
        None => Route::Reject(status::tenant_missing()),
    }
}

impl<S, St, ResBody> Service<Request<Body>> for Idempotency<S, St>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
    St: Store,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        // The generation this call keeps, whatever a reload does meanwhile: read under
        // the lock (no reference count to touch), which is let go before the inner
        // service is called.
        let current = self.shared.current_read();
        let Some(policy) = current
            .config
            .lookup_path(req.uri().path())
            .and_then(|m| m.idempotency())
        else {
            let path = req.uri().path();
            // The one cost an unprotected call pays: a header lookup.
            let ignored = req
                .headers()
                .contains_key(&current.config.settings().key_header)
                && self.shared.ignored_keys.note(&current.config, path);
            let reason = ignored.then_some(metrics::KEY_IGNORED);
            let trace = CallTrace::passthrough(self.shared.observer.as_ref(), path, reason);
            drop(current);
            return ResponseFuture::passthrough(self.inner.call(req), trace);
        };
        let (parts, body) = req.into_parts();
        match route(&self.shared, &current, policy, &parts) {
            Route::Passthrough => {
                drop(current);
                let trace =
                    CallTrace::passthrough(self.shared.observer.as_ref(), parts.uri.path(), None);
                ResponseFuture::passthrough(
                    self.inner.call(Request::from_parts(parts, body)),
                    trace,
                )
            }
            Route::Reject(status) => {
                self.shared.stats.inc(Counter::rejected);
                let path = parts.uri.path();
                let span = call_span(path, None);
                let trace =
                    CallTrace::start(self.shared.observer.as_ref(), || Arc::from(path), &span);
                span.in_scope(|| {
                    tracing::info!(code = ?status.code(), "{}", status.message());
                    metrics::outcome_of(trace.as_deref(), "rejected");
                });
                let resp = status.into_http();
                ResponseFuture::ready(match trace {
                    Some(t) => metrics::watch(resp, t),
                    None => resp,
                })
            }
            Route::Protect {
                scope,
                tenant,
                name,
            } => {
                let path = parts.uri.path();
                let span = call_span(path, Some(&scope));
                // The path is copied only for an observer's trace.
                let trace =
                    CallTrace::start(self.shared.observer.as_ref(), || Arc::from(path), &span);
                let call = Call {
                    shared: self.shared.clone(),
                    policy: policy.clone(),
                    scope,
                    tenant,
                    single_tenant: current.single_tenant,
                    trace: trace.map(|t| {
                        let name = name.unwrap_or_else(|| {
                            current
                                .single
                                .as_ref()
                                .map_or_else(String::new, |s| s.0.to_string())
                        });
                        t.with_tenant(name)
                    }),
                };
                drop(current);
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                let trace = call.trace.clone();
                let detach = Detach {
                    admission: self.shared.admission.clone(),
                    trace: trace.clone(),
                    span: span.clone(),
                };
                let fut = metrics::traced(trace, call.run(inner, parts, body));
                ResponseFuture::protected(Box::pin(fut.instrument(span)), detach)
            }
        }
    }
}

/// The span of a protected call: OpenTelemetry's RPC attributes, the scope's first 16
/// hex digits (never the key), and what the call came to.
fn call_span(path: &str, scope: Option<&idem_store::Scope>) -> tracing::Span {
    let (service, method) = path
        .trim_start_matches('/')
        .split_once('/')
        .unwrap_or((path, ""));
    // The scope's hex is formatted only for an enabled span: a disabled span's field
    // values are still evaluated when `tracing`'s `log` feature is on (sqlx turns it on).
    let span = tracing::info_span!(
        "idempotency",
        method = %path,
        scope = field::Empty,
        rpc.system = "grpc",
        rpc.service = service,
        rpc.method = method,
        rpc.grpc.status_code = field::Empty,
        outcome = field::Empty,
        idem.record = field::Empty,
        fence = field::Empty,
    );
    if let Some(s) = scope
        && !span.is_disabled()
    {
        span.record("scope", field::display(s.short_hex()));
    }
    span
}
