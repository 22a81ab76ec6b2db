//! What the blocking and the tokio client share, without I/O: queueing lines, reading answers
//! into results, the open batch (its lines kept for a retry) and what a lost connection
//! leaves. Each driver moves the bytes and waits; every decision is here.

use std::io;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use crate::error::{Error, Lost};
use crate::line::{self, Event};
use crate::options::Options;
use crate::reply::{Rejection, Reply};
use crate::session::{Answer, Control, Session, Ticket, Wire};

/// What tallyd counted: the answer to `!flush`, or to the `!commit` of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tally {
    /// Event lines accepted (since the previous `!flush` on this connection; in the batch).
    pub accepted: u64,
    /// Lines rejected, for any reason (a refused correction too).
    pub rejected: u64,
    /// The rejected lines with their reasons, as tallyd reported them (up to
    /// `Options::max_rejections`). In a batch, `line` counts the batch's lines from 1.
    pub rejections: Vec<Rejection>,
    /// Rejections beyond `Options::max_rejections`, counted only.
    pub rejections_not_kept: u64,
}

/// How a batch ended: both mean it counts exactly once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// This copy was committed (durable in tallyd's journal) and counts.
    Committed(Tally),
    /// A copy under this id was committed before: nothing of this copy counted.
    Duplicate,
}

/// The open batch: its lines are kept until `!commit` is answered, to be sent again under
/// the same id on a new connection.
pub(crate) struct BatchState {
    pub(crate) id: String,
    lines: Vec<u8>,
    count: u64,
    /// `!batch` was answered `ok` on the current connection, and every line kept so far was
    /// queued on it.
    open_here: bool,
}

/// The requests a caller may pipeline: sent at once, answered later by `answer(ticket)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    Ping,
    Flush,
    Sync,
}

pub(crate) struct Core {
    pub(crate) options: Options,
    pub(crate) session: Session,
    pub(crate) wire: Wire,
    pub(crate) batch: Option<BatchState>,
    line: String,
}

impl Core {
    pub(crate) fn new(options: Options) -> Core {
        Core {
            session: Session::new(options.max_rejections),
            options,
            wire: Wire::default(),
            batch: None,
            line: String::new(),
        }
    }

    /// A new connection: fresh bookkeeping, and `!errors` first so that every rejected line
    /// is answered with its reason.
    pub(crate) fn connection_started(&mut self) -> Ticket {
        self.session = Session::new(self.options.max_rejections);
        self.wire = Wire::default();
        if let Some(b) = &mut self.batch {
            b.open_here = false;
        }
        self.queue(Control::Errors, "!errors\n")
    }

    /// The connection ended because of `cause`: what the caller is told.
    pub(crate) fn lost(&mut self, cause: Lost) -> Error {
        let cause = match (cause, self.session.closing.take()) {
            (Lost::Closed | Lost::Io { .. }, Some(why)) => Lost::ClosedBy(why),
            (cause, _) => cause,
        };
        let unacknowledged = self.session.unacknowledged();
        self.session = Session::new(self.options.max_rejections);
        self.wire = Wire::default();
        if let Some(b) = &mut self.batch {
            b.open_here = false;
        }
        Error::ConnectionLost {
            unacknowledged,
            cause,
        }
    }

    /// Whether the bytes waiting to be written have reached the write buffer's size.
    pub(crate) fn buffer_full(&self) -> bool {
        self.wire.unsent().len() >= self.options.write_buffer_bytes
    }

    pub(crate) fn queue(&mut self, control: Control, line: &str) -> Ticket {
        self.wire.queue(line.as_bytes());
        self.session.control(control, true)
    }

    pub(crate) fn request(&mut self, request: Request) -> Ticket {
        match request {
            Request::Ping => self.queue(Control::Ping, "!ping\n"),
            Request::Flush => self.queue(Control::Flush, "!flush\n"),
            Request::Sync => self.queue(Control::Sync, "!sync\n"),
        }
    }

    pub(crate) fn event(&mut self, event: &Event) -> Result<(), Error> {
        self.line.clear();
        event.write_line(&mut self.line)?;
        self.wire.queue(self.line.as_bytes());
        self.session.events(1, true);
        Ok(())
    }

    pub(crate) fn raw_line(&mut self, line: &str) -> Result<(), Error> {
        let line = line::raw_line(line)?;
        self.wire.queue(line.as_bytes());
        self.session.events(1, true);
        Ok(())
    }

    /// Counts whole lines the caller queues itself, in chunks (`send_lines`).
    pub(crate) fn raw_lines(&mut self, lines: &[u8]) -> Result<(), Error> {
        let n = line::count_lines(lines)?;
        self.session.events(n, true);
        Ok(())
    }

    /// The chunks `send_lines` queues one by one, writing each out once the buffer is full,
    /// so that a large buffer is never copied whole.
    pub(crate) fn chunk_bytes(&self) -> usize {
        self.options.write_buffer_bytes.max(1)
    }

    pub(crate) fn set(
        &mut self,
        counter: &str,
        key: &str,
        value: i64,
        at: Option<u64>,
    ) -> Result<Ticket, Error> {
        let line = line::set_line(counter, key, value, at)?;
        Ok(self.queue(Control::Correction, &line))
    }

    pub(crate) fn forget(&mut self, counter: Option<&str>, key: &str) -> Result<Ticket, Error> {
        let line = line::forget_line(counter, key)?;
        Ok(self.queue(Control::Correction, &line))
    }

    // ---- answers into results ----

    /// `ok`, or why not.
    pub(crate) fn ok(answer: Answer, control: Control) -> Result<(), Error> {
        match answer.reply {
            Reply::Ok => Ok(()),
            reply => Err(refusal(reply, control)),
        }
    }

    pub(crate) fn pong(answer: Answer) -> Result<(), Error> {
        match answer.reply {
            Reply::Pong => Ok(()),
            reply => Err(refusal(reply, Control::Ping)),
        }
    }

    pub(crate) fn tally(answer: Answer, control: Control) -> Result<Tally, Error> {
        match answer.reply {
            Reply::Counts { accepted, rejected } => Ok(Tally {
                accepted,
                rejected,
                rejections: answer.rejections,
                rejections_not_kept: answer.rejections_not_kept,
            }),
            reply => Err(refusal(reply, control)),
        }
    }

    // ---- the batch ----

    pub(crate) fn begin_batch(&mut self, id: &str) -> Result<(), Error> {
        line::batch_line(id)?;
        self.batch = Some(BatchState {
            id: id.to_string(),
            lines: Vec::new(),
            count: 0,
            open_here: false,
        });
        Ok(())
    }

    fn open_batch(&mut self) -> Result<&mut BatchState, Error> {
        self.batch
            .as_mut()
            .ok_or_else(|| Error::BatchOver { id: String::new() })
    }

    /// Whether the open batch must be (re)opened on this connection before its commit.
    pub(crate) fn batch_needs_opening(&self) -> bool {
        self.batch.as_ref().is_some_and(|b| !b.open_here)
    }

    /// `!batch <id>` on this connection.
    pub(crate) fn open_batch_here(&mut self) -> Result<Ticket, Error> {
        let line = line::batch_line(&self.open_batch()?.id)?;
        Ok(self.queue(Control::Batch, &line))
    }

    /// The answer to `!batch`: on `ok`, every line kept so far is queued after it.
    pub(crate) fn batch_opened(&mut self, answer: Answer) -> Result<(), Error> {
        match answer.reply {
            Reply::Ok => {
                let b = self.batch.as_mut().expect("a batch is open");
                b.open_here = true;
                self.wire.queue(&b.lines);
                self.session.events(b.count, false);
                Ok(())
            }
            reply => {
                self.batch = None;
                Err(refusal(reply, Control::Batch))
            }
        }
    }

    /// Keeps one more line of the batch and queues it when the batch is open on this
    /// connection (else the commit sends it with the others).
    pub(crate) fn batch_add(&mut self, line: &str) -> Result<(), Error> {
        let limit = self.options.max_batch_bytes;
        let b = self.open_batch()?;
        if b.lines.len() + line.len() > limit {
            return Err(Error::BatchTooLarge {
                id: b.id.clone(),
                limit,
            });
        }
        b.lines.extend_from_slice(line.as_bytes());
        b.count += 1;
        if b.open_here {
            self.wire.queue(line.as_bytes());
            self.session.events(1, false);
        }
        Ok(())
    }

    pub(crate) fn batch_event(&mut self, event: &Event) -> Result<(), Error> {
        let mut line = std::mem::take(&mut self.line);
        line.clear();
        let added = event
            .write_line(&mut line)
            .and_then(|()| self.batch_add(&line));
        self.line = line;
        added
    }

    pub(crate) fn queue_commit(&mut self) -> Ticket {
        self.queue(Control::Commit, "!commit\n")
    }

    /// The answer to `!commit`; the batch is over unless the connection was lost.
    pub(crate) fn committed(&mut self, answer: Answer) -> Result<Outcome, Error> {
        self.batch = None;
        let batch_line = self.session.batch_line();
        match answer.reply {
            Reply::Duplicate => Ok(Outcome::Duplicate),
            _ => {
                let mut tally = Core::tally(answer, Control::Commit)?;
                for r in &mut tally.rejections {
                    r.line = r.line.map(|n| n - batch_line);
                }
                Ok(Outcome::Committed(tally))
            }
        }
    }

    /// Drops the open batch; `!abort` is queued when it is open on this connection (`keep`:
    /// whether its answer is awaited).
    pub(crate) fn abort_batch(&mut self, keep: bool) -> Option<Ticket> {
        let b = self.batch.take()?;
        b.open_here.then(|| {
            self.wire.queue(b"!abort\n");
            self.session.control(Control::Abort, keep)
        })
    }

    /// After connection attempt `attempts` (the first started at `started`): done, or the
    /// delay before the next attempt, or the error once `Options::connect` allows no more.
    pub(crate) fn after_connect(
        &self,
        attempts: u32,
        started: Instant,
        result: Result<(), Error>,
    ) -> ControlFlow<Result<(), Error>, Duration> {
        let last = match result {
            Ok(()) => return ControlFlow::Break(Ok(())),
            Err(Error::ConnectionLost { cause, .. }) => cause.to_string(),
            Err(e) => e.to_string(),
        };
        match self.options.connect.next_delay(attempts, started) {
            Some(delay) => ControlFlow::Continue(delay),
            None => ControlFlow::Break(Err(Error::Connect {
                socket: self.options.socket.clone(),
                attempts,
                elapsed: started.elapsed(),
                last,
            })),
        }
    }

    /// After attempt `attempts` at opening the batch: done, or another attempt on a new
    /// connection (nothing of the batch was sent yet).
    pub(crate) fn after_open(
        &mut self,
        attempts: u32,
        result: Result<(), Error>,
    ) -> ControlFlow<Result<(), Error>> {
        match result {
            Err(e) if e.is_connection_lost() && attempts < self.options.batch_attempts => {
                ControlFlow::Continue(())
            }
            Err(e) => {
                self.batch = None;
                ControlFlow::Break(Err(e))
            }
            Ok(()) => ControlFlow::Break(Ok(())),
        }
    }

    /// After attempt `attempts` at committing: the outcome (the batch is over), another
    /// attempt on a new connection, or `BatchUnacknowledged` once `Options::batch_attempts`
    /// are spent (the batch stays open, to be committed again).
    pub(crate) fn after_commit(
        &mut self,
        attempts: u32,
        result: Result<Outcome, Error>,
    ) -> ControlFlow<Result<Outcome, Error>> {
        match result {
            Err(e) if e.is_connection_lost() || matches!(e, Error::Connect { .. }) => {
                if attempts < self.options.batch_attempts {
                    return ControlFlow::Continue(());
                }
                let id = self
                    .batch
                    .as_ref()
                    .map_or_else(String::new, |b| b.id.clone());
                ControlFlow::Break(Err(Error::BatchUnacknowledged {
                    id,
                    attempts,
                    last: Box::new(e),
                }))
            }
            result => {
                self.batch = None;
                ControlFlow::Break(result)
            }
        }
    }

    /// Whether the batch `id` is still open (not committed, aborted or refused).
    pub(crate) fn batch_is_open(&self, id: &str) -> Result<(), Error> {
        match &self.batch {
            Some(_) => Ok(()),
            None => Err(Error::BatchOver { id: id.to_string() }),
        }
    }
}

/// How moving bytes failed: the connection was lost, or a reply broke the protocol.
pub(crate) enum Fail {
    Lost(Lost),
    Error(Error),
}

impl Core {
    /// A failed pump: the connection is dropped, and this is what the caller is told.
    pub(crate) fn failed(&mut self, fail: Fail) -> Error {
        match fail {
            Fail::Lost(cause) => self.lost(cause),
            Fail::Error(e) => {
                self.lost(Lost::Closed);
                e
            }
        }
    }

    /// One non-blocking read into `buf`: whether to read again.
    pub(crate) fn on_read(&mut self, result: io::Result<usize>, buf: &[u8]) -> Result<bool, Fail> {
        match result {
            Ok(0) => {
                self.wire.eof = true;
                Ok(false)
            }
            Ok(n) => {
                self.wire
                    .received(&buf[..n], &mut self.session)
                    .map_err(Fail::Error)?;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(true),
            Err(cause) => Err(Fail::Lost(Lost::Io {
                what: "read",
                cause,
            })),
        }
    }

    /// One non-blocking write of `wire.unsent()`: whether to write again.
    pub(crate) fn on_write(&mut self, result: io::Result<usize>) -> Result<bool, Fail> {
        match result {
            Ok(n) => {
                self.wire.wrote(n);
                Ok(!self.wire.unsent().is_empty())
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(true),
            Err(cause) => Err(Fail::Lost(Lost::Io {
                what: "write",
                cause,
            })),
        }
    }
}

/// A reply other than the one expected: tallyd's refusal, or a protocol error.
fn refusal(reply: Reply, control: Control) -> Error {
    match reply {
        Reply::Error { reason, .. } if control == Control::Batch && reason == "unknown_command" => {
            Error::BatchesUnsupported
        }
        Reply::Error { reason, message } => Error::Refused {
            what: control.what(),
            reason,
            message,
        },
        Reply::Rejected(r) if control == Control::Batch && r.reason == "unknown_command" => {
            Error::BatchesUnsupported
        }
        Reply::Rejected(r) => Error::Refused {
            what: control.what(),
            reason: r.reason,
            message: format!("tallyd rejected the line \"{}\"", r.excerpt),
        },
        reply => Error::Protocol {
            to: control.what(),
            reply: format!("{reply:?}"),
        },
    }
}
