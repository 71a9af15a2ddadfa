//! Tests of `retryPolicy`, `hedgingPolicy` and `retryThrottling`.

use std::time::Duration;

use serde_json::{Value, json};

use crate::code::{Code, CodeSet};
use crate::config::fixtures::*;
use crate::config::*;

// ---- retryPolicy -------------------------------------------------------------------------

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
