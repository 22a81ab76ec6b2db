//! Sockets and connections: the stream and datagram listeners, the per-connection read loop, and
//! routing of parsed events to bucket actors in one batch per bucket per read.

use std::collections::HashMap;
use std::io::{self, Write as _};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytes::BufMut;
use futures_util::FutureExt;
use metrics::counter;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixDatagram, UnixListener, UnixStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn, Instrument};

mod batch;

use crate::bucket::{Batch, BucketHandle};
use crate::clock::now_ms;
use crate::io_error::IoError;
use crate::journal::{self, Journal};
use crate::metrics as m;
use crate::protocol::{self, Control, Counters, Limits, Line, LineBuffer, Reject};
use crate::routing::{self, Layout};
use crate::service::Activated;
use crate::shared::Shared;
pub(crate) use batch::RecvBatch;

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("{path}: another tallyd is listening on this socket")]
    InUse { path: PathBuf },
    #[error("{path}: exists and is not a socket; refusing to replace it")]
    NotASocket { path: PathBuf },
    #[error(transparent)]
    Activation(#[from] crate::service::ActivationError),
    #[error(transparent)]
    Io(#[from] IoError),
}

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
    fn has_room(&self) -> bool {
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
}

/// Counts and (rate-limited) logs a line that was not accepted.
fn reject(reason: Reject, line: &[u8]) {
    crate::events::LineRejected {
        reason,
        line,
        statsd: false,
    }
    .emit();
}

/// What became of one line.
enum Outcome {
    /// An event routed to its bucket's batch, or an empty line.
    Taken,
    Control(Control),
    Rejected(Reject),
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
    accepted: u64,
    rejected: u64,
    pub(crate) now_ms: i64,
    /// Whether accepted events are written to the journal (not when replaying it).
    journaling: bool,
    /// This read's accepted events as canonical lines, for the journal.
    journal_lines: Vec<u8>,
}

impl Router {
    pub(crate) fn new(ingest: &Ingest, conn: u64) -> Router {
        let n = ingest.buckets.len();
        let generation = ingest.generation.load(Ordering::Acquire);
        let schema = ingest.schema();
        Router {
            conn,
            batches: (0..n).map(|_| Batch::default()).collect(),
            touched: Vec::new(),
            ever: vec![0; n.div_ceil(64)],
            accepted_by_counter: vec![0; schema.seeds.len()],
            schema,
            generation,
            accepted: 0,
            rejected: 0,
            now_ms: 0,
            journaling: ingest.journal.is_some(),
            journal_lines: Vec::new(),
        }
    }

    /// Parses one line; events go to their bucket's batch, control lines and rejections are
    /// returned for the connection to answer.
    fn line(&mut self, ingest: &Ingest, line: Result<&[u8], Reject>) -> Outcome {
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
            Ok(Line::Event(ev)) => {
                self.event(ingest, ev);
                Outcome::Taken
            }
            Ok(Line::Control(c)) => Outcome::Control(c),
            Ok(Line::Empty) => Outcome::Taken,
            Err(reason) => {
                self.rejected += 1;
                Outcome::Rejected(reason)
            }
        }
    }

    /// Routes one parsed event to its bucket's batch (and the journal's lines), whichever
    /// protocol it came in (native or statsd).
    pub(crate) fn event(&mut self, ingest: &Ingest, ev: protocol::Event<'_>) {
        let key = ev.key.as_str();
        let hash = routing::key_hash(self.schema.seeds[ev.counter as usize], key.as_bytes());
        let b = ingest.layout.bucket(hash);
        let batch = &mut self.batches[b];
        if batch.is_empty() {
            self.touched.push(b as u32);
            self.ever[b / 64] |= 1 << (b % 64);
        }
        let at_ms = ev.at_ms.unwrap_or(self.now_ms);
        batch.push(hash, ev.counter, key, ev.delta, at_ms);
        if self.journaling {
            let name = self.schema.counters.name(ev.counter);
            journal::push_line(&mut self.journal_lines, name, key, ev.delta, at_ms);
        }
        self.accepted_by_counter[ev.counter as usize] += 1;
        self.accepted += 1;
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
    fn reserve(&self, ingest: &Ingest) {
        let events: usize = self
            .touched
            .iter()
            .map(|&b| self.batches[b as usize].len())
            .sum();
        ingest.shared.reserve(events);
    }

    /// Journals this read as one record, then sends its batches, both under the journal's gate
    /// (see [`Journal::record`]), so a flush drain sees all of a record's batches or none.
    async fn send_journaled(&mut self, ingest: &Ingest, journal: &Journal) {
        if self.touched.is_empty() {
            return self.send_batches(ingest).await;
        }
        // The record goes to the writer thread; the next read likely needs as much room.
        let room = self.journal_lines.len();
        let lines = std::mem::replace(&mut self.journal_lines, Vec::with_capacity(room));
        journal.record(lines, self.send_batches(ingest)).await
    }

    async fn send_batches(&mut self, ingest: &Ingest) {
        for (i, n) in self.accepted_by_counter.iter_mut().enumerate() {
            if *n > 0 {
                self.schema.accepted[i].increment(std::mem::take(n));
            }
        }
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
            self.accepted_by_counter.resize(self.schema.seeds.len(), 0);
        }
    }

    fn ever_buckets(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.batches.len()).filter(|b| self.ever[b / 64] & (1 << (b % 64)) != 0)
    }

    /// Waits until everything this connection sent so far is committed; returns how many of its
    /// events the buckets rejected for overflow since the last call.
    async fn flush(&mut self, ingest: &Ingest) -> u64 {
        let buckets: Vec<usize> = self.ever_buckets().collect();
        if buckets.is_empty() {
            return 0;
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
        let mut overflows = 0;
        while let Some(n) = rx.recv().await {
            overflows += n;
        }
        overflows
    }

    async fn close(&mut self, ingest: &Ingest) {
        self.send(ingest).await;
        let buckets: Vec<usize> = self.ever_buckets().collect();
        for b in buckets {
            if let Err(err) = ingest.buckets[b].closed(self.conn).await {
                debug!(cause = %err, "closed connection not forgotten by its bucket");
            }
        }
    }
}

/// Removes a socket file left by a crashed tallyd; refuses to touch a live socket, a symlink or
/// anything that is not a socket.
fn clear_stale(path: &Path) -> Result<(), ListenError> {
    let io_err = |what, cause| ListenError::Io(IoError::on(what, path)(cause));
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err("cannot inspect", e)),
        Ok(meta) if !meta.file_type().is_socket() => Err(ListenError::NotASocket {
            path: path.to_path_buf(),
        }),
        Ok(_) => {
            let live = std::os::unix::net::UnixStream::connect(path).is_ok()
                || std::os::unix::net::UnixDatagram::unbound()
                    .and_then(|s| s.connect(path))
                    .is_ok();
            if live {
                return Err(ListenError::InUse {
                    path: path.to_path_buf(),
                });
            }
            std::fs::remove_file(path).map_err(|e| io_err("cannot remove stale socket", e))
        }
    }
}

pub(crate) fn prepare(path: &Path) -> Result<(), ListenError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(IoError::on("cannot create socket directory", dir))?;
    }
    clear_stale(path)
}

pub(crate) fn set_mode(path: &Path, mode: u32) -> Result<(), ListenError> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|cause| IoError::on("cannot set socket mode", path)(cause).into())
}

/// The bound sockets, created before anything else starts so that a bad path fails fast.
pub struct Listeners {
    pub stream: Option<(UnixListener, PathBuf)>,
    pub datagram: Option<(UnixDatagram, PathBuf)>,
    /// The statsd sockets ([`crate::statsd`]), when configured.
    pub statsd: Option<crate::statsd::Bound>,
    /// Socket files systemd created (socket activation): tallyd never removes them, so that
    /// they keep accepting while it restarts.
    pub adopted: Vec<PathBuf>,
}

impl Listeners {
    /// Binds the sockets that are set (`listen.socket()`, `listen.datagram_socket()`).
    pub fn bind(
        stream: Option<&Path>,
        datagram: Option<&Path>,
        mode: u32,
    ) -> Result<Listeners, ListenError> {
        Listeners::bind_or_adopt(stream, datagram, mode, &mut Activated::default())
    }

    /// Takes each socket from `activated` (named `stream` and `datagram`, or unnamed and bound
    /// to the configured path) when systemd passed it; binds the others.
    pub fn bind_or_adopt(
        stream: Option<&Path>,
        datagram: Option<&Path>,
        mode: u32,
        activated: &mut Activated,
    ) -> Result<Listeners, ListenError> {
        let mut adopted = Vec::new();
        let stream = stream
            .map(|path| {
                let socket = take_or_bind(
                    (path, mode, "stream", libc::SOCK_STREAM),
                    activated,
                    &mut adopted,
                    |fd| {
                        let l = std::os::unix::net::UnixListener::from(fd);
                        l.set_nonblocking(true)?;
                        UnixListener::from_std(l)
                    },
                    |p: &Path| UnixListener::bind(p),
                )?;
                Ok::<_, ListenError>((socket, path.to_path_buf()))
            })
            .transpose()?;
        let datagram = datagram
            .map(|path| {
                let socket = take_or_bind(
                    (path, mode, "datagram", libc::SOCK_DGRAM),
                    activated,
                    &mut adopted,
                    |fd| {
                        let s = std::os::unix::net::UnixDatagram::from(fd);
                        s.set_nonblocking(true)?;
                        UnixDatagram::from_std(s)
                    },
                    |p: &Path| UnixDatagram::bind(p),
                )?;
                Ok::<_, ListenError>((socket, path.to_path_buf()))
            })
            .transpose()?;
        Ok(Listeners {
            stream,
            datagram,
            statsd: None,
            adopted,
        })
    }

    /// Whether tallyd bound `path` itself (and so removes it on the way out).
    fn owns(&self, path: &Path) -> bool {
        !self.adopted.iter().any(|p| p == path)
    }
}

/// The socket at `path`: the one systemd passed under `name` (or unnamed, of `kind` and bound to
/// `path`), noted in `adopted` so that its file is never removed; else bound here, with `mode`.
fn take_or_bind<T>(
    (path, mode, name, kind): (&Path, u32, &str, libc::c_int),
    activated: &mut Activated,
    adopted: &mut Vec<PathBuf>,
    from_fd: impl FnOnce(std::os::fd::OwnedFd) -> io::Result<T>,
    bind: impl FnOnce(&Path) -> io::Result<T>,
) -> Result<T, ListenError> {
    if let Some(fd) = activated.take_socket(name, kind, path)? {
        adopted.push(path.to_path_buf());
        return adopt(path, || from_fd(fd));
    }
    prepare(path)?;
    let socket = bind(path).map_err(|e| bind_err(path, e))?;
    set_mode(path, mode)?;
    Ok(socket)
}

fn bind_err(path: &Path, cause: io::Error) -> ListenError {
    ListenError::Io(IoError::on("cannot bind", path)(cause))
}

/// A socket systemd passed, made non-blocking and registered with the runtime by `make`.
pub(crate) fn adopt<T>(
    path: &Path,
    make: impl FnOnce() -> io::Result<T>,
) -> Result<T, ListenError> {
    make().map_err(|cause| {
        ListenError::Io(IoError::on(
            "cannot use the socket systemd passed for",
            path,
        )(cause))
    })
}

/// Limits on stream connections.
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    pub max_connections: usize,
    /// A connection that sends nothing for this long is closed; `None`: never.
    pub idle_timeout: Option<Duration>,
}

/// Serves both sockets until `cancel`, then drains: no new connections, but open ones are read
/// until their clients close them, for at most `drain`; then they are closed. Returns after every
/// connection has handed its events to the buckets. Socket files tallyd bound are removed on the
/// way out; those systemd passed stay.
pub async fn serve(
    listeners: Listeners,
    ingest: Arc<Ingest>,
    limits: ConnLimits,
    drain: Duration,
    cancel: CancellationToken,
) {
    let tracker = TaskTracker::new();
    let hard_stop = CancellationToken::new();
    let owned = |path: &PathBuf| listeners.owns(path).then(|| path.clone());
    let (stream_file, datagram_file) = (
        listeners.stream.as_ref().and_then(|(_, p)| owned(p)),
        listeners.datagram.as_ref().and_then(|(_, p)| owned(p)),
    );
    if let Some((socket, _)) = listeners.datagram {
        let ingest = ingest.clone();
        let cancel = cancel.clone();
        tracker.spawn(async move {
            serve_datagrams(&socket, &ingest, &cancel).await;
            remove_socket_file(datagram_file);
        });
    }
    if let Some(statsd) = listeners.statsd {
        crate::statsd::spawn(statsd, &ingest, &cancel, &tracker);
    }
    if let Some((listener, _)) = listeners.stream {
        let conns = Conns {
            ingest: ingest.clone(),
            permits: Arc::new(Semaphore::new(limits.max_connections)),
            idle: Arc::new(IdleConns::default()),
            idle_timeout: limits.idle_timeout,
            hard_stop: hard_stop.clone(),
        };
        accept_loop(&listener, &conns, &cancel, &tracker).await;
        drop(listener);
        remove_socket_file(stream_file);
    } else {
        cancel.cancelled().await;
    }
    tracker.close();
    if tokio::time::timeout(drain, tracker.wait()).await.is_err() {
        info!(
            open = tracker.len(),
            "drain time is up; closing the remaining connections"
        );
        hard_stop.cancel();
        tracker.wait().await;
    }
}

/// Removes a socket file tallyd bound itself (`None`: systemd's, which stays).
fn remove_socket_file(path: Option<PathBuf>) {
    if let Some(path) = path {
        let _ = std::fs::remove_file(path);
    }
}

/// What the accept loop hands every stream connection.
struct Conns {
    ingest: Arc<Ingest>,
    /// One per open connection, up to `listen.max_connections`.
    permits: Arc<Semaphore>,
    idle: Arc<IdleConns>,
    idle_timeout: Option<Duration>,
    hard_stop: CancellationToken,
}

/// A connection must have been idle this long before it is closed to admit a new one, so that a
/// burst of new connections cannot push each other out, nor a client between its connect and
/// its first line.
const EVICT_MIN_IDLE: Duration = Duration::from_secs(1);

/// The connections waiting for their client's next bytes, with nothing of theirs in progress:
/// the ones that may be closed to admit a new connection at `listen.max_connections`.
#[derive(Default)]
struct IdleConns {
    waiting: std::sync::Mutex<HashMap<u64, (Instant, CancellationToken)>>,
}

impl IdleConns {
    /// Registers `conn` as waiting for its client until the guard is dropped.
    fn waiting(&self, conn: u64, evict: &CancellationToken) -> IdleGuard<'_> {
        let mut waiting = self.waiting.lock().expect("idle list poisoned");
        waiting.insert(conn, (Instant::now(), evict.clone()));
        IdleGuard { idle: self, conn }
    }

    /// Closes the connection idle the longest, if it has been idle for `EVICT_MIN_IDLE`.
    fn evict_longest(&self) -> bool {
        let mut waiting = self.waiting.lock().expect("idle list poisoned");
        let oldest = waiting
            .iter()
            .filter(|(_, (since, _))| since.elapsed() >= EVICT_MIN_IDLE)
            .min_by_key(|(_, (since, _))| *since)
            .map(|(&conn, _)| conn);
        match oldest.and_then(|conn| waiting.remove(&conn)) {
            Some((_, evict)) => {
                evict.cancel();
                true
            }
            None => false,
        }
    }
}

struct IdleGuard<'a> {
    idle: &'a IdleConns,
    conn: u64,
}

impl Drop for IdleGuard<'_> {
    fn drop(&mut self) {
        if let Ok(mut waiting) = self.idle.waiting.lock() {
            waiting.remove(&self.conn);
        }
    }
}

async fn accept_loop(
    listener: &UnixListener,
    conns: &Conns,
    cancel: &CancellationToken,
    tracker: &TaskTracker,
) {
    let mut backoff = Duration::from_millis(5);
    let mut stopping = false;
    loop {
        let accepted = if stopping {
            // Clients whose connect already completed (queued in the backlog) get served too.
            match listener.accept().now_or_never() {
                Some(r) => r,
                None => return,
            }
        } else {
            tokio::select! {
                r = listener.accept() => r,
                _ = cancel.cancelled() => {
                    stopping = true;
                    continue;
                }
            }
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                backoff = Duration::from_millis(5);
                stream
            }
            Err(err) => {
                // EMFILE and friends: wait instead of spinning; the listener itself stays usable.
                warn!(cause = %err, "accept failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let permit = match conns.permits.clone().try_acquire_owned() {
            Ok(permit) => Some(permit),
            // An idle connection makes room; its permit comes back once it has closed.
            Err(_) if conns.idle.evict_longest() => None,
            Err(_) => {
                counter!(m::CONNECTIONS_REFUSED).increment(1);
                tracker.spawn(refuse(stream));
                continue;
            }
        };
        counter!(m::CONNECTIONS_ACCEPTED).increment(1);
        let ingest = conns.ingest.clone();
        let permits = conns.permits.clone();
        let idle = conns.idle.clone();
        let idle_timeout = conns.idle_timeout;
        let hard_stop = conns.hard_stop.clone();
        let conn = ingest.conn_id();
        tracker.spawn(
            async move {
                let permit = match permit {
                    Some(p) => p,
                    None => permits.acquire_owned().await.expect("never closed"),
                };
                metrics::gauge!(m::CONNECTIONS_OPEN).increment(1.0);
                ingest.shared.connection_opened();
                let ctx = ConnCtx {
                    ingest: &ingest,
                    idle: &idle,
                    idle_timeout,
                    cancel: &hard_stop,
                };
                if let Err(err) = serve_stream(stream, &ctx, conn).await {
                    debug!(cause = %err, "connection ended with an error");
                }
                metrics::gauge!(m::CONNECTIONS_OPEN).decrement(1.0);
                ingest.shared.connection_closed();
                drop(permit);
            }
            .instrument(tracing::debug_span!("conn", id = conn)),
        );
    }
}

async fn refuse(mut stream: UnixStream) {
    crate::events::ConnectionRefused.emit();
    let reply = stream.write_all(b"error too many connections\n");
    let _ = tokio::time::timeout(Duration::from_millis(100), reply).await;
}

/// A reply the client does not read within this time ends the connection, so that a client that
/// never reads cannot hold a task (and a graceful stop) forever.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

async fn reply(wr: &mut OwnedWriteHalf, text: &[u8]) -> io::Result<()> {
    if text.is_empty() {
        return Ok(());
    }
    match tokio::time::timeout(WRITE_TIMEOUT, wr.write_all(text)).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "client does not read replies",
        )),
    }
}

/// The counts a `!flush` answers: lines accepted and rejected since the previous one.
#[derive(Default)]
struct FlushPeriods {
    accepted_at: u64,
    rejected_at: u64,
    /// Overflow rejections not yet charged to a period.
    overflow_carry: u64,
}

impl FlushPeriods {
    /// Closes the period that ends with `accepted` and `rejected` lines so far. Overflows may
    /// belong to lines read after this `!flush` in the same buffer: whatever exceeds this
    /// period's accepted lines is charged to the next.
    fn close(&mut self, accepted: u64, rejected: u64, overflows: u64) -> (u64, u64) {
        let owed = overflows + self.overflow_carry;
        let taken = owed.min(accepted - self.accepted_at);
        self.overflow_carry = owed - taken;
        let period = (
            accepted - self.accepted_at - taken,
            rejected - self.rejected_at + taken,
        );
        self.accepted_at = accepted;
        self.rejected_at = rejected;
        period
    }
}

/// The most bytes of a rejected line quoted back in a `rejected` reply.
const EXCERPT_BYTES: usize = 64;

/// A rejected line as quoted in a reply: at most `EXCERPT_BYTES` bytes, invalid UTF-8 replaced,
/// escaped so that it stays on one line, in double quotes; `...` after the quote if cut.
fn excerpt(line: &[u8]) -> String {
    let shown = &line[..line.len().min(EXCERPT_BYTES)];
    let mut out = format!("\"{}\"", String::from_utf8_lossy(shown).escape_debug());
    if line.len() > EXCERPT_BYTES {
        out.push_str("...");
    }
    out
}

/// Something a stream connection owes its client, in the order of its lines.
enum Reply {
    /// A control line, with the connection's accepted and rejected counts when it was read.
    Control(Control, u64, u64),
    /// A rejected line, answered only after `!errors`: its number on the connection, the
    /// reason and an excerpt.
    Rejected(u64, Reject, String),
}

/// Why a connection stopped being served.
enum Stop {
    Cancelled,
    Io(io::Error),
}

/// One stream connection's state between its reads.
struct StreamConn<'a> {
    ingest: &'a Ingest,
    router: Router,
    replies: Vec<Reply>,
    periods: FlushPeriods,
    /// Lines seen so far (every line, empty and control lines included): numbers the
    /// `rejected` replies.
    lines: u64,
    report_errors: bool,
}

impl<'a> StreamConn<'a> {
    fn new(ingest: &'a Ingest, conn: u64) -> StreamConn<'a> {
        StreamConn {
            ingest,
            router: Router::new(ingest, conn),
            replies: Vec::new(),
            periods: FlushPeriods::default(),
            lines: 0,
            report_errors: false,
        }
    }

    fn take(&mut self, line: Result<&[u8], Reject>) {
        self.lines += 1;
        match self.router.line(self.ingest, line) {
            Outcome::Taken => {}
            Outcome::Control(c) => {
                // Applies to the very next line, even in the same read.
                self.report_errors |= c == Control::Errors;
                let (a, r) = (self.router.accepted, self.router.rejected);
                self.replies.push(Reply::Control(c, a, r));
            }
            Outcome::Rejected(reason) if self.report_errors => {
                let text = line.map_or_else(|_| "\"\"".to_string(), excerpt);
                self.replies.push(Reply::Rejected(self.lines, reason, text));
            }
            Outcome::Rejected(_) => {}
        }
    }

    /// Takes `line` unless it is an event: returns false then, leaving it unparsed for later.
    fn take_unless_event(&mut self, line: Result<&[u8], Reject>) -> bool {
        if let Ok(l) = line {
            self.router.refresh(self.ingest);
            let schema = &self.router.schema;
            let parsed = protocol::parse_line(l, &schema.counters, &schema.limits);
            if let Ok(Line::Event(_)) = parsed {
                return false;
            }
        }
        self.take(line);
        true
    }

    /// Writes the replies owed so far, in order. Written as one block, except that everything
    /// before a `!flush` or `!sync` goes out before it waits.
    async fn answer(
        &mut self,
        wr: &mut OwnedWriteHalf,
        cancel: &CancellationToken,
    ) -> Result<(), Stop> {
        let mut out = Vec::new();
        for r in std::mem::take(&mut self.replies) {
            match r {
                Reply::Rejected(line, reason, text) => {
                    let _ = writeln!(out, "rejected {line} {} {text}", reason.as_str());
                }
                Reply::Control(Control::Ping, ..) => out.extend_from_slice(b"pong\n"),
                Reply::Control(Control::Errors, ..) => out.extend_from_slice(b"ok\n"),
                Reply::Control(c, accepted, rejected) => {
                    reply(wr, &out).await.map_err(Stop::Io)?;
                    out.clear();
                    self.wait(c, accepted, rejected, &mut out, cancel).await?;
                }
            }
        }
        reply(wr, &out).await.map_err(Stop::Io)
    }

    /// Answers a `!flush` or `!sync` into `out` once what it waits for is done.
    async fn wait(
        &mut self,
        control: Control,
        accepted: u64,
        rejected: u64,
        out: &mut Vec<u8>,
        cancel: &CancellationToken,
    ) -> Result<(), Stop> {
        if let (Control::Sync, Some(journal)) = (control, &self.ingest.journal) {
            match journal.sync().await {
                Ok(()) => out.extend_from_slice(b"ok\n"),
                Err(cause) => {
                    let _ = writeln!(out, "error journal write failed: {cause}");
                }
            }
            return Ok(());
        }
        let overflows = tokio::select! {
            n = self.router.flush(self.ingest) => n,
            // Stopping with the database unreachable: the client gets no answer; its lines
            // stay pending for the final flush (and in the journal).
            _ = cancel.cancelled() => return Err(Stop::Cancelled),
        };
        if self.report_errors {
            // Found by the buckets after the line left the connection: its number is unknown.
            for _ in 0..overflows {
                out.extend_from_slice(b"rejected - overflow \"\"\n");
            }
        }
        let (a, r) = self.periods.close(accepted, rejected, overflows);
        match control {
            Control::Flush => {
                let _ = writeln!(out, "ok {a} {r}");
            }
            _ => out.extend_from_slice(b"ok\n"),
        }
        Ok(())
    }

    /// Takes the complete lines read so far. At the memory cap it takes only the lines before
    /// the first event line: control lines are still answered, and the event line waits,
    /// unparsed, until there is room. Returns whether such a line is held.
    fn take_lines(&mut self, buf: &mut LineBuffer, eof: bool) -> bool {
        let held = if self.ingest.has_room() {
            buf.drain_lines(|line| self.take(line));
            false
        } else {
            buf.drain_lines_while(|line| self.take_unless_event(line))
        };
        if eof && !held {
            buf.finish(|line| self.take(line));
        }
        held
    }
}

/// What a stream connection shares with the others.
struct ConnCtx<'a> {
    ingest: &'a Ingest,
    idle: &'a IdleConns,
    idle_timeout: Option<Duration>,
    /// The end of the graceful stop's drain.
    cancel: &'a CancellationToken,
}

/// What a wait for the client's next bytes ended with.
enum Read {
    Bytes(usize),
    End,
    Idle,
    Evicted,
}

/// Waits for the client's next bytes, at most `read_size` of them.
async fn read_some(
    rd: &mut OwnedReadHalf,
    buf: &mut LineBuffer,
    ctx: &ConnCtx<'_>,
    conn: u64,
    evict: &CancellationToken,
) -> io::Result<Read> {
    if ctx.cancel.is_cancelled() {
        return Ok(Read::End);
    }
    // Bytes already there are taken at once: a busy connection is neither idle nor evictable,
    // so it skips the idle list's lock and the timer that only a wait needs. It still spends
    // the runtime's budget as a socket read would, so it yields to the bucket actors as often.
    if let Some(read) = read_ready(rd, buf)? {
        tokio::task::coop::consume_budget().await;
        return Ok(read);
    }
    let _idle = ctx.idle.waiting(conn, evict);
    let idle_timer = async {
        match ctx.idle_timeout {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    let mut limited = (&mut *rd).take(buf.read_size() as u64);
    tokio::select! {
        r = limited.read_buf(buf.read_buf()) => Ok(match r? {
            0 => Read::End,
            n => Read::Bytes(n),
        }),
        _ = ctx.cancel.cancelled() => Ok(Read::End),
        _ = idle_timer => Ok(Read::Idle),
        _ = evict.cancelled() => Ok(Read::Evicted),
    }
}

/// A read of the bytes the runtime has already seen arrive (None: none yet, so a wait is due).
fn read_ready(rd: &OwnedReadHalf, buf: &mut LineBuffer) -> io::Result<Option<Read>> {
    let size = buf.read_size();
    match rd.try_read_buf(&mut buf.read_buf().limit(size)) {
        Ok(0) => Ok(Some(Read::End)),
        Ok(n) => Ok(Some(Read::Bytes(n))),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(e),
    }
}

/// Closes an idle connection, telling the client why.
async fn close_idle(wr: &mut OwnedWriteHalf, why: Read) {
    counter!(m::CONNECTIONS_IDLE_CLOSED).increment(1);
    let text: &[u8] = if let Read::Idle = why {
        debug!("closing a connection idle for listen.idle_timeout_ms");
        b"error idle for listen.idle_timeout_ms; closing\n"
    } else {
        debug!(
            "closing the connection idle the longest to admit a new one at listen.max_connections"
        );
        b"error idle, closed to admit a new connection at listen.max_connections\n"
    };
    let _ = reply(wr, text).await;
}

async fn serve_stream(stream: UnixStream, ctx: &ConnCtx<'_>, conn: u64) -> io::Result<()> {
    let ingest = ctx.ingest;
    let (mut rd, mut wr) = stream.into_split();
    let max_line_bytes = ingest.schema().limits.max_line_bytes;
    let mut buf = LineBuffer::new(max_line_bytes, ingest.read_buffer_bytes);
    let mut c = StreamConn::new(ingest, conn);
    let evict = CancellationToken::new();
    let mut held = false;
    let mut eof = false;
    let result = loop {
        if held {
            let paused = Instant::now();
            tokio::select! {
                _ = ingest.wait_for_intake() => {}
                // Held lines count as unread, like the bytes still in the socket.
                _ = ctx.cancel.cancelled() => break Ok(()),
            }
            m::backpressure_paused(paused.elapsed());
        } else {
            match read_some(&mut rd, &mut buf, ctx, conn, &evict).await {
                Ok(Read::Bytes(n)) => ingest.received_bytes.increment(n as u64),
                Ok(Read::End) => eof = true,
                Ok(why) => {
                    // A partial line is `unterminated`, as when the client closes.
                    buf.finish(|line| c.take(line));
                    close_idle(&mut wr, why).await;
                    break Ok(());
                }
                Err(e) => break Err(e),
            }
            c.router.now_ms = now_ms();
        }
        held = c.take_lines(&mut buf, eof);
        c.router.send(ingest).await;
        match c.answer(&mut wr, ctx.cancel).await {
            Ok(()) => {}
            Err(Stop::Cancelled) => break Ok(()),
            Err(Stop::Io(e)) => break Err(e),
        }
        if eof && !held {
            break Ok(());
        }
    };
    c.router.close(ingest).await;
    result
}

/// The largest datagram accepted, in bytes.
pub const MAX_DATAGRAM: usize = 65_536;

/// A socket datagrams are read from: the native Unix datagram socket, and statsd's Unix
/// datagram and UDP sockets.
pub(crate) trait DatagramSource {
    async fn readable(&self) -> io::Result<()>;
    /// Takes a datagram if tokio has seen the socket readable (else `WouldBlock`, and tokio
    /// waits for the next readiness event).
    fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// Takes a datagram with a non-blocking `recv` whatever tokio has seen: for the last pass
    /// at a stop, which must not miss datagrams the reactor has not reported yet.
    fn recv_now(&self, buf: &mut [u8]) -> io::Result<usize>;

    /// Like [`DatagramSource::try_recv`], into `batch`; returns how many datagrams it took. One
    /// at a time unless the source overrides it.
    fn try_recv_batch(&self, batch: &mut RecvBatch) -> io::Result<usize> {
        let n = self.try_recv(batch.first_slot())?;
        batch.set_one(n);
        Ok(1)
    }

    /// Like [`DatagramSource::recv_now`], into `batch`; returns how many datagrams it took.
    fn recv_now_batch(&self, batch: &mut RecvBatch) -> io::Result<usize> {
        let n = self.recv_now(batch.first_slot())?;
        batch.set_one(n);
        Ok(1)
    }
}

impl DatagramSource for UnixDatagram {
    async fn readable(&self) -> io::Result<()> {
        UnixDatagram::readable(self).await
    }

    fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        UnixDatagram::try_recv(self, buf)
    }

    fn recv_now(&self, buf: &mut [u8]) -> io::Result<usize> {
        recv_nonblocking(self.as_raw_fd(), buf)
    }

    fn try_recv_batch(&self, batch: &mut RecvBatch) -> io::Result<usize> {
        let fd = self.as_raw_fd();
        self.try_io(tokio::io::Interest::READABLE, || batch.recv_from(fd))
    }

    fn recv_now_batch(&self, batch: &mut RecvBatch) -> io::Result<usize> {
        batch.recv_from(self.as_raw_fd())
    }
}

/// One non-blocking `recv(2)` on `fd`.
pub(crate) fn recv_nonblocking(fd: std::os::fd::RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for `buf.len()` bytes for the call; `fd` is a socket we own.
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// The native datagram socket: each line is routed like a stream's; control lines are
/// rejected, since there is no one to answer.
async fn serve_datagrams(socket: &UnixDatagram, ingest: &Ingest, cancel: &CancellationToken) {
    serve_datagram_lines(socket, ingest, cancel, "datagram", |router, line| {
        if let Outcome::Control(_) = router.line(ingest, line) {
            m::rejected(Reject::UnknownCommand, 1);
            router.rejected += 1;
        }
    })
    .await;
}

/// Datagrams: each one is complete, holding one or more lines, each handed to `take`. Several
/// ready datagrams are parsed before their batches are sent, like one stream read, with the
/// memory cap and journal back-pressure. Serves until `cancel`, then takes what is already
/// queued in the socket and returns. `name` names the socket in log lines.
pub(crate) async fn serve_datagram_lines<S: DatagramSource>(
    socket: &S,
    ingest: &Ingest,
    cancel: &CancellationToken,
    name: &'static str,
    mut take: impl FnMut(&mut Router, Result<&[u8], Reject>),
) {
    let mut router = Router::new(ingest, ingest.conn_id());
    // A datagram that fills its whole slot may have been cut short: it is rejected whole.
    let mut batch = RecvBatch::new(MAX_DATAGRAM + 1);
    let mut stopping = false;
    while !stopping {
        tokio::select! {
            r = socket.readable() => if let Err(err) = r {
                warn!(socket = name, cause = %err, "datagram socket failed");
                return;
            },
            // One last pass takes what is already queued in the socket.
            _ = cancel.cancelled() => stopping = true,
        }
        if !stopping {
            // Checked once datagrams are there, just before they are taken. They wait in the
            // socket while memory is at its cap or the journal fails: a Unix datagram sender
            // blocks (or gets EAGAIN); UDP ones are dropped by the kernel once the receive
            // buffer is full, and counted.
            tokio::select! {
                _ = ingest.wait_for_intake() => {}
                _ = cancel.cancelled() => stopping = true,
            }
        }
        let (mut bytes, mut datagrams) = (0, 0);
        router.now_ms = now_ms();
        while stopping || bytes < ingest.read_buffer_bytes {
            let received = if stopping {
                socket.recv_now_batch(&mut batch)
            } else {
                socket.try_recv_batch(&mut batch)
            };
            match received {
                Ok(n) => datagrams += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    warn!(socket = name, cause = %e, "datagram receive failed");
                    break;
                }
            }
            for datagram in batch.datagrams() {
                bytes += datagram.len();
                if datagram.len() > MAX_DATAGRAM {
                    take(&mut router, Err(Reject::TooLong));
                    continue;
                }
                let max_line_bytes = router.schema.limits.max_line_bytes;
                protocol::datagram_lines(datagram, max_line_bytes, |line| take(&mut router, line));
            }
        }
        ingest.datagrams_received.increment(datagrams as u64);
        ingest.received_bytes.increment(bytes as u64);
        router.send(ingest).await;
    }
    info!(socket = name, "datagram listener stopped");
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

#[cfg(test)]
mod tests {
    use super::FlushPeriods;

    #[test]
    fn overflow_rejections_carry_to_the_next_period() {
        // `k MAX`, `!flush`, `k 1`, `k 1` in one read: both later lines overflow, but only one
        // line was accepted before the `!flush`.
        let mut p = FlushPeriods::default();
        assert_eq!(p.close(1, 0, 2), (0, 1));
        assert_eq!(p.close(3, 0, 0), (1, 1));
        assert_eq!(p.close(5, 1, 0), (2, 1));
    }
}
