//! Pending-state accounting shared by connections, buckets and flush workers: how many keys and
//! events wait in memory, and the wake-ups that keep that bounded (early flushes, paused readers).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

#[derive(Debug)]
pub struct Shared {
    pending_keys: AtomicUsize,
    pending_events: AtomicU64,
    /// Events sent to the buckets but not yet recorded: each may still become a new key, so the
    /// cap counts them until the bucket knows (otherwise a connection's next check would miss
    /// its previous read, still queued, and the cap would leak by whole queues).
    in_transit: AtomicUsize,
    /// Flush early once this many keys are pending.
    flush_threshold: usize,
    /// Connections stop reading once this many keys are pending.
    max_pending_keys: usize,
    /// One per flush worker: "flush now" (`!flush`, readers paused at the memory cap).
    nudges: Vec<Notify>,
    /// One per flush worker: "`flush.max_pending_keys` are pending", which the worker heeds
    /// only while the database keeps up (src/flush.rs, `FlushWorker::run`).
    early: Vec<Notify>,
    /// Signalled after every commit, for readers paused at `max_pending_keys`.
    room: Notify,
    /// One per flush worker: when the oldest event of the flight it is writing arrived, as
    /// milliseconds after `started` plus one (0: no flight), so a stuck flush is visible.
    oldest: Vec<AtomicU64>,
    started: Instant,
}

impl Shared {
    pub fn new(workers: usize, flush_threshold: usize, max_pending_keys: usize) -> Shared {
        Shared {
            pending_keys: AtomicUsize::new(0),
            pending_events: AtomicU64::new(0),
            in_transit: AtomicUsize::new(0),
            flush_threshold,
            max_pending_keys,
            nudges: (0..workers).map(|_| Notify::new()).collect(),
            early: (0..workers).map(|_| Notify::new()).collect(),
            room: Notify::new(),
            oldest: (0..workers).map(|_| AtomicU64::new(0)).collect(),
            started: Instant::now(),
        }
    }

    /// Worker `worker` is writing a flight whose oldest event arrived at `since` (None: done).
    pub fn set_flight_oldest(&self, worker: usize, since: Option<Instant>) {
        let ms = since.map_or(0, |t| {
            t.saturating_duration_since(self.started).as_millis() as u64 + 1
        });
        self.oldest[worker].store(ms, Ordering::Relaxed);
    }

    /// Per worker, the age of the oldest event of the flight it is writing (zero when idle).
    pub fn flight_ages(&self) -> impl Iterator<Item = Duration> + '_ {
        let now = self.started.elapsed();
        self.oldest
            .iter()
            .map(move |o| match o.load(Ordering::Relaxed) {
                0 => Duration::ZERO,
                ms => now.saturating_sub(Duration::from_millis(ms - 1)),
            })
    }

    /// A connection is about to send `events` events to the buckets.
    pub fn reserve(&self, events: usize) {
        self.in_transit.fetch_add(events, Ordering::Relaxed);
    }

    /// A bucket recorded `received` of the reserved events: `keys` new keys holding `events`
    /// events (the others merged into existing keys or were overflow rejections).
    pub fn add_pending(&self, keys: usize, events: u64, received: usize) {
        self.pending_keys.fetch_add(keys, Ordering::Relaxed);
        self.pending_events.fetch_add(events, Ordering::Relaxed);
        self.in_transit.fetch_sub(received, Ordering::Relaxed);
        // Events that made no new key free room without any commit. Wake the paused readers
        // when that crosses the cap, or they could wait for a commit that never comes (nothing
        // pending to flush).
        let freed = received.saturating_sub(keys);
        let now = self.counted_keys();
        if freed > 0 && now < self.max_pending_keys && now + freed >= self.max_pending_keys {
            self.room.notify_waiters();
        }
    }

    /// Called once a flush has committed `keys` rows holding `events` events.
    pub fn remove_pending(&self, keys: usize, events: u64) {
        self.pending_keys.fetch_sub(keys, Ordering::Relaxed);
        self.pending_events.fetch_sub(events, Ordering::Relaxed);
        self.room.notify_waiters();
    }

    pub fn pending_keys(&self) -> usize {
        self.pending_keys.load(Ordering::Relaxed)
    }

    pub fn pending_events(&self) -> u64 {
        self.pending_events.load(Ordering::Relaxed)
    }

    /// Keys pending plus events on their way to the buckets: what the cap compares.
    pub fn counted_keys(&self) -> usize {
        self.pending_keys() + self.in_transit.load(Ordering::Relaxed)
    }

    /// Whether a connection may read: below `coalesce.max_pending_keys`, counting the events
    /// still on their way to the buckets.
    pub fn has_room(&self) -> bool {
        self.counted_keys() < self.max_pending_keys
    }

    pub fn over_flush_threshold(&self) -> bool {
        self.pending_keys() >= self.flush_threshold
    }

    pub fn nudge(&self, worker: usize) {
        self.nudges[worker].notify_one();
    }

    pub fn nudge_all(&self) {
        self.nudges.iter().for_each(Notify::notify_one);
    }

    pub async fn nudged(&self, worker: usize) {
        self.nudges[worker].notified().await
    }

    /// `flush.max_pending_keys` keys are pending: worker `worker` may flush early.
    pub fn nudge_early(&self, worker: usize) {
        self.early[worker].notify_one();
    }

    pub async fn nudged_early(&self, worker: usize) {
        self.early[worker].notified().await
    }

    /// Returns at once while there is room; otherwise waits until a flush frees some.
    /// Returns whether it had to wait (for the back-pressure metric).
    pub async fn wait_for_room(&self) -> bool {
        if self.has_room() {
            return false;
        }
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            // Register before re-checking, so a commit between the check and the await is not missed.
            room.as_mut().enable();
            if self.has_room() {
                return true;
            }
            self.nudge_all();
            room.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Shared;

    #[test]
    fn events_in_transit_count_against_the_cap_until_recorded() {
        let s = Shared::new(1, 10, 10);
        s.reserve(10);
        assert!(!s.has_room(), "sent but not yet recorded: still counted");
        // The bucket finds 4 new keys among the 10 events.
        s.add_pending(4, 10, 10);
        assert!(s.has_room());
        assert_eq!((s.pending_keys(), s.pending_events()), (4, 10));
        s.reserve(6);
        assert!(!s.has_room());
        s.add_pending(6, 6, 6);
        assert!(!s.has_room());
        s.remove_pending(10, 16);
        assert!(s.has_room());
    }
}
