//! The flush's pipelined transaction: one connection ([`Conn`]) sends BEGIN (with the shard map
//! check), the corrections, every chunk's upsert, the ledger row and COMMIT before it reads any
//! answer ([`in_order`]), so the transaction never sits idle waiting on tallyd; and it learns
//! from the answers whether the flight committed, or which statement failed ([`Unsent`]). A
//! total beyond the 64-bit range fails the whole transaction; it is then tried again returning
//! its rows and rolled back (a probe), and the keys with a row the range guard skipped are
//! handed back ([`Written::Overflowed`]) for the worker to take out of the flight whole, so that
//! an event is counted in all its rows or in none. On Citus, where the upserts always return
//! their rows, the skipped rows are rejected as the flight commits ([`reject_out_of_range`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use compact_str::CompactString;
use futures_util::future::{maybe_done, MaybeDone};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row};

use super::direct::Targets;
use super::rows::{Chunk, Corrections, DirectChunk};
use super::sql::{direct_lock_timeout, BEGIN, CORRECT, LAST_SEQ, LOCK_SLOTS, RECORD};
use super::FlushContext;
use crate::config::Counter;
use crate::events;
use crate::store::{DbError, Ending};
use crate::window::span_name;

/// One flush connection.
pub(super) struct Conn {
    pub(super) client: Client,
    /// Why the connection ended, once it has: what the server said, for the log.
    pub(super) ending: Ending,
    /// Citus: the upserts always return the rows they wrote (see [`super::sql::Shape::upsert`]),
    /// and no row is written directly.
    pub(super) citus: bool,
    /// The `rollup_into` targets a flight may write directly (none on Citus), read for the
    /// counter table at `targets_for` (the address of the `Arc`'s value: a reload that swaps the
    /// table may have recorded other targets first, so they are read again).
    pub(super) targets: Targets,
    targets_for: usize,
}

/// Why a flush transaction did not commit.
pub(super) enum Failed {
    /// A direct statement of `counter` failed and the server rolled the transaction back (the
    /// connection waits for the next): the flight is written again, at once, with that
    /// counter's rows through `tallyd.slots`.
    Direct { counter: u16, cause: DbError },
    /// Anything else: the connection is dropped and the ledger settles the next try.
    Other(DbError),
}

/// What each statement of a pipelined transaction is, to tell which one failed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Other,
    Slots,
    Direct(u16),
}

impl Conn {
    /// Connects and reads this writer's ledger row: whatever it committed last, possibly the
    /// flight whose COMMIT was lost with the previous connection (0: none).
    pub(super) async fn open(ctx: &FlushContext, writer: i32) -> Result<(Conn, i64), DbError> {
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
            targets: Targets::default(),
            targets_for: 0,
        };
        Ok((conn, committed.unwrap_or(0)))
    }

    /// Reads the `rollup_into` targets again when the counter table is not the one they were
    /// read for (the first flight of a connection, the first after a reload).
    pub(super) async fn targets_for(
        &mut self,
        counters: &Arc<Vec<Counter>>,
    ) -> Result<(), DbError> {
        let at = Arc::as_ptr(counters) as usize;
        if self.citus || self.targets_for == at {
            return Ok(());
        }
        if counters
            .iter()
            .any(|c| c.rollup_into.as_ref().is_some_and(|i| i.direct))
        {
            self.targets = Targets::load(&self.client).await?;
        } else {
            self.targets = Targets::default();
        }
        self.targets_for = at;
        Ok(())
    }

    /// Writes `chunks` (rows sorted) in one transaction with the ledger row
    /// `(writer, seq, covered)`. A total that would leave the 64-bit range fails the whole
    /// transaction; it is then tried again, on the same connection, returning its rows and
    /// rolled back, to learn which keys the range guard skipped (an overflow is rare; returning
    /// every row is not free): nothing is written, and those keys are returned.
    ///
    /// The `direct` statements come after every slot upsert, under a short `lock_timeout`; when
    /// one of them fails and the server ended the transaction, [`Failed::Direct`] names its
    /// counter.
    pub(super) async fn write(
        &self,
        ctx: &FlushContext,
        corrections: Option<&Corrections>,
        chunks: &[Chunk<'_>],
        direct: &[DirectChunk<'_>],
        ledger: (i32, i64, i64, i64),
    ) -> Result<Written, Failed> {
        // The plain try's failure, once a probe follows it.
        let mut failed: Option<DbError> = None;
        loop {
            let probe = failed.is_some();
            // A probe leaves the direct statements out: they come after every slot upsert and
            // touch no slot row, so they cannot change which rows the guard skips; they could
            // only wait on the application's rows and be charged a fallback for a rollback.
            let direct = if probe { &[][..] } else { direct };
            let sent = self
                .send(ctx, corrections, chunks, direct, ledger, probe)
                .await;
            match sent {
                Ok(written) if probe => {
                    let skipped = skipped_keys(chunks, written);
                    if skipped.is_empty() {
                        // No upsert's guard skipped a row: the overflow was elsewhere (or has
                        // gone meanwhile), so the flight is retried as itself, after the
                        // backoff, never in a loop without a pause.
                        return Err(Failed::Other(failed.expect("a probe follows a failure")));
                    }
                    return Ok(Written::Overflowed(skipped));
                }
                Ok(written) => {
                    for (chunk, rows) in chunks.iter().zip(written) {
                        if let Some(rows) = rows.filter(|r| r.len() < chunk.rows.len()) {
                            reject_out_of_range(chunk, &rows);
                        }
                    }
                    return Ok(Written::Committed);
                }
                Err(Unsent { cause, ended, role }) => {
                    if let (Role::Direct(counter), true) = (role, ended) {
                        return Err(Failed::Direct { counter, cause });
                    }
                    let overflow = cause.code() == Some(&SqlState::NUMERIC_VALUE_OUT_OF_RANGE);
                    if overflow && ended && !self.citus && !probe && role == Role::Slots {
                        failed = Some(cause);
                        continue;
                    }
                    return Err(Failed::Other(cause));
                }
            }
        }
    }

    /// One transaction, pipelined: BEGIN (with the database's timeouts), every chunk's upsert,
    /// the ledger row and COMMIT are all sent before any answer is read. Returns the rows each
    /// upsert returned (on Citus, and in a probe). A `probe` ends with ROLLBACK instead of the
    /// ledger row and COMMIT: it writes nothing.
    ///
    /// The transaction committed only if every statement succeeded: after an error the
    /// statements behind it fail at once (the transaction is aborted) and its COMMIT rolls back.
    async fn send(
        &self,
        ctx: &FlushContext,
        corrections: Option<&Corrections>,
        chunks: &[Chunk<'_>],
        direct: &[DirectChunk<'_>],
        ledger: (i32, i64, i64, i64),
        probe: bool,
    ) -> Result<Vec<Option<Vec<Row>>>, Unsent> {
        // On Citus every flight's upserts return their rows (the range guard's skipped rows are
        // rejected as it commits); elsewhere only a probe's.
        let returning = self.citus || probe;
        let (writer, seq, covered, unique_covered) = ledger;
        // The shard map check comes first, before any row is locked: a move waits for this
        // transaction from here on, or this waits for the move (see migrations/V8). In BEGIN's
        // message, with the settings: a failed check aborts the transaction, so every statement
        // sent behind it fails and writes nothing.
        let check = format!("SELECT tallyd.check_shard_map({})", ctx.map_version);
        let settings = ctx.db.transaction_settings();
        let mut begin = match settings {
            Some(settings) => format!("{BEGIN}; {settings}; {check}"),
            None => format!("{BEGIN}; {check}"),
        };
        if !direct.is_empty() {
            begin = format!("{begin}; {LOCK_SLOTS}");
        }
        // After the direct statements, the transaction's own lock_timeout again: the session's
        // default, then the database's settings (which may or may not set it).
        let (short, restore) = (
            direct_lock_timeout(),
            match settings {
                Some(settings) => format!("SET LOCAL lock_timeout = DEFAULT; {settings}"),
                None => "SET LOCAL lock_timeout = DEFAULT".to_string(),
            },
        );
        let (client, begin) = (&self.client, begin.as_str());
        let mut statements: Vec<Statement> = Vec::with_capacity(chunks.len() + direct.len() + 5);
        let mut roles: Vec<Role> = Vec::with_capacity(statements.capacity());
        statements.push(Box::pin(async move {
            client.batch_execute(begin).await.map(|()| None)
        }));
        roles.push(Role::Other);
        // Corrections first: the corrected keys' stored rows are deleted before this flight's
        // rows for them are written.
        if let Some(corrections) = corrections {
            statements.push(Box::pin(async move {
                client
                    .execute_typed(CORRECT, &corrections.params())
                    .await
                    .map(|_| None)
            }));
            roles.push(Role::Other);
        }
        let first_chunk = 1 + usize::from(corrections.is_some());
        for chunk in chunks {
            roles.push(Role::Slots);
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
        // The direct statements after every slot upsert: while one waits for a row, this
        // transaction holds no row another writer's slot upsert or rollup step waits on in turn
        // but its own slot rows (docs/design.md, "Direct writes").
        if !direct.is_empty() {
            let short = short.as_str();
            statements.push(Box::pin(async move {
                client.batch_execute(short).await.map(|()| None)
            }));
            roles.push(Role::Other);
        }
        for chunk in direct {
            statements.push(Box::pin(async move {
                client
                    .execute_typed(chunk.sql, &chunk.params())
                    .await
                    .map(|_| None)
            }));
            roles.push(Role::Direct(chunk.counter));
        }
        if !direct.is_empty() {
            let restore = restore.as_str();
            statements.push(Box::pin(async move {
                client.batch_execute(restore).await.map(|()| None)
            }));
            roles.push(Role::Other);
        }
        // The ledger row in a probe too: a flight that committed meanwhile (a lost COMMIT, a
        // half-open copy) or a lost lease fails it (TD002), and the ledger, not the probe's
        // verdict, then settles the flight.
        statements.push(Box::pin(async move {
            let record: [(&(dyn ToSql + Sync), Type); 6] = [
                (&ctx.writer.instance_id, Type::TEXT),
                (&writer, Type::INT4),
                (&seq, Type::INT8),
                (&covered, Type::INT8),
                (&ctx.writer.owner, Type::TEXT),
                (&unique_covered, Type::INT8),
            ];
            client.execute_typed(RECORD, &record).await.map(|_| None)
        }));
        roles.push(Role::Other);
        let end = if probe { "ROLLBACK" } else { "COMMIT" };
        statements.push(Box::pin(async move {
            client.batch_execute(end).await.map(|()| None)
        }));
        roles.push(Role::Other);
        let mut replies = in_order(statements).await;
        // The server answered COMMIT: the transaction is over (committed or rolled back) and
        // the connection waits for the next.
        let ended = matches!(replies.last(), Some(Some(Ok(_))));
        let mut written = Vec::with_capacity(chunks.len());
        // A statement never sent comes after the one whose failure stopped the sending, which
        // is returned first.
        for (i, reply) in replies.drain(..).enumerate() {
            let Some(reply) = reply else { break };
            match reply {
                Ok(rows) if (first_chunk..first_chunk + chunks.len()).contains(&i) => {
                    written.push(rows)
                }
                Ok(_) => {}
                Err(err) => {
                    return Err(Unsent {
                        cause: err.into(),
                        ended,
                        role: roles[i],
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
    /// Which statement failed.
    role: Role,
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
pub(super) async fn in_order<F, T, E>(statements: Vec<F>) -> Vec<Option<Result<T, E>>>
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

/// How a flight's write ended without an error.
pub(super) enum Written {
    Committed,
    /// Nothing was written: these keys (counter, key) have a row whose total would leave the
    /// 64-bit range.
    Overflowed(Vec<(u16, CompactString)>),
}

/// The keys with a row a probe's upserts did not return (the range guard skipped it).
fn skipped_keys(chunks: &[Chunk<'_>], written: Vec<Option<Vec<Row>>>) -> Vec<(u16, CompactString)> {
    let mut out: Vec<(u16, CompactString)> = Vec::new();
    for (chunk, rows) in chunks.iter().zip(written) {
        let rows = rows.unwrap_or_default();
        if rows.len() == chunk.rows.len() {
            continue;
        }
        let written: std::collections::HashSet<(&str, &str, &str, i64)> = rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
            .collect();
        for e in chunk.rows {
            let counter = chunk.counters[e.counter as usize].name.as_str();
            let row = (counter, e.key.as_str(), span_name(e.span), e.win);
            if !written.contains(&row) && !out.iter().any(|(c, k)| *c == e.counter && *k == e.key) {
                out.push((e.counter, e.key.clone()));
            }
        }
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

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
}
