//! The journal's disk full, against the real `tallyd run` binary and a real PostgreSQL: it
//! fills up (a small tmpfs mounted on `data_dir/journal`, or, where mounting is not possible, a
//! file-size limit set on the running daemon) in each fsync mode. `!sync` must answer errors and
//! reading must pause while writes fail, tallyd must recover by itself once space returns, and
//! after a kill -9 and a restart every event sent is counted exactly once, an acknowledged
//! batch whose routed record was not written too.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common::{buf_of, free_port, sql, temp_dir, Daemon, LineClient, Samples, TestConfig};
use tallyd::config::{FsyncMode, KeyTypeName};

/// How the journal's disk is made full: a tmpfs, or a file-size limit on the daemon.
enum DiskFault {
    /// Mounted on `dir`; `filler` takes the free space.
    Tmpfs { dir: PathBuf, filler: PathBuf },
    /// RLIMIT_FSIZE lowered on the running daemon (SIGXFSZ is ignored by it).
    FileSize,
}

impl DiskFault {
    /// Mounts a 1 MiB tmpfs on `dir` if possible (root), else falls back to a file-size limit
    /// and says so.
    fn new(dir: &Path) -> DiskFault {
        std::fs::create_dir_all(dir).unwrap();
        // TALLYD_TEST_NO_TMPFS=1 tries the fallback where mounting works.
        let mounted = match std::env::var_os("TALLYD_TEST_NO_TMPFS") {
            Some(_) => Err(std::io::Error::other("TALLYD_TEST_NO_TMPFS is set")),
            None => Command::new("mount")
                .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
                .arg(dir)
                .status(),
        };
        match mounted {
            Ok(s) if s.success() => DiskFault::Tmpfs {
                dir: dir.to_path_buf(),
                filler: dir.join("filler"),
            },
            other => {
                println!(
                    "cannot mount a tmpfs on {} ({other:?}): falling back to RLIMIT_FSIZE on the daemon",
                    dir.display()
                );
                DiskFault::FileSize
            }
        }
    }

    /// Makes every further journal write fail.
    fn fill(&self, daemon: &Daemon) {
        match self {
            DiskFault::Tmpfs { filler, .. } => {
                let mut f = std::fs::File::create(filler).unwrap();
                let chunk = vec![0u8; 4096];
                while f.write_all(&chunk).is_ok() {}
            }
            // The limit is per file: with any room, a retry of a few small records into a new
            // segment would succeed while the test expects writes to fail.
            DiskFault::FileSize => set_fsize(daemon, 0),
        }
    }

    fn free(&self, daemon: &Daemon) {
        match self {
            DiskFault::Tmpfs { filler, .. } => std::fs::remove_file(filler).unwrap(),
            DiskFault::FileSize => set_fsize(daemon, libc::RLIM_INFINITY),
        }
    }
}

/// Unmounts even when the test fails (the daemon must be gone first: callers kill it before).
impl Drop for DiskFault {
    fn drop(&mut self) {
        if let DiskFault::Tmpfs { dir, .. } = self {
            let ok = Command::new("umount").arg(&*dir).status();
            if !ok.is_ok_and(|s| s.success()) {
                let _ = Command::new("umount").arg("-l").arg(&*dir).status();
            }
        }
    }
}

fn set_fsize(daemon: &Daemon, bytes: libc::rlim_t) {
    let limit = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: prlimit(2) on our own child with a valid struct.
    let rc = unsafe {
        libc::prlimit(
            daemon.pid() as i32,
            libc::RLIMIT_FSIZE,
            &limit,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
}

/// The value of an unlabelled series in a /metrics scrape.
fn scrape(addr: SocketAddr, name: &str) -> f64 {
    Samples::parse(&crate::common::scrape(addr)).value(name)
}

/// `tallyd run` with SIGXFSZ ignored (so a file-size limit makes writes fail, not the process
/// die), once its socket answers `!ping`.
fn spawn(config: &Path) -> Daemon {
    use std::os::unix::process::CommandExt;
    Daemon::spawn_with(Path::new(crate::common::BIN), config, |cmd| {
        // SAFETY: only async-signal-safe signal(2) between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                Ok(())
            });
        }
    })
}

/// One round: 200 new keys, delta 1, then `!sync`, in one write (so that tallyd reads the
/// `!sync` with the lines, before a write failure pauses reading); returns the reply.
async fn round(c: &mut LineClient, prefix: &str, n: usize) -> String {
    let mut lines = buf_of((0..200).map(|k| format!("downloads {prefix}-{n}-{k} 1")));
    lines.extend_from_slice(b"!sync\n");
    c.send(&lines).await;
    // A guard against hanging forever, not a timing assertion.
    tokio::time::timeout(Duration::from_secs(120), c.read_line())
        .await
        .expect("no answer to `!sync` within 120 s")
}

/// The daemon's config: no timed flush (at a kill, every event is only in the journal),
/// metrics on `metrics`, `fsync` as named; returns its path.
fn disk_full_config(
    dir: &Path,
    conninfo: &str,
    metrics: SocketAddr,
    instance: &str,
    fsync: &str,
) -> PathBuf {
    let fsync = match fsync {
        "always" => FsyncMode::Always,
        "interval" => FsyncMode::Interval,
        "off" => FsyncMode::Off,
        other => panic!("no fsync mode {other:?}"),
    };
    TestConfig::new(dir)
        .counters(&[("downloads", KeyTypeName::Text)])
        .external(conninfo, instance)
        .never_flushes()
        .metrics_port(metrics.port())
        .with(|c| c.journal.fsync = fsync)
        .write()
}

async fn full_disk(mode: &str) {
    let dir = temp_dir();
    let pg = crate::common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let port = free_port();
    let metrics: SocketAddr = ([127, 0, 0, 1], port).into();
    // No timed flush: at the kill, every event is only in the journal (twice, for the records
    // written again after the failure), and replay alone must count each once.
    let config = disk_full_config(
        dir.path(),
        &conninfo,
        metrics,
        &format!("full-disk-{mode}"),
        mode,
    );
    let socket = dir.path().join("tallyd.sock");
    let fault = DiskFault::new(&dir.path().join("data/journal"));
    let mut daemon = Some(spawn(&config));
    let pid = || daemon.as_ref().unwrap();

    let mut a = LineClient::connect(&socket).await;
    let mut sent = 0usize;
    for n in 0..3 {
        assert_eq!(
            round(&mut a, "a", n).await,
            "ok\n",
            "{mode}: before the fault"
        );
        sent += 200;
    }
    assert_eq!(scrape(metrics, "tallyd_journal_writes_failing"), 0.0);

    fault.fill(pid());
    let mut failed_at = None;
    for n in 3..200 {
        let reply = round(&mut a, "a", n).await;
        sent += 200;
        if reply != "ok\n" {
            assert!(
                reply.starts_with("error journal write failed"),
                "{mode}: {reply}"
            );
            println!("{mode}: round {n} answered {}", reply.trim_end());
            failed_at = Some(n);
            break;
        }
    }
    let failed_at =
        failed_at.unwrap_or_else(|| panic!("{mode}: a full disk never made `!sync` fail"));
    assert_eq!(
        scrape(metrics, "tallyd_journal_writes_failing"),
        1.0,
        "{mode}: {}",
        std::fs::read_to_string(config.with_extension("log")).unwrap_or_default()
    );
    assert!(scrape(metrics, "tallyd_journal_errors_total") >= 1.0);

    // While writes fail, a new connection's lines are not read: its `!sync` waits.
    let b = {
        let socket = socket.clone();
        tokio::spawn(async move {
            let mut b = LineClient::connect(&socket).await;
            round(&mut b, "b", 0).await
        })
    };
    sent += 200;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !b.is_finished(),
        "{mode}: reading must pause while the journal fails"
    );
    assert_eq!(scrape(metrics, "tallyd_journal_writes_failing"), 1.0);

    // Space returns: tallyd writes the failed records again and reads on, without a restart.
    fault.free(pid());
    assert_eq!(b.await.unwrap(), "ok\n", "{mode}: after space returned");
    a.send(b"!sync\n").await;
    assert_eq!(a.read_line().await, "ok\n", "{mode}: after space returned");
    assert_eq!(scrape(metrics, "tallyd_journal_writes_failing"), 0.0);
    for n in failed_at + 1..failed_at + 4 {
        assert_eq!(
            round(&mut a, "a", n).await,
            "ok\n",
            "{mode}: after recovery"
        );
        sent += 200;
    }

    // Every line sent so far was followed by a `!sync ok` on its connection: all must survive.
    daemon.take().unwrap().kill();
    daemon = Some(spawn(&config));
    let mut c = LineClient::connect(&socket).await;
    assert_eq!(c.flush().await, (0, 0));
    let client = sql(&conninfo).await;
    let rows = client
        .query("SELECT key, count FROM tallyd.totals ORDER BY key", &[])
        .await
        .unwrap();
    let wrong: Vec<(String, i64)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .filter(|(_, n)| *n != 1)
        .take(5)
        .collect();
    assert!(
        wrong.is_empty(),
        "{mode}: keys not counted exactly once: {wrong:?}"
    );
    assert_eq!(rows.len(), sent, "{mode}: every event sent, once");
    let damaged = dir.path().join("data/journal/damaged");
    assert!(!damaged.exists(), "{mode}: a failed write is not damage");
    println!(
        "{mode}: {sent} events sent, `!sync` failed at round {failed_at}, recovered without a restart; after kill -9 all {sent} counted once"
    );
    assert!(daemon.take().unwrap().terminate().success());
    drop(fault);
    crate::common::stop_postgres(pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_disk_fsync_always() {
    full_disk("always").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_disk_fsync_interval() {
    full_disk("interval").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_disk_fsync_off() {
    full_disk("off").await;
}

/// A batch acknowledged (`ok`) whose routed journal record cannot be written (the disk fills
/// up after its payload was held, while its claim waits on a lock, so the record is the first
/// write to fail): its held payload stays until the record is written, so after a kill -9 the
/// next start routes it, and it counts once. Deleted as soon as the batch was routed (the
/// defect that lost batches in tests/batches.rs's kill -9 test, there in the moment the record
/// waited in the writer's queue), the batch counted nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_routed_record_is_not_written_stays_held_and_counts_after_kill_9() {
    let dir = temp_dir();
    let pg = crate::common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let metrics: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    // Timed flushes: the batch routed at the next start commits without a `!flush` of its own.
    let config = TestConfig::new(dir.path())
        .counters(&[("downloads", KeyTypeName::Text)])
        .external(&conninfo, "batch-unwritten")
        .metrics_port(metrics.port())
        .with(|c| {
            c.journal.fsync = FsyncMode::Always;
            c.flush.set_interval(Duration::from_millis(150));
        })
        .write();
    let socket = dir.path().join("tallyd.sock");
    let held = dir.path().join("data/batches");
    let fault = DiskFault::new(&dir.path().join("data/journal"));
    let mut daemon = Some(spawn(&config));
    let mut a = LineClient::connect(&socket).await;
    for n in 0..3 {
        assert_eq!(round(&mut a, "a", n).await, "ok\n");
    }

    // The claim waits (its INSERT) until the lock goes: `!commit` answers `ok` after 2 s,
    // undecided, with the payload held.
    let mut locker = sql(&conninfo).await;
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE tallyd.batches IN EXCLUSIVE MODE")
        .await
        .unwrap();
    let lines: String = (0..300)
        .map(|j| format!("downloads batch-{j} 2\n"))
        .collect();
    let mut b = LineClient::connect(&socket).await;
    b.send(format!("!batch unwritten:0\n{lines}!commit\n").as_bytes())
        .await;
    assert_eq!(b.read_line().await, "ok\n", "`!batch`");
    assert_eq!(b.read_line().await, "ok 300 0\n", "`!commit`: held");
    assert_eq!(std::fs::read_dir(&held).unwrap().count(), 1, "held");
    fault.fill(daemon.as_ref().unwrap());
    lock.commit().await.unwrap();
    // Claimed now, then routed: its record is the first journal write since the disk filled.
    let client = sql(&conninfo).await;
    crate::common::wait_until(
        "the claim and the routed record's failed write",
        async || {
            crate::common::scalar(&client, "SELECT count(*) FROM tallyd.batches").await == 1
                && scrape(metrics, "tallyd_journal_writes_failing") == 1.0
        },
    )
    .await;
    // Not a timing assertion: a held file deleted at routing is gone by now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        std::fs::read_dir(&held).unwrap().count(),
        1,
        "the batch stays held while its routed record is not written"
    );

    daemon.take().unwrap().kill();
    // The file-size limit went with the process.
    if let DiskFault::Tmpfs { filler, .. } = &fault {
        std::fs::remove_file(filler).unwrap();
    }
    daemon = Some(spawn(&config));
    let want = 3 * 200 + 600;
    crate::common::wait_until("the held batch counted", async || {
        crate::common::counter_total(&client, "downloads").await == want
    })
    .await;
    crate::common::wait_until("the held file settled", async || {
        std::fs::read_dir(&held).unwrap().count() == 0
    })
    .await;
    a = LineClient::connect(&socket).await;
    assert_eq!(a.flush().await, (0, 0));
    assert_eq!(
        crate::common::counter_total(&client, "downloads").await,
        want,
        "every `!sync`ed event and the batch, once"
    );
    assert!(daemon.take().unwrap().terminate().success());
    drop(fault);
    crate::common::stop_postgres(pg).await;
}

/// The records of a journal segment as (offset, record length, lines), found by their marks.
fn records_of(bytes: &[u8]) -> Vec<(usize, usize, String)> {
    const MARK: [u8; 4] = [0xFF, 0xA5, b'T', b'R'];
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(p) = bytes[at..].windows(4).position(|w| w == MARK) {
        let start = at + p;
        let len = u32::from_le_bytes(bytes[start + 4..start + 8].try_into().unwrap()) as usize;
        let lines = String::from_utf8(bytes[start + 20..start + 20 + len].to_vec()).unwrap();
        out.push((start, 20 + len, lines));
        at = start + 20 + len;
    }
    out
}

/// A segment damaged between two runs: one flipped byte in a record in the middle, and another
/// record appended a second time. After the restart exactly the damaged record's events are
/// missing, the copy counts once, the loss is in the metrics, and the segment is kept aside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_segment_loses_only_the_damaged_record() {
    let dir = temp_dir();
    let pg = crate::common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let metrics: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let config = disk_full_config(dir.path(), &conninfo, metrics, "damaged-journal", "always");
    let socket = dir.path().join("tallyd.sock");
    let mut daemon = Some(spawn(&config));
    let mut a = LineClient::connect(&socket).await;
    for n in 0..10 {
        assert_eq!(round(&mut a, "d", n).await, "ok\n");
    }
    daemon.take().unwrap().kill();

    let journal = dir.path().join("data/journal");
    let segments: Vec<PathBuf> = std::fs::read_dir(&journal)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(segments.len(), 1, "{segments:?}");
    let mut bytes = std::fs::read(&segments[0]).unwrap();
    let records = records_of(&bytes);
    assert!(records.len() >= 10, "one record per round at least");
    let (victim, victim_len, lost_lines) = records[records.len() / 2].clone();
    let (copy, copy_len, _) = records[1].clone();
    let copied = bytes[copy..copy + copy_len].to_vec();
    bytes[victim + 20 + 3] ^= 0x01;
    bytes.extend_from_slice(&copied);
    std::fs::write(&segments[0], &bytes).unwrap();
    let lost: Vec<&str> = lost_lines
        .lines()
        .map(|l| l.split(' ').nth(1).unwrap())
        .collect();

    daemon = Some(spawn(&config));
    let mut c = LineClient::connect(&socket).await;
    assert_eq!(c.flush().await, (0, 0));
    let rows = sql(&conninfo)
        .await
        .query("SELECT key, count FROM tallyd.totals", &[])
        .await
        .unwrap();
    let counted: std::collections::HashMap<String, i64> =
        rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(
        counted.len(),
        2000 - lost.len(),
        "all but the damaged record's keys"
    );
    assert!(
        counted.values().all(|&n| n == 1),
        "the copied record counts once"
    );
    assert!(lost.iter().all(|k| !counted.contains_key(*k)));
    assert_eq!(
        scrape(metrics, "tallyd_journal_unreadable_records_total"),
        1.0
    );
    assert_eq!(
        scrape(metrics, "tallyd_journal_unreadable_bytes_total"),
        victim_len as f64
    );
    assert_eq!(scrape(metrics, "tallyd_journal_missing_records_total"), 1.0);
    let aside: Vec<_> = std::fs::read_dir(journal.join("damaged"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(aside.len(), 1);
    assert_eq!(
        std::fs::read(&aside[0]).unwrap(),
        bytes,
        "kept byte for byte"
    );
    println!(
        "damaged segment: {} of 2000 events lost with the damaged record ({victim_len} bytes), the rest counted once",
        lost.len()
    );
    assert!(daemon.take().unwrap().terminate().success());
    crate::common::stop_postgres(pg).await;
}
