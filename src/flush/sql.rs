//! The flush's SQL text: the transaction's opening ([`BEGIN`]), the upserts of each [`Shape`]
//! of chunk (plain, and returning behind the range guard), the corrections ([`CORRECT`]), the
//! ledger row ([`RECORD`]) and the ledger's read at connect ([`LAST_SEQ`]). A kind's merge in
//! the upserts comes from [`crate::kind::sql`], a window's start from
//! [`crate::store::win_from_ms`]: the upserts are built from them once, at the first flush,
//! and every flight reuses the same text.

use std::sync::LazyLock;

use crate::bucket::Entry;
use crate::kind::sql::{self, Side};
use crate::kind::Kind;
use crate::store::{win_from_ms, WIN_AS_MS};

/// Opens a flush's transaction and marks it as one: the upserts and the ledger row write only
/// where `tallyd.flushing` is on, which this `SET LOCAL` makes true inside this transaction
/// block alone. The rest of the flush is sent right behind it, before its answer; were the
/// BEGIN to fail, each of those statements would run as a transaction of its own, and write
/// nothing. READ COMMITTED whatever the role's `default_transaction_isolation`: the shard map
/// check reads the version once its lock is granted, and `tallyd.record_flush` sees a copy of
/// the flight that committed while it waited, only with a snapshot per statement.
pub(super) const BEGIN: &str =
    "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL tallyd.flushing = on";

/// The flight's corrections (`!set`, `!forget`; migrations/V12, `tallyd.correct`): each key's
/// advisory lock (the rollup's), then its stored rows deleted: a set's window, a forget's every
/// row. Only inside a flush's transaction (see [`BEGIN`]).
pub(super) const CORRECT: &str = "SELECT tallyd.correct($1::text[], $2::text[], $3::text[], \
     $4::bigint[], $5::boolean[], $6::bigint[], $7::bigint[], $8::int[], $9::int[], \
     $10::text[], $11::bigint[])";

/// The flight's ledger row (migrations/V9, V21: `tallyd.record_flush`): also checks, in the
/// flush's own transaction, that this daemon still holds its instance lease (store/lease.rs; a
/// daemon whose lease was taken over while it stalled writes nothing), and fails the
/// transaction (SQLSTATE TD002) when the writer's row already records this flight: a copy of a
/// transaction tallyd gave up on, which the server ran to its COMMIT meanwhile. `$6`: how far
/// this writer's unique lines are committed, below `$4` while its unique rows are held back
/// (`super::held`).
pub(super) const RECORD: &str = "SELECT tallyd.record_flush($1, $5, $2, $3, $4, $6)";

/// Whether the hll extension is installed: asked before a flight while unique rows are held.
pub(super) const HAS_HLL: &str = "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'hll')";

/// This writer's last committed seq (NULL: none), and whether the database is a Citus cluster.
pub(super) const LAST_SEQ: &str = "\
SELECT (SELECT seq FROM tallyd.flushes WHERE instance_id = $1 AND writer = $2 AND owner = $3),
       EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')";

/// Which upsert a chunk needs: the narrowest that carries all its rows' kinds, so that a flight
/// of sums is written exactly as before kinds existed, and only a chunk with unique rows names
/// the hll extension's functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Shape {
    /// Sums only (`kind` NULL): the eight columns every row has.
    Sums,
    /// Sums, max, min and last rows: with `kind` and `value`, a value merged by the stored
    /// row's kind; a sum's `kind` and `value` stay NULL.
    Values,
    /// Every kind, unique rows among them: with `sketch` too, unioned by the hll extension's
    /// `hll_union` (present wherever a unique counter is declared: src/store/kinds.rs), from
    /// and back to the hll's own bytes.
    Sketches,
}

/// The upserts of each [`Shape`], plain and returning: built once.
static UPSERTS: LazyLock<[[String; 2]; 3]> = LazyLock::new(|| {
    [Shape::Sums, Shape::Values, Shape::Sketches].map(|s| [upsert(s, false), upsert(s, true)])
});

impl Shape {
    pub(super) fn of(entry: &Entry) -> Shape {
        match entry.value.kind() {
            None => Shape::Sums,
            Some(Kind::Unique) => Shape::Sketches,
            Some(_) => Shape::Values,
        }
    }

    /// The chunk's upsert. Plain, a stored total that would leave the 64-bit range fails the
    /// statement (`bigint out of range`, SQLSTATE 22003) and with it the whole transaction,
    /// COMMIT included: nothing of the flight is written. A probe then sends it `returning` and
    /// rolls it back: the range guard skips a row whose total would leave the 64-bit range and
    /// the rows written come back, so the keys skipped are known; they leave the flight whole
    /// (rejected) and the rest is written. On Citus every upsert returns (no probe): the skipped
    /// rows are rejected as the flight commits.
    pub(super) fn upsert(self, returning: bool) -> &'static str {
        &UPSERTS[self as usize][usize::from(returning)]
    }
}

/// A chunk's columns beyond the eight every row has (as the table names them), their arrays
/// (typed parameters), and their merges in the slot upsert's `ON CONFLICT`.
fn kind_columns(shape: Shape) -> (&'static str, &'static str, String) {
    match shape {
        Shape::Sums => ("", "", String::new()),
        Shape::Values => (
            ", kind, value",
            ", $9::text[], $10::bigint[]",
            format!(",\n    value = {}", sql::value_column("s")),
        ),
        Shape::Sketches => (
            ", kind, value, sketch",
            ", $9::text[], $10::bigint[], $11::bytea[]",
            format!(
                ",\n    value = {},\n    sketch = {}",
                sql::value_column("s"),
                sql::sketch_column("s")
            ),
        ),
    }
}

/// The flush's upsert of a chunk of `shape`: the eight columns every row has, a kind's columns
/// merged by [`crate::kind::sql`]. Writes only inside a flush's transaction (see [`BEGIN`]).
fn upsert(shape: Shape, returning: bool) -> String {
    let (columns, arrays, merges) = kind_columns(shape);
    let (guard, tail) = if returning {
        (
            "\nWHERE s.count::numeric + EXCLUDED.count \
             BETWEEN -9223372036854775808 AND 9223372036854775807",
            format!(
                "\nRETURNING s.counter, s.key, s.span, {}",
                WIN_AS_MS.replace("win", "s.win")
            ),
        )
    } else {
        ("", String::new())
    };
    format!(
        "INSERT INTO tallyd.slots AS s (counter, key, span, win, slot, count, first_seen, last_seen{columns})
SELECT c, k, sp, {win}, sl, n, f, l{columns}
FROM unnest($1::text[], $2::text[], $3::int[], $4::bigint[], $5::timestamptz[], $6::timestamptz[],
            $7::text[], $8::bigint[]{arrays})
AS u (c, k, sl, n, f, l, sp, w{columns})
WHERE current_setting('tallyd.flushing', true) = 'on'
ON CONFLICT (counter, key, span, win, slot) DO UPDATE SET
    count = s.count + EXCLUDED.count,
    first_seen = LEAST(s.first_seen, EXCLUDED.first_seen),
    last_seen = GREATEST(s.last_seen, EXCLUDED.last_seen){merges}{guard}{tail}",
        win = win_from_ms("w"),
    )
}

/// Where a direct write goes (docs/design.md, "Direct writes"): a `rollup_into` target as the
/// database names it (see `super::direct::Targets`): its table, qualified and quoted, its
/// columns quoted, the key column's type (the key is cast to it), and for a windowed target its
/// window column (a `date` or a `timestamptz`) and the counter's zone as a quoted literal; and
/// its `on_add` columns, each with its constant as an SQL literal cast to the column's type.
pub(super) struct Place<'a> {
    pub(super) on_add: &'a [(String, String)],
    pub(super) table: &'a str,
    pub(super) key_column: &'a str,
    pub(super) count_column: &'a str,
    pub(super) window_column: Option<&'a str>,
    pub(super) key_type: &'a str,
    pub(super) date: bool,
    pub(super) zone: &'a str,
}

impl Place<'_> {
    /// The window column's value for the window starting at `ms` (a bigint expression of Unix
    /// ms): as `tallyd.window_value` (migrations/V11) reads a slot row's `win`, so that a direct
    /// write and the rollup name the same row.
    fn window_value(&self, ms: &str) -> String {
        let win = format!("('epoch'::timestamptz + {ms} * interval '1 millisecond')");
        if self.date {
            format!(
                "(({win} + interval '12 hours') AT TIME ZONE {})::date",
                self.zone
            )
        } else {
            win
        }
    }

    /// The statement's condition that `alias`'s row is the target row of key `k` and window
    /// `w` (columns of the unnested rows).
    fn matches(&self, alias: &str, k: &str, w: &str) -> String {
        let key = format!(
            "{alias}.{} = {k}::{}",
            quote(self.key_column),
            self.key_type
        );
        match self.window_column {
            Some(column) => format!(
                "{key} AND {alias}.{} = {}",
                quote(column),
                self.window_value(w)
            ),
            None => key,
        }
    }
}

impl Place<'_> {
    /// The `on_add` columns for an INSERT's column list (`, "processed"`), their constants for
    /// its values (`, 'false'::boolean`), and both for a SET (`, "processed" = 'false'::boolean`):
    /// each empty without `on_add`.
    fn on_add(&self) -> (String, String, String) {
        let mut out = (String::new(), String::new(), String::new());
        for (column, value) in self.on_add {
            out.0 += &format!(", {}", quote(column));
            out.1 += &format!(", {value}");
            out.2 += &format!(", {} = {value}", quote(column));
        }
        out
    }
}

/// `name` as an SQL identifier.
fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// An `insert_missing` sum target's direct write: the plain upsert of a buffer's mover, the key,
/// window and count of each row (`$1`, `$2`, `$3`) added to its `(key, window)` row, inserted
/// where missing. Rows in the flight's order (key bytes, window): the rollup inserts new rows in
/// that order too, so that neither waits for the other in a cycle.
pub(super) fn direct_upsert(to: &Place<'_>) -> String {
    let (key, count) = (quote(to.key_column), quote(to.count_column));
    let window = quote(to.window_column.unwrap_or_default());
    let (columns, values, sets) = to.on_add();
    format!(
        "INSERT INTO {table} AS u ({key}, {window}, {count}{columns})
SELECT k::{key_type}, {value}, n{values} FROM unnest($1::text[], $2::bigint[], $3::bigint[]) AS x (k, w, n)
WHERE current_setting('tallyd.flushing', true) = 'on'
ON CONFLICT ({key}, {window}) DO UPDATE SET {count} = coalesce(u.{count}, 0) + EXCLUDED.{count}{sets}",
        table = to.table,
        key_type = to.key_type,
        value = to.window_value("w"),
    )
}

/// A target's direct write without `insert_missing` (an all-time target, a windowed one that
/// only adds to rows that exist, a max, min or unique counter's column): each row's target row
/// found by one index probe and added to (merged with, by the kind's rule); the rows whose
/// target row does not exist, or changed under the statement, go to `tallyd.slots` with the
/// slot upsert, in the same statement. The chunk carries the slot upsert's columns. `None` for
/// a kind that folds into no column (`last`).
pub(super) fn direct_update(to: &Place<'_>, kind: Kind, shape: Shape) -> Option<String> {
    let count = quote(to.count_column);
    let column = format!("t.{count}");
    let merged = match kind {
        Kind::Sum => format!("coalesce({column}, 0) + x.n"),
        Kind::Unique => sql::pair(kind, Side::untimed(&column), Side::untimed("x.sketch::hll"))?,
        _ => sql::pair(kind, Side::untimed(&column), Side::untimed("x.value"))?,
    };
    let (columns, arrays, merges) = kind_columns(shape);
    let (_, _, sets) = to.on_add();
    Some(format!(
        "WITH x AS MATERIALIZED (
    SELECT u.*, v.utid
    FROM unnest($1::text[], $2::text[], $3::int[], $4::bigint[], $5::timestamptz[], $6::timestamptz[],
                $7::text[], $8::bigint[]{arrays}) WITH ORDINALITY
         AS u (c, k, sl, n, f, l, sp, w{columns}, i)
    LEFT JOIN LATERAL (SELECT v.ctid AS utid FROM {table} v WHERE {probe} LIMIT 1) v ON true
    WHERE current_setting('tallyd.flushing', true) = 'on'
), written AS (
    UPDATE {table} t SET {count} = {merged}{sets} FROM x WHERE t.ctid = x.utid RETURNING x.i
)
INSERT INTO tallyd.slots AS s (counter, key, span, win, slot, count, first_seen, last_seen{columns})
SELECT c, k, sp, {win}, sl, n, f, l{columns} FROM x
WHERE x.i NOT IN (SELECT written.i FROM written)
ON CONFLICT (counter, key, span, win, slot) DO UPDATE SET
    count = s.count + EXCLUDED.count,
    first_seen = LEAST(s.first_seen, EXCLUDED.first_seen),
    last_seen = GREATEST(s.last_seen, EXCLUDED.last_seen){merges}",
        table = to.table,
        probe = to.matches("v", "u.k", "u.w"),
        win = win_from_ms("w"),
    ))
}

/// A direct counter's `also` rows (sums: `rollup_into` takes windows of sums only) written into
/// `tallyd.rollups` with the slot upsert's statement and columns, as the rollup would fold them.
pub(super) static ALSO_UPSERT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "INSERT INTO tallyd.rollups AS r (counter, key, span, win, count, first_seen, last_seen)
SELECT c, k, sp, {win}, n, f, l
FROM unnest($1::text[], $2::text[], $3::int[], $4::bigint[], $5::timestamptz[], $6::timestamptz[],
            $7::text[], $8::bigint[])
AS u (c, k, sl, n, f, l, sp, w)
WHERE current_setting('tallyd.flushing', true) = 'on'
ON CONFLICT (counter, key, span, win) DO UPDATE SET
    count = r.count + EXCLUDED.count,
    first_seen = LEAST(r.first_seen, EXCLUDED.first_seen),
    last_seen = GREATEST(r.last_seen, EXCLUDED.last_seen)",
        win = win_from_ms("w"),
    )
});

/// How long a direct statement waits for a lock (see [`direct_lock_timeout`]): a row the
/// application, another instance or a rollup step holds fails the statement quickly, and the
/// flight is written again through `tallyd.slots`.
pub const LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(200);

/// Before the direct statements: a lock the application (or another writer) holds fails the
/// statement within [`LOCK_TIMEOUT`], and the flight is written again through `tallyd.slots`.
pub(super) fn direct_lock_timeout() -> String {
    format!("SET LOCAL lock_timeout = '{}ms'", LOCK_TIMEOUT.as_millis())
}

/// In BEGIN's message when the flight writes anything directly: the lock every writer of
/// `tallyd.slots` holds, which a correction's SHARE ROW EXCLUSIVE waits for and holds back
/// (migrations/V12, `tallyd.correct`), so that a correction orders against a direct flight as
/// against one that writes slot rows, which takes it at its first upsert.
pub(super) const LOCK_SLOTS: &str = "LOCK TABLE tallyd.slots IN ROW EXCLUSIVE MODE";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flight_of_sums_names_no_kind_and_only_a_unique_row_names_the_extension() {
        let sums = Shape::Sums.upsert(false);
        assert!(!sums.contains("kind") && !sums.contains("hll"), "{sums}");
        assert!(!Shape::Values.upsert(true).contains("hll"));
        assert!(Shape::Sketches.upsert(false).contains("hll_union"));
        for shape in [Shape::Sums, Shape::Values, Shape::Sketches] {
            assert!(!shape.upsert(false).contains("RETURNING"));
            let returning = shape.upsert(true);
            assert!(returning.contains("BETWEEN") && returning.contains("RETURNING"));
        }
    }
}
