//! tallyd on a real Citus cluster: a coordinator and two workers started here on loopback,
//! set up by `tallyd migrate`, driven through the real binary (daemon, `tallyd rollup`,
//! `tallyd get`). Skipped, with a printed reason, where the citus extension is not installed
//! (build Citus v13.0.5 from its source against PostgreSQL 15 and install it to run them).
//! The cluster runs with Citus's default TLS: tallyd connects with its default sslmode.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    buf_of, counter_rolled_into, counts, free_port, kind_counter, rows_of_key, scalar,
    spawn_daemon, start_postgres_with, temp_dir, total_row, unix_ms, value_of, wait_until,
    windowed_counter, Daemon, LineClient, TestConfig,
};
use tallyd::config::{Config, KeyTypeName};
use tallyd::store::embedded::Embedded;
use tempfile::TempDir;
use tokio_postgres::error::SqlState;

const CONTROL: &str = "/usr/share/postgresql/15/extension/citus.control";
const HLL_CONTROL: &str = "/usr/share/postgresql/15/extension/hll.control";

fn citus_missing() -> bool {
    if Path::new(CONTROL).exists() {
        return false;
    }
    eprintln!("SKIPPED: citus not installed ({CONTROL} missing)");
    true
}

/// Citus and postgresql-hll (scripts/ensure-postgres installs the package).
fn citus_or_hll_missing() -> bool {
    if citus_missing() {
        return true;
    }
    if Path::new(HLL_CONTROL).exists() {
        return false;
    }
    eprintln!("SKIPPED: postgresql-hll not installed ({HLL_CONTROL} missing)");
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
        Cluster::start_with(&[]).await
    }

    /// With `extensions` created on every node beside citus, before the workers are added and
    /// before any tallyd starts.
    async fn start_with(extensions: &[&str]) -> Cluster {
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
            for extension in extensions {
                client
                    .batch_execute(&format!("CREATE EXTENSION {extension}"))
                    .await
                    .unwrap();
            }
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

/// The unique counter's keys in the kinds test and their distinct values per round: 1 to 3,000
/// (postgresql-hll keeps up to 160 hashes at log2m 11, regwidth 5 explicitly, exact), and 20
/// small keys, so that keys live on both workers.
fn unique_keys() -> Vec<(String, usize)> {
    let mut keys: Vec<(String, usize)> = [
        ("one", 1),
        ("hundred", 100),
        ("threshold", 160),
        ("over", 161),
        ("many", 3000),
    ]
    .iter()
    .map(|(k, n)| (k.to_string(), *n))
    .collect();
    keys.extend((0..20).map(|i| (format!("small{i}"), i + 1)));
    keys
}

/// What the kinds test sent, per counter and key: the unique counter's distinct values, the
/// max, min and last values due, and the events (`count` of every kind but sum).
#[derive(Default)]
struct KindsSent {
    values: BTreeMap<String, BTreeSet<String>>,
    peak: BTreeMap<String, i64>,
    low: BTreeMap<String, i64>,
    /// (event time, value): the latest time wins, at equal times the larger value.
    gauge: BTreeMap<String, (i64, i64)>,
    events: BTreeMap<(&'static str, String), i64>,
    /// xorshift state.
    x: u64,
}

impl KindsSent {
    fn new() -> KindsSent {
        KindsSent {
            x: 0x9e37_79b9_7f4a_7c15,
            ..KindsSent::default()
        }
    }

    fn next(&mut self) -> u64 {
        self.x ^= self.x << 13;
        self.x ^= self.x >> 7;
        self.x ^= self.x << 17;
        self.x
    }

    /// One round's lines: each unique key's values (half of them seen in the round before),
    /// and 600 max, min and last events over 37 keys, out of time order.
    fn round(&mut self, round: usize) -> Vec<u8> {
        let mut lines = Vec::new();
        for (key, n) in unique_keys() {
            for j in round * n / 2..round * n / 2 + n {
                let value = format!("v{j}");
                lines.push(format!("visitors {key} {value}"));
                self.values.entry(key.clone()).or_default().insert(value);
                *self.events.entry(("visitors", key.clone())).or_default() += 1;
            }
        }
        for i in 0..600 {
            let key = format!("k{}", i % 37);
            let value = (self.next() % 2_000_001) as i64 - 1_000_000;
            // Few distinct times, so that equal times occur.
            let at = 1_700_000_000_000 + (self.next() % 50) as i64;
            lines.push(format!("peak {key} {value}"));
            lines.push(format!("low {key} {value}"));
            lines.push(format!("gauge {key} {value} @{at}"));
            let peak = self.peak.entry(key.clone()).or_insert(value);
            *peak = (*peak).max(value);
            let low = self.low.entry(key.clone()).or_insert(value);
            *low = (*low).min(value);
            let gauge = self.gauge.entry(key.clone()).or_insert((at, value));
            *gauge = (*gauge).max((at, value));
            for counter in ["peak", "low", "gauge"] {
                *self.events.entry((counter, key.clone())).or_default() += 1;
            }
        }
        buf_of(lines)
    }

    fn lines(&self) -> u64 {
        self.events.values().sum::<i64>() as u64
    }

    /// Through the coordinator: every unique key's sketch in tallyd.unique_totals is the one
    /// SQL's `hll_add_agg(hll_hash_text(v), 11, 5)` builds of its distinct values, with its
    /// events; every max, min and last key's value and events in tallyd.totals are due.
    async fn check(&self, sql: &tokio_postgres::Client, when: &str) {
        assert_sketches(sql, &self.values, when).await;
        let events: BTreeMap<String, i64> = sql
            .query(
                "SELECT key, events::bigint FROM tallyd.unique_totals WHERE counter = 'visitors'",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let sent: BTreeMap<String, i64> = self
            .events
            .iter()
            .filter(|((counter, _), _)| *counter == "visitors")
            .map(|((_, key), n)| (key.clone(), *n))
            .collect();
        assert_eq!(events, sent, "{when}: visitors' events");
        for (counter, due) in [
            ("peak", self.peak.clone()),
            ("low", self.low.clone()),
            (
                "gauge",
                self.gauge
                    .iter()
                    .map(|(k, (_, v))| (k.clone(), *v))
                    .collect(),
            ),
        ] {
            let got: BTreeMap<String, (i64, i64)> = sql
                .query(
                    "SELECT key, count, value FROM tallyd.totals WHERE counter = $1",
                    &[&counter],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| (r.get(0), (r.get(1), r.get(2))))
                .collect();
            let want: BTreeMap<String, (i64, i64)> = due
                .into_iter()
                .map(|(k, v)| {
                    let events = self.events[&(counter, k.clone())];
                    (k, (events, v))
                })
                .collect();
            assert_eq!(got, want, "{when}: {counter} (key: (events, value))");
        }
    }
}

/// Through the coordinator: the `visitors` keys are those of `values`, and each key's sketch
/// in tallyd.unique_totals is the one SQL's `hll_add_agg(hll_hash_text(v), 11, 5)` builds of
/// its distinct values (exact up to 160 of them).
async fn assert_sketches(
    sql: &tokio_postgres::Client,
    values: &BTreeMap<String, BTreeSet<String>>,
    when: &str,
) {
    for (key, values) in values {
        let values: Vec<&str> = values.iter().map(String::as_str).collect();
        let row = sql
            .query_one(
                "SELECT u.cardinality, u.sketch::text, round(hll_cardinality(x.s))::bigint, \
                        x.s::text \
                 FROM tallyd.unique_totals u, \
                      (SELECT hll_add_agg(hll_hash_text(v), 11, 5) AS s \
                       FROM unnest($2::text[]) v) x \
                 WHERE u.counter = 'visitors' AND u.key = $1 AND u.span = 'all'",
                &[key, &values],
            )
            .await
            .unwrap_or_else(|e| panic!("{when}: visitors {key}: {e}"));
        let (ours, theirs): ((i64, String), (i64, String)) =
            ((row.get(0), row.get(1)), (row.get(2), row.get(3)));
        assert_eq!(
            ours,
            theirs,
            "{when}: visitors {key}: {} values",
            values.len()
        );
        if values.len() <= 160 {
            assert_eq!(
                ours.0,
                values.len() as i64,
                "{when}: {key} exact while explicit"
            );
        }
    }
    let keys = scalar(
        sql,
        "SELECT count(*) FROM tallyd.unique_totals WHERE counter = 'visitors'",
    )
    .await;
    assert_eq!(keys, values.len() as i64, "{when}: visitors' keys");
}

/// Slot rows of counters of another kind than sum, per worker port, counted on the shards'
/// placements (a worker's tallyd.slots would show every shard: Citus syncs its metadata).
async fn kind_rows_per_worker(sql: &tokio_postgres::Client) -> Vec<(i32, i64)> {
    sql.query(
        "SELECT nodeport, sum(result::bigint)::bigint FROM run_command_on_placements(\
             'tallyd.slots', 'SELECT count(*) FROM %s WHERE kind IS NOT NULL') \
         GROUP BY nodeport ORDER BY nodeport",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// Unique, max, min and last counters on Citus, the hll extension created on the coordinator
/// and both workers before tallyd starts: exact after flushes (their slot rows on both
/// workers) and after `tallyd rollup` (folded on the workers: tallyd.rollup_fold runs
/// tallyd.rollup_sketches there), read through the coordinator in tallyd.unique_totals
/// (sketches equal to SQL's own, byte for byte) and tallyd.totals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counter_kinds_are_exact_on_citus() {
    if citus_or_hll_missing() {
        return;
    }
    let cluster = Cluster::start_with(&["hll"]).await;
    let sql = cluster.sql().await;
    let config = cluster.config("a", false, |c| {
        c.counters.extend([
            kind_counter("visitors", "unique", ""),
            kind_counter("peak", "max", ""),
            kind_counter("low", "min", ""),
            kind_counter("gauge", "last", ""),
        ])
    });
    tallyd(&config, &["migrate"]);
    let daemon = spawn_daemon(&config);
    let mut c = LineClient::connect(&config.parent().unwrap().join("tallyd.sock")).await;
    let mut sent = KindsSent::new();
    for round in 0..3 {
        let before = sent.lines();
        c.send(&sent.round(round)).await;
        assert_eq!(c.flush().await, (sent.lines() - before, 0));
        sent.check(&sql, &format!("round {round}, flushed")).await;
        if round == 0 {
            let rows = kind_rows_per_worker(&sql).await;
            let ports: Vec<i32> = rows.iter().map(|(port, _)| *port).collect();
            let mut workers: Vec<i32> = cluster.ports[1..].iter().map(|p| *p as i32).collect();
            workers.sort();
            assert_eq!(ports, workers, "slot rows on both workers: {rows:?}");
            assert!(rows.iter().all(|(_, n)| *n > 0), "{rows:?}");
        }
        if round >= 1 {
            let out = tallyd(&config, &["rollup", "--until-empty"]);
            assert!(out.contains("folded"), "{out}");
            assert_eq!(
                scalar(
                    &sql,
                    "SELECT count(*) FROM tallyd.slots WHERE kind IS NOT NULL"
                )
                .await,
                0,
                "the rollup folds every kind's slot rows on the workers"
            );
            assert_eq!(
                scalar(
                    &sql,
                    "SELECT count(*) FROM tallyd.rollups WHERE kind = 'unique' AND sketch IS NOT NULL"
                )
                .await,
                sent.values.len() as i64
            );
            sent.check(&sql, &format!("round {round}, rolled up")).await;
        }
    }
    // "one": v0, v0, v1 over the three rounds.
    let got = tallyd(&config, &["get", "visitors", "one"]);
    assert!(got.starts_with("visitors one count=3 unique=2 "), "{got}");
    let got = tallyd(&config, &["get", "gauge", "k0"]);
    assert!(
        got.contains(&format!(" last={} ", sent.gauge["k0"].1)),
        "{got}"
    );
    daemon.terminate();
    cluster.stop().await;
}

/// Max, min and unique counters folded into an application's table on Citus, distributed on
/// its key and colocated with tallyd.slots: `tallyd rollup` folds each shard group on its
/// worker with tallyd.rollup_into_kind (before V13, tallyd.rollup_citus did not pass the
/// target's kind, so a max or min column received the number of events and an hll column
/// failed the step): the greatest, the least and the union of what was sent, beside the
/// column's own value; a key without a row stays in tallyd.slots, exact in tallyd.totals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinds_fold_into_a_distributed_table_on_citus() {
    if citus_or_hll_missing() {
        return;
    }
    let cluster = Cluster::start_with(&["hll"]).await;
    let sql = cluster.sql().await;
    sql.batch_execute(
        "CREATE TABLE public.repositories (id text PRIMARY KEY, visitors hll, peak bigint, \
                                           low numeric);
         SELECT create_distributed_table('public.repositories', 'id');
         INSERT INTO public.repositories (id) SELECT 'r' || i FROM generate_series(1, 49) i;
         INSERT INTO public.repositories VALUES ('r0', hll_empty(11, 5), 1000000, -1000000);",
    )
    .await
    .unwrap();
    let into = |name: &str, kind: &str, column: &str| {
        let mut counter =
            counter_rolled_into(name, KeyTypeName::Text, "public.repositories", "id", column);
        counter.kind = kind_counter(name, kind, "").kind;
        counter
    };
    let config = cluster.config("a", false, |c| {
        c.counters.extend([
            into("repo_visitors", "unique", "visitors"),
            into("repo_peak", "max", "peak"),
            into("repo_low", "min", "low"),
        ])
    });
    tallyd(&config, &["migrate"]);
    let daemon = spawn_daemon(&config);
    let mut c = LineClient::connect(&config.parent().unwrap().join("tallyd.sock")).await;
    let mut sent = KindsSent::new();
    let keys: Vec<String> = (0..50)
        .map(|i| format!("r{i}"))
        .chain(["nosuch".to_string()])
        .collect();
    for _ in 0..3 {
        let mut lines = Vec::new();
        for key in &keys {
            for _ in 0..20 {
                let value = (sent.next() % 2_000_001) as i64 - 1_000_000;
                lines.push(format!("repo_peak {key} {value}"));
                lines.push(format!("repo_low {key} {value}"));
                let peak = sent.peak.entry(key.clone()).or_insert(value);
                *peak = (*peak).max(value);
                let low = sent.low.entry(key.clone()).or_insert(value);
                *low = (*low).min(value);
                let visitor = format!("u{}", sent.next() % 300);
                lines.push(format!("repo_visitors {key} {visitor}"));
                sent.values.entry(key.clone()).or_default().insert(visitor);
            }
        }
        c.send(&buf_of(lines)).await;
        assert_eq!(c.flush().await, (60 * keys.len() as u64, 0));
        let out = tallyd(&config, &["rollup", "--until-empty"]);
        assert!(out.contains("folded"), "{out}");
    }
    for key in &keys[..50] {
        let values: Vec<&str> = sent.values[key].iter().map(String::as_str).collect();
        let row = sql
            .query_one(
                "SELECT visitors::text, (SELECT hll_add_agg(hll_hash_text(v), 11, 5)::text \
                                         FROM unnest($2::text[]) v), peak, low::bigint \
                 FROM public.repositories WHERE id = $1",
                &[key, &values],
            )
            .await
            .unwrap();
        let (ours, theirs): (String, String) = (row.get(0), row.get(1));
        assert_eq!(ours, theirs, "{key}: one sketch of every value sent");
        let (peak, low): (i64, i64) = (row.get(2), row.get(3));
        // r0's row started with its own values, beyond anything sent.
        let (want_peak, want_low) = if key == "r0" {
            (1_000_000, -1_000_000)
        } else {
            (sent.peak[key], sent.low[key])
        };
        assert_eq!((peak, low), (want_peak, want_low), "{key}");
    }
    assert_eq!(
        scalar(
            &sql,
            "SELECT count(*) FROM tallyd.slots WHERE key <> 'nosuch'"
        )
        .await,
        0,
        "every row of a key with a target row folded"
    );
    let pending: Vec<(String, i64, Option<i64>)> = sql
        .query(
            "SELECT counter, count, value FROM tallyd.totals WHERE key = 'nosuch' ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        pending,
        [
            ("repo_low".to_string(), 60, Some(sent.low["nosuch"])),
            ("repo_peak".to_string(), 60, Some(sent.peak["nosuch"])),
            ("repo_visitors".to_string(), 60, None),
        ]
    );
    daemon.terminate();
    cluster.stop().await;
}
/// Every row of tallyd.totals: (counter, key, count, value).
async fn all_totals(sql: &tokio_postgres::Client) -> Vec<(String, String, i64, Option<i64>)> {
    sql.query(
        "SELECT counter, key, count, value FROM tallyd.totals ORDER BY 1, 2",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

/// Sends `before`, `correction` and `after` on one connection in one write (the events after
/// it may share its flight); waits for the correction's `ok`.
async fn correct_between(
    c: &mut LineClient,
    before: &[String],
    correction: &str,
    after: &[String],
) {
    let mut lines = before.to_vec();
    lines.push(correction.to_string());
    lines.extend_from_slice(after);
    c.send(&buf_of(lines)).await;
    assert_eq!(c.read_line().await, "ok\n", "{correction}");
}

fn repeat(line: &str, n: usize) -> Vec<String> {
    vec![line.to_string(); n]
}

/// `!set` and `!forget` on Citus, each with events before and after it, the key's rows on its
/// worker in slots (flushed), in rollups (folded there by `tallyd rollup`) and in memory: a
/// sum, a max, a unique counter's key forgotten, a key forgotten in every counter
/// (`!forget *`), and `tallyd.set_total` / `tallyd.forget` from SQL on the coordinator; exact
/// before and after a last rollup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrections_are_exact_on_citus() {
    if citus_or_hll_missing() {
        return;
    }
    let cluster = Cluster::start_with(&["hll"]).await;
    let sql = cluster.sql().await;
    let config = cluster.config("a", false, |c| {
        c.counters.extend([
            kind_counter("visitors", "unique", ""),
            kind_counter("peak", "max", ""),
            windowed_counter("daily", "day", "UTC", &["month", "all"]),
        ])
    });
    tallyd(&config, &["migrate"]);
    let daemon = spawn_daemon(&config);
    let mut c = LineClient::connect(&config.parent().unwrap().join("tallyd.sock")).await;
    let rollup = || tallyd(&config, &["rollup", "--until-empty"]);

    // A sum: folded, flushed and pending rows before the set, superseded; those after, added.
    c.send(&buf_of(repeat("downloads k 3", 50))).await;
    assert_eq!(c.flush().await, (50, 0));
    rollup();
    c.send(&buf_of(repeat("downloads k 5", 20))).await;
    assert_eq!(c.flush().await, (20, 0));
    correct_between(
        &mut c,
        &repeat("downloads k 1", 10),
        "!set downloads k 1000",
        &[],
    )
    .await;
    assert_eq!(
        total_row(&sql, "downloads", "k").await,
        Some((Some(1000), None))
    );
    correct_between(
        &mut c,
        &repeat("downloads k 1", 7),
        "!set downloads k -5",
        &repeat("downloads k 2", 4),
    )
    .await;
    assert_eq!(c.flush().await, (21, 0), "corrections are not events");
    assert_eq!(
        total_row(&sql, "downloads", "k").await,
        Some((Some(3), None))
    );

    // A max: the set's value, then the larger of it and what came after.
    c.send(b"peak m 50\npeak m 70\n").await;
    assert_eq!(c.flush().await, (2, 0));
    rollup();
    correct_between(
        &mut c,
        &repeat("peak m 90", 1),
        "!set peak m 10",
        &["peak m 5".into(), "peak m 8".into()],
    )
    .await;
    assert_eq!(c.flush().await, (3, 0));
    assert_eq!(value_of(&sql, "peak", "m").await, Some(10));
    c.send(b"peak m 12\n").await;
    assert_eq!(c.flush().await, (1, 0));
    assert_eq!(value_of(&sql, "peak", "m").await, Some(12));

    // A unique counter's key forgotten: folded, flushed and pending values gone; the values
    // after it make a new sketch, SQL's own of them.
    c.send(b"visitors u a\nvisitors u b\nvisitors u c\n").await;
    assert_eq!(c.flush().await, (3, 0));
    rollup();
    c.send(b"visitors u d\n").await;
    assert_eq!(c.flush().await, (1, 0));
    correct_between(&mut c, &["visitors u e".into()], "!forget visitors u", &[]).await;
    assert_eq!(rows_of_key(&sql, "u").await, 0);
    c.send(b"visitors u z\nvisitors u z\n").await;
    assert_eq!(c.flush().await, (3, 0));
    let (ours, theirs): (String, String) = {
        let row = sql
            .query_one(
                "SELECT (SELECT sketch::text FROM tallyd.unique_totals \
                         WHERE counter = 'visitors' AND key = 'u'), \
                        hll_add_agg(hll_hash_text('z'), 11, 5)::text",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(ours, theirs);
    assert_eq!(
        total_row(&sql, "visitors", "u").await,
        Some((Some(2), None))
    );

    // One key forgotten in every counter whose key type takes it (`views` is bigint).
    c.send(b"ips 10.0.0.1 4\ndownloads 10.0.0.1 2\nips 10.0.0.2 1\n")
        .await;
    assert_eq!(c.flush().await, (3, 0));
    rollup();
    correct_between(
        &mut c,
        &["ips 10.0.0.1 1".into()],
        "!forget * 10.0.0.1",
        &["ips 10.0.0.2 1".into()],
    )
    .await;
    assert_eq!(c.flush().await, (2, 0));
    assert_eq!(rows_of_key(&sql, "10.0.0.1").await, 0);
    assert_eq!(
        total_row(&sql, "ips", "10.0.0.2").await,
        Some((Some(2), None))
    );

    // A windowed sum's set (days, with months and all-time rows beside them): the day becomes
    // the value, and its month and all-time rows move by the day's difference.
    let (d1, d2) = (
        unix_ms("2026-11-23T10:00:00Z"),
        unix_ms("2026-11-24T10:00:00Z"),
    );
    let days = |n: usize, day: i64, delta: i64| repeat(&format!("daily w {delta} @{day}"), n);
    c.send(&buf_of([days(30, d1, 1), days(7, d2, 1)].concat()))
        .await;
    assert_eq!(c.flush().await, (37, 0));
    rollup();
    c.send(&buf_of(days(20, d1, 1))).await;
    assert_eq!(c.flush().await, (20, 0));
    correct_between(
        &mut c,
        &days(10, d1, 1),
        &format!("!set daily w 1000 @{d1}"),
        &days(3, d1, 2),
    )
    .await;
    assert_eq!(c.flush().await, (13, 0));
    let windows = || async {
        sql.query(
            "SELECT span, window_start::text, count FROM tallyd.window_totals \
             WHERE counter = 'daily' AND key = 'w' ORDER BY 1, 2",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect::<Vec<(String, String, i64)>>()
    };
    let want_windows = [
        (
            "day".to_string(),
            "2026-11-23 00:00:00+00".to_string(),
            1006,
        ),
        ("day".into(), "2026-11-24 00:00:00+00".into(), 7),
        ("month".into(), "2026-11-01 00:00:00+00".into(), 1013),
    ];
    assert_eq!(windows().await, want_windows);
    assert_eq!(
        total_row(&sql, "daily", "w").await,
        Some((Some(1013), None))
    );

    // From SQL on the coordinator, in the application's transaction.
    sql.execute("SELECT tallyd.set_total('downloads', 'sql', 42)", &[])
        .await
        .unwrap();
    c.send(b"downloads sql 1\n").await;
    assert_eq!(c.flush().await, (1, 0));
    assert_eq!(
        total_row(&sql, "downloads", "sql").await,
        Some((Some(43), None))
    );
    assert_eq!(
        scalar(&sql, "SELECT tallyd.forget('downloads', 'sql')").await,
        2,
        "the set's rollup row and the event's slot row"
    );
    assert_eq!(rows_of_key(&sql, "sql").await, 0);

    let totals = all_totals(&sql).await;
    let keys: Vec<(&str, &str)> = totals
        .iter()
        .map(|(counter, key, ..)| (counter.as_str(), key.as_str()))
        .collect();
    assert_eq!(
        keys,
        [
            ("daily", "w"),
            ("downloads", "k"),
            ("ips", "10.0.0.2"),
            ("peak", "m"),
            ("visitors", "u")
        ]
    );
    rollup();
    assert_eq!(scalar(&sql, "SELECT count(*) FROM tallyd.slots").await, 0);
    assert_eq!(all_totals(&sql).await, totals, "the same after the rollup");
    assert_eq!(windows().await, want_windows);
    daemon.terminate();
    cluster.stop().await;
}

/// Corrections while rollup steps run all the while on the workers (the daemon's schedule every
/// 200 ms, 50 rows a step, and a session on the coordinator calling `tallyd.rollup(50)` in a
/// loop). On Citus the correction's per-key advisory lock is taken on the coordinator and the
/// steps' on the workers, so they do not exclude each other there; the row locks order them
/// (docs/scaling.md, "Corrections on Citus"). On one connection, so the test knows the order
/// the daemon accepted: 40 corrections (sets of hot keys, forgets of a sum's key and of a
/// unique counter's key), each between events before (superseded) and after (added) in one
/// write; every total exact: the last set's value plus what came after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrections_beside_running_rollups_are_exact_on_citus() {
    if citus_or_hll_missing() {
        return;
    }
    let cluster = Cluster::start_with(&["hll"]).await;
    let sql = cluster.sql().await;
    let metrics = format!("127.0.0.1:{}", free_port());
    let config = cluster.config("a", true, |c| {
        c.counters.push(kind_counter("visitors", "unique", ""));
        c.rollup.batch_rows = 50;
        c.metrics.set_listen(Some(metrics));
    });
    // Four shards instead of 32: each step opens a connection per shard group, and more keys
    // share a shard group with a corrected one.
    sql.batch_execute("ALTER DATABASE postgres SET citus.shard_count = 4")
        .await
        .unwrap();
    tallyd(&config, &["migrate"]);
    let daemon = spawn_daemon(&config);
    let mut c = LineClient::connect(&config.parent().unwrap().join("tallyd.sock")).await;
    let stop = Arc::new(AtomicBool::new(false));
    let stepper = {
        let (stop, steps) = (stop.clone(), cluster.sql().await);
        tokio::spawn(async move {
            let (mut done, mut failed) = (0, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                match steps.query_one("SELECT tallyd.rollup(50)", &[]).await {
                    Ok(_) => done += 1,
                    // Rolled back whole; the next step retries its rows.
                    Err(e) => failed.push(e.to_string()),
                }
            }
            (done, failed)
        })
    };

    let mut want: BTreeMap<String, i64> = BTreeMap::new();
    let mut values: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let add = |want: &mut BTreeMap<String, i64>, lines: &mut Vec<String>, key: &str, n| {
        lines.push(format!("downloads {key} {n}"));
        *want.entry(key.to_string()).or_default() += n;
    };
    for i in 0..40i64 {
        let mut before = Vec::new();
        for k in 0..4 {
            for _ in 0..25 {
                add(&mut want, &mut before, &format!("hot{k}"), i % 5 + 1);
            }
        }
        for k in 0..50 {
            add(&mut want, &mut before, &format!("c{k}"), 1);
        }
        let u = format!("u{}", i % 3);
        before.push(format!("visitors {u} v{i}"));
        values.entry(u.clone()).or_default().insert(format!("v{i}"));
        let mut after = Vec::new();
        let correction = match i % 10 {
            9 => {
                let key = format!("c{i}");
                want.remove(&key);
                add(&mut want, &mut after, &key, 2);
                format!("!forget downloads {key}")
            }
            4 => {
                values.remove(&u);
                after.push(format!("visitors {u} w{i}"));
                values.entry(u.clone()).or_default().insert(format!("w{i}"));
                format!("!forget visitors {u}")
            }
            _ => {
                let key = format!("hot{}", i % 4);
                want.insert(key.clone(), 1000 * i + 7);
                for _ in 0..5 {
                    add(&mut want, &mut after, &key, 1);
                }
                format!("!set downloads {key} {}", 1000 * i + 7)
            }
        };
        correct_between(&mut c, &before, &correction, &after).await;
    }
    assert_eq!(c.flush().await.1, 0);
    stop.store(true, Ordering::Relaxed);
    let (steps, failed) = stepper.await.unwrap();
    let scraped = daemon.scrape();
    eprintln!(
        "rollup steps beside the daemon's: {steps}, failed: {failed:?}; the daemon's \
         flush errors: {:?}, rollup errors: {:?}",
        scraped.sum("tallyd_flush_errors_total"),
        scraped.sum("tallyd_rollup_errors_total"),
    );
    let got: BTreeMap<String, i64> = counts(&sql, "downloads").await.into_iter().collect();
    assert_eq!(got, want);
    assert_sketches(&sql, &values, "after the corrections").await;
    tallyd(&config, &["rollup", "--until-empty"]);
    assert_eq!(scalar(&sql, "SELECT count(*) FROM tallyd.slots").await, 0);
    let got: BTreeMap<String, i64> = counts(&sql, "downloads").await.into_iter().collect();
    assert_eq!(got, want);
    assert_sketches(&sql, &values, "rolled up").await;
    daemon.terminate();
    cluster.stop().await;
}

/// The case where a correction and a rollup step meet on Citus (docs/scaling.md,
/// "Corrections on Citus"): the correction's per-key advisory lock is the coordinator's, the
/// step's the worker's, so a step can claim rows of a key the correction is about to delete,
/// and fold rows of a key it has already deleted. Here from SQL, in the application's
/// transaction (`tallyd.forget`, as the flush's `tallyd.correct` does): it forgets k1; another
/// tallyd instance commits an event of k1 in its own slot; a step claims that row and k2's and
/// waits to fold k1 into the rollups row the transaction deleted; the transaction then forgets
/// k2, whose rows the step holds: a deadlock on the worker, which PostgreSQL breaks by
/// failing one of the two. Either way nothing is lost or counted twice: the failed one is
/// rolled back whole (a flush retries its flight, the rollup its step).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "built for corrections without their table lock: instance b's flush must commit while \
            the application's forget is open, and a correction now holds tallyd.slots in SHARE ROW \
            EXCLUSIVE mode until it commits, so b's flush waits for it and the test would hang"]
async fn a_correction_deadlocked_with_a_rollup_step_loses_nothing_on_citus() {
    if citus_missing() {
        return;
    }
    let cluster = Cluster::start().await;
    let sql = cluster.sql().await;
    // Slots of their own: b's event of k1 must not wait for the row a's slot had, which the
    // open forget holds (instances that derive their slots may share one).
    let (config_a, config_b) = (
        cluster.config("a", false, |c| c.flush.set_slot_offset(Some(0))),
        cluster.config("b", false, |c| c.flush.set_slot_offset(Some(50))),
    );
    tallyd(&config_a, &["migrate"]);
    // Two keys of one shard group.
    let candidates: Vec<String> = (0..200).map(|i| format!("d{i}")).collect();
    let pair: Vec<String> = sql
        .query_one(
            "SELECT array_agg(k ORDER BY k) FROM unnest($1::text[]) k \
             GROUP BY get_shard_id_for_distribution_column('tallyd.slots', k) \
             HAVING count(*) >= 2 ORDER BY min(k) LIMIT 1",
            &[&candidates],
        )
        .await
        .unwrap()
        .get(0);
    let (k1, k2) = (pair[0].clone(), pair[1].clone());
    let a = spawn_daemon(&config_a);
    let b = spawn_daemon(&config_b);
    let mut ca = LineClient::connect(&config_a.parent().unwrap().join("tallyd.sock")).await;
    let mut cb = LineClient::connect(&config_b.parent().unwrap().join("tallyd.sock")).await;
    // Each key in tallyd.rollups and in a slot row.
    ca.send(format!("downloads {k1} 10\ndownloads {k2} 20\n").as_bytes())
        .await;
    assert_eq!(ca.flush().await, (2, 0));
    tallyd(&config_a, &["rollup", "--until-empty"]);
    ca.send(format!("downloads {k1} 1\ndownloads {k2} 2\n").as_bytes())
        .await;
    assert_eq!(ca.flush().await, (2, 0));

    let app = cluster.sql().await;
    app.batch_execute(&format!("BEGIN; SELECT tallyd.forget('downloads', '{k1}')"))
        .await
        .unwrap();
    // Instance b's row of k1 (its own slot, so not locked by the forget) commits meanwhile.
    cb.send(format!("downloads {k1} 5\n").as_bytes()).await;
    assert_eq!(cb.flush().await, (1, 0));
    let step = {
        let steps = cluster.sql().await;
        tokio::spawn(async move { steps.query_one("SELECT tallyd.rollup(1000)", &[]).await })
    };
    let workers: Vec<tokio_postgres::Client> = {
        let mut clients = Vec::new();
        for port in &cluster.ports[1..] {
            clients.push(connect(*port).await);
        }
        clients
    };
    wait_until(
        "the rollup step to wait for the forget's row lock",
        async || {
            let mut waiting = 0;
            for worker in &workers {
                waiting += scalar(worker, "SELECT count(*) FROM pg_locks WHERE NOT granted").await;
            }
            waiting > 0
        },
    )
    .await;
    let second = app
        .batch_execute(&format!("SELECT tallyd.forget('downloads', '{k2}')"))
        .await;
    let step = step.await.unwrap();
    // PostgreSQL's own check on the worker ("deadlock detected": the step's, which
    // tallyd.rollup_citus reports as its worker's failure) or Citus's distributed one
    // ("canceling the transaction since it was involved in a distributed deadlock", SQLSTATE
    // 40P01), whichever runs first.
    let deadlock = |e: &tokio_postgres::Error| {
        let db = e.as_db_error().unwrap_or_else(|| panic!("{e:?}"));
        assert!(
            db.code() == &SqlState::T_R_DEADLOCK_DETECTED || db.message().contains("deadlock"),
            "{e:?}"
        );
        db.message().to_string()
    };
    let total = |key: String| {
        let sql = &sql;
        async move {
            sql.query_opt(
                "SELECT count FROM tallyd.totals WHERE counter = 'downloads' AND key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .map(|r| r.get::<_, i64>(0))
        }
    };
    match (second, step) {
        // The usual outcome: the step waited first, so its deadlock check ran first.
        (Ok(()), Err(e)) => {
            eprintln!("the rollup step lost the deadlock: {}", deadlock(&e));
            app.batch_execute("COMMIT").await.unwrap();
            // Both forgotten; b's event, committed before the forget but after its DELETE
            // read k1's rows, is kept, as on plain PostgreSQL.
            assert_eq!(total(k1.clone()).await, Some(5));
            assert_eq!(total(k2.clone()).await, None);
        }
        (Err(e), Ok(_)) => {
            eprintln!(
                "the forget's transaction lost the deadlock: {}",
                deadlock(&e)
            );
            app.batch_execute("ROLLBACK").await.unwrap();
            assert_eq!(total(k1.clone()).await, Some(16));
            assert_eq!(total(k2.clone()).await, Some(22));
        }
        (second, step) => panic!("expected one deadlock: {second:?}, {step:?}"),
    }
    let before = (total(k1.clone()).await, total(k2.clone()).await);
    tallyd(&config_a, &["rollup", "--until-empty"]);
    assert_eq!(scalar(&sql, "SELECT count(*) FROM tallyd.slots").await, 0);
    assert_eq!((total(k1).await, total(k2).await), before);
    a.terminate();
    b.terminate();
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
