"""Wake-ups between processes: a waiter count, a doorbell byte, an inotify watch.

A process that must wait (a reader with nothing to read, a writer with no
room) registers in a *waiter semaphore* used as an atomic counter, re-checks
its condition, then sleeps on an inotify watch of the spool file.  The other
side, after publishing, reads the counter and rings the doorbell (a 1-byte
``pwrite``) only when it is non-zero: stores through the mapping raise no
inotify event, ``pwrite`` raises ``IN_MODIFY``.

No lost wake-ups: registration is ``sem_post`` (a locked instruction, so a
full fence on x86) before the re-check, and the publisher reads the counter
after its own fence (the writer lock's ``sem_post``).  Unread identical
inotify events merge into one, so a wake means "re-check", never a count.  A
bounded safety-net timeout (``SAFETY_NET_S``) still caps any sleep, covering
a waiter killed while registered (it only costs a spurious doorbell) and
publishers without a fence.
"""

from __future__ import annotations

import asyncio
import os
import select
import time

import inotify_simple
import posix_ipc

#: Upper bound on one sleep: the cost of a wake-up that was somehow missed.
SAFETY_NET_S = 0.1
#: Spin this long re-checking before parking: with 2 vCPUs a parked waiter
#: costs a scheduler hop, a short spin catches the next frame of a stream.
SPIN_S = 30e-6

_READ_BYTES = 64 * 1024


class Doorbell:
    """One side's wake-up channel: waiters on ``sem`` sleep until ``ring()``.

    ``file.fd`` is the spool's descriptor (it changes after a fork); ``byte``
    is the doorbell byte.
    The inotify instance is created lazily (on the first wait) and is
    per-handle: inotify instances are a per-user limited resource (128 by
    default, fs.inotify.max_user_instances).
    """

    def __init__(self, file, byte: int, sem):
        self.file = file
        self.byte = byte
        self.sem = sem
        self._inotify = None
        self._poll = None
        self._async_waiters: set[asyncio.Future] = set()
        self._async_loop = None

    # -- publisher side ---------------------------------------------------

    def has_waiters(self) -> bool:
        return self.sem.value > 0

    def ring(self) -> None:
        """Wake every waiter (call after publishing, only if has_waiters())."""
        os.pwrite(self.file.fd, b"\x00", self.byte)

    # -- waiter side ------------------------------------------------------

    def _watch(self):
        if self._inotify is None:
            ino = inotify_simple.INotify()
            try:
                # Watch the inode behind our descriptor, not the path: the
                # path may have been unlinked (destroy) or replaced since.
                ino.add_watch(f"/proc/self/fd/{self.file.fd}", inotify_simple.flags.MODIFY)
            except OSError:
                ino.close()
                raise
            os.set_blocking(ino.fileno(), False)
            self._inotify = ino
            self._poll = select.poll()
            self._poll.register(ino.fileno(), select.POLLIN)
        return self._inotify

    def _drain(self):
        try:
            os.read(self._inotify.fileno(), _READ_BYTES)
        except BlockingIOError:
            pass

    def wait(self, ready, timeout: float | None) -> bool:
        """Block until ``ready()`` is true or ``timeout`` elapses; return ready().

        ``timeout=None`` waits forever; 0 checks once.
        """
        if ready():
            return True
        if timeout is not None and timeout <= 0:
            return False
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_until = now + SPIN_S
        while time.monotonic() < spin_until:
            if ready():
                return True
        self._watch()
        self.sem.release()  # register (a full fence), then re-check
        try:
            while True:
                if ready():
                    return True
                wait = SAFETY_NET_S
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    wait = min(wait, left)
                if self._poll.poll(max(1, int(wait * 1000))) and not ready():
                    # Drain only when the wake was not for us: on the hot path
                    # the event is left queued (a later wait sees one spurious,
                    # merged wake and drains then), saving a read on the way out.
                    self._drain()
        finally:
            self._unregister()

    def _unregister(self):
        try:
            self.sem.acquire(0)
        except posix_ipc.BusyError:
            pass  # counter was reset (fsck --repair); nothing to undo

    async def wait_async(self, ready, timeout: float | None) -> bool:
        """Like :meth:`wait`, for asyncio: parks on the inotify fd via the loop."""
        if ready():
            return True
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        self._watch()
        self._attach_loop(loop)
        self.sem.release()
        try:
            while True:
                if ready():
                    return True
                wait = SAFETY_NET_S
                if deadline is not None:
                    left = deadline - loop.time()
                    if left <= 0:
                        return False
                    wait = min(wait, left)
                fut = loop.create_future()
                self._async_waiters.add(fut)
                try:
                    await asyncio.wait_for(fut, wait)
                except asyncio.TimeoutError:
                    pass
                finally:
                    self._async_waiters.discard(fut)
        finally:
            self._unregister()

    def _attach_loop(self, loop):
        if self._async_loop is loop:
            return
        if self._async_loop is not None and not self._async_loop.is_closed():
            try:
                self._async_loop.remove_reader(self._inotify.fileno())
            except Exception:
                pass
        loop.add_reader(self._inotify.fileno(), self._on_readable)
        self._async_loop = loop

    def _on_readable(self):
        self._drain()
        for fut in list(self._async_waiters):
            if not fut.done():
                fut.set_result(None)

    def forget_after_fork(self):
        """In a fork child: drop the inherited inotify instance without touching
        the event loop, whose epoll set the child shares with its parent."""
        if self._inotify is not None:
            self._inotify.close()  # the child's copy only: the parent's stays open
        self._inotify = self._poll = self._async_loop = None
        self._async_waiters = set()

    def close(self):
        if self._inotify is not None:
            if self._async_loop is not None and not self._async_loop.is_closed():
                try:
                    self._async_loop.remove_reader(self._inotify.fileno())
                except Exception:
                    pass
            self._async_loop = None
            self._inotify.close()
            self._inotify = None
            self._poll = None
