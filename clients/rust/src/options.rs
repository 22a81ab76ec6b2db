//! [`Options`]: where tallyd listens, how the client connects again, and the bounds on what it
//! holds.

use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How the client (re)connects: attempts spaced by a delay that doubles from `initial` up to
/// `max`, until `max_attempts` or `max_elapsed`, whichever comes first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    pub max_attempts: u32,
    pub max_elapsed: Duration,
}

impl Default for Backoff {
    /// 50 ms doubling to 2 s, for up to 30 s (a restarting tallyd is back well within it).
    fn default() -> Backoff {
        Backoff {
            initial: Duration::from_millis(50),
            max: Duration::from_secs(2),
            max_attempts: u32::MAX,
            max_elapsed: Duration::from_secs(30),
        }
    }
}

impl Backoff {
    /// The delay before the next attempt after `attempts` failed ones started at `started`,
    /// or `None` when no attempt is left.
    pub(crate) fn next_delay(&self, attempts: u32, started: Instant) -> Option<Duration> {
        if attempts >= self.max_attempts {
            return None;
        }
        let doubling = self
            .initial
            .saturating_mul(1 << attempts.saturating_sub(1).min(16));
        let delay = doubling.min(self.max);
        (started.elapsed() + delay <= self.max_elapsed).then_some(delay)
    }
}

/// The client's settings. `Options::new(socket)` gives the defaults below.
#[derive(Debug, Clone)]
pub struct Options {
    /// tallyd's stream socket (`listen.socket`).
    pub socket: PathBuf,
    /// Connecting, at the start and after a lost connection.
    pub connect: Backoff,
    /// The longest wait for progress (a reply, or room to write) before the connection is
    /// dropped as lost. `None` (the default): wait as long as tallyd takes; `!flush` waits
    /// while the database is unreachable, and writes wait while tallyd applies back-pressure.
    pub io_timeout: Option<Duration>,
    /// Bytes written lines may wait in the client before it writes them out (and blocks until
    /// the socket takes them): 64 KiB.
    pub write_buffer_bytes: usize,
    /// The largest batch the client holds for a retry: 8 MiB of lines. Adding beyond is
    /// refused with `Error::BatchTooLarge`.
    pub max_batch_bytes: usize,
    /// How many times `commit` sends a batch (the first time included) before it returns
    /// `Error::BatchUnacknowledged`: 5.
    pub batch_attempts: u32,
    /// Rejections kept per `!flush` or batch (the rest are counted): 1000.
    pub max_rejections: usize,
}

impl Options {
    pub fn new(socket: impl Into<PathBuf>) -> Options {
        Options {
            socket: socket.into(),
            connect: Backoff::default(),
            io_timeout: None,
            write_buffer_bytes: 64 * 1024,
            max_batch_bytes: 8 * 1024 * 1024,
            batch_attempts: 5,
            max_rejections: 1000,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_max_within_its_bounds() {
        let b = Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(50),
            max_attempts: 5,
            max_elapsed: Duration::from_secs(60),
        };
        let now = Instant::now();
        let delays: Vec<_> = (1..6).map(|n| b.next_delay(n, now)).collect();
        let ms = |m| Some(Duration::from_millis(m));
        assert_eq!(delays, [ms(10), ms(20), ms(40), ms(50), None]);
        let short = Backoff {
            max_elapsed: Duration::from_millis(5),
            ..b
        };
        assert_eq!(short.next_delay(1, now), None);
    }
}
