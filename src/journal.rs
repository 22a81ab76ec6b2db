//! The journal: accepted events, appended to segment files in `data_dir/journal` by one writer
//! thread with group commit, so that a crash (kill -9, power loss) loses nothing acknowledged
//! with `!sync`, and replay after a restart applies each event exactly once.
//!
//! Every read buffer's accepted events form one record with a sequence number. A connection
//! journals a record and sends its batches to the buckets while holding the journal's gate
//! (shared); a flush worker queues its drains while holding it exclusively. So every drain takes
//! every record numbered below its "drain point" whole, and none above. A flush records, in its
//! own transaction, `journal_covered = drain point - 1` for its writer in `tallyd.flushes`: all of
//! that writer's events in records up to there are committed. Replay skips, for each writer,
//! exactly those. A segment is deleted once every writer has covered its last record.
//!
//! Record layout: `len: u32 | crc32: u32 | seq: u64 | len bytes of lines`, little endian; the
//! lines are canonical protocol lines `counter key delta @unix_ms\n`. A segment starts with a
//! header that records how keys were spread over writers when it was written.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, select, Receiver, Sender};
use tokio::sync::oneshot;
use tracing::{error, info, warn};

use crate::bucket::Layout;
use crate::config::{FsyncMode, JournalConfig};
use crate::throttle::Throttle;

const MAGIC: &[u8; 8] = b"TALLYJ2\n";
/// Magic, buckets and workers per database, and the length of the shard map that follows.
const HEADER_LEN: usize = 20;
const RECORD_HEADER: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("journal {path}: {what}: {cause}")]
    Io {
        path: PathBuf,
        what: &'static str,
        cause: io::Error,
    },
}

fn io_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(io::Error) -> JournalError + 'a {
    move |cause| JournalError::Io {
        path: path.to_path_buf(),
        what,
        cause,
    }
}

/// What a connection hands the writer thread.
enum Input {
    Record {
        seq: u64,
        lines: Vec<u8>,
    },
    /// Answered once everything sent before it is durable (per `fsync`).
    Sync(oneshot::Sender<bool>),
    /// Every event in records with a lower sequence number is committed.
    Committed(u64),
}

/// The handle connections and flush workers use; the writer thread runs behind it.
pub struct Journal {
    tx: Sender<Input>,
    /// Shared while a record is journaled and its batches sent; exclusive while drains are queued.
    gate: tokio::sync::RwLock<()>,
    next_seq: AtomicU64,
    /// Per writer: every record up to this one has its events committed.
    covered: Mutex<Vec<u64>>,
}

impl Journal {
    /// Opens the journal for writing new records numbered from `first_seq`. Old segments must
    /// have been read (see [`read_segments`]) before; they are replayed and deleted by the caller.
    pub fn open(
        config: &JournalConfig,
        dir: &Path,
        first_seq: u64,
        layout: &Layout,
    ) -> Result<Journal, JournalError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir, "cannot create directory"))?;
        let (tx, rx) = bounded(1024);
        let writer = Writer {
            dir: dir.to_path_buf(),
            config: config.clone(),
            header: encode_header(layout),
            current: None,
            closed: VecDeque::new(),
            pending_syncs: Vec::new(),
            dirty: false,
            failed: false,
            last_fsync: Instant::now(),
        };
        std::thread::Builder::new()
            .name("tallyd-journal".into())
            .spawn(move || writer.run(rx))
            .map_err(io_err(dir, "cannot start the writer thread"))?;
        let first_seq = first_seq.max(1);
        Ok(Journal {
            tx,
            gate: tokio::sync::RwLock::new(()),
            next_seq: AtomicU64::new(first_seq),
            covered: Mutex::new(vec![first_seq - 1; layout.total_workers()]),
        })
    }

    /// Held while a record is numbered, appended and its batches sent.
    pub async fn record_gate(&self) -> tokio::sync::RwLockReadGuard<'_, ()> {
        self.gate.read().await
    }

    /// Held while a flush worker queues its drains; returns the drain point: every record below
    /// it is wholly in this drain or an earlier one.
    pub async fn drain_gate(&self) -> (tokio::sync::RwLockWriteGuard<'_, ()>, u64) {
        let guard = self.gate.write().await;
        (guard, self.next_seq.load(Ordering::SeqCst))
    }

    /// The next record's sequence number (call under the record gate).
    pub fn next_seq(&self) -> u64 {
        self.next_seq.fetch_add(1, Ordering::SeqCst)
    }

    /// Queues a record for writing. Waits (off the async threads) only when the writer is
    /// behind by more than its queue.
    pub async fn append(&self, seq: u64, lines: Vec<u8>) {
        self.send(Input::Record { seq, lines }).await
    }

    /// Resolves once everything appended before is durable; false if the journal failed.
    pub async fn sync(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        self.send(Input::Sync(tx)).await;
        rx.await.unwrap_or(false)
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
        let _ = self.tx.try_send(Input::Committed(low + 1));
    }
}

struct Segment {
    path: PathBuf,
    file: BufWriter<File>,
    bytes: u64,
    last_seq: u64,
}

/// The writer thread's state.
struct Writer {
    dir: PathBuf,
    config: JournalConfig,
    /// The segment header: how keys were routed to writers when these records were written.
    header: Vec<u8>,
    current: Option<Segment>,
    /// Closed segments and the last sequence number each holds, oldest first.
    closed: VecDeque<(PathBuf, u64)>,
    pending_syncs: Vec<oneshot::Sender<bool>>,
    /// Written since the last fsync.
    dirty: bool,
    /// A write or fsync failed: from then on `!sync` answers an error (until restart), since
    /// an earlier record of the asking connection may be the one that was lost.
    failed: bool,
    last_fsync: Instant,
}

static JOURNAL_ERROR_LOG: Throttle = Throttle::new(5_000);

impl Writer {
    /// Group commit: takes everything queued, writes it, then fsyncs once (per `fsync`).
    fn run(mut self, rx: Receiver<Input>) {
        let interval = Duration::from_millis(self.config.fsync_interval_ms);
        let mut low = 0u64;
        loop {
            let timeout = if self.dirty && self.config.fsync == FsyncMode::Interval {
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
            let mut ok = true;
            for input in first.into_iter().chain(rx.try_iter().take(4096)) {
                match input {
                    Input::Record { seq, lines } => ok &= self.write(seq, &lines),
                    Input::Sync(ack) => self.pending_syncs.push(ack),
                    Input::Committed(l) => low = low.max(l),
                }
            }
            // Hand everything to the OS at once: a killed process then loses nothing written.
            if let Some(seg) = self.current.as_mut() {
                let flushed = seg.file.flush();
                ok &= self.report(flushed, "cannot write");
            }
            let due = match self.config.fsync {
                FsyncMode::Always => true,
                FsyncMode::Interval => self.last_fsync.elapsed() >= interval,
                FsyncMode::Off => false,
            };
            if self.dirty && due {
                ok &= self.fsync();
            }
            // `off` answers after write(): safe from a process crash, not from power loss.
            if !self.dirty || self.config.fsync == FsyncMode::Off || !ok {
                for ack in self.pending_syncs.drain(..) {
                    let _ = ack.send(ok);
                }
            }
            self.delete_covered(low);
        }
        if self.dirty {
            self.fsync();
        }
        for ack in self.pending_syncs.drain(..) {
            let _ = ack.send(true);
        }
    }

    fn write(&mut self, seq: u64, lines: &[u8]) -> bool {
        let result = self.segment_for(seq).and_then(|seg| {
            let mut header = [0u8; RECORD_HEADER];
            header[0..4].copy_from_slice(&(lines.len() as u32).to_le_bytes());
            header[4..8].copy_from_slice(&crc32fast::hash(lines).to_le_bytes());
            header[8..16].copy_from_slice(&seq.to_le_bytes());
            seg.file.write_all(&header)?;
            seg.file.write_all(lines)?;
            seg.bytes += (RECORD_HEADER + lines.len()) as u64;
            seg.last_seq = seq;
            Ok(())
        });
        self.dirty = true;
        self.report(result, "cannot write")
    }

    /// The open segment, rotating to a new one when it is full.
    fn segment_for(&mut self, seq: u64) -> io::Result<&mut Segment> {
        let full = self
            .current
            .as_ref()
            .is_some_and(|s| s.bytes >= self.config.segment_bytes);
        if full {
            let mut old = self.current.take().expect("checked above");
            old.file.flush()?;
            old.file.get_ref().sync_data()?;
            self.closed.push_back((old.path, old.last_seq));
        }
        if self.current.is_none() {
            let path = self.dir.join(format!("{seq:020}.journal"));
            let file = OpenOptions::new()
                .create_new(true)
                .append(true)
                .open(&path)?;
            let mut file = BufWriter::with_capacity(256 * 1024, file);
            file.write_all(&self.header)?;
            // The new file's directory entry must survive a power loss too.
            File::open(&self.dir)?.sync_all()?;
            self.current = Some(Segment {
                path,
                file,
                bytes: self.header.len() as u64,
                last_seq: seq,
            });
        }
        Ok(self.current.as_mut().expect("opened above"))
    }

    fn fsync(&mut self) -> bool {
        let result = match self.current.as_mut() {
            Some(seg) => seg
                .file
                .flush()
                .and_then(|_| seg.file.get_ref().sync_data()),
            None => Ok(()),
        };
        self.dirty = false;
        self.last_fsync = Instant::now();
        let ok = self.report(result, "cannot fsync");
        for ack in self.pending_syncs.drain(..) {
            let _ = ack.send(ok);
        }
        ok
    }

    /// Deletes closed segments whose every record is below `low` (all committed). The open
    /// segment is closed and deleted too once it is fully covered and idle, so an idle daemon
    /// keeps no journal.
    fn delete_covered(&mut self, low: u64) {
        while let Some((path, last)) = self.closed.front() {
            if *last >= low {
                break;
            }
            if let Err(e) = std::fs::remove_file(path) {
                warn!(path = %path.display(), cause = %e, "cannot delete covered journal segment");
            }
            self.closed.pop_front();
        }
        let covered = self.current.as_ref().is_some_and(|s| s.last_seq < low);
        if covered && self.closed.is_empty() {
            let seg = self.current.take().expect("checked above");
            drop(seg.file);
            let _ = std::fs::remove_file(&seg.path);
        }
    }

    fn report(&mut self, result: io::Result<()>, what: &str) -> bool {
        match result {
            Ok(()) => !self.failed,
            Err(e) => {
                crate::metrics::journal_error();
                self.failed = true;
                // The segment may end in a torn record now; later records go to a new one so
                // that replay can read them.
                if let Some(seg) = self.current.take() {
                    self.closed.push_back((seg.path, seg.last_seq));
                }
                if let Some(suppressed) = JOURNAL_ERROR_LOG.allow() {
                    error!(dir = %self.dir.display(), cause = %e, suppressed, "journal {what}; accepted events are not durable until it works again");
                }
                false
            }
        }
    }
}

/// A segment found at start, before replay.
#[derive(Debug)]
pub struct OldSegment {
    pub path: PathBuf,
    /// How its records' keys were routed to writers.
    pub layout: Layout,
    pub records: Vec<(u64, Vec<u8>)>,
}

fn encode_header(layout: &Layout) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_LEN + 2 * layout.map.len());
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&(layout.buckets as u32).to_le_bytes());
    h.extend_from_slice(&(layout.workers as u32).to_le_bytes());
    h.extend_from_slice(&(layout.map.len() as u32).to_le_bytes());
    for &d in &layout.map {
        h.extend_from_slice(&d.to_le_bytes());
    }
    h
}

/// The layout and the header's length, if `bytes` starts with a valid header.
fn decode_header(bytes: &[u8]) -> Option<(Layout, usize)> {
    let u32_at = |at: usize| -> Option<usize> {
        Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?) as usize)
    };
    if bytes.get(..8)? != MAGIC {
        return None;
    }
    let (buckets, workers, shards) = (u32_at(8)?, u32_at(12)?, u32_at(16)?);
    let end = HEADER_LEN + 2 * shards;
    let map = bytes
        .get(HEADER_LEN..end)?
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect::<Vec<_>>();
    if buckets == 0 || workers == 0 || map.is_empty() {
        return None;
    }
    Some((
        Layout {
            buckets,
            workers,
            map,
        },
        end,
    ))
}

/// Reads every segment in `dir`, oldest first. A torn or corrupt record ends its segment (it
/// was never acknowledged by `!sync`): the rest of that segment is ignored, with a warning.
pub fn read_segments(dir: &Path) -> Result<Vec<OldSegment>, JournalError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(dir, "cannot list")(e)),
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "journal"))
        .collect();
    paths.sort();
    let mut out = Vec::new();
    for path in paths {
        let mut bytes = Vec::new();
        File::open(&path)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(io_err(&path, "cannot read"))?;
        let Some((layout, mut at)) = decode_header(&bytes) else {
            warn!(path = %path.display(), "not a tallyd journal segment (or empty); ignoring it");
            out.push(OldSegment {
                path,
                layout: Layout::single(1, 1),
                records: Vec::new(),
            });
            continue;
        };
        let mut records = Vec::new();
        while at + RECORD_HEADER <= bytes.len() {
            let len = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4")) as usize;
            let crc = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().expect("4"));
            let seq = u64::from_le_bytes(bytes[at + 8..at + 16].try_into().expect("8"));
            let body = at + RECORD_HEADER;
            if body + len > bytes.len() || crc32fast::hash(&bytes[body..body + len]) != crc {
                warn!(path = %path.display(), offset = at, "torn record at the end of a journal segment; ignoring the rest");
                break;
            }
            records.push((seq, bytes[body..body + len].to_vec()));
            at = body + len;
        }
        out.push(OldSegment {
            path,
            layout,
            records,
        });
    }
    if !out.is_empty() {
        info!(segments = out.len(), "journal segments found");
    }
    Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn config(fsync: FsyncMode) -> JournalConfig {
        JournalConfig {
            enabled: true,
            fsync,
            fsync_interval_ms: 10,
            segment_bytes: 200,
        }
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
            let _gate = j.record_gate().await;
            let seq = j.next_seq();
            let mut lines = Vec::new();
            push_line(&mut lines, "c", &format!("k{i}"), i, 1000 + i);
            j.append(seq, lines).await;
        }
        assert!(j.sync().await);
        let segs = read_segments(dir.path()).unwrap();
        assert!(segs.len() > 1, "small segment_bytes rotates");
        let records: Vec<_> = segs.iter().flat_map(|s| s.records.clone()).collect();
        assert_eq!(records.len(), 20);
        assert_eq!(records[3], (4, b"c k3 3 @1003\n".to_vec()));
        assert_eq!(segs[0].layout, layout);

        let (gate, point) = j.drain_gate().await;
        drop(gate);
        assert_eq!(point, 21);
        // Writers covering everything one by one is not enough: another may still hold events.
        for w in 0..3 {
            j.committed(w, point);
        }
        assert!(j.sync().await);
        assert_eq!(read_segments(dir.path()).unwrap().len(), segs.len());
        j.committed(3, point);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !read_segments(dir.path()).unwrap().is_empty() {
            assert!(
                Instant::now() < deadline,
                "covered segments were not deleted"
            );
            j.committed(3, point);
            assert!(j.sync().await);
        }
    }

    #[test]
    fn a_torn_tail_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("00000000000000000001.journal");
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&encode_header(&Layout::single(1, 1)));
        for (seq, body) in [(1u64, &b"c a 1 @5\n"[..]), (2, b"c b 1 @5\n")] {
            bytes.extend_from_slice(&(body.len() as u32).to_le_bytes());
            bytes.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
            bytes.extend_from_slice(&seq.to_le_bytes());
            bytes.extend_from_slice(body);
        }
        bytes.truncate(bytes.len() - 3);
        std::fs::write(&path, &bytes).unwrap();
        let segs = read_segments(dir.path()).unwrap();
        assert_eq!(segs[0].records, vec![(1, b"c a 1 @5\n".to_vec())]);
    }
}
