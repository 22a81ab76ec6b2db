//! Accepting stream connections within `listen.max_connections`: the idle connection that
//! gives up its place to a new one, and the refusal when none can. Also within their share of
//! the file descriptors (descriptors.rs): beyond it, a new connection is refused at once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn, Instrument};

use super::idle::IdleConns;
use super::stream::{serve_stream, ConnCtx};
use crate::events;
use crate::ingest::Ingest;

/// What the accept loop hands every stream connection.
pub(super) struct Conns {
    pub(super) ingest: Arc<Ingest>,
    /// One per open connection, up to `listen.max_connections`.
    pub(super) permits: Arc<Semaphore>,
    pub(super) idle: Arc<IdleConns>,
    pub(super) idle_timeout: Option<Duration>,
    pub(super) hard_stop: CancellationToken,
    /// Stream connections that may hold a descriptor at once; `None`: no budget known.
    pub(super) descriptors: Option<usize>,
    /// Stream connections holding a descriptor: accepted, until their task ends.
    pub(super) held: Arc<AtomicUsize>,
}

impl Conns {
    /// Counts a new connection against the descriptor budget; `Err(budget)` when it is spent.
    fn hold(&self) -> Result<Held, usize> {
        let held = self.held.fetch_add(1, Ordering::Relaxed);
        let guard = Held(self.held.clone());
        match self.descriptors {
            Some(budget) if held >= budget => Err(budget),
            _ => Ok(guard),
        }
    }
}

/// One stream connection's descriptor, counted until dropped.
struct Held(Arc<AtomicUsize>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

pub(super) async fn accept_loop(
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
        // Before any eviction: closing an idle connection frees its descriptor only once it
        // has closed, while the new one holds its own.
        let held = match conns.hold() {
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
                events::ConnectionOpen { open: true }.emit();
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
                events::ConnectionOpen { open: false }.emit();
                ingest.shared.connection_closed();
                drop(permit);
                drop(held);
            }
            .instrument(tracing::debug_span!("conn", id = conn)),
        );
    }
}

/// Tells the client why and closes the connection at once, so that a burst of refused
/// connections holds no descriptor. A new connection's send buffer is empty: the line fits.
fn refuse(stream: UnixStream, why: events::ConnectionRefused) {
    why.emit();
    let _ = stream.try_write(b"error too many connections\n");
}
