//! A database that stalls flushes: a lock held on `tallyd.slots` (a row, or the whole table) and
//! a `statement_timeout` too tight for a big flush. The flush must fail and retry instead of
//! waiting without limit, show its age in `tallyd_flush_oldest_pending_seconds`, log the
//! server's SQLSTATE, split statements that time out, and end with exact totals. Also a database
//! that ends sessions quickly: a 1 ms `idle_in_transaction_session_timeout` (flushes still
//! commit) and an `idle_session_timeout` (the log says why the server closed the connection).

mod common;

use std::time::Duration;

use common::{
    buf_of, free_port, postgres, spawn_daemon, sql, temp_dir, terminate, wait_until, Harness,
    LineClient, Sessions, TestConfig,
};
use tallyd::config::Config;
use tallyd::store::Db;

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
        async || {
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
    wait_until("the age gauge back at 0 after the commit", async || {
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

/// A liveness bound, not a timing assertion: a flush that can never commit retries forever.
const BOUND: Duration = Duration::from_secs(120);

/// Runs `sql` on the database at `url`.
async fn admin(url: &str, sql: &str) {
    let db = Db::new(url, Duration::from_secs(5)).unwrap();
    db.connect()
        .await
        .unwrap()
        .batch_execute(sql)
        .await
        .unwrap();
}

/// A DBA's strict policy: every session left idle inside a transaction for 1 ms is ended
/// (`idle_in_transaction_session_timeout` on the database, set while tallyd runs; its sessions
/// are ended so that their new ones take it). A flush sends all its statements at once (BEGIN
/// to COMMIT, pipelined), so its transaction never waits on tallyd, and every flush commits,
/// exactly once. Flushes that waited for each statement's answer before sending the next never
/// committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushes_commit_under_a_one_millisecond_idle_in_transaction_timeout() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let url = pg.connection_string("postgres");
    let config = stall_config(dir.path(), &url, free_port())
        .with(|c: &mut Config| {
            c.flush.connections = 2;
            // Many statements per flush: 10 per worker and flush below.
            c.flush.batch_rows = 500;
        })
        .write();
    let child = spawn_daemon(&config);
    admin(
        &url,
        "ALTER DATABASE postgres SET idle_in_transaction_session_timeout = '1ms'",
    )
    .await;
    terminate(&sql(&url).await, Sessions::All).await;
    let mut client = LineClient::connect(child.socket()).await;
    let (keys, rounds, per_round) = (10_000, 4, 50_000);
    for round in 0..rounds {
        let lines = (0..per_round).map(|i| format!("downloads k{:05} 1", (i + round) % keys));
        client.send(&buf_of(lines)).await;
        let flushed = tokio::time::timeout(BOUND, client.flush()).await;
        assert_eq!(
            flushed.unwrap_or_else(|_| panic!("no flush committed:\n{}", child.log())),
            (per_round as u64, 0)
        );
    }
    let db = Db::new(&url, Duration::from_secs(5)).unwrap();
    let row = db
        .connect()
        .await
        .unwrap()
        .query_one(
            "SELECT sum(count)::bigint, count(*), min(count), max(count) FROM tallyd.totals \
             WHERE counter = 'downloads'",
            &[],
        )
        .await
        .unwrap();
    let total = (rounds * per_round) as i64;
    let each = total / keys as i64;
    assert_eq!(
        (row.get::<_, i64>(0), row.get::<_, i64>(1)),
        (total, keys as i64)
    );
    assert_eq!((row.get::<_, i64>(2), row.get::<_, i64>(3)), (each, each));
    assert!(child.terminate().success());
    common::stop_postgres(pg).await;
}

/// The database ends every session idle for 300 ms (`idle_session_timeout`), so a flush finds
/// its connection closed by the server. The log must say what the server said when it closed
/// it (its FATAL message and SQLSTATE), not only "connection closed"; the flush reconnects and
/// commits exactly, and the lease heartbeat, whose connection is ended between renewals too,
/// renews on a new one without a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_the_server_closed_is_logged_with_the_servers_reason() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let url = pg.connection_string("postgres");
    admin(
        &url,
        "ALTER DATABASE postgres SET idle_session_timeout = '300ms'",
    )
    .await;
    let config = stall_config(dir.path(), &url, free_port())
        .with(|c: &mut Config| {
            c.flush.connections = 1;
            // Only `!flush` flushes.
            c.flush.set_interval(Duration::from_secs(600));
            // Renewed every 400 ms: the server ends the heartbeat's connection in between too.
            c.daemon.set_instance_lease(Duration::from_millis(1200));
        })
        .write();
    let child = spawn_daemon(&config);
    let mut client = LineClient::connect(child.socket()).await;
    for round in 0..3 {
        client
            .send(format!("downloads r{round} 5\n").as_bytes())
            .await;
        let flushed = tokio::time::timeout(BOUND, client.flush()).await;
        assert_eq!(flushed.expect("the flush never committed"), (1, 0));
        // The server ends the flush connection meanwhile (three times its timeout).
        tokio::time::sleep(Duration::from_millis(900)).await;
    }
    let log = child.log();
    let reason = "terminating connection due to idle-session timeout (SQLSTATE 57P05)";
    assert!(
        log.lines()
            .any(|l| l.contains("tallyd::flush") && l.contains(reason)),
        "the flush's log names the server's reason ({reason}):\n{log}"
    );
    // A connection the server ended while idle is replaced before it is used: no renewal of
    // the lease fails for it.
    assert!(!log.contains("cannot renew the instance lease"), "{log}");
    let sum = common::counter_total(&common::sql(&url).await, "downloads").await;
    assert_eq!(sum, 15);
    assert!(child.terminate().success());
    common::stop_postgres(pg).await;
}
