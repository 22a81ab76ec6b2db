//! The daemon's health as its parts see it happen: the phase of its life, and per database
//! whether it answers and whether flushes into it work. Written by the daemon, the flush
//! workers, the rollups and the lease heartbeat; read by the status view ([`crate::status`]).
//! A leaf: it imports nothing of the pipeline, so every part may report into it.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::clock::now_ms;

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

/// The daemon's health, shared by the parts that change it and the status view that reports it.
pub struct Health {
    phase: AtomicU8,
    started: Instant,
    databases: Box<[DbHealth]>,
    /// How the status view names each database (never with a password), once connected.
    names: OnceLock<Vec<String>>,
}

impl Health {
    /// `databases`: how many the config names.
    pub fn new(databases: usize) -> Arc<Health> {
        Arc::new(Health {
            phase: AtomicU8::new(Phase::Starting as u8),
            started: Instant::now(),
            databases: (0..databases).map(|_| DbHealth::default()).collect(),
            names: OnceLock::new(),
        })
    }

    /// For a daemon run without status reporting (tests that call `daemon::run` directly).
    pub fn detached() -> Arc<Health> {
        Health::new(0)
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
            db.last_flush_ms.store(now_ms(), Ordering::Relaxed);
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

    /// Why tallyd is not ready as far as its phase and its databases tell, each a short
    /// sentence (none: ready, as far as they go).
    pub fn reasons(&self) -> Vec<String> {
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
        reasons
    }

    /// How long since the daemon started.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// Every database as last seen, with `lags[index]`: the age of its oldest uncommitted
    /// event, as the pipeline knows it.
    pub fn databases(&self, lags: &[Option<Duration>]) -> Vec<DbStatus> {
        let now = now_ms();
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
