//! Tests of `methodConfig[]`: names, lookup and the standard per-method fields.

use std::time::Duration;

use serde_json::{Value, json};

use crate::config::fixtures::*;
use crate::config::*;

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
