//! How a flight is tried again: what the ledger says a try must do (`settle`), the wait before
//! the next try (`Backoff`), the statement size after a statement timeout (`ChunkSize`), and
//! when a slow commit means the database, not the timer, sets the pace (`database_behind`).

use std::time::Duration;

use rand::Rng;

use crate::config::FlushConfig;

/// What a try does with its flight, given the highest seq this writer is known to have committed.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Settle {
    /// The flight's transaction committed on a connection that was lost before it said so.
    AlreadyCommitted,
    /// Write the flight as `seq`: a new number for a new flight, its own for a retry.
    Write { seq: i64 },
}

/// A flight that took at least a flush interval to commit means the database, not the timer,
/// sets the pace. Flushing again at once would write most of the same keys again a moment
/// later (at high cardinality nearly every key has new events by then), so the worker keeps
/// coalescing instead: its next flush comes one interval after this commit, and the early
/// flush at `flush.max_pending_keys` is ignored until a flight commits within the interval.
/// `!flush`, readers paused at the memory cap and the stop still flush at once.
pub(super) fn database_behind(took: Duration, interval: Duration) -> bool {
    took >= interval
}

/// Only a numbered flight can have committed (a number is given just before its first write),
/// and the ledger row holds the last committed number, so `committed >= seq` means it did.
pub(super) fn settle(flight: Option<i64>, committed: i64) -> Settle {
    match flight {
        Some(seq) if committed >= seq => Settle::AlreadyCommitted,
        Some(seq) => Settle::Write { seq },
        None => Settle::Write { seq: committed + 1 },
    }
}

/// Rows per upsert statement: `batch_rows`, halved after each statement timeout (down to one),
/// doubled again after [`REGROW_AFTER`] clean commits in a row.
#[derive(Debug)]
pub(super) struct ChunkSize {
    pub(super) rows: usize,
    batch_rows: usize,
    /// Commits since the last statement timeout.
    clean_commits: u32,
}

/// Clean commits after which a reduced statement size doubles again.
const REGROW_AFTER: u32 = 16;

impl ChunkSize {
    pub(super) fn new(batch_rows: usize) -> ChunkSize {
        ChunkSize {
            rows: batch_rows,
            batch_rows,
            clean_commits: 0,
        }
    }

    /// A statement of a flight of `flight_rows` timed out: returns the size before and after.
    pub(super) fn shrink(&mut self, flight_rows: usize) -> (usize, usize) {
        self.clean_commits = 0;
        let was = self.rows;
        self.rows = (was.min(flight_rows) / 2).max(1);
        (was, self.rows)
    }

    /// A flight committed: returns the new size if it grew back.
    pub(super) fn committed(&mut self) -> Option<usize> {
        if self.rows >= self.batch_rows {
            return None;
        }
        self.clean_commits += 1;
        if self.clean_commits < REGROW_AFTER {
            return None;
        }
        self.clean_commits = 0;
        self.rows = (self.rows * 2).min(self.batch_rows);
        Some(self.rows)
    }
}

/// The wait before retrying a failed flight: doubling from `retry_initial_ms` up to
/// `retry_max_ms`, plus up to half again of jitter so that workers do not retry in step.
pub(super) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    pub(super) fn new(config: &FlushConfig) -> Backoff {
        Backoff {
            next: config.retry_initial(),
            max: config.retry_max(),
        }
    }

    pub(super) fn wait(&mut self) -> Duration {
        let jitter = rand::thread_rng().gen_range(0..=self.next.as_millis() as u64 / 2);
        let wait = self.next + Duration::from_millis(jitter);
        self.next = (self.next * 2).min(self.max);
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_flight_takes_the_next_number() {
        assert_eq!(settle(None, 0), Settle::Write { seq: 1 });
        assert_eq!(settle(None, 41), Settle::Write { seq: 42 });
    }

    #[test]
    fn a_flight_the_ledger_holds_is_accepted_as_committed() {
        // The COMMIT of flight 7 reached the database, the answer did not.
        assert_eq!(settle(Some(7), 7), Settle::AlreadyCommitted);
    }

    #[test]
    fn a_flight_the_ledger_lacks_is_retried_as_itself() {
        // Flight 7 failed before its COMMIT: same number, never a new one (which would let a
        // later settle take flight 8 for committed when only 7 is missing).
        assert_eq!(settle(Some(7), 6), Settle::Write { seq: 7 });
    }

    #[test]
    fn statement_timeouts_halve_chunks_and_clean_commits_regrow_them() {
        let mut c = ChunkSize::new(1000);
        assert_eq!(c.committed(), None, "full size does not grow");
        // A flight smaller than the chunk halves from its own size.
        assert_eq!(c.shrink(300), (1000, 150));
        assert_eq!(c.shrink(300), (150, 75));
        for _ in 1..REGROW_AFTER {
            assert_eq!(c.committed(), None);
        }
        assert_eq!(c.committed(), Some(150));
        assert_eq!(c.shrink(1), (150, 1));
        assert_eq!(c.shrink(1), (1, 1), "never below one row");
    }
}
