//! The counting receiver, the per-event scenarios' ceiling: a child process (this binary, with
//! the hidden `--count-newlines KIND SOCKET EVENTS`) that binds a Unix socket and only reads and
//! counts newlines, so that its rate and CPU are measured the way the daemon's are.
//!
//! - datagram: one thread, blocking `recvmmsg(2)` calls taking up to 32 datagrams each (what the
//!   daemon does: a receiver with one `recv` per datagram pays a syscall per datagram, and the
//!   daemon then beats its "ceiling");
//! - stream: the daemon's I/O model without its work: a tokio runtime with one worker per CPU
//!   (as the daemon's), one task per connection reading up to 64 KiB at a time.
//!
//! It prints `ready` once bound and `done` once it has counted `EVENTS` newlines, then waits
//! for its standard input to close, so the bench reads its CPU time before it exits.

use std::io::{BufRead, Write};
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use tokio::io::AsyncReadExt;
use tokio::sync::Notify;

const READ_BYTES: usize = 64 * 1024;

/// Runs the receiver: `kind` is `datagram` or `stream`.
pub(crate) fn run(kind: &str, socket: &Path, events: u64) -> Result<()> {
    match kind {
        "datagram" => datagrams(socket, events)?,
        "stream" => streams(socket, events)?,
        other => bail!("--count-newlines: unknown kind {other:?}"),
    }
    say("done")?;
    // Exit when the bench closes our standard input.
    let _ = std::io::stdin().lock().read_line(&mut String::new());
    Ok(())
}

fn say(what: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{what}")?;
    out.flush()?;
    Ok(())
}

fn newlines(buf: &[u8]) -> u64 {
    memchr::memchr_iter(b'\n', buf).count() as u64
}

fn datagrams(path: &Path, events: u64) -> Result<()> {
    let socket = UnixDatagram::bind(path).with_context(|| format!("binding {}", path.display()))?;
    say("ready")?;
    let mut bufs = vec![vec![0u8; READ_BYTES]; BATCH];
    let mut counted = 0;
    while counted < events {
        let lens = recv_batch(&socket, &mut bufs)?;
        for (buf, &len) in bufs.iter().zip(&lens) {
            counted += newlines(&buf[..len]);
        }
    }
    Ok(())
}

/// Datagrams one `recvmmsg` takes at most, as the daemon's `listener::batch`.
const BATCH: usize = 32;

/// One blocking `recvmmsg(MSG_WAITFORONE)`: waits for a datagram, then takes every datagram
/// already queued (up to `bufs.len()`); returns their lengths.
fn recv_batch(socket: &UnixDatagram, bufs: &mut [Vec<u8>]) -> Result<Vec<usize>> {
    use std::os::fd::AsRawFd;
    let mut iovs: Vec<libc::iovec> = bufs
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    // SAFETY: zeroed mmsghdr is valid (null name and control, no iovecs) before we set them.
    let mut msgs: Vec<libc::mmsghdr> = iovs
        .iter_mut()
        .map(|iov| {
            let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
            m.msg_hdr.msg_iov = iov;
            m.msg_hdr.msg_iovlen = 1;
            m
        })
        .collect();
    // SAFETY: every header points at a live iovec over a live buffer of its stated length.
    let n = unsafe {
        libc::recvmmsg(
            socket.as_raw_fd(),
            msgs.as_mut_ptr(),
            msgs.len() as libc::c_uint,
            libc::MSG_WAITFORONE,
            std::ptr::null_mut(),
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(msgs[..n as usize]
        .iter()
        .map(|m| m.msg_len as usize)
        .collect())
}

fn streams(path: &Path, events: u64) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let listener = tokio::net::UnixListener::bind(path)
            .with_context(|| format!("binding {}", path.display()))?;
        say("ready")?;
        let counted = Arc::new(AtomicU64::new(0));
        let all = Arc::new(Notify::new());
        let accept = {
            let (counted, all) = (counted.clone(), all.clone());
            async move {
                loop {
                    let (mut conn, _) = listener.accept().await?;
                    let (counted, all) = (counted.clone(), all.clone());
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; READ_BYTES];
                        while let Ok(n @ 1..) = conn.read(&mut buf).await {
                            let n = newlines(&buf[..n]);
                            if counted.fetch_add(n, Ordering::Relaxed) + n >= events {
                                all.notify_one();
                            }
                        }
                    });
                }
                #[allow(unreachable_code)]
                Ok::<(), anyhow::Error>(())
            }
        };
        tokio::select! {
            r = accept => r,
            _ = all.notified() => Ok(()),
        }
    })
}
