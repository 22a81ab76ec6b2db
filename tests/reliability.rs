//! Fault injection against real processes and a real PostgreSQL: killed database backends, a
//! database restart, kill -9 of tallyd, memory pressure with the database down, hostile input.
//! Every test asserts exact totals against what it sent.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    buf_of, counter_total, db, free_port, scalar_pair, spawn_daemon, sql, temp_dir, Daemon,
    Harness, LineClient, Samples, TestConfig,
};
use rand::{Rng, RngCore};
use tallyd::config::{Config, FsyncMode, KeyTypeName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Clients that send rounds of lines and count only what `!flush` confirmed.
fn confirmed_senders(
    h: &Harness,
    clients: usize,
    run_for: Duration,
) -> Vec<tokio::task::JoinHandle<(usize, i64)>> {
    (0..clients)
        .map(|i| {
            let socket = h.socket().to_path_buf();
            tokio::spawn(async move {
                let mut c = LineClient::connect(&socket).await;
                let lines = buf_of((0..100).map(|k| format!("downloads c{i}k{k} 2")));
                let started = Instant::now();
                let mut confirmed = 0i64;
                while started.elapsed() < run_for {
                    c.send(&lines).await;
                    assert_eq!(c.flush().await, (100, 0));
                    confirmed += 200;
                }
                (i, confirmed)
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_terminating_tallyd_backends_under_load() {
    let h = Harness::start(|c| {
        c.flush.set_interval(Duration::from_millis(20));
        c.flush.connections = 2;
    })
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let killer = {
        let client = h.sql().await;
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut kills = 0i64;
            while !stop.load(Ordering::Relaxed) {
                let n: i64 = client
                    .query_one(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                         WHERE application_name LIKE 'tallyd-%' AND pid <> pg_backend_pid() \
                           AND backend_type = 'client backend'",
                        &[],
                    )
                    .await
                    .unwrap()
                    .get(0);
                kills += n;
                let pause = rand::thread_rng().gen_range(20..150);
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
            kills
        })
    };
    let senders = confirmed_senders(&h, 4, Duration::from_secs(10));
    let mut sent = 0;
    let mut per_client = Vec::new();
    for s in senders {
        let (i, confirmed) = s.await.unwrap();
        per_client.push((i, confirmed));
        sent += confirmed;
    }
    stop.store(true, Ordering::Relaxed);
    let kills = killer.await.unwrap();
    assert!(
        kills > 10,
        "the chaos must actually kill connections ({kills})"
    );
    assert_eq!(counter_total(&h.sql().await, "downloads").await, sent);
    let all = h.all("downloads").await;
    assert_eq!(all.len(), 400);
    for (i, confirmed) in per_client {
        for (key, n) in all.iter().filter(|(k, _)| k.starts_with(&format!("c{i}k"))) {
            assert_eq!(*n, confirmed / 100, "key {key}");
        }
    }
    println!("chaos: {sent} confirmed, {kills} backends terminated, totals exact");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_restart_under_load() {
    let mut h = Harness::start(|c| c.flush.set_interval(Duration::from_millis(20))).await;
    let senders = confirmed_senders(&h, 3, Duration::from_secs(6));
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Crash-stop PostgreSQL for a few seconds while clients keep sending.
    let pg = h.pg.take().unwrap();
    common::stop_postgres_immediate(pg).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let dir = h.dir.path().to_path_buf();
    h.pg = Some(common::postgres(&dir).await);
    let mut sent = 0;
    for s in senders {
        sent += s.await.unwrap().1;
    }
    assert!(sent > 0);
    assert_eq!(counter_total(&h.sql().await, "downloads").await, sent);
    h.stop().await;
}

/// `tallyd run` on the external database `conninfo`, instance `crash-test`, no rollup, one
/// counter (`downloads`), changed by `edit`; returns the config's path.
fn daemon_config(dir: &Path, conninfo: &str, edit: impl FnOnce(&mut Config)) -> PathBuf {
    TestConfig::new(dir)
        .counters(&[("downloads", KeyTypeName::Text)])
        .database_url(conninfo)
        .with(|c| {
            c.daemon.set_instance_id(Some("crash-test".into()));
            c.listen.set_datagram_socket(None);
            c.rollup.enabled = false;
        })
        .with(edit)
        .write()
}

async fn total_of(db: &tallyd::store::Db, counter: &str, key_prefix: &str) -> i64 {
    db.connect()
        .await
        .unwrap()
        .query_one(
            "SELECT coalesce(sum(count), 0)::bigint FROM tallyd.totals \
             WHERE counter = $1 AND key LIKE $2 || '%'",
            &[&counter, &key_prefix],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_after_sync_loses_and_doubles_nothing() {
    let dir = temp_dir();
    let pg = {
        let d = dir.path().to_path_buf();
        common::postgres(&d).await
    };
    let conninfo = pg.connection_string("postgres");
    let db = db(&conninfo);
    // Flushes every 30 ms: at the kill, some records are committed and some are not.
    let config = daemon_config(dir.path(), &conninfo, |c| {
        c.flush.set_interval(Duration::from_millis(30));
        c.journal.fsync = FsyncMode::Always;
    });
    let socket = dir.path().join("tallyd.sock");
    let daemon = spawn_daemon(&config);

    // Clients A: rounds of lines, each acknowledged by `!sync`, then they stop.
    let mut synced = Vec::new();
    for i in 0..3 {
        let socket = socket.clone();
        synced.push(tokio::spawn(async move {
            let mut c = LineClient::connect(&socket).await;
            let lines = buf_of((0..200).map(|k| format!("downloads a{i}-{k} 3")));
            for _ in 0..30 {
                c.send(&lines).await;
                c.send(b"!sync\n").await;
                assert_eq!(c.read_line().await, "ok\n");
            }
            30 * 200 * 3i64
        }));
    }
    // Client B: keeps sending without `!sync` until the kill.
    let unsynced = Arc::new(AtomicI64::new(0));
    let b = {
        let socket = socket.clone();
        let unsynced = unsynced.clone();
        tokio::spawn(async move {
            let mut c = LineClient::connect(&socket).await;
            let line = b"downloads b 1\n".repeat(500);
            loop {
                if c.wr.write_all(&line).await.is_err() {
                    break;
                }
                unsynced.fetch_add(500, Ordering::SeqCst);
            }
        })
    };
    let mut acked = 0;
    for s in synced {
        acked += s.await.unwrap();
    }
    daemon.kill();
    b.await.unwrap();
    let before_restart = total_of(&db, "downloads", "a").await;
    assert!(before_restart <= acked);

    let daemon = spawn_daemon(&config);
    let mut c = LineClient::connect(&socket).await;
    assert_eq!(c.flush().await, (0, 0));
    // Replay has committed before the daemon answers: every acknowledged event exactly once.
    assert_eq!(total_of(&db, "downloads", "a").await, acked);
    let rows = db
        .connect()
        .await
        .unwrap()
        .query(
            "SELECT key, count FROM tallyd.totals WHERE key LIKE 'a%' ORDER BY key",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 600);
    assert!(rows.iter().all(|r| r.get::<_, i64>(1) == 90));
    // Unacknowledged events: some may be lost with the process, none is counted twice.
    let b_total = total_of(&db, "downloads", "b").await;
    assert!(
        b_total <= unsynced.load(Ordering::SeqCst),
        "{b_total} > sent {}",
        unsynced.load(Ordering::SeqCst)
    );
    println!(
        "kill -9: {acked} acknowledged all present ({before_restart} committed before the kill), \
         {b_total} of {} unacknowledged kept",
        unsynced.load(Ordering::SeqCst)
    );
    assert!(daemon.terminate().success());
    let left = std::fs::read_dir(dir.path().join("data/journal")).map_or(0, |d| d.count());
    assert_eq!(left, 0, "a graceful stop leaves no journal behind");
    common::stop_postgres(pg).await;
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_stays_bounded_while_the_database_is_down() {
    const CAP: usize = 20_000;
    const KEYS: usize = 300_000;
    const RSS_BOUND_KIB: u64 = 96 * 1024;
    let dir = temp_dir();
    let pg_dir = dir.path().to_path_buf();
    let pg = common::postgres(&pg_dir).await;
    let conninfo = pg.connection_string("postgres");
    let config = daemon_config(dir.path(), &conninfo, |c| {
        c.coalesce.max_pending_keys = CAP;
        c.flush.max_pending_keys = 5000;
        c.flush.set_retry_max(Duration::from_millis(200));
    });
    let socket = dir.path().join("tallyd.sock");
    let daemon = spawn_daemon(&config);
    let pg_dir = dir.path().to_path_buf();
    common::stop_postgres_immediate(pg).await;

    let sender = {
        let socket = socket.clone();
        tokio::spawn(async move {
            let mut c = LineClient::connect(&socket).await;
            for chunk in 0..KEYS / 10_000 {
                let lines =
                    buf_of((0..10_000).map(|k| format!("downloads m{} 1", chunk * 10_000 + k)));
                c.send(&lines).await;
            }
            c.flush().await
        })
    };
    // With the database down, past the cap its events are spilled to the journal (not held in
    // memory), and its `!flush` waits for the database.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rss = rss_kib(daemon.pid());
    assert!(
        !sender.is_finished(),
        "`!flush` answered with the database down"
    );
    assert!(
        rss < RSS_BOUND_KIB,
        "RSS {rss} KiB over the bound {RSS_BOUND_KIB} KiB"
    );

    let pg = common::postgres(&pg_dir).await;
    assert_eq!(sender.await.unwrap(), (KEYS as u64, 0));
    let client = sql(&conninfo).await;
    assert_eq!(
        scalar_pair(
            &client,
            "SELECT count(*), sum(count)::bigint FROM tallyd.totals"
        )
        .await,
        (KEYS as i64, KEYS as i64)
    );
    println!("memory: RSS {rss} KiB with {CAP} keys pending and the database down");
    assert!(daemon.terminate().success());
    common::stop_postgres(pg).await;
}

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
async fn a_stop_with_the_database_down_keeps_events_for_the_next_start() {
    let dir = temp_dir();
    let pg_dir = dir.path().to_path_buf();
    let pg = common::postgres(&pg_dir).await;
    let conninfo = pg.connection_string("postgres");
    let config = daemon_config(dir.path(), &conninfo, |c| {
        c.flush.set_retry_max(Duration::from_millis(200));
        c.journal.fsync = FsyncMode::Always;
        // A short final-flush deadline.
        c.daemon.set_shutdown_timeout(Duration::from_millis(1000));
    });
    let socket = dir.path().join("tallyd.sock");
    let daemon = spawn_daemon(&config);
    let pg_dir = dir.path().to_path_buf();
    common::stop_postgres_immediate(pg).await;
    // Accepted and journaled while the database is down...
    let mut c = LineClient::connect(&socket).await;
    c.send(&buf_of((0..1000).map(|k| format!("downloads down{k} 3"))))
        .await;
    c.send(b"!sync\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    drop(c);
    // ...then a graceful stop that cannot flush: it gives up after shutdown_timeout_ms.
    assert!(daemon.terminate().success());
    let segments = std::fs::read_dir(dir.path().join("data/journal"))
        .unwrap()
        .count();
    assert!(segments > 0, "the unflushed events stay in the journal");

    let pg = common::postgres(&pg_dir).await;
    let daemon = spawn_daemon(&config);
    let replayed = scalar_pair(
        &sql(&conninfo).await,
        "SELECT count(*), sum(count)::bigint FROM tallyd.totals WHERE key LIKE 'down%'",
    )
    .await;
    assert_eq!(replayed, (1000, 3000));
    assert!(daemon.terminate().success());
    let left = std::fs::read_dir(dir.path().join("data/journal")).map_or(0, |d| d.count());
    assert_eq!(left, 0, "replayed segments are deleted");
    common::stop_postgres(pg).await;
}

/// One sample of an unlabelled metric, scraped from tallyd's metrics endpoint.
async fn scrape_metric(addr: std::net::SocketAddr, name: &'static str) -> f64 {
    tokio::task::spawn_blocking(move || Samples::parse(&common::scrape(addr)).value(name))
        .await
        .unwrap()
}

/// Reads one reply line, failing the test if none comes within `wait`: a liveness bound for
/// replies that must not depend on the database, not a speed check.
async fn reply_within(c: &mut LineClient, wait: Duration, what: &str) -> String {
    tokio::time::timeout(wait, c.read_line())
        .await
        .unwrap_or_else(|_| panic!("no answer to {what} within {wait:?}"))
}

/// `tallyd run` with `coalesce.max_pending_keys = cap` and its metrics endpoint, whose
/// PostgreSQL is stopped once the daemon is up.
struct CappedOutage {
    // Dropped first: the daemon stops before its directory is removed.
    daemon: Daemon,
    dir: tempfile::TempDir,
    conninfo: String,
    metrics: std::net::SocketAddr,
    socket: PathBuf,
}

impl CappedOutage {
    async fn start(cap: usize) -> CappedOutage {
        let dir = temp_dir();
        let pg = common::postgres(dir.path()).await;
        let conninfo = pg.connection_string("postgres");
        let port = free_port();
        let config = daemon_config(dir.path(), &conninfo, |c| {
            c.coalesce.max_pending_keys = cap;
            c.flush.max_pending_keys = cap / 2;
            c.flush.set_retry_max(Duration::from_millis(200));
            c.metrics.set_listen(Some(format!("127.0.0.1:{port}")));
        });
        let socket = dir.path().join("tallyd.sock");
        let daemon = spawn_daemon(&config);
        common::stop_postgres_immediate(pg).await;
        CappedOutage {
            dir,
            conninfo,
            metrics: ([127, 0, 0, 1], port).into(),
            socket,
            daemon,
        }
    }

    async fn pending_keys(&self) -> f64 {
        scrape_metric(self.metrics, "tallyd_pending_keys").await
    }

    /// A client that sends `lines`, then `!flush`; it returns the counts.
    fn sender(&self, lines: Vec<u8>) -> tokio::task::JoinHandle<(u64, u64)> {
        let socket = self.socket.clone();
        tokio::spawn(async move {
            let mut c = LineClient::connect(&socket).await;
            c.send(&lines).await;
            c.flush().await
        })
    }

    /// Starts PostgreSQL again, waits for `senders`, stops everything, and returns the keys and
    /// the total committed, and each sender's counts.
    async fn recover(
        self,
        senders: Vec<tokio::task::JoinHandle<(u64, u64)>>,
    ) -> (i64, i64, Vec<(u64, u64)>) {
        let pg = common::postgres(self.dir.path()).await;
        let mut counts = Vec::new();
        for s in senders {
            counts.push(s.await.unwrap());
        }
        let (keys, total) = scalar_pair(
            &sql(&self.conninfo).await,
            "SELECT count(*), sum(count)::bigint FROM tallyd.totals",
        )
        .await;
        assert!(self.daemon.terminate().success());
        common::stop_postgres(pg).await;
        (keys, total, counts)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_lines_are_answered_at_the_memory_cap_with_the_database_down() {
    const CAP: usize = 1_000;
    const KEYS: usize = 20_000;
    let t = CappedOutage::start(CAP).await;
    // A client fills memory up to the cap (the rest of its events spill to the journal); its
    // `!flush` waits for the database.
    let filler = t.sender(buf_of((0..KEYS).map(|k| format!("downloads cap{k}"))));
    while t.pending_keys().await < CAP as f64 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Another connects at the cap: its control lines are answered without waiting for room.
    let mut b = LineClient::connect(&t.socket).await;
    b.send(b"!ping\n!sync\n!flush\n").await;
    let wait = Duration::from_secs(30);
    assert_eq!(reply_within(&mut b, wait, "!ping").await, "pong\n");
    assert_eq!(reply_within(&mut b, wait, "!sync").await, "ok\n");
    assert_eq!(reply_within(&mut b, wait, "!flush").await, "ok 0 0\n");
    assert!(
        !filler.is_finished(),
        "the filler's `!flush` must still wait"
    );
    // After the event line it sends, its `!flush` waits for the database.
    let late = {
        let mut b = b;
        tokio::spawn(async move {
            b.send(b"downloads late 1\n").await;
            b.flush().await
        })
    };

    // The database returns: everything read is committed exactly once.
    let (keys, total, counts) = t.recover(vec![filler, late]).await;
    assert_eq!(counts, [(KEYS as u64, 0), (1, 0)]);
    assert_eq!((keys, total), (KEYS as i64 + 1, KEYS as i64 + 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_keys_stay_within_the_documented_bound() {
    const CAP: usize = 1_000;
    const KEYS: usize = 50_000;
    /// `listen.read_buffer_bytes`, the default.
    const READ_BUFFER: usize = 65_536;
    let t = CappedOutage::start(CAP).await;
    // Every line has the same length, so one read holds at most READ_BUFFER / LINE + 1 events.
    let line = |k: usize| format!("downloads k{k:06}");
    let line_bytes = line(0).len() + 1;
    let bound = (CAP - 1 + READ_BUFFER / line_bytes + 1) as f64;
    let sender = t.sender(buf_of((0..KEYS).map(line)));
    // Sampled until the count has stopped moving (nothing commits: it only grows); the bound
    // must hold at every sample.
    let mut samples = Vec::new();
    loop {
        let keys = t.pending_keys().await;
        assert!(
            keys <= bound,
            "{keys} keys pending, over the bound {bound} (samples {samples:?})"
        );
        samples.push(keys);
        let n = samples.len();
        if keys >= CAP as f64 && n >= 4 && samples[n - 4] == keys {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        !sender.is_finished(),
        "`!flush` answered with the database down"
    );

    let (keys, total, counts) = t.recover(vec![sender]).await;
    assert_eq!(counts, [(KEYS as u64, 0)]);
    assert_eq!((keys, total), (KEYS as i64, KEYS as i64));
    println!(
        "memory cap {CAP}: at most {} keys pending (bound {bound})",
        samples.iter().cloned().fold(0.0, f64::max)
    );
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
    let db = tallyd::store::Db::new(&url, Duration::from_secs(5)).unwrap();
    let killed: i64 = db
        .connect()
        .await
        .unwrap()
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
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
    let total = common::counter_total(&db.connect().await.unwrap(), "downloads").await;
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
