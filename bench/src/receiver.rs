//! The counting receiver, the per-event scenarios' ceiling: a child process (this binary, with
//! the hidden `--count-newlines KIND SOCKET EVENTS`) that binds a Unix socket and only reads and
//! counts newlines, so that its rate and CPU are measured the way the daemon's are.
//!
//! - datagram: one thread, one blocking `recv(2)` per datagram;
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
    let mut buf = vec![0u8; READ_BYTES];
    let mut counted = 0;
    while counted < events {
        let n = socket.recv(&mut buf)?;
        counted += newlines(&buf[..n]);
    }
    Ok(())
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
