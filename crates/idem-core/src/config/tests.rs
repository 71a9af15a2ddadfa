//! Tests of the service-config parser: one `passes`/`fails` pair (at least) per gRFC A6 /
//! `service_config.proto` rule, each failure checked for its exact path and rule.

use std::time::Duration;

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;
use crate::code::{Code, CodeSet};
use idem_store::memory::MemoryStoreSettings;

fn parse(text: &str) -> Result<Parsed, ConfigError> {
    ServiceConfig::from_json_with_warnings(text)
}

#[track_caller]
fn ok(text: &str) -> Parsed {
    match parse(text) {
        Ok(p) => p,
        Err(e) => panic!("expected a valid config:\n{text}\ngot: {e}"),
    }
}

#[track_caller]
fn errors(text: &str) -> Vec<String> {
    match parse(text) {
        Err(ConfigError::Invalid { errors, .. }) => {
            errors.iter().map(ToString::to_string).collect()
        }
        other => panic!("expected ConfigError::Invalid for\n{text}\ngot: {other:?}"),
    }
}

/// The base document's retried, protected CreateOrder, as parsed.
#[track_caller]
fn create_order(p: &Parsed) -> &MethodConfig {
    p.config.lookup("shop.v1.Orders", "CreateOrder").unwrap()
}

/// The base document's hedged GetOrder, as parsed.
#[track_caller]
fn get_order(p: &Parsed) -> &MethodConfig {
    p.config.lookup("shop.v1.Orders", "GetOrder").unwrap()
}

/// The rule messages of a malformed duration.
const DURATION_NOT_A_NUMBER: &str = r#"must be a duration string such as "1.5s", not a number"#;
const DURATION_SECONDS_ONLY: &str =
    r#"must be a proto3 JSON duration such as "1.5s": must end in "s" (seconds is the only unit)"#;
const DURATION_UNSIGNED: &str =
    r#"must be a proto3 JSON duration such as "1.5s": must not have a sign"#;

fn warnings(p: &Parsed) -> Vec<String> {
    p.warnings.iter().map(ToString::to_string).collect()
}

/// A valid document that raises no warning: a retried, protected CreateOrder, a hedged
/// GetOrder, throttling and an empty `idem` object.
fn base() -> Value {
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
fn with(pointer: &str, value: Option<Value>) -> String {
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
fn rule(pointer: &str, path: &str, good: &[Value], bad: &[(Option<Value>, &str)]) {
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

#[test]
fn base_is_valid_and_quiet() {
    let p = ok(&base().to_string());
    assert!(p.warnings.is_empty(), "{:?}", warnings(&p));
    let create = create_order(&p);
    let retry = create.retry_policy().unwrap();
    assert_eq!(retry.max_attempts(), 3);
    assert_eq!(retry.initial_backoff(), Duration::from_millis(100));
    assert_eq!(retry.max_backoff(), Duration::from_secs(1));
    assert_eq!(retry.backoff_multiplier(), 2.0);
    assert_eq!(
        retry.retryable_status_codes(),
        CodeSet::of(Code::Unavailable)
    );
    assert_eq!(retry.per_attempt_recv_timeout(), None);
    assert_eq!(create.timeout(), Some(Duration::from_secs(10)));
    assert_eq!(create.idempotency(), Some(&IdempotencyPolicy::default()));
    assert!(create.hedging_policy().is_none());
    let get = get_order(&p);
    assert_eq!(
        get.hedging_policy(),
        Some(&HedgingPolicy {
            max_attempts: 2,
            hedging_delay: Duration::ZERO,
            non_fatal_status_codes: CodeSet::EMPTY
        })
    );
    assert!(get.idempotency().is_none());
    assert!(p.config.lookup("shop.v1.Orders", "ListOrders").is_none());
    assert_eq!(
        p.config.retry_throttling(),
        Some(RetryThrottling {
            max_milli_tokens: 10_000,
            token_ratio_milli: 100
        })
    );
    assert_eq!(p.config.settings(), &IdemSettings::default());
}

// ---- the document ------------------------------------------------------------------------

#[test]
fn malformed_json_reports_line_and_column() {
    match parse("{\n  \"methodConfig\": [\n    {\"name\": }\n  ]\n}") {
        Err(ConfigError::Json {
            line,
            column,
            message,
        }) => {
            assert_eq!((line, column), (3, 14));
            assert_eq!(message, "expected value", "the position is not repeated");
        }
        other => panic!("{other:?}"),
    }
    match parse("") {
        Err(ConfigError::Json { line: 1, .. }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn top_level_must_be_an_object() {
    for (text, at) in [
        ("[]", (1, 1)),
        ("\n  \"x\"", (2, 3)),
        ("null", (1, 1)),
        ("  5", (1, 3)),
    ] {
        match parse(text) {
            Err(ConfigError::Json {
                line,
                column,
                message,
            }) => {
                assert_eq!((line, column), at, "{text:?}");
                assert!(message.contains("must be a JSON object"), "{message}");
            }
            other => panic!("{text:?}: {other:?}"),
        }
    }
    let empty = ok("{}");
    assert!(empty.config.method_configs().is_empty());
    assert!(empty.config.retry_throttling().is_none());
    assert!(empty.config.lookup("a", "b").is_none());
}

#[test]
fn unknown_top_level_fields_are_ignored_silently() {
    let p = ok(
        r#"{"loadBalancingPolicy":"round_robin","loadBalancingConfig":[{"x":{}}],
        "healthCheckConfig":{"serviceName":""},"somethingNew":{"a":[1,2]}}"#,
    );
    assert!(p.warnings.is_empty(), "{:?}", warnings(&p));
}

#[test]
fn misspelled_fields_are_flagged() {
    // grpc-go matches field names case-insensitively; idem, grpc-java and C-core do not.
    let p = ok(r#"{"MethodConfig":[], "retry_throttling":{}}"#);
    assert_eq!(
        warnings(&p),
        vec![
            r#"MethodConfig: not read: field names are case-sensitive; did you mean "methodConfig"?"#,
            r#"retry_throttling: not read: field names are case-sensitive; did you mean "retryThrottling"?"#,
        ]
    );
}

#[test]
fn unknown_fields_inside_read_objects_are_warnings_with_their_path() {
    let mut doc = base();
    doc["methodConfig"][0]["retryPolicy"]["jitter"] = json!(0.2);
    doc["methodConfig"][0]["retryPolicy"]["max_attempts"] = json!(4);
    doc["methodConfig"][0]["name"][0]["version"] = json!("v1");
    doc["methodConfig"][0]["idempotency"]["ttl"] = json!("1s");
    doc["methodConfig"][1]["odd key"] = json!(1);
    doc["idem"]["store"] = json!("redis");
    doc["retryThrottling"]["burst"] = json!(1);
    let p = ok(&doc.to_string());
    let mut w = warnings(&p);
    w.sort();
    assert_eq!(
        w,
        vec![
            "idem.store: unknown field, ignored",
            "methodConfig[0].idempotency.ttl: unknown field, ignored",
            "methodConfig[0].name[0].version: unknown field, ignored",
            "methodConfig[0].retryPolicy.jitter: unknown field, ignored",
            r#"methodConfig[0].retryPolicy.max_attempts: unknown field, ignored: field names are case-sensitive; did you mean "maxAttempts"?"#,
            r#"methodConfig[1]["odd key"]: unknown field, ignored"#,
            "retryThrottling.burst: unknown field, ignored",
        ]
    );
}

#[test]
fn all_errors_are_reported_at_once() {
    let mut doc = base();
    doc["methodConfig"][0]["retryPolicy"]["maxAttempts"] = json!(1);
    doc["methodConfig"][1]["timeout"] = json!("1ms");
    doc["retryThrottling"]["tokenRatio"] = json!("0.1");
    let e = errors(&doc.to_string());
    assert_eq!(
        e,
        vec![
            "methodConfig[0].retryPolicy.maxAttempts: must be an integer > 1",
            r#"methodConfig[1].timeout: must be a proto3 JSON duration such as "1.5s": must end in "s" (seconds is the only unit)"#,
            "retryThrottling.tokenRatio: must be a number > 0 (a JSON number, not a string)",
        ]
    );
    // The Display of the error lists them all too.
    let shown = parse(&doc.to_string()).unwrap_err().to_string();
    assert!(
        shown.starts_with("3 error(s) in service config: "),
        "{shown}"
    );
}

#[test]
fn errors_keep_the_warnings_found_along_the_way() {
    let mut doc = base();
    doc["methodConfig"][0]["retryPolicy"]["maxAttempts"] = json!(9);
    doc["methodConfig"][1]["timeout"] = json!(1);
    match parse(&doc.to_string()) {
        Err(ConfigError::Invalid { errors, warnings }) => {
            assert_eq!(errors.len(), 1);
            assert_eq!(warnings.len(), 1);
            assert_eq!(warnings[0].path, "methodConfig[0].retryPolicy.maxAttempts");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn method_config_shape() {
    rule(
        "/methodConfig",
        "methodConfig",
        &[json!([]), Value::Null],
        &[(
            Some(json!({})),
            "must be an array of method configs, not an object",
        )],
    );
    rule(
        "/methodConfig/1",
        "methodConfig[1]",
        &[json!({"name": [{"service": "x"}]})],
        &[(Some(json!([])), "must be a JSON object, not an array")],
    );
}

// ---- names and lookup --------------------------------------------------------------------

#[test]
fn name_null_empty_and_absent_are_the_same() {
    for name in [
        json!({"service": "s"}),
        json!({"service": "s", "method": null}),
        json!({"service": "s", "method": ""}),
    ] {
        let p = ok(&json!({"methodConfig": [{"name": [name], "timeout": "1s"}]}).to_string());
        let mc = &p.config.method_configs()[0];
        assert_eq!(
            mc.names(),
            &[MethodName {
                service: Some("s".into()),
                method: None
            }]
        );
        assert_eq!(
            p.config.lookup("s", "Anything").unwrap().timeout(),
            Some(Duration::from_secs(1))
        );
        assert!(p.config.lookup("t", "Anything").is_none());
    }
    for name in [
        json!({}),
        json!({"service": null}),
        json!({"service": ""}),
        json!({"service": "", "method": ""}),
        json!({"method": null}),
    ] {
        let p = ok(&json!({"methodConfig": [{"name": [name], "timeout": "1s"}]}).to_string());
        assert_eq!(
            p.config.method_configs()[0].names(),
            &[MethodName {
                service: None,
                method: None
            }]
        );
        assert!(p.config.lookup("any.Service", "Any").is_some());
    }
    // So two spellings of one name are a duplicate.
    let e = errors(r#"{"methodConfig":[{"name":[{"service":"s"},{"service":"s","method":""}]}]}"#);
    assert_eq!(
        e,
        vec!["methodConfig[0].name[1]: duplicate name s/*: first at methodConfig[0].name[0]"]
    );
}

#[test]
fn name_method_needs_a_service() {
    rule(
        "/methodConfig/0/name/0",
        "methodConfig[0].name[0]",
        &[
            json!({"service": "shop.v1.Orders", "method": "CreateOrder"}),
            json!({"service": "shop.v1.Orders"}),
        ],
        &[
            (
                Some(json!({"method": "CreateOrder"})),
                "service must not be empty when method is set",
            ),
            (
                Some(json!({"service": "", "method": "CreateOrder"})),
                "service must not be empty when method is set",
            ),
            (
                Some(json!({"service": null, "method": "CreateOrder"})),
                "service must not be empty when method is set",
            ),
            (
                Some(json!("shop.v1.Orders/CreateOrder")),
                "must be a JSON object, not a string",
            ),
        ],
    );
    rule(
        "/methodConfig/0/name/0/service",
        "methodConfig[0].name[0].service",
        &[json!("other.Service")],
        &[(Some(json!(5)), "must be a string, not a number")],
    );
    rule(
        "/methodConfig/0/name",
        "methodConfig[0].name",
        &[json!([{"service": "a"}, {"service": "b", "method": "c"}])],
        &[(
            Some(json!({"service": "a"})),
            "must be an array of {service, method} objects, not an object",
        )],
    );
}

#[test]
fn names_are_unique_across_the_document() {
    let doc =
        |a: Value, b: Value| json!({"methodConfig": [{"name": [a]}, {"name": [b]}]}).to_string();
    // Exact, service and default names, each repeated in another entry.
    assert_eq!(
        errors(&doc(
            json!({"service": "s", "method": "m"}),
            json!({"service": "s", "method": "m"})
        )),
        vec!["methodConfig[1].name[0]: duplicate name s/m: first at methodConfig[0].name[0]"]
    );
    assert_eq!(
        errors(&doc(
            json!({"service": "s"}),
            json!({"service": "s", "method": null})
        )),
        vec!["methodConfig[1].name[0]: duplicate name s/*: first at methodConfig[0].name[0]"]
    );
    assert_eq!(
        errors(&doc(json!({}), json!({"service": ""}))),
        vec!["methodConfig[1].name[0]: duplicate name *: first at methodConfig[0].name[0]"]
    );
    // Within one entry too.
    assert_eq!(
        errors(
            r#"{"methodConfig":[{"name":[{"service":"s","method":"m"},{"service":"s","method":"m"}]}]}"#
        ),
        vec!["methodConfig[0].name[1]: duplicate name s/m: first at methodConfig[0].name[0]"]
    );
    // Different levels are not duplicates; neither are names differing only in case.
    ok(&doc(
        json!({"service": "s", "method": "m"}),
        json!({"service": "s"}),
    ));
    ok(&doc(
        json!({"service": "s", "method": "m"}),
        json!({"service": "s", "method": "M"}),
    ));
    ok(&doc(json!({"service": "s"}), json!({})));
}

#[test]
fn lookup_precedence_exact_then_service_then_default() {
    let p = ok(r#"{"methodConfig":[
        {"name":[{}], "timeout":"1s"},
        {"name":[{"service":"s"}], "timeout":"2s",
         "retryPolicy":{"maxAttempts":2,"initialBackoff":"0.1s","maxBackoff":"0.1s","backoffMultiplier":1,"retryableStatusCodes":["UNAVAILABLE"]}},
        {"name":[{"service":"s","method":"m"}, {"service":"t","method":"m"}], "timeout":"3s"}
    ]}"#);
    let timeout = |s: &str, m: &str| p.config.lookup(s, m).and_then(MethodConfig::timeout);
    assert_eq!(timeout("s", "m"), Some(Duration::from_secs(3)));
    assert_eq!(timeout("t", "m"), Some(Duration::from_secs(3)));
    assert_eq!(timeout("s", "other"), Some(Duration::from_secs(2)));
    assert_eq!(timeout("t", "other"), Some(Duration::from_secs(1)));
    assert_eq!(timeout("u", "m"), Some(Duration::from_secs(1)));
    // The most specific entry wins whole: s/m has no retry policy, although s/* has one.
    assert!(p.config.lookup("s", "m").unwrap().retry_policy().is_none());
    assert!(
        p.config
            .lookup("s", "other")
            .unwrap()
            .retry_policy()
            .is_some()
    );
    // By HTTP/2 path.
    assert_eq!(
        p.config.lookup_path("/s/m").and_then(MethodConfig::timeout),
        Some(Duration::from_secs(3))
    );
    assert_eq!(
        p.config.lookup_path("/s/x").and_then(MethodConfig::timeout),
        Some(Duration::from_secs(2))
    );
    assert!(p.config.lookup_path("s/m").is_none());
    assert!(p.config.lookup_path("/s/m/x").is_none());

    // Without a default entry, an unmatched method has no config.
    let p = ok(r#"{"methodConfig":[{"name":[{"service":"s"}]}]}"#);
    assert!(p.config.lookup("s", "m").is_some());
    assert!(p.config.lookup("s2", "m").is_none());
    assert!(p.config.lookup("", "").is_none());
}

#[test]
fn entry_without_names_is_skipped_but_validated() {
    for names in [None, Some(json!([])), Some(Value::Null)] {
        let mut entry = json!({"timeout": "1s"});
        if let Some(n) = &names {
            entry["name"] = n.clone();
        }
        let p = ok(&json!({"methodConfig": [entry]}).to_string());
        assert!(p.config.method_configs().is_empty(), "{names:?}");
        assert!(p.config.lookup("s", "m").is_none());
        assert_eq!(
            warnings(&p),
            vec![
                "methodConfig[0]: has no names, so it applies to no method: validated, then skipped"
            ]
        );
        entry["timeout"] = json!("1");
        assert_eq!(
            errors(&json!({"methodConfig": [entry]}).to_string()),
            vec![
                r#"methodConfig[0].timeout: must be a proto3 JSON duration such as "1.5s": must end in "s" (seconds is the only unit)"#
            ]
        );
    }
    // A skipped entry does not shift the index of the others.
    let p = ok(r#"{"methodConfig":[{"timeout":"1s"},{"name":[{"service":"s"}],"timeout":"2s"}]}"#);
    assert_eq!(
        p.config.lookup("s", "m").and_then(MethodConfig::timeout),
        Some(Duration::from_secs(2))
    );
}

#[test]
fn slash_in_a_name_is_a_warning() {
    let p = ok(r#"{"methodConfig":[{"name":[{"service":"/shop.v1.Orders/","method":"Get"}]}]}"#);
    assert_eq!(
        warnings(&p),
        vec!["methodConfig[0].name[0].service: contains '/', so it never matches a request path"]
    );
}

// ---- per-method standard fields ----------------------------------------------------------

#[test]
fn timeout_rule() {
    rule(
        "/methodConfig/0/timeout",
        "methodConfig[0].timeout",
        &[
            json!("1s"),
            json!("0.5s"),
            json!("9223372036s"),
            Value::Null,
        ],
        &[
            (Some(json!(2)), DURATION_NOT_A_NUMBER),
            (Some(json!("2")), DURATION_SECONDS_ONLY),
            (Some(json!("-2s")), DURATION_UNSIGNED),
        ],
    );
    // 0 is valid (the proto allows it) but every call then fails at once.
    let p = ok(&with("/methodConfig/1/timeout", Some(json!("0s"))));
    assert_eq!(
        warnings(&p),
        vec!["methodConfig[1].timeout: is 0: every call without its own deadline fails at once"]
    );
}

#[test]
fn wait_for_ready_rule() {
    rule(
        "/methodConfig/0/waitForReady",
        "methodConfig[0].waitForReady",
        &[json!(true), json!(false)],
        &[
            (Some(json!("true")), "must be true or false, not a string"),
            (Some(json!(1)), "must be true or false, not a number"),
        ],
    );
    let p = ok(&with("/methodConfig/0/waitForReady", Some(json!(true))));
    assert_eq!(create_order(&p).wait_for_ready(), Some(true));
}

#[test]
fn message_size_rules() {
    for field in ["maxRequestMessageBytes", "maxResponseMessageBytes"] {
        rule(
            &format!("/methodConfig/0/{field}"),
            &format!("methodConfig[0].{field}"),
            &[json!(0), json!(4194304), json!(4294967295u64)],
            &[
                (
                    Some(json!(4294967296u64)),
                    "must be an integer in 0..=4294967295",
                ),
                (Some(json!(-1)), "must be an integer in 0..=4294967295"),
                (Some(json!(1.5)), "must be an integer in 0..=4294967295"),
                (
                    Some(json!("1024")),
                    "must be an integer in 0..=4294967295 (a JSON number, not a string)",
                ),
            ],
        );
    }
    let p = ok(&with(
        "/methodConfig/0/maxRequestMessageBytes",
        Some(json!(0)),
    ));
    let mc = create_order(&p);
    assert_eq!(mc.max_request_message_bytes(), Some(0));
    assert_eq!(mc.max_response_message_bytes(), None);
}

// ---- retryPolicy -------------------------------------------------------------------------

const RP: &str = "/methodConfig/0/retryPolicy";
const RP_PATH: &str = "methodConfig[0].retryPolicy";

#[test]
fn retry_max_attempts_rule() {
    rule(
        &format!("{RP}/maxAttempts"),
        &format!("{RP_PATH}.maxAttempts"),
        &[json!(2), json!(5)],
        &[
            (Some(json!(1)), "must be an integer > 1"),
            (Some(json!(0)), "must be an integer > 1"),
            (Some(json!(-3)), "must be an integer > 1"),
            (Some(json!(2.5)), "must be an integer > 1"),
            (
                Some(json!(2.0)),
                "must be an integer > 1; write 2 without a fraction or exponent",
            ),
            (
                Some(json!("3")),
                "must be an integer > 1 (a JSON number, not a string)",
            ),
            (Some(json!(true)), "must be an integer > 1, not a boolean"),
            (None, "is required and must be an integer > 1"),
            (Some(Value::Null), "is required and must be an integer > 1"),
        ],
    );
}

#[test]
fn retry_max_attempts_above_five_is_clamped_with_a_warning() {
    for (n, shown) in [(json!(6), "6"), (json!(u64::MAX), "18446744073709551615")] {
        let p = ok(&with(&format!("{RP}/maxAttempts"), Some(n)));
        let policy = create_order(&p).retry_policy().unwrap();
        assert_eq!(policy.max_attempts(), 5);
        assert_eq!(
            warnings(&p),
            vec![format!(
                "{RP_PATH}.maxAttempts: {shown} is clamped to 5 (gRPC allows at most 5 attempts)"
            )]
        );
    }
}

#[test]
fn retry_backoff_rules() {
    for field in ["initialBackoff", "maxBackoff"] {
        rule(
            &format!("{RP}/{field}"),
            &format!("{RP_PATH}.{field}"),
            &[json!("1s"), json!("0.1s")],
            &[
                (Some(json!("0s")), "must be a duration > 0"),
                (Some(json!("0.000s")), "must be a duration > 0"),
                (Some(json!(1)), DURATION_NOT_A_NUMBER),
                (Some(json!("100ms")), DURATION_SECONDS_ONLY),
                (Some(json!("-1s")), DURATION_UNSIGNED),
                (None, "is required and must be a duration > 0"),
            ],
        );
    }
    let p = ok(&with(
        &format!("{RP}/initialBackoff"),
        Some(json!("0.000000001s")),
    ));
    let policy = create_order(&p).retry_policy().unwrap().clone();
    assert_eq!(policy.initial_backoff(), Duration::from_nanos(1));
    // maxBackoff below initialBackoff is legal but odd.
    let p = ok(&with(&format!("{RP}/maxBackoff"), Some(json!("0.05s"))));
    assert_eq!(
        warnings(&p),
        vec![format!(
            "{RP_PATH}.maxBackoff: is less than initialBackoff 0.1s: every backoff is 0.05s"
        )]
    );
}

#[test]
fn retry_backoff_multiplier_rule() {
    rule(
        &format!("{RP}/backoffMultiplier"),
        &format!("{RP_PATH}.backoffMultiplier"),
        &[json!(1), json!(0.5), json!(2.5), json!(1e1)],
        &[
            (Some(json!(0)), "must be a number > 0"),
            (Some(json!(-2)), "must be a number > 0"),
            (Some(json!(0.0)), "must be a number > 0"),
            (
                Some(json!("2")),
                "must be a number > 0 (a JSON number, not a string)",
            ),
            (None, "is required and must be a number > 0"),
        ],
    );
}

#[test]
fn retry_retryable_status_codes_rule() {
    rule(
        &format!("{RP}/retryableStatusCodes"),
        &format!("{RP_PATH}.retryableStatusCodes"),
        &[
            json!(["UNAVAILABLE"]),
            json!(["RESOURCE_EXHAUSTED", "UNAVAILABLE", "ABORTED"]),
        ],
        &[
            (Some(json!([])), "must be a non-empty array of status codes"),
            (
                None,
                "is required and must be a non-empty array of status codes",
            ),
            (
                Some(json!("UNAVAILABLE")),
                "must be an array of status codes, not a string",
            ),
        ],
    );
    rule(
        &format!("{RP}/retryableStatusCodes"),
        &format!("{RP_PATH}.retryableStatusCodes[1]"),
        &[],
        &[
            (
                Some(json!(["UNAVAILABLE", "UNAVAILABLEX"])),
                r#"must be a status code name such as "UNAVAILABLE" or an integer 0..=16"#,
            ),
            (
                Some(json!(["UNAVAILABLE", 17])),
                r#"must be a status code name such as "UNAVAILABLE" or an integer 0..=16"#,
            ),
            (
                Some(json!(["UNAVAILABLE", -1])),
                r#"must be a status code name such as "UNAVAILABLE" or an integer 0..=16"#,
            ),
            (
                Some(json!(["UNAVAILABLE", 14.0])),
                r#"must be a status code name such as "UNAVAILABLE" or an integer 0..=16"#,
            ),
            (
                Some(json!(["UNAVAILABLE", null])),
                r#"must be a status code name such as "UNAVAILABLE" or an integer 0..=16, not null"#,
            ),
        ],
    );
    // Names in any case and integers are read (with a portability warning).
    let p = ok(&with(
        &format!("{RP}/retryableStatusCodes"),
        Some(json!(["unavailable", 10, "Resource_Exhausted"])),
    ));
    let codes = create_order(&p)
        .retry_policy()
        .unwrap()
        .retryable_status_codes();
    assert_eq!(
        codes,
        CodeSet::of(Code::Unavailable)
            .with(Code::Aborted)
            .with(Code::ResourceExhausted)
    );
    assert_eq!(
        warnings(&p),
        vec![
            format!(
                r#"{RP_PATH}.retryableStatusCodes[0]: "unavailable" is read as UNAVAILABLE, but grpc-go, grpc-java and C-core accept only "UNAVAILABLE""#
            ),
            format!(
                r#"{RP_PATH}.retryableStatusCodes[1]: an integer code is read as ABORTED, but C-core accepts only names: write "ABORTED""#
            ),
            format!(
                r#"{RP_PATH}.retryableStatusCodes[2]: "Resource_Exhausted" is read as RESOURCE_EXHAUSTED, but grpc-go, grpc-java and C-core accept only "RESOURCE_EXHAUSTED""#
            ),
        ]
    );
}

#[test]
fn retry_risky_codes_are_warnings() {
    let risky = [
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
        "FAILED_PRECONDITION",
        "UNIMPLEMENTED",
        "DATA_LOSS",
        "OK",
    ];
    let mut codes = vec!["UNAVAILABLE"];
    codes.extend(risky);
    let p = ok(&with(
        &format!("{RP}/retryableStatusCodes"),
        Some(json!(codes)),
    ));
    let w = warnings(&p);
    assert_eq!(w.len(), risky.len(), "{w:?}");
    for (i, name) in risky.iter().enumerate() {
        let why = if *name == "OK" {
            "OK is not a failure".to_owned()
        } else {
            "it means the server will answer the same, so retrying cannot help".to_owned()
        };
        assert_eq!(
            w[i],
            format!(
                "{RP_PATH}.retryableStatusCodes[{}]: retrying {name} is risky: {why}",
                i + 1
            )
        );
    }
    // The rest are not risky.
    let fine = [
        "CANCELLED",
        "UNKNOWN",
        "DEADLINE_EXCEEDED",
        "ALREADY_EXISTS",
        "RESOURCE_EXHAUSTED",
        "ABORTED",
        "OUT_OF_RANGE",
        "INTERNAL",
        "UNAVAILABLE",
    ];
    let p = ok(&with(
        &format!("{RP}/retryableStatusCodes"),
        Some(json!(fine)),
    ));
    assert!(p.warnings.is_empty(), "{:?}", warnings(&p));
}

#[test]
fn retry_per_attempt_recv_timeout_rule() {
    rule(
        &format!("{RP}/perAttemptRecvTimeout"),
        &format!("{RP_PATH}.perAttemptRecvTimeout"),
        &[json!("0.5s"), Value::Null],
        &[
            (Some(json!("0s")), "must be a duration > 0"),
            (Some(json!(5)), DURATION_NOT_A_NUMBER),
        ],
    );
    let p = ok(&with(
        &format!("{RP}/perAttemptRecvTimeout"),
        Some(json!("0.5s")),
    ));
    let policy = create_order(&p).retry_policy().unwrap();
    assert_eq!(
        policy.per_attempt_recv_timeout(),
        Some(Duration::from_millis(500))
    );
}

#[test]
fn retry_policy_must_be_an_object() {
    rule(
        RP,
        RP_PATH,
        &[Value::Null],
        &[(Some(json!(true)), "must be a JSON object, not a boolean")],
    );
    assert!(create_order(&ok(&with(RP, None))).retry_policy().is_none());
}

#[test]
fn retry_policy_reports_every_missing_field() {
    let e = errors(&with(RP, Some(json!({}))));
    assert_eq!(
        e,
        vec![
            format!("{RP_PATH}.maxAttempts: is required and must be an integer > 1"),
            format!("{RP_PATH}.initialBackoff: is required and must be a duration > 0"),
            format!("{RP_PATH}.maxBackoff: is required and must be a duration > 0"),
            format!("{RP_PATH}.backoffMultiplier: is required and must be a number > 0"),
            format!(
                "{RP_PATH}.retryableStatusCodes: is required and must be a non-empty array of status codes"
            ),
        ]
    );
}

#[test]
fn retry_worst_case_beyond_timeout_is_a_warning() {
    // Backoffs 0.2 + 0.4 + 0.8 + 1 = 2.4 s, × 1.2 = 2.88 s > 2 s.
    let policy = json!({"maxAttempts": 5, "initialBackoff": "0.2s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]});
    let mut doc = base();
    doc["methodConfig"][0]["retryPolicy"] = policy.clone();
    doc["methodConfig"][0]["timeout"] = json!("2s");
    let p = ok(&doc.to_string());
    assert_eq!(
        warnings(&p),
        vec![format!(
            "{RP_PATH}: worst case backoff 2.88s (4 retries, each at 1.2 × its maximum) exceeds timeout 2s: the last retries cannot run"
        )]
    );
    // 2.88 s fits in 3 s; and without a timeout there is nothing to compare.
    doc["methodConfig"][0]["timeout"] = json!("3s");
    assert!(ok(&doc.to_string()).warnings.is_empty());
    doc["methodConfig"][0]
        .as_object_mut()
        .unwrap()
        .remove("timeout");
    assert!(ok(&doc.to_string()).warnings.is_empty());
    // A huge multiplier saturates at maxBackoff rather than overflowing.
    doc["methodConfig"][0]["retryPolicy"]["backoffMultiplier"] = json!(1e300);
    doc["methodConfig"][0]["timeout"] = json!("1s");
    let w = warnings(&ok(&doc.to_string()));
    assert_eq!(w.len(), 1);
    // 0.2 + 1 + 1 + 1 = 3.2 s, × 1.2 = 3.84 s.
    assert!(w[0].contains("worst case backoff 3.84s"), "{w:?}");
}

// ---- hedgingPolicy -----------------------------------------------------------------------

const HP: &str = "/methodConfig/1/hedgingPolicy";
const HP_PATH: &str = "methodConfig[1].hedgingPolicy";

#[test]
fn hedging_max_attempts_rule() {
    rule(
        &format!("{HP}/maxAttempts"),
        &format!("{HP_PATH}.maxAttempts"),
        &[json!(2), json!(5)],
        &[
            (Some(json!(1)), "must be an integer > 1"),
            (
                Some(json!("2")),
                "must be an integer > 1 (a JSON number, not a string)",
            ),
            (None, "is required and must be an integer > 1"),
        ],
    );
    let p = ok(&with(&format!("{HP}/maxAttempts"), Some(json!(8))));
    assert_eq!(get_order(&p).hedging_policy().unwrap().max_attempts, 5);
    assert_eq!(
        warnings(&p),
        vec![format!(
            "{HP_PATH}.maxAttempts: 8 is clamped to 5 (gRPC allows at most 5 attempts)"
        )]
    );
}

#[test]
fn hedging_delay_and_non_fatal_codes_rules() {
    rule(
        &format!("{HP}/hedgingDelay"),
        &format!("{HP_PATH}.hedgingDelay"),
        &[json!("0s"), json!("0.5s"), Value::Null],
        &[
            (Some(json!("-0.5s")), DURATION_UNSIGNED),
            (Some(json!(0.5)), DURATION_NOT_A_NUMBER),
        ],
    );
    rule(
        &format!("{HP}/nonFatalStatusCodes"),
        &format!("{HP_PATH}.nonFatalStatusCodes"),
        &[json!([]), json!(["UNAVAILABLE", "ABORTED"]), Value::Null],
        &[(
            Some(json!({})),
            "must be an array of status codes, not an object",
        )],
    );
    let mut doc = base();
    doc["methodConfig"][1]["hedgingPolicy"] = json!({"maxAttempts": 3, "hedgingDelay": "0.5s", "nonFatalStatusCodes": ["UNAVAILABLE", "NOPE"]});
    assert_eq!(
        errors(&doc.to_string()),
        vec![format!(
            r#"{HP_PATH}.nonFatalStatusCodes[1]: must be a status code name such as "UNAVAILABLE" or an integer 0..=16"#
        )]
    );
    doc["methodConfig"][1]["hedgingPolicy"]["nonFatalStatusCodes"] = json!(["UNAVAILABLE"]);
    let p = ok(&doc.to_string());
    let h = get_order(&p).hedging_policy().unwrap().clone();
    assert_eq!(
        h,
        HedgingPolicy {
            max_attempts: 3,
            hedging_delay: Duration::from_millis(500),
            non_fatal_status_codes: CodeSet::of(Code::Unavailable)
        }
    );
}

#[test]
fn retry_and_hedging_are_mutually_exclusive() {
    let mut doc = base();
    doc["methodConfig"][1]["retryPolicy"] = doc["methodConfig"][0]["retryPolicy"].clone();
    assert_eq!(
        errors(&doc.to_string()),
        vec!["methodConfig[1]: retryPolicy and hedgingPolicy must not both be set"]
    );
    // null is absent, so this is fine.
    doc["methodConfig"][1]["retryPolicy"] = Value::Null;
    ok(&doc.to_string());
}

// ---- retryThrottling ---------------------------------------------------------------------

#[test]
fn throttling_max_tokens_rule() {
    rule(
        "/retryThrottling/maxTokens",
        "retryThrottling.maxTokens",
        &[json!(1), json!(1000)],
        &[
            (Some(json!(0)), "must be an integer in (0, 1000]"),
            (Some(json!(1001)), "must be an integer in (0, 1000]"),
            (Some(json!(-5)), "must be an integer in (0, 1000]"),
            (Some(json!(10.5)), "must be an integer in (0, 1000]"),
            (
                Some(json!(10.0)),
                "must be an integer in (0, 1000]; write 10 without a fraction or exponent",
            ),
            (
                Some(json!("10")),
                "must be an integer in (0, 1000] (a JSON number, not a string)",
            ),
            (None, "is required and must be an integer in (0, 1000]"),
        ],
    );
    let p = ok(&with("/retryThrottling/maxTokens", Some(json!(1000))));
    assert_eq!(
        p.config.retry_throttling().unwrap().max_milli_tokens,
        1_000_000
    );
}

#[test]
fn throttling_token_ratio_rule() {
    rule(
        "/retryThrottling/tokenRatio",
        "retryThrottling.tokenRatio",
        &[json!(0.1), json!(1), json!(0.001), json!(0.5)],
        &[
            (Some(json!(0)), "must be a number > 0"),
            (Some(json!(-0.1)), "must be a number > 0"),
            (
                Some(json!(0.0004)),
                "must be at least 0.001 (3 decimals are kept)",
            ),
            (
                Some(json!("0.1")),
                "must be a number > 0 (a JSON number, not a string)",
            ),
            (None, "is required and must be a number > 0"),
        ],
    );
}

#[test]
fn throttling_token_ratio_keeps_three_decimals_truncating() {
    let milli = |ratio: Value| {
        let p = ok(&with("/retryThrottling/tokenRatio", Some(ratio)));
        (
            p.config.retry_throttling().unwrap().token_ratio_milli,
            warnings(&p),
        )
    };
    assert_eq!(milli(json!(0.1)), (100, vec![]));
    assert_eq!(milli(json!(1)), (1000, vec![]));
    assert_eq!(milli(json!(2.5)), (2500, vec![]));
    // 0.251 as an f32 times 1000 is 250.99998 (grpc-java's (int) cast gives 250); the
    // decimal text keeps 251, as C-core does.
    assert_eq!(milli(json!(0.251)), (251, vec![]));
    assert_eq!(milli(json!(0.506)), (506, vec![]));
    // Truncated, never rounded up, with a warning.
    assert_eq!(
        milli(json!(0.2559)),
        (
            255,
            vec![
                "retryThrottling.tokenRatio: 0.2559 is truncated to 0.255 (3 decimals are kept)"
                    .to_owned()
            ]
        )
    );
    assert_eq!(milli(json!(1e-3)), (1, vec![]));
    // Above 1000 refills as much as 1000 does (the bucket holds at most 1000 tokens).
    assert_eq!(milli(json!(5000)), (1_000_000, vec![]));
    assert_eq!(milli(json!(1e30)).0, 1_000_000);
}

#[test]
fn throttling_must_be_an_object() {
    rule(
        "/retryThrottling",
        "retryThrottling",
        &[Value::Null],
        &[(
            Some(json!([10, 0.1])),
            "must be a JSON object, not an array",
        )],
    );
    assert!(
        ok(&with("/retryThrottling", None))
            .config
            .retry_throttling()
            .is_none()
    );
}

// ---- numbers -----------------------------------------------------------------------------

#[test]
fn numbers_are_json_numbers_never_strings() {
    // One string for every numeric field idem reads.
    let cases = [
        (format!("{RP}/maxAttempts"), "3"),
        (format!("{RP}/backoffMultiplier"), "2"),
        ("/methodConfig/0/maxRequestMessageBytes".to_owned(), "10"),
        ("/retryThrottling/maxTokens".to_owned(), "10"),
        ("/retryThrottling/tokenRatio".to_owned(), "0.1"),
        (
            "/methodConfig/0/idempotency/maxRequestBytes".to_owned(),
            "10",
        ),
        ("/idem/memoryStore".to_owned(), ""),
    ];
    for (pointer, text) in cases {
        let (pointer, value) = if text.is_empty() {
            (pointer, json!({"maxEntries": "10"}))
        } else {
            (pointer, json!(text))
        };
        let e = errors(&with(&pointer, Some(value)));
        assert_eq!(e.len(), 1, "{pointer}: {e:?}");
        assert!(e[0].ends_with("(a JSON number, not a string)"), "{e:?}");
    }
}

// ---- idempotency -------------------------------------------------------------------------

const IP: &str = "/methodConfig/0/idempotency";
const IP_PATH: &str = "methodConfig[0].idempotency";

fn idempotency(fields: Value) -> Result<IdempotencyPolicy, Vec<String>> {
    match parse(&with(IP, Some(fields))) {
        Ok(p) => Ok(create_order(&p).idempotency().unwrap().clone()),
        Err(ConfigError::Invalid { errors, .. }) => {
            Err(errors.iter().map(ToString::to_string).collect())
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn idempotency_presence_marks_protection() {
    assert!(create_order(&ok(&with(IP, None))).idempotency().is_none());
    assert!(
        create_order(&ok(&with(IP, Some(Value::Null))))
            .idempotency()
            .is_none()
    );
    assert_eq!(idempotency(json!({})), Ok(IdempotencyPolicy::default()));
    assert_eq!(
        errors(&with(IP, Some(json!(true)))),
        vec![format!("{IP_PATH}: must be a JSON object, not a boolean")]
    );
}

#[test]
fn idempotency_fields() {
    let p = idempotency(json!({
        "keyRequired": false, "recordTtl": "3600s", "leaseTtl": "5s", "inFlight": "ABORT",
        "abortRetryDelay": "0.25s", "maxRequestBytes": 1024, "maxResponseBytes": 2048, "failOpen": true
    }))
    .unwrap();
    assert_eq!(
        p,
        IdempotencyPolicy {
            key_required: false,
            record_ttl: Duration::from_secs(3600),
            lease_ttl: Duration::from_secs(5),
            in_flight: InFlightPolicy::Abort,
            abort_retry_delay: Duration::from_millis(250),
            max_request_bytes: 1024,
            max_response_bytes: 2048,
            fail_open: true,
            ..IdempotencyPolicy::default()
        }
    );
    assert_eq!(
        idempotency(json!({"inFlight": "WAIT"})).unwrap().in_flight,
        InFlightPolicy::Wait
    );
    assert_eq!(
        idempotency(json!({"abortRetryDelay": "0s"}))
            .unwrap()
            .abort_retry_delay,
        Duration::ZERO
    );
    let bad = [
        (
            "keyRequired",
            json!("yes"),
            "must be true or false, not a string",
        ),
        ("recordTtl", json!("0s"), "must be a duration > 0"),
        ("leaseTtl", json!("0s"), "must be a duration > 0"),
        (
            "leaseTtl",
            json!(10),
            r#"must be a duration string such as "1.5s", not a number"#,
        ),
        ("inFlight", json!("wait"), r#"must be "WAIT" or "ABORT""#),
        ("inFlight", json!("REJECT"), r#"must be "WAIT" or "ABORT""#),
        (
            "abortRetryDelay",
            json!("-1s"),
            r#"must be a proto3 JSON duration such as "1.5s": must not have a sign"#,
        ),
        ("maxRequestBytes", json!(0), "must be an integer > 0"),
        ("maxResponseBytes", json!(-1), "must be an integer > 0"),
        ("maxRequestFrames", json!(0), "must be an integer > 0"),
        (
            "acceptCompressed",
            json!("gzip"),
            "must be an array of encoding names, not a string",
        ),
        ("failOpen", json!(1), "must be true or false, not a number"),
    ];
    for (field, value, message) in bad {
        assert_eq!(
            idempotency(json!({ field: value })),
            Err(vec![format!("{IP_PATH}.{field}: {message}")]),
            "{field}"
        );
    }
}

#[test]
fn response_stall_timeout_is_read_and_never_zero() {
    assert_eq!(
        idempotency(json!({})).unwrap().response_stall_timeout,
        Duration::from_secs(30)
    );
    let p = idempotency(json!({"responseStallTimeout": "2.5s"})).unwrap();
    assert_eq!(p.response_stall_timeout, Duration::from_millis(2500));
    assert_eq!(
        idempotency(json!({"responseStallTimeout": "0s"})),
        Err(vec![format!(
            "{IP_PATH}.responseStallTimeout: must be a duration > 0"
        )])
    );
}

#[test]
fn idempotency_timings_must_work_together() {
    // A lease shorter than a millisecond cannot be renewed in time.
    assert_eq!(
        idempotency(json!({"leaseTtl": "0.000999s"})),
        Err(vec![format!(
            "{IP_PATH}.leaseTtl: must be at least 0.001s: a shorter lease ends before it can \
             be renewed"
        )])
    );
    let p = idempotency(json!({"leaseTtl": "0.001s", "completionRetryTimeout": "1s"})).unwrap();
    assert_eq!(p.lease_ttl, Duration::from_millis(1));

    // A record must outlive its lease: reported on the field that was written.
    let record_below_lease = "recordTtl (5s) must be at least leaseTtl (10s): a record must \
                              not expire while its handler still holds the lease";
    assert_eq!(
        idempotency(json!({"recordTtl": "5s"})),
        Err(vec![format!("{IP_PATH}.recordTtl: {record_below_lease}")])
    );
    assert_eq!(
        idempotency(json!({"recordTtl": "5s", "leaseTtl": "10s"})),
        Err(vec![format!("{IP_PATH}.recordTtl: {record_below_lease}")])
    );
    let lease_above_record = "recordTtl (86400s) must be at least leaseTtl (90000s): a record \
                              must not expire while its handler still holds the lease";
    let text = with(
        IP,
        Some(json!({"leaseTtl": "90000s", "completionRetryTimeout": "90000s"})),
    );
    assert_eq!(
        errors(&text),
        vec![format!("{IP_PATH}.leaseTtl: {lease_above_record}")]
    );
    assert!(idempotency(json!({"recordTtl": "10s", "leaseTtl": "10s"})).is_ok());

    // Retrying a completion for less than a lease frees nothing sooner: a warning.
    let warned = |fields: Value| warnings(&ok(&with(IP, Some(fields))));
    assert_eq!(
        warned(json!({"completionRetryTimeout": "5s"})),
        vec![format!(
            "{IP_PATH}.completionRetryTimeout: completionRetryTimeout (5s) is shorter than \
             leaseTtl (10s): the lease keeps the record in flight while the outcome is \
             retried and until it ends, so giving up sooner frees nothing and rides out \
             shorter store outages"
        )]
    );
    assert_eq!(
        warned(json!({"leaseTtl": "120s"})),
        vec![format!(
            "{IP_PATH}.leaseTtl: completionRetryTimeout (60s) is shorter than leaseTtl \
             (120s): the lease keeps the record in flight while the outcome is retried and \
             until it ends, so giving up sooner frees nothing and rides out shorter store \
             outages"
        )]
    );
    assert!(warned(json!({"completionRetryTimeout": "10s"})).is_empty());

    // A field with an error of its own is not compared with the others.
    assert_eq!(
        idempotency(json!({"recordTtl": "1s", "leaseTtl": "ten"})),
        Err(vec![format!(
            "{IP_PATH}.leaseTtl: must be a proto3 JSON duration such as \"1.5s\": {}",
            parse_duration("ten").unwrap_err()
        )])
    );
}

#[test]
fn idempotency_request_framing() {
    let p = idempotency(json!({})).unwrap();
    assert_eq!(p.accept_compressed, CompressionSet::EMPTY, "identity only");
    assert_eq!(p.max_request_frames, 65_536);
    let p = idempotency(json!({
        "acceptCompressed": ["gzip", "deflate", "gzip"], "maxRequestFrames": 16
    }))
    .unwrap();
    assert_eq!(
        p.accept_compressed,
        CompressionSet::EMPTY
            .with(Compression::Gzip)
            .with(Compression::Deflate)
    );
    assert_eq!(p.accept_compressed.iter().count(), 2);
    assert_eq!(p.max_request_frames, 16);
    let rule = r#"must be "gzip" or "deflate" (the request encodings idem can decode)"#;
    assert_eq!(
        idempotency(json!({"acceptCompressed": ["zstd", "gzip", "GZIP", 1]})),
        Err(vec![
            format!("{IP_PATH}.acceptCompressed[0]: {rule}"),
            format!("{IP_PATH}.acceptCompressed[2]: {rule}"),
            format!("{IP_PATH}.acceptCompressed[3]: {rule}"),
        ])
    );
}

#[test]
fn idempotency_code_lists() {
    use Code::*;
    // Only cacheable: release is its complement.
    let p = idempotency(json!({"cacheableStatusCodes": ["OK", "INTERNAL"]})).unwrap();
    assert_eq!(p.cacheable_status_codes, CodeSet::of(Ok).with(Internal));
    assert_eq!(
        p.release_status_codes,
        CodeSet::of(Ok).with(Internal).complement()
    );
    // Only release: cacheable is its complement.
    let p = idempotency(json!({"releaseStatusCodes": ["UNAVAILABLE"]})).unwrap();
    assert_eq!(p.release_status_codes, CodeSet::of(Unavailable));
    assert_eq!(
        p.cacheable_status_codes,
        CodeSet::of(Unavailable).complement()
    );
    // Both, disjoint and covering everything.
    let cached: Vec<&str> = [
        "OK",
        "UNKNOWN",
        "DEADLINE_EXCEEDED",
        "INTERNAL",
        "DATA_LOSS",
    ]
    .into();
    let released: Vec<String> = IdempotencyPolicy::DEFAULT_CACHEABLE
        .complement()
        .iter()
        .map(|c| crate::code::code_name(c).to_owned())
        .collect();
    let parsed = ok(&with(
        IP,
        Some(json!({"cacheableStatusCodes": cached, "releaseStatusCodes": released})),
    ));
    assert!(parsed.warnings.is_empty(), "{:?}", warnings(&parsed));
    // Both, overlapping: an error at the repeated code.
    assert_eq!(
        idempotency(
            json!({"cacheableStatusCodes": ["OK", "UNAVAILABLE"], "releaseStatusCodes": ["ABORTED", "UNAVAILABLE"]})
        ),
        Err(vec![format!(
            "{IP_PATH}.releaseStatusCodes[1]: UNAVAILABLE is also in cacheableStatusCodes"
        )])
    );
    // Both, with codes in neither: cached, with a warning.
    let parsed = ok(&with(
        IP,
        Some(
            json!({"cacheableStatusCodes": ["OK"], "releaseStatusCodes": ["UNAVAILABLE", "ABORTED"]}),
        ),
    ));
    let p = create_order(&parsed).idempotency().unwrap();
    assert_eq!(
        p.release_status_codes,
        CodeSet::of(Unavailable).with(Aborted)
    );
    assert_eq!(
        p.cacheable_status_codes,
        p.release_status_codes.complement()
    );
    assert_eq!(
        warnings(&parsed),
        vec![format!(
            "{IP_PATH}.releaseStatusCodes: CANCELLED, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED, RESOURCE_EXHAUSTED, FAILED_PRECONDITION, OUT_OF_RANGE, UNIMPLEMENTED, INTERNAL, DATA_LOSS, UNAUTHENTICATED in neither list, so cached"
        )]
    );
    // Releasing OK is allowed but dangerous.
    let parsed = ok(&with(IP, Some(json!({"releaseStatusCodes": ["OK"]}))));
    assert_eq!(
        warnings(&parsed),
        vec![format!(
            "{IP_PATH}: OK releases the record: a retry after a success runs the handler again"
        )]
    );
    // Element errors carry their index.
    assert_eq!(
        idempotency(json!({"cacheableStatusCodes": ["OK", "FINE"]})),
        Err(vec![format!(
            r#"{IP_PATH}.cacheableStatusCodes[1]: must be a status code name such as "UNAVAILABLE" or an integer 0..=16"#
        )])
    );
}

// ---- idem --------------------------------------------------------------------------------

fn settings(fields: Value) -> Result<(IdemSettings, Vec<String>), Vec<String>> {
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
fn assert_settings_errors(field: &str, bad: &[(Value, impl ToString)]) {
    for (value, message) in bad {
        assert_eq!(
            settings(json!({ field: value })),
            Err(vec![message.to_string()]),
            "{field}: {value}"
        );
    }
}

#[test]
fn idem_key_header() {
    let (s, _) = settings(json!({"keyHeader": "x-request-key"})).unwrap();
    assert_eq!(s.key_header.as_str(), "x-request-key");
    let bad = [
        (
            json!("X-Request-Key"),
            r#"must be lower case: write "x-request-key""#,
        ),
        (
            json!("grpc-key"),
            r#"must not start with "grpc-" (reserved by gRPC)"#,
        ),
        (
            json!("x-key-bin"),
            r#"must not end in "-bin" (binary metadata)"#,
        ),
        (json!("te"), "is reserved by HTTP/2 or gRPC"),
        (
            json!("bad header"),
            "must be a valid header name (letters, digits, '-', '_', '.')",
        ),
        (
            json!(""),
            "must be a valid header name (letters, digits, '-', '_', '.')",
        ),
        (
            json!(":path"),
            "must be a valid header name (letters, digits, '-', '_', '.')",
        ),
        (json!(5), "must be a header name string, not a number"),
    ];
    for (value, message) in bad {
        assert_eq!(
            settings(json!({"keyHeader": value})),
            Err(vec![format!("idem.keyHeader: {message}")]),
            "{value}"
        );
    }
}

#[test]
fn idem_tenant() {
    assert_eq!(
        settings(json!({"tenant": {"single": "acme"}}))
            .unwrap()
            .0
            .tenant,
        TenantSource::Single("acme".into())
    );
    let (s, w) = settings(json!({"tenant": {"header": "x-tenant-id"}})).unwrap();
    assert_eq!(
        s.tenant,
        TenantSource::Header(http::HeaderName::from_static("x-tenant-id"))
    );
    assert_eq!(
        w,
        vec![
            "idem.tenant.header: trusts a client-sent header: only safe behind a proxy that sets or strips it"
        ]
    );
    assert_eq!(
        settings(json!({"tenant": null})).unwrap().0.tenant,
        TenantSource::Unset
    );
    let bad = [
        (
            json!({}),
            "idem.tenant: must have exactly one of \"single\" or \"header\"",
        ),
        (
            json!({"single": "a", "header": "x-t"}),
            "idem.tenant: must have exactly one of \"single\" or \"header\"",
        ),
        (
            json!({"single": ""}),
            "idem.tenant.single: must be a non-empty string, not a string",
        ),
        (
            json!({"single": 7}),
            "idem.tenant.single: must be a non-empty string, not a number",
        ),
        (
            json!({"header": "grpc-tenant"}),
            "idem.tenant.header: must not start with \"grpc-\" (reserved by gRPC)",
        ),
        (
            json!({"header": "x-idempotency-key"}),
            "idem.tenant.header: must differ from keyHeader",
        ),
        (
            json!("acme"),
            "idem.tenant: must be a JSON object, not a string",
        ),
    ];
    assert_settings_errors("tenant", &bad);
}

#[test]
fn idem_memory_store() {
    let (s, _) = settings(
        json!({"memoryStore": {"maxEntries": 10, "maxBytes": 4096, "maxInFlightPerTenant": 2,
               "maxEntriesPerTenant": 5, "maxBytesPerTenant": 2048, "sweepInterval": "0.5s",
               "minRetention": "90s"}}),
    )
    .unwrap();
    assert_eq!(
        s.memory_store,
        MemoryStoreSettings {
            max_entries: 10,
            max_bytes: 4096,
            max_in_flight_per_tenant: Some(2),
            max_entries_per_tenant: Some(5),
            max_bytes_per_tenant: Some(2048),
            sweep_interval: Duration::from_millis(500),
            min_retention: Duration::from_secs(90),
        }
    );
    // minRetention: 10 minutes by default; zero (evict any completed record at a
    // bound) is allowed.
    let (s, _) = settings(json!({"memoryStore": {}})).unwrap();
    assert_eq!(s.memory_store.min_retention, Duration::from_secs(600));
    let (s, w) = settings(json!({"memoryStore": {"minRetention": "0s"}})).unwrap();
    assert!(w.is_empty(), "{w:?}");
    assert_eq!(s.memory_store.min_retention, Duration::ZERO);
    let (s, _) = settings(json!({"memoryStore": {"minRetention": "86400s"}})).unwrap();
    assert_eq!(s.memory_store.min_retention, Duration::from_secs(86_400));
    // Absent per-tenant bounds are a share of the store-wide ones.
    let (s, w) = settings(json!({"memoryStore": {"maxEntries": 1600, "maxBytes": 4096}})).unwrap();
    assert!(w.is_empty(), "{w:?}");
    assert_eq!(
        (
            s.memory_store.tenant_in_flight_bound(),
            s.memory_store.tenant_entries_bound(),
            s.memory_store.tenant_bytes_bound()
        ),
        (100, 400, 1024)
    );
    // The retired tombstoneTtl and per-tenant bounds above the store's are warnings.
    let (s, w) = settings(json!({"memoryStore": {"maxEntries": 10, "maxEntriesPerTenant": 20, "tombstoneTtl": "60s"}})).unwrap();
    assert_eq!(s.memory_store.tenant_entries_bound(), 10);
    assert_eq!(
        w,
        vec![
            "idem.memoryStore.tombstoneTtl: no longer used: a released record is removed, and \
             an in-flight record whose lease ended is dropped one lease later"
                .to_owned(),
            "idem.memoryStore.maxEntriesPerTenant: is above the store-wide bound (10); the \
             store-wide bound applies"
                .to_owned(),
        ]
    );
    let (s, _) = settings(json!({"memoryStore": {"maxEntries": 10}})).unwrap();
    assert_eq!(
        s.memory_store.max_bytes,
        MemoryStoreSettings::default().max_bytes
    );
    // The largest bounds that can be allocated are accepted.
    let (s, _) = settings(json!({"memoryStore": {"maxEntries": 4_294_967_296_u64,
        "maxBytes": 281_474_976_710_656_u64, "sweepInterval": "0.001s"}}))
    .unwrap();
    assert_eq!(s.memory_store.max_entries, 1 << 32);
    assert_eq!(s.memory_store.sweep_interval, Duration::from_millis(1));
    let bad = [
        (
            json!({"maxEntries": 0}),
            "idem.memoryStore.maxEntries: must be an integer > 0",
        ),
        (
            json!({"maxBytes": -1}),
            "idem.memoryStore.maxBytes: must be an integer > 0",
        ),
        (
            json!({"sweepInterval": "0s"}),
            "idem.memoryStore.sweepInterval: must be a duration > 0",
        ),
        (
            json!({"sweepInterval": "0.0005s"}),
            "idem.memoryStore.sweepInterval: must be at least 0.001s: tokio's timers tick in \
             milliseconds",
        ),
        (
            json!({"maxEntries": 4_294_967_297_u64}),
            "idem.memoryStore.maxEntries: must be at most 4294967296: a bound no process can \
             reach bounds nothing",
        ),
        (
            json!({"maxBytes": 281_474_976_710_657_u64}),
            "idem.memoryStore.maxBytes: must be at most 281474976710656 (the address space \
             of this machine's processes): a bound no process can reach bounds nothing",
        ),
        (
            json!({"minRetention": "-1s"}),
            "idem.memoryStore.minRetention: must be a proto3 JSON duration such as \"1.5s\": must not have a sign",
        ),
        (
            json!({"minRetention": 600}),
            "idem.memoryStore.minRetention: must be a duration string such as \"1.5s\", not a number",
        ),
    ];
    assert_settings_errors("memoryStore", &bad);
}

#[test]
fn idem_redis() {
    let (s, _) = settings(json!({"redis": {"url": "redis://127.0.0.1:6379/0"}})).unwrap();
    assert_eq!(
        s.redis,
        Some(RedisSettings {
            url: "redis://127.0.0.1:6379/0".into(),
            key_prefix: "idem:".into(),
            command_timeout: Duration::from_millis(500),
            connect_timeout: Duration::from_secs(2),
            max_in_flight_per_tenant: Some(1000),
            cluster_nodes: vec![],
            replica_acks: 0,
            replica_ack_timeout: Duration::from_millis(100),
        })
    );
    let quota = |v: serde_json::Value| {
        settings(json!({"redis": {"url": "redis://c", "maxInFlightPerTenant": v}}))
            .map(|(s, _)| s.redis.unwrap().max_in_flight_per_tenant)
    };
    assert_eq!(quota(json!(16)), Ok(Some(16)));
    assert_eq!(quota(json!(0)), Ok(None), "0: no per-tenant bound");
    assert_eq!(
        quota(json!(-1)),
        Err(vec![
            "idem.redis.maxInFlightPerTenant: must be an integer >= 0 (0: no per-tenant bound)"
                .to_owned()
        ])
    );
    let (s, _) = settings(json!({"redis": {"url": "rediss://cache:6380", "keyPrefix": "shop:", "commandTimeout": "0.2s", "connectTimeout": "1s"}})).unwrap();
    let r = s.redis.unwrap();
    assert_eq!(
        (r.key_prefix.as_str(), r.command_timeout, r.connect_timeout),
        ("shop:", Duration::from_millis(200), Duration::from_secs(1))
    );
    let url_rule = "must be a redis://, rediss://, redis+unix:// or unix:// URL";
    let bad = [
        (
            json!({}),
            format!("idem.redis.url: is required (or clusterNodes) and {url_rule}"),
        ),
        (
            json!({"url": "http://cache"}),
            format!("idem.redis.url: {url_rule}"),
        ),
        (
            json!({"url": "redis://"}),
            format!("idem.redis.url: {url_rule}"),
        ),
        (
            json!({"url": "redis://c", "commandTimeout": "0s"}),
            "idem.redis.commandTimeout: must be a duration > 0".to_owned(),
        ),
        (
            json!({"url": "redis://c", "keyPrefix": 1}),
            "idem.redis.keyPrefix: must be a string, not a number".to_owned(),
        ),
        (
            json!({"url": "redis://c", "clusterNodes": ["redis://a:7000"]}),
            "idem.redis.url: must not be given with clusterNodes (one endpoint, or a cluster)"
                .to_owned(),
        ),
        (
            json!({"clusterNodes": []}),
            "idem.redis.clusterNodes: must be a non-empty array of redis:// URLs (Redis Cluster seed nodes)"
                .to_owned(),
        ),
        (
            json!({"clusterNodes": ["redis://a:7000", "unix:///tmp/s"]}),
            "idem.redis.clusterNodes[1]: must be a redis:// or rediss:// URL".to_owned(),
        ),
        (
            json!({"url": "redis://c", "replicaAcks": -1}),
            "idem.redis.replicaAcks: must be an integer in 0..=1000 (0: no confirmation)"
                .to_owned(),
        ),
        (
            json!({"url": "redis://c", "replicaAcks": 1, "replicaAckTimeout": "0.5s"}),
            "idem.redis.replicaAckTimeout: must be shorter than commandTimeout (WAIT runs within a command)"
                .to_owned(),
        ),
    ];
    assert_settings_errors("redis", &bad);
    // Two bad nodes: both named.
    assert_eq!(
        settings(json!({"redis": {"clusterNodes": ["http://a", "redis://b:1", 7]}})),
        Err(vec![
            "idem.redis.clusterNodes[0]: must be a redis:// or rediss:// URL".to_owned(),
            "idem.redis.clusterNodes[2]: must be a redis:// or rediss:// URL".to_owned(),
        ])
    );
    let (s, _) = settings(json!({"redis": {"clusterNodes": ["redis://10.0.0.1:7000", "rediss://10.0.0.2:7000"], "replicaAcks": 1, "replicaAckTimeout": "0.05s"}})).unwrap();
    let r = s.redis.unwrap();
    assert_eq!(r.url, "");
    assert_eq!(
        r.cluster_nodes,
        vec!["redis://10.0.0.1:7000", "rediss://10.0.0.2:7000"]
    );
    assert_eq!(
        (r.replica_acks, r.replica_ack_timeout),
        (1, Duration::from_millis(50))
    );
}

#[test]
fn idem_client() {
    let (s, w) = settings(json!({"client": {"keyAllMethods": true, "maxReplayBytesPerCall": 1024, "maxReplayBytesTotal": 4096, "minAttemptTime": "0.01s", "retryExhaustedPushback": false, "noRetryUnderRetriedInbound": true}})).unwrap();
    assert!(w.is_empty());
    assert_eq!(
        s.client,
        ClientSettings {
            key_all_methods: true,
            max_replay_bytes_per_call: 1024,
            max_replay_bytes_total: 4096,
            min_attempt_time: Duration::from_millis(10),
            retry_exhausted_pushback: false,
            no_retry_under_retried_inbound: true,
        }
    );
    let (_, w) = settings(json!({"client": {"maxReplayBytesTotal": 1024}})).unwrap();
    assert_eq!(
        w,
        vec![
            "idem.client.maxReplayBytesTotal: is less than maxReplayBytesPerCall: calls between the two are never retried"
        ]
    );
    let bad = [
        (
            json!({"maxReplayBytesPerCall": 0}),
            "idem.client.maxReplayBytesPerCall: must be an integer > 0",
        ),
        (
            json!({"keyAllMethods": "true"}),
            "idem.client.keyAllMethods: must be true or false, not a string",
        ),
        (
            json!({"minAttemptTime": "1"}),
            r#"idem.client.minAttemptTime: must be a proto3 JSON duration such as "1.5s": must end in "s" (seconds is the only unit)"#,
        ),
    ];
    assert_settings_errors("client", &bad);
}

#[test]
fn idem_must_be_an_object() {
    assert_eq!(
        settings(json!([])),
        Err(vec!["idem: must be a JSON object, not an array".to_owned()])
    );
    assert_eq!(
        ok(&with("/idem", None)).config.settings(),
        &IdemSettings::default()
    );
}

// ---- durations inside documents ----------------------------------------------------------

#[test]
fn duration_boundaries_in_a_document() {
    let at = |v: &str| with("/methodConfig/0/timeout", Some(json!(v)));
    let timeout = |text: &str| create_order(&ok(text)).timeout().unwrap();
    assert_eq!(timeout(&at("0.123456789s")), Duration::new(0, 123_456_789));
    assert_eq!(
        timeout(&at("315576000000s")),
        Duration::from_secs(315_576_000_000)
    );
    let p = ok(&at("315576000000s"));
    assert_eq!(
        warnings(&p),
        vec![
            "methodConfig[0].timeout: grpc-go refuses durations above 9223372036s (it keeps int64 nanoseconds)"
        ]
    );
    let refused = [
        ("0.1234567891s", "must have at most 9 fractional digits"),
        ("315576000001s", "must be at most 315576000000s"),
        ("-1s", "must not have a sign"),
        ("1ms", "must end in \"s\" (seconds is the only unit)"),
        ("1", "must end in \"s\" (seconds is the only unit)"),
        ("s", "must have a digit before the decimal point"),
        (" 1s", "must be digits with an optional decimal point"),
        ("1.s", "must have a digit after the decimal point"),
    ];
    for (text, why) in refused {
        assert_eq!(
            errors(&at(text)),
            vec![format!(
                r#"methodConfig[0].timeout: must be a proto3 JSON duration such as "1.5s": {why}"#
            )],
            "{text:?}"
        );
    }
}

// ---- never panics ------------------------------------------------------------------------

/// Field names the parser knows (each once), so generated objects reach its deeper
/// readers.
fn keys() -> Vec<&'static str> {
    let mut keys: Vec<&'static str> = parse::FIELD_LISTS
        .iter()
        .flat_map(|l| l.iter().copied())
        .collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        (0u64..20).prop_map(|n| json!(n)),
        "[0-9]{0,14}(\\.[0-9]{0,11})?s?".prop_map(Value::String),
        "(UNAVAILABLE|unavailable|OK|WAIT|ABORT|x-[a-z]{1,8}|redis://h|)".prop_map(Value::String),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(6, 96, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec(
                (
                    prop_oneof![
                        prop::sample::select(keys()).prop_map(str::to_owned),
                        any::<String>()
                    ],
                    inner
                ),
                0..8
            )
            .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_json_never_panics(v in arb_json()) {
        check_outcome(&v.to_string());
        // Also as the body of a method config and of each object idem reads.
        let wrapped = json!({"methodConfig": [v.clone(), {"name": [{"service": "s"}], "retryPolicy": v.clone(), "idempotency": v.clone()}], "retryThrottling": v.clone(), "idem": v});
        check_outcome(&wrapped.to_string());
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        check_outcome(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn arbitrary_durations_never_panic(s in "\\PC{0,24}") {
        if let Ok(d) = parse_duration(&s) {
            prop_assert!(d.as_secs() <= MAX_DURATION_SECONDS);
            prop_assert_eq!(parse_duration(&format_duration(d)), Ok(d));
        }
    }
}

/// Whatever the outcome, it is consistent: errors are never empty, attempts within 2..=5.
fn check_outcome(text: &str) {
    match ServiceConfig::from_json_with_warnings(text) {
        Ok(p) => {
            for mc in p.config.method_configs() {
                if let Some(r) = mc.retry_policy() {
                    assert!((2..=5).contains(&r.max_attempts()));
                }
                if let Some(h) = mc.hedging_policy() {
                    assert!((2..=5).contains(&h.max_attempts));
                }
                assert!(!(mc.retry_policy().is_some() && mc.hedging_policy().is_some()));
            }
            if let Some(t) = p.config.retry_throttling() {
                assert!((1000..=1_000_000).contains(&t.max_milli_tokens));
                assert!(t.token_ratio_milli > 0);
            }
        }
        Err(ConfigError::Invalid { errors, .. }) => assert!(!errors.is_empty()),
        Err(ConfigError::Json { line, .. }) => assert!(line >= 1),
        Err(e @ ConfigError::Read { .. }) => panic!("no file was read: {e}"),
    }
}

#[test]
fn repeated_json_keys_are_errors() {
    // C-core refuses a document with a repeated key; grpc-go and grpc-java keep the last.
    let text = r#"{"methodConfig": [{"name": [{"service": "s"}],
        "retryPolicy": {"maxAttempts": 2, "maxAttempts": 3, "initialBackoff": "1s",
          "maxBackoff": "1s", "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}}],
        "idem": {}, "idem": {}}"#;
    assert_eq!(
        errors(text),
        vec![
            "methodConfig[0].retryPolicy.maxAttempts: duplicate key: C-core refuses the document (grpc-go and grpc-java keep the last value)",
            "idem: duplicate key: C-core refuses the document (grpc-go and grpc-java keep the last value)",
        ]
    );
    // Equal keys in different objects are fine.
    ok(r#"{"methodConfig": [{"name": [{"service": "a"}]}, {"name": [{"service": "b"}]}]}"#);
}

#[test]
fn an_entry_whose_names_are_all_refused_gets_errors_not_the_no_names_warning() {
    match parse(r#"{"methodConfig":[{"name":[{"method":"m"}]}]}"#) {
        Err(ConfigError::Invalid { errors, warnings }) => {
            assert_eq!(errors.len(), 1);
            assert!(warnings.is_empty(), "{warnings:?}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn from_file_names_the_path_it_cannot_read() {
    let e = ServiceConfig::from_file("no/such/service_config.json").unwrap_err();
    assert!(matches!(e, ConfigError::Read { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.starts_with("cannot read the service config no/such/service_config.json: "),
        "{text}"
    );
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/service_config.json"
    );
    let config = ServiceConfig::from_file(example).expect("the example config");
    assert!(config.lookup("shop.v1.Orders", "CreateOrder").is_some());
}

#[test]
fn config_errors_debug_as_sentences() {
    let e = ServiceConfig::from_json_with_warnings(r#"{"methodConfig": [{"name": [{"service": "s"}], "timeout": "1m"}, {"name": [{"service": "", "method": "m"}]}]}"#)
        .unwrap_err();
    let debug = format!("{e:?}");
    assert!(
        debug.starts_with("2 error(s) in service config:\n  methodConfig[0].timeout: "),
        "{debug}"
    );
    assert!(debug.contains("\n  methodConfig[1].name[0]"), "{debug}");
    assert!(!debug.contains("Diagnostic"), "{debug}");
    let e = ServiceConfig::from_json_with_warnings("{").unwrap_err();
    assert!(
        format!("{e:?}").starts_with("invalid JSON at line 1"),
        "{e:?}"
    );
}
