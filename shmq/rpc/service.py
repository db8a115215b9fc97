"""The serving side: :class:`Service` takes calls from its request ring,
:class:`Call` answers one, ``serve`` runs handlers in supervised worker processes.

See the package docstring (:mod:`shmq.rpc`) and docs/service.md.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, Self

from .. import codec as _codec
from .._mapping import resolve_path
from ..errors import Empty, NotASpool, ShmqError
from ..spool import Spool
from ..workers import Crew, Hands, WakePipe
from .board import Board, board_path, service_status
from .replies import Replies, caller_alive
from .requests import GROUP, create_or_open, decode, take_views, taken_up_to
from .wire import BATCH_S, ERR, MAX_ATTEMPTS, OK, REQUEST_CAPACITY, TAKE_MAX, error_tuple

if TYPE_CHECKING:
    from multiprocessing.context import BaseContext

    from _typeshed import StrPath

__all__ = ["Service", "Call", "ServiceStats"]

log = logging.getLogger("shmq.service")

#: A stop request is noticed within this (a worker's get wakes this often).
STOP_POLL_S = 0.2
#: A worker that could not be started is tried again after this.
RESTART_RETRY_S = 1.0
#: A bundle answered sooner than this after its caller was found alive (at
#: admission) does not look the caller up again: a caller that died meanwhile has
#: its reply queue removed by the next sweep (shmq.rpc.replies.SWEEP_S) instead.
RECHECK_CALLER_NS = 1_000_000


class ServiceStats(NamedTuple):
    """A service's state: ``queued`` calls in the request ring, ``in_flight`` calls
    taken and not answered yet, serving ``workers`` (``busy`` of them with a call in
    hand), and the totals of its board: ``calls`` answered (``failed`` with an error),
    ``expired`` (dropped: the caller had given up), ``redeliveries`` (calls taken
    again after a worker died holding them)."""

    queued: int
    in_flight: int
    workers: int
    busy: int
    calls: int
    failed: int
    expired: int
    redeliveries: int


def queued_calls(spool: Spool) -> int | None:
    """Calls waiting in the request ring ``spool`` (None if it has no workers' group)."""
    pos = taken_up_to(spool)
    return None if pos is None else max(0, spool.next_seq - pos)


class Call:
    """One delivery of a request to the service: answer it with :meth:`reply` or :meth:`fail`.

    ``request`` is the caller's object, ``id`` its call id (unique per
    caller), ``attempt`` counts deliveries (above 1: a worker died holding
    it before, and the handler runs again: at-least-once).  Whatever is
    answered first reaches the caller; later answers of redelivered copies
    are dropped by the caller.
    """

    __slots__ = ("_svc", "_seq", "request", "id", "attempt", "_reply_to", "_caller", "_done",
                 "_taken_ns", "_sent_ns")

    def __init__(self, svc: Service, seq: int, cid: int, reply_to: str, caller: int,
                 attempt: int, request: Any, sent_ns: int, taken_ns: int) -> None:
        self._svc = svc
        self._seq = seq
        self.request = request
        self.id = cid
        self.attempt = attempt
        self._reply_to = reply_to
        self._caller = caller
        self._done = False
        self._sent_ns = sent_ns
        self._taken_ns = taken_ns  # service time: from here to the answer

    @property
    def done(self) -> bool:
        return self._done

    def reply(self, obj: Any) -> None:
        """Send ``obj`` to the caller, then settle the call (it is never delivered again).

        An ``obj`` that cannot be pickled, or does not fit the caller's reply
        queue, is answered with a :class:`shmq.RemoteError` saying so.

        :raises ValueError: the call was answered already.
        """
        self._svc._answer(self, OK, obj)

    def fail(self, exc: BaseException | str) -> None:
        """Answer with an error: the caller's ``call`` raises :class:`shmq.RemoteError`
        with ``exc``'s type name, message and traceback."""
        if not isinstance(exc, BaseException):
            exc = ShmqError(str(exc))
        self._svc._answer(self, ERR, error_tuple(exc))

    def __repr__(self) -> str:
        return f"<shmq.Call id={self.id} attempt={self.attempt} done={self._done}>"


class _Bundle:
    """Calls one ``call_many`` sent in one frame (see :mod:`shmq.rpc.requests`): the
    serving loop answers them with one reply; :meth:`Service.get_many` hands them
    out as :class:`Call` objects, and the frame is settled when all are answered."""

    __slots__ = ("seq", "first", "reply_to", "caller", "attempt", "requests", "sent_ns", "taken_ns")

    def __init__(self, seq, first, reply_to, caller, attempt, requests, sent_ns, taken_ns):
        self.seq, self.first, self.reply_to, self.caller = seq, first, reply_to, caller
        self.attempt, self.requests, self.sent_ns, self.taken_ns = attempt, requests, sent_ns, taken_ns

    def calls(self, svc):
        return [Call(svc, self.seq, self.first + i, self.reply_to, self.caller, self.attempt, req,
                     self.sent_ns, self.taken_ns) for i, req in enumerate(self.requests)]


class Service:
    """The serving side of a request/reply service at ``name_or_path``.

    A bare name lives in the private directory (docs/security.md), like a
    spool's.  The service owns the request ring at that path (a ``block``
    spool; see :mod:`shmq.rpc.requests`), created on first use and kept
    across restarts, so calls queued when the service stops are answered
    when it comes back; :meth:`destroy` removes it.

    Drive it with :meth:`serve` (handlers in worker processes, restarted
    when they die) or yourself: ``for call in svc: call.reply(...)``.
    Every process that takes calls holds a row of the service's board
    ``PATH.svc`` (:mod:`shmq.rpc.board`): the request seqs in its hands,
    its pid, calls answered, latency and service-time histograms.  Callers
    read the held seqs to send again a call that a dead worker took;
    ``shmq stat``/``top``/``metrics`` read the rest.  A worker that cannot
    claim a row serves anyway (logged): its long calls may then be sent
    twice (the duplicate answer is dropped by the caller).
    A handle works in the process that made it and in its children (it
    re-attaches after ``fork``, and pickles by path).

    ``capacity``: the request ring (a slow service makes callers wait when
    it is full).  ``max_attempts``: deliveries of a call that kills its
    worker before it is answered with a ``WorkerCrashed`` error.  ``lease``:
    seconds a handler may hold a call before callers send it again (to
    another worker; the first answer wins).  ``prefetch``: frames (single
    calls or bundles) a worker takes at once when they are waiting (fewer
    lock round trips; a worker that dies holds more).  ``copy=False``: a
    request with out-of-band buffers (numpy arrays, Arrow data) of 512 KiB
    or more reaches the handler without a copy, as read-only views of the
    request ring, never overwritten while anything references them.  A
    handler must then not keep its request (copy what it keeps): the ring
    cannot wrap past a kept one.  ``serve`` notices a handler that keeps
    them, logs it, and copies from then on in that worker.
    """

    def __init__(self, name_or_path: StrPath, *, capacity: int | str = REQUEST_CAPACITY,
                 max_attempts: int = MAX_ATTEMPTS, lease: float = 60.0, prefetch: int = 1,
                 copy: bool = True, trusted: bool = False) -> None:
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError("max_attempts must be an int >= 1")
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not lease > 0:
            raise ValueError("lease must be a positive number of seconds")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError("prefetch must be an int >= 1")
        if type(copy) is not bool:
            raise TypeError(f"copy must be a bool, not {type(copy).__name__}")
        self.name = os.fspath(name_or_path)
        self.path = resolve_path(name_or_path)
        self._opts: dict[str, Any] = dict(capacity=capacity, max_attempts=max_attempts, lease=lease,
                                          prefetch=prefetch, copy=copy, trusted=trusted)
        self.prefetch = prefetch
        self.copy = copy
        self.max_attempts = max_attempts
        self.lease = float(lease)
        self._trusted = trusted
        self._pid: int | None = None
        self._spool: Spool | None = None
        self._reader: Any = None
        self._held: deque[Any] = deque()  # frames taken, not admitted yet
        self._ready: deque[Call] = deque()  # a bundle's calls, not handed out yet
        self._hands = Hands()             # seqs taken and not answered yet (on our row)
        self._frame_calls = 1.0           # calls per frame taken, smoothed (bundles hold many)
        self._replies = Replies(self.path, trusted)
        self._stopping = False
        self._wake: WakePipe | None = None  # serve()'s; stop() wakes it, also once closed
        self._board: Board | None = None
        self._board_tried = False
        self._ring()  # create it now: clients find the service at once
        try:  # and its board: shmq stat shows a service (0 workers) before any serves
            Board.create(board_path(self.path))
        except (OSError, ShmqError) as exc:
            log.warning("%s: no service board (calls are served, not recorded): %s", self.path, exc)

    def __reduce__(self) -> tuple[Callable[..., Service], tuple[Any, ...]]:
        return (_reopen_service, (self.name, self._opts))

    def __repr__(self) -> str:
        return f"<shmq.Service {self.path}>"

    def _ring(self) -> Any:
        """This process's member of the workers' group (made again in a forked child)."""
        if self._pid != os.getpid():
            sp = create_or_open(self.path, self._opts["capacity"])
            try:
                _codec.require_trust(sp, self._trusted)  # requests are pickles: ours and private
                self._reader = sp.reader(GROUP, group=True)
            except BaseException:
                sp.close()
                raise
            self._spool = sp
            self._replies = Replies(self.path, self._trusted)
            self._held, self._ready, self._hands = deque(), deque(), Hands()
            self._board, self._board_tried = None, False  # a forked child claims its own row
            self._pid = os.getpid()
        return self._reader

    def close(self) -> None:
        """Detach this process's handles (the request ring stays; see :meth:`destroy`).

        Calls taken and not answered are given up: their callers see them in no
        live worker's hands and send them again.
        """
        if self._pid == os.getpid():
            self._held.clear()
            self._ready.clear()
            self._hands = Hands()
            self._replies.close()
            if self._board is not None:
                self._board.release()
                self._board = None
            self._reader.close()
            assert self._spool is not None  # set with _pid
            self._spool.close()
        self._pid = self._spool = self._reader = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def destroy(name_or_path: StrPath) -> None:
        """Remove a service's request ring (``PATH``) and its board (``PATH.svc``);
        calls in the ring are lost.

        :raises FileNotFoundError: no service there.
        :raises shmq.NotASpool: something other than a regular file is at ``PATH.svc``
            (nothing is removed).
        """
        path = resolve_path(name_or_path)
        bp = board_path(path)
        try:
            st = os.lstat(bp)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise NotASpool(f"{bp}: not a regular file, not a service board; nothing removed")
        Spool.destroy(path)
        if st is not None:
            try:
                os.unlink(bp)
            except FileNotFoundError:
                pass

    def stats(self) -> ServiceStats:
        """The service's :class:`ServiceStats` (the ring's queue, the board's counts)."""
        self._ring()
        assert self._spool is not None
        try:
            b = service_status(self.path)
        except (OSError, ShmqError):
            b = dict.fromkeys(("in_flight", "workers", "busy", "calls", "failed", "expired",
                               "redeliveries"), 0)
        return ServiceStats(queued_calls(self._spool) or 0, b["in_flight"], b["workers"], b["busy"],
                            b["calls"], b["failed"], b["expired"], b["redeliveries"])

    # -- taking calls ---------------------------------------------------------------

    def get(self, timeout: float | None = None) -> Call:
        """The next call to answer (blocks; no polling).

        Calls whose caller gave up (deadline passed, or its process is gone)
        are dropped here; a call that has taken down its worker
        ``max_attempts`` times is answered with a :class:`shmq.RemoteError`
        (``WorkerCrashed``) and skipped.

        :raises shmq.Empty: no call within ``timeout``.
        """
        return self.get_many(1, timeout)[0]

    def get_many(self, max_calls: int = 64, timeout: float | None = None) -> list[Call]:
        """1..``max_calls`` calls to answer, blocking only for the first (as :meth:`get`).

        Every call returned is in this process's hands until answered: take
        only as many as you will answer soon (a call held longer than
        ``lease`` is sent again by its caller).  The calls of a bundle (one
        ``call_many``'s, in one frame) are taken together: those beyond
        ``max_calls`` are already in this process's hands, and come first
        from the next ``get``/``get_many``.

        :raises shmq.Empty: no call within ``timeout``.
        """
        if not self._ready:
            for u in self._units(max_calls, timeout):
                if type(u) is _Bundle:
                    self._ready.extend(u.calls(self))
                else:
                    self._ready.append(u)
        ready = self._ready
        return [ready.popleft() for _ in range(min(max_calls, len(ready)))]

    def _units(self, max_calls, timeout):
        """Calls and whole bundles (about ``max_calls`` calls; at least one unit), as
        :meth:`get_many` takes them; the serving loop answers a bundle in one reply."""
        reader = self._ring()
        if not self._board_tried:
            self._claim_row()
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[Any] = []
        n = 0  # calls in out
        alive: dict[int, bool] = {}  # callers looked up in this batch
        while True:
            self._replies.sweep_due()
            if not self._held:
                frames = max(1, round((max_calls - n) / self._frame_calls))
                if out:  # more only if they are there already
                    self._take(reader, max(frames, self.prefetch), block=False)
                else:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    self._take(reader, max(frames, self.prefetch), timeout=left)
            now, mono = time.time_ns(), time.monotonic_ns()
            held = self._held
            while held and n < max_calls:
                u = self._admit(held.popleft(), now, mono, alive)
                if u is not None:
                    out.append(u)
                    k = len(u.requests) if type(u) is _Bundle else 1
                    n += k
                    self._frame_calls = 0.9 * self._frame_calls + 0.1 * k
            if out and (n >= max_calls or not held):
                if self._board is not None:
                    self._board.busy()
                return out

    def _take(self, reader, n, block=True, timeout=None):
        """Take up to ``n`` calls into our hands (and show them on our row at once)."""
        try:
            if self.copy:
                frames = reader.get_many(n, block, timeout)
            else:
                assert self._spool is not None  # set with the reader
                frames = take_views(self._spool, reader, n, block, timeout)
        except Empty:
            if block:
                raise
            return
        self._hands.took(f.seq for f in frames)  # published at once: callers must see these
        self._held.extend(frames)

    def _admit(self, f, now, mono, alive):
        """The call in frame ``f``, or None if it is dropped or answered here (``now``,
        ``mono``: the wall and monotonic clocks in ns; ``alive``: caller word -> liveness,
        filled as callers are seen)."""
        try:
            t = decode(f)
            n, bundle = 1, type(t) is tuple and len(t) == 7
            if bundle:  # a bundle: its calls travel and are answered together
                cid, reply_to, caller, deadline_ns, attempt, request, n = t
                if type(cid) is not int or type(request) is not list or len(request) != n or not n:
                    raise ValueError("a malformed bundle")
            else:
                cid, reply_to, caller, deadline_ns, attempt, request = t
        except Exception as exc:  # noqa: BLE001  (not a call: written by something else)
            log.warning("%s: dropping frame %d: not a call (%s)", self.path, f.seq, exc)
            self._hands.settle(f.seq)
            return None
        live = alive.get(caller)
        if live is None:
            live = alive[caller] = caller_alive(caller)
        if (deadline_ns and now > deadline_ns) or not live:
            self._hands.settle(f.seq)  # the caller raised Timeout already, or is gone
            if self._board is not None:
                self._board.expired(n)
            return None
        if bundle:
            self._hands.count(f.seq, n)  # its calls' count
            return _Bundle(f.seq, cid, reply_to, caller, attempt, request, f.timestamp_ns, mono)
        call = Call(self, f.seq, cid, reply_to, caller, attempt, request, f.timestamp_ns, mono)
        if attempt > 1 and self._board is not None:
            self._board.redelivered()
        if attempt > self.max_attempts:
            self._answer(call, ERR, (
                "WorkerCrashed", f"the call took down its worker {attempt - 1} times "
                f"(max_attempts={self.max_attempts}); not retried", None))
            return None
        return call

    def __iter__(self) -> Iterator[Call]:
        """Calls, forever (until :meth:`stop`, or a signal when serving)."""
        while not self._stopping:
            try:
                yield self.get(timeout=STOP_POLL_S)
            except Empty:
                continue

    def _claim_row(self):
        self._board_tried = True
        try:
            self._board = Board.claim(board_path(self.path))
        except (OSError, ShmqError) as exc:
            log.warning("%s: no row on the service board (calls are served, not recorded; "
                        "callers may send long calls twice): %s", self.path, exc)
            return
        if self._board is None:
            log.warning("%s: every row of the service board is held by a live process; this "
                        "one (pid %d) serves unrecorded", self.path, os.getpid())
        else:
            self._board.set_lease(self.lease)
            self._hands.row = self._board.words

    def _answer(self, call, status, value):
        self._answer_all([(call, status, value)])

    def _answer_all(self, answers):
        """Send ``(call, status, value)`` answers: one batch per caller's reply queue
        (one wake-up per caller), then settle them (reply first: a caller never
        finds a call neither in our hands nor answered)."""
        for call, _s, _v in answers:
            if call._done:
                raise ValueError(f"call {call.id} was answered already")
        by_queue: dict[Any, list[tuple[Call, int, Any]]] = {}
        for a in answers:
            by_queue.setdefault(a[0]._reply_to, []).append(a)
        failed = set()
        for path, group in by_queue.items():
            bad = self._replies.send(path, group[0][0]._caller, [(c.id, st, v) for c, st, v in group])
            failed.update(group[i][0] for i in bad)
        now, mono = time.time_ns(), time.monotonic_ns()
        answered = self._hands.answered
        for call, _s, _v in answers:
            call._done = True
            answered(call._seq)
        if self._board is not None:
            # latency: the caller's put (wall clock, this host) to the reply written
            self._board.record_many([(now - c._sent_ns, mono - c._taken_ns, st != OK or c in failed)
                                     for c, st, _v in answers])
        self._hands.publish()

    def _answer_bundle(self, b, statuses, values, service_ns):
        """Answer bundle ``b`` with one reply (``statuses``: a bytearray, one per call),
        then settle it; replies that cannot be sent together go one by one."""
        # its caller was found alive at admission: looked up again only after a while
        stale = time.monotonic_ns() - b.taken_ns >= RECHECK_CALLER_NS
        failed = self._replies.send_bundle(b.reply_to, b.caller, b.first, statuses, values, service_ns,
                                           stale)
        now, mono = time.time_ns(), time.monotonic_ns()
        self._hands.answered(b.seq, len(values))
        if self._board is not None:
            n = len(values)
            self._board.record_bulk(n, now - b.sent_ns, (mono - b.taken_ns) // n, failed)
        self._hands.publish()

    # -- serving --------------------------------------------------------------------

    def stop(self) -> None:
        """Make :meth:`serve` (or iteration) return: workers finish the call in hand.

        Safe from any thread and from a signal handler, during and after
        :meth:`serve` (which then returns soon, or has returned: nothing to do).
        """
        self._stopping = True
        wake = self._wake
        if wake is not None:
            wake.wake()  # writes nothing once serve() has closed it

    def serve(self, handler: Callable[[Any], Any], workers: int = 1, *,
              mp_context: BaseContext | str | None = None, grace: float = 10.0) -> None:
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
        # the workers' supervisor (fork: its zygote is forked here, before our handlers)
        crew = Crew(ctx, _worker_main, (self.name, self._opts, handler), daemon=True,
                    name=f"shmq-service-{os.path.basename(self.path)}", death_signal=signal.SIGTERM)
        wake = WakePipe()
        self._wake, self._stopping = wake, False
        restore = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                restore[sig] = signal.signal(sig, lambda *_a: self.stop())
        try:
            due = list(range(workers))  # slots to (re)start
            while not self._stopping:
                for i in list(due):
                    try:
                        crew.start(i)
                        due.remove(i)
                    except (OSError, ShmqError) as exc:
                        log.error("%s: could not start worker %d (retrying in %g s): %s",
                                  self.path, i, RESTART_RETRY_S, exc)
                for dead in crew.wait(RESTART_RETRY_S if due else None, [wake])[0]:
                    log.warning("%s: worker %d (pid %d) exited with %s; restarting",
                                self.path, dead.key, dead.pid, dead.exitcode)
                    due.append(dead.key)
        finally:
            self._stopping = True
            crew.stop(grace)  # SIGTERM: they finish the call in hand; SIGKILL after grace
            crew.close()
            for sig, old in restore.items():
                signal.signal(sig, old)
            self._wake = None
            wake.close()


def _worker_main(name, opts, handler, index):
    """A serving worker process (:class:`shmq.workers.Crew` armed its parent-death signal)."""
    parent = os.getppid()  # the supervisor, or the zygote that forked us: gone means stop
    svc = _reopen_service(name, opts)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_a: setattr(svc, "_stopping", True))
    try:
        _serve_batches(svc, handler, parent)
    finally:
        svc.close()


def _serve_batches(svc, handler, parent):
    """A worker's loop: take a batch, run the handler on each call, answer the batch.

    It takes as many waiting calls at once as the handler answers in about
    ``BATCH_S`` (from its recent service times, :func:`_take_size`), and
    answers each caller's calls with one put (one wake-up per caller); a
    bundle with one reply, without a :class:`Call` per call.
    """
    per_call = BATCH_S  # seconds per call, smoothed; starts at one call per take
    while not svc._stopping:
        n = _take_size(per_call)
        try:
            units = svc._units(n, STOP_POLL_S)
        except Empty:
            continue
        t0 = time.perf_counter()
        # A call sent again (its worker died with it) may be what kills workers:
        # answer one call at a time around it, and take one at a time after it, so
        # that calls taken with it are not lost (and their attempts spent) again.
        careful = any(u.attempt > 1 for u in units)
        answers = []
        calls = 0
        for u in units:
            if type(u) is _Bundle:
                t = time.perf_counter_ns()
                statuses, values = _run_bundle(handler, u.requests)
                svc._answer_bundle(u, statuses, values, time.perf_counter_ns() - t)
                calls += len(u.requests)
                continue
            try:
                answers.append((u, OK, handler(u.request)))
            except Exception as exc:  # noqa: BLE001  (the caller gets it as RemoteError)
                answers.append((u, ERR, error_tuple(exc)))
            calls += 1
            if careful:
                svc._answer_all(answers)
                answers = []
        if answers:
            svc._answer_all(answers)
        per_call = 0.8 * per_call + 0.2 * max(1e-7, (time.perf_counter() - t0) / calls)
        units = answers = u = None  # no request outlives its call here (copy=False: its pin)
        if not svc.copy and svc._spool.pins.held:  # a request still referenced
            log.warning("%s: worker %d: the handler keeps references to its requests; with "
                        "copy=False the request ring cannot wrap past them, so this worker "
                        "copies requests from now on (copy what you keep)", svc.path, os.getpid())
            svc.copy = True
        if careful:
            per_call = BATCH_S
        if os.getppid() != parent:
            break


def _take_size(per_call):
    """Calls a worker takes at once: as many as its handler answers in about
    ``BATCH_S`` (``per_call``: smoothed seconds a call), 1 to ``TAKE_MAX``.  A fast
    handler's worker so takes several waiting bundles with one lock round trip and
    answers them in one turn of its loop; a slow one's takes one call or bundle,
    leaving the rest to the other workers."""
    return max(1, min(TAKE_MAX, int(BATCH_S / per_call)))


def _run_bundle(handler, requests):
    """``(statuses, values)``: the handler's reply (``OK``) or error (``ERR``) for each
    request.  The common case, no error, is one ``map`` (no Python loop per call);
    after an error the rest run one by one."""
    statuses, values = bytearray(len(requests)), []
    it = iter(requests)
    while True:
        try:
            values += map(handler, it)  # stops at the first error; its request is consumed
            return statuses, values
        except Exception as exc:  # noqa: BLE001  (the caller gets it as RemoteError)
            statuses[len(values)] = ERR
            values.append(error_tuple(exc))


def _reopen_service(name, opts):
    return Service(name, **opts)
