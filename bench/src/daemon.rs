//! The daemon under test: its generated config, `tallyd run` as a child process (ready, CPU,
//! memory, stop), and the tallyd scenarios, each checking `tallyd.totals` is exact.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::process::{Child, Command};

use tallyd::config::Config;

use crate::bench::{
    proc_kib, BenchEnv, COUNTER, FLUSH_INTERVAL_MS, MEMORY_KEYS, STARTUP_TIMEOUT, STOP_TIMEOUT,
};
use crate::client::{flush_replies, send};
use crate::load::{distinct_load, Load};
use crate::report::{DaemonStats, Flow, Outcome};
use crate::scrape::Usage;

pub(crate) const ROLLUP: &str = "[rollup]\nenabled = true\ninterval_ms = 200\n";
pub(crate) const JOURNAL: &str = "[journal]\nfsync = \"interval\"\n";

/// Ok when this build's config knows `[journal] fsync`, else why the journal row is not run.
pub(crate) fn journal_support() -> Result<(), String> {
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
    pub(crate) fn daemon_config(&self, dir: &Path, port: u16, extra: &str) -> String {
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

    /// Like `spawn_daemon`, also returning its config path and metrics port, to start it
    /// again on the same data_dir (its journal).
    pub(crate) async fn spawn_daemon_keep(
        &self,
        name: &str,
        extra: &str,
    ) -> Result<(Daemon, PathBuf, u16)> {
        self.reset_tallyd_tables().await?;
        let dir = self.root.path.join(name);
        std::fs::create_dir_all(&dir)?;
        let port = free_port()?;
        let config = dir.join("config.toml");
        std::fs::write(&config, self.daemon_config(&dir, port, extra))?;
        let daemon = Daemon::spawn(&self.tallyd, &dir, &config, port).await?;
        Ok((daemon, config, port))
    }

    /// Sends `load`, waits for every `!flush`, scrapes the daemon, checks the totals are exact.
    pub(crate) async fn tallyd(
        &self,
        name: &'static str,
        extra: &str,
        load: Load,
    ) -> Result<Outcome> {
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
    pub(crate) async fn memory_per_key(
        &self,
        name: &'static str,
        clients: usize,
    ) -> Result<Outcome> {
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
pub(crate) struct Daemon {
    child: Child,
    pid: u32,
    socket: PathBuf,
    pub(crate) metrics: String,
    log: PathBuf,
}

impl Daemon {
    pub(crate) async fn spawn(
        tallyd: &Path,
        dir: &Path,
        config: &Path,
        port: u16,
    ) -> Result<Daemon> {
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
    pub(crate) fn cpu_seconds(&self) -> Result<f64> {
        cpu_seconds_of(self.pid)
    }

    /// VmHWM, in MiB.
    pub(crate) fn peak_rss_mib(&self) -> Result<f64> {
        Ok(self.status_kib("VmHWM")? as f64 / 1024.0)
    }

    /// SIGTERM, then waits for the final flush and exit.
    pub(crate) async fn stop(mut self) -> Result<()> {
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

    pub(crate) async fn kill(mut self) {
        let _ = self.child.kill().await;
    }
}

/// utime + stime of process `pid`, in seconds.
pub(crate) fn cpu_seconds_of(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    cpu_ticks(&stat)
        .map(|t| t as f64 / clock_ticks())
        .context("unreadable /proc/<pid>/stat")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_ticks_skip_the_process_name() {
        let stat = "123 (tall yd) S 1 123 123 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 9 0";
        assert_eq!(cpu_ticks(stat), Some(300));
    }
}
