use crate::config::{ConfigError, ParseOptions, ServiceConfig};
use crate::descriptor::{Descriptors, IdempotencyLevel, Streaming};

/// `payments.v1.Payments`: one method of each level and streaming kind that matters.
fn payments() -> Descriptors {
    use IdempotencyLevel::*;
    Descriptors::default()
        .with_service(
            "payments.v1.Payments",
            [
                ("Charge".to_owned(), IdempotencyUnknown, Streaming::Unary),
                ("GetCharge".to_owned(), NoSideEffects, Streaming::Unary),
                ("Refund".to_owned(), Idempotent, Streaming::Unary),
                ("Upload".to_owned(), IdempotencyUnknown, Streaming::Client),
                ("Chat".to_owned(), IdempotencyUnknown, Streaming::Bidi),
            ],
        )
        .unwrap()
}

fn with_d(text: &str) -> Result<crate::config::Parsed, ConfigError> {
    ServiceConfig::from_json_with_options(text, &ParseOptions::new().descriptors(payments()))
}

fn errors(text: &str) -> Vec<String> {
    match with_d(text) {
        Err(ConfigError::Invalid { errors, .. }) => errors.iter().map(|e| e.to_string()).collect(),
        other => panic!("expected errors, got {other:?}"),
    }
}

const CHARGE_TYPO: &str = r#"{"methodConfig": [{"name": [{"service": "payments.v1.Payments", "method": "Charg"}], "idempotency": {}}]}"#;
const SERVICE_TYPO: &str = r#"{"methodConfig": [{"name": [{"service": "payment.v1.Payments", "method": "Charge"}], "idempotency": {}}]}"#;
const FIELD_TYPO: &str = r#"{"methodConfig": [{"name": [{"service": "payments.v1.Payments", "method": "Charge"}], "idempotence": {}}]}"#;

#[test]
fn a_method_typo_is_an_error_naming_the_real_method() {
    assert_eq!(
        errors(CHARGE_TYPO),
        [
            "methodConfig[0].name[0]: no method `payments.v1.Payments/Charg` in the descriptors; did you mean `payments.v1.Payments/Charge`?"
        ]
    );
}

#[test]
fn a_service_typo_is_an_error_naming_the_real_method() {
    assert_eq!(
        errors(SERVICE_TYPO),
        [
            "methodConfig[0].name[0]: no service `payment.v1.Payments` in the descriptors; did you mean `payments.v1.Payments/Charge`?"
        ]
    );
}

#[test]
fn a_field_typo_is_an_error_with_descriptors_and_a_warning_without() {
    let e = errors(FIELD_TYPO);
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].starts_with(
            "methodConfig[0].idempotence: unknown field, ignored; did you mean \"idempotency\"?"
        ),
        "{e:?}"
    );
    let parsed = ServiceConfig::from_json_with_warnings(FIELD_TYPO).unwrap();
    assert_eq!(
        parsed.warnings[0].to_string(),
        "methodConfig[0].idempotence: unknown field, ignored; did you mean \"idempotency\"?"
    );
}

/// With descriptors a near-miss field is reported once, as the error: the parser's
/// warning for it is not repeated beside it.
#[test]
fn a_field_typo_with_descriptors_is_not_also_a_warning() {
    match with_d(FIELD_TYPO) {
        Err(ConfigError::Invalid { errors, warnings }) => {
            assert_eq!(errors.len(), 1, "{errors:?}");
            assert!(
                warnings.iter().all(|w| w.path != errors[0].path),
                "the typo is an error only: {warnings:?}"
            );
        }
        other => panic!("expected errors, got {other:?}"),
    }
}

#[test]
fn the_issues_field_typos_get_did_you_mean() {
    let parsed = ServiceConfig::from_json_with_warnings(
        r#"{"methodConfig": [{"name": [{"service": "s"}], "retryPolicies": {},
            "hedgingPolicy": {"maxAttempts": 2, "maxAttempt": 2}}], "methodConfigs": []}"#,
    )
    .unwrap();
    let text: Vec<String> = parsed.warnings.iter().map(ToString::to_string).collect();
    let text = text.join("\n");
    assert!(
        text.contains("methodConfigs: not read; did you mean \"methodConfig\"?"),
        "{text}"
    );
    assert!(
        text.contains("retryPolicies: unknown field, ignored; did you mean \"retryPolicy\"?"),
        "{text}"
    );
    assert!(
        text.contains("maxAttempt: unknown field, ignored; did you mean \"maxAttempts\"?"),
        "{text}"
    );
}

#[test]
fn an_unconfigured_side_effecting_method_is_protected_key_optional() {
    let parsed = with_d(r#"{"methodConfig": []}"#).unwrap();
    let c = &parsed.config;
    let charge = c.lookup("payments.v1.Payments", "Charge").unwrap();
    let p = charge.idempotency().unwrap();
    assert!(!p.key_required);
    assert!(
        c.lookup("payments.v1.Payments", "Upload")
            .unwrap()
            .idempotency()
            .is_some()
    );
    // Safe levels and bidi are left alone.
    for m in ["GetCharge", "Refund", "Chat"] {
        assert!(c.lookup("payments.v1.Payments", m).is_none(), "{m}");
    }
    assert!(parsed.warnings.is_empty());
}

#[test]
fn a_service_entry_is_inherited_and_protected_per_method() {
    let parsed = with_d(
        r#"{"methodConfig": [{"name": [{"service": "payments.v1.Payments"}], "timeout": "2s",
            "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s",
            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}"#,
    )
    .unwrap();
    let c = &parsed.config;
    let charge = c.lookup("payments.v1.Payments", "Charge").unwrap();
    assert!(charge.idempotency().is_some_and(|p| !p.key_required));
    assert_eq!(charge.retry_policy().unwrap().max_attempts(), 3);
    assert_eq!(charge.timeout(), Some(std::time::Duration::from_secs(2)));
    let get = c.lookup("payments.v1.Payments", "GetCharge").unwrap();
    assert!(get.idempotency().is_none() && get.retry_policy().is_some());
}

#[test]
fn the_configs_own_idempotency_wins() {
    let parsed = with_d(
        r#"{"methodConfig": [{"name": [{"service": "payments.v1.Payments", "method": "Charge"}],
            "idempotency": {"keyRequired": true, "leaseTtl": "5s"}}]}"#,
    )
    .unwrap();
    let p = parsed
        .config
        .lookup("payments.v1.Payments", "Charge")
        .unwrap()
        .idempotency()
        .unwrap()
        .clone();
    assert!(p.key_required);
    assert_eq!(p.lease_ttl, std::time::Duration::from_secs(5));
}

#[test]
fn an_opt_out_is_a_warning_and_refuses_retries() {
    let parsed = with_d(
        r#"{"methodConfig": [{"name": [{"service": "payments.v1.Payments", "method": "Charge"}],
            "idempotency": false}]}"#,
    )
    .unwrap();
    assert!(
        parsed
            .config
            .lookup("payments.v1.Payments", "Charge")
            .unwrap()
            .idempotency()
            .is_none()
    );
    assert_eq!(parsed.warnings.len(), 1);
    assert!(
        parsed.warnings[0].to_string().starts_with(
            "methodConfig[0].idempotency: payments.v1.Payments/Charge has side effects"
        )
    );

    let e = errors(
        r#"{"methodConfig": [{"name": [{"service": "payments.v1.Payments", "method": "Charge"}],
            "idempotency": false, "hedgingPolicy": {"maxAttempts": 2}}]}"#,
    );
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].starts_with("methodConfig[0].hedgingPolicy: payments.v1.Payments/Charge has side effects and is opted out"), "{e:?}");
}

#[test]
fn only_no_side_effects_may_be_hedged_unprotected() {
    let hedged = |m: &str| {
        format!(
            r#"{{"methodConfig": [{{"name": [{{"service": "payments.v1.Payments", "method": "{m}"}}], "hedgingPolicy": {{"maxAttempts": 2}}}}]}}"#
        )
    };
    assert!(with_d(&hedged("GetCharge")).is_ok());
    let e = errors(&hedged("Refund"));
    assert!(
        e[0].contains("is IDEMPOTENT: only NO_SIDE_EFFECTS methods may be hedged"),
        "{e:?}"
    );
    // A side-effecting method is protected by its level, so its hedges share a key.
    let c = with_d(&hedged("Charge")).unwrap().config;
    assert!(
        c.lookup("payments.v1.Payments", "Charge")
            .unwrap()
            .idempotency()
            .is_some()
    );
}

#[test]
fn bidi_is_never_protected() {
    let e = errors(
        r#"{"methodConfig": [{"name": [{"service": "payments.v1.Payments", "method": "Chat"}], "idempotency": {}}]}"#,
    );
    assert!(
        e[0].starts_with(
            "methodConfig[0].idempotency: payments.v1.Payments/Chat is bidirectional streaming"
        ),
        "{e:?}"
    );
    let parsed = with_d(
        r#"{"methodConfig": [{"name": [{"service": "payments.v1.Payments"}], "idempotency": {}}]}"#,
    )
    .unwrap();
    assert!(
        parsed
            .config
            .lookup("payments.v1.Payments", "Chat")
            .unwrap()
            .idempotency()
            .is_none()
    );
    assert!(
        parsed
            .config
            .lookup("payments.v1.Payments", "Charge")
            .unwrap()
            .idempotency()
            .is_some()
    );
    assert!(
        parsed
            .notes
            .iter()
            .any(|n| n.message.contains("Chat: bidirectional")
                || n.message.contains("to payments.v1.Payments/Chat")),
        "{:?}",
        parsed.notes
    );
}

#[test]
fn strict_turns_warnings_into_errors() {
    let text = r#"{"methodConfig": [{"name": [{"service": "s"}], "timeout": "0s"}]}"#;
    assert!(ServiceConfig::from_json(text).is_ok());
    let strict = ServiceConfig::from_json_with_options(text, &ParseOptions::new().strict(true));
    assert!(
        matches!(&strict, Err(ConfigError::Invalid { errors, .. }) if errors[0].message.ends_with("(an error in strict mode)")),
        "{strict:?}"
    );
    let in_file = r#"{"methodConfig": [{"name": [{"service": "s"}], "timeout": "0s"}], "idem": {"strict": true}}"#;
    assert!(ServiceConfig::from_json(in_file).is_err());
    assert!(ServiceConfig::from_json(r#"{"idem": {"strict": true}}"#).is_ok());
}

#[test]
fn method_policies_follow_the_descriptors() {
    let c = with_d(r#"{"methodConfig": [{"name": [{"service": "payments.v1.Payments", "method": "GetCharge"}], "hedgingPolicy": {"maxAttempts": 3}}]}"#)
        .unwrap()
        .config;
    let got: Vec<_> = c
        .method_policies()
        .into_iter()
        .map(|p| {
            (
                p.method,
                p.protected,
                p.key_required,
                p.hedging_policy.is_some(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("payments.v1.Payments/Charge".to_owned(), true, false, false),
            (
                "payments.v1.Payments/GetCharge".to_owned(),
                false,
                false,
                true
            ),
            (
                "payments.v1.Payments/Refund".to_owned(),
                false,
                false,
                false
            ),
            ("payments.v1.Payments/Upload".to_owned(), true, false, false),
            ("payments.v1.Payments/Chat".to_owned(), false, false, false),
        ]
    );
}

#[test]
fn applying_twice_changes_nothing() {
    let once = with_d(
        r#"{"methodConfig": [{"name": [{"service": "payments.v1.Payments"}], "timeout": "1s"}]}"#,
    )
    .unwrap()
    .config;
    let twice = once.with_descriptors(&payments()).unwrap().config;
    assert_eq!(once.method_policies(), twice.method_policies());
}

#[test]
fn idempotency_true_is_refused_with_the_two_forms() {
    let e = ServiceConfig::from_json(
        r#"{"methodConfig": [{"name": [{"service": "s"}], "idempotency": true}]}"#,
    )
    .unwrap_err();
    assert!(e.to_string().contains("or false (opts out)"), "{e}");
}
