//! Idempotent batches (docs/protocol.md, "Batches"): a connection's batch is kept whole until
//! `!commit`, then written as a held payload ([`held`]), claimed under its id in every
//! database its keys route to ([`claim`]), and only then routed, as one journal record that
//! names the payload, to the buckets, where its events coalesce with every other event. The
//! claim, not the flush, is what makes a second copy count nothing; the held payload and the
//! record that names it are what make a crash at any point count the first copy once
//! (docs/reliability.md, "Batches").

mod claim;
mod held;

use std::collections::HashSet;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{counter, gauge};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{Config, FsyncMode};
use crate::ingest::{Ingest, Router};
use crate::journal::{self, Journal, JournalError, OldSegment};
use crate::metrics as m;
use crate::routing;
use crate::store::Db;
use crate::throttle::Throttle;

/// How long `!commit` waits for the claims before it answers `ok` without knowing whether
/// this copy or another counts (the batch is durable; the claim goes on in the background).
const CLAIM_WAIT: Duration = Duration::from_secs(2);

/// The first line of a batch's routed record: `!batch <payload>`. Replay routes nothing of it
/// (it has no key); the start reads it to know the payload is settled.
const MARKER: &[u8] = b"!batch ";

/// What `!commit` answers when the batch is durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// This copy counts (or is not decided yet: the database did not answer in time).
    Counted,
    /// Every database's claim names another copy: nothing of this one counts.
    Duplicate,
}

/// What a `!commit` came to: durable, with its answer and a receiver told when the batch is
/// settled; or why it could not be written (nothing of it counts).
pub type Committed = Result<(Answer, oneshot::Receiver<()>), String>;

/// The batches of one running daemon: the held payloads, the claim task per database and the
/// router that routes claimed batches.
pub struct Batches {
    dir: PathBuf,
    fsync: bool,
    /// `batch.max_bytes`.
    pub max_bytes: usize,
    last_payload: Mutex<u64>,
    claimers: Vec<claim::Claimer>,
    ingest: Arc<Ingest>,
    journal: Arc<Journal>,
    /// Claimed batches are routed by one of these (by payload), so that batches claimed
    /// together are routed side by side.
    routers: Vec<tokio::sync::Mutex<Router>>,
    /// Held payloads not settled yet.
    held: AtomicU64,
    /// `!commit`s begun ([`Batches::begin_commit`]) whose payload is not written yet.
    committing: Arc<AtomicU64>,
    duplicates: Throttle,
}

/// What the status view shows of batches.
#[derive(Debug, Clone, Copy)]
pub struct Status {
    /// Claims remembered in every database together (None until each was counted once).
    pub remembered: Option<i64>,
    /// Unix ms of the oldest claim remembered.
    pub oldest_ms: Option<i64>,
    /// Committed batches not yet routed or dropped (held in `data_dir/batches`).
    pub held: u64,
}

/// The payloads whose routed record is in these (old) segments: settled, whatever else
/// happened to them. Reads the head of each record (its first line names the payload).
pub fn settled_payloads(segments: &[OldSegment]) -> Result<HashSet<u64>, JournalError> {
    let mut reader = journal::Reader::new(segments);
    let mut settled = HashSet::new();
    for (i, seg) in segments.iter().enumerate() {
        for j in 0..seg.records.len() {
            // The marker and a payload number (at most 20 digits) and its newline.
            let head = reader.head(i, j, MARKER.len() + 21)?;
            let first = journal::lines(&head).next();
            let payload: Option<u64> = first
                .and_then(|f| f.strip_prefix(MARKER))
                .and_then(|p| std::str::from_utf8(p).ok()?.parse().ok());
            settled.extend(payload);
        }
    }
    Ok(settled)
}

/// Deletes the held files of `settled` payloads (see [`settled_payloads`]) in
/// `data_dir/batches`, if any.
pub fn forget_settled(data_dir: &Path, settled: &HashSet<u64>) -> io::Result<()> {
    let dir = data_dir.join("batches");
    if settled.is_empty() || !dir.is_dir() {
        return Ok(());
    }
    for payload in settled {
        held::remove(&dir, *payload)?;
    }
    Ok(())
}

impl Batches {
    /// Starts the claim tasks (one per database, until `stop`). Payloads held by an earlier run
    /// are taken up by [`Batches::recover`].
    pub fn start(
        config: &Config,
        dbs: &[Db],
        instance_id: &str,
        ingest: Arc<Ingest>,
        journal: Arc<Journal>,
        stop: &CancellationToken,
    ) -> io::Result<Arc<Batches>> {
        let dir = config.daemon.data_dir.join("batches");
        // Owner-only, like data_dir and the journal, whatever the umask.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)?;
        let claimers = (dbs.iter().enumerate())
            .map(|(i, db)| {
                let (id, days) = (instance_id.to_string(), config.batch.remember_days);
                claim::Claimer::spawn(db.clone(), i, id, days, stop.child_token())
            })
            .collect();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let routers = (0..threads.clamp(1, 8))
            .map(|_| tokio::sync::Mutex::new(Router::for_journal(&ingest)))
            .collect();
        Ok(Arc::new(Batches {
            dir,
            fsync: config.journal.fsync != FsyncMode::Off,
            max_bytes: config.batch.max_bytes as usize,
            last_payload: Mutex::new(0),
            claimers,
            ingest,
            journal,
            routers,
            held: AtomicU64::new(0),
            committing: Arc::new(AtomicU64::new(0)),
            duplicates: Throttle::new(10_000),
        }))
    }

    /// Payloads an earlier run held and did not settle (those whose routed record the old
    /// journal holds are gone already: [`forget_settled`]) are claimed and routed or dropped as
    /// at their `!commit`, in the background.
    pub fn recover(self: &Arc<Self>) -> io::Result<()> {
        let mut taken = 0;
        for h in held::read_all(&self.dir)? {
            self.note_payload(h.payload);
            taken += 1;
            self.held.fetch_add(1, Ordering::Relaxed);
            let this = self.clone();
            tokio::spawn(async move { this.settle(h.payload, h.id, h.lines, None).await });
        }
        if taken > 0 {
            info!(
                batches = taken,
                "committed batches from before the restart are being claimed"
            );
        }
        self.report();
        Ok(())
    }

    fn note_payload(&self, payload: u64) {
        let mut last = self.last_payload.lock().expect("batch payloads");
        *last = (*last).max(payload);
    }

    /// A new payload number: above every earlier one (of this run, and on disk at the start)
    /// and, across restarts, above the previous run's (microseconds since the epoch).
    fn next_payload(&self) -> u64 {
        let mut last = self.last_payload.lock().expect("batch payloads");
        let now_us = (crate::clock::now_seconds() * 1e6) as u64;
        *last = (*last + 1).max(now_us);
        *last
    }

    /// [`Batches::commit`] in a task of its own, so the connection reads on meanwhile; a stop
    /// waits for it ([`Batches::wait_settled`]) as for the batches already held.
    pub fn begin_commit(
        self: &Arc<Self>,
        id: String,
        lines: Vec<u8>,
    ) -> tokio::task::JoinHandle<Committed> {
        /// Counts the commit until its task ends, however it ends.
        struct Begun(Arc<AtomicU64>);
        impl Drop for Begun {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.committing.fetch_add(1, Ordering::SeqCst);
        let begun = Begun(self.committing.clone());
        let this = self.clone();
        tokio::spawn(async move {
            let _begun = begun;
            this.commit(id, lines).await
        })
    }

    /// `!commit` of `lines` under `id`: durable once this returns Ok; then claimed, routed or
    /// dropped, which the returned receiver tells (dropped unanswered if the daemon stops
    /// first). Err: the payload could not be written (nothing of the batch counts).
    pub async fn commit(self: &Arc<Self>, id: String, lines: Vec<u8>) -> Committed {
        let payload = self.next_payload();
        let (dir, fsync) = (self.dir.clone(), self.fsync);
        let written = tokio::task::spawn_blocking(move || {
            held::write(&dir, payload, &id, &lines, fsync).map(|()| (id, lines))
        })
        .await
        .map_err(|e| e.to_string())?;
        let (id, lines) = written
            .map_err(|e| format!("cannot write the batch to {}: {e}", self.dir.display()))?;
        self.held.fetch_add(1, Ordering::Relaxed);
        self.report();
        let (decided, answer) = oneshot::channel();
        let (settled, settling) = oneshot::channel();
        let this = self.clone();
        tokio::spawn(async move {
            this.settle(payload, id, lines, Some(decided)).await;
            let _ = settled.send(());
        });
        let answer = match tokio::time::timeout(CLAIM_WAIT, answer).await {
            Ok(Ok(Answer::Duplicate)) => Answer::Duplicate,
            _ => Answer::Counted,
        };
        Ok((answer, settling))
    }

    /// Waits until the events of every batch routed so far are committed (for a `!flush`
    /// after `!commit`, whose batch was routed by [`Batches::settle`], not by the connection).
    pub async fn flush_routed(&self) {
        let flushes = self.routers.iter().map(|router| async move {
            router.lock().await.flush(&self.ingest).await;
        });
        futures_util::future::join_all(flushes).await;
    }

    /// At a stop: waits until no `!commit` is being written and no batch is held (each claimed
    /// and routed or dropped) or
    /// `within` has passed; what is still held then is taken up by the next start.
    pub async fn wait_settled(&self, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        let busy =
            || self.held.load(Ordering::SeqCst) > 0 || self.committing.load(Ordering::SeqCst) > 0;
        while busy() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Claims payload `payload` in each database its lines route to, routes the parts whose
    /// claim names it (one journal record; no flush commits its events before it is durable),
    /// and deletes the held file once that record is durable. The journal keeps every segment
    /// from before the record until the file is gone (see [`Journal::pin`]).
    async fn settle(
        self: Arc<Self>,
        payload: u64,
        id: String,
        lines: Vec<u8>,
        decided: Option<oneshot::Sender<Answer>>,
    ) {
        let parts = self.by_database(lines);
        let claims = parts
            .iter()
            .map(|(db, _)| self.claimers[*db].claim(&id, payload));
        let Some(mine) = futures_util::future::join_all(claims)
            .await
            .into_iter()
            .collect::<Option<Vec<bool>>>()
        else {
            // Stopping: the payload stays held for the next start.
            return;
        };
        let counts = mine.iter().any(|&m| m);
        if let Some(decided) = decided {
            let _ = decided.send(if counts {
                Answer::Counted
            } else {
                Answer::Duplicate
            });
        }
        if counts {
            // While the journal cannot be written, a routed record would wait in memory and
            // hold back every flush drained after it (`Journal::durable_below`): the batch
            // waits held instead.
            while !self.journal.writable() {
                tokio::time::sleep(journal::RETRY_EVERY).await;
            }
        }
        let pin = counts.then(|| self.journal.pin());
        if counts {
            let mut record = MARKER.to_vec();
            record.extend_from_slice(payload.to_string().as_bytes());
            record.push(b'\n');
            let n = self.routers.len();
            let seq = {
                let mut router = self.routers[(payload % n as u64) as usize].lock().await;
                router.now_ms = crate::clock::now_ms();
                for ((_, part), _) in parts.iter().zip(&mine).filter(|(_, &m)| m) {
                    for line in journal::lines(part) {
                        router.line(&self.ingest, Ok(line));
                    }
                    record.extend_from_slice(part);
                }
                router
                    .send_batch_record(&self.ingest, &self.journal, record)
                    .await
            };
            // The held file goes only once the routed record is durable: deleted before, a
            // crash could lose the record (still in the writer's queue or buffer, or failed)
            // and the file with it, and the batch, acknowledged, would count nowhere (its
            // events commit only after the record is durable, `Journal::durable_below`). The
            // router is free meanwhile; the waits of batches routed together share one sync.
            let mut logged = false;
            while let Err(cause) = self.journal.wait_durable(seq).await {
                if !std::mem::replace(&mut logged, true) {
                    warn!(payload, %cause, "a routed batch stays held until its journal record is written");
                }
                tokio::time::sleep(journal::RETRY_EVERY).await;
            }
        }
        let outcome = match (counts, mine.iter().all(|&m| m)) {
            (true, true) => "counted",
            (true, false) => "counted_in_part",
            (false, _) => "duplicate",
        };
        counter!(m::BATCHES, "outcome" => outcome).increment(1);
        if !counts {
            if let Some(suppressed) = self.duplicates.allow() {
                info!(id = %id, suppressed, "a batch id already claimed by another copy: this copy is dropped");
            }
        }
        match held::remove(&self.dir, payload) {
            Ok(()) => {
                if let Some(pin) = pin {
                    self.journal.unpin(pin);
                }
            }
            // The pin stays: the routed record must outlive the file, or a restart would
            // route the payload again.
            Err(e) => warn!(payload, cause = %e, "cannot delete a settled batch payload"),
        }
        self.held.fetch_sub(1, Ordering::Relaxed);
        self.report();
    }

    /// The payload's lines split by the database their keys route to, in database order; a
    /// payload without lines is claimed in the first database (so its copies are told
    /// `duplicate` too).
    fn by_database(&self, lines: Vec<u8>) -> Vec<(usize, Vec<u8>)> {
        let layout = &self.ingest.layout;
        if layout.databases() <= 1 {
            // One database: every line is its (nothing to parse).
            return vec![(0, lines)];
        }
        let mut parts: Vec<Vec<u8>> = vec![Vec::new(); layout.databases().max(1)];
        for line in journal::lines(&lines) {
            let db = journal::parse_line(line).map_or(0, |(counter, key)| {
                let seed = routing::counter_seed(&String::from_utf8_lossy(counter));
                layout.database(routing::key_hash(seed, key))
            });
            parts[db].extend_from_slice(line);
            parts[db].push(b'\n');
        }
        let mut parts: Vec<(usize, Vec<u8>)> = parts
            .into_iter()
            .enumerate()
            .filter(|(_, p)| !p.is_empty())
            .collect();
        if parts.is_empty() {
            parts.push((0, Vec::new()));
        }
        parts
    }

    fn report(&self) {
        gauge!(m::BATCHES_HELD).set(self.held.load(Ordering::Relaxed) as f64);
    }

    pub fn status(&self) -> Status {
        let mut remembered = Some(0);
        let mut oldest: Option<i64> = None;
        for c in &self.claimers {
            let n = c.remembered.count.load(Ordering::Relaxed);
            remembered = remembered.and_then(|r| (n >= 0).then_some(r + n));
            let o = c.remembered.oldest_ms.load(Ordering::Relaxed);
            if o > 0 {
                oldest = Some(oldest.map_or(o, |x| x.min(o)));
            }
        }
        Status {
            remembered,
            oldest_ms: oldest,
            held: self.held.load(Ordering::Relaxed),
        }
    }
}
