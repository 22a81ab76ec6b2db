//! A unique counter's rows held back while the database lacks the hll extension (a `DROP
//! EXTENSION hll CASCADE`): taken out of a flight so that the flight's other rows commit, kept
//! by the worker, and put back into each later flight, until one commits them.
//!
//! Why this is exactly once (docs/reliability.md, "A unique counter without its extension"):
//! the held rows are never written by the flight that held them, so they are written once, by
//! the flight that commits them, under its ledger row. And the journal keeps them: the flight
//! that commits without them records, beside `journal_covered`, how far this writer's unique
//! lines are committed (`unique_covered`, migrations/V21): no further than before the first
//! flight that held some. A replay after a crash replays a unique counter's lines above
//! `unique_covered` and every other line above `journal_covered`: the held rows again, the
//! committed ones never. The journal's own coverage (which deletes segments and answers a
//! `!flush` after spilled records) stays at `unique_covered` too.
//!
//! A `!flush` waits with the held rows when its connection sent unique events among them (the
//! buckets name those connections, [`Drained::unique_conns`]); the others are answered when
//! their flight commits.

use std::time::Instant;

use tracing::{debug, info, warn};

use super::{sql, Flight, FlushWorker};
use crate::bucket::{Agg, Correct, Drained, Entry, Waiter};
use crate::events;
use crate::kind::{Kind, Value};
use crate::store::DbError;

/// The rows one worker holds back, with the waits that wait for them.
#[derive(Default)]
pub(super) struct Held {
    /// Each row with the bucket it was drained from.
    entries: Vec<(usize, Entry)>,
    waiters: Vec<Waiter>,
    conns: Vec<u64>,
    since: Option<Instant>,
    pub(super) rows: usize,
    pub(super) events: u64,
    /// The counters of the rows, for the report.
    pub(super) counters: Vec<u16>,
}

impl Held {
    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.waiters.is_empty()
    }

    /// Takes the unique rows out of `parts` (each whole: a unique key's windows and all-time
    /// row are all unique rows), and the waits of the connections that sent unique events
    /// among them. Returns the rows and events taken.
    pub(super) fn take(&mut self, parts: &mut [Drained]) -> (usize, u64) {
        let (mut rows, mut events) = (0, 0);
        for part in parts.iter_mut() {
            let unique = |e: &Entry| e.value.kind() == Some(Kind::Unique);
            if part.entries.iter().any(unique) {
                self.since = match (self.since, part.since) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
            for e in part.entries.extract_if(|e| unique(e)) {
                rows += 1;
                events += e.agg.events;
                if !self.counters.contains(&e.counter) {
                    self.counters.push(e.counter);
                }
                self.entries.push((part.bucket, e));
            }
            for conn in part.unique_conns.drain(..) {
                if !self.conns.contains(&conn) {
                    self.conns.push(conn);
                }
            }
        }
        for part in parts.iter_mut() {
            for waiter in std::mem::take(&mut part.waiters) {
                if self.conns.contains(&waiter.conn) {
                    self.waiters.push(waiter);
                } else {
                    part.waiters.push(waiter);
                }
            }
        }
        self.rows += rows;
        self.events += events;
        (rows, events)
    }

    /// Puts every held row back into `parts` (a newer drain), merged with the same row there,
    /// and the held waits with them. Returns the rows and events added to the parts' counts,
    /// and the rows that merged into a newer one: no longer pending on their own.
    pub(super) fn put_back(&mut self, parts: &mut Vec<Drained>) -> (usize, u64, Vec<u16>) {
        // A forget in the newer drain deletes every stored row of its key: held rows of that
        // key are superseded by it, as pending ones are in a bucket (their events stay counted).
        let forgotten: Vec<(u16, compact_str::CompactString)> = parts
            .iter()
            .flat_map(|d| d.entries.iter())
            .filter(|e| e.reset == Correct::Forget)
            .map(|e| (e.counter, e.key.clone()))
            .collect();
        let (mut rows, mut events, mut merged) = (0, 0, Vec::new());
        for (bucket, mut held) in std::mem::take(&mut self.entries) {
            if forgotten.contains(&(held.counter, held.key.clone())) {
                held.agg = Agg {
                    events: held.agg.events,
                    ..Agg::EMPTY
                };
                held.reset = Correct::None;
                held.value = Value::default();
            }
            events += held.agg.events;
            let part = match parts.iter().position(|d| d.bucket == bucket) {
                Some(i) => &mut parts[i],
                None => {
                    parts.push(Drained {
                        bucket,
                        ..Drained::default()
                    });
                    parts.last_mut().expect("pushed")
                }
            };
            part.events += held.agg.events;
            let newer = part.entries.find_mut(held.hash, |x| {
                (x.counter, x.span, x.win) == (held.counter, held.span, held.win)
                    && x.key == held.key
            });
            match newer {
                Some(newer) => {
                    absorb(held, newer);
                    merged.push(newer.counter);
                }
                None => {
                    rows += 1;
                    part.entries.insert_unique(held.hash, held, |x| x.hash);
                }
            }
        }
        if let Some(first) = parts.first_mut() {
            first.waiters.append(&mut self.waiters);
            first.unique_conns.append(&mut self.conns);
            first.since = match (first.since, self.since) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        *self = Held::default();
        (rows, events, merged)
    }
}

impl FlushWorker {
    /// Takes the unique rows out of `flight` and holds them (see [`held`]): the database lacks
    /// the hll extension (`cause`), and the rest of the flight is written without them.
    pub(super) fn hold(&mut self, flight: &mut Flight, cause: &(dyn std::fmt::Display + Sync)) {
        // Rows held already are merged with the same rows of this flight first, in the order
        // they were drained (a `!forget` here supersedes them), and held again with them.
        self.put_back(flight);
        let (rows, events) = self.held.take(&mut flight.parts);
        flight.rows -= rows;
        flight.events -= events;
        self.held_from.get_or_insert(self.whole);
        let counters = self.ctx.counters.get();
        let names: Vec<&str> = self
            .held
            .counters
            .iter()
            .filter_map(|&c| counters.get(c as usize).map(|c| c.name.as_str()))
            .collect();
        let targets: Vec<String> = self
            .held
            .counters
            .iter()
            .filter_map(|&c| counters.get(c as usize)?.rollup_into.as_ref())
            .map(|t| format!("{}.{}", t.table, t.column))
            .collect();
        events::UniqueHeld {
            database: self.ctx.database,
            worker: self.index,
            counters: &names.join(", "),
            targets: &targets.join(", "),
            rows: self.held.rows,
            events: self.held.events,
            cause,
        }
        .emit();
    }

    /// Before a flight while unique rows are held: when the hll extension is back (or this
    /// cannot tell without a try), makes `tallyd.unique_totals` again if it is gone and puts
    /// the held rows into `flight`; else holds the flight's unique rows too, untried.
    pub(super) async fn hold_or_put_back(&mut self, flight: &mut Flight) {
        let back = match &self.session.conn {
            None => None,
            Some(conn) => match conn.client.query_typed_one(sql::HAS_HLL, &[]).await {
                Ok(row) => Some(row.get::<_, bool>(0)),
                Err(err) => {
                    debug!(worker = self.index, cause = %DbError::from(err),
                        "cannot ask for the hll extension; trying the flight");
                    self.session.conn = None;
                    None
                }
            },
        };
        if back == Some(false) {
            let cause = "the hll extension is not installed in the database";
            self.hold(flight, &cause);
            return;
        }
        if let (Some(true), Some(conn)) = (back, &self.session.conn) {
            match crate::store::restore_unique_totals(&conn.client).await {
                Ok(true) => info!(
                    worker = self.index,
                    database = self.ctx.database,
                    "the hll extension is back: made tallyd.unique_totals again"
                ),
                Ok(false) => {}
                Err(err) => warn!(worker = self.index, database = self.ctx.database,
                    cause = %DbError::from(err),
                    "cannot make tallyd.unique_totals again; the next start makes it"),
            }
        }
        self.put_back(flight);
    }

    /// Puts the held rows back into `flight` (see [`Held::put_back`]).
    fn put_back(&mut self, flight: &mut Flight) {
        if self.held.is_empty() {
            return;
        }
        let (rows, events, merged) = self.held.put_back(&mut flight.parts);
        flight.rows += rows;
        flight.events += events;
        // A held row merged into the same key's newer row: one pending row less.
        for counter in &merged {
            self.ctx
                .shared
                .remove_counter_pending(*counter as usize, 1, 0);
        }
        self.ctx.shared.remove_pending(merged.len(), 0);
    }
}

/// Merges `held` into `newer`, the same row of a later drain: held first, as if both had been
/// drained together. A forget in `newer` supersedes the held row (its events stay counted, as
/// superseded ones do in a bucket); a forget in `held` stays first.
fn absorb(held: Entry, newer: &mut Entry) {
    if newer.reset == Correct::Forget {
        newer.agg.events += held.agg.events;
        return;
    }
    if held.agg.is_empty() {
        // A held forget with nothing after it still deletes the key's stored rows before the
        // newer events are written (dropping it lost the forget).
        newer.agg.events += held.agg.events;
        if held.reset != Correct::None {
            newer.reset = held.reset;
        }
        return;
    }
    if newer.agg.is_empty() {
        newer.agg.events += held.agg.events;
        newer.agg = Agg {
            events: newer.agg.events,
            ..held.agg
        };
        newer.value = held.value;
        newer.reset = held.reset;
        return;
    }
    let agg = held.agg.merge(&newer.agg).unwrap_or(Agg {
        // A unique row's `sum` counts its events: it cannot reach the 64-bit edge.
        sum: i64::MAX,
        ..held.agg
    });
    let mut value = held.value;
    // Rows of one unique counter hold sketches of its one precision: they always union.
    let _ = value.merge(held.agg.last_ms, &newer.value, newer.agg.last_ms);
    newer.agg = agg;
    newer.value = value;
    newer.reset = held.reset;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hll::Params;
    use crate::kind::Op;

    fn entry(key: &str, op: Op, values: &[i64], events: u64) -> Entry {
        let mut value = Value::empty(op);
        for (i, v) in values.iter().enumerate() {
            value.add(*v, i as i64, i as i64);
        }
        Entry {
            hash: key.len() as u64,
            counter: u16::from(op != Op::Sum),
            span: crate::window::ALL_SPAN,
            win: crate::window::ALL_TIME,
            key: key.into(),
            agg: Agg {
                sum: events as i64,
                first_ms: 0,
                last_ms: values.len() as i64,
                events,
            },
            value,
            reset: Correct::None,
        }
    }

    fn part(entries: Vec<Entry>, unique_conns: Vec<u64>) -> Drained {
        let mut d = Drained {
            unique_conns,
            ..Drained::default()
        };
        for e in entries {
            d.events += e.agg.events;
            d.entries.insert_unique(e.hash, e, |x| x.hash);
        }
        d
    }

    #[test]
    fn unique_rows_leave_and_come_back_merged_with_newer_ones() {
        let unique = Op::Unique(Params::default());
        let mut parts = vec![part(
            vec![entry("s", Op::Sum, &[], 3), entry("u", unique, &[1, 2], 2)],
            vec![7],
        )];
        let mut held = Held::default();
        assert_eq!(held.take(&mut parts), (1, 2));
        assert_eq!(parts[0].entries.len(), 1, "the sum stays");
        let mut newer = vec![part(vec![entry("u", unique, &[2, 3], 2)], vec![])];
        let (rows, events, merged) = held.put_back(&mut newer);
        assert_eq!((rows, events, merged.len()), (0, 2, 1));
        assert!(held.is_empty());
        let e = newer[0].entries.iter().next().unwrap();
        assert_eq!((e.agg.events, e.agg.sum), (4, 4));
        let mut want = Value::empty(unique);
        for v in [1, 2, 3] {
            want.add(v, 0, 0);
        }
        assert_eq!(e.value, want, "the union of both sketches");
        assert_eq!(newer[0].unique_conns, vec![7]);
    }

    #[test]
    fn a_forget_held_after_held_rows_supersedes_them() {
        let unique = Op::Unique(Params::default());
        let mut held = Held::default();
        held.take(&mut [part(vec![entry("u", unique, &[1, 2], 2)], vec![])]);
        // Held again (the extension still missing) with a newer drain that forgets the key,
        // as the worker's `hold` does: put back, then taken.
        let mut forget = entry("u", unique, &[3], 1);
        forget.reset = Correct::Forget;
        let mut parts = vec![part(vec![forget], vec![])];
        held.put_back(&mut parts);
        assert_eq!(held.take(&mut parts), (1, 3));
        let mut back = vec![Drained::default()];
        held.put_back(&mut back);
        let e = back[0].entries.iter().next().unwrap();
        assert_eq!(e.reset, Correct::Forget, "the forget stays first");
        assert_eq!(
            (e.agg.sum, e.agg.events),
            (1, 3),
            "only the event after it counts"
        );
        let mut want = Value::empty(unique);
        want.add(3, 0, 0);
        assert_eq!(e.value, want);
    }

    #[test]
    fn a_held_forget_with_nothing_after_it_stays_first() {
        let unique = Op::Unique(Params::default());
        let mut forget = entry("u", unique, &[], 0);
        forget.agg = Agg::EMPTY;
        forget.reset = Correct::Forget;
        let mut held = Held::default();
        assert_eq!(held.take(&mut [part(vec![forget], vec![])]), (1, 0));
        let mut parts = vec![part(vec![entry("u", unique, &[4], 1)], vec![])];
        held.put_back(&mut parts);
        let e = parts[0].entries.iter().next().unwrap();
        assert_eq!(
            e.reset,
            Correct::Forget,
            "the held forget deletes the stored rows before the newer event is written"
        );
        assert_eq!((e.agg.sum, e.agg.events), (1, 1));
    }
}
