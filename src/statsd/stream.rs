//! One connection to the statsd stream socket (DogStatsD's `unixstream://`): its packets read
//! whole ([`super::frames`]), each packet's lines mapped and routed as a datagram's are. The
//! connection is accepted, limited, evicted when idle and drained at a stop like a native
//! stream connection; it waits for room (the memory cap, the journal's) before each read, so a
//! client that outpaces tallyd is held back by the kernel, never dropped by it.

use std::io;
use std::sync::Arc;
use std::time::Instant;

use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;

use super::frames::{FrameBuffer, FrameTooLong};
use super::mapping::Mappings;
use super::receive::take;
use crate::clock::now_ms;
use crate::events;
use crate::ingest::Router;
use crate::listener::conn::{read_some, ConnCtx, Protocol, Read};
use crate::protocol::{self, Reject};
use crate::socket::MAX_DATAGRAM;

/// DogStatsD's length-prefixed packets, with the counters' statsd mappings.
pub(crate) struct Framed {
    pub(crate) mappings: Arc<Mappings>,
}

impl Protocol for Framed {
    async fn serve(&self, stream: UnixStream, ctx: &ConnCtx<'_>, conn: u64) -> io::Result<()> {
        let ingest = ctx.ingest;
        // Replies there are none: the write half only keeps the connection open.
        let (mut rd, _wr) = stream.into_split();
        let mut router = Router::new(ingest, conn);
        let mut frames = FrameBuffer::new(ingest.read_buffer_bytes);
        let evict = CancellationToken::new();
        let result = loop {
            if !ingest.has_room() {
                // Unread bytes stay in the socket, where they hold the client back.
                let paused = Instant::now();
                tokio::select! {
                    _ = ingest.wait_for_intake() => {}
                    _ = ctx.cancel.cancelled() => break Ok(()),
                }
                events::BackpressurePaused {
                    took: paused.elapsed(),
                }
                .emit();
            }
            let size = frames.read_size();
            let ended = match read_some(&mut rd, frames.read_buf(), size, ctx, conn, &evict).await {
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
            router.now_ms = now_ms();
            let max_line_bytes = router.schema.limits.max_line_bytes;
            let taken = frames.drain_frames(|packet| {
                protocol::datagram_lines(packet, max_line_bytes, |line| {
                    take(&mut router, ingest, &self.mappings, line)
                })
            });
            router.send(ingest).await;
            if let Err(FrameTooLong(bytes)) = taken {
                events::StatsdFrameTooLong {
                    bytes,
                    max_bytes: MAX_DATAGRAM,
                }
                .emit();
                break Ok(());
            }
            if ended {
                if frames.partial() {
                    // Cut short: the client gave up mid-packet (the datadog client closes its
                    // socket when a send would block), or the connection was closed.
                    take(
                        &mut router,
                        ingest,
                        &self.mappings,
                        Err(Reject::Unterminated),
                    );
                }
                break Ok(());
            }
        };
        router.close(ingest).await;
        result
    }
}
