//! The answer to `tallyd reload`: SIGHUP carries no reply, so the command binds a datagram
//! socket `data_dir/reload-reply.<its pid>` before it signals, and the daemon sends the verdict
//! of every reload it applies (or refuses) to each such socket it finds there.
//!
//! A verdict names when its reload started, so that a waiter can tell the reload its own signal
//! asked for from one already under way when it sent it (both clocks are this machine's).

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const PREFIX: &str = "reload-reply.";
/// A verdict names the refused keys with their reasons: far below this.
const MAX_VERDICT: usize = 64 * 1024;

/// The outcome of one reload, as the daemon sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// When the daemon started this reload (Unix ms), after the signal that asked for it.
    pub started_ms: i64,
    /// Applied (the file is in force), or not (invalid or refused: the old config stays).
    pub applied: bool,
    /// What changed, or why nothing did; one item per line.
    pub text: String,
}

impl Verdict {
    fn encode(&self) -> Vec<u8> {
        let result = if self.applied { "applied" } else { "refused" };
        format!("{} {result}\n{}", self.started_ms, self.text).into_bytes()
    }

    fn decode(bytes: &[u8]) -> Option<Verdict> {
        let text = std::str::from_utf8(bytes).ok()?;
        let (head, rest) = text.split_once('\n').unwrap_or((text, ""));
        let (started, result) = head.split_once(' ')?;
        Some(Verdict {
            started_ms: started.parse().ok()?,
            applied: match result {
                "applied" => true,
                "refused" => false,
                _ => return None,
            },
            text: rest.to_string(),
        })
    }
}

/// Sends `verdict` to every waiter in `data_dir`, without blocking; removes the sockets nobody
/// reads any more (a waiter killed before it removed its own).
pub fn announce(data_dir: &Path, verdict: &Verdict) {
    let Ok(entries) = std::fs::read_dir(data_dir) else {
        return;
    };
    let sender = match UnixDatagram::unbound().and_then(|s| {
        s.set_nonblocking(true)?;
        Ok(s)
    }) {
        Ok(s) => s,
        Err(cause) => {
            tracing::warn!(%cause, "cannot answer `tallyd reload`: no socket");
            return;
        }
    };
    let bytes = verdict.encode();
    for path in entries.filter_map(|e| e.ok()).map(|e| e.path()) {
        let waiting = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(PREFIX));
        if !waiting {
            continue;
        }
        match sender.send_to(&bytes, &path) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                let _ = std::fs::remove_file(&path);
            }
            Err(cause) => {
                tracing::debug!(path = %path.display(), %cause, "cannot answer a `tallyd reload`")
            }
        }
    }
}

/// Why no verdict came.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    #[error("no verdict within {0:?}")]
    TimedOut(Duration),
    #[error("the daemon ended before it answered")]
    Ended,
    #[error("cannot wait for the daemon's verdict on {path}: {cause}")]
    Io { path: PathBuf, cause: io::Error },
}

/// A `tallyd reload` waiting for its verdict; its socket is removed when dropped.
pub struct Waiter {
    socket: UnixDatagram,
    path: PathBuf,
}

impl Waiter {
    /// Binds `data_dir/reload-reply.<pid>`, writable by the daemon whichever user it runs as
    /// (data_dir itself lets only tallyd's user and root in).
    pub fn bind(data_dir: &Path) -> Result<Waiter, WaitError> {
        let path = data_dir.join(format!("{PREFIX}{}", std::process::id()));
        let io_err = |cause| WaitError::Io {
            path: path.clone(),
            cause,
        };
        // Left by a waiter of the same pid that was killed: nobody reads it.
        let _ = std::fs::remove_file(&path);
        let socket = UnixDatagram::bind(&path).map_err(io_err)?;
        let waiter = Waiter {
            socket,
            path: path.clone(),
        };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).map_err(io_err)?;
        Ok(waiter)
    }

    /// The verdict of the first reload started at `since_ms` or later, waiting at most
    /// `timeout`; `alive` is asked every second whether the daemon still runs.
    pub fn wait(
        &self,
        since_ms: i64,
        timeout: Duration,
        alive: impl Fn() -> bool,
    ) -> Result<Verdict, WaitError> {
        let deadline = Instant::now() + timeout;
        let mut buf = vec![0u8; MAX_VERDICT];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(WaitError::TimedOut(timeout));
            }
            let slice = left.min(Duration::from_secs(1));
            let io_err = |cause| WaitError::Io {
                path: self.path.clone(),
                cause,
            };
            self.socket.set_read_timeout(Some(slice)).map_err(io_err)?;
            match self.socket.recv(&mut buf) {
                Ok(n) => match Verdict::decode(&buf[..n]) {
                    Some(v) if v.started_ms >= since_ms => return Ok(v),
                    // A reload under way before the signal: not this one's answer.
                    _ => continue,
                },
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    if !alive() {
                        return Err(WaitError::Ended);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(cause) => return Err(io_err(cause)),
            }
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiter_takes_the_first_verdict_of_a_reload_started_after_its_signal() {
        let dir = tempfile::tempdir().unwrap();
        let waiter = Waiter::bind(dir.path()).unwrap();
        let verdict = |started_ms, applied, text: &str| Verdict {
            started_ms,
            applied,
            text: text.to_string(),
        };
        // Under way before the signal (at 100): skipped.
        announce(dir.path(), &verdict(99, true, "nothing changed"));
        announce(
            dir.path(),
            &verdict(100, false, "listen.socket: bound at start"),
        );
        let got = waiter.wait(100, Duration::from_secs(5), || true).unwrap();
        assert_eq!(got, verdict(100, false, "listen.socket: bound at start"));
        let err = waiter
            .wait(100, Duration::from_millis(50), || true)
            .unwrap_err();
        assert!(matches!(err, WaitError::TimedOut(_)), "{err}");
        let err = waiter
            .wait(100, Duration::from_secs(5), || false)
            .unwrap_err();
        assert!(matches!(err, WaitError::Ended), "{err}");
        let path = waiter.path.clone();
        drop(waiter);
        assert!(!path.exists(), "removed when dropped");
    }

    #[test]
    fn a_waiter_that_is_gone_is_cleared() {
        let dir = tempfile::tempdir().unwrap();
        let stale = dir.path().join(format!("{PREFIX}1"));
        drop(UnixDatagram::bind(&stale).unwrap());
        announce(
            dir.path(),
            &Verdict {
                started_ms: 1,
                applied: true,
                text: String::new(),
            },
        );
        assert!(!stale.exists());
    }
}
