//! One stream connection: reading its bytes (within the memory cap and the journal's room),
//! taking its lines, and answering `!flush`, `!sync`, `!ping` and `!errors` in order.

use std::collections::VecDeque;
use std::io::{self, Write as _};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;

use crate::batch::{Answer, Batches, Committed};
use crate::clock::now_ms;
use crate::conns::{read_some, ConnCtx, Protocol, Read};
use crate::events;
use crate::ingest::{Held, Ingest, Outcome, Router};
use crate::protocol::{self, BatchControl, BatchRefusal, Control, Line, LineBuffer, Reject};

/// A reply the client does not read within this time ends the connection, so that a client that
/// never reads cannot hold a task (and a graceful stop) forever.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

async fn reply(wr: &mut OwnedWriteHalf, text: &[u8]) -> io::Result<()> {
    if text.is_empty() {
        return Ok(());
    }
    match tokio::time::timeout(WRITE_TIMEOUT, wr.write_all(text)).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "client does not read replies",
        )),
    }
}

/// The counts a `!flush` answers: lines accepted and rejected since the previous one.
#[derive(Default)]
struct FlushPeriods {
    accepted_at: u64,
    rejected_at: u64,
    /// Overflow rejections not yet charged to a period.
    overflow_carry: u64,
}

impl FlushPeriods {
    /// Closes the period that ends with `accepted` and `rejected` lines so far. Overflows may
    /// belong to lines read after this `!flush` in the same buffer: whatever exceeds this
    /// period's accepted lines is charged to the next.
    fn close(&mut self, accepted: u64, rejected: u64, overflows: u64) -> (u64, u64) {
        let owed = overflows + self.overflow_carry;
        let taken = owed.min(accepted - self.accepted_at);
        self.overflow_carry = owed - taken;
        let period = (
            accepted - self.accepted_at - taken,
            rejected - self.rejected_at + taken,
        );
        self.accepted_at = accepted;
        self.rejected_at = rejected;
        period
    }
}

/// A connection's `!commit`s being written and claimed at once, at most: past it, the
/// connection stops reading until the first is answered. Each holds its batch's lines (at most
/// `batch.max_bytes`) until it is claimed.
const COMMITS_IN_FLIGHT: usize = 4;

/// The most bytes of a rejected line quoted back in a `rejected` reply.
const EXCERPT_BYTES: usize = 64;

/// A rejected line as quoted in a reply: at most `EXCERPT_BYTES` bytes, invalid UTF-8 replaced,
/// escaped so that it stays on one line, in double quotes; `...` after the quote if cut.
fn excerpt(line: &[u8]) -> String {
    let shown = &line[..line.len().min(EXCERPT_BYTES)];
    let mut out = format!("\"{}\"", String::from_utf8_lossy(shown).escape_debug());
    if line.len() > EXCERPT_BYTES {
        out.push_str("...");
    }
    out
}

/// Something a stream connection owes its client, in the order of its lines.
enum Reply {
    /// A control line, with the connection's accepted and rejected counts when it was read.
    Control(Control, u64, u64),
    /// A rejected line, answered only after `!errors`: its number on the connection, the
    /// reason and an excerpt.
    Rejected(u64, Reject, String),
    /// `!batch` or `!abort` taken, or a batch's control line refused: answered at once.
    Batch(Result<(), BatchRefusal>),
    /// `!commit`: answered once the batch is durable (and its claim decided, or timed out).
    /// The connection reads on meanwhile; the replies after it wait for it.
    Commit(Commit),
}

/// A committed batch on its way to be answered.
struct Commit {
    id: String,
    accepted: u64,
    rejected: u64,
    work: Work,
}

/// Where a `!commit` is.
enum Work {
    /// Refused: the batch was larger than `batch.max_bytes`.
    TooLarge,
    /// Not started: an earlier `!commit` of this connection under the same id is in flight,
    /// and a connection's copies are decided in the order it sent them.
    Deferred(Vec<u8>),
    Running(tokio::task::JoinHandle<Committed>),
    Done(Committed),
}

impl Commit {
    /// Whether its answer can be written without waiting.
    fn ready(&self) -> bool {
        match &self.work {
            Work::TooLarge | Work::Done(_) => true,
            Work::Running(h) => h.is_finished(),
            Work::Deferred(_) => false,
        }
    }
}

/// Resolves when the first running `!commit` in `replies` is done (never, if none runs).
async fn first_commit_done(replies: &mut VecDeque<Reply>) {
    let running = replies.iter_mut().find_map(|r| match r {
        Reply::Commit(Commit { work, .. }) if matches!(work, Work::Running(_)) => Some(work),
        _ => None,
    });
    let Some(work) = running else {
        return std::future::pending().await;
    };
    if let Work::Running(h) = work {
        let done = h.await.unwrap_or_else(|e| Err(e.to_string()));
        *work = Work::Done(done);
    }
}

/// The connection's open batch: its id, and the connection's counts when it opened.
struct OpenBatch {
    id: String,
    accepted: u64,
    rejected: u64,
}

/// Why a connection stopped being served.
enum Stop {
    Cancelled,
    Io(io::Error),
}

/// One stream connection's state between its reads.
struct StreamConn<'a> {
    ingest: &'a Ingest,
    /// None without a journal: `!batch` is refused.
    batches: Option<&'a Arc<Batches>>,
    batch: Option<OpenBatch>,
    /// This connection's committed batches not yet routed or dropped: a `!flush` waits for
    /// them, then for their events' commit.
    unsettled: Vec<tokio::sync::oneshot::Receiver<()>>,
    router: Router,
    replies: VecDeque<Reply>,
    /// `!commit`s taken and not answered yet.
    commits: usize,
    periods: FlushPeriods,
    /// Lines seen so far (every line, empty and control lines included): numbers the
    /// `rejected` replies.
    lines: u64,
    report_errors: bool,
    /// Corrections answered so far: the number the router gave the next one, less one.
    corrections: u64,
    /// Corrections the flush refused, by number, not answered yet.
    refused: Vec<u64>,
}

impl<'a> StreamConn<'a> {
    fn new(ingest: &'a Ingest, batches: Option<&'a Arc<Batches>>, conn: u64) -> StreamConn<'a> {
        StreamConn {
            ingest,
            batches,
            batch: None,
            unsettled: Vec::new(),
            router: Router::new(ingest, conn),
            replies: VecDeque::new(),
            commits: 0,
            periods: FlushPeriods::default(),
            lines: 0,
            report_errors: false,
            corrections: 0,
            refused: Vec::new(),
        }
    }

    fn take(&mut self, line: Result<&[u8], Reject>) {
        self.lines += 1;
        match self.router.line(self.ingest, line) {
            Outcome::Taken => {}
            Outcome::Batch(b) => {
                let reply = self.batch_line(b);
                self.replies.push_back(reply);
            }
            Outcome::Control(Control::Flush | Control::Sync | Control::InBatch)
                if self.batch.is_some() =>
            {
                self.replies
                    .push_back(Reply::Batch(Err(BatchRefusal::BatchOpen)));
            }
            Outcome::Control(c) => {
                // Applies to the very next line, even in the same read.
                self.report_errors |= c == Control::Errors;
                let (a, r) = (self.router.accepted, self.router.rejected);
                self.replies.push_back(Reply::Control(c, a, r));
            }
            Outcome::Rejected(reason) if self.report_errors => {
                let text = line.map_or_else(|_| "\"\"".to_string(), excerpt);
                self.replies
                    .push_back(Reply::Rejected(self.lines, reason, text));
            }
            Outcome::Rejected(_) => {}
        }
    }

    /// Applies `!batch`, `!commit` or `!abort`; returns what it owes the client.
    fn batch_line(&mut self, b: BatchControl) -> Reply {
        let (accepted, rejected) = (self.router.accepted, self.router.rejected);
        match b {
            BatchControl::Open(Err(refusal)) => Reply::Batch(Err(refusal)),
            BatchControl::Open(Ok(_)) if self.batch.is_some() => {
                Reply::Batch(Err(BatchRefusal::BatchOpen))
            }
            BatchControl::Open(Ok(id)) => {
                let Some(batches) = self.batches else {
                    return Reply::Batch(Err(BatchRefusal::BatchNeedsJournal));
                };
                self.router.held = Some(Held {
                    max_bytes: batches.max_bytes,
                    ..Held::default()
                });
                self.batch = Some(OpenBatch {
                    id,
                    accepted,
                    rejected,
                });
                Reply::Batch(Ok(()))
            }
            BatchControl::Commit | BatchControl::Abort if self.batch.is_none() => {
                Reply::Batch(Err(BatchRefusal::NoBatch))
            }
            BatchControl::Commit | BatchControl::Abort => {
                let open = self.batch.take().expect("checked above");
                let held = self.router.held.take().unwrap_or_default();
                // The batch's lines are the batch's: a later `!flush` counts none of them.
                let (a, r) = (accepted - open.accepted, rejected - open.rejected);
                self.periods.accepted_at += a;
                self.periods.rejected_at += r;
                if b == BatchControl::Abort {
                    return Reply::Batch(Ok(()));
                }
                self.commits += 1;
                let same_id_in_flight = self.replies.iter().any(|r| {
                    matches!(r, Reply::Commit(c) if c.id == open.id
                        && matches!(c.work, Work::Running(_) | Work::Deferred(_)))
                });
                let work = if held.too_large {
                    Work::TooLarge
                } else if same_id_in_flight {
                    Work::Deferred(held.lines)
                } else {
                    let batches = self.batches.expect("a batch opened only with batches");
                    Work::Running(batches.begin_commit(open.id.clone(), held.lines))
                };
                Reply::Commit(Commit {
                    id: open.id,
                    accepted: a,
                    rejected: r,
                    work,
                })
            }
        }
    }

    /// Answers a `!commit` into `out`, waiting for it if need be.
    async fn commit(&mut self, commit: Commit, out: &mut Vec<u8>) {
        self.commits -= 1;
        let committed = match commit.work {
            Work::TooLarge => {
                let r = BatchRefusal::BatchTooLarge;
                let _ = writeln!(out, "error {} {}", r.as_str(), r.message());
                return;
            }
            Work::Deferred(lines) => {
                let batches = self.batches.expect("a batch opened only with batches");
                batches.commit(commit.id, lines).await
            }
            Work::Running(h) => h.await.unwrap_or_else(|e| Err(e.to_string())),
            Work::Done(committed) => committed,
        };
        match committed {
            Ok((answer, settling)) => {
                // Only those not settled yet: a connection that never sends `!flush` keeps
                // no more than the batches in flight.
                self.unsettled.retain_mut(|r| {
                    matches!(
                        r.try_recv(),
                        Err(tokio::sync::oneshot::error::TryRecvError::Empty)
                    )
                });
                self.unsettled.push(settling);
                match answer {
                    Answer::Counted => {
                        let _ = writeln!(out, "ok {} {}", commit.accepted, commit.rejected);
                    }
                    Answer::Duplicate => out.extend_from_slice(b"duplicate\n"),
                }
            }
            Err(cause) => {
                let _ = writeln!(
                    out,
                    "error batch_not_written {cause}; nothing of it counted"
                );
            }
        }
    }

    /// Takes `line` unless it is an event: returns false then, leaving it unparsed for later.
    fn take_unless_event(&mut self, line: Result<&[u8], Reject>) -> bool {
        if let Ok(l) = line {
            self.router.refresh(self.ingest);
            let schema = &self.router.schema;
            let parsed = protocol::parse_line(l, &schema.counters, &schema.limits);
            if let Ok(Line::Event(_)) = parsed {
                return false;
            }
        }
        self.take(line);
        true
    }

    /// Writes the replies owed so far, in order, up to the first `!commit` still being written
    /// or claimed (unless `all`, or `COMMITS_IN_FLIGHT` are: then it waits for it). Written as
    /// one block, except that everything before a wait goes out before it waits.
    async fn answer(
        &mut self,
        wr: &mut OwnedWriteHalf,
        cancel: &CancellationToken,
        all: bool,
    ) -> Result<(), Stop> {
        let mut out = Vec::new();
        while let Some(front) = self.replies.front_mut() {
            if let Reply::Commit(c) = front {
                if let Work::Deferred(lines) = &mut c.work {
                    // Every earlier copy of this connection's is answered: this one starts.
                    let batches = self.batches.expect("a batch opened only with batches");
                    let lines = std::mem::take(lines);
                    c.work = Work::Running(batches.begin_commit(c.id.clone(), lines));
                }
                if !c.ready() && !all && self.commits < COMMITS_IN_FLIGHT {
                    break;
                }
            }
            let r = self.replies.pop_front().expect("front above");
            match r {
                Reply::Rejected(line, reason, text) => {
                    let _ = writeln!(out, "rejected {line} {} {text}", reason.as_str());
                }
                Reply::Control(Control::Ping, ..) => out.extend_from_slice(b"pong\n"),
                Reply::Control(Control::Errors, ..) => out.extend_from_slice(b"ok\n"),
                Reply::Control(Control::Refused(reason), ..) => {
                    let _ = writeln!(out, "error {} {reason}", reason.as_str());
                }
                Reply::Batch(Ok(())) => out.extend_from_slice(b"ok\n"),
                Reply::Batch(Err(r)) => {
                    let _ = writeln!(out, "error {} {}", r.as_str(), r.message());
                }
                Reply::Commit(commit) => {
                    reply(wr, &out).await.map_err(Stop::Io)?;
                    out.clear();
                    self.commit(commit, &mut out).await;
                }
                Reply::Control(c, accepted, rejected) => {
                    reply(wr, &out).await.map_err(Stop::Io)?;
                    out.clear();
                    self.wait(c, accepted, rejected, &mut out, cancel).await?;
                }
            }
        }
        reply(wr, &out).await.map_err(Stop::Io)
    }

    /// Answers a `!flush` or `!sync` into `out` once what it waits for is done.
    async fn wait(
        &mut self,
        control: Control,
        accepted: u64,
        rejected: u64,
        out: &mut Vec<u8>,
        cancel: &CancellationToken,
    ) -> Result<(), Stop> {
        if let (Control::Sync, Some(journal)) = (control, &self.ingest.journal) {
            match journal.sync().await {
                Ok(()) => out.extend_from_slice(b"ok\n"),
                Err(cause) => {
                    let _ = writeln!(out, "error journal write failed: {cause}");
                }
            }
            return Ok(());
        }
        if let (false, Some(batches)) = (self.unsettled.is_empty(), self.batches) {
            let settled = futures_util::future::join_all(std::mem::take(&mut self.unsettled));
            tokio::select! {
                _ = async { settled.await; batches.flush_routed().await } => {}
                _ = cancel.cancelled() => return Err(Stop::Cancelled),
            }
        }
        let acked = tokio::select! {
            n = self.router.flush(self.ingest) => n,
            // Stopping with the database unreachable: the client gets no answer; its lines
            // stay pending for the final flush (and in the journal).
            _ = cancel.cancelled() => return Err(Stop::Cancelled),
        };
        let overflows = acked.overflows;
        // A refusal may come with an earlier wait's answer: kept until its correction's.
        self.refused.extend(acked.refused);
        if self.report_errors {
            // Found by the buckets after the line left the connection: its number is unknown.
            for _ in 0..overflows {
                out.extend_from_slice(b"rejected - overflow \"\"\n");
            }
        }
        if control == Control::Corrected {
            // Not a `!flush`: its overflows are told by the next one, in its period.
            self.periods.overflow_carry += overflows;
            self.corrections += 1;
            let serial = self.corrections;
            if let Some(i) = self.refused.iter().position(|&s| s == serial) {
                self.refused.swap_remove(i);
                let _ = writeln!(
                    out,
                    "error {} the set would move a row beside its window (a coarser window or \
                     the all-time row) beyond the signed 64-bit range; nothing changed",
                    Reject::Overflow.as_str()
                );
            } else {
                out.extend_from_slice(b"ok\n");
            }
            return Ok(());
        }
        let (a, r) = self.periods.close(accepted, rejected, overflows);
        match control {
            Control::Flush => {
                let _ = writeln!(out, "ok {a} {r}");
            }
            _ => out.extend_from_slice(b"ok\n"),
        }
        Ok(())
    }

    /// Takes the complete lines read so far. At the memory cap it takes only the lines before
    /// the first event line: control lines are still answered, and the event line waits,
    /// unparsed, until there is room. Returns whether such a line is held.
    fn take_lines(&mut self, buf: &mut LineBuffer, eof: bool) -> bool {
        let held = if self.ingest.has_room() {
            buf.drain_lines(|line| self.take(line));
            false
        } else {
            buf.drain_lines_while(|line| self.take_unless_event(line))
        };
        if eof && !held {
            buf.finish(|line| self.take(line));
        }
        held
    }
}

/// Closes an idle connection, telling the client why.
async fn close_idle(wr: &mut OwnedWriteHalf, why: Read) {
    let timeout = matches!(why, Read::Idle);
    events::IdleConnectionClosed { timeout }.emit();
    let text: &[u8] = if timeout {
        b"error idle for listen.idle_timeout_ms; closing\n"
    } else {
        b"error idle, closed to admit a new connection at listen.max_connections\n"
    };
    let _ = reply(wr, text).await;
}

/// A connection closed because this daemon may no longer write is told so: its lines after the
/// last `ok` are not confirmed (they stay in the journal, for the next start).
async fn tell_if_fenced(wr: &mut OwnedWriteHalf, ingest: &Ingest) {
    if ingest.lost.is_cancelled() {
        let _ = reply(
            wr,
            b"error fenced this tallyd may no longer write (another tallyd moved logical shards, \
              or its instance lease was lost); closing: nothing after the last ok is confirmed\n",
        )
        .await;
    }
}

/// tallyd's own line protocol, on the stream socket.
pub(super) struct Lines {
    pub(super) ingest: Arc<Ingest>,
    pub(super) batches: Option<Arc<Batches>>,
}

impl Protocol for Lines {
    fn conn_id(&self) -> u64 {
        self.ingest.conn_id()
    }

    async fn serve(&self, stream: UnixStream, ctx: &ConnCtx<'_>, conn: u64) -> io::Result<()> {
        serve_stream(stream, &self.ingest, self.batches.as_ref(), ctx, conn).await
    }
}

async fn serve_stream(
    stream: UnixStream,
    ingest: &Ingest,
    batches: Option<&Arc<Batches>>,
    ctx: &ConnCtx<'_>,
    conn: u64,
) -> io::Result<()> {
    let (mut rd, mut wr) = stream.into_split();
    let max_line_bytes = ingest.schema().limits.max_line_bytes;
    let mut buf = LineBuffer::new(max_line_bytes, ingest.read_buffer_bytes);
    let mut c = StreamConn::new(ingest, batches, conn);
    let evict = CancellationToken::new();
    let mut held = false;
    let mut eof = false;
    let result = loop {
        if held {
            // Held lines count as unread at the stop, like the bytes still in the socket.
            if !ingest.pause_for_intake(ctx.cancel).await {
                tell_if_fenced(&mut wr, ingest).await;
                break Ok(());
            }
        } else {
            let size = buf.read_size();
            // While `!commit`s are in flight, the first one's end is answered without waiting
            // for more bytes.
            let read = tokio::select! {
                biased;
                r = read_some(&mut rd, buf.read_buf(), size, ctx, conn, &evict) => Some(r),
                () = first_commit_done(&mut c.replies) => None,
            };
            match read {
                None => {}
                Some(Ok(Read::Bytes(n))) => ingest.received_bytes.increment(n as u64),
                Some(Ok(Read::End)) => eof = true,
                Some(Ok(why)) => {
                    // A partial line is `unterminated`, as when the client closes.
                    buf.finish(|line| c.take(line));
                    close_idle(&mut wr, why).await;
                    break Ok(());
                }
                Some(Err(e)) => break Err(e),
            }
            c.router.now_ms = now_ms();
        }
        held = c.take_lines(&mut buf, eof);
        c.router.send(ingest).await;
        match c.answer(&mut wr, ctx.cancel, eof && !held).await {
            Ok(()) => {}
            Err(Stop::Cancelled) => {
                tell_if_fenced(&mut wr, ingest).await;
                break Ok(());
            }
            Err(Stop::Io(e)) => break Err(e),
        }
        if eof && !held {
            break Ok(());
        }
    };
    c.router.close(ingest).await;
    result
}

#[cfg(test)]
mod tests {
    use super::FlushPeriods;

    #[test]
    fn overflow_rejections_carry_to_the_next_period() {
        // `k MAX`, `!flush`, `k 1`, `k 1` in one read: both later lines overflow, but only one
        // line was accepted before the `!flush`.
        let mut p = FlushPeriods::default();
        assert_eq!(p.close(1, 0, 2), (0, 1));
        assert_eq!(p.close(3, 0, 0), (1, 1));
        assert_eq!(p.close(5, 1, 0), (2, 1));
    }
}
