//! Two tallyd instances on the same sharded databases, and a shard move by one of them: the
//! other one must never write a shard into a database that no longer owns it. It is fenced (its
//! flush is refused in the flush's own transaction), stops saying why, and its journal is
//! replayed under the new map at its next start: every acknowledged event exactly once, on the
//! database its shard now maps to, and `tallyd get` finds it.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{buf_of, send_synced, spawn_daemon, tallyd, temp_dir, TestConfig};
use tallyd::routing::{self, Layout};
use tallyd::store::Db;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

async fn sql(conninfo: &str) -> tokio_postgres::Client {
    Db::new(conninfo, Duration::from_secs(5))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// A daemon's config on `databases`, in `dir/config-<n>.toml` (`n` databases). `slot_offset`
/// keeps the two instances' slots apart; `interval` is the flush timer.
fn config(
    dir: &Path,
    id: &str,
    slot_offset: u64,
    interval: Duration,
    databases: &[String],
    move_shards: bool,
) -> (PathBuf, Layout) {
    std::fs::create_dir_all(dir).unwrap();
    let test = TestConfig::new(dir).standard_counters().fast().with(|c| {
        c.daemon.set_instance_id(Some(id.into()));
        c.flush.set_slot_offset(Some(slot_offset));
        c.flush.set_interval(interval);
        c.listen.set_datagram_socket(None);
        c.database.shards = databases.to_vec();
        c.database.move_shards = move_shards;
    });
    let layout = test.clone().build().layout();
    let path = test.write_as(&format!("config-{}.toml", databases.len()));
    (path, layout)
}

/// Every database's `downloads` totals, with the logical shards it records as its own.
async fn per_database(conninfos: &[String]) -> Vec<(HashSet<i32>, usize, HashMap<String, i64>)> {
    let mut out = Vec::new();
    for c in conninfos {
        let client = sql(c).await;
        let shards = client
            .query("SELECT shard, logical_shards FROM tallyd.shards", &[])
            .await
            .unwrap();
        let logical = shards.first().map_or(0, |r| r.get::<_, i32>(1) as usize);
        let owned = shards.iter().map(|r| r.get(0)).collect();
        let rows = client
            .query(
                "SELECT key, count FROM tallyd.totals WHERE counter = 'downloads'",
                &[],
            )
            .await
            .unwrap();
        out.push((
            owned,
            logical,
            rows.iter().map(|r| (r.get(0), r.get(1))).collect(),
        ));
    }
    out
}

/// Keys shown by a database that does not record their logical shard as its own.
async fn misplaced(conninfos: &[String]) -> usize {
    let seed = routing::counter_seed("downloads");
    let mut n = 0;
    for (owned, logical, keys) in per_database(conninfos).await {
        for key in keys.keys() {
            let shard = routing::logical_shard(routing::key_hash(seed, key.as_bytes()), logical);
            n += usize::from(!owned.contains(&(shard as i32)));
        }
    }
    n
}

fn home(layout: &Layout, key: &str) -> usize {
    layout.database(routing::key_hash(
        routing::counter_seed("downloads"),
        key.as_bytes(),
    ))
}

/// What a load client sent: keys counted once (each batch names new keys, once each), and the
/// keys of batches whose answer never came (the daemon stopped meanwhile), which count at most
/// once.
#[derive(Default)]
struct Sent {
    counted: HashSet<String>,
    unsure: HashSet<String>,
}

/// X's client `id`: batches of 300 new keys, each counted once `!flush` confirms it; while no
/// daemon listens it retries.
fn x_client(id: u64, socket: PathBuf, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Sent> {
    tokio::spawn(async move {
        let mut sent = Sent::default();
        let mut round = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let Ok(stream) = tokio::net::UnixStream::connect(&socket).await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let keys: Vec<String> = (0..300).map(|i| format!("x{id}-{round}-{i}")).collect();
            round += 1;
            let (rd, mut wr) = stream.into_split();
            let mut body = buf_of(keys.iter().map(|k| format!("downloads {k}")));
            body.extend_from_slice(b"!flush\n");
            let mut reply = String::new();
            let written = wr.write_all(&body).await.is_ok();
            if written
                && BufReader::new(rd).read_line(&mut reply).await.is_ok()
                && reply == "ok 300 0\n"
            {
                sent.counted.extend(keys);
            } else {
                sent.unsure.extend(keys);
            }
        }
        sent
    })
}

/// Y's client: rounds of 100 new keys, each acknowledged by `!sync` (durable in Y's journal,
/// not flushed: Y's timer is far away), until `stop` or until Y goes away. Returns the rounds
/// acknowledged and the one in flight when Y went away, if any.
fn y_client(socket: PathBuf, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<(u64, Option<u64>)> {
    tokio::spawn(async move {
        let Ok(stream) = tokio::net::UnixStream::connect(&socket).await else {
            return (0, None);
        };
        let (rd, mut wr) = stream.into_split();
        let mut rd = BufReader::new(rd);
        let mut round = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let mut body = buf_of((0..100).map(|i| format!("downloads yl{round}-{i}")));
            body.extend_from_slice(b"!sync\n");
            let mut reply = String::new();
            if wr.write_all(&body).await.is_err()
                || rd.read_line(&mut reply).await.is_err()
                || reply != "ok\n"
            {
                return (round, Some(round));
            }
            round += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        (round, None)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_fences_the_other_instance_and_its_journal_replays_under_the_new_map() {
    const PENDING: u64 = 5000;
    let dir = temp_dir();
    // Three databases of one server; the instances start on the first two.
    let pg = common::postgres(dir.path()).await;
    let urls = common::create_databases(&pg, 3).await;
    let (x_dir, y_dir) = (dir.path().join("x"), dir.path().join("y"));
    let far = Duration::from_secs(600);
    let (x2, _) = config(
        &x_dir,
        "x",
        0,
        Duration::from_millis(200),
        &urls[..2],
        false,
    );
    let (x3, layout3) = config(&x_dir, "x", 0, Duration::from_millis(200), &urls, true);
    let (y2, layout2) = config(&y_dir, "y", 10, far, &urls[..2], false);
    let (y3, _) = config(&y_dir, "y", 10, far, &urls, false);

    let x = spawn_daemon(&x2);
    let y = spawn_daemon(&y2);
    let (x_socket, y_socket) = (x.socket().to_path_buf(), y.socket().to_path_buf());
    // Y holds PENDING keys, durable in its journal and not yet flushed.
    let mut pending = send_synced(&y_socket, (0..PENDING).map(|k| format!("downloads y{k}"))).await;
    let stop = Arc::new(AtomicBool::new(false));
    let xs: Vec<_> = (0..2)
        .map(|id| x_client(id, x_socket.clone(), stop.clone()))
        .collect();
    let y_load = y_client(y_socket.clone(), stop.clone());
    tokio::time::sleep(Duration::from_millis(1000)).await;

    // X restarts with the third database and moves shards while both instances take load.
    assert!(x.terminate().success());
    let x = spawn_daemon(&x3);
    assert!(x.log().contains("logical shards moved"), "{}", x.log());
    tokio::time::sleep(Duration::from_millis(1000)).await;

    // Y flushes by its old map.
    pending.send(b"!flush\n").await;
    let reply = tokio::time::timeout(Duration::from_secs(60), pending.read_line())
        .await
        .expect("Y answers or closes the connection");
    let wrong = misplaced(&urls).await;
    println!("Y's !flush after the move: {reply:?}; keys on a database that does not own their shard: {wrong}");
    assert_eq!(
        wrong, 0,
        "Y wrote keys to databases that no longer own them"
    );
    // It says why before it closes the connection (before: it closed it without a line).
    assert!(
        reply.starts_with("error fenced "),
        "Y must not confirm a flush it could not write, and must say why: {reply:?}"
    );

    // Y stopped by itself, and said why.
    let status = tokio::task::spawn_blocking(move || y.wait()).await.unwrap();
    assert!(!status.success(), "Y exits with an error");
    let (acked, in_flight) = y_load.await.unwrap();
    let log = std::fs::read_to_string(y2.with_extension("log")).unwrap();
    let said = log
        .lines()
        .find(|l| l.starts_with("tallyd: "))
        .unwrap_or_default();
    println!("Y stopped with: {said}");
    for part in [
        ": the shard map of this database changed while this tallyd ran",
        "another tallyd moved logical shards",
        "start this tallyd again with the new [database] shards and shard_map",
        "replayed, under the new map, at its next start",
    ] {
        assert!(log.contains(part), "{part:?} missing from Y's log: {log}");
    }
    println!("Y took {acked} more rounds of 100 keys during the move");

    // Y starts with the new map: its journal replays under it.
    let y = spawn_daemon(&y3);
    assert!(y.terminate().success());
    stop.store(true, Ordering::Relaxed);
    let mut x_sent = Sent::default();
    for c in xs {
        let sent = c.await.unwrap();
        x_sent.counted.extend(sent.counted);
        x_sent.unsure.extend(sent.unsure);
    }
    assert!(x.terminate().success());
    println!(
        "X: {} keys confirmed by !flush, {} unanswered",
        x_sent.counted.len(),
        x_sent.unsure.len()
    );

    // Exact on every database, each key on the database its shard now maps to.
    let mut expected: HashMap<String, i64> =
        x_sent.counted.iter().map(|k| (k.clone(), 1)).collect();
    expected.extend((0..PENDING).map(|k| (format!("y{k}"), 1)));
    expected.extend((0..acked).flat_map(|r| (0..100).map(move |i| (format!("yl{r}-{i}"), 1))));
    let mut unsure: HashSet<String> = in_flight
        .into_iter()
        .flat_map(|r| (0..100).map(move |i| format!("yl{r}-{i}")))
        .collect();
    unsure.extend(x_sent.unsure);
    assert_eq!(misplaced(&urls).await, 0);
    let parts = per_database(&urls).await;
    for (db, (_, _, keys)) in parts.iter().enumerate() {
        let mut certain = keys.clone();
        certain.retain(|k, n| {
            if unsure.contains(k) {
                assert_eq!(
                    *n, 1,
                    "{k}: an event of the round in flight counts at most once"
                );
                false
            } else {
                true
            }
        });
        let want: HashMap<String, i64> = expected
            .iter()
            .filter(|(k, _)| home(&layout3, k) == db)
            .map(|(k, n)| (k.clone(), *n))
            .collect();
        assert_eq!(certain.len(), want.len(), "database {db}: keys");
        assert_eq!(certain, want, "database {db}: totals");
    }
    let moved = (0..PENDING)
        .map(|k| format!("y{k}"))
        .filter(|k| home(&layout2, k) != home(&layout3, k))
        .count();
    println!("{moved} of Y's {PENDING} pending keys are in shards that moved");
    assert!(moved > PENDING as usize / 3, "the move concerns Y's keys");

    // Through `tallyd get`, routed by the new map.
    let sample = (0..PENDING)
        .map(|k| format!("y{k}"))
        .filter(|k| home(&layout2, k) != home(&layout3, k))
        .take(8)
        .chain(x_sent.counted.iter().take(4).cloned());
    for key in sample {
        let out = tallyd(&x3, &["get", "downloads", &key]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.starts_with(&format!("downloads {key} count={} ", expected[&key])),
            "tallyd get {key}: {text}"
        );
    }
    common::stop_postgres(pg).await;
}
