//! The run of `tallyd-bench`: its options and scenarios, and the private PostgreSQL they share.
//! It measures one-statement-per-event upserts, insert-only, the batched-upsert ceiling and the
//! real daemon side by side, and checks the performance targets.
//!
//! Every approach runs in one process against one server, so the numbers compare like with like:
//! - baselines (naive, slotted, insert-only) run `--connections` sessions issuing one statement
//!   per event for `--baseline-seconds`; the batched ceiling is one session upserting 5,000
//!   distinct keys per statement;
//! - each tallyd scenario spawns `tallyd run` (the binary given to [`run`]) as a child process
//!   (fresh data dir, truncated tables) pointed at the bench's server, so its CPU and memory are
//!   measured apart from PostgreSQL's, sends pre-built buffers over the stream socket from
//!   `--clients` connections, times first byte to the last `!flush` answer, and checks
//!   `tallyd.totals` is exact.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;

use tallyd::store::embedded::{self, Embedded, EmbeddedOptions};
use tallyd::store::{self, Db};

use crate::baselines::{batched_ceiling, rollup_fold, server_upsert, PerEvent};
use crate::daemon::rollup_and_journal;
use crate::load::{hot_load, spread_load, KeyDist};
use crate::per_event::Transport;
use crate::report::{checks, table, Outcome};

/// The one key of the hot-key scenarios.
pub(crate) const HOT: &str = "hot";
/// The counter every daemon scenario writes.
pub(crate) const COUNTER: &str = "bench";
pub(crate) const SLOTS: i32 = 100;
/// Rows per statement of the batched ceiling, and the key space they are drawn from.
pub(crate) const BATCH_ROWS: usize = 5_000;
pub(crate) const BATCH_KEY_SPACE: usize = 1_000_000;
/// Bytes per client write: whole lines, up to this many.
pub(crate) const WRITE_BYTES: usize = 64 * 1024;
/// Pending keys for the memory check.
pub(crate) const MEMORY_KEYS: u64 = 1_000_000;
pub(crate) const ZIPF_S: f64 = 1.0;
/// The daemon's flush interval in every throughput scenario (its default).
pub(crate) const FLUSH_INTERVAL_MS: u64 = 1_000;
pub(crate) const STOP_TIMEOUT: Duration = Duration::from_secs(120);

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
    /// fsync = off and synchronous_commit = off on the bench's PostgreSQL (not durable).
    #[arg(long)]
    pub fast_db: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scenario {
    Naive,
    SlottedRandom,
    SlottedTime,
    InsertOnly,
    Batched,
    ServerUpsert,
    Hot,
    HcUniform,
    HcZipf,
    HotRollup,
    CeilingEventDgram,
    EventDgram,
    CeilingEventStream,
    EventStream,
    Memory,
    RollupFold,
}

pub(crate) const SCENARIOS: [Scenario; 16] = [
    Scenario::Naive,
    Scenario::SlottedRandom,
    Scenario::SlottedTime,
    Scenario::InsertOnly,
    Scenario::Batched,
    Scenario::ServerUpsert,
    Scenario::Hot,
    Scenario::HcUniform,
    Scenario::HcZipf,
    Scenario::HotRollup,
    Scenario::CeilingEventDgram,
    Scenario::EventDgram,
    Scenario::CeilingEventStream,
    Scenario::EventStream,
    Scenario::Memory,
    Scenario::RollupFold,
];

impl Scenario {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Scenario::Naive => "naive",
            Scenario::SlottedRandom => "slotted-random",
            Scenario::SlottedTime => "slotted-time",
            Scenario::InsertOnly => "insert-only",
            Scenario::Batched => "batched",
            Scenario::ServerUpsert => "server-upsert",
            Scenario::Hot => "tallyd-hot",
            Scenario::HcUniform => "tallyd-hc-uniform",
            Scenario::HcZipf => "tallyd-hc-zipf",
            Scenario::HotRollup => "tallyd-hot-rollup-journal",
            Scenario::CeilingEventDgram => "ceiling-event-dgram",
            Scenario::EventDgram => "tallyd-event-dgram",
            Scenario::CeilingEventStream => "ceiling-event-stream",
            Scenario::EventStream => "tallyd-event-stream",
            Scenario::Memory => "tallyd-memory",
            Scenario::RollupFold => "tallyd-rollup-fold",
        }
    }

    fn is_baseline(self) -> bool {
        !self.name().starts_with("tallyd-")
    }
}

/// The scenarios `--only` and `--skip-baselines` leave: `--only` is a comma-separated list of
/// exact names or `name-` groups, run in the default order.
fn selected(args: &BenchArgs) -> Result<Vec<Scenario>> {
    let wanted = |s: &Scenario| !(args.skip_baselines && s.is_baseline());
    let Some(only) = args.only.as_deref() else {
        let all = SCENARIOS.iter().copied().filter(wanted).collect();
        return Ok(crate::per_event::with_ceilings(all));
    };
    let mut picked = Vec::new();
    for one in only.split(',') {
        picked.extend(selected_one(one)?);
    }
    let picked = SCENARIOS
        .iter()
        .copied()
        .filter(|s| picked.contains(s))
        .filter(wanted)
        .collect();
    Ok(crate::per_event::with_ceilings(picked))
}

/// One `--only` entry: an exact name, else a `name-` group.
fn selected_one(only: &str) -> Result<Vec<Scenario>> {
    let exact: Vec<Scenario> = SCENARIOS
        .iter()
        .copied()
        .filter(|s| s.name() == only)
        .collect();
    let picked: Vec<Scenario> = if exact.is_empty() {
        let group = format!("{only}-");
        SCENARIOS
            .iter()
            .copied()
            .filter(|s| s.name().starts_with(&group))
            .collect()
    } else {
        exact
    };
    if picked.is_empty() {
        let names: Vec<&str> = SCENARIOS.iter().map(|s| s.name()).collect();
        bail!(
            "--only {only:?}: no such scenario; one of {}",
            names.join(", ")
        );
    }
    Ok(picked)
}

/// `--only statsd-side-by-side` (bench/src/statsd.rs): not in the default run, since it needs
/// node and the reference statsd server (`npm ci` in bench/statsd-reference).
const STATSD_SIDE_BY_SIDE: &str = "statsd-side-by-side";

async fn statsd_side_by_side(args: &BenchArgs, tallyd: PathBuf) -> Result<()> {
    println!("{}", machine_description());
    let mut env = BenchEnv::start(args, tallyd).await?;
    println!("running {STATSD_SIDE_BY_SIDE} ...");
    if let Err(err) = env.statsd_side_by_side().await {
        env.root.keep = true;
        let kept = env.root.path.display().to_string();
        return Err(err.context(format!("bench failed; its files are kept in {kept}")));
    }
    env.stop().await
}

/// Runs the selected scenarios against the daemon binary `tallyd`, prints the table and the
/// target checks.
pub async fn run(args: BenchArgs, tallyd: PathBuf) -> Result<()> {
    ensure!(args.clients > 0, "--clients must be at least 1");
    ensure!(args.connections > 0, "--connections must be at least 1");
    ensure!(args.hc_keys > 0, "--hc-keys must be at least 1");
    ensure!(args.event_clients > 0, "--event-clients must be at least 1");
    ensure!(args.event_events > 0, "--event-events must be at least 1");
    if args.only.as_deref() == Some(STATSD_SIDE_BY_SIDE) {
        return statsd_side_by_side(&args, tallyd).await;
    }
    let scenarios = selected(&args)?;
    println!("{}", machine_description());
    let mut env = BenchEnv::start(&args, tallyd).await?;
    println!(
        "PostgreSQL: {} ({})\n",
        if args.fast_db {
            "fsync=off, synchronous_commit=off (--fast-db)"
        } else {
            "fsync=on, synchronous_commit=on"
        },
        env.root.path.display()
    );
    let outcomes = tokio::select! {
        result = env.run_all(&scenarios, &args) => result,
        _ = tokio::signal::ctrl_c() => bail!("interrupted"),
    };
    let outcomes = match outcomes {
        Ok(outcomes) => outcomes,
        Err(err) => {
            // The daemon's log and config are there to look at.
            env.root.keep = true;
            let kept = env.root.path.display().to_string();
            return Err(err.context(format!("bench failed; its files are kept in {kept}")));
        }
    };
    println!();
    print!("{}", table(&outcomes));
    println!();
    for check in checks(&outcomes) {
        println!("{check}");
    }
    env.stop().await
}

fn machine_description() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = proc_field(&cpuinfo, "model name").unwrap_or_else(|| "unknown".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_gib = proc_kib(&meminfo, "MemTotal").unwrap_or(0) as f64 / (1024.0 * 1024.0);
    format!(
        "machine: {cpus} CPUs ({model}), {mem_gib:.1} GiB memory; {}",
        postgres_version()
    )
}

fn postgres_version() -> String {
    let Ok(bin) = embedded::find_bin_dir() else {
        return "PostgreSQL binaries not found".into();
    };
    std::process::Command::new(bin.join("postgres"))
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|e| format!("postgres --version failed: {e}"))
}

/// A `/proc`-style `name: value` line's value.
fn proc_field(text: &str, name: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == name).then(|| v.trim().to_string())
    })
}

/// A `/proc`-style `Name:   1234 kB` line's number.
pub(crate) fn proc_kib(text: &str, name: &str) -> Option<u64> {
    proc_field(text, name)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A temporary directory the `postgres` user can traverse, removed on drop.
pub(crate) struct TempRoot {
    pub(crate) path: PathBuf,
    keep: bool,
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
    async fn start(args: &BenchArgs, tallyd: PathBuf) -> Result<BenchEnv> {
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
        let env = BenchEnv {
            pg: Some(pg),
            root,
            conninfo,
            db,
            tallyd,
        };
        env.create_tables().await?;
        Ok(env)
    }

    /// The baselines' tables, and tallyd's schema (so it can be truncated before each daemon).
    async fn create_tables(&self) -> Result<()> {
        let mut client = self.db.connect().await?;
        client
            .batch_execute(
                "CREATE TABLE bench_naive (key text PRIMARY KEY, count bigint NOT NULL);
                 CREATE TABLE bench_slotted (key text NOT NULL, slot int NOT NULL,
                     count bigint NOT NULL, PRIMARY KEY (key, slot));
                 CREATE TABLE bench_events (id bigserial PRIMARY KEY, key text NOT NULL,
                     at timestamptz NOT NULL DEFAULT now());
                 CREATE TABLE bench_batch (key text PRIMARY KEY, count bigint NOT NULL);",
            )
            .await?;
        let config = self.daemon_config(Path::new("/"), 0, |_| {}).build();
        store::prepare(&mut client, &config).await?;
        Ok(())
    }

    async fn run_all(&self, scenarios: &[Scenario], args: &BenchArgs) -> Result<Vec<Outcome>> {
        let mut outcomes = Vec::with_capacity(scenarios.len());
        for &scenario in scenarios {
            println!("running {} ...", scenario.name());
            let outcome = self.run(scenario, args).await?;
            println!("  {}", outcome.summary());
            outcomes.push(outcome);
        }
        Ok(outcomes)
    }

    async fn run(&self, scenario: Scenario, args: &BenchArgs) -> Result<Outcome> {
        let seconds = Duration::from_secs(args.baseline_seconds);
        let name = scenario.name();
        match scenario {
            Scenario::Naive => self.per_event(name, PerEvent::Naive, args).await,
            Scenario::SlottedRandom => self.per_event(name, PerEvent::SlotRandom, args).await,
            Scenario::SlottedTime => self.per_event(name, PerEvent::SlotTime, args).await,
            Scenario::InsertOnly => self.per_event(name, PerEvent::Insert, args).await,
            Scenario::Batched => batched_ceiling(&self.db, seconds).await,
            Scenario::ServerUpsert => server_upsert(self, name, args.hc_keys).await,
            Scenario::Hot => {
                self.tallyd(name, |_| {}, hot_load(args.events, args.clients))
                    .await
            }
            Scenario::HcUniform | Scenario::HcZipf => {
                let dist = if scenario == Scenario::HcZipf {
                    KeyDist::Zipf
                } else {
                    KeyDist::Uniform
                };
                let load = tokio::task::spawn_blocking({
                    let (events, keys, clients) = (args.hc_events, args.hc_keys, args.clients);
                    move || spread_load(events, keys, clients, dist)
                })
                .await?;
                self.tallyd(name, |_| {}, load).await
            }
            Scenario::HotRollup => {
                let load = hot_load(args.events, args.clients);
                self.tallyd(name, rollup_and_journal, load).await
            }
            Scenario::CeilingEventDgram | Scenario::CeilingEventStream => {
                let t = per_event_transport(scenario);
                let (n, c) = (args.event_events, args.event_clients);
                self.per_event_ceiling(name, t, n, c).await
            }
            Scenario::EventDgram | Scenario::EventStream => {
                let t = per_event_transport(scenario);
                let (n, c) = (args.event_events, args.event_clients);
                self.per_event_tallyd(name, t, n, c).await
            }
            Scenario::Memory => self.memory_per_key(name, args.clients).await,
            Scenario::RollupFold => rollup_fold(&self.db, name).await,
        }
    }

    /// CPU seconds the bench's PostgreSQL has used so far (all its processes).
    pub(crate) fn server_cpu(&self) -> Result<f64> {
        let pid = self
            .pg
            .as_ref()
            .context("the bench's PostgreSQL has stopped")?
            .pid();
        crate::daemon::server_cpu_seconds(pid)
    }

    async fn stop(mut self) -> Result<()> {
        if let Some(pg) = self.pg.take() {
            tokio::task::spawn_blocking(move || pg.stop()).await??;
        }
        Ok(())
    }
}

fn per_event_transport(s: Scenario) -> Transport {
    match s {
        Scenario::CeilingEventDgram | Scenario::EventDgram => Transport::Datagram,
        _ => Transport::Stream,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::thousands;

    #[test]
    fn only_selects_a_name_or_a_group() {
        let args = |only: Option<&str>, skip| BenchArgs {
            connections: 1,
            baseline_seconds: 1,
            events: 1,
            hc_events: 1,
            hc_keys: 1,
            clients: 1,
            event_clients: 1,
            event_events: 1,
            skip_baselines: skip,
            only: only.map(String::from),
            fast_db: false,
        };
        assert_eq!(
            selected(&args(Some("tallyd-hot"), false)).unwrap(),
            vec![Scenario::Hot]
        );
        assert_eq!(
            selected(&args(Some("slotted"), false)).unwrap(),
            vec![Scenario::SlottedRandom, Scenario::SlottedTime]
        );
        // --skip-baselines leaves the eight tallyd scenarios, and the ceilings of two of them.
        assert_eq!(selected(&args(None, true)).unwrap().len(), 10);
        // A per-event scenario comes with its ceiling, run just before it.
        assert_eq!(
            selected(&args(Some("tallyd-event-dgram"), false)).unwrap(),
            vec![Scenario::CeilingEventDgram, Scenario::EventDgram]
        );
        assert!(selected(&args(Some("nope"), false)).is_err());
        // A list runs in the default order, each once.
        assert_eq!(
            selected(&args(
                Some("tallyd-hc-uniform,server-upsert,tallyd-hc"),
                false
            ))
            .unwrap(),
            vec![
                Scenario::ServerUpsert,
                Scenario::HcUniform,
                Scenario::HcZipf
            ]
        );
        assert_eq!(thousands(1234567.4), "1,234,567");
        assert_eq!(thousands(12.0), "12");
    }
}
