//! Bucket actors: each owns the pending aggregates of the keys hashed to it, coalescing events
//! (sum of deltas, first and last seen, event count) until its flush worker drains it.
//!
//! The state is a plain struct ([`Pending`]) with synchronous `record` and `drain`; the actor is a
//! thin loop over its bounded channel. Connections send one [`Batch`] per bucket per read buffer,
//! never one message per event.

use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Instant;

use compact_str::CompactString;
use hashbrown::HashTable;
use tokio::sync::{mpsc, oneshot};

use crate::shared::Shared;

/// Stable hash of (counter, key): xxh3-64 of the key seeded with xxh3-64 of the counter name.
/// It decides the bucket (and, with several databases, the logical shard), so it must never change.
pub fn key_hash(counter_seed: u64, key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(key, counter_seed)
}

pub fn counter_seed(name: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(name.as_bytes())
}

/// Maps a hash onto `0..n` without the bias or the division of `%` (Lemire's multiply-shift).
pub fn reduce(hash: u64, n: usize) -> usize {
    ((hash as u128 * n as u128) >> 64) as usize
}

/// The logical shard of a key: the same stable hash, other bits than the bucket uses.
pub fn logical_shard(hash: u64, logical_shards: usize) -> usize {
    reduce(hash.rotate_left(32), logical_shards)
}

/// Where a key goes: its logical shard picks a database (`map`), and each database has its own
/// `buckets` bucket actors and `workers` flush workers. Bucket and worker numbers are global:
/// database `d` owns buckets `d * buckets ..` and workers `d * workers ..`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub buckets: usize,
    pub workers: usize,
    /// Database index of each logical shard.
    pub map: Vec<u16>,
}

impl Layout {
    /// One database: every logical shard maps to it.
    pub fn single(buckets: usize, workers: usize) -> Layout {
        Layout {
            buckets,
            workers,
            map: vec![0],
        }
    }

    pub fn databases(&self) -> usize {
        self.map.iter().copied().max().map_or(1, |d| d as usize + 1)
    }

    pub fn database(&self, hash: u64) -> usize {
        self.map[logical_shard(hash, self.map.len())] as usize
    }

    pub fn bucket(&self, hash: u64) -> usize {
        self.database(hash) * self.buckets + reduce(hash, self.buckets)
    }

    pub fn worker_of(&self, bucket: usize) -> usize {
        (bucket / self.buckets) * self.workers + (bucket % self.buckets) % self.workers
    }

    pub fn total_buckets(&self) -> usize {
        self.databases() * self.buckets
    }

    pub fn total_workers(&self) -> usize {
        self.databases() * self.workers
    }

    /// The logical shards database `db` owns.
    pub fn owned(&self, db: usize) -> Vec<i32> {
        (0..self.map.len())
            .filter(|&s| self.map[s] as usize == db)
            .map(|s| s as i32)
            .collect()
    }
}

/// The running aggregate of one (counter, key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Agg {
    pub sum: i64,
    /// Event times in Unix milliseconds.
    pub first_ms: i64,
    pub last_ms: i64,
    pub events: u64,
}

impl Agg {
    fn new(delta: i64, at_ms: i64) -> Agg {
        Agg {
            sum: delta,
            first_ms: at_ms,
            last_ms: at_ms,
            events: 1,
        }
    }

    /// Folds `other` in; `None` when the sum would leave the 64-bit range.
    pub fn merge(&self, other: &Agg) -> Option<Agg> {
        Some(Agg {
            sum: self.sum.checked_add(other.sum)?,
            first_ms: self.first_ms.min(other.first_ms),
            last_ms: self.last_ms.max(other.last_ms),
            events: self.events + other.events,
        })
    }
}

/// One pending (counter, key) with its aggregate. The hash is kept so that the table never rehashes keys.
#[derive(Debug)]
pub struct Entry {
    pub hash: u64,
    pub counter: u16,
    pub key: CompactString,
    pub agg: Agg,
}

impl Hash for Entry {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash)
    }
}

/// One event inside a [`Batch`]; its key lives in the batch's arena.
#[derive(Clone, Copy, Debug)]
struct BatchEvent {
    hash: u64,
    key_start: u32,
    key_len: u32,
    counter: u16,
    delta: i64,
    at_ms: i64,
}

/// Events for one bucket from one read buffer, keys packed into one arena: two allocations per
/// batch however many events it carries.
#[derive(Debug, Default)]
pub struct Batch {
    arena: String,
    events: Vec<BatchEvent>,
}

impl Batch {
    pub fn push(&mut self, hash: u64, counter: u16, key: &str, delta: i64, at_ms: i64) {
        let key_start = self.arena.len() as u32;
        self.arena.push_str(key);
        self.events.push(BatchEvent {
            hash,
            key_start,
            key_len: key.len() as u32,
            counter,
            delta,
            at_ms,
        });
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    fn iter(&self) -> impl Iterator<Item = (BatchEvent, &str)> + '_ {
        self.events.iter().map(|e| {
            let start = e.key_start as usize;
            (*e, &self.arena[start..start + e.key_len as usize])
        })
    }
}

/// Told to a waiting `!flush` once the bucket's share of its lines is committed: how many of that
/// connection's events this bucket rejected for overflow.
pub type FlushAck = mpsc::Sender<u64>;

/// A waiter that rides along with the next drain and is answered after its commit.
#[derive(Debug)]
pub struct Waiter {
    pub ack: FlushAck,
    pub rejected: u64,
}

/// What a drain hands to the flush worker.
#[derive(Debug, Default)]
pub struct Drained {
    pub entries: HashTable<Entry>,
    pub events: u64,
    pub waiters: Vec<Waiter>,
    /// When the oldest of these events arrived.
    pub since: Option<Instant>,
}

/// The synchronous state of one bucket.
#[derive(Debug, Default)]
pub struct Pending {
    entries: HashTable<Entry>,
    events: u64,
    waiters: Vec<Waiter>,
    since: Option<Instant>,
    /// Overflow rejections per connection id, reported with that connection's next `!flush`.
    overflows: Vec<(u64, u64)>,
}

/// Result of recording a batch.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Recorded {
    pub new_keys: usize,
    pub overflows: u64,
}

impl Pending {
    pub fn record(&mut self, conn: u64, batch: &Batch) -> Recorded {
        let mut out = Recorded::default();
        self.since.get_or_insert_with(Instant::now);
        for (e, key) in batch.iter() {
            let found = self
                .entries
                .find_mut(e.hash, |x| x.counter == e.counter && &*x.key == key);
            let incoming = Agg::new(e.delta, e.at_ms);
            match found {
                Some(entry) => match entry.agg.merge(&incoming) {
                    Some(agg) => entry.agg = agg,
                    None => {
                        out.overflows += 1;
                        continue;
                    }
                },
                None => {
                    self.entries.insert_unique(
                        e.hash,
                        Entry {
                            hash: e.hash,
                            counter: e.counter,
                            key: key.into(),
                            agg: incoming,
                        },
                        |x| x.hash,
                    );
                    out.new_keys += 1;
                }
            }
            self.events += 1;
        }
        if out.overflows > 0 {
            match self.overflows.iter_mut().find(|(c, _)| *c == conn) {
                Some((_, n)) => *n += out.overflows,
                None => self.overflows.push((conn, out.overflows)),
            }
        }
        out
    }

    /// Registers a `!flush` of connection `conn`: it is answered after the next drain commits.
    pub fn barrier(&mut self, conn: u64, ack: FlushAck) {
        let rejected = match self.overflows.iter().position(|(c, _)| *c == conn) {
            Some(i) => self.overflows.swap_remove(i).1,
            None => 0,
        };
        self.waiters.push(Waiter { ack, rejected });
    }

    pub fn drain(&mut self) -> Drained {
        Drained {
            entries: std::mem::take(&mut self.entries),
            events: std::mem::take(&mut self.events),
            waiters: std::mem::take(&mut self.waiters),
            since: self.since.take(),
        }
    }

    pub fn keys(&self) -> usize {
        self.entries.len()
    }

    /// A connection that closed will never ask for its overflow count.
    pub fn forget(&mut self, conn: u64) {
        self.overflows.retain(|(c, _)| *c != conn);
    }
}

pub enum Message {
    Events { conn: u64, batch: Batch },
    Barrier { conn: u64, ack: FlushAck },
    Drain(oneshot::Sender<Drained>),
    Closed { conn: u64 },
}

/// Cloneable handle to one bucket actor.
#[derive(Clone)]
pub struct BucketHandle {
    tx: mpsc::Sender<Message>,
}

impl BucketHandle {
    /// Spawns the actor; `worker` is the flush worker that drains it (for early-flush nudges).
    pub fn spawn(capacity: usize, worker: usize, shared: Arc<Shared>) -> BucketHandle {
        let (tx, rx) = mpsc::channel(capacity);
        let actor = Bucket {
            rx,
            state: Pending::default(),
            worker,
            shared,
        };
        tokio::spawn(actor.run());
        BucketHandle { tx }
    }

    /// Waits for room in the bucket's queue: this is where back-pressure reaches connections.
    pub async fn send(&self, msg: Message) -> bool {
        self.tx.send(msg).await.is_ok()
    }

    /// Queues a drain; the answer comes once the bucket has taken everything queued before it.
    pub async fn request_drain(&self) -> Option<oneshot::Receiver<Drained>> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Message::Drain(tx)).await.ok()?;
        Some(rx)
    }
}

struct Bucket {
    rx: mpsc::Receiver<Message>,
    state: Pending,
    worker: usize,
    shared: Arc<Shared>,
}

impl Bucket {
    /// Runs until every handle is gone. Never awaits anything but its own queue, so it cannot be
    /// part of a cycle of full channels.
    async fn run(mut self) {
        while let Some(msg) = self.rx.recv().await {
            match msg {
                Message::Events { conn, batch } => {
                    let rec = self.state.record(conn, &batch);
                    self.shared.add_pending(
                        rec.new_keys,
                        batch.len() as u64 - rec.overflows,
                        batch.len(),
                    );
                    if rec.overflows > 0 {
                        crate::metrics::rejected(crate::protocol::Reject::Overflow, rec.overflows);
                    }
                    if self.shared.over_flush_threshold() {
                        self.shared.nudge(self.worker);
                    }
                }
                Message::Barrier { conn, ack } => self.state.barrier(conn, ack),
                Message::Drain(reply) => {
                    // A flush worker that went away takes nothing: keep the state.
                    let drained = self.state.drain();
                    if let Err(back) = reply.send(drained) {
                        self.state.entries = back.entries;
                        self.state.events = back.events;
                        self.state.waiters = back.waiters;
                        self.state.since = back.since;
                    }
                }
                Message::Closed { conn } => self.state.forget(conn),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(events: &[(&str, i64, i64)]) -> Batch {
        let mut b = Batch::default();
        for (key, delta, at) in events {
            b.push(key_hash(1, key.as_bytes()), 0, key, *delta, *at);
        }
        b
    }

    fn get(d: &Drained, key: &str) -> Option<Agg> {
        let h = key_hash(1, key.as_bytes());
        d.entries.find(h, |x| &*x.key == key).map(|e| e.agg)
    }

    #[test]
    fn record_coalesces_sum_first_last() {
        let mut p = Pending::default();
        let rec = p.record(
            1,
            &batch(&[("a", 1, 50), ("a", 5, 10), ("b", -2, 7), ("a", -1, 70)]),
        );
        assert_eq!(
            rec,
            Recorded {
                new_keys: 2,
                overflows: 0
            }
        );
        let d = p.drain();
        assert_eq!(d.events, 4);
        assert_eq!(
            get(&d, "a"),
            Some(Agg {
                sum: 5,
                first_ms: 10,
                last_ms: 70,
                events: 3
            })
        );
        assert_eq!(get(&d, "b").unwrap().sum, -2);
        assert_eq!(p.keys(), 0, "drain leaves the bucket empty");
    }

    #[test]
    fn overflow_is_rejected_and_reported_to_its_connection() {
        let mut p = Pending::default();
        let rec = p.record(7, &batch(&[("a", i64::MAX, 1), ("a", 1, 2), ("a", -5, 3)]));
        assert_eq!(rec.overflows, 1);
        let (tx, _rx) = mpsc::channel(1);
        p.barrier(8, tx.clone());
        p.barrier(7, tx);
        let d = p.drain();
        assert_eq!(get(&d, "a").unwrap().sum, i64::MAX - 5);
        assert_eq!(d.waiters[0].rejected, 0);
        assert_eq!(d.waiters[1].rejected, 1);
    }

    #[test]
    fn reduce_stays_in_range_and_spreads() {
        let mut seen = [0u32; 12];
        for i in 0..12_000u64 {
            seen[reduce(key_hash(3, &i.to_le_bytes()), 12)] += 1;
        }
        assert!(seen.iter().all(|&n| (800..1200).contains(&n)), "{seen:?}");
    }
}
