//! The flush's direct writes (docs/design.md, "Direct writes"): a `rollup_into` counter's rows
//! written into the application's table (and its `also` rows into `tallyd.rollups`) in the
//! flight's own transaction, so the table holds every event once its `!flush` is answered; and
//! every way a direct write can fail (a row the application holds, a foreign key, an overflow,
//! a dropped column), each of which writes the flight again through `tallyd.slots`, exactly once,
//! for the rollup to fold; and two instances writing the same keys while the application holds
//! rows. Every total is checked against what the test sent.

mod common;

use common::unix_ms as ms;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{buf_of, counter, scalar, Harness, InProcess, LineClient};
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
        on_add: Default::default(),
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

/// Two instances (each with two connections) send the same keys and days, `!flush` after each
/// round, while the application holds a third of the table's rows for 300 to 500 ms at a time
/// and a rollup loop runs: their direct flights wait for each other's rows (key order: no
/// deadlock), fall back to `tallyd.slots` when a row stays held, and every (key, day) and
/// all-time total is exactly what was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_write_the_same_keys_while_the_application_holds_rows() {
    use rand::Rng;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    let setup = format!(
        "{CRATES_IO}INSERT INTO public.version_downloads \
         SELECT i, d::date, 100 FROM generate_series(1, 20) i, \
              generate_series(date '2026-11-22', date '2026-11-25', interval '1 day') d;"
    );
    let h = Harness::start_with(|c| c.counters = vec![downloads()], &setup, &[]).await;
    let sub = h.dir.path().join("second");
    std::fs::create_dir_all(&sub).unwrap();
    let second = Harness::config_for(&sub)
        .with(|c| {
            c.counters = vec![downloads()];
            c.daemon.set_instance_id(Some("second".into()));
        })
        .build();
    let second_socket = second.listen.socket().unwrap().to_path_buf();
    let mut b = InProcess::spawn_on(Arc::new(second), vec![h.db.clone()]);
    b.ready().await;
    let stop = Arc::new(AtomicBool::new(false));
    let app = {
        let (client, stop) = (h.sql().await, stop.clone());
        tokio::spawn(async move {
            let mut round: i64 = 0;
            while !stop.load(Ordering::Relaxed) {
                round += 1;
                client
                    .batch_execute(&format!(
                        "BEGIN; SELECT 1 FROM public.version_downloads WHERE version_id % 3 = {} \
                         FOR UPDATE; SELECT pg_sleep({} / 1000.0); COMMIT",
                        round % 3,
                        300 + (round * 67) % 200
                    ))
                    .await
                    .expect("the application's transaction");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            round
        })
    };
    let conninfo = h.pg.as_ref().unwrap().connection_string("postgres");
    let rollups = common::RollupLoop::start(&conninfo, 50).await;
    let mut rng = common::seeded();
    let sockets = [h.socket().to_path_buf(), second_socket];
    let mut senders = Vec::new();
    for socket in sockets.iter().chain(sockets.iter()) {
        let (socket, seed) = (socket.clone(), rng.gen::<u64>());
        senders.push(tokio::spawn(async move {
            let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
            let mut c = LineClient::connect(&socket).await;
            let mut sent: BTreeMap<(i64, String), i64> = BTreeMap::new();
            let until = std::time::Instant::now() + Duration::from_secs(5);
            while std::time::Instant::now() < until {
                let mut lines = Vec::new();
                for _ in 0..200 {
                    let id: i64 = rng.gen_range(1..=20);
                    let day = rng.gen_range(22..=25);
                    let delta: i64 = rng.gen_range(1..10);
                    *sent.entry((id, format!("2026-11-{day}"))).or_default() += delta;
                    let at = ms(&format!("2026-11-{day}T11:00:00Z"));
                    lines.push(format!("downloads {id} {delta} @{at}"));
                }
                c.send(&buf_of(lines)).await;
                assert_eq!(c.flush().await, (200, 0));
            }
            sent
        }));
    }
    let mut want: BTreeMap<(i64, String), i64> = BTreeMap::new();
    for s in senders {
        for (k, n) in s.await.unwrap() {
            *want.entry(k).or_default() += n;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let holds = app.await.unwrap();
    let folded = rollups.stop().await;
    let sql = h.sql().await;
    let check = |when: &'static str| {
        let (sql, want) = (&sql, &want);
        async move {
            let mut found: BTreeMap<(i64, String), i64> = BTreeMap::new();
            for ((id, day), n) in version_downloads(sql).await {
                if n != 100 {
                    found.insert((id, day), n - 100);
                }
            }
            for r in sql
                .query(
                    "SELECT key::bigint, ((window_start + interval '12 hours') \
                     AT TIME ZONE 'Europe/Berlin')::date::text, count \
                     FROM tallyd.window_totals WHERE counter = 'downloads' AND span = 'day'",
                    &[],
                )
                .await
                .unwrap()
            {
                *found.entry((r.get(0), r.get(1))).or_default() += r.get::<_, i64>(2);
            }
            assert_eq!(&found, want, "{when}: (version, day) totals");
            let all: i64 = want.values().sum();
            assert_eq!(
                scalar(
                    sql,
                    "SELECT coalesce(sum(count), 0)::bigint FROM tallyd.totals \
                     WHERE counter = 'downloads'"
                )
                .await,
                all,
                "{when}: all-time totals"
            );
        }
    };
    check("after the flushes").await;
    tallyd::rollup::until_empty(&sql, 1000).await.unwrap();
    check("rolled up").await;
    assert_eq!(in_slots(&sql).await, (0, 0));
    println!("{holds} holds by the application, {folded} slot rows folded by the loop");
    b.stop().await.unwrap();
    h.stop().await;
}
