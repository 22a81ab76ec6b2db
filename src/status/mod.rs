//! What tallyd says about itself while it runs: readiness (`/readyz`) and the status view
//! (`/status`, `tallyd status`). The [`Reporter`] reads the daemon's [`Health`] (written by its
//! parts as things happen) and, once the pipeline runs, the pipeline itself; gathering a
//! [`Status`] reads atomics and asks each bucket, without waiting for room in its queue, for a
//! bounded look at its keys. Nothing here can slow ingest down.
//! docs/operations.md ("Health endpoints", "Status") documents every field.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::bucket::{BucketHandle, HotKey, Peek};
use crate::clock::now_ms;
use crate::config::Counter;
use crate::health::{DbStatus, Health};
use crate::journal::Journal;
use crate::routing::Layout;
use crate::shared::Shared;

mod table;

/// Keys a bucket looks at for one status request: bounds its cost (a few hundred microseconds)
/// however many keys are pending. Beyond it the hottest keys are those of a sample.
const PEEK_LIMIT: usize = 65_536;
/// How long a status request waits for the buckets' answers before reporting without them.
const PEEK_WAIT: Duration = Duration::from_millis(500);
/// The buckets are asked for a look at their keys at most once in this time. However many
/// clients ask for /status, each bucket spends at most one bounded scan (`PEEK_LIMIT` keys) per
/// period on them, so a storm of status requests cannot slow ingest down.
const GATHER_PERIOD: Duration = Duration::from_millis(100);
/// Status requests that may wait for a gather at once; beyond them a request is answered
/// [`Busy`] at once, so that waiting status requests cannot hold every HTTP connection the
/// health checks and scrapes need.
const MAX_WAITING: usize = 4;

/// Too many status requests are waiting already (see [`MAX_WAITING`]): try again shortly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("too many status requests at once; try again")]
pub struct Busy;

/// What the running pipeline exposes to the status view, attached once it has started.
pub(crate) struct Attached {
    pub shared: Arc<Shared>,
    pub buckets: Vec<BucketHandle>,
    pub layout: Layout,
    pub journal: Option<Arc<Journal>>,
    /// The counter table (a reload adds to it; a removed counter stays, retired, while its
    /// events are pending).
    pub counters: Arc<crate::live::Live<Vec<Counter>>>,
}

/// Readiness and the status view, from the daemon's [`Health`] and, once attached, its pipeline.
pub struct Reporter {
    health: Arc<Health>,
    /// Hottest keys per counter in the status view (0: keys are not shown).
    top_keys: usize,
    live: OnceLock<Attached>,
    /// Attached once the journal is replayed (with the journal only).
    batches: OnceLock<Arc<crate::batch::Batches>>,
    /// Status requests waiting for a gather now.
    waiting: std::sync::atomic::AtomicUsize,
    /// The last view gathered and when its gathering started: one gather at a time.
    last: tokio::sync::Mutex<Option<(tokio::time::Instant, Status)>>,
}

impl Reporter {
    /// `databases`: how many the config names; `top_keys`: `metrics.status_top_keys`.
    pub fn new(databases: usize, top_keys: usize) -> Arc<Reporter> {
        Arc::new(Reporter {
            health: Health::new(databases),
            top_keys,
            live: OnceLock::new(),
            batches: OnceLock::new(),
            waiting: std::sync::atomic::AtomicUsize::new(0),
            last: tokio::sync::Mutex::new(None),
        })
    }

    /// For a daemon run without status reporting (tests that call `daemon::run` directly).
    pub fn detached() -> Arc<Reporter> {
        Reporter::new(0, 0)
    }

    /// The health the daemon's parts report into.
    pub fn health(&self) -> &Arc<Health> {
        &self.health
    }

    pub(crate) fn attach(&self, live: Attached) {
        let _ = self.live.set(live);
    }

    pub(crate) fn attach_batches(&self, batches: Arc<crate::batch::Batches>) {
        let _ = self.batches.set(batches);
    }

    /// Ready: accepting on the sockets, the journal replayed, every database reachable, the
    /// journal writable. Otherwise the reasons, each a short sentence.
    pub fn readiness(&self) -> Readiness {
        let mut reasons = self.health.reasons();
        let journal = self.live.get().and_then(|l| l.journal.as_ref());
        if journal.is_some_and(|j| !j.writable()) {
            reasons.push("journal writes failing".to_string());
        }
        Readiness {
            ready: reasons.is_empty(),
            reasons,
        }
    }

    /// The status view. Reads atomics, and asks each bucket for its oldest event and hottest
    /// keys without waiting for room in its queue (a bucket that is busy is left out, and
    /// `hottest_complete` says so). One gather at a time, at most one per [`GATHER_PERIOD`]:
    /// requests that arrive while one is gathered wait for the next, and every answer was
    /// gathered after its request arrived (never a view older than the request). [`Busy`]
    /// when [`MAX_WAITING`] requests wait already.
    pub async fn status(&self) -> Result<Status, Busy> {
        use std::sync::atomic::Ordering;
        struct Waiting<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= MAX_WAITING {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(Busy);
        }
        let _waiting = Waiting(&self.waiting);
        let asked = tokio::time::Instant::now();
        let mut last = self.last.lock().await;
        if let Some((started, status)) = last.as_ref() {
            if *started >= asked {
                // Gathered for requests that waited with this one.
                return Ok(status.clone());
            }
            tokio::time::sleep_until(*started + GATHER_PERIOD).await;
        }
        let started = tokio::time::Instant::now();
        let status = self.gather().await;
        *last = Some((started, status.clone()));
        Ok(status)
    }

    async fn gather(&self) -> Status {
        let readiness = self.readiness();
        let mut status = Status {
            version: env!("CARGO_PKG_VERSION").to_string(),
            phase: self.health.phase().as_str().to_string(),
            ready: readiness.ready,
            reasons: readiness.reasons,
            uptime_seconds: self.health.uptime().as_secs_f64(),
            connections_open: 0,
            memory: None,
            counters: Vec::new(),
            hottest_shown: self.top_keys > 0,
            hottest_complete: true,
            databases: Vec::new(),
            journal: None,
            batches: None,
        };
        status.batches = self.batches.get().map(|b| batches(&b.status()));
        let Some(live) = self.live.get() else {
            // Starting: no pipeline yet, only the databases' state.
            status.databases = self.health.databases(&[]);
            return status;
        };
        let peeks = self.peek(live).await;
        status.hottest_complete =
            peeks.len() == live.buckets.len() && peeks.iter().all(|(_, p)| p.complete);
        status.connections_open = live.shared.connections_open() as u64;
        status.memory = Some(memory(&live.shared));
        status.counters = counters(live, &peeks, self.top_keys);
        status.journal = live.journal.as_ref().map(|j| journal(j));
        status.databases = self.health.databases(&lags(live, &peeks));
        status
    }

    /// Every bucket's [`Peek`] that arrives within [`PEEK_WAIT`], with its index.
    async fn peek(&self, live: &Attached) -> Vec<(usize, Peek)> {
        let asked: Vec<_> = live
            .buckets
            .iter()
            .enumerate()
            .filter_map(|(b, h)| Some((b, h.try_peek(self.top_keys, PEEK_LIMIT)?)))
            .collect();
        let deadline = tokio::time::Instant::now() + PEEK_WAIT;
        let mut peeks = Vec::with_capacity(asked.len());
        for (b, rx) in asked {
            if let Ok(Ok(peek)) = tokio::time::timeout_at(deadline, rx).await {
                peeks.push((b, peek));
            }
        }
        peeks
    }
}

/// `/readyz`'s answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Readiness {
    pub ready: bool,
    pub reasons: Vec<String>,
}

/// The status view (`/status`, `tallyd status --json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    pub version: String,
    pub phase: String,
    pub ready: bool,
    pub reasons: Vec<String>,
    pub uptime_seconds: f64,
    pub connections_open: u64,
    /// None until the pipeline runs.
    pub memory: Option<Memory>,
    pub counters: Vec<CounterStatus>,
    /// False when `[metrics] status_top_keys = 0`: no key is shown.
    pub hottest_shown: bool,
    /// False when a bucket was busy or held more keys than it looks at for one request: the
    /// hottest keys are then those of a sample.
    pub hottest_complete: bool,
    pub databases: Vec<DbStatus>,
    /// None without a journal (or before the pipeline runs).
    pub journal: Option<JournalStatus>,
    /// None without a journal (or before the journal is replayed).
    #[serde(default)]
    pub batches: Option<BatchesStatus>,
}

/// Idempotent batches: the ids remembered and the batches held.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchesStatus {
    /// Batch ids remembered in `tallyd.batches`, every database together (counted every 10 s;
    /// None until each database was counted once).
    pub remembered: Option<i64>,
    /// Age of the oldest remembered claim: pruned past `batch.remember_days`.
    pub oldest_claim_age_seconds: Option<f64>,
    /// Committed batches not yet routed or dropped (claims waiting for a database).
    pub held: u64,
}

fn batches(s: &crate::batch::Status) -> BatchesStatus {
    BatchesStatus {
        remembered: s.remembered,
        oldest_claim_age_seconds: s
            .oldest_ms
            .map(|ms| ((crate::clock::now_ms() - ms).max(0)) as f64 / 1000.0),
        held: s.held,
    }
}

/// The memory cap (`coalesce.max_pending_keys`) and how much of it is used.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Memory {
    pub pending_keys: u64,
    pub pending_events: u64,
    /// Keys pending plus events on their way to the buckets: what the cap compares.
    pub counted_keys: u64,
    pub max_pending_keys: u64,
    /// counted_keys / max_pending_keys; at 1 connections stop reading.
    pub used: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CounterStatus {
    pub name: String,
    pub pending_keys: u64,
    pub pending_events: u64,
    /// Most pending events first; keys waiting in a flight being written are not included.
    pub hottest: Vec<HotKeyStatus>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct HotKeyStatus {
    pub key: String,
    pub events: u64,
    pub sum: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JournalStatus {
    pub bytes: u64,
    pub segments: u64,
    /// Age of the oldest segment kept: an upper bound on the age of the oldest record whose
    /// events are not yet all committed. None when no segment is kept.
    pub oldest_segment_age_seconds: Option<f64>,
    pub writable: bool,
    /// `journal.max_bytes`: at `bytes >= max_bytes` connections stop reading.
    pub max_bytes: u64,
    /// bytes / max_bytes.
    pub used: f64,
}

fn memory(shared: &Shared) -> Memory {
    let counted = shared.counted_keys() as u64;
    let max = shared.max_pending_keys() as u64;
    Memory {
        pending_keys: shared.pending_keys() as u64,
        pending_events: shared.pending_events(),
        counted_keys: counted,
        max_pending_keys: max,
        used: if max == 0 {
            0.0
        } else {
            counted as f64 / max as f64
        },
    }
}

fn counters(live: &Attached, peeks: &[(usize, Peek)], top: usize) -> Vec<CounterStatus> {
    live.counters
        .get()
        .iter()
        .enumerate()
        .map(|(i, info)| {
            let (keys, events) = live.shared.counter_pending(i);
            let mut hottest: Vec<&HotKey> = peeks
                .iter()
                .flat_map(|(_, p)| &p.hottest)
                .filter(|h| h.counter as usize == i)
                .collect();
            hottest.sort_by(|a, b| b.events.cmp(&a.events).then_with(|| a.key.cmp(&b.key)));
            hottest.truncate(top);
            CounterStatus {
                name: info.name.clone(),
                pending_keys: keys as u64,
                pending_events: events,
                hottest: hottest
                    .into_iter()
                    .map(|h| HotKeyStatus {
                        key: h.key.to_string(),
                        events: h.events,
                        sum: h.sum,
                    })
                    .collect(),
            }
        })
        .collect()
}

/// Per database, the age of its oldest uncommitted event: in a flight being written, or
/// waiting in one of its buckets.
fn lags(live: &Attached, peeks: &[(usize, Peek)]) -> Vec<Option<Duration>> {
    let layout = &live.layout;
    let mut lags = vec![None; layout.databases()];
    let mut older = |database: usize, age: Duration| {
        if let Some(lag) = lags.get_mut(database) {
            *lag = Some(lag.map_or(age, |l: Duration| l.max(age)));
        }
    };
    for (worker, age) in live.shared.flight_ages().enumerate() {
        if !age.is_zero() {
            older(worker / layout.workers, age);
        }
    }
    for (bucket, peek) in peeks {
        if let Some(since) = peek.since {
            older(layout.worker_of(*bucket) / layout.workers, since.elapsed());
        }
    }
    lags
}

fn journal(journal: &Journal) -> JournalStatus {
    let usage = journal.usage();
    JournalStatus {
        bytes: usage.bytes,
        segments: usage.segments,
        oldest_segment_age_seconds: usage
            .oldest_ms
            .map(|ms| (now_ms() - ms).max(0) as f64 / 1000.0),
        writable: journal.writable(),
        max_bytes: usage.max_bytes,
        used: usage.bytes as f64 / usage.max_bytes.max(1) as f64,
    }
}
