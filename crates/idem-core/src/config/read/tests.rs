//! Tests of the validator's shared rules: near misses, every error at once, numbers,
//! durations, repeated keys and how errors print.

use std::time::Duration;

use serde_json::json;

use crate::config::fixtures::*;
use crate::config::*;

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
