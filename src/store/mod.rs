//! PostgreSQL: connecting (connect.rs, conninfo.rs, tls.rs, passfile.rs), the schema
//! (migrations/), which databases and private clusters (databases.rs), the private cluster
//! itself (embedded.rs), the instance lease (lease.rs), journal coverage in the flush ledger
//! (coverage.rs), shard moves (moves.rs), the `rollup_into` targets (targets.rs) and reading
//! one key's total back (read.rs, for `tallyd get`).

pub mod citus;
mod connect;
pub mod conninfo;
pub mod coverage;
pub mod databases;
pub mod embedded;
pub mod error;
mod kinds;
pub mod lease;
pub mod moves;
mod passfile;
pub mod read;
mod targets;
pub mod tls;

pub use connect::{ConnectError, Db, Ending};
pub use databases::{migrate, Databases};
pub use error::DbError;
pub use kinds::restore_unique_totals;
pub use targets::{sync_rollup_targets, TargetError};

use tokio_postgres::Client;
use tracing::warn;

refinery::embed_migrations!("migrations");

/// A row's `win` as Unix milliseconds, [`crate::window::ALL_TIME`] for '-infinity' (an
/// all-time row): the form buckets and flushes carry it in.
pub const WIN_AS_MS: &str = "CASE WHEN win = '-infinity' THEN -9223372036854775808 \
     ELSE (extract(epoch FROM win) * 1000)::bigint END";

/// The views over `tallyd.slots`, dropped and recreated when it is repartitioned.
const VIEWS_OF_SLOTS: [&str; 2] = ["tallyd.totals", "tallyd.window_totals"];

/// The `win` for `ms` (a bigint expression in the form of [`WIN_AS_MS`]).
pub fn win_from_ms(ms: &str) -> String {
    format!(
        "CASE WHEN {ms} = -9223372036854775808 THEN '-infinity'::timestamptz \
         ELSE 'epoch'::timestamptz + {ms} * interval '1 millisecond' END"
    )
}

/// Key for the advisory lock that serialises migrations of several tallyd instances.
pub const MIGRATION_LOCK: i64 = 0x7461_6c6c_7964_0001;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Address(#[from] conninfo::ConninfoError),
    /// A failed connection names the database itself; other errors get the prefix.
    #[error("{}{}", if .0.is_connect() { "" } else { "database: " }, .0)]
    Postgres(DbError),
    #[error("migration failed: {}", error::migration(.0))]
    Migrate(refinery::Error),
    #[error(transparent)]
    Embedded(#[from] embedded::EmbeddedError),
    #[error(transparent)]
    Target(#[from] TargetError),
    #[error(transparent)]
    Kind(#[from] kinds::KindError),
    #[error("Citus: {0}")]
    Citus(String),
    #[error(
        "database {database} records logical shards that differ from the configured map \
         ({logical} logical shards): it owns {recorded}, the config gives it {configured}; \
         differing: {differing} (move shards with the documented procedure, or fix database.shard_map)"
    )]
    ShardMap {
        database: usize,
        logical: u32,
        recorded: String,
        configured: String,
        differing: String,
    },
}

// By hand rather than `#[from]`, which would also make the wrapped error the `source()` of one
// whose message already prints it: the cause would then appear twice.
impl From<DbError> for StoreError {
    fn from(err: DbError) -> StoreError {
        StoreError::Postgres(err)
    }
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(err: tokio_postgres::Error) -> StoreError {
        StoreError::Postgres(err.into())
    }
}

impl StoreError {
    /// Whether the server failed the statement to break a deadlock (SQLSTATE 40P01).
    pub fn is_deadlock(&self) -> bool {
        let deadlock = Some(&tokio_postgres::error::SqlState::T_R_DEADLOCK_DETECTED);
        match self {
            StoreError::Postgres(err) => err.code() == deadlock,
            StoreError::Migrate(err) => match err.kind() {
                refinery::error::Kind::Connection(_, cause) => cause
                    .downcast_ref::<tokio_postgres::Error>()
                    .is_some_and(|pg| pg.code() == deadlock),
                _ => false,
            },
            _ => false,
        }
    }
}

impl From<refinery::Error> for StoreError {
    fn from(err: refinery::Error) -> StoreError {
        StoreError::Migrate(err)
    }
}

/// Brings the database up to what `config` needs: applies the migrations in migrations/ it has
/// not seen, distributes the tables on a Citus cluster (citus.rs), partitions `tallyd.slots` as
/// configured and records the `rollup_into` targets.
/// Safe to run from several instances at once: they take turns on an advisory lock. The shard
/// map is checked separately, by [`check_map`], once every database is prepared.
pub async fn prepare(
    client: &mut Client,
    config: &crate::config::Config,
) -> Result<(), StoreError> {
    // The lock comes first: `CREATE SCHEMA IF NOT EXISTS` run by two sessions at once on a fresh
    // database fails in one of them with a unique violation on pg_namespace.
    client
        .execute_typed(
            "SELECT pg_advisory_lock($1)",
            &[(&MIGRATION_LOCK, tokio_postgres::types::Type::INT8)],
        )
        .await?;
    let result = match client
        .batch_execute("SET client_min_messages = warning; CREATE SCHEMA IF NOT EXISTS tallyd")
        .await
    {
        Ok(()) => prepare_locked(client, config).await,
        Err(err) => Err(err.into()),
    };
    client
        .execute_typed(
            "SELECT pg_advisory_unlock($1)",
            &[(&MIGRATION_LOCK, tokio_postgres::types::Type::INT8)],
        )
        .await?;
    result
}

/// [`prepare`] with the migration lock held by a transaction on a connection of its own
/// (`pg_advisory_xact_lock`) rather than by the session: through a transaction pooler each
/// statement of a session may run on another server connection, so a session lock could be
/// taken on one, "released" on another, and stay held. Needs two connections at once. That
/// transaction waits, idle, for the migrations by design, so it turns the server's
/// `idle_in_transaction_session_timeout` off for itself (in the same message as its BEGIN,
/// before the timer could start): a strict timeout would end it at once.
pub async fn prepare_db(db: &Db, config: &crate::config::Config) -> Result<(), StoreError> {
    let lock = db.connect().await?;
    lock.batch_execute("BEGIN; SET LOCAL idle_in_transaction_session_timeout = 0")
        .await?;
    lock.execute_typed(
        "SELECT pg_advisory_xact_lock($1)",
        &[(&MIGRATION_LOCK, tokio_postgres::types::Type::INT8)],
    )
    .await?;
    let result = async {
        let mut client = db.connect().await?;
        // Warnings only: the `IF NOT EXISTS` of the schema, the migration table and the
        // extensions send "already exists, skipping" notices at every start, and the driver
        // logs each notice it receives.
        client
            .batch_execute("SET client_min_messages = warning; CREATE SCHEMA IF NOT EXISTS tallyd")
            .await?;
        prepare_locked(&mut client, config).await
    }
    .await;
    lock.batch_execute("COMMIT").await?;
    result
}

/// Applies the migrations up to and including `version` only: for tests of an upgrade, which
/// write rows as an older tallyd did and then migrate the rest of the way.
pub async fn migrate_up_to(client: &mut Client, version: u32) -> Result<(), StoreError> {
    client
        .batch_execute("SET client_min_messages = warning; CREATE SCHEMA IF NOT EXISTS tallyd")
        .await?;
    let mut runner = migrations::runner().set_target(refinery::Target::Version(version));
    runner
        .set_migration_table_name("tallyd.schema_history")
        .run_async(client)
        .await?;
    Ok(())
}

/// What a start with `database.migrate = false` checks instead of preparing: the Citus layout,
/// and the counters' kinds against their stored rows (the hll extension where a unique counter
/// is declared), read-only.
pub async fn check_unmigrated(db: &Db, config: &crate::config::Config) -> Result<(), StoreError> {
    let client = db.connect().await?;
    if citus::detect(&client).await? {
        citus::check_layout(&client, &config.counters).await?;
    }
    kinds::prepare(&client, &config.counters, false).await
}

/// How many times [`prepare_locked`] is tried when the server breaks a deadlock by failing it.
const PREPARE_TRIES: u32 = 5;

/// [`prepare_steps`], again when the server broke a deadlock by failing it. A migration (or the
/// partitioning) takes ACCESS EXCLUSIVE locks on tables that applications read through
/// `tallyd.totals`, one after another: a reader holding one of them while it asks for another
/// the migration holds makes a cycle that PostgreSQL ends by failing one side after
/// `deadlock_timeout`, often the migration, which waited first. That failed the daemon's start
/// (`tests/shards.rs::adding_a_database_under_load_moves_shards_exactly`, whose reader queries
/// the databases as they are created: 1 run in 11 under load, and a hung CI run). Each
/// migration commits on its own, so the next try goes on from the one that failed; the reader's
/// transaction has ended or goes on once the migration's locks are gone.
async fn prepare_locked(
    client: &mut Client,
    config: &crate::config::Config,
) -> Result<(), StoreError> {
    let mut tries = 1;
    loop {
        match prepare_steps(client, config).await {
            Err(err) if err.is_deadlock() && tries < PREPARE_TRIES => {
                warn!(cause = %err, tries, "preparing the database deadlocked with another session (a reader of tallyd's tables?); trying again");
                // A step of ours that failed inside its own transaction block leaves it aborted.
                // If even that fails (the connection is gone), the deadlock is what to report.
                if client.batch_execute("ROLLBACK").await.is_err() {
                    return Err(err);
                }
                tokio::time::sleep(std::time::Duration::from_millis(200 * u64::from(tries))).await;
                tries += 1;
            }
            other => return other,
        }
    }
}

async fn prepare_steps(
    client: &mut Client,
    config: &crate::config::Config,
) -> Result<(), StoreError> {
    migrations::runner()
        .set_migration_table_name("tallyd.schema_history")
        .run_async(client)
        .await?;
    if citus::detect(client).await? {
        citus::setup(client, config.database.slot_partitions, &config.counters).await?;
    }
    ensure_slot_partitions(client, config.database.slot_partitions).await?;
    kinds::prepare(client, &config.counters, true).await?;
    sync_rollup_targets(client, &config.counters).await?;
    Ok(())
}

/// Checks every database's recorded shards against `layout` (recording them where none are
/// recorded yet). Run once all databases are prepared, and after any move. Returns each
/// database's shard map version, read with the records it checked: what its flushes must still
/// find (`tallyd.check_shard_map`, migrations/V8), or another tallyd has moved shards since.
pub async fn check_map(
    dbs: &[Db],
    layout: &crate::routing::Layout,
) -> Result<Vec<i64>, StoreError> {
    let mut versions = Vec::with_capacity(dbs.len());
    for (index, db) in dbs.iter().enumerate() {
        let mut client = db.connect().await?;
        versions.push(
            check_shards(
                &mut client,
                index,
                &layout.owned(index),
                layout.map.len() as u32,
            )
            .await?,
        );
    }
    Ok(versions)
}

/// Makes `tallyd.slots` hash-partitioned by key into `partitions` parts (0: a plain table),
/// rebuilding it in one transaction if it is not so yet. Rows are copied, so totals are unchanged;
/// writers wait on the table lock while it runs.
pub async fn ensure_slot_partitions(
    client: &mut Client,
    partitions: u32,
) -> Result<(), StoreError> {
    let current: i64 = client
        .query_typed_one(
            "SELECT CASE WHEN c.relkind = 'p' THEN (SELECT count(*) FROM pg_inherits WHERE inhparent = c.oid) ELSE 0 END \
             FROM pg_class c WHERE c.oid = 'tallyd.slots'::regclass",
            &[],
        )
        .await?
        .get(0);
    if current == partitions as i64 {
        return Ok(());
    }
    tracing::info!(
        from = current,
        to = partitions,
        "repartitioning tallyd.slots"
    );
    // The views are dropped with the old table and recreated as the migrations last defined them.
    let mut views = Vec::new();
    for name in VIEWS_OF_SLOTS {
        let def: String = client
            .query_typed_one(
                "SELECT pg_get_viewdef(to_regclass($1))",
                &[(&name, tokio_postgres::types::Type::TEXT)],
            )
            .await?
            .get(0);
        views.push((name, def));
    }
    // tallyd.unique_totals is created again after this, where a unique counter is declared.
    let mut sql = String::from(
        "LOCK TABLE tallyd.slots IN ACCESS EXCLUSIVE MODE;\nDROP VIEW IF EXISTS tallyd.unique_totals;\n",
    );
    for (name, _) in &views {
        sql.push_str(&format!("DROP VIEW {name};\n"));
    }
    sql.push_str(
        "ALTER TABLE tallyd.slots RENAME TO slots_old;\n\
         ALTER TABLE tallyd.slots_old RENAME CONSTRAINT slots_pkey TO slots_old_pkey;\n\
         CREATE TABLE tallyd.slots (LIKE tallyd.slots_old INCLUDING DEFAULTS, PRIMARY KEY (counter, key, span, win, slot))",
    );
    if partitions > 0 {
        sql.push_str(" PARTITION BY HASH (key);\n");
        for i in 0..partitions {
            sql.push_str(&format!(
                "CREATE TABLE tallyd.slots_p{i} PARTITION OF tallyd.slots \
                 FOR VALUES WITH (MODULUS {partitions}, REMAINDER {i}) \
                 WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02);\n"
            ));
        }
    } else {
        sql.push_str(
            " WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02, \
             autovacuum_analyze_scale_factor = 0.05);\n",
        );
    }
    sql.push_str(
        "INSERT INTO tallyd.slots SELECT * FROM tallyd.slots_old;\n\
         DROP TABLE tallyd.slots_old;\n",
    );
    for (name, def) in &views {
        sql.push_str(&format!(
            "CREATE VIEW {name} AS {};\n",
            def.trim_end().trim_end_matches(';')
        ));
    }
    let tx = client.transaction().await?;
    tx.batch_execute(&sql).await?;
    tx.commit().await?;
    Ok(())
}

/// Records the logical shards database `database` owns on first use; afterwards checks that the
/// configured map agrees with the record. Returns the database's shard map version, read in the
/// same transaction as the records.
pub async fn check_shards(
    client: &mut Client,
    database: usize,
    owned: &[i32],
    logical: u32,
) -> Result<i64, StoreError> {
    let tx = client.transaction().await?;
    // The version first, then the records: the order a move locks them in (store/moves/mod.rs).
    // Both locks wait for a move that holds them; the reads that follow see what it committed.
    tx.batch_execute(
        "LOCK TABLE tallyd.shard_map_version IN ACCESS SHARE MODE; \
         LOCK TABLE tallyd.shards IN EXCLUSIVE MODE",
    )
    .await?;
    let version: i64 = tx
        .query_one("SELECT version FROM tallyd.shard_map_version", &[])
        .await?
        .get(0);
    let rows = tx
        .query(
            "SELECT shard, logical_shards FROM tallyd.shards ORDER BY shard",
            &[],
        )
        .await?;
    if rows.is_empty() {
        tx.execute(
            "INSERT INTO tallyd.shards (shard, logical_shards) SELECT unnest($1::int[]), $2",
            &[&owned, &(logical as i32)],
        )
        .await?;
        tx.commit().await?;
        return Ok(version);
    }
    let recorded: Vec<i32> = rows.iter().map(|r| r.get(0)).collect();
    let recorded_logical = rows.iter().map(|r| r.get::<_, i32>(1)).max().unwrap_or(0);
    if recorded == owned && recorded_logical == logical as i32 {
        return Ok(version);
    }
    let differing: Vec<i32> = recorded
        .iter()
        .filter(|s| !owned.contains(s))
        .chain(owned.iter().filter(|s| !recorded.contains(s)))
        .copied()
        .collect();
    Err(StoreError::ShardMap {
        database,
        logical,
        recorded: ranges(&recorded),
        configured: ranges(owned),
        differing: ranges(&differing),
    })
}

/// `[0, 1, 2, 5, 7, 8]` as `0-2, 5, 7-8`.
pub(crate) fn ranges(shards: &[i32]) -> String {
    let mut sorted = shards.to_vec();
    sorted.sort_unstable();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        while i + 1 < sorted.len() && sorted[i + 1] == sorted[i] + 1 {
            i += 1;
        }
        out.push(if sorted[i] == start {
            start.to_string()
        } else {
            format!("{start}-{}", sorted[i])
        });
        i += 1;
    }
    if out.is_empty() {
        "none".into()
    } else {
        out.join(", ")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn shard_ranges_read_well() {
        assert_eq!(super::ranges(&[7, 0, 1, 2, 5, 8]), "0-2, 5, 7-8");
        assert_eq!(super::ranges(&[]), "none");
    }
}
