//! The daemon under test: its generated config, `tallyd run` as a child process (ready, CPU,
//! memory, stop), and the tallyd scenarios, each checking `tallyd.totals` (or, counting per
//! day, `tallyd.window_totals`) is exact, or for a unique counter what `tallyd.unique_totals`
//! holds (bench/src/unique.rs).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, ensure, Context, Result};

use tallyd::config::{Config, FsyncMode, KeyTypeName};
use tallyd::metrics as m;
use tallyd::window::Span;
use tallyd_testkit::{Samples, TestConfig};

use crate::client::{flush_replies, send};
use crate::env::{BenchEnv, COUNTER, FLUSH_INTERVAL_MS};
use crate::load::{distinct_load, distinct_timed_load, Load, UniqueLoad};
use crate::procfs::{cpu_seconds_of, proc_kib};
use crate::report::{server_cpu_note, thousands, DaemonStats, Flow, Outcome};
use crate::scrape::{scrape, Usage};
use crate::unique::unique_counter;

/// Pending keys (or (key, window) pairs) for the memory check.
const MEMORY_KEYS: u64 = 1_000_000;
/// The zone the per-day rows count days in: not UTC, so a day is not a multiple of the epoch's
/// days and the window is computed from the zone's offsets (23- and 25-hour days included).
const DAY_ZONE: &str = "Europe/Berlin";
const DAY_MS: u64 = 86_400_000;

/// How the bench counter counts: one all-time total per key, in `tallyd.totals`; or per day in
/// `DAY_ZONE` (`window = "day"`, no `also`), in `tallyd.window_totals` with span 'day' (the
/// `tallyd-day-*` rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Counting {
    AllTime,
    PerDay,
}

impl Counting {
    pub(crate) fn configure(self, c: &mut Config) {
        if self == Counting::PerDay {
            let counter = &mut c.counters[0];
            counter.window = Some(Span::Day);
            counter.time_zone = Some(DAY_ZONE.into());
        }
    }

    /// What one pending entry is, in the memory row's note.
    fn entry(self) -> &'static str {
        match self {
            Counting::AllTime => "key",
            Counting::PerDay => "(key, day)",
        }
    }
}

/// What a tallyd row checks once every `!flush` is answered.
enum Check {
    /// The counter's totals, counting as given: exact.
    Totals(Counting),
    /// The unique counter's rows: every event, and cardinalities near the `distinct` (key,
    /// value) pairs sent (exact when no key holds more than the explicit threshold).
    Unique { distinct: u64, max_per_key: u64 },
}

/// How long a daemon may take to stop (its final flush) after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(120);

/// The hot_rollup row: rollups every 200 ms and the journal fsynced on an interval.
pub(crate) fn rollup_and_journal(c: &mut Config) {
    c.rollup.enabled = true;
    c.rollup.set_interval(Duration::from_millis(200));
    c.journal.fsync = FsyncMode::Interval;
}

impl BenchEnv {
    /// The daemon's config (the test kit's typed builder): this server (not embedded), sockets
    /// in `dir`, metrics on `port`, a flush every `FLUSH_INTERVAL_MS`, rollup off, warnings
    /// only; then `edit`.
    pub(crate) fn daemon_config(
        &self,
        dir: &Path,
        port: u16,
        edit: impl FnOnce(&mut Config),
    ) -> TestConfig {
        TestConfig::new(dir)
            .counters(&[(COUNTER, KeyTypeName::Text)])
            .database_url(&self.conninfo)
            .metrics_port(port)
            .with(|c| {
                c.daemon.set_drain_timeout(Duration::from_millis(1000));
                c.listen.set_datagram_socket(None);
                c.flush
                    .set_interval(Duration::from_millis(FLUSH_INTERVAL_MS));
                c.rollup.enabled = false;
                c.log.level = "warn".into();
            })
            .with(edit)
    }

    /// Empty tallyd tables, so each daemon starts from nothing.
    async fn reset_tallyd_tables(&self) -> Result<()> {
        let client = self.db.connect().await?;
        client
            .batch_execute("TRUNCATE tallyd.slots, tallyd.rollups, tallyd.flushes")
            .await?;
        Ok(())
    }

    pub(crate) async fn spawn_daemon(
        &self,
        name: &str,
        edit: impl FnOnce(&mut Config),
    ) -> Result<Daemon> {
        Ok(self.spawn_daemon_keep(name, edit).await?.0)
    }

    /// Like `spawn_daemon`, also returning its config path and metrics port, to start it
    /// again on the same data_dir (its journal).
    pub(crate) async fn spawn_daemon_keep(
        &self,
        name: &str,
        edit: impl FnOnce(&mut Config),
    ) -> Result<(Daemon, PathBuf, u16)> {
        self.reset_tallyd_tables().await?;
        let dir = self.root.path.join(name);
        std::fs::create_dir_all(&dir)?;
        let port = free_port()?;
        let config = self.daemon_config(&dir, port, edit).write();
        let daemon = Daemon::spawn(&self.tallyd, &config, port).await?;
        Ok((daemon, config, port))
    }

    /// Sends `load` to a counter counting as `counting`, waits for every `!flush`, scrapes the
    /// daemon, checks the totals are exact.
    pub(crate) async fn tallyd(
        &self,
        name: &'static str,
        counting: Counting,
        edit: impl FnOnce(&mut Config),
        load: Load,
    ) -> Result<Outcome> {
        let edit = |c: &mut Config| {
            counting.configure(c);
            edit(c);
        };
        self.tallyd_checked(name, edit, load, Check::Totals(counting))
            .await
    }

    /// Sends `load` to the unique counter `visitors` (in place of `bench`), waits for every
    /// `!flush`, scrapes the daemon, checks `tallyd.unique_totals` holds every event and
    /// cardinalities near the distinct values sent.
    pub(crate) async fn tallyd_unique(
        &self,
        name: &'static str,
        load: UniqueLoad,
    ) -> Result<Outcome> {
        let counter = unique_counter();
        let check = Check::Unique {
            distinct: load.distinct,
            max_per_key: load.max_per_key,
        };
        self.tallyd_checked(name, |c| c.counters[0] = counter, load.load, check)
            .await
    }

    async fn tallyd_checked(
        &self,
        name: &'static str,
        edit: impl FnOnce(&mut Config),
        load: Load,
        check: Check,
    ) -> Result<Outcome> {
        let daemon = self.spawn_daemon(name, edit).await?;
        let started = SystemTime::now();
        let before = daemon.usage().await?;
        let server_before = self.server_cpu()?;
        let (events, keys) = (load.events, load.keys);
        let sent = send(&daemon.socket, load.buffers, true).await?;
        let after = daemon.usage().await?;
        let server_cpu = self.server_cpu()? - server_before;
        let peak_kib = daemon.status_kib("VmHWM")?;
        let accepted = flush_replies(&sent.replies)?;
        ensure!(
            accepted == events,
            "{name}: sent {events} events, tallyd accepted {accepted} (see {})",
            daemon.log.display()
        );
        let detail = match check {
            Check::Totals(Counting::AllTime) => {
                self.check_totals(name, events, keys).await?;
                String::new()
            }
            Check::Totals(Counting::PerDay) => {
                let days = self.check_day_totals(name, events, keys, started).await?;
                format!(
                    " in {days} {DAY_ZONE} day{}",
                    if days == 1 { "" } else { "s" }
                )
            }
            Check::Unique {
                distinct,
                max_per_key,
            } => {
                let cardinality = self
                    .check_unique_totals(name, events, keys, distinct, max_per_key)
                    .await?;
                format!("; {cardinality}")
            }
        };
        daemon.stop().await?;
        let mut note = format!(
            "exact: {events} events, {keys} key{}{detail}",
            if keys == 1 { "" } else { "s" }
        );
        let paused = after.paused_s - before.paused_s;
        if paused > 0.0 {
            let _ = write!(note, "; readers paused {paused:.1} s at max_pending_keys");
        }
        let rows = after.rows - before.rows;
        let flushing = after.flushing_s - before.flushing_s;
        if flushing > 0.0 {
            // What one flush connection writes while it writes: comparable to the single
            // server-side statement, and not lowered by coalescing (fewer rows per event).
            let per_conn = thousands(rows / flushing);
            let _ = write!(
                note,
                "; {per_conn} rows/s per flush connection while writing"
            );
        }
        let _ = write!(note, "; {}", server_cpu_note(server_cpu, rows));
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

    pub(crate) async fn check_totals(&self, name: &str, events: u64, keys: u64) -> Result<()> {
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

    /// The per-day counterpart of `check_totals`: `tallyd.window_totals` holds `events` on
    /// `keys` keys, every row a day of `DAY_ZONE` (its local midnight, by PostgreSQL's own zone
    /// rules) from the day the load started to now, and `tallyd.totals` nothing of the counter.
    /// Returns the number of days.
    pub(crate) async fn check_day_totals(
        &self,
        name: &str,
        events: u64,
        keys: u64,
        started: SystemTime,
    ) -> Result<i64> {
        let client = self.db.connect().await?;
        let row = client
            .query_one(
                "SELECT count(DISTINCT key), coalesce(sum(count), 0)::bigint, \
                        count(DISTINCT window_start), \
                        count(*) FILTER (WHERE span <> 'day' \
                            OR window_start <> date_trunc('day', window_start, $2) \
                            OR window_start < date_trunc('day', $3::timestamptz, $2) \
                            OR window_start > now()), \
                        (SELECT count(*) FROM tallyd.totals WHERE counter = $1) \
                 FROM tallyd.window_totals WHERE counter = $1",
                &[&COUNTER, &DAY_ZONE, &started],
            )
            .await?;
        let (stored_keys, stored_events, days, misplaced, all_time): (i64, i64, i64, i64, i64) =
            (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
        ensure!(
            stored_events as u64 == events && stored_keys as u64 == keys,
            "{name}: NOT EXACT: sent {events} events on {keys} keys, tallyd.window_totals holds \
             {stored_events} events on {stored_keys} keys"
        );
        ensure!(
            misplaced == 0 && all_time == 0,
            "{name}: {misplaced} rows of tallyd.window_totals are not {DAY_ZONE} days of this \
             run, and tallyd.totals has {all_time} rows of the counter (expected none)"
        );
        Ok(days)
    }

    /// RSS per pending key, counting as `counting`: 1,000,000 distinct keys (or, over `days`
    /// days, 1,000,000 / `days` keys each sent once a day: 1,000,000 (key, day) pairs) held (no
    /// flush), RSS over the idle daemon's.
    pub(crate) async fn memory_per_key(
        &self,
        name: &'static str,
        counting: Counting,
        days: u64,
        clients: usize,
    ) -> Result<Outcome> {
        ensure!(
            MEMORY_KEYS % days == 0 && (days == 1 || counting == Counting::PerDay),
            "{name}: {days} days of {MEMORY_KEYS} pairs, counting {counting:?}"
        );
        let daemon = self
            .spawn_daemon(name, |c| {
                counting.configure(c);
                c.flush.set_interval(Duration::from_millis(600_000));
                c.flush.max_pending_keys = 2_000_000;
                c.coalesce.max_pending_keys = 2_000_000;
            })
            .await?;
        let idle_kib = daemon.status_kib("VmRSS")?;
        let load = tokio::task::spawn_blocking(move || {
            if days == 1 {
                distinct_load(MEMORY_KEYS, clients)
            } else {
                distinct_timed_load(MEMORY_KEYS / days, &past_noons(days), clients)
            }
        })
        .await?;
        let sent = send(&daemon.socket, load.buffers, false).await?;
        let loaded_kib = settled_rss(&daemon).await?;
        let peak_kib = daemon.status_kib("VmHWM")?;
        pending_reach(&daemon, name, MEMORY_KEYS).await?;
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
                "RSS {:.1} -> {:.1} MiB: {per_key:.0} B/pending {}{}",
                idle_kib as f64 / 1024.0,
                loaded_kib as f64 / 1024.0,
                counting.entry(),
                if days == 1 {
                    String::new()
                } else {
                    format!(" ({} keys x {days} days)", MEMORY_KEYS / days)
                }
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

/// Noon UTC of each of the `days` days before today (UTC): each in its own `DAY_ZONE` day (noon
/// UTC is 13:00 or 14:00 there), none in the future.
fn past_noons(days: u64) -> Vec<u64> {
    let today = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
        / DAY_MS;
    (1..=days)
        .map(|d| (today - d) * DAY_MS + DAY_MS / 2)
        .collect()
}

/// Waits until the daemon's `tallyd_pending_keys` gauge (set every second) reads `n`: every line
/// was taken, and each (key, window) is one pending entry.
async fn pending_reach(daemon: &Daemon, name: &str, n: u64) -> Result<()> {
    let mut pending = None;
    for _ in 0..50 {
        pending = Samples::parse(&scrape(&daemon.metrics).await?).get(m::PENDING_KEYS);
        if pending == Some(n as f64) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("{name}: sent {n} distinct entries, the daemon holds {pending:?} pending keys")
}

fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// `tallyd run` as a child process (the test kit's `Daemon`, stopped if dropped while running),
/// with what the benchmark reads from /proc.
pub(crate) struct Daemon {
    inner: tallyd_testkit::Daemon,
    pid: u32,
    pub(crate) socket: PathBuf,
    pub(crate) metrics: String,
    log: PathBuf,
}

impl Daemon {
    pub(crate) async fn spawn(tallyd: &Path, config: &Path, port: u16) -> Result<Daemon> {
        let (bin, config) = (tallyd.to_path_buf(), config.to_path_buf());
        let inner = tokio::task::spawn_blocking(move || {
            tallyd_testkit::Daemon::try_spawn_with(&bin, &config, |cmd| {
                // The generated config is the whole truth: no TALLYD_* or RUST_LOG overrides.
                for (var, _) in std::env::vars() {
                    if var.starts_with("TALLYD_") || var == "RUST_LOG" {
                        cmd.env_remove(var);
                    }
                }
            })
        })
        .await?
        .map_err(anyhow::Error::msg)?;
        Ok(Daemon {
            pid: inner.pid(),
            socket: inner.socket().to_path_buf(),
            metrics: format!("127.0.0.1:{port}"),
            log: inner.log_path().to_path_buf(),
            inner,
        })
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    pub(crate) fn status_kib(&self, field: &str) -> Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid))?;
        proc_kib(&status, field).with_context(|| format!("no {field} in /proc/{}/status", self.pid))
    }

    /// A scrape of its metrics, then its CPU seconds.
    pub(crate) async fn usage(&self) -> Result<Usage> {
        let samples = Samples::parse(&scrape(&self.metrics).await?);
        Ok(Usage::new(&samples, self.cpu_seconds()?))
    }

    /// utime + stime, in seconds.
    pub(crate) fn cpu_seconds(&self) -> Result<f64> {
        cpu_seconds_of(self.pid)
    }

    /// VmHWM, in MiB.
    pub(crate) fn peak_rss_mib(&self) -> Result<f64> {
        Ok(self.status_kib("VmHWM")? as f64 / 1024.0)
    }

    /// SIGTERM, then waits for the final flush and exit.
    pub(crate) async fn stop(self) -> Result<()> {
        let log = self.log;
        let inner = self.inner;
        let status = tokio::time::timeout(
            STOP_TIMEOUT,
            tokio::task::spawn_blocking(move || inner.terminate()),
        )
        .await
        .context("tallyd did not stop after SIGTERM")??;
        ensure!(
            status.success(),
            "tallyd exited with {status}; log: {}",
            log.display()
        );
        Ok(())
    }

    pub(crate) async fn kill(self) {
        let inner = self.inner;
        let _ = tokio::task::spawn_blocking(move || inner.kill()).await;
    }
}
