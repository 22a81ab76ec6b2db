//! The flush's direct writes (docs/design.md, "Direct writes"): a `rollup_into` counter's rows
//! written into the application's table (and its `also` rows into `tallyd.rollups`) in the
//! flight's own transaction, so the table holds every event once its `!flush` is answered; and
//! every way a direct write can fail (a row the application holds, a foreign key, an overflow,
//! a dropped column), each of which writes the flight again through `tallyd.slots`, exactly once,
//! for the rollup to fold. Every total is checked against what the test sent.

mod common;

use common::unix_ms as ms;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{buf_of, counter, scalar, Harness, LineClient};
use tallyd::config::{Also, CounterConfig, KeyTypeName, RollupInto};
use tallyd::window::Span;

/// crates.io's tables, with versions 1 to 20 (version_downloads refers to versions).
const CRATES_IO: &str = "
CREATE TABLE public.versions (id bigint PRIMARY KEY);
CREATE TABLE public.version_downloads (
    version_id bigint NOT NULL REFERENCES public.versions (id),
    date date NOT NULL,
    downloads int NOT NULL DEFAULT 0,
    PRIMARY KEY (version_id, date)
);
INSERT INTO public.versions SELECT generate_series(1, 20);
";

const ZONE: &str = "Europe/Berlin";

/// `downloads`: days in [`ZONE`] with the all-time total, into version_downloads (inserting
/// missing rows), written directly by the flush.
fn downloads() -> CounterConfig {
    let mut c = counter("downloads", KeyTypeName::Bigint);
    c.window = Some(Span::Day);
    c.time_zone = Some(ZONE.into());
    c.also = vec![Also::All];
    c.rollup_into = Some(RollupInto {
        table: "public.version_downloads".into(),
        key_column: "version_id".into(),
        window_column: Some("date".into()),
        column: "downloads".into(),
        insert_missing: true,
        direct: true,
    });
    c
}

/// Sends `events` (key, delta, RFC 3339 event time) and waits for their flight's commit.
async fn send(c: &mut LineClient, events: &[(i64, i64, &str)]) {
    let lines = buf_of(
        events
            .iter()
            .map(|(key, delta, at)| format!("downloads {key} {delta} @{}", ms(at))),
    );
    c.send(&lines).await;
    assert_eq!(c.flush().await, (events.len() as u64, 0));
}

async fn version_downloads(sql: &tokio_postgres::Client) -> BTreeMap<(i64, String), i64> {
    sql.query(
        "SELECT version_id, date::text, downloads::bigint FROM public.version_downloads",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| ((r.get(0), r.get(1)), r.get(2)))
    .collect()
}

fn rows(rows: &[(i64, &str, i64)]) -> BTreeMap<(i64, String), i64> {
    rows.iter()
        .map(|(k, w, n)| ((*k, w.to_string()), *n))
        .collect()
}

/// Day rows of `downloads` waiting in slots, and their sum.
async fn in_slots(sql: &tokio_postgres::Client) -> (i64, i64) {
    let row = sql
        .query_one(
            "SELECT count(*), coalesce(sum(count), 0)::bigint FROM tallyd.slots \
             WHERE counter = 'downloads' AND span = 'day'",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_flight_is_in_the_table_and_its_also_rows_in_rollups() {
    let setup =
        format!("{CRATES_IO}INSERT INTO public.version_downloads VALUES (1, '2026-11-24', 10);");
    let h = Harness::start_with(|c| c.counters = vec![downloads()], &setup, &[]).await;
    let sql = h.sql().await;
    let mut c = h.client().await;
    send(
        &mut c,
        &[
            // 2026-11-24 23:59:59.999 in Berlin (CET, UTC+1), then its next midnight.
            (1, 1, "2026-11-24T22:59:59.999Z"),
            (1, 2, "2026-11-24T23:00:00Z"),
            (2, 4, "2026-11-25T12:00:00Z"),
            (3, 8, "2026-11-25T12:00:00Z"),
        ],
    )
    .await;
    // Answered: committed, in the table already; nothing waits in slots.
    assert_eq!(
        version_downloads(&sql).await,
        rows(&[
            (1, "2026-11-24", 11),
            (1, "2026-11-25", 2),
            (2, "2026-11-25", 4),
            (3, "2026-11-25", 8),
        ])
    );
    assert_eq!(in_slots(&sql).await, (0, 0));
    assert_eq!(
        scalar(
            &sql,
            "SELECT sum(count)::bigint FROM tallyd.rollups WHERE counter = 'downloads' AND span = 'all'"
        )
        .await,
        15
    );
    assert_eq!(h.total("downloads", "1").await.0, 3);
    // The rollup finds nothing to fold.
    assert_eq!(tallyd::rollup::until_empty(&sql, 1000).await.unwrap(), 0);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_the_application_holds_sends_the_flight_through_slots() {
    let setup =
        format!("{CRATES_IO}INSERT INTO public.version_downloads VALUES (5, '2026-11-25', 100);");
    let h = Harness::start_with(|c| c.counters = vec![downloads()], &setup, &[]).await;
    let sql = h.sql().await;
    // The application holds version 5's row for today.
    let app = h.sql().await;
    app.batch_execute(
        "BEGIN; UPDATE public.version_downloads SET downloads = downloads + 1000 WHERE version_id = 5",
    )
    .await
    .unwrap();
    let mut c = h.client().await;
    let started = std::time::Instant::now();
    send(
        &mut c,
        &[
            (5, 1, "2026-11-25T12:00:00Z"),
            (6, 2, "2026-11-25T12:00:00Z"),
        ],
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the flush does not wait for the application"
    );
    // Written through slots (both rows: the counter's, its all-time rows too), not waiting on
    // the application.
    assert_eq!(in_slots(&sql).await, (2, 3));
    assert_eq!(
        version_downloads(&sql).await,
        rows(&[(5, "2026-11-25", 100)])
    );
    // While the counter writes through slots, later flights do too.
    send(&mut c, &[(7, 4, "2026-11-25T12:00:00Z")]).await;
    assert_eq!(in_slots(&sql).await, (3, 7));
    app.batch_execute("COMMIT").await.unwrap();
    // The rollup folds them once the application lets go.
    tallyd::rollup::until_empty(&sql, 1000).await.unwrap();
    assert_eq!(in_slots(&sql).await, (0, 0));
    assert_eq!(
        version_downloads(&sql).await,
        rows(&[
            (5, "2026-11-25", 1101),
            (6, "2026-11-25", 2),
            (7, "2026-11-25", 4)
        ])
    );
    h.stop().await;
}
