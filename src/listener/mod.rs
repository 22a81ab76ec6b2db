//! The native sockets: binding the stream and datagram sockets (or taking systemd's), serving
//! them until the stop, and the graceful drain. Connections are accepted by [`crate::conns`]
//! (shared with statsd's stream socket) and read in [`stream`]; what their lines become is
//! [`crate::ingest`]'s.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{UnixDatagram, UnixListener};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

mod stream;

use crate::conns::accept::{self, accept_loop, Conns};
use crate::conns::ConnLimits;
use crate::ingest::{self, Ingest, Outcome, Router};
use crate::protocol::Reject;
use crate::service::Activated;
use crate::socket::{remove_socket_file, take_or_bind, take_or_bind_listener, ListenError};

/// The bound sockets, created before anything else starts so that a bad path fails fast.
pub struct Listeners {
    pub stream: Option<(UnixListener, PathBuf)>,
    pub datagram: Option<(UnixDatagram, PathBuf)>,
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
                let socket =
                    take_or_bind_listener((path, mode, "stream"), activated, &mut adopted)?;
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
            adopted,
        })
    }

    /// Whether tallyd bound `path` itself (and so removes it on the way out).
    fn owns(&self, path: &Path) -> bool {
        !self.adopted.iter().any(|p| p == path)
    }
}

/// Serves both sockets until `cancel`, then drains: no new connections, but open ones are read
/// until their clients close them, for at most `drain`; then they are closed. Returns after every
/// connection has handed its events to the buckets. Socket files tallyd bound are removed on the
/// way out; those systemd passed stay.
pub async fn serve(
    listeners: Listeners,
    ingest: Arc<Ingest>,
    batches: Option<Arc<crate::batch::Batches>>,
    limits: ConnLimits,
    drain: Duration,
    cancel: CancellationToken,
) {
    let tracker = TaskTracker::new();
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
    let lines = stream::Lines {
        ingest: ingest.clone(),
        batches,
    };
    let conns = Conns::new(&ingest.shared, lines, limits);
    if let Some((listener, _)) = listeners.stream {
        accept_loop(&listener, stream_file, &conns, &cancel, &tracker).await;
        drop(listener);
    } else {
        cancel.cancelled().await;
    }
    accept::drain(&tracker, &conns, drain).await;
}

/// The native datagram socket: each line is routed like a stream's; control lines are
/// rejected, since there is no one to answer.
async fn serve_datagrams(socket: &UnixDatagram, ingest: &Ingest, cancel: &CancellationToken) {
    ingest::serve_datagram_lines(
        socket,
        ingest,
        cancel,
        "datagram",
        |router: &mut Router, line| {
            if let Outcome::Control(_) | Outcome::Batch(_) = router.line(ingest, line) {
                crate::events::LineRejected {
                    reason: Reject::UnknownCommand,
                    line: line.unwrap_or(b""),
                    statsd: false,
                }
                .emit();
                router.rejected += 1;
            }
        },
    )
    .await;
}
