//! Proptest strategies shared by the retry and hedging decision tests.

use std::time::Duration;

use idem_core::code::ALL_CODES;
use proptest::prelude::*;

use crate::retry::AttemptEnd;
use crate::retry::policy::pushback::Pushback;

/// How an attempt ended; `cancelled` adds `AttemptEnd::Cancelled` (hedges only).
pub(crate) fn ends(cancelled: bool) -> BoxedStrategy<AttemptEnd> {
    let mut ends = vec![
        Just(AttemptEnd::Committed).boxed(),
        Just(AttemptEnd::TransportError).boxed(),
        Just(AttemptEnd::RecvTimeout).boxed(),
        Just(AttemptEnd::Deadline).boxed(),
        (0usize..17)
            .prop_map(|i| AttemptEnd::Status(ALL_CODES[i]))
            .boxed(),
    ];
    if cancelled {
        ends.push(Just(AttemptEnd::Cancelled).boxed());
    }
    proptest::strategy::Union::new(ends).boxed()
}

/// Server pushback: none, stop, any wait, short waits.
pub(crate) fn pushbacks() -> impl Strategy<Value = Pushback> {
    prop_oneof![
        Just(Pushback::Absent),
        Just(Pushback::Stop),
        (0u64..=u64::MAX).prop_map(|ms| Pushback::Wait(Duration::from_millis(ms))),
        (0u64..5_000).prop_map(|ms| Pushback::Wait(Duration::from_millis(ms))),
    ]
}

/// Durations from zero to `Duration::MAX`, most of them short.
pub(crate) fn durations() -> impl Strategy<Value = Duration> {
    prop_oneof![
        (0u64..10_000_000).prop_map(Duration::from_micros),
        (0u64..=u64::MAX).prop_map(Duration::from_secs),
        Just(Duration::MAX),
        Just(Duration::ZERO),
    ]
}
