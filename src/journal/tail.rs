//! Reading a segment from a byte offset in bounded chunks, for the folder that reads spilled
//! records back while the writer appends: it remembers where it stopped, so a round decodes only
//! what was appended since, never the whole segment again, and holds at most one chunk of it.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::format::{MAGIC_V2, RECORD_HEADER, RECORD_MARK};
use super::read::{decode_header, find_mark, record_at};
use super::{io_err, JournalError};

/// How many bytes a read takes at most (more only for a single record that is larger).
pub const CHUNK_BYTES: usize = 4 << 20;

/// Records by number, with their lines.
pub type Records = Vec<(u64, Vec<u8>)>;

/// Where a reader is in one segment.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    /// The byte after the last whole record read (or damaged stretch skipped).
    pub offset: u64,
    /// The segment is closed (the writer appends to a newer one) and was read to its end.
    pub done: bool,
}

/// The next chunk of whole records at `place` in the segment at `path` (`closed`: the writer no
/// longer appends to it), and the place after them. A record cut short at the end of a segment
/// the writer still appends to is left for the next read; damaged bytes are skipped up to the
/// next record mark (the segment's reading at start reports them). A segment deleted meanwhile
/// has no records and is done. A segment of the previous format is read whole (only a start
/// can find one, and its records are all numbered below what the folder looks for).
pub fn read_chunk(
    path: &Path,
    place: Place,
    closed: bool,
) -> Result<(Records, Place), JournalError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Ok((
                Vec::new(),
                Place {
                    done: true,
                    ..place
                },
            ))
        }
        Err(e) => return Err(io_err(path, "cannot open")(e)),
    };
    let len = file.metadata().map_err(io_err(path, "cannot stat"))?.len();
    let mut records = Vec::new();
    let mut offset = place.offset;
    let want = usize::try_from(len.saturating_sub(offset))
        .unwrap_or(usize::MAX)
        .min(CHUNK_BYTES);
    let mut buf = read_at(&file, path, offset, want)?;
    let mut at = 0;
    if offset == 0 {
        if buf.starts_with(MAGIC_V2) {
            let records = super::read::records_from(path, 0)?;
            return Ok((
                records,
                Place {
                    offset: len,
                    done: closed,
                },
            ));
        }
        at = match (decode_header(&buf), find_mark(&buf, 0)) {
            (Some((_, end)), _) => end,
            (None, Some(mark)) => mark,
            // A header the writer may still be writing.
            (None, None) if !closed => return Ok((records, place)),
            (None, None) => buf.len(),
        };
    }
    let mut grown = false;
    loop {
        if let Some((seq, lines, end)) = record_at(&buf, at) {
            records.push((seq, lines.to_vec()));
            at = end;
            continue;
        }
        if at >= buf.len() {
            break;
        }
        let eof = offset + buf.len() as u64 >= len;
        let rest = &buf[at..];
        // Nothing whole follows: what is here may be a record the writer is appending now.
        let last = find_mark(&buf, at + 1).is_none();
        if RECORD_MARK.starts_with(&rest[..rest.len().min(RECORD_MARK.len())]) {
            match rest.get(4..8) {
                None if !eof => break,
                None if !closed && last => break,
                None => {}
                Some(l) => {
                    let need = RECORD_HEADER + u32::from_le_bytes(l.try_into().unwrap()) as usize;
                    let start = offset + at as u64;
                    if need > rest.len() && start + need as u64 <= len {
                        if at == 0 && !grown {
                            // Larger than a chunk: read it alone.
                            grown = true;
                            buf = read_at(&file, path, start, need)?;
                            continue;
                        }
                        break;
                    }
                    if need > rest.len() && !closed && last {
                        break;
                    }
                }
            }
        } else if rest.len() < RECORD_MARK.len() && !eof {
            break;
        }
        // Damaged (or cut short for good in a closed segment): skip to the next mark.
        match find_mark(&buf, at + 1) {
            Some(next) => at = next,
            None if eof => {
                at = buf.len();
                break;
            }
            None => {
                // The next mark may straddle the chunk's end.
                at = buf.len().saturating_sub(RECORD_MARK.len() - 1).max(at + 1);
                break;
            }
        }
    }
    offset += at as u64;
    let done = closed && offset >= len;
    Ok((records, Place { offset, done }))
}

fn read_at(file: &File, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>, JournalError> {
    let mut buf = vec![0; len];
    let mut got = 0;
    while got < len {
        match file.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(path, "cannot read")(e)),
        }
    }
    buf.truncate(got);
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::super::format::{encode_header, record_header};
    use super::*;
    use crate::routing::Layout;

    fn record(seq: u64, len: usize) -> Vec<u8> {
        let lines = vec![b'a' + (seq % 26) as u8; len];
        let mut out = record_header(seq, &lines).to_vec();
        out.extend_from_slice(&lines);
        out
    }

    /// Every read from where the last stopped, until no progress.
    fn read_all(path: &Path, place: &mut Place, closed: bool) -> Vec<(u64, usize)> {
        let mut got = Vec::new();
        loop {
            let (records, after) = read_chunk(path, *place, closed).unwrap();
            got.extend(records.into_iter().map(|(seq, lines)| (seq, lines.len())));
            if after == *place {
                return got;
            }
            *place = after;
        }
    }

    #[test]
    fn reads_resume_where_they_stopped_across_chunks_and_torn_tails() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("1.journal");
        let layout = Layout {
            buckets: 4,
            workers: 2,
            map: vec![0, 1],
        };
        let mut file = File::create(&path).unwrap();
        file.write_all(&encode_header(&layout)).unwrap();
        // Small records, one larger than a chunk, records straddling chunk ends.
        let sizes = [10, 3 << 20, 100, CHUNK_BYTES + 7, 3 << 20, 5];
        for (i, len) in sizes.iter().enumerate() {
            file.write_all(&record(i as u64 + 1, *len)).unwrap();
        }
        // Half of the next record: the writer is appending it.
        let next = record(7, 1000);
        file.write_all(&next[..500]).unwrap();
        let mut place = Place::default();
        let got = read_all(&path, &mut place, false);
        let want: Vec<(u64, usize)> = (1..).zip(sizes).collect();
        assert_eq!(got, want);
        assert!(!place.done);
        // Its rest arrives: only it is read, from where the last read stopped.
        file.write_all(&next[500..]).unwrap();
        file.write_all(&record(8, 20)).unwrap();
        assert_eq!(read_all(&path, &mut place, false), [(7, 1000), (8, 20)]);
        // Damage is skipped to the next record; a closed segment read to its end is done.
        file.write_all(b"garbage").unwrap();
        file.write_all(&record(9, 30)).unwrap();
        assert_eq!(read_all(&path, &mut place, true), [(9, 30)]);
        assert!(place.done);
        // A segment deleted meanwhile has nothing more.
        std::fs::remove_file(&path).unwrap();
        let (records, after) = read_chunk(&path, Place::default(), false).unwrap();
        assert!(records.is_empty() && after.done);
    }
}
