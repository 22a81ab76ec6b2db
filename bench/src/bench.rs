//! The scenarios of `tallyd-bench`: on a private PostgreSQL, measures one-statement-per-event upserts, insert-only,
//! the batched-upsert ceiling and the real daemon side by side, and checks the performance targets.
//!
//! Every approach runs in one process against one server, so the numbers compare like with like:
//! - baselines (naive, slotted, insert-only) run `--connections` sessions issuing one statement
//!   per event for `--baseline-seconds`; the batched ceiling is one session upserting 5,000
//!   distinct keys per statement;
//! - each tallyd scenario spawns `tallyd run` (the binary given to [`run`]) as a child process (fresh data dir, truncated
//!   tables) pointed at the bench's server, so its CPU and memory are measured apart from
//!   PostgreSQL's, sends pre-built buffers over the stream socket from `--clients` connections,
//!   times first byte to the last `!flush` answer, and checks `tallyd.totals` is exact.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::process::{Child, Command};

use tallyd::config::Config;
use tallyd::metrics as m;
use tallyd::store::embedded::{self, Embedded, EmbeddedOptions};
use tallyd::store::{self, Db};

/// The one key of the hot-key scenarios.
const HOT: &str = "hot";
/// The counter every daemon scenario writes.
const COUNTER: &str = "bench";
const SLOTS: i32 = 100;
/// Rows per statement of the batched ceiling, and the key space they are drawn from.
const BATCH_ROWS: usize = 5_000;
const BATCH_KEY_SPACE: usize = 1_000_000;
/// Bytes per client write: whole lines, up to this many.
const WRITE_BYTES: usize = 64 * 1024;
/// Pending keys for the memory check.
const MEMORY_KEYS: u64 = 1_000_000;
const ZIPF_S: f64 = 1.0;
/// The daemon's flush interval in every throughput scenario (its default).
const FLUSH_INTERVAL_MS: u64 = 1_000;
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_TIMEOUT: Duration = Duration::from_secs(120);

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
    /// Run only the tallyd scenarios.
    #[arg(long)]
    pub skip_baselines: bool,
    /// Run one scenario (or a group: `slotted`, `tallyd-hc`); see the list in the output.
    #[arg(long, value_name = "NAME")]
    pub only: Option<String>,
    /// fsync = off and synchronous_commit = off on the bench's PostgreSQL (not durable).
    #[arg(long)]
    pub fast_db: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    Naive,
    SlottedRandom,
    SlottedTime,
    InsertOnly,
    Batched,
    Hot,
    HcUniform,
    HcZipf,
    HotRollup,
    Memory,
    RollupFold,
}

const SCENARIOS: [Scenario; 11] = [
    Scenario::Naive,
    Scenario::SlottedRandom,
    Scenario::SlottedTime,
    Scenario::InsertOnly,
    Scenario::Batched,
    Scenario::Hot,
    Scenario::HcUniform,
    Scenario::HcZipf,
    Scenario::HotRollup,
    Scenario::Memory,
    Scenario::RollupFold,
];

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Naive => "naive",
            Scenario::SlottedRandom => "slotted-random",
            Scenario::SlottedTime => "slotted-time",
            Scenario::InsertOnly => "insert-only",
            Scenario::Batched => "batched",
            Scenario::Hot => "tallyd-hot",
            Scenario::HcUniform => "tallyd-hc-uniform",
            Scenario::HcZipf => "tallyd-hc-zipf",
            Scenario::HotRollup => "tallyd-hot-rollup-journal",
            Scenario::Memory => "tallyd-memory",
            Scenario::RollupFold => "tallyd-rollup-fold",
        }
    }

    fn is_baseline(self) -> bool {
        !self.name().starts_with("tallyd-")
    }
}

/// The scenarios `--only` and `--skip-baselines` leave: an exact name, else a `name-` group.
fn selected(args: &BenchArgs) -> Result<Vec<Scenario>> {
    let wanted = |s: &Scenario| !(args.skip_baselines && s.is_baseline());
    let Some(only) = args.only.as_deref() else {
        return Ok(SCENARIOS.iter().copied().filter(wanted).collect());
    };
    let exact: Vec<Scenario> = SCENARIOS
        .iter()
        .copied()
        .filter(|s| s.name() == only)
        .collect();
    let picked = if exact.is_empty() {
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
    Ok(picked.into_iter().filter(wanted).collect())
}

/// Runs the selected scenarios against the daemon binary `tallyd`, prints the table and the
/// target checks.
pub async fn run(args: BenchArgs, tallyd: PathBuf) -> Result<()> {
    ensure!(args.clients > 0, "--clients must be at least 1");
    ensure!(args.connections > 0, "--connections must be at least 1");
    ensure!(args.hc_keys > 0, "--hc-keys must be at least 1");
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

// ---------------------------------------------------------------------------------------------
// The machine and the private server

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
fn proc_kib(text: &str, name: &str) -> Option<u64> {
    proc_field(text, name)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A temporary directory the `postgres` user can traverse, removed on drop.
struct TempRoot {
    path: PathBuf,
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
struct BenchEnv {
    // Dropped in order: the server stops before its directory is removed.
    pg: Option<Embedded>,
    root: TempRoot,
    conninfo: String,
    db: Db,
    /// The daemon binary each tallyd scenario spawns.
    tallyd: PathBuf,
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
        let config = Config::from_toml(&self.daemon_config(Path::new("/"), 0, ""), Vec::new())?;
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
            Scenario::Hot => {
                self.tallyd(name, "", hot_load(args.events, args.clients))
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
                self.tallyd(name, "", load).await
            }
            Scenario::HotRollup => match journal_support() {
                Ok(()) => {
                    let extra = format!("{ROLLUP}{JOURNAL}");
                    self.tallyd(name, &extra, hot_load(args.events, args.clients))
                        .await
                }
                Err(why) => Ok(Outcome::not_run(name, why)),
            },
            Scenario::Memory => self.memory_per_key(name, args.clients).await,
            Scenario::RollupFold => rollup_fold(&self.db, name).await,
        }
    }

    async fn stop(mut self) -> Result<()> {
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

// ---------------------------------------------------------------------------------------------
// Baselines: one statement per event, and the batched ceiling

#[derive(Clone, Copy, Debug)]
enum PerEvent {
    Naive,
    SlotRandom,
    SlotTime,
    Insert,
}

impl PerEvent {
    fn sql(self) -> &'static str {
        match self {
            PerEvent::Naive => {
                "INSERT INTO bench_naive(key, count) VALUES ($1, 1) \
                 ON CONFLICT (key) DO UPDATE SET count = bench_naive.count + 1"
            }
            PerEvent::SlotRandom | PerEvent::SlotTime => {
                "INSERT INTO bench_slotted(key, slot, count) VALUES ($1, $2, 1) \
                 ON CONFLICT (key, slot) DO UPDATE SET count = bench_slotted.count + 1"
            }
            PerEvent::Insert => "INSERT INTO bench_events(key) VALUES ($1)",
        }
    }

    fn table(self) -> &'static str {
        match self {
            PerEvent::Naive => "bench_naive",
            PerEvent::SlotRandom | PerEvent::SlotTime => "bench_slotted",
            PerEvent::Insert => "bench_events",
        }
    }

    /// What the table must sum to after `n` statements.
    fn total_sql(self) -> &'static str {
        match self {
            PerEvent::Naive => "SELECT coalesce(sum(count), 0)::bigint FROM bench_naive",
            PerEvent::SlotRandom | PerEvent::SlotTime => {
                "SELECT coalesce(sum(count), 0)::bigint FROM bench_slotted"
            }
            PerEvent::Insert => "SELECT count(*) FROM bench_events",
        }
    }

    /// The slot of the next statement: random, or the clock's microseconds modulo 100.
    fn slot(self, rng: &mut StdRng) -> i32 {
        match self {
            PerEvent::SlotTime => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default();
                (now.subsec_micros() % SLOTS as u32) as i32
            }
            _ => rng.gen_range(0..SLOTS),
        }
    }
}

impl BenchEnv {
    /// `--connections` sessions, each issuing `kind`'s statement on the hot key until the deadline.
    async fn per_event(
        &self,
        name: &'static str,
        kind: PerEvent,
        args: &BenchArgs,
    ) -> Result<Outcome> {
        let admin = self.db.connect().await?;
        admin
            .batch_execute(&format!("TRUNCATE {}", kind.table()))
            .await?;
        let mut sessions = Vec::with_capacity(args.connections);
        for _ in 0..args.connections {
            let client = self.db.connect().await?;
            let stmt = client.prepare(kind.sql()).await?;
            sessions.push((client, stmt));
        }
        let started = Instant::now();
        let deadline = started + Duration::from_secs(args.baseline_seconds);
        let tasks: Vec<_> = sessions
            .into_iter()
            .map(|(client, stmt)| tokio::spawn(statement_loop(client, stmt, kind, deadline)))
            .collect();
        let mut total = 0u64;
        for task in tasks {
            total += task.await??;
        }
        let elapsed = started.elapsed();
        let stored: i64 = admin.query_one(kind.total_sql(), &[]).await?.get(0);
        ensure!(
            stored as u64 == total,
            "{name}: {total} statements committed but {} holds {stored}",
            kind.table()
        );
        Ok(Outcome::baseline(name, total, "stmt", elapsed))
    }
}

async fn statement_loop(
    client: tokio_postgres::Client,
    stmt: tokio_postgres::Statement,
    kind: PerEvent,
    deadline: Instant,
) -> Result<u64> {
    let mut rng = StdRng::from_entropy();
    let mut n = 0u64;
    while Instant::now() < deadline {
        match kind {
            PerEvent::Naive | PerEvent::Insert => client.execute(&stmt, &[&HOT]).await?,
            PerEvent::SlotRandom | PerEvent::SlotTime => {
                let slot = kind.slot(&mut rng);
                client.execute(&stmt, &[&HOT, &slot]).await?
            }
        };
        n += 1;
    }
    Ok(n)
}

/// One session upserting 5,000 distinct keys per statement: what PostgreSQL itself can absorb.
/// Slot rows folded per second by `tallyd.rollup()` steps of 1,000 rows, one session, from
/// 500,000 slot rows (250,000 keys, two slots each).
async fn rollup_fold(db: &Db, name: &'static str) -> Result<Outcome> {
    const KEYS: i64 = 250_000;
    let mut client = db.connect().await?;
    let config = Config::from_toml(&format!("[[counters]]\nname = \"{COUNTER}\"\n"), Vec::new())?;
    store::prepare(&mut client, &config).await?;
    client
        .batch_execute(&format!(
            "TRUNCATE tallyd.slots, tallyd.rollups;
             INSERT INTO tallyd.slots SELECT '{COUNTER}', 'k' || i, s, 1, now(), now()
               FROM generate_series(1, {KEYS}) i, generate_series(0, 1) s;"
        ))
        .await?;
    // Its own statement: a multi-statement batch runs as one transaction, and VACUUM refuses that.
    client.batch_execute("VACUUM ANALYZE tallyd.slots").await?;
    let started = Instant::now();
    let folded = tallyd::rollup::until_empty(&client, 1_000).await?;
    let elapsed = started.elapsed();
    let summed: i64 = client
        .query_one(
            "SELECT coalesce(sum(count), 0)::bigint FROM tallyd.rollups",
            &[],
        )
        .await?
        .get(0);
    ensure!(
        folded == 2 * KEYS && summed == 2 * KEYS,
        "{name}: folded {folded} rows summing to {summed}, expected {}",
        2 * KEYS
    );
    client
        .batch_execute("TRUNCATE tallyd.slots, tallyd.rollups")
        .await?;
    Ok(Outcome::baseline(name, folded as u64, "row", elapsed))
}

async fn batched_ceiling(db: &Db, seconds: Duration) -> Result<Outcome> {
    let client = db.connect().await?;
    client.batch_execute("TRUNCATE bench_batch").await?;
    let stmt = client
        .prepare(
            "INSERT INTO bench_batch(key, count) SELECT * FROM unnest($1::text[], $2::bigint[]) \
             ON CONFLICT (key) DO UPDATE SET count = bench_batch.count + EXCLUDED.count",
        )
        .await?;
    let mut rng = StdRng::from_entropy();
    let counts = vec![1i64; BATCH_ROWS];
    let started = Instant::now();
    let mut rows = 0u64;
    while started.elapsed() < seconds {
        let keys: Vec<String> = rand::seq::index::sample(&mut rng, BATCH_KEY_SPACE, BATCH_ROWS)
            .iter()
            .map(|k| format!("k{k}"))
            .collect();
        client.execute(&stmt, &[&keys, &counts]).await?;
        rows += BATCH_ROWS as u64;
    }
    let elapsed = started.elapsed();
    let stored: i64 = client
        .query_one(
            "SELECT coalesce(sum(count), 0)::bigint FROM bench_batch",
            &[],
        )
        .await?
        .get(0);
    ensure!(
        stored as u64 == rows,
        "batched: {rows} rows sent, table sums to {stored}"
    );
    Ok(Outcome::baseline("batched", rows, "row", elapsed))
}

// ---------------------------------------------------------------------------------------------
// Load: pre-built buffers of protocol lines, one per client

#[derive(Clone, Copy, Debug)]
enum KeyDist {
    Uniform,
    Zipf,
}

/// What the clients send, and what `tallyd.totals` must hold afterwards.
struct Load {
    buffers: Vec<Vec<u8>>,
    events: u64,
    keys: u64,
}

/// Events client `i` of `clients` sends, so that they add up to `events`.
fn share(events: u64, clients: usize, i: usize) -> u64 {
    let clients = clients as u64;
    events / clients + u64::from((i as u64) < events % clients)
}

fn hot_load(events: u64, clients: usize) -> Load {
    let line = format!("{COUNTER} {HOT}\n");
    Load {
        buffers: (0..clients)
            .map(|i| line.repeat(share(events, clients, i) as usize).into_bytes())
            .collect(),
        events,
        keys: u64::from(events > 0),
    }
}

/// `events` events over `keys` keys drawn from `dist`.
fn spread_load(events: u64, keys: u64, clients: usize, dist: KeyDist) -> Load {
    let zipf = matches!(dist, KeyDist::Zipf).then(|| Zipf::new(keys as usize, ZIPF_S));
    let mut rng = StdRng::from_entropy();
    let mut seen = vec![false; keys as usize];
    let buffers = (0..clients)
        .map(|i| {
            let n = share(events, clients, i);
            let mut buf = Vec::with_capacity(n as usize * 16);
            for _ in 0..n {
                let k = match &zipf {
                    Some(z) => z.sample(&mut rng),
                    None => rng.gen_range(0..keys),
                };
                seen[k as usize] = true;
                push_key_line(&mut buf, k);
            }
            buf
        })
        .collect();
    Load {
        buffers,
        events,
        keys: seen.iter().filter(|s| **s).count() as u64,
    }
}

/// Every key in `0..keys` once.
fn distinct_load(keys: u64, clients: usize) -> Load {
    let mut next = 0u64;
    let buffers = (0..clients)
        .map(|i| {
            let n = share(keys, clients, i);
            let mut buf = Vec::with_capacity(n as usize * 16);
            for k in next..next + n {
                push_key_line(&mut buf, k);
            }
            next += n;
            buf
        })
        .collect();
    Load {
        buffers,
        events: keys,
        keys,
    }
}

/// `bench k<n>\n`, without a formatter per line.
fn push_key_line(buf: &mut Vec<u8>, k: u64) {
    buf.extend_from_slice(COUNTER.as_bytes());
    buf.extend_from_slice(b" k");
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut n = k;
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    buf.extend_from_slice(&digits[i..]);
    buf.push(b'\n');
}

/// Zipf over ranks `0..n` (rank r has weight 1 / (r + 1)^s): a precomputed CDF, binary search.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Zipf {
        let mut sum = 0.0;
        let mut cdf: Vec<f64> = (1..=n)
            .map(|r| {
                sum += 1.0 / (r as f64).powf(s);
                sum
            })
            .collect();
        for c in &mut cdf {
            *c /= sum;
        }
        Zipf { cdf }
    }

    fn sample(&self, rng: &mut impl Rng) -> u64 {
        let u: f64 = rng.gen();
        let i = self.cdf.partition_point(|&c| c < u);
        i.min(self.cdf.len() - 1) as u64
    }
}

// ---------------------------------------------------------------------------------------------
// The daemon under test

const ROLLUP: &str = "[rollup]\nenabled = true\ninterval_ms = 200\n";
const JOURNAL: &str = "[journal]\nfsync = \"interval\"\n";

/// Ok when this build's config knows `[journal] fsync`, else why the journal row is not run.
fn journal_support() -> Result<(), String> {
    let text = format!("{JOURNAL}[[counters]]\nname = \"{COUNTER}\"\n");
    match Config::from_toml(&text, Vec::new()) {
        Ok(_) => Ok(()),
        Err(e) if e.to_string().contains("unknown field") => {
            Err("n/a (journal not built yet)".into())
        }
        Err(e) => Err(format!("n/a ({e})")),
    }
}

fn toml_str(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

impl BenchEnv {
    /// The daemon's config: this server (not embedded), sockets in `dir`, metrics on `port`,
    /// rollup off; `extra` TOML sections are appended (sections must not repeat these).
    fn daemon_config(&self, dir: &Path, port: u16, extra: &str) -> String {
        let path = |p: &str| toml_str(&dir.join(p).to_string_lossy());
        let rollup = if extra.contains("[rollup]") {
            ""
        } else {
            "[rollup]\nenabled = false\n"
        };
        let flush = if extra.contains("[flush]") {
            String::new()
        } else {
            format!("[flush]\ninterval_ms = {FLUSH_INTERVAL_MS}\n")
        };
        format!(
            "[daemon]\ndata_dir = {data}\ndrain_timeout_ms = 1000\n\
             [database]\nurl = {url}\n\
             [listen]\nsocket = {sock}\ndatagram_socket = \"\"\n\
             {flush}{rollup}\
             [metrics]\nlisten = \"127.0.0.1:{port}\"\n\
             [log]\nlevel = \"warn\"\n\
             {extra}\
             [[counters]]\nname = \"{COUNTER}\"\nkey_type = \"text\"\n",
            data = path("data"),
            url = toml_str(&self.conninfo),
            sock = path("tallyd.sock"),
        )
    }

    /// Empty tallyd tables, so each daemon starts from nothing.
    async fn reset_tallyd_tables(&self) -> Result<()> {
        let client = self.db.connect().await?;
        client
            .batch_execute("TRUNCATE tallyd.slots, tallyd.rollups, tallyd.flushes")
            .await?;
        Ok(())
    }

    async fn spawn_daemon(&self, name: &str, extra: &str) -> Result<Daemon> {
        self.reset_tallyd_tables().await?;
        let dir = self.root.path.join(name);
        std::fs::create_dir_all(&dir)?;
        let port = free_port()?;
        let config = dir.join("config.toml");
        std::fs::write(&config, self.daemon_config(&dir, port, extra))?;
        Daemon::spawn(&self.tallyd, &dir, &config, port).await
    }

    /// Sends `load`, waits for every `!flush`, scrapes the daemon, checks the totals are exact.
    async fn tallyd(&self, name: &'static str, extra: &str, load: Load) -> Result<Outcome> {
        let daemon = self.spawn_daemon(name, extra).await?;
        let before = Usage::take(&daemon).await?;
        let (events, keys) = (load.events, load.keys);
        let sent = send(&daemon.socket, load.buffers, true).await?;
        let after = Usage::take(&daemon).await?;
        let peak_kib = daemon.status_kib("VmHWM")?;
        let accepted = flush_replies(&sent.replies)?;
        ensure!(
            accepted == events,
            "{name}: sent {events} events, tallyd accepted {accepted} (see {})",
            daemon.log.display()
        );
        self.check_totals(name, events, keys).await?;
        daemon.stop().await?;
        let mut note = format!(
            "exact: {events} events, {keys} key{}",
            if keys == 1 { "" } else { "s" }
        );
        let paused = after.paused_s - before.paused_s;
        if paused > 0.0 {
            let _ = write!(note, "; readers paused {paused:.1} s at max_pending_keys");
        }
        Ok(Outcome::daemon(
            name,
            events,
            sent.elapsed,
            DaemonStats {
                ingest: sent.ingest,
                flow: Some(Flow::between(&before, &after)),
                peak_rss_mib: peak_kib as f64 / 1024.0,
                bytes_per_key: None,
            },
            note,
        ))
    }

    async fn check_totals(&self, name: &str, events: u64, keys: u64) -> Result<()> {
        let client = self.db.connect().await?;
        let row = client
            .query_one(
                "SELECT count(*), coalesce(sum(count), 0)::bigint FROM tallyd.totals \
                 WHERE counter = $1",
                &[&COUNTER],
            )
            .await?;
        let (stored_keys, stored_events): (i64, i64) = (row.get(0), row.get(1));
        ensure!(
            stored_events as u64 == events && stored_keys as u64 == keys,
            "{name}: NOT EXACT: sent {events} events on {keys} keys, tallyd.totals holds \
             {stored_events} events on {stored_keys} keys"
        );
        Ok(())
    }

    /// RSS per pending key: 1,000,000 distinct keys held (no flush), RSS over the idle daemon's.
    async fn memory_per_key(&self, name: &'static str, clients: usize) -> Result<Outcome> {
        let extra = "[flush]\ninterval_ms = 600000\nmax_pending_keys = 2000000\n\
                     [coalesce]\nmax_pending_keys = 2000000\n";
        let daemon = self.spawn_daemon(name, extra).await?;
        let idle_kib = daemon.status_kib("VmRSS")?;
        let load = tokio::task::spawn_blocking(move || distinct_load(MEMORY_KEYS, clients)).await?;
        let sent = send(&daemon.socket, load.buffers, false).await?;
        let loaded_kib = settled_rss(&daemon).await?;
        let peak_kib = daemon.status_kib("VmHWM")?;
        // Nothing to keep: killing skips the final flush of a million keys.
        daemon.kill().await;
        let per_key = (loaded_kib.saturating_sub(idle_kib) * 1024) as f64 / MEMORY_KEYS as f64;
        let stats = DaemonStats {
            ingest: sent.ingest,
            flow: None,
            peak_rss_mib: peak_kib as f64 / 1024.0,
            bytes_per_key: Some(per_key),
        };
        Ok(Outcome::daemon(
            name,
            MEMORY_KEYS,
            sent.elapsed,
            stats,
            format!(
                "RSS {:.1} -> {:.1} MiB: {per_key:.0} B/pending key",
                idle_kib as f64 / 1024.0,
                loaded_kib as f64 / 1024.0
            ),
        ))
    }
}

/// `pong` means the listener has read every byte; the bucket actors may still be adding keys.
/// Waits until RSS stops growing (3 equal readings 100 ms apart, at most 10 s).
async fn settled_rss(daemon: &Daemon) -> Result<u64> {
    let mut last = daemon.status_kib("VmRSS")?;
    let mut steady = 0;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = daemon.status_kib("VmRSS")?;
        steady = if now == last { steady + 1 } else { 0 };
        last = now;
        if steady == 3 {
            break;
        }
    }
    Ok(last)
}

fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// `tallyd run` as a child process: killed if dropped while running.
struct Daemon {
    child: Child,
    pid: u32,
    socket: PathBuf,
    metrics: String,
    log: PathBuf,
}

impl Daemon {
    async fn spawn(tallyd: &Path, dir: &Path, config: &Path, port: u16) -> Result<Daemon> {
        let log = dir.join("tallyd.log");
        let mut cmd = Command::new(tallyd);
        cmd.arg("--config")
            .arg(config)
            .arg("run")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .kill_on_drop(true);
        // The generated config is the whole truth: no TALLYD_* or RUST_LOG overrides.
        for (var, _) in std::env::vars() {
            if var.starts_with("TALLYD_") || var == "RUST_LOG" {
                cmd.env_remove(var);
            }
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("spawning {} run", tallyd.display()))?;
        let pid = child.id().context("tallyd exited at once")?;
        let mut daemon = Daemon {
            child,
            pid,
            socket: dir.join("tallyd.sock"),
            metrics: format!("127.0.0.1:{port}"),
            log,
        };
        daemon.wait_ready().await?;
        Ok(daemon)
    }

    /// Polls the socket until `!ping` answers: the daemon has no readiness notification.
    async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if ping(&self.socket).await {
                return Ok(());
            }
            if let Some(status) = self.child.try_wait()? {
                bail!("tallyd run exited ({status}); log: {}", self.log.display());
            }
            ensure!(
                Instant::now() < deadline,
                "tallyd did not answer within {STARTUP_TIMEOUT:?}; log: {}",
                self.log.display()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn status_kib(&self, field: &str) -> Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid))?;
        proc_kib(&status, field).with_context(|| format!("no {field} in /proc/{}/status", self.pid))
    }

    /// utime + stime, in seconds.
    fn cpu_seconds(&self) -> Result<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid))?;
        cpu_ticks(&stat)
            .map(|t| t as f64 / clock_ticks())
            .context("unreadable /proc/<pid>/stat")
    }

    /// SIGTERM, then waits for the final flush and exit.
    async fn stop(mut self) -> Result<()> {
        // SAFETY: signalling our own child, which has not been reaped yet.
        unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGTERM) };
        let status = tokio::time::timeout(STOP_TIMEOUT, self.child.wait())
            .await
            .context("tallyd did not stop after SIGTERM")??;
        ensure!(
            status.success(),
            "tallyd exited with {status}; log: {}",
            self.log.display()
        );
        Ok(())
    }

    async fn kill(mut self) {
        let _ = self.child.kill().await;
    }
}

async fn ping(socket: &Path) -> bool {
    let Ok(stream) = UnixStream::connect(socket).await else {
        return false;
    };
    let (rd, mut wr) = stream.into_split();
    if wr.write_all(b"!ping\n").await.is_err() {
        return false;
    }
    let mut reader = BufReader::new(rd);
    let mut line = String::new();
    let read = reader.read_line(&mut line);
    let answered = matches!(
        tokio::time::timeout(Duration::from_secs(5), read).await,
        Ok(Ok(_))
    );
    answered && line == "pong\n"
}

/// `/proc/<pid>/stat` fields 14 and 15 (utime, stime), counted after the `)` that ends the name.
fn cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

// ---------------------------------------------------------------------------------------------
// Clients

struct Sent {
    /// First byte to the last `pong`: every byte read and handed to the buckets.
    ingest: Duration,
    /// First byte to the last `!flush` answer (equal to `ingest` without `!flush`).
    elapsed: Duration,
    /// The `!flush` answers.
    replies: Vec<String>,
}

/// Connects one client per buffer, then, timed from the first byte: each writes its buffer in
/// line-aligned writes of up to 64 KiB, then `!ping` (ingested once answered), then, with
/// `flush`, `!flush` (committed once answered).
async fn send(socket: &Path, buffers: Vec<Vec<u8>>, flush: bool) -> Result<Sent> {
    let mut streams = Vec::with_capacity(buffers.len());
    for _ in &buffers {
        streams.push(UnixStream::connect(socket).await?);
    }
    let started = Instant::now();
    let tasks: Vec<_> = streams
        .into_iter()
        .zip(buffers)
        .map(|(stream, buf)| tokio::spawn(client(stream, buf, flush)))
        .collect();
    let mut ingested = started;
    let mut replies = Vec::with_capacity(tasks.len());
    for task in tasks {
        let (pong_at, reply) = task.await??;
        ingested = ingested.max(pong_at);
        replies.extend(reply);
    }
    Ok(Sent {
        ingest: ingested - started,
        elapsed: started.elapsed(),
        replies,
    })
}

/// When `!ping` was answered, and the answer to `!flush` if sent.
async fn client(
    stream: UnixStream,
    buf: Vec<u8>,
    flush: bool,
) -> Result<(Instant, Option<String>)> {
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::new(rd);
    let mut rest = &buf[..];
    while !rest.is_empty() {
        let end = if rest.len() <= WRITE_BYTES {
            rest.len()
        } else {
            memchr::memrchr(b'\n', &rest[..WRITE_BYTES]).map_or(WRITE_BYTES, |i| i + 1)
        };
        wr.write_all(&rest[..end]).await?;
        rest = &rest[end..];
    }
    wr.write_all(b"!ping\n").await?;
    let pong = read_reply(&mut rd).await?;
    let pong_at = Instant::now();
    ensure!(pong == "pong", "unexpected reply to !ping: {pong:?}");
    if !flush {
        return Ok((pong_at, None));
    }
    wr.write_all(b"!flush\n").await?;
    Ok((pong_at, Some(read_reply(&mut rd).await?)))
}

async fn read_reply(rd: &mut BufReader<tokio::net::unix::OwnedReadHalf>) -> Result<String> {
    let mut line = String::new();
    rd.read_line(&mut line).await?;
    ensure!(!line.is_empty(), "tallyd closed the connection");
    Ok(line.trim_end().to_string())
}

/// Sum of `ok <accepted> <rejected>` replies; any rejection is an error.
fn flush_replies(replies: &[String]) -> Result<u64> {
    let mut accepted = 0;
    for reply in replies {
        let f: Vec<&str> = reply.split(' ').collect();
        match f.as_slice() {
            ["ok", a, "0"] => accepted += a.parse::<u64>()?,
            _ => bail!("unexpected reply to !flush: {reply:?}"),
        }
    }
    Ok(accepted)
}

// ---------------------------------------------------------------------------------------------
// The daemon's own numbers: CPU and its Prometheus endpoint

/// CPU seconds and a metrics scrape at one moment.
struct Usage {
    cpu_s: f64,
    rows: f64,
    /// Time readers waited at `coalesce.max_pending_keys`, summed over connections.
    paused_s: f64,
    freshness: Vec<(f64, f64)>,
}

impl Usage {
    async fn take(daemon: &Daemon) -> Result<Usage> {
        let text = scrape(&daemon.metrics).await?;
        Ok(Usage {
            cpu_s: daemon.cpu_seconds()?,
            rows: metric_value(&text, m::FLUSH_ROWS).unwrap_or(0.0),
            paused_s: metric_value(&text, &format!("{}_sum", m::BACKPRESSURE_PAUSE)).unwrap_or(0.0),
            freshness: histogram_buckets(&text, m::FRESHNESS),
        })
    }
}

/// GET /metrics over HTTP/1.0, so the body is plain (not chunked) and ends at close.
async fn scrape(addr: &str) -> Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to the metrics endpoint {addr}"))?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("malformed HTTP response from the metrics endpoint")?;
    ensure!(head.contains(" 200 "), "metrics endpoint answered {head:?}");
    Ok(body.to_string())
}

/// The value of an unlabelled sample `name`.
fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok())?
    })
}

/// `(le, cumulative count)` of histogram `name`, in order; `+Inf` as infinity.
fn histogram_buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{le=\"");
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (le, value) = rest.split_once("\"}")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, value.trim().parse().ok()?))
        })
        .collect()
}

/// Per-bucket difference of two scrapes of one histogram.
fn histogram_delta(before: &[(f64, f64)], after: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let old: HashMap<u64, f64> = before.iter().map(|(le, c)| (le.to_bits(), *c)).collect();
    after
        .iter()
        .map(|(le, c)| (*le, c - old.get(&le.to_bits()).copied().unwrap_or(0.0)))
        .collect()
}

/// Quantile `q` from cumulative buckets, interpolating linearly inside the bucket it falls in
/// (from 0 for the first); in the `+Inf` bucket, the largest finite bound.
fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for &(le, cum) in buckets {
        if cum >= rank && cum > below {
            if le.is_infinite() {
                return Some(lower);
            }
            return Some(lower + (le - lower) * (rank - below) / (cum - below));
        }
        lower = if le.is_finite() { le } else { lower };
        below = cum;
    }
    Some(lower)
}

// ---------------------------------------------------------------------------------------------
// Results

/// What the daemon under test did: only tallyd scenarios have this.
struct DaemonStats {
    /// First byte to the last `pong`: every event read and handed to the buckets.
    ingest: Duration,
    /// None for the memory check, which never flushes.
    flow: Option<Flow>,
    peak_rss_mib: f64,
    bytes_per_key: Option<f64>,
}

/// Between the first byte and the last `!flush` answer.
struct Flow {
    rows: f64,
    cpu_s: f64,
    p50: Option<f64>,
    p99: Option<f64>,
}

impl Flow {
    fn between(before: &Usage, after: &Usage) -> Flow {
        let freshness = histogram_delta(&before.freshness, &after.freshness);
        Flow {
            rows: after.rows - before.rows,
            cpu_s: after.cpu_s - before.cpu_s,
            p50: quantile(&freshness, 0.50),
            p99: quantile(&freshness, 0.99),
        }
    }
}

struct Outcome {
    name: &'static str,
    /// None: not run (the note says why).
    total: Option<u64>,
    unit: &'static str,
    elapsed: Duration,
    daemon: Option<DaemonStats>,
    note: String,
}

impl Outcome {
    fn baseline(name: &'static str, total: u64, unit: &'static str, elapsed: Duration) -> Self {
        Outcome {
            name,
            total: Some(total),
            unit,
            elapsed,
            daemon: None,
            note: "exact".into(),
        }
    }

    fn daemon(
        name: &'static str,
        total: u64,
        elapsed: Duration,
        stats: DaemonStats,
        note: String,
    ) -> Self {
        Outcome {
            name,
            total: Some(total),
            unit: if stats.flow.is_some() { "event" } else { "key" },
            elapsed,
            daemon: Some(stats),
            note,
        }
    }

    fn not_run(name: &'static str, why: String) -> Self {
        Outcome {
            name,
            total: None,
            unit: "",
            elapsed: Duration::ZERO,
            daemon: None,
            note: why,
        }
    }

    fn per_second(&self, took: Duration) -> Option<f64> {
        let secs = took.as_secs_f64();
        self.total.filter(|_| secs > 0.0).map(|t| t as f64 / secs)
    }

    /// Statements, rows or events per second, to commit.
    fn rate(&self) -> Option<f64> {
        self.per_second(self.elapsed)
    }

    fn ingest_rate(&self) -> Option<f64> {
        self.per_second(self.daemon.as_ref()?.ingest)
    }

    fn flow(&self) -> Option<&Flow> {
        self.daemon.as_ref()?.flow.as_ref()
    }

    fn rows_per_s(&self) -> Option<f64> {
        let rows = self.flow()?.rows;
        (rows > 0.0).then(|| rows / self.elapsed.as_secs_f64())
    }

    fn events_per_row(&self) -> Option<f64> {
        let rows = self.flow()?.rows;
        (rows > 0.0).then(|| self.total.unwrap_or(0) as f64 / rows)
    }

    fn cpu_per_million(&self) -> Option<f64> {
        let events = self.total? as f64;
        (events > 0.0).then(|| self.flow().map(|f| f.cpu_s / (events / 1e6)))?
    }

    fn summary(&self) -> String {
        let Some(rate) = self.rate() else {
            return self.note.clone();
        };
        let ingest = self.ingest_rate().map_or_else(String::new, |r| {
            format!(" (ingest {} {}/s)", thousands(r), self.unit)
        });
        format!(
            "{} {}s in {:.2} s: {} {}/s{ingest}; {}",
            thousands(self.total.unwrap_or(0) as f64),
            self.unit,
            self.elapsed.as_secs_f64(),
            thousands(rate),
            self.unit,
            self.note
        )
    }

    fn cells(&self) -> Vec<String> {
        let dash = || "-".to_string();
        let Some(total) = self.total else {
            let mut row = vec![self.name.to_string()];
            row.extend((2..HEADER.len()).map(|_| dash()));
            row.push(self.note.clone());
            return row;
        };
        let opt = |v: Option<f64>, f: fn(f64) -> String| v.map_or_else(dash, f);
        let ms = |v: f64| format!("{:.0}", v * 1000.0);
        let flow = self.flow();
        vec![
            self.name.to_string(),
            thousands(total as f64),
            format!("{:.2} s", self.elapsed.as_secs_f64()),
            self.rate()
                .map_or_else(dash, |r| format!("{} {}/s", thousands(r), self.unit)),
            opt(self.ingest_rate(), thousands),
            opt(self.rows_per_s(), thousands),
            opt(self.events_per_row(), |v| {
                if v >= 1000.0 {
                    thousands(v)
                } else {
                    format!("{v:.1}")
                }
            }),
            opt(self.cpu_per_million(), |v| format!("{v:.3}")),
            opt(self.daemon.as_ref().map(|d| d.peak_rss_mib), |v| {
                format!("{v:.1}")
            }),
            opt(flow.and_then(|f| f.p50), ms),
            opt(flow.and_then(|f| f.p99), ms),
            self.note.clone(),
        ]
    }
}

/// Thousands separators, no decimals.
fn thousands(v: f64) -> String {
    let digits = format!("{:.0}", v.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if v < 0.0 {
        out.insert(0, '-');
    }
    out
}

const HEADER: [&str; 12] = [
    "approach",
    "total",
    "elapsed",
    "rate (to commit)",
    "ingest ev/s",
    "rows/s",
    "ev/row",
    "CPU s/M ev",
    "peak RSS MiB",
    "p50 ms",
    "p99 ms",
    "check",
];

/// The plain-text table: names left-aligned, numbers right-aligned, the check column last.
fn table(outcomes: &[Outcome]) -> String {
    let rows: Vec<Vec<String>> = std::iter::once(HEADER.iter().map(|h| h.to_string()).collect())
        .chain(outcomes.iter().map(Outcome::cells))
        .collect();
    let widths: Vec<usize> = (0..HEADER.len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in &rows {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            let w = widths[c];
            let _ = match c {
                0 => write!(line, "{cell:<w$}"),
                c if c == HEADER.len() - 1 => write!(line, "  {cell}"),
                _ => write!(line, "  {cell:>w$}"),
            };
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn find<'a>(outcomes: &'a [Outcome], name: &str) -> Option<&'a Outcome> {
    outcomes
        .iter()
        .find(|o| o.name == name && o.total.is_some())
}

/// One target: `None` when a scenario it needs did not run.
fn check(label: &str, result: Option<(bool, String)>) -> String {
    match result {
        Some((true, detail)) => format!("PASS  {label}: {detail}"),
        Some((false, detail)) => format!("FAIL  {label}: {detail}"),
        None => format!("SKIP  {label}: needs scenarios that did not run"),
    }
}

fn checks(outcomes: &[Outcome]) -> Vec<String> {
    let hot = find(outcomes, Scenario::Hot.name());
    let slotted = [Scenario::SlottedRandom, Scenario::SlottedTime]
        .iter()
        .filter_map(|s| find(outcomes, s.name()).and_then(Outcome::rate))
        .reduce(f64::max);
    let batched = find(outcomes, Scenario::Batched.name()).and_then(Outcome::rate);
    let mut lines = vec![check(
        "hot-key tallyd events/s >= 100x the better slotted baseline",
        hot.and_then(Outcome::rate).zip(slotted).map(|(t, s)| {
            let ratio = t / s;
            (
                ratio >= 100.0,
                format!("{} vs {} = {ratio:.1}x", thousands(t), thousands(s)),
            )
        }),
    )];
    for s in [Scenario::HcUniform, Scenario::HcZipf] {
        let hc = find(outcomes, s.name());
        lines.push(check(
            &format!("{} rows/s >= 70% of the batched ceiling", s.name()),
            hc.and_then(Outcome::rows_per_s).zip(batched).map(|(r, b)| {
                let ratio = r / b;
                (
                    ratio >= 0.7,
                    format!(
                        "{} vs {} rows/s = {:.0}%",
                        thousands(r),
                        thousands(b),
                        ratio * 100.0
                    ),
                )
            }),
        ));
        lines.push(check(
            &format!("{} >= 1,000,000 events/s ingested", s.name()),
            hc.and_then(|o| Some((o.ingest_rate()?, o.rate()?)))
                .map(|(i, r)| {
                    (
                        i >= 1e6,
                        format!(
                            "ingest {} events/s (to commit: {} events/s)",
                            thousands(i),
                            thousands(r)
                        ),
                    )
                }),
        ));
    }
    lines.push(check(
        "hot-key CPU <= 0.5 s per million events",
        hot.and_then(Outcome::cpu_per_million)
            .map(|c| (c <= 0.5, format!("{c:.3} s per million events"))),
    ));
    lines.push(check(
        "<= 200 bytes RSS per pending key (1,000,000 keys)",
        find(outcomes, Scenario::Memory.name())
            .and_then(|o| o.daemon.as_ref()?.bytes_per_key)
            .map(|b| (b <= 200.0, format!("{b:.0} bytes per key"))),
    ));
    let bound = (FLUSH_INTERVAL_MS + 250) as f64 / 1000.0;
    lines.push(check(
        &format!("hot-key p99 event-to-commit <= flush interval + 250 ms ({bound:.2} s)"),
        hot.and_then(|o| o.flow()?.p99)
            .map(|p| (p <= bound, format!("p99 {:.0} ms", p * 1000.0))),
    ));
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantile_interpolates_within_the_bucket() {
        let buckets = [(0.1, 0.0), (0.5, 10.0), (1.0, 20.0), (f64::INFINITY, 20.0)];
        let close = |q: Option<f64>, want: f64| q.is_some_and(|v| (v - want).abs() < 1e-9);
        assert!(close(quantile(&buckets, 0.25), 0.3));
        assert_eq!(quantile(&buckets, 0.5), Some(0.5));
        assert_eq!(quantile(&buckets, 0.75), Some(0.75));
        let first = [(1.0, 4.0), (f64::INFINITY, 4.0)];
        assert_eq!(quantile(&first, 0.5), Some(0.5));
        let overflow = [(1.0, 0.0), (f64::INFINITY, 3.0)];
        assert_eq!(quantile(&overflow, 0.99), Some(1.0));
        assert_eq!(quantile(&[(1.0, 0.0), (f64::INFINITY, 0.0)], 0.5), None);
    }

    #[test]
    fn scrape_parsing() {
        let text = "# TYPE tallyd_flush_rows_total counter\n\
                    tallyd_flush_rows_total 42\n\
                    tallyd_flush_rows_totally 7\n\
                    tallyd_event_to_commit_seconds_bucket{le=\"0.5\"} 1\n\
                    tallyd_event_to_commit_seconds_bucket{le=\"+Inf\"} 3\n\
                    tallyd_event_to_commit_seconds_sum 2.5\n";
        assert_eq!(metric_value(text, m::FLUSH_ROWS), Some(42.0));
        assert_eq!(
            histogram_buckets(text, m::FRESHNESS),
            vec![(0.5, 1.0), (f64::INFINITY, 3.0)]
        );
        let delta = histogram_delta(&[(0.5, 1.0)], &[(0.5, 4.0), (f64::INFINITY, 9.0)]);
        assert_eq!(delta, vec![(0.5, 3.0), (f64::INFINITY, 9.0)]);
    }

    #[test]
    fn stat_ticks_skip_the_process_name() {
        let stat = "123 (tall yd) S 1 123 123 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 9 0";
        assert_eq!(cpu_ticks(stat), Some(300));
    }

    #[test]
    fn loads_add_up() {
        let load = hot_load(10, 3);
        let lines: usize = load
            .buffers
            .iter()
            .map(|b| b.split(|&c| c == b'\n').count() - 1)
            .sum();
        assert_eq!((lines, load.events, load.keys), (10, 10, 1));
        let load = distinct_load(1001, 4);
        let text: Vec<u8> = load.buffers.concat();
        assert!(text.starts_with(b"bench k0\nbench k1\n"));
        assert!(text.ends_with(b"bench k1000\n"));
        let load = spread_load(5000, 50, 2, KeyDist::Uniform);
        assert_eq!(
            load.buffers
                .concat()
                .iter()
                .filter(|&&c| c == b'\n')
                .count(),
            5000
        );
        assert!(load.keys <= 50 && load.keys > 40);
    }

    #[test]
    fn zipf_follows_its_weights() {
        let zipf = Zipf::new(1000, 1.0);
        let mut rng = StdRng::seed_from_u64(7);
        let n = 200_000;
        let top = (0..n).filter(|_| zipf.sample(&mut rng) == 0).count() as f64 / n as f64;
        let harmonic: f64 = (1..=1000).map(|r| 1.0 / r as f64).sum();
        assert!((top - 1.0 / harmonic).abs() < 0.01, "rank 0 share {top}");
        assert!((0..1000).all(|_| zipf.sample(&mut rng) < 1000));
    }

    #[test]
    fn only_selects_a_name_or_a_group() {
        let args = |only: Option<&str>, skip| BenchArgs {
            connections: 1,
            baseline_seconds: 1,
            events: 1,
            hc_events: 1,
            hc_keys: 1,
            clients: 1,
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
        // --skip-baselines leaves the six tallyd scenarios.
        assert_eq!(selected(&args(None, true)).unwrap().len(), 6);
        assert!(selected(&args(Some("nope"), false)).is_err());
        assert_eq!(thousands(1234567.4), "1,234,567");
        assert_eq!(thousands(12.0), "12");
    }
}
