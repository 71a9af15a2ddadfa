//! Attaching an idempotency key to a call: a helper for one request, a tonic
//! [`Interceptor`] that adds a key to every call that has none, and the one rule the
//! retry layer and the interceptor both use to put a key under the configured header.
//!
//! A key set with [`with_key`] travels as a typed request extension (tonic copies a
//! `Request`'s extensions into the HTTP request), so the layer below always knows it,
//! whatever header the caller thought it should go in.
//!
//! # Keys of calls made while serving a protected call
//! A call without a key made by a handler that `idem-server` runs under a record gets a
//! key *derived* from that record and the call's place in the handler (the n-th call to
//! this method, see [`idem_core::derive`]), not a random one. A run of the handler after
//! a crash then sends the same keys, and the services it calls replay what they did for
//! the first run instead of doing it again. Outside a protected handler keys are random.
//!
//! - Calls made concurrently have no fixed order: name each with [`with_step`], and its
//!   key is derived from the name instead.
//! - [`with_fresh_key`] opts one call out: it gets a random key, as outside a handler.
//! - [`with_key`] sets the key yourself; it always wins.
//!
//! ```
//! use idem_client::{with_fresh_key, with_step};
//! let mut charge = tonic::Request::new(());
//! with_step(&mut charge, "charge-deposit");
//! let mut audit = tonic::Request::new(());
//! with_fresh_key(&mut audit);
//! ```

use http::{HeaderMap, HeaderName, HeaderValue};
use idem_core::derive::KeySource;
use idem_core::headers::IDEMPOTENCY_KEY;
use idem_core::{config::ServiceConfig, key::IdempotencyKey};
use tonic::metadata::MetadataMap;
use tonic::service::Interceptor;
use tonic::{GrpcMethod, Request, Status};

/// Sets the idempotency key of `request`, replacing any.
///
/// The key is stored twice: as a typed [`IdempotencyKey`] request extension, which the
/// retry layer ([`RetryLayer`](crate::retry::RetryLayer)) and [`IdempotencyKeyInterceptor`] move
/// under *their* configured header (`idem.keyHeader`, or
/// [`RetryLayerBuilder::key_header`](crate::retry::RetryLayerBuilder::key_header)), and under the
/// default header `x-idempotency-key`, for channels without either. The layer keeps the
/// key on every attempt; it never replaces it with a fresh one.
///
/// ```
/// use idem_core::key::IdempotencyKey;
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

/// A request extension naming the call's step in the handler that makes it: its derived
/// key comes from the name instead of the call's position (see the module docs). Set it
/// with [`with_step`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyStep(pub std::borrow::Cow<'static, str>);

/// A request extension that opts the call out of derived keys: when it has no key, it
/// gets a random one. Set it with [`with_fresh_key`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct FreshKey;

/// Names the step of a call made while serving a protected call, so its derived key
/// comes from `step` (unique within the handler for this method) rather than from the
/// order of the calls. For calls made concurrently, whose order changes from run to run.
///
/// ```
/// let mut req = tonic::Request::new(());
/// idem_client::with_step(&mut req, "reserve-stock");
/// ```
pub fn with_step<T>(request: &mut Request<T>, step: impl Into<std::borrow::Cow<'static, str>>) {
    request.extensions_mut().insert(KeyStep(step.into()));
}

/// Gives the call a random key when it has none, even while serving a protected call
/// (where it would get a derived one): for a call that must run again when the handler
/// runs again.
pub fn with_fresh_key<T>(request: &mut Request<T>) {
    request.extensions_mut().insert(FreshKey);
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
        let path = request
            .extensions()
            .get::<GrpcMethod<'static>>()
            .map(|m| format!("/{}/{}", m.service(), m.method()));
        let step = request.extensions().get::<KeyStep>().cloned();
        let fresh = request.extensions().get::<FreshKey>().copied();
        let make = new_key(path.as_deref(), step.as_ref(), fresh.as_ref());
        with_headers(request.metadata_mut(), |headers| {
            place_key(headers, typed.as_ref(), &self.header, generate, make);
        });
        Ok(request)
    }
}

/// Puts the key of an HTTP request to `req`'s path under `name` (see [`place_key`]),
/// taking the typed key, the step and the opt-out from its extensions.
pub(crate) fn place_request_key<B>(req: &mut http::Request<B>, name: &HeaderName, generate: bool) {
    let typed = req.extensions_mut().remove::<IdempotencyKey>();
    let step = req.extensions_mut().remove::<KeyStep>();
    let fresh = req.extensions_mut().remove::<FreshKey>();
    // A `Bytes` clone (static for generated clients), so the headers can be borrowed.
    let uri = req.uri().clone();
    let make = new_key(Some(uri.path()), step.as_ref(), fresh.as_ref());
    place_key(req.headers_mut(), typed.as_ref(), name, generate, make);
}

/// How a call that needs a key and has none gets one: derived from the protected call
/// being served (by `step`, else by position), or random outside one, for calls without
/// a known method path, and with [`FreshKey`]. Evaluated only when a key is made, so
/// calls that bring their own do not count as positions.
fn new_key<'a>(
    path: Option<&'a str>,
    step: Option<&'a KeyStep>,
    fresh: Option<&'a FreshKey>,
) -> impl FnOnce() -> HeaderValue + 'a {
    move || {
        let source = if fresh.is_some() {
            None
        } else {
            KeySource::current()
        };
        match (source, path) {
            (Some(source), Some(path)) => {
                let key = match step {
                    Some(KeyStep(step)) => source.step_key(path, step),
                    None => source.next_key(path),
                };
                sensitive_value(&key)
            }
            _ => fresh_value(),
        }
    }
}

/// Puts the call's key under `name`, the one header the server reads. The key is, in
/// this order: the typed key ([`with_key`]), a value already under `name`, a value under
/// the default `x-idempotency-key` (moved: a caller that used the default name while the
/// layer is configured with another must not get a second, fresh key), or, when
/// `generate`, a new one from `make` (derived or random, see [`new_key`]). The value is
/// marked sensitive (see [`fresh_value`]).
pub(crate) fn place_key(
    headers: &mut HeaderMap,
    typed: Option<&IdempotencyKey>,
    name: &HeaderName,
    generate: bool,
    make: impl FnOnce() -> HeaderValue,
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
            None if generate => make(),
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
        place_key(
            &mut h,
            Some(&key("typed-key-123")),
            &custom,
            true,
            fresh_value,
        );
        assert_eq!(h[&custom], "typed-key-123");
        assert!(h[&custom].is_sensitive());
        assert!(!h.contains_key(IDEMPOTENCY_KEY));

        let mut h = HeaderMap::new();
        h.insert(IDEMPOTENCY_KEY, "default-key-1".parse().unwrap());
        place_key(&mut h, None, &custom, false, fresh_value);
        assert_eq!(
            h[&custom], "default-key-1",
            "moved even when not generating"
        );

        let mut h = HeaderMap::new();
        place_key(&mut h, None, &custom, false, fresh_value);
        assert!(h.is_empty());
        place_key(&mut h, None, &custom, true, fresh_value);
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

#[cfg(test)]
mod derive_tests {
    use super::*;
    use idem_core::derive::{KeySource, Which};

    fn derive(seed: &[u8; 32], path: &str, which: Which<'_>) -> IdempotencyKey {
        let tail = match which {
            Which::Position(n) => format!("n{n}"),
            Which::Step(s) => format!("s{s}"),
        };
        format!("k{}-{}-{tail}", seed[0], path.len())
            .parse()
            .unwrap()
    }

    fn call(path: &str, ext: impl FnOnce(&mut http::Request<()>)) -> HeaderValue {
        let mut req = http::Request::builder().uri(path).body(()).unwrap();
        ext(&mut req);
        place_request_key(&mut req, &IDEMPOTENCY_KEY, true);
        req.headers()[IDEMPOTENCY_KEY].clone()
    }

    #[tokio::test]
    async fn inside_a_protected_handler_keys_are_derived_from_its_record() {
        let path = "/shop.v1.Payments/Charge";
        let run = || async {
            (
                call(path, |_| {}),
                call(path, |_| {}),
                call(path, |r| {
                    r.extensions_mut().insert(KeyStep("deposit".into()));
                }),
                call(path, |r| {
                    r.extensions_mut().insert(FreshKey);
                }),
                call(path, |r| {
                    r.extensions_mut().insert(key("own-key-0001"));
                }),
                call(path, |_| {}),
            )
        };
        let first = KeySource::new([9; 32], derive).run(run()).await;
        let again = KeySource::new([9; 32], derive).run(run()).await;
        let expect = KeySource::new([9; 32], derive);
        assert_eq!(first.0, expect.next_key(path).as_str());
        assert_eq!(first.1, expect.next_key(path).as_str());
        assert_eq!(first.2, expect.step_key(path, "deposit").as_str());
        assert_eq!(first.4, "own-key-0001");
        // The step, the fresh key and the caller's key took no position.
        assert_eq!(first.5, expect.next_key(path).as_str());
        assert!(first.0.is_sensitive());
        // A second run repeats every derived key, never the fresh one.
        assert_eq!(
            (&first.0, &first.1, &first.2, &first.5),
            (&again.0, &again.1, &again.2, &again.5)
        );
        assert_ne!(first.3, again.3);
        // Outside a handler: random.
        assert_ne!(call(path, |_| {}), call(path, |_| {}));
    }

    fn key(s: &str) -> IdempotencyKey {
        s.parse().unwrap()
    }
}
