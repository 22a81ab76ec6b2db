//! Connections that misbehave, idle or pile up stall only themselves, against a real daemon
//! and PostgreSQL: random bytes, NULs, invalid UTF-8 and a 100 MB line are rejected line by
//! line; random byte streams cut anywhere leave the known lines exact; connections over
//! `listen.max_connections` are refused politely or admitted by closing the longest-idle one
//! (and `listen.idle_timeout_ms` closes a silent one, telling why); a client that never reads
//! and a byte-at-a-time writer hold up no one else; with 256 file descriptors, idle clients
//! leave the flush the descriptors it needs to reconnect. Every total exact.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{
    buf_of, free_port, temp_dir, terminate, Daemon, Harness, LineClient, Sessions, TestConfig,
};
use rand::{Rng, RngCore};
use tallyd::config::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_input_touches_nothing_else() {
    let h = Harness::start(|c| c.listen.max_connections = 100).await;

    // Random bytes, NULs and invalid UTF-8, each burst ended by a newline.
    let mut raw = h.client().await;
    let mut rng = rand::thread_rng();
    for _ in 0..50 {
        let mut junk = vec![0u8; rng.gen_range(1..20_000)];
        rng.fill_bytes(&mut junk);
        junk.extend_from_slice(b"\0\xff\xfe\n");
        raw.send(&junk).await;
    }
    raw.send(b"downloads valid 5\n").await;
    let (accepted, rejected) = raw.flush().await;
    assert!(accepted >= 1 && rejected >= 50, "{accepted} {rejected}");

    // A 100 MB line without a newline: one rejection, bounded memory, then the next line works.
    let mut huge = h.client().await;
    let block = vec![b'x'; 1 << 20];
    for _ in 0..100 {
        huge.send(&block).await;
    }
    huge.send(b"\ndownloads valid 7\n").await;
    assert_eq!(huge.flush().await, (1, 1));

    drop((raw, huge));

    // Connections over the limit are refused politely, or admitted by closing connections idle
    // for a second or more (which ones depends on timing; together they are 200).
    let mut idle = Vec::new();
    for _ in 0..300 {
        idle.push(tokio::net::UnixStream::connect(h.socket()).await.unwrap());
    }
    let mut turned_away = 0;
    for s in idle.iter_mut() {
        let mut buf = [0u8; 128];
        if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(20), s.read(&mut buf)).await {
            if buf[..n].starts_with(b"error too many connections")
                || buf[..n].starts_with(b"error idle, closed to admit")
            {
                turned_away += 1;
            }
        }
    }
    assert!(turned_away >= 300 - 100, "turned away {turned_away}");
    // Now every open connection has been idle for a while: a new client is still served.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut good = h.client().await;
    good.send(b"downloads valid 11\n").await;
    assert_eq!(good.flush().await, (1, 0));
    drop(idle);

    // A client that never reads its answers, and a slow-loris writer, stall only themselves.
    let mut deaf = h.client().await;
    // Its writes stall once the daemon stops reading it; after 10 s the daemon hangs up.
    let deaf = tokio::spawn(async move {
        let _ = deaf.wr.write_all(&b"!ping\n".repeat(200_000)).await;
    });
    let slow = {
        let socket = h.socket().to_path_buf();
        tokio::spawn(async move {
            let mut c = LineClient::connect(&socket).await;
            for b in b"downloads valid 13\n" {
                c.send(&[*b]).await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            c.flush().await
        })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    for _ in 0..5 {
        good.send(b"downloads valid 1\n").await;
        assert_eq!(good.flush().await, (1, 0));
    }
    assert_eq!(slow.await.unwrap(), (1, 0));
    assert_eq!(h.total("downloads", "valid").await.0, 5 + 7 + 11 + 13 + 5);
    deaf.abort();
    h.stop().await;
}

/// Random byte streams, cut at random points, interleaved with known lines: the daemon
/// survives and the known lines count exactly. One runtime and one daemon for every case (the
/// cases share the database, each cleaning up after itself), stopped once every case has run,
/// whether they passed or not: no PostgreSQL is left behind.
#[test]
fn fuzz_over_the_socket_random_streams_with_known_lines() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config as ProptestConfig, TestRunner};

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let h = rt.block_on(Harness::start(|_| {}));
    let chunks = proptest::collection::vec(
        (proptest::collection::vec(any::<u8>(), 0..3000), 1i64..100),
        1..20,
    );
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 24,
        ..ProptestConfig::default()
    });
    let result = runner.run(&chunks, |chunks| {
        rt.block_on(async {
            let mut c = h.client().await;
            let mut expected = 0;
            for (junk, delta) in &chunks {
                c.send(junk).await;
                c.send(format!("\ndownloads fuzzcheck {delta}\n").as_bytes())
                    .await;
                expected += delta;
            }
            let (accepted, _) = c.flush().await;
            assert!(accepted >= chunks.len() as u64);
            assert_eq!(h.total("downloads", "fuzzcheck").await.0, expected);
            h.sql()
                .await
                .batch_execute("TRUNCATE tallyd.slots, tallyd.rollups")
                .await
                .unwrap();
        });
        Ok(())
    });
    rt.block_on(h.stop());
    if let Err(failure) = result {
        panic!("{failure}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_never_lock_out_a_client() {
    let h = Harness::start(|c| c.listen.max_connections = 4).await;
    let mut idle = Vec::new();
    for _ in 0..4 {
        let mut c = h.client().await;
        c.send(b"!ping\n").await;
        assert_eq!(c.read_line().await, "pong\n");
        idle.push(c);
    }
    // Only connections idle for at least a second may make room (see EVICT_MIN_IDLE). A wide
    // margin: on a loaded machine the daemon may start waiting on them late.
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let mut good = h.client().await;
    good.send(b"downloads admitted 1\n").await;
    assert_eq!(good.flush().await, (1, 0));
    // The idle connection closed to admit it was told why before its slot was reused.
    let mut closed = 0;
    for c in &mut idle {
        let mut buf = [0u8; 128];
        match c.wr.as_ref().try_read(&mut buf) {
            Ok(n) => {
                let text = String::from_utf8_lossy(&buf[..n]);
                assert_eq!(
                    text,
                    "error idle, closed to admit a new connection at listen.max_connections\n"
                );
                closed += 1;
            }
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock),
        }
    }
    assert_eq!(closed, 1, "exactly the longest idle connection is closed");
    assert_eq!(h.total("downloads", "admitted").await.0, 1);
    h.stop().await;

    // With listen.idle_timeout_ms, a connection that sends nothing is closed, telling why; what
    // it sent before is kept.
    let h = Harness::start(|c| c.listen.set_idle_timeout(Some(Duration::from_millis(300)))).await;
    let mut c = h.client().await;
    c.send(b"downloads before-idle 2\n!ping\n").await;
    assert_eq!(c.read_line().await, "pong\n");
    assert_eq!(
        c.read_line().await,
        "error idle for listen.idle_timeout_ms; closing\n"
    );
    assert_eq!(c.read_line().await, "", "closed after the error");
    // Committed by the next flush: wait for it through a connection of its own.
    let mut other = h.client().await;
    other.send(b"downloads before-idle 0\n").await;
    assert_eq!(other.flush().await, (1, 0));
    assert_eq!(h.total("downloads", "before-idle").await.0, 2);
    h.stop().await;
}

/// `log` without the terminal colours around its field names (`ESC[...m`).
fn without_colours(log: &str) -> String {
    let mut parts = log.split('\x1b');
    let mut plain = parts.next().unwrap_or_default().to_string();
    for part in parts {
        plain.push_str(part.split_once('m').map_or(part, |(_, rest)| rest));
    }
    plain
}

/// Sets the child's descriptor limit (soft and hard) before it runs: `prlimit` for one process.
fn limit_descriptors(cmd: &mut std::process::Command, limit: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only setrlimit, async-signal-safe, runs between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let rlimit = libc::rlimit {
                rlim_cur: limit as libc::rlim_t,
                rlim_max: limit as libc::rlim_t,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &rlimit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Connects, sends `!ping` and returns the first line the daemon answers (empty when the
/// connection ends first), or `None` when nothing comes within `patience`. Errors are answers
/// too: a refused connection may be closed before the `!ping` is written.
async fn ping_once(socket: &Path, patience: Duration) -> (tokio::net::UnixStream, Option<String>) {
    let mut s = tokio::net::UnixStream::connect(socket).await.unwrap();
    let _ = s.write_all(b"!ping\n").await;
    let mut line = Vec::new();
    let read = tokio::time::timeout(patience, async {
        let mut byte = [0u8; 1];
        while let Ok(1) = s.read(&mut byte).await {
            line.push(byte[0]);
            if byte[0] == b'\n' {
                break;
            }
        }
    })
    .await;
    let answer = read
        .ok()
        .map(|()| String::from_utf8_lossy(&line).into_owned());
    (s, answer)
}

/// With 256 file descriptors (soft and hard limit, set on the daemon before it starts) and more
/// idle clients than fit, stream connections keep to their share: the extra clients are refused
/// at once, with the reason in the log and `tallyd_connections_refused_total{reason}`. Then the
/// database's connections are terminated and more clients arrive, so the flushes must
/// reconnect while the admitted clients stay: events sent afterwards on a connection opened
/// before are committed exactly.
/// Before, the idle clients took every descriptor (accept failing with EMFILE, the clients
/// beyond it left unanswered in the backlog), and the flush could not reconnect ("Too many open
/// files") until clients left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_clients_leave_descriptors_for_the_database() {
    const LIMIT: u64 = 256;
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let url = pg.connection_string("postgres");
    let config = TestConfig::new(dir.path())
        .standard_counters()
        .fast()
        .database_url(&url)
        .metrics_port(free_port())
        .with(|c: &mut Config| c.flush.connections = 2)
        .write();
    let child = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || {
            Daemon::spawn_with(Path::new(common::BIN), &config, |cmd| {
                limit_descriptors(cmd, LIMIT)
            })
        })
        .await
        .unwrap()
    };
    let mut worker = LineClient::connect(child.socket()).await;
    worker.send(b"downloads fd 1\n").await;
    assert_eq!(worker.flush().await, (1, 0));

    let clients = 300;
    let answers = futures_util::future::join_all(
        (0..clients).map(|_| ping_once(child.socket(), Duration::from_secs(10))),
    )
    .await;
    let (mut admitted, mut refused, mut unanswered) = (Vec::new(), 0, 0);
    for (stream, answer) in answers {
        match answer.as_deref() {
            Some("pong\n") => admitted.push(stream),
            Some("error too many connections\n") => refused += 1,
            None => unanswered += 1,
            Some(other) => panic!("unexpected answer {other:?}"),
        }
    }

    // Every database session of tallyd ends: the flush workers (and the lease heartbeat) must
    // open new ones, with the admitted clients still connected.
    let sql = common::sql(&url).await;
    let killed = terminate(&sql, Sessions::All).await;
    assert!(killed >= 1, "tallyd had database sessions");
    // Clients keep arriving meanwhile: they must not take the descriptors the database
    // connections gave back.
    let late = futures_util::future::join_all(
        (0..50).map(|_| ping_once(child.socket(), Duration::from_secs(10))),
    )
    .await;
    let late_refused = late
        .iter()
        .filter(|(_, a)| a.as_deref() == Some("error too many connections\n"))
        .count();
    let lines = (0..1000).map(|i| format!("downloads fd{} 1", i % 100));
    worker.send(&buf_of(lines)).await;
    let flushed = tokio::time::timeout(Duration::from_secs(120), worker.flush()).await;
    let log = child.log();
    assert_eq!(
        flushed.unwrap_or_else(|_| panic!("the flush never reconnected:\n{log}")),
        (1000, 0)
    );
    let total = common::counter_total(&sql, "downloads").await;
    assert_eq!(total, 1001);

    assert_eq!(
        unanswered, 0,
        "every client is answered, admitted or refused"
    );
    assert!(
        !admitted.is_empty() && refused > 0,
        "{} admitted, {refused} refused",
        admitted.len()
    );
    assert_eq!(admitted.len() + refused, clients);
    assert_eq!(late_refused, late.len(), "the budget was still spent");
    let refused = refused + late_refused;
    let scrape = child.scrape();
    assert_eq!(
        scrape.get(r#"tallyd_connections_refused_total{reason="descriptors"}"#),
        Some(refused as f64)
    );
    assert_eq!(
        scrape.get(r#"tallyd_connections_refused_total{reason="max_connections"}"#),
        Some(0.0)
    );
    assert!(
        log.contains(
            "refusing connection: stream connections hold their whole file descriptor budget"
        ),
        "{log}"
    );
    let plain = without_colours(&log);
    let limits = plain
        .lines()
        .find(|l| l.contains("file descriptor limit (RLIMIT_NOFILE)"))
        .unwrap_or_else(|| panic!("the limits are logged:\n{log}"));
    assert!(
        limits.contains("soft=256") && limits.contains("hard=256"),
        "{limits}"
    );
    drop(admitted);
    assert!(child.terminate().success());
    common::stop_postgres(pg).await;
}
