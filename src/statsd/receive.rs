//! The statsd datagram loop, for the Unix datagram socket and UDP alike: each datagram holds one
//! or more statsd lines; several ready datagrams are taken before their batches are sent, like
//! one read of the native datagram socket, with the same memory-cap and journal back-pressure.

use std::io;
use std::os::fd::AsRawFd;

use metrics::counter;
use tokio::net::{UdpSocket, UnixDatagram};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::mapping::{Mappings, Taken};
use crate::clock::now_ms;
use crate::listener::{Ingest, Router, MAX_DATAGRAM};
use crate::metrics as m;
use crate::protocol::{self, Reject};

/// A socket datagrams are read from.
pub(crate) trait Source {
    async fn readable(&self) -> io::Result<()>;
    fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize>;
}

pub(crate) struct Unix(pub UnixDatagram);

impl Source for Unix {
    async fn readable(&self) -> io::Result<()> {
        self.0.readable().await
    }

    fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.try_recv(buf)
    }
}

pub(crate) struct Udp(pub UdpSocket);

impl Source for Udp {
    async fn readable(&self) -> io::Result<()> {
        self.0.readable().await
    }

    fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        let fd = self.0.as_raw_fd();
        let (n, drops) = self.0.try_io(tokio::io::Interest::READABLE, || {
            super::udp::recv_counting_drops(fd, buf)
        })?;
        if let Some(drops) = drops {
            counter!(m::STATSD_UDP_DROPPED).absolute(u64::from(drops));
        }
        Ok(n)
    }
}

fn rejected(reason: Reject, line: &[u8]) {
    crate::events::LineRejected {
        reason,
        line,
        statsd: true,
    }
    .emit();
}

/// Maps one line and routes its events; a rejected line is counted by reason.
fn take(router: &mut Router, ingest: &Ingest, mappings: &Mappings, line: Result<&[u8], Reject>) {
    let line = match line {
        Ok(l) => l,
        Err(reason) => return rejected(reason, b""),
    };
    let mut events = Vec::new();
    match mappings.events(line, &ingest.limits, &mut events) {
        Ok(Taken::Events(_)) => {
            for ev in events {
                router.event(ingest, ev);
            }
        }
        Ok(Taken::Event) => m::statsd_ignored("event"),
        Ok(Taken::ServiceCheck) => m::statsd_ignored("service_check"),
        Ok(Taken::Empty) => {}
        Err(reason) => rejected(reason, line),
    }
}

/// Serves `socket` until `cancel`, then takes what is already queued in it and returns.
pub(crate) async fn serve<S: Source>(
    socket: &S,
    mappings: &Mappings,
    ingest: &Ingest,
    cancel: &CancellationToken,
) {
    let mut router = Router::new(ingest, ingest.conn_id());
    // A datagram that fills the whole buffer may have been cut short: it is rejected whole.
    let mut buf = vec![0u8; MAX_DATAGRAM + 1];
    let mut stopping = false;
    while !stopping {
        tokio::select! {
            r = socket.readable() => if let Err(err) = r {
                warn!(cause = %err, "statsd socket failed");
                return;
            },
            _ = cancel.cancelled() => stopping = true,
        }
        if !stopping {
            // Datagrams wait in the socket while memory is at its cap or the journal fails: a
            // Unix datagram sender blocks (or gets EAGAIN), UDP ones are dropped by the kernel
            // once the receive buffer is full, and counted.
            tokio::select! {
                _ = ingest.wait_for_intake() => {}
                _ = cancel.cancelled() => stopping = true,
            }
        }
        let mut bytes = 0;
        router.now_ms = now_ms();
        while stopping || bytes < ingest.read_buffer_bytes {
            let n = match socket.try_recv(&mut buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    warn!(cause = %e, "statsd receive failed");
                    break;
                }
            };
            bytes += n;
            counter!(m::DATAGRAMS_RECEIVED).increment(1);
            if n > MAX_DATAGRAM {
                rejected(Reject::TooLong, b"(datagram over 64 KiB)");
                continue;
            }
            protocol::datagram_lines(&buf[..n], ingest.limits.max_line_bytes, |line| {
                take(&mut router, ingest, mappings, line)
            });
        }
        counter!(m::RECEIVED_BYTES).increment(bytes as u64);
        router.send(ingest).await;
    }
    info!("statsd listener stopped");
}
