//! From bytes to routed events, whatever transport they came by: the [`Schema`] lines are
//! parsed against (swapped whole by a reload), the [`Ingest`] every connection and datagram
//! socket feeds (buckets, layout, journal, memory accounting), the per-connection [`Router`]
//! that batches events per bucket, the datagram read loop the native and statsd datagram
//! sockets share, and the replay of an old journal through the same path, and the folder that
//! routes records spilled at the memory cap.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use metrics::counter;
use tokio_util::sync::CancellationToken;

mod datagrams;
pub mod fold;
mod router;

pub(crate) use datagrams::serve_datagram_lines;
pub(crate) use router::{Outcome, Router};

use crate::bucket::{BucketHandle, Op};
use crate::config::CounterInfo;
use crate::journal::Journal;
use crate::metrics as m;
use crate::protocol::{Counters, Kind, Limits, Reject};
use crate::routing::{self, Layout};
use crate::shared::Shared;
use crate::window::{SpanCode, Window};

/// What a line is parsed against: the counters and the limits. A reload swaps it whole under
/// running connections ([`Ingest::set_schema`]); a connection takes the new one before its next
/// line.
pub struct Schema {
    /// Indexes only grow: a counter a reload removes keeps its index, retired (see
    /// [`Counters::with_retired`]), because pending events still name it.
    pub counters: Counters,
    /// Per counter index: the hash seed (from its name) and its accepted-events metric.
    pub seeds: Vec<u64>,
    pub accepted: Vec<metrics::Counter>,
    /// Per counter index: its windows (`None`: an all-time counter).
    pub windowing: Vec<Option<Arc<Windowing>>>,
    /// Per counter index: how its events' values fold (its kind).
    pub ops: Vec<Op>,
    /// Per counter index: whether `!set` may set its total (see [`CounterInfo::settable`]).
    pub settable: Vec<bool>,
    pub limits: Limits,
}

/// The windows a windowed counter's events are counted in: one row per window of each, written
/// together (one bucket, one flush transaction).
#[derive(Debug)]
pub struct Windowing {
    /// The counter's `window` first, then its `also` windows, each with its span code.
    pub windows: Vec<(SpanCode, Window)>,
    /// An all-time row too (`also` lists `all`).
    pub all_time: bool,
    /// `keep_windows`: events whose window is older than the last this many are rejected.
    pub keep: Option<u32>,
}

impl Windowing {
    fn of(info: &CounterInfo) -> Option<Windowing> {
        let window = info.window.as_ref()?;
        let windows = std::iter::once(window.clone())
            .chain(info.also.iter().map(|&span| window.with_span(span)))
            .map(|w| (w.span().code(), w))
            .collect();
        Some(Windowing {
            windows,
            all_time: info.all_time,
            keep: info.keep_windows,
        })
    }
}

/// How `info`'s events fold in a bucket.
fn op_of(info: &CounterInfo) -> Op {
    match (info.kind, info.params) {
        (Kind::Sum, _) => Op::Sum,
        (Kind::Max, _) => Op::Max,
        (Kind::Min, _) => Op::Min,
        (Kind::Last, _) => Op::Last,
        (Kind::Unique, params) => Op::Unique(params.unwrap_or_default()),
    }
}

impl Schema {
    /// `infos` in index order, one per entry of `counters`.
    pub fn new(counters: Counters, infos: &[CounterInfo], limits: Limits) -> Schema {
        Schema {
            counters,
            seeds: infos
                .iter()
                .map(|c| routing::counter_seed(&c.name))
                .collect(),
            accepted: infos.iter().map(|c| m::accepted_handle(&c.name)).collect(),
            windowing: infos
                .iter()
                .map(|c| Windowing::of(c).map(Arc::new))
                .collect(),
            ops: infos.iter().map(op_of).collect(),
            settable: infos.iter().map(CounterInfo::settable).collect(),
            limits,
        }
    }

    /// This schema for lines read back from the journal, which were accepted already: removed
    /// counters are found again (see [`Counters::reviving`]), and no length limit applies (the
    /// journal's line carries `@unix_ms` and the canonical key, so it may be longer than the
    /// line that was sent, and a reload may have lowered the limits since).
    pub fn reviving(&self) -> Schema {
        Schema {
            counters: self.counters.reviving(),
            seeds: self.seeds.clone(),
            accepted: self.accepted.clone(),
            windowing: self.windowing.clone(),
            ops: self.ops.clone(),
            settable: self.settable.clone(),
            limits: Limits {
                max_line_bytes: usize::MAX,
                max_key_bytes: usize::MAX,
            },
        }
    }
}

/// Everything a connection needs to turn bytes into routed events.
pub struct Ingest {
    schema: RwLock<Arc<Schema>>,
    /// Bumped by every [`Ingest::set_schema`]: connections compare it (one relaxed load per
    /// line) instead of locking the schema for each line.
    generation: AtomicU64,
    pub buckets: Vec<BucketHandle>,
    /// Which database, bucket and flush worker a key goes to.
    pub layout: Layout,
    pub shared: Arc<Shared>,
    pub read_buffer_bytes: usize,
    pub journal: Option<Arc<Journal>>,
    next_conn: AtomicU64,
    /// Handles registered once: a per-read `counter!` would look the name up in the registry
    /// on every read and every datagram.
    pub(crate) received_bytes: metrics::Counter,
    pub(crate) datagrams_received: metrics::Counter,
}

impl Ingest {
    pub fn new(
        schema: Schema,
        buckets: Vec<BucketHandle>,
        layout: Layout,
        shared: Arc<Shared>,
        read_buffer_bytes: usize,
        journal: Option<Arc<Journal>>,
    ) -> Ingest {
        Ingest {
            schema: RwLock::new(Arc::new(schema)),
            generation: AtomicU64::new(0),
            buckets,
            layout,
            shared,
            read_buffer_bytes,
            journal,
            next_conn: AtomicU64::new(1),
            received_bytes: counter!(m::RECEIVED_BYTES),
            datagrams_received: counter!(m::DATAGRAMS_RECEIVED),
        }
    }

    /// The schema lines are parsed against now, and its generation.
    pub fn schema(&self) -> Arc<Schema> {
        self.schema
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Replaces the schema (a reload); every connection parses its next line against it.
    pub fn set_schema(&self, schema: Schema) {
        *self.schema.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(schema);
        self.generation.fetch_add(1, Ordering::Release);
    }

    pub(crate) fn conn_id(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    /// Whether new events may be taken now. With a journal: its writes work (while they fail,
    /// nothing more is taken: its lines could not be made durable) and it is below
    /// `journal.max_bytes`; at the memory cap, records are spilled (journaled only, routed
    /// later by the folder), so an outage is bounded by the disk. Without one: memory below
    /// its cap.
    pub(crate) fn has_room(&self) -> bool {
        match &self.journal {
            Some(journal) => journal.has_room(),
            None => self.shared.has_room(),
        }
    }

    /// Waits until [`Ingest::has_room`] may hold again. At the journal's cap it asks the flush
    /// workers to flush now: only commits let segments go.
    pub(crate) async fn wait_for_intake(&self) {
        match &self.journal {
            Some(journal) => {
                journal.wait_for_room(|| self.shared.nudge_all()).await;
            }
            None => {
                self.shared.wait_for_room().await;
            }
        }
    }

    /// A stream connection's pause at the memory cap or the journal's: waits as
    /// [`Ingest::wait_for_intake`] does and counts the pause; false when `cancel` came first.
    pub(crate) async fn pause_for_intake(&self, cancel: &CancellationToken) -> bool {
        // Counted as paused from now on, not only once the pause ends.
        let _pause = crate::events::BackpressurePause::begin();
        tokio::select! {
            _ = self.wait_for_intake() => true,
            _ = cancel.cancelled() => false,
        }
    }
}

/// Counts and (rate-limited) logs a line that was not accepted.
pub(crate) fn reject(reason: Reject, line: &[u8]) {
    crate::events::LineRejected {
        reason,
        line,
        statsd: false,
    }
    .emit();
}

/// Replays the lines of old journal records `(seq, lines)`, in ascending order of `seq`,
/// through the normal path without writing them again, then waits until they are all
/// committed, so that the caller can delete the old segments. Memory is capped as for
/// connections: before each record it waits for room, while flushes commit what is routed.
/// Until the replay has routed a record, no drain point passes its number
/// ([`Journal::begin_backlog`]), so a flush during the replay covers exactly the records
/// routed before it. Returns how many events were accepted.
pub async fn replay(ingest: &Ingest, journal: &Journal, records: Vec<(u64, Vec<u8>)>) -> u64 {
    let mut router = Router::for_journal(ingest);
    if let Some((first, _)) = records.first() {
        journal.begin_backlog(*first);
    }
    for (seq, lines) in records {
        ingest.shared.wait_for_room().await;
        fold::route(ingest, journal, &mut router, seq, &lines).await;
    }
    journal.end_backlog();
    router.flush(ingest).await;
    router.close(ingest).await;
    router.accepted
}
