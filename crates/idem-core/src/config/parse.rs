//! JSON wire form → validated domain types.
//!
//! The document is read as a [`serde_json::Value`] and walked by hand rather than
//! deserialized with serde derive: derive stops at the first error, and a config check
//! must report every error at once, each with its JSON path. Every reader below records
//! its error and carries on with the next field; the result is built only when no error
//! was recorded. See the [module docs](super) for the rules and the choices made where
//! grpc-go, grpc-java and C-core disagree.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{Map, Number, Value};

use super::duration::{format_duration, parse_duration};
use super::types::{
    ClientSettings, Compression, CompressionSet, ConfigError, Diagnostic, HedgingPolicy,
    IdemSettings, IdempotencyPolicy, InFlightPolicy, MAX_ATTEMPTS_LIMIT, MethodConfig, MethodName,
    Parsed, RedisSettings, RetryPolicy, RetryThrottling, ServiceConfig, TenantSource,
};
use idem_store::memory::MemoryStoreSettings;

use crate::code::{Code, CodeSet, code_from_i64, code_name, parse_code_name};

/// Top-level fields idem reads. Every other top-level field (loadBalancingConfig,
/// healthCheckConfig, …) belongs to another part of gRPC and is ignored.
const TOP_FIELDS: &[&str] = &["methodConfig", "retryThrottling", "idem"];
const METHOD_FIELDS: &[&str] = &[
    "name",
    "waitForReady",
    "timeout",
    "maxRequestMessageBytes",
    "maxResponseMessageBytes",
    "retryPolicy",
    "hedgingPolicy",
    "idempotency",
];
const NAME_FIELDS: &[&str] = &["service", "method"];
const RETRY_FIELDS: &[&str] = &[
    "maxAttempts",
    "initialBackoff",
    "maxBackoff",
    "backoffMultiplier",
    "retryableStatusCodes",
    "perAttemptRecvTimeout",
];
const HEDGING_FIELDS: &[&str] = &["maxAttempts", "hedgingDelay", "nonFatalStatusCodes"];
const THROTTLING_FIELDS: &[&str] = &["maxTokens", "tokenRatio"];
const IDEMPOTENCY_FIELDS: &[&str] = &[
    "keyRequired",
    "recordTtl",
    "leaseTtl",
    "inFlight",
    "abortRetryDelay",
    "cacheableStatusCodes",
    "releaseStatusCodes",
    "maxRequestBytes",
    "maxResponseBytes",
    "maxRequestFrames",
    "acceptCompressed",
    "failOpen",
    "completionRetryTimeout",
    "responseStallTimeout",
];
const IDEM_FIELDS: &[&str] = &[
    "keyHeader",
    "tenant",
    "maxHandlersInFlight",
    "memoryStore",
    "redis",
    "client",
];
const TENANT_FIELDS: &[&str] = &["single", "header"];
const MEMORY_FIELDS: &[&str] = &[
    "maxEntries",
    "maxBytes",
    "maxInFlightPerTenant",
    "maxEntriesPerTenant",
    "maxBytesPerTenant",
    "sweepInterval",
    "minRetention",
    "tombstoneTtl",
];
const REDIS_FIELDS: &[&str] = &[
    "url",
    "keyPrefix",
    "commandTimeout",
    "connectTimeout",
    "maxInFlightPerTenant",
    "clusterNodes",
    "replicaAcks",
    "replicaAckTimeout",
];
/// Default of `idem.redis.maxInFlightPerTenant`.
const REDIS_MAX_IN_FLIGHT_PER_TENANT: usize = 1000;
const CLIENT_FIELDS: &[&str] = &[
    "keyAllMethods",
    "maxReplayBytesPerCall",
    "maxReplayBytesTotal",
    "minAttemptTime",
    "retryExhaustedPushback",
    "noRetryUnderRetriedInbound",
];

/// The fields of every object idem reads, for the tests' generated documents.
#[cfg(test)]
pub(super) const FIELD_LISTS: &[&[&str]] = &[
    TOP_FIELDS,
    METHOD_FIELDS,
    NAME_FIELDS,
    RETRY_FIELDS,
    HEDGING_FIELDS,
    THROTTLING_FIELDS,
    IDEMPOTENCY_FIELDS,
    IDEM_FIELDS,
    TENANT_FIELDS,
    MEMORY_FIELDS,
    REDIS_FIELDS,
    CLIENT_FIELDS,
];

/// Codes whose retry cannot help: the server will answer the same (or there was no error).
pub(crate) const RISKY_RETRYABLE: CodeSet = CodeSet::of(Code::InvalidArgument)
    .with(Code::NotFound)
    .with(Code::PermissionDenied)
    .with(Code::Unauthenticated)
    .with(Code::FailedPrecondition)
    .with(Code::Unimplemented)
    .with(Code::DataLoss)
    .with(Code::Ok);

/// Largest `google.protobuf.UInt32Value`: `maxRequestMessageBytes`, `maxResponseMessageBytes`.
const U32_MAX: u64 = u32::MAX as u64;
/// grpc-go keeps durations as `time.Duration` (int64 nanoseconds) and refuses longer ones.
const GO_MAX_DURATION_SECS: u64 = (i64::MAX as u64) / 1_000_000_000;
/// `maxTokens` is at most 1000, so a ratio above 1000 tokens refills as much as 1000 does.
const MAX_TOKEN_RATIO_MILLI: u32 = 1_000_000;
/// A6 (2024): the jitter multiplies each backoff by up to 1.2.
const MAX_JITTER: f64 = 1.2;

pub(crate) fn parse(text: &str) -> Result<Parsed, ConfigError> {
    let read = super::json::read(text).map_err(|e| {
        // serde_json's Display ends in " at line L column C"; the fields carry those.
        let full = e.to_string();
        let suffix = format!(" at line {} column {}", e.line(), e.column());
        let message = full.strip_suffix(&suffix).unwrap_or(&full).to_owned();
        ConfigError::Json {
            line: e.line(),
            column: e.column(),
            message,
        }
    })?;
    let doc = read.value;
    let Value::Object(top) = &doc else {
        let (line, column) = first_token_position(text);
        return Err(ConfigError::Json {
            line,
            column,
            message: format!(
                "the service config must be a JSON object, not {}",
                kind(&doc)
            ),
        });
    };
    let mut v = Validator::default();
    for path in read.repeated {
        v.error(
            path,
            "duplicate key: C-core refuses the document (grpc-go and grpc-java keep the last value)",
        );
    }
    let config = v.document(top);
    match config {
        Some(config) if v.errors.is_empty() => Ok(Parsed {
            config,
            warnings: v.warnings,
        }),
        _ => Err(ConfigError::Invalid {
            errors: v.errors,
            warnings: v.warnings,
        }),
    }
}

/// 1-based line and column of the first non-blank character (where the value starts).
fn first_token_position(text: &str) -> (usize, usize) {
    let (mut line, mut column) = (1, 1);
    for c in text.chars() {
        match c {
            '\n' => {
                line += 1;
                column = 1;
            }
            ' ' | '\t' | '\r' => column += 1,
            _ => break,
        }
    }
    (line, column)
}

/// "a string", "an array", … for messages.
fn kind(v: &Value) -> &'static str {
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
pub(crate) fn child(parent: &str, key: &str) -> String {
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
fn near_miss<'k>(key: &str, known: &[&'k str]) -> Option<&'k str> {
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
struct Obj<'a> {
    map: &'a Map<String, Value>,
    path: String,
}

impl<'a> Obj<'a> {
    /// The field's value; JSON `null` is the same as absent (proto3 JSON).
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }
    fn path(&self, key: &str) -> String {
        child(&self.path, key)
    }
}

/// The shortest lease or sweep interval: tokio's timers have millisecond resolution.
const MIN_TIMER: Duration = Duration::from_millis(1);

/// The most records a memory store may be configured for (2^32): far beyond what fits
/// in any machine's memory at the per-record overhead.
const MAX_MEMORY_ENTRIES: u64 = 1 << 32;

/// The most bytes a memory store may be configured for: the user address space of a
/// 64-bit process (2^48, x86-64 and aarch64 with 4-level page tables), or all of it on
/// smaller targets.
fn max_memory_bytes() -> usize {
    usize::try_from(1u64 << 48).unwrap_or(isize::MAX.unsigned_abs())
}

/// Whether a duration may be zero.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Zero {
    Allowed,
    Refused,
}

#[derive(Default)]
struct Validator {
    errors: Vec<Diagnostic>,
    warnings: Vec<Diagnostic>,
}

impl Validator {
    fn error(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.errors.push(Diagnostic {
            path: path.into(),
            message: message.into(),
        });
    }

    fn warn(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.warnings.push(Diagnostic {
            path: path.into(),
            message: message.into(),
        });
    }

    // ---- the document -------------------------------------------------------------------

    fn document(&mut self, top: &Map<String, Value>) -> Option<ServiceConfig> {
        let o = Obj {
            map: top,
            path: String::new(),
        };
        for key in top.keys() {
            // Other unknown top-level fields belong to other parts of gRPC
            // (loadBalancingConfig, healthCheckConfig, …) and are ignored silently.
            if !TOP_FIELDS.contains(&key.as_str())
                && let Some(known) = near_miss(key, TOP_FIELDS)
            {
                self.warn(
                    o.path(key),
                    format!("not read: field names are case-sensitive; did you mean \"{known}\"?"),
                );
            }
        }

        let mut entries = Vec::new();
        if let Some(list) = o.get("methodConfig") {
            let path = o.path("methodConfig");
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
                        if let Some(mc) = self.method_config(item, p.clone(), &mut seen) {
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
        }

        let throttling = o
            .get("retryThrottling")
            .and_then(|v| self.retry_throttling(v, o.path("retryThrottling")));
        let settings = match o.get("idem") {
            Some(v) => self.idem_settings(v, o.path("idem")),
            None => Some(IdemSettings::default()),
        };

        let settings = settings?;
        match ServiceConfig::from_parts(entries, throttling, settings) {
            Ok(config) => Some(config),
            Err(ConfigError::Invalid { errors, .. }) => {
                // Unreachable in practice: duplicates are found above, with document paths.
                self.errors.extend(errors);
                None
            }
            Err(e @ (ConfigError::Json { .. } | ConfigError::Read { .. })) => {
                self.error("$", e.to_string());
                None
            }
        }
    }

    // ---- generic readers ----------------------------------------------------------------

    /// `value` as an object; warns about every field not in `known`.
    fn object<'a>(&mut self, value: &'a Value, path: String, known: &[&str]) -> Option<Obj<'a>> {
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
                    None => "unknown field, ignored".to_owned(),
                };
                self.warn(o.path(key), message);
            }
        }
        Some(o)
    }

    /// The field's value, or an error `is required and {rule}` when absent or null.
    fn required<'a>(&mut self, o: &Obj<'a>, key: &str, rule: &str) -> Option<&'a Value> {
        let v = o.get(key);
        if v.is_none() {
            self.error(o.path(key), format!("is required and {rule}"));
        }
        v
    }

    fn boolean(&mut self, o: &Obj<'_>, key: &str) -> Option<bool> {
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
    fn integer(&mut self, v: &Value, path: String, min: u64, max: u64, rule: &str) -> Option<u64> {
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

    fn integer_field(
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
    fn size_field(&mut self, o: &Obj<'_>, key: &str) -> Option<usize> {
        let max = u64::try_from(usize::MAX).unwrap_or(u64::MAX);
        self.integer_field(o, key, 1, max, "must be an integer > 0")
            .and_then(|x| usize::try_from(x).ok())
    }

    /// A JSON number > 0 (any form: `2`, `2.5`, `1e-3`).
    fn positive_number<'a>(
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

    fn duration(&mut self, v: &Value, path: String, zero: Zero) -> Option<Duration> {
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

    fn duration_field(&mut self, o: &Obj<'_>, key: &str, zero: Zero) -> Option<Duration> {
        let v = o.get(key)?;
        self.duration(v, o.path(key), zero)
    }

    fn string_field<'a>(&mut self, o: &Obj<'a>, key: &str) -> Option<&'a str> {
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
    fn code(&mut self, v: &Value, path: String) -> Option<Code> {
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
    fn codes(&mut self, v: &Value, path: String, non_empty: bool) -> Option<Vec<(Code, String)>> {
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

    fn codes_field(
        &mut self,
        o: &Obj<'_>,
        key: &str,
        non_empty: bool,
    ) -> Option<Vec<(Code, String)>> {
        let v = o.get(key)?;
        self.codes(v, o.path(key), non_empty)
    }

    /// `maxAttempts` of a retry or hedging policy: required, > 1, clamped to 5.
    fn max_attempts(&mut self, o: &Obj<'_>) -> Option<u32> {
        const RULE: &str = "must be an integer > 1";
        let v = self.required(o, "maxAttempts", RULE)?;
        let n = self.integer(v, o.path("maxAttempts"), 2, u64::MAX, RULE)?;
        if n > u64::from(MAX_ATTEMPTS_LIMIT) {
            self.warn(
                o.path("maxAttempts"),
                format!("{n} is clamped to {MAX_ATTEMPTS_LIMIT} (gRPC allows at most {MAX_ATTEMPTS_LIMIT} attempts)"),
            );
        }
        Some(n.min(u64::from(MAX_ATTEMPTS_LIMIT)) as u32)
    }

    // ---- methodConfig[] -----------------------------------------------------------------

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
        let idempotency = o
            .get("idempotency")
            .and_then(|v| self.idempotency(v, o.path("idempotency")));

        Some(MethodConfig {
            names,
            timeout,
            wait_for_ready,
            max_request_message_bytes,
            max_response_message_bytes,
            retry_policy,
            hedging_policy,
            idempotency,
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

    fn retry_policy(&mut self, v: &Value, path: String) -> Option<RetryPolicy> {
        let o = self.object(v, path, RETRY_FIELDS)?;
        let max_attempts = self.max_attempts(&o);
        const BACKOFF_RULE: &str = "must be a duration > 0";
        let initial_backoff = self
            .required(&o, "initialBackoff", BACKOFF_RULE)
            .and_then(|v| self.duration(v, o.path("initialBackoff"), Zero::Refused));
        let max_backoff = self
            .required(&o, "maxBackoff", BACKOFF_RULE)
            .and_then(|v| self.duration(v, o.path("maxBackoff"), Zero::Refused));
        const MULTIPLIER_RULE: &str = "must be a number > 0";
        let multiplier = self
            .required(&o, "backoffMultiplier", MULTIPLIER_RULE)
            .and_then(|v| self.positive_number(v, o.path("backoffMultiplier"), MULTIPLIER_RULE))
            .and_then(Number::as_f64);
        let codes = self
            .required(
                &o,
                "retryableStatusCodes",
                "must be a non-empty array of status codes",
            )
            .and_then(|v| self.codes(v, o.path("retryableStatusCodes"), true));
        let per_attempt = self.duration_field(&o, "perAttemptRecvTimeout", Zero::Refused);

        if let Some(codes) = &codes {
            for (c, p) in codes {
                if RISKY_RETRYABLE.contains(*c) {
                    let why = if *c == Code::Ok {
                        "OK is not a failure"
                    } else {
                        "it means the server will answer the same, so retrying cannot help"
                    };
                    self.warn(
                        p.clone(),
                        format!("retrying {} is risky: {why}", code_name(*c)),
                    );
                }
            }
        }
        if let (Some(i), Some(m)) = (initial_backoff, max_backoff)
            && m < i
        {
            self.warn(
                o.path("maxBackoff"),
                format!(
                    "is less than initialBackoff {}: every backoff is {}",
                    format_duration(i),
                    format_duration(m)
                ),
            );
        }

        let codes: CodeSet = codes?.into_iter().map(|(c, _)| c).collect();
        let policy = RetryPolicy::new(
            max_attempts?,
            initial_backoff?,
            max_backoff?,
            multiplier?,
            codes,
        );
        match policy {
            Ok(p) => Some(p.with_per_attempt_recv_timeout(per_attempt)),
            Err(e) => {
                self.error(o.path.clone(), e.to_string());
                None
            }
        }
    }

    /// Warns when the backoffs alone (each at its maximum jitter) outlast the timeout.
    fn check_worst_case(&mut self, p: &RetryPolicy, timeout: Duration, path: String) {
        if timeout.is_zero() {
            return; // already warned about
        }
        let retries = p.max_attempts().saturating_sub(1);
        let max = p.max_backoff().as_secs_f64();
        let mut backoff = p.initial_backoff().as_secs_f64();
        let mut total = 0.0;
        for _ in 0..retries {
            total += backoff.min(max) * MAX_JITTER;
            backoff = (backoff * p.backoff_multiplier()).min(max);
        }
        if total > timeout.as_secs_f64() {
            let shown = Duration::try_from_secs_f64(total)
                .map(|d| format_duration(Duration::from_millis(d.as_millis() as u64)))
                .unwrap_or_else(|_| format!("{total}s"));
            self.warn(
                path,
                format!(
                    "worst case backoff {shown} ({retries} retries, each at 1.2 × its maximum) exceeds timeout {}: the last retries cannot run",
                    format_duration(timeout)
                ),
            );
        }
    }

    fn hedging_policy(&mut self, v: &Value, path: String) -> Option<HedgingPolicy> {
        let o = self.object(v, path, HEDGING_FIELDS)?;
        let max_attempts = self.max_attempts(&o);
        let delay = match o.get("hedgingDelay") {
            Some(v) => self.duration(v, o.path("hedgingDelay"), Zero::Allowed),
            None => Some(Duration::ZERO),
        };
        let codes = match o.get("nonFatalStatusCodes") {
            Some(v) => self.codes(v, o.path("nonFatalStatusCodes"), false),
            None => Some(Vec::new()),
        };
        Some(HedgingPolicy {
            max_attempts: max_attempts?,
            hedging_delay: delay?,
            non_fatal_status_codes: codes?.into_iter().map(|(c, _)| c).collect(),
        })
    }

    // ---- retryThrottling ----------------------------------------------------------------

    fn retry_throttling(&mut self, v: &Value, path: String) -> Option<RetryThrottling> {
        let o = self.object(v, path, THROTTLING_FIELDS)?;
        const TOKENS_RULE: &str = "must be an integer in (0, 1000]";
        let max_tokens = self
            .required(&o, "maxTokens", TOKENS_RULE)
            .and_then(|v| self.integer(v, o.path("maxTokens"), 1, 1000, TOKENS_RULE));
        const RATIO_RULE: &str = "must be a number > 0";
        let ratio = self
            .required(&o, "tokenRatio", RATIO_RULE)
            .and_then(|v| self.positive_number(v, o.path("tokenRatio"), RATIO_RULE));
        let token_ratio_milli = match ratio {
            Some(n) => {
                let (milli, exact) = milli_truncated(n);
                if milli == 0 {
                    self.error(
                        o.path("tokenRatio"),
                        "must be at least 0.001 (3 decimals are kept)",
                    );
                    None
                } else {
                    if !exact {
                        self.warn(
                            o.path("tokenRatio"),
                            format!(
                                "{n} is truncated to {} (3 decimals are kept)",
                                show_milli(milli)
                            ),
                        );
                    }
                    Some(milli)
                }
            }
            None => None,
        };
        Some(RetryThrottling {
            max_milli_tokens: u32::try_from(max_tokens? * 1000).ok()?,
            token_ratio_milli: token_ratio_milli?,
        })
    }

    // ---- idempotency (per method) -------------------------------------------------------

    fn idempotency(&mut self, v: &Value, path: String) -> Option<IdempotencyPolicy> {
        let o = self.object(v, path, IDEMPOTENCY_FIELDS)?;
        let mut p = IdempotencyPolicy::default();
        // Absent fields keep their defaults; a bad one records an error and keeps it too.
        macro_rules! set {
            ($field:expr, $value:expr) => {
                if let Some(x) = $value {
                    $field = x;
                }
            };
        }
        let errors_before = self.errors.len();
        set!(p.key_required, self.boolean(&o, "keyRequired"));
        let record_ttl = self.duration_field(&o, "recordTtl", Zero::Refused);
        set!(p.record_ttl, record_ttl);
        let lease_ttl = self.duration_field(&o, "leaseTtl", Zero::Refused);
        set!(p.lease_ttl, lease_ttl);
        set!(
            p.abort_retry_delay,
            self.duration_field(&o, "abortRetryDelay", Zero::Allowed)
        );
        match o.get("inFlight") {
            None => {}
            Some(Value::String(s)) if s == "WAIT" => p.in_flight = InFlightPolicy::Wait,
            Some(Value::String(s)) if s == "ABORT" => p.in_flight = InFlightPolicy::Abort,
            Some(_) => self.error(o.path("inFlight"), "must be \"WAIT\" or \"ABORT\""),
        }
        set!(p.max_request_bytes, self.size_field(&o, "maxRequestBytes"));
        set!(
            p.max_response_bytes,
            self.size_field(&o, "maxResponseBytes")
        );
        set!(
            p.max_request_frames,
            self.size_field(&o, "maxRequestFrames")
        );
        set!(
            p.accept_compressed,
            self.compressions(&o, "acceptCompressed")
        );
        set!(p.fail_open, self.boolean(&o, "failOpen"));
        let completion_retry_timeout =
            self.duration_field(&o, "completionRetryTimeout", Zero::Allowed);
        set!(p.completion_retry_timeout, completion_retry_timeout);
        set!(
            p.response_stall_timeout,
            self.duration_field(&o, "responseStallTimeout", Zero::Refused)
        );
        // Compare only values that were read (or defaulted): a field with an error of
        // its own says nothing about the others.
        let read = |key: &str, v: Option<Duration>| o.get(key).is_none() || v.is_some();
        if read("recordTtl", record_ttl)
            && read("leaseTtl", lease_ttl)
            && read("completionRetryTimeout", completion_retry_timeout)
        {
            self.idempotency_timings(&o, &p);
        }

        self.code_lists(&o, &mut p);
        if p.release_status_codes.contains(Code::Ok) {
            self.warn(
                o.path.clone(),
                "OK releases the record: a retry after a success runs the handler again",
            );
        }
        (self.errors.len() == errors_before).then_some(p)
    }

    /// `cacheableStatusCodes` / `releaseStatusCodes`: given one, the other is its
    /// complement; given both, they must not overlap, and a code in neither is cached.
    fn code_lists(&mut self, o: &Obj<'_>, p: &mut IdempotencyPolicy) {
        let cacheable = self.codes_field(o, "cacheableStatusCodes", false);
        let release = self.codes_field(o, "releaseStatusCodes", false);
        let set_of = |v: &Vec<(Code, String)>| v.iter().map(|(c, _)| *c).collect::<CodeSet>();
        match (
            o.get("cacheableStatusCodes").is_some(),
            o.get("releaseStatusCodes").is_some(),
        ) {
            (false, false) => {}
            (true, false) => {
                if let Some(c) = &cacheable {
                    p.cacheable_status_codes = set_of(c);
                    p.release_status_codes = set_of(c).complement();
                }
            }
            (false, true) => {
                if let Some(r) = &release {
                    p.release_status_codes = set_of(r);
                    p.cacheable_status_codes = set_of(r).complement();
                }
            }
            (true, true) => {
                if let (Some(c), Some(r)) = (&cacheable, &release) {
                    let cached = set_of(c);
                    for (code, path) in r {
                        if cached.contains(*code) {
                            self.error(
                                path.clone(),
                                format!("{} is also in cacheableStatusCodes", code_name(*code)),
                            );
                        }
                    }
                    let neither = cached.union(set_of(r)).complement();
                    if !neither.is_empty() {
                        self.warn(
                            o.path("releaseStatusCodes"),
                            format!("{neither} in neither list, so cached"),
                        );
                    }
                    p.release_status_codes = set_of(r);
                    p.cacheable_status_codes = set_of(r).complement();
                }
            }
        }
    }

    /// The durations of one policy against each other: a lease that can be renewed, a
    /// record that outlives its lease, a completion retried for at least a lease.
    fn idempotency_timings(&mut self, o: &Obj<'_>, p: &IdempotencyPolicy) {
        // The field the user wrote, when only one of the two was written.
        let given = |a: &'static str, b: &'static str| if o.get(a).is_some() { a } else { b };
        if p.lease_ttl < MIN_TIMER {
            self.error(
                o.path("leaseTtl"),
                "must be at least 0.001s: a shorter lease ends before it can be renewed",
            );
            return;
        }
        let (lease, record) = (format_duration(p.lease_ttl), format_duration(p.record_ttl));
        if p.record_ttl < p.lease_ttl {
            let key = given("recordTtl", "leaseTtl");
            self.error(
                o.path(key),
                format!(
                    "recordTtl ({record}) must be at least leaseTtl ({lease}): a record must \
                     not expire while its handler still holds the lease"
                ),
            );
        }
        if p.completion_retry_timeout < p.lease_ttl {
            let key = given("completionRetryTimeout", "leaseTtl");
            self.warn(
                o.path(key),
                format!(
                    "completionRetryTimeout ({}) is shorter than leaseTtl ({lease}): the \
                     lease keeps the record in flight while the outcome is retried and until \
                     it ends, so giving up sooner frees nothing and rides out shorter store \
                     outages",
                    format_duration(p.completion_retry_timeout)
                ),
            );
        }
    }

    /// `acceptCompressed`: an array of the `grpc-encoding` names idem decodes.
    fn compressions(&mut self, o: &Obj<'_>, key: &str) -> Option<CompressionSet> {
        let path = o.path(key);
        let v = o.get(key)?;
        let Value::Array(items) = v else {
            self.error(
                path,
                format!("must be an array of encoding names, not {}", kind(v)),
            );
            return None;
        };
        let mut set = CompressionSet::EMPTY;
        let mut ok = true;
        for (i, v) in items.iter().enumerate() {
            if let Value::String(s) = v
                && let Some(c) = Compression::from_name(s.as_bytes())
            {
                set = set.with(c);
            } else {
                ok = false;
                self.error(
                    format!("{path}[{i}]"),
                    "must be \"gzip\" or \"deflate\" (the request encodings idem can decode)",
                );
            }
        }
        ok.then_some(set)
    }

    // ---- idem (process-wide) ------------------------------------------------------------

    fn idem_settings(&mut self, v: &Value, path: String) -> Option<IdemSettings> {
        let o = self.object(v, path, IDEM_FIELDS)?;
        let errors_before = self.errors.len();
        let mut s = IdemSettings::default();
        if let Some(v) = o.get("keyHeader")
            && let Some(x) = self.header_name(v, o.path("keyHeader"))
        {
            s.key_header = x;
        }
        if let Some(v) = o.get("tenant")
            && let Some(x) = self.tenant(v, o.path("tenant"), &s.key_header)
        {
            s.tenant = x;
        }
        if let Some(x) = self.size_field(&o, "maxHandlersInFlight") {
            s.max_handlers_in_flight = x;
        }
        if let Some(v) = o.get("memoryStore")
            && let Some(x) = self.memory_store(v, o.path("memoryStore"))
        {
            s.memory_store = x;
        }
        if let Some(v) = o.get("redis") {
            s.redis = self.redis(v, o.path("redis"));
        }
        if let Some(v) = o.get("client")
            && let Some(x) = self.client(v, o.path("client"))
        {
            s.client = x;
        }
        (self.errors.len() == errors_before).then_some(s)
    }

    /// A header name idem may read: lower-case, valid, not reserved by HTTP/2 or gRPC.
    fn header_name(&mut self, v: &Value, path: String) -> Option<http::HeaderName> {
        let Value::String(s) = v else {
            self.error(
                path,
                format!("must be a header name string, not {}", kind(v)),
            );
            return None;
        };
        let Ok(name) = http::HeaderName::from_bytes(s.as_bytes()) else {
            self.error(
                path,
                "must be a valid header name (letters, digits, '-', '_', '.')",
            );
            return None;
        };
        if name.as_str() != s {
            self.error(
                path,
                format!("must be lower case: write \"{}\"", name.as_str()),
            );
            return None;
        }
        const RESERVED: &[&str] = &[
            "content-type",
            "te",
            "host",
            "connection",
            "keep-alive",
            "proxy-connection",
            "transfer-encoding",
            "upgrade",
            "user-agent",
            "content-length",
        ];
        if s.starts_with("grpc-") {
            self.error(path, "must not start with \"grpc-\" (reserved by gRPC)");
            None
        } else if s.ends_with("-bin") {
            self.error(path, "must not end in \"-bin\" (binary metadata)");
            None
        } else if RESERVED.contains(&s.as_str()) {
            self.error(path, "is reserved by HTTP/2 or gRPC");
            None
        } else {
            Some(name)
        }
    }

    fn tenant(
        &mut self,
        v: &Value,
        path: String,
        key_header: &http::HeaderName,
    ) -> Option<TenantSource> {
        let o = self.object(v, path, TENANT_FIELDS)?;
        match (o.get("single"), o.get("header")) {
            (Some(single), None) => match single {
                Value::String(s) if !s.is_empty() => Some(TenantSource::Single(s.clone())),
                other => {
                    self.error(
                        o.path("single"),
                        format!("must be a non-empty string, not {}", kind(other)),
                    );
                    None
                }
            },
            (None, Some(header)) => {
                let h = self.header_name(header, o.path("header"))?;
                if h == *key_header {
                    self.error(o.path("header"), "must differ from keyHeader");
                    return None;
                }
                self.warn(
                    o.path("header"),
                    "trusts a client-sent header: only safe behind a proxy that sets or strips it",
                );
                Some(TenantSource::Header(h))
            }
            _ => {
                self.error(
                    o.path.clone(),
                    "must have exactly one of \"single\" or \"header\"",
                );
                None
            }
        }
    }

    fn memory_store(&mut self, v: &Value, path: String) -> Option<MemoryStoreSettings> {
        let o = self.object(v, path, MEMORY_FIELDS)?;
        let mut m = MemoryStoreSettings::default();
        let errors_before = self.errors.len();
        if let Some(x) = self.size_field(&o, "maxEntries") {
            if u64::try_from(x).is_ok_and(|x| x > MAX_MEMORY_ENTRIES) {
                self.error(
                    o.path("maxEntries"),
                    format!(
                        "must be at most {MAX_MEMORY_ENTRIES}: a bound no process can reach \
                         bounds nothing"
                    ),
                );
            }
            m.max_entries = x;
        }
        if let Some(x) = self.size_field(&o, "maxBytes") {
            let max = max_memory_bytes();
            if x > max {
                self.error(
                    o.path("maxBytes"),
                    format!(
                        "must be at most {max} (the address space of this machine's \
                         processes): a bound no process can reach bounds nothing"
                    ),
                );
            }
            m.max_bytes = x;
        }
        m.max_in_flight_per_tenant = self.size_field(&o, "maxInFlightPerTenant");
        m.max_entries_per_tenant = self.size_field(&o, "maxEntriesPerTenant");
        m.max_bytes_per_tenant = self.size_field(&o, "maxBytesPerTenant");
        if let Some(d) = self.duration_field(&o, "sweepInterval", Zero::Refused) {
            if d < MIN_TIMER {
                self.error(
                    o.path("sweepInterval"),
                    "must be at least 0.001s: tokio's timers tick in milliseconds",
                );
            }
            m.sweep_interval = d;
        }
        // Zero: any completed record may be evicted at a bound.
        if let Some(d) = self.duration_field(&o, "minRetention", Zero::Allowed) {
            m.min_retention = d;
        }
        if o.get("tombstoneTtl").is_some() {
            self.warn(
                o.path("tombstoneTtl"),
                "no longer used: a released record is removed, and an in-flight record \
                 whose lease ended is dropped one lease later",
            );
        }
        for (key, value, store) in [
            (
                "maxEntriesPerTenant",
                m.max_entries_per_tenant,
                m.max_entries,
            ),
            (
                "maxInFlightPerTenant",
                m.max_in_flight_per_tenant,
                m.max_entries,
            ),
            ("maxBytesPerTenant", m.max_bytes_per_tenant, m.max_bytes),
        ] {
            if value.is_some_and(|v| v > store) {
                self.warn(
                    o.path(key),
                    format!(
                        "is above the store-wide bound ({store}); the store-wide bound applies"
                    ),
                );
            }
        }
        (self.errors.len() == errors_before).then_some(m)
    }

    fn redis(&mut self, v: &Value, path: String) -> Option<RedisSettings> {
        let o = self.object(v, path, REDIS_FIELDS)?;
        let errors_before = self.errors.len();
        let (url, cluster_nodes) = self.redis_endpoint(&o);
        let key_prefix = self
            .string_field(&o, "keyPrefix")
            .unwrap_or("idem:")
            .to_owned();
        let command_timeout = self
            .duration_field(&o, "commandTimeout", Zero::Refused)
            .unwrap_or(Duration::from_millis(500));
        let connect_timeout = self
            .duration_field(&o, "connectTimeout", Zero::Refused)
            .unwrap_or(Duration::from_secs(2));
        let max = u64::try_from(usize::MAX).unwrap_or(u64::MAX);
        let max_in_flight_per_tenant = match self.integer_field(
            &o,
            "maxInFlightPerTenant",
            0,
            max,
            "must be an integer >= 0 (0: no per-tenant bound)",
        ) {
            None => Some(REDIS_MAX_IN_FLIGHT_PER_TENANT),
            Some(0) => None,
            Some(n) => usize::try_from(n).ok(),
        };
        let replica_acks = self
            .integer_field(
                &o,
                "replicaAcks",
                0,
                1000,
                "must be an integer in 0..=1000 (0: no confirmation)",
            )
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(0);
        let replica_ack_timeout = self
            .duration_field(&o, "replicaAckTimeout", Zero::Refused)
            .unwrap_or(Duration::from_millis(100));
        if replica_acks > 0 && replica_ack_timeout >= command_timeout {
            self.error(
                o.path("replicaAckTimeout"),
                "must be shorter than commandTimeout (WAIT runs within a command)",
            );
        }
        if self.errors.len() > errors_before {
            return None;
        }
        Some(RedisSettings {
            url: url?,
            cluster_nodes: cluster_nodes.unwrap_or_default(),
            key_prefix,
            command_timeout,
            connect_timeout,
            max_in_flight_per_tenant,
            replica_acks,
            replica_ack_timeout,
        })
    }

    /// `url` (one endpoint) or `clusterNodes` (a cluster's seeds), exactly one of them;
    /// with `clusterNodes` the URL is empty.
    fn redis_endpoint(&mut self, o: &Obj<'_>) -> (Option<String>, Option<Vec<String>>) {
        const URL_RULE: &str = "must be a redis://, rediss://, redis+unix:// or unix:// URL";
        const NODE_RULE: &str = "must be a redis:// or rediss:// URL";
        let is_url = |s: &str, schemes: &[&str]| {
            schemes
                .iter()
                .any(|scheme| s.len() > scheme.len() && s.starts_with(scheme))
        };
        let cluster_nodes = match o.get("clusterNodes") {
            None => None,
            Some(Value::Array(items)) if !items.is_empty() => {
                let mut nodes = Vec::with_capacity(items.len());
                for (k, item) in items.iter().enumerate() {
                    match item {
                        Value::String(s) if is_url(s, &["redis://", "rediss://"]) => {
                            nodes.push(s.clone());
                        }
                        _ => self.error(format!("{}[{k}]", o.path("clusterNodes")), NODE_RULE),
                    }
                }
                Some(nodes)
            }
            Some(_) => {
                self.error(
                    o.path("clusterNodes"),
                    "must be a non-empty array of redis:// URLs (Redis Cluster seed nodes)",
                );
                None
            }
        };
        let url = match (o.get("url"), o.get("clusterNodes")) {
            (Some(_), Some(_)) => {
                self.error(
                    o.path("url"),
                    "must not be given with clusterNodes (one endpoint, or a cluster)",
                );
                None
            }
            (None, Some(_)) => Some(String::new()),
            (Some(Value::String(s)), None)
                if is_url(s, &["redis://", "rediss://", "redis+unix://", "unix://"]) =>
            {
                Some(s.clone())
            }
            (Some(_), None) => {
                self.error(o.path("url"), URL_RULE);
                None
            }
            (None, None) => {
                self.error(
                    o.path("url"),
                    format!("is required (or clusterNodes) and {URL_RULE}"),
                );
                None
            }
        };
        (url, cluster_nodes)
    }

    fn client(&mut self, v: &Value, path: String) -> Option<ClientSettings> {
        let o = self.object(v, path, CLIENT_FIELDS)?;
        let errors_before = self.errors.len();
        let mut c = ClientSettings::default();
        if let Some(b) = self.boolean(&o, "keyAllMethods") {
            c.key_all_methods = b;
        }
        if let Some(x) = self.size_field(&o, "maxReplayBytesPerCall") {
            c.max_replay_bytes_per_call = x;
        }
        if let Some(x) = self.size_field(&o, "maxReplayBytesTotal") {
            c.max_replay_bytes_total = x;
        }
        if let Some(d) = self.duration_field(&o, "minAttemptTime", Zero::Allowed) {
            c.min_attempt_time = d;
        }
        if let Some(b) = self.boolean(&o, "retryExhaustedPushback") {
            c.retry_exhausted_pushback = b;
        }
        if let Some(b) = self.boolean(&o, "noRetryUnderRetriedInbound") {
            c.no_retry_under_retried_inbound = b;
        }
        if c.max_replay_bytes_total < c.max_replay_bytes_per_call {
            self.warn(
                o.path("maxReplayBytesTotal"),
                "is less than maxReplayBytesPerCall: calls between the two are never retried",
            );
        }
        (self.errors.len() == errors_before).then_some(c)
    }
}

/// `tokenRatio × 1000`, truncated toward zero on the number's decimal text (as C-core
/// does), and whether nothing was cut off. Saturates at 1000 tokens.
fn milli_truncated(n: &Number) -> (u32, bool) {
    if let Some(whole) = n.as_u64() {
        let milli = whole
            .saturating_mul(1000)
            .min(u64::from(MAX_TOKEN_RATIO_MILLI));
        return (milli as u32, true);
    }
    let Some(f) = n.as_f64() else {
        return (0, false);
    };
    // Rust prints the shortest decimal that reads back as the same f64, without an
    // exponent: 0.251 → "0.251", 1e-7 → "0.0000001". That is the text the user wrote,
    // up to 17 significant digits.
    let text = format!("{f}");
    let (whole, fraction) = text.split_once('.').unwrap_or((text.as_str(), ""));
    let whole: u64 = whole.parse().unwrap_or(u64::MAX);
    let mut milli = whole.saturating_mul(1000);
    let mut digits = fraction.bytes();
    for scale in [100, 10, 1] {
        let d = digits
            .next()
            .map_or(0, |b| u64::from(b.wrapping_sub(b'0')).min(9));
        milli = milli.saturating_add(d * scale);
    }
    let exact = fraction.len() <= 3;
    (milli.min(u64::from(MAX_TOKEN_RATIO_MILLI)) as u32, exact)
}

/// `250` → `0.25`, `1000` → `1`.
pub(crate) fn show_milli(milli: u32) -> String {
    let whole = milli / 1000;
    let frac = milli % 1000;
    if frac == 0 {
        whole.to_string()
    } else {
        format!("{whole}.{}", format!("{frac:03}").trim_end_matches('0'))
    }
}
