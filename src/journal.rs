//! The journal: accepted events, appended to segment files in `data_dir/journal` by one writer
//! thread with group commit, so that a crash (kill -9, power loss) loses nothing acknowledged
//! with `!sync`, and replay after a restart applies each event exactly once. Reading segments
//! back at start (and damage) is in [`read`]; choosing what to replay is in [`replay`].
//!
//! Every read buffer's accepted events form one record with a sequence number. A connection
//! journals a record and sends its batches to the buckets while holding the journal's gate
//! (shared); a flush worker queues its drains while holding it exclusively. So every drain takes
//! every record numbered below its "drain point" whole, and none above. A flush records, in its
//! own transaction, `journal_covered = drain point - 1` for its writer in `tallyd.flushes`: all of
//! that writer's events in records up to there are committed. Replay skips, for each writer,
//! exactly those. A segment is deleted once every writer has covered its last record.
//!
//! Record layout: `mark: 4 bytes | len: u32 | seq: u64 | crc32: u32 | len bytes of lines`,
//! little endian; the CRC covers `len`, `seq` and the lines, and the mark lets a reader find the
//! next record after a damaged one. The lines are canonical protocol lines
//! `counter key delta @unix_ms\n`. A segment starts with a header (with its own CRC) that records
//! how keys were spread over writers when it was written.
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

mod read;
pub mod replay;
mod translate;

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::future::Future;
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, select, Receiver, Sender};
use tokio::sync::{oneshot, Notify};
use tracing::{error, info, warn};

use crate::config::{FsyncMode, JournalConfig};
use crate::io_error::IoError;
use crate::routing::Layout;

pub use read::{read_segments, records_from, retire, segments, Damage, OldJournal, OldSegment};
pub use translate::translate;

const MAGIC: &[u8; 8] = b"TALLYJ3\n";
/// The format before record marks and the header CRC: still read, never written.
const MAGIC_V2: &[u8; 8] = b"TALLYJ2\n";
/// A segment rewritten under another layout ([`translate`]), laid out as [`MAGIC`]'s: it
/// supersedes every record of the other segments numbered below its own first record.
const MAGIC_TRANSLATED: &[u8; 8] = b"TALLYJT\n";
/// Magic, buckets and workers per database, and the length of the shard map that follows (then
/// the map and a CRC-32 of everything before it).
const HEADER_LEN: usize = 20;
/// Starts every record. 0xFF never occurs in the UTF-8 lines of a record, so a reader that lost
/// its place finds the next record by this mark (and confirms it by the CRC).
const RECORD_MARK: [u8; 4] = [0xFF, 0xA5, b'T', b'R'];
const RECORD_HEADER: usize = 20;
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
        let writer = Writer {
            dir: dir.to_path_buf(),
            config: config.clone(),
            header: encode_header(layout),
            current: None,
            closed: VecDeque::new(),
            pending_syncs: Vec::new(),
            unconfirmed: Vec::new(),
            unwritten: Vec::new(),
            failing: false,
            cause: String::new(),
            retry_at: Instant::now(),
            dirty: false,
            last_fsync: Instant::now(),
            health: health.clone(),
            full: false,
        };
        std::thread::Builder::new()
            .name("tallyd-journal".into())
            .spawn(move || writer.run(rx))
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
        let reserved = Reservation::new(&self.health, (RECORD_HEADER + lines.len()) as u64);
        let _gate = self.gate.read().await;
        let (seq, spilled) = {
            let mut n = self.numbering.lock().expect("journal numbering");
            let seq = n.next;
            n.next += 1;
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
            return Recorded::Spilled(seq);
        }
        Recorded::Sent(send.await)
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

    /// Writer `worker` has committed everything drained before `drain_point`; segments that
    /// every writer has covered can go.
    pub fn committed(&self, worker: usize, drain_point: u64) {
        let low = {
            let mut covered = self.covered.lock().expect("journal coverage");
            covered[worker] = covered[worker].max(drain_point.saturating_sub(1));
            covered.iter().copied().min().unwrap_or(0)
        };
        self.coverage.notify_waiters();
        let _ = self.tx.try_send(Input::Committed(low + 1));
    }
}

struct Segment {
    path: PathBuf,
    file: BufWriter<File>,
    bytes: u64,
    last_seq: u64,
    /// Holds records known to be durable: kept when a later write fails (else deleted).
    confirmed: bool,
    /// The highest number of those durable records (0: none).
    confirmed_last_seq: u64,
    /// Unix ms when it was opened (for the status view's oldest segment age).
    opened_ms: u64,
}

/// A closed segment the writer keeps until every record in it is committed.
struct Closed {
    path: PathBuf,
    last_seq: u64,
    bytes: u64,
    opened_ms: u64,
}

impl Closed {
    fn of(seg: &Segment) -> Closed {
        Closed {
            path: seg.path.clone(),
            last_seq: seg.last_seq,
            bytes: seg.bytes,
            opened_ms: seg.opened_ms,
        }
    }
}

/// The writer thread's state.
struct Writer {
    dir: PathBuf,
    config: JournalConfig,
    /// The segment header: how keys were routed to writers when these records were written.
    header: Vec<u8>,
    current: Option<Segment>,
    /// Closed segments, oldest first.
    closed: VecDeque<Closed>,
    /// `!sync`s waiting for the next fsync (or write, with `off`).
    pending_syncs: Vec<oneshot::Sender<SyncResult>>,
    /// Records in the current segment not yet known to be durable (handed to the OS with `off`,
    /// fsynced otherwise): if that fails, they are written again.
    unconfirmed: Vec<(u64, Vec<u8>)>,
    /// Records whose write or fsync failed, kept until a retry writes them (in order).
    unwritten: Vec<(u64, Vec<u8>)>,
    /// A write or fsync failed and no retry has succeeded since: records go to `unwritten`.
    failing: bool,
    /// Why, for the `!sync` answers.
    cause: String,
    retry_at: Instant,
    /// Written since the last fsync.
    dirty: bool,
    last_fsync: Instant,
    health: Arc<Health>,
    /// At `journal.max_bytes` when the size was last counted.
    full: bool,
}

impl Writer {
    /// Group commit: takes everything queued, writes it, then fsyncs once (per `fsync`). While
    /// failing, it wakes every [`RETRY_EVERY`] to write the failed records again.
    fn run(mut self, rx: Receiver<Input>) {
        let interval = self.config.fsync_interval();
        let mut low = 0u64;
        // Records taken this round: counted against the cap until the size is counted again.
        let mut taken = Vec::new();
        loop {
            let timeout = if self.failing {
                self.retry_at.saturating_duration_since(Instant::now())
            } else if self.dirty && self.config.fsync == FsyncMode::Interval {
                interval.saturating_sub(self.last_fsync.elapsed())
            } else {
                Duration::from_secs(3600)
            };
            let first = select! {
                recv(rx) -> msg => match msg {
                    Ok(m) => Some(m),
                    Err(_) => break,
                },
                default(timeout) => None,
            };
            for input in first.into_iter().chain(rx.try_iter().take(4096)) {
                match input {
                    Input::Record {
                        seq,
                        lines,
                        reserved,
                    } => {
                        self.append(seq, lines);
                        taken.push(reserved);
                    }
                    Input::Sync(ack) if self.failing => {
                        let _ = ack.send(Err(self.cause.clone()));
                    }
                    Input::Sync(ack) => self.pending_syncs.push(ack),
                    Input::Committed(l) => low = low.max(l),
                }
            }
            if !self.failing {
                let due = match self.config.fsync {
                    FsyncMode::Always => true,
                    FsyncMode::Interval => self.last_fsync.elapsed() >= interval,
                    FsyncMode::Off => false,
                };
                self.end_group(due);
            } else if Instant::now() >= self.retry_at {
                self.retry();
            }
            let deleted = self.delete_covered(low);
            self.count_bytes();
            taken.clear();
            if deleted {
                self.health.room.notify_waiters();
            }
        }
        if self.failing {
            self.retry();
        } else {
            self.end_group(true);
        }
        // At a stop, `off` too forces its records to disk.
        if self.dirty && !self.failing {
            self.fsync();
        }
        if self.failing {
            error!(dir = %self.dir.display(), records = self.unwritten.len(), cause = %self.cause, "journal still failing at stop: these records were never written; their events survive only if the final flush committed them");
        }
    }

    /// Hands the group to the OS and, when `fsync_due` (and the mode fsyncs), forces it to disk;
    /// answers the `!sync`s that this makes durable.
    fn end_group(&mut self, fsync_due: bool) {
        // Hand everything to the OS at once: a killed process then loses nothing written.
        if let Some(seg) = self.current.as_mut() {
            if let Err(e) = seg.file.flush() {
                return self.fail(e, "cannot write");
            }
        }
        if self.config.fsync == FsyncMode::Off {
            // `off` promises only that records reached the OS: safe from a process crash.
            self.confirm();
        } else if self.dirty && fsync_due {
            self.fsync();
        } else if !self.dirty {
            // Nothing written since the last fsync: every earlier record is durable.
            self.confirm();
        }
    }

    /// Writes a record to the current segment, or keeps it for a retry while failing.
    fn append(&mut self, seq: u64, lines: Vec<u8>) {
        if self.failing {
            self.unwritten.push((seq, lines));
            return;
        }
        let result = self.segment_for(seq).and_then(|seg| {
            seg.last_seq = seg.last_seq.max(seq);
            seg.file.write_all(&record_header(seq, &lines))?;
            seg.file.write_all(&lines)?;
            seg.bytes += (RECORD_HEADER + lines.len()) as u64;
            Ok(())
        });
        self.dirty = true;
        match result {
            Ok(()) => self.unconfirmed.push((seq, lines)),
            Err(e) => {
                self.fail(e, "cannot write");
                self.unwritten.push((seq, lines));
            }
        }
    }

    /// The open segment, rotating to a new one when it is full.
    fn segment_for(&mut self, seq: u64) -> io::Result<&mut Segment> {
        let full = self
            .current
            .as_ref()
            .is_some_and(|s| s.bytes >= self.config.segment_bytes);
        if full {
            let seg = self.current.as_mut().expect("checked above");
            seg.file.flush()?;
            seg.file.get_ref().sync_data()?;
            self.confirm();
            let old = self.current.take().expect("checked above");
            self.closed.push_back(Closed::of(&old));
        }
        if self.current.is_none() {
            self.current = Some(self.open_segment(seq)?);
        }
        Ok(self.current.as_mut().expect("opened above"))
    }

    /// Creates a segment named after its first record. A retry can start a segment with the
    /// number of one that failed: that one keeps its name, the new one gets a suffix.
    fn open_segment(&self, seq: u64) -> io::Result<Segment> {
        let mut path = self.dir.join(format!("{seq:020}.journal"));
        let mut n = 1;
        while path.symlink_metadata().is_ok() {
            path = self.dir.join(format!("{seq:020}-{n}.journal"));
            n += 1;
        }
        // Owner only whatever the umask: it holds every key, and is replayed at the next start.
        let file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .mode(0o600)
            .open(&path)?;
        let mut file = BufWriter::with_capacity(256 * 1024, file);
        let header = file
            .write_all(&self.header)
            // The new file's directory entry must survive a power loss too.
            .and_then(|_| File::open(&self.dir)?.sync_all());
        if let Err(e) = header {
            drop(file.into_parts());
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        Ok(Segment {
            path,
            file,
            bytes: self.header.len() as u64,
            last_seq: seq,
            confirmed: false,
            confirmed_last_seq: 0,
            opened_ms: crate::clock::now_ms().max(1) as u64,
        })
    }

    fn fsync(&mut self) {
        let result = match self.current.as_mut() {
            Some(seg) => seg
                .file
                .flush()
                .and_then(|_| seg.file.get_ref().sync_data()),
            None => Ok(()),
        };
        self.dirty = false;
        self.last_fsync = Instant::now();
        match result {
            Ok(()) => self.confirm(),
            Err(e) => self.fail(e, "cannot fsync"),
        }
    }

    /// Everything written so far is durable (per mode): answers the waiting `!sync`s.
    fn confirm(&mut self) {
        if let Some(seg) = self.current.as_mut() {
            seg.confirmed |= !self.unconfirmed.is_empty();
            let high = self.unconfirmed.iter().map(|r| r.0).max().unwrap_or(0);
            seg.confirmed_last_seq = seg.confirmed_last_seq.max(high);
        }
        self.unconfirmed.clear();
        for ack in self.pending_syncs.drain(..) {
            let _ = ack.send(Ok(()));
        }
    }

    /// A write or fsync failed. Which of the current segment's unconfirmed records reached the
    /// disk is unknown (a torn record may end it), so the segment takes no more records and all
    /// of them are kept for a retry; the `!sync`s waiting for them answer the error; connections
    /// stop reading until a retry succeeds.
    fn fail(&mut self, e: io::Error, what: &str) {
        if let Some(seg) = self.current.take() {
            // Only its durable records are kept here: the others go to `unwritten`, to be
            // written again into a new segment. So the segment can go once those are
            // committed, even though copies of later records may be in it (needed where the
            // failure is a full disk: its space is what the retry needs).
            let closed = Closed {
                last_seq: seg.confirmed_last_seq,
                ..Closed::of(&seg)
            };
            // into_parts: the buffered rest is dropped, never written after the failure.
            let Segment {
                file, confirmed, ..
            } = seg;
            drop(file.into_parts());
            // A segment without a durable record is only a copy of records kept in memory:
            // removing it gives back the space.
            if confirmed || std::fs::remove_file(&closed.path).is_err() {
                self.closed.push_back(closed);
            }
        }
        let mut records = std::mem::take(&mut self.unconfirmed);
        records.append(&mut self.unwritten);
        self.unwritten = records;
        self.cause = format!("journal {what}: {e}");
        self.failing = true;
        self.dirty = false;
        self.retry_at = Instant::now() + RETRY_EVERY;
        // Reading pauses before any `!sync` hears of the failure.
        let first = !self.health.failing.load(Ordering::SeqCst);
        if first {
            self.health.set_failing(true);
        }
        crate::events::JournalWriteFailed {
            dir: &self.dir,
            what,
            cause: &e,
            first,
            unwritten: self.unwritten.len(),
        }
        .emit();
        for ack in self.pending_syncs.drain(..) {
            let _ = ack.send(Err(self.cause.clone()));
        }
    }

    /// Writes every failed record again, into a new segment, and makes it durable (per mode:
    /// fsynced unless `off`). On success reading resumes; on failure it is tried again later.
    fn retry(&mut self) {
        let records = std::mem::take(&mut self.unwritten);
        let count = records.len();
        self.failing = false;
        for (seq, lines) in records {
            self.append(seq, lines);
        }
        if !self.failing {
            self.end_group(true);
        }
        if !self.failing {
            self.health.set_failing(false);
            info!(dir = %self.dir.display(), records = count, "journal writable again; records that had failed are written; connections read again");
        }
    }

    /// Deletes closed segments whose every record is below `low` (all committed). The open
    /// segment is closed and deleted too once it is fully covered and idle, so an idle daemon
    /// keeps no journal. Returns whether it deleted any.
    fn delete_covered(&mut self, low: u64) -> bool {
        let mut deleted = false;
        while let Some(Closed { path, last_seq, .. }) = self.closed.front() {
            if *last_seq >= low {
                break;
            }
            if let Err(e) = std::fs::remove_file(path) {
                warn!(path = %path.display(), cause = %e, "cannot delete covered journal segment");
            }
            self.closed.pop_front();
            deleted = true;
        }
        let covered = self.current.as_ref().is_some_and(|s| s.last_seq < low);
        if covered && self.closed.is_empty() {
            let seg = self.current.take().expect("checked above");
            drop(seg.file.into_parts());
            let _ = std::fs::remove_file(&seg.path);
            // Its records are committed: nothing of them needs writing again.
            self.unconfirmed.clear();
            deleted = true;
        }
        deleted
    }

    /// Counts the segments' bytes for the cap, the gauge and the status view (with the segments
    /// and when the oldest was opened); says when the journal reaches
    /// `journal.max_bytes` or goes back below it. Before the round's reservations are dropped,
    /// so a record is never counted in neither.
    fn count_bytes(&mut self) {
        let current = self.current.as_ref();
        let closed: u64 = self.closed.iter().map(|c| c.bytes).sum();
        let bytes = closed + current.map_or(0, |s| s.bytes);
        self.health.disk_bytes.store(bytes, Ordering::SeqCst);
        let segments = self.closed.len() + usize::from(current.is_some());
        let oldest = self
            .closed
            .front()
            .map(|c| c.opened_ms)
            .or(current.map(|s| s.opened_ms))
            .unwrap_or(0);
        self.health
            .segments
            .store(segments as u64, Ordering::Relaxed);
        self.health.oldest_ms.store(oldest, Ordering::Relaxed);
        crate::events::JournalBytes { bytes }.emit();
        let full = bytes >= self.health.max_bytes;
        if full != self.full {
            self.full = full;
            crate::events::JournalFull {
                dir: &self.dir,
                bytes,
                max_bytes: self.health.max_bytes,
                full,
            }
            .emit();
        }
    }
}

fn record_header(seq: u64, lines: &[u8]) -> [u8; RECORD_HEADER] {
    let mut h = [0u8; RECORD_HEADER];
    h[0..4].copy_from_slice(&RECORD_MARK);
    h[4..8].copy_from_slice(&(lines.len() as u32).to_le_bytes());
    h[8..16].copy_from_slice(&seq.to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&h[4..16]);
    crc.update(lines);
    h[16..20].copy_from_slice(&crc.finalize().to_le_bytes());
    h
}

fn encode_header(layout: &Layout) -> Vec<u8> {
    header(MAGIC, layout)
}

/// The header of a translated segment.
fn encode_translated_header(layout: &Layout) -> Vec<u8> {
    header(MAGIC_TRANSLATED, layout)
}

fn header(magic: &[u8; 8], layout: &Layout) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_LEN + 2 * layout.map.len() + 4);
    h.extend_from_slice(magic);
    h.extend_from_slice(&(layout.buckets as u32).to_le_bytes());
    h.extend_from_slice(&(layout.workers as u32).to_le_bytes());
    h.extend_from_slice(&(layout.map.len() as u32).to_le_bytes());
    for &d in &layout.map {
        h.extend_from_slice(&d.to_le_bytes());
    }
    let crc = crc32fast::hash(&h);
    h.extend_from_slice(&crc.to_le_bytes());
    h
}

/// Appends the canonical line of one accepted event to a record.
pub fn push_line(buf: &mut Vec<u8>, counter: &str, key: &str, delta: i64, at_ms: i64) {
    let mut num = itoa::Buffer::new();
    buf.extend_from_slice(counter.as_bytes());
    buf.push(b' ');
    buf.extend_from_slice(key.as_bytes());
    buf.push(b' ');
    buf.extend_from_slice(num.format(delta).as_bytes());
    buf.extend_from_slice(b" @");
    buf.extend_from_slice(num.format(at_ms).as_bytes());
    buf.push(b'\n');
}

/// Appends a unique counter's event as a line: `<counter> <key> <value> @<unix_ms>\n`.
pub fn push_value_line(buf: &mut Vec<u8>, counter: &str, key: &str, value: &str, at_ms: i64) {
    let mut num = itoa::Buffer::new();
    buf.extend_from_slice(counter.as_bytes());
    buf.push(b' ');
    buf.extend_from_slice(key.as_bytes());
    buf.push(b' ');
    buf.extend_from_slice(value.as_bytes());
    buf.extend_from_slice(b" @");
    buf.extend_from_slice(num.format(at_ms).as_bytes());
    buf.push(b'\n');
}

/// The non-empty lines of a record, as [`push_line`] wrote them (without their `\n`).
pub fn lines(record: &[u8]) -> impl Iterator<Item = &[u8]> {
    record.split(|&b| b == b'\n').filter(|l| !l.is_empty())
}

/// The counter and key of a line written by [`push_line`] (all replay needs to route it; the
/// whole line is parsed again by the protocol parser when replayed). None without a key.
pub fn parse_line(line: &[u8]) -> Option<(&[u8], &[u8])> {
    let mut fields = line.splitn(3, |&b| b == b' ');
    Some((fields.next()?, fields.next()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_read_back_as_written() {
        let mut record = Vec::new();
        push_line(&mut record, "page_views", "/a/b", -3, 1_700_000_000_000);
        push_line(&mut record, "c", "k", 1, 5);
        assert_eq!(record, b"page_views /a/b -3 @1700000000000\nc k 1 @5\n");
        let read: Vec<_> = lines(&record).map(parse_line).collect();
        assert_eq!(
            read,
            vec![
                Some((&b"page_views"[..], &b"/a/b"[..])),
                Some((&b"c"[..], &b"k"[..]))
            ]
        );
        assert_eq!(parse_line(b"lonely"), None);
    }

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
        let records: Vec<_> = segs.iter().flat_map(|s| s.records.clone()).collect();
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
