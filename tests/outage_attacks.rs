//! Attacks on the outage bounded by disk (issue 23 item 6, tests/outage.rs for the positive
//! tests): records spilled at `coalesce.max_pending_keys` (journaled only) and folded back by the
//! folder, against the real binary and a real PostgreSQL, stopped and started. Each test asserts
//! exact totals (nothing acknowledged lost, nothing counted twice) and liveness (every `!flush`
//! answered within a bound once the database is back).
//!
//! Found defects (these fail on 07269f8; all but two are fixed since, and those two are
//! ignored with the reason):
//! - `records_out_of_order_across_rollovers_are_all_folded_fsync_*`: the folder stalls for good
//!   when records reach the writer out of order across a segment rollover
//!   (`journal::segments_from` skips a segment by its successor's name).
//! - `a_reload_that_lowers_max_key_bytes_keeps_spilled_events`,
//!   `a_line_near_max_line_bytes_survives_the_fold`: spilled lines are parsed again at the fold
//!   against the limits in force and dropped after their `!sync`.
//! - `flush_after_spilled_events_reports_their_overflow`: `!flush` does not count the overflow
//!   rejections the folder found.
//! - `a_disk_filled_by_spilled_records_frees_itself_once_the_database_returns`: a journal disk
//!   smaller than `journal.max_bytes` filled by spilled records never recovers by itself.
//! - `the_start_does_not_hold_a_large_journal_in_memory`: the start reads the whole journal into
//!   memory (about twice its size), whatever the memory cap (not new in 07269f8).
//!
//! The others pass; `measure_*` are measurements run by hand (`-- --ignored`, with
//! `ATTACK_TALLYD_BIN` set to a release build for meaningful figures).

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{buf_of, free_port, scalar_pair, sql, temp_dir, Daemon, LineClient, Samples};
use tallyd::config::{Config, FsyncMode, KeyTypeName};
use tallyd::store::embedded::Embedded;

/// How long a `!flush` may take once the database is back before the test calls it hung.
const PATIENCE: Duration = Duration::from_secs(60);

/// A daemon on a private PostgreSQL (its database `postgres`, or `db0..` with shards) whose
/// memory cap is small, with a metrics endpoint.
struct Rig {
    dir: tempfile::TempDir,
    config: PathBuf,
    conninfos: Vec<String>,
    metrics: SocketAddr,
    pg: Option<Embedded>,
    env: Vec<(&'static str, String)>,
}

/// The binary under test: Cargo's, or `ATTACK_TALLYD_BIN` (a release build, for the
/// measurements).
fn bin() -> PathBuf {
    std::env::var_os("ATTACK_TALLYD_BIN").map_or_else(|| PathBuf::from(common::BIN), PathBuf::from)
}

/// What every rig sets; `edit` changes more.
fn base(c: &mut Config, cap: usize) {
    c.daemon.set_instance_id(Some("attack".into()));
    c.listen.set_datagram_socket(None);
    c.rollup.enabled = false;
    c.coalesce.max_pending_keys = cap;
    c.flush.max_pending_keys = cap / 2;
    c.flush.set_interval(Duration::from_millis(200));
    c.flush.set_retry_initial(Duration::from_millis(20));
    c.flush.set_retry_max(Duration::from_millis(200));
}

impl Rig {
    /// PostgreSQL up (with `shards` databases, or none: its `postgres` database), the daemon
    /// started on it with `env` set.
    async fn start(
        cap: usize,
        shards: usize,
        env: &[(&'static str, &str)],
        edit: impl FnOnce(&mut Config),
    ) -> (Rig, Daemon) {
        let rig = Rig::create(cap, shards, env, edit).await;
        let daemon = rig.spawn().await;
        (rig, daemon)
    }

    /// As [`Rig::start`], without starting the daemon.
    async fn create(
        cap: usize,
        shards: usize,
        env: &[(&'static str, &str)],
        edit: impl FnOnce(&mut Config),
    ) -> Rig {
        let dir = temp_dir();
        let pg = common::postgres(dir.path()).await;
        let conninfos = match shards {
            0 => vec![pg.connection_string("postgres")],
            n => common::create_databases(&pg, n).await,
        };
        let port = free_port();
        let urls = conninfos.clone();
        let config = common::TestConfig::new(dir.path())
            .counters(&[
                ("downloads", KeyTypeName::Text),
                ("views", KeyTypeName::Text),
            ])
            .metrics_port(port)
            .with(|c| {
                if shards == 0 {
                    c.database.url = urls[0].clone();
                } else {
                    c.database.shards = urls;
                }
                base(c, cap);
                edit(c);
            })
            .write();
        Rig {
            dir,
            config,
            conninfos,
            metrics: ([127, 0, 0, 1], port).into(),
            pg: Some(pg),
            env: env.iter().map(|(k, v)| (*k, v.to_string())).collect(),
        }
    }

    async fn spawn(&self) -> Daemon {
        let config = self.config.clone();
        let env = self.env.clone();
        tokio::task::spawn_blocking(move || {
            Daemon::spawn_with(&bin(), &config, |cmd| {
                for (k, v) in env {
                    cmd.env(k, v);
                }
            })
        })
        .await
        .unwrap()
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("tallyd.sock")
    }

    fn journal_dir(&self) -> PathBuf {
        self.dir.path().join("data/journal")
    }

    async fn pg_down(&mut self) {
        common::stop_postgres_immediate(self.pg.take().expect("PostgreSQL is up")).await;
    }

    async fn pg_up(&mut self) {
        assert!(self.pg.is_none(), "PostgreSQL is up already");
        self.pg = Some(common::postgres(self.dir.path()).await);
    }

    async fn samples(&self) -> Samples {
        let addr = self.metrics;
        tokio::task::spawn_blocking(move || Samples::parse(&common::scrape(addr)))
            .await
            .unwrap()
    }

    /// (rows, sum of counts) in `tallyd.totals` over every database.
    async fn totals(&self) -> (i64, i64) {
        let mut out = (0, 0);
        for conninfo in &self.conninfos {
            let (rows, sum) = scalar_pair(
                &sql(conninfo).await,
                "SELECT count(*), coalesce(sum(count), 0)::bigint FROM tallyd.totals",
            )
            .await;
            out = (out.0 + rows, out.1 + sum);
        }
        out
    }

    async fn client(&self) -> LineClient {
        LineClient::connect(&self.socket()).await
    }
}

impl Rig {
    /// Rewrites config.toml with `edit` applied, sends SIGHUP and waits until the reload is
    /// counted as applied.
    fn reload(&self, daemon: &Daemon, edit: impl FnOnce(&mut Config)) {
        let text = std::fs::read_to_string(&self.config).unwrap();
        let mut config = Config::from_toml(&text, Vec::new()).unwrap();
        edit(&mut config);
        std::fs::write(&self.config, toml::to_string(&config).unwrap()).unwrap();
        let ok = |d: &Daemon| {
            d.scrape()
                .value(r#"tallyd_config_reloads_total{result="ok"}"#)
        };
        let before = ok(daemon);
        daemon.signal(libc::SIGHUP);
        let deadline = Instant::now() + Duration::from_secs(20);
        while ok(daemon) < before + 1.0 {
            assert!(
                Instant::now() < deadline,
                "reload not applied: {}",
                daemon.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Fills memory to the cap on a connection of its own (`cap` distinct `views` keys,
    /// acknowledged), so that what follows is spilled. Returns that connection.
    async fn fill_memory(&self, cap: usize) -> LineClient {
        let mut c = self.client().await;
        synced(
            &mut c,
            &buf_of((0..cap).map(|k| format!("views fill-{k} 1"))),
        )
        .await;
        c
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        if let Some(pg) = self.pg.take() {
            let _ = pg.stop_immediate();
        }
    }
}

/// Sends `lines` then `!sync` and expects `ok`.
async fn synced(c: &mut LineClient, lines: &[u8]) {
    c.send(lines).await;
    c.send(b"!sync\n").await;
    let reply = tokio::time::timeout(PATIENCE, c.read_line())
        .await
        .expect("`!sync` answered");
    assert_eq!(reply, "ok\n", "`!sync` answer");
}

/// `!flush` with a bound: panics naming `what` when it is not answered within [`PATIENCE`].
async fn flushed(c: &mut LineClient, what: &str) -> (u64, u64) {
    match tokio::time::timeout(PATIENCE, c.flush()).await {
        Ok(answer) => answer,
        Err(_) => panic!("`!flush` not answered within {PATIENCE:?}: {what}"),
    }
}

/// The journal's segments as (name's first record, records in the file, highest record), by
/// name: what the folder's `segments_from` sees.
fn segments(dir: &Path) -> Vec<(u64, usize, u64, String)> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    paths.retain(|p| p.extension().is_some_and(|x| x == "journal"));
    paths.sort();
    paths
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            let first = name[..20].parse().unwrap();
            let records = tallyd::journal::records_from(&p, 0).unwrap_or_default();
            let last = records.iter().map(|(s, _)| *s).max().unwrap_or(0);
            (first, records.len(), last, name)
        })
        .collect()
}

/// Segments holding a record numbered at or above the next segment's first: a folder whose
/// next record is between the two skips the earlier segment (`journal::segments_from`).
fn overlapping(dir: &Path) -> Vec<String> {
    let segs = segments(dir);
    segs.windows(2)
        .filter(|w| w[0].2 >= w[1].0)
        .map(|w| {
            format!(
                "{} holds record {} >= {} (first of {})",
                w[0].3, w[0].2, w[1].0, w[1].3
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// 1. Ordering: records reach the writer in another order than their numbers, across rollovers.
// ---------------------------------------------------------------------------------------------

/// Many connections (700, as many applications' pools might open) with 4 KiB segments (a
/// rollover every few records): after each group commit the connections' next records and
/// `!sync`s overflow the writer's queue (1,024 inputs) and reach it from blocking threads in
/// any order, so segments hold records numbered above the next segment's first. A burst with
/// the database down, then short bursts with it up but faster than the cap (so they spill
/// too); after each, the folder catches up with the tail of the journal while the burst's last
/// records are still on their way, and must be done within seconds. Then every `!flush` is
/// answered and the totals are exact.
async fn out_of_order(fsync: FsyncMode) {
    const CLIENTS: usize = 700;
    const LINES: usize = 20;
    const BURSTS: usize = 16;
    let (mut rig, daemon) = Rig::start(5_000, 0, &[], |c| {
        c.journal.segment_bytes = 4096;
        c.journal.fsync = fsync;
    })
    .await;
    rig.pg_down().await;
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(rig.client().await);
    }
    let mut events = 0i64;
    let mut overlaps = 0;
    for burst in 0..BURSTS {
        let length = if burst == 0 { 2000 } else { 500 };
        let until = Instant::now() + Duration::from_millis(length);
        let mut tasks = Vec::new();
        for (i, mut c) in clients.drain(..).enumerate() {
            tasks.push(tokio::spawn(async move {
                let mut chunks = 0usize;
                while Instant::now() < until {
                    let lines =
                        buf_of((0..LINES).map(|k| {
                            format!("downloads b{burst:02}-c{i:03}-{chunks:05}-{k:02} 3")
                        }));
                    synced(&mut c, &lines).await;
                    chunks += 1;
                }
                (c, chunks)
            }));
        }
        while Instant::now() < until {
            overlaps = overlaps.max(overlapping(&rig.journal_dir()).len());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for t in tasks {
            let (c, chunks) = t.await.unwrap();
            events += (chunks * LINES) as i64;
            clients.push(c);
        }
        if burst == 0 {
            let spilled = rig
                .samples()
                .await
                .value("tallyd_journal_spilled_events_total");
            assert!(spilled > 0.0, "nothing spilled");
            rig.pg_up().await;
        }
        let caught_up = Instant::now() + Duration::from_secs(20);
        loop {
            let unfolded = rig.samples().await.value("tallyd_journal_unfolded_records");
            if unfolded == 0.0 {
                break;
            }
            if Instant::now() > caught_up {
                let segs = segments(&rig.journal_dir());
                panic!(
                    "the folder is stuck after burst {burst}: {unfolded} spilled records unfolded \
                     20 s after the clients paused; first segments (name's first record, records, \
                     highest record): {:?}; segments holding a record above the next one's first: {:?}",
                    segs.iter()
                        .take(6)
                        .map(|(f, n, l, _)| (*f, *n, *l))
                        .collect::<Vec<_>>(),
                    overlapping(&rig.journal_dir())
                        .into_iter()
                        .take(3)
                        .collect::<Vec<_>>()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    println!(
        "{events} events sent by {CLIENTS} clients in {BURSTS} bursts; up to {overlaps} segments at once held a record above the next one's first"
    );
    for (i, c) in clients.iter_mut().enumerate() {
        flushed(c, &format!("client {i}")).await;
    }
    assert_eq!(rig.totals().await, (events, events * 3));
    drop(clients);
    assert!(daemon.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_out_of_order_across_rollovers_are_all_folded_fsync_interval() {
    out_of_order(FsyncMode::Interval).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_out_of_order_across_rollovers_are_all_folded_fsync_always() {
    out_of_order(FsyncMode::Always).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_out_of_order_across_rollovers_are_all_folded_fsync_off() {
    out_of_order(FsyncMode::Off).await;
}

// ---------------------------------------------------------------------------------------------
// 5. Reloads while records are spilled.
// ---------------------------------------------------------------------------------------------

/// Events accepted (and `!sync`ed) with keys within `listen.max_key_bytes`, spilled with the
/// database down; a reload then lowers `listen.max_key_bytes` (a limit the docs say applies to
/// lines sent after the reload). The folder parses the spilled lines again against the new
/// limit: they must still be committed, and `!flush` must not answer `ok` for events that
/// were dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_lowers_max_key_bytes_keeps_spilled_events() {
    const CAP: usize = 100;
    const LONG: usize = 50;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |_| {}).await;
    rig.pg_down().await;
    let mut filler = rig.fill_memory(CAP).await;
    let mut c = rig.client().await;
    let key = |k: usize| format!("{k:03}-{}", "x".repeat(60));
    synced(
        &mut c,
        &buf_of((0..LONG).map(|k| format!("downloads {} 3", key(k)))),
    )
    .await;
    let spilled = rig
        .samples()
        .await
        .value("tallyd_journal_spilled_events_total");
    // The filler's own read may have spilled too (its events count against the cap before
    // the check): folded at once, with the database down, until memory was full.
    assert!(
        spilled >= LONG as f64,
        "the long keys were spilled ({spilled})"
    );
    rig.reload(&daemon, |c| c.listen.max_key_bytes = 32);
    rig.pg_up().await;
    let answer = flushed(&mut c, "after the reload").await;
    let (rows, sum) = rig.totals().await;
    let rejected = rig
        .samples()
        .await
        .value(r#"tallyd_lines_rejected_total{reason="key_too_long"}"#);
    println!("`!flush` answered {answer:?}; committed {rows} keys, sum {sum}; key_too_long rejections: {rejected}");
    assert_eq!(filler.flush().await, (CAP as u64, 0));
    assert_eq!(
        rig.totals().await,
        ((CAP + LONG) as i64, (CAP + 3 * LONG) as i64),
        "`!sync`ed events with keys the limit allowed when they were accepted were dropped at the fold \
         (`!flush` answered {answer:?})"
    );
    assert_eq!(answer, (LONG as u64, 0));
    assert!(daemon.terminate().success());
}

/// The same without any reload: a line within `listen.max_line_bytes` as sent becomes longer
/// in the journal (its canonical form gets ` @<unix ms>`, 15 bytes). Spilled, it is parsed
/// again at the fold against the same limit and rejected as too long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_line_near_max_line_bytes_survives_the_fold() {
    const CAP: usize = 100;
    const LONG: usize = 50;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |c| {
        c.listen.max_line_bytes = 128;
        c.listen.max_key_bytes = 120;
    })
    .await;
    rig.pg_down().await;
    let mut filler = rig.fill_memory(CAP).await;
    let mut c = rig.client().await;
    // 10 + 110 + 2 = 122 bytes a line: accepted.
    let lines = buf_of((0..LONG).map(|k| format!("downloads {k:03}-{} 3", "y".repeat(106))));
    assert!(lines.split(|&b| b == b'\n').all(|l| l.len() <= 128));
    synced(&mut c, &lines).await;
    rig.pg_up().await;
    let answer = flushed(&mut c, "lines near the limit").await;
    assert_eq!(filler.flush().await, (CAP as u64, 0));
    let too_long = rig
        .samples()
        .await
        .value(r#"tallyd_lines_rejected_total{reason="too_long"}"#);
    assert_eq!(
        rig.totals().await,
        ((CAP + LONG) as i64, (CAP + 3 * LONG) as i64),
        "accepted and `!sync`ed lines dropped at the fold ({too_long} rejected as too long; \
         `!flush` answered {answer:?})"
    );
    assert!(daemon.terminate().success());
}

/// A reload during spilling removes the counter the spilled events name, and lowers then
/// raises `coalesce.max_pending_keys`: the spilled events are still committed exactly, the
/// fold stays within the cap in force, and `!flush` answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_during_spilling_remove_a_counter_and_move_the_cap() {
    const CAP: usize = 1_000;
    const KEYS: usize = 20_000;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |_| {}).await;
    rig.pg_down().await;
    let mut filler = rig.fill_memory(CAP).await;
    let mut c = rig.client().await;
    for chunk in 0..KEYS / 1000 {
        synced(
            &mut c,
            &buf_of((0..1000).map(|k| format!("downloads k{chunk:02}-{k:03} 2"))),
        )
        .await;
    }
    let s = rig.samples().await;
    assert!(s.value("tallyd_journal_spilled_events_total") >= KEYS as f64);
    // `downloads` removed; the cap lowered to a tenth.
    rig.reload(&daemon, |c| {
        c.counters.retain(|k| k.name != "downloads");
        c.coalesce.max_pending_keys = CAP / 10;
        c.flush.max_pending_keys = CAP / 20;
    });
    rig.pg_up().await;
    let mut highest = 0.0f64;
    // Halfway through the fold, the cap is raised again.
    loop {
        let s = rig.samples().await;
        highest = highest.max(s.value("tallyd_pending_keys"));
        if s.value("tallyd_journal_folded_events_total") >= (KEYS / 2) as f64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    rig.reload(&daemon, |c| {
        c.coalesce.max_pending_keys = CAP * 5;
        c.flush.max_pending_keys = CAP;
    });
    assert_eq!(
        flushed(&mut c, "spilled events of a removed counter").await,
        (KEYS as u64, 0)
    );
    assert_eq!(filler.flush().await, (CAP as u64, 0));
    assert_eq!(
        rig.totals().await,
        ((CAP + KEYS) as i64, (CAP + 2 * KEYS) as i64)
    );
    // The fold at the lowered cap: one record (1000 keys) above it at most.
    println!("while folding at the lowered cap: at most {highest} keys pending");
    assert!(
        highest <= (CAP / 10 + 1000) as f64,
        "{highest} keys pending"
    );
    // Lines for the removed counter are refused after the reload, as for any unknown counter.
    c.send(b"!errors\ndownloads late 1\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    assert!(c.read_line().await.contains("unknown_counter"));
    assert!(daemon.terminate().success());
}

// ---------------------------------------------------------------------------------------------
// 4. `!flush` answers.
// ---------------------------------------------------------------------------------------------

/// Two events of one key whose sum overflows a bigint: when they are coalesced in memory the
/// second is rejected and `!flush` says so (`ok 2 1`). Spilled, the folder finds the overflow
/// on its own connection: the client's `!flush` must still count it as rejected, not answer
/// that both were accepted while only one is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known gap (docs/reliability.md): an overflow found while folding a spilled record is counted and logged, not reported in the sender's !flush"]
async fn flush_after_spilled_events_reports_their_overflow() {
    const CAP: usize = 50;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |_| {}).await;
    let big = i64::MAX;
    // In memory (database up): the reference answer.
    let mut c = rig.client().await;
    c.send(format!("downloads mem {big}\ndownloads mem {big}\n").as_bytes())
        .await;
    let in_memory = flushed(&mut c, "in memory").await;
    assert_eq!(in_memory, (1, 1), "the second event overflows");
    rig.pg_down().await;
    let mut filler = rig.fill_memory(CAP).await;
    synced(
        &mut c,
        format!("downloads spilled {big}\ndownloads spilled {big}\n").as_bytes(),
    )
    .await;
    assert!(
        rig.samples()
            .await
            .value("tallyd_journal_spilled_events_total")
            >= 2.0
    );
    rig.pg_up().await;
    let spilled = flushed(&mut c, "spilled").await;
    assert_eq!(filler.flush().await, (CAP as u64, 0));
    let db = sql(&rig.conninfos[0]).await;
    assert_eq!(common::key_total(&db, "downloads", "mem").await, big);
    assert_eq!(common::key_total(&db, "downloads", "spilled").await, big);
    assert_eq!(common::counter_total(&db, "views").await, CAP as i64);
    assert_eq!(
        spilled, in_memory,
        "`!flush` after spilled events answered {spilled:?}, coalesced in memory {in_memory:?}: \
         the overflow the folder found is not reported to the client"
    );
    assert!(daemon.terminate().success());
}

// ---------------------------------------------------------------------------------------------
// 2. Journal write failures (a full disk) while spilling and while folding.
// ---------------------------------------------------------------------------------------------

/// A tmpfs of `size` mounted on `dir` (root only), unmounted on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    /// `None` (with the reason printed) where a tmpfs cannot be mounted: not root, or a
    /// container without the capability. These tests need a real full filesystem.
    fn mount(dir: &Path, size: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(dir).unwrap();
        let ok = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!(
                "SKIPPED: cannot mount a tmpfs on {} (needs root and the capability to mount)",
                dir.display()
            );
            return None;
        }
        Some(Tmpfs(dir.to_path_buf()))
    }

    fn resize(&self, size: &str) {
        let ok = std::process::Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "cannot resize the tmpfs on {}", self.0.display());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let ok = std::process::Command::new("umount").arg(&self.0).status();
        if !ok.is_ok_and(|s| s.success()) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
}

/// One round as in tests/journal_faults.rs: `n` new keys and `!sync` in one write; the reply.
async fn round(c: &mut LineClient, prefix: &str, n: usize) -> String {
    let mut lines = buf_of((0..n).map(|k| format!("downloads {prefix}-{k:03} 1")));
    lines.extend_from_slice(b"!sync\n");
    c.send(&lines).await;
    tokio::time::timeout(PATIENCE, c.read_line())
        .await
        .expect("`!sync` answered")
}

/// The journal's disk (1 MiB) is smaller than `journal.max_bytes` (the default 1 GiB, as on a
/// shared disk with less free space than that): with the database down, spilled records fill
/// it and journal writes fail (`!sync` answers an error, reading pauses). The database comes
/// back. The memory part commits, but every segment still holds spilled records, and the
/// folder will not read them back while the journal fails; the writer retries into a disk
/// that only committing the spilled records could free. tallyd must get out of this by
/// itself. (Then the disk is grown, and the totals must be exact either way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_filled_by_spilled_records_frees_itself_once_the_database_returns() {
    const CAP: usize = 200;
    const CLIENTS: usize = 4;
    let mut rig = Rig::create(CAP, 0, &[], |_| {}).await;
    let Some(disk) = Tmpfs::mount(&rig.journal_dir(), "1m") else {
        return;
    };
    let daemon = rig.spawn().await;
    rig.pg_down().await;
    let mut clients = Vec::new();
    let mut sent = 0i64;
    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        let mut c = rig.client().await;
        tasks.push(tokio::spawn(async move {
            let mut sent = 0i64;
            for n in 0.. {
                let mut lines =
                    buf_of((0..200).map(|k| format!("downloads c{i}-r{n:04}-{k:03} 1")));
                lines.extend_from_slice(b"!sync\n");
                c.send(&lines).await;
                sent += 200;
                // Sent after the failure: its lines wait unread (reading pauses), and so does
                // the answer: it is read once the journal recovers.
                match tokio::time::timeout(Duration::from_secs(5), c.read_line()).await {
                    Ok(reply) if reply == "ok\n" => {}
                    Ok(reply) => {
                        assert!(reply.starts_with("error journal write failed"), "{reply}");
                        return (c, sent, false);
                    }
                    Err(_) => return (c, sent, true),
                }
            }
            unreachable!()
        }));
    }
    for t in tasks {
        let (c, n, unanswered) = t.await.unwrap();
        clients.push((c, unanswered));
        sent += n;
    }
    let s = rig.samples().await;
    assert_eq!(s.value("tallyd_journal_writes_failing"), 1.0);
    println!(
        "database down: {sent} events sent, {} spilled, until the 1 MiB journal disk was full",
        s.value("tallyd_journal_spilled_events_total")
    );
    rig.pg_up().await;
    // Recovered: journal writes work again and no spilled record is left unfolded.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut stuck = true;
    while Instant::now() < deadline {
        let s = rig.samples().await;
        if s.value("tallyd_journal_writes_failing") == 0.0
            && s.value("tallyd_journal_unfolded_records") == 0.0
        {
            stuck = false;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let s = rig.samples().await;
    let state = format!(
        "journal writes failing: {}, unfolded records: {}, keys committed: {:?} of {sent}",
        s.value("tallyd_journal_writes_failing"),
        s.value("tallyd_journal_unfolded_records"),
        rig.totals().await
    );
    println!("20 s after the database returned: stuck = {stuck}; {state}");
    if stuck {
        // What an operator would do: more space. Then everything must be exact.
        disk.resize("64m");
    }
    for (i, (c, unanswered)) in clients.iter_mut().enumerate() {
        if *unanswered {
            let reply = tokio::time::timeout(PATIENCE, c.read_line()).await;
            assert_eq!(
                reply.ok().as_deref(),
                Some("ok\n"),
                "client {i}'s late `!sync`"
            );
        }
        flushed(c, &format!("client {i}")).await;
    }
    assert_eq!(rig.totals().await, (sent, sent));
    assert!(
        !stuck,
        "tallyd did not recover by itself once the database returned: {state}"
    );
    drop(clients);
    assert!(daemon.terminate().success());
    drop(disk);
}

/// Fills every free byte of the filesystem holding `dir` with `dir/filler`.
fn fill(dir: &Path) -> PathBuf {
    use std::io::Write;
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).unwrap();
    let chunk = vec![0u8; 4096];
    while f.write_all(&chunk).is_ok() {}
    let _ = f.sync_all();
    path
}

/// Spilling with the database down, the journal's disk fills (`!sync` answers errors, reading
/// pauses), space returns (the failed records are written again to a new segment: some are now
/// on disk twice), more is spilled, then kill -9 with nothing committed. The next start's
/// replay must count every event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "passes; overlaps tests/journal_faults.rs: run by hand"]
async fn a_full_disk_while_spilling_then_kill_9_counts_each_event_once() {
    const CAP: usize = 300;
    let mut rig = Rig::create(CAP, 0, &[], |c| {
        c.journal.segment_bytes = 64 << 10;
    })
    .await;
    let Some(disk) = Tmpfs::mount(&rig.journal_dir(), "8m") else {
        return;
    };
    let daemon = rig.spawn().await;
    rig.pg_down().await;
    let mut a = rig.client().await;
    let mut sent = 0i64;
    for n in 0..20 {
        assert_eq!(round(&mut a, &format!("a{n:03}"), 250).await, "ok\n");
        sent += 250;
    }
    let filler = fill(&rig.journal_dir());
    let mut failed = false;
    for n in 20..2000 {
        let reply = round(&mut a, &format!("a{n:03}"), 250).await;
        sent += 250;
        if reply != "ok\n" {
            assert!(reply.starts_with("error journal write failed"), "{reply}");
            failed = true;
            break;
        }
    }
    assert!(failed, "the full disk never failed a write");
    // A second connection's lines wait unread while writes fail.
    let b = {
        let socket = rig.socket();
        tokio::spawn(async move {
            let mut b = LineClient::connect(&socket).await;
            let reply = round(&mut b, "b", 250).await;
            (b, reply)
        })
    };
    sent += 250;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!b.is_finished(), "reading pauses while the journal fails");
    std::fs::remove_file(&filler).unwrap();
    let (mut b, reply) = b.await.unwrap();
    assert_eq!(reply, "ok\n", "after space returned");
    for n in 0..20 {
        assert_eq!(round(&mut b, &format!("b{n:03}"), 250).await, "ok\n");
        sent += 250;
    }
    let s = rig.samples().await;
    assert_eq!(s.value("tallyd_journal_writes_failing"), 0.0);
    assert!(s.value("tallyd_journal_spilled_events_total") > 0.0);
    drop((a, b));
    daemon.kill();
    rig.pg_up().await;
    assert_eq!(
        rig.totals().await,
        (0, 0),
        "nothing committed before the kill"
    );
    let daemon = rig.spawn().await;
    assert_eq!(
        rig.totals().await,
        (sent, sent),
        "every event once after the replay"
    );
    println!("{sent} events, a full disk while spilling, kill -9: each counted once");
    assert!(daemon.terminate().success());
    drop(disk);
}

/// The database returns and the folder routes a large spilled backlog; the journal's disk
/// fills in the middle of it (writes of new spilled records fail) and space returns two
/// seconds later. Every event once, and every `!flush` answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_while_folding_recovers_exactly() {
    const CAP: usize = 500;
    const CLIENTS: usize = 4;
    const ROUNDS: usize = 20;
    let mut rig = Rig::create(CAP, 0, &[], |c| {
        c.journal.segment_bytes = 64 << 10;
    })
    .await;
    let Some(disk) = Tmpfs::mount(&rig.journal_dir(), "16m") else {
        return;
    };
    let daemon = rig.spawn().await;
    rig.pg_down().await;
    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        let mut c = rig.client().await;
        for n in 0..ROUNDS {
            assert_eq!(round(&mut c, &format!("c{i}-{n:03}"), 250).await, "ok\n");
        }
        clients.push(c);
    }
    let mut sent = (CLIENTS * ROUNDS * 250) as i64;
    let spilled = rig
        .samples()
        .await
        .value("tallyd_journal_spilled_events_total");
    rig.pg_up().await;
    loop {
        let folded = rig
            .samples()
            .await
            .value("tallyd_journal_folded_events_total");
        if folded >= spilled / 4.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let filler = fill(&rig.journal_dir());
    // New events while the disk is full: still spilled (the folder is behind), and written
    // only once space returns.
    let late = {
        let socket = rig.socket();
        tokio::spawn(async move {
            let mut c = LineClient::connect(&socket).await;
            let mut n = 0;
            let mut errors = 0;
            while n < 20 {
                if round(&mut c, &format!("late-{n:03}"), 250).await != "ok\n" {
                    errors += 1;
                }
                n += 1;
            }
            (c, errors)
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let failing = rig.samples().await.value("tallyd_journal_writes_failing");
    std::fs::remove_file(&filler).unwrap();
    let (c, errors) = late.await.unwrap();
    sent += 20 * 250;
    clients.push(c);
    for (i, c) in clients.iter_mut().enumerate() {
        flushed(c, &format!("client {i}")).await;
    }
    assert_eq!(rig.totals().await, (sent, sent));
    println!(
        "{sent} events; writes failing during the fold: {failing}, `!sync` errors: {errors}; exact"
    );
    let s = rig.samples().await;
    assert_eq!(s.value("tallyd_journal_unfolded_records"), 0.0);
    drop(clients);
    assert!(daemon.terminate().success());
    drop(disk);
}

// ---------------------------------------------------------------------------------------------
// 3. kill -9 while folding and during the start's bounded replay, backends terminated.
// ---------------------------------------------------------------------------------------------

/// Terminates every tallyd session in the cluster every `every` until `stop`; returns how many
/// it ended.
fn terminator(
    conninfo: String,
    every: Duration,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<i64> {
    tokio::spawn(async move {
        let mut ended = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok((client, conn)) =
                tokio_postgres::connect(&conninfo, tokio_postgres::NoTls).await
            {
                tokio::spawn(conn);
                if let Ok(rows) = client
                    .query(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                         WHERE application_name LIKE 'tallyd-%' AND pid <> pg_backend_pid()",
                        &[],
                    )
                    .await
                {
                    ended += rows.len() as i64;
                }
            }
            tokio::time::sleep(every).await;
        }
        ended
    })
}

/// `tallyd run` started without waiting for it to answer (its replay runs before it serves).
fn start_unready(rig: &Rig) -> std::process::Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(rig.config.with_extension("log"))
        .unwrap();
    std::process::Command::new(bin())
        .arg("--config")
        .arg(&rig.config)
        .arg("run")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

enum Killed {
    Yes,
    /// It exited by itself first.
    Exited,
    /// Everything was committed first (it was then killed all the same).
    Done,
}

/// Waits until the committed sum is at least `at`, then kill -9.
async fn kill_when_committed(
    rig: &Rig,
    child: &mut std::process::Child,
    at: i64,
    all: i64,
) -> Killed {
    let deadline = Instant::now() + PATIENCE;
    loop {
        assert!(
            Instant::now() < deadline,
            "nothing committed for {PATIENCE:?}"
        );
        if child.try_wait().unwrap().is_some() {
            return Killed::Exited;
        }
        // The database is being disturbed: a failed read is read again.
        let conninfo = rig.conninfos[0].clone();
        let sum = match tokio_postgres::connect(&conninfo, tokio_postgres::NoTls).await {
            Ok((client, conn)) => {
                tokio::spawn(conn);
                client
                    .query_one(
                        "SELECT coalesce(sum(count), 0)::bigint FROM tallyd.totals",
                        &[],
                    )
                    .await
                    .map(|r| r.get::<_, i64>(0))
                    .unwrap_or(0)
            }
            Err(_) => 0,
        };
        if sum >= at {
            child.kill().unwrap();
            child.wait().unwrap();
            return if sum >= all {
                Killed::Done
            } else {
                Killed::Yes
            };
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Spilled with the database down; then, with every tallyd session terminated every 100 ms
/// throughout: kill -9 while the folder routes the backlog, kill -9 twice during the next
/// starts' bounded replays (each further in), and a last start. Every event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_while_folding_and_during_replays_with_backends_terminated() {
    const CAP: usize = 1_000;
    const CLIENTS: usize = 4;
    const ROUNDS: usize = 16;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |c| {
        c.journal.segment_bytes = 256 << 10;
        c.flush.connections = 2;
    })
    .await;
    rig.pg_down().await;
    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        let mut c = rig.client().await;
        for n in 0..ROUNDS {
            assert_eq!(round(&mut c, &format!("c{i}-{n:03}"), 500).await, "ok\n");
        }
        clients.push(c);
    }
    let all = (CLIENTS * ROUNDS * 500) as i64;
    rig.pg_up().await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let terminations = terminator(
        rig.conninfos[0].clone(),
        Duration::from_millis(100),
        stop.clone(),
    );
    // While folding.
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (_, sum) = rig.totals().await;
        if sum >= all / 5 {
            break;
        }
        assert!(Instant::now() < deadline, "the fold does not progress");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    daemon.kill();
    drop(clients);
    let mut kills = vec![rig.totals().await.1];
    // During two replays, each further in. A start whose own session is terminated before
    // its replay exits (status 1, "connection closed"): it is started again, as systemd would.
    let mut refused = 0;
    for at in [all / 2, all * 3 / 4] {
        loop {
            let mut child = start_unready(&rig);
            match kill_when_committed(&rig, &mut child, at, all).await {
                Killed::Yes => kills.push(rig.totals().await.1),
                Killed::Exited => {
                    refused += 1;
                    assert!(refused < 20, "20 starts ended by themselves");
                    continue;
                }
                Killed::Done => {}
            }
            break;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let ended = terminations.await.unwrap();
    let daemon = rig.spawn().await;
    let mut c = rig.client().await;
    flushed(&mut c, "after the last start").await;
    assert_eq!(rig.totals().await, (all, all));
    println!(
        "{all} events; kill -9 with {kills:?} committed; {ended} sessions terminated, \
         {refused} starts ended by a terminated session; exact"
    );
    assert!(
        kills.len() >= 2,
        "no kill landed during a replay: {kills:?}"
    );
    assert!(daemon.terminate().success());
}

// ---------------------------------------------------------------------------------------------
// 4. Stops while records are spilled.
// ---------------------------------------------------------------------------------------------

/// SIGTERM, then how long the daemon took to exit (it must exit 0).
fn stop_timed(daemon: Daemon) -> Duration {
    let started = Instant::now();
    assert!(daemon.terminate().success(), "the stop failed");
    started.elapsed()
}

/// Spilled records at a graceful stop: once with the database down (a `!flush` waiting), once
/// with the database up while the folder routes a large backlog. Each stop is bounded by the
/// drain and shutdown timeouts (it does not fold the backlog first), the waiting `!flush` is
/// not answered `ok`, the log says records are left, and the next start replays them exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stops_with_spilled_records_are_bounded_and_the_next_start_replays_them() {
    const CAP: usize = 500;
    const ROUNDS: usize = 20;
    let bound = Duration::from_secs(1 + 2 + 5);
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |c| {
        c.daemon.set_drain_timeout(Duration::from_secs(1));
        c.daemon.set_shutdown_timeout(Duration::from_secs(2));
    })
    .await;
    rig.pg_down().await;
    let mut a = rig.client().await;
    for n in 0..ROUNDS {
        assert_eq!(round(&mut a, &format!("a{n:03}"), 500).await, "ok\n");
    }
    let mut sent = (ROUNDS * 500) as i64;
    // A `!flush` that can only be answered once the database is back.
    a.send(b"!flush\n").await;
    // The connection's end ("") or reset (the task panics) is what a stop may give it.
    let waiting = tokio::spawn(async move { a.read_line().await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let took = stop_timed(daemon);
    let answer = waiting
        .await
        .unwrap_or_else(|_| "<connection reset>".into());
    println!("stop with the database down: {took:?}; the waiting `!flush` got {answer:?}");
    assert!(took < bound, "the stop took {took:?}");
    assert!(
        !answer.starts_with("ok"),
        "`!flush` answered {answer:?} with nothing committed"
    );

    rig.pg_up().await;
    let daemon = rig.spawn().await;
    assert_eq!(rig.totals().await, (sent, sent), "replayed exactly");

    // Again with the database up: a backlog, and the stop while the folder routes it.
    rig.pg_down().await;
    let mut b = rig.client().await;
    for n in 0..ROUNDS * 2 {
        assert_eq!(round(&mut b, &format!("b{n:03}"), 500).await, "ok\n");
    }
    sent += (ROUNDS * 2 * 500) as i64;
    let spilled = rig
        .samples()
        .await
        .value("tallyd_journal_spilled_events_total");
    rig.pg_up().await;
    loop {
        if rig
            .samples()
            .await
            .value("tallyd_journal_folded_events_total")
            >= spilled / 10.0
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(b);
    let log_path = rig.config.with_extension("log");
    let took = stop_timed(daemon);
    let committed = rig.totals().await;
    let log = std::fs::read_to_string(&log_path).unwrap();
    println!("stop while folding: {took:?}, {committed:?} committed of {sent}");
    assert!(took < bound, "the stop took {took:?}");
    assert!(
        committed.1 < sent,
        "the fold ended before the stop: the test proves nothing"
    );
    assert!(log.contains("spilled journal records not yet routed at the stop"));
    let daemon = rig.spawn().await;
    assert_eq!(rig.totals().await, (sent, sent), "replayed exactly");
    assert!(daemon.terminate().success());
}

// ---------------------------------------------------------------------------------------------
// 6. Two flush writers per database, two databases (shards) in one cluster.
// ---------------------------------------------------------------------------------------------

/// Two shard databases in one cluster, two flush writers each (four writers whose coverage a
/// `!flush` after spilled records waits for), spilled with the cluster down; kill -9 halfway
/// through the fold, a restart, and every `!flush` answered: exact over the databases, each
/// key in the database its shard maps to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_and_two_writers_fold_and_replay_exactly() {
    const CAP: usize = 1_000;
    const CLIENTS: usize = 4;
    const ROUNDS: usize = 12;
    let (mut rig, daemon) = Rig::start(CAP, 2, &[], |c| {
        c.flush.connections = 2;
        c.coalesce.buckets = 64;
    })
    .await;
    rig.pg_down().await;
    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        let mut c = rig.client().await;
        for n in 0..ROUNDS {
            assert_eq!(round(&mut c, &format!("c{i}-{n:03}"), 400).await, "ok\n");
        }
        clients.push(c);
    }
    let all = (CLIENTS * ROUNDS * 400) as i64;
    rig.pg_up().await;
    // One connection's `!flush` is answered while the fold goes on.
    let first = flushed(&mut clients[0], "shards, first client").await;
    assert_eq!(first, ((ROUNDS * 400) as u64, 0));
    // Answered once committed: every event of that connection is in its database now.
    let mut c0 = 0;
    for conninfo in &rig.conninfos {
        c0 += scalar_pair(
            &sql(conninfo).await,
            "SELECT count(*), coalesce(sum(count), 0)::bigint FROM tallyd.totals WHERE key LIKE 'c0-%'",
        )
        .await
        .1;
    }
    assert_eq!(
        c0,
        (ROUNDS * 400) as i64,
        "`!flush` answered before its events committed"
    );
    let committed = rig.totals().await;
    daemon.kill();
    drop(clients);
    println!("kill -9 with {committed:?} of {all} committed");
    let daemon = rig.spawn().await;
    let mut c = rig.client().await;
    flushed(&mut c, "after the restart").await;
    assert_eq!(rig.totals().await, (all, all));
    // Each database holds the keys of its shards only: the layout's database for each key.
    let config = Config::load(&rig.config).unwrap();
    let layout = config.layout();
    let seed = tallyd::routing::counter_seed("downloads");
    for (d, conninfo) in rig.conninfos.iter().enumerate() {
        let rows = common::counts(&sql(conninfo).await, "downloads").await;
        assert!(!rows.is_empty(), "database {d} holds no key");
        for (key, count) in rows {
            assert_eq!(count, 1, "{key}");
            let hash = tallyd::routing::key_hash(seed, key.as_bytes());
            assert_eq!(layout.database(hash), d, "{key} in the wrong database");
        }
    }
    assert!(daemon.terminate().success());
}

// ---------------------------------------------------------------------------------------------
// 7. Memory of the start's replay.
// ---------------------------------------------------------------------------------------------

/// A journal of about 96 MiB (4 MiB segments) left by an outage (the database down, the same
/// 64 KiB of lines sent again and again, every read spilled or coalesced, none committed),
/// kill -9, then a start with the database up. The replay is said to be bounded by the memory
/// cap: the pending keys are, but the start must not hold the whole journal in memory either
/// (it reads it segment by segment, so a few segments at most). Exact afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known limit (docs/reliability.md, Spilling: Limits): the start reads the old segments into memory; the keys are capped, the records' bytes are not"]
async fn the_start_does_not_hold_a_large_journal_in_memory() {
    const CAP: usize = 500;
    const MIB: usize = 96;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |c| {
        c.journal.segment_bytes = 4 << 20;
        c.journal.fsync = FsyncMode::Off;
    })
    .await;
    rig.pg_down().await;
    // 64 KiB of lines over 1,000 keys, each key's delta 1.
    let mut chunk = Vec::new();
    let mut lines = 0i64;
    while chunk.len() < 65_000 {
        chunk.extend_from_slice(format!("downloads hot-{:03} 1\n", lines % 1000).as_bytes());
        lines += 1;
    }
    let mut c = rig.client().await;
    let mut sent = 0i64;
    let started = Instant::now();
    // A journal line is the line sent and ` @<unix ms>`: 35 bytes for 20.
    while (sent / lines) as usize * chunk.len() * 35 / 20 < MIB << 20 {
        c.send(&chunk).await;
        sent += lines;
    }
    synced(&mut c, b"").await;
    let journal = rig.samples().await.value("tallyd_journal_bytes") / 1048576.0;
    println!(
        "{sent} events, a {journal:.0} MiB journal in {:?}",
        started.elapsed()
    );
    drop(c);
    daemon.kill();
    rig.pg_up().await;
    let mut child = start_unready(&rig);
    let pid = child.id();
    let started = Instant::now();
    let mut rss_max = 0.0f64;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the start ended: {status}");
        }
        rss_max = rss_max.max(rss_mib(pid));
        if rig.totals().await.1 == sent {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "replay not done in 5 min"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    println!(
        "start with a {journal:.0} MiB journal: committed in {:?}, RSS up to {rss_max:.0} MiB",
        started.elapsed()
    );
    assert_eq!(rig.totals().await, (1000, sent));
    assert!(
        rss_max < journal,
        "the start held the journal in memory: RSS up to {rss_max:.0} MiB for a {journal:.0} MiB journal"
    );
}

// ---------------------------------------------------------------------------------------------
// 7. Memory and CPU (measurements, run by hand: `cargo test --test outage_attacks -- --ignored`).
// ---------------------------------------------------------------------------------------------

/// CPU seconds (user + system) the process has used.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat.rsplit_once(") ").unwrap().1.split(' ').collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

/// Resident memory in MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .unwrap()
        .trim()
        .trim_end_matches(" kB")
        .trim()
        .parse()
        .unwrap();
    kb / 1024.0
}

/// `clients` connections sending `per_tick` events each every `tick` over `keys` keys until
/// `stop`; returns the events sent.
fn steady_traffic(
    socket: PathBuf,
    clients: usize,
    tick: Duration,
    per_tick: usize,
    keys: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<(i64, Vec<LineClient>)> {
    tokio::spawn(async move {
        let mut conns = Vec::new();
        for _ in 0..clients {
            conns.push(LineClient::connect(&socket).await);
        }
        let mut sent = 0i64;
        let mut tick = tokio::time::interval(tick);
        let mut n = 0usize;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            tick.tick().await;
            for c in conns.iter_mut() {
                let lines =
                    buf_of((0..per_tick).map(|k| format!("downloads hot-{} 1", (n + k) % keys)));
                n += per_tick;
                c.send(&lines).await;
                sent += per_tick as i64;
            }
        }
        (sent, conns)
    })
}

/// After an outage, with steady traffic that the database keeps up with easily: does tallyd
/// leave spill mode (the folder catches up, records go to memory again), and what does the
/// folder's re-reading of the current segment cost? Compared with the same traffic before the
/// outage. Prints the figures; asserts only exactness.
async fn tailing_cost(segment_bytes: u64) {
    const CAP: usize = 100_000;
    let (mut rig, mut daemon) = Rig::start(CAP, 0, &[], |c| {
        c.journal.segment_bytes = segment_bytes;
    })
    .await;
    let pid = daemon.pid();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // 4 x 150 events / 10 ms = 60,000 events/s over a million keys: 12,000 keys a flush
    // interval (well under the cap), but the cap is reached after two seconds of outage.
    let traffic = steady_traffic(
        rig.socket(),
        4,
        Duration::from_millis(10),
        150,
        1_000_000,
        stop.clone(),
    );
    let measure = |label: &'static str, rig: &Rig, pid: u32| {
        let addr = rig.metrics;
        async move {
            let s0 = Samples::parse(&common::scrape(addr));
            let cpu0 = cpu_seconds(pid);
            let mut unfolded_min = f64::MAX;
            let mut rss_max = 0.0f64;
            for _ in 0..50 {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let s = Samples::parse(&common::scrape(addr));
                unfolded_min = unfolded_min.min(s.value("tallyd_journal_unfolded_records"));
                rss_max = rss_max.max(rss_mib(pid));
            }
            let s1 = Samples::parse(&common::scrape(addr));
            let cpu = cpu_seconds(pid) - cpu0;
            let spilled = s1.value("tallyd_journal_spilled_events_total")
                - s0.value("tallyd_journal_spilled_events_total");
            let received =
                s1.value("tallyd_received_bytes_total") - s0.value("tallyd_received_bytes_total");
            println!(
                "segment_bytes {segment_bytes}: {label}: {:.2} CPU s per s, {:.1} MB/s received, \
                 {spilled} events spilled in 10 s, unfolded records at least {unfolded_min}, RSS up to {rss_max:.0} MiB",
                cpu / 10.0,
                received / 10e6
            );
        }
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    measure("before the outage", &rig, pid).await;
    rig.pg_down().await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let s = rig.samples().await;
    println!(
        "segment_bytes {segment_bytes}: after 10 s down: journal {:.0} MiB, {} events spilled",
        s.value("tallyd_journal_bytes") / 1048576.0,
        s.value("tallyd_journal_spilled_events_total")
    );
    rig.pg_up().await;
    tokio::time::sleep(Duration::from_secs(20)).await;
    measure("20 s after the database returned", &rig, pid).await;
    measure("30 s after the database returned", &rig, pid).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (sent, mut conns) = traffic.await.unwrap();
    for c in conns.iter_mut() {
        flushed(c, "steady traffic").await;
    }
    assert_eq!(rig.totals().await.1, sent);
    let _ = daemon.try_wait();
    assert!(daemon.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run by hand"]
async fn measure_tailing_cost_64_mib_segments() {
    tailing_cost(64 << 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run by hand"]
async fn measure_tailing_cost_1_mib_segments() {
    tailing_cost(1 << 20).await;
}

/// With the database down: sends 64 KiB buffers over 100,000 keys (each key's delta 1) on one
/// connection until the journal holds `target` bytes; returns the connection (synced) and the
/// events sent.
async fn spill_fast(rig: &Rig, target: f64) -> (LineClient, i64) {
    let mut buffers = Vec::new();
    let mut k = 0usize;
    while k < 100_000 {
        let mut b = Vec::new();
        let mut n = 0i64;
        while b.len() < 65_000 && k < 100_000 {
            b.extend_from_slice(format!("downloads key-{k:06} 1\n").as_bytes());
            k += 1;
            n += 1;
        }
        buffers.push((b, n));
    }
    let mut c = rig.client().await;
    let mut sent = 0i64;
    let mut i = 0;
    loop {
        let (b, n) = &buffers[i % buffers.len()];
        c.send(b).await;
        sent += n;
        i += 1;
        if i % 500 == 0 && rig.samples().await.value("tallyd_journal_bytes") >= target {
            break;
        }
    }
    synced(&mut c, b"").await;
    (c, sent)
}

/// A journal of `ATTACK_JOURNAL_MIB` (256 by default) spilled with the database down, kill -9,
/// then a start: the start's resident memory while it reads and replays the journal, and the
/// pending keys (bounded by the cap). Prints the figures; asserts exactness.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run by hand"]
async fn measure_replay_memory() {
    const CAP: usize = 50_000;
    let target: f64 = std::env::var("ATTACK_JOURNAL_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256.0)
        * 1048576.0;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |c| {
        c.journal.max_bytes = 4 << 30;
    })
    .await;
    let pid = daemon.pid();
    rig.pg_down().await;
    let started = Instant::now();
    let (c, sent) = spill_fast(&rig, target).await;
    let rss_spilling = rss_mib(pid);
    let journal = rig.samples().await.value("tallyd_journal_bytes") / 1048576.0;
    println!(
        "spilled {sent} events, journal {journal:.0} MiB in {:?}; RSS while spilling {rss_spilling:.0} MiB",
        started.elapsed()
    );
    drop(c);
    daemon.kill();
    rig.pg_up().await;
    let mut child = start_unready(&rig);
    let pid = child.id();
    let started = Instant::now();
    let mut rss_max = 0.0f64;
    let mut pending_max = 0.0f64;
    let mut cpu;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the start ended: {status}");
        }
        rss_max = rss_max.max(rss_mib(pid));
        cpu = cpu_seconds(pid);
        let addr = rig.metrics;
        if let Ok(Ok(text)) =
            tokio::task::spawn_blocking(move || std::panic::catch_unwind(|| common::scrape(addr)))
                .await
        {
            pending_max = pending_max.max(Samples::parse(&text).value("tallyd_pending_keys"));
        }
        if std::os::unix::net::UnixStream::connect(rig.socket()).is_ok()
            && rig.totals().await.1 == sent
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(1200),
            "replay not done in 20 min"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "start with a {journal:.0} MiB journal: replayed and committed in {:?} ({cpu:.1} CPU s); \
         RSS up to {rss_max:.0} MiB; pending keys up to {pending_max} (cap {CAP})",
        started.elapsed()
    );
    assert_eq!(rig.totals().await, (100_000, sent));
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A spilled backlog of `ATTACK_JOURNAL_MIB` (256 by default; events over 100,000 keys, cap
/// 50,000) folded once the database returns, without a restart: how long, the CPU and the
/// resident memory, with the default 64 MiB segments. Prints the figures; asserts exactness.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run by hand"]
async fn measure_fold_of_a_large_backlog() {
    const CAP: usize = 50_000;
    let target: f64 = std::env::var("ATTACK_JOURNAL_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256.0)
        * 1048576.0;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |c| {
        c.journal.max_bytes = 4 << 30;
    })
    .await;
    let pid = daemon.pid();
    rig.pg_down().await;
    let started = Instant::now();
    let (mut c, sent) = spill_fast(&rig, target).await;
    let s = rig.samples().await;
    let journal = s.value("tallyd_journal_bytes") / 1048576.0;
    println!(
        "spilled {} of {sent} events, journal {journal:.0} MiB in {:?}; RSS {:.0} MiB",
        s.value("tallyd_journal_spilled_events_total"),
        started.elapsed(),
        rss_mib(pid)
    );
    let cpu0 = cpu_seconds(pid);
    rig.pg_up().await;
    let started = Instant::now();
    let mut rss_max = 0.0f64;
    let mut pending_max = 0.0f64;
    loop {
        let s = rig.samples().await;
        rss_max = rss_max.max(rss_mib(pid));
        pending_max = pending_max.max(s.value("tallyd_pending_keys"));
        if s.value("tallyd_journal_unfolded_records") == 0.0
            && s.value("tallyd_pending_keys") == 0.0
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(1800),
            "not folded in 30 min"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    flushed(&mut c, "after the fold").await;
    println!(
        "folded and committed a {journal:.0} MiB backlog in {:?} ({:.1} CPU s of tallyd); RSS up to \
         {rss_max:.0} MiB; pending keys up to {pending_max} (cap {CAP})",
        started.elapsed(),
        cpu_seconds(pid) - cpu0
    );
    assert_eq!(rig.totals().await, (100_000, sent));
    assert!(daemon.terminate().success());
}
