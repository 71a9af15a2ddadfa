//! What a handler's run produced, as its record will hold it ([`Collected`]: encoded as
//! it arrives, within `maxResponseBytes`), and what becomes of the record by it
//! ([`plan`]: completed with the response or as not retained, or released).

use bytes::Bytes;
use http::HeaderMap;
use idem_core::config::IdempotencyPolicy;
use idem_store::StoredOutcome;
use idem_store::response::{EncodedSize, ResponseEncoder};
use tonic::Code;

use super::decision::{self, IdemDecision, Origin};
use super::stats::{Counter, IdempotencyStats};

/// What becomes of the record: released, or completed with this outcome.
pub(crate) enum Plan {
    Release,
    Complete(StoredOutcome),
}

/// Whether the record is completed (with the response encoded, or as not retained) or
/// released, by what the handler produced.
pub(crate) fn plan(
    stats: &IdempotencyStats,
    policy: &IdempotencyPolicy,
    collected: &mut Collected,
) -> Plan {
    let origin = collected.origin();
    let code = collected.code();
    let cacheable = policy.cacheable_status_codes;
    if !decision::keep(origin, code, collected.decision, cacheable) {
        if origin == Origin::BeforeHandler {
            tracing::info!("the service refused the request before its handler ran: released");
        }
        return Plan::Release;
    }
    match collected.encode() {
        Some(bytes) => Plan::Complete(StoredOutcome::Response(bytes)),
        None => {
            stats.inc(Counter::not_retained);
            let max = policy.max_response_bytes;
            tracing::warn!(
                max,
                "response over the size limit: recorded as not retained"
            );
            Plan::Complete(StoredOutcome::NotRetained)
        }
    }
}

/// The response as it will be stored, encoded as it arrives within the size limit.
pub(crate) struct Collected {
    /// The record's bytes so far; `None` once over the limit, or when nothing is to be
    /// recorded (the handler's own transaction completed the record).
    encoded: Option<ResponseEncoder>,
    /// The response's trailers, until they move to the caller's side.
    pub(crate) trailers: Option<HeaderMap>,
    /// The head's `grpc-status` (a Trailers-Only response's code).
    head_code: Option<Code>,
    /// The head is tonic's own refusal of a request it could not decode.
    decode_refusal: bool,
    frames: usize,
    size: EncodedSize,
    max: usize,
    decision: Option<IdemDecision>,
    /// The body failed mid-way: no complete response exists.
    pub(crate) broken: bool,
}

impl Collected {
    /// Starts from the response head, taking the handler's decision out of it; `encode`
    /// says whether the response is to be recorded.
    pub(crate) fn new(head: &mut http::response::Parts, max: usize, encode: bool) -> Self {
        let from_extension = head.extensions.remove::<IdemDecision>();
        let decision = decision::take_decision(&mut head.headers).or(from_extension);
        let size = EncodedSize::of_head(&head.headers);
        let head_code = decision::grpc_status(&head.headers);
        Collected {
            encoded: (encode && size.bytes() <= max)
                .then(|| ResponseEncoder::new(head.status, &head.headers)),
            trailers: None,
            head_code,
            decode_refusal: head_code == Some(Code::Internal)
                && decision::is_decode_refusal(&head.headers),
            frames: 0,
            size,
            max,
            decision,
            broken: false,
        }
    }

    pub(crate) fn data(&mut self, data: &Bytes) {
        self.frames += 1;
        self.size.add_frame(data);
        self.drop_over_limit();
        if let Some(e) = &mut self.encoded {
            e.frame(data);
        }
    }

    pub(crate) fn trailers(&mut self, mut t: HeaderMap) {
        self.decision = decision::take_decision(&mut t).or(self.decision);
        self.size.add_trailers(&t);
        self.drop_over_limit();
        self.trailers = Some(t);
    }

    /// A response over the size limit is not kept: its record says so instead.
    fn drop_over_limit(&mut self) {
        if self.size.bytes() > self.max {
            self.encoded = None;
        }
    }

    /// The record's bytes: the response as collected, with its trailers; `None` when it
    /// is over the size limit.
    fn encode(&mut self) -> Option<Bytes> {
        let encoded = self.encoded.take()?;
        Some(encoded.finish(self.trailers.as_ref()))
    }

    /// The response's code: its trailers' `grpc-status`, else the Trailers-Only
    /// head's; a response without one counts as UNKNOWN.
    fn code(&self) -> Code {
        let from_trailers = self.trailers.as_ref().and_then(decision::grpc_status);
        from_trailers.or(self.head_code).unwrap_or(Code::Unknown)
    }

    fn origin(&self) -> Origin {
        let within_limit = self.size.bytes() <= self.max;
        let trailers_only = self.frames == 0 && within_limit && self.trailers.is_none();
        if self.broken {
            Origin::Broken
        } else if trailers_only && self.decode_refusal {
            Origin::BeforeHandler
        } else {
            Origin::Handler
        }
    }
}
