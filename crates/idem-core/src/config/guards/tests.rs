//! Tests of `idem.client.retryBudget` and `idem.client.circuitBreaker`.

use std::time::Duration;

use serde_json::{Value, json};
use tonic::Code;

use crate::config::fixtures::*;
use crate::config::*;

fn client(fields: Value) -> Result<ClientSettings, Vec<String>> {
    settings(json!({"client": fields})).map(|(s, _)| s.client)
}

#[test]
fn the_issue_examples_read_as_written() {
    let c = client(json!({
        "retryBudget": {"ratio": 0.1, "minRetriesPerSecond": 10, "window": "10s"},
        "circuitBreaker": {"failureRatio": 0.5, "minCalls": 20, "window": "10s",
            "openFor": "5s", "halfOpenProbes": 3,
            "failureStatusCodes": ["UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"]}
    }))
    .unwrap();
    assert_eq!(c.retry_budget, Some(RetryBudgetSettings::default()));
    assert_eq!(c.circuit_breaker, Some(CircuitBreakerSettings::default()));
    let c = client(json!({"retryBudget": {}, "circuitBreaker": {}})).unwrap();
    assert_eq!(c.retry_budget, Some(RetryBudgetSettings::default()));
    assert_eq!(c.circuit_breaker, Some(CircuitBreakerSettings::default()));
    let c = client(json!({
        "retryBudget": {"ratio": 1, "minRetriesPerSecond": 0, "window": "0.5s"},
        "circuitBreaker": {"failureRatio": 0.25, "minCalls": 1, "openFor": "0.1s",
            "halfOpenProbes": 1, "failureStatusCodes": ["INTERNAL"]}
    }))
    .unwrap();
    let b = c.retry_budget.unwrap();
    assert_eq!(
        (b.ratio.get(), b.min_retries_per_second, b.window),
        (1.0, 0, Duration::from_millis(500))
    );
    let cb = c.circuit_breaker.unwrap();
    assert_eq!(cb.failure_ratio.get(), 0.25);
    assert_eq!((cb.min_calls, cb.half_open_probes), (1, 1));
    assert_eq!(cb.open_for, Duration::from_millis(100));
    assert_eq!(
        cb.failure_status_codes.iter().collect::<Vec<_>>(),
        [Code::Internal]
    );
    assert_eq!(client(json!({})).unwrap().circuit_breaker, None);
}

#[test]
fn bad_guards_name_their_path_and_rule() {
    let ratio = "must be a number in (0, 1]";
    let window = "must be a duration > 0";
    let cases = [
        (
            json!({"retryBudget": {"ratio": 0}}),
            "retryBudget.ratio",
            ratio.to_owned(),
        ),
        (
            json!({"retryBudget": {"ratio": 1.5}}),
            "retryBudget.ratio",
            ratio.to_owned(),
        ),
        (
            json!({"retryBudget": {"ratio": -0.1}}),
            "retryBudget.ratio",
            ratio.to_owned(),
        ),
        (
            json!({"retryBudget": {"ratio": "0.1"}}),
            "retryBudget.ratio",
            format!("{ratio} (a JSON number, not a string)"),
        ),
        (
            json!({"retryBudget": {"window": "0s"}}),
            "retryBudget.window",
            window.to_owned(),
        ),
        (
            json!({"retryBudget": {"window": "0.001s"}}),
            "retryBudget.window",
            "must be a duration from \"0.010s\" to \"86400s\"".to_owned(),
        ),
        (
            json!({"retryBudget": {"minRetriesPerSecond": -1}}),
            "retryBudget.minRetriesPerSecond",
            "must be an integer in 0..=1000000".to_owned(),
        ),
        (
            json!({"circuitBreaker": {"failureRatio": 2}}),
            "circuitBreaker.failureRatio",
            ratio.to_owned(),
        ),
        (
            json!({"circuitBreaker": {"window": "0s"}}),
            "circuitBreaker.window",
            window.to_owned(),
        ),
        (
            json!({"circuitBreaker": {"openFor": "0s"}}),
            "circuitBreaker.openFor",
            window.to_owned(),
        ),
        (
            json!({"circuitBreaker": {"halfOpenProbes": 0}}),
            "circuitBreaker.halfOpenProbes",
            "must be an integer in 1..=1000".to_owned(),
        ),
        (
            json!({"circuitBreaker": {"minCalls": 0}}),
            "circuitBreaker.minCalls",
            "must be an integer in 1..=1000000".to_owned(),
        ),
        (
            json!({"circuitBreaker": {"failureStatusCodes": []}}),
            "circuitBreaker.failureStatusCodes",
            "must be a non-empty array of status codes".to_owned(),
        ),
        (
            json!({"circuitBreaker": {"failureStatusCodes": ["OK"]}}),
            "circuitBreaker.failureStatusCodes[0]",
            "must not be OK: a success never opens the breaker".to_owned(),
        ),
        (
            json!({"circuitBreaker": 3}),
            "circuitBreaker",
            "must be a JSON object, not a number".to_owned(),
        ),
    ];
    for (fields, path, rule) in cases {
        assert_eq!(
            client(fields.clone()),
            Err(vec![format!("idem.client.{path}: {rule}")]),
            "{fields}"
        );
    }
}

#[test]
fn a_misspelt_guard_field_is_a_warning() {
    let (s, w) = settings(json!({"client": {"retryBudget": {"Ratio": 0.2}}})).unwrap();
    assert_eq!(s.client.retry_budget, Some(RetryBudgetSettings::default()));
    assert_eq!(
        w,
        [
            "idem.client.retryBudget.Ratio: unknown field, ignored: field names are \
             case-sensitive; did you mean \"ratio\"?"
        ]
    );
}

/// `circuitBreaker` inside a `methodConfig` entry: that entry's own breaker, read and
/// checked as the client-wide one, its errors under the entry's path.
#[test]
fn a_method_config_entry_may_have_its_own_breaker() {
    let p = ok(&with(
        "/methodConfig/0/circuitBreaker",
        Some(json!({"failureRatio": 0.25, "openFor": "1s"})),
    ));
    let cb = create_order(&p).circuit_breaker().unwrap();
    assert_eq!(
        (cb.failure_ratio.get(), cb.open_for),
        (0.25, Duration::from_secs(1))
    );
    assert_eq!(cb.min_calls, CircuitBreakerSettings::default().min_calls);
    assert_eq!(get_order(&p).circuit_breaker(), None);
    assert!(warnings(&p).is_empty(), "{:?}", warnings(&p));
    let bad = [
        (
            json!({"failureRatio": 1.5}),
            ".failureRatio: must be a number in (0, 1]",
        ),
        (
            json!({"halfOpenProbes": 0}),
            ".halfOpenProbes: must be an integer in 1..=1000",
        ),
        (json!({"openFor": "0s"}), ".openFor: must be a duration > 0"),
    ];
    for (v, rule) in bad {
        let e = errors(&with("/methodConfig/1/circuitBreaker", Some(v.clone())));
        assert_eq!(e, [format!("methodConfig[1].circuitBreaker{rule}")], "{v}");
    }
}
