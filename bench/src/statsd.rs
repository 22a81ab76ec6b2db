//! `--only statsd-side-by-side`: tallyd and the reference statsd server (the `statsd` npm
//! package, console backend: nothing leaves the machine) receive the same per-event UDP
//! traffic from one client (this program), in one run: first at rising rates, then killed with
//! SIGKILL mid-stream. Needs node and `npm ci` in bench/statsd-reference (docs/benchmarks.md).
//!
//! What each counted: tallyd's `tallyd_events_accepted_total` (and, at the end, its totals in
//! PostgreSQL, which must equal it); statsd's, the sum of the counter values its console
//! backend printed at each flush, and its own `packets_received` / `bad_lines_seen`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use tokio::net::UdpSocket;
use tokio::process::{Child, Command};

use crate::daemon::Daemon;
use crate::env::BenchEnv;
use crate::procfs::{cpu_seconds_of, proc_kib};
use tallyd::config::{CounterStatsd, Sampled};
use tallyd::config::{FsyncMode, KeyTypeName};
use tallyd_testkit::{counter, Samples};

/// The statsd counter, one per key: `bench.hits.k<n>`.
const KEYS: u64 = 10;
/// Seconds each rate step sends for.
const STEP: Duration = Duration::from_secs(5);
/// Events per second sent to each server, per step; 0: as fast as the client can.
const RATES: [u64; 4] = [10_000, 30_000, 60_000, 0];
/// statsd's flush interval (ms): what a crash of statsd loses at most, besides its queue.
const STATSD_FLUSH_MS: u64 = 1000;

/// The statsd reference: bench/statsd-reference/node_modules/statsd.
fn statsd_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("statsd-reference/node_modules/statsd")
}

fn free_udp_port() -> Result<u16> {
    Ok(std::net::UdpSocket::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The reference statsd server as a child process, its console output in `out`.
struct Statsd {
    child: Child,
    pid: u32,
    out: PathBuf,
    port: u16,
}

impl Statsd {
    async fn spawn(dir: &Path) -> Result<Statsd> {
        let stats = statsd_dir().join("stats.js");
        ensure!(
            stats.is_file(),
            "{} is missing: run `npm ci` in bench/statsd-reference (needs node and npm)",
            stats.display()
        );
        let port = free_udp_port()?;
        let mgmt = free_udp_port()?;
        let config = dir.join("statsd-config.js");
        std::fs::write(
            &config,
            format!(
                "{{ port: {port}, address: \"127.0.0.1\", mgmt_address: \"127.0.0.1\", \
                 mgmt_port: {mgmt}, flushInterval: {STATSD_FLUSH_MS}, \
                 backends: [\"./backends/console\"], console: {{ prettyprint: false }} }}\n"
            ),
        )?;
        let out = dir.join("statsd.out");
        let child = Command::new("node")
            .current_dir(statsd_dir())
            .arg("stats.js")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out)?)
            .stderr(std::fs::File::create(dir.join("statsd.err"))?)
            .kill_on_drop(true)
            .spawn()
            .context("spawning node stats.js (is node installed?)")?;
        let pid = child.id().context("statsd exited at once")?;
        let statsd = Statsd {
            child,
            pid,
            out,
            port,
        };
        // Up once its management port answers.
        let deadline = Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(("127.0.0.1", mgmt))
            .await
            .is_err()
        {
            ensure!(Instant::now() < deadline, "statsd did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(statsd)
    }

    /// What its console backend printed so far: (sum of the `bench.hits.*` counters,
    /// packets_received, bad_lines_seen), over every flush.
    fn counted(&self) -> Result<(u64, u64, u64)> {
        let text = std::fs::read_to_string(&self.out)?;
        Ok(parse_console(&text))
    }

    fn rss_mib(&self) -> f64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.pid))
            .ok()
            .and_then(|s| proc_kib(&s, "VmHWM"))
            .map_or(0.0, |k| k as f64 / 1024.0)
    }
}

/// Sums the `counters: { ... }` objects of the console backend's output.
fn parse_console(text: &str) -> (u64, u64, u64) {
    let (mut hits, mut packets, mut bad) = (0u64, 0u64, 0u64);
    let mut rest = text;
    while let Some(i) = rest.find("counters: {") {
        let body = &rest[i + "counters: {".len()..];
        let end = body.find('}').unwrap_or(body.len());
        for entry in body[..end].split(',') {
            let Some((name, value)) = entry.split_once(':') else {
                continue;
            };
            let name = name.trim().trim_matches('\'');
            let Ok(value) = value.trim().parse::<f64>() else {
                continue;
            };
            let value = value as u64;
            if name.starts_with("bench.hits.") {
                hits += value;
            } else if name == "statsd.packets_received" {
                packets += value;
            } else if name == "statsd.bad_lines_seen" {
                bad += value;
            }
        }
        rest = &body[end..];
    }
    (hits, packets, bad)
}

/// One client, both servers: each event is one datagram to each, the same bytes.
struct Sender {
    socket: UdpSocket,
    tallyd: u16,
    statsd: u16,
    sent: u64,
}

impl Sender {
    /// Sends for `for_time` at `rate` events/s to each server (0: flat out); returns how many.
    async fn run(&mut self, rate: u64, for_time: Duration) -> Result<u64> {
        let start = Instant::now();
        let mut n = 0u64;
        while start.elapsed() < for_time {
            let line = format!("bench.hits.k{}:1|c", self.sent % KEYS);
            for port in [self.tallyd, self.statsd] {
                // A full local socket buffer (ENOBUFS) is the client's loss, before either
                // server: count the event as not sent to either.
                self.socket
                    .send_to(line.as_bytes(), ("127.0.0.1", port))
                    .await?;
            }
            self.sent += 1;
            n += 1;
            if rate > 0 && n % 100 == 0 {
                let due = start + Duration::from_secs_f64(n as f64 / rate as f64);
                tokio::time::sleep_until(due.into()).await;
            }
        }
        Ok(n)
    }
}

/// One line of the rate table.
struct Step {
    rate: u64,
    sent: u64,
    achieved: f64,
    tallyd: u64,
    tallyd_dropped: u64,
    statsd: u64,
}

async fn accepted(daemon: &Daemon) -> Result<(u64, u64)> {
    let samples = Samples::parse(&crate::scrape::scrape(&daemon.metrics).await?);
    let get = |name: &str| samples.get(name).unwrap_or(0.0) as u64;
    Ok((
        get("tallyd_events_accepted_total{counter=\"statsd_hits\"}"),
        get("tallyd_statsd_udp_dropped_total"),
    ))
}

impl BenchEnv {
    async fn statsd_total(&self) -> Result<u64> {
        let client = self.db.connect().await?;
        let row = client
            .query_one(
                "SELECT coalesce(sum(count), 0)::bigint FROM tallyd.totals WHERE counter = 'statsd_hits'",
                &[],
            )
            .await?;
        Ok(row.get::<_, i64>(0) as u64)
    }

    /// The side-by-side run; prints its two tables.
    pub(crate) async fn statsd_side_by_side(&self) -> Result<()> {
        let name = "statsd-side-by-side";
        let dir = self.root.path.join(name);
        std::fs::create_dir_all(&dir)?;
        let udp = free_udp_port()?;
        let (daemon, config, port) = self
            .spawn_daemon_keep(name, |c| {
                c.journal.fsync = FsyncMode::Interval;
                c.statsd.set_udp(Some(format!("127.0.0.1:{udp}")));
                let mut hits = counter("statsd_hits", KeyTypeName::Text);
                hits.statsd = Some(CounterStatsd {
                    metric: "bench.hits.*".into(),
                    key_tag: None,
                    sampled: Sampled::Reject,
                });
                c.counters.push(hits);
            })
            .await?;
        let statsd = Statsd::spawn(&dir).await?;
        let mut sender = Sender {
            socket: UdpSocket::bind("127.0.0.1:0").await?,
            tallyd: udp,
            statsd: statsd.port,
            sent: 0,
        };
        let cpu = (daemon.cpu_seconds()?, cpu_seconds_of(statsd.pid)?);
        let mut steps = Vec::new();
        for rate in RATES {
            println!("  sending {} ...", rate_name(rate));
            let before = (accepted(&daemon).await?, statsd.counted()?.0);
            let started = Instant::now();
            let sent = sender.run(rate, STEP).await?;
            let achieved = sent as f64 / started.elapsed().as_secs_f64();
            // Two statsd flushes later, both have counted what they will count.
            tokio::time::sleep(Duration::from_millis(2 * STATSD_FLUSH_MS + 500)).await;
            let after = (accepted(&daemon).await?, statsd.counted()?.0);
            steps.push(Step {
                rate,
                sent,
                achieved,
                tallyd: after.0 .0 - before.0 .0,
                tallyd_dropped: after.0 .1 - before.0 .1,
                statsd: after.1 - before.1,
            });
        }
        let cpu = (
            daemon.cpu_seconds()? - cpu.0,
            cpu_seconds_of(statsd.pid)? - cpu.1,
        );
        let rss = (daemon.peak_rss_mib()?, statsd.rss_mib());
        let (_, packets, bad) = statsd.counted()?;
        let counted = (
            steps.iter().map(|s| s.tallyd).sum::<u64>(),
            steps.iter().map(|s| s.statsd).sum::<u64>(),
        );
        print_steps(&steps);
        println!(
            "\n| | tallyd | statsd |\n|---|---|---|\n\
             | events counted / sent | {} / {} | {} / {} |\n\
             | daemon CPU s per million events counted | {:.2} | {:.2} |\n\
             | peak RSS (MiB) | {:.0} | {:.0} |\n\
             | statsd's own packets_received / bad_lines_seen | | {packets} / {bad} |",
            counted.0,
            sender.sent,
            counted.1,
            sender.sent,
            cpu.0 / counted.0.max(1) as f64 * 1e6,
            cpu.1 / counted.1.max(1) as f64 * 1e6,
            rss.0,
            rss.1,
        );
        self.kill_mid_stream(daemon, statsd, sender, &config, port, counted)
            .await
    }

    /// Sends at a rate both absorb, kills both with SIGKILL mid-stream, restarts tallyd on its
    /// journal and reports what each lost of what was sent before the kill.
    #[allow(clippy::too_many_arguments)]
    async fn kill_mid_stream(
        &self,
        daemon: Daemon,
        mut statsd: Statsd,
        mut sender: Sender,
        config: &Path,
        port: u16,
        counted: (u64, u64),
    ) -> Result<()> {
        println!("  kill -9 mid-stream ...");
        // Both have settled: tallyd's committed total must be what it accepted.
        let committed_before = self.wait_total(counted.0).await?;
        let statsd_before = statsd.counted()?.0;
        let sent = sender.run(RATES[0], Duration::from_millis(2500)).await?;
        daemon.kill().await;
        let _ = statsd.child.kill().await;
        let statsd_after = statsd.counted()?.0 - statsd_before;
        let restarted = Daemon::spawn(&self.tallyd, config, port).await?;
        let total = self.wait_settled_total().await? - committed_before;
        restarted.stop().await?;
        println!(
            "\n| kill -9 after {sent} events sent to each | tallyd | statsd |\n|---|---|---|\n\
             | counted after restart (tallyd: journal replayed) | {total} | {statsd_after} |\n\
             | lost | {} | {} |",
            sent.saturating_sub(total),
            sent.saturating_sub(statsd_after)
        );
        ensure!(
            total <= sent,
            "tallyd counted {total} of {sent} events sent"
        );
        Ok(())
    }

    /// Waits until tallyd's committed total is `expected`.
    async fn wait_total(&self, expected: u64) -> Result<u64> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let total = self.statsd_total().await?;
            if total == expected {
                return Ok(total);
            }
            if Instant::now() > deadline {
                bail!("tallyd committed {total}, accepted {expected}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The committed total once it stops changing (after a replay).
    async fn wait_settled_total(&self) -> Result<u64> {
        let mut last = self.statsd_total().await?;
        loop {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let now = self.statsd_total().await?;
            if now == last {
                return Ok(now);
            }
            last = now;
        }
    }
}

fn rate_name(rate: u64) -> String {
    if rate == 0 {
        "flat out".into()
    } else {
        format!("{rate} events/s")
    }
}

fn print_steps(steps: &[Step]) {
    println!(
        "\n| rate asked (to each) | sent | achieved events/s | tallyd counted | tallyd lost (kernel drops counted) | statsd counted | statsd lost |\n\
         |---|---|---|---|---|---|---|"
    );
    for s in steps {
        println!(
            "| {} | {} | {:.0} | {} | {} ({}) | {} | {} |",
            rate_name(s.rate),
            s.sent,
            s.achieved,
            s.tallyd,
            s.sent.saturating_sub(s.tallyd),
            s.tallyd_dropped,
            s.statsd,
            s.sent.saturating_sub(s.statsd)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::parse_console;

    #[test]
    fn console_output_is_summed_over_flushes() {
        let text = "Flushing stats at  x\n{\n  counters: {\n    'statsd.bad_lines_seen': 1,\n    \
                    'statsd.packets_received': 7,\n    'bench.hits.k0': 3,\n    'bench.hits.k1': 4\n  },\n  \
                    timers: {},\n  counter_rates: { 'bench.hits.k0': 0.3 }\n}\n\
                    Flushing stats at  y\n{ counters: { 'statsd.packets_received': 2, 'bench.hits.k0': 2 } }\n";
        assert_eq!(parse_console(text), (9, 9, 1));
    }
}
