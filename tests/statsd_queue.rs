//! statsd over Unix sockets with the real `datadog` Python client in its default mode (it does
//! not block: a send that would block is dropped): a burst must lose nothing. Over a Unix
//! datagram socket that takes `net.unix.max_dgram_qlen` >= 512 (the kernel's default, 10,
//! drops), which tallyd warns about at start; over the stream socket (`unixstream://`,
//! length-prefixed packets) it takes nothing, whatever the sysctl.
//!
//! The sysctl is the machine's (its network namespace's): a test that raises it restores it,
//! and the tests that depend on it take turns (`SYSCTL`). A socket keeps the value it was
//! created with, so it is raised only while tallyd binds. The client is installed by
//! scripts/ensure-clients; missing, the tests fail under CI (CI=true) and skip elsewhere.

mod common;

use std::path::Path;
use std::process::Command;

use common::{temp_dir, Harness, TestConfig};
use tallyd::config::{CounterConfig, CounterStatsd, KeyTypeName, Sampled};
use tokio::sync::Mutex;

/// Taken by every test that reads or changes `net.unix.max_dgram_qlen`.
static SYSCTL: Mutex<()> = Mutex::const_new(());

const QLEN: &str = "/proc/sys/net/unix/max_dgram_qlen";

/// As many increments as the burst that lost 196 over `unix://` with the default sysctl.
const N: i64 = 20_005;

/// The datadog client's defaults (non-blocking sends, no buffering, telemetry on), `n`
/// increments of `page.views` tagged `page:<key>` in a loop; prints what the client dropped.
const CLIENT: &str = "
import sys
from datadog import DogStatsd
url, n, key = sys.argv[1], int(sys.argv[2]), sys.argv[3]
c = DogStatsd(socket_path=url)
for _ in range(n):
    c.increment('page.views', tags=['page:' + key])
c.flush()
print('client dropped', c.packets_dropped_writer, 'packets')
c.close_socket()
";

fn qlen() -> u32 {
    let text = std::fs::read_to_string(QLEN).expect("read max_dgram_qlen");
    text.trim().parse().expect("max_dgram_qlen is a number")
}

/// Sets the sysctl until dropped, then puts back what it was. `None` when it cannot be set
/// (not root, or a read-only /proc/sys).
struct RaisedQlen(u32);

impl RaisedQlen {
    fn to(value: u32) -> Option<RaisedQlen> {
        let was = qlen();
        std::fs::write(QLEN, value.to_string()).ok()?;
        Some(RaisedQlen(was))
    }
}

impl Drop for RaisedQlen {
    fn drop(&mut self) {
        std::fs::write(QLEN, self.0.to_string()).expect("restore max_dgram_qlen");
    }
}

fn page_views() -> CounterConfig {
    let mut c = common::counter("page_views", KeyTypeName::Text);
    c.statsd = Some(CounterStatsd {
        metric: "page.views".into(),
        key_tag: Some("page".into()),
        sampled: Sampled::Reject,
    });
    c
}

/// A daemon with the statsd Unix datagram and stream sockets (in the returned directory).
async fn start() -> (Harness, tempfile::TempDir) {
    let dir = temp_dir();
    let (dgram, stream) = (dir.path().join("s.dgram"), dir.path().join("s.sock"));
    let h = Harness::start(move |c| {
        c.statsd.set_socket(Some(dgram));
        c.statsd.set_stream_socket(Some(stream));
        c.counters.push(page_views());
    })
    .await;
    (h, dir)
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// `false` (after saying why) when the datadog package is missing outside CI; panics in CI.
fn have_datadog() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import datadog"])
        .output()
        .is_ok_and(|o| o.status.success());
    let why = "Python package datadog is not installed: run scripts/ensure-clients";
    assert!(ok || !in_ci(), "{why}");
    if !ok {
        eprintln!("skipping: {why}");
    }
    ok
}

/// Runs [`CLIENT`] to completion; returns what it printed.
async fn send(url: String, key: &str) -> String {
    let key = key.to_string();
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .args(["-c", CLIENT, &url, &N.to_string(), &key])
            .output()
            .expect("run python3")
    })
    .await
    .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "client failed: {said}");
    said
}

fn statsd_path(h: &Harness, stream: bool) -> &Path {
    let s = &h.config.statsd;
    if stream {
        s.stream_socket().unwrap()
    } else {
        s.socket().unwrap()
    }
}

/// The stream socket: the kernel holds the client back instead of dropping, so every increment
/// of the burst counts, whatever `max_dgram_qlen` is (the machine's, untouched).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datadog_over_unixstream_counts_every_increment() {
    if !have_datadog() {
        return;
    }
    let (mut h, _dir) = start().await;
    let url = format!("unixstream://{}", statsd_path(&h, true).display());
    let said = send(url, "stream").await;
    // A graceful stop reads the connection to its end, then flushes everything.
    h.stop_daemon().await;
    assert_eq!(h.total("page_views", "stream").await.0, N, "{said}");
    h.stop().await;
}

/// Unix datagrams with the sysctl at 512 (as the package sets it): the burst loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datadog_over_unix_datagrams_loses_nothing_at_512() {
    if !have_datadog() {
        return;
    }
    let turn = SYSCTL.lock().await;
    let default = qlen();
    let Some(raised) = RaisedQlen::to(512) else {
        eprintln!("skipping: cannot set {QLEN} (needs root and a writable /proc/sys)");
        return;
    };
    let (mut h, _dir) = start().await;
    // The socket is bound: it keeps 512.
    drop(raised);
    drop(turn);
    let url = format!("unix://{}", statsd_path(&h, false).display());
    let said = send(url, "dgram").await;
    h.stop_daemon().await;
    let counted = h.total("page_views", "dgram").await.0;
    assert_eq!(
        counted, N,
        "max_dgram_qlen 512 (machine's: {default}); {said}"
    );
    h.stop().await;
}

/// The real binary warns at start, naming the sysctl and the fix, when a Unix datagram socket
/// is configured and the machine's `max_dgram_qlen` is below 512; without one it says nothing.
/// (The threshold itself is unit-tested: `socket::datagram`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_warns_of_a_short_datagram_queue() {
    let _turn = SYSCTL.lock().await;
    let value = qlen();
    if value >= 512 {
        eprintln!("skipping: max_dgram_qlen is {value} here; no warning is due");
        return;
    }
    let dir = temp_dir();
    let warning = format!("net.unix.max_dgram_qlen is {value}:");
    let streams_only = TestConfig::new(dir.path()).counters(&[("views", KeyTypeName::Text)]);
    let streams_only = streams_only.with(|c| {
        c.listen.set_datagram_socket(None);
        c.statsd
            .set_stream_socket(Some(dir.path().join("statsd.sock")));
        c.counters.push(page_views());
    });
    let quiet = tokio::task::spawn_blocking(move || {
        let daemon = common::spawn_daemon(&streams_only.write());
        let log = daemon.log_path().to_path_buf();
        assert!(daemon.terminate().success());
        std::fs::read_to_string(log).unwrap()
    })
    .await
    .unwrap();
    assert!(!quiet.contains(&warning), "{quiet}");

    let with_dgram = TestConfig::new(dir.path()).counters(&[("views", KeyTypeName::Text)]);
    let logged = tokio::task::spawn_blocking(move || {
        let mut daemon = common::spawn_daemon(&with_dgram.write_as("dgram.toml"));
        let found = daemon.wait_for_log(&warning);
        let log = daemon.log();
        assert!(daemon.terminate().success());
        (found, log)
    })
    .await
    .unwrap();
    let (found, log) = logged;
    assert!(found, "no warning about max_dgram_qlen {value}: {log}");
    for fix in [
        "sysctl -w net.unix.max_dgram_qlen=512",
        "/etc/sysctl.d/",
        "statsd.stream_socket",
    ] {
        assert!(log.contains(fix), "the warning names {fix:?}: {log}");
    }
}
