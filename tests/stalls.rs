//! A database that stalls flushes: a lock held on `tallyd.slots` (a row, or the whole table) and
//! a `statement_timeout` too tight for a big flush. The flush must fail and retry instead of
//! waiting without limit, show its age in `tallyd_flush_oldest_pending_seconds`, log the
//! server's SQLSTATE, split statements that time out, and end with exact totals.

mod common;

use std::time::{Duration, Instant};

use common::{
    buf_of, free_port, postgres, spawn_daemon, sql, temp_dir, Harness, LineClient, TestConfig,
};
use tallyd::config::Config;

/// `tallyd run` on the database at `url`: quick flush retries, a 200 ms `lock_timeout`, its
/// metrics endpoint on `port`.
fn stall_config(dir: &std::path::Path, url: &str, port: u16) -> TestConfig {
    TestConfig::new(dir)
        .standard_counters()
        .fast()
        .database_url(url)
        .metrics_port(port)
        .with(|c: &mut Config| {
            c.daemon
                .set_drain_timeout(Config::default().daemon.drain_timeout());
            c.flush.set_retry_max(Duration::from_millis(200));
            c.flush.set_lock_timeout(Some(Duration::from_millis(200)));
        })
}

/// Waits (up to a generous deadline, not a timing assertion) until `done` holds.
async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while !done() {
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Holds `lock_sql` in an open transaction while events arrive; checks that the flush fails with
/// lock_timeout (logged with its SQLSTATE), that the age gauge grows, and exact totals after.
async fn flush_survives_a_held_lock(lock_sql: &str) {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let port = free_port();
    let config = stall_config(dir.path(), &pg.connection_string("postgres"), port).write();
    let child = spawn_daemon(&config);
    let socket = child.socket().to_path_buf();
    let scrape = |name: &str| child.scrape().sum(name);

    let mut client = LineClient::connect(&socket).await;
    client.send(b"downloads k 1\n").await;
    assert_eq!(client.flush().await, (1, 0));

    let mut locker = sql(&pg.connection_string("postgres")).await;
    let tx = locker.transaction().await.unwrap();
    tx.batch_execute(lock_sql).await.unwrap();
    let errors_before = scrape("tallyd_flush_errors_total").unwrap();

    client
        .send(&buf_of((0..100).map(|i| format!("downloads k{i} 2"))))
        .await;
    client.send(b"downloads k 3\n").await;
    wait_until(
        "failed flushes and a growing age while the lock is held",
        || {
            let errors = scrape("tallyd_flush_errors_total").unwrap();
            let age = scrape("tallyd_flush_oldest_pending_seconds").unwrap_or(0.0);
            errors >= errors_before + 2.0 && age >= 1.0
        },
    )
    .await;
    let log = child.log();
    assert!(
        log.contains("canceling statement due to lock timeout (SQLSTATE 55P03)"),
        "the flush failure is logged with the server's message and SQLSTATE:\n{log}"
    );

    tx.rollback().await.unwrap();
    assert_eq!(client.flush().await, (101, 0));
    wait_until("the age gauge back at 0 after the commit", || {
        scrape("tallyd_flush_oldest_pending_seconds") == Some(0.0)
    })
    .await;
    let row = locker
        .query_one(
            "SELECT (SELECT count FROM tallyd.totals WHERE counter = 'downloads' AND key = 'k'), \
                    (SELECT sum(count)::bigint FROM tallyd.totals WHERE counter = 'downloads')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 4, "k: 1 + 3");
    assert_eq!(row.get::<_, i64>(1), 4 + 100 * 2);
    assert!(child.terminate().success());
    common::stop_postgres(pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_slots_table_fails_the_flush_instead_of_stalling_it() {
    flush_survives_a_held_lock("LOCK TABLE tallyd.slots IN ACCESS EXCLUSIVE MODE").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_slot_row_fails_the_flush_instead_of_stalling_it() {
    flush_survives_a_held_lock(
        "SELECT 1 FROM tallyd.slots WHERE counter = 'downloads' AND key = 'k' FOR UPDATE",
    )
    .await;
}

/// Rows cost 2 ms each to write (a trigger sleeps), and the database's `statement_timeout` is
/// 3 s: a flush of 4,000 keys in one statement (8 s) can never commit, statements of 1,000
/// can. The flush must split and commit every event exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_that_keeps_timing_out_is_split_into_smaller_statements() {
    let keys = 4_000;
    let mut h = Harness::start(|c| {
        c.flush.connections = 1;
        c.flush.set_interval(Duration::from_millis(600000));
        c.flush.set_statement_timeout(None);
    })
    .await;
    h.stop_daemon().await;
    h.sql()
        .await
        .batch_execute(
            "CREATE FUNCTION tallyd_test_slow() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN PERFORM pg_sleep(0.002); RETURN NEW; END $$; \
             CREATE TRIGGER slow BEFORE INSERT ON tallyd.slots \
               FOR EACH ROW EXECUTE FUNCTION tallyd_test_slow(); \
             ALTER DATABASE postgres SET statement_timeout = '3s';",
        )
        .await
        .unwrap();
    h.start_daemon().await;
    let mut client = h.client().await;
    let lines = (0..keys).map(|i| format!("downloads key{i:05} 1"));
    client.send(&buf_of(lines.clone().chain(lines))).await;
    // A deadline for any progress at all, not a speed check: unsplit, it never commits.
    let flushed = tokio::time::timeout(Duration::from_secs(300), client.flush()).await;
    assert_eq!(flushed.expect("the flush never committed"), (2 * keys, 0));
    let all = h.all("downloads").await;
    assert_eq!(all.len(), keys as usize);
    assert!(
        all.iter().all(|(_, count)| *count == 2),
        "every key exactly twice"
    );
    h.stop().await;
}
