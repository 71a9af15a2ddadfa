//! The demo as an example of the root package, with every store built in:
//! `cargo run --release --example demo -- --store redis --instances 3 …` (the same flags
//! and output as `cargo run --release -p idem-demo`, which builds only the in-memory
//! store unless given `--features redis` / `--features postgres`). See
//! [`idem_demo::cli`].

fn main() {
    idem_demo::cli::main()
}
