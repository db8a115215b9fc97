"""shmq: a host-local, multi-process shared-memory message spool and queue.

See docs/guide.md.  This module only re-exports the public names.
"""

from typing import TYPE_CHECKING, Any

from ._format import FORMAT_VERSION
from .errors import (
    Empty, FrameLost, Full, LeaseLost, NotASpool, ReaderBusy, RemoteError, ShmqError, SpoolFormatError, Timeout,
    TooLarge, UntrustedSpool,
)
from .queue import JoinableQueue, Queue, SimpleQueue
from .group import GroupReader
from .reader import NamedReader, Reader
from .spool import Frame, Reservation, Spool
from .stats import ReaderStats, SpoolStats
from .workqueue import DeadLetter, Message, WorkQueue, WorkQueueStats

if TYPE_CHECKING:  # loaded lazily by __getattr__ below; type checkers see them here
    from .dispatch import Context, Dispatcher
    from .rpc import Call, Client, Service, ServiceStats

__version__ = "0.1.0"

__all__ = [
    "Spool", "Frame", "Reservation", "Queue", "JoinableQueue", "SimpleQueue", "Reader", "NamedReader", "GroupReader", "SpoolStats", "ReaderStats",
    "ShmqError", "Empty", "Full", "Timeout", "FrameLost", "SpoolFormatError", "TooLarge",
    "NotASpool", "UntrustedSpool",
    "ReaderBusy", "LeaseLost", "Dispatcher", "Context", "WorkQueue", "Message", "DeadLetter", "WorkQueueStats",
    "Service", "Client", "Call", "ServiceStats", "RemoteError",
    "FORMAT_VERSION",
]


def __getattr__(name: str) -> Any:
    # The dispatcher (threads, sockets, multiprocessing) loads only when used.
    if name in ("Dispatcher", "Context"):
        from . import dispatch

        return getattr(dispatch, name)
    if name in ("Service", "Client", "Call", "ServiceStats"):  # request/reply (asyncio, multiprocessing): on use
        from . import rpc

        return getattr(rpc, name)
    raise AttributeError(f"module 'shmq' has no attribute {name!r}")
