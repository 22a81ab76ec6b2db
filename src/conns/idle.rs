//! The stream connections waiting for their client's next bytes, with nothing of theirs in
//! progress: the ones `listen.max_connections` may close to admit a new connection.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// A connection must have been idle this long before it is closed to admit a new one, so that a
/// burst of new connections cannot push each other out, nor a client between its connect and
/// its first line.
const EVICT_MIN_IDLE: Duration = Duration::from_secs(1);

/// The connections waiting for their client's next bytes, with nothing of theirs in progress:
/// the ones that may be closed to admit a new connection at `listen.max_connections`.
#[derive(Default)]
pub(super) struct IdleConns {
    waiting: std::sync::Mutex<HashMap<u64, (Instant, CancellationToken)>>,
}

impl IdleConns {
    /// Registers `conn` as waiting for its client until the guard is dropped.
    pub(super) fn waiting(&self, conn: u64, evict: &CancellationToken) -> IdleGuard<'_> {
        let mut waiting = self.waiting.lock().expect("idle list poisoned");
        waiting.insert(conn, (Instant::now(), evict.clone()));
        IdleGuard { idle: self, conn }
    }

    /// Closes the connection idle the longest, if it has been idle for `EVICT_MIN_IDLE`.
    pub(super) fn evict_longest(&self) -> bool {
        let mut waiting = self.waiting.lock().expect("idle list poisoned");
        let oldest = waiting
            .iter()
            .filter(|(_, (since, _))| since.elapsed() >= EVICT_MIN_IDLE)
            .min_by_key(|(_, (since, _))| *since)
            .map(|(&conn, _)| conn);
        match oldest.and_then(|conn| waiting.remove(&conn)) {
            Some((_, evict)) => {
                evict.cancel();
                true
            }
            None => false,
        }
    }
}

pub(super) struct IdleGuard<'a> {
    idle: &'a IdleConns,
    conn: u64,
}

impl Drop for IdleGuard<'_> {
    fn drop(&mut self) {
        if let Ok(mut waiting) = self.idle.waiting.lock() {
            waiting.remove(&self.conn);
        }
    }
}
