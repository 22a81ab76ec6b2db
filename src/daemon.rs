//! The daemon's lifecycle: start the database (private or external), wire listeners, buckets and
//! flush workers together, and stop them in order so that nothing accepted is lost.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::types::Type;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::bucket::BucketHandle;
use crate::config::{Config, DatabaseConfig};
use crate::flush::{CounterInfo, FlushContext, FlushWorker, WriterId};
use crate::journal::{self, Journal, JournalError, OldSegment};
use crate::listener::{self, Ingest, ListenError, Listeners};
use crate::rollup::Rollup;
use crate::routing;
use crate::shared::Shared;
use crate::store::embedded::{Embedded, EmbeddedError, EmbeddedOptions, PORT};
use crate::store::lease::Lease;
use crate::store::{self, Db, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Listen(#[from] ListenError),
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error(transparent)]
    Move(#[from] store::moves::MoveError),
    #[error(transparent)]
    Lease(#[from] store::lease::LeaseError),
    #[error("another tallyd is running on this data_dir ({dir})")]
    Locked { dir: std::path::PathBuf },
    #[error("daemon.data_dir {dir} exists and is not a directory")]
    NotADirectory { dir: std::path::PathBuf },
    #[error(
        "{dir} holds journal segments not yet replayed, but [journal] enabled = false: enable \
         the journal to replay them, or delete the directory to discard those events"
    )]
    Unreplayed { dir: std::path::PathBuf },
    #[error("{what} {path}: {cause}")]
    Io {
        what: &'static str,
        path: std::path::PathBuf,
        cause: std::io::Error,
    },
}

/// The databases tallyd writes to (one, or one per `[database] shards` entry, in map order), and
/// the private clusters it runs.
pub struct Database {
    pub dbs: Vec<Db>,
    pub embedded: Vec<Embedded>,
}

/// Where the private cluster of database `index` lives: `data_dir/postgres` with one database,
/// `data_dir/postgres-<index>` with shards.
fn embedded_dir(config: &Config, index: usize) -> std::path::PathBuf {
    if config.database.shards.is_empty() {
        config.daemon.data_dir.join("postgres")
    } else {
        config.daemon.data_dir.join(format!("postgres-{index}"))
    }
}

impl Database {
    /// Starts a private cluster for every database given as `embedded`, and parses the URLs of
    /// the others. Blocking: call from `spawn_blocking` or before the runtime is busy.
    pub fn open(config: &Config) -> Result<Database, DaemonError> {
        let timeout = Duration::from_millis(config.database.connect_timeout_ms);
        let mut opened = Database {
            dbs: Vec::new(),
            embedded: Vec::new(),
        };
        for (index, entry) in config.database.databases().into_iter().enumerate() {
            if entry != DatabaseConfig::EMBEDDED {
                opened.dbs.push(Db::new(entry, timeout)?);
                continue;
            }
            let mut settings: Vec<(String, String)> = config
                .database
                .embedded_settings
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            // Moving shards commits in two phases.
            if !settings
                .iter()
                .any(|(k, _)| k == "max_prepared_transactions")
            {
                settings.push(("max_prepared_transactions".into(), "16".into()));
            }
            let options = EmbeddedOptions {
                dir: embedded_dir(config, index),
                settings,
                bin_dir: None,
            };
            let embedded = match Embedded::start(&options) {
                Err(EmbeddedError::AlreadyRunning { .. }) => {
                    // We hold the data_dir lock, so no tallyd owns that server: it outlived a
                    // tallyd that was killed. Stop it and start our own.
                    stop_orphan(&options.dir.join("pgdata"));
                    Embedded::start(&options)
                }
                other => other,
            }
            .map_err(StoreError::from)?;
            info!(database = index, socket_dir = %embedded.socket_dir().display(), "private PostgreSQL started");
            opened
                .dbs
                .push(Db::new(&embedded.connection_string("postgres"), timeout)?);
            opened.embedded.push(embedded);
        }
        Ok(opened)
    }

    /// Connects without starting anything: private clusters must already run (for the CLI).
    pub fn connect_only(config: &Config) -> Result<Vec<Db>, DaemonError> {
        let timeout = Duration::from_millis(config.database.connect_timeout_ms);
        let mut dbs = Vec::new();
        for (index, entry) in config.database.databases().into_iter().enumerate() {
            let conninfo = if entry == DatabaseConfig::EMBEDDED {
                let dir = embedded_dir(config, index).join("pgsocket");
                let dir = std::path::absolute(&dir).map_err(|cause| DaemonError::Io {
                    what: "cannot resolve",
                    path: dir.clone(),
                    cause,
                })?;
                crate::store::embedded::socket_connection_string(&dir, PORT, "postgres")
            } else {
                entry.to_string()
            };
            dbs.push(Db::new(&conninfo, timeout)?);
        }
        Ok(dbs)
    }

    pub fn stop(self) {
        for embedded in self.embedded {
            match embedded.stop() {
                Ok(()) => info!("private PostgreSQL stopped"),
                Err(err) => warn!(cause = %err, "private PostgreSQL did not stop cleanly"),
            }
        }
    }
}

/// This instance's id: from config, else the one kept in `data_dir/instance_id`, else a new one.
pub fn instance_id(config: &Config) -> Result<String, DaemonError> {
    if !config.daemon.instance_id.is_empty() {
        return Ok(config.daemon.instance_id.clone());
    }
    let path = config.daemon.data_dir.join("instance_id");
    let io = |what, cause| DaemonError::Io {
        what,
        path: path.clone(),
        cause,
    };
    match std::fs::read_to_string(&path) {
        Ok(id) if !id.trim().is_empty() => return Ok(id.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("cannot read", e)),
    }
    let id = format!("{:016x}", rand::random::<u64>());
    std::fs::create_dir_all(&config.daemon.data_dir)
        .map_err(|e| io("cannot create data_dir for", e))?;
    write_atomically(&path, id.as_bytes()).map_err(|e| io("cannot write", e))?;
    Ok(id)
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::File::open(&tmp)?.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// Runs until `shutdown` is cancelled, then stops in order: listeners and connections first, so
/// that every accepted event reaches a bucket; then a final flush of everything; then returns.
/// `dbs` are the databases in map order (one without shards). The caller owns them (and stops
/// private clusters after this returns).
pub async fn run(
    config: Arc<Config>,
    listeners: Listeners,
    dbs: Vec<Db>,
    shutdown: CancellationToken,
) -> Result<(), DaemonError> {
    // So that a DBA sees whose sessions these are in pg_stat_activity.
    let name = format!("tallyd-{}", instance_id(&config)?);
    let dbs: Vec<Db> = dbs
        .into_iter()
        .map(|db| db.default_application_name(&name))
        .collect();
    if config.database.migrate {
        for db in &dbs {
            store::prepare_db(db, &config).await?;
        }
    }
    // Before moves, replay and any flush: one live tallyd per instance id.
    let instance_id = instance_id(&config)?;
    let lease = Arc::new(Lease::new(
        &instance_id,
        &config.daemon.data_dir,
        config.daemon.instance_lease_ms,
    )?);
    lease.claim(&dbs).await?;
    if !config.database.move_shards {
        store::check_map(&dbs, &config.layout()).await?;
    } else {
        // Before any flush: nothing writes a shard while it moves.
        let moved = store::moves::settle(&dbs, &config.layout()).await?;
        if !moved.is_empty() {
            info!(
                shards = moved.len(),
                "logical shards moved to their databases"
            );
        }
    }
    // Every database answered above.
    for index in 0..dbs.len() {
        crate::metrics::database_up(index, true);
    }
    let layout = config.layout();
    let workers = layout.total_workers();
    let slot_base = match config.flush.slot_offset {
        -1 => crate::routing::counter_seed(&instance_id) % 1_000_003,
        n => n as u64,
    };
    info!(%instance_id, slot_base, databases = dbs.len(), workers, buckets = layout.total_buckets(), "tallyd starting");

    let shared = Arc::new(Shared::new(
        workers,
        config.flush.max_pending_keys,
        config.coalesce.max_pending_keys,
    ));
    let buckets: Vec<BucketHandle> = (0..layout.total_buckets())
        .map(|b| {
            BucketHandle::spawn(
                b,
                config.coalesce.queue_batches,
                layout.worker_of(b),
                shared.clone(),
            )
        })
        .collect();

    // Old journal segments (from a crash, or a stop that could not flush) are read now, before
    // new records are written, and replayed once the pipeline runs.
    let journal_dir = config.daemon.data_dir.join("journal");
    let old_segments = journal::read_segments(&journal_dir, &layout)?.segments;
    let covered = journal_coverage(&dbs, &lease).await?;
    if !config.journal.enabled && !old_segments.is_empty() {
        return Err(DaemonError::Unreplayed { dir: journal_dir });
    }
    let journal = if config.journal.enabled {
        let newest = old_segments
            .iter()
            .flat_map(|s| s.records.iter().map(|r| r.0))
            .chain(covered.values().map(|&c| c as u64))
            .max()
            .unwrap_or(0);
        Some(Arc::new(Journal::open(
            &config.journal,
            &journal_dir,
            newest + 1,
            &layout,
        )?))
    } else {
        None
    };

    let abandon = CancellationToken::new();
    let context = |database: usize, db: &Db| FlushContext {
        db: db.clone().with_timeouts(
            config.flush.lock_timeout_ms,
            config.flush.statement_timeout_ms,
        ),
        database,
        config: config.flush.clone(),
        counters: config
            .counters
            .iter()
            .map(|c| CounterInfo {
                name: c.name.clone(),
                slots: c.slots,
            })
            .collect(),
        writer: WriterId {
            instance_id: instance_id.clone(),
            slot_base,
            owner: lease.owner.clone(),
        },
        shared: shared.clone(),
        abandon: abandon.clone(),
        journal: journal.clone(),
    };
    let contexts: Vec<Arc<FlushContext>> = dbs
        .iter()
        .enumerate()
        .map(|(i, db)| Arc::new(context(i, db)))
        .collect();
    let flush_stop = CancellationToken::new();
    let flushers = TaskTracker::new();
    for w in 0..workers {
        let mine = (0..buckets.len())
            .filter(|&b| layout.worker_of(b) == w)
            .map(|b| buckets[b].clone())
            .collect();
        let ctx = contexts[w / layout.workers].clone();
        flushers.spawn(FlushWorker::new(w, mine, ctx).run(flush_stop.clone()));
    }
    flushers.close();

    let background = CancellationToken::new();
    // Flush workers set the pending gauges after commits; during an outage only this does.
    crate::metrics::spawn_pending_gauges(
        shared.clone(),
        Duration::from_secs(1),
        background.clone(),
    );
    // Losing the lease (taken over after a stall) stops the daemon; flushes already fail then.
    let (serving, lost, heartbeat_stop) = (
        shutdown.child_token(),
        CancellationToken::new(),
        CancellationToken::new(),
    );
    let heartbeat = tokio::spawn(lease.clone().heartbeat(
        dbs.clone(),
        heartbeat_stop.clone(),
        vec![serving.clone(), lost.clone()],
    ));
    let tasks = TaskTracker::new();
    if config.rollup.enabled {
        let has_targets = config.counters.iter().any(|c| c.rollup_into.is_some());
        let names: Vec<String> = config.counters.iter().map(|c| c.name.clone()).collect();
        for (index, db) in dbs.iter().enumerate() {
            let rollup = Rollup::new(
                db.clone(),
                index,
                names.clone(),
                config.rollup.clone(),
                has_targets,
            );
            tasks.spawn(rollup.run(background.clone()));
        }
    }
    tasks.close();

    let names: Vec<String> = config.counters.iter().map(|c| c.name.clone()).collect();
    let (counters, limits) = config.protocol();
    let ingest = Arc::new(Ingest::new(
        counters,
        &names,
        limits,
        buckets,
        layout.clone(),
        shared.clone(),
        config.listen.read_buffer_bytes,
        journal.clone(),
    ));
    if !old_segments.is_empty() {
        let journal = journal
            .as_ref()
            .expect("checked when the journal was opened");
        replay(&ingest, journal, old_segments, &covered, &dbs, &lease).await;
    }
    info!("ready");
    let drain = Duration::from_millis(config.daemon.drain_timeout_ms);
    listener::serve(
        listeners,
        ingest,
        listener::ConnLimits {
            max_connections: config.listen.max_connections,
            idle_timeout: config.listen.idle_timeout(),
        },
        drain,
        serving,
    )
    .await;

    info!(
        pending_keys = shared.pending_keys(),
        pending_events = shared.pending_events(),
        "listeners closed; final flush"
    );
    background.cancel();
    flush_stop.cancel();
    if lost.is_cancelled() {
        // No flush can commit without the lease: what is pending stays in the journal.
        abandon.cancel();
    }
    let deadline = Duration::from_millis(config.daemon.shutdown_timeout_ms);
    if tokio::time::timeout(deadline, flushers.wait())
        .await
        .is_err()
    {
        warn!(
            pending_events = shared.pending_events(),
            "final flush did not finish within daemon.shutdown_timeout_ms; giving up"
        );
        abandon.cancel();
        flushers.wait().await;
    }
    tasks.wait().await;
    if let Some(journal) = &journal {
        // What the final flush could not write stays in the journal for the next start.
        let _ = journal.sync().await;
    }
    heartbeat_stop.cancel();
    if let Ok(Some(err)) = heartbeat.await {
        return Err(err.into());
    }
    lease.release(&dbs).await;
    info!("stopped");
    Ok(())
}

/// Per writer of this instance: the journal sequence number up to which its events are committed.
/// Writer numbers are global, so the rows of every database merge into one map.
async fn journal_coverage(dbs: &[Db], lease: &Lease) -> Result<HashMap<i32, i64>, DaemonError> {
    let mut covered = HashMap::new();
    for db in dbs {
        let client = db.connect().await.map_err(StoreError::from)?;
        let rows = client
            .query_typed(
                "SELECT writer, journal_covered FROM tallyd.flushes \
                 WHERE instance_id = $1 AND owner = $2",
                &[(&lease.instance_id, Type::TEXT), (&lease.owner, Type::TEXT)],
            )
            .await
            .map_err(StoreError::from)?;
        for r in rows {
            let entry = covered.entry(r.get::<_, i32>(0)).or_insert(0i64);
            *entry = (*entry).max(r.get(1));
        }
    }
    Ok(covered)
}

/// Replays the events of old segments that no committed flush covers, then retires the segments
/// (deleted, or moved to `journal/damaged/` when damaged).
/// An event went to writer `reduce(hash, buckets) % workers` with the segment's own numbers; it
/// is covered when its record's sequence number is at most that writer's `journal_covered`.
async fn replay(
    ingest: &Ingest,
    journal: &Journal,
    segments: Vec<OldSegment>,
    covered: &HashMap<i32, i64>,
    dbs: &[Db],
    lease: &Lease,
) {
    let mut records = Vec::new();
    let (mut kept, mut skipped) = (0u64, 0u64);
    for seg in &segments {
        for (seq, record) in &seg.records {
            let mut lines = Vec::new();
            for line in record.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
                let mut fields = line.splitn(3, |&b| b == b' ');
                let (Some(counter), Some(key)) = (fields.next(), fields.next()) else {
                    continue;
                };
                let seed = routing::counter_seed(&String::from_utf8_lossy(counter));
                let hash = routing::key_hash(seed, key);
                let writer = seg.layout.worker_of(seg.layout.bucket(hash)) as i32;
                if (*seq as i64) <= covered.get(&writer).copied().unwrap_or(0) {
                    skipped += 1;
                } else {
                    lines.extend_from_slice(line);
                    lines.push(b'\n');
                    kept += 1;
                }
            }
            if !lines.is_empty() {
                records.push(lines);
            }
        }
    }
    info!(
        replay = kept,
        already_committed = skipped,
        "replaying the journal"
    );
    let newest = segments
        .iter()
        .flat_map(|s| s.records.iter().map(|r| r.0))
        .max()
        .unwrap_or(0);
    let writers = segments
        .iter()
        .map(|s| s.layout.total_workers() as i32)
        .chain([ingest.layout.total_workers() as i32])
        .max()
        .unwrap_or(1);
    let accepted = listener::replay(ingest, journal, records).await;
    let dir = segments
        .first()
        .and_then(|s| s.path.parent())
        .map(|d| d.to_path_buf())
        .unwrap_or_default();
    // Every replayed event is committed now. Say so for every writer number the old segments
    // could name, so that a crash before they are deleted cannot replay them again, even if
    // the number of writers has changed since they were written.
    for db in dbs {
        if let Err(err) = cover_all(db, lease, writers, newest as i64).await {
            warn!(cause = %err, "cannot record the replay in tallyd.flushes; keeping the old segments");
            return;
        }
    }
    metrics::counter!(crate::metrics::JOURNAL_REPLAYED).increment(accepted);
    info!(events = accepted, "journal replayed and committed");
    journal::retire(&dir, segments);
}

/// Fast-stops the postmaster recorded in `pgdata/postmaster.pid` and waits up to 60 s for it.
fn stop_orphan(pgdata: &Path) {
    let pid = std::fs::read_to_string(pgdata.join("postmaster.pid"))
        .ok()
        .and_then(|s| s.lines().next().and_then(|l| l.trim().parse::<i32>().ok()));
    let Some(pid) = pid.filter(|&p| p > 0) else {
        return;
    };
    warn!(
        pid,
        "stopping a private PostgreSQL left running by a previous tallyd"
    );
    // SAFETY: plain signal calls on a pid read from the cluster's own lock file.
    unsafe { libc::kill(pid, libc::SIGINT) };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while unsafe { libc::kill(pid, 0) } == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
}

async fn cover_all(db: &Db, lease: &Lease, writers: i32, upto: i64) -> Result<(), StoreError> {
    let client = db.connect().await?;
    client
        .execute_typed(
            "INSERT INTO tallyd.flushes AS f (instance_id, owner, writer, seq, journal_covered) \
             SELECT $1, $4, w, 0, $3 FROM generate_series(0, $2 - 1) AS w \
             ON CONFLICT (instance_id, owner, writer) \
             DO UPDATE SET journal_covered = GREATEST(f.journal_covered, EXCLUDED.journal_covered)",
            &[
                (&lease.instance_id, Type::TEXT),
                (&writers, Type::INT4),
                (&upto, Type::INT8),
                (&lease.owner, Type::TEXT),
            ],
        )
        .await?;
    Ok(())
}

/// Takes `data_dir/tallyd.lock` for as long as the returned file is open, so that two tallyd
/// processes never share a data directory (its private PostgreSQL, journal and instance id).
pub fn lock_data_dir(dir: &Path) -> Result<std::fs::File, DaemonError> {
    use std::os::fd::AsRawFd;
    let path = dir.join("tallyd.lock");
    let io = |what, cause| DaemonError::Io {
        what,
        path: path.clone(),
        cause,
    };
    if dir.exists() && !dir.is_dir() {
        return Err(DaemonError::NotADirectory {
            dir: dir.to_path_buf(),
        });
    }
    std::fs::create_dir_all(dir).map_err(|e| io("cannot create data_dir for", e))?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| io("cannot open", e))?;
    // SAFETY: flock on a descriptor we own; the lock goes with the file.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(DaemonError::Locked {
            dir: dir.to_path_buf(),
        });
    }
    Ok(file)
}
