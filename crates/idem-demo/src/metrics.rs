//! The demo's `--metrics-out FILE`: both layers of the run with idem recorded through
//! OpenTelemetry (idem-otel), and the final Prometheus exposition written to a file. In a
//! `--crash-every` run the server side lives in the instance processes: each serves its
//! exposition, scraped before its SIGKILL and at the end, and the scrapes are summed.

use std::path::Path;

use idem_client::retry::RetryLayerBuilder;
use idem_core::config::ServiceConfig;
use idem_otel::prometheus::Prometheus;
use idem_otel::{ClientMetrics, ServerMetrics};
use idem_server::idempotency::IdempotencyLayer;
use idem_store::{Store, instrumented::InstrumentedStore};

/// The metrics of one demo run: client and server on one provider.
#[derive(Clone, Debug)]
pub struct DemoMetrics {
    client: ClientMetrics,
    instance: InstanceMetrics,
}

impl DemoMetrics {
    /// Instruments for the demo's config (the client's target is `demo`).
    pub fn new(config: &ServiceConfig) -> Self {
        let prometheus = Prometheus::new();
        let client = ClientMetrics::new(&prometheus.meter(METER), "demo", config);
        DemoMetrics {
            client,
            instance: InstanceMetrics::on(prometheus, config),
        }
    }

    /// The client layer's builder, observed.
    pub fn client(&self, builder: RetryLayerBuilder) -> RetryLayerBuilder {
        builder.observer(self.client.clone())
    }

    /// Watches the built client layer (throttle tokens).
    pub fn watch_client(&self, layer: &idem_client::retry::RetryLayer) {
        self.client.watch(layer);
    }

    /// The server side, on the same provider (in-process runs).
    pub fn server_side(&self) -> &InstanceMetrics {
        &self.instance
    }

    /// The exposition now.
    pub fn render(&self) -> String {
        self.instance.prometheus.render()
    }

    /// Writes the exposition to `path`.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.render())
    }
}

/// The meter both sides record on.
const METER: &str = "idem-demo";

/// The server side of one instance process of a `--crash-every` run: its layer's metrics,
/// served as a Prometheus exposition on 127.0.0.1 for the demo to scrape before each
/// SIGKILL and at the end.
#[derive(Clone, Debug)]
pub struct InstanceMetrics {
    prometheus: Prometheus,
    server: ServerMetrics,
}

impl InstanceMetrics {
    /// Instruments for `config`'s server side.
    pub fn new(config: &ServiceConfig) -> Self {
        Self::on(Prometheus::new(), config)
    }

    /// Instruments for `config`'s server side on `prometheus`'s provider.
    fn on(prometheus: Prometheus, config: &ServiceConfig) -> Self {
        InstanceMetrics {
            server: ServerMetrics::new(&prometheus.meter(METER), config),
            prometheus,
        }
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

    /// Serves `GET /metrics` on 127.0.0.1:`port` until the process ends.
    pub async fn serve(&self, port: u16) -> std::io::Result<()> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        tokio::spawn(idem_otel::prometheus::serve(
            listener,
            self.prometheus.clone(),
        ));
        Ok(())
    }
}

/// The exposition an instance serves on 127.0.0.1:`port` (HTTP/1.0 GET /metrics).
pub async fn scrape(port: u16) -> std::io::Result<String> {
    // An instance that hangs must not hang the demo: its scrape is lost instead.
    tokio::time::timeout(std::time::Duration::from_secs(2), scrape_now(port))
        .await
        .map_err(|_| std::io::Error::other(format!("scrape of 127.0.0.1:{port} timed out")))?
}

async fn scrape_now(port: u16) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw);
    match text.split_once("\r\n\r\n") {
        Some((head, body))
            if head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200") =>
        {
            Ok(body.to_owned())
        }
        _ => Err(std::io::Error::other(format!(
            "scrape of 127.0.0.1:{port}: unexpected answer {:?}",
            text.lines().next().unwrap_or("")
        ))),
    }
}

/// One exposition from several of the same program's: the samples of counters and
/// histograms added up (each scrape is one process's whole life, so the sum is the
/// fleet's), gauges from `last` only (what the live processes hold at the end), and
/// each family's `# HELP`/`# TYPE` once, in first-seen order.
pub fn merge(dead: &[String], last: &[String]) -> String {
    use std::collections::HashMap;
    struct Family {
        head: Vec<String>,
        gauge: bool,
        samples: Vec<String>,
        values: HashMap<String, f64>,
    }
    let mut order: Vec<String> = Vec::new();
    let mut families: HashMap<String, Family> = HashMap::new();
    let scrapes = dead
        .iter()
        .map(|t| (t, false))
        .chain(last.iter().map(|t| (t, true)));
    for (text, is_last) in scrapes {
        let mut current = String::new();
        for line in text.lines() {
            if let Some(rest) = line
                .strip_prefix("# HELP ")
                .or_else(|| line.strip_prefix("# TYPE "))
            {
                let name = rest.split(' ').next().unwrap_or("").to_owned();
                let family = families.entry(name.clone()).or_insert_with(|| {
                    order.push(name.clone());
                    Family {
                        head: Vec::new(),
                        gauge: false,
                        samples: Vec::new(),
                        values: HashMap::new(),
                    }
                });
                if !family.head.iter().any(|h| h == line) {
                    family.head.push(line.to_owned());
                }
                if line.starts_with("# TYPE ") && line.ends_with(" gauge") {
                    family.gauge = true;
                }
                current = name;
                continue;
            }
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let (Ok(value), Some(family)) = (value.parse::<f64>(), families.get_mut(&current))
            else {
                continue;
            };
            if family.gauge && !is_last {
                continue;
            }
            let sum = family.values.entry(series.to_owned()).or_insert_with(|| {
                family.samples.push(series.to_owned());
                0.0
            });
            *sum += value;
        }
    }
    let mut out = String::new();
    for name in order {
        let f = &families[&name];
        for h in &f.head {
            out.push_str(h);
            out.push('\n');
        }
        for s in &f.samples {
            out.push_str(&format!("{s} {}\n", f.values[s]));
        }
    }
    out
}

impl DemoMetrics {
    /// Writes this process's exposition (the client side) followed by `servers`, the
    /// instances' merged exposition, with a comment saying where each part comes from.
    pub fn write_with_servers(
        &self,
        path: &Path,
        servers: &str,
        scrapes: usize,
    ) -> std::io::Result<()> {
        let text = format!(
            "# idem demo: client side from the demo process; server side summed over {scrapes} \
             instance-process lifetimes, each scraped just before its SIGKILL or at the end \
             (calls that ended between a scrape and its kill are not counted)\n{}{servers}",
            self.render()
        );
        std::fs::write(path, text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_adds_counters_and_histograms_and_keeps_the_live_gauges() {
        let life = |n: u32, g: u32| {
            format!(
                "# HELP c_total c\n# TYPE c_total counter\nc_total{{a=\"x\"}} {n}\n\
                 # TYPE h_seconds histogram\nh_seconds_bucket{{le=\"1\"}} {n}\nh_seconds_count {n}\n\
                 # TYPE g gauge\ng {g}\n"
            )
        };
        let out = merge(&[life(2, 7), life(3, 8)], &[life(4, 1)]);
        assert_eq!(out.matches("# TYPE c_total counter").count(), 1, "{out}");
        assert!(out.contains("c_total{a=\"x\"} 9\n"), "{out}");
        assert!(out.contains("h_seconds_bucket{le=\"1\"} 9\n"), "{out}");
        assert!(out.contains("h_seconds_count 9\n"), "{out}");
        assert!(
            out.contains("\ng 1\n"),
            "gauges from the live instance only: {out}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_scrape_of_an_instance_that_never_answers_gives_up() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let _held = tokio::spawn(async move {
            let (socket, _) = listener.accept().await.unwrap();
            std::future::pending::<()>().await;
            drop(socket);
        });
        let err = scrape(port).await.unwrap_err();
        assert!(err.to_string().contains("timed out"), "{err}");
    }
}
