//! The fault injector: a tower layer in front of everything else on a demo server,
//! failing calls before the handler or losing their responses after it, as drawn from
//! a seeded generator.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tonic::Status;
use tower::{Layer, Service};

use crate::Options;
use crate::outage::Outage;

/// The layer: [`Options`]' fault probabilities and latency with their own seeded
/// generator. Clones share the generator and the count of attempts.
#[derive(Clone)]
pub struct Faults {
    unavailable: f64,
    drop: f64,
    latency: Duration,
    rng: Arc<Mutex<StdRng>>,
    attempts: Arc<AtomicU64>,
    outage: Outage,
}

impl Faults {
    /// Faults drawn from `o`'s probabilities with their own seeded generator.
    pub fn new(o: &Options, seed: u64) -> Self {
        Faults {
            unavailable: o.unavailable,
            drop: o.drop,
            latency: o.latency,
            rng: Arc::new(Mutex::new(StdRng::seed_from_u64(seed))),
            attempts: Arc::new(AtomicU64::new(0)),
            outage: Outage::default(),
        }
    }

    /// The same faults, and every call fails while `outage` is under way.
    pub fn with_outage(mut self, outage: Outage) -> Self {
        self.outage = outage;
        self
    }

    /// Calls that reached this injector.
    pub fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::Relaxed)
    }

    /// Counts a call and draws what happens to it.
    fn draw(&self) -> CallFault {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        if self.outage.attempt() {
            return CallFault::Before;
        }
        let x: f64 = self.rng.lock().expect("rng lock").random();
        if x < self.unavailable {
            CallFault::Before
        } else if x < self.unavailable + self.drop {
            CallFault::DropResponse
        } else {
            CallFault::None
        }
    }
}

impl<S> Layer<S> for Faults {
    type Service = FaultService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        FaultService {
            inner,
            faults: self.clone(),
        }
    }
}

/// The service of [`Faults`].
#[derive(Clone)]
pub struct FaultService<S> {
    inner: S,
    faults: Faults,
}

/// What the injector does to one call.
enum CallFault {
    /// Nothing.
    None,
    /// UNAVAILABLE before the handler runs.
    Before,
    /// The handler runs; its response is lost on the way back.
    DropResponse,
}

type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S, B, RB> Service<http::Request<B>> for FaultService<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
    RB: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    RB::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let fault = self.faults.draw();
        let latency = self.faults.latency;
        Box::pin(async move {
            if let CallFault::Before = fault {
                return Ok(Status::unavailable("injected: before the handler").into_http());
            }
            if !latency.is_zero() {
                tokio::time::sleep(latency).await;
            }
            let res = inner.call(req).await?;
            if let CallFault::DropResponse = fault {
                // The handler ran (its response is complete: unary). Lose it on the way.
                drop(res);
                return Ok(Status::unavailable("injected: response lost").into_http());
            }
            Ok(res.map(tonic::body::Body::new))
        })
    }
}
