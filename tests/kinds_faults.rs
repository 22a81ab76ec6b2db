//! Counter kinds through the faults sums survive (issue 25, "What must hold"): kill -9 after
//! `!sync` and while flights are written, the journal's replay, reads spilled at the memory cap,
//! backends terminated under load, PgBouncer in transaction mode, a shard move, windows (a
//! week's sketch is the union of its days), the accuracy of a million distinct values, and the
//! starts that must be refused (a unique counter without the hll extension; a kind or sketch
//! precision changed while rows remain). A unique key's sketch is compared with the extension's
//! own `hll_add_agg(hll_hash_text(value), log2m, regwidth)` of the distinct values the test
//! sent, as text (byte for byte); max, min and last values with what the test sent; every
//! kind's event count exactly.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::netpg::Pgbouncer;
use common::{
    buf_of, db, scalar, sql, temp_dir, unix_ms, Daemon, Harness, InProcess, LineClient, TestConfig,
};
use tallyd::config::CounterConfig;
use tallyd::protocol::Kind;
use tallyd::routing;
use tokio_postgres::Client;

/// A liveness bound, not a timing assertion.
const BOUND: Duration = Duration::from_secs(120);

/// 2026-11-25T00:00:00Z: event times are around it.
const BASE: i64 = 1_795_564_800_000;

const DAY: i64 = 86_400_000;

fn kind_counter(name: &str, kind: &str, extra: &str) -> CounterConfig {
    toml::from_str(&format!("name = {name:?}\nkind = {kind:?}\n{extra}")).expect("counter")
}

/// `visitors` (unique), `peak` (max), `low` (min) and `gauge` (last).
fn four_kinds() -> Vec<CounterConfig> {
    vec![
        kind_counter("visitors", "unique", ""),
        kind_counter("peak", "max", ""),
        kind_counter("low", "min", ""),
        kind_counter("gauge", "last", ""),
    ]
}

/// A small deterministic generator (xorshift64), so that a failure can be replayed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }

    /// An integer value in ±1,000,000.
    fn value(&mut self) -> i64 {
        self.below(2_000_001) as i64 - 1_000_000
    }
}

/// What one key must show, from the events the test sent to it.
#[derive(Clone, Debug, Default)]
struct Kept {
    events: i64,
    /// A unique counter's distinct values.
    distinct: BTreeSet<String>,
    /// A max, min or last counter's (event time, value): for last, the latest event's, ties to
    /// the larger value.
    value: Option<(i64, i64)>,
}

impl Kept {
    fn add(&mut self, kind: Kind, at: i64, value: i64) {
        self.value = Some(match (kind, self.value) {
            (_, None) => (at, value),
            (Kind::Max, Some((t, v))) => (t.max(at), v.max(value)),
            (Kind::Min, Some((t, v))) => (t.max(at), v.min(value)),
            (_, Some(mine)) => mine.max((at, value)),
        });
    }
}

/// The events a test sent (all confirmed by `!flush` or `!sync`), per (counter, key): what
/// tallyd must show.
#[derive(Clone, Debug)]
struct Sent {
    /// Per counter of another kind than sum: its kind and, for unique, (log2m, regwidth).
    kinds: BTreeMap<String, (Kind, (i32, i32))>,
    keys: BTreeMap<(String, String), Kept>,
}

impl Sent {
    fn new(counters: &[CounterConfig]) -> Sent {
        let kinds = counters
            .iter()
            .filter(|c| c.kind != Kind::Sum)
            .map(|c| {
                let params = c
                    .sketch_params()
                    .map_or((0, 0), |p| (p.log2m() as i32, p.regwidth() as i32));
                (c.name.clone(), (c.kind, params))
            })
            .collect();
        Sent {
            kinds,
            keys: BTreeMap::new(),
        }
    }

    /// Records one event and returns its line.
    fn event(&mut self, counter: &str, key: &str, value: impl Display, at_ms: i64) -> String {
        let value = value.to_string();
        let (kind, _) = self.kinds[counter];
        let kept = self
            .keys
            .entry((counter.to_string(), key.to_string()))
            .or_default();
        kept.events += 1;
        if kind == Kind::Unique {
            kept.distinct.insert(value.clone());
        } else {
            kept.add(kind, at_ms, value.parse().expect("an integer value"));
        }
        format!("{counter} {key} {value} @{at_ms}")
    }

    /// `n` events to each counter, on keys `k0` to `k{keys - 1}`: unique values `v0` to
    /// `v{pool - 1}`, integers in ±1,000,000, event times in `[from, from + span)` (several on
    /// one millisecond when `span` is small, so that `last` breaks ties by value).
    fn events(
        &mut self,
        rng: &mut Rng,
        n: usize,
        keys: u64,
        pool: u64,
        from: i64,
        span: i64,
    ) -> Vec<u8> {
        let counters: Vec<(String, Kind)> = self
            .kinds
            .iter()
            .map(|(c, (k, _))| (c.clone(), *k))
            .collect();
        let mut lines = Vec::with_capacity(n * counters.len());
        for _ in 0..n {
            let key = format!("k{}", rng.below(keys));
            let at = from + rng.below(span as u64) as i64;
            for (counter, kind) in &counters {
                let line = if *kind == Kind::Unique {
                    let value = format!("v{}", rng.below(pool));
                    self.event(counter, &key, value, at)
                } else {
                    let value = rng.value();
                    self.event(counter, &key, value, at)
                };
                lines.push(line);
            }
        }
        buf_of(lines)
    }

    /// Adds what `other` sent (another client's events).
    fn merge(&mut self, other: &Sent) {
        for ((counter, key), theirs) in &other.keys {
            let (kind, _) = self.kinds[counter];
            let mine = self.keys.entry((counter.clone(), key.clone())).or_default();
            mine.events += theirs.events;
            mine.distinct.extend(theirs.distinct.iter().cloned());
            if let Some((at, value)) = theirs.value {
                mine.add(kind, at, value);
            }
        }
    }

    /// The events sent in all.
    fn total(&self) -> i64 {
        self.keys.values().map(|k| k.events).sum()
    }

    /// Asserts that the database shows exactly what was sent: every key, no other key of these
    /// counters, and per key its kind, event count and value or sketch.
    async fn check(&self, client: &Client, when: &str) {
        self.check_over(&[client], |_, _| 0, when).await;
    }

    /// [`Sent::check`] over several databases, each key on the database `home` names. A few
    /// statements per counter, whatever the number of keys: the extension's sketches of every
    /// key in one, on the first database.
    async fn check_over(
        &self,
        clients: &[&Client],
        home: impl Fn(&str, &str) -> usize,
        when: &str,
    ) {
        for (counter, &(kind, (log2m, regwidth))) in &self.kinds {
            let want: BTreeMap<&str, &Kept> = self
                .keys
                .iter()
                .filter(|((c, _), _)| c == counter)
                .map(|((_, k), kept)| (k.as_str(), kept))
                .collect();
            // Per key: its database, kind, event count and value (max, min, last).
            let mut found: BTreeMap<String, (usize, String, i64, Option<i64>)> = BTreeMap::new();
            // Per unique key: its cardinality, sketch and event count in tallyd.unique_totals.
            let mut ours: BTreeMap<String, (i64, String, i64)> = BTreeMap::new();
            for (i, client) in clients.iter().enumerate() {
                let rows = client
                    .query(
                        "SELECT key, kind, count, value FROM tallyd.totals WHERE counter = $1",
                        &[counter],
                    )
                    .await
                    .unwrap();
                for r in rows {
                    let key: String = r.get(0);
                    let row = (i, r.get(1), r.get(2), r.get(3));
                    if let Some(other) = found.insert(key.clone(), row) {
                        panic!("{when}: {counter}/{key} on databases {} and {i}", other.0);
                    }
                }
                if kind == Kind::Unique {
                    let rows = client
                        .query(
                            "SELECT key, cardinality, sketch::text, events::bigint \
                             FROM tallyd.unique_totals WHERE counter = $1 AND span = 'all'",
                            &[counter],
                        )
                        .await
                        .unwrap();
                    for r in rows {
                        ours.insert(r.get(0), (r.get(1), r.get(2), r.get(3)));
                    }
                }
            }
            assert_eq!(found.len(), want.len(), "{when}: the keys of {counter}");
            for (key, kept) in &want {
                let (database, shown, events, value) = found
                    .get(*key)
                    .unwrap_or_else(|| panic!("{when}: {counter}/{key} is missing"));
                assert_eq!(
                    *database,
                    home(counter, key),
                    "{when}: {counter}/{key} is not on its database"
                );
                assert_eq!(
                    (shown.as_str(), *events),
                    (kind.name(), kept.events),
                    "{when}: {counter}/{key}: kind and events"
                );
                if kind != Kind::Unique {
                    assert_eq!(
                        *value,
                        kept.value.map(|v| v.1),
                        "{when}: {counter}/{key}: value"
                    );
                }
            }
            if kind != Kind::Unique {
                continue;
            }
            let (keys, values): (Vec<&str>, Vec<&str>) = want
                .iter()
                .flat_map(|(k, kept)| kept.distinct.iter().map(move |v| (*k, v.as_str())))
                .unzip();
            let theirs = clients[0]
                .query(
                    "SELECT k, round(hll_cardinality(s))::bigint, s::text FROM \
                     (SELECT k, hll_add_agg(hll_hash_text(v), $3, $4) AS s \
                      FROM unnest($1::text[], $2::text[]) AS x (k, v) GROUP BY k) y",
                    &[&keys, &values, &log2m, &regwidth],
                )
                .await
                .unwrap();
            assert_eq!(theirs.len(), want.len());
            for r in theirs {
                let key: &str = r.get(0);
                let sketch = ours
                    .get(key)
                    .unwrap_or_else(|| panic!("{when}: {counter}/{key}: no unique_totals row"));
                assert_eq!(
                    sketch,
                    &(r.get(1), r.get(2), want[key].events),
                    "{when}: {counter}/{key}: the sketch of {} distinct values",
                    want[key].distinct.len()
                );
            }
        }
    }
}

/// (cardinality, sketch as text, events) of one row of tallyd.unique_totals: the all-time row
/// (`span` "all"), or the window of `span` starting at `start_ms`.
async fn unique_row(
    client: &Client,
    counter: &str,
    key: &str,
    span: &str,
    start_ms: Option<i64>,
) -> (i64, String, i64) {
    let row = client
        .query_opt(
            "SELECT cardinality, sketch::text, events::bigint FROM tallyd.unique_totals \
             WHERE counter = $1 AND key = $2 AND span = $3 \
               AND ($4::bigint IS NULL \
                    OR window_start = 'epoch'::timestamptz + $4::bigint * interval '1 millisecond')",
            &[&counter, &key, &span, &start_ms],
        )
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("no unique_totals row for {counter}/{key} {span} {start_ms:?}"));
    (row.get(0), row.get(1), row.get(2))
}

/// The extension's own sketch of `values` (cardinality, sketch as text), built in SQL.
async fn sql_sketch(
    client: &Client,
    values: &BTreeSet<String>,
    (log2m, regwidth): (i32, i32),
) -> (i64, String) {
    let values: Vec<&str> = values.iter().map(String::as_str).collect();
    let row = client
        .query_one(
            "SELECT round(hll_cardinality(s))::bigint, s::text FROM \
             (SELECT hll_add_agg(hll_hash_text(v), $2, $3) AS s FROM unnest($1::text[]) v) x",
            &[&values, &log2m, &regwidth],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

async fn flush(c: &mut LineClient) -> (u64, u64) {
    tokio::time::timeout(BOUND, c.flush())
        .await
        .expect("!flush was not answered")
}

async fn rollup_step(client: &Client, batch_rows: i32) -> i64 {
    client
        .query_one("SELECT tallyd.rollup($1)", &[&batch_rows])
        .await
        .unwrap()
        .get(0)
}

/// The config of a `tallyd run` (the real binary) on the external database `conninfo` with
/// `counters`, without a datagram socket or a rollup schedule; callers change the rest.
fn daemon_config(dir: &Path, conninfo: &str, counters: Vec<CounterConfig>) -> TestConfig {
    TestConfig::new(dir).database_url(conninfo).with(|c| {
        c.counters = counters;
        c.daemon.set_instance_id(Some("kinds".into()));
        c.listen.set_datagram_socket(None);
        c.rollup.enabled = false;
    })
}

// ---------------------------------------------------------------------------------------------
// 1. kill -9 after `!sync`: the journal's replay.
// ---------------------------------------------------------------------------------------------

/// The real `tallyd run`, killed with SIGKILL after `!sync` with events of every kind committed
/// (some rolled up) and others only journaled, among them `last` events older than the
/// committed ones: after the restart every key is exact, and the replay of older events does
/// not roll a `last` value back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_after_sync_replays_every_kind_exactly() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let counters = four_kinds();
    let config = daemon_config(dir.path(), &conninfo, counters.clone())
        // Only `!flush` commits: what follows it before the kill comes back by the replay.
        .with(|c| c.flush.set_interval(Duration::from_secs(600)))
        .write();
    let client = sql(&conninfo).await;
    let daemon = common::spawn_daemon(&config);
    let socket = dir.path().join("tallyd.sock");
    let mut c = LineClient::connect(&socket).await;
    let mut sent = Sent::new(&counters);
    let mut rng = Rng::new(1);

    // Committed: two flushes on keys k0..k39 at [BASE, BASE + 1 s), the first rolled up.
    let lines = sent.events(&mut rng, 2000, 40, 3000, BASE, 1000);
    c.send(&lines).await;
    assert_eq!(flush(&mut c).await, (8000, 0));
    assert!(rollup_step(&client, 100_000).await > 0);
    let lines = sent.events(&mut rng, 1000, 40, 3000, BASE, 1000);
    c.send(&lines).await;
    assert_eq!(flush(&mut c).await, (4000, 0));
    let committed = sent.clone();

    // Journaled only, on k0..k49: the even keys' events are older than every committed one
    // (with larger values, which must not win), the odd keys' newer; new unique values too.
    let mut lines = Vec::new();
    for j in 0..1000u64 {
        let i = j % 50;
        let key = format!("k{i}");
        let at = if i % 2 == 0 {
            BASE - 1 - rng.below(1000) as i64
        } else {
            BASE + 5000 + rng.below(100) as i64
        };
        let v = format!("{}{}", ["v", "w"][(j % 2) as usize], rng.below(4000));
        lines.push(sent.event("visitors", &key, v, at));
        lines.push(sent.event("peak", &key, rng.value() * 2, at));
        lines.push(sent.event("low", &key, rng.value() * 2, at));
        lines.push(sent.event("gauge", &key, 5_000_000 + rng.value(), at));
    }
    c.send(&buf_of(lines)).await;
    c.send(b"!sync\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    // The journaled events are not in the database yet: only the replay can bring them.
    committed.check(&client, "before the kill").await;
    daemon.kill();
    drop(c);

    let daemon = common::spawn_daemon(&config);
    let mut c = LineClient::connect(&socket).await;
    assert_eq!(flush(&mut c).await, (0, 0));
    sent.check(&client, "after the replay").await;
    // The replay did not roll `last` back: the even keys kept their committed values.
    for i in (0..40).step_by(2) {
        let key = ("gauge".to_string(), format!("k{i}"));
        assert_eq!(sent.keys[&key].value, committed.keys[&key].value);
    }

    // New events after the restart add to the replayed ones; the rollup folds them all.
    let lines = sent.events(&mut rng, 1000, 50, 5000, BASE - 2000, 10_000);
    c.send(&lines).await;
    assert_eq!(flush(&mut c).await, (4000, 0));
    sent.check(&client, "after the restart").await;
    tallyd::rollup::until_empty(&client, 1000).await.unwrap();
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM tallyd.slots").await,
        0
    );
    sent.check(&client, "rolled up").await;
    drop(c);
    assert!(daemon.terminate().success());
    drop(client);
    common::stop_postgres(pg).await;
}

/// kill -9 while flushes commit: each round of every kind is acknowledged by `!sync`, flushes
/// run every 10 ms (and the rollup every 50 ms), and the daemon is killed right after a round's
/// `!sync`, three times over. A flight committed before the kill is not replayed again and one
/// that was not is: every key exact, event counts included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_while_flushing_replays_exactly_once() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let counters = four_kinds();
    let config = daemon_config(dir.path(), &conninfo, counters.clone())
        .with(|c| {
            c.flush.set_interval(Duration::from_millis(10));
            c.flush.connections = 2;
            c.rollup.enabled = true;
            c.rollup.set_interval(Duration::from_millis(50));
            c.rollup.batch_rows = 200;
        })
        .write();
    let socket = dir.path().join("tallyd.sock");
    let client = sql(&conninfo).await;
    let mut sent = Sent::new(&counters);
    let mut rng = Rng::new(2);
    for cycle in 0..3 {
        let daemon = common::spawn_daemon(&config);
        let mut c = LineClient::connect(&socket).await;
        for round in 0..20 {
            // The last round on many keys: its flight is still being written at the kill.
            let (n, keys) = if round == 19 { (5000, 4000) } else { (100, 60) };
            let lines = sent.events(&mut rng, n, keys, 5000, BASE + cycle * 1000, 3000);
            c.send(&lines).await;
            c.send(b"!sync\n").await;
            assert_eq!(c.read_line().await, "ok\n");
        }
        daemon.kill();
        let committed = scalar(
            &client,
            "SELECT coalesce(sum(count), 0)::bigint FROM tallyd.totals",
        )
        .await;
        println!(
            "kill {cycle}: {committed} of {} events committed, the rest journaled",
            sent.total()
        );
    }
    let daemon = common::spawn_daemon(&config);
    let mut c = LineClient::connect(&socket).await;
    assert_eq!(flush(&mut c).await, (0, 0));
    sent.check(&client, "after three kills").await;
    drop(c);
    assert!(daemon.terminate().success());
    drop(client);
    common::stop_postgres(pg).await;
}

/// At the memory cap (`coalesce.max_pending_keys`), reads of every kind are spilled to the
/// journal and folded back into the buckets as flushes make room: every key exact, the values
/// and sketches of spilled lines included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_spilled_at_the_memory_cap_fold_back_exactly() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let counters = four_kinds();
    let config = daemon_config(dir.path(), &conninfo, counters.clone())
        .metrics_port(common::free_port())
        .with(|c| {
            c.coalesce.max_pending_keys = 500;
            c.flush.max_pending_keys = 400;
            c.listen.read_buffer_bytes = 4096;
        })
        .write();
    let daemon = common::spawn_daemon(&config);
    let mut c = LineClient::connect(daemon.socket()).await;
    let mut sent = Sent::new(&counters);
    let mut rng = Rng::new(9);
    for _ in 0..3 {
        let lines = sent.events(&mut rng, 3000, 2000, 5000, BASE, 2000);
        c.send(&lines).await;
        assert_eq!(flush(&mut c).await, (12_000, 0));
    }
    let client = sql(&conninfo).await;
    sent.check(&client, "spilled and folded").await;
    let s = daemon.scrape();
    let (spilled, folded) = (
        s.value("tallyd_journal_spilled_events_total"),
        s.value("tallyd_journal_folded_events_total"),
    );
    assert!(spilled > 1000.0, "the cap spilled only {spilled} events");
    assert_eq!(folded, spilled);
    println!(
        "{spilled} of {} events spilled and folded back",
        sent.total()
    );
    drop(c);
    assert!(daemon.terminate().success());
    drop(client);
    common::stop_postgres(pg).await;
}

// ---------------------------------------------------------------------------------------------
// 2. Backends terminated under load.
// ---------------------------------------------------------------------------------------------

/// Terminates every tallyd session (flushes and rollups) every 50 to 150 ms until `stop`;
/// returns how many it ended.
fn terminator(client: Client, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<i64> {
    tokio::spawn(async move {
        let mut ended = 0;
        let mut rng = Rng::new(7);
        while !stop.load(Ordering::Relaxed) {
            let n: i64 = client
                .query_one(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                     WHERE application_name LIKE 'tallyd-%' AND pid <> pg_backend_pid() \
                       AND backend_type = 'client backend'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            ended += n;
            tokio::time::sleep(Duration::from_millis(50 + rng.below(100))).await;
        }
        ended
    })
}

/// Four connections send rounds of every kind onto shared keys and count a round once `!flush`
/// confirmed it, while the flush and rollup sessions are terminated about every 100 ms: every
/// key is exact afterwards (a retry after a lost COMMIT is not applied twice, not even as an
/// event count).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backends_terminated_under_load_leave_every_kind_exact() {
    let counters = four_kinds();
    let h = Harness::start({
        let counters = counters.clone();
        move |c| {
            c.counters.extend(counters);
            c.flush.set_interval(Duration::from_millis(20));
            c.flush.connections = 2;
            c.rollup.enabled = true;
            c.rollup.set_interval(Duration::from_millis(50));
            c.rollup.batch_rows = 100;
        }
    })
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let killer = terminator(h.sql().await, stop.clone());
    let senders: Vec<_> = (0..4u64)
        .map(|i| {
            let socket = h.socket().to_path_buf();
            let mut sent = Sent::new(&counters);
            tokio::spawn(async move {
                let mut c = LineClient::connect(&socket).await;
                let mut rng = Rng::new(100 + i);
                let started = Instant::now();
                let mut rounds = 0;
                while started.elapsed() < Duration::from_secs(8) {
                    let lines = sent.events(&mut rng, 50, 30, 2000, BASE, 2000);
                    c.send(&lines).await;
                    assert_eq!(flush(&mut c).await, (200, 0));
                    rounds += 1;
                }
                (sent, rounds)
            })
        })
        .collect();
    let mut sent = Sent::new(&counters);
    let mut rounds = 0;
    for s in senders {
        let (theirs, n) = s.await.unwrap();
        sent.merge(&theirs);
        rounds += n;
    }
    stop.store(true, Ordering::Relaxed);
    let kills = killer.await.unwrap();
    assert!(kills > 10, "the terminations must end sessions ({kills})");
    let client = h.sql().await;
    sent.check(&client, "under terminations").await;
    tallyd::rollup::until_empty(&client, 1000).await.unwrap();
    sent.check(&client, "rolled up").await;
    println!(
        "{rounds} rounds, {} events confirmed, {kills} sessions terminated: every kind exact",
        sent.total()
    );
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// 3. PgBouncer in transaction mode.
// ---------------------------------------------------------------------------------------------

/// Makes `bouncer` hand each transaction to another server connection than the one before
/// whenever it can: `pool` server connections opened first (as many sessions at once), and
/// round robin over the idle ones (`server_round_robin`, set through PgBouncer's admin console).
/// A statement prepared in one round trip and run in the next then fails ("prepared statement
/// ... does not exist").
async fn round_robin(bouncer: &Pgbouncer, pool: usize) {
    let admin = sql(&bouncer.url_for("pgbouncer")).await;
    admin
        .simple_query("SET server_round_robin = 1")
        .await
        .unwrap();
    let sessions: Vec<_> = (0..pool)
        .map(|_| {
            let url = bouncer.url();
            tokio::spawn(async move {
                sql(&url)
                    .await
                    .batch_execute("BEGIN; SELECT pg_sleep(0.3); COMMIT")
                    .await
                    .unwrap();
            })
        })
        .collect();
    for s in sessions {
        s.await.unwrap();
    }
}

/// A unique and a last counter through PgBouncer in transaction mode (four server connections
/// for five sessions, handed out round robin, so that consecutive transactions of one session
/// run on different server connections): the start (which creates the view and checks the
/// kinds) and the flushes, every server connection terminated before each flush, the rollup
/// schedule running through the pooler too: exact, and no statement met another session's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_transaction_mode_keeps_unique_and_last_exact() {
    let counters = vec![
        kind_counter("visitors", "unique", ""),
        kind_counter("gauge", "last", ""),
    ];
    let mut h = Harness::start({
        let counters = counters.clone();
        move |c| {
            c.counters.extend(counters);
            c.flush.connections = 4;
            c.rollup.enabled = true;
            c.rollup.set_interval(Duration::from_millis(50));
            c.rollup.batch_rows = 100;
        }
    })
    .await;
    let direct = h.sql().await;
    let bouncer = Pgbouncer::start(h.dir.path(), h.pg.as_ref().unwrap(), "transaction", 4);
    round_robin(&bouncer, 4).await;
    h.stop_daemon().await;
    h.db = db(&bouncer.url());
    h.start_daemon().await;

    let mut c = h.client().await;
    let mut sent = Sent::new(&counters);
    let mut rng = Rng::new(3);
    for round in 0..6 {
        let lines = sent.events(&mut rng, 300, 30, 1500, BASE + round * 100, 500);
        c.send(&lines).await;
        scalar(
            &direct,
            "SELECT count(pg_terminate_backend(pid))::bigint FROM pg_stat_activity \
             WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
        )
        .await;
        assert_eq!(flush(&mut c).await, (600, 0));
    }
    sent.check(&direct, "through PgBouncer").await;
    // The rollup through the pooler, as `tallyd rollup` runs it.
    let pooled = sql(&bouncer.url()).await;
    tallyd::rollup::until_empty(&pooled, 50).await.unwrap();
    assert_eq!(
        scalar(&direct, "SELECT count(*) FROM tallyd.slots").await,
        0
    );
    sent.check(&direct, "rolled up through PgBouncer").await;
    let log = std::fs::read_to_string(h.pg.as_ref().unwrap().log_path()).unwrap();
    let bad: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("prepared statement") || l.contains("portal"))
        .collect();
    assert!(bad.is_empty(), "{bad:#?}");
    drop((c, pooled));
    h.stop_daemon().await;
    drop(bouncer);
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// 4. A shard move.
// ---------------------------------------------------------------------------------------------

/// Every kind over two databases (slot rows and rolled-up rows; a unique counter per day too),
/// then a third database added with `move_shards`: on every database each key is where its
/// shard maps to and exact (sketches unioned, max/min/last merged), a daily key's days union to
/// its all-time sketch, and new events and rollups add to the moved rows exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_move_carries_sketches_and_values_exactly() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfos = common::create_databases(&pg, 3).await;
    let mut counters = four_kinds();
    counters.push(kind_counter(
        "daily_visitors",
        "unique",
        "window = \"day\"\ntime_zone = \"UTC\"\nalso = [\"all\"]",
    ));
    let config = |databases: usize, move_shards: bool| {
        Harness::config_for(dir.path())
            .with(|c| {
                c.database.shards = conninfos[..databases].to_vec();
                c.database.move_shards = move_shards;
                c.counters.extend(counters.clone());
            })
            .build()
    };
    let mut sent = Sent::new(&counters);
    let mut rng = Rng::new(4);
    let two = config(2, false);
    let socket = two.listen.socket().unwrap().to_path_buf();
    let daemon = InProcess::spawn(two);
    let mut c = LineClient::connect(&socket).await;
    // Over three days, for the daily counter.
    let lines = sent.events(&mut rng, 3000, 200, 4000, BASE, 3 * DAY);
    c.send(&lines).await;
    assert_eq!(flush(&mut c).await, (15_000, 0));
    // Part of the rows rolled up on both databases, then more slot rows on top.
    for conninfo in &conninfos[..2] {
        assert!(rollup_step(&sql(conninfo).await, 300).await > 0);
    }
    let lines = sent.events(&mut rng, 2000, 200, 4000, BASE, 3 * DAY);
    c.send(&lines).await;
    assert_eq!(flush(&mut c).await, (10_000, 0));
    drop(c);
    daemon.stop().await.unwrap();

    let three = config(3, true);
    let layout = three.layout();
    InProcess::spawn(three).stop().await.unwrap();
    let sessions = [
        sql(&conninfos[0]).await,
        sql(&conninfos[1]).await,
        sql(&conninfos[2]).await,
    ];
    let clients: Vec<&Client> = sessions.iter().collect();
    let home = |counter: &str, key: &str| {
        layout.database(routing::key_hash(
            routing::counter_seed(counter),
            key.as_bytes(),
        ))
    };
    sent.check_over(&clients, home, "after the move").await;
    days_union_to_all(&clients, "after the move").await;
    let moved = sent
        .keys
        .keys()
        .filter(|(counter, key)| home(counter, key) == 2)
        .count();
    assert!(
        moved > 100,
        "the new database took its share ({moved} keys)"
    );

    // The moved rows take new events, and the rollup folds old and new on every database.
    let daemon = InProcess::spawn(config(3, false));
    let mut c = LineClient::connect(&socket).await;
    let lines = sent.events(&mut rng, 2000, 200, 6000, BASE - DAY, 5 * DAY);
    c.send(&lines).await;
    assert_eq!(flush(&mut c).await, (10_000, 0));
    sent.check_over(&clients, home, "new events after the move")
        .await;
    for client in &clients {
        tallyd::rollup::until_empty(client, 500).await.unwrap();
    }
    sent.check_over(&clients, home, "rolled up after the move")
        .await;
    days_union_to_all(&clients, "rolled up after the move").await;
    drop(c);
    daemon.stop().await.unwrap();
    drop(clients);
    drop(sessions);
    common::stop_postgres(pg).await;
}

/// On every database, each `daily_visitors` key's day sketches union to its all-time sketch.
async fn days_union_to_all(clients: &[&Client], when: &str) {
    for (i, client) in clients.iter().enumerate() {
        let (differ, keys) = common::scalar_pair(
            client,
            "SELECT count(*) FILTER (WHERE d.s IS DISTINCT FROM a.s), count(*) FROM \
             (SELECT key, hll_union_agg(sketch)::text AS s FROM tallyd.unique_totals \
              WHERE counter = 'daily_visitors' AND span = 'day' GROUP BY key) d \
             FULL JOIN (SELECT key, sketch::text AS s FROM tallyd.unique_totals \
                        WHERE counter = 'daily_visitors' AND span = 'all') a USING (key)",
        )
        .await;
        assert_eq!(differ, 0, "{when}: database {i}: of {keys} daily keys");
        assert!(keys > 20, "{when}: database {i} has {keys} daily keys");
    }
}

// ---------------------------------------------------------------------------------------------
// 5. Windows.
// ---------------------------------------------------------------------------------------------

/// A unique counter per UTC day with `also = ["week", "all"]`, ten days over two ISO weeks,
/// sent in three flushes with rollup steps between: each day's sketch is the extension's sketch
/// of that day's values, each week's equals both the union of its days (`hll_union_agg`) and one
/// sketch of the week's values, and the all-time row the sketch of every value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_weeks_sketch_is_the_union_of_its_days() {
    let counter = kind_counter(
        "daily_visitors",
        "unique",
        "window = \"day\"\ntime_zone = \"UTC\"\nalso = [\"week\", \"all\"]",
    );
    let h = Harness::start(move |c| c.counters.push(counter)).await;
    let client = h.sql().await;
    let mut c = h.client().await;
    // Friday 2026-11-20 to Sunday 2026-11-29: three days of the week of 11-16, seven of 11-23.
    let first = unix_ms("2026-11-20T00:00:00Z");
    let weeks = [
        unix_ms("2026-11-16T00:00:00Z"),
        unix_ms("2026-11-23T00:00:00Z"),
    ];
    let week_of = |day: i64| if day < 3 { weeks[0] } else { weeks[1] };
    // Below, at and above the explicit threshold (160 at log2m 11) and well into full sketches.
    let sizes = [5u64, 60, 160, 161, 1500, 30, 700, 2500, 90, 12];
    let mut rng = Rng::new(5);
    let mut days: BTreeMap<i64, (BTreeSet<String>, i64)> = BTreeMap::new();
    let mut lines = Vec::new();
    for (d, n) in sizes.iter().enumerate() {
        let start = first + d as i64 * DAY;
        for _ in 0..*n {
            let value = format!("v{}", rng.below(3000));
            // The first and last millisecond of the day too.
            let at = start + [0, DAY - 1, rng.below(DAY as u64) as i64][rng.below(3) as usize];
            lines.push(format!("daily_visitors home {value} @{at}"));
            let day = days.entry(start).or_default();
            day.0.insert(value);
            day.1 += 1;
        }
    }
    let total = lines.len();
    for (i, part) in lines.chunks(total / 3 + 1).enumerate() {
        c.send(&buf_of(part.iter().cloned())).await;
        assert_eq!(flush(&mut c).await, (part.len() as u64, 0));
        if i < 2 {
            assert!(rollup_step(&client, 7).await > 0);
        }
    }
    let params = (11, 5);
    for (start, (values, events)) in &days {
        let ours = unique_row(&client, "daily_visitors", "home", "day", Some(*start)).await;
        assert_eq!(ours.2, *events, "day {start}: events");
        assert_eq!(
            (ours.0, ours.1),
            sql_sketch(&client, values, params).await,
            "day {start}: {} values",
            values.len()
        );
    }
    let union_of_days = |from: i64, to: i64| {
        let client = &client;
        async move {
            let row = client
                .query_one(
                    "SELECT round(hll_cardinality(hll_union_agg(sketch)))::bigint, \
                            hll_union_agg(sketch)::text FROM tallyd.unique_totals \
                     WHERE counter = 'daily_visitors' AND key = 'home' AND span = 'day' \
                       AND window_start >= 'epoch'::timestamptz + $1::bigint * interval '1 millisecond' \
                       AND window_start < 'epoch'::timestamptz + $2::bigint * interval '1 millisecond'",
                    &[&from, &to],
                )
                .await
                .unwrap();
            (row.get::<_, i64>(0), row.get::<_, String>(1))
        }
    };
    for week in weeks {
        let mut values = BTreeSet::new();
        let mut events = 0;
        for (start, (v, n)) in &days {
            if week_of((start - first) / DAY) == week {
                values.extend(v.iter().cloned());
                events += n;
            }
        }
        let ours = unique_row(&client, "daily_visitors", "home", "week", Some(week)).await;
        assert_eq!(ours.2, events, "week {week}: events");
        let days_union = union_of_days(week, week + 7 * DAY).await;
        assert_eq!(
            (ours.0, ours.1.clone()),
            days_union,
            "week {week}: the union of its days"
        );
        assert_eq!(
            days_union,
            sql_sketch(&client, &values, params).await,
            "week {week}: one sketch of its {} values",
            values.len()
        );
    }
    let all: BTreeSet<String> = days.values().flat_map(|(v, _)| v.iter().cloned()).collect();
    let ours = unique_row(&client, "daily_visitors", "home", "all", None).await;
    assert_eq!(ours.2, total as i64);
    assert_eq!(
        (ours.0, ours.1.clone()),
        union_of_days(first, first + 10 * DAY).await
    );
    assert_eq!((ours.0, ours.1), sql_sketch(&client, &all, params).await);
    drop(c);
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// 6. Accuracy.
// ---------------------------------------------------------------------------------------------

/// A million distinct values into one key, over ten flushes, a rollup step and a restart: the
/// cardinality is within 3 standard errors (1.04 / sqrt(2^11)) of the exact count, and the
/// sketch is the one SQL builds from the same values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_distinct_values_within_three_standard_errors() {
    const N: u64 = 1_000_000;
    let mut h = Harness::start(|c| c.counters.push(kind_counter("uniq", "unique", ""))).await;
    let client = h.sql().await;
    let started = Instant::now();
    let mut c = h.client().await;
    for part in 0..10 {
        let lines: String = (part * N / 10..(part + 1) * N / 10)
            .map(|i| format!("uniq page u{i}\n"))
            .collect();
        c.send(lines.as_bytes()).await;
        assert_eq!(flush(&mut c).await, (N / 10, 0));
        if part == 4 {
            assert!(rollup_step(&client, 1000).await > 0);
            drop(c);
            h.stop_daemon().await;
            h.start_daemon().await;
            c = h.client().await;
        }
    }
    let elapsed = started.elapsed();
    let ours = unique_row(&client, "uniq", "page", "all", None).await;
    let theirs = client
        .query_one(
            "SELECT round(hll_cardinality(s))::bigint, s::text FROM \
             (SELECT hll_add_agg(hll_hash_text('u' || i)) AS s \
              FROM generate_series(0, $1::bigint - 1) i) x",
            &[&(N as i64)],
        )
        .await
        .unwrap();
    let error = (ours.0 as f64 - N as f64).abs() / N as f64;
    let bound = 3.0 * 1.04 / 2048f64.sqrt();
    println!(
        "{N} distinct values in {:.1}s: cardinality {} (relative error {:.4}, bound {bound:.4})",
        elapsed.as_secs_f64(),
        ours.0,
        error
    );
    assert!(error <= bound, "relative error {error} over {bound}");
    assert_eq!(ours.2, N as i64);
    assert_eq!(
        (ours.0, ours.1),
        (theirs.get(0), theirs.get(1)),
        "the sketch SQL builds of the same values"
    );
    drop(c);
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// 7. Refusals at start.
// ---------------------------------------------------------------------------------------------

/// [`daemon_config`] as it is, written as `dir/<name>.toml` (its log goes to `dir/<name>.log`).
fn binary_config(dir: &Path, conninfo: &str, counters: Vec<CounterConfig>, name: &str) -> PathBuf {
    daemon_config(dir, conninfo, counters).write_as(&format!("{name}.toml"))
}

/// Starts `tallyd run` on `config`: the daemon once it answers, or its log if it exited first.
fn start(config: &Path) -> Result<Daemon, String> {
    Daemon::try_spawn_with(Path::new(common::BIN), config, |_| {})
}

/// Asserts that `tallyd run` on `config` refuses to start, and returns the error it printed
/// (its line `tallyd: ...`).
fn refused(config: &Path) -> String {
    if let Ok(daemon) = start(config) {
        assert!(daemon.terminate().success());
        panic!("{} started, where it must be refused", config.display());
    }
    // The log is copied from the daemon's stderr by a thread of the test kit, which may not
    // have written the last line yet when the exit is seen.
    let path = config.with_extension("log");
    let deadline = Instant::now() + Duration::from_secs(10);
    let error = loop {
        let log = std::fs::read_to_string(&path).unwrap_or_default();
        if let Some(error) = log.lines().find_map(|l| l.strip_prefix("tallyd: ")) {
            break error.to_string();
        }
        assert!(Instant::now() < deadline, "no error printed:\n{log}");
        std::thread::sleep(Duration::from_millis(20));
    };
    println!("{}: {error}", config.display());
    assert!(!error.contains(".."), "{error}");
    error
}

/// On a database where tallyd's role may not `CREATE EXTENSION hll` (a role that is not a
/// superuser, owning its database), a unique counter refuses the start, naming the counter and
/// the statement; only sum counters start and count; once an administrator has created the
/// extension there, the unique counter starts and counts as the extension does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unique_counter_needs_the_extension_and_only_it_does() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let admin = sql(&pg.connection_string("postgres")).await;
    for statement in ["CREATE ROLE app LOGIN", "CREATE DATABASE appdb OWNER app"] {
        admin.batch_execute(statement).await.unwrap();
    }
    let conninfo = pg
        .connection_string("appdb")
        .replace("user=postgres", "user=app");
    let app = sql(&conninfo).await;
    let sums = vec![common::counter(
        "downloads",
        tallyd::config::KeyTypeName::Text,
    )];
    let mut with_unique = sums.clone();
    with_unique.push(kind_counter("visitors", "unique", ""));

    let log = refused(&binary_config(
        dir.path(),
        &conninfo,
        with_unique.clone(),
        "unique-1",
    ));
    assert!(
        log.contains("counter visitors") && log.contains("CREATE EXTENSION hll"),
        "{log}"
    );
    let installed = "SELECT count(*) FROM pg_extension WHERE extname = 'hll'";
    assert_eq!(scalar(&app, installed).await, 0);

    let sums_only = binary_config(dir.path(), &conninfo, sums, "sums");
    let daemon = start(&sums_only).expect("only sum counters start without the extension");
    let mut c = LineClient::connect(daemon.socket()).await;
    c.send(b"downloads report.pdf 3\n").await;
    assert_eq!(flush(&mut c).await, (1, 0));
    drop(c);
    assert!(daemon.terminate().success());
    assert_eq!(common::key_total(&app, "downloads", "report.pdf").await, 3);
    assert_eq!(scalar(&app, installed).await, 0);
    // Still refused, now that tallyd's schema is there.
    let log = refused(&binary_config(
        dir.path(),
        &conninfo,
        with_unique.clone(),
        "unique-2",
    ));
    assert!(log.contains("counter visitors"), "{log}");

    // The statement the message names, run by an administrator.
    sql(&pg.connection_string("appdb"))
        .await
        .batch_execute("CREATE EXTENSION hll")
        .await
        .unwrap();
    let daemon = start(&binary_config(
        dir.path(),
        &conninfo,
        with_unique.clone(),
        "unique-3",
    ))
    .expect("a unique counter starts once the extension exists");
    let mut sent = Sent::new(&with_unique);
    let mut c = LineClient::connect(daemon.socket()).await;
    let lines = sent.events(&mut Rng::new(6), 500, 5, 400, BASE, 1000);
    c.send(&lines).await;
    assert_eq!(flush(&mut c).await, (500, 0));
    sent.check(&app, "with the extension").await;
    drop(c);
    assert!(daemon.terminate().success());
    drop((app, admin));
    common::stop_postgres(pg).await;
}

/// `counters` with `name` declared again as `kind` (with `extra` keys).
fn redeclared(
    counters: &[CounterConfig],
    name: &str,
    kind: &str,
    extra: &str,
) -> Vec<CounterConfig> {
    counters
        .iter()
        .map(|c| {
            if c.name == name {
                kind_counter(name, kind, extra)
            } else {
                c.clone()
            }
        })
        .collect()
}

/// A counter whose kind or sketch precision changes between starts while rows of it remain is
/// refused with a message naming the counter, what it was and what it is now, and nothing
/// changes; with its rows deleted, the change is accepted and the counter counts by its new
/// kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_kind_or_precision_is_refused_while_rows_remain() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let client = sql(&conninfo).await;
    let counters = vec![
        common::counter("downloads", tallyd::config::KeyTypeName::Text),
        kind_counter("peak", "max", ""),
        kind_counter("visitors", "unique", ""),
    ];
    let config = binary_config(dir.path(), &conninfo, counters.clone(), "first");
    let daemon = start(&config).unwrap();
    let mut c = LineClient::connect(daemon.socket()).await;
    c.send(b"downloads a 5\npeak k 7\npeak k -3\nvisitors k x\nvisitors k y\n")
        .await;
    assert_eq!(flush(&mut c).await, (5, 0));
    drop(c);
    assert!(daemon.terminate().success());

    let cases = [
        (
            redeclared(&counters, "peak", "min", ""),
            ["counter peak is declared min", "its rows in the database hold max rows"],
        ),
        (
            redeclared(&counters, "visitors", "unique", "log2m = 12"),
            [
                "counter visitors is declared unique (log2m 12, regwidth 5)",
                "hold sketches of log2m 11, regwidth 5: sketches of different parameters cannot be unioned",
            ],
        ),
        (
            redeclared(&counters, "visitors", "unique", "regwidth = 4"),
            ["declared unique (log2m 11, regwidth 4)", "hold sketches of log2m 11, regwidth 5"],
        ),
        (
            redeclared(&counters, "visitors", "last", ""),
            ["counter visitors is declared last", "hold unique rows"],
        ),
        (
            redeclared(&counters, "downloads", "max", ""),
            ["counter downloads is declared max", "hold sum rows: sums are not values"],
        ),
    ];
    for (i, (changed, said)) in cases.into_iter().enumerate() {
        let log = refused(&binary_config(
            dir.path(),
            &conninfo,
            changed,
            &format!("changed-{i}"),
        ));
        for s in said {
            assert!(log.contains(s), "case {i}: {s:?} not in\n{log}");
        }
    }
    let mut sent = Sent::new(&counters);
    sent.event("peak", "k", 7, 0);
    sent.event("peak", "k", -3, 0);
    sent.event("visitors", "k", "x", 0);
    sent.event("visitors", "k", "y", 0);
    sent.check(&client, "after the refusals").await;

    // With their rows deleted, peak becomes a min and visitors takes log2m 12.
    client
        .batch_execute(
            "DELETE FROM tallyd.slots WHERE counter IN ('peak', 'visitors'); \
             DELETE FROM tallyd.rollups WHERE counter IN ('peak', 'visitors')",
        )
        .await
        .unwrap();
    let changed = redeclared(
        &redeclared(&counters, "peak", "min", ""),
        "visitors",
        "unique",
        "log2m = 12",
    );
    let daemon = start(&binary_config(
        dir.path(),
        &conninfo,
        changed.clone(),
        "accepted",
    ))
    .expect("a change with no rows is accepted");
    let mut sent = Sent::new(&changed);
    let mut c = LineClient::connect(daemon.socket()).await;
    let lines = sent.events(&mut Rng::new(8), 400, 3, 1000, BASE, 100);
    c.send(&lines).await;
    assert_eq!(flush(&mut c).await, (800, 0));
    sent.check(&client, "after the accepted change").await;
    drop(c);
    assert!(daemon.terminate().success());
    // And the check follows the rows: going back is a change again.
    let log = refused(&binary_config(dir.path(), &conninfo, counters, "back"));
    assert!(log.contains("hold min rows"), "{log}");
    drop(client);
    common::stop_postgres(pg).await;
}

/// Rows an older tallyd (before counter kinds, migrations up to V11) wrote are sums: a start
/// that declares their counter another kind is refused, as if the sum had been recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sums_written_before_kinds_existed_refuse_another_kind() {
    let dir = temp_dir();
    let pg = common::postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let mut client = sql(&conninfo).await;
    tallyd::store::migrate_up_to(&mut client, 11).await.unwrap();
    client
        .batch_execute(
            "INSERT INTO tallyd.slots (counter, key, slot, count, first_seen, last_seen)
             VALUES ('downloads', 'a', 0, 42, now(), now())",
        )
        .await
        .unwrap();
    let counters = vec![kind_counter("downloads", "max", "")];
    let log = refused(&binary_config(dir.path(), &conninfo, counters, "upgraded"));
    assert!(
        log.contains("counter downloads is declared max") && log.contains("hold sum rows"),
        "{log}"
    );
    // Declared a sum, as it was, it starts and goes on counting.
    let sums = vec![common::counter(
        "downloads",
        tallyd::config::KeyTypeName::Text,
    )];
    let daemon = start(&binary_config(dir.path(), &conninfo, sums, "as-before")).unwrap();
    let mut c = LineClient::connect(daemon.socket()).await;
    c.send(b"downloads a 8\n").await;
    assert_eq!(flush(&mut c).await, (1, 0));
    drop(c);
    assert!(daemon.terminate().success());
    assert_eq!(common::key_total(&client, "downloads", "a").await, 50);
    drop(client);
    common::stop_postgres(pg).await;
}
