//! Reload under load: clients stream events over both sockets while the test rewrites
//! config.toml and sends SIGHUP, round after round (add a counter, change the flush interval,
//! change log level and format, remove a counter no client uses, an invalid file, a refused
//! socket change). Every connection stays open, every event sent is in the database exactly
//! once, lines for an added counter are accepted on connections opened before the reload, and
//! an invalid or refused file leaves the running configuration in force. Also `tallyd reload`
//! and `tallyd check-config` from the command line.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use common::{free_port, spawn_daemon, tallyd, temp_dir, Daemon, TestConfig};
use tallyd::config::{Config, KeyTypeName};

const STREAM_CLIENTS: usize = 3;
const KEYS: usize = 5;
const ROUNDS: usize = 3;

fn base(dir: &Path, port: u16) -> TestConfig {
    TestConfig::new(dir)
        .counters(&[
            ("downloads", KeyTypeName::Text),
            ("spare0", KeyTypeName::Text),
        ])
        .fast()
        .metrics_port(port)
}

/// Writes the config as `config.toml` atomically (a reload never reads half a file).
fn install(config: &TestConfig) -> PathBuf {
    let new = config.write_as("config.toml.new");
    let path = new.with_file_name("config.toml");
    std::fs::rename(&new, &path).unwrap();
    path
}

fn reloads(daemon: &Daemon, result: &str) -> f64 {
    daemon.scrape().value(&format!(
        r#"tallyd_config_reloads_total{{result="{result}"}}"#
    ))
}

/// A stream client on one connection for the whole test: sends `downloads s<k> 1` lines until
/// `stop`, then `!flush`; returns per-key counts and the `!flush` answer.
fn stream_client(
    socket: PathBuf,
    id: usize,
    stop: Arc<AtomicBool>,
) -> JoinHandle<(Vec<u64>, String)> {
    std::thread::spawn(move || {
        let mut conn = UnixStream::connect(&socket).unwrap();
        let mut sent = vec![0u64; KEYS];
        let mut n = 0usize;
        while !stop.load(Ordering::Relaxed) {
            let mut batch = String::new();
            for _ in 0..50 {
                let k = (n + id) % KEYS;
                batch.push_str(&format!("downloads s{k} 1\n"));
                sent[k] += 1;
                n += 1;
            }
            conn.write_all(batch.as_bytes())
                .expect("the connection stays open");
        }
        conn.write_all(b"!flush\n").unwrap();
        let mut answer = String::new();
        BufReader::new(&conn).read_line(&mut answer).unwrap();
        (sent, answer)
    })
}

/// Datagrams of `downloads d<k> 1` until `stop`; returns per-key counts.
fn datagram_client(socket: PathBuf, stop: Arc<AtomicBool>) -> JoinHandle<Vec<u64>> {
    std::thread::spawn(move || {
        let sock = UnixDatagram::unbound().unwrap();
        let mut sent = vec![0u64; KEYS];
        let mut n = 0usize;
        while !stop.load(Ordering::Relaxed) {
            let k = n % KEYS;
            sock.send_to(format!("downloads d{k} 1\n").as_bytes(), &socket)
                .expect("the datagram socket stays bound");
            sent[k] += 1;
            n += 1;
        }
        sent
    })
}

/// One line and its answer on a connection that sent `!errors` first.
fn ask(conn: &mut BufReader<UnixStream>, line: &str) -> String {
    conn.get_mut().write_all(line.as_bytes()).unwrap();
    let mut answer = String::new();
    conn.read_line(&mut answer).unwrap();
    answer
}

fn count(config: &Path, counter: &str, key: &str) -> u64 {
    let out = tallyd(config, &["get", counter, key]);
    let text = String::from_utf8_lossy(&out.stdout);
    let count = text
        .split_whitespace()
        .find_map(|f| f.strip_prefix("count="))
        .unwrap_or_else(|| {
            panic!(
                "no count in {text:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    count.parse().unwrap()
}

#[test]
fn reload_under_load_keeps_connections_and_exact_totals() {
    let dir = temp_dir();
    let port = free_port();
    let mut config = base(dir.path(), port);
    let path = install(&config);
    let daemon = spawn_daemon(&path);
    let built = config.clone().build();
    let (socket, dgram) = (
        built.listen.socket().unwrap().to_path_buf(),
        built.listen.datagram_socket().unwrap().to_path_buf(),
    );

    // `spawn_daemon`'s `!ping`s.
    let accepted_before = daemon.scrape().value("tallyd_connections_accepted_total");
    let stop = Arc::new(AtomicBool::new(false));
    let streams: Vec<_> = (0..STREAM_CLIENTS)
        .map(|i| stream_client(socket.clone(), i, stop.clone()))
        .collect();
    let datagrams = datagram_client(dgram.clone(), stop.clone());
    // Opened before any reload; sends lines for each counter the reloads add.
    let mut early = BufReader::new(UnixStream::connect(&socket).unwrap());
    assert_eq!(ask(&mut early, "!errors\n"), "ok\n");
    assert_eq!(ask(&mut early, "downloads early 1\n!flush\n"), "ok 1 0\n");
    let mut early_sent = 1u64;
    let mut json_seen = false;

    let (mut ok, mut invalid, mut refused) = (0, 0, 0);
    for round in 0..ROUNDS {
        // A counter added: accepted at once on the connection opened before.
        let added = format!("added{round}");
        config = config.counters(&[(&added, KeyTypeName::Text)]);
        install(&config);
        daemon.reload("ok");
        ok += 1;
        let answer = ask(&mut early, &format!("{added} k 2\n{added} k 3\n!flush\n"));
        assert_eq!(
            answer, "ok 2 0\n",
            "round {round}: lines for the added counter"
        );

        // The flush interval.
        let interval = [50, 400][round % 2];
        config = config.with(|c| c.flush.set_interval(Duration::from_millis(interval)));
        install(&config);
        daemon.reload("ok");
        ok += 1;

        // Log level and format.
        let json = round % 2 == 0;
        config = config.with(|c| {
            c.log.level = if json { "info,tallyd=info" } else { "info" }.into();
            c.log.format = if json {
                tallyd::config::LogFormat::Json
            } else {
                tallyd::config::LogFormat::Text
            };
        });
        install(&config);
        daemon.reload("ok");
        ok += 1;

        // A counter no client uses removed (and the next one added): its lines are rejected.
        let (old_spare, new_spare) = (format!("spare{round}"), format!("spare{}", round + 1));
        config = config.with(|c| {
            c.counters.retain(|x| x.name != old_spare);
            c.counters
                .push(tallyd_testkit::counter(&new_spare, KeyTypeName::Text));
        });
        install(&config);
        daemon.reload("ok");
        ok += 1;
        let answer = ask(&mut early, &format!("{old_spare} k 1\n"));
        assert!(
            answer.starts_with("rejected ") && answer.contains(" unknown_counter "),
            "{answer}"
        );
        assert_eq!(ask(&mut early, "!flush\n"), "ok 0 1\n");

        // An invalid file: nothing changes, and check-config says the same.
        let bad = config
            .clone()
            .with(|c| c.flush.set_interval(Duration::ZERO));
        let bad_path = install(&bad);
        daemon.reload("invalid");
        invalid += 1;
        let out = tallyd(&bad_path, &["check-config"]);
        assert!(!out.status.success());
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("flush.interval_ms"),
            "{out:?}"
        );
        // The running config still has the counter the last good file added.
        assert_eq!(
            ask(&mut early, &format!("{new_spare} k 1\n!flush\n")),
            "ok 1 0\n"
        );

        // A refused change: another socket path. The old socket keeps serving.
        let moved = config.clone().with(|c| {
            c.listen.set_socket(Some(dir.path().join("elsewhere.sock")));
        });
        install(&moved);
        daemon.reload("refused");
        refused += 1;
        assert!(!dir.path().join("elsewhere.sock").exists());
        assert_eq!(ask(&mut early, "downloads early 1\n!flush\n"), "ok 1 0\n");
        early_sent += 1;
        install(&config);
        if json {
            json_seen |= daemon
                .log()
                .lines()
                .any(|l| l.starts_with('{') && l.contains("listen.socket"));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut stream_totals = [0u64; KEYS];
    let mut kept = 0;
    for client in streams {
        let (sent, answer) = client.join().unwrap();
        let n: u64 = sent.iter().sum();
        assert_eq!(
            answer,
            format!("ok {n} 0\n"),
            "every line accepted, connection open"
        );
        kept += 1;
        for (t, s) in stream_totals.iter_mut().zip(sent) {
            *t += s;
        }
    }
    let dgram_totals = datagrams.join().unwrap();
    kept += 1; // `early`, checked by every round's `!flush`.
    assert!(
        json_seen,
        "log.format = json applied: the refused line is JSON"
    );

    let log = daemon.log();
    let line = log
        .lines()
        .find(|l| l.contains("cannot change while tallyd runs"))
        .expect("a log line for the refused reload");
    assert!(line.contains("listen.socket"), "{line}");
    let s = daemon.scrape();
    assert_eq!(
        s.value(r#"tallyd_config_reloads_total{result="ok"}"#),
        ok as f64
    );
    assert_eq!(
        s.value(r#"tallyd_config_reloads_total{result="invalid"}"#),
        invalid as f64
    );
    assert_eq!(
        s.value(r#"tallyd_config_reloads_total{result="refused"}"#),
        refused as f64
    );
    assert_eq!(s.value("tallyd_config_last_reload_successful"), 0.0);
    // A reload registers the series of the counters it adds, and resets none that runs.
    for round in 0..ROUNDS {
        let series = format!(r#"tallyd_events_accepted_total{{counter="added{round}"}}"#);
        assert_eq!(s.value(&series), 2.0, "{series}");
    }
    // The clients' connections and `early`, and no other: none had to reconnect.
    assert_eq!(
        s.value("tallyd_connections_accepted_total"),
        accepted_before + (STREAM_CLIENTS + 1) as f64,
        "no client had to reconnect"
    );

    // A graceful stop flushes the rest; a fresh start reads the totals back.
    assert!(daemon.terminate().success());
    // The spares the rounds removed are declared again, to read what they had accepted: the
    // events of a removed counter were flushed, not dropped.
    let removed: Vec<String> = (1..ROUNDS).map(|r| format!("spare{r}")).collect();
    let removed: Vec<(&str, KeyTypeName)> = removed
        .iter()
        .map(|n| (n.as_str(), KeyTypeName::Text))
        .collect();
    let path = install(&config.clone().counters(&removed));
    let _daemon = spawn_daemon(&path);
    let mut events = 0;
    for k in 0..KEYS {
        assert_eq!(
            count(&path, "downloads", &format!("s{k}")),
            stream_totals[k],
            "s{k}"
        );
        assert_eq!(
            count(&path, "downloads", &format!("d{k}")),
            dgram_totals[k],
            "d{k}"
        );
        events += stream_totals[k] + dgram_totals[k];
    }
    assert_eq!(count(&path, "downloads", "early"), early_sent);
    for round in 0..ROUNDS {
        assert_eq!(count(&path, &format!("added{round}"), "k"), 5);
        assert_eq!(count(&path, &format!("spare{}", round + 1), "k"), 1);
    }
    println!(
        "reload under load: {} reloads ({ok} ok, {invalid} invalid, {refused} refused), \
         {events} events sent during the reloads ({} stream, {} datagram), {kept} connections \
         kept open, totals exact",
        ok + invalid + refused,
        stream_totals.iter().sum::<u64>(),
        dgram_totals.iter().sum::<u64>(),
    );
}

#[test]
fn reload_command_signals_the_daemon_and_refuses_a_bad_file() {
    let dir = temp_dir();
    let config = base(dir.path(), free_port());
    let path = install(&config);
    // No daemon yet: said so.
    let out = tallyd(&path, &["reload"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(err.contains("no tallyd is running on data_dir"), "{err}");

    let mut daemon = spawn_daemon(&path);
    let out = tallyd(&path, &["send", "downloads", "k", "4"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "accepted 1, rejected 0\n"
    );
    // A counter added, and another's slots changed: both live.
    let added = config
        .clone()
        .counters(&[("added", KeyTypeName::Text)])
        .with(|c| c.counters[0].slots = 3);
    install(&added);
    let out = tallyd(&path, &["reload"]);
    assert!(out.status.success(), "{out:?}");
    while reloads(&daemon, "ok") < 1.0 {
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = tallyd(&path, &["send", "added", "k", "4"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "accepted 1, rejected 0\n"
    );
    let out = tallyd(&path, &["send", "downloads", "k", "5"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "accepted 1, rejected 0\n"
    );
    assert_eq!(
        count(&path, "downloads", "k"),
        9,
        "slots changed: the total is still exact"
    );
    assert!(
        daemon.wait_for_log("counters.downloads.slots: 100 -> 3"),
        "{}",
        daemon.log()
    );

    // A bad file: `tallyd reload` validates it first and does not signal.
    let bad = added.clone().with(|c: &mut Config| c.counters[0].slots = 0);
    install(&bad);
    let out = tallyd(&path, &["reload"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(err.contains("counters.downloads.slots"), "{err}");
    let check = tallyd(&path, &["check-config"]);
    assert_eq!(
        String::from_utf8_lossy(&check.stderr),
        err,
        "the same validation"
    );
    let s = daemon.scrape();
    assert_eq!(
        s.value(r#"tallyd_config_reloads_total{result="invalid"}"#),
        0.0
    );
    assert_eq!(s.value(r#"tallyd_config_reloads_total{result="ok"}"#), 1.0);
    assert!(dir.path().join("data/tallyd.pid").exists());
    assert!(daemon.terminate().success());
    assert!(
        !dir.path().join("data/tallyd.pid").exists(),
        "removed at the stop"
    );
}

#[test]
fn rollup_into_changes_live_and_a_missing_table_is_invalid() {
    let dir = temp_dir();
    let config = TestConfig::new(dir.path())
        .counters(&[("downloads", KeyTypeName::Bigint)])
        .fast()
        .metrics_port(free_port())
        .with(|c| {
            c.rollup.enabled = true;
            c.rollup.set_interval(Duration::from_millis(100));
        });
    let path = install(&config);
    let mut daemon = spawn_daemon(&path);
    let into = config
        .clone()
        .with(|c| c.counters[0] = common::counter_into_repositories("downloads"));
    // The table does not exist yet: invalid, nothing changes.
    install(&into);
    daemon.reload("invalid");
    // The count is taken just before the line is logged (by the logging thread): wait for it.
    assert!(
        daemon.wait_for_log("rollup_into table public.repositories does not exist"),
        "{}",
        daemon.log()
    );
    common::run_sql(
        &path,
        "CREATE TABLE public.repositories (id bigint PRIMARY KEY, download_count bigint);
         INSERT INTO public.repositories VALUES (1, 0)",
    );
    daemon.reload("ok");
    let out = tallyd(&path, &["send", "downloads", "1", "7"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "accepted 1, rejected 0\n"
    );
    // The rollup tasks restarted with the new target fold the key into the application's row.
    let folded = || {
        let rows = common::run_sql(
            &path,
            "SELECT download_count FROM public.repositories WHERE id = 1",
        );
        rows.iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
                _ => None,
            })
            .expect("the row of key 1")
    };
    while folded() != "7" {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(count(&path, "downloads", "1"), 7);
}

/// `tallyd reload` signals only the process that holds the data_dir lock. The lock can be held
/// while `tallyd.pid` names another process: a tallyd killed with -9 leaves its pid file, and
/// then `tallyd move-shards` holds the lock, or a new tallyd holds it before it has written its
/// own pid; meanwhile the kernel may have given the old pid to any process. Here the test holds
/// the lock and the stale pid file names a live `sleep` (a reused pid): SIGHUP would kill it.
#[test]
fn reload_never_signals_a_process_that_does_not_hold_the_data_dir() {
    let dir = temp_dir();
    let config = base(dir.path(), free_port());
    let path = install(&config);
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let mut victim = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .unwrap();
    std::fs::write(data.join("tallyd.pid"), format!("{}\n", victim.id())).unwrap();
    let lock = tallyd::instance::lock_data_dir(&data).unwrap();

    let out = tallyd(&path, &["reload"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    let alive = victim.try_wait().unwrap().is_none();
    let _ = victim.kill();
    let _ = victim.wait();
    drop(lock);
    assert!(
        alive,
        "tallyd reload sent SIGHUP to an unrelated process: {out:?}"
    );
    assert!(!out.status.success(), "{out:?}");
    assert!(err.contains("tallyd.pid"), "{err}");
}

/// `tallyd reload` (or any SIGHUP) right after the start, as soon as `tallyd.pid` exists: the
/// daemon must not die of it (SIGHUP's default action) and applies the reload once ready.
#[test]
fn sighup_right_after_the_start_does_not_kill_the_daemon() {
    let dir = temp_dir();
    let config = base(dir.path(), free_port());
    let path = install(&config);
    let pid_file = dir.path().join("data/tallyd.pid");
    let stop = Arc::new(AtomicBool::new(false));
    let hup = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut sent = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let pid = std::fs::read_to_string(&pid_file)
                    .ok()
                    .and_then(|s| s.trim().parse::<i32>().ok());
                if let Some(pid) = pid {
                    // SAFETY: kill(2); the pid is the test's own daemon (a fresh data_dir),
                    // alive until `stop` is set.
                    if unsafe { libc::kill(pid, libc::SIGHUP) } == 0 {
                        sent += 1;
                    }
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            sent
        })
    };
    let spawned = common::Daemon::try_spawn_with(Path::new(common::BIN), &path, |_| {});
    stop.store(true, Ordering::SeqCst);
    let sent = hup.join().unwrap();
    let daemon = spawned.unwrap_or_else(|e| panic!("the daemon died of an early SIGHUP: {e}"));
    assert!(sent > 0);
    // Every early SIGHUP is a reload request, applied once serving (coalesced or not).
    while reloads(&daemon, "ok") < 1.0 {
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = tallyd(&path, &["send", "downloads", "k", "4"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "accepted 1, rejected 0\n"
    );
    assert_eq!(count(&path, "downloads", "k"), 4);
    assert!(daemon.terminate().success());
}

/// Pending events across reloads: a counter removed while it has pending events (flushed),
/// then added back (same index, its old key type) and sent to again; another counter's
/// `slots` changed twice while it has pending events; then kill -9 before any timed flush and a
/// restart that replays the journal. Every total is exact: nothing lost, nothing doubled.
#[test]
fn pending_events_survive_remove_readd_slots_change_and_a_kill() {
    let dir = temp_dir();
    let config = base(dir.path(), free_port()).with(|c| {
        c.flush.set_interval(Duration::from_secs(3600));
        c.daemon.set_instance_id(Some("reload-pending".into()));
    });
    let path = install(&config);
    let daemon = spawn_daemon(&path);
    let mut conn = BufReader::new(UnixStream::connect(daemon.socket()).unwrap());
    assert_eq!(ask(&mut conn, "spare0 k 5\ndownloads k 3\n!sync\n"), "ok\n");

    let removed = config.clone().with(|c| {
        c.counters.retain(|c| c.name != "spare0");
        c.counters[0].slots = 3;
    });
    install(&removed);
    daemon.reload("ok");
    let out = tallyd(&path, &["send", "spare0", "k", "1"]);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("accepted 0, rejected 1"), "{text}");
    // The removed counter's pending events were flushed at the reload (read in SQL: the
    // config file no longer names it for `tallyd get`).
    let spare0 = || {
        common::run_sql(
            &path,
            "SELECT coalesce(sum(count), 0)::text FROM tallyd.totals \
             WHERE counter = 'spare0' AND key = 'k'",
        )
        .into_iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(r.get(0).unwrap().to_string()),
            _ => None,
        })
        .unwrap()
    };
    // Polled: the nudged flush commits after the reload is counted (a liveness bound only).
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while spare0() != "5" {
        assert!(
            std::time::Instant::now() < deadline,
            "spare0 k: {}",
            spare0()
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    install(&config.clone().with(|c| c.counters[0].slots = 7));
    daemon.reload("ok");
    assert_eq!(ask(&mut conn, "spare0 k 2\ndownloads k 4\n!sync\n"), "ok\n");
    daemon.kill();
    let daemon = spawn_daemon(&path);
    assert_eq!(count(&path, "spare0", "k"), 7);
    assert_eq!(count(&path, "downloads", "k"), 7);
    assert!(daemon.terminate().success());
}

/// The config file missing at a SIGHUP (mid-deploy, a rename not yet done): the reload is
/// invalid, says why, and the running configuration stays; put back, the next one applies.
#[test]
fn a_missing_config_file_at_reload_changes_nothing() {
    let dir = temp_dir();
    let config = base(dir.path(), free_port());
    let path = install(&config);
    let mut daemon = spawn_daemon(&path);
    std::fs::remove_file(&path).unwrap();
    daemon.reload("invalid");
    assert!(
        daemon.wait_for_log("configuration not reloaded: the file is invalid"),
        "{}",
        daemon.log()
    );
    install(&config.clone().counters(&[("added", KeyTypeName::Text)]));
    daemon.reload("ok");
    let out = tallyd(&path, &["send", "added", "k", "3"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "accepted 1, rejected 0\n"
    );
    assert_eq!(count(&path, "added", "k"), 3);
    assert!(daemon.terminate().success());
}

/// A counter removed (here from the file, as a reload would) while its events are journaled and
/// not yet committed, then kill -9: a start whose config does not declare it refuses, naming the
/// counter and its events, instead of replaying them into `unknown_counter` rejections and
/// deleting the segments (lost). Declared again, the start replays them exactly.
#[test]
fn a_removed_counter_s_journaled_events_refuse_a_start_that_would_drop_them() {
    let dir = temp_dir();
    let config = base(dir.path(), free_port()).with(|c| {
        c.flush.set_interval(Duration::from_secs(3600));
        c.daemon.set_instance_id(Some("reload-undeclared".into()));
    });
    let path = install(&config);
    let daemon = spawn_daemon(&path);
    let mut conn = BufReader::new(UnixStream::connect(daemon.socket()).unwrap());
    assert_eq!(ask(&mut conn, "spare0 k 5\ndownloads k 3\n!sync\n"), "ok\n");
    daemon.kill();

    install(
        &config
            .clone()
            .with(|c| c.counters.retain(|c| c.name != "spare0")),
    );
    match Daemon::try_spawn_with(Path::new(common::BIN), &path, |_| {}) {
        Ok(d) => {
            d.kill();
            panic!("tallyd started and would have dropped spare0's journaled events");
        }
        Err(e) => assert!(
            e.contains("counters this configuration does not declare (spare0: 1 events"),
            "{e}"
        ),
    }

    install(&config);
    let daemon = spawn_daemon(&path);
    assert_eq!(count(&path, "spare0", "k"), 5);
    assert_eq!(count(&path, "downloads", "k"), 3);
    assert!(daemon.terminate().success());
}

/// `tallyd reload` waits for the daemon's verdict: it prints what was applied; it exits 1,
/// naming each refused key and why, when the daemon keeps its running configuration (the
/// first unique counter among them: it needs a restart, the hll extension being checked at
/// start), and when a database refuses a `rollup_into` table; and it says so, after
/// `--timeout`, when the daemon does not answer.
#[test]
fn reload_command_reports_the_daemons_verdict() {
    let dir = temp_dir();
    let config = base(dir.path(), free_port());
    let path = install(&config);
    let daemon = spawn_daemon(&path);
    let text = |out: &std::process::Output| {
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
    };

    let added = config.clone().counters(&[("added", KeyTypeName::Text)]);
    install(&added);
    let out = tallyd(&path, &["reload"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("reloaded by tallyd") && text(&out).contains("counter added added"),
        "{}",
        text(&out)
    );

    let refused = added.clone().with(|c| {
        let mut visitors = common::counter("visitors", KeyTypeName::Text);
        visitors.kind = tallyd::protocol::Kind::Unique;
        c.counters.push(visitors);
        c.listen.set_socket(Some(dir.path().join("other.sock")));
    });
    install(&refused);
    let out = tallyd(&path, &["reload"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    for said in [
        "not reloaded by tallyd",
        "counters.visitors.kind: the first unique counter needs a restart",
        "listen.socket: the sockets are bound at start",
    ] {
        assert!(text(&out).contains(said), "{said:?} in {}", text(&out));
    }
    assert_eq!(reloads(&daemon, "refused"), 1.0);

    // A rollup_into table that does not exist: the daemon finds it invalid.
    install(&added.clone().with(|c| {
        c.counters
            .push(common::counter_into_repositories("repo_downloads"))
    }));
    let out = tallyd(&path, &["reload"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("rollup_into table public.repositories does not exist"),
        "{}",
        text(&out)
    );

    // A daemon that cannot answer (stopped): said so after --timeout, not `ok`.
    daemon.signal(libc::SIGSTOP);
    let out = tallyd(&path, &["reload", "--timeout", "2"]);
    daemon.signal(libc::SIGCONT);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("gave no verdict within 2 s"),
        "{}",
        text(&out)
    );
    assert!(daemon.terminate().success());
}
