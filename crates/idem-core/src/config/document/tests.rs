//! Tests of the whole document: its shape, lookup by method, a file, and arbitrary input
//! (never a panic).

use std::time::Duration;

use proptest::prelude::*;
use serde_json::{Value, json};

use crate::code::{Code, CodeSet};
use crate::config::fixtures::*;
use crate::config::*;

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

// ---- never panics ------------------------------------------------------------------------

/// Field names the parser knows (each once), so generated objects reach its deeper
/// readers.
fn keys() -> Vec<&'static str> {
    let mut keys: Vec<&'static str> = FIELD_LISTS.iter().flat_map(|l| l.iter().copied()).collect();
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
fn from_file_names_the_path_it_cannot_read() {
    let e = ServiceConfig::from_file("no/such/service_config.json").unwrap_err();
    assert!(matches!(e, ConfigError::Read { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.starts_with("cannot read the service config no/such/service_config.json: "),
        "{text}"
    );
    // The directory cargo gives the test when it runs it (a test binary reused from a
    // build in another checkout carries that checkout's path).
    let dir = std::env::var("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_owned());
    let example = format!("{dir}/../../examples/service_config.json");
    let config = ServiceConfig::from_file(example).expect("the example config");
    assert!(config.lookup("shop.v1.Orders", "CreateOrder").is_some());
}
