"""The worker side: one process per worker slot, running one type's handler.

A worker leases messages from its type's work queue ``PATH.<type>`` itself
(the lease is held by the process that runs the handler) and settles them:
ack on return, nack (with the retry delay) on an exception or a timeout.
Its watchdog thread renews the lease, sets ``ctx.cancelled`` at the timeout
and terminates the process if the handler ignores the cancellation.  The
worker publishes its counters and the message in progress on its row of the
board, so the supervisor can release that message if the process dies.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from ..errors import Empty, LeaseLost
from ..workers import holdings as _holdings
from ..workers.board import Board
from .board import (
    LAYOUT, R_DEADLINE_NS, R_FAILED, R_GRACE_NS, R_LEASE_LOST, R_PROCESSED, R_TIMED_OUT, sample,
)
from .registry import (
    EXIT_STARTUP, EXIT_TIMEOUT, IDLE_WAKE_S, HandlerTimeout, WorkerSpec, attach, builtins_type,
    delay_for, positive,
)

if TYPE_CHECKING:
    from ..workqueue import Message

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}

LOG_FORMAT = ("%(asctime)s %(levelname)s %(processName)s %(name)s "
              "[%(msg_type)s id=%(message_id)s corr=%(correlation_id)s try=%(attempt)s] %(message)s")


def block_stop_signals() -> None:
    """In a helper thread of a worker: leave SIGINT/SIGTERM to the main thread."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def default_log_fields(record: logging.LogRecord) -> bool:
    """A logging filter: give records the message fields ``LOG_FORMAT`` needs."""
    for k in ("msg_type", "message_id", "correlation_id", "attempt"):
        if not hasattr(record, k):
            setattr(record, k, "-")
    return True


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
            default_log_fields(record)
        return True


class Context:
    """What a handler gets besides the body: identity, cancellation, publishing.

    * ``type``, ``body``, ``headers``, ``attempt`` (1 on first delivery);
    * ``message``: the :class:`shmq.Message` leased from the type's queue
      (ack/nack are the dispatcher's job: do not call them);
    * ``message_id``: the id the producer got back from ``publish``/``put``
      (unique per dispatcher: ids of messages published straight into a
      type's queue carry the type's number in their high bits);
      ``correlation_id``: shared by every message of a chain (a root
      message's own ``message_id`` unless the producer set the header);
      ``parent_id``: the ``message_id`` of the message whose handler
      published this one (None for roots);
    * ``cancelled``: a :class:`threading.Event` set when the timeout expires
      (or the lease was lost): return (or raise) soon after it is set;
    * ``logger``: a :class:`logging.Logger` whose records carry ``msg_type``,
      ``message_id``, ``correlation_id`` and ``attempt`` attributes.
    """

    __slots__ = ("_rt", "_job", "type", "message", "body", "headers", "attempt", "message_id",
                 "correlation_id", "parent_id", "cancelled", "logger")
    type: str
    message: Message
    body: Any
    headers: dict[str, Any]
    attempt: int
    message_id: int
    correlation_id: int
    parent_id: int | None
    cancelled: threading.Event
    logger: logging.Logger

    def __init__(self, rt: _WorkerRuntime, msg: Message) -> None:
        self._rt = rt
        self._job = None
        self.type = rt.spec.handler.type
        self.message = msg
        self.body = msg.body
        self.headers = msg.headers
        self.attempt = msg.attempt
        self.message_id = msg.headers.get("message_id", rt.id_base | msg.id)
        self.correlation_id = msg.headers.get("correlation_id", self.message_id)
        self.parent_id = msg.headers.get("parent_id")
        self.cancelled = threading.Event()
        self.logger = rt.logger

    def publish(self, type: str, body: Any, key: str | bytes | None = None, delay: float | None = None,
                headers: dict[str, Any] | None = None) -> int:
        """Enqueue a follow-up message of ``type`` in the same chain; return its id.

        It carries this message's ``correlation_id`` and has ``parent_id`` set
        to this message's ``message_id``.  A registered type goes straight
        into its queue; any other is routed through the ingress queue and,
        with no handler for it, ends up dead-lettered (NoHandler).

        :raises TypeError: ``type`` is not a str (see ``WorkQueue.put`` for the rest).
        """
        if not isinstance(type, str):
            raise TypeError(f"message type must be a str, not {builtins_type(type).__name__}")
        h = dict(headers or {})
        h["type"] = type
        h["correlation_id"] = self.correlation_id
        h["parent_id"] = self.message_id
        h.pop("message_id", None)
        return self._rt.publish(type, body, key, delay, h)

    def heartbeat(self, extend: float | None = None) -> None:
        """Renew the lease now; with ``extend`` (seconds), also push the timeout
        to at least ``extend`` seconds from now (progress reported by a
        long-running operation).  A cancellation already signalled stays.

        Useful when the handler holds the GIL for long stretches (the
        automatic renewal runs in a thread) or tracks an external operation.

        :raises shmq.LeaseLost: the lease was re-granted to another worker.
        :raises RuntimeError: called outside the handler.
        """
        self._rt.watchdog.heartbeat(self._job, extend)

    def time_left(self) -> float | None:
        """Seconds until the timeout (negative once past it), or None without a timeout."""
        job = self._job
        if job is None or job.deadline is None:
            return None
        return job.deadline - time.monotonic()

    def __repr__(self) -> str:
        return (f"<shmq.dispatch.Context type={self.type!r} message_id={self.message_id} "
                f"correlation_id={self.correlation_id!r} attempt={self.attempt}>")


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
                extend = positive("extend", extend)
                if job.deadline is not None and not job.timed_out:
                    job.deadline = max(job.deadline, now + extend)
                    self.rt.row_set(R_DEADLINE_NS, int(job.deadline * 1e9))
            self.renew(job, now)
            self.cond.notify()

    def renew(self, job, now):
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
        block_stop_signals()
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
                        self.renew(job, now)
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

    def __init__(self, spec: WorkerSpec, conn):
        self.spec = spec
        self.conn = conn
        self.stopping = False
        self.current = None
        self.wq = None
        self.wq_mutex = threading.Lock()
        self.outq: dict[str, Any] = {}  # path -> WorkQueue handle for ctx.publish
        self.out_lock = threading.Lock()
        self.board = None
        self.instance = None
        self.id_base = spec.direct.get(spec.handler.type, (0, 0))[1]
        self.logger = logging.getLogger("shmq.dispatch." + spec.handler.type)

    # -- setup --------------------------------------------------------------------

    def setup(self):
        spec = self.spec
        if spec.log_level is not None:
            logging.basicConfig(level=spec.log_level, format=LOG_FORMAT)
            for hd in logging.getLogger().handlers:
                hd.addFilter(default_log_fields)
        if spec.initializer is not None:
            spec.initializer()
        self.logger.addFilter(_LogContext(self))
        self.board = Board.attach(spec.board_path, LAYOUT)
        self.row = self.board.row(spec.row)
        self.wq = attach(spec.queue_path, spec.trusted)
        h = spec.handler
        if h.is_class and h.scope == "worker":
            self.instance = h.target()
        self.watchdog = _Watchdog(self)
        self.watchdog.start()
        _holdings.drop_lease(self.row)
        self.row.set(R_GRACE_NS, int(h.cancel_grace * 1e9))
        self.row.hold()

    def row_set(self, field, value):
        self.row.set(field, value)

    def row_add(self, field, n=1):
        self.row.add(field, n)

    # -- stop requests ------------------------------------------------------------

    def on_sigterm(self, signum, frame):
        self.stopping = True

    def watch_parent(self):
        """The supervisor sends "stop", or dies (EOF): finish the current message, exit."""
        block_stop_signals()
        try:
            while True:
                if self.conn.recv() == "stop":
                    break
        except (EOFError, OSError):
            pass
        self.stopping = True

    # -- publishing ---------------------------------------------------------------

    def publish(self, type_, body, key, delay, headers):
        """``ctx.publish``: straight into a registered type's queue, else via the ingress."""
        direct = self.spec.direct.get(type_)
        if direct is None:
            path, kw, base = self.spec.ingress_path, {}, 0
        else:
            path, kw, base = f"{self.spec.ingress_path}.{type_}", {"max_attempts": direct[0]}, direct[1]
        with self.out_lock:
            q = self.outq.get(path)
            if q is None:
                q = self.outq[path] = attach(path, self.spec.trusted)
            return base | q.put(body, key=key, delay=delay, headers=headers, **kw)

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

    def retry_delay(self, attempt):
        try:
            return delay_for(self.spec.handler, attempt)
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
        # what the supervisor needs to release this delivery if we die
        self.row.set(R_DEADLINE_NS, 0 if job.deadline is None else int(job.deadline * 1e9))
        _holdings.hold_lease(self.row, msg.id, msg.slot, msg.token, msg.attempt, time.time_ns())
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
        delay = self.retry_delay(msg.attempt)
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
        sample(self.row, elapsed)
        _holdings.drop_lease(self.row)
        self.current = None
        if fatal is not None:
            raise fatal

    def abort_timed_out(self, job):
        """Watchdog thread, cond held: the handler ignored its cancellation."""
        h = self.spec.handler
        try:
            with self.wq_mutex:
                job.msg.nack(delay=self.retry_delay(job.msg.attempt), error=HandlerTimeout(
                    f"{h.type!r} handler exceeded its timeout of {h.timeout} s and ignored the "
                    f"cancellation for {h.cancel_grace} s: worker {os.getpid()} terminated "
                    f"(attempt {job.msg.attempt})"))
        except LeaseLost:
            pass
        except Exception:
            self.logger.exception("could not nack the timed-out message")
        try:
            self.row_add(R_TIMED_OUT)
            sample(self.row, time.monotonic() - job.started)
            _holdings.drop_lease(self.row)
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
                _holdings.drop_lease(self.row)
                self.row.clear_holder()
            except Exception:
                pass
        with self.out_lock:
            for q in self.outq.values():
                q.close()
            self.outq.clear()
        if self.wq is not None:
            self.wq.close()
            self.wq = None


def worker_main(_row: int, spec: WorkerSpec, conn):
    """Entry point of a worker process (started by the supervisor's crew for board row
    ``_row``, which ``spec`` names too): set up, report ready, serve until stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the supervisor orchestrates the stop
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # whatever mask we inherited
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
