//! Reading a config document: the [`Validator`] that records every broken rule with its
//! JSON path and carries on, the readers of JSON values every section shares, JSON paths
//! ([`child`]) and near misses (a known field name in another case).
//!
//! The document is read as a [`serde_json::Value`] and walked by hand rather than
//! deserialized with serde derive: derive stops at the first error, and a config check
//! must report every error at once, each with its JSON path. Every reader records its
//! error and carries on with the next field; the result is built only when no error was
//! recorded. Each section (`method`, `retry`, `idempotency`, `idem`, `stores`) adds the
//! readers of its own objects to [`Validator`]. See the [module docs](super) for the
//! rules and the choices made where grpc-go, grpc-java and C-core disagree.

use std::fmt;
use std::time::Duration;

use serde_json::{Map, Number, Value};

use super::duration::parse_duration;
use crate::code::{Code, code_from_i64, code_name, parse_code_name};
use crate::descriptor::nearest;

/// One finding about a config document: where (a JSON path such as
/// `methodConfig[0].retryPolicy.maxAttempts`) and what rule it breaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// JSON path of the offending value (`$` for the document itself).
    pub path: String,
    /// The rule, in lower case: `must be an integer > 1`.
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Why a config document was refused.
///
/// `Debug` prints the same sentences as `Display`, one error per line, so a `main` that
/// returns `Result<_, Box<dyn Error>>` and meets a bad config prints something a person
/// can act on rather than a struct dump.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read the service config {path}: {message}")]
    Read {
        /// The path as given.
        path: String,
        /// The operating system's reason.
        message: String,
    },
    /// The text is not JSON (or not a JSON object at the top).
    #[error("invalid JSON at line {line}, column {column}: {message}")]
    Json {
        /// 1-based line of the parser's error.
        line: usize,
        /// 1-based column of the parser's error.
        column: usize,
        /// The parser's message.
        message: String,
    },
    /// The JSON breaks one or more rules; every error is listed.
    #[error("{} error(s) in service config: {}", .errors.len(), join(.errors))]
    Invalid {
        /// Every error found, in document order.
        errors: Vec<Diagnostic>,
        /// Warnings found along the way.
        warnings: Vec<Diagnostic>,
    },
}

impl fmt::Debug for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Json { .. } | ConfigError::Read { .. } => fmt::Display::fmt(self, f),
            ConfigError::Invalid { errors, .. } => {
                write!(f, "{} error(s) in service config:", errors.len())?;
                for e in errors {
                    write!(f, "\n  {e}")?;
                }
                Ok(())
            }
        }
    }
}

fn join(d: &[Diagnostic]) -> String {
    d.iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

/// grpc-go keeps durations as `time.Duration` (int64 nanoseconds) and refuses longer ones.
const GO_MAX_DURATION_SECS: u64 = (i64::MAX as u64) / 1_000_000_000;

/// "a string", "an array", … for messages.
pub(super) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `parent.key`, or `parent["odd key"]` when the key is not a plain identifier.
pub(super) fn child(parent: &str, key: &str) -> String {
    let plain = !key.is_empty() && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    let quoted;
    let key = if plain {
        key
    } else {
        quoted = serde_json::to_string(key).unwrap_or_else(|_| format!("{key:?}"));
        quoted.as_str()
    };
    match (parent.is_empty(), plain) {
        (true, true) => key.to_owned(),
        (true, false) => format!("[{key}]"),
        (false, true) => format!("{parent}.{key}"),
        (false, false) => format!("{parent}[{key}]"),
    }
}

/// A known field spelled with another case or with snake_case (`MaxAttempts`,
/// `max_attempts`): grpc-go matches field names case-insensitively, C-core, grpc-java
/// and idem do not, so such a field is read by some stacks only.
pub(super) fn near_miss<'k>(key: &str, known: &[&'k str]) -> Option<&'k str> {
    let norm = |s: &str| -> String {
        s.chars()
            .filter(|c| *c != '_' && *c != '-')
            .flat_map(char::to_lowercase)
            .collect()
    };
    let k = norm(key);
    known.iter().copied().find(|known| norm(known) == k)
}

/// An object being read, with its path.
pub(super) struct Obj<'a> {
    pub(super) map: &'a Map<String, Value>,
    pub(super) path: String,
}

impl<'a> Obj<'a> {
    /// The field's value; JSON `null` is the same as absent (proto3 JSON).
    pub(super) fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }
    pub(super) fn path(&self, key: &str) -> String {
        child(&self.path, key)
    }
}

/// The shortest lease or sweep interval: tokio's timers have millisecond resolution.
pub(super) const MIN_TIMER: Duration = Duration::from_millis(1);

/// Whether a duration may be zero.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Zero {
    /// Zero is a valid value.
    Allowed,
    /// Zero is an error.
    Refused,
}

/// Collects the errors and warnings of one document as its readers go.
#[derive(Default)]
pub(super) struct Validator {
    pub(super) errors: Vec<Diagnostic>,
    pub(super) warnings: Vec<Diagnostic>,
    /// The unknown fields that are near misses of a known one (also in `warnings`):
    /// errors once descriptors are attached, since a misspelled `idempotency` leaves a
    /// method unprotected.
    pub(super) typos: Vec<Diagnostic>,
}

impl Validator {
    pub(super) fn error(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.errors.push(Diagnostic {
            path: path.into(),
            message: message.into(),
        });
    }

    pub(super) fn warn(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.warnings.push(Diagnostic {
            path: path.into(),
            message: message.into(),
        });
    }

    /// A warning about a near miss of a known field name (kept among the typos too).
    pub(super) fn typo(&mut self, path: String, message: String) {
        self.typos.push(Diagnostic {
            path: path.clone(),
            message: message.clone(),
        });
        self.warn(path, message);
    }

    /// `value` as an object; warns about every field not in `known`, with the known
    /// field it is nearest to ("did you mean") when it is a near miss.
    pub(super) fn object<'a>(
        &mut self,
        value: &'a Value,
        path: String,
        known: &[&str],
    ) -> Option<Obj<'a>> {
        let Value::Object(map) = value else {
            self.error(path, format!("must be a JSON object, not {}", kind(value)));
            return None;
        };
        let o = Obj { map, path };
        for key in map.keys() {
            if !known.contains(&key.as_str()) {
                let message = match near_miss(key, known) {
                    Some(k) => format!(
                        "unknown field, ignored: field names are case-sensitive; did you mean \"{k}\"?"
                    ),
                    None => match nearest(key, known.iter().copied()) {
                        Some(k) => format!("unknown field, ignored; did you mean \"{k}\"?"),
                        None => "unknown field, ignored".to_owned(),
                    },
                };
                if message.contains("did you mean") {
                    self.typo(o.path(key), message);
                } else {
                    self.warn(o.path(key), message);
                }
            }
        }
        Some(o)
    }

    /// The field's value, or an error `is required and {rule}` when absent or null.
    pub(super) fn required<'a>(&mut self, o: &Obj<'a>, key: &str, rule: &str) -> Option<&'a Value> {
        let v = o.get(key);
        if v.is_none() {
            self.error(o.path(key), format!("is required and {rule}"));
        }
        v
    }

    pub(super) fn boolean(&mut self, o: &Obj<'_>, key: &str) -> Option<bool> {
        match o.get(key)? {
            Value::Bool(b) => Some(*b),
            other => {
                self.error(
                    o.path(key),
                    format!("must be true or false, not {}", kind(other)),
                );
                None
            }
        }
    }

    /// A JSON integer in `min..=max`. `2.0`, `2e0` and `"2"` are refused (see module docs).
    pub(super) fn integer(
        &mut self,
        v: &Value,
        path: String,
        min: u64,
        max: u64,
        rule: &str,
    ) -> Option<u64> {
        let n = match v {
            Value::Number(n) => n,
            Value::String(_) => {
                self.error(path, format!("{rule} (a JSON number, not a string)"));
                return None;
            }
            other => {
                self.error(path, format!("{rule}, not {}", kind(other)));
                return None;
            }
        };
        if let Some(x) = n.as_u64() {
            if (min..=max).contains(&x) {
                return Some(x);
            }
            self.error(path, rule);
            return None;
        }
        if n.is_i64() {
            self.error(path, rule);
            return None;
        }
        // A float literal. Integral ones (2.0, 1e3) get a hint: grpc-go and C-core refuse them.
        match n.as_f64() {
            Some(f) if f.fract() == 0.0 && f >= min as f64 && f <= max as f64 => self.error(
                path,
                format!("{rule}; write {} without a fraction or exponent", f as u64),
            ),
            _ => self.error(path, rule),
        }
        None
    }

    pub(super) fn integer_field(
        &mut self,
        o: &Obj<'_>,
        key: &str,
        min: u64,
        max: u64,
        rule: &str,
    ) -> Option<u64> {
        let v = o.get(key)?;
        self.integer(v, o.path(key), min, max, rule)
    }

    /// A positive size that fits `usize`.
    pub(super) fn size_field(&mut self, o: &Obj<'_>, key: &str) -> Option<usize> {
        let max = u64::try_from(usize::MAX).unwrap_or(u64::MAX);
        self.integer_field(o, key, 1, max, "must be an integer > 0")
            .and_then(|x| usize::try_from(x).ok())
    }

    /// A JSON number > 0 (any form: `2`, `2.5`, `1e-3`).
    pub(super) fn positive_number<'a>(
        &mut self,
        v: &'a Value,
        path: String,
        rule: &str,
    ) -> Option<&'a Number> {
        match v {
            Value::Number(n) if n.as_f64().is_some_and(|f| f.is_finite() && f > 0.0) => Some(n),
            Value::Number(_) => {
                self.error(path, rule);
                None
            }
            Value::String(_) => {
                self.error(path, format!("{rule} (a JSON number, not a string)"));
                None
            }
            other => {
                self.error(path, format!("{rule}, not {}", kind(other)));
                None
            }
        }
    }

    pub(super) fn duration(&mut self, v: &Value, path: String, zero: Zero) -> Option<Duration> {
        let Value::String(s) = v else {
            self.error(
                path,
                format!(
                    "must be a duration string such as \"1.5s\", not {}",
                    kind(v)
                ),
            );
            return None;
        };
        match parse_duration(s) {
            Ok(d) if d.is_zero() && zero == Zero::Refused => {
                self.error(path, "must be a duration > 0");
                None
            }
            Ok(d) => {
                if d.as_secs() > GO_MAX_DURATION_SECS {
                    self.warn(
                        path,
                        format!(
                            "grpc-go refuses durations above {GO_MAX_DURATION_SECS}s (it keeps int64 nanoseconds)"
                        ),
                    );
                }
                Some(d)
            }
            Err(e) => {
                self.error(
                    path,
                    format!("must be a proto3 JSON duration such as \"1.5s\": {e}"),
                );
                None
            }
        }
    }

    pub(super) fn duration_field(
        &mut self,
        o: &Obj<'_>,
        key: &str,
        zero: Zero,
    ) -> Option<Duration> {
        let v = o.get(key)?;
        self.duration(v, o.path(key), zero)
    }

    pub(super) fn string_field<'a>(&mut self, o: &Obj<'a>, key: &str) -> Option<&'a str> {
        match o.get(key)? {
            Value::String(s) => Some(s),
            other => {
                self.error(
                    o.path(key),
                    format!("must be a string, not {}", kind(other)),
                );
                None
            }
        }
    }

    /// One status code: a name (any case) or an integer 0..=16.
    pub(super) fn code(&mut self, v: &Value, path: String) -> Option<Code> {
        const RULE: &str =
            "must be a status code name such as \"UNAVAILABLE\" or an integer 0..=16";
        match v {
            Value::String(s) => match parse_code_name(s) {
                Some(c) => {
                    if s != code_name(c) {
                        self.warn(
                            path,
                            format!(
                                "\"{s}\" is read as {0}, but grpc-go, grpc-java and C-core accept only \"{0}\"",
                                code_name(c)
                            ),
                        );
                    }
                    Some(c)
                }
                None => {
                    self.error(path, RULE);
                    None
                }
            },
            Value::Number(n) => match n
                .as_u64()
                .and_then(|x| i64::try_from(x).ok())
                .and_then(code_from_i64)
            {
                Some(c) => {
                    self.warn(
                        path,
                        format!(
                            "an integer code is read as {0}, but C-core accepts only names: write \"{0}\"",
                            code_name(c)
                        ),
                    );
                    Some(c)
                }
                None => {
                    self.error(path, RULE);
                    None
                }
            },
            other => {
                self.error(path, format!("{RULE}, not {}", kind(other)));
                None
            }
        }
    }

    /// A list of status codes, with the path of each element (for warnings).
    pub(super) fn codes(
        &mut self,
        v: &Value,
        path: String,
        non_empty: bool,
    ) -> Option<Vec<(Code, String)>> {
        let Value::Array(items) = v else {
            self.error(
                path,
                format!("must be an array of status codes, not {}", kind(v)),
            );
            return None;
        };
        if non_empty && items.is_empty() {
            self.error(path, "must be a non-empty array of status codes");
            return None;
        }
        let mut out = Vec::with_capacity(items.len());
        let mut ok = true;
        for (k, item) in items.iter().enumerate() {
            let p = format!("{path}[{k}]");
            match self.code(item, p.clone()) {
                Some(c) => out.push((c, p)),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    pub(super) fn codes_field(
        &mut self,
        o: &Obj<'_>,
        key: &str,
        non_empty: bool,
    ) -> Option<Vec<(Code, String)>> {
        let v = o.get(key)?;
        self.codes(v, o.path(key), non_empty)
    }
}

#[cfg(test)]
mod tests;
