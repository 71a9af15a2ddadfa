//! `methodConfig[]`: an entry's names and standard fields ([`MethodConfig`],
//! [`MethodName`]) and their reader, which hands the entry's policies to the
//! [`retry`](super::retry) and [`idempotency`](super::idempotency) readers.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use serde_json::Value;

use super::guards::CircuitBreakerSettings;
use super::idempotency::IdempotencyPolicy;
use super::read::{Obj, Validator, Zero, kind};
use super::retry::{HedgingPolicy, RetryPolicy};

/// `{service, method}` of a `methodConfig[].name[]` entry. `""`, `null` and absent are
/// the same and are stored as `None`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MethodName {
    /// Fully-qualified service name (`shop.v1.Orders`), or `None` for the default entry.
    pub service: Option<String>,
    /// Method name (`CreateOrder`), or `None` for every method of the service.
    pub method: Option<String>,
}

impl fmt::Display for MethodName {
    /// `shop.v1.Orders/CreateOrder`, `shop.v1.Orders/*`, or `*` for the default.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.service, &self.method) {
            (None, _) => f.write_str("*"),
            (Some(s), None) => write!(f, "{s}/*"),
            (Some(s), Some(m)) => write!(f, "{s}/{m}"),
        }
    }
}

/// One validated `methodConfig[]` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct MethodConfig {
    pub(crate) names: Vec<MethodName>,
    pub(crate) timeout: Option<Duration>,
    pub(crate) wait_for_ready: Option<bool>,
    pub(crate) max_request_message_bytes: Option<u64>,
    pub(crate) max_response_message_bytes: Option<u64>,
    pub(crate) retry_policy: Option<RetryPolicy>,
    pub(crate) hedging_policy: Option<HedgingPolicy>,
    pub(crate) idempotency: Option<IdempotencyPolicy>,
    /// `"idempotency": false`: the method is left unprotected on purpose.
    pub(crate) idempotency_opt_out: bool,
    /// `circuitBreaker`: the entry's own breaker, instead of `idem.client.circuitBreaker`.
    pub(crate) circuit_breaker: Option<CircuitBreakerSettings>,
    /// The entry's index in the document's `methodConfig` (for paths in diagnostics made
    /// after parsing); `None` for entries built in code.
    pub(crate) source: Option<usize>,
}

impl MethodConfig {
    /// An entry with no names and no policies (what applies when nothing matches).
    pub fn empty() -> Self {
        MethodConfig {
            names: Vec::new(),
            timeout: None,
            wait_for_ready: None,
            max_request_message_bytes: None,
            max_response_message_bytes: None,
            retry_policy: None,
            hedging_policy: None,
            idempotency: None,
            idempotency_opt_out: false,
            circuit_breaker: None,
            source: None,
        }
    }
    /// This entry with a retry policy (replacing any hedging policy).
    pub fn with_retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.retry_policy = Some(policy);
        self.hedging_policy = None;
        self
    }
    /// This entry with one more name: `("shop.v1.Orders", "CreateOrder")` for one method,
    /// `("shop.v1.Orders", "")` for every method of a service, `("", "")` for the
    /// default entry (empty means absent, as in the JSON form).
    pub fn with_name(mut self, service: impl Into<String>, method: impl Into<String>) -> Self {
        let (service, method) = (service.into(), method.into());
        self.names.push(MethodName {
            service: (!service.is_empty()).then_some(service),
            method: (!method.is_empty()).then_some(method),
        });
        self
    }
    /// This entry with an idempotency policy (marks the method protected).
    pub fn with_idempotency(mut self, policy: IdempotencyPolicy) -> Self {
        self.idempotency = Some(policy);
        self
    }
    /// This entry without its idempotency policy (the method becomes unprotected).
    pub fn without_idempotency(mut self) -> Self {
        self.idempotency = None;
        self
    }
    /// This entry opted out of protection on purpose (`"idempotency": false`): with
    /// descriptors, a side-effecting method it names is then left unprotected (and
    /// must have no retry or hedging policy).
    pub fn with_idempotency_opt_out(mut self) -> Self {
        self.idempotency = None;
        self.idempotency_opt_out = true;
        self
    }
    /// This entry with its own circuit breaker (`circuitBreaker`): its methods use it
    /// instead of the client-wide `idem.client.circuitBreaker`, with their own state.
    pub fn with_circuit_breaker(mut self, settings: CircuitBreakerSettings) -> Self {
        self.circuit_breaker = Some(settings);
        self
    }
    /// This entry with a per-call timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
    /// This entry with `waitForReady`.
    pub fn with_wait_for_ready(mut self, wait: bool) -> Self {
        self.wait_for_ready = Some(wait);
        self
    }
    /// This entry with `maxRequestMessageBytes`.
    pub fn with_max_request_message_bytes(mut self, bytes: u32) -> Self {
        self.max_request_message_bytes = Some(u64::from(bytes));
        self
    }
    /// This entry with `maxResponseMessageBytes`.
    pub fn with_max_response_message_bytes(mut self, bytes: u32) -> Self {
        self.max_response_message_bytes = Some(u64::from(bytes));
        self
    }
    /// The names this entry applies to.
    pub fn names(&self) -> &[MethodName] {
        &self.names
    }
    /// `timeout`: the per-call deadline when the caller sets none.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }
    /// `waitForReady`: a call that finds the channel unable to connect waits for it
    /// (until its deadline) instead of failing at once. The client layer applies it.
    pub fn wait_for_ready(&self) -> Option<bool> {
        self.wait_for_ready
    }
    /// `maxRequestMessageBytes`: a larger request message fails on the client with
    /// RESOURCE_EXHAUSTED before it is sent. The client layer applies it.
    pub fn max_request_message_bytes(&self) -> Option<u64> {
        self.max_request_message_bytes
    }
    /// `maxResponseMessageBytes`: a larger response message ends the call with
    /// RESOURCE_EXHAUSTED on the client. The client layer applies it.
    pub fn max_response_message_bytes(&self) -> Option<u64> {
        self.max_response_message_bytes
    }
    /// The retry policy, if any.
    pub fn retry_policy(&self) -> Option<&RetryPolicy> {
        self.retry_policy.as_ref()
    }
    /// The hedging policy, if any (never both).
    pub fn hedging_policy(&self) -> Option<&HedgingPolicy> {
        self.hedging_policy.as_ref()
    }
    /// idem's `circuitBreaker` object: the entry's own breaker, one for all its names,
    /// instead of the client-wide one (`idem.client.circuitBreaker`).
    pub fn circuit_breaker(&self) -> Option<&CircuitBreakerSettings> {
        self.circuit_breaker.as_ref()
    }
    /// idem's `idempotency` object; `Some` marks the method protected.
    pub fn idempotency(&self) -> Option<&IdempotencyPolicy> {
        self.idempotency.as_ref()
    }
    /// `"idempotency": false`: left unprotected on purpose (see
    /// [`with_idempotency_opt_out`](Self::with_idempotency_opt_out)).
    pub fn idempotency_opted_out(&self) -> bool {
        self.idempotency_opt_out
    }
    /// The JSON path of this entry (`methodConfig[2]`), or `None` when it was built in
    /// code.
    pub fn json_path(&self) -> Option<String> {
        self.source.map(|i| format!("methodConfig[{i}]"))
    }
}

pub(super) const METHOD_FIELDS: &[&str] = &[
    "name",
    "waitForReady",
    "timeout",
    "maxRequestMessageBytes",
    "maxResponseMessageBytes",
    "retryPolicy",
    "hedgingPolicy",
    "idempotency",
    "circuitBreaker",
];
pub(super) const NAME_FIELDS: &[&str] = &["service", "method"];
/// Largest `google.protobuf.UInt32Value`: `maxRequestMessageBytes`, `maxResponseMessageBytes`.
const U32_MAX: u64 = u32::MAX as u64;

impl Validator {
    /// `methodConfig`: every entry, in document order, without the ones that have no
    /// names (validated, then skipped with a warning).
    pub(super) fn method_configs(&mut self, list: &Value, path: String) -> Vec<MethodConfig> {
        let mut entries = Vec::new();
        match list {
            Value::Array(items) => {
                let mut seen = HashMap::new();
                for (i, item) in items.iter().enumerate() {
                    let p = format!("{path}[{i}]");
                    // An entry whose names were all refused already has errors.
                    let unnamed = match item.get("name") {
                        None | Some(Value::Null) => true,
                        Some(Value::Array(names)) => names.is_empty(),
                        Some(_) => false,
                    };
                    if let Some(mut mc) = self.method_config(item, p.clone(), &mut seen) {
                        mc.source = Some(i);
                        if mc.names.is_empty() && unnamed {
                            self.warn(
                                p,
                                "has no names, so it applies to no method: validated, then skipped",
                            );
                        } else {
                            entries.push(mc);
                        }
                    }
                }
            }
            other => self.error(
                path,
                format!("must be an array of method configs, not {}", kind(other)),
            ),
        }
        entries
    }

    fn method_config(
        &mut self,
        v: &Value,
        path: String,
        seen: &mut HashMap<MethodName, String>,
    ) -> Option<MethodConfig> {
        let o = self.object(v, path, METHOD_FIELDS)?;
        let names = self.names(&o, seen);
        let timeout = self.duration_field(&o, "timeout", Zero::Allowed);
        if timeout.is_some_and(|t| t.is_zero()) {
            self.warn(
                o.path("timeout"),
                "is 0: every call without its own deadline fails at once",
            );
        }
        let wait_for_ready = self.boolean(&o, "waitForReady");
        const BYTES_RULE: &str = "must be an integer in 0..=4294967295";
        let max_request_message_bytes =
            self.integer_field(&o, "maxRequestMessageBytes", 0, U32_MAX, BYTES_RULE);
        let max_response_message_bytes =
            self.integer_field(&o, "maxResponseMessageBytes", 0, U32_MAX, BYTES_RULE);

        let retry_policy = o
            .get("retryPolicy")
            .and_then(|v| self.retry_policy(v, o.path("retryPolicy")));
        let hedging_policy = o
            .get("hedgingPolicy")
            .and_then(|v| self.hedging_policy(v, o.path("hedgingPolicy")));
        if o.get("retryPolicy").is_some() && o.get("hedgingPolicy").is_some() {
            self.error(
                o.path.clone(),
                "retryPolicy and hedgingPolicy must not both be set",
            );
        }
        if let (Some(policy), Some(timeout)) = (&retry_policy, timeout) {
            self.check_worst_case(policy, timeout, o.path("retryPolicy"));
        }
        let (idempotency, idempotency_opt_out) = match o.get("idempotency") {
            None => (None, false),
            Some(Value::Bool(false)) => (None, true),
            Some(Value::Bool(true)) => {
                self.error(
                    o.path("idempotency"),
                    "must be an object ({} protects with the defaults) or false (opts out)",
                );
                (None, false)
            }
            Some(v) => (self.idempotency(v, o.path("idempotency")), false),
        };
        let circuit_breaker = o
            .get("circuitBreaker")
            .and_then(|v| self.circuit_breaker(v, o.path("circuitBreaker")));

        Some(MethodConfig {
            names,
            timeout,
            wait_for_ready,
            max_request_message_bytes,
            max_response_message_bytes,
            retry_policy,
            hedging_policy,
            idempotency,
            idempotency_opt_out,
            circuit_breaker,
            source: None,
        })
    }

    /// `name[]`: `""`, `null` and absent are the same; each name once in the document.
    fn names(&mut self, o: &Obj<'_>, seen: &mut HashMap<MethodName, String>) -> Vec<MethodName> {
        let mut names = Vec::new();
        let Some(v) = o.get("name") else { return names };
        let path = o.path("name");
        let Value::Array(items) = v else {
            self.error(
                path,
                format!(
                    "must be an array of {{service, method}} objects, not {}",
                    kind(v)
                ),
            );
            return names;
        };
        for (j, item) in items.iter().enumerate() {
            let p = format!("{path}[{j}]");
            let Some(n) = self.object(item, p.clone(), NAME_FIELDS) else {
                continue;
            };
            let (Some(service), Some(method)) =
                (self.name_part(&n, "service"), self.name_part(&n, "method"))
            else {
                continue;
            };
            if service.is_none() && method.is_some() {
                self.error(p, "service must not be empty when method is set");
                continue;
            }
            for (part, value) in [("service", &service), ("method", &method)] {
                if value.as_deref().is_some_and(|s| s.contains('/')) {
                    self.warn(
                        n.path(part),
                        "contains '/', so it never matches a request path",
                    );
                }
            }
            let name = MethodName { service, method };
            if let Some(first) = seen.get(&name) {
                self.error(p, format!("duplicate name {name}: first at {first}"));
                continue;
            }
            seen.insert(name.clone(), p);
            names.push(name);
        }
        names
    }

    /// `Some(None)` for `""`, `null` or absent; `None` after an error.
    fn name_part(&mut self, n: &Obj<'_>, key: &str) -> Option<Option<String>> {
        match n.get(key) {
            None => Some(None),
            Some(Value::String(s)) if s.is_empty() => Some(None),
            Some(Value::String(s)) => Some(Some(s.clone())),
            Some(other) => {
                self.error(
                    n.path(key),
                    format!("must be a string, not {}", kind(other)),
                );
                None
            }
        }
    }
}

#[cfg(test)]
mod tests;
