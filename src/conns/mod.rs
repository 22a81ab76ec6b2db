//! Stream connections, whatever their protocol: accepting them within `listen.max_connections`
//! and the descriptor budget ([`accept`], [`descriptors`]), the idle ones a new connection may
//! evict ([`idle`]), and what every connection shares (this file): the [`Protocol`] a listener
//! serves its connections with (tallyd's lines in [`crate::listener`], DogStatsD's
//! length-prefixed packets in [`crate::statsd`]), what a connection is handed ([`ConnCtx`]),
//! and the wait for the client's next bytes, which ends at the stop, at the idle timeout or when
//! a new connection evicts it. Below both listeners, so that neither imports the other: what a
//! connection's bytes become is its protocol's.

pub(crate) mod accept;
pub mod descriptors;
mod idle;

pub use accept::{ConnLimits, Descriptors};

use std::future::Future;
use std::io;
use std::time::Duration;

use bytes::BufMut;
use tokio::io::AsyncReadExt;
use tokio::net::unix::OwnedReadHalf;
use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;

use idle::IdleConns;

/// How a listener's connections are read: one call per connection, returning when it ends.
pub(crate) trait Protocol: Send + Sync + 'static {
    /// A new connection's id, unique among the daemon's connections and datagram sockets (its
    /// router's: the buckets count overflow rejections per id).
    fn conn_id(&self) -> u64;

    fn serve(
        &self,
        stream: UnixStream,
        ctx: &ConnCtx<'_>,
        conn: u64,
    ) -> impl Future<Output = io::Result<()>> + Send;
}

/// What a stream connection shares with the others.
pub(crate) struct ConnCtx<'a> {
    idle: &'a IdleConns,
    idle_timeout: Option<Duration>,
    /// The end of the graceful stop's drain.
    pub(crate) cancel: &'a CancellationToken,
}

/// What a wait for the client's next bytes ended with.
pub(crate) enum Read {
    Bytes(usize),
    End,
    /// Nothing for `listen.idle_timeout_ms`.
    Idle,
    /// Closed to admit a new connection at `listen.max_connections`.
    Evicted,
}

/// Waits for the client's next bytes, at most `size` of them, appended to `buf`. `evict` is
/// the connection's own token: cancelled when a new connection takes its place.
pub(crate) async fn read_some(
    rd: &mut OwnedReadHalf,
    buf: &mut Vec<u8>,
    size: usize,
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
    if let Some(read) = read_ready(rd, buf, size)? {
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
    let mut limited = (&mut *rd).take(size as u64);
    tokio::select! {
        r = limited.read_buf(buf) => Ok(match r? {
            0 => Read::End,
            n => Read::Bytes(n),
        }),
        _ = ctx.cancel.cancelled() => Ok(Read::End),
        _ = idle_timer => Ok(Read::Idle),
        _ = evict.cancelled() => Ok(Read::Evicted),
    }
}

/// A read of the bytes the runtime has already seen arrive (None: none yet, so a wait is due).
fn read_ready(rd: &OwnedReadHalf, buf: &mut Vec<u8>, size: usize) -> io::Result<Option<Read>> {
    match rd.try_read_buf(&mut buf.limit(size)) {
        Ok(0) => Ok(Some(Read::End)),
        Ok(n) => Ok(Some(Read::Bytes(n))),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(e),
    }
}
