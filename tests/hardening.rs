//! Hardening against local users and the environment, on the real binary and a real
//! PostgreSQL: slow HTTP clients cannot take the health and scrape endpoints away; data_dir is
//! private whatever the umask; text logs are coloured only on a terminal.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{free_port, send_synced, spawn_daemon, temp_dir, Daemon, Samples, TestConfig, BIN};

/// A daemon's config on the external PostgreSQL `url`, with its endpoints on `port`.
fn config(dir: &Path, url: &str, port: u16) -> PathBuf {
    TestConfig::new(dir)
        .standard_counters()
        .fast()
        .database_url(url)
        .metrics_port(port)
        .write()
}

/// Prometheus's default scrape timeout: an answer later than this is a failed scrape.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);

/// `GET path` as Prometheus or a health checker sends it, within [`SCRAPE_TIMEOUT`]: the status
/// code, or what went wrong.
fn get(addr: SocketAddr, path: &str) -> Result<u16, String> {
    let deadline = Instant::now() + SCRAPE_TIMEOUT;
    let mut s =
        TcpStream::connect_timeout(&addr, SCRAPE_TIMEOUT).map_err(|e| format!("connect: {e}"))?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_read_timeout(Some(left)).unwrap();
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .map_err(|e| format!("send: {e}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| format!("read: {e}"))?;
    let head = String::from_utf8_lossy(&raw[..raw.len().min(64)]).into_owned();
    head.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no HTTP answer: {head:?}"))
}

/// One slow client: connects, sends the start of a request head and nothing more, and
/// connects again as soon as tallyd closes the connection, until `stop`. Counts its connections.
fn slow_client(addr: SocketAddr, stop: Arc<AtomicBool>, connections: Arc<AtomicU64>) {
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
            continue;
        };
        connections.fetch_add(1, Ordering::Relaxed);
        if s.write_all(b"GET /metrics HTTP/1.1\r\nHost: slow\r\n")
            .is_err()
        {
            continue;
        }
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        // Held until tallyd closes it (EOF or reset).
        while !stop.load(Ordering::Relaxed) {
            match s.read(&mut [0u8; 64]) {
                Ok(0) => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                _ => break,
            }
        }
    }
}

/// 100 clients that each hold an HTTP connection with a partial request head and reconnect as
/// soon as they are closed (more than the 32 connections tallyd serves at once) for 20 s:
/// every `/healthz`, `/readyz` and `/metrics` request sent meanwhile is answered 200 within
/// Prometheus's scrape timeout, and the evictions are counted.
#[test]
fn health_and_scrapes_are_answered_while_slow_clients_hold_the_http_port() {
    let dir = temp_dir();
    let pg = common::start_postgres(dir.path());
    let url = pg.connection_string("postgres");
    let daemon = spawn_daemon(&config(dir.path(), &url, free_port()));
    let addr = daemon.metrics();
    let stop = Arc::new(AtomicBool::new(false));
    let connections = Arc::new(AtomicU64::new(0));
    let slow: Vec<_> = (0..100)
        .map(|_| {
            let (stop, connections) = (stop.clone(), connections.clone());
            std::thread::spawn(move || slow_client(addr, stop, connections))
        })
        .collect();
    // Until the slow clients hold every slot (tallyd's 32, then the kernel's queue).
    while connections.load(Ordering::Relaxed) < 100 {
        std::thread::sleep(Duration::from_millis(10));
    }
    let until = Instant::now() + Duration::from_secs(20);
    let mut answers = Vec::new();
    while Instant::now() < until {
        for path in ["/healthz", "/readyz", "/metrics"] {
            let sent = Instant::now();
            answers.push((path, get(addr, path), sent.elapsed()));
        }
    }
    stop.store(true, Ordering::Relaxed);
    for client in slow {
        client.join().unwrap();
    }
    let failed: Vec<_> = answers
        .iter()
        .filter(|(_, code, _)| *code != Ok(200))
        .collect();
    let slowest = answers.iter().map(|(_, _, took)| *took).max().unwrap();
    eprintln!(
        "{} requests, slowest {slowest:?}; {} slow connections",
        answers.len(),
        connections.load(Ordering::Relaxed)
    );
    assert!(
        failed.is_empty(),
        "{} of {} requests failed: {failed:?}",
        failed.len(),
        answers.len()
    );
    assert!(
        answers.len() >= 10,
        "only {} requests in 20 s",
        answers.len()
    );
    let samples = Samples::parse(&common::scrape(addr));
    let evicted = samples.value("tallyd_http_connections_evicted_total");
    assert!(evicted >= 100.0, "only {evicted} slow connections evicted");
    assert!(
        daemon
            .log()
            .contains("closed the connection waiting longest"),
        "{}",
        daemon.log()
    );
    assert!(daemon.terminate().success());
    pg.stop().unwrap();
}

/// `tallyd run` with the umask at 000, as a careless service manager or shell might leave it.
fn spawn_with_umask_000(config: &Path) -> Daemon {
    Daemon::spawn_with(Path::new(BIN), config, |cmd| {
        // SAFETY: umask(2) is async-signal-safe and cannot fail.
        unsafe {
            cmd.pre_exec(|| {
                libc::umask(0);
                Ok(())
            });
        }
    })
}

/// Every directory and file under `dir` (itself included) whose mode lets group or others in
/// further than allowed: no file may be read or written by them, no directory listed or
/// written; only data_dir and the private PostgreSQL's directory may be passed through, and
/// only when tallyd runs as root (the server runs as `postgres` then and must reach its files).
fn loose_modes(data_dir: &Path) -> Vec<String> {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let mut loose = Vec::new();
    let mut todo = vec![data_dir.to_path_buf()];
    let mut seen = 0;
    while let Some(path) = todo.pop() {
        let meta = std::fs::symlink_metadata(&path).unwrap();
        let mode = meta.permissions().mode() & 0o7777;
        let kind = meta.file_type();
        seen += 1;
        let allowed = if kind.is_dir() {
            let passable = path == data_dir || path == data_dir.join("postgres");
            if passable && root {
                0o711
            } else {
                0o700
            }
        } else if kind.is_socket() {
            // PostgreSQL's socket (0700): socket files keep their own mode.
            continue;
        } else {
            0o600
        };
        if mode & !allowed & 0o077 != 0 || (kind.is_dir() && mode & 0o077 != allowed & 0o077) {
            loose.push(format!(
                "{} {mode:04o} (uid {}), expected {allowed:04o}",
                path.display(),
                meta.uid()
            ));
        }
        if kind.is_dir() {
            for entry in std::fs::read_dir(&path).unwrap() {
                todo.push(entry.unwrap().path());
            }
        }
    }
    assert!(
        seen > 10,
        "only {seen} entries under {}",
        data_dir.display()
    );
    loose
}

/// Under umask 000, a new data_dir is 0700 (0711 as root) and everything tallyd and its
/// private PostgreSQL create in it is owner-only: the lock, pid, instance id and lease token,
/// the journal directory and its segments, the cluster's directory, log and socket directory.
/// Then an existing data_dir left open to everyone (an older tallyd under umask 000) is
/// closed at the next start, with a log line each for data_dir and the journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_dir_is_private_whatever_the_umask() {
    let dir = temp_dir();
    let config = TestConfig::new(dir.path())
        .standard_counters()
        .fast()
        .write();
    let data_dir = dir.path().join("data");
    let daemon = spawn_with_umask_000(&config);
    // One event `!sync`ed: the journal has a segment on disk.
    send_synced(daemon.socket(), ["downloads first 3".to_string()]).await;
    let loose = loose_modes(&data_dir);
    assert!(
        loose.is_empty(),
        "open to other users under umask 000:\n{}",
        loose.join("\n")
    );
    assert!(daemon.terminate().success());

    let open = |path: &Path, mode: u32| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap()
    };
    open(&data_dir, 0o777);
    open(&data_dir.join("instance_id"), 0o666);
    open(&data_dir.join("journal"), 0o777);
    open(&data_dir.join("postgres"), 0o777);
    let daemon = spawn_with_umask_000(&config);
    send_synced(daemon.socket(), ["downloads second 3".to_string()]).await;
    let loose = loose_modes(&data_dir);
    assert!(
        loose.is_empty(),
        "still open to other users after a restart:\n{}",
        loose.join("\n")
    );
    let log = daemon.log();
    assert!(log.contains("data_dir was open to other users"), "{log}");
    assert!(
        log.contains("journal directory was open to other users"),
        "{log}"
    );
    assert!(daemon.terminate().success());
}

/// `tallyd run` with `config` (text logs, the default), its stderr to `stderr` and `env` set,
/// until `log()` shows it ready; then SIGTERM and its exit. Returns what `log()` holds then.
fn run_logging_to(
    config: &Path,
    stderr: std::process::Stdio,
    env: &[(&str, &str)],
    log: impl Fn() -> Vec<u8>,
) -> Vec<u8> {
    let mut child = std::process::Command::new(BIN)
        .arg("--config")
        .arg(config)
        .arg("run")
        .env_remove("NO_COLOR")
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    // The daemon's `ready` line (not the private PostgreSQL's): the one ending in it.
    let ready = |log: &[u8]| {
        (String::from_utf8_lossy(log).lines()).any(|line| line.trim_end().ends_with(" ready"))
    };
    while !ready(&log()) {
        let exited = child.try_wait().unwrap();
        assert!(
            exited.is_none() && Instant::now() < deadline,
            "tallyd did not get ready ({exited:?}): {}",
            String::from_utf8_lossy(&log())
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    log()
}

/// A pseudo-terminal: the end a child writes to (as its stderr), and what arrived at the other
/// end so far, read by a thread until the last writer closes it.
fn terminal() -> (std::fs::File, Arc<std::sync::Mutex<Vec<u8>>>) {
    use std::os::fd::FromRawFd;
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty writes two descriptors into our variables; the other arguments may be null.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors are new and owned by nothing else.
    let (mut master, slave) = unsafe {
        (
            std::fs::File::from_raw_fd(master),
            std::fs::File::from_raw_fd(slave),
        )
    };
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let into = seen.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        // EIO once every copy of the slave end is closed.
        while let Ok(n @ 1..) = master.read(&mut buf) {
            into.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    (slave, seen)
}

/// `log.format = "text"` colours its lines only on a terminal: stderr to a file (as under a
/// service manager or `2>file`) has no escape byte; on a terminal the lines are coloured,
/// unless `NO_COLOR` is set (https://no-color.org).
#[test]
fn text_logs_are_coloured_only_on_a_terminal_without_no_color() {
    let dir = temp_dir();
    let config = TestConfig::new(dir.path())
        .standard_counters()
        .fast()
        .write();
    let log_path = dir.path().join("stderr.log");
    let file = std::fs::File::create(&log_path).unwrap();
    let log = run_logging_to(&config, file.into(), &[], || {
        std::fs::read(&log_path).unwrap()
    });
    assert!(
        !log.contains(&0x1b),
        "escape codes in a log file:\n{}",
        String::from_utf8_lossy(&log)
    );

    let (slave, seen) = terminal();
    let log = run_logging_to(&config, slave.into(), &[], || seen.lock().unwrap().clone());
    assert!(
        log.contains(&0x1b),
        "no colour on a terminal:\n{}",
        String::from_utf8_lossy(&log)
    );

    let (slave, seen) = terminal();
    let log = run_logging_to(&config, slave.into(), &[("NO_COLOR", "1")], || {
        seen.lock().unwrap().clone()
    });
    assert!(
        !log.contains(&0x1b),
        "colour on a terminal despite NO_COLOR:\n{}",
        String::from_utf8_lossy(&log)
    );
}
