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
//! Kinds ride the same argument. A max, min or last value or a sketch is written in its row's
//! `value` or `sketch` column by the same upsert, merged with the stored row by the kind's rule
//! ([`crate::kind`]); that merge is idempotent, so only `count` (the events) needs the ledger,
//! as a sum's total does. A retry writes the same flight again, never merged with newer events,
//! so a `last` value keeps the event time it was drained with.
//!
//! Corrections (`!set`, `!forget`) are entries of the flight too, marked by their bucket. The
//! flight's transaction runs `tallyd.correct` before its upserts: the corrected keys' stored
//! rows are deleted (a set's window, a forget's every row, in every slot) under the rollup's
//! per-key lock and the table lock that orders corrections against every other writer, then the
//! upserts write the keys' new totals. The deletes commit with the ledger row, so a correction
//! is applied exactly once as well: a retry that finds the flight committed does nothing, one
//! that does not deletes and writes again, all of it.
//!
//! A flight the database refuses for a reason a retry of the same flight cannot cure is not
//! retried as itself: a key whose total would leave the 64-bit range leaves the flight whole
//! (`take_out`), and a set `tallyd.correct` refuses (SQLSTATE TD003) is taken out and answered
//! `error overflow` (`refuse`); the rest is written at once, in the same ledgered transaction.
//!
//! A flight the database refuses because the hll extension is gone (`DROP EXTENSION hll
//! CASCADE`) is not retried as itself either: its unique rows are held back by the worker
//! ([`held`]) and the rest commits at once; each later flight asks whether the extension is
//! back, and carries the held rows again once it is (after making `tallyd.unique_totals`
//! again). Until then the ledger and the journal keep the held rows' lines uncovered.
//!
//! The decisions are plain functions and structs, unit-tested below: `settle` (write a flight,
//! retry it as itself, or accept it as committed), `ChunkSize` and `Backoff`. Files by job:
//! this one the worker loop and its decisions; [`sql`] the statements' text; [`pipeline`] the
//! pipelined transaction (the SQL is issued only by `Conn::open` and `Conn::send`); [`rows`]
//! the flight's rows, sorted, chunked and encoded, and its corrections; [`overflow`] the keys
//! and sets taken out at the 64-bit edge.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use compact_str::CompactString;

use crate::bucket::{BucketHandle, Correct, Drained, Entry};
use crate::config::{Counter, FlushConfig};
use crate::events;
use crate::health::Health;
use crate::journal::Journal;
use crate::live::Live;
use crate::shared::Shared;
use crate::store::{Db, DbError};
use crate::window::{SpanCode, ALL_SPAN};
pub use direct::Fallback;
use held::Held;
use pipeline::{Conn, Failed, Written};
use retry::{database_behind, settle, Backoff, ChunkSize, Settle};
use rows::{sorted_rows, Chunk, Corrections, DirectChunk};

mod direct;
mod held;
mod overflow;
mod pipeline;
mod retry;
mod rows;
mod sql;

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
    pub counters: Arc<Live<Vec<Counter>>>,
    pub writer: WriterId,
    pub shared: Arc<Shared>,
    /// Ends the final flush's retries when the graceful stop runs out of time.
    pub abandon: CancellationToken,
    pub journal: Option<Arc<Journal>>,
    /// Where the status view reads this database's state (up, last flush, retries).
    pub health: Arc<Health>,
    /// Which counters write through `tallyd.slots` for now, after a direct write failed.
    pub direct: Arc<Fallback>,
}

impl FlushContext {
    /// The slot worker `worker` writes for `counter`.
    fn slot(&self, counters: &[Counter], worker: usize, counter: u16) -> i32 {
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
    /// A set of it was refused (see [`FlushWorker::refuse`]).
    refused: bool,
}

impl Flight {
    fn new(parts: Vec<Drained>, drain_point: u64) -> Flight {
        Flight {
            seq: None,
            rows: parts.iter().map(|d| d.entries.len()).sum(),
            events: parts.iter().map(|d| d.events).sum(),
            parts,
            drain_point,
            refused: false,
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
            waiter.answer();
        }
    }
}

/// How one try of a flight ended, when the database did not fail it.
enum Tried {
    Committed,
    /// Nothing was written: these keys (counter, key) have a row whose total would leave the
    /// 64-bit range, with this flight's rows added.
    Overflowed(Vec<(u16, CompactString)>),
    /// Nothing was written: `tallyd.correct` refused this correction (counter, key, span,
    /// window): its set would move a row beside its window beyond the 64-bit range.
    Refused {
        id: (u16, CompactString, SpanCode, i64),
        cause: DbError,
    },
    /// Nothing was written: the flight has unique rows and the database lacks the hll
    /// extension (it was dropped).
    NoExtension(DbError),
}

/// How writing a flight ended.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Committed,
    /// The stop deadline passed before it could be written: its events were not written.
    Abandoned,
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
    /// Unique rows held back while the hll extension is gone (see [`held`]).
    held: Held,
    /// While unique rows are held: the drain point below which this writer's unique lines
    /// are all committed (what the journal and the ledger keep covered for them).
    held_from: Option<u64>,
    /// The drain point of the last flight that committed everything it drained.
    whole: u64,
}

impl FlushWorker {
    pub fn new(index: usize, buckets: Vec<BucketHandle>, ctx: Arc<FlushContext>) -> FlushWorker {
        FlushWorker {
            index,
            buckets,
            chunks: ChunkSize::new(ctx.config.get().batch_rows),
            ctx,
            session: Session::default(),
            held: Held::default(),
            held_from: None,
            whole: 0,
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
            if flight.rows == 0 && self.held.is_empty() {
                // Nothing of this writer's is pending below the drain point: covered as it is.
                if let Some(journal) = &self.ctx.journal {
                    journal.committed(self.index, drain_point);
                }
                self.whole = drain_point;
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
            if stopping && !self.held.is_empty() {
                // The stop waits for the extension as a flight waits for its database.
                tokio::select! {
                    _ = tokio::time::sleep(period) => {}
                    _ = self.ctx.abandon.cancelled() => {
                        error!(worker = self.index, rows = self.held.rows, events = self.held.events,
                            "stop deadline reached: these unique counters' events were not written (the hll extension is missing); they stay in the journal");
                        break;
                    }
                }
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
        if !self.held.is_empty() {
            self.hold_or_put_back(&mut flight).await;
        }
        ctx.shared.set_flight_oldest(self.index, flight.oldest());
        if let Some(journal) = &ctx.journal {
            // A correction's record can hold parts for several flush workers (a `!forget *`):
            // none commits before the record is durable, or a kill -9 could lose the other
            // parts with it and leave the key half forgotten. Corrections are rare; the wait
            // is at most one fsync interval. A journal that cannot be written does not hold
            // the flush (its events are safest committed).
            let corrects = flight
                .parts
                .iter()
                .flat_map(|d| d.entries.iter())
                .any(|e| e.reset != Correct::None);
            if corrects {
                if let Err(cause) = journal.sync().await {
                    warn!(worker = self.index, %cause,
                        "a flush with a correction goes on although its journal record is not yet durable");
                }
            }
            // A batch's events commit only once the record that settles its held payload is
            // durable (docs/reliability.md, "Batches"); a flight drained before every batch
            // record not yet known durable does not wait.
            let mut logged = false;
            while let Err(cause) = journal.durable_below(flight.drain_point).await {
                if !std::mem::replace(&mut logged, true) {
                    error!(worker = self.index, %cause, "a flush of a batch's events waits for the journal to be written");
                }
                tokio::select! {
                    _ = tokio::time::sleep(crate::journal::RETRY_EVERY) => {}
                    _ = ctx.abandon.cancelled() => {
                        error!(worker = self.index, rows = flight.rows, events = flight.events,
                            "stop deadline reached: these pending events were not written");
                        return Outcome::Abandoned;
                    }
                }
            }
        }
        loop {
            let started = Instant::now();
            match self.attempt(&mut flight).await {
                Ok(Tried::Committed) => {
                    self.committed(flight, started.elapsed(), attempt);
                    return Outcome::Committed;
                }
                // A retry of the same flight can never succeed: the flight is written again at
                // once without what the database cannot take (see `take_out`, `refuse`).
                Ok(Tried::Overflowed(keys)) => {
                    self.take_out(&mut flight, &keys).await;
                    continue;
                }
                Ok(Tried::Refused { id, cause }) => {
                    self.refuse(&mut flight, &id, &cause).await;
                    continue;
                }
                Ok(Tried::NoExtension(cause)) => {
                    self.hold(&mut flight, &cause);
                    continue;
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
        if self.held.is_empty() {
            if self.held_from.take().is_some() {
                info!(
                    worker = self.index,
                    database = ctx.database,
                    "the hll extension is back: the unique rows held back are written"
                );
                events::UniqueHeld::released(ctx.database, self.index);
            }
            self.whole = flight.drain_point;
        }
        if let Some(journal) = &ctx.journal {
            journal.committed(self.index, self.held_from.unwrap_or(flight.drain_point));
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
    async fn attempt(&mut self, flight: &mut Flight) -> Result<Tried, DbError> {
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
                return Ok(Tried::Committed);
            }
            Settle::Write { seq } => seq,
        };
        flight.seq = Some(seq);
        let ctx = Arc::clone(&self.ctx);
        // One view of the counters for the whole flight (a reload may add some meanwhile).
        let counters = ctx.counters.get();
        // A `rollup_into` target's set is written into the application's row by
        // tallyd.correct: the flight writes only the events after it there.
        let after_sets = rows::after_target_sets(flight, &counters);
        let mut rows = sorted_rows(flight, &counters);
        let corrections = Corrections::of(&rows, flight, &counters, |c| {
            ctx.slot(&counters, self.index, c)
        });
        rows::swap_in(&mut rows, &after_sets);
        if corrections.is_some() || flight.refused {
            // A key a correction emptied, with no event since, has no row to write, nor a
            // refused set with nothing else (only these empty an entry: a flight without
            // either skips this pass).
            rows.retain(|e| !e.agg.is_empty());
        }
        // Every journal record below the drain point has all of this writer's events in this
        // flight or an earlier one, which committed before it.
        let covered = flight.drain_point.saturating_sub(1) as i64;
        // While unique rows are held back, their lines stay uncovered (see `held`); a flight
        // that carries every held row again covers them (`held_from` is cleared only once it
        // commits, and a ledger row left below would replay committed unique lines).
        let unique_covered = match self.held_from {
            Some(from) if !self.held.is_empty() => from.saturating_sub(1) as i64,
            _ => covered,
        };
        let ledger = (writer, seq, covered, unique_covered);
        let conn = self.session.conn.as_mut().expect("connected above");
        if let Err(err) = conn.targets_for(&counters).await {
            let conn = self.session.conn.take().expect("connected above");
            return Err(conn.ending.explain(err).await);
        }
        let conn = self.session.conn.as_ref().expect("connected above");
        let slot_of = |c| ctx.slot(&counters, self.index, c);
        // Each try writes the flight again with the same seq: after a direct statement failed,
        // the server rolled the whole transaction back, and its counter's rows go through
        // tallyd.slots this time. A counter turned off stays off, so this ends.
        loop {
            let planned = Instant::now();
            let plan = direct::plan(&rows, &counters, &conn.targets, &ctx.direct, planned);
            let chunks: Vec<Chunk> = plan
                .slots
                .chunks(self.chunks.rows)
                .map(|chunk| Chunk::new(chunk, &counters, slot_of))
                .collect();
            let mut direct_chunks: Vec<DirectChunk> = Vec::new();
            for group in &plan.direct {
                let counter = group.counter;
                let target = conn
                    .targets
                    .of(&counters[counter as usize])
                    .expect("planned with its target");
                for rows in group.target.chunks(self.chunks.rows) {
                    direct_chunks.push(if target.compact {
                        DirectChunk::compact(counter, &target.sql, rows)
                    } else {
                        DirectChunk::full(
                            counter,
                            &target.sql,
                            rows,
                            &counters,
                            target.shape,
                            slot_of,
                        )
                    });
                }
                for rows in group.also.chunks(self.chunks.rows) {
                    direct_chunks.push(DirectChunk::full(
                        counter,
                        sql::ALSO_UPSERT.as_str(),
                        rows,
                        &counters,
                        sql::Shape::Sums,
                        slot_of,
                    ));
                }
            }
            match conn
                .write(&ctx, corrections.as_ref(), &chunks, &direct_chunks, ledger)
                .await
            {
                Ok(Written::Committed) => {
                    ctx.direct
                        .succeeded(plan.direct.iter().map(|g| g.counter), planned);
                    break;
                }
                Ok(Written::Overflowed(keys)) => return Ok(Tried::Overflowed(keys)),
                Err(Failed::Direct { counter, cause }) => {
                    let off = ctx.direct.failed(counter, Instant::now());
                    events::DirectWriteFailed {
                        counter: &counters[counter as usize].name,
                        database: ctx.database,
                        cause: &cause,
                        off,
                    }
                    .emit();
                }
                Err(Failed::Other(err)) => {
                    let conn = self.session.conn.take().expect("connected above");
                    let err = conn.ending.explain(err).await;
                    let unique = |e: &&Entry| e.value.kind() == Some(crate::kind::Kind::Unique);
                    if err.is_missing_hll() && rows.iter().any(unique) {
                        return Ok(Tried::NoExtension(err));
                    }
                    let refused = err.refused_correction();
                    return match refused.and_then(|i| corrections.as_ref()?.at(i)) {
                        Some(id) => Ok(Tried::Refused {
                            id: id.clone(),
                            cause: err,
                        }),
                        None => Err(err),
                    };
                }
            }
        }
        self.session.committed = seq;
        Ok(Tried::Committed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::{Acked, Agg, Entry, Waiter};
    use crate::kind::Value;
    use tokio::sync::mpsc;

    fn flight(ack: mpsc::Sender<Acked>) -> Flight {
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
            waiters: vec![Waiter {
                ack,
                conn: 1,
                rejected: 0,
                refused: Vec::new(),
            }],
            since: Some(Instant::now()),
            sets: Vec::new(),
            bucket: 0,
            unique_conns: Vec::new(),
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
            counters: Arc::new(Live::new(vec![Counter::new("c", 4)])),
            writer: WriterId {
                instance_id: "test".into(),
                slot_base: 0,
                owner: "owner".into(),
            },
            shared,
            abandon,
            journal: None,
            health: crate::health::Health::detached(),
            direct: Arc::new(Fallback::new()),
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
