//! Crashes and stops with records spilled: kill -9 while the folder routes a backlog and during
//! the next starts' bounded replays, tallyd's sessions terminated every 100 ms throughout; a
//! graceful stop bounded by its timeouts, whether the database is down or the folder busy; two
//! shard databases with two flush writers each. Every event once.

use std::time::{Duration, Instant};

use tallyd::config::Config;

use crate::common::{scalar_pair, sql, Daemon, Sessions, Terminator};
use crate::{flushed, round, start_unready, Rig, PATIENCE};

enum Killed {
    Yes,
    /// It exited by itself first.
    Exited,
    /// Everything was committed first (it was then killed all the same).
    Done,
}

/// Waits until the committed sum is at least `at`, then kill -9.
async fn kill_when_committed(
    rig: &Rig,
    child: &mut std::process::Child,
    at: i64,
    all: i64,
) -> Killed {
    let deadline = Instant::now() + PATIENCE;
    loop {
        assert!(
            Instant::now() < deadline,
            "nothing committed for {PATIENCE:?}"
        );
        if child.try_wait().unwrap().is_some() {
            return Killed::Exited;
        }
        // The database is being disturbed: a failed read is read again.
        let conninfo = rig.conninfos[0].clone();
        let sum = match tokio_postgres::connect(&conninfo, tokio_postgres::NoTls).await {
            Ok((client, conn)) => {
                tokio::spawn(conn);
                client
                    .query_one(
                        "SELECT coalesce(sum(count), 0)::bigint FROM tallyd.totals",
                        &[],
                    )
                    .await
                    .map(|r| r.get::<_, i64>(0))
                    .unwrap_or(0)
            }
            Err(_) => 0,
        };
        if sum >= at {
            child.kill().unwrap();
            child.wait().unwrap();
            return if sum >= all {
                Killed::Done
            } else {
                Killed::Yes
            };
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Spilled with the database down; then, with every tallyd session terminated every 100 ms
/// throughout: kill -9 while the folder routes the backlog, kill -9 twice during the next
/// starts' bounded replays (each further in), and a last start. Every event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_while_folding_and_during_replays_with_backends_terminated() {
    const CAP: usize = 1_000;
    const CLIENTS: usize = 4;
    const ROUNDS: usize = 16;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |c| {
        c.journal.segment_bytes = 256 << 10;
        c.flush.connections = 2;
    })
    .await;
    rig.pg_down().await;
    let clients = rig.synced_rounds(CLIENTS, ROUNDS, 500).await;
    let all = (CLIENTS * ROUNDS * 500) as i64;
    rig.pg_up().await;
    let terminations = Terminator::start(&rig.conninfos[0], Sessions::Tallyd, 100..101);
    // While folding.
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (_, sum) = rig.totals().await;
        if sum >= all / 5 {
            break;
        }
        assert!(Instant::now() < deadline, "the fold does not progress");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    daemon.kill();
    drop(clients);
    let mut kills = vec![rig.totals().await.1];
    // During two replays, each further in. A start whose own session is terminated before
    // its replay exits (status 1, "connection closed"): it is started again, as systemd would.
    // Each such start lasts a fraction of a second; on a loaded machine most starts meet a
    // termination before their replay, so the bound is generous (it only catches a start that
    // can never get through).
    let mut refused = 0;
    for at in [all / 2, all * 3 / 4] {
        loop {
            let mut child = start_unready(&rig);
            match kill_when_committed(&rig, &mut child, at, all).await {
                Killed::Yes => kills.push(rig.totals().await.1),
                Killed::Exited => {
                    refused += 1;
                    assert!(refused < 200, "200 starts ended by themselves");
                    continue;
                }
                Killed::Done => {}
            }
            break;
        }
    }
    let ended = terminations.stop().await;
    let daemon = rig.spawn().await;
    let mut c = rig.client().await;
    flushed(&mut c, "after the last start").await;
    assert_eq!(rig.totals().await, (all, all));
    println!(
        "{all} events; kill -9 with {kills:?} committed; {ended} sessions terminated, \
         {refused} starts ended by a terminated session; exact"
    );
    assert!(
        kills.len() >= 2,
        "no kill landed during a replay: {kills:?}"
    );
    assert!(daemon.terminate().success());
}

/// SIGTERM, then how long the daemon took to exit (it must exit 0).
fn stop_timed(daemon: Daemon) -> Duration {
    let started = Instant::now();
    assert!(daemon.terminate().success(), "the stop failed");
    started.elapsed()
}

/// Spilled records at a graceful stop: once with the database down (a `!flush` waiting), once
/// with the database up while the folder routes a backlog larger than the stop has time for.
/// Each stop is bounded by the drain and shutdown timeouts, the waiting `!flush` is not
/// answered `ok`, the log says how many records are left, and the next start replays them
/// exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stops_with_spilled_records_are_bounded_and_the_next_start_replays_them() {
    const CAP: usize = 500;
    const ROUNDS: usize = 20;
    let bound = Duration::from_secs(1 + 2 + 5);
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |c| {
        c.daemon.set_drain_timeout(Duration::from_secs(1));
        c.daemon.set_shutdown_timeout(Duration::from_secs(2));
    })
    .await;
    rig.pg_down().await;
    let mut a = rig.client().await;
    for n in 0..ROUNDS {
        assert_eq!(round(&mut a, &format!("a{n:03}"), 500).await, "ok\n");
    }
    let mut sent = (ROUNDS * 500) as i64;
    // A `!flush` that can only be answered once the database is back.
    a.send(b"!flush\n").await;
    // The connection's end ("") or reset (the task panics) is what a stop may give it.
    let waiting = tokio::spawn(async move { a.read_line().await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let took = stop_timed(daemon);
    let answer = waiting
        .await
        .unwrap_or_else(|_| "<connection reset>".into());
    println!("stop with the database down: {took:?}; the waiting `!flush` got {answer:?}");
    assert!(took < bound, "the stop took {took:?}");
    assert!(
        !answer.starts_with("ok"),
        "`!flush` answered {answer:?} with nothing committed"
    );

    rig.pg_up().await;
    let daemon = rig.spawn().await;
    assert_eq!(rig.totals().await, (sent, sent), "replayed exactly");

    // Again with the database up: a backlog the stop cannot fold in its time (no flush can
    // commit once the fold is under way; the stop folds while it can: tests below), and the
    // stop while the folder routes it.
    rig.pg_down().await;
    let mut b = rig.client().await;
    for n in 0..ROUNDS * 8 {
        assert_eq!(round(&mut b, &format!("b{n:03}"), 500).await, "ok\n");
    }
    sent += (ROUNDS * 8 * 500) as i64;
    let spilled = rig
        .samples()
        .await
        .value("tallyd_journal_spilled_events_total");
    rig.pg_up().await;
    loop {
        if rig
            .samples()
            .await
            .value("tallyd_journal_folded_events_total")
            >= spilled / 10.0
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(b);
    // From here no flush commits until the stop is over: the stop meets a backlog it cannot
    // fold in its time on any machine (without this, a fast machine folded it all).
    let (locker, connection) = tokio_postgres::connect(&rig.conninfos[0], tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    locker
        .batch_execute("BEGIN; LOCK TABLE tallyd.slots IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let log_path = rig.config.with_extension("log");
    let took = stop_timed(daemon);
    locker.batch_execute("COMMIT").await.unwrap();
    let committed = rig.totals().await;
    let log = std::fs::read_to_string(&log_path).unwrap();
    println!("stop while folding: {took:?}, {committed:?} committed of {sent}");
    assert!(took < bound, "the stop took {took:?}");
    assert!(
        committed.1 < sent,
        "the fold ended before the stop: the test proves nothing"
    );
    assert!(log.contains("spilled journal records not yet routed at the stop"));
    let daemon = rig.spawn().await;
    assert_eq!(rig.totals().await, (sent, sent), "replayed exactly");
    assert!(daemon.terminate().success());
}

/// A graceful stop with the database up, right after an outage that spilled: the stop folds
/// what is still spilled and writes it within `daemon.shutdown_timeout_ms`, so nothing is left
/// for the next start (docs/protocol.md: "Everything read is written in a final flush"): exact
/// in the database before any restart, and after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_with_the_database_up_writes_what_was_spilled() {
    const CAP: usize = 1_000;
    const ROUNDS: usize = 60;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |c| {
        c.daemon.set_shutdown_timeout(Duration::from_secs(60));
    })
    .await;
    rig.pg_down().await;
    let mut a = rig.client().await;
    for n in 0..ROUNDS {
        assert_eq!(round(&mut a, &format!("a{n:03}"), 500).await, "ok\n");
    }
    let sent = (ROUNDS * 500) as i64;
    let spilled = rig
        .samples()
        .await
        .value("tallyd_journal_spilled_events_total");
    assert!(
        spilled >= (sent - CAP as i64 * 2) as f64,
        "only {spilled} of {sent} events spilled"
    );
    drop(a);
    rig.pg_up().await;
    let log_path = rig.config.with_extension("log");
    let took = stop_timed(daemon);
    let committed = rig.totals().await;
    let log = std::fs::read_to_string(&log_path).unwrap();
    println!("stop {took:?} after the outage: {committed:?} committed of {sent}");
    assert_eq!(
        committed,
        (sent, sent),
        "written by the stop, before any restart"
    );
    assert!(!log.contains("not yet routed at the stop"));
    // And nothing is replayed twice.
    let daemon = rig.spawn().await;
    assert_eq!(rig.totals().await, (sent, sent));
    assert!(daemon.terminate().success());
}

/// Two shard databases in one cluster, two flush writers each (four writers whose coverage a
/// `!flush` after spilled records waits for), spilled with the cluster down; kill -9 halfway
/// through the fold, a restart, and every `!flush` answered: exact over the databases, each
/// key in the database its shard maps to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_and_two_writers_fold_and_replay_exactly() {
    const CAP: usize = 1_000;
    const CLIENTS: usize = 4;
    const ROUNDS: usize = 12;
    let (mut rig, daemon) = Rig::start(CAP, 2, &[], |c| {
        c.flush.connections = 2;
        c.coalesce.buckets = 64;
    })
    .await;
    rig.pg_down().await;
    let mut clients = rig.synced_rounds(CLIENTS, ROUNDS, 400).await;
    let all = (CLIENTS * ROUNDS * 400) as i64;
    rig.pg_up().await;
    // One connection's `!flush` is answered while the fold goes on.
    let first = flushed(&mut clients[0], "shards, first client").await;
    assert_eq!(first, ((ROUNDS * 400) as u64, 0));
    // Answered once committed: every event of that connection is in its database now.
    let mut c0 = 0;
    for conninfo in &rig.conninfos {
        c0 += scalar_pair(
            &sql(conninfo).await,
            "SELECT count(*), coalesce(sum(count), 0)::bigint FROM tallyd.totals WHERE key LIKE 'c0-%'",
        )
        .await
        .1;
    }
    assert_eq!(
        c0,
        (ROUNDS * 400) as i64,
        "`!flush` answered before its events committed"
    );
    let committed = rig.totals().await;
    daemon.kill();
    drop(clients);
    println!("kill -9 with {committed:?} of {all} committed");
    let daemon = rig.spawn().await;
    let mut c = rig.client().await;
    flushed(&mut c, "after the restart").await;
    assert_eq!(rig.totals().await, (all, all));
    // Each database holds the keys of its shards only: the layout's database for each key.
    let config = Config::load(&rig.config).unwrap();
    let layout = config.layout();
    let seed = tallyd::routing::counter_seed("downloads");
    for (d, conninfo) in rig.conninfos.iter().enumerate() {
        let rows = crate::common::counts(&sql(conninfo).await, "downloads").await;
        assert!(!rows.is_empty(), "database {d} holds no key");
        for (key, count) in rows {
            assert_eq!(count, 1, "{key}");
            let hash = tallyd::routing::key_hash(seed, key.as_bytes());
            assert_eq!(layout.database(hash), d, "{key} in the wrong database");
        }
    }
    assert!(daemon.terminate().success());
}
