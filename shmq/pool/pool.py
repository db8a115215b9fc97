"""``shmq.Pool``: ``multiprocessing.pool.Pool``'s API, on a pool that survives killed workers.

``apply``/``apply_async``, ``map``/``map_async``, ``starmap``/``starmap_async``,
``imap``, ``imap_unordered``, ``close``, ``terminate``, ``join`` and the
context manager behave as the stdlib's; results are :class:`AsyncResult`
(``get``, ``wait``, ``ready``, ``successful``; callbacks and error callbacks
run in the pool's result thread).  A task whose worker dies runs again on a
fresh worker (``max_attempts`` times in all), then fails alone with
:class:`shmq.WorkerCrashed`: ``map`` over a task that kills its worker
returns (raises it), where the stdlib's hangs for good.  See docs/pool.md.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Self

from . import engine as _engine
from .engine import Engine, Task
from .wire import POOL

__all__ = ["Pool", "AsyncResult", "ApplyResult", "MapResult", "IMapIterator"]

log = logging.getLogger("shmq.pool")

RUN, CLOSE, TERMINATE = "RUN", "CLOSE", "TERMINATE"


def _call_back(fn: Callable[[Any], object] | None, value: Any) -> None:
    if fn is not None:
        try:
            fn(value)
        except Exception:  # noqa: BLE001  (the user's callback: logged, the pool goes on)
            log.exception("a pool result callback raised")


class ApplyResult:
    """The result of :meth:`Pool.apply_async` (``multiprocessing.pool.AsyncResult``'s API)."""

    def __init__(self, callback: Callable[[Any], object] | None = None,
                 error_callback: Callable[[BaseException], object] | None = None) -> None:
        self._event = threading.Event()
        self._callback = callback
        self._error_callback = error_callback
        self._success: bool | None = None
        self._value: Any = None

    def ready(self) -> bool:
        """Whether the call has completed."""
        return self._event.is_set()

    def successful(self) -> bool:
        """Whether the call completed without raising.

        :raises ValueError: not ready yet.
        """
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return bool(self._success)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the result is ready, or ``timeout`` seconds."""
        self._event.wait(timeout)

    def get(self, timeout: float | None = None) -> Any:
        """The result, or the exception the call raised (with the worker's traceback as its
        ``__cause__``).

        :raises multiprocessing.TimeoutError: not ready within ``timeout``.
        """
        self.wait(timeout)
        if not self.ready():
            raise multiprocessing.TimeoutError
        if self._success:
            return self._value
        raise self._value

    def _deliver(self, index: int, ok: bool, value: Any) -> None:
        self._success, self._value = ok, value
        _call_back(self._callback if ok else self._error_callback, value)
        self._callback = self._error_callback = None
        self._event.set()


AsyncResult = ApplyResult


class MapResult(ApplyResult):
    """The result of :meth:`Pool.map_async`: a list, ready once every call has completed
    (the first error is the result's exception)."""

    def __init__(self, length: int, callback: Callable[[Any], object] | None = None,
                 error_callback: Callable[[BaseException], object] | None = None) -> None:
        super().__init__(callback, error_callback)
        self._value = [None] * length
        self._left = length
        self._success = True
        if not length:
            self._event.set()

    def _deliver(self, index: int, ok: bool, value: Any) -> None:
        self._left -= 1
        if not ok and self._success:  # only the first exception is kept
            self._success, self._value = False, value
        elif ok and self._success:
            self._value[index] = value
        if self._left == 0:
            _call_back(self._callback if self._success else self._error_callback, self._value)
            self._callback = self._error_callback = None
            self._event.set()


class IMapIterator:
    """The iterator :meth:`Pool.imap` returns: results in order, ``next(timeout)``."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._items: dict[int, tuple[bool, Any]] = {}
        self._index = 0
        self._length: int | None = None  # set once the input is read whole

    def __iter__(self) -> Self:
        return self

    def _take(self) -> tuple[bool, Any] | None:
        got = self._items.pop(self._index, None)
        if got is not None:
            self._index += 1
        return got

    def next(self, timeout: float | None = None) -> Any:
        """The next result.

        :raises multiprocessing.TimeoutError: none within ``timeout``.
        :raises StopIteration: no more.
        """
        with self._cond:
            while True:
                got = self._take()
                if got is not None:
                    break
                if self._length is not None and self._index >= self._length:
                    raise StopIteration
                if not self._cond.wait(timeout):
                    raise multiprocessing.TimeoutError
        ok, value = got
        if ok:
            return value
        raise value

    __next__ = next

    def _deliver(self, index: int, ok: bool, value: Any) -> None:
        with self._cond:
            self._put(index, ok, value)
            self._cond.notify()

    def _put(self, index: int, ok: bool, value: Any) -> None:
        self._items[index] = (ok, value)

    def _set_length(self, n: int) -> None:
        with self._cond:
            self._length = n
            self._cond.notify()


class IMapUnorderedIterator(IMapIterator):
    """:meth:`Pool.imap_unordered`'s: results as they complete."""

    def __init__(self) -> None:
        super().__init__()
        self._done: deque[tuple[bool, Any]] = deque()

    def _put(self, index: int, ok: bool, value: Any) -> None:
        self._done.append((ok, value))

    def _take(self) -> tuple[bool, Any] | None:
        if not self._done:
            return None
        self._index += 1
        return self._done.popleft()


class Pool:
    """``multiprocessing.pool.Pool``, whose workers may be killed: a dead worker costs its
    task a retry on a fresh worker, never the pool (``max_attempts`` runs in all, then
    that task fails with :class:`shmq.WorkerCrashed`).

    ``processes``: default ``os.cpu_count()``.  ``initializer(*initargs)`` runs in
    each worker first (if it raises, the pool is broken: every pending result fails
    with ``BrokenProcessPool``).  ``maxtasksperchild``: a worker exits after that
    many tasks (chunks) and is replaced.  ``context``: a ``multiprocessing`` context
    or start method name; under "fork", workers are forked by a single-threaded
    zygote forked when the pool is made.  At the interpreter's exit (or when the
    pool is collected) a pool still open is terminated, as the stdlib's: its
    workers are killed and its files removed.

    :raises ValueError: ``processes`` < 1, or ``maxtasksperchild`` not a positive int.
    :raises TypeError: ``initializer`` not callable.
    """

    def __init__(self, processes: int | None = None, initializer: Callable[..., object] | None = None,
                 initargs: Iterable[Any] = (), maxtasksperchild: int | None = None,
                 context: Any = None, *, max_attempts: int = 3) -> None:
        if processes is None:
            processes = os.cpu_count() or 1
        if processes < 1:
            raise ValueError("Number of processes must be at least 1")
        if maxtasksperchild is not None and (not isinstance(maxtasksperchild, int)
                                             or isinstance(maxtasksperchild, bool)
                                             or maxtasksperchild <= 0):
            raise ValueError("maxtasksperchild must be a positive int or None")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError("max_attempts must be an int >= 1")
        self._state = RUN
        self.processes = processes
        self._engine = Engine(processes, _ctx(context), initializer, tuple(initargs), maxtasksperchild,
                              max_attempts, POOL, "terminate", None, _deliver)
        weakref.finalize(self, self._engine.terminate)  # collected while open: as terminate()

    def __reduce__(self) -> Any:
        raise NotImplementedError("pool objects cannot be passed between processes or pickled")

    def __repr__(self) -> str:
        return f"<shmq.Pool state={self._state} pool_size={self.processes}>"

    def _submit(self, tasks: list[Task]) -> None:
        e = self._engine
        with e.lock:
            if self._state != RUN:
                raise ValueError("Pool not running")
            if e.broken is not None:
                from concurrent.futures.process import BrokenProcessPool

                raise BrokenProcessPool(str(e.broken)) from e.broken
            e.submit(tasks)

    def _check_running(self) -> None:
        if self._state != RUN:
            raise ValueError("Pool not running")

    # -- one call -----------------------------------------------------------------------

    def apply(self, func: Callable[..., Any], args: Iterable[Any] = (), kwds: dict[str, Any] | None = None) -> Any:
        """``func(*args, **kwds)`` in a worker; blocks for the result."""
        return self.apply_async(func, args, kwds).get()

    def apply_async(self, func: Callable[..., Any], args: Iterable[Any] = (),
                    kwds: dict[str, Any] | None = None, callback: Callable[[Any], object] | None = None,
                    error_callback: Callable[[BaseException], object] | None = None) -> ApplyResult:
        """``func(*args, **kwds)`` in a worker; its :class:`AsyncResult` at once.

        :raises ValueError: the pool is not running.
        """
        self._check_running()
        res = ApplyResult(callback, error_callback)
        self._submit([Task((func, tuple(args), dict(kwds or {})), res)])
        return res

    # -- many calls ---------------------------------------------------------------------

    def _map_async(self, func: Callable[..., Any], iterable: Iterable[Any], star: bool,
                   chunksize: int | None, callback: Callable[[Any], object] | None,
                   error_callback: Callable[[BaseException], object] | None) -> MapResult:
        self._check_running()
        items = list(iterable)  # here: an error of the iterable is the caller's, as the stdlib's
        _check_chunksize(chunksize)
        res = MapResult(len(items), callback, error_callback)
        if items:
            self._submit(self._tasks(func, items, 0, star, res))
        return res

    @staticmethod
    def _tasks(func: Callable[..., Any], items: list[Any], start: int, star: bool, sink: Any) -> list[Task]:
        kw: dict[str, Any] = {}  # one for all (a frame pickles it once)
        if star:
            return [Task((func, tuple(a), kw), sink, start + i) for i, a in enumerate(items)]
        return [Task((func, (a,), kw), sink, start + i) for i, a in enumerate(items)]

    def map(self, func: Callable[..., Any], iterable: Iterable[Any], chunksize: int | None = None) -> list[Any]:
        """``[func(x) for x in iterable]`` in the workers; blocks.  ``chunksize`` is
        accepted for compatibility (with ``maxtasksperchild`` it is what counts as one
        task); the pool sizes its own frames and retries each call alone."""
        return self._map_async(func, iterable, False, chunksize, None, None).get()

    def map_async(self, func: Callable[..., Any], iterable: Iterable[Any], chunksize: int | None = None,
                  callback: Callable[[Any], object] | None = None,
                  error_callback: Callable[[BaseException], object] | None = None) -> MapResult:
        """:meth:`map`'s :class:`AsyncResult` (ready once every call has completed)."""
        return self._map_async(func, iterable, False, chunksize, callback, error_callback)

    def starmap(self, func: Callable[..., Any], iterable: Iterable[Iterable[Any]],
                chunksize: int | None = None) -> list[Any]:
        """``[func(*args) for args in iterable]`` in the workers; blocks."""
        return self._map_async(func, iterable, True, chunksize, None, None).get()

    def starmap_async(self, func: Callable[..., Any], iterable: Iterable[Iterable[Any]],
                      chunksize: int | None = None, callback: Callable[[Any], object] | None = None,
                      error_callback: Callable[[BaseException], object] | None = None) -> MapResult:
        """:meth:`starmap`'s :class:`AsyncResult`."""
        return self._map_async(func, iterable, True, chunksize, callback, error_callback)

    def imap(self, func: Callable[..., Any], iterable: Iterable[Any], chunksize: int = 1) -> IMapIterator:
        """Results of ``func`` over ``iterable`` in order, as they come.  The input is read
        in the background, ``chunksize`` items at a time; if reading it raises, the chunk
        being read fails with that error and the results end there."""
        return self._imap(func, iterable, chunksize, IMapIterator())

    def imap_unordered(self, func: Callable[..., Any], iterable: Iterable[Any],
                       chunksize: int = 1) -> IMapIterator:
        """As :meth:`imap`, in the order they complete."""
        return self._imap(func, iterable, chunksize, IMapUnorderedIterator())

    def _imap(self, func: Callable[..., Any], iterable: Iterable[Any], chunksize: int,
              it: IMapIterator) -> IMapIterator:
        self._check_running()
        _check_chunksize(chunksize)
        source = iter(iterable)
        threading.Thread(target=self._read_input, args=(func, source, chunksize, it),
                         name="shmq-pool-imap", daemon=True).start()
        return it

    def _read_input(self, func: Callable[..., Any], source: Iterator[Any], chunksize: int,
                    it: IMapIterator) -> None:
        n = 0
        try:
            while True:
                try:
                    chunk = list(itertools.islice(source, chunksize))
                except BaseException as exc:  # noqa: BLE001  (the consumer gets it, in place)
                    it._deliver(n, False, exc)
                    n += 1
                    break
                if not chunk:
                    break
                self._submit(self._tasks(func, chunk, n, False, it))
                n += len(chunk)
        except BaseException as exc:  # noqa: BLE001  (the pool closed under us: say so)
            it._deliver(n, False, exc)
            n += 1
        finally:
            it._set_length(n)

    # -- the end ------------------------------------------------------------------------

    def close(self) -> None:
        """No more tasks; the workers exit once the tasks submitted are done."""
        if self._state == RUN:
            self._state = CLOSE
            self._engine.close()

    def terminate(self) -> None:
        """Stop now: the workers are killed; results not ready never will be."""
        self._state = TERMINATE
        self._engine.terminate()

    def join(self) -> None:
        """Wait for the workers to exit (after :meth:`close` or :meth:`terminate`).

        :raises ValueError: the pool is still running.
        """
        if self._state == RUN:
            raise ValueError("Pool is still running")
        self._engine.join()

    def __enter__(self) -> Self:
        self._check_running()
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()


def _deliver(result: Any, index: int, ok: bool, value: Any) -> None:
    result._deliver(index, ok, value)


def _ctx(context: Any) -> Any:
    return context if context is not None and not isinstance(context, str) else _engine.context(context)


def _check_chunksize(chunksize: int | None) -> None:
    if chunksize is not None and chunksize < 1:
        raise ValueError(f"Chunksize must be 1+, not {chunksize:n}")
