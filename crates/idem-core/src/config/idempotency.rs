//! idem's per-method `idempotency` object ([`IdempotencyPolicy`]): its presence marks a
//! method as protected. The validated policy, the request compressions it accepts, and
//! its reader.

use std::fmt;
use std::time::Duration;

use serde_json::Value;

use super::duration::format_duration;
use super::read::{MIN_TIMER, Obj, Validator, Zero, kind};
use crate::code::{Code, CodeSet, code_name};

/// What a duplicate does when it finds the key's first call still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InFlightPolicy {
    /// Wait for the outcome (up to the caller's deadline), then replay it. The default.
    #[default]
    Wait,
    /// Answer ABORTED at once, with a retry delay.
    Abort,
}

/// A request compression idem can decode to fingerprint a request (`grpc-encoding`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Compression {
    /// `gzip` (RFC 1952), one member per message.
    Gzip,
    /// `deflate`: a zlib stream (RFC 1950), one per message, as gRPC implementations send it.
    Deflate,
}

impl Compression {
    /// Every compression idem decodes.
    pub const ALL: [Compression; 2] = [Compression::Gzip, Compression::Deflate];

    /// The `grpc-encoding` name.
    pub const fn name(self) -> &'static str {
        match self {
            Compression::Gzip => "gzip",
            Compression::Deflate => "deflate",
        }
    }

    /// The compression a `grpc-encoding` value names, if idem decodes it.
    pub fn from_name(name: &[u8]) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name().as_bytes() == name)
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of [`Compression`]s (`acceptCompressed`); `Copy`, no allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct CompressionSet(u8);

impl CompressionSet {
    /// No compression: identity requests only.
    pub const EMPTY: CompressionSet = CompressionSet(0);

    /// This set and `c`.
    pub const fn with(self, c: Compression) -> Self {
        CompressionSet(self.0 | 1 << c as u8)
    }

    /// Whether `c` is in the set.
    pub const fn contains(self, c: Compression) -> bool {
        self.0 & (1 << c as u8) != 0
    }

    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The members, in [`Compression::ALL`] order.
    pub fn iter(self) -> impl Iterator<Item = Compression> {
        Compression::ALL
            .into_iter()
            .filter(move |c| self.contains(*c))
    }
}

impl FromIterator<Compression> for CompressionSet {
    fn from_iter<I: IntoIterator<Item = Compression>>(iter: I) -> Self {
        iter.into_iter().fold(Self::EMPTY, Self::with)
    }
}

/// idem's per-method `idempotency` object. Its presence marks the method as protected.
///
/// # Defaults
/// | field (JSON) | default |
/// |---|---|
/// | `keyRequired` | `true` |
/// | `recordTtl` | `"86400s"` (24 h) |
/// | `leaseTtl` | `"10s"` |
/// | `inFlight` | `"WAIT"` (`"ABORT"` is the other choice) |
/// | `abortRetryDelay` | `"1s"` |
/// | `cacheableStatusCodes` | OK, UNKNOWN, DEADLINE_EXCEEDED, INTERNAL, DATA_LOSS |
/// | `releaseStatusCodes` | the other twelve codes |
/// | `maxRequestBytes` | 4194304 (4 MiB, tonic's default message limit) |
/// | `maxResponseBytes` | 1048576 (1 MiB) |
/// | `maxRequestFrames` | 65536 |
/// | `acceptCompressed` | `[]` (identity only, as a tonic service without `accept_compressed`) |
/// | `failOpen` | `false` |
/// | `completionRetryTimeout` | `"60s"` |
/// | `responseStallTimeout` | `"30s"` |
///
/// # Rules between fields
/// `leaseTtl` is at least `"0.001s"` and `recordTtl` at least `leaseTtl` (errors); a
/// `completionRetryTimeout` shorter than `leaseTtl` is a warning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyPolicy {
    /// A call without a key is refused (INVALID_ARGUMENT) when true; passed through
    /// unprotected when false.
    pub key_required: bool,
    /// How long a completed record is kept.
    pub record_ttl: Duration,
    /// Lease of an in-flight record; renewed while the handler runs.
    pub lease_ttl: Duration,
    /// What an in-flight duplicate does.
    pub in_flight: InFlightPolicy,
    /// Retry delay sent with ABORTED under [`InFlightPolicy::Abort`].
    pub abort_retry_delay: Duration,
    /// Outcomes stored and replayed to duplicates.
    pub cacheable_status_codes: CodeSet,
    /// Outcomes that release the record so a retry runs again. Always the complement of
    /// `cacheable_status_codes`.
    pub release_status_codes: CodeSet,
    /// Buffering limit for a protected request's body.
    pub max_request_bytes: usize,
    /// Responses larger than this are recorded as "completed, response not retained".
    pub max_response_bytes: usize,
    /// Most gRPC messages (frames) a protected request may hold; more is refused with
    /// RESOURCE_EXHAUSTED before any of them is decoded.
    pub max_request_frames: usize,
    /// Request compressions the service accepts for this method: mirror the service's
    /// `accept_compressed` here. A request in any other `grpc-encoding` is refused with
    /// UNIMPLEMENTED before its body is read, as tonic refuses it.
    pub accept_compressed: CompressionSet,
    /// When the store cannot answer, run the handler without a record (true) or answer
    /// UNAVAILABLE (false).
    pub fail_open: bool,
    /// How long a completion or release the store refuses transiently is retried (with
    /// backoff, the lease renewed meanwhile) before the record is left to its lease.
    /// Zero: one attempt.
    pub completion_retry_timeout: Duration,
    /// How long a caller may leave a streamed response unread (no message taken while
    /// the next one waits) before the layer stops sending it: the caller's stream ends
    /// there, the handler runs on to its end and its outcome is recorded, so a caller
    /// that never reads cannot hold a handler run (and its place under
    /// `maxHandlersInFlight`) for ever. Unary responses are never held this way.
    pub response_stall_timeout: Duration,
}

impl IdempotencyPolicy {
    /// Codes cached by default: OK and the errors that may follow side effects.
    pub const DEFAULT_CACHEABLE: CodeSet = CodeSet::of(Code::Ok)
        .with(Code::Unknown)
        .with(Code::DeadlineExceeded)
        .with(Code::Internal)
        .with(Code::DataLoss);
}

impl Default for IdempotencyPolicy {
    fn default() -> Self {
        IdempotencyPolicy {
            key_required: true,
            record_ttl: Duration::from_secs(24 * 3600),
            lease_ttl: Duration::from_secs(10),
            in_flight: InFlightPolicy::Wait,
            abort_retry_delay: Duration::from_secs(1),
            cacheable_status_codes: Self::DEFAULT_CACHEABLE,
            release_status_codes: Self::DEFAULT_CACHEABLE.complement(),
            max_request_bytes: 4 * 1024 * 1024,
            max_response_bytes: 1024 * 1024,
            max_request_frames: 65_536,
            accept_compressed: CompressionSet::EMPTY,
            fail_open: false,
            completion_retry_timeout: Duration::from_secs(60),
            response_stall_timeout: Duration::from_secs(30),
        }
    }
}

pub(super) const IDEMPOTENCY_FIELDS: &[&str] = &[
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

impl Validator {
    pub(super) fn idempotency(&mut self, v: &Value, path: String) -> Option<IdempotencyPolicy> {
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
}

#[cfg(test)]
mod tests;
