use tower_layer::Layer;

use super::Inbound;

/// Applies [`Inbound`] to a service. See the [module docs](super).
#[derive(Debug, Clone, Copy)]
pub struct InboundLayer {
    pub(super) pushback_on_exhausted: bool,
}

impl InboundLayer {
    /// The layer with the pushback marker on.
    pub fn new() -> Self {
        InboundLayer {
            pushback_on_exhausted: true,
        }
    }

    /// Whether a failure from an exhausted downstream call is sent upstream with
    /// `grpc-retry-pushback-ms: -1` (default `true`). When off, the internal tag is still
    /// removed, and upstream clients retry as they please.
    pub fn pushback_on_exhausted(mut self, enabled: bool) -> Self {
        self.pushback_on_exhausted = enabled;
        self
    }
}

impl Default for InboundLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Layer<S> for InboundLayer {
    type Service = Inbound<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Inbound {
            inner,
            pushback_on_exhausted: self.pushback_on_exhausted,
        }
    }
}
