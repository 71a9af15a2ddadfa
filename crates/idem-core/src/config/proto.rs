//! The services' descriptors applied to a config ([`ServiceConfig::with_descriptors`]):
//! every configured name checked against the real services and methods, and each
//! method's protection decided by its `idempotency_level`, once, when the config is
//! built. The result is an ordinary [`ServiceConfig`] whose lookups cost what they
//! always did; [`ServiceConfig::method_policies`] says what applies to each method.

use std::sync::Arc;

use super::document::{Parsed, ServiceConfig};
use super::idempotency::IdempotencyPolicy;
use super::method::{MethodConfig, MethodName};
use super::read::{ConfigError, Diagnostic};
use super::retry::{HedgingPolicy, RetryPolicy};
use crate::descriptor::{Descriptors, IdempotencyLevel, MethodDescriptor, Streaming, nearest};

/// What applies to one method: its level and streaming kind (when descriptors say
/// them), whether it is protected, and its policies. `idem check-config --json` prints
/// one per method.
#[derive(Debug, Clone, PartialEq)]
pub struct MethodPolicy {
    /// `payments.v1.Payments/Charge`, or a configured name (`payments.v1.Payments/*`,
    /// `*`) without descriptors.
    pub method: String,
    /// The method's level; `None` without descriptors.
    pub idempotency_level: Option<IdempotencyLevel>,
    /// The method's streaming kind; `None` without descriptors.
    pub streaming: Option<Streaming>,
    /// A call with a key is deduplicated.
    pub protected: bool,
    /// A call without a key is refused (INVALID_ARGUMENT).
    pub key_required: bool,
    /// The retry policy the client applies.
    pub retry_policy: Option<RetryPolicy>,
    /// The hedging policy the client applies.
    pub hedging_policy: Option<HedgingPolicy>,
}

/// Where a method's entry came from in the lookup.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Match {
    Exact,
    Inherited,
}

impl ServiceConfig {
    /// This config checked against `descriptors` and completed by them:
    ///
    /// - every `methodConfig[].name` must name a service or a method in them (an error
    ///   names the JSON path and the nearest real name); an unknown field that is a near
    ///   miss of a known one (`idempotence`) is an error too;
    /// - a side-effecting method (level unset) without an `idempotency` object is
    ///   protected with the defaults and `keyRequired: false`: a call with a key is
    ///   deduplicated, one without passes through. `"idempotency": false` opts it out
    ///   (a warning), and then it must have no `retryPolicy` or `hedgingPolicy`;
    /// - an `IDEMPOTENT` method may be retried without protection, but hedged only with
    ///   an `idempotency` object; a `NO_SIDE_EFFECTS` method may be both;
    /// - a bidirectional-streaming method is never protected (an `idempotency` object
    ///   naming it exactly is an error; one inherited from its service is dropped for it,
    ///   with a note).
    ///
    /// The warnings and notes returned are the descriptors' only (parse warnings are
    /// returned by the parse). The config keeps the descriptors ([`descriptors`](Self::descriptors)).
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] listing every mismatch.
    pub fn with_descriptors(&self, descriptors: &Descriptors) -> Result<Parsed, ConfigError> {
        self.apply_descriptors(Arc::new(descriptors.clone()), Vec::new())
    }

    /// The descriptors this config was completed with, if any.
    pub fn descriptors(&self) -> Option<&Descriptors> {
        self.descriptors.as_deref()
    }

    /// What applies to each method of the descriptors, in file order; without
    /// descriptors, to each configured name, in document order.
    pub fn method_policies(&self) -> Vec<MethodPolicy> {
        let of = |method: String, mc: Option<&MethodConfig>, d: Option<&MethodDescriptor>| {
            MethodPolicy {
                method,
                idempotency_level: d.map(MethodDescriptor::idempotency_level),
                streaming: d.map(MethodDescriptor::streaming),
                protected: mc.is_some_and(|m| m.idempotency.is_some()),
                key_required: mc
                    .and_then(MethodConfig::idempotency)
                    .is_some_and(|p| p.key_required),
                retry_policy: mc.and_then(|m| m.retry_policy.clone()),
                hedging_policy: mc.and_then(|m| m.hedging_policy.clone()),
            }
        };
        match &self.descriptors {
            Some(d) => d
                .methods()
                .map(|m| of(m.full_name(), self.lookup(m.service(), m.name()), Some(m)))
                .collect(),
            None => self
                .method_configs
                .iter()
                .flat_map(|mc| {
                    mc.names
                        .iter()
                        .map(move |n| of(n.to_string(), Some(mc), None))
                })
                .collect(),
        }
    }

    /// The entry that applies to `service/method`, and how it matched.
    fn entry_of(&self, service: &str, method: &str) -> Option<(usize, Match)> {
        if let Some(&i) = self.by_method.get(&format!("{service}/{method}")) {
            return Some((i, Match::Exact));
        }
        let i = self
            .by_service
            .get(service)
            .copied()
            .or(self.default_entry)?;
        Some((i, Match::Inherited))
    }

    pub(super) fn apply_descriptors(
        &self,
        descriptors: Arc<Descriptors>,
        warnings: Vec<Diagnostic>,
    ) -> Result<Parsed, ConfigError> {
        let mut a = Apply {
            config: self,
            d: &descriptors,
            errors: Vec::new(),
            warnings,
            notes: Vec::new(),
            entries: self.method_configs.clone(),
            extra: Vec::new(),
        };
        a.typos();
        a.names();
        for m in descriptors.methods() {
            a.method(m);
        }
        if !a.errors.is_empty() {
            return Err(ConfigError::Invalid {
                errors: a.errors,
                warnings: a.warnings,
            });
        }
        let (warnings, notes) = (a.warnings, a.notes);
        let mut entries = a.entries;
        entries.extend(a.extra);
        let mut config =
            ServiceConfig::from_parts(entries, self.retry_throttling, self.settings.clone())?;
        config.descriptors = Some(descriptors);
        Ok(Parsed {
            config,
            warnings,
            notes,
        })
    }
}

/// Strict mode: every warning is an error.
pub(super) fn strict(parsed: Parsed) -> Result<Parsed, ConfigError> {
    if parsed.warnings.is_empty() {
        return Ok(parsed);
    }
    Err(ConfigError::Invalid {
        errors: parsed
            .warnings
            .into_iter()
            .map(|w| Diagnostic {
                path: w.path,
                message: format!("{} (an error in strict mode)", w.message),
            })
            .collect(),
        warnings: Vec::new(),
    })
}

/// One application of descriptors to a config.
struct Apply<'a> {
    config: &'a ServiceConfig,
    d: &'a Descriptors,
    errors: Vec<Diagnostic>,
    warnings: Vec<Diagnostic>,
    notes: Vec<Diagnostic>,
    /// The config's entries, less the exact names moved to `extra`.
    entries: Vec<MethodConfig>,
    /// One entry per method whose protection the descriptors decide.
    extra: Vec<MethodConfig>,
}

fn path_of(mc: &MethodConfig, i: usize) -> String {
    mc.json_path()
        .unwrap_or_else(|| format!("methodConfig[{i}]"))
}

impl Apply<'_> {
    fn error(&mut self, path: String, message: String) {
        self.errors.push(Diagnostic { path, message });
    }

    /// Near misses of field names are errors with descriptors: each leaves the warnings
    /// (it is reported once, as the error).
    fn typos(&mut self) {
        let typos = &self.config.typos;
        self.warnings.retain(|w| {
            !typos
                .iter()
                .any(|t| t.path == w.path && t.message == w.message)
        });
        for t in typos {
            self.errors.push(Diagnostic {
                path: t.path.clone(),
                message: format!(
                    "{} (an error with descriptors: a misspelled field can leave a method \
                     unprotected)",
                    t.message
                ),
            });
        }
    }

    /// Every configured name must be a service or a method of the descriptors.
    fn names(&mut self) {
        for (i, mc) in self.config.method_configs.iter().enumerate() {
            let path = path_of(mc, i);
            for (j, name) in mc.names.iter().enumerate() {
                if let Some(message) = self.unknown(name) {
                    self.error(format!("{path}.name[{j}]"), message);
                }
            }
        }
    }

    /// Why `name` matches nothing in the descriptors, with the nearest real name.
    fn unknown(&self, name: &MethodName) -> Option<String> {
        let d = self.d;
        let service = name.service.as_deref()?;
        let Some(methods) = d.service(service) else {
            let near = nearest(service, d.services());
            let hint = match (near, &name.method) {
                (Some(s), Some(m)) if d.method(s, m).is_some() => {
                    format!("; did you mean `{s}/{m}`?")
                }
                (Some(s), _) => format!("; did you mean `{s}`?"),
                (None, _) => format!(
                    "; the descriptors have {}",
                    listed(d.services().map(|s| format!("`{s}`")))
                ),
            };
            return Some(format!("no service `{service}` in the descriptors{hint}"));
        };
        let method = name.method.as_deref()?;
        if methods.iter().any(|m| m.name() == method) {
            return None;
        }
        let hint = match nearest(method, methods.iter().map(MethodDescriptor::name)) {
            Some(m) => format!("; did you mean `{service}/{m}`?"),
            None => format!(
                "; `{service}` has {}",
                listed(methods.iter().map(|m| format!("`{}`", m.name())))
            ),
        };
        Some(format!(
            "no method `{service}/{method}` in the descriptors{hint}"
        ))
    }

    /// Decides one method's protection by its level and streaming kind.
    fn method(&mut self, m: &MethodDescriptor) {
        let full = m.full_name();
        let found = self.config.entry_of(m.service(), m.name());
        let entry = found.map(|(i, _)| &self.config.method_configs[i]);
        let path = found.map_or_else(
            || "methodConfig".to_owned(),
            |(i, _)| path_of(&self.config.method_configs[i], i),
        );
        let protected = entry.is_some_and(|e| e.idempotency.is_some());
        let opted_out = entry.is_some_and(|e| e.idempotency_opt_out);
        let (retry, hedging) = (
            entry.is_some_and(|e| e.retry_policy.is_some()),
            entry.is_some_and(|e| e.hedging_policy.is_some()),
        );
        if m.streaming() == Streaming::Bidi {
            match found {
                Some((_, Match::Exact)) if protected => self.error(
                    format!("{path}.idempotency"),
                    format!(
                        "{full} is bidirectional streaming, which is never protected (its \
                         requests are not one message to fingerprint before it runs): remove \
                         the idempotency object"
                    ),
                ),
                Some((i, _)) if protected => {
                    self.notes.push(Diagnostic {
                        path: format!("{path}.idempotency"),
                        message: format!(
                            "not applied to {full}: bidirectional streaming is never protected"
                        ),
                    });
                    self.materialize(m, i, None);
                }
                _ => self.notes.push(Diagnostic {
                    path: "$".to_owned(),
                    message: format!(
                        "{full} is bidirectional streaming: never protected, a key sent to it \
                         is ignored"
                    ),
                }),
            }
            return;
        }
        match m.idempotency_level() {
            IdempotencyLevel::IdempotencyUnknown if protected => {}
            IdempotencyLevel::IdempotencyUnknown if opted_out => {
                self.warnings.push(Diagnostic {
                    path: format!("{path}.idempotency"),
                    message: format!(
                        "{full} has side effects (no idempotency_level) and is opted out: a \
                         key sent to it is ignored and a repeated call runs again"
                    ),
                });
                for (set, field) in [(retry, "retryPolicy"), (hedging, "hedgingPolicy")] {
                    if set {
                        self.error(
                            format!("{path}.{field}"),
                            format!(
                                "{full} has side effects and is opted out of idempotency: \
                                 retries would run it twice; protect it (remove \
                                 \"idempotency\": false) or drop the {field}"
                            ),
                        );
                    }
                }
            }
            IdempotencyLevel::IdempotencyUnknown => {
                let policy = IdempotencyPolicy {
                    key_required: false,
                    ..IdempotencyPolicy::default()
                };
                self.notes.push(Diagnostic {
                    path: "$".to_owned(),
                    message: format!(
                        "{full} has side effects (no idempotency_level): protected, key \
                         optional"
                    ),
                });
                match found {
                    Some((i, _)) => self.materialize(m, i, Some(policy)),
                    None => self.extra.push(
                        MethodConfig::empty()
                            .with_name(m.service(), m.name())
                            .with_idempotency(policy),
                    ),
                }
            }
            IdempotencyLevel::Idempotent if hedging && !protected => self.error(
                format!("{path}.hedgingPolicy"),
                format!(
                    "{full} is IDEMPOTENT: only NO_SIDE_EFFECTS methods may be hedged without \
                     protection (hedges run at once, side by side); add an idempotency object \
                     or use a retryPolicy"
                ),
            ),
            IdempotencyLevel::Idempotent | IdempotencyLevel::NoSideEffects => {}
        }
    }

    /// Gives `m` an exact entry of its own: entry `i`'s settings with `idempotency`.
    fn materialize(
        &mut self,
        m: &MethodDescriptor,
        i: usize,
        idempotency: Option<IdempotencyPolicy>,
    ) {
        let name = MethodName {
            service: Some(m.service().to_owned()),
            method: Some(m.name().to_owned()),
        };
        self.entries[i].names.retain(|n| *n != name);
        let mut own = self.config.method_configs[i].clone();
        own.names = vec![name];
        own.idempotency = idempotency;
        self.extra.push(own);
    }
}

/// `a, b and c`.
fn listed(items: impl Iterator<Item = String>) -> String {
    let items: Vec<String> = items.collect();
    match items.as_slice() {
        [] => "no services".to_owned(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

#[cfg(test)]
mod tests;
