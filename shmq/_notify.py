"""Wake-ups between processes: a waiter count, a futex word, a doorbell byte.

A process that must wait (a reader with nothing to read, a writer with no
room) registers in a *waiter semaphore* used as an atomic counter, reads the
doorbell's *futex word* (a control word), re-checks its condition, then
sleeps until the word moves.  The other side, after publishing, reads the
counter (after a full fence, in the compiled core) and, only when it is
non-zero, bumps the word, wakes the futex and rings the doorbell byte (a
1-byte ``pwrite``): stores through the mapping raise no inotify event,
``pwrite`` raises ``IN_MODIFY``, which is what asyncio waiters need.

Blocking calls sleep on the futex, GIL released: a blocking ``get`` in one
C call (the core's ``park_take``), other waits here (:meth:`Doorbell.wait`
around ``Ring.bell_wait``).  A futex wake is about as quick as a pipe's;
on the VMs measured a blocked reader saw an inotify event 1-8 µs later.  It
needs no per-process resource, so any number of threads and handles can
block at once.  Event loops cannot wait on a
futex: they wait on the process's one inotify instance (:class:`Watcher`;
instances are a per-user limited resource, ``fs.inotify.max_user_instances``,
128 by default, shared by all of that user's processes), whose reader
callback wakes every coroutine waiting in that loop.  A wake means
"re-check", never a count.

No lost wake-ups: registration is ``sem_post`` (a full fence) before the
word is read and the condition re-checked; a ring after the re-check has
moved the word, so the futex wait returns at once.  For asyncio, an event
that arrives after the re-check stays queued on the descriptor.  A bounded
safety-net timeout (``SAFETY_NET_S``, changed only by :func:`set_safety_net`)
still caps any sleep, covering a
publisher killed between publishing and ringing.  If the kernel refuses an
inotify instance, asyncio waits fall back to short sleeps (logged once).
"""

from __future__ import annotations

import errno
import os
import threading
import time

from . import _core
from ._lazy import TYPE_CHECKING, logger

# asyncio and inotify_simple (with ctypes) load on the first asyncio wait:
# together they cost several times what the rest of ``import shmq`` does, and
# the blocking waits most processes only ever make need neither.
if TYPE_CHECKING:
    import asyncio

#: Upper bound on one sleep: the cost of a wake-up that was somehow missed.
SAFETY_NET_S = 0.1
#: Spin this long re-checking before parking: with 2 vCPUs a parked waiter
#: costs a scheduler hop, a short spin catches the next frame of a stream.
#: The spin yields the CPU between looks (``_core.yield_cpu``: sched_yield,
#: which returns at once when nothing else is runnable here), so that a waiter
#: never holds a CPU the process it waits for needs: with 8 callers and a
#: service's worker on 2 vCPUs, spinning without yielding cost each caller 30 us
#: of CPU per reply, and the worker's CPU too.
SPIN_S = 30e-6
#: A waiter calls its ``before_park`` (a reader publishing its counters) once it
#: has waited this long after its spin: a wait that a frame ends sooner skips it
#: (8 callers of a service: every reply wait outlasts the spin, and most end
#: within this), and for a group member it is a round trip on the group's lock.
PUBLISH_AFTER_S = 0.001
#: Sleep between re-checks of an asyncio wait when no inotify instance could be had.
FALLBACK_SLEEP_S = 0.002

_READ_BYTES = 64 * 1024
_IN_MODIFY = 0x2  # inotify_simple.flags.MODIFY (IN_MODIFY, <sys/inotify.h>)


class Watcher:
    """This process's one inotify instance, shared by all handles and event loops."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ino = None
        self._failed = None  # the OSError that refused an instance, if any
        self._watches = {}  # (st_dev, st_ino) -> [wd, refcount]
        self._async = {}  # event loop -> set of futures waiting on it

    # -- watches ----------------------------------------------------------

    def _instance(self):
        if self._ino is None and self._failed is None:
            try:
                import inotify_simple

                ino = inotify_simple.INotify()
            except OSError as exc:
                self._failed = exc
                logger().warning("shmq: no inotify instance (%s); asyncio waits poll every %.0f ms "
                                 "instead: raise fs.inotify.max_user_instances", exc,
                                 FALLBACK_SLEEP_S * 1000)
                return None
            os.set_blocking(ino.fileno(), False)
            self._ino = ino
        return self._ino

    def watch(self, fd: int):
        """Watch the inode behind ``fd``; return a key for :meth:`unwatch` (None: fallback)."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            entry = self._watches.get(key)
            if entry is not None:
                entry[1] += 1
                return key
            ino = self._instance()
            if ino is None:
                return None
            try:
                # Watch the inode behind our descriptor, not the path: the
                # path may have been unlinked (destroy) or replaced since.
                wd = ino.add_watch(f"/proc/self/fd/{fd}", _IN_MODIFY)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:  # ENOSPC: max_user_watches reached
                    raise
                logger().warning("shmq: inotify watch refused (%s); this spool's waits poll", exc)
                return None
            self._watches[key] = [wd, 1]
            return key

    def unwatch(self, key) -> None:
        if key is None:
            return
        with self._lock:
            entry = self._watches.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._watches[key]
                try:
                    self._ino.rm_watch(entry[0])
                except OSError:
                    pass  # the inode is gone (IN_IGNORED already removed it)

    # -- waking ---------------------------------------------------------

    def _drain(self):
        try:
            os.read(self._ino.fileno(), _READ_BYTES)
        except (BlockingIOError, OSError):
            pass

    def _bump(self):
        """Wake every coroutine waiting on a watched file: "something changed, re-check"."""
        with self._lock:
            loops = list(self._async.items())
        for loop, futs in loops:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, futs)

    # -- asyncio ----------------------------------------------------------

    def attach_loop(self, loop):
        """Register the inotify fd with ``loop`` once; return the futures set for it."""
        with self._lock:
            futs = self._async.get(loop)
            if futs is not None:
                return futs
            for old in [lp for lp in self._async if lp.is_closed()]:
                del self._async[old]
            futs = self._async[loop] = set()
        if self._ino is not None:
            loop.add_reader(self._ino.fileno(), self._on_readable, loop)
        return futs

    def _on_readable(self, loop):
        self._drain()
        self._bump()


def _resolve(futs):
    for fut in list(futs):
        if not fut.done():
            fut.set_result(None)


_watcher = Watcher()


def set_safety_net(seconds: float) -> float:
    """Cap every sleep of a parked wait at ``seconds``, here and in the core (whose
    parked gets are handed the value: it never reads Python attributes); return
    the previous cap.  Tests raise it so that a missed wake-up costs visibly.

    :raises ValueError: not a positive number of seconds (nothing changes).
    """
    global SAFETY_NET_S
    _core.set_safety_net(seconds)
    old, SAFETY_NET_S = SAFETY_NET_S, float(seconds)
    return old


_core.set_safety_net(SAFETY_NET_S)


def watcher() -> Watcher:
    """The process-wide watcher (re-created in fork children)."""
    return _watcher


def _after_fork_in_child():
    global _watcher
    old = _watcher
    _watcher = Watcher()
    if old._ino is not None:
        # The inherited instance is the parent's open file: reading it here
        # would steal the parent's events.  Close the child's copy only,
        # without touching event loops, whose epoll set the child shares.
        try:
            old._ino.close()
        except OSError:
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)


def _next_sleep(deadline, now):
    """How long to sleep before re-checking: the safety net, less if ``deadline`` (None:
    none) is nearer; None once it has passed."""
    if deadline is None:
        return SAFETY_NET_S
    left = deadline - now
    if left <= 0:
        return None
    return min(SAFETY_NET_S, left)


class Doorbell:
    """One side's wake-up channel: waiters on ``sem`` sleep until ``ring()``.

    ``file.fd`` is the spool's descriptor (it changes after a fork; asyncio
    waits watch it); ``core`` the spool's compiled ring, which owns the
    futex word and rings (``space``: the space bell's, else the data bell's).
    Thread-safe: any number of threads may wait.

    ``spin``: a waiter's spin before it sleeps, :data:`SPIN_S` by default.  The
    spin holds the GIL (and ``sched_yield`` on a busy machine can keep it held
    for a time slice): a thread that waits beside busy Python threads of its
    own process (a pool's result thread beside its callers) sets 0.
    """

    def __init__(self, file, sem, core, space: bool):
        self.spin = SPIN_S
        self.file = file
        self.sem = sem
        self._core = core
        self._space = bool(space)
        # Registration as a C context manager: a signal can neither leak it
        # (publishers would ring forever) nor undo someone else's.
        self._waiting = _core.Waiting(sem.name)
        self._key = None
        self._watched = False
        self._lock = threading.Lock()

    # -- publisher side ---------------------------------------------------

    def has_waiters(self) -> bool:
        return self.sem.value > 0

    def ring(self) -> None:
        """Wake every waiter, blocking or asyncio (a no-op when none is registered)."""
        if self._space:
            self._core.ring_space()
        else:
            self._core.ring_data()

    # -- waiter side ------------------------------------------------------

    def _watch(self):
        if not self._watched:
            with self._lock:
                if not self._watched:
                    self._key = watcher().watch(self.file.fd)
                    self._watched = True

    def wait(self, ready, timeout: float | None, before_park=None) -> bool:
        """Block until ``ready()`` is true or ``timeout`` elapses; return ready().

        ``timeout=None`` waits forever; 0 checks once.  First spins for
        :attr:`spin` seconds (never past the timeout), yielding the CPU to
        other runnable processes between looks, with a look after the last
        yield too (the GIL stays held; a frame caught here never registers a
        waiter), then sleeps on the futex word with the GIL released.  A
        waiter still waiting :data:`PUBLISH_AFTER_S` after its spin calls
        ``before_park()`` if given (once: what an idle waiter publishes, e.g.
        a reader's counters; a wait that ends sooner never calls it), then
        sleeps on.
        A signal handler's exception (Ctrl-C) propagates with the
        registration undone.
        """
        if ready():
            return True
        if timeout is not None and timeout <= 0:
            return False
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin = self.spin
        spin_until = now + spin if deadline is None else min(now + spin, deadline)
        while spin > 0:  # a look after every yield, the last one too (the writer may have run)
            _core.yield_cpu()
            if ready():
                return True
            if time.monotonic() >= spin_until:
                break
        core, space = self._core, self._space
        publish_at = None if before_park is None else time.monotonic() + PUBLISH_AFTER_S
        with self._waiting:  # register (a full fence), read the word, then re-check
            while True:
                seen = core.bell_seen(space)
                if ready():
                    return True
                now = time.monotonic()
                wait = _next_sleep(deadline, now)
                if wait is None:
                    return False
                if publish_at is not None:
                    if now >= publish_at:  # still waiting: publish once, then sleep on
                        before_park()
                        publish_at = None
                        continue
                    wait = min(wait, publish_at - now)
                core.bell_wait(space, seen, wait)

    async def wait_async(self, ready, timeout: float | None) -> bool:
        """Like :meth:`wait`, for asyncio: parks on the inotify fd via the loop."""
        if ready():
            return True
        import asyncio

        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        self._watch()
        futs = watcher().attach_loop(loop)
        with self._waiting:
            while True:
                self._core.bell_seen(self._space)  # arms the data doorbell before the look
                if ready():
                    return True
                wait = _next_sleep(deadline, loop.time())
                if wait is None:
                    return False
                if self._key is None:  # no inotify watch: poll
                    wait = min(wait, FALLBACK_SLEEP_S)
                fut = loop.create_future()
                futs.add(fut)
                # A timer, not asyncio.wait_for: CPython 3.11's wait_for returns the
                # result of a future done when its task is cancelled (a wake-up in
                # the same loop turn), and the cancellation is lost.
                timer = loop.call_later(wait, _resolve, (fut,))
                try:
                    await fut
                finally:
                    timer.cancel()
                    futs.discard(fut)

    def forget_after_fork(self):
        """In a fork child: the process-wide watcher is new; watch again on demand."""
        self._key = None
        self._watched = False
        self._lock = threading.Lock()

    def close(self):
        self._waiting.close()
        if self._watched:
            watcher().unwatch(self._key)
            self._key = None
            self._watched = False
