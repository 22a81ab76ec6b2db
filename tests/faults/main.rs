//! The fault matrix: every fault tallyd survives, each run over every workload at once (sums,
//! each kind of value, windows with `also`, corrections, `rollup_into` folded by the rollup and
//! written directly by the flush, sets of a `rollup_into` column, a windowed sum at the 64-bit
//! edge with sets refused beyond it, idempotent batches), against the real
//! `tallyd run` and a real PostgreSQL. After each fault every workload's databases hold exactly
//! its model: what the test sent and the daemon acknowledged (`!flush`, `!sync`, a correction's
//! `ok`), once, every key on its shard's database, nothing else.
//!
//! | fault | test |
//! | --- | --- |
//! | kill -9 after `!sync` (the journal's replay), twice | [`kill_9_after_sync_replays_every_acknowledged_line_once`] |
//! | kill -9 while flights are written, three times | [`kill_9_while_flushes_commit_replays_exactly_once`] |
//! | tallyd's backends terminated every 20 to 150 ms under load | [`backends_terminated_under_load`] |
//! | PgBouncer in transaction mode, server connections terminated | [`pgbouncer_in_transaction_mode`] |
//! | reads past the memory cap spilled; the database crash-stopped under load, back 3 s later | [`spill_at_the_memory_cap_and_a_database_restart`] |
//! | a third database added, shards moved | [`a_shard_move`] |
//! | `tallyd.rollup` in a loop beside the flushes | [`beside_a_rollup_loop`] |
//! | the application holds rows of its `rollup_into` tables past the direct writes' lock timeout | [`the_application_holds_its_rows`] |
//! | `DROP EXTENSION hll CASCADE` under load for 3 s, then created again; dropped again and kill -9 while unique rows are held | [`the_hll_extension_dropped_under_load`] |
//!
//! Each fault starts one daemon declaring every workload's counters, and each workload sends
//! its rounds on connections of its own, concurrently with the others; a fault strikes only
//! after acknowledgements, and the models record only lines that were sent, so every recorded
//! line must be in the database exactly once. Each test after a fault rolls everything up and
//! checks again: the rollup keeps what the fault left exact.
//!
//! # A new feature joins with one workload
//! A type implementing [`workload::Workload`], in a file of its own, and one entry in
//! [`workloads`]; every fault then runs it (one that cannot is a defect to fix, not a skip):
//! - `counters()`: its own counters, named after it, on keys no other workload uses (a
//!   `!forget *` must stay within it); `setup_sql()`: what each database needs first (an
//!   application's table).
//! - `round(ctx, rng)`: a round's lines (`ctx.size`: tens or thousands; `ctx.commits`: whether
//!   lines that commit by themselves, such as corrections, are allowed), recorded in its model
//!   as sent. The model sits behind a lock: the workload's connections (`ctx.conn`) share it.
//!   `Round::replies` are the answers its lines get before the acknowledgement's (`ok` for a
//!   correction), `events` and `rejected` what the next `!flush` counts.
//! - `verify(store)`: the databases against the model, exactly, `Err` saying what differs
//!   (`workload::compare` does it for rows keyed by the counter's key, every key on the database
//!   its shard maps to).
//!
//! # A new fault
//! A test below: a [`rig::Rig`] (PostgreSQL, the workloads' setup, the config), a
//! [`rig::Traffic`] (every workload's connections) sending [`rig::Plan`]s, the fault, then
//! `rig.verify(when)`.

mod batches;
#[path = "../common/mod.rs"]
mod common;
mod corrections;
mod direct;
mod edge;
mod kinds;
mod rig;
mod rollup_into;
mod set_into;
mod sums;
mod windows;
mod workload;

use std::sync::Arc;
use std::time::Duration;

use common::netpg::{statements_crossed_in_the_pooler, Pgbouncer};
use common::{
    counter, counter_total, scalar, seeded, sql, LineClient, RollupLoop, Sessions, Terminator,
};
use rig::{samples, Ack, Plan, Rig, Traffic};
use tallyd::config::{FsyncMode, KeyTypeName};
use tokio::io::AsyncWriteExt;
use workload::{Size, Workload};

/// The workloads every fault runs: one entry per feature.
fn workloads() -> Vec<Arc<dyn Workload>> {
    vec![
        Arc::new(sums::Sums::default()),
        Arc::new(kinds::Kinds::new(kinds::Kind::Unique)),
        Arc::new(kinds::Kinds::new(kinds::Kind::Max)),
        Arc::new(kinds::Kinds::new(kinds::Kind::Min)),
        Arc::new(kinds::Kinds::new(kinds::Kind::Last)),
        Arc::new(windows::Windows::default()),
        Arc::new(corrections::Corrections::default()),
        Arc::new(rollup_into::RollupInto::default()),
        Arc::new(direct::Direct::default()),
        Arc::new(set_into::SetInto::default()),
        Arc::new(edge::Edge::default()),
        Arc::new(batches::Batches::default()),
    ]
}

/// The counter of the lines a client streams without ever asking for an acknowledgement.
const UNACKED: &str = "unacked";

/// Streams `unacked b 1` lines on a connection of its own until the daemon dies; returns how
/// many it wrote.
fn unacknowledged_stream(rig: &Rig) -> tokio::task::JoinHandle<i64> {
    let socket = rig.socket();
    tokio::spawn(async move {
        let mut c = LineClient::connect(&socket).await;
        let lines = format!("{UNACKED} b 1\n").repeat(500);
        let mut sent = 0;
        while c.wr.write_all(lines.as_bytes()).await.is_ok() {
            sent += 500;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        sent
    })
}

/// The real `tallyd run`, committing only on `!flush` (and corrections), with `fsync =
/// "always"`: rounds committed (part of them rolled up), then rounds acknowledged by `!sync`
/// alone (so that no workload's model is in the database yet: only the replay can bring them,
/// among them `last` events older than the committed ones, which must not win), and a client
/// streaming lines it never asks about; kill -9. The restart replays every acknowledged line
/// exactly once (the unacknowledged ones at most once), a second kill -9 right after the
/// replay changes nothing, rounds after it add up, and a graceful stop leaves no journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_after_sync_replays_every_acknowledged_line_once() {
    let mut rng = seeded();
    let rig = Rig::start(workloads(), 1, |c| {
        c.counters.push(counter(UNACKED, KeyTypeName::Text));
        c.flush.set_interval(Duration::from_secs(600));
        c.journal.fsync = FsyncMode::Always;
    })
    .await;
    let daemon = rig.spawn().await;
    let mut traffic = Traffic::connect(&rig, 2, &mut rng).await;
    traffic.run(Plan::rounds(2, Size::Small, Ack::Flush)).await;
    let folded = scalar(
        &sql(&rig.conninfos[0]).await,
        "SELECT tallyd.rollup(100000)",
    )
    .await;
    assert!(folded > 0, "nothing rolled up");
    traffic.run(Plan::rounds(1, Size::Large, Ack::Flush)).await;
    rig.verify("committed").await;

    let unacked = unacknowledged_stream(&rig);
    traffic.run(Plan::rounds(3, Size::Small, Ack::Sync)).await;
    traffic
        .run(Plan {
            commits: false,
            ..Plan::rounds(1, Size::Large, Ack::Sync)
        })
        .await;
    let journaled_only = rig.unverified().await;
    assert_eq!(
        journaled_only.len(),
        rig.workloads.len(),
        "every workload's last rounds must be in the journal alone before the kill: {journaled_only:#?}"
    );
    daemon.kill();
    let streamed = unacked.await.unwrap();

    let daemon = rig.spawn().await;
    let mut c = LineClient::connect(&rig.socket()).await;
    assert_eq!(c.flush().await, (0, 0));
    // The replay has committed before the daemon answers.
    rig.verify("after the replay").await;
    let kept = counter_total(&sql(&rig.conninfos[0]).await, UNACKED).await;
    assert!(
        kept <= streamed,
        "{kept} unacknowledged events kept of {streamed} sent"
    );
    println!("{kept} of {streamed} unacknowledged events kept");
    drop(c);
    daemon.kill();
    let daemon = rig.spawn().await;
    rig.verify("after a second kill -9 right after the replay")
        .await;

    traffic.reconnect(&rig).await;
    traffic.run(Plan::rounds(2, Size::Small, Ack::Flush)).await;
    rig.verify("after the restart").await;
    rig.roll_up_everything(None).await;
    rig.verify("rolled up").await;
    drop(traffic);
    assert!(daemon.terminate().success());
    let left = std::fs::read_dir(rig.dir().join("data/journal")).map_or(0, |d| d.count());
    assert_eq!(left, 0, "a graceful stop leaves no journal behind");
}

/// kill -9 while flights commit: flushes every 10 ms and the rollup every 50 ms, each round
/// acknowledged by `!sync`, the daemon killed right after a large round's `!sync` (its flight
/// still being written), three times over. A flight committed before a kill is not replayed
/// again, one that was not is: every workload exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_while_flushes_commit_replays_exactly_once() {
    let mut rng = seeded();
    let rig = Rig::start(workloads(), 1, |c| {
        c.flush.set_interval(Duration::from_millis(10));
        c.flush.connections = 2;
        c.rollup.enabled = true;
        c.rollup.set_interval(Duration::from_millis(50));
        c.rollup.batch_rows = 200;
    })
    .await;
    let client = sql(&rig.conninfos[0]).await;
    let mut traffic = None;
    for cycle in 0..3 {
        let daemon = rig.spawn().await;
        let t = match traffic.as_mut() {
            None => traffic.insert(Traffic::connect(&rig, 1, &mut rng).await),
            Some(t) => {
                t.reconnect(&rig).await;
                t
            }
        };
        t.run(Plan::rounds(19, Size::Small, Ack::Sync)).await;
        t.run(Plan::rounds(1, Size::Large, Ack::Sync)).await;
        daemon.kill();
        let slots = scalar(&client, "SELECT count(*) FROM tallyd.slots").await;
        println!("kill {cycle}: {slots} slot rows committed, the rest journaled");
    }
    let daemon = rig.spawn().await;
    let mut c = LineClient::connect(&rig.socket()).await;
    assert_eq!(c.flush().await, (0, 0));
    rig.verify("after three kills").await;
    rig.roll_up_everything(None).await;
    rig.verify("rolled up").await;
    drop((c, traffic));
    assert!(daemon.terminate().success());
}

/// Two connections of every workload send rounds, each confirmed by `!flush`, for 8 s and 12
/// rounds at least (a correction in each of the corrections workload's), while every tallyd
/// session (flushes, rollups every 50 ms, the lease, the batch claims) is terminated every 20 to
/// 150 ms for the first 8 s: a retry
/// after a lost COMMIT is applied once, not twice, not even as an event count, and corrections
/// among the rounds stay in their place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backends_terminated_under_load() {
    let mut rng = seeded();
    let rig = Rig::start(workloads(), 1, |c| {
        c.flush.set_interval(Duration::from_millis(20));
        c.flush.connections = 2;
        c.rollup.enabled = true;
        c.rollup.set_interval(Duration::from_millis(50));
        c.rollup.batch_rows = 20;
    })
    .await;
    let daemon = rig.spawn().await;
    let mut traffic = Traffic::connect(&rig, 2, &mut rng).await;
    let terminator = Terminator::start(&rig.conninfos[0], Sessions::Tallyd, 20..150);
    let running = traffic.spawn(Plan::for_time(Duration::from_secs(8), 12, Ack::Flush));
    // The terminations last the plan's 8 s, not until its 12 rounds are done: on a loaded
    // machine a flight can take longer than the 20 to 150 ms between terminations at every
    // try, and a `!flush` then waited past the test's patience (seen in CI: a batches
    // connection, 120 s), while the rounds themselves must still complete once it stops.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let ended = terminator.stop().await;
    traffic.join(running).await;
    assert!(ended > 10, "the terminations must end sessions ({ended})");
    assert!(
        traffic.replies() > 20,
        "corrections must run ({})",
        traffic.replies()
    );
    println!(
        "{} rounds confirmed, {} corrections, {ended} sessions terminated",
        traffic.rounds(),
        traffic.replies()
    );
    rig.verify("under terminations").await;
    rig.roll_up_everything(None).await;
    rig.verify("rolled up").await;
    drop(traffic);
    assert!(daemon.terminate().success());
}

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

/// tallyd through PgBouncer in transaction mode, four server connections for its sessions
/// handed out round robin (consecutive transactions of one session run on different server
/// connections), every server connection terminated every 50 to 300 ms for 2 s while 6 rounds at
/// least are sent: the start (migrations,
/// the kinds check, the view), the flushes, the daemon's rollup every 50 ms and a rollup to the
/// end through the pooler, as `tallyd rollup` runs it. Every workload exact, and no statement
/// met another session's (no "prepared statement" or "portal" error in the server's log).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_in_transaction_mode() {
    let mut rng = seeded();
    let mut rig = Rig::start(workloads(), 1, |c| {
        c.flush.connections = 4;
        c.rollup.enabled = true;
        c.rollup.set_interval(Duration::from_millis(50));
        c.rollup.batch_rows = 100;
    })
    .await;
    let bouncer = Pgbouncer::start(rig.dir(), rig.pg(), "transaction", 4);
    round_robin(&bouncer, 4).await;
    let url = bouncer.url();
    rig.reconfigure(|c| c.database.url = url);
    let daemon = rig.spawn().await;
    let mut traffic = Traffic::connect(&rig, 1, &mut rng).await;
    let terminator = Terminator::start(&rig.conninfos[0], Sessions::All, 50..300);
    let running = traffic.spawn(Plan::for_time(Duration::from_secs(2), 6, Ack::Flush));
    // For the plan's 2 s only, as in `backends_terminated_under_load`: the rounds still waiting
    // complete after.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ended = terminator.stop().await;
    traffic.join(running).await;
    assert!(
        ended >= 6,
        "the terminations must end server connections ({ended})"
    );
    rig.verify("through PgBouncer").await;
    rig.roll_up_everything(Some(&bouncer.url())).await;
    rig.verify("rolled up through PgBouncer").await;
    let crossed = statements_crossed_in_the_pooler(rig.pg());
    assert!(crossed.is_empty(), "{crossed:#?}");
    drop(traffic);
    assert!(daemon.terminate().success());
    drop(bouncer);
}

/// A memory cap of 500 keys and 4 KiB reads: with the database up, large rounds pass the cap,
/// their reads are spilled to the journal and folded back as flushes make room. Then the
/// database is crash-stopped under load for 3 s: `!flush` waits for it, `!sync` is answered,
/// reads past the cap spill, a correction waits for the database. Every workload exact after
/// each, every spilled event folded back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spill_at_the_memory_cap_and_a_database_restart() {
    let mut rng = seeded();
    let mut rig = Rig::start(workloads(), 1, |c| {
        c.coalesce.max_pending_keys = 500;
        c.flush.max_pending_keys = 400;
        c.listen.read_buffer_bytes = 4096;
        c.flush.set_interval(Duration::from_millis(100));
    })
    .await;
    let daemon = rig.spawn().await;
    let mut traffic = Traffic::connect(&rig, 2, &mut rng).await;
    traffic.run(Plan::rounds(1, Size::Large, Ack::Flush)).await;
    rig.verify("spilled at the cap and folded back").await;
    let spilled = samples(&daemon)
        .await
        .value("tallyd_journal_spilled_events_total");
    assert!(spilled > 1000.0, "the cap spilled only {spilled} events");

    let running = traffic.spawn(Plan::for_time(Duration::from_secs(5), 3, Ack::Mixed));
    tokio::time::sleep(Duration::from_secs(1)).await;
    rig.pg_down().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    rig.pg_up().await;
    traffic.join(running).await;
    traffic.flush_all().await;
    rig.verify("after the database restart").await;
    let s = samples(&daemon).await;
    let (after, folded) = (
        s.value("tallyd_journal_spilled_events_total"),
        s.value("tallyd_journal_folded_events_total"),
    );
    assert!(
        after > spilled,
        "nothing spilled while the database was down"
    );
    assert_eq!(folded, after, "every spilled event folded back");
    println!("{after} events spilled and folded back");
    rig.roll_up_everything(None).await;
    rig.verify("rolled up").await;
    drop(traffic);
    assert!(daemon.terminate().success());
}

/// Every workload on two databases (slot rows and rolled-up rows), then a third database added
/// with `move_shards`: each key is on the database its shard maps to and exact (sums added,
/// sketches unioned, max, min and last merged, windows and their coarser spans, forgotten keys
/// still gone, what was folded into the application's table kept), a key's days union to its
/// all-time sketch, the new database took its share, and new rounds and rollups add to the
/// moved rows exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_move() {
    let mut rng = seeded();
    // Not the sets of rollup_into columns: a set on a key's new database cannot reach the row
    // the old database's table keeps (docs/reliability.md).
    let movable = workloads()
        .into_iter()
        .filter(|w| w.name() != "set_into")
        .collect();
    let mut rig = Rig::start(movable, 3, |c| c.database.shards.truncate(2)).await;
    let daemon = rig.spawn().await;
    let mut traffic = Traffic::connect(&rig, 1, &mut rng).await;
    traffic.run(Plan::rounds(2, Size::Large, Ack::Flush)).await;
    for conninfo in &rig.conninfos[..2] {
        let folded = scalar(&sql(conninfo).await, "SELECT tallyd.rollup(300)").await;
        assert!(folded > 0, "nothing rolled up");
    }
    traffic.run(Plan::rounds(1, Size::Large, Ack::Flush)).await;
    rig.verify("on two databases").await;
    assert!(daemon.terminate().success());

    let all = rig.conninfos.clone();
    rig.reconfigure(|c| {
        c.database.shards = all;
        c.database.move_shards = true;
    });
    let daemon = rig.spawn().await;
    assert!(daemon.terminate().success());
    rig.moved = true;
    rig.verify("after the move").await;
    let moved = scalar(
        &sql(&rig.conninfos[2]).await,
        "SELECT count(*) FROM tallyd.totals",
    )
    .await;
    assert!(
        moved > 100,
        "the new database took its share ({moved} keys)"
    );

    rig.reconfigure(|c| c.database.move_shards = false);
    let daemon = rig.spawn().await;
    traffic.reconnect(&rig).await;
    traffic.run(Plan::rounds(1, Size::Large, Ack::Flush)).await;
    rig.verify("new rounds after the move").await;
    rig.roll_up_everything(None).await;
    rig.verify("rolled up after the move").await;
    drop(traffic);
    assert!(daemon.terminate().success());
}

/// `tallyd.rollup(7)` in a loop on a session of its own (the daemon's schedule off) while two
/// connections of every workload send rounds confirmed by `!flush` for 5 s: every fold, set and
/// forget meets rows being folded; every workload exact, and the loop folded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beside_a_rollup_loop() {
    let mut rng = seeded();
    let rig = Rig::start(workloads(), 1, |c| {
        c.flush.set_interval(Duration::from_millis(50));
        c.flush.connections = 2;
    })
    .await;
    let daemon = rig.spawn().await;
    let mut traffic = Traffic::connect(&rig, 2, &mut rng).await;
    let rollups = RollupLoop::start(&rig.conninfos[0], 7).await;
    traffic
        .run(Plan::for_time(Duration::from_secs(5), 12, Ack::Flush))
        .await;
    let folded = rollups.stop().await;
    assert!(folded > 0, "the loop must fold");
    println!(
        "{folded} slot rows folded beside {} rounds",
        traffic.rounds()
    );
    rig.verify("beside a rollup loop").await;
    rig.roll_up_everything(None).await;
    rig.verify("rolled up").await;
    drop(traffic);
    assert!(daemon.terminate().success());
}

/// The application holds rows of its `rollup_into` tables (`FOR UPDATE`, 300 to 500 ms at a
/// time, past the direct writes' 200 ms `lock_timeout`) while every workload sends rounds and
/// the daemon's rollup runs every 50 ms: the direct workload's flights fall back to
/// `tallyd.slots` (counted by `tallyd_flush_direct_fallbacks_total`), the rollup skips the held
/// rows, a set of a held row waits for it; every workload exact, before and after everything is
/// rolled up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_application_holds_its_rows() {
    let mut rng = seeded();
    let rig = Rig::start(workloads(), 1, |c| {
        c.flush.set_interval(Duration::from_millis(50));
        c.flush.connections = 2;
        c.rollup.enabled = true;
        c.rollup.set_interval(Duration::from_millis(50));
        c.rollup.batch_rows = 20;
    })
    .await;
    let daemon = rig.spawn().await;
    let mut traffic = Traffic::connect(&rig, 2, &mut rng).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let app = {
        let (client, stop) = (sql(&rig.conninfos[0]).await, stop.clone());
        tokio::spawn(async move {
            let mut held = 0;
            let mut round: i64 = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                round += 1;
                let hold = 300 + (round * 67) % 200;
                client
                    .batch_execute(&format!(
                        "BEGIN; \
                         SELECT 1 FROM public.fault_downloads WHERE version_id % 3 = {r} FOR UPDATE; \
                         SELECT 1 FROM public.fault_repos WHERE id % 3 = {r} FOR UPDATE; \
                         SELECT 1 FROM public.fault_set_downloads WHERE version_id % 3 = {r} FOR UPDATE; \
                         SELECT pg_sleep({hold} / 1000.0); COMMIT",
                        r = round % 3
                    ))
                    .await
                    .expect("the application's transaction");
                held += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            held
        })
    };
    traffic
        .run(Plan::for_time(Duration::from_secs(6), 12, Ack::Flush))
        .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let held = app.await.unwrap();
    let fallbacks = samples(&daemon)
        .await
        .sum("tallyd_flush_direct_fallbacks_total")
        .unwrap_or(0.0);
    assert!(
        fallbacks >= 1.0,
        "a held row must send a direct flight through tallyd.slots ({held} holds)"
    );
    println!(
        "{} rounds, {held} holds by the application, {fallbacks} direct flights fell back",
        traffic.rounds()
    );
    rig.verify("while the application held rows").await;
    rig.roll_up_everything(None).await;
    rig.verify("rolled up").await;
    drop(traffic);
    assert!(daemon.terminate().success());
}

/// `DROP EXTENSION hll CASCADE` for 3 s under load (every workload, `!flush`, `!sync` and
/// unacknowledged rounds), then `CREATE EXTENSION hll`: the unique workload's rows are held
/// back (`tallyd_flush_unique_rows_held`); once the extension is back they commit and every
/// workload is exact. Dropped again and kill -9 while unique rows are held: the next start
/// (which creates the extension) replays them, and no other workload's line twice. That the
/// other counters' `!flush` is answered while rows are held is asserted by
/// `tests/kinds.rs::a_dropped_extension_holds_back_only_the_unique_rows`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hll_extension_dropped_under_load() {
    let mut rng = seeded();
    let rig = Rig::start(workloads(), 1, |c| {
        c.flush.set_interval(Duration::from_millis(50));
        c.flush.connections = 2;
    })
    .await;
    let client = sql(&rig.conninfos[0]).await;
    let daemon = rig.spawn().await;
    let mut traffic = Traffic::connect(&rig, 2, &mut rng).await;
    traffic.run(Plan::rounds(1, Size::Large, Ack::Flush)).await;
    rig.verify("before the drop").await;

    let running = traffic.spawn(Plan::for_time(Duration::from_secs(5), 3, Ack::Mixed));
    tokio::time::sleep(Duration::from_secs(1)).await;
    client
        .batch_execute("DROP EXTENSION hll CASCADE")
        .await
        .unwrap();
    unique_rows_held(&daemon).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    client.batch_execute("CREATE EXTENSION hll").await.unwrap();
    traffic.join(running).await;
    traffic.flush_all().await;
    rig.verify("after the extension came back").await;

    // Dropped again, rounds acknowledged by `!sync` (the unique ones cannot commit), kill -9.
    client
        .batch_execute("DROP EXTENSION hll CASCADE")
        .await
        .unwrap();
    traffic.run(Plan::rounds(2, Size::Small, Ack::Sync)).await;
    unique_rows_held(&daemon).await;
    daemon.kill();
    let daemon = rig.spawn().await;
    traffic.reconnect(&rig).await;
    traffic.flush_all().await;
    rig.verify("after kill -9 while unique rows were held")
        .await;
    rig.roll_up_everything(None).await;
    rig.verify("rolled up").await;
    drop(traffic);
    assert!(daemon.terminate().success());
}

/// Waits (10 s at most) until the daemon reports unique rows held back.
async fn unique_rows_held(daemon: &common::Daemon) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let held = samples(daemon)
            .await
            .sum("tallyd_flush_unique_rows_held")
            .unwrap_or(0.0);
        if held > 0.0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no unique row was held back while the extension was gone"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
