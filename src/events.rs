//! Internal events: each one emits its metric and its rate-limited log line together.
//!
//! A call site builds the event and calls `emit()`, so a metric and its log line can neither
//! drift apart nor be paired by hand with a `static` throttle in every module. Log lines keep
//! the target of the module that reports them, so `log.level` filters still apply by module.

use metrics::{counter, gauge, histogram};
use tracing::{debug, warn};

use crate::metrics as m;
use crate::protocol::Reject;
use crate::throttle::Throttle;

/// A flush transaction failed; the flight is retried.
pub struct FlushFailed<'a> {
    pub worker: usize,
    pub seq: Option<i64>,
    pub rows: usize,
    pub database: usize,
    /// The database could not be reached (the connection failed or broke), as opposed to a
    /// statement it refused (a lock timeout, a statement timeout, an error).
    pub unreachable: bool,
    pub cause: &'a dyn std::fmt::Display,
}

impl FlushFailed<'_> {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(1000);
        m::database_up(self.database, !self.unreachable);
        m::flush_failing(self.database, true);
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

/// A correction the flush refused: its set would take a row of its key beyond the 64-bit range
/// (answered `error overflow`; nothing of it is written).
pub struct CorrectionRefused<'a> {
    pub counter: &'a str,
    pub key: &'a str,
    pub cause: &'a dyn std::fmt::Display,
}

impl CorrectionRefused<'_> {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(1000);
        m::rejected(Reject::Overflow, 1);
        if let Some(suppressed) = LOG.allow() {
            warn!(
                target: "tallyd::flush",
                counter = self.counter,
                key = self.key,
                cause = %self.cause,
                suppressed,
                "correction refused: it would take a row of the key beyond the 64-bit range; the key keeps its events"
            );
        }
    }
}

/// A rollup step failed; the next tick tries again.
pub struct RollupFailed<'a> {
    pub cause: &'a dyn std::fmt::Display,
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
    pub database: usize,
    pub slot_rows: i64,
}

impl RollupUnmatched {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(60_000);
        gauge!(m::ROLLUP_UNMATCHED, "counter" => self.counter.clone(), "database" => self.database.to_string())
            .set(self.slot_rows as f64);
        if self.slot_rows > 0 {
            if let Some(suppressed) = LOG.allow() {
                warn!(target: "tallyd::rollup", counter = %self.counter, database = self.database, slot_rows = self.slot_rows, suppressed,
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

/// Keys of an `insert_missing` target the rollup holds back because inserting their row
/// failed on a foreign key (the parent row does not exist yet, or was deleted).
pub struct RollupHeldBack<'a> {
    pub counter: &'a str,
    pub database: usize,
    /// Their slot rows waiting in `tallyd.slots`.
    pub slot_rows: i64,
    pub keys: i64,
    /// How long the longest-held of them has been held (zero without any).
    pub held_for: std::time::Duration,
    /// One of the held-back keys, with the error of its last try, when there are any.
    pub example: Option<(&'a str, &'a str)>,
}

impl RollupHeldBack<'_> {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(60_000);
        m::rollup_held_back(
            self.counter,
            self.database,
            self.slot_rows.max(0) as u64,
            self.held_for,
        );
        let Some((key, cause)) = self.example else {
            return;
        };
        if let Some(suppressed) = LOG.allow() {
            warn!(target: "tallyd::rollup", counter = %self.counter, key = %key, keys = self.keys,
                slot_rows = self.slot_rows, held_for_s = self.held_for.as_secs(),
                database = self.database, cause = %cause, suppressed,
                "rollup_into cannot insert the rows of keys whose parent row is missing (foreign \
                 key); their slot rows stay in tallyd.slots and fold once it exists, and a key \
                 whose parent was deleted is held until `tallyd forget` drops it (see \
                 tallyd.held_back())");
        }
    }
}

/// A stream connection refused: `listen.max_connections` are open and none has been idle long
/// enough to give up its place, or the stream connections hold every descriptor of their
/// budget (the soft `RLIMIT_NOFILE` minus those kept for the database connections, the journal
/// and the HTTP endpoint).
pub enum ConnectionRefused {
    MaxConnections,
    Descriptors { budget: usize },
}

impl ConnectionRefused {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(1000);
        static FDS_LOG: Throttle = Throttle::new(1000);
        match self {
            ConnectionRefused::MaxConnections => {
                m::connection_refused(m::REFUSED_MAX_CONNECTIONS);
                if let Some(suppressed) = LOG.allow() {
                    warn!(
                        target: "tallyd::listener",
                        suppressed, "refusing connection: listen.max_connections reached"
                    );
                }
            }
            ConnectionRefused::Descriptors { budget } => {
                m::connection_refused(m::REFUSED_DESCRIPTORS);
                if let Some(suppressed) = FDS_LOG.allow() {
                    warn!(target: "tallyd::listener", budget, suppressed,
                        "refusing connection: stream connections hold their whole file descriptor budget \
                         (the soft RLIMIT_NOFILE minus the descriptors kept for the database connections, \
                         the journal and the HTTP endpoint); raise the limit (LimitNOFILE) or lower listen.max_connections");
                }
            }
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

/// The HTTP endpoint could not accept a connection (out of file descriptors, say); it retries
/// after a pause.
pub struct HttpAcceptFailed<'a> {
    pub cause: &'a dyn std::fmt::Display,
}

impl HttpAcceptFailed<'_> {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(1000);
        if let Some(suppressed) = LOG.allow() {
            warn!(target: "tallyd::http", cause = %self.cause, suppressed, "metrics listener: cannot accept a connection");
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

/// The instance lease could not be renewed in one database (it is retried). The heartbeat
/// reaches every database every third of `daemon.instance_lease_ms`, so `tallyd_database_up`
/// follows an outage even while nothing is flushed.
pub struct LeaseRenewFailed<'a> {
    pub database: usize,
    /// The database could not be reached (as opposed to an error it answered with).
    pub unreachable: bool,
    pub cause: &'a dyn std::fmt::Display,
}

impl LeaseRenewFailed<'_> {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(10_000);
        m::database_up(self.database, !self.unreachable);
        if let Some(suppressed) = LOG.allow() {
            warn!(target: "tallyd::store::lease", database = self.database, cause = %self.cause,
                suppressed, "cannot renew the instance lease; will retry");
        }
    }
}

/// A flush transaction committed: `rows` slot rows covering `events` events into `database`,
/// in `took`; `oldest_age` is the age of its oldest event.
pub struct FlushCommitted {
    pub database: usize,
    pub rows: usize,
    pub events: u64,
    pub took: std::time::Duration,
    pub oldest_age: Option<std::time::Duration>,
}

impl FlushCommitted {
    pub fn emit(self) {
        m::database_up(self.database, true);
        m::flush_failing(self.database, false);
        m::flush_committed(self.rows, self.events, self.took, self.oldest_age);
    }
}

/// A flush attempt that repeats a failed one is starting.
pub struct FlushRetry;

impl FlushRetry {
    pub fn emit(self) {
        m::flush_retry();
    }
}

/// The pending state after a flush committed (the gauges; the periodic publisher sets them
/// too, so that they move during an outage).
pub struct Pending {
    pub keys: usize,
    pub events: u64,
}

impl Pending {
    pub fn emit(self) {
        m::pending(self.keys, self.events);
    }
}

/// Database `database` answered (the start's checks, a rollup's connection) or did not.
pub struct DatabaseReached {
    pub database: usize,
    pub up: bool,
}

impl DatabaseReached {
    pub fn emit(self) {
        m::database_up(self.database, self.up);
    }
}

/// Events a bucket rejected because their key's total would leave the 64-bit range (each
/// also answered after `!errors`; the flush logs the key, see [`ValueOverflow`]).
pub struct OverflowRejected {
    pub events: u64,
}

impl OverflowRejected {
    pub fn emit(self) {
        m::rejected(Reject::Overflow, self.events);
    }
}

/// A direct write of `counter`'s rows (a flush writing its `rollup_into` table itself) failed:
/// the flight was written again with the counter's rows through `tallyd.slots`, and the counter
/// writes through them for `off`.
pub struct DirectWriteFailed<'a> {
    pub counter: &'a str,
    pub database: usize,
    pub cause: &'a dyn std::fmt::Display,
    pub off: std::time::Duration,
}

impl DirectWriteFailed<'_> {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(10_000);
        counter!(m::DIRECT_FALLBACKS, "counter" => self.counter.to_string(), "database" => self.database.to_string())
            .increment(1);
        if let Some(suppressed) = LOG.allow() {
            warn!(target: "tallyd::flush", counter = self.counter, database = self.database,
                cause = %self.cause, off_secs = self.off.as_secs(), suppressed,
                "a direct write into the rollup_into table failed; the flight was written through tallyd.slots, and this counter's rows go there (the rollup folds them) until the pause ends");
        }
    }
}

/// A flush worker holds unique counters' rows back: the database lacks the hll extension.
pub struct UniqueHeld<'a> {
    pub database: usize,
    pub worker: usize,
    /// The held rows' counters, by name.
    pub counters: &'a str,
    /// Their `rollup_into` columns (`table.column`), which a `DROP EXTENSION hll CASCADE`
    /// dropped from the application's tables.
    pub targets: &'a str,
    pub rows: usize,
    pub events: u64,
    pub cause: &'a dyn std::fmt::Display,
}

impl UniqueHeld<'_> {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(10_000);
        gauge!(m::UNIQUE_HELD, "database" => self.database.to_string(), "worker" => self.worker.to_string())
            .set(self.rows as f64);
        if let Some(suppressed) = LOG.allow() {
            let restore = if self.targets.is_empty() {
                String::new()
            } else {
                format!(
                    "; a DROP EXTENSION hll CASCADE also dropped the hll columns of the \
                     application's tables: add back {} (type hll) before the rollup folds \
                     into them",
                    self.targets
                )
            };
            warn!(target: "tallyd::flush", database = self.database, worker = self.worker,
                counters = self.counters, rows = self.rows, events = self.events,
                cause = %self.cause, suppressed,
                "unique counters' rows held back: the database lacks the hll extension; every other counter's rows are written. Fix: CREATE EXTENSION hll; in that database (tallyd then writes the held rows and makes the view tallyd.unique_totals again){restore}");
        }
    }

    /// The worker's held rows were written.
    pub fn released(database: usize, worker: usize) {
        gauge!(m::UNIQUE_HELD, "database" => database.to_string(), "worker" => worker.to_string())
            .set(0.0);
    }
}

/// A rollup step folded `folded` slot rows in `took`.
pub struct RollupStepped {
    pub folded: i64,
    pub took: std::time::Duration,
}

impl RollupStepped {
    pub fn emit(self) {
        counter!(m::ROLLUP_RUNS).increment(1);
        counter!(m::ROLLUP_ROWS).increment(self.folded as u64);
        histogram!(m::ROLLUP_DURATION).record(self.took.as_secs_f64());
    }
}

/// How far the rollup of `database` is behind: the start of the oldest last-completed pass of
/// its units (no row written before it still waits, but those held back or locked then).
pub struct RollupLag {
    pub database: usize,
    pub lag: std::time::Duration,
}

impl RollupLag {
    pub fn emit(self) {
        gauge!(m::ROLLUP_LAG, "database" => self.database.to_string()).set(self.lag.as_secs_f64());
    }
}

/// The rollup of `database` counted `rows` slot rows waiting (an estimate).
pub struct SlotRowsCounted {
    pub database: usize,
    pub rows: i64,
}

impl SlotRowsCounted {
    pub fn emit(self) {
        gauge!(m::SLOT_ROWS, "database" => self.database.to_string()).set(self.rows as f64);
    }
}

/// A stream connection was accepted (with a free place, or one an idle connection gives up).
pub struct ConnectionAccepted;

impl ConnectionAccepted {
    pub fn emit(self) {
        counter!(m::CONNECTIONS_ACCEPTED).increment(1);
    }
}

/// A stream connection started (`open`) or stopped being served.
pub struct ConnectionOpen {
    pub open: bool,
}

impl ConnectionOpen {
    pub fn emit(self) {
        let open = gauge!(m::CONNECTIONS_OPEN);
        if self.open {
            open.increment(1.0);
        } else {
            open.decrement(1.0);
        }
    }
}

/// An idle stream connection was closed: idle for `listen.idle_timeout_ms` (`timeout`), or the
/// longest idle one, to admit a new connection at `listen.max_connections`.
pub struct IdleConnectionClosed {
    pub timeout: bool,
}

impl IdleConnectionClosed {
    pub fn emit(self) {
        counter!(m::CONNECTIONS_IDLE_CLOSED).increment(1);
        if self.timeout {
            debug!(target: "tallyd::listener", "closing a connection idle for listen.idle_timeout_ms");
        } else {
            debug!(target: "tallyd::listener",
                "closing the connection idle the longest to admit a new one at listen.max_connections");
        }
    }
}

/// A connection paused for room (the journal's cap, a failing journal, or without a journal
/// the memory cap): counted in `tallyd_backpressure_paused_connections` while it lasts, so that
/// an alert sees a pause as it happens, and recorded in the pause histogram when it ends (also
/// when a stop cuts it short).
pub struct BackpressurePause {
    started: std::time::Instant,
}

impl BackpressurePause {
    pub fn begin() -> BackpressurePause {
        m::backpressure_paused_connections(1.0);
        BackpressurePause {
            started: std::time::Instant::now(),
        }
    }
}

impl Drop for BackpressurePause {
    fn drop(&mut self) {
        m::backpressure_paused_connections(-1.0);
        m::backpressure_paused(self.started.elapsed());
    }
}

/// The kernel's count of datagrams it dropped on the statsd UDP socket's full queue
/// (SO_RXQ_OVFL), as the last datagram read carried it.
pub struct StatsdUdpDropped {
    pub total: u32,
}

impl StatsdUdpDropped {
    pub fn emit(self) {
        counter!(m::STATSD_UDP_DROPPED).absolute(u64::from(self.total));
    }
}

/// A packet on the statsd stream socket announced longer than the largest datagram: rejected
/// (reason too_long) and its connection closed, since the packets after it cannot be found.
pub struct StatsdFrameTooLong {
    pub bytes: u32,
    pub max_bytes: usize,
}

impl StatsdFrameTooLong {
    pub fn emit(self) {
        static LOG: Throttle = Throttle::new(1000);
        m::rejected(Reject::TooLong, 1);
        if let Some(suppressed) = LOG.allow() {
            warn!(target: "tallyd::statsd::stream", bytes = self.bytes, max_bytes = self.max_bytes, suppressed,
                "statsd stream packet longer than the largest datagram; closing the connection");
        }
    }
}

/// At start: `net.unix.max_dgram_qlen` is below what a Unix datagram socket needs not to lose
/// datagrams of clients that do not block. A warning where such clients are the norm (the
/// statsd socket: DogStatsD's `unix://` does not block by default); on the native datagram
/// socket only, whose senders block (or see `EAGAIN`) when it is full, a note.
pub struct DatagramQueueShort {
    pub qlen: u32,
    pub wanted: u32,
    /// A statsd Unix datagram socket is configured.
    pub statsd: bool,
}

impl DatagramQueueShort {
    pub fn emit(self) {
        let (qlen, wanted) = (self.qlen, self.wanted);
        if self.statsd {
            warn!(target: "tallyd::socket", max_dgram_qlen = qlen, wanted,
                "net.unix.max_dgram_qlen is {qlen}: the kernel queues at most {qlen} datagrams on \
                 the statsd Unix datagram socket, and a client that does not block (DogStatsD's \
                 unix:// by default) drops what does not fit; set it to {wanted} or more (`sysctl \
                 -w net.unix.max_dgram_qlen={wanted}`, and a file in /etc/sysctl.d/ to keep it; \
                 the tallyd package installs /usr/lib/sysctl.d/60-tallyd.conf) or send over a \
                 stream socket (statsd.stream_socket, DogStatsD's unixstream://)");
        } else {
            tracing::info!(target: "tallyd::socket", max_dgram_qlen = qlen, wanted,
                "net.unix.max_dgram_qlen is {qlen}: a client of the datagram socket waits (or gets \
                 EAGAIN) once {qlen} datagrams are queued; a client that must not wait may raise \
                 it to {wanted} (`sysctl -w net.unix.max_dgram_qlen={wanted}`, and a file in \
                 /etc/sysctl.d/ to keep it) or use the stream socket (for statsd clients: \
                 statsd.stream_socket)");
        }
    }
}

/// A DogStatsD event or service check, read and ignored; `kind`: "event" or "service_check".
pub struct StatsdIgnored {
    pub kind: &'static str,
}

impl StatsdIgnored {
    pub fn emit(self) {
        m::statsd_ignored(self.kind);
    }
}

/// The journal of an earlier run was replayed: `events` accepted and committed.
pub struct JournalReplayed {
    pub events: u64,
}

impl JournalReplayed {
    pub fn emit(self) {
        counter!(m::JOURNAL_REPLAYED).increment(self.events);
        tracing::info!(target: "tallyd::daemon", events = self.events, "journal replayed and committed");
    }
}

/// Damage found in the journal segments at start (records not replayed).
pub struct JournalDamaged {
    pub unreadable_records: u64,
    pub unreadable_bytes: u64,
    pub missing: u64,
}

impl JournalDamaged {
    pub fn emit(self) {
        counter!(m::JOURNAL_UNREADABLE_RECORDS).increment(self.unreadable_records);
        counter!(m::JOURNAL_UNREADABLE_BYTES).increment(self.unreadable_bytes);
        counter!(m::JOURNAL_MISSING_RECORDS).increment(self.missing);
    }
}

/// Journal writes started failing (`failing`), or work again.
pub struct JournalFailing {
    pub failing: bool,
}

impl JournalFailing {
    pub fn emit(self) {
        gauge!(m::JOURNAL_FAILING).set(if self.failing { 1.0 } else { 0.0 });
    }
}

/// A flush committed rows of `counter`'s windows, the oldest starting at `start_ms`.
pub struct OldestWindowWritten<'a> {
    pub counter: &'a str,
    pub start_ms: i64,
}

impl OldestWindowWritten<'_> {
    pub fn emit(self) {
        gauge!(m::WINDOW_OLDEST_WRITTEN, "counter" => self.counter.to_string())
            .set(self.start_ms as f64 / 1000.0);
    }
}

/// The rollup deleted `rows` rows of `counter`'s windows older than its `keep_windows`.
pub struct WindowsExpired<'a> {
    pub counter: &'a str,
    pub rows: i64,
}

impl WindowsExpired<'_> {
    pub fn emit(self) {
        counter!(m::WINDOW_ROWS_EXPIRED, "counter" => self.counter.to_string())
            .increment(self.rows.max(0) as u64);
    }
}

/// A record was spilled: journaled only, at the memory cap, for the folder to route later.
pub struct RecordSpilled {
    pub events: u64,
}

impl RecordSpilled {
    pub fn emit(self) {
        counter!(m::JOURNAL_SPILLED_EVENTS).increment(self.events);
    }
}

/// The folder routed a spilled record's events to the buckets.
pub struct RecordFolded {
    pub events: u64,
}

impl RecordFolded {
    pub fn emit(self) {
        counter!(m::JOURNAL_FOLDED_EVENTS).increment(self.events);
    }
}

/// How many records wait spilled in the journal (0 once the folder has routed them all).
pub struct Unfolded {
    pub records: u64,
}

impl Unfolded {
    pub fn emit(self) {
        gauge!(m::JOURNAL_UNFOLDED_RECORDS).set(self.records as f64);
    }
}

/// The bytes of journal segments on disk changed.
pub struct JournalBytes {
    pub bytes: u64,
}

impl JournalBytes {
    pub fn emit(self) {
        gauge!(m::JOURNAL_BYTES).set(self.bytes as f64);
    }
}

/// The flight a flush worker is writing is `age` old (0: the worker is idle).
pub struct FlightAge {
    pub worker: usize,
    pub age: std::time::Duration,
}

impl FlightAge {
    pub fn emit(self) {
        m::flight_age(self.worker, self.age);
    }
}
