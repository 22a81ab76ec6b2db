//! Flush workers: each owns one PostgreSQL connection and a fixed share of the buckets, drains
//! them on a timer (or sooner when nudged) and writes the aggregates as batched, slotted upserts.
//!
//! Every key always travels through the same worker, and each worker writes its own slot, so no
//! two writers of this instance ever update the same row. A flush is one transaction that also
//! records `(instance_id, writer, seq)` in `tallyd.flushes`; after an error the worker reads that
//! row back to learn whether the flush committed, then retries exactly the same flight if it did
//! not. A failed flush is therefore never dropped and never applied twice.
//!
//! A statement that hits `statement_timeout` makes the worker retry the same flight (same seq,
//! one transaction) as more, smaller statements, halving the rows per statement down to one; the
//! size grows back after a run of clean commits.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::future::try_join_all;
use rand::Rng;
use tokio::time::MissedTickBehavior;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::bucket::{BucketHandle, Drained, Entry};
use crate::config::FlushConfig;
use crate::journal::Journal;
use crate::metrics;
use crate::shared::Shared;
use crate::store::{Db, DbError};
use crate::throttle::Throttle;

const UPSERT: &str = "\
INSERT INTO tallyd.slots AS s (counter, key, slot, count, first_seen, last_seen)
SELECT * FROM unnest($1::text[], $2::text[], $3::int[], $4::bigint[], $5::timestamptz[], $6::timestamptz[])
ON CONFLICT (counter, key, slot) DO UPDATE SET
    count = s.count + EXCLUDED.count,
    first_seen = LEAST(s.first_seen, EXCLUDED.first_seen),
    last_seen = GREATEST(s.last_seen, EXCLUDED.last_seen)
WHERE s.count::numeric + EXCLUDED.count BETWEEN -9223372036854775808 AND 9223372036854775807
RETURNING s.counter, s.key";

/// Also checks, in the flush's own transaction, that this daemon still holds its instance
/// lease (store/lease.rs): a daemon whose lease was taken over while it stalled writes nothing.
const RECORD: &str = "\
INSERT INTO tallyd.flushes AS f (instance_id, owner, writer, seq, journal_covered, committed_at)
SELECT $1, $5, $2, $3, $4, now() WHERE tallyd.check_lease($1, $5)
ON CONFLICT (instance_id, owner, writer) DO UPDATE SET
    seq = EXCLUDED.seq,
    journal_covered = GREATEST(f.journal_covered, EXCLUDED.journal_covered),
    committed_at = EXCLUDED.committed_at";

const LAST_SEQ: &str =
    "SELECT seq FROM tallyd.flushes WHERE instance_id = $1 AND writer = $2 AND owner = $3";

/// What a counter needs at flush time.
#[derive(Clone, Debug)]
pub struct CounterInfo {
    pub name: String,
    pub slots: u32,
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

/// Everything the workers share.
pub struct FlushContext {
    pub db: Db,
    /// Index of `db` in config order: the `database` label of its metrics.
    pub database: usize,
    pub config: FlushConfig,
    pub counters: Arc<[CounterInfo]>,
    pub writer: WriterId,
    pub shared: Arc<Shared>,
    /// Ends the final flush's retries when the graceful stop runs out of time.
    pub abandon: CancellationToken,
    pub journal: Option<Arc<Journal>>,
}

/// A drained set of aggregates on its way to PostgreSQL, with its write identity.
struct Flight {
    seq: i64,
    parts: Vec<Drained>,
    rows: usize,
    events: u64,
    /// Journal records below this are wholly in this flight or earlier ones (0: no journal).
    drain_point: u64,
}

impl Flight {
    fn oldest(&self) -> Option<Instant> {
        self.parts.iter().filter_map(|d| d.since).min()
    }

    /// Answers the `!flush` waiters: their lines are now committed.
    fn release(self) {
        for waiter in self.parts.into_iter().flat_map(|d| d.waiters) {
            let _ = waiter.ack.try_send(waiter.rejected);
        }
    }
}

struct Conn {
    client: Client,
}

pub struct FlushWorker {
    index: usize,
    buckets: Vec<BucketHandle>,
    ctx: Arc<FlushContext>,
    /// Rows per upsert statement: `batch_rows`, less after statement timeouts.
    chunk_rows: AtomicUsize,
    /// Commits since the last statement timeout (to grow `chunk_rows` back).
    clean_commits: AtomicU32,
}

/// Clean commits after which a reduced statement size doubles again.
const REGROW_AFTER: u32 = 16;

static FLUSH_ERROR_LOG: Throttle = Throttle::new(1000);

impl FlushWorker {
    pub fn new(index: usize, buckets: Vec<BucketHandle>, ctx: Arc<FlushContext>) -> FlushWorker {
        let chunk_rows = AtomicUsize::new(ctx.config.batch_rows);
        FlushWorker {
            index,
            buckets,
            ctx,
            chunk_rows,
            clean_commits: AtomicU32::new(0),
        }
    }

    /// Flushes every `interval_ms`, or at once when nudged, until `stop`; then drains until
    /// nothing is left (the caller cancels `stop` only after every connection has finished).
    pub async fn run(self, stop: CancellationToken) {
        // The first flush comes one interval after the start, not at once: at the start there is
        // nothing to flush, and a transaction opened then would only hold the lease row's lock.
        let period = Duration::from_millis(self.ctx.config.interval_ms);
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut conn: Option<Conn> = None;
        let mut seq: Option<i64> = None;
        loop {
            let stopping = stop.is_cancelled();
            if !stopping {
                tokio::select! {
                    _ = ticker.tick() => {}
                    _ = self.ctx.shared.nudged(self.index) => {}
                    _ = stop.cancelled() => {}
                }
            }
            let (parts, drain_point) = self.drain().await;
            let rows: usize = parts.iter().map(|d| d.entries.len()).sum();
            let events: u64 = parts.iter().map(|d| d.events).sum();
            let flight = Flight {
                seq: 0,
                parts,
                rows,
                events,
                drain_point,
            };
            if rows == 0 {
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
            if !self.commit(flight, &mut conn, &mut seq).await {
                break;
            }
            metrics::pending(
                self.ctx.shared.pending_keys(),
                self.ctx.shared.pending_events(),
            );
        }
        debug!(worker = self.index, "flush worker stopped");
    }

    /// Drains this worker's buckets. With a journal, the drains are queued under its gate, so
    /// they take whole records: every record below the returned drain point, none above.
    async fn drain(&self) -> (Vec<Drained>, u64) {
        let mut replies = Vec::with_capacity(self.buckets.len());
        let gate = match &self.ctx.journal {
            Some(journal) => Some(journal.drain_gate().await),
            None => None,
        };
        for bucket in &self.buckets {
            replies.extend(bucket.request_drain().await);
        }
        let drain_point = gate.map_or(0, |(_, point)| point);
        let mut parts = Vec::with_capacity(replies.len());
        for reply in replies {
            parts.extend(reply.await.ok());
        }
        (parts, drain_point)
    }

    /// Writes `flight` until it commits. Returns false only if the stop deadline abandoned it.
    async fn commit(
        &self,
        mut flight: Flight,
        conn: &mut Option<Conn>,
        seq: &mut Option<i64>,
    ) -> bool {
        let ctx = &self.ctx;
        let mut backoff = Duration::from_millis(ctx.config.retry_initial_ms);
        let mut attempt = 0u32;
        ctx.shared.set_flight_oldest(self.index, flight.oldest());
        loop {
            let started = Instant::now();
            let result = self.attempt(&mut flight, conn, seq).await;
            match result {
                Ok(()) => {
                    ctx.shared.set_flight_oldest(self.index, None);
                    self.regrow_chunks();
                    metrics::database_up(ctx.database, true);
                    let age = flight.oldest().map(|t| t.elapsed());
                    metrics::flush_committed(flight.rows, flight.events, started.elapsed(), age);
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
                    return true;
                }
                Err(err) => {
                    metrics::database_up(ctx.database, false);
                    metrics::flush_failed();
                    if let Some(suppressed) = FLUSH_ERROR_LOG.allow() {
                        warn!(worker = self.index, seq = flight.seq, rows = flight.rows, cause = %err, suppressed, "flush failed; will retry");
                    }
                    if err.is_statement_timeout() {
                        self.shrink_chunks(&flight);
                    }
                    // The connection may be broken or mid-transaction: start over on a new one.
                    *conn = None;
                }
            }
            attempt += 1;
            let jitter = rand::thread_rng().gen_range(0..=backoff.as_millis() as u64 / 2);
            let wait = backoff + Duration::from_millis(jitter);
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = ctx.abandon.cancelled() => {
                    error!(worker = self.index, rows = flight.rows, events = flight.events,
                        "stop deadline reached: these pending events were not written");
                    return false;
                }
            }
            backoff = (backoff * 2).min(Duration::from_millis(ctx.config.retry_max_ms));
            metrics::flush_retry();
        }
    }

    /// A statement of `flight` hit `statement_timeout`: the same flight is retried with half as
    /// many rows per statement (same seq, still one transaction, so still exactly once).
    fn shrink_chunks(&self, flight: &Flight) {
        self.clean_commits.store(0, Ordering::Relaxed);
        let was = self.chunk_rows.load(Ordering::Relaxed);
        let now = (was.min(flight.rows) / 2).max(1);
        self.chunk_rows.store(now, Ordering::Relaxed);
        if now < was {
            warn!(worker = self.index, seq = flight.seq, rows = flight.rows, was, now,
                "flush statement hit statement_timeout; retrying the same flight as smaller statements");
        } else {
            error!(worker = self.index, seq = flight.seq, rows = flight.rows,
                "flush statement hit statement_timeout even at one row per statement; raise statement_timeout (flush.statement_timeout_ms or the database's setting)");
        }
    }

    /// After [`REGROW_AFTER`] clean commits, doubles a reduced statement size (up to
    /// `batch_rows`), so a passing slowdown does not leave flushes small for good.
    fn regrow_chunks(&self) {
        let batch_rows = self.ctx.config.batch_rows;
        let chunk_rows = self.chunk_rows.load(Ordering::Relaxed);
        if chunk_rows >= batch_rows {
            return;
        }
        if self.clean_commits.fetch_add(1, Ordering::Relaxed) + 1 >= REGROW_AFTER {
            self.clean_commits.store(0, Ordering::Relaxed);
            let now = (chunk_rows * 2).min(batch_rows);
            self.chunk_rows.store(now, Ordering::Relaxed);
            info!(worker = self.index, now, "flush statements grow again");
        }
    }

    /// One try: connect if needed, settle the previous try's outcome, write, commit.
    async fn attempt(
        &self,
        flight: &mut Flight,
        conn: &mut Option<Conn>,
        seq: &mut Option<i64>,
    ) -> Result<(), DbError> {
        let ctx = &self.ctx;
        let writer = self.index as i32;
        if conn.is_none() {
            let client = ctx.db.connect().await?;
            // Whatever this writer committed last, possibly the flight whose COMMIT we lost.
            let row = client
                .query_typed_opt(
                    LAST_SEQ,
                    &[
                        (&ctx.writer.instance_id, Type::TEXT),
                        (&writer, Type::INT4),
                        (&ctx.writer.owner, Type::TEXT),
                    ],
                )
                .await?;
            let committed: i64 = row.map_or(0, |r| r.get(0));
            if flight.seq != 0 && committed >= flight.seq {
                info!(
                    worker = self.index,
                    seq = flight.seq,
                    "flush had committed before the connection was lost"
                );
                *seq = Some(committed);
                *conn = Some(Conn { client });
                return Ok(());
            }
            *seq = Some(committed.max(seq.unwrap_or(0)));
            *conn = Some(Conn { client });
        }
        let conn = conn.as_mut().expect("connected above");
        if flight.seq == 0 {
            flight.seq = seq.unwrap_or(0) + 1;
        }
        self.write(conn, flight, writer).await?;
        *seq = Some(flight.seq);
        Ok(())
    }

    async fn write(&self, conn: &mut Conn, flight: &Flight, writer: i32) -> Result<(), DbError> {
        let ctx = &self.ctx;
        // Sorted so that every statement locks its rows in index order.
        let mut rows: Vec<&Entry> = flight.parts.iter().flat_map(|d| d.entries.iter()).collect();
        rows.sort_unstable_by(|a, b| {
            let (na, nb) = (
                &ctx.counters[a.counter as usize].name,
                &ctx.counters[b.counter as usize].name,
            );
            na.cmp(nb).then_with(|| a.key.cmp(&b.key))
        });
        let slot_of = |counter: u16| -> i32 {
            let slots = ctx.counters[counter as usize].slots as u64;
            ((ctx.writer.slot_base + self.index as u64) % slots) as i32
        };
        let tx = conn.client.transaction().await?;
        if let Some(settings) = ctx.db.transaction_settings() {
            tx.batch_execute(settings).await?;
        }
        let chunks: Vec<Chunk> = rows
            .chunks(self.chunk_rows.load(Ordering::Relaxed))
            .map(|chunk| Chunk::new(chunk, &ctx.counters, slot_of))
            .collect();
        // Issued together: tokio-postgres pipelines them on the one connection.
        // Unnamed statements (Parse, Bind, Execute in one round trip) so that a transaction
        // pooler may hand each transaction to another server connection (docs/operations.md).
        let txr = &tx;
        let applied = try_join_all(chunks.iter().map(|c| async move {
            let params: [(&(dyn ToSql + Sync), Type); 6] = [
                (&c.counters, Type::TEXT_ARRAY),
                (&c.keys, Type::TEXT_ARRAY),
                (&c.slots, Type::INT4_ARRAY),
                (&c.counts, Type::INT8_ARRAY),
                (&c.first, Type::TIMESTAMPTZ_ARRAY),
                (&c.last, Type::TIMESTAMPTZ_ARRAY),
            ];
            txr.query_typed(UPSERT, &params).await
        }))
        .await?;
        // The rows written come back (RETURNING), not an affected-row count: on Citus that
        // count includes the rows the range guard skipped (docs/scaling.md).
        for (chunk, written) in chunks.iter().zip(applied) {
            if written.len() < chunk.keys.len() {
                self.reject_out_of_range(chunk, &written, &rows);
            }
        }
        // Every journal record below the drain point has all of this writer's events in this
        // flight or an earlier one, which committed before it.
        let covered = flight.drain_point.saturating_sub(1) as i64;
        tx.execute_typed(
            RECORD,
            &[
                (&ctx.writer.instance_id, Type::TEXT),
                (&writer, Type::INT4),
                (&flight.seq, Type::INT8),
                (&covered, Type::INT8),
                (&ctx.writer.owner, Type::TEXT),
            ],
        )
        .await?;
        Ok(tx.commit().await?)
    }

    /// A stored total that would leave the 64-bit range is never wrapped, and must not make the
    /// flush fail forever: the upsert skips such rows, and their events are rejected here
    /// (reason `overflow`), the rest of the flush commits.
    fn reject_out_of_range(
        &self,
        chunk: &Chunk<'_>,
        written: &[tokio_postgres::Row],
        rows: &[&Entry],
    ) {
        static LOG: Throttle = Throttle::new(1000);
        let written: std::collections::HashSet<(&str, &str)> =
            written.iter().map(|r| (r.get(0), r.get(1))).collect();
        let skipped = chunk
            .counters
            .iter()
            .zip(&chunk.keys)
            .filter(|&(c, k)| !written.contains(&(*c, *k)));
        for (&counter, &key) in skipped {
            let events: u64 = rows
                .iter()
                .filter(|e| &*e.key == key && self.ctx.counters[e.counter as usize].name == counter)
                .map(|e| e.agg.events)
                .sum();
            metrics::rejected(crate::protocol::Reject::Overflow, events);
            if let Some(suppressed) = LOG.allow() {
                warn!(
                    counter,
                    key, events, suppressed, "total would leave the 64-bit range; events rejected"
                );
            }
        }
    }
}

/// The column arrays of one upsert statement.
struct Chunk<'a> {
    counters: Vec<&'a str>,
    keys: Vec<&'a str>,
    slots: Vec<i32>,
    counts: Vec<i64>,
    first: Vec<SystemTime>,
    last: Vec<SystemTime>,
}

impl<'a> Chunk<'a> {
    fn new(
        rows: &[&'a Entry],
        counters: &'a [CounterInfo],
        slot_of: impl Fn(u16) -> i32,
    ) -> Chunk<'a> {
        let mut c = Chunk {
            counters: Vec::with_capacity(rows.len()),
            keys: Vec::with_capacity(rows.len()),
            slots: Vec::with_capacity(rows.len()),
            counts: Vec::with_capacity(rows.len()),
            first: Vec::with_capacity(rows.len()),
            last: Vec::with_capacity(rows.len()),
        };
        for e in rows {
            c.counters.push(&counters[e.counter as usize].name);
            c.keys.push(e.key.as_str());
            c.slots.push(slot_of(e.counter));
            c.counts.push(e.agg.sum);
            c.first.push(ms_to_time(e.agg.first_ms));
            c.last.push(ms_to_time(e.agg.last_ms));
        }
        c
    }
}

pub fn ms_to_time(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
