//! The `[flush]` section: how often and how pending counts are written to PostgreSQL.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FlushConfig {
    interval_ms: u64,
    /// Flush sooner once this many distinct keys are pending.
    pub max_pending_keys: usize,
    /// Parallel PostgreSQL connections; each key always goes through the same one.
    pub connections: usize,
    /// Rows per upsert statement.
    pub batch_rows: usize,
    retry_initial_ms: u64,
    retry_max_ms: u64,
    /// `lock_timeout` of the flush sessions, so a lock held on `tallyd.slots` fails the flush
    /// (which is retried) instead of stalling it; 0 leaves the server's setting.
    lock_timeout_ms: u64,
    /// `statement_timeout` of the flush sessions; 0 leaves the server's setting.
    statement_timeout_ms: u64,
    /// First slot this instance writes; connection `i` writes slot `slot_offset + i`.
    /// -1 derives it from the instance id, so instances on one database use different slots.
    slot_offset: i64,
}

impl Default for FlushConfig {
    fn default() -> Self {
        FlushConfig {
            interval_ms: 1000,
            max_pending_keys: 100_000,
            connections: 2,
            batch_rows: 5_000,
            retry_initial_ms: 100,
            retry_max_ms: 10_000,
            lock_timeout_ms: 5_000,
            statement_timeout_ms: 60_000,
            slot_offset: -1,
        }
    }
}

super::durations!(FlushConfig {
    interval_ms => interval, set_interval;
    retry_initial_ms => retry_initial, set_retry_initial;
    retry_max_ms => retry_max, set_retry_max;
});

/// `None` for 0, the file's "leave the server's setting".
fn nonzero(ms: u64) -> Option<Duration> {
    (ms > 0).then(|| Duration::from_millis(ms))
}

impl FlushConfig {
    /// The flush sessions' `lock_timeout`; `None` leaves the server's.
    pub fn lock_timeout(&self) -> Option<Duration> {
        nonzero(self.lock_timeout_ms)
    }

    pub fn set_lock_timeout(&mut self, timeout: Option<Duration>) {
        self.lock_timeout_ms = timeout.map_or(0, |d| d.as_millis() as u64);
    }

    /// The flush sessions' `statement_timeout`; `None` leaves the server's.
    pub fn statement_timeout(&self) -> Option<Duration> {
        nonzero(self.statement_timeout_ms)
    }

    pub fn set_statement_timeout(&mut self, timeout: Option<Duration>) {
        self.statement_timeout_ms = timeout.map_or(0, |d| d.as_millis() as u64);
    }

    /// The configured first slot; `None` (`-1` in the file) derives it from the instance id.
    pub fn slot_offset(&self) -> Option<u64> {
        u64::try_from(self.slot_offset).ok()
    }

    pub fn set_slot_offset(&mut self, slot: Option<u64>) {
        self.slot_offset = slot.map_or(-1, |s| s as i64);
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.connections == 0 || self.connections > 64 {
            return Err(invalid("flush.connections", "must be between 1 and 64"));
        }
        if self.interval_ms == 0 {
            return Err(invalid("flush.interval_ms", "must be at least 1"));
        }
        if self.max_pending_keys == 0 {
            return Err(invalid("flush.max_pending_keys", "must be at least 1"));
        }
        if self.batch_rows == 0 {
            return Err(invalid("flush.batch_rows", "must be at least 1"));
        }
        if self.retry_initial_ms == 0 || self.retry_max_ms < self.retry_initial_ms {
            return Err(invalid(
                "flush.retry_max_ms",
                "retry_initial_ms must be at least 1 and retry_max_ms at least retry_initial_ms",
            ));
        }
        if self.slot_offset < -1 {
            return Err(invalid(
                "flush.slot_offset",
                "must be -1 (derive) or a slot number",
            ));
        }
        Ok(())
    }
}
