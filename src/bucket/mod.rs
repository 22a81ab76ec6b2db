//! Bucket actors: each owns the pending aggregates of the keys hashed to it, coalescing events
//! until its flush worker drains it. A pending (counter, key, window) keeps an [`Agg`] (the sum
//! of deltas, or for every other kind the number of events; first and last seen; the events)
//! and, for every kind but a sum, its [`Value`] (a max, min or last value or a sketch), folded
//! by the kind's rule ([`crate::kind`]). Corrections (`!set`, `!forget`) reach the bucket in
//! the same batches, in order with the events, and supersede what it holds ([`correct`]).
//!
//! The state is a plain struct ([`Pending`]) with synchronous `record` and `drain`; the actor is a
//! thin loop over its bounded channel, reached only through [`BucketHandle`]'s methods (`events`,
//! `barrier`, `closed`, `drain`). Connections send one [`Batch`] per bucket per read buffer,
//! never one message per event. Which bucket a key goes to is decided in [`crate::routing`].

mod correct;

use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Instant;

use compact_str::CompactString;
use hashbrown::HashTable;
use tokio::sync::{mpsc, oneshot};

pub use correct::{Correct, SetNote};

use crate::kind::{Op, Value};
use crate::shared::{Shared, Tally};
use crate::window::{SpanCode, ALL_SPAN, ALL_TIME};

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
    /// Nothing yet: the identity of [`Agg::merge`]. A key a correction emptied holds it until
    /// an event comes, and is not written while it does.
    pub const EMPTY: Agg = Agg {
        sum: 0,
        first_ms: i64::MAX,
        last_ms: i64::MIN,
        events: 0,
    };

    pub fn is_empty(&self) -> bool {
        self.first_ms > self.last_ms
    }

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

/// One pending (counter, key, window) with its aggregate. The hash (of counter and key: every
/// window of a key is in the same bucket, so they commit together) is kept so that the table
/// never rehashes keys.
#[derive(Debug)]
pub struct Entry {
    pub hash: u64,
    pub counter: u16,
    /// The window's span ([`crate::window::ALL_SPAN`]: an all-time row) and start in Unix ms
    /// ([`crate::window::ALL_TIME`] for an all-time row).
    pub span: SpanCode,
    pub win: i64,
    pub key: CompactString,
    pub agg: Agg,
    /// Its value or sketch, for every kind but a sum.
    pub value: Value,
    /// A correction the next flush applies before writing the entry.
    pub reset: Correct,
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
    span: SpanCode,
    /// A row of one of the counter's `also` windows (a coarser window, the all-time row),
    /// written beside the event's own: it is not counted as an event again.
    also: bool,
    op: Op,
    correct: Correct,
    win: i64,
    /// A sum's delta, a max, min or last value, or a unique value's hash.
    delta: i64,
    at_ms: i64,
}

/// Events for one bucket from one read buffer, keys packed into one arena: two allocations per
/// batch however many events it carries.
#[derive(Debug, Default)]
pub struct Batch {
    arena: String,
    events: Vec<BatchEvent>,
    /// Each correction's number on its connection, in order (kept beside the events, so an
    /// event carries no field of its own for it).
    serials: Vec<u64>,
}

/// Where an event goes in a bucket: its counter and key (by hash), and a window.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    pub hash: u64,
    pub counter: u16,
    pub span: SpanCode,
    pub win: i64,
    /// How its value folds in.
    pub op: Op,
}

impl Batch {
    /// An all-time counter's event.
    pub fn push(&mut self, hash: u64, counter: u16, key: &str, delta: i64, at_ms: i64) {
        let to = Target {
            hash,
            counter,
            span: ALL_SPAN,
            win: ALL_TIME,
            op: Op::Sum,
        };
        self.push_to(to, key, delta, at_ms, false);
    }

    /// An event for `to`'s window; `also`: a row of an `also` window (or the all-time row),
    /// written beside the event's own window (its key is already in the arena, as the last one
    /// pushed).
    pub fn push_to(&mut self, to: Target, key: &str, delta: i64, at_ms: i64, also: bool) {
        let (key_start, key_len) = match (also, self.events.last()) {
            (true, Some(last)) => (last.key_start, last.key_len),
            _ => {
                let start = self.arena.len() as u32;
                self.arena.push_str(key);
                (start, key.len() as u32)
            }
        };
        self.events.push(BatchEvent {
            hash: to.hash,
            key_start,
            key_len,
            counter: to.counter,
            span: to.span,
            also,
            op: to.op,
            correct: Correct::None,
            win: to.win,
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

    /// Empties the batch, keeping its allocations.
    pub fn clear(&mut self) {
        self.arena.clear();
        self.events.clear();
        self.serials.clear();
    }

    /// Whether the event at `i` and the `also` rows behind it all fit in `taken`'s pending
    /// sums: a sum outside the signed 64-bit range refuses the whole event (reason `overflow`),
    /// so that none of its rows counts it.
    fn fits(&self, i: usize, taken: &Drained) -> bool {
        let mut rows = std::iter::once(&self.events[i])
            .chain(self.events[i + 1..].iter().take_while(|e| e.also));
        rows.all(|e| {
            // As `record` counts it: every kind but a sum counts its events in `sum`.
            let counted = if e.op == Op::Sum { e.delta } else { 1 };
            let start = e.key_start as usize;
            let key = &self.arena[start..start + e.key_len as usize];
            taken
                .entries
                .find(e.hash, |x| {
                    x.counter == e.counter && x.win == e.win && x.span == e.span && &*x.key == key
                })
                .is_none_or(|x| x.agg.sum.checked_add(counted).is_some())
        })
    }

    fn iter(&self) -> impl Iterator<Item = (BatchEvent, &str)> + '_ {
        self.events.iter().map(|e| {
            let start = e.key_start as usize;
            (*e, &self.arena[start..start + e.key_len as usize])
        })
    }
}

/// Told to a waiting `!flush` (or correction) once the bucket's share of its lines is
/// committed.
pub type FlushAck = mpsc::Sender<Acked>;

/// A bucket's answer to a waiting `!flush` or correction of one connection.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Acked {
    /// That connection's events this bucket rejected for overflow.
    pub overflows: u64,
    /// That connection's corrections the flush refused (a set that would move a row beside
    /// its window beyond the 64-bit range), by their number on the connection: each is
    /// answered `error overflow` instead of `ok`.
    pub refused: Vec<u64>,
}

/// A waiter that rides along with the next drain and is answered after its commit.
#[derive(Debug)]
pub struct Waiter {
    pub ack: FlushAck,
    /// The connection that waits.
    pub conn: u64,
    pub rejected: u64,
    /// Its corrections the flush refused (see [`Acked::refused`]).
    pub refused: Vec<u64>,
}

impl Waiter {
    /// Answers the waiter: what it waited for is committed.
    pub fn answer(self) {
        let acked = Acked {
            overflows: self.rejected,
            refused: self.refused,
        };
        // Fails only when the waiting connection has gone: no one is left to tell.
        let _ = self.ack.try_send(acked);
    }
}

/// What a drain hands to the flush worker.
#[derive(Debug, Default)]
pub struct Drained {
    pub entries: HashTable<Entry>,
    pub events: u64,
    pub waiters: Vec<Waiter>,
    /// When the oldest of these events arrived.
    pub since: Option<Instant>,
    /// The sets among these entries' corrections: what the flush needs to move a windowed
    /// counter's coarser rows with its window (src/flush/rows.rs, `Corrections`).
    pub sets: Vec<SetNote>,
    /// The bucket drained (set by [`DrainReply::recv`]).
    pub bucket: usize,
    /// The connections that sent unique events among these entries: while the flush holds a
    /// unique counter's rows back (the hll extension gone), their `!flush` waits with them.
    pub unique_conns: Vec<u64>,
}

/// The synchronous state of one bucket.
#[derive(Debug, Default)]
pub struct Pending {
    /// What the next drain takes.
    taken: Drained,
    /// Overflow rejections per connection id, reported with that connection's next `!flush`.
    overflows: Vec<(u64, u64)>,
    /// Refused corrections (connection id, its number there), told to that connection's
    /// next wait.
    refusals: Vec<(u64, u64)>,
    /// New keys and events per counter since the actor last told [`Shared`].
    tally: Tally,
}

/// One of the hottest pending keys, for the status view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotKey {
    pub counter: u16,
    pub key: CompactString,
    pub events: u64,
    pub sum: i64,
}

/// A bucket's answer to a status request: when its oldest pending event arrived, and its
/// hottest pending keys per counter.
#[derive(Debug, Default)]
pub struct Peek {
    pub since: Option<Instant>,
    /// Up to `top` keys per counter, most events first.
    pub hottest: Vec<HotKey>,
    /// False when the bucket held more keys than it was allowed to look at.
    pub complete: bool,
}
/// Result of recording a batch.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Recorded {
    pub new_keys: usize,
    pub overflows: u64,
    /// Events recorded: rows written beside an event's own (its `also` windows, its all-time
    /// row) are not events, and overflow rejections are not recorded.
    pub events: u64,
}

impl Pending {
    pub fn record(&mut self, conn: u64, batch: &Batch) -> Recorded {
        let mut out = Recorded::default();
        let taken = &mut self.taken;
        taken.since.get_or_insert_with(Instant::now);
        // Whether the event whose rows these are (its window, then its `also` rows) is refused:
        // an event is counted in all its rows or in none.
        let mut refused = false;
        let mut serials = batch.serials.iter().copied();
        for (i, (e, key)) in batch.iter().enumerate() {
            if !e.also {
                refused = e.correct == Correct::None && !batch.fits(i, taken);
                if refused {
                    out.overflows += 1;
                }
            }
            if refused {
                continue;
            }
            if e.correct != Correct::None {
                let serial = serials.next().unwrap_or(0);
                let new_key = usize::from(correct::correct(taken, (conn, serial), &e, key));
                out.new_keys += new_key;
                // Its entry is flushed, and released per counter, as any other.
                self.tally.add(e.counter, new_key, 0);
                continue;
            }
            let found = taken.entries.find_mut(e.hash, |x| {
                x.counter == e.counter && x.win == e.win && x.span == e.span && &*x.key == key
            });
            // An `also` row counts its sum, not the event again.
            let event = u64::from(!e.also);
            // Every kind but a sum counts its events in `sum`.
            let counted = if e.op == Op::Sum { e.delta } else { 1 };
            let incoming = Agg {
                events: event,
                ..Agg::new(counted, e.at_ms)
            };
            let new_key = found.is_none();
            match found {
                Some(entry) => {
                    let agg = entry.agg.merge(&incoming).expect("checked by `fits`");
                    entry.value.add(e.delta, e.at_ms, entry.agg.last_ms);
                    entry.agg = agg;
                }
                None => {
                    taken.entries.insert_unique(
                        e.hash,
                        Entry {
                            hash: e.hash,
                            counter: e.counter,
                            span: e.span,
                            win: e.win,
                            key: key.into(),
                            agg: incoming,
                            value: Value::new(e.op, e.delta),
                            reset: Correct::None,
                        },
                        |x| x.hash,
                    );
                    out.new_keys += 1;
                }
            }
            taken.events += event;
            out.events += event;
            self.tally.add(e.counter, usize::from(new_key), event);
            if matches!(e.op, Op::Unique(_)) && !taken.unique_conns.contains(&conn) {
                taken.unique_conns.push(conn);
            }
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
        let mut refused = Vec::new();
        self.refusals.retain(|&(c, serial)| {
            if c == conn {
                refused.push(serial);
            }
            c != conn
        });
        self.taken.waiters.push(Waiter {
            ack,
            conn,
            rejected,
            refused,
        });
    }

    /// A correction of connection `conn` was refused by a flush whose drain did not hold the
    /// correction's wait: the wait is answered with it, whether it is pending here already or
    /// comes next (a connection waits for one correction at a time, in order).
    pub fn refused(&mut self, conn: u64, serial: u64) {
        match self.taken.waiters.iter_mut().find(|w| w.conn == conn) {
            Some(w) => w.refused.push(serial),
            None => self.refusals.push((conn, serial)),
        }
    }

    pub fn drain(&mut self) -> Drained {
        std::mem::take(&mut self.taken)
    }

    /// Takes back a drain nobody received, as if it had not happened. Nothing may have been
    /// recorded since that drain (the actor does both without awaiting in between).
    fn undrain(&mut self, back: Drained) {
        debug_assert!(self.taken.entries.is_empty() && self.taken.waiters.is_empty());
        self.taken = back;
    }

    pub fn keys(&self) -> usize {
        self.taken.entries.len()
    }

    /// The per-counter share of what was recorded since the last call, for [`Shared`].
    pub fn tally(&mut self) -> &mut Tally {
        &mut self.tally
    }

    /// The `top` keys with the most pending events, per counter, looking at no more than
    /// `limit` keys (so a status request costs a bounded time however many keys are pending).
    pub fn peek(&self, top: usize, limit: usize) -> Peek {
        let entries = &self.taken.entries;
        // Per counter, the best `top` so far; when full, a newcomer replaces the coldest.
        let mut best: Vec<Vec<&Entry>> = Vec::new();
        for e in entries.iter().take(if top == 0 { 0 } else { limit }) {
            let c = e.counter as usize;
            if best.len() <= c {
                best.resize_with(c + 1, Vec::new);
            }
            let list = &mut best[c];
            if list.len() < top {
                list.push(e);
            } else if let Some(coldest) = list.iter_mut().min_by_key(|x| x.agg.events) {
                if e.agg.events > coldest.agg.events {
                    *coldest = e;
                }
            }
        }
        let hottest = best
            .into_iter()
            .flat_map(|mut list| {
                list.sort_by_key(|k| std::cmp::Reverse(k.agg.events));
                list
            })
            .map(|e| HotKey {
                counter: e.counter,
                key: e.key.clone(),
                events: e.agg.events,
                sum: e.agg.sum,
            })
            .collect();
        Peek {
            since: self.taken.since,
            hottest,
            complete: top == 0 || entries.len() <= limit,
        }
    }

    /// A connection that closed will never ask for its overflow count.
    pub fn forget(&mut self, conn: u64) {
        self.overflows.retain(|(c, _)| *c != conn);
        self.refusals.retain(|(c, _)| *c != conn);
    }
}

/// What a handle asks of its actor; only the handle's methods build these.
enum Message {
    Events {
        conn: u64,
        batch: Batch,
    },
    Barrier {
        conn: u64,
        ack: FlushAck,
    },
    Drain(oneshot::Sender<Drained>),
    Closed {
        conn: u64,
    },
    Refused {
        conn: u64,
        serial: u64,
    },
    Peek {
        top: usize,
        limit: usize,
        reply: oneshot::Sender<Peek>,
    },
}

/// A bucket actor has stopped: only a panic in it ends it while handles exist, so whatever was
/// sent to it is not recorded.
#[derive(Debug, thiserror::Error)]
#[error("bucket {bucket} has stopped (its actor panicked)")]
pub struct BucketGone {
    pub bucket: usize,
}

/// Cloneable handle to one bucket actor. Every method waits for room in the bucket's queue:
/// this is where back-pressure reaches connections (and flush workers' drains).
#[derive(Clone)]
pub struct BucketHandle {
    tx: mpsc::Sender<Message>,
    index: usize,
}

impl BucketHandle {
    /// Spawns actor `index`; `worker` is the flush worker that drains it (for early-flush nudges).
    pub fn spawn(
        index: usize,
        capacity: usize,
        worker: usize,
        shared: Arc<Shared>,
    ) -> BucketHandle {
        let (tx, rx) = mpsc::channel(capacity);
        let actor = Bucket {
            rx,
            state: Pending::default(),
            worker,
            shared,
        };
        tokio::spawn(actor.run());
        BucketHandle { tx, index }
    }

    /// Records connection `conn`'s events (reserved in [`Shared::reserve`] beforehand).
    pub async fn events(&self, conn: u64, batch: Batch) -> Result<(), BucketGone> {
        self.send(Message::Events { conn, batch }).await
    }

    /// A `!flush` of connection `conn`: `ack` hears, after the next drain commits, how many of
    /// that connection's events this bucket rejected for overflow.
    pub async fn barrier(&self, conn: u64, ack: FlushAck) -> Result<(), BucketGone> {
        self.send(Message::Barrier { conn, ack }).await
    }

    /// A flush refused a correction of connection `conn` (see [`Pending::refused`]).
    pub async fn refused(&self, conn: u64, serial: u64) -> Result<(), BucketGone> {
        self.send(Message::Refused { conn, serial }).await
    }

    /// This bucket's number (as [`Drained::bucket`] names it).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Connection `conn` closed: its overflow count will never be asked for.
    pub async fn closed(&self, conn: u64) -> Result<(), BucketGone> {
        self.send(Message::Closed { conn }).await
    }

    /// Queues a drain; the [`DrainReply`] resolves once the bucket has taken everything queued
    /// before it.
    pub async fn drain(&self) -> Result<DrainReply, BucketGone> {
        let (tx, rx) = oneshot::channel();
        self.send(Message::Drain(tx)).await?;
        Ok(DrainReply {
            rx,
            bucket: self.index,
        })
    }

    /// Asks for a [`Peek`] (see [`Pending::peek`]) without waiting: None when the bucket's queue
    /// is full or it has stopped, so that a status request never holds up ingest.
    pub fn try_peek(&self, top: usize, limit: usize) -> Option<oneshot::Receiver<Peek>> {
        let (reply, rx) = oneshot::channel();
        self.tx.try_send(Message::Peek { top, limit, reply }).ok()?;
        Some(rx)
    }

    async fn send(&self, msg: Message) -> Result<(), BucketGone> {
        let gone = BucketGone { bucket: self.index };
        self.tx.send(msg).await.map_err(|_| gone)
    }
}

/// A queued drain's answer.
#[must_use = "a drain's events are lost unless the reply is received"]
pub struct DrainReply {
    rx: oneshot::Receiver<Drained>,
    bucket: usize,
}

impl DrainReply {
    pub async fn recv(self) -> Result<Drained, BucketGone> {
        let bucket = self.bucket;
        let mut drained = self.rx.await.map_err(|_| BucketGone { bucket })?;
        drained.bucket = bucket;
        Ok(drained)
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
                Message::Events { conn, batch } => self.record(conn, &batch),
                Message::Barrier { conn, ack } => self.state.barrier(conn, ack),
                Message::Drain(reply) => {
                    // A flush worker that went away takes nothing: keep the state.
                    if let Err(back) = reply.send(self.state.drain()) {
                        self.state.undrain(back);
                    }
                }
                Message::Closed { conn } => self.state.forget(conn),
                Message::Refused { conn, serial } => self.state.refused(conn, serial),
                Message::Peek { top, limit, reply } => {
                    let _ = reply.send(self.state.peek(top, limit));
                }
            }
        }
    }

    fn record(&mut self, conn: u64, batch: &Batch) {
        let rec = self.state.record(conn, batch);
        // `received` in rows (what the connection reserved), the events as recorded.
        let received = batch.len();
        self.shared.add_pending(rec.new_keys, rec.events, received);
        self.shared.add_counter_pending(self.state.tally());
        if rec.overflows > 0 {
            crate::events::OverflowRejected {
                events: rec.overflows,
            }
            .emit();
        }
        if self.shared.over_flush_threshold() {
            self.shared.nudge_early(self.worker);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::routing::key_hash;

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
                overflows: 0,
                events: 4,
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
    fn an_entry_stays_small_for_sums() {
        // What a pending key costs (docs/design.md, "Memory"): a sum's value is no allocation.
        assert_eq!(std::mem::size_of::<Entry>(), 88);
    }

    fn to(key: &str, op: Op) -> Target {
        Target {
            hash: key_hash(1, key.as_bytes()),
            counter: 0,
            span: ALL_SPAN,
            win: ALL_TIME,
            op,
        }
    }

    #[test]
    fn kinds_fold_by_their_rule_and_last_follows_event_time() {
        let mut p = Pending::default();
        let mut b = Batch::default();
        for (op, key) in [(Op::Max, "max"), (Op::Min, "min"), (Op::Last, "last")] {
            for (v, at) in [(5, 10), (-3, 30), (9, 20), (7, 30)] {
                b.push_to(to(key, op), key, v, at, false);
            }
        }
        p.record(1, &b);
        let d = p.drain();
        let value = |key: &str| {
            let h = key_hash(1, key.as_bytes());
            let e = d.entries.find(h, |x| &*x.key == key).unwrap();
            (e.value.number(), e.agg.sum)
        };
        assert_eq!(
            value("max"),
            (Some(9), 4),
            "the count of a max key is its events"
        );
        assert_eq!(value("min"), (Some(-3), 4));
        assert_eq!(
            value("last"),
            (Some(7), 4),
            "latest time, then the larger value"
        );
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
    fn an_event_is_counted_in_all_its_rows_or_in_none() {
        // A windowed sum with an all-time row: day 1 takes MAX - 7, then day 2's 20 fits its
        // own (new) window but not the all-time row, so it is refused in both.
        let mut p = Pending::default();
        let h = key_hash(1, b"k");
        let day = |win| Target {
            hash: h,
            counter: 0,
            span: 3,
            win,
            op: Op::Sum,
        };
        let all = Target {
            span: ALL_SPAN,
            win: ALL_TIME,
            ..day(0)
        };
        let mut b = Batch::default();
        for (win, delta) in [(0, i64::MAX - 7), (86_400_000, 20), (86_400_000, 7)] {
            b.push_to(day(win), "k", delta, win, false);
            b.push_to(all, "k", delta, win, true);
        }
        let rec = p.record(1, &b);
        assert_eq!((rec.overflows, rec.events), (1, 2));
        let d = p.drain();
        let sum = |span, win| {
            d.entries
                .find(h, |x| (x.span, x.win) == (span, win))
                .map(|e| e.agg.sum)
        };
        assert_eq!(sum(3, 86_400_000), Some(7), "the refused 20 is in no row");
        assert_eq!(sum(ALL_SPAN, ALL_TIME), Some(i64::MAX));
    }

    #[test]
    fn peek_names_the_hottest_keys_per_counter_within_its_limit() {
        let mut p = Pending::default();
        let mut b = batch(&[("a", 1, 1), ("b", 1, 1), ("b", 2, 2), ("c", 1, 1)]);
        b.push(key_hash(1, b"z"), 1, "z", 7, 1);
        p.record(1, &b);
        p.record(1, &batch(&[("c", 1, 3), ("c", 1, 4)]));
        let peek = p.peek(2, 100);
        assert!(peek.complete && peek.since.is_some());
        let hot: Vec<(u16, &str, u64, i64)> = peek
            .hottest
            .iter()
            .map(|h| (h.counter, h.key.as_str(), h.events, h.sum))
            .collect();
        assert_eq!(hot, vec![(0, "c", 3, 3), (0, "b", 2, 3), (1, "z", 1, 7)]);
        assert!(!p.peek(2, 3).complete, "4 keys, allowed to look at 3");
        assert!(p.peek(0, 0).hottest.is_empty());
        let mut tally = std::mem::take(p.tally());
        let shared = Shared::new(1, 2, 100, 100);
        shared.add_counter_pending(&mut tally);
        assert_eq!(shared.counter_pending(0), (3, 6));
        assert_eq!(shared.counter_pending(1), (1, 1));
    }
}
