//! Counter kinds end to end against real PostgreSQL with postgresql-hll: unique counters'
//! sketches equal the extension's own `hll_add_agg(hll_hash_text(value), log2m, regwidth)` of
//! the same values, through flushes, slots, rollups and windows (a week's sketch is the union
//! of its days), and a million distinct values estimate within three standard errors; max, min
//! and last exact against what the test sent; bad values rejected and counted, changing
//! nothing; and the starts that must be refused: a unique counter without the extension, a kind
//! or sketch precision changed while rows remain (rows written before kinds existed are sums).
//! Every kind through the faults (kill -9, terminated backends, PgBouncer, the memory cap, a
//! shard move): tests/faults.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{
    buf_of, kind_counter, scalar, sketch_of, sql, sql_sketch, temp_dir, unix_ms,
    wait_until_blocking, Daemon, Harness, LineClient, TestConfig,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tallyd::config::CounterConfig;
use tokio_postgres::Client;

/// A liveness bound, not a timing assertion.
const BOUND: Duration = Duration::from_secs(120);

const DAY: i64 = 86_400_000;

async fn with_kinds(extra: Vec<CounterConfig>) -> Harness {
    Harness::start(move |c| c.counters.extend(extra)).await
}

/// The cardinality and the sketch (as text) of `counter`/`key`'s all-time row in
/// tallyd.unique_totals, beside the extension's own sketch of `values`, built in SQL.
async fn sketches(
    client: &Client,
    counter: &str,
    key: &str,
    values: &BTreeSet<String>,
    params: (i32, i32),
) -> ((i64, String), (i64, String)) {
    let (cardinality, sketch, _) = sketch_of(client, counter, key, None)
        .await
        .unwrap_or_else(|| panic!("{counter}/{key} has no all-time sketch"));
    (
        (cardinality, sketch),
        sql_sketch(client, values, params).await,
    )
}

/// Asserts that the unique counter `counter` holds exactly `want` (per key: its distinct
/// values and events): each key's all-time sketch is the extension's sketch of its values with
/// its event count, and no other key has a row.
async fn assert_uniques(
    client: &Client,
    counter: &str,
    want: &BTreeMap<String, (BTreeSet<String>, i64)>,
    params: (i32, i32),
) {
    let keys: i64 = client
        .query_one(
            "SELECT count(*) FROM tallyd.totals WHERE counter = $1",
            &[&counter],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(keys, want.len() as i64, "the keys of {counter}");
    for (key, (values, events)) in want {
        let ours = sketch_of(client, counter, key, None).await;
        let (cardinality, sketch) = sql_sketch(client, values, params).await;
        assert_eq!(
            ours,
            Some((cardinality, sketch, *events)),
            "{counter}/{key}: the sketch of {} values",
            values.len()
        );
    }
}

/// Asserts that `counter`, of `kind` (max, min or last), holds exactly `want` (per key: its
/// events and kept value), and no other key.
async fn assert_values(
    client: &Client,
    counter: &str,
    kind: &str,
    want: &BTreeMap<String, (i64, i64)>,
) {
    let found: BTreeMap<String, (String, i64, Option<i64>)> = client
        .query(
            "SELECT key, kind, count, value FROM tallyd.totals WHERE counter = $1",
            &[&counter],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3))))
        .collect();
    let want: BTreeMap<String, (String, i64, Option<i64>)> = want
        .iter()
        .map(|(k, (events, value))| (k.clone(), (kind.to_string(), *events, Some(*value))))
        .collect();
    assert_eq!(found, want, "{counter}");
}

async fn flush(c: &mut LineClient) -> (u64, u64) {
    tokio::time::timeout(BOUND, c.flush())
        .await
        .expect("!flush was not answered")
}

async fn rollup_step(client: &Client, batch_rows: i32) -> i64 {
    client
        .query_one("SELECT tallyd.rollup($1)", &[&batch_rows])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unique_sketches_equal_the_extensions_through_flushes_and_rollups() {
    let h = with_kinds(vec![
        kind_counter("visitors", "unique", ""),
        kind_counter("fine", "unique", "log2m = 14\nregwidth = 4"),
    ])
    .await;
    let client = h.sql().await;
    let mut c = h.client().await;
    // Per key: distinct values at, below and above the explicit threshold (160 values at
    // log2m 11, regwidth 5), sent three times over, across flushes and rollup steps.
    let sizes = [
        (1usize, "one"),
        (100, "hundred"),
        (160, "threshold"),
        (161, "over"),
        (5000, "many"),
    ];
    let mut sent: BTreeMap<(&str, &str), BTreeSet<String>> = BTreeMap::new();
    for round in 0..3 {
        for counter in ["visitors", "fine"] {
            for (n, key) in sizes {
                let lines = buf_of((0..n).map(|i| format!("{counter} {key} v{i}-{}", i % 7)));
                c.send(&lines).await;
                let set = sent.entry((counter, key)).or_default();
                set.extend((0..n).map(|i| format!("v{i}-{}", i % 7)));
            }
        }
        let (accepted, rejected) = c.flush().await;
        assert_eq!(rejected, 0);
        assert_eq!(
            accepted,
            2 * sizes.iter().map(|(n, _)| *n as u64).sum::<u64>()
        );
        if round == 1 {
            let folded: i64 = client
                .query_one("SELECT tallyd.rollup(100000)", &[])
                .await
                .unwrap()
                .get(0);
            assert!(folded > 0, "the rollup folded the sketches' slot rows");
        }
    }
    for ((counter, key), values) in &sent {
        let params = if *counter == "fine" { (14, 4) } else { (11, 5) };
        let (ours, theirs) = sketches(&client, counter, key, values, params).await;
        assert_eq!(ours, theirs, "{counter}/{key}: {} values", values.len());
        if values.len() <= 160 {
            assert_eq!(ours.0, values.len() as i64, "exact while explicit");
        }
    }
    // Events: every event counted, duplicates too.
    let events: i64 = client
        .query_one(
            "SELECT sum(events)::bigint FROM tallyd.unique_totals WHERE counter = 'visitors'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        events,
        3 * sizes.iter().map(|(n, _)| *n as i64).sum::<i64>()
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_min_and_last_are_exact_and_last_follows_event_time() {
    let h = with_kinds(vec![
        kind_counter("peak", "max", ""),
        kind_counter("low", "min", ""),
        kind_counter("gauge", "last", ""),
    ])
    .await;
    let client = h.sql().await;
    let mut c = h.client().await;
    let mut want: BTreeMap<(&str, String), i64> = BTreeMap::new();
    // Per key, (value, event time): the last by time, ties to the larger value, sent out of
    // order and across flushes.
    let mut latest: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for round in 0..4 {
        let mut lines = Vec::new();
        for i in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = format!("k{}", i % 37);
            let value = (x % 2_000_001) as i64 - 1_000_000;
            let at = 1_700_000_000_000 + (x >> 40) as i64 % 1000;
            lines.push(format!("peak {key} {value} @{at}"));
            lines.push(format!("low {key} {value}"));
            lines.push(format!("gauge {key} {value} @{at}"));
            let w = want.entry(("peak", key.clone())).or_insert(i64::MIN);
            *w = (*w).max(value);
            let w = want.entry(("low", key.clone())).or_insert(i64::MAX);
            *w = (*w).min(value);
            let l = latest.entry(key).or_insert((i64::MIN, i64::MIN));
            if (at, value) > *l {
                *l = (at, value);
            }
        }
        c.send(&buf_of(lines)).await;
        assert_eq!(c.flush().await, (6000, 0));
        if round % 2 == 1 {
            client
                .query_one("SELECT tallyd.rollup(1000)", &[])
                .await
                .unwrap();
        }
    }
    for (key, (_, value)) in &latest {
        want.insert(("gauge", key.clone()), *value);
    }
    for ((counter, key), value) in &want {
        let row = client
            .query_one(
                "SELECT value, kind, count FROM tallyd.totals WHERE counter = $1 AND key = $2",
                &[counter, key],
            )
            .await
            .unwrap();
        let (got, kind, events): (i64, String, i64) = (row.get(0), row.get(1), row.get(2));
        let want_kind = match *counter {
            "peak" => "max",
            "low" => "min",
            _ => "last",
        };
        assert_eq!((got, kind.as_str()), (*value, want_kind), "{counter}/{key}");
        assert!(events > 0);
    }
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_values_are_rejected_counted_and_change_nothing() {
    let h = with_kinds(vec![
        kind_counter("visitors", "unique", ""),
        kind_counter("peak", "max", ""),
    ])
    .await;
    let mut c = h.client().await;
    c.send(b"!errors\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    let long = "x".repeat(257);
    let cases = [
        ("visitors k".to_string(), "missing_value"),
        ("peak k".to_string(), "missing_value"),
        ("peak k @1700000000000".to_string(), "missing_value"),
        ("peak k 1.5".to_string(), "bad_value"),
        ("peak k 9223372036854775808".to_string(), "bad_value"),
        (format!("visitors k {long}"), "value_too_long"),
        ("visitors k a\u{a0}b".to_string(), "bad_value"),
        ("visitors k v @1 x".to_string(), "too_many_fields"),
    ];
    for (line, reason) in &cases {
        c.send(format!("{line}\n").as_bytes()).await;
        let reply = c.read_line().await;
        assert!(reply.contains(reason), "{line:?}: {reply:?}");
    }
    assert_eq!(c.flush().await, (0, cases.len() as u64));
    let client = h.sql().await;
    let rows: i64 = client
        .query_one("SELECT count(*) FROM tallyd.slots", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0, "nothing was written");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_shows_values_and_distinct_counts_per_window() {
    let dir = common::temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let mut visitors = common::windowed_counter("visitors", "day", "UTC", &["all"]);
    visitors.kind = tallyd::protocol::Kind::Unique;
    let config = common::TestConfig::new(dir.path())
        .database_url(&conninfo)
        .with(|c| {
            c.counters = vec![visitors, kind_counter("peak", "max", "")];
            c.listen.set_datagram_socket(None);
        })
        .write();
    let daemon = common::spawn_daemon(&config);
    let mut c = common::LineClient::connect(&dir.path().join("tallyd.sock")).await;
    let day1 = common::unix_ms("2026-11-23T12:00:00Z");
    let day2 = common::unix_ms("2026-11-24T12:00:00Z");
    let mut lines: Vec<String> = (0..30)
        .map(|i| format!("visitors /home u{i} @{day1}"))
        .collect();
    lines.extend((20..50).map(|i| format!("visitors /home u{i} @{day2}")));
    lines.extend(["peak disk 7", "peak disk 42", "peak disk -3"].map(String::from));
    c.send(&buf_of(lines)).await;
    assert_eq!(c.flush().await, (63, 0));
    let out = common::tallyd(&config, &["get", "visitors", "/home", "--last", "7"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[1], "2026-11-23 count=30 unique=30", "{text}");
    assert_eq!(lines[2], "2026-11-24 count=30 unique=30", "{text}");
    assert!(lines[3].starts_with("all count=60 unique=50 "), "{text}");
    let out = common::tallyd(&config, &["get", "peak", "disk"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("peak disk count=3 max=42 "), "{text}");
    daemon.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unique_and_max_fold_into_the_applications_columns() {
    let into = |name: &str, kind: &str, column: &str| {
        kind_counter(
            name,
            kind,
            &format!(
                "[rollup_into]\ntable = \"public.pages\"\nkey_column = \"path\"\ncolumn = {column:?}"
            ),
        )
    };
    let setup = "CREATE EXTENSION IF NOT EXISTS hll; \
                 CREATE TABLE pages (path text PRIMARY KEY, visitors hll, peak bigint); \
                 INSERT INTO pages VALUES ('/a', NULL, NULL), ('/b', hll_empty(11, 5), 1000)";
    let counters = vec![
        into("visitors", "unique", "visitors"),
        into("peak", "max", "peak"),
    ];
    let h = Harness::start_with(move |c| c.counters.extend(counters), setup, &[]).await;
    let client = h.sql().await;
    let mut c = h.client().await;
    let mut values: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    for round in 0..3 {
        let mut lines = Vec::new();
        for path in ["/a", "/b", "/none"] {
            for i in 0..300 {
                let v = format!("u{}", (i * 7 + round * 100) % 500);
                lines.push(format!("visitors {path} {v}"));
                values.entry(path).or_default().insert(v);
            }
            lines.push(format!("peak {path} {}", 10 * round));
        }
        c.send(&buf_of(lines)).await;
        assert_eq!(c.flush().await, (903, 0));
        client
            .query_one("SELECT tallyd.rollup(100000)", &[])
            .await
            .unwrap();
    }
    for path in ["/a", "/b"] {
        let vals: Vec<&str> = values[path].iter().map(String::as_str).collect();
        let row = client
            .query_one(
                "SELECT p.visitors::text = (SELECT hll_add_agg(hll_hash_text(v), 11, 5)::text \
                                            FROM unnest($2::text[]) v), p.peak \
                 FROM pages p WHERE path = $1",
                &[&path, &vals],
            )
            .await
            .unwrap();
        let (same, peak): (bool, i64) = (row.get(0), row.get(1));
        assert!(
            same,
            "{path}: the column holds one sketch of every value sent"
        );
        assert_eq!(peak, if path == "/b" { 1000 } else { 20 }, "{path}");
    }
    // A key without a row stays in tallyd.slots, exact there.
    let pending: i64 = client
        .query_one(
            "SELECT count(*) FROM tallyd.slots WHERE key = '/none' AND counter = 'visitors'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(pending > 0);
    let folded: i64 = client
        .query_one(
            "SELECT count(*) FROM tallyd.slots WHERE key IN ('/a', '/b')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(folded, 0, "every row of a key with a target row folded");
    h.stop().await;
}

#[test]
fn rollup_into_is_refused_for_last_and_for_windowed_kinds() {
    let config = |extra: &str| {
        let text = format!(
            "[[counters]]\nname = \"g\"\n{extra}\n[counters.rollup_into]\ntable = \"t\"\n\
             key_column = \"k\"\ncolumn = \"c\"\n"
        );
        toml::from_str::<tallyd::config::Config>(&text)
            .unwrap()
            .validate()
            .unwrap_err()
            .to_string()
    };
    let last = config("kind = \"last\"");
    assert!(
        last.contains("counters.g.rollup_into") && last.contains("event time"),
        "{last}"
    );
    let windowed = config("kind = \"unique\"\nwindow = \"day\"");
    assert!(windowed.contains("not for a unique counter"), "{windowed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_that_changes_a_kind_or_a_precision_under_stored_rows_is_refused() {
    let mut h = with_kinds(vec![kind_counter("visitors", "unique", "")]).await;
    let mut c = h.client().await;
    c.send(b"visitors k a\nvisitors k b\ndownloads k 1\n").await;
    assert_eq!(c.flush().await, (3, 0));
    h.stop_daemon().await;
    let refused = |edit: &'static str| {
        let mut config = (*h.config).clone();
        let db = h.db.clone();
        async move {
            for c in config.counters.iter_mut() {
                *c = match (c.name.as_str(), edit) {
                    ("visitors", "precision") => kind_counter("visitors", "unique", "log2m = 12"),
                    ("visitors", "kind") => kind_counter("visitors", "max", ""),
                    ("downloads", "sum") => kind_counter("downloads", "min", ""),
                    _ => continue,
                };
            }
            let mut client = db.connect().await.unwrap();
            tallyd::store::prepare(&mut client, &config)
                .await
                .expect_err("refused")
                .to_string()
        }
    };
    let err = refused("precision").await;
    assert!(
        err.contains("sketches of log2m 11, regwidth 5") && err.contains("log2m 12"),
        "{err}"
    );
    let err = refused("kind").await;
    assert!(
        err.contains("visitors") && err.contains("unique rows"),
        "{err}"
    );
    let err = refused("sum").await;
    assert!(
        err.contains("downloads") && err.contains("sum rows"),
        "{err}"
    );
    // Without rows, a counter may change: forget them first.
    h.sql()
        .await
        .batch_execute("DELETE FROM tallyd.slots WHERE counter = 'visitors'")
        .await
        .unwrap();
    let mut config = (*h.config).clone();
    config.counters.retain(|c| c.name != "visitors");
    config
        .counters
        .push(kind_counter("visitors", "unique", "log2m = 12"));
    let mut client = h.db.connect().await.unwrap();
    tallyd::store::prepare(&mut client, &config).await.unwrap();
    h.stop().await;
}

/// statsd gauges land in a `last` counter by their `|T` time, sets in a `unique` counter; a
/// relative gauge and a counter line into a unique counter change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statsd_gauges_and_sets_land_in_last_and_unique_counters() {
    let dir = common::temp_dir();
    let socket = dir.path().join("statsd.sock");
    let statsd_socket = socket.clone();
    let counters = vec![
        kind_counter("cpu", "last", "[statsd]\nmetric = \"cpu.*\""),
        kind_counter(
            "visitors",
            "unique",
            "[statsd]\nmetric = \"visitors\"\nkey_tag = \"page\"",
        ),
    ];
    let mut h = Harness::start(move |c| {
        c.statsd.set_socket(Some(statsd_socket));
        c.counters.extend(counters);
    })
    .await;
    let sock = tokio::net::UnixDatagram::unbound().unwrap();
    let datagram = "cpu.web1:42|g|T1700000001\n\
                    cpu.web1:7|g|T1700000000\n\
                    cpu.web1:+3|g\n\
                    visitors:alice|s|#page:home\n\
                    visitors:bob|s|#page:home\n\
                    visitors:alice|s|#page:home\n\
                    visitors:5|c|#page:home\n";
    sock.send_to(datagram.as_bytes(), &socket).await.unwrap();
    h.stop_daemon().await;
    let client = h.sql().await;
    let row = client
        .query_one(
            "SELECT value, count FROM tallyd.totals WHERE counter = 'cpu' AND key = 'web1'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (42, 2));
    let row = client
        .query_one(
            "SELECT cardinality, events::bigint FROM tallyd.unique_totals \
             WHERE counter = 'visitors' AND key = 'home' AND span = 'all'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (2, 3));
    h.stop().await;
}

/// A unique counter per UTC day with `also = ["week", "all"]`, ten days over two ISO weeks,
/// sent in three flushes with rollup steps between: each day's sketch is the extension's sketch
/// of that day's values, each week's equals both the union of its days (`hll_union_agg`) and one
/// sketch of the week's values, and the all-time row the sketch of every value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_weeks_sketch_is_the_union_of_its_days() {
    let counter = kind_counter(
        "daily_visitors",
        "unique",
        "window = \"day\"\ntime_zone = \"UTC\"\nalso = [\"week\", \"all\"]",
    );
    let h = Harness::start(move |c| c.counters.push(counter)).await;
    let client = h.sql().await;
    let mut c = h.client().await;
    // Friday 2026-11-20 to Sunday 2026-11-29: three days of the week of 11-16, seven of 11-23.
    let first = unix_ms("2026-11-20T00:00:00Z");
    let weeks = [
        unix_ms("2026-11-16T00:00:00Z"),
        unix_ms("2026-11-23T00:00:00Z"),
    ];
    let week_of = |day: i64| if day < 3 { weeks[0] } else { weeks[1] };
    // Below, at and above the explicit threshold (160 at log2m 11) and well into full sketches.
    let sizes = [5u64, 60, 160, 161, 1500, 30, 700, 2500, 90, 12];
    let mut rng = StdRng::seed_from_u64(5);
    let mut days: BTreeMap<i64, (BTreeSet<String>, i64)> = BTreeMap::new();
    let mut lines = Vec::new();
    for (d, n) in sizes.iter().enumerate() {
        let start = first + d as i64 * DAY;
        for _ in 0..*n {
            let value = format!("v{}", rng.gen_range(0..3000));
            // The first and last millisecond of the day too.
            let at = start + [0, DAY - 1, rng.gen_range(0..DAY)][rng.gen_range(0..3)];
            lines.push(format!("daily_visitors home {value} @{at}"));
            let day = days.entry(start).or_default();
            day.0.insert(value);
            day.1 += 1;
        }
    }
    let total = lines.len();
    for (i, part) in lines.chunks(total / 3 + 1).enumerate() {
        c.send(&buf_of(part.iter().cloned())).await;
        assert_eq!(flush(&mut c).await, (part.len() as u64, 0));
        if i < 2 {
            assert!(rollup_step(&client, 7).await > 0);
        }
    }
    let params = (11, 5);
    for (start, (values, events)) in &days {
        let ours = sketch_of(&client, "daily_visitors", "home", Some(("day", *start)))
            .await
            .expect("the day's sketch");
        assert_eq!(ours.2, *events, "day {start}: events");
        assert_eq!(
            (ours.0, ours.1),
            sql_sketch(&client, values, params).await,
            "day {start}: {} values",
            values.len()
        );
    }
    let union_of_days = |from: i64, to: i64| {
        let client = &client;
        async move {
            let row = client
                .query_one(
                    "SELECT round(hll_cardinality(hll_union_agg(sketch)))::bigint, \
                            hll_union_agg(sketch)::text FROM tallyd.unique_totals \
                     WHERE counter = 'daily_visitors' AND key = 'home' AND span = 'day' \
                       AND window_start >= 'epoch'::timestamptz + $1::bigint * interval '1 millisecond' \
                       AND window_start < 'epoch'::timestamptz + $2::bigint * interval '1 millisecond'",
                    &[&from, &to],
                )
                .await
                .unwrap();
            (row.get::<_, i64>(0), row.get::<_, String>(1))
        }
    };
    for week in weeks {
        let mut values = BTreeSet::new();
        let mut events = 0;
        for (start, (v, n)) in &days {
            if week_of((start - first) / DAY) == week {
                values.extend(v.iter().cloned());
                events += n;
            }
        }
        let ours = sketch_of(&client, "daily_visitors", "home", Some(("week", week)))
            .await
            .expect("the week's sketch");
        assert_eq!(ours.2, events, "week {week}: events");
        let days_union = union_of_days(week, week + 7 * DAY).await;
        assert_eq!(
            (ours.0, ours.1.clone()),
            days_union,
            "week {week}: the union of its days"
        );
        assert_eq!(
            days_union,
            sql_sketch(&client, &values, params).await,
            "week {week}: one sketch of its {} values",
            values.len()
        );
    }
    let all: BTreeSet<String> = days.values().flat_map(|(v, _)| v.iter().cloned()).collect();
    let ours = sketch_of(&client, "daily_visitors", "home", None)
        .await
        .expect("the all-time sketch");
    assert_eq!(ours.2, total as i64);
    assert_eq!(
        (ours.0, ours.1.clone()),
        union_of_days(first, first + 10 * DAY).await
    );
    assert_eq!((ours.0, ours.1), sql_sketch(&client, &all, params).await);
    drop(c);
    h.stop().await;
}

/// A million distinct values into one key, over ten flushes, a rollup step and a restart: the
/// cardinality is within 3 standard errors (1.04 / sqrt(2^11)) of the exact count, and the
/// sketch is the one SQL builds from the same values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_distinct_values_within_three_standard_errors() {
    const N: u64 = 1_000_000;
    let mut h = Harness::start(|c| c.counters.push(kind_counter("uniq", "unique", ""))).await;
    let client = h.sql().await;
    let started = Instant::now();
    let mut c = h.client().await;
    for part in 0..10 {
        let lines: String = (part * N / 10..(part + 1) * N / 10)
            .map(|i| format!("uniq page u{i}\n"))
            .collect();
        c.send(lines.as_bytes()).await;
        assert_eq!(flush(&mut c).await, (N / 10, 0));
        if part == 4 {
            assert!(rollup_step(&client, 1000).await > 0);
            drop(c);
            h.stop_daemon().await;
            h.start_daemon().await;
            c = h.client().await;
        }
    }
    let elapsed = started.elapsed();
    let ours = sketch_of(&client, "uniq", "page", None)
        .await
        .expect("the all-time sketch");
    let theirs = client
        .query_one(
            "SELECT round(hll_cardinality(s))::bigint, s::text FROM \
             (SELECT hll_add_agg(hll_hash_text('u' || i)) AS s \
              FROM generate_series(0, $1::bigint - 1) i) x",
            &[&(N as i64)],
        )
        .await
        .unwrap();
    let error = (ours.0 as f64 - N as f64).abs() / N as f64;
    let bound = 3.0 * 1.04 / 2048f64.sqrt();
    println!(
        "{N} distinct values in {:.1}s: cardinality {} (relative error {:.4}, bound {bound:.4})",
        elapsed.as_secs_f64(),
        ours.0,
        error
    );
    assert!(error <= bound, "relative error {error} over {bound}");
    assert_eq!(ours.2, N as i64);
    assert_eq!(
        (ours.0, ours.1),
        (theirs.get(0), theirs.get(1)),
        "the sketch SQL builds of the same values"
    );
    drop(c);
    h.stop().await;
}

/// The config of a `tallyd run` on the external database `conninfo` with `counters`, written
/// as `dir/<name>.toml` (its log goes to `dir/<name>.log`).
fn binary_config(dir: &Path, conninfo: &str, counters: Vec<CounterConfig>, name: &str) -> PathBuf {
    TestConfig::new(dir)
        .external(conninfo, "kinds")
        .with(|c| c.counters = counters)
        .write_as(&format!("{name}.toml"))
}

/// Starts `tallyd run` on `config`: the daemon once it answers, or its log if it exited first.
fn start(config: &Path) -> Result<Daemon, String> {
    Daemon::try_spawn_with(Path::new(common::BIN), config, |_| {})
}

/// Asserts that `tallyd run` on `config` refuses to start, and returns the error it printed
/// (its line `tallyd: ...`).
fn refused(config: &Path) -> String {
    if let Ok(daemon) = start(config) {
        assert!(daemon.terminate().success());
        panic!("{} started, where it must be refused", config.display());
    }
    // The log is copied from the daemon's stderr by a thread of the test kit, which may not
    // have written the last line yet when the exit is seen.
    let path = config.with_extension("log");
    let printed = || {
        let log = std::fs::read_to_string(&path).unwrap_or_default();
        log.lines()
            .find_map(|l| l.strip_prefix("tallyd: ").map(String::from))
    };
    wait_until_blocking("the error `tallyd run` prints", || printed().is_some());
    let error = printed().unwrap();
    println!("{}: {error}", config.display());
    assert!(!error.contains(".."), "{error}");
    error
}

/// On a database where tallyd's role may not `CREATE EXTENSION hll` (a role that is not a
/// superuser, owning its database), a unique counter refuses the start, naming the counter and
/// the statement; only sum counters start and count; once an administrator has created the
/// extension there, the unique counter starts and counts as the extension does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unique_counter_needs_the_extension_and_only_it_does() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let admin = sql(&pg.connection_string("postgres")).await;
    for statement in ["CREATE ROLE app LOGIN", "CREATE DATABASE appdb OWNER app"] {
        admin.batch_execute(statement).await.unwrap();
    }
    let conninfo = pg
        .connection_string("appdb")
        .replace("user=postgres", "user=app");
    let app = sql(&conninfo).await;
    let sums = vec![common::counter(
        "downloads",
        tallyd::config::KeyTypeName::Text,
    )];
    let mut with_unique = sums.clone();
    with_unique.push(kind_counter("visitors", "unique", ""));

    let log = refused(&binary_config(
        dir.path(),
        &conninfo,
        with_unique.clone(),
        "unique-1",
    ));
    assert!(
        log.contains("counter visitors") && log.contains("CREATE EXTENSION hll"),
        "{log}"
    );
    let installed = "SELECT count(*) FROM pg_extension WHERE extname = 'hll'";
    assert_eq!(scalar(&app, installed).await, 0);

    let sums_only = binary_config(dir.path(), &conninfo, sums, "sums");
    let daemon = start(&sums_only).expect("only sum counters start without the extension");
    let mut c = LineClient::connect(daemon.socket()).await;
    c.send(b"downloads report.pdf 3\n").await;
    assert_eq!(flush(&mut c).await, (1, 0));
    drop(c);
    assert!(daemon.terminate().success());
    assert_eq!(common::key_total(&app, "downloads", "report.pdf").await, 3);
    assert_eq!(scalar(&app, installed).await, 0);
    // Still refused, now that tallyd's schema is there.
    let log = refused(&binary_config(
        dir.path(),
        &conninfo,
        with_unique.clone(),
        "unique-2",
    ));
    assert!(log.contains("counter visitors"), "{log}");

    // The statement the message names, run by an administrator.
    sql(&pg.connection_string("appdb"))
        .await
        .batch_execute("CREATE EXTENSION hll")
        .await
        .unwrap();
    let daemon = start(&binary_config(
        dir.path(),
        &conninfo,
        with_unique.clone(),
        "unique-3",
    ))
    .expect("a unique counter starts once the extension exists");
    let mut rng = StdRng::seed_from_u64(6);
    let mut sent: BTreeMap<String, (BTreeSet<String>, i64)> = BTreeMap::new();
    let lines: Vec<String> = (0..500)
        .map(|_| {
            let (key, value) = (
                format!("k{}", rng.gen_range(0..5)),
                format!("v{}", rng.gen_range(0..400)),
            );
            let kept = sent.entry(key.clone()).or_default();
            kept.0.insert(value.clone());
            kept.1 += 1;
            format!("visitors {key} {value}")
        })
        .collect();
    let mut c = LineClient::connect(daemon.socket()).await;
    c.send(&buf_of(lines)).await;
    assert_eq!(flush(&mut c).await, (500, 0));
    assert_uniques(&app, "visitors", &sent, (11, 5)).await;
    drop(c);
    assert!(daemon.terminate().success());
    drop((app, admin));
    common::stop_postgres(pg).await;
}

/// `counters` with `name` declared again as `kind` (with `extra` keys).
fn redeclared(
    counters: &[CounterConfig],
    name: &str,
    kind: &str,
    extra: &str,
) -> Vec<CounterConfig> {
    counters
        .iter()
        .map(|c| {
            if c.name == name {
                kind_counter(name, kind, extra)
            } else {
                c.clone()
            }
        })
        .collect()
}

/// A counter whose kind or sketch precision changes between starts while rows of it remain is
/// refused with a message naming the counter, what it was and what it is now, and nothing
/// changes; with its rows deleted, the change is accepted and the counter counts by its new
/// kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_kind_or_precision_is_refused_while_rows_remain() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let client = sql(&conninfo).await;
    let counters = vec![
        common::counter("downloads", tallyd::config::KeyTypeName::Text),
        kind_counter("peak", "max", ""),
        kind_counter("visitors", "unique", ""),
    ];
    let config = binary_config(dir.path(), &conninfo, counters.clone(), "first");
    let daemon = start(&config).unwrap();
    let mut c = LineClient::connect(daemon.socket()).await;
    c.send(b"downloads a 5\npeak k 7\npeak k -3\nvisitors k x\nvisitors k y\n")
        .await;
    assert_eq!(flush(&mut c).await, (5, 0));
    drop(c);
    assert!(daemon.terminate().success());

    let cases = [
        (
            redeclared(&counters, "peak", "min", ""),
            ["counter peak is declared min", "its rows in the database hold max rows"],
        ),
        (
            redeclared(&counters, "visitors", "unique", "log2m = 12"),
            [
                "counter visitors is declared unique (log2m 12, regwidth 5)",
                "hold sketches of log2m 11, regwidth 5: sketches of different parameters cannot be unioned",
            ],
        ),
        (
            redeclared(&counters, "visitors", "unique", "regwidth = 4"),
            ["declared unique (log2m 11, regwidth 4)", "hold sketches of log2m 11, regwidth 5"],
        ),
        (
            redeclared(&counters, "visitors", "last", ""),
            ["counter visitors is declared last", "hold unique rows"],
        ),
        (
            redeclared(&counters, "downloads", "max", ""),
            ["counter downloads is declared max", "hold sum rows: sums are not values"],
        ),
    ];
    for (i, (changed, said)) in cases.into_iter().enumerate() {
        let log = refused(&binary_config(
            dir.path(),
            &conninfo,
            changed,
            &format!("changed-{i}"),
        ));
        for s in said {
            assert!(log.contains(s), "case {i}: {s:?} not in\n{log}");
        }
    }
    // Nothing changed.
    let peak = BTreeMap::from([("k".to_string(), (2, 7))]);
    assert_values(&client, "peak", "max", &peak).await;
    let values = BTreeSet::from(["x".to_string(), "y".to_string()]);
    let visitors = BTreeMap::from([("k".to_string(), (values, 2))]);
    assert_uniques(&client, "visitors", &visitors, (11, 5)).await;

    // With their rows deleted, peak becomes a min and visitors takes log2m 12.
    client
        .batch_execute(
            "DELETE FROM tallyd.slots WHERE counter IN ('peak', 'visitors'); \
             DELETE FROM tallyd.rollups WHERE counter IN ('peak', 'visitors')",
        )
        .await
        .unwrap();
    let changed = redeclared(
        &redeclared(&counters, "peak", "min", ""),
        "visitors",
        "unique",
        "log2m = 12",
    );
    let daemon = start(&binary_config(
        dir.path(),
        &conninfo,
        changed.clone(),
        "accepted",
    ))
    .expect("a change with no rows is accepted");
    let mut rng = StdRng::seed_from_u64(8);
    let mut low: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    let mut distinct: BTreeMap<String, (BTreeSet<String>, i64)> = BTreeMap::new();
    let mut lines = Vec::new();
    for _ in 0..400 {
        let key = format!("k{}", rng.gen_range(0..3));
        let value: i64 = rng.gen_range(-1_000_000..=1_000_000);
        let kept = low.entry(key.clone()).or_insert((0, i64::MAX));
        *kept = (kept.0 + 1, kept.1.min(value));
        lines.push(format!("peak {key} {value}"));
        let v = format!("v{}", rng.gen_range(0..1000));
        let kept = distinct.entry(key.clone()).or_default();
        kept.0.insert(v.clone());
        kept.1 += 1;
        lines.push(format!("visitors {key} {v}"));
    }
    let mut c = LineClient::connect(daemon.socket()).await;
    c.send(&buf_of(lines)).await;
    assert_eq!(flush(&mut c).await, (800, 0));
    assert_values(&client, "peak", "min", &low).await;
    assert_uniques(&client, "visitors", &distinct, (12, 5)).await;
    drop(c);
    assert!(daemon.terminate().success());
    // And the check follows the rows: going back is a change again.
    let log = refused(&binary_config(dir.path(), &conninfo, counters, "back"));
    assert!(log.contains("hold min rows"), "{log}");
    drop(client);
    common::stop_postgres(pg).await;
}

/// Rows an older tallyd (before counter kinds, migrations up to V11) wrote are sums: a start
/// that declares their counter another kind is refused, as if the sum had been recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sums_written_before_kinds_existed_refuse_another_kind() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let mut client = sql(&conninfo).await;
    tallyd::store::migrate_up_to(&mut client, 11).await.unwrap();
    client
        .batch_execute(
            "INSERT INTO tallyd.slots (counter, key, slot, count, first_seen, last_seen)
             VALUES ('downloads', 'a', 0, 42, now(), now())",
        )
        .await
        .unwrap();
    let counters = vec![kind_counter("downloads", "max", "")];
    let log = refused(&binary_config(dir.path(), &conninfo, counters, "upgraded"));
    assert!(
        log.contains("counter downloads is declared max") && log.contains("hold sum rows"),
        "{log}"
    );
    // Declared a sum, as it was, it starts and goes on counting.
    let sums = vec![common::counter(
        "downloads",
        tallyd::config::KeyTypeName::Text,
    )];
    let daemon = start(&binary_config(dir.path(), &conninfo, sums, "as-before")).unwrap();
    let mut c = LineClient::connect(daemon.socket()).await;
    c.send(b"downloads a 8\n").await;
    assert_eq!(flush(&mut c).await, (1, 0));
    drop(c);
    assert!(daemon.terminate().success());
    assert_eq!(common::key_total(&client, "downloads", "a").await, 50);
    drop(client);
    common::stop_postgres(pg).await;
}

/// `DROP EXTENSION hll CASCADE` under a running tallyd (it takes `tallyd.unique_totals` with
/// it) holds back only the unique counter's rows: on the one flush worker they share, the sum
/// and max keys keep committing and a connection that sent only them has its `!flush`
/// answered, while the one that sent unique events waits; the held rows are reported (the log
/// names the counter and the fix, the gauge counts them). After `CREATE EXTENSION hll` the held
/// rows commit, the waiting `!flush` is answered and the view is back, every sketch the
/// extension's own. Dropped again, then kill -9 while rows are held (the sums committed
/// meanwhile): the next start (which creates the extension) replays the held unique lines and
/// no sum twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_extension_holds_back_only_the_unique_rows() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let client = sql(&conninfo).await;
    let port = common::free_port();
    let config = TestConfig::new(dir.path())
        .external(&conninfo, "held")
        .fast()
        .metrics_port(port)
        .with(|c| {
            c.flush.connections = 1;
            c.counters = vec![
                common::counter("downloads", tallyd::config::KeyTypeName::Text),
                kind_counter("peak", "max", ""),
                kind_counter("visitors", "unique", ""),
            ];
        })
        .write();
    let daemon = start(&config).expect("starts");
    let mut uniques: BTreeMap<String, (BTreeSet<String>, i64)> = BTreeMap::new();
    let mut downloads = 0i64;
    // One round: `u` sends unique and sum events, `s` sums and max values only.
    let mut round = |uniques: &mut BTreeMap<String, (BTreeSet<String>, i64)>, r: i64| {
        let mut u_lines = Vec::new();
        let mut s_lines = Vec::new();
        for i in 0..200 {
            let (key, value) = (format!("k{}", i % 4), format!("v{}-{}", r, i % 50));
            let kept = uniques.entry(key.clone()).or_default();
            kept.0.insert(value.clone());
            kept.1 += 1;
            u_lines.push(format!("visitors {key} {value}"));
            u_lines.push("downloads file 1".to_string());
            s_lines.push("downloads file 2".to_string());
            s_lines.push(format!("peak p {}", r * 1000 + i));
            downloads += 3;
        }
        (buf_of(u_lines), buf_of(s_lines), downloads, r * 1000 + 199)
    };
    let mut u = LineClient::connect(daemon.socket()).await;
    let mut s = LineClient::connect(daemon.socket()).await;
    let (ul, sl, _, _) = round(&mut uniques, 1);
    u.send(&ul).await;
    s.send(&sl).await;
    assert_eq!(flush(&mut u).await, (400, 0));
    assert_eq!(flush(&mut s).await, (400, 0));
    assert_uniques(&client, "visitors", &uniques, (11, 5)).await;

    let view =
        "SELECT count(*) FROM pg_views WHERE schemaname = 'tallyd' AND viewname = 'unique_totals'";
    client
        .batch_execute("DROP EXTENSION hll CASCADE")
        .await
        .unwrap();
    assert_eq!(scalar(&client, view).await, 0, "CASCADE took the view");
    let (ul, sl, downloads, peak) = round(&mut uniques, 2);
    u.send(&ul).await;
    s.send(&sl).await;
    // The unique counter's trouble is its own: the sum-only connection is answered.
    assert_eq!(flush(&mut s).await, (400, 0));
    // `u`'s sums share its `!flush` with its unique events: it waits for them.
    let mut u_flush = tokio::spawn(async move {
        let acked = u.flush().await;
        (u, acked)
    });
    wait_until_blocking("the held rows reported", || {
        daemon.log().contains("CREATE EXTENSION hll")
            && daemon
                .scrape()
                .sum("tallyd_flush_unique_rows_held")
                .is_some_and(|n| n > 0.0)
    });
    let log = daemon.log();
    let line = log
        .lines()
        .find(|l| l.contains("held back"))
        .expect("the held rows' log line");
    assert!(line.contains("visitors"), "{line}");
    assert!(
        tokio::time::timeout(Duration::from_millis(1500), &mut u_flush)
            .await
            .is_err(),
        "a `!flush` after unique events waits while they are held"
    );
    // Every sum is committed meanwhile (a `!flush` of `s` covers what it sent, and `u`'s sums
    // on the same worker go with each flight).
    assert_eq!(flush(&mut s).await, (0, 0));
    let deadline = Instant::now() + BOUND;
    while common::key_total(&client, "downloads", "file").await != downloads {
        assert!(Instant::now() < deadline, "the sums were not all committed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_values(
        &client,
        "peak",
        "max",
        &BTreeMap::from([("p".to_string(), (400, peak))]),
    )
    .await;
    // The rollup (pg_cron's call, here by hand) folds the other counters meanwhile.
    let folded: i64 = client
        .query_one("SELECT tallyd.rollup(100000)", &[])
        .await
        .expect("the rollup runs without the extension")
        .get(0);
    assert!(folded > 0, "the sums and max rows fold");
    assert_eq!(
        common::key_total(&client, "downloads", "file").await,
        downloads
    );

    client.batch_execute("CREATE EXTENSION hll").await.unwrap();
    let (u, acked) = tokio::time::timeout(BOUND, u_flush)
        .await
        .expect("answered once the extension is back")
        .unwrap();
    assert_eq!(acked, (400, 0));
    let mut u = u;
    assert_eq!(scalar(&client, view).await, 1, "the view is back");
    assert_uniques(&client, "visitors", &uniques, (11, 5)).await;
    assert_eq!(
        common::key_total(&client, "downloads", "file").await,
        downloads
    );
    wait_until_blocking("the gauge back at 0", || {
        daemon.scrape().sum("tallyd_flush_unique_rows_held") == Some(0.0)
    });

    // Dropped again: held, the sums committed, then kill -9.
    client
        .batch_execute("DROP EXTENSION hll CASCADE")
        .await
        .unwrap();
    let (ul, sl, downloads, peak) = round(&mut uniques, 3);
    u.send(&ul).await;
    u.sync().await;
    s.send(&sl).await;
    assert_eq!(flush(&mut s).await, (400, 0));
    let deadline = Instant::now() + BOUND;
    while common::key_total(&client, "downloads", "file").await != downloads {
        assert!(Instant::now() < deadline, "the sums were not all committed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_until_blocking("rows held again", || {
        daemon
            .scrape()
            .sum("tallyd_flush_unique_rows_held")
            .is_some_and(|n| n > 0.0)
    });
    // The ledger keeps the held lines uncovered while the sums' are covered.
    let (all, unique) = common::scalar_pair(
        &client,
        "SELECT max(journal_covered), min(unique_covered) FROM tallyd.flushes",
    )
    .await;
    assert!(
        unique < all,
        "unique_covered {unique}, journal_covered {all}"
    );
    drop((u, s));
    daemon.kill();
    // The next start creates the extension (tallyd's role may) and replays what was held.
    let daemon = start(&config).expect("restarts");
    let mut c = LineClient::connect(daemon.socket()).await;
    assert_eq!(flush(&mut c).await, (0, 0));
    assert_eq!(scalar(&client, view).await, 1);
    assert_uniques(&client, "visitors", &uniques, (11, 5)).await;
    assert_eq!(
        common::key_total(&client, "downloads", "file").await,
        downloads,
        "no sum replayed twice"
    );
    assert_values(
        &client,
        "peak",
        "max",
        &BTreeMap::from([("p".to_string(), (600, peak))]),
    )
    .await;
    drop(c);
    assert!(daemon.terminate().success());
    drop(client);
    common::stop_postgres(pg).await;
}
