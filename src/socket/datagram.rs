//! Reading datagrams from a socket, one at a time or a batch per `recvmmsg(2)`.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use tokio::net::UnixDatagram;

use super::batch::RecvBatch;

/// The largest datagram accepted, in bytes.
pub const MAX_DATAGRAM: usize = 65_536;

/// A socket datagrams are read from: the native Unix datagram socket, and statsd's Unix
/// datagram and UDP sockets.
pub(crate) trait DatagramSource {
    async fn readable(&self) -> io::Result<()>;
    /// Takes a datagram if tokio has seen the socket readable (else `WouldBlock`, and tokio
    /// waits for the next readiness event).
    fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// Takes a datagram with a non-blocking `recv` whatever tokio has seen: for the last pass
    /// at a stop, which must not miss datagrams the reactor has not reported yet.
    fn recv_now(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// The socket's descriptor, for the socket options.
    fn raw_fd(&self) -> RawFd;

    /// The most bytes the kernel holds queued for this socket (`SO_RCVBUF`, which already
    /// counts the kernel's bookkeeping): the last pass at a stop takes at most this much, so
    /// that senders that keep sending cannot hold the stop forever.
    fn queue_bytes(&self) -> usize {
        let mut value: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: `value` and `len` are valid for the call and sized for SO_RCVBUF's int.
        let rc = unsafe {
            libc::getsockopt(
                self.raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&mut value as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if rc == 0 && value > 0 {
            value as usize
        } else {
            // Linux's default for a socket nobody tuned.
            212_992
        }
    }

    /// Like [`DatagramSource::try_recv`], into `batch`; returns how many datagrams it took. One
    /// at a time unless the source overrides it.
    fn try_recv_batch(&self, batch: &mut RecvBatch) -> io::Result<usize> {
        let n = self.try_recv(batch.first_slot())?;
        batch.set_one(n);
        Ok(1)
    }

    /// Like [`DatagramSource::recv_now`], into `batch`; returns how many datagrams it took.
    fn recv_now_batch(&self, batch: &mut RecvBatch) -> io::Result<usize> {
        let n = self.recv_now(batch.first_slot())?;
        batch.set_one(n);
        Ok(1)
    }
}

impl DatagramSource for UnixDatagram {
    async fn readable(&self) -> io::Result<()> {
        UnixDatagram::readable(self).await
    }

    fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        UnixDatagram::try_recv(self, buf)
    }

    fn recv_now(&self, buf: &mut [u8]) -> io::Result<usize> {
        recv_nonblocking(self.as_raw_fd(), buf)
    }

    fn raw_fd(&self) -> RawFd {
        self.as_raw_fd()
    }

    fn try_recv_batch(&self, batch: &mut RecvBatch) -> io::Result<usize> {
        let fd = self.as_raw_fd();
        self.try_io(tokio::io::Interest::READABLE, || batch.recv_from(fd))
    }

    fn recv_now_batch(&self, batch: &mut RecvBatch) -> io::Result<usize> {
        batch.recv_from(self.as_raw_fd())
    }
}

/// One non-blocking `recv(2)` on `fd`.
pub(crate) fn recv_nonblocking(fd: std::os::fd::RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for `buf.len()` bytes for the call; `fd` is a socket we own.
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Where Linux keeps `net.unix.max_dgram_qlen`: how many datagrams one Unix datagram socket
/// queues before a sender blocks (or, not blocking, gets `EAGAIN` and drops its datagram).
const MAX_DGRAM_QLEN: &str = "/proc/sys/net/unix/max_dgram_qlen";

/// The least `net.unix.max_dgram_qlen` tallyd's Unix datagram sockets want (the package's
/// packaging/sysctl/60-tallyd.conf sets it): with the default, 10, a burst from a client that
/// does not block loses datagrams as soon as tallyd is a moment late.
pub const WANTED_DGRAM_QLEN: u32 = 512;

/// `net.unix.max_dgram_qlen` as its file reads, when it is below [`WANTED_DGRAM_QLEN`].
pub fn short_dgram_qlen(text: &str) -> Option<u32> {
    let qlen = text.trim().parse::<u32>().ok()?;
    (qlen < WANTED_DGRAM_QLEN).then_some(qlen)
}

/// Says when `net.unix.max_dgram_qlen` is below [`WANTED_DGRAM_QLEN`]: at start, when a Unix
/// datagram socket is configured; a warning when it is statsd's (`statsd`), whose clients lose
/// what does not fit. Says nothing where it cannot be read.
pub fn check_dgram_qlen(statsd: bool) {
    match std::fs::read_to_string(MAX_DGRAM_QLEN) {
        Ok(text) => {
            if let Some(qlen) = short_dgram_qlen(&text) {
                crate::events::DatagramQueueShort {
                    qlen,
                    wanted: WANTED_DGRAM_QLEN,
                    statsd,
                }
                .emit();
            }
        }
        Err(cause) => tracing::debug!(%cause, "cannot read {MAX_DGRAM_QLEN}"),
    }
}

#[cfg(test)]
mod tests {
    use super::short_dgram_qlen;

    #[test]
    fn a_queue_below_512_is_short() {
        assert_eq!(short_dgram_qlen("10\n"), Some(10));
        assert_eq!(short_dgram_qlen("511"), Some(511));
        assert_eq!(short_dgram_qlen("512\n"), None);
        assert_eq!(short_dgram_qlen("4096\n"), None);
        assert_eq!(short_dgram_qlen(""), None);
    }
}
