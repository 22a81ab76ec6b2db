//! One tallyd over several databases: keys spread by logical shard, each database exact for the
//! keys it owns, rollups per database, and a map that disagrees with the databases is refused.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{
    buf_of, counts_per_database, db, scalar, sql, temp_dir, Harness, InProcess, LineClient,
};
use tallyd::routing;
use tallyd::store::embedded::Embedded;

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

/// `n` databases in ONE PostgreSQL server (a common layout: many logical shards per server).
async fn start_shared(dir: &Path, n: usize) -> Fleet {
    let pg = common::postgres(dir).await;
    let conninfos = common::create_databases(&pg, n).await;
    Fleet {
        pgs: vec![pg],
        conninfos,
    }
}

/// The harness config on the databases `conninfos`; `move_shards` as given.
fn sharded_config(dir: &Path, conninfos: &[String], move_shards: bool) -> tallyd::config::Config {
    Harness::config_for(dir)
        .with(|c| {
            c.database.shards = conninfos.to_vec();
            c.database.move_shards = move_shards;
        })
        .build()
}

/// Every (key, count) of `counter`, one map per database.
async fn per_database(conninfos: &[String], counter: &str) -> Vec<HashMap<String, i64>> {
    let parts = counts_per_database(conninfos, counter).await;
    parts.into_iter().map(|p| p.into_iter().collect()).collect()
}

async fn spread_over(n: usize) {
    const KEYS: i64 = 100_000;
    let dir = temp_dir();
    let fleet = start_fleet(dir.path(), n).await;
    let config = sharded_config(dir.path(), &fleet.conninfos, false);
    let layout = config.layout();
    let socket = config.listen.socket().unwrap().to_path_buf();
    let daemon = InProcess::spawn(config);

    let mut c = LineClient::connect(&socket).await;
    let lines = buf_of((0..KEYS).map(|k| format!("views {k} {}", k % 5 + 1)));
    let started = std::time::Instant::now();
    c.send(&lines).await;
    assert_eq!(c.flush().await, (KEYS as u64, 0));
    let elapsed = started.elapsed();

    let seed = routing::counter_seed("views");
    let check = |parts: &[HashMap<String, i64>]| {
        for k in 0..KEYS {
            let key = k.to_string();
            let home = layout.database(routing::key_hash(seed, key.as_bytes()));
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
    for conninfo in &fleet.conninfos {
        let client = sql(conninfo).await;
        tallyd::rollup::until_empty(&client, 5000).await.unwrap();
        assert_eq!(
            scalar(&client, "SELECT count(*) FROM tallyd.slots").await,
            0
        );
    }
    check(&per_database(&fleet.conninfos, "views").await);
    println!(
        "{n} database(s): {sizes:?} keys; {KEYS} distinct keys committed in {:.2}s = {:.0} events/s",
        elapsed.as_secs_f64(),
        KEYS as f64 / elapsed.as_secs_f64()
    );
    drop(c);
    daemon.stop().await.unwrap();

    if n == 1 {
        for pg in fleet.pgs {
            common::stop_postgres(pg).await;
        }
        return;
    }
    // The databases recorded their shards: a map that disagrees is refused, naming the shards.
    let fewer = &fleet.conninfos[..n - 1];
    let refused = sharded_config(dir.path(), fewer, false);
    let err = InProcess::spawn(refused)
        .ended()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("differ") && err.contains("database 0"),
        "unexpected error: {err}"
    );
    // So is an explicit map that moves one shard.
    let mut map: Vec<u32> = layout.map.iter().map(|&d| u32::from(d)).collect();
    map[0] = (map[0] + 1) % n as u32;
    let mut moved = sharded_config(dir.path(), &fleet.conninfos, false);
    moved.database.shard_map = map;
    moved.validate().unwrap();
    let err = InProcess::spawn(moved)
        .ended()
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("differing: 0"), "unexpected error: {err}");
    for pg in fleet.pgs {
        common::stop_postgres(pg).await;
    }
}

/// The same load on one database through the sharded path: the baseline for the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_database() {
    spread_over(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_databases() {
    spread_over(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_databases() {
    spread_over(3).await;
}

/// Sums of `views` per key over every database, and which database holds each key.
async fn fleet_totals(conninfos: &[String]) -> (HashMap<String, i64>, HashMap<String, usize>) {
    let mut totals = HashMap::new();
    let mut home = HashMap::new();
    for (i, part) in per_database(conninfos, "views")
        .await
        .into_iter()
        .enumerate()
    {
        for (key, n) in part {
            *totals.entry(key.clone()).or_insert(0) += n;
            assert!(
                home.insert(key.clone(), i).is_none(),
                "key {key} in two databases"
            );
        }
    }
    (totals, home)
}

fn assert_placed(layout: &tallyd::routing::Layout, home: &HashMap<String, usize>) {
    let seed = routing::counter_seed("views");
    for (key, &db) in home {
        assert_eq!(
            db,
            layout.database(routing::key_hash(seed, key.as_bytes())),
            "key {key} is not on the database its shard maps to"
        );
    }
}

/// Clients that connect for each batch and count it only once `!flush` confirmed it; while no
/// daemon listens they retry. Each batch adds 1 to every key it names.
fn batch_clients(
    socket: std::path::PathBuf,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<HashMap<String, i64>> {
    tokio::spawn(async move {
        let mut confirmed: HashMap<String, i64> = HashMap::new();
        let mut round = 0u64;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let Ok(stream) = tokio::net::UnixStream::connect(&socket).await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let keys: Vec<String> = (0..500)
                .map(|i| ((round * 500 + i) % 3000).to_string())
                .collect();
            let (rd, mut wr) = stream.into_split();
            use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
            let mut body = buf_of(keys.iter().map(|k| format!("views {k}")));
            body.extend_from_slice(b"!flush\n");
            if wr.write_all(&body).await.is_err() {
                // Refused before anything was read: the whole batch never arrived.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
            let mut reply = String::new();
            tokio::io::BufReader::new(rd)
                .read_line(&mut reply)
                .await
                .expect("a connection that was read is answered");
            assert_eq!(reply, "ok 500 0\n");
            for k in keys {
                *confirmed.entry(k).or_insert(0) += 1;
            }
            round += 1;
        }
        confirmed
    })
}

/// Raises its flag when dropped.
struct StopOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adding_a_database_under_load_moves_shards_exactly() {
    let dir = temp_dir();
    let fleet3 = start_fleet(dir.path(), 3).await;
    let two = &fleet3.conninfos[..2];
    let config = sharded_config(dir.path(), two, false);
    let socket = config.listen.socket().unwrap().to_path_buf();
    let daemon_a = InProcess::spawn(config);

    let stop_clients = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Raised however the test ends: after a panic, the clients and the reader stop too, and the
    // test fails instead of waiting for them forever.
    let _stop_on_drop = StopOnDrop(stop_clients.clone());
    let clients: Vec<_> = (0..3)
        .map(|_| batch_clients(socket.clone(), stop_clients.clone()))
        .collect();
    // During everything, including the move: each database, read in one snapshot, holds rows
    // only for the logical shards it records as its own (a half-moved shard is never visible).
    let reader = {
        let (stop, conninfos) = (stop_clients.clone(), fleet3.conninfos.clone());
        tokio::spawn(async move {
            let seed = routing::counter_seed("views");
            let mut reads = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for (i, conninfo) in conninfos.iter().enumerate() {
                    // Each failed attempt waits: a loop that never waits would keep the runtime
                    // from shutting down after a panic (the test would hang, not fail).
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let Ok(mut client) = db(conninfo).connect().await else {
                        continue;
                    };
                    let Ok(tx) = client
                        .build_transaction()
                        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                        .start()
                        .await
                    else {
                        continue;
                    };
                    let (Ok(owned), Ok(keys)) = (
                        tx.query("SELECT shard, logical_shards FROM tallyd.shards", &[])
                            .await,
                        tx.query("SELECT key FROM tallyd.totals WHERE counter = 'views'", &[])
                            .await,
                    ) else {
                        continue;
                    };
                    let Some(logical) = owned.first().map(|r| r.get::<_, i32>(1) as usize) else {
                        continue;
                    };
                    let owned: std::collections::HashSet<i32> =
                        owned.iter().map(|r| r.get(0)).collect();
                    for row in keys {
                        let key: String = row.get(0);
                        let shard = routing::logical_shard(
                            routing::key_hash(seed, key.as_bytes()),
                            logical,
                        );
                        assert!(
                            owned.contains(&(shard as i32)),
                            "database {i} shows key {key} of shard {shard}, which it does not own"
                        );
                    }
                    reads += 1;
                }
            }
            reads
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // Add the third database: stop, and start again with it and move_shards on. The clients
    // keep going; while no daemon listens they wait and retry.
    daemon_a
        .stop()
        .await
        .expect("the first daemon stops cleanly");
    let before = fleet_totals(two).await.0.values().sum::<i64>();
    let grown = sharded_config(dir.path(), &fleet3.conninfos, true);
    let layout = grown.layout();
    let daemon_b = InProcess::spawn(grown);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop_clients.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut confirmed: HashMap<String, i64> = HashMap::new();
    for c in clients {
        for (k, n) in c.await.unwrap() {
            *confirmed.entry(k).or_insert(0) += n;
        }
    }
    assert!(reader.await.unwrap() > 5, "the reader ran throughout");
    daemon_b
        .stop()
        .await
        .expect("the daemon that moved the shards stops cleanly");

    let (totals, home) = fleet_totals(&fleet3.conninfos).await;
    assert_eq!(totals, confirmed, "every confirmed event exactly once");
    assert!(
        before > 0 && totals.values().sum::<i64>() > before,
        "load before and after the move"
    );
    assert_placed(&layout, &home);
    // A third of the logical shards moved: the new database holds about a third of the keys,
    // however many the clients managed to send (a loaded machine sends fewer); a quarter is
    // more than 4 standard deviations below a third even at one round of 500 keys.
    let on_new: usize = home.values().filter(|&&d| d == 2).count();
    assert!(
        home.len() >= 500 && on_new * 4 > home.len(),
        "the new database took its share ({on_new} of {} keys)",
        home.len()
    );
    // The records now agree with the three-database map: a plain start accepts it.
    let plain = sharded_config(dir.path(), &fleet3.conninfos, false);
    InProcess::spawn(plain).stop().await.unwrap();
    for pg in fleet3.pgs {
        common::stop_postgres(pg).await;
    }
}

/// Where a crash left one group of a move.
#[derive(Clone, Copy, Debug)]
enum Interrupted {
    /// Both sides prepared, nothing committed (killed after step 3).
    BothPrepared,
    /// The source's delete committed, the target's copy still prepared (killed inside step 4).
    SourceCommitted,
    /// Only the target's copy prepared (killed inside step 3).
    CopyPrepared,
    /// The target's copy committed and the source's delete prepared (an order tallyd never
    /// uses, but a hand or another tool might).
    TargetCommitted,
    /// The target's copy committed, the source's delete gone: what older versions left on
    /// databases of one server (the source's PREPARE failed), which they refused with "fix by
    /// hand". Both databases record the shards and hold the same totals for their keys.
    CopyCommittedAlone,
}

/// Moves 2 -> 3 databases, leaves each of the two groups (0 -> 2, 1 -> 2) as `states` says, and
/// checks that the next start settles both and finishes the move with exact totals.
async fn interrupted_move(shared_server: bool, states: [Interrupted; 2]) {
    let dir = temp_dir();
    let fleet3 = if shared_server {
        start_shared(dir.path(), 3).await
    } else {
        start_fleet(dir.path(), 3).await
    };
    let two = &fleet3.conninfos[..2];
    let config = sharded_config(dir.path(), two, false);
    let socket = config.listen.socket().unwrap().to_path_buf();
    let daemon = InProcess::spawn(config);
    let mut c = LineClient::connect(&socket).await;
    c.send(&buf_of(
        (0..20_000).map(|k| format!("views {k} {}", k % 3 + 1)),
    ))
    .await;
    c.flush().await;
    drop(c);
    daemon.stop().await.unwrap();
    let expected: HashMap<String, i64> = (0..20_000).map(|k| (k.to_string(), k % 3 + 1)).collect();

    let grown = sharded_config(dir.path(), &fleet3.conninfos, true);
    let layout = grown.layout();
    // The schema on every database (as the daemon's start does), then the move's first half.
    let mut clients = Vec::new();
    for conninfo in &fleet3.conninfos {
        let mut client = sql(conninfo).await;
        tallyd::store::prepare(&mut client, &grown).await.unwrap();
        clients.push(client);
    }
    let moves = tallyd::store::moves::plan(&clients, &layout).await.unwrap();
    let mut groups: std::collections::BTreeMap<(usize, usize), Vec<i32>> = Default::default();
    for m in &moves {
        groups.entry((m.from, m.to)).or_default().push(m.shard);
    }
    let groups: Vec<_> = groups.into_iter().collect();
    assert_eq!(
        groups.len(),
        2,
        "shards move from both old databases to the new one"
    );
    for (i, (((from, to), shards), state)) in groups.iter().zip(states).enumerate() {
        let gids = tallyd::store::moves::prepare_group(&clients, &layout, *from, *to, shards)
            .await
            .unwrap();
        if i == 0 {
            // Prepared transactions change nothing yet.
            assert_eq!(fleet_totals(&fleet3.conninfos).await.0, expected);
        }
        let (commit, rollback) = match state {
            Interrupted::BothPrepared => (None, None),
            Interrupted::SourceCommitted => (Some((*from, &gids.delete)), None),
            Interrupted::CopyPrepared => (None, Some((*from, &gids.delete))),
            Interrupted::TargetCommitted => (Some((*to, &gids.copy)), None),
            Interrupted::CopyCommittedAlone => {
                (Some((*to, &gids.copy)), Some((*from, &gids.delete)))
            }
        };
        if let Some((db, gid)) = commit {
            clients[db]
                .batch_execute(&format!("COMMIT PREPARED '{gid}'"))
                .await
                .unwrap();
        }
        if let Some((db, gid)) = rollback {
            clients[db]
                .batch_execute(&format!("ROLLBACK PREPARED '{gid}'"))
                .await
                .unwrap();
        }
    }
    drop(clients);

    // The next start settles both and finishes the move.
    InProcess::spawn(grown).stop().await.unwrap();
    let (totals, home) = fleet_totals(&fleet3.conninfos).await;
    assert_eq!(totals, expected);
    assert_placed(&layout, &home);
    let client = sql(&fleet3.conninfos[0]).await;
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM pg_prepared_xacts").await,
        0,
        "no prepared transaction is left behind"
    );
    for pg in fleet3.pgs {
        common::stop_postgres(pg).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_interrupted_midway_is_resumed_exactly() {
    use Interrupted::*;
    interrupted_move(false, [BothPrepared, SourceCommitted]).await;
}

/// Three databases of one server: prepared-transaction ids are global to a server, so the two
/// sides of a move need ids of their own (before, the source's PREPARE failed with "transaction
/// identifier ... is already in use" and the next run found the shard in both databases).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_between_databases_of_one_server_is_resumed_exactly() {
    use Interrupted::*;
    interrupted_move(true, [BothPrepared, SourceCommitted]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_interrupted_at_either_side_alone_is_settled() {
    use Interrupted::*;
    interrupted_move(true, [CopyPrepared, TargetCommitted]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_an_older_version_left_half_done_is_finished() {
    use Interrupted::*;
    interrupted_move(true, [CopyCommittedAlone, BothPrepared]).await;
}

/// A database that cannot prepare transactions is named before anything changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_without_prepared_transactions_is_named() {
    let dir = temp_dir();
    let mut fleet = start_fleet(dir.path(), 2).await;
    let options = tallyd::store::embedded::EmbeddedOptions {
        dir: dir.path().join("db2"),
        settings: vec![
            ("fsync".into(), "off".into()),
            ("max_prepared_transactions".into(), "0".into()),
        ],
        bin_dir: None,
    };
    let pg = tokio::task::spawn_blocking(move || Embedded::start(&options).unwrap())
        .await
        .unwrap();
    fleet.conninfos.push(pg.connection_string("postgres"));
    fleet.pgs.push(pg);
    let two = &fleet.conninfos[..2];
    let config = sharded_config(dir.path(), two, false);
    let socket = config.listen.socket().unwrap().to_path_buf();
    let daemon = InProcess::spawn(config);
    let mut c = LineClient::connect(&socket).await;
    c.send(&buf_of((0..1000).map(|k| format!("views {k}"))))
        .await;
    assert_eq!(c.flush().await, (1000, 0));
    drop(c);
    daemon.stop().await.unwrap();
    let before = fleet_totals(two).await.0;

    let grown = sharded_config(dir.path(), &fleet.conninfos, true);
    let err = InProcess::spawn(grown)
        .ended()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("database 2 has max_prepared_transactions = 0"),
        "unexpected error: {err}"
    );
    assert_eq!(fleet_totals(two).await.0, before, "nothing moved");
    assert_eq!(before.values().sum::<i64>(), 1000);
    for pg in fleet.pgs {
        common::stop_postgres(pg).await;
    }
}

/// Moving shards carries every window of a key: a windowed counter (days and the all-time row)
/// over two databases, then a third added with `move_shards`: each (key, day) and each all-time
/// total is exact over the three databases, and each key's rows are all on the database its
/// shard maps to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_move_carries_every_window() {
    let dir = temp_dir();
    let fleet = start_shared(dir.path(), 3).await;
    let with_daily = |conninfos: &[String], move_shards: bool| {
        let mut c = sharded_config(dir.path(), conninfos, move_shards);
        c.counters
            .push(common::windowed_counter("daily", "day", "UTC", &["all"]));
        c
    };
    let two = with_daily(&fleet.conninfos[..2], false);
    let socket = two.listen.socket().unwrap().to_path_buf();
    let daemon = InProcess::spawn(two);
    let mut c = LineClient::connect(&socket).await;
    // 300 keys on 3 days: key k gets k % 5 + 1 on each day.
    let day = 86_400_000i64;
    let base = 1_795_564_800_000i64; // 2026-11-25T00:00:00Z
    let lines = buf_of((0..300i64).flat_map(|k| {
        (0..3).map(move |d| format!("daily k{k} {} @{}", k % 5 + 1, base + d * day + k))
    }));
    c.send(&lines).await;
    assert_eq!(c.flush().await, (900, 0));
    drop(c);
    daemon.stop().await.unwrap();

    let three = with_daily(&fleet.conninfos, true);
    let layout = three.layout();
    InProcess::spawn(three).stop().await.unwrap();

    let seed = routing::counter_seed("daily");
    let mut days: HashMap<(String, i64), i64> = HashMap::new();
    let mut all: HashMap<String, i64> = HashMap::new();
    for (i, conninfo) in fleet.conninfos.iter().enumerate() {
        let client = sql(conninfo).await;
        for row in client
            .query(
                "SELECT key, span, coalesce(extract(epoch FROM window_start)::bigint, 0), count \
                 FROM tallyd.window_totals WHERE counter = 'daily' \
                 UNION ALL SELECT key, 'all', 0, count FROM tallyd.totals WHERE counter = 'daily'",
                &[],
            )
            .await
            .unwrap()
        {
            let (key, span, start, n): (String, String, i64, i64) =
                (row.get(0), row.get(1), row.get(2), row.get(3));
            assert_eq!(
                layout.database(routing::key_hash(seed, key.as_bytes())),
                i,
                "key {key} ({span}) is not on the database its shard maps to"
            );
            if span == "all" {
                assert!(all.insert(key, n).is_none());
            } else {
                assert!(days.insert((key, start), n).is_none());
            }
        }
    }
    assert_eq!(days.len(), 900);
    assert_eq!(all.len(), 300);
    for k in 0..300i64 {
        let key = format!("k{k}");
        for d in 0..3 {
            assert_eq!(days[&(key.clone(), (base + d * day) / 1000)], k % 5 + 1);
        }
        assert_eq!(all[&key], 3 * (k % 5 + 1));
    }
    let on_new = all
        .keys()
        .filter(|k| layout.database(routing::key_hash(seed, k.as_bytes())) == 2);
    assert!(on_new.count() > 50, "the new database took its share");
    for pg in fleet.pgs {
        common::stop_postgres(pg).await;
    }
}
