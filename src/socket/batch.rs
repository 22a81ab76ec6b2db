//! Many datagrams per system call: [`RecvBatch`] holds the slots one `recvmmsg(2)` fills, so a
//! datagram socket under per-event load pays one syscall entry and exit (and at most one
//! preemption by the senders it wakes) per batch instead of per datagram.

use std::io;
use std::os::fd::RawFd;

/// Datagrams taken by one `recvmmsg(2)` at most.
pub(crate) const BATCH_DATAGRAMS: usize = 32;

/// Slots for up to [`BATCH_DATAGRAMS`] datagrams of up to `slot - 1` bytes each: a datagram
/// that fills its whole slot may have been cut short, and the caller rejects it whole. The
/// slots are one allocation whose pages the kernel touches only as datagrams fill them.
pub(crate) struct RecvBatch {
    buf: Vec<u8>,
    slot: usize,
    lens: [usize; BATCH_DATAGRAMS],
    count: usize,
}

impl RecvBatch {
    pub(crate) fn new(slot: usize) -> RecvBatch {
        RecvBatch {
            buf: vec![0; slot * BATCH_DATAGRAMS],
            slot,
            lens: [0; BATCH_DATAGRAMS],
            count: 0,
        }
    }

    /// The datagrams of the last receive, in arrival order.
    pub(crate) fn datagrams(&self) -> impl Iterator<Item = &[u8]> + '_ {
        (0..self.count).map(|i| &self.buf[i * self.slot..i * self.slot + self.lens[i]])
    }

    /// The first slot, for a source that receives one datagram at a time.
    pub(crate) fn first_slot(&mut self) -> &mut [u8] {
        &mut self.buf[..self.slot]
    }

    /// Records that one datagram of `len` bytes was received into the first slot.
    pub(crate) fn set_one(&mut self, len: usize) {
        self.lens[0] = len;
        self.count = 1;
    }

    /// One non-blocking `recvmmsg(2)` on `fd` into the slots; returns how many datagrams it
    /// took (`WouldBlock` when none was queued).
    pub(crate) fn recv_from(&mut self, fd: RawFd) -> io::Result<usize> {
        let base = self.buf.as_mut_ptr();
        let mut iovecs: [libc::iovec; BATCH_DATAGRAMS] = std::array::from_fn(|i| libc::iovec {
            // SAFETY: slot `i` lies inside `buf` (BATCH_DATAGRAMS slots of `slot` bytes).
            iov_base: unsafe { base.add(i * self.slot) }.cast(),
            iov_len: self.slot,
        });
        // SAFETY: all-zero is a valid `mmsghdr` (null name and control, no flags).
        let mut msgs: [libc::mmsghdr; BATCH_DATAGRAMS] = unsafe { std::mem::zeroed() };
        for (msg, iov) in msgs.iter_mut().zip(iovecs.iter_mut()) {
            msg.msg_hdr.msg_iov = iov;
            msg.msg_hdr.msg_iovlen = 1;
        }
        // SAFETY: `msgs` and the iovecs they point to live across the call, each iovec covers
        // its own part of `buf`, and `fd` is a datagram socket the caller owns.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                msgs.as_mut_ptr(),
                BATCH_DATAGRAMS as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if n < 0 {
            self.count = 0;
            return Err(io::Error::last_os_error());
        }
        let n = n as usize;
        for (len, msg) in self.lens.iter_mut().zip(&msgs[..n]) {
            *len = msg.msg_len as usize;
        }
        self.count = n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixDatagram;

    #[test]
    fn one_call_takes_the_queued_datagrams_in_order() {
        let (rx, tx) = UnixDatagram::pair().unwrap();
        let mut batch = RecvBatch::new(9);
        assert_eq!(
            batch.recv_from(rx.as_raw_fd()).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        for d in [&b"a 1"[..], b"", b"bb 2\nc"] {
            tx.send(d).unwrap();
        }
        assert_eq!(batch.recv_from(rx.as_raw_fd()).unwrap(), 3);
        let got: Vec<&[u8]> = batch.datagrams().collect();
        assert_eq!(got, vec![&b"a 1"[..], b"", b"bb 2\nc"]);
        // Longer than its slot: cut to the slot, which the caller rejects as too long.
        tx.send(b"0123456789").unwrap();
        assert_eq!(batch.recv_from(rx.as_raw_fd()).unwrap(), 1);
        assert_eq!(batch.datagrams().next().unwrap(), b"012345678");
    }
}
