//! One tallyd over several databases: keys spread by logical shard, each database exact for the
//! keys it owns, rollups per database, and a map that disagrees with the databases is refused.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{buf_of, temp_dir, test_config, LineClient};
use tallyd::bucket;
use tallyd::listener::Listeners;
use tallyd::store::embedded::Embedded;
use tallyd::store::Db;
use tokio_util::sync::CancellationToken;

struct Fleet {
    pgs: Vec<Embedded>,
    conninfos: Vec<String>,
}

async fn start_fleet(dir: &Path, n: usize) -> Fleet {
    let mut fleet = Fleet {
        pgs: Vec::new(),
        conninfos: Vec::new(),
    };
    for i in 0..n {
        let d = dir.join(format!("db{i}"));
        std::fs::create_dir_all(&d).unwrap();
        let pg = common::postgres(&d).await;
        fleet.conninfos.push(pg.connection_string("postgres"));
        fleet.pgs.push(pg);
    }
    fleet
}

fn sharded_config(dir: &Path, conninfos: &[String], extra: &str) -> tallyd::config::Config {
    let shards: Vec<String> = conninfos.iter().map(|c| format!("{c:?}")).collect();
    test_config(
        dir,
        &format!("[database]\nshards = [{}]\n{extra}", shards.join(", ")),
    )
}

fn dbs(conninfos: &[String]) -> Vec<Db> {
    conninfos
        .iter()
        .map(|c| Db::new(c, Duration::from_secs(5)).unwrap())
        .collect()
}

/// Runs the daemon on `config` until the returned token is cancelled.
async fn spawn(
    config: tallyd::config::Config,
    dbs: Vec<Db>,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<Result<(), tallyd::daemon::DaemonError>>,
) {
    let config = Arc::new(config);
    let listeners = Listeners::bind(
        &config.listen.socket,
        &config.listen.datagram_socket,
        config.listen.mode(),
    )
    .unwrap();
    let stop = CancellationToken::new();
    let task = tokio::spawn(tallyd::daemon::run(config, listeners, dbs, stop.clone()));
    (stop, task)
}

async fn per_database(conninfos: &[String], counter: &str) -> Vec<HashMap<String, i64>> {
    let mut out = Vec::new();
    for db in dbs(conninfos) {
        let client = db.connect().await.unwrap();
        let rows = client
            .query(
                "SELECT key, count FROM tallyd.totals WHERE counter = $1",
                &[&counter],
            )
            .await
            .unwrap();
        out.push(rows.iter().map(|r| (r.get(0), r.get(1))).collect());
    }
    out
}

async fn spread_over(n: usize) {
    const KEYS: i64 = 100_000;
    let dir = temp_dir();
    let fleet = start_fleet(dir.path(), n).await;
    let config = sharded_config(dir.path(), &fleet.conninfos, "");
    let layout = config.layout();
    let socket = config.listen.socket.clone();
    let (stop, task) = spawn(config, dbs(&fleet.conninfos)).await;

    let mut c = LineClient::connect(&socket).await;
    c.send(&buf_of(
        (0..KEYS).map(|k| format!("views {k} {}", k % 5 + 1)),
    ))
    .await;
    assert_eq!(c.flush().await, (KEYS as u64, 0));

    let seed = bucket::counter_seed("views");
    let check = |parts: &[HashMap<String, i64>]| {
        for k in 0..KEYS {
            let key = k.to_string();
            let home = layout.database(bucket::key_hash(seed, key.as_bytes()));
            for (i, part) in parts.iter().enumerate() {
                let found = part.get(&key).copied();
                if i == home {
                    assert_eq!(found, Some(k % 5 + 1), "key {key} on its database {i}");
                } else {
                    assert_eq!(found, None, "key {key} (home {home}) also on database {i}");
                }
            }
        }
        let total: i64 = parts.iter().flat_map(|p| p.values()).sum();
        assert_eq!(total, (0..KEYS).map(|k| k % 5 + 1).sum::<i64>());
    };
    let parts = per_database(&fleet.conninfos, "views").await;
    check(&parts);
    let sizes: Vec<usize> = parts.iter().map(HashMap::len).collect();
    for s in &sizes {
        // An even split of 480 logical shards: each database gets about 1/n of the keys.
        let share = *s as f64 / KEYS as f64;
        assert!(
            (share - 1.0 / n as f64).abs() < 0.05,
            "uneven split {sizes:?}"
        );
    }

    // Rollups run per database and keep every total.
    for db in dbs(&fleet.conninfos) {
        let client = db.connect().await.unwrap();
        tallyd::rollup::until_empty(&client, 5000).await.unwrap();
        let left: i64 = client
            .query_one("SELECT count(*) FROM tallyd.slots", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(left, 0);
    }
    check(&per_database(&fleet.conninfos, "views").await);
    println!("{n} databases: {sizes:?} keys");
    drop(c);
    stop.cancel();
    task.await.unwrap().unwrap();

    // The databases recorded their shards: a map that disagrees is refused, naming the shards.
    let fewer = &fleet.conninfos[..n - 1];
    let refused = sharded_config(dir.path(), fewer, "");
    let (_stop, task) = spawn(refused, dbs(fewer)).await;
    let err = task.await.unwrap().unwrap_err().to_string();
    assert!(
        err.contains("differ") && err.contains("database 0"),
        "unexpected error: {err}"
    );
    // So is an explicit map that moves one shard.
    let mut map: Vec<String> = layout.map.iter().map(u16::to_string).collect();
    map[0] = ((layout.map[0] as usize + 1) % n).to_string();
    let moved = sharded_config(
        dir.path(),
        &fleet.conninfos,
        &format!("shard_map = [{}]\n", map.join(", ")),
    );
    let (_stop, task) = spawn(moved, dbs(&fleet.conninfos)).await;
    let err = task.await.unwrap().unwrap_err().to_string();
    assert!(err.contains("differing: 0"), "unexpected error: {err}");
    for pg in fleet.pgs {
        tokio::task::spawn_blocking(move || pg.stop().unwrap())
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_databases() {
    spread_over(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_databases() {
    spread_over(3).await;
}
