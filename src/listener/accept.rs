//! Accepting stream connections within `listen.max_connections`: the idle connection that
//! gives up its place to a new one, and the refusal when none can.

use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::io::AsyncWriteExt;
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
        let permit = match conns.permits.clone().try_acquire_owned() {
            Ok(permit) => Some(permit),
            // An idle connection makes room; its permit comes back once it has closed.
            Err(_) if conns.idle.evict_longest() => None,
            Err(_) => {
                tracker.spawn(refuse(stream));
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
            }
            .instrument(tracing::debug_span!("conn", id = conn)),
        );
    }
}

async fn refuse(mut stream: UnixStream) {
    events::ConnectionRefused.emit();
    let reply = stream.write_all(b"error too many connections\n");
    let _ = tokio::time::timeout(Duration::from_millis(100), reply).await;
}
