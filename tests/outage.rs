//! An outage bounded by disk, not memory: with the database down and `coalesce.max_pending_keys`
//! reached, tallyd keeps accepting events into the journal (spilled: journaled only), answers
//! `!sync`, and folds them into memory, in bounded memory, once the database returns; through
//! kill -9 while spilled, kill -9 while folding and the bounded replay at the next start, every
//! acknowledged event is committed exactly once. Real PostgreSQL, stopped and started.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use common::{
    buf_of, free_port, scalar_pair, sql, temp_dir, Daemon, LineClient, Samples, TestConfig,
};
use tallyd::config::KeyTypeName;

/// The memory cap, and ten times as many distinct keys and more.
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

struct Outage {
    dir: tempfile::TempDir,
    config: PathBuf,
    conninfo: String,
    metrics: SocketAddr,
}

impl Outage {
    /// A daemon with a small memory cap; its PostgreSQL is stopped once it is up.
    async fn start() -> (Outage, Daemon) {
        let dir = temp_dir();
        let pg = common::postgres(dir.path()).await;
        let conninfo = pg.connection_string("postgres");
        let port = free_port();
        let config = TestConfig::new(dir.path())
            .counters(&[("downloads", KeyTypeName::Text)])
            .database_url(&conninfo)
            .metrics_port(port)
            .with(|c| {
                c.daemon.set_instance_id(Some("outage".into()));
                c.listen.set_datagram_socket(None);
                c.rollup.enabled = false;
                c.coalesce.max_pending_keys = CAP;
                c.flush.max_pending_keys = CAP / 2;
                c.flush.set_retry_max(Duration::from_millis(200));
            })
            .write();
        let daemon = common::spawn_daemon(&config);
        common::stop_postgres_immediate(pg).await;
        let outage = Outage {
            dir,
            config,
            conninfo,
            metrics: ([127, 0, 0, 1], port).into(),
        };
        (outage, daemon)
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("tallyd.sock")
    }

    async fn samples(&self) -> Samples {
        let addr = self.metrics;
        tokio::task::spawn_blocking(move || Samples::parse(&common::scrape(addr)))
            .await
            .unwrap()
    }

    /// Clients send KEYS distinct keys, each chunk acknowledged by `!sync` while the database
    /// is down; returns the connections, still open.
    async fn fill(&self) -> Vec<LineClient> {
        let mut tasks = Vec::new();
        for i in 0..CLIENTS {
            let socket = self.socket();
            tasks.push(tokio::spawn(async move {
                let mut c = LineClient::connect(&socket).await;
                for chunk in 0..PER_CLIENT / CHUNK {
                    let lines = buf_of(
                        (0..CHUNK)
                            .map(|k| format!("downloads c{i}-k{:05} {DELTA}", chunk * CHUNK + k)),
                    );
                    c.send(&lines).await;
                    c.send(b"!sync\n").await;
                    let reply = tokio::time::timeout(Duration::from_secs(60), c.read_line())
                        .await
                        .expect("`!sync` must be answered while the database is down");
                    assert_eq!(reply, "ok\n");
                }
                c
            }));
        }
        let mut clients = Vec::new();
        for t in tasks {
            clients.push(t.await.unwrap());
        }
        let s = self.samples().await;
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

    async fn totals(&self) -> (i64, i64) {
        scalar_pair(
            &sql(&self.conninfo).await,
            "SELECT count(*), coalesce(sum(count), 0)::bigint FROM tallyd.totals",
        )
        .await
    }

    async fn client_total(&self, client: usize) -> i64 {
        scalar_pair(
            &sql(&self.conninfo).await,
            &format!(
                "SELECT count(*), coalesce(sum(count), 0)::bigint FROM tallyd.totals WHERE key LIKE 'c{client}-%'"
            ),
        )
        .await
        .1
    }
}

/// Samples `tallyd_pending_keys` until `done`, failing if a sample passes the bound; returns the
/// highest.
async fn sample_pending(addr: SocketAddr, done: tokio::sync::watch::Receiver<bool>) -> f64 {
    let mut highest = 0.0f64;
    while !*done.borrow() {
        let scraped = tokio::task::spawn_blocking(move || {
            std::panic::catch_unwind(|| Samples::parse(&common::scrape(addr)))
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
    let (t, daemon) = Outage::start().await;
    let mut clients = t.fill().await;
    // `!flush` on a connection whose events were spilled waits for the database.
    let mut first = clients.remove(0);
    let flushed = tokio::spawn(async move { (first.flush().await, first) });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !flushed.is_finished(),
        "`!flush` answered with the database down"
    );

    let (done_tx, done_rx) = tokio::sync::watch::channel(false);
    let sampler = tokio::spawn(sample_pending(t.metrics, done_rx));
    let pg = common::postgres(t.dir.path()).await;
    let ((accepted, rejected), _first) = flushed.await.unwrap();
    assert_eq!((accepted, rejected), (PER_CLIENT as u64, 0));
    // Answered once committed: every event of that connection is in the table now.
    assert_eq!(t.client_total(0).await, PER_CLIENT as i64 * DELTA);
    for mut c in clients {
        assert_eq!(c.flush().await, (PER_CLIENT as u64, 0));
    }
    done_tx.send(true).unwrap();
    let highest = sampler.await.unwrap();
    assert_eq!(t.totals().await, (KEYS as i64, KEYS as i64 * DELTA));
    let s = t.samples().await;
    assert_eq!(
        s.value("tallyd_journal_folded_events_total"),
        s.value("tallyd_journal_spilled_events_total")
    );
    assert_eq!(s.value("tallyd_journal_unfolded_records"), 0.0);
    println!("folded in bounded memory: at most {highest} keys pending (cap {CAP}, bound {BOUND})");
    assert!(daemon.terminate().success());
    let left = std::fs::read_dir(t.dir.path().join("data/journal")).map_or(0, |d| d.count());
    assert_eq!(left, 0, "a graceful stop leaves no journal behind");
    common::stop_postgres(pg).await;
}

/// Starts the daemon again on the same data_dir (its PostgreSQL up) while sampling the pending
/// keys: the replay of the spilled records at the start is bounded by the cap too.
async fn restart_sampled(t: &Outage) -> (Daemon, f64) {
    let (done_tx, done_rx) = tokio::sync::watch::channel(false);
    let sampler = tokio::spawn(sample_pending(t.metrics, done_rx));
    let config = t.config.clone();
    let daemon = tokio::task::spawn_blocking(move || common::spawn_daemon(&config))
        .await
        .unwrap();
    done_tx.send(true).unwrap();
    (daemon, sampler.await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_while_spilled_then_a_bounded_replay_loses_and_doubles_nothing() {
    let (t, daemon) = Outage::start().await;
    let clients = t.fill().await;
    drop(clients);
    daemon.kill();
    let pg = common::postgres(t.dir.path()).await;
    assert_eq!(
        t.totals().await,
        (0, 0),
        "nothing committed with the database down"
    );
    let (daemon, highest) = restart_sampled(&t).await;
    // The start answers `!ping` once the replay has committed.
    assert_eq!(t.totals().await, (KEYS as i64, KEYS as i64 * DELTA));
    println!("replayed {KEYS} spilled keys: at most {highest} keys pending (bound {BOUND})");
    assert!(daemon.terminate().success());
    common::stop_postgres(pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_while_folding_loses_and_doubles_nothing() {
    let (t, daemon) = Outage::start().await;
    let clients = t.fill().await;
    let pg = common::postgres(t.dir.path()).await;
    // Killed once the folder has routed a third of the spilled events and before it is done.
    let spilled = t
        .samples()
        .await
        .value("tallyd_journal_spilled_events_total");
    let folded = loop {
        let s = t.samples().await;
        let folded = s.value("tallyd_journal_folded_events_total");
        if folded >= spilled / 3.0 {
            break folded;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    daemon.kill();
    drop(clients);
    let committed = t.totals().await;
    assert!(
        folded < spilled && committed.1 < KEYS as i64 * DELTA,
        "the kill came after the fold ({folded} of {spilled} folded, {committed:?} committed)"
    );
    let (daemon, highest) = restart_sampled(&t).await;
    assert_eq!(t.totals().await, (KEYS as i64, KEYS as i64 * DELTA));
    println!(
        "kill -9 with {folded} of {spilled} spilled events folded, {} of {} committed: \
         exact after the replay (at most {highest} keys pending)",
        committed.1,
        KEYS as i64 * DELTA
    );
    assert!(daemon.terminate().success());
    common::stop_postgres(pg).await;
}
