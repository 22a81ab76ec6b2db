//! What every scenario shares: the options, the counter and hot key they write, the daemon's
//! flush interval, and the bench's private PostgreSQL with the directory everything lives in.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;

use tallyd::store::embedded::{Embedded, EmbeddedOptions};
use tallyd::store::Db;

use crate::procfs::server_cpu_seconds;

/// The one key of the hot-key scenarios.
pub(crate) const HOT: &str = "hot";
/// The counter every daemon scenario writes.
pub(crate) const COUNTER: &str = "bench";
/// The counter the unique-count scenarios write instead (`kind = "unique"`).
pub(crate) const UNIQUE_COUNTER: &str = "visitors";
/// The daemon's flush interval in every throughput scenario (its default).
pub(crate) const FLUSH_INTERVAL_MS: u64 = 1_000;

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Concurrent connections of the one-statement-per-event baselines.
    #[arg(long, default_value_t = 16)]
    pub connections: usize,
    /// How long each baseline (and the batched ceiling) runs.
    #[arg(long, default_value_t = 5)]
    pub baseline_seconds: u64,
    /// Events sent to one key in the hot-key scenarios.
    #[arg(long, default_value_t = 1_000_000)]
    pub events: u64,
    /// Events sent in each high-cardinality scenario.
    #[arg(long, default_value_t = 10_000_000)]
    pub hc_events: u64,
    /// Distinct keys the high-cardinality events are drawn from.
    #[arg(long, default_value_t = 1_000_000)]
    pub hc_keys: u64,
    /// Stream connections sending to the daemon.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// Client threads of the per-event scenarios (`tallyd-event-*`, `ceiling-event-*`), each
    /// sending one event per syscall.
    #[arg(long, default_value_t = 8)]
    pub event_clients: usize,
    /// Events sent in each per-event scenario (and its ceiling).
    #[arg(long, default_value_t = 2_000_000)]
    pub event_events: u64,
    /// Run only the tallyd scenarios.
    #[arg(long)]
    pub skip_baselines: bool,
    /// Run one scenario (or a group: `slotted`, `tallyd-hc`), or several separated by commas
    /// (`server-upsert,tallyd-hc-uniform`); see the list in the output.
    #[arg(long, value_name = "NAME")]
    pub only: Option<String>,
    /// New distinct keys a second in the sustained rows (`tallyd-sustained-*`).
    #[arg(long, default_value_t = 50_000)]
    pub sustained_rate: u64,
    /// How long the sustained rows send.
    #[arg(long, default_value_t = 300)]
    pub sustained_seconds: u64,
    /// fsync = off and synchronous_commit = off on the bench's PostgreSQL (not durable).
    #[arg(long)]
    pub fast_db: bool,
}

/// A temporary directory the `postgres` user can traverse, removed on drop.
pub(crate) struct TempRoot {
    pub(crate) path: PathBuf,
    pub(crate) keep: bool,
}

impl TempRoot {
    fn create() -> Result<TempRoot> {
        let path = PathBuf::from(format!(
            "/tmp/tallyd-bench-{}-{:04x}",
            std::process::id(),
            rand::random::<u16>()
        ));
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        Ok(TempRoot { path, keep: false })
    }
}

impl Drop for TempRoot {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The bench's PostgreSQL, its tables, and the directory everything lives in.
pub(crate) struct BenchEnv {
    // Dropped in order: the server stops before its directory is removed.
    pub(crate) pg: Option<Embedded>,
    pub(crate) root: TempRoot,
    pub(crate) conninfo: String,
    pub(crate) db: Db,
    /// The daemon binary each tallyd scenario spawns.
    pub(crate) tallyd: PathBuf,
}

impl BenchEnv {
    /// Starts the bench's PostgreSQL in a new temporary directory; the tables come after.
    pub(crate) async fn start(args: &BenchArgs, tallyd: PathBuf) -> Result<BenchEnv> {
        let root = TempRoot::create()?;
        let options = EmbeddedOptions {
            dir: root.path.join("pg"),
            settings: server_settings(args),
            bin_dir: None,
        };
        let pg = tokio::task::spawn_blocking(move || Embedded::start(&options))
            .await?
            .context("starting the bench's PostgreSQL")?;
        let conninfo = pg.connection_string("postgres");
        let db = Db::new(&conninfo, Duration::from_secs(10))?;
        Ok(BenchEnv {
            pg: Some(pg),
            root,
            conninfo,
            db,
            tallyd,
        })
    }

    /// CPU seconds the bench's PostgreSQL has used so far (all its processes).
    pub(crate) fn server_cpu(&self) -> Result<f64> {
        let pid = self
            .pg
            .as_ref()
            .context("the bench's PostgreSQL has stopped")?
            .pid();
        server_cpu_seconds(pid)
    }

    pub(crate) async fn stop(mut self) -> Result<()> {
        if let Some(pg) = self.pg.take() {
            tokio::task::spawn_blocking(move || pg.stop()).await??;
        }
        Ok(())
    }
}

/// Durable by default; `--fast-db` trades durability for speed. The sizes suit this bench's
/// million-key tables on a small machine, for every approach alike.
fn server_settings(args: &BenchArgs) -> Vec<(String, String)> {
    let durable = if args.fast_db { "off" } else { "on" };
    let max_connections = (args.connections + 20).max(100).to_string();
    [
        ("fsync", durable),
        ("synchronous_commit", durable),
        ("shared_buffers", "1GB"),
        ("max_wal_size", "4GB"),
        ("max_connections", max_connections.as_str()),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}
