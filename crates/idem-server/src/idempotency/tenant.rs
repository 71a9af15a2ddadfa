//! Where a protected call's tenant comes from.
//!
//! The tenant is part of the record's scope, so two tenants that pick the same key never
//! see each other's responses. It must come from an authenticated source: put the
//! idempotency layer *after* your authentication layer and read what it established,
//! usually with [`FromExtension`]. Authentication with `XServer::with_interceptor` runs
//! after the layer and is too late; use `tonic::service::InterceptorLayer` before it
//! (see [Authentication and tenants](super#authentication-and-tenants)).

use std::fmt;
use std::marker::PhantomData;

use http::HeaderName;

/// Resolves the tenant of a protected call. `None` refuses the call (UNAUTHENTICATED).
///
/// Closures `Fn(&http::request::Parts) -> Option<String>` are resolvers too.
pub trait TenantResolver: Send + Sync + 'static {
    /// The tenant of the request with these parts.
    fn tenant(&self, parts: &http::request::Parts) -> Option<String>;
}

impl<F> TenantResolver for F
where
    F: Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
{
    fn tenant(&self, parts: &http::request::Parts) -> Option<String> {
        self(parts)
    }
}

/// Reads the tenant from a request extension of type `T` that an authentication layer
/// inserted (the recommended source).
///
/// `T` must implement `AsRef<str>` (the tenant's name); an empty name counts as no
/// tenant. The layer that inserts it must run before the idempotency layer: a
/// `tonic::service::InterceptorLayer` or a tower layer given to `Server::builder()`
/// first, not `XServer::with_interceptor`.
///
/// ```
/// # use idem_server::idempotency::tenant::{FromExtension, TenantResolver};
/// #[derive(Clone)]
/// struct Tenant(String);
/// impl AsRef<str> for Tenant { fn as_ref(&self) -> &str { &self.0 } }
///
/// let (mut parts, ()) = http::Request::new(()).into_parts();
/// let r = FromExtension::<Tenant>::new();
/// assert_eq!(r.tenant(&parts), None);
/// parts.extensions.insert(Tenant("acme".into()));
/// assert_eq!(r.tenant(&parts).as_deref(), Some("acme"));
/// ```
pub struct FromExtension<T>(PhantomData<fn() -> T>);

impl<T> FromExtension<T> {
    /// A resolver reading extension `T`.
    pub fn new() -> Self {
        FromExtension(PhantomData)
    }
}

impl<T> Default for FromExtension<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for FromExtension<T> {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl<T> fmt::Debug for FromExtension<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FromExtension<{}>", std::any::type_name::<T>())
    }
}

impl<T> TenantResolver for FromExtension<T>
where
    T: AsRef<str> + Send + Sync + 'static,
{
    fn tenant(&self, parts: &http::request::Parts) -> Option<String> {
        let t = parts.extensions.get::<T>()?.as_ref();
        (!t.is_empty()).then(|| t.to_owned())
    }
}

/// Every call belongs to one tenant (a single-tenant service).
///
/// The one tenant gets the whole memory store: given to
/// [`IdempotencyLayer::tenant`](super::IdempotencyLayer::tenant) on a layer made by
/// [`from_config`](super::IdempotencyLayer::from_config) (or as `idem.tenant` `single`),
/// the per-tenant bounds the config leaves unset are the store's own, not a share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SingleTenant(pub String);

impl SingleTenant {
    /// The one tenant.
    pub fn new(tenant: impl Into<String>) -> Self {
        SingleTenant(tenant.into())
    }
}

impl TenantResolver for SingleTenant {
    fn tenant(&self, _: &http::request::Parts) -> Option<String> {
        Some(self.0.clone())
    }
}

/// Trusts a client-sent header as the tenant.
///
/// **Risk**: any client can claim any tenant, and so read another tenant's stored
/// responses by guessing its keys. Use it only behind a proxy that authenticates the
/// caller and overwrites this header. Exactly one non-empty UTF-8 value is accepted;
/// anything else means "no tenant" (UNAUTHENTICATED).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FromHeader(pub HeaderName);

impl FromHeader {
    /// Trust header `name`.
    pub fn new(name: HeaderName) -> Self {
        FromHeader(name)
    }
}

impl TenantResolver for FromHeader {
    fn tenant(&self, parts: &http::request::Parts) -> Option<String> {
        let mut values = parts.headers.get_all(&self.0).iter();
        let v = values.next()?;
        if values.next().is_some() {
            return None;
        }
        let s = v.to_str().ok()?;
        (!s.is_empty()).then(|| s.to_owned())
    }
}

/// Refuses every call as unauthenticated (UNAUTHENTICATED), e.g. to switch protected
/// calls off while keeping the layer. A layer with no source at all does not use it: it
/// fails [`check`](super::IdempotencyLayer::check) and refuses protected calls as
/// misconfigured (FAILED_PRECONDITION).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoTenant;

impl TenantResolver for NoTenant {
    fn tenant(&self, _: &http::request::Parts) -> Option<String> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_needs_exactly_one_value() {
        let r = FromHeader::new(HeaderName::from_static("x-tenant"));
        let (mut parts, ()) = http::Request::new(()).into_parts();
        assert_eq!(r.tenant(&parts), None);
        parts.headers.append("x-tenant", "a".parse().unwrap());
        assert_eq!(r.tenant(&parts).as_deref(), Some("a"));
        parts.headers.append("x-tenant", "b".parse().unwrap());
        assert_eq!(r.tenant(&parts), None);
        assert_eq!(SingleTenant::new("s").tenant(&parts).as_deref(), Some("s"));
        assert_eq!(NoTenant.tenant(&parts), None);
    }
}
