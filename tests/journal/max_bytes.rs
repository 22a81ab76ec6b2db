//! The journal's cap (`journal.max_bytes`) against the real `tallyd run` binary and a real
//! PostgreSQL that is stopped while clients send more than the cap holds: the journal on disk
//! stays within the cap (plus one record per runtime thread), memory stays bounded, control
//! lines are answered, `tallyd_journal_full` and a log line say so; once the database returns
//! intake resumes by itself and every event is counted once. A kill -9 at the cap loses nothing
//! that was read: after the restart's replay the clients send the rest, and totals are exact.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::{buf_of, free_port, sql, temp_dir, Daemon, LineClient, TestConfig};
use tallyd::config::KeyTypeName;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// `journal.max_bytes` in these tests.
const CAP: u64 = 256 * 1024;
/// `listen.read_buffer_bytes`: small, so that one record (one read) is small beside the cap.
const READ_BUFFER: usize = 4096;

/// How far over the cap the journal may go: one record per runtime thread that passed the check
/// at the same moment. A record holds what a connection's buffer had: the lines held at the cap
/// plus the next read, up to two reads, and canonical lines are under twice the bytes read (they
/// add `@unix_ms`); plus segment headers.
fn slack() -> u64 {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) as u64;
    threads * 2 * (2 * READ_BUFFER as u64 + 20) + 4096
}

/// Client `c`'s event `i`: a key of its own, delta 1, so that a count of 2 is a double.
fn line(c: usize, i: usize) -> String {
    format!("downloads c{c}-{i:07} 1")
}

/// The daemon's config: `journal.max_bytes` at [`CAP`], 16 KiB segments, small reads, flushes
/// every 200 ms, metrics on `port`, changed by `edit`; returns its path.
fn capped_config(
    dir: &Path,
    conninfo: &str,
    port: u16,
    edit: impl FnOnce(&mut tallyd::config::Config),
) -> PathBuf {
    TestConfig::new(dir)
        .counters(&[("downloads", KeyTypeName::Text)])
        .external(conninfo, "journal-cap")
        .metrics_port(port)
        .with(|c| {
            c.listen.read_buffer_bytes = READ_BUFFER;
            c.flush.set_interval(Duration::from_millis(200));
            c.flush.set_retry_initial(Duration::from_millis(20));
            c.flush.set_retry_max(Duration::from_millis(200));
            c.journal.max_bytes = CAP;
            c.journal.segment_bytes = 16 * 1024;
        })
        .with(edit)
        .write()
}

/// Bytes of the journal's segment files on disk.
fn journal_size(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir.join("data/journal")) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok()?.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

/// The daemon's resident memory, from /proc.
fn vm_rss(daemon: &Daemon) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", daemon.pid())).unwrap();
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .expect("VmRSS in /proc/<pid>/status");
    kb * 1024
}

async fn scrape(daemon: &Daemon, series: &'static str) -> f64 {
    let addr = daemon.metrics();
    tokio::task::spawn_blocking(move || {
        crate::common::Samples::parse(&crate::common::scrape(addr)).value(series)
    })
    .await
    .unwrap()
}

/// A client that sends `lines`, then `!flush`; returns what the `!flush` answers (accepted,
/// rejected), or None when the daemon went away first (a kill).
fn sender(socket: &Path, lines: Vec<u8>) -> tokio::task::JoinHandle<Option<(u64, u64)>> {
    let socket = socket.to_path_buf();
    tokio::spawn(async move {
        let stream = UnixStream::connect(&socket).await.expect("connect");
        let (rd, mut wr) = stream.into_split();
        wr.write_all(&lines).await.ok()?;
        wr.write_all(b"!flush\n").await.ok()?;
        let mut reply = String::new();
        BufReader::new(rd).read_line(&mut reply).await.ok()?;
        let f: Vec<&str> = reply.trim_end().split(' ').collect();
        match f[..] {
            ["ok", a, r] => Some((a.parse().unwrap(), r.parse().unwrap())),
            _ => None,
        }
    })
}

/// Samples the journal until it is at its cap and has stopped growing, asserting at every sample
/// that it stays within the cap plus the slack (plus `extra`, a datagram batch); returns the
/// largest size seen.
async fn wait_until_capped(daemon: &Daemon, dir: &Path, extra: u64) -> u64 {
    let bound = CAP + slack() + extra;
    // A guard against hanging forever, not a timing assertion.
    let give_up = Instant::now() + Duration::from_secs(300);
    let mut sizes = Vec::new();
    loop {
        let size = journal_size(dir);
        assert!(
            size <= bound,
            "journal {size} bytes on disk, over the cap {CAP} + slack (samples {sizes:?})"
        );
        sizes.push(size);
        let n = sizes.len();
        let full = scrape(daemon, "tallyd_journal_full").await;
        if full == 1.0 && n >= 4 && sizes[n - 4..].iter().all(|&s| s == size) {
            return sizes.into_iter().max().unwrap();
        }
        assert!(
            Instant::now() < give_up,
            "the journal never settled at its cap: sizes {sizes:?}, tallyd_journal_full {full}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// (keys, sum of counts, keys whose count is not 1) of counter `downloads`.
async fn totals(conninfo: &str) -> (i64, i64, i64) {
    let row = sql(conninfo)
        .await
        .query_one(
            "SELECT count(*), coalesce(sum(count), 0)::bigint, count(*) FILTER (WHERE count <> 1) \
             FROM tallyd.totals WHERE counter = 'downloads'",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// `!ping`, `!sync` and `!flush` (no events) on a new connection are answered at the cap:
/// `!sync` says `ok`, as everything read is journaled.
async fn control_lines_answered(socket: &Path) {
    let mut b = LineClient::connect(socket).await;
    b.send(b"!ping\n!sync\n!flush\n").await;
    // A guard against hanging forever, not a timing assertion.
    let wait = Duration::from_secs(60);
    let answers = [
        ("!ping", "pong\n"),
        ("!sync", "ok\n"),
        ("!flush", "ok 0 0\n"),
    ];
    for (control, answer) in answers {
        let reply = tokio::time::timeout(wait, b.read_line()).await;
        let reply = reply.unwrap_or_else(|_| panic!("{control} not answered at the cap"));
        assert_eq!(reply, answer, "{control}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_journal_stays_within_max_bytes_through_a_database_outage() {
    const CLIENTS: usize = 4;
    const EVENTS: usize = 150_000;
    let dir = temp_dir();
    let pg = crate::common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let config = capped_config(dir.path(), &conninfo, free_port(), |_| {});
    let mut daemon = crate::common::spawn_daemon(&config);
    let socket = daemon.socket().to_path_buf();
    crate::common::stop_postgres_immediate(pg).await;
    let rss_before = vm_rss(&daemon);

    // Far more than the cap: unbounded, the journal would take EVENTS * CLIENTS lines of ~37
    // bytes, and memory as many distinct keys.
    let senders: Vec<_> = (0..CLIENTS)
        .map(|c| sender(&socket, buf_of((0..EVENTS).map(|i| line(c, i)))))
        .collect();
    let most = wait_until_capped(&daemon, dir.path(), 0).await;
    let rss_capped = vm_rss(&daemon);
    let accepted = scrape(
        &daemon,
        "tallyd_events_accepted_total{counter=\"downloads\"}",
    )
    .await;
    let gauge = scrape(&daemon, "tallyd_journal_bytes").await;
    println!(
        "cap {CAP} (+ slack {}): journal at most {most} bytes on disk, gauge {gauge}; {accepted} of {} events read; VmRSS {} KiB before, {} KiB at the cap",
        slack(),
        CLIENTS * EVENTS,
        rss_before / 1024,
        rss_capped / 1024
    );
    assert!(gauge >= CAP as f64 && gauge <= (CAP + slack()) as f64);
    assert!(
        senders.iter().all(|s| !s.is_finished()),
        "back-pressure must hold the senders"
    );
    assert!(accepted < (CLIENTS * EVENTS) as f64);
    // Unbounded, tallyd would hold 600,000 keys (about 110 bytes each) and their lines.
    assert!(
        rss_capped < rss_before + 32 * 1024 * 1024,
        "VmRSS grew from {rss_before} to {rss_capped} bytes at the cap"
    );
    assert!(
        daemon.wait_for_log("journal full (journal.max_bytes)"),
        "{}",
        daemon.log()
    );
    control_lines_answered(&socket).await;
    assert!(senders.iter().all(|s| !s.is_finished()));

    // The database returns: flushes commit, segments go, intake resumes by itself.
    let pg = crate::common::postgres(dir.path()).await;
    for s in senders {
        let counts = tokio::time::timeout(Duration::from_secs(600), s)
            .await
            .expect("senders finish once the database is back")
            .unwrap();
        assert_eq!(counts, Some((EVENTS as u64, 0)));
    }
    let n = (CLIENTS * EVENTS) as i64;
    assert_eq!(totals(&conninfo).await, (n, n, 0), "every event sent, once");
    assert_eq!(scrape(&daemon, "tallyd_journal_full").await, 0.0);
    assert!(
        daemon
            .log()
            .contains("journal below journal.max_bytes again"),
        "{}",
        daemon.log()
    );
    assert!(daemon.terminate().success());
    crate::common::stop_postgres(pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_at_the_cap_loses_nothing_read() {
    const CLIENTS: usize = 2;
    const EVENTS: usize = 60_000;
    let dir = temp_dir();
    let pg = crate::common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let config = capped_config(dir.path(), &conninfo, free_port(), |_| {});
    let daemon = crate::common::spawn_daemon(&config);
    let socket = daemon.socket().to_path_buf();
    crate::common::stop_postgres_immediate(pg).await;

    let senders: Vec<_> = (0..CLIENTS)
        .map(|c| sender(&socket, buf_of((0..EVENTS).map(|i| line(c, i)))))
        .collect();
    wait_until_capped(&daemon, dir.path(), 0).await;
    // Everything read is journaled: `!sync` answers once it is on disk.
    control_lines_answered(&socket).await;
    let accepted = scrape(
        &daemon,
        "tallyd_events_accepted_total{counter=\"downloads\"}",
    )
    .await;
    assert!(daemon.kill().code().is_none(), "killed by SIGKILL");
    for s in senders {
        assert_eq!(s.await.unwrap(), None, "the kill cut every sender short");
    }

    // The restart replays the journal (and commits it) before it serves the socket.
    let pg = crate::common::postgres(dir.path()).await;
    let daemon = crate::common::spawn_daemon(&config);
    let (keys, sum, wrong) = totals(&conninfo).await;
    assert_eq!(
        (keys as f64, sum as f64, wrong),
        (accepted, accepted, 0),
        "every event read before the kill, once"
    );
    // tallyd reads a connection in order: each client's counted events are a prefix of its
    // lines. The clients send the rest.
    let client = sql(&conninfo).await;
    let mut rest = Vec::new();
    for c in 0..CLIENTS {
        let row = client
            .query_one(
                "SELECT count(*), coalesce(max(key), '') FROM tallyd.totals WHERE key LIKE $1",
                &[&format!("c{c}-%")],
            )
            .await
            .unwrap();
        let (counted, last): (i64, String) = (row.get(0), row.get(1));
        let counted = counted as usize;
        if counted > 0 {
            assert_eq!(last, line(c, counted - 1).split(' ').nth(1).unwrap());
        }
        println!("client {c}: {counted} of {EVENTS} events read before the kill");
        rest.push(sender(
            &socket,
            buf_of((counted..EVENTS).map(|i| line(c, i))),
        ));
    }
    for s in rest {
        assert!(s.await.unwrap().is_some_and(|(_, rejected)| rejected == 0));
    }
    let n = (CLIENTS * EVENTS) as i64;
    assert_eq!(totals(&conninfo).await, (n, n, 0), "every event sent, once");
    assert!(daemon.terminate().success());
    crate::common::stop_postgres(pg).await;
}

/// Datagrams at the cap wait in their socket, as at the memory cap: a blocking Unix datagram
/// sender blocks, nothing is dropped, and all of it is counted once the database returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datagrams_wait_in_their_socket_at_the_cap() {
    const DATAGRAMS: usize = 3_000;
    const LINES: usize = 50;
    let dir = temp_dir();
    let pg = crate::common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let dgram = dir.path().join("tallyd.dgram");
    let config = capped_config(dir.path(), &conninfo, free_port(), |c| {
        c.listen.set_datagram_socket(Some(dgram.clone()));
    });
    let daemon = crate::common::spawn_daemon(&config);
    crate::common::stop_postgres_immediate(pg).await;

    // A blocking sender: it waits while the socket's queue is full.
    let sender = tokio::task::spawn_blocking(move || {
        let socket = std::os::unix::net::UnixDatagram::unbound().unwrap();
        for d in 0..DATAGRAMS {
            let payload = buf_of((0..LINES).map(|i| line(9, d * LINES + i)));
            socket.send_to(&payload, &dgram).expect("send a datagram");
        }
    });
    // A datagram socket's record is one receive batch: up to 32 datagrams (`recvmmsg`), each
    // of LINES canonical lines (under twice the bytes sent).
    let payload = buf_of((0..LINES).map(|i| line(9, DATAGRAMS * LINES + i))).len() as u64;
    wait_until_capped(&daemon, dir.path(), 32 * 2 * payload).await;
    let accepted = scrape(
        &daemon,
        "tallyd_events_accepted_total{counter=\"downloads\"}",
    )
    .await;
    assert!(!sender.is_finished(), "the sender must be blocked");
    assert!(accepted < (DATAGRAMS * LINES) as f64);

    let pg = crate::common::postgres(dir.path()).await;
    sender.await.unwrap();
    let n = (DATAGRAMS * LINES) as i64;
    // No reply confirms a datagram: wait for the totals (a guard, not a timing assertion).
    let give_up = Instant::now() + Duration::from_secs(300);
    loop {
        let got = totals(&conninfo).await;
        if got == (n, n, 0) {
            break;
        }
        assert!(got.2 == 0 && got.0 <= n, "{got:?}");
        assert!(Instant::now() < give_up, "totals stuck at {got:?} of {n}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    println!("datagrams at the cap: {accepted} events read while full, all {n} counted after");
    assert!(daemon.terminate().success());
    crate::common::stop_postgres(pg).await;
}

#[test]
fn max_bytes_is_validated_and_0_means_the_default() {
    let dir = temp_dir();
    let config = |max_bytes| {
        TestConfig::new(dir.path())
            .counters(&[("downloads", KeyTypeName::Text)])
            .with(|c| c.journal.max_bytes = max_bytes)
            .config()
            .clone()
    };
    let err = config(1000).validate().unwrap_err().to_string();
    assert!(err.contains("journal.max_bytes"), "{err}");
    assert!(err.contains("at least 65536"), "{err}");
    let default = config(0);
    default.validate().unwrap();
    assert_eq!(default.journal.max_bytes(), 1 << 30);
    assert_eq!(config(65_536).journal.max_bytes(), 65_536);
}

/// The cap with the database up: no timed flush (an hour), `fsync = "always"`, and segments
/// larger than the cap, so the open segment is never rotated and only its deletion once every
/// writer has covered it frees space. Clients send far more than the cap holds; the cap's
/// early flushes must keep intake going (no deadlock) and every event is counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cap_with_the_database_up_never_stalls_intake() {
    const CLIENTS: usize = 4;
    const EVENTS: usize = 30_000;
    let dir = temp_dir();
    let pg = crate::common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let config = capped_config(dir.path(), &conninfo, free_port(), |c| {
        c.flush.set_interval(Duration::from_secs(3600));
        c.journal.fsync = tallyd::config::FsyncMode::Always;
        c.journal.segment_bytes = 64 << 20;
    });
    let daemon = crate::common::spawn_daemon(&config);
    let senders: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let lines: String = (0..EVENTS).map(|i| line(c, i) + "\n").collect();
            sender(daemon.socket(), lines.into_bytes())
        })
        .collect();
    for s in senders {
        // A guard against hanging forever (a deadlock at the cap), not a timing assertion.
        let answer = tokio::time::timeout(Duration::from_secs(300), s)
            .await
            .expect("intake stalled at the cap with the database up")
            .unwrap();
        assert_eq!(answer, Some((EVENTS as u64, 0)));
    }
    let n = (CLIENTS * EVENTS) as i64;
    assert_eq!(totals(&conninfo).await, (n, n, 0));
    assert!(scrape(&daemon, "tallyd_journal_full").await <= 1.0);
    assert!(daemon.terminate().success());
    crate::common::stop_postgres(pg).await;
}
