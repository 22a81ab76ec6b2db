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
mod owners;
mod router;

pub(crate) use datagrams::serve_datagram_lines;
pub(crate) use router::{Held, Outcome, Router};

use crate::bucket::BucketHandle;
use crate::config::Counter;
use crate::journal::Journal;
use crate::kind::Op;
use crate::metrics as m;
use crate::protocol::{Counters, Limits, Reject};
use crate::routing::Layout;
use crate::shared::Shared;

/// What a line is parsed against: the counter table and the limits. A reload swaps it whole
/// under running connections ([`Ingest::set_schema`]); a connection takes the new one before
/// its next line.
pub struct Schema {
    /// The parser's index of `table` (names, key types, kinds, retired counters).
    pub counters: Counters,
    /// Every counter by id (the table the flush workers read too). Ids only grow: a counter a
    /// reload removes keeps its id, retired, because pending events still name it.
    pub table: Arc<Vec<Counter>>,
    /// Per counter id: what routing needs besides the model.
    pub routes: Vec<Route>,
    pub limits: Limits,
}

/// What the router keeps per counter id besides [`Counter`]: what the model cannot hold (a
/// metric handle) or would hold in a lower layer's terms (the bucket's fold).
#[derive(Clone)]
pub struct Route {
    /// How its events fold in a bucket (its kind).
    pub op: Op,
    /// `tallyd_events_accepted_total{counter}`, registered once.
    pub accepted: metrics::Counter,
}

impl Route {
    fn of(counter: &Counter) -> Route {
        Route {
            op: Op::new(counter.kind, counter.params),
            accepted: m::accepted_handle(&counter.name),
        }
    }
}

impl Schema {
    /// Lines parsed against `table` within `limits`.
    pub fn new(table: Arc<Vec<Counter>>, limits: Limits) -> Schema {
        Schema {
            counters: Counters::declare(
                table
                    .iter()
                    .map(|c| (c.name.as_str(), c.key_type, c.kind, c.live)),
            ),
            routes: table.iter().map(Route::of).collect(),
            table,
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
            table: self.table.clone(),
            routes: self.routes.clone(),
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
    /// Who sent each spilled record not yet folded.
    pub(crate) owners: owners::Owners,
    /// Cancelled when this daemon may no longer write (a shard move fenced it, or its lease
    /// was lost): connections closed then say so.
    pub(crate) lost: CancellationToken,
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
            owners: owners::Owners::default(),
            lost: CancellationToken::new(),
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

    /// Connections closed because `lost` was cancelled answer why (see [`Ingest::lost`]).
    pub fn fenced_by(mut self, lost: CancellationToken) -> Ingest {
        self.lost = lost;
        self
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
/// routed before it. `records` are read one at a time (`first` is the first one's number), so
/// the replay holds one record of the journal, whatever its size. Returns how many events were
/// accepted.
pub async fn replay(
    ingest: &Ingest,
    journal: &Journal,
    first: Option<u64>,
    records: impl Iterator<Item = (u64, Vec<u8>)>,
) -> u64 {
    let mut router = Router::for_journal(ingest);
    if let Some(first) = first {
        journal.begin_backlog(first);
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
