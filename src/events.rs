//! Internal events: each one emits its metric and its rate-limited log line together.
//!
//! A call site builds the event and calls `emit()`, so a metric and its log line can neither
//! drift apart nor be paired by hand with a `static` throttle in every module. Log lines keep
//! the target of the module that reports them, so `log.level` filters still apply by module.

use metrics::{counter, gauge};
use tracing::warn;

use crate::metrics as m;
use crate::protocol::Reject;
use crate::store::DbError;
use crate::throttle::Throttle;

/// A flush transaction failed; the flight is retried.
pub struct FlushFailed<'a> {
    pub worker: usize,
    pub seq: Option<i64>,
    pub rows: usize,
    pub cause: &'a DbError,
}

impl FlushFailed<'_> {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(1000);
        m::flush_failed();
        if let Some(suppressed) = LOG.allow() {
            warn!(target: "tallyd::flush", worker = self.worker, seq = self.seq, rows = self.rows, cause = %self.cause, suppressed, "flush failed; will retry");
        }
    }
}

/// A key whose total would leave the 64-bit range: its events are rejected at flush.
pub struct ValueOverflow<'a> {
    pub counter: &'a str,
    pub key: &'a str,
    pub events: u64,
}

impl ValueOverflow<'_> {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(1000);
        m::rejected(Reject::Overflow, self.events);
        if let Some(suppressed) = LOG.allow() {
            warn!(
                target: "tallyd::flush",
                counter = self.counter,
                key = self.key,
                events = self.events,
                suppressed,
                "total would leave the 64-bit range; events rejected"
            );
        }
    }
}

/// A rollup step failed; the next tick tries again.
pub struct RollupFailed<'a> {
    pub cause: &'a DbError,
}

impl RollupFailed<'_> {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(10_000);
        counter!(m::ROLLUP_ERRORS).increment(1);
        if let Some(suppressed) = LOG.allow() {
            warn!(target: "tallyd::rollup", cause = %self.cause, suppressed, "rollup failed; will retry on the next tick");
        }
    }
}

/// Slot rows of a `rollup_into` counter whose key has no row in the target table.
pub struct RollupUnmatched {
    pub counter: String,
    pub slot_rows: i64,
}

impl RollupUnmatched {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(60_000);
        gauge!(m::ROLLUP_UNMATCHED, "counter" => self.counter.clone()).set(self.slot_rows as f64);
        if self.slot_rows > 0 {
            if let Some(suppressed) = LOG.allow() {
                warn!(target: "tallyd::rollup", counter = %self.counter, slot_rows = self.slot_rows, suppressed,
                    "keys with no row in the rollup_into table stay in tallyd.slots until one appears");
            }
        }
    }
}

/// Keys the rollup holds back because their folded total would leave the 64-bit range.
pub struct RollupOverflow<'a> {
    pub counter: &'a str,
    pub database: usize,
    pub keys: i64,
    /// One of the held-back keys, when there are any.
    pub example: Option<&'a str>,
}

impl RollupOverflow<'_> {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(60_000);
        m::rollup_overflow(self.counter, self.database, self.keys as u64);
        let Some(key) = self.example else { return };
        if let Some(suppressed) = LOG.allow() {
            warn!(target: "tallyd::rollup", counter = %self.counter, key = %key, keys = self.keys, database = self.database, suppressed,
                "rollup holds back keys whose folded total would leave the 64-bit range; \
                 their slot rows stay in tallyd.slots (see tallyd.rollup_rejects)");
        }
    }
}

/// A connection refused because `listen.max_connections` is reached.
pub struct ConnectionRefused;

impl ConnectionRefused {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(1000);
        if let Some(suppressed) = LOG.allow() {
            warn!(
                target: "tallyd::listener",
                suppressed, "refusing connection: listen.max_connections reached"
            );
        }
    }
}

/// All HTTP slots (`metrics.listen`) were taken: the connection that had waited longest for a
/// request head was closed to serve a new one.
pub struct HttpConnectionEvicted {
    pub max: usize,
    pub waited: std::time::Duration,
}

impl HttpConnectionEvicted {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(10_000);
        counter!(m::HTTP_EVICTED).increment(1);
        if let Some(suppressed) = LOG.allow() {
            warn!(target: "tallyd::http", max = self.max, waited_ms = self.waited.as_millis() as u64, suppressed,
                "metrics listener: every connection slot taken; closed the connection waiting longest for a request head");
        }
    }
}

/// A line that was not accepted, on a tallyd socket or a statsd socket.
pub struct LineRejected<'a> {
    pub reason: Reject,
    /// The line (its first 120 bytes are logged), or a note when the line itself is gone.
    pub line: &'a [u8],
    pub statsd: bool,
}

impl LineRejected<'_> {
    pub fn emit(self) {
        // One throttle per kind of socket, so statsd noise cannot hide tallyd rejections.
        static LOG: Throttle = Throttle::new(1000);
        static STATSD_LOG: Throttle = Throttle::new(1000);
        m::rejected(self.reason, 1);
        let shown = &self.line[..self.line.len().min(120)];
        let shown = String::from_utf8_lossy(shown);
        let reason = self.reason.as_str();
        if self.statsd {
            if let Some(suppressed) = STATSD_LOG.allow() {
                warn!(target: "tallyd::statsd::receive", reason, line = %shown.escape_debug(), suppressed, "rejected statsd line");
            }
        } else if let Some(suppressed) = LOG.allow() {
            warn!(target: "tallyd::listener", reason, line = %shown.escape_debug(), suppressed, "rejected line");
        }
    }
}

/// A journal write or fsync failed. The first failure of a run is always logged (reading
/// pauses from then on); the retries' failures are rate-limited.
pub struct JournalWriteFailed<'a> {
    pub dir: &'a std::path::Path,
    pub what: &'a str,
    pub cause: &'a std::io::Error,
    /// No failure was outstanding before this one.
    pub first: bool,
    /// Records kept in memory for the next retry.
    pub unwritten: usize,
}

impl JournalWriteFailed<'_> {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(5_000);
        m::journal_error();
        let (dir, what, cause) = (self.dir.display(), self.what, self.cause);
        if self.first {
            tracing::error!(target: "tallyd::journal", dir = %dir, cause = %cause,
                "journal {what}; `!sync` answers errors and connections stop reading until it works again");
        } else if let Some(suppressed) = LOG.allow() {
            warn!(target: "tallyd::journal", dir = %dir, cause = %cause, suppressed,
                records = self.unwritten, "journal {what} (retrying)");
        }
    }
}

/// The journal reached `journal.max_bytes` (connections stop reading until flushes commit and
/// covered segments are deleted), or went back below it. Both lines are rate-limited: during a
/// long outage's recovery the journal may touch the cap again with every segment it frees.
pub struct JournalFull<'a> {
    pub dir: &'a std::path::Path,
    pub bytes: u64,
    pub max_bytes: u64,
    pub full: bool,
}

impl JournalFull<'_> {
    pub fn emit(self) {
        static FULL_LOG: Throttle = Throttle::new(10_000);
        static ROOM_LOG: Throttle = Throttle::new(10_000);
        gauge!(m::JOURNAL_FULL).set(if self.full { 1.0 } else { 0.0 });
        let (dir, bytes, max_bytes) = (self.dir.display(), self.bytes, self.max_bytes);
        if self.full {
            if let Some(suppressed) = FULL_LOG.allow() {
                warn!(target: "tallyd::journal", dir = %dir, bytes, max_bytes, suppressed,
                    "journal full (journal.max_bytes): connections stop reading until flushes commit and covered segments are deleted; `!sync` still answers for what is journaled");
            }
        } else if let Some(suppressed) = ROOM_LOG.allow() {
            tracing::info!(target: "tallyd::journal", dir = %dir, bytes, max_bytes, suppressed,
                "journal below journal.max_bytes again; connections read again");
        }
    }
}

/// The instance lease could not be renewed in one database (it is retried; that database's
/// flushes fail meanwhile, which `tallyd_database_up` shows).
pub struct LeaseRenewFailed<'a> {
    pub database: usize,
    pub cause: &'a dyn std::fmt::Display,
}

impl LeaseRenewFailed<'_> {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(10_000);
        if let Some(suppressed) = LOG.allow() {
            warn!(target: "tallyd::store::lease", database = self.database, cause = %self.cause,
                suppressed, "cannot renew the instance lease; will retry");
        }
    }
}
