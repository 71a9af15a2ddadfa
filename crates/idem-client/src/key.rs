//! Attaching an `x-idempotency-key` to a call: a helper for one request, and a tonic
//! [`Interceptor`] that adds a fresh key to every call that has none.

use http::HeaderName;
use idem_core::headers::IDEMPOTENCY_KEY;
use idem_core::{IdempotencyKey, ServiceConfig};
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue};
use tonic::service::Interceptor;
use tonic::{GrpcMethod, Request, Status};

/// Sets the idempotency key of `request` (header `x-idempotency-key`), replacing any. The
/// retry layer keeps a key the caller set and sends it on every attempt.
///
/// ```
/// use idem_core::IdempotencyKey;
/// let mut req = tonic::Request::new(());
/// let key: IdempotencyKey = "order-2024-0001".parse().unwrap();
/// idem_client::with_key(&mut req, &key);
/// assert_eq!(req.metadata().get("x-idempotency-key").unwrap(), "order-2024-0001");
/// ```
pub fn with_key<T>(request: &mut Request<T>, key: &IdempotencyKey) {
    insert_key(
        request,
        &AsciiMetadataKey::from_static(IDEMPOTENCY_KEY),
        key,
    );
}

fn insert_key<T>(request: &mut Request<T>, name: &AsciiMetadataKey, key: &IdempotencyKey) {
    // A validated key is ASCII `[A-Za-z0-9_-]`: always a valid metadata value. Sensitive:
    // HPACK sends it as a never-indexed literal (keys do not repeat across calls).
    if let Ok(mut v) = AsciiMetadataValue::try_from(key.as_str()) {
        v.set_sensitive(true);
        request.metadata_mut().insert(name.clone(), v);
    }
}

/// [`with_key`] as methods on `tonic::Request`.
pub trait RequestKeyExt: Sized {
    /// Sets the idempotency key (see [`with_key`]).
    fn set_idempotency_key(&mut self, key: &IdempotencyKey);
    /// This request with the idempotency key set.
    fn with_idempotency_key(mut self, key: &IdempotencyKey) -> Self {
        self.set_idempotency_key(key);
        self
    }
}

impl<T> RequestKeyExt for Request<T> {
    fn set_idempotency_key(&mut self, key: &IdempotencyKey) {
        with_key(self, key);
    }
}

/// A tonic [`Interceptor`] that adds a fresh random key to calls that have none.
///
/// For `Client::with_interceptor` users: the interceptor runs once per call, above any
/// retry layer on the channel, so its key is the same on every retry below it.
///
/// ```
/// use idem_client::IdempotencyKeyInterceptor;
/// use tonic::service::Interceptor;
/// let mut keys = IdempotencyKeyInterceptor::all_methods();
/// let req = keys.call(tonic::Request::new(())).unwrap();
/// assert_eq!(req.metadata().get("x-idempotency-key").unwrap().len(), 32);
/// ```
#[derive(Debug, Clone)]
pub struct IdempotencyKeyInterceptor {
    header: AsciiMetadataKey,
    /// `None`: every call. `Some`: only methods this config protects (or all with
    /// `keyAllMethods`).
    config: Option<ServiceConfig>,
}

impl IdempotencyKeyInterceptor {
    /// Adds a key to every call.
    pub fn all_methods() -> Self {
        IdempotencyKeyInterceptor {
            header: AsciiMetadataKey::from_static(IDEMPOTENCY_KEY),
            config: None,
        }
    }

    /// Adds a key to the methods `config` protects (those with an `idempotency` object), or
    /// to every method when its `idem.client.keyAllMethods` is set, under its
    /// `idem.keyHeader`. The method is known from tonic's [`GrpcMethod`] extension, which
    /// generated clients set; a call without it gets a key.
    pub fn for_config(config: &ServiceConfig) -> Self {
        let header = header_key(&config.settings().key_header);
        IdempotencyKeyInterceptor {
            header,
            config: Some(config.clone()),
        }
    }

    fn wants_key<T>(&self, request: &Request<T>) -> bool {
        let Some(cfg) = &self.config else {
            return true;
        };
        if cfg.settings().client.key_all_methods {
            return true;
        }
        match request.extensions().get::<GrpcMethod<'static>>() {
            Some(m) => cfg
                .lookup(m.service(), m.method())
                .is_some_and(|mc| mc.idempotency().is_some()),
            None => true,
        }
    }
}

fn header_key(name: &HeaderName) -> AsciiMetadataKey {
    AsciiMetadataKey::from_bytes(name.as_str().as_bytes())
        .unwrap_or_else(|_| AsciiMetadataKey::from_static(IDEMPOTENCY_KEY))
}

impl Interceptor for IdempotencyKeyInterceptor {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if !request.metadata().contains_key(&self.header) && self.wants_key(&request) {
            let key = IdempotencyKey::generate();
            insert_key(&mut request, &self.header, &key);
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interceptor_keeps_an_existing_key() {
        let key: IdempotencyKey = "caller-key-1".parse().unwrap();
        let req = Request::new(()).with_idempotency_key(&key);
        let out = IdempotencyKeyInterceptor::all_methods().call(req).unwrap();
        assert_eq!(out.metadata().get(IDEMPOTENCY_KEY).unwrap(), "caller-key-1");
        assert!(out.metadata().get(IDEMPOTENCY_KEY).unwrap().is_sensitive());
        let fresh = IdempotencyKeyInterceptor::all_methods()
            .call(Request::new(()))
            .unwrap();
        assert!(
            fresh
                .metadata()
                .get(IDEMPOTENCY_KEY)
                .unwrap()
                .is_sensitive()
        );
    }

    #[test]
    fn interceptor_follows_the_config() {
        use idem_core::config::{IdemSettings, IdempotencyPolicy, MethodConfig};
        let cfg = ServiceConfig::from_parts(
            vec![
                MethodConfig::empty()
                    .with_name("shop.v1.Orders", "CreateOrder")
                    .with_idempotency(IdempotencyPolicy::default()),
            ],
            None,
            IdemSettings::default(),
        )
        .unwrap();
        let mut icpt = IdempotencyKeyInterceptor::for_config(&cfg);
        let mut create = Request::new(());
        create
            .extensions_mut()
            .insert(GrpcMethod::new("shop.v1.Orders", "CreateOrder"));
        assert!(
            icpt.call(create)
                .unwrap()
                .metadata()
                .contains_key(IDEMPOTENCY_KEY)
        );
        let mut get = Request::new(());
        get.extensions_mut()
            .insert(GrpcMethod::new("shop.v1.Orders", "GetOrder"));
        assert!(
            !icpt
                .call(get)
                .unwrap()
                .metadata()
                .contains_key(IDEMPOTENCY_KEY)
        );
    }
}
