//! The journal: every accepted line, appended to segment files in `data_dir/journal` by one
//! writer thread with group commit, so that a crash (kill -9, power loss) loses nothing
//! acknowledged with `!sync`, and replay after a restart applies each line exactly once. This
//! file is the gate that numbers records and orders them against the flushes' drains
//! ([`Journal`]); the writer thread is in [`writer`], the bytes on disk and the lines in
//! [`format`], reading segments back at start (and damage) in [`read`], choosing what to replay
//! in [`replay`], and rewriting them under another layout in [`translate`].
//!
//! Every read buffer's accepted lines form one record with a sequence number: events of every
//! kind (a sum's delta, a max, min or last value, a unique value as its text) and corrections
//! (`!set`, `!forget`), in the order the connection sent them ([`format`]). A connection
//! journals a record and sends its batches to the buckets while holding the journal's gate
//! (shared); a flush worker queues its drains while holding it exclusively. So every drain takes
//! every record numbered below its "drain point" whole, and none above. A flush records, in its
//! own transaction, `journal_covered = drain point - 1` for its writer in `tallyd.flushes`: all of
//! that writer's lines in records up to there are committed. Replay skips, for each writer,
//! exactly those. A segment is deleted once every writer has covered its last record.
//!
//! A correction's line belongs to the writer of its key's bucket, as the key's events do, so the
//! same coverage decides it: it is replayed only when the flight that held it did not commit,
//! and then after the uncommitted lines before it and before the lines after it, as the first
//! time; a committed correction is never applied again (docs/design.md, "Corrections"). A
//! replayed event keeps its event time (`@unix_ms`), so a `last` value replays as the same
//! `(time, value)` pair, and its window is the same.
//!
//! When a write or fsync fails (a full disk), the records that are not known to be durable are
//! kept in memory, `!sync` answers an error, connections stop reading, and the writer retries
//! every [`RETRY_EVERY`], writing those records again to a new segment. A record may then be on
//! disk twice (whole or torn): replay keeps one copy per sequence number.
//!
//! The journal is bounded by `journal.max_bytes`: segments on disk plus records on their way to
//! the writer. At the cap, connections stop reading (as at the memory cap) until flushes commit
//! and covered segments are deleted; `!sync` still answers for what is journaled. A record is
//! counted before its connection awaits anything, so the cap is exceeded by at most one record
//! (a connection's buffer: held lines and the next read; on a datagram socket, one `recvmmsg`
//! batch of up to 32 datagrams) per runtime thread that passed the check at the same moment,
//! plus segment headers.

mod format;
mod read;
pub mod replay;
mod tail;
mod translate;
mod writer;

use std::future::Future;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::{bounded, Sender};
use tokio::sync::{oneshot, Notify};
use tracing::warn;

use crate::config::JournalConfig;
use crate::io_error::IoError;
use crate::routing::Layout;
use format::{encode_header, RECORD_HEADER};

pub use format::{lines, parse_line, push_forget_line, push_line, push_set_line, push_value_line};
pub use read::{
    read_segments, records_from, retire, segments, Damage, Lines, OldJournal, OldSegment, Reader,
};
pub use tail::{read_chunk, Place};
pub use translate::translate;

/// How often a failing journal tries to write again.
pub const RETRY_EVERY: Duration = Duration::from_millis(200);

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// Not `#[from]`: the message prints the I/O error, so it is not the `source()` too.
    #[error("journal: {0}")]
    Io(IoError),
}

fn io_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(io::Error) -> JournalError + 'a {
    move |cause| JournalError::Io(IoError::on(what, path)(cause))
}

/// Creates the journal directory with mode 0700 whatever the umask, or takes every permission
/// of group and others from an existing one and its segments (an older tallyd created them
/// with the umask's modes), with a log line when that changes anything.
fn create_private_dir(dir: &Path) -> Result<(), JournalError> {
    if !dir.is_dir() {
        // Missing parents too (data_dir, when no lock created it: tests), with the same mode.
        return (std::fs::DirBuilder::new().recursive(true).mode(0o700))
            .create(dir)
            .map_err(io_err(dir, "cannot create directory"));
    }
    let restricted =
        crate::instance::restrict(dir, false).map_err(io_err(dir, "cannot restrict"))?;
    if let Some(r) = restricted {
        warn!(dir = %dir.display(), was = %format!("{:04o}", r.was), now = %format!("{:04o}", r.now),
            entries = r.entries, "journal directory was open to other users; restricted it and its segments to tallyd's user");
    }
    Ok(())
}

/// A `!sync` answer: Ok once durable, else why not.
type SyncResult = Result<(), String>;

/// What a connection hands the writer thread.
enum Input {
    Record {
        seq: u64,
        lines: Vec<u8>,
        /// Counts the record against the cap until the writer has counted it on disk.
        reserved: Reservation,
    },
    /// Answered once everything sent before it is durable (per `fsync`).
    Sync(oneshot::Sender<SyncResult>),
    /// As `Sync`, but with `fsync = "interval"` the group it ends is fsynced at once rather
    /// than at the next interval: a flush waits on it ([`Journal::durable_below`]).
    SyncNow(oneshot::Sender<SyncResult>),
    /// Every event in records with a lower sequence number is committed.
    Committed(u64),
}

/// Whether the journal takes records: its writes work and it is below `journal.max_bytes`.
/// Connections stop reading while it does not.
struct Health {
    failing: AtomicBool,
    /// Bytes of the segments on disk, as the writer last counted them.
    disk_bytes: AtomicU64,
    /// Bytes of records handed to the journal and not yet counted in `disk_bytes`.
    queued_bytes: AtomicU64,
    max_bytes: u64,
    /// Signalled when writes work again and when segments are deleted.
    room: Notify,
    /// What the writer keeps on disk besides the bytes, published with them for the status view.
    segments: AtomicU64,
    /// Unix ms when the oldest segment kept was opened (0: none kept).
    oldest_ms: AtomicU64,
}

/// What the journal keeps on disk now (see [`Journal::usage`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub bytes: u64,
    pub segments: u64,
    /// `journal.max_bytes`.
    pub max_bytes: u64,
    /// Unix ms when the oldest segment kept was opened.
    pub oldest_ms: Option<i64>,
}

impl Health {
    fn new(max_bytes: u64) -> Health {
        Health {
            failing: AtomicBool::new(false),
            disk_bytes: AtomicU64::new(0),
            queued_bytes: AtomicU64::new(0),
            max_bytes,
            room: Notify::new(),
            segments: AtomicU64::new(0),
            oldest_ms: AtomicU64::new(0),
        }
    }

    fn set_failing(&self, failing: bool) {
        self.failing.store(failing, Ordering::SeqCst);
        crate::events::JournalFailing { failing }.emit();
        if !failing {
            self.room.notify_waiters();
        }
    }

    /// At `journal.max_bytes`, counting the records on their way to the writer.
    fn full(&self) -> bool {
        // Queued first: the writer counts records on disk before it gives back their
        // reservations, so in this order a record is never missed in both (only seen twice).
        let queued = self.queued_bytes.load(Ordering::SeqCst);
        queued + self.disk_bytes.load(Ordering::SeqCst) >= self.max_bytes
    }

    fn has_room(&self) -> bool {
        !self.failing.load(Ordering::SeqCst) && !self.full()
    }
}

/// A record's bytes, counted against the cap from before its connection awaits anything until
/// the writer has counted it on disk (or it was never sent): dropping it gives them back.
struct Reservation {
    health: Arc<Health>,
    bytes: u64,
}

impl Reservation {
    fn new(health: &Arc<Health>, bytes: u64) -> Reservation {
        health.queued_bytes.fetch_add(bytes, Ordering::SeqCst);
        Reservation {
            health: health.clone(),
            bytes,
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.health
            .queued_bytes
            .fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

/// The handle connections and flush workers use; the writer thread runs behind it.
pub struct Journal {
    tx: Sender<Input>,
    /// Shared while a record is journaled and its batches sent; exclusive while drains are
    /// queued. Taken only inside [`Journal::record`], [`Journal::replayed`], [`Journal::drain`].
    gate: tokio::sync::RwLock<()>,
    /// Numbers records and decides, in the same step, whether one is spilled.
    numbering: Mutex<Numbering>,
    /// Per writer: every record up to this one has its events committed.
    covered: Mutex<Vec<u64>>,
    /// Signalled when a flush advances `covered` (for `!flush` after spilled records).
    coverage: Notify,
    /// Signalled when a record is spilled (for the folder).
    spilling: Notify,
    health: Arc<Health>,
    dir: PathBuf,
    /// Sequence numbers from which segments must stay although covered (see [`Journal::pin`]).
    pins: Mutex<std::collections::BTreeMap<u64, usize>>,
    /// The records a flush must not commit any event of before they are durable (a batch's
    /// routed record: [`Journal::record_batch`]) and that are not yet known durable. Each one
    /// on its own, so that a flush whose drain point is below all of them never waits: while
    /// the journal cannot be written, flushes drained before such a record still commit (and
    /// free covered segments).
    not_durable: Mutex<std::collections::BTreeSet<u64>>,
}

/// No record waits unrouted.
const ROUTED: u64 = u64::MAX;

/// The sequence numbers: the next to give, and the first record whose events are not yet in the
/// buckets (spilled, or an old record the start's replay has not reached), or [`ROUTED`].
/// Every record from `unrouted` on is unrouted too until the folder reaches it: once one record
/// spills, every later one does, so a drain point below `unrouted` covers only routed records.
#[derive(Debug)]
struct Numbering {
    next: u64,
    unrouted: u64,
    /// The first number this run gave: old records (the start's replay) are all below it.
    live_from: u64,
}

/// What [`Journal::record`] did with a record.
#[derive(Debug, PartialEq, Eq)]
pub enum Recorded<T> {
    /// Journaled, and its batches sent to the buckets.
    Sent(T),
    /// Journaled only, as record `seq`: the folder ([`fold`]) routes it later.
    Spilled(u64),
}

impl Journal {
    /// Opens the journal for writing new records numbered from `first_seq`. Old segments must
    /// have been read (see [`read_segments`]) before; they are replayed and retired by the caller.
    pub fn open(
        config: &JournalConfig,
        dir: &Path,
        first_seq: u64,
        layout: &Layout,
    ) -> Result<Journal, JournalError> {
        create_private_dir(dir)?;
        let (tx, rx) = bounded(1024);
        let health = Arc::new(Health::new(config.max_bytes()));
        writer::spawn(dir, config, encode_header(layout), health.clone(), rx)
            .map_err(io_err(dir, "cannot start the writer thread"))?;
        let first_seq = first_seq.max(1);
        Ok(Journal {
            tx,
            gate: tokio::sync::RwLock::new(()),
            numbering: Mutex::new(Numbering {
                next: first_seq,
                unrouted: ROUTED,
                live_from: first_seq,
            }),
            covered: Mutex::new(vec![first_seq - 1; layout.total_workers()]),
            coverage: Notify::new(),
            spilling: Notify::new(),
            health,
            dir: dir.to_path_buf(),
            pins: Mutex::new(Default::default()),
            not_durable: Mutex::new(Default::default()),
        })
    }

    /// Journals `lines` as one record, then runs `send`, which hands the record's batches to the
    /// buckets. The gate is held (shared) from before the record is numbered until `send` is
    /// done, so a drain ([`Journal::drain`]) queued after the record was numbered also comes
    /// after all of its batches: every drain takes whole records below its drain point, none
    /// above. Taking the gate, numbering, appending and sending happen in this one call, in
    /// this order, so no caller can get them wrong. Appending waits (off the async threads)
    /// only when the writer is behind by more than its queue.
    ///
    /// With `spill` (memory is at its cap), or while earlier records are spilled, the record is
    /// journaled only and `send` never runs: the caller drops its batches, and the folder routes
    /// the record later from the segments ([`fold`]). That is what lets intake go on at the
    /// memory cap, bounded by `journal.max_bytes` instead.
    ///
    /// The record counts against `journal.max_bytes` from this call's first poll, before it
    /// awaits anything, so the caller's next [`Journal::has_room`] sees it.
    pub async fn record<F: Future>(
        &self,
        lines: Vec<u8>,
        spill: bool,
        send: F,
    ) -> Recorded<F::Output> {
        self.record_as(lines, spill, send, false).await.1
    }

    /// [`Journal::record`] for a batch's routed record (docs/reliability.md, "Batches"): its
    /// batches are sent at once, and no flush commits any of its events before the record is
    /// durable ([`Journal::durable_below`]), so no restart can find the batch counted and its
    /// held payload without the record that settles it. The wait is the flushes', not the
    /// gate's: connections and drains go on meanwhile. Also returns the record's number, for
    /// [`Journal::wait_durable`]: the held payload may go only once the record is durable.
    pub async fn record_batch<F: Future>(
        &self,
        lines: Vec<u8>,
        spill: bool,
        send: F,
    ) -> (u64, Recorded<F::Output>) {
        self.record_as(lines, spill, send, true).await
    }

    async fn record_as<F: Future>(
        &self,
        lines: Vec<u8>,
        spill: bool,
        send: F,
        durable_first: bool,
    ) -> (u64, Recorded<F::Output>) {
        let reserved = Reservation::new(&self.health, (RECORD_HEADER + lines.len()) as u64);
        let _gate = self.gate.read().await;
        let (seq, spilled) = {
            let mut n = self.numbering.lock().expect("journal numbering");
            let seq = n.next;
            n.next += 1;
            if durable_first {
                self.not_durable
                    .lock()
                    .expect("journal not_durable")
                    .insert(seq);
            }
            let spilled = spill || n.unrouted != ROUTED;
            if spilled && n.unrouted == ROUTED {
                n.unrouted = seq;
            }
            (seq, spilled)
        };
        self.send(Input::Record {
            seq,
            lines,
            reserved,
        })
        .await;
        if spilled {
            self.spilling.notify_one();
            return (seq, Recorded::Spilled(seq));
        }
        (seq, Recorded::Sent(send.await))
    }

    /// Runs `send`, which hands the batches of record `seq` (spilled, or read back from an old
    /// segment at the start) to the buckets, under the gate like [`Journal::record`] but
    /// without journaling it again; then marks it routed ([`Journal::routed`]) before the gate
    /// is let go, so the first drain that can take its batches may also pass its number.
    pub async fn fold<F: Future>(&self, seq: u64, send: F) -> F::Output {
        let _gate = self.gate.read().await;
        let out = send.await;
        self.routed(seq);
        out
    }

    /// Where the segments are (for the folder, which reads spilled records back).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Runs `queue`, which queues a flush worker's drains at its buckets, holding the gate
    /// exclusively; returns its output and the drain point: every record numbered below it is
    /// wholly in these drains or earlier ones, and none above it is in them.
    pub async fn drain<F: Future>(&self, queue: F) -> (F::Output, u64) {
        let _gate = self.gate.write().await;
        let point = {
            let n = self.numbering.lock().expect("journal numbering");
            n.next.min(n.unrouted)
        };
        (queue.await, point)
    }

    /// The start's replay is about to route old records from `first` on: until it has,
    /// no drain point passes them.
    pub fn begin_backlog(&self, first: u64) {
        let mut n = self.numbering.lock().expect("journal numbering");
        n.unrouted = n.unrouted.min(first);
    }

    /// Record `seq` (the first unrouted one, or an old one the replay chose) is routed now:
    /// drain points may pass it.
    fn routed(&self, seq: u64) {
        let mut n = self.numbering.lock().expect("journal numbering");
        if n.unrouted <= seq {
            n.unrouted = seq + 1;
            if n.unrouted >= n.next {
                n.unrouted = ROUTED;
            }
        }
    }

    /// The start's replay has routed every old record it chose. Records of this run numbered
    /// meanwhile were all spilled (`unrouted` was set): the folder takes them from the first.
    pub fn end_backlog(&self) {
        let mut n = self.numbering.lock().expect("journal numbering");
        if n.unrouted < n.live_from {
            n.unrouted = if n.next > n.live_from {
                n.live_from
            } else {
                ROUTED
            };
        }
    }

    /// The first record not yet routed (spilled, or waiting for the replay), if any.
    pub fn unrouted(&self) -> Option<u64> {
        let n = self.numbering.lock().expect("journal numbering");
        (n.unrouted != ROUTED).then_some(n.unrouted)
    }

    /// How many records wait spilled (numbered, not yet routed): 0 when none.
    pub fn unfolded(&self) -> u64 {
        let n = self.numbering.lock().expect("journal numbering");
        if n.unrouted == ROUTED {
            0
        } else {
            n.next.saturating_sub(n.unrouted)
        }
    }

    /// The last record numbered so far.
    pub fn last_numbered(&self) -> u64 {
        self.numbering.lock().expect("journal numbering").next - 1
    }

    /// Waits until a record is spilled (at once if one waits).
    pub async fn spilled(&self) {
        loop {
            let notified = self.spilling.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.unrouted().is_some() {
                return;
            }
            notified.await;
        }
    }

    /// Waits until every writer has committed every record up to `seq` (a `!flush` after
    /// spilled records). Calls `nudge` (to ask for flushes now) once, before the first wait:
    /// not at every wake-up, since an idle writer's empty flush advances coverage too, and a
    /// nudge per wake-up would keep it flushing nothing in a loop until the folder gets there.
    pub async fn wait_covered(&self, seq: u64, nudge: impl FnOnce()) {
        let mut nudge = Some(nudge);
        loop {
            let notified = self.coverage.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let low = self
                .covered
                .lock()
                .expect("journal coverage")
                .iter()
                .copied()
                .min();
            if low.unwrap_or(u64::MAX) >= seq {
                return;
            }
            if let Some(nudge) = nudge.take() {
                nudge();
            }
            notified.await;
        }
    }

    /// Before a flush whose drain point is `point` commits: resolves once every record below
    /// it that [`Journal::record_batch`] numbered is durable (at once when none of them is
    /// not known durable yet, as for a flush drained before all of them). Every record below a
    /// drain point was appended before the drain, so one sync after it covers them all; with
    /// `fsync = "interval"` it fsyncs at once, not at the next interval (a flush is worth one
    /// fsync). Err as [`Journal::sync`].
    pub async fn durable_below(&self, point: u64) -> SyncResult {
        let first = (self.not_durable.lock().expect("journal not_durable"))
            .first()
            .copied();
        if first.is_none_or(|first| first >= point) {
            return Ok(());
        }
        let (tx, rx) = oneshot::channel();
        self.send(Input::SyncNow(tx)).await;
        rx.await
            .unwrap_or_else(|_| Err("the journal writer has stopped".into()))?;
        let mut pending = self.not_durable.lock().expect("journal not_durable");
        *pending = pending.split_off(&point);
        Ok(())
    }

    /// Resolves once record `seq`, numbered by [`Journal::record_batch`] (which appended it
    /// before it returned), is durable: at once if a flush already knew it, else at the next
    /// sync (per `fsync`, as a `!sync`). Err as [`Journal::sync`].
    pub async fn wait_durable(&self, seq: u64) -> SyncResult {
        let known = !(self.not_durable.lock().expect("journal not_durable")).contains(&seq);
        if known {
            return Ok(());
        }
        self.sync().await?;
        (self.not_durable.lock().expect("journal not_durable")).remove(&seq);
        Ok(())
    }

    /// Resolves once everything appended before is durable; Err (the cause) if a write or fsync
    /// of one of those records failed and it is not yet written again.
    pub async fn sync(&self) -> SyncResult {
        let (tx, rx) = oneshot::channel();
        self.send(Input::Sync(tx)).await;
        rx.await
            .unwrap_or_else(|_| Err("the journal writer has stopped".into()))
    }

    /// Bytes and segments on disk, and when the oldest was opened: read from atomics the writer
    /// thread publishes, so it costs nothing.
    pub fn usage(&self) -> Usage {
        let oldest = self.health.oldest_ms.load(Ordering::Relaxed);
        Usage {
            bytes: self.health.disk_bytes.load(Ordering::Relaxed),
            segments: self.health.segments.load(Ordering::Relaxed),
            max_bytes: self.health.max_bytes,
            oldest_ms: (oldest > 0).then_some(oldest as i64),
        }
    }

    /// False while journal writes fail (until a retry has written every failed record).
    pub fn writable(&self) -> bool {
        !self.health.failing.load(Ordering::SeqCst)
    }

    /// False while journal writes fail (until a retry has written every failed record) and
    /// while the journal is at `journal.max_bytes`.
    pub fn has_room(&self) -> bool {
        self.health.has_room()
    }

    /// Returns at once while [`Journal::has_room`]; otherwise waits until a retry has written
    /// every record that failed and deleted segments bring the journal below its cap. Calls
    /// `at_cap` before each wait at the cap (to ask for early flushes: only commits free space).
    /// Returns whether it had to wait.
    pub async fn wait_for_room(&self, at_cap: impl Fn()) -> bool {
        if self.health.has_room() {
            return false;
        }
        loop {
            let room = self.health.room.notified();
            tokio::pin!(room);
            // Register before re-checking, so a recovery in between is not missed.
            room.as_mut().enable();
            if self.health.has_room() {
                return true;
            }
            if self.health.full() {
                at_cap();
            }
            room.await;
        }
    }

    async fn send(&self, input: Input) {
        match self.tx.try_send(input) {
            Ok(()) => {}
            Err(crossbeam_channel::TrySendError::Full(input)) => {
                let tx = self.tx.clone();
                let _ = tokio::task::spawn_blocking(move || tx.send(input)).await;
            }
            Err(crossbeam_channel::TrySendError::Disconnected(_)) => {}
        }
    }

    /// Keeps every segment holding a record numbered from now on, covered or not, until
    /// [`Journal::unpin`] with the number returned: a batch's routed record must outlive the
    /// batch's held payload (docs/reliability.md, "Batches").
    pub fn pin(&self) -> u64 {
        let at = self.numbering.lock().expect("journal numbering").next;
        *self
            .pins
            .lock()
            .expect("journal pins")
            .entry(at)
            .or_default() += 1;
        at
    }

    pub fn unpin(&self, at: u64) {
        let mut pins = self.pins.lock().expect("journal pins");
        if let Some(n) = pins.get_mut(&at) {
            *n -= 1;
            if *n == 0 {
                pins.remove(&at);
            }
        }
    }

    /// Writer `worker` has committed everything drained before `drain_point`; segments that
    /// every writer has covered (and no pin holds) can go.
    pub fn committed(&self, worker: usize, drain_point: u64) {
        let low = {
            let mut covered = self.covered.lock().expect("journal coverage");
            covered[worker] = covered[worker].max(drain_point.saturating_sub(1));
            covered.iter().copied().min().unwrap_or(0)
        };
        let pinned = self
            .pins
            .lock()
            .expect("journal pins")
            .keys()
            .next()
            .copied();
        let low = pinned.map_or(low, |at| low.min(at.saturating_sub(1)));
        self.coverage.notify_waiters();
        let _ = self.tx.try_send(Input::Committed(low + 1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FsyncMode;
    use std::time::Instant;

    fn config(fsync: FsyncMode) -> JournalConfig {
        let mut config = JournalConfig::default();
        config.fsync = fsync;
        config.segment_bytes = 200;
        config.set_fsync_interval(Duration::from_millis(10));
        config
    }

    /// A drain that starts while a record's batches are being sent waits for them, and its
    /// drain point covers that record; a drain never splits a record.
    #[tokio::test]
    async fn a_drain_waits_for_the_batches_of_a_numbered_record() {
        use futures_util::FutureExt;
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::single(1, 1);
        let j = Journal::open(&config(FsyncMode::Off), dir.path(), 1, &layout).unwrap();
        let (sent, batches_sent) = oneshot::channel::<()>();
        let record = j.record(b"c k 1 @1\n".to_vec(), false, batches_sent);
        tokio::pin!(record);
        assert!(
            (&mut record).now_or_never().is_none(),
            "sending its batches"
        );
        let drain = j.drain(async {});
        tokio::pin!(drain);
        assert!(
            (&mut drain).now_or_never().is_none(),
            "waits for the record"
        );
        sent.send(()).unwrap();
        assert!(matches!(record.await, Recorded::Sent(Ok(()))));
        let ((), point) = drain.await;
        assert_eq!(point, 2, "record 1 is below the drain point");
    }

    /// A flush past a batch's record waits for it to be durable, at once even with a long
    /// `fsync_interval_ms` (a `!sync` would wait for the interval); once known durable, a
    /// later flush does not wait again, nor does the batch's own wait for it; a flush drained
    /// before every batch record not known durable never waits (while the journal cannot be
    /// written, such flushes still commit).
    #[tokio::test]
    async fn a_flush_past_a_batch_record_waits_until_it_is_durable() {
        use futures_util::FutureExt;
        let dir = tempfile::tempdir().unwrap();
        let mut config = config(FsyncMode::Interval);
        config.segment_bytes = 1 << 20;
        config.set_fsync_interval(Duration::from_secs(3600));
        let j = Journal::open(&config, dir.path(), 1, &Layout::single(1, 1)).unwrap();
        j.record(b"c k 1 @1\n".to_vec(), false, async {}).await;
        assert!(
            j.durable_below(2).now_or_never().is_some(),
            "no batch record: nothing to wait for"
        );
        let sent = j.record_batch(b"!batch 7\nc k 2 @1\n".to_vec(), false, async {});
        assert_eq!(sent.await, (2, Recorded::Sent(())));
        assert!(
            j.durable_below(2).now_or_never().is_some(),
            "a flush drained before the batch's record (record 2) does not wait for it"
        );
        let sent = j.record_batch(b"!batch 8\nc k 3 @1\n".to_vec(), false, async {});
        assert_eq!(sent.await, (3, Recorded::Sent(())));
        let waited = tokio::time::timeout(Duration::from_secs(30), j.durable_below(3)).await;
        assert!(matches!(waited, Ok(Ok(()))), "fsynced at once: {waited:?}");
        let on_disk: Vec<u8> = std::fs::read_dir(dir.path())
            .unwrap()
            .flat_map(|e| std::fs::read(e.unwrap().path()).unwrap())
            .collect();
        assert!(
            on_disk.windows(8).any(|w| w == b"!batch 7"),
            "the batch's record is written"
        );
        assert!(
            j.durable_below(3).now_or_never().is_some(),
            "known durable: no second wait"
        );
        assert!(
            j.wait_durable(2).now_or_never().is_some(),
            "the batch's own wait: known durable"
        );
        assert!(
            j.durable_below(4).now_or_never().is_none(),
            "record 3 is below a flush drained after it"
        );
    }

    /// A batch's held payload waits for its routed record to be durable: with `fsync =
    /// "always"` at the next group, and after that without waiting again.
    #[tokio::test]
    async fn a_batch_record_is_known_durable_once_synced() {
        use futures_util::FutureExt;
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(
            &config(FsyncMode::Always),
            dir.path(),
            1,
            &Layout::single(1, 1),
        )
        .unwrap();
        let (seq, sent) = j
            .record_batch(b"!batch 7\nc k 2 @1\n".to_vec(), true, async {})
            .await;
        assert_eq!((seq, sent), (1, Recorded::Spilled(1)), "spilled ones too");
        let waited = tokio::time::timeout(Duration::from_secs(30), j.wait_durable(seq)).await;
        assert!(matches!(waited, Ok(Ok(()))), "{waited:?}");
        assert!(
            j.durable_below(2).now_or_never().is_some(),
            "known durable: a flush past it does not wait"
        );
    }

    /// Once a record spills, every later one does, and no drain point passes the first spilled
    /// record until the folder has routed it; then drain points follow the folder, and intake
    /// routes again once it has caught up.
    #[tokio::test]
    async fn drain_points_stop_at_the_first_unrouted_record() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(
            &config(FsyncMode::Off),
            dir.path(),
            1,
            &Layout::single(1, 1),
        )
        .unwrap();
        let line = || b"c k 1 @1\n".to_vec();
        assert_eq!(j.record(line(), false, async {}).await, Recorded::Sent(()));
        assert_eq!(j.record(line(), true, async {}).await, Recorded::Spilled(2));
        assert_eq!(
            j.record(line(), false, async {}).await,
            Recorded::Spilled(3),
            "after a spilled record, every record spills"
        );
        assert_eq!(j.drain(async {}).await.1, 2, "record 2 is not routed");
        assert_eq!(j.unrouted(), Some(2));
        j.fold(2, async {}).await;
        assert_eq!(j.drain(async {}).await.1, 3);
        assert_eq!(
            j.record(line(), false, async {}).await,
            Recorded::Spilled(4)
        );
        j.fold(3, async {}).await;
        j.fold(4, async {}).await;
        assert_eq!(j.unrouted(), None, "caught up");
        assert_eq!(j.drain(async {}).await.1, 5);
        assert_eq!(j.record(line(), false, async {}).await, Recorded::Sent(()));
        assert_eq!(j.drain(async {}).await.1, 6);
    }

    /// The start's replay: old records below the first new number hold the drain point until
    /// routed; a record of this run numbered meanwhile is spilled and left to the folder.
    #[tokio::test]
    async fn a_backlog_holds_the_drain_point_until_replayed() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(
            &config(FsyncMode::Off),
            dir.path(),
            10,
            &Layout::single(1, 1),
        )
        .unwrap();
        j.begin_backlog(4);
        assert_eq!(j.drain(async {}).await.1, 4);
        j.fold(4, async {}).await;
        j.fold(7, async {}).await;
        assert_eq!(j.drain(async {}).await.1, 8);
        assert_eq!(
            j.record(b"c k 1 @1\n".to_vec(), false, async {}).await,
            Recorded::Spilled(10)
        );
        j.fold(9, async {}).await;
        j.end_backlog();
        assert_eq!(
            j.unrouted(),
            Some(10),
            "the live record waits for the folder"
        );
        j.fold(10, async {}).await;
        assert_eq!(j.unrouted(), None);
        assert_eq!(j.drain(async {}).await.1, 11);
    }

    /// At `max_bytes` (segments on disk plus records on their way) the journal has no room;
    /// once the records are committed and their segments deleted, it has again, and the waiter
    /// is woken.
    #[tokio::test]
    async fn the_cap_holds_until_covered_segments_go() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::single(1, 1);
        let mut config = config(FsyncMode::Off);
        config.segment_bytes = 4096;
        config.max_bytes = 16 * 1024;
        let j = Journal::open(&config, dir.path(), 1, &layout).unwrap();
        let mut records = 0;
        while j.has_room() {
            j.record(vec![b'x'; 1000], false, async {}).await;
            records += 1;
        }
        // 1,020 bytes a record, counted before the writer wrote them: 16 fill the cap but for
        // 64 bytes, and a 17th is taken only if no segment header was counted yet.
        assert!((16..=17).contains(&records), "{records} records");
        assert_eq!(j.sync().await, Ok(()));
        assert!(!j.has_room(), "still full once on disk");
        let waiter = j.wait_for_room(|| {});
        tokio::pin!(waiter);
        assert!(futures_util::FutureExt::now_or_never(&mut waiter).is_none());
        let ((), point) = j.drain(async {}).await;
        j.committed(0, point);
        assert!(waiter.await, "woken once covered segments are deleted");
        assert!(j.has_room());
    }

    #[tokio::test]
    async fn records_round_trip_and_covered_segments_go() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout {
            buckets: 4,
            workers: 2,
            map: vec![0, 0, 1],
        };
        let j = Journal::open(&config(FsyncMode::Always), dir.path(), 1, &layout).unwrap();
        for i in 0..20 {
            let mut lines = Vec::new();
            push_line(&mut lines, "c", &format!("k{i}"), i, 1000 + i);
            j.record(lines, false, async {}).await;
        }
        assert_eq!(j.sync().await, Ok(()));
        let read = |dir: &Path| read_segments(dir, &Layout::single(1, 1)).unwrap();
        let old = read(dir.path());
        let segs = old.segments;
        assert!(segs.len() > 1, "small segment_bytes rotates");
        assert_eq!(old.damage, Damage::default());
        let records = read::loaded(&segs);
        assert_eq!(records.len(), 20);
        assert_eq!(records[3], (4, b"c k3 3 @1003\n".to_vec()));
        assert_eq!(segs[0].layout, layout);

        let ((), point) = j.drain(async {}).await;
        assert_eq!(point, 21);
        // Writers covering everything one by one is not enough: another may still hold events.
        for w in 0..3 {
            j.committed(w, point);
        }
        assert_eq!(j.sync().await, Ok(()));
        assert_eq!(read(dir.path()).segments.len(), segs.len());
        j.committed(3, point);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !read(dir.path()).segments.is_empty() {
            assert!(
                Instant::now() < deadline,
                "covered segments were not deleted"
            );
            j.committed(3, point);
            assert_eq!(j.sync().await, Ok(()));
        }
    }
}
