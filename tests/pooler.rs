//! tallyd through Debian's PgBouncer in transaction pooling mode, with fewer server connections
//! than tallyd has sessions, so that consecutive transactions of one session land on different
//! server connections: flushes, the ledger after backends are terminated, rollups (daemon and
//! `tallyd rollup`), `tallyd get`, `tallyd migrate` and `tallyd move-shards`, with exact totals;
//! flushes under a 1 ms `idle_in_transaction_session_timeout` too.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::netpg::{net_config, statements_crossed_in_the_pooler, tallyd_cli, Pgbouncer};
use common::{
    db, postgres, scalar, spawn_daemon, sql, temp_dir, terminate, total_and_keys, Harness,
    LineClient, Sessions,
};

/// A liveness bound, not a timing assertion: through a pooler that breaks tallyd's statements a
/// flush retries forever instead of failing.
const BOUND: Duration = Duration::from_secs(120);

async fn flush(c: &mut LineClient) -> (u64, u64) {
    tokio::time::timeout(BOUND, c.flush())
        .await
        .expect("flush did not commit through PgBouncer")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_pooling_counts_exactly() {
    let mut h = Harness::start(|c| {
        c.counters.push(common::windowed_counter(
            "daily",
            "day",
            "Europe/Berlin",
            &["all"],
        ));
        c.flush.connections = 4;
        c.rollup.enabled = true;
        c.rollup.set_interval(Duration::from_millis(50));
        c.rollup.batch_rows = 100;
    })
    .await;
    // A session on the server itself, not through PgBouncer (it survives the terminations
    // below: they spare the session that runs them).
    let direct = h.sql().await;
    let bouncer = Pgbouncer::in_front_of(&mut h, "transaction", 2).await;

    let mut c = h.client().await;
    let mut lines = String::new();
    for i in 0..4000 {
        lines.push_str(&format!("downloads hot\nviews {}\n", i % 1500));
    }
    c.send(lines.as_bytes()).await;
    assert_eq!(flush(&mut c).await, (8000, 0));
    assert_eq!(total_and_keys(&direct, "downloads").await, (4000, 1));
    assert_eq!(total_and_keys(&direct, "views").await, (4000, 1500));

    // The ledger: every server connection is terminated between and during flushes; PgBouncer
    // drops the client sessions whose transaction died, and tallyd learns from tallyd.flushes
    // whether the lost commit happened.
    for round in 0..5 {
        let mut lines = String::new();
        for i in 0..1000 {
            lines.push_str(&format!(
                "downloads hot\nviews {}\n",
                (i + round * 1000) % 1500
            ));
        }
        // A windowed counter too: 100 events a round on each of three Berlin days.
        for day in 0..3i64 {
            for n in 0..100i64 {
                let at = 1_795_560_000_000 + day * 86_400_000 + n;
                lines.push_str(&format!("daily v{} 1 @{at}\n", n % 7));
            }
        }
        c.send(lines.as_bytes()).await;
        let killed = terminate(&direct, Sessions::All).await;
        assert!(killed >= 0);
        assert_eq!(flush(&mut c).await, (2300, 0));
    }
    assert_eq!(total_and_keys(&direct, "daily").await, (1500, 7));
    let days = scalar(
        &direct,
        "SELECT count(*) FROM (SELECT window_start FROM tallyd.window_totals \
         WHERE counter = 'daily' AND span = 'day' GROUP BY window_start \
         HAVING sum(count) = 500) d",
    )
    .await;
    assert_eq!(days, 3, "three days of 500 each through PgBouncer");
    assert_eq!(total_and_keys(&direct, "downloads").await, (9000, 1));
    assert_eq!(total_and_keys(&direct, "views").await.0, 9000);
    h.stop_daemon().await;

    // The command line through the pooler.
    let config = net_config(h.dir.path(), &bouncer.url()).write();
    for _ in 0..2 {
        let out = tallyd_cli(&config, &["migrate"], &[]);
        assert!(out.status.success(), "{out:?}");
    }
    let out = tallyd_cli(
        &config,
        &["rollup", "--until-empty", "--batch-rows", "50"],
        &[],
    );
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        scalar(&direct, "SELECT count(*) FROM tallyd.slots").await,
        0
    );
    assert_eq!(total_and_keys(&direct, "downloads").await, (9000, 1));
    assert_eq!(total_and_keys(&direct, "views").await, (9000, 1500));
    let out = tallyd_cli(&config, &["get", "downloads", "hot"], &[]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("downloads hot count=9000"),
        "{out:?}"
    );
    // Nothing went wrong on the way: a named statement that met another session's on a shared
    // server connection ("already exists", "does not exist") would only show as retries.
    let crossed = statements_crossed_in_the_pooler(h.pg.as_ref().unwrap());
    assert!(crossed.is_empty(), "{crossed:#?}");
    drop(bouncer);
    h.stop().await;
}

/// A 1 ms `idle_in_transaction_session_timeout` on the database behind PgBouncer in transaction
/// mode: a flush's statements go out at once (pipelined), so its transaction, on whichever
/// server connection PgBouncer gives it, never waits on tallyd; every flush commits, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushes_commit_through_pgbouncer_under_a_one_millisecond_idle_in_transaction_timeout() {
    let mut h = Harness::start(|c| {
        c.flush.connections = 2;
        c.flush.batch_rows = 500;
    })
    .await;
    let direct = h.sql().await;
    let bouncer = Pgbouncer::in_front_of(&mut h, "transaction", 2).await;
    // New server sessions take the setting: the present ones (but this one, idle) are ended.
    direct
        .batch_execute("ALTER DATABASE postgres SET idle_in_transaction_session_timeout = '1ms'")
        .await
        .unwrap();
    terminate(&direct, Sessions::All).await;
    let mut c = h.client().await;
    for round in 0..4 {
        let lines: String = (0..20_000)
            .map(|i| format!("views {}\n", (i + round) % 5_000))
            .collect();
        c.send(lines.as_bytes()).await;
        assert_eq!(flush(&mut c).await, (20_000, 0));
    }
    assert_eq!(total_and_keys(&direct, "views").await, (80_000, 5_000));
    let counts = scalar(
        &direct,
        "SELECT count(DISTINCT count)::bigint FROM tallyd.totals WHERE counter = 'views'",
    )
    .await;
    assert_eq!(counts, 1, "every key counted 16 times");
    drop(bouncer);
    h.stop().await;
}

/// Two-phase commit through the pooler: `PREPARE TRANSACTION` ends the transaction, and
/// `COMMIT PREPARED` may run on any server connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn move_shards_through_pgbouncer() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    sql(&pg.connection_string("postgres"))
        .await
        .batch_execute("CREATE DATABASE db1")
        .await
        .unwrap();
    let bouncer = Pgbouncer::start(dir.path(), &pg, "transaction", 2);
    let (url0, url1) = (bouncer.url_for("postgres"), bouncer.url_for("db1"));
    let shards = |urls: &[&str]| {
        let list: Vec<String> = urls.iter().map(|u| u.to_string()).collect();
        net_config(dir.path(), &url0)
            .with(|c| c.database.shards = list)
            .write()
    };
    let config = shards(&[&url0]);
    let socket = dir.path().join("tallyd.sock");
    let daemon = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || spawn_daemon(&config))
            .await
            .unwrap()
    };
    let mut c = LineClient::connect(&socket).await;
    let lines: String = (0..300)
        .map(|k| format!("downloads m{k} {}\n", k + 1))
        .collect();
    c.send(lines.as_bytes()).await;
    assert_eq!(flush(&mut c).await, (300, 0));
    assert!(tokio::task::spawn_blocking(move || daemon.terminate())
        .await
        .unwrap()
        .success());

    let config = shards(&[&url0, &url1]);
    let out = tallyd_cli(&config, &["move-shards"], &[]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "moved 240 logical shards\n"
    );
    let mut sums = Vec::new();
    for db in ["postgres", "db1"] {
        let client = sql(&pg.connection_string(db)).await;
        let all = "SELECT coalesce(sum(count), 0)::bigint FROM tallyd.totals";
        sums.push(scalar(&client, all).await);
    }
    assert_eq!(sums.iter().sum::<i64>(), (1..=300).sum::<i64>());
    assert!(sums.iter().all(|s| *s > 0), "{sums:?}");
    let db1 = sql(&pg.connection_string("db1")).await;
    assert_eq!(
        scalar(&db1, "SELECT count(*) FROM pg_prepared_xacts").await,
        0
    );
    for k in [0, 150, 299] {
        let out = tallyd_cli(&config, &["get", "downloads", &format!("m{k}")], &[]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.starts_with(&format!("downloads m{k} count={} ", k + 1)),
            "{out:?}"
        );
    }
    drop(bouncer);
    common::stop_postgres(pg).await;
}

/// Other sessions through the same PgBouncer running short transactions without pause (as a
/// daemon's flush workers, heartbeat and rollup do), so that server connections change hands.
struct Hogs {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Hogs {
    fn start(url: &str, n: usize) -> Hogs {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..n)
            .map(|_| {
                let db = db(url);
                let stop = stop.clone();
                tokio::spawn(async move {
                    let client = db.connect().await.unwrap();
                    while !stop.load(Ordering::Relaxed) {
                        client
                            .batch_execute("SELECT pg_sleep(0.001)")
                            .await
                            .unwrap();
                    }
                })
            })
            .collect();
        Hogs { stop, tasks }
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.unwrap();
        }
    }
}

/// `tallyd rollup` ends with `rollup::overflowed`, and the daemon's rollup loop reads
/// `tallyd.rollup_rejects`: outside a transaction, a named prepared statement's Parse and Bind
/// may land on different server connections. Both must be unnamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overflowed_query_survives_transaction_pooling() {
    let h = Harness::start(|_| {}).await;
    let bouncer = Pgbouncer::start(h.dir.path(), h.pg.as_ref().unwrap(), "transaction", 2);
    let hogs = Hogs::start(&bouncer.url(), 3);
    let client = sql(&bouncer.url()).await;
    let mut errors = Vec::new();
    for _ in 0..200 {
        if let Err(e) = tallyd::rollup::overflowed(&client, 10).await {
            errors.push(e.to_string());
        }
    }
    hogs.stop().await;
    assert!(
        errors.is_empty(),
        "{} of 200 reads of tallyd.rollup_rejects through PgBouncer failed, e.g. {:?}",
        errors.len(),
        errors.first()
    );
    h.stop().await;
}

/// The same through the CLI: `tallyd rollup` through PgBouncer while other sessions use the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_rollup_survives_transaction_pooling_with_other_sessions() {
    let h = Harness::start(|_| {}).await;
    let bouncer = Pgbouncer::start(h.dir.path(), h.pg.as_ref().unwrap(), "transaction", 2);
    let hogs = Hogs::start(&bouncer.url(), 3);
    let config = net_config(h.dir.path(), &bouncer.url()).write();
    let mut failures = Vec::new();
    for _ in 0..12 {
        let config = config.clone();
        let out = tokio::task::spawn_blocking(move || {
            tallyd_cli(&config, &["rollup", "--until-empty"], &[])
        })
        .await
        .unwrap();
        if !out.status.success() {
            failures.push(String::from_utf8_lossy(&out.stderr).into_owned());
        }
    }
    hogs.stop().await;
    assert!(
        failures.is_empty(),
        "{} of 12 `tallyd rollup` runs through PgBouncer failed, e.g. {:?}",
        failures.len(),
        failures.first()
    );
    h.stop().await;
}
