//! Keys sent to methods the layer does not protect: logged once per method at WARN,
//! counted on every call (outcome `passthrough`, reason
//! [`KEY_IGNORED`](crate::metrics::KEY_IGNORED)).
//!
//! A client sends a key because it expects the call to run once; a server that ignores
//! it turns effectively-once back into at-least-once without a word. With descriptors
//! ([`IdempotencyLayer::descriptors`](super::IdempotencyLayer::descriptors)) that only
//! happens to methods that are safe to repeat (said by their level: then nothing is
//! logged), to bidirectional-streaming methods, and to side-effecting methods the
//! config opted out on purpose.

use std::collections::HashSet;
use std::sync::{PoisonError, RwLock};

use idem_core::config::ServiceConfig;
use idem_core::descriptor::Streaming;

/// The methods whose ignored key was logged already.
#[derive(Debug, Default)]
pub(crate) struct IgnoredKeys {
    logged: RwLock<HashSet<Box<str>>>,
}

impl IgnoredKeys {
    /// A call to `path` carried a key that the layer ignores: logs it the first time for
    /// this method. Returns whether the ignored key is worth counting (false: the
    /// descriptors say the method is safe to repeat, so a key there means nothing).
    ///
    /// Runs only for unprotected calls that carry a key; the set stops growing at
    /// the number of methods that ever got one (unknown paths are routed by the
    /// server only when a service has them).
    pub(crate) fn note(&self, config: &ServiceConfig, path: &str) -> bool {
        let method = config.descriptors().and_then(|d| d.method_by_path(path));
        if method.is_some_and(|m| {
            !m.idempotency_level().has_side_effects() && m.streaming() != Streaming::Bidi
        }) {
            return false;
        }
        let seen = self.logged.read().unwrap_or_else(PoisonError::into_inner);
        if seen.contains(path) || seen.len() >= MAX_LOGGED {
            return true;
        }
        drop(seen);
        let first = self
            .logged
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(path.into());
        if first {
            let fix = match method {
                None if config.descriptors().is_none() => {
                    "give the layer the service's descriptors (IdempotencyLayer::descriptors) \
                     so side-effecting methods are protected by their level, or add an \
                     \"idempotency\" object to the method's methodConfig entry"
                }
                None => "the method is not in the descriptors given to the layer",
                Some(m) if m.streaming() == Streaming::Bidi => {
                    "bidirectional-streaming methods are never protected; the client should \
                     not send a key to it"
                }
                Some(_) => {
                    "the config opts this side-effecting method out (\"idempotency\": false): \
                     remove the opt-out to protect it"
                }
            };
            tracing::warn!(
                method = path,
                "a call carried an idempotency key to a method this server does not protect: \
                 the key is ignored and a repeated call runs again; {fix}"
            );
        }
        true
    }
}

/// Methods logged at most: a client sending keys to paths no service has (each answered
/// UNIMPLEMENTED) cannot grow the set without bound.
const MAX_LOGGED: usize = 4096;
