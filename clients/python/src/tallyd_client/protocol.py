"""tallyd's line protocol without I/O: the lines the client writes (checked only for what would
change their meaning), the replies it reads, and one connection's bookkeeping (line numbers,
control lines awaiting their replies in order, rejections, acknowledged events)."""

from collections import deque
from dataclasses import dataclass, field
from typing import List, Optional

from .errors import InvalidArgument, ProtocolError

MAX_BATCH_ID_BYTES = 256


@dataclass
class Rejection:
    """A rejected line as tallyd reported it after `!errors`. `line`: its number on the
    connection (within the batch, from 1, for a batch's lines); None for an `overflow` found
    after the line left the connection. `excerpt`: its first 64 bytes, escaped as sent."""

    line: Optional[int]
    reason: str
    excerpt: str


@dataclass
class Tally:
    """What tallyd counted: the answer to `!flush`, or a committed batch's."""

    accepted: int
    rejected: int
    rejections: List[Rejection] = field(default_factory=list)
    rejections_not_kept: int = 0


@dataclass
class Committed(Tally):
    """This copy of the batch was committed (durable in tallyd's journal) and counts."""


@dataclass
class Duplicate:
    """A copy under this id was committed before: nothing of this copy counted."""


# ---- lines ------------------------------------------------------------------------------


def _field(name, value):
    if not isinstance(value, str):
        value = str(value)
    if value == "":
        raise InvalidArgument(name, value, "it is empty")
    if " " in value or "\t" in value:
        raise InvalidArgument(name, value, "it holds a space or tab, which separate fields")
    if "\n" in value or "\r" in value:
        raise InvalidArgument(name, value, "it holds a line break")
    return value


def _counter(counter):
    _field("counter", counter)
    if counter.startswith("!"):
        raise InvalidArgument("counter", counter, "a first field starting with `!` is a control line")
    return counter


def _at(at):
    if at is None:
        return ""
    if isinstance(at, bool) or not isinstance(at, int) or at < 0:
        raise InvalidArgument("at", at, "an event time is an int of milliseconds since the epoch")
    return f" @{at}"


def event_line(counter, key, value=None, at=None):
    """`<counter> <key> [<value>] [@<unix_ms>]\\n`: value is a sum's delta or a max, min or
    last value (int), or a unique counter's value (str)."""
    line = f"{_counter(counter)} {_field('key', key)}"
    if value is not None:
        if isinstance(value, bool):
            raise InvalidArgument("value", value, "a value is an int or a str")
        line += f" {value}" if isinstance(value, int) else f" {_field('value', value)}"
    return line + _at(at) + "\n"


def set_line(counter, key, value, at=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument("value", value, "`!set` takes an int")
    return f"!set {_counter(counter)} {_field('key', key)} {value}{_at(at)}\n"


def forget_line(counter, key):
    counter = "*" if counter is None else _counter(counter)
    return f"!forget {counter} {_field('key', key)}\n"


def batch_line(batch_id):
    if not isinstance(batch_id, str) or batch_id == "":
        raise InvalidArgument("batch id", batch_id, "it is empty")
    if len(batch_id.encode()) > MAX_BATCH_ID_BYTES:
        raise InvalidArgument("batch id", batch_id, "it is longer than 256 bytes")
    if any(c.isspace() or ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in batch_id):
        raise InvalidArgument("batch id", batch_id, "it holds a control character or whitespace")
    return f"!batch {batch_id}\n"


def raw_line(line):
    """A line given as text: one line, not a control line; the `\\n` added when missing."""
    body = line[:-1] if line.endswith("\n") else line
    if "\n" in body:
        raise InvalidArgument("line", line, "it holds more than one line")
    if body.lstrip(" \t").startswith("!"):
        raise InvalidArgument("line", line, "control lines are sent by the client's own methods")
    return body + "\n"


# ---- replies ------------------------------------------------------------------------------


class Reply:
    """One parsed reply line: `kind` is ok, counts, pong, duplicate, rejected, error or
    closing."""

    __slots__ = ("kind", "accepted", "rejected", "rejection", "reason", "message")

    def __init__(self, kind, accepted=0, rejected=0, rejection=None, reason="", message=""):
        self.kind, self.accepted, self.rejected = kind, accepted, rejected
        self.rejection, self.reason, self.message = rejection, reason, message

    def __repr__(self):
        return f"Reply({self.kind}, {self.accepted}, {self.rejected}, {self.rejection}, {self.reason!r}, {self.message!r})"


def parse_reply(text):
    """One reply line (without its newline), or None for a line the protocol does not have."""
    if text in ("ok", "pong", "duplicate"):
        return Reply(text)
    if text.startswith("ok "):
        parts = text[3:].split(" ")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            return None
        return Reply("counts", accepted=int(parts[0]), rejected=int(parts[1]))
    if text.startswith("rejected "):
        parts = text[9:].split(" ", 2)
        if len(parts) != 3:
            return None
        number, reason, excerpt = parts
        if number != "-" and not number.isdigit():
            return None
        if excerpt.endswith("..."):
            excerpt = excerpt[:-3]
        if len(excerpt) < 2 or excerpt[0] != '"' or excerpt[-1] != '"':
            return None
        line = None if number == "-" else int(number)
        return Reply("rejected", rejection=Rejection(line, reason, excerpt[1:-1]))
    if not text.startswith("error "):
        return None
    rest = text[6:]
    # The lines of a closing connection, and `!sync`'s journal error, predate the
    # `error <reason> <message>` form.
    if rest.startswith("idle") or rest == "too many connections":
        return Reply("closing", message=rest)
    if rest.startswith("journal write failed: "):
        return Reply("error", reason="journal_write_failed", message=rest[len("journal write failed: "):])
    reason, _, message = rest.partition(" ")
    return Reply("error", reason=reason, message=message)


# ---- one connection's bookkeeping ------------------------------------------------------------

# The control lines whose `ok` acknowledges the event lines before them.
ACKNOWLEDGING = ("!flush", "!sync", "a correction")


class Answer:
    __slots__ = ("reply", "rejections", "rejections_not_kept")

    def __init__(self, reply, rejections=(), rejections_not_kept=0):
        self.reply, self.rejections, self.rejections_not_kept = reply, list(rejections), rejections_not_kept


class _Awaited:
    __slots__ = ("ticket", "what", "line", "events_before", "keep", "batch_line")

    def __init__(self, ticket, what, line, events_before, keep, batch_line):
        self.ticket, self.what, self.line = ticket, what, line
        self.events_before, self.keep, self.batch_line = events_before, keep, batch_line


class Session:
    """The bookkeeping of one connection: fed the lines queued and the reply lines read."""

    def __init__(self, max_rejections):
        self.lines = 0
        self.tickets = 0
        self.awaited = deque()
        self.answers = {}
        self.rejections = []
        self.rejections_not_kept = 0
        self.max_rejections = max_rejections
        self.events_sent = 0
        self.acknowledged = 0
        self.batch_line = 0
        self.closing = None
        self._input = b""

    def events(self, n, counted):
        self.lines += n
        if counted:
            self.events_sent += n

    def control(self, what, keep=True):
        self.lines += 1
        self.tickets += 1
        if what == "!batch":
            self.batch_line = self.lines
        self.awaited.append(_Awaited(self.tickets, what, self.lines, self.events_sent, keep, self.batch_line))
        return self.tickets

    @property
    def unacknowledged(self):
        return self.events_sent - self.acknowledged

    def quiet(self):
        return not self.awaited and self.unacknowledged == 0

    def received(self, data):
        """Bytes read from the socket: each complete line is taken."""
        self._input += data
        *lines, self._input = self._input.split(b"\n")
        for line in lines:
            self.on_line(line.decode("utf-8", "replace"))

    def on_line(self, text):
        front = self.awaited[0] if self.awaited else None
        reply = parse_reply(text)
        if reply is None:
            raise ProtocolError(front.what if front else "nothing", text)
        if reply.kind == "closing":
            self.closing = reply.message
        elif reply.kind == "rejected":
            # A control line tallyd does not know is rejected like an event line: the reply
            # to that line is its answer.
            if front is not None and reply.rejection.line == front.line:
                self._answer(reply)
            elif len(self.rejections) < self.max_rejections:
                self.rejections.append(reply.rejection)
            else:
                self.rejections_not_kept += 1
        elif front is None:
            raise ProtocolError("nothing", text)
        else:
            self._answer(reply)

    def _answer(self, reply):
        a = self.awaited.popleft()
        if reply.kind in ("ok", "counts") and a.what in ACKNOWLEDGING:
            self.acknowledged = max(self.acknowledged, a.events_before)
        rejections, not_kept = [], 0
        if a.what == "!flush":
            rejections, self.rejections = self.rejections, []
            not_kept, self.rejections_not_kept = self.rejections_not_kept, 0
        elif a.what == "!commit":
            # The batch's lines follow its `!batch` line.
            mine = [r for r in self.rejections if r.line is None or r.line > a.batch_line]
            self.rejections = [r for r in self.rejections if not (r.line is None or r.line > a.batch_line)]
            rejections, not_kept, self.rejections_not_kept = mine, self.rejections_not_kept, 0
        if a.keep:
            self.answers[a.ticket] = Answer(reply, rejections, not_kept)

    def answered(self, ticket):
        return ticket in self.answers

    def take(self, ticket):
        return self.answers.pop(ticket)
