//! PostgreSQL: connecting, the schema (migrations/), and the private cluster (embedded.rs).

pub mod embedded;

use std::str::FromStr;
use std::time::Duration;

use tokio_postgres::{Client, NoTls};
use tracing::debug;

refinery::embed_migrations!("migrations");

/// Key for the advisory lock that serialises migrations of several tallyd instances.
const MIGRATION_LOCK: i64 = 0x7461_6c6c_7964_0001;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("invalid database address: {0}")]
    Address(#[source] tokio_postgres::Error),
    #[error("database: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("migration failed: {0}")]
    Migrate(#[from] refinery::Error),
    #[error(transparent)]
    Embedded(#[from] embedded::EmbeddedError),
}

/// Where the database is: a parsed connection config, connected to as often as needed.
#[derive(Clone, Debug)]
pub struct Db {
    config: tokio_postgres::Config,
}

impl Db {
    /// Accepts a `postgres://` URL or a libpq `key=value` string.
    pub fn new(conninfo: &str, connect_timeout: Duration) -> Result<Db, StoreError> {
        let mut config = tokio_postgres::Config::from_str(conninfo).map_err(StoreError::Address)?;
        config.connect_timeout(connect_timeout);
        if config.get_application_name().is_none() {
            config.application_name("tallyd");
        }
        Ok(Db { config })
    }

    /// A fresh connection; its driver task ends when the client is dropped.
    pub async fn connect(&self) -> Result<Client, tokio_postgres::Error> {
        let (client, connection) = self.config.connect(NoTls).await?;
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                debug!(cause = %err, "database connection ended");
            }
        });
        Ok(client)
    }
}

/// Applies the migrations in migrations/ that this database has not seen. Safe to run from several
/// instances at once: they take turns on an advisory lock.
pub async fn migrate(client: &mut Client) -> Result<(), StoreError> {
    client
        .batch_execute("SET client_min_messages = warning; CREATE SCHEMA IF NOT EXISTS tallyd")
        .await?;
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    let result = migrations::runner()
        .set_migration_table_name("tallyd.schema_history")
        .run_async(client)
        .await;
    client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
        .await?;
    result?;
    Ok(())
}
