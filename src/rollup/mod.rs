//! The rollup schedule, one per database: folds slot rows into `tallyd.rollups` and the
//! `rollup_into` tables, unit by unit (step.rs), each at its own pace (pace.rs), by the SQL steps
//! of migrations/V14 that `tallyd rollup` runs too (pg_cron runs `tallyd.rollup(batch_rows)`);
//! deletes expired windows; reports what waits, what is held back, and how far behind it is.
//!
//! The schedule keeps a key cursor per unit and steps the unit due first: at once while it is
//! behind (its steps come back full), else one pass per interval. A step is a transaction of
//! its own; when one fails, the connection is dropped and the unit tried again an interval later
//! from the same key. On Citus (`tallyd.slots` distributed) it runs `tallyd.rollup()` until it is
//! caught up, every interval, as before V14: that steps each shard group on its worker.

mod pace;
mod step;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_postgres::types::Type;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

use crate::config::{Config, RollupConfig};
use crate::events;
use crate::health::Health;
use crate::store::{Db, DbError};
use crate::window::Window;

pub use pace::{Pace, Stepped, MAX_BATCH, MIN_BATCH};
pub use step::{counters_found, drain, step, step_unit, units_with_found, until_empty, Unit};

/// How often the schedule looks for counters in `tallyd.slots` that the configuration does not
/// declare, in intervals.
const FIND_EVERY: u32 = 30;

pub struct Rollup {
    db: Db,
    /// Index of `db` in config order: the `database` label of its metrics.
    database: usize,
    /// Every configured counter, so that a counter no longer held back reads 0 again.
    counters: Vec<String>,
    /// The configured counters' units (step.rs); the schedule adds those of counters it finds
    /// in `tallyd.slots` that the configuration does not declare.
    units: Vec<Unit>,
    config: RollupConfig,
    /// Whether any counter folds into an application table (then unmatched keys are reported).
    has_targets: bool,
    /// Where the status view reads the slot rows waiting and whether the database answers.
    health: Arc<Health>,
    /// The windowed counters that keep only their last windows.
    retention: Vec<Retention>,
}

/// A counter's `keep_windows`: its windows older than the last `keep` are deleted.
#[derive(Clone, Debug)]
pub struct Retention {
    pub counter: String,
    pub window: Window,
    pub keep: u32,
}

impl Retention {
    /// The retention of every counter of `config` that declares one.
    pub fn of(config: &Config) -> Vec<Retention> {
        config
            .counters
            .iter()
            .filter_map(|c| {
                Some(Retention {
                    counter: c.name.clone(),
                    window: c.window().ok()??,
                    keep: c.keep_windows?,
                })
            })
            .collect()
    }

    /// The start of the oldest window kept at `now_ms`: windows starting before it go.
    pub fn cutoff(&self, now_ms: i64) -> i64 {
        let (start, _) = self.window.bounds(now_ms);
        self.window.back(start, self.keep.saturating_sub(1))
    }
}

/// Deletes the windows of `retention`'s counter older than its last `keep`, `batch_rows` rows
/// per statement (each its own short transaction, skipping rows a flush holds), until none is
/// left; returns how many rows went.
pub async fn expire(
    client: &Client,
    retention: &Retention,
    batch_rows: i32,
) -> Result<i64, DbError> {
    let cutoff = retention.cutoff(crate::clock::now_ms());
    let span = retention.window.span().name();
    let mut total = 0;
    loop {
        let n: i64 = client
            .query_typed_one(
                "SELECT tallyd.expire_windows($1, $2, 'epoch'::timestamptz + $3 * interval '1 millisecond', $4)",
                &[
                    (&retention.counter, Type::TEXT),
                    (&span, Type::TEXT),
                    (&cutoff, Type::INT8),
                    (&batch_rows, Type::INT4),
                ],
            )
            .await?
            .get(0);
        total += n;
        events::WindowsExpired {
            counter: &retention.counter,
            rows: n,
        }
        .emit();
        // Fewer than a batch from both tables: nothing left that no flush holds.
        if n < batch_rows as i64 {
            return Ok(total);
        }
    }
}

impl Rollup {
    pub fn new(
        db: Db,
        database: usize,
        counters: Vec<String>,
        units: Vec<Unit>,
        config: RollupConfig,
        has_targets: bool,
    ) -> Rollup {
        Rollup {
            db,
            database,
            counters,
            units,
            config,
            has_targets,
            health: Health::detached(),
            retention: Vec::new(),
        }
    }

    /// Also deletes windows older than each of `retention`'s counters keeps.
    pub fn expiring(mut self, retention: Vec<Retention>) -> Rollup {
        self.retention = retention;
        self
    }

    /// Reports the backlog and the database's reachability to `health` too.
    pub fn reporting_to(mut self, health: Arc<Health>) -> Rollup {
        self.health = health;
        self
    }

    /// Steps the unit due first until `stop` (see the module docs); every interval, deletes
    /// expired windows and reports what waits and what is held back.
    pub async fn run(self, stop: CancellationToken) {
        let interval = self.config.interval();
        let started = Instant::now();
        let mut units: Vec<(Unit, Pace)> = Vec::new();
        for unit in &self.units {
            units.push((unit.clone(), self.pace(started)));
        }
        let mut client: Option<Client> = None;
        let mut citus = false;
        // The first pass of every unit, the first report and the first search for undeclared
        // counters come at once; then every interval (every FIND_EVERY intervals).
        let mut report_due = started;
        let mut find_due = started;
        loop {
            if stop.is_cancelled() {
                return;
            }
            let now = Instant::now();
            self.report_lag(&units, now);
            if client.as_ref().is_none_or(Client::is_closed) {
                match self.connect().await {
                    Some((c, distributed)) => {
                        client = Some(c);
                        citus = distributed;
                    }
                    None => {
                        client = None;
                        if sleep_until(now + interval, &stop).await {
                            return;
                        }
                        continue;
                    }
                }
            }
            let Some(c) = client.as_ref() else { continue };
            if citus {
                // As before V14: every interval, tallyd.rollup() until caught up, on each shard
                // group's worker.
                let result = tokio::select! {
                    r = self.citus_pass(c) => r,
                    _ = stop.cancelled() => return,
                };
                if let Err(e) = result {
                    log_error(&e);
                    client = None;
                }
                if sleep_until(Instant::now() + interval, &stop).await {
                    return;
                }
                continue;
            }
            if now >= find_due {
                find_due = now + interval * FIND_EVERY;
                match counters_found(c).await {
                    Ok(found) => {
                        for (counter, kind) in found {
                            if !units.iter().any(|(u, _)| u.counter == counter) {
                                debug!(%counter, "rollup: a counter the configuration does not declare has slot rows");
                                units.push((Unit::found(counter, kind), self.pace(now)));
                            }
                        }
                    }
                    Err(e) => {
                        log_error(&e);
                        client = None;
                        continue;
                    }
                }
            }
            if now >= report_due {
                report_due = now + interval;
                let result = tokio::select! {
                    r = self.housekeeping(c) => r,
                    _ = stop.cancelled() => return,
                };
                if let Err(e) = result {
                    log_error(&e);
                    client = None;
                    continue;
                }
            }
            // The unit due first; ties go to the one waiting longest (the order of the list).
            let next = units
                .iter()
                .enumerate()
                .min_by_key(|(_, (_, pace))| pace.due())
                .map(|(i, (_, pace))| (i, pace.due()));
            let Some((i, due)) = next else {
                // No unit yet: wake for the report (and, rarely, the search).
                if sleep_until(report_due.min(find_due), &stop).await {
                    return;
                }
                continue;
            };
            let now = Instant::now();
            if due > now {
                // Wake at least every second: the lag gauge moves while nothing is due.
                let wake = due
                    .min(report_due)
                    .min(find_due)
                    .min(now + Duration::from_secs(1));
                if sleep_until(wake, &stop).await {
                    return;
                }
                continue;
            }
            units[i].1.begin(now);
            let result = {
                let (unit, pace) = &units[i];
                let step = step_unit(c, unit, pace.cursor(), pace.batch());
                tokio::pin!(step);
                // A step that waits (a lock someone holds on the table it folds into) must not
                // stop the lag gauge: it grows every second meanwhile.
                loop {
                    tokio::select! {
                        r = &mut step => break r,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {
                            self.report_lag(&units, Instant::now());
                        }
                        _ = stop.cancelled() => return,
                    }
                }
            };
            let pace = &mut units[i].1;
            let ended = Instant::now();
            match result {
                Ok(stepped) => pace.stepped(&stepped, ended - now, ended, interval),
                Err(e) => {
                    log_error(&e);
                    pace.failed(ended, interval);
                    client = None;
                }
            }
        }
    }

    /// A unit's pace from `now`: its first step, of `rollup.batch_rows` rows, due at once.
    fn pace(&self, now: Instant) -> Pace {
        Pace::new(self.config.batch_rows, true, now)
    }

    /// Connects, and reads whether `tallyd.slots` is distributed (Citus); `None` when the
    /// database cannot be reached (logged, and reported to the status view).
    async fn connect(&self) -> Option<(Client, bool)> {
        let connected = match self.db.connect().await {
            Ok(c) => match c
                .query_typed_one("SELECT tallyd.is_distributed('tallyd.slots')", &[])
                .await
            {
                Ok(row) => Ok((c, row.get::<_, bool>(0))),
                Err(e) => Err(DbError::from(e)),
            },
            Err(e) => Err(e),
        };
        let reached = match connected {
            Ok(pair) => {
                self.health.reachable(self.database);
                Some(pair)
            }
            Err(e) => {
                log_error(&e);
                self.health.unreachable(self.database, &e);
                None
            }
        };
        events::DatabaseReached {
            database: self.database,
            up: reached.is_some(),
        }
        .emit();
        reached
    }

    /// On Citus: `tallyd.rollup()` until caught up, then the interval's housekeeping.
    async fn citus_pass(&self, client: &Client) -> Result<(), DbError> {
        let n = until_empty(client, self.config.batch_rows).await?;
        debug!(folded = n, "rollup caught up");
        self.housekeeping(client).await
    }

    /// Every interval: expired windows deleted, then the gauges.
    async fn housekeeping(&self, client: &Client) -> Result<(), DbError> {
        self.expire_all(client).await?;
        self.report(client).await
    }

    /// The age of the oldest row that may still wait: the start of the oldest last-completed
    /// pass among the units.
    fn report_lag(&self, units: &[(Unit, Pace)], now: Instant) {
        let lag = units
            .iter()
            .map(|(_, pace)| pace.lag(now))
            .max()
            .unwrap_or_default();
        events::RollupLag {
            database: self.database,
            lag,
        }
        .emit();
    }

    async fn expire_all(&self, client: &Client) -> Result<(), DbError> {
        for retention in &self.retention {
            let n = expire(client, retention, self.config.batch_rows).await?;
            if n > 0 {
                debug!(counter = %retention.counter, rows = n, "expired windows deleted");
            }
        }
        Ok(())
    }

    /// The gauges read after each catch-up.
    async fn report(&self, client: &Client) -> Result<(), DbError> {
        let rows = count_slot_rows(client).await?;
        self.health.slot_rows(self.database, rows);
        events::SlotRowsCounted {
            database: self.database,
            rows,
        }
        .emit();
        self.report_overflow(client).await?;
        if self.has_targets {
            report_unmatched(client, self.database).await?;
            self.report_held_back(client).await?;
        }
        Ok(())
    }

    /// Keys held back because their fold would leave the 64-bit range: a gauge per counter of
    /// this database, and a log line now and then naming one of them.
    async fn report_overflow(&self, client: &Client) -> Result<(), DbError> {
        // Unnamed (typed) statements outside a transaction, for transaction poolers.
        let rows = client
            .query_typed(
                "SELECT counter, count(*), min(key) FROM tallyd.rollup_rejects GROUP BY counter",
                &[],
            )
            .await?;
        for name in &self.counters {
            let row = rows.iter().find(|r| r.get::<_, &str>(0) == name);
            let keys: i64 = row.map_or(0, |r| r.get(1));
            events::RollupOverflow {
                counter: name,
                database: self.database,
                keys,
                example: row.map(|r| r.get(2)),
            }
            .emit();
        }
        Ok(())
    }

    /// Keys of `insert_missing` targets held back by a foreign key: a gauge of their slot rows
    /// per counter of this database, and a log line now and then naming one of them.
    async fn report_held_back(&self, client: &Client) -> Result<(), DbError> {
        let held = held_back(client).await?;
        for name in &self.counters {
            let h = held.iter().find(|h| &h.counter == name);
            events::RollupHeldBack {
                counter: name,
                database: self.database,
                keys: h.map_or(0, |h| h.keys),
                slot_rows: h.map_or(0, |h| h.slot_rows),
                held_for: h.map_or(std::time::Duration::ZERO, |h| h.held_for),
                example: h.map(|h| (h.example_key.as_str(), h.cause.as_str())),
            }
            .emit();
        }
        Ok(())
    }
}

/// The keys of one `insert_missing` counter whose row the rollup could not insert because of a
/// foreign key (`tallyd.held_back()`).
#[derive(Debug)]
pub struct HeldBack {
    pub counter: String,
    pub keys: i64,
    /// Their slot rows waiting in `tallyd.slots`.
    pub slot_rows: i64,
    /// The first of them, and the error of its last try.
    pub example_key: String,
    pub cause: String,
    /// How long the longest-held of them has been held.
    pub held_for: std::time::Duration,
}

/// Per counter, the keys held back by a foreign key that still have slot rows.
pub async fn held_back(client: &Client) -> Result<Vec<HeldBack>, DbError> {
    // Unnamed (typed): `tallyd rollup` runs it outside a transaction, maybe through a pooler.
    Ok(client
        .query_typed(
            "SELECT counter, keys, slot_rows, example_key, cause, \
                    greatest(extract(epoch FROM clock_timestamp() - held_since), 0)::float8 \
             FROM tallyd.held_back() ORDER BY counter",
            &[],
        )
        .await?
        .iter()
        .map(|r| HeldBack {
            counter: r.get(0),
            keys: r.get(1),
            slot_rows: r.get(2),
            example_key: r.get(3),
            cause: r.get(4),
            held_for: std::time::Duration::from_secs_f64(r.get(5)),
        })
        .collect())
}

/// A key the rollup holds back (a row of `tallyd.rollup_rejects`).
#[derive(Debug)]
pub struct Overflowed {
    pub counter: String,
    pub key: String,
    /// The total the fold would have produced, when known (`None` for `rollup_into` counters).
    pub total: Option<String>,
}

impl Overflowed {
    pub fn total_text(&self) -> &str {
        self.total
            .as_deref()
            .unwrap_or("beyond the target column's type")
    }
}

/// Up to `limit` of the keys the rollup holds back because their fold would leave the 64-bit
/// range.
pub async fn overflowed(client: &Client, limit: i64) -> Result<Vec<Overflowed>, DbError> {
    // Unnamed (typed): `tallyd rollup` runs it outside a transaction, maybe through a pooler.
    Ok(client
        .query_typed(
            "SELECT counter, key, total::text FROM tallyd.rollup_rejects \
             ORDER BY counter, key LIMIT $1",
            &[(&limit, Type::INT8)],
        )
        .await?
        .iter()
        .map(|r| Overflowed {
            counter: r.get(0),
            key: r.get(1),
            total: r.get(2),
        })
        .collect())
}

/// Rows in `tallyd.slots` (all partitions), from the statistics collector: cheap, and close
/// enough for a gauge.
async fn count_slot_rows(client: &Client) -> Result<i64, DbError> {
    let rows: i64 = client
        .query_typed_one(
            "SELECT coalesce(sum(n_live_tup), 0)::bigint FROM pg_stat_user_tables \
             WHERE schemaname = 'tallyd' AND (relname = 'slots' OR relname LIKE 'slots\\_p%')",
            &[],
        )
        .await?
        .get(0);
    Ok(rows)
}

/// Slot rows of `rollup_into` counters held back because their key has no row in the target
/// table: a gauge per counter and database, and a log line now and then while there are any.
async fn report_unmatched(client: &Client, database: usize) -> Result<(), DbError> {
    for row in client
        .query_typed("SELECT counter, slot_rows FROM tallyd.unmatched()", &[])
        .await?
    {
        events::RollupUnmatched {
            counter: row.get(0),
            database,
            slot_rows: row.get(1),
        }
        .emit();
    }
    Ok(())
}

/// Sleeps until `when`; true when `stop` came first.
async fn sleep_until(when: Instant, stop: &CancellationToken) -> bool {
    tokio::select! {
        _ = tokio::time::sleep_until(when.into()) => false,
        _ = stop.cancelled() => true,
    }
}

fn log_error(err: &DbError) {
    events::RollupFailed { cause: err }.emit();
}

/// The rollup schedule, one per database, when enabled, on `rollups` until `stop` (a reload
/// stops them and starts them again with its settings).
pub(crate) fn spawn_all(
    config: &Config,
    dbs: &[Db],
    stop: &CancellationToken,
    rollups: &TaskTracker,
    health: &Arc<Health>,
) {
    if config.rollup.enabled {
        let has_targets = config.counters.iter().any(|c| c.rollup_into.is_some());
        for (index, db) in dbs.iter().enumerate() {
            let rollup = Rollup::new(
                db.clone(),
                index,
                config.counters.iter().map(|c| c.name.clone()).collect(),
                Unit::of(config),
                config.rollup.clone(),
                has_targets,
            )
            .expiring(Retention::of(config))
            .reporting_to(health.clone());
            rollups.spawn(rollup.run(stop.clone()));
        }
    }
}
