//! Keys derived for downstream calls: a client call made while serving a protected call
//! gets a key computed from the inbound call's record, so a run of the handler after a
//! crash sends the *same* keys downstream, and the downstream services replay instead of
//! executing again.
//!
//! The server layer runs each protected handler inside a [`KeySource`] seeded with the
//! record's scope digest (tenant, method, key) and given the function that computes keys
//! (`idem-server` uses SHA-256, see `idem_server::idempotency::derived_key`); the client
//! layer asks the current source for a key when the caller set none. A key depends on
//! the seed, the method path, and either the call's position (the n-th call to that
//! method in this run of the handler, from 0) or a step name the caller chose.
//!
//! A handler that makes its calls in the same order every time gets the same keys every
//! time. Calls made concurrently (`join!`, spawned tasks) have no fixed order: name them
//! (a step) instead. Handlers that spawn tasks carry the source over with
//! [`InboundScope::run`](crate::deadline::InboundScope::run), which takes the current
//! one along, or with [`KeySource::current`] + [`KeySource::run`].
//!
//! ```
//! use idem_core::key::IdempotencyKey;
//! use idem_core::derive::{KeySource, Which};
//! // A toy derivation for the example; the server layer's is SHA-256.
//! fn derive(seed: &[u8; 32], path: &str, which: Which<'_>) -> IdempotencyKey {
//!     let tail = match which {
//!         Which::Position(n) => format!("n{n}"),
//!         Which::Step(s) => format!("s{s}"),
//!     };
//!     format!("key-{}-{}-{tail}", seed[0], path.len()).parse().unwrap()
//! }
//! let source = KeySource::new([7; 32], derive);
//! let first = source.next_key("/shop.v1.Payments/Charge");
//! let second = source.next_key("/shop.v1.Payments/Charge");
//! assert_ne!(first, second);
//! // A second run of the same handler (a new source with the same seed) repeats them.
//! let again = KeySource::new([7; 32], derive);
//! assert_eq!(again.next_key("/shop.v1.Payments/Charge"), first);
//! ```

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};

use crate::key::IdempotencyKey;

tokio::task_local! {
    static KEYS: KeySource;
}

/// Which call of a method a derived key is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which<'a> {
    /// The n-th call (from 0) to the method in this run of the handler.
    Position(u64),
    /// The call the caller named this step.
    Step(&'a str),
}

/// Computes a key from a source's seed, a method path and [`Which`] call. It must be
/// deterministic, give distinct keys for distinct inputs (a cryptographic hash), and
/// return valid keys.
pub type DeriveFn = fn(seed: &[u8; 32], method_path: &str, which: Which<'_>) -> IdempotencyKey;

/// Where the keys of one handler run's downstream calls come from: a seed (the inbound
/// record's scope digest) and a call counter per method path. Cheap to clone; clones
/// share the counters.
#[derive(Clone)]
pub struct KeySource {
    inner: Arc<Inner>,
}

struct Inner {
    seed: [u8; 32],
    derive: DeriveFn,
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
    /// A source for one run of a handler, seeded with its record's scope digest, whose
    /// keys `derive` computes.
    pub fn new(seed: [u8; 32], derive: DeriveFn) -> Self {
        KeySource {
            inner: Arc::new(Inner {
                seed,
                derive,
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
        (self.inner.derive)(&self.inner.seed, method_path, Which::Position(n))
    }

    /// The key of the call to `method_path` named `step` (does not count as a call for
    /// [`next_key`](Self::next_key)).
    pub fn step_key(&self, method_path: &str, step: &str) -> IdempotencyKey {
        (self.inner.derive)(&self.inner.seed, method_path, Which::Step(step))
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

    fn derive(seed: &[u8; 32], path: &str, which: Which<'_>) -> IdempotencyKey {
        let tail = match which {
            Which::Position(n) => format!("n{n}"),
            Which::Step(s) => format!("s{s}"),
        };
        format!("key{}-{}-{tail}", seed[0], path.len())
            .parse()
            .unwrap()
    }

    #[test]
    fn positions_count_per_method_and_steps_take_none() {
        let a = KeySource::new([1; 32], derive);
        assert_eq!(a.next_key("/s.S/M").as_str(), "key1-6-n0");
        assert_eq!(a.step_key("/s.S/M", "x").as_str(), "key1-6-sx");
        assert_eq!(a.next_key("/s.S/Nn").as_str(), "key1-7-n0");
        assert_eq!(a.next_key("/s.S/M").as_str(), "key1-6-n1");
    }

    #[tokio::test]
    async fn the_current_source_is_visible_inside_only_and_shared_by_clones() {
        assert!(KeySource::current().is_none());
        let s = KeySource::new([3; 32], derive);
        let first = s
            .clone()
            .run(async { KeySource::current().unwrap().next_key("/a/b") })
            .await;
        assert_eq!(first.as_str(), "key3-4-n0");
        assert_eq!(
            s.next_key("/a/b").as_str(),
            "key3-4-n1",
            "the counter is shared"
        );
        assert!(KeySource::current().is_none());
        // `InboundScope::run` carries it into spawned tasks.
        let scope = crate::deadline::InboundScope::new(None, 0);
        let spawned = s
            .clone()
            .run(async move {
                // Built here, inside the source; run by another task.
                let task = scope.run(async { KeySource::current().map(|k| k.next_key("/a/b")) });
                tokio::spawn(task).await.unwrap()
            })
            .await;
        assert_eq!(spawned.unwrap().as_str(), "key3-4-n2");
    }
}
