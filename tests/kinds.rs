//! Counter kinds end to end against real PostgreSQL with postgresql-hll: unique counters'
//! sketches equal the extension's own `hll_add_agg(hll_hash_text(value), log2m, regwidth)` of
//! the same values, through flushes, slots, rollups and windows; max, min and last exact
//! against what the test sent; bad values rejected and counted, changing nothing.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{buf_of, Harness};
use tallyd::config::CounterConfig;
use tokio_postgres::Client;

fn kind_counter(name: &str, kind: &str, extra: &str) -> CounterConfig {
    toml::from_str(&format!("name = {name:?}\nkind = {kind:?}\n{extra}")).expect("counter")
}

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
    (log2m, regwidth): (i32, i32),
) -> ((i64, String), (i64, String)) {
    let values: Vec<&str> = values.iter().map(String::as_str).collect();
    let ours = client
        .query_one(
            "SELECT cardinality, sketch::text FROM tallyd.unique_totals \
             WHERE counter = $1 AND key = $2 AND span = 'all'",
            &[&counter, &key],
        )
        .await
        .unwrap();
    let theirs = client
        .query_one(
            "SELECT round(hll_cardinality(s))::bigint, s::text FROM \
             (SELECT hll_add_agg(hll_hash_text(v), $2, $3) AS s FROM unnest($1::text[]) v) x",
            &[&values, &log2m, &regwidth],
        )
        .await
        .unwrap();
    ((ours.get(0), ours.get(1)), (theirs.get(0), theirs.get(1)))
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
                let declared = match (c.name.as_str(), edit) {
                    ("visitors", "precision") => {
                        "name = \"visitors\"\nkind = \"unique\"\nlog2m = 12"
                    }
                    ("visitors", "kind") => "name = \"visitors\"\nkind = \"max\"",
                    ("downloads", "sum") => "name = \"downloads\"\nkind = \"min\"",
                    _ => continue,
                };
                *c = toml::from_str(declared).unwrap();
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
