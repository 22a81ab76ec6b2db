//! Which databases tallyd writes to, and the private clusters it runs for them: opening
//! (starting clusters, stopping one a killed tallyd left behind), connecting without starting
//! anything (for the CLI), migrating, and stopping.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tracing::{info, warn};

use super::embedded::{self, Embedded, EmbeddedError, EmbeddedOptions};
use super::{Db, StoreError};
use crate::config::{Config, DatabaseConfig};

/// The databases tallyd writes to (one, or one per `[database] shards` entry, in map order), and
/// the private clusters it runs.
pub struct Databases {
    dbs: Vec<Db>,
    embedded: Vec<Embedded>,
}

/// Where the private cluster of database `index` lives: `data_dir/postgres` with one database,
/// `data_dir/postgres-<index>` with shards.
fn cluster_dir(config: &Config, index: usize) -> PathBuf {
    if config.database.shards.is_empty() {
        config.daemon.data_dir.join("postgres")
    } else {
        config.daemon.data_dir.join(format!("postgres-{index}"))
    }
}

fn connect_timeout(config: &Config) -> Duration {
    config.database.connect_timeout()
}

impl Databases {
    /// Starts a private cluster for every database given as `embedded`, and parses the addresses
    /// of the others. Blocking: call from `spawn_blocking` or before the runtime is busy. The
    /// caller holds the data_dir lock.
    pub fn open(config: &Config) -> Result<Databases, StoreError> {
        let mut opened = Databases {
            dbs: Vec::new(),
            embedded: Vec::new(),
        };
        for (index, entry) in config.database.databases().into_iter().enumerate() {
            if entry != DatabaseConfig::EMBEDDED {
                opened.dbs.push(Db::new(entry, connect_timeout(config))?);
                continue;
            }
            let embedded = start_cluster(config, index)?;
            info!(database = index, socket_dir = %embedded.socket_dir().display(), "private PostgreSQL started");
            let conninfo = embedded.connection_string("postgres");
            opened
                .dbs
                .push(Db::new(&conninfo, connect_timeout(config))?);
            opened.embedded.push(embedded);
        }
        Ok(opened)
    }

    /// Connects without starting anything: private clusters must already run (for the CLI).
    pub fn connect_only(config: &Config) -> Result<Vec<Db>, StoreError> {
        let mut dbs = Vec::new();
        for (index, entry) in config.database.databases().into_iter().enumerate() {
            let conninfo = if entry == DatabaseConfig::EMBEDDED {
                let dir = cluster_dir(config, index).join("pgsocket");
                let dir = std::path::absolute(&dir).map_err(|cause| {
                    EmbeddedError::from(crate::io_error::IoError::on("cannot resolve", &dir)(cause))
                })?;
                embedded::socket_connection_string(&dir, embedded::PORT, "postgres")
            } else {
                entry.to_string()
            };
            dbs.push(Db::new(&conninfo, connect_timeout(config))?);
        }
        Ok(dbs)
    }

    /// Parses every database entry as the commands and the daemon do, without connecting or
    /// starting anything (`tallyd check-config`).
    pub fn check(config: &Config) -> Result<(), StoreError> {
        for entry in config.database.databases() {
            if entry != DatabaseConfig::EMBEDDED {
                super::conninfo::parse(entry, &|name| std::env::var(name).ok())?;
            }
        }
        Ok(())
    }

    /// The databases, in map order.
    pub fn dbs(&self) -> &[Db] {
        &self.dbs
    }

    /// Stops the private clusters (fast shutdown). Blocking.
    pub fn stop(self) {
        for embedded in self.embedded {
            match embedded.stop() {
                Ok(()) => info!("private PostgreSQL stopped"),
                Err(err) => warn!(cause = %err, "private PostgreSQL did not stop cleanly"),
            }
        }
    }
}

/// Brings every database up to what `config` needs (see [`super::prepare_db`]).
pub async fn migrate(dbs: &[Db], config: &Config) -> Result<(), StoreError> {
    for db in dbs {
        super::prepare_db(db, config).await?;
    }
    Ok(())
}

/// Starts the private cluster of database `index`, stopping first one that outlived a killed
/// tallyd.
fn start_cluster(config: &Config, index: usize) -> Result<Embedded, StoreError> {
    let mut settings: Vec<(String, String)> = config
        .database
        .embedded_settings
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    // Moving shards commits in two phases.
    if !settings
        .iter()
        .any(|(k, _)| k == "max_prepared_transactions")
    {
        settings.push(("max_prepared_transactions".into(), "16".into()));
    }
    let options = EmbeddedOptions {
        dir: cluster_dir(config, index),
        settings,
        bin_dir: None,
    };
    let started = match Embedded::start(&options) {
        Err(EmbeddedError::AlreadyRunning { .. }) => {
            // We hold the data_dir lock, so no tallyd owns that server: it outlived a tallyd
            // that was killed. Stop it and start our own.
            stop_orphan(&options.dir.join("pgdata"));
            Embedded::start(&options)
        }
        other => other,
    };
    Ok(started?)
}

/// Fast-stops the postmaster recorded in `pgdata/postmaster.pid` and waits up to 60 s for it.
fn stop_orphan(pgdata: &Path) {
    let pid = std::fs::read_to_string(pgdata.join("postmaster.pid"))
        .ok()
        .and_then(|s| s.lines().next().and_then(|l| l.trim().parse::<i32>().ok()));
    let Some(pid) = pid.filter(|&p| p > 0) else {
        return;
    };
    warn!(
        pid,
        "stopping a private PostgreSQL left running by a previous tallyd"
    );
    // SAFETY: plain signal calls on a pid read from the cluster's own lock file.
    unsafe { libc::kill(pid, libc::SIGINT) };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    // No notification exists for another process's exit: poll it.
    while unsafe { libc::kill(pid, 0) } == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cli_reaches_a_private_cluster_by_a_quoted_socket_path() {
        let mut config = Config::default();
        config.daemon.data_dir = PathBuf::from("/tmp/tallyd test's dir");
        config.database.url = DatabaseConfig::EMBEDDED.to_string();
        let dbs = Databases::connect_only(&config).unwrap();
        assert_eq!(dbs.len(), 1);
        // The whole path is the host (unquoted, the space would have ended it).
        let debug = format!("{:?}", dbs[0]);
        assert!(
            debug.contains(r"host='/tmp/tallyd test\'s dir/postgres/pgsocket'"),
            "{debug}"
        );
    }
}
