use std::pin::Pin;
use std::task::{Context, Poll};

use http::{HeaderMap, HeaderName, HeaderValue};
use http_body::{Body, Frame, SizeHint};
use idem_core::deadline::{ExhaustedMarker, InboundScope};
use idem_core::headers::{DOWNSTREAM_EXHAUSTED, RETRY_ATTEMPTS, RETRY_OUTCOME, RETRY_PUSHBACK_MS};
use pin_project_lite::pin_project;

/// Headers a client layer in this process sets for its own caller (outcome reports),
/// which ride along in a `Status` a handler passes up: never sent upstream.
const LOCAL_ONLY: [HeaderName; 2] = [RETRY_OUTCOME, RETRY_ATTEMPTS];

/// Removes the exhausted-downstream tag from `headers`; when it carried this call's
/// `marker` and the feature is on, puts `grpc-retry-pushback-ms: -1` in its place.
/// Also removes the client layer's local outcome headers.
pub(super) fn rewrite_marker(
    headers: &mut HeaderMap,
    marker: Option<ExhaustedMarker>,
    enabled: bool,
) {
    for name in LOCAL_ONLY {
        headers.remove(name);
    }
    if !headers.contains_key(DOWNSTREAM_EXHAUSTED) {
        return;
    }
    let ours = marker.is_some_and(|m| {
        headers
            .get_all(DOWNSTREAM_EXHAUSTED)
            .iter()
            .any(|v| m.matches(v))
    });
    headers.remove(DOWNSTREAM_EXHAUSTED);
    if ours && enabled {
        headers.insert(RETRY_PUSHBACK_MS, HeaderValue::from_static("-1"));
    }
}

pin_project! {
    /// Response body of [`Inbound`](super::Inbound): the inner body, with the tag
    /// rewritten in its trailers too (a streaming handler's error ends up there).
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        #[pin]
        inner: B,
        scope: InboundScope,
        enabled: bool,
    }
}

impl<B> ResponseBody<B> {
    pub(super) fn new(inner: B, scope: InboundScope, enabled: bool) -> Self {
        ResponseBody {
            inner,
            scope,
            enabled,
        }
    }
}

impl<B: Body> Body for ResponseBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let scope = *this.scope;
        let inner = this.inner;
        // Streaming handlers run while the body is polled: keep the scope for them too.
        let mut frame = scope.sync_run(|| inner.poll_frame(cx));
        if let Poll::Ready(Some(Ok(f))) = &mut frame
            && let Some(trailers) = f.trailers_mut()
        {
            rewrite_marker(trailers, scope.marker(), *this.enabled);
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_marker_becomes_pushback() {
        let m = ExhaustedMarker::random();
        let mut h = HeaderMap::new();
        h.insert(DOWNSTREAM_EXHAUSTED, m.to_header_value());
        rewrite_marker(&mut h, Some(m), true);
        assert_eq!(h.get(RETRY_PUSHBACK_MS).unwrap(), "-1");
        assert!(!h.contains_key(DOWNSTREAM_EXHAUSTED));

        let mut h = HeaderMap::new();
        h.insert(
            DOWNSTREAM_EXHAUSTED,
            ExhaustedMarker::random().to_header_value(),
        );
        rewrite_marker(&mut h, Some(m), true);
        assert!(
            !h.contains_key(RETRY_PUSHBACK_MS),
            "a foreign tag is dropped"
        );
        assert!(!h.contains_key(DOWNSTREAM_EXHAUSTED));

        let mut h = HeaderMap::new();
        h.insert(DOWNSTREAM_EXHAUSTED, m.to_header_value());
        rewrite_marker(&mut h, Some(m), false);
        assert!(!h.contains_key(RETRY_PUSHBACK_MS), "switched off");
        assert!(!h.contains_key(DOWNSTREAM_EXHAUSTED));

        let mut h = HeaderMap::new();
        rewrite_marker(&mut h, Some(m), true);
        assert!(h.is_empty(), "no tag, no pushback");
    }
}
