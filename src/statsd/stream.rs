//! One connection to the statsd stream socket (DogStatsD's `unixstream://`): its packets read
//! whole ([`super::frames`]), each packet's lines mapped and routed as a datagram's are. The
//! connection is accepted, limited and drained at a stop like a native stream connection (but
//! never closed for being idle: see [`super::spawn`]); it waits for room (the memory cap, the
//! journal's) before each read, so the kernel holds back a client that blocks.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use tokio::net::unix::OwnedReadHalf;
use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;

use super::frames::{FrameBuffer, FrameTooLong};
use super::mapping::Mappings;
use super::receive::take;
use crate::clock::now_ms;
use crate::conns::{read_some, ConnCtx, Protocol, Read};
use crate::events;
use crate::ingest::{Ingest, Router};
use crate::protocol::{self, Reject};
use crate::socket::{recv_nonblocking, MAX_DATAGRAM};

/// DogStatsD's length-prefixed packets, with the counters' statsd mappings.
pub(crate) struct Framed {
    pub(crate) mappings: Arc<Mappings>,
    pub(crate) ingest: Arc<Ingest>,
}

/// At the end of the drain, the most bytes one connection's last pass takes: more than a
/// client's default send buffer holds (208 KiB), so that it ends even if the client never
/// stops writing.
const LAST_PASS_BYTES: usize = 4 << 20;

/// One connection's state between its reads.
struct FramedConn<'a> {
    ingest: &'a Ingest,
    mappings: &'a Mappings,
    router: Router,
    frames: FrameBuffer,
}

impl FramedConn<'_> {
    /// Maps and routes the lines of every complete packet read so far, then sends them.
    async fn take_packets(&mut self) -> Result<(), FrameTooLong> {
        let (ingest, mappings, router) = (self.ingest, self.mappings, &mut self.router);
        router.now_ms = now_ms();
        let max_line_bytes = router.schema.limits.max_line_bytes;
        let taken = self.frames.drain_frames(|packet| {
            protocol::datagram_lines(packet, max_line_bytes, |line| {
                take(router, ingest, mappings, line)
            })
        });
        router.send(ingest).await;
        taken
    }

    /// The drain's time is up: takes what the kernel already holds for this connection with
    /// plain non-blocking reads (tokio may not have seen it arrive), as the datagram sockets'
    /// last pass does, instead of dropping what the client believes sent.
    async fn last_pass(&mut self, rd: &OwnedReadHalf) -> Result<(), FrameTooLong> {
        let fd = rd.as_ref().as_raw_fd();
        let mut chunk = vec![0; self.frames.read_size()];
        let mut taken = 0;
        while taken < LAST_PASS_BYTES {
            match recv_nonblocking(fd, &mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    taken += n;
                    self.frames.read_buf().extend_from_slice(&chunk[..n]);
                    self.take_packets().await?;
                }
            }
        }
        self.ingest.received_bytes.increment(taken as u64);
        Ok(())
    }

    /// A packet cut short: the client gave up mid-packet (the datadog client closes its socket
    /// when a send would block), or the connection was closed.
    fn reject_partial(&mut self) {
        if self.frames.partial() {
            let (ingest, mappings) = (self.ingest, self.mappings);
            take(
                &mut self.router,
                ingest,
                mappings,
                Err(Reject::Unterminated),
            );
        }
    }
}

impl Protocol for Framed {
    fn conn_id(&self) -> u64 {
        self.ingest.conn_id()
    }

    async fn serve(&self, stream: UnixStream, ctx: &ConnCtx<'_>, conn: u64) -> io::Result<()> {
        let ingest = &*self.ingest;
        // Replies there are none: the write half only keeps the connection open.
        let (mut rd, _wr) = stream.into_split();
        let mut c = FramedConn {
            ingest,
            mappings: &self.mappings,
            router: Router::new(ingest, conn),
            frames: FrameBuffer::new(ingest.read_buffer_bytes),
        };
        let evict = CancellationToken::new();
        let result = loop {
            // Unread bytes stay in the socket, where they hold the client back.
            if !ingest.has_room() && !ingest.pause_for_intake(ctx.cancel).await {
                break Ok(());
            }
            let size = c.frames.read_size();
            let read = read_some(&mut rd, c.frames.read_buf(), size, ctx, conn, &evict).await;
            let ended = match read {
                Ok(Read::Bytes(n)) => {
                    ingest.received_bytes.increment(n as u64);
                    false
                }
                Ok(Read::End) => true,
                Ok(why) => {
                    events::IdleConnectionClosed {
                        timeout: matches!(why, Read::Idle),
                    }
                    .emit();
                    true
                }
                Err(e) => break Err(e),
            };
            let mut taken = c.take_packets().await;
            if ended && ctx.cancel.is_cancelled() && taken.is_ok() {
                taken = c.last_pass(&rd).await;
            }
            if let Err(FrameTooLong(bytes)) = taken {
                events::StatsdFrameTooLong {
                    bytes,
                    max_bytes: MAX_DATAGRAM,
                }
                .emit();
                break Ok(());
            }
            if ended {
                c.reject_partial();
                break Ok(());
            }
        };
        c.router.close(ingest).await;
        result
    }
}
