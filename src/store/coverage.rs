//! Journal coverage in the flush ledger (`tallyd.flushes.journal_covered`): reading, per writer
//! of this instance, up to which journal record its events are committed, and recording a
//! replay as committed for every writer.

use std::collections::HashMap;

use tokio_postgres::types::Type;

use super::lease::Lease;
use super::{Db, StoreError};

/// Per writer of this instance: the journal sequence number up to which its events are committed.
/// Writer numbers are global, so the rows of every database merge into one map.
pub async fn covered(dbs: &[Db], lease: &Lease) -> Result<HashMap<i32, i64>, StoreError> {
    let mut covered = HashMap::new();
    for db in dbs {
        let client = db.connect().await?;
        let rows = client
            .query_typed(
                "SELECT writer, journal_covered FROM tallyd.flushes \
                 WHERE instance_id = $1 AND owner = $2",
                &[(&lease.instance_id, Type::TEXT), (&lease.owner, Type::TEXT)],
            )
            .await?;
        for r in rows {
            let entry = covered.entry(r.get::<_, i32>(0)).or_insert(0i64);
            *entry = (*entry).max(r.get(1));
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
             DO UPDATE SET journal_covered = GREATEST(f.journal_covered, EXCLUDED.journal_covered)",
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
