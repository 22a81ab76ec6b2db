//! statsd and DogStatsD in: the real client libraries (Python `datadog` and `statsd`, Node
//! `hot-shots`, installed by scripts/ensure-clients) send a known workload to tallyd's statsd
//! sockets; totals in PostgreSQL are exact, and every rejected line is counted by its reason.
//!
//! A client that is not installed fails the test under CI (CI=true) and skips it elsewhere,
//! saying why. The metrics exporter is global to this test process, so the tests take turns
//! (`TURN`) and compare the metrics before and after each one.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{
    counter, free_port, in_ci, key_total, sql, temp_dir, total_and_keys, Harness, Samples,
};
use tallyd::config::{CounterConfig, KeyTypeName};
use tallyd::config::{CounterStatsd, Sampled};
use tallyd::protocol::Kind;
use tokio::sync::Mutex;

static TURN: Mutex<()> = Mutex::const_new(());

const N: i64 = 500;
const R: i64 = 20;

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn delta(before: &Samples, after: &Samples, key: &str) -> i64 {
    let get = |m: &Samples| m.get(key).unwrap_or(0.0);
    (get(after) - get(before)) as i64
}

fn rejected(reason: &str) -> String {
    format!("tallyd_lines_rejected_total{{reason=\"{reason}\"}}")
}

fn ignored(kind: &str) -> String {
    format!("tallyd_statsd_ignored_total{{kind=\"{kind}\"}}")
}

/// A counter that takes the statsd metric `metric` (its key from `key_tag`, or from the `*`).
fn mapped(
    name: &str,
    key_type: KeyTypeName,
    metric: &str,
    key_tag: Option<&str>,
    sampled: Sampled,
) -> CounterConfig {
    let mut c = counter(name, key_type);
    c.statsd = Some(CounterStatsd {
        metric: metric.into(),
        key_tag: key_tag.map(str::to_string),
        sampled,
    });
    c
}

/// The statsd mappings the tests send to: `page_views`, `logins` (bigint keys), `scaled`
/// (sampled lines scaled), `hits`, `gauges` (last: statsd gauges) and `sets` (unique: statsd
/// sets).
fn mapped_counters() -> Vec<CounterConfig> {
    use tallyd::protocol::KeyType::{Bigint, Text};
    vec![
        mapped(
            "page_views",
            Text,
            "page.views",
            Some("page"),
            Sampled::Reject,
        ),
        mapped("logins", Bigint, "logins.*", None, Sampled::Reject),
        mapped("scaled", Text, "scaled.hits", Some("k"), Sampled::Scale),
        mapped("hits", Text, "hits.*", None, Sampled::Reject),
        kind(
            mapped("gauges", Text, "gauge.*", None, Sampled::Reject),
            Kind::Last,
        ),
        kind(
            mapped("sets", Text, "set.*", None, Sampled::Reject),
            Kind::Unique,
        ),
    ]
}

fn kind(mut c: CounterConfig, kind: Kind) -> CounterConfig {
    c.kind = kind;
    c
}

/// A daemon with the statsd Unix socket and UDP on loopback.
struct Statsd {
    h: Harness,
    _dir: tempfile::TempDir,
    socket: PathBuf,
    port: u16,
}

async fn start() -> Statsd {
    common::process_metrics();
    let dir = temp_dir();
    let socket = dir.path().join("statsd.sock");
    let port = free_udp_port();
    let statsd_socket = socket.clone();
    let h = Harness::start(move |c| {
        c.statsd.set_socket(Some(statsd_socket));
        c.statsd.set_udp(Some(format!("127.0.0.1:{port}")));
        c.counters.extend(mapped_counters());
    })
    .await;
    Statsd {
        h,
        _dir: dir,
        socket,
        port,
    }
}

fn clients_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients")
}

/// What a client's workload must become: totals by (counter, key, total), where the key `*` is
/// the client's own, and the lines rejected and ignored, by reason and kind.
struct Expected {
    totals: &'static [(&'static str, &'static str, i64)],
    rejected: &'static [(&'static str, i64)],
    ignored: &'static [(&'static str, i64)],
}

/// tests/clients/python_client.py's `datadog_workload` (the same in hot_shots_client.js).
static DATADOG_WORKLOAD: Expected = Expected {
    // `scaled` is sampled at 0.5 and scaled (opt-in): each 1 counts 2.
    totals: &[
        ("page_views", "*", 4 * N),
        ("logins", "42", N),
        ("scaled", "*", 2 * R),
        // A last and a unique counter count their events.
        ("gauges", "*", R),
        ("sets", "*", 2 * R),
    ],
    rejected: &[
        ("sampled", R),
        ("unmapped_metric", R),
        ("unsupported_type", 3 * R),
        ("wrong_kind", 2 * R),
        ("bad_statsd_line", 0),
        ("missing_key", 0),
        ("bad_delta", 0),
    ],
    ignored: &[("event", R), ("service_check", R)],
};

/// tests/clients/python_client.py's `statsd_workload`.
static STATSD_WORKLOAD: Expected = Expected {
    totals: &[
        ("hits", "*", 4 * N),
        ("logins", "42", N),
        ("gauges", "*", R),
        ("sets", "*", 2 * R),
    ],
    rejected: &[
        ("sampled", R),
        ("unmapped_metric", R),
        ("unsupported_type", R),
        ("wrong_kind", 2 * R),
        ("bad_statsd_line", 0),
    ],
    ignored: &[],
};

/// One client library over one transport.
struct ClientCase {
    /// Names the case in failure messages.
    name: &'static str,
    /// `python3` or `node`, run in tests/clients.
    program: &'static str,
    /// Arguments to `program` that succeed only when the client library is installed.
    check: &'static [&'static str],
    /// The client program's arguments before N and R: `{socket}` is the daemon's statsd Unix
    /// socket, `{port}` its UDP port.
    args: &'static [&'static str],
    expected: &'static Expected,
    /// The key the client puts on its events (set in the client program).
    key: &'static str,
}

static CLIENT_CASES: [ClientCase; 5] = [
    ClientCase {
        name: "python datadog over unix datagrams",
        program: "python3",
        check: &["-c", "import datadog"],
        args: &["python_client.py", "datadog-uds", "{socket}"],
        expected: &DATADOG_WORKLOAD,
        key: "dd_uds",
    },
    ClientCase {
        name: "python datadog over udp",
        program: "python3",
        check: &["-c", "import datadog"],
        args: &["python_client.py", "datadog-udp", "127.0.0.1", "{port}"],
        expected: &DATADOG_WORKLOAD,
        key: "dd_udp",
    },
    ClientCase {
        name: "node hot-shots over udp",
        program: "node",
        check: &["-e", "require('hot-shots')"],
        args: &["hot_shots_client.js", "udp", "127.0.0.1", "{port}"],
        expected: &DATADOG_WORKLOAD,
        key: "hs_udp",
    },
    ClientCase {
        name: "node hot-shots over unix datagrams",
        program: "node",
        // hot-shots' Unix datagram support is its optional dependency `unix-dgram`, a native
        // module built by node-gyp at install.
        check: &["-e", "require('unix-dgram')"],
        args: &["hot_shots_client.js", "uds", "{socket}"],
        expected: &DATADOG_WORKLOAD,
        key: "hs_uds",
    },
    ClientCase {
        name: "python statsd over udp",
        program: "python3",
        check: &["-c", "import statsd"],
        args: &["python_client.py", "statsd-udp", "127.0.0.1", "{port}"],
        expected: &STATSD_WORKLOAD,
        key: "py_statsd",
    },
];

/// Whether the case's client library is installed; when it is not, says why outside CI and
/// panics under CI.
fn installed(case: &ClientCase) -> bool {
    let check = Command::new(case.program)
        .current_dir(clients_dir())
        .args(case.check)
        .output();
    if check.is_ok_and(|o| o.status.success()) {
        return true;
    }
    let why = format!(
        "{}: the client library is not installed (`{} {}` fails): run scripts/ensure-clients",
        case.name,
        case.program,
        case.check.join(" ")
    );
    assert!(!in_ci(), "{why}");
    eprintln!("skipping: {why}");
    false
}

/// Runs the client program to completion; panics with its output if it fails.
async fn run_client(case: &ClientCase, s: &Statsd) {
    let args: Vec<String> = case
        .args
        .iter()
        .map(|a| {
            a.replace("{socket}", &s.socket.display().to_string())
                .replace("{port}", &s.port.to_string())
        })
        .chain([N.to_string(), R.to_string()])
        .collect();
    let program = case.program;
    let out = tokio::task::spawn_blocking(move || {
        Command::new(program)
            .current_dir(clients_dir())
            .args(&args)
            .output()
            .expect("run client")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}: client failed: {}\n{}",
        case.name,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs one case's client against a fresh daemon and checks every total and rejection.
async fn client_case(case: &ClientCase) {
    if !installed(case) {
        return;
    }
    let _turn = TURN.lock().await;
    let mut s = start().await;
    let before = common::process_metrics();
    run_client(case, &s).await;
    // A graceful stop takes what is queued in the sockets, then flushes everything.
    s.h.stop_daemon().await;
    let after = common::process_metrics();
    let name = case.name;
    let expected = case.expected;
    for &(counter, key, total) in expected.totals {
        let key = if key == "*" { case.key } else { key };
        let got = s.h.total(counter, key).await.0;
        assert_eq!(got, total, "{name}: {counter} {key}");
    }
    for &(reason, n) in expected.rejected {
        let got = delta(&before, &after, &rejected(reason));
        assert_eq!(got, n, "{name}: rejected {reason}");
    }
    for &(kind, n) in expected.ignored {
        let got = delta(&before, &after, &ignored(kind));
        assert_eq!(got, n, "{name}: ignored {kind}");
    }
    s.h.stop().await;
}

/// Every client library over every transport it has: each case on a daemon of its own, one
/// after the other; a failed case is named and the others still run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_libraries_count_exactly() {
    let mut failed = Vec::new();
    for case in &CLIENT_CASES {
        // On a task of its own, so that a failed assertion ends only this case.
        if tokio::spawn(client_case(case)).await.is_err() {
            failed.push(case.name);
        }
    }
    assert!(failed.is_empty(), "failed: {failed:?}");
}

/// Multi-value lines, `|T` timestamps, several lines per datagram, and rejected lines beside
/// accepted ones in one datagram: only the bad lines are lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_dogstatsd_datagrams() {
    let _turn = TURN.lock().await;
    let mut s = start().await;
    let before = common::process_metrics();
    let sock = tokio::net::UnixDatagram::unbound().unwrap();
    let datagram = "page.views:1:2:3|c|#page:multi|T1700000000\n\
                    page.views:1|c|#env:x\n\
                    logins.7:5|c|@1\n\
                    logins.bob:1|c\n\
                    downloads a 1\n\
                    logins.7:1:x|c\n\
                    _sc|x|0\n";
    sock.send_to(datagram.as_bytes(), &s.socket).await.unwrap();
    s.h.stop_daemon().await;
    let after = common::process_metrics();
    let (count, first, last) = s.h.total("page_views", "multi").await;
    assert_eq!(
        (count, first, last),
        (6, Some(1_700_000_000_000), Some(1_700_000_000_000))
    );
    assert_eq!(s.h.total("logins", "7").await.0, 5);
    for (reason, n) in [
        ("missing_key", 1),
        ("bad_key", 1),
        ("bad_statsd_line", 1),
        ("bad_delta", 1),
    ] {
        assert_eq!(delta(&before, &after, &rejected(reason)), n, "{reason}");
    }
    assert_eq!(delta(&before, &after, &ignored("service_check")), 1);
    s.h.stop().await;
}

/// Scrapes a spawned daemon's metrics endpoint until `name` reads `want`.
fn wait_for_metric(port: u16, name: &str, want: f64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let got = Samples::parse(&common::scrape(([127, 0, 0, 1], port).into())).get(name);
        if got == Some(want) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{name} is {got:?}, expected {want}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// statsd lines are journaled as canonical native lines and survive kill -9 exactly once: the
/// real binary takes multi-line, multi-value datagrams, `!sync` on the native socket makes them
/// durable, SIGKILL before any flush (the interval is ten minutes), and the restart replays
/// them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_after_sync_replays_statsd_lines_exactly_once() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let port = free_port();
    let statsd_socket = dir.path().join("statsd.sock");
    let config = common::TestConfig::new(dir.path())
        .database_url(&conninfo)
        .metrics_port(port)
        .with(|c| {
            c.listen.set_datagram_socket(None);
            c.flush.set_interval(Duration::from_millis(600_000));
            c.rollup.enabled = false;
            c.statsd.set_socket(Some(statsd_socket));
            c.counters = mapped_counters();
        })
        .write();
    let socket = dir.path().join("tallyd.sock");
    let daemon = common::spawn_daemon(&config);
    let sock = tokio::net::UnixDatagram::unbound().unwrap();
    const DATAGRAMS: i64 = 2000;
    for _ in 0..DATAGRAMS {
        // Waits while the socket's queue is full: nothing is lost on a Unix datagram socket.
        sock.send_to(
            b"page.views:1:2|c|#page:kill\nlogins.5:1|c\n",
            dir.path().join("statsd.sock"),
        )
        .await
        .unwrap();
    }
    let accepted = |c: &str| format!("tallyd_events_accepted_total{{counter=\"{c}\"}}");
    let port2 = port;
    tokio::task::spawn_blocking(move || {
        wait_for_metric(port2, &accepted("page_views"), 2.0 * DATAGRAMS as f64);
        wait_for_metric(port2, &accepted("logins"), DATAGRAMS as f64);
    })
    .await
    .unwrap();
    let mut c = common::LineClient::connect(&socket).await;
    c.send(b"!sync\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    daemon.kill();
    let journal: Vec<u8> = std::fs::read_dir(dir.path().join("data/journal"))
        .unwrap()
        .flat_map(|e| std::fs::read(e.unwrap().path()).unwrap_or_default())
        .collect();
    let has = |s: &[u8]| journal.windows(s.len()).any(|w| w == s);
    assert!(has(b"page_views kill 2 @"), "canonical native lines");
    assert!(has(b"logins 5 1 @"));
    assert!(!has(b"page.views"), "no statsd text in the journal");

    let daemon = common::spawn_daemon(&config);
    let mut c = common::LineClient::connect(&socket).await;
    assert_eq!(c.flush().await, (0, 0));
    let client = sql(&conninfo).await;
    assert_eq!(
        key_total(&client, "page_views", "kill").await,
        3 * DATAGRAMS
    );
    assert_eq!(key_total(&client, "logins", "5").await, DATAGRAMS);
    assert!(daemon.terminate().success());
    common::stop_postgres(pg).await;
}

/// Without a journal, the memory cap holds statsd datagrams back as it holds native lines: with
/// the database down and `coalesce.max_pending_keys` reached, the statsd Unix socket is not read
/// and a blocking sender waits; once the database is back every event is committed exactly
/// once. (With a journal, intake goes on past the memory cap, spilled to the journal, up to
/// `journal.max_bytes`: tests/outage.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_cap_holds_statsd_senders_while_the_database_is_down() {
    const CAP: usize = 1000;
    const KEYS: usize = 20_000;
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let port = free_port();
    let statsd_socket = dir.path().join("statsd.sock");
    let config = common::TestConfig::new(dir.path())
        .database_url(&conninfo)
        .metrics_port(port)
        .with(|c| {
            c.listen.set_datagram_socket(None);
            c.journal.enabled = false;
            c.coalesce.max_pending_keys = CAP;
            c.flush.max_pending_keys = 500;
            c.flush.set_retry_max(Duration::from_millis(200));
            c.rollup.enabled = false;
            c.statsd.set_socket(Some(statsd_socket));
            c.counters = mapped_counters();
        })
        .write();
    let daemon = common::spawn_daemon(&config);
    common::stop_postgres_immediate(pg).await;

    let statsd = dir.path().join("statsd.sock");
    let sender = tokio::spawn(async move {
        let sock = tokio::net::UnixDatagram::unbound().unwrap();
        for k in 0..KEYS {
            let line = format!("page.views:1|c|#page:m{k}");
            sock.send_to(line.as_bytes(), &statsd).await.unwrap();
        }
    });
    // At most the cap, one read and the socket's small queue can be taken while the database
    // is down: the sender cannot finish.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    assert!(!sender.is_finished(), "back-pressure must hold the sender");

    let pg = common::postgres(dir.path()).await;
    sender.await.unwrap();
    tokio::task::spawn_blocking(move || {
        wait_for_metric(
            port,
            "tallyd_events_accepted_total{counter=\"page_views\"}",
            KEYS as f64,
        )
    })
    .await
    .unwrap();
    // The final flush of a graceful stop writes everything.
    assert!(daemon.terminate().success());
    assert_eq!(
        total_and_keys(&sql(&conninfo).await, "page_views").await,
        (KEYS as i64, KEYS as i64)
    );
    common::stop_postgres(pg).await;
}
