//! The system calls both drivers make on the socket's descriptor: send(2) without SIGPIPE,
//! poll(2) (the blocking driver's wait), and the check that tallyd has not closed a quiet
//! connection.

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

/// send(2) with MSG_NOSIGNAL: a closed connection is an `EPIPE` error, never a SIGPIPE that
/// would end a process that has not ignored it.
pub(crate) fn send(fd: RawFd, bytes: &[u8]) -> io::Result<usize> {
    // SAFETY: the pointer and length describe `bytes`, alive for the call.
    let n = unsafe { libc::send(fd, bytes.as_ptr().cast(), bytes.len(), libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// What poll(2) found: readable (data, the end of the stream or an error to read), writable.
pub(crate) struct Ready {
    pub(crate) read: bool,
    pub(crate) write: bool,
}

/// Waits until `fd` is readable (or closed), or writable when `write`; `None` on timeout.
pub(crate) fn poll(fd: RawFd, write: bool, timeout: Option<Duration>) -> io::Result<Option<Ready>> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN | if write { libc::POLLOUT } else { 0 },
        revents: 0,
    };
    let ms = timeout.map_or(-1, |d| d.as_millis().min(i32::MAX as u128) as i32);
    loop {
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n >= 0 {
            let has = |bits| p.revents & bits != 0;
            return Ok((n > 0).then(|| Ready {
                read: has(libc::POLLIN | libc::POLLHUP | libc::POLLERR),
                write: has(libc::POLLOUT | libc::POLLERR),
            }));
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Whether a connection with nothing awaited is over: tallyd closed it (it was idle too
/// long, or tallyd stopped), or sent the line it sends before closing. Peeks, so nothing is
/// consumed.
pub(crate) fn closed_while_quiet(fd: RawFd) -> bool {
    let mut byte = 0u8;
    // SAFETY: a one-byte buffer alive for the call.
    let n = unsafe {
        libc::recv(
            fd,
            (&mut byte as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        return !matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
        );
    }
    // 0: the end of the stream; more: a reply nothing asked for, which is the closing line.
    true
}
