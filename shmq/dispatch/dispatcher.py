"""``shmq.Dispatcher``: registration, publishing and the lifecycle.

The class users hold.  It validates and records handlers
(:mod:`.registry`), publishes messages, and hands the running part to a
:class:`~.supervisor.Supervisor` (worker processes, board, control socket,
router) between :meth:`Dispatcher.start` and :meth:`Dispatcher.stop`.
"""

from __future__ import annotations

import atexit
import fcntl
import inspect
import logging
import multiprocessing.connection as mpc
import os
import signal
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Self, TypeVar

from .._mapping import open_file
from .._mapping import resolve_path
from ..errors import ShmqError
from ..workqueue import WorkQueue
from ..workers.board import read_words
from .board import LAYOUT, board_path, config_of, status
from .registry import (
    BACKSTOP_MARGIN_S, MAX_TYPES, SUPERVISOR_TICK_S, HandlerSpec, attach, builtins_type,
    check_importable, check_type, open_or_create, positive,
)
from .supervisor import Supervisor, drain

_log = logging.getLogger("shmq.dispatch")

if TYPE_CHECKING:
    from _typeshed import StrPath

#: A handler: a function ``fn(ctx, body)`` or a class (returned unchanged by registration).
_H = TypeVar("_H", bound=Callable[..., Any])

#: Ids of messages published straight into a type's queue carry the type's
#: number (1-based, registration order) from this bit up, so that they never
#: equal an ingress id or another type's id (``message_id`` and
#: ``correlation_id`` stay unique per dispatcher).
ID_TYPE_SHIFT = 48


class _HybridMethod:
    """``Dispatcher.metrics(path)`` on the class, ``dispatcher.metrics()`` on an instance."""

    def __init__(self, fn: Callable[..., dict[str, Any]]) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj: Dispatcher | None, cls: type | None = None) -> Callable[..., dict[str, Any]]:
        if obj is None:
            return lambda path, **kw: self.fn(path, **kw)
        return lambda **kw: self.fn(obj.path, **kw)


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

    def __init__(self, work_queue: WorkQueue | StrPath, *, start_method: str = "forkserver", grace: float = 10.0,
                 capacity: int | str | None = None, dead_capacity: int | str | None = None,
                 max_attempts: int = 5, leases: int = 1024, keys: int = 4096,
                 unknown_type_delay: float = 0.0, initializer: Callable[[], Any] | None = None,
                 log_level: int | str | None = None, max_workers: int = 128,
                 reservoir: int = 256, start_timeout: float = 60.0) -> None:
        if start_method == "fork":
            raise ValueError("start_method='fork' is not supported: the dispatcher's supervisor "
                             "and router threads make fork unsafe; use 'forkserver' or 'spawn'")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', not {start_method!r}")
        if isinstance(work_queue, WorkQueue):
            self.path = work_queue.path
            opts = work_queue.options()
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
            check_importable(initializer, "initializer")
        for name, v, lo in (("max_workers", max_workers, 1), ("reservoir", reservoir, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= 4096:
                raise ValueError(f"{name} must be an int in {lo}..4096")
        self.start_method = start_method
        self.grace = positive("grace", grace) if grace else 0.0
        self.unknown_type_delay = float(unknown_type_delay or 0.0)
        self.initializer = initializer
        self.log_level = log_level
        self.max_workers = max_workers
        self.reservoir = reservoir
        self.start_timeout = start_timeout
        self.board_path = board_path(self.path)
        # the ingress queue exists from here on: publish() works before start()
        self._pub = open_or_create(self.path, **opts)
        self._pub_lock = threading.Lock()
        self._direct: dict[str, tuple[WorkQueue, int, int]] = {}  # type -> its queue, for publish() once started (no router hop)
        self._specs: dict[str, HandlerSpec] = {}
        self._lock = threading.RLock()
        self._state = "new"
        self._sup: Any = None  # the Supervisor once started

    # -- registration --------------------------------------------------------------

    def handler(self, type: str, *, parallelism: int = 1, timeout: float | None = None,
                max_attempts: int = 5, scope: str = "message", lease: float | None = None,
                cancel_grace: float = 5.0, retry_delay: float | Callable[[int], float] = 0.0) -> Callable[[_H], _H]:
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

        :raises ValueError: as :meth:`register`.
        :raises TypeError: as :meth:`register`.
        """
        def register(target: _H) -> _H:
            self.register(type, target, parallelism=parallelism, timeout=timeout,
                          max_attempts=max_attempts, scope=scope, lease=lease,
                          cancel_grace=cancel_grace, retry_delay=retry_delay)
            return target
        return register

    def register(self, type: str, target: _H, *, parallelism: int = 1, timeout: float | None = None,
                 max_attempts: int = 5, scope: str = "message", lease: float | None = None,
                 cancel_grace: float = 5.0, retry_delay: float | Callable[[int], float] = 0.0) -> _H:
        """Register ``target`` for ``type`` (the non-decorator form of :meth:`handler`).

        :raises ValueError: a bad type name or option, a type registered twice,
            too many types.
        :raises TypeError: ``target`` (or ``retry_delay``) is not importable by name.
        :raises RuntimeError: the dispatcher was started already.
        """
        check_type(type)
        if self._state != "new":
            raise RuntimeError("register handlers before start()")
        if type in self._specs:
            raise ValueError(f"a handler for {type!r} is already registered")
        if len(self._specs) >= MAX_TYPES:
            raise ValueError(f"at most {MAX_TYPES} message types per dispatcher")
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
            check_importable(retry_delay, "retry_delay")
        check_importable(target, "handler")
        if cancel_grace is None or isinstance(cancel_grace, bool) or cancel_grace < 0:
            raise ValueError("cancel_grace must be seconds >= 0")
        timeout = positive("timeout", timeout, allow_none=True)
        if lease is None:
            lease = 30.0
            if timeout is not None:
                lease = max(lease, timeout + cancel_grace + BACKSTOP_MARGIN_S
                            + SUPERVISOR_TICK_S + 5.0)
        spec = HandlerSpec(type, target, is_class, scope, parallelism, timeout, max_attempts,
                           positive("lease", lease), float(cancel_grace), retry_delay)
        self._specs[type] = spec
        return target

    @property
    def types(self) -> list[str]:
        return list(self._specs)

    def queue_path(self, type: str) -> str:
        """The path of ``type``'s work queue (``PATH.<type>``).

        :raises ValueError: not a valid type name.
        """
        return f"{self.path}.{check_type(type)}"

    def queue(self, type: str) -> WorkQueue:
        """A new handle on ``type``'s work queue (dead letters, stats); close it when done.

        :raises FileNotFoundError: the queue does not exist (yet).
        """
        return attach(self.queue_path(type), self._trusted)

    def _id_bases(self) -> dict[str, tuple[int, int]]:
        return {t: (s.max_attempts, (i + 1) << ID_TYPE_SHIFT)
                for i, (t, s) in enumerate(self._specs.items())}

    # -- producing -------------------------------------------------------------------

    def publish(self, type: str, body: Any, key: str | bytes | None = None, delay: float | None = None,
                headers: dict[str, Any] | None = None, correlation_id: int | None = None) -> int:
        """Enqueue a root message of ``type``; return its id.

        Once started, a registered type's message goes straight into its
        queue ``PATH.<type>`` (one pickle, one lease: the worker's); before
        :meth:`start`, and for unregistered types, it goes to the ingress
        queue and the router forwards it (or dead-letters it: NoHandler).
        Its ``correlation_id`` is ``correlation_id`` if given, else this id.

        :raises TypeError: ``type`` is not a str (see ``WorkQueue.put`` for the rest).
        :raises ValueError: the dispatcher is closed.
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
            direct = self._direct.get(type)
            if direct is not None:
                q, max_attempts, base = direct
                return base | q.put(body, key=key, delay=delay, headers=h,
                                    max_attempts=max_attempts)
            return self._pub.put(body, key=key, delay=delay, headers=h)

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> Self:
        """Create the per-type queues, start the workers and the router; return when
        every initial worker is ready.

        :raises shmq.ShmqError: another dispatcher runs on this path, or a
            worker could not start (the message includes its traceback).
        :raises RuntimeError: started before, or no handlers registered.
        :raises ValueError: the handlers' parallelism exceeds ``max_workers``.
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
            bases = self._id_bases()
            self._sup = Supervisor(
                self.path, self._specs, bases, start_method=self.start_method, grace=self.grace,
                initializer=self.initializer, log_level=self.log_level,
                max_workers=self.max_workers, reservoir=self.reservoir,
                start_timeout=self.start_timeout, qopts=self._qopts,
                unknown_type_delay=self.unknown_type_delay)
        try:
            self._sup.start()
            with self._pub_lock:
                for t, (max_attempts, base) in bases.items():
                    self._direct[t] = (attach(self.queue_path(t), self._trusted), max_attempts,
                                       base)
            with self._lock:
                self._state = "running"
            atexit.register(self._atexit)
        except BaseException:
            self.stop(grace=0)
            raise
        return self

    def stop(self, grace: float | None = None) -> None:
        """Stop: no new messages are taken; running handlers get ``grace`` seconds
        (default: the dispatcher's ``grace``) to finish, then their workers are
        killed and their messages released.  Idempotent; returns when every
        worker has exited."""
        with self._lock:
            if self._state in ("new", "stopped"):
                self._state = "stopped"
                return
            self._state = "stopped"
        try:
            atexit.unregister(self._atexit)
        except Exception:
            pass
        self._sup.stop(grace)
        with self._pub_lock:
            for q, _m, _b in self._direct.values():
                q.close()
            self._direct = {}

    def close(self) -> None:
        """Stop (if running) and close the ingress handle."""
        self.stop()
        with self._pub_lock:
            if self._pub is not None:
                self._pub.close()
                self._pub = None  # type: ignore[assignment]  # closed

    def _atexit(self) -> None:
        self.stop()

    def __enter__(self) -> Self:
        if self._state == "new":
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, grace: float | None = None) -> None:
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

            def on_signal(signum: int, frame: object) -> None:
                sup = self._sup
                if sup is not None:
                    sup.request_stop(grace, hurry=sup.stopping)
            for sig in (signal.SIGINT, signal.SIGTERM):
                installed[sig] = signal.signal(sig, on_signal)
        try:
            if self._state == "new":
                self.start()
            sup = self._sup
            while not sup.finished.is_set():
                if sig_r is None:
                    sup.finished.wait()
                    break
                for fd in mpc.wait([sig_r, sup.done_pipe]):
                    if fd == sig_r:
                        drain(sig_r)
        finally:
            self.stop(grace)
            for sig, old in installed.items():
                signal.signal(sig, old)
            if sig_r is not None:
                signal.set_wakeup_fd(old_wakeup)  # type: ignore[arg-type]  # set with sig_r
                os.close(sig_r)
                os.close(sig_w)  # type: ignore[arg-type]

    # -- scaling ----------------------------------------------------------------------

    def scale(self, type: str, n: int, wait: float | None = None) -> bool:
        """Run ``n`` workers for ``type`` from now on (0 pauses the type).

        Scaling down asks idle workers first; a busy worker finishes its
        current message before it exits, so nothing is dropped.  With
        ``wait`` (seconds), block until exactly ``n`` workers run and are
        ready; returns whether that happened in time.

        :raises ValueError: unknown type, bad ``n``, or over ``max_workers``.
        :raises RuntimeError: not started.
        """
        if self._sup is None:
            raise RuntimeError("scale() needs a started dispatcher (set parallelism= before)")
        self._sup.set_target(type, n)
        if wait is not None:
            return self.wait_ready(type, timeout=wait)
        return True

    def wait_ready(self, type: str | None = None, timeout: float | None = None) -> bool:
        """Block until ``type`` (or every type) runs exactly its target number of
        ready workers, none of them retiring; return False on timeout, on a
        stop, or if not started."""
        if self._sup is None:
            return False
        return self._sup.wait_ready([type] if type is not None else list(self._specs), timeout)

    def workers(self) -> dict[str, list[int]]:
        """``{type: [pid, ...]}`` of the live worker processes (retiring ones included)."""
        if self._sup is None:
            return {t: [] for t in self._specs}
        return self._sup.workers()

    # -- metrics ------------------------------------------------------------------------

    def _metrics(path: StrPath, queues: bool = True) -> dict[str, Any]:  # type: ignore[misc]  # see _HybridMethod
        """Per-type metrics: ``{type: {...}}`` (see docs/dispatcher.md, "Metrics").

        ``Dispatcher.metrics(path)`` from any process, ``dispatcher.metrics()``
        on an instance.  ``queues=False`` skips the queue depths (cheaper).
        """
        return status(path, queues=queues)["types"]

    metrics = _HybridMethod(_metrics)
    del _metrics

    def status(self, queues: bool = True) -> dict[str, Any]:
        """The board of this dispatcher, as :func:`shmq.dispatch.status` returns it."""
        return status(self.path, queues=queues)

    @staticmethod
    def destroy(path: StrPath, types: Iterable[str] = ()) -> None:
        """Remove a stopped dispatcher's files: the ingress queue, the type queues it
        recorded (and ``types``), their dead-letter spools and ``PATH.dispatch``.

        :raises shmq.ShmqError: a dispatcher is running on ``path``.
        """
        path = resolve_path(path)
        bp = board_path(path)
        queues = {f"{path}.{check_type(t)}" for t in types}
        try:
            fd, _st = open_file(bp, write=False)  # no follow, no block, regular files only
        except FileNotFoundError:
            fd = None
        if fd is not None:
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise ShmqError(f"a dispatcher is running on {path}; stop it first") from None
                try:
                    queues |= {q for q in config_of(read_words(bp, LAYOUT)).get("queues", [])
                               if isinstance(q, str) and q.startswith(path + ".")
                               and "/" not in q[len(path):]}
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
