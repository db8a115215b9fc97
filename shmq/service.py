"""Request/reply on one host: ``Service`` answers calls that ``Client`` makes.

How it maps onto the layers below (docs/service.md has the full design):

* **Requests** are messages of a :class:`shmq.WorkQueue` at the service's
  path: ``(call id, reply queue path, caller identity, deadline, request)``.
  Workers lease them, so a worker SIGKILLed mid-call (or the whole service)
  leaves the call in the queue, and it is delivered again (at-least-once to
  handlers) as soon as a consumer sees the holder dead.  The queue is a
  fixed-size ``block`` spool: a slow service makes callers wait in ``put``
  (bounded memory), never an unbounded backlog.
* **Replies** go to one anonymous :class:`shmq.Queue` per client process,
  named by its path in each request: only that process reads it, so a
  reply can never reach another caller.  The queue is removed when the
  client closes, exits, or is SIGKILLed (the multiprocessing resource
  tracker; and a worker that finds the caller's pid gone removes it).
* **Exactly one reply per call**: a call id (per client, increasing) is
  in each reply; the client keeps the calls it waits for and drops a reply
  whose call is not pending (a duplicate from a redelivery, or a call that
  timed out).
* **Trust**: request bodies are unpickled only from a work queue that is
  ours and private (:func:`shmq.codec.require_trust`), replies only from a
  queue we created; ``trusted=True`` opts in as elsewhere.

A call whose deadline passed before a worker took it is dropped by the
service (the caller has raised :class:`shmq.Timeout` already).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import signal
import threading
import time
import traceback
from collections import OrderedDict, deque

from ._lock import holder_word
from ._mapping import resolve_path
from .errors import Empty, Full, LeaseLost, RemoteError, ShmqError, Timeout, TooLarge
from .queue import Queue
from .spool import Spool
from .workqueue import WorkQueue

__all__ = ["Service", "Client", "Call", "RemoteError"]

log = logging.getLogger("shmq.service")

_OK, _ERR = 0, 1
_NS = 1_000_000_000
#: Service defaults: the request ring (allocated in full, in /dev/shm) and how
#: many times a call may take its worker down before it is answered with an error.
REQUEST_CAPACITY = "16MiB"
MAX_ATTEMPTS = 10
#: What the work queue itself stores: high, so that the service (which can still
#: answer the caller) gives up on a call, not the work queue's dead-letter spool.
_WQ_MAX_ATTEMPTS = 1_000_000
#: Workers check lease holders (a SIGKILLed worker's calls) this often.
LIVENESS_INTERVAL_S = 0.2
#: A stop request is noticed within this (a worker's get wakes this often).
STOP_POLL_S = 0.2
_REPLY_HANDLES = 256  # reply queues a worker keeps open (LRU)
_SETUP_LOCK = threading.Lock()


def _label(name, path):
    return f"service {name!r}" + (f" ({path})" if str(name) != path else "")


def _error_tuple(exc: BaseException):
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return (type(exc).__qualname__, str(exc), tb)


# ----------------------------------------------------------------------------- service


class Call:
    """One delivery of a request to the service: answer it with :meth:`reply` or :meth:`fail`.

    ``request`` is the caller's object, ``id`` its call id (unique per
    caller), ``attempt`` counts deliveries (above 1: a worker died holding
    it before, and the handler runs again: at-least-once).  Whatever is
    answered first reaches the caller; later answers of redelivered copies
    are dropped by the caller.
    """

    __slots__ = ("_svc", "_msg", "request", "id", "attempt", "_reply_to", "_caller", "_done")

    def __init__(self, svc, msg, cid, reply_to, caller, request):
        self._svc = svc
        self._msg = msg
        self.request = request
        self.id = cid
        self.attempt = msg.attempt
        self._reply_to = reply_to
        self._caller = caller
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def reply(self, obj) -> None:
        """Send ``obj`` to the caller, then settle the call (it is never delivered again).

        An ``obj`` that cannot be pickled, or does not fit the caller's reply
        queue, is answered with a :class:`shmq.RemoteError` saying so.

        :raises ValueError: the call was answered already.
        """
        self._svc._answer(self, _OK, obj)

    def fail(self, exc) -> None:
        """Answer with an error: the caller's ``call`` raises :class:`shmq.RemoteError`
        with ``exc``'s type name, message and traceback."""
        if not isinstance(exc, BaseException):
            exc = ShmqError(str(exc))
        self._svc._answer(self, _ERR, _error_tuple(exc))

    def __repr__(self):
        return f"<shmq.Call id={self.id} attempt={self.attempt} done={self._done}>"


class Service:
    """The serving side of a request/reply service at ``name_or_path``.

    A bare name lives in the private directory (docs/security.md), like a
    spool's.  The service owns the request work queue at that path (and
    ``PATH.dead``), created on first use and kept across restarts, so calls
    in flight when the service stops are answered when it comes back;
    :meth:`destroy` removes it.

    Drive it with :meth:`serve` (handlers in worker processes, restarted
    when they die) or yourself: ``for call in svc: call.reply(...)``.
    A handle works in the process that made it and in its children (it
    re-attaches after ``fork``, and pickles by path).
    """

    def __init__(self, name_or_path, *, capacity=REQUEST_CAPACITY, max_attempts=MAX_ATTEMPTS,
                 lease=60.0, prefetch=1, trusted=False):
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError("max_attempts must be an int >= 1")
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not lease > 0:
            raise ValueError("lease must be a positive number of seconds")
        self.name = os.fspath(name_or_path)
        self.path = resolve_path(name_or_path)
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError("prefetch must be an int >= 1")
        self._opts = dict(capacity=capacity, max_attempts=max_attempts, lease=lease,
                          prefetch=prefetch, trusted=trusted)
        self.prefetch = prefetch
        self._held = deque()  # calls leased by get_many, not handed out yet
        self.max_attempts = max_attempts
        self.lease = float(lease)
        self._trusted = trusted
        self._pid = None
        self._wq = None
        self._replies = OrderedDict()  # reply queue path -> Queue handle, LRU
        self._next_sweep = 0.0
        self._stopping = False
        self._wake_w = None
        self._queue()  # create it now: clients find the service at once

    def __reduce__(self):
        return (_reopen_service, (self.name, self._opts))

    def __repr__(self):
        return f"<shmq.Service {self.path}>"

    def _queue(self) -> WorkQueue:
        if self._pid != os.getpid():  # first use, or a forked child: its own handles
            self._wq = WorkQueue(self.path, capacity=self._opts["capacity"],
                                 max_attempts=_WQ_MAX_ATTEMPTS, trusted=self._trusted,
                                 liveness_interval=LIVENESS_INTERVAL_S)
            self._replies = OrderedDict()
            self._held = deque()
            self._pid = os.getpid()
        return self._wq

    def close(self) -> None:
        """Detach this process's handles (the request queue stays; see :meth:`destroy`)."""
        if self._pid == os.getpid():
            for q in self._replies.values():
                q.close()
            self._replies.clear()
            self._wq.close()
        self._pid = self._wq = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @staticmethod
    def destroy(name_or_path) -> None:
        """Remove a service's request queue (``PATH`` and ``PATH.dead``); calls in it are lost.

        :raises FileNotFoundError: no service there.
        """
        WorkQueue.destroy(resolve_path(name_or_path))

    def stats(self):
        """The request queue's :class:`shmq.WorkQueueStats`: ``ready`` (queued calls),
        ``in_flight`` (calls being handled), ``redeliveries`` and more."""
        return self._queue().stats()

    # -- taking calls ---------------------------------------------------------------

    def get(self, timeout=None) -> Call:
        """The next call to answer (blocks; no polling).

        Calls whose caller gave up (deadline passed) are dropped here; a call
        that has taken down its worker ``max_attempts`` times is answered
        with a :class:`shmq.RemoteError` (``WorkerCrashed``) and skipped.

        :raises shmq.Empty: no call within ``timeout``.
        """
        wq = self._queue()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if time.monotonic() >= self._next_sweep:
                self._sweep()
            if not self._held:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._held.extend(wq.get_many(self.prefetch, timeout=left, lease=self.lease))
            msg = self._held.popleft()
            try:
                cid, reply_to, caller, deadline_ns, request = msg.body
            except (TypeError, ValueError):
                log.warning("%s: dropping message %d: not a call", self.path, msg.id)
                _settle(msg)
                continue
            if deadline_ns and time.time_ns() > deadline_ns:
                _settle(msg)  # the caller raised Timeout already
                continue
            call = Call(self, msg, cid, reply_to, caller, request)
            if msg.attempt > self.max_attempts:
                self._answer(call, _ERR, (
                    "WorkerCrashed", f"the call took down its worker {msg.attempt - 1} times "
                    f"(max_attempts={self.max_attempts}); not retried", None))
                continue
            return call

    def __iter__(self):
        """Calls, forever (until :meth:`stop`, or a signal when serving)."""
        while not self._stopping:
            try:
                yield self.get(timeout=STOP_POLL_S)
            except Empty:
                continue

    def _answer(self, call, status, value):
        if call._done:
            raise ValueError(f"call {call.id} was answered already")
        q = self._reply_queue(call._reply_to)
        if q is not None:
            try:
                q.put((call.id, status, value))
            except Exception as exc:  # unpicklable, or beyond the reply queue's ceiling
                if status == _OK:
                    err = _error_tuple(exc)
                    msg = f"the reply could not be sent: {err[0]}: {err[1]}"
                    try:
                        q.put((call.id, _ERR, ("ReplyError", msg, err[2])))
                    except Exception:
                        log.exception("%s: reply to call %d lost", self.path, call.id)
                else:
                    log.exception("%s: error reply to call %d lost", self.path, call.id)
            self._check_caller(call._reply_to, call._caller)
        call._done = True
        _settle(call._msg)

    def _reply_queue(self, path):
        q = self._replies.get(path)
        if q is not None:
            self._replies.move_to_end(path)
            return q
        if not isinstance(path, str):
            return None
        try:
            q = _attach_queue(path, self._trusted)
        except FileNotFoundError:
            return None  # the caller is gone and its queue removed: nobody to answer
        self._replies[path] = q
        if len(self._replies) > _REPLY_HANDLES:
            _p, old = self._replies.popitem(last=False)
            old.close()
        return q

    def _check_caller(self, path, caller):
        """A caller whose pid is gone: remove its reply queue (its resource tracker
        normally does; this covers a tracker killed with it).  0.5 us: ``kill(pid, 0)``."""
        try:
            os.kill(caller & 0xFFFFFFFF, 0)
            return
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError, TypeError):
            return
        self._forget(path, destroy=True)

    def _forget(self, path, destroy):
        q = self._replies.pop(path, None)
        if q is not None:
            q.close()
        if destroy:
            try:
                Spool.destroy(path)
            except (FileNotFoundError, ShmqError):
                pass

    def _sweep(self):
        """Close reply queues that were removed (their caller exited); once a second."""
        self._next_sweep = time.monotonic() + 1.0
        for path, q in list(self._replies.items()):
            if not os.path.lexists(path):
                self._forget(path, destroy=False)

    # -- serving --------------------------------------------------------------------

    def stop(self) -> None:
        """Make :meth:`serve` (or iteration) return: workers finish the call in hand."""
        self._stopping = True
        w = self._wake_w
        if w is not None:
            try:
                os.write(w, b"s")
            except OSError:
                pass

    def serve(self, handler, workers=1, *, mp_context=None, grace=10.0) -> None:
        """Answer calls with ``handler(request) -> reply`` in ``workers`` processes; blocks.

        A handler that raises answers the caller with :class:`shmq.RemoteError`.
        A worker that dies (SIGKILL, segfault, ``os._exit``) is restarted; its
        call is delivered again to another worker.  SIGINT or SIGTERM (or
        :meth:`stop` from another thread) shut down cleanly: workers finish
        the call they hold (up to ``grace`` seconds, then they are killed and
        their calls redelivered at the next start) and ``serve`` returns.

        ``mp_context``: a multiprocessing context or start method name
        (default "fork"; with "spawn" the handler must be picklable).
        """
        if not callable(handler):
            raise TypeError("handler must be callable")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError("workers must be an int >= 1")
        ctx = mp_context if mp_context is not None else "fork"
        if isinstance(ctx, str):
            ctx = multiprocessing.get_context(ctx)
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._wake_w, self._stopping = w, False
        restore = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                restore[sig] = signal.signal(sig, lambda *_a: self.stop())
        procs = {}
        try:
            for i in range(workers):
                procs[i] = self._start_worker(ctx, handler, i)
            while not self._stopping:
                sentinels = {p.sentinel: i for i, p in procs.items()}
                ready = multiprocessing.connection.wait(list(sentinels) + [r])
                for s in ready:
                    if s in sentinels and not self._stopping:
                        i = sentinels[s]
                        procs[i].join()
                        log.warning("%s: worker %d (pid %d) exited with %s; restarting",
                                    self.path, i, procs[i].pid, procs[i].exitcode)
                        procs[i] = self._start_worker(ctx, handler, i)
        finally:
            self._stopping = True
            for p in procs.values():
                if p.is_alive():
                    try:
                        os.kill(p.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            end = time.monotonic() + grace
            for p in procs.values():
                p.join(max(0.0, end - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join()
            for sig, old in restore.items():
                signal.signal(sig, old)
            self._wake_w = None
            os.close(r)
            os.close(w)

    def _start_worker(self, ctx, handler, index):
        p = ctx.Process(target=_worker_main, args=(self.name, self._opts, handler, os.getpid()),
                        name=f"shmq-service-{os.path.basename(self.path)}-{index}", daemon=True)
        p.start()
        return p


def _settle(msg):
    try:
        msg.ack()
    except LeaseLost:
        pass  # redelivered meanwhile (our lease expired): the copy answers too; dedup drops it


def _parent_death_signal(sig):
    """Linux: deliver ``sig`` to this process when its parent dies (the supervisor)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_main(name, opts, handler, parent):
    _parent_death_signal(signal.SIGTERM)
    svc = _reopen_service(name, opts)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_a: setattr(svc, "_stopping", True))
    if os.getppid() != parent:  # the supervisor died before we set the death signal
        return
    try:
        for call in svc:
            try:
                out = handler(call.request)
            except Exception as exc:
                call.fail(exc)
            else:
                call.reply(out)
            if os.getppid() != parent:
                break
    finally:
        svc.close()


def _reopen_service(name, opts):
    return Service(name, **opts)


def _attach_queue(path, trusted):
    """Attach to an existing reply queue (never create one).

    :raises FileNotFoundError: it is gone.
    """
    q = Queue.__new__(Queue)
    q.__setstate__({"path": path, "trusted": trusted})  # what unpickling a Queue does
    return q


# ----------------------------------------------------------------------------- client


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

    def __init__(self, name_or_path, *, window=256, trusted=False):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError("window must be an int >= 1")
        self.name = os.fspath(name_or_path)
        self.path = resolve_path(name_or_path)
        self.window = window
        self._trusted = trusted
        self._pid = None
        self._closed = False

    def __reduce__(self):
        return (Client, (self.name,), {"window": self.window, "_trusted": self._trusted})

    def __setstate__(self, state):
        self.__init__(self.name, window=state["window"], trusted=state["_trusted"])

    def __repr__(self):
        return f"<shmq.Client of {self.path}>"

    def _label(self):
        return _label(self.name, self.path)

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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
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
                                                  max_attempts=_WQ_MAX_ATTEMPTS)
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
        if p.status == _OK:
            return p.value
        type_name, message, tb = p.value
        raise RemoteError(f"{self._label()}: {type_name}: {message}", self.name, type_name,
                          message, tb)

    # -- the API --------------------------------------------------------------------

    def call(self, obj, timeout=None):
        """Send ``obj`` to the service and return its reply.

        :raises shmq.Timeout: no reply within ``timeout`` seconds (None: wait
            forever); the message names the service and says when none is running.
        :raises shmq.RemoteError: the handler raised (its type, message and traceback).
        """
        return self.call_many([obj], timeout=timeout)[0]

    def call_many(self, objs, timeout=None) -> list:
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
        return time.monotonic() + timeout, time.time_ns() + int(timeout * _NS)

    async def call_async(self, obj, timeout=None):
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
