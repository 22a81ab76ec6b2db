//! Corrections through crashes: a forgotten key stays gone through kill -9 at every point of
//! its `!forget` (before its answer while its flush waits on a lock, right after, at once after
//! it was written), with the key's old increments committed and in the journal, under another
//! flush layout too; and a `!set` among records spilled at the memory cap supersedes exactly the
//! increments before it, also when the daemon is killed while the set waits for the database.

use std::time::{Duration, Instant};

use tokio_postgres::Client;

use crate::common::{
    buf_of, count_of, free_port, key_total, postgres, rows_of, scalar, spawn_daemon, sql, temp_dir,
    LineClient, Sessions, TestConfig,
};
use crate::journaled_config;

const GONE: &str = "10.0.0.1";

/// The keys besides the forgotten one, with what each must total.
struct Others(Vec<(&'static str, &'static str, i64)>);

impl Others {
    fn lines(&mut self, n: usize) -> Vec<String> {
        let mut out = Vec::new();
        for (counter, key, total) in &mut self.0 {
            for _ in 0..n {
                out.push(format!("{counter} {key} 3"));
                *total += 3;
            }
        }
        out
    }

    async fn assert(&self, client: &Client, what: &str) {
        for (counter, key, total) in &self.0 {
            assert_eq!(
                count_of(client, counter, key).await,
                Some(*total),
                "{what}: {counter} {key}"
            );
        }
    }
}

async fn assert_gone(client: &Client, what: &str) {
    for counter in ["ips", "downloads"] {
        assert_eq!(rows_of(client, counter, GONE).await, 0, "{what}: {counter}");
    }
}

/// Old increments of the key, committed and only journaled, then `!forget * <key>` with kill -9
/// at several points: before its answer while its flush waits on a lock (its record journaled,
/// the flush's backend terminated too, or left to end by itself), right after its answer, and at
/// once after it was written; each restart replays a journal holding the old increments, and
/// the key stays gone (or, where the forget died unanswered, holds exactly its old total).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_key_stays_gone_through_kill_9_at_every_point() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    // Nothing commits unless a `!flush` or a correction asks.
    let config = journaled_config(dir.path(), &conninfo, Duration::from_secs(600), 2);
    let client = sql(&conninfo).await;
    let socket = dir.path().join("tallyd.sock");
    let mut others = Others(vec![
        ("ips", "10.0.0.2", 0),
        ("downloads", "10.0.0.2", 0),
        ("downloads", "other", 0),
    ]);
    let mut daemon = spawn_daemon(&config);

    // Old increments: committed, then only journaled.
    let old = |n: usize| -> Vec<String> {
        (0..n)
            .flat_map(|_| [format!("ips {GONE} 2"), format!("downloads {GONE} 5")])
            .collect()
    };
    let mut c = LineClient::connect(&socket).await;
    for sync in [false, true] {
        let mut lines = old(50);
        lines.extend(others.lines(20));
        c.send(&buf_of(lines)).await;
        if sync {
            c.send(b"!sync\n").await;
            assert_eq!(c.read_line().await, "ok\n");
        } else {
            assert_eq!(c.flush().await, (160, 0));
        }
    }

    for terminate in [true, false] {
        // Left alone, the backend runs the flush's pipelined statements once the lock is gone,
        // and PostgreSQL ends it when it cannot answer ("connection to client lost").
        let what = if terminate {
            "unanswered, its flush's backend terminated"
        } else {
            "unanswered, its flush's backend left to end by itself"
        };
        // The forget's flush waits on a lock; its record is journaled and synced.
        let mut locker = sql(&conninfo).await;
        let tx = locker.transaction().await.unwrap();
        tx.batch_execute("LOCK TABLE tallyd.slots IN SHARE MODE")
            .await
            .unwrap();
        c.send(format!("!forget * {GONE}\n").as_bytes()).await;
        wait_for_correct_on_lock(&client).await;
        let mut s = LineClient::connect(&socket).await;
        s.send(b"!sync\n").await;
        assert_eq!(s.read_line().await, "ok\n");
        daemon.kill();
        if terminate {
            crate::common::terminate(&client, Sessions::Tallyd).await;
        }
        tx.rollback().await.unwrap();
        if !terminate {
            // Under another layout: the start rewrites the journal's uncovered lines, the
            // forget among them, for three writers before it replays them.
            journaled_config(dir.path(), &conninfo, Duration::from_secs(600), 3);
        }
        daemon = spawn_daemon(&config);
        assert_gone(&client, what).await;
        others.assert(&client, what).await;
        // The old increments again, for the next point.
        c = LineClient::connect(&socket).await;
        let mut lines = old(30);
        lines.extend(others.lines(10));
        c.send(&buf_of(lines)).await;
        c.send(b"!sync\n").await;
        assert_eq!(c.read_line().await, "ok\n");
    }

    // Answered, then kill -9 at once; then a second crash right after the replay.
    c.send(format!("!forget * {GONE}\n").as_bytes()).await;
    assert_eq!(c.read_line().await, "ok\n");
    daemon.kill();
    daemon = spawn_daemon(&config);
    assert_gone(&client, "answered").await;
    others.assert(&client, "answered").await;
    daemon.kill();
    daemon = spawn_daemon(&config);
    assert_gone(&client, "answered, crashed twice").await;
    others.assert(&client, "answered, crashed twice").await;

    // Increments after an answered forget count, and only they.
    let mut c = LineClient::connect(&socket).await;
    c.send(&buf_of(old(10))).await;
    c.send(format!("!forget ips {GONE}\n").as_bytes()).await;
    assert_eq!(c.read_line().await, "ok\n");
    c.send(format!("ips {GONE} 7\n!sync\n").as_bytes()).await;
    assert_eq!(c.read_line().await, "ok\n");
    daemon.kill();
    daemon = spawn_daemon(&config);
    assert_eq!(count_of(&client, "ips", GONE).await, Some(7));
    assert_eq!(count_of(&client, "downloads", GONE).await, Some(50));
    others.assert(&client, "after a forget").await;

    // Written, then kill -9 at once, unanswered: the key is gone or holds exactly its old
    // total (the forget was lost with the daemon), never a part of it.
    let mut c = LineClient::connect(&socket).await;
    let mut lines = others.lines(5);
    lines.extend(old(20));
    c.send(&buf_of(lines)).await;
    c.send(b"!sync\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    c.send(format!("!forget * {GONE}\n").as_bytes()).await;
    daemon.kill();
    daemon = spawn_daemon(&config);
    let ips = count_of(&client, "ips", GONE).await;
    let downloads = count_of(&client, "downloads", GONE).await;
    assert!(
        (ips, downloads) == (None, None)
            || (ips, downloads) == (Some(7 + 2 * 20), Some(50 + 5 * 20)),
        "killed at once: {ips:?} {downloads:?}"
    );
    others.assert(&client, "killed at once").await;
    for line in daemon
        .log()
        .lines()
        .filter(|l| l.contains("replaying the journal"))
    {
        println!("{line}");
    }
    assert!(
        daemon.log().contains("flush.connections 2 -> 3"),
        "the journal was translated to the new layout"
    );
    daemon.terminate();
}

/// Waits until a flush's `tallyd.correct` waits on a lock (the forget is drained, so its record
/// is journaled).
async fn wait_for_correct_on_lock(client: &Client) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while scalar(
        client,
        "SELECT count(*) FROM pg_stat_activity \
         WHERE query LIKE '%tallyd.correct(%' AND wait_event_type = 'Lock' \
           AND pid <> pg_backend_pid()",
    )
    .await
        == 0
    {
        assert!(Instant::now() < deadline, "no flush waits on the lock");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// With the database down and a memory cap of 200 keys, a connection's records spill to the
/// journal and are folded back in order once the database returns: a `!set` among them
/// supersedes exactly the increments before it. Then the same with kill -9 while the set waits
/// for the database: after the restart the key holds either all of its increments (the set's
/// read was never journaled) or the set's value plus what followed it, nothing between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_in_spilled_records_at_the_memory_cap_is_exact() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let port = free_port();
    let config = TestConfig::new(dir.path())
        .external(&conninfo, "spill")
        .standard_counters()
        .metrics_port(port)
        .with(|c| {
            c.coalesce.max_pending_keys = 200;
            c.flush.max_pending_keys = 100;
            c.flush.set_retry_max(Duration::from_millis(200));
        })
        .write();
    let socket = dir.path().join("tallyd.sock");
    let mut daemon = spawn_daemon(&config);
    let mut pg = Some(pg);
    let distinct = |from: usize, to: usize, tag: &str| -> Vec<String> {
        (from..to)
            .map(|i| format!("downloads {tag}{i} 1"))
            .collect()
    };
    for kill in [false, true] {
        let tag = if kill { "killed" } else { "spilled" };
        let key = format!("hot-{tag}");
        crate::common::stop_postgres_immediate(pg.take().unwrap()).await;
        let mut c = LineClient::connect(&socket).await;
        let mut lines = distinct(0, 1000, tag);
        lines.extend((0..10).map(|_| format!("downloads {key} 5")));
        lines.push("!sync".into());
        c.send(&buf_of(lines)).await;
        assert_eq!(c.read_line().await, "ok\n");
        let mut lines = vec![format!("!set downloads {key} 7")];
        lines.extend((0..3).map(|_| format!("downloads {key} 1")));
        lines.extend(distinct(1000, 1300, tag));
        c.send(&buf_of(lines)).await;
        if kill {
            // The set waits for the database; its read may or may not be journaled yet.
            tokio::time::sleep(Duration::from_millis(200)).await;
            daemon.kill();
            pg = Some(postgres(dir.path()).await);
            daemon = spawn_daemon(&config);
        } else {
            tokio::time::sleep(Duration::from_millis(500)).await;
            pg = Some(postgres(dir.path()).await);
            assert_eq!(c.read_line().await, "ok\n");
            assert_eq!(c.flush().await, (1313, 0));
            let spilled = daemon.scrape().value("tallyd_journal_spilled_events_total");
            assert!(spilled > 0.0, "the records must spill ({spilled})");
        }
        let client = sql(&conninfo).await;
        let hot = key_total(&client, "downloads", &key).await;
        let keys = scalar(
            &client,
            &format!(
                "SELECT count(*) FROM tallyd.totals WHERE counter = 'downloads' \
                 AND key LIKE '{tag}%' AND count = 1"
            ),
        )
        .await;
        if kill {
            assert!(
                (hot, keys) == (50, 1000) || (hot, keys) == (10, 1300),
                "{tag}: {hot} for the set key, {keys} keys"
            );
            println!("killed while the set waited: {hot} for the set key, {keys} keys");
        } else {
            assert_eq!((hot, keys), (10, 1300), "{tag}");
        }
    }
    daemon.terminate();
}
