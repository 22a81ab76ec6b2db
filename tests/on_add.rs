//! rollup_into's `on_add` (issue 35): columns of the application's table tallyd sets to a
//! constant whenever it adds to a row. Against a crates.io-shaped schema (`version_downloads`
//! with `downloads`, `counted` and `processed`, a foreign key with `ON DELETE CASCADE`) and
//! crates.io's consumer job, run by the test: it moves `downloads - counted` on into the crates'
//! totals and freezes past days (`processed = true`), never looking at a frozen row again. A late
//! download into a frozen day reopens it (`processed = false`), so the job counts it: the crates'
//! totals equal every download sent, through the flush's direct writes and through the rollup's
//! step. A constant the column cannot hold is refused at start, naming the column and its type.

mod common;

use common::unix_ms as ms;

use std::sync::Arc;

use common::{buf_of, counter, scalar, Harness, InProcess, LineClient};
use tallyd::config::{Constant, CounterConfig, KeyTypeName, RollupInto};
use tallyd::window::Span;

/// crates.io's tables: crates 1 and 2, versions 1 to 3 of crate 1 and 4 of crate 2.
const CRATES_IO: &str = "
CREATE TABLE public.crates (id bigint PRIMARY KEY, downloads bigint NOT NULL DEFAULT 0);
CREATE TABLE public.versions (id bigint PRIMARY KEY,
                              crate_id bigint NOT NULL REFERENCES public.crates (id));
CREATE TABLE public.version_downloads (
    version_id bigint NOT NULL REFERENCES public.versions (id) ON DELETE CASCADE,
    date date NOT NULL DEFAULT current_date,
    downloads int NOT NULL DEFAULT 1,
    counted int NOT NULL DEFAULT 0,
    processed boolean NOT NULL DEFAULT false,
    PRIMARY KEY (version_id, date)
);
INSERT INTO public.crates (id) VALUES (1), (2);
INSERT INTO public.versions VALUES (1, 1), (2, 1), (3, 1), (4, 2);
";

const ZONE: &str = "Europe/Berlin";

/// crates.io's `update_downloads`, with `today` as the first day it leaves open: each row not
/// processed has `downloads - counted` moved on to its crate and `counted` caught up, and a
/// past day is frozen (`processed = true`) once counted.
async fn update_downloads(sql: &tokio_postgres::Client, today: &str) {
    sql.batch_execute(&format!(
        "WITH todo AS MATERIALIZED (
             SELECT vd.version_id, vd.date, vd.downloads - vd.counted AS d
             FROM public.version_downloads vd WHERE NOT vd.processed
             FOR UPDATE
         ), moved AS (
             UPDATE public.version_downloads vd
             SET counted = vd.counted + todo.d, processed = vd.date < DATE '{today}'
             FROM todo WHERE vd.version_id = todo.version_id AND vd.date = todo.date
         )
         UPDATE public.crates c SET downloads = c.downloads + s.d
         FROM (SELECT v.crate_id, sum(todo.d) AS d FROM todo
               JOIN public.versions v ON v.id = todo.version_id GROUP BY v.crate_id) s
         WHERE c.id = s.crate_id"
    ))
    .await
    .unwrap();
}

/// `downloads`: days in [`ZONE`] into version_downloads, inserting missing rows, reopening the
/// rows it adds to.
fn downloads(direct: bool, on_add: &[(&str, Constant)]) -> CounterConfig {
    let mut c = counter("downloads", KeyTypeName::Bigint);
    c.window = Some(Span::Day);
    c.time_zone = Some(ZONE.into());
    c.rollup_into = Some(RollupInto {
        table: "public.version_downloads".into(),
        key_column: "version_id".into(),
        window_column: Some("date".into()),
        column: "downloads".into(),
        insert_missing: true,
        direct,
        on_add: on_add
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    });
    c
}

/// Sends `events` (key, delta, RFC 3339 event time), waits for their flight's commit, and when
/// the counter goes through `tallyd.slots`, folds them.
async fn send(
    c: &mut LineClient,
    sql: &tokio_postgres::Client,
    direct: bool,
    events: &[(i64, i64, &str)],
) {
    let lines = buf_of(
        events
            .iter()
            .map(|(key, delta, at)| format!("downloads {key} {delta} @{}", ms(at))),
    );
    c.send(&lines).await;
    assert_eq!(c.flush().await, (events.len() as u64, 0));
    if !direct {
        assert!(tallyd::rollup::until_empty(sql, 1000).await.unwrap() > 0);
    }
    assert_eq!(
        scalar(
            sql,
            "SELECT count(*) FROM tallyd.slots WHERE counter = 'downloads'"
        )
        .await,
        0,
        "every download is in version_downloads"
    );
}

/// (downloads, counted, processed) of a version's day.
async fn day_row(sql: &tokio_postgres::Client, version: i64, date: &str) -> (i32, i32, bool) {
    let row = sql
        .query_one(
            "SELECT downloads, counted, processed FROM public.version_downloads \
             WHERE version_id = $1 AND date = $2::text::date",
            &[&version, &date],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

async fn crates(sql: &tokio_postgres::Client) -> Vec<i64> {
    sql.query("SELECT downloads FROM public.crates ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn a_late_download_reopens_a_frozen_day(direct: bool) {
    let on_add = [("processed", Constant::Bool(false))];
    let h = Harness::start_with(
        |c| c.counters = vec![downloads(direct, &on_add)],
        CRATES_IO,
        &[],
    )
    .await;
    let sql = h.sql().await;
    let mut c = h.client().await;
    // Yesterday (2026-11-24 in Berlin) and today (2026-11-25).
    send(
        &mut c,
        &sql,
        direct,
        &[
            (1, 5, "2026-11-24T12:00:00Z"),
            (2, 3, "2026-11-25T12:00:00Z"),
            (4, 7, "2026-11-25T12:00:00Z"),
        ],
    )
    .await;
    update_downloads(&sql, "2026-11-25").await;
    assert_eq!(crates(&sql).await, vec![8, 7]);
    assert_eq!(day_row(&sql, 1, "2026-11-24").await, (5, 5, true), "frozen");
    assert_eq!(day_row(&sql, 2, "2026-11-25").await, (3, 3, false), "today");
    // Late downloads for yesterday, one of them into a frozen row; more for today.
    send(
        &mut c,
        &sql,
        direct,
        &[
            (1, 2, "2026-11-24T20:00:00Z"),
            (2, 16, "2026-11-25T13:00:00Z"),
            (3, 32, "2026-11-24T13:00:00Z"),
        ],
    )
    .await;
    assert_eq!(
        day_row(&sql, 1, "2026-11-24").await,
        (7, 5, false),
        "reopened"
    );
    assert_eq!(
        day_row(&sql, 3, "2026-11-24").await,
        (32, 0, false),
        "inserted"
    );
    update_downloads(&sql, "2026-11-26").await;
    assert_eq!(crates(&sql).await, vec![5 + 3 + 2 + 16 + 32, 7]);
    for (version, date, n) in [
        (1, "2026-11-24", 7),
        (2, "2026-11-25", 19),
        (3, "2026-11-24", 32),
        (4, "2026-11-25", 7),
    ] {
        assert_eq!(day_row(&sql, version, date).await, (n, n, true));
    }
    // A row tallyd does not add to stays frozen.
    send(&mut c, &sql, direct, &[(2, 64, "2026-11-25T14:00:00Z")]).await;
    assert_eq!(day_row(&sql, 4, "2026-11-25").await, (7, 7, true));
    assert_eq!(day_row(&sql, 2, "2026-11-25").await, (83, 19, false));
    update_downloads(&sql, "2026-11-26").await;
    assert_eq!(crates(&sql).await, vec![5 + 3 + 2 + 16 + 32 + 64, 7]);
    h.stop().await;
}

/// Through the flush's direct writes (the default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_download_reopens_a_frozen_day_written_directly() {
    a_late_download_reopens_a_frozen_day(true).await;
}

/// Through `tallyd.slots` and the rollup's generated step (migrations/V14, V18).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_download_reopens_a_frozen_day_through_the_rollup() {
    a_late_download_reopens_a_frozen_day(false).await;
}

/// Constants the table cannot take are refused at start, naming the column, the type found
/// and why; the refused start records no target. A constant of a domain, an enum or text is
/// read by the column's own type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constant_the_column_cannot_hold_is_refused_at_start() {
    let setup = format!(
        "{CRATES_IO}
        CREATE TYPE public.state AS ENUM ('new', 'seen');
        ALTER TABLE public.version_downloads ADD COLUMN state public.state NOT NULL DEFAULT 'new',
            ADD COLUMN note text, ADD COLUMN total bigint GENERATED ALWAYS AS (downloads * 2) STORED;"
    );
    let mut h = Harness::start_with(|_| {}, &setup, &[]).await;
    h.stop_daemon().await;
    for (on_add, message) in [
        (
            ("processed", Constant::Int(0)),
            "counter downloads: rollup_into.on_add.processed = 0 cannot be written into \
             public.version_downloads.processed, which is boolean: an integer fits no boolean \
             column (give a value of the column's type)",
        ),
        (
            ("counted", Constant::Int(1 << 40)),
            "counter downloads: rollup_into.on_add.counted = 1099511627776 cannot be written \
             into public.version_downloads.counted, which is integer: value \"1099511627776\" is \
             out of range for type integer",
        ),
        (
            ("state", Constant::Text("gone".into())),
            "counter downloads: rollup_into.on_add.state = \"gone\" cannot be written into \
             public.version_downloads.state, which is state: invalid input value for enum \
             state: \"gone\"",
        ),
        (
            ("total", Constant::Int(0)),
            "rollup_into.on_add.total = 0 cannot be written into public.version_downloads.total, \
             which is bigint: a generated or GENERATED ALWAYS identity column cannot be set",
        ),
        (
            ("nope", Constant::Bool(true)),
            "counter downloads: rollup_into table public.version_downloads has no column nope",
        ),
    ] {
        let config = Harness::config_for(h.dir.path())
            .with(|c| c.counters = vec![downloads(true, &[on_add])])
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
    // Constants the columns read: recorded, and written into an inserted row.
    let config = Harness::config_for(h.dir.path())
        .with(|c| {
            c.counters = vec![downloads(
                true,
                &[
                    ("state", Constant::Text("seen".into())),
                    ("note", Constant::Text("it's 100%".into())),
                    ("counted", Constant::Int(-1)),
                ],
            )]
        })
        .build();
    h.config = Arc::new(config);
    h.start_daemon().await;
    let sql = h.sql().await;
    let mut c = h.client().await;
    c.send(&buf_of([format!(
        "downloads 1 4 @{}",
        ms("2026-11-24T12:00:00Z")
    )]))
    .await;
    assert_eq!(c.flush().await, (1, 0));
    let row = sql
        .query_one(
            "SELECT downloads, counted, state::text, note FROM public.version_downloads",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, i32>(0),
            row.get::<_, i32>(1),
            row.get::<_, String>(2),
            row.get::<_, String>(3)
        ),
        (4, -1, "seen".into(), "it's 100%".into())
    );
    h.stop().await;
}

/// A version deleted with its rows (`ON DELETE CASCADE`) while downloads of it are still sent:
/// the rollup holds its key back (its insert fails on the foreign key) and retries it forever,
/// until `!forget` drops it (docs/counters.md): the hold and its slot rows go, the table is left
/// alone, and the other versions fold as before. The report names how long it has been held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_version_held_back_is_forgotten() {
    let on_add = [("processed", Constant::Bool(false))];
    let h = Harness::start_with(
        |c| c.counters = vec![downloads(false, &on_add)],
        CRATES_IO,
        &[],
    )
    .await;
    let sql = h.sql().await;
    let mut c = h.client().await;
    send(&mut c, &sql, false, &[(3, 5, "2026-11-24T12:00:00Z")]).await;
    sql.batch_execute("DELETE FROM public.versions WHERE id = 3")
        .await
        .unwrap();
    assert_eq!(
        scalar(&sql, "SELECT count(*) FROM public.version_downloads").await,
        0
    );
    let before = std::time::Instant::now();
    c.send(&buf_of([
        format!("downloads 3 2 @{}", ms("2026-11-25T12:00:00Z")),
        format!("downloads 1 4 @{}", ms("2026-11-25T12:00:00Z")),
    ]))
    .await;
    assert_eq!(c.flush().await, (2, 0));
    tallyd::rollup::until_empty(&sql, 1000).await.unwrap();
    let held = tallyd::rollup::held_back(&sql).await.unwrap();
    assert_eq!(
        held.iter()
            .map(|h| (
                h.counter.as_str(),
                h.keys,
                h.slot_rows,
                h.example_key.as_str()
            ))
            .collect::<Vec<_>>(),
        vec![("downloads", 1, 1, "3")]
    );
    // The report names how long the key has been held.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let held = tallyd::rollup::held_back(&sql).await.unwrap();
    assert!(
        held[0].held_for >= std::time::Duration::from_secs(1)
            && held[0].held_for <= before.elapsed(),
        "held for {:?}, sent {:?} ago",
        held[0].held_for,
        before.elapsed()
    );
    assert_eq!(day_row(&sql, 1, "2026-11-25").await, (4, 0, false));
    c.send(b"!forget downloads 3\n").await;
    let answer = c.read_line().await;
    assert!(answer.starts_with("ok"), "{answer}");
    assert!(tallyd::rollup::held_back(&sql).await.unwrap().is_empty());
    assert_eq!(
        scalar(
            &sql,
            "SELECT (SELECT count(*) FROM tallyd.slots WHERE counter = 'downloads') \
                  + (SELECT count(*) FROM tallyd.rollup_held)"
        )
        .await,
        0
    );
    assert_eq!(day_row(&sql, 1, "2026-11-25").await, (4, 0, false));
    h.stop().await;
}

/// A recount of one (version, day) while downloads of every version and day keep coming and
/// crates.io's job runs in a loop (freezing yesterday): `!set` writes the row's `downloads`
/// and reopens it (`processed = false`), so the job moves the set's difference on into the
/// crate's total. The set supersedes exactly the downloads its connection sent before it; the
/// other rows keep every download; at the end the crates' totals are the rows' sums.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_of_a_version_day_under_load_with_the_job_running() {
    use rand::Rng;
    let on_add = [("processed", Constant::Bool(false))];
    let h = Harness::start_with(
        |c| {
            c.counters = vec![downloads(true, &on_add)];
            c.flush.connections = 2;
        },
        CRATES_IO,
        &[],
    )
    .await;
    let sql = h.sql().await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let job = {
        let (job_sql, stop) = (h.sql().await, stop.clone());
        tokio::spawn(async move {
            let mut runs = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                update_downloads(&job_sql, "2026-11-25").await;
                runs += 1;
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            runs
        })
    };
    let (d24, d25) = (ms("2026-11-24T12:00:00Z"), ms("2026-11-25T12:00:00Z"));
    // The load: every version on both days but (2, 24th), which only the setter writes.
    let load: Vec<_> = (0..2)
        .map(|conn| {
            let socket = h.socket().to_path_buf();
            tokio::spawn(async move {
                let mut rng = common::seeded();
                let mut c = LineClient::connect(&socket).await;
                let mut sent: std::collections::BTreeMap<(i64, i64), i64> = Default::default();
                for _ in 0..60 {
                    let lines: Vec<(i64, i64, i64)> = (0..20)
                        .map(|_| {
                            let version = rng.gen_range(1..=4);
                            let day = if version == 2 || rng.gen() { d25 } else { d24 };
                            (version, day, rng.gen_range(1..5))
                        })
                        .collect();
                    c.send(&buf_of(
                        lines
                            .iter()
                            .map(|(v, d, n)| format!("downloads {v} {n} @{}", d + conn)),
                    ))
                    .await;
                    assert_eq!(c.flush().await, (20, 0));
                    for (v, d, n) in lines {
                        *sent.entry((v, d)).or_default() += n;
                    }
                }
                sent
            })
        })
        .collect();
    // The setter: downloads of (2, 24th), the recount at a random point, more after it.
    let mut rng = common::seeded();
    let mut c = h.client().await;
    let at = rng.gen_range(5..25);
    let mut after = 0;
    for batch in 0..30 {
        if batch == at {
            c.send(format!("!set downloads 2 1000 @{d24}\n").as_bytes())
                .await;
            assert_eq!(c.read_line().await, "ok\n");
            after = 0;
        }
        let n = rng.gen_range(1..9);
        c.send(format!("downloads 2 {n} @{d24}\n").as_bytes()).await;
        assert_eq!(c.flush().await, (1, 0));
        after += n;
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let mut sent: std::collections::BTreeMap<(i64, i64), i64> = Default::default();
    for l in load {
        for (k, n) in l.await.unwrap() {
            *sent.entry(k).or_default() += n;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let runs = job.await.unwrap();
    update_downloads(&sql, "2026-11-26").await;
    assert_eq!(
        day_row(&sql, 2, "2026-11-24").await,
        (1000 + after as i32, 1000 + after as i32, true),
        "the recount plus what came after it, moved on by the job"
    );
    for ((version, day), n) in &sent {
        let date = if *day == d24 {
            "2026-11-24"
        } else {
            "2026-11-25"
        };
        assert_eq!(
            day_row(&sql, *version, date).await,
            (*n as i32, *n as i32, true),
            "version {version} on {date}"
        );
    }
    let of_crate = |c: i64| {
        sent.iter()
            .filter(|((v, _), _)| (*v == 4) == (c == 2))
            .map(|(_, n)| n)
            .sum::<i64>()
    };
    assert_eq!(
        crates(&sql).await,
        vec![of_crate(1) + 1000 + after, of_crate(2)],
        "the crates' totals follow the set"
    );
    println!("the job ran {runs} times beside the load; the set came after {at} batches");
    h.stop().await;
}
