//! Pending-state accounting shared by connections, buckets and flush workers: how many keys and
//! events wait in memory, and the wake-ups that keep that bounded (early flushes, paused readers).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::events;

#[derive(Debug)]
pub struct Shared {
    pending_keys: AtomicUsize,
    pending_events: AtomicU64,
    /// Events sent to the buckets but not yet recorded: each may still become a new key, so the
    /// cap counts them until the bucket knows (otherwise a connection's next check would miss
    /// its previous read, still queued, and the cap would leak by whole queues).
    in_transit: AtomicUsize,
    /// Flush early once this many keys are pending (a reload may change it).
    flush_threshold: AtomicUsize,
    /// Connections stop reading once this many keys are pending (a reload may change it).
    max_pending_keys: AtomicUsize,
    /// One per flush worker: "flush now".
    nudges: Vec<Notify>,
    /// One per flush worker: "`flush.max_pending_keys` are pending", which the worker heeds
    /// only while the database keeps up (src/flush/mod.rs, `FlushWorker::run`).
    early: Vec<Notify>,
    /// Signalled after every commit, for readers paused at `max_pending_keys`.
    room: Notify,
    /// One per flush worker: when the oldest event of the flight it is writing arrived, as
    /// milliseconds after `started` plus one (0: no flight), so a stuck flush is visible.
    oldest: Vec<AtomicU64>,
    started: Instant,
    /// Per counter (config order): keys and events pending, for the status view. Grows when a
    /// reload adds counters (the counter table only grows); locked per bucket batch, not per
    /// event.
    per_counter: RwLock<Vec<CounterPending>>,
    /// Stream connections open now, for the status view.
    connections: AtomicUsize,
}

/// One counter's share of `pending_keys` / `pending_events`.
#[derive(Debug, Default)]
struct CounterPending {
    keys: AtomicUsize,
    events: AtomicU64,
}

/// What a bucket recorded per counter since it last told [`Shared`]: (new keys, events), indexed
/// by counter. Kept by the bucket and reused, so recording allocates nothing.
#[derive(Debug, Default)]
pub struct Tally(Vec<(usize, u64)>);

impl Tally {
    pub fn add(&mut self, counter: u16, new_keys: usize, events: u64) {
        let i = counter as usize;
        if self.0.len() <= i {
            self.0.resize(i + 1, (0, 0));
        }
        self.0[i].0 += new_keys;
        self.0[i].1 += events;
    }

    /// The (counter, new keys, events) recorded, zeroing them.
    fn take(&mut self) -> impl Iterator<Item = (usize, usize, u64)> + '_ {
        self.0
            .iter_mut()
            .enumerate()
            .filter(|(_, t)| **t != (0, 0))
            .map(|(i, t)| {
                let (keys, events) = std::mem::take(t);
                (i, keys, events)
            })
    }
}

impl Shared {
    pub fn new(
        workers: usize,
        counters: usize,
        flush_threshold: usize,
        max_pending_keys: usize,
    ) -> Shared {
        Shared {
            pending_keys: AtomicUsize::new(0),
            pending_events: AtomicU64::new(0),
            in_transit: AtomicUsize::new(0),
            flush_threshold: AtomicUsize::new(flush_threshold),
            max_pending_keys: AtomicUsize::new(max_pending_keys),
            nudges: (0..workers).map(|_| Notify::new()).collect(),
            early: (0..workers).map(|_| Notify::new()).collect(),
            room: Notify::new(),
            oldest: (0..workers).map(|_| AtomicU64::new(0)).collect(),
            started: Instant::now(),
            per_counter: RwLock::new((0..counters).map(|_| CounterPending::default()).collect()),
            connections: AtomicUsize::new(0),
        }
    }

    /// A bucket's per-counter share of what it just passed to [`Shared::add_pending`].
    pub fn add_counter_pending(&self, tally: &mut Tally) {
        let needed = tally.0.len();
        if self.read_per_counter().len() < needed {
            let mut all = self.per_counter.write().unwrap_or_else(|e| e.into_inner());
            if all.len() < needed {
                all.resize_with(needed, CounterPending::default);
            }
        }
        let all = self.read_per_counter();
        for (i, keys, events) in tally.take() {
            all[i].keys.fetch_add(keys, Ordering::Relaxed);
            all[i].events.fetch_add(events, Ordering::Relaxed);
        }
    }

    /// A commit's per-counter share of what it passes to [`Shared::remove_pending`].
    pub fn remove_counter_pending(&self, counter: usize, keys: usize, events: u64) {
        if let Some(c) = self.read_per_counter().get(counter) {
            c.keys.fetch_sub(keys, Ordering::Relaxed);
            c.events.fetch_sub(events, Ordering::Relaxed);
        }
    }

    /// (keys, events) pending for counter `counter` (config order).
    pub fn counter_pending(&self, counter: usize) -> (usize, u64) {
        self.read_per_counter().get(counter).map_or((0, 0), |c| {
            (
                c.keys.load(Ordering::Relaxed),
                c.events.load(Ordering::Relaxed),
            )
        })
    }

    fn read_per_counter(&self) -> std::sync::RwLockReadGuard<'_, Vec<CounterPending>> {
        self.per_counter.read().unwrap_or_else(|e| e.into_inner())
    }

    pub fn connection_opened(&self) {
        self.connections.fetch_add(1, Ordering::Relaxed);
    }

    pub fn connection_closed(&self) {
        self.connections.fetch_sub(1, Ordering::Relaxed);
    }

    pub fn connections_open(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    /// `coalesce.max_pending_keys`: the cap [`Shared::counted_keys`] is compared with.
    pub fn max_pending_keys(&self) -> usize {
        self.max_pending_keys.load(Ordering::Relaxed)
    }

    /// A reload's new `flush.max_pending_keys` and `coalesce.max_pending_keys`. Paused readers
    /// look again (a higher cap lets them go on at once); a lower one takes effect at their
    /// next check, and an early flush brings the pending keys under it.
    pub fn set_limits(&self, flush_threshold: usize, max_pending_keys: usize) {
        self.flush_threshold
            .store(flush_threshold, Ordering::Relaxed);
        self.max_pending_keys
            .store(max_pending_keys, Ordering::Relaxed);
        self.room.notify_waiters();
        if self.over_flush_threshold() {
            self.nudge_all();
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
        let max = self.max_pending_keys.load(Ordering::Relaxed);
        if freed > 0 && now < max && now + freed >= max {
            self.room.notify_waiters();
        }
    }

    /// Reserved events that were not sent after all (their record was spilled to the journal).
    pub fn unreserve(&self, events: usize) {
        self.add_pending(0, 0, events);
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
        self.counted_keys() < self.max_pending_keys.load(Ordering::Relaxed)
    }

    pub fn over_flush_threshold(&self) -> bool {
        self.pending_keys() >= self.flush_threshold.load(Ordering::Relaxed)
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

/// Sets the pending gauges and the flight ages from `shared` every `every` until `stop`. The
/// flush workers set the pending gauges only after a commit, so without this they freeze during
/// a database outage, exactly when they grow. Must run inside a tokio runtime.
pub(crate) fn spawn_gauges(
    shared: Arc<Shared>,
    every: Duration,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {
                    events::Pending { keys: shared.pending_keys(), events: shared.pending_events() }.emit();
                    for (worker, age) in shared.flight_ages().enumerate() {
                        events::FlightAge { worker, age }.emit();
                    }
                }
                _ = stop.cancelled() => return,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::Shared;

    #[test]
    fn events_in_transit_count_against_the_cap_until_recorded() {
        let s = Shared::new(1, 1, 10, 10);
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

    #[test]
    fn per_counter_pending_follows_tallies_and_commits() {
        let s = Shared::new(1, 2, 10, 10);
        let mut tally = super::Tally::default();
        tally.add(1, 2, 5);
        tally.add(1, 0, 1);
        tally.add(0, 1, 1);
        s.add_counter_pending(&mut tally);
        assert_eq!(
            (s.counter_pending(0), s.counter_pending(1)),
            ((1, 1), (2, 6))
        );
        s.add_counter_pending(&mut tally);
        assert_eq!(s.counter_pending(1), (2, 6), "a tally is zeroed once told");
        s.remove_counter_pending(1, 2, 6);
        assert_eq!(s.counter_pending(1), (0, 0));
        // A counter a reload added (index past the table at start) is counted too.
        tally.add(3, 1, 4);
        s.add_counter_pending(&mut tally);
        assert_eq!(s.counter_pending(3), (1, 4));
    }

    /// A reload raising the cap lets a reader paused at the old one go on, without a commit.
    #[tokio::test]
    async fn a_raised_cap_wakes_paused_readers() {
        let s = std::sync::Arc::new(Shared::new(1, 1, 10, 10));
        s.reserve(10);
        assert!(!s.has_room());
        let waiting = tokio::spawn({
            let s = s.clone();
            async move { s.wait_for_room().await }
        });
        tokio::task::yield_now().await;
        s.set_limits(10, 20);
        assert!(waiting.await.unwrap(), "it had waited, and was woken");
        s.set_limits(5, 5);
        assert!(!s.has_room(), "a lowered cap holds at the next check");
    }
}
