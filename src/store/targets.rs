//! The `rollup_into` targets: each checked against the application's table and recorded in
//! `tallyd.rollup_targets`, where `tallyd.rollup()` (run by anyone) reads how to fold the counter
//! (migrations/V2, V11).

use tokio_postgres::Transaction;

use super::DbError;
use crate::config::{Constant, CounterConfig, RollupInto};
use crate::kind::Kind;
use crate::window::Span;

#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("counter {counter}: rollup_into table {table} does not exist")]
    NoTable { counter: String, table: String },
    #[error("counter {counter}: rollup_into table {table} has no column {column}")]
    NoColumn {
        counter: String,
        table: String,
        column: String,
    },
    #[error(
        "counter {counter}: rollup_into window_column {table}.{column} is {found}: it must be a \
         date (the window's first day, for day, week or month windows) or a timestamptz (the \
         window's first instant)"
    )]
    WindowType {
        counter: String,
        table: String,
        column: String,
        found: String,
    },
    #[error(
        "counter {counter}: rollup_into window_column {table}.{column} is a date, which cannot \
         hold {span} windows: use a timestamptz column (or a day, week or month window)"
    )]
    DateWindow {
        counter: String,
        table: String,
        column: String,
        span: Span,
    },
    #[error(
        "counter {counter}: the database does not know time_zone {zone:?}, which the rollup \
         needs to turn windows into the dates of {table}.{column}: {cause}"
    )]
    Zone {
        counter: String,
        zone: String,
        table: String,
        column: String,
        cause: Box<DbError>,
    },
    #[error(
        "counter {counter}: rollup_into insert_missing needs a unique index or constraint on \
         exactly ({key_column}, {window_column}) of {table}, not deferrable and without WHERE, \
         for INSERT ... ON CONFLICT: CREATE UNIQUE INDEX ON {table} ({key_column}, {window_column})"
    )]
    NoUniqueKey {
        counter: String,
        table: String,
        key_column: String,
        window_column: String,
    },
    #[error(
        "counter {counter}: {table}.{column} is NOT NULL without a default: insert_missing \
         cannot insert rows (give the column a default, or set insert_missing = false)"
    )]
    NotNullWithoutDefault {
        counter: String,
        table: String,
        column: String,
    },
    #[error("counter {counter}: {reason}")]
    Citus { counter: String, reason: String },
    #[error(
        "counter {counter}: rollup_into column {table}.{column} is {found}: a {kind} counter \
         folds into {wanted}"
    )]
    KindColumn {
        counter: String,
        table: String,
        column: String,
        kind: Kind,
        found: String,
        wanted: &'static str,
    },
    #[error(
        "counter {counter}: rollup_into.on_add.{column} = {value} cannot be written into \
         {table}.{column}, which is {found}: {reason}",
        table = refusal.table,
        value = refusal.value,
        found = refusal.found,
        reason = refusal.reason,
    )]
    OnAdd {
        counter: String,
        column: String,
        refusal: Box<OnAddRefusal>,
    },
    #[error(transparent)]
    Postgres(#[from] DbError),
}

/// Why an `on_add` constant was refused: the table, the constant as written, the column's type
/// and the reason.
#[derive(Debug)]
pub struct OnAddRefusal {
    table: String,
    value: String,
    found: String,
    reason: String,
}

impl From<tokio_postgres::Error> for TargetError {
    fn from(err: tokio_postgres::Error) -> TargetError {
        TargetError::Postgres(err.into())
    }
}

/// Records which counters fold into application tables (`rollup_into`), checking each table
/// and its columns, so that `tallyd.rollup()` (run by anyone) folds them the same way. In one
/// transaction: a refused target records nothing.
pub async fn sync_rollup_targets(
    client: &mut tokio_postgres::Client,
    counters: &[CounterConfig],
) -> Result<(), TargetError> {
    let tx = client.transaction().await?;
    tx.execute("DELETE FROM tallyd.rollup_targets", &[]).await?;
    for c in counters {
        let Some(into) = &c.rollup_into else { continue };
        let oid = check(&tx, c, into).await?;
        let span = c.window.map_or("all", Span::name);
        tx.execute(
            "INSERT INTO tallyd.rollup_targets \
             (counter, target, key_column, count_column, window_column, span, time_zone, insert_missing, kind, on_add) \
             VALUES ($1, $2::oid::regclass, $3, $4, $5, $6, $7, $8, $9, $10::text::jsonb)",
            &[
                &c.name,
                &oid,
                &into.key_column,
                &into.column,
                &into.window_column,
                &span,
                &c.time_zone(),
                &into.insert_missing,
                &c.kind.name(),
                &serde_json::to_string(&into.on_add).expect("constants serialize"),
            ],
        )
        .await?;
    }
    // Each target's rollup step, generated for its table, columns and types (migrations/V14),
    // and none for a target no longer recorded.
    tx.execute("SELECT tallyd.install_rollup_targets()", &[])
        .await?;
    // Keys held by a foreign key are only kept back (and reported) for insert_missing targets.
    tx.execute(
        "DELETE FROM tallyd.rollup_held h WHERE NOT EXISTS \
         (SELECT 1 FROM tallyd.rollup_targets r WHERE r.counter = h.counter AND r.insert_missing)",
        &[],
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Checks `counter`'s target `into` against the database; returns the table's oid.
async fn check(
    tx: &Transaction<'_>,
    counter: &CounterConfig,
    into: &RollupInto,
) -> Result<u32, TargetError> {
    let name = || counter.name.clone();
    let table = || into.table.clone();
    let found = tx
        .query_opt("SELECT to_regclass($1)::oid", &[&into.table])
        .await?
        .and_then(|r| r.get::<_, Option<u32>>(0));
    let Some(oid) = found else {
        return Err(TargetError::NoTable {
            counter: name(),
            table: table(),
        });
    };
    let columns = [
        Some(&into.key_column),
        Some(&into.column),
        into.window_column.as_ref(),
    ];
    for column in columns.into_iter().flatten().chain(into.on_add.keys()) {
        let exists = tx
            .query_opt(
                "SELECT 1 FROM pg_attribute WHERE attrelid = $1 AND attname = $2 AND attnum > 0 AND NOT attisdropped",
                &[&oid, column],
            )
            .await?
            .is_some();
        if !exists {
            return Err(TargetError::NoColumn {
                counter: name(),
                table: table(),
                column: column.clone(),
            });
        }
    }
    check_on_add(tx, oid, counter, into).await?;
    if counter.kind != Kind::Sum {
        let found: String = tx
            .query_one(
                "SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = $1 AND attname = $2",
                &[&oid, &into.column],
            )
            .await?
            .get(0);
        let (ok, wanted) = match counter.kind {
            Kind::Unique => (found == "hll" || found.starts_with("hll("), "an hll column"),
            _ => (
                found == "bigint" || found.starts_with("numeric"),
                "a bigint or numeric column (every 64-bit value fits)",
            ),
        };
        if !ok {
            return Err(TargetError::KindColumn {
                counter: name(),
                table: table(),
                column: into.column.clone(),
                kind: counter.kind,
                found,
                wanted,
            });
        }
    }
    let (Some(window_column), Some(span)) = (&into.window_column, counter.window) else {
        return Ok(oid);
    };
    let distributed: bool = tx
        .query_one("SELECT tallyd.is_distributed('tallyd.slots')", &[])
        .await?
        .get(0);
    if distributed {
        return Err(TargetError::Citus {
            counter: name(),
            reason: super::citus::WINDOWED_ROLLUP_INTO.into(),
        });
    }
    let window_type: String = tx
        .query_one(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = $1 AND attname = $2",
            &[&oid, window_column],
        )
        .await?
        .get(0);
    match window_type.as_str() {
        "timestamp with time zone" => {}
        "date" if matches!(span, Span::Day | Span::Week | Span::Month) => {
            // The rollup turns windows into dates in the counter's zone, by the server's zones.
            if let Err(err) = tx
                .query_one("SELECT now() AT TIME ZONE $1", &[&counter.time_zone()])
                .await
            {
                return Err(TargetError::Zone {
                    counter: name(),
                    zone: counter.time_zone().to_string(),
                    table: table(),
                    column: window_column.clone(),
                    cause: Box::new(err.into()),
                });
            }
        }
        "date" => {
            return Err(TargetError::DateWindow {
                counter: name(),
                table: table(),
                column: window_column.clone(),
                span,
            })
        }
        _ => {
            return Err(TargetError::WindowType {
                counter: name(),
                table: table(),
                column: window_column.clone(),
                found: window_type,
            })
        }
    }
    if into.insert_missing {
        check_insertable(tx, oid, counter, into, window_column).await?;
    }
    Ok(oid)
}

/// Each `on_add` constant against its column: a boolean only into a boolean column, an integer
/// only into a number, and the value must be one the column's type reads (its range, a domain's
/// check, an enum's labels). Not on Citus, whose rollup (migrations/V13) does not write them.
async fn check_on_add(
    tx: &Transaction<'_>,
    oid: u32,
    counter: &CounterConfig,
    into: &RollupInto,
) -> Result<(), TargetError> {
    if into.on_add.is_empty() {
        return Ok(());
    }
    let distributed: bool = tx
        .query_one("SELECT tallyd.is_distributed('tallyd.slots')", &[])
        .await?
        .get(0);
    if distributed {
        return Err(TargetError::Citus {
            counter: counter.name.clone(),
            reason: "rollup_into.on_add is not supported on Citus: the distributed rollup does \
                     not write it (remove on_add)"
                .into(),
        });
    }
    for (column, value) in &into.on_add {
        let row = tx
            .query_one(
                "SELECT format_type(a.atttypid, a.atttypmod), t.typcategory::text, \
                        a.attgenerated <> '' OR a.attidentity = 'a' \
                 FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid \
                 WHERE a.attrelid = $1 AND a.attname = $2",
                &[&oid, column],
            )
            .await?;
        let found: String = row.get(0);
        let category: String = row.get(1);
        let unwritable: bool = row.get(2);
        let refuse = |reason: String| TargetError::OnAdd {
            counter: counter.name.clone(),
            column: column.clone(),
            refusal: Box::new(OnAddRefusal {
                table: into.table.clone(),
                value: match value {
                    Constant::Text(t) => format!("{t:?}"),
                    other => other.text(),
                },
                found: found.clone(),
                reason,
            }),
        };
        if unwritable {
            return Err(refuse(
                "a generated or GENERATED ALWAYS identity column cannot be set".into(),
            ));
        }
        let fits = match value {
            Constant::Bool(_) => category == "B",
            Constant::Int(_) => category == "N",
            Constant::Text(_) => true,
        };
        if !fits {
            return Err(refuse(format!(
                "{} fits no {found} column (give a value of the column's type)",
                value.what()
            )));
        }
        // The column's type reads the value (its range, a domain's check, an enum's labels), in
        // a savepoint so that a refusal leaves the transaction usable for the error.
        tx.batch_execute("SAVEPOINT on_add").await?;
        let read = tx
            .query_one(
                &format!("SELECT $1::text::{found} IS NOT NULL"),
                &[&value.text()],
            )
            .await;
        match read {
            Ok(_) => tx.batch_execute("RELEASE SAVEPOINT on_add").await?,
            Err(err) => {
                let reason = err
                    .as_db_error()
                    .map_or_else(|| err.to_string(), |db| db.message().to_string());
                tx.batch_execute("ROLLBACK TO SAVEPOINT on_add").await?;
                return Err(refuse(reason));
            }
        }
    }
    Ok(())
}

/// What `INSERT ... ON CONFLICT (key_column, window_column) DO UPDATE` needs of the table: a
/// unique index on exactly those columns that can arbitrate the conflict, and a default for
/// every other NOT NULL column.
async fn check_insertable(
    tx: &Transaction<'_>,
    oid: u32,
    counter: &CounterConfig,
    into: &RollupInto,
    window_column: &str,
) -> Result<(), TargetError> {
    let mut pair = [into.key_column.as_str(), window_column];
    pair.sort_unstable();
    let unique: bool = tx
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_index i \
             WHERE i.indrelid = $1 AND i.indisunique AND i.indimmediate AND i.indisvalid \
               AND i.indpred IS NULL AND i.indnkeyatts = 2 \
               AND ARRAY(SELECT a.attname::text \
                         FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k (attnum, o) \
                         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
                         WHERE k.o <= 2 ORDER BY 1) = $2::text[])",
            &[&oid, &pair.as_slice()],
        )
        .await?
        .get(0);
    if !unique {
        return Err(TargetError::NoUniqueKey {
            counter: counter.name.clone(),
            table: into.table.clone(),
            key_column: into.key_column.clone(),
            window_column: window_column.to_string(),
        });
    }
    let written = [
        into.key_column.as_str(),
        window_column,
        into.column.as_str(),
    ];
    let bare = tx
        .query_opt(
            "SELECT a.attname::text FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid \
             WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped AND a.attnotnull \
               AND NOT a.atthasdef AND a.attidentity = '' AND a.attgenerated = '' \
               AND t.typdefault IS NULL AND a.attname::text <> ALL ($2::text[]) \
             ORDER BY a.attnum LIMIT 1",
            &[&oid, &written.as_slice()],
        )
        .await?;
    if let Some(row) = bare {
        return Err(TargetError::NotNullWithoutDefault {
            counter: counter.name.clone(),
            table: into.table.clone(),
            column: row.get(0),
        });
    }
    Ok(())
}
