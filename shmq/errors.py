"""The shmq error set.

Every error subclasses :class:`ShmqError`; the two that have stdlib twins also
subclass them, so code written for :mod:`queue` / :mod:`multiprocessing`
catches them unchanged.  All errors survive pickling (they are raised in
worker processes and re-raised in parents).
"""

import queue

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
]


class ShmqError(Exception):
    """Base class of every error shmq raises on purpose."""

    def __reduce__(self):
        # Exceptions with extra attributes or keyword-only constructors do
        # not round-trip through pickle by default; rebuild from args.
        return (type(self), self.args)


class Empty(ShmqError, queue.Empty):
    """Nothing to read (non-blocking get, or a blocking get that timed out)."""


class Full(ShmqError, queue.Full):
    """No room for the frame (``on_full="error"``, or a blocking put timed out)."""


class Timeout(ShmqError, TimeoutError):
    """A lock could not be acquired in time (its holder is alive but busy)."""


class FrameLost(ShmqError, LookupError):
    """The requested frame was overwritten (or never existed)."""


class SpoolFormatError(ShmqError, ValueError):
    """The file is not a usable spool: wrong magic, newer version, corrupt or truncated.

    The message says what is wrong and what to do about it.
    """


class NotASpool(SpoolFormatError):
    """Something other than a spool file is at the path: a symbolic link, a FIFO, a socket,
    a device or a directory.  Raised at once, without blocking or following it; nothing
    at the path is changed."""


class UntrustedSpool(ShmqError, PermissionError):
    """Refusing to unpickle from a spool another user owns or can write (pass
    ``trusted=True``, or ``--unsafe-pickle`` on the command line, if you trust them).

    The message names the file, its owner and its mode.
    """

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class TooLarge(ShmqError, ValueError):
    """A frame (or atomic batch) that can never fit in the spool's ring."""


class ReaderBusy(ShmqError):
    """A named reader is already attached by another live handle."""


class LeaseLost(ShmqError):
    """A work queue ack/nack/extend carried a stale fencing token (the lease was re-granted)."""
