//! The rollup's units and their steps in SQL: which units a configuration has (a counter's rows
//! bound for `tallyd.rollups`, and a `rollup_into` counter's rows bound for its table), one step
//! of a unit after a key (`tallyd.rollup_step`, migrations/V14), a pass of every unit to its end
//! (`tallyd rollup --until-empty`), and the SQL entry point's step (`tallyd.rollup(batch_rows)`,
//! what pg_cron runs).

use std::time::Instant;

use tokio_postgres::types::Type;
use tokio_postgres::Client;

use super::pace::{Pace, Stepped};
use crate::config::Config;
use crate::events;
use crate::store::DbError;

/// A counter's rows bound for one place, stepped with a cursor of its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    pub counter: String,
    /// The counter's kind (`sum`, `max`, `min`, `last`, `unique`): a unique counter's sketches
    /// fold by their own statements.
    pub kind: String,
    /// Its `rollup_into` table; else `tallyd.rollups` (every span but the target's window).
    pub into_target: bool,
}

impl Unit {
    /// The units of `config`'s counters: each counter's rows for `tallyd.rollups` (but a
    /// counter whose every row goes to its table: an all-time `rollup_into`, or a windowed one
    /// without `also`), and each `rollup_into` counter's rows for its table.
    pub fn of(config: &Config) -> Vec<Unit> {
        let mut units = Vec::new();
        for c in &config.counters {
            let kind = c.kind.name().to_string();
            let into = c.rollup_into.is_some();
            if !into || (c.window.is_some() && !c.also.is_empty()) {
                units.push(Unit {
                    counter: c.name.clone(),
                    kind: kind.clone(),
                    into_target: false,
                });
            }
            if into {
                units.push(Unit {
                    counter: c.name.clone(),
                    kind,
                    into_target: true,
                });
            }
        }
        units
    }

    /// A counter found in `tallyd.slots` that the configuration does not declare (removed from
    /// it since its rows were written): its rows fold into `tallyd.rollups`, as every counter's
    /// without a recorded target.
    pub fn found(counter: String, kind: String) -> Unit {
        Unit {
            counter,
            kind,
            into_target: false,
        }
    }
}

/// One step of `unit` after the key `after` ('' starts a pass), of at most `batch_rows` rows,
/// in a transaction of its own that commits without waiting for the WAL's flush.
pub async fn step_unit(
    client: &Client,
    unit: &Unit,
    after: &str,
    batch_rows: i32,
) -> Result<Stepped, DbError> {
    let started = Instant::now();
    // Unnamed (typed): a transaction pooler may run each step on another server connection.
    let row = client
        .query_typed_one(
            "SELECT folded, claimed, last_key FROM tallyd.rollup_step($1, $2, $3, $4, $5)",
            &[
                (&unit.counter, Type::TEXT),
                (&unit.kind, Type::TEXT),
                (&unit.into_target, Type::BOOL),
                (&after, Type::TEXT),
                (&batch_rows, Type::INT4),
            ],
        )
        .await?;
    let stepped = Stepped {
        folded: row.get(0),
        claimed: row.get(1),
        last_key: row.get(2),
    };
    events::RollupStepped {
        folded: stepped.folded,
        took: started.elapsed(),
    }
    .emit();
    Ok(stepped)
}

/// The counters with slot rows, and their kinds (`tallyd.rollup_counters()`: one index descent
/// per counter).
pub async fn counters_found(client: &Client) -> Result<Vec<(String, String)>, DbError> {
    Ok(client
        .query_typed("SELECT counter, kind FROM tallyd.rollup_counters()", &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

/// `config`'s units and those of the counters found in `tallyd.slots` that it does not declare.
pub async fn units_with_found(client: &Client, config: &Config) -> Result<Vec<Unit>, DbError> {
    let mut units = Unit::of(config);
    for (counter, kind) in counters_found(client).await? {
        if !units.iter().any(|u| u.counter == counter) {
            units.push(Unit::found(counter, kind));
        }
    }
    Ok(units)
}

/// Every unit stepped through one pass, to its end (`tallyd rollup --until-empty`): `batch_rows`
/// per step, or (`None`) steps sized as the daemon sizes them, from `start_rows`. Returns the
/// slot rows folded.
pub async fn drain(
    client: &Client,
    units: &[Unit],
    batch_rows: Option<i32>,
    start_rows: i32,
) -> Result<i64, DbError> {
    let mut total = 0;
    for unit in units {
        let mut pace = Pace::new(
            batch_rows.unwrap_or(start_rows),
            batch_rows.is_none(),
            Instant::now(),
        );
        loop {
            let began = Instant::now();
            pace.begin(began);
            let stepped = step_unit(client, unit, pace.cursor(), pace.batch()).await?;
            total += stepped.folded;
            let now = Instant::now();
            let done = stepped.last_key.is_none();
            pace.stepped(&stepped, now - began, now, std::time::Duration::ZERO);
            if done {
                break;
            }
        }
    }
    Ok(total)
}

/// One step of `tallyd.rollup(batch_rows)`, the SQL entry point pg_cron calls: every counter
/// from its first key. Returns the slot rows folded.
pub async fn step(client: &Client, batch_rows: i32) -> Result<i64, DbError> {
    let started = Instant::now();
    let row = client
        .query_typed_one("SELECT tallyd.rollup($1)", &[(&batch_rows, Type::INT4)])
        .await?;
    let folded: i64 = row.get(0);
    events::RollupStepped {
        folded,
        took: started.elapsed(),
    }
    .emit();
    Ok(folded)
}

/// Steps `tallyd.rollup(batch_rows)` until a step folds fewer than `batch_rows` rows (nothing
/// left that is not locked by someone else). Returns the total folded.
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
