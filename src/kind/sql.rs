//! Each kind's merge as SQL text, written once for every statement tallyd builds: the pairwise
//! form ([`pair`]: two values of one key, such as a stored row and an upsert's `EXCLUDED`; the
//! `value` and `sketch` columns of an upsert, [`value_column`] and [`sketch_column`]) and the
//! aggregate form ([`aggregate`]: every row of a key in one `GROUP BY`). The flush's upserts
//! (src/flush/sql.rs), shard moves (src/store/moves/mod.rs) and `tallyd get` (src/store/read.rs) use
//! them, and so does the view `tallyd.unique_totals` (src/store/kinds.rs); each is the rule of
//! [`super::Kept::merge`].
//!
//! Copies that cannot come from here, since migrations are SQL files that run as written (and
//! must keep the same rule), all in migrations/V12__counter_kinds.sql:
//! - the views `tallyd.totals` and `tallyd.window_totals` (the aggregate form of max, min and
//!   last);
//! - `tallyd.rollup_fold` and `tallyd.rollup_fold_own`: the aggregate form in the fold's `GROUP
//!   BY` and the pairwise form in its `ON CONFLICT`;
//! - `tallyd.rollup_sketches`: `hll_union_agg`, then `hll_union` in its `ON CONFLICT`;
//! - `tallyd.rollup_into_kind`: max, min and unique folded into an application's column.
//!
//! tests/kind_algebra.rs runs each of them, and every function here, against the Rust merge on
//! the same inputs (i64 edges, equal event times for `last`), so a wrong copy fails it.

use super::Kind;

/// One side of a pairwise merge: the SQL expression of a value (a sketch's as an `hll`) and of
/// the event time it came from, which only `last` reads.
#[derive(Clone, Copy, Debug)]
pub struct Side<'a> {
    pub value: &'a str,
    pub at: Option<&'a str>,
}

impl<'a> Side<'a> {
    /// A value with its event time.
    pub fn timed(value: &'a str, at: &'a str) -> Side<'a> {
        Side {
            value,
            at: Some(at),
        }
    }

    /// A value without one (an application's column): it merges with any kind but `last`.
    pub fn untimed(value: &'a str) -> Side<'a> {
        Side { value, at: None }
    }
}

/// `ours` and `theirs`, two values of `kind`, merged: the greatest, the least, the value of the
/// later time (at equal times the larger), or the union of two sketches (either NULL: the
/// other). `None` for a sum (its counts are added) and for a `last` without times.
pub fn pair(kind: Kind, ours: Side<'_>, theirs: Side<'_>) -> Option<String> {
    let (a, b) = (ours.value, theirs.value);
    Some(match kind {
        Kind::Sum => return None,
        Kind::Max => format!("GREATEST({a}, {b})"),
        Kind::Min => format!("LEAST({a}, {b})"),
        Kind::Last => {
            let (at_a, at_b) = (ours.at?, theirs.at?);
            format!(
                "CASE WHEN {at_b} > {at_a} OR ({at_b} = {at_a} AND {b} > {a}) \
                 THEN {b} ELSE {a} END"
            )
        }
        Kind::Unique => or_either(a, b, &union(a, b)),
    })
}

/// The `value` of an upsert's row `stored` (the table's alias) merged with `EXCLUDED`'s by the
/// stored row's kind: NULL for a sum or a unique row, which keep no value.
pub fn value_column(stored: &str) -> String {
    let (value, at) = (format!("{stored}.value"), format!("{stored}.last_seen"));
    let ours = Side::timed(&value, &at);
    let theirs = Side::timed("EXCLUDED.value", "EXCLUDED.last_seen");
    let arms: String = Kind::ALL
        .into_iter()
        .filter(|k| k.numeric())
        .map(|k| {
            let merged = pair(k, ours, theirs).expect("a numeric kind merges with times");
            format!("\n        WHEN '{}' THEN {merged}", k.name())
        })
        .collect();
    format!("CASE {stored}.kind{arms}\n    END")
}

/// The `sketch` of an upsert's row `stored` unioned with `EXCLUDED`'s: both in the `hll` type's
/// own bytes in a `bytea` column, read with `::hll` and written back with `hll_send`.
pub fn sketch_column(stored: &str) -> String {
    let (a, b) = (format!("{stored}.sketch"), "EXCLUDED.sketch");
    let both = format!(
        "hll_send({})",
        union(&format!("{a}::hll"), &format!("{b}::hll"))
    );
    or_either(&a, b, &both)
}

/// The value of a key's rows merged in one `GROUP BY` (the rows' `kind`, `value`, `sketch` and
/// `last_seen` columns): the greatest, the least, the value of the latest `last_seen` (at equal
/// times the largest), the union of the sketches (an `hll`). `None` for a sum.
pub fn aggregate(kind: Kind) -> Option<&'static str> {
    Some(match kind {
        Kind::Sum => return None,
        Kind::Max => "max(value)",
        Kind::Min => "min(value)",
        Kind::Last => {
            "(array_agg(value ORDER BY last_seen DESC, value DESC) FILTER (WHERE kind = 'last'))[1]"
        }
        Kind::Unique => "hll_union_agg(sketch::hll)",
    })
}

/// The union of two sketches, `hll` expressions neither of them NULL.
fn union(a: &str, b: &str) -> String {
    format!("hll_union({a}, {b})")
}

/// `both` where neither `a` nor `b` is NULL, else whichever is not.
fn or_either(a: &str, b: &str, both: &str) -> String {
    format!("CASE WHEN {a} IS NULL OR {b} IS NULL THEN coalesce({a}, {b}) ELSE {both} END")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_upsert_merges_each_numeric_kind_by_its_rule() {
        assert_eq!(
            value_column("s"),
            "CASE s.kind
        WHEN 'max' THEN GREATEST(s.value, EXCLUDED.value)
        WHEN 'min' THEN LEAST(s.value, EXCLUDED.value)
        WHEN 'last' THEN CASE WHEN EXCLUDED.last_seen > s.last_seen OR (EXCLUDED.last_seen = \
             s.last_seen AND EXCLUDED.value > s.value) THEN EXCLUDED.value ELSE s.value END
    END"
        );
        assert_eq!(
            sketch_column("r"),
            "CASE WHEN r.sketch IS NULL OR EXCLUDED.sketch IS NULL THEN coalesce(r.sketch, \
             EXCLUDED.sketch) ELSE hll_send(hll_union(r.sketch::hll, EXCLUDED.sketch::hll)) END"
        );
    }

    #[test]
    fn a_last_merges_only_with_times_and_a_sum_not_at_all() {
        let (a, b) = (Side::untimed("a"), Side::untimed("b"));
        assert_eq!(pair(Kind::Last, a, b), None);
        assert_eq!(pair(Kind::Sum, a, b), None);
        assert_eq!(aggregate(Kind::Sum), None);
        assert_eq!(pair(Kind::Max, a, b).as_deref(), Some("GREATEST(a, b)"));
    }
}
