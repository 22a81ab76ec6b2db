//! Corrections that must be refused, and what they leave: hostile lines (values beyond 64 bits,
//! bad keys and timestamps, keys no counter takes, the datagram socket) are answered with their
//! reason and change nothing; sets to the 64-bit bounds and a key the rollup holds back beyond
//! them; a counter a reload removed (`unknown_counter`, its rows kept, `!forget *` passes it
//! by), the command line's refusals; and `/status` shows nothing pending after corrections.

use crate::common::{
    count_of, free_port, http_get, postgres, rows_of, scalar, spawn_daemon, sql, temp_dir, Harness,
    LineClient, TestConfig,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_corrections_are_refused_and_change_nothing() {
    let mut h = Harness::start(|c| c.flush.connections = 1).await;
    let client = h.sql().await;
    let mut c = h.client().await;
    c.send(b"downloads k 5\nviews 42 4\ndownloads 0042 3\ndownloads 42 2\n")
        .await;
    assert_eq!(c.flush().await, (4, 0));
    let long = "x".repeat(300);
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            b"!set downloads k 9223372036854775808".to_vec(),
            "bad_value",
        ),
        (
            b"!set downloads k -9223372036854775809".to_vec(),
            "bad_value",
        ),
        (
            b"!set downloads k 99999999999999999999999999".to_vec(),
            "bad_value",
        ),
        (b"!set downloads k 1e3".to_vec(), "bad_value"),
        (b"!set downloads k 0x10".to_vec(), "bad_value"),
        (b"!set downloads k --1".to_vec(), "bad_value"),
        (b"!set downloads k".to_vec(), "missing_value"),
        (b"!set downloads k 5 @x".to_vec(), "bad_timestamp"),
        (
            b"!set downloads k 5 @999999999999999999".to_vec(),
            "bad_timestamp",
        ),
        (b"!set downloads k 5 6".to_vec(), "too_many_fields"),
        (b"!set downloads k 5 @1 x".to_vec(), "too_many_fields"),
        (b"!set".to_vec(), "missing_key"),
        (b"!forget".to_vec(), "missing_key"),
        (b"!forget *".to_vec(), "missing_key"),
        (b"!forget * a b".to_vec(), "too_many_fields"),
        (b"!forget nope k".to_vec(), "unknown_counter"),
        (b"!forget views k".to_vec(), "bad_key"),
        (b"!set ips 999.1.1.1 5".to_vec(), "bad_key"),
        // A key no counter takes: not UTF-8 (so not text), nor a number, address or uuid.
        (b"!forget * caf\xe9".to_vec(), "bad_key"),
        (b"!forget * a\x7fb".to_vec(), "bad_key"),
        (format!("!forget * {long}").into_bytes(), "key_too_long"),
        (
            format!("!set downloads {long} 1").into_bytes(),
            "key_too_long",
        ),
    ];
    for (line, reason) in &cases {
        let mut bytes = line.clone();
        bytes.push(b'\n');
        c.send(&bytes).await;
        let reply = c.read_line().await;
        assert!(
            reply.starts_with(&format!("error {reason} ")),
            "{}: {reply:?}",
            String::from_utf8_lossy(line)
        );
    }
    // Not corrections: unknown control words, rejected like any bad line.
    c.send(b"!SET downloads k 1\n!setx downloads k 1\n!forget2 downloads k\n")
        .await;
    assert_eq!(c.flush().await, (0, cases.len() as u64 + 3));
    assert_eq!(count_of(&client, "downloads", "k").await, Some(5));

    // A refused correction between two accepted ones is answered in its place.
    c.send(b"!set downloads k 1\n!set nope k 1\n!set downloads k 8\n")
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert!(c.read_line().await.starts_with("error unknown_counter "));
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(count_of(&client, "downloads", "k").await, Some(8));

    // The 64-bit bounds: set to them, and nothing may carry past them.
    c.send(b"!set downloads max 9223372036854775807\n!set downloads min -9223372036854775808\n")
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.read_line().await, "ok\n");
    c.send(b"downloads max 1\ndownloads min -1\n").await;
    // Skipped by the flush's range guard, after they were accepted (docs/protocol.md,
    // "Overflow"); the refused `!set nope` is this period's rejection.
    assert_eq!(c.flush().await, (2, 1));
    assert_eq!(count_of(&client, "downloads", "max").await, Some(i64::MAX));
    assert_eq!(count_of(&client, "downloads", "min").await, Some(i64::MIN));
    // Within the same flight too: the set's value is where later increments start from.
    c.send(b"!set downloads max -1\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    c.send(b"!set downloads max 9223372036854775806\ndownloads max 1\ndownloads max 1\n")
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.flush().await, (1, 1));
    assert_eq!(count_of(&client, "downloads", "max").await, Some(i64::MAX));
    // A flight with a set beside a row the range guard skips (one flush connection: one
    // flight): written again with the guard, the set and the rest commit, exact.
    c.send(b"downloads max 1\n!set downloads other 5\ndownloads other 2\n")
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.flush().await, (2, 0));
    assert_eq!(count_of(&client, "downloads", "max").await, Some(i64::MAX));
    assert_eq!(count_of(&client, "downloads", "other").await, Some(7));

    // A key held back by the rollup's range guard (its total leaves the 64-bit range): a set
    // supersedes all of it, and the guard lets it go.
    scalar(&client, "SELECT tallyd.rollup(1000)").await;
    c.send(b"downloads max 1\n").await;
    assert_eq!(c.flush().await, (1, 0));
    scalar(&client, "SELECT tallyd.rollup(1000)").await;
    assert_eq!(
        scalar(
            &client,
            "SELECT count(*) FROM tallyd.rollup_rejects WHERE key = 'max'"
        )
        .await,
        1,
        "held back"
    );
    let held: (bool, String) = client
        .query_one(
            "SELECT count IS NULL, exact_count::text FROM tallyd.totals \
             WHERE counter = 'downloads' AND key = 'max'",
            &[],
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(held, (true, "9223372036854775808".to_string()));
    c.send(b"!set downloads max 12\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(count_of(&client, "downloads", "max").await, Some(12));
    scalar(&client, "SELECT tallyd.rollup(1000)").await;
    c.send(b"downloads max 1\n").await;
    assert_eq!(c.flush().await, (1, 0));
    scalar(&client, "SELECT tallyd.rollup(1000)").await;
    assert_eq!(count_of(&client, "downloads", "max").await, Some(13));
    assert_eq!(rows_of(&client, "downloads", "max").await, 1, "folded");

    // `!forget *` takes each counter's canonical form of the key: `0042` is `42` in views.
    c.send(b"!forget * 0042\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(rows_of(&client, "views", "42").await, 0);
    assert_eq!(rows_of(&client, "downloads", "0042").await, 0);
    assert_eq!(count_of(&client, "downloads", "42").await, Some(2));
    let uuid = "6f1c2f34-5f7e-4c1a-9b1e-2a9e4d1c0b7a";
    c.send(format!("users {uuid} 4\n").as_bytes()).await;
    assert_eq!(c.flush().await, (1, 0));
    c.send(format!("!forget * {}\n", uuid.to_uppercase()).as_bytes())
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(rows_of(&client, "users", uuid).await, 0);

    // Corrections on the datagram socket: rejected (`unknown_command`), nothing changed, the
    // events around them taken.
    let dgram = tokio::net::UnixDatagram::unbound().unwrap();
    for d in [
        "!set downloads k 1000\ndownloads k 1",
        "!forget downloads k\ndownloads k 1",
        "!forget * k",
        "!set downloads k 1000",
    ] {
        dgram
            .send_to(d.as_bytes(), h.datagram_socket())
            .await
            .unwrap();
    }
    // A graceful stop takes every datagram already queued.
    h.stop_daemon().await;
    assert_eq!(count_of(&client, "downloads", "k").await, Some(10));
    h.stop().await;
}

/// Corrections for a counter a reload removed are refused as `unknown_counter` (its rows stay),
/// `!forget *` passes it by; and corrections leave no pending keys or events behind in
/// `/status` (a correction's own entry, and the events it superseded, are released with its
/// flush).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrections_after_a_reload_removed_their_counter_and_in_status() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let port = free_port();
    let base = TestConfig::new(dir.path())
        .external(&conninfo, "reloaded")
        .standard_counters()
        .counters(&[("spare", tallyd::config::KeyTypeName::Text)])
        .metrics_port(port);
    let config = base.write();
    let client = sql(&conninfo).await;
    let mut daemon = spawn_daemon(&config);
    let addr = daemon.metrics();

    let mut c = LineClient::connect(daemon.socket()).await;
    c.send(b"spare k 5\nspare 7 1\ndownloads k 2\nviews 7 3\ndownloads 7 4\n")
        .await;
    for _ in 0..10 {
        c.send(b"downloads hot 1\n").await;
    }
    assert_eq!(c.flush().await, (15, 0));
    // Superseded events and a correction's own new entry are released by its flush.
    for _ in 0..10 {
        c.send(b"downloads hot 1\n").await;
    }
    c.send(b"!set downloads hot 3\n!set downloads fresh 4\n!forget downloads never\n")
        .await;
    for _ in 0..3 {
        assert_eq!(c.read_line().await, "ok\n");
    }
    assert_eq!(c.flush().await, (10, 0));
    assert_eq!(count_of(&client, "downloads", "hot").await, Some(3));
    assert_nothing_pending(addr);

    // The reload removes `spare`.
    let reduced = base
        .clone()
        .with(|c| c.counters.retain(|x| x.name != "spare"));
    let new = reduced.write_as("config.toml.new");
    std::fs::rename(&new, &config).unwrap();
    daemon.reload("ok");
    let mut after = LineClient::connect(daemon.socket()).await;
    for (conn, c) in [
        ("opened before the reload", &mut c),
        ("opened after", &mut after),
    ] {
        for line in ["!set spare k 1", "!forget spare k"] {
            c.send(format!("{line}\n").as_bytes()).await;
            let reply = c.read_line().await;
            assert!(
                reply.starts_with("error unknown_counter "),
                "{conn}: {line}: {reply:?}"
            );
        }
    }
    c.send(b"!set spare k 1\n!forget * k\n!forget * 7\n").await;
    assert!(c.read_line().await.starts_with("error unknown_counter "));
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(count_of(&client, "spare", "k").await, Some(5));
    assert_eq!(count_of(&client, "spare", "7").await, Some(1));
    assert_eq!(rows_of(&client, "downloads", "k").await, 0);
    assert_eq!(rows_of(&client, "downloads", "7").await, 0);
    assert_eq!(rows_of(&client, "views", "7").await, 0);
    assert_nothing_pending(addr);

    // The command line: refusals name the reason and fail; a negative value is a value.
    let refused = [
        (&["set", "spare", "k", "1"][..], "unknown_counter"),
        (&["set", "downloads", "k", "12x"][..], "bad_value"),
        (
            &["set", "downloads", "k", "9223372036854775808"][..],
            "bad_value",
        ),
        (&["forget", "views", "not-a-number"][..], "bad_key"),
    ];
    for (args, reason) in refused {
        let out = crate::common::tallyd(&config, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(reason),
            "{args:?}: {out:?}"
        );
    }
    for args in [
        &["forget", "downloads"][..],
        &["forget", "--everywhere", "a", "b"],
    ] {
        let out = crate::common::tallyd(&config, args);
        assert!(!out.status.success(), "{args:?}: {out:?}");
    }
    let out = crate::common::tallyd(&config, &["set", "downloads", "k", "-5"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(count_of(&client, "downloads", "k").await, Some(-5));
    let out = crate::common::tallyd(&config, &["forget", "--everywhere", "k"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(rows_of(&client, "downloads", "k").await, 0);

    // A crash and a restart on the reduced config: the journal's corrections replay (or are
    // covered) without the removed counter.
    daemon.kill();
    daemon = spawn_daemon(&config);
    assert_eq!(count_of(&client, "spare", "k").await, Some(5));
    assert_eq!(rows_of(&client, "downloads", "k").await, 0);
    assert_eq!(count_of(&client, "downloads", "hot").await, Some(3));
    assert_eq!(count_of(&client, "downloads", "fresh").await, Some(4));
    daemon.terminate();
}

/// Every counter in `/status` has nothing pending.
fn assert_nothing_pending(addr: std::net::SocketAddr) {
    let (code, body) = http_get(addr, "/status");
    assert_eq!(code, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    let memory = &status["memory"];
    assert_eq!(
        (&memory["pending_keys"], &memory["pending_events"]),
        (&serde_json::json!(0), &serde_json::json!(0)),
        "{memory}"
    );
    for counter in status["counters"].as_array().expect("counters") {
        assert_eq!(
            (&counter["pending_keys"], &counter["pending_events"]),
            (&serde_json::json!(0), &serde_json::json!(0)),
            "{counter}"
        );
    }
}

/// A windowed sum's set at the 64-bit edge (issue 33, item 1). A set whose move of the rows
/// beside its window (here the all-time row) would leave the signed 64-bit range is refused
/// with `error overflow` and changes nothing: the events it superseded stay counted, and the
/// flush worker goes on (a `!flush` of other keys on the one worker is answered). Before,
/// `tallyd.correct` failed with `bigint out of range` at every retry: the set was never
/// answered and every key of that worker waited. A set whose move fits, though the window's
/// difference alone is beyond 64 bits (-5 set to the maximum), is applied. A set refused
/// because the flight's own events would take a row beyond the range, with it, is refused the
/// same way and the events commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_that_would_move_a_row_beyond_64_bits_is_refused_and_the_worker_goes_on() {
    let h = Harness::start(|c| {
        c.flush.connections = 1;
        c.counters.push(crate::common::windowed_counter(
            "wd",
            "day",
            "UTC",
            &["all"],
        ));
    })
    .await;
    let client = h.sql().await;
    let mut c = h.client().await;
    let max = i64::MAX;
    let d1 = crate::common::unix_ms("2026-11-23T10:00:00Z");
    let d2 = crate::common::unix_ms("2026-11-24T10:00:00Z");
    let windows = |key: &'static str| {
        let client = &client;
        async move {
            let w = crate::common::windows_of(client, "wd", key).await;
            let day = |d: &str| w.get(&("day".to_string(), d.to_string())).copied();
            (
                day("2026-11-23T00:00:00Z"),
                day("2026-11-24T00:00:00Z"),
                count_of(client, "wd", key).await,
            )
        }
    };
    // -5 set to the maximum: the all-time row moves by the maximum + 5, to the maximum.
    c.send(format!("wd a -5 @{d1}\n").as_bytes()).await;
    assert_eq!(c.flush().await, (1, 0));
    c.send(format!("!set wd a {max} @{d1}\n").as_bytes()).await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(windows("a").await, (Some(max), None, Some(max)));
    // Day 2 holds 1: day 1 set to the maximum would take the all-time row to the maximum + 1,
    // found by tallyd.correct before it deletes anything.
    c.send(format!("wd s 1 @{d2}\nwd s 2 @{d1}\n").as_bytes())
        .await;
    assert_eq!(c.flush().await, (2, 0));
    c.send(format!("!set wd s {max} @{d1}\n").as_bytes()).await;
    let reply = c.read_line().await;
    assert!(reply.starts_with("error overflow "), "{reply:?}");
    assert_eq!(windows("s").await, (Some(2), Some(1), Some(3)));
    // Refused on a day without a row: it leaves none.
    c.send(format!("wd n 1 @{d2}\n!set wd n {max} @{d1}\n").as_bytes())
        .await;
    let reply = c.read_line().await;
    assert!(reply.starts_with("error overflow "), "{reply:?}");
    assert_eq!(windows("n").await, (None, Some(1), Some(1)));
    // The same with 3 pending in day 1 before the set: they stay counted.
    c.send(format!("wd b 1 @{d2}\n").as_bytes()).await;
    assert_eq!(c.flush().await, (2, 0), "n's 1 and b's 1");
    c.send(format!("wd b 3 @{d1}\n!set wd b {max} @{d1}\n").as_bytes())
        .await;
    let reply = c.read_line().await;
    assert!(reply.starts_with("error overflow "), "{reply:?}");
    c.send(format!("wd other 9 @{d1}\n").as_bytes()).await;
    assert_eq!(c.flush().await, (2, 0), "the worker goes on");
    assert_eq!(windows("b").await, (Some(3), Some(1), Some(4)));
    assert_eq!(windows("other").await, (Some(9), None, Some(9)));
    // The set's move fits the stored all-time row, the flight's events on top of it do not:
    // the set is refused, the events commit.
    c.send(format!("wd m 100 @{d1}\nwd m {} @{d2}\n", max - 200).as_bytes())
        .await;
    assert_eq!(c.flush().await, (2, 0));
    c.send(format!("wd m 50 @{d2}\n!set wd m 200 @{d1}\n").as_bytes())
        .await;
    let reply = c.read_line().await;
    assert!(reply.starts_with("error overflow "), "{reply:?}");
    assert_eq!(c.flush().await, (1, 0));
    assert_eq!(
        windows("m").await,
        (Some(100), Some(max - 150), Some(max - 50))
    );
    // Two sets in one write, the second refused: each is answered for itself, in order.
    c.send(format!("!set wd fine 5 @{d1}\n!set wd s {max} @{d1}\n").as_bytes())
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    let reply = c.read_line().await;
    assert!(reply.starts_with("error overflow "), "{reply:?}");
    assert_eq!(windows("fine").await, (Some(5), None, Some(5)));
    assert_eq!(windows("s").await, (Some(2), Some(1), Some(3)));
    h.stop().await;
}
