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
one :class:`Group`; a bundle found lost as above is split, and its calls
are sent again one by one (each with its own attempts from then on).

Waiting (threads and coroutines alike, on one handle): a call first takes
a slot of the client's window (``window`` calls in flight; beyond it,
calls wait in order), then waits for its reply while one waiter, holding
the *reading role*, reads the reply queue, hands each reply to its call
and wakes that call's caller alone; its own calls answered, it hands the
role to one parked waiter.  Who waits, and how each is woken alone, is
:mod:`shmq.rpc.waiters`.

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
from .board import held_ranges, service_status
from .requests import encode_bundles, open_ring, put_bundles, send, taken_up_to
from .waiters import EXPIRED, AsyncWaiter, Group, Pending, Waiter, Waiters, flush
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


class Client:
    """Calls a :class:`Service` and waits for its replies.

    One handle can be used by many threads and coroutines at once (they
    share one reply queue: one waiting caller reads replies for all of them
    and wakes each reply's caller alone).  At most ``window`` calls of a
    process's handle are in flight; more wait for a slot in order, without
    polling, and a call that times out or is cancelled frees its slot at
    once.  After ``fork`` the child makes its own reply queue on first
    use; handles pickle by service path.

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
        self._waits = Waiters(self.window)  # the window, the reading role, the waiters
        self._lock = self._waits.lock       # guards what follows, and the waits
        self._put_lock = threading.Lock()   # one writer at a time on our work queue handle
        self._pending = {}  # call id -> Pending: single calls, and split bundles' calls
        self._groups = {}   # first call id -> Group: bundles
        self._hint = (0.0, "")  # (when, what) of the last Timeout's look at the service
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

    def _send(self, objs, deadline, wall_deadline, w):
        """Register and enqueue calls: several in bundles (:class:`Group`), else one
        :class:`Pending` each, all waited for by ``w`` (its ``left`` set to how
        many).  Returns the first call id and what waits for their replies, in order."""
        ring = self._attach(deadline)
        n = len(objs)
        parts = None
        if n > 1:
            with self._lock:
                first = self._ids(n)
            k = self._bundle
            groups = [Group(first + i, objs[i:i + k], wall_deadline) for i in range(0, n, k)]
            parts = encode_bundles([(g.first, self._reply_path, self._me, wall_deadline, 1, g.objs,
                                     len(g.objs)) for g in groups])
        if parts is not None:
            with self._lock:
                for g in groups:
                    self._groups[g.first] = g
                    g.waiter = w
                w.left = len(groups)
            waiting = groups
        else:
            waiting = [Pending(obj, wall_deadline) for obj in objs]
            with self._lock:
                if n == 1:
                    first = self._ids(1)
                self._register(first, waiting, w)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            with self._put_lock:
                seqs = put_bundles(ring, parts, left) if parts is not None else None
                if parts is not None and seqs is None:  # larger than the ring: one by one
                    self._abandon(first, waiting)
                    waiting = [Pending(obj, wall_deadline) for obj in objs]
                    with self._lock:
                        self._register(first, waiting, w)
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
        for x, seq in zip(waiting, seqs):
            x.seq = seq
        return first, waiting

    def _ids(self, n):
        """Lock held: the first of ``n`` new call ids."""
        if not self._pending and not self._groups:  # the first look for lost calls:
            self._next_look = time.monotonic() + RECHECK_S  # when these are RECHECK_S old
        first = self._next_id
        self._next_id += n
        return first

    def _register(self, first, waiting, w):
        """Lock held: calls ``first`` onwards (:class:`Pending` each) wait for replies."""
        for p in waiting:
            p.waiter = w
        self._pending.update(zip(range(first, first + len(waiting)), waiting))
        w.left = len(waiting)

    def _abandon(self, first, waiting):
        with self._lock:
            self._forget(first, waiting)

    def _forget(self, first, waiting):
        """Lock held: forget calls (``first`` and ``waiting`` as :meth:`_send` returned
        them); their late replies are dropped."""
        pending = self._pending
        if waiting and type(waiting[0]) is Group:
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
        # Every reply written before the looks above, not only a window's worth: one
        # still unread would make its call look lost and send it again.
        items = got = self._read(0)
        while len(got) == self.window:
            got = self._read(0)
            items += got
        now = time.time_ns()
        lost = []
        far = {}

        def found(p):
            return p.seq >= taken or any(lo <= p.seq < hi and not (since and lease and now - since > lease)
                                         for lo, hi, since, lease in held)

        with self._lock:
            if items:
                self._deliver(items, far)
            for g in list(self._groups.values()):
                if g.done or g.parts is not None or g.seq < 0:
                    continue
                if found(g):
                    g.strikes = 0
                    continue
                g.strikes += 1
                if g.strikes >= 2:  # lost with its worker: its calls go again, alone
                    parts = g.split()
                    self._pending.update(parts)
                    lost += parts.items()
            for cid, p in self._pending.items():
                if p.done or p.seq < 0:
                    continue
                if found(p):
                    p.strikes = 0
                    continue
                p.strikes += 1
                # twice in a row the first time, four times after a resend: a call
                # whose holder cannot be seen (a worker without a board row) is
                # sent again once a second while it runs, not twice
                if p.strikes >= (2 if p.attempt == 1 else 4):
                    lost.append((cid, p))
        if far:
            flush(far)
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

    def _deliver(self, items, far):
        """Lock held: hand replies to their calls, waking each completed call's waiter
        (``far``: see :meth:`Waiters.wake`); drop those nobody waits for."""
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
                        self._waits.answered(g, far)
                    else:  # split: some of its calls may be answered already, alone
                        for i, cid in enumerate(range(first, first + len(values))):
                            p = pending.get(cid)
                            if p is None or p.done:
                                self.duplicates += 1
                            else:
                                self._waits.answered(p.answer(statuses[i], values[i]), far)
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
            self._waits.answered(p.answer(status, value), far)

    def _split_for(self, cid):
        """Lock held: the Pending of call ``cid`` of a bundle answered call by call (a
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

    # -- waiting --------------------------------------------------------------------

    def _read(self, timeout):
        """Role held: the replies that arrive within ``timeout`` (maybe none)."""
        try:
            if timeout == 0:
                return self._replies.get_many(self.window, block=False)
            return self._replies.get_many(self.window, timeout=timeout)
        except Empty:
            return []

    def _hand_over(self, items, w):
        """Role held by ``w``: deliver what it read; if its own calls are answered,
        pass the role on and return True."""
        far = {}
        with self._lock:
            if items:
                self._deliver(items, far)
            done = w.left == 0
            if done:
                self._waits.pass_role()
        if far:
            flush(far)
        return done

    def _wait(self, first, waiting, deadline, w):
        """Block until every call :meth:`_send` returned has its reply, or raise Timeout
        (thread ``w``: a :class:`Waiter`).  On the way out the calls are forgotten and
        ``w``'s slots of the window given back."""
        lock, waits = self._lock, self._waits
        try:
            while True:
                with lock:
                    if w.left == 0:
                        return
                    left = None if deadline is None else deadline - time.monotonic()
                    expired = left is not None and left <= 0
                    reading = not expired and waits.take_role(w)
                    if not (expired or reading):
                        w.prepare()
                if expired:
                    raise self._timeout(sum(len(x.objs) if type(x) is Group else 1
                                            for x in waiting))
                if reading:
                    items = []
                    try:
                        items = self._read(RECHECK_S if left is None else min(left, RECHECK_S))
                        if time.monotonic() >= self._next_look:
                            self._look()
                    finally:
                        done = self._hand_over(items, w)
                    if done:
                        return
                else:
                    got = w.park(left)
                    with lock:
                        w.settle(got)
                        waits.unidle(w)
        finally:
            with lock:
                self._forget(first, waiting)
                waits.leave(w)
                waits.unslot(w)

    def _slot_timeout(self, n):
        what = "the call" if n == 1 else f"{n} calls"
        return Timeout(f"{self._label()}: {what} found no room in time: {self.window} calls of "
                       "this client are in flight (its window) and did not finish")

    def _timeout(self, n):
        what = "the call" if n == 1 else f"{n} calls"
        return Timeout(f"{self._label()} did not answer {what} in time{self._stall_hint()}")

    def _stall_hint(self):
        """": N call(s) queued, no worker serving; ..." when that is so, else "".  Reading
        the board takes about 27 ms: one look serves every timeout for RECHECK_S (thousands
        of calls timing out together must not stall their event loop for minutes)."""
        now = time.monotonic()
        when, hint = self._hint
        if when and now - when < RECHECK_S:
            return hint
        hint = ""
        try:
            from .service import queued_calls

            queued = queued_calls(self._ring)
            if queued and not service_status(self.path)["workers"]:
                hint = f": {queued} call(s) queued, no worker serving; is the service running?"
        except Exception:  # noqa: BLE001  (a hint only)
            pass
        self._hint = (now, hint)
        return hint

    def _results(self, waiting):
        """The replies, in order; raises the first error (:meth:`_result`)."""
        out: list[Any] = []
        for w in waiting:
            if type(w) is not Group:
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

        Calls go in chunks of at most ``window``; each chunk first waits, in order
        with the handle's other callers (threads and coroutines), for as many free
        slots of the window, and gives them back once answered, timed out or
        interrupted.

        :raises shmq.Timeout: not every reply arrived in time (or no room in the
            window within it).
        :raises shmq.RemoteError: a handler raised (the first such call, in order;
            the other replies are still collected first).
        """
        self._check()
        objs = list(objs)
        deadline, wall = self._deadlines(timeout)
        w = Waiter()
        waiting = []
        i = 0
        while i < len(objs):
            chunk = objs[i:i + self.window]
            if not self._waits.take_slots(len(chunk), deadline, w):
                raise self._slot_timeout(len(chunk))
            try:
                first, ws = self._send(chunk, deadline, wall, w)
            except BaseException:
                with self._lock:
                    self._waits.unslot(w)
                raise
            # Ctrl-C or a timeout: _wait forgets the calls (late replies are dropped)
            # and gives the slots back, as it does once they are answered
            self._wait(first, ws, deadline, w)
            waiting += ws
            i += len(chunk)
        return self._results(waiting)

    def _deadlines(self, timeout):
        if timeout is None:
            return None, 0
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError("timeout must be a non-negative number or None")
        return time.monotonic() + timeout, time.time_ns() + int(timeout * NS)

    async def call_async(self, obj: Any, timeout: float | None = None) -> Any:
        """``await`` the reply to ``obj`` (as :meth:`call`).

        The call awaits a slot of the window (in order, woken when one is
        free), then its reply, without blocking the event loop; one waiting
        caller at a time reads the reply queue (parked on its inotify doorbell)
        and wakes only the callers whose replies it read.  Cancelled (task
        cancel, ``asyncio.wait_for``) or timed out, the call frees its slot at
        once and its late reply is dropped (``duplicates``).  Its put into a
        full request ring, and the wait for a service not there yet, do block
        the loop's thread (up to ``timeout``).

        :raises shmq.Timeout: no reply within ``timeout`` seconds (or no room in
            the window within it).
        :raises shmq.RemoteError: the handler raised.
        """
        self._check()
        deadline, wall = self._deadlines(timeout)
        waits = self._waits
        w = AsyncWaiter(asyncio.get_running_loop(), deadline)
        try:
            try:
                while True:
                    with self._lock:
                        fut = waits.slot_step(w)
                    if fut is None:
                        break
                    if fut is EXPIRED:
                        raise self._slot_timeout(1)
                    waits.arm(w)
                    await fut
                # a slot is held from here: every way out gives it back (unslot)
                cid, [p] = self._send([obj], deadline, wall, w)
            except BaseException:  # cancelled (a timeout in line has left it already)
                with self._lock:
                    waits.unslot(w)
                raise
            try:
                while (fut := self._reply_step(p, w)) is not None:
                    await (self._read_async(w) if fut is _READ else fut)
            finally:  # answered, timed out or cancelled: nobody waits for it any more
                with self._lock:
                    self._pending.pop(cid, None)
                    waits.leave(w)
                    waits.unslot(w)
        finally:
            waits.disarm(w)
        return self._result(p.status, p.value)

    def _reply_step(self, p, w):
        """The next step of coroutine ``w`` waiting for call ``p``: None once ``p`` is
        answered; :data:`_READ` if ``w`` holds the reading role (taken now if free);
        else the future to await (woken by the reply, the role, or the deadline).

        :raises shmq.Timeout: the deadline passed.
        """
        with self._lock:
            if p.done:
                return None
            if w.deadline is not None and time.monotonic() >= w.deadline:
                expired = True
            else:
                expired = False
                if self._waits.take_role(w):
                    return _READ
                w.fut = w.loop.create_future()  # a wake from now on sets this one
        if expired:
            raise self._timeout(1)
        self._waits.arm(w)
        return w.fut

    async def _read_async(self, w):
        """Role held by coroutine ``w``: read the replies that arrive within RECHECK_S
        (or until its deadline), deliver them, look for lost calls when due."""
        wait = RECHECK_S if w.deadline is None else max(0.0, min(w.deadline - time.monotonic(),
                                                                 RECHECK_S))
        items = []
        try:
            try:
                items = [await self._replies.get_async(timeout=wait)]
                items += self._read(0)
            except Empty:
                pass
            if time.monotonic() >= self._next_look:
                self._look()
        finally:
            self._hand_over(items, w)


#: :meth:`Client._reply_step`: this coroutine reads the replies now.
_READ = object()
