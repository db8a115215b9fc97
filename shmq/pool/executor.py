"""``shmq.ProcessPoolExecutor``: a ``concurrent.futures.Executor`` whose pool survives
killed workers.

It drops in where ``concurrent.futures.ProcessPoolExecutor`` is used: the same
constructor (plus ``max_attempts``), ``submit``, ``map``, ``shutdown`` and the
context manager, the same errors at the same points, futures of the stdlib's
class (:class:`~shmq.pool.futures.PoolFuture`: its lock made only when someone
waits), exceptions re-raised as the worker's own with its traceback chained
as ``__cause__``.  What differs is what a dead worker costs: its task runs
again on a fresh worker (up to ``max_attempts`` times, then that task alone
fails with :class:`shmq.WorkerCrashed`, a ``BrokenProcessPool``); every
other task, and the pool, go on.  See docs/pool.md.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, InvalidStateError
from typing import Any, Self

from . import lifetime
from .engine import Engine, Task, context
from .futures import PoolFuture
from .wire import EXECUTOR

__all__ = ["ProcessPoolExecutor"]


def _deliver(f: Future[Any], index: int, ok: bool, value: Any) -> None:
    """A task's outcome to its future."""
    try:
        if ok:
            f.set_result(value)
        else:
            f.set_exception(value)
    except InvalidStateError:  # cancelled while it waited to be sent (the pool broke)
        pass


class ProcessPoolExecutor(Executor):
    """Runs calls in ``max_workers`` worker processes; a killed worker costs its task a
    retry, never the pool.

    ``max_workers``: default ``os.cpu_count()``.  ``mp_context``: a
    ``multiprocessing`` context (default: the default context, or "spawn"
    with ``max_tasks_per_child``); under "fork", workers are forked by a
    single-threaded zygote forked when the executor is made (docs/pool.md).
    ``initializer(*initargs)`` runs in each worker first; if it raises, the
    executor is broken (every pending future fails with
    ``BrokenProcessPool``, as the stdlib's).  ``max_tasks_per_child``: a
    worker exits after that many tasks and is replaced.  ``max_attempts``:
    how many times a task may run while its worker dies (a signal,
    ``os._exit``, a segfault) before it fails with :class:`shmq.WorkerCrashed`.

    Arguments and results travel through shared memory (numpy arrays and
    Arrow data out of band, written straight into it).  At the interpreter's
    exit the submitted work is finished first, as the stdlib's does, unless
    the exit is an uncaught ``KeyboardInterrupt``: then the workers are
    killed at once.  Either way no worker and no file is left behind.

    :raises ValueError: ``max_workers`` < 1, ``max_tasks_per_child`` < 1, or
        ``max_tasks_per_child`` with the "fork" start method (as the stdlib's).
    :raises TypeError: ``initializer`` not callable, ``max_tasks_per_child`` not an int.
    """

    def __init__(self, max_workers: int | None = None, mp_context: Any = None,
                 initializer: Callable[..., object] | None = None, initargs: tuple[Any, ...] = (),
                 max_tasks_per_child: int | None = None, *, max_attempts: int = 3) -> None:
        if max_workers is None:
            max_workers = os.cpu_count() or 1
        elif max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if mp_context is None:
            mp_context = context("spawn" if max_tasks_per_child is not None else None)
        else:
            mp_context = context(mp_context)
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if max_tasks_per_child is not None:
            if not isinstance(max_tasks_per_child, int):
                raise TypeError("max_tasks_per_child must be an integer")
            if max_tasks_per_child <= 0:
                raise ValueError("max_tasks_per_child must be >= 1")
            if mp_context.get_start_method(allow_none=False) == "fork":
                raise ValueError("max_tasks_per_child is incompatible with the 'fork' "
                                 "multiprocessing start method; supply a different mp_context.")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError("max_attempts must be an int >= 1")
        self.max_workers = max_workers
        self.mp_context = mp_context
        self.max_attempts = max_attempts
        self._engine = Engine(max_workers, mp_context, initializer, initargs, max_tasks_per_child,
                              max_attempts, EXECUTOR, "finish", PoolFuture.set_running_or_notify_cancel,
                              _deliver)
        # dropped without shutdown(): the work submitted is finished, then the workers go
        weakref.finalize(self, self._engine.close)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Schedule ``fn(*args, **kwargs)``; return its future at once (arguments that
        cannot be pickled fail the future, as the stdlib's).

        :raises RuntimeError: after :meth:`shutdown`, or at the interpreter's exit.
        :raises concurrent.futures.process.BrokenProcessPool: the pool is broken (its
            initializer raised).
        """
        f: Future[Any] = PoolFuture()
        e = self._engine
        with e.lock:
            if e.broken is not None:
                from concurrent.futures.process import BrokenProcessPool

                raise BrokenProcessPool(str(e.broken)) from e.broken
            if e.closing:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if lifetime.exiting:
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            e.submit([Task((fn, args, kwargs), f)])
        return f

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any], timeout: float | None = None,
            chunksize: int = 1) -> Iterator[Any]:
        """``fn`` over the iterables' items, results in order (as the stdlib's: every call
        is submitted at once; ``timeout`` from this call; an error is raised when its
        result is reached).  ``chunksize`` is accepted for compatibility: the pool
        sends tasks in frames it sizes itself, and each task is retried alone.

        :raises ValueError: ``chunksize`` < 1.
        """
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        return super().map(fn, *iterables, timeout=timeout)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new tasks; with ``wait``, return once every submitted task is done and the
        workers and files are gone.  ``cancel_futures`` cancels the tasks not sent to a
        worker yet (the window ahead of the workers is a few tasks each)."""
        for t in self._engine.close(cancel=cancel_futures):
            t.sink.cancel()  # a future no worker was ever told of
        if wait:
            self._engine.join()

    def __enter__(self) -> Self:
        return self

    def __repr__(self) -> str:
        return f"<shmq.ProcessPoolExecutor max_workers={self.max_workers}>"
