//! Reading the journal at start: decodes segments (this format and the previous one), keeps every
//! intact record of a damaged segment, checks sequence numbers across segments (duplicates
//! skipped, gaps reported), counts what could not be read, and after replay retires segments:
//! clean ones are deleted, damaged ones moved to `journal/damaged/` as evidence.
//!
//! A start holds at most one segment's bytes at a time: a segment is read whole, decoded, and
//! only where each intact record's lines are is kept ([`Lines::At`]); the replay reads each
//! record back when it routes it ([`Reader`]), so the memory a start needs does not grow with the
//! journal (only the index does: 24 bytes a record).

use std::collections::HashSet;
use std::fs::{DirBuilder, File};
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, FileExt};
use std::path::{Path, PathBuf};

use tracing::{error, info, warn};

use super::format::{HEADER_LEN, MAGIC, MAGIC_TRANSLATED, MAGIC_V2, RECORD_HEADER, RECORD_MARK};
use super::{io_err, JournalError};
use crate::routing::Layout;

/// Where damaged segments go after replay, inside the journal directory.
pub const DAMAGED_DIR: &str = "damaged";
const RECORD_HEADER_V2: usize = 16;

/// A segment found at start, before replay.
#[derive(Debug)]
pub struct OldSegment {
    pub path: PathBuf,
    /// How its records' keys were routed to writers (a neighbour's, or the current one, when its
    /// own header is damaged).
    pub layout: Layout,
    /// Its intact records by number, without those already read from an earlier segment.
    pub records: Vec<(u64, Lines)>,
    /// Some bytes could not be read (beyond a torn tail): moved aside after replay.
    pub damaged: bool,
    /// A translated segment (see `translate`) replaces every record of the other segments
    /// numbered up to this one: those below its first record (0: a segment the writer wrote,
    /// which replaces nothing).
    pub supersedes: u64,
}

/// Where a record's lines are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lines {
    /// In the segment's file, from this byte: read back when the replay reaches the record.
    At { offset: u64, len: u32 },
    /// In memory (a segment just written by `translate`, or built by a test).
    Held(Vec<u8>),
}

/// Reads records' lines back from their segments, one record at a time, keeping the last
/// segment it read open.
pub struct Reader<'a> {
    segments: &'a [OldSegment],
    open: Option<(usize, File)>,
}

impl<'a> Reader<'a> {
    pub fn new(segments: &'a [OldSegment]) -> Reader<'a> {
        Reader {
            segments,
            open: None,
        }
    }

    /// The lines of record `record` of segment `segment` (indexes into `records`).
    pub fn lines(&mut self, segment: usize, record: usize) -> Result<Vec<u8>, JournalError> {
        self.head(segment, record, usize::MAX)
    }

    /// The first `max` bytes (at most) of the lines of record `record` of segment `segment`.
    pub fn head(
        &mut self,
        segment: usize,
        record: usize,
        max: usize,
    ) -> Result<Vec<u8>, JournalError> {
        let seg = &self.segments[segment];
        let (offset, len) = match &seg.records[record].1 {
            Lines::Held(lines) => return Ok(lines[..lines.len().min(max)].to_vec()),
            Lines::At { offset, len } => (*offset, (*len as usize).min(max)),
        };
        if self.open.as_ref().is_none_or(|(i, _)| *i != segment) {
            let file = File::open(&seg.path).map_err(io_err(&seg.path, "cannot open"))?;
            self.open = Some((segment, file));
        }
        let (_, file) = self.open.as_ref().expect("opened above");
        let mut buf = vec![0; len];
        file.read_exact_at(&mut buf, offset)
            .map_err(io_err(&seg.path, "cannot read back a record of"))?;
        Ok(buf)
    }
}

/// Every record of `segments` with its lines, read back as the replay reads them (for tests).
#[cfg(test)]
pub(super) fn loaded(segments: &[OldSegment]) -> Vec<(u64, Vec<u8>)> {
    let mut reader = Reader::new(segments);
    let mut out = Vec::new();
    for (i, seg) in segments.iter().enumerate() {
        for (j, (seq, _)) in seg.records.iter().enumerate() {
            out.push((*seq, reader.lines(i, j).unwrap()));
        }
    }
    out
}

/// What reading the journal found besides intact records.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Damage {
    /// Damaged stretches (at least one per stretch; more when it holds several record marks).
    pub unreadable_records: u64,
    pub unreadable_bytes: u64,
    /// Records cut short at the end of a segment (a write the crash or a failure interrupted).
    pub torn_bytes: u64,
    /// Second copies of a sequence number, skipped.
    pub duplicates: u64,
    /// Sequence numbers missing between the lowest and the highest found.
    pub missing: u64,
    /// Entries of the journal directory that are not readable segments (directories, files that
    /// cannot be opened or read, other names), left where they are.
    pub skipped: Vec<PathBuf>,
}

/// Everything read from the journal directory at start.
#[derive(Debug, Default)]
pub struct OldJournal {
    pub segments: Vec<OldSegment>,
    pub damage: Damage,
}

/// One segment's bytes, decoded.
#[derive(Debug, Default)]
struct Decoded {
    layout: Option<Layout>,
    /// Written by `translate` (known by its magic alone, even if the rest of the header is
    /// damaged).
    translated: bool,
    /// Each intact record's number, and where its lines are in the bytes decoded.
    records: Vec<(u64, usize, usize)>,
    unreadable_records: u64,
    unreadable_bytes: u64,
    torn_bytes: u64,
}

impl Decoded {
    fn damaged(&self) -> bool {
        self.unreadable_bytes > 0
    }
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

/// The layout and the header's length, if `bytes` starts with a valid header of any format.
pub(super) fn decode_header(bytes: &[u8]) -> Option<(Layout, usize)> {
    let v3 = match bytes.get(..8)? {
        m if m == MAGIC || m == MAGIC_TRANSLATED => true,
        m if m == MAGIC_V2 => false,
        _ => return None,
    };
    let (buckets, workers, shards) = (
        u32_at(bytes, 8)? as usize,
        u32_at(bytes, 12)? as usize,
        u32_at(bytes, 16)? as usize,
    );
    let mut end = HEADER_LEN.checked_add(shards.checked_mul(2)?)?;
    let map = bytes
        .get(HEADER_LEN..end)?
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect::<Vec<_>>();
    if v3 {
        if crc32fast::hash(&bytes[..end]) != u32_at(bytes, end)? {
            return None;
        }
        end += 4;
    }
    if buckets == 0 || workers == 0 || map.is_empty() {
        return None;
    }
    let layout = Layout {
        buckets,
        workers,
        map,
    };
    Some((layout, end))
}

/// The record at `at` if it is whole and its CRC matches: (seq, lines, end).
pub(super) fn record_at(bytes: &[u8], at: usize) -> Option<(u64, &[u8], usize)> {
    if bytes.get(at..at + 4)? != RECORD_MARK {
        return None;
    }
    let len = u32_at(bytes, at + 4)? as usize;
    let seq = u64_at(bytes, at + 8)?;
    let crc = u32_at(bytes, at + 16)?;
    let body = at + RECORD_HEADER;
    let lines = bytes.get(body..body.checked_add(len)?)?;
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&bytes[at + 4..at + 16]);
    hasher.update(lines);
    (hasher.finalize() == crc).then_some((seq, lines, body + len))
}

/// Whether `bytes[at..]` is the beginning of a record that the end of the file cut short.
fn torn_at(bytes: &[u8], at: usize) -> bool {
    let rest = &bytes[at..];
    if rest.len() < RECORD_HEADER {
        return RECORD_MARK.starts_with(&rest[..rest.len().min(4)]);
    }
    let len = u32_at(rest, 4).unwrap_or(0) as usize;
    rest[..4] == RECORD_MARK && RECORD_HEADER + len > rest.len()
}

pub(super) fn find_mark(bytes: &[u8], from: usize) -> Option<usize> {
    bytes
        .get(from..)?
        .windows(RECORD_MARK.len())
        .position(|w| w == RECORD_MARK)
        .map(|p| from + p)
}

/// Decodes a segment of the current format, resynchronising at the next record mark after
/// anything that is not an intact record.
fn decode(bytes: &[u8]) -> Decoded {
    if bytes.starts_with(MAGIC_V2) {
        return decode_v2(bytes);
    }
    let mut out = Decoded {
        translated: bytes.starts_with(MAGIC_TRANSLATED),
        ..Decoded::default()
    };
    let mut at = match decode_header(bytes) {
        Some((layout, end)) => {
            out.layout = Some(layout);
            end
        }
        None => {
            // The records are still framed: start at the first mark.
            let first = find_mark(bytes, 0).unwrap_or(bytes.len());
            out.unreadable_bytes += first as u64;
            first
        }
    };
    while at < bytes.len() {
        if let Some((seq, lines, end)) = record_at(bytes, at) {
            out.records.push((seq, end - lines.len(), lines.len()));
            at = end;
            continue;
        }
        let next = find_mark(bytes, at + 1);
        if next.is_none() && torn_at(bytes, at) {
            out.torn_bytes += (bytes.len() - at) as u64;
            break;
        }
        let end = next.unwrap_or(bytes.len());
        let marks = (at..end)
            .filter(|&i| bytes[i..].starts_with(&RECORD_MARK))
            .count();
        out.unreadable_records += marks.max(1) as u64;
        out.unreadable_bytes += (end - at) as u64;
        at = end;
    }
    out
}

/// The previous format (`len | crc | seq | lines`) has no marks: a bad record ends the segment.
fn decode_v2(bytes: &[u8]) -> Decoded {
    let mut out = Decoded::default();
    let Some((layout, mut at)) = decode_header(bytes) else {
        out.unreadable_bytes = bytes.len() as u64;
        return out;
    };
    out.layout = Some(layout);
    while at < bytes.len() {
        let header = (
            u32_at(bytes, at),
            u32_at(bytes, at + 4),
            u64_at(bytes, at + 8),
        );
        let (Some(len), Some(crc), Some(seq)) = header else {
            out.torn_bytes += (bytes.len() - at) as u64;
            break;
        };
        let body = at + RECORD_HEADER_V2;
        match bytes.get(body..body + len as usize) {
            None => {
                out.torn_bytes += (bytes.len() - at) as u64;
                break;
            }
            Some(lines) if crc32fast::hash(lines) == crc => {
                out.records.push((seq, body, lines.len()));
                at = body + len as usize;
            }
            Some(_) => {
                out.unreadable_records += 1;
                out.unreadable_bytes += (bytes.len() - at) as u64;
                break;
            }
        }
    }
    out
}

/// Lists the journal directory: segment paths, oldest first, and what is not a segment.
fn list(dir: &Path, skipped: &mut Vec<PathBuf>) -> Result<Vec<PathBuf>, JournalError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(dir, "cannot list")(e)),
    };
    let mut paths = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err(dir, "cannot list"))?;
        let path = entry.path();
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if is_dir && entry.file_name() == DAMAGED_DIR {
            continue;
        }
        if is_dir || path.extension().is_none_or(|x| x != "journal") {
            warn!(path = %path.display(), "not a journal segment (a directory, or another name) in the journal directory; ignoring it");
            skipped.push(path);
            continue;
        }
        paths.push(path);
    }
    paths.sort();
    Ok(paths)
}

/// Reads every segment in `dir`, oldest first, keeping every intact record. `current` is the
/// layout used for a segment whose header is damaged when no neighbour's can be used. What
/// could not be read is logged (once per segment) and counted in the metrics.
pub fn read_segments(dir: &Path, current: &Layout) -> Result<OldJournal, JournalError> {
    let mut damage = Damage::default();
    let mut decoded = Vec::new();
    for path in list(dir, &mut damage.skipped)? {
        let mut bytes = Vec::new();
        if let Err(e) = File::open(&path).and_then(|mut f| f.read_to_end(&mut bytes)) {
            error!(path = %path.display(), cause = %e, "cannot read a journal segment; leaving it in place, its events are not replayed");
            damage.skipped.push(path);
            continue;
        }
        let d = decode(&bytes);
        // Only the records' places are kept: the replay reads them back one at a time.
        drop(bytes);
        if d.damaged() {
            error!(path = %path.display(), unreadable_records = d.unreadable_records, unreadable_bytes = d.unreadable_bytes, header_ok = d.layout.is_some(), records_kept = d.records.len(), "damaged journal segment: its intact records are replayed, the rest is lost; it will be moved to journal/damaged/");
        } else if d.torn_bytes > 0 {
            warn!(path = %path.display(), bytes = d.torn_bytes, "a record cut short at the end of a journal segment (never acknowledged); ignoring it");
        }
        damage.unreadable_records += d.unreadable_records;
        damage.unreadable_bytes += d.unreadable_bytes;
        damage.torn_bytes += d.torn_bytes;
        decoded.push((path, d));
    }
    let layouts = fill_layouts(&decoded, current);
    let (superseded, supersedes) = supersede(&mut decoded);
    if superseded > 0 {
        info!(
            records = superseded,
            "journal records superseded by their rewrite under a newer layout; replaying the rewrite"
        );
    }
    let mut seen = HashSet::new();
    let mut segments = Vec::new();
    for (((path, d), layout), supersedes) in decoded.into_iter().zip(layouts).zip(supersedes) {
        let damaged = d.damaged();
        let before = d.records.len();
        let records: Vec<(u64, Lines)> = (d.records.into_iter())
            .filter(|(seq, _, _)| seen.insert(*seq))
            .map(|(seq, at, len)| {
                let (offset, len) = (at as u64, len as u32);
                (seq, Lines::At { offset, len })
            })
            .collect();
        damage.duplicates += (before - records.len()) as u64;
        segments.push(OldSegment {
            path,
            layout,
            records,
            damaged,
            supersedes,
        });
    }
    damage.missing = report_gaps(&seen);
    if damage.missing > 0 && !segments.iter().any(|s| s.damaged) {
        note_missing(dir, damage.missing);
    }
    report(&segments, &damage);
    Ok(OldJournal { segments, damage })
}

/// Drops the records that a translated segment supersedes in the other segments: those
/// numbered below its first record (every record there was when it was written; later ones are
/// numbered above it). Returns how many, and what each segment supersedes. The segments stay,
/// to be retired after the replay.
fn supersede(decoded: &mut [(PathBuf, Decoded)]) -> (u64, Vec<u64>) {
    let supersedes: Vec<u64> = (decoded.iter())
        .map(|(_, d)| match d.records.iter().map(|r| r.0).min() {
            Some(first) if d.translated => first - 1,
            _ => 0,
        })
        .collect();
    let mut dropped = 0;
    for (i, (_, d)) in decoded.iter_mut().enumerate() {
        let upto = (supersedes.iter().enumerate())
            .filter(|&(j, _)| j != i)
            .map(|(_, &s)| s)
            .max()
            .unwrap_or(0);
        let before = d.records.len();
        d.records.retain(|(seq, _, _)| *seq > upto);
        dropped += (before - d.records.len()) as u64;
    }
    (dropped, supersedes)
}

/// A damaged header loses the segment's layout: take the nearest earlier segment's (written by
/// the same run, most likely), else the nearest later one's, else the current config's.
fn fill_layouts(decoded: &[(PathBuf, Decoded)], current: &Layout) -> Vec<Layout> {
    (0..decoded.len())
        .map(|i| {
            let own = decoded[i].1.layout.as_ref();
            let earlier = || decoded[..i].iter().rev().find_map(|d| d.1.layout.as_ref());
            let later = || decoded[i + 1..].iter().find_map(|d| d.1.layout.as_ref());
            let layout = own.or_else(earlier).or_else(later).unwrap_or(current);
            if own.is_none() && !decoded[i].1.records.is_empty() {
                warn!(path = %decoded[i].0.display(), buckets = layout.buckets, workers = layout.workers, "journal segment header damaged; replaying its records with a neighbouring segment's layout (or the current one)");
            }
            layout.clone()
        })
        .collect()
}

/// Records missing with no damaged segment to show for them (a segment lost from the middle):
/// a note beside the damaged segments, so that the loss stays reported
/// (`tallyd_journal_damaged_files`) until an operator has read and removed it.
fn note_missing(dir: &Path, missing: u64) {
    let aside = dir.join(DAMAGED_DIR);
    let path = aside.join(format!("missing-records.{}.txt", crate::clock::now_ms()));
    let text = format!(
        "{missing} journal records were missing between the segments found at start; their \
         events were not replayed (the tallyd log names them: \"journal records missing\").\n"
    );
    let written = DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&aside)
        .and_then(|()| std::fs::write(&path, text));
    if let Err(cause) = written {
        warn!(path = %path.display(), %cause, "cannot leave a note of the missing journal records");
    }
}

/// Logs the sequence numbers missing between the lowest and highest found; returns how many.
fn report_gaps(seen: &HashSet<u64>) -> u64 {
    let mut seqs: Vec<u64> = seen.iter().copied().collect();
    seqs.sort_unstable();
    let gaps: Vec<(u64, u64)> = seqs
        .windows(2)
        .filter(|w| w[1] > w[0] + 1)
        .map(|w| (w[0] + 1, w[1] - 1))
        .collect();
    let missing: u64 = gaps.iter().map(|(a, b)| b - a + 1).sum();
    if missing > 0 {
        let shown: Vec<String> = gaps
            .iter()
            .take(10)
            .map(|(a, b)| format!("{a}..={b}"))
            .collect();
        error!(missing, ranges = gaps.len(), first_ranges = %shown.join(", "), "journal records missing between the segments found (a lost segment, or damaged records): their events cannot be replayed");
    }
    missing
}

fn report(segments: &[OldSegment], damage: &Damage) {
    crate::events::JournalDamaged {
        unreadable_records: damage.unreadable_records,
        unreadable_bytes: damage.unreadable_bytes,
        missing: damage.missing,
    }
    .emit();
    if damage.duplicates > 0 {
        info!(
            duplicates = damage.duplicates,
            "journal records present twice (written again after a failed write); replaying each once"
        );
    }
    if !segments.is_empty() {
        info!(
            segments = segments.len(),
            damaged = segments.iter().filter(|s| s.damaged).count(),
            unreadable_records = damage.unreadable_records,
            unreadable_bytes = damage.unreadable_bytes,
            "journal segments found"
        );
    }
}

/// The segments in `dir`, oldest first (by the number of the first record each was opened
/// with), for the folder, which reads spilled records back while the writer appends. A segment
/// may hold records numbered above the next one's first: records reach the writer in the order
/// their connections hand them over, not always in the order of their numbers, so one numbered
/// just before a rollover can land in the next segment. Which segments can be skipped is the
/// caller's to know (what it has read of each).
pub fn segments(dir: &Path) -> Result<Vec<PathBuf>, JournalError> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io_err(dir, "cannot list"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "journal"))
        .collect();
    paths.sort();
    Ok(paths)
}

/// The intact records of the segment at `path` numbered `from` or later, by number (the first
/// copy of a number written twice). A segment deleted meanwhile has none.
pub fn records_from(path: &Path, from: u64) -> Result<Vec<(u64, Vec<u8>)>, JournalError> {
    let mut bytes = Vec::new();
    match File::open(path).and_then(|mut f| f.read_to_end(&mut bytes)) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(path, "cannot read")(e)),
    }
    let mut records: Vec<(u64, Vec<u8>)> = (decode(&bytes).records.into_iter())
        .filter(|(seq, _, _)| *seq >= from)
        .map(|(seq, at, len)| (seq, bytes[at..at + len].to_vec()))
        .collect();
    records.sort_by_key(|(seq, _)| *seq);
    records.dedup_by_key(|(seq, _)| *seq);
    Ok(records)
}

/// After a replay has committed: deletes clean segments and moves damaged ones to
/// `dir/damaged/` (with a numeric suffix if the name is taken), so that what could not be read
/// stays for inspection and is never read again.
pub fn retire(dir: &Path, segments: Vec<OldSegment>) {
    for seg in segments {
        if !seg.damaged {
            if let Err(err) = std::fs::remove_file(&seg.path) {
                warn!(path = %seg.path.display(), cause = %err, "cannot delete a replayed journal segment");
            }
            continue;
        }
        match move_aside(dir, &seg.path) {
            Ok(to) => {
                warn!(from = %seg.path.display(), to = %to.display(), "damaged journal segment moved aside")
            }
            Err(err) => {
                error!(path = %seg.path.display(), cause = %err, "cannot move a damaged journal segment aside; leaving it (it will be read again at the next start)")
            }
        }
    }
}

fn move_aside(dir: &Path, path: &Path) -> io::Result<PathBuf> {
    let aside = dir.join(DAMAGED_DIR);
    // Owner only whatever the umask, like the journal directory it is in.
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&aside)?;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let mut to = aside.join(&*name);
    let mut n = 1;
    while to.symlink_metadata().is_ok() {
        to = aside.join(format!("{name}.{n}"));
        n += 1;
    }
    std::fs::rename(path, &to)?;
    File::open(&aside)?.sync_all()?;
    Ok(to)
}

#[cfg(test)]
mod tests {
    use super::super::format::{encode_header, record_header};
    use super::*;

    fn layout() -> Layout {
        Layout {
            buckets: 4,
            workers: 2,
            map: vec![0, 1],
        }
    }

    fn line(seq: u64) -> Vec<u8> {
        format!("c k{seq} {seq} @5\n").into_bytes()
    }

    /// A segment of the current format holding records `seqs`; returns its bytes and where each
    /// record starts.
    fn segment(seqs: impl IntoIterator<Item = u64>) -> (Vec<u8>, Vec<usize>) {
        let mut bytes = encode_header(&layout());
        let mut starts = Vec::new();
        for seq in seqs {
            starts.push(bytes.len());
            bytes.extend_from_slice(&record_header(seq, &line(seq)));
            bytes.extend_from_slice(&line(seq));
        }
        (bytes, starts)
    }

    fn write(dir: &Path, first: u64, bytes: &[u8]) -> PathBuf {
        let path = dir.join(format!("{first:020}.journal"));
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn seqs(old: &OldJournal) -> Vec<u64> {
        let mut s: Vec<u64> = old
            .segments
            .iter()
            .flat_map(|s| s.records.iter().map(|r| r.0))
            .collect();
        s.sort_unstable();
        s
    }

    fn read(dir: &Path) -> OldJournal {
        read_segments(dir, &Layout::single(1, 1)).unwrap()
    }

    #[test]
    fn a_torn_tail_is_ignored_and_is_not_damage() {
        let dir = tempfile::tempdir().unwrap();
        let (mut bytes, _) = segment(1..=2);
        bytes.truncate(bytes.len() - 3);
        write(dir.path(), 1, &bytes);
        let old = read(dir.path());
        assert_eq!(loaded(&old.segments), vec![(1, line(1))]);
        assert!(!old.segments[0].damaged);
        assert_eq!(
            old.damage.torn_bytes,
            (RECORD_HEADER + line(2).len() - 3) as u64
        );
        assert_eq!(old.damage.unreadable_bytes, 0);
    }

    #[test]
    fn a_flipped_byte_loses_only_its_record() {
        let dir = tempfile::tempdir().unwrap();
        let (mut bytes, starts) = segment(1..=10);
        // A byte of record 4's lines, then one of record 7's length.
        bytes[starts[3] + RECORD_HEADER + 2] ^= 0x20;
        bytes[starts[6] + 5] ^= 0x01;
        write(dir.path(), 1, &bytes);
        let old = read(dir.path());
        assert_eq!(seqs(&old), vec![1, 2, 3, 5, 6, 8, 9, 10]);
        assert!(old.segments[0].damaged);
        assert_eq!(old.damage.unreadable_records, 2);
        assert_eq!(
            old.damage.unreadable_bytes,
            (2 * RECORD_HEADER + line(4).len() + line(7).len()) as u64
        );
        assert_eq!(old.damage.missing, 2);
        assert_eq!(old.segments[0].layout, layout());
    }

    #[test]
    fn a_damaged_header_keeps_the_records_and_borrows_a_layout() {
        let dir = tempfile::tempdir().unwrap();
        let (first, _) = segment(1..=3);
        write(dir.path(), 1, &first);
        let (mut second, _) = segment(4..=6);
        second[10] ^= 0xFF;
        write(dir.path(), 4, &second);
        let old = read(dir.path());
        assert_eq!(seqs(&old), (1..=6).collect::<Vec<_>>());
        assert!(old.segments[1].damaged);
        assert_eq!(old.segments[1].layout, layout(), "the neighbour's layout");
        assert_eq!(
            old.damage.unreadable_bytes,
            encode_header(&layout()).len() as u64
        );
        assert_eq!(old.damage.unreadable_records, 0);
    }

    #[test]
    fn a_record_present_twice_is_read_once() {
        let dir = tempfile::tempdir().unwrap();
        // A failed write left records 3..=5 (the last torn) in the first segment; a retry wrote
        // them again into a second one.
        let (mut first, starts) = segment(1..=5);
        first.truncate(starts[4] + 7);
        write(dir.path(), 1, &first);
        write(dir.path(), 3, &segment(3..=8).0);
        let old = read(dir.path());
        assert_eq!(seqs(&old), (1..=8).collect::<Vec<_>>());
        assert_eq!(old.damage.duplicates, 2);
        assert_eq!(old.damage.missing, 0);
    }

    #[test]
    fn a_missing_segment_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 1, &segment(1..=3).0);
        write(dir.path(), 8, &segment(8..=9).0);
        let old = read(dir.path());
        assert_eq!(old.damage.missing, 4);
        assert_eq!(seqs(&old), vec![1, 2, 3, 8, 9]);
    }

    #[test]
    fn damaged_segments_are_moved_aside_and_clean_ones_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let clean = write(dir.path(), 1, &segment(1..=3).0);
        let (mut bytes, starts) = segment(4..=6);
        bytes[starts[1] + RECORD_HEADER] ^= 0x01;
        let damaged = write(dir.path(), 4, &bytes);
        let old = read(dir.path());
        retire(dir.path(), old.segments);
        assert!(!clean.exists() && !damaged.exists());
        let aside = dir
            .path()
            .join(DAMAGED_DIR)
            .join(damaged.file_name().unwrap());
        assert_eq!(std::fs::read(&aside).unwrap(), bytes, "kept byte for byte");
        // Set aside for good: the next start neither reads nor reports it.
        let again = read(dir.path());
        assert!(again.segments.is_empty());
        assert_eq!(again.damage, Damage::default());
    }

    #[test]
    fn directories_and_unreadable_files_are_reported_and_skipped() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 1, &segment(1..=2).0);
        let subdir = dir.path().join("00000000000000000005.journal");
        std::fs::create_dir(&subdir).unwrap();
        // Root reads any file; a dangling symlink cannot be opened by anyone.
        let dangling = dir.path().join("00000000000000000009.journal");
        std::os::unix::fs::symlink("/nonexistent/tallyd-test", &dangling).unwrap();
        let old = read(dir.path());
        assert_eq!(seqs(&old), vec![1, 2]);
        assert_eq!(old.damage.skipped, vec![subdir, dangling]);
    }

    #[test]
    fn segments_of_the_previous_format_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let l = layout();
        let mut bytes = MAGIC_V2.to_vec();
        for n in [l.buckets as u32, l.workers as u32, l.map.len() as u32] {
            bytes.extend_from_slice(&n.to_le_bytes());
        }
        for d in &l.map {
            bytes.extend_from_slice(&d.to_le_bytes());
        }
        for seq in 1..=3u64 {
            let body = line(seq);
            bytes.extend_from_slice(&(body.len() as u32).to_le_bytes());
            bytes.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
            bytes.extend_from_slice(&seq.to_le_bytes());
            bytes.extend_from_slice(&body);
        }
        write(dir.path(), 1, &bytes);
        let old = read(dir.path());
        assert_eq!(seqs(&old), vec![1, 2, 3]);
        assert_eq!(old.segments[0].layout, l);
        assert_eq!(old.damage, Damage::default());
    }
}
