//! The run of `tallyd-bench`: it starts the bench's private PostgreSQL (env.rs), runs the
//! selected scenarios (scenario.rs) on it and prints the table and the target checks
//! (report.rs). It measures one-statement-per-event upserts, insert-only, the batched-upsert
//! ceiling, the Redis-buffered per-day peer (redis_daily.rs) and the real daemon side by side,
//! and what a kill -9 loses (kill.rs).
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

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Result};

use tallyd::store::{self, embedded};

use crate::baselines::{batched_ceiling, rollup_fold, server_upsert, PerEvent};
use crate::daemon::{rollup_and_journal, Counting, DAY_ZONE};
use crate::env::{BenchArgs, BenchEnv};
use crate::load::UniqueLoad;
use crate::load::{hot_load, spread_load, unique_hot_load, unique_spread_load, KeyDist, Load};
use crate::per_event::Transport;
use crate::procfs::{proc_field, proc_kib};
use crate::redis::find_redis_server;
use crate::redis_daily::NO_REDIS;
use crate::report::{checks, peers, table, Outcome};
use crate::scenario::{selected, Scenario};
use crate::sustained::Sink;
use crate::unique::NO_HLL;

/// `--only statsd-side-by-side` (bench/src/statsd.rs): not in the default run, since it needs
/// node and the reference statsd server (`npm ci` in bench/statsd-reference).
const STATSD_SIDE_BY_SIDE: &str = "statsd-side-by-side";
/// The days `tallyd-day-memory-10-days` spreads its (key, day) pairs over.
const MEMORY_DAYS: u64 = 10;
/// Distinct values each key gets in `tallyd-unique-hc` and `redis-pfadd-hc`.
const VALUES_PER_KEY: u64 = 3;

async fn statsd_side_by_side(args: &BenchArgs, tallyd: PathBuf) -> Result<()> {
    println!("{}", machine_description());
    let mut env = start_env(args, tallyd).await?;
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
    let mut env = start_env(&args, tallyd).await?;
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
    for line in checks(&outcomes).into_iter().chain(peers(&outcomes)) {
        println!("{line}");
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

/// The bench's PostgreSQL, with the baselines' tables and tallyd's schema in it.
async fn start_env(args: &BenchArgs, tallyd: PathBuf) -> Result<BenchEnv> {
    let env = BenchEnv::start(args, tallyd).await?;
    env.create_tables().await?;
    Ok(env)
}

impl BenchEnv {
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
            if scenario == Scenario::Import {
                // Its peer, in the same run, on the same events, after it: the peer leaves
                // PostgreSQL a checkpoint and a vacuum of a million fresh rows behind, which
                // would slow whichever tallyd run came next.
                let load = hc_load(args, KeyDist::Uniform).await?;
                let buffers = load.buffers.clone();
                let (events, keys) = (load.events, load.keys);
                let outcome = self.tallyd_import(scenario.name(), load).await?;
                println!("  {}", outcome.summary());
                let load = Load {
                    buffers,
                    events,
                    keys,
                };
                let peer = self.crates_io_importer(&load).await?;
                println!("  {}", peer.summary());
                if let (Some(t), Some(p)) = (outcome.rate(), peer.rate()) {
                    println!(
                        "PEER  {} / {} events/s to commit: {:.0} vs {:.0} = {:.1}x",
                        scenario.name(),
                        crate::import::PEER,
                        t,
                        p,
                        t / p
                    );
                }
                outcomes.push(peer);
                outcomes.push(outcome);
                continue;
            }
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
            Scenario::Hot | Scenario::DayHot => {
                let load = hot_load(args.events, args.clients);
                self.tallyd(name, counting(scenario), |_| {}, load).await
            }
            Scenario::HcUniform | Scenario::DayHcUniform | Scenario::HcZipf => {
                let dist = if scenario == Scenario::HcZipf {
                    KeyDist::Zipf
                } else {
                    KeyDist::Uniform
                };
                let load = hc_load(args, dist).await?;
                self.tallyd(name, counting(scenario), |_| {}, load).await
            }
            Scenario::TableDayHc | Scenario::TableDayHcRollup => {
                let load = hc_load(args, KeyDist::Uniform).await?;
                let direct = scenario == Scenario::TableDayHc;
                self.tallyd_to_table(name, direct, DAY_ZONE, load).await
            }
            Scenario::Import => {
                let load = hc_load(args, KeyDist::Uniform).await?;
                self.tallyd_import(name, load).await
            }
            Scenario::UniqueHot | Scenario::UniqueHc => {
                if !self.hll_ready().await? {
                    return Ok(Outcome::skipped(name, NO_HLL.into()));
                }
                let load = unique_load(scenario, args).await?;
                self.tallyd_unique(name, load).await
            }
            Scenario::HllUpsertHot => self.hll_upsert(name, args).await,
            Scenario::RedisPfaddHot | Scenario::RedisPfaddHc => {
                let Some(redis) = find_redis_server() else {
                    return Ok(Outcome::skipped(name, NO_REDIS.into()));
                };
                let load = unique_load(scenario, args).await?;
                self.redis_pfadd(name, redis, load).await
            }
            Scenario::HotRollup => {
                let load = hot_load(args.events, args.clients);
                self.tallyd(name, Counting::AllTime, rollup_and_journal, load)
                    .await
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
            Scenario::Memory | Scenario::DayMemory | Scenario::DayMemoryDays => {
                let days = if scenario == Scenario::DayMemoryDays {
                    MEMORY_DAYS
                } else {
                    1
                };
                self.memory_per_key(name, counting(scenario), days, args.clients)
                    .await
            }
            Scenario::RollupFold => rollup_fold(self, name).await,
            Scenario::RedisDailyHot | Scenario::RedisDailyHc | Scenario::RedisDailyKill => {
                let Some(redis) = find_redis_server() else {
                    return Ok(Outcome::skipped(name, NO_REDIS.into()));
                };
                match scenario {
                    Scenario::RedisDailyHot => {
                        let load = hot_load(args.events, args.clients);
                        self.redis_daily(name, redis, load).await
                    }
                    Scenario::RedisDailyHc => {
                        let load = hc_load(args, KeyDist::Uniform).await?;
                        self.redis_daily(name, redis, load).await
                    }
                    _ => self.redis_daily_kill(name, redis, args).await,
                }
            }
            Scenario::SustainedAllTime => {
                self.tallyd_sustained(name, Sink::Summary, DAY_ZONE, args)
                    .await
            }
            Scenario::SustainedTableDay => {
                self.tallyd_sustained(name, Sink::Table, DAY_ZONE, args)
                    .await
            }
            Scenario::TallydKill | Scenario::DayKill => {
                self.tallyd_kill(name, counting(scenario), args).await
            }
        }
    }
}

/// The high-cardinality scenarios' load: `--hc-events` events over `--hc-keys` keys.
async fn hc_load(args: &BenchArgs, dist: KeyDist) -> Result<Load> {
    let (events, keys, clients) = (args.hc_events, args.hc_keys, args.clients);
    Ok(tokio::task::spawn_blocking(move || spread_load(events, keys, clients, dist)).await?)
}

/// The unique-count rows' loads, `--hc-events` events each: on the hot key, over `--hc-keys`
/// values (`tallyd-unique-hot`, `redis-pfadd-hot`); else over `--hc-keys` uniform keys as in
/// `tallyd-hc-uniform`, each event one of its key's `VALUES_PER_KEY` values.
async fn unique_load(s: Scenario, args: &BenchArgs) -> Result<UniqueLoad> {
    let (events, keys, clients) = (args.hc_events, args.hc_keys, args.clients);
    let hot = matches!(s, Scenario::UniqueHot | Scenario::RedisPfaddHot);
    Ok(tokio::task::spawn_blocking(move || {
        if hot {
            unique_hot_load(events, keys, clients)
        } else {
            unique_spread_load(events, keys, VALUES_PER_KEY, clients)
        }
    })
    .await?)
}

/// How a scenario's counter counts: the `tallyd-day-*` rows per day, the others all-time.
fn counting(s: Scenario) -> Counting {
    if s.name().starts_with("tallyd-day-") {
        Counting::PerDay
    } else {
        Counting::AllTime
    }
}

fn per_event_transport(s: Scenario) -> Transport {
    match s {
        Scenario::CeilingEventDgram | Scenario::EventDgram => Transport::Datagram,
        _ => Transport::Stream,
    }
}
