//! SQL on a test's database: a session by connection string, and the reads of tallyd's views
//! (`tallyd.totals`, `window_totals`, `unique_totals`) and tables the tests assert on, written
//! once so that every test sums a counter, and tells "no row" from 0, the same way.

use std::collections::BTreeMap;
use std::time::Duration;

use tallyd::store::Db;
use tokio_postgres::Client;

/// A [`Db`] on `conninfo` (a URL or a libpq string), as tests open one: a 5 s connect timeout.
pub fn db(conninfo: &str) -> Db {
    Db::new(conninfo, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("connection string {conninfo:?}: {e}"))
}

/// A session on `conninfo`.
pub async fn sql(conninfo: &str) -> Client {
    let db = db(conninfo);
    db.connect()
        .await
        .unwrap_or_else(|e| panic!("connect to {}: {e}", db.name()))
}

/// A PostgreSQL error as a test failure shows it: the server's message and SQLSTATE (with its
/// detail), where `Display` says only "db error".
pub fn db_error(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!(
            "{} ({}){}",
            db.message(),
            db.code().code(),
            db.detail().map(|d| format!(": {d}")).unwrap_or_default()
        ),
        None => e.to_string(),
    }
}

/// The single bigint `query` returns (a count, a sum cast to bigint).
pub async fn scalar(client: &Client, query: &str) -> i64 {
    client
        .query_one(query, &[])
        .await
        .unwrap_or_else(|e| panic!("{query}: {}", db_error(&e)))
        .get(0)
}

/// The two bigints `query` returns, e.g. `SELECT count(*), sum(count)::bigint ...`.
pub async fn scalar_pair(client: &Client, query: &str) -> (i64, i64) {
    let row = client
        .query_one(query, &[])
        .await
        .unwrap_or_else(|e| panic!("{query}: {}", db_error(&e)));
    (row.get(0), row.get(1))
}

/// The total of `counter` over all its keys in `tallyd.totals` (0 when it has none).
pub async fn counter_total(client: &Client, counter: &str) -> i64 {
    client
        .query_one(
            "SELECT coalesce(sum(count), 0)::bigint FROM tallyd.totals WHERE counter = $1",
            &[&counter],
        )
        .await
        .unwrap_or_else(|e| panic!("total of {counter}: {e}"))
        .get(0)
}

/// The total of one key of `counter` (0 when absent).
pub async fn key_total(client: &Client, counter: &str, key: &str) -> i64 {
    client
        .query_one(
            "SELECT coalesce(sum(count), 0)::bigint FROM tallyd.totals \
             WHERE counter = $1 AND key = $2",
            &[&counter, &key],
        )
        .await
        .unwrap_or_else(|e| panic!("total of {counter} {key:?}: {e}"))
        .get(0)
}

/// (total, keys) of `counter`: its sum over all keys (0 when none) and how many keys it has.
pub async fn total_and_keys(client: &Client, counter: &str) -> (i64, i64) {
    let row = client
        .query_one(
            "SELECT coalesce(sum(count), 0)::bigint, count(*) FROM tallyd.totals \
             WHERE counter = $1",
            &[&counter],
        )
        .await
        .unwrap_or_else(|e| panic!("totals of {counter}: {e}"));
    (row.get(0), row.get(1))
}

/// Every (key, count) of `counter`, in key order.
pub async fn counts(client: &Client, counter: &str) -> Vec<(String, i64)> {
    client
        .query(
            "SELECT key, count FROM tallyd.totals WHERE counter = $1 ORDER BY key",
            &[&counter],
        )
        .await
        .unwrap_or_else(|e| panic!("counts of {counter}: {e}"))
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// The total of `counter` summed over several databases (the shards of one tallyd).
pub async fn counter_total_over(conninfos: &[String], counter: &str) -> i64 {
    let mut sum = 0;
    for conninfo in conninfos {
        sum += counter_total(&sql(conninfo).await, counter).await;
    }
    sum
}

/// Every (key, count) of `counter`, one list per database of `conninfos`, in their order.
pub async fn counts_per_database(conninfos: &[String], counter: &str) -> Vec<Vec<(String, i64)>> {
    let mut out = Vec::new();
    for conninfo in conninfos {
        out.push(counts(&sql(conninfo).await, counter).await);
    }
    out
}

/// One key's `count` in tallyd.totals: `None` when the key has no row (never counted, or
/// forgotten), where [`key_total`] says 0; `None` too for a total beyond 64 bits (`count` is
/// NULL then: read `exact_count`).
pub async fn count_of(client: &Client, counter: &str, key: &str) -> Option<i64> {
    total_row(client, counter, key)
        .await
        .and_then(|(count, _)| count)
}

/// One key's kept value (max, min, last) in tallyd.totals: `None` when the key has no row (or,
/// for a sum or unique counter, always).
pub async fn value_of(client: &Client, counter: &str, key: &str) -> Option<i64> {
    total_row(client, counter, key)
        .await
        .and_then(|(_, value)| value)
}

/// One key's row of tallyd.totals as (`count`, `value`), `None` without a row: `count` is NULL
/// beyond 64 bits, `value` for sums and unique counters.
pub async fn total_row(
    client: &Client,
    counter: &str,
    key: &str,
) -> Option<(Option<i64>, Option<i64>)> {
    client
        .query_opt(
            "SELECT count, value FROM tallyd.totals WHERE counter = $1 AND key = $2",
            &[&counter, &key],
        )
        .await
        .unwrap_or_else(|e| panic!("the row of {counter} {key:?}: {e}"))
        .map(|r| (r.get(0), r.get(1)))
}

/// Rows of one key of `counter` anywhere tallyd keeps them: slots, rollups and the rows the
/// rollup holds back (0 once it is forgotten).
pub async fn rows_of(client: &Client, counter: &str, key: &str) -> i64 {
    rows_where(client, "counter = $1 AND key = $2", &[&counter, &key]).await
}

/// Rows of one key in every counter, anywhere tallyd keeps them (as [`rows_of`]).
pub async fn rows_of_key(client: &Client, key: &str) -> i64 {
    rows_where(client, "key = $1", &[&key]).await
}

async fn rows_where(
    client: &Client,
    filter: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> i64 {
    let query = format!(
        "SELECT (SELECT count(*) FROM tallyd.slots WHERE {filter}) \
              + (SELECT count(*) FROM tallyd.rollups WHERE {filter}) \
              + (SELECT count(*) FROM tallyd.rollup_rejects WHERE {filter})"
    );
    client
        .query_one(&query, params)
        .await
        .unwrap_or_else(|e| panic!("{query}: {}", db_error(&e)))
        .get(0)
}

/// Every window of one key of a windowed counter in tallyd.window_totals, as
/// (span, window start as RFC 3339 in UTC, see [`utc`]) -> count: a window without a row is
/// absent, not 0.
pub async fn windows_of(
    client: &Client,
    counter: &str,
    key: &str,
) -> BTreeMap<(String, String), i64> {
    client
        .query(
            "SELECT span, to_char(window_start AT TIME ZONE 'UTC', \
                                  'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), count \
             FROM tallyd.window_totals WHERE counter = $1 AND key = $2",
            &[&counter, &key],
        )
        .await
        .unwrap_or_else(|e| panic!("the windows of {counter} {key:?}: {e}"))
        .iter()
        .map(|r| ((r.get(0), r.get(1)), r.get(2)))
        .collect()
}

/// `ms` (Unix milliseconds) as RFC 3339 in UTC to the second, as [`windows_of`] shows a window's
/// start: the inverse of [`crate::unix_ms`] for whole seconds.
pub fn utc(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms)
        .unwrap_or_else(|e| panic!("{ms} ms: {e}"))
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// One row of tallyd.unique_totals: the sketch's cardinality, the sketch as text (byte for
/// byte what the extension prints) and the events it took.
pub type SketchRow = (i64, String, i64);

/// One key's sketch in tallyd.unique_totals: its all-time row (`window` `None`), or the window
/// of `span` starting at Unix ms `start`; `None` without a row.
pub async fn sketch_of(
    client: &Client,
    counter: &str,
    key: &str,
    window: Option<(&str, i64)>,
) -> Option<SketchRow> {
    let (span, start) = window.map_or(("all", None), |(span, start)| (span, Some(start)));
    client
        .query_opt(
            "SELECT cardinality, sketch::text, events::bigint FROM tallyd.unique_totals \
             WHERE counter = $1 AND key = $2 AND span = $3 \
               AND ($4::bigint IS NULL \
                    OR window_start = 'epoch'::timestamptz + $4::bigint * interval '1 millisecond')",
            &[&counter, &key, &span, &start],
        )
        .await
        .unwrap_or_else(|e| panic!("the sketch of {counter} {key:?} {window:?}: {e}"))
        .map(|r| (r.get(0), r.get(1), r.get(2)))
}

/// The extension's own sketch of `values` (`hll_add_agg(hll_hash_text(v), log2m, regwidth)`):
/// (cardinality, sketch as text), to compare with [`sketch_of`] byte for byte.
pub async fn sql_sketch<S: AsRef<str>>(
    client: &Client,
    values: impl IntoIterator<Item = S>,
    (log2m, regwidth): (i32, i32),
) -> (i64, String) {
    let values: Vec<String> = values.into_iter().map(|v| v.as_ref().to_string()).collect();
    let row = client
        .query_one(
            "SELECT round(hll_cardinality(s))::bigint, s::text FROM \
             (SELECT hll_add_agg(hll_hash_text(v), $2, $3) AS s FROM unnest($1::text[]) v) x",
            &[&values, &log2m, &regwidth],
        )
        .await
        .unwrap_or_else(|e| panic!("the extension's sketch of {} values: {e}", values.len()));
    (row.get(0), row.get(1))
}
