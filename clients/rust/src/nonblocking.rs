//! [`Client`] and [`Batch`] on tokio (feature `tokio`): the blocking client's operations as
//! `async fn`s, on a tokio `UnixStream` waited on for both directions at once, so that while
//! the client waits to write (tallyd applying back-pressure) it keeps reading tallyd's replies.
//! Every decision is the shared core's; only the waiting differs from `blocking`.

use std::ops::ControlFlow;
use std::os::fd::AsRawFd;
use std::time::Instant;

use tokio::io::Interest;
use tokio::net::UnixStream;

use crate::core::{Core, Fail, Outcome, Request, Tally};
use crate::error::{Error, Lost};
use crate::line::Event;
use crate::options::Options;
use crate::session::{Answer, Control, Ticket};
use crate::sys;

/// A connection to tallyd's stream socket that connects again when it is lost: the async
/// twin of [`crate::Client`], with the same operations and guarantees.
pub struct Client {
    core: Core,
    stream: Option<UnixStream>,
}

impl Client {
    /// Connects (with `options.connect`'s backoff) and turns on `!errors`.
    pub async fn connect(options: Options) -> Result<Client, Error> {
        let mut client = Client {
            core: Core::new(options),
            stream: None,
        };
        client.reconnect().await?;
        Ok(client)
    }

    /// Queues one event line (written once the buffer is full, or by the next control line).
    pub async fn send(&mut self, event: &Event) -> Result<(), Error> {
        self.ready().await?;
        self.core.event(event)?;
        self.drain_if_full().await
    }

    /// Queues one event line given as text; control lines are refused.
    pub async fn send_line(&mut self, line: &str) -> Result<(), Error> {
        self.ready().await?;
        self.core.raw_line(line)?;
        self.drain_if_full().await
    }

    /// Queues whole event lines at once, each ending in `\n`; control lines are refused.
    pub async fn send_lines(&mut self, lines: &[u8]) -> Result<(), Error> {
        self.ready().await?;
        self.core.raw_lines(lines)?;
        for chunk in lines.chunks(self.core.chunk_bytes()) {
            self.core.wire.queue(chunk);
            self.drain_if_full().await?;
        }
        Ok(())
    }

    /// `!flush`: accepted and rejected since the previous flush, once committed.
    pub async fn flush(&mut self) -> Result<Tally, Error> {
        let answer = self.call(Request::Flush).await?;
        Core::tally(answer, Control::Flush)
    }

    /// `!sync`: once every earlier line is durable in tallyd's journal.
    pub async fn sync(&mut self) -> Result<(), Error> {
        let answer = self.call(Request::Sync).await?;
        Core::ok(answer, Control::Sync)
    }

    /// `!ping`: once tallyd has taken every earlier line.
    pub async fn ping(&mut self) -> Result<(), Error> {
        let answer = self.call(Request::Ping).await?;
        Core::pong(answer)
    }

    /// `!set <counter> <key> <value> [@<unix_ms>]`, answered once committed.
    pub async fn set(
        &mut self,
        counter: &str,
        key: &str,
        value: i64,
        at: Option<u64>,
    ) -> Result<(), Error> {
        self.ready().await?;
        let t = self.core.set(counter, key, value, at)?;
        self.correction(t).await
    }

    /// `!forget <counter> <key>`, answered once committed.
    pub async fn forget(&mut self, counter: &str, key: &str) -> Result<(), Error> {
        self.ready().await?;
        let t = self.core.forget(Some(counter), key)?;
        self.correction(t).await
    }

    /// `!forget * <key>`, answered once committed.
    pub async fn forget_everywhere(&mut self, key: &str) -> Result<(), Error> {
        self.ready().await?;
        let t = self.core.forget(None, key)?;
        self.correction(t).await
    }

    /// Opens a batch under `id`; see [`crate::Client::batch`].
    pub async fn batch(&mut self, id: &str) -> Result<Batch<'_>, Error> {
        self.core.begin_batch(id)?;
        let mut attempts = 0;
        loop {
            attempts += 1;
            let result = self.open_batch().await;
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

    /// Sends a control line without waiting for its answer; see [`Client::answer`].
    pub async fn request(&mut self, request: Request) -> Result<Ticket, Error> {
        self.ready().await?;
        let t = self.core.request(request);
        self.drain_if_full().await?;
        Ok(t)
    }

    /// Waits for the answer to a request (writing what is queued meanwhile).
    pub async fn answer(&mut self, ticket: Ticket) -> Result<Answer, Error> {
        self.pump(|core| core.session.answered(ticket)).await?;
        Ok(self.core.session.take(ticket).expect("answered"))
    }

    /// Event lines sent outside batches since the last acknowledgement.
    pub fn unacknowledged(&self) -> u64 {
        self.core.session.unacknowledged()
    }

    /// Bytes queued and not yet written to the socket.
    pub fn buffered_bytes(&self) -> usize {
        self.core.wire.unsent().len()
    }

    async fn call(&mut self, request: Request) -> Result<Answer, Error> {
        let t = self.request(request).await?;
        self.answer(t).await
    }

    async fn correction(&mut self, t: Ticket) -> Result<(), Error> {
        let answer = self.answer(t).await?;
        Core::ok(answer, Control::Correction)
    }

    async fn open_batch(&mut self) -> Result<(), Error> {
        self.ready().await?;
        let t = self.core.open_batch_here()?;
        let answer = self.answer(t).await?;
        self.core.batch_opened(answer)?;
        self.drain_if_full().await
    }

    async fn commit_once(&mut self) -> Result<Outcome, Error> {
        if self.core.batch_needs_opening() {
            self.open_batch().await?;
        }
        let t = self.core.queue_commit();
        let answer = self.answer(t).await?;
        self.core.committed(answer)
    }

    /// As the blocking client's: connects again after a lost connection, and checks a quiet
    /// one before writing into it.
    async fn ready(&mut self) -> Result<(), Error> {
        if self.stream.is_some() && self.core.session.quiet() && self.core.wire.unsent().is_empty()
        {
            let fd = self.stream.as_ref().map(AsRawFd::as_raw_fd);
            if fd.is_some_and(sys::closed_while_quiet) {
                self.stream = None;
                self.core.lost(Lost::Closed);
            }
        }
        if self.stream.is_none() {
            self.reconnect().await?;
        }
        Ok(())
    }

    async fn reconnect(&mut self) -> Result<(), Error> {
        let started = Instant::now();
        let mut attempts = 0;
        loop {
            attempts += 1;
            let result = self.connect_once().await;
            if result.is_err() {
                self.stream = None;
            }
            match self.core.after_connect(attempts, started, result) {
                ControlFlow::Break(result) => return result,
                ControlFlow::Continue(delay) => tokio::time::sleep(delay).await,
            }
        }
    }

    async fn connect_once(&mut self) -> Result<(), Error> {
        let stream = UnixStream::connect(&self.core.options.socket)
            .await
            .map_err(|cause| Error::ConnectionLost {
                unacknowledged: 0,
                cause: Lost::Io {
                    what: "connect",
                    cause,
                },
            })?;
        self.stream = Some(stream);
        let t = self.core.connection_started();
        let answer = self.answer(t).await?;
        Core::ok(answer, Control::Errors)
    }

    async fn drain_if_full(&mut self) -> Result<(), Error> {
        if self.core.buffer_full() {
            self.pump(|core| core.wire.unsent().is_empty()).await?;
        }
        Ok(())
    }

    /// Writes and reads until `done`; a failure drops the connection.
    async fn pump(&mut self, done: impl Fn(&Core) -> bool) -> Result<(), Error> {
        let result = self.pump_inner(done).await;
        if result.is_err() {
            self.stream = None;
        }
        result.map_err(|fail| self.core.failed(fail))
    }

    async fn pump_inner(&mut self, done: impl Fn(&Core) -> bool) -> Result<(), Fail> {
        loop {
            if done(&self.core) {
                return Ok(());
            }
            if self.core.wire.eof {
                return Err(Fail::Lost(Lost::Closed));
            }
            let stream = self.stream.as_ref().ok_or(Fail::Lost(Lost::Closed))?;
            let write = !self.core.wire.unsent().is_empty();
            let interest = if write {
                Interest::READABLE | Interest::WRITABLE
            } else {
                Interest::READABLE
            };
            let ready = match self.core.options.io_timeout {
                None => stream.ready(interest).await,
                Some(t) => tokio::time::timeout(t, stream.ready(interest))
                    .await
                    .map_err(|_| Fail::Lost(Lost::Timeout(t)))?,
            };
            let ready = ready.map_err(|cause| {
                Fail::Lost(Lost::Io {
                    what: "poll",
                    cause,
                })
            })?;
            if ready.is_readable() || ready.is_read_closed() {
                self.read_available()?;
            }
            if write && ready.is_writable() && !self.core.wire.eof {
                self.write_available()?;
            }
        }
    }

    fn read_available(&mut self) -> Result<(), Fail> {
        let mut buf = [0u8; 8192];
        let Some(stream) = self.stream.as_ref() else {
            return Ok(());
        };
        while self.core.on_read(stream.try_read(&mut buf), &buf)? {}
        Ok(())
    }

    fn write_available(&mut self) -> Result<(), Fail> {
        let Some(stream) = self.stream.as_ref() else {
            return Ok(());
        };
        let fd = stream.as_raw_fd();
        loop {
            let unsent = self.core.wire.unsent();
            let result = stream.try_io(Interest::WRITABLE, || sys::send(fd, unsent));
            if !self.core.on_write(result)? {
                return Ok(());
            }
        }
    }
}

/// An open batch; see [`crate::Batch`]. Dropped without `commit`, it is aborted.
pub struct Batch<'c> {
    id: String,
    client: &'c mut Client,
}

impl Batch<'_> {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Adds one event; see [`crate::Batch::add`].
    pub async fn add(&mut self, event: &Event) -> Result<(), Error> {
        self.check_open()?;
        self.client.core.batch_event(event)?;
        self.write_out().await
    }

    /// Adds one event line given as text.
    pub async fn add_line(&mut self, line: &str) -> Result<(), Error> {
        self.check_open()?;
        let line = crate::line::raw_line(line)?;
        self.client.core.batch_add(&line)?;
        self.write_out().await
    }

    /// `!commit`, sent again under the same id after a lost connection; see
    /// [`crate::Batch::commit`].
    pub async fn commit(&mut self) -> Result<Outcome, Error> {
        self.check_open()?;
        let mut attempts = 0;
        loop {
            attempts += 1;
            let result = self.client.commit_once().await;
            if let ControlFlow::Break(result) = self.client.core.after_commit(attempts, result) {
                return result;
            }
        }
    }

    /// `!abort`: nothing of the batch counts.
    pub async fn abort(self) -> Result<(), Error> {
        match self.client.core.abort_batch(true) {
            None => Ok(()),
            Some(t) => match self.client.answer(t).await {
                Ok(answer) => Core::ok(answer, Control::Abort),
                Err(e) if e.is_connection_lost() => Ok(()),
                Err(e) => Err(e),
            },
        }
    }

    fn check_open(&self) -> Result<(), Error> {
        self.client.core.batch_is_open(&self.id)
    }

    async fn write_out(&mut self) -> Result<(), Error> {
        match self.client.drain_if_full().await {
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
