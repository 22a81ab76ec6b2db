//! The flush ledger records a flight once, on the server (migrations/V9). A flush sends its
//! whole transaction at once, so a transaction tallyd has given up on (a half-open connection)
//! may still commit on the server while tallyd, having read the ledger on a new connection,
//! writes the same flight again. Here the two copies are played exactly as flush.rs sends them
//! (BEGIN with `tallyd.flushing`, the upsert, `tallyd.record_flush`, COMMIT), the second one
//! waiting on the first's row lock as it would: the second must roll back whole, and the
//! key is counted once.

mod common;

use common::{postgres, sql, tallyd, temp_dir, TestConfig};

/// One flush transaction of writer 0, flight `seq`, adding 7 to `views k`, up to (not
/// including) COMMIT.
fn flight(seq: i64) -> String {
    format!(
        "BEGIN; SET LOCAL tallyd.flushing = on; \
         INSERT INTO tallyd.slots AS s (counter, key, slot, count, first_seen, last_seen) \
         VALUES ('views', 'k', 0, 7, now(), now()) \
         ON CONFLICT (counter, key, span, win, slot) DO UPDATE SET count = s.count + EXCLUDED.count; \
         SELECT tallyd.record_flush('ledger-test', 'owner', 0, {seq}, 0)"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flight_committed_by_a_connection_given_up_on_is_not_applied_again() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let url = pg.connection_string("postgres");
    let config = TestConfig::new(dir.path())
        .standard_counters()
        .database_url(&url)
        .write();
    let out = tallyd(&config, &["migrate"]);
    assert!(out.status.success(), "{out:?}");
    let setup = sql(&url).await;
    setup
        .batch_execute(
            "INSERT INTO tallyd.instances VALUES \
             ('ledger-test', 'owner', 'h', 1, '/d', now(), now() + interval '1 hour')",
        )
        .await
        .unwrap();

    // Flight 1 commits normally; flight 2 is the one sent twice.
    let first = sql(&url).await;
    first.batch_execute(&flight(1)).await.unwrap();
    first.batch_execute("COMMIT").await.unwrap();

    // The copy tallyd gave up on: everything sent, COMMIT not yet run by the server.
    let abandoned = sql(&url).await;
    abandoned.batch_execute(&flight(2)).await.unwrap();
    // The retry, on a new connection, after reading the ledger (flight 1 recorded): its upsert
    // waits for the abandoned copy's row lock.
    let retry = tokio::spawn(async move {
        let client = sql(&url).await;
        let result = client.batch_execute(&flight(2)).await;
        let _ = client.batch_execute("ROLLBACK").await;
        result
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    // Then the server reaches the abandoned copy's COMMIT.
    abandoned.batch_execute("COMMIT").await.unwrap();
    let err = retry
        .await
        .unwrap()
        .expect_err("the second copy of flight 2 must fail");
    assert_eq!(
        err.as_db_error().map(|e| e.code().code()),
        Some("TD002"),
        "{err:?}"
    );
    let total: i64 = setup
        .query_one(
            "SELECT count FROM tallyd.slots WHERE counter = 'views' AND key = 'k'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(total, 14, "flights 1 and 2, each once");
    let recorded: i64 = setup
        .query_one(
            "SELECT seq FROM tallyd.flushes WHERE instance_id = 'ledger-test'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(recorded, 2);

    // Outside a flush's transaction the ledger write writes nothing.
    let outside: bool = setup
        .query_one(
            "SELECT tallyd.record_flush('ledger-test', 'owner', 0, 3, 0)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!outside);
    common::stop_postgres(pg).await;
}
