//! statsd over Unix sockets with the real `datadog` Python client, 20,005 increments in a
//! loop. In its default mode the client does not block: a packet the socket has no room for
//! is dropped by the client (and, on a stream, the connection with it), never seen by tallyd.
//! How many that is depends on how long tallyd is late, which no test can fix on a shared
//! machine; what it can fix: every packet the kernel took is counted, exactly (counted plus
//! the client's own drops is 20,005), and a client that blocks loses nothing, over the stream
//! socket (`unixstream://`, length-prefixed packets) and the datagram socket alike.
//!
//! The room on a Unix datagram socket is `net.unix.max_dgram_qlen` datagrams (10 by default),
//! which tallyd warns about at start. The sysctl is the machine's (its network namespace's): a
//! test that raises it restores it, and the tests that depend on it take turns (`SYSCTL`). A
//! socket keeps the value it was created with, so it is raised only while tallyd binds. The
//! client is installed by scripts/ensure-clients; missing, the tests fail under CI (CI=true)
//! and skip elsewhere.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{in_ci, temp_dir, Harness, Samples, TestConfig};
use tallyd::config::{CounterConfig, CounterStatsd, KeyTypeName, Sampled};
use tokio::sync::Mutex;

/// Taken by every test that reads or changes `net.unix.max_dgram_qlen`.
static SYSCTL: Mutex<()> = Mutex::const_new(());

/// Taken by the tests that count `unterminated` rejections in this process's metrics (a
/// datadog client that drops a packet midway leaves one).
static UNTERMINATED: Mutex<()> = Mutex::const_new(());

const QLEN: &str = "/proc/sys/net/unix/max_dgram_qlen";

/// As many increments as the burst that lost 196 over `unix://` with the default sysctl.
const N: i64 = 20_005;

/// `n` increments of `page.views` tagged `page:<key>` in a loop, with the datadog client's
/// defaults (non-blocking sends, no buffering, telemetry on) or, with `block`, waiting sends
/// (`socket_timeout=None`); prints how many packets the client dropped. Counted at its one
/// send function: its own counter restarts with every telemetry flush.
const CLIENT: &str = "
import sys
from datadog import DogStatsd
url, n, key, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
c = DogStatsd(socket_path=url, **({'socket_timeout': None} if mode == 'block' else {}))
dropped = 0
send = c._xmit_packet
def counting(packet, is_telemetry, queue_mode=False):
    global dropped
    sent = send(packet, is_telemetry, queue_mode=queue_mode)
    if not sent and not is_telemetry:
        dropped += 1
    return sent
c._xmit_packet = counting
for _ in range(n):
    c.increment('page.views', tags=['page:' + key])
c.flush()
c.close_socket()
print(dropped)
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

/// How the client sends: with its defaults, or waiting when the socket is full.
#[derive(Clone, Copy, Debug)]
enum Mode {
    Default,
    Block,
}

/// Runs [`CLIENT`] to completion; returns how many packets it dropped.
async fn send(url: String, key: &str, mode: Mode) -> i64 {
    let key = key.to_string();
    let mode = match mode {
        Mode::Default => "default",
        Mode::Block => "block",
    };
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .args(["-c", CLIENT, &url, &N.to_string(), &key, mode])
            .output()
            .expect("run python3")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "client failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout.trim().parse().expect("the client prints its drops")
}

/// Sends the burst over `url` in both modes (keys `default` and `block`), stops the daemon and
/// checks: with the defaults, every packet the client did not drop is counted; blocking, all.
async fn both_modes(mut h: Harness, url: String, what: &str) {
    let dropped = send(url.clone(), "default", Mode::Default).await;
    assert_eq!(send(url, "block", Mode::Block).await, 0);
    // A graceful stop reads the sockets and connections to their end, then flushes everything.
    h.stop_daemon().await;
    let counted = h.total("page_views", "default").await.0;
    eprintln!("{what}, client defaults: {counted} of {N} counted, {dropped} dropped by the client");
    assert_eq!(
        counted + dropped,
        N,
        "{what}: counted + dropped by the client"
    );
    assert_eq!(
        h.total("page_views", "block").await.0,
        N,
        "{what}, blocking"
    );
    h.stop().await;
}

fn statsd_path(h: &Harness, stream: bool) -> &Path {
    let s = &h.config.statsd;
    if stream {
        s.stream_socket().unwrap()
    } else {
        s.socket().unwrap()
    }
}

/// The stream socket, whatever `max_dgram_qlen` is (the machine's, untouched).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datadog_over_unixstream_loses_nothing_the_kernel_took() {
    if !have_datadog() {
        return;
    }
    let _turn = UNTERMINATED.lock().await;
    let (h, _dir) = start().await;
    let url = format!("unixstream://{}", statsd_path(&h, true).display());
    both_modes(h, url, "unixstream://").await;
}

/// Unix datagrams with the sysctl at 512, as the package sets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datadog_over_unix_datagrams_at_512_loses_nothing_the_kernel_took() {
    if !have_datadog() {
        return;
    }
    let turn = SYSCTL.lock().await;
    let default = qlen();
    let Some(raised) = RaisedQlen::to(512) else {
        eprintln!("skipping: cannot set {QLEN} (needs root and a writable /proc/sys)");
        return;
    };
    let (h, _dir) = start().await;
    // The socket is bound: it keeps 512.
    drop(raised);
    drop(turn);
    let url = format!("unix://{}", statsd_path(&h, false).display());
    let what = format!("unix:// at max_dgram_qlen 512 (the machine's: {default})");
    both_modes(h, url, &what).await;
}

/// The real binary says at start, naming the sysctl and the fix, when a Unix datagram socket
/// is configured and the machine's `max_dgram_qlen` is below 512: a warning for the statsd
/// socket, whose clients drop what does not fit, a note for the native one only, whose clients
/// wait; without one it says nothing. (The threshold itself is unit-tested: `socket::datagram`.)
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
    let warning_ = warning.clone();
    let logged = tokio::task::spawn_blocking(move || {
        let mut daemon = common::spawn_daemon(&with_dgram.write_as("dgram.toml"));
        let found = daemon.wait_for_log(&warning_);
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
    let level = |log: &str| {
        let line = log
            .lines()
            .find(|l| l.contains(&warning))
            .unwrap_or_default();
        ["INFO", "WARN"].into_iter().find(|l| line.contains(l))
    };
    assert_eq!(
        level(&log),
        Some("INFO"),
        "native socket only: a note: {log}"
    );

    let with_statsd = TestConfig::new(dir.path()).counters(&[("views", KeyTypeName::Text)]);
    let with_statsd = with_statsd.with(|c| {
        c.listen.set_datagram_socket(None);
        c.statsd.set_socket(Some(dir.path().join("statsd.dgram")));
        c.counters.push(page_views());
    });
    let warning_ = warning.clone();
    let log = tokio::task::spawn_blocking(move || {
        let mut daemon = common::spawn_daemon(&with_statsd.write_as("statsd.toml"));
        assert!(daemon.wait_for_log(&warning_), "{}", daemon.log());
        let log = daemon.log();
        assert!(daemon.terminate().success());
        log
    })
    .await
    .unwrap();
    assert_eq!(
        level(&log),
        Some("WARN"),
        "statsd's socket: a warning: {log}"
    );
    assert!(log.contains("DogStatsD's unix://"), "{log}");
}

fn rejected(samples: &Samples, reason: &str) -> i64 {
    let series = format!("tallyd_lines_rejected_total{{reason=\"{reason}\"}}");
    samples.get(&series).unwrap_or(0.0) as i64
}

/// `packet` with its length before it, as DogStatsD frames it on a stream.
fn frame(packet: &str) -> Vec<u8> {
    let mut out = (packet.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(packet.as_bytes());
    out
}

/// The stream framing from a raw socket: packets split anywhere across writes are counted; a
/// packet announced longer than 64 KiB is rejected (too_long) and closes its connection, and
/// one cut short by the client's close is rejected (unterminated); a connection held open
/// through the stop has everything it sent counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_packets_are_framed_bounded_and_taken_at_the_stop() {
    let _turn = UNTERMINATED.lock().await;
    let before = common::process_metrics();
    let (mut h, _dir) = start().await;
    let path = statsd_path(&h, true).to_path_buf();
    let raw = tokio::task::spawn_blocking(move || {
        let connect = || UnixStream::connect(&path).unwrap();
        // Two lines in one packet, then a packet split across two writes.
        let mut s = connect();
        s.write_all(&frame(
            "page.views:2|c|#page:raw\npage.views:1|c|#page:raw\n",
        ))
        .unwrap();
        let split = frame("page.views:4|c|#page:raw");
        s.write_all(&split[..6]).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        s.write_all(&split[6..]).unwrap();
        // Too long: tallyd closes the connection; what follows is not read.
        s.write_all(&(65_537u32).to_le_bytes()).unwrap();
        let _ = s.write_all(&frame("page.views:100|c|#page:raw"));
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let closed = matches!(s.read(&mut [0; 16]), Ok(0) | Err(_));
        // Cut short by the client's close.
        let mut cut = connect();
        cut.write_all(&frame("page.views:1000|c|#page:raw")[..10])
            .unwrap();
        drop(cut);
        // Held open through the stop.
        let mut held = connect();
        held.write_all(&frame("page.views:8|c|#page:held")).unwrap();
        (closed, held)
    })
    .await
    .unwrap();
    let (closed, _held) = raw;
    assert!(closed, "a packet over 64 KiB closes its connection");
    h.stop_daemon().await;
    let after = common::process_metrics();
    assert_eq!(h.total("page_views", "raw").await.0, 7);
    assert_eq!(h.total("page_views", "held").await.0, 8);
    for (reason, n) in [("too_long", 1), ("unterminated", 1)] {
        let delta = rejected(&after, reason) - rejected(&before, reason);
        assert_eq!(delta, n, "{reason}");
    }
    h.stop().await;
}
