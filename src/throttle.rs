//! Rate-limited logging: at most one line per kind per second, with the count of the ones held back.
//! Bad input must be visible in the logs without a hostile client being able to flood them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

#[derive(Debug)]
pub struct Throttle {
    /// Milliseconds since `epoch()` of the last line written.
    last_ms: AtomicU64,
    suppressed: AtomicU64,
    interval_ms: u64,
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl Throttle {
    pub const fn new(interval_ms: u64) -> Throttle {
        Throttle {
            last_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
            interval_ms,
        }
    }

    /// `Some(n)` when a line may be written now, `n` being how many were held back since the last one.
    pub fn allow(&self) -> Option<u64> {
        // +1 so that the very first call (at 0 ms) is allowed.
        let now = epoch().elapsed().as_millis() as u64 + self.interval_ms + 1;
        let last = self.last_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= self.interval_ms
            && self
                .last_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            Some(self.suppressed.swap(0, Ordering::Relaxed))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_passes_then_holds_back() {
        let t = Throttle::new(60_000);
        assert_eq!(t.allow(), Some(0));
        assert_eq!(t.allow(), None);
        assert_eq!(t.allow(), None);
        let t = Throttle::new(0);
        assert_eq!(t.allow(), Some(0));
        assert_eq!(t.allow(), Some(0));
    }
}
