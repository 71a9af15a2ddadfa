//! What `idem records` prints: a record as text lines or one JSON object, with its
//! response messages as hex, or as JSON when the service's `.proto` files are given.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_store::format::{self, GrpcMessage};
use idem_store::{RecordInfo, RecordState, Scope, StoredOutcome};
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor};
use serde_json::{Map, Value, json};

/// The message type of the method's responses, from the `.proto` files.
pub(crate) fn response_type(
    protos: &[String],
    includes: &[String],
    method_path: Option<&str>,
) -> Result<Option<MessageDescriptor>, String> {
    if protos.is_empty() {
        return Ok(None);
    }
    let Some(path) = method_path else {
        return Err(
            "--proto needs --tenant/--method/--key: with --scope the method, and so the \
             response type, is not known"
                .into(),
        );
    };
    let includes: Vec<String> = if includes.is_empty() {
        let mut dirs: Vec<String> = protos
            .iter()
            .map(|p| {
                std::path::Path::new(p)
                    .parent()
                    .map(|d| d.to_string_lossy().into_owned())
                    .filter(|d| !d.is_empty())
                    .unwrap_or_else(|| ".".into())
            })
            .collect();
        dirs.dedup();
        dirs
    } else {
        includes.to_vec()
    };
    let fds = protox::compile(protos, &includes).map_err(|e| format!("--proto: {e}"))?;
    let pool =
        DescriptorPool::from_file_descriptor_set(fds).map_err(|e| format!("--proto: {e}"))?;
    let (service, method) = path
        .trim_start_matches('/')
        .split_once('/')
        .ok_or("method without '/'")?;
    let svc = pool
        .get_service_by_name(service)
        .ok_or_else(|| format!("--proto: no service {service} in the given files"))?;
    let m = svc
        .methods()
        .find(|m| m.name() == method)
        .ok_or_else(|| format!("--proto: service {service} has no method {method}"))?;
    Ok(Some(m.output()))
}

fn state_name(s: &RecordState) -> &'static str {
    match s {
        RecordState::InFlight { .. } => "in_flight",
        RecordState::Completed { .. } => "completed",
        RecordState::Released { .. } => "released",
    }
}

/// `2026-12-02T03:04:05.678Z`.
fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

fn secs(d: Duration) -> String {
    format!("{:.3}s", d.as_secs_f64())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The record as one JSON object (the `--json` output; the text output prints the same
/// fields).
pub(crate) fn record_json(
    scope: &Scope,
    location: &str,
    info: &RecordInfo,
    ty: Option<&MessageDescriptor>,
) -> Result<Value, String> {
    let mut o = Map::new();
    o.insert("scope".into(), json!(scope.to_hex()));
    o.insert("location".into(), json!(location));
    o.insert("state".into(), json!(state_name(&info.state)));
    let fence = match &info.state {
        RecordState::InFlight { fence, .. }
        | RecordState::Completed { fence, .. }
        | RecordState::Released { fence } => *fence,
    };
    o.insert("fence".into(), json!(fence));
    match &info.state {
        RecordState::InFlight {
            fingerprint,
            lease_until,
            ..
        } => {
            o.insert("fingerprint".into(), json!(hex(&fingerprint.0)));
            let left = lease_until.saturating_duration_since(tokio::time::Instant::now());
            o.insert("lease_left".into(), json!(secs(left)));
            o.insert(
                "lease_expires_at".into(),
                json!(rfc3339(SystemTime::now() + left)),
            );
        }
        RecordState::Completed { fingerprint, .. } => {
            o.insert("fingerprint".into(), json!(hex(&fingerprint.0)));
        }
        RecordState::Released { .. } => {}
    }
    let time = |t: Option<SystemTime>| t.map_or(Value::Null, |t| json!(rfc3339(t)));
    o.insert("created_at".into(), time(info.created_at));
    o.insert("completed_at".into(), time(info.completed_at));
    o.insert(
        "ttl_left".into(),
        info.expires_in.map_or(Value::Null, |d| json!(secs(d))),
    );
    if let RecordState::Completed { outcome, .. } = &info.state {
        o.insert("response".into(), response_json(outcome, ty)?);
    }
    Ok(Value::Object(o))
}

fn headers_json(h: &http::HeaderMap) -> Value {
    Value::Array(
        h.iter()
            .map(|(n, v)| json!([n.as_str(), String::from_utf8_lossy(v.as_bytes())]))
            .collect(),
    )
}

fn response_json(outcome: &StoredOutcome, ty: Option<&MessageDescriptor>) -> Result<Value, String> {
    let bytes = match outcome {
        StoredOutcome::NotRetained => {
            return Ok(json!({"retained": false,
                "note": "the call completed; its response was over the size limit and not kept"}));
        }
        StoredOutcome::Response(b) => b.clone(),
    };
    let r = format::read(bytes).map_err(|e| e.to_string())?;
    let status_from = r.trailers.as_ref().unwrap_or(&r.headers);
    let text = |name: &str| {
        status_from
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    let grpc_status = text("grpc-status").and_then(|s| s.parse::<i32>().ok());
    let messages = format::grpc_messages(&r.frames).map_err(|e| e.to_string())?;
    let messages: Vec<Value> = messages
        .iter()
        .map(|m| message_json(m, ty))
        .collect::<Result<_, _>>()?;
    Ok(json!({
        "retained": true,
        "http_status": r.status.as_u16(),
        "grpc_status": grpc_status,
        "grpc_status_name": grpc_status
            .and_then(|c| idem_core::code::code_from_i64(i64::from(c)))
            .map(idem_core::code::code_name),
        "grpc_message": text("grpc-message"),
        "headers": headers_json(&r.headers),
        "trailers": r.trailers.as_ref().map(headers_json),
        "messages": messages,
    }))
}

fn message_json(m: &GrpcMessage, ty: Option<&MessageDescriptor>) -> Result<Value, String> {
    match ty {
        Some(ty) if !m.compressed => {
            let msg = DynamicMessage::decode(ty.clone(), m.bytes.clone()).map_err(|e| {
                format!(
                    "a stored message does not decode as {}: {e}",
                    ty.full_name()
                )
            })?;
            serde_json::to_value(&msg).map_err(|e| e.to_string())
        }
        _ => Ok(json!({
            "compressed": m.compressed,
            "hex": hex(&m.bytes),
        })),
    }
}

/// The text output: one `name: value` line per field, in the JSON's order.
pub(crate) fn text(v: &Value) -> String {
    let mut out = String::new();
    if let Value::Object(o) = v {
        for (k, v) in o {
            match (k.as_str(), v) {
                ("response", Value::Object(r)) => {
                    for (k, v) in r {
                        match (k.as_str(), v) {
                            ("headers" | "trailers", Value::Array(hs)) => {
                                for h in hs {
                                    out.push_str(&format!(
                                        "{}: {}: {}\n",
                                        k.trim_end_matches('s'),
                                        h[0].as_str().unwrap_or(""),
                                        h[1].as_str().unwrap_or("")
                                    ));
                                }
                            }
                            ("messages", Value::Array(ms)) => {
                                for (i, m) in ms.iter().enumerate() {
                                    out.push_str(&format!("message {i}: {m}\n"));
                                }
                            }
                            (_, Value::Null) => {}
                            (k, Value::String(s)) => out.push_str(&format!("{k}: {s}\n")),
                            (k, v) => out.push_str(&format!("{k}: {v}\n")),
                        }
                    }
                }
                // A time the store did not record (an older record, a store that keeps
                // none) is said to be unknown; an in-flight record has no completion.
                (k @ ("created_at" | "completed_at"), Value::Null) => {
                    if k == "created_at" || o.get("state") == Some(&json!("completed")) {
                        out.push_str(&format!(
                            "{k}: unknown (not kept by this store or record version)\n"
                        ));
                    }
                }
                (_, Value::Null) => {}
                (k, Value::String(s)) => out.push_str(&format!("{k}: {s}\n")),
                (k, v) => out.push_str(&format!("{k}: {v}\n")),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_print_in_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_764_644_645_678);
        assert_eq!(rfc3339(t), "2025-12-02T03:04:05.678Z");
    }

    #[test]
    fn times_not_recorded_print_as_unknown() {
        let sc = Scope([1; 32]);
        let fingerprint = idem_store::Fingerprint([2; 32]);
        let done = RecordInfo::of(RecordState::Completed {
            fence: 7,
            fingerprint,
            outcome: StoredOutcome::NotRetained,
        });
        let out = text(&record_json(&sc, "here", &done, None).unwrap());
        assert!(
            out.contains("created_at: unknown") && out.contains("completed_at: unknown"),
            "{out}"
        );
        let running = RecordInfo {
            created_at: Some(UNIX_EPOCH),
            ..RecordInfo::of(RecordState::InFlight {
                fence: 7,
                fingerprint,
                lease_until: tokio::time::Instant::now(),
            })
        };
        let out = text(&record_json(&sc, "here", &running, None).unwrap());
        assert!(
            out.contains("created_at: 1970-01-01T00:00:00.000Z"),
            "{out}"
        );
        assert!(!out.contains("completed_at"), "{out}");
    }
}
