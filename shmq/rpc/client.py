"""The calling side: :class:`Client` sends calls to a service's request work queue and
matches the replies in its per-process reply queue to the calls waiting for them.

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
from ..errors import Empty, Full, RemoteError, Timeout, TooLarge
from ..queue import Queue
from ..workqueue import WorkQueue
from .wire import NS, OK, REQUEST_CAPACITY, WQ_MAX_ATTEMPTS, label

if TYPE_CHECKING:
    from _typeshed import StrPath

__all__ = ["Client"]

_SETUP_LOCK = threading.Lock()


class _Pending:
    """A call waiting for its reply; ``event`` (asyncio) or the client's condition wakes it."""

    __slots__ = ("done", "status", "value", "loop", "event")

    def __init__(self, loop=None):
        self.done = False
        self.status = self.value = None
        self.loop = loop
        self.event = asyncio.Event() if loop is not None else None


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
        self._wq = None
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
            if self._wq is not None:
                self._wq.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sending --------------------------------------------------------------------

    def _attach(self, deadline):
        """The service's work queue, waiting (up to ``deadline``) for it to exist."""
        if self._wq is not None:
            return self._wq
        while True:
            if os.path.lexists(self.path):
                with self._put_lock:
                    if self._wq is not None:
                        return self._wq
                    try:
                        self._wq = WorkQueue.open(self.path, trusted=self._trusted,
                                                  capacity=REQUEST_CAPACITY,
                                                  max_attempts=WQ_MAX_ATTEMPTS)
                        return self._wq
                    except FileNotFoundError:
                        pass
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise Timeout(f"{self._label()} is not running: nothing at {self.path} "
                              "(start it with shmq.Service(...).serve(...))")
            # No doorbell exists before the file does: look again in a moment.
            time.sleep(0.02 if left is None else min(0.02, left))

    def _send(self, objs, deadline, wall_deadline):
        """Register and enqueue calls; return their ids."""
        wq = self._attach(deadline)
        ids = [next(self._ids) for _ in objs]
        with self._lock:
            for cid in ids:
                self._pending[cid] = _Pending()
        bodies = [(cid, self._reply_path, self._me, wall_deadline, obj) for cid, obj in zip(ids, objs)]
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            with self._put_lock:
                try:
                    wq.put_many(bodies, timeout=left)
                except TooLarge:
                    if len(bodies) == 1:
                        raise
                    # larger than the request ring as one atomic batch: one by one
                    for body in bodies:
                        left = None if deadline is None else max(0.0, deadline - time.monotonic())
                        wq.put(body, timeout=left)
        except Full:
            self._abandon(ids)
            raise Timeout(f"{self._label()} did not take the call within the timeout: its "
                          "request queue is full (the service is too slow, or not running)") from None
        except BaseException:
            self._abandon(ids)
            raise
        return ids

    def _abandon(self, ids):
        with self._lock:
            for cid in ids:
                self._pending.pop(cid, None)

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
                items = self._read(left)
            finally:
                self._release_role(items)

    def _timeout(self, n):
        what = "the call" if n == 1 else f"{n} calls"
        hint = ""
        try:
            st = self._wq.stats()
            if st.ready and not st.in_flight:
                hint = f": {st.ready} call(s) queued, none being handled; is the service running?"
        except Exception:
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
        [cid] = self._send([obj], deadline, wall)
        p = _Pending(loop)
        with self._lock:
            if self._pending[cid].done:  # answered before we swapped in the async waiter
                p = self._pending[cid]
            else:
                self._pending[cid] = p
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
                            items = [await self._replies.get_async(timeout=left)]
                            items += self._read(0)
                        except Empty:
                            pass
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
