//! idem on a service's own proto: `payments.v1.Payments`, whose config names no
//! `idempotency` object at all. The proto's `idempotency_level` decides: `Charge` (no
//! level) is protected on the server and keyed by the client; `GetCharge`
//! (`NO_SIDE_EFFECTS`) and `SetDescription` (`IDEMPOTENT`) are retried without a key.
//!
//! Runs a server and a client on 127.0.0.1, charges twice with one key, and exits 0
//! once it has seen the second charge replayed and the handler run once:
//! `cargo run -p idem-example-payments`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use idem::client::retry::RetryLayer;
use idem::core::config::ServiceConfig;
use idem::core::descriptor::Descriptors;
use idem::core::key::IdempotencyKey;
use idem::server::idempotency::IdempotencyLayer;
use tonic::{Request, Response, Status};

/// The code tonic-prost-build generated from `proto/payments/v1/payments.proto`.
#[allow(unreachable_pub, missing_docs)]
mod pb {
    tonic::include_proto!("payments.v1");
}
use pb::payments_client::PaymentsClient;
use pb::payments_server::{Payments, PaymentsServer};
use pb::{ChargeReply, ChargeRequest, GetChargeRequest, SetDescriptionRequest};

/// The descriptor set build.rs wrote: the same bytes tonic-reflection would serve.
const DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/payments_descriptor.bin"));

/// A payments service that counts the charges it really makes.
#[derive(Default)]
struct Ledger {
    charges: AtomicU64,
}

#[tonic::async_trait]
impl Payments for Arc<Ledger> {
    async fn charge(&self, req: Request<ChargeRequest>) -> Result<Response<ChargeReply>, Status> {
        let n = self.charges.fetch_add(1, Ordering::SeqCst) + 1;
        let req = req.into_inner();
        Ok(Response::new(ChargeReply {
            charge_id: format!("ch_{n}"),
            amount_cents: req.amount_cents,
            description: String::new(),
        }))
    }

    async fn get_charge(
        &self,
        req: Request<GetChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        Ok(Response::new(ChargeReply {
            charge_id: req.into_inner().charge_id,
            ..ChargeReply::default()
        }))
    }

    async fn set_description(
        &self,
        req: Request<SetDescriptionRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        let req = req.into_inner();
        Ok(Response::new(ChargeReply {
            charge_id: req.charge_id,
            amount_cents: 0,
            description: req.description,
        }))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Found from the example's manifest: the directory `cargo run` gives it, else the
    // one it was built in.
    let dir = std::env::var("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_owned());
    let config_path = format!("{dir}/service_config.json");
    let config = ServiceConfig::from_file(config_path)?;
    let descriptors = Arc::new(Descriptors::from_file_descriptor_set(DESCRIPTOR_SET)?);

    // Server: the descriptors say Charge has side effects, so it is protected.
    let idempotency = IdempotencyLayer::from_config(&config)
        .descriptors(descriptors.clone())
        .check()?;
    let ledger = Arc::new(Ledger::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tonic::transport::Server::builder()
        .layer(idempotency)
        .add_service(PaymentsServer::new(ledger.clone()))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    let server = tokio::spawn(server);

    // Client: the same descriptors decide which calls carry a key.
    let retry = RetryLayer::builder()
        .service_config(config)
        .descriptors(descriptors)
        .build()?;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut client =
        PaymentsClient::new(tower::ServiceBuilder::new().layer(retry).service(channel));

    // One business intent, one key: the application sends the charge twice.
    let key = IdempotencyKey::generate();
    let charge = || {
        let mut req = Request::new(ChargeRequest {
            account: "acct-1".into(),
            amount_cents: 1250,
        });
        idem::client::with_key(&mut req, &key);
        req
    };
    let first = client.charge(charge()).await?;
    let second = client.charge(charge()).await?;
    let read = client
        .get_charge(GetChargeRequest {
            charge_id: first.get_ref().charge_id.clone(),
        })
        .await?;

    let ran = ledger.charges.load(Ordering::SeqCst);
    println!(
        "charge {}: first replayed {}, second replayed {}; handler ran {ran} time(s); read {}",
        first.get_ref().charge_id,
        idem::client::is_replayed(&first),
        idem::client::is_replayed(&second),
        read.get_ref().charge_id,
    );
    if ran != 1 || !idem::client::is_replayed(&second) || first.get_ref() != second.get_ref() {
        return Err("the second charge was not a replay of the first".into());
    }
    server.abort();
    Ok(())
}
