//! Citus: when the database tallyd prepares has the citus extension, distributes tallyd's tables
//! over its workers (idempotently, as part of `tallyd migrate` and every start) and checks the
//! layout the rollup and flushes rely on (docs/scaling.md).
//!
//! `tallyd.slots`, `tallyd.rollups` and `tallyd.rollup_rejects` are hash-distributed on `key`
//! and colocated, so all rows of one key live in one shard group on one worker: the rollup folds
//! each shard group there (migrations/V6, V7), and `tallyd.totals` groups by key within a shard.
//! The flush ledger, leases, shard map and rollup targets stay local tables on the coordinator.

use tokio_postgres::Client;

use super::StoreError;

/// The tables distributed on `key`, colocated with the first.
const DISTRIBUTED: [&str; 3] = ["tallyd.slots", "tallyd.rollups", "tallyd.rollup_rejects"];

/// The functions each worker runs for its shard groups (migrations/V6, V7).
const WORKER_FUNCTIONS: [&str; 3] = [
    "tallyd.rollup_shard(regclass,regclass,regclass,jsonb,integer)",
    "tallyd.rollup_fold(regclass,regclass,regclass,integer,text[])",
    "tallyd.rollup_into_shard(regclass,regclass,text,regclass,name,name,text,integer,text)",
];

/// Why a windowed `rollup_into` (a `window_column`) is refused on Citus (docs/scaling.md).
pub const WINDOWED_ROLLUP_INTO: &str =
    "a rollup_into with window_column is not supported on Citus: the rollup folds each shard \
     group on its worker, and the windowed fold needs its held-back keys (tallyd.rollup_held) \
     and the target's unique (key, window) index there, which tallyd does not distribute; \
     without rollup_into, the windows are read from tallyd.window_totals";

/// Whether the database has the citus extension (then tallyd runs distributed).
pub async fn detect(client: &Client) -> Result<bool, StoreError> {
    let row = client
        .query_typed_opt("SELECT 1 FROM pg_extension WHERE extname = 'citus'", &[])
        .await?;
    Ok(row.is_some())
}

/// Distributes what is not distributed yet, then checks the whole layout. Runs after the
/// migrations, under the migration lock. Refuses `slot_partitions` (a distributed table is
/// already split into shards; Citus cannot nest hash partitions under it the way
/// `ensure_slot_partitions` builds them).
pub async fn setup(
    client: &Client,
    slot_partitions: u32,
    counters: &[crate::config::CounterConfig],
) -> Result<(), StoreError> {
    if slot_partitions > 0 {
        return Err(StoreError::Citus(format!(
            "database.slot_partitions = {slot_partitions} is not supported on Citus: \
             tallyd.slots is split into Citus shards instead; set slot_partitions = 0"
        )));
    }
    let partitioned: bool = client
        .query_typed_one(
            "SELECT relkind = 'p' FROM pg_class WHERE oid = 'tallyd.slots'::regclass",
            &[],
        )
        .await?
        .get(0);
    if partitioned {
        return Err(StoreError::Citus(
            "tallyd.slots is partitioned (an earlier slot_partitions setting): run tallyd \
             migrate with slot_partitions = 0 before installing citus"
                .into(),
        ));
    }
    for (i, table) in DISTRIBUTED.iter().enumerate() {
        if distribution(client, table).await?.is_some() {
            continue;
        }
        let colocate = if i == 0 { "default" } else { DISTRIBUTED[0] };
        tracing::info!(table, colocate, "Citus: distributing on key");
        client
            .query_typed(
                "SELECT create_distributed_table($1::text::regclass, 'key', colocate_with => $2)",
                &[
                    (table, tokio_postgres::types::Type::TEXT),
                    (&colocate, tokio_postgres::types::Type::TEXT),
                ],
            )
            .await?;
    }
    for function in WORKER_FUNCTIONS {
        // Creates the function on every worker (and on workers added later).
        client
            .query_typed(
                "SELECT create_distributed_function($1::text::regprocedure)",
                &[(&function, tokio_postgres::types::Type::TEXT)],
            )
            .await?;
    }
    check_layout(client, counters).await
}

/// The distribution column and colocation group of `table`, if Citus hash-distributes it.
async fn distribution(client: &Client, table: &str) -> Result<Option<(String, i32)>, StoreError> {
    let row = client
        .query_typed_opt(
            "SELECT column_to_column_name(logicalrelid, partkey), colocationid \
             FROM pg_dist_partition WHERE logicalrelid = to_regclass($1) AND partmethod = 'h'",
            &[(&table, tokio_postgres::types::Type::TEXT)],
        )
        .await?;
    Ok(row.map(|r| (r.get(0), r.get(1))))
}

/// Every table the rollup folds within a shard group is distributed on `key` and colocated with
/// `tallyd.slots`, and so is every `rollup_into` table of `counters` (on its key column). Run
/// before the targets are recorded, so that a refused start changes nothing.
pub async fn check_layout(
    client: &Client,
    counters: &[crate::config::CounterConfig],
) -> Result<(), StoreError> {
    let Some((_, group)) = distribution(client, DISTRIBUTED[0]).await? else {
        return Err(StoreError::Citus(
            "tallyd.slots is not distributed: run tallyd migrate".into(),
        ));
    };
    for table in DISTRIBUTED {
        match distribution(client, table).await? {
            Some((column, g)) if column == "key" && g == group => {}
            found => {
                return Err(StoreError::Citus(format!(
                    "{table} must be distributed on key and colocated with tallyd.slots \
                     (colocation group {group}); found {found:?}"
                )))
            }
        }
    }
    for c in counters {
        let Some(into) = &c.rollup_into else { continue };
        if into.window_column.is_some() {
            return Err(StoreError::Citus(format!(
                "counter {}: {WINDOWED_ROLLUP_INTO}",
                c.name
            )));
        }
        let (table, key) = (&into.table, &into.key_column);
        let exists = client
            .query_typed_one(
                "SELECT to_regclass($1) IS NOT NULL",
                &[(table, tokio_postgres::types::Type::TEXT)],
            )
            .await?
            .get::<_, bool>(0);
        if !exists {
            // sync_rollup_targets names it.
            continue;
        }
        match distribution(client, table).await? {
            Some((column, g)) if &column == key && g == group => {}
            _ => {
                return Err(StoreError::Citus(format!(
                    "counter {}: on Citus, rollup_into table {table} must be distributed \
                     on {key} and colocated with tallyd.slots ({key} of type text): \
                     SELECT create_distributed_table('{table}', '{key}', colocate_with => 'tallyd.slots')",
                    c.name
                )))
            }
        }
    }
    Ok(())
}
