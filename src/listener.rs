//! Sockets and connections: the stream and datagram listeners, the per-connection read loop, and
//! routing of parsed events to bucket actors in one batch per bucket per read.

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use metrics::counter;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::{UnixDatagram, UnixListener, UnixStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn, Instrument};

use crate::bucket::{self, Batch, BucketHandle, Layout, Message};
use crate::flush::now_ms;
use crate::journal::{self, Journal};
use crate::metrics as m;
use crate::protocol::{self, Control, Counters, Limits, Line, LineBuffer, Reject};
use crate::shared::Shared;
use crate::throttle::Throttle;

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("{path}: another tallyd is listening on this socket")]
    InUse { path: PathBuf },
    #[error("{path}: exists and is not a socket; refusing to replace it")]
    NotASocket { path: PathBuf },
    #[error("{path}: {what}: {cause}")]
    Io {
        path: PathBuf,
        what: &'static str,
        cause: io::Error,
    },
}

/// Everything a connection needs to turn bytes into routed events.
pub struct Ingest {
    pub counters: Counters,
    /// Per counter: the hash seed (from its name) and its accepted-events metric.
    pub seeds: Vec<u64>,
    pub accepted: Vec<metrics::Counter>,
    pub limits: Limits,
    pub buckets: Vec<BucketHandle>,
    /// Which database, bucket and flush worker a key goes to.
    pub layout: Layout,
    pub shared: Arc<Shared>,
    pub read_buffer_bytes: usize,
    pub journal: Option<Arc<Journal>>,
    next_conn: AtomicU64,
}

impl Ingest {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        counters: Counters,
        names: &[String],
        limits: Limits,
        buckets: Vec<BucketHandle>,
        layout: Layout,
        shared: Arc<Shared>,
        read_buffer_bytes: usize,
        journal: Option<Arc<Journal>>,
    ) -> Ingest {
        Ingest {
            counters,
            seeds: names.iter().map(|n| bucket::counter_seed(n)).collect(),
            accepted: names.iter().map(|n| m::accepted_handle(n)).collect(),
            limits,
            buckets,
            layout,
            shared,
            read_buffer_bytes,
            journal,
            next_conn: AtomicU64::new(1),
        }
    }

    fn conn_id(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }
}

static REJECT_LOG: Throttle = Throttle::new(1000);

fn log_reject(reason: Reject, line: &[u8]) {
    if let Some(suppressed) = REJECT_LOG.allow() {
        let shown = &line[..line.len().min(120)];
        warn!(reason = reason.as_str(), line = %String::from_utf8_lossy(shown).escape_debug(), suppressed, "rejected line");
    }
}

/// Per-connection routing state: one batch per bucket, filled while a read buffer is parsed and
/// sent when it is done.
struct Router {
    conn: u64,
    batches: Vec<Batch>,
    touched: Vec<u32>,
    /// Buckets this connection ever sent to, so `!flush` waits only on those.
    ever: Vec<u64>,
    accepted_by_counter: Vec<u64>,
    accepted: u64,
    rejected: u64,
    now_ms: i64,
    /// Whether accepted events are written to the journal (not when replaying it).
    journaling: bool,
    /// This read's accepted events as canonical lines, for the journal.
    journal_lines: Vec<u8>,
}

impl Router {
    fn new(ingest: &Ingest, conn: u64) -> Router {
        let n = ingest.buckets.len();
        Router {
            conn,
            batches: (0..n).map(|_| Batch::default()).collect(),
            touched: Vec::new(),
            ever: vec![0; n.div_ceil(64)],
            accepted_by_counter: vec![0; ingest.seeds.len()],
            accepted: 0,
            rejected: 0,
            now_ms: 0,
            journaling: ingest.journal.is_some(),
            journal_lines: Vec::new(),
        }
    }

    /// Parses one line; events go to their bucket's batch, control lines are returned.
    fn line(&mut self, ingest: &Ingest, line: Result<&[u8], Reject>) -> Option<Control> {
        let parsed = match line {
            Ok(l) => protocol::parse_line(l, &ingest.counters, &ingest.limits)
                .inspect_err(|&reason| log_reject(reason, l)),
            // The framer's rejections: the line itself is gone.
            Err(reason) => {
                log_reject(reason, b"");
                Err(reason)
            }
        };
        match parsed {
            Ok(Line::Event(ev)) => {
                let key = ev.key.as_str();
                let hash = bucket::key_hash(ingest.seeds[ev.counter as usize], key.as_bytes());
                let b = ingest.layout.bucket(hash);
                let batch = &mut self.batches[b];
                if batch.is_empty() {
                    self.touched.push(b as u32);
                    self.ever[b / 64] |= 1 << (b % 64);
                }
                let at_ms = ev.at_ms.unwrap_or(self.now_ms);
                batch.push(hash, ev.counter, key, ev.delta, at_ms);
                if self.journaling {
                    let name = ingest.counters.name(ev.counter);
                    journal::push_line(&mut self.journal_lines, name, key, ev.delta, at_ms);
                }
                self.accepted_by_counter[ev.counter as usize] += 1;
                self.accepted += 1;
                None
            }
            Ok(Line::Control(c)) => Some(c),
            Ok(Line::Empty) => None,
            Err(reason) => {
                m::rejected(reason, 1);
                self.rejected += 1;
                None
            }
        }
    }

    /// Sends every non-empty batch to its bucket. Waits when a bucket's queue is full: that is
    /// the back-pressure that stops this connection from reading.
    async fn send(&mut self, ingest: &Ingest) {
        match &ingest.journal {
            Some(journal) => self.send_journaled(ingest, journal).await,
            None => self.send_batches(ingest).await,
        }
    }

    /// Journals this read as one record, then sends its batches. Both happen under the
    /// journal's gate, so a flush drain sees all of a record's batches or none of them.
    async fn send_journaled(&mut self, ingest: &Ingest, journal: &Journal) {
        if self.touched.is_empty() {
            return self.send_batches(ingest).await;
        }
        let _gate = journal.record_gate().await;
        let seq = journal.next_seq();
        // The record goes to the writer thread; the next read likely needs as much room.
        let room = self.journal_lines.len();
        let lines = std::mem::replace(&mut self.journal_lines, Vec::with_capacity(room));
        journal.append(seq, lines).await;
        self.send_batches(ingest).await
    }

    async fn send_batches(&mut self, ingest: &Ingest) {
        for (i, n) in self.accepted_by_counter.iter_mut().enumerate() {
            if *n > 0 {
                ingest.accepted[i].increment(std::mem::take(n));
            }
        }
        for b in self.touched.drain(..) {
            let batch = std::mem::take(&mut self.batches[b as usize]);
            ingest.buckets[b as usize]
                .send(Message::Events {
                    conn: self.conn,
                    batch,
                })
                .await;
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
            ingest.buckets[b]
                .send(Message::Barrier {
                    conn: self.conn,
                    ack: tx.clone(),
                })
                .await;
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
            ingest.buckets[b]
                .send(Message::Closed { conn: self.conn })
                .await;
        }
    }
}

/// Removes a socket file left by a crashed tallyd; refuses to touch a live socket, a symlink or
/// anything that is not a socket.
fn clear_stale(path: &Path) -> Result<(), ListenError> {
    let io_err = |what, cause| ListenError::Io {
        path: path.to_path_buf(),
        what,
        cause,
    };
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

fn prepare(path: &Path) -> Result<(), ListenError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|cause| ListenError::Io {
            path: dir.to_path_buf(),
            what: "cannot create socket directory",
            cause,
        })?;
    }
    clear_stale(path)
}

fn set_mode(path: &Path, mode: u32) -> Result<(), ListenError> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(|cause| {
        ListenError::Io {
            path: path.to_path_buf(),
            what: "cannot set socket mode",
            cause,
        }
    })
}

/// The bound sockets, created before anything else starts so that a bad path fails fast.
pub struct Listeners {
    pub stream: Option<(UnixListener, PathBuf)>,
    pub datagram: Option<(UnixDatagram, PathBuf)>,
}

impl Listeners {
    pub fn bind(stream: &Path, datagram: &Path, mode: u32) -> Result<Listeners, ListenError> {
        let bind_err = |path: &Path, cause| ListenError::Io {
            path: path.to_path_buf(),
            what: "cannot bind",
            cause,
        };
        let stream = if stream.as_os_str().is_empty() {
            None
        } else {
            prepare(stream)?;
            let l = UnixListener::bind(stream).map_err(|e| bind_err(stream, e))?;
            set_mode(stream, mode)?;
            Some((l, stream.to_path_buf()))
        };
        let datagram = if datagram.as_os_str().is_empty() {
            None
        } else {
            prepare(datagram)?;
            let s = UnixDatagram::bind(datagram).map_err(|e| bind_err(datagram, e))?;
            set_mode(datagram, mode)?;
            Some((s, datagram.to_path_buf()))
        };
        Ok(Listeners { stream, datagram })
    }
}

/// Serves both sockets until `cancel`, then drains: no new connections, but open ones are read
/// until their clients close them, for at most `drain`; then they are closed. Returns after every
/// connection has handed its events to the buckets. Socket files are removed on the way out.
pub async fn serve(
    listeners: Listeners,
    ingest: Arc<Ingest>,
    max_connections: usize,
    drain: Duration,
    cancel: CancellationToken,
) {
    let tracker = TaskTracker::new();
    let hard_stop = CancellationToken::new();
    if let Some((socket, path)) = listeners.datagram {
        let ingest = ingest.clone();
        let cancel = cancel.clone();
        tracker.spawn(async move {
            serve_datagrams(&socket, &ingest, &cancel).await;
            let _ = std::fs::remove_file(&path);
        });
    }
    if let Some((listener, path)) = listeners.stream {
        accept_loop(
            &listener,
            &ingest,
            max_connections,
            &cancel,
            &hard_stop,
            &tracker,
        )
        .await;
        drop(listener);
        let _ = std::fs::remove_file(&path);
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

async fn accept_loop(
    listener: &UnixListener,
    ingest: &Arc<Ingest>,
    max_connections: usize,
    cancel: &CancellationToken,
    hard_stop: &CancellationToken,
    tracker: &TaskTracker,
) {
    let permits = Arc::new(Semaphore::new(max_connections));
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
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            counter!(m::CONNECTIONS_REFUSED).increment(1);
            tracker.spawn(refuse(stream));
            continue;
        };
        counter!(m::CONNECTIONS_ACCEPTED).increment(1);
        let ingest = ingest.clone();
        let hard_stop = hard_stop.clone();
        let conn = ingest.conn_id();
        tracker.spawn(
            async move {
                metrics::gauge!(m::CONNECTIONS_OPEN).increment(1.0);
                if let Err(err) = serve_stream(stream, &ingest, conn, &hard_stop).await {
                    debug!(cause = %err, "connection ended with an error");
                }
                metrics::gauge!(m::CONNECTIONS_OPEN).decrement(1.0);
                drop(permit);
            }
            .instrument(tracing::debug_span!("conn", id = conn)),
        );
    }
}

async fn refuse(mut stream: UnixStream) {
    static LOG: Throttle = Throttle::new(1000);
    if let Some(suppressed) = LOG.allow() {
        warn!(
            suppressed,
            "refusing connection: listen.max_connections reached"
        );
    }
    let reply = stream.write_all(b"error too many connections\n");
    let _ = tokio::time::timeout(Duration::from_millis(100), reply).await;
}

/// A reply the client does not read within this time ends the connection, so that a client that
/// never reads cannot hold a task (and a graceful stop) forever.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

async fn reply(wr: &mut OwnedWriteHalf, text: &[u8]) -> io::Result<()> {
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

async fn serve_stream(
    stream: UnixStream,
    ingest: &Ingest,
    conn: u64,
    cancel: &CancellationToken,
) -> io::Result<()> {
    let (mut rd, mut wr) = stream.into_split();
    let mut buf = LineBuffer::new(ingest.limits.max_line_bytes, ingest.read_buffer_bytes);
    let mut router = Router::new(ingest, conn);
    let mut controls: Vec<(Control, u64, u64)> = Vec::new();
    let mut periods = FlushPeriods::default();
    let result = 'conn: loop {
        let paused = Instant::now();
        let waited = tokio::select! {
            waited = ingest.shared.wait_for_room() => waited,
            _ = cancel.cancelled() => break Ok(()),
        };
        if waited {
            m::backpressure_paused(paused.elapsed());
        }
        let n = tokio::select! {
            r = rd.read_buf(buf.read_buf()) => r,
            _ = cancel.cancelled() => Ok(0),
        };
        let n = match n {
            Ok(n) => n,
            Err(e) => break Err(e),
        };
        router.now_ms = now_ms();
        if n == 0 {
            buf.finish(|line| {
                router.line(ingest, line);
            });
            break Ok(());
        }
        counter!(m::RECEIVED_BYTES).increment(n as u64);
        buf.drain_lines(|line| {
            if let Some(c) = router.line(ingest, line) {
                controls.push((c, router.accepted, router.rejected));
            }
        });
        router.send(ingest).await;
        for (control, accepted, rejected) in controls.drain(..) {
            let answer: Vec<u8> = match control {
                Control::Ping => b"pong\n".to_vec(),
                Control::Sync if ingest.journal.is_some() => {
                    let journal = ingest.journal.as_ref().expect("guarded");
                    if journal.sync().await {
                        b"ok\n".to_vec()
                    } else {
                        b"error journal write failed\n".to_vec()
                    }
                }
                Control::Flush | Control::Sync => {
                    let overflows = tokio::select! {
                        n = router.flush(ingest) => n,
                        // Stopping with the database unreachable: the client gets no answer;
                        // its lines stay pending for the final flush (and in the journal).
                        _ = cancel.cancelled() => break 'conn Ok(()),
                    };
                    let (a, r) = periods.close(accepted, rejected, overflows);
                    if control == Control::Flush {
                        format!("ok {a} {r}\n").into_bytes()
                    } else {
                        b"ok\n".to_vec()
                    }
                }
            };
            if let Err(e) = reply(&mut wr, &answer).await {
                break 'conn Err(e);
            }
        }
    };
    router.close(ingest).await;
    result
}

/// The largest datagram accepted, in bytes.
pub const MAX_DATAGRAM: usize = 65_536;

/// Datagrams: each one is complete, holding one or more lines. Several ready datagrams are
/// parsed before their batches are sent, like one stream read.
async fn serve_datagrams(socket: &UnixDatagram, ingest: &Ingest, cancel: &CancellationToken) {
    let mut router = Router::new(ingest, ingest.conn_id());
    // A datagram that fills the whole buffer may have been cut short: it is rejected whole.
    let mut buf = vec![0u8; MAX_DATAGRAM + 1];
    let mut stopping = false;
    while !stopping {
        tokio::select! {
            // Datagrams wait in the socket (their senders block) while memory is at its cap.
            _ = ingest.shared.wait_for_room() => {}
            _ = cancel.cancelled() => stopping = true,
        }
        tokio::select! {
            r = socket.readable() => if let Err(err) = r {
                warn!(cause = %err, "datagram socket failed");
                return;
            },
            // One last pass takes what is already queued in the socket.
            _ = cancel.cancelled() => stopping = true,
        }
        let mut bytes = 0;
        router.now_ms = now_ms();
        while stopping || bytes < ingest.read_buffer_bytes {
            let n = match socket.try_recv(&mut buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    warn!(cause = %e, "datagram receive failed");
                    break;
                }
            };
            bytes += n;
            counter!(m::DATAGRAMS_RECEIVED).increment(1);
            if n > MAX_DATAGRAM {
                m::rejected(Reject::TooLong, 1);
                router.rejected += 1;
                log_reject(Reject::TooLong, b"(datagram over 64 KiB)");
                continue;
            }
            protocol::datagram_lines(&buf[..n], ingest.limits.max_line_bytes, |line| {
                if router.line(ingest, line).is_some() {
                    // There is no one to answer on a datagram socket.
                    m::rejected(Reject::UnknownCommand, 1);
                    router.rejected += 1;
                }
            });
        }
        counter!(m::RECEIVED_BYTES).increment(bytes as u64);
        router.send(ingest).await;
    }
    info!("datagram listener stopped");
}

/// Replays the lines of old journal records through the normal path without writing them
/// again, then waits until they are all committed, so that the caller can delete the old
/// segments. The journal's gate is held for the whole replay: the first drain then covers every
/// replayed record at once (they keep their old, lower sequence numbers). Memory is not capped
/// while replaying. Returns how many events were accepted.
pub async fn replay(ingest: &Ingest, journal: &Journal, records: Vec<Vec<u8>>) -> u64 {
    let mut router = Router::new(ingest, ingest.conn_id());
    router.journaling = false;
    {
        let _gate = journal.record_gate().await;
        for lines in records {
            for line in lines.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
                router.line(ingest, Ok(line));
            }
            router.send_batches(ingest).await;
        }
    }
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
