//! A `!set` at a random moment among concurrent increments of one key, decoded exactly: each
//! batch adds a power of two, so the key's total less the set's value names the batches counted
//! after it. Every batch acknowledged before the set was written is superseded, every batch
//! written after its `ok` is counted, each connection's counted batches are a suffix of its
//! acknowledged ones. Alone, beside a rollup loop (with forgets), through kill -9 right after
//! the set's answer, through PgBouncer in transaction mode, and with two instances writing the
//! key.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::sync::watch;

use crate::common::netpg::{statements_crossed_in_the_pooler, Pgbouncer};
use crate::common::{
    buf_of, count_of, key_total, postgres, rows_of, scalar, seeded, spawn_daemon, sql, temp_dir,
    terminate, Harness, RollupLoop, Sessions, TestConfig,
};
use crate::journaled_config;

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
pub(crate) enum Ack {
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
pub(crate) struct Race {
    batches: Vec<Batch>,
    value: i64,
    /// Tickets taken before the `!set` was written and after its `ok` was read.
    set_sent: u64,
    set_ok: u64,
}

#[derive(Clone, Copy)]
pub(crate) struct RaceOptions {
    /// The counter raced (`downloads` unless a test declares another: tests/corrections/into.rs).
    pub(crate) counter: &'static str,
    pub(crate) ack: Ack,
    /// Each connection stops after this many batches begun after the set's `ok`.
    pub(crate) after_set: Option<usize>,
    /// kill -9 this pid as soon as the set's `ok` is read.
    pub(crate) kill_at_ok: Option<u32>,
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

fn race_line(counter: &str, key: &str, delta: i64) -> String {
    format!("{counter} {key} {delta}")
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
        let mut lines = buf_of((0..LINES).map(|_| race_line(options.counter, &key, delta)));
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
pub(crate) async fn race(socket: &Path, key: &str, options: RaceOptions, rng: &mut StdRng) -> Race {
    race_on(&[socket], socket, key, options, rng).await
}

/// A race whose adders connect to `adders` in turn (instances writing the same database) and
/// whose setter connects to `setter`.
pub(crate) async fn race_on(
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
        .ask(format!("!set {} {key} {value}\n", options.counter).as_bytes())
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
pub(crate) fn check(race: &Race, total: i64, what: &str) -> usize {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_among_concurrent_increments_supersedes_exactly_what_came_before_it() {
    let h = Harness::start(|c| c.flush.connections = 2).await;
    let client = h.sql().await;
    let mut rng = seeded();
    let options = RaceOptions {
        counter: "downloads",
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
    let config = journaled_config(dir.path(), &conninfo, Duration::from_secs(1), 2);
    let client = sql(&conninfo).await;
    let socket = dir.path().join("tallyd.sock");
    let mut rng = seeded();
    let mut daemon = spawn_daemon(&config);
    let mut in_flight = 0;
    for round in 0..4 {
        let key = format!("killed{round}");
        let at_once = round % 2 == 0;
        let options = RaceOptions {
            counter: "downloads",
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sets_and_forgets_are_exact_beside_a_rollup_loop() {
    let h = Harness::start(|c| c.flush.connections = 2).await;
    let client = h.sql().await;
    let mut rng = seeded();
    let conninfo = h.pg.as_ref().unwrap().connection_string("postgres");
    let rollups = RollupLoop::start(&conninfo, 7).await;
    let options = RaceOptions {
        counter: "downloads",
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
        c.send(&buf_of(
            (0..round + 1).map(|_| race_line("downloads", &key, 1)),
        ))
        .await;
        assert_eq!(c.flush().await, (round as u64 + 1, 0));
        totals.last_mut().unwrap().1 = round as i64 + 1;
    }
    let folded = rollups.stop().await;
    assert!(folded > 0, "the loop must fold");
    scalar(&client, "SELECT tallyd.rollup(100000)").await;
    for (key, total) in totals {
        assert_eq!(key_total(&client, "downloads", &key).await, total, "{key}");
    }
    println!("{folded} slot rows folded beside the sets");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sets_and_forgets_are_exact_through_pgbouncer_in_transaction_mode() {
    let mut h = Harness::start(|c| {
        c.flush.connections = 2;
        c.rollup.enabled = true;
        c.rollup.set_interval(Duration::from_millis(50));
    })
    .await;
    let direct = h.sql().await;
    let bouncer = Pgbouncer::in_front_of(&mut h, "transaction", 2).await;
    let mut rng = seeded();
    let options = RaceOptions {
        counter: "downloads",
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
    let mut c = h.client().await;
    c.send(&buf_of((0..10).map(|i| format!("downloads p{} 5", i % 2))))
        .await;
    c.send(&buf_of((0..10).map(|_| "views 77 1".to_string())))
        .await;
    assert_eq!(c.flush().await, (20, 0));
    terminate(&direct, Sessions::All).await;
    c.send(b"downloads p0 1\n!set downloads p0 100\ndownloads p0 2\n")
        .await;
    assert_eq!(c.read_line().await, "ok\n");
    terminate(&direct, Sessions::All).await;
    c.send(b"!forget * 77\n!forget downloads p1\n").await;
    assert_eq!(c.read_line().await, "ok\n");
    assert_eq!(c.read_line().await, "ok\n");
    terminate(&direct, Sessions::All).await;
    c.send(b"downloads p1 3\n").await;
    assert_eq!(c.flush().await, (3, 0));
    assert_eq!(count_of(&direct, "downloads", "p0").await, Some(102));
    assert_eq!(count_of(&direct, "downloads", "p1").await, Some(3));
    assert_eq!(rows_of(&direct, "views", "77").await, 0);

    // From SQL through the pooler, inside the application's transaction.
    let mut app = h.sql().await;
    let tx = app.transaction().await.unwrap();
    tx.execute("SELECT tallyd.forget('downloads', 'p0')", &[])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(rows_of(&direct, "downloads", "p0").await, 0);

    let crossed = statements_crossed_in_the_pooler(h.pg.as_ref().unwrap());
    assert!(crossed.is_empty(), "{crossed:#?}");
    h.stop_daemon().await;
    drop(bouncer);
    h.stop().await;
}

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
        spawn_daemon(
            &TestConfig::new(&sub)
                .external(&conninfo, name)
                .standard_counters()
                .write(),
        )
    };
    let (a, b) = (start("a"), start("b"));
    let client = sql(&conninfo).await;
    let mut rng = seeded();
    let options = RaceOptions {
        counter: "downloads",
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
