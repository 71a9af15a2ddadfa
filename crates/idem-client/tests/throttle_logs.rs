//! What the retry throttle logs when retries stop and resume. Alone in its test binary:
//! a subscriber set per thread shares tracing's global callsite interest with every
//! other test of the binary, and a test elsewhere that hits the same warning first, on a
//! thread with no subscriber, could leave it disabled for this one.

use idem_client::retry::RetryThrottle;
use idem_core::config::RetryThrottling;
use idem_test_support::logs;

#[test]
fn logs_once_when_retries_stop_and_once_when_they_resume() {
    let t = RetryThrottle::new(RetryThrottling {
        max_milli_tokens: 4_000,
        token_ratio_milli: 1_000,
    });
    let text = logs::capture(tracing::Level::DEBUG, || {
        // 4 → 3 (allowed), 3 → 2 (at half: stops), then more failures: still stopped.
        for _ in 0..5 {
            t.record_failure();
        }
        // 0 → 1 → 2 (still at half) → 3: resumes; more successes log nothing.
        for _ in 0..6 {
            t.record_success();
        }
        t.record_failure();
        t.record_failure();
    });
    let lines: Vec<&str> = text.lines().collect();
    let warn: Vec<_> = lines.iter().filter(|l| l.contains("WARN")).collect();
    let info: Vec<_> = lines.iter().filter(|l| l.contains("INFO")).collect();
    assert_eq!(lines.len(), 3, "{lines:#?}");
    assert_eq!(warn.len(), 2);
    assert_eq!(info.len(), 1);
    assert!(warn[0].contains("retry throttle engaged: the token bucket is at or below half"));
    assert!(warn[0].contains("tokens=2.0 max_tokens=4.0"), "{}", warn[0]);
    assert!(info[0].contains("retry throttle released"));
    assert!(lines[0].contains("WARN") && lines[1].contains("INFO") && lines[2].contains("WARN"));
}
