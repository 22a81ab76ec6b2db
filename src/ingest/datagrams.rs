//! The datagram read loop: the native Unix datagram socket and statsd's datagram sockets feed
//! their lines through it.

use std::io;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{Ingest, Router};
use crate::clock::now_ms;
use crate::protocol::{self, Reject};
use crate::socket::{DatagramSource, RecvBatch, MAX_DATAGRAM};

/// Datagrams: each one is complete, holding one or more lines, each handed to `take`. Several
/// ready datagrams are parsed before their batches are sent, like one stream read, with the
/// memory cap and journal back-pressure. Serves until `cancel`, then takes what is already
/// queued in the socket (at most what its receive queue holds, so that senders that go on
/// sending cannot hold the stop) and returns. `name` names the socket in log lines.
pub(crate) async fn serve_datagram_lines<S: DatagramSource>(
    socket: &S,
    ingest: &Ingest,
    cancel: &CancellationToken,
    name: &'static str,
    mut take: impl FnMut(&mut Router, Result<&[u8], Reject>),
) {
    let mut router = Router::new(ingest, ingest.conn_id());
    router.takes_corrections = false;
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
        let limit = if stopping {
            socket.queue_bytes().max(ingest.read_buffer_bytes)
        } else {
            ingest.read_buffer_bytes
        };
        while bytes < limit {
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
