//! `idem check-config` with the services' protos or descriptor set, and `idem init`,
//! run as real processes (issue 29).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use prost::Message as _;
use serde_json::Value;

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
            // A command that fails before it reads its input (a usage error) closes the
            // pipe first: that is not the test's concern.
            let _ = input.write_all(text);
        }
    }
    child.wait_with_output().expect("idem runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).expect("utf-8")
}

/// A scratch directory of this test process.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("idem-cli-proto-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

const PAYMENTS: [&str; 4] = [
    "--proto",
    "payments/v1/payments.proto",
    "-I",
    "examples/payments/proto",
];

fn check_payments(config: &str, json: bool) -> Output {
    let mut args = vec!["check-config"];
    args.extend(PAYMENTS);
    if json {
        args.push("--json");
    }
    args.push("-");
    idem(&args, Some(config.as_bytes()))
}

const TYPOS: [(&str, &str, &str); 3] = [
    (
        r#"{"methodConfig": [{"name": [{"service": "payments.v1.Payments", "method": "Charg"}], "idempotency": {}}]}"#,
        "methodConfig[0].name[0]",
        "no method `payments.v1.Payments/Charg` in the descriptors; did you mean `payments.v1.Payments/Charge`?",
    ),
    (
        r#"{"methodConfig": [{"name": [{"service": "payment.v1.Payments", "method": "Charge"}], "idempotency": {}}]}"#,
        "methodConfig[0].name[0]",
        "no service `payment.v1.Payments` in the descriptors; did you mean `payments.v1.Payments/Charge`?",
    ),
    (
        r#"{"methodConfig": [{"name": [{"service": "payments.v1.Payments", "method": "Charge"}], "idempotence": {}}]}"#,
        "methodConfig[0].idempotence",
        "unknown field, ignored; did you mean \"idempotency\"?",
    ),
];

#[test]
fn each_typo_is_refused_with_the_proto() {
    for (config, path, message) in TYPOS {
        // Without the proto, today's behaviour: valid (a typo is at most a warning).
        let o = idem(&["check-config", "-"], Some(config.as_bytes()));
        assert_eq!(o.status.code(), Some(0), "{config}: {}", text(&o.stderr));

        let o = check_payments(config, false);
        assert_eq!(o.status.code(), Some(1), "{config}: {}", text(&o.stderr));
        let err = text(&o.stderr);
        assert!(err.contains(&format!("error: {path}: {message}")), "{err}");

        let o = check_payments(config, true);
        assert_eq!(o.status.code(), Some(1));
        let v: Value = serde_json::from_slice(&o.stdout).expect("json");
        assert_eq!(v["valid"], false);
        assert_eq!(v["errors"][0]["path"], path);
        assert!(
            v["errors"][0]["message"]
                .as_str()
                .unwrap()
                .starts_with(message),
            "{v}"
        );
    }
}

#[test]
fn the_example_config_is_valid_and_protects_charge_by_its_level() {
    let config =
        std::fs::read_to_string(root().join("examples/payments/service_config.json")).unwrap();
    let o = check_payments(&config, true);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(v["valid"], true);
    assert_eq!(v["errors"], Value::Array(vec![]));
    let methods = v["methods"].as_array().unwrap();
    let charge = &methods[0];
    assert_eq!(charge["method"], "payments.v1.Payments/Charge");
    assert_eq!(charge["idempotencyLevel"], "IDEMPOTENCY_UNKNOWN");
    assert_eq!(charge["protected"], true);
    assert_eq!(charge["keyRequired"], false);
    assert_eq!(charge["retryPolicy"]["maxAttempts"], 4);
    assert_eq!(methods[1]["protected"], false);
}

/// What `--json` says of one method: level, streaming, protected, key required,
/// retried, hedged.
fn summary(m: &Value) -> (String, String, String, bool, bool, bool, bool) {
    (
        m["method"]
            .as_str()
            .unwrap()
            .trim_start_matches("levels.v1.Levels/")
            .to_owned(),
        m["idempotencyLevel"].as_str().unwrap().to_owned(),
        m["streaming"].as_str().unwrap().to_owned(),
        m["protected"].as_bool().unwrap(),
        m["keyRequired"].as_bool().unwrap(),
        !m["retryPolicy"].is_null(),
        !m["hedgingPolicy"].is_null(),
    )
}

#[test]
fn every_level_and_streaming_kind_gets_its_policy() {
    // A retry policy for the whole service, hedging for one NO_SIDE_EFFECTS method.
    let config = r#"{
      "methodConfig": [
        {"name": [{"service": "levels.v1.Levels"}], "retryPolicy": {"maxAttempts": 3,
          "initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2,
          "retryableStatusCodes": ["UNAVAILABLE"]}},
        {"name": [{"service": "levels.v1.Levels", "method": "FreeUnary"}],
          "hedgingPolicy": {"maxAttempts": 2, "hedgingDelay": "0.05s"}}
      ],
      "idem": {"tenant": {"single": "t"}}
    }"#;
    let o = idem(
        &[
            "check-config",
            "--json",
            "--proto",
            "levels/v1/levels.proto",
            "-I",
            "crates/idem-cli/tests/fixtures",
            "-",
        ],
        Some(config.as_bytes()),
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).expect("json");
    let got: Vec<_> = v["methods"]
        .as_array()
        .unwrap()
        .iter()
        .map(summary)
        .collect();
    let row = |m: &str, l: &str, s: &str, p, k, r, h| {
        (m.to_owned(), l.to_owned(), s.to_owned(), p, k, r, h)
    };
    let (u, f, i) = ("IDEMPOTENCY_UNKNOWN", "NO_SIDE_EFFECTS", "IDEMPOTENT");
    assert_eq!(
        got,
        [
            // Side effects: protected (key optional) and retried, except bidi: never protected.
            row("UnknownUnary", u, "unary", true, false, true, false),
            row("UnknownClient", u, "client", true, false, true, false),
            row("UnknownServer", u, "server", true, false, true, false),
            row("UnknownBidi", u, "bidi", false, false, true, false),
            // Safe to repeat: retried without protection; the hedged one hedged.
            row("FreeUnary", f, "unary", false, false, false, true),
            row("FreeClient", f, "client", false, false, true, false),
            row("FreeServer", f, "server", false, false, true, false),
            row("FreeBidi", f, "bidi", false, false, true, false),
            row("SameUnary", i, "unary", false, false, true, false),
            row("SameClient", i, "client", false, false, true, false),
            row("SameServer", i, "server", false, false, true, false),
            row("SameBidi", i, "bidi", false, false, true, false),
        ]
    );
    let notes = v["notes"].to_string();
    assert!(
        notes.contains("UnknownBidi is bidirectional streaming"),
        "{notes}"
    );
}

#[test]
fn hedging_an_idempotent_method_or_retrying_an_opted_out_one_is_an_error() {
    for (config, message) in [
        (
            r#"{"methodConfig": [{"name": [{"service": "payments.v1.Payments", "method": "SetDescription"}], "hedgingPolicy": {"maxAttempts": 2}}]}"#,
            "is IDEMPOTENT: only NO_SIDE_EFFECTS methods may be hedged without protection",
        ),
        (
            r#"{"methodConfig": [{"name": [{"service": "payments.v1.Payments", "method": "Charge"}], "idempotency": false, "retryPolicy": {"maxAttempts": 2, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}}]}"#,
            "has side effects and is opted out of idempotency: retries would run it twice",
        ),
    ] {
        let o = check_payments(config, false);
        assert_eq!(o.status.code(), Some(1));
        assert!(text(&o.stderr).contains(message), "{}", text(&o.stderr));
    }
    // The opt-out alone is valid, with a warning naming the method.
    let o = check_payments(
        r#"{"methodConfig": [{"name": [{"service": "payments.v1.Payments", "method": "Charge"}], "idempotency": false}]}"#,
        false,
    );
    assert_eq!(o.status.code(), Some(0));
    assert!(
        text(&o.stderr).contains(
            "warning: methodConfig[0].idempotency: payments.v1.Payments/Charge has side effects"
        ),
        "{}",
        text(&o.stderr)
    );
}

#[test]
fn init_output_passes_strict_check_config() {
    for (proto, include) in [
        ("payments/v1/payments.proto", "examples/payments/proto"),
        ("levels/v1/levels.proto", "crates/idem-cli/tests/fixtures"),
    ] {
        let o = idem(&["init", "--proto", proto, "-I", include], None);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
        assert!(
            text(&o.stderr).contains("tenant source is left to you"),
            "{}",
            text(&o.stderr)
        );
        let config = o.stdout;
        let v: Value = serde_json::from_slice(&config).expect("init prints JSON");
        assert!(
            v["methodConfig"]
                .as_array()
                .unwrap()
                .iter()
                .all(|e| !e["retryPolicy"].is_null())
        );
        let check = idem(
            &[
                "check-config",
                "--strict",
                "--json",
                "--proto",
                proto,
                "-I",
                include,
                "-",
            ],
            Some(&config),
        );
        assert_eq!(
            check.status.code(),
            Some(0),
            "{}{}",
            text(&check.stdout),
            text(&check.stderr)
        );
        let v: Value = serde_json::from_slice(&check.stdout).unwrap();
        for m in v["methods"].as_array().unwrap() {
            // Every method retried; side-effecting ones protected with a required key.
            assert!(!m["retryPolicy"].is_null(), "{m}");
            let side_effects =
                m["idempotencyLevel"] == "IDEMPOTENCY_UNKNOWN" && m["streaming"] != "bidi";
            assert_eq!(m["protected"].as_bool(), Some(side_effects), "{m}");
            assert_eq!(m["keyRequired"].as_bool(), Some(side_effects), "{m}");
        }
        if proto.contains("payments") {
            assert!(
                v["notes"]
                    .to_string()
                    .contains("GetCharge is NO_SIDE_EFFECTS: it may be hedged"),
                "{v}"
            );
        }
    }
}

#[test]
fn strict_turns_a_warning_into_an_error() {
    let config = r#"{"methodConfig": [{"name": [{"service": "s"}], "timeout": "0s"}]}"#;
    assert_eq!(
        idem(&["check-config", "-"], Some(config.as_bytes()))
            .status
            .code(),
        Some(0)
    );
    let o = idem(&["check-config", "--strict", "-"], Some(config.as_bytes()));
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stderr).contains("(an error in strict mode)"),
        "{}",
        text(&o.stderr)
    );
}

fn payments_set(service: &str) -> Vec<u8> {
    use prost_types::{
        FileDescriptorProto, FileDescriptorSet, MethodDescriptorProto, ServiceDescriptorProto,
    };
    FileDescriptorSet {
        file: vec![FileDescriptorProto {
            name: Some("other.proto".into()),
            package: Some("other.v1".into()),
            service: vec![ServiceDescriptorProto {
                name: Some(service.into()),
                method: vec![MethodDescriptorProto {
                    name: Some("Do".into()),
                    ..Default::default()
                }],
                options: None,
            }],
            ..Default::default()
        }],
    }
    .encode_to_vec()
}

#[test]
fn a_descriptor_set_is_read_and_one_without_the_service_is_refused() {
    let d = scratch("fds");
    let set = d.join("other.bin");
    std::fs::write(&set, payments_set("Other")).unwrap();
    let set = set.to_string_lossy().into_owned();
    let config =
        std::fs::read_to_string(root().join("examples/payments/service_config.json")).unwrap();
    let o = idem(
        &["check-config", "--descriptor-set", &set, "-"],
        Some(config.as_bytes()),
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("error: methodConfig[0].name[0]: no service `payments.v1.Payments` in the descriptors; the descriptors have `other.v1.Other`"),
        "{}",
        text(&o.stderr)
    );
    let ok = r#"{"methodConfig": [{"name": [{"service": "other.v1.Other", "method": "Do"}], "idempotency": {}}]}"#;
    let o = idem(
        &["check-config", "--descriptor-set", &set, "-"],
        Some(ok.as_bytes()),
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
}

#[test]
fn bad_input_gets_a_clear_error_and_exit_2() {
    let d = scratch("bad");
    std::fs::write(
        d.join("broken.proto"),
        "syntax = \"proto3\";\npackage b;\nservice S {\n  rpc Do(M) returns\n}\n",
    )
    .unwrap();
    std::fs::write(
        d.join("importer.proto"),
        "syntax = \"proto3\";\nimport \"not/there.proto\";\npackage c;\n",
    )
    .unwrap();
    std::fs::write(
        d.join("undefined.proto"),
        "syntax = \"proto3\";\npackage u;\nservice S {\n  rpc Do(Missing) returns (Missing);\n}\n",
    )
    .unwrap();
    let dir = d.to_string_lossy().into_owned();
    let config = br#"{"methodConfig": []}"#;
    for (proto, expected) in [
        (
            "broken.proto",
            "idem: cannot compile the protos: broken.proto:5:1: ",
        ),
        (
            "importer.proto",
            "idem: cannot compile the protos: importer.proto:2:1: import 'not/there.proto' not found",
        ),
        (
            "undefined.proto",
            "idem: cannot compile the protos: undefined.proto:4:",
        ),
        ("absent.proto", "idem: cannot compile the protos: "),
    ] {
        for command in [
            &["check-config", "--proto", proto, "-I", &dir, "-"][..],
            &["init", "--proto", proto, "-I", &dir],
        ] {
            let o = idem(command, Some(config));
            assert_eq!(o.status.code(), Some(2), "{command:?}: {}", text(&o.stderr));
            let err = text(&o.stderr);
            assert!(err.starts_with(expected), "{command:?}: {err}");
            assert!(!err.contains("panicked"), "{err}");
        }
    }
    // A file that is not a FileDescriptorSet: the config itself, random bytes, nothing.
    std::fs::write(d.join("random.bin"), [0xff_u8, 0x13, 0x00, 0x9a]).unwrap();
    std::fs::write(d.join("empty.bin"), []).unwrap();
    for file in [
        "examples/payments/service_config.json".to_owned(),
        format!("{dir}/random.bin"),
        format!("{dir}/empty.bin"),
    ] {
        let o = idem(
            &["check-config", "--descriptor-set", &file, "-"],
            Some(config),
        );
        assert_eq!(o.status.code(), Some(2), "{file}: {}", text(&o.stderr));
        assert!(
            text(&o.stderr).contains(": not a FileDescriptorSet: "),
            "{}",
            text(&o.stderr)
        );
    }
    let o = idem(
        &[
            "check-config",
            "--descriptor-set",
            "/nonexistent/x.bin",
            "-",
        ],
        Some(config),
    );
    assert_eq!(o.status.code(), Some(2));
    // Usage errors.
    for args in [
        &["check-config", "--proto"][..],
        &[
            "check-config",
            "--proto",
            "a.proto",
            "--descriptor-set",
            "b.bin",
            "-",
        ],
        &["check-config", "--frobnicate", "-"],
        &["init"],
    ] {
        let o = idem(args, Some(config));
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(text(&o.stderr).contains("Usage:"), "{}", text(&o.stderr));
    }
}
