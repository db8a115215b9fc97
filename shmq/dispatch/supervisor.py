"""The supervisor: worker processes, the board's header, the control socket.

It runs in the dispatcher's process, in one thread that waits (never
polls) on the worker processes (a :class:`shmq.workers.Crew`: they start,
stop and die there), their pipes, a wake pipe and the control socket.  It
keeps each type at its target number of workers, replaces workers that
die, gives the message a dead worker held back to its work queue
(``WorkQueue.release``: the worker published the lease's slot and token on
its board row, :mod:`shmq.workers.holdings`), and kills as a backstop a
worker whose handler holds the GIL so long that its own watchdog cannot act.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback

from ..errors import LeaseLost, ShmqError
from ..workers import Crew, WakePipe, exit_text
from ..workers import holdings as _holdings
from ..workers.board import R_HOLDER, STATE_RUNNING, STATE_STOPPED, STATE_STOPPING
from . import control
from .board import (
    H_LIVE, H_NTYPES, H_TARGET, R_CRASHED, R_DEADLINE_NS, R_GRACE_NS, R_TIMED_OUT, R_TYPE,
    board_path, claim_board, write_config,
)
from .registry import (
    BACKSTOP_MARGIN_S, EXIT_OK, EXIT_TIMEOUT, IDLE_WAKE_S, SUPERVISOR_TICK_S, HandlerTimeout,
    WorkerDied, WorkerSpec, delay_for, open_or_create, qualname,
)
from .routing import Router
from .worker import worker_main

_log = logging.getLogger("shmq.dispatch")


def drain(fd):
    """Read a non-blocking pipe empty (its bytes are wake-ups, not data): run()'s
    signal wakeup fd (the supervisor's own pipes are WakePipes)."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


class _Worker:
    """A worker process (``proc``, the crew's) as the supervisor sees it: its type, its
    pipe and board row (the crew's key), whether it is ready or retiring."""

    __slots__ = ("type", "proc", "conn", "row", "ready", "retiring", "started", "pid",
                 "backstop_token")

    def __init__(self, type_, proc, conn, row):
        self.type = type_
        self.proc = proc
        self.conn = conn
        self.row = row
        self.ready = False
        self.retiring = False
        self.started = proc.started
        self.pid = proc.pid
        self.backstop_token = None


class Supervisor:
    """Owns the worker processes of one running dispatcher (one start, one stop).

    ``specs``: ``{type: HandlerSpec}``; ``direct``: ``{type: (max_attempts,
    id_base)}`` handed to workers for ``ctx.publish``; ``qopts``: options
    for creating the type queues.  Thread-safe: ``set_target``,
    ``wait_ready``, ``workers`` from any thread, ``request_stop`` from a
    signal handler.
    """

    def __init__(self, path, specs, direct, *, start_method, grace, initializer, log_level,
                 max_workers, reservoir, start_timeout, qopts, unknown_type_delay):
        self.path = path
        self.specs = dict(specs)
        self.direct = dict(direct)
        self.start_method = start_method
        self.grace = grace
        self.initializer = initializer
        self.log_level = log_level
        self.max_workers = max_workers
        self.reservoir = reservoir
        self.start_timeout = start_timeout
        self.qopts = dict(qopts)
        self.trusted = bool(qopts.get("trusted", False))
        self.unknown_type_delay = unknown_type_delay
        self.board_path = board_path(path)
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self.targets = {t: s.parallelism for t, s in self.specs.items()}
        self.live = []
        self.stop_grace = None
        self.stopping = False
        self.hurry = False
        self.thread = None
        self.router = None
        self.start_error = None
        self.started = threading.Event()
        self.finished = threading.Event()
        self.retired = 0
        self.board = self.sock = self.crew = None
        self.by_key = {}  # the crew's key (a board row) -> _Worker
        self.wake_pipe = self.done_pipe = None  # WakePipes: the thread's wait; its end, for run()
        self.tq = {}
        self.failures = {}
        self.backoff_until = {}

    # -- lifecycle (called by the Dispatcher) ----------------------------------------

    def start(self):
        """Board, socket, type queues, workers, router; return once every worker is ready.

        :raises shmq.ShmqError: another dispatcher runs on the path, or a worker
            failed to start (with its traceback).  The caller then calls :meth:`stop`.
        """
        self.open_board()
        self.sock = control.listen(self.path)
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            mods = {"shmq.dispatch"} | {s.target.__module__ for s in self.specs.values()}
            if self.initializer is not None:
                mods.add(self.initializer.__module__)
            ctx.set_forkserver_preload(sorted(m for m in mods if m))
        # SIGTERM when the supervisor's process dies: a worker finishes its message
        self.crew = Crew(ctx, worker_main, name="shmq-dispatch", death_signal=signal.SIGTERM)
        for t, s in self.specs.items():  # our own handles: releases on behalf of dead workers
            self.tq[t] = open_or_create(f"{self.path}.{t}", max_attempts=s.max_attempts,
                                        **self.qopts)
        self.wake_pipe, self.done_pipe = WakePipe(), WakePipe()
        self.write_targets()
        self.thread = threading.Thread(target=self.supervise, name="shmq-dispatch-supervisor",
                                       daemon=True)
        self.thread.start()
        if not self.started.wait(self.start_timeout):
            raise ShmqError(f"workers did not become ready within {self.start_timeout} s")
        if self.start_error:
            raise ShmqError(f"a worker failed to start:\n{self.start_error}")
        self.router = Router(self.path, self.specs, self.board.w, lambda: self.stopping,
                             unknown_type_delay=self.unknown_type_delay, trusted=self.trusted)
        self.router.start()
        self.board.set_state(STATE_RUNNING)

    def request_stop(self, grace=None, hurry=False):
        """Called from signal handlers too: no locks (handlers can nest), only plain
        attribute stores and one byte written to the wake pipe.  The router and
        the supervisor thread look at ``stopping``."""
        if grace is not None:
            self.stop_grace = 0.0 if hurry else float(grace)
        if hurry:
            self.hurry = True
        self.stopping = True
        self.wake()

    def wake(self):
        pipe = self.wake_pipe
        if pipe is not None:  # else not started, or finished
            pipe.wake()

    def stop(self, grace):
        """Request a stop, wait for the supervisor thread, release everything.  Idempotent."""
        self.request_stop(grace)
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            g = self.stop_grace if self.stop_grace is not None else self.grace
            thread.join(g + 30.0)
            if thread.is_alive():
                _log.error("supervisor did not finish within %.1f s", g + 30.0)
        self.close()

    def close(self):
        router = self.router
        if router is not None:
            router.join(IDLE_WAKE_S * 4 + 2.0)
            if router.is_alive():
                _log.error("router thread still blocked (a full type queue?); it keeps its "
                           "ingress lease until this process exits")
            self.router = None
        for q in self.tq.values():
            q.close()
        self.tq = {}
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.crew is not None:
            self.crew.close()
            self.crew = None
        board = self.board
        if board is not None:
            board.set_state(STATE_STOPPED)
            board.close()  # drops the flock
            self.board = None
        thread = self.thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            # It still waits on the wake pipe, and run() on the done pipe: closed under
            # a wait, a number would be polled after it was freed.  Left open for the
            # process's life: two pipes.
            return
        for name in ("wake_pipe", "done_pipe"):
            pipe = getattr(self, name)
            setattr(self, name, None)
            if pipe is not None:
                pipe.close()  # a wake() that read the attribute just before writes nothing

    # -- scaling ----------------------------------------------------------------------

    def set_target(self, type, n):
        """Run ``n`` workers of ``type`` from now on; return the previous target.

        :raises ValueError: unknown type, bad ``n``, or over ``max_workers``.
        """
        if type not in self.specs:
            raise ValueError(f"no handler registered for {type!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError("the number of workers must be an int >= 0")
        with self.lock:
            total = sum(v for t, v in self.targets.items() if t != type) + n
            if total > self.max_workers:
                raise ValueError(f"{total} workers in all exceeds max_workers={self.max_workers}")
            old = self.targets.get(type, 0)
            self.targets[type] = n
            if self.board is not None:
                self.write_targets()
            self.cv.notify_all()
        self.wake()
        return old

    def wait_ready(self, types, timeout=None) -> bool:
        """Block until each of ``types`` runs exactly its target number of ready
        workers, none retiring; False on timeout or stop."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def settled():
            for t in types:
                ws = [w for w in self.live if w.type == t]
                if len(ws) != self.targets.get(t, 0) or not all(w.ready and not w.retiring
                                                                 for w in ws):
                    return False
            return True

        with self.cv:
            while not settled():
                if self.stopping:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cv.wait(left)
            return True

    def workers(self) -> dict[str, list[int]]:
        """``{type: [pid, ...]}`` of the live worker processes (retiring ones included)."""
        with self.lock:
            out: dict[str, list[int]] = {t: [] for t in self.specs}
            for w in self.live:
                out[w.type].append(w.pid)
            return out

    # -- the board ------------------------------------------------------------------------

    def open_board(self):
        """Take ``PATH.dispatch`` (one dispatcher per path) and publish the config.

        :raises shmq.ShmqError: the file is not ours, or another dispatcher holds it.
        """
        self.board, old_queues = claim_board(self.board_path, self.path, self.max_workers,
                                             self.reservoir)
        b = self.board
        b.w[H_NTYPES] = len(self.specs)
        queues = sorted(set(old_queues) | {f"{self.path}.{t}" for t in self.specs})
        write_config(b, 
            {"path": self.path, "pid": os.getpid(), "start_method": self.start_method,
             "queues": queues,
             "types": [{"type": s.type, "handler": qualname(s.target), "scope": s.scope,
                        "parallelism": s.parallelism, "timeout": s.timeout,
                        "max_attempts": s.max_attempts, "lease": s.lease,
                        "cancel_grace": s.cancel_grace} for s in self.specs.values()]})
        b.publish()
        self.type_index = {t: i for i, t in enumerate(self.specs)}
        self.rows_free = list(range(self.max_workers - 1, -1, -1))
        self.rows_idle = {t: [] for t in self.specs}

    def write_targets(self):
        w = self.board.w
        for t, i in self.type_index.items():
            w[H_TARGET + i] = self.targets.get(t, 0)

    def write_live(self):
        counts = {t: 0 for t in self.specs}
        for wk in self.live:
            counts[wk.type] += 1
        w = self.board.w
        for t, i in self.type_index.items():
            w[H_LIVE + i] = counts[t]

    # -- workers --------------------------------------------------------------------------

    def alloc_row(self, type_):
        idle = self.rows_idle[type_]
        if idle:
            return idle.pop()
        if self.rows_free:
            row = self.rows_free.pop()
            self.board.row(row).set(R_TYPE, self.type_index[type_] + 1)
            return row
        return None

    def spawn(self, type_):
        row = self.alloc_row(type_)
        if row is None:
            _log.error("no free worker row for %r (max_workers=%d)", type_, self.max_workers)
            return None
        spec = WorkerSpec(self.specs[type_], f"{self.path}.{type_}", self.path, self.board_path,
                          row, self.initializer, self.log_level, self.trusted, self.direct)
        parent, child = self.crew.ctx.Pipe(duplex=True)
        try:
            proc = self.crew.start(row, spec, child)
        except BaseException:
            self.rows_idle[type_].append(row)
            parent.close()
            child.close()
            raise
        child.close()
        w = _Worker(type_, proc, parent, row)
        with self.lock:
            self.live.append(w)
            self.by_key[row] = w
        return w

    def retire(self, w):
        w.retiring = True
        try:
            w.conn.send("stop")
        except (OSError, ValueError, AttributeError):
            self.crew.signal(w.proc, signal.SIGTERM)

    def reconcile(self):
        if self.stopping:
            return
        with self.lock:
            targets = dict(self.targets)
        now = time.monotonic()
        for t, target in targets.items():
            ws = [w for w in self.live if w.type == t and not w.retiring]
            if len(ws) < target:
                if now < self.backoff_until.get(t, 0.0):
                    continue
                for _ in range(target - len(ws)):
                    try:
                        if self.spawn(t) is None:
                            break
                    except Exception:
                        if not self.started.is_set():
                            raise
                        _log.exception("could not start a worker for %r; retrying later", t)
                        self.backoff_until[t] = time.monotonic() + 1.0
                        break
            elif len(ws) > target:
                # idle ones first (they stop at once), newest first
                ws.sort(key=lambda w: (_holdings.peek(self.board.row(w.row)).n, -w.started))
                for w in ws[:len(ws) - target]:
                    self.retire(w)
        self.write_live()

    def release_dead(self, w, code, held):
        """The worker died holding a message (``held``, its row's holding): give it back
        to its queue (a failed attempt)."""
        row = self.board.row(w.row)
        h = self.specs[w.type]
        msg_id, attempt, token = held.msg, held.attempt, held.token
        if w.backstop_token is not None and w.backstop_token == token:
            err = HandlerTimeout(
                f"{w.type!r} handler exceeded its timeout of {h.timeout} s and its worker "
                f"{w.pid} could not cancel it (GIL held?): killed by the supervisor "
                f"(attempt {attempt})")
            row.add(R_TIMED_OUT)
        elif self.stopping and code == -signal.SIGKILL:
            err = WorkerDied(f"dispatcher stopping: the {w.type!r} handler did not finish "
                             f"within the grace period; worker {w.pid} killed "
                             f"(attempt {attempt})")
            row.add(R_CRASHED)
        else:
            err = WorkerDied(f"worker {w.pid} for {w.type!r} died ({exit_text(code)}) while "
                             f"handling message {msg_id} (attempt {attempt})")
            row.add(R_CRASHED)
        try:
            delay = delay_for(h, attempt)
        except Exception:
            delay = 0.0
        try:
            self.tq[w.type].release(held.slot, token, delay=delay, error=err)
            _log.warning("%s; message released", err)
        except LeaseLost:
            pass  # settled before it died, or already redelivered by the work queue
        except Exception:
            _log.exception("could not release the message of dead worker %d", w.pid)

    def on_exit(self, w):
        """A worker process ended (reaped by the crew): settle its message, free its row,
        maybe replace it."""
        code = w.proc.exitcode
        if w.conn is not None:
            try:
                w.conn.close()
            except OSError:
                pass
            w.conn = None
        row = self.board.row(w.row)
        held = _holdings.reclaim(row)  # its single writer is gone: the row is ours now
        if held is not None and held.n and row.holder:
            self.release_dead(w, code, held)
        row.set(R_HOLDER, 0)  # free
        self.rows_idle[w.type].append(w.row)
        with self.lock:
            self.live.remove(w)
            self.by_key.pop(w.row, None)
            self.cv.notify_all()
        if not w.ready:  # died while starting: back off before the next attempt
            n = self.failures.get(w.type, 0) + 1
            self.failures[w.type] = n
            self.backoff_until[w.type] = time.monotonic() + min(10.0, 0.2 * 2 ** (n - 1))
            if not self.started.is_set():
                self.start_error = self.start_error or (
                    f"worker for {w.type!r} exited with code {code} before it was ready")
                self.started.set()
        else:
            self.failures.pop(w.type, None)
        if w.retiring and code == EXIT_OK:
            self.retired += 1
        elif code not in (EXIT_OK, EXIT_TIMEOUT) and not self.stopping:
            _log.warning("worker %d for %r exited with %s; replacing it", w.pid, w.type,
                         exit_text(code))

    def on_event(self, w):
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
            with self.lock:
                w.ready = True
                self.cv.notify_all()
            if not self.started.is_set() and all(x.ready for x in self.live):
                self.started.set()
        elif ev[0] == "error":
            _log.error("worker %d for %r failed to start:\n%s", w.pid, w.type, ev[1])
            if not self.started.is_set():
                self.start_error = ev[1]
                self.started.set()

    def backstop(self):
        """Kill workers whose handler is far past timeout + grace; return the next check time."""
        now = time.monotonic_ns()
        nxt = None
        for w in self.live:
            row = self.board.row(w.row)
            dl, held = row.get(R_DEADLINE_NS), _holdings.peek(row)
            if not held.n or not dl or w.backstop_token is not None:
                continue
            at = dl + row.get(R_GRACE_NS) + int(BACKSTOP_MARGIN_S * 1e9)
            if now >= at:
                w.backstop_token = held.token
                _log.error("worker %d for %r is %.1f s past its handler timeout: killing it",
                           w.pid, w.type, (now - dl) / 1e9)
                self.crew.signal(w.proc, signal.SIGKILL)
            else:
                nxt = at if nxt is None else min(nxt, at)
        return None if nxt is None else (nxt - now) / 1e9

    # -- remote commands --------------------------------------------------------------------

    def command(self, req):
        """Answer one control-socket request (see :mod:`shmq.dispatch.control`)."""
        op = req.get("op")
        if op == "scale":
            old = self.set_target(req.get("type"), req.get("n"))
            return {"ok": True, "type": req["type"], "previous": old, "target": req["n"]}
        if op == "stop":
            g = req.get("grace")
            self.request_stop(None if g is None else float(g))
            return {"ok": True}
        if op == "ping":
            return {"ok": True, "pid": os.getpid()}
        return {"ok": False, "error": f"unknown op {op!r}"}

    # -- the supervisor thread ---------------------------------------------------------------

    def supervise(self):
        try:
            self.reconcile()
            if not self.live:
                self.started.set()
            self.loop()
        except BaseException as exc:
            _log.exception("dispatcher supervisor failed")
            if not self.started.is_set():
                self.start_error = "".join(traceback.format_exception(exc))
                self.started.set()
            self.stopping = True
        finally:
            try:
                self.shutdown()
            finally:
                self.finished.set()
                done = self.done_pipe
                if done is not None:
                    done.wake()

    def loop(self):
        has_timeouts = any(s.timeout is not None for s in self.specs.values())
        while not self.stopping:
            timeout = None
            if has_timeouts and self.live:
                nxt = self.backstop()
                timeout = SUPERVISOR_TICK_S if nxt is None else min(SUPERVISOR_TICK_S, nxt)
            pending = [t for t, until in self.backoff_until.items() if until > time.monotonic()]
            if pending:
                left = min(self.backoff_until[t] for t in pending) - time.monotonic()
                timeout = left if timeout is None else min(timeout, left)
            self.wait_and_handle(timeout, accept=True)
            self.reconcile()

    def wait_and_handle(self, timeout, accept):
        objs = {self.wake_pipe: ("wake", None)}
        if accept and self.sock is not None:
            objs[self.sock] = ("control", None)
        for w in self.live:
            if w.conn is not None:
                objs[w.conn] = ("event", w)
        dead, ready = self.crew.wait(None if timeout is None else max(0.0, timeout), list(objs))
        for o in ready:
            kind, w = objs[o]
            if kind == "wake":
                self.wake_pipe.drain()
            elif kind == "control":
                control.serve_one(self.sock, self.command)
            elif w.conn is not None:
                self.on_event(w)
        exits = [self.by_key[p.key] for p in dead if p.key in self.by_key]
        for w in exits:
            # drain its last events (a startup error arrives just before the exit)
            while w.conn is not None and w.conn.poll(0):
                self.on_event(w)
            self.on_exit(w)

    def shutdown(self):
        if self.board is None:
            return
        self.board.set_state(STATE_STOPPING)
        self.stopping = True
        with self.lock:
            self.cv.notify_all()
        for w in list(self.live):
            self.retire(w)
        grace = self.stop_grace if self.stop_grace is not None else self.grace
        deadline = time.monotonic() + grace
        while self.live:
            left = 0.0 if self.hurry else deadline - time.monotonic()
            if left <= 0:
                break
            self.wait_and_handle(left, accept=False)
        for p in self.crew.kill_all():  # SIGKILLed, reaped
            if p.key in self.by_key:
                self.on_exit(self.by_key[p.key])
        for w in list(self.live):  # never reaped (logged by the crew): free its row anyway
            self.on_exit(w)
        self.write_live()
