//! [`Error`]: what failed and why, for every operation of the client.

use std::path::PathBuf;
use std::time::Duration;

/// Why a connection ended under the client. The message prints the cause; it is not also the
/// `source()`.
#[derive(Debug, thiserror::Error)]
pub enum Lost {
    /// A read or write on the socket failed (`EPIPE`, `ECONNRESET`, ...).
    #[error("{what}: {cause}")]
    Io {
        what: &'static str,
        cause: std::io::Error,
    },
    /// tallyd closed the connection without saying why (it stopped, or was killed).
    #[error("tallyd closed the connection")]
    Closed,
    /// tallyd closed the connection and said why first (`error idle ...`,
    /// `error too many connections`).
    #[error("tallyd closed the connection: {0}")]
    ClosedBy(String),
    /// No progress (no reply, no room to write) within `Options::io_timeout`; the connection
    /// is dropped, since a late reply could no longer be matched.
    #[error("no progress within {0:?} (io_timeout)")]
    Timeout(Duration),
}

/// Everything an operation of the client can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Connecting (and tallyd's first answer) failed on every attempt `Options::connect`
    /// allowed.
    #[error("cannot connect to tallyd at {}: {attempts} attempts in {elapsed:?}, the last: {last}", socket.display())]
    Connect {
        socket: PathBuf,
        attempts: u32,
        elapsed: Duration,
        last: String,
    },
    /// The connection ended. Event lines sent outside a batch since the last acknowledgement
    /// (`flush`, `sync`, a correction) may or may not have counted: `unacknowledged` says how
    /// many. The next operation connects again. Send under a batch to retry without counting
    /// twice.
    #[error("connection to tallyd lost ({cause}); {unacknowledged} event lines sent since the last acknowledgement may or may not have counted")]
    ConnectionLost { unacknowledged: u64, cause: Lost },
    /// tallyd answered a control line with `error <reason> <message>` (a correction it cannot
    /// apply, `!sync` with a failed journal write, a batch it refuses): nothing of it changed.
    #[error("tallyd refused {what}: {reason}: {message}")]
    Refused {
        what: &'static str,
        reason: String,
        message: String,
    },
    /// tallyd does not know `!batch` (it answered `unknown_command`): it predates batches.
    #[error("tallyd does not support batches (it answered `!batch` with unknown_command); upgrade tallyd")]
    BatchesUnsupported,
    /// Adding the line would take the batch past `Options::max_batch_bytes`: the client keeps
    /// every line of a batch until it is acknowledged, so it refuses to grow one beyond that.
    /// The batch is still open without this line: commit it and start another.
    #[error("batch {id:?}: adding this line would exceed max_batch_bytes ({limit} bytes); commit it and start another batch")]
    BatchTooLarge { id: String, limit: usize },
    /// The batch was sent `attempts` times without an answer to `!commit`; whether it counted
    /// is unknown until it is sent again under the same id (which counts it at most once).
    #[error("batch {id:?} unacknowledged after {attempts} attempts (the last: {last}); send it again under the same id")]
    BatchUnacknowledged {
        id: String,
        attempts: u32,
        last: Box<Error>,
    },
    /// The batch was already committed, aborted or refused: start a new one.
    #[error("batch {id:?} is over (committed, aborted or refused); open a new one")]
    BatchOver { id: String },
    /// An argument the client refuses before sending: it would change the line's meaning (a
    /// space in a key splits it into two fields) or is not a line of this kind.
    #[error("invalid {field} {value:?}: {why}")]
    Invalid {
        field: &'static str,
        value: String,
        why: &'static str,
    },
    /// A reply the protocol does not allow here; the connection is dropped.
    #[error("unexpected reply from tallyd to {to}: {reply:?}")]
    Protocol { to: &'static str, reply: String },
}

impl Error {
    /// Whether the connection ended: the operation may be retried on a new one (the client
    /// connects again by itself).
    pub fn is_connection_lost(&self) -> bool {
        matches!(self, Error::ConnectionLost { .. })
    }
}
