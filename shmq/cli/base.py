"""Exit codes, the CLI's error type, and how an escaping exception becomes (code, one line).

Library errors carry a ``kind`` (:mod:`shmq.errors`); this module maps kinds
and OS errors to exit codes, never message text.
"""

from __future__ import annotations

import errno

EXIT_OK = 0
EXIT_PROBLEMS = 1  # fsck found problems (or they remain after --repair)
EXIT_USAGE = 2  # bad arguments (argparse's own code)
EXIT_NOT_FOUND = 3  # no such spool (or reader, or directory)
EXIT_NOT_SPOOL = 4  # a foreign file, a directory, a symlink, not a dump
EXIT_CORRUPT = 5  # a damaged spool (header, control block, ring) or dump; a newer format
EXIT_PERMISSION = 6  # permission denied
EXIT_BUSY = 7  # the named reader is attached by another process (or the spool is in use)
EXIT_FULL = 8  # no room: the spool is full, the writer lock stayed busy, a frame too large
EXIT_LOST = 9  # the requested frame was overwritten or is not written yet
EXIT_EXISTS = 10  # create/import/export target already exists
EXIT_ERROR = 11  # any other error
EXIT_INTERRUPTED = 130  # Ctrl-C outside the watch/follow modes (which exit 0 on Ctrl-C)
EXIT_PIPE = 141  # stdout closed early (e.g. piped into head), as a shell reports SIGPIPE

EXIT_CODES = {
    EXIT_OK: "success (fsck: the spool is clean)",
    EXIT_PROBLEMS: "fsck found problems, or problems remain after --repair",
    EXIT_USAGE: "usage error: bad option or argument",
    EXIT_NOT_FOUND: "no such spool, reader or directory",
    EXIT_NOT_SPOOL: "not a spool: a foreign file, a directory, a symbolic link (or not a dump)",
    EXIT_CORRUPT: "damaged spool or dump, or a newer format than this shmq",
    EXIT_PERMISSION: "permission denied",
    EXIT_BUSY: "the named reader is attached by another process, or the spool is in use",
    EXIT_FULL: "no room: spool full, writer lock busy, frame larger than the ring, disk full",
    EXIT_LOST: "frame overwritten or not written yet",
    EXIT_EXISTS: "the target already exists",
    EXIT_ERROR: "other error",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
    EXIT_PIPE: "output closed early (broken pipe)",
}

#: ``ShmqError.kind`` -> exit code (kinds not listed exit EXIT_ERROR).
KIND_EXIT = {
    "busy": EXIT_BUSY,
    "full": EXIT_FULL,
    "timeout": EXIT_FULL,
    "too_large": EXIT_FULL,
    "lost": EXIT_LOST,
    "corrupt": EXIT_CORRUPT,
    "not_spool": EXIT_NOT_SPOOL,
    "untrusted": EXIT_PERMISSION,
}


class CliError(Exception):
    """A user-facing failure: one line on stderr, then exit with ``code``."""

    def __init__(self, message, code=EXIT_ERROR):
        super().__init__(message)
        self.code = code


def one_line(exc) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def os_message(exc, what):
    name = exc.filename if exc.filename is not None else ""
    return f"{name}: {what}" if name else what


def classify(exc, spool=None):
    """``(exit code, message)`` for an exception escaping a subcommand on ``spool``."""
    from ..errors import ShmqError

    if isinstance(exc, CliError):
        return exc.code, one_line(exc)
    if isinstance(exc, ShmqError):
        return KIND_EXIT.get(exc.kind, EXIT_ERROR), one_line(exc)
    if isinstance(exc, FileNotFoundError):
        if exc.filename is not None and spool is not None and exc.filename != spool:
            return EXIT_NOT_FOUND, os_message(exc, "no such file or directory")
        return EXIT_NOT_FOUND, os_message(exc, "no such spool (create it with 'shmq create')")
    if isinstance(exc, IsADirectoryError):
        return EXIT_NOT_SPOOL, os_message(exc, "is a directory, not a spool")
    if isinstance(exc, PermissionError):
        return EXIT_PERMISSION, os_message(exc, "permission denied (a spool needs read and "
                                           "write access; fsck/ls need read access)")
    if isinstance(exc, FileExistsError):
        return EXIT_EXISTS, os_message(exc, "already exists; refusing to overwrite it")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return EXIT_FULL, os_message(exc, exc.strerror or "no space left on device")
    if isinstance(exc, (ValueError, TypeError)):
        return EXIT_USAGE, one_line(exc)
    if isinstance(exc, OSError):
        return EXIT_ERROR, os_message(exc, exc.strerror or one_line(exc))
    return EXIT_ERROR, f"{type(exc).__name__}: {one_line(exc)}"


def resolve(path):
    """The absolute spool path of ``path`` (a bare name means NAME in the private directory, /dev/shm/shmq-UID)."""
    from .._mapping import resolve_path

    return resolve_path(path)


def resolve_target(target):
    """A spool or directory argument: "." and ".." are directories, other names follow
    the bare-name convention of :func:`resolve`."""
    import os

    return os.path.abspath(target) if target in (".", "..") else resolve(target)


def open_spool(path):
    """``Spool.open(path)`` (imported late: ``shmq --help`` stays fast)."""
    from ..spool import Spool

    return Spool.open(path)


def progress_wanted(a):
    """A progress line on stderr: asked for, or stderr is a terminal and not refused."""
    import sys

    return a.progress or (not a.no_progress and sys.stderr.isatty())
