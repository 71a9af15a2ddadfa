//! The gRPC service config, parsed and validated.
//!
//! One JSON document in the service-config format (gRFC A2, A6,
//! `grpc/service_config/service_config.proto`) configures both of idem's layers. The
//! standard fields mean exactly what they mean to grpc-go, grpc-java and grpcio; idem's
//! own settings are extra objects those stacks ignore:
//!
//! - `methodConfig[].idempotency` ([`IdempotencyPolicy`]): its presence marks the
//!   method as *protected*.
//! - top-level `idem` ([`IdemSettings`]): process-wide settings.
//!
//! ```
//! use idem_core::config::ServiceConfig;
//! let config = ServiceConfig::from_json(r#"{
//!   "methodConfig": [{
//!     "name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}],
//!     "timeout": "2s",
//!     "retryPolicy": {
//!       "maxAttempts": 4, "initialBackoff": "0.05s", "maxBackoff": "1s",
//!       "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]
//!     },
//!     "idempotency": {}
//!   }]
//! }"#).unwrap();
//! let method = config.lookup("shop.v1.Orders", "CreateOrder").unwrap();
//! assert_eq!(method.retry_policy().unwrap().max_attempts(), 4);
//! assert!(method.idempotency().is_some());
//! ```
//!
//! # Rules
//!
//! [`ServiceConfig::from_json`] checks gRFC A6 and `service_config.proto` to the letter:
//!
//! - The document is a JSON object. Top-level fields other than `methodConfig`,
//!   `retryThrottling` and `idem` belong to other parts of gRPC and are ignored.
//! - `methodConfig[].name[]` is `{service, method}`; `""`, `null` and absent are the
//!   same. An empty service with a non-empty method is invalid. A name appears once in
//!   the whole document. Lookup is exact `service/method`, else `service`, else the
//!   default `{}`; the most specific entry wins whole. An entry with no names is
//!   validated, then skipped (with a warning).
//! - `retryPolicy`: `maxAttempts` (integer > 1; above 5 clamped to 5 with a warning),
//!   `initialBackoff`, `maxBackoff` (durations > 0), `backoffMultiplier` (number > 0),
//!   `retryableStatusCodes` (non-empty) are all required; `perAttemptRecvTimeout` is an
//!   optional duration > 0.
//! - `hedgingPolicy`: `maxAttempts` (integer > 1, clamped to 5), optional `hedgingDelay`
//!   (default 0), optional `nonFatalStatusCodes` (may be empty). An entry with both
//!   policies is invalid (the proto's `oneof`).
//! - `retryThrottling`: `maxTokens` an integer in (0, 1000], `tokenRatio` a number > 0;
//!   both kept in milli-tokens ([`RetryThrottling`]).
//! - `timeout` a duration (0 allowed, with a warning), `waitForReady` a boolean,
//!   `maxRequestMessageBytes` / `maxResponseMessageBytes` integers in 0..=4294967295
//!   (`UInt32Value`; 0 is valid per the proto).
//! - Durations are proto3 JSON ([`parse_duration`]): `"1s"`, `"0.100s"`, at most 9
//!   fractional digits, at most 315576000000 s, no sign, no other unit.
//! - Status codes are names (any case) or integers 0..=16.
//! - Numbers are JSON numbers, never strings. A JSON `null` is the same as an absent
//!   field (proto3 JSON; C-core and grpc-go read it so too), so `null` for a required
//!   field is "is required".
//!
//! # Errors and warnings
//!
//! Every broken rule is a [`Diagnostic`] `json.path: rule`
//! (`methodConfig[0].retryPolicy.maxAttempts: must be an integer > 1`), and every one is
//! reported at once in [`ConfigError::Invalid`]. Text that is not JSON (or not an
//! object) is [`ConfigError::Json`] with the parser's line and column. Warnings (in
//! [`Parsed::warnings`]): clamps; retryable codes that mean retrying cannot help
//! (INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED, UNAUTHENTICATED, FAILED_PRECONDITION,
//! UNIMPLEMENTED, DATA_LOSS, OK); a retry policy whose backoffs alone (each at its
//! maximum, × 1.2 jitter) exceed the entry's `timeout`; a `completionRetryTimeout`
//! shorter than the `leaseTtl`; unknown fields inside objects idem reads; and forms that
//! idem reads but another gRPC stack would not (below).
//!
//! Values that cannot work are errors too: a `leaseTtl` or `memoryStore.sweepInterval`
//! below `"0.001s"` (tokio's timer resolution), a `recordTtl` shorter than the
//! `leaseTtl`, a `memoryStore.maxEntries` above 2^32 or a `memoryStore.maxBytes` above
//! the address space of a process (2^48 on 64-bit targets).
//!
//! # Where gRPC implementations disagree, and what idem does
//!
//! The same file should configure a grpc-go, grpc-java or C-core (grpcio) client and an
//! idem layer, so where they differ idem takes the strictest reading and says why.
//!
//! | point | grpc-go | grpc-java | C-core | idem |
//! |---|---|---|---|---|
//! | invalid `retryPolicy` | ignored with a log line, rest of config used | config rejected | config rejected | error |
//! | `maxAttempts` > 5 | clamped to the channel limit (5) | clamped to `maxRetryAttempts` (5) | clamped to 5, logged | clamped to 5, warning |
//! | integer written `2.0` | refused (`encoding/json` into `int`) | accepted (reads a double, checks it is integral) | refused | refused, with a hint |
//! | number written as a string `"3"` | refused | accepted (`Integer.parseInt`) | accepted (proto3 JSON allows it) | refused (as grpc-go) |
//! | `maxTokens` | float, (0, 1000] | float, > 0 | `uint32`, > 0, no upper bound | integer in (0, 1000] (A6, proto `uint32`) |
//! | `tokenRatio` 3 decimals | kept as float64 | `(int)(ratio × 1000f)` in `float`: 0.251 → 250 | decimal text truncated: 0.251 → 251, 0.2559 → 255 | C-core's: truncate the decimal text, warn when digits are cut |
//! | duplicate names | error, whole document | error, whole document | error, whole document | error, with both paths |
//! | `{"service": "", "method": "m"}` | error | error | accepted as the default entry | error |
//! | entry without names | skipped, *not* validated when `name` is absent | validated, skipped | validated, skipped | validated, skipped, warning |
//! | field-name case (`MaxAttempts`) | case-insensitive | exact | exact | exact, warning "did you mean" |
//! | repeated JSON key | last wins | last wins (`JsonParser.parse`) | document refused | error |
//! | duration `"1.s"`, `".5s"`, `"+1s"`, `"-1s"`, `" 1s"` | first four accepted by the parser | `"1.s"`, `"+1s"`, `"-1s"` accepted; `".5s"` refused | `"1.s"`, `".5s"`, `"-1s"` refused; `"+1s"`, `" 1s"` accepted | all refused |
//! | 10 fractional digits | refused | extra digits ignored | refused | refused |
//! | duration range | int64 ns (≈ 292 years) | proto range | 315576000000 s | proto range, warning above grpc-go's |
//! | status code `"unavailable"` / `14` | upper-case names and integers | upper-case names and integers | upper-case names only | both read, warning naming the stack that refuses it |
//! | `perAttemptRecvTimeout` | ignored | ≥ 0; codes may then be empty | > 0 (experimental); codes may then be empty | > 0; codes always non-empty |
//! | `hedgingPolicy.hedgingDelay` | hedging ignored | required | hedging ignored | optional, default 0 (proto) |
//! | retry and hedging both set | hedging ignored | both parsed | hedging ignored | error (proto `oneof`) |
//! | `max*MessageBytes` | int64, negatives accepted | int ≥ 0 | `uint32` | 0..=4294967295 (`UInt32Value`) |
//!
//! idem's own objects follow the same conventions; their fields and defaults are on
//! [`IdempotencyPolicy`], [`IdemSettings`],
//! [`MemoryStoreSettings`], [`RedisSettings`],
//! [`ClientSettings`], [`RetryBudgetSettings`] and [`CircuitBreakerSettings`]. In `idempotency`, when only one of `cacheableStatusCodes` /
//! `releaseStatusCodes` is given the other is its complement; when both are given they
//! must not overlap, and a code in neither is cached (with a warning), because caching
//! an outcome is the safe side: a duplicate sees it instead of running again. `inFlight`
//! is `"WAIT"` or `"ABORT"`, exactly (it is idem's own enum, so no case games).

mod document;
mod duration;
#[cfg(test)]
mod fixtures;
mod guards;
mod idem;
mod idempotency;
mod json;
mod method;
mod proto;
mod read;
mod retry;
mod stores;

pub use document::{ParseOptions, Parsed, ServiceConfig, split_path};
pub use duration::{DurationError, MAX_DURATION_SECONDS, format_duration, parse_duration};
pub use guards::{CircuitBreakerSettings, Ratio, RetryBudgetSettings};
pub use idem::{
    ClientSettings, DEFAULT_MAX_DETACHED_HANDLERS, DEFAULT_MAX_WAITERS, IdemSettings, TenantSource,
};
pub use idempotency::{Compression, CompressionSet, IdempotencyPolicy, InFlightPolicy};
pub use method::{MethodConfig, MethodName};
pub use proto::MethodPolicy;
pub use read::{ConfigError, Diagnostic};
pub use retry::{
    HedgingPolicy, InvalidRetryPolicy, MAX_ATTEMPTS_LIMIT, RetryPolicy, RetryThrottling,
};
pub use stores::{
    DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, DEFAULT_MIN_RETENTION, MemoryStoreSettings,
    RedisSettings,
};
