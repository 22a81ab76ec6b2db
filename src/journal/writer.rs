//! The journal's writer thread: takes the records connections hand the journal, appends them
//! to the open segment and makes them durable by the fsync mode, with group commit (everything
//! queued is written, then fsynced once); answers `!sync` once what came before it is durable;
//! rotates segments at `journal.segment_bytes` and deletes the ones every writer has covered.
//! When a write or fsync fails (a full disk), it keeps the records not known to be durable in
//! memory, says so ([`Health`]: connections stop reading, `!sync` answers the error) and
//! writes them again to a new segment every [`RETRY_EVERY`]. It counts the bytes on disk for
//! `journal.max_bytes`, the gauge and the status view.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{select, Receiver};
use tokio::sync::oneshot;
use tracing::{error, info, warn};

use super::format::{record_header, RECORD_HEADER};
use super::{Health, Input, SyncResult, RETRY_EVERY};
use crate::config::{FsyncMode, JournalConfig};

/// Starts the writer thread: it writes what `rx` brings into segments of `dir`, each opening
/// with `header`, and runs until every sender is gone.
pub(super) fn spawn(
    dir: &Path,
    config: &JournalConfig,
    header: Vec<u8>,
    health: Arc<Health>,
    rx: Receiver<Input>,
) -> io::Result<()> {
    let writer = Writer {
        dir: dir.to_path_buf(),
        config: config.clone(),
        header,
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
        health,
        full: false,
    };
    std::thread::Builder::new()
        .name("tallyd-journal".into())
        .spawn(move || writer.run(rx))?;
    Ok(())
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
            // A `SyncNow` in this group: fsynced now whatever the interval.
            let mut now = false;
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
                    Input::Sync(ack) | Input::SyncNow(ack) if self.failing => {
                        let _ = ack.send(Err(self.cause.clone()));
                    }
                    Input::Sync(ack) => self.pending_syncs.push(ack),
                    Input::SyncNow(ack) => {
                        self.pending_syncs.push(ack);
                        now = true;
                    }
                    Input::Committed(l) => low = low.max(l),
                }
            }
            if !self.failing {
                let due = match self.config.fsync {
                    FsyncMode::Always => true,
                    FsyncMode::Interval => now || self.last_fsync.elapsed() >= interval,
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
