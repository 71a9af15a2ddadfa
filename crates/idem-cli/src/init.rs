//! `idem init --proto FILE... [-I DIR]...`: a starter service config for the protos'
//! services, which passes `idem check-config --strict --proto` on the same files:
//!
//! - a retry policy for every method (UNAVAILABLE, the README's backoffs: 4 attempts,
//!   0.05 s growing ×2 to 1 s);
//! - an `idempotency` object on every side-effecting method (no `idempotency_level`),
//!   bidirectional-streaming ones excepted (never protected);
//! - no hedging: check-config's notes suggest it for `NO_SIDE_EFFECTS` methods;
//! - no tenant: a warning on standard error says it is left to the user.
//!
//! Also the method table check-config prints when it has descriptors, and the JSON
//! forms of the policies both commands print.

use std::process::ExitCode;

use idem_core::config::{HedgingPolicy, RetryPolicy, ServiceConfig, format_duration};
use idem_core::descriptor::{Descriptors, MethodDescriptor, Streaming};
use serde_json::{Value, json};

use crate::check::{descriptors, value};
use crate::{UNREADABLE, err, out, table, usage_error};

/// Runs `init` with its arguments.
pub(crate) fn run(args: &[&str]) -> ExitCode {
    let (mut protos, mut includes) = (Vec::new(), Vec::new());
    let mut it = args.iter().copied();
    while let Some(arg) = it.next() {
        let parsed = if let Some(v) = value(arg, "--proto", &mut it) {
            v.map(|v| protos.push(v))
        } else if let Some(v) = value(arg, "-I", &mut it) {
            v.map(|v| includes.push(v))
        } else {
            Err(format!("init: unknown argument {arg:?}"))
        };
        if let Err(message) = parsed {
            return usage_error(&message);
        }
    }
    if protos.is_empty() {
        return usage_error("init needs at least one --proto FILE");
    }
    let d = match descriptors(&protos, &includes, None) {
        Ok(Some(d)) => d,
        Ok(None) => return usage_error("init needs at least one --proto FILE"),
        Err(message) => {
            err(&format!("idem: {message}\n"));
            return ExitCode::from(UNREADABLE);
        }
    };
    if d.is_empty() {
        err("idem: the protos define no service\n");
        return ExitCode::from(UNREADABLE);
    }
    let text = serde_json::to_string_pretty(&starter(&d)).unwrap_or_default();
    out(&format!("{text}\n"));
    err(
        "warning: the tenant source is left to you: set \"idem\": {\"tenant\": {\"single\": \
         \"name\"}} for a one-tenant service, or give the server layer a resolver in code \
         (IdempotencyLayer::tenant); until then IdempotencyLayer::check fails\n",
    );
    ExitCode::SUCCESS
}

/// The README's retry policy.
fn starter_retry() -> Value {
    json!({
        "maxAttempts": 4,
        "initialBackoff": "0.05s",
        "maxBackoff": "1s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"]
    })
}

/// One entry for the methods safe to repeat (and bidi ones), one for the
/// side-effecting ones, each naming its methods exactly.
fn starter(d: &Descriptors) -> Value {
    let name = |m: &MethodDescriptor| json!({"service": m.service(), "method": m.name()});
    let protect = |m: &&MethodDescriptor| {
        m.idempotency_level().has_side_effects() && m.streaming() != Streaming::Bidi
    };
    let (side_effects, others): (Vec<&MethodDescriptor>, Vec<&MethodDescriptor>) =
        d.methods().partition(protect);
    let mut entries = Vec::new();
    if !others.is_empty() {
        entries.push(json!({
            "name": others.iter().map(|m| name(m)).collect::<Vec<_>>(),
            "retryPolicy": starter_retry(),
        }));
    }
    if !side_effects.is_empty() {
        entries.push(json!({
            "name": side_effects.iter().map(|m| name(m)).collect::<Vec<_>>(),
            "retryPolicy": starter_retry(),
            "idempotency": {},
        }));
    }
    json!({ "methodConfig": entries })
}

/// A retry policy in its service-config form.
pub(crate) fn retry_json(r: &RetryPolicy) -> Value {
    let mut v = json!({
        "maxAttempts": r.max_attempts(),
        "initialBackoff": format_duration(r.initial_backoff()),
        "maxBackoff": format_duration(r.max_backoff()),
        "backoffMultiplier": r.backoff_multiplier(),
        "retryableStatusCodes": codes(r.retryable_status_codes()),
    });
    if let Some(t) = r.per_attempt_recv_timeout() {
        v["perAttemptRecvTimeout"] = json!(format_duration(t));
    }
    v
}

/// A hedging policy in its service-config form.
pub(crate) fn hedging_json(h: &HedgingPolicy) -> Value {
    json!({
        "maxAttempts": h.max_attempts,
        "hedgingDelay": format_duration(h.hedging_delay),
        "nonFatalStatusCodes": codes(h.non_fatal_status_codes),
    })
}

fn codes(set: idem_core::code::CodeSet) -> Value {
    set.iter().map(idem_core::code::code_name).collect()
}

/// What applies to each method of the descriptors, one row each.
pub(crate) fn methods_table(config: &ServiceConfig) -> String {
    let rows: Vec<Vec<String>> = config
        .method_policies()
        .into_iter()
        .map(|p| {
            let policy = match (&p.retry_policy, &p.hedging_policy) {
                (Some(r), _) => format!("retry x{}", r.max_attempts()),
                (None, Some(h)) => format!("hedging x{}", h.max_attempts),
                (None, None) => "none".to_owned(),
            };
            let key = match (p.protected, p.key_required) {
                (false, _) => "-",
                (true, true) => "required",
                (true, false) => "optional",
            };
            vec![
                p.method,
                p.idempotency_level.map_or("-", |l| l.name()).to_owned(),
                p.streaming.map_or("-", |s| s.name()).to_owned(),
                if p.protected { "protected" } else { "-" }.to_owned(),
                key.to_owned(),
                policy,
            ]
        })
        .collect();
    table(
        &[
            "METHOD",
            "LEVEL",
            "STREAMING",
            "IDEMPOTENCY",
            "KEY",
            "POLICY",
        ],
        &rows,
    )
}
