//! The claim of a batch id in one database (`tallyd.batches`): one task per database, on its
//! own connection, deciding many pending claims per statement. A claim is final: the first
//! copy to insert the id owns it, whichever instance it came to; every other copy finds the
//! owner and is dropped. While the database does not answer, claims wait and are tried again.
//! The same task prunes claims older than `batch.remember_days` in bounded steps and reads how
//! many are remembered and the oldest, for the status view and the metrics.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};
use tokio_postgres::types::Type;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use metrics::gauge;

use crate::metrics as m;
use crate::store::{Db, DbError};
use crate::throttle::Throttle;

/// Claims decided by one statement at most.
const CLAIMS_PER_STATEMENT: usize = 1000;
/// Claims pruned by one statement at most: a step's locks and WAL stay small.
pub(super) const PRUNE_STEP: i64 = 10_000;
/// How often expired claims are pruned and the remembered ones counted.
const PRUNE_EVERY: Duration = Duration::from_secs(60);
const COUNT_EVERY: Duration = Duration::from_secs(10);
/// A statement that takes longer is given up and tried again on a new connection.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// One pending claim: answered `true` when this copy owns the id in this database.
struct Request {
    id: String,
    payload: i64,
    mine: oneshot::Sender<bool>,
}

/// What a database remembers, as last counted (`-1`: not counted yet).
#[derive(Debug)]
pub struct Remembered {
    pub count: AtomicI64,
    /// Unix ms of the oldest claim (0: none).
    pub oldest_ms: AtomicI64,
}

/// The handle of one database's claim task.
pub(super) struct Claimer {
    tx: mpsc::UnboundedSender<Request>,
    pub remembered: Arc<Remembered>,
}

impl Claimer {
    pub fn spawn(
        db: Db,
        database: usize,
        instance_id: String,
        remember_days: u32,
        stop: CancellationToken,
    ) -> Claimer {
        let (tx, rx) = mpsc::unbounded_channel();
        let remembered = Arc::new(Remembered {
            count: AtomicI64::new(-1),
            oldest_ms: AtomicI64::new(0),
        });
        let task = Task {
            db,
            database,
            instance_id,
            remember_days,
            remembered: remembered.clone(),
            client: None,
            errors: Throttle::new(10_000),
        };
        tokio::spawn(task.run(rx, stop));
        Claimer { tx, remembered }
    }

    /// Whether copy `payload` of this instance owns `id` in this database; waits (trying
    /// again) while the database does not answer. None once the daemon stops.
    pub async fn claim(&self, id: &str, payload: u64) -> Option<bool> {
        let (mine, answer) = oneshot::channel();
        let request = Request {
            id: id.to_string(),
            payload: payload as i64,
            mine,
        };
        self.tx.send(request).ok()?;
        answer.await.ok()
    }
}

struct Task {
    db: Db,
    database: usize,
    instance_id: String,
    remember_days: u32,
    remembered: Arc<Remembered>,
    client: Option<Client>,
    errors: Throttle,
}

impl Task {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Request>, stop: CancellationToken) {
        let mut pruned_at: Option<Instant> = None;
        let mut counted_at: Option<Instant> = None;
        let mut pending: Vec<Request> = Vec::new();
        let mut retry = RETRY_FIRST;
        loop {
            if pending.is_empty() {
                let due = |at: Option<Instant>, every: Duration| {
                    at.map_or(Duration::ZERO, |t: Instant| {
                        every.saturating_sub(t.elapsed())
                    })
                };
                let wait = due(pruned_at, PRUNE_EVERY).min(due(counted_at, COUNT_EVERY));
                tokio::select! {
                    r = rx.recv() => match r {
                        Some(r) => pending.push(r),
                        None => return,
                    },
                    _ = tokio::time::sleep(wait) => {}
                    _ = stop.cancelled() => return,
                }
            }
            while pending.len() < CLAIMS_PER_STATEMENT {
                match rx.try_recv() {
                    Ok(r) => pending.push(r),
                    Err(_) => break,
                }
            }
            let result = if !pending.is_empty() {
                self.decide(&mut pending).await
            } else if pruned_at.is_none_or(|t| t.elapsed() >= PRUNE_EVERY) {
                let r = self.prune(&stop).await;
                if r.is_ok() {
                    pruned_at = Some(Instant::now());
                }
                r
            } else {
                let r = self.count().await;
                if r.is_ok() {
                    counted_at = Some(Instant::now());
                }
                r
            };
            match result {
                Ok(()) => retry = RETRY_FIRST,
                Err(cause) => {
                    self.client = None;
                    if let Some(suppressed) = self.errors.allow() {
                        warn!(database = self.database, %cause, suppressed, pending = pending.len(), "cannot claim or prune batch ids; trying again");
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(retry) => {}
                        _ = stop.cancelled() => return,
                    }
                    retry = (retry * 2).min(RETRY_MAX);
                }
            }
        }
    }

    async fn client(&mut self) -> Result<&Client, String> {
        if self.client.is_none() {
            let client = self.db.connect().await.map_err(|e| e.to_string())?;
            self.client = Some(client);
        }
        Ok(self.client.as_ref().expect("connected above"))
    }

    /// Claims every pending id (the first copy inserted owns it), then reads the owners and
    /// answers each request; on an error the requests stay pending.
    async fn decide(&mut self, pending: &mut Vec<Request>) -> Result<(), String> {
        let ids: Vec<&str> = pending.iter().map(|r| r.id.as_str()).collect();
        let payloads: Vec<i64> = pending.iter().map(|r| r.payload).collect();
        let instance = self.instance_id.clone();
        let client = self.client().await?;
        let rows = tokio::time::timeout(STATEMENT_TIMEOUT, async {
            client
                .execute_typed(
                    "INSERT INTO tallyd.batches (id, instance_id, payload) \
                     SELECT u.id, $2, u.payload FROM unnest($1::text[], $3::bigint[]) AS u (id, payload) \
                     ON CONFLICT (id) DO NOTHING",
                    &[
                        (&ids, Type::TEXT_ARRAY),
                        (&instance, Type::TEXT),
                        (&payloads, Type::INT8_ARRAY),
                    ],
                )
                .await?;
            client
                .query_typed(
                    "SELECT id, instance_id, payload FROM tallyd.batches WHERE id = ANY($1)",
                    &[(&ids, Type::TEXT_ARRAY)],
                )
                .await
        })
        .await
        .map_err(|_| "the database did not answer in time".to_string())?
        .map_err(|e| DbError::from(e).to_string())?;
        let owners: std::collections::HashMap<String, (String, i64)> = rows
            .iter()
            .map(|r| {
                (
                    r.get::<_, String>(0),
                    (r.get::<_, String>(1), r.get::<_, i64>(2)),
                )
            })
            .collect();
        for r in pending.drain(..) {
            // Missing only if pruned in between: claimed by no one now, so it is claimed again.
            let mine = owners
                .get(&r.id)
                .is_some_and(|(i, p)| *i == self.instance_id && *p == r.payload);
            let _ = r.mine.send(mine);
        }
        Ok(())
    }

    /// Deletes claims older than `batch.remember_days`, `PRUNE_STEP` at a time, until none is
    /// left or the daemon stops.
    async fn prune(&mut self, stop: &CancellationToken) -> Result<(), String> {
        let days = self.remember_days as i32;
        loop {
            let client = self.client().await?;
            let deleted = tokio::time::timeout(
                STATEMENT_TIMEOUT,
                client.execute_typed(
                    "DELETE FROM tallyd.batches WHERE id IN (SELECT id FROM tallyd.batches \
                     WHERE claimed_at < now() - make_interval(days => $1) LIMIT $2)",
                    &[(&days, Type::INT4), (&PRUNE_STEP, Type::INT8)],
                ),
            )
            .await
            .map_err(|_| "the database did not answer in time".to_string())?
            .map_err(|e| DbError::from(e).to_string())?;
            if deleted < PRUNE_STEP as u64 || stop.is_cancelled() {
                break;
            }
        }
        self.count().await
    }

    /// Reads how many claims are remembered and the oldest one's time.
    async fn count(&mut self) -> Result<(), String> {
        let client = self.client().await?;
        let row = tokio::time::timeout(
            STATEMENT_TIMEOUT,
            client.query_typed(
                "SELECT count(*), COALESCE((extract(epoch FROM min(claimed_at)) * 1000)::int8, 0) \
                 FROM tallyd.batches",
                &[],
            ),
        )
        .await
        .map_err(|_| "the database did not answer in time".to_string())?
        .map_err(|e| DbError::from(e).to_string())?;
        let row = row.first().ok_or("count(*) returned no row")?;
        let (count, oldest): (i64, i64) = (row.get(0), row.get(1));
        self.remembered.count.store(count, Ordering::Relaxed);
        self.remembered.oldest_ms.store(oldest, Ordering::Relaxed);
        let database = self.database.to_string();
        gauge!(m::BATCH_IDS_REMEMBERED, "database" => database.clone()).set(count as f64);
        gauge!(m::BATCH_OLDEST_CLAIM, "database" => database).set(oldest as f64 / 1000.0);
        Ok(())
    }
}
