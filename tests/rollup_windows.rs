//! A windowed counter's `rollup_into`: the crates.io schema (`versions`, and `version_downloads`
//! with a unique key on `(version_id, date)` and a foreign key to `versions`), created here. Its
//! day windows in a non-UTC zone fold into the table, inserting missing rows; a version that
//! does not exist yet is held back in tallyd.slots, reported, and folds once it is inserted;
//! with the rollup running while events for today keep arriving, the table plus the pending
//! slot rows equals what was sent at every barrier. A start is refused, naming what is wrong,
//! when the table cannot take the rows. Every total is checked against what the test sent.

mod common;

use common::unix_ms as ms;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{buf_of, counter, scalar, Harness, InProcess, LineClient};
use tallyd::config::{Also, CounterConfig, KeyTypeName, RollupInto};
use tallyd::window::Span;

/// The crates.io tables, with versions 1 to 20.
const CRATES_IO: &str = "
CREATE TABLE public.versions (id bigint PRIMARY KEY);
CREATE TABLE public.version_downloads (
    version_id bigint REFERENCES public.versions (id),
    date date,
    downloads int NOT NULL DEFAULT 0,
    UNIQUE (version_id, date)
);
INSERT INTO public.versions SELECT generate_series(1, 20);
";

/// The zone of the `downloads` days: eight hours behind UTC in November, so a UTC date and the
/// local one differ for a third of each day.
const ZONE: &str = "America/Los_Angeles";

/// A counter `name` (bigint keys) counting `window`s in `zone`, with `also`, folded into
/// `table`'s `column` per (`key_column`, `window_column`).
fn windowed_into(
    name: &str,
    window: Span,
    zone: &str,
    also: &[Also],
    into: (&str, &str, &str, &str),
    insert_missing: bool,
) -> CounterConfig {
    let (table, key_column, window_column, column) = into;
    let mut c = counter(name, KeyTypeName::Bigint);
    c.window = Some(window);
    c.time_zone = Some(zone.to_string());
    c.also = also.to_vec();
    c.rollup_into = Some(RollupInto {
        table: table.into(),
        key_column: key_column.into(),
        window_column: Some(window_column.into()),
        column: column.into(),
        insert_missing,
        // Through tallyd.slots: these tests are the rollup's (tests/direct.rs has the flush's
        // direct writes).
        direct: false,
        on_add: Default::default(),
    });
    c
}

/// `downloads`: days in [`ZONE`] with the all-time total, into crates.io's version_downloads,
/// inserting missing rows.
fn downloads() -> CounterConfig {
    windowed_into(
        "downloads",
        Span::Day,
        ZONE,
        &[Also::All],
        (
            "public.version_downloads",
            "version_id",
            "date",
            "downloads",
        ),
        true,
    )
}

/// Sends `events` (key, delta, RFC 3339 event time) for `counter` and waits for the commit.
async fn send(c: &mut LineClient, counter: &str, events: &[(i64, i64, &str)]) {
    let lines = buf_of(
        events
            .iter()
            .map(|(key, delta, at)| format!("{counter} {key} {delta} @{}", ms(at))),
    );
    c.send(&lines).await;
    assert_eq!(c.flush().await, (events.len() as u64, 0));
}

/// (key, window column as text) -> count, for every row of `table`.
async fn table_rows(sql: &tokio_postgres::Client, query: &str) -> BTreeMap<(i64, String), i64> {
    sql.query(query, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| ((r.get(0), r.get(1)), r.get(2)))
        .collect()
}

async fn version_downloads(sql: &tokio_postgres::Client) -> BTreeMap<(i64, String), i64> {
    table_rows(
        sql,
        "SELECT version_id, date::text, downloads::bigint FROM public.version_downloads",
    )
    .await
}

fn rows(rows: &[(i64, &str, i64)]) -> BTreeMap<(i64, String), i64> {
    rows.iter()
        .map(|(k, w, n)| ((*k, w.to_string()), *n))
        .collect()
}

/// (counter, keys, slot rows, example key, cause) of each counter's keys held back by a
/// foreign key.
async fn held_back(sql: &tokio_postgres::Client) -> Vec<(String, i64, i64, String, String)> {
    tallyd::rollup::held_back(sql)
        .await
        .unwrap()
        .into_iter()
        .map(|h| (h.counter, h.keys, h.slot_rows, h.example_key, h.cause))
        .collect()
}

/// Rolls up until `done` holds, at most for 20 s (a held-back key is retried on its own clock).
async fn roll_until<F, Fut>(sql: &tokio_postgres::Client, what: &str, done: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    loop {
        tallyd::rollup::until_empty(sql, 1000).await.unwrap();
        if done().await {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn days_fold_into_version_downloads_and_a_missing_version_waits_for_its_row() {
    let setup =
        format!("{CRATES_IO}INSERT INTO public.version_downloads VALUES (1, '2026-11-24', 10);");
    let h = Harness::start_with(|c| c.counters = vec![downloads()], &setup, &[]).await;
    let sql = h.sql().await;
    let mut c = h.client().await;
    send(
        &mut c,
        "downloads",
        &[
            // 2026-11-24 23:59:59.999 in Los Angeles (PST, UTC-8), then its next midnight.
            (1, 1, "2026-11-25T07:59:59.999Z"),
            (1, 2, "2026-11-25T08:00:00Z"),
            (1, 4, "2026-11-25T20:00:00Z"),
            (2, 8, "2026-11-24T12:00:00Z"),
            (2, 16, "2026-11-25T09:00:00Z"),
            // 2026-11-01 01:30 happens twice in Los Angeles (PDT, then PST): one day.
            (3, 32, "2026-11-01T08:30:00Z"),
            (3, 64, "2026-11-01T09:30:00Z"),
            // Version 99 does not exist yet: its rows cannot be inserted.
            (99, 128, "2026-11-24T18:00:00Z"),
            (99, 256, "2026-11-25T18:00:00Z"),
        ],
    )
    .await;
    let folded = tallyd::rollup::until_empty(&sql, 1000).await.unwrap();
    assert_eq!(
        version_downloads(&sql).await,
        rows(&[
            (1, "2026-11-24", 11),
            (1, "2026-11-25", 6),
            (2, "2026-11-24", 8),
            (2, "2026-11-25", 16),
            (3, "2026-11-01", 96),
        ])
    );
    // Version 99's day rows stay in slots, reported; the all-time rows (also = ["all"]) of
    // every version fold into tallyd.rollups, 99's too.
    assert_eq!(
        scalar(
            &sql,
            "SELECT count(*) FROM tallyd.slots WHERE counter = 'downloads' AND (span, key) <> ('day', '99')"
        )
        .await,
        0
    );
    assert_eq!(
        scalar(
            &sql,
            "SELECT sum(count)::bigint FROM tallyd.slots WHERE counter = 'downloads' AND span = 'day'"
        )
        .await,
        384
    );
    // 7 day rows and 4 all-time rows, less version 99's 2 day rows.
    assert_eq!(folded, 9);
    let held = held_back(&sql).await;
    assert_eq!(held.len(), 1, "{held:?}");
    let (counter, keys, slot_rows, key, cause) = &held[0];
    assert_eq!(
        (counter.as_str(), *keys, *slot_rows, key.as_str()),
        ("downloads", 1, 2, "99")
    );
    assert!(
        cause.contains("violates foreign key constraint \"version_downloads_version_id_fkey\""),
        "{cause}"
    );
    assert_eq!(
        scalar(
            &sql,
            "SELECT slot_rows FROM tallyd.unmatched() WHERE counter = 'downloads'"
        )
        .await,
        0,
        "insert_missing leaves nothing unmatched"
    );
    let all_time = h.all("downloads").await;
    assert_eq!(
        all_time,
        vec![
            ("1".to_string(), 7),
            ("2".to_string(), 24),
            ("3".to_string(), 96),
            ("99".to_string(), 384),
        ]
    );
    assert_eq!(
        scalar(
            &sql,
            "SELECT sum(count)::bigint FROM tallyd.window_totals WHERE counter = 'downloads' AND key = '99'"
        )
        .await,
        384
    );

    // More events for version 99 wait with the others; once it exists, they fold.
    send(&mut c, "downloads", &[(99, 512, "2026-11-25T19:00:00Z")]).await;
    tallyd::rollup::until_empty(&sql, 1000).await.unwrap();
    assert_eq!(held_back(&sql).await[0].1, 1);
    assert_eq!(
        scalar(
            &sql,
            "SELECT sum(count)::bigint FROM tallyd.slots WHERE counter = 'downloads' AND span = 'day'"
        )
        .await,
        896
    );
    // `tallyd get`: each day is the table's row plus its slot rows not folded yet.
    let config = h.dir.path().join("get.toml");
    let mut cli_config = (*h.config).clone();
    cli_config.database.url = h.pg.as_ref().unwrap().connection_string("postgres");
    std::fs::write(&config, toml::to_string(&cli_config).unwrap()).unwrap();
    let get = |key: &str| {
        let out = common::tallyd(&config, &["get", "downloads", key]);
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let lines = get("99");
    let lines: Vec<&str> = lines.lines().collect();
    assert_eq!(
        lines[1..3],
        ["2026-11-24 count=128", "2026-11-25 count=768"],
        "{lines:?}"
    );
    assert!(lines[3].starts_with("all count=896 "), "{lines:?}");
    let lines = get("1");
    let lines: Vec<&str> = lines.lines().collect();
    assert_eq!(
        lines[1..3],
        ["2026-11-24 count=11", "2026-11-25 count=6"],
        "{lines:?}"
    );
    sql.batch_execute("INSERT INTO public.versions VALUES (99)")
        .await
        .unwrap();
    roll_until(&sql, "version 99 to fold", || async {
        held_back(&sql).await.is_empty()
    })
    .await;
    let mut expected = rows(&[
        (1, "2026-11-24", 11),
        (1, "2026-11-25", 6),
        (2, "2026-11-24", 8),
        (2, "2026-11-25", 16),
        (3, "2026-11-01", 96),
        (99, "2026-11-24", 128),
        (99, "2026-11-25", 768),
    ]);
    assert_eq!(version_downloads(&sql).await, expected);
    assert_eq!(scalar(&sql, "SELECT count(*) FROM tallyd.slots").await, 0);
    assert_eq!(
        scalar(&sql, "SELECT count(*) FROM tallyd.rollup_held").await,
        0
    );

    // A deleted parent holds its key back again; the other keys keep folding.
    sql.batch_execute("DELETE FROM public.version_downloads WHERE version_id = 3; DELETE FROM public.versions WHERE id = 3")
        .await
        .unwrap();
    expected.remove(&(3, "2026-11-01".to_string()));
    send(
        &mut c,
        "downloads",
        &[
            (3, 1, "2026-11-25T19:00:00Z"),
            (2, 1, "2026-11-25T19:00:00Z"),
        ],
    )
    .await;
    tallyd::rollup::until_empty(&sql, 1000).await.unwrap();
    *expected.get_mut(&(2, "2026-11-25".to_string())).unwrap() += 1;
    assert_eq!(version_downloads(&sql).await, expected);
    let held = held_back(&sql).await;
    assert_eq!((held[0].1, held[0].2, held[0].3.as_str()), (1, 1, "3"));
    // Its counts dropped by hand (as docs/operations.md says), nothing is reported any more.
    sql.batch_execute("DELETE FROM tallyd.slots WHERE counter = 'downloads' AND key = '3'")
        .await
        .unwrap();
    assert!(held_back(&sql).await.is_empty());
    h.stop().await;
}

/// `version_downloads` plus the pending day rows of `downloads`, in one snapshot.
const TABLE_PLUS_SLOTS: &str = "SELECT ( \
    (SELECT coalesce(sum(downloads), 0) FROM public.version_downloads) \
  + (SELECT coalesce(sum(count), 0) FROM tallyd.slots WHERE counter = 'downloads' AND span = 'day'))::bigint";

async fn table_plus_slots(sql: &tokio_postgres::Client) -> i64 {
    scalar(sql, TABLE_PLUS_SLOTS).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_plus_pending_slots_equals_what_was_sent_while_the_rollup_runs() {
    let h = Harness::start_with(
        |c| {
            c.counters = vec![downloads()];
            c.rollup.enabled = true;
            c.rollup.set_interval(Duration::from_millis(20));
            c.rollup.batch_rows = 50;
            c.flush.set_interval(Duration::from_millis(20));
        },
        CRATES_IO,
        &[],
    )
    .await;
    let acknowledged = Arc::new(AtomicI64::new(0));
    let submitted = Arc::new(AtomicI64::new(0));
    let stop = Arc::new(AtomicBool::new(false));

    // A reader between barriers: never below what was acknowledged before it read, never above
    // what was submitted after.
    let reader = {
        let sql = h.sql().await;
        let (acknowledged, submitted, stop) =
            (acknowledged.clone(), submitted.clone(), stop.clone());
        tokio::spawn(async move {
            let mut samples = 0;
            while !stop.load(Ordering::SeqCst) {
                let low = acknowledged.load(Ordering::SeqCst);
                let total = table_plus_slots(&sql).await;
                let high = submitted.load(Ordering::SeqCst);
                assert!(low <= total && total <= high, "{low} <= {total} <= {high}");
                samples += 1;
            }
            samples
        })
    };

    // Events for today (the time tallyd reads them) on 21 versions, 20 that exist and 500 that
    // does not, in rounds; after each round's `!flush` answer (a barrier: nothing else is in
    // flight), the table plus the pending slot rows is exactly what was sent.
    let sql = h.sql().await;
    let mut c = h.client().await;
    let mut rounds = 0;
    let mut barriers_with_folds = 0;
    // At least 4 s, and on until 20 barriers came after the rollup's first fold (on a loaded
    // machine the first fold can come late); a rollup that never folds fails at the deadline.
    let run_for = Duration::from_secs(4);
    let deadline = Duration::from_secs(120);
    let started = Instant::now();
    while started.elapsed() < run_for || barriers_with_folds < 20 {
        assert!(
            started.elapsed() < deadline,
            "the rollup ran: {barriers_with_folds} barriers after its first fold in {deadline:?}"
        );
        rounds += 1;
        let events: Vec<(i64, i64)> = (1..=20)
            .chain([500])
            .map(|v| (v, (v + rounds) % 7 + 1))
            .collect();
        let sum: i64 = events.iter().map(|(_, n)| n).sum();
        submitted.fetch_add(sum, Ordering::SeqCst);
        c.send(&buf_of(
            events.iter().map(|(v, n)| format!("downloads {v} {n}")),
        ))
        .await;
        assert_eq!(c.flush().await, (events.len() as u64, 0));
        let sent = acknowledged.fetch_add(sum, Ordering::SeqCst) + sum;
        assert_eq!(table_plus_slots(&sql).await, sent, "round {rounds}");
        if scalar(&sql, "SELECT count(*) FROM public.version_downloads").await > 0 {
            barriers_with_folds += 1;
        }
    }
    stop.store(true, Ordering::SeqCst);
    let samples = reader.await.unwrap();
    let sent = acknowledged.load(Ordering::SeqCst);
    eprintln!(
        "{rounds} rounds ({sent} events), {barriers_with_folds} barriers after the first fold, \
         {samples} samples between barriers"
    );
    assert!(
        rounds > 20 && samples > 20,
        "{rounds} rounds, {samples} samples"
    );

    // Version 500 is held back, and reported by the daemon's rollup.
    let wait_for_gauge = |want: Option<f64>| async move {
        let series = r#"tallyd_rollup_held_back_rows{counter="downloads",database="0"}"#;
        let started = Instant::now();
        loop {
            let value = common::process_metrics().get(series);
            if want.map_or(value.is_some_and(|v| v > 0.0), |w| value == Some(w)) {
                return value;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "{series} = {value:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    wait_for_gauge(None).await;
    let held = held_back(&sql).await;
    assert_eq!((held.len(), held[0].3.as_str()), (1, "500"));

    // Once it exists, every event is in the table, exactly.
    sql.batch_execute("INSERT INTO public.versions VALUES (500)")
        .await
        .unwrap();
    let started = Instant::now();
    while scalar(&sql, "SELECT count(*) FROM tallyd.slots WHERE span = 'day'").await > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "day rows left in slots"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        scalar(
            &sql,
            "SELECT sum(downloads)::bigint FROM public.version_downloads"
        )
        .await,
        sent
    );
    assert_eq!(table_plus_slots(&sql).await, sent);
    assert_eq!(
        scalar(
            &sql,
            "SELECT count(DISTINCT version_id) FROM public.version_downloads"
        )
        .await,
        21
    );
    wait_for_gauge(Some(0.0)).await;
    h.stop().await;
}

/// Tables a windowed rollup_into cannot use as configured, each refused at start with a message
/// naming the table, the column and why; the refused start records no target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_is_refused_naming_what_the_table_lacks() {
    let setup = format!(
        "{CRATES_IO}
        CREATE TABLE public.no_unique (version_id bigint, date date, downloads int);
        CREATE TABLE public.partial_unique (version_id bigint, date date, downloads int);
        CREATE UNIQUE INDEX ON public.partial_unique (version_id, date) WHERE downloads > 0;
        CREATE TABLE public.bare (version_id bigint, date date, downloads int, foo text NOT NULL,
                                  bar text NOT NULL DEFAULT '', UNIQUE (version_id, date));
        CREATE TABLE public.text_window (version_id bigint, date text, downloads int);"
    );
    let mut h = Harness::start_with(|_| {}, &setup, &[]).await;
    h.stop_daemon().await;
    let day = |table: &str, window_column: &str, insert_missing: bool| {
        windowed_into(
            "downloads",
            Span::Day,
            ZONE,
            &[],
            (table, "version_id", window_column, "downloads"),
            insert_missing,
        )
    };
    let hour = windowed_into(
        "downloads",
        Span::Hour,
        ZONE,
        &[],
        (
            "public.version_downloads",
            "version_id",
            "date",
            "downloads",
        ),
        false,
    );
    for (counter, message) in [
        (
            day("public.no_unique", "date", true),
            "counter downloads: rollup_into insert_missing needs a unique index or constraint on \
             exactly (version_id, date) of public.no_unique, not deferrable and without WHERE, \
             for INSERT ... ON CONFLICT: CREATE UNIQUE INDEX ON public.no_unique (version_id, date)",
        ),
        (
            day("public.partial_unique", "date", true),
            "insert_missing needs a unique index or constraint on exactly (version_id, date) of \
             public.partial_unique",
        ),
        (
            day("public.bare", "date", true),
            "counter downloads: public.bare.foo is NOT NULL without a default: insert_missing \
             cannot insert rows (give the column a default, or set insert_missing = false)",
        ),
        (
            hour,
            "counter downloads: rollup_into window_column public.version_downloads.date is a \
             date, which cannot hold hour windows: use a timestamptz column (or a day, week or \
             month window)",
        ),
        (
            day("public.text_window", "date", false),
            "counter downloads: rollup_into window_column public.text_window.date is text: it \
             must be a date (the window's first day, for day, week or month windows) or a \
             timestamptz (the window's first instant)",
        ),
        (
            day("public.version_downloads", "day", false),
            "counter downloads: rollup_into table public.version_downloads has no column day",
        ),
    ] {
        let config = Harness::config_for(h.dir.path())
            .with(|c| c.counters = vec![counter])
            .build();
        let err = InProcess::spawn_on(Arc::new(config), vec![h.db.clone()])
            .ended()
            .await
            .expect_err("the start is refused")
            .to_string();
        assert!(err.contains(message), "{err}\nlacks\n{message}");
        assert_eq!(
            scalar(&h.sql().await, "SELECT count(*) FROM tallyd.rollup_targets").await,
            0
        );
    }
    // Without insert_missing, neither the unique key nor the defaults are needed.
    let config = Harness::config_for(h.dir.path())
        .with(|c| c.counters = vec![day("public.bare", "date", false)])
        .build();
    h.config = Arc::new(config);
    h.start_daemon().await;
    h.stop().await;
}

/// An hour window in a half-hour zone into a timestamptz column (the window's first instant),
/// inserting rows; and day windows into a date column without insert_missing, which updates the
/// existing (key, day) rows only and leaves the others in slots, reported as unmatched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hours_into_a_timestamptz_column_and_days_into_existing_rows_only() {
    const TABLES: &str = "
        CREATE TABLE public.page_hours (page_id bigint, hour timestamptz, hits bigint NOT NULL,
                                        PRIMARY KEY (page_id, hour));
        CREATE TABLE public.daily (id bigint, day date, n bigint);
        INSERT INTO public.daily VALUES (1, '2026-11-24', NULL), (2, '2026-11-25', 5),
                                        (9, '2026-11-25', 100);";
    let h = Harness::start_with(
        |c| {
            c.counters = vec![
                windowed_into(
                    "hits",
                    Span::Hour,
                    "Asia/Kolkata",
                    &[Also::Window(Span::Day), Also::All],
                    ("public.page_hours", "page_id", "hour", "hits"),
                    true,
                ),
                windowed_into(
                    "daily",
                    Span::Day,
                    "Europe/Berlin",
                    &[],
                    ("public.daily", "id", "day", "n"),
                    false,
                ),
            ]
        },
        TABLES,
        &[],
    )
    .await;
    let sql = h.sql().await;
    let mut c = h.client().await;
    // Kolkata is UTC+5:30: its hours start at :30 UTC.
    send(
        &mut c,
        "hits",
        &[
            (7, 1, "2026-11-25T10:29:59Z"),
            (7, 2, "2026-11-25T10:30:00Z"),
            (7, 4, "2026-11-25T11:29:59Z"),
            (8, 8, "2026-11-25T11:30:00Z"),
        ],
    )
    .await;
    // Berlin is UTC+1: 23:30 UTC is the next day there.
    send(
        &mut c,
        "daily",
        &[
            (1, 1, "2026-11-24T12:00:00Z"),
            (1, 2, "2026-11-24T23:30:00Z"),
            (2, 4, "2026-11-25T12:00:00Z"),
            (3, 8, "2026-11-25T12:00:00Z"),
        ],
    )
    .await;
    tallyd::rollup::until_empty(&sql, 1000).await.unwrap();
    let hours = table_rows(
        &sql,
        "SELECT page_id, to_char(hour AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI'), hits FROM public.page_hours",
    )
    .await;
    assert_eq!(
        hours,
        rows(&[
            (7, "2026-11-25 09:30", 1),
            (7, "2026-11-25 10:30", 6),
            (8, "2026-11-25 11:30", 8),
        ])
    );
    // The also rows (the Kolkata day, all-time) went to tallyd.rollups, none is left in slots.
    assert_eq!(
        scalar(
            &sql,
            "SELECT count(*) FROM tallyd.slots WHERE counter = 'hits'"
        )
        .await,
        0
    );
    assert_eq!(
        scalar(
            &sql,
            "SELECT count FROM tallyd.window_totals WHERE counter = 'hits' AND key = '7' AND span = 'day'"
        )
        .await,
        7
    );
    assert_eq!(h.all("hits").await, vec![("7".into(), 7), ("8".into(), 8)]);

    let daily = "SELECT id, day::text, coalesce(n, -1) FROM public.daily";
    assert_eq!(
        table_rows(&sql, daily).await,
        rows(&[
            (1, "2026-11-24", 1),
            (2, "2026-11-25", 9),
            (9, "2026-11-25", 100)
        ]),
        "only existing rows are updated, none inserted"
    );
    let left = table_rows(
        &sql,
        "SELECT key::bigint, (window_start AT TIME ZONE 'Europe/Berlin')::date::text, count \
         FROM tallyd.window_totals WHERE counter = 'daily' AND (key, window_start) IN \
         (SELECT key, win FROM tallyd.slots)",
    )
    .await;
    assert_eq!(left, rows(&[(1, "2026-11-25", 2), (3, "2026-11-25", 8)]));
    assert_eq!(
        scalar(
            &sql,
            "SELECT slot_rows FROM tallyd.unmatched() WHERE counter = 'daily'"
        )
        .await,
        2
    );
    assert!(held_back(&sql).await.is_empty());
    // Once its row exists, a key's window folds.
    sql.batch_execute("INSERT INTO public.daily VALUES (3, '2026-11-25', 0)")
        .await
        .unwrap();
    tallyd::rollup::until_empty(&sql, 1000).await.unwrap();
    assert_eq!(
        table_rows(&sql, daily).await,
        rows(&[
            (1, "2026-11-24", 1),
            (2, "2026-11-25", 9),
            (3, "2026-11-25", 8),
            (9, "2026-11-25", 100)
        ])
    );
    assert_eq!(
        scalar(
            &sql,
            "SELECT slot_rows FROM tallyd.unmatched() WHERE counter = 'daily'"
        )
        .await,
        1
    );
    h.stop().await;
}

/// A key whose (key, window) row would leave the column's type (`downloads int`) is held back
/// alone, as for an all-time target: its slot rows stay, every other key folds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_count_beyond_the_column_type_holds_back_only_its_key() {
    let h = Harness::start_with(|c| c.counters = vec![downloads()], CRATES_IO, &[]).await;
    let sql = h.sql().await;
    let mut c = h.client().await;
    let day = "2026-11-25T20:00:00Z";
    send(
        &mut c,
        "downloads",
        &[(1, i32::MAX as i64, day), (2, 5, day)],
    )
    .await;
    tallyd::rollup::until_empty(&sql, 1000).await.unwrap();
    send(
        &mut c,
        "downloads",
        &[(1, 1, day), (2, 5, day), (3, 7, day)],
    )
    .await;
    tallyd::rollup::until_empty(&sql, 1000).await.unwrap();
    assert_eq!(
        version_downloads(&sql).await,
        rows(&[
            (1, "2026-11-25", i32::MAX as i64),
            (2, "2026-11-25", 10),
            (3, "2026-11-25", 7)
        ])
    );
    let held = tallyd::rollup::overflowed(&sql, 10).await.unwrap();
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(
        (
            held[0].counter.as_str(),
            held[0].key.as_str(),
            held[0].total.as_deref()
        ),
        ("downloads", "1", None)
    );
    assert_eq!(
        scalar(
            &sql,
            "SELECT sum(count)::bigint FROM tallyd.slots WHERE span = 'day'"
        )
        .await,
        1
    );
    assert_eq!(table_plus_slots(&sql).await, i32::MAX as i64 + 18);
    assert_eq!(
        h.all("downloads").await,
        vec![
            ("1".into(), i32::MAX as i64 + 1),
            ("2".into(), 10),
            ("3".into(), 7)
        ]
    );
    assert!(held_back(&sql).await.is_empty());
    h.stop().await;
}
