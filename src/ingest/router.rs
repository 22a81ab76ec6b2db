//! One connection's (or datagram socket's) routing state: parsed events batched per bucket and
//! journaled per read, `!flush` barriers, and the close that lets the buckets forget it.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::mpsc;
use tracing::{debug, error};

use super::owners::Sender;
use super::{reject, Ingest, Schema};
use crate::bucket::{Acked, Batch, Correct, Target};
use crate::hll;
use crate::journal::{self, Journal, Recorded};
use crate::kind::Op;
use crate::protocol::{self, BatchControl, Control, Correction, Line, Reject};
use crate::routing;
use crate::window::{Span, SpanCode, Window, WindowCache, ALL_SPAN, ALL_TIME};

/// What became of one line.
pub(crate) enum Outcome {
    /// An event routed to its bucket's batch, or an empty line.
    Taken,
    Control(Control),
    Rejected(Reject),
    /// `!batch`, `!commit` or `!abort`, for the stream connection to apply.
    Batch(BatchControl),
}

/// The lines of a connection's open batch, kept instead of routed until `!commit`
/// (see [`crate::batch`]): canonical lines, as the journal writes them.
#[derive(Debug, Default)]
pub(crate) struct Held {
    pub(crate) lines: Vec<u8>,
    /// `batch.max_bytes`: lines past it are not kept, and the batch is refused at `!commit`.
    pub(crate) max_bytes: usize,
    pub(crate) too_large: bool,
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
    /// Lines read back from the journal (see [`Router::for_journal`]): removed counters found
    /// again, no length limits, and no retention check (they were accepted already).
    from_journal: bool,
    /// Whether its events count in `tallyd_events_accepted_total`: not for spilled records
    /// folded back, counted when they were spilled.
    pub(crate) counts_accepted: bool,
    /// Whether `!set` and `!forget` are applied: not on datagram sockets, where no one hears
    /// the answer (they are rejected as `unknown_command` there).
    pub(crate) takes_corrections: bool,
    windows: WindowState,
    /// Corrections taken so far: the next one's number on this connection (from 1), which a
    /// refusal names (see [`crate::bucket::Acked::refused`]).
    corrections: u64,
    /// `corrections` when this read began: kept with a spilled record, so that the folder
    /// numbers its corrections as this connection did.
    corrections_before_read: u64,
    /// The open batch's lines, while one is open: events are kept here instead of routed.
    pub(crate) held: Option<Held>,
}

/// Per counter: the last window of each of its windows seen, and the retention cut-off for
/// the current window, so that an event costs a few compares.
#[derive(Debug, Default)]
struct WindowState {
    caches: Vec<Vec<WindowCache>>,
    /// Per counter: the `now` window's bounds and the start of the oldest window kept.
    cutoffs: Vec<(i64, i64, i64)>,
}

impl WindowState {
    fn caches(&mut self, counter: usize, n: usize) -> &mut [WindowCache] {
        if self.caches.len() <= counter {
            self.caches.resize_with(counter + 1, Vec::new);
        }
        let caches = &mut self.caches[counter];
        if caches.len() < n {
            caches.resize(n, WindowCache::default());
        }
        &mut caches[..n]
    }

    /// The start of the oldest of the last `keep` windows of `window` at `now_ms`.
    fn cutoff(&mut self, counter: usize, window: &Window, keep: u32, now_ms: i64) -> i64 {
        if self.cutoffs.len() <= counter {
            self.cutoffs.resize(counter + 1, (0, 0, i64::MIN));
        }
        let entry = &mut self.cutoffs[counter];
        if !(entry.0..entry.1).contains(&now_ms) {
            let (start, end) = window.bounds(now_ms);
            *entry = (start, end, window.back(start, keep.saturating_sub(1)));
        }
        entry.2
    }
}

impl Router {
    /// A router for lines read back from the journal: not journaled again, parsed without
    /// length limits, counters a reload removed since found again, no retention check.
    pub(crate) fn for_journal(ingest: &Ingest) -> Router {
        let mut router = Router::new(ingest, ingest.conn_id());
        router.journaling = false;
        router.from_journal = true;
        router.schema = Arc::new(router.schema.reviving());
        router
    }

    /// The connection id its events are sent under, and its corrections so far: the folder
    /// routes each spilled record as its sender ([`super::owners`]), so that the buckets report
    /// an overflow to that connection and a refused set by the number that connection gave it.
    pub(crate) fn sender(&self) -> Sender {
        Sender {
            conn: self.conn,
            corrections: self.corrections,
        }
    }

    pub(crate) fn set_sender(&mut self, sender: Sender) {
        self.conn = sender.conn;
        self.corrections = sender.corrections;
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
            accepted_by_counter: vec![0; schema.table.len()],
            schema,
            generation,
            accepted: 0,
            rejected: 0,
            now_ms: 0,
            journaling: ingest.journal.is_some(),
            journal_lines: Vec::new(),
            spilled_upto: 0,
            from_journal: false,
            counts_accepted: true,
            takes_corrections: true,
            windows: WindowState::default(),
            corrections: 0,
            corrections_before_read: 0,
            held: None,
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
            Ok(Line::Event(ev)) => match self.event(ingest, ev) {
                Ok(()) => Outcome::Taken,
                Err(reason) => {
                    reject(reason, line.unwrap_or_default());
                    Outcome::Rejected(reason)
                }
            },
            Ok(Line::Control(c)) => Outcome::Control(c),
            Ok(Line::Batch(b)) => Outcome::Batch(b),
            Ok(Line::Correction(_)) if self.held.is_some() => Outcome::Control(Control::InBatch),
            Ok(Line::Correction(_)) if !self.takes_corrections => {
                reject(Reject::UnknownCommand, line.unwrap_or_default());
                self.rejected += 1;
                Outcome::Rejected(Reject::UnknownCommand)
            }
            Ok(Line::Correction(correction)) => {
                self.corrections += 1;
                match correction.and_then(|c| self.correction(ingest, c)) {
                    Ok(()) => Outcome::Control(Control::Corrected),
                    Err(reason) => {
                        self.corrections -= 1;
                        reject(reason, line.unwrap_or_default());
                        self.rejected += 1;
                        Outcome::Control(Control::Refused(reason))
                    }
                }
            }
            Ok(Line::Empty) => Outcome::Taken,
            Err(reason) => {
                self.rejected += 1;
                Outcome::Rejected(reason)
            }
        }
    }

    /// Routes one parsed event to its bucket's batch (and the journal's lines), whichever
    /// protocol it came in (native or statsd). A windowed counter's event goes to one row per
    /// window it is counted in (its window, the coarser ones, the all-time row), all in the
    /// same bucket, so they commit together; an event older than the windows the counter keeps
    /// is rejected (`expired`).
    pub(crate) fn event(&mut self, ingest: &Ingest, ev: protocol::Event<'_>) -> Result<(), Reject> {
        if self.held.is_some() {
            return self.hold(ev);
        }
        let key = ev.key.as_str();
        let at_ms = ev.at_ms.unwrap_or(self.now_ms);
        let c = ev.counter as usize;
        let counter = &self.schema.table[c];
        let hash = routing::key_hash(counter.seed, key.as_bytes());
        let b = ingest.layout.bucket(hash);
        let was_empty = self.batches[b].is_empty();
        let op = self.schema.routes[c].op;
        // What folds in the bucket: a unique value by its hash, as postgresql-hll hashes text.
        let amount = match ev.value {
            Some(value) => hll::hash_text(value.as_bytes()),
            None => ev.delta,
        };
        match &counter.window {
            None if op == Op::Sum => self.batches[b].push(hash, ev.counter, key, ev.delta, at_ms),
            None => {
                let to = Target {
                    hash,
                    counter: ev.counter,
                    span: ALL_SPAN,
                    win: ALL_TIME,
                    op,
                };
                self.batches[b].push_to(to, key, amount, at_ms, false);
            }
            Some(_) if !self.from_journal && !crate::window::nameable(at_ms) => {
                self.rejected += 1;
                return Err(Reject::UnnamedWindow);
            }
            Some(window) => {
                // The counter's window first, then its `also` windows.
                let windows = std::iter::once(window).chain(&counter.also);
                let mut starts = [0i64; Span::ALL.len()];
                let caches = self.windows.caches(c, 1 + counter.also.len());
                for (i, (w, cache)) in windows.clone().zip(caches).enumerate() {
                    starts[i] = cache.start_of(w, at_ms);
                }
                if let (Some(keep), true) = (counter.keep_windows, !self.from_journal) {
                    if starts[0] < self.windows.cutoff(c, window, keep, self.now_ms) {
                        self.rejected += 1;
                        return Err(Reject::Expired);
                    }
                }
                let batch = &mut self.batches[b];
                let mut to = Target {
                    hash,
                    counter: ev.counter,
                    span: ALL_SPAN,
                    win: ALL_TIME,
                    op,
                };
                for (i, w) in windows.enumerate() {
                    (to.span, to.win) = (w.span().code(), starts[i]);
                    batch.push_to(to, key, amount, at_ms, i > 0);
                }
                if counter.all_time {
                    (to.span, to.win) = (ALL_SPAN, ALL_TIME);
                    batch.push_to(to, key, amount, at_ms, true);
                }
            }
        }
        if was_empty {
            self.touched.push(b as u32);
            self.ever[b / 64] |= 1 << (b % 64);
        }
        if self.journaling {
            let name = self.schema.counters.name(ev.counter);
            match ev.value {
                Some(value) => {
                    journal::push_value_line(&mut self.journal_lines, name, key, value, at_ms)
                }
                None => journal::push_line(&mut self.journal_lines, name, key, ev.delta, at_ms),
            }
        }
        self.accepted_by_counter[c] += 1;
        self.accepted += 1;
        Ok(())
    }

    /// Keeps an event of the open batch as its canonical line (checked as [`Router::event`]
    /// checks it: the window's retention), to be routed once the batch is claimed.
    fn hold(&mut self, ev: protocol::Event<'_>) -> Result<(), Reject> {
        let at_ms = ev.at_ms.unwrap_or(self.now_ms);
        let c = ev.counter as usize;
        let counter = &self.schema.table[c];
        if let (Some(window), Some(keep)) = (&counter.window, counter.keep_windows) {
            let start = window.bounds(at_ms).0;
            if start < self.windows.cutoff(c, window, keep, self.now_ms) {
                self.rejected += 1;
                return Err(Reject::Expired);
            }
        }
        let name = self.schema.counters.name(ev.counter);
        let held = self.held.as_mut().expect("a batch is open");
        if !held.too_large {
            let before = held.lines.len();
            let key = ev.key.as_str();
            match ev.value {
                Some(value) => journal::push_value_line(&mut held.lines, name, key, value, at_ms),
                None => journal::push_line(&mut held.lines, name, key, ev.delta, at_ms),
            }
            if held.lines.len() > held.max_bytes {
                held.too_large = true;
                held.lines.truncate(before);
            }
        }
        self.accepted += 1;
        Ok(())
    }

    /// Routes a correction to its key's bucket, in order with this connection's events, and
    /// journals it; refuses a `!set` the counter cannot take exactly ([`Reject::NotSettable`]).
    fn correction(&mut self, ingest: &Ingest, correction: Correction<'_>) -> Result<(), Reject> {
        match correction {
            Correction::Set {
                counter,
                key,
                value,
                at_ms,
            } => {
                let c = usize::from(counter);
                let model = &self.schema.table[c];
                if !model.settable {
                    return Err(Reject::NotSettable);
                }
                let at_ms = at_ms.unwrap_or(self.now_ms);
                let (span, win) = match &model.window {
                    None => (ALL_SPAN, ALL_TIME),
                    Some(_) if !self.from_journal && !crate::window::nameable(at_ms) => {
                        return Err(Reject::UnnamedWindow);
                    }
                    Some(window) => {
                        let start = window.bounds(at_ms).0;
                        // As for an event: a window the counter no longer keeps is refused.
                        if let (Some(keep), false) = (model.keep_windows, self.from_journal) {
                            if start < self.windows.cutoff(c, window, keep, self.now_ms) {
                                return Err(Reject::Expired);
                            }
                        }
                        (window.span().code(), start)
                    }
                };
                self.route_correction(
                    ingest,
                    counter,
                    key.as_str(),
                    (span, win),
                    Correct::Set,
                    value,
                    at_ms,
                );
                if self.journaling {
                    let name = self.schema.counters.name(counter);
                    journal::push_set_line(
                        &mut self.journal_lines,
                        name,
                        key.as_str(),
                        value,
                        at_ms,
                    );
                }
            }
            Correction::Forget { counter, key } => self.forget(ingest, counter, key.as_str()),
            Correction::ForgetEverywhere { key } => {
                let counters = &self.schema.counters;
                let found: Vec<(u16, String)> = (0..counters.len() as u16)
                    .filter(|&c| counters.is_live(c))
                    .filter_map(|c| {
                        let key = protocol::parse_key(key, counters.key_type(c)).ok()?;
                        Some((c, key.as_str().to_string()))
                    })
                    .collect();
                if found.is_empty() {
                    return Err(Reject::BadKey);
                }
                for (counter, key) in found {
                    self.forget(ingest, counter, &key);
                }
            }
        }
        Ok(())
    }

    /// A forget of `key` in `counter`: its all-time entry marks every window's rows for
    /// deletion.
    fn forget(&mut self, ingest: &Ingest, counter: u16, key: &str) {
        let target = (ALL_SPAN, ALL_TIME);
        self.route_correction(
            ingest,
            counter,
            key,
            target,
            Correct::Forget,
            0,
            self.now_ms,
        );
        if self.journaling {
            let name = self.schema.counters.name(counter);
            journal::push_forget_line(&mut self.journal_lines, name, key);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn route_correction(
        &mut self,
        ingest: &Ingest,
        counter: u16,
        key: &str,
        (span, win): (SpanCode, i64),
        correct: Correct,
        value: i64,
        at_ms: i64,
    ) {
        let c = usize::from(counter);
        let hash = routing::key_hash(self.schema.table[c].seed, key.as_bytes());
        let b = ingest.layout.bucket(hash);
        if self.batches[b].is_empty() {
            self.touched.push(b as u32);
            self.ever[b / 64] |= 1 << (b % 64);
        }
        let to = Target {
            hash,
            counter,
            span,
            win,
            op: self.schema.routes[c].op,
        };
        self.batches[b].push_correction(to, key, correct, value, at_ms, self.corrections);
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
        let corrections_before =
            std::mem::replace(&mut self.corrections_before_read, self.corrections);
        if self.touched.is_empty() {
            return self.send_batches(ingest).await;
        }
        // The record goes to the writer thread; the next read likely needs as much room.
        let room = self.journal_lines.len();
        let lines = std::mem::replace(&mut self.journal_lines, Vec::with_capacity(room));
        let spill = !ingest.shared.has_room();
        // This read's events (its batches hold rows: an event of a windowed counter may be
        // several).
        let events: u64 = self.accepted_by_counter.iter().sum();
        if let Recorded::Spilled(seq) = journal
            .record(lines, spill, self.send_batches(ingest))
            .await
        {
            self.spilled_upto = seq;
            let sender = Sender {
                conn: self.conn,
                corrections: corrections_before,
            };
            ingest.owners.spilled(seq, sender);
            self.count_accepted();
            let mut rows = 0;
            for b in self.touched.drain(..) {
                rows += self.batches[b as usize].len();
                self.batches[b as usize].clear();
            }
            ingest.shared.unreserve(rows);
            crate::events::RecordSpilled { events }.emit();
            crate::events::Unfolded {
                records: journal.unfolded(),
            }
            .emit();
        }
    }

    /// Journals `lines` (a claimed batch's, routed by this router already) as one record and
    /// sends its batches, as [`Router::send`] does for a read; the record is a batch's
    /// ([`Journal::record_batch`]): no flush commits any of its events before it is durable, so
    /// no event of a batch can be committed while the record that says the batch was routed
    /// could still be lost (docs/reliability.md, "Batches"). At the memory cap the record is
    /// spilled as any other. Returns the record's number: the batch's held payload may be
    /// deleted only once it is durable ([`Journal::wait_durable`]).
    pub(crate) async fn send_batch_record(
        &mut self,
        ingest: &Ingest,
        journal: &Journal,
        lines: Vec<u8>,
    ) -> u64 {
        self.reserve(ingest);
        let spill = !ingest.shared.has_room();
        let events: u64 = self.accepted_by_counter.iter().sum();
        let (seq, recorded) = journal
            .record_batch(lines, spill, self.send_batches(ingest))
            .await;
        if let Recorded::Spilled(seq) = recorded {
            self.spilled_upto = seq;
            self.count_accepted();
            let mut rows = 0;
            for b in self.touched.drain(..) {
                rows += self.batches[b as usize].len();
                self.batches[b as usize].clear();
            }
            ingest.shared.unreserve(rows);
            crate::events::RecordSpilled { events }.emit();
        }
        seq
    }

    fn count_accepted(&mut self) {
        for (i, n) in self.accepted_by_counter.iter_mut().enumerate() {
            let n = std::mem::take(n);
            if n > 0 && self.counts_accepted {
                self.schema.routes[i].accepted.increment(n);
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
            if self.from_journal {
                self.schema = Arc::new(self.schema.reviving());
            }
            // `keep_windows` may have changed.
            self.windows = WindowState::default();
            self.accepted_by_counter.resize(self.schema.table.len(), 0);
        }
    }

    fn ever_buckets(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.batches.len()).filter(|b| self.ever[b / 64] & (1 << (b % 64)) != 0)
    }

    /// Waits until everything this connection sent so far is committed; returns how many of its
    /// events the buckets rejected for overflow since the last call, and how many of its
    /// corrections the flush refused.
    pub(crate) async fn flush(&mut self, ingest: &Ingest) -> Acked {
        if let (Some(journal), upto @ 1..) = (&ingest.journal, self.spilled_upto) {
            journal
                .wait_covered(upto, || ingest.shared.nudge_all())
                .await;
        }
        let buckets: Vec<usize> = self.ever_buckets().collect();
        if buckets.is_empty() {
            return Acked::default();
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
        let mut all = Acked::default();
        while let Some(acked) = rx.recv().await {
            all.overflows += acked.overflows;
            all.refused.extend(acked.refused);
        }
        all
    }

    pub(crate) async fn close(&mut self, ingest: &Ingest) {
        self.send(ingest).await;
        ingest.owners.closed(self.conn, self.spilled_upto);
        let buckets: Vec<usize> = self.ever_buckets().collect();
        for b in buckets {
            if let Err(err) = ingest.buckets[b].closed(self.conn).await {
                debug!(cause = %err, "closed connection not forgotten by its bucket");
            }
        }
    }
}
