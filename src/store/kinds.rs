//! Counter kinds in the database: the hll extension where a unique counter is declared (and
//! only there), the `tallyd.unique_totals` view over its sketches, and the record of each
//! counter's kind and sketch parameters (`tallyd.counter_kinds`), so that a start whose config
//! changes them while rows remain is refused.

use tokio_postgres::types::Type;
use tokio_postgres::Client;

use crate::config::CounterConfig;
use crate::protocol::Kind;

/// Why a database cannot take the declared kinds.
#[derive(Debug, thiserror::Error)]
pub enum KindError {
    #[error(
        "counter {counter} is a unique counter, which needs the hll extension (postgresql-hll), \
         and this database does not have it: {cause}. Run `CREATE EXTENSION hll;` in this \
         database as a role allowed to (the package is postgresql-15-hll on Debian), or \
         declare no unique counter"
    )]
    NoExtension { counter: String, cause: String },
    #[error(
        "counter {counter} was declared {was} when its rows were written, and is now {now}: \
         {why}. Give the counter a new name, or delete its rows first (DELETE FROM \
         tallyd.slots WHERE counter = '{counter}'; DELETE FROM tallyd.rollups WHERE counter = \
         '{counter}')"
    )]
    Changed {
        counter: String,
        was: String,
        now: String,
        why: &'static str,
    },
}

/// The `tallyd.unique_totals` view: one row per (counter, key, span, window) of the unique
/// counters, its sketch the union of its slot and rollup rows, exact at any moment as
/// `tallyd.totals` is. Created at start where a unique counter is declared (it needs the
/// extension's functions), and replaced so it follows this version of tallyd.
const UNIQUE_TOTALS: &str = "\
CREATE OR REPLACE VIEW tallyd.unique_totals AS
SELECT counter, key, span, win AS window_start,
       hll_union_agg(sketch::hll) AS sketch,
       round(hll_cardinality(hll_union_agg(sketch::hll)))::bigint AS cardinality,
       sum(count) AS events,
       min(first_seen) AS first_seen,
       max(last_seen) AS last_seen
FROM (
    SELECT counter, key, span, win, sketch, count, first_seen, last_seen
    FROM tallyd.rollups WHERE sketch IS NOT NULL
    UNION ALL
    SELECT counter, key, span, win, sketch, count, first_seen, last_seen
    FROM tallyd.slots WHERE sketch IS NOT NULL
) AS parts
GROUP BY counter, key, span, win";

/// How a counter is recorded: its kind, with a unique counter's log2m and regwidth.
fn declared(c: &CounterConfig) -> (String, Option<i32>, Option<i32>) {
    let params = c.sketch_params();
    (
        c.kind.name().to_string(),
        params.map(|p| p.log2m() as i32),
        params.map(|p| p.regwidth() as i32),
    )
}

fn shown(kind: &str, log2m: Option<i32>, regwidth: Option<i32>) -> String {
    match (log2m, regwidth) {
        (Some(l), Some(r)) => format!("{kind} (log2m {l}, regwidth {r})"),
        _ => kind.to_string(),
    }
}

/// Checks and records `counters`' kinds, and where one is unique, the extension (created if
/// this role may: the private cluster's role may) and the view. Under the migration lock.
pub(super) async fn prepare(
    client: &Client,
    counters: &[CounterConfig],
) -> Result<(), super::StoreError> {
    if let Some(unique) = counters.iter().find(|c| c.kind == Kind::Unique) {
        // Unnamed (one round trip), as every statement outside a transaction: through a
        // transaction pooler a named one may be prepared on one server connection and run on
        // another.
        let installed: bool = client
            .query_typed_one(
                "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'hll')",
                &[],
            )
            .await?
            .get(0);
        if !installed {
            if let Err(err) = client
                .batch_execute("CREATE EXTENSION IF NOT EXISTS hll")
                .await
            {
                // The server's hint ends its sentence; the message goes on after it.
                let cause = crate::store::DbError::from(err).to_string();
                let cause = cause.trim_end_matches('.').to_string();
                return Err(KindError::NoExtension {
                    counter: unique.name.clone(),
                    cause,
                }
                .into());
            }
        }
        client.batch_execute(UNIQUE_TOTALS).await?;
    }
    for c in counters {
        let (kind, log2m, regwidth) = declared(c);
        let row = client
            .query_typed_one(
                "WITH found AS (
                     SELECT EXISTS (SELECT 1 FROM tallyd.slots s WHERE s.counter = $1)
                            OR EXISTS (SELECT 1 FROM tallyd.rollups r WHERE r.counter = $1) AS rows
                 ), added AS (
                     INSERT INTO tallyd.counter_kinds (counter, kind, log2m, regwidth)
                     SELECT $1, CASE WHEN f.rows THEN 'sum' ELSE $2 END,
                            CASE WHEN f.rows THEN NULL ELSE $3 END,
                            CASE WHEN f.rows THEN NULL ELSE $4 END
                     FROM found f
                     ON CONFLICT (counter) DO NOTHING RETURNING kind, log2m, regwidth)
                 SELECT k.kind, k.log2m, k.regwidth, f.rows
                 FROM tallyd.counter_kinds k, found f WHERE k.counter = $1
                 UNION ALL SELECT a.kind, a.log2m, a.regwidth, f.rows FROM added a, found f",
                &[
                    (&c.name, Type::TEXT),
                    (&kind, Type::TEXT),
                    (&log2m, Type::INT4),
                    (&regwidth, Type::INT4),
                ],
            )
            .await?;
        let (was, was_log2m, was_regwidth, rows): (String, Option<i32>, Option<i32>, bool) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        if (was.as_str(), was_log2m, was_regwidth) == (kind.as_str(), log2m, regwidth) {
            continue;
        }
        // A counter without a record is recorded above as declared, unless rows of it remain:
        // those were written before kinds existed (migrations/V12), so they are sums, and it is
        // recorded as a sum. Recording the declared kind there would accept it now, and at
        // every later start.
        let only_sums_before = was == "sum";
        if rows {
            let why = if was == kind {
                "sketches of different parameters cannot be unioned"
            } else if only_sums_before {
                "its rows hold sums, which are not values or sketches"
            } else {
                "its rows hold another kind's values"
            };
            return Err(KindError::Changed {
                counter: c.name.clone(),
                was: shown(&was, was_log2m, was_regwidth),
                now: shown(&kind, log2m, regwidth),
                why,
            }
            .into());
        }
        client
            .execute_typed(
                "UPDATE tallyd.counter_kinds SET kind = $2, log2m = $3, regwidth = $4
                 WHERE counter = $1",
                &[
                    (&c.name, Type::TEXT),
                    (&kind, Type::TEXT),
                    (&log2m, Type::INT4),
                    (&regwidth, Type::INT4),
                ],
            )
            .await?;
    }
    Ok(())
}
