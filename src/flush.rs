//! Flush workers: each owns one PostgreSQL connection and a fixed share of the buckets, drains
//! them on a timer (or sooner when nudged) and writes the aggregates as batched, slotted upserts.
//!
//! Every key always travels through the same worker, and each worker writes its own slot, so no
//! two writers of this instance ever update the same row. A flush is one transaction that also
//! records `(instance_id, writer, seq)` in `tallyd.flushes`; after an error the worker reads that
//! row back to learn whether the flush committed, then retries exactly the same flight if it did
//! not. A failed flush is therefore never dropped and never applied twice.
//!
//! The transaction's statements, BEGIN to COMMIT, are sent at once (pipelined) and their answers
//! read afterwards, so the transaction never sits idle waiting on tallyd: a strict
//! `idle_in_transaction_session_timeout` (or a pooler's idle-transaction timeout) cannot end it.
//!
//! A statement that hits `statement_timeout` makes the worker retry the same flight (same seq,
//! one transaction) as more, smaller statements, halving the rows per statement down to one; the
//! size grows back after a run of clean commits.
//!
//! Every flush transaction first checks that its database's shard map version is still the one
//! read at the start (`tallyd.check_shard_map`): after another tallyd moved shards of that
//! database, this one's map no longer says which keys the database owns. Such a flush writes
//! nothing; the worker trips the [`Fence`], which stops the daemon, and gives its flight up once
//! the stop allows (it stays in the journal, replayed under the new map at the next start).
//!
//! The decisions are plain functions and structs, unit-tested below: `settle` (write a flight,
//! retry it as itself, or accept it as committed), `ChunkSize` and `Backoff`. The SQL is
//! issued only by `Conn::open` and `Conn::send`.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant, SystemTime};

use bytes::{Bytes, BytesMut};
use futures_util::future::{maybe_done, MaybeDone};
use rand::Rng;
use tokio::time::MissedTickBehavior;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{to_sql_checked, IsNull, ToSql, Type};
use tokio_postgres::{Client, Row};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::bucket::{BucketHandle, Correct, Drained, Entry};
use crate::clock::ms_to_time;
use crate::config::{CounterInfo, FlushConfig};
use crate::events;
use crate::health::Health;
use crate::hll::Sketch;
use crate::journal::Journal;
use crate::live::Live;
use crate::shared::Shared;
use crate::store::{Db, DbError, Ending};
use crate::window::{span_name, SpanCode, ALL_SPAN, ALL_TIME};

/// Opens a flush's transaction and marks it as one: the upserts and the ledger row write only
/// where `tallyd.flushing` is on, which this `SET LOCAL` makes true inside this transaction
/// block alone. The rest of the flush is sent right behind it, before its answer; were the
/// BEGIN to fail, each of those statements would run as a transaction of its own, and write
/// nothing. READ COMMITTED whatever the role's `default_transaction_isolation`: the shard map
/// check reads the version once its lock is granted, and `tallyd.record_flush` sees a copy of
/// the flight that committed while it waited, only with a snapshot per statement.
const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL tallyd.flushing = on";

/// The flush's upsert: `$columns` and `$unnest` add a kind's columns to the eight every row
/// has, `$set` merges them, `$update` follows the update and `$tail` the statement. Writes only
/// inside a flush's transaction (see [`BEGIN`]).
macro_rules! upsert {
    ($columns:literal, $unnest:literal, $set:literal, $update:literal, $tail:literal) => {
        concat!(
            "INSERT INTO tallyd.slots AS s (counter, key, span, win, slot, count, first_seen, last_seen",
            $columns,
            ")
SELECT c, k, sp, CASE WHEN w = -9223372036854775808 THEN '-infinity'::timestamptz
                      ELSE 'epoch'::timestamptz + w * interval '1 millisecond' END, sl, n, f, l",
            $columns,
            "
FROM unnest($1::text[], $2::text[], $3::int[], $4::bigint[], $5::timestamptz[], $6::timestamptz[],
            $7::text[], $8::bigint[]",
            $unnest,
            "
WHERE current_setting('tallyd.flushing', true) = 'on'
ON CONFLICT (counter, key, span, win, slot) DO UPDATE SET
    count = s.count + EXCLUDED.count,
    first_seen = LEAST(s.first_seen, EXCLUDED.first_seen),
    last_seen = GREATEST(s.last_seen, EXCLUDED.last_seen)",
            $set,
            $update,
            $tail
        )
    };
}

/// The flush's upsert for the rows of one kind family ([`Shape`]), as a macro so that each
/// statement is one constant: its plain and its returning form.
macro_rules! upserts {
    ($columns:literal, $unnest:literal, $set:literal) => {
        [
            upsert!($columns, $unnest, $set, "", ""),
            upsert!(
                $columns,
                $unnest,
                $set,
                "\nWHERE s.count::numeric + EXCLUDED.count BETWEEN -9223372036854775808 AND 9223372036854775807",
                "\nRETURNING s.counter, s.key, s.span,
    CASE WHEN s.win = '-infinity' THEN -9223372036854775808
         ELSE (extract(epoch FROM s.win) * 1000)::bigint END"
            ),
        ]
    };
}

/// Sums only: [0] writes; a stored total that would leave the 64-bit range fails the statement
/// (`bigint out of range`, SQLSTATE 22003) and with it the whole transaction, COMMIT included:
/// nothing of the flight is written, and it is written again with [1]. There the range guard
/// skips a row whose total would leave the 64-bit range, and the rows written come back, so the
/// skipped ones are known (and rejected) while the rest commits. [1] is also used always on
/// Citus.
const UPSERT_SUMS: [&str; 2] = upserts!("", ")\nAS u (c, k, sl, n, f, l, sp, w)", "");

/// Sums, max, min and last rows (migrations/V12): a max or min value kept by greatest or
/// least, a last value by the later `last_seen`, then the larger value. A sum's `kind` is NULL,
/// and its `value` stays NULL.
const UPSERT_VALUES: [&str; 2] = upserts!(
    ", kind, value",
    ", $9::text[], $10::bigint[])\nAS u (c, k, sl, n, f, l, sp, w, kind, value)",
    ",
    value = CASE s.kind
        WHEN 'max' THEN GREATEST(s.value, EXCLUDED.value)
        WHEN 'min' THEN LEAST(s.value, EXCLUDED.value)
        WHEN 'last' THEN CASE WHEN EXCLUDED.last_seen > s.last_seen
                                OR (EXCLUDED.last_seen = s.last_seen AND EXCLUDED.value > s.value)
                              THEN EXCLUDED.value ELSE s.value END
    END"
);

/// Every kind, unique rows among them: their sketches unioned by the hll extension's
/// `hll_union` (present wherever a unique counter is declared: src/store/kinds.rs), from and
/// back to the hll's own bytes.
const UPSERT_SKETCHES: [&str; 2] = upserts!(
    ", kind, value, sketch",
    ", $9::text[], $10::bigint[], $11::bytea[])\nAS u (c, k, sl, n, f, l, sp, w, kind, value, sketch)",
    ",
    value = CASE s.kind
        WHEN 'max' THEN GREATEST(s.value, EXCLUDED.value)
        WHEN 'min' THEN LEAST(s.value, EXCLUDED.value)
        WHEN 'last' THEN CASE WHEN EXCLUDED.last_seen > s.last_seen
                                OR (EXCLUDED.last_seen = s.last_seen AND EXCLUDED.value > s.value)
                              THEN EXCLUDED.value ELSE s.value END
    END,
    sketch = CASE WHEN s.sketch IS NULL OR EXCLUDED.sketch IS NULL THEN coalesce(s.sketch, EXCLUDED.sketch)
                  ELSE hll_send(hll_union(s.sketch::hll, EXCLUDED.sketch::hll)) END"
);

/// The flight's corrections (`!set`, `!forget`; migrations/V12, `tallyd.correct`): each key's
/// advisory lock (the rollup's), then its stored rows deleted: a set's window, a forget's every
/// row. Only inside a flush's transaction (see [`BEGIN`]).
const CORRECT: &str = "SELECT tallyd.correct($1::text[], $2::text[], $3::text[], $4::bigint[], \
     $5::boolean[], $6::bigint[], $7::bigint[], $8::int[], $9::int[], $10::text[], $11::bigint[])";

/// The flight's ledger row (migrations/V9, `tallyd.record_flush`): also checks, in the flush's
/// own transaction, that this daemon still holds its instance lease (store/lease.rs; a daemon
/// whose lease was taken over while it stalled writes nothing), and fails the transaction
/// (SQLSTATE TD002) when the writer's row already records this flight: a copy of a
/// transaction tallyd gave up on, which the server ran to its COMMIT meanwhile.
const RECORD: &str = "SELECT tallyd.record_flush($1, $5, $2, $3, $4)";

/// This writer's last committed seq (NULL: none), and whether the database is a Citus cluster.
const LAST_SEQ: &str = "\
SELECT (SELECT seq FROM tallyd.flushes WHERE instance_id = $1 AND writer = $2 AND owner = $3),
       EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')";

/// Which upsert a chunk needs: the narrowest that carries all its rows' kinds, so that a flight
/// of sums is written exactly as before kinds existed, and only a chunk with unique rows names
/// the hll extension's functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Shape {
    Sums,
    Values,
    Sketches,
}

impl Shape {
    fn of(entry: &Entry) -> Shape {
        match (entry.value.kind_name(), entry.value.sketch()) {
            (None, _) => Shape::Sums,
            (_, Some(_)) => Shape::Sketches,
            _ => Shape::Values,
        }
    }

    fn upsert(self, returning: bool) -> &'static str {
        let pair = match self {
            Shape::Sums => UPSERT_SUMS,
            Shape::Values => UPSERT_VALUES,
            Shape::Sketches => UPSERT_SKETCHES,
        };
        pair[usize::from(returning)]
    }
}

/// Identity of a writer: which slots it writes and how its flushes are recorded.
#[derive(Clone, Debug)]
pub struct WriterId {
    pub instance_id: String,
    /// Slot of connection 0; connection `i` writes `(slot_base + i) % slots`.
    pub slot_base: u64,
    /// The instance lease's owner token (this data_dir): the ledger rows are its own.
    pub owner: String,
}

/// A flush found its database's shard map changed since the start: another tallyd moved
/// logical shards there, so this one's map no longer says which keys belong to which database.
#[derive(Debug, thiserror::Error)]
#[error(
    "database {database}: {cause}. This tallyd stopped without writing by its old map; {}",
    if *.journal {
        "the events it had not written stay in its journal and are replayed, under the new map, \
         at its next start"
    } else {
        "the events it had not written are lost ([journal] enabled = false)"
    }
)]
pub struct MapChanged {
    pub database: usize,
    pub cause: DbError,
    pub journal: bool,
}

/// Tripped by the first flush that finds its database's shard map changed (see the module
/// docs): it keeps why, and cancels the tokens that stop the daemon.
pub struct Fence {
    found: Mutex<Option<MapChanged>>,
    on_trip: Vec<CancellationToken>,
}

impl Fence {
    /// A fence that cancels `on_trip` when tripped.
    pub fn new(on_trip: Vec<CancellationToken>) -> Fence {
        Fence {
            found: Mutex::new(None),
            on_trip,
        }
    }

    fn trip(&self, changed: MapChanged) {
        let mut found = self.found.lock().expect("fence");
        if found.is_none() {
            error!(database = changed.database, cause = %changed.cause,
                "the shard map changed under this tallyd (another one moved logical shards); stopping");
            *found = Some(changed);
        }
        for token in &self.on_trip {
            token.cancel();
        }
    }

    /// Why the fence was tripped, if it was (once).
    pub fn take(&self) -> Option<MapChanged> {
        self.found.lock().expect("fence").take()
    }
}

/// Everything the workers share.
pub struct FlushContext {
    pub db: Db,
    /// Index of `db` in config order: the `database` label of its metrics.
    pub database: usize,
    /// The database's shard map version read at the start with the map check: every flush
    /// transaction checks it first.
    pub map_version: i64,
    /// Tripped when that check fails.
    pub fence: Arc<Fence>,
    /// Both replaced by a reload (shared by every database's context): a flight reads them once.
    pub config: Arc<Live<FlushConfig>>,
    pub counters: Arc<Live<Vec<CounterInfo>>>,
    pub writer: WriterId,
    pub shared: Arc<Shared>,
    /// Ends the final flush's retries when the graceful stop runs out of time.
    pub abandon: CancellationToken,
    pub journal: Option<Arc<Journal>>,
    /// Where the status view reads this database's state (up, last flush, retries).
    pub health: Arc<Health>,
}

impl FlushContext {
    /// The slot worker `worker` writes for `counter`.
    fn slot(&self, counters: &[CounterInfo], worker: usize, counter: u16) -> i32 {
        let slots = counters[counter as usize].slots as u64;
        ((self.writer.slot_base + worker as u64) % slots) as i32
    }
}

/// A drained set of aggregates on its way to PostgreSQL, with its write identity.
struct Flight {
    /// Its number in this writer's ledger row; `None` until a try has a session to number it.
    seq: Option<i64>,
    parts: Vec<Drained>,
    rows: usize,
    events: u64,
    /// Journal records below this are wholly in this flight or earlier ones (0: no journal).
    drain_point: u64,
}

impl Flight {
    fn new(parts: Vec<Drained>, drain_point: u64) -> Flight {
        Flight {
            seq: None,
            rows: parts.iter().map(|d| d.entries.len()).sum(),
            events: parts.iter().map(|d| d.events).sum(),
            parts,
            drain_point,
        }
    }

    fn oldest(&self) -> Option<Instant> {
        self.parts.iter().filter_map(|d| d.since).min()
    }

    /// Its rows and events per counter, for the per-counter pending figures, and the start of
    /// the oldest window of the counter's own span (`primary`: not its `also` rows) it writes
    /// per windowed counter (`i64::MAX`: none).
    fn by_counter(&self, primary: impl Fn(u16) -> Option<SpanCode>) -> Vec<(usize, u64, i64)> {
        let mut out: Vec<(usize, u64, i64)> = Vec::new();
        for e in self.parts.iter().flat_map(|d| d.entries.iter()) {
            let c = e.counter as usize;
            if out.len() <= c {
                out.resize(c + 1, (0, 0, i64::MAX));
            }
            out[c].0 += 1;
            out[c].1 += e.agg.events;
            if e.span != ALL_SPAN && primary(e.counter) == Some(e.span) {
                out[c].2 = out[c].2.min(e.win);
            }
        }
        out
    }

    /// Answers the `!flush` waiters: their lines are now committed.
    fn release(self) {
        for waiter in self.parts.into_iter().flat_map(|d| d.waiters) {
            // Fails only when the waiting connection has gone: no one is left to tell.
            let _ = waiter.ack.try_send(waiter.rejected);
        }
    }
}

/// How writing a flight ended.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Committed,
    /// The stop deadline passed before it could be written: its events were not written.
    Abandoned,
}

/// What a try does with its flight, given the highest seq this writer is known to have committed.
#[derive(Debug, PartialEq, Eq)]
enum Settle {
    /// The flight's transaction committed on a connection that was lost before it said so.
    AlreadyCommitted,
    /// Write the flight as `seq`: a new number for a new flight, its own for a retry.
    Write { seq: i64 },
}

/// A flight that took at least a flush interval to commit means the database, not the timer,
/// sets the pace. Flushing again at once would write most of the same keys again a moment
/// later (at high cardinality nearly every key has new events by then), so the worker keeps
/// coalescing instead: its next flush comes one interval after this commit, and the early
/// flush at `flush.max_pending_keys` is ignored until a flight commits within the interval.
/// `!flush`, readers paused at the memory cap and the stop still flush at once.
fn database_behind(took: Duration, interval: Duration) -> bool {
    took >= interval
}

/// Only a numbered flight can have committed (a number is given just before its first write),
/// and the ledger row holds the last committed number, so `committed >= seq` means it did.
fn settle(flight: Option<i64>, committed: i64) -> Settle {
    match flight {
        Some(seq) if committed >= seq => Settle::AlreadyCommitted,
        Some(seq) => Settle::Write { seq },
        None => Settle::Write { seq: committed + 1 },
    }
}

/// This writer's standing with its database.
#[derive(Default)]
struct Session {
    /// `None` after an error: the connection may be broken or mid-transaction, so the next try
    /// opens a new one and reads the ledger to learn what committed.
    conn: Option<Conn>,
    /// The last flight this writer knows committed (0: none). Kept across connections.
    committed: i64,
}

/// One flush connection.
struct Conn {
    client: Client,
    /// Why the connection ended, once it has: what the server said, for the log.
    ending: Ending,
    /// Citus: the upserts always return the rows they wrote (see [`UPSERT_SUMS`]).
    citus: bool,
}

impl Conn {
    /// Connects and reads this writer's ledger row: whatever it committed last, possibly the
    /// flight whose COMMIT was lost with the previous connection (0: none).
    async fn open(ctx: &FlushContext, writer: i32) -> Result<(Conn, i64), DbError> {
        let (client, ending) = ctx.db.connect_watched().await?;
        let read = client
            .query_typed_one(
                LAST_SEQ,
                &[
                    (&ctx.writer.instance_id, Type::TEXT),
                    (&writer, Type::INT4),
                    (&ctx.writer.owner, Type::TEXT),
                ],
            )
            .await;
        let row = match read {
            Ok(row) => row,
            Err(err) => return Err(ending.explain(err.into()).await),
        };
        let committed: Option<i64> = row.get(0);
        let citus = row.get(1);
        let conn = Conn {
            client,
            ending,
            citus,
        };
        Ok((conn, committed.unwrap_or(0)))
    }

    /// Writes `chunks` (rows sorted) in one transaction with the ledger row
    /// `(writer, seq, covered)`. A total that would leave the 64-bit range fails the whole
    /// transaction; it is then written again, on the same connection, returning its rows, to
    /// learn which ones the range guard skipped (an overflow is rare; returning every row is
    /// not free).
    async fn write(
        &mut self,
        ctx: &FlushContext,
        corrections: Option<&Corrections>,
        chunks: &[Chunk<'_>],
        ledger: (i32, i64, i64),
    ) -> Result<(), DbError> {
        let mut returning = self.citus;
        loop {
            let sent = self.send(ctx, corrections, chunks, ledger, returning).await;
            match sent {
                Ok(written) => {
                    for (chunk, rows) in chunks.iter().zip(written) {
                        if let Some(rows) = rows.filter(|r| r.len() < chunk.rows.len()) {
                            reject_out_of_range(chunk, &rows);
                        }
                    }
                    return Ok(());
                }
                Err(Unsent { cause, ended }) => {
                    let overflow = cause.code() == Some(&SqlState::NUMERIC_VALUE_OUT_OF_RANGE);
                    if overflow && ended && !returning {
                        returning = true;
                        continue;
                    }
                    return Err(cause);
                }
            }
        }
    }

    /// One transaction, pipelined: BEGIN (with the database's timeouts), every chunk's upsert,
    /// the ledger row and COMMIT are all sent before any answer is read. Returns the rows each
    /// upsert returned (with `returning`).
    ///
    /// The transaction committed only if every statement succeeded: after an error the
    /// statements behind it fail at once (the transaction is aborted) and its COMMIT rolls back.
    async fn send(
        &self,
        ctx: &FlushContext,
        corrections: Option<&Corrections>,
        chunks: &[Chunk<'_>],
        ledger: (i32, i64, i64),
        returning: bool,
    ) -> Result<Vec<Option<Vec<Row>>>, Unsent> {
        let (writer, seq, covered) = ledger;
        // The shard map check comes first, before any row is locked: a move waits for this
        // transaction from here on, or this waits for the move (see migrations/V8). In BEGIN's
        // message, with the settings: a failed check aborts the transaction, so every statement
        // sent behind it fails and writes nothing.
        let check = format!("SELECT tallyd.check_shard_map({})", ctx.map_version);
        let begin = match ctx.db.transaction_settings() {
            Some(settings) => format!("{BEGIN}; {settings}; {check}"),
            None => format!("{BEGIN}; {check}"),
        };
        let (client, begin) = (&self.client, begin.as_str());
        let mut statements: Vec<Statement> = Vec::with_capacity(chunks.len() + 3);
        statements.push(Box::pin(async move {
            client.batch_execute(begin).await.map(|()| None)
        }));
        // Corrections first: the corrected keys' stored rows are deleted before this flight's
        // rows for them are written.
        if let Some(corrections) = corrections {
            statements.push(Box::pin(async move {
                client
                    .execute_typed(CORRECT, &corrections.params())
                    .await
                    .map(|_| None)
            }));
        }
        let first_chunk = 1 + usize::from(corrections.is_some());
        for chunk in chunks {
            statements.push(if returning {
                Box::pin(async move {
                    client
                        .query_typed(chunk.shape.upsert(true), &chunk.params())
                        .await
                        .map(Some)
                })
            } else {
                Box::pin(async move {
                    client
                        .execute_typed(chunk.shape.upsert(false), &chunk.params())
                        .await
                        .map(|_| None)
                })
            });
        }
        statements.push(Box::pin(async move {
            let record: [(&(dyn ToSql + Sync), Type); 5] = [
                (&ctx.writer.instance_id, Type::TEXT),
                (&writer, Type::INT4),
                (&seq, Type::INT8),
                (&covered, Type::INT8),
                (&ctx.writer.owner, Type::TEXT),
            ];
            client.execute_typed(RECORD, &record).await.map(|_| None)
        }));
        statements.push(Box::pin(async move {
            client.batch_execute("COMMIT").await.map(|()| None)
        }));
        let mut replies = in_order(statements).await;
        // The server answered COMMIT: the transaction is over (committed or rolled back) and
        // the connection waits for the next.
        let ended = matches!(replies.last(), Some(Some(Ok(_))));
        let mut written = Vec::with_capacity(chunks.len());
        // A statement never sent comes after the one whose failure stopped the sending, which
        // is returned first.
        for (i, reply) in replies.drain(..).flatten().enumerate() {
            match reply {
                Ok(rows) if (first_chunk..first_chunk + chunks.len()).contains(&i) => {
                    written.push(rows)
                }
                Ok(_) => {}
                Err(err) => {
                    return Err(Unsent {
                        cause: err.into(),
                        ended,
                    })
                }
            }
        }
        Ok(written)
    }
}

/// A flush transaction that did not commit: the first statement that failed (the ones behind
/// it failed because it did), and whether the server ended the transaction (it answered the
/// COMMIT, as a rollback), so that the connection can be used again.
struct Unsent {
    cause: DbError,
    ended: bool,
}

/// One statement of a pipelined transaction; a returning upsert answers with its rows.
type Statement<'a> =
    Pin<Box<dyn Future<Output = Result<Option<Vec<Row>>, tokio_postgres::Error>> + Send + 'a>>;

/// Queues every statement, in order, then waits for all the answers. tokio-postgres queues a
/// statement when its future is first polled and pipelines whatever it has been given on the
/// one connection: polling each future once, in order, before any answer can arrive, puts them
/// on the wire in that order.
///
/// A statement that fails at its first poll was never sent (its parameters did not encode):
/// the statements behind it, COMMIT among them, are then never sent either (`None`), so the
/// transaction cannot commit without it. The caller drops the connection, and the server rolls
/// back what was sent.
async fn in_order<F, T, E>(statements: Vec<F>) -> Vec<Option<Result<T, E>>>
where
    F: Future<Output = Result<T, E>> + Unpin,
{
    let mut all: Vec<MaybeDone<F>> = statements.into_iter().map(maybe_done).collect();
    // How many statements were sent (polled at least once).
    let mut sent = 0;
    let mut halted = false;
    std::future::poll_fn(|cx| {
        let mut done = true;
        for (i, statement) in all.iter_mut().enumerate() {
            if halted && i >= sent {
                break;
            }
            let first = i >= sent;
            let ready = Pin::new(&mut *statement).poll(cx).is_ready();
            if first {
                sent = i + 1;
                if ready && matches!(&*statement, MaybeDone::Done(Err(_))) {
                    halted = true;
                }
            }
            done &= ready;
        }
        if done {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    all.iter_mut()
        .enumerate()
        .map(|(i, s)| (i < sent).then(|| Pin::new(s).take_output().expect("answered")))
        .collect()
}

/// The rows of `chunk` its upsert did not return (`written`) are the ones the range guard
/// skipped: their events are rejected (reason `overflow`), the rest of the flush commits. A
/// stored total that would leave the 64-bit range is never wrapped, and must not make the flush
/// fail forever.
fn reject_out_of_range(chunk: &Chunk<'_>, written: &[Row]) {
    let written: std::collections::HashSet<(&str, &str, &str, i64)> = written
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    for e in chunk.rows {
        let counter = chunk.counters[e.counter as usize].name.as_str();
        let row = (counter, e.key.as_str(), span_name(e.span), e.win);
        if !written.contains(&row) {
            events::ValueOverflow {
                counter,
                key: &e.key,
                events: e.agg.events,
            }
            .emit();
        }
    }
}

/// Rows per upsert statement: `batch_rows`, halved after each statement timeout (down to one),
/// doubled again after [`REGROW_AFTER`] clean commits in a row.
#[derive(Debug)]
struct ChunkSize {
    rows: usize,
    batch_rows: usize,
    /// Commits since the last statement timeout.
    clean_commits: u32,
}

/// Clean commits after which a reduced statement size doubles again.
const REGROW_AFTER: u32 = 16;

impl ChunkSize {
    fn new(batch_rows: usize) -> ChunkSize {
        ChunkSize {
            rows: batch_rows,
            batch_rows,
            clean_commits: 0,
        }
    }

    /// A statement of a flight of `flight_rows` timed out: returns the size before and after.
    fn shrink(&mut self, flight_rows: usize) -> (usize, usize) {
        self.clean_commits = 0;
        let was = self.rows;
        self.rows = (was.min(flight_rows) / 2).max(1);
        (was, self.rows)
    }

    /// A flight committed: returns the new size if it grew back.
    fn committed(&mut self) -> Option<usize> {
        if self.rows >= self.batch_rows {
            return None;
        }
        self.clean_commits += 1;
        if self.clean_commits < REGROW_AFTER {
            return None;
        }
        self.clean_commits = 0;
        self.rows = (self.rows * 2).min(self.batch_rows);
        Some(self.rows)
    }
}

/// The wait before retrying a failed flight: doubling from `retry_initial_ms` up to
/// `retry_max_ms`, plus up to half again of jitter so that workers do not retry in step.
struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    fn new(config: &FlushConfig) -> Backoff {
        Backoff {
            next: config.retry_initial(),
            max: config.retry_max(),
        }
    }

    fn wait(&mut self) -> Duration {
        let jitter = rand::thread_rng().gen_range(0..=self.next.as_millis() as u64 / 2);
        let wait = self.next + Duration::from_millis(jitter);
        self.next = (self.next * 2).min(self.max);
        wait
    }
}

/// Ticks every `period`, the first one period from now.
fn new_ticker(period: Duration) -> tokio::time::Interval {
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticker
}

pub struct FlushWorker {
    index: usize,
    buckets: Vec<BucketHandle>,
    ctx: Arc<FlushContext>,
    chunks: ChunkSize,
    session: Session,
}

impl FlushWorker {
    pub fn new(index: usize, buckets: Vec<BucketHandle>, ctx: Arc<FlushContext>) -> FlushWorker {
        FlushWorker {
            index,
            buckets,
            chunks: ChunkSize::new(ctx.config.get().batch_rows),
            ctx,
            session: Session::default(),
        }
    }

    /// Flushes every `interval_ms`, or at once when nudged, until `stop`; then drains until
    /// nothing is left (the caller cancels `stop` only after every connection has finished).
    pub async fn run(mut self, stop: CancellationToken) {
        // The first flush comes one interval after the start, not at once: at the start there is
        // nothing to flush, and a transaction opened then would only hold the lease row's lock.
        let mut period = self.ctx.config.get().interval();
        let mut ticker = new_ticker(period);
        let mut behind = false;
        loop {
            // A reload may change `flush.interval_ms`: the next wait is the new period.
            let now = self.ctx.config.get().interval();
            if now != period {
                period = now;
                ticker = new_ticker(period);
            }
            let stopping = stop.is_cancelled();
            if !stopping {
                tokio::select! {
                    _ = ticker.tick() => {}
                    _ = self.ctx.shared.nudged(self.index) => {}
                    _ = self.ctx.shared.nudged_early(self.index), if !behind => {}
                    _ = stop.cancelled() => {}
                }
            }
            let (parts, drain_point) = self.drain().await;
            let flight = Flight::new(parts, drain_point);
            if flight.rows == 0 {
                // Nothing of this writer's is pending below the drain point: covered as it is.
                if let Some(journal) = &self.ctx.journal {
                    journal.committed(self.index, drain_point);
                }
                flight.release();
                if stopping {
                    break;
                }
                continue;
            }
            let started = tokio::time::Instant::now();
            if self.commit(flight).await == Outcome::Abandoned {
                break;
            }
            behind = database_behind(started.elapsed(), period);
            if behind {
                ticker.reset();
            }
            events::Pending {
                keys: self.ctx.shared.pending_keys(),
                events: self.ctx.shared.pending_events(),
            }
            .emit();
        }
        debug!(worker = self.index, "flush worker stopped");
    }

    /// Drains this worker's buckets. With a journal, the drains are queued under its gate, so
    /// they take whole records: every record below the returned drain point, none above.
    async fn drain(&self) -> (Vec<Drained>, u64) {
        let queue = async {
            let mut replies = Vec::with_capacity(self.buckets.len());
            for bucket in &self.buckets {
                match bucket.drain().await {
                    Ok(reply) => replies.push(reply),
                    Err(err) => error!(worker = self.index, cause = %err, "cannot drain"),
                }
            }
            replies
        };
        let (replies, drain_point) = match &self.ctx.journal {
            Some(journal) => journal.drain(queue).await,
            None => (queue.await, 0),
        };
        let mut parts = Vec::with_capacity(replies.len());
        for reply in replies {
            match reply.recv().await {
                Ok(drained) => parts.push(drained),
                Err(err) => error!(worker = self.index, cause = %err, "drain not answered"),
            }
        }
        (parts, drain_point)
    }

    /// Writes `flight` until it commits, or until the stop deadline abandons it.
    async fn commit(&mut self, mut flight: Flight) -> Outcome {
        let ctx = self.ctx.clone();
        let mut backoff = Backoff::new(&ctx.config.get());
        let mut attempt = 0u32;
        ctx.shared.set_flight_oldest(self.index, flight.oldest());
        loop {
            let started = Instant::now();
            match self.attempt(&mut flight).await {
                Ok(()) => {
                    self.committed(flight, started.elapsed(), attempt);
                    return Outcome::Committed;
                }
                Err(err) if err.is_shard_map_changed() => {
                    ctx.fence.trip(MapChanged {
                        database: ctx.database,
                        cause: err,
                        journal: ctx.journal.is_some(),
                    });
                    // Kept (unanswered) until the stop has closed the connections: a `!flush`
                    // waiting for this flight must not be answered as if it had committed.
                    ctx.abandon.cancelled().await;
                    error!(
                        worker = self.index,
                        rows = flight.rows,
                        events = flight.events,
                        "not written: the shard map changed under this tallyd"
                    );
                    return Outcome::Abandoned;
                }
                Err(err) => self.failed(&flight, &err),
            }
            attempt += 1;
            tokio::select! {
                _ = tokio::time::sleep(backoff.wait()) => {}
                _ = ctx.abandon.cancelled() => {
                    error!(worker = self.index, rows = flight.rows, events = flight.events,
                        "stop deadline reached: these pending events were not written");
                    return Outcome::Abandoned;
                }
            }
            events::FlushRetry.emit();
            ctx.health.flush_retry(ctx.database);
        }
    }

    /// `flight` committed after `attempt` failed tries: accounts for it and answers its waiters.
    fn committed(&mut self, flight: Flight, took: Duration, attempt: u32) {
        let ctx = &self.ctx;
        ctx.shared.set_flight_oldest(self.index, None);
        if let Some(now) = self.chunks.committed() {
            info!(worker = self.index, now, "flush statements grow again");
        }
        ctx.health.flushed(ctx.database);
        events::FlushCommitted {
            database: ctx.database,
            rows: flight.rows,
            events: flight.events,
            took,
            oldest_age: flight.oldest().map(|t| t.elapsed()),
        }
        .emit();
        let counters = ctx.counters.get();
        let primary = |c: u16| {
            let window = counters.get(c as usize)?.window.as_ref()?;
            Some(window.span().code())
        };
        for (counter, (rows, events, oldest)) in flight.by_counter(primary).into_iter().enumerate()
        {
            ctx.shared.remove_counter_pending(counter, rows, events);
            if let (Some(info), true) = (counters.get(counter), oldest < i64::MAX) {
                events::OldestWindowWritten {
                    counter: &info.name,
                    start_ms: oldest,
                }
                .emit();
            }
        }
        ctx.shared.remove_pending(flight.rows, flight.events);
        if let Some(journal) = &ctx.journal {
            journal.committed(self.index, flight.drain_point);
        }
        if attempt > 0 {
            info!(
                worker = self.index,
                seq = flight.seq,
                attempts = attempt + 1,
                "flush committed after retries"
            );
        }
        flight.release();
    }

    /// A try of `flight` failed: the next one starts on a new connection.
    fn failed(&mut self, flight: &Flight, err: &DbError) {
        self.ctx.health.flush_failed(self.ctx.database, err);
        events::FlushFailed {
            worker: self.index,
            seq: flight.seq,
            database: self.ctx.database,
            rows: flight.rows,
            unreachable: err.is_connect() || err.is_closed(),
            cause: err,
        }
        .emit();
        if err.is_statement_timeout() {
            self.shrink_chunks(flight);
        }
        self.session.conn = None;
    }

    /// A statement of `flight` hit `statement_timeout`: the same flight is retried with half as
    /// many rows per statement (same seq, still one transaction, so still exactly once).
    fn shrink_chunks(&mut self, flight: &Flight) {
        let (was, now) = self.chunks.shrink(flight.rows);
        if now < was {
            warn!(worker = self.index, seq = flight.seq, rows = flight.rows, was, now,
                "flush statement hit statement_timeout; retrying the same flight as smaller statements");
        } else {
            error!(worker = self.index, seq = flight.seq, rows = flight.rows,
                "flush statement hit statement_timeout even at one row per statement; raise statement_timeout (flush.statement_timeout_ms or the database's setting)");
        }
    }

    /// One try: connect if needed, settle the previous try's outcome, write, commit.
    async fn attempt(&mut self, flight: &mut Flight) -> Result<(), DbError> {
        let writer = self.index as i32;
        let session = &mut self.session;
        if let Some(conn) = session.conn.take_if(|c| c.client.is_closed()) {
            // Ended while idle (the server's idle_session_timeout, a restart, an operator): no
            // flush failed; a new connection reads the ledger, as after any other loss.
            match conn.ending.reason().await {
                Some(cause) => info!(worker = self.index, %cause,
                    "the database closed the idle flush connection; reconnecting"),
                None => info!(
                    worker = self.index,
                    "the idle flush connection closed; reconnecting"
                ),
            }
        }
        if session.conn.is_none() {
            let (conn, ledger) = Conn::open(&self.ctx, writer).await?;
            session.conn = Some(conn);
            session.committed = session.committed.max(ledger);
        }
        let seq = match settle(flight.seq, session.committed) {
            Settle::AlreadyCommitted => {
                info!(
                    worker = self.index,
                    seq = flight.seq,
                    "flush had committed before the connection was lost"
                );
                return Ok(());
            }
            Settle::Write { seq } => seq,
        };
        flight.seq = Some(seq);
        let ctx = Arc::clone(&self.ctx);
        // One view of the counters for the whole flight (a reload may add some meanwhile).
        let counters = ctx.counters.get();
        let mut rows = sorted_rows(flight, &counters);
        let corrections = Corrections::of(&rows, flight, &counters, |c| {
            ctx.slot(&counters, self.index, c)
        });
        if corrections.is_some() {
            // A key a correction emptied, with no event since, has no row to write (only a
            // correction empties an entry: a flight without one skips this pass).
            rows.retain(|e| !e.agg.is_empty());
        }
        let chunks: Vec<Chunk> = rows
            .chunks(self.chunks.rows)
            .map(|chunk| Chunk::new(chunk, &counters, |c| ctx.slot(&counters, self.index, c)))
            .collect();
        // Every journal record below the drain point has all of this writer's events in this
        // flight or an earlier one, which committed before it.
        let covered = flight.drain_point.saturating_sub(1) as i64;
        let conn = self.session.conn.as_mut().expect("connected above");
        let ledger = (writer, seq, covered);
        if let Err(err) = conn
            .write(&ctx, corrections.as_ref(), &chunks, ledger)
            .await
        {
            let conn = self.session.conn.take().expect("connected above");
            return Err(conn.ending.explain(err).await);
        }
        self.session.committed = seq;
        Ok(())
    }
}

/// The flight's rows sorted by (counter name, key, window), so that every statement locks its rows in
/// index order, and writers that share rows (instances whose slots collide) lock them in the
/// same order. Each comparison first looks at a sort key held in the vector itself (the
/// counter's rank by name, the key's first 8 bytes big-endian), and touches the entries only
/// when those tie: with a million keys the entries are far out of cache, and dereferencing two
/// of them per comparison was most of the sort's time.
fn sorted_rows<'f>(flight: &'f Flight, counters: &[CounterInfo]) -> Vec<&'f Entry> {
    let rank = name_ranks(counters);
    let mut keyed: Vec<(u16, u64, &Entry)> = flight
        .parts
        .iter()
        .flat_map(|d| d.entries.iter())
        .map(|e| (rank[e.counter as usize], key_prefix(&e.key), e))
        .collect();
    keyed.sort_unstable_by(|a, b| {
        (a.0, a.1)
            .cmp(&(b.0, b.1))
            .then_with(|| a.2.key.as_bytes().cmp(b.2.key.as_bytes()))
            .then_with(|| (a.2.span, a.2.win).cmp(&(b.2.span, b.2.win)))
    });
    keyed.into_iter().map(|(_, _, e)| e).collect()
}

/// Each counter's position in name order.
fn name_ranks(counters: &[CounterInfo]) -> Vec<u16> {
    let mut by_name: Vec<usize> = (0..counters.len()).collect();
    by_name.sort_unstable_by(|&a, &b| counters[a].name.cmp(&counters[b].name));
    let mut rank = vec![0u16; counters.len()];
    for (r, &c) in by_name.iter().enumerate() {
        rank[c] = r as u16;
    }
    rank
}

/// The corrections of a flight, in its rows' order (so that keys are locked in the order the
/// upserts lock them), as `tallyd.correct`'s arrays.
#[derive(Default)]
struct Corrections {
    counters: Vec<String>,
    keys: Vec<String>,
    spans: Vec<&'static str>,
    wins: Vec<i64>,
    forgets: Vec<bool>,
    /// A windowed sum's set: its value and what it superseded in memory (see
    /// [`crate::bucket::SetNote`]), the slot this writer writes, and the rows beside its
    /// window, which move by the window's difference (`beside_of`: the correction's index,
    /// from 1).
    values: Vec<Option<i64>>,
    superseded: Vec<i64>,
    slots: Vec<i32>,
    beside_of: Vec<i32>,
    beside_spans: Vec<&'static str>,
    beside_wins: Vec<i64>,
}

impl Corrections {
    /// Forgets first (a forget and a set of one key in one flight: the set's window is among
    /// what the forget deletes, and its total is written after), then sets, each in row order.
    fn of(
        rows: &[&Entry],
        flight: &Flight,
        counters: &[CounterInfo],
        slot_of: impl Fn(u16) -> i32,
    ) -> Option<Corrections> {
        let mut corrected: Vec<&Entry> = rows
            .iter()
            .copied()
            .filter(|e| e.reset != Correct::None)
            .collect();
        if corrected.is_empty() {
            return None;
        }
        // Stable: each kind keeps the rows' order.
        corrected.sort_by_key(|e| e.reset != Correct::Forget);
        let mut out = Corrections::default();
        for e in corrected {
            let info = &counters[e.counter as usize];
            out.counters.push(info.name.clone());
            out.keys.push(e.key.to_string());
            out.spans.push(span_name(e.span));
            out.wins.push(e.win);
            out.forgets.push(e.reset == Correct::Forget);
            out.slots.push(slot_of(e.counter));
            let note = flight.parts.iter().flat_map(|d| &d.sets).find(|n| {
                (n.counter, n.span, n.win) == (e.counter, e.span, e.win) && n.key == e.key
            });
            let (value, superseded) = match note {
                Some(n) if e.reset == Correct::Set => (Some(n.value), n.superseded),
                _ => (None, 0),
            };
            out.values.push(value);
            out.superseded.push(superseded);
            if value.is_some() && e.win != ALL_TIME {
                for (span, win) in info.beside(e.win) {
                    out.beside_of.push(out.keys.len() as i32);
                    out.beside_spans.push(span);
                    out.beside_wins.push(win);
                }
            }
        }
        (!out.keys.is_empty()).then_some(out)
    }

    fn params(&self) -> [(&(dyn ToSql + Sync), Type); 11] {
        [
            (&self.counters, Type::TEXT_ARRAY),
            (&self.keys, Type::TEXT_ARRAY),
            (&self.spans, Type::TEXT_ARRAY),
            (&self.wins, Type::INT8_ARRAY),
            (&self.forgets, Type::BOOL_ARRAY),
            (&self.values, Type::INT8_ARRAY),
            (&self.superseded, Type::INT8_ARRAY),
            (&self.slots, Type::INT4_ARRAY),
            (&self.beside_of, Type::INT4_ARRAY),
            (&self.beside_spans, Type::TEXT_ARRAY),
            (&self.beside_wins, Type::INT8_ARRAY),
        ]
    }
}

/// The first 8 bytes of `key`, big-endian, zero-padded: ordered as the keys are, except that
/// keys sharing their first 8 bytes (or differing only by trailing NULs) tie.
fn key_prefix(key: &str) -> u64 {
    let mut prefix = [0u8; 8];
    let n = key.len().min(8);
    prefix[..n].copy_from_slice(&key.as_bytes()[..n]);
    u64::from_be_bytes(prefix)
}

/// One upsert statement: its rows, and its eight column arrays already in PostgreSQL's binary
/// format. Encoding them before the transaction begins leaves the pipeline only copies to make,
/// so that BEGIN is never left waiting for the first upsert while its rows are encoded.
struct Chunk<'a> {
    rows: &'a [&'a Entry],
    counters: &'a [CounterInfo],
    shape: Shape,
    /// Eight columns for sums, ten with values, eleven with sketches.
    columns: Vec<Encoded>,
}

impl<'a> Chunk<'a> {
    fn new(
        rows: &'a [&'a Entry],
        counters: &'a [CounterInfo],
        slot_of: impl Fn(u16) -> i32,
    ) -> Chunk<'a> {
        let names: Vec<&str> = rows
            .iter()
            .map(|e| counters[e.counter as usize].name.as_str())
            .collect();
        let keys: Vec<&str> = rows.iter().map(|e| e.key.as_str()).collect();
        let slots: Vec<i32> = rows.iter().map(|e| slot_of(e.counter)).collect();
        let counts: Vec<i64> = rows.iter().map(|e| e.agg.sum).collect();
        let first: Vec<SystemTime> = rows.iter().map(|e| ms_to_time(e.agg.first_ms)).collect();
        let last: Vec<SystemTime> = rows.iter().map(|e| ms_to_time(e.agg.last_ms)).collect();
        let spans: Vec<&str> = rows.iter().map(|e| span_name(e.span)).collect();
        let wins: Vec<i64> = rows.iter().map(|e| e.win).collect();
        let mut buf = BytesMut::new();
        let mut columns = vec![
            Encoded::new(&names, Type::TEXT_ARRAY, &mut buf),
            Encoded::new(&keys, Type::TEXT_ARRAY, &mut buf),
            Encoded::new(&slots, Type::INT4_ARRAY, &mut buf),
            Encoded::new(&counts, Type::INT8_ARRAY, &mut buf),
            Encoded::new(&first, Type::TIMESTAMPTZ_ARRAY, &mut buf),
            Encoded::new(&last, Type::TIMESTAMPTZ_ARRAY, &mut buf),
            Encoded::new(&spans, Type::TEXT_ARRAY, &mut buf),
            Encoded::new(&wins, Type::INT8_ARRAY, &mut buf),
        ];
        let shape = rows
            .iter()
            .map(|e| Shape::of(e))
            .max()
            .unwrap_or(Shape::Sums);
        if shape >= Shape::Values {
            let kinds: Vec<Option<&str>> = rows.iter().map(|e| e.value.kind_name()).collect();
            let values: Vec<Option<i64>> = rows.iter().map(|e| e.value.number()).collect();
            columns.push(Encoded::new(&kinds, Type::TEXT_ARRAY, &mut buf));
            columns.push(Encoded::new(&values, Type::INT8_ARRAY, &mut buf));
        }
        if shape == Shape::Sketches {
            let sketches: Vec<Option<Vec<u8>>> = rows
                .iter()
                .map(|e| e.value.sketch().map(Sketch::to_bytes))
                .collect();
            columns.push(Encoded::new(&sketches, Type::BYTEA_ARRAY, &mut buf));
        }
        Chunk {
            rows,
            counters,
            shape,
            columns,
        }
    }

    /// The upsert's parameters, typed: an unnamed statement (Parse, Bind, Execute in one round
    /// trip), so that a transaction pooler may hand each transaction to another server
    /// connection (docs/operations.md).
    fn params(&self) -> Vec<(&(dyn ToSql + Sync), Type)> {
        self.columns
            .iter()
            .map(|c| (c as &(dyn ToSql + Sync), c.ty.clone()))
            .collect()
    }
}

/// A parameter already encoded (as `ty`), or why it could not be: the error comes back where
/// tokio-postgres would have met it, when the statement is sent.
#[derive(Debug)]
struct Encoded {
    ty: Type,
    value: Result<Bytes, String>,
}

impl Encoded {
    fn new(value: &(dyn ToSql + Sync), ty: Type, buf: &mut BytesMut) -> Encoded {
        let value = match value.to_sql_checked(&ty, buf) {
            Ok(_) => Ok(buf.split().freeze()),
            Err(err) => {
                buf.clear();
                Err(err.to_string())
            }
        };
        Encoded { ty, value }
    }
}

impl ToSql for Encoded {
    fn to_sql(
        &self,
        _: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match &self.value {
            Ok(bytes) => {
                out.extend_from_slice(bytes);
                Ok(IsNull::No)
            }
            Err(err) => Err(err.clone().into()),
        }
    }

    /// Its own type, checked when it was encoded.
    fn accepts(_: &Type) -> bool {
        true
    }

    to_sql_checked!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::{Agg, Value, Waiter};
    use tokio::sync::mpsc;

    /// A statement that fails at its first poll (never sent) stops the sending: the ones
    /// behind it, COMMIT among them, are never polled, so never put on the wire.
    #[tokio::test]
    async fn a_statement_that_fails_unsent_stops_the_pipeline() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let polled: Arc<[AtomicUsize; 4]> = Arc::new(Default::default());
        let statement = |i: usize, fails: bool| {
            let polled = polled.clone();
            Box::pin(async move {
                polled[i].fetch_add(1, Ordering::SeqCst);
                if fails {
                    Err(format!("statement {i} did not encode"))
                } else {
                    tokio::task::yield_now().await;
                    Ok(i)
                }
            }) as Pin<Box<dyn Future<Output = Result<usize, String>> + Send>>
        };
        let replies = in_order(vec![
            statement(0, false),
            statement(1, true),
            statement(2, false),
            statement(3, false),
        ])
        .await;
        assert_eq!(
            replies,
            vec![
                Some(Ok(0)),
                Some(Err("statement 1 did not encode".to_string())),
                None,
                None
            ]
        );
        let polled: Vec<usize> = polled.iter().map(|p| p.load(Ordering::SeqCst)).collect();
        assert_eq!(polled, [1, 1, 0, 0]);
        // Without a failure, every statement is sent and answered in order.
        let replies = in_order((0..4).map(|i| statement(i, false)).collect()).await;
        assert_eq!(replies, (0..4).map(|i| Some(Ok(i))).collect::<Vec<_>>());
    }

    #[test]
    fn a_new_flight_takes_the_next_number() {
        assert_eq!(settle(None, 0), Settle::Write { seq: 1 });
        assert_eq!(settle(None, 41), Settle::Write { seq: 42 });
    }

    #[test]
    fn a_flight_the_ledger_holds_is_accepted_as_committed() {
        // The COMMIT of flight 7 reached the database, the answer did not.
        assert_eq!(settle(Some(7), 7), Settle::AlreadyCommitted);
    }

    #[test]
    fn a_flight_the_ledger_lacks_is_retried_as_itself() {
        // Flight 7 failed before its COMMIT: same number, never a new one (which would let a
        // later settle take flight 8 for committed when only 7 is missing).
        assert_eq!(settle(Some(7), 6), Settle::Write { seq: 7 });
    }

    #[test]
    fn statement_timeouts_halve_chunks_and_clean_commits_regrow_them() {
        let mut c = ChunkSize::new(1000);
        assert_eq!(c.committed(), None, "full size does not grow");
        // A flight smaller than the chunk halves from its own size.
        assert_eq!(c.shrink(300), (1000, 150));
        assert_eq!(c.shrink(300), (150, 75));
        for _ in 1..REGROW_AFTER {
            assert_eq!(c.committed(), None);
        }
        assert_eq!(c.committed(), Some(150));
        assert_eq!(c.shrink(1), (150, 1));
        assert_eq!(c.shrink(1), (1, 1), "never below one row");
    }

    #[test]
    fn rows_sort_by_counter_name_then_key_bytes() {
        // Counter 0 is "b", counter 1 is "a": name order, not index order, comes first. Keys
        // share 8-byte prefixes, differ past them, or only by trailing NULs.
        let counters: Vec<CounterInfo> =
            ["b", "a"].iter().map(|n| CounterInfo::new(n, 1)).collect();
        let keys = [
            "k1",
            "k10",
            "k2",
            "",
            "abcdefgh",
            "abcdefghz",
            "abcdefgha",
            "abc\0",
            "abc",
            "z",
            "abcdefgh\0",
            "é",
            "e",
        ];
        let mut entries = hashbrown::HashTable::new();
        for (i, key) in keys.iter().enumerate() {
            for counter in 0..2u16 {
                let hash = (i * 2 + counter as usize) as u64;
                let entry = Entry {
                    hash,
                    counter,
                    span: crate::window::ALL_SPAN,
                    win: crate::window::ALL_TIME,
                    key: (*key).into(),
                    agg: Agg {
                        sum: 1,
                        first_ms: 0,
                        last_ms: 0,
                        events: 1,
                    },
                    value: Value::SUM,
                    reset: Correct::None,
                };
                entries.insert_unique(hash, entry, |e: &Entry| e.hash);
            }
        }
        let drained = Drained {
            entries,
            ..Drained::default()
        };
        let flight = Flight::new(vec![drained], 0);
        let got: Vec<(&str, &str)> = sorted_rows(&flight, &counters)
            .iter()
            .map(|e| (counters[e.counter as usize].name.as_str(), e.key.as_str()))
            .collect();
        let mut want = got.clone();
        want.sort();
        assert_eq!(got, want);
        assert_eq!(got.len(), 2 * keys.len());
        assert_eq!(got[0], ("a", ""));
    }

    fn flight(ack: mpsc::Sender<u64>) -> Flight {
        let mut entries = hashbrown::HashTable::new();
        let agg = Agg {
            sum: 3,
            first_ms: 1,
            last_ms: 2,
            events: 2,
        };
        let entry = Entry {
            hash: 9,
            counter: 0,
            span: crate::window::ALL_SPAN,
            win: crate::window::ALL_TIME,
            key: "k".into(),
            agg,
            value: Value::SUM,
            reset: Correct::None,
        };
        entries.insert_unique(9, entry, |e: &Entry| e.hash);
        let drained = Drained {
            entries,
            events: 2,
            waiters: vec![Waiter { ack, rejected: 0 }],
            since: Some(Instant::now()),
            sets: Vec::new(),
        };
        Flight::new(vec![drained], 0)
    }

    /// A database that refuses every connection (no server at that socket path): a real
    /// connection error, no mock.
    fn unreachable(shared: Arc<Shared>, abandon: CancellationToken) -> Arc<FlushContext> {
        let dir = tempfile::tempdir().unwrap();
        let conninfo = format!("host={} user=tallyd dbname=tallyd", dir.path().display());
        Arc::new(FlushContext {
            db: Db::new(&conninfo, Duration::from_secs(1)).unwrap(),
            database: 0,
            map_version: 1,
            fence: Arc::new(Fence::new(Vec::new())),
            config: Arc::new(Live::new(FlushConfig::default())),
            counters: Arc::new(Live::new(vec![CounterInfo::new("c", 4)])),
            writer: WriterId {
                instance_id: "test".into(),
                slot_base: 0,
                owner: "owner".into(),
            },
            shared,
            abandon,
            journal: None,
            health: crate::health::Health::detached(),
        })
    }

    #[tokio::test]
    async fn a_flight_that_cannot_be_written_is_abandoned_at_the_stop_deadline() {
        let shared = Arc::new(Shared::new(1, 1, 100, 100));
        shared.reserve(2);
        shared.add_pending(1, 2, 2);
        let abandon = CancellationToken::new();
        abandon.cancel();
        let ctx = unreachable(shared.clone(), abandon);
        let mut worker = FlushWorker::new(0, Vec::new(), ctx);
        let (ack, mut acks) = mpsc::channel(1);
        assert_eq!(worker.commit(flight(ack)).await, Outcome::Abandoned);
        // Nothing is counted as written, and the waiting `!flush` hears no success.
        assert_eq!((shared.pending_keys(), shared.pending_events()), (1, 2));
        assert_eq!(acks.recv().await, None, "the waiter is dropped unanswered");
        assert_eq!(worker.session.committed, 0);
    }
}
