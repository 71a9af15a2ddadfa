use prost::Message as _;
use prost_types::{
    FileDescriptorProto, FileDescriptorSet, MethodDescriptorProto, MethodOptions,
    ServiceDescriptorProto,
};

use super::*;

fn rpc(name: &str, level: Option<i32>, client: bool, server: bool) -> MethodDescriptorProto {
    MethodDescriptorProto {
        name: Some(name.into()),
        input_type: Some(".payments.v1.Req".into()),
        output_type: Some(".payments.v1.Resp".into()),
        options: level.map(|l| MethodOptions {
            idempotency_level: Some(l),
            ..Default::default()
        }),
        client_streaming: Some(client),
        server_streaming: Some(server),
    }
}

fn set() -> FileDescriptorSet {
    FileDescriptorSet {
        file: vec![FileDescriptorProto {
            name: Some("payments/v1/payments.proto".into()),
            package: Some("payments.v1".into()),
            service: vec![ServiceDescriptorProto {
                name: Some("Payments".into()),
                method: vec![
                    rpc("Charge", None, false, false),
                    rpc("GetCharge", Some(1), false, true),
                    rpc("Refund", Some(2), true, false),
                    rpc("Chat", Some(0), true, true),
                    rpc("Odd", Some(7), false, false),
                ],
                options: None,
            }],
            ..Default::default()
        }],
    }
}

#[test]
fn reads_levels_and_streaming_kinds() {
    let d = Descriptors::from_file_descriptor_set(&set().encode_to_vec()).unwrap();
    assert_eq!(d.services().collect::<Vec<_>>(), ["payments.v1.Payments"]);
    let got: Vec<_> = d
        .methods()
        .map(|m| (m.full_name(), m.idempotency_level(), m.streaming()))
        .collect();
    use IdempotencyLevel::*;
    assert_eq!(
        got,
        [
            (
                "payments.v1.Payments/Charge".to_owned(),
                IdempotencyUnknown,
                Streaming::Unary
            ),
            (
                "payments.v1.Payments/GetCharge".to_owned(),
                NoSideEffects,
                Streaming::Server
            ),
            (
                "payments.v1.Payments/Refund".to_owned(),
                Idempotent,
                Streaming::Client
            ),
            (
                "payments.v1.Payments/Chat".to_owned(),
                IdempotencyUnknown,
                Streaming::Bidi
            ),
            // A level this reader does not know is read as side effects: the safe side.
            (
                "payments.v1.Payments/Odd".to_owned(),
                IdempotencyUnknown,
                Streaming::Unary
            ),
        ]
    );
    assert!(d.method_by_path("/payments.v1.Payments/Charge").is_some());
    assert!(d.method_by_path("/payments.v1.Payments/Nope").is_none());
}

#[test]
fn refuses_what_is_not_a_file_descriptor_set() {
    for bytes in [
        &b"{\"methodConfig\": []}"[..],
        b"\xff\xff\xff",
        b"",
        b"hello",
    ] {
        let e = Descriptors::from_file_descriptor_set(bytes).unwrap_err();
        assert!(
            matches!(e, DescriptorError::NotAFileDescriptorSet(_)),
            "{bytes:?}: {e}"
        );
        assert!(
            e.to_string().starts_with("not a FileDescriptorSet: "),
            "{e}"
        );
    }
}

#[test]
fn refuses_a_service_described_twice() {
    let mut s = set();
    s.file.push(FileDescriptorProto {
        name: Some("other.proto".into()),
        ..s.file[0].clone()
    });
    let e = Descriptors::from_file_descriptor_set(&s.encode_to_vec()).unwrap_err();
    assert_eq!(
        e,
        DescriptorError::DuplicateService("payments.v1.Payments".into())
    );
}

proptest::proptest! {
    /// Untrusted bytes never panic the reader.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
        let _ = Descriptors::from_file_descriptor_set(&bytes);
    }
}

#[cfg(feature = "protox")]
mod compile {
    use super::*;

    fn dir(files: &[(&str, &str)]) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!(
            "idem-core-protox-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        for (name, text) in files {
            let p = d.join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        d
    }

    #[test]
    fn compiles_a_proto_without_protoc() {
        let d = dir(&[(
            "p/v1/p.proto",
            "syntax = \"proto3\";\npackage p.v1;\nmessage M {}\nservice S {\n  rpc Get(M) returns (M) { option idempotency_level = NO_SIDE_EFFECTS; }\n  rpc Put(M) returns (M);\n}\n",
        )]);
        let got = Descriptors::compile(&["p/v1/p.proto"], &[&d]).unwrap();
        let levels: Vec<_> = got.methods().map(|m| m.idempotency_level()).collect();
        assert_eq!(
            levels,
            [
                IdempotencyLevel::NoSideEffects,
                IdempotencyLevel::IdempotencyUnknown
            ]
        );
    }

    #[test]
    fn a_syntax_error_names_its_file_and_line() {
        let d = dir(&[(
            "bad.proto",
            "syntax = \"proto3\";\npackage p;\nservice S {\n  rpc Get(M) returns\n}\n",
        )]);
        let e = Descriptors::compile(&["bad.proto"], &[&d]).unwrap_err();
        let text = e.to_string();
        assert!(text.starts_with("bad.proto:"), "{text}");
        assert!(matches!(e, DescriptorError::Compile(_)));
    }

    #[test]
    fn a_missing_import_is_named() {
        let d = dir(&[(
            "a.proto",
            "syntax = \"proto3\";\nimport \"b/missing.proto\";\npackage p;\n",
        )]);
        let e = Descriptors::compile(&["a.proto"], &[&d])
            .unwrap_err()
            .to_string();
        assert!(e.contains("b/missing.proto"), "{e}");
        assert!(e.starts_with("a.proto:2:"), "{e}");
    }
}
