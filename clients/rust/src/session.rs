//! One connection's bookkeeping, without I/O: the bytes to write and the bytes read
//! ([`Wire`]), the lines sent, the control lines awaiting their replies in order, the
//! rejections reported meanwhile, and which event lines are acknowledged ([`Session`]). Both
//! drivers (blocking and tokio) feed it the bytes they move.

use std::collections::VecDeque;

use crate::error::Error;
use crate::reply::{Rejection, Reply};

/// The control lines the client sends, each answered by exactly one reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Control {
    Errors,
    Ping,
    Flush,
    Sync,
    Correction,
    Batch,
    Commit,
    Abort,
}

impl Control {
    pub(crate) fn what(self) -> &'static str {
        match self {
            Control::Errors => "!errors",
            Control::Ping => "!ping",
            Control::Flush => "!flush",
            Control::Sync => "!sync",
            Control::Correction => "a correction",
            Control::Batch => "!batch",
            Control::Commit => "!commit",
            Control::Abort => "!abort",
        }
    }

    /// Whether its `ok` acknowledges the event lines sent before it: they are committed
    /// (`!flush`, a correction) or durable in the journal (`!sync`).
    fn acknowledges(self) -> bool {
        matches!(self, Control::Flush | Control::Sync | Control::Correction)
    }
}

/// A control line sent and not yet answered, or answered and not yet taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket(u64);

/// The reply to a control line, with the rejections it closes: for `!flush`, every line
/// rejected before it on the connection; for `!commit`, the batch's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub reply: Reply,
    pub rejections: Vec<Rejection>,
    /// Rejections reported but not kept (beyond `Options::max_rejections`).
    pub rejections_not_kept: u64,
}

struct Awaited {
    ticket: u64,
    control: Control,
    /// Its line number on the connection.
    line: u64,
    /// The event lines sent before it (those its `ok` acknowledges).
    events_before: u64,
    /// Whether its answer is wanted (an `!abort` sent when a batch is dropped is not).
    keep: bool,
    /// For `!commit`: the line number of its `!batch`, after which the batch's lines come.
    batch_line: u64,
}

/// The bookkeeping of one connection.
pub(crate) struct Session {
    lines: u64,
    tickets: u64,
    awaited: VecDeque<Awaited>,
    answers: Vec<(u64, Answer)>,
    rejections: Vec<Rejection>,
    rejections_not_kept: u64,
    max_rejections: usize,
    events: u64,
    acknowledged: u64,
    /// The line number of the last `!batch` sent: the client has one batch open at a time.
    batch_line: u64,
    /// What tallyd said before closing the connection, if it did.
    pub(crate) closing: Option<String>,
}

impl Session {
    pub(crate) fn new(max_rejections: usize) -> Session {
        Session {
            lines: 0,
            tickets: 0,
            awaited: VecDeque::new(),
            answers: Vec::new(),
            rejections: Vec::new(),
            rejections_not_kept: 0,
            max_rejections,
            events: 0,
            acknowledged: 0,
            batch_line: 0,
            closing: None,
        }
    }

    /// `n` event lines were queued (outside a batch when `counted`).
    pub(crate) fn events(&mut self, n: u64, counted: bool) {
        self.lines += n;
        if counted {
            self.events += n;
        }
    }

    /// A control line was queued; its reply is awaited in order.
    pub(crate) fn control(&mut self, control: Control, keep: bool) -> Ticket {
        self.lines += 1;
        self.tickets += 1;
        if control == Control::Batch {
            self.batch_line = self.lines;
        }
        self.awaited.push_back(Awaited {
            ticket: self.tickets,
            control,
            line: self.lines,
            events_before: self.events,
            keep,
            batch_line: self.batch_line,
        });
        Ticket(self.tickets)
    }

    /// The line number of the last `!batch` sent: a batch's lines are numbered from it.
    pub(crate) fn batch_line(&self) -> u64 {
        self.batch_line
    }

    /// Event lines sent outside batches and not yet acknowledged.
    pub(crate) fn unacknowledged(&self) -> u64 {
        self.events - self.acknowledged
    }

    /// Whether nothing is in flight: no reply awaited, every event line acknowledged.
    pub(crate) fn quiet(&self) -> bool {
        self.awaited.is_empty() && self.unacknowledged() == 0
    }

    pub(crate) fn answered(&self, t: Ticket) -> bool {
        self.answers.iter().any(|(n, _)| *n == t.0)
    }

    pub(crate) fn take(&mut self, t: Ticket) -> Option<Answer> {
        let i = self.answers.iter().position(|(n, _)| *n == t.0)?;
        Some(self.answers.swap_remove(i).1)
    }

    /// One reply line (without its `\n`).
    pub(crate) fn on_line(&mut self, text: &str) -> Result<(), Error> {
        let front = self.awaited.front();
        let Some(reply) = Reply::parse(text) else {
            return Err(Error::Protocol {
                to: front.map_or("nothing", |a| a.control.what()),
                reply: text.to_string(),
            });
        };
        match reply {
            Reply::Closing(why) => self.closing = Some(why),
            // A control line tallyd does not know is rejected like an event line: the reply
            // to that line is its answer.
            Reply::Rejected(r) if front.is_some_and(|a| r.line == Some(a.line)) => {
                self.answer(Reply::Rejected(r))
            }
            Reply::Rejected(r) if self.rejections.len() < self.max_rejections => {
                self.rejections.push(r)
            }
            Reply::Rejected(_) => self.rejections_not_kept += 1,
            reply if front.is_some() => self.answer(reply),
            _ => {
                return Err(Error::Protocol {
                    to: "nothing",
                    reply: text.to_string(),
                })
            }
        }
        Ok(())
    }

    fn answer(&mut self, reply: Reply) {
        let a = self.awaited.pop_front().expect("a control line awaits");
        let ok = matches!(reply, Reply::Ok | Reply::Counts { .. });
        if ok && a.control.acknowledges() {
            self.acknowledged = self.acknowledged.max(a.events_before);
        }
        let (rejections, rejections_not_kept) = match a.control {
            Control::Flush => (
                std::mem::take(&mut self.rejections),
                std::mem::take(&mut self.rejections_not_kept),
            ),
            // The batch's lines follow its `!batch` line, which `commit` numbers them from.
            Control::Commit => {
                let (batch, before) = std::mem::take(&mut self.rejections)
                    .into_iter()
                    .partition(|r| r.line.is_none_or(|n| n > a.batch_line));
                self.rejections = before;
                (batch, std::mem::take(&mut self.rejections_not_kept))
            }
            _ => (Vec::new(), 0),
        };
        if a.keep {
            self.answers.push((
                a.ticket,
                Answer {
                    reply,
                    rejections,
                    rejections_not_kept,
                },
            ));
        }
    }
}

/// The bytes of one connection: written in order (`queue`, `unsent`, `wrote`) and read into
/// reply lines (`received`).
#[derive(Default)]
pub(crate) struct Wire {
    out: Vec<u8>,
    sent: usize,
    input: Vec<u8>,
    /// tallyd closed its side.
    pub(crate) eof: bool,
}

impl Wire {
    pub(crate) fn queue(&mut self, bytes: &[u8]) {
        self.out.extend_from_slice(bytes);
    }

    pub(crate) fn unsent(&self) -> &[u8] {
        &self.out[self.sent..]
    }

    pub(crate) fn wrote(&mut self, n: usize) {
        self.sent += n;
        if self.sent == self.out.len() {
            self.out.clear();
            self.sent = 0;
        }
    }

    /// Bytes read from the socket: each complete line goes to `session`.
    pub(crate) fn received(&mut self, bytes: &[u8], session: &mut Session) -> Result<(), Error> {
        self.input.extend_from_slice(bytes);
        let mut start = 0;
        while let Some(i) = self.input[start..].iter().position(|&b| b == b'\n') {
            let line = String::from_utf8_lossy(&self.input[start..start + i]).into_owned();
            start += i + 1;
            session.on_line(&line)?;
        }
        self.input.drain(..start);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(s: &mut Session, lines: &[&str]) {
        let mut wire = Wire::default();
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        wire.received(text.as_bytes(), s).unwrap();
    }

    #[test]
    fn a_flush_takes_the_rejections_before_it_and_acknowledges_its_events() {
        let mut s = Session::new(10);
        let errors = s.control(Control::Errors, true);
        s.events(3, true);
        let flush = s.control(Control::Flush, true);
        s.events(2, true);
        assert_eq!(s.unacknowledged(), 5);
        feed(&mut s, &["ok", r#"rejected 3 unknown_counter "nope k""#]);
        assert!(s.answered(errors) && !s.answered(flush));
        feed(&mut s, &["ok 2 1"]);
        let a = s.take(flush).unwrap();
        assert_eq!(
            a.reply,
            Reply::Counts {
                accepted: 2,
                rejected: 1
            }
        );
        assert_eq!(a.rejections.len(), 1);
        assert_eq!(a.rejections[0].line, Some(3));
        // The two events after the flush are still in doubt.
        assert_eq!(s.unacknowledged(), 2);
    }

    #[test]
    fn an_unknown_control_line_is_answered_by_its_rejection() {
        let mut s = Session::new(10);
        s.control(Control::Errors, true);
        let batch = s.control(Control::Batch, true);
        feed(&mut s, &["ok", r#"rejected 2 unknown_command "!batch x""#]);
        assert!(
            matches!(s.take(batch).unwrap().reply, Reply::Rejected(r) if r.reason == "unknown_command")
        );
    }

    #[test]
    fn a_commit_takes_only_its_batch_rejections() {
        let mut s = Session::new(10);
        s.control(Control::Errors, true);
        s.events(1, true); // line 2, outside the batch
        s.control(Control::Batch, true); // line 3
        s.events(2, false); // lines 4, 5
        let commit = s.control(Control::Commit, true);
        feed(
            &mut s,
            &[
                "ok",
                r#"rejected 2 bad_key "d \u{1}""#,
                "ok",
                r#"rejected 5 bad_value "peak k x""#,
                "ok 1 1",
            ],
        );
        let a = s.take(commit).unwrap();
        assert_eq!(a.rejections.len(), 1);
        assert_eq!(a.rejections[0].line, Some(5));
        let flush = s.control(Control::Flush, true);
        feed(&mut s, &["ok 1 1"]);
        assert_eq!(s.take(flush).unwrap().rejections[0].line, Some(2));
    }

    #[test]
    fn rejections_beyond_the_bound_are_counted_and_closing_lines_kept() {
        let mut s = Session::new(1);
        s.events(2, true);
        let flush = s.control(Control::Flush, true);
        feed(
            &mut s,
            &[
                r#"rejected 1 bad_key "a""#,
                r#"rejected 2 bad_key "b""#,
                "ok 0 2",
                "error idle for listen.idle_timeout_ms; closing",
            ],
        );
        let a = s.take(flush).unwrap();
        assert_eq!((a.rejections.len(), a.rejections_not_kept), (1, 1));
        assert!(s.closing.is_some());
        let mut wire = Wire::default();
        assert!(
            wire.received(b"pong\n", &mut s).is_err(),
            "nothing awaits it"
        );
    }
}
