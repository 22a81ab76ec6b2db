//! `tallyd get`: one key's exact total, from the database its logical shard lives in (or the
//! application's `rollup_into` column plus the slot rows not folded yet).

use anyhow::{bail, Context, Result};
use tokio_postgres::types::Type;

use crate::config::{Config, DatabaseConfig};
use crate::protocol::{self, Kind, Line};
use crate::routing;
use crate::store::{Databases, DbError};
use crate::window::Window;

fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// Which windows of a windowed counter `get` shows.
#[derive(Debug, Default)]
pub struct Windows {
    /// The latest this many (when no range is given).
    pub last: u32,
    /// The windows holding `from` through `to` (either open).
    pub from: Option<String>,
    pub to: Option<String>,
}

/// Prints `counter`'s total for `key` (canonicalised by the counter's key type, as the daemon
/// does); for a windowed counter, the windows `windows` asks for, then the all-time total if
/// the counter keeps one.
pub async fn get(config: &Config, counter: &str, key: &str, windows: &Windows) -> Result<()> {
    let (counters, limits) = config.protocol();
    // A value after the key: every kind but a sum needs one to parse (`0` fits them all).
    let line = format!("{counter} {key} 0");
    let key = match protocol::parse_line(line.as_bytes(), &counters, &limits) {
        Ok(Line::Event(ev)) => ev.key.as_str().to_string(),
        Ok(_) => bail!("expected a counter and a key"),
        Err(reason) => bail!("{reason}"),
    };
    // The key's logical shard picks its database.
    let hash = routing::key_hash(routing::counter_seed(counter), key.as_bytes());
    let index = config.layout().database(hash);
    let db = Databases::connect_only(config)?.swap_remove(index);
    let embedded = config.database.databases()[index] == DatabaseConfig::EMBEDDED;
    let client = match db.connect().await {
        Ok(client) => client,
        // The private cluster runs only while tallyd does.
        Err(err) if embedded => {
            let dir = &config.daemon.data_dir;
            let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.clone());
            return Err(err).context(format!(
                "database {index} is \"embedded\": its PostgreSQL runs only while tallyd runs \
                 (on data_dir {}: is it running?)",
                dir.display()
            ));
        }
        Err(err) => return Err(err.into()),
    };
    let declared = config.counters.iter().find(|c| c.name == counter);
    let window = declared.map(|c| c.window()).transpose()?.flatten();
    if let (Some(into), Some(window)) = (declared.and_then(|c| c.rollup_into.as_ref()), &window) {
        // The window's rows are folded into the application's (key, window) rows; its `also`
        // rows (the all-time total) into tallyd.rollups, read below as for any windowed counter.
        show_folded_windows(&client, counter, &key, window, into, windows).await?;
        if !declared.is_some_and(|c| c.all_time()) {
            return Ok(());
        }
        return show_total(&client, counter, &key, "all").await;
    }
    if let Some(into) = declared.and_then(|c| c.rollup_into.as_ref()) {
        // Folded counts live in the application's column; the rest is still in slots.
        let key_type: String = client
            .query_typed_one(
                "SELECT format_type(atttypid, atttypmod) FROM pg_attribute \
                 WHERE attrelid = to_regclass($1) AND attname = $2",
                &[(&into.table, Type::TEXT), (&into.key_column, Type::NAME)],
            )
            .await
            .map_err(DbError::from)
            .with_context(|| format!("looking up {}.{}", into.table, into.key_column))?
            .get(0);
        let kind = declared.map_or(Kind::Sum, |c| c.kind);
        if kind != Kind::Sum {
            return show_folded_kind(&client, counter, &key, into, kind, &key_type).await;
        }
        let sql = format!(
            "SELECT (coalesce((SELECT {col}::numeric FROM {table} \
                     WHERE {keycol} = $2::text::{key_type}), 0) \
                  + coalesce((SELECT sum(count) FROM tallyd.slots \
                     WHERE counter = $1 AND key = $2), 0))::text",
            col = quote_ident(&into.column),
            keycol = quote_ident(&into.key_column),
            table = into
                .table
                .split('.')
                .map(quote_ident)
                .collect::<Vec<_>>()
                .join("."),
        );
        let count: String = client
            .query_typed_one(&sql, &[(&counter, Type::TEXT), (&key, Type::TEXT)])
            .await
            .map_err(DbError::from)?
            .get(0);
        println!(
            "{counter} {key} count={count} (column {}.{} plus unfolded slots)",
            into.table, into.column
        );
        return Ok(());
    }
    // A windowed counter: its windows, then its all-time total (if it keeps one) as `all`.
    let mut head = format!("{counter} {key}");
    if let Some(window) = &window {
        show_windows(&client, counter, &key, window, windows).await?;
        if !declared.is_some_and(|c| c.all_time()) {
            return Ok(());
        }
        head = "all".into();
    }
    show_total(&client, counter, &key, &head).await
}

/// Prints a max, min or unique counter's value for `key` folded into the application's column:
/// the column merged with the slot rows not folded yet, as the rollup will merge them.
async fn show_folded_kind(
    client: &tokio_postgres::Client,
    counter: &str,
    key: &str,
    into: &crate::config::RollupInto,
    kind: Kind,
    key_type: &str,
) -> Result<()> {
    let col = format!("u.{}", quote_ident(&into.column));
    let (pending, merged) = match kind {
        Kind::Max => ("max(value)", format!("GREATEST({col}, p.v)::text")),
        Kind::Min => ("min(value)", format!("LEAST({col}, p.v)::text")),
        _ => (
            "hll_union_agg(sketch::hll)",
            format!(
                "round(hll_cardinality(CASE WHEN {col} IS NULL THEN p.v WHEN p.v IS NULL \
                 THEN {col} ELSE hll_union({col}, p.v) END))::bigint::text"
            ),
        ),
    };
    let sql = format!(
        "SELECT {merged} FROM (SELECT {pending} AS v FROM tallyd.slots \
             WHERE counter = $1 AND key = $2) p \
         LEFT JOIN {table} u ON u.{keycol} = $2::text::{key_type}",
        keycol = quote_ident(&into.key_column),
        table = into
            .table
            .split('.')
            .map(quote_ident)
            .collect::<Vec<_>>()
            .join("."),
    );
    let value: Option<String> = client
        .query_typed_one(&sql, &[(&counter, Type::TEXT), (&key, Type::TEXT)])
        .await
        .map_err(DbError::from)?
        .get(0);
    println!(
        "{counter} {key} {kind}={} (column {}.{} plus unfolded slots)",
        value.as_deref().unwrap_or("none"),
        into.table,
        into.column
    );
    Ok(())
}

/// Prints the all-time total of `key` from `tallyd.totals`, after `head`.
async fn show_total(
    client: &tokio_postgres::Client,
    counter: &str,
    key: &str,
    head: &str,
) -> Result<()> {
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
        .await
        .map_err(DbError::from)?;
    match row {
        Some(r) => {
            let (count, first, last): (String, String, String) = (r.get(0), r.get(1), r.get(2));
            let shown = kind_shown(client, counter, key, "all", None, r.get(3), r.get(4)).await?;
            println!("{head} count={count}{shown} first_seen={first} last_seen={last}");
        }
        None => println!("{head} count=0"),
    }
    Ok(())
}

/// What a row of a kind other than sum shows after its count: ` max=42` (min, last), or
/// ` unique=1234` (the cardinality of the window's, or the all-time, sketch); nothing for a sum.
async fn kind_shown(
    client: &tokio_postgres::Client,
    counter: &str,
    key: &str,
    span: &str,
    window_ms: Option<i64>,
    kind: String,
    value: Option<String>,
) -> Result<String> {
    if kind != "unique" {
        return Ok(value.map_or(String::new(), |v| format!(" {kind}={v}")));
    }
    let win = crate::store::WIN_AS_MS.replace("win", "window_start");
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
        .await
        .map_err(DbError::from)?
        .map(|r| r.get(0));
    Ok(format!(" unique={}", cardinality.unwrap_or(0)))
}

/// Prints the windows of `key` that `which` asks for, oldest first, one line each.
async fn show_windows(
    client: &tokio_postgres::Client,
    counter: &str,
    key: &str,
    window: &Window,
    which: &Windows,
) -> Result<()> {
    let at = |text: &Option<String>| -> Result<Option<i64>> {
        text.as_deref()
            .map(|t| window.parse_instant(t).map(|ms| window.bounds(ms).0))
            .transpose()
            .map_err(anyhow::Error::msg)
    };
    let (from, to) = (at(&which.from)?, at(&which.to)?);
    let ranged = from.is_some() || to.is_some();
    let limit = if ranged {
        i64::MAX
    } else {
        i64::from(which.last)
    };
    let win = crate::store::WIN_AS_MS;
    let rows = client
        .query_typed(
            &format!(
                "SELECT w, exact_count::text, kind, value::text FROM ( \
                     SELECT {win} AS w, exact_count, kind, value FROM tallyd.window_totals \
                     WHERE counter = $1 AND key = $2 AND span = $3) t \
                 WHERE w >= $4 AND w <= $5 ORDER BY w DESC LIMIT $6",
                win = win.replace("win", "window_start")
            ),
            &[
                (&counter, Type::TEXT),
                (&key, Type::TEXT),
                (&window.span().name(), Type::TEXT),
                (&from.unwrap_or(i64::MIN + 1), Type::INT8),
                (&to.unwrap_or(i64::MAX), Type::INT8),
                (&limit, Type::INT8),
            ],
        )
        .await
        .map_err(DbError::from)?;
    println!(
        "{counter} {key} window={} time_zone={}",
        window.span(),
        window.zone_name()
    );
    if rows.is_empty() {
        println!("(no counts in these windows)");
    }
    let span = window.span().name();
    for row in rows.iter().rev() {
        let (start, count): (i64, String) = (row.get(0), row.get(1));
        let shown = kind_shown(
            client,
            counter,
            key,
            span,
            Some(start),
            row.get(2),
            row.get(3),
        )
        .await?;
        println!("{} count={count}{shown}", window.name_of(start));
    }
    Ok(())
}

/// The windows of `key` of a windowed counter folded into the application's `(key, window)`
/// rows: each window is its row's column plus its slot rows not folded yet, read in one
/// statement (one snapshot). A `date` window column names the window by its first day.
async fn show_folded_windows(
    client: &tokio_postgres::Client,
    counter: &str,
    key: &str,
    window: &Window,
    into: &crate::config::RollupInto,
    which: &Windows,
) -> Result<()> {
    let Some(window_column) = into.window_column.as_deref() else {
        bail!("{counter}: rollup_into of a windowed counter needs window_column");
    };
    let table = into
        .table
        .split('.')
        .map(quote_ident)
        .collect::<Vec<_>>()
        .join(".");
    let column_type = |column: &str| {
        let (table, column) = (into.table.clone(), column.to_string());
        async move {
            client
                .query_typed_one(
                    "SELECT format_type(atttypid, atttypmod) FROM pg_attribute \
                     WHERE attrelid = to_regclass($1) AND attname = $2",
                    &[(&table, Type::TEXT), (&column, Type::NAME)],
                )
                .await
                .map(|r| r.get::<_, String>(0))
                .map_err(DbError::from)
                .with_context(|| format!("looking up {table}.{column}"))
        }
    };
    let key_type = column_type(&into.key_column).await?;
    let by_date = column_type(window_column).await? == "date";
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
    let at = |text: &Option<String>| -> Result<Option<i64>> {
        text.as_deref()
            .map(|t| window.parse_instant(t).map(|ms| window.bounds(ms).0))
            .transpose()
            .map_err(anyhow::Error::msg)
    };
    let (from, to) = (at(&which.from)?, at(&which.to)?);
    let sql = format!(
        "SELECT w, coalesce(sum(n), 0)::text FROM ( \
             SELECT {start_of_row} AS w, {col}::numeric AS n FROM {table} \
             WHERE {keycol} = $2::text::{key_type} \
             UNION ALL \
             SELECT {win}, count FROM tallyd.slots WHERE counter = $1 AND key = $2 AND span = $4 \
         ) t WHERE w >= $5 AND w <= $6 GROUP BY w",
        col = quote_ident(&into.column),
        keycol = quote_ident(&into.key_column),
        win = crate::store::WIN_AS_MS,
    );
    let rows = client
        .query_typed(
            &sql,
            &[
                (&counter, Type::TEXT),
                (&key, Type::TEXT),
                (&window.zone_name(), Type::TEXT),
                (&window.span().name(), Type::TEXT),
                (&from.unwrap_or(i64::MIN + 1), Type::INT8),
                (&to.unwrap_or(i64::MAX), Type::INT8),
            ],
        )
        .await
        .map_err(DbError::from)?;
    // Grouped here by the window that holds each start: a date row's instant (local midnight
    // as PostgreSQL resolves it) and the window's own start differ where DST skips midnight.
    let mut counts: std::collections::BTreeMap<i64, i128> = Default::default();
    for row in &rows {
        let (start, n): (i64, String) = (row.get(0), row.get(1));
        let n: i128 = n
            .parse()
            .with_context(|| format!("{}: {n:?} is not a whole number", into.column))?;
        *counts.entry(window.bounds(start).0).or_default() += n;
    }
    let shown = if from.is_some() || to.is_some() {
        counts.len()
    } else {
        which.last as usize
    };
    println!(
        "{counter} {key} window={} time_zone={} (column {}.{} plus unfolded slots)",
        window.span(),
        window.zone_name(),
        into.table,
        into.column
    );
    if counts.is_empty() {
        println!("(no counts in these windows)");
    }
    let skip = counts.len().saturating_sub(shown);
    for (start, count) in counts.into_iter().skip(skip) {
        println!("{} count={count}", window.name_of(start));
    }
    Ok(())
}
