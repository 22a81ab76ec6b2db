//! Journal replay across a layout change (`flush.connections`, `coalesce.buckets`, the shard
//! map). Replay is exactly once only under the layout that wrote the journal: the replay's
//! flushes record their coverage under this run's writer numbers, while the next start judges
//! old lines by the writer numbers of the layout that wrote them (a replay under the new layout
//! counted 99 or 253 of 200). So tallyd first
//! rewrites the uncommitted lines under the new layout (journal::translate), and replays that:
//! exactly once, even with a crash during the replay, and after `tallyd move-shards` added a
//! database while the journal held events of the old map.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{
    buf_of, counter_total, send_synced, spawn_daemon, sql, tallyd, temp_dir, terminate, Daemon,
    LineClient, Sessions, TestConfig, BIN,
};
use tallyd::routing::{self, Layout};

/// The config for `connections` flush connections, in `home/config-<connections>.toml`. Only
/// `!flush`, the replay and the stop flush write: the timer is far away.
fn settings(home: &Path, url: &str, connections: usize) -> TestConfig {
    TestConfig::new(home)
        .standard_counters()
        .fast()
        .never_flushes()
        .database_url(url)
        .with(|c| {
            c.flush.connections = connections;
            c.flush.set_slot_offset(Some(0));
            c.flush.set_lock_timeout(Some(Duration::from_millis(500)));
        })
}

fn config(home: &Path, url: &str, connections: usize) -> PathBuf {
    settings(home, url, connections).write_as(&format!("config-{connections}.toml"))
}

/// Asserts that `tallyd run` with `config` exits at start, saying `why`.
fn assert_refused(config: &Path, why: &str) {
    match Daemon::try_spawn_with(Path::new(BIN), config, |_| {}) {
        Ok(daemon) => {
            drop(daemon);
            panic!("tallyd started; expected it to refuse: {why}");
        }
        Err(e) => {
            println!("refused as expected: {e}");
            assert!(e.contains("tallyd run exited early"), "{e}");
            assert!(e.contains(why), "{e}");
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
async fn a_journal_written_with_fewer_flush_connections_is_replayed_under_more() {
    const N: i64 = 200;
    let dir = temp_dir();
    let pg = crate::common::postgres(dir.path()).await;
    let url = pg.connection_string("postgres");
    let home = dir.path().join("d");
    std::fs::create_dir_all(&home).unwrap();
    let socket = home.join("tallyd.sock");
    let (one, two) = (config(&home, &url, 1), config(&home, &url, 2));
    let watch = sql(&url).await;

    // Run 1, one flush connection: N events durable in the journal, none flushed, then a crash.
    let daemon = spawn_daemon(&one);
    send_synced(&socket, (0..N).map(|k| format!("views {k}"))).await;
    daemon.kill();

    // Two connections: the journal is rewritten under them and replayed.
    let daemon = spawn_daemon(&two);
    assert!(
        daemon.log().contains("rewritten under this one"),
        "{}",
        daemon.log()
    );
    assert!(daemon.terminate().success());
    assert_eq!(counter_total(&watch, "views").await, N, "replayed once");

    // Two connections journal and replay their own events after a crash; one connection then
    // starts on a journal that two wrote, empty after the clean stop.
    let daemon = spawn_daemon(&two);
    send_synced(&socket, (N..N + 100).map(|k| format!("views {k}"))).await;
    daemon.kill();
    assert!(spawn_daemon(&two).terminate().success());
    assert_eq!(
        counter_total(&watch, "views").await,
        N + 100,
        "every !sync'd event counted once"
    );
    assert!(spawn_daemon(&one).terminate().success());
    assert_eq!(counter_total(&watch, "views").await, N + 100);
    crate::common::stop_postgres(pg).await;
}

/// The reviewer's scenario: a journal of one flush connection replayed with two, where writer 0
/// commits its share of the replay while writer 1 waits on a row lock, and tallyd is killed
/// then (the replay ran on the old lines, so the next start lost 99 of 200 or counted 253).
/// Now the replay runs on the rewritten journal, and the next start, with either layout, counts
/// every event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_during_the_replay_of_a_rewritten_journal_counts_once() {
    let dir = temp_dir();
    let pg = crate::common::postgres(dir.path()).await;
    let url = pg.connection_string("postgres");
    let home = dir.path().join("d");
    std::fs::create_dir_all(&home).unwrap();
    let socket = home.join("tallyd.sock");
    let (one, two) = (config(&home, &url, 1), config(&home, &url, 2));
    let watch = sql(&url).await;

    // Run 1, one flush connection: 100 events committed, 100 more only in the journal.
    let daemon = spawn_daemon(&one);
    let mut c = LineClient::connect(&socket).await;
    c.send(&buf_of((0..100).map(|k| format!("views {k}"))))
        .await;
    assert_eq!(c.flush().await, (100, 0));
    drop(c);
    send_synced(&socket, (100..200).map(|k| format!("views {k}"))).await;
    daemon.kill();

    // Two connections, with writer 1 held up on one of the replayed keys (slot 1).
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
    terminate(&watch, Sessions::Tallyd).await;
    lock.rollback().await.unwrap();

    // One connection: the rest of the rewritten journal is rewritten again and replayed
    // exactly; then two start on an empty journal.
    assert!(spawn_daemon(&one).terminate().success());
    assert_eq!(
        counter_total(&watch, "views").await,
        200,
        "every !sync'd event counted once"
    );
    assert!(spawn_daemon(&two).terminate().success());
    assert_eq!(counter_total(&watch, "views").await, 200);
    crate::common::stop_postgres(pg).await;
}

/// A config on the databases `urls` (one server's), with `move_shards` as given, in
/// `home/<name>.toml`.
fn sharded(home: &Path, urls: &[String], move_shards: bool, name: &str) -> (PathBuf, Layout) {
    let test = TestConfig::new(home)
        .standard_counters()
        .fast()
        .never_flushes()
        .with(|c| {
            c.database.shards = urls.to_vec();
            c.database.move_shards = move_shards;
        });
    let layout = test.clone().build().layout();
    (test.write_as(&format!("{name}.toml")), layout)
}

/// Per database: the logical shards it records, and its `views` totals.
async fn fleet(urls: &[String]) -> Vec<(HashSet<i32>, HashMap<String, i64>)> {
    let mut out = Vec::new();
    for url in urls {
        let client = sql(url).await;
        let shards = client
            .query("SELECT shard FROM tallyd.shards", &[])
            .await
            .unwrap();
        let totals = client
            .query(
                "SELECT key, count FROM tallyd.totals WHERE counter = 'views'",
                &[],
            )
            .await
            .unwrap();
        out.push((
            shards.iter().map(|r| r.get(0)).collect(),
            totals.iter().map(|r| (r.get(0), r.get(1))).collect(),
        ));
    }
    out
}

/// docs/reliability.md: after a crash, `tallyd move-shards` adds a database while the journal
/// still holds events journaled under the old map. The recovery the docs gave before (the old
/// map with `move_shards = true`) moved 80 shards back and then failed, since the old map
/// cannot name the new database; it must now be refused before anything moves. The recovery the
/// docs give now, a start with the new settings, replays every event once, onto the database
/// its shard now maps to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_move_shards_added_a_database_the_old_maps_journal_replays_under_the_new_one() {
    const N: i64 = 3000;
    let dir = temp_dir();
    let pg = crate::common::postgres(dir.path()).await;
    let urls = crate::common::create_databases(&pg, 3).await;
    let home = dir.path().join("d");
    std::fs::create_dir_all(&home).unwrap();
    let socket = home.join("tallyd.sock");
    let (two, _) = sharded(&home, &urls[..2], false, "two");
    let (two_moving, _) = sharded(&home, &urls[..2], true, "two-moving");
    let (three, layout) = sharded(&home, &urls, false, "three");

    // Two databases: 1,000 events committed, N more only in the journal, then a crash.
    let daemon = spawn_daemon(&two);
    let mut c = LineClient::connect(&socket).await;
    c.send(&buf_of((0..1000).map(|k| format!("views {k}"))))
        .await;
    assert_eq!(c.flush().await, (1000, 0));
    drop(c);
    send_synced(&socket, (1000..1000 + N).map(|k| format!("views {k}"))).await;
    daemon.kill();

    // The third database is added with `tallyd move-shards`.
    let out = tallyd(&three, &["move-shards"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "moved 240 logical shards\n"
    );
    let moved = fleet(&urls).await;

    // The old map with move_shards: refused, and nothing changed.
    assert_refused(
        &two_moving,
        "logical shards 320-479 (of 480) are recorded in none of the 2 configured databases",
    );
    assert_eq!(fleet(&urls).await, moved, "the refused start moved nothing");

    // The new settings: the journal is rewritten under the new map and replayed.
    let daemon = spawn_daemon(&three);
    assert!(
        daemon.log().contains("rewritten under this one"),
        "{}",
        daemon.log()
    );
    assert!(daemon.terminate().success());
    let seed = routing::counter_seed("views");
    let mut seen = 0;
    for (db, (owned, totals)) in fleet(&urls).await.into_iter().enumerate() {
        assert_eq!(owned.len(), 160, "database {db} owns its share");
        for (key, count) in &totals {
            let hash = routing::key_hash(seed, key.as_bytes());
            assert_eq!(layout.database(hash), db, "key {key} on database {db}");
            assert_eq!(*count, 1, "key {key} counted once");
        }
        seen += totals.len() as i64;
    }
    assert_eq!(seen, 1000 + N, "every event, once");
    crate::common::stop_postgres(pg).await;
}
