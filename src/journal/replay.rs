//! Choosing what to replay after a restart: of the lines in old segments, those that no
//! committed flush covers. Pure: the caller reads the segments and the ledger's coverage, feeds
//! the chosen records to the buckets, and records the replay as committed.
//!
//! A line went to writer `worker_of(bucket(hash))` under its segment's own layout (the one it was
//! written with, which may differ from the current config); it is covered when its record's
//! sequence number is at most that writer's `journal_covered`. Uncovered lines of a layout other
//! than the current one ([`foreign`]) are not replayed as they are: only under its own layout
//! does a replay's coverage mean what the next start reads it as. The daemon first rewrites them
//! under the current layout (`journal::translate`).

use std::collections::HashMap;

use super::format::{lines, parse_line};
use super::{JournalError, OldSegment, Reader};
use crate::routing::{self, Layout};
pub use crate::store::coverage::Coverage;

/// Whether a committed flush covers a line: a writer's coverage.
pub trait Covers {
    /// Whether the line of `counter` in record `seq`, which went to `writer`, is committed.
    fn covers(&self, writer: i32, seq: u64, counter: &[u8]) -> bool;
    /// The highest record any writer covers (0: none).
    fn highest(&self) -> u64;
}

impl Covers for HashMap<i32, i64> {
    fn covers(&self, writer: i32, seq: u64, _: &[u8]) -> bool {
        (seq as i64) <= self.get(&writer).copied().unwrap_or(0)
    }

    fn highest(&self) -> u64 {
        self.values().map(|&c| c as u64).max().unwrap_or(0)
    }
}

impl Covers for Coverage {
    fn covers(&self, writer: i32, seq: u64, counter: &[u8]) -> bool {
        if !self.all.covers(writer, seq, counter) {
            return false;
        }
        match self.unique.get(&writer) {
            Some(&upto) if self.uniques.iter().any(|u| u.as_bytes() == counter) => {
                (seq as i64) <= upto
            }
            _ => true,
        }
    }

    fn highest(&self) -> u64 {
        self.all.highest()
    }
}

/// What to replay, and what to record once it is committed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Selection {
    /// The old records with uncovered lines, in order of their numbers: where each is, to be
    /// read back (and its lines chosen again) when the replay reaches it ([`replayed`]), so
    /// that a start holds one record of the journal at a time.
    pub records: Vec<Chosen>,
    /// Lines to replay.
    pub kept: u64,
    /// Lines a committed flush already covers.
    pub skipped: u64,
    /// The highest sequence number in the segments (0 without records).
    pub newest: u64,
    /// How many writer numbers the segments or the current layout can name: once the replay is
    /// committed, writers `0..writers` all cover `newest`, so that a crash before the segments
    /// are deleted cannot replay them again, even if the number of writers has changed.
    pub writers: i32,
}

/// An old record with lines no committed flush covers: its number, its segment and its place
/// there (indexes into the segments and their `records`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chosen {
    pub seq: u64,
    segment: usize,
    record: usize,
}

/// Chooses the lines of `segments` that `covered` (per writer: committed up to that record)
/// does not cover. `current` is the layout of this run. Reads each record back once, to count.
pub fn select(
    segments: &[OldSegment],
    covered: &impl Covers,
    current: &Layout,
) -> Result<Selection, JournalError> {
    let mut out = Selection {
        newest: newest(segments),
        writers: segments
            .iter()
            .map(|s| s.layout.total_workers() as i32)
            .chain([current.total_workers() as i32])
            .max()
            .unwrap_or(1),
        ..Selection::default()
    };
    let mut reader = Reader::new(segments);
    for (segment, seg) in segments.iter().enumerate() {
        for (record, (seq, _)) in seg.records.iter().enumerate() {
            let lines = reader.lines(segment, record)?;
            let mut kept = 0;
            out.skipped += uncovered(&lines, *seq, &seg.layout, covered, |_| kept += 1);
            out.kept += kept;
            if kept > 0 {
                let seq = *seq;
                out.records.push(Chosen {
                    seq,
                    segment,
                    record,
                });
            }
        }
    }
    out.records.sort_by_key(|c| c.seq);
    Ok(out)
}

/// Calls `kept` with each line of `record` (number `seq`, written under `layout`) that
/// `covered` does not cover; returns how many it covers. A line without a key is neither.
fn uncovered(
    record: &[u8],
    seq: u64,
    layout: &Layout,
    covered: &impl Covers,
    mut kept: impl FnMut(&[u8]),
) -> u64 {
    let mut skipped = 0;
    for line in lines(record) {
        let Some((counter, key)) = parse_line(line) else {
            continue;
        };
        if covered.covers(writer_of(layout, counter, key), seq, counter) {
            skipped += 1;
        } else {
            kept(line);
        }
    }
    skipped
}

/// The `chosen` records (of [`select`] on the same segments and coverage), read back one at a
/// time in order, each as its number and its uncovered lines, `\n`-terminated.
pub fn replayed<'a>(
    segments: &'a [OldSegment],
    covered: &'a (impl Covers + Sync),
    chosen: Vec<Chosen>,
) -> impl Iterator<Item = Result<(u64, Vec<u8>), JournalError>> + Send + 'a {
    let mut reader = Reader::new(segments);
    chosen.into_iter().map(move |c| {
        let record = reader.lines(c.segment, c.record)?;
        let mut kept = Vec::new();
        let layout = &segments[c.segment].layout;
        uncovered(&record, c.seq, layout, covered, |line| {
            kept.extend_from_slice(line);
            kept.push(b'\n');
        });
        Ok((c.seq, kept))
    })
}

/// Lines no committed flush covers that were journaled under a layout other than this run's.
/// Replaying them under this run's layout is not exactly once: the replay's flushes record
/// coverage under this run's writer numbers, while the next start would judge the old lines by
/// the old ones (docs/reliability.md, "Replay exactly once"). So the daemon rewrites them under
/// this run's layout first.
#[derive(Debug, PartialEq, Eq)]
pub struct Foreign {
    /// The layout of the first such segment.
    pub layout: Layout,
    /// Uncovered lines in every segment whose layout differs from this run's.
    pub lines: u64,
    /// The most databases such a segment's layout names: the ledger rows that judge its lines
    /// are in those databases.
    pub databases: usize,
}

impl Foreign {
    /// What differs between the journal's layout and `current`, as config keys.
    pub fn changes(&self, current: &Layout) -> String {
        let (old, new) = (&self.layout, current);
        let mut changes = Vec::new();
        if old.buckets != new.buckets {
            changes.push(format!(
                "coalesce.buckets {} -> {}",
                old.buckets, new.buckets
            ));
        }
        if old.workers != new.workers {
            changes.push(format!(
                "flush.connections {} -> {}",
                old.workers, new.workers
            ));
        }
        if old.map.len() != new.map.len() {
            changes.push(format!(
                "database.logical_shards {} -> {}",
                old.map.len(),
                new.map.len()
            ));
        } else if old.map != new.map {
            let moved = old.map.iter().zip(&new.map).filter(|(a, b)| a != b).count();
            changes.push(format!(
                "the shard map (database.shards / shard_map): {moved} logical shards map to another database"
            ));
        }
        changes.join(", ")
    }
}

/// The uncovered lines of segments written under a layout other than `current`, if any.
pub fn foreign(
    segments: &[OldSegment],
    covered: &impl Covers,
    current: &Layout,
) -> Result<Option<Foreign>, JournalError> {
    let mut out: Option<Foreign> = None;
    for seg in segments.iter().filter(|s| s.layout != *current) {
        let lines = select(std::slice::from_ref(seg), covered, current)?.kept;
        if lines > 0 {
            let f = out.get_or_insert_with(|| Foreign {
                layout: seg.layout.clone(),
                lines: 0,
                databases: 0,
            });
            f.lines += lines;
            f.databases = f.databases.max(seg.layout.databases());
        }
    }
    Ok(out)
}

/// Per counter the configuration no longer declares, the uncovered lines the journal holds for it
/// (name order). A reload may remove a counter with events pending; if tallyd dies before they
/// commit, a start that replayed them would reject them as `unknown_counter`: lost.
pub fn undeclared(
    segments: &[OldSegment],
    covered: &impl Covers,
    declared: impl Fn(&str) -> bool,
) -> Result<Vec<(String, u64)>, JournalError> {
    let mut out: std::collections::BTreeMap<String, u64> = Default::default();
    let mut reader = Reader::new(segments);
    for (segment, seg) in segments.iter().enumerate() {
        for (record, (seq, _)) in seg.records.iter().enumerate() {
            let lines = reader.lines(segment, record)?;
            uncovered(&lines, *seq, &seg.layout, covered, |line| {
                let Some((counter, _)) = parse_line(line) else {
                    return;
                };
                let name = String::from_utf8_lossy(counter);
                if !declared(&name) {
                    *out.entry(name.into_owned()).or_default() += 1;
                }
            });
        }
    }
    Ok(out.into_iter().collect())
}

/// The sequence number new records start from: above every old record and every position the
/// ledger records as covered, so that no new record is mistaken for a covered one.
pub fn first_seq(segments: &[OldSegment], covered: &impl Covers) -> u64 {
    newest(segments).max(covered.highest()) + 1
}

fn newest(segments: &[OldSegment]) -> u64 {
    segments
        .iter()
        .flat_map(|s| s.records.iter().map(|r| r.0))
        .max()
        .unwrap_or(0)
}

/// The writer a line went to under `layout`.
fn writer_of(layout: &Layout, counter: &[u8], key: &[u8]) -> i32 {
    let seed = routing::counter_seed(&String::from_utf8_lossy(counter));
    let hash = routing::key_hash(seed, key);
    layout.worker_of(layout.bucket(hash)) as i32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::push_line;

    fn two_writers() -> Layout {
        Layout::single(4, 2)
    }

    /// A key of counter `c` that `layout` routes to `writer`.
    fn key_for(layout: &Layout, writer: i32) -> String {
        (0..)
            .map(|i| format!("k{i}"))
            .find(|k| writer_of(layout, b"c", k.as_bytes()) == writer)
            .unwrap()
    }

    fn record(events: &[(&str, i64)]) -> Vec<u8> {
        let mut lines = Vec::new();
        for (key, delta) in events {
            push_line(&mut lines, "c", key, *delta, 5);
        }
        lines
    }

    fn segment(layout: Layout, records: Vec<(u64, Vec<u8>)>) -> OldSegment {
        OldSegment {
            path: "00000000000000000001.journal".into(),
            layout,
            records: (records.into_iter())
                .map(|(seq, lines)| (seq, crate::journal::Lines::Held(lines)))
                .collect(),
            damaged: false,
            supersedes: 0,
        }
    }

    /// What `select` chooses, and the records `replayed` reads back for it.
    fn chosen(
        segments: &[OldSegment],
        covered: &(impl Covers + Sync),
        current: &Layout,
    ) -> (Selection, Vec<(u64, Vec<u8>)>) {
        let s = select(segments, covered, current).unwrap();
        let records = replayed(segments, covered, s.records.clone())
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        (s, records)
    }

    #[test]
    fn a_line_is_replayed_unless_its_writer_covered_its_record() {
        let layout = two_writers();
        let (a, b) = (key_for(&layout, 0), key_for(&layout, 1));
        let seg = segment(
            layout.clone(),
            (1..=3)
                .map(|seq| (seq, record(&[(&a, seq as i64), (&b, 10 * seq as i64)])))
                .collect(),
        );
        // Writer 0 committed records up to 2; writer 1 up to 1.
        let covered = HashMap::from([(0, 2), (1, 1)]);
        let (s, records) = chosen(&[seg], &covered, &layout);
        assert_eq!(
            records,
            vec![(2, record(&[(&b, 20)])), (3, record(&[(&a, 3), (&b, 30)]))]
        );
        assert_eq!((s.kept, s.skipped), (3, 3));
        assert_eq!((s.newest, s.writers), (3, 2));
    }

    #[test]
    fn each_segment_routes_by_its_own_layout() {
        // Written with two writers, read back by a run with one: writer 1's coverage still
        // applies to the lines that went to writer 1 then.
        let old = two_writers();
        let (a, b) = (key_for(&old, 0), key_for(&old, 1));
        let seg = segment(old, vec![(7, record(&[(&a, 1), (&b, 2)]))]);
        let covered = HashMap::from([(1, 7)]);
        let (s, records) = chosen(&[seg], &covered, &Layout::single(1, 1));
        assert_eq!(records, vec![(7, record(&[(&a, 1)]))]);
        assert_eq!((s.kept, s.skipped), (1, 1));
        assert_eq!(
            s.writers, 2,
            "the old layout names more writers than the current one"
        );
    }

    #[test]
    fn nothing_old_selects_nothing_and_new_records_follow_the_coverage() {
        let covered = HashMap::from([(0, 41), (3, 12)]);
        let s = select(&[], &covered, &Layout::single(4, 4)).unwrap();
        assert_eq!(
            s,
            Selection {
                writers: 4,
                ..Selection::default()
            }
        );
        assert_eq!(first_seq(&[], &covered), 42);
        assert_eq!(first_seq(&[], &HashMap::new()), 1);
        let seg = segment(two_writers(), vec![(50, record(&[("k", 1)]))]);
        assert_eq!(first_seq(&[seg], &covered), 51);
    }

    #[test]
    fn uncovered_lines_of_another_layout_are_foreign_covered_ones_are_not() {
        let old = two_writers();
        let (a, b) = (key_for(&old, 0), key_for(&old, 1));
        let seg = || segment(old.clone(), vec![(7, record(&[(&a, 1), (&b, 2)]))]);
        let current = Layout::single(4, 1);
        // Writer 1 committed record 7; writer 0 did not.
        let half = HashMap::from([(1, 7)]);
        let f = (foreign(&[seg()], &half, &current).unwrap()).expect("one uncovered line");
        assert_eq!(
            (f.layout.clone(), f.lines, f.databases),
            (old.clone(), 1, 1)
        );
        assert_eq!(f.changes(&current), "flush.connections 2 -> 1");
        let all = HashMap::from([(0, 7), (1, 7)]);
        assert_eq!(
            foreign(&[seg()], &all, &current).unwrap(),
            None,
            "all covered"
        );
        assert_eq!(foreign(&[seg()], &half, &old).unwrap(), None, "same layout");
        let moved = Layout {
            map: vec![0, 1],
            ..Layout::single(8, 2)
        };
        let f = Foreign {
            layout: Layout {
                map: vec![0, 0],
                ..Layout::single(4, 2)
            },
            lines: 1,
            databases: 1,
        };
        assert_eq!(
            f.changes(&moved),
            "coalesce.buckets 4 -> 8, the shard map (database.shards / shard_map): 1 logical shards map to another database"
        );
    }

    #[test]
    fn a_unique_counters_lines_are_replayed_above_its_own_coverage() {
        let layout = Layout::single(1, 1);
        let mut lines = Vec::new();
        push_line(&mut lines, "c", "k", 1, 5);
        push_line(&mut lines, "u", "k", 1, 5);
        let seg = segment(layout.clone(), vec![(3, lines), (5, record(&[("k", 2)]))]);
        // Committed up to record 4, but the unique lines only up to 2 (held back).
        let covered = Coverage {
            all: HashMap::from([(0, 4)]),
            unique: HashMap::from([(0, 2)]),
            uniques: vec!["u".into()],
        };
        let (s, records) = chosen(std::slice::from_ref(&seg), &covered, &layout);
        let mut held = Vec::new();
        push_line(&mut held, "u", "k", 1, 5);
        assert_eq!(records, vec![(3, held), (5, record(&[("k", 2)]))]);
        assert_eq!((s.kept, s.skipped), (2, 1));
        assert_eq!(first_seq(&[], &covered), 5);
        let whole = Coverage {
            unique: HashMap::new(),
            ..covered
        };
        assert_eq!(
            select(&[seg], &whole, &layout).unwrap().kept,
            1,
            "nothing held"
        );
    }

    #[test]
    fn a_line_without_a_key_is_neither_replayed_nor_counted() {
        let seg = segment(two_writers(), vec![(1, b"c\n\nc k 1 @5\n".to_vec())]);
        let (s, records) = chosen(&[seg], &HashMap::new(), &two_writers());
        assert_eq!(records, vec![(1, b"c k 1 @5\n".to_vec())]);
        assert_eq!((s.kept, s.skipped), (1, 0));
    }
}
