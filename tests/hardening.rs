//! Hardening against local users and the environment, on the real binary and a real
//! PostgreSQL: slow HTTP clients cannot take the health and scrape endpoints away.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{free_port, spawn_daemon, temp_dir, Samples, TestConfig};

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
