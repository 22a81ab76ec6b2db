//! Idempotent batches (docs/protocol.md, "Batches") against the real daemon and PostgreSQL, for
//! what the fault matrix (tests/faults, whose batches workload sends every batch twice under
//! every fault) does not cover: the protocol's answers and bad input, a sender that resends
//! every batch it did not see answered while tallyd is killed -9 at random points (during its
//! start and replay too) and its backends are terminated, two instances on one database
//! receiving the same batches (at once, and with the database stopped in between), a batch
//! across shards, and the claims' pruning and visibility.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{
    buf_of, counter_total, counter_total_over, free_port, scalar, seeded, spawn_daemon, sql,
    temp_dir, Harness, InProcess, LineClient, Sessions, Terminator, TestConfig, BIN,
};
use rand::Rng;
use tallyd::config::{Config, FsyncMode};

/// Sends `lines` and reads one answer line per element of `want`, comparing each.
async fn expect(c: &mut LineClient, lines: &str, want: &[&str]) {
    c.send(lines.as_bytes()).await;
    for w in want {
        let got = tokio::time::timeout(Duration::from_secs(30), c.read_line())
            .await
            .unwrap_or_else(|_| panic!("no answer to {lines:?}, want {w:?}"));
        assert_eq!(got.trim_end(), *w, "answer to {lines:?}");
    }
}

fn events(key: &str, n: usize) -> String {
    format!("downloads {key}\n").repeat(n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_protocol_answers_as_documented_and_bad_input_changes_nothing() {
    let h = Harness::start(|c| c.batch.max_bytes = 2048).await;
    let mut c = h.client().await;
    expect(&mut c, "!errors\n", &["ok"]).await;
    // Without an open batch.
    expect(&mut c, "!commit\n", &["error no_batch no batch is open"]).await;
    expect(&mut c, "!abort\n", &["error no_batch no batch is open"]).await;
    // Bad ids: each refused, nothing opened.
    expect(
        &mut c,
        "!batch\n",
        &["error missing_batch_id !batch needs an id"],
    )
    .await;
    let long = format!("!batch {}\n", "x".repeat(257));
    c.send(long.as_bytes()).await;
    assert!(c.read_line().await.starts_with("error batch_id_too_long "));
    for bad in ["!batch a b\n", "!batch a\u{1}b\n", "!batch a\u{3000}b\n"] {
        c.send(bad.as_bytes()).await;
        let got = c.read_line().await;
        assert!(got.starts_with("error bad_batch_id "), "{bad:?}: {got:?}");
    }
    expect(&mut c, "!commit\n", &["error no_batch no batch is open"]).await;

    // A batch: rejected lines answered as usual and counted in `<rejected>`; control lines
    // that would commit or correct are refused inside it and change nothing.
    let mut lines = String::from("!batch app:file-1\n");
    lines += &events("b1", 20);
    lines += "nope x\n!ping\n!batch app:other\n!flush\n!sync\n!set downloads b1 5\n!forget downloads b1\n";
    lines += &events("b1", 5);
    lines += "!commit\n";
    let open = "error batch_open a batch is open: !commit or !abort it first";
    expect(
        &mut c,
        &lines,
        &[
            "ok",
            "rejected 31 unknown_counter \"nope x\"",
            "pong",
            open,
            open,
            open,
            open,
            open,
            "ok 25 1",
        ],
    )
    .await;
    // The batch's lines are not counted by `!flush`; the `!flush` waits for the batch.
    expect(&mut c, "downloads out 1\n!flush\n", &["ok 1 0"]).await;
    assert_eq!(h.total("downloads", "b1").await.0, 25);

    // The same batch again, on another connection: duplicate, nothing counted.
    let mut again = h.client().await;
    let copy = format!("!batch app:file-1\n{}!commit\n!flush\n", events("b1", 25));
    expect(&mut again, &copy, &["ok", "duplicate", "ok 0 0"]).await;
    assert_eq!(h.total("downloads", "b1").await.0, 25);

    // Aborted, and dropped by a closed connection: nothing counted, the id stays free.
    let aborted = format!("!batch app:file-2\n{}!abort\n!flush\n", events("b2", 7));
    expect(&mut c, &aborted, &["ok", "ok", "ok 0 0"]).await;
    let mut dropped = h.client().await;
    dropped
        .send(format!("!batch app:file-2\n{}", events("b2", 9)).as_bytes())
        .await;
    assert_eq!(dropped.read_line().await, "ok\n");
    drop(dropped);
    let counted = format!("!batch app:file-2\n{}!commit\n!flush\n", events("b2", 3));
    expect(&mut c, &counted, &["ok", "ok 3 0", "ok 0 0"]).await;
    assert_eq!(h.total("downloads", "b2").await.0, 3);

    // Past batch.max_bytes (2048): refused at `!commit`, nothing of it counted, id still free.
    let big = format!("!batch app:big\n{}!commit\n!flush\n", events("b3", 200));
    c.send(big.as_bytes()).await;
    assert_eq!(c.read_line().await, "ok\n");
    assert!(c.read_line().await.starts_with("error batch_too_large "));
    assert_eq!(c.read_line().await, "ok 0 0\n");
    let small = format!("!batch app:big\n{}!commit\n!flush\n", events("b3", 2));
    expect(&mut c, &small, &["ok", "ok 2 0", "ok 0 0"]).await;
    assert_eq!(h.total("downloads", "b3").await.0, 2);

    // The datagram socket: `!batch` is an unknown command there, its events count as usual.
    let d = std::os::unix::net::UnixDatagram::unbound().unwrap();
    d.send_to(
        b"!batch app:dgram\ndownloads b4\n!commit\n",
        h.datagram_socket(),
    )
    .unwrap();
    common::wait_until("the datagram's event", async || {
        c.send(b"!flush\n").await;
        c.read_line().await;
        h.total("downloads", "b4").await.0 == 1
    })
    .await;
    let claims = scalar(&h.sql().await, "SELECT count(*) FROM tallyd.batches").await;
    assert_eq!(
        claims, 3,
        "app:file-1, app:file-2 and app:big (its refused copy claimed nothing)"
    );
    drop((c, again));
    h.stop().await;

    // Without the journal, `!batch` is refused.
    let h = Harness::start(|c| c.journal.enabled = false).await;
    let mut c = h.client().await;
    expect(
        &mut c,
        "!batch app:x\ndownloads nj\n!commit\n!flush\n",
        &[
            "error batch_needs_journal batches need the journal ([journal] enabled = true) to count exactly once",
            "error no_batch no batch is open",
            "ok 1 0",
        ],
    )
    .await;
    h.stop().await;
}

/// One try at batch `id`: connects, sends it whole with `!commit`, and returns the answer
/// (`ok <n> 0` or `duplicate`); Err on anything else (the connection lost, a timeout).
fn try_batch(socket: &Path, id: &str, body: &str) -> Result<String, String> {
    let s = UnixStream::connect(socket).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .map_err(|e| e.to_string())?;
    let mut w = s.try_clone().map_err(|e| e.to_string())?;
    w.write_all(format!("!batch {id}\n{body}!commit\n").as_bytes())
        .map_err(|e| e.to_string())?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).map_err(|e| e.to_string())?;
    if line != "ok\n" {
        return Err(format!("!batch answered {line:?}"));
    }
    line.clear();
    r.read_line(&mut line).map_err(|e| e.to_string())?;
    match line.trim_end() {
        "duplicate" => Ok("duplicate".into()),
        l if l.starts_with("ok ") => Ok(l.to_string()),
        l => Err(format!("!commit answered {l:?}")),
    }
}

/// Sends batch `id` until it is answered, connecting again after any failure, as the client
/// libraries do.
fn send_until_answered(socket: &Path, id: &str, body: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        match try_batch(socket, id, body) {
            Ok(answer) => return answer,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(30)),
            Err(e) => panic!("batch {id} not answered within 300 s: {e}"),
        }
    }
}

/// A batch's body: `n` events `downloads <prefix><j % 40> <delta>`; returns it and its sum.
fn body(prefix: &str, n: usize, delta: i64) -> (String, i64) {
    let lines: String = (0..n)
        .map(|j| format!("downloads {prefix}{} {delta}\n", j % 40))
        .collect();
    (lines, n as i64 * delta)
}

fn daemon_config(dir: &Path, url: &str, id: &str, edit: impl FnOnce(&mut Config)) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    TestConfig::new(dir)
        .standard_counters()
        .fast()
        .external(url, id)
        .with(|c| {
            c.journal.fsync = FsyncMode::Always;
            c.flush.set_interval(Duration::from_millis(150));
            c.daemon.set_drain_timeout(Duration::from_secs(10));
        })
        .with(edit)
        .write()
}

/// A sender resends every batch it did not see answered while tallyd is killed -9 every 0.2
/// to 1.5 s (before, during and after flushes of batches it acknowledged), sometimes again
/// 10 to 300 ms after a restart began (during its start and its journal's replay), and its
/// backends are terminated: every batch counts once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resending_sender_counts_every_batch_once_through_kill_9() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let url = pg.connection_string("postgres");
    let config = daemon_config(&dir.path().join("d"), &url, "killed", |_| {});
    let socket = dir.path().join("d/tallyd.sock");
    // A start whose own sessions were terminated exits (as it does today without batches): it
    // is started again, as systemd would.
    let spawn = |config: PathBuf| async move {
        tokio::task::spawn_blocking(move || {
            let bin = Path::new(BIN);
            for _ in 0..20 {
                if let Ok(d) = common::Daemon::try_spawn_with(bin, &config, |_| {}) {
                    return d;
                }
            }
            spawn_daemon(&config)
        })
        .await
        .unwrap()
    };
    let mut daemon = spawn(config.clone()).await;
    let terminator = Terminator::start(&url, Sessions::Tallyd, 100..600);
    // Batches go on until tallyd was killed 8 times, 80 at least.
    let enough = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sender = {
        let (socket, enough) = (socket.clone(), enough.clone());
        std::thread::spawn(move || {
            let mut want = 0;
            let mut duplicates = 0;
            let mut b = 0;
            while b < 80 || !enough.load(std::sync::atomic::Ordering::Relaxed) {
                let (lines, sum) = body("k", 300, b as i64 % 5 + 1);
                want += sum;
                let answer = send_until_answered(&socket, &format!("kill9:{b}"), &lines);
                duplicates += usize::from(answer == "duplicate");
                // Every fourth batch is sent once more after its answer: always a duplicate
                // unless its claim was still undecided at the `!commit`.
                if b % 4 == 0 {
                    let again = send_until_answered(&socket, &format!("kill9:{b}"), &lines);
                    assert!(again == "duplicate" || again.starts_with("ok "), "{again}");
                }
                b += 1;
            }
            (want, duplicates, b)
        })
    };
    let mut rng = seeded();
    let mut kills = 0;
    while !sender.is_finished() {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(200..1500))).await;
        daemon.kill();
        kills += 1;
        if rng.gen_bool(0.4) {
            // Killed again while it starts and replays.
            let mut child = std::process::Command::new(BIN)
                .arg("--config")
                .arg(&config)
                .arg("run")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            tokio::time::sleep(Duration::from_millis(rng.gen_range(10..300))).await;
            child.kill().unwrap();
            child.wait().unwrap();
            kills += 1;
        }
        daemon = spawn(config.clone()).await;
        if kills >= 8 {
            enough.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let (want, duplicates, batches) = sender.join().unwrap();
    let terminated = terminator.stop().await;
    assert!(daemon.terminate().success());
    assert!(kills >= 8, "{kills} kills");
    assert!(terminated > 0, "no backend was terminated");
    let client = sql(&url).await;
    assert_eq!(counter_total(&client, "downloads").await, want);
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM tallyd.batches").await,
        batches as i64
    );
    eprintln!("{batches} batches, {kills} kills, {terminated} backends terminated, {duplicates} first answers were duplicate");
    common::stop_postgres(pg).await;
}

/// Two instances on one database get the same batches from two senders at once: each batch
/// counts once (the first claim wins; the other copy is answered `duplicate`, or `ok` if its
/// claim was undecided, and dropped). Then the database is crash-stopped: both instances take
/// new batches (answered `ok`, held), and once it is back each counts once again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_database_count_each_batch_once() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let url = pg.connection_string("postgres");
    let port_a = free_port();
    let configs = [
        daemon_config(&dir.path().join("a"), &url, "a", |c| {
            c.metrics.set_listen(Some(format!("127.0.0.1:{port_a}")))
        }),
        daemon_config(&dir.path().join("b"), &url, "b", |_| {}),
    ];
    let sockets = [
        dir.path().join("a/tallyd.sock"),
        dir.path().join("b/tallyd.sock"),
    ];
    let mut daemons = Vec::new();
    for c in &configs {
        let c = c.clone();
        daemons.push(
            tokio::task::spawn_blocking(move || spawn_daemon(&c))
                .await
                .unwrap(),
        );
    }
    let send_all = move |prefix: &'static str, n: usize| {
        let handles: Vec<_> = sockets
            .iter()
            .cloned()
            .map(|socket| {
                std::thread::spawn(move || {
                    let mut answers = Vec::new();
                    for b in 0..n {
                        let (lines, _) = body("t", 200, 1);
                        answers.push(send_until_answered(
                            &socket,
                            &format!("{prefix}:{b}"),
                            &lines,
                        ));
                    }
                    answers
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    };
    let send = send_all.clone();
    let answers = tokio::task::spawn_blocking(move || send("both", 30))
        .await
        .unwrap();
    let client = sql(&url).await;
    // Committed by `!flush`-less waiting: poll until both settled.
    common::wait_until("both copies settled", async || {
        counter_total(&client, "downloads").await == 30 * 200
    })
    .await;
    let duplicates = answers
        .iter()
        .flatten()
        .filter(|a| *a == "duplicate")
        .count();
    assert!(duplicates > 0, "no copy was told duplicate: {answers:?}");

    // The database crash-stopped: new batches to both are answered `ok`, held.
    common::stop_postgres_immediate(pg).await;
    let answers = tokio::task::spawn_blocking(move || send_all("down", 3))
        .await
        .unwrap();
    assert!(
        answers.iter().flatten().all(|a| a == "ok 200 0"),
        "{answers:?}"
    );
    let pg = common::postgres(dir.path()).await;
    let client = sql(&url).await;
    common::wait_until("the held batches counted once", async || {
        counter_total(&client, "downloads").await == 33 * 200
    })
    .await;
    // Nothing more arrives later (the dropped copies stay dropped), and a stop leaves none held.
    let samples = tokio::task::spawn_blocking(move || {
        common::wait_until_blocking("instance a holds no batch", || {
            common::Samples::parse(&common::scrape(
                format!("127.0.0.1:{port_a}").parse().unwrap(),
            ))
            .get("tallyd_batches_held")
                == Some(0.0)
        });
        common::scrape(format!("127.0.0.1:{port_a}").parse().unwrap())
    })
    .await
    .unwrap();
    assert!(
        samples.contains("tallyd_batches_total{outcome="),
        "{samples}"
    );
    for d in daemons {
        assert!(d.terminate().success());
    }
    assert_eq!(counter_total(&client, "downloads").await, 33 * 200);
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM tallyd.batches").await,
        33
    );
    common::stop_postgres(pg).await;
}

/// A batch whose keys live on two databases is claimed in each; its second copy counts
/// nothing on either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_across_shards_is_claimed_in_every_database_it_routes_to() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfos = common::create_databases(&pg, 2).await;
    let config = Harness::config_for(dir.path())
        .with(|c| c.database.shards = conninfos.clone())
        .build();
    let socket = config.listen.socket().unwrap().to_path_buf();
    let daemon = InProcess::spawn(config);
    let mut c = LineClient::connect(&socket).await;
    let lines = buf_of((0..500).map(|k| format!("views {k} 2")));
    let batch = |c: &str| {
        let mut b = b"!batch shards:1\n".to_vec();
        b.extend_from_slice(&lines);
        b.extend_from_slice(format!("!commit\n{c}").as_bytes());
        String::from_utf8(b).unwrap()
    };
    expect(&mut c, &batch("!flush\n"), &["ok", "ok 500 0", "ok 0 0"]).await;
    expect(&mut c, &batch("!flush\n"), &["ok", "duplicate", "ok 0 0"]).await;
    assert_eq!(counter_total_over(&conninfos, "views").await, 1000);
    for conninfo in &conninfos {
        let client = sql(conninfo).await;
        assert!(counter_total(&client, "views").await > 0, "keys on both");
        assert_eq!(
            scalar(
                &client,
                "SELECT count(*) FROM tallyd.batches WHERE id = 'shards:1'"
            )
            .await,
            1
        );
    }
    drop(c);
    daemon.stop().await.unwrap();
    common::stop_postgres(pg).await;
}

/// Claims older than `batch.remember_days` are pruned in bounded steps (here more than one
/// step's worth), and how many are remembered and the oldest show in /status and the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_claims_are_pruned_and_the_rest_are_shown() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let url = pg.connection_string("postgres");
    let port = free_port();
    let config = daemon_config(&dir.path().join("d"), &url, "pruned", |c| {
        c.metrics.set_listen(Some(format!("127.0.0.1:{port}")));
        c.batch.remember_days = 3;
    });
    // Migrated by a first start, then 25,000 claims of 4 days ago and 5 of 2 days ago.
    let daemon = tokio::task::spawn_blocking({
        let config = config.clone();
        move || spawn_daemon(&config)
    })
    .await
    .unwrap();
    assert!(daemon.terminate().success());
    let client = sql(&url).await;
    client
        .batch_execute(
            "INSERT INTO tallyd.batches (id, instance_id, payload, claimed_at) \
             SELECT 'old:' || i, 'x', i, now() - interval '4 days' FROM generate_series(1, 25000) i; \
             INSERT INTO tallyd.batches (id, instance_id, payload, claimed_at) \
             SELECT 'kept:' || i, 'x', i, now() - interval '2 days' FROM generate_series(1, 5) i",
        )
        .await
        .unwrap();
    let daemon = tokio::task::spawn_blocking({
        let config = config.clone();
        move || spawn_daemon(&config)
    })
    .await
    .unwrap();
    let socket = dir.path().join("d/tallyd.sock");
    let (lines, _) = body("p", 10, 1);
    assert_eq!(
        tokio::task::spawn_blocking(move || send_until_answered(&socket, "new:1", &lines))
            .await
            .unwrap(),
        "ok 10 0"
    );
    common::wait_until("old claims pruned", async || {
        scalar(&client, "SELECT count(*) FROM tallyd.batches").await == 6
    })
    .await;
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let status = tokio::task::spawn_blocking(move || {
        common::wait_until_blocking("the claims counted", || {
            common::Samples::parse(&common::scrape(addr))
                .get("tallyd_batch_ids_remembered{database=\"0\"}")
                == Some(6.0)
        });
        let samples = common::Samples::parse(&common::scrape(addr));
        let oldest = samples.value("tallyd_batch_oldest_claim_timestamp_seconds{database=\"0\"}");
        let age = tallyd::clock::now_seconds() - oldest;
        assert!(
            (2.0 * 86400.0 - 60.0..2.0 * 86400.0 + 60.0).contains(&age),
            "{age}"
        );
        let (code, body) = common::http_get(addr, "/status");
        assert_eq!(code, 200, "{body}");
        body
    })
    .await
    .unwrap();
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["batches"]["remembered"], 6, "{status}");
    assert_eq!(status["batches"]["held"], 0, "{status}");
    let age = status["batches"]["oldest_claim_age_seconds"]
        .as_f64()
        .unwrap();
    assert!(
        (2.0 * 86400.0 - 60.0..2.0 * 86400.0 + 60.0).contains(&age),
        "{age}"
    );
    assert!(daemon.terminate().success());
    common::stop_postgres(pg).await;
}
