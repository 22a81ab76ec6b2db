"""The exceptions of tallyd_client: each names what failed and why."""


class TallydError(Exception):
    """Every error of this library."""


class ConnectError(TallydError):
    """Connecting (and tallyd's first answer) failed on every attempt the backoff allowed."""

    def __init__(self, socket_path, attempts, elapsed, last):
        self.socket_path, self.attempts, self.elapsed, self.last = socket_path, attempts, elapsed, last
        super().__init__(
            f"cannot connect to tallyd at {socket_path}: {attempts} attempts in "
            f"{elapsed:.1f}s, the last: {last}"
        )


class ConnectionLost(TallydError):
    """The connection ended. `unacknowledged` event lines sent outside a batch since the last
    acknowledgement (flush, sync, a correction) may or may not have counted. The next operation
    connects again; send under a batch to retry without counting twice."""

    def __init__(self, unacknowledged, cause):
        self.unacknowledged, self.cause = unacknowledged, cause
        super().__init__(
            f"connection to tallyd lost ({cause}); {unacknowledged} event lines sent since the "
            "last acknowledgement may or may not have counted"
        )


class Refused(TallydError):
    """tallyd answered a control line with `error <reason> <message>` (a correction it cannot
    apply, `!sync` after a failed journal write, a batch it refuses): nothing of it changed."""

    def __init__(self, what, reason, message):
        self.what, self.reason, self.message = what, reason, message
        super().__init__(f"tallyd refused {what}: {reason}: {message}")


class BatchesUnsupported(TallydError):
    """tallyd does not know `!batch` (it answered unknown_command): it predates batches."""

    def __init__(self):
        super().__init__(
            "tallyd does not support batches (it answered `!batch` with unknown_command); "
            "upgrade tallyd"
        )


class BatchTooLarge(TallydError):
    """Adding the line would take the batch past max_batch_bytes: the client keeps every line
    of a batch until it is acknowledged. The batch is still open without this line."""

    def __init__(self, batch_id, limit):
        self.batch_id, self.limit = batch_id, limit
        super().__init__(
            f"batch {batch_id!r}: adding this line would exceed max_batch_bytes ({limit} "
            "bytes); commit it and start another batch"
        )


class BatchUnacknowledged(TallydError):
    """The batch was sent `attempts` times without an answer to `!commit`: send it again under
    the same id (it counts at most once); `commit()` may be called again."""

    def __init__(self, batch_id, attempts, last):
        self.batch_id, self.attempts, self.last = batch_id, attempts, last
        super().__init__(
            f"batch {batch_id!r} unacknowledged after {attempts} attempts (the last: {last}); "
            "send it again under the same id"
        )


class BatchOver(TallydError):
    """The batch was already committed, aborted or refused."""

    def __init__(self, batch_id):
        self.batch_id = batch_id
        super().__init__(f"batch {batch_id!r} is over (committed, aborted or refused); open a new one")


class BatchOpen(TallydError):
    """A batch is open on this client: events go into it (`batch.add`), and nothing else is
    sent until it is committed or aborted (tallyd would answer `batch_open`)."""

    def __init__(self, batch_id, what):
        self.batch_id, self.what = batch_id, what
        super().__init__(f"batch {batch_id!r} is open: commit or abort it before {what}")


class InvalidArgument(TallydError, ValueError):
    """An argument refused before sending: it would change the line's meaning (a space in a
    key splits it into two fields) or is not a line of this kind."""

    def __init__(self, field, value, why):
        self.field, self.value, self.why = field, value, why
        super().__init__(f"invalid {field} {value!r}: {why}")


class ProtocolError(TallydError):
    """A reply the protocol does not allow here; the connection is dropped."""

    def __init__(self, to, reply):
        self.to, self.reply = to, reply
        super().__init__(f"unexpected reply from tallyd to {to}: {reply!r}")
