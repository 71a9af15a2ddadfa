//! `idem check-config`: exit codes and output, run as a real process.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

/// The workspace root: the tests run `idem` from there, as the README does.
fn root() -> PathBuf {
    // The directory cargo gives the test when it runs it: a test binary reused from a
    // build in another checkout of the same tree carries that checkout's path.
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join("../..")
}

fn idem(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .current_dir(root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idem");
    {
        let mut input = child.stdin.take().expect("stdin");
        if let Some(text) = stdin {
            input.write_all(text).expect("write stdin");
        }
    }
    child.wait_with_output().expect("idem runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).expect("utf-8 stdout")
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).expect("utf-8 stderr")
}

fn fixture(name: &str) -> String {
    root()
        .join("crates/idem-cli/tests/fixtures")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

/// The row of `name` in a printed table, split into its columns (two or more spaces).
fn row(out: &str, name: &str) -> Vec<String> {
    let line = out
        .lines()
        .find(|l| l.starts_with(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no row for {name} in:\n{out}"));
    line.split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(str::to_owned)
        .collect()
}

#[test]
fn valid_example_prints_the_effective_table() {
    let o = idem(&["check-config", "examples/service_config.json"], None);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "stderr: {}", stderr(&o));
    assert_eq!(stderr(&o), "", "the example raises no warning");
    assert!(
        out.starts_with(
            "examples/service_config.json: valid: 3 method config(s), 3 name(s), 0 warning(s)\n"
        ),
        "{out}"
    );
    assert!(
        out.contains("NAME  ") && out.contains("ATTEMPTS") && out.contains("IDEMPOTENCY"),
        "{out}"
    );
    assert_eq!(
        row(&out, "shop.v1.Orders/CreateOrder"),
        [
            "shop.v1.Orders/CreateOrder",
            "retry",
            "4",
            "0.05s..1s x2",
            "UNAVAILABLE",
            "5s",
            "max 10, ratio 0.1",
            "protected"
        ]
    );
    assert_eq!(
        row(&out, "shop.v1.Orders/GetOrder"),
        [
            "shop.v1.Orders/GetOrder",
            "retry",
            "3",
            "0.02s..0.5s x2",
            "RESOURCE_EXHAUSTED, UNAVAILABLE",
            "2s",
            "max 10, ratio 0.1",
            "-"
        ]
    );
    assert_eq!(
        row(&out, "shop.v1.Orders/ListOrders"),
        [
            "shop.v1.Orders/ListOrders",
            "none",
            "1",
            "-",
            "-",
            "30s",
            "-",
            "-"
        ]
    );
    // The idempotency table has the protected method only.
    let protected: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("PROTECTED"))
        .take_while(|l| !l.is_empty())
        .collect();
    assert_eq!(protected.len(), 2, "{out}");
    assert_eq!(
        row(protected[1], "shop.v1.Orders/CreateOrder"),
        [
            "shop.v1.Orders/CreateOrder",
            "required",
            "86400s",
            "10s",
            "WAIT",
            "OK,UNKNOWN,DEADLINE_EXCEEDED,INTERNAL,DATA_LOSS",
            "1048576",
            "65536",
            "-",
            "262144",
            "60s",
            "fail closed"
        ]
    );
    assert!(
        out.contains("retryThrottling: maxTokens 10, tokenRatio 0.1"),
        "{out}"
    );
    assert!(out.contains("idem.tenant: single \"shop\""), "{out}");
    assert!(
        out.contains("idem.maxHandlersInFlight: 1024 (per server layer)\n"),
        "{out}"
    );
    assert!(
        out.contains(
            "idem.memoryStore per tenant: maxInFlightPerTenant 2000000 (single tenant: the \
             whole store), maxEntriesPerTenant 2000000 (single tenant: the whole store), \
             maxBytesPerTenant 268435456 (single tenant: the whole store)\n"
        ),
        "{out}"
    );
}

#[test]
fn the_newer_settings_are_printed() {
    let doc = br#"{
      "methodConfig": [{"name": [{"service": "a.v1.B"}], "idempotency": {
        "acceptCompressed": ["deflate", "gzip"], "maxRequestFrames": 9,
        "completionRetryTimeout": "30s"}}],
      "idem": {
        "tenant": {"single": "t"},
        "maxHandlersInFlight": 7,
        "memoryStore": {"maxEntries": 10, "maxEntriesPerTenant": 20, "maxInFlightPerTenant": 3},
        "redis": {"url": "redis://redis:6379/0", "maxInFlightPerTenant": 50}
      }
    }"#;
    let o = idem(&["check-config", "-"], Some(doc));
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let protected: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("PROTECTED"))
        .collect();
    assert_eq!(
        row(protected[0], "PROTECTED")[7..10],
        ["MAX FRAMES", "COMPRESSED", "MAX RESPONSE"]
    );
    let r = row(protected[1], "a.v1.B/*");
    assert_eq!(
        (r[7].as_str(), r[8].as_str(), r[10].as_str()),
        ("9", "gzip,deflate", "30s"),
        "{out}"
    );
    for line in [
        "idem.maxHandlersInFlight: 7 (per server layer)",
        "idem.memoryStore: maxEntries 10, maxBytes 268435456, minRetention 120s, sweepInterval 1s",
        "idem.memoryStore per tenant: maxInFlightPerTenant 3, maxEntriesPerTenant 10 (cut to \
         the store-wide bound), maxBytesPerTenant 268435456 (single tenant: the whole store)",
        "idem.redis: redis://redis:6379/0 (keyPrefix \"idem:\", commandTimeout 0.5s, \
         connectTimeout 2s, maxInFlightPerTenant 50 across instances)",
    ] {
        assert!(out.lines().any(|l| l == line), "{line:?} in:\n{out}");
    }
    let no_bound = br#"{"idem": {"redis": {"url": "redis://r:1/0", "maxInFlightPerTenant": 0}}}"#;
    let out = stdout(&idem(&["check-config", "-"], Some(no_bound)));
    assert!(
        out.contains("maxInFlightPerTenant none (no bound))"),
        "{out}"
    );
    let cluster = br#"{"idem": {"redis": {"clusterNodes": ["redis://a:7000", "redis://b:7000"], "replicaAcks": 1, "replicaAckTimeout": "0.05s"}}}"#;
    let out = stdout(&idem(&["check-config", "-"], Some(cluster)));
    assert!(
        out.contains(
            "idem.redis: Redis Cluster via redis://a:7000, redis://b:7000, each claim and \
             completion confirmed on 1 replica(s) within 0.05s (keyPrefix"
        ),
        "{out}"
    );
}

#[test]
fn three_errors_are_all_printed() {
    let path = fixture("three_errors.json");
    let o = idem(&["check-config", &path], None);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(stdout(&o), "");
    let err = stderr(&o);
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(
        errors,
        [
            "error: methodConfig[0].retryPolicy.maxAttempts: must be an integer > 1",
            "error: methodConfig[1].name[0]: service must not be empty when method is set",
            "error: methodConfig[1].timeout: must be a proto3 JSON duration such as \"1.5s\": must end in \"s\" (seconds is the only unit)",
        ],
        "{err}"
    );
    assert!(
        err.starts_with(&format!("{path}: invalid: 3 error(s)\n")),
        "{err}"
    );
    assert_eq!(
        err.lines().count(),
        4,
        "a summary and three errors, nothing else: {err}"
    );
}

#[test]
fn warnings_go_to_stderr_and_the_config_is_still_valid() {
    let o = idem(&["check-config", &fixture("warnings.json")], None);
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(
        stderr(&o).lines().collect::<Vec<_>>(),
        [
            "warning: methodConfig[0].retryPolicy.jitter: unknown field, ignored",
            "warning: methodConfig[0].retryPolicy.maxAttempts: 7 is clamped to 5 (gRPC allows at most 5 attempts)",
            "warning: methodConfig[0].retryPolicy.retryableStatusCodes[1]: retrying NOT_FOUND is risky: it means the server will answer the same, so retrying cannot help",
            "warning: methodConfig[0].retryPolicy: worst case backoff 6.6s (4 retries, each at 1.2 × its maximum) exceeds timeout 1s: the last retries cannot run",
        ]
    );
    let out = stdout(&o);
    assert!(out.contains("4 warning(s)"), "{out}");
    assert_eq!(
        row(&out, "shop.v1.Orders/*")[..5],
        [
            "shop.v1.Orders/*",
            "retry",
            "5",
            "0.5s..2s x2",
            "NOT_FOUND, UNAVAILABLE"
        ]
    );
}

#[test]
fn missing_file_exits_2() {
    let o = idem(
        &[
            "check-config",
            "crates/idem-cli/tests/fixtures/does-not-exist.json",
        ],
        None,
    );
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(stdout(&o), "");
    assert!(
        stderr(&o)
            .starts_with("idem: cannot read crates/idem-cli/tests/fixtures/does-not-exist.json: "),
        "{}",
        stderr(&o)
    );
    // A directory cannot be read as a file either.
    let o = idem(&["check-config", "crates/idem-cli/tests/fixtures"], None);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

#[test]
fn dash_reads_standard_input() {
    let text =
        std::fs::read_to_string(root().join("examples/service_config.json")).expect("example");
    let o = idem(&["check-config", "-"], Some(text.as_bytes()));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.starts_with("<stdin>: valid: 3 method config(s)"),
        "{out}"
    );
    assert_eq!(row(&out, "shop.v1.Orders/CreateOrder")[2], "4");

    // Malformed JSON on stdin: invalid, with the parser's line and column.
    let o = idem(
        &["check-config", "-"],
        Some(b"{\n  \"methodConfig\": [,]\n}"),
    );
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err == "<stdin>: invalid: invalid JSON at line 2, column 20: expected value\n",
        "{err}"
    );

    // Not an object.
    let o = idem(&["check-config", "-"], Some(b"[]"));
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("must be a JSON object"),
        "{}",
        stderr(&o)
    );

    // Not UTF-8: invalid, with the offset of the bad byte.
    let o = idem(&["check-config", "-"], Some(b"{\"a\": \"\xff\"}"));
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr(&o),
        "<stdin>: invalid: not UTF-8 text (bad byte at offset 7)\n"
    );
}

#[test]
fn help_and_usage_errors() {
    for args in [
        &["--help"][..],
        &["-h"],
        &["help"],
        &["check-config", "--help"],
    ] {
        let o = idem(args, None);
        assert_eq!(o.status.code(), Some(0), "{args:?}");
        let out = stdout(&o);
        assert!(out.contains("idem check-config FILE"), "{out}");
        assert!(out.contains("idem check-config -"), "{out}");
    }
    let o = idem(&["--version"], None);
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(stdout(&o), format!("idem {}\n", env!("CARGO_PKG_VERSION")));
    for (args, message) in [
        (&[][..], "idem: missing command"),
        (&["frobnicate"], "idem: unknown command \"frobnicate\""),
        (
            &["check-config"],
            "idem: check-config takes exactly one FILE",
        ),
        (
            &["check-config", "a", "b"],
            "idem: check-config takes exactly one FILE",
        ),
    ] {
        let o = idem(args, None);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(stderr(&o).starts_with(message), "{}", stderr(&o));
        assert!(stderr(&o).contains("Usage:"), "{}", stderr(&o));
    }
}

#[test]
fn an_unset_tenant_is_said_once_for_a_tenant_set_in_code() {
    let doc = br#"{"methodConfig": [{"name": [{"service": "s.v1.S"}], "idempotency": {}}, {"name": [{"service": "s.v1.T"}], "idempotency": {}}]}"#;
    let o = idem(&["check-config", "-"], Some(doc));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // No note on standard error: one line of the report says it, and that a tenant set
    // in code is fine.
    assert_eq!(stderr(&o), "");
    let out = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = out.lines().filter(|l| l.contains("tenant")).collect();
    assert_eq!(
        lines
            .iter()
            .filter(|l| l.starts_with("idem.tenant:"))
            .count(),
        1,
        "{out}"
    );
    assert!(
        out.contains(
            "idem.tenant: not in the config, so the server sets it in code (IdempotencyLayer::tenant"
        ),
        "{out}"
    );
    assert_eq!(out.matches("TENANT_SOURCE_MISSING").count(), 1, "{out}");
    let with_tenant =
        br#"{"methodConfig": [{"name": [{"service": "s.v1.S"}], "idempotency": {}}], "idem": {"tenant": {"single": "t"}}}"#;
    let o = idem(&["check-config", "-"], Some(with_tenant));
    assert_eq!(stderr(&o), "");
}

#[test]
fn hedged_methods_get_a_note_on_when_hedging_pays() {
    let doc = br#"{"methodConfig": [{"name": [{"service": "s.v1.S", "method": "M"}],
        "hedgingPolicy": {"maxAttempts": 3, "hedgingDelay": "0.05s"},
        "idempotency": {"inFlight": "ABORT"}}], "idem": {"tenant": {"single": "t"}}}"#;
    let o = idem(&["check-config", "-"], Some(doc));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("note: s.v1.S/M is hedged: it pays for slow instances"),
        "{err}"
    );
    assert!(err.contains("list ABORTED in nonFatalStatusCodes"), "{err}");
}

#[test]
fn the_memory_stores_sustained_rate_is_printed_per_bound() {
    // Defaults, several tenants: bytes bind first.
    let o = idem(&["check-config", "-"], Some(b"{}"));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stderr(&o), "", "the defaults allow over 1000 calls/s");
    let out = stdout(&o);
    let lines: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("idem.memoryStore sustained rate"))
        .take(5)
        .collect();
    assert_eq!(
        lines,
        [
            "idem.memoryStore sustained rate (new protected calls/s at which records reach \
             minRetention 120s as the bound fills; 200-byte responses, 440 bytes a record):",
            "  per tenant, entries 500000: 4166 calls/s",
            "  per tenant, bytes 67108864: 1271 calls/s (152520 records)",
            "  whole store, entries 2000000: 16666 calls/s",
            "  whole store, bytes 268435456: 5084 calls/s (610080 records)",
        ],
        "{out}"
    );
    // One tenant: the whole store is its share.
    let single = br#"{"idem": {"tenant": {"single": "t"}}}"#;
    let out = stdout(&idem(&["check-config", "-"], Some(single)));
    assert!(
        out.contains("  per tenant, bytes 268435456: 5084 calls/s (610080 records)\n"),
        "{out}"
    );
    // The former defaults: about 42 calls/s per tenant; warned (the memory store is in use).
    let former = br#"{"idem": {"memoryStore": {"maxEntries": 100000, "minRetention": "600s"}}}"#;
    let o = idem(&["check-config", "-"], Some(former));
    assert_eq!(o.status.code(), Some(0), "a warning, not an error");
    assert!(stdout(&o).contains("  per tenant, entries 25000: 41.6 calls/s\n"));
    assert!(stdout(&o).contains(", 1 warning(s)\n"));
    assert_eq!(
        stderr(&o),
        "warning: idem.memoryStore (per tenant, entries 25000): allows only 41.6 protected \
         calls/s (25000 records of 200-byte responses kept minRetention 600s); at a higher \
         sustained rate every new call is refused with RESOURCE_EXHAUSTED: raise the bound \
         or lower minRetention\n"
    );
    // With Redis the memory store is not in use: its rate is printed, not warned about.
    let redis =
        br#"{"idem": {"memoryStore": {"maxEntries": 10}, "redis": {"url": "redis://r:1/0"}}}"#;
    let o = idem(&["check-config", "-"], Some(redis));
    assert_eq!(stderr(&o), "");
    assert!(stdout(&o).contains("  whole store, entries 10: 0.0 calls/s\n"));
    // minRetention zero: no rate bounds the store.
    let zero = br#"{"idem": {"memoryStore": {"minRetention": "0s", "maxEntries": 1}}}"#;
    let o = idem(&["check-config", "-"], Some(zero));
    assert_eq!(stderr(&o), "");
    assert!(stdout(&o).contains(
        "  whole store, entries 1: any rate (minRetention 0s: completed records may be \
         evicted at once)\n"
    ));
}

#[test]
fn retry_guards_are_summed_up_and_bad_ones_named_by_path() {
    let o = idem(&["check-config", "examples/outage/breaker.json"], None);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("idem.client.retryBudget: none\n"), "{out}");
    assert!(
        out.contains(
            "idem.client.circuitBreaker: opens when 0.5 of at least 20 attempts over 1s fail \
             with DEADLINE_EXCEEDED,RESOURCE_EXHAUSTED,UNAVAILABLE (retries stop at half \
             that); open 0.5s"
        ),
        "{out}"
    );
    // A method config entry's own breaker: a line of its own, errors under its path.
    let own = br#"{"methodConfig": [{"name": [{"service": "a.B"}],
        "circuitBreaker": {"minCalls": 5, "openFor": "2s"}}]}"#;
    let o = idem(&["check-config", "-"], Some(own));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("idem.client.circuitBreaker: none\n"), "{out}");
    assert!(
        out.contains(
            "methodConfig[0].circuitBreaker: opens when 0.5 of at least 5 attempts over 10s"
        ) && out.contains("(its own, for a.B/*: instead of idem.client.circuitBreaker)\n"),
        "{out}"
    );
    let bad_own = br#"{"methodConfig": [{"name": [{"service": "a.B"}],
        "circuitBreaker": {"failureRatio": 2}}]}"#;
    let o = idem(&["check-config", "-"], Some(bad_own));
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o)
            .contains("methodConfig[0].circuitBreaker.failureRatio: must be a number in (0, 1]"),
        "{}",
        stderr(&o)
    );
    let o = idem(&["check-config", "examples/outage/budget.json"], None);
    assert!(
        stdout(&o).contains(
            "idem.client.retryBudget: ratio 0.1 of the calls over 10s, plus 10 per second"
        ),
        "{}",
        stdout(&o)
    );
    let bad = br#"{"idem": {"client": {"retryBudget": {"ratio": 0},
        "circuitBreaker": {"window": "0s", "halfOpenProbes": 0}}}}"#;
    let o = idem(&["check-config", "-"], Some(bad));
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(
        errors,
        [
            "error: idem.client.retryBudget.ratio: must be a number in (0, 1]",
            "error: idem.client.circuitBreaker.window: must be a duration > 0",
            "error: idem.client.circuitBreaker.halfOpenProbes: must be an integer in 1..=1000",
        ],
        "{err}"
    );
}

#[test]
fn json_output_gives_the_retry_guards() {
    let o = idem(
        &["check-config", "--json", "examples/outage/breaker.json"],
        None,
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("json");
    let g = &v["retryGuards"];
    assert!(g["retryBudget"].is_null(), "{g}");
    assert_eq!(g["circuitBreaker"]["failureRatio"], 0.5, "{g}");
    assert_eq!(g["circuitBreaker"]["minCalls"], 20, "{g}");
    assert_eq!(g["circuitBreaker"]["openFor"], "0.5s", "{g}");
    assert_eq!(
        g["circuitBreaker"]["failureStatusCodes"],
        serde_json::json!(["DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "UNAVAILABLE"]),
        "{g}"
    );
    let own = br#"{"methodConfig": [{"name": [{"service": "a.B"}],
        "circuitBreaker": {"minCalls": 5}}],
        "idem": {"client": {"retryBudget": {"ratio": 0.2}}}}"#;
    let o = idem(&["check-config", "--json", "-"], Some(own));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("json");
    let g = &v["retryGuards"];
    assert_eq!(g["retryBudget"]["ratio"], 0.2, "{g}");
    assert!(g["circuitBreaker"].is_null(), "{g}");
    let own = &g["methodCircuitBreakers"][0];
    assert_eq!(own["path"], "methodConfig[0]", "{g}");
    assert_eq!(own["names"], serde_json::json!(["a.B/*"]), "{g}");
    assert_eq!(own["minCalls"], 5, "{g}");
    let o = idem(
        &["check-config", "--json", "-"],
        Some(br#"{"methodConfig": 1}"#),
    );
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("json");
    assert!(v["retryGuards"].is_null());
}
