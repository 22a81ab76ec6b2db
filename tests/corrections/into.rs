//! Sets of `rollup_into` counters (issue 35, migrations/V20): the total lives in the
//! application's column, and a set writes it there. Once answered `ok`, the column plus what
//! tallyd still holds for the key (and window) equals the value, with the events after it
//! added: the race of tests/corrections/race.rs (4 connections' batches of distinct powers of
//! two, a set at a random moment) on all-time and windowed `insert_missing` targets, written
//! directly and through `tallyd.slots`, beside a rollup loop, through kill -9 right after the
//! set's answer and with two instances; a row the application holds locked (the set waits, then
//! is applied); a value beyond the column's range (refused, nothing changed); rows that do not
//! exist yet; `tallyd.set_total` from SQL.

use std::path::Path;
use std::time::Duration;

use tallyd::config::{Constant, CounterConfig, KeyTypeName, RollupInto};
use tokio_postgres::Client;

use super::race::{check, race, race_on, Ack, RaceOptions};
use crate::common::{
    counter, kind_counter, postgres, scalar, seeded, spawn_daemon, sql, temp_dir, Harness,
    RollupLoop, TestConfig,
};

/// The application's tables: repositories 1..=100 (all-time targets), and per-day rows of ids
/// (windowed, rows inserted by tallyd), with an `int` column for the range test.
const TABLES: &str = "
CREATE TABLE public.repositories (id bigint PRIMARY KEY, stars bigint, rolled bigint,
                                  small int NOT NULL DEFAULT 0);
INSERT INTO public.repositories (id) SELECT g FROM generate_series(1, 100) g;
CREATE TABLE public.daily (id bigint NOT NULL, day date NOT NULL, n bigint NOT NULL DEFAULT 0,
                           seen boolean NOT NULL DEFAULT true, PRIMARY KEY (id, day));
CREATE TABLE public.daily_rolled (id bigint NOT NULL, day date NOT NULL,
                                  n bigint NOT NULL DEFAULT 0, PRIMARY KEY (id, day));
";

/// An all-time counter into `public.repositories.column`.
fn into_repositories(name: &str, column: &str, direct: bool) -> CounterConfig {
    let mut c = counter(name, KeyTypeName::Bigint);
    c.rollup_into = Some(RollupInto {
        table: "public.repositories".into(),
        key_column: "id".into(),
        window_column: None,
        column: column.into(),
        insert_missing: false,
        direct,
        on_add: Default::default(),
    });
    c
}

/// A day counter (UTC) with its all-time row in `tallyd.rollups`, into `table`'s `(id, day)`
/// rows, inserting missing rows; `seen = false` wherever it writes a row of `public.daily`.
fn into_days(name: &str, table: &str, direct: bool) -> CounterConfig {
    let mut c = kind_counter(
        name,
        "sum",
        "key_type = \"bigint\"\nwindow = \"day\"\ntime_zone = \"UTC\"\nalso = [\"all\"]",
    );
    c.rollup_into = Some(RollupInto {
        table: table.into(),
        key_column: "id".into(),
        window_column: Some("day".into()),
        column: "n".into(),
        insert_missing: true,
        direct,
        on_add: if table == "public.daily" {
            [("seen".to_string(), Constant::Bool(false))].into()
        } else {
            Default::default()
        },
    });
    c
}

/// `stars` and `days` written directly, `rolled` and `rolled_days` through `tallyd.slots`;
/// `small` into an `int` column.
fn counters() -> Vec<CounterConfig> {
    vec![
        into_repositories("stars", "stars", true),
        into_repositories("rolled", "rolled", false),
        into_repositories("small", "small", true),
        into_days("days", "public.daily", true),
        into_days("rolled_days", "public.daily_rolled", false),
    ]
}

/// The total of `key`: the application's column (every day of a windowed counter: the races
/// write one) plus the slot rows of the window the table holds.
async fn total(client: &Client, counter: &str, key: &str) -> i64 {
    let (table, column, span) = match counter {
        "stars" | "rolled" | "small" => ("public.repositories", counter, "all"),
        "days" => ("public.daily", "n", "day"),
        "rolled_days" => ("public.daily_rolled", "n", "day"),
        other => panic!("no table for {other}"),
    };
    let query = format!(
        "SELECT (coalesce((SELECT sum({column})::bigint FROM {table} WHERE id = {key}), 0)
               + coalesce((SELECT sum(count) FROM tallyd.slots
                           WHERE counter = '{counter}' AND key = '{key}' AND span = '{span}'), 0))::bigint"
    );
    scalar(client, &query).await
}

/// A windowed counter's all-time row (`tallyd.totals`), which the set moves with its day.
async fn all_time(client: &Client, counter: &str, key: &str) -> i64 {
    crate::common::key_total(client, counter, key).await
}

fn options(counter: &'static str) -> RaceOptions {
    RaceOptions {
        counter,
        ack: Ack::Flush,
        after_set: None,
        kill_at_ok: None,
    }
}

/// The race on every target kind, beside a rollup loop that folds what goes through
/// `tallyd.slots` (and the direct counters' all-time rows): all-time and windowed, directly and
/// not; the windowed keys are new (their day's row does not exist when the race begins).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_of_an_application_column_among_concurrent_increments_is_exact() {
    let h = Harness::start_with(
        |c| {
            c.counters = counters();
            c.flush.connections = 2;
        },
        TABLES,
        &[],
    )
    .await;
    let client = h.sql().await;
    let conninfo = h.pg.as_ref().unwrap().connection_string("postgres");
    let rollups = RollupLoop::start(&conninfo, 7).await;
    let mut rng = seeded();
    let mut in_flight = 0;
    for round in 0..12 {
        let counter = ["stars", "days", "rolled", "rolled_days"][round % 4];
        let key = format!("{}", 10 + round);
        let race = race(h.socket(), &key, options(counter), &mut rng).await;
        let what = format!("round {round}, {counter}");
        let t = total(&client, counter, &key).await;
        in_flight += check(&race, t, &what);
        if counter.ends_with("days") {
            assert_eq!(
                all_time(&client, counter, &key).await,
                t,
                "{what}: all-time"
            );
        }
    }
    let folded = rollups.stop().await;
    assert!(folded > 0, "the loop must fold");
    // Everything folded: the same totals, now in the columns alone.
    tallyd::rollup::until_empty(&client, 1000).await.unwrap();
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM tallyd.slots").await,
        0,
        "all folded"
    );
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM public.daily WHERE seen").await,
        0,
        "every row tallyd wrote has its on_add column set"
    );
    println!("{in_flight} batches were in flight during a set; {folded} slot rows folded");
    h.stop().await;
}

/// A child daemon's config on `conninfo` in `dir`, with [`counters`] and its journal.
fn child_config(dir: &Path, conninfo: &str, id: &str) -> std::path::PathBuf {
    TestConfig::new(dir)
        .external(conninfo, id)
        .with(|c| {
            c.counters = counters();
            c.flush.connections = 2;
            c.flush.set_interval(Duration::from_secs(1));
            c.flush.set_retry_initial(Duration::from_millis(20));
            c.flush.set_retry_max(Duration::from_millis(500));
        })
        .write()
}

/// kill -9 the moment the set's `ok` is read, or once every connection had two more batches
/// acknowledged (some only journaled): the replay neither undoes the set nor applies it again,
/// and a second kill after the replay changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_right_after_a_set_of_an_application_column_loses_and_doubles_nothing() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let client = sql(&conninfo).await;
    client.batch_execute(TABLES).await.unwrap();
    let config = child_config(dir.path(), &conninfo, "into");
    let socket = dir.path().join("tallyd.sock");
    let mut rng = seeded();
    let mut daemon = spawn_daemon(&config);
    for round in 0..4 {
        let counter = ["stars", "days"][round % 2];
        let key = format!("{}", 20 + round);
        let at_once = round < 2;
        let options = RaceOptions {
            counter,
            ack: Ack::Mixed,
            after_set: Some(if at_once { 0 } else { 2 }),
            kill_at_ok: at_once.then(|| daemon.pid()),
        };
        let race = race(&socket, &key, options, &mut rng).await;
        daemon.kill();
        daemon = spawn_daemon(&config);
        let what = format!("round {round}, {counter}");
        let t = total(&client, counter, &key).await;
        check(&race, t, &what);
        daemon.kill();
        daemon = spawn_daemon(&config);
        assert_eq!(
            total(&client, counter, &key).await,
            t,
            "{what}: replayed again"
        );
        if counter == "days" {
            assert_eq!(
                all_time(&client, counter, &key).await,
                t,
                "{what}: all-time"
            );
        }
    }
    daemon.terminate();
}

/// Two daemons add to one key while one of them sets it: the other's batches committed before
/// the set are superseded, those written after its `ok` are added.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_of_an_application_column_among_two_instances_increments_is_exact() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let client = sql(&conninfo).await;
    client.batch_execute(TABLES).await.unwrap();
    let start = |name: &str| {
        let sub = dir.path().join(name);
        std::fs::create_dir_all(&sub).unwrap();
        spawn_daemon(&child_config(&sub, &conninfo, name))
    };
    let (a, b) = (start("a"), start("b"));
    let mut rng = seeded();
    for round in 0..4 {
        let counter = ["stars", "days"][round % 2];
        let key = format!("{}", 30 + round);
        let setter = if round < 2 { &a } else { &b };
        let adders = [a.socket(), b.socket()];
        let race = race_on(&adders, setter.socket(), &key, options(counter), &mut rng).await;
        let t = total(&client, counter, &key).await;
        check(&race, t, &format!("round {round}, {counter}"));
    }
    a.terminate();
    b.terminate();
}

/// The application holds the row (a long transaction, `FOR UPDATE`): the set waits (its flush
/// tries again after each 200 ms lock wait) and is answered once the row is free, applied on
/// top of what the application committed; events after it are added. (Its flush worker writes
/// nothing else meanwhile: a flight is retried until it commits.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_of_a_row_the_application_holds_waits_and_is_applied() {
    let h = Harness::start_with(
        |c| {
            c.counters = counters();
            c.flush.set_retry_initial(Duration::from_millis(50));
            c.flush.set_retry_max(Duration::from_millis(200));
        },
        TABLES,
        &[],
    )
    .await;
    let client = h.sql().await;
    let mut c = h.client().await;
    c.send(b"stars 1 5\ndays 1 7\n").await;
    assert_eq!(c.flush().await, (2, 0));
    let mut app = h.sql().await;
    let tx = app.transaction().await.unwrap();
    tx.batch_execute(
        "SELECT * FROM public.repositories WHERE id = 1 FOR UPDATE; \
         SELECT * FROM public.daily WHERE id = 1 FOR UPDATE",
    )
    .await
    .unwrap();
    let mut setter = h.client().await;
    setter
        .send(b"!set stars 1 100\nstars 1 3\n!set days 1 40\ndays 1 2\n")
        .await;
    let waiting = tokio::time::timeout(Duration::from_millis(1500), setter.read_line()).await;
    assert!(
        waiting.is_err(),
        "answered while the row is held: {waiting:?}"
    );
    tx.batch_execute("UPDATE public.repositories SET stars = stars + 1000 WHERE id = 1")
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(setter.read_line().await, "ok\n");
    assert_eq!(setter.read_line().await, "ok\n");
    assert_eq!(setter.flush().await, (2, 0));
    assert_eq!(total(&client, "stars", "1").await, 103);
    assert_eq!(
        scalar(
            &client,
            "SELECT stars FROM public.repositories WHERE id = 1"
        )
        .await,
        103,
        "written directly"
    );
    assert_eq!(total(&client, "days", "1").await, 42);
    assert_eq!(all_time(&client, "days", "1").await, 42);
    h.stop().await;
}

/// A value the column's type cannot hold is refused (`error overflow`), and nothing changes:
/// the column, the slot rows and the events the set would have superseded; the flush goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_beyond_the_columns_range_is_refused_and_changes_nothing() {
    let h = Harness::start_with(|c| c.counters = counters(), TABLES, &[]).await;
    let client = h.sql().await;
    let mut c = h.client().await;
    c.send(b"small 1 5\n").await;
    assert_eq!(c.flush().await, (1, 0));
    c.send(b"small 1 2\n!set small 1 3000000000\nsmall 1 1\n")
        .await;
    let reply = c.read_line().await;
    assert!(reply.starts_with("error overflow "), "{reply:?}");
    assert_eq!(c.flush().await, (2, 0));
    assert_eq!(total(&client, "small", "1").await, 8, "nothing superseded");
    c.send(b"!set small 1 -7\nsmall 1 1\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.flush().await, (1, 0));
    assert_eq!(
        scalar(
            &client,
            "SELECT small::bigint FROM public.repositories WHERE id = 1"
        )
        .await,
        -6
    );
    h.stop().await;
}

/// A set of a row that does not exist: a windowed `insert_missing` target's row is inserted
/// with the value (and its `on_add` columns); an all-time target's key without a row is held in
/// `tallyd.slots` as its events would be, and folded once the application inserts the row.
/// From SQL, `tallyd.set_total` sets an all-time target's column in the caller's transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_of_a_missing_row_inserts_it_or_holds_it() {
    let h = Harness::start_with(|c| c.counters = counters(), TABLES, &[]).await;
    let client = h.sql().await;
    let mut c = h.client().await;
    let day = crate::common::unix_ms("2026-11-24T12:00:00Z");
    c.send(format!("!set days 500 12 @{day}\ndays 500 1 @{day}\n").as_bytes())
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.flush().await, (1, 0));
    let row = client
        .query_one(
            "SELECT n, seen FROM public.daily WHERE id = 500 AND day = '2026-11-24'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, bool>(1)), (13, false));
    assert_eq!(all_time(&client, "days", "500").await, 13);
    // The all-time target has no row 500: held, as an event of it would be.
    c.send(b"rolled 500 4\n!set rolled 500 50\nrolled 500 1\n")
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.flush().await, (2, 0));
    assert_eq!(total(&client, "rolled", "500").await, 51);
    tallyd::rollup::until_empty(&client, 1000).await.unwrap();
    assert_eq!(total(&client, "rolled", "500").await, 51, "still held");
    client
        .batch_execute("INSERT INTO public.repositories (id, rolled) VALUES (500, 7)")
        .await
        .unwrap();
    tallyd::rollup::until_empty(&client, 1000).await.unwrap();
    assert_eq!(
        scalar(
            &client,
            "SELECT rolled FROM public.repositories WHERE id = 500"
        )
        .await,
        58,
        "folded onto what the application wrote"
    );
    // From SQL, in the application's transaction.
    c.send(b"stars 3 8\n").await;
    assert_eq!(c.flush().await, (1, 0));
    client
        .batch_execute("BEGIN; SELECT tallyd.set_total('stars', '3', 70); COMMIT")
        .await
        .unwrap();
    c.send(b"stars 3 1\n").await;
    assert_eq!(c.flush().await, (1, 0));
    assert_eq!(total(&client, "stars", "3").await, 71);
    let err = client
        .batch_execute("SELECT tallyd.set_total('days', '500', 1)")
        .await
        .expect_err("a windowed target from SQL");
    assert!(
        format!("{err:?}").contains("tallyd set --window"),
        "{err:?}"
    );
    // A forget then a set of one key in one flush: the forget leaves the column alone, the set
    // writes it.
    c.send(b"stars 4 5\n").await;
    assert_eq!(c.flush().await, (1, 0));
    c.send(b"!forget stars 4\n!set stars 4 9\nstars 4 1\n")
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.flush().await, (1, 0));
    assert_eq!(total(&client, "stars", "4").await, 10);
    h.stop().await;
}
