//! The outage's bounds: with the database down, tallyd's memory (RSS) and its pending keys stay
//! within what docs/reliability.md says, control lines are answered at the cap, `!sync` is
//! answered and `!flush` waits; once the database returns the spilled events fold in bounded
//! memory, and after kill -9 (while spilled, or while folding) the start's replay is bounded by
//! the cap too. A stop with the database down keeps its events in the journal for the next
//! start. Every acknowledged event committed exactly once.

use std::net::SocketAddr;
use std::time::Duration;

use tallyd::config::{Config, FsyncMode};

use crate::common::{buf_of, scalar_pair, sql, Daemon, LineClient, Samples};
use crate::{rss_mib, Rig};

/// The memory cap of the folding tests, and ten times as many distinct keys and more.
const CAP: usize = 2_000;
const CLIENTS: usize = 4;
const PER_CLIENT: usize = 12_500;
const KEYS: usize = CLIENTS * PER_CLIENT;
/// Lines per `!sync`.
const CHUNK: usize = 500;
/// Each event adds this much: a total counts every event once.
const DELTA: i64 = 3;
/// `listen.read_buffer_bytes` (the default) over the shortest line sent: the most events one
/// read, and so one record, can carry.
const EVENTS_PER_RECORD: usize = 65_536 / "downloads c0-k00000 3\n".len() + 1;
/// Pending keys may pass the cap by the events of the record being routed when it was reached:
/// a connection counts its read's events before it checks for room (so it spills past the cap),
/// while the folder (or the replay) checks before it routes one record; allow one of each.
const BOUND: f64 = (CAP + 2 * EVENTS_PER_RECORD) as f64;

/// A daemon with a memory cap of [`CAP`] keys whose PostgreSQL is stopped once it is up.
async fn outage() -> (Rig, Daemon) {
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |_| {}).await;
    rig.pg_down().await;
    (rig, daemon)
}

/// Clients send KEYS distinct keys, each chunk acknowledged by `!sync` while the database is
/// down; returns the connections, still open.
async fn fill(rig: &Rig) -> Vec<LineClient> {
    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        let socket = rig.socket();
        tasks.push(tokio::spawn(async move {
            let mut c = LineClient::connect(&socket).await;
            for chunk in 0..PER_CLIENT / CHUNK {
                let lines = buf_of(
                    (0..CHUNK).map(|k| format!("downloads c{i}-k{:05} {DELTA}", chunk * CHUNK + k)),
                );
                c.send_synced(&lines).await;
            }
            c
        }));
    }
    let mut clients = Vec::new();
    for t in tasks {
        clients.push(t.await.unwrap());
    }
    let s = rig.samples().await;
    let pending = s.value("tallyd_pending_keys");
    let spilled = s.value("tallyd_journal_spilled_events_total");
    assert!(pending <= BOUND, "{pending} keys pending, over {BOUND}");
    assert!(
        spilled >= (KEYS - CAP) as f64 - BOUND,
        "only {spilled} events spilled: the memory cap was not what held them"
    );
    println!("database down: {KEYS} keys acknowledged, {pending} pending in memory, {spilled} events spilled");
    clients
}

/// The total committed of client `client`'s keys.
async fn client_total(rig: &Rig, client: usize) -> i64 {
    scalar_pair(
        &sql(&rig.conninfos[0]).await,
        &format!(
            "SELECT count(*), coalesce(sum(count), 0)::bigint FROM tallyd.totals WHERE key LIKE 'c{client}-%'"
        ),
    )
    .await
    .1
}

/// Samples `tallyd_pending_keys` until `done`, failing if a sample passes the bound; returns the
/// highest.
async fn sample_pending(addr: SocketAddr, done: tokio::sync::watch::Receiver<bool>) -> f64 {
    let mut highest = 0.0f64;
    while !*done.borrow() {
        let scraped = tokio::task::spawn_blocking(move || {
            std::panic::catch_unwind(|| Samples::parse(&crate::common::scrape(addr)))
        })
        .await
        .unwrap();
        // The endpoint is not up yet (a restart) or gone: nothing to sample.
        if let Ok(s) = scraped {
            if let Some(pending) = s.get("tallyd_pending_keys") {
                assert!(pending <= BOUND, "{pending} keys pending, over {BOUND}");
                highest = highest.max(pending);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    highest
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spilled_events_fold_exactly_and_in_bounded_memory_when_the_database_returns() {
    let (mut rig, daemon) = outage().await;
    let mut clients = fill(&rig).await;
    // `!flush` on a connection whose events were spilled waits for the database.
    let mut first = clients.remove(0);
    let flushed = tokio::spawn(async move { (first.flush().await, first) });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !flushed.is_finished(),
        "`!flush` answered with the database down"
    );

    let (done_tx, done_rx) = tokio::sync::watch::channel(false);
    let sampler = tokio::spawn(sample_pending(rig.metrics, done_rx));
    rig.pg_up().await;
    let ((accepted, rejected), _first) = flushed.await.unwrap();
    assert_eq!((accepted, rejected), (PER_CLIENT as u64, 0));
    // Answered once committed: every event of that connection is in the table now.
    assert_eq!(client_total(&rig, 0).await, PER_CLIENT as i64 * DELTA);
    for mut c in clients {
        assert_eq!(c.flush().await, (PER_CLIENT as u64, 0));
    }
    done_tx.send(true).unwrap();
    let highest = sampler.await.unwrap();
    assert_eq!(rig.totals().await, (KEYS as i64, KEYS as i64 * DELTA));
    let s = rig.samples().await;
    assert_eq!(
        s.value("tallyd_journal_folded_events_total"),
        s.value("tallyd_journal_spilled_events_total")
    );
    assert_eq!(s.value("tallyd_journal_unfolded_records"), 0.0);
    println!("folded in bounded memory: at most {highest} keys pending (cap {CAP}, bound {BOUND})");
    assert!(daemon.terminate().success());
    let left = std::fs::read_dir(rig.journal_dir()).map_or(0, |d| d.count());
    assert_eq!(left, 0, "a graceful stop leaves no journal behind");
}

/// Starts the daemon again on the same data_dir (its PostgreSQL up) while sampling the pending
/// keys: the replay of the spilled records at the start is bounded by the cap too.
async fn restart_sampled(rig: &Rig) -> (Daemon, f64) {
    let (done_tx, done_rx) = tokio::sync::watch::channel(false);
    let sampler = tokio::spawn(sample_pending(rig.metrics, done_rx));
    let daemon = rig.spawn().await;
    done_tx.send(true).unwrap();
    (daemon, sampler.await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_while_spilled_then_a_bounded_replay_loses_and_doubles_nothing() {
    let (mut rig, daemon) = outage().await;
    let clients = fill(&rig).await;
    drop(clients);
    daemon.kill();
    rig.pg_up().await;
    assert_eq!(
        rig.totals().await,
        (0, 0),
        "nothing committed with the database down"
    );
    let (daemon, highest) = restart_sampled(&rig).await;
    // The start answers `!ping` once the replay has committed.
    assert_eq!(rig.totals().await, (KEYS as i64, KEYS as i64 * DELTA));
    println!("replayed {KEYS} spilled keys: at most {highest} keys pending (bound {BOUND})");
    assert!(daemon.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_while_folding_loses_and_doubles_nothing() {
    let (mut rig, daemon) = outage().await;
    let clients = fill(&rig).await;
    rig.pg_up().await;
    // Killed once the folder has routed a third of the spilled events and before it is done.
    let spilled = rig
        .samples()
        .await
        .value("tallyd_journal_spilled_events_total");
    let folded = loop {
        let s = rig.samples().await;
        let folded = s.value("tallyd_journal_folded_events_total");
        if folded >= spilled / 3.0 {
            break folded;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    daemon.kill();
    drop(clients);
    let committed = rig.totals().await;
    assert!(
        folded < spilled && committed.1 < KEYS as i64 * DELTA,
        "the kill came after the fold ({folded} of {spilled} folded, {committed:?} committed)"
    );
    let (daemon, highest) = restart_sampled(&rig).await;
    assert_eq!(rig.totals().await, (KEYS as i64, KEYS as i64 * DELTA));
    println!(
        "kill -9 with {folded} of {spilled} spilled events folded, {} of {} committed: \
         exact after the replay (at most {highest} keys pending)",
        committed.1,
        KEYS as i64 * DELTA
    );
    assert!(daemon.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_stays_bounded_while_the_database_is_down() {
    const CAP: usize = 20_000;
    const KEYS: usize = 300_000;
    const RSS_BOUND_MIB: f64 = 96.0;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |c| c.flush.max_pending_keys = 5000).await;
    rig.pg_down().await;

    let sender = {
        let socket = rig.socket();
        tokio::spawn(async move {
            let mut c = LineClient::connect(&socket).await;
            for chunk in 0..KEYS / 10_000 {
                let lines =
                    buf_of((0..10_000).map(|k| format!("downloads m{} 1", chunk * 10_000 + k)));
                c.send(&lines).await;
            }
            c.flush().await
        })
    };
    // With the database down, past the cap its events are spilled to the journal (not held in
    // memory), and its `!flush` waits for the database.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rss = rss_mib(daemon.pid());
    assert!(
        !sender.is_finished(),
        "`!flush` answered with the database down"
    );
    assert!(
        rss < RSS_BOUND_MIB,
        "RSS {rss:.1} MiB over the bound {RSS_BOUND_MIB} MiB"
    );

    rig.pg_up().await;
    assert_eq!(sender.await.unwrap(), (KEYS as u64, 0));
    assert_eq!(rig.totals().await, (KEYS as i64, KEYS as i64));
    println!("memory: RSS {rss:.1} MiB with {CAP} keys pending and the database down");
    assert!(daemon.terminate().success());
}

/// A client that sends `lines`, then `!flush`; it returns the counts.
fn sender(rig: &Rig, lines: Vec<u8>) -> tokio::task::JoinHandle<(u64, u64)> {
    let socket = rig.socket();
    tokio::spawn(async move {
        let mut c = LineClient::connect(&socket).await;
        c.send(&lines).await;
        c.flush().await
    })
}

/// Starts PostgreSQL again, waits for `senders`, stops the daemon, and returns the keys and the
/// total committed, and each sender's counts.
async fn recover(
    mut rig: Rig,
    daemon: Daemon,
    senders: Vec<tokio::task::JoinHandle<(u64, u64)>>,
) -> (i64, i64, Vec<(u64, u64)>) {
    rig.pg_up().await;
    let mut counts = Vec::new();
    for s in senders {
        counts.push(s.await.unwrap());
    }
    let (keys, total) = rig.totals().await;
    assert!(daemon.terminate().success());
    (keys, total, counts)
}

/// Reads one reply line, failing the test if none comes within `wait`: a liveness bound for
/// replies that must not depend on the database, not a speed check.
async fn reply_within(c: &mut LineClient, wait: Duration, what: &str) -> String {
    tokio::time::timeout(wait, c.read_line())
        .await
        .unwrap_or_else(|_| panic!("no answer to {what} within {wait:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_lines_are_answered_at_the_memory_cap_with_the_database_down() {
    const CAP: usize = 1_000;
    const KEYS: usize = 20_000;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |_| {}).await;
    rig.pg_down().await;
    // A client fills memory up to the cap (the rest of its events spill to the journal); its
    // `!flush` waits for the database.
    let filler = sender(&rig, buf_of((0..KEYS).map(|k| format!("downloads cap{k}"))));
    while rig.samples().await.value("tallyd_pending_keys") < CAP as f64 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Another connects at the cap: its control lines are answered without waiting for room.
    let mut b = rig.client().await;
    b.send(b"!ping\n!sync\n!flush\n").await;
    let wait = Duration::from_secs(30);
    assert_eq!(reply_within(&mut b, wait, "!ping").await, "pong\n");
    assert_eq!(reply_within(&mut b, wait, "!sync").await, "ok\n");
    assert_eq!(reply_within(&mut b, wait, "!flush").await, "ok 0 0\n");
    assert!(
        !filler.is_finished(),
        "the filler's `!flush` must still wait"
    );
    // After the event line it sends, its `!flush` waits for the database.
    let late = {
        let mut b = b;
        tokio::spawn(async move {
            b.send(b"downloads late 1\n").await;
            b.flush().await
        })
    };

    // The database returns: everything read is committed exactly once.
    let (keys, total, counts) = recover(rig, daemon, vec![filler, late]).await;
    assert_eq!(counts, [(KEYS as u64, 0), (1, 0)]);
    assert_eq!((keys, total), (KEYS as i64 + 1, KEYS as i64 + 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_keys_stay_within_the_documented_bound() {
    const CAP: usize = 1_000;
    const KEYS: usize = 50_000;
    /// `listen.read_buffer_bytes`, the default.
    const READ_BUFFER: usize = 65_536;
    let (mut rig, daemon) = Rig::start(CAP, 0, &[], |_| {}).await;
    rig.pg_down().await;
    // Every line has the same length, so one read holds at most READ_BUFFER / LINE + 1 events.
    let line = |k: usize| format!("downloads k{k:06}");
    let line_bytes = line(0).len() + 1;
    let bound = (CAP - 1 + READ_BUFFER / line_bytes + 1) as f64;
    let sender = sender(&rig, buf_of((0..KEYS).map(line)));
    // Sampled until the count has stopped moving (nothing commits: it only grows); the bound
    // must hold at every sample.
    let mut samples = Vec::new();
    loop {
        let keys = rig.samples().await.value("tallyd_pending_keys");
        assert!(
            keys <= bound,
            "{keys} keys pending, over the bound {bound} (samples {samples:?})"
        );
        samples.push(keys);
        let n = samples.len();
        if keys >= CAP as f64 && n >= 4 && samples[n - 4] == keys {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        !sender.is_finished(),
        "`!flush` answered with the database down"
    );

    let (keys, total, counts) = recover(rig, daemon, vec![sender]).await;
    assert_eq!(counts, [(KEYS as u64, 0)]);
    assert_eq!((keys, total), (KEYS as i64, KEYS as i64));
    println!(
        "memory cap {CAP}: at most {} keys pending (bound {bound})",
        samples.iter().cloned().fold(0.0, f64::max)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_with_the_database_down_keeps_events_for_the_next_start() {
    let cap = Config::default().coalesce.max_pending_keys;
    let (mut rig, daemon) = Rig::start(cap, 0, &[], |c| {
        c.journal.fsync = FsyncMode::Always;
        // A short final-flush deadline.
        c.daemon.set_shutdown_timeout(Duration::from_millis(1000));
    })
    .await;
    rig.pg_down().await;
    // Accepted and journaled while the database is down...
    let mut c = rig.client().await;
    c.send_synced(&buf_of((0..1000).map(|k| format!("downloads down{k} 3"))))
        .await;
    drop(c);
    // ...then a graceful stop that cannot flush: it gives up after shutdown_timeout_ms.
    assert!(daemon.terminate().success());
    let segments = std::fs::read_dir(rig.journal_dir()).unwrap().count();
    assert!(segments > 0, "the unflushed events stay in the journal");

    rig.pg_up().await;
    let daemon = rig.spawn().await;
    let replayed = scalar_pair(
        &sql(&rig.conninfos[0]).await,
        "SELECT count(*), sum(count)::bigint FROM tallyd.totals WHERE key LIKE 'down%'",
    )
    .await;
    assert_eq!(replayed, (1000, 3000));
    assert!(daemon.terminate().success());
    let left = std::fs::read_dir(rig.journal_dir()).map_or(0, |d| d.count());
    assert_eq!(left, 0, "replayed segments are deleted");
}
