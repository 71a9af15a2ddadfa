//! The demo's `--metrics-out`: the harness writes the Prometheus exposition of both
//! layers of the run with idem; parsed here and checked against the run's own counts.

use std::collections::HashMap;

use idem::core::config::ServiceConfig;
use idem::store::memory::MemoryStore;
use idem_demo::{DEFAULT_CONFIG, DemoStore, Options, run};

/// `name{labels} value` lines of a Prometheus text exposition, by name and labels.
fn parse(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').expect("a sample line");
            (series.to_owned(), value.parse().expect("a number"))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_out_has_both_sides_of_the_run_with_idem() {
    let dir = std::env::temp_dir().join(format!("idem-demo-metrics-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("metrics.prom");
    let o = Options {
        intents: 300,
        concurrency: 16,
        progress: false,
        metrics_out: Some(path.clone()),
        ..Options::default()
    };
    let config = ServiceConfig::from_json(DEFAULT_CONFIG).unwrap();
    let store = DemoStore::Memory(MemoryStore::new(config.settings().memory_store.clone()));
    let report = run(&o, true, &config, &store).await.expect("run");
    assert_eq!((report.duplicates, report.lost), (0, 0));
    let text = std::fs::read_to_string(&path).expect("the file was written");
    let m = parse(&text);
    let method = r#"grpc_method="shop.v1.Orders/CreateOrder""#;
    let get = |series: &str| {
        *m.get(series)
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
    };
    // Every attempt that reached the server went through the client layer.
    let attempts = get(&format!(
        r#"grpc_client_attempt_started_total{{{method},grpc_target="demo"}}"#
    ));
    assert_eq!(attempts as u64, report.attempts);
    let calls = get(&format!(
        r#"grpc_client_call_duration_seconds_count{{{method},grpc_status="OK",grpc_target="demo"}}"#
    ));
    assert_eq!(calls as u64, report.intents as u64 - report.failed);
    // The server layer counts the calls that passed the fault injector in front of it.
    let replayed = get(&format!(
        r#"idem_server_call_outcome_total{{{method},idem_outcome="replayed"}}"#
    ));
    let waited = m
        .get(&format!(
            r#"idem_server_call_outcome_total{{{method},idem_outcome="waited"}}"#
        ))
        .copied()
        .unwrap_or(0.0);
    assert_eq!((replayed + waited) as u64, report.replays, "\n{text}");
    let executed = get(&format!(
        r#"idem_server_call_outcome_total{{{method},idem_outcome="executed"}}"#
    ));
    assert_eq!(executed as u64, report.orders);
    assert!(text.contains("# TYPE grpc_client_call_duration_seconds histogram"));
    assert!(text.contains("# TYPE idem_store_operation_duration_seconds histogram"));
    std::fs::remove_dir_all(&dir).ok();
}
