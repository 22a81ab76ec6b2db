//! Time-windowed counters against a real PostgreSQL: events land in the window of their event
//! time (`@unix_ms`, statsd `|T`, else arrival) in the counter's zone, across midnight, DST
//! changes both ways, ISO weeks over a year end and month ends; coarser windows and the
//! all-time total are written in the same transaction and always agree; retention deletes old
//! windows and rejects expired events with their own reason; kill -9 after `!sync` and the
//! replay of a Berlin day, then `tallyd get` showing the windows; statsd `|T` event times; a
//! reload that adds a windowed counter under running connections. Every total is checked
//! against what the test itself sent. Windows with `also` under every fault: tests/faults.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{
    buf_of, count_of, free_port, sql, temp_dir, unix_ms as ms, utc, windowed_counter, windows_of,
    Harness, LineClient, TestConfig,
};
use tallyd::config::{CounterConfig, CounterStatsd, Sampled};

fn expect(rows: &[(&str, &str, i64)]) -> BTreeMap<(String, String), i64> {
    rows.iter()
        .map(|(span, start, n)| ((span.to_string(), start.to_string()), *n))
        .collect()
}

/// Sends `events` (key, delta, RFC 3339 event time) for `counter` and waits for the commit.
async fn send(c: &mut LineClient, counter: &str, events: &[(&str, i64, &str)]) {
    let lines = buf_of(
        events
            .iter()
            .map(|(key, delta, at)| format!("{counter} {key} {delta} @{}", ms(at))),
    );
    c.send(&lines).await;
    assert_eq!(c.flush().await, (events.len() as u64, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn days_in_utc_and_across_berlin_dst_changes_both_ways() {
    let h = Harness::start(|c| {
        c.counters = vec![
            windowed_counter("utc_day", "day", "UTC", &["all"]),
            windowed_counter("berlin_day", "day", "Europe/Berlin", &["all"]),
        ];
    })
    .await;
    let mut c = h.client().await;
    send(
        &mut c,
        "utc_day",
        &[
            ("k", 1, "2026-11-24T23:59:59.999Z"),
            ("k", 2, "2026-11-25T00:00:00Z"),
            ("k", 4, "2026-11-25T12:00:00Z"),
        ],
    )
    .await;
    assert_eq!(
        windows_of(&h.sql().await, "utc_day", "k").await,
        expect(&[
            ("day", "2026-11-24T00:00:00Z", 1),
            ("day", "2026-11-25T00:00:00Z", 6)
        ])
    );
    assert_eq!(count_of(&h.sql().await, "utc_day", "k").await, Some(7));

    // 2026-03-29 in Berlin is 23 hours long (CET to CEST at 02:00 local), 2026-10-25 is 25.
    send(
        &mut c,
        "berlin_day",
        &[
            // 2026-03-28 23:59 CET, then the first and last minutes of the 23-hour day.
            ("k", 1, "2026-03-28T22:59:00Z"),
            ("k", 2, "2026-03-28T23:00:00Z"),
            ("k", 4, "2026-03-29T21:59:59Z"),
            // 2026-03-30 00:00 CEST.
            ("k", 8, "2026-03-29T22:00:00Z"),
            // The 25-hour day: from 2026-10-24T22:00Z to 2026-10-25T23:00Z.
            ("k", 16, "2026-10-24T22:00:00Z"),
            ("k", 32, "2026-10-25T22:59:59Z"),
            ("k", 64, "2026-10-25T23:00:00Z"),
        ],
    )
    .await;
    assert_eq!(
        windows_of(&h.sql().await, "berlin_day", "k").await,
        expect(&[
            ("day", "2026-03-27T23:00:00Z", 1),
            ("day", "2026-03-28T23:00:00Z", 6),
            ("day", "2026-03-29T22:00:00Z", 8),
            ("day", "2026-10-24T22:00:00Z", 48),
            ("day", "2026-10-25T23:00:00Z", 64),
        ])
    );
    assert_eq!(count_of(&h.sql().await, "berlin_day", "k").await, Some(127));
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iso_weeks_over_a_year_end_month_ends_and_half_hour_zones() {
    // Installs this process's metrics recorder before the daemon reports anything.
    tokio::task::spawn_blocking(common::process_metrics)
        .await
        .unwrap();
    let h = Harness::start(|c| {
        c.counters = vec![
            windowed_counter("weekly", "week", "UTC", &[]),
            windowed_counter("daily", "day", "UTC", &["month", "all"]),
            windowed_counter("kolkata", "hour", "Asia/Kolkata", &[]),
            windowed_counter("kathmandu", "hour", "Asia/Kathmandu", &[]),
        ];
    })
    .await;
    let mut c = h.client().await;
    // 2026-12-28 is a Monday: through Sunday 2027-01-03 one ISO week; 2027-01-04 the next.
    send(
        &mut c,
        "weekly",
        &[
            ("k", 1, "2026-12-28T00:00:00Z"),
            ("k", 2, "2026-12-31T23:59:59Z"),
            ("k", 4, "2027-01-03T23:59:59.999Z"),
            ("k", 8, "2027-01-04T00:00:00Z"),
        ],
    )
    .await;
    assert_eq!(
        windows_of(&h.sql().await, "weekly", "k").await,
        expect(&[
            ("week", "2026-12-28T00:00:00Z", 7),
            ("week", "2027-01-04T00:00:00Z", 8)
        ])
    );
    assert_eq!(
        count_of(&h.sql().await, "weekly", "k").await,
        None,
        "no all-time row unless asked"
    );

    // Month ends, with the month windows written beside the days.
    send(
        &mut c,
        "daily",
        &[
            ("k", 1, "2028-02-28T23:59:59Z"),
            ("k", 2, "2028-02-29T00:00:00Z"),
            ("k", 4, "2028-02-29T23:59:59.999Z"),
            ("k", 8, "2028-03-01T00:00:00Z"),
        ],
    )
    .await;
    assert_eq!(
        windows_of(&h.sql().await, "daily", "k").await,
        expect(&[
            ("day", "2028-02-28T00:00:00Z", 1),
            ("day", "2028-02-29T00:00:00Z", 6),
            ("day", "2028-03-01T00:00:00Z", 8),
            ("month", "2028-02-01T00:00:00Z", 7),
            ("month", "2028-03-01T00:00:00Z", 8),
        ])
    );
    assert_eq!(count_of(&h.sql().await, "daily", "k").await, Some(15));
    // The oldest window that flush wrote is 2028-02-28 (its day), not the month it is in.
    let samples = tokio::task::spawn_blocking(common::process_metrics)
        .await
        .unwrap();
    assert_eq!(
        samples.value("tallyd_window_oldest_written_seconds{counter=\"daily\"}"),
        (ms("2028-02-28T00:00:00Z") / 1000) as f64
    );

    // +05:30 and +05:45: hours start at local whole hours.
    send(
        &mut c,
        "kolkata",
        &[
            ("k", 1, "2026-11-25T05:29:59Z"),
            ("k", 2, "2026-11-25T05:30:00Z"),
        ],
    )
    .await;
    assert_eq!(
        windows_of(&h.sql().await, "kolkata", "k").await,
        expect(&[
            ("hour", "2026-11-25T04:30:00Z", 1),
            ("hour", "2026-11-25T05:30:00Z", 2)
        ])
    );
    send(
        &mut c,
        "kathmandu",
        &[
            ("k", 1, "2026-11-25T05:14:59Z"),
            ("k", 2, "2026-11-25T05:15:00Z"),
        ],
    )
    .await;
    assert_eq!(
        windows_of(&h.sql().await, "kathmandu", "k").await,
        expect(&[
            ("hour", "2026-11-25T04:15:00Z", 1),
            ("hour", "2026-11-25T05:15:00Z", 2)
        ])
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_and_all_time_agree_under_load_and_rollups() {
    let h = Harness::start(|c| {
        c.counters = vec![windowed_counter(
            "downloads",
            "day",
            "Europe/Berlin",
            &["month", "all"],
        )];
        c.flush.set_interval(Duration::from_millis(20));
        c.rollup.enabled = true;
        c.rollup.set_interval(Duration::from_millis(50));
    })
    .await;
    // Late and current events for 50 keys over 40 days, from 4 connections.
    let mut tasks = Vec::new();
    for i in 0..4 {
        let socket = h.socket().to_path_buf();
        tasks.push(tokio::spawn(async move {
            let mut c = LineClient::connect(&socket).await;
            let base = ms("2026-10-01T00:00:00Z");
            for round in 0..20 {
                let lines = buf_of((0..500).map(|n| {
                    let at = base + ((n * 7 + round * 13 + i) % 40) as i64 * 86_400_000 + n as i64;
                    format!("downloads v{} 1 @{at}", n % 50)
                }));
                c.send(&lines).await;
                assert_eq!(c.flush().await, (500, 0));
            }
        }));
    }
    let client = h.sql().await;
    let sums = "SELECT (SELECT coalesce(sum(count), 0) FROM tallyd.window_totals WHERE counter = 'downloads' AND span = 'day')::bigint, \
                       (SELECT coalesce(sum(count), 0) FROM tallyd.window_totals WHERE counter = 'downloads' AND span = 'month')::bigint, \
                       (SELECT coalesce(sum(count), 0) FROM tallyd.totals WHERE counter = 'downloads')::bigint";
    let mut samples = 0;
    loop {
        let done = tasks.iter().all(|t| t.is_finished());
        let row = client.query_one(sums, &[]).await.unwrap();
        let (days, months, total): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        // Every reader sees the three agree: they are written in one transaction, and the
        // rollup moves rows of all three together.
        assert_eq!((days, months), (total, total), "sample {samples}");
        samples += 1;
        if done {
            break;
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let row = client.query_one(sums, &[]).await.unwrap();
    assert_eq!(
        (
            row.get::<_, i64>(0),
            row.get::<_, i64>(1),
            row.get::<_, i64>(2)
        ),
        (40_000, 40_000, 40_000)
    );
    let rolled: i64 = client
        .query_one(
            "SELECT count(*) FROM tallyd.rollups WHERE counter = 'downloads' AND span <> 'all'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(rolled > 0, "the rollup folded windowed rows");
    println!("{samples} samples: days, months and all-time always agreed; {rolled} window rows rolled up");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_old_windows_and_rejects_expired_events() {
    // Installs this process's metrics recorder before the daemon reports anything.
    tokio::task::spawn_blocking(common::process_metrics)
        .await
        .unwrap();
    let h = Harness::start(|c| {
        let mut recent = windowed_counter("recent", "day", "UTC", &["all"]);
        recent.keep_windows = Some(3);
        c.counters = vec![recent];
        c.rollup.enabled = true;
        c.rollup.set_interval(Duration::from_millis(50));
    })
    .await;
    let day = 86_400_000i64;
    let now = tallyd::clock::now_ms();
    let today = now - now.rem_euclid(day);
    let client = h.sql().await;
    // Rows written earlier (when their days were kept): slot and rollup rows of five days,
    // three of them older than the three windows kept now.
    for (back, table) in [
        (10, "slots"),
        (4, "rollups"),
        (3, "slots"),
        (2, "slots"),
        (0, "rollups"),
    ] {
        let (cols, vals) = if table == "slots" {
            (
                "counter, key, span, win, slot, count, first_seen, last_seen",
                "$1, 'k', 'day', to_timestamp($2::float8 / 1000), 0, 5, now(), now()",
            )
        } else {
            (
                "counter, key, span, win, count, first_seen, last_seen",
                "$1, 'k', 'day', to_timestamp($2::float8 / 1000), 5, now(), now()",
            )
        };
        client
            .execute(
                &format!("INSERT INTO tallyd.{table} ({cols}) VALUES ({vals})"),
                &[&"recent", &((today - back * day) as f64)],
            )
            .await
            .unwrap();
    }
    // The rollup deletes the three old windows, and no more.
    let kept = loop {
        let kept: i64 = client
            .query_one(
                "SELECT count(*) FROM tallyd.window_totals WHERE counter = 'recent'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if kept <= 2 {
            break kept;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(kept, 2);

    // An event in the oldest kept window is taken; one a day older is rejected, with its own
    // reason, and changes nothing.
    let mut c = h.client().await;
    let oldest_kept = today - 2 * day;
    let lines = format!(
        "!errors\nrecent k 1 @{oldest_kept}\nrecent k 1 @{}\n!flush\n",
        oldest_kept - 1
    );
    c.send(lines.as_bytes()).await;
    assert_eq!(c.read_line().await, "ok\n");
    let rejected = c.read_line().await;
    assert!(
        rejected.starts_with("rejected 3 expired \"recent k 1 @"),
        "{rejected}"
    );
    assert_eq!(c.read_line().await, "ok 1 1\n");
    assert_eq!(
        windows_of(&h.sql().await, "recent", "k").await,
        [
            (("day".to_string(), utc(oldest_kept)), 6),
            (("day".to_string(), utc(today)), 5),
        ]
        .into_iter()
        .collect()
    );
    assert_eq!(count_of(&h.sql().await, "recent", "k").await, Some(1));
    let samples = tokio::task::spawn_blocking(common::process_metrics)
        .await
        .unwrap();
    assert_eq!(
        samples.value("tallyd_window_rows_expired_total{counter=\"recent\"}"),
        3.0
    );
    assert!(samples.value("tallyd_lines_rejected_total{reason=\"expired\"}") >= 1.0);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_after_sync_with_windows_then_get_shows_them() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    // Nothing commits before the kill: every event comes back through the replay.
    let config = TestConfig::new(dir.path())
        .external(&conninfo, "windows")
        .never_flushes()
        .with(|c| {
            c.counters = vec![windowed_counter(
                "downloads",
                "day",
                "Europe/Berlin",
                &["all"],
            )];
        })
        .write();
    let daemon = common::spawn_daemon(&config);
    let socket = dir.path().join("tallyd.sock");
    let mut c = LineClient::connect(&socket).await;
    // 23:30 and 00:30 Berlin time on 2026-10-24/25 (CEST, UTC+2), and one on 2026-10-26
    // (CET, UTC+1), 100 times each.
    let times = [
        ms("2026-10-24T21:30:00Z"),
        ms("2026-10-24T22:30:00Z"),
        ms("2026-10-26T00:30:00Z"),
    ];
    for _ in 0..100 {
        let lines = buf_of(times.iter().map(|t| format!("downloads v1 2 @{t}")));
        c.send(&lines).await;
    }
    c.send(b"!sync\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    daemon.kill();

    let daemon = common::spawn_daemon(&config);
    let days = [
        ("2026-10-23T22:00:00Z", 200),
        ("2026-10-24T22:00:00Z", 200),
        ("2026-10-25T23:00:00Z", 200),
    ];
    let windows = windows_of(&sql(&conninfo).await, "downloads", "v1").await;
    for (start, n) in days {
        assert_eq!(
            windows.get(&("day".to_string(), start.to_string())),
            Some(&n),
            "{start}"
        );
    }
    let out = common::tallyd(&config, &["get", "downloads", "v1"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[..4],
        [
            "downloads v1 window=day time_zone=Europe/Berlin",
            "2026-10-24 count=200",
            "2026-10-25 count=200",
            "2026-10-26 count=200",
        ]
    );
    assert!(lines[4].starts_with("all count=600 "), "{text}");
    let out = common::tallyd(
        &config,
        &["get", "downloads", "v1", "--window", "2026-10-25"],
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.lines().nth(1), Some("2026-10-25 count=200"), "{text}");
    assert!(text.lines().nth(2).unwrap().starts_with("all "), "{text}");

    // From 9987-04-02T17:46:40Z on no window can be named (before: every such event shared one
    // window labelled 9987-04-02, and `get --window 9999-12-31` failed with a time-library overflow).
    let mut c = LineClient::connect(&socket).await;
    // 9987-04-02T00:00Z (02:00 in Berlin), before the last nameable instant
    // (9987-04-02T17:46:39.999Z).
    let last_day = 252_999_936_000_000i64;
    c.send(
        format!(
            "!errors\ndownloads v1 1 @{last_day}\ndownloads v1 1 @253100000000000\n\
             downloads v1 1 @253402300799999\n!flush\n"
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(c.read_line().await, "ok\n");
    for n in [3, 4] {
        let line = c.read_line().await;
        assert!(
            line.starts_with(&format!("rejected {n} unnamed_window ")),
            "{line}"
        );
    }
    assert_eq!(c.read_line().await, "ok 1 2\n");
    let windows = windows_of(&sql(&conninfo).await, "downloads", "v1").await;
    let days: i64 = (windows.iter())
        .filter(|((span, _), _)| span == "day")
        .map(|(_, n)| n)
        .sum();
    assert_eq!(days, 601, "{windows:?}");
    assert_eq!(
        windows.get(&("day".to_string(), "9987-04-01T22:00:00Z".to_string())),
        Some(&1),
        "{windows:?}"
    );
    let out = common::tallyd(
        &config,
        &["get", "downloads", "v1", "--window", "9999-12-31"],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("\"9999-12-31\" is outside the windows tallyd can name"),
        "{err}"
    );
    assert!(daemon.terminate().success());
    common::stop_postgres(pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statsd_event_times_and_a_reload_that_adds_a_windowed_counter() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let statsd = dir.path().join("statsd.sock");
    let port = free_port();
    let mut hits = windowed_counter("hits", "hour", "Asia/Kathmandu", &["all"]);
    hits.statsd = Some(CounterStatsd {
        metric: "hits.*".into(),
        key_tag: None,
        sampled: Sampled::Reject,
    });
    let build = |counters: Vec<CounterConfig>| {
        let statsd = statsd.clone();
        TestConfig::new(dir.path())
            .database_url(&conninfo)
            .metrics_port(port)
            .with(move |c| {
                c.counters = counters;
                c.listen.set_datagram_socket(None);
                c.rollup.enabled = false;
                c.flush.set_interval(Duration::from_millis(50));
                c.statsd.set_socket(Some(statsd));
            })
            .write()
    };
    let config = build(vec![hits.clone()]);
    let daemon = common::spawn_daemon(&config);
    // `|T` is Unix seconds: 05:14:59Z and 05:15:00Z are two Kathmandu hours (UTC+05:45).
    let sock = tokio::net::UnixDatagram::unbound().unwrap();
    for t in [1_795_583_699u64, 1_795_583_700] {
        for _ in 0..10 {
            sock.send_to(format!("hits.home:3|c|T{t}").as_bytes(), &statsd)
                .await
                .unwrap();
        }
    }
    // A connection open across the reload, then the reload that adds a daily counter.
    let socket = dir.path().join("tallyd.sock");
    let mut c = LineClient::connect(&socket).await;
    c.send(b"!ping\n").await;
    assert_eq!(c.read_line().await, "pong\n");
    // Rewritten in place: the daemon re-reads the same path.
    build(vec![hits, windowed_counter("daily", "day", "UTC", &[])]);
    daemon.reload("ok");
    let at = ms("2026-11-25T23:59:59.999Z");
    c.send(format!("daily k 5 @{at}\ndaily k 7 @{}\n", at + 1).as_bytes())
        .await;
    assert_eq!(c.flush().await, (2, 0));
    assert_eq!(
        windows_of(&sql(&conninfo).await, "daily", "k").await,
        expect(&[
            ("day", "2026-11-25T00:00:00Z", 5),
            ("day", "2026-11-26T00:00:00Z", 7)
        ])
    );
    // The statsd events are committed by the periodic flush.
    let (early, late) = ("2026-11-25T04:15:00Z", "2026-11-25T05:15:00Z");
    let want = expect(&[("hour", early, 30), ("hour", late, 30)]);
    let client = sql(&conninfo).await;
    let mut hits = BTreeMap::new();
    for _ in 0..200 {
        hits = windows_of(&client, "hits", "home").await;
        if hits == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(hits, want);
    // Everything is committed: nothing is pending, although each `hits` event was two rows
    // (its hour and the all-time row).
    let mut pending = (f64::NAN, f64::NAN);
    for _ in 0..100 {
        let s = daemon.scrape();
        pending = (
            s.value("tallyd_pending_events"),
            s.value("tallyd_pending_keys"),
        );
        if pending == (0.0, 0.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        pending,
        (0.0, 0.0),
        "(pending events, keys) once all is committed"
    );
    assert!(daemon.terminate().success());
    common::stop_postgres(pg).await;
}

/// An event is counted in all its rows or in none (issue 33, item 2): near the top of the
/// 64-bit range, an event that its own window could take but its all-time row could not is
/// rejected (`overflow`) and lands in no row, whether the rows that cannot take it are
/// pending in the same write or stored by an earlier flush; the all-time row never falls below
/// the sum of the windows. Without the rule, the new day's row took the 20 while the all-time
/// row refused it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_its_all_time_row_cannot_take_is_in_no_row() {
    let h = Harness::start(|c| {
        c.counters
            .push(windowed_counter("wd", "day", "UTC", &["all"]))
    })
    .await;
    let client = h.sql().await;
    let mut c = h.client().await;
    let near = i64::MAX - 7;
    let (d1, d2, d3) = (
        ms("2026-11-23T10:00:00Z"),
        ms("2026-11-24T10:00:00Z"),
        ms("2026-11-25T10:00:00Z"),
    );
    // In one write: the 20 for day 2 is refused whole, the 7 after it fits.
    c.send(format!("wd a {near} @{d1}\nwd a 20 @{d2}\nwd a 7 @{d2}\n").as_bytes())
        .await;
    assert_eq!(c.flush().await, (2, 1));
    let a = expect(&[
        ("day", "2026-11-23T00:00:00Z", near),
        ("day", "2026-11-24T00:00:00Z", 7),
    ]);
    assert_eq!(windows_of(&client, "wd", "a").await, a);
    assert_eq!(count_of(&client, "wd", "a").await, Some(i64::MAX));
    // In separate flushes: the stored all-time row cannot take day 3's 20; neither row does.
    c.send(format!("wd b {near} @{d1}\n").as_bytes()).await;
    assert_eq!(c.flush().await, (1, 0));
    c.send(format!("wd b 20 @{d3}\nwd other 5 @{d3}\n").as_bytes())
        .await;
    // Refused by the database after the lines were accepted: counted as accepted.
    assert_eq!(c.flush().await, (2, 0));
    let b = expect(&[("day", "2026-11-23T00:00:00Z", near)]);
    assert_eq!(
        windows_of(&client, "wd", "b").await,
        b,
        "day 3 took nothing"
    );
    assert_eq!(count_of(&client, "wd", "b").await, Some(near));
    assert_eq!(count_of(&client, "wd", "other").await, Some(5));
    // The key goes on: an event that fits is counted in every row.
    c.send(format!("wd b 7 @{d3}\n").as_bytes()).await;
    assert_eq!(c.flush().await, (1, 0));
    let b = expect(&[
        ("day", "2026-11-23T00:00:00Z", near),
        ("day", "2026-11-25T00:00:00Z", 7),
    ]);
    assert_eq!(windows_of(&client, "wd", "b").await, b);
    assert_eq!(count_of(&client, "wd", "b").await, Some(i64::MAX));
    h.stop().await;
}
