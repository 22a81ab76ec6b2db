//! SQL on a test's database: a session by connection string, and the reads of `tallyd.totals`
//! the tests assert on, written once so that every test sums a counter the same way.

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

/// The single bigint `query` returns (a count, a sum cast to bigint).
pub async fn scalar(client: &Client, query: &str) -> i64 {
    client
        .query_one(query, &[])
        .await
        .unwrap_or_else(|e| panic!("{query}: {e}"))
        .get(0)
}

/// The two bigints `query` returns, e.g. `SELECT count(*), sum(count)::bigint ...`.
pub async fn scalar_pair(client: &Client, query: &str) -> (i64, i64) {
    let row = client
        .query_one(query, &[])
        .await
        .unwrap_or_else(|e| panic!("{query}: {e}"));
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
