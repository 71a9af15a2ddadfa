//! Compiles the proto with protox (no `protoc`) and writes its descriptor set beside the
//! generated code, for `include_bytes!` in `src/main.rs`.

use std::path::PathBuf;

use prost::Message as _;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let fds = protox::compile(["payments/v1/payments.proto"], ["proto"])?;
    // The same bytes tonic-reflection serves. With `protoc` (`compile_protos`),
    // `.file_descriptor_set_path(out.join("payments_descriptor.bin"))` writes them;
    // `compile_fds` does not, so they are written here.
    std::fs::write(out.join("payments_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
