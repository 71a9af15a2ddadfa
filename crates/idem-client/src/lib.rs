//! The client half of idem: a tower layer for tonic channels that retries calls by gRPC
//! status code as gRFC A6 (2024) says, under the call's deadline, and sends a stable
//! `x-idempotency-key` on every attempt so an idem server runs the call once.
//!
//! Stack [`RetryLayer`] on a tonic `Channel` and use the generated client unchanged:
//!
//! ```
//! use idem_client::retry::RetryLayer;
//! use idem_core::config::ServiceConfig;
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
//! maxBackoff 1 s, ±20 % jitter, codes `[UNAVAILABLE]`), and a key on every call (that
//! policy retries every method, and an idem server needs the key to run a retried write
//! once; [`RetryLayerBuilder::key_all_methods`]`(false)` turns it off);
//! [`RetryLayerBuilder`] lists every option with its default. [`RetryLayer::reload`]
//! swaps the config at run time.
//!
//! # What it does
//! - **Which calls retry**: the method's config entry (exact `service/method`, else
//!   `service`, else the default entry) decides; a method with a `hedgingPolicy` is
//!   hedged instead ([Hedging](#hedging)); a method with neither is passed through once,
//!   without buffering (unless it has `waitForReady`). Unary,
//!   server-streaming, client-streaming and bidi methods alike.
//! - **What is retried**: Trailers-Only responses (`grpc-status` among the headers) with a
//!   code in `retryableStatusCodes`, and transport errors (connection refused: the channel
//!   fails before anything came back) as UNAVAILABLE.
//! - **Commit** (gRFC A6): once a call is committed it is never retried; the committed
//!   attempt goes on, and its response is passed through untouched. A call commits when
//!   1. an attempt's response has real headers (not Trailers-Only), or
//!   2. keeping its request for a replay would pass `maxReplayBytesPerCall` (256 KiB), or
//!      what the other calls of the layer leave of `maxReplayBytesTotal` (16 MiB).
//!
//!   When an attempt committed by a limit then fails with a retryable status, the caller
//!   gets that status, and the report says why no retry came
//!   ([`CallOutcome::BodyTooLarge`], [`CallOutcome::ReplayBudgetExhausted`]).
//! - **Replay buffer**: each attempt streams the request as the caller produces it, and a
//!   copy is kept until the call commits. A request whose frames are all ready when the
//!   call starts (every unary and server-streaming call) is read whole first; each attempt
//!   then gets refcounted `Bytes` clones of it. Anything else (a client or bidi stream the
//!   caller is still producing) goes out message by message: the first message reaches the
//!   server before the caller has produced the second, and the caller may wait for
//!   responses before it sends more, on the first attempt and after a retry. A retry sends
//!   the copy, then goes on with the live rest. The copy is freed when the call commits or
//!   ends; dropping the response future before its headers ends the request (the attempt
//!   is reset), so the budget of a layer returns to full. Request bytes read from the
//!   caller that a committed attempt has not handed to the transport yet (its server
//!   reads slowly, or not at all) stay counted in `maxReplayBytesTotal` until it does:
//!   after a commit the layer reads the caller's stream only as fast as the attempt
//!   sends it, and at most one message past the limit (the one that committed the call)
//!   is ever held beyond it. [`RetryLayer::request_bytes_held`] reads the count.
//! - **Attempts**: `maxAttempts` counts the first attempt; idem-core already clamps it to 5.
//!   Retries carry `grpc-previous-rpc-attempts`.
//! - **Backoff** ([`retry::backoff`]): retry `n` waits
//!   `min(initialBackoff·multiplier^(n-1), maxBackoff) × U(0.8, 1.2)`, saturating. The RNG
//!   is injectable ([`RetryLayerBuilder::jitter`], [`RetryLayerBuilder::seed`]); time is
//!   `tokio::time`, so paused-clock tests are exact.
//! - **Deadline**: the earliest of the request's `grpc-timeout`, the inbound call's deadline
//!   ([`idem_core::deadline::inbound_deadline`], set by the server layer) and the config
//!   `timeout`. Each attempt's `grpc-timeout` is rewritten to the time left. A retry whose
//!   wait would end at or past the deadline, or leave less than `minAttemptTime`, is not
//!   started: the call ends at once with the last attempt's status. When the deadline
//!   itself passes, whatever set it (tonic's `Request::set_timeout`, the inbound call, the
//!   config), the caller gets DEADLINE_EXCEEDED with a report: before response headers
//!   (also when tonic's channel timeout fires first, and while a retry or hedge waits for
//!   a busy inner service to become ready) and while the response body streams
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
//!   kept across [`RetryLayer::reload`]. It logs when retries stop (`WARN`) and resume
//!   (`INFO`), once per change; each call it stops says why in its report.
//! - **Retry budget and circuit breaker** (`idem.client.retryBudget`,
//!   `idem.client.circuitBreaker`; [`retry::RetryBudget`], [`retry::CircuitBreaker`]):
//!   retries and hedges at most a ratio of the calls over a window; the breaker counts
//!   attempts, stops retries at half its failure ratio, and while the target keeps
//!   failing, calls fail at once (UNAVAILABLE, `CIRCUIT_OPEN`, a retry delay) with
//!   nothing sent; half-open probes are never retried or hedged. A method config entry
//!   may have its own breaker (`methodConfig[].circuitBreaker`). A refused call never
//!   reached a server, so retrying it with the same key is safe.
//! - **`waitForReady`**: a call whose attempt the channel could not send (it could not
//!   connect: [`tonic::ConnectError`], a refused connection) waits and sends the same
//!   attempt again (100 ms, growing ×1.6 to 2 s, ±20 %) until its deadline, then ends with
//!   DEADLINE_EXCEEDED; without a deadline, for
//!   [`RetryLayerBuilder::wait_for_ready_limit`] (30 s), then UNAVAILABLE
//!   ([`CallOutcome::NotReady`]). Those waits use no attempt of `maxAttempts` and no
//!   throttle token. Without `waitForReady`, a connection failure is an attempt that
//!   failed with UNAVAILABLE (fail fast).
//! - **`maxRequestMessageBytes` / `maxResponseMessageBytes`**: read from each message's
//!   5-byte gRPC frame header as the bytes stream (no message is held to check it). A
//!   request message over its limit fails the call on the client with RESOURCE_EXHAUSTED:
//!   before anything is sent when it is ready at the start, otherwise by resetting the
//!   stream as it comes. A response message over its limit ends the response with
//!   RESOURCE_EXHAUSTED trailers, after the messages before it
//!   ([`CallOutcome::MessageTooLarge`]).
//! - **Keys**: protected methods (config entry with `idempotency`), or all methods with
//!   `keyAllMethods`, get `x-idempotency-key` (or `idem.keyHeader`): the caller's value is
//!   kept ([`with_key`], [`RequestKeyExt`]: a typed request extension the layer writes
//!   under its configured header; a value under the default name is moved, never replaced
//!   by a fresh key); otherwise one random 128-bit key per call, the same on every attempt.
//!   Without a config, every method gets a key. [`IdempotencyKeyInterceptor`] does the
//!   same as a tonic interceptor, above the retry layer. Key values are marked *sensitive*, so HPACK
//!   sends them as never-indexed literals: a key never repeats across calls, and
//!   indexing each one would churn both ends' dynamic tables (measured in BENCHMARKS.md:
//!   about 2 % of a call's CPU).
//!
//! # Hedging
//! A method whose config entry has a `hedgingPolicy` (instead of a `retryPolicy`) is
//! *hedged*, as gRFC A6 says:
//! - the request goes out at once; while no hedge has answered, it goes out again every
//!   `hedgingDelay` (all at once for `0s`), up to `maxAttempts` hedges in all (clamped
//!   to 5); each carries `grpc-previous-rpc-attempts` (its index), `grpc-timeout` (the
//!   time left) and a copy of the buffered request;
//! - the first hedge whose response has real headers (the call commits; not
//!   Trailers-Only) or ends OK wins: the caller gets it, and the others are cancelled
//!   (their futures and bodies dropped, which resets their streams);
//! - a fatal status (not in `nonFatalStatusCodes`) ends the call with it and cancels the
//!   others ([`CallOutcome::NonRetryableCode`]); a non-fatal one sends the next hedge at
//!   once, and the one after `hedgingDelay` later;
//! - server pushback on a hedge: `grpc-retry-pushback-ms` ≥ 0 sends the next hedge that
//!   long after (`RetryInfo` is a minimum, as for retries); negative, unparseable or
//!   repeated sends no more hedges, while those already out go on
//!   ([`CallOutcome::PushbackStop`] if they fail too);
//! - throttling: each non-fatal failure (and each pushback that says stop) takes a token,
//!   the winner gives `tokenRatio` back, as retries do; the first request always goes
//!   out, every later hedge only while the bucket is above half
//!   ([`CallOutcome::Throttled`]);
//! - the call's deadline bounds every hedge: none starts past it (or with less than
//!   `minAttemptTime` left), and at the deadline the call ends with DEADLINE_EXCEEDED
//!   whatever is still running;
//! - when every hedge failed and no more may go out, the caller gets the last one's
//!   status ([`CallOutcome::AttemptsExhausted`] after `maxAttempts` hedges).
//!
//! **One key on every hedge.** The key is placed once per call, before the first hedge,
//! so every hedge of a protected method carries the same `x-idempotency-key`: on an idem
//! server the first hedge to reach the layer claims the key and runs the handler; the
//! others wait for that execution and get its response (the default in-flight policy,
//! `WAIT`), so a hedged write still takes effect once.
//!
//! **When hedging pays.** Because the duplicates wait for the one execution, hedging a
//! protected method cuts the latency that comes *before* an instance claims the key: a
//! slow *instance* (requests queueing on a busy one, a GC pause or a noisy neighbour that
//! stalls it, a slow connection). It does nothing for a slow *handler*: once an instance
//! runs it, every hedge waits for that same run. Choose `hedgingDelay` near the latency
//! most calls meet (the p95, say): a call slower than it costs one more request. With the
//! `ABORT` in-flight policy a duplicate is refused with ABORTED: list ABORTED among
//! `nonFatalStatusCodes`, or that refusal ends the call.
//!
//! The [`CallReport`] of a hedged call says how many hedges went out
//! ([`CallReport::hedges`]) and which won ([`CallReport::winner`]); its history lists
//! the hedges in the order they went out, those still running when the call ended as
//! [`AttemptEnd::Cancelled`], each with the delay before the next one.
//!
//! **Streaming requests.** A client-streaming or bidi request (or any body the caller is
//! still producing) is hedged too: every hedge sends the messages so far, then follows
//! the live stream, read once from the caller. The copy counts against the same replay
//! limits as a retried call's; when it would pass one, the call commits to the hedge
//! that has sent the most messages, the others are cancelled and no more hedges go out
//! (gRFC A6, "Memory Management"); the committed hedge goes on.
//!
//! **`waitForReady`.** A hedge the channel could not send (connection refused) uses no
//! attempt and no throttle token: it goes out again after the same waits as a retried
//! call's, in place of the next hedge, until the deadline (DEADLINE_EXCEEDED) or, without
//! one, [`RetryLayerBuilder::wait_for_ready_limit`] (UNAVAILABLE,
//! [`CallOutcome::NotReady`]). Without it, a connect failure is a failed hedge
//! (UNAVAILABLE).
//!
//! Limits:
//! - A request already over a replay limit when the call starts is sent once, as a call
//!   without a policy.
//! - Hedges go through the same inner service: A6 asks that they reach distinct backends
//!   "if possible". Under a tonic `Channel::balance_list`, tower's power-of-two-choices
//!   balancer prefers the endpoint with fewer requests in flight, which is rarely the one
//!   holding the slow hedge, but it is not excluded.
//! - grpc-go does not hedge. grpc-java, in the version read, moves the next hedge only
//!   when a failed hedge carries a pushback (and then sends it at once); idem follows
//!   A6's text: a non-fatal status sends the next hedge at once, a pushback of *n* ms
//!   *n* ms later.
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
//! - Tracing: a `debug` span `idem_retry` per call (fields `method`, OpenTelemetry's
//!   `rpc.system`, `rpc.service`, `rpc.method` and, for a call that did not commit,
//!   `rpc.grpc.status_code`; `attempts`, `retry_delay_ms`, `outcome`: the stop reason)
//!   and a `debug` event `retrying` per retry (`attempt`, `end`, `wait_ms`). Never the key.
//! - Metrics: [`RetryLayerBuilder::observer`] ([`metrics`]) for gRPC's standard client
//!   metrics; `idem-otel` records them through OpenTelemetry.
//! - Across hops: a call that gives up ([`CallOutcome::retries_gave_up`]: exhausted,
//!   throttled, pushback stop) while serving an inbound call whose scope carries an
//!   [`ExhaustedMarker`](idem_core::deadline::ExhaustedMarker) gets that marker in the
//!   `x-idem-downstream-exhausted` header (when `idem.client.retryExhaustedPushback`, the
//!   default), so the server layer can answer upstream with `grpc-retry-pushback-ms: -1`.
//!
//! # Where idem differs from grpc-go, and why
//! - **Replay limits**: 256 KiB per call, as grpc-go (grpc-java: 1 MiB), and 16 MiB per
//!   layer, as grpc-java (grpc-go has no channel-wide limit). A streaming call holds its
//!   copy only until it commits, and the per-layer total bounds the memory of all of them.
//! - **Transport errors count as attempts**, unless `waitForReady`. grpc-go retries
//!   streams that never reached the server "transparently" (not counted); from a tonic
//!   `Channel` error the layer can tell only a failed connection apart (nothing was
//!   sent), so it treats every error before response headers as UNAVAILABLE, which uses
//!   an attempt and a throttle token; with `waitForReady` a failed connection is waited
//!   out instead, uncounted.
//! - **`waitForReady` without a deadline** waits at most
//!   [`RetryLayerBuilder::wait_for_ready_limit`]; grpc-go waits for ever. The channel is
//!   not watched: the attempt is sent again after each wait, so a channel that comes up is
//!   used within 2 s.
//! - **Message limits read the framed length**: a compressed message is measured
//!   compressed. grpc-go also checks the decompressed size of a response; tonic's own
//!   `max_decoding_message_size` does that on the client.
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
//!   response as Trailers-Only. It does not for requests that stream (client or bidi
//!   streams still being produced): their caller may wait for the response headers
//!   before it sends the message the server waits for.
//! - **Response bodies are [`tonic::body::Body`]**: the layer works on tonic's types (a
//!   `Channel`'s body passes through without a new box; other bodies are boxed once).
//! - An unparseable `grpc-status` is UNKNOWN. A non-200 HTTP response without
//!   `grpc-status` (a proxy's 503) has not committed the call either: it is classified by
//!   gRPC's HTTP-to-status mapping (429, 502, 503, 504 → UNAVAILABLE), like grpc-go.

mod inspect;
mod key;
pub mod metrics;
pub mod retry;

// The crate docs above name these without their module.
#[cfg(doc)]
use retry::{AttemptEnd, CallOutcome, CallReport, RetryLayer, RetryLayerBuilder, RetryThrottle};

pub use inspect::{idem_reason, is_replayed};
pub use key::{
    FreshKey, IdempotencyKeyInterceptor, KeyStep, RequestKeyExt, with_fresh_key, with_key,
    with_step,
};

/// The boxed error type of request bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
