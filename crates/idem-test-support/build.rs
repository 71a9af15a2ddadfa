//! Compiles `proto/` for the examples, tests and benchmarks with `protox`, so a fresh
//! machine needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=../../proto");
    let fds = protox::compile(
        ["shop/v1/orders.proto", "stream/v1/stream.proto"],
        ["../../proto"],
    )?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
