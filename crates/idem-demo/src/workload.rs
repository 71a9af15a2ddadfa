//! The demo's workload: `CreateOrder` intents fired at a chosen concurrency, each with
//! its own key reused by every application retry, and the tally of what they did.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_core::key::IdempotencyKey;
use idem_test_support::shop::CreateOrderRequest;
use idem_test_support::shop::orders_client::OrdersClient;
use tonic::Request;

use crate::history::History;
use crate::outage::Outage;
use crate::{BoxError, Options, RunReport};

/// What the callers saw in one run.
pub struct Workload {
    latencies: Vec<Duration>,
    /// Calls answered with `x-idempotency-replayed: true`.
    replays: Arc<AtomicU64>,
    /// Every intent's calls and the orders its OKs named.
    history: Arc<History>,
    app_calls: u64,
    elapsed: Duration,
}

/// Fires `o.intents` CreateOrder intents through `client` at `o.concurrency`, each with
/// its own key (with idem) reused by every application retry; `done` counts finished
/// intents as they finish.
pub async fn workload<S>(
    o: &Options,
    with_idem: bool,
    label: &'static str,
    client: &OrdersClient<S>,
    done: Arc<AtomicU64>,
) -> Result<Workload, BoxError>
where
    S: tonic::client::GrpcService<tonic::body::Body> + Clone + Send + 'static,
    S::Future: Send,
    S::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <S::ResponseBody as http_body::Body>::Error: Into<BoxError> + Send,
    S::Error: Into<BoxError>,
{
    workload_with_outage(o, with_idem, label, client, done, Outage::default()).await
}

/// [`workload`], counting the calls made during `outage` (see [`Outage`]); in a run
/// with `--outage-after`, the application waits between its retries and keeps trying
/// until 30 s after the outage.
pub async fn workload_with_outage<S>(
    o: &Options,
    with_idem: bool,
    label: &'static str,
    client: &OrdersClient<S>,
    done: Arc<AtomicU64>,
    outage: Outage,
) -> Result<Workload, BoxError>
where
    S: tonic::client::GrpcService<tonic::body::Body> + Clone + Send + 'static,
    S::Future: Send,
    S::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <S::ResponseBody as http_body::Body>::Error: Into<BoxError> + Send,
    S::Error: Into<BoxError>,
{
    let started = Instant::now();
    let app_calls = Arc::new(AtomicU64::new(0));
    let replays = Arc::new(AtomicU64::new(0));
    let history = Arc::new(History::default());
    let sem = Arc::new(tokio::sync::Semaphore::new(o.concurrency));
    let progress = show_progress(o, label, done.clone());
    let mut tasks = Vec::with_capacity(o.intents);
    for n in 0..o.intents {
        let permit = sem.clone().acquire_owned().await?;
        let client = client.clone();
        let done = done.clone();
        let app_calls = app_calls.clone();
        let replays = replays.clone();
        let history = history.clone();
        let app_retries = o.app_retries;
        let outage = outage.clone();
        let wait_out = o
            .outage_after
            .map(|_| o.outage_for + Duration::from_secs(30));
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let intent = format!("intent-{n}");
            let t0 = Instant::now();
            let calls = (&*app_calls, &*replays, &*history);
            let retries = AppRetries {
                max: app_retries,
                wait_out: wait_out.map(|d| (d, &outage)),
            };
            let ok = one_intent(client, n, &intent, with_idem, retries, calls).await;
            done.fetch_add(1, Ordering::Relaxed);
            (intent, ok, t0.elapsed())
        }));
    }
    let mut latencies = Vec::with_capacity(o.intents);
    // Whether each intent got its OK is in the history.
    for t in tasks {
        let (_, _, latency) = t.await?;
        latencies.push(latency);
    }
    let _ = progress.await;
    latencies.sort();
    Ok(Workload {
        latencies,
        replays,
        history,
        app_calls: app_calls.load(Ordering::Relaxed),
        elapsed: started.elapsed(),
    })
}

/// How the application retries an intent.
struct AppRetries<'a> {
    /// Retries after the first call.
    max: u32,
    /// An outage run: wait between retries, keep retrying for this long, count calls.
    wait_out: Option<(Duration, &'a Outage)>,
}

/// One business intent: one key, created here and reused by every application retry.
/// Retries codes that say "nothing was decided" or "not yet": UNAVAILABLE, CANCELLED (not
/// by this caller), DEADLINE_EXCEEDED, ABORTED, RESOURCE_EXHAUSTED.
async fn one_intent<S>(
    mut client: OrdersClient<S>,
    n: usize,
    intent: &str,
    with_idem: bool,
    retries: AppRetries<'_>,
    (app_calls, replays, history): (&AtomicU64, &AtomicU64, &History),
) -> bool
where
    S: tonic::client::GrpcService<tonic::body::Body>,
    S::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <S::ResponseBody as http_body::Body>::Error: Into<BoxError> + Send,
    S::Error: Into<BoxError>,
{
    let key = IdempotencyKey::generate();
    let started = Instant::now();
    let mut tries = 0u32;
    loop {
        if tries > 0 && retries.wait_out.is_none() {
            // A caller backs off before trying again (10 ms doubling to 1 s): a key in
            // flight on an instance cut off from its store answers ABORTED at once
            // until that instance's completion lands.
            let backoff = Duration::from_millis(10 << (tries - 1).min(7));
            tokio::time::sleep(backoff.min(Duration::from_secs(1))).await;
        }
        app_calls.fetch_add(1, Ordering::Relaxed);
        history.attempt(intent);
        if let Some((_, outage)) = retries.wait_out {
            outage.call();
        }
        let mut req = Request::new(CreateOrderRequest {
            customer_id: format!("customer-{}", n % 97),
            sku: "sku-42".into(),
            quantity: 1,
            note: intent.to_owned(),
        });
        if with_idem {
            idem_client::with_key(&mut req, &key);
        }
        match client.create_order(req).await {
            Ok(response) => {
                if idem_client::is_replayed(&response) {
                    replays.fetch_add(1, Ordering::Relaxed);
                }
                if let Some((_, outage)) = retries.wait_out {
                    outage.success();
                }
                history.ok(intent, &response.into_inner().order_id);
                return true;
            }
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::Unavailable
                        // A connection that died mid-call (a killed server) can end
                        // the call CANCELLED although the caller cancelled nothing.
                        | tonic::Code::Cancelled
                        | tonic::Code::DeadlineExceeded
                        | tonic::Code::Aborted
                        | tonic::Code::ResourceExhausted
                ) =>
            {
                match retries.wait_out {
                    Some((longest, _)) if started.elapsed() < longest => {
                        tokio::time::sleep(Outage::app_wait(&s)).await;
                    }
                    _ if tries < retries.max => tries += 1,
                    _ => return false,
                }
            }
            Err(s) => {
                if std::env::var_os("IDEM_DEMO_DEBUG").is_some() {
                    eprintln!("intent {intent} failed: {s:?}");
                }
                return false;
            }
        }
    }
}

fn show_progress(
    o: &Options,
    label: &'static str,
    done: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    let total = o.intents as u64;
    let show = o.progress;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tick.tick().await;
            let d = done.load(Ordering::Relaxed);
            if show {
                eprint!("\r  {label:<13} {d:>6}/{total} intents");
            }
            if d >= total {
                if show {
                    eprintln!();
                }
                break;
            }
        }
    })
}

/// Counts orders, duplicates and lost intents of a run from the orders that exist
/// (intent and order id of each) and what the callers saw, through the history checker.
pub fn tally(
    o: &Options,
    label: &'static str,
    orders: &[(String, String)],
    w: Workload,
) -> RunReport {
    let pct = |p: f64| w.latencies[((w.latencies.len() as f64 - 1.0) * p).round() as usize];
    let verdict = w.history.check(
        (0..o.intents).map(|n| format!("intent-{n}")),
        orders.iter().map(|(i, id)| (i, id)),
    );
    if !verdict.is_exactly_once() && std::env::var_os("IDEM_DEMO_DEBUG").is_some() {
        eprintln!("{label}: {verdict}");
    }
    RunReport {
        label,
        intents: o.intents,
        attempts: 0,
        app_calls: w.app_calls,
        replays: w.replays.load(Ordering::Relaxed),
        orders: orders.len() as u64,
        duplicates: verdict.duplicates,
        failed: verdict.never_ok,
        ok_without_order: verdict.ok_without_order,
        wrong_orders: verdict.wrong_orders,
        restarted: false,
        lost: verdict.lost(),
        p50: pct(0.50),
        p99: pct(0.99),
        elapsed: w.elapsed,
        crashes: 0,
        restarts: 0,
        transparent: 0,
        outage: None,
        net_faults: None,
        verdict: Some(verdict),
    }
}
