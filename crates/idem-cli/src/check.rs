//! `idem check-config [--strict] [--json] [--proto FILE]... [-I DIR]...
//! [--descriptor-set FILE] CONFIG`: the options, the descriptors, and the two outputs
//! (the tables of [`report`](crate::report), or one JSON object).
//!
//! Exit 0: valid; 1: invalid (every error printed); 2: unreadable (a config, proto or
//! descriptor set that cannot be read, a proto that does not compile, a file that is
//! not a FileDescriptorSet) or a wrong command line.

use std::io::{self, Read};
use std::process::ExitCode;

use idem_core::code::code_name;
use idem_core::config::{
    CircuitBreakerSettings, ConfigError, Diagnostic, ParseOptions, Parsed, ServiceConfig,
    format_duration,
};
use idem_core::descriptor::{Descriptors, IdempotencyLevel};
use serde_json::{Value, json};

use crate::{
    INVALID, UNREADABLE, err, notes, out, rate_warning, report, usage_error, warning_lines,
};

/// The parsed command line of `check-config`.
#[derive(Debug, Default)]
struct Options<'a> {
    strict: bool,
    json: bool,
    protos: Vec<&'a str>,
    includes: Vec<&'a str>,
    descriptor_set: Option<&'a str>,
    config: Option<&'a str>,
}

/// `--proto FILE`, `--proto=FILE`, `-I DIR`, `-IDIR`: a flag's value, taken from the
/// same argument or the next one.
pub(crate) fn value<'a>(
    arg: &'a str,
    flag: &str,
    rest: &mut impl Iterator<Item = &'a str>,
) -> Option<Result<&'a str, String>> {
    let tail = arg.strip_prefix(flag)?;
    let long = flag.starts_with("--");
    let v = match tail {
        "" => rest.next().ok_or_else(|| format!("{flag} needs a value")),
        t if long => match t.strip_prefix('=') {
            Some(v) => Ok(v),
            None => return None,
        },
        t => Ok(t),
    };
    Some(v.and_then(|v| {
        if v.is_empty() {
            Err(format!("{flag} needs a value"))
        } else {
            Ok(v)
        }
    }))
}

const ONE_FILE: &str = "check-config takes exactly one FILE (or - for standard input)";

fn parse<'a>(args: &[&'a str]) -> Result<Options<'a>, String> {
    let mut o = Options::default();
    let mut it = args.iter().copied();
    while let Some(arg) = it.next() {
        if arg == "--strict" {
            o.strict = true;
        } else if arg == "--json" {
            o.json = true;
        } else if let Some(v) = value(arg, "--proto", &mut it) {
            o.protos.push(v?);
        } else if let Some(v) = value(arg, "--descriptor-set", &mut it) {
            if o.descriptor_set.replace(v?).is_some() {
                return Err("--descriptor-set is given twice".to_owned());
            }
        } else if let Some(v) = value(arg, "-I", &mut it) {
            o.includes.push(v?);
        } else if arg.starts_with('-') && arg != "-" {
            return Err(format!("check-config: unknown option {arg:?}"));
        } else if o.config.replace(arg).is_some() {
            return Err(ONE_FILE.to_owned());
        }
    }
    if o.config.is_none() {
        return Err(ONE_FILE.to_owned());
    }
    if o.descriptor_set.is_some() && !o.protos.is_empty() {
        return Err("give --proto or --descriptor-set, not both".to_owned());
    }
    if !o.includes.is_empty() && o.protos.is_empty() {
        return Err("-I applies to --proto files: give at least one".to_owned());
    }
    Ok(o)
}

/// Descriptors from `--proto` files or a `--descriptor-set`; `Err`: the message for an
/// unreadable input.
pub(crate) fn descriptors(
    protos: &[&str],
    includes: &[&str],
    descriptor_set: Option<&str>,
) -> Result<Option<Descriptors>, String> {
    if let Some(path) = descriptor_set {
        let bytes = std::fs::read(path).map_err(|e| format!("cannot read {path}: {e}"))?;
        return Descriptors::from_file_descriptor_set(&bytes)
            .map(Some)
            .map_err(|e| format!("{path}: {e}"));
    }
    if protos.is_empty() {
        return Ok(None);
    }
    Descriptors::compile(protos, includes)
        .map(Some)
        .map_err(|e| format!("cannot compile the protos: {e}"))
}

/// Runs `check-config` with its arguments.
pub(crate) fn run(args: &[&str]) -> ExitCode {
    let o = match parse(args) {
        Ok(o) => o,
        Err(message) => return usage_error(&message),
    };
    let file = o.config.unwrap_or("-");
    let (name, text) = match read_config(file) {
        Ok(read) => read,
        Err(Unreadable(message)) => {
            err(&format!("idem: {message}\n"));
            return ExitCode::from(UNREADABLE);
        }
    };
    let descriptors = match descriptors(&o.protos, &o.includes, o.descriptor_set) {
        Ok(d) => d,
        Err(message) => {
            err(&format!("idem: {message}\n"));
            return ExitCode::from(UNREADABLE);
        }
    };
    let text = match text {
        Ok(text) => text,
        Err(message) => return unparsable(&o, name, &message),
    };
    let mut options = ParseOptions::new().strict(o.strict);
    if let Some(d) = descriptors {
        options = options.descriptors(d);
    }
    match ServiceConfig::from_json_with_options(&text, &options) {
        Ok(parsed) => valid(&o, name, parsed),
        Err(e @ (ConfigError::Json { .. } | ConfigError::Read { .. })) => {
            unparsable(&o, name, &e.to_string())
        }
        Err(ConfigError::Invalid { errors, warnings }) => invalid(&o, name, errors, warnings),
    }
}

struct Unreadable(String);

/// The config's display name and its text (`Err` inside: not UTF-8, an invalid config).
fn read_config(file: &str) -> Result<(&str, Result<String, String>), Unreadable> {
    let (name, bytes) = if file == "-" {
        let mut buf = Vec::new();
        io::stdin()
            .lock()
            .read_to_end(&mut buf)
            .map_err(|e| Unreadable(format!("cannot read standard input: {e}")))?;
        ("<stdin>", buf)
    } else {
        let buf =
            std::fs::read(file).map_err(|e| Unreadable(format!("cannot read {file}: {e}")))?;
        (file, buf)
    };
    let text = String::from_utf8(bytes).map_err(|e| {
        format!(
            "not UTF-8 text (bad byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    });
    Ok((name, text))
}

fn diag(path: &str, message: &str) -> Diagnostic {
    Diagnostic {
        path: path.to_owned(),
        message: message.to_owned(),
    }
}

fn valid(o: &Options<'_>, name: &str, mut parsed: Parsed) -> ExitCode {
    let rate = rate_warning(parsed.config.settings());
    let mut extra = descriptor_notes(&parsed);
    extra.append(&mut parsed.notes);
    if o.strict
        && let Some(r) = &rate
    {
        // The command's own warning is a warning too: strict refuses it.
        let message = r.trim_end().trim_start_matches("warning: ");
        return invalid(o, name, vec![diag("idem.memoryStore", message)], Vec::new());
    }
    if o.json {
        let mut warnings = parsed.warnings.clone();
        if let Some(r) = &rate {
            let message = r
                .trim_end()
                .trim_start_matches("warning: idem.memoryStore ");
            warnings.push(diag("idem.memoryStore", message));
        }
        let notes_text = notes(&parsed.config);
        let mut notes: Vec<Value> = notes_text
            .lines()
            .map(|l| json!(l.trim_start_matches("note: ")))
            .collect();
        notes.extend(extra.iter().map(|n| json!(n.to_string())));
        print_json(json!({
            "valid": true,
            "errors": [],
            "warnings": diagnostics(&warnings),
            "notes": notes,
            "methods": methods(&parsed.config),
            "retryGuards": retry_guards(&parsed.config),
        }));
        return ExitCode::SUCCESS;
    }
    err(&warning_lines(&parsed.warnings));
    err(rate.as_deref().unwrap_or(""));
    err(&notes(&parsed.config));
    err(&extra
        .iter()
        .map(|n| format!("note: {n}\n"))
        .collect::<String>());
    out(&report(name, &parsed, usize::from(rate.is_some())));
    if parsed.config.descriptors().is_some() {
        out(&format!("\n{}", crate::init::methods_table(&parsed.config)));
    }
    ExitCode::SUCCESS
}

/// What the descriptors suggest and the config does not do: hedging for a
/// `NO_SIDE_EFFECTS` method that is retried.
fn descriptor_notes(parsed: &Parsed) -> Vec<Diagnostic> {
    let Some(d) = parsed.config.descriptors() else {
        return Vec::new();
    };
    d.methods()
        .filter(|m| m.idempotency_level() == IdempotencyLevel::NoSideEffects)
        .filter(|m| {
            parsed
                .config
                .lookup(m.service(), m.name())
                .is_some_and(|mc| mc.retry_policy().is_some())
        })
        .map(|m| {
            diag(
                "$",
                &format!(
                    "{} is NO_SIDE_EFFECTS: it may be hedged without protection (a \
                     hedgingPolicy instead of its retryPolicy) if slow instances delay it",
                    m.full_name()
                ),
            )
        })
        .collect()
}

fn invalid(
    o: &Options<'_>,
    name: &str,
    errors: Vec<Diagnostic>,
    warnings: Vec<Diagnostic>,
) -> ExitCode {
    if o.json {
        print_json(json!({
            "valid": false,
            "errors": diagnostics(&errors),
            "warnings": diagnostics(&warnings),
            "notes": [],
            "methods": [],
            "retryGuards": null,
        }));
        return ExitCode::from(INVALID);
    }
    let mut text = format!("{name}: invalid: {} error(s)\n", errors.len());
    for e in &errors {
        text.push_str(&format!("error: {e}\n"));
    }
    text.push_str(&warning_lines(&warnings));
    err(&text);
    ExitCode::from(INVALID)
}

/// A config that is not JSON (or not text): one line, as before the other options.
fn unparsable(o: &Options<'_>, name: &str, message: &str) -> ExitCode {
    if o.json {
        return invalid(o, name, vec![diag("$", message)], Vec::new());
    }
    err(&format!("{name}: invalid: {message}\n"));
    ExitCode::from(INVALID)
}

fn print_json(v: Value) {
    let text = serde_json::to_string_pretty(&v).unwrap_or_default();
    out(&format!("{text}\n"));
}

fn diagnostics(d: &[Diagnostic]) -> Value {
    d.iter()
        .map(|d| json!({"path": d.path, "message": d.message}))
        .collect()
}

/// `methods`: one entry per method of the descriptors, or per configured name.
/// The client's retry budget and circuit breakers as `--json` gives them: the
/// client-wide ones (`null` when not configured) and each method config entry's own
/// breaker, with the entry's JSON path and names.
fn retry_guards(config: &ServiceConfig) -> Value {
    let c = &config.settings().client;
    let budget = c.retry_budget.as_ref().map(|b| {
        json!({
            "ratio": b.ratio.get(),
            "minRetriesPerSecond": b.min_retries_per_second,
            "window": format_duration(b.window),
        })
    });
    let breaker = |b: &CircuitBreakerSettings| {
        json!({
            "failureRatio": b.failure_ratio.get(),
            "minCalls": b.min_calls,
            "window": format_duration(b.window),
            "openFor": format_duration(b.open_for),
            "halfOpenProbes": b.half_open_probes,
            "failureStatusCodes": b.failure_status_codes.iter().map(code_name).collect::<Vec<_>>(),
        })
    };
    let per_method: Vec<Value> = config
        .method_configs()
        .iter()
        .enumerate()
        .filter_map(|(i, mc)| {
            let b = mc.circuit_breaker()?;
            let mut own = breaker(b);
            own["path"] = json!(
                mc.json_path()
                    .unwrap_or_else(|| format!("methodConfig[{i}]"))
            );
            own["names"] = json!(
                mc.names()
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
            );
            Some(own)
        })
        .collect();
    json!({
        "retryBudget": budget,
        "circuitBreaker": c.circuit_breaker.as_ref().map(breaker),
        "methodCircuitBreakers": per_method,
    })
}

fn methods(config: &ServiceConfig) -> Value {
    config
        .method_policies()
        .into_iter()
        .map(|p| {
            json!({
                "method": p.method,
                "idempotencyLevel": p.idempotency_level.map(IdempotencyLevel::name),
                "streaming": p.streaming.map(|s| s.name()),
                "protected": p.protected,
                "keyRequired": p.key_required,
                "retryPolicy": p.retry_policy.as_ref().map(crate::init::retry_json),
                "hedgingPolicy": p.hedging_policy.as_ref().map(crate::init::hedging_json),
            })
        })
        .collect()
}
