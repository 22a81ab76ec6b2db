//! A flight's rows as the flush writes them: sorted so that every writer locks rows in the same
//! order ([`sorted_rows`]), its corrections as `tallyd.correct`'s arrays ([`Corrections`]), and
//! each statement's chunk of rows with its column arrays already in PostgreSQL's binary format
//! ([`Chunk`], [`Encoded`]): a kind's `kind` and `value` columns, and a unique key's sketch in
//! the hll type's own bytes, only in chunks whose [`Shape`] carries them.

use std::time::SystemTime;

use bytes::{Bytes, BytesMut};
use compact_str::CompactString;
use tokio_postgres::types::{to_sql_checked, IsNull, ToSql, Type};

use super::sql::Shape;
use super::Flight;
use crate::bucket::{Agg, Correct, Entry};
use crate::clock::ms_to_time;
use crate::config::Counter;
use crate::hll::Sketch;
use crate::kind::Kind;
use crate::window::{span_name, SpanCode, ALL_SPAN, ALL_TIME};

/// The flight's rows sorted by (counter name, key, window), so that every statement locks its rows in
/// index order, and writers that share rows (instances whose slots collide) lock them in the
/// same order. Each comparison first looks at a sort key held in the vector itself (the
/// counter's rank by name, the key's first 8 bytes big-endian), and touches the entries only
/// when those tie: with a million keys the entries are far out of cache, and dereferencing two
/// of them per comparison was most of the sort's time.
pub(super) fn sorted_rows<'f>(flight: &'f Flight, counters: &[Counter]) -> Vec<&'f Entry> {
    let rank = name_ranks(counters);
    let mut keyed: Vec<(u16, u64, &Entry)> = flight
        .parts
        .iter()
        .flat_map(|d| d.entries.iter())
        .map(|e| (rank[e.counter as usize], key_prefix(&e.key), e))
        .collect();
    keyed.sort_unstable_by(|a, b| {
        (a.0, a.1)
            .cmp(&(b.0, b.1))
            .then_with(|| a.2.key.as_bytes().cmp(b.2.key.as_bytes()))
            .then_with(|| (a.2.span, a.2.win).cmp(&(b.2.span, b.2.win)))
    });
    keyed.into_iter().map(|(_, _, e)| e).collect()
}

/// Each counter's position in name order.
fn name_ranks(counters: &[Counter]) -> Vec<u16> {
    let mut by_name: Vec<usize> = (0..counters.len()).collect();
    by_name.sort_unstable_by(|&a, &b| counters[a].name.cmp(&counters[b].name));
    let mut rank = vec![0u16; counters.len()];
    for (r, &c) in by_name.iter().enumerate() {
        rank[c] = r as u16;
    }
    rank
}

/// The corrections of a flight, in its rows' order (so that keys are locked in the order the
/// upserts lock them), as `tallyd.correct`'s arrays.
#[derive(Default)]
pub(super) struct Corrections {
    counters: Vec<String>,
    keys: Vec<String>,
    spans: Vec<&'static str>,
    wins: Vec<i64>,
    forgets: Vec<bool>,
    /// A windowed sum's set: its value and what it superseded in memory (see
    /// [`crate::bucket::SetNote`]), the slot this writer writes, and the rows of its `also`
    /// windows, which move by the window's difference (`also_of`: the correction's index,
    /// from 1; `tallyd.correct`'s `beside_of`).
    values: Vec<Option<i64>>,
    superseded: Vec<i64>,
    slots: Vec<i32>,
    also_of: Vec<i32>,
    also_spans: Vec<&'static str>,
    also_wins: Vec<i64>,
    /// Whether the set is of a `rollup_into` counter's target window (see [`into_target`]):
    /// `tallyd.correct` writes its value into the application's row (`tallyd.set_target`).
    into_target: Vec<bool>,
    /// Each correction's (counter, key, span, window), as the entry that carries it: what
    /// `tallyd.correct` names by position when it refuses one (SQLSTATE TD003).
    ids: Vec<(u16, CompactString, SpanCode, i64)>,
}

impl Corrections {
    /// Forgets first (a forget and a set of one key in one flight: the set's window is among
    /// what the forget deletes, and its total is written after), then sets, each in row order
    /// (stable: each kind keeps the rows' order).
    pub(super) fn of(
        rows: &[&Entry],
        flight: &Flight,
        counters: &[Counter],
        slot_of: impl Fn(u16) -> i32,
    ) -> Option<Corrections> {
        let corrected: Vec<&Entry> = rows
            .iter()
            .copied()
            .filter(|e| e.reset != Correct::None)
            .collect();
        if corrected.is_empty() {
            return None;
        }
        let note_of = |e: &Entry| {
            flight.parts.iter().flat_map(|d| &d.sets).find(|n| {
                (n.counter, n.span, n.win) == (e.counter, e.span, e.win) && n.key == e.key
            })
        };
        // A forget then a set of one key in one drain leave its entry marked `Forget`
        // (src/bucket/correct.rs). A forget leaves a `rollup_into` target's row alone, so there
        // the set is applied too, after the forgets, as a set of its own.
        let set_after_forget =
            |e: &Entry| into_target(e, &counters[e.counter as usize]) && note_of(e).is_some();
        let forgets = corrected
            .iter()
            .filter(|e| e.reset == Correct::Forget)
            .map(|e| (*e, true));
        let sets = corrected
            .iter()
            .filter(|e| e.reset == Correct::Set || set_after_forget(e))
            .map(|e| (*e, false));
        let mut out = Corrections::default();
        for (e, forget) in forgets.chain(sets) {
            let info = &counters[e.counter as usize];
            out.counters.push(info.name.clone());
            out.keys.push(e.key.to_string());
            out.spans.push(span_name(e.span));
            out.wins.push(e.win);
            out.forgets.push(forget);
            out.slots.push(slot_of(e.counter));
            out.ids.push((e.counter, e.key.clone(), e.span, e.win));
            let (value, superseded) = match note_of(e) {
                Some(n) if !forget => (Some(n.value), n.superseded),
                _ => (None, 0),
            };
            out.values.push(value);
            out.superseded.push(superseded);
            out.into_target
                .push(value.is_some() && into_target(e, info));
            if value.is_some() && e.win != ALL_TIME {
                for (span, win) in info.also_of(e.win) {
                    out.also_of.push(out.keys.len() as i32);
                    out.also_spans.push(span);
                    out.also_wins.push(win);
                }
            }
        }
        (!out.keys.is_empty()).then_some(out)
    }

    /// The correction at `position` (from 1, as `tallyd.correct` names it).
    pub(super) fn at(&self, position: usize) -> Option<&(u16, CompactString, SpanCode, i64)> {
        self.ids.get(position.checked_sub(1)?)
    }

    pub(super) fn params(&self) -> [(&(dyn ToSql + Sync), Type); 12] {
        [
            (&self.counters, Type::TEXT_ARRAY),
            (&self.keys, Type::TEXT_ARRAY),
            (&self.spans, Type::TEXT_ARRAY),
            (&self.wins, Type::INT8_ARRAY),
            (&self.forgets, Type::BOOL_ARRAY),
            (&self.values, Type::INT8_ARRAY),
            (&self.superseded, Type::INT8_ARRAY),
            (&self.slots, Type::INT4_ARRAY),
            (&self.also_of, Type::INT4_ARRAY),
            (&self.also_spans, Type::TEXT_ARRAY),
            (&self.also_wins, Type::INT8_ARRAY),
            (&self.into_target, Type::BOOL_ARRAY),
        ]
    }
}

/// Whether `e`, a corrected entry (a set's, or a forget's followed by a set), is of `counter`'s `rollup_into` target: a sum folded into an
/// application's table, in the window the table holds (its all-time row without a window).
/// `tallyd.correct` writes such a set's value where the total lives, the application's row
/// (or, where that row cannot take it, a slot row), so the flight writes only the events after
/// the set for it ([`after_target_sets`]).
fn into_target(e: &Entry, counter: &Counter) -> bool {
    let span = counter
        .window
        .as_ref()
        .map_or(ALL_SPAN, |w| w.span().code());
    e.reset != Correct::None
        && counter.kind == Kind::Sum
        && counter.rollup_into.is_some()
        && e.span == span
}

/// The entries of `flight` that hold a set of a `rollup_into` target (see [`into_target`]),
/// each as the flight writes it: the events after the set alone, since `tallyd.correct` writes
/// the set's value into the application's row in the same transaction. An entry with no event
/// after its set is empty (not written). Sets are rare: these are copies, swapped for the
/// flight's own entries by [`swap_in`].
pub(super) fn after_target_sets(flight: &Flight, counters: &[Counter]) -> Vec<Entry> {
    let mut out = Vec::new();
    for part in &flight.parts {
        for note in &part.sets {
            let Some(counter) = counters.get(note.counter as usize) else {
                continue;
            };
            let found = part.entries.iter().find(|e| {
                (e.counter, e.span, e.win) == (note.counter, note.span, note.win)
                    && e.key == note.key
            });
            let Some(e) = found.filter(|e| into_target(e, counter)) else {
                continue;
            };
            // The entry is the set's value plus the events after it (its `agg.sum` cannot
            // leave the range by less than it holds).
            let after = i128::from(e.agg.sum) - i128::from(note.value);
            let agg = if (after, e.agg.events) == (0, 0) {
                Agg::EMPTY
            } else {
                Agg {
                    sum: after.clamp(i64::MIN.into(), i64::MAX.into()) as i64,
                    ..e.agg
                }
            };
            out.push(Entry {
                hash: e.hash,
                counter: e.counter,
                span: e.span,
                win: e.win,
                key: e.key.clone(),
                agg,
                value: e.value.clone(),
                reset: e.reset,
            });
        }
    }
    out
}

/// Puts `after` (from [`after_target_sets`]) in place of the flight's entries they copy.
pub(super) fn swap_in<'f>(rows: &mut [&'f Entry], after: &'f [Entry]) {
    if after.is_empty() {
        return;
    }
    for row in rows.iter_mut() {
        let copy = after.iter().find(|a| {
            (a.counter, a.span, a.win) == (row.counter, row.span, row.win) && a.key == row.key
        });
        if let Some(copy) = copy {
            *row = copy;
        }
    }
}

/// The first 8 bytes of `key`, big-endian, zero-padded: ordered as the keys are, except that
/// keys sharing their first 8 bytes (or differing only by trailing NULs) tie.
fn key_prefix(key: &str) -> u64 {
    let mut prefix = [0u8; 8];
    let n = key.len().min(8);
    prefix[..n].copy_from_slice(&key.as_bytes()[..n]);
    u64::from_be_bytes(prefix)
}

/// One upsert statement: its rows, and its eight column arrays already in PostgreSQL's binary
/// format. Encoding them before the transaction begins leaves the pipeline only copies to make,
/// so that BEGIN is never left waiting for the first upsert while its rows are encoded.
pub(super) struct Chunk<'a> {
    pub(super) rows: &'a [&'a Entry],
    pub(super) counters: &'a [Counter],
    pub(super) shape: Shape,
    /// Eight columns for sums, ten with values, eleven with sketches.
    columns: Vec<Encoded>,
}

impl<'a> Chunk<'a> {
    pub(super) fn new(
        rows: &'a [&'a Entry],
        counters: &'a [Counter],
        slot_of: impl Fn(u16) -> i32,
    ) -> Chunk<'a> {
        Chunk::with_shape(rows, counters, slot_of, Shape::Sums)
    }

    /// [`Chunk::new`] with the columns of `shape` at least.
    fn with_shape(
        rows: &'a [&'a Entry],
        counters: &'a [Counter],
        slot_of: impl Fn(u16) -> i32,
        least: Shape,
    ) -> Chunk<'a> {
        let names: Vec<&str> = rows
            .iter()
            .map(|e| counters[e.counter as usize].name.as_str())
            .collect();
        let keys: Vec<&str> = rows.iter().map(|e| e.key.as_str()).collect();
        let slots: Vec<i32> = rows.iter().map(|e| slot_of(e.counter)).collect();
        let counts: Vec<i64> = rows.iter().map(|e| e.agg.sum).collect();
        let first: Vec<SystemTime> = rows.iter().map(|e| ms_to_time(e.agg.first_ms)).collect();
        let last: Vec<SystemTime> = rows.iter().map(|e| ms_to_time(e.agg.last_ms)).collect();
        let spans: Vec<&str> = rows.iter().map(|e| span_name(e.span)).collect();
        let wins: Vec<i64> = rows.iter().map(|e| e.win).collect();
        let mut buf = BytesMut::new();
        let mut columns = vec![
            Encoded::new(&names, Type::TEXT_ARRAY, &mut buf),
            Encoded::new(&keys, Type::TEXT_ARRAY, &mut buf),
            Encoded::new(&slots, Type::INT4_ARRAY, &mut buf),
            Encoded::new(&counts, Type::INT8_ARRAY, &mut buf),
            Encoded::new(&first, Type::TIMESTAMPTZ_ARRAY, &mut buf),
            Encoded::new(&last, Type::TIMESTAMPTZ_ARRAY, &mut buf),
            Encoded::new(&spans, Type::TEXT_ARRAY, &mut buf),
            Encoded::new(&wins, Type::INT8_ARRAY, &mut buf),
        ];
        let shape = rows.iter().map(|e| Shape::of(e)).fold(least, Shape::max);
        if shape >= Shape::Values {
            let kinds: Vec<Option<&str>> = rows
                .iter()
                .map(|e| e.value.kind().map(Kind::name))
                .collect();
            let values: Vec<Option<i64>> = rows.iter().map(|e| e.value.number()).collect();
            columns.push(Encoded::new(&kinds, Type::TEXT_ARRAY, &mut buf));
            columns.push(Encoded::new(&values, Type::INT8_ARRAY, &mut buf));
        }
        if shape == Shape::Sketches {
            let sketches: Vec<Option<Vec<u8>>> = rows
                .iter()
                .map(|e| e.value.sketch().map(Sketch::to_bytes))
                .collect();
            columns.push(Encoded::new(&sketches, Type::BYTEA_ARRAY, &mut buf));
        }
        Chunk {
            rows,
            counters,
            shape,
            columns,
        }
    }

    /// The upsert's parameters, typed: an unnamed statement (Parse, Bind, Execute in one round
    /// trip), so that a transaction pooler may hand each transaction to another server
    /// connection (docs/operations.md).
    pub(super) fn params(&self) -> Vec<(&(dyn ToSql + Sync), Type)> {
        self.columns
            .iter()
            .map(|c| (c as &(dyn ToSql + Sync), c.ty.clone()))
            .collect()
    }
}

/// One direct statement (see [`super::direct`]): a direct counter's rows of one chunk, bound for
/// its `rollup_into` table (`sql` is its target's statement) or, its `also` rows, for
/// `tallyd.rollups`; its arrays encoded before the transaction begins, as a [`Chunk`]'s.
pub(super) struct DirectChunk<'a> {
    pub(super) counter: u16,
    pub(super) sql: &'a str,
    columns: Vec<Encoded>,
}

impl<'a> DirectChunk<'a> {
    /// The key, window and count arrays of an `insert_missing` upsert.
    pub(super) fn compact(counter: u16, sql: &'a str, rows: &[&Entry]) -> DirectChunk<'a> {
        let keys: Vec<&str> = rows.iter().map(|e| e.key.as_str()).collect();
        let wins: Vec<i64> = rows.iter().map(|e| e.win).collect();
        let counts: Vec<i64> = rows.iter().map(|e| e.agg.sum).collect();
        let mut buf = BytesMut::new();
        let columns = vec![
            Encoded::new(&keys, Type::TEXT_ARRAY, &mut buf),
            Encoded::new(&wins, Type::INT8_ARRAY, &mut buf),
            Encoded::new(&counts, Type::INT8_ARRAY, &mut buf),
        ];
        DirectChunk {
            counter,
            sql,
            columns,
        }
    }

    /// A slot upsert's arrays (its rows may end in `tallyd.slots`), at least those of `shape`.
    pub(super) fn full(
        counter: u16,
        sql: &'a str,
        rows: &'a [&'a Entry],
        counters: &'a [Counter],
        shape: Shape,
        slot_of: impl Fn(u16) -> i32,
    ) -> DirectChunk<'a> {
        let chunk = Chunk::with_shape(rows, counters, slot_of, shape);
        DirectChunk {
            counter,
            sql,
            columns: chunk.columns,
        }
    }

    pub(super) fn params(&self) -> Vec<(&(dyn ToSql + Sync), Type)> {
        self.columns
            .iter()
            .map(|c| (c as &(dyn ToSql + Sync), c.ty.clone()))
            .collect()
    }
}

/// A parameter already encoded (as `ty`), or why it could not be: the error comes back where
/// tokio-postgres would have met it, when the statement is sent.
#[derive(Debug)]
struct Encoded {
    ty: Type,
    value: Result<Bytes, String>,
}

impl Encoded {
    fn new(value: &(dyn ToSql + Sync), ty: Type, buf: &mut BytesMut) -> Encoded {
        let value = match value.to_sql_checked(&ty, buf) {
            Ok(_) => Ok(buf.split().freeze()),
            Err(err) => {
                buf.clear();
                Err(err.to_string())
            }
        };
        Encoded { ty, value }
    }
}

impl ToSql for Encoded {
    fn to_sql(
        &self,
        _: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match &self.value {
            Ok(bytes) => {
                out.extend_from_slice(bytes);
                Ok(IsNull::No)
            }
            Err(err) => Err(err.clone().into()),
        }
    }

    /// Its own type, checked when it was encoded.
    fn accepts(_: &Type) -> bool {
        true
    }

    to_sql_checked!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::{Agg, Drained};
    use crate::kind::Value;

    #[test]
    fn rows_sort_by_counter_name_then_key_bytes() {
        // Counter 0 is "b", counter 1 is "a": name order, not index order, comes first. Keys
        // share 8-byte prefixes, differ past them, or only by trailing NULs.
        let counters: Vec<Counter> = ["b", "a"].iter().map(|n| Counter::new(n, 1)).collect();
        let keys = [
            "k1",
            "k10",
            "k2",
            "",
            "abcdefgh",
            "abcdefghz",
            "abcdefgha",
            "abc\0",
            "abc",
            "z",
            "abcdefgh\0",
            "é",
            "e",
        ];
        let mut entries = hashbrown::HashTable::new();
        for (i, key) in keys.iter().enumerate() {
            for counter in 0..2u16 {
                let hash = (i * 2 + counter as usize) as u64;
                let entry = Entry {
                    hash,
                    counter,
                    span: crate::window::ALL_SPAN,
                    win: crate::window::ALL_TIME,
                    key: (*key).into(),
                    agg: Agg {
                        sum: 1,
                        first_ms: 0,
                        last_ms: 0,
                        events: 1,
                    },
                    value: Value::SUM,
                    reset: Correct::None,
                };
                entries.insert_unique(hash, entry, |e: &Entry| e.hash);
            }
        }
        let drained = Drained {
            entries,
            ..Drained::default()
        };
        let flight = Flight::new(vec![drained], 0);
        let got: Vec<(&str, &str)> = sorted_rows(&flight, &counters)
            .iter()
            .map(|e| (counters[e.counter as usize].name.as_str(), e.key.as_str()))
            .collect();
        let mut want = got.clone();
        want.sort();
        assert_eq!(got, want);
        assert_eq!(got.len(), 2 * keys.len());
        assert_eq!(got[0], ("a", ""));
    }
}
