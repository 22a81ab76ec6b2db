//! The statsd datagram loop, for the Unix datagram socket and UDP alike: each datagram holds one
//! or more statsd lines; several ready datagrams are taken before their batches are sent, like
//! one read of the native datagram socket, with the same memory-cap and journal back-pressure.

use std::io;
use std::os::fd::AsRawFd;

use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;

use super::mapping::{LineEvents, Mappings, Taken};
use crate::ingest::{serve_datagram_lines, Ingest, Router};
use crate::protocol::Reject;
use crate::socket::DatagramSource;

pub(crate) struct Udp(pub UdpSocket);

impl DatagramSource for Udp {
    async fn readable(&self) -> io::Result<()> {
        self.0.readable().await
    }

    fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        let fd = self.0.as_raw_fd();
        let (n, drops) = self.0.try_io(tokio::io::Interest::READABLE, || {
            super::udp::recv_counting_drops(fd, buf)
        })?;
        if let Some(drops) = drops {
            crate::events::StatsdUdpDropped { total: drops }.emit();
        }
        Ok(n)
    }

    fn recv_now(&self, buf: &mut [u8]) -> io::Result<usize> {
        let (n, drops) = super::udp::recv_counting_drops(self.0.as_raw_fd(), buf)?;
        if let Some(drops) = drops {
            crate::events::StatsdUdpDropped { total: drops }.emit();
        }
        Ok(n)
    }

    fn raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
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

/// Maps one line and routes its events; a rejected line is counted by reason. For every statsd
/// socket: the datagram ones' lines, and the lines of the stream socket's packets.
pub(crate) fn take(
    router: &mut Router,
    ingest: &Ingest,
    mappings: &Mappings,
    line: Result<&[u8], Reject>,
) {
    let line = match line {
        Ok(l) => l,
        Err(reason) => return rejected(reason, b""),
    };
    let mut events = LineEvents::new();
    router.refresh(ingest);
    let limits = router.schema.limits;
    match mappings.events(line, &limits, &mut events) {
        Ok(Taken::Events(_)) => {
            for ev in events {
                if let Err(reason) = router.event(ingest, ev) {
                    rejected(reason, line);
                }
            }
        }
        Ok(Taken::Event) => crate::events::StatsdIgnored { kind: "event" }.emit(),
        Ok(Taken::ServiceCheck) => crate::events::StatsdIgnored {
            kind: "service_check",
        }
        .emit(),
        Ok(Taken::Empty) => {}
        Err(reason) => rejected(reason, line),
    }
}

/// Serves `socket` until `cancel`, then takes what is already queued in it and returns.
pub(crate) async fn serve<S: DatagramSource>(
    socket: &S,
    mappings: &Mappings,
    ingest: &Ingest,
    cancel: &CancellationToken,
) {
    serve_datagram_lines(socket, ingest, cancel, "statsd", |router, line| {
        take(router, ingest, mappings, line)
    })
    .await;
}
