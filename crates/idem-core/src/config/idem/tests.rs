//! Tests of the process-wide `idem` object (the stores' settings: `stores/tests.rs`).

use std::time::Duration;

use serde_json::json;

use crate::config::fixtures::*;
use crate::config::*;

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
            ..ClientSettings::default()
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

#[test]
fn idem_handler_and_waiter_shares() {
    let d = IdemSettings::default();
    assert_eq!(d.max_detached_handlers, 256);
    assert_eq!(d.max_waiters, 4096);
    assert_eq!(d.effective_max_handlers_per_tenant(false), 256);
    assert_eq!(d.effective_max_handlers_per_tenant(true), 1024);
    assert_eq!(d.effective_max_waiters_per_tenant(false), 1024);
    assert_eq!(d.effective_max_waiters_per_tenant(true), 4096);
    let (s, w) = settings(json!({"maxHandlersInFlight": 8, "maxHandlersPerTenant": 3, "maxDetachedHandlers": 2, "maxWaiters": 10, "maxWaitersPerTenant": 4})).unwrap();
    assert!(w.is_empty(), "{w:?}");
    assert_eq!(
        (s.max_handlers_per_tenant, s.max_detached_handlers),
        (Some(3), 2)
    );
    assert_eq!(s.effective_max_handlers_per_tenant(true), 3, "set: kept");
    assert_eq!(s.effective_max_waiters_per_tenant(false), 4);
    let (s, w) = settings(json!({"maxHandlersInFlight": 8, "maxHandlersPerTenant": 9, "maxWaiters": 2, "maxWaitersPerTenant": 3})).unwrap();
    assert_eq!(
        w,
        vec![
            "idem.maxHandlersPerTenant: is above maxHandlersInFlight: a tenant gets at most maxHandlersInFlight",
            "idem.maxWaitersPerTenant: is above maxWaiters: a tenant gets at most maxWaiters",
        ]
    );
    assert_eq!(
        s.effective_max_handlers_per_tenant(false),
        8,
        "cut to the whole"
    );
    assert_eq!(s.effective_max_waiters_per_tenant(false), 2);
    for field in [
        "maxHandlersPerTenant",
        "maxDetachedHandlers",
        "maxWaiters",
        "maxWaitersPerTenant",
    ] {
        assert_settings_errors(
            field,
            &[(json!(0), format!("idem.{field}: must be an integer > 0"))],
        );
    }
}
