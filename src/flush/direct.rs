//! Direct writes (docs/design.md, "Direct writes"): a `rollup_into` counter's rows written by
//! the flush itself, in the flight's transaction, into the application's table (the rows of its
//! target's window, or its all-time rows) and `tallyd.rollups` (its `also` rows), with the plain
//! upsert a buffer's mover runs, so that the table holds every event once its flight commits
//! and the rows never wait in `tallyd.slots` for the rollup. What each recorded target needs
//! ([`Targets`], read when a connection opens), which rows of a flight go where ([`plan`]), and
//! which counters write through `tallyd.slots` for a while after a direct write failed
//! ([`Fallback`]). The statements are in [`super::sql`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio_postgres::Client;

use super::sql::{self, Shape};
use crate::bucket::Entry;
use crate::config::Counter;
use crate::kind::Kind;
use crate::store::DbError;
use crate::window::ALL_SPAN;

/// How long a counter writes through `tallyd.slots` after its first failed direct write...
pub const FIRST_OFF: Duration = Duration::from_secs(10);
/// ...doubled at each failure in a row, up to this.
pub const MAX_OFF: Duration = Duration::from_secs(600);

/// One recorded `rollup_into` target, as the database describes it (`tallyd.rollup_targets`
/// with its table's and columns' current names and types), and the statement that writes a
/// chunk of its rows.
#[derive(Debug)]
pub(super) struct Target {
    /// The span its rows have (`all` for an all-time target).
    span: String,
    /// The columns as declared, to tell a target recorded for other columns (a reload changed
    /// `rollup_into`) from the counter's own.
    key_column: String,
    count_column: String,
    window_column: Option<String>,
    insert_missing: bool,
    /// The statement, and whether it takes the compact arrays (key, window, count) of an
    /// `insert_missing` upsert rather than the slot upsert's.
    pub(super) sql: String,
    pub(super) compact: bool,
    /// The columns the statement's chunks carry (a max, min or unique target's values).
    pub(super) shape: Shape,
}

/// The targets of a database, by counter name (none on Citus).
#[derive(Debug, Default)]
pub(super) struct Targets {
    by_counter: HashMap<String, Target>,
}

/// Each recorded target with its table's qualified name and its columns quoted as the session
/// that runs the statements reads them, and the key and window columns' types
/// (`tallyd.rollup_targets_json()`, migrations/V11, V12), and its `on_add` columns, each with
/// its constant as a literal cast to the column's type (V18). A target whose table or a column is
/// gone has no `target` there, and is left out: its rows go to `tallyd.slots`.
const TARGETS: &str = "\
SELECT x.counter, format('%I.%I', n.nspname, c.relname), x.key_column, x.count_column,
       x.window_column, x.key_type, x.window_type, quote_literal(x.time_zone), x.insert_missing,
       x.span, x.kind,
       ARRAY(SELECT e.key FROM jsonb_each_text(x.on_add) e ORDER BY e.key),
       ARRAY(SELECT e.value FROM jsonb_each_text(x.on_add) e ORDER BY e.key)
FROM jsonb_to_recordset(tallyd.rollup_targets_json())
     AS x (counter text, target text, key_column text, count_column text, window_column text,
           key_type text, window_type text, time_zone text, insert_missing boolean, span text,
           kind text, on_add jsonb)
JOIN pg_class c ON c.oid = x.target::regclass
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE x.target IS NOT NULL";

impl Targets {
    /// The targets recorded in `client`'s database.
    pub(super) async fn load(client: &Client) -> Result<Targets, DbError> {
        let mut by_counter = HashMap::new();
        for row in client.query_typed(TARGETS, &[]).await? {
            let counter: String = row.get(0);
            let table: String = row.get(1);
            let key_column: String = row.get(2);
            let count_column: String = row.get(3);
            let window_column: Option<String> = row.get(4);
            let key_type: String = row.get(5);
            let window_type: String = row.get(6);
            let zone: String = row.get(7);
            let insert_missing: bool = row.get(8);
            let span: String = row.get(9);
            let kind = Kind::named(row.get::<_, &str>(10)).unwrap_or(Kind::Sum);
            let on_add: Vec<(String, String)> = row
                .get::<_, Vec<String>>(11)
                .into_iter()
                .zip(row.get::<_, Vec<String>>(12))
                .collect();
            let place = sql::Place {
                on_add: &on_add,
                table: &table,
                key_column: &key_column,
                count_column: &count_column,
                window_column: window_column.as_deref().filter(|_| span != "all"),
                key_type: &key_type,
                date: window_type == "date",
                zone: &zone,
            };
            let compact = insert_missing && kind == Kind::Sum && place.window_column.is_some();
            let shape = match kind {
                Kind::Sum => Shape::Sums,
                Kind::Unique => Shape::Sketches,
                _ => Shape::Values,
            };
            let Some(statement) = (if compact {
                Some(sql::direct_upsert(&place))
            } else {
                sql::direct_update(&place, kind, shape)
            }) else {
                continue;
            };
            by_counter.insert(
                counter,
                Target {
                    span,
                    key_column,
                    count_column,
                    window_column,
                    insert_missing,
                    sql: statement,
                    compact,
                    shape,
                },
            );
        }
        Ok(Targets { by_counter })
    }

    /// `counter`'s target, when the flush may write it directly: declared with `direct`, and
    /// recorded for the columns and window it declares.
    pub(super) fn of(&self, counter: &Counter) -> Option<&Target> {
        let into = counter.rollup_into.as_ref().filter(|into| into.direct)?;
        let target = self.by_counter.get(&counter.name)?;
        let span = counter.window.as_ref().map_or("all", |w| w.span().name());
        let same = target.span == span
            && target.key_column == into.key_column
            && target.count_column == into.column
            && target.window_column == into.window_column
            && target.insert_missing == into.insert_missing;
        same.then_some(target)
    }
}

/// A direct counter's rows in one flight: those of its target's window (or its all-time rows),
/// and its `also` rows, bound for `tallyd.rollups`.
pub(super) struct Group<'f> {
    pub(super) counter: u16,
    pub(super) target: Vec<&'f Entry>,
    pub(super) also: Vec<&'f Entry>,
}

/// Where a flight's rows go: `slots`, as before direct writes, and a [`Group`] per counter
/// written directly. Each keeps the rows' order.
pub(super) struct Plan<'f> {
    pub(super) slots: Vec<&'f Entry>,
    pub(super) direct: Vec<Group<'f>>,
}

/// The rows of a flight (sorted), split: a counter's rows go directly where `targets` has its
/// target and `fallback` has not turned it off.
pub(super) fn plan<'f>(
    rows: &[&'f Entry],
    counters: &[Counter],
    targets: &Targets,
    fallback: &Fallback,
    now: Instant,
) -> Plan<'f> {
    let mut slots = Vec::with_capacity(rows.len());
    let mut direct: Vec<Group<'f>> = Vec::new();
    // Per counter id: `None` not decided yet, then the span code of its target's rows (its
    // window's, or ALL_SPAN), or `Some(None)` for a counter written through slots.
    let mut decided: Vec<Option<Option<u8>>> = vec![None; counters.len()];
    for e in rows {
        let c = e.counter as usize;
        let way = *decided[c].get_or_insert_with(|| {
            let counter = &counters[c];
            targets
                .of(counter)
                .filter(|_| !fallback.is_off(e.counter, now))
                .map(|_| {
                    counter
                        .window
                        .as_ref()
                        .map_or(ALL_SPAN, |w| w.span().code())
                })
        });
        let Some(span) = way else {
            slots.push(*e);
            continue;
        };
        let group = match direct.last_mut() {
            Some(g) if g.counter == e.counter => g,
            _ => {
                direct.push(Group {
                    counter: e.counter,
                    target: Vec::new(),
                    also: Vec::new(),
                });
                direct.last_mut().expect("pushed")
            }
        };
        if e.span == span {
            group.target.push(*e);
        } else {
            group.also.push(*e);
        }
    }
    Plan { slots, direct }
}

/// Which counters write through `tallyd.slots` for now, after a direct write failed: shared by
/// a database's flush workers. The first failure turns a counter's direct writes off for
/// [`FIRST_OFF`], each failure in a row doubles that (up to [`MAX_OFF`]), and a flight that
/// writes the counter directly again resets it. So a failing target costs one failed try per
/// period, never a retry loop.
#[derive(Debug, Default)]
pub struct Fallback {
    off: Mutex<HashMap<u16, Off>>,
}

#[derive(Debug, Clone, Copy)]
struct Off {
    until: Instant,
    strikes: u32,
}

impl Fallback {
    pub fn new() -> Fallback {
        Fallback::default()
    }

    /// Whether `counter` writes through `tallyd.slots` at `now`.
    pub fn is_off(&self, counter: u16, now: Instant) -> bool {
        let off = self.off.lock().unwrap_or_else(|e| e.into_inner());
        off.get(&counter).is_some_and(|o| now < o.until)
    }

    /// A direct write of `counter` failed at `now`: returns for how long it now writes through
    /// `tallyd.slots`.
    pub fn failed(&self, counter: u16, now: Instant) -> Duration {
        let mut off = self.off.lock().unwrap_or_else(|e| e.into_inner());
        let strikes = off.get(&counter).map_or(0, |o| o.strikes) + 1;
        let period = FIRST_OFF
            .saturating_mul(1 << (strikes - 1).min(16))
            .min(MAX_OFF);
        off.insert(
            counter,
            Off {
                until: now + period,
                strikes,
            },
        );
        period
    }

    /// A flight planned at `planned` wrote `counters` directly: their next failure starts again
    /// from [`FIRST_OFF`]. Only a fallback that had ended by `planned` is cleared: one another
    /// worker's failure started while this flight was in the air stands, since this success
    /// says nothing about the target since then.
    pub fn succeeded(&self, counters: impl IntoIterator<Item = u16>, planned: Instant) {
        let mut off = self.off.lock().unwrap_or_else(|e| e.into_inner());
        if off.is_empty() {
            return;
        }
        for c in counters {
            if off.get(&c).is_some_and(|o| o.until <= planned) {
                off.remove(&c);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_turns_a_counter_off_for_a_while_doubling_until_it_writes_again() {
        let f = Fallback::new();
        let t0 = Instant::now();
        assert!(!f.is_off(3, t0));
        assert_eq!(f.failed(3, t0), FIRST_OFF);
        assert!(f.is_off(3, t0 + FIRST_OFF - Duration::from_millis(1)));
        assert!(!f.is_off(3, t0 + FIRST_OFF));
        assert!(!f.is_off(4, t0), "only the counter that failed");
        let t1 = t0 + FIRST_OFF;
        assert_eq!(f.failed(3, t1), FIRST_OFF * 2);
        assert_eq!(f.failed(3, t1), FIRST_OFF * 4);
        for _ in 0..30 {
            f.failed(3, t1);
        }
        assert_eq!(f.failed(3, t1), MAX_OFF);
        let ended = t1 + MAX_OFF;
        f.succeeded([3], t1);
        assert!(
            f.is_off(3, t1),
            "a flight planned before the failure clears nothing"
        );
        f.succeeded([3], ended);
        assert!(!f.is_off(3, ended));
        assert_eq!(
            f.failed(3, ended),
            FIRST_OFF,
            "a success planned after the fallback ended resets the doubling"
        );
    }
}
