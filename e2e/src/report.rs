//! Numbers the scenarios print, one parseable line each, for BENCHMARKS.md.

use std::time::Duration;

/// `E2E-TIMING scenario=<name> seconds=<s> k=v ...` (seconds with 2 decimals).
pub fn timing_line(scenario: &str, seconds: Duration, extra: &[(&str, String)]) -> String {
    let mut line = format!("E2E-TIMING scenario={scenario} seconds={:.2}", seconds.as_secs_f64());
    for (k, v) in extra {
        line.push_str(&format!(" {k}={v}"));
    }
    line
}

/// Print the timing line on stderr.
pub fn timing(scenario: &str, seconds: Duration, extra: &[(&str, String)]) {
    eprintln!("{}", timing_line(scenario, seconds, extra));
}

/// The longest time between consecutive instants (which must be in order).
pub fn max_gap<T: Copy + std::ops::Sub<Output = Duration>>(at: &[T]) -> Duration {
    at.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(Duration::ZERO)
}

/// Milliseconds, as an integer string.
pub fn ms(d: Duration) -> String {
    d.as_millis().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_is_parseable() {
        let line = timing_line(
            "rolling_deploy",
            Duration::from_millis(12_345),
            &[("max_gap_ms", ms(Duration::from_millis(420))), ("turns", "900".into())],
        );
        assert_eq!(line, "E2E-TIMING scenario=rolling_deploy seconds=12.35 max_gap_ms=420 turns=900");
    }

    #[test]
    fn the_largest_gap_is_found() {
        let t0 = std::time::Instant::now();
        let at = [
            t0,
            t0 + Duration::from_millis(100),
            t0 + Duration::from_millis(700),
            t0 + Duration::from_millis(800),
        ];
        assert_eq!(max_gap(&at), Duration::from_millis(600));
        assert_eq!(max_gap(&at[..1]), Duration::ZERO);
    }
}
