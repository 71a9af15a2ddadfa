//! Keys derived for downstream calls: a client call made while serving a protected call
//! gets a key computed from the inbound call's record, so a run of the handler after a
//! crash sends the *same* keys downstream, and the downstream services replay instead of
//! executing again.
//!
//! The server layer runs each protected handler inside a [`KeySource`] seeded with the
//! record's scope digest (tenant, method, key), and the client layer asks it for a key
//! when the caller set none:
//!
//! ```text
//! key = hex(SHA-256("idem derived key v1" ‖ seed ‖ len ‖ method path ‖ "#" n)[..16])  // n-th call to that method
//! key = hex(SHA-256("idem derived key v1" ‖ seed ‖ len ‖ method path ‖ "@" step)[..16]) // a named step
//! ```
//!
//! `n` counts the calls to each method path in one run of the handler, from 0, so a
//! handler that makes its calls in the same order every time gets the same keys every
//! time. Calls made concurrently (`join!`, spawned tasks) have no fixed order: name them
//! (a step) instead. Handlers that spawn tasks carry the source over with
//! [`InboundScope::run`](crate::deadline::InboundScope::run), which takes the current
//! one along, or with [`KeySource::current`] + [`KeySource::run`].
//!
//! ```
//! use idem_core::derive::KeySource;
//! let source = KeySource::new([7; 32]);
//! let first = source.next_key("/shop.v1.Payments/Charge");
//! let second = source.next_key("/shop.v1.Payments/Charge");
//! assert_ne!(first, second);
//! // A second run of the same handler (a new source with the same seed) repeats them.
//! let again = KeySource::new([7; 32]);
//! assert_eq!(again.next_key("/shop.v1.Payments/Charge"), first);
//! assert_eq!(
//!     again.step_key("/shop.v1.Payments/Charge", "deposit"),
//!     source.step_key("/shop.v1.Payments/Charge", "deposit"),
//! );
//! ```

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use crate::IdempotencyKey;

tokio::task_local! {
    static KEYS: KeySource;
}

const DOMAIN: &[u8] = b"idem derived key v1";

/// Where the keys of one handler run's downstream calls come from: a seed (the inbound
/// record's scope digest) and a call counter per method path. Cheap to clone; clones
/// share the counters.
#[derive(Clone)]
pub struct KeySource {
    inner: Arc<Inner>,
}

struct Inner {
    seed: [u8; 32],
    /// Calls so far per method path (few per handler: a short list beats a map).
    calls: Mutex<Vec<(Box<str>, u64)>>,
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The seed names a record: keep it out of logs.
        f.debug_struct("KeySource").finish_non_exhaustive()
    }
}

impl KeySource {
    /// A source for one run of a handler, seeded with its record's scope digest.
    pub fn new(seed: [u8; 32]) -> Self {
        KeySource {
            inner: Arc::new(Inner {
                seed,
                calls: Mutex::new(Vec::new()),
            }),
        }
    }

    /// The key of the next call to `method_path` (`/package.Service/Method`).
    pub fn next_key(&self, method_path: &str) -> IdempotencyKey {
        let n = {
            let mut calls = self.inner.calls.lock().unwrap_or_else(|e| e.into_inner());
            match calls.iter_mut().find(|(m, _)| &**m == method_path) {
                Some((_, n)) => {
                    *n += 1;
                    *n
                }
                None => {
                    calls.push((method_path.into(), 0));
                    0
                }
            }
        };
        self.derive(method_path, b'#', n.to_string().as_bytes())
    }

    /// The key of the call to `method_path` named `step` (does not count as a call for
    /// [`next_key`](Self::next_key)).
    pub fn step_key(&self, method_path: &str, step: &str) -> IdempotencyKey {
        self.derive(method_path, b'@', step.as_bytes())
    }

    fn derive(&self, method_path: &str, kind: u8, tail: &[u8]) -> IdempotencyKey {
        let mut h = Sha256::new();
        h.update(DOMAIN);
        h.update(self.inner.seed);
        h.update((method_path.len() as u64).to_be_bytes());
        h.update(method_path.as_bytes());
        h.update([kind]);
        h.update(tail);
        let digest = h.finalize();
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = [0u8; 32];
        for (i, b) in digest[..16].iter().enumerate() {
            out[2 * i] = HEX[usize::from(b >> 4)];
            out[2 * i + 1] = HEX[usize::from(b & 0xf)];
        }
        // 32 hex digits: always a valid key.
        IdempotencyKey::parse(&out).unwrap_or_else(|_| IdempotencyKey::generate())
    }

    /// Runs `fut` with this source as the current one.
    pub fn run<F: Future>(self, fut: F) -> impl Future<Output = F::Output> {
        KEYS.scope(self, fut)
    }

    /// The source of the handler run the current task serves, if any.
    pub fn current() -> Option<KeySource> {
        KEYS.try_with(KeySource::clone).ok()
    }
}

/// Runs `fut` inside `source` when there is one.
pub(crate) async fn run_in<F: Future>(source: Option<KeySource>, fut: F) -> F::Output {
    match source {
        Some(s) => s.run(fut).await,
        None => fut.await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_valid_and_depend_on_every_input() {
        let a = KeySource::new([1; 32]);
        let k = a.next_key("/s.S/M");
        assert_eq!(k.as_str().len(), 32);
        assert!(k.as_str().bytes().all(|c| c.is_ascii_hexdigit()));
        // Another method has its own counter.
        assert_eq!(
            a.next_key("/s.S/N"),
            KeySource::new([1; 32]).next_key("/s.S/N")
        );
        assert_ne!(a.next_key("/s.S/M"), k, "second call, second key");
        assert_ne!(KeySource::new([2; 32]).next_key("/s.S/M"), k, "seed");
        assert_ne!(
            a.step_key("/s.S/M", "0"),
            k,
            "a step is not a sequence number"
        );
        assert_ne!(a.step_key("/s.S/M", "x"), a.step_key("/s.S/N", "x"));
    }

    #[tokio::test]
    async fn the_current_source_is_visible_inside_only_and_shared_by_clones() {
        assert!(KeySource::current().is_none());
        let s = KeySource::new([3; 32]);
        let first = s
            .clone()
            .run(async { KeySource::current().unwrap().next_key("/a/b") })
            .await;
        assert_eq!(first, KeySource::new([3; 32]).next_key("/a/b"));
        assert_ne!(s.next_key("/a/b"), first, "the counter is shared");
        assert!(KeySource::current().is_none());
    }
}
