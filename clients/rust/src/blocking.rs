//! [`Client`] and [`Batch`]: the client on a std `UnixStream`, blocking the calling thread.
//! The socket is non-blocking underneath and waited on with poll(2), so that while the client
//! waits to write (tallyd applying back-pressure) it keeps reading tallyd's replies: tallyd
//! closes a connection whose replies are not read, and a client blocked in write(2) could not.

use std::io::Read;
use std::ops::ControlFlow;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use crate::core::{Core, Fail, Outcome, Request, Tally};
use crate::error::{Error, Lost};
use crate::line::Event;
use crate::options::Options;
use crate::session::{Answer, Control, Ticket};
use crate::sys;

/// A connection to tallyd's stream socket that connects again when it is lost.
///
/// Lines are buffered up to `Options::write_buffer_bytes` and written when the buffer is full
/// or a reply is awaited; a write waits while tallyd does not read (back-pressure). After a
/// lost connection the operation that saw it fails with [`Error::ConnectionLost`] and the next
/// one connects again; a [`Batch`] is sent again by itself.
pub struct Client {
    core: Core,
    stream: Option<UnixStream>,
}

impl Client {
    /// Connects (with `options.connect`'s backoff) and turns on `!errors`.
    pub fn connect(options: Options) -> Result<Client, Error> {
        let mut client = Client {
            core: Core::new(options),
            stream: None,
        };
        client.reconnect()?;
        Ok(client)
    }

    /// Queues one event line (written once the buffer is full, or by the next control line).
    pub fn send(&mut self, event: &Event) -> Result<(), Error> {
        self.ready()?;
        self.core.event(event)?;
        self.drain_if_full()
    }

    /// Queues one event line given as text (`downloads report.pdf 5`), as `tallyd send -`
    /// reads them; control lines are refused.
    pub fn send_line(&mut self, line: &str) -> Result<(), Error> {
        self.ready()?;
        self.core.raw_line(line)?;
        self.drain_if_full()
    }

    /// Queues whole event lines at once, each ending in `\n` (a load generator's pre-built
    /// buffer); control lines are refused.
    pub fn send_lines(&mut self, lines: &[u8]) -> Result<(), Error> {
        self.ready()?;
        self.core.raw_lines(lines)?;
        for chunk in lines.chunks(self.core.chunk_bytes()) {
            self.core.wire.queue(chunk);
            self.drain_if_full()?;
        }
        Ok(())
    }

    /// `!flush`: waits until every earlier line of this connection is committed in
    /// PostgreSQL; returns what was accepted and rejected since the previous flush.
    pub fn flush(&mut self) -> Result<Tally, Error> {
        let answer = self.call(Request::Flush)?;
        Core::tally(answer, Control::Flush)
    }

    /// `!sync`: waits until every earlier line of this connection is durable in tallyd's
    /// journal (with the journal disabled, until committed).
    pub fn sync(&mut self) -> Result<(), Error> {
        let answer = self.call(Request::Sync)?;
        Core::ok(answer, Control::Sync)
    }

    /// `!ping`: waits until tallyd has taken every earlier line (not committed them).
    pub fn ping(&mut self) -> Result<(), Error> {
        let answer = self.call(Request::Ping)?;
        Core::pong(answer)
    }

    /// `!set`: `value` becomes the key's total (sum) or kept value (max, min, last), at
    /// `at` (the window of a windowed counter); answered once committed.
    pub fn set(
        &mut self,
        counter: &str,
        key: &str,
        value: i64,
        at: Option<u64>,
    ) -> Result<(), Error> {
        self.ready()?;
        let t = self.core.set(counter, key, value, at)?;
        self.correction(t)
    }

    /// `!forget <counter> <key>`: every row of the key is deleted; answered once committed.
    pub fn forget(&mut self, counter: &str, key: &str) -> Result<(), Error> {
        self.ready()?;
        let t = self.core.forget(Some(counter), key)?;
        self.correction(t)
    }

    /// `!forget * <key>`: the key forgotten in every counter whose key type accepts it.
    pub fn forget_everywhere(&mut self, key: &str) -> Result<(), Error> {
        self.ready()?;
        let t = self.core.forget(None, key)?;
        self.correction(t)
    }

    /// Opens a batch under `id` (1 to 256 bytes of text, no whitespace): its events count
    /// whole, exactly once, when [`Batch::commit`] returns, however often it is sent.
    /// [`Error::BatchesUnsupported`] when tallyd predates batches.
    pub fn batch(&mut self, id: &str) -> Result<Batch<'_>, Error> {
        self.core.begin_batch(id)?;
        let mut attempts = 0;
        loop {
            attempts += 1;
            let result = self.open_batch();
            if let ControlFlow::Break(result) = self.core.after_open(attempts, result) {
                result?;
                break;
            }
        }
        Ok(Batch {
            id: id.to_string(),
            client: self,
        })
    }

    /// Sends a control line without waiting for its answer: pipelining many lines and
    /// requests, reading the answers later with [`Client::answer`], in any order.
    pub fn request(&mut self, request: Request) -> Result<Ticket, Error> {
        self.ready()?;
        let t = self.core.request(request);
        self.drain_if_full()?;
        Ok(t)
    }

    /// Waits for the answer to a request (writing what is queued meanwhile).
    pub fn answer(&mut self, ticket: Ticket) -> Result<Answer, Error> {
        self.pump(|core| core.session.answered(ticket))?;
        Ok(self.core.session.take(ticket).expect("answered"))
    }

    /// Event lines sent outside batches since the last acknowledgement (`flush`, `sync`, a
    /// correction): those a lost connection leaves in doubt.
    pub fn unacknowledged(&self) -> u64 {
        self.core.session.unacknowledged()
    }

    /// Bytes queued and not yet written to the socket (at most about
    /// `Options::write_buffer_bytes` plus one line).
    pub fn buffered_bytes(&self) -> usize {
        self.core.wire.unsent().len()
    }

    fn call(&mut self, request: Request) -> Result<Answer, Error> {
        let t = self.request(request)?;
        self.answer(t)
    }

    fn correction(&mut self, t: Ticket) -> Result<(), Error> {
        let answer = self.answer(t)?;
        Core::ok(answer, Control::Correction)
    }

    fn open_batch(&mut self) -> Result<(), Error> {
        self.ready()?;
        let t = self.core.open_batch_here()?;
        let answer = self.answer(t)?;
        self.core.batch_opened(answer)?;
        self.drain_if_full()
    }

    fn commit_once(&mut self) -> Result<Outcome, Error> {
        if self.core.batch_needs_opening() {
            self.open_batch()?;
        }
        let t = self.core.queue_commit();
        let answer = self.answer(t)?;
        self.core.committed(answer)
    }

    /// Makes sure a connection is there: connects again after a lost one, and before the
    /// first line after a quiet spell checks that tallyd has not closed this one meanwhile
    /// (an idle timeout, or tallyd restarted), so that nothing is written into a closed
    /// connection.
    fn ready(&mut self) -> Result<(), Error> {
        if self.stream.is_some() && self.core.session.quiet() && self.core.wire.unsent().is_empty()
        {
            let fd = self.stream.as_ref().map(AsRawFd::as_raw_fd);
            if fd.is_some_and(sys::closed_while_quiet) {
                self.stream = None;
                self.core.lost(Lost::Closed);
            }
        }
        if self.stream.is_none() {
            self.reconnect()?;
        }
        Ok(())
    }

    fn reconnect(&mut self) -> Result<(), Error> {
        let started = Instant::now();
        let mut attempts = 0;
        loop {
            attempts += 1;
            let result = self.connect_once();
            if result.is_err() {
                self.stream = None;
            }
            match self.core.after_connect(attempts, started, result) {
                ControlFlow::Break(result) => return result,
                ControlFlow::Continue(delay) => std::thread::sleep(delay),
            }
        }
    }

    fn connect_once(&mut self) -> Result<(), Error> {
        let stream = UnixStream::connect(&self.core.options.socket)
            .and_then(|s| s.set_nonblocking(true).map(|()| s))
            .map_err(|cause| Error::ConnectionLost {
                unacknowledged: 0,
                cause: Lost::Io {
                    what: "connect",
                    cause,
                },
            })?;
        self.stream = Some(stream);
        let t = self.core.connection_started();
        let answer = self.answer(t)?;
        Core::ok(answer, Control::Errors)
    }

    /// Writes out the buffer once it is full, waiting while tallyd does not read.
    fn drain_if_full(&mut self) -> Result<(), Error> {
        if self.core.buffer_full() {
            self.pump(|core| core.wire.unsent().is_empty())?;
        }
        Ok(())
    }

    /// Writes and reads until `done`; a failure drops the connection.
    fn pump(&mut self, done: impl Fn(&Core) -> bool) -> Result<(), Error> {
        let result = self.pump_inner(done);
        if result.is_err() {
            self.stream = None;
        }
        result.map_err(|fail| self.core.failed(fail))
    }

    fn pump_inner(&mut self, done: impl Fn(&Core) -> bool) -> Result<(), Fail> {
        loop {
            if done(&self.core) {
                return Ok(());
            }
            if self.core.wire.eof {
                return Err(Fail::Lost(Lost::Closed));
            }
            let stream = self.stream.as_ref().ok_or(Fail::Lost(Lost::Closed))?;
            let write = !self.core.wire.unsent().is_empty();
            let timeout = self.core.options.io_timeout;
            let ready = match sys::poll(stream.as_raw_fd(), write, timeout) {
                Ok(Some(ready)) => ready,
                Ok(None) => return Err(Fail::Lost(Lost::Timeout(timeout.unwrap_or_default()))),
                Err(cause) => {
                    return Err(Fail::Lost(Lost::Io {
                        what: "poll",
                        cause,
                    }))
                }
            };
            if ready.read {
                self.read_available()?;
            }
            if ready.write && !self.core.wire.eof {
                self.write_available()?;
            }
        }
    }

    /// Reads what the socket holds, without waiting; each complete reply line is taken.
    fn read_available(&mut self) -> Result<(), Fail> {
        let mut buf = [0u8; 8192];
        let Some(mut stream) = self.stream.as_ref() else {
            return Ok(());
        };
        while self.core.on_read(stream.read(&mut buf), &buf)? {}
        Ok(())
    }

    fn write_available(&mut self) -> Result<(), Fail> {
        let Some(stream) = self.stream.as_ref() else {
            return Ok(());
        };
        let fd = stream.as_raw_fd();
        while !self.core.wire.unsent().is_empty() {
            let result = sys::send(fd, self.core.wire.unsent());
            if !self.core.on_write(result)? {
                return Ok(());
            }
        }
        Ok(())
    }
}

/// An open batch: lines added are sent at once and kept until [`Batch::commit`] is answered,
/// so that a lost connection sends them again, under the same id, on the next one. Dropped
/// without `commit`, it is aborted (nothing of it counts).
pub struct Batch<'c> {
    id: String,
    client: &'c mut Client,
}

impl Batch<'_> {
    /// The batch's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Adds one event; [`Error::BatchTooLarge`] (and the batch stays as it was) when it would
    /// take the batch past `Options::max_batch_bytes`.
    pub fn add(&mut self, event: &Event) -> Result<(), Error> {
        self.check_open()?;
        self.client.core.batch_event(event)?;
        self.write_out()
    }

    /// Adds one event line given as text (`downloads report.pdf 5`).
    pub fn add_line(&mut self, line: &str) -> Result<(), Error> {
        self.check_open()?;
        let line = crate::line::raw_line(line)?;
        self.client.core.batch_add(&line)?;
        self.write_out()
    }

    /// `!commit`: [`Outcome::Committed`] or [`Outcome::Duplicate`], both meaning the batch
    /// counts exactly once. A lost connection is retried (connect, `!batch` under the same
    /// id, the lines, `!commit`) up to `Options::batch_attempts` times; then
    /// [`Error::BatchUnacknowledged`], and `commit` may be called again.
    pub fn commit(&mut self) -> Result<Outcome, Error> {
        self.check_open()?;
        let mut attempts = 0;
        loop {
            attempts += 1;
            let result = self.client.commit_once();
            if let ControlFlow::Break(result) = self.client.core.after_commit(attempts, result) {
                return result;
            }
        }
    }

    /// `!abort`: nothing of the batch counts.
    pub fn abort(self) -> Result<(), Error> {
        match self.client.core.abort_batch(true) {
            None => Ok(()),
            Some(t) => match self.client.answer(t) {
                Ok(answer) => Core::ok(answer, Control::Abort),
                // A connection that ends before `!commit` counts none of the batch.
                Err(e) if e.is_connection_lost() => Ok(()),
                Err(e) => Err(e),
            },
        }
    }

    fn check_open(&self) -> Result<(), Error> {
        self.client.core.batch_is_open(&self.id)
    }

    /// Writes the buffer out once full; a lost connection is left for `commit` to retry.
    fn write_out(&mut self) -> Result<(), Error> {
        match self.client.drain_if_full() {
            Err(e) if e.is_connection_lost() => Ok(()),
            result => result,
        }
    }
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        // No-op once committed or aborted.
        self.client.core.abort_batch(false);
    }
}
