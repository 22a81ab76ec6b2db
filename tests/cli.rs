//! The `tallyd` binary as a user runs it: `run` on a private PostgreSQL, `send`, `get`,
//! `rollup`, `check-config`, signals, and socket files.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{free_port, spawn_daemon, tallyd, temp_dir, TestConfig, BIN};
use tallyd::config::KeyTypeName;

/// The CLI tests' config: tallyd's defaults (in the test's directory), with `downloads`
/// (text) and `ips` (inet).
fn cli_config(dir: &Path) -> TestConfig {
    TestConfig::new(dir).counters(&[("downloads", KeyTypeName::Text), ("ips", KeyTypeName::Inet)])
}

/// `cli_config` without the daemon's rollup schedule, as docs/operations.md ("Rollup") says to
/// run when `tallyd rollup` comes from cron: then the count it prints is every slot row folded.
/// With the schedule on (every 10 s, and once at start), a slow run let the daemon fold the rows
/// first, or hold them while `tallyd rollup` skipped them (SKIP LOCKED): "folded 0 slot rows".
fn write_config(dir: &Path) -> PathBuf {
    cli_config(dir).with(|c| c.rollup.enabled = false).write()
}

/// `tallyd send -` with `lines` on its standard input.
fn send_stdin(config: &Path, lines: &[u8]) -> Output {
    use std::io::Write;
    let mut send = Command::new(BIN)
        .arg("--config")
        .arg(config)
        .args(["send", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    send.stdin.take().unwrap().write_all(lines).unwrap();
    send.wait_with_output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Each rejected line with its reason, and for a bad key the key type its counter takes.
#[test]
fn send_reports_why_each_line_was_rejected() {
    let dir = temp_dir();
    let config = write_config(dir.path());
    let daemon = spawn_daemon(&config);
    let long = format!("nope {}", "y".repeat(80));
    let lines = format!("downloads a\nnope k\nips 10.0.0.300\ndownloads a 2\n{long}\n");
    let out = send_stdin(&config, lines.as_bytes());
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_eq!(stdout(&out), "accepted 2, rejected 3\n");
    assert_eq!(
        stderr(&out),
        format!(
            "rejected 2: unknown_counter \"nope k\"\n\
             rejected 3: bad_key \"ips 10.0.0.300\": counter ips takes inet keys (an IPv4 or IPv6 \
             address such as 203.0.113.7): key_type = \"inet\"\n\
             rejected 5: unknown_counter \"{}\"...\n",
            &long[..64]
        )
    );
    // Nothing rejected: nothing on stderr, exit 0.
    let out = send_stdin(&config, b"downloads a\n");
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        (stdout(&out).as_str(), stderr(&out).as_str()),
        ("accepted 1, rejected 0\n", "")
    );
    assert!(daemon.terminate().success());
}

#[test]
fn run_send_get_rollup_and_stop() {
    let dir = temp_dir();
    let config = write_config(dir.path());
    let socket = dir.path().join("tallyd.sock");
    let daemon = spawn_daemon(&config);

    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660, "default socket mode");

    let out = tallyd(&config, &["send", "downloads", "report.pdf", "5"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "accepted 1, rejected 0\n");

    let out = send_stdin(
        &config,
        b"downloads report.pdf\nips 2001:DB8::1 @1700000000000\nnope x\n",
    );
    assert_eq!(
        out.status.code(),
        Some(2),
        "a rejected line makes send exit 2"
    );
    assert_eq!(stdout(&out), "accepted 2, rejected 1\n");

    let out = tallyd(&config, &["get", "downloads", "report.pdf"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with("downloads report.pdf count=6 "),
        "{}",
        stdout(&out)
    );
    // The key is canonicalised by the same rules as the protocol.
    let out = tallyd(&config, &["get", "ips", "2001:db8:0:0:0:0:0:1"]);
    assert_eq!(
        stdout(&out),
        "ips 2001:db8::1 count=1 first_seen=2023-11-14T22:13:20.000Z last_seen=2023-11-14T22:13:20.000Z\n"
    );
    let out = tallyd(&config, &["get", "downloads", "never-sent"]);
    assert_eq!(stdout(&out), "downloads never-sent count=0\n");

    let out = tallyd(&config, &["rollup", "--until-empty"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "folded 2 slot rows\n");
    let out = tallyd(&config, &["get", "downloads", "report.pdf"]);
    assert!(
        stdout(&out).starts_with("downloads report.pdf count=6 "),
        "after rollup: {}",
        stdout(&out)
    );

    let out = tallyd(&config, &["migrate"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // A second daemon on the same data_dir is refused (before it touches the sockets or the
    // private cluster), the first keeps working.
    let out = tallyd(&config, &["run"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("another tallyd is running on this data_dir"),
        "{}",
        stderr(&out)
    );
    // So is one on another data_dir but the same sockets.
    let other = dir.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    let other_config = cli_config(dir.path())
        .with(|c| c.daemon.data_dir = other.join("data"))
        .write_as("other/config.toml");
    let out = tallyd(&other_config, &["run"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("another tallyd is listening"),
        "{}",
        stderr(&out)
    );
    assert!(tallyd(&config, &["send", "downloads", "report.pdf"])
        .status
        .success());

    let status = daemon.terminate();
    assert!(status.success(), "graceful stop exits 0, got {status}");
    assert!(!socket.exists(), "socket file removed on exit");
    let pid_file = dir.path().join("data/postgres/pgdata/postmaster.pid");
    assert!(!pid_file.exists(), "private PostgreSQL stopped");

    // Restart: the private cluster is reused and the data is still there.
    let daemon = spawn_daemon(&config);
    let out = tallyd(&config, &["get", "downloads", "report.pdf"]);
    assert!(
        stdout(&out).starts_with("downloads report.pdf count=7 "),
        "{}",
        stdout(&out)
    );
    assert!(daemon.terminate().success());
}

#[test]
fn stale_socket_is_replaced_and_mode_is_configurable() {
    let dir = temp_dir();
    let config = cli_config(dir.path())
        .with(|c| c.listen.socket_mode = "0600".into())
        .write();
    let socket = dir.path().join("tallyd.sock");
    // A socket file left behind by a crashed process.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    assert!(socket.exists());
    let daemon = spawn_daemon(&config);
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert!(tallyd(&config, &["send", "downloads", "x"])
        .status
        .success());
    assert!(daemon.terminate().success());
}

#[test]
fn refuses_to_replace_a_file_or_symlink_at_the_socket_path() {
    let dir = temp_dir();
    let config = write_config(dir.path());
    let socket = dir.path().join("tallyd.sock");
    let target = dir.path().join("precious");
    std::fs::write(&target, "keep me").unwrap();
    std::os::unix::fs::symlink(&target, &socket).unwrap();
    let out = tallyd(&config, &["run"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("not a socket"), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me");
}

/// `TZDIR` naming an empty directory is reported, not passed over for the system's zone files
/// (before: `check-config` said the configuration was valid, and days were cut by the system's
/// Berlin); a zone file that is damaged is reported as damaged, not as "no such zone".
#[test]
fn an_empty_tzdir_and_a_damaged_zone_file_are_reported() {
    let dir = temp_dir();
    let config = TestConfig::new(dir.path())
        .with(|c| {
            c.counters = vec![common::windowed_counter(
                "daily",
                "day",
                "Europe/Berlin",
                &[],
            )]
        })
        .write();
    let check = |tzdir: &Path| {
        Command::new(BIN)
            .arg("--config")
            .arg(&config)
            .arg("check-config")
            .env("TZDIR", tzdir)
            .output()
            .expect("run tallyd")
    };
    let empty = dir.path().join("empty-zoneinfo");
    std::fs::create_dir(&empty).unwrap();
    let out = check(&empty);
    assert!(!out.status.success(), "accepted: {}", stdout(&out));
    let expected = format!("TZDIR={} holds no zone database", empty.display());
    assert!(stderr(&out).contains(&expected), "{}", stderr(&out));

    let damaged = dir.path().join("damaged-zoneinfo");
    std::fs::create_dir_all(damaged.join("Europe")).unwrap();
    let berlin = std::fs::read("/usr/share/zoneinfo/Europe/Berlin").unwrap();
    std::fs::write(
        damaged.join("UTC"),
        std::fs::read("/usr/share/zoneinfo/UTC").unwrap(),
    )
    .unwrap();
    std::fs::write(damaged.join("Europe/Berlin"), &berlin[..40]).unwrap();
    let out = check(&damaged);
    assert!(!out.status.success(), "accepted: {}", stdout(&out));
    let expected = format!("{} is damaged: ", damaged.join("Europe/Berlin").display());
    assert!(stderr(&out).contains(&expected), "{}", stderr(&out));

    std::fs::write(damaged.join("Europe/Berlin"), &berlin).unwrap();
    let out = check(&damaged);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn check_config_names_the_bad_key() {
    let dir = temp_dir();
    let good = write_config(dir.path());
    let out = tallyd(&good, &["check-config"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let bad = cli_config(dir.path())
        .with(|c| c.listen.max_line_bytes = 1)
        .write();
    let out = tallyd(&bad, &["check-config"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("listen.max_line_bytes"),
        "{}",
        stderr(&out)
    );
    // A typo is a mistake in the file's text, so this one is written as text.
    let typo = dir.path().join("typo.toml");
    std::fs::write(&typo, "[listen]\nmax_line_byte = 100\n").unwrap();
    let out = tallyd(&typo, &["check-config"]);
    assert!(
        stderr(&out).contains("unknown field `max_line_byte`"),
        "{}",
        stderr(&out)
    );
    // The shipped config is valid.
    let out = tallyd(
        Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/config.toml")),
        &["check-config"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn private_clusters_per_shard_and_get_routes_by_key() {
    let dir = temp_dir();
    // Two private clusters, data_dir/postgres-0 and -1, with the even split of 480 shards.
    let config = cli_config(dir.path())
        .with(|c| c.database.shards = vec!["embedded".into(); 2])
        .write();
    let daemon = spawn_daemon(&config);
    let lines: String = (0..200)
        .map(|k| format!("downloads key{k} {}\n", k + 1))
        .collect();
    let out = send_stdin(&config, lines.as_bytes());
    assert_eq!(stdout(&out), "accepted 200, rejected 0\n");
    for k in [0, 7, 99, 150, 199] {
        let out = tallyd(&config, &["get", "downloads", &format!("key{k}")]);
        assert!(
            stdout(&out).starts_with(&format!("downloads key{k} count={} ", k + 1)),
            "{}{}",
            stdout(&out),
            stderr(&out)
        );
    }
    for i in 0..2 {
        assert!(dir
            .path()
            .join(format!("data/postgres-{i}/pgdata/PG_VERSION"))
            .exists());
    }
    assert!(daemon.terminate().success());
}

#[test]
fn move_shards_after_adding_a_private_cluster() {
    let dir = temp_dir();
    let with_shards = |n: usize| {
        cli_config(dir.path())
            .with(|c| c.database.shards = vec!["embedded".into(); n])
            .write()
    };
    let config = with_shards(2);
    send_moved_keys(&config);

    // A third database: the recorded map disagrees, so `run` refuses until the shards move.
    with_shards(3);
    let out = tallyd(&config, &["run"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("differ"), "{}", stderr(&out));
    let out = tallyd(&config, &["move-shards"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // The default even split is contiguous ranges: 2 -> 3 moves 80 + 160 of the 480 shards.
    assert_eq!(stdout(&out), "moved 240 logical shards\n");
    let out = tallyd(&config, &["move-shards"]);
    assert_eq!(
        stdout(&out),
        "moved 0 logical shards\n",
        "a second run has nothing to do"
    );

    assert_moved_keys(&config);
}

/// Starts the daemon, sends the move tests' 300 events `downloads m<k> <k+1>` and stops it.
fn send_moved_keys(config: &Path) {
    let daemon = spawn_daemon(config);
    let lines: String = (0..300)
        .map(|k| format!("downloads m{k} {}\n", k + 1))
        .collect();
    assert_eq!(
        stdout(&send_stdin(config, lines.as_bytes())),
        "accepted 300, rejected 0\n"
    );
    assert!(daemon.terminate().success());
}

/// Starts the daemon and reads back some of the 300 `downloads m<k> <k+1>` events the move
/// tests send, each from the database its shard maps to now.
fn assert_moved_keys(config: &Path) {
    let daemon = spawn_daemon(config);
    for k in [0, 1, 2, 50, 150, 299] {
        let out = tallyd(config, &["get", "downloads", &format!("m{k}")]);
        assert!(
            stdout(&out).starts_with(&format!("downloads m{k} count={} ", k + 1)),
            "{}{}",
            stdout(&out),
            stderr(&out)
        );
    }
    assert!(daemon.terminate().success());
}

/// Several `tallyd migrate` started at once on one empty database all succeed: they take turns
/// on the migration lock before anything creates the schema. To make the race certain, the test
/// plays a tallyd caught midway through migrating (holding the lock, its schema not yet
/// committed) while the others start; before the fix they created the schema without the lock,
/// waited on the uncommitted one and failed with a unique violation on pg_namespace.
#[test]
fn simultaneous_migrations_on_an_empty_database_all_succeed() {
    const PROCESSES: usize = 4;
    let dir = temp_dir();
    let pg = common::start_postgres(dir.path());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let connect = |name: &str| runtime.block_on(common::sql(&pg.connection_string(name)));
    runtime
        .block_on(connect("postgres").batch_execute("CREATE DATABASE fresh"))
        .unwrap();
    let first = connect("fresh");
    runtime
        .block_on(first.batch_execute(&format!(
            "SELECT pg_advisory_lock({}); BEGIN; CREATE SCHEMA tallyd",
            tallyd::store::MIGRATION_LOCK
        )))
        .unwrap();
    let children: Vec<_> = (0..PROCESSES)
        .map(|i| {
            let sub = dir.path().join(format!("m{i}"));
            std::fs::create_dir_all(&sub).unwrap();
            let url = pg.connection_string("fresh");
            let config = cli_config(&sub).database_url(&url).write();
            Command::new(BIN)
                .arg("--config")
                .arg(config)
                .arg("migrate")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // Every one of them waits (on the lock now; on the schema before the fix).
    let watch = connect("postgres");
    loop {
        let waiting: i64 = runtime
            .block_on(watch.query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = 'fresh' AND wait_event_type = 'Lock'",
                &[],
            ))
            .unwrap()
            .get(0);
        if waiting == PROCESSES as i64 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    runtime
        .block_on(first.batch_execute(&format!(
            "ROLLBACK; SELECT pg_advisory_unlock({})",
            tallyd::store::MIGRATION_LOCK
        )))
        .unwrap();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(stdout(&out), "migrations applied\n");
    }
    pg.stop().unwrap();
}

/// `tallyd move-shards` between three databases of ONE PostgreSQL server (two-phase ids are
/// global to a server: before, the second PREPARE failed with "transaction identifier ... is
/// already in use" and the next run refused with "fix by hand").
#[test]
fn move_shards_between_databases_of_one_server() {
    let dir = temp_dir();
    let pg = common::start_postgres(dir.path());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let urls = runtime.block_on(common::create_databases(&pg, 3));
    let shards = |n: usize| {
        cli_config(dir.path())
            .with(|c| c.database.shards = urls[..n].to_vec())
            .write()
    };
    let config = shards(2);
    send_moved_keys(&config);

    let config = shards(3);
    let out = tallyd(&config, &["move-shards"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "moved 240 logical shards\n");
    assert_moved_keys(&config);
    pg.stop().unwrap();
}

#[test]
fn sighup_reloads_without_a_stop_and_nothing_is_lost() {
    let dir = temp_dir();
    // Without the journal, an ungraceful end would lose what is accepted but not committed.
    let config = cli_config(dir.path())
        .with(|c| c.journal.enabled = false)
        .write();
    let socket = dir.path().join("tallyd.sock");
    let mut daemon = spawn_daemon(&config);
    let out = tallyd(&config, &["send", "downloads", "hup", "5"]);
    assert_eq!(stdout(&out), "accepted 1, rejected 0\n", "{}", stderr(&out));

    daemon.signal(libc::SIGHUP);
    // The file is unchanged: a reload that changes nothing (and no stop).
    assert!(
        daemon.wait_for_log("configuration reloaded: nothing changed"),
        "SIGHUP ended the daemon"
    );

    let out = tallyd(&config, &["send", "downloads", "hup", "3"]);
    assert_eq!(stdout(&out), "accepted 1, rejected 0\n", "{}", stderr(&out));
    let out = tallyd(&config, &["get", "downloads", "hup"]);
    assert!(
        stdout(&out).starts_with("downloads hup count=8 "),
        "{}",
        stdout(&out)
    );
    let status = daemon.terminate();
    assert!(status.success(), "graceful stop exits 0, got {status}");
    assert!(!socket.exists(), "socket file removed on exit");
}

#[test]
fn busy_data_dir_is_named_before_the_metrics_port() {
    let dir = temp_dir();
    let config = cli_config(dir.path()).metrics_port(free_port()).write();
    let daemon = spawn_daemon(&config);
    let out = tallyd(&config, &["run"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("another tallyd is running on this data_dir"),
        "{err}"
    );
    assert!(
        err.contains(&format!("{}/data", dir.path().display())),
        "{err}"
    );
    assert!(!err.contains("in use"), "{err}");
    assert!(tallyd(&config, &["send", "downloads", "x"])
        .status
        .success());
    assert!(daemon.terminate().success());
}

#[test]
fn data_dir_that_is_a_file_is_named() {
    let dir = temp_dir();
    let config = write_config(dir.path());
    std::fs::write(dir.path().join("data"), "not a directory").unwrap();
    let out = tallyd(&config, &["run"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "daemon.data_dir {}/data exists and is not a directory",
            dir.path().display()
        )),
        "{err}"
    );
    assert!(!dir.path().join("tallyd.sock").exists(), "nothing bound");
}

#[test]
fn check_config_rejects_socket_paths_too_long_for_the_os() {
    let dir = temp_dir();
    let long = format!("{}/{}", dir.path().display(), "s".repeat(110));
    for key in ["socket", "datagram_socket"] {
        let config = cli_config(dir.path())
            .with(|c| match key {
                "socket" => c.listen.set_socket(Some(long.clone().into())),
                _ => c.listen.set_datagram_socket(Some(long.clone().into())),
            })
            .write();
        let out = tallyd(&config, &["check-config"]);
        assert!(!out.status.success(), "{key}: {}", stdout(&out));
        let err = stderr(&out);
        assert!(err.contains(&format!("listen.{key}")), "{err}");
        assert!(err.contains("shorter than 108 bytes"), "{err}");
    }
    // 107 bytes plus the NUL fit.
    let fits = format!("{}/", dir.path().display());
    let fits = format!("{fits}{}", "s".repeat(107 - fits.len()));
    let config = cli_config(dir.path())
        .with(|c| c.listen.set_socket(Some(fits.into())))
        .write();
    let out = tallyd(&config, &["check-config"]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn rollup_reports_a_key_held_back_beyond_64_bits_and_exits_0() {
    let dir = temp_dir();
    let config = write_config(dir.path());
    let daemon = spawn_daemon(&config);
    let max = i64::MAX.to_string();
    let out = tallyd(&config, &["send", "downloads", "huge", &max]);
    assert_eq!(stdout(&out), "accepted 1, rejected 0\n", "{}", stderr(&out));
    let out = tallyd(&config, &["rollup", "--until-empty"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = send_stdin(&config, b"downloads huge 1\ndownloads other 2\n");
    assert_eq!(stdout(&out), "accepted 2, rejected 0\n");

    let out = tallyd(&config, &["rollup", "--until-empty"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(
            "held back downloads \"huge\": its total (9223372036854775808) would leave the 64-bit range"
        ),
        "{}",
        stdout(&out)
    );
    let out = tallyd(&config, &["get", "downloads", "huge"]);
    assert!(
        stdout(&out).starts_with("downloads huge count=9223372036854775808 "),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    let out = tallyd(&config, &["get", "downloads", "other"]);
    assert!(
        stdout(&out).starts_with("downloads other count=2 "),
        "{}",
        stdout(&out)
    );
    assert!(daemon.terminate().success());
}
