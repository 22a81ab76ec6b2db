//! What tallyd says about itself while it runs: readiness (`/readyz`) and the status view
//! (`/status`, `tallyd status`). [`Health`] is written by the parts of the daemon as things
//! happen (a phase change, a commit, a failed flush, a rollup's figure) and read by the HTTP
//! endpoints; gathering a [`Status`] reads atomics and asks each bucket, without waiting for
//! room in its queue, for a bounded look at its keys. Nothing here can slow ingest down.
//! docs/operations.md ("Health endpoints", "Status") documents every field.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::bucket::{BucketHandle, HotKey, Peek};
use crate::flush::CounterInfo;
use crate::journal::Journal;
use crate::routing::Layout;
use crate::shared::Shared;

mod table;

/// Keys a bucket looks at for one status request: bounds its cost (a few hundred microseconds)
/// however many keys are pending. Beyond it the hottest keys are those of a sample.
const PEEK_LIMIT: usize = 65_536;
/// How long a status request waits for the buckets' answers before reporting without them.
const PEEK_WAIT: Duration = Duration::from_millis(500);

/// Where the daemon is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Connecting to the databases, migrating, claiming the lease, reading the journal.
    Starting = 0,
    /// Replaying the journal of an earlier run; the sockets do not accept yet.
    Replaying = 1,
    /// Accepting on the sockets.
    Serving = 2,
    /// Stopping: the sockets are closed, the final flush runs.
    Stopping = 3,
}

impl Phase {
    fn from_u8(v: u8) -> Phase {
        match v {
            0 => Phase::Starting,
            1 => Phase::Replaying,
            2 => Phase::Serving,
            _ => Phase::Stopping,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Starting => "starting",
            Phase::Replaying => "replaying",
            Phase::Serving => "serving",
            Phase::Stopping => "stopping",
        }
    }
}

/// One database as tallyd last saw it. Two sources, kept apart so that neither hides the
/// other: whether it answers (the lease heartbeat every third of `instance_lease_ms`, the
/// rollup's connection), and whether flushes into it fail (set by a failed try, cleared by the
/// next commit; a lock timeout fails flushes of a database that answers).
#[derive(Debug)]
struct DbHealth {
    /// 0: not yet known, 1: answers, 2: does not.
    reachable: AtomicU8,
    unreachable_cause: Mutex<String>,
    flush_failing: AtomicBool,
    flush_cause: Mutex<String>,
    /// The most recent error from either source.
    last_error: Mutex<Option<String>>,
    /// Unix ms of the last commit of a flush (0: none yet).
    last_flush_ms: AtomicI64,
    retries: AtomicU64,
    /// Slot rows waiting for the rollup, as its last run counted them (-1: not yet known).
    slot_rows: AtomicI64,
}

impl Default for DbHealth {
    fn default() -> DbHealth {
        DbHealth {
            reachable: AtomicU8::new(0),
            unreachable_cause: Mutex::new(String::new()),
            flush_failing: AtomicBool::new(false),
            flush_cause: Mutex::new(String::new()),
            last_error: Mutex::new(None),
            last_flush_ms: AtomicI64::new(0),
            retries: AtomicU64::new(0),
            slot_rows: AtomicI64::new(-1),
        }
    }
}

impl DbHealth {
    fn set_error(&self, cause: &Mutex<String>, text: String) {
        *cause.lock().expect("cause") = text.clone();
        *self.last_error.lock().expect("last_error") = Some(text);
    }

    /// None before anything is known; else whether it answers and flushes into it work.
    fn up(&self) -> Option<bool> {
        let failing = self.flush_failing.load(Ordering::Relaxed);
        match self.reachable.load(Ordering::Relaxed) {
            0 if !failing => None,
            r => Some(r != 2 && !failing),
        }
    }

    /// Why it is not up, one reason per source.
    fn reasons(&self, index: usize) -> impl Iterator<Item = String> {
        let unreachable = (self.reachable.load(Ordering::Relaxed) == 2).then(|| {
            let cause = self.unreachable_cause.lock().expect("cause");
            format!("database {index} unreachable: {cause}")
        });
        let failing = self.flush_failing.load(Ordering::Relaxed).then(|| {
            let cause = self.flush_cause.lock().expect("cause");
            format!("database {index} flushes failing: {cause}")
        });
        unreachable.into_iter().chain(failing)
    }
}

/// What the running pipeline exposes to the status view, attached once it has started.
pub(crate) struct Attached {
    pub shared: Arc<Shared>,
    pub buckets: Vec<BucketHandle>,
    pub layout: Layout,
    pub journal: Option<Arc<Journal>>,
    /// The counter table (a reload adds to it; a removed counter stays, retired, while its
    /// events are pending).
    pub counters: Arc<crate::live::Live<Vec<CounterInfo>>>,
}

/// The daemon's health, shared by the parts that change it and the endpoints that report it.
pub struct Health {
    phase: AtomicU8,
    started: Instant,
    databases: Box<[DbHealth]>,
    /// How the status view names each database (never with a password), once connected.
    names: OnceLock<Vec<String>>,
    /// Hottest keys per counter in the status view (0: keys are not shown).
    top_keys: usize,
    live: OnceLock<Attached>,
}

impl Health {
    /// `databases`: how many the config names; `top_keys`: `metrics.status_top_keys`.
    pub fn new(databases: usize, top_keys: usize) -> Arc<Health> {
        Arc::new(Health {
            phase: AtomicU8::new(Phase::Starting as u8),
            started: Instant::now(),
            databases: (0..databases).map(|_| DbHealth::default()).collect(),
            names: OnceLock::new(),
            top_keys,
            live: OnceLock::new(),
        })
    }

    /// For a daemon run without status reporting (tests that call `daemon::run` directly).
    pub fn detached() -> Arc<Health> {
        Health::new(0, 0)
    }

    pub fn set_phase(&self, phase: Phase) {
        self.phase.store(phase as u8, Ordering::SeqCst);
    }

    pub fn phase(&self) -> Phase {
        Phase::from_u8(self.phase.load(Ordering::SeqCst))
    }

    /// The databases' names as messages give them (hosts, port, database, user), map order.
    pub fn name_databases(&self, names: Vec<String>) {
        let _ = self.names.set(names);
    }

    pub(crate) fn attach(&self, live: Attached) {
        let _ = self.live.set(live);
    }

    /// Database `index` answered (a lease renewal, a rollup connection, the start's checks).
    pub fn reachable(&self, index: usize) {
        if let Some(db) = self.databases.get(index) {
            db.reachable.store(1, Ordering::Relaxed);
        }
    }

    /// Database `index` could not be reached, or a round trip to it failed, with `cause`.
    pub fn unreachable(&self, index: usize, cause: &dyn std::fmt::Display) {
        if let Some(db) = self.databases.get(index) {
            db.set_error(&db.unreachable_cause, cause.to_string());
            db.reachable.store(2, Ordering::Relaxed);
        }
    }

    /// A try of a flush into database `index` failed with `cause`.
    pub fn flush_failed(&self, index: usize, cause: &dyn std::fmt::Display) {
        if let Some(db) = self.databases.get(index) {
            db.set_error(&db.flush_cause, cause.to_string());
            db.flush_failing.store(true, Ordering::Relaxed);
        }
    }

    /// A flush into database `index` committed: it answers, and its flushes work.
    pub fn flushed(&self, index: usize) {
        if let Some(db) = self.databases.get(index) {
            db.last_flush_ms.store(unix_ms(), Ordering::Relaxed);
            db.flush_failing.store(false, Ordering::Relaxed);
            db.reachable.store(1, Ordering::Relaxed);
        }
    }

    /// A flush into database `index` is being tried again.
    pub fn flush_retry(&self, index: usize) {
        if let Some(db) = self.databases.get(index) {
            db.retries.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The rollup of database `index` counted `rows` slot rows waiting.
    pub fn slot_rows(&self, index: usize, rows: i64) {
        if let Some(db) = self.databases.get(index) {
            db.slot_rows.store(rows, Ordering::Relaxed);
        }
    }

    /// Ready: accepting on the sockets, the journal replayed, every database reachable, the
    /// journal writable. Otherwise the reasons, each a short sentence.
    pub fn readiness(&self) -> Readiness {
        let mut reasons = Vec::new();
        match self.phase() {
            Phase::Starting => reasons.push("starting".to_string()),
            Phase::Replaying => reasons.push("replaying journal".to_string()),
            Phase::Serving => {}
            Phase::Stopping => reasons.push("stopping".to_string()),
        }
        for (index, db) in self.databases.iter().enumerate() {
            reasons.extend(db.reasons(index));
        }
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
    /// `hottest_complete` says so).
    pub async fn status(&self) -> Status {
        let readiness = self.readiness();
        let mut status = Status {
            version: env!("CARGO_PKG_VERSION").to_string(),
            phase: self.phase().as_str().to_string(),
            ready: readiness.ready,
            reasons: readiness.reasons,
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            connections_open: 0,
            memory: None,
            counters: Vec::new(),
            hottest_shown: self.top_keys > 0,
            hottest_complete: true,
            databases: Vec::new(),
            journal: None,
        };
        let Some(live) = self.live.get() else {
            // Starting: no pipeline yet, only the databases' state.
            status.databases = self.databases(&[]);
            return status;
        };
        let peeks = self.peek(live).await;
        status.hottest_complete =
            peeks.len() == live.buckets.len() && peeks.iter().all(|(_, p)| p.complete);
        status.connections_open = live.shared.connections_open() as u64;
        status.memory = Some(memory(&live.shared));
        status.counters = counters(live, &peeks, self.top_keys);
        status.journal = live.journal.as_ref().map(|j| journal(j));
        status.databases = self.databases(&lags(live, &peeks));
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

    fn databases(&self, lags: &[Option<Duration>]) -> Vec<DbStatus> {
        let now = unix_ms();
        self.databases
            .iter()
            .enumerate()
            .map(|(index, db)| {
                let last_flush = db.last_flush_ms.load(Ordering::Relaxed);
                let slot_rows = db.slot_rows.load(Ordering::Relaxed);
                DbStatus {
                    index,
                    name: self
                        .names
                        .get()
                        .and_then(|n| n.get(index))
                        .cloned()
                        .unwrap_or_default(),
                    up: db.up(),
                    last_error: db.last_error.lock().expect("last_error").clone(),
                    last_flush_unix_ms: (last_flush > 0).then_some(last_flush),
                    last_flush_age_seconds: (last_flush > 0)
                        .then(|| (now - last_flush).max(0) as f64 / 1000.0),
                    flush_lag_seconds: lags.get(index).copied().flatten().map(|d| d.as_secs_f64()),
                    retries: db.retries.load(Ordering::Relaxed),
                    slot_rows: (slot_rows >= 0).then_some(slot_rows),
                }
            })
            .collect()
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
pub struct DbStatus {
    pub index: usize,
    pub name: String,
    /// None until the first round trip.
    pub up: Option<bool>,
    pub last_error: Option<String>,
    pub last_flush_unix_ms: Option<i64>,
    pub last_flush_age_seconds: Option<f64>,
    /// Age of the oldest event bound for this database not yet committed; None when none is
    /// pending.
    pub flush_lag_seconds: Option<f64>,
    pub retries: u64,
    /// Slot rows waiting for the rollup, from its last run; None before it (or without one).
    pub slot_rows: Option<i64>,
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
            .map(|ms| (unix_ms() - ms).max(0) as f64 / 1000.0),
        writable: journal.writable(),
        max_bytes: usage.max_bytes,
        used: usage.bytes as f64 / usage.max_bytes.max(1) as f64,
    }
}

fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
