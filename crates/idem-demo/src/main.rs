//! The demo binary (`cargo run --release -p idem-demo -- …`): see [`idem_demo::cli`] for
//! its flags and output. The in-memory default builds no Redis or PostgreSQL client;
//! `--features redis` / `--features postgres` add those stores.

fn main() {
    idem_demo::cli::main()
}
