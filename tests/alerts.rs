//! The shipped alert rules (dashboards/alerts.yml) on a real Prometheus server, against the
//! real `tallyd run` and real faults, one after the other on one daemon:
//!
//! - healthy, under light load: nothing fires (nor is pending);
//! - a lock on `tallyd.slots` makes every flush time out: TallydFlushErrors fires, and
//!   TallydDatabaseDown never does (the database answers); the rollup, stopped by the same lock,
//!   falls behind until TallydRollupBehind fires, and it resolves once the lock is released;
//! - the database stops while a client writes as fast as it can: TallydDatabaseDown fires, the
//!   journal fills (`journal.max_bytes`) and the client is paused, and TallydBackpressure fires
//!   while it is; with the database back, both resolve;
//! - a journal record damaged between two runs: TallydJournalDamaged fires at the restart, and
//!   resolves once the files in `journal/damaged/` are removed.
//!
//! The expressions are exactly the shipped ones; only each rule's `for:` is cut to 5 s, so that
//! a rule that cannot fire fails this test in minutes rather than hours. Prometheus scrapes and
//! evaluates every second. The times printed are from the fault to the alert's state.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::prometheus::{prometheus_binary, Prometheus};
use common::{free_port, start_postgres, temp_dir, TestConfig};
use tallyd::config::KeyTypeName;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const FOR: &str = "5s";

/// dashboards/alerts.yml with every `for:` set to [`FOR`], written into `dir`.
fn shortened_rules(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(format!("{ROOT}/dashboards/alerts.yml")).unwrap();
    let mut cut = 0;
    let rules: String = text
        .lines()
        .map(|line| {
            let trimmed = line.trim_start();
            if trimmed.starts_with("for: ") {
                cut += 1;
                let indent = &line[..line.len() - trimmed.len()];
                format!("{indent}for: {FOR}\n")
            } else {
                format!("{line}\n")
            }
        })
        .collect();
    assert!(cut >= 10, "dashboards/alerts.yml has {cut} `for:` lines");
    let path = dir.join("alerts.yml");
    std::fs::write(&path, rules).unwrap();
    path
}

/// The alerts Prometheus holds now (pending or firing), by name, with their state.
fn alerts(prom: &Prometheus) -> Vec<(String, String)> {
    let Some(result) = prom.query("ALERTS") else {
        return Vec::new();
    };
    result
        .iter()
        .map(|r| {
            let name = r["metric"]["alertname"].as_str().unwrap_or_default();
            let state = r["metric"]["alertstate"].as_str().unwrap_or_default();
            (name.to_string(), state.to_string())
        })
        .collect()
}

/// The state of `alert`: `firing`, `pending`, or `None` (inactive).
fn state(prom: &Prometheus, alert: &str) -> Option<String> {
    let states: Vec<String> = alerts(prom)
        .into_iter()
        .filter(|(name, _)| name == alert)
        .map(|(_, s)| s)
        .collect();
    ["firing", "pending"]
        .into_iter()
        .find(|s| states.iter().any(|x| x == s))
        .map(String::from)
}

/// Waits until `alert` is firing (`firing`) or inactive (not `firing`), for at most `within`,
/// checking `meanwhile` at every look; returns how long it took from `since`.
fn wait_for(
    prom: &Prometheus,
    alert: &str,
    firing: bool,
    since: Instant,
    within: Duration,
    mut meanwhile: impl FnMut(),
) -> Duration {
    let deadline = Instant::now() + within;
    loop {
        meanwhile();
        let now = state(prom, alert);
        if (now.as_deref() == Some("firing")) == firing {
            return since.elapsed();
        }
        assert!(
            Instant::now() < deadline,
            "{alert} is {now:?} after {within:?}, expected {}; alerts: {:?}\n--- prometheus log:\n{}",
            if firing { "firing" } else { "resolved" },
            alerts(prom),
            prom.log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The value of an instant query that returns one series.
fn value(prom: &Prometheus, promql: &str) -> Option<f64> {
    let result = prom.query(promql)?;
    result.first()?["value"][1].as_str()?.parse().ok()
}

/// A client writing `lines()` on its own connection until stopped (or tallyd closes it), in a
/// thread; every write may block while tallyd does not read.
struct Writer {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl Writer {
    fn start(socket: &Path, pause: Duration, batch: usize) -> Writer {
        let stop = Arc::new(AtomicBool::new(false));
        let mut conn = UnixStream::connect(socket).expect("connect to tallyd");
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let lines: String = (0..batch)
                        .map(|i| format!("downloads k{} 1\n", n + i as u64))
                        .collect();
                    if conn.write_all(lines.as_bytes()).is_err() {
                        break;
                    }
                    n += batch as u64;
                    std::thread::sleep(pause);
                }
                n
            })
        };
        Writer {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops the thread (once its current write is taken) and returns how many lines it wrote.
    fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Sends `line` and `!sync` on a new connection; waits for `ok` (journaled).
fn journaled(socket: &Path, line: &str) {
    let mut conn = UnixStream::connect(socket).unwrap();
    conn.write_all(format!("{line}\n!sync\n").as_bytes())
        .unwrap();
    let mut answer = String::new();
    BufReader::new(&conn).read_line(&mut answer).unwrap();
    assert_eq!(answer, "ok\n");
}

/// Flips a byte inside the record that holds `marker`, in a segment where a later record
/// follows it (so it is damage, not a record cut short at the end). Returns the segment.
fn damage_record(journal: &Path, markers: &[&str]) -> PathBuf {
    for entry in std::fs::read_dir(journal).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|x| x != "journal") {
            continue;
        }
        let mut bytes = std::fs::read(&path).unwrap();
        let at: Vec<Option<usize>> = markers
            .iter()
            .map(|m| bytes.windows(m.len()).position(|w| w == m.as_bytes()))
            .collect();
        // The first marker found with another found after it in the same segment.
        let Some(victim) = at
            .iter()
            .flatten()
            .copied()
            .find(|&a| at.iter().flatten().any(|&b| b > a))
        else {
            continue;
        };
        bytes[victim] ^= 0x01;
        std::fs::write(&path, bytes).unwrap();
        return path;
    }
    panic!(
        "no journal segment in {} holds two of {markers:?}",
        journal.display()
    );
}

#[test]
fn shipped_alerts_fire_on_their_faults_and_resolve() {
    let bin = prometheus_binary().unwrap_or_else(|| {
        panic!(
            "the prometheus server binary is required (set PROMETHEUS, or let \
             scripts/ensure-promtool --server download it)"
        )
    });
    let dir = temp_dir();
    let mut pg = Some(start_postgres(dir.path()));
    let conninfo = pg.as_ref().unwrap().connection_string("postgres");
    let port = free_port();
    let metrics = SocketAddr::from(([127, 0, 0, 1], port));
    let config = TestConfig::new(dir.path())
        .counters(&[("downloads", KeyTypeName::Text)])
        .fast()
        .metrics_port(port)
        .database_url(&conninfo)
        .with(|c| {
            // The least journal: an outage fills it in a moment.
            c.journal.max_bytes = 65536;
            c.journal.segment_bytes = 4096;
            c.flush.set_lock_timeout(Some(Duration::from_millis(300)));
            // The heartbeat, which reaches the database every third of it, says when it is
            // down even while nothing is flushed.
            c.daemon.set_instance_lease(Duration::from_millis(3000));
            // The rollup runs every second: while a lock stops it, its lag grows past the rule's
            // 60 s.
            c.rollup.enabled = true;
            c.rollup.set_interval(Duration::from_secs(1));
        })
        .write();
    let mut daemon = Some(common::spawn_daemon(&config));
    let socket = daemon.as_ref().unwrap().socket().to_path_buf();
    let rules = shortened_rules(dir.path());
    let prom = Prometheus::start_with_rules(&bin, dir.path(), metrics, Some(&rules));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut report = Vec::new();

    // Healthy, under light load: nothing pending, nothing firing.
    let light = Writer::start(&socket, Duration::from_millis(100), 1);
    let ready = Instant::now() + Duration::from_secs(60);
    while value(&prom, "up").is_none_or(|v| v != 1.0) {
        assert!(
            Instant::now() < ready,
            "Prometheus never scraped tallyd\n{}",
            prom.log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let quiet = Instant::now() + Duration::from_secs(12);
    while Instant::now() < quiet {
        assert_eq!(alerts(&prom), Vec::new(), "a healthy daemon raises nothing");
        std::thread::sleep(Duration::from_millis(500));
    }

    // Every flush times out on a lock: the database answers, flushes fail.
    let locker = rt.block_on(common::sql(&conninfo));
    rt.block_on(locker.batch_execute("BEGIN; LOCK TABLE tallyd.slots IN EXCLUSIVE MODE"))
        .unwrap();
    let locked = Instant::now();
    let no_database_down = || {
        assert_eq!(
            state(&prom, "TallydDatabaseDown"),
            None,
            "a lock timeout is no outage"
        );
    };
    let took = wait_for(
        &prom,
        "TallydFlushErrors",
        true,
        locked,
        Duration::from_secs(60),
        no_database_down,
    );
    report.push(format!(
        "TallydFlushErrors fired {took:?} after flushes began to time out"
    ));
    // Some seconds more: still no TallydDatabaseDown.
    let more = Instant::now() + Duration::from_secs(8);
    while Instant::now() < more {
        no_database_down();
        assert_eq!(value(&prom, "min(tallyd_database_up)"), Some(1.0));
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(value(&prom, "max(tallyd_flush_failing)"), Some(1.0));
    // The lock stops the rollup too: its lag passes 60 s.
    let took = wait_for(
        &prom,
        "TallydRollupBehind",
        true,
        locked,
        Duration::from_secs(120),
        || {},
    );
    report.push(format!(
        "TallydRollupBehind fired {took:?} after the rollup was stopped by a lock"
    ));
    rt.block_on(locker.batch_execute("COMMIT")).unwrap();
    let unlocked = Instant::now();
    let took = wait_for(
        &prom,
        "TallydRollupBehind",
        false,
        unlocked,
        Duration::from_secs(60),
        || {},
    );
    report.push(format!(
        "TallydRollupBehind resolved {took:?} after the lock was released"
    ));
    light.stop();

    // The database stops while a client writes as fast as it can.
    let burst = Writer::start(&socket, Duration::ZERO, 200);
    pg.take().unwrap().stop().expect("stop PostgreSQL");
    let stopped = Instant::now();
    let took = wait_for(
        &prom,
        "TallydDatabaseDown",
        true,
        stopped,
        Duration::from_secs(60),
        || {},
    );
    report.push(format!(
        "TallydDatabaseDown fired {took:?} after the database stopped"
    ));
    let took = wait_for(
        &prom,
        "TallydBackpressure",
        true,
        stopped,
        Duration::from_secs(60),
        || {},
    );
    report.push(format!(
        "TallydBackpressure fired {took:?} after the database stopped (journal full, the \
         client paused)"
    ));
    assert!(value(&prom, "max(tallyd_backpressure_paused_connections)").unwrap_or(0.0) >= 1.0);
    assert_eq!(value(&prom, "max(tallyd_journal_full)"), Some(1.0));

    pg = Some(start_postgres(dir.path()));
    let back = Instant::now();
    let took = wait_for(
        &prom,
        "TallydDatabaseDown",
        false,
        back,
        Duration::from_secs(60),
        || {},
    );
    report.push(format!(
        "TallydDatabaseDown resolved {took:?} after the database came back"
    ));
    let written = burst.stop();
    let took = wait_for(
        &prom,
        "TallydBackpressure",
        false,
        back,
        Duration::from_secs(180),
        || {},
    );
    report.push(format!(
        "TallydBackpressure resolved {took:?} after the database came back ({written} lines \
         written by the paused client)"
    ));

    // A record damaged between two runs: events journaled, not committed (flushes time out on
    // the lock again), tallyd killed, one byte of a record flipped.
    // The stop ended the first locker's session.
    let locker = rt.block_on(common::sql(&conninfo));
    rt.block_on(locker.batch_execute("BEGIN; LOCK TABLE tallyd.slots IN EXCLUSIVE MODE"))
        .unwrap();
    let markers = ["damage-me-1", "damage-me-2", "damage-me-3"];
    for marker in markers {
        journaled(&socket, &format!("downloads {marker} 1"));
    }
    daemon.take().unwrap().kill();
    rt.block_on(locker.batch_execute("COMMIT")).unwrap();
    let journal = dir.path().join("data/journal");
    damage_record(&journal, &markers);
    daemon = Some(common::spawn_daemon(&config));
    let restarted = Instant::now();
    let took = wait_for(
        &prom,
        "TallydJournalDamaged",
        true,
        restarted,
        Duration::from_secs(60),
        || {},
    );
    report.push(format!(
        "TallydJournalDamaged fired {took:?} after the restart"
    ));
    let damaged = journal.join("damaged");
    let files: Vec<PathBuf> = std::fs::read_dir(&damaged)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    std::fs::remove_file(&files[0]).unwrap();
    let cleared = Instant::now();
    let took = wait_for(
        &prom,
        "TallydJournalDamaged",
        false,
        cleared,
        Duration::from_secs(60),
        || {},
    );
    report.push(format!(
        "TallydJournalDamaged resolved {took:?} after journal/damaged/ was emptied"
    ));

    assert!(daemon.take().unwrap().terminate().success());
    drop(prom);
    pg.take().unwrap().stop().expect("stop PostgreSQL");
    for line in report {
        println!("{line}");
    }
}
