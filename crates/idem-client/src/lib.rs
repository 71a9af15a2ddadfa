//! The client half of idem: a tower layer for tonic channels that retries calls by gRPC
//! status code as gRFC A6 (2024) says, under the call's deadline, and sends a stable
//! `x-idempotency-key` on every attempt so an idem server runs the call once.
//!
//! Stack [`RetryLayer`] on a tonic `Channel` and use the generated client unchanged:
//!
//! ```
//! use idem_client::RetryLayer;
//! use idem_core::ServiceConfig;
//! use tower::ServiceBuilder;
//!
//! # fn is_grpc_service<T: tonic::client::GrpcService<tonic::body::Body>>(_: &T) {}
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let config = ServiceConfig::from_json(r#"{
//!   "methodConfig": [{
//!     "name": [{"service": "shop.v1.Orders"}],
//!     "timeout": "2s",
//!     "retryPolicy": {
//!       "maxAttempts": 4, "initialBackoff": "0.05s", "maxBackoff": "1s",
//!       "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]
//!     },
//!     "idempotency": {}
//!   }],
//!   "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
//! }"#)?;
//! let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:50051").connect_lazy();
//!
//! let svc = ServiceBuilder::new().layer(RetryLayer::from_config(&config)).service(channel);
//! // let mut client = OrdersClient::new(svc);   // any generated tonic client
//! # is_grpc_service(&svc);
//! # Ok(())
//! # }
//! ```
//!
//! Without a config, [`RetryLayer::builder`] gives one policy for every method, with the
//! defaults (maxAttempts 3, initialBackoff 20 ms, multiplier 2,
//! maxBackoff 1 s, ±20 % jitter, codes `[UNAVAILABLE]`); [`RetryLayerBuilder`] lists every
//! option with its default. [`RetryLayer::reload`] swaps the config at run time.
//!
//! # What it does
//! - **Which calls retry**: the method's config entry (exact `service/method`, else
//!   `service`, else the default entry) decides; a method without a `retryPolicy` is
//!   passed through once, without buffering.
//! - **Commit**: an attempt whose response has real headers (not Trailers-Only) commits the
//!   call and is passed through untouched. Only Trailers-Only responses (`grpc-status` among
//!   the headers) with a code in `retryableStatusCodes` are retried, and transport errors
//!   (connection refused: the channel fails before anything came back) as UNAVAILABLE.
//! - **Attempts**: `maxAttempts` counts the first attempt; idem-core already clamps it to 5.
//!   Retries carry `grpc-previous-rpc-attempts`.
//! - **Backoff** ([`retry::backoff`]): retry `n` waits
//!   `min(initialBackoff·multiplier^(n-1), maxBackoff) × U(0.8, 1.2)`, saturating. The RNG
//!   is injectable ([`RetryLayerBuilder::jitter`], [`RetryLayerBuilder::seed`]); time is
//!   `tokio::time`, so paused-clock tests are exact.
//! - **Replay buffer**: the request body is read once, up to `maxReplayBytesPerCall`
//!   (256 KiB), and each attempt gets refcounted `Bytes` clones. A larger body, or one that
//!   does not fit in the layer's total budget (`maxReplayBytesTotal`, 16 MiB), is sent once
//!   without retries: what was read is sent first, then the rest, nothing is lost.
//! - **Deadline**: the earliest of the request's `grpc-timeout`, the inbound call's deadline
//!   ([`idem_core::deadline::inbound_deadline`], set by the server layer) and the config
//!   `timeout`. Each attempt's `grpc-timeout` is rewritten to the time left. A retry whose
//!   wait would end at or past the deadline, or leave less than `minAttemptTime`, is not
//!   started: the call ends at once with the last attempt's status. When the deadline
//!   itself passes, whatever set it (tonic's `Request::set_timeout`, the inbound call, the
//!   config), the caller gets DEADLINE_EXCEEDED with a report: before response headers
//!   (also when tonic's channel timeout fires first) and while the response body streams
//!   (the body ends with DEADLINE_EXCEEDED trailers; tonic servers do not enforce
//!   `grpc-timeout` on streaming bodies).
//! - **Pushback**: `grpc-retry-pushback-ms` ≥ 0 replaces the backoff exactly and resets the
//!   exponent; negative, unparseable or repeated values stop the retries.
//!   `google.rpc.RetryInfo.retry_delay` in `grpc-status-details-bin` is a minimum wait.
//!   Neither makes a non-retryable code retryable; a wait past the deadline ends the call.
//!   A server-requested wait longer than [`RetryLayerBuilder::max_retry_delay`] (default
//!   30 s) ends the call at once as [`CallOutcome::PushbackStop`]: a call without a
//!   deadline cannot be parked for hours, and it never retries sooner than asked.
//! - **Throttling** ([`RetryThrottle`]): the A6 token bucket in milli-tokens, shared by all
//!   clones of a layer, shareable across channels ([`RetryLayerBuilder::throttle`]), and
//!   kept across [`RetryLayer::reload`].
//! - **Keys**: protected methods (config entry with `idempotency`), or all methods with
//!   `keyAllMethods`, get `x-idempotency-key` (or `idem.keyHeader`): the caller's value is
//!   kept ([`with_key`], [`RequestKeyExt`]: a typed request extension the layer writes
//!   under its configured header; a value under the default name is moved, never replaced
//!   by a fresh key); otherwise one random 128-bit key per call, the same on every attempt. [`IdempotencyKeyInterceptor`] does the same as a tonic
//!   interceptor, above the retry layer. Key values are marked *sensitive*, so HPACK
//!   sends them as never-indexed literals: a key never repeats across calls, and
//!   indexing each one would churn both ends' dynamic tables (measured in BENCHMARKS.md:
//!   about 2 % of a call's CPU).
//!
//! # Reading the outcome
//! Every call ends with a [`CallReport`]: the [`CallOutcome`] (why it stopped), the number
//! of attempts, the last code, and each attempt's end, duration and the wait after it; its
//! `Display` reads as a sentence.
//! - A successful tonic call: [`CallReport::from_response`] (a response extension).
//! - A failed tonic call: tonic turns a Trailers-Only error into a `Status` and keeps only
//!   its headers, so the layer also writes the local headers `x-idem-retry-outcome` and
//!   `x-idem-retry-attempts`; read them with [`CallReport::from_status`].
//! - Every failure has a report: a transport error (connection refused…) is answered as a
//!   Trailers-Only response with the status tonic would make of it
//!   ([`tonic::Status::from_error`]; what tonic leaves UNKNOWN becomes UNAVAILABLE, since
//!   no response came back) and the report headers. The hook
//!   ([`RetryLayerBuilder::on_outcome`]) and the counters ([`RetryLayer::stats`]) see every
//!   call too.
//! - Tracing: a `debug` span `idem_retry` per call (fields `method`, `attempts`,
//!   `outcome`) and a `debug` event `retrying` per retry (`attempt`, `end`, `wait_ms`).
//! - Across hops: a call that gives up ([`CallOutcome::retries_gave_up`]: exhausted,
//!   throttled, pushback stop) while serving an inbound call whose scope carries an
//!   [`ExhaustedMarker`](idem_core::deadline::ExhaustedMarker) gets that marker in the
//!   `x-idem-downstream-exhausted` header (when `idem.client.retryExhaustedPushback`, the
//!   default), so the server layer can answer upstream with `grpc-retry-pushback-ms: -1`.
//!
//! # Where idem differs from grpc-go, and why
//! - **The body is buffered before the first attempt**, up to the cap; grpc-go buffers as
//!   it sends. Simpler and enough for unary and server-streaming calls. A client- or
//!   bidi-streaming method whose request stream waits for responses would stall: give such
//!   methods no `retryPolicy` (they are then passed through unbuffered).
//! - **Transport errors count as attempts.** grpc-go retries streams that never reached the
//!   server "transparently" (not counted); the layer cannot see that from a tonic
//!   `Channel` error, so it treats every error before response headers as UNAVAILABLE,
//!   which uses an attempt and a throttle token.
//! - **Success for the throttle** is a committed response (real headers) or a Trailers-Only
//!   OK: the layer does not read trailers, so a committed call that fails in its trailers
//!   counts as a success. Non-retryable codes count neither way (as grpc-go).
//! - **The deadline is checked before sleeping**: grpc-go sleeps the backoff and fails with
//!   DEADLINE_EXCEEDED; idem returns the last attempt's status at once. The layer also cuts
//!   an attempt with no response headers at the deadline, answering a made-up Trailers-Only
//!   DEADLINE_EXCEEDED, and ends a response body still streaming at the deadline.
//! - **`minAttemptTime`** (default 0) also stops a retry that would start with too little
//!   time left; grpc-go has no such option.
//! - **`google.rpc.RetryInfo`** is honoured as a minimum wait (grpc-go ignores it); with a
//!   valid pushback too, the longer of the two is used.
//! - **`perAttemptRecvTimeout`** runs from the attempt's start to its response headers; on
//!   expiry the attempt is cancelled and retried whatever the codes say (as C-core), and
//!   the last one ends as a made-up CANCELLED.
//! - **A reload keeps the throttle bucket**, rescaling its tokens to new settings (as
//!   C-core); grpc-go starts a new bucket.
//! - **"Headers, then an error with no message"** is retried only with the opt-in
//!   [`RetryLayerBuilder::retry_headers_then_error`] (grpc-go never retries it): tonic
//!   answers unary errors Trailers-Only, but a server-streaming handler that fails before
//!   its first message sends headers first. With the opt-in the layer reads each
//!   response's first body frame before handing the response on, and reshapes such a
//!   response as Trailers-Only.
//! - **Response bodies are [`tonic::body::Body`]**: the layer works on tonic's types (a
//!   `Channel`'s body passes through without a new box; other bodies are boxed once).
//! - An unparseable `grpc-status` is UNKNOWN. A non-200 HTTP response without
//!   `grpc-status` (a proxy's 503) has not committed the call either: it is classified by
//!   gRPC's HTTP-to-status mapping (429, 502, 503, 504 → UNAVAILABLE), like grpc-go.

mod inspect;
mod key;
pub mod retry;

pub use inspect::{idem_reason, is_replayed};
pub use key::{
    FreshKey, IdempotencyKeyInterceptor, KeyStep, RequestKeyExt, with_fresh_key, with_key,
    with_step,
};
pub use retry::{
    AttemptEnd, AttemptRecord, BuildError, CallOutcome, CallReport, OutcomeHook, Retry, RetryLayer,
    RetryLayerBuilder, RetryStats, RetryStatsSnapshot, RetryThrottle,
};

/// The boxed error type of request bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
