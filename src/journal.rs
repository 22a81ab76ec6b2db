//! The journal: accepted events, appended to segment files in `data_dir/journal` by one writer
//! thread with group commit, so that a crash (kill -9, power loss) loses nothing acknowledged
//! with `!sync`, and replay after a restart applies each event exactly once.
//!
//! Every read buffer's accepted events form one record with a sequence number. Connections
//! register a record's batches per flush worker before sending them ([`Journal::register`]); a
//! flush records, in its own transaction, the highest sequence number up to which all of its
//! worker's events are committed (`journal_covered` in `tallyd.flushes`). Replay skips, for each
//! worker, the events that number covers. A segment is deleted once every event in it has been
//! committed, whichever worker it went to.
//!
//! Record layout: `len: u32 | crc32: u32 | seq: u64 | len bytes of lines`, little endian; the
//! lines are canonical protocol lines `counter key delta @unix_ms\n`. A segment starts with a
//! header that records how keys were spread over workers when it was written.

use std::collections::{BTreeMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, select, Receiver, Sender};
use tokio::sync::oneshot;
use tracing::{error, info, warn};

use crate::config::{FsyncMode, JournalConfig};
use crate::throttle::Throttle;

const MAGIC: &[u8; 8] = b"TALLYJ1\n";
const HEADER_LEN: usize = 16;
const RECORD_HEADER: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("journal {path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: &'static str,
        source: io::Error,
    },
}

fn io_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(io::Error) -> JournalError + 'a {
    move |source| JournalError::Io {
        path: path.to_path_buf(),
        what,
        source,
    }
}

/// What a connection hands the writer thread.
enum Input {
    Record { seq: u64, lines: Vec<u8> },
    /// Answered once everything sent before it is durable (per `fsync`).
    Sync(oneshot::Sender<bool>),
    /// Every event in records with a lower sequence number is committed.
    Committed(u64),
}

/// Which records still have events on their way to PostgreSQL, per flush worker.
struct Tracker {
    next_seq: u64,
    /// worker -> seq -> batches of that record not yet committed by that worker.
    outstanding: Vec<BTreeMap<u64, u32>>,
}

impl Tracker {
    fn low(&self) -> u64 {
        self.outstanding
            .iter()
            .filter_map(|m| m.keys().next().copied())
            .min()
            .unwrap_or(self.next_seq)
    }
}

/// The handle connections and flush workers use; the writer thread runs behind it.
pub struct Journal {
    tx: Sender<Input>,
    tracker: Mutex<Tracker>,
}

/// Sequence numbers of the records a drain carried, one entry per batch.
pub type Seqs = Vec<u64>;

impl Journal {
    /// Opens the journal for writing new records, starting after `first_seq - 1`. Any old
    /// segments must have been replayed (see [`recover`]) before.
    pub fn open(
        config: &JournalConfig,
        dir: &Path,
        first_seq: u64,
        buckets: usize,
        workers: usize,
    ) -> Result<Journal, JournalError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir, "cannot create directory"))?;
        let (tx, rx) = bounded(1024);
        let writer = Writer {
            dir: dir.to_path_buf(),
            config: config.clone(),
            buckets: buckets as u32,
            workers: workers as u32,
            current: None,
            closed: VecDeque::new(),
            pending_syncs: Vec::new(),
            dirty: false,
            last_fsync: Instant::now(),
        };
        std::thread::Builder::new()
            .name("tallyd-journal".into())
            .spawn(move || writer.run(rx))
            .map_err(io_err(dir, "cannot start the writer thread"))?;
        Ok(Journal {
            tx,
            tracker: Mutex::new(Tracker {
                next_seq: first_seq.max(1),
                outstanding: vec![BTreeMap::new(); workers],
            }),
        })
    }

    /// Gives a read buffer's record its sequence number and notes how many of its batches go
    /// to each worker. Must happen before the batches are sent.
    pub fn register(&self, batches_per_worker: &[u32]) -> u64 {
        let mut t = self.tracker.lock().expect("journal tracker");
        let seq = t.next_seq;
        t.next_seq += 1;
        for (w, &n) in batches_per_worker.iter().enumerate() {
            if n > 0 {
                t.outstanding[w].insert(seq, n);
            }
        }
        seq
    }

    /// Registers a record replayed from an old segment under its old sequence number, so that
    /// no flush claims it covered before its events are committed. It is not written again.
    pub fn register_replayed(&self, seq: u64, batches_per_worker: &[u32]) {
        let mut t = self.tracker.lock().expect("journal tracker");
        debug_assert!(seq < t.next_seq, "replayed records precede new ones");
        for (w, &n) in batches_per_worker.iter().enumerate() {
            if n > 0 {
                *t.outstanding[w].entry(seq).or_default() += n;
            }
        }
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

    /// The highest sequence number up to which every event of `worker` is committed, assuming
    /// the flight carrying `seqs` commits. Written into the ledger with that flight.
    pub fn covered_after(&self, worker: usize, seqs: &[u64]) -> u64 {
        let t = self.tracker.lock().expect("journal tracker");
        let mut in_flight: BTreeMap<u64, u32> = BTreeMap::new();
        for &s in seqs {
            *in_flight.entry(s).or_default() += 1;
        }
        for (&seq, &n) in &t.outstanding[worker] {
            if in_flight.get(&seq).copied().unwrap_or(0) < n {
                return seq - 1;
            }
        }
        t.next_seq - 1
    }

    /// Marks the flight carrying `seqs` committed; lets the writer delete covered segments.
    pub fn committed(&self, worker: usize, seqs: &[u64]) {
        let low = {
            let mut t = self.tracker.lock().expect("journal tracker");
            for &s in seqs {
                if let std::collections::btree_map::Entry::Occupied(mut e) =
                    t.outstanding[worker].entry(s)
                {
                    *e.get_mut() -= 1;
                    if *e.get() == 0 {
                        e.remove();
                    }
                }
            }
            t.low()
        };
        let _ = self.tx.try_send(Input::Committed(low));
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
    buckets: u32,
    workers: u32,
    current: Option<Segment>,
    /// Closed segments and the last sequence number each holds, oldest first.
    closed: VecDeque<(PathBuf, u64)>,
    pending_syncs: Vec<oneshot::Sender<bool>>,
    /// Written since the last fsync.
    dirty: bool,
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
            let file = OpenOptions::new().create_new(true).append(true).open(&path)?;
            let mut file = BufWriter::with_capacity(256 * 1024, file);
            let mut header = [0u8; HEADER_LEN];
            header[..8].copy_from_slice(MAGIC);
            header[8..12].copy_from_slice(&self.buckets.to_le_bytes());
            header[12..16].copy_from_slice(&self.workers.to_le_bytes());
            file.write_all(&header)?;
            // The new file's directory entry must survive a power loss too.
            File::open(&self.dir)?.sync_all()?;
            self.current = Some(Segment {
                path,
                file,
                bytes: HEADER_LEN as u64,
                last_seq: seq,
            });
        }
        Ok(self.current.as_mut().expect("opened above"))
    }

    fn fsync(&mut self) -> bool {
        let result = match self.current.as_mut() {
            Some(seg) => seg.file.flush().and_then(|_| seg.file.get_ref().sync_data()),
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

    fn report(&self, result: io::Result<()>, what: &str) -> bool {
        match result {
            Ok(()) => true,
            Err(e) => {
                crate::metrics::journal_error();
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
    pub buckets: u32,
    pub workers: u32,
    pub records: Vec<(u64, Vec<u8>)>,
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
        if bytes.len() < HEADER_LEN || &bytes[..8] != MAGIC {
            warn!(path = %path.display(), "not a tallyd journal segment (or empty); ignoring it");
            out.push(OldSegment { path, buckets: 1, workers: 1, records: Vec::new() });
            continue;
        }
        let buckets = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        let workers = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes"));
        let mut records = Vec::new();
        let mut at = HEADER_LEN;
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
        out.push(OldSegment { path, buckets, workers, records });
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
        let j = Journal::open(&config(FsyncMode::Always), dir.path(), 1, 4, 2).unwrap();
        let mut seqs = Vec::new();
        for i in 0..20 {
            let seq = j.register(&[1, 0]);
            let mut lines = Vec::new();
            push_line(&mut lines, "c", &format!("k{i}"), i, 1000 + i);
            j.append(seq, lines).await;
            seqs.push(seq);
        }
        assert!(j.sync().await);
        let segs = read_segments(dir.path()).unwrap();
        assert!(segs.len() > 1, "small segment_bytes rotates");
        let records: Vec<_> = segs.iter().flat_map(|s| s.records.clone()).collect();
        assert_eq!(records.len(), 20);
        assert_eq!(records[3], (4, b"c k3 3 @1003\n".to_vec()));
        assert_eq!((segs[0].buckets, segs[0].workers), (4, 2));

        // Worker 1 had nothing; worker 0 commits the first 10 records.
        assert_eq!(j.covered_after(1, &[]), 20);
        assert_eq!(j.covered_after(0, &seqs[..10]), 10);
        j.committed(0, &seqs[..10]);
        assert_eq!(j.covered_after(0, &[]), 10);
        j.committed(0, &seqs[10..]);
        assert!(j.sync().await);
        // Everything is covered: every segment is gone.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !read_segments(dir.path()).unwrap().is_empty() {
            assert!(Instant::now() < deadline, "covered segments were not deleted");
            j.committed(0, &[]);
            assert!(j.sync().await);
        }
    }

    #[test]
    fn a_torn_tail_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("00000000000000000001.journal");
        let mut bytes = Vec::new();
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.extend_from_slice(&1u32.to_le_bytes());
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
