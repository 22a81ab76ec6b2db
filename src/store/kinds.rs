//! Counter kinds in the database: the hll extension where a unique counter is declared (and
//! only there), the `tallyd.unique_totals` view over its sketches, and the check that a
//! counter's stored rows are of the kind (and a unique counter's sketches of the precision)
//! the config declares, read from the rows themselves, so that no start writes one kind onto
//! another.

use tokio_postgres::types::Type;
use tokio_postgres::Client;

use crate::config::CounterConfig;
use crate::hll::Sketch;
use crate::kind::{sql, Kind};

/// Why a database cannot take the declared kinds.
#[derive(Debug, thiserror::Error)]
pub enum KindError {
    #[error(
        "counter {counter} is a unique counter, which needs the hll extension (postgresql-hll) \
         in database {database}, and {why}: run `CREATE EXTENSION hll;` there as a role allowed \
         to (the package is postgresql-15-hll on Debian), or declare no unique counter"
    )]
    NoExtension {
        counter: String,
        database: String,
        why: String,
    },
    #[error(
        "counter {counter} is declared {now}, but its rows in the database hold {was}: {why}. \
         Give the counter a new name, or delete its rows first (DELETE FROM tallyd.slots WHERE \
         counter = '{counter}'; DELETE FROM tallyd.rollups WHERE counter = '{counter}')"
    )]
    Changed {
        counter: String,
        was: String,
        now: String,
        why: &'static str,
    },
}

/// The `tallyd.unique_totals` view: one row per (counter, key, span, window) of the unique
/// counters, its sketch the union of its slot and rollup rows (the aggregate form of the
/// unique merge, [`sql::aggregate`]), exact at any moment as `tallyd.totals` is. Created at
/// start where a unique counter is declared (it needs the extension's functions), and replaced
/// so it follows this version of tallyd.
fn unique_totals() -> String {
    let union = sql::aggregate(Kind::Unique).expect("unique merges");
    format!(
        "\
CREATE OR REPLACE VIEW tallyd.unique_totals AS
SELECT counter, key, span, win AS window_start,
       {union} AS sketch,
       round(hll_cardinality({union}))::bigint AS cardinality,
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
GROUP BY counter, key, span, win"
    )
}

/// Makes `tallyd.unique_totals` again where it is missing and the extension is back (a `DROP
/// EXTENSION hll CASCADE` took the view with it): the flush calls it when the unique rows it
/// held back can be written again. Returns whether it made the view.
pub async fn restore_unique_totals(client: &Client) -> Result<bool, tokio_postgres::Error> {
    let missing: bool = client
        .query_typed_one(
            "SELECT to_regclass('tallyd.unique_totals') IS NULL \
                    AND EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'hll')",
            &[],
        )
        .await?
        .get(0);
    if missing {
        client.batch_execute(&unique_totals()).await?;
    }
    Ok(missing)
}

/// Where a unique counter is declared: the extension (created if `create` and this role may:
/// the private cluster's role may) and, with `create`, the view. Then every counter's stored
/// rows checked against its declared kind. Under the migration lock when `create`; read-only
/// otherwise (`database.migrate = false`).
pub(super) async fn prepare(
    client: &Client,
    counters: &[CounterConfig],
    create: bool,
) -> Result<(), super::StoreError> {
    if let Some(unique) = counters.iter().find(|c| c.kind == Kind::Unique) {
        // An unnamed statement (one round trip): a transaction pooler may run each on another
        // server connection, where a named one would not exist.
        let row = client
            .query_typed_one(
                "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'hll'), \
                        current_database()",
                &[],
            )
            .await?;
        let (installed, database): (bool, String) = (row.get(0), row.get(1));
        let refused = |why: String| KindError::NoExtension {
            counter: unique.name.clone(),
            database: database.clone(),
            why,
        };
        if !installed && !create {
            return Err(
                refused("database.migrate = false, so tallyd does not create it".into()).into(),
            );
        }
        if !installed {
            if let Err(err) = client
                .batch_execute("CREATE EXTENSION IF NOT EXISTS hll")
                .await
            {
                let cause = crate::store::DbError::from(err).to_string();
                let cause = cause.trim_end_matches('.');
                return Err(refused(format!("creating it failed: {cause}")).into());
            }
        }
        if create {
            client.batch_execute(&unique_totals()).await?;
        }
    }
    for c in counters {
        check_rows(client, c).await?;
    }
    Ok(())
}

/// Checks `c`'s stored rows (one of them: a counter's rows are all of one kind) against its
/// declared kind, and a unique counter's sketch against its precision.
async fn check_rows(client: &Client, c: &CounterConfig) -> Result<(), super::StoreError> {
    let row = client
        .query_typed_opt(
            "(SELECT kind, sketch FROM tallyd.slots WHERE counter = $1 LIMIT 1)
             UNION ALL
             (SELECT kind, sketch FROM tallyd.rollups WHERE counter = $1 LIMIT 1)
             LIMIT 1",
            &[(&c.name, Type::TEXT)],
        )
        .await?;
    let Some(row) = row else {
        return Ok(());
    };
    let (kind, sketch): (Option<String>, Option<Vec<u8>>) = (row.get(0), row.get(1));
    let was = kind.unwrap_or_else(|| "sum".into());
    let changed = |was: String, now: String, why| KindError::Changed {
        counter: c.name.clone(),
        was,
        now,
        why,
    };
    if was != c.kind.name() {
        let why = if was == "sum" {
            "sums are not values or sketches"
        } else {
            "a kind's rows cannot be read as another kind's"
        };
        return Err(changed(format!("{was} rows"), c.kind.to_string(), why).into());
    }
    let (Some(bytes), Some(params)) = (sketch, c.sketch_params()) else {
        return Ok(());
    };
    let stored = Sketch::from_bytes(&bytes).map(|s| s.params());
    let refused = match stored {
        Ok(p) if (p.log2m(), p.regwidth()) == (params.log2m(), params.regwidth()) => return Ok(()),
        Ok(p) => changed(
            format!("sketches of log2m {}, regwidth {}", p.log2m(), p.regwidth()),
            format!(
                "unique (log2m {}, regwidth {})",
                params.log2m(),
                params.regwidth()
            ),
            "sketches of different parameters cannot be unioned",
        ),
        Err(e) => changed(
            format!("a sketch that cannot be read ({e})"),
            c.kind.to_string(),
            "a damaged sketch cannot be unioned",
        ),
    };
    Err(refused.into())
}
