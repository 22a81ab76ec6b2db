//! The rollup schedule: folds slot rows into `tallyd.rollups` by calling the SQL function
//! `tallyd.rollup(batch_rows)` (migrations/V2) — the same step `tallyd rollup` and pg_cron run.

use std::time::{Duration, Instant};

use metrics::{counter, gauge, histogram};
use tokio_postgres::types::Type;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::config::RollupConfig;
use crate::metrics as m;
use crate::store::{Db, DbError};
use crate::throttle::Throttle;

pub struct Rollup {
    db: Db,
    config: RollupConfig,
    /// Whether any counter folds into an application table (then unmatched keys are reported).
    has_targets: bool,
}

static ROLLUP_ERROR_LOG: Throttle = Throttle::new(10_000);

/// Runs one step; returns the slot rows folded.
pub async fn step(client: &Client, batch_rows: i32) -> Result<i64, DbError> {
    let started = Instant::now();
    let row = client
        .query_typed_one("SELECT tallyd.rollup($1)", &[(&batch_rows, Type::INT4)])
        .await?;
    let folded: i64 = row.get(0);
    counter!(m::ROLLUP_RUNS).increment(1);
    counter!(m::ROLLUP_ROWS).increment(folded as u64);
    histogram!(m::ROLLUP_DURATION).record(started.elapsed().as_secs_f64());
    Ok(folded)
}

/// Steps until a step folds fewer than `batch_rows` rows (nothing left that is not locked by
/// someone else). Returns the total folded.
pub async fn until_empty(client: &Client, batch_rows: i32) -> Result<i64, DbError> {
    let mut total = 0;
    loop {
        let n = step(client, batch_rows).await?;
        total += n;
        if n < batch_rows as i64 {
            return Ok(total);
        }
    }
}

impl Rollup {
    pub fn new(db: Db, config: RollupConfig, has_targets: bool) -> Rollup {
        Rollup {
            db,
            config,
            has_targets,
        }
    }

    /// Every `interval_ms`, folds until caught up. Each step is its own short transaction, so
    /// flushes wait at most one batch on a row the rollup holds.
    pub async fn run(self, stop: CancellationToken) {
        let mut client: Option<Client> = None;
        let mut ticker = tokio::time::interval(Duration::from_millis(self.config.interval_ms));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = stop.cancelled() => return,
            }
            if client.as_ref().is_none_or(Client::is_closed) {
                client = self.db.connect().await.map_err(|e| log_error(&e)).ok();
                m::database_up(client.is_some());
            }
            let Some(c) = client.as_ref() else { continue };
            let run = until_empty(c, self.config.batch_rows);
            let result = tokio::select! {
                r = run => r,
                _ = stop.cancelled() => return,
            };
            let result = match result {
                Ok(n) => {
                    debug!(folded = n, "rollup caught up");
                    match report_slot_rows(c).await {
                        Ok(()) if self.has_targets => report_unmatched(c).await,
                        other => other,
                    }
                }
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                log_error(&e);
                client = None;
            }
        }
    }
}

/// Rows in `tallyd.slots` (all partitions), from the statistics collector: cheap, and close
/// enough for a gauge.
async fn report_slot_rows(client: &Client) -> Result<(), DbError> {
    let rows: i64 = client
        .query_typed_one(
            "SELECT coalesce(sum(n_live_tup), 0)::bigint FROM pg_stat_user_tables \
             WHERE schemaname = 'tallyd' AND (relname = 'slots' OR relname LIKE 'slots\\_p%')",
            &[],
        )
        .await?
        .get(0);
    gauge!(m::SLOT_ROWS).set(rows as f64);
    Ok(())
}

static UNMATCHED_LOG: Throttle = Throttle::new(60_000);

/// Slot rows of `rollup_into` counters held back because their key has no row in the target
/// table: a gauge per counter, and a log line now and then while there are any.
async fn report_unmatched(client: &Client) -> Result<(), DbError> {
    for row in client
        .query_typed("SELECT counter, slot_rows FROM tallyd.unmatched()", &[])
        .await?
    {
        let (counter, rows): (String, i64) = (row.get(0), row.get(1));
        gauge!(m::ROLLUP_UNMATCHED, "counter" => counter.clone()).set(rows as f64);
        if rows > 0 {
            if let Some(suppressed) = UNMATCHED_LOG.allow() {
                warn!(%counter, slot_rows = rows, suppressed,
                    "keys with no row in the rollup_into table stay in tallyd.slots until one appears");
            }
        }
    }
    Ok(())
}

fn log_error(err: &DbError) {
    counter!(m::ROLLUP_ERRORS).increment(1);
    if let Some(suppressed) = ROLLUP_ERROR_LOG.allow() {
        warn!(cause = %err, suppressed, "rollup failed; will retry on the next tick");
    }
}
