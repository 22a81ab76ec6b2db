//! Corrections (`!set`, `!forget`, `tallyd set`, `tallyd forget`, `tallyd.forget()`) against
//! real PostgreSQL: exact totals against what each test sent, in the order the daemon accepted
//! it, through restarts, kill -9 and a second instance. The modules: `race` (a set at a random
//! moment among increments of several connections supersedes exactly what came before it:
//! beside a rollup loop, through kill -9, PgBouncer and two instances), `crashes` (a forgotten
//! key stays gone through kill -9 at every point; a set among records spilled at the memory
//! cap), `refusals` (hostile corrections, a counter a reload removed, `/status`), `kinds` (max,
//! min, last and windowed counters). Sets and forgets under every fault: tests/faults.

#[path = "../common/mod.rs"]
mod common;
mod crashes;
mod into;
mod kinds;
mod race;
mod refusals;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{
    buf_of, count_of, kind_counter, rows_of_key, windows_of, Harness, LineClient, TestConfig,
};

/// The config of a `tallyd run` child in `dir` on `conninfo`: the standard counters, its
/// journal, `connections` flush connections flushing every `flush_every`.
fn journaled_config(
    dir: &Path,
    conninfo: &str,
    flush_every: Duration,
    connections: usize,
) -> PathBuf {
    TestConfig::new(dir)
        .external(conninfo, "corrections")
        .standard_counters()
        .with(|c| {
            c.flush.connections = connections;
            c.flush.set_interval(flush_every);
            c.flush.set_retry_initial(Duration::from_millis(20));
            c.flush.set_retry_max(Duration::from_millis(500));
        })
        .write()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_supersedes_what_came_before_and_keeps_what_came_after() {
    let h = Harness::start(|_| {}).await;
    let client = h.sql().await;
    let mut c = h.client().await;
    // Committed, then pending in memory, then the set, then more: all on one connection, so
    // the order is the order sent.
    c.send(&buf_of((0..50).map(|_| "downloads k 3".to_string())))
        .await;
    assert_eq!(c.flush().await, (50, 0));
    client
        .query_one("SELECT tallyd.rollup(1000)", &[])
        .await
        .unwrap();
    c.send(&buf_of((0..20).map(|_| "downloads k 5".to_string())))
        .await;
    c.send(b"!set downloads k 1000\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(count_of(&client, "downloads", "k").await, Some(1000));
    c.send(&buf_of((0..7).map(|_| "downloads k 1".to_string())))
        .await;
    c.send(b"!set downloads k -5\n!set downloads other 9\n")
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.read_line().await, "ok\n");
    c.send(&buf_of((0..4).map(|_| "downloads k 2".to_string())))
        .await;
    assert_eq!(
        c.flush().await,
        (31, 0),
        "corrections are not counted as events"
    );
    assert_eq!(count_of(&client, "downloads", "k").await, Some(3));
    assert_eq!(count_of(&client, "downloads", "other").await, Some(9));
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_corrections_are_answered_and_change_nothing() {
    let h = Harness::start(|c| {
        c.counters.push(kind_counter("visitors", "unique", ""));
    })
    .await;
    let client = h.sql().await;
    let mut c = h.client().await;
    c.send(b"downloads k 5\n").await;
    assert_eq!(c.flush().await, (1, 0));
    let cases = [
        ("!set downloads k 9223372036854775808", "bad_value"),
        ("!set downloads k", "missing_value"),
        ("!set nope k 1", "unknown_counter"),
        ("!set downloads", "missing_key"),
        ("!forget downloads k 1", "too_many_fields"),
        ("!set visitors k 1", "not_settable"),
        ("!set users not-a-uuid 1", "bad_key"),
    ];
    for (line, reason) in cases {
        c.send(format!("{line}\n").as_bytes()).await;
        let reply = c.read_line().await;
        assert!(
            reply.starts_with(&format!("error {reason} ")),
            "{line}: {reply:?}"
        );
    }
    assert_eq!(c.flush().await, (0, cases.len() as u64));
    assert_eq!(count_of(&client, "downloads", "k").await, Some(5));
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_then_kill_9_and_replay_keeps_the_key_gone() {
    let dir = common::temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    // Nothing commits on its own: the old increments are only in memory and the journal when
    // the forget comes.
    let config = TestConfig::new(dir.path())
        .external(&conninfo, "forget")
        .standard_counters()
        .never_flushes()
        .write();
    let daemon = common::spawn_daemon(&config);
    let socket = dir.path().join("tallyd.sock");
    let mut c = LineClient::connect(&socket).await;
    let mut lines: Vec<String> = (0..300)
        .map(|i| format!("ips 10.0.0.{} 1", i % 3))
        .collect();
    lines.extend((0..100).map(|_| "downloads 10.0.0.1 2".to_string()));
    c.send(&buf_of(lines)).await;
    c.send(b"!sync\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    c.send(b"!forget * 10.0.0.1\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    c.send(b"ips 10.0.0.2 5\n!sync\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    daemon.kill();

    let daemon = common::spawn_daemon(&config);
    let client = common::sql(&conninfo).await;
    let mut c = LineClient::connect(&socket).await;
    c.send(b"!flush\n").await;
    c.read_line().await;
    assert_eq!(
        rows_of_key(&client, "10.0.0.1").await,
        0,
        "forgotten everywhere, replay or not"
    );
    assert_eq!(count_of(&client, "ips", "10.0.0.0").await, Some(100));
    assert_eq!(count_of(&client, "ips", "10.0.0.2").await, Some(105));
    daemon.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_supersedes_another_instances_committed_rows_and_keeps_its_later_ones() {
    let dir = common::temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let config = |name: &str| {
        let sub = dir.path().join(name);
        std::fs::create_dir_all(&sub).unwrap();
        TestConfig::new(&sub)
            .external(&conninfo, name)
            .standard_counters()
            .write()
    };
    let (config_a, config_b) = (config("a"), config("b"));
    let a = common::spawn_daemon(&config_a);
    let b = common::spawn_daemon(&config_b);
    let mut ca = LineClient::connect(&dir.path().join("a").join("tallyd.sock")).await;
    let mut cb = LineClient::connect(&dir.path().join("b").join("tallyd.sock")).await;
    cb.send(&buf_of((0..40).map(|_| "downloads k 1".to_string())))
        .await;
    assert_eq!(cb.flush().await, (40, 0));
    ca.send(b"downloads k 7\n").await;
    let out = common::tallyd(&config_a, &["set", "downloads", "k", "500"]);
    assert!(out.status.success(), "{out:?}");
    cb.send(&buf_of((0..11).map(|_| "downloads k 1".to_string())))
        .await;
    assert_eq!(cb.flush().await, (11, 0));
    ca.send(b"downloads k 2\n").await;
    assert_eq!(ca.flush().await, (2, 0));
    let client = common::sql(&conninfo).await;
    assert_eq!(count_of(&client, "downloads", "k").await, Some(513));
    // From SQL, in the application's transaction, and from the command line.
    client
        .execute("SELECT tallyd.forget('downloads', 'k')", &[])
        .await
        .unwrap();
    assert_eq!(count_of(&client, "downloads", "k").await, None);
    let out = common::tallyd(&config_b, &["forget", "downloads", "nothing-here"]);
    assert!(out.status.success(), "{out:?}");
    a.terminate();
    b.terminate();
}

/// A windowed sum's set: the window's total becomes the value, and its coarser windows and
/// all-time row move with it, through stored, rolled-up and pending events on both sides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_windowed_set_moves_its_coarser_windows_with_it() {
    let h = Harness::start(|c| {
        c.counters.push(common::windowed_counter(
            "daily",
            "day",
            "UTC",
            &["month", "all"],
        ))
    })
    .await;
    let client = h.sql().await;
    let mut c = h.client().await;
    let d1 = common::unix_ms("2026-11-23T10:00:00Z");
    let d2 = common::unix_ms("2026-11-24T10:00:00Z");
    // One window of `k`: its count, `None` without a row.
    let window = |span: &str, start: &str| {
        let at = (span.to_string(), start.to_string());
        let client = &client;
        async move { windows_of(client, "daily", "k").await.get(&at).copied() }
    };
    // Stored and rolled up, stored in slots, then pending: 30 + 20 + 10 in day 1, 7 in day 2.
    c.send(&buf_of((0..30).map(|_| format!("daily k 1 @{d1}"))))
        .await;
    assert_eq!(c.flush().await, (30, 0));
    client
        .query_one("SELECT tallyd.rollup(1000)", &[])
        .await
        .unwrap();
    c.send(&buf_of((0..20).map(|_| format!("daily k 1 @{d1}"))))
        .await;
    c.send(&buf_of((0..7).map(|_| format!("daily k 1 @{d2}"))))
        .await;
    assert_eq!(c.flush().await, (27, 0));
    c.send(&buf_of((0..10).map(|_| format!("daily k 1 @{d1}"))))
        .await;
    c.send(format!("!set daily k 1000 @{d1}\n").as_bytes())
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    c.send(&buf_of((0..5).map(|_| format!("daily k 1 @{d1}"))))
        .await;
    c.send(format!("!set daily k 400 @{d1}\ndaily k 2 @{d1}\n").as_bytes())
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.flush().await, (16, 0));
    assert_eq!(window("day", "2026-11-23T00:00:00Z").await, Some(402));
    assert_eq!(window("day", "2026-11-24T00:00:00Z").await, Some(7));
    assert_eq!(window("month", "2026-11-01T00:00:00Z").await, Some(409));
    assert_eq!(count_of(&client, "daily", "k").await, Some(409));
    // The same in one flight: a set between pending events, twice.
    c.send(
        format!("daily k 3 @{d2}\n!set daily k 50 @{d2}\ndaily k 4 @{d2}\n!set daily k 60 @{d2}\ndaily k 5 @{d2}\n")
            .as_bytes(),
    )
    .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.flush().await, (3, 0));
    assert_eq!(window("day", "2026-11-24T00:00:00Z").await, Some(65));
    assert_eq!(window("month", "2026-11-01T00:00:00Z").await, Some(467));
    assert_eq!(count_of(&client, "daily", "k").await, Some(467));
    h.stop().await;
}

/// The boundary for other writers is the correction's commit: a flush that would commit a new
/// slot row of the key while an application's `tallyd.forget()` is open waits for it (the
/// correction holds `tallyd.slots` against writers), so it commits after and is added. Without
/// that lock the flush committed first, inside the correction's window, and was kept although
/// it committed before the correction did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_waits_for_an_open_correction_and_is_added_after_it() {
    let h = Harness::start(|_| {}).await;
    let client = h.sql().await;
    let mut c = h.client().await;
    c.send(b"downloads gap 4\n").await;
    assert_eq!(c.flush().await, (1, 0));
    let app = h.sql().await;
    app.batch_execute("BEGIN; SELECT tallyd.forget('downloads', 'gap')")
        .await
        .unwrap();
    let flushed = tokio::spawn(async move {
        c.send(b"downloads gap 3\n").await;
        c.flush().await
    });
    // The flush's upsert waits on the correction's table lock (on the old code it never
    // waited: this loop would end with its panic).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let waiting: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_locks \
                 WHERE NOT granted AND relation = 'tallyd.slots'::regclass",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if waiting > 0 {
            break;
        }
        assert!(
            !flushed.is_finished(),
            "the flush committed while the correction was open"
        );
        assert!(std::time::Instant::now() < deadline, "no flush waited");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!flushed.is_finished());
    app.batch_execute("COMMIT").await.unwrap();
    assert_eq!(flushed.await.unwrap(), (1, 0));
    assert_eq!(count_of(&client, "downloads", "gap").await, Some(3));
    h.stop().await;
}
