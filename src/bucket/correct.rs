//! Corrections in a bucket (`!set`, `!forget`; docs/design.md, "Corrections"): carried in a
//! [`Batch`] between the connection's events ([`Batch::push_correction`]), they supersede the
//! pending entries of their key ([`correct`]) and mark them ([`Correct`]), so that the flush
//! that writes the entry first deletes the key's stored rows; a set of a windowed sum also
//! leaves a [`SetNote`], with which the flush moves the key's `also` rows by the window's
//! difference.

use compact_str::CompactString;

use super::{Agg, Batch, BatchEvent, Drained, Entry, Target};
use crate::kind::{Op, Value};
use crate::window::SpanCode;

/// A correction carried by a [`BatchEvent`] and remembered by its [`Entry`] until the flush
/// applies it (src/flush/: the key's stored rows are deleted before its row is written).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Correct {
    #[default]
    None,
    /// The entry's window: its stored rows are deleted, and the entry's total replaces them.
    Set,
    /// Every row of the key, in every window, is deleted.
    Forget,
}

/// A `!set` of a sum's window: its value, and the sum of the events it superseded in memory
/// (the events before it in this drain; with several sets of the window in one drain, the
/// events between them too). The window's rows beside it (coarser windows, the all-time row)
/// hold those events and the stored window's total: they move by `value - stored -
/// superseded`, computed in the flush's transaction (`tallyd.correct`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetNote {
    pub counter: u16,
    pub key: CompactString,
    pub span: SpanCode,
    pub win: i64,
    pub value: i64,
    pub superseded: i64,
    /// The connection that sent it and its number there (from 1): told if the flush refuses
    /// it.
    pub conn: u64,
    pub serial: u64,
}

impl Batch {
    /// A correction of `to`'s key: `Set` (its window's total becomes `value`, at `at_ms`) or
    /// `Forget` (every window of the key; `to`'s window is the all-time row).
    pub fn push_correction(
        &mut self,
        to: Target,
        key: &str,
        correct: Correct,
        value: i64,
        at_ms: i64,
        serial: u64,
    ) {
        self.push_to(to, key, value, at_ms, false);
        let last = self.events.last_mut().expect("pushed above");
        last.correct = correct;
        self.serials.push(serial);
    }
}

/// Applies correction `e` of `key` to the pending entries; returns whether it added one. A
/// set replaces its window's entry (the events before it are superseded; those after add to
/// it); a forget empties every window's entry of the key and marks the all-time entry, whose
/// flush deletes all the key's rows. The superseded events stay counted as pending, in their
/// entry's `events` (they are released with the flush, per counter too, as any drained event).
pub(super) fn correct(
    taken: &mut Drained,
    (conn, serial): (u64, u64),
    e: &BatchEvent,
    key: &str,
) -> bool {
    if e.correct == Correct::Forget {
        taken
            .sets
            .retain(|n| !(n.counter == e.counter && n.key == key));
        for x in taken.entries.iter_hash_mut(e.hash) {
            if x.counter == e.counter && &*x.key == key {
                x.agg = Agg {
                    events: x.agg.events,
                    ..Agg::EMPTY
                };
                x.value = Value::empty(e.op);
            }
        }
    }
    let found = taken.entries.find_mut(e.hash, |x| {
        x.counter == e.counter && x.win == e.win && x.span == e.span && &*x.key == key
    });
    if (e.correct, e.op) == (Correct::Set, Op::Sum) {
        let pending = found.as_ref().map_or(0, |x| x.agg.sum);
        let same = |n: &&mut SetNote| {
            (n.counter, n.span, n.win) == (e.counter, e.span, e.win) && n.key == key
        };
        match taken.sets.iter_mut().find(same) {
            Some(note) => {
                note.superseded += pending - note.value;
                note.value = e.delta;
                note.conn = conn;
                note.serial = serial;
            }
            None => taken.sets.push(SetNote {
                counter: e.counter,
                key: key.into(),
                span: e.span,
                win: e.win,
                value: e.delta,
                superseded: pending,
                conn,
                serial,
            }),
        }
    }
    let (agg, value) = match e.correct {
        Correct::Set if e.op == Op::Sum => (
            Agg {
                events: 0,
                ..Agg::new(e.delta, e.at_ms)
            },
            Value::SUM,
        ),
        Correct::Set => (
            Agg {
                sum: 0,
                events: 0,
                ..Agg::new(0, e.at_ms)
            },
            Value::new(e.op, e.delta),
        ),
        _ => (Agg::EMPTY, Value::empty(e.op)),
    };
    match found {
        Some(entry) => {
            entry.agg = Agg {
                events: entry.agg.events,
                ..agg
            };
            entry.value = value;
            // A forget deletes more than a set: a set after a forget keeps the forget.
            if entry.reset != Correct::Forget {
                entry.reset = e.correct;
            }
            false
        }
        None => {
            taken.entries.insert_unique(
                e.hash,
                Entry {
                    hash: e.hash,
                    counter: e.counter,
                    span: e.span,
                    win: e.win,
                    key: key.into(),
                    agg,
                    value,
                    reset: e.correct,
                },
                |x| x.hash,
            );
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::Pending;
    use crate::routing::key_hash;
    use crate::window::{ALL_SPAN, ALL_TIME};

    #[test]
    fn a_set_supersedes_earlier_events_and_a_forget_empties_every_window() {
        let mut p = Pending::default();
        let mut b = Batch::default();
        let t = Target {
            hash: key_hash(1, b"k"),
            counter: 0,
            span: ALL_SPAN,
            win: ALL_TIME,
            op: Op::Sum,
        };
        b.push_to(t, "k", 5, 1, false);
        b.push_to(
            Target {
                span: 3,
                win: 0,
                ..t
            },
            "k",
            5,
            1,
            false,
        );
        b.push_correction(t, "k", Correct::Set, 100, 2, 1);
        b.push_to(t, "k", 1, 3, false);
        p.record(1, &b);
        let d = p.drain();
        let h = key_hash(1, b"k");
        let all = d.entries.find(h, |x| x.span == ALL_SPAN).unwrap();
        assert_eq!((all.agg.sum, all.reset), (101, Correct::Set));
        let mut b = Batch::default();
        b.push_to(t, "k", 5, 1, false);
        b.push_to(
            Target {
                span: 3,
                win: 0,
                ..t
            },
            "k",
            5,
            1,
            false,
        );
        b.push_correction(t, "k", Correct::Forget, 0, 2, 2);
        p.record(1, &b);
        let d = p.drain();
        assert!(
            d.entries.iter().all(|e| e.agg.is_empty()),
            "nothing left to write"
        );
        let marker = d.entries.find(h, |x| x.span == ALL_SPAN).unwrap();
        assert_eq!(marker.reset, Correct::Forget);
    }
}
