//! Accepting stream connections within `listen.max_connections`: the idle connection that
//! gives up its place to a new one, and the refusal when none can; and the drain at a stop.
//! The native stream socket and statsd's stream socket are served alike, each with its own
//! [`Protocol`] and its own `listen.max_connections`. All of them stay within one share of the
//! file descriptors ([`Descriptors`], see descriptors.rs): beyond it a new connection is
//! refused at once, so that the database connections, the journal and the HTTP endpoint
//! always find a descriptor.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn, Instrument};

use super::idle::IdleConns;
use super::{ConnCtx, Protocol};
use crate::events;
use crate::shared::Shared;

/// Limits on stream connections.
#[derive(Clone, Debug)]
pub struct ConnLimits {
    pub max_connections: usize,
    /// A connection that sends nothing for this long is closed; `None`: never.
    pub idle_timeout: Option<Duration>,
    /// The descriptors every stream listener's connections share (descriptors.rs); `None`:
    /// `max_connections` alone.
    pub descriptors: Option<Arc<Descriptors>>,
}

/// The file descriptors client connections may hold at once, shared by every stream listener.
#[derive(Debug)]
pub struct Descriptors {
    budget: usize,
    held: AtomicUsize,
}

impl Descriptors {
    pub fn new(budget: usize) -> Arc<Descriptors> {
        Arc::new(Descriptors {
            budget,
            held: AtomicUsize::new(0),
        })
    }

    /// Counts a new connection against the budget; `Err(budget)` when it is spent.
    fn hold(self: &Arc<Descriptors>) -> Result<Held, usize> {
        let held = self.held.fetch_add(1, Ordering::Relaxed);
        let guard = Held(self.clone());
        if held >= self.budget {
            Err(self.budget)
        } else {
            Ok(guard)
        }
    }
}

/// One stream connection's descriptor, counted until dropped.
struct Held(Arc<Descriptors>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the accept loop hands every stream connection.
pub(crate) struct Conns<P> {
    /// Where the open connections are counted.
    shared: Arc<Shared>,
    protocol: Arc<P>,
    /// One per open connection, up to `listen.max_connections`.
    permits: Arc<Semaphore>,
    idle: Arc<IdleConns>,
    idle_timeout: Option<Duration>,
    /// The end of the drain: cancelled by [`drain`] when its time is up.
    hard_stop: CancellationToken,
    descriptors: Option<Arc<Descriptors>>,
}

impl<P: Protocol> Conns<P> {
    pub(crate) fn new(shared: &Arc<Shared>, protocol: P, limits: ConnLimits) -> Conns<P> {
        Conns {
            shared: shared.clone(),
            protocol: Arc::new(protocol),
            permits: Arc::new(Semaphore::new(limits.max_connections)),
            idle: Arc::new(IdleConns::default()),
            idle_timeout: limits.idle_timeout,
            hard_stop: CancellationToken::new(),
            descriptors: limits.descriptors,
        }
    }
}

/// Accepts connections on `listener` until `cancel` (then those already queued in its
/// backlog), each served on `tracker` with `conns`' protocol. At `cancel`, `socket_file` (the
/// file tallyd bound; `None` for systemd's, which stays) is removed and the listener stops
/// taking connections before the backlog is drained ([`stop_listening`]): a client that
/// connected before is in the backlog and served, and one that connects after is refused, so no
/// client is left in a backlog that is then closed (reset).
pub(crate) async fn accept_loop<P: Protocol>(
    listener: &UnixListener,
    socket_file: Option<std::path::PathBuf>,
    conns: &Conns<P>,
    cancel: &CancellationToken,
    tracker: &TaskTracker,
) {
    let mut socket_file = socket_file;
    let mut backoff = Duration::from_millis(5);
    let mut stopping = false;
    loop {
        let accepted = if stopping {
            // Clients whose connect already completed (queued in the backlog) get served too.
            match accept_now(listener) {
                Some(Ok(stream)) => Ok(stream),
                Some(Err(err)) => {
                    warn!(cause = %err, "accept failed at the stop");
                    return;
                }
                None => return,
            }
        } else {
            tokio::select! {
                r = listener.accept() => r.map(|(stream, _)| stream),
                _ = cancel.cancelled() => {
                    stopping = true;
                    if let Some(file) = socket_file.take() {
                        crate::socket::remove_socket_file(Some(file));
                        stop_listening(listener);
                    }
                    continue;
                }
            }
        };
        let stream = match accepted {
            Ok(stream) => {
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
        // Before any eviction: closing an idle connection frees its descriptor only once it
        // has closed, while the new one holds its own.
        let held = match conns.descriptors.as_ref().map(|d| d.hold()).transpose() {
            Ok(held) => held,
            Err(budget) => {
                refuse(stream, events::ConnectionRefused::Descriptors { budget });
                continue;
            }
        };
        let permit = match conns.permits.clone().try_acquire_owned() {
            Ok(permit) => Some(permit),
            // An idle connection makes room; its permit comes back once it has closed.
            Err(_) if conns.idle.evict_longest() => None,
            Err(_) => {
                refuse(stream, events::ConnectionRefused::MaxConnections);
                continue;
            }
        };
        events::ConnectionAccepted.emit();
        let shared = conns.shared.clone();
        let protocol = conns.protocol.clone();
        let permits = conns.permits.clone();
        let idle = conns.idle.clone();
        let idle_timeout = conns.idle_timeout;
        let hard_stop = conns.hard_stop.clone();
        let conn = protocol.conn_id();
        tracker.spawn(
            async move {
                let permit = match permit {
                    Some(p) => p,
                    None => permits.acquire_owned().await.expect("never closed"),
                };
                events::ConnectionOpen { open: true }.emit();
                shared.connection_opened();
                let ctx = ConnCtx {
                    idle: &idle,
                    idle_timeout,
                    cancel: &hard_stop,
                };
                if let Err(err) = protocol.serve(stream, &ctx, conn).await {
                    debug!(cause = %err, "connection ended with an error");
                }
                events::ConnectionOpen { open: false }.emit();
                shared.connection_closed();
                drop(permit);
                drop(held);
            }
            .instrument(tracing::debug_span!("conn", id = conn)),
        );
    }
}

/// Makes the kernel refuse new connections to `listener` (`ECONNREFUSED`), while those already
/// in its backlog can still be accepted. Removing the socket file alone is not enough: a client
/// whose `connect(2)` looked the path up just before the removal is queued after it, possibly
/// after the last accept, and is then reset when the listener closes, its lines unread. On
/// Linux a stream connect checks the listener's shutdown state under the same lock it queues
/// under, so after this no connection joins the backlog (a short window, found by reading, not
/// seen in a test). Only for a socket tallyd bound: systemd's is shared with the next start,
/// whose clients wait in it meanwhile.
fn stop_listening(listener: &UnixListener) {
    // SAFETY: shutdown(2) on a descriptor we own; it changes no memory.
    if unsafe { libc::shutdown(listener.as_raw_fd(), libc::SHUT_RD) } != 0 {
        let err = io::Error::last_os_error();
        warn!(cause = %err, "cannot stop the listener taking connections at the stop");
    }
}

/// A connection the kernel already completed, taken with a plain non-blocking `accept4(2)`:
/// at the stop, tokio may not have seen it arrive yet (its cached readiness would say there
/// is none, and the connection would be dropped with the listener). `None`: there is none.
fn accept_now(listener: &UnixListener) -> Option<io::Result<UnixStream>> {
    let flags = libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
    let fd = loop {
        // SAFETY: accept4 on a listening socket we own; null address pointers are allowed.
        let fd = unsafe {
            libc::accept4(
                listener.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                flags,
            )
        };
        if fd >= 0 {
            break fd;
        }
        let err = io::Error::last_os_error();
        match err.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return None,
            _ => return Some(Err(err)),
        }
    };
    // SAFETY: a new descriptor, owned by nothing else.
    let stream = unsafe { std::os::unix::net::UnixStream::from_raw_fd(fd) };
    Some(UnixStream::from_std(stream))
}

/// After the accept loop: lets the connections on `tracker` (and any other task on it) finish
/// for at most `drain`, then closes the remaining connections and waits for them.
pub(crate) async fn drain<P>(tracker: &TaskTracker, conns: &Conns<P>, drain: Duration) {
    tracker.close();
    if tokio::time::timeout(drain, tracker.wait()).await.is_err() {
        info!(
            open = tracker.len(),
            "drain time is up; closing the remaining connections"
        );
        conns.hard_stop.cancel();
        tracker.wait().await;
    }
}

/// Tells the client why and closes the connection at once, so that a burst of refused
/// connections holds no descriptor. A new connection's send buffer is empty: the line fits.
fn refuse(stream: UnixStream, why: events::ConnectionRefused) {
    why.emit();
    let _ = stream.try_write(b"error too many connections\n");
}
