//! Journal replay across a layout change (`flush.connections`, `coalesce.buckets`, the shard
//! map). Replay is exactly once only under the layout that wrote the journal: the replay's
//! flushes record their coverage under this run's writer numbers, while the next start judges
//! old lines by the writer numbers of the layout that wrote them. So tallyd refuses to start
//! while the journal holds uncommitted events written under another layout, and the previous
//! settings replay them exactly, even with a crash during that replay (an adversarial review
//! found 99 of 200 or 253 of 200 counted when the replay ran under the new layout).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    buf_of, counter_total, spawn_daemon, sql, temp_dir, Daemon, LineClient, TestConfig, BIN,
};
use tallyd::routing::Layout;

/// The config for `connections` flush connections, in `home/config-<connections>.toml`. Only
/// `!flush`, the replay and the stop flush write: the timer is far away.
fn settings(home: &Path, url: &str, connections: usize) -> TestConfig {
    TestConfig::new(home)
        .standard_counters()
        .fast()
        .database_url(url)
        .with(|c| {
            c.flush.connections = connections;
            c.flush.set_slot_offset(Some(0));
            c.flush.set_interval(Duration::from_millis(600_000));
            c.flush.set_lock_timeout(Some(Duration::from_millis(500)));
        })
}

fn config(home: &Path, url: &str, connections: usize) -> PathBuf {
    settings(home, url, connections).write_as(&format!("config-{connections}.toml"))
}

/// Sends one `views` event per key and waits for `!sync`: durable in the journal.
async fn send_synced(socket: &Path, keys: std::ops::Range<i64>) {
    let mut c = LineClient::connect(socket).await;
    c.send(&buf_of(keys.map(|k| format!("views {k}")))).await;
    c.send(b"!sync\n").await;
    assert_eq!(c.read_line().await, "ok\n");
}

/// Asserts that `tallyd run` with `config` exits at start, naming `change` and the way out.
fn assert_refused(config: &Path, change: &str) {
    match Daemon::try_spawn_with(Path::new(BIN), config, |_| {}) {
        Ok(daemon) => {
            drop(daemon);
            panic!("tallyd started on a journal written with another layout ({change})");
        }
        Err(e) => {
            println!("refused as expected: {e}");
            assert!(e.contains("tallyd run exited early"), "{e}");
            assert!(e.contains("written with another layout"), "{e}");
            assert!(e.contains(change), "names the change: {e}");
            assert!(
                e.contains("Start tallyd once with the previous settings"),
                "says what to do: {e}"
            );
        }
    }
}

/// The writer `layout` sends `views <key>` to.
fn writer_of(layout: &Layout, key: i64) -> usize {
    let seed = tallyd::routing::counter_seed("views");
    let hash = tallyd::routing::key_hash(seed, key.to_string().as_bytes());
    layout.worker_of(layout.bucket(hash))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_written_with_fewer_flush_connections_is_replayed_with_them_first() {
    const N: i64 = 200;
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let url = pg.connection_string("postgres");
    let home = dir.path().join("d");
    std::fs::create_dir_all(&home).unwrap();
    let socket = home.join("tallyd.sock");
    let (one, two) = (config(&home, &url, 1), config(&home, &url, 2));
    let watch = sql(&url).await;

    // Run 1, one flush connection: N events durable in the journal, none flushed, then a crash.
    let daemon = spawn_daemon(&one);
    send_synced(&socket, 0..N).await;
    daemon.kill();

    // Two connections: refused before anything is flushed.
    assert_refused(&two, "flush.connections 1 -> 2");
    assert_eq!(
        counter_total(&watch, "views").await,
        0,
        "the refused start wrote nothing"
    );

    // The previous settings replay the journal; a graceful stop.
    assert!(spawn_daemon(&one).terminate().success());
    assert_eq!(counter_total(&watch, "views").await, N, "replayed once");

    // Now two connections start, journal and replay their own events after a crash.
    let daemon = spawn_daemon(&two);
    send_synced(&socket, N..N + 100).await;
    daemon.kill();
    assert!(spawn_daemon(&two).terminate().success());
    assert_eq!(
        counter_total(&watch, "views").await,
        N + 100,
        "every !sync'd event counted once"
    );
    common::stop_postgres(pg).await;
}

/// The reviewer's other direction, with the crash during the replay moved to the run that uses
/// the journal's own layout: writer 0 commits its share of the replay while writer 1 waits on a
/// row lock, and tallyd is killed then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_during_replay_with_the_journals_own_layout_counts_once() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let url = pg.connection_string("postgres");
    let home = dir.path().join("d");
    std::fs::create_dir_all(&home).unwrap();
    let socket = home.join("tallyd.sock");
    let (one, two) = (config(&home, &url, 1), config(&home, &url, 2));
    let watch = sql(&url).await;

    // Run 1, two flush connections: 100 events committed, 100 more only in the journal.
    let daemon = spawn_daemon(&two);
    let mut c = LineClient::connect(&socket).await;
    c.send(&buf_of((0..100).map(|k| format!("views {k}"))))
        .await;
    assert_eq!(c.flush().await, (100, 0));
    drop(c);
    send_synced(&socket, 100..200).await;
    daemon.kill();

    // One connection: refused, nothing written.
    assert_refused(&one, "flush.connections 2 -> 1");
    assert_eq!(counter_total(&watch, "views").await, 100);

    // Two connections again, with writer 1 held up on one of the replayed keys (slot 1).
    let layout = settings(&home, &url, 2).build().layout();
    let held = (100..200)
        .find(|&k| writer_of(&layout, k) == 1)
        .expect("a replayed key of writer 1");
    assert!((100..200).any(|k| writer_of(&layout, k) == 0));
    let mut locker = sql(&url).await;
    locker
        .batch_execute(&format!(
            "INSERT INTO tallyd.slots (counter, key, slot, count, first_seen, last_seen) \
             VALUES ('views', '{held}', 1, 0, now(), now())"
        ))
        .await
        .unwrap();
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute(&format!(
        "SELECT 1 FROM tallyd.slots WHERE counter = 'views' AND key = '{held}' FOR UPDATE"
    ))
    .await
    .unwrap();
    // Not `spawn_daemon`: it waits for the socket, which is served only after the replay.
    let mut replaying = Command::new(BIN)
        .arg("--config")
        .arg(&two)
        .arg("run")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while counter_total(&watch, "views").await <= 100 {
        assert!(replaying.try_wait().unwrap().is_none(), "the replay exited");
        assert!(Instant::now() < deadline, "writer 0 never committed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        counter_total(&watch, "views").await < 200,
        "writer 1 is still held up"
    );
    replaying.kill().unwrap();
    replaying.wait().unwrap();
    // A crashed host's sessions end too: none may commit once the lock is gone.
    watch
        .batch_execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name LIKE 'tallyd-%' AND pid <> pg_backend_pid()",
        )
        .await
        .unwrap();
    lock.rollback().await.unwrap();

    // The same layout replays the rest exactly; then the new one starts on an empty journal.
    assert!(spawn_daemon(&two).terminate().success());
    assert_eq!(
        counter_total(&watch, "views").await,
        200,
        "every !sync'd event counted once"
    );
    assert!(spawn_daemon(&one).terminate().success());
    assert_eq!(counter_total(&watch, "views").await, 200);
    common::stop_postgres(pg).await;
}
