//! The `idem` command: `idem check-config FILE` validates a service config and prints the
//! effective policy of every configured name, and for each bound of the memory store the
//! sustained protected calls per second it allows (with a warning below 1000 when the
//! memory store is the one in use).
//!
//! `check-config` also takes the services' protos or descriptor set, a strict mode and
//! a JSON output ([`check`]); `idem init` writes a starter config from protos ([`init`]).
//!
//! Arguments are parsed by hand: a few flags per subcommand, so a command-line crate
//! would add more build time than it saves.

mod check;
mod init;
mod records;

use std::io::{self, Write};
use std::process::ExitCode;

use idem_core::code::code_name;
use idem_core::config::{
    Diagnostic, IdemSettings, InFlightPolicy, MethodConfig, Parsed, ServiceConfig, TenantSource,
    format_duration,
};
use idem_store::memory::{MemoryStoreSettings, RECORD_OVERHEAD_BYTES};

const USAGE: &str = "\
idem: effectively-once gRPC writes for tonic

Usage:
  idem check-config FILE    validate a gRPC service config and print the effective
                            policy of every configured name
  idem check-config -       the same, reading the config from standard input
  idem check-config [--strict] [--json] [--proto FILE]... [-I DIR]...
                    [--descriptor-set FILE] CONFIG
                            the same, with the options below (CONFIG may be -)
  idem init --proto FILE... [-I DIR]...
                            print a starter service config for the protos' services
  idem --help               print this help
  idem --version            print the version

check-config options:
  --strict                  every warning is an error (as \"idem\": {\"strict\": true})
  --json                    print {\"valid\", \"errors\", \"warnings\", \"notes\", \"methods\",
                            \"retryGuards\"}
  --proto FILE              the services' .proto file (compiled in-process, no protoc);
                            every configured name must then match a service or method,
                            and side-effecting methods are protected by default
  -I DIR                    where --proto files and their imports are found
  --descriptor-set FILE     the services' encoded FileDescriptorSet instead of --proto

check-config exits with 0 when the config is valid (warnings are printed to standard
error), 1 when it is invalid (every error is printed, as `json.path: rule`), and 2 when
a file cannot be read (a proto that does not compile, a file that is not a
FileDescriptorSet included) or the command line is wrong.
";

/// Exit status: the config is invalid.
const INVALID: u8 = 1;
/// Exit status: the file cannot be read, or bad usage.
const UNREADABLE: u8 = 2;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["-h" | "--help" | "help"] | ["check-config", "-h" | "--help"] => {
            out(&usage());
            ExitCode::SUCCESS
        }
        ["-V" | "--version"] => {
            out(&format!("idem {}\n", env!("CARGO_PKG_VERSION")));
            ExitCode::SUCCESS
        }
        ["check-config", rest @ ..] => check::run(rest),
        ["init", rest @ ..] => init::run(rest),
        ["records", rest @ ..] => records::main(rest),
        [] => usage_error("missing command"),
        [other, ..] => usage_error(&format!("unknown command {other:?}")),
    }
}

/// The whole usage text: check-config's, then `idem records`'.
fn usage() -> String {
    format!("{USAGE}\nRecords:\n{}", records::USAGE)
}

fn usage_error(message: &str) -> ExitCode {
    err(&format!("idem: {message}\n\n{}", usage()));
    ExitCode::from(UNREADABLE)
}

/// Writes to stdout, ignoring a closed pipe (`idem check-config f | head` must not panic).
fn out(text: &str) {
    let _ = io::stdout().lock().write_all(text.as_bytes());
}

fn err(text: &str) {
    let _ = io::stderr().lock().write_all(text.as_bytes());
}

/// What the file alone cannot settle: said on standard error, not counted as warnings
/// (the server may settle it in code).
fn notes(config: &ServiceConfig) -> String {
    // An unset idem.tenant is said once, on the report's `idem.tenant` line: a server
    // that sets its tenant in code has nothing to fix.
    let mut text = String::new();
    for m in config.method_configs() {
        if let Some(h) = m.hedging_policy() {
            text.push_str(&hedging_note(m, h));
        }
    }
    text
}

/// When hedging pays, for each hedged entry: every hedge carries the call's key, so on an
/// idem server a duplicate waits for the one run.
fn hedging_note(m: &MethodConfig, h: &idem_core::config::HedgingPolicy) -> String {
    let names = m
        .names()
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let mut text = format!(
        "note: {names} is hedged: it pays for slow instances (queueing, GC pauses, a noisy \
         neighbour), where the delay comes before an instance claims the key; a slow handler \
         is not helped, since every hedge waits for the same run; set hedgingDelay near the \
         method's p95 latency\n"
    );
    let aborts = m
        .idempotency()
        .is_some_and(|p| p.in_flight == InFlightPolicy::Abort);
    if aborts
        && !h
            .non_fatal_status_codes
            .contains(idem_core::code::Code::Aborted)
    {
        text.push_str(&format!(
            "note: {names} is hedged with inFlight ABORT: list ABORTED in nonFatalStatusCodes, \
             or a duplicate hedge's ABORTED ends the call\n"
        ));
    }
    text
}

fn warning_lines(warnings: &[Diagnostic]) -> String {
    warnings.iter().map(|w| format!("warning: {w}\n")).collect()
}

/// The summary line, the policy table, the idempotency table and the process-wide
/// settings; `more_warnings`: warnings of this command's own (the memory store's rate).
fn report(name: &str, parsed: &Parsed, more_warnings: usize) -> String {
    let config = &parsed.config;
    let entries = config.method_configs();
    let names: usize = entries.iter().map(|m| m.names().len()).sum();
    let mut text = format!(
        "{name}: valid: {} method config(s), {names} name(s), {} warning(s)\n\n",
        entries.len(),
        parsed.warnings.len() + more_warnings
    );

    let throttling = config.retry_throttling().map(|t| {
        format!(
            "max {}, ratio {}",
            milli(t.max_milli_tokens),
            milli(t.token_ratio_milli)
        )
    });
    let mut rows = Vec::new();
    let mut protected = Vec::new();
    for mc in entries {
        for n in mc.names() {
            rows.push(policy_row(&n.to_string(), mc, throttling.as_deref()));
            if mc.idempotency().is_some() {
                protected.push(idempotency_row(&n.to_string(), mc));
            }
        }
    }
    if rows.is_empty() {
        text.push_str("no method configs: no call is retried or protected\n");
    } else {
        text.push_str(&table(
            &[
                "NAME",
                "POLICY",
                "ATTEMPTS",
                "BACKOFF",
                "CODES",
                "TIMEOUT",
                "THROTTLING",
                "IDEMPOTENCY",
            ],
            &rows,
        ));
    }
    if !protected.is_empty() {
        text.push('\n');
        text.push_str(&table(
            &[
                "PROTECTED",
                "KEY",
                "RECORD TTL",
                "LEASE",
                "IN-FLIGHT",
                "CACHED",
                "MAX REQUEST",
                "MAX FRAMES",
                "COMPRESSED",
                "MAX RESPONSE",
                "COMPLETION RETRY",
                "STORE DOWN",
            ],
            &protected,
        ));
    }

    text.push('\n');
    match config.retry_throttling() {
        Some(t) => text.push_str(&format!(
            "retryThrottling: maxTokens {}, tokenRatio {} (per target; retries stop at or below {} tokens)\n",
            milli(t.max_milli_tokens),
            milli(t.token_ratio_milli),
            milli(t.max_milli_tokens / 2)
        )),
        None => text.push_str("retryThrottling: none\n"),
    }
    text.push_str(&retry_guards(config));
    text.push_str(&process_wide(config.settings()));
    text
}

/// `idem.client.retryBudget` and `idem.client.circuitBreaker`, one line each, then one
/// line per method config entry with its own breaker (`methodConfig[i].circuitBreaker`).
fn retry_guards(config: &ServiceConfig) -> String {
    let c = &config.settings().client;
    let budget = match &c.retry_budget {
        Some(b) => format!(
            "ratio {} of the calls over {}, plus {} per second (retries and hedges, per layer)",
            b.ratio,
            format_duration(b.window),
            b.min_retries_per_second
        ),
        None => "none".to_owned(),
    };
    let breaker = match &c.circuit_breaker {
        Some(b) => format!("{} (per layer)", breaker_rule(b)),
        None => "none".to_owned(),
    };
    let mut text =
        format!("idem.client.retryBudget: {budget}\nidem.client.circuitBreaker: {breaker}\n");
    for (i, mc) in config.method_configs().iter().enumerate() {
        if let Some(b) = mc.circuit_breaker() {
            let names: Vec<String> = mc.names().iter().map(ToString::to_string).collect();
            let path = mc
                .json_path()
                .unwrap_or_else(|| format!("methodConfig[{i}]"));
            text.push_str(&format!(
                "{path}.circuitBreaker: {} (its own, for {}: instead of idem.client.circuitBreaker)\n",
                breaker_rule(b),
                names.join(", ")
            ));
        }
    }
    text
}

/// What a breaker's settings do, in one line.
fn breaker_rule(b: &idem_core::config::CircuitBreakerSettings) -> String {
    format!(
        "opens when {} of at least {} attempts over {} fail with {} (retries stop at half that); open {} (x2 per reopening, up to 8x), then {} probe(s), never retried, judged by the same ratio",
        b.failure_ratio,
        b.min_calls,
        format_duration(b.window),
        b.failure_status_codes
            .iter()
            .map(code_name)
            .collect::<Vec<_>>()
            .join(","),
        format_duration(b.open_for),
        b.half_open_probes
    )
}

/// The `idem` object: process-wide settings, one line per part.
fn process_wide(s: &IdemSettings) -> String {
    let tenant = match &s.tenant {
        TenantSource::Unset => "not in the config, so the server sets it in code \
            (IdempotencyLayer::tenant, e.g. FromExtension after an auth layer); a server that \
            does not is refused by IdempotencyLayer::check, and its protected calls get \
            FAILED_PRECONDITION (TENANT_SOURCE_MISSING); {\"single\": \"name\"} sets one \
            tenant here"
            .to_owned(),
        TenantSource::Single(t) => format!("single {t:?}"),
        TenantSource::Header(h) => format!("header {h} (trusted client header)"),
    };
    let redis = match &s.redis {
        Some(r) => format!(
            "{}{} (keyPrefix {:?}, commandTimeout {}, connectTimeout {}, maxInFlightPerTenant {})",
            if r.cluster_nodes.is_empty() {
                r.url.clone()
            } else {
                format!("Redis Cluster via {}", r.cluster_nodes.join(", "))
            },
            if r.replica_acks == 0 {
                String::new()
            } else {
                format!(
                    ", each claim and completion confirmed on {} replica(s) within {}",
                    r.replica_acks,
                    format_duration(r.replica_ack_timeout)
                )
            },
            r.key_prefix,
            format_duration(r.command_timeout),
            format_duration(r.connect_timeout),
            r.max_in_flight_per_tenant
                .map_or("none (no bound)".to_owned(), |n| format!(
                    "{n} across instances"
                )),
        ),
        None => "not configured (in-memory store)".to_owned(),
    };
    let m = &s.memory_store;
    let c = &s.client;
    format!(
        "idem.keyHeader: {}\nidem.tenant: {tenant}\n\
         idem.maxHandlersInFlight: {} (per server layer)\n\
         idem.memoryStore: maxEntries {}, maxBytes {}, minRetention {}, sweepInterval {}\n\
         idem.memoryStore per tenant: {}\n{}idem.redis: {redis}\n\
         idem.client: keyAllMethods {}, maxReplayBytesPerCall {}, maxReplayBytesTotal {}, \
         minAttemptTime {}, retryExhaustedPushback {}, noRetryUnderRetriedInbound {}\n",
        s.key_header,
        s.max_handlers_in_flight,
        m.max_entries,
        m.max_bytes,
        format_duration(m.min_retention),
        format_duration(m.sweep_interval),
        tenant_bounds(m, &s.tenant),
        rates(m),
        c.key_all_methods,
        c.max_replay_bytes_per_call,
        c.max_replay_bytes_total,
        format_duration(c.min_attempt_time),
        c.retry_exhausted_pushback,
        c.no_retry_under_retried_inbound,
    )
}

/// The memory store's effective per-tenant bounds, saying where each comes from. With a
/// single tenant the config gives it the whole store (`for_single_tenant`).
fn tenant_bounds(m: &MemoryStoreSettings, tenant: &TenantSource) -> String {
    let single = matches!(tenant, TenantSource::Single(_));
    let origin = |given: Option<usize>, effective: usize, store: usize, default: &str| match given {
        None => format!("{effective} (default: {default})"),
        Some(g) if g > effective => format!("{effective} (cut to the store-wide bound)"),
        Some(g) if single && g == store => format!("{effective} (single tenant: the whole store)"),
        Some(_) => effective.to_string(),
    };
    format!(
        "maxInFlightPerTenant {}, maxEntriesPerTenant {}, maxBytesPerTenant {}",
        origin(
            m.max_in_flight_per_tenant,
            m.tenant_in_flight_bound(),
            m.max_entries,
            "maxEntries / 16"
        ),
        origin(
            m.max_entries_per_tenant,
            m.tenant_entries_bound(),
            m.max_entries,
            "maxEntries / 4"
        ),
        origin(
            m.max_bytes_per_tenant,
            m.tenant_bytes_bound(),
            m.max_bytes,
            "maxBytes / 4"
        ),
    )
}

/// The response size the memory store's rates are given for.
const RATE_RESPONSE_BYTES: usize = 200;

/// Below this many protected calls per second, a memory store in use gets a warning.
const MIN_RATE: f64 = 1000.0;

/// One bound of the memory store and the sustained rate it allows.
struct BoundRate {
    /// `per tenant, entries` …
    name: &'static str,
    /// The bound, defaults applied.
    limit: usize,
    /// Records it holds: `limit` for entries, records of a [`RATE_RESPONSE_BYTES`]
    /// response for bytes.
    records: usize,
}

impl BoundRate {
    /// New protected calls per second at which records reach `minRetention` just as the
    /// bound fills: above it, the bound is full of records that may not be evicted yet
    /// and new calls are refused. `None`: no such rate (`minRetention` zero: any
    /// completed record may be evicted).
    fn per_second(&self, m: &MemoryStoreSettings) -> Option<f64> {
        let window = m.min_retention.as_secs_f64();
        (window > 0.0).then(|| self.records as f64 / window)
    }
}

/// The four record bounds of the memory store (per tenant and whole store, entries and
/// bytes), defaults applied.
fn bound_rates(m: &MemoryStoreSettings) -> [BoundRate; 4] {
    let record = RATE_RESPONSE_BYTES + RECORD_OVERHEAD_BYTES;
    let entries = |name, limit| BoundRate {
        name,
        limit,
        records: limit,
    };
    let bytes = |name, limit: usize| BoundRate {
        name,
        limit,
        records: limit / record,
    };
    [
        entries("per tenant, entries", m.tenant_entries_bound()),
        bytes("per tenant, bytes", m.tenant_bytes_bound()),
        entries("whole store, entries", m.max_entries),
        bytes("whole store, bytes", m.max_bytes),
    ]
}

/// `5084.3` → `5084`, `41.66` → `41.7`.
fn rate(r: f64) -> String {
    if r >= 100.0 {
        format!("{}", r.floor())
    } else {
        format!("{:.1}", (r * 10.0).floor() / 10.0)
    }
}

/// The sustained rate of each bound of the memory store, one line each under a heading.
fn rates(m: &MemoryStoreSettings) -> String {
    let mut text = format!(
        "idem.memoryStore sustained rate (new protected calls/s at which records reach \
         minRetention {} as the bound fills; {RATE_RESPONSE_BYTES}-byte responses, {} bytes a \
         record):\n",
        format_duration(m.min_retention),
        RATE_RESPONSE_BYTES + RECORD_OVERHEAD_BYTES
    );
    for b in bound_rates(m) {
        let r = match b.per_second(m) {
            Some(r) if b.records == b.limit => format!("{} calls/s", rate(r)),
            Some(r) => format!("{} calls/s ({} records)", rate(r), b.records),
            None => {
                "any rate (minRetention 0s: completed records may be evicted at once)".to_owned()
            }
        };
        text.push_str(&format!("  {} {}: {r}\n", b.name, b.limit));
    }
    text
}

/// A warning when the memory store is the store in use (no `idem.redis`) and one of its
/// bounds allows fewer than [`MIN_RATE`] protected calls per second.
fn rate_warning(s: &IdemSettings) -> Option<String> {
    if s.redis.is_some() {
        return None;
    }
    let m = &s.memory_store;
    let (b, r) = bound_rates(m)
        .into_iter()
        .filter_map(|b| b.per_second(m).map(|r| (b, r)))
        .min_by(|x, y| x.1.total_cmp(&y.1))?;
    (r < MIN_RATE).then(|| {
        format!(
            "warning: idem.memoryStore ({} {}): allows only {} protected calls/s \
             ({} records of {RATE_RESPONSE_BYTES}-byte responses kept minRetention {}); at a \
             higher sustained rate every new call is refused with RESOURCE_EXHAUSTED: raise \
             the bound or lower minRetention\n",
            b.name,
            b.limit,
            rate(r),
            b.records,
            format_duration(m.min_retention),
        )
    })
}

fn policy_row(name: &str, mc: &MethodConfig, throttling: Option<&str>) -> Vec<String> {
    let (policy, attempts, backoff, codes, throttled) = if let Some(r) = mc.retry_policy() {
        (
            "retry",
            r.max_attempts().to_string(),
            format!(
                "{}..{} x{}",
                format_duration(r.initial_backoff()),
                format_duration(r.max_backoff()),
                r.backoff_multiplier()
            ),
            r.retryable_status_codes().to_string(),
            throttling,
        )
    } else if let Some(h) = mc.hedging_policy() {
        (
            "hedging",
            h.max_attempts.to_string(),
            format!("delay {}", format_duration(h.hedging_delay)),
            h.non_fatal_status_codes.to_string(),
            throttling,
        )
    } else {
        ("none", "1".to_owned(), "-".to_owned(), "-".to_owned(), None)
    };
    vec![
        name.to_owned(),
        policy.to_owned(),
        attempts,
        backoff,
        codes,
        mc.timeout().map_or_else(|| "-".to_owned(), format_duration),
        throttled.unwrap_or("-").to_owned(),
        if mc.idempotency().is_some() {
            "protected"
        } else {
            "-"
        }
        .to_owned(),
    ]
}

fn idempotency_row(name: &str, mc: &MethodConfig) -> Vec<String> {
    let Some(p) = mc.idempotency() else {
        return Vec::new();
    };
    let in_flight = match p.in_flight {
        InFlightPolicy::Wait => "WAIT".to_owned(),
        InFlightPolicy::Abort => {
            format!("ABORT, retry in {}", format_duration(p.abort_retry_delay))
        }
    };
    let cached = p
        .cacheable_status_codes
        .iter()
        .map(code_name)
        .collect::<Vec<_>>()
        .join(",");
    vec![
        name.to_owned(),
        if p.key_required {
            "required"
        } else {
            "optional"
        }
        .to_owned(),
        format_duration(p.record_ttl),
        format_duration(p.lease_ttl),
        in_flight,
        if cached.is_empty() {
            "-".to_owned()
        } else {
            cached
        },
        p.max_request_bytes.to_string(),
        p.max_request_frames.to_string(),
        if p.accept_compressed.is_empty() {
            "-".to_owned()
        } else {
            p.accept_compressed
                .iter()
                .map(|c| c.name())
                .collect::<Vec<_>>()
                .join(",")
        },
        p.max_response_bytes.to_string(),
        format_duration(p.completion_retry_timeout),
        if p.fail_open {
            "fail open"
        } else {
            "fail closed"
        }
        .to_owned(),
    ]
}

/// `10000` milli-tokens → `10`, `100` → `0.1`.
fn milli(value: u32) -> String {
    let (whole, frac) = (value / 1000, value % 1000);
    if frac == 0 {
        whole.to_string()
    } else {
        format!("{whole}.{}", format!("{frac:03}").trim_end_matches('0'))
    }
}

/// Left-aligned columns separated by two spaces; the last column is not padded.
fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut s = String::new();
        for (i, cell) in cells.enumerate() {
            if i + 1 == widths.len() {
                s.push_str(cell);
            } else {
                s.push_str(&format!("{cell:<w$}  ", w = widths[i]));
            }
        }
        s.push('\n');
        s
    };
    let mut text = line(&mut headers.iter().copied());
    for row in rows {
        text.push_str(&line(&mut row.iter().map(String::as_str)));
    }
    text
}
