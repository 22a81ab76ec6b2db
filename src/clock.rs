//! Wall-clock time as tallyd stores it: event times are Unix milliseconds (`i64`), written to
//! PostgreSQL as `timestamptz`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// An event time in Unix milliseconds as a `SystemTime`; times before 1970 are clamped to it.
pub fn ms_to_time(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

/// Now, in Unix milliseconds (0 if the clock is before 1970).
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Now, in seconds since the Unix epoch (0 if the clock is before 1970): for gauges of times.
pub fn now_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
