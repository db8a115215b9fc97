"""The executor's futures: ``concurrent.futures.Future``, without a lock made for each.

The stdlib's ``Future.__init__`` makes a ``threading.Condition`` (Python code:
an RLock and its bound methods): most of a trivial ``submit()``'s time in the
parent, and most of its objects for the cyclic GC.
A :class:`PoolFuture` makes its condition (and its lists of waiters and
callbacks) on first use, which only a thread that must wait or be told
needs: ``result()``/``exception()`` before the future is done,
``concurrent.futures.wait``/``as_completed``, ``add_done_callback``,
``cancel()``, ``repr()``.

Guarantees (the stdlib's, for a class that *is* the stdlib's, by subclass):

* The same states, transitions, errors and callback order.  Until a future
  has its condition, its transitions (:meth:`~PoolFuture.set_running_or_notify_cancel`,
  :meth:`~PoolFuture.set_result`, :meth:`~PoolFuture.set_exception`) run
  under one lock shared by all pool futures, held for a few attribute writes
  and never while user code runs or while anything waits.
* The condition is made under that same lock, so every transition made
  without it happens before anyone holds it; once it exists, every
  transition takes it (the stdlib's code), as ``wait()`` and ``as_completed()``
  expect.  Without a condition a future has no waiter and no callback (both
  are added under it).
* A finished future's ``result()`` and ``exception()`` read it without a
  lock: FINISHED is final, and its value was written before it (CPython
  3.15's ``Future._get_snapshot`` does the same).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from concurrent.futures._base import (CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED, PENDING,
                                      RUNNING)
from typing import Any

__all__ = ["PoolFuture"]

_DONE = frozenset((CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED))
_CANCELLED = frozenset((CANCELLED, CANCELLED_AND_NOTIFIED))
_OPEN = frozenset((PENDING, RUNNING))
# Reentrant, as the stdlib's per-future conditions are: a signal handler may complete
# a future while the main thread is inside a transition.
_lock = threading.RLock()


def _after_fork_in_child() -> None:
    # A fork taken while another thread held the lock would leave it held for good.
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _MadeOnUse:
    """A class attribute standing for ``_condition``, ``_waiters`` and ``_done_callbacks``
    until a future has them: the first read of any makes all three, under the lock,
    as instance attributes (which from then on hide this non-data descriptor)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, f: PoolFuture | None, owner: type) -> Any:
        if f is None:
            return self
        with _lock:
            if not f._has_condition:
                f._condition = threading.Condition()
                f._waiters = []
                f._done_callbacks = []
                f._has_condition = True  # last: the fast paths read it under the lock
        return getattr(f, self.name)


class PoolFuture(Future):
    """A ``concurrent.futures.Future`` whose condition is made on first use (module docstring)."""

    _condition = _MadeOnUse()
    _waiters = _MadeOnUse()
    _done_callbacks = _MadeOnUse()
    _has_condition = False

    def __init__(self) -> None:  # pylint: disable=super-init-not-called  (the point)
        # Future.__init__'s attributes but the three made on use (tests/test_pool_futures.py
        # checks the list against the running Python's).  No instance __dict__ is read:
        # that would make a dict object for each future, for the cyclic GC to track.
        self._state = PENDING
        self._result: Any = None
        self._exception: BaseException | None = None

    def set_running_or_notify_cancel(self) -> bool:
        with _lock:
            if not self._has_condition and self._state == PENDING:
                self._state = RUNNING
                return True
        return super().set_running_or_notify_cancel()

    def set_result(self, result: Any) -> None:
        with _lock:
            if not self._has_condition and self._state in _OPEN:
                self._result = result
                self._state = FINISHED
                return  # no waiter, no callback: nobody to tell
        super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        with _lock:
            if not self._has_condition and self._state in _OPEN:
                self._exception = exception
                self._state = FINISHED
                return
        super().set_exception(exception)

    def result(self, timeout: float | None = None) -> Any:
        if self._state == FINISHED:
            if self._exception is not None:
                try:
                    raise self._exception
                finally:
                    self = None  # type: ignore[assignment]  # the stdlib's: no cycle via the traceback
            return self._result
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._state == FINISHED:
            return self._exception
        return super().exception(timeout)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The stdlib's Future refuses (its lock does not pickle); so does one without it yet.
        raise TypeError(f"cannot pickle {type(self).__name__!r} object")

    # One read of one attribute each: the condition would add nothing.
    def done(self) -> bool:
        return self._state in _DONE

    def cancelled(self) -> bool:
        return self._state in _CANCELLED

    def running(self) -> bool:
        return self._state == RUNNING
