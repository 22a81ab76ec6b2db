//! tallyd's own client libraries (clients/rust, clients/python, clients/ruby) against the real
//! daemon: each runs the same workload (`WORKLOAD` below) on a `tallyd run` of its own beside a
//! private PostgreSQL, asserting its flush counts and rejection reasons as it goes; this file
//! kills the daemon with SIGKILL when the workload asks, restarts it, and checks the totals in
//! PostgreSQL exactly against what the workload sent.
//!
//! The daemon takes batches (`!batch`), so every workload must run its batch phase: this file
//! asks too, fails when the daemon answers `unknown_command`, and fails a workload that skips
//! the phase. The Python and Ruby libraries are
//! installed the way a user installs them (`pip install <path>`, `gem build` and
//! `gem install`) into a temporary directory first. A missing interpreter fails the test under
//! CI (CI=true) and skips it elsewhere, saying why (scripts/ensure-clients installs them).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use common::{spawn_daemon, temp_dir, Daemon, TestConfig};
use tallyd::config::KeyTypeName;
use tallyd::protocol::Kind;
use tallyd_client::{Client, Error, Event, Options, Outcome, Tally};

// WORKLOAD, the same in every library (tag `T`: rs, rs-async, py, rb; `N`: the workload's
// bigint key). Phases, each ending in a `flush` whose counts the workload asserts:
//
// 1. kinds: downloads `T-file` x10, then delta 5 @1700000000000, then delta -2; views `N`
//    delta 3 x7; uniq `T-page` visitor-0..4 twice each; peak `T-k` 5 42 17; low `T-k` 5 -3
//    17; latest `T-k` 1@1000 9@3000 4@2000; rejected: `nope T-x` (unknown_counter, line 40),
//    peak `T-k` "abc" (bad_value, 41), downloads with a 300-byte key (key_too_long, 42).
//    flush: accepted 38, rejected 3.
// 2. corrections: downloads `T-fixed` x3, set 100, x2 more; downloads `T-gone` x4, forget;
//    downloads `T-gone2` x1, forget everywhere; set uniq (refused: not_settable).
//    flush: accepted 10, rejected 1.
// 3. kill while lines are buffered: downloads `T-a` x20, sync; downloads `T-b` x30 (still in
//    the client's buffer); "kill" and wait for "killed"; flush fails with the connection lost
//    and 30 lines unacknowledged; the workload sends the 30 again and flushes: 30, 0.
// 4. kill while quiet: "kill", wait for "killed"; downloads `T-c` x5, flush: 5, 0 (the client
//    notices the closed connection before writing and connects again).
// 5. idle: wait past listen.idle_timeout_ms (2 s); downloads `T-idle` x3, flush: 3, 0.
// 6. batches, when the daemon takes them (else "batches: unsupported"):
//    batch `T:log:0`: downloads `T-batch` x20 and `nope T-x`: committed 20, 1 (line 21,
//    unknown_counter); the same batch again: duplicate; batch `T:aborted`: downloads
//    `T-aborted` x7, aborted (and again, left by an exception / a drop: aborted); a client
//    with max_batch_bytes 100 refuses the line past it; batch `T:kill:0`: downloads
//    `T-killed-batch` x1000, "kill" (not waiting), x1000 more, commit: committed or
//    duplicate. "batches: ran".
// Then "done".

/// The workload's totals: (counter, key, count); `T` in a key is the tag.
const TOTALS: [(&str, &str, i64); 11] = [
    ("downloads", "T-file", 13),
    ("uniq", "T-page", 10),
    ("peak", "T-k", 3),
    ("low", "T-k", 3),
    ("latest", "T-k", 3),
    ("downloads", "T-fixed", 102),
    ("downloads", "T-a", 20),
    ("downloads", "T-b", 30),
    ("downloads", "T-c", 5),
    ("downloads", "T-idle", 3),
    ("nope", "T-x", 0),
];

/// The kept values of the max, min and last counters.
const VALUES: [(&str, i64); 3] = [("peak", 42), ("low", -3), ("latest", 9)];

/// Keys that must have no row at all (forgotten, aborted).
const ABSENT: [(&str, &str); 3] = [
    ("downloads", "T-gone"),
    ("downloads", "T-gone2"),
    ("downloads", "T-aborted"),
];

/// The batch phase's totals, when batches ran.
const BATCH_TOTALS: [(&str, &str, i64); 2] = [
    ("downloads", "T-batch", 20),
    ("downloads", "T-killed-batch", 2000),
];

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A `tallyd run` (the real binary, so that it can be killed) beside a private PostgreSQL,
/// with the workload's counters and a 2 s idle timeout.
struct Stack {
    config: PathBuf,
    socket: PathBuf,
    conninfo: String,
    daemon: Arc<Mutex<Option<Daemon>>>,
    restart: Option<JoinHandle<()>>,
    pg: Option<tallyd::store::embedded::Embedded>,
    dir: tempfile::TempDir,
}

impl Stack {
    async fn start(edit: impl FnOnce(&mut tallyd::config::Config)) -> Stack {
        let dir = temp_dir();
        let pg = common::postgres(dir.path()).await;
        let conninfo = pg.connection_string("postgres");
        let config = TestConfig::new(dir.path())
            .database_url(&conninfo)
            .fast()
            .with(|c| {
                c.listen.set_datagram_socket(None);
                c.listen.set_idle_timeout(Some(Duration::from_millis(2000)));
                c.counters = workload_counters();
                edit(c);
            })
            .write();
        let socket = dir.path().join("tallyd.sock");
        let daemon = spawn_daemon(&config);
        Stack {
            config,
            socket,
            conninfo,
            daemon: Arc::new(Mutex::new(Some(daemon))),
            restart: None,
            pg: Some(pg),
            dir,
        }
    }

    /// SIGKILL now; the daemon is started again on the same data_dir 300 ms later, while the
    /// client tries to connect.
    fn kill_then_restart(&mut self) {
        self.settle();
        let daemon = self.daemon.lock().unwrap().take().expect("daemon running");
        assert!(!daemon.kill().success());
        let (slot, config) = (self.daemon.clone(), self.config.clone());
        self.restart = Some(std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            *slot.lock().unwrap() = Some(spawn_daemon(&config));
        }));
    }

    /// Waits for a pending restart.
    fn settle(&mut self) {
        if let Some(t) = self.restart.take() {
            t.join().expect("restart the daemon");
        }
    }

    /// A graceful stop (the final flush writes anything left) and a session on the database.
    async fn stop_daemon(&mut self) -> tokio_postgres::Client {
        self.settle();
        let daemon = self.daemon.lock().unwrap().take().unwrap();
        assert!(daemon.terminate().success());
        common::sql(&self.conninfo).await
    }

    /// PostgreSQL stopped at once (a crash for it).
    async fn stop_postgres_now(&mut self) {
        common::stop_postgres_immediate(self.pg.take().unwrap()).await;
    }

    /// PostgreSQL started again on its data directory.
    async fn start_postgres(&mut self) {
        self.pg = Some(common::postgres(self.dir.path()).await);
    }

    async fn stop(mut self) {
        common::stop_postgres(self.pg.take().unwrap()).await;
    }

    /// Stops the daemon, checks the WORKLOAD's totals for `tag`, stops PostgreSQL.
    async fn finish(mut self, tag: &str, batches_ran: bool) {
        let client = self.stop_daemon().await;
        let key = |k: &str| k.replace('T', tag);
        let mut totals = TOTALS.to_vec();
        if batches_ran {
            totals.extend(BATCH_TOTALS);
        }
        for (counter, k, want) in totals {
            let got = common::key_total(&client, counter, &key(k)).await;
            assert_eq!(got, want, "{tag}: {counter} {}", key(k));
        }
        let n = workload_number(tag).to_string();
        assert_eq!(common::key_total(&client, "views", &n).await, 21, "{tag}");
        for (counter, want) in VALUES {
            let row = client
                .query_one(
                    "SELECT value FROM tallyd.totals WHERE counter = $1 AND key = $2",
                    &[&counter, &key("T-k")],
                )
                .await
                .unwrap();
            assert_eq!(row.get::<_, Option<i64>>(0), Some(want), "{tag}: {counter}");
        }
        let distinct: i64 = client
            .query_one(
                "SELECT cardinality FROM tallyd.unique_totals \
                 WHERE counter = 'uniq' AND key = $1 AND span = 'all'",
                &[&key("T-page")],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(distinct, 5, "{tag}: distinct visitors");
        for (counter, k) in ABSENT {
            let rows: i64 = client
                .query_one(
                    "SELECT count(*) FROM tallyd.totals WHERE counter = $1 AND key = $2",
                    &[&counter, &key(k)],
                )
                .await
                .unwrap()
                .get(0);
            assert_eq!(rows, 0, "{tag}: {counter} {} has rows", key(k));
        }
        self.stop().await;
    }
}

fn workload_counters() -> Vec<tallyd::config::CounterConfig> {
    let kind = |name, kind| {
        let mut c = common::counter(name, KeyTypeName::Text);
        c.kind = kind;
        c
    };
    vec![
        common::counter("downloads", KeyTypeName::Text),
        common::counter("views", KeyTypeName::Bigint),
        kind("uniq", Kind::Unique),
        kind("peak", Kind::Max),
        kind("low", Kind::Min),
        kind("latest", Kind::Last),
    ]
}

/// The workload's bigint key, one per tag so that each library counts its own.
fn workload_number(tag: &str) -> i64 {
    match tag {
        "rs" => 1,
        "rs-async" => 2,
        "py" => 3,
        "rb" => 4,
        _ => 5,
    }
}

/// Asserts that the daemon at `socket` takes batches (`!batch` answered `ok`, not
/// `unknown_command`), so that the workloads' batch phases must run; returns true.
fn daemon_takes_batches(socket: &Path) -> bool {
    let mut c = Client::connect(Options::new(socket)).unwrap();
    let takes = match c.batch("client-libraries:probe") {
        Ok(b) => b.abort().map(|()| true),
        Err(Error::BatchesUnsupported) => Ok(false),
        Err(e) => Err(e),
    };
    let takes = takes.unwrap_or_else(|e| panic!("probing for batches: {e}"));
    assert!(takes, "this tallyd answers `!batch` with unknown_command");
    takes
}

// ---------------------------------------------------------------------------------------------
// The Rust library's workload, in this process.

fn tally(t: &Tally) -> (u64, u64) {
    (t.accepted, t.rejected)
}

/// The WORKLOAD with the blocking client; returns whether batches ran.
fn rust_workload(stack: &mut Stack, tag: &str) -> bool {
    let k = |s: &str| format!("{tag}-{s}");
    let mut c = Client::connect(Options::new(&stack.socket)).unwrap();
    let send = |c: &mut Client, e: Event, times: usize| {
        for _ in 0..times {
            c.send(&e).unwrap();
        }
    };
    // 1. kinds
    send(&mut c, Event::new("downloads", k("file")), 10);
    let file = Event::new("downloads", k("file"));
    send(&mut c, file.clone().delta(5).at(1_700_000_000_000), 1);
    send(&mut c, file.delta(-2), 1);
    let n = workload_number(tag).to_string();
    send(&mut c, Event::new("views", n).delta(3), 7);
    for i in 0..5 {
        send(
            &mut c,
            Event::new("uniq", k("page")).value(format!("visitor-{i}")),
            2,
        );
    }
    for v in [5, 42, 17] {
        send(&mut c, Event::new("peak", k("k")).value(v), 1);
    }
    for v in [5, -3, 17] {
        send(&mut c, Event::new("low", k("k")).value(v), 1);
    }
    for (v, at) in [(1, 1000), (9, 3000), (4, 2000)] {
        send(&mut c, Event::new("latest", k("k")).value(v).at(at), 1);
    }
    send(&mut c, Event::new("nope", k("x")), 1);
    send(&mut c, Event::new("peak", k("k")).value("abc"), 1);
    send(&mut c, Event::new("downloads", "k".repeat(300)), 1);
    let t = c.flush().unwrap();
    assert_eq!(tally(&t), (38, 3));
    let reasons: Vec<_> = t
        .rejections
        .iter()
        .map(|r| (r.line, r.reason.as_str()))
        .collect();
    assert_eq!(
        reasons,
        [
            (Some(40), "unknown_counter"),
            (Some(41), "bad_value"),
            (Some(42), "key_too_long")
        ]
    );
    assert_eq!(t.rejections[0].excerpt, format!("nope {tag}-x"));

    // 2. corrections
    send(&mut c, Event::new("downloads", k("fixed")), 3);
    c.set("downloads", &k("fixed"), 100, None).unwrap();
    send(&mut c, Event::new("downloads", k("fixed")), 2);
    send(&mut c, Event::new("downloads", k("gone")), 4);
    c.forget("downloads", &k("gone")).unwrap();
    send(&mut c, Event::new("downloads", k("gone2")), 1);
    c.forget_everywhere(&k("gone2")).unwrap();
    match c.set("uniq", &k("page"), 5, None) {
        Err(Error::Refused { reason, .. }) => assert_eq!(reason, "not_settable"),
        other => panic!("set of a unique counter: {other:?}"),
    }
    assert_eq!(tally(&c.flush().unwrap()), (10, 1));

    // 3. kill while lines are buffered
    send(&mut c, Event::new("downloads", k("a")), 20);
    c.sync().unwrap();
    send(&mut c, Event::new("downloads", k("b")), 30);
    assert!(c.buffered_bytes() > 0, "the lines wait in the client");
    stack.kill_then_restart();
    match c.flush() {
        Err(Error::ConnectionLost { unacknowledged, .. }) => assert_eq!(unacknowledged, 30),
        other => panic!("flush after SIGKILL: {other:?}"),
    }
    send(&mut c, Event::new("downloads", k("b")), 30);
    assert_eq!(tally(&c.flush().unwrap()), (30, 0));

    // 4. kill while quiet
    stack.kill_then_restart();
    send(&mut c, Event::new("downloads", k("c")), 5);
    assert_eq!(tally(&c.flush().unwrap()), (5, 0));

    // 5. idle
    std::thread::sleep(Duration::from_millis(2500));
    send(&mut c, Event::new("downloads", k("idle")), 3);
    assert_eq!(tally(&c.flush().unwrap()), (3, 0));

    // 6. batches
    match c.batch(&format!("{tag}:probe")) {
        Err(Error::BatchesUnsupported) => return false,
        probe => probe.unwrap().abort().unwrap(),
    }
    let log = |c: &mut Client| {
        let mut b = c.batch(&format!("{tag}:log:0")).unwrap();
        for _ in 0..20 {
            b.add(&Event::new("downloads", k("batch"))).unwrap();
        }
        b.add(&Event::new("nope", k("x"))).unwrap();
        b.commit().unwrap()
    };
    match log(&mut c) {
        Outcome::Committed(t) => {
            assert_eq!(tally(&t), (20, 1));
            assert_eq!(t.rejections[0].line, Some(21));
            assert_eq!(t.rejections[0].reason, "unknown_counter");
        }
        Outcome::Duplicate => panic!("the first copy of {tag}:log:0 is a duplicate"),
    }
    assert_eq!(log(&mut c), Outcome::Duplicate);
    let mut b = c.batch(&format!("{tag}:aborted")).unwrap();
    for _ in 0..7 {
        b.add(&Event::new("downloads", k("aborted"))).unwrap();
    }
    b.abort().unwrap();
    {
        let mut dropped = c.batch(&format!("{tag}:aborted")).unwrap();
        dropped.add(&Event::new("downloads", k("aborted"))).unwrap();
    }
    let mut small = Options::new(&stack.socket);
    small.max_batch_bytes = 100;
    let mut s = Client::connect(small).unwrap();
    let mut b = s.batch(&format!("{tag}:small")).unwrap();
    b.add(&Event::new("downloads", "x".repeat(60))).unwrap();
    match b.add(&Event::new("downloads", "x".repeat(60))) {
        Err(Error::BatchTooLarge { limit, .. }) => assert_eq!(limit, 100),
        other => panic!("a line past max_batch_bytes: {other:?}"),
    }
    b.abort().unwrap();
    let mut b = c.batch(&format!("{tag}:kill:0")).unwrap();
    for i in 0..2000 {
        if i == 1000 {
            stack.kill_then_restart();
        }
        b.add(&Event::new("downloads", k("killed-batch"))).unwrap();
    }
    match b.commit().unwrap() {
        Outcome::Committed(t) => assert_eq!(tally(&t), (2000, 0)),
        Outcome::Duplicate => {}
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_client_runs_the_workload_exactly() {
    let mut stack = Stack::start(|_| {}).await;
    let takes_batches = daemon_takes_batches(&stack.socket);
    let (stack, ran) = tokio::task::spawn_blocking(move || {
        let ran = rust_workload(&mut stack, "rs");
        (stack, ran)
    })
    .await
    .unwrap();
    assert_eq!(ran, takes_batches);
    if !ran {
        eprintln!("batches skipped: this tallyd answers `!batch` with unknown_command");
    }
    stack.finish("rs", ran).await;
}

// ---------------------------------------------------------------------------------------------
// The Python and Ruby libraries, installed as a user installs them, run by their interpreter.

/// Whether `program args` succeeds; when it does not, says why outside CI and panics under CI.
fn present(program: &str, args: &[&str], what: &str) -> bool {
    let ok = Command::new(program)
        .args(args)
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        let why = format!(
            "{what} is not installed (`{program} {}` fails): run scripts/ensure-clients",
            args.join(" ")
        );
        assert!(!in_ci(), "{why}");
        eprintln!("skipping: {why}");
    }
    ok
}

/// Runs `cmd` to completion; panics with its output unless it succeeds.
fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

/// Runs a workload program against `stack`: kills (and restarts) the daemon each time it
/// prints `kill`, answering `killed`; returns the other lines it printed, once it succeeded.
fn drive(stack: &mut Stack, mut cmd: Command) -> Vec<String> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let mut stdin = child.stdin.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
        text
    });
    let mut said = Vec::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        if line == "kill" {
            stack.kill_then_restart();
            // A workload that failed meanwhile no longer reads: its output says why.
            let _ = stdin.write_all(b"killed\n").and_then(|()| stdin.flush());
        } else {
            said.push(line);
        }
    }
    let status = child.wait().unwrap();
    let stderr = stderr.join().unwrap();
    assert!(
        status.success() && said.last().is_some_and(|l| l == "done"),
        "{cmd:?}: {status}\nstdout: {said:?}\nstderr:\n{stderr}"
    );
    said
}

/// Runs the workload program `cmd` (tag `tag`) against a fresh stack and checks the totals.
async fn workload_case(tag: &'static str, cmd: impl FnOnce(&Path) -> Command + Send + 'static) {
    let stack = Stack::start(|_| {}).await;
    let takes_batches = daemon_takes_batches(&stack.socket);
    let (stack, said) = tokio::task::spawn_blocking(move || {
        let mut stack = stack;
        let cmd = cmd(&stack.socket);
        let said = drive(&mut stack, cmd);
        (stack, said)
    })
    .await
    .unwrap();
    let ran = said.iter().any(|l| l == "batches: ran");
    assert_eq!(ran, takes_batches, "{tag}: batches ran: {said:?}");
    stack.finish(tag, ran).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_client_runs_the_workload_exactly() {
    // Building a wheel takes setuptools and either `wheel` or a setuptools that has it.
    let build_tools = "import setuptools\ntry: import wheel\nexcept ImportError: import setuptools.command.bdist_wheel";
    if !present(
        "python3",
        &["-c", build_tools],
        "python3 with setuptools and wheel",
    ) {
        return;
    }
    let lib = repo().join("clients/python");
    let installed = temp_dir();
    let target = installed.path().join("site");
    // As a user installs it, from a copy (pip builds in the source tree), without the network
    // (the build tools are already there).
    let copy = installed.path().join("python");
    run(Command::new("cp").arg("-r").arg(&lib).arg(&copy));
    run(Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--no-deps", "--no-index"])
        .args(["--no-build-isolation", "--target"])
        .arg(&target)
        .arg(&copy));
    let python = move |target: &Path| {
        let mut cmd = Command::new("python3");
        cmd.env("PYTHONPATH", target)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .current_dir(lib.join("tests"));
        cmd
    };
    run(python(&target).args(["-m", "unittest", "-q", "test_protocol"]));
    let n = workload_number("py").to_string();
    workload_case("py", move |socket| {
        let mut cmd = python(&target);
        cmd.arg("conformance.py").arg(socket).args(["py", &n]);
        cmd
    })
    .await;
    drop(installed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ruby_client_runs_the_workload_exactly() {
    if !present("ruby", &["-e", "require 'minitest'"], "ruby with minitest") {
        return;
    }
    let lib = repo().join("clients/ruby");
    let installed = temp_dir();
    let gem = installed.path().join("tallyd-client.gem");
    let gems = installed.path().join("gems");
    // As a user installs it: the gem built from its gemspec, then installed from the file.
    run(Command::new("gem")
        .args(["build", "tallyd-client.gemspec", "--output"])
        .arg(&gem)
        .current_dir(&lib));
    run(Command::new("gem")
        .args(["install", "--local", "--no-document", "--install-dir"])
        .arg(&gems)
        .arg(&gem));
    // The installed gem before the system's (minitest is one of those).
    let system_gems = run(Command::new("ruby").args(["-e", "print Gem.path.join(':')"]));
    let gem_path = format!("{}:{system_gems}", gems.display());
    let ruby = move |gem_path: &str| {
        let mut cmd = Command::new("ruby");
        cmd.env("GEM_PATH", gem_path).current_dir(lib.join("test"));
        cmd
    };
    run(ruby(&gem_path).arg("test_protocol.rb"));
    let n = workload_number("rb").to_string();
    workload_case("rb", move |socket| {
        let mut cmd = ruby(&gem_path);
        cmd.arg("conformance.rb").arg(socket).args(["rb", &n]);
        cmd
    })
    .await;
    drop(installed);
}

// ---------------------------------------------------------------------------------------------
// The Rust library's tokio client, back-pressure, and `tallyd send --batch`.

/// The tokio client: every operation once, a kill while quiet, and batches when the daemon
/// takes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_client_counts_exactly() {
    use tallyd_client::nonblocking;
    let mut stack = Stack::start(|_| {}).await;
    let takes_batches = daemon_takes_batches(&stack.socket);
    let mut c = nonblocking::Client::connect(Options::new(&stack.socket))
        .await
        .unwrap();
    let file = Event::new("downloads", "rs-async-file");
    for _ in 0..10 {
        c.send(&file).await.unwrap();
    }
    c.send(&Event::new("peak", "rs-async-k").value(7).at(5))
        .await
        .unwrap();
    c.send_line("nope rs-async-x").await.unwrap();
    let t = c.flush().await.unwrap();
    assert_eq!(tally(&t), (11, 1));
    assert_eq!(t.rejections[0].reason, "unknown_counter");
    c.set("downloads", "rs-async-file", 50, None).await.unwrap();
    c.sync().await.unwrap();
    c.ping().await.unwrap();
    tokio::task::block_in_place(|| stack.kill_then_restart());
    for _ in 0..5 {
        c.send(&file).await.unwrap();
    }
    assert_eq!(tally(&c.flush().await.unwrap()), (5, 0));
    async fn log(c: &mut nonblocking::Client) -> Result<Outcome, Error> {
        let mut b = c.batch("rs-async:log:0").await?;
        for _ in 0..20 {
            b.add(&Event::new("downloads", "rs-async-batch")).await?;
        }
        b.commit().await
    }
    match log(&mut c).await {
        Err(Error::BatchesUnsupported) => assert!(!takes_batches),
        Ok(Outcome::Committed(t)) => assert_eq!(tally(&t), (20, 0)),
        other => panic!("the first copy of a batch: {other:?}"),
    }
    if takes_batches {
        assert_eq!(log(&mut c).await.unwrap(), Outcome::Duplicate);
    }
    drop(c);
    let client = stack.stop_daemon().await;
    let total = |k: &'static str| common::key_total(&client, "downloads", k);
    assert_eq!(total("rs-async-file").await, 55);
    let batch = if takes_batches { 20 } else { 0 };
    assert_eq!(total("rs-async-batch").await, batch);
    assert_eq!(common::key_total(&client, "peak", "rs-async-k").await, 1);
    stack.stop().await;
}

/// When tallyd stops reading (no journal, the database down, `coalesce.max_pending_keys`
/// reached), the client's writes wait, its buffer stays within `write_buffer_bytes`, and once
/// the database is back every event counts exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_wait_while_tallyd_does_not_read() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    // Well beyond what tallyd takes (1000 keys, a read buffer) and the socket's buffers.
    const KEYS: usize = 50_000;
    const BUFFER: usize = 16 * 1024;
    let mut stack = Stack::start(|c| {
        c.journal.enabled = false;
        c.coalesce.max_pending_keys = 1000;
        c.flush.max_pending_keys = 500;
        c.flush.set_retry_max(Duration::from_millis(200));
    })
    .await;
    stack.stop_postgres_now().await;
    let most_buffered = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let mut options = Options::new(&stack.socket);
    options.write_buffer_bytes = BUFFER;
    let (most, finished) = (most_buffered.clone(), done.clone());
    let sender = std::thread::spawn(move || {
        let mut c = Client::connect(options).unwrap();
        for k in 0..KEYS {
            c.send(&Event::new("downloads", format!("bp-{k}"))).unwrap();
            most.fetch_max(c.buffered_bytes(), Ordering::Relaxed);
        }
        finished.store(true, Ordering::Relaxed);
        c.flush().unwrap()
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !done.load(Ordering::Relaxed),
        "back-pressure must hold the sender"
    );
    stack.start_postgres().await;
    let t = tokio::task::spawn_blocking(move || sender.join().unwrap())
        .await
        .unwrap();
    assert_eq!(tally(&t), (KEYS as u64, 0));
    let line = "downloads bp-49999\n".len();
    let most = most_buffered.load(Ordering::Relaxed);
    assert!(most < BUFFER + line, "{most} bytes buffered");
    let client = stack.stop_daemon().await;
    assert_eq!(
        common::total_and_keys(&client, "downloads").await,
        (KEYS as i64, KEYS as i64)
    );
    stack.stop().await;
}

/// `tallyd send --batch ID -` imports stdin once: committed, then duplicate, both exit 0;
/// against a tallyd without batches it fails and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_batch_imports_a_file_once() {
    let stack = Stack::start(|_| {}).await;
    let takes_batches = daemon_takes_batches(&stack.socket);
    let send = |config: PathBuf| {
        let mut child = Command::new(common::BIN)
            .arg("--config")
            .arg(config)
            .args(["send", "--batch", "cli:access.log:0", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = b"downloads cli-f\n\nnope cli-x\ndownloads cli-f 2\n";
        child.stdin.take().unwrap().write_all(lines).unwrap();
        let out = child.wait_with_output().unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    };
    let config = stack.config.clone();
    let first = tokio::task::spawn_blocking(move || send(config))
        .await
        .unwrap();
    if !takes_batches {
        assert_eq!(first.0, Some(1), "{first:?}");
        assert!(first.2.contains("does not support batches"), "{first:?}");
        stack.stop().await;
        return;
    }
    assert_eq!(first.0, Some(0), "{first:?}");
    assert_eq!(
        first.1,
        "committed cli:access.log:0: accepted 2, rejected 1\n"
    );
    assert!(first
        .2
        .contains("rejected 3: unknown_counter \"nope cli-x\""));
    let config = stack.config.clone();
    let second = tokio::task::spawn_blocking(move || send(config))
        .await
        .unwrap();
    assert_eq!(second.0, Some(0), "{second:?}");
    assert!(
        second.1.starts_with("duplicate cli:access.log:0"),
        "{second:?}"
    );
    let mut stack = stack;
    let client = stack.stop_daemon().await;
    assert_eq!(common::key_total(&client, "downloads", "cli-f").await, 3);
    stack.stop().await;
}

/// A load generator's way: a pre-built buffer of many lines (bad ones among them) queued
/// whole, `!ping` and `!flush` sent without waiting, their answers read later in any order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_lines_and_requests_count_exactly() {
    use tallyd_client::{Reply, Request};
    const LINES: usize = 100_000;
    let mut stack = Stack::start(|_| {}).await;
    let socket = stack.socket.clone();
    let (t, pong) = tokio::task::spawn_blocking(move || {
        let mut buf = Vec::new();
        for i in 0..LINES {
            let line = match i % 1000 {
                999 => format!("nope pipe-{i}\n"),
                _ => format!("downloads pipe-{} 2\n", i % 100),
            };
            buf.extend_from_slice(line.as_bytes());
        }
        let mut options = Options::new(socket);
        options.write_buffer_bytes = 4096;
        let mut c = Client::connect(options).unwrap();
        c.send_lines(&buf).unwrap();
        let ping = c.request(Request::Ping).unwrap();
        let flush = c.request(Request::Flush).unwrap();
        let flushed = c.answer(flush).unwrap();
        let pong = c.answer(ping).unwrap();
        (flushed, pong.reply)
    })
    .await
    .unwrap();
    assert_eq!(pong, Reply::Pong);
    let bad = (LINES / 1000) as u64;
    assert_eq!(
        t.reply,
        Reply::Counts {
            accepted: LINES as u64 - bad,
            rejected: bad
        }
    );
    assert_eq!(t.rejections.len() as u64, bad);
    // Line numbers count from `!errors`, the connection's first line.
    assert_eq!(t.rejections[0].line, Some(1000 + 1));
    let client = stack.stop_daemon().await;
    let want = 2 * (LINES as i64 - bad as i64);
    assert_eq!(
        common::total_and_keys(&client, "downloads").await,
        (want, 100)
    );
    stack.stop().await;
}
