"""The shmq error set.

Every error subclasses :class:`ShmqError`; the two that have stdlib twins also
subclass them, so code written for :mod:`queue` / :mod:`multiprocessing`
catches them unchanged.  All errors survive pickling (they are raised in
worker processes and re-raised in parents).
"""

from __future__ import annotations

import queue
TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (see shmq._lazy)
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "ShmqError",
    "Empty",
    "Full",
    "Timeout",
    "FrameLost",
    "SpoolFormatError",
    "NotASpool",
    "UntrustedSpool",
    "TooLarge",
    "ReaderBusy",
    "LeaseLost",
    "RemoteError",
    "WorkerCrashed",
]


class ShmqError(Exception):
    """Base class of every error shmq raises on purpose.

    ``kind`` names what went wrong in one word, so tools (the CLI's exit
    codes) can tell errors apart without reading their messages.
    """

    kind = "error"

    def __reduce__(self) -> tuple[type[ShmqError], tuple[object, ...]]:
        # Exceptions with extra attributes or keyword-only constructors do
        # not round-trip through pickle by default; rebuild from args.
        return (type(self), self.args)


class Empty(ShmqError, queue.Empty):
    """Nothing to read (non-blocking get, or a blocking get that timed out)."""

    kind = "empty"


class Full(ShmqError, queue.Full):
    """No room for the frame (``on_full="error"``, or a blocking put timed out)."""

    kind = "full"


class Timeout(ShmqError, TimeoutError):
    """A lock could not be acquired in time (its holder is alive but busy)."""

    kind = "timeout"


class FrameLost(ShmqError, LookupError):
    """The requested frame was overwritten (or never existed)."""

    kind = "lost"


class SpoolFormatError(ShmqError, ValueError):
    """The file is not a usable spool: wrong magic, newer version, corrupt or truncated.

    The message says what is wrong and what to do about it.
    """

    kind = "corrupt"


class NotASpool(SpoolFormatError):
    """The path holds something that is not a spool: a foreign file, a directory, a
    symbolic link, a FIFO, a socket or a device.  Raised at once, without blocking or
    following it; shmq refuses to modify or remove it."""

    kind = "not_spool"


class UntrustedSpool(ShmqError, PermissionError):
    """Refusing to unpickle from a spool another user owns or can write (pass
    ``trusted=True``, or ``--unsafe-pickle`` on the command line, if you trust them).

    The message names the file, its owner and its mode.
    """

    kind = "untrusted"

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class TooLarge(ShmqError, ValueError):
    """A frame (or atomic batch) that can never fit in the spool's ring."""

    kind = "too_large"


class ReaderBusy(ShmqError):
    """A named reader is already attached by another live handle."""

    kind = "busy"


class LeaseLost(ShmqError):
    """A work queue ack/nack/extend carried a stale fencing token (the lease was re-granted)."""

    kind = "lease_lost"


class RemoteError(ShmqError):
    """A service's handler raised (or the call could not be answered): re-raised in the caller.

    ``service`` names the service; ``type_name``, ``message`` and
    ``remote_traceback`` are the handler's exception type (qualified name),
    its message and its formatted traceback (None when there is none).  The
    exception itself is not sent, so a class the caller cannot import (or
    unpickle) never matters.
    """

    kind = "remote"

    def __init__(self, text: str = "", service: str | None = None, type_name: str | None = None,
                 message: str | None = None, remote_traceback: str | None = None) -> None:
        super().__init__(text, service, type_name, message, remote_traceback)
        self.service = service
        self.type_name = type_name
        self.message = message
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _worker_crashed() -> type[ShmqError]:
    # concurrent.futures.process (multiprocessing.connection and .queues with it) loads
    # only when the class is first asked for: ``import shmq`` stays light
    from concurrent.futures.process import BrokenProcessPool

    class WorkerCrashed(ShmqError, BrokenProcessPool):
        """A task's worker process died (a signal, ``os._exit``, a segfault) on each of
        its attempts: only that task fails; the pool goes on.

        A subclass of ``concurrent.futures.process.BrokenProcessPool``, so code written
        for the stdlib's pools catches it unchanged.  The message names how the worker
        died and the attempts; ``exitcodes`` are the workers' exit codes, one per attempt
        (negative: a signal), ``attempts`` how many there were.
        """

        kind = "crashed"

        def __init__(self, text: str = "", exitcodes: tuple[int, ...] = ()) -> None:
            super().__init__(text, exitcodes)
            self.exitcodes = tuple(exitcodes)
            self.attempts = len(self.exitcodes)

        def __str__(self) -> str:
            return str(self.args[0]) if self.args else ""

    WorkerCrashed.__module__, WorkerCrashed.__qualname__ = __name__, "WorkerCrashed"
    return WorkerCrashed


_lazy: dict[str, type[ShmqError]] = {}

if TYPE_CHECKING:
    from concurrent.futures.process import BrokenProcessPool

    class WorkerCrashed(ShmqError, BrokenProcessPool):
        exitcodes: tuple[int, ...]
        attempts: int

        def __init__(self, text: str = "", exitcodes: tuple[int, ...] = ()) -> None: ...


def __getattr__(name: str) -> Any:
    if name == "WorkerCrashed":
        if name not in _lazy:
            _lazy[name] = _worker_crashed()
        return _lazy[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
