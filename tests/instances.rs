//! One live tallyd per instance_id: a second daemon with the same id (a copied config) on another
//! data_dir is refused while the first runs; the same data_dir takes its lease back at once after
//! kill -9; a daemon whose lease was taken over while it stalled stops without writing, and its
//! journal is replayed exactly later (the flush ledger is per data_dir).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{
    buf_of, counter_total, counter_total_over, send_synced, spawn_daemon, sql, tallyd, temp_dir,
    Harness, InProcess, LineClient, TestConfig,
};
use tallyd::config::Config;

/// Two databases of one server, as shards: the lease is claimed in each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_daemon_with_the_same_instance_id_is_refused() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfos = common::create_databases(&pg, 2).await;
    let config = |name: &str| {
        let sub = dir.path().join(name);
        std::fs::create_dir_all(&sub).unwrap();
        Harness::config_for(&sub)
            .with(|c| {
                c.daemon.set_instance_id(Some("copied".into()));
                c.database.shards = conninfos.clone();
            })
            .build()
    };
    let (a, b) = (config("a"), config("b"));
    let (socket_a, socket_b) = (
        a.listen.socket().unwrap().to_path_buf(),
        b.listen.socket().unwrap().to_path_buf(),
    );
    let data_dir_a = std::path::absolute(&a.daemon.data_dir).unwrap();
    let daemon_a = InProcess::spawn(a);
    let mut c = LineClient::connect(&socket_a).await;
    c.send(&buf_of((0..1000).map(|k| format!("views {k}"))))
        .await;
    assert_eq!(c.flush().await, (1000, 0));

    // B has the same instance id and its own data_dir: refused, naming A.
    let refused =
        tokio::time::timeout(Duration::from_secs(60), InProcess::spawn(b.clone()).ended())
            .await
            .expect("the second daemon must be refused, not start");
    let err = refused.unwrap_err().to_string();
    for part in [
        "instance_id copied is held by another running tallyd",
        &format!("data_dir {}", data_dir_a.display()),
        &format!("pid {}", std::process::id()),
        "expires in",
        "its own instance_id",
    ] {
        assert!(err.contains(part), "{part:?} missing from: {err}");
    }
    // A goes on undisturbed.
    c.send(&buf_of((0..500).map(|k| format!("views {k}"))))
        .await;
    assert_eq!(c.flush().await, (500, 0));
    drop(c);
    daemon_a.stop().await.unwrap();
    assert_eq!(counter_total_over(&conninfos, "views").await, 1500);

    // A clean stop releases the lease: B may take the id at once.
    let _ = std::fs::remove_file(&socket_b);
    let daemon_b = InProcess::spawn(b);
    let mut c = LineClient::connect(&socket_b).await;
    c.send(&buf_of((0..10).map(|k| format!("views {k}")))).await;
    assert_eq!(c.flush().await, (10, 0));
    drop(c);
    daemon_b.stop().await.unwrap();
    assert_eq!(counter_total_over(&conninfos, "views").await, 1510);
    common::stop_postgres(pg).await;
}

/// A config file for the real binary in `dir`, on the external database `url`, instance
/// `copied`, with the instance lease `lease_ms` long and no timed flush.
fn leased_config(dir: &Path, url: &str, lease_ms: u64) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    TestConfig::new(dir)
        .standard_counters()
        .fast()
        .external(url, "copied")
        .never_flushes()
        .with(|c| {
            c.daemon
                .set_drain_timeout(Config::default().daemon.drain_timeout());
            c.daemon.set_shutdown_timeout(Duration::from_millis(5000));
            c.daemon.set_instance_lease(Duration::from_millis(lease_ms));
            c.flush.set_retry_max(Duration::from_millis(200));
        })
        .write()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_data_dir_takes_its_lease_back_after_kill_9() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let url = pg.connection_string("postgres");
    // A lease far longer than the test: only the owner token can explain a restart.
    let lease = 600_000;
    let a = leased_config(&dir.path().join("a"), &url, lease);
    let socket = dir.path().join("a/tallyd.sock");
    let daemon = spawn_daemon(&a);
    send_synced(&socket, (0..700).map(|k| format!("views {k}"))).await;
    daemon.kill();

    let daemon = spawn_daemon(&a);
    // Another data_dir with the same id is refused while A holds the lease.
    let b = leased_config(&dir.path().join("b"), &url, lease);
    let out = tallyd(&b, &["run"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("instance_id copied is held by another running tallyd")
            && err.contains(&format!("pid {}", daemon.pid())),
        "{err}"
    );
    assert!(daemon.terminate().success());
    assert_eq!(
        counter_total(&sql(&url).await, "views").await,
        700,
        "replayed exactly once"
    );
    common::stop_postgres(pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_taken_over_after_a_stall_stops_without_writing() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let url = pg.connection_string("postgres");
    let lease = 1000;
    let a = leased_config(&dir.path().join("a"), &url, lease);
    let socket_a = dir.path().join("a/tallyd.sock");
    let daemon_a = spawn_daemon(&a);
    send_synced(&socket_a, (0..300).map(|k| format!("views {k}"))).await;

    // A stalls (SIGSTOP) until its lease has expired, and B takes the id over.
    daemon_a.signal(libc::SIGSTOP);
    let watch = sql(&url).await;
    loop {
        let expired: bool = watch
            .query_one(
                "SELECT expires_at < clock_timestamp() FROM tallyd.instances",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if expired {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let b = leased_config(&dir.path().join("b"), &url, lease);
    let socket_b = dir.path().join("b/tallyd.sock");
    let daemon_b = spawn_daemon(&b);
    let mut c = LineClient::connect(&socket_b).await;
    c.send(&buf_of((0..50).map(|k| format!("views {k}")))).await;
    assert_eq!(c.flush().await, (50, 0));
    drop(c);

    // A wakes up, finds its lease taken and stops with an error, writing nothing.
    daemon_a.signal(libc::SIGCONT);
    let status = tokio::task::spawn_blocking(move || daemon_a.wait())
        .await
        .unwrap();
    assert!(!status.success());
    let log = std::fs::read_to_string(a.with_extension("log")).unwrap();
    assert!(
        log.contains("took over this daemon's lease"),
        "A's log: {log}"
    );
    assert_eq!(counter_total(&sql(&url).await, "views").await, 50);

    // Once B stops, A starts again and replays its journal: its own ledger rows, not B's,
    // say what it had committed (nothing), so all 300 arrive, exactly once.
    assert!(daemon_b.terminate().success());
    let daemon_a = spawn_daemon(&a);
    assert!(daemon_a.terminate().success());
    assert_eq!(counter_total(&sql(&url).await, "views").await, 350);
    common::stop_postgres(pg).await;
}
