use std::time::Duration;

use super::*;

/// A drain over runs of its own (other tests of this binary run protected calls).
fn drain(timeout: Duration) -> (Drain, &'static runs::Runs) {
    let runs: &'static runs::Runs = Box::leak(Box::new(runs::Runs::new()));
    let drain = Drain {
        runs,
        ..Drain::new().timeout(timeout)
    };
    (drain, runs)
}

#[tokio::test(start_paused = true)]
async fn a_drain_waits_for_the_server_then_its_runs_within_the_timeout() {
    let (drain, runs) = drain(Duration::from_secs(5));
    let (finish, finished) = tokio::sync::oneshot::channel::<()>();
    // A protected run whose caller went away: it ends when `finish` fires.
    let run = tokio::spawn(runs.protect(async move {
        let _ = finished.await;
    }));
    assert_eq!(runs.count(), 1);
    let signal = drain.signal();
    let server = async move {
        signal.await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        Ok::<(), std::io::Error>(())
    };
    let d = drain.clone();
    let drained = tokio::spawn(async move { d.run(server).await });
    tokio::time::sleep(Duration::from_millis(10)).await;
    drain.start();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!drained.is_finished(), "the run is still going");
    finish.send(()).unwrap();
    run.await.unwrap();
    let drained = drained.await.unwrap().unwrap();
    assert!(!drained.timed_out);
    assert_eq!(drained.took, Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn a_drain_ends_at_its_timeout_with_the_runs_left() {
    let (drain, runs) = drain(Duration::from_secs(2));
    let _stuck = tokio::spawn(runs.protect(std::future::pending()));
    drain.start();
    let drained = drain
        .run(async { Ok::<(), std::io::Error>(()) })
        .await
        .unwrap();
    assert!(drained.timed_out);
    assert_eq!(drained.runs_left, 1);
    assert_eq!(drained.took, Duration::from_secs(2));
}
