//! tallyd through Debian's PgBouncer in transaction pooling mode, with fewer server connections
//! than tallyd has sessions, so that consecutive transactions of one session land on different
//! server connections: flushes, the ledger after backends are terminated, rollups (daemon and
//! `tallyd rollup`), `tallyd get`, `tallyd migrate` and `tallyd move-shards`, with exact totals.

mod common;

use std::time::Duration;

use common::netpg::{tallyd_cli, write_config, Pgbouncer};
use common::{Harness, LineClient};
use tallyd::store::Db;

/// A liveness bound, not a timing assertion: through a pooler that breaks tallyd's statements a
/// flush retries forever instead of failing.
const BOUND: Duration = Duration::from_secs(120);

async fn flush(c: &mut LineClient) -> (u64, u64) {
    tokio::time::timeout(BOUND, c.flush())
        .await
        .expect("flush did not commit through PgBouncer")
}

async fn totals(db: &Db, counter: &str) -> (i64, i64) {
    let client = db.connect().await.unwrap();
    let row = client
        .query_one(
            "SELECT coalesce(sum(count), 0)::bigint, count(*) FROM tallyd.totals WHERE counter = $1",
            &[&counter],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

async fn scalar(db: &Db, sql: &str) -> i64 {
    db.connect()
        .await
        .unwrap()
        .query_one(sql, &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_pooling_counts_exactly() {
    let mut h = Harness::start(
        "[flush]\nconnections = 4\n[rollup]\nenabled = true\ninterval_ms = 50\nbatch_rows = 100",
    )
    .await;
    let direct = h.db.clone();
    let bouncer = Pgbouncer::start(h.dir.path(), h.pg.as_ref().unwrap(), "transaction", 2);
    h.stop_daemon().await;
    h.db = Db::new(&bouncer.url(), Duration::from_secs(5)).unwrap();
    // Migrates, checks the shard map and replays the ledger through PgBouncer.
    h.start_daemon().await;

    let mut c = h.client().await;
    let mut lines = String::new();
    for i in 0..4000 {
        lines.push_str(&format!("downloads hot\nviews {}\n", i % 1500));
    }
    c.send(lines.as_bytes()).await;
    assert_eq!(flush(&mut c).await, (8000, 0));
    assert_eq!(totals(&direct, "downloads").await, (4000, 1));
    assert_eq!(totals(&direct, "views").await, (4000, 1500));

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
        c.send(lines.as_bytes()).await;
        let killed = scalar(
            &direct,
            "SELECT count(pg_terminate_backend(pid))::bigint FROM pg_stat_activity \
             WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
        )
        .await;
        assert!(killed >= 0);
        assert_eq!(flush(&mut c).await, (2000, 0));
    }
    assert_eq!(totals(&direct, "downloads").await, (9000, 1));
    assert_eq!(totals(&direct, "views").await.0, 9000);
    h.stop_daemon().await;

    // The command line through the pooler.
    let config = write_config(h.dir.path(), &bouncer.url(), "");
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
    assert_eq!(totals(&direct, "downloads").await, (9000, 1));
    assert_eq!(totals(&direct, "views").await, (9000, 1500));
    let out = tallyd_cli(&config, &["get", "downloads", "hot"], &[]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("downloads hot count=9000"),
        "{out:?}"
    );
    // Nothing went wrong on the way: a named statement that met another session's on a shared
    // server connection ("already exists", "does not exist") would only show as retries.
    let log = std::fs::read_to_string(h.pg.as_ref().unwrap().log_path()).unwrap();
    let bad: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("prepared statement") || l.contains("portal"))
        .collect();
    assert!(bad.is_empty(), "{bad:#?}");
    drop(bouncer);
    h.stop().await;
}
