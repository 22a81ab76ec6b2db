//! tallyd on a real Citus cluster: a coordinator and two workers started here on loopback,
//! set up by `tallyd migrate`, driven through the real binary (daemon, `tallyd rollup`,
//! `tallyd get`). Skipped, with a printed reason, where the citus extension is not installed
//! (build Citus v13.0.5 from its source against PostgreSQL 15 and install it to run them).
//! The cluster runs with Citus's default TLS: tallyd connects with its default sslmode.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{
    buf_of, counter_rolled_into, counts, free_port, scalar, spawn_daemon, start_postgres_with,
    temp_dir, Daemon, LineClient, TestConfig,
};
use tallyd::config::{Config, KeyTypeName};
use tallyd::store::embedded::Embedded;
use tempfile::TempDir;

const CONTROL: &str = "/usr/share/postgresql/15/extension/citus.control";

fn citus_missing() -> bool {
    if Path::new(CONTROL).exists() {
        return false;
    }
    eprintln!("SKIPPED: citus not installed ({CONTROL} missing)");
    true
}

/// A coordinator and two workers, each a private cluster on 127.0.0.1.
struct Cluster {
    // Dropped before `dir`.
    nodes: Vec<Embedded>,
    ports: Vec<u16>,
    dir: TempDir,
}

impl Cluster {
    async fn start() -> Cluster {
        let dir = temp_dir();
        let mut nodes = Vec::new();
        let mut ports = Vec::new();
        for name in ["coordinator", "worker1", "worker2"] {
            let port = free_port();
            let path = dir.path().join(name);
            let node_conninfo = format!(
                "sslmode=require sslcert={}",
                path.join("no-client-certificate.crt").display()
            );
            let node = tokio::task::spawn_blocking(move || {
                start_postgres_with(
                    &path,
                    &[
                        ("shared_preload_libraries", "citus"),
                        ("listen_addresses", "127.0.0.1"),
                        ("port", &port.to_string()),
                        ("max_connections", "200"),
                        // Citus's default sslmode (require), so that CREATE EXTENSION citus
                        // turns TLS on with its self-signed X.509 version 1 certificate, as on
                        // a default cluster. A client certificate file that does not exist:
                        // the servers run with root's HOME, and libpq refuses to connect when
                        // it cannot look for $HOME/.postgresql/postgresql.crt (EACCES).
                        ("citus.node_conninfo", &node_conninfo),
                    ],
                )
            })
            .await
            .unwrap();
            let client = connect(port).await;
            client
                .batch_execute("CREATE EXTENSION citus")
                .await
                .unwrap();
            nodes.push(node);
            ports.push(port);
        }
        let coordinator = connect(ports[0]).await;
        coordinator
            .execute(
                "SELECT citus_set_coordinator_host('127.0.0.1', $1)",
                &[&(ports[0] as i32)],
            )
            .await
            .unwrap();
        for port in &ports[1..] {
            coordinator
                .execute("SELECT citus_add_node('127.0.0.1', $1)", &[&(*port as i32)])
                .await
                .unwrap();
        }
        Cluster { nodes, ports, dir }
    }

    fn url(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.ports[0]
        )
    }

    async fn sql(&self) -> tokio_postgres::Client {
        connect(self.ports[0]).await
    }

    /// Writes a config for the real binary under `name/`: the standard counters through the
    /// coordinator, the rollup schedule on when `rollup` is, then `edit`.
    fn config(&self, name: &str, rollup: bool, edit: impl FnOnce(&mut Config)) -> PathBuf {
        let dir = self.dir.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        TestConfig::new(&dir)
            .standard_counters()
            .fast()
            .database_url(&self.url())
            .with(|c| {
                c.daemon.set_drain_timeout(Duration::from_millis(5000));
                c.rollup.enabled = rollup;
                c.rollup.set_interval(Duration::from_millis(200));
                c.rollup.batch_rows = 1000;
            })
            .with(edit)
            .write()
    }

    async fn stop(self) {
        for node in self.nodes {
            common::stop_postgres(node).await;
        }
    }
}

async fn connect(port: u16) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(
        &format!("host=127.0.0.1 port={port} user=postgres dbname=postgres"),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    client
}

/// Runs the tallyd binary; panics with its output unless it succeeds.
fn tallyd(config: &Path, args: &[&str]) -> String {
    let out = common::tallyd(config, args);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "tallyd {args:?} failed:\n{text}");
    text
}

/// `tallyd_lines_rejected_total{reason="overflow"}` from the daemon's metrics endpoint.
fn overflow_rejected(daemon: &Daemon) -> u64 {
    daemon
        .scrape()
        .get("tallyd_lines_rejected_total{reason=\"overflow\"}")
        .map_or(0, |v| v as u64)
}

/// What the workload below sends, per key of `downloads`: a hot key and 10,000 others.
fn expected(rounds: i64) -> Vec<(String, i64)> {
    let mut all: Vec<(String, i64)> = (0..10_000)
        .map(|k| (format!("k{k:05}"), rounds * (k % 7 + 1)))
        .collect();
    all.push(("hot".into(), rounds * 20_000));
    all.sort();
    all
}

/// One round: 20,000 events on the hot key and 10,000 keys of delta 1..7, then `!flush`.
async fn send_round(c: &mut LineClient) {
    c.send(&buf_of((0..20_000).map(|_| "downloads hot".to_string())))
        .await;
    c.send(&buf_of(
        (0..10_000).map(|k| format!("downloads k{k:05} {}", k % 7 + 1)),
    ))
    .await;
    assert_eq!(c.flush().await, (30_000, 0));
}

async fn wait_until(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !done().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `tallyd migrate` distributes the tables (twice: idempotent), the core workload is exact
/// through the coordinator, the daemon's rollup and `tallyd rollup` fold every slot row on the
/// workers, exact throughout, and a rollup_into table distributed with tallyd.slots is folded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workload_and_rollups_are_exact_on_citus() {
    if citus_missing() {
        return;
    }
    let cluster = Cluster::start().await;
    let sql = cluster.sql().await;
    sql.batch_execute(
        "CREATE TABLE public.repositories (id text PRIMARY KEY, stars bigint NOT NULL DEFAULT 0);
         SELECT create_distributed_table('public.repositories', 'id');
         INSERT INTO public.repositories (id) SELECT 'r' || i FROM generate_series(0, 99) i;",
    )
    .await
    .unwrap();
    let stars = |c: &mut Config| {
        c.counters.push(counter_rolled_into(
            "stars",
            KeyTypeName::Text,
            "public.repositories",
            "id",
            "stars",
        ))
    };
    let config = cluster.config("a", true, stars);
    tallyd(&config, &["migrate"]);
    tallyd(&config, &["migrate"]);
    let distributed: Vec<String> = sql
        .query(
            "SELECT logicalrelid::text FROM pg_dist_partition WHERE partmethod = 'h' ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        distributed,
        [
            "repositories",
            "tallyd.rollup_rejects",
            "tallyd.rollups",
            "tallyd.slots"
        ]
    );
    // slot_partitions is refused with a clear message.
    let bad = cluster.config("bad", false, |c| c.database.slot_partitions = 4);
    let out = common::tallyd(&bad, &["migrate"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("slot_partitions = 4 is not supported on Citus"),
        "{err}"
    );

    // A rollup_into table that is not distributed with tallyd.slots is refused, and the
    // refused start records nothing.
    sql.batch_execute("CREATE TABLE public.local_repos (id text PRIMARY KEY, n bigint)")
        .await
        .unwrap();
    let local_stars = |c: &mut Config| {
        c.counters.push(counter_rolled_into(
            "local_stars",
            KeyTypeName::Text,
            "public.local_repos",
            "id",
            "n",
        ))
    };
    let local = cluster.config("local", false, local_stars);
    let out = common::tallyd(&local, &["migrate"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("rollup_into table public.local_repos must be distributed on id"),
        "{err}"
    );
    assert_eq!(
        scalar(
            &sql,
            "SELECT count(*) FROM tallyd.rollup_targets WHERE counter = 'local_stars'"
        )
        .await,
        0
    );

    // So is a start without migrations (`migrate = false`): the layout is checked all the same.
    let local = cluster.config("local", false, |c| {
        local_stars(c);
        c.database.migrate = false;
    });
    let out = common::tallyd(&local, &["run"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("rollup_into table public.local_repos must be distributed on id"),
        "{err}"
    );

    // Rollup off at first: the rows are really on the workers, and exact before any fold.
    let plain = cluster.config("b", false, stars);
    let socket = plain.parent().unwrap().join("tallyd.sock");
    let daemon = spawn_daemon(&plain);
    let mut c = LineClient::connect(&socket).await;
    send_round(&mut c).await;
    c.send(&buf_of((0..100).map(|i| format!("stars r{i} {}", i + 1))))
        .await;
    c.send(b"stars nosuchrepo 5\n").await;
    assert_eq!(c.flush().await, (101, 0));
    assert_eq!(counts(&sql, "downloads").await, expected(1));
    // Over TLS with Citus's own certificate, on tallyd's default sslmode (prefer).
    let tallyd_sessions = |ssl: &str| {
        format!(
            "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.application_name LIKE 'tallyd-%' AND s.ssl = {ssl}"
        )
    };
    assert!(scalar(&sql, &tallyd_sessions("true")).await > 0);
    assert_eq!(scalar(&sql, &tallyd_sessions("false")).await, 0);
    for port in &cluster.ports[1..] {
        let worker = connect(*port).await;
        let rows = scalar(
            &worker,
            "SELECT count(*) FROM tallyd.slots WHERE counter = 'downloads'",
        )
        .await;
        assert!(rows > 1000, "worker {port} holds {rows} slot rows");
    }
    let got = tallyd(&plain, &["get", "downloads", "hot"]);
    assert!(got.starts_with("downloads hot count=20000 "), "{got}");
    let got = tallyd(&plain, &["get", "stars", "r9"]);
    assert!(got.starts_with("stars r9 count=10 "), "{got}");
    // `tallyd rollup` folds everything (the unmatched stars key stays, exact).
    let out = tallyd(&plain, &["rollup", "--until-empty"]);
    assert!(out.contains("folded"), "{out}");
    assert_eq!(
        scalar(
            &sql,
            "SELECT count(*) FROM tallyd.slots WHERE counter <> 'stars'"
        )
        .await,
        0
    );
    assert_eq!(
        scalar(
            &sql,
            "SELECT count(*) FROM tallyd.slots WHERE counter = 'stars'"
        )
        .await,
        1
    );
    assert_eq!(counts(&sql, "downloads").await, expected(1));
    // The daemon's unmatched-keys gauge reads this through the coordinator.
    assert_eq!(
        scalar(
            &sql,
            "SELECT slot_rows FROM tallyd.unmatched() WHERE counter = 'stars'"
        )
        .await,
        1
    );
    assert_eq!(
        scalar(&sql, "SELECT sum(stars)::bigint FROM public.repositories").await,
        (1..=100).sum::<i64>()
    );
    daemon.terminate();

    // The daemon's rollup folds while the workload runs; exact throughout.
    let daemon = spawn_daemon(&config);
    let mut c = LineClient::connect(&config.parent().unwrap().join("tallyd.sock")).await;
    for round in 2..=3 {
        send_round(&mut c).await;
        assert_eq!(counts(&sql, "downloads").await, expected(round));
        // `tallyd rollup` beside the daemon's own schedule: both claim with SKIP LOCKED and
        // the per-key lock on the workers, so neither folds a row twice.
        let cli = config.clone();
        tokio::task::spawn_blocking(move || tallyd(&cli, &["rollup", "--until-empty"]))
            .await
            .unwrap();
        assert_eq!(counts(&sql, "downloads").await, expected(round));
    }
    wait_until("the daemon's rollup to fold every slot row", async || {
        scalar(
            &sql,
            "SELECT count(*) FROM tallyd.slots WHERE counter = 'downloads'",
        )
        .await
            == 0
    })
    .await;
    assert_eq!(counts(&sql, "downloads").await, expected(3));
    assert_eq!(
        scalar(
            &sql,
            "SELECT count FROM tallyd.rollups WHERE counter = 'downloads' AND key = 'hot'"
        )
        .await,
        60_000
    );
    daemon.terminate();
    cluster.stop().await;
}

/// The overflow guard counts on Citus: a flush that would push a stored total past 64 bits
/// rejects those events (seen by a client that asked with `!errors`), the rest commits; the
/// rollup holds back that key only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overflow_guard_counts_on_citus() {
    if citus_missing() {
        return;
    }
    let cluster = Cluster::start().await;
    let sql = cluster.sql().await;
    let metrics = format!("127.0.0.1:{}", free_port());
    let config = cluster.config("a", false, |c| c.metrics.set_listen(Some(metrics)));
    tallyd(&config, &["migrate"]);
    let socket = config.parent().unwrap().join("tallyd.sock");
    let daemon = spawn_daemon(&config);
    let mut c = LineClient::connect(&socket).await;
    c.send(format!("downloads huge {}\n", i64::MAX).as_bytes())
        .await;
    assert_eq!(c.flush().await, (1, 0));
    assert_eq!(overflow_rejected(&daemon), 0);
    // Each line is fine alone; the stored total would overflow: the upsert skips that row.
    c.send(b"downloads huge 1\ndownloads other 3\n").await;
    assert_eq!(c.flush().await, (2, 0));
    assert_eq!(overflow_rejected(&daemon), 1);
    assert_eq!(
        counts(&sql, "downloads").await,
        [("huge".to_string(), i64::MAX), ("other".to_string(), 3)]
    );

    // The rollup: fold the key at the limit, then one more makes its fold overflow.
    tallyd(&config, &["rollup", "--until-empty"]);
    c.send(b"downloads huge -1\n").await;
    assert_eq!(c.flush().await, (1, 0));
    sql.execute(
        "UPDATE tallyd.slots SET count = 2 WHERE counter = 'downloads' AND key = 'huge'",
        &[],
    )
    .await
    .unwrap();
    let out = tallyd(&config, &["rollup", "--until-empty"]);
    assert!(out.contains("held back downloads \"huge\""), "{out}");
    assert_eq!(
        scalar(&sql, "SELECT count(*) FROM tallyd.rollup_rejects").await,
        1
    );
    let exact: String = sql
        .query_one(
            "SELECT exact_count::text FROM tallyd.totals WHERE counter = 'downloads' AND key = 'huge'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(exact, "9223372036854775809");
    daemon.terminate();
    cluster.stop().await;
}

/// kill -9 after `!sync`: the restarted daemon replays its journal onto the Citus cluster,
/// exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_replays_exactly_on_citus() {
    if citus_missing() {
        return;
    }
    let cluster = Cluster::start().await;
    let sql = cluster.sql().await;
    // Flushes only when asked (`!flush`), so that the `!sync`ed lines are not yet committed.
    let config = cluster.config("a", false, |c| {
        c.flush.set_interval(Duration::from_millis(600_000))
    });
    tallyd(&config, &["migrate"]);
    let socket = config.parent().unwrap().join("tallyd.sock");
    let daemon = spawn_daemon(&config);
    let mut c = LineClient::connect(&socket).await;
    send_round(&mut c).await;
    // Accepted and durable in the journal, not flushed (the flush interval is a minute).
    c.send(&buf_of(
        (0..10_000).map(|k| format!("downloads k{k:05} {}", k % 7 + 1)),
    ))
    .await;
    c.send(&buf_of((0..20_000).map(|_| "downloads hot".to_string())))
        .await;
    c.send(b"!sync\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    daemon.kill();
    assert_eq!(counts(&sql, "downloads").await, expected(1));

    let daemon = spawn_daemon(&config);
    let mut c = LineClient::connect(&socket).await;
    c.flush().await;
    wait_until("the replay to commit", async || {
        counts(&sql, "downloads").await == expected(2)
    })
    .await;
    daemon.terminate();
    assert_eq!(counts(&sql, "downloads").await, expected(2));
    cluster.stop().await;
}

/// Flush throughput on plain PostgreSQL against the Citus cluster, in one run, through the same
/// daemon binary and workload: rows per second of bulk flushes (50,000 new keys per `!flush`)
/// and the time of a one-row flush (its commit's round trips). Ignored by default: a
/// measurement, not a check; run with
/// `cargo test --release --test citus flush_throughput -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn flush_throughput_plain_vs_citus() {
    if citus_missing() {
        return;
    }
    let cluster = Cluster::start().await;
    let plain_dir = temp_dir();
    let plain_port = free_port();
    let plain = {
        let path = plain_dir.path().to_path_buf();
        tokio::task::spawn_blocking(move || {
            start_postgres_with(
                &path,
                &[
                    ("listen_addresses", "127.0.0.1"),
                    ("port", &plain_port.to_string()),
                ],
            )
        })
        .await
        .unwrap()
    };
    let citus_config = cluster.config("citus", false, |_| ());
    let plain_config = cluster.config("plain", false, |c| {
        c.database.url = format!("host=127.0.0.1 port={plain_port} user=postgres dbname=postgres")
    });
    println!(
        "| database | bulk flush (50,000 new keys each, 5 flushes) | one-row flush (200 flushes) |"
    );
    println!("| --- | --- | --- |");
    let citus = "Citus 13.0.5, 2 workers";
    let runs = [
        ("PostgreSQL 15".to_string(), &plain_config),
        (format!("{citus}, 32 shards (default)"), &citus_config),
        (format!("{citus}, 4 shards"), &citus_config),
    ];
    for (run, (name, config)) in runs.into_iter().enumerate() {
        tallyd(config, &["migrate"]);
        if name.ends_with("4 shards") {
            cluster
                .sql()
                .await
                .execute(
                    "SELECT alter_distributed_table('tallyd.slots', shard_count := 4, \
                     cascade_to_colocated := true)",
                    &[],
                )
                .await
                .unwrap();
        }
        let socket = config.parent().unwrap().join("tallyd.sock");
        let daemon = spawn_daemon(config);
        let mut c = LineClient::connect(&socket).await;
        let started = Instant::now();
        for round in 0..5 {
            c.send(&buf_of(
                (0..50_000).map(|k| format!("downloads x{run}r{round}k{k}")),
            ))
            .await;
            assert_eq!(c.flush().await, (50_000, 0));
        }
        let bulk = 250_000.0 / started.elapsed().as_secs_f64();
        let started = Instant::now();
        for _ in 0..200 {
            c.send(b"downloads hot\n").await;
            assert_eq!(c.flush().await, (1, 0));
        }
        let one = started.elapsed().as_secs_f64() * 1000.0 / 200.0;
        println!("| {name} | {bulk:.0} rows/s | {one:.1} ms |");
        daemon.terminate();
    }
    common::stop_postgres(plain).await;
    cluster.stop().await;
}
