"""The calling side: :class:`Client` sends calls to a service's request ring and
matches the replies in its per-process reply queue to the calls waiting for them.

A call a worker took and died with is sent again by its caller: while it
waits, the caller looks (every :data:`RECHECK_S`) for calls that are
neither queued (seq at or past the workers' group position), nor in a live
worker's hands (the service board's held ranges), nor answered (replies
read after both looks); a call found so twice in a row is sent again with
its attempt count raised (after a resend it takes four looks: a call
whose holder cannot be seen is resent once a second, not twice).  Looking twice covers the microseconds between a
worker's take and its board update; a call sent twice is answered twice,
and the second answer is dropped here by call id.

``call_many`` sends bundles (:mod:`shmq.rpc.requests`) and waits for each as
one :class:`_Group`; a bundle found lost as above is split, and its calls
are sent again one by one (each with its own attempts from then on).

See the package docstring (:mod:`shmq.rpc`) and docs/service.md.
"""

from __future__ import annotations

import asyncio
import multiprocessing.util
import os
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Self

from .._lock import holder_word
from .._mapping import resolve_path
from ..errors import Empty, Full, RemoteError, ShmqError, Timeout, UntrustedSpool
from ..queue import Queue
from ..workers import Lookout
from .board import held_ranges, service_status
from .requests import encode_bundles, open_ring, put_bundles, send, taken_up_to
from .wire import BATCH_S, BUNDLE_MAX, NS, OK, label

if TYPE_CHECKING:
    from _typeshed import StrPath

__all__ = ["Client"]

_SETUP_LOCK = threading.Lock()
#: How often a waiting caller looks for calls lost with a dead worker (and how long
#: a lost call waits before it is sent again: two looks).
RECHECK_S = 0.25
#: Calls per bundle before a bundle's reply has said how long the handler takes.
BUNDLE_START = 8
#: Sent again when found nowhere twice in a row the first time, four times after a
#: resend: a call whose holder cannot be seen (a worker without a board row) is sent
#: again once a second while it runs, not twice (shmq.workers.holdings).
_LOOKOUT = Lookout(strikes=2, again=4)


class _Pending:
    """A call waiting for its reply; ``event`` (asyncio) or the client's condition wakes it.

    ``obj``, ``wall`` and ``attempt`` are what sending it again needs; ``seq`` is
    where it sits in the request ring, ``strikes`` how many looks in a row found it
    nowhere (2 send it again the first time, 4 after that).
    """

    __slots__ = ("done", "status", "value", "loop", "event", "obj", "wall", "attempt", "seq",
                 "strikes", "group", "index")

    def __init__(self, obj=None, wall=0, loop=None):
        self.done = False
        self.status = self.value = None
        self.loop = loop
        self.event = asyncio.Event() if loop is not None else None
        self.obj, self.wall, self.attempt, self.seq, self.strikes = obj, wall, 1, -1, 0
        self.group = self.index = None  # a bundle's call sent again alone: its place there

    def answer(self, status, value):
        self.status, self.value, self.done = status, value, True
        if self.group is not None:
            self.group.answer(self.index, status, value)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.event.set)


class _Group:
    """The calls of one bundle (ids ``first`` .. ``first + n - 1``), pending under
    ``first``: one bundle reply answers them all at once, without a :class:`_Pending`
    per call.  A bundle lost with its worker is *split*: each unanswered call gets a
    :class:`_Pending` of its own (``parts``) and is sent again alone."""

    __slots__ = ("first", "objs", "wall", "seq", "strikes", "statuses", "values", "done", "left",
                 "parts")
    attempt = 1
    loop = None

    def __init__(self, first, objs, wall):
        self.first, self.objs, self.wall = first, objs, wall
        self.seq, self.strikes, self.done = -1, 0, False
        self.statuses = self.values = self.parts = None
        self.left = len(objs)

    def answer_all(self, statuses, values):
        self.statuses, self.values, self.done, self.left = statuses, values, True, 0

    def split(self):
        """Each call as a _Pending of its own, for the caller to register (none is answered
        yet: a bundle's reply answers all of them at once)."""
        n = len(self.objs)
        if self.values is None:
            self.statuses, self.values = bytearray(n), [None] * n
        self.parts = {}
        for i, obj in enumerate(self.objs):
            p = _Pending(obj, self.wall)
            p.group, p.index, p.seq = self, i, self.seq
            self.parts[self.first + i] = p
        return self.parts

    def answer(self, i, status, value):
        self.statuses[i], self.values[i] = status, value
        self.left -= 1
        if self.left == 0:
            self.done = True


class Client:
    """Calls a :class:`Service` and waits for its replies.

    One handle can be used by many threads at once (they share one reply
    queue: whichever thread is waiting reads replies for all of them) and
    from asyncio (:meth:`call_async`).  After ``fork`` the child makes its
    own reply queue on first use; handles pickle by service path.

    ``call`` never creates the service: with no service at the path it
    waits up to its timeout for one to appear, then raises
    :class:`shmq.Timeout` naming the service.
    """

    def __init__(self, name_or_path: StrPath, *, window: int = 256, trusted: bool = False) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError("window must be an int >= 1")
        self.name = os.fspath(name_or_path)
        self.path = resolve_path(name_or_path)
        self.window = window
        self._trusted = trusted
        self._pid = None
        self._closed = False
        self.duplicates = 0  # replies dropped: a redelivered call's second answer, a late one

    def __reduce__(self) -> tuple[type[Client], tuple[str], dict[str, Any]]:
        return (Client, (self.name,), {"window": self.window, "_trusted": self._trusted})

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(self.name, window=state["window"], trusted=state["_trusted"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"<shmq.Client of {self.path}>"

    def _label(self):
        return label(self.name, self.path)

    def _setup(self):
        """Per-process state, made on first use (and again in a forked child)."""
        self._lock = threading.Lock()       # guards what follows, and the role
        self._cv = threading.Condition(self._lock)
        self._put_lock = threading.Lock()   # one writer at a time on our work queue handle
        self._pending = {}  # call id -> _Pending: single calls, and split bundles' calls
        self._groups = {}   # first call id -> _Group: bundles
        self._reading = False
        self._sleepers = 0  # threads waiting on _cv (notified only when there are some)
        self._next_id = 1
        self._ring = None
        self._next_look = 0.0
        self._replies = Queue()
        self._reply_path = self._replies.path
        # A multiprocessing child exits with os._exit (no atexit): remove the
        # reply queue at its exit too, not only when the resource tracker does.
        multiprocessing.util.Finalize(self, self._replies.close, exitpriority=10)
        self._me = holder_word()
        # calls per bundle: what the handler answers in about BATCH_S (from the service
        # times bundle replies carry), at least 2 (so that replies keep telling)
        self._bundle = BUNDLE_START
        self._per_call_ns = None
        self.duplicates = 0
        self._pid = os.getpid()

    def _check(self):
        if self._closed:
            raise ValueError("client is closed")
        if self._pid != os.getpid():
            with _SETUP_LOCK:  # threads making their first calls at once: one setup
                if self._pid != os.getpid():
                    self._setup()

    def close(self) -> None:
        """Remove this process's reply queue; calls still pending raise nothing (they are abandoned)."""
        if self._closed:
            return
        self._closed = True
        if self._pid == os.getpid():
            self._replies.close()
            if self._ring is not None:
                self._ring.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sending --------------------------------------------------------------------

    def _attach(self, deadline):
        """The service's request ring, waiting (up to ``deadline``) for it to exist."""
        if self._ring is not None:
            return self._ring
        while True:
            why = f"nothing at {self.path}"
            if os.path.lexists(self.path):
                with self._put_lock:
                    if self._ring is not None:
                        return self._ring
                    try:
                        self._ring = open_ring(self.path, self._trusted)
                        return self._ring
                    except FileNotFoundError:
                        pass
                    except UntrustedSpool:
                        raise
                    except ShmqError as exc:  # being created (no group yet), or not a service
                        why = str(exc)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise Timeout(f"{self._label()} is not running: {why} "
                              "(start it with shmq.Service(...).serve(...))")
            # No doorbell exists before the file does: look again in a moment.
            time.sleep(0.02 if left is None else min(0.02, left))

    def _send(self, objs, deadline, wall_deadline, loop=None):
        """Register and enqueue calls: several in bundles (:class:`_Group`), else one
        :class:`_Pending` each.  Returns what waits for their replies, in order."""
        ring = self._attach(deadline)
        n = len(objs)
        with self._lock:
            if not self._pending and not self._groups:  # the first look for lost calls:
                self._next_look = time.monotonic() + RECHECK_S  # when these are RECHECK_S old
            first = self._next_id
            self._next_id += n
        parts = None
        if n > 1:
            k = self._bundle
            groups = [_Group(first + i, objs[i:i + k], wall_deadline) for i in range(0, n, k)]
            parts = encode_bundles([(g.first, self._reply_path, self._me, wall_deadline, 1, g.objs,
                                     len(g.objs)) for g in groups])
        if parts is not None:
            with self._lock:
                for g in groups:
                    self._groups[g.first] = g
            waiting = groups
        else:
            waiting = [_Pending(obj, wall_deadline, loop) for obj in objs]
            with self._lock:
                self._pending.update(zip(range(first, first + n), waiting))
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            with self._put_lock:
                seqs = put_bundles(ring, parts, left) if parts is not None else None
                if parts is not None and seqs is None:  # larger than the ring: one by one
                    self._abandon(first, waiting)
                    waiting = [_Pending(obj, wall_deadline, loop) for obj in objs]
                    with self._lock:
                        self._pending.update(zip(range(first, first + n), waiting))
                if seqs is None:
                    seqs = send(ring, [(first + i, self._reply_path, self._me, wall_deadline, 1, obj)
                                       for i, obj in enumerate(objs)], left)
        except Full:
            self._abandon(first, waiting)
            raise Timeout(f"{self._label()} did not take the call within the timeout: its "
                          "request queue is full (the service is too slow, or not running)") from None
        except BaseException:
            self._abandon(first, waiting)
            raise
        for w, seq in zip(waiting, seqs):
            w.seq = seq
        return first, waiting

    def _abandon(self, first, waiting):
        with self._lock:
            self._forget(first, waiting)

    def _forget(self, first, waiting):
        """Lock held: forget calls (``first`` and ``waiting`` as :meth:`_send` returned
        them); their late replies are dropped."""
        pending = self._pending
        if waiting and type(waiting[0]) is _Group:
            for g in waiting:
                self._groups.pop(g.first, None)
                for cid in g.parts or ():
                    pending.pop(cid, None)
        else:
            for cid in range(first, first + len(waiting)):
                pending.pop(cid, None)

    def _look(self):
        """Role held: send again the calls a dead worker took (see the module docstring).

        Order matters: the group's position, then the held ranges, then the
        replies; a worker replies before it drops a call from its range, so a
        call answered in between is found answered.
        """
        self._next_look = time.monotonic() + RECHECK_S
        ring = self._ring
        if ring is None:
            return
        taken = taken_up_to(ring)
        if taken is None:
            return
        try:
            held = held_ranges(self.path)
        except FileNotFoundError:
            held = []  # no board: nothing is known to be held (backoff below bounds resends)
        except (OSError, ShmqError):
            return
        items = self._read(0)
        found = _LOOKOUT.finder(taken, held)
        lost = []
        with self._lock:
            if items:
                self._deliver(items)
            groups = [g for g in self._groups.values() if g.parts is None]
            for g in _LOOKOUT.lost(groups, found):  # lost with its worker: its calls go again, alone
                parts = g.split()
                self._pending.update(parts)
                lost += parts.items()
            gone = set(_LOOKOUT.lost(self._pending.values(), found))
            lost += [(cid, p) for cid, p in self._pending.items() if p in gone]
        # Never wait here for another thread's put (it may wait for room for as long
        # as its timeout, and we hold the reader role): the next look tries again.
        if not lost or not self._put_lock.acquire(blocking=False):
            return
        try:
            for cid, p in lost:
                try:
                    [p.seq] = send(ring, [(cid, self._reply_path, self._me, p.wall, p.attempt + 1,
                                           p.obj)], 0)
                except (Full, Timeout):
                    break  # the ring is full: the next look tries again
                p.strikes, p.attempt = 0, p.attempt + 1
        finally:
            self._put_lock.release()

    # -- receiving ------------------------------------------------------------------

    def _deliver(self, items):
        """Lock held: hand replies to their calls; drop those nobody waits for."""
        pending = self._pending
        for item in items:
            try:
                if type(item) is tuple and len(item) == 4:  # a bundle's replies
                    first, statuses, values, service_ns = item
                    g = self._groups.get(first)
                    if g is None or g.done or len(statuses) != len(values) or \
                            len(values) != len(g.objs):
                        self.duplicates += len(values)
                        continue
                    if g.parts is None:
                        g.answer_all(statuses, values)
                    else:  # split: some of its calls may be answered already, alone
                        for i, cid in enumerate(range(first, first + len(values))):
                            p = pending.get(cid)
                            if p is None or p.done:
                                self.duplicates += 1
                            else:
                                p.answer(statuses[i], values[i])
                    self._learn(service_ns / len(values))
                    continue
                cid, status, value = item
                p = pending.get(cid)
                if p is None:
                    p = self._split_for(cid)
            except (TypeError, ValueError):
                continue  # not a reply of ours
            if p is None or p.done:
                self.duplicates += 1  # a redelivered call's second answer, or a timed-out call
                continue
            p.answer(status, value)

    def _split_for(self, cid):
        """Lock held: the _Pending of call ``cid`` of a bundle answered call by call (a
        service driven with ``get``/``Call.reply``), splitting the bundle; None if none."""
        for g in self._groups.values():
            if g.first <= cid < g.first + len(g.objs):
                if g.done or g.parts is not None:
                    return None
                self._pending.update(g.split())
                return self._pending[cid]
        return None

    def _learn(self, per_call_ns):
        """Size later bundles from a bundle's service time per call."""
        old = self._per_call_ns
        self._per_call_ns = per = per_call_ns if old is None else 0.8 * old + 0.2 * per_call_ns
        self._bundle = max(2, min(BUNDLE_MAX, int(BATCH_S * NS / max(per, 1.0))))

    def _release_role(self, items):
        with self._lock:
            self._reading = False
            if items:
                self._deliver(items)
            if self._sleepers:  # (Condition.notify_all is Python: not for nobody)
                self._cv.notify_all()
            for p in self._pending.values():  # an asyncio waiter may take the role now
                if p.loop is not None and not p.done:
                    p.loop.call_soon_threadsafe(p.event.set)

    def _read(self, timeout):
        """Role held: the replies that arrive within ``timeout`` (maybe none)."""
        try:
            if timeout == 0:
                return self._replies.get_many(self.window, block=False)
            return self._replies.get_many(self.window, timeout=timeout)
        except Empty:
            return []

    def _wait(self, first, waiting, deadline):
        """Block until every call :meth:`_send` returned has its reply, or raise Timeout."""
        while True:
            with self._lock:
                while True:
                    if all(w.done for w in waiting):
                        self._forget(first, waiting)
                        return
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        self._forget(first, waiting)
                        n = sum(len(w.objs) if type(w) is _Group else 1 for w in waiting)
                        raise self._timeout(n)
                    if not self._reading:
                        self._reading = True
                        break
                    self._sleepers += 1
                    try:
                        self._cv.wait(left)
                    finally:
                        self._sleepers -= 1
            items = []
            try:
                wait = RECHECK_S if left is None else min(left, RECHECK_S)
                items = self._read(wait)
                if time.monotonic() >= self._next_look:
                    self._look()
            finally:
                self._release_role(items)

    def _timeout(self, n):
        what = "the call" if n == 1 else f"{n} calls"
        hint = ""
        try:
            from .service import queued_calls

            queued = queued_calls(self._ring)
            if queued and not service_status(self.path)["workers"]:
                hint = f": {queued} call(s) queued, no worker serving; is the service running?"
        except Exception:  # noqa: BLE001  (a hint only)
            pass
        return Timeout(f"{self._label()} did not answer {what} in time{hint}")

    def _results(self, waiting):
        """The replies, in order; raises the first error (:meth:`_result`)."""
        out: list[Any] = []
        for w in waiting:
            if type(w) is not _Group:
                out.append(self._result(w.status, w.value))
            elif not any(w.statuses):  # all OK
                out += w.values
            else:
                out += [self._result(st, v) for st, v in zip(w.statuses, w.values)]
        return out

    def _result(self, status, value):
        if status == OK:
            return value
        type_name, message, tb = value
        raise RemoteError(f"{self._label()}: {type_name}: {message}", self.name, type_name,
                          message, tb)

    # -- the API --------------------------------------------------------------------

    def call(self, obj: Any, timeout: float | None = None) -> Any:
        """Send ``obj`` to the service and return its reply.

        :raises shmq.Timeout: no reply within ``timeout`` seconds (None: wait
            forever); the message names the service and says when none is running.
        :raises shmq.RemoteError: the handler raised (its type, message and traceback).
        """
        return self.call_many([obj], timeout=timeout)[0]

    def call_many(self, objs: Iterable[Any], timeout: float | None = None) -> list[Any]:
        """Send every object, pipelined (up to ``window`` calls in flight), and return
        the replies in request order.  ``timeout`` bounds the whole batch.

        :raises shmq.Timeout: not every reply arrived in time.
        :raises shmq.RemoteError: a handler raised (the first such call, in order;
            the other replies are still collected first).
        """
        self._check()
        objs = list(objs)
        deadline, wall = self._deadlines(timeout)
        waiting = []
        i = 0
        while i < len(objs):
            chunk = objs[i:i + self.window]
            first, w = self._send(chunk, deadline, wall)
            try:
                self._wait(first, w, deadline)
            except BaseException:  # Ctrl-C (a Timeout has forgotten them already)
                self._abandon(first, w)  # nobody waits for them: late replies are dropped
                raise
            waiting += w
            i += len(chunk)
        return self._results(waiting)

    def _deadlines(self, timeout):
        if timeout is None:
            return None, 0
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError("timeout must be a non-negative number or None")
        return time.monotonic() + timeout, time.time_ns() + int(timeout * NS)

    async def call_async(self, obj: Any, timeout: float | None = None) -> Any:
        """``await`` the reply to ``obj`` (as :meth:`call`); the event loop is never blocked
        waiting: it parks on the reply queue's inotify doorbell."""
        self._check()
        deadline, wall = self._deadlines(timeout)
        loop = asyncio.get_running_loop()
        cid, [p] = self._send([obj], deadline, wall, loop)
        try:
            while True:
                with self._lock:
                    if p.done:
                        self._pending.pop(cid, None)
                        return self._result(p.status, p.value)
                    take = not self._reading
                    if take:
                        self._reading = True
                    else:
                        p.event.clear()  # no await before waiting: a set cannot slip in between
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    if take:
                        self._release_role([])
                    raise self._timeout(1)
                if take:
                    items = []
                    try:
                        try:
                            wait = RECHECK_S if left is None else min(left, RECHECK_S)
                            items = [await self._replies.get_async(timeout=wait)]
                            items += self._read(0)
                        except Empty:
                            pass
                        if time.monotonic() >= self._next_look:
                            self._look()
                    finally:
                        self._release_role(items)
                else:
                    try:
                        await asyncio.wait_for(p.event.wait(), left)
                    except asyncio.TimeoutError:
                        pass
        finally:  # answered, timed out or cancelled: nobody waits for it any more
            with self._lock:
                self._pending.pop(cid, None)
