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

See the package docstring (:mod:`shmq.rpc`) and docs/service.md.
"""

from __future__ import annotations

import asyncio
import itertools
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
from .board import held_ranges, service_status
from .requests import open_ring, send, taken_up_to
from .wire import NS, OK, label

if TYPE_CHECKING:
    from _typeshed import StrPath

__all__ = ["Client"]

_SETUP_LOCK = threading.Lock()
#: How often a waiting caller looks for calls lost with a dead worker (and how long
#: a lost call waits before it is sent again: two looks).
RECHECK_S = 0.25


class _Pending:
    """A call waiting for its reply; ``event`` (asyncio) or the client's condition wakes it.

    ``obj``, ``wall`` and ``attempt`` are what sending it again needs; ``seq`` is
    where it sits in the request ring, ``strikes`` how many looks in a row found it
    nowhere (2 send it again the first time, 4 after that).
    """

    __slots__ = ("done", "status", "value", "loop", "event", "obj", "wall", "attempt", "seq",
                 "strikes")

    def __init__(self, obj=None, wall=0, loop=None):
        self.done = False
        self.status = self.value = None
        self.loop = loop
        self.event = asyncio.Event() if loop is not None else None
        self.obj, self.wall, self.attempt, self.seq, self.strikes = obj, wall, 1, -1, 0


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
        self._pending = {}
        self._reading = False
        self._ids = itertools.count(1)
        self._ring = None
        self._next_look = 0.0
        self._replies = Queue()
        self._reply_path = self._replies.path
        # A multiprocessing child exits with os._exit (no atexit): remove the
        # reply queue at its exit too, not only when the resource tracker does.
        multiprocessing.util.Finalize(self, self._replies.close, exitpriority=10)
        self._me = holder_word()
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
        """Register and enqueue calls; return their ids."""
        ring = self._attach(deadline)
        ids = [next(self._ids) for _ in objs]
        ps = [_Pending(obj, wall_deadline, loop) for obj in objs]
        with self._lock:
            if not self._pending:  # the first look for lost calls: when these are RECHECK_S old
                self._next_look = time.monotonic() + RECHECK_S
            for cid, p in zip(ids, ps):
                self._pending[cid] = p
        calls = [(cid, self._reply_path, self._me, wall_deadline, 1, obj) for cid, obj in zip(ids, objs)]
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            with self._put_lock:
                seqs = send(ring, calls, left)
        except Full:
            self._abandon(ids)
            raise Timeout(f"{self._label()} did not take the call within the timeout: its "
                          "request queue is full (the service is too slow, or not running)") from None
        except BaseException:
            self._abandon(ids)
            raise
        for p, seq in zip(ps, seqs):
            p.seq = seq
        return ids

    def _abandon(self, ids):
        with self._lock:
            for cid in ids:
                self._pending.pop(cid, None)

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
        now = time.time_ns()
        lost = []
        with self._lock:
            if items:
                self._deliver(items)
            for cid, p in self._pending.items():
                if p.done or p.seq < 0:
                    continue
                if p.seq >= taken or any(lo <= p.seq < hi and not (since and lease and now - since > lease)
                                         for lo, hi, since, lease in held):
                    p.strikes = 0
                    continue
                p.strikes += 1
                # twice in a row the first time, four times after a resend: a call
                # whose holder cannot be seen (a worker without a board row) is
                # sent again once a second while it runs, not twice
                if p.strikes >= (2 if p.attempt == 1 else 4):
                    lost.append((cid, p))
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
                cid, status, value = item
            except (TypeError, ValueError):
                continue
            p = pending.get(cid)
            if p is None or p.done:
                self.duplicates += 1  # a redelivered call's second answer, or a timed-out call
                continue
            p.status, p.value, p.done = status, value, True
            if p.loop is not None:
                p.loop.call_soon_threadsafe(p.event.set)

    def _release_role(self, items):
        with self._lock:
            self._reading = False
            if items:
                self._deliver(items)
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

    def _wait(self, ids, deadline):
        """Block until every call in ``ids`` has its reply, or raise Timeout."""
        pending = self._pending
        while True:
            with self._lock:
                while True:
                    if all(pending[c].done for c in ids):
                        return [pending.pop(c) for c in ids]
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        for c in ids:
                            pending.pop(c, None)
                        raise self._timeout(len(ids))
                    if not self._reading:
                        self._reading = True
                        break
                    self._cv.wait(left)
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

    def _result(self, p):
        if p.status == OK:
            return p.value
        type_name, message, tb = p.value
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
        out = []
        i = 0
        while i < len(objs):
            chunk = objs[i:i + self.window]
            ids = self._send(chunk, deadline, wall)
            out += self._wait(ids, deadline)
            i += len(chunk)
        return [self._result(p) for p in out]

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
        [cid] = self._send([obj], deadline, wall, loop)
        with self._lock:
            p = self._pending[cid]
        try:
            while True:
                with self._lock:
                    if p.done:
                        self._pending.pop(cid, None)
                        return self._result(p)
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
        finally:
            with self._lock:
                if not p.done:
                    self._pending.pop(cid, None)
