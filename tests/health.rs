//! The HTTP endpoints and the status view against the real binary and a real PostgreSQL:
//! /healthz, /readyz before, during and after a journal replay and while a database is down,
//! /status polled while clients stream events (exact totals, consistent figures), and
//! `tallyd status` with and without a running daemon.

mod common;

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{
    buf_of, free_port, http_get, key_total, postgres, spawn_daemon, sql, tallyd, temp_dir,
    LineClient, TestConfig,
};
use serde_json::Value;
use tallyd::config::Config;
use tallyd::status::Status;

/// `tallyd run` on `url` with its endpoints on `port`, a fixed instance id (so that a restart
/// replays the journal of the run before), a 200 ms `lock_timeout` and quick retries.
fn config(dir: &Path, url: &str, port: u16, edit: impl FnOnce(&mut Config)) -> PathBuf {
    TestConfig::new(dir)
        .standard_counters()
        .fast()
        .database_url(url)
        .metrics_port(port)
        .with(|c| {
            c.daemon.set_instance_id(Some("health-test".into()));
            c.flush.set_lock_timeout(Some(Duration::from_millis(200)));
            c.flush.set_retry_max(Duration::from_millis(200));
        })
        .with(edit)
        .write()
}

/// Waits (up to a generous deadline: a liveness bound, not a timing assertion) until `done`
/// returns Some.
fn wait_for<T>(what: &str, mut done: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(v) = done() {
            return v;
        }
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `GET path` as (status, JSON body).
fn get_json(addr: SocketAddr, path: &str) -> (u16, Value) {
    let (code, body) = http_get(addr, path);
    let json = serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: {e}: {body}"));
    (code, json)
}

fn status(addr: SocketAddr) -> Status {
    let (code, body) = http_get(addr, "/status");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("/status is not a Status: {e}: {body}"))
}

/// The reasons of a not-ready /readyz, or None while it is ready.
fn not_ready(addr: SocketAddr) -> Option<Vec<String>> {
    let (code, body) = get_json(addr, "/readyz");
    match code {
        200 => {
            assert_eq!(body, serde_json::json!({"ready": true, "reasons": []}));
            None
        }
        503 => {
            assert_eq!(body["ready"], false);
            let reasons: Vec<String> = serde_json::from_value(body["reasons"].clone()).unwrap();
            assert!(!reasons.is_empty(), "503 says why: {body}");
            Some(reasons)
        }
        other => panic!("/readyz answered {other}: {body}"),
    }
}

/// Clients stream events while the test polls /status every few ms; every answer is a
/// well-formed status with consistent figures; the hottest key and the pending totals are
/// exact once the streams are in; after `!flush` nothing is pending and there is no lag; the
/// totals are exact. Then `tallyd status` as a table and as JSON, and its error once the
/// daemon is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_under_load_is_consistent_and_exact() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let url = pg.connection_string("postgres");
    let port = free_port();
    // No timed flush during the test: what the clients send stays pending until `!flush`.
    let path = config(dir.path(), &url, port, |c| {
        c.flush.set_interval(Duration::from_secs(3600))
    });
    let daemon = spawn_daemon(&path);
    let addr = daemon.metrics();

    assert_eq!(
        get_json(addr, "/healthz"),
        (200, serde_json::json!({"status": "alive"}))
    );
    assert_eq!(not_ready(addr), None);
    assert_eq!(get_json(addr, "/nothing-here").0, 404);
    let (code, metrics) = http_get(addr, "/metrics");
    assert_eq!(code, 200);
    assert!(metrics.contains("tallyd_events_accepted_total{counter=\"downloads\"} 0"));

    // 4 clients x 500 rounds, a ms apart: each round 10 events on `hot` and one on each of 20
    // cold keys.
    let (clients, rounds) = (4usize, 500usize);
    let polling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let poller = {
        let polling = polling.clone();
        std::thread::spawn(move || {
            let mut polls = 0u64;
            while polling.load(std::sync::atomic::Ordering::SeqCst) {
                let s = status(addr);
                check_consistent(&s);
                polls += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            polls
        })
    };
    let mut senders = Vec::new();
    for c in 0..clients {
        let socket = daemon.socket().to_path_buf();
        senders.push(tokio::spawn(async move {
            let mut client = LineClient::connect(&socket).await;
            for _ in 0..rounds {
                let hot = (0..10).map(|_| "downloads hot 2".to_string());
                let cold = (0..20).map(|k| format!("downloads cold-{c}-{k} 1"));
                client.send(&buf_of(hot.chain(cold))).await;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            client
        }));
    }
    let mut streams = Vec::new();
    for s in senders {
        streams.push(s.await.unwrap());
    }
    let events = (clients * rounds * 30) as u64;
    let hot_events = (clients * rounds * 10) as u64;
    // Everything sent is pending (no flush has run): wait until the buckets have recorded it
    // all, then look again (a status read while the last events arrived may show fewer).
    wait_for("every event sent pending", || {
        (status(addr).counters[0].pending_events == events).then_some(())
    });
    let s = status(addr);
    polling.store(false, std::sync::atomic::Ordering::SeqCst);
    let polls = poller.join().unwrap();
    let downloads = &s.counters[0];
    assert_eq!(downloads.name, "downloads");
    assert_eq!(downloads.pending_keys, 1 + (clients * 20) as u64);
    assert_eq!(downloads.hottest.len(), 10, "top 10 of 81 keys");
    assert_eq!(
        (
            downloads.hottest[0].key.as_str(),
            downloads.hottest[0].events
        ),
        ("hot", hot_events)
    );
    assert_eq!(downloads.hottest[0].sum, 2 * hot_events as i64);
    assert!(s.hottest_complete);
    let memory = s.memory.as_ref().unwrap();
    assert_eq!(memory.pending_keys, downloads.pending_keys);
    assert_eq!(memory.pending_events, events);
    assert_eq!(s.connections_open, clients as u64);
    assert!(s.databases[0].flush_lag_seconds.is_some(), "events wait");
    // Every event is journaled before a bucket has it; the writer publishes after its group.
    let journal = wait_for("the journal's figures", || {
        status(addr).journal.filter(|j| j.bytes > 0)
    });
    assert!(journal.segments >= 1 && journal.oldest_segment_age_seconds.is_some());

    let mut flushed = 0;
    for mut client in streams {
        flushed += client.flush().await.0;
    }
    assert_eq!(flushed, events);
    let s = status(addr);
    check_consistent(&s);
    assert!(s
        .counters
        .iter()
        .all(|c| c.pending_keys == 0 && c.pending_events == 0));
    assert!(s.counters.iter().all(|c| c.hottest.is_empty()));
    let db = &s.databases[0];
    assert_eq!(db.flush_lag_seconds, None, "nothing pending: no lag");
    assert_eq!(db.up, Some(true));
    assert!(db.last_flush_unix_ms.is_some());
    assert_eq!(
        key_total(&sql(&url).await, "downloads", "hot").await,
        2 * hot_events as i64
    );
    println!("{polls} polls of /status while {events} events streamed in");

    // The CLI, against the running daemon.
    let out = tallyd(&path, &["status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    for part in [
        "ready",
        "COUNTER",
        "downloads",
        "DATABASE",
        "up",
        "journal:",
    ] {
        assert!(text.contains(part), "{part:?} in:\n{text}");
    }
    let out = tallyd(&path, &["status", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let json: Status = serde_json::from_slice(&out.stdout).expect("--json prints the JSON");
    assert_eq!(json.counters.len(), 4);

    assert!(daemon.terminate().success());
    let out = tallyd(&path, &["status"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!(
            "cannot connect to tallyd at http://127.0.0.1:{port}"
        )) && err.contains("is tallyd running?"),
        "{err}"
    );
    common::stop_postgres(pg).await;
}

/// What holds in every status answer, however it interleaves with ingest and flushes.
fn check_consistent(s: &Status) {
    assert_eq!(s.phase, "serving");
    assert_eq!(s.counters.len(), 4);
    assert_eq!(s.databases.len(), 1);
    let memory = s.memory.as_ref().expect("memory once serving");
    assert!(memory.max_pending_keys > 0 && memory.used >= 0.0);
    for c in &s.counters {
        // An underflow would wrap to a huge number.
        assert!(
            c.pending_keys < 1 << 40 && c.pending_events < 1 << 40,
            "{c:?}"
        );
        assert!(c.hottest.len() <= 10);
        assert!(c.hottest.windows(2).all(|w| w[0].events >= w[1].events));
    }
    assert!(s.journal.as_ref().is_some_and(|j| j.writable));
}

/// A PostgreSQL, a daemon on it (see [`config`]) and a client that has committed `downloads k 1`.
struct Started {
    dir: tempfile::TempDir,
    pg: tallyd::store::embedded::Embedded,
    url: String,
    path: PathBuf,
    daemon: common::Daemon,
    addr: SocketAddr,
    client: LineClient,
}

impl Started {
    async fn with_k_committed() -> Started {
        let dir = temp_dir();
        let pg = postgres(dir.path()).await;
        let url = pg.connection_string("postgres");
        let path = config(dir.path(), &url, free_port(), |_| {});
        let daemon = spawn_daemon(&path);
        let addr = daemon.metrics();
        let mut client = LineClient::connect(daemon.socket()).await;
        client.send(b"downloads k 1\n").await;
        assert_eq!(client.flush().await, (1, 0));
        Started {
            dir,
            pg,
            url,
            path,
            daemon,
            addr,
            client,
        }
    }
}

/// A journal to replay and a flush that cannot commit (a row lock holds it): /readyz is 503,
/// saying "replaying journal" and naming the database, while /healthz is 200; once the lock is
/// gone the replay commits, /readyz is 200, and the total is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_while_the_journal_replays_and_200_after() {
    let Started {
        dir: _dir, // removed at the end of the test
        pg,
        url,
        path,
        daemon,
        addr,
        mut client,
    } = Started::with_k_committed().await;

    // Hold the slot row of `k`: flushes of `k` fail with lock_timeout from now on.
    let mut locker = sql(&url).await;
    let tx = locker.transaction().await.unwrap();
    tx.batch_execute(
        "SELECT 1 FROM tallyd.slots WHERE counter = 'downloads' AND key = 'k' FOR UPDATE",
    )
    .await
    .unwrap();
    client.send(b"downloads k 5\n!sync\n").await;
    assert_eq!(client.read_line().await, "ok\n", "journaled");
    drop(client);
    daemon.kill();

    // The restart replays `k 5`, whose flush waits for the lock: spawn_daemon returns only
    // once the daemon serves, so it runs on its own thread while the test watches /readyz.
    let restart = {
        let path = path.clone();
        std::thread::spawn(move || spawn_daemon(&path))
    };
    let reasons = wait_for("/readyz saying the replay waits for the database", || {
        if TcpStream::connect(addr).is_err() {
            return None; // not listening yet
        }
        let reasons = not_ready(addr).expect("not ready before the replay commits");
        let db_down = reasons
            .iter()
            .any(|r| r.starts_with("database 0 flushes failing: ") && r.contains("lock timeout"));
        (db_down && reasons.contains(&"replaying journal".to_string())).then_some(reasons)
    });
    println!("/readyz while replaying: {reasons:?}");
    assert_eq!(get_json(addr, "/healthz").0, 200, "alive while not ready");
    let s = wait_for("a retry of the replay's flush", || {
        Some(status(addr)).filter(|s| s.databases[0].retries > 0)
    });
    assert_eq!((s.phase.as_str(), s.ready), ("replaying", false));
    assert_eq!(s.databases[0].up, Some(false));
    assert!(s.databases[0].flush_lag_seconds.is_some());

    tx.rollback().await.unwrap();
    let daemon = restart.join().unwrap();
    wait_for("/readyz 200 after the replay", || {
        not_ready(addr).is_none().then_some(())
    });
    assert_eq!(
        key_total(&sql(&url).await, "downloads", "k").await,
        6,
        "1 before the kill + 5 replayed, once"
    );
    assert!(daemon.terminate().success());
    common::stop_postgres(pg).await;
}

/// The database stops mid-run: /readyz turns 503 naming it, first with nothing pending (the
/// lease heartbeat finds it), then with an event whose flush fails (and /status says down, with
/// the error and a lag); when it is back, /readyz is 200 again and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_names_a_database_that_goes_down_and_recovers() {
    let Started {
        dir,
        pg,
        url,
        path: _,
        daemon,
        addr,
        mut client,
    } = Started::with_k_committed().await;
    assert_eq!(not_ready(addr), None);

    common::stop_postgres_immediate(pg).await;
    // Nothing is pending: the lease heartbeat alone finds the database gone.
    let reasons = wait_for("/readyz naming the stopped database", || {
        let reasons = not_ready(addr)?;
        reasons
            .iter()
            .any(|r| r.starts_with("database 0 unreachable: "))
            .then_some(reasons)
    });
    println!("/readyz with the database down, idle: {reasons:?}");
    assert_eq!(status(addr).counters[0].pending_events, 0);
    // An event whose flush fails adds its own reason.
    client.send(b"downloads k 2\n").await;
    let reasons = wait_for("/readyz saying flushes fail", || {
        let reasons = not_ready(addr)?;
        reasons
            .iter()
            .any(|r| r.starts_with("database 0 flushes failing: "))
            .then_some(reasons)
    });
    println!("/readyz with the database down, an event pending: {reasons:?}");
    assert!(!reasons.contains(&"replaying journal".to_string()));
    let s = status(addr);
    let db = &s.databases[0];
    assert_eq!(db.up, Some(false));
    assert!(db.last_error.as_ref().is_some_and(|e| !e.is_empty()));
    assert!(db.flush_lag_seconds.is_some(), "k 2 waits");
    assert_eq!(s.counters[0].pending_events, 1);

    let pg = postgres(dir.path()).await;
    assert_eq!(client.flush().await, (1, 0));
    wait_for("/readyz 200 with the database back", || {
        not_ready(addr).is_none().then_some(())
    });
    assert_eq!(key_total(&sql(&url).await, "downloads", "k").await, 3);
    assert!(daemon.terminate().success());
    common::stop_postgres(pg).await;
}

/// Not a check (no timing assertion): how long /status takes with a million keys pending, and
/// how many events per second the clients get in while it is polled every 10 ms against none.
/// Run with `cargo test --release --test health status_cost -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn status_cost_with_a_million_pending_keys() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let url = pg.connection_string("postgres");
    let path = config(dir.path(), &url, free_port(), |c| {
        c.flush.set_interval(Duration::from_secs(3600));
        c.flush.max_pending_keys = 3_000_000;
        c.coalesce.max_pending_keys = 3_000_000;
    });
    let daemon = spawn_daemon(&path);
    let addr = daemon.metrics();
    let keys = 1_000_000usize;
    let send = |offset: usize, polled: bool| {
        let socket = daemon.socket().to_path_buf();
        async move {
            let polling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(polled));
            let poller = {
                let polling = polling.clone();
                std::thread::spawn(move || {
                    let mut n = 0;
                    while polling.load(std::sync::atomic::Ordering::SeqCst) {
                        status(addr);
                        n += 1;
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    n
                })
            };
            let started = Instant::now();
            let mut tasks = Vec::new();
            for c in 0..4 {
                let socket = socket.clone();
                tasks.push(tokio::spawn(async move {
                    let mut client = LineClient::connect(&socket).await;
                    for chunk in (0..keys / 4).collect::<Vec<_>>().chunks(1000) {
                        let lines = chunk
                            .iter()
                            .map(|k| format!("downloads k{}-{c}-{k} 1", offset));
                        client.send(&buf_of(lines)).await;
                    }
                    client.send(b"!ping\n").await;
                    client.read_line().await;
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
            let took = started.elapsed();
            polling.store(false, std::sync::atomic::Ordering::SeqCst);
            (took, poller.join().unwrap())
        }
    };
    let (quiet, _) = send(0, false).await;
    let (polled, polls) = send(1, true).await;
    wait_for("every key pending", || {
        (status(addr).counters[0].pending_keys == 2 * keys as u64).then_some(())
    });
    let mut times = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        let s = status(addr);
        times.push(t.elapsed());
        assert!(s.hottest_complete);
    }
    times.sort();
    println!(
        "{keys} events on new keys: {:.0} events/s without /status, {:.0} events/s while it \
         was polled {polls} times; /status with {} keys pending: median {:?}, max {:?}",
        keys as f64 / quiet.as_secs_f64(),
        keys as f64 / polled.as_secs_f64(),
        2 * keys,
        times[10],
        times[19]
    );
    drop(daemon);
    common::stop_postgres(pg).await;
}

/// Open descriptors of process `pid`.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// Many clients connect to the HTTP port and send nothing (a stuck scraper, a port scan):
/// tallyd's descriptors are shared with its event sockets, so the HTTP listener must not take
/// them all. The daemon runs with a 256-descriptor limit and 400 silent HTTP connections; a
/// native client then connects and its events are accepted and flushed exactly.
#[test]
fn silent_http_connections_do_not_starve_the_event_sockets() {
    use std::io::{BufRead, BufReader, Read, Write};
    let dir = temp_dir();
    let pg = common::start_postgres(dir.path());
    let url = pg.connection_string("postgres");
    let path = config(dir.path(), &url, free_port(), |_| {});
    let daemon = common::Daemon::spawn_with(Path::new(common::BIN), &path, |cmd| {
        use std::os::unix::process::CommandExt;
        // SAFETY: setrlimit is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                let limit = libc::rlimit {
                    rlim_cur: 256,
                    rlim_max: 256,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    });
    let addr = daemon.metrics();
    // 400 of them, or until tallyd holds descriptors up to its limit (then its backlog fills
    // and connects time out); a loaded machine may time a connect out before either.
    let mut silent: Vec<TcpStream> = Vec::new();
    while silent.len() < 400 && open_fds(daemon.pid()) < 256 {
        if let Ok(s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            s.set_nonblocking(true).unwrap();
            silent.push(s);
        }
    }
    // Until tallyd has dealt with them: either it holds descriptors up to its limit, or it has
    // closed (EOF) all but a bounded number of them.
    wait_for("tallyd to take the HTTP connections", || {
        let closed = silent
            .iter()
            .filter(|s| matches!((&**s).read(&mut [0u8; 1]), Ok(0)))
            .count();
        (open_fds(daemon.pid()) >= 256 || closed >= 300).then_some(())
    });
    let mut conn = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
    // A liveness bound: tallyd that cannot accept never answers.
    conn.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    conn.write_all(b"downloads silent 7\n!flush\n").unwrap();
    let mut answer = String::new();
    let read = BufReader::new(&conn).read_line(&mut answer);
    drop(silent);
    assert!(
        read.is_ok() && answer == "ok 1 0\n",
        "the event socket is starved: {read:?} {answer:?}; log: {}",
        daemon.log()
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let total = rt.block_on(async { key_total(&sql(&url).await, "downloads", "silent").await });
    assert_eq!(total, 7);
    assert!(daemon.terminate().success());
    pg.stop().unwrap();
}

/// Hostile HTTP: a POST with a body, a 1 MiB header, a request cut off mid-head; each is
/// answered or closed alone, and the endpoints and the event socket keep working.
#[test]
fn hostile_http_requests_are_answered_alone() {
    use std::io::{Read, Write};
    let dir = temp_dir();
    let pg = common::start_postgres(dir.path());
    let url = pg.connection_string("postgres");
    let path = config(dir.path(), &url, free_port(), |_| {});
    let daemon = spawn_daemon(&path);
    let addr = daemon.metrics();
    let raw = |request: &[u8]| {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let _ = s.write_all(request);
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        String::from_utf8_lossy(&answer).into_owned()
    };
    let post = raw(
        b"POST /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 5\r\n\r\nhello",
    );
    assert!(post.starts_with("HTTP/1.1 405"), "{post}");
    let mut huge = b"GET /status HTTP/1.1\r\nHost: x\r\nX-Big: ".to_vec();
    huge.extend(std::iter::repeat_n(b'a', 1 << 20));
    huge.extend_from_slice(b"\r\n\r\n");
    let big = raw(&huge);
    assert!(big.is_empty() || big.starts_with("HTTP/1.1 431"), "{big}");
    let mut cut = TcpStream::connect(addr).unwrap();
    cut.write_all(b"GET /status HTTP/1.1\r\nHo").unwrap();
    assert_eq!(get_json(addr, "/healthz").0, 200);
    let out = tallyd(&path, &["send", "downloads", "hostile", "2"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "accepted 1, rejected 0\n"
    );
    drop(cut);
    assert!(daemon.terminate().success());
    pg.stop().unwrap();
}

/// A burst of /status requests: tallyd gathers one view at a time, at most one per 100 ms, and
/// answers 503 to requests beyond the 4 that may wait, so that waiting status requests never
/// hold every HTTP connection; /healthz and /readyz answer meanwhile, and /status answers
/// again once the burst is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_status_requests_is_answered_or_told_to_retry() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let url = pg.connection_string("postgres");
    let path = config(dir.path(), &url, free_port(), |_| {});
    let daemon = spawn_daemon(&path);
    let addr = daemon.metrics();
    // One gather now: the burst's requests then wait for the next, 100 ms later.
    assert_eq!(http_get(addr, "/status").0, 200);
    let start = std::sync::Arc::new(std::sync::Barrier::new(20));
    let burst: Vec<_> = (0..20)
        .map(|_| {
            let start = start.clone();
            std::thread::spawn(move || {
                start.wait();
                http_get(addr, "/status")
            })
        })
        .collect();
    // While the burst waits, the health endpoints answer.
    assert_eq!(get_json(addr, "/healthz").0, 200);
    assert_eq!(get_json(addr, "/readyz").0, 200);
    let answers: Vec<(u16, String)> = burst.into_iter().map(|t| t.join().unwrap()).collect();
    let codes: Vec<u16> = answers.iter().map(|(code, _)| *code).collect();
    let ok = answers.iter().filter(|(code, _)| *code == 200).count();
    let busy: Vec<&String> = answers
        .iter()
        .filter(|(code, _)| *code == 503)
        .map(|(_, body)| body)
        .collect();
    assert_eq!(ok + busy.len(), 20, "{codes:?}");
    assert!(ok >= 1, "the waiting requests are answered: {codes:?}");
    assert!(!busy.is_empty(), "20 at once, 4 may wait: {codes:?}");
    assert!(
        busy.iter()
            .all(|b| b.contains("too many status requests at once")),
        "{busy:?}"
    );
    assert_eq!(http_get(addr, "/status").0, 200);
    assert!(daemon.terminate().success());
    common::stop_postgres(pg).await;
}
