"""Client and Batch: a connection to tallyd's stream socket that connects again when it is
lost, sends batches again under their id, and waits (reading replies meanwhile) while tallyd
applies back-pressure."""

import select
import socket
import time

from . import protocol
from .errors import (
    BatchOpen,
    BatchOver,
    BatchTooLarge,
    BatchUnacknowledged,
    BatchesUnsupported,
    ConnectError,
    ConnectionLost,
    ProtocolError,
    Refused,
)
from .protocol import Committed, Duplicate, Session, Tally

_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


class _Lost(Exception):
    """The connection ended under a pump: its cause, as the caller will read it."""


class Client:
    """A connection to tallyd's stream socket (`listen.socket`).

    Event lines are buffered up to `write_buffer_bytes` and written when the buffer is full or
    a reply is awaited; a write waits while tallyd does not read (back-pressure), reading its
    replies meanwhile. A lost connection fails the operation that saw it with ConnectionLost
    (saying how many event lines are in doubt) and the next operation connects again; a batch
    is sent again under its id by itself.

    Connecting tries every `backoff_initial` seconds, doubling up to `backoff_max`, for up to
    `connect_timeout` seconds (or `connect_attempts` attempts). `io_timeout` (None: wait as
    long as tallyd takes) bounds every wait for a reply or for room to write.
    """

    def __init__(
        self,
        socket_path,
        *,
        connect_timeout=30.0,
        connect_attempts=None,
        backoff_initial=0.05,
        backoff_max=2.0,
        io_timeout=None,
        write_buffer_bytes=64 * 1024,
        max_batch_bytes=8 * 1024 * 1024,
        batch_attempts=5,
        max_rejections=1000,
    ):
        self.socket_path = str(socket_path)
        self.connect_timeout, self.connect_attempts = connect_timeout, connect_attempts
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.io_timeout = io_timeout
        self.write_buffer_bytes = write_buffer_bytes
        self.max_batch_bytes = max_batch_bytes
        self.batch_attempts = batch_attempts
        self.max_rejections = max_rejections
        self._sock = None
        self._out = bytearray()
        self._eof = False
        self._session = Session(max_rejections)
        self._batch = None  # the open _BatchState
        self._reconnect()

    # ---- events and control lines -------------------------------------------------------

    def send(self, counter, key, value=None, *, at=None):
        """Queues one event: `value` is a sum's delta (default 1) or a max, min or last value
        (int), or a unique counter's value (str); `at` the event time in Unix milliseconds."""
        line = protocol.event_line(counter, key, value, at)
        self._no_batch("sending an event outside it")
        self._ready()
        self._queue_events(line, 1)

    def send_line(self, line):
        """Queues one event line given as text (`downloads report.pdf 5`)."""
        line = protocol.raw_line(line)
        self._no_batch("sending an event outside it")
        self._ready()
        self._queue_events(line, 1)

    def flush(self):
        """`!flush`: waits until every earlier line of this connection is committed in
        PostgreSQL; returns a Tally of what was accepted and rejected since the last flush."""
        answer = self._call("!flush", "!flush\n")
        reply = answer.reply
        if reply.kind != "counts":
            raise self._refusal(reply, "!flush")
        return Tally(reply.accepted, reply.rejected, answer.rejections, answer.rejections_not_kept)

    def sync(self):
        """`!sync`: waits until every earlier line is durable in tallyd's journal."""
        self._expect_ok(self._call("!sync", "!sync\n"), "!sync")

    def ping(self):
        """`!ping`: waits until tallyd has taken every earlier line (not committed them)."""
        reply = self._call("!ping", "!ping\n").reply
        if reply.kind != "pong":
            raise self._refusal(reply, "!ping")

    def set(self, counter, key, value, *, at=None):
        """`!set`: `value` becomes the key's total (sum) or kept value (max, min, last);
        answered once committed. Refused (reason not_settable, ...) when it cannot apply."""
        self._expect_ok(self._call("a correction", protocol.set_line(counter, key, value, at)), "a correction")

    def forget(self, counter, key):
        """`!forget <counter> <key>`: every row of the key deleted, once committed."""
        self._expect_ok(self._call("a correction", protocol.forget_line(counter, key)), "a correction")

    def forget_everywhere(self, key):
        """`!forget * <key>`: the key forgotten in every counter whose key type takes it."""
        self._expect_ok(self._call("a correction", protocol.forget_line(None, key)), "a correction")

    def batch(self, batch_id):
        """Opens a batch under `batch_id` (1 to 256 bytes of text, no whitespace); its events
        count whole, exactly once, when `commit()` returns, however often it is sent. Use it as
        a context manager: committed at the end of the block, aborted on an exception.
        Raises BatchesUnsupported when tallyd predates batches."""
        protocol.batch_line(batch_id)
        self._no_batch("opening another")
        self._batch = _BatchState(batch_id)
        attempts = 0
        while True:
            attempts += 1
            try:
                self._open_batch()
                return Batch(self, batch_id)
            except ConnectionLost:
                if attempts >= self.batch_attempts:
                    self._batch = None
                    raise
            except BaseException:
                self._batch = None
                raise

    @property
    def unacknowledged(self):
        """Event lines sent outside batches since the last acknowledgement (flush, sync, a
        correction): those a lost connection leaves in doubt."""
        return self._session.unacknowledged

    @property
    def buffered_bytes(self):
        """Bytes queued and not yet written to the socket."""
        return len(self._out)

    def close(self):
        """Closes the connection (an open batch counts none of its lines)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- internals ------------------------------------------------------------------------

    def _queue_events(self, line, n, counted=True):
        self._out += line.encode() if isinstance(line, str) else line
        self._session.events(n, counted)
        self._drain_if_full()

    def _queue(self, what, line, keep=True):
        self._out += line.encode()
        return self._session.control(what, keep)

    def _no_batch(self, doing):
        if self._batch is not None:
            raise BatchOpen(self._batch.batch_id, doing)

    def _call(self, what, line):
        self._no_batch(what)
        self._ready()
        ticket = self._queue(what, line)
        return self._answer(ticket)

    def _answer(self, ticket):
        self._pump(lambda: self._session.answered(ticket))
        return self._session.take(ticket)

    def _expect_ok(self, answer, what):
        if answer.reply.kind != "ok":
            raise self._refusal(answer.reply, what)

    @staticmethod
    def _refusal(reply, what):
        if what == "!batch" and reply.kind in ("rejected", "error"):
            reason = reply.rejection.reason if reply.kind == "rejected" else reply.reason
            if reason == "unknown_command":
                return BatchesUnsupported()
        if reply.kind == "error":
            return Refused(what, reply.reason, reply.message)
        if reply.kind == "rejected":
            r = reply.rejection
            return Refused(what, r.reason, f'tallyd rejected the line "{r.excerpt}"')
        return ProtocolError(what, repr(reply))

    def _ready(self):
        """Connects again after a lost connection; before the first line after a quiet spell,
        checks that tallyd has not closed this one meanwhile (an idle timeout, a restart), so
        that nothing is written into a closed connection."""
        if self._sock is not None and self._session.quiet() and not self._out:
            try:
                # Data or the end of the stream: either is the line tallyd sends before closing.
                self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                closed = True
            except (BlockingIOError, InterruptedError):
                closed = False
            except OSError:
                closed = True
            if closed:
                self._drop()
        if self._sock is None:
            self._reconnect()

    def _reconnect(self):
        started = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            try:
                self._connect_once()
                return
            except (ConnectionLost, OSError) as e:
                last = e.cause if isinstance(e, ConnectionLost) else e
                self._drop()
            delay = min(self.backoff_initial * 2 ** min(attempts - 1, 16), self.backoff_max)
            out_of_attempts = self.connect_attempts is not None and attempts >= self.connect_attempts
            if out_of_attempts or time.monotonic() - started + delay > self.connect_timeout:
                raise ConnectError(self.socket_path, attempts, time.monotonic() - started, last)
            time.sleep(delay)

    def _connect_once(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._sock, self._out, self._eof = sock, bytearray(), False
        self._session = Session(self.max_rejections)
        if self._batch is not None:
            self._batch.open_here = False
        # Every rejected line is answered with its reason from now on.
        self._expect_ok(self._answer(self._queue("!errors", "!errors\n")), "!errors")

    def _drop(self):
        """Forgets the connection; returns what was in doubt on it."""
        unacknowledged = self._session.unacknowledged
        if self._sock is not None:
            self._sock.close()
        self._sock, self._out, self._eof = None, bytearray(), False
        self._session = Session(self.max_rejections)
        if self._batch is not None:
            self._batch.open_here = False
        return unacknowledged

    def _lost(self, cause):
        closing = self._session.closing
        if closing is not None:
            cause = f"tallyd closed the connection: {closing}"
        return ConnectionLost(self._drop(), cause)

    def _drain_if_full(self):
        if len(self._out) >= self.write_buffer_bytes:
            self._pump(lambda: not self._out)

    def _pump(self, done):
        """Writes and reads until `done()`; a failure drops the connection."""
        try:
            self._pump_inner(done)
        except _Lost as e:
            raise self._lost(str(e)) from None
        except ProtocolError:
            self._drop()
            raise

    def _pump_inner(self, done):
        poller = select.poll()
        timeout = None if self.io_timeout is None else int(self.io_timeout * 1000)
        while not done():
            if self._eof or self._sock is None:
                raise _Lost("tallyd closed the connection")
            events = select.POLLIN | (select.POLLOUT if self._out else 0)
            poller.register(self._sock, events)
            if not poller.poll(timeout):
                raise _Lost(f"no progress within {self.io_timeout}s (io_timeout)")
            self._read_available()
            if self._out and not self._eof:
                self._write_available()

    def _read_available(self):
        while True:
            try:
                data = self._sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                raise _Lost(f"read: {e}") from None
            if not data:
                self._eof = True
                return
            self._session.received(data)

    def _write_available(self):
        while self._out:
            try:
                n = self._sock.send(self._out, _NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                raise _Lost(f"write: {e}") from None
            del self._out[:n]

    # ---- the batch ------------------------------------------------------------------------

    def _open_batch(self):
        self._ready()
        b = self._batch
        answer = self._answer(self._queue("!batch", protocol.batch_line(b.batch_id)))
        if answer.reply.kind != "ok":
            raise self._refusal(answer.reply, "!batch")
        b.open_here = True
        self._queue_events(bytes(b.lines), b.count, counted=False)

    def _batch_add(self, line):
        b = self._batch
        data = line.encode()
        if len(b.lines) + len(data) > self.max_batch_bytes:
            raise BatchTooLarge(b.batch_id, self.max_batch_bytes)
        b.lines += data
        b.count += 1
        if b.open_here:
            try:
                self._queue_events(data, 1, counted=False)
            except ConnectionLost:
                pass  # the commit sends the batch again on a new connection

    def _commit(self):
        attempts = 0
        while True:
            attempts += 1
            try:
                if not self._batch.open_here:
                    self._open_batch()
                answer = self._answer(self._queue("!commit", "!commit\n"))
            except (ConnectionLost, ConnectError) as e:
                if attempts >= self.batch_attempts:
                    raise BatchUnacknowledged(self._batch.batch_id, attempts, e) from None
                continue
            except BaseException:
                self._batch = None
                raise
            batch_line = self._session.batch_line
            self._batch = None
            reply = answer.reply
            if reply.kind == "duplicate":
                return Duplicate()
            if reply.kind != "counts":
                raise self._refusal(reply, "!commit")
            for r in answer.rejections:
                if r.line is not None:
                    r.line -= batch_line
            return Committed(reply.accepted, reply.rejected, answer.rejections, answer.rejections_not_kept)

    def _abort(self, wait):
        b, self._batch = self._batch, None
        if b is None or not b.open_here:
            return
        ticket = self._queue("!abort", "!abort\n", keep=wait)
        if wait:
            try:
                self._expect_ok(self._answer(ticket), "!abort")
            except ConnectionLost:
                pass  # a connection that ends before `!commit` counts none of the batch


class _BatchState:
    """The open batch's lines, kept until `!commit` is answered."""

    def __init__(self, batch_id):
        self.batch_id = batch_id
        self.lines = bytearray()
        self.count = 0
        self.open_here = False  # `!batch` answered ok on this connection, every line queued


class Batch:
    """An open batch (from `Client.batch`): lines added are sent at once and kept until
    `commit()` is answered, so that a lost connection sends them again, under the same id, on
    the next one. As a context manager: committed at the end of the block (the outcome in
    `batch.outcome`), aborted when the block raises."""

    def __init__(self, client, batch_id):
        self._client = client
        self.batch_id = batch_id
        self.outcome = None

    def _check_open(self):
        if self._client._batch is None or self._client._batch.batch_id != self.batch_id:
            raise BatchOver(self.batch_id)

    def add(self, counter, key, value=None, *, at=None):
        """Adds one event (as `Client.send`); BatchTooLarge (the batch stays as it was) when
        it would take the batch past max_batch_bytes."""
        self._check_open()
        self._client._batch_add(protocol.event_line(counter, key, value, at))

    def add_line(self, line):
        """Adds one event line given as text."""
        self._check_open()
        self._client._batch_add(protocol.raw_line(line))

    def commit(self):
        """`!commit`: Committed(accepted, rejected, rejections) or Duplicate(), both meaning the
        batch counts exactly once. A lost connection is retried (connect, `!batch` under the
        same id, the lines, `!commit`) up to batch_attempts times; then BatchUnacknowledged,
        and commit() may be called again."""
        self._check_open()
        self.outcome = self._client._commit()
        return self.outcome

    def abort(self):
        """`!abort`: nothing of the batch counts."""
        self._check_open()
        self._client._abort(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._client._batch is None:
            return False
        if exc_type is None:
            self.commit()
        else:
            self._client._abort(wait=False)
        return False
