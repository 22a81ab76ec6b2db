//! Reading one key's exact total back, for `tallyd get`: from `tallyd.totals` and
//! `tallyd.window_totals` (with a unique counter's cardinality from `tallyd.unique_totals`), or
//! from the application's `rollup_into` column merged with the slot rows not folded yet, as the
//! rollup will merge them (each kind's merge from [`crate::kind::sql`]). Every figure comes
//! from one statement, so from one snapshot: the rollup moves rows from the slots to the
//! column in one transaction, and the sum is exact at any moment.

use std::collections::BTreeMap;

use tokio_postgres::types::Type;
use tokio_postgres::Client;

use super::{DbError, WIN_AS_MS};
use crate::config::RollupInto;
use crate::kind::{sql, Kind};
use crate::window::Window;

/// Why a key could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{0}")]
    Db(DbError),
    #[error("looking up {table}.{column}: {cause}")]
    Column {
        table: String,
        column: String,
        cause: DbError,
    },
    #[error("{column}: {value:?} is not a whole number")]
    NotANumber { column: String, value: String },
    #[error("{counter}: rollup_into of a windowed counter needs window_column")]
    NoWindowColumn { counter: String },
    #[error("{counter}: a {kind} counter does not fold into a column")]
    NotFoldable { counter: String, kind: Kind },
}

// By hand rather than `#[from]`, so that the message prints the cause once (it is no `source()`).
impl From<DbError> for ReadError {
    fn from(e: DbError) -> ReadError {
        ReadError::Db(e)
    }
}

impl From<tokio_postgres::Error> for ReadError {
    fn from(e: tokio_postgres::Error) -> ReadError {
        ReadError::Db(e.into())
    }
}

/// What a row of a kind other than sum holds beside its count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shown {
    /// A sum: nothing.
    Sum,
    /// A max, min or last value (`None`: none yet).
    Value(Kind, Option<String>),
    /// A unique counter's cardinality (0 without a sketch).
    Unique(i64),
}

/// A key's all-time total (`tallyd.totals`).
#[derive(Debug, Clone)]
pub struct Total {
    /// `exact_count`: numeric, so beyond the 64-bit range too.
    pub count: String,
    /// ISO 8601, UTC, in milliseconds.
    pub first_seen: String,
    pub last_seen: String,
    pub shown: Shown,
}

/// One window of a windowed counter (`tallyd.window_totals`).
#[derive(Debug, Clone)]
pub struct WindowTotal {
    /// The window's start, Unix ms.
    pub start: i64,
    pub count: String,
    pub shown: Shown,
}

/// Which windows to read: those starting in `[from, to]` (Unix ms), the latest `limit` of them.
#[derive(Debug, Clone, Copy)]
pub struct Range {
    pub from: i64,
    pub to: i64,
    pub limit: i64,
}

/// `key`'s all-time total in `counter`; `None` without a row.
pub async fn total(client: &Client, counter: &str, key: &str) -> Result<Option<Total>, ReadError> {
    const TS: &str = "'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'";
    let row = client
        .query_typed_opt(
            &format!(
                // exact_count: `count` is NULL for a total beyond the 64-bit range.
                "SELECT exact_count::text, to_char(first_seen AT TIME ZONE 'UTC', {TS}), \
                        to_char(last_seen AT TIME ZONE 'UTC', {TS}), kind, value::text \
                 FROM tallyd.totals WHERE counter = $1 AND key = $2"
            ),
            &[(&counter, Type::TEXT), (&key, Type::TEXT)],
        )
        .await?;
    let Some(r) = row else {
        return Ok(None);
    };
    let shown = shown(client, (counter, key), ("all", None), r.get(3), r.get(4)).await?;
    Ok(Some(Total {
        count: r.get(0),
        first_seen: r.get(1),
        last_seen: r.get(2),
        shown,
    }))
}

/// The windows of `key` in `counter`'s `span` that `range` asks for, oldest first.
pub async fn windows(
    client: &Client,
    (counter, key): (&str, &str),
    span: &str,
    range: Range,
) -> Result<Vec<WindowTotal>, ReadError> {
    let rows = client
        .query_typed(
            &format!(
                "SELECT w, exact_count::text, kind, value::text FROM ( \
                     SELECT {win} AS w, exact_count, kind, value FROM tallyd.window_totals \
                     WHERE counter = $1 AND key = $2 AND span = $3) t \
                 WHERE w >= $4 AND w <= $5 ORDER BY w DESC LIMIT $6",
                win = WIN_AS_MS.replace("win", "window_start")
            ),
            &[
                (&counter, Type::TEXT),
                (&key, Type::TEXT),
                (&span, Type::TEXT),
                (&range.from, Type::INT8),
                (&range.to, Type::INT8),
                (&range.limit, Type::INT8),
            ],
        )
        .await?;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows.iter().rev() {
        let start: i64 = row.get(0);
        let shown = shown(
            client,
            (counter, key),
            (span, Some(start)),
            row.get(2),
            row.get(3),
        )
        .await?;
        out.push(WindowTotal {
            start,
            count: row.get(1),
            shown,
        });
    }
    Ok(out)
}

/// What a row of `kind` shows after its count: its value, or for a unique counter the cardinality of the
/// window's (or, `window_ms` `None`, the all-time) sketch.
async fn shown(
    client: &Client,
    (counter, key): (&str, &str),
    (span, window_ms): (&str, Option<i64>),
    kind: String,
    value: Option<String>,
) -> Result<Shown, ReadError> {
    match Kind::named(&kind) {
        None | Some(Kind::Sum) => Ok(Shown::Sum),
        Some(Kind::Unique) => {
            let win = WIN_AS_MS.replace("win", "window_start");
            let cardinality: Option<i64> = client
                .query_typed_opt(
                    &format!(
                        "SELECT cardinality FROM tallyd.unique_totals \
                         WHERE counter = $1 AND key = $2 AND span = $3 AND {win} = $4"
                    ),
                    &[
                        (&counter, Type::TEXT),
                        (&key, Type::TEXT),
                        (&span, Type::TEXT),
                        (&window_ms.unwrap_or(i64::MIN), Type::INT8),
                    ],
                )
                .await?
                .map(|r| r.get(0));
            Ok(Shown::Unique(cardinality.unwrap_or(0)))
        }
        Some(kind) => Ok(Shown::Value(kind, value)),
    }
}

/// The type of the application's column `table.column`, as `format_type` names it.
async fn column_type(client: &Client, table: &str, column: &str) -> Result<String, ReadError> {
    let row = client
        .query_typed_one(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute \
             WHERE attrelid = to_regclass($1) AND attname = $2",
            &[(&table, Type::TEXT), (&column, Type::NAME)],
        )
        .await
        .map_err(|e| ReadError::Column {
            table: table.to_string(),
            column: column.to_string(),
            cause: e.into(),
        })?;
    Ok(row.get(0))
}

/// An all-time sum folded into the application's column: the column plus the slot rows not
/// folded yet.
pub async fn folded_sum(
    client: &Client,
    (counter, key): (&str, &str),
    into: &RollupInto,
) -> Result<String, ReadError> {
    let key_type = column_type(client, &into.table, &into.key_column).await?;
    let sql = format!(
        "SELECT (coalesce((SELECT {col}::numeric FROM {table} \
                 WHERE {keycol} = $2::text::{key_type}), 0) \
              + coalesce((SELECT sum(count) FROM tallyd.slots \
                 WHERE counter = $1 AND key = $2), 0))::text",
        col = quote_ident(&into.column),
        keycol = quote_ident(&into.key_column),
        table = quote_table(&into.table),
    );
    let row = client
        .query_typed_one(&sql, &[(&counter, Type::TEXT), (&key, Type::TEXT)])
        .await?;
    Ok(row.get(0))
}

/// A max, min or unique counter folded into the application's column: the column merged with
/// the slot rows not folded yet, as the rollup will merge them (`tallyd.rollup_into_kind`), as
/// text: the value, or a unique counter's cardinality. `None`: neither holds a value.
pub async fn folded_kind(
    client: &Client,
    (counter, key): (&str, &str),
    into: &RollupInto,
    kind: Kind,
) -> Result<Option<String>, ReadError> {
    let key_type = column_type(client, &into.table, &into.key_column).await?;
    let col = format!("u.{}", quote_ident(&into.column));
    let (ours, theirs) = (sql::Side::untimed(&col), sql::Side::untimed("p.v"));
    let (Some(pending), Some(merged)) = (sql::aggregate(kind), sql::pair(kind, ours, theirs))
    else {
        return Err(ReadError::NotFoldable {
            counter: counter.to_string(),
            kind,
        });
    };
    let shown = match kind {
        Kind::Unique => format!("round(hll_cardinality({merged}))::bigint::text"),
        _ => format!("({merged})::text"),
    };
    let sql = format!(
        "SELECT {shown} FROM (SELECT {pending} AS v FROM tallyd.slots \
             WHERE counter = $1 AND key = $2) p \
         LEFT JOIN {table} u ON u.{keycol} = $2::text::{key_type}",
        keycol = quote_ident(&into.key_column),
        table = quote_table(&into.table),
    );
    let row = client
        .query_typed_one(&sql, &[(&counter, Type::TEXT), (&key, Type::TEXT)])
        .await?;
    Ok(row.get(0))
}

/// The windows of `key` of a windowed counter folded into the application's `(key, window)`
/// rows, between `from` and `to` (Unix ms of window starts): each window its row's column plus
/// its slot rows not folded yet, read in one statement, by window start. A `date` window column
/// names the window by its first day.
pub async fn folded_windows(
    client: &Client,
    (counter, key): (&str, &str),
    window: &Window,
    into: &RollupInto,
    (from, to): (i64, i64),
) -> Result<BTreeMap<i64, i128>, ReadError> {
    let Some(window_column) = into.window_column.as_deref() else {
        return Err(ReadError::NoWindowColumn {
            counter: counter.to_string(),
        });
    };
    let key_type = column_type(client, &into.table, &into.key_column).await?;
    let by_date = column_type(client, &into.table, window_column).await? == "date";
    // Each window as Unix ms of its start: a date is the first instant of that day in the zone
    // (the window that holds it).
    let start_of_row = if by_date {
        format!(
            "(extract(epoch FROM ({} ::timestamp AT TIME ZONE $3)) * 1000)::bigint",
            quote_ident(window_column)
        )
    } else {
        format!(
            "(extract(epoch FROM {}) * 1000)::bigint",
            quote_ident(window_column)
        )
    };
    let sql = format!(
        "SELECT w, coalesce(sum(n), 0)::text FROM ( \
             SELECT {start_of_row} AS w, {col}::numeric AS n FROM {table} \
             WHERE {keycol} = $2::text::{key_type} \
             UNION ALL \
             SELECT {WIN_AS_MS}, count FROM tallyd.slots WHERE counter = $1 AND key = $2 AND span = $4 \
         ) t WHERE w >= $5 AND w <= $6 GROUP BY w",
        col = quote_ident(&into.column),
        keycol = quote_ident(&into.key_column),
        table = quote_table(&into.table),
    );
    let rows = client
        .query_typed(
            &sql,
            &[
                (&counter, Type::TEXT),
                (&key, Type::TEXT),
                (&window.zone_name(), Type::TEXT),
                (&window.span().name(), Type::TEXT),
                (&from, Type::INT8),
                (&to, Type::INT8),
            ],
        )
        .await?;
    // Grouped here by the window that holds each start: a date row's instant (local midnight
    // as PostgreSQL resolves it) and the window's own start differ where DST skips midnight.
    let mut counts: BTreeMap<i64, i128> = BTreeMap::new();
    for row in &rows {
        let (start, n): (i64, String) = (row.get(0), row.get(1));
        let n: i128 = n.parse().map_err(|_| ReadError::NotANumber {
            column: into.column.clone(),
            value: n.clone(),
        })?;
        *counts.entry(window.bounds(start).0).or_default() += n;
    }
    Ok(counts)
}

fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// A table name as config.toml writes it (`schema.table` or `table`), each part quoted.
fn quote_table(table: &str) -> String {
    table
        .split('.')
        .map(quote_ident)
        .collect::<Vec<_>>()
        .join(".")
}
