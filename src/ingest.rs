//! From bytes to routed events, whatever transport they came by: the [`Schema`] lines are
//! parsed against (swapped whole by a reload), the [`Ingest`] every connection and datagram
//! socket feeds (buckets, layout, journal, memory accounting), the per-connection [`Router`]
//! that batches events per bucket, the datagram read loop the native and statsd datagram
//! sockets share, and the replay of an old journal through the same path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use metrics::counter;
use tokio_util::sync::CancellationToken;

mod datagrams;
mod router;

pub(crate) use datagrams::serve_datagram_lines;
pub(crate) use router::{Outcome, Router};

use crate::bucket::BucketHandle;
use crate::journal::Journal;
use crate::metrics as m;
use crate::protocol::{Counters, Limits, Reject};
use crate::routing::{self, Layout};
use crate::shared::Shared;

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
    pub limits: Limits,
}

impl Schema {
    /// `names` in index order, one per entry of `counters`.
    pub fn new(counters: Counters, names: &[String], limits: Limits) -> Schema {
        Schema {
            counters,
            seeds: names.iter().map(|n| routing::counter_seed(n)).collect(),
            accepted: names.iter().map(|n| m::accepted_handle(n)).collect(),
            limits,
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

    /// Whether new events may be taken now: memory below its cap, journal writes working
    /// (while they fail, nothing more is taken: its lines could not be made durable) and the
    /// journal below `journal.max_bytes`.
    pub(crate) fn has_room(&self) -> bool {
        self.shared.has_room() && self.journal.as_ref().is_none_or(|j| j.has_room())
    }

    /// Waits until [`Ingest::has_room`] may hold again. At the journal's cap it asks the flush
    /// workers to flush now: only commits let segments go.
    pub(crate) async fn wait_for_intake(&self) {
        self.shared.wait_for_room().await;
        if let Some(journal) = &self.journal {
            journal.wait_for_room(|| self.shared.nudge_all()).await;
        }
    }

    /// A stream connection's pause at the memory cap or the journal's: waits as
    /// [`Ingest::wait_for_intake`] does and counts the pause; false when `cancel` came first.
    pub(crate) async fn pause_for_intake(&self, cancel: &CancellationToken) -> bool {
        let paused = std::time::Instant::now();
        tokio::select! {
            _ = self.wait_for_intake() => {}
            _ = cancel.cancelled() => return false,
        }
        crate::events::BackpressurePaused {
            took: paused.elapsed(),
        }
        .emit();
        true
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

/// Replays the lines of old journal records through the normal path without writing them
/// again, then waits until they are all committed, so that the caller can delete the old
/// segments. The journal's gate is held for the whole replay: the first drain then covers every
/// replayed record at once (they keep their old, lower sequence numbers). Memory is not capped
/// while replaying. Returns how many events were accepted.
pub async fn replay(ingest: &Ingest, journal: &Journal, records: Vec<Vec<u8>>) -> u64 {
    let mut router = Router::new(ingest, ingest.conn_id());
    router.journaling = false;
    journal
        .replayed(async {
            for lines in records {
                for line in lines.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
                    router.line(ingest, Ok(line));
                }
                // Not `send`: the gate is held already, and replayed lines are journaled already.
                router.reserve(ingest);
                router.send_batches(ingest).await;
            }
        })
        .await;
    router.flush(ingest).await;
    router.close(ingest).await;
    router.accepted
}
