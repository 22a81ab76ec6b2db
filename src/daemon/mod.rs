//! Wiring: [`run`] starts the parts of the daemon in order and stops them in the reverse order,
//! so that nothing accepted is lost. What each part does is in its own module (see the
//! Architecture section of docs/design.md); this one only connects them.
//!
//! Start: migrations, the instance lease, reading the old journal (and the checks that may
//! refuse it), shard moves (or the map check), the old journal rewritten under this run's layout
//! if another one wrote it, then the `Pipeline` (buckets, flush workers, pending gauges, lease
//! heartbeat, rollups, ingest), replay, and the listeners. Stop (`Running::shutdown`): listeners
//! and connections first, so that every accepted event reaches a bucket; then a final flush of
//! everything; then the journal's last sync, the heartbeat and the lease. A lost lease, or a
//! flush that finds its database's shard map changed by another tallyd, stops the daemon too,
//! giving up at once what it can no longer write (it stays in the journal).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::batch::Batches;
use crate::bucket::BucketHandle;
use crate::config::{Config, ConfigError, Counter, DaemonConfig, FlushConfig};
use crate::conns::{descriptors, ConnLimits, Descriptors};
use crate::flush::{Fallback, Fence, FlushContext, FlushWorker, MapChanged, WriterId};
use crate::health::Health;
use crate::health::Phase;
use crate::ingest::{self, Ingest, Schema};
use crate::instance::{self, InstanceError};
use crate::journal::{self, Journal, JournalError};
use crate::listener::{self, Listeners};
use crate::live::Live;
use crate::reload::{self, Reloader};
use crate::rollup;
use crate::routing::{self, Layout};
use crate::service;
use crate::shared::Shared;
use crate::socket::ListenError;
use crate::statsd;
use crate::status::{Attached, Reporter};
use crate::store::lease::{Lease, LeaseError};
use crate::store::{self, coverage, Db, StoreError};
use backlog::{open_journal, Backlog};

mod backlog;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Listen(#[from] ListenError),
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error(transparent)]
    Move(#[from] store::moves::MoveError),
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error(transparent)]
    Instance(#[from] InstanceError),
    #[error(
        "{dir} holds journal segments not yet replayed, but [journal] enabled = false: enable \
         the journal to replay them, or delete the directory to discard those events"
    )]
    Unreplayed { dir: PathBuf },
    #[error("cannot read or write the held batches in {dir}: {cause}")]
    Batches { dir: PathBuf, cause: std::io::Error },
    #[error(transparent)]
    MapChanged(#[from] MapChanged),
    #[error(
        "{dir} holds {lines} journaled events not yet committed that were written with \
         {journal} databases, and this configuration names {configured}: the ledger rows that \
         say which of them are committed are in the databases left out, so they cannot be \
         replayed exactly. Configure every database again (in order), or delete the directory \
         to discard those events"
    )]
    JournalDatabases {
        dir: PathBuf,
        lines: u64,
        journal: usize,
        configured: usize,
    },
    #[error(
        "{dir} holds journaled events not yet committed for counters this configuration does \
         not declare ({counters}; removed by a reload before their flush committed?); replayed, \
         they would be rejected and lost. Declare them again so that tallyd replays and commits \
         them (then remove them with a reload), or delete the directory to discard those events"
    )]
    UndeclaredCounters { dir: PathBuf, counters: String },
}

/// Runs until `shutdown` is cancelled (or the instance lease is lost), then stops in order.
/// `dbs` are the databases in map order (one without shards). The caller owns them (and stops
/// private clusters after this returns). The statsd sockets the config names are bound here.
pub async fn run(
    config: Arc<Config>,
    listeners: Listeners,
    dbs: Vec<Db>,
    shutdown: CancellationToken,
) -> Result<(), DaemonError> {
    let detached = Supervision::detached();
    run_supervised(config, listeners, None, dbs, shutdown, detached).await
}

/// What ties a running daemon to the process around it: the [`Health`] the HTTP endpoints
/// read, and the reload requests (SIGHUP, `tallyd reload`) it applies while serving.
pub struct Supervision {
    pub reporter: Arc<Reporter>,
    pub reloads: Option<reload::Requests>,
}

impl Supervision {
    /// Nobody reads the health and nothing reloads (tests, the bench).
    pub fn detached() -> Supervision {
        Supervision {
            reporter: Reporter::detached(),
            reloads: None,
        }
    }
}

/// [`run`], telling `supervision.reporter` its phase, its databases' state and where the running
/// pipeline's figures are, and applying a reload of the config file at each of
/// `supervision.reloads`' requests (from the time tallyd is ready until the listeners close).
/// `statsd`: the statsd sockets the caller bound (or took from systemd); without, the ones the
/// config names are bound here.
pub async fn run_supervised(
    config: Arc<Config>,
    listeners: Listeners,
    statsd: Option<statsd::Bound>,
    dbs: Vec<Db>,
    shutdown: CancellationToken,
    supervision: Supervision,
) -> Result<(), DaemonError> {
    let Supervision { reporter, reloads } = supervision;
    let health = reporter.health().clone();
    let statsd = match statsd {
        Some(bound) => Some(bound),
        None => statsd::Bound::bind(&config, config.listen.mode())?,
    };
    let instance_id = instance::instance_id(&config)?;
    let counters = Arc::new(config.counter_table()?);
    let dbs = named_sessions(dbs, &instance_id);
    health.name_databases(dbs.iter().map(|db| db.name().to_string()).collect());
    if config.database.migrate {
        store::migrate(&dbs, &config).await?;
    } else {
        for db in &dbs {
            store::check_unmigrated(db, &config).await?;
        }
    }
    // Before moves, replay and any flush: one live tallyd per instance id.
    let lease = claim_lease(&config, &instance_id, &dbs).await?;
    // Read before new records are written; replayed once the pipeline runs. Before moves, so
    // that a journal that cannot be replayed refuses the start before anything moves.
    let backlog = Backlog::read(&config, &dbs, &lease).await?;
    // The batches whose routed record the old journal holds are settled: their held files go
    // now, before a rewrite under another layout (which keeps no such record) or the replay
    // could lose the record while the file stayed.
    let settled = crate::batch::settled_payloads(&backlog.segments)?;
    crate::batch::forget_settled(&config.daemon.data_dir, &settled).map_err(|cause| {
        DaemonError::Batches {
            dir: config.daemon.data_dir.join("batches"),
            cause,
        }
    })?;
    // Before any flush: nothing of this daemon's writes a shard while it moves; the versions
    // fence this daemon's flushes against later moves by others.
    let versions = settle_shards(&config, &dbs, &lease.instance_id).await?;
    (0..dbs.len()).for_each(|i| health.reachable(i));
    // Once the start can no longer be refused: a refused start leaves the journal as it was.
    let backlog = backlog.translate(&config.layout())?;
    let journal = open_journal(&config, &backlog)?;
    let deadlines = Deadlines::from_config(&config.daemon);
    let mut running = Pipeline {
        config,
        counters,
        dbs,
        versions,
        lease,
        journal,
        reporter,
    }
    .start(&shutdown);
    health.set_phase(Phase::Replaying);
    running.replay(backlog).await;
    if running.lost.is_cancelled() {
        // The lease or the shard map was lost during the replay: stop without serving.
        health.set_phase(Phase::Stopping);
        return running.shutdown(&deadlines).await;
    }
    running.spawn_folder();
    let batches = running.start_batches()?;
    health.set_phase(Phase::Serving);
    info!("ready");
    // The sockets are bound (their connections queue in the kernel) and the journal replayed.
    service::ready();
    service::spawn_watchdog(watchdog_probe(&running.ingest), running.serving.clone());
    let reloading = reloads.map(|r| running.reloads(r));
    running.serve(listeners, statsd, batches, &deadlines).await;
    health.set_phase(Phase::Stopping);
    if let Some(reloading) = reloading {
        // Not during the stop: the listeners are closed and the final flush is next.
        reloading.abort();
    }
    running.shutdown(&deadlines).await
}

/// The watchdog's check of the main loop: every bucket actor takes a message (a no-op
/// "connection 0 closed"; connection ids start at 1) within the watchdog period, so a bucket
/// that panicked or stopped consuming its queue stops the pings.
fn watchdog_probe(ingest: &Arc<Ingest>) -> impl Fn() -> BoxFuture<'static, bool> + Send {
    let ingest = ingest.clone();
    move || {
        let ingest = ingest.clone();
        Box::pin(async move {
            for bucket in &ingest.buckets {
                if bucket.closed(0).await.is_err() {
                    return false;
                }
            }
            true
        })
    }
}

/// So that a DBA sees whose sessions these are in pg_stat_activity (unless the address names
/// an application itself).
fn named_sessions(dbs: Vec<Db>, instance_id: &str) -> Vec<Db> {
    let name = format!("tallyd-{instance_id}");
    dbs.into_iter()
        .map(|db| db.default_application_name(&name))
        .collect()
}

async fn claim_lease(
    config: &Config,
    instance_id: &str,
    dbs: &[Db],
) -> Result<Arc<Lease>, DaemonError> {
    let lease = Lease::new(
        instance_id,
        &config.daemon.data_dir,
        config.daemon.instance_lease(),
    )?;
    lease.claim(dbs).await?;
    Ok(Arc::new(lease))
}

/// Checks the shard map, or with `move_shards` moves logical shards to the databases it names.
/// Returns each database's shard map version (see `store::check_map`).
async fn settle_shards(
    config: &Config,
    dbs: &[Db],
    instance_id: &str,
) -> Result<Vec<i64>, DaemonError> {
    let versions = if !config.database.move_shards {
        store::check_map(dbs, &config.layout()).await?
    } else {
        let settled = store::moves::settle(dbs, &config.layout(), instance_id).await?;
        if !settled.moves.is_empty() {
            info!(
                shards = settled.moves.len(),
                "logical shards moved to their databases"
            );
        }
        settled.versions
    };
    // Every database answered.
    for index in 0..dbs.len() {
        crate::events::DatabaseReached {
            database: index,
            up: true,
        }
        .emit();
    }
    Ok(versions)
}

/// How long the stop may take: connections finish within `drain`, the final flush within
/// `final_flush` (then what it could not write stays in the journal).
struct Deadlines {
    drain: Duration,
    final_flush: Duration,
}

impl Deadlines {
    fn from_config(config: &DaemonConfig) -> Deadlines {
        Deadlines {
            drain: config.drain_timeout(),
            final_flush: config.shutdown_timeout(),
        }
    }
}

/// What the running parts share, before they start.
struct Pipeline {
    config: Arc<Config>,
    /// The counter table by id (see [`crate::config::counter_table`]).
    counters: Arc<Vec<Counter>>,
    dbs: Vec<Db>,
    /// Per database, the shard map version its flushes must find.
    versions: Vec<i64>,
    lease: Arc<Lease>,
    journal: Option<Arc<Journal>>,
    reporter: Arc<Reporter>,
}

/// The started parts, and the tokens and trackers that stop them in order.
struct Running {
    config: Arc<Config>,
    dbs: Vec<Db>,
    lease: Arc<Lease>,
    journal: Option<Arc<Journal>>,
    shared: Arc<Shared>,
    ingest: Arc<Ingest>,
    /// What a reload replaces under the flush workers: their settings, and the counter table
    /// (which the status view reads too, and the ingest schema holds).
    flush_config: Arc<Live<FlushConfig>>,
    counters: Arc<Live<Vec<Counter>>>,
    flushers: TaskTracker,
    /// Flush workers drain once more and end.
    flush_stop: CancellationToken,
    /// Flush workers give up the flight they are writing (it stays in the journal).
    abandon: CancellationToken,
    /// Stops the rollup schedule, the pending gauges and the folder.
    background: CancellationToken,
    /// The folder (with the journal, once serving), and what asks it to route what is still
    /// spilled and end (the stop's first step).
    folder: Option<JoinHandle<()>>,
    fold_finish: CancellationToken,
    rollups: TaskTracker,
    /// Stops the rollup tasks of the configuration in force (a child of `background`).
    rollup_stop: CancellationToken,
    /// Cancelled by the caller's stop, or by the heartbeat when the lease is lost, or by the
    /// fence when the shard map changed.
    serving: CancellationToken,
    /// Cancelled when this daemon may no longer write: the lease is lost or the shard map changed.
    lost: CancellationToken,
    /// Why the shard map fence was tripped, if it was.
    fence: Arc<Fence>,
    heartbeat: JoinHandle<Option<LeaseError>>,
    heartbeat_stop: CancellationToken,
    /// What the HTTP endpoints read; a reload's rollups report to it too.
    health: Arc<Health>,
    reporter: Arc<Reporter>,
}

impl Pipeline {
    /// Spawns the buckets, the flush workers, the pending gauges, the lease heartbeat and the
    /// rollups, and builds the ingest that connections and replay feed.
    fn start(self, shutdown: &CancellationToken) -> Running {
        let Pipeline {
            config,
            counters: table,
            dbs,
            versions,
            lease,
            journal,
            reporter,
        } = self;
        let health = reporter.health().clone();
        let layout = config.layout();
        let shared = Arc::new(Shared::new(
            layout.total_workers(),
            config.counters.len(),
            config.flush.max_pending_keys,
            config.coalesce.max_pending_keys,
        ));
        let writer = WriterId {
            instance_id: lease.instance_id.clone(),
            slot_base: slot_base(&config, &lease.instance_id),
            owner: lease.owner.clone(),
        };
        info!(instance_id = %writer.instance_id, slot_base = writer.slot_base, databases = dbs.len(), workers = layout.total_workers(), buckets = layout.total_buckets(), "tallyd starting");
        let buckets = spawn_buckets(&config, &layout, &shared);
        let (flush_stop, abandon) = (CancellationToken::new(), CancellationToken::new());
        let flush_config = Arc::new(Live::new(config.flush.clone()));
        let counters = Arc::new(Live::shared(table.clone()));
        // Losing the lease (taken over after a stall) or the shard map (moved by another tallyd)
        // stops the daemon; flushes already fail then.
        let (serving, lost, heartbeat_stop) = (
            shutdown.child_token(),
            CancellationToken::new(),
            CancellationToken::new(),
        );
        // `lost` first: a connection woken by `serving` finds it cancelled and says why it closes.
        let fence = Arc::new(Fence::new(vec![lost.clone(), serving.clone()]));
        // One flush context per database: its connection (with the flush timeouts) and what
        // every worker writing to it shares.
        let contexts: Vec<Arc<FlushContext>> = (dbs.iter().enumerate())
            .map(|(database, db)| {
                Arc::new(FlushContext {
                    db: db.clone().with_timeouts(
                        config.flush.lock_timeout(),
                        config.flush.statement_timeout(),
                    ),
                    database,
                    map_version: versions[database],
                    fence: fence.clone(),
                    config: flush_config.clone(),
                    counters: counters.clone(),
                    writer: writer.clone(),
                    shared: shared.clone(),
                    abandon: abandon.clone(),
                    journal: journal.clone(),
                    health: health.clone(),
                    direct: Arc::new(Fallback::new()),
                })
            })
            .collect();
        let flushers = spawn_flushers(&layout, &buckets, &contexts, &flush_stop);
        let background = CancellationToken::new();
        // Flush workers set the pending gauges after commits; during an outage only this does.
        crate::shared::spawn_gauges(shared.clone(), Duration::from_secs(1), background.clone());
        let heartbeat = tokio::spawn(lease.clone().heartbeat(
            dbs.clone(),
            heartbeat_stop.clone(),
            vec![lost.clone(), serving.clone()],
            health.clone(),
        ));
        let (rollups, rollup_stop) = (TaskTracker::new(), background.child_token());
        rollup::spawn_all(&config, &dbs, &rollup_stop, &rollups, &health);
        rollups.close();
        let ingest = ingest(&config, table, layout, buckets, &shared, &journal, &lost);
        reporter.attach(Attached {
            shared: shared.clone(),
            buckets: ingest.buckets.clone(),
            layout: ingest.layout.clone(),
            journal: journal.clone(),
            counters: counters.clone(),
        });
        Running {
            config,
            dbs,
            lease,
            journal,
            shared,
            ingest,
            flush_config,
            counters,
            flushers,
            flush_stop,
            abandon,
            background,
            folder: None,
            fold_finish: CancellationToken::new(),
            rollups,
            rollup_stop,
            serving,
            lost,
            fence,
            heartbeat,
            heartbeat_stop,
            health,
            reporter,
        }
    }
}

fn spawn_buckets(config: &Config, layout: &Layout, shared: &Arc<Shared>) -> Vec<BucketHandle> {
    (0..layout.total_buckets())
        .map(|b| {
            BucketHandle::spawn(
                b,
                config.coalesce.queue_batches,
                layout.worker_of(b),
                shared.clone(),
            )
        })
        .collect()
}

/// The first slot this instance writes (spreads instances over slots; see docs/design.md).
fn slot_base(config: &Config, instance_id: &str) -> u64 {
    config
        .flush
        .slot_offset()
        .unwrap_or_else(|| routing::counter_seed(instance_id) % 1_000_003)
}

/// One flush worker per connection, each draining the buckets the layout gives it.
fn spawn_flushers(
    layout: &Layout,
    buckets: &[BucketHandle],
    contexts: &[Arc<FlushContext>],
    stop: &CancellationToken,
) -> TaskTracker {
    let flushers = TaskTracker::new();
    for w in 0..layout.total_workers() {
        let mine = (0..buckets.len())
            .filter(|&b| layout.worker_of(b) == w)
            .map(|b| buckets[b].clone())
            .collect();
        let ctx = contexts[w / layout.workers].clone();
        flushers.spawn(FlushWorker::new(w, mine, ctx).run(stop.clone()));
    }
    flushers.close();
    flushers
}

/// What connections and replay hand their events to.
fn ingest(
    config: &Config,
    counters: Arc<Vec<Counter>>,
    layout: Layout,
    buckets: Vec<BucketHandle>,
    shared: &Arc<Shared>,
    journal: &Option<Arc<Journal>>,
    lost: &CancellationToken,
) -> Arc<Ingest> {
    let ingest = Ingest::new(
        Schema::new(counters, config.limits()),
        buckets,
        layout,
        shared.clone(),
        config.listen.read_buffer_bytes,
        journal.clone(),
    );
    Arc::new(ingest.fenced_by(lost.clone()))
}

impl Running {
    /// Starts the folder, which routes records spilled at the memory cap (see
    /// [`ingest::fold`]). At the stop it routes what is still spilled while time allows; what it
    /// has not routed then stays in the journal.
    fn spawn_folder(&mut self) {
        if let Some(journal) = &self.journal {
            let (ingest, journal) = (self.ingest.clone(), journal.clone());
            let (stop, finish) = (self.background.clone(), self.fold_finish.clone());
            self.folder = Some(tokio::spawn(async move {
                ingest::fold::run(&ingest, &journal, finish, stop).await
            }));
        }
    }

    /// With the journal: the claim tasks, and the batches an earlier run held (see
    /// [`crate::batch`]). Without, `!batch` is refused.
    fn start_batches(&self) -> Result<Option<Arc<Batches>>, DaemonError> {
        let Some(journal) = &self.journal else {
            return Ok(None);
        };
        let dir = self.config.daemon.data_dir.join("batches");
        let batches = Batches::start(
            &self.config,
            &self.dbs,
            &self.lease.instance_id,
            self.ingest.clone(),
            journal.clone(),
            &self.background,
        )
        .and_then(|b| b.recover().map(|()| b))
        .map_err(|cause| DaemonError::Batches { dir, cause })?;
        self.reporter.attach_batches(batches.clone());
        Ok(Some(batches))
    }

    /// Serves reload requests (see [`crate::reload`]) until the listeners close.
    fn reloads(&self, requests: reload::Requests) -> JoinHandle<()> {
        let target = reload::Target {
            ingest: self.ingest.clone(),
            shared: self.shared.clone(),
            flush_config: self.flush_config.clone(),
            counters: self.counters.clone(),
            dbs: self.dbs.clone(),
            rollups: self.rollups.clone(),
            background: self.background.clone(),
            rollup_stop: self.rollup_stop.clone(),
            health: self.health.clone(),
            logging: requests.logging,
        };
        let reloader = Reloader::new(requests.path, self.config.clone(), target);
        tokio::spawn(reloader.serve(requests.requests, self.serving.clone()))
    }

    /// Replays the lines of old segments that no committed flush covers, records them as
    /// committed, then retires the segments (deleted, or moved to `journal/damaged/`).
    async fn replay(&self, backlog: Backlog) {
        if backlog.segments.is_empty() {
            return;
        }
        let journal = self
            .journal
            .as_ref()
            .expect("Backlog::read refuses old segments without a journal");
        let chosen =
            journal::replay::select(&backlog.segments, &backlog.covered, &self.ingest.layout);
        let chosen = match chosen {
            Ok(chosen) => chosen,
            Err(err) => {
                error!(cause = %err, "cannot read the journal back; not replaying it (its segments stay, for the next start)");
                return;
            }
        };
        service::status("replaying the journal");
        info!(
            replay = chosen.kept,
            already_committed = chosen.skipped,
            "replaying the journal"
        );
        let first = chosen.records.first().map(|c| c.seq);
        let (newest, writers) = (chosen.newest, chosen.writers);
        // A record that cannot be read back ends the replay: the segments stay for the next
        // start, which replays what no flush of this one covered.
        let unread = std::sync::atomic::AtomicBool::new(false);
        let records =
            journal::replay::replayed(&backlog.segments, &backlog.covered, chosen.records)
                .map_while(|r| match r {
                    Ok(record) => Some(record),
                    Err(err) => {
                        error!(cause = %err, "cannot read a journal record back; ending the replay (its segments stay, for the next start)");
                        unread.store(true, std::sync::atomic::Ordering::Relaxed);
                        None
                    }
                });
        let accepted = tokio::select! {
            accepted = ingest::replay(&self.ingest, journal, first, records) => accepted,
            // Nothing more can commit: what did not stays in the segments, for the next start.
            _ = self.lost.cancelled() => return,
        };
        if self.lost.is_cancelled() || unread.load(std::sync::atomic::Ordering::Relaxed) {
            // A flight the fence gave up ends the replay's wait too: not all of it committed.
            return;
        }
        // The replayed events are committed now (the replay waits for their flush): say so for
        // every writer number the old segments could name, before they are deleted.
        for db in &self.dbs {
            let upto = newest as i64;
            if let Err(err) = coverage::cover_all(db, &self.lease, writers, upto).await {
                warn!(cause = %err, "cannot record the replay in tallyd.flushes; keeping the old segments");
                return;
            }
        }
        crate::events::JournalReplayed { events: accepted }.emit();
        journal::retire(&backlog.dir, backlog.segments);
    }

    /// Serves the listeners until the caller's stop or a lost lease; returns once every
    /// connection has handed its last events to the buckets.
    async fn serve(
        &self,
        listeners: Listeners,
        bound: Option<statsd::Bound>,
        batches: Option<Arc<Batches>>,
        deadlines: &Deadlines,
    ) {
        let limits = ConnLimits {
            max_connections: self.config.listen.max_connections,
            idle_timeout: self.config.listen.idle_timeout(),
            // One budget for the native and the statsd stream connections together.
            descriptors: descriptors::connection_budget(&self.config).map(Descriptors::new),
        };
        let serving = self.serving.clone();
        let statsd = TaskTracker::new();
        let statsd_unix = bound.as_ref().and_then(|s| s.unix_path());
        if listeners.datagram.is_some() || statsd_unix.is_some() {
            crate::socket::check_dgram_qlen(statsd_unix.is_some());
        }
        if let Some(bound) = bound {
            let stream = (limits.clone(), deadlines.drain);
            statsd::spawn(bound, &self.ingest, stream, &serving, &statsd);
        }
        statsd.close();
        listener::serve(
            listeners,
            self.ingest.clone(),
            batches.clone(),
            limits,
            deadlines.drain,
            serving,
        )
        .await;
        if let Some(batches) = batches {
            // Before the final flush: committed batches whose claims the databases can still
            // decide are routed, so that a stop leaves none held without need.
            batches.wait_settled(deadlines.drain).await;
        }
        // The statsd sockets stop with the native ones, after one last pass over what is queued.
        statsd.wait().await;
        info!(
            pending_keys = self.shared.pending_keys(),
            pending_events = self.shared.pending_events(),
            "listeners closed; final flush"
        );
    }

    /// After [`Running::serve`]: the fold of what is still spilled, the final flush (abandoned
    /// at the deadline, or at once without the lease), the rollups, the journal's last sync, the
    /// heartbeat, the lease.
    async fn shutdown(mut self, deadlines: &Deadlines) -> Result<(), DaemonError> {
        let started = tokio::time::Instant::now();
        if let Some(mut folder) = self.folder.take() {
            // Records spilled at the memory cap are folded and written too while the flush
            // workers run, in at most three quarters of the time, the rest left for the final
            // flush; with the database down nothing makes room and the time runs out.
            self.fold_finish.cancel();
            tokio::select! {
                _ = &mut folder => {}
                _ = tokio::time::sleep_until(started + deadlines.final_flush * 3 / 4) => {}
                _ = self.lost.cancelled() => {}
            }
        }
        self.background.cancel();
        self.flush_stop.cancel();
        let final_flush = async {
            tokio::select! {
                _ = self.flushers.wait() => {}
                _ = self.lost.cancelled() => {
                    // No flush can commit without the lease or the map (now, or once a flush of
                    // the final one finds it changed): what is pending stays in the journal.
                    self.abandon.cancel();
                    self.flushers.wait().await;
                }
            }
        };
        let flushed = tokio::time::timeout_at(started + deadlines.final_flush, final_flush).await;
        if flushed.is_err() {
            warn!(
                pending_events = self.shared.pending_events(),
                "final flush did not finish within daemon.shutdown_timeout_ms; giving up"
            );
            self.abandon.cancel();
            self.flushers.wait().await;
        }
        self.rollups.wait().await;
        if let Some(journal) = &self.journal {
            // What the final flush could not write stays in the journal for the next start.
            let _ = journal.sync().await;
        }
        self.heartbeat_stop.cancel();
        if let Ok(Some(err)) = self.heartbeat.await {
            return Err(err.into());
        }
        self.lease.release(&self.dbs).await;
        if let Some(changed) = self.fence.take() {
            return Err(changed.into());
        }
        info!("stopped");
        Ok(())
    }
}
