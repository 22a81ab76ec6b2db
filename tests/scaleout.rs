//! Several tallyd instances on one database: each writes its own slots, so their flushes never
//! wait on each other's row locks, and the rollups of all of them keep totals exact.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{
    buf_of, key_total, spawn_daemon, sql, start_postgres_with, temp_dir, LineClient, TestConfig,
};
use tallyd::config::KeyTypeName;

fn instance_config(dir: &Path, conninfo: &str, n: usize) -> (PathBuf, PathBuf) {
    let home = dir.join(format!("instance{n}"));
    std::fs::create_dir_all(&home).unwrap();
    let config = TestConfig::new(&home)
        .counters(&[("downloads", KeyTypeName::Text)])
        .database_url(conninfo)
        .with(|c| {
            c.daemon.set_instance_id(Some(format!("instance-{n}")));
            c.listen.set_datagram_socket(None);
            c.flush.set_interval(Duration::from_millis(20));
            c.flush.connections = 2;
            // Instance n writes slots 10n and 10n + 1: disjoint by construction.
            c.flush.set_slot_offset(Some((n * 10) as u64));
            c.rollup.set_interval(Duration::from_millis(100));
            c.rollup.batch_rows = 200;
        })
        .write();
    (config, home.join("tallyd.sock"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_one_database_exact_and_without_lock_waits() {
    instances_on_one_database(3).await;
}

/// The same load through one instance: the baseline the three-instance run is compared with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_one_database_same_load() {
    instances_on_one_database(1).await;
}

/// `instances` daemons, two clients each, all on one hot key and 200 shared keys for 5 s.
async fn instances_on_one_database(instances: usize) {
    let dir = temp_dir();
    let pg_dir = dir.path().to_path_buf();
    // Any lock wait on a row longer than 10 ms is logged by PostgreSQL itself.
    let pg = tokio::task::spawn_blocking(move || {
        start_postgres_with(
            &pg_dir,
            &[("log_lock_waits", "on"), ("deadlock_timeout", "10ms")],
        )
    })
    .await
    .unwrap();
    let conninfo = pg.connection_string("postgres");
    let mut daemons = Vec::new();
    let mut sockets = Vec::new();
    for n in 0..instances {
        let (config, socket) = instance_config(dir.path(), &conninfo, n);
        daemons.push(spawn_daemon(&config));
        sockets.push(socket);
    }
    let run_for = Duration::from_secs(5);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (n, socket) in sockets.iter().enumerate() {
        for c in 0..2 {
            let socket = socket.clone();
            tasks.push(tokio::spawn(async move {
                let mut client = LineClient::connect(&socket).await;
                // One hot key everyone hammers, and a shared set of 200 keys.
                let lines = buf_of(
                    std::iter::repeat_n("downloads hot".to_string(), 500)
                        .chain((0..200).map(|k| format!("downloads shared{k} {}", n + c + 1))),
                );
                let mut rounds = 0i64;
                while started.elapsed() < run_for {
                    client.send(&lines).await;
                    assert_eq!(client.flush().await, (700, 0));
                    rounds += 1;
                }
                (rounds, (n + c + 1) as i64)
            }));
        }
    }
    let (mut hot, mut shared_each) = (0i64, 0i64);
    for t in tasks {
        let (rounds, delta) = t.await.unwrap();
        hot += rounds * 500;
        shared_each += rounds * delta;
    }
    let elapsed = started.elapsed();
    for d in daemons {
        assert!(d.terminate().success());
    }
    let client = sql(&conninfo).await;
    assert_eq!(key_total(&client, "downloads", "hot").await, hot);
    for k in 0..200 {
        let key = format!("shared{k}");
        assert_eq!(
            key_total(&client, "downloads", &key).await,
            shared_each,
            "{key}"
        );
    }
    let slots: Vec<i32> = client
        .query("SELECT DISTINCT slot FROM tallyd.slots ORDER BY 1", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        slots.iter().all(|s| [0, 1, 10, 11, 20, 21].contains(s)),
        "{slots:?}"
    );
    // The check below can only fail if PostgreSQL is really logging lock waits.
    let logging: String = client
        .query_one("SHOW log_lock_waits", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(logging, "on");
    let log = std::fs::read_to_string(dir.path().join("pg/postgres.log")).unwrap();
    let waits: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("still waiting for") && l.contains("slots"))
        .collect();
    assert!(
        waits.is_empty(),
        "flushes waited on row locks:\n{}",
        waits.join("\n")
    );
    println!(
        "{instances} instance(s): {} events in {:.1}s = {:.0} events/s committed, no lock waits",
        hot + 200 * shared_each,
        elapsed.as_secs_f64(),
        (hot + 200 * shared_each) as f64 / elapsed.as_secs_f64()
    );
    common::stop_postgres(pg).await;
}
