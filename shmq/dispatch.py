"""shmq.Dispatcher: message handlers in supervised worker processes.

Layout on disk, for a dispatcher on ``PATH`` (docs/dispatcher.md has the
semantics and the trade-offs):

* ``PATH`` is the *ingress* work queue: producers put messages there with a
  ``"type"`` header (``Dispatcher.publish``, ``ctx.publish``, or a plain
  ``WorkQueue.put(..., headers={"type": ...})``);
* a *router* thread in the supervising process moves each ingress message to
  the per-type work queue ``PATH.<type>`` (adding ``message_id`` and
  ``correlation_id`` headers, and the handler's ``max_attempts``); a type with
  no handler is nacked with a ``NoHandler`` error until the ingress queue
  dead-letters it (``PATH.dead``);
* each type has its own worker processes (``parallelism``), which block in
  ``WorkQueue.get`` on their type's queue only: no head-of-line blocking
  between types, one lease table per type, handler failures dead-lettered in
  ``PATH.<type>.dead``;
* ``PATH.dispatch`` is a small memory-mapped *board*: the supervisor's
  identity and per-type targets, and one row per worker slot with counters,
  the message in progress and a ring of recent latencies.  ``status`` and
  ``metrics`` read it from any process;
* a running supervisor listens on an abstract Unix socket named after the
  path's hash (no file): ``python -m shmq.dispatch scale PATH TYPE N`` and
  ``stop PATH`` talk to it.

Handlers run in the worker's main thread; a watchdog thread in the same
process renews the lease, sets ``ctx.cancelled`` when the timeout expires,
and terminates the worker (after nacking the message) if the handler ignores
the cancellation for ``cancel_grace`` seconds.  The supervisor replaces
workers that die, and kills (as a backstop) a worker whose handler holds the
GIL so long that its watchdog cannot run.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import errno
import fcntl
import hashlib
import inspect
import json
import logging
import math
import mmap
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import re
import signal
import socket
import stat as _stat
import struct
import sys
import threading
import time
import traceback

from ._lock import holder_alive, holder_pid, holder_word
from ._mapping import resolve_path
from .errors import Empty, LeaseLost, ShmqError
from .workqueue import Message, WorkQueue

__all__ = ["Dispatcher", "Context", "HandlerTimeout", "NoHandler", "WorkerDied", "main",
           "status", "scale", "stop", "metrics", "format_status"]

_log = logging.getLogger("shmq.dispatch")

#: An idle worker (or the router) returns from ``WorkQueue.get`` this often to
#: notice a stop request.  Dispatch itself never waits for it: a put wakes the
#: blocked ``get`` at once (the spool's doorbell).
IDLE_WAKE_S = 0.5
#: The supervisor re-reads the board this often while some handler has a
#: timeout (backstop kills), and never otherwise.
SUPERVISOR_TICK_S = 0.5
#: The supervisor SIGKILLs a worker whose handler is this long past its
#: timeout + cancel_grace (its own watchdog should have acted long before).
BACKSTOP_MARGIN_S = 1.0
#: The router holds an ingress message this long while forwarding it.
ROUTER_LEASE_S = 60.0

EXIT_OK = 0
EXIT_STARTUP = 3  # the worker could not start (import error, factory raised, ...)
EXIT_TIMEOUT = 70  # the watchdog terminated a handler that ignored its cancellation

_TYPE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_RESERVED_HEADERS = ("type", "message_id", "correlation_id", "parent_id")


class HandlerTimeout(ShmqError, TimeoutError):
    """A handler ran past its ``timeout`` (recorded as the nack error)."""


class NoHandler(ShmqError):
    """An ingress message whose ``"type"`` header names no registered handler."""


class WorkerDied(ShmqError):
    """A worker process died while handling a message (recorded as the nack error)."""


# ---------------------------------------------------------------------------------------
# the board: PATH.dispatch
# ---------------------------------------------------------------------------------------

_MAGIC = int.from_bytes(b"SHMQDSP1", "little")
_VERSION = 1
_HDR_BYTES = 16384
_MAX_TYPES = 64
_JSON_OFF = 2048
# header words
(H_MAGIC, H_VERSION, H_HOLDER, H_STATE, H_NROWS, H_RESERVOIR, H_NTYPES, H_STARTED_NS,
 H_JSON_LEN, H_ROUTED, H_UNROUTABLE, H_STOPPED_NS) = range(12)
H_TARGET = 16  # one word per type
H_LIVE = H_TARGET + _MAX_TYPES
STATE_STOPPED, STATE_STARTING, STATE_RUNNING, STATE_STOPPING = 0, 1, 2, 3
_STATE_NAMES = {STATE_STOPPED: "stopped", STATE_STARTING: "starting", STATE_RUNNING: "running",
                STATE_STOPPING: "stopping"}
# row words (one row per worker slot; one writer at a time: its worker, or the
# supervisor once that worker is dead)
(R_TYPE, R_HOLDER, R_PROCESSED, R_FAILED, R_TIMED_OUT, R_CRASHED, R_BUSY, R_MSG, R_SLOT,
 R_TOKEN, R_ATTEMPT, R_STARTED_NS, R_DEADLINE_NS, R_NSAMPLES, R_LEASE_LOST, R_GRACE_NS) = range(16)
_ROW_HDR = 32


def board_path(path):
    """The metrics board file of the dispatcher whose ingress queue is ``path``."""
    return resolve_path(path) + ".dispatch"


def _row_words(reservoir):
    return _ROW_HDR + reservoir


class _Board:
    """A mapping of ``PATH.dispatch`` (words are published with aligned 8-byte stores)."""

    def __init__(self, fd, size, writable):
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        self.w = memoryview(self.mm).cast("Q")
        self.size = size

    @classmethod
    def open(cls, path, writable=False):
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size < _HDR_BYTES:
                raise ShmqError(f"{path}: not a dispatcher board (too short)")
            b = cls(fd, size, writable)
        finally:
            os.close(fd)
        if b.w[H_MAGIC] != _MAGIC or b.w[H_VERSION] != _VERSION:
            b.close()
            raise ShmqError(f"{path}: not a dispatcher board (bad magic or version)")
        return b

    def base(self, row):
        return _HDR_BYTES // 8 + row * _row_words(self.w[H_RESERVOIR])

    def config(self):
        n = self.w[H_JSON_LEN]
        if not n or n > _HDR_BYTES - _JSON_OFF:
            return {}
        return json.loads(bytes(self.mm[_JSON_OFF:_JSON_OFF + n]))

    def close(self):
        if self.mm is not None:
            self.w.release()
            self.mm.close()
            self.mm = None


def _attach(path, trusted=False) -> WorkQueue:
    """Open an existing work queue cheaply.

    ``WorkQueue(path)`` on an existing queue still builds (and pre-faults) a
    temporary spool of the full ``capacity`` and ``dead_capacity`` before it
    finds the path taken (``Spool.create(exist_ok=True)``): 80 MiB and
    ~130 ms with the defaults.  The sizes only matter when creating, so pass
    tiny ones.  :raises FileNotFoundError: no queue at ``path``.
    """
    return WorkQueue.open(path, capacity=4096, dead_capacity=4096, leases=1, keys=1,
                          trusted=trusted)


def _open_or_create(path, **opts) -> WorkQueue:
    try:
        return _attach(path, opts.get("trusted", False))
    except FileNotFoundError:
        return WorkQueue(path, **opts)


def _drain(fd):
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _block_stop_signals():
    """In a helper thread of a worker: leave SIGINT/SIGTERM to the main thread."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)


def _percentile(sorted_values, q):
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


# ---------------------------------------------------------------------------------------
# handler registration
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _HandlerSpec:
    type: str
    target: object  # a module-level function, or a class (the factory)
    is_class: bool
    scope: str  # "message" | "worker" (classes only)
    parallelism: int
    timeout: float | None
    max_attempts: int
    lease: float
    cancel_grace: float
    retry_delay: object  # float, or callable(attempt) -> float


@dataclasses.dataclass(frozen=True)
class _WorkerSpec:
    handler: _HandlerSpec
    queue_path: str
    ingress_path: str
    board_path: str
    row: int
    initializer: object
    log_level: object
    trusted: bool


def _check_type(t):
    if not isinstance(t, str) or not _TYPE_RE.fullmatch(t):
        raise ValueError(f"message type must match {_TYPE_RE.pattern!r} (it names the queue "
                         f"PATH.<type>), not {t!r}")
    if t.endswith(".dead") or t == "dead" or t == "dispatch" or t.startswith("dispatch."):
        raise ValueError(f"message type {t!r} is reserved (it would clash with PATH.dead or "
                         "PATH.dispatch)")
    return t


def _qualname(obj):
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"


def _check_importable(obj, what):
    """Worker processes are spawned: handlers travel by reference (module + name)."""
    qn = getattr(obj, "__qualname__", "")
    if "<locals>" in qn or "<lambda>" in qn:
        raise TypeError(f"{what} {_qualname(obj)} must be importable: define it at module level "
                        "(worker processes import it by name)")
    try:
        pickle.dumps(obj)
    except Exception as exc:
        raise TypeError(f"{what} {_qualname(obj)} must be importable (module-level) so that "
                        f"worker processes can load it: {exc}") from None


def _delay_for(spec, attempt):
    d = spec.retry_delay(attempt) if callable(spec.retry_delay) else spec.retry_delay
    return max(0.0, float(d or 0.0))


def _positive(name, v, allow_none=False):
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v:
        raise ValueError(f"{name} must be a positive number{' or None' if allow_none else ''}")
    return float(v)


# ---------------------------------------------------------------------------------------
# the handler's context (worker side)
# ---------------------------------------------------------------------------------------


class _LogContext(logging.Filter):
    """Adds the current message's identity to records of ``ctx.logger``."""

    def __init__(self, rt):
        super().__init__()
        self.rt = rt

    def filter(self, record):
        ctx = self.rt.current
        if ctx is not None:
            record.msg_type = ctx.type
            record.message_id = ctx.message_id
            record.correlation_id = ctx.correlation_id
            record.attempt = ctx.attempt
        else:
            _default_log_fields(record)
        return True


def _default_log_fields(record):
    for k in ("msg_type", "message_id", "correlation_id", "attempt"):
        if not hasattr(record, k):
            setattr(record, k, "-")
    return True


LOG_FORMAT = ("%(asctime)s %(levelname)s %(processName)s %(name)s "
              "[%(msg_type)s id=%(message_id)s corr=%(correlation_id)s try=%(attempt)s] %(message)s")


class Context:
    """What a handler gets besides the body: identity, cancellation, publishing.

    * ``type``, ``body``, ``headers``, ``attempt`` (1 on first delivery);
    * ``message``: the :class:`shmq.Message` leased from the type's queue
      (ack/nack are the dispatcher's job: do not call them);
    * ``message_id``: the id the producer got back from ``publish``/``put``
      on the ingress queue; ``correlation_id``: shared by every message of a
      chain (a root message's own ``message_id`` unless the producer set the
      header); ``parent_id``: the ``message_id`` of the message whose handler
      published this one (None for roots);
    * ``cancelled``: a :class:`threading.Event` set when the timeout expires
      (or the lease was lost): return (or raise) soon after it is set;
    * ``logger``: a :class:`logging.Logger` whose records carry ``msg_type``,
      ``message_id``, ``correlation_id`` and ``attempt`` attributes.
    """

    __slots__ = ("_rt", "_job", "type", "message", "body", "headers", "attempt", "message_id",
                 "correlation_id", "parent_id", "cancelled", "logger")

    def __init__(self, rt, msg):
        self._rt = rt
        self._job = None
        self.type = rt.spec.handler.type
        self.message = msg
        self.body = msg.body
        self.headers = msg.headers
        self.attempt = msg.attempt
        self.message_id = msg.headers.get("message_id", msg.id)
        self.correlation_id = msg.headers.get("correlation_id", self.message_id)
        self.parent_id = msg.headers.get("parent_id")
        self.cancelled = threading.Event()
        self.logger = rt.logger

    def publish(self, type, body, key=None, delay=None, headers=None) -> int:
        """Enqueue a follow-up message of ``type`` in the same chain; return its id.

        It carries this message's ``correlation_id`` and has ``parent_id`` set
        to this message's ``message_id``.  It is routed like any message:
        with no handler for ``type`` it ends up dead-lettered (NoHandler).
        """
        if not isinstance(type, str):
            raise TypeError(f"message type must be a str, not {builtins_type(type).__name__}")
        h = dict(headers or {})
        h["type"] = type
        h["correlation_id"] = self.correlation_id
        h["parent_id"] = self.message_id
        h.pop("message_id", None)
        return self._rt.publish(body, key, delay, h)

    def heartbeat(self, extend=None) -> None:
        """Renew the lease now; with ``extend`` (seconds), also push the timeout
        to at least ``extend`` seconds from now (progress reported by a
        long-running operation).  A cancellation already signalled stays.

        Useful when the handler holds the GIL for long stretches (the
        automatic renewal runs in a thread) or tracks an external operation.

        :raises shmq.LeaseLost: the lease was re-granted to another worker.
        """
        self._rt.watchdog.heartbeat(self._job, extend)

    def time_left(self):
        """Seconds until the timeout (negative once past it), or None without a timeout."""
        job = self._job
        if job is None or job.deadline is None:
            return None
        return job.deadline - time.monotonic()

    def __repr__(self):
        return (f"<shmq.dispatch.Context type={self.type!r} message_id={self.message_id} "
                f"correlation_id={self.correlation_id!r} attempt={self.attempt}>")


builtins_type = type


class _Job:
    __slots__ = ("msg", "ctx", "started", "deadline", "kill_at", "next_hb", "timed_out",
                 "lease_lost", "done")

    def __init__(self, msg, ctx, timeout, hb_interval):
        now = time.monotonic()
        self.msg = msg
        self.ctx = ctx
        self.started = now
        self.deadline = None if timeout is None else now + timeout
        self.kill_at = None
        self.next_hb = now + hb_interval
        self.timed_out = False
        self.lease_lost = False
        self.done = False


class _Watchdog(threading.Thread):
    """Worker-side: renews the lease, cancels on timeout, terminates an ignoring handler."""

    def __init__(self, rt):
        super().__init__(name="shmq-dispatch-watchdog", daemon=True)
        self.rt = rt
        self.cond = threading.Condition()
        self.job = None
        h = rt.spec.handler
        self.hb_interval = h.lease / 3.0

    def begin(self, job):
        with self.cond:
            self.job = job
            self.cond.notify()

    def end(self, job):
        with self.cond:
            job.done = True
            self.job = None
            self.cond.notify()

    def heartbeat(self, job, extend):
        with self.cond:
            if job is None or job.done:
                raise RuntimeError("ctx.heartbeat() called outside its handler")
            if job.lease_lost:
                raise LeaseLost(f"message {job.msg.id}: the lease was lost")
            now = time.monotonic()
            if extend is not None:
                extend = _positive("extend", extend)
                if job.deadline is not None and not job.timed_out:
                    job.deadline = max(job.deadline, now + extend)
                    self.rt.row_set(R_DEADLINE_NS, int(job.deadline * 1e9))
            self._renew(job, now)
            self.cond.notify()

    def _renew(self, job, now):
        """Extend the lease (cond held)."""
        try:
            with self.rt.wq_mutex:
                job.msg.extend(self.rt.spec.handler.lease)
        except LeaseLost:
            job.lease_lost = True
            job.ctx.cancelled.set()
            self.rt.logger.error("lease lost while the handler ran: another worker may process "
                                 "this message; cancelling")
            raise
        finally:
            job.next_hb = now + self.hb_interval

    def run(self):
        _block_stop_signals()
        h = self.rt.spec.handler
        with self.cond:
            while True:
                job = self.job
                if job is None:
                    self.cond.wait()
                    continue
                now = time.monotonic()
                if job.deadline is not None and not job.timed_out and now >= job.deadline:
                    job.timed_out = True
                    job.kill_at = now + h.cancel_grace
                    job.ctx.cancelled.set()
                    self.rt.logger.warning("handler exceeded its timeout of %s s: cancelled "
                                           "(it has %s s to return)", h.timeout, h.cancel_grace)
                if job.kill_at is not None and now >= job.kill_at:
                    self.rt.abort_timed_out(job)  # does not return
                if now >= job.next_hb and not job.lease_lost:
                    try:
                        self._renew(job, now)
                    except LeaseLost:
                        pass
                    except Exception:
                        self.rt.logger.exception("lease renewal failed")
                wake = job.next_hb if not job.lease_lost else None
                if job.kill_at is not None:
                    wake = job.kill_at if wake is None else min(wake, job.kill_at)
                elif job.deadline is not None:
                    wake = job.deadline if wake is None else min(wake, job.deadline)
                self.cond.wait(None if wake is None else max(0.0, wake - time.monotonic()))


class _WorkerRuntime:
    """Everything a worker process holds."""

    def __init__(self, spec: _WorkerSpec, conn):
        self.spec = spec
        self.conn = conn
        self.stopping = False
        self.current = None
        self.wq = None
        self.wq_mutex = threading.Lock()
        self._ingress = None
        self._ingress_lock = threading.Lock()
        self.board = None
        self.instance = None
        self.logger = logging.getLogger("shmq.dispatch." + spec.handler.type)

    # -- setup --------------------------------------------------------------------

    def setup(self):
        spec = self.spec
        if spec.log_level is not None:
            logging.basicConfig(level=spec.log_level, format=LOG_FORMAT)
            for hd in logging.getLogger().handlers:
                hd.addFilter(_default_log_fields)
        if spec.initializer is not None:
            spec.initializer()
        self.logger.addFilter(_LogContext(self))
        self.board = _Board.open(spec.board_path, writable=True)
        self.base = self.board.base(spec.row)
        self.wq = _attach(spec.queue_path, spec.trusted)
        h = spec.handler
        if h.is_class and h.scope == "worker":
            self.instance = h.target()
        self.watchdog = _Watchdog(self)
        self.watchdog.start()
        w = self.board.w
        w[self.base + R_BUSY] = 0
        w[self.base + R_GRACE_NS] = int(h.cancel_grace * 1e9)
        w[self.base + R_HOLDER] = holder_word()

    def row_set(self, field, value):
        self.board.w[self.base + field] = value

    def row_add(self, field, n=1):
        w, i = self.board.w, self.base + field
        w[i] = w[i] + n

    def sample(self, seconds):
        w, b = self.board.w, self.base
        n = w[b + R_NSAMPLES]
        k = w[H_RESERVOIR]
        w[b + _ROW_HDR + n % k] = max(0, int(seconds * 1e9))
        w[b + R_NSAMPLES] = n + 1

    # -- stop requests ------------------------------------------------------------

    def on_sigterm(self, signum, frame):
        self.stopping = True

    def watch_parent(self):
        """The supervisor sends "stop", or dies (EOF): finish the current message, exit."""
        _block_stop_signals()
        try:
            while True:
                if self.conn.recv() == "stop":
                    break
        except (EOFError, OSError):
            pass
        self.stopping = True

    # -- publishing ---------------------------------------------------------------

    def publish(self, body, key, delay, headers):
        with self._ingress_lock:
            if self._ingress is None:
                self._ingress = _attach(self.spec.ingress_path, self.spec.trusted)
            return self._ingress.put(body, key=key, delay=delay, headers=headers)

    # -- the loop -----------------------------------------------------------------

    def serve(self):
        h = self.spec.handler
        while not self.stopping:
            try:
                msg = self.wq.get(timeout=IDLE_WAKE_S, lease=h.lease)
            except Empty:
                continue
            except Exception:
                # e.g. a body that cannot be unpickled here: WorkQueue keeps it
                # leased to us until the lease expires, then redelivers it
                self.logger.exception("could not take a message")
                continue
            self.handle(msg)

    def _retry_delay(self, attempt):
        try:
            return _delay_for(self.spec.handler, attempt)
        except Exception:
            self.logger.exception("retry_delay(%d) failed: retrying at once", attempt)
            return 0.0

    def invoke(self, ctx, body):
        h = self.spec.handler
        if not h.is_class:
            return h.target(ctx, body)
        inst = self.instance if h.scope == "worker" else h.target()
        try:
            fn = getattr(inst, "handle", None) or inst
            return fn(ctx, body)
        finally:
            if h.scope == "message" and hasattr(inst, "close"):
                inst.close()

    def handle(self, msg):
        h = self.spec.handler
        ctx = Context(self, msg)
        job = _Job(msg, ctx, h.timeout, self.watchdog.hb_interval)
        ctx._job = job
        w, b = self.board.w, self.base
        w[b + R_MSG] = msg.id
        w[b + R_SLOT] = msg._slot
        w[b + R_TOKEN] = msg.token
        w[b + R_ATTEMPT] = msg.attempt
        w[b + R_STARTED_NS] = int(job.started * 1e9)
        w[b + R_DEADLINE_NS] = 0 if job.deadline is None else int(job.deadline * 1e9)
        w[b + R_BUSY] = 1
        self.current = ctx
        self.watchdog.begin(job)
        err = fatal = None
        try:
            self.invoke(ctx, msg.body)
        except Exception as exc:
            err = exc
        except BaseException as exc:  # SystemExit, KeyboardInterrupt: settle, then exit
            err = fatal = exc
        finally:
            self.watchdog.end(job)
        elapsed = time.monotonic() - job.started
        delay = self._retry_delay(msg.attempt)
        try:
            with self.wq_mutex:
                if job.lease_lost:
                    self.row_add(R_LEASE_LOST)
                elif job.timed_out:
                    reason = (f"{h.type!r} handler exceeded its timeout of {h.timeout} s and was "
                              f"cancelled (attempt {msg.attempt})")
                    if err is not None:
                        reason += f"; it then raised {type(err).__name__}: {err}"
                    te = HandlerTimeout(reason)
                    te.__cause__ = err
                    msg.nack(delay=delay, error=te)
                    self.row_add(R_TIMED_OUT)
                elif err is not None:
                    msg.nack(delay=delay, error=err)
                    self.row_add(R_FAILED)
                    self.logger.warning("handler failed: %s: %s", type(err).__name__, err)
                else:
                    msg.ack()
                    self.row_add(R_PROCESSED)
        except LeaseLost:
            self.row_add(R_LEASE_LOST)
            self.logger.warning("lease lost before the message was settled: it will be (or "
                                "was) delivered again")
        self.sample(elapsed)
        w[b + R_BUSY] = 0
        self.current = None
        if fatal is not None:
            raise fatal

    def abort_timed_out(self, job):
        """Watchdog thread, cond held: the handler ignored its cancellation."""
        h = self.spec.handler
        try:
            with self.wq_mutex:
                job.msg.nack(delay=self._retry_delay(job.msg.attempt), error=HandlerTimeout(
                    f"{h.type!r} handler exceeded its timeout of {h.timeout} s and ignored the "
                    f"cancellation for {h.cancel_grace} s: worker {os.getpid()} terminated "
                    f"(attempt {job.msg.attempt})"))
        except LeaseLost:
            pass
        except Exception:
            self.logger.exception("could not nack the timed-out message")
        try:
            self.row_add(R_TIMED_OUT)
            self.sample(time.monotonic() - job.started)
            self.row_set(R_BUSY, 0)
            self.logger.error("handler ignored its cancellation for %s s: terminating worker %d",
                              h.cancel_grace, os.getpid())
            for hd in logging.getLogger().handlers:
                hd.flush()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(EXIT_TIMEOUT)

    def close(self):
        inst = self.instance
        if inst is not None and hasattr(inst, "close"):
            try:
                inst.close()
            except Exception:
                self.logger.exception("handler close() failed")
        if self.board is not None:
            try:
                self.row_set(R_BUSY, 0)
                self.row_set(R_HOLDER, 0)
            except Exception:
                pass
        with self._ingress_lock:
            if self._ingress is not None:
                self._ingress.close()
                self._ingress = None
        if self.wq is not None:
            self.wq.close()
            self.wq = None


def _worker_main(spec: _WorkerSpec, conn):
    """Entry point of a worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the supervisor orchestrates the stop
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # whatever mask we inherited
    rt = _WorkerRuntime(spec, conn)
    signal.signal(signal.SIGTERM, rt.on_sigterm)
    try:
        rt.setup()
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        sys.exit(EXIT_STARTUP)
    conn.send(("ready", os.getpid()))
    threading.Thread(target=rt.watch_parent, name="shmq-dispatch-parent", daemon=True).start()
    try:
        rt.serve()
    finally:
        rt.close()


# ---------------------------------------------------------------------------------------
# the supervisor (in the dispatcher's process)
# ---------------------------------------------------------------------------------------


class _Worker:
    __slots__ = ("type", "proc", "conn", "row", "ready", "retiring", "started", "pid",
                 "backstop_token")

    def __init__(self, type_, proc, conn, row):
        self.type = type_
        self.proc = proc
        self.conn = conn
        self.row = row
        self.ready = False
        self.retiring = False
        self.started = time.monotonic()
        self.pid = proc.pid
        self.backstop_token = None


class _HybridMethod:
    """``Dispatcher.metrics(path)`` on the class, ``dispatcher.metrics()`` on an instance."""

    def __init__(self, fn):
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj, cls):
        if obj is None:
            return lambda path, **kw: self.fn(path, **kw)
        return lambda **kw: self.fn(obj.path, **kw)


def _control_address(path):
    real = os.path.realpath(resolve_path(path))
    return "\0shmq-dispatch-" + hashlib.sha256(real.encode()).hexdigest()[:40]


class Dispatcher:
    """Runs registered handlers in worker processes, per message type.

    ``Dispatcher(work_queue_or_path)``: the ingress work queue (created with
    ``capacity``/``max_attempts``/... if a path names nothing yet).  Register
    handlers with :meth:`handler`, then :meth:`run` (blocking, stops on
    SIGINT/SIGTERM) or :meth:`start` / :meth:`stop`.  See docs/dispatcher.md.

    ``start_method``: "forkserver" (default: workers fork from a clean,
    single-threaded server that preloaded the handler modules, so starting
    and replacing workers is cheap) or "spawn".  "fork" is refused: the
    supervisor has threads.  Handlers must be importable (module-level).
    """

    def __init__(self, work_queue, *, start_method="forkserver", grace=10.0, capacity=None,
                 dead_capacity=None, max_attempts=5, leases=1024, keys=4096,
                 unknown_type_delay=0.0, initializer=None, log_level=None, max_workers=128,
                 reservoir=256, start_timeout=60.0):
        if start_method == "fork":
            raise ValueError("start_method='fork' is not supported: the dispatcher's supervisor "
                             "and router threads make fork unsafe; use 'forkserver' or 'spawn'")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', not {start_method!r}")
        if isinstance(work_queue, WorkQueue):
            self.path = work_queue.path
            opts = dict(work_queue._opts)
        else:
            self.path = resolve_path(work_queue)
            opts = {}
        if capacity is not None:
            opts["capacity"] = capacity
        if dead_capacity is not None:
            opts["dead_capacity"] = dead_capacity
        opts.setdefault("capacity", "64MiB")
        opts.setdefault("dead_capacity", "16MiB")
        opts.setdefault("max_attempts", max_attempts)
        opts.setdefault("leases", leases)
        opts.setdefault("keys", keys)
        opts.pop("liveness_interval", None)
        self._trusted = bool(opts.get("trusted", False))
        self._qopts = {k: opts[k] for k in ("capacity", "dead_capacity", "leases", "keys")}
        self._qopts["trusted"] = self._trusted
        if initializer is not None:
            _check_importable(initializer, "initializer")
        for name, v, lo in (("max_workers", max_workers, 1), ("reservoir", reservoir, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= 4096:
                raise ValueError(f"{name} must be an int in {lo}..4096")
        self.start_method = start_method
        self.grace = _positive("grace", grace) if grace else 0.0
        self.unknown_type_delay = float(unknown_type_delay or 0.0)
        self.initializer = initializer
        self.log_level = log_level
        self.max_workers = max_workers
        self.reservoir = reservoir
        self.start_timeout = start_timeout
        self.board_path = board_path(self.path)
        # the ingress queue exists from here on: publish() works before start()
        self._pub = _open_or_create(self.path, **opts)
        self._pub_lock = threading.Lock()
        self._specs: dict[str, _HandlerSpec] = {}
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._state = "new"
        self._targets: dict[str, int] = {}
        self._workers: list[_Worker] = []
        self._stop_grace = None
        self._stopping = False
        self._hurry = False
        self._thread = None
        self._router = None
        self._start_error = None
        self._started = threading.Event()
        self._finished = threading.Event()
        self._retired = 0

    # -- registration --------------------------------------------------------------

    def handler(self, type, *, parallelism=1, timeout=None, max_attempts=5, scope="message",
                lease=None, cancel_grace=5.0, retry_delay=0.0):
        """Decorator: register a function ``fn(ctx, body)`` or a class for ``type``.

        A class is a factory: ``scope="message"`` builds a fresh instance per
        message, ``scope="worker"`` one per worker process; the instance's
        ``handle(ctx, body)`` (or ``__call__``) runs, and its ``close()`` (if
        any) when the instance is discarded.  ``timeout`` (seconds, None: no
        limit) sets ``ctx.cancelled``; ``cancel_grace`` later the worker is
        terminated.  ``lease`` is renewed every ``lease / 3`` s while the
        handler runs (default: 30 s, or longer than ``timeout + cancel_grace``
        plus the supervisor's backstop margin, so that not even a handler
        holding the GIL loses its lease before it is stopped).
        ``retry_delay`` (seconds, or ``f(attempt) -> seconds``)
        delays the redelivery after a failure.  Returns the target unchanged.
        """
        def register(target):
            self.register(type, target, parallelism=parallelism, timeout=timeout,
                          max_attempts=max_attempts, scope=scope, lease=lease,
                          cancel_grace=cancel_grace, retry_delay=retry_delay)
            return target
        return register

    def register(self, type, target, *, parallelism=1, timeout=None, max_attempts=5,
                 scope="message", lease=None, cancel_grace=5.0, retry_delay=0.0):
        """Register ``target`` for ``type`` (the non-decorator form of :meth:`handler`)."""
        _check_type(type)
        if self._state != "new":
            raise RuntimeError("register handlers before start()")
        if type in self._specs:
            raise ValueError(f"a handler for {type!r} is already registered")
        if len(self._specs) >= _MAX_TYPES:
            raise ValueError(f"at most {_MAX_TYPES} message types per dispatcher")
        is_class = inspect.isclass(target)
        if not is_class and not callable(target):
            raise TypeError(f"handler must be a function or a class, not {builtins_type(target).__name__}")
        if scope not in ("message", "worker"):
            raise ValueError(f"scope must be 'message' or 'worker', not {scope!r}")
        if scope == "worker" and not is_class:
            raise ValueError("scope='worker' needs a class (a function has no instance to keep)")
        if isinstance(parallelism, bool) or not isinstance(parallelism, int) or parallelism < 0:
            raise ValueError("parallelism must be an int >= 0")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError("max_attempts must be an int >= 1")
        if not callable(retry_delay):
            if isinstance(retry_delay, bool) or not isinstance(retry_delay, (int, float)) \
                    or retry_delay < 0:
                raise ValueError("retry_delay must be seconds >= 0 or a callable(attempt)")
        else:
            _check_importable(retry_delay, "retry_delay")
        _check_importable(target, "handler")
        if cancel_grace is None or isinstance(cancel_grace, bool) or cancel_grace < 0:
            raise ValueError("cancel_grace must be seconds >= 0")
        timeout = _positive("timeout", timeout, allow_none=True)
        if lease is None:
            lease = 30.0
            if timeout is not None:
                lease = max(lease, timeout + cancel_grace + BACKSTOP_MARGIN_S
                            + SUPERVISOR_TICK_S + 5.0)
        spec = _HandlerSpec(type, target, is_class, scope, parallelism, timeout, max_attempts,
                            _positive("lease", lease), float(cancel_grace), retry_delay)
        self._specs[type] = spec
        return target

    @property
    def types(self):
        return list(self._specs)

    def queue_path(self, type):
        """The path of ``type``'s work queue (``PATH.<type>``)."""
        return f"{self.path}.{_check_type(type)}"

    def queue(self, type) -> WorkQueue:
        """A new handle on ``type``'s work queue (dead letters, stats); close it when done."""
        return _attach(self.queue_path(type), self._trusted)

    # -- producing -------------------------------------------------------------------

    def publish(self, type, body, key=None, delay=None, headers=None, correlation_id=None) -> int:
        """Enqueue a root message of ``type`` on the ingress queue; return its id.

        Its ``correlation_id`` is ``correlation_id`` if given, else this id.
        """
        if not isinstance(type, str):
            raise TypeError(f"message type must be a str, not {builtins_type(type).__name__}")
        h = dict(headers or {})
        h["type"] = type
        for k in ("message_id", "parent_id"):
            h.pop(k, None)
        if correlation_id is not None:
            h["correlation_id"] = correlation_id
        with self._pub_lock:
            if self._pub is None:
                raise ValueError("dispatcher is closed")
            return self._pub.put(body, key=key, delay=delay, headers=h)

    # -- lifecycle -------------------------------------------------------------------

    def start(self):
        """Create the per-type queues, start the workers and the router; return when
        every initial worker is ready.

        :raises shmq.ShmqError: another dispatcher runs on this path, or a
            worker could not start (the message includes its traceback).
        """
        with self._lock:
            if self._state != "new":
                raise RuntimeError("a Dispatcher starts once; create a new one to restart")
            if not self._specs:
                raise RuntimeError("no handlers registered")
            total = sum(s.parallelism for s in self._specs.values())
            if total > self.max_workers:
                raise ValueError(f"{total} workers in all exceeds max_workers={self.max_workers}")
            self._state = "starting"
        try:
            self._open_board()
            self._listen()
            self._ctx = mp.get_context(self.start_method)
            if self.start_method == "forkserver":
                mods = {"shmq.dispatch"} | {s.target.__module__ for s in self._specs.values()}
                if self.initializer is not None:
                    mods.add(self.initializer.__module__)
                self._ctx.set_forkserver_preload(sorted(m for m in mods if m))
            self._tq = {}  # the supervisor thread's handles, for nacks on behalf of dead workers
            for t, s in self._specs.items():
                self._tq[t] = _open_or_create(self.queue_path(t), max_attempts=s.max_attempts,
                                              **self._qopts)
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            self._done_r, self._done_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            self._targets = {t: s.parallelism for t, s in self._specs.items()}
            self._write_targets()
            self._thread = threading.Thread(target=self._supervise, name="shmq-dispatch-supervisor",
                                            daemon=True)
            self._thread.start()
            if not self._started.wait(self.start_timeout):
                raise ShmqError(f"workers did not become ready within {self.start_timeout} s")
            if self._start_error:
                raise ShmqError(f"a worker failed to start:\n{self._start_error}")
            self._router = threading.Thread(target=self._route, name="shmq-dispatch-router",
                                            daemon=True)
            self._router.start()
            self._board.w[H_STATE] = STATE_RUNNING
            with self._lock:
                self._state = "running"
            atexit.register(self._atexit)
        except BaseException:
            self.stop(grace=0)
            raise
        return self

    def stop(self, grace=None):
        """Stop: no new messages are taken; running handlers get ``grace`` seconds
        (default: the dispatcher's ``grace``) to finish, then their workers are
        killed and their messages nacked.  Idempotent; returns when every
        worker has exited."""
        with self._lock:
            if self._state in ("new", "stopped"):
                self._state = "stopped"
                return
            self._request_stop(grace)
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            g = self._stop_grace if self._stop_grace is not None else self.grace
            thread.join(g + 30.0)
            if thread.is_alive():
                _log.error("supervisor did not finish within %.1f s", g + 30.0)
        self._finish()

    def _request_stop(self, grace=None, hurry=False):
        """Called from signal handlers too: no locks (handlers can nest), only plain
        attribute stores and one byte written to the wake pipe.  The router and
        the supervisor look at ``_stopping``."""
        if grace is not None:
            self._stop_grace = 0.0 if hurry else float(grace)
        if hurry:
            self._hurry = True
        self._stopping = True
        self._wake()

    def _wake(self):
        try:
            os.write(self._wake_w, b"\0")
        except (OSError, AttributeError, TypeError):
            pass  # not started, or already finished

    def _finish(self):
        with self._lock:
            if self._state in ("stopped",):
                return
            self._state = "stopped"
        try:
            atexit.unregister(self._atexit)
        except Exception:
            pass
        router = self._router
        if router is not None:
            router.join(IDLE_WAKE_S * 4 + 2.0)
            if router.is_alive():
                _log.error("router thread still blocked (a full type queue?); it keeps its "
                           "ingress lease until this process exits")
        for q in getattr(self, "_tq", {}).values():
            q.close()
        self._tq = {}
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()
            self._sock = None
        board = getattr(self, "_board", None)
        if board is not None:
            board.w[H_STATE] = STATE_STOPPED
            board.w[H_STOPPED_NS] = time.time_ns()
            board.w[H_HOLDER] = 0
            board.close()
            self._board = None
        fd = getattr(self, "_board_fd", None)
        if fd is not None:
            os.close(fd)  # drops the flock
            self._board_fd = None
        for name in ("_wake_r", "_wake_w", "_done_r", "_done_w"):
            fd = getattr(self, name, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
            setattr(self, name, None)

    def close(self):
        """Stop (if running) and close the ingress handle."""
        self.stop()
        with self._pub_lock:
            if self._pub is not None:
                self._pub.close()
                self._pub = None

    def _atexit(self):
        self.stop()

    def __enter__(self):
        if self._state == "new":
            self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def run(self, grace=None):
        """Start, then block until SIGINT/SIGTERM (or a remote ``stop``), then stop.

        The first signal lets running handlers finish for ``grace`` seconds
        (default: the dispatcher's); a second one kills them at once.
        Signal handlers are installed only when called from the main thread.
        """
        installed = {}
        sig_r = sig_w = old_wakeup = None
        if threading.current_thread() is threading.main_thread():
            # A signal may be delivered to any thread; Python runs the handler in the
            # main thread once it wakes, so the main thread sleeps on the wakeup fd.
            sig_r, sig_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            old_wakeup = signal.set_wakeup_fd(sig_w, warn_on_full_buffer=False)

            def on_signal(signum, frame):
                self._request_stop(grace, hurry=self._stopping)
            for sig in (signal.SIGINT, signal.SIGTERM):
                installed[sig] = signal.signal(sig, on_signal)
        try:
            if self._state == "new":
                self.start()
            while not self._finished.is_set():
                if sig_r is None:
                    self._finished.wait()
                    break
                for fd in mpc.wait([sig_r, self._done_r]):
                    if fd == sig_r:
                        _drain(sig_r)
        finally:
            self.stop(grace)
            for sig, old in installed.items():
                signal.signal(sig, old)
            if sig_r is not None:
                signal.set_wakeup_fd(old_wakeup)
                os.close(sig_r)
                os.close(sig_w)

    # -- scaling ----------------------------------------------------------------------

    def scale(self, type, n, wait=None):
        """Run ``n`` workers for ``type`` from now on (0 pauses the type).

        Scaling down asks idle workers first; a busy worker finishes its
        current message before it exits, so nothing is dropped.  With
        ``wait`` (seconds), block until exactly ``n`` workers run and are
        ready; returns whether that happened in time.
        """
        self._set_target(type, n)
        if wait is not None:
            return self.wait_ready(type, timeout=wait)
        return True

    def _set_target(self, type, n):
        if type not in self._specs:
            raise ValueError(f"no handler registered for {type!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError("the number of workers must be an int >= 0")
        with self._lock:
            total = sum(v for t, v in self._targets.items() if t != type) + n
            if total > self.max_workers:
                raise ValueError(f"{total} workers in all exceeds max_workers={self.max_workers}")
            old = self._targets.get(type, 0)
            self._targets[type] = n
            if self._state in ("starting", "running"):
                self._write_targets()
            self._cv.notify_all()
        self._wake()
        return old

    def wait_ready(self, type=None, timeout=None) -> bool:
        """Block until ``type`` (or every type) runs exactly its target number of
        ready workers, none of them retiring; return False on timeout."""
        types = [type] if type is not None else list(self._specs)
        deadline = None if timeout is None else time.monotonic() + timeout

        def settled():
            for t in types:
                ws = [w for w in self._workers if w.type == t]
                if len(ws) != self._targets.get(t, 0) or not all(w.ready and not w.retiring
                                                                  for w in ws):
                    return False
            return True

        with self._cv:
            while not settled():
                if self._stopping:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def workers(self) -> dict:
        """``{type: [pid, ...]}`` of the live worker processes (retiring ones included)."""
        with self._lock:
            out = {t: [] for t in self._specs}
            for w in self._workers:
                out[w.type].append(w.pid)
            return out

    # -- metrics ------------------------------------------------------------------------

    def _metrics(path, queues=True):
        """Per-type metrics: ``{type: {...}}`` (see docs/dispatcher.md, "Metrics").

        ``Dispatcher.metrics(path)`` from any process, ``dispatcher.metrics()``
        on an instance.  ``queues=False`` skips the queue depths (cheaper).
        """
        return status(path, queues=queues)["types"]

    metrics = _HybridMethod(_metrics)
    del _metrics

    def status(self, queues=True) -> dict:
        """The board of this dispatcher, as :func:`shmq.dispatch.status` returns it."""
        return status(self.path, queues=queues)

    @staticmethod
    def destroy(path, types=()) -> None:
        """Remove a stopped dispatcher's files: the ingress queue, the type queues it
        recorded (and ``types``), their dead-letter spools and ``PATH.dispatch``.

        :raises shmq.ShmqError: a dispatcher is running on ``path``.
        """
        path = resolve_path(path)
        bp = board_path(path)
        queues = {f"{path}.{_check_type(t)}" for t in types}
        try:
            fd = os.open(bp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None
        if fd is not None:
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise ShmqError(f"a dispatcher is running on {path}; stop it first") from None
                try:
                    b = _Board.open(bp)
                    try:
                        queues |= {q for q in b.config().get("queues", [])
                                   if isinstance(q, str) and q.startswith(path + ".")
                                   and "/" not in q[len(path):]}
                    finally:
                        b.close()
                except (ShmqError, ValueError):
                    pass
                os.unlink(bp)
            finally:
                os.close(fd)
        for q in sorted(queues) + [path]:
            try:
                WorkQueue.destroy(q)
            except FileNotFoundError:
                pass

    # -- supervisor internals ------------------------------------------------------------

    def _open_board(self):
        bp = self.board_path
        fd = os.open(bp, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if not _stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise ShmqError(f"{bp}: not a regular file owned by this user")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = None
                try:
                    b = _Board.open(bp)
                    pid = holder_pid(b.w[H_HOLDER])
                    b.close()
                except Exception:
                    pass
                raise ShmqError(f"a dispatcher (pid {pid}) is already running on {self.path}; "
                                "one dispatcher per queue") from None
            old_queues = []
            if st.st_size >= _HDR_BYTES:
                try:
                    b = _Board.open(bp)
                    old_queues = [q for q in b.config().get("queues", []) if os.path.exists(q)]
                    b.close()
                except Exception:
                    pass
            rows = self.max_workers
            size = _HDR_BYTES + rows * _row_words(self.reservoir) * 8
            if st.st_size < size:
                os.ftruncate(fd, size)  # grows only: a reader mapping the old size stays valid
            size = max(size, st.st_size)
            board = _Board(fd, size, True)
        except BaseException:
            os.close(fd)
            raise
        self._board_fd = fd
        self._board = board
        w = board.w
        w[H_STATE] = STATE_STARTING
        board.mm[8 * (H_STATE + 1):] = bytes(size - 8 * (H_STATE + 1))
        w[H_NROWS] = rows
        w[H_RESERVOIR] = self.reservoir
        w[H_NTYPES] = len(self._specs)
        w[H_STARTED_NS] = time.time_ns()
        queues = sorted(set(old_queues) | {self.queue_path(t) for t in self._specs})
        cfg = {"path": self.path, "pid": os.getpid(), "start_method": self.start_method,
               "queues": queues,
               "types": [{"type": s.type, "handler": _qualname(s.target), "scope": s.scope,
                          "parallelism": s.parallelism, "timeout": s.timeout,
                          "max_attempts": s.max_attempts, "lease": s.lease,
                          "cancel_grace": s.cancel_grace} for s in self._specs.values()]}
        raw = json.dumps(cfg).encode()
        if len(raw) > _HDR_BYTES - _JSON_OFF:
            while len(raw) > _HDR_BYTES - _JSON_OFF and cfg["queues"]:
                cfg["queues"] = cfg["queues"][1:]
                raw = json.dumps(cfg).encode()
            if len(raw) > _HDR_BYTES - _JSON_OFF:
                raise ValueError("too many or too long handler names for the dispatcher board")
        board.mm[_JSON_OFF:_JSON_OFF + len(raw)] = raw
        w[H_JSON_LEN] = len(raw)
        w[H_HOLDER] = holder_word()
        w[H_VERSION] = _VERSION
        w[H_MAGIC] = _MAGIC
        self._type_index = {t: i for i, t in enumerate(self._specs)}
        self._rows_free = list(range(rows - 1, -1, -1))
        self._rows_idle = {t: [] for t in self._specs}

    def _write_targets(self):
        w = self._board.w
        for t, i in self._type_index.items():
            w[H_TARGET + i] = self._targets.get(t, 0)

    def _write_live(self):
        counts = {t: 0 for t in self._specs}
        for wk in self._workers:
            counts[wk.type] += 1
        w = self._board.w
        for t, i in self._type_index.items():
            w[H_LIVE + i] = counts[t]

    def _listen(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.bind(_control_address(self.path))
        except OSError as exc:
            s.close()
            if exc.errno == errno.EADDRINUSE:
                raise ShmqError(f"another process is listening for dispatcher commands on "
                                f"{self.path}") from None
            raise
        s.listen(8)
        s.setblocking(False)
        self._sock = s

    def _alloc_row(self, type_):
        idle = self._rows_idle[type_]
        if idle:
            return idle.pop()
        if self._rows_free:
            row = self._rows_free.pop()
            self._board.w[self._board.base(row) + R_TYPE] = self._type_index[type_] + 1
            return row
        return None

    def _spawn(self, type_):
        row = self._alloc_row(type_)
        if row is None:
            _log.error("no free worker row for %r (max_workers=%d)", type_, self.max_workers)
            return None
        spec = _WorkerSpec(self._specs[type_], self.queue_path(type_), self.path, self.board_path,
                           row, self.initializer, self.log_level, self._trusted)
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(spec, child),
                                 name=f"shmq-dispatch[{type_}#{row}]", daemon=False)
        try:
            proc.start()
        except BaseException:
            self._rows_idle[type_].append(row)
            parent.close()
            child.close()
            raise
        child.close()
        w = _Worker(type_, proc, parent, row)
        with self._lock:
            self._workers.append(w)
        return w

    def _retire(self, w):
        w.retiring = True
        try:
            w.conn.send("stop")
        except (OSError, ValueError, AttributeError):
            try:
                os.kill(w.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _reconcile(self):
        if self._stopping:
            return
        with self._lock:
            targets = dict(self._targets)
        now = time.monotonic()
        for t, target in targets.items():
            ws = [w for w in self._workers if w.type == t and not w.retiring]
            if len(ws) < target:
                if now < self._backoff_until.get(t, 0.0):
                    continue
                for _ in range(target - len(ws)):
                    try:
                        if self._spawn(t) is None:
                            break
                    except Exception:
                        if not self._started.is_set():
                            raise
                        _log.exception("could not start a worker for %r; retrying later", t)
                        self._backoff_until[t] = time.monotonic() + 1.0
                        break
            elif len(ws) > target:
                w_ = self._board.w
                # idle ones first (they stop at once), newest first
                ws.sort(key=lambda w: (w_[self._board.base(w.row) + R_BUSY], -w.started))
                for w in ws[:len(ws) - target]:
                    self._retire(w)
        self._write_live()

    def _on_exit(self, w):
        """A worker process ended: settle its message, free its row, maybe replace it."""
        w.proc.join(5)
        code = w.proc.exitcode
        if w.conn is not None:
            try:
                w.conn.close()
            except OSError:
                pass
            w.conn = None
        b, base = self._board.w, self._board.base(w.row)
        h = self._specs[w.type]
        if b[base + R_BUSY] and b[base + R_HOLDER]:
            msg = Message(self._tq[w.type], b[base + R_SLOT], None, b[base + R_MSG],
                          b[base + R_ATTEMPT], None, {}, 0.0, b[base + R_TOKEN], 0.0)
            if w.backstop_token is not None and w.backstop_token == msg.token:
                err = HandlerTimeout(
                    f"{w.type!r} handler exceeded its timeout of {h.timeout} s and its worker "
                    f"{w.pid} could not cancel it (GIL held?): killed by the supervisor "
                    f"(attempt {msg.attempt})")
                b[base + R_TIMED_OUT] += 1
            elif self._stopping and code == -signal.SIGKILL:
                err = WorkerDied(f"dispatcher stopping: the {w.type!r} handler did not finish "
                                 f"within the grace period; worker {w.pid} killed "
                                 f"(attempt {msg.attempt})")
                b[base + R_CRASHED] += 1
            else:
                how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                err = WorkerDied(f"worker {w.pid} for {w.type!r} died ({how}) while handling "
                                 f"message {msg.id} (attempt {msg.attempt})")
                b[base + R_CRASHED] += 1
            try:
                delay = _delay_for(h, msg.attempt)
            except Exception:
                delay = 0.0
            try:
                msg.nack(delay=delay, error=err)
                _log.warning("%s; message nacked", err)
            except LeaseLost:
                pass  # settled before it died, or already redelivered by the work queue
            except Exception:
                _log.exception("could not nack the message of dead worker %d", w.pid)
        b[base + R_BUSY] = 0
        b[base + R_HOLDER] = 0
        self._rows_idle[w.type].append(w.row)
        with self._lock:
            self._workers.remove(w)
            self._cv.notify_all()
        if not w.ready:  # died while starting: back off before the next attempt
            n = self._failures.get(w.type, 0) + 1
            self._failures[w.type] = n
            self._backoff_until[w.type] = time.monotonic() + min(10.0, 0.2 * 2 ** (n - 1))
            if not self._started.is_set():
                self._start_error = self._start_error or (
                    f"worker for {w.type!r} exited with code {code} before it was ready")
                self._started.set()
        else:
            self._failures.pop(w.type, None)
        if w.retiring and code == EXIT_OK:
            self._retired += 1
        elif code not in (EXIT_OK, EXIT_TIMEOUT) and not self._stopping:
            _log.warning("worker %d for %r exited with %s; replacing it", w.pid, w.type,
                         f"signal {-code}" if code is not None and code < 0 else f"code {code}")

    def _on_event(self, w):
        try:
            ev = w.conn.recv()
        except (EOFError, OSError):
            try:
                w.conn.close()
            except OSError:
                pass
            w.conn = None
            return
        if ev[0] == "ready":
            with self._lock:
                w.ready = True
                self._cv.notify_all()
            if not self._started.is_set() and all(x.ready for x in self._workers):
                self._started.set()
        elif ev[0] == "error":
            _log.error("worker %d for %r failed to start:\n%s", w.pid, w.type, ev[1])
            if not self._started.is_set():
                self._start_error = ev[1]
                self._started.set()

    def _backstop(self):
        """Kill workers whose handler is far past timeout + grace; return the next check time."""
        b = self._board.w
        now = time.monotonic_ns()
        nxt = None
        for w in self._workers:
            base = self._board.base(w.row)
            dl = b[base + R_DEADLINE_NS]
            if not b[base + R_BUSY] or not dl or w.backstop_token is not None:
                continue
            at = dl + b[base + R_GRACE_NS] + int(BACKSTOP_MARGIN_S * 1e9)
            if now >= at:
                w.backstop_token = b[base + R_TOKEN]
                _log.error("worker %d for %r is %.1f s past its handler timeout: killing it",
                           w.pid, w.type, (now - dl) / 1e9)
                try:
                    os.kill(w.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            else:
                nxt = at if nxt is None else min(nxt, at)
        return None if nxt is None else (nxt - now) / 1e9

    def _on_control(self):
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        with conn:
            try:
                conn.settimeout(2.0)
                cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                _pid, uid, _gid = struct.unpack("3i", cred)
                if uid not in (os.geteuid(), 0):
                    conn.sendall(b'{"ok": false, "error": "permission denied"}\n')
                    return
                data = b""
                while not data.endswith(b"\n") and len(data) < 65536:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                req = json.loads(data or b"{}")
                reply = self._command(req)
            except Exception as exc:
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                pass

    def _command(self, req):
        op = req.get("op")
        if op == "scale":
            old = self._set_target(req.get("type"), req.get("n"))
            return {"ok": True, "type": req["type"], "previous": old, "target": req["n"]}
        if op == "stop":
            g = req.get("grace")
            self._request_stop(None if g is None else float(g))
            return {"ok": True}
        if op == "ping":
            return {"ok": True, "pid": os.getpid()}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _supervise(self):
        self._failures = {}
        self._backoff_until = {}
        try:
            self._reconcile()
            if not self._workers:
                self._started.set()
            self._loop()
        except BaseException as exc:
            _log.exception("dispatcher supervisor failed")
            if not self._started.is_set():
                self._start_error = "".join(traceback.format_exception(exc))
                self._started.set()
            self._stopping = True
        finally:
            try:
                self._shutdown()
            finally:
                self._finished.set()
                try:
                    os.write(self._done_w, b"\0")
                except OSError:
                    pass

    def _loop(self):
        has_timeouts = any(s.timeout is not None for s in self._specs.values())
        while not self._stopping:
            timeout = None
            if has_timeouts and self._workers:
                nxt = self._backstop()
                timeout = SUPERVISOR_TICK_S if nxt is None else min(SUPERVISOR_TICK_S, nxt)
            pending = [t for t, until in self._backoff_until.items() if until > time.monotonic()]
            if pending:
                left = min(self._backoff_until[t] for t in pending) - time.monotonic()
                timeout = left if timeout is None else min(timeout, left)
            self._wait_and_handle(timeout, accept=True)
            self._reconcile()

    def _wait_and_handle(self, timeout, accept):
        objs = {self._wake_r: ("wake", None)}
        if accept and self._sock is not None:
            objs[self._sock] = ("control", None)
        for w in self._workers:
            objs[w.proc.sentinel] = ("exit", w)
            if w.conn is not None:
                objs[w.conn] = ("event", w)
        ready = mpc.wait(list(objs), timeout=None if timeout is None else max(0.0, timeout))
        exits = []
        for o in ready:
            kind, w = objs[o]
            if kind == "wake":
                _drain(self._wake_r)
            elif kind == "control":
                self._on_control()
            elif kind == "event":
                if w.conn is not None:
                    self._on_event(w)
            else:
                exits.append(w)
        for w in exits:
            # drain its last events (a startup error arrives just before the exit)
            while w.conn is not None and w.conn.poll(0):
                self._on_event(w)
            self._on_exit(w)

    def _shutdown(self):
        if self._board is None:
            return
        self._board.w[H_STATE] = STATE_STOPPING
        self._stopping = True
        with self._lock:
            self._cv.notify_all()
        for w in list(self._workers):
            self._retire(w)
        grace = self._stop_grace if self._stop_grace is not None else self.grace
        deadline = time.monotonic() + grace
        while self._workers:
            left = 0.0 if self._hurry else deadline - time.monotonic()
            if left <= 0:
                break
            self._wait_and_handle(left, accept=False)
        for w in list(self._workers):
            try:
                os.kill(w.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for w in list(self._workers):
            w.proc.join(10)
            self._on_exit(w)
        self._write_live()

    # -- the router -------------------------------------------------------------------------

    def _route(self):
        ingress = _attach(self.path, self._trusted)
        tqs = {t: _attach(self.queue_path(t), self._trusted) for t in self._specs}
        warned = set()
        w = self._board.w
        try:
            while not self._stopping:
                try:
                    msg = ingress.get(timeout=IDLE_WAKE_S, lease=ROUTER_LEASE_S)
                except Empty:
                    continue
                except Exception:
                    _log.exception("router: could not take an ingress message (it comes back "
                                   "after %s s)", ROUTER_LEASE_S)
                    continue
                t = msg.headers.get("type")
                spec = self._specs.get(t) if isinstance(t, str) else None
                try:
                    if spec is None:
                        wkey = t if isinstance(t, str) else repr(t)
                        if wkey not in warned and len(warned) < 1000:
                            warned.add(wkey)
                            _log.warning("no handler for message type %r: nacked until the "
                                         "ingress queue dead-letters it", t)
                        what = ("has no 'type' header" if t is None
                                else f"has type {t!r}, which has no registered handler")
                        msg.nack(delay=self.unknown_type_delay,
                                 error=NoHandler(f"message {msg.id} {what} (registered: "
                                                 f"{sorted(self._specs)})"))
                        w[H_UNROUTABLE] += 1
                        continue
                    headers = dict(msg.headers)
                    headers["message_id"] = msg.id
                    headers.setdefault("correlation_id", msg.id)
                    try:
                        tqs[t].put(msg.body, key=msg.key, headers=headers,
                                   max_attempts=spec.max_attempts)
                    except Exception as exc:
                        _log.error("router: could not forward message %d to %r: %s", msg.id, t, exc)
                        msg.nack(delay=1.0, error=exc)
                        continue
                    msg.ack()
                    w[H_ROUTED] += 1
                except LeaseLost:
                    _log.warning("router: lease of ingress message %d lost (it is delivered "
                                 "again: a duplicate may reach %r)", msg.id, t)
        finally:
            ingress.close()
            for q in tqs.values():
                q.close()


# ---------------------------------------------------------------------------------------
# reading the board; remote control; the CLI
# ---------------------------------------------------------------------------------------


def status(path, queues=True) -> dict:
    """The state of the dispatcher on ``path``, from any process.

    Returns ``{"path", "state", "pid", "alive", "started_at", "stopped_at",
    "routed", "unroutable", "types": {type: metrics}}``; each type's metrics
    are ``workers``, ``target``, ``processed``, ``failed``, ``timed_out``,
    ``crashed``, ``lease_lost``, ``in_progress``, ``latency`` (``count``,
    ``p50``, ``p90``, ``p99`` in seconds, over the most recent ``reservoir``
    runs of each worker slot) and, with ``queues``, ``queue`` (``ready``,
    ``in_flight``, ``delayed``, ``dead``, ``redeliveries``).

    :raises FileNotFoundError: no dispatcher ever ran on ``path``.
    """
    path = resolve_path(path)
    b = _Board.open(board_path(path))
    try:
        w = b.w
        state = w[H_STATE]
        holder = w[H_HOLDER]
        out = {"path": path, "state": _STATE_NAMES.get(state, str(state)),
               "pid": holder_pid(holder) or None, "alive": bool(holder) and holder_alive(holder),
               "started_at": w[H_STARTED_NS] / 1e9 or None, "stopped_at": w[H_STOPPED_NS] / 1e9 or None,
               "routed": w[H_ROUTED], "unroutable": w[H_UNROUTABLE], "types": {}}
        if state != STATE_STOPPED and not out["alive"]:
            out["state"] = "dead"
        if state == STATE_STARTING:
            return out
        cfg = b.config()
        types = [t["type"] for t in cfg.get("types", [])]
        nrows, k = w[H_NROWS], w[H_RESERVOIR]
        rw = _row_words(k)
        if _HDR_BYTES + nrows * rw * 8 > b.size:
            raise ShmqError(f"{path}.dispatch is truncated")
        acc = {t: {"workers": w[H_LIVE + i], "target": w[H_TARGET + i], "processed": 0,
                   "failed": 0, "timed_out": 0, "crashed": 0, "lease_lost": 0, "in_progress": 0,
                   "_samples": []} for i, t in enumerate(types)}
        for r in range(nrows):
            base = _HDR_BYTES // 8 + r * rw
            ti = w[base + R_TYPE]
            if not ti or ti > len(types):
                continue
            a = acc[types[ti - 1]]
            for key, f in (("processed", R_PROCESSED), ("failed", R_FAILED),
                           ("timed_out", R_TIMED_OUT), ("crashed", R_CRASHED),
                           ("lease_lost", R_LEASE_LOST)):
                a[key] += w[base + f]
            if w[base + R_BUSY] and w[base + R_HOLDER]:
                a["in_progress"] += 1
            n = min(w[base + R_NSAMPLES], k)
            a["_samples"].extend(w[base + _ROW_HDR:base + _ROW_HDR + n].tolist())
    finally:
        b.close()
    for t, a in acc.items():
        s = sorted(x / 1e9 for x in a.pop("_samples"))
        a["latency"] = {"count": len(s), "p50": _percentile(s, 0.50), "p90": _percentile(s, 0.90),
                        "p99": _percentile(s, 0.99)}
        if queues:
            try:
                with _attach(f"{path}.{t}") as q:
                    st = q.stats()
                a["queue"] = {"ready": st.ready, "in_flight": st.in_flight, "delayed": st.delayed,
                              "dead": st.dead, "redeliveries": st.redeliveries}
            except (FileNotFoundError, ShmqError):
                a["queue"] = None
    out["types"] = acc
    return out


metrics = Dispatcher.metrics


def _request(path, req, timeout=5.0):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout)
        try:
            s.connect(_control_address(path))
        except (ConnectionRefusedError, FileNotFoundError):
            raise ShmqError(f"no dispatcher is running on {resolve_path(path)}") from None
        s.sendall(json.dumps(req).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    finally:
        s.close()
    if not data:
        raise ShmqError("the dispatcher closed the connection without replying")
    reply = json.loads(data)
    if not reply.get("ok"):
        raise ShmqError(f"dispatcher refused: {reply.get('error')}")
    return reply


def scale(path, type, n, timeout=5.0) -> dict:
    """Ask the dispatcher running on ``path`` to run ``n`` workers for ``type``.

    :raises shmq.ShmqError: no dispatcher is running there, or it refused.
    """
    return _request(path, {"op": "scale", "type": type, "n": n}, timeout)


def stop(path, grace=None, timeout=5.0) -> dict:
    """Ask the dispatcher running on ``path`` to stop (as SIGTERM would)."""
    return _request(path, {"op": "stop", "grace": grace}, timeout)


def _fmt_s(v):
    if v is None:
        return "-"
    return f"{v * 1e3:.1f}ms" if v < 1 else f"{v:.2f}s"


def format_status(st) -> str:
    """A human-readable table of :func:`status`."""
    lines = [f"dispatcher on {st['path']}: {st['state']}"
             + (f" (pid {st['pid']})" if st.get("pid") else "")
             + f", routed {st['routed']}, unroutable {st['unroutable']}"]
    cols = ("type", "workers", "processed", "failed", "timed_out", "crashed", "busy",
            "p50", "p90", "p99", "ready", "in_flight", "delayed", "dead")
    rows = [cols]
    for t, m in st["types"].items():
        q = m.get("queue") or {}
        lat = m["latency"]
        rows.append((t, f"{m['workers']}/{m['target']}", str(m["processed"]), str(m["failed"]),
                     str(m["timed_out"]), str(m["crashed"]), str(m["in_progress"]),
                     _fmt_s(lat["p50"]), _fmt_s(lat["p90"]), _fmt_s(lat["p99"]),
                     *(str(q.get(k, "-")) for k in ("ready", "in_flight", "delayed", "dead"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    for r in rows:
        lines.append("  ".join(v.ljust(widths[i]) if i == 0 else v.rjust(widths[i])
                               for i, v in enumerate(r)))
    return "\n".join(lines)


def main(argv=None, prog="python -m shmq.dispatch") -> int:
    """``python -m shmq.dispatch {scale PATH TYPE N | status PATH [--json] | stop PATH}``
    (``shmq dispatch ...`` passes its own ``prog``)."""
    p = argparse.ArgumentParser(prog=prog,
                                description="Control and inspect a running shmq Dispatcher.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("scale", help="set the number of workers of a message type")
    sp.add_argument("path")
    sp.add_argument("type")
    sp.add_argument("n", type=int)
    sp.add_argument("--timeout", type=float, default=5.0)
    st = sub.add_parser("status", help="workers, counters, latencies and queue depths per type")
    st.add_argument("path")
    st.add_argument("--json", action="store_true")
    st.add_argument("--no-queues", action="store_true", help="skip queue depths")
    so = sub.add_parser("stop", help="stop the dispatcher (running handlers get the grace period)")
    so.add_argument("path")
    so.add_argument("--grace", type=float, default=None)
    so.add_argument("--timeout", type=float, default=5.0)
    args = p.parse_args(argv)
    try:
        if args.cmd == "scale":
            r = scale(args.path, args.type, args.n, timeout=args.timeout)
            print(f"{args.type}: {r['previous']} -> {r['target']} workers")
        elif args.cmd == "stop":
            stop(args.path, grace=args.grace, timeout=args.timeout)
            print("stopping")
        else:
            s = status(args.path, queues=not args.no_queues)
            print(json.dumps(s, indent=2) if args.json else format_status(s))
    except FileNotFoundError:
        print(f"error: no dispatcher has run on {resolve_path(args.path)}", file=sys.stderr)
        return 1
    except (ShmqError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
