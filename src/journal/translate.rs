//! Rewriting an old journal under the current layout. A replay is exactly once only under the
//! layout that wrote the segment (see `replay`), so when another layout (other
//! `flush.connections`, `coalesce.buckets`, or a shard map changed by a move) wrote lines that no
//! committed flush covers, the daemon first writes those lines, each chosen under its own
//! segment's layout, as one new segment of the current layout, numbered above every record and
//! every coverage the ledger holds, and then replays that segment like any other.
//!
//! The new segment supersedes every record of the other segments numbered below its first record
//! (`read` drops them), so the swap is atomic: the segment is written under a temporary name,
//! fsynced, renamed, and the directory fsynced. A crash before the rename leaves only the old
//! segments (the next start translates again); after it, only the new one counts. The old
//! segments are retired after the replay with the new one.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use super::format::{encode_translated_header, record_header, RECORD_HEADER};
use super::{io_err, JournalError, Lines, OldSegment};
use crate::routing::Layout;

/// Where the new segment is written before it is complete.
const TMP_NAME: &str = "translation.tmp";

/// Writes `records` (each one's lines, `\n`-terminated) as one durable segment of `layout`,
/// numbered from `first_seq`, which supersedes every record numbered below it. Returns it as
/// the replay reads it.
pub fn translate(
    dir: &Path,
    layout: &Layout,
    first_seq: u64,
    records: Vec<Vec<u8>>,
) -> Result<OldSegment, JournalError> {
    let first_seq = first_seq.max(1);
    let tmp = dir.join(TMP_NAME);
    // Left by a crash during an earlier try, which changed nothing.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(io_err(&tmp, "cannot remove")(e))
        }
        _ => {}
    }
    let file = File::create(&tmp).map_err(io_err(&tmp, "cannot create"))?;
    let mut out = BufWriter::with_capacity(256 * 1024, file);
    let header = encode_translated_header(layout);
    out.write_all(&header)
        .map_err(io_err(&tmp, "cannot write"))?;
    // Where each record's lines are, as the replay reads them back.
    let mut numbered = Vec::with_capacity(records.len());
    let mut at = header.len() as u64;
    for (seq, lines) in (first_seq..).zip(records) {
        out.write_all(&record_header(seq, &lines))
            .and_then(|_| out.write_all(&lines))
            .map_err(io_err(&tmp, "cannot write"))?;
        at += RECORD_HEADER as u64;
        let len = lines.len() as u32;
        numbered.push((seq, Lines::At { offset: at, len }));
        at += u64::from(len);
    }
    let file = out
        .into_inner()
        .map_err(|e| io_err(&tmp, "cannot write")(e.into_error()))?;
    file.sync_all().map_err(io_err(&tmp, "cannot fsync"))?;
    drop(file);
    let mut path = dir.join(format!("{first_seq:020}.journal"));
    let mut n = 1;
    while path.symlink_metadata().is_ok() {
        path = dir.join(format!("{first_seq:020}-{n}.journal"));
        n += 1;
    }
    std::fs::rename(&tmp, &path).map_err(io_err(&path, "cannot rename into place"))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir, "cannot fsync"))?;
    Ok(OldSegment {
        path,
        layout: layout.clone(),
        records: numbered,
        damaged: false,
        supersedes: first_seq - 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::JournalConfig;
    use crate::journal::read::loaded;
    use crate::journal::{push_line, read_segments, Journal};

    fn lines(keys: &[&str]) -> Vec<u8> {
        let mut out = Vec::new();
        for k in keys {
            push_line(&mut out, "c", k, 1, 5);
        }
        out
    }

    /// A journal of one layout, translated: read back, only the translated segment's records
    /// count, under the new layout; a second translation supersedes the first; a stale
    /// temporary file is replaced.
    #[tokio::test]
    async fn a_translated_segment_supersedes_the_old_ones() {
        let dir = tempfile::tempdir().unwrap();
        let old = Layout::single(4, 1);
        let new = Layout::single(4, 2);
        let j = Journal::open(&JournalConfig::default(), dir.path(), 1, &old).unwrap();
        for k in ["a", "b", "c"] {
            j.record(lines(&[k]), false, async {}).await;
        }
        assert_eq!(j.sync().await, Ok(()));
        drop(j);
        let read = |layout: &Layout| read_segments(dir.path(), layout).unwrap();
        let before = read(&new).segments;
        assert_eq!(before.iter().map(|s| s.records.len()).sum::<usize>(), 3);

        // As if a crash had left a half-written translation: it is replaced.
        std::fs::write(dir.path().join(TMP_NAME), b"half").unwrap();
        let t = translate(dir.path(), &new, 10, vec![lines(&["b"]), lines(&["c"])]).unwrap();
        assert_eq!(t.supersedes, 9);
        assert!(!dir.path().join(TMP_NAME).exists());
        let after = read(&old);
        assert_eq!(after.damage, Default::default());
        let layouts = after.segments.iter().flat_map(|s| {
            let n = s.records.len();
            std::iter::repeat_n(s.layout.clone(), n)
        });
        let kept: Vec<_> = layouts.zip(loaded(&after.segments)).collect();
        assert_eq!(
            kept,
            vec![
                (new.clone(), (10, lines(&["b"]))),
                (new.clone(), (11, lines(&["c"])))
            ],
            "only the translation counts, under its own layout"
        );
        assert_eq!(
            after.segments.len(),
            2,
            "the old segment stays until retired"
        );

        // Translated back: the second translation supersedes the first.
        translate(dir.path(), &old, 12, vec![lines(&["c"])]).unwrap();
        let again = loaded(&read(&new).segments);
        assert_eq!(again, vec![(12, lines(&["c"]))]);
        // The translation read back as it was returned.
        assert_eq!(
            loaded(std::slice::from_ref(&t)),
            vec![(10, lines(&["b"])), (11, lines(&["c"]))]
        );
    }
}
