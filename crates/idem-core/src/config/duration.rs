//! proto3 JSON durations (`google.protobuf.Duration` in its JSON form): `"1s"`, `"0.100s"`.

use std::fmt;
use std::time::Duration;

/// Largest `seconds` of a `google.protobuf.Duration`: 10000 years.
pub const MAX_DURATION_SECONDS: u64 = 315_576_000_000;

/// Why a string is not a proto3 JSON duration. `Display` is the rule, in lower case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DurationError {
    /// Does not end in `s` (also: another unit such as `ms`).
    MissingSuffix,
    /// A sign (`-`, `+`) in front.
    Signed,
    /// No digit before the decimal point (`".5s"`, `"s"`).
    NoWholeDigits,
    /// A decimal point with no digit after it (`"1.s"`).
    NoFractionDigits,
    /// More than 9 digits after the decimal point.
    TooManyFractionDigits,
    /// A character that is not a digit (`" 1s"`, `"1e3s"`, `"1.2.3s"`).
    NotDigits,
    /// More than [`MAX_DURATION_SECONDS`] seconds.
    OutOfRange,
}

impl fmt::Display for DurationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DurationError::MissingSuffix => "must end in \"s\" (seconds is the only unit)",
            DurationError::Signed => "must not have a sign",
            DurationError::NoWholeDigits => "must have a digit before the decimal point",
            DurationError::NoFractionDigits => "must have a digit after the decimal point",
            DurationError::TooManyFractionDigits => "must have at most 9 fractional digits",
            DurationError::NotDigits => "must be digits with an optional decimal point",
            DurationError::OutOfRange => "must be at most 315576000000s",
        })
    }
}

impl std::error::Error for DurationError {}

/// Parses a proto3 JSON duration (`"0.1s"`).
///
/// The grammar is the canonical proto3 JSON form, a subset of what grpc-go, grpc-java
/// and C-core each accept, so a string idem takes is taken by all three:
///
/// ```text
/// duration = digits [ "." 1*9digit ] "s"      ; digits = 1*DIGIT
/// ```
///
/// - No sign: `"-1s"` is refused (no field idem reads may be negative; C-core refuses it
///   too) and so is `"+1s"` (not proto3 JSON, although the three stacks read it).
/// - No other unit (`"1ms"`), no whitespace (`" 1s"`: grpc-go refuses it), no exponent.
/// - At least one digit before the point: `".5s"` is refused (C-core and grpc-java refuse
///   it; grpc-go accepts it).
/// - At least one digit after a point: `"1.s"` is refused (C-core refuses it; grpc-go and
///   grpc-java read it as `"1s"`).
/// - At most 9 fractional digits (nanoseconds); a 10th is refused, not rounded.
/// - At most 315576000000 seconds, the `google.protobuf.Duration` range (10000 years);
///   a fraction on top of the maximum is allowed, as the proto allows `nanos` with it.
///
/// ```
/// use std::time::Duration;
/// use idem_core::config::parse_duration;
/// assert_eq!(parse_duration("0.100s"), Ok(Duration::from_millis(100)));
/// assert!(parse_duration("100ms").is_err());
/// ```
///
/// # Errors
/// A [`DurationError`] naming the broken rule.
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let number = text.strip_suffix('s').ok_or(DurationError::MissingSuffix)?;
    if number.ends_with(|c: char| c.is_ascii_alphabetic()) {
        // "1ms", "1ns", "1us": another unit.
        return Err(DurationError::MissingSuffix);
    }
    if number.starts_with(['-', '+']) {
        return Err(DurationError::Signed);
    }
    let (whole, fraction) = match number.split_once('.') {
        Some((w, f)) => (w, Some(f)),
        None => (number, None),
    };
    if whole.is_empty() {
        return Err(DurationError::NoWholeDigits);
    }
    if !whole.bytes().all(|b| b.is_ascii_digit()) {
        return Err(DurationError::NotDigits);
    }
    let nanos = match fraction {
        None => 0,
        Some("") => return Err(DurationError::NoFractionDigits),
        Some(f) if !f.bytes().all(|b| b.is_ascii_digit()) => return Err(DurationError::NotDigits),
        Some(f) if f.len() > 9 => return Err(DurationError::TooManyFractionDigits),
        Some(f) => f
            .bytes()
            .chain(std::iter::repeat(b'0'))
            .take(9)
            .fold(0u32, |acc, b| acc * 10 + u32::from(b - b'0')),
    };
    // Leading zeros are fine ("007s"); the digit check above makes only overflow possible.
    let trimmed = whole.trim_start_matches('0');
    let seconds = if trimmed.is_empty() {
        0
    } else if trimmed.len() > 12 {
        return Err(DurationError::OutOfRange);
    } else {
        trimmed
            .parse::<u64>()
            .map_err(|_| DurationError::OutOfRange)?
    };
    if seconds > MAX_DURATION_SECONDS {
        return Err(DurationError::OutOfRange);
    }
    Ok(Duration::new(seconds, nanos))
}

/// Formats a duration in the proto3 JSON form idem parses: `"1s"`, `"0.05s"`,
/// `"1.000000001s"` (no trailing zeros in the fraction).
///
/// ```
/// use std::time::Duration;
/// use idem_core::config::format_duration;
/// assert_eq!(format_duration(Duration::from_millis(50)), "0.05s");
/// assert_eq!(format_duration(Duration::from_secs(86400)), "86400s");
/// ```
pub fn format_duration(d: Duration) -> String {
    let nanos = d.subsec_nanos();
    if nanos == 0 {
        return format!("{}s", d.as_secs());
    }
    let fraction = format!("{nanos:09}");
    format!("{}.{}s", d.as_secs(), fraction.trim_end_matches('0'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_proto3_forms() {
        assert_eq!(parse_duration("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("0.1s"), Ok(Duration::from_millis(100)));
        assert_eq!(parse_duration("0.100s"), Ok(Duration::from_millis(100)));
        assert_eq!(parse_duration("007s"), Ok(Duration::from_secs(7)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        // 9 fractional digits: nanoseconds.
        assert_eq!(parse_duration("0.000000001s"), Ok(Duration::from_nanos(1)));
        assert_eq!(
            parse_duration("1.123456789s"),
            Ok(Duration::new(1, 123_456_789))
        );
    }

    #[test]
    fn range_boundaries() {
        assert_eq!(
            parse_duration("315576000000s"),
            Ok(Duration::from_secs(MAX_DURATION_SECONDS))
        );
        assert_eq!(
            parse_duration("315576000000.999999999s"),
            Ok(Duration::new(MAX_DURATION_SECONDS, 999_999_999))
        );
        assert_eq!(
            parse_duration("315576000001s"),
            Err(DurationError::OutOfRange)
        );
        assert_eq!(
            parse_duration("99999999999999999999999s"),
            Err(DurationError::OutOfRange)
        );
        assert_eq!(
            parse_duration("0000000000000000000001s"),
            Ok(Duration::from_secs(1)),
            "leading zeros do not count toward the range"
        );
    }

    #[test]
    fn refuses_other_forms() {
        use DurationError::*;
        let cases = [
            ("0.0000000001s", TooManyFractionDigits),
            ("1.1234567890s", TooManyFractionDigits),
            ("-1s", Signed),
            ("-0s", Signed),
            ("+1s", Signed),
            ("1ms", MissingSuffix),
            ("1ns", MissingSuffix),
            ("1m", MissingSuffix),
            ("1", MissingSuffix),
            ("", MissingSuffix),
            ("s", NoWholeDigits),
            (".5s", NoWholeDigits),
            ("1.s", NoFractionDigits),
            (" 1s", NotDigits),
            ("1s ", MissingSuffix),
            ("1 s", NotDigits),
            ("1e3s", NotDigits),
            ("1.2.3s", NotDigits),
            ("0x10s", NotDigits),
            ("1,5s", NotDigits),
            ("١s", NotDigits),
            ("1S", MissingSuffix),
        ];
        for (text, want) in cases {
            assert_eq!(parse_duration(text), Err(want), "{text:?}");
        }
    }

    #[test]
    fn formats_round_trip() {
        for d in [
            Duration::ZERO,
            Duration::from_millis(50),
            Duration::from_nanos(1),
            Duration::new(3, 100_000_000),
            Duration::new(MAX_DURATION_SECONDS, 999_999_999),
        ] {
            assert_eq!(parse_duration(&format_duration(d)), Ok(d));
        }
        assert_eq!(format_duration(Duration::new(1, 1)), "1.000000001s");
    }
}
