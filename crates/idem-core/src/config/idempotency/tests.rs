//! Tests of the per-method `idempotency` object.

use std::time::Duration;

use serde_json::{Value, json};

use crate::code::{Code, CodeSet};
use crate::config::fixtures::*;
use crate::config::*;

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
        vec![format!(
            "{IP_PATH}: must be an object ({{}} protects with the defaults) or false (opts out)"
        )]
    );
    // `false` is the explicit opt-out (issue 29): unprotected, and said so.
    let out = ok(&with(IP, Some(json!(false))));
    assert!(create_order(&out).idempotency().is_none());
    assert!(create_order(&out).idempotency_opted_out());
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
