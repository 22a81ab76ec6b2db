//! The counter kinds and their algebra, in one place: what a counter keeps per key ([`Kind`],
//! and its name, written here only), how an event folds into a pending key ([`Op`]), the value
//! a key keeps beside its count ([`Value`], [`Kept`]), the one merge of two values of a kind
//! ([`Kept::merge`]: a single `match`, as vector's `MetricValue::add`), and the same merges as
//! SQL text ([`sql`]) for every statement tallyd builds that merges rows in the database (the
//! flush's upserts, shard moves, `tallyd get`).
//!
//! Each merge is commutative, associative and idempotent (a greatest, a least, the greatest
//! `(event time, value)` pair, a sketch union): the order in which events, slot rows, flushes,
//! rollup steps and moves meet changes nothing. The SQL functions and views of the migrations
//! that merge values (V12) cannot be generated from here: [`sql`] lists them, and
//! tests/kind_algebra.rs runs every one of them, and the text of [`sql`], against
//! [`Kept::merge`] on the same inputs.

pub mod sql;

use std::fmt;

use crate::hll::{HllError, Params, Sketch};

/// A counter's aggregate (`kind` in config.toml). The third field of an event line is a delta
/// for `sum` and a value for every other kind (docs/protocol.md, "Kinds").
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Deserialize, serde::Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// The sum of the deltas (default 1): today's counters.
    #[default]
    Sum,
    /// The distinct values seen, as a postgresql-hll sketch (the value is text, hashed as
    /// `hll_hash_text` hashes it).
    Unique,
    /// The largest 64-bit integer value seen.
    Max,
    /// The smallest 64-bit integer value seen.
    Min,
    /// The 64-bit integer value of the event with the latest event time (ties: the largest).
    Last,
}

impl Kind {
    pub const ALL: [Kind; 5] = [Kind::Sum, Kind::Unique, Kind::Max, Kind::Min, Kind::Last];

    /// The config name, also the `kind` column of tallyd's tables (NULL there for `sum`: see
    /// [`Kind::column`]).
    pub fn name(self) -> &'static str {
        match self {
            Kind::Sum => "sum",
            Kind::Unique => "unique",
            Kind::Max => "max",
            Kind::Min => "min",
            Kind::Last => "last",
        }
    }

    /// The `kind` column of a row of this kind: NULL for a sum, so that every row written
    /// before kinds existed is a sum (migrations/V12).
    pub fn column(self) -> Option<&'static str> {
        (self != Kind::Sum).then(|| self.name())
    }

    /// The kind `name` names ([`Kind::name`]), as the views' `kind` column (`sum` for NULL)
    /// and config.toml write it.
    pub fn named(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The kind a row's `kind` column names ([`Kind::column`]); `None` for a name no tallyd
    /// writes there.
    pub fn of_column(column: Option<&str>) -> Option<Kind> {
        match column {
            None => Some(Kind::Sum),
            Some(name) => Kind::named(name).filter(|k| *k != Kind::Sum),
        }
    }

    /// Whether the value is a 64-bit integer (max, min, last).
    pub fn numeric(self) -> bool {
        matches!(self, Kind::Max | Kind::Min | Kind::Last)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How an event's value folds into its key's pending aggregate: the counter's kind, with a
/// unique counter's sketch parameters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Op {
    /// The delta is added to the sum.
    #[default]
    Sum,
    /// The value is kept if it is larger.
    Max,
    /// The value is kept if it is smaller.
    Min,
    /// The value is kept if its event time is later (at equal times, if it is larger).
    Last,
    /// The value's hash (`hll::hash_text`) is added to the sketch.
    Unique(Params),
}

impl Op {
    /// A counter of `kind`; a unique counter's sketches take `params` (without: the
    /// extension's defaults).
    pub fn new(kind: Kind, params: Option<Params>) -> Op {
        match kind {
            Kind::Sum => Op::Sum,
            Kind::Max => Op::Max,
            Kind::Min => Op::Min,
            Kind::Last => Op::Last,
            Kind::Unique => Op::Unique(params.unwrap_or_default()),
        }
    }

    pub fn kind(self) -> Kind {
        match self {
            Op::Sum => Kind::Sum,
            Op::Max => Kind::Max,
            Op::Min => Kind::Min,
            Op::Last => Kind::Last,
            Op::Unique(_) => Kind::Unique,
        }
    }
}

/// What a pending key keeps beside its aggregate (whose `sum` is the number of events for every
/// kind but a sum): nothing for a sum (no allocation: a sum's entry stays small), else its
/// value or its sketch, boxed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Value(Option<Box<Kept>>);

/// A max, min or last value, or a unique counter's sketch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kept {
    Max(i64),
    Min(i64),
    Last(i64),
    Sketch(Sketch),
}

/// What merges into a [`Kept`] value: one event's value (a unique counter's as its hash), or
/// another kept value of the same key (a drained entry, a stored row).
#[derive(Clone, Copy, Debug)]
pub enum Theirs<'a> {
    Event(i64),
    Kept(&'a Kept),
}

/// Two values that cannot merge: rows of one key that hold a sketch and a number, or sketches
/// of other parameters.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    #[error("a {ours} value does not merge with a {theirs} value")]
    Kinds { ours: Kind, theirs: Kind },
    #[error(transparent)]
    Sketch(#[from] HllError),
}

impl Theirs<'_> {
    /// A max, min or last value (of whichever of the three: as the database's `CASE` on the
    /// stored row's kind, the rule is `ours`').
    fn number(self, ours: Kind) -> Result<i64, MergeError> {
        match self {
            Theirs::Event(value) => Ok(value),
            Theirs::Kept(kept) => kept.number().ok_or(MergeError::Kinds {
                ours,
                theirs: kept.kind(),
            }),
        }
    }
}

impl Kept {
    /// Merges `theirs`, whose latest event time is `their_at`, into this value, whose latest is
    /// `at`: a max keeps the larger, a min the smaller, a last the value of the later time (at
    /// equal times the larger value), a sketch takes a hash or unions a sketch. The times are
    /// Unix milliseconds in the buckets and `last_seen` timestamps in shard moves.
    pub fn merge<T: Ord>(
        &mut self,
        at: T,
        theirs: Theirs<'_>,
        their_at: T,
    ) -> Result<(), MergeError> {
        match (self, theirs) {
            (Kept::Max(v), t) => *v = (*v).max(t.number(Kind::Max)?),
            (Kept::Min(v), t) => *v = (*v).min(t.number(Kind::Min)?),
            (Kept::Last(v), t) => {
                let value = t.number(Kind::Last)?;
                if (their_at, value) > (at, *v) {
                    *v = value;
                }
            }
            (Kept::Sketch(sketch), Theirs::Event(hash)) => sketch.add_hash(hash),
            (Kept::Sketch(sketch), Theirs::Kept(Kept::Sketch(other))) => sketch.union(other)?,
            (Kept::Sketch(_), Theirs::Kept(other)) => {
                return Err(MergeError::Kinds {
                    ours: Kind::Unique,
                    theirs: other.kind(),
                })
            }
        }
        Ok(())
    }

    /// A stored row's value: its `kind` with its `value` (max, min, last) or its `sketch`
    /// (unique); `None` for a sum's row, or a row without the column its kind keeps.
    pub fn of_row(kind: Kind, value: Option<i64>, sketch: Option<Sketch>) -> Option<Kept> {
        match (kind, value, sketch) {
            (Kind::Max, Some(v), _) => Some(Kept::Max(v)),
            (Kind::Min, Some(v), _) => Some(Kept::Min(v)),
            (Kind::Last, Some(v), _) => Some(Kept::Last(v)),
            (Kind::Unique, _, Some(sketch)) => Some(Kept::Sketch(sketch)),
            _ => None,
        }
    }

    pub fn kind(&self) -> Kind {
        match self {
            Kept::Max(_) => Kind::Max,
            Kept::Min(_) => Kind::Min,
            Kept::Last(_) => Kind::Last,
            Kept::Sketch(_) => Kind::Unique,
        }
    }

    /// The value of a max, min or last key.
    pub fn number(&self) -> Option<i64> {
        match self {
            Kept::Max(v) | Kept::Min(v) | Kept::Last(v) => Some(*v),
            Kept::Sketch(_) => None,
        }
    }

    /// A unique key's sketch.
    pub fn sketch(&self) -> Option<&Sketch> {
        match self {
            Kept::Sketch(sketch) => Some(sketch),
            _ => None,
        }
    }
}

impl Value {
    /// A sum's: nothing.
    pub const SUM: Value = Value(None);

    fn kept(kept: Kept) -> Value {
        Value(Some(Box::new(kept)))
    }

    /// Nothing yet: the identity of [`Value::add`] for `op` (the least value of a max, the
    /// greatest of a min, the least pair of a last, the empty sketch).
    pub fn empty(op: Op) -> Value {
        match op {
            Op::Sum => Value::SUM,
            Op::Max => Value::kept(Kept::Max(i64::MIN)),
            Op::Min => Value::kept(Kept::Min(i64::MAX)),
            Op::Last => Value::kept(Kept::Last(i64::MIN)),
            Op::Unique(params) => Value::kept(Kept::Sketch(Sketch::new(params))),
        }
    }

    /// One event's value (a unique counter's: its hash).
    pub fn new(op: Op, value: i64) -> Value {
        match op {
            Op::Sum => Value::SUM,
            Op::Max => Value::kept(Kept::Max(value)),
            Op::Min => Value::kept(Kept::Min(value)),
            Op::Last => Value::kept(Kept::Last(value)),
            Op::Unique(params) => {
                let mut sketch = Sketch::new(params);
                sketch.add_hash(value);
                Value::kept(Kept::Sketch(sketch))
            }
        }
    }

    /// Folds in one event's `value` at `at_ms`, the key's latest event time so far being
    /// `last_ms` (before this event), by [`Kept::merge`]. A key keeps the kind it was created
    /// with (a kind cannot change while the daemon runs).
    pub fn add(&mut self, value: i64, at_ms: i64, last_ms: i64) {
        if let Some(kept) = self.0.as_deref_mut() {
            let merged = kept.merge(last_ms, Theirs::Event(value), at_ms);
            debug_assert!(merged.is_ok(), "an event merges into every kind");
        }
    }

    /// Folds in `theirs`, another pending value of the same key whose latest event time is
    /// `their_last_ms` (this one's: `last_ms`), by [`Kept::merge`]: a unique row the flush held
    /// back and the same key's row of a newer drain. A sum has nothing to merge.
    pub fn merge(
        &mut self,
        last_ms: i64,
        theirs: &Value,
        their_last_ms: i64,
    ) -> Result<(), MergeError> {
        match (self.0.as_deref_mut(), theirs.0.as_deref()) {
            (Some(ours), Some(kept)) => ours.merge(last_ms, Theirs::Kept(kept), their_last_ms),
            _ => Ok(()),
        }
    }

    /// Its kind: `None` for a sum.
    pub fn kind(&self) -> Option<Kind> {
        self.0.as_deref().map(Kept::kind)
    }

    /// The value of a max, min or last key.
    pub fn number(&self) -> Option<i64> {
        self.0.as_deref()?.number()
    }

    /// A unique key's sketch.
    pub fn sketch(&self) -> Option<&Sketch> {
        self.0.as_deref()?.sketch()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kind_is_named_once_and_read_back_from_its_column() {
        for kind in Kind::ALL {
            assert_eq!(Kind::of_column(kind.column()), Some(kind));
            assert_eq!(Kind::named(kind.name()), Some(kind));
            assert_eq!(kind.to_string(), kind.name());
        }
        assert_eq!(Kind::Sum.column(), None);
        assert_eq!(Kind::of_column(Some("sum")), None, "a sum's column is NULL");
        assert_eq!(Kind::of_column(Some("median")), None);
        for kind in Kind::ALL {
            assert_eq!(Op::new(kind, None).kind(), kind);
        }
    }

    #[test]
    fn last_takes_the_later_time_then_the_larger_value() {
        let mut last = Kept::Last(5);
        last.merge(10, Theirs::Event(3), 9).unwrap();
        assert_eq!(last, Kept::Last(5), "an earlier event never wins");
        last.merge(10, Theirs::Event(3), 10).unwrap();
        assert_eq!(last, Kept::Last(5), "at the same time, the larger value");
        last.merge(10, Theirs::Event(7), 10).unwrap();
        assert_eq!(last, Kept::Last(7));
        last.merge(10, Theirs::Kept(&Kept::Last(i64::MIN)), 11)
            .unwrap();
        assert_eq!(
            last,
            Kept::Last(i64::MIN),
            "a later time wins whatever its value"
        );
    }

    #[test]
    fn a_sketch_and_a_number_do_not_merge() {
        let mut sketch = Kept::Sketch(Sketch::new(Params::default()));
        let err = sketch.merge(0, Theirs::Kept(&Kept::Max(1)), 0).unwrap_err();
        assert_eq!(
            err.to_string(),
            "a unique value does not merge with a max value"
        );
        let mut max = Kept::Max(1);
        assert!(max.merge(0, Theirs::Kept(&sketch), 0).is_err());
        // Numbers merge by the rule of the value merged into, as the database's CASE does.
        max.merge(0, Theirs::Kept(&Kept::Min(4)), 0).unwrap();
        assert_eq!(max, Kept::Max(4));
    }
}
