//! Journal coverage in the flush ledger (`tallyd.flushes.journal_covered`, `unique_covered`):
//! reading, per writer of this instance, up to which journal record its events (and its unique
//! counters' events, held back while the hll extension was missing) are committed, and
//! recording a replay as committed for every writer.

use std::collections::HashMap;

use tokio_postgres::types::Type;

use super::lease::Lease;
use super::{Db, StoreError};

/// How far the ledger says each writer committed the journal: every line of its records up to
/// `all`, a unique counter's lines only up to `unique`, lower while a flush held unique rows
/// back (src/flush/held.rs, migrations/V21). `journal::replay` decides by it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Coverage {
    pub all: HashMap<i32, i64>,
    /// Per writer whose unique lines are covered less far than `all` says.
    pub unique: HashMap<i32, i64>,
    /// The unique counters' names (this run's config).
    pub uniques: Vec<String>,
}

/// Per writer of this instance: the journal sequence number up to which its events are
/// committed, and its unique counters' events where they are committed less far (the caller
/// names the unique counters). Writer numbers are global, so the rows of every database merge
/// into one map.
pub async fn covered(dbs: &[Db], lease: &Lease) -> Result<Coverage, StoreError> {
    let mut covered = Coverage::default();
    for db in dbs {
        let client = db.connect().await?;
        let rows = client
            .query_typed(
                "SELECT writer, journal_covered, coalesce(unique_covered, journal_covered) \
                 FROM tallyd.flushes WHERE instance_id = $1 AND owner = $2",
                &[(&lease.instance_id, Type::TEXT), (&lease.owner, Type::TEXT)],
            )
            .await?;
        for r in rows {
            let (writer, all, unique): (i32, i64, i64) = (r.get(0), r.get(1), r.get(2));
            let entry = covered.all.entry(writer).or_insert(0i64);
            *entry = (*entry).max(all);
            if unique < all {
                let entry = covered.unique.entry(writer).or_insert(unique);
                *entry = (*entry).min(unique);
            }
        }
    }
    Ok(covered)
}

/// Records that writers `0..writers` have committed every journal record up to `upto`.
pub async fn cover_all(db: &Db, lease: &Lease, writers: i32, upto: i64) -> Result<(), StoreError> {
    let client = db.connect().await?;
    client
        .execute_typed(
            "INSERT INTO tallyd.flushes AS f (instance_id, owner, writer, seq, journal_covered) \
             SELECT $1, $4, w, 0, $3 FROM generate_series(0, $2 - 1) AS w \
             ON CONFLICT (instance_id, owner, writer) \
             DO UPDATE SET journal_covered = GREATEST(f.journal_covered, EXCLUDED.journal_covered), \
             unique_covered = GREATEST(coalesce(f.unique_covered, f.journal_covered), EXCLUDED.journal_covered)",
            &[
                (&lease.instance_id, Type::TEXT),
                (&writers, Type::INT4),
                (&upto, Type::INT8),
                (&lease.owner, Type::TEXT),
            ],
        )
        .await?;
    Ok(())
}
