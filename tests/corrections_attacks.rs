//! Attacks on the corrections (`!set`, `!forget`; issue 26) against real PostgreSQL, each with
//! exact expectations the test derives from its own ordering through the daemon's replies:
//! a `!set` at a random moment among increments from several connections, decoded exactly from
//! power-of-two batch sums; the same with kill -9 right after the set's answer; flush backends
//! terminated while sets and forgets run under load; forgets around kill -9 with the key's old
//! increments in the journal; sets beside a rollup loop; PgBouncer in transaction mode; hostile
//! input (64-bit bounds, keys no counter takes, the datagram socket, a counter a reload removed).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::netpg::Pgbouncer;
use common::{
    buf_of, counts, db, free_port, http_get, key_total, postgres, scalar, spawn_daemon, sql,
    temp_dir, Daemon, Harness, LineClient, TestConfig,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::sync::watch;
use tokio_postgres::Client;

// ---------------------------------------------------------------------------------------------
// The race: connections add batches to one key while another connection sets it.
// ---------------------------------------------------------------------------------------------

/// Connections adding to the raced key.
const CONNS: usize = 4;
/// Batch `j` (from `FIRST_BIT` to `LAST_BIT`) is `LINES` lines of `2^(j - 6)`: its sum `2^j` is
/// one bit of the key's total, so the total less the set's value (below `2^FIRST_BIT`) names
/// exactly the batches counted after the set. The bits sum below `2^62`: no overflow.
const FIRST_BIT: u32 = 6;
const LAST_BIT: u32 = 61;
const LINES: usize = 64;

/// What acknowledges a batch.
#[derive(Clone, Copy, Debug)]
enum Ack {
    /// `!flush`: committed.
    Flush,
    /// `!flush` or `!sync` (journaled, maybe not committed) at random until the set's `ok`,
    /// then `!sync` only: what comes after the set is in the journal, not committed.
    Mixed,
}

/// One batch as its connection saw it: tickets from one counter shared by every task of the
/// race, taken before the batch was written and after its acknowledgement was read.
#[derive(Debug)]
struct Batch {
    conn: usize,
    bit: u32,
    sent: u64,
    /// `None`: the daemon died before acknowledging it.
    acked: Option<u64>,
}

#[derive(Debug)]
struct Race {
    batches: Vec<Batch>,
    value: i64,
    /// Tickets taken before the `!set` was written and after its `ok` was read.
    set_sent: u64,
    set_ok: u64,
}

#[derive(Clone, Copy)]
struct RaceOptions {
    ack: Ack,
    /// Each connection stops after this many batches begun after the set's `ok`.
    after_set: Option<usize>,
    /// kill -9 this pid as soon as the set's `ok` is read.
    kill_at_ok: Option<u32>,
}

/// A stream connection that tells a daemon's death (end of stream, reset) from an answer.
struct Conn {
    rd: BufReader<tokio::net::unix::OwnedReadHalf>,
    wr: tokio::net::unix::OwnedWriteHalf,
}

impl Conn {
    async fn connect(socket: &Path) -> Conn {
        let (rd, wr) = UnixStream::connect(socket)
            .await
            .expect("connect to tallyd")
            .into_split();
        Conn {
            rd: BufReader::new(rd),
            wr,
        }
    }

    /// Writes `bytes` and reads one reply line; `None` once the daemon is gone.
    async fn ask(&mut self, bytes: &[u8]) -> Option<String> {
        self.wr.write_all(bytes).await.ok()?;
        let mut line = String::new();
        match self.rd.read_line(&mut line).await {
            Ok(n) if n > 0 => Some(line),
            _ => None,
        }
    }
}

fn race_line(key: &str, delta: i64) -> String {
    format!("downloads {key} {delta}")
}

/// Adds this connection's batches (every `CONNS`th bit from `FIRST_BIT + conn`) to `key`, one
/// at a time, each written with its acknowledgement request and answered before the next.
#[allow(clippy::too_many_arguments)]
async fn add_batches(
    socket: PathBuf,
    key: String,
    conn: usize,
    options: RaceOptions,
    seed: u64,
    tickets: Arc<AtomicU64>,
    set_ok: Arc<AtomicU64>,
    acks: Arc<watch::Sender<usize>>,
) -> Vec<Batch> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut c = Conn::connect(&socket).await;
    let mut out = Vec::new();
    let mut after = 0;
    // Lines since the last `!flush` (a `!sync` does not end its period).
    let mut period = 0;
    for bit in (FIRST_BIT + conn as u32..=LAST_BIT).step_by(CONNS) {
        let sent = tickets.fetch_add(1, SeqCst);
        let after_set = set_ok.load(SeqCst) < sent;
        if let (Some(limit), true) = (options.after_set, after_set) {
            after += 1;
            if after > limit {
                break;
            }
        }
        let delta = 1i64 << (bit - FIRST_BIT);
        let mut lines = buf_of((0..LINES).map(|_| race_line(&key, delta)));
        let flush = match options.ack {
            Ack::Flush => true,
            Ack::Mixed => !after_set && rng.gen(),
        };
        lines.extend_from_slice(if flush { b"!flush\n" } else { b"!sync\n" });
        let reply = c.ask(&lines).await;
        let acked = reply.is_some().then(|| tickets.fetch_add(1, SeqCst));
        out.push(Batch {
            conn,
            bit,
            sent,
            acked,
        });
        let Some(reply) = reply else {
            break;
        };
        period += LINES;
        let expected = if flush {
            format!("ok {} 0\n", std::mem::take(&mut period))
        } else {
            "ok\n".to_string()
        };
        assert_eq!(reply, expected, "connection {conn}, batch {bit}");
        acks.send_modify(|n| *n += 1);
    }
    out
}

/// One race on `key`: `CONNS` connections add their batches while another connection sets the
/// key to a random value below `2^FIRST_BIT` once a random number of batches is acknowledged.
async fn race(socket: &Path, key: &str, options: RaceOptions, rng: &mut StdRng) -> Race {
    race_on(&[socket], socket, key, options, rng).await
}

/// A race whose adders connect to `adders` in turn (instances writing the same database) and
/// whose setter connects to `setter`.
async fn race_on(
    adders: &[&Path],
    setter: &Path,
    key: &str,
    options: RaceOptions,
    rng: &mut StdRng,
) -> Race {
    let tickets = Arc::new(AtomicU64::new(0));
    let set_ok = Arc::new(AtomicU64::new(u64::MAX));
    let (acks, mut acked) = watch::channel(0usize);
    let acks = Arc::new(acks);
    let adders: Vec<_> = (0..CONNS)
        .map(|conn| {
            tokio::spawn(add_batches(
                adders[conn % adders.len()].to_path_buf(),
                key.to_string(),
                conn,
                options,
                rng.gen(),
                tickets.clone(),
                set_ok.clone(),
                acks.clone(),
            ))
        })
        .collect();
    drop(acks);
    let value: i64 = rng.gen_range(0..1 << FIRST_BIT);
    let batches = (LAST_BIT - FIRST_BIT + 1) as usize;
    let at = rng.gen_range(0..batches);
    let mut setter = Conn::connect(setter).await;
    // Ends early (Err) only when every adder is done: the set then comes after all of them.
    let _ = acked.wait_for(|n| *n >= at).await;
    let set_sent = tickets.fetch_add(1, SeqCst);
    let reply = setter
        .ask(format!("!set downloads {key} {value}\n").as_bytes())
        .await;
    let ok = tickets.fetch_add(1, SeqCst);
    assert_eq!(reply.as_deref(), Some("ok\n"), "the set of {key}");
    set_ok.store(ok, SeqCst);
    if let Some(pid) = options.kill_at_ok {
        // SAFETY: kill(2) of the test's own child, not yet reaped.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    }
    let mut all = Vec::new();
    for adder in adders {
        all.extend(adder.await.expect("adder"));
    }
    Race {
        batches: all,
        value,
        set_sent,
        set_ok: ok,
    }
}

/// Decodes `total` and checks it against the race's order: every batch acknowledged before the
/// set was written is superseded, every acknowledged batch written after the set's `ok` is
/// counted, each connection's counted batches are a suffix of its acknowledged ones, and
/// nothing else is in the total. Returns how many batches were in flight during the set (the
/// ones the order leaves to the daemon).
fn check(race: &Race, total: i64, what: &str) -> usize {
    let rest = total - race.value;
    assert!(
        rest >= 0 && rest % (1 << FIRST_BIT) == 0,
        "{what}: total {total} is not the set's {} plus whole batches",
        race.value
    );
    let counted = |bit: u32| rest >> bit & 1 == 1;
    let sent: i64 = race.batches.iter().map(|b| 1i64 << b.bit).sum();
    assert_eq!(rest & !sent, 0, "{what}: bits of batches never sent");
    let mut in_flight = 0;
    for b in &race.batches {
        let c = counted(b.bit);
        let Some(acked) = b.acked else {
            continue;
        };
        if acked < race.set_sent {
            assert!(
                !c,
                "{what}: batch 2^{} of connection {} was acknowledged before the set was sent, yet it counts ({race:?})",
                b.bit, b.conn
            );
        } else if b.sent > race.set_ok {
            assert!(
                c,
                "{what}: batch 2^{} of connection {} was sent after the set's ok, yet it is superseded ({race:?})",
                b.bit, b.conn
            );
        } else {
            in_flight += 1;
        }
    }
    for conn in 0..CONNS {
        let flags: Vec<bool> = race
            .batches
            .iter()
            .filter(|b| b.conn == conn && b.acked.is_some())
            .map(|b| counted(b.bit))
            .collect();
        assert!(
            flags.windows(2).all(|w| !w[0] || w[1]),
            "{what}: connection {conn}'s counted batches are not a suffix: {flags:?}"
        );
    }
    in_flight
}

fn seeded() -> StdRng {
    let seed: u64 = std::env::var("TALLYD_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("seed {seed} (TALLYD_TEST_SEED={seed} repeats this run)");
    StdRng::seed_from_u64(seed)
}

/// Rows of `key` in `counter` anywhere tallyd keeps them.
async fn rows_of(client: &Client, counter: &str, key: &str) -> i64 {
    client
        .query_one(
            "SELECT (SELECT count(*) FROM tallyd.slots WHERE counter = $1 AND key = $2) \
                  + (SELECT count(*) FROM tallyd.rollups WHERE counter = $1 AND key = $2) \
                  + (SELECT count(*) FROM tallyd.rollup_rejects WHERE counter = $1 AND key = $2)",
            &[&counter, &key],
        )
        .await
        .unwrap()
        .get(0)
}

async fn total_of(client: &Client, counter: &str, key: &str) -> Option<i64> {
    client
        .query_opt(
            "SELECT count FROM tallyd.totals WHERE counter = $1 AND key = $2",
            &[&counter, &key],
        )
        .await
        .unwrap()
        .and_then(|r| r.get(0))
}

// ---------------------------------------------------------------------------------------------
// 1. The issue's main test.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_among_concurrent_increments_supersedes_exactly_what_came_before_it() {
    let h = Harness::start(|c| c.flush.connections = 2).await;
    let client = h.sql().await;
    let mut rng = seeded();
    let options = RaceOptions {
        ack: Ack::Flush,
        after_set: None,
        kill_at_ok: None,
    };
    let mut in_flight = 0;
    for round in 0..8 {
        let key = format!("race{round}");
        let race = race(h.socket(), &key, options, &mut rng).await;
        assert!(race.batches.iter().all(|b| b.acked.is_some()));
        let total = key_total(&client, "downloads", &key).await;
        in_flight += check(&race, total, &format!("round {round}"));
    }
    println!("{in_flight} batches were in flight during a set");
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// 2. kill -9 right after the set's answer.
// ---------------------------------------------------------------------------------------------

/// A daemon on `conninfo` with its journal, two flush connections, flushing every `flush_every`.
fn journaled_config(dir: &Path, conninfo: &str, flush_every: Duration) -> PathBuf {
    journaled_config_with(dir, conninfo, flush_every, 2)
}

/// `journaled_config` with `connections` flush connections (another layout of the journal).
fn journaled_config_with(
    dir: &Path,
    conninfo: &str,
    flush_every: Duration,
    connections: usize,
) -> PathBuf {
    child_config(dir, conninfo, "attacks")
        .with(|c| {
            c.flush.connections = connections;
            c.flush.set_interval(flush_every);
            c.flush.set_retry_initial(Duration::from_millis(20));
            c.flush.set_retry_max(Duration::from_millis(500));
        })
        .write()
}

/// The config of a `tallyd run` child in `dir` on `conninfo`: the standard counters, instance
/// `id`, no datagram socket, no rollup schedule.
fn child_config(dir: &Path, conninfo: &str, id: &str) -> TestConfig {
    TestConfig::new(dir)
        .database_url(conninfo)
        .standard_counters()
        .with(|c| {
            c.daemon.set_instance_id(Some(id.into()));
            c.listen.set_datagram_socket(None);
            c.rollup.enabled = false;
        })
}

/// Each round: a race whose batches are acknowledged by `!flush` or `!sync`; then kill -9,
/// either the moment the set's `ok` is read (batches in flight die with the daemon) or once
/// every connection has had two more batches acknowledged after it; then a restart, whose
/// replay must neither bring back what the set superseded nor apply the set again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_right_after_a_set_is_answered_loses_and_doubles_nothing() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    // Rarely by the timer within a round: what is only `!sync`ed at the kill is replayed.
    let config = journaled_config(dir.path(), &conninfo, Duration::from_secs(1));
    let client = sql(&conninfo).await;
    let socket = dir.path().join("tallyd.sock");
    let mut rng = seeded();
    let mut daemon = spawn_daemon(&config);
    let mut in_flight = 0;
    for round in 0..4 {
        let key = format!("killed{round}");
        let at_once = round % 2 == 0;
        let options = RaceOptions {
            ack: Ack::Mixed,
            after_set: Some(if at_once { 0 } else { 2 }),
            kill_at_ok: at_once.then(|| daemon.pid()),
        };
        let race = race(&socket, &key, options, &mut rng).await;
        daemon.kill();
        daemon = spawn_daemon(&config);
        let total = key_total(&client, "downloads", &key).await;
        in_flight += check(&race, total, &format!("round {round}"));
        // A second crash right after the replay changes nothing.
        daemon.kill();
        daemon = spawn_daemon(&config);
        assert_eq!(key_total(&client, "downloads", &key).await, total);
    }
    println!("{in_flight} batches were in flight during a set");
    for line in daemon
        .log()
        .lines()
        .filter(|l| l.contains("replaying the journal"))
    {
        println!("{line}");
    }
    daemon.terminate();
}

// ---------------------------------------------------------------------------------------------
// 3. Flush backends terminated while sets and forgets run under load.
// ---------------------------------------------------------------------------------------------

/// The expected state of one connection's keys: `None` for a key with no rows.
type Model = BTreeMap<(&'static str, String), Option<i64>>;

/// Sends random increments, sets and forgets of its own keys (`downloads` and `views` keys
/// `base..base + 5`, so `!forget *` takes both counters) until `stop`, each read ended by
/// `!flush`; returns what the totals must be, following its own order.
async fn corrections_under_load(
    socket: PathBuf,
    base: u32,
    seed: u64,
    stop: Arc<AtomicBool>,
) -> (Model, u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut c = LineClient::connect(&socket).await;
    let mut model = Model::new();
    let mut corrections = 0;
    while !stop.load(SeqCst) {
        let mut lines = Vec::new();
        let mut answers = 0;
        let mut events = 0;
        for _ in 0..rng.gen_range(1..40) {
            let n = base + rng.gen_range(0..5);
            let counter = if rng.gen() { "downloads" } else { "views" };
            let slot = model.entry((counter, n.to_string())).or_insert(None);
            match rng.gen_range(0..100) {
                0..=3 => {
                    let v: i64 = rng.gen_range(-1000..1000);
                    lines.push(format!("!set {counter} {n} {v}"));
                    *slot = Some(v);
                    answers += 1;
                }
                4..=5 => {
                    lines.push(format!("!forget {counter} {n}"));
                    *slot = None;
                    answers += 1;
                }
                6 => {
                    lines.push(format!("!forget * {n}"));
                    for counter in ["downloads", "views"] {
                        model.insert((counter, n.to_string()), None);
                    }
                    answers += 1;
                }
                _ => {
                    let d: i64 = rng.gen_range(-5..20);
                    lines.push(format!("{counter} {n} {d}"));
                    *slot = Some(slot.unwrap_or(0) + d);
                    events += 1;
                }
            }
        }
        lines.push("!flush".into());
        c.send(&buf_of(lines)).await;
        for _ in 0..answers {
            assert_eq!(c.read_line().await, "ok\n");
        }
        // The corrections answered above were flushes too: only the events since the last one
        // are told here, and this read's last correction may come after every event.
        let (accepted, rejected) = flush_answer(&mut c).await;
        assert_eq!(rejected, 0);
        assert!(accepted <= events);
        corrections += answers;
    }
    (model, corrections)
}

/// Reads the answer of a `!flush` already sent.
async fn flush_answer(c: &mut LineClient) -> (u64, u64) {
    let line = c.read_line().await;
    let f: Vec<&str> = line.trim_end().split(' ').collect();
    assert!(f.len() == 3 && f[0] == "ok", "unexpected reply {line:?}");
    (f[1].parse().unwrap(), f[2].parse().unwrap())
}

/// Terminates every tallyd session every ~100 ms until `stop`; returns how many it ended.
fn terminator(client: Client, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<i64> {
    tokio::spawn(async move {
        let mut ended = 0;
        let mut rng = StdRng::from_entropy();
        while !stop.load(SeqCst) {
            ended += scalar(
                &client,
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE application_name LIKE 'tallyd-%' AND pid <> pg_backend_pid() \
                   AND backend_type = 'client backend'",
            )
            .await;
            tokio::time::sleep(Duration::from_millis(rng.gen_range(50..150))).await;
        }
        ended
    })
}

async fn assert_model(client: &Client, models: &[Model]) {
    for counter in ["downloads", "views"] {
        let expected: Vec<(String, i64)> = models
            .iter()
            .flat_map(|m| m.iter())
            .filter(|((c, _), v)| *c == counter && v.is_some())
            .map(|((_, k), v)| (k.clone(), v.unwrap()))
            .collect::<BTreeMap<_, _>>()
            .into_iter()
            .collect();
        assert_eq!(counts(client, counter).await, expected, "{counter}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sets_and_forgets_are_exact_while_flush_backends_are_terminated() {
    let h = Harness::start(|c| {
        c.flush.connections = 2;
        c.flush.set_interval(Duration::from_millis(20));
        c.rollup.enabled = true;
        c.rollup.set_interval(Duration::from_millis(50));
        c.rollup.batch_rows = 20;
    })
    .await;
    let mut rng = seeded();
    let stop = Arc::new(AtomicBool::new(false));
    let killer = terminator(h.sql().await, stop.clone());
    let senders: Vec<_> = (0..3)
        .map(|i| {
            tokio::spawn(corrections_under_load(
                h.socket().to_path_buf(),
                100 * (i + 1),
                rng.gen(),
                stop.clone(),
            ))
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(8)).await;
    stop.store(true, SeqCst);
    let mut models = Vec::new();
    let mut corrections = 0;
    for s in senders {
        let (model, n) = s.await.unwrap();
        models.push(model);
        corrections += n;
    }
    let kills = killer.await.unwrap();
    assert!(kills > 10, "the terminations must happen ({kills})");
    assert!(corrections > 20, "corrections must run ({corrections})");
    let client = h.sql().await;
    assert_model(&client, &models).await;
    println!("{corrections} corrections, {kills} backends terminated, totals exact");
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// 4. Forget and kill -9, with the key's old increments still in the journal.
// ---------------------------------------------------------------------------------------------

const GONE: &str = "10.0.0.1";

/// The keys besides the forgotten one, with what each must total.
struct Others(Vec<(&'static str, &'static str, i64)>);

impl Others {
    fn lines(&mut self, n: usize) -> Vec<String> {
        let mut out = Vec::new();
        for (counter, key, total) in &mut self.0 {
            for _ in 0..n {
                out.push(format!("{counter} {key} 3"));
                *total += 3;
            }
        }
        out
    }

    async fn assert(&self, client: &Client, what: &str) {
        for (counter, key, total) in &self.0 {
            assert_eq!(
                total_of(client, counter, key).await,
                Some(*total),
                "{what}: {counter} {key}"
            );
        }
    }
}

async fn assert_gone(client: &Client, what: &str) {
    for counter in ["ips", "downloads"] {
        assert_eq!(rows_of(client, counter, GONE).await, 0, "{what}: {counter}");
    }
}

/// Old increments of the key, committed and only journaled, then `!forget * <key>` with kill -9
/// at several points: before its answer while its flush waits on a lock (its record journaled,
/// the flush's backend terminated too, or left to end by itself), right after its answer, and at
/// once after it was written; each restart replays a journal holding the old increments, and
/// the key stays gone (or, where the forget died unanswered, holds exactly its old total).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_key_stays_gone_through_kill_9_at_every_point() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    // Nothing commits unless a `!flush` or a correction asks.
    let config = journaled_config(dir.path(), &conninfo, Duration::from_secs(600));
    let client = sql(&conninfo).await;
    let socket = dir.path().join("tallyd.sock");
    let mut others = Others(vec![
        ("ips", "10.0.0.2", 0),
        ("downloads", "10.0.0.2", 0),
        ("downloads", "other", 0),
    ]);
    let mut daemon = spawn_daemon(&config);

    // Old increments: committed, then only journaled.
    let old = |n: usize| -> Vec<String> {
        (0..n)
            .flat_map(|_| [format!("ips {GONE} 2"), format!("downloads {GONE} 5")])
            .collect()
    };
    let mut c = LineClient::connect(&socket).await;
    for sync in [false, true] {
        let mut lines = old(50);
        lines.extend(others.lines(20));
        c.send(&buf_of(lines)).await;
        if sync {
            c.send(b"!sync\n").await;
            assert_eq!(c.read_line().await, "ok\n");
        } else {
            assert_eq!(c.flush().await, (160, 0));
        }
    }

    for terminate in [true, false] {
        // Left alone, the backend runs the flush's pipelined statements once the lock is gone,
        // and PostgreSQL ends it when it cannot answer ("connection to client lost").
        let what = if terminate {
            "unanswered, its flush's backend terminated"
        } else {
            "unanswered, its flush's backend left to end by itself"
        };
        // The forget's flush waits on a lock; its record is journaled and synced.
        let mut locker = sql(&conninfo).await;
        let tx = locker.transaction().await.unwrap();
        tx.batch_execute("LOCK TABLE tallyd.slots IN SHARE MODE")
            .await
            .unwrap();
        c.send(format!("!forget * {GONE}\n").as_bytes()).await;
        wait_for_correct_on_lock(&client).await;
        let mut s = LineClient::connect(&socket).await;
        s.send(b"!sync\n").await;
        assert_eq!(s.read_line().await, "ok\n");
        daemon.kill();
        if terminate {
            scalar(
                &client,
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE application_name LIKE 'tallyd-%' AND pid <> pg_backend_pid()",
            )
            .await;
        }
        tx.rollback().await.unwrap();
        if !terminate {
            // Under another layout: the start rewrites the journal's uncovered lines, the
            // forget among them, for three writers before it replays them.
            journaled_config_with(dir.path(), &conninfo, Duration::from_secs(600), 3);
        }
        daemon = spawn_daemon(&config);
        assert_gone(&client, what).await;
        others.assert(&client, what).await;
        // The old increments again, for the next point.
        c = LineClient::connect(&socket).await;
        let mut lines = old(30);
        lines.extend(others.lines(10));
        c.send(&buf_of(lines)).await;
        c.send(b"!sync\n").await;
        assert_eq!(c.read_line().await, "ok\n");
    }

    // Answered, then kill -9 at once; then a second crash right after the replay.
    c.send(format!("!forget * {GONE}\n").as_bytes()).await;
    assert_eq!(c.read_line().await, "ok\n");
    daemon.kill();
    daemon = spawn_daemon(&config);
    assert_gone(&client, "answered").await;
    others.assert(&client, "answered").await;
    daemon.kill();
    daemon = spawn_daemon(&config);
    assert_gone(&client, "answered, crashed twice").await;
    others.assert(&client, "answered, crashed twice").await;

    // Increments after an answered forget count, and only they.
    let mut c = LineClient::connect(&socket).await;
    c.send(&buf_of(old(10))).await;
    c.send(format!("!forget ips {GONE}\n").as_bytes()).await;
    assert_eq!(c.read_line().await, "ok\n");
    c.send(format!("ips {GONE} 7\n!sync\n").as_bytes()).await;
    assert_eq!(c.read_line().await, "ok\n");
    daemon.kill();
    daemon = spawn_daemon(&config);
    assert_eq!(total_of(&client, "ips", GONE).await, Some(7));
    assert_eq!(total_of(&client, "downloads", GONE).await, Some(50));
    others.assert(&client, "after a forget").await;

    // Written, then kill -9 at once, unanswered: the key is gone or holds exactly its old
    // total (the forget was lost with the daemon), never a part of it.
    let mut c = LineClient::connect(&socket).await;
    let mut lines = others.lines(5);
    lines.extend(old(20));
    c.send(&buf_of(lines)).await;
    c.send(b"!sync\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    c.send(format!("!forget * {GONE}\n").as_bytes()).await;
    daemon.kill();
    daemon = spawn_daemon(&config);
    let ips = total_of(&client, "ips", GONE).await;
    let downloads = total_of(&client, "downloads", GONE).await;
    assert!(
        (ips, downloads) == (None, None)
            || (ips, downloads) == (Some(7 + 2 * 20), Some(50 + 5 * 20)),
        "killed at once: {ips:?} {downloads:?}"
    );
    others.assert(&client, "killed at once").await;
    for line in daemon
        .log()
        .lines()
        .filter(|l| l.contains("replaying the journal"))
    {
        println!("{line}");
    }
    assert!(
        daemon.log().contains("flush.connections 2 -> 3"),
        "the journal was translated to the new layout"
    );
    daemon.terminate();
}

/// Waits until a flush's `tallyd.correct` waits on a lock (the forget is drained, so its record
/// is journaled).
async fn wait_for_correct_on_lock(client: &Client) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while scalar(
        client,
        "SELECT count(*) FROM pg_stat_activity \
         WHERE query LIKE '%tallyd.correct(%' AND wait_event_type = 'Lock' \
           AND pid <> pg_backend_pid()",
    )
    .await
        == 0
    {
        assert!(Instant::now() < deadline, "no flush waits on the lock");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// 5. Sets beside a rollup loop.
// ---------------------------------------------------------------------------------------------

/// `tallyd.rollup` in a loop on its own session until `stop`; returns the slot rows it folded.
fn rollup_loop(client: Client, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<i64> {
    tokio::spawn(async move {
        let mut folded = 0;
        while !stop.load(SeqCst) {
            folded += scalar(&client, "SELECT tallyd.rollup(7)").await;
        }
        folded
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sets_and_forgets_are_exact_beside_a_rollup_loop() {
    let h = Harness::start(|c| c.flush.connections = 2).await;
    let client = h.sql().await;
    let mut rng = seeded();
    let stop = Arc::new(AtomicBool::new(false));
    let rollups = rollup_loop(h.sql().await, stop.clone());
    let options = RaceOptions {
        ack: Ack::Flush,
        after_set: None,
        kill_at_ok: None,
    };
    let mut totals = Vec::new();
    let mut c = h.client().await;
    for round in 0..6 {
        let key = format!("rolled{round}");
        let race = race(h.socket(), &key, options, &mut rng).await;
        let total = key_total(&client, "downloads", &key).await;
        check(&race, total, &format!("round {round}"));
        totals.push((key.clone(), total));
        // A forget of the same key while the loop folds it, then increments after it.
        c.send(format!("!forget downloads {key}\n").as_bytes())
            .await;
        assert_eq!(c.read_line().await, "ok\n");
        assert_eq!(rows_of(&client, "downloads", &key).await, 0, "{key}");
        c.send(&buf_of((0..round + 1).map(|_| race_line(&key, 1))))
            .await;
        assert_eq!(c.flush().await, (round as u64 + 1, 0));
        totals.last_mut().unwrap().1 = round as i64 + 1;
    }
    stop.store(true, SeqCst);
    let folded = rollups.await.unwrap();
    assert!(folded > 0, "the loop must fold");
    scalar(&client, "SELECT tallyd.rollup(100000)").await;
    for (key, total) in totals {
        assert_eq!(key_total(&client, "downloads", &key).await, total, "{key}");
    }
    println!("{folded} slot rows folded beside the sets");
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// 6. PgBouncer in transaction mode.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sets_and_forgets_are_exact_through_pgbouncer_in_transaction_mode() {
    let mut h = Harness::start(|c| {
        c.flush.connections = 2;
        c.rollup.enabled = true;
        c.rollup.set_interval(Duration::from_millis(50));
    })
    .await;
    let direct = h.sql().await;
    let bouncer = Pgbouncer::start(h.dir.path(), h.pg.as_ref().unwrap(), "transaction", 2);
    h.stop_daemon().await;
    h.db = db(&bouncer.url());
    h.start_daemon().await;
    let mut rng = seeded();
    let options = RaceOptions {
        ack: Ack::Flush,
        after_set: None,
        kill_at_ok: None,
    };
    for round in 0..3 {
        let key = format!("pooled{round}");
        let race = race(h.socket(), &key, options, &mut rng).await;
        let total = key_total(&direct, "downloads", &key).await;
        check(&race, total, &format!("round {round}"));
    }

    // One connection, server connections terminated between the steps.
    let terminate = "SELECT count(pg_terminate_backend(pid))::bigint FROM pg_stat_activity \
                     WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()";
    let mut c = h.client().await;
    c.send(&buf_of((0..10).map(|i| format!("downloads p{} 5", i % 2))))
        .await;
    c.send(&buf_of((0..10).map(|_| "views 77 1".to_string())))
        .await;
    assert_eq!(c.flush().await, (20, 0));
    scalar(&direct, terminate).await;
    c.send(b"downloads p0 1\n!set downloads p0 100\ndownloads p0 2\n")
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    scalar(&direct, terminate).await;
    c.send(b"!forget * 77\n!forget downloads p1\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.read_line().await, "ok\n");
    scalar(&direct, terminate).await;
    c.send(b"downloads p1 3\n").await;
    assert_eq!(c.flush().await, (3, 0));
    assert_eq!(total_of(&direct, "downloads", "p0").await, Some(102));
    assert_eq!(total_of(&direct, "downloads", "p1").await, Some(3));
    assert_eq!(rows_of(&direct, "views", "77").await, 0);

    // From SQL through the pooler, inside the application's transaction.
    let mut app = h.sql().await;
    let tx = app.transaction().await.unwrap();
    tx.execute("SELECT tallyd.forget('downloads', 'p0')", &[])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(rows_of(&direct, "downloads", "p0").await, 0);

    let log = std::fs::read_to_string(h.pg.as_ref().unwrap().log_path()).unwrap();
    let bad: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("prepared statement") || l.contains("portal"))
        .collect();
    assert!(bad.is_empty(), "{bad:#?}");
    h.stop_daemon().await;
    drop(bouncer);
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// 7. Hostile input.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_corrections_are_refused_and_change_nothing() {
    let mut h = Harness::start(|c| c.flush.connections = 1).await;
    let client = h.sql().await;
    let mut c = h.client().await;
    c.send(b"downloads k 5\nviews 42 4\ndownloads 0042 3\ndownloads 42 2\n")
        .await;
    assert_eq!(c.flush().await, (4, 0));
    let long = "x".repeat(300);
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            b"!set downloads k 9223372036854775808".to_vec(),
            "bad_value",
        ),
        (
            b"!set downloads k -9223372036854775809".to_vec(),
            "bad_value",
        ),
        (
            b"!set downloads k 99999999999999999999999999".to_vec(),
            "bad_value",
        ),
        (b"!set downloads k 1e3".to_vec(), "bad_value"),
        (b"!set downloads k 0x10".to_vec(), "bad_value"),
        (b"!set downloads k --1".to_vec(), "bad_value"),
        (b"!set downloads k".to_vec(), "missing_value"),
        (b"!set downloads k 5 @x".to_vec(), "bad_timestamp"),
        (
            b"!set downloads k 5 @999999999999999999".to_vec(),
            "bad_timestamp",
        ),
        (b"!set downloads k 5 6".to_vec(), "too_many_fields"),
        (b"!set downloads k 5 @1 x".to_vec(), "too_many_fields"),
        (b"!set".to_vec(), "missing_key"),
        (b"!forget".to_vec(), "missing_key"),
        (b"!forget *".to_vec(), "missing_key"),
        (b"!forget * a b".to_vec(), "too_many_fields"),
        (b"!forget nope k".to_vec(), "unknown_counter"),
        (b"!forget views k".to_vec(), "bad_key"),
        (b"!set ips 999.1.1.1 5".to_vec(), "bad_key"),
        // A key no counter takes: not UTF-8 (so not text), nor a number, address or uuid.
        (b"!forget * caf\xe9".to_vec(), "bad_key"),
        (b"!forget * a\x7fb".to_vec(), "bad_key"),
        (format!("!forget * {long}").into_bytes(), "key_too_long"),
        (
            format!("!set downloads {long} 1").into_bytes(),
            "key_too_long",
        ),
    ];
    for (line, reason) in &cases {
        let mut bytes = line.clone();
        bytes.push(b'\n');
        c.send(&bytes).await;
        let reply = c.read_line().await;
        assert!(
            reply.starts_with(&format!("error {reason} ")),
            "{}: {reply:?}",
            String::from_utf8_lossy(line)
        );
    }
    // Not corrections: unknown control words, rejected like any bad line.
    c.send(b"!SET downloads k 1\n!setx downloads k 1\n!forget2 downloads k\n")
        .await;
    assert_eq!(c.flush().await, (0, cases.len() as u64 + 3));
    assert_eq!(total_of(&client, "downloads", "k").await, Some(5));

    // A refused correction between two accepted ones is answered in its place.
    c.send(b"!set downloads k 1\n!set nope k 1\n!set downloads k 8\n")
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert!(c.read_line().await.starts_with("error unknown_counter "));
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(total_of(&client, "downloads", "k").await, Some(8));

    // The 64-bit bounds: set to them, and nothing may carry past them.
    c.send(b"!set downloads max 9223372036854775807\n!set downloads min -9223372036854775808\n")
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.read_line().await, "ok\n");
    c.send(b"downloads max 1\ndownloads min -1\n").await;
    // Skipped by the flush's range guard, after they were accepted (docs/protocol.md,
    // "Overflow"); the refused `!set nope` is this period's rejection.
    assert_eq!(c.flush().await, (2, 1));
    assert_eq!(total_of(&client, "downloads", "max").await, Some(i64::MAX));
    assert_eq!(total_of(&client, "downloads", "min").await, Some(i64::MIN));
    // Within the same flight too: the set's value is where later increments start from.
    c.send(b"!set downloads max -1\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    c.send(b"!set downloads max 9223372036854775806\ndownloads max 1\ndownloads max 1\n")
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.flush().await, (1, 1));
    assert_eq!(total_of(&client, "downloads", "max").await, Some(i64::MAX));
    // A flight with a set beside a row the range guard skips (one flush connection: one
    // flight): written again with the guard, the set and the rest commit, exact.
    c.send(b"downloads max 1\n!set downloads other 5\ndownloads other 2\n")
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.flush().await, (2, 0));
    assert_eq!(total_of(&client, "downloads", "max").await, Some(i64::MAX));
    assert_eq!(total_of(&client, "downloads", "other").await, Some(7));

    // A key held back by the rollup's range guard (its total leaves the 64-bit range): a set
    // supersedes all of it, and the guard lets it go.
    scalar(&client, "SELECT tallyd.rollup(1000)").await;
    c.send(b"downloads max 1\n").await;
    assert_eq!(c.flush().await, (1, 0));
    scalar(&client, "SELECT tallyd.rollup(1000)").await;
    assert_eq!(
        scalar(
            &client,
            "SELECT count(*) FROM tallyd.rollup_rejects WHERE key = 'max'"
        )
        .await,
        1,
        "held back"
    );
    let held: (bool, String) = client
        .query_one(
            "SELECT count IS NULL, exact_count::text FROM tallyd.totals \
             WHERE counter = 'downloads' AND key = 'max'",
            &[],
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(held, (true, "9223372036854775808".to_string()));
    c.send(b"!set downloads max 12\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(total_of(&client, "downloads", "max").await, Some(12));
    scalar(&client, "SELECT tallyd.rollup(1000)").await;
    c.send(b"downloads max 1\n").await;
    assert_eq!(c.flush().await, (1, 0));
    scalar(&client, "SELECT tallyd.rollup(1000)").await;
    assert_eq!(total_of(&client, "downloads", "max").await, Some(13));
    assert_eq!(rows_of(&client, "downloads", "max").await, 1, "folded");

    // `!forget *` takes each counter's canonical form of the key: `0042` is `42` in views.
    c.send(b"!forget * 0042\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(rows_of(&client, "views", "42").await, 0);
    assert_eq!(rows_of(&client, "downloads", "0042").await, 0);
    assert_eq!(total_of(&client, "downloads", "42").await, Some(2));
    let uuid = "6f1c2f34-5f7e-4c1a-9b1e-2a9e4d1c0b7a";
    c.send(format!("users {uuid} 4\n").as_bytes()).await;
    assert_eq!(c.flush().await, (1, 0));
    c.send(format!("!forget * {}\n", uuid.to_uppercase()).as_bytes())
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(rows_of(&client, "users", uuid).await, 0);

    // Corrections on the datagram socket: rejected (`unknown_command`), nothing changed, the
    // events around them taken.
    let dgram = tokio::net::UnixDatagram::unbound().unwrap();
    for d in [
        "!set downloads k 1000\ndownloads k 1",
        "!forget downloads k\ndownloads k 1",
        "!forget * k",
        "!set downloads k 1000",
    ] {
        dgram
            .send_to(d.as_bytes(), h.datagram_socket())
            .await
            .unwrap();
    }
    // A graceful stop takes every datagram already queued.
    h.stop_daemon().await;
    assert_eq!(total_of(&client, "downloads", "k").await, Some(10));
    h.stop().await;
}

/// Corrections for a counter a reload removed are refused as `unknown_counter` (its rows stay),
/// `!forget *` passes it by; and corrections leave no pending keys or events behind in
/// `/status` (a correction's own entry, and the events it superseded, are released with its
/// flush).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrections_after_a_reload_removed_their_counter_and_in_status() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let port = free_port();
    let base = child_config(dir.path(), &conninfo, "reloaded")
        .counters(&[("spare", tallyd::config::KeyTypeName::Text)])
        .metrics_port(port);
    let config = base.write();
    let client = sql(&conninfo).await;
    let mut daemon = spawn_daemon(&config);
    let addr = daemon.metrics();

    let mut c = LineClient::connect(daemon.socket()).await;
    c.send(b"spare k 5\nspare 7 1\ndownloads k 2\nviews 7 3\ndownloads 7 4\n")
        .await;
    for _ in 0..10 {
        c.send(b"downloads hot 1\n").await;
    }
    assert_eq!(c.flush().await, (15, 0));
    // Superseded events and a correction's own new entry are released by its flush.
    for _ in 0..10 {
        c.send(b"downloads hot 1\n").await;
    }
    c.send(b"!set downloads hot 3\n!set downloads fresh 4\n!forget downloads never\n")
        .await;
    for _ in 0..3 {
        assert_eq!(c.read_line().await, "ok\n");
    }
    assert_eq!(c.flush().await, (10, 0));
    assert_eq!(total_of(&client, "downloads", "hot").await, Some(3));
    assert_nothing_pending(addr);

    // The reload removes `spare`.
    let reduced = base
        .clone()
        .with(|c| c.counters.retain(|x| x.name != "spare"));
    let new = reduced.write_as("config.toml.new");
    std::fs::rename(&new, &config).unwrap();
    reload(&daemon);
    let mut after = LineClient::connect(daemon.socket()).await;
    for (conn, c) in [
        ("opened before the reload", &mut c),
        ("opened after", &mut after),
    ] {
        for line in ["!set spare k 1", "!forget spare k"] {
            c.send(format!("{line}\n").as_bytes()).await;
            let reply = c.read_line().await;
            assert!(
                reply.starts_with("error unknown_counter "),
                "{conn}: {line}: {reply:?}"
            );
        }
    }
    c.send(b"!set spare k 1\n!forget * k\n!forget * 7\n").await;
    assert!(c.read_line().await.starts_with("error unknown_counter "));
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(total_of(&client, "spare", "k").await, Some(5));
    assert_eq!(total_of(&client, "spare", "7").await, Some(1));
    assert_eq!(rows_of(&client, "downloads", "k").await, 0);
    assert_eq!(rows_of(&client, "downloads", "7").await, 0);
    assert_eq!(rows_of(&client, "views", "7").await, 0);
    assert_nothing_pending(addr);

    // The command line: refusals name the reason and fail; a negative value is a value.
    let refused = [
        (&["set", "spare", "k", "1"][..], "unknown_counter"),
        (&["set", "downloads", "k", "12x"][..], "bad_value"),
        (
            &["set", "downloads", "k", "9223372036854775808"][..],
            "bad_value",
        ),
        (&["forget", "views", "not-a-number"][..], "bad_key"),
    ];
    for (args, reason) in refused {
        let out = common::tallyd(&config, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(reason),
            "{args:?}: {out:?}"
        );
    }
    for args in [
        &["forget", "downloads"][..],
        &["forget", "--everywhere", "a", "b"],
    ] {
        let out = common::tallyd(&config, args);
        assert!(!out.status.success(), "{args:?}: {out:?}");
    }
    let out = common::tallyd(&config, &["set", "downloads", "k", "-5"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(total_of(&client, "downloads", "k").await, Some(-5));
    let out = common::tallyd(&config, &["forget", "--everywhere", "k"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(rows_of(&client, "downloads", "k").await, 0);

    // A crash and a restart on the reduced config: the journal's corrections replay (or are
    // covered) without the removed counter.
    daemon.kill();
    daemon = spawn_daemon(&config);
    assert_eq!(total_of(&client, "spare", "k").await, Some(5));
    assert_eq!(rows_of(&client, "downloads", "k").await, 0);
    assert_eq!(total_of(&client, "downloads", "hot").await, Some(3));
    assert_eq!(total_of(&client, "downloads", "fresh").await, Some(4));
    daemon.terminate();
}

/// SIGHUP, then waits until the daemon has counted a successful reload.
fn reload(daemon: &Daemon) {
    let ok = r#"tallyd_config_reloads_total{result="ok"}"#;
    let before = daemon.scrape().get(ok).unwrap_or(0.0);
    daemon.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(60);
    while daemon.scrape().get(ok).unwrap_or(0.0) < before + 1.0 {
        assert!(Instant::now() < deadline, "the reload was not counted");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every counter in `/status` has nothing pending.
fn assert_nothing_pending(addr: std::net::SocketAddr) {
    let (code, body) = http_get(addr, "/status");
    assert_eq!(code, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    let memory = &status["memory"];
    assert_eq!(
        (&memory["pending_keys"], &memory["pending_events"]),
        (&serde_json::json!(0), &serde_json::json!(0)),
        "{memory}"
    );
    for counter in status["counters"].as_array().expect("counters") {
        assert_eq!(
            (&counter["pending_keys"], &counter["pending_events"]),
            (&serde_json::json!(0), &serde_json::json!(0)),
            "{counter}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Kinds and windows (a windowed counter without `also`; with it, sets are refused for now).
// ---------------------------------------------------------------------------------------------

async fn value_of(client: &Client, counter: &str, key: &str) -> Option<i64> {
    client
        .query_opt(
            "SELECT value FROM tallyd.totals WHERE counter = $1 AND key = $2",
            &[&counter, &key],
        )
        .await
        .unwrap()
        .and_then(|r| r.get(0))
}

/// (window start in Unix ms, count) of each day of `key` in `daily`.
async fn days_of(client: &Client, key: &str) -> Vec<(i64, i64)> {
    client
        .query(
            "SELECT (extract(epoch FROM window_start) * 1000)::bigint, count \
             FROM tallyd.window_totals WHERE counter = 'daily' AND key = $1 AND span = 'day' \
             ORDER BY 1",
            &[&key],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sets_and_forgets_of_max_min_last_and_daily_counters_are_exact() {
    let h = Harness::start(|c| {
        for (name, kind) in [("peak", "max"), ("floor", "min"), ("latest", "last")] {
            c.counters.push(
                toml::from_str(&format!("name = {name:?}\nkind = {kind:?}")).expect("counter"),
            );
        }
        let mut daily = common::windowed_counter("daily", "day", "UTC", &[]);
        daily.keep_windows = Some(5);
        c.counters.push(daily);
        c.counters.push(common::windowed_counter(
            "monthly",
            "day",
            "UTC",
            &["month", "all"],
        ));
    })
    .await;
    let client = h.sql().await;
    let mut c = h.client().await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    c.send(b"peak k 100\nfloor k -100\n").await;
    c.send(format!("latest k 100 @{}\n", now - 60_000).as_bytes())
        .await;
    assert_eq!(c.flush().await, (3, 0));
    c.send(b"!set peak k 5\n!set floor k 5\n!set latest k 5\n")
        .await;
    for _ in 0..3 {
        assert_eq!(c.read_line().await, "ok\n");
    }
    for counter in ["peak", "floor", "latest"] {
        assert_eq!(value_of(&client, counter, "k").await, Some(5), "{counter}");
    }
    // Later values fold into the set one as into any other: greatest, least, latest in time.
    c.send(b"peak k 3\nfloor k 7\n").await;
    c.send(format!("latest k 3 @{}\n", now - 30_000).as_bytes())
        .await;
    assert_eq!(c.flush().await, (3, 0));
    for counter in ["peak", "floor", "latest"] {
        assert_eq!(value_of(&client, counter, "k").await, Some(5), "{counter}");
    }
    c.send(b"peak k 9\nfloor k 2\n").await;
    c.send(format!("latest k 4 @{}\n", now + 60_000).as_bytes())
        .await;
    assert_eq!(c.flush().await, (3, 0));
    let values = [("peak", 9), ("floor", 2), ("latest", 4)];
    for (counter, v) in values {
        assert_eq!(value_of(&client, counter, "k").await, Some(v), "{counter}");
    }
    c.send(b"!forget * k\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    for counter in ["peak", "floor", "latest", "downloads"] {
        assert_eq!(rows_of(&client, counter, "k").await, 0, "{counter}");
    }

    // Days: a set replaces its own day, the others stay; a forget takes every day.
    const DAY: i64 = 86_400_000;
    let today = now - now.rem_euclid(DAY);
    let (d0, d1) = (today - 2 * DAY, today - DAY);
    let mut lines: Vec<String> = (0..3).map(|i| format!("daily k 1 @{}", d0 + i)).collect();
    lines.extend((0..4).map(|i| format!("daily k 1 @{}", d1 + i)));
    c.send(&buf_of(lines)).await;
    assert_eq!(c.flush().await, (7, 0));
    c.send(
        format!(
            "daily k 2 @{d1}\n!set daily k 10 @{}\ndaily k 1 @{d1}\n",
            d1 + 5
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(days_of(&client, "k").await, vec![(d0, 3), (d1, 11)]);
    c.send(format!("!set daily k 7 @{}\ndaily k 1 @{d0}\n", today + 1).as_bytes())
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(
        days_of(&client, "k").await,
        vec![(d0, 4), (d1, 11), (today, 7)]
    );
    c.send(b"!forget daily k\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(rows_of(&client, "daily", "k").await, 0);
    // With `also`, a forget takes every span: days, months, all time; events after it count
    // alone, in each (a windowed sum's set with `also`: tests/corrections.rs).
    let lines: Vec<String> = (0..4)
        .map(|i| format!("monthly k 1 @{}", d0 - i * 20 * DAY))
        .collect();
    c.send(&buf_of(lines)).await;
    // With the three `daily` lines since the last `!flush`.
    assert_eq!(c.flush().await, (7, 0));
    let reply = {
        c.send(b"!set monthly k 1\n").await;
        c.read_line().await
    };
    assert_eq!(reply, "ok\n", "a windowed sum with `also` is settable");
    c.send(format!("monthly k 2 @{d0}\n!forget monthly k\nmonthly k 3 @{d1}\n").as_bytes())
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    let spans: Vec<(String, i64)> = client
        .query(
            "SELECT span, count FROM tallyd.window_totals WHERE counter = 'monthly' \
             AND key = 'k' ORDER BY span",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let spans: Vec<(&str, i64)> = spans.iter().map(|(s, n)| (s.as_str(), *n)).collect();
    assert_eq!(spans, vec![("day", 3), ("month", 3)]);
    assert_eq!(total_of(&client, "monthly", "k").await, Some(3), "all time");
    // A day older than `keep_windows`: refused as an event there would be.
    c.send(format!("!set daily k 5 @{}\n", today - 10 * DAY).as_bytes())
        .await;
    let reply = c.read_line().await;
    assert!(reply.starts_with("error expired "), "{reply:?}");
    assert_eq!(rows_of(&client, "daily", "k").await, 0);
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// At the memory cap: corrections in spilled records.
// ---------------------------------------------------------------------------------------------

/// With the database down and a memory cap of 200 keys, a connection's records spill to the
/// journal and are folded back in order once the database returns: a `!set` among them
/// supersedes exactly the increments before it. Then the same with kill -9 while the set waits
/// for the database: after the restart the key holds either all of its increments (the set's
/// read was never journaled) or the set's value plus what followed it, nothing between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_in_spilled_records_at_the_memory_cap_is_exact() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let port = free_port();
    let config = child_config(dir.path(), &conninfo, "spill")
        .metrics_port(port)
        .with(|c| {
            c.coalesce.max_pending_keys = 200;
            c.flush.max_pending_keys = 100;
            c.flush.set_retry_max(Duration::from_millis(200));
        })
        .write();
    let socket = dir.path().join("tallyd.sock");
    let mut daemon = spawn_daemon(&config);
    let mut pg = Some(pg);
    let distinct = |from: usize, to: usize, tag: &str| -> Vec<String> {
        (from..to)
            .map(|i| format!("downloads {tag}{i} 1"))
            .collect()
    };
    for kill in [false, true] {
        let tag = if kill { "killed" } else { "spilled" };
        let key = format!("hot-{tag}");
        common::stop_postgres_immediate(pg.take().unwrap()).await;
        let mut c = LineClient::connect(&socket).await;
        let mut lines = distinct(0, 1000, tag);
        lines.extend((0..10).map(|_| race_line(&key, 5)));
        lines.push("!sync".into());
        c.send(&buf_of(lines)).await;
        assert_eq!(c.read_line().await, "ok\n");
        let mut lines = vec![format!("!set downloads {key} 7")];
        lines.extend((0..3).map(|_| race_line(&key, 1)));
        lines.extend(distinct(1000, 1300, tag));
        c.send(&buf_of(lines)).await;
        if kill {
            // The set waits for the database; its read may or may not be journaled yet.
            tokio::time::sleep(Duration::from_millis(200)).await;
            daemon.kill();
            pg = Some(postgres(dir.path()).await);
            daemon = spawn_daemon(&config);
        } else {
            tokio::time::sleep(Duration::from_millis(500)).await;
            pg = Some(postgres(dir.path()).await);
            assert_eq!(c.read_line().await, "ok\n");
            assert_eq!(c.flush().await, (1313, 0));
            let spilled = daemon.scrape().value("tallyd_journal_spilled_events_total");
            assert!(spilled > 0.0, "the records must spill ({spilled})");
        }
        let client = sql(&conninfo).await;
        let hot = key_total(&client, "downloads", &key).await;
        let keys = scalar(
            &client,
            &format!(
                "SELECT count(*) FROM tallyd.totals WHERE counter = 'downloads' \
                 AND key LIKE '{tag}%' AND count = 1"
            ),
        )
        .await;
        if kill {
            assert!(
                (hot, keys) == (50, 1000) || (hot, keys) == (10, 1300),
                "{tag}: {hot} for the set key, {keys} keys"
            );
            println!("killed while the set waited: {hot} for the set key, {keys} keys");
        } else {
            assert_eq!((hot, keys), (10, 1300), "{tag}");
        }
    }
    daemon.terminate();
}

// ---------------------------------------------------------------------------------------------
// Two instances on one database.
// ---------------------------------------------------------------------------------------------

/// Two daemons write one key: connections of both add batches while one of them sets it. For
/// the other instance's batches, "before" is "committed before the set commits": acknowledged
/// by `!flush` before the set was written, superseded; written after its `ok`, counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_among_two_instances_increments_is_exact() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let conninfo = pg.connection_string("postgres");
    let start = |name: &str| {
        let sub = dir.path().join(name);
        std::fs::create_dir_all(&sub).unwrap();
        spawn_daemon(&child_config(&sub, &conninfo, name).write())
    };
    let (a, b) = (start("a"), start("b"));
    let client = sql(&conninfo).await;
    let mut rng = seeded();
    let options = RaceOptions {
        ack: Ack::Flush,
        after_set: None,
        kill_at_ok: None,
    };
    let mut in_flight = 0;
    for round in 0..6 {
        let key = format!("shared{round}");
        let setter = if round % 2 == 0 { &a } else { &b };
        let adders = [a.socket(), b.socket()];
        let race = race_on(&adders, setter.socket(), &key, options, &mut rng).await;
        let total = key_total(&client, "downloads", &key).await;
        in_flight += check(&race, total, &format!("round {round}"));
    }
    println!("{in_flight} batches were in flight during a set");
    a.terminate();
    b.terminate();
}
