//! End-to-end ingest: real sockets in, real PostgreSQL out, exact totals.

mod common;

use std::time::Duration;
use std::time::Instant;

use common::{buf_of, counter_total, scalar, Harness, LineClient};
use tokio::net::UnixDatagram;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hot_key_from_eight_connections() {
    let h = Harness::start(|_| {}).await;
    const CONNS: usize = 8;
    const PER_CONN: usize = 25_000;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..CONNS {
        let mut c = h.client().await;
        tasks.push(tokio::spawn(async move {
            let chunk = b"downloads hot\n".repeat(1000);
            for _ in 0..PER_CONN / 1000 {
                c.send(&chunk).await;
            }
            c.flush().await
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), (PER_CONN as u64, 0));
    }
    let elapsed = started.elapsed();
    let (count, _, _) = h.total("downloads", "hot").await;
    assert_eq!(count, (CONNS * PER_CONN) as i64);
    println!(
        "hot key: {} events committed in {:.3}s = {:.0} events/s (debug build, in-process)",
        CONNS * PER_CONN,
        elapsed.as_secs_f64(),
        (CONNS * PER_CONN) as f64 / elapsed.as_secs_f64()
    );
    let rows = scalar(&h.sql().await, "SELECT count(*) FROM tallyd.slots").await;
    assert!(
        rows <= 2,
        "one slot row per flush connection at most, got {rows}"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_thousand_distinct_keys() {
    let h = Harness::start(|_| {}).await;
    const KEYS: i64 = 100_000;
    let mut c = h.client().await;
    // Each key k gets delta k % 7 + 1 once, and key k < 1000 once more with delta 1.
    let lines = (0..KEYS)
        .map(|k| format!("views {k} {}", k % 7 + 1))
        .chain((0..1000).map(|k| format!("views {k}")));
    c.send(&buf_of(lines)).await;
    assert_eq!(c.flush().await, (KEYS as u64 + 1000, 0));
    let all = h.all("views").await;
    assert_eq!(all.len(), KEYS as usize);
    let mut expected: Vec<(String, i64)> = (0..KEYS)
        .map(|k| (k.to_string(), k % 7 + 1 + i64::from(k < 1000)))
        .collect();
    expected.sort();
    assert_eq!(all, expected);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rejection_reason_alone_and_valid_lines_unaffected() {
    let h = Harness::start(|_| {}).await;
    let mut c = h.client().await;
    let long_key = "k".repeat(300);
    let long_line = format!("downloads {}", "x".repeat(5000));
    let bad: Vec<String> = vec![
        "nosuch key".into(),                       // unknown_counter
        "downloads".into(),                        // missing_key
        "views notanumber".into(),                 // bad_key
        "ips 999.1.1.1".into(),                    // bad_key
        "users not-a-uuid".into(),                 // bad_key
        format!("downloads {long_key}"),           // key_too_long
        "downloads a 1x".into(),                   // bad_delta
        "downloads a 99999999999999999999".into(), // bad_delta
        "downloads a 1 @soon".into(),              // bad_timestamp
        "downloads a 1 @5 extra".into(),           // too_many_fields
        long_line,                                 // too_long
        "!frobnicate".into(),                      // unknown_command
    ];
    let mut lines = Vec::new();
    for (i, b) in bad.iter().enumerate() {
        lines.push(format!("downloads ok {}", i + 1));
        lines.push(b.clone());
    }
    lines.push("downloads ok 100".into());
    // Overflow: a pending sum that would leave the 64-bit range is rejected, never wrapped.
    lines.push(format!("downloads big {}", i64::MAX));
    lines.push("downloads big 1".into());
    lines.push("downloads big -7".into());
    c.send(&buf_of(lines)).await;
    let valid = bad.len() as u64 + 1 + 3;
    assert_eq!(c.flush().await, (valid - 1, bad.len() as u64 + 1));
    let expected_ok: i64 = (1..=bad.len() as i64).sum::<i64>() + 100;
    assert_eq!(h.total("downloads", "ok").await.0, expected_ok);
    assert_eq!(h.total("downloads", "big").await.0, i64::MAX - 7);
    assert_eq!(
        h.total("downloads", "a").await.0,
        0,
        "rejected lines touch nothing"
    );

    // The connection is still usable, and ping works.
    c.send(b"!ping\ndownloads ok\n").await;
    assert_eq!(c.read_line().await, "pong\n");
    assert_eq!(c.flush().await, (1, 0));
    assert_eq!(h.total("downloads", "ok").await.0, expected_ok + 1);

    // A line cut off by the end of the stream is not counted.
    let mut cut = h.client().await;
    cut.send(b"downloads cut 5\ndownloads cut 7").await;
    cut.wr.shutdown().await.unwrap();
    drop(cut);
    let mut check = h.client().await;
    check.send(b"downloads other\n").await;
    check.flush().await;
    // The cut-off connection's first line may still be in flight: flush until it shows.
    for _ in 0..100 {
        if h.total("downloads", "cut").await.0 == 5 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(h.total("downloads", "cut").await.0, 5);
    h.stop().await;
}

use tokio::io::AsyncWriteExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lines_split_at_every_byte() {
    let h = Harness::start(|_| {}).await;
    let message = b"downloads split 3\r\nviews 42 -1 @1700000000000\nips 10.0.0.1\n";
    let mut c = h.client().await;
    for cut in 0..=message.len() {
        c.send(&message[..cut]).await;
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        c.send(&message[cut..]).await;
    }
    let n = message.len() as u64 + 1;
    assert_eq!(c.flush().await, (3 * n, 0));
    assert_eq!(h.total("downloads", "split").await.0, 3 * n as i64);
    assert_eq!(h.total("views", "42").await.0, -(n as i64));
    assert_eq!(h.total("ips", "10.0.0.1").await.0, n as i64);
    h.stop().await;
}

/// A graceful stop takes the datagrams already queued in the socket, even those the runtime's
/// reactor has not reported readable yet: before, the last pass asked tokio, which answered
/// "would block" for a datagram sent just before the stop, and it was dropped with the socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_takes_the_datagrams_already_queued() {
    const ROUNDS: i64 = 20;
    let mut h = Harness::start(|_| {}).await;
    let sock = UnixDatagram::unbound().unwrap();
    for round in 0..ROUNDS {
        if round > 0 {
            h.start_daemon().await;
        }
        sock.send_to(b"downloads queued 1", h.datagram_socket())
            .await
            .unwrap();
        h.stop_daemon().await;
        assert_eq!(
            h.total("downloads", "queued").await.0,
            round + 1,
            "round {round}"
        );
    }
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datagrams_with_several_lines() {
    let h = Harness::start(|_| {}).await;
    let sock = UnixDatagram::unbound().unwrap();
    let mut sent = 0i64;
    for i in 0..200 {
        // The last line of a datagram needs no newline.
        let d = format!("downloads dg 2\ndownloads dg\nbogus x\ndownloads dg2 {i}");
        sock.send_to(d.as_bytes(), h.datagram_socket())
            .await
            .unwrap();
        sent += 3;
    }
    // Datagrams carry no replies: use a stream connection's flush after they are read.
    let mut c = h.client().await;
    for _ in 0..200 {
        c.flush().await;
        if h.total("downloads", "dg").await.0 == sent {
            break;
        }
    }
    assert_eq!(h.total("downloads", "dg").await.0, sent);
    assert_eq!(h.total("downloads", "dg2").await.0, (0..200).sum::<i64>());
    h.stop().await;
}

async fn burst_sum(h: &Harness) -> i64 {
    let mut sum = 0;
    for k in 0..3 {
        sum += h.total("downloads", &format!("burst{k}")).await.0;
    }
    sum
}

/// Datagrams are taken many per receive (`recvmmsg`): eight senders at once, one event per
/// datagram, and among them a datagram longer than the largest accepted, full of valid lines,
/// which must be rejected whole (not cut and parsed); every other datagram is counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_datagrams_per_receive_each_counted_once() {
    const SENDERS: i64 = 8;
    const EACH: i64 = 2_000;
    let mut h = Harness::start(|_| {}).await;
    let path = h.datagram_socket().to_path_buf();
    let senders: Vec<_> = (0..SENDERS)
        .map(|s| {
            let path = path.clone();
            std::thread::spawn(move || {
                let sock = std::os::unix::net::UnixDatagram::unbound().unwrap();
                sock.connect(&path).unwrap();
                for i in 0..EACH {
                    // A blocking send waits while the daemon's queue is full: nothing dropped.
                    sock.send(format!("downloads burst{} 1\n", i % 3).as_bytes())
                        .unwrap();
                    if s == 0 && i == EACH / 2 {
                        let oversized = "downloads burst0 1\n".repeat(70_000 / 19);
                        assert!(oversized.len() > tallyd::socket::MAX_DATAGRAM);
                        sock.send(oversized.as_bytes()).unwrap();
                    }
                }
            })
        })
        .collect();
    for s in senders {
        s.join().unwrap();
    }
    // Datagrams carry no `!flush`: wait (bounded) for the flushes to commit them.
    for _ in 0..600 {
        if burst_sum(&h).await >= SENDERS * EACH {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(burst_sum(&h).await, SENDERS * EACH);
    // The stop's final flush adds nothing more.
    h.stop_daemon().await;
    assert_eq!(burst_sum(&h).await, SENDERS * EACH);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_deltas_and_event_times() {
    let h = Harness::start(|_| {}).await;
    let mut c = h.client().await;
    c.send(b"downloads t 10 @1700000005000\ndownloads t -3 @1700000001000\ndownloads t\t-2\t@1700000009000\n")
        .await;
    assert_eq!(c.flush().await, (3, 0));
    assert_eq!(
        h.total("downloads", "t").await,
        (5, Some(1_700_000_001_000), Some(1_700_000_009_000))
    );
    // A later flush widens first/last across flushes.
    c.send(b"downloads t 1 @1600000000000\n").await;
    c.flush().await;
    assert_eq!(
        h.total("downloads", "t").await,
        (6, Some(1_600_000_000_000), Some(1_700_000_009_000))
    );
    // No timestamp: arrival time.
    let before = tallyd::clock::now_ms();
    c.send(b"downloads now\n").await;
    c.flush().await;
    let (n, first, last) = h.total("downloads", "now").await;
    assert_eq!(n, 1);
    assert!(first.unwrap() >= before && last.unwrap() <= tallyd::clock::now_ms());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_canonicalised_by_type() {
    let h = Harness::start(|_| {}).await;
    let mut c = h.client().await;
    c.send(
        b"ips 2001:DB8::1\nips 2001:db8:0:0:0:0:0:1\nips 2001:0db8::0001 5\n\
          users 6BA7B810-9DAD-11D1-80B4-00C04FD430C8\nusers 6ba7b8109dad11d180b400c04fd430c8\n\
          users {6ba7b810-9dad-11d1-80b4-00c04fd430c8}\nviews +007\nviews 7\n",
    )
    .await;
    assert_eq!(c.flush().await, (8, 0));
    assert_eq!(h.all("ips").await, vec![("2001:db8::1".to_string(), 7)]);
    assert_eq!(
        h.all("users").await,
        vec![("6ba7b810-9dad-11d1-80b4-00c04fd430c8".to_string(), 3)]
    );
    assert_eq!(h.all("views").await, vec![("7".to_string(), 2)]);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_answers_counts_since_the_previous_flush_after_commit() {
    let h = Harness::start(|c| c.flush.set_interval(Duration::from_millis(60000))).await;
    let mut c = h.client().await;
    // The flush interval is a minute: only `!flush` can have committed these.
    c.send(b"downloads f\ndownloads f\nnope x\n!flush\ndownloads f 5\n!flush\n!flush\n")
        .await;
    assert_eq!(c.read_line().await, "ok 2 1\n");
    assert_eq!(c.read_line().await, "ok 1 0\n");
    assert_eq!(c.read_line().await, "ok 0 0\n");
    assert_eq!(h.total("downloads", "f").await.0, 7);
    // A connection that sent nothing gets an immediate answer.
    let mut idle = h.client().await;
    assert_eq!(idle.flush().await, (0, 0));
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_stop_under_load_loses_nothing() {
    let mut h = Harness::start(|c| c.daemon.set_drain_timeout(Duration::from_millis(60000))).await;
    const CONNS: usize = 4;
    const LINES: usize = 50_000;
    let mut tasks = Vec::new();
    for i in 0..CONNS {
        let mut c = LineClient::connect(h.socket()).await;
        tasks.push(tokio::spawn(async move {
            let chunk = buf_of((0..500).map(|k| format!("downloads g{} 1", k % 10 + i * 10)));
            for _ in 0..LINES / 500 {
                c.send(&chunk).await;
                tokio::task::yield_now().await;
            }
            c.wr.shutdown().await.unwrap();
        }));
    }
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    // Stop while the clients are still sending: they are drained to the end of their streams.
    h.stop_daemon().await;
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        counter_total(&h.sql().await, "downloads").await,
        (CONNS * LINES) as i64
    );
    let per_key = h.all("downloads").await;
    assert_eq!(per_key.len(), CONNS * 10);
    assert!(
        per_key.iter().all(|(_, n)| *n == (LINES / 10) as i64),
        "{per_key:?}"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_keeps_data_in_the_private_cluster() {
    let mut h = Harness::start(|_| {}).await;
    let mut c = h.client().await;
    c.send(b"downloads keep 40\n").await;
    c.flush().await;
    drop(c);
    h.stop_daemon().await;
    // Stop and start PostgreSQL too, on the same directory.
    let pg = h.pg.take().unwrap();
    common::stop_postgres(pg).await;
    let dir = h.dir.path().to_path_buf();
    h.pg = Some(
        tokio::task::spawn_blocking(move || common::start_postgres(&dir))
            .await
            .unwrap(),
    );
    h.start_daemon().await;
    let mut c = h.client().await;
    c.send(b"downloads keep 2\n").await;
    c.flush().await;
    assert_eq!(h.total("downloads", "keep").await.0, 42);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_total_never_leaves_the_64_bit_range_and_never_stalls_flushes() {
    let h = Harness::start(|_| {}).await;
    let mut c = h.client().await;
    c.send(format!("downloads huge {}\n", i64::MAX).as_bytes())
        .await;
    c.flush().await;
    // Each line is fine alone, but the stored total would overflow: the upsert skips that row
    // and the rest of the flush commits.
    c.send(b"downloads huge 1\ndownloads other 3\n").await;
    c.flush().await;
    assert_eq!(h.total("downloads", "huge").await.0, i64::MAX);
    assert_eq!(h.total("downloads", "other").await.0, 3);
    // Flushes go on, for that key too.
    c.send(b"downloads huge -5\ndownloads other 4\n").await;
    assert_eq!(c.flush().await, (2, 0));
    assert_eq!(h.total("downloads", "huge").await.0, i64::MAX - 5);
    assert_eq!(h.total("downloads", "other").await.0, 7);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_lines_are_answered_with_their_reason_only_after_errors() {
    let h = Harness::start(|_| {}).await;
    let bad = b"downloads ok 1\nnope k\n\ndownloads\nips 999.1.1.1\ndownloads \"q\"\x01\n";
    // A client that does not ask sees only the counts, as before.
    let mut plain = h.client().await;
    plain.send(bad).await;
    assert_eq!(plain.flush().await, (1, 4));

    let mut c = h.client().await;
    c.send(b"!errors\n").await;
    c.send(bad).await;
    let long = format!("nope {}", "x".repeat(100));
    c.send(
        format!("{long}\ndownloads big 9223372036854775807\ndownloads big 1\n!flush\n").as_bytes(),
    )
    .await;
    let mut replies = Vec::new();
    loop {
        let line = c.read_line().await;
        let done = line.starts_with("ok ");
        replies.push(line);
        if done {
            break;
        }
    }
    assert_eq!(
        replies,
        [
            "ok\n",
            "rejected 3 unknown_counter \"nope k\"\n",
            "rejected 5 missing_key \"downloads\"\n",
            "rejected 6 bad_key \"ips 999.1.1.1\"\n",
            "rejected 7 bad_key \"downloads \\\"q\\\"\\u{1}\"\n",
            &format!("rejected 8 unknown_counter \"{}\"...\n", &long[..64]),
            "rejected - overflow \"\"\n",
            "ok 2 6\n",
        ]
    );
    assert_eq!(h.total("downloads", "ok").await.0, 2);
    h.stop().await;
}

/// On plain PostgreSQL a flush reads its upserts' row counts, not their rows. A row the range
/// guard skipped shows as a short count: the flight's transaction is rolled back and written
/// again returning its rows, so the skipped key is still reported (`reason="overflow"`) and the
/// rest of the flight is applied exactly once (the rolled-back try left nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_the_range_guard_skips_is_reported_and_its_flight_applied_once() {
    let dir = common::temp_dir();
    let port = common::free_port();
    let config = common::TestConfig::new(dir.path())
        .standard_counters()
        .fast()
        .metrics_port(port)
        .write();
    let daemon = common::spawn_daemon(&config);
    let overflows = || {
        daemon
            .scrape()
            .get("tallyd_lines_rejected_total{reason=\"overflow\"}")
            .map_or(0, |v| v as u64)
    };
    let mut c = LineClient::connect(daemon.socket()).await;
    c.send(format!("downloads huge {}\n", i64::MAX).as_bytes())
        .await;
    assert_eq!(c.flush().await, (1, 0));
    assert_eq!(overflows(), 0);
    c.send(b"downloads huge 1\ndownloads other 3\ndownloads more 4\n")
        .await;
    assert_eq!(c.flush().await, (3, 0));
    assert_eq!(overflows(), 1, "the skipped row is reported");
    let get = |key: &str| {
        let out = common::tallyd(&config, &["get", "downloads", key]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.split_whitespace()
            .find_map(|f| f.strip_prefix("count="))
            .map(|n| n.to_string())
            .unwrap_or(text)
    };
    assert_eq!(get("huge"), i64::MAX.to_string());
    assert_eq!(get("other"), "3", "written once, not once per try");
    assert_eq!(get("more"), "4");
    daemon.terminate();
}
