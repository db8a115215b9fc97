"""shmq: a host-local, multi-process shared-memory message spool and queue.

See docs/guide.md.  This module only re-exports the public names.  The
spool, its readers and the queues load with it; the rest (the work queue,
the statistics types, the dispatcher, request/reply) load on first use, so
that ``import shmq`` costs about what ``import multiprocessing`` does
(stress/import_time.py): every spawned worker pays for it.
"""

from __future__ import annotations

from ._format import FORMAT_VERSION
from .errors import (
    Empty, FrameLost, Full, LeaseLost, NotASpool, ReaderBusy, RemoteError, ShmqError, SpoolFormatError, Timeout,
    TooLarge, UntrustedSpool,
)
from .queue import JoinableQueue, Queue, SimpleQueue
from .group import GroupReader
from .reader import NamedReader, Reader
from .spool import Frame, Reservation, Spool

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (see shmq._lazy)
if TYPE_CHECKING:  # loaded lazily by __getattr__ below; type checkers see them here
    from typing import Any

    from .dispatch import Context, Dispatcher
    from .errors import WorkerCrashed
    from .pool import Pool, ProcessPoolExecutor
    from .rpc import Call, Client, Service, ServiceStats
    from .stats import ReaderStats, SpoolStats
    from .workqueue import DeadLetter, Message, WorkQueue, WorkQueueStats

__version__ = "0.1.0"

__all__ = [
    "Spool", "Frame", "Reservation", "Queue", "JoinableQueue", "SimpleQueue", "Reader", "NamedReader", "GroupReader", "SpoolStats", "ReaderStats",
    "ShmqError", "Empty", "Full", "Timeout", "FrameLost", "SpoolFormatError", "TooLarge",
    "NotASpool", "UntrustedSpool",
    "ReaderBusy", "LeaseLost", "Dispatcher", "Context", "WorkQueue", "Message", "DeadLetter", "WorkQueueStats",
    "Service", "Client", "Call", "ServiceStats", "RemoteError",
    "ProcessPoolExecutor", "Pool", "WorkerCrashed",
    "FORMAT_VERSION",
]

#: The names loaded on first use, and the submodule of each.
_LAZY = {
    "Dispatcher": "dispatch", "Context": "dispatch",  # threads, sockets, multiprocessing
    "Service": "rpc", "Client": "rpc", "Call": "rpc", "ServiceStats": "rpc",  # asyncio, multiprocessing
    "WorkQueue": "workqueue", "Message": "workqueue", "DeadLetter": "workqueue", "WorkQueueStats": "workqueue",
    "SpoolStats": "stats", "ReaderStats": "stats",  # dataclasses
    "ProcessPoolExecutor": "pool", "Pool": "pool",  # threads, concurrent.futures
    "WorkerCrashed": "errors",  # a BrokenProcessPool: concurrent.futures.process on use
}


def __getattr__(name: str) -> Any:
    sub = _LAZY.get(name)
    if sub is None:
        raise AttributeError(f"module 'shmq' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{sub}", __name__), name)
    globals()[name] = value  # the next look-up is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
