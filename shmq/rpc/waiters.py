"""Who waits on a :class:`shmq.Client`, and how each one is woken alone.

The caller of a call, a thread or a coroutine, is a *waiter*: it parks on a
waker of its own (:class:`Waiter`, a lock of its own; :class:`AsyncWaiter`,
a future of its event loop) and is woken only by what it waits for: its
slots of the window granted, its calls answered, or the reading role handed
to it.  A wake means "look again": what it announces is state the waiter
checks under the client's lock before it parks, so no wake is lost.  What
it waits for is a call (:class:`Pending`) or a bundle of calls
(:class:`Group`), each naming its ``waiter``.

:class:`Waiters` keeps, under that one lock:

* the window: ``free`` slots, and the ``queue`` of waiters asking for some,
  served in order (nobody overtakes a waiter asking for several);
* the reading role: the ``reader`` (the one waiter that reads the reply
  queue) and the parked waiters it may be handed to (``idle``, by event
  loop; None for threads);
* the deadlines of coroutines: one heap and one timer per event loop
  (:class:`Deadlines`).

So a grant, a reply or a hand-over of the role costs one wake-up of one
waiter: a coroutine of the waker's own loop has its future set directly (no
self-pipe write), others get one ``call_soon_threadsafe`` (one per loop for
a batch of replies, gathered in a ``far`` dict and sent by :func:`flush`
once the lock is released), a thread has its lock released.
"""

from __future__ import annotations

import asyncio
import heapq
import threading
import time
from collections import deque

__all__ = ["Pending", "Group", "Waiter", "AsyncWaiter", "Deadlines", "Waiters", "flush", "EXPIRED"]

#: The loop running in this thread, or None (asyncio's own C accessor: a waker on
#: that loop's thread sets a future directly instead of writing to its self-pipe).
_running_loop = asyncio._get_running_loop
#: :meth:`Waiters.slot_step`: the deadline passed first.
EXPIRED = object()


class Pending:
    """A call waiting for its reply; its ``waiter`` is woken when it is answered.

    ``obj``, ``wall`` and ``attempt`` are what sending it again needs; ``seq`` is
    where it sits in the request ring, ``strikes`` how many looks in a row found it
    nowhere (2 send it again the first time, 4 after that).
    """

    __slots__ = ("done", "status", "value", "waiter", "obj", "wall", "attempt", "seq",
                 "strikes", "group", "index")

    def __init__(self, obj=None, wall=0):
        self.done = False
        self.status = self.value = self.waiter = None
        self.obj, self.wall, self.attempt, self.seq, self.strikes = obj, wall, 1, -1, 0
        self.group = self.index = None  # a bundle's call sent again alone: its place there

    def answer(self, status, value):
        """Record the reply; return what it completed (this call, or its bundle once
        all the bundle's calls are answered; None if not yet)."""
        self.status, self.value, self.done = status, value, True
        g = self.group
        if g is None:
            return self
        return g if g.answer(self.index, status, value) else None


class Group:
    """The calls of one bundle (ids ``first`` .. ``first + n - 1``), pending under
    ``first``: one bundle reply answers them all at once, without a :class:`Pending`
    per call.  A bundle lost with its worker is *split*: each unanswered call gets a
    :class:`Pending` of its own (``parts``) and is sent again alone."""

    __slots__ = ("first", "objs", "wall", "seq", "strikes", "statuses", "values", "done", "left",
                 "parts", "waiter")
    attempt = 1

    def __init__(self, first, objs, wall):
        self.first, self.objs, self.wall = first, objs, wall
        self.seq, self.strikes, self.done = -1, 0, False
        self.statuses = self.values = self.parts = self.waiter = None
        self.left = len(objs)

    def answer_all(self, statuses, values):
        self.statuses, self.values, self.done, self.left = statuses, values, True, 0

    def split(self):
        """Each call as a Pending of its own, for the caller to register (none is answered
        yet: a bundle's reply answers all of them at once)."""
        n = len(self.objs)
        if self.values is None:
            self.statuses, self.values = bytearray(n), [None] * n
        self.parts = {}
        for i, obj in enumerate(self.objs):
            p = Pending(obj, self.wall)
            p.group, p.index, p.seq = self, i, self.seq
            self.parts[self.first + i] = p
        return self.parts

    def answer(self, i, status, value):
        """A split bundle's call ``i`` answered alone; True once all of them are."""
        self.statuses[i], self.values[i] = status, value
        self.left -= 1
        if self.left == 0:
            self.done = True
        return self.done


class Waiter:
    """A thread waiting in a call: it parks on a lock of its own, which only a wake
    meant for it releases.  ``left``: how many of the things it waits for (calls,
    bundles) are not answered; ``n``, ``granted``, ``gone``: its slots of the window
    (asked for, granted, done with).

    The lock is made when the thread first parks (:meth:`prepare`, under the
    client's lock): a call whose thread reads its own reply never needs one.
    A wake before then only marks ``woken``, and the state it announces is
    what the thread checks, under the client's lock, before it parks.
    """

    __slots__ = ("lock", "woken", "left", "n", "granted", "gone")
    loop = None

    def __init__(self):
        self.lock = None
        self.woken = self.granted = self.gone = False
        self.left = self.n = 0

    def prepare(self):
        """Client's lock held, state checked: the thread parks next."""
        if self.lock is None:
            self.lock = threading.Lock()
            self.lock.acquire()  # released by a wake (at most one outstanding: ``woken``)
            self.woken = False  # a wake before now announced what was just checked

    def park(self, timeout):
        """Sleep until woken or ``timeout`` (None: forever) passes; then, with the
        client's lock, :meth:`settle` what it returned."""
        return self.lock.acquire(True, -1 if timeout is None else max(0.0, timeout))

    def wake(self):
        """Client's lock held."""
        if not self.woken:
            self.woken = True
            if self.lock is not None:
                self.lock.release()

    def settle(self, got):
        """Client's lock held, after :meth:`park`: consume a wake that came after the
        park timed out, so that the next park sleeps."""
        if self.woken:
            if not got:
                self.lock.acquire()  # released by that wake: returns at once
            self.woken = False


class AsyncWaiter:
    """A coroutine's call: it parks on ``fut``, a future of its ``loop`` made for each
    park; the other fields as :class:`Waiter`'s, and ``deadline`` (monotonic; None:
    none), ``armed``: in its loop's :class:`Deadlines`."""

    __slots__ = ("loop", "fut", "left", "n", "granted", "gone", "deadline", "armed")

    def __init__(self, loop, deadline):
        self.loop, self.deadline, self.fut = loop, deadline, None
        self.left = self.n = 0
        self.granted = self.gone = self.armed = False


class Deadlines:
    """The deadlines of one event loop's parked calls, behind one timer of that loop.

    Not a timer each: thousands of calls waiting for the window would each add
    one to the loop's heap, whose order is kept by Python-level comparisons,
    and one more object to collect.  Here a call is a tuple in a heap ordered
    in C, added at its first park and woken once its deadline has passed;
    a call that ends first leaves its tuple behind (``armed`` false), dropped
    when the heap holds over twice as many as the calls still armed.  Used
    from the loop's thread only.
    """

    __slots__ = ("loop", "heap", "timer", "at", "live", "seq")

    def __init__(self, loop):
        self.loop, self.heap, self.timer, self.at, self.live, self.seq = loop, [], None, None, 0, 0

    def add(self, w):
        self.seq += 1
        heapq.heappush(self.heap, (w.deadline, self.seq, w))
        w.armed = True
        self.live += 1
        if len(self.heap) > 2 * self.live + 64:
            self.heap = [e for e in self.heap if e[2].armed]
            heapq.heapify(self.heap)
        if self.at is None or w.deadline < self.at:
            self._arm(w.deadline)

    def finish(self, w):
        """``w``'s call is over: its deadline no longer matters."""
        if w.armed:
            w.armed = False
            self.live -= 1

    def _arm(self, when):
        if self.timer is not None:
            self.timer.cancel()
        self.at = when
        self.timer = self.loop.call_later(max(0.0, when - time.monotonic()), self._fire)

    def _fire(self):
        self.timer = self.at = None
        heap = self.heap
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            w = heapq.heappop(heap)[2]
            if w.armed:
                self.finish(w)
                fut = w.fut
                if fut is not None and not fut.done():
                    fut.set_result(None)  # it sees its deadline passed
        if heap:
            self._arm(heap[0][0])


class Waiters:
    """The waiters of one client process (see the module docstring).  Every method
    but :meth:`take_slots`, :meth:`arm` and :meth:`disarm` is called with ``lock``
    held."""

    def __init__(self, window):
        self.lock = threading.Lock()
        self.free = window  # slots of the window not taken
        self.queue = deque()  # waiters for room in the window, in order
        self.reader = None  # the waiter holding the reading role (None: nobody reads)
        # parked waiters that may be handed the role, by event loop (None: threads);
        # a dict per loop, popped from its end (the newest waiter, the last answered)
        self.idle = {}
        self.timers = {}  # event loop -> Deadlines of its parked calls

    # -- waking -----------------------------------------------------------------------

    def wake(self, w, far=None):
        """Wake waiter ``w``: a thread's lock is released; a coroutine of the loop running
        here has its future set; one of another thread's loop gets one
        ``call_soon_threadsafe``, or, with ``far`` (a dict) given, joins ``far[loop]`` for
        :func:`flush` to wake with one call per loop once the lock is released."""
        if w.loop is None:
            w.wake()
            return
        fut = w.fut
        if fut is None or fut.done():
            return  # not parked, or woken already: it looks again anyway
        if w.loop is _running_loop():
            fut.set_result(None)
        elif far is not None:
            far.setdefault(w.loop, []).append(fut)
        else:
            _post(w.loop, [fut])

    def answered(self, item, far):
        """``item`` (a call or bundle; None: nothing complete yet) is answered: wake its
        waiter once everything it waits for is (the reader needs no wake)."""
        w = None if item is None else item.waiter
        if w is None:
            return
        w.left -= 1
        if w.left == 0 and w is not self.reader:
            self.unidle(w)
            self.wake(w, far)

    # -- the reading role -------------------------------------------------------------

    def take_role(self, w):
        """True if ``w`` holds the reading role (taken now if nobody held it); else
        ``w`` is recorded as idle, for the role to be handed to it."""
        if self.reader is None:
            self.reader = w
        elif self.reader is not w:
            idle = self.idle.get(w.loop)
            if idle is None:
                idle = self.idle[w.loop] = {}
            idle[w] = None
            return False
        return True

    def unidle(self, w):
        """``w`` no longer waits parked."""
        idle = self.idle.get(w.loop)
        if idle:
            idle.pop(w, None)

    def pass_role(self):
        """The reader is done: hand the role to one idle waiter and wake it alone: one of
        this thread's loop first (no self-pipe write), then a thread, then one of
        another loop."""
        self.reader = None
        idle = self.idle
        if not idle:
            return
        for key in (_running_loop(), None, *idle):
            waiters = idle.get(key)
            if waiters is None:
                continue
            if key is not None and key.is_closed():  # its coroutines will never run
                del idle[key]
                continue
            if waiters:
                w, _ = waiters.popitem()
                self.reader = w
                self.wake(w)
                return

    def leave(self, w):
        """``w`` stops waiting for replies (answered, timed out, cancelled, interrupted)."""
        self.unidle(w)
        if self.reader is w:
            self.pass_role()

    # -- the window -------------------------------------------------------------------

    def take_slots(self, n, deadline, w):
        """Lock not held: take ``n`` slots for thread ``w``, waiting in order for them;
        False if ``deadline`` passed first (``w`` left the queue)."""
        with self.lock:
            w.n, w.gone = n, False
            if not self.queue and self.free >= n:
                self.free -= n
                w.granted = True
                return True
            w.granted = False
            self.queue.append(w)
            self.grant()  # drops those who left the queue ahead of w; may grant w
            if w.granted:
                return True
            w.prepare()
        try:
            while True:
                got = w.park(None if deadline is None else deadline - time.monotonic())
                with self.lock:
                    w.settle(got)
                    if w.granted:
                        return True
                    if deadline is not None and time.monotonic() >= deadline:
                        self.unslot(w)
                        return False
        except BaseException:  # Ctrl-C: the slots go back (or to the next in line)
            with self.lock:
                self.unslot(w)
            raise

    def slot_step(self, w):
        """A coroutine's way to one slot (``w``: its :class:`AsyncWaiter`): None once it
        has it, :data:`EXPIRED` if its deadline passed first (it left the queue), else
        the future to await before the next step (woken when granted, or at the
        deadline: :meth:`arm` it once the lock is released).  The first step takes a
        free slot at once if nobody waits for one, else queues ``w`` in order."""
        if w.granted:
            return None
        if w.n == 0:
            w.n = 1
            if not self.queue and self.free >= 1:
                self.free -= 1
                w.granted = True
                return None
            self.queue.append(w)
            self.grant()
            if w.granted:
                return None
        elif w.deadline is not None and time.monotonic() >= w.deadline:
            self.unslot(w)
            return EXPIRED
        w.fut = w.loop.create_future()
        return w.fut

    def grant(self):
        """Grant slots to the waiters in the queue, in order."""
        q = self.queue
        while q:
            w = q[0]
            if w.gone:
                q.popleft()
                continue
            if w.n > self.free:
                return
            q.popleft()
            self.free -= w.n
            w.granted = True
            self.wake(w)

    def unslot(self, w):
        """``w`` is done with the window: granted, it gives its slots back; still queued,
        it leaves the queue (lazily: :meth:`grant` drops it)."""
        if w.gone:
            return
        w.gone = True
        if w.granted:
            w.granted = False
            self.free += w.n
        if self.queue:
            self.grant()

    # -- deadlines of coroutines ----------------------------------------------------

    def arm(self, w):
        """In ``w``'s loop: wake it at its deadline (the first park of its call arms it)."""
        if w.deadline is None or w.armed:
            return
        timers = self.timers.get(w.loop)
        if timers is None:
            for old in [lp for lp in self.timers if lp.is_closed()]:
                del self.timers[old]
            timers = self.timers[w.loop] = Deadlines(w.loop)
        timers.add(w)

    def disarm(self, w):
        """In ``w``'s loop: its call is over."""
        if w.armed:
            self.timers[w.loop].finish(w)


def _resolve(futs):
    """In the futures' loop: wake their coroutines (a cancelled one is done already)."""
    for fut in futs:
        if not fut.done():
            fut.set_result(None)


def _post(loop, futs):
    """From another thread: wake ``futs`` (of ``loop``) with one ``call_soon_threadsafe``."""
    try:
        loop.call_soon_threadsafe(_resolve, futs)
    except RuntimeError:  # the loop is closed: nothing of it waits any more
        pass


def flush(far):
    """Once the lock is released: wake the coroutines :meth:`Waiters.wake` gathered in
    ``far``, one ``call_soon_threadsafe`` per loop."""
    for loop, futs in far.items():
        _post(loop, futs)
