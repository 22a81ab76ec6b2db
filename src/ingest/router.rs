//! One connection's (or datagram socket's) routing state: parsed events batched per bucket and
//! journaled per read, `!flush` barriers, and the close that lets the buckets forget it.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::mpsc;
use tracing::{debug, error};

use super::{reject, Ingest, Schema};
use crate::bucket::Batch;
use crate::journal::{self, Journal, Recorded};
use crate::protocol::{self, Control, Line, Reject};
use crate::routing;

/// What became of one line.
pub(crate) enum Outcome {
    /// An event routed to its bucket's batch, or an empty line.
    Taken,
    Control(Control),
    Rejected(Reject),
}

/// Per-connection routing state: one batch per bucket, filled while a read buffer is parsed and
/// sent when it is done.
pub(crate) struct Router {
    conn: u64,
    /// The schema this connection parses against (see [`Schema`]) and its generation.
    pub(crate) schema: Arc<Schema>,
    generation: u64,
    batches: Vec<Batch>,
    touched: Vec<u32>,
    /// Buckets this connection ever sent to, so `!flush` waits only on those.
    ever: Vec<u64>,
    accepted_by_counter: Vec<u64>,
    pub(crate) accepted: u64,
    pub(crate) rejected: u64,
    pub(crate) now_ms: i64,
    /// Whether accepted events are written to the journal (not when replaying it, nor when
    /// folding spilled records).
    pub(crate) journaling: bool,
    /// This read's accepted events as canonical lines, for the journal.
    journal_lines: Vec<u8>,
    /// The last record of this connection's that was spilled (0: none): `!flush` waits until
    /// the folder has routed it and a flush committed it.
    spilled_upto: u64,
    /// See [`Router::for_journal`].
    reviving: bool,
}

impl Router {
    /// A router for lines read back from the journal: not journaled again, and counters a
    /// reload removed since they were accepted are still found.
    pub(crate) fn for_journal(ingest: &Ingest) -> Router {
        let mut router = Router::new(ingest, ingest.conn_id());
        router.journaling = false;
        router.reviving = true;
        router.schema = Arc::new(router.schema.reviving());
        router
    }

    pub(crate) fn new(ingest: &Ingest, conn: u64) -> Router {
        let n = ingest.buckets.len();
        let generation = ingest.generation.load(Ordering::Acquire);
        let schema = ingest.schema();
        Router {
            conn,
            batches: (0..n).map(|_| Batch::default()).collect(),
            touched: Vec::new(),
            ever: vec![0; n.div_ceil(64)],
            accepted_by_counter: vec![0; schema.seeds.len()],
            schema,
            generation,
            accepted: 0,
            rejected: 0,
            now_ms: 0,
            journaling: ingest.journal.is_some(),
            journal_lines: Vec::new(),
            spilled_upto: 0,
            reviving: false,
        }
    }

    /// Parses one line; events go to their bucket's batch, control lines and rejections are
    /// returned for the connection to answer.
    pub(crate) fn line(&mut self, ingest: &Ingest, line: Result<&[u8], Reject>) -> Outcome {
        self.refresh(ingest);
        let parsed = match line {
            Ok(l) => protocol::parse_line(l, &self.schema.counters, &self.schema.limits)
                .inspect_err(|&reason| reject(reason, l)),
            // The framer's rejections: the line itself is gone.
            Err(reason) => {
                reject(reason, b"");
                Err(reason)
            }
        };
        match parsed {
            Ok(Line::Event(ev)) => {
                self.event(ingest, ev);
                Outcome::Taken
            }
            Ok(Line::Control(c)) => Outcome::Control(c),
            Ok(Line::Empty) => Outcome::Taken,
            Err(reason) => {
                self.rejected += 1;
                Outcome::Rejected(reason)
            }
        }
    }

    /// Routes one parsed event to its bucket's batch (and the journal's lines), whichever
    /// protocol it came in (native or statsd).
    pub(crate) fn event(&mut self, ingest: &Ingest, ev: protocol::Event<'_>) {
        let key = ev.key.as_str();
        let hash = routing::key_hash(self.schema.seeds[ev.counter as usize], key.as_bytes());
        let b = ingest.layout.bucket(hash);
        let batch = &mut self.batches[b];
        if batch.is_empty() {
            self.touched.push(b as u32);
            self.ever[b / 64] |= 1 << (b % 64);
        }
        let at_ms = ev.at_ms.unwrap_or(self.now_ms);
        batch.push(hash, ev.counter, key, ev.delta, at_ms);
        if self.journaling {
            let name = self.schema.counters.name(ev.counter);
            journal::push_line(&mut self.journal_lines, name, key, ev.delta, at_ms);
        }
        self.accepted_by_counter[ev.counter as usize] += 1;
        self.accepted += 1;
    }

    /// Sends every non-empty batch to its bucket. Waits when a bucket's queue is full: that is
    /// the back-pressure that stops this connection from reading.
    pub(crate) async fn send(&mut self, ingest: &Ingest) {
        self.reserve(ingest);
        match &ingest.journal {
            Some(journal) => self.send_journaled(ingest, journal).await,
            None => self.send_batches(ingest).await,
        }
    }

    /// Counts this read's events against the memory cap before anything awaits, so that the
    /// connection's next check sees them even while they wait in a bucket's queue.
    pub(crate) fn reserve(&self, ingest: &Ingest) {
        let events: usize = self
            .touched
            .iter()
            .map(|&b| self.batches[b as usize].len())
            .sum();
        ingest.shared.reserve(events);
    }

    /// Journals this read as one record, then sends its batches, both under the journal's gate
    /// (see [`Journal::record`]), so a flush drain sees all of a record's batches or none. At
    /// the memory cap the record is spilled instead: journaled only, its batches dropped, to be
    /// routed by the folder ([`super::fold`]).
    async fn send_journaled(&mut self, ingest: &Ingest, journal: &Journal) {
        if self.touched.is_empty() {
            return self.send_batches(ingest).await;
        }
        // The record goes to the writer thread; the next read likely needs as much room.
        let room = self.journal_lines.len();
        let lines = std::mem::replace(&mut self.journal_lines, Vec::with_capacity(room));
        let spill = !ingest.shared.has_room();
        if let Recorded::Spilled(seq) = journal
            .record(lines, spill, self.send_batches(ingest))
            .await
        {
            self.spilled_upto = seq;
            self.count_accepted();
            let mut events = 0;
            for b in self.touched.drain(..) {
                events += self.batches[b as usize].len();
                self.batches[b as usize].clear();
            }
            ingest.shared.unreserve(events);
            crate::events::RecordSpilled { events }.emit();
        }
    }

    fn count_accepted(&mut self) {
        for (i, n) in self.accepted_by_counter.iter_mut().enumerate() {
            if *n > 0 {
                self.schema.accepted[i].increment(std::mem::take(n));
            }
        }
    }

    pub(crate) async fn send_batches(&mut self, ingest: &Ingest) {
        self.count_accepted();
        for b in self.touched.drain(..) {
            let batch = std::mem::take(&mut self.batches[b as usize]);
            let events = batch.len();
            if let Err(err) = ingest.buckets[b as usize].events(self.conn, batch).await {
                // Only a panic stops a bucket; its events are gone. Give back their reservation
                // so the memory cap does not stay held by them.
                ingest.shared.add_pending(0, 0, events);
                error!(cause = %err, events, "events not recorded");
            }
        }
    }

    /// Takes the current schema when a reload replaced it. Safe between any two lines: indexes
    /// only grow, so what is batched already keeps its meaning.
    pub(crate) fn refresh(&mut self, ingest: &Ingest) {
        let generation = ingest.generation.load(Ordering::Acquire);
        if generation != self.generation {
            self.generation = generation;
            self.schema = ingest.schema();
            if self.reviving {
                self.schema = Arc::new(self.schema.reviving());
            }
            self.accepted_by_counter.resize(self.schema.seeds.len(), 0);
        }
    }

    fn ever_buckets(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.batches.len()).filter(|b| self.ever[b / 64] & (1 << (b % 64)) != 0)
    }

    /// Waits until everything this connection sent so far is committed; returns how many of its
    /// events the buckets rejected for overflow since the last call.
    pub(crate) async fn flush(&mut self, ingest: &Ingest) -> u64 {
        if let (Some(journal), upto @ 1..) = (&ingest.journal, self.spilled_upto) {
            journal
                .wait_covered(upto, || ingest.shared.nudge_all())
                .await;
        }
        let buckets: Vec<usize> = self.ever_buckets().collect();
        if buckets.is_empty() {
            return 0;
        }
        let (tx, mut rx) = mpsc::channel(buckets.len());
        for &b in &buckets {
            // A stopped bucket drops the ack unanswered: the wait below still ends.
            if let Err(err) = ingest.buckets[b].barrier(self.conn, tx.clone()).await {
                error!(cause = %err, "`!flush` cannot wait for this bucket");
            }
        }
        drop(tx);
        for &b in &buckets {
            ingest.shared.nudge(ingest.layout.worker_of(b));
        }
        let mut overflows = 0;
        while let Some(n) = rx.recv().await {
            overflows += n;
        }
        overflows
    }

    pub(crate) async fn close(&mut self, ingest: &Ingest) {
        self.send(ingest).await;
        let buckets: Vec<usize> = self.ever_buckets().collect();
        for b in buckets {
            if let Err(err) = ingest.buckets[b].closed(self.conn).await {
                debug!(cause = %err, "closed connection not forgotten by its bucket");
            }
        }
    }
}
