"""Locks: a crash-recoverable POSIX semaphore lock, and fcntl OFD region locks.

The fast path is a POSIX named semaphore (glibc's sem_trywait/sem_post are a
single atomic instruction each when uncontended: no syscall).  The holder's
pid, process start time and a fencing token are recorded in shared words so
that a waiter that times out can tell a busy holder from a dead one.  A dead
holder's lock is broken under an fcntl *open file description* lock on one
byte of the spool, so exactly one process recovers; the kernel drops that
lock if the recovering process dies too.

The mechanism is the engine's (shmq/engine/lock.c): process identity, the
liveness check, the OFD locks and the recovery itself, which the C API's
writers and readers use too, so a lock a dead C process held is recovered
here and the other way round.  This module gives them their Python shape.

OFD locks (``F_OFD_SETLK``, Linux >= 3.15) are used rather than classic POSIX
record locks because classic locks are dropped when the process closes *any*
descriptor of the file (POSIX.1-2008, fcntl(2) "Bugs"), which would silently
detach a named reader whenever another handle to the same spool closed.
"""

from __future__ import annotations

import os
import time

from . import _core
from ._format import HANDLE_LOCK_BYTE
from .errors import ShmqError, Timeout

#: Linux's largest possible pid (PID_MAX_LIMIT, include/linux/threads.h).
PID_MAX_LIMIT = 4 * 1024 * 1024

#: How long a waiter trusts a lock holder between checks of whether it is alive.
LOCK_RECOVERY_TIMEOUT_S = 1.0
#: ... except the first check, made this soon: locks are held for microseconds, so
#: a wait this long already means a slow, stopped or dead holder, and a dead one is
#: broken at once (the check costs one ``kill(pid, 0)`` and a /proc read).  Waiting
#: a whole period first let a holder's death stall everyone for a second, and a
#: process killed that often (a chaos run) before it looked never recovered a lock.
FIRST_LOOK_S = 0.05

# --- process identity ----------------------------------------------------
#
# A lock holder is recorded as ONE aligned word, so taking and releasing the
# lock costs one store each: pid in the low 32 bits, the low 32 bits of the
# process's start stamp (:func:`process_start`) in the high 32 bits, so a
# recycled pid is not mistaken for the holder.

_holder: int | None = None


def holder_word() -> int:
    """This process's holder word (the engine's); recomputed after fork."""
    global _holder
    if _holder is None:
        _holder = _core.holder_word()
    return _holder


def process_start(pid: int) -> int:
    """Process ``pid``'s start stamp, or 0 if there is no such process or its stat file
    cannot be read: its start time in centiseconds since boot (the engine reads
    ``/proc/PID/stat``) plus a salt from this boot's ``boot_id``.  Every process of the
    host computes the same stamp for ``pid`` whatever the wall clock does (it never
    enters), and a process of the next boot with the same pid and start tick gets
    another.  A holder word keeps the low 32 bits."""
    return _core.process_start(pid)


def holder_pid(word: int) -> int:
    return word & 0xFFFFFFFF


def _reset_identity():
    global _holder
    _holder = None


os.register_at_fork(after_in_child=_reset_identity)


def process_alive(pid: int, start: int | None = None) -> bool:
    """True if process ``pid`` exists, is not a zombie, and (if given) started at ``start``.

    ``start`` is the low 32 bits of its start stamp (:func:`process_start`).  The
    engine probes with ``kill(pid, 0)`` and reads ``/proc/PID/stat``; a
    process whose state cannot be read is assumed alive (a live lock is
    never broken).
    """
    if not 0 < pid <= PID_MAX_LIMIT:  # a corrupt holder word is not a live process
        return False
    return _core.process_alive(pid, start)


def holder_alive(word: int) -> bool:
    return process_alive(word & 0xFFFFFFFF, word >> 32)


# --- OFD region locks ----------------------------------------------------


def ofd_lock(fd: int, byte: int, *, exclusive: bool = True, wait: bool = False) -> bool:
    """Lock one byte of ``fd``'s file; return False if another holder conflicts."""
    return _core.ofd_lock(fd, byte, exclusive, wait)


def ofd_unlock(fd: int, byte: int) -> None:
    _core.ofd_unlock(fd, byte)


def ofd_locked_by_other(fd: int, byte: int) -> bool:
    """True if some other open file description holds any lock on ``byte``."""
    return _core.ofd_locked_by_other(fd, byte)


#: How long opening a spool waits while its handle lock is held exclusively: only a
#: process removing an orphaned anonymous queue holds it so, for the few unlinks
#: that takes (milliseconds), so a wait this long means a hostile holder.
HANDLE_LOCK_WAIT_S = 5.0


def hold_handle_lock(fd: int, path: str) -> None:
    """Take the handle lock (:data:`shmq._format.HANDLE_LOCK_BYTE`, shared) on ``fd``:
    every handle holds it while it has the spool mapped, so an exclusive attempt
    elsewhere fails while any handle exists.  Never released explicitly: the kernel
    drops it when the last descriptor of ``fd``'s open file description closes
    (a fork child sharing it keeps it), at the latest when the process dies.  The
    engine's (shmq/engine/lock.c), which the C API's ``shmq_open`` takes too.

    Blocks only while another process holds it exclusively, at most
    :data:`HANDLE_LOCK_WAIT_S` (polling, the GIL released; a removal holds it for
    milliseconds; Ctrl-C interrupts it).  On a filesystem without fcntl locks (some
    network mounts) there is none to hold; the anonymous queues that rely on it live
    on ``/dev/shm``, which has them.

    :raises shmq.ShmqError: still held exclusively after that.
    :raises OSError: fcntl failed otherwise.
    """
    if not _core.hold_handle_lock(fd, HANDLE_LOCK_WAIT_S):
        raise ShmqError(f"{path}: another process has held this spool's handle lock "
                        f"(fcntl byte {HANDLE_LOCK_BYTE}) exclusively for over "
                        f"{HANDLE_LOCK_WAIT_S} s; only shmq removing an orphaned queue "
                        "takes it so, for milliseconds: find the holder with 'fuser' or "
                        "/proc/locks")


# --- recoverable semaphore lock ------------------------------------------


class RecoverableLock(_core.Lock):
    """A cross-process mutex that survives its holder being SIGKILLed.

    Guarantees: mutual exclusion among live processes and threads; a holder
    that dies holding the lock delays other processes by at most about
    ``FIRST_LOOK_S`` (or ``recovery_timeout`` if that is shorter; one more
    period if it died in the two-store window where no holder is recorded)
    before one of them takes the lock over, bumping the fencing token in ``words[token_word]`` and calling
    ``on_recover`` while holding it, so the protected structure can be
    repaired.  A holder that is alive but slow is never broken.

    Taking and releasing are single calls into the compiled core (which
    records the holder word), so ``with lock:`` is atomic with respect to
    Python signal handlers: a KeyboardInterrupt raised in the block still
    releases the lock, and none can land between taking it and entering
    the block.

    ``words`` is a shared ``'Q'`` memoryview; ``holder``/``token_word``
    index the holder record in it (see :func:`holder_word`).  ``file.fd`` is
    the spool's descriptor (it changes after a fork) and ``recovery_byte``
    the file byte locked (fcntl OFD) while one process breaks the lock.
    Call :meth:`close` before unmapping ``words``.
    """

    __slots__ = ("sem", "words", "holder", "token_word", "breaks_word", "file",
                 "recovery_byte", "recovery_timeout", "on_recover")

    def __init__(self, sem, words, holder, token_word, file, recovery_byte, *,
                 breaks_word=None, recovery_timeout=LOCK_RECOVERY_TIMEOUT_S, on_recover=None):
        # on_stuck unbound (the core passes the lock), not a bound method: no
        # reference cycle keeps the lock (and its export of the mapping) alive
        # after its owner is gone; type(self)'s, so a subclass's override counts.
        super().__init__(sem.name, words, holder, holder_word(), float(recovery_timeout),
                         type(self).recover_if_dead, token_word, -1 if breaks_word is None else breaks_word)
        self.sem = sem
        self.words = words
        self.holder = holder
        self.token_word = token_word
        self.breaks_word = breaks_word
        self.file = file
        self.recovery_byte = recovery_byte
        self.recovery_timeout = recovery_timeout
        self.on_recover = on_recover

    def recover_if_dead(self) -> bool:
        """Break the lock if its recorded holder is dead; True if it was broken.

        Called after a wait for the lock failed (``FIRST_LOOK_S`` the first
        time, ``recovery_timeout`` after that; by ``with lock:`` and by the
        compiled core's callers).  A broken lock is released again at once
        (the caller retries), so this process holds the lock only while
        ``on_recover`` repairs the structure.  A lock held with no holder
        recorded is broken only if looks have found it so for at least one
        whole ``recovery_timeout`` (a holder between sem_wait and recording
        itself, or killed between clearing and sem_post).  The engine's
        recovery (``eng_lock_recover``): under the recovery byte's OFD lock,
        re-checked there (token, holder, the semaphore still taken), our
        holder word recorded, the token (and breaks) bumped, ``on_recover``
        called, then released.
        """
        return self._recover(self.file.fd, self.recovery_byte, float(self.recovery_timeout),
                             holder_word(), self.on_recover)

    def acquire(self, timeout: float | None = None) -> None:
        """Take the lock, waiting at most ``timeout`` seconds (None: forever).

        Prefer ``with lock:``; a caller of ``acquire`` must release in a
        ``finally`` (or call ``release_if_held``) that also covers this call.

        :raises shmq.Timeout: the holder is alive and did not release in time.
        """
        if self.try_acquire(0):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        wait = min(self.recovery_timeout, FIRST_LOOK_S)
        while True:
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    raise Timeout(f"lock not acquired within {timeout} s (held by pid "
                                  f"{holder_pid(self.words[self.holder])})")
            if self.try_acquire(wait):
                return
            self.recover_if_dead()
            wait = self.recovery_timeout
