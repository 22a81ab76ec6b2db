//! The rollup's pace, per unit (pure, unit-tested below): where its next step starts (the key
//! cursor), how many rows it claims, when it runs, and how far behind the unit is.
//!
//! A unit walks its keys in passes: each step claims the rows after the cursor, and a step that
//! claims fewer rows than it asked for ends the pass (the next starts at the first key again, so
//! rows written behind the cursor are found then). While steps come back full the unit is behind:
//! the next step runs at once, and a step that took less than [`GROW_BELOW`] doubles the batch
//! (up to [`MAX_BATCH`]), one that took more than [`SHRINK_ABOVE`] halves it (a flush waits at
//! most one step for a slot row a step holds). A pass that ends is followed by the next one an
//! interval after it began: a caught-up unit folds each key about once per interval, and a slot
//! row absorbs that interval's flushes as in-place updates, the cheapest write.

use std::time::{Duration, Instant};

/// A step faster than this doubles the next step's batch while the unit is behind.
pub const GROW_BELOW: Duration = Duration::from_millis(100);
/// A step slower than this halves the next step's batch.
pub const SHRINK_ABOVE: Duration = Duration::from_millis(250);
/// The largest batch: about 200 ms of work at the step's cost per row (8 µs on a loaded 2-core
/// machine, docs/benchmarks.md); a step has no per-key lock, so nothing else bounds it.
pub const MAX_BATCH: i32 = 50_000;
/// The smallest batch a slow step shrinks to.
pub const MIN_BATCH: i32 = 100;

/// What one step did (`tallyd.rollup_step`, migrations/V14).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stepped {
    /// Slot rows folded.
    pub folded: i64,
    /// Slot rows (or, after a key-by-key fallback, keys) claimed.
    pub claimed: i64,
    /// The last key claimed when the step claimed a full batch; `None`: the pass ended.
    pub last_key: Option<String>,
}

/// One unit's pace.
#[derive(Debug)]
pub struct Pace {
    batch: i32,
    /// Adapt the batch (the daemon), or keep it (`tallyd rollup --batch-rows`).
    adaptive: bool,
    /// The last key the previous step claimed; empty at the start of a pass.
    cursor: String,
    /// When the current pass's first step began (`None` between passes).
    pass_started: Option<Instant>,
    /// When the last completed pass began: every row written before it was folded by it (or
    /// held back, or locked by another transaction then). The start, before any pass completed.
    completed: Instant,
    /// When the next step may run.
    due: Instant,
}

impl Pace {
    /// A unit whose first step, of `batch` rows, is due at `now`.
    pub fn new(batch: i32, adaptive: bool, now: Instant) -> Pace {
        Pace {
            batch: batch.max(1),
            adaptive,
            cursor: String::new(),
            pass_started: None,
            completed: now,
            due: now,
        }
    }

    pub fn due(&self) -> Instant {
        self.due
    }

    pub fn batch(&self) -> i32 {
        self.batch
    }

    /// The key the next step starts after ('' at a pass's start).
    pub fn cursor(&self) -> &str {
        &self.cursor
    }

    /// A step begins at `now`: the first of a pass starts the pass.
    pub fn begin(&mut self, now: Instant) {
        if self.pass_started.is_none() {
            self.pass_started = Some(now);
        }
    }

    /// The step begun last did `stepped` in `took`; it ended at `now`.
    pub fn stepped(&mut self, stepped: &Stepped, took: Duration, now: Instant, interval: Duration) {
        match &stepped.last_key {
            Some(key) => {
                // Behind: the next step at once, from after the last key claimed.
                self.cursor.clone_from(key);
                self.due = now;
                if self.adaptive {
                    if took < GROW_BELOW {
                        self.batch = (self.batch.saturating_mul(2)).min(MAX_BATCH.max(self.batch));
                    } else if took > SHRINK_ABOVE {
                        self.batch = (self.batch / 2).max(MIN_BATCH.min(self.batch));
                    }
                }
            }
            None => {
                // The pass ended: the next one an interval after this one began.
                let started = self.pass_started.take().unwrap_or(now);
                self.completed = started;
                self.cursor.clear();
                self.due = (started + interval).max(now);
                if self.adaptive && took > SHRINK_ABOVE {
                    self.batch = (self.batch / 2).max(MIN_BATCH.min(self.batch));
                }
            }
        }
    }

    /// The step failed at `now`: tried again from the same key an interval later.
    pub fn failed(&mut self, now: Instant, interval: Duration) {
        self.due = now + interval;
    }

    /// How long ago the last completed pass began: no row written before then waits in
    /// `tallyd.slots` (but those held back or locked by others).
    pub fn lag(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.completed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INTERVAL: Duration = Duration::from_secs(10);

    fn full(key: &str, n: i64) -> Stepped {
        Stepped {
            folded: n,
            claimed: n,
            last_key: Some(key.into()),
        }
    }

    fn short(n: i64) -> Stepped {
        Stepped {
            folded: n,
            claimed: n,
            last_key: None,
        }
    }

    #[test]
    fn a_full_step_moves_the_cursor_and_runs_the_next_at_once() {
        let t0 = Instant::now();
        let mut p = Pace::new(1000, true, t0);
        assert_eq!((p.cursor(), p.due()), ("", t0));
        p.begin(t0);
        let t1 = t0 + Duration::from_millis(30);
        p.stepped(&full("k500", 1000), Duration::from_millis(30), t1, INTERVAL);
        assert_eq!(p.cursor(), "k500");
        assert_eq!(p.due(), t1);
    }

    #[test]
    fn fast_full_steps_grow_the_batch_up_to_the_cap_and_slow_ones_shrink_it() {
        let t0 = Instant::now();
        let mut p = Pace::new(1000, true, t0);
        let mut sizes = Vec::new();
        for i in 0..10 {
            p.begin(t0);
            p.stepped(
                &full(&format!("k{i}"), 1),
                Duration::from_millis(20),
                t0,
                INTERVAL,
            );
            sizes.push(p.batch());
        }
        assert_eq!(
            sizes,
            [2000, 4000, 8000, 16000, 32000, 50000, 50000, 50000, 50000, 50000]
        );
        p.stepped(&full("z", 1), Duration::from_millis(400), t0, INTERVAL);
        assert_eq!(p.batch(), 25000);
        // Between the bounds: kept.
        p.stepped(&full("z", 1), Duration::from_millis(150), t0, INTERVAL);
        assert_eq!(p.batch(), 25000);
        for _ in 0..20 {
            p.stepped(&full("z", 1), Duration::from_secs(1), t0, INTERVAL);
        }
        assert_eq!(p.batch(), MIN_BATCH);
    }

    #[test]
    fn a_fixed_batch_never_changes() {
        let t0 = Instant::now();
        let mut p = Pace::new(300, false, t0);
        p.stepped(&full("a", 300), Duration::from_millis(1), t0, INTERVAL);
        p.stepped(&full("b", 300), Duration::from_secs(5), t0, INTERVAL);
        p.stepped(&short(3), Duration::from_secs(5), t0, INTERVAL);
        assert_eq!(p.batch(), 300);
    }

    #[test]
    fn a_short_step_ends_the_pass_and_the_next_comes_an_interval_after_it_began() {
        let t0 = Instant::now();
        let mut p = Pace::new(1000, true, t0);
        p.begin(t0);
        p.stepped(
            &full("k1", 1000),
            Duration::from_millis(10),
            t0 + Duration::from_millis(10),
            INTERVAL,
        );
        let t1 = t0 + Duration::from_millis(20);
        p.begin(t1);
        let t2 = t0 + Duration::from_millis(30);
        p.stepped(&short(40), Duration::from_millis(10), t2, INTERVAL);
        assert_eq!(p.cursor(), "", "the next pass starts at the first key");
        assert_eq!(p.due(), t0 + INTERVAL, "an interval after the pass began");
        assert_eq!(p.lag(t2), Duration::from_millis(30));
        // A pass longer than the interval: the next starts at once.
        let t3 = t0 + INTERVAL;
        p.begin(t3);
        let t4 = t3 + INTERVAL + Duration::from_secs(1);
        p.stepped(&short(0), Duration::from_millis(1), t4, INTERVAL);
        assert_eq!(p.due(), t4);
        assert_eq!(p.lag(t4), INTERVAL + Duration::from_secs(1));
    }

    #[test]
    fn lag_grows_while_no_pass_completes() {
        let t0 = Instant::now();
        let mut p = Pace::new(1000, true, t0);
        for i in 0..100u64 {
            let t = t0 + Duration::from_secs(i);
            p.begin(t);
            p.stepped(
                &full(&format!("k{i:03}"), 1000),
                Duration::from_millis(50),
                t,
                INTERVAL,
            );
        }
        assert_eq!(
            p.lag(t0 + Duration::from_secs(100)),
            Duration::from_secs(100)
        );
    }

    #[test]
    fn a_failed_step_is_retried_from_the_same_key_an_interval_later() {
        let t0 = Instant::now();
        let mut p = Pace::new(1000, true, t0);
        p.begin(t0);
        p.stepped(&full("k7", 1000), Duration::from_millis(10), t0, INTERVAL);
        p.begin(t0);
        p.failed(t0, INTERVAL);
        assert_eq!((p.cursor(), p.due()), ("k7", t0 + INTERVAL));
    }
}
