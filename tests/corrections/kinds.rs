//! Corrections of max, min and last counters (a set value is one more value: later events merge
//! with it as usual) and of windowed counters: a set replaces its own day and leaves the others,
//! a forget takes every day, with `also` every span; a day older than `keep_windows` is refused.

use std::collections::BTreeMap;

use crate::common::{
    buf_of, count_of, kind_counter, rows_of, utc, value_of, windowed_counter, windows_of, Harness,
};

/// (window start, count) of each day of `key` in `daily`.
async fn days_of(client: &tokio_postgres::Client, key: &str) -> BTreeMap<String, i64> {
    windows_of(client, "daily", key)
        .await
        .into_iter()
        .filter(|((span, _), _)| span == "day")
        .map(|((_, start), n)| (start, n))
        .collect()
}

/// The days `(start ms, count)` as [`days_of`] shows them.
fn days(days: &[(i64, i64)]) -> BTreeMap<String, i64> {
    days.iter().map(|(start, n)| (utc(*start), *n)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sets_and_forgets_of_max_min_last_and_daily_counters_are_exact() {
    let h = Harness::start(|c| {
        for (name, kind) in [("peak", "max"), ("floor", "min"), ("latest", "last")] {
            c.counters.push(kind_counter(name, kind, ""));
        }
        let mut daily = windowed_counter("daily", "day", "UTC", &[]);
        daily.keep_windows = Some(5);
        c.counters.push(daily);
        c.counters
            .push(windowed_counter("monthly", "day", "UTC", &["month", "all"]));
    })
    .await;
    let client = h.sql().await;
    let mut c = h.client().await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    c.send(b"peak k 100\nfloor k -100\n").await;
    c.send(format!("latest k 100 @{}\n", now - 60_000).as_bytes())
        .await;
    assert_eq!(c.flush().await, (3, 0));
    c.send(b"!set peak k 5\n!set floor k 5\n!set latest k 5\n")
        .await;
    for _ in 0..3 {
        assert_eq!(c.read_line().await, "ok\n");
    }
    for counter in ["peak", "floor", "latest"] {
        assert_eq!(value_of(&client, counter, "k").await, Some(5), "{counter}");
    }
    // Later values fold into the set one as into any other: greatest, least, latest in time.
    c.send(b"peak k 3\nfloor k 7\n").await;
    c.send(format!("latest k 3 @{}\n", now - 30_000).as_bytes())
        .await;
    assert_eq!(c.flush().await, (3, 0));
    for counter in ["peak", "floor", "latest"] {
        assert_eq!(value_of(&client, counter, "k").await, Some(5), "{counter}");
    }
    c.send(b"peak k 9\nfloor k 2\n").await;
    c.send(format!("latest k 4 @{}\n", now + 60_000).as_bytes())
        .await;
    assert_eq!(c.flush().await, (3, 0));
    let values = [("peak", 9), ("floor", 2), ("latest", 4)];
    for (counter, v) in values {
        assert_eq!(value_of(&client, counter, "k").await, Some(v), "{counter}");
    }
    c.send(b"!forget * k\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    for counter in ["peak", "floor", "latest", "downloads"] {
        assert_eq!(rows_of(&client, counter, "k").await, 0, "{counter}");
    }

    // Days: a set replaces its own day, the others stay; a forget takes every day.
    const DAY: i64 = 86_400_000;
    let today = now - now.rem_euclid(DAY);
    let (d0, d1) = (today - 2 * DAY, today - DAY);
    let mut lines: Vec<String> = (0..3).map(|i| format!("daily k 1 @{}", d0 + i)).collect();
    lines.extend((0..4).map(|i| format!("daily k 1 @{}", d1 + i)));
    c.send(&buf_of(lines)).await;
    assert_eq!(c.flush().await, (7, 0));
    c.send(
        format!(
            "daily k 2 @{d1}\n!set daily k 10 @{}\ndaily k 1 @{d1}\n",
            d1 + 5
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(days_of(&client, "k").await, days(&[(d0, 3), (d1, 11)]));
    c.send(format!("!set daily k 7 @{}\ndaily k 1 @{d0}\n", today + 1).as_bytes())
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(
        days_of(&client, "k").await,
        days(&[(d0, 4), (d1, 11), (today, 7)])
    );
    c.send(b"!forget daily k\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(rows_of(&client, "daily", "k").await, 0);
    // With `also`, a forget takes every span: days, months, all time; events after it count
    // alone, in each (a windowed sum's set with `also`: tests/corrections/main.rs).
    let lines: Vec<String> = (0..4)
        .map(|i| format!("monthly k 1 @{}", d0 - i * 20 * DAY))
        .collect();
    c.send(&buf_of(lines)).await;
    // With the three `daily` lines since the last `!flush`.
    assert_eq!(c.flush().await, (7, 0));
    let reply = {
        c.send(b"!set monthly k 1\n").await;
        c.read_line().await
    };
    assert_eq!(reply, "ok\n", "a windowed sum with `also` is settable");
    c.send(format!("monthly k 2 @{d0}\n!forget monthly k\nmonthly k 3 @{d1}\n").as_bytes())
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    let spans = windows_of(&client, "monthly", "k").await;
    let spans: Vec<(&str, i64)> = spans.iter().map(|((s, _), n)| (s.as_str(), *n)).collect();
    assert_eq!(spans, vec![("day", 3), ("month", 3)]);
    assert_eq!(count_of(&client, "monthly", "k").await, Some(3), "all time");
    // A day older than `keep_windows`: refused as an event there would be.
    c.send(format!("!set daily k 5 @{}\n", today - 10 * DAY).as_bytes())
        .await;
    let reply = c.read_line().await;
    assert!(reply.starts_with("error expired "), "{reply:?}");
    assert_eq!(rows_of(&client, "daily", "k").await, 0);
    h.stop().await;
}
