"""Locks: a crash-recoverable POSIX semaphore lock, and fcntl OFD region locks.

The fast path is a POSIX named semaphore (glibc's sem_trywait/sem_post are a
single atomic instruction each when uncontended: no syscall).  The holder's
pid, process start time and a fencing token are recorded in shared words so
that a waiter that times out can tell a busy holder from a dead one.  A dead
holder's lock is broken under an fcntl *open file description* lock on one
byte of the spool, so exactly one process recovers; the kernel drops that
lock if the recovering process dies too.

OFD locks (``F_OFD_SETLK``, Linux >= 3.15) are used rather than classic POSIX
record locks because classic locks are dropped when the process closes *any*
descriptor of the file (POSIX.1-2008, fcntl(2) "Bugs"), which would silently
detach a named reader whenever another handle to the same spool closed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time

import psutil

from . import _core
from ._format import HANDLE_LOCK_BYTE, pack_flock, unpack_flock
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

F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)

# --- process identity ----------------------------------------------------
#
# A lock holder is recorded as ONE aligned word, so taking and releasing the
# lock costs one store each: pid in the low 32 bits, the low 32 bits of the
# process start time (centiseconds since the epoch) in the high 32 bits, so
# a recycled pid is not mistaken for the holder.

_holder: int | None = None


def _start_time(pid: int) -> int:
    """Process start time in centiseconds since the epoch (jiffy resolution)."""
    return round(psutil.Process(pid).create_time() * 100)


def holder_word() -> int:
    """This process's holder word; recomputed after fork."""
    global _holder
    if _holder is None:
        pid = os.getpid()
        _holder = pid | (_start_time(pid) & 0xFFFFFFFF) << 32
    return _holder


def holder_pid(word: int) -> int:
    return word & 0xFFFFFFFF


def _reset_identity():
    global _holder
    _holder = None


os.register_at_fork(after_in_child=_reset_identity)


def process_alive(pid: int, start: int | None = None) -> bool:
    """True if process ``pid`` exists, is not a zombie, and (if given) started at ``start``.

    ``start`` is the low 32 bits of the start time in centiseconds.
    ``os.kill(pid, 0)`` is the cheap probe (0.5 us); psutil (25-50 us)
    confirms the start time so a recycled pid is not mistaken for the holder.
    """
    if not 0 < pid <= PID_MAX_LIMIT:  # a corrupt holder word is not a live process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return start is None or (_start_time(pid) & 0xFFFFFFFF) == start
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # cannot tell: assume alive, never break a live lock


def holder_alive(word: int) -> bool:
    return process_alive(word & 0xFFFFFFFF, word >> 32)


# --- OFD region locks ----------------------------------------------------


def ofd_lock(fd: int, byte: int, *, exclusive: bool = True, wait: bool = False) -> bool:
    """Lock one byte of ``fd``'s file; return False if another holder conflicts."""
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    try:
        fcntl.fcntl(fd, F_OFD_SETLKW if wait else F_OFD_SETLK, pack_flock(kind, byte))
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def ofd_unlock(fd: int, byte: int) -> None:
    fcntl.fcntl(fd, F_OFD_SETLK, pack_flock(fcntl.F_UNLCK, byte))


def ofd_locked_by_other(fd: int, byte: int) -> bool:
    """True if some other open file description holds any lock on ``byte``."""
    raw = fcntl.fcntl(fd, F_OFD_GETLK, pack_flock(fcntl.F_WRLCK, byte))
    return unpack_flock(raw)[0] != fcntl.F_UNLCK


#: How long opening a spool waits while its handle lock is held exclusively: only a
#: process removing an orphaned anonymous queue holds it so, for the few unlinks
#: that takes (milliseconds), so a wait this long means a hostile holder.
HANDLE_LOCK_WAIT_S = 5.0


def _try_shared(fd: int) -> bool:
    try:
        return ofd_lock(fd, HANDLE_LOCK_BYTE, exclusive=False)
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP):
            return True  # a filesystem without fcntl locks: no handle lock to hold
        raise


def hold_handle_lock(fd: int, path: str) -> None:
    """Take the handle lock (:data:`shmq._format.HANDLE_LOCK_BYTE`, shared) on ``fd``:
    every handle holds it while it has the spool mapped, so an exclusive attempt
    elsewhere fails while any handle exists.  Never released explicitly: the kernel
    drops it when the last descriptor of ``fd``'s open file description closes
    (a fork child sharing it keeps it), at the latest when the process dies.

    Blocks only while another process holds it exclusively, at most
    :data:`HANDLE_LOCK_WAIT_S` (polling; a removal holds it for milliseconds).  On a
    filesystem without fcntl locks (some network mounts) there is none to hold; the
    anonymous queues that rely on it live on ``/dev/shm``, which has them.

    :raises shmq.ShmqError: still held exclusively after that.
    """
    delay, deadline = 0.0005, None
    while not _try_shared(fd):
        now = time.monotonic()
        if deadline is None:
            deadline = now + HANDLE_LOCK_WAIT_S
        elif now > deadline:
            raise ShmqError(f"{path}: another process has held this spool's handle lock "
                            f"(fcntl byte {HANDLE_LOCK_BYTE}) exclusively for over "
                            f"{HANDLE_LOCK_WAIT_S} s; only shmq removing an orphaned queue "
                            "takes it so, for milliseconds: find the holder with 'fuser' or "
                            "/proc/locks")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


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
                 "recovery_byte", "recovery_timeout", "on_recover", "_unknown_since",
                 "_unknown_last")

    def __init__(self, sem, words, holder, token_word, file, recovery_byte, *,
                 breaks_word=None, recovery_timeout=LOCK_RECOVERY_TIMEOUT_S, on_recover=None):
        # on_stuck unbound (the core passes the lock), not a bound method: no
        # reference cycle keeps the lock (and its export of the mapping) alive
        # after its owner is gone; type(self)'s, so a subclass's override counts.
        super().__init__(sem.name, words, holder, holder_word(), float(recovery_timeout),
                         type(self).recover_if_dead)
        self.sem = sem
        self.words = words
        self.holder = holder
        self.token_word = token_word
        self.breaks_word = breaks_word
        self.file = file
        self.recovery_byte = recovery_byte
        self.recovery_timeout = recovery_timeout
        self.on_recover = on_recover
        self._unknown_since = 0.0  # when the looks of this wait first found no holder recorded
        self._unknown_last = -1e9   # ... and when one last did

    def recover_if_dead(self) -> bool:
        """Break the lock if its recorded holder is dead; True if it was broken.

        Called after a wait for the lock failed (``FIRST_LOOK_S`` the first
        time, ``recovery_timeout`` after that; by ``with lock:`` and by the
        compiled core's callers).  A broken lock is released again at once
        (the caller retries), so Python holds the lock only while
        ``on_recover`` repairs the structure.  A lock held with no holder
        recorded is broken only if looks have found it so for at least one
        whole ``recovery_timeout`` (a holder between sem_wait and recording
        itself, or killed between clearing and sem_post).
        """
        word = self.words[self.holder]
        if word and holder_alive(word):
            self._unknown_last = -1e9
            return False
        if not word:
            # Only consecutive looks of one wait count (they come at most a period
            # apart): a look that caught another holder's instant before it recorded
            # itself, in an earlier wait, must not count towards breaking this one.
            now = time.monotonic()
            if now - self._unknown_last > 1.5 * self.recovery_timeout + FIRST_LOOK_S:
                self._unknown_since = now
            self._unknown_last = now
            if now - self._unknown_since < self.recovery_timeout:
                return False
        self._unknown_last = -1e9
        if self._break(word):
            self.release()
            return True
        return False

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

    def _break(self, word) -> bool:
        """Take over a dead holder's lock; True if this process now owns it."""
        token = self.words[self.token_word]
        ofd_lock(self.file.fd, self.recovery_byte, wait=True)
        try:
            # Re-check under the recovery lock: another waiter may have
            # recovered already, or the holder may have released.
            if (self.words[self.token_word] != token or self.words[self.holder] != word
                    or self.sem.value > 0):
                return False
            self.words[self.holder] = holder_word()
            self.words[self.token_word] = token + 1
            self.set_holder(holder_word())
            if self.breaks_word is not None:
                self.words[self.breaks_word] += 1
            # The semaphore stays at 0: this process inherits the dead
            # holder's acquisition instead of posting and racing for it.
            if self.on_recover is not None:
                self.on_recover(holder_pid(word))
            return True
        finally:
            ofd_unlock(self.file.fd, self.recovery_byte)
