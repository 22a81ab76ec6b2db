//! Keys and sets the database refuses for the 64-bit edge, taken out of a flight: a key whose
//! totals would leave the range, whole (`take_out`), and a set `tallyd.correct` refuses
//! (SQLSTATE TD003), answered `error overflow` (`refuse`); the rest of the flight is written at
//! once.

use compact_str::CompactString;
use tracing::error;

use super::{Flight, FlushWorker};
use crate::bucket::{Agg, Correct};
use crate::events;
use crate::window::SpanCode;

impl FlushWorker {
    /// Takes out of `flight` the keys whose totals would leave the 64-bit range with its rows,
    /// each whole: every row of the key (its windows, its `also` rows, its all-time row) holds
    /// the same events, so an event is counted in all its rows or in none. The events are
    /// rejected (reason `overflow`, a log line naming the counter and the key). A key with a
    /// set in the flight first loses the set instead (`refuse`): the flight is tried again
    /// with the key's events as they were before it.
    pub(super) async fn take_out(&mut self, flight: &mut Flight, keys: &[(u16, CompactString)]) {
        for (counter, key) in keys {
            let set = flight.parts.iter().find_map(|d| {
                d.sets
                    .iter()
                    .find(|n| n.counter == *counter && n.key == *key)
                    .map(|n| (n.counter, n.key.clone(), n.span, n.win))
            });
            if let Some(id) = set {
                let cause =
                    "its rows, with this flush's events, would leave the signed 64-bit range";
                self.refuse(flight, &id, &cause).await;
                continue;
            }
            let (mut rows, mut events) = (0, 0);
            for part in &mut flight.parts {
                part.entries.retain(|e| {
                    let out = e.counter == *counter && e.key == *key;
                    if out {
                        rows += 1;
                        events += e.agg.events;
                    }
                    !out
                });
            }
            flight.rows -= rows;
            flight.events -= events;
            self.ctx
                .shared
                .remove_counter_pending(*counter as usize, rows, events);
            self.ctx.shared.remove_pending(rows, events);
            let counters = self.ctx.counters.get();
            events::ValueOverflow {
                counter: counters.get(*counter as usize).map_or("?", |c| &c.name),
                key,
                events,
            }
            .emit();
        }
    }

    /// Refuses the set `id` of `flight` (tallyd.correct found it would move a row beside its
    /// window beyond the 64-bit range, or its key's rows overflowed with it): its window keeps
    /// the events the set superseded and those after it, as if it had not been sent, and the
    /// connection that sent it is answered `error overflow`.
    pub(super) async fn refuse(
        &mut self,
        flight: &mut Flight,
        id: &(u16, CompactString, SpanCode, i64),
        cause: &(dyn std::fmt::Display + Sync),
    ) {
        let (counter, key, span, win) = id;
        let same = |c: u16, k: &CompactString, s: SpanCode, w: i64| {
            (c, s, w) == (*counter, *span, *win) && k == key
        };
        let Some(part) = flight.parts.iter_mut().find(|d| {
            d.sets
                .iter()
                .any(|n| same(n.counter, &n.key, n.span, n.win))
        }) else {
            // Every set tallyd.correct can refuse has its note: not reached.
            error!(worker = self.index, counter, key = %key, "refused correction not found in its flight");
            return;
        };
        let i = part
            .sets
            .iter()
            .position(|n| same(n.counter, &n.key, n.span, n.win))
            .expect("found above");
        let note = part.sets.swap_remove(i);
        flight.refused = true;
        for e in part.entries.iter_mut() {
            if same(e.counter, &e.key, e.span, e.win) && e.reset != Correct::None {
                // A forget before the set stays (its entry is marked `Forget`: see
                // `Corrections::of`).
                if e.reset == Correct::Set {
                    e.reset = Correct::None;
                }
                // The events after the set, on top of those it superseded.
                let kept =
                    i128::from(note.superseded) + i128::from(e.agg.sum) - i128::from(note.value);
                // Beyond the range only if they were: the next try takes the key out then.
                e.agg.sum = kept.clamp(i64::MIN.into(), i64::MAX.into()) as i64;
                if (e.agg.sum, e.agg.events, note.superseded) == (0, 0, 0) {
                    // Nothing but the set: no row to write (a refused set leaves no trace).
                    e.agg = Agg::EMPTY;
                }
            }
        }
        match part.waiters.iter_mut().find(|w| w.conn == note.conn) {
            Some(waiter) => waiter.refused.push(note.serial),
            None => {
                let bucket = self.buckets.iter().find(|b| b.index() == part.bucket);
                if let Some(Err(err)) = match bucket {
                    Some(b) => Some(b.refused(note.conn, note.serial).await),
                    None => None,
                } {
                    error!(worker = self.index, cause = %err, "a refused correction cannot be answered");
                }
            }
        }
        let counters = self.ctx.counters.get();
        events::CorrectionRefused {
            counter: counters.get(*counter as usize).map_or("?", |c| &c.name),
            key,
            cause,
        }
        .emit();
    }
}
