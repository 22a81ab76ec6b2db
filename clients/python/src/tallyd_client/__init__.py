"""A client for tallyd's line protocol over its Unix stream socket: events of every kind,
flush, sync, ping, corrections (set, forget) and exactly-once batches, with reconnects,
back-pressure and rejections reported with their reasons. Standard library only.

    from tallyd_client import Client

    with Client("/run/tallyd/tallyd.sock") as tallyd:
        tallyd.send("downloads", "report.pdf")
        tallyd.send("page_views", "42", -1, at=1700000000000)
        print(tallyd.flush())            # Tally(accepted=2, rejected=0, ...)
        with tallyd.batch("importer:cdn.log:0") as batch:
            batch.add("downloads", "report.pdf")
        print(batch.outcome)             # Committed(...) or Duplicate()
"""

from .client import Batch, Client
from .errors import (
    BatchesUnsupported,
    BatchOpen,
    BatchOver,
    BatchTooLarge,
    BatchUnacknowledged,
    ConnectError,
    ConnectionLost,
    InvalidArgument,
    ProtocolError,
    Refused,
    TallydError,
)
from .protocol import Committed, Duplicate, Rejection, Tally

__all__ = [
    "Batch",
    "BatchesUnsupported",
    "BatchOpen",
    "BatchOver",
    "BatchTooLarge",
    "BatchUnacknowledged",
    "Client",
    "Committed",
    "ConnectError",
    "ConnectionLost",
    "Duplicate",
    "InvalidArgument",
    "ProtocolError",
    "Refused",
    "Rejection",
    "Tally",
    "TallydError",
]
__version__ = "0.1.0"
