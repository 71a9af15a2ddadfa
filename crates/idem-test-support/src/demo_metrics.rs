//! The demo's `--metrics-out FILE`: both layers of the run with idem recorded through
//! OpenTelemetry (idem-otel), and the final Prometheus exposition written to a file.

use std::path::Path;

use idem_client::RetryLayerBuilder;
use idem_core::ServiceConfig;
use idem_otel::prometheus::Prometheus;
use idem_otel::{ClientMetrics, ServerMetrics};
use idem_server::IdempotencyLayer;
use idem_store::{InstrumentedStore, Store};

/// The metrics of one demo run: client and server on one provider.
#[derive(Clone, Debug)]
pub struct DemoMetrics {
    prometheus: Prometheus,
    client: ClientMetrics,
    server: ServerMetrics,
}

impl DemoMetrics {
    /// Instruments for the demo's config (the client's target is `demo`).
    pub fn new(config: &ServiceConfig) -> Self {
        let prometheus = Prometheus::new();
        let meter = prometheus.meter("idem-demo");
        DemoMetrics {
            client: ClientMetrics::new(&meter, "demo", config),
            server: ServerMetrics::new(&meter, config),
            prometheus,
        }
    }

    /// The client layer's builder, observed.
    pub fn client(&self, builder: RetryLayerBuilder) -> RetryLayerBuilder {
        builder.observer(self.client.clone())
    }

    /// Watches the built client layer (throttle tokens).
    pub fn watch_client(&self, layer: &idem_client::RetryLayer) {
        self.client.watch(layer);
    }

    /// A server layer on `store` (timed, labelled `kind`), observed and watched.
    pub fn server<St: Store>(
        &self,
        store: St,
        kind: &'static str,
        config: &ServiceConfig,
    ) -> IdempotencyLayer<InstrumentedStore<St>> {
        let layer = IdempotencyLayer::new(self.server.instrument_store(store, kind), config)
            .observer(self.server.clone());
        self.server.watch(&layer);
        layer
    }

    /// The exposition now.
    pub fn render(&self) -> String {
        self.prometheus.render()
    }

    /// Writes the exposition to `path`.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.render())
    }
}
