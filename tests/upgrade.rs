//! The V10 schema change (time windows) on a database an older tallyd wrote: every existing
//! row is kept and reads the same through `tallyd.totals` and `tallyd get`, the rollup goes on
//! folding it, and new events add to it.

mod common;

use common::{sql, temp_dir, LineClient, TestConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_before_windows_read_the_same_after() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let mut client = sql(&conninfo).await;
    // The schema as of V9, and rows as that tallyd wrote them: slot rows of three slots and
    // summary rows.
    tallyd::store::migrate_up_to(&mut client, 9).await.unwrap();
    client
        .batch_execute(
            "INSERT INTO tallyd.slots (counter, key, slot, count, first_seen, last_seen)
             SELECT 'downloads', 'k' || (i % 50), i % 3, sum(i), now() - interval '1 day', now()
             FROM generate_series(1, 600) i GROUP BY i % 50, i % 3;
             INSERT INTO tallyd.rollups (counter, key, count, first_seen, last_seen)
             SELECT 'downloads', 'k' || i, 1000 * i, now() - interval '2 days', now() - interval '1 day'
             FROM generate_series(0, 79) i;",
        )
        .await
        .unwrap();
    let read = "SELECT key, count, first_seen::text, last_seen::text FROM tallyd.totals \
                WHERE counter = 'downloads' ORDER BY key";
    let before: Vec<(String, i64, String, String)> = client
        .query(read, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    assert_eq!(before.len(), 80);

    // The daemon migrates the rest of the way at its start.
    let config = TestConfig::new(dir.path())
        .database_url(&conninfo)
        .with(|c| {
            c.counters = vec![
                common::counter("downloads", tallyd::config::KeyTypeName::Text),
                common::windowed_counter("daily", "day", "UTC", &["all"]),
            ];
            c.listen.set_datagram_socket(None);
            c.rollup.enabled = false;
        })
        .write();
    let daemon = common::spawn_daemon(&config);
    let after: Vec<(String, i64, String, String)> = client
        .query(read, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    assert_eq!(after, before, "every row reads the same after V10");
    let spans: i64 = client
        .query_one(
            "SELECT count(*) FROM (SELECT span, win FROM tallyd.slots UNION ALL \
             SELECT span, win FROM tallyd.rollups) r WHERE span = 'all' AND win = '-infinity'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(spans, 150 + 80, "old rows are all-time rows");

    // New events add to the old rows; the rollup folds old and new together.
    let mut c = LineClient::connect(&dir.path().join("tallyd.sock")).await;
    c.send(b"downloads k7 5\ndaily k7 1\n").await;
    assert_eq!(c.flush().await, (2, 0));
    let out = common::tallyd(&config, &["rollup", "--until-empty"]);
    assert!(out.status.success(), "{out:?}");
    let k7 = |rows: &[(String, i64, String, String)]| rows.iter().find(|r| r.0 == "k7").unwrap().1;
    let out = common::tallyd(&config, &["get", "downloads", "k7"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.starts_with(&format!("downloads k7 count={} ", k7(&before) + 5)),
        "{text}"
    );
    assert_eq!(
        common::scalar(&client, "SELECT count(*) FROM tallyd.slots").await,
        0,
        "the rollup folded the old slot rows"
    );
    let total: i64 = client
        .query_one(
            "SELECT sum(count)::bigint FROM tallyd.totals WHERE counter = 'downloads'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(total, before.iter().map(|r| r.1).sum::<i64>() + 5);
    assert!(daemon.terminate().success());
    drop(client);
    common::stop_postgres(pg).await;
}
