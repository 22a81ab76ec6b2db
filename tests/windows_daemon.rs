//! Windowed counters in the real `tallyd run` process: kill -9 after `!sync` and the replay,
//! `tallyd get` showing windows, statsd `|T` event times, and a reload that adds a windowed
//! counter under running connections. Exact totals against what each test sent.

mod common;

use std::time::Duration;

use common::{
    buf_of, free_port, sql, temp_dir, unix_ms as ms, windowed_counter, LineClient, TestConfig,
};
use tallyd::config::{CounterConfig, CounterStatsd, Sampled};

async fn window_total(conninfo: &str, counter: &str, span: &str, start: &str) -> i64 {
    sql(conninfo)
        .await
        .query_one(
            "SELECT coalesce(sum(count), 0)::bigint FROM tallyd.window_totals \
             WHERE counter = $1 AND span = $2 AND window_start = $3::text::timestamptz",
            &[&counter, &span, &start],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_after_sync_with_windows_then_get_shows_them() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let config = TestConfig::new(dir.path())
        .database_url(&conninfo)
        .with(|c| {
            c.counters = vec![windowed_counter(
                "downloads",
                "day",
                "Europe/Berlin",
                &["all"],
            )];
            c.daemon.set_instance_id(Some("windows".into()));
            c.listen.set_datagram_socket(None);
            c.rollup.enabled = false;
            // Nothing commits before the kill: every event comes back through the replay.
            c.flush.set_interval(Duration::from_secs(600));
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
    for (start, n) in days {
        assert_eq!(
            window_total(&conninfo, "downloads", "day", start).await,
            n,
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
    let before = daemon
        .scrape()
        .value(r#"tallyd_config_reloads_total{result="ok"}"#);
    daemon.signal(libc::SIGHUP);
    while daemon
        .scrape()
        .value(r#"tallyd_config_reloads_total{result="ok"}"#)
        < before + 1.0
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let at = ms("2026-11-25T23:59:59.999Z");
    c.send(format!("daily k 5 @{at}\ndaily k 7 @{}\n", at + 1).as_bytes())
        .await;
    assert_eq!(c.flush().await, (2, 0));
    assert_eq!(
        window_total(&conninfo, "daily", "day", "2026-11-25T00:00:00Z").await,
        5
    );
    assert_eq!(
        window_total(&conninfo, "daily", "day", "2026-11-26T00:00:00Z").await,
        7
    );
    // The statsd events are committed by the periodic flush.
    let (early, late) = ("2026-11-25T04:15:00Z", "2026-11-25T05:15:00Z");
    let mut totals = (0, 0);
    for _ in 0..200 {
        totals = (
            window_total(&conninfo, "hits", "hour", early).await,
            window_total(&conninfo, "hits", "hour", late).await,
        );
        if totals == (30, 30) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(totals, (30, 30));
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
