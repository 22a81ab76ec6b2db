//! Binding the statsd sockets with a bounded receive buffer, and reading UDP datagrams together
//! with the kernel's count of the datagrams it dropped on a full receive queue (SO_RXQ_OVFL).
//!
//! UDP has no back-pressure: when tallyd stops reading (memory cap, journal failing) or cannot
//! keep up, the kernel drops datagrams once the receive buffer is full, and the sender never
//! knows. tallyd cannot prevent that loss, only count it: with SO_RXQ_OVFL the kernel attaches
//! its running drop count for the socket to each datagram it delivers, so the count is exact
//! as of the last datagram read (the same number as the `drops` column of /proc/net/udp).

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;

use tokio::net::{UdpSocket, UnixDatagram};

use crate::io_error::IoError;
use crate::socket::{self, ListenError};

fn io_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(io::Error) -> ListenError + 'a {
    move |cause| ListenError::Io(IoError::on(what, path)(cause))
}

fn set_int_opt(fd: RawFd, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: a valid fd and a pointer to an int of the size given.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Asks for a receive buffer of `bytes`; the kernel caps it at net.core.rmem_max (unless root,
/// with SO_RCVBUFFORCE, which is tried first).
fn set_receive_buffer(fd: RawFd, bytes: usize) -> io::Result<()> {
    let bytes = i32::try_from(bytes).unwrap_or(i32::MAX);
    set_int_opt(fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, bytes)
        .or_else(|_| set_int_opt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, bytes))
}

/// The Unix datagram socket systemd passed for statsd, with the receive buffer asked for.
pub fn adopt_unix(
    socket: std::os::unix::net::UnixDatagram,
    path: &Path,
    receive_buffer: usize,
) -> Result<UnixDatagram, ListenError> {
    set_receive_buffer(socket.as_raw_fd(), receive_buffer)
        .map_err(io_err(path, "cannot set the receive buffer"))?;
    socket::adopt(path, || {
        socket.set_nonblocking(true)?;
        UnixDatagram::from_std(socket)
    })
}

/// The UDP socket systemd passed for statsd, set up as [`bind_udp`] sets up its own.
pub fn adopt_udp(
    socket: std::net::UdpSocket,
    addr: &str,
    receive_buffer: usize,
) -> Result<UdpSocket, ListenError> {
    let path = Path::new(addr);
    udp_options(&socket, path, receive_buffer)?;
    socket::adopt(path, || {
        socket.set_nonblocking(true)?;
        UdpSocket::from_std(socket)
    })
}

fn udp_options(
    socket: &std::net::UdpSocket,
    path: &Path,
    receive_buffer: usize,
) -> Result<(), ListenError> {
    let fd = socket.as_raw_fd();
    set_receive_buffer(fd, receive_buffer)
        .map_err(io_err(path, "cannot set the receive buffer"))?;
    set_int_opt(fd, libc::SOL_SOCKET, libc::SO_RXQ_OVFL, 1)
        .map_err(io_err(path, "cannot enable SO_RXQ_OVFL"))
}

pub fn bind_unix(
    path: &Path,
    mode: u32,
    receive_buffer: usize,
) -> Result<(UnixDatagram, &Path), ListenError> {
    socket::prepare(path)?;
    let socket = UnixDatagram::bind(path).map_err(io_err(path, "cannot bind"))?;
    socket::set_mode(path, mode)?;
    set_receive_buffer(socket.as_raw_fd(), receive_buffer)
        .map_err(io_err(path, "cannot set the receive buffer"))?;
    Ok((socket, path))
}

pub fn bind_udp(addr: &str, receive_buffer: usize) -> Result<UdpSocket, ListenError> {
    let path = Path::new(addr);
    let socket = std::net::UdpSocket::bind(addr).map_err(io_err(path, "cannot bind UDP"))?;
    udp_options(&socket, path, receive_buffer)?;
    socket
        .set_nonblocking(true)
        .map_err(io_err(path, "cannot make non-blocking"))?;
    UdpSocket::from_std(socket).map_err(io_err(path, "cannot register with the runtime"))
}

/// Receives one datagram into `buf`: its length and, if the kernel attached it, its running
/// count of datagrams dropped on this socket.
pub fn recv_counting_drops(fd: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<u32>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // u64s: aligned for cmsghdr; room for the one u32 message and then some.
    let mut control = [0u64; 8];
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: msg points at live buffers of the lengths it states.
    let n = unsafe { libc::recvmsg(fd, &mut msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut drops = None;
    // SAFETY: the CMSG_* macros walk the control buffer the kernel just filled, within
    // msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SO_RXQ_OVFL {
                drops = Some(std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<u32>()));
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n as usize, drops))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Datagrams sent to a socket that is not read overflow its small buffer; every one is
    /// either received or in the kernel's drop count.
    #[tokio::test]
    async fn every_datagram_is_received_or_counted_as_dropped() {
        let socket = bind_udp("127.0.0.1:0", 4096).unwrap();
        let addr = socket.local_addr().unwrap();
        let sender = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        const SENT: u32 = 2000;
        for i in 0..SENT {
            sender.send_to(format!("a:{i}|c").as_bytes(), addr).unwrap();
        }
        let mut buf = [0u8; 64];
        let (mut received, mut dropped) = (0, 0);
        let mut drain = |received: &mut u32, dropped: &mut u32| loop {
            match recv_counting_drops(socket.as_raw_fd(), &mut buf) {
                Ok((_, drops)) => {
                    *received += 1;
                    *dropped = drops.unwrap_or(*dropped);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
        };
        drain(&mut received, &mut dropped);
        // The count rides on datagrams queued after the drops: one more brings it.
        sender.send_to(b"last:1|c", addr).unwrap();
        drain(&mut received, &mut dropped);
        assert!(
            dropped > 0,
            "a 4 KiB buffer holds fewer than {SENT} datagrams"
        );
        assert_eq!(received + dropped, SENT + 1);
    }
}
