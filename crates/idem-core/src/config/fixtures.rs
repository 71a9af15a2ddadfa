//! What every section's tests share: a valid base document, edits of it at a JSON
//! pointer, and checks that a value passes or fails with exactly one `path: rule`
//! (one `passes`/`fails` pair at least per gRFC A6 / `service_config.proto` rule).

use serde_json::{Value, json};

use super::*;

/// The fields of every object idem reads, for the tests' generated documents.
pub(super) const FIELD_LISTS: &[&[&str]] = &[
    document::TOP_FIELDS,
    method::METHOD_FIELDS,
    method::NAME_FIELDS,
    retry::RETRY_FIELDS,
    retry::HEDGING_FIELDS,
    retry::THROTTLING_FIELDS,
    idempotency::IDEMPOTENCY_FIELDS,
    idem::IDEM_FIELDS,
    idem::TENANT_FIELDS,
    stores::MEMORY_FIELDS,
    stores::REDIS_FIELDS,
    idem::CLIENT_FIELDS,
    guards::BUDGET_FIELDS,
    guards::BREAKER_FIELDS,
];

pub(super) fn parse(text: &str) -> Result<Parsed, ConfigError> {
    ServiceConfig::from_json_with_warnings(text)
}

#[track_caller]
pub(super) fn ok(text: &str) -> Parsed {
    match parse(text) {
        Ok(p) => p,
        Err(e) => panic!("expected a valid config:\n{text}\ngot: {e}"),
    }
}

#[track_caller]
pub(super) fn errors(text: &str) -> Vec<String> {
    match parse(text) {
        Err(ConfigError::Invalid { errors, .. }) => {
            errors.iter().map(ToString::to_string).collect()
        }
        other => panic!("expected ConfigError::Invalid for\n{text}\ngot: {other:?}"),
    }
}

/// The base document's retried, protected CreateOrder, as parsed.
#[track_caller]
pub(super) fn create_order(p: &Parsed) -> &MethodConfig {
    p.config.lookup("shop.v1.Orders", "CreateOrder").unwrap()
}

/// The base document's hedged GetOrder, as parsed.
#[track_caller]
pub(super) fn get_order(p: &Parsed) -> &MethodConfig {
    p.config.lookup("shop.v1.Orders", "GetOrder").unwrap()
}

/// The base document's retry policy (of CreateOrder), as a JSON pointer and as a path.
pub(super) const RP: &str = "/methodConfig/0/retryPolicy";
pub(super) const RP_PATH: &str = "methodConfig[0].retryPolicy";

/// The rule messages of a malformed duration.
pub(super) const DURATION_NOT_A_NUMBER: &str =
    r#"must be a duration string such as "1.5s", not a number"#;
pub(super) const DURATION_SECONDS_ONLY: &str =
    r#"must be a proto3 JSON duration such as "1.5s": must end in "s" (seconds is the only unit)"#;
pub(super) const DURATION_UNSIGNED: &str =
    r#"must be a proto3 JSON duration such as "1.5s": must not have a sign"#;

pub(super) fn warnings(p: &Parsed) -> Vec<String> {
    p.warnings.iter().map(ToString::to_string).collect()
}

/// A valid document that raises no warning: a retried, protected CreateOrder, a hedged
/// GetOrder, throttling and an empty `idem` object.
pub(super) fn base() -> Value {
    json!({
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": "shop.v1.Orders"},
        "methodConfig": [
            {
                "name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}],
                "timeout": "10s",
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"]
                },
                "idempotency": {}
            },
            {
                "name": [{"service": "shop.v1.Orders", "method": "GetOrder"}],
                "hedgingPolicy": {"maxAttempts": 2}
            }
        ],
        "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
        "idem": {}
    })
}

/// `base()` with the value at a JSON pointer replaced (`Some`) or removed (`None`).
pub(super) fn with(pointer: &str, value: Option<Value>) -> String {
    let mut doc = base();
    let (parent, key) = pointer.rsplit_once('/').expect("pointer has a parent");
    let target = doc.pointer_mut(parent).expect("parent exists");
    match (target, value) {
        (Value::Object(map), Some(v)) => {
            map.insert(key.to_owned(), v);
        }
        (Value::Object(map), None) => {
            map.remove(key);
        }
        (Value::Array(items), Some(v)) => items[key.parse::<usize>().expect("index")] = v,
        (other, _) => panic!("cannot set {pointer} in {other}"),
    }
    doc.to_string()
}

/// Every `good` value at `pointer` parses with no warning about it; every `bad` value
/// gives exactly the one error `path: rule`.
#[track_caller]
pub(super) fn rule(pointer: &str, path: &str, good: &[Value], bad: &[(Option<Value>, &str)]) {
    for v in good {
        let text = with(pointer, Some(v.clone()));
        let parsed = ok(&text);
        assert!(
            parsed.warnings.iter().all(|w| !w.path.starts_with(path)),
            "{v} at {path}: unexpected warnings {:?}",
            warnings(&parsed)
        );
    }
    for (v, message) in bad {
        let text = with(pointer, v.clone());
        assert_eq!(
            errors(&text),
            vec![format!("{path}: {message}")],
            "value {v:?} at {path}"
        );
    }
}

pub(super) fn settings(fields: Value) -> Result<(IdemSettings, Vec<String>), Vec<String>> {
    match parse(&with("/idem", Some(fields))) {
        Ok(p) => Ok((p.config.settings().clone(), warnings(&p))),
        Err(ConfigError::Invalid { errors, .. }) => {
            Err(errors.iter().map(ToString::to_string).collect())
        }
        Err(e) => panic!("{e}"),
    }
}

/// Asserts that `idem.{field}` set to each value fails with exactly its message.
#[track_caller]
pub(super) fn assert_settings_errors(field: &str, bad: &[(Value, impl ToString)]) {
    for (value, message) in bad {
        assert_eq!(
            settings(json!({ field: value })),
            Err(vec![message.to_string()]),
            "{field}: {value}"
        );
    }
}
