//! tallyd under a service manager, without systemd: the test plays systemd. It binds the
//! sockets itself and passes them to `tallyd run` as fds 3 and 4 with `LISTEN_FDS`,
//! `LISTEN_FDNAMES` and `LISTEN_PID` (socket activation), and it binds a `NOTIFY_SOCKET` and
//! reads what tallyd tells it (READY=1, STOPPING=1, WATCHDOG=1, STATUS=).

mod common;

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;

/// A liveness bound on waiting for a message from tallyd, not a speed check.
const PATIENCE: Duration = Duration::from_secs(120);

/// `sh` sets `LISTEN_PID` to its own pid, which `exec` gives to tallyd: what systemd does.
fn activation_wrapper(dir: &Path) -> PathBuf {
    let path = dir.join("activate.sh");
    let script = format!(
        "#!/bin/sh\nexport LISTEN_PID=$$\nexec {} \"$@\"\n",
        common::BIN
    );
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// Gives the child `fds` as 3, 4, ... (dup'd above 10 first, so that an fd already at 3 or 4
/// is not overwritten before it is moved).
fn pass_fds(cmd: &mut Command, fds: Vec<RawFd>, names: &str) {
    cmd.env("LISTEN_FDS", fds.len().to_string())
        .env("LISTEN_FDNAMES", names);
    // SAFETY: only async-signal-safe calls (fcntl, dup2) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let mut high = Vec::with_capacity(fds.len());
            for &fd in &fds {
                let h = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10);
                if h < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                high.push(h);
            }
            for (i, &h) in high.iter().enumerate() {
                // dup2 clears close-on-exec on the new descriptor.
                if libc::dup2(h, 3 + i as RawFd) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// `tallyd get COUNTER KEY`'s count.
fn count(config: &Path, counter: &str, key: &str) -> u64 {
    let out = tallyd(config, &["get", counter, key]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "tallyd get: {out:?}");
    let n = text
        .split_whitespace()
        .find_map(|f| f.strip_prefix("count="))
        .unwrap_or_else(|| panic!("no count in {text:?}"));
    n.parse().unwrap()
}

/// What the client threads did.
#[derive(Default)]
struct Tally {
    /// Lines written on connections whose end tallyd acknowledged (it closed after reading
    /// them all).
    lines: AtomicU64,
    datagrams: AtomicU64,
    connects: AtomicU64,
    failures: AtomicU64,
}

const LINES_PER_CONN: u64 = 20;

/// Connects, writes `LINES_PER_CONN` lines for `downloads k`, closes its side and reads until
/// tallyd closes: then tallyd has read every line. Until `stop`.
fn stream_client(path: PathBuf, tally: Arc<Tally>, stop: Arc<AtomicBool>) {
    let line = b"downloads k\n".repeat(LINES_PER_CONN as usize);
    while !stop.load(Ordering::Relaxed) {
        let mut s = match UnixStream::connect(&path) {
            Ok(s) => s,
            Err(err) => {
                eprintln!("connect failed: {err}");
                tally.failures.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        tally.connects.fetch_add(1, Ordering::Relaxed);
        let done = s
            .write_all(&line)
            .and_then(|_| s.shutdown(std::net::Shutdown::Write));
        let mut rest = Vec::new();
        match done.and_then(|_| s.read_to_end(&mut rest)) {
            Ok(_) => {
                tally.lines.fetch_add(LINES_PER_CONN, Ordering::Relaxed);
            }
            Err(err) => {
                eprintln!("stream connection failed: {err}");
                tally.failures.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Sends `views 7` datagrams (blocking while the socket's queue is full) until `stop`.
fn datagram_client(path: PathBuf, tally: Arc<Tally>, stop: Arc<AtomicBool>) {
    let socket = UnixDatagram::unbound().unwrap();
    while !stop.load(Ordering::Relaxed) {
        match socket.send_to(b"views 7\n", &path) {
            Ok(_) => {
                tally.datagrams.fetch_add(1, Ordering::Relaxed);
            }
            Err(err) => {
                eprintln!("datagram send failed: {err}");
                tally.failures.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The point of socket activation: the sockets are the service manager's, so events sent
/// before tallyd is up and while it restarts are queued by the kernel and taken by the next
/// process; no connect fails, no socket file disappears, every line is counted once.
#[test]
fn a_restart_on_passed_sockets_refuses_no_client_and_loses_nothing() {
    let dir = temp_dir();
    let pg = start_postgres(dir.path());
    let config = TestConfig::new(dir.path())
        .standard_counters()
        .fast()
        .database_url(&pg.connection_string("postgres"))
        .write();
    let (stream_path, dgram_path) = (
        dir.path().join("tallyd.sock"),
        dir.path().join("tallyd.dgram"),
    );
    // What systemd's tallyd.socket does.
    let listener = UnixListener::bind(&stream_path).unwrap();
    let datagram = UnixDatagram::bind(&dgram_path).unwrap();
    let fds = vec![listener.as_raw_fd(), datagram.as_raw_fd()];
    let wrapper = activation_wrapper(dir.path());
    let spawn = || {
        let fds = fds.clone();
        Daemon::spawn_with(&wrapper, &config, move |cmd| {
            pass_fds(cmd, fds, "stream:datagram")
        })
    };

    let (tally, stop) = (Arc::new(Tally::default()), Arc::new(AtomicBool::new(false)));
    let mut clients = Vec::new();
    for _ in 0..3 {
        let (p, t, s) = (stream_path.clone(), tally.clone(), stop.clone());
        clients.push(std::thread::spawn(move || stream_client(p, t, s)));
    }
    let (p, t, s) = (dgram_path.clone(), tally.clone(), stop.clone());
    clients.push(std::thread::spawn(move || datagram_client(p, t, s)));

    // Before tallyd runs: connections and datagrams wait in the kernel.
    wait_until_blocking("clients connected before tallyd started", || {
        tally.connects.load(Ordering::Relaxed) >= 3 && tally.datagrams.load(Ordering::Relaxed) >= 5
    });
    assert_eq!(tally.lines.load(Ordering::Relaxed), 0, "no tallyd ran yet");
    let first = spawn();
    let served = tally.lines.load(Ordering::Relaxed);
    wait_until_blocking("connections served by the first tallyd", || {
        tally.lines.load(Ordering::Relaxed) >= served + 10 * LINES_PER_CONN
    });

    // The restart: a graceful stop, then a new process on the same sockets.
    let status = first.terminate();
    assert!(status.success(), "first tallyd: {status}");
    assert!(
        std::fs::symlink_metadata(&stream_path).is_ok()
            && std::fs::symlink_metadata(&dgram_path).is_ok(),
        "tallyd removed a socket file it did not create"
    );
    // No tallyd runs: a new client connects and sends all the same.
    let mut gap = UnixStream::connect(&stream_path).expect("connect while no tallyd runs");
    gap.write_all(&b"downloads k\n".repeat(7)).unwrap();
    gap.shutdown(std::net::Shutdown::Write).unwrap();
    let connects = tally.connects.load(Ordering::Relaxed);
    let second = spawn();
    let mut rest = Vec::new();
    gap.read_to_end(&mut rest)
        .expect("the second tallyd read the gap connection");
    wait_until_blocking("connections served by the second tallyd", || {
        tally.connects.load(Ordering::Relaxed) >= connects + 10
    });
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    let status = second.terminate();
    assert!(status.success(), "second tallyd: {status}");

    assert_eq!(
        tally.failures.load(Ordering::Relaxed),
        0,
        "a client was refused"
    );
    let lines = tally.lines.load(Ordering::Relaxed) + 7;
    let datagrams = tally.datagrams.load(Ordering::Relaxed);
    eprintln!(
        "sent {lines} lines on {} connections and {datagrams} datagrams across a restart",
        tally.connects.load(Ordering::Relaxed) + 1
    );
    assert_eq!(count(&config, "downloads", "k"), lines);
    assert_eq!(count(&config, "views", "7"), datagrams);
    pg.stop().unwrap();
}

/// The messages tallyd sent to the notify socket, one datagram each, as their lines.
fn recv_notifications(socket: &UnixDatagram, until: &str, seen: &mut Vec<String>) {
    socket.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut buf = vec![0u8; 4096];
    loop {
        let n = socket
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("no {until:?} from tallyd ({e}); got {seen:?}"));
        let lines: Vec<String> = String::from_utf8_lossy(&buf[..n])
            .lines()
            .map(str::to_string)
            .collect();
        let done = lines.iter().any(|l| l == until);
        seen.extend(lines);
        if done {
            return;
        }
    }
}

/// `Type=notify`: READY=1 only once the journal is replayed (and committed) and the sockets
/// serve, watchdog pings after that, STOPPING=1 at SIGTERM. The private PostgreSQL tallyd
/// starts (built with systemd support on Debian) must not tell tallyd's service manager
/// anything: its READY=1 would come before the replay.
#[test]
fn notifies_ready_after_replay_then_watchdog_then_stopping() {
    let dir = temp_dir();
    // The private PostgreSQL tallyd runs itself; flushes only when asked.
    let config = TestConfig::new(dir.path())
        .standard_counters()
        .fast()
        .with(|c| c.flush.set_interval(Duration::from_secs(600)))
        .write();
    // A first run journals 50 events, then crashes before any flush.
    let first = spawn_daemon(&config);
    let mut s = UnixStream::connect(dir.path().join("tallyd.sock")).unwrap();
    s.write_all(&b"downloads r\n".repeat(50)).unwrap();
    s.write_all(b"!sync\n").unwrap();
    let mut reply = [0u8; 3];
    s.read_exact(&mut reply).unwrap();
    assert_eq!(&reply, b"ok\n");
    first.kill();

    let notify_path = dir.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    // Like systemd's /run/systemd/notify: any process may write to it, the private
    // PostgreSQL (the `postgres` OS user) too.
    std::fs::set_permissions(&notify_path, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut second = Daemon::spawn_with(Path::new(common::BIN), &config, |cmd| {
        cmd.env("NOTIFY_SOCKET", &notify_path)
            .env("WATCHDOG_USEC", "200000");
    });
    let mut seen = Vec::new();
    recv_notifications(&notify, "READY=1", &mut seen);
    let replaying = seen
        .iter()
        .position(|l| l == "STATUS=replaying the journal");
    assert_eq!(
        replaying,
        Some(0),
        "the replay's status comes first, before any READY=1: {seen:?}"
    );
    assert!(second.log().contains("journal replayed and committed"));
    assert_eq!(
        count(&config, "downloads", "r"),
        50,
        "the replay is committed"
    );

    recv_notifications(&notify, "WATCHDOG=1", &mut seen);
    second.signal(libc::SIGTERM);
    recv_notifications(&notify, "STOPPING=1", &mut seen);
    assert_eq!(
        seen.iter().filter(|l| *l == "READY=1").count(),
        1,
        "one READY=1, tallyd's: {seen:?}"
    );
    let ready = seen.iter().position(|l| l == "READY=1").unwrap();
    let first_ping = seen.iter().position(|l| l == "WATCHDOG=1").unwrap();
    assert!(
        ready < first_ping,
        "watchdog pings start once ready: {seen:?}"
    );
    assert!(second.wait_for_log("stopped"));
    let status = second.wait();
    assert!(status.success(), "tallyd: {status}");
}

/// The statsd sockets are taken from systemd too (`statsd`, `statsd-stream`, `statsd-udp`), and a socket unit
/// without `FileDescriptorName=` (its sockets named after the unit) is matched by type and
/// path; a configured socket systemd did not pass (the native datagram one here) is bound by
/// tallyd. Lines sent before tallyd starts are all counted; systemd's socket files stay.
#[test]
fn statsd_and_unnamed_sockets_are_taken_from_systemd() {
    use tallyd::config::KeyTypeName;
    use tallyd::config::{CounterStatsd, Sampled};
    let dir = temp_dir();
    let pg = start_postgres(dir.path());
    let (stream_path, statsd_path, statsd_stream_path) = (
        dir.path().join("tallyd.sock"),
        dir.path().join("statsd.sock"),
        dir.path().join("statsd.stream.sock"),
    );
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let udp_addr = udp.local_addr().unwrap();
    let config = TestConfig::new(dir.path())
        .counters(&[("views", KeyTypeName::Text)])
        .fast()
        .database_url(&pg.connection_string("postgres"))
        .with(|c| {
            c.statsd.set_socket(Some(statsd_path.clone()));
            c.statsd.set_stream_socket(Some(statsd_stream_path.clone()));
            c.statsd.set_udp(Some(udp_addr.to_string()));
            c.counters[0].statsd = Some(CounterStatsd {
                metric: "page.views".into(),
                key_tag: Some("page".into()),
                sampled: Sampled::Reject,
            });
        })
        .write();
    let listener = UnixListener::bind(&stream_path).unwrap();
    let statsd = UnixDatagram::bind(&statsd_path).unwrap();
    let statsd_stream = UnixListener::bind(&statsd_stream_path).unwrap();
    // Before tallyd runs: 5 lines on each statsd socket and 5 on the native stream socket.
    let sender = UnixDatagram::unbound().unwrap();
    let client = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    for _ in 0..5 {
        sender
            .send_to(b"page.views:1|c|#page:home", &statsd_path)
            .unwrap();
        client
            .send_to(b"page.views:2|c|#page:udp", udp_addr)
            .unwrap();
    }
    let mut early = UnixStream::connect(&stream_path).unwrap();
    early.write_all(&b"views native\n".repeat(5)).unwrap();
    early.shutdown(std::net::Shutdown::Write).unwrap();
    // DogStatsD's stream framing: each packet after its length (u32, little-endian).
    let packet = b"page.views:3|c|#page:stream";
    let framed = [&(packet.len() as u32).to_le_bytes()[..], packet].concat();
    let mut early_statsd = UnixStream::connect(&statsd_stream_path).unwrap();
    early_statsd.write_all(&framed.repeat(5)).unwrap();
    drop(early_statsd);

    let fds = vec![
        listener.as_raw_fd(),
        statsd.as_raw_fd(),
        statsd_stream.as_raw_fd(),
        udp.as_raw_fd(),
    ];
    let daemon = Daemon::spawn_with(&activation_wrapper(dir.path()), &config, move |cmd| {
        pass_fds(cmd, fds, "tallyd.socket:statsd:statsd-stream:statsd-udp")
    });
    let mut rest = Vec::new();
    early.read_to_end(&mut rest).unwrap();
    let status = daemon.terminate();
    assert!(status.success(), "tallyd: {status}");
    assert_eq!(count(&config, "views", "home"), 5);
    assert_eq!(count(&config, "views", "udp"), 10);
    assert_eq!(count(&config, "views", "native"), 5);
    assert_eq!(count(&config, "views", "stream"), 15);
    assert!(
        stream_path.exists() && statsd_path.exists() && statsd_stream_path.exists(),
        "systemd's socket files stay"
    );
    assert!(
        !dir.path().join("tallyd.dgram").exists(),
        "tallyd removed the datagram socket it bound itself"
    );
    pg.stop().unwrap();
}

/// A socket unit with its `FileDescriptorName=`s swapped: the stream socket named `datagram`
/// and the datagram one named `stream`. Served as the wrong kinds, neither would ever take a
/// client while tallyd reports ready; tallyd refuses to start and names the socket.
#[test]
fn a_passed_socket_of_the_wrong_type_for_its_name_refuses_the_start() {
    let dir = temp_dir();
    let pg = start_postgres(dir.path());
    let config = TestConfig::new(dir.path())
        .standard_counters()
        .fast()
        .database_url(&pg.connection_string("postgres"))
        .write();
    let (stream_path, dgram_path) = (
        dir.path().join("tallyd.sock"),
        dir.path().join("tallyd.dgram"),
    );
    let listener = UnixListener::bind(&stream_path).unwrap();
    let datagram = UnixDatagram::bind(&dgram_path).unwrap();
    let fds = vec![listener.as_raw_fd(), datagram.as_raw_fd()];
    let log = dir.path().join("swapped.log");
    let mut cmd = Command::new(activation_wrapper(dir.path()));
    cmd.arg("--config")
        .arg(&config)
        .arg("run")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    pass_fds(&mut cmd, fds, "datagram:stream");
    let mut child = cmd.spawn().unwrap();
    // Either it exits, or it gets as far as saying it is ready (the old behaviour).
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        let text = std::fs::read_to_string(&log).unwrap();
        if text.lines().any(|l| l.trim_end().ends_with(" ready")) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = std::fs::read_to_string(&log).unwrap();
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    pg.stop().unwrap();
    let status = status.unwrap_or_else(|| panic!("tallyd started on swapped sockets: {text}"));
    assert!(!status.success());
    assert!(
        text.contains("passed as \"stream\"") && text.contains("is a datagram socket"),
        "{text}"
    );
}
