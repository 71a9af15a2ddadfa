//! Attaching an idempotency key to a call: a helper for one request, a tonic
//! [`Interceptor`] that adds a fresh key to every call that has none, and the one rule
//! the retry layer and the interceptor both use to put a key under the configured header.
//!
//! A key set with [`with_key`] travels as a typed request extension (tonic copies a
//! `Request`'s extensions into the HTTP request), so the layer below always knows it,
//! whatever header the caller thought it should go in.

use http::{HeaderMap, HeaderName, HeaderValue};
use idem_core::headers::IDEMPOTENCY_KEY;
use idem_core::{IdempotencyKey, ServiceConfig};
use tonic::metadata::MetadataMap;
use tonic::service::Interceptor;
use tonic::{GrpcMethod, Request, Status};

/// Sets the idempotency key of `request`, replacing any.
///
/// The key is stored twice: as a typed [`IdempotencyKey`] request extension, which the
/// retry layer ([`RetryLayer`](crate::RetryLayer)) and [`IdempotencyKeyInterceptor`] move
/// under *their* configured header (`idem.keyHeader`, or
/// [`RetryLayerBuilder::key_header`](crate::RetryLayerBuilder::key_header)), and under the
/// default header `x-idempotency-key`, for channels without either. The layer keeps the
/// key on every attempt; it never replaces it with a fresh one.
///
/// ```
/// use idem_core::IdempotencyKey;
/// let mut req = tonic::Request::new(());
/// let key: IdempotencyKey = "order-2024-0001".parse().unwrap();
/// idem_client::with_key(&mut req, &key);
/// assert_eq!(req.metadata().get("x-idempotency-key").unwrap(), "order-2024-0001");
/// assert_eq!(req.extensions().get::<IdempotencyKey>(), Some(&key));
/// ```
pub fn with_key<T>(request: &mut Request<T>, key: &IdempotencyKey) {
    request.extensions_mut().insert(key.clone());
    with_headers(request.metadata_mut(), |headers| {
        headers.insert(IDEMPOTENCY_KEY, sensitive_value(key));
    });
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
/// retry layer on the channel, so its key is the same on every retry below it. A key set
/// with [`with_key`] is kept and put under the interceptor's header.
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
    header: HeaderName,
    /// `None`: every call. `Some`: only methods this config protects (or all with
    /// `keyAllMethods`).
    config: Option<ServiceConfig>,
}

impl IdempotencyKeyInterceptor {
    /// Adds a key to every call, under `x-idempotency-key`.
    pub fn all_methods() -> Self {
        IdempotencyKeyInterceptor {
            header: IDEMPOTENCY_KEY,
            config: None,
        }
    }

    /// Adds a key to the methods `config` protects (those with an `idempotency` object), or
    /// to every method when its `idem.client.keyAllMethods` is set, under its
    /// `idem.keyHeader`. The method is known from tonic's [`GrpcMethod`] extension, which
    /// generated clients set; a call without it gets a key.
    pub fn for_config(config: &ServiceConfig) -> Self {
        IdempotencyKeyInterceptor {
            header: config.settings().key_header.clone(),
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

impl Interceptor for IdempotencyKeyInterceptor {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let generate = self.wants_key(&request);
        let typed = request.extensions().get::<IdempotencyKey>().cloned();
        with_headers(request.metadata_mut(), |headers| {
            place_key(headers, typed.as_ref(), &self.header, generate);
        });
        Ok(request)
    }
}

/// Puts the call's key under `name`, the one header the server reads. The key is, in
/// this order: the typed key ([`with_key`]), a value already under `name`, a value under
/// the default `x-idempotency-key` (moved: a caller that used the default name while the
/// layer is configured with another must not get a second, fresh key), or, when
/// `generate`, a fresh random key. The value is marked sensitive (see [`fresh_value`]).
pub(crate) fn place_key(
    headers: &mut HeaderMap,
    typed: Option<&IdempotencyKey>,
    name: &HeaderName,
    generate: bool,
) {
    let under_default = if *name == IDEMPOTENCY_KEY {
        None
    } else {
        headers.remove(IDEMPOTENCY_KEY)
    };
    let value = match (typed, headers.remove(name)) {
        (Some(key), _) => sensitive_value(key),
        (None, Some(mut v)) => {
            v.set_sensitive(true);
            v
        }
        (None, None) => match under_default {
            Some(mut v) => {
                v.set_sensitive(true);
                v
            }
            None if generate => fresh_value(),
            None => return,
        },
    };
    headers.insert(name, value);
}

/// A fresh random 128-bit key (32 lower-case hex digits, as
/// [`IdempotencyKey::generate`]), formatted on the stack: one allocation (the header's
/// `Bytes`). The value is marked sensitive, so HPACK sends it as a never-indexed literal:
/// a key never repeats across calls, and indexing each one would evict the entries that
/// do repeat (`content-type`, `user-agent`, the path) from both ends' dynamic tables and
/// make every later call re-send and re-index them.
pub(crate) fn fresh_value() -> HeaderValue {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bits: u128 = rand::random();
    let mut buf = [0u8; 32];
    for (i, b) in buf.iter_mut().enumerate() {
        *b = HEX[((bits >> (124 - 4 * i)) & 0xf) as usize];
    }
    // Hex digits: always a valid header value (and a valid `IdempotencyKey`). `from_owner`
    // puts the digits and the refcount in one allocation, so the clone each attempt
    // makes of the headers does not allocate again (a `Vec`-backed `Bytes` would on its
    // first clone).
    let mut v = HeaderValue::from_maybe_shared(bytes::Bytes::from_owner(buf))
        .unwrap_or_else(|_| HeaderValue::from_static("0000000000000000"));
    v.set_sensitive(true);
    v
}

/// A validated key as a sensitive header value (a key is ASCII `[A-Za-z0-9_-]`: always a
/// valid value).
fn sensitive_value(key: &IdempotencyKey) -> HeaderValue {
    let mut v = HeaderValue::from_str(key.as_str())
        .unwrap_or_else(|_| HeaderValue::from_static("invalid-key"));
    v.set_sensitive(true);
    v
}

/// Runs `f` on the metadata of a tonic request as a plain `HeaderMap` (no copy).
fn with_headers(metadata: &mut MetadataMap, f: impl FnOnce(&mut HeaderMap)) {
    let mut headers = std::mem::take(metadata).into_headers();
    f(&mut headers);
    *metadata = MetadataMap::from_headers(headers);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interceptor_keeps_an_existing_key() {
        let key: IdempotencyKey = "caller-key-1".parse().unwrap();
        let req = Request::new(()).with_idempotency_key(&key);
        let out = IdempotencyKeyInterceptor::all_methods().call(req).unwrap();
        assert_eq!(
            out.metadata().get(IDEMPOTENCY_KEY.as_str()).unwrap(),
            "caller-key-1"
        );
        assert!(
            out.metadata()
                .get(IDEMPOTENCY_KEY.as_str())
                .unwrap()
                .is_sensitive()
        );
        let fresh = IdempotencyKeyInterceptor::all_methods()
            .call(Request::new(()))
            .unwrap();
        assert!(
            fresh
                .metadata()
                .get(IDEMPOTENCY_KEY.as_str())
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
                .contains_key(IDEMPOTENCY_KEY.as_str())
        );
        let mut get = Request::new(());
        get.extensions_mut()
            .insert(GrpcMethod::new("shop.v1.Orders", "GetOrder"));
        assert!(
            !icpt
                .call(get)
                .unwrap()
                .metadata()
                .contains_key(IDEMPOTENCY_KEY.as_str())
        );
    }
}

#[cfg(test)]
mod place_tests {
    use super::*;

    fn key(s: &str) -> IdempotencyKey {
        s.parse().unwrap()
    }

    #[test]
    fn the_typed_key_wins_and_the_default_header_is_moved() {
        let custom = HeaderName::from_static("idempotency-key");
        let mut h = HeaderMap::new();
        h.insert(IDEMPOTENCY_KEY, "stale-key-000".parse().unwrap());
        place_key(&mut h, Some(&key("typed-key-123")), &custom, true);
        assert_eq!(h[&custom], "typed-key-123");
        assert!(h[&custom].is_sensitive());
        assert!(!h.contains_key(IDEMPOTENCY_KEY));

        let mut h = HeaderMap::new();
        h.insert(IDEMPOTENCY_KEY, "default-key-1".parse().unwrap());
        place_key(&mut h, None, &custom, false);
        assert_eq!(
            h[&custom], "default-key-1",
            "moved even when not generating"
        );

        let mut h = HeaderMap::new();
        place_key(&mut h, None, &custom, false);
        assert!(h.is_empty());
        place_key(&mut h, None, &custom, true);
        assert_eq!(h[&custom].len(), 32);
    }

    #[test]
    fn the_interceptor_puts_a_with_key_key_under_its_header() {
        use idem_core::config::IdemSettings;
        let settings = IdemSettings {
            key_header: HeaderName::from_static("idempotency-key"),
            ..IdemSettings::default()
        };
        let cfg = ServiceConfig::from_parts(Vec::new(), None, settings).unwrap();
        let req = Request::new(()).with_idempotency_key(&key("intent-0002-x"));
        let out = IdempotencyKeyInterceptor::for_config(&cfg)
            .call(req)
            .unwrap();
        assert_eq!(
            out.metadata().get("idempotency-key").unwrap(),
            "intent-0002-x"
        );
        assert!(out.metadata().get(IDEMPOTENCY_KEY.as_str()).is_none());
    }
}
