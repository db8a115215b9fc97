"""Waiting: stdlib-style ``(block, timeout)`` arguments, and retries around a stuck lock.

One home for what every blocking call shares: the validation of its
timeout, and the loop that waits for a recoverable lock's holder, breaking
the lock when the holder died.  The sleeping itself is the doorbells'
(:mod:`shmq._notify`).
"""

from __future__ import annotations

import time

from ._lock import FIRST_LOOK_S

__all__ = ["check_block_timeout", "first_look", "retry_stuck", "retry_async"]


def check_block_timeout(block, timeout):
    """Validate a stdlib-style (block, timeout) pair; return the timeout to use (0: do not wait).

    :raises TypeError: timeout is not a number.
    :raises ValueError: NaN or negative.
    """
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout must be a number or None, not {type(timeout).__name__}")
        if timeout != timeout:
            raise ValueError("timeout must not be NaN")
        if timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
    return timeout if block else 0


async def retry_async(attempt, retry_on, bell, ready, timeout, before_wait=None):
    """``attempt()`` until it does not raise ``retry_on``; return its result.

    Between attempts, awaits ``bell`` (a :class:`shmq._notify.Doorbell`: the
    event loop parks on its inotify fd) until the predicate ``ready()``
    returned right after the failed attempt holds, calling ``before_wait()``
    first if given.  ``timeout`` bounds the whole call (None: forever); once
    it has passed, the last ``retry_on`` error propagates.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            return attempt()
        except retry_on:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise
            check = ready()  # taken after the failed attempt: no change is missed
        if before_wait is not None:
            before_wait()
        await bell.wait_async(check, left)


def first_look(lock):
    """The wait of a first attempt at ``lock``'s holder (what :func:`retry_stuck` passes
    first): short, so that a dead holder is noticed soon."""
    return min(lock.recovery_timeout, FIRST_LOOK_S)


_NOT_YET = object()


def retry_stuck(call, lock, limit, is_stuck, on_timeout, first=_NOT_YET):
    """``call(wait)`` until its result is not ``is_stuck``; return that result.

    ``call`` tries to take ``lock`` (a :class:`shmq._lock.RecoverableLock`) for at
    most ``wait`` seconds.  Each time it reports the lock stuck, a dead
    holder's lock is recovered and the call retried, until ``limit`` (a
    ``time.monotonic()`` deadline, None: never) passes; then ``on_timeout()``
    is called and must raise.  A live holder is never broken.  ``first``: the
    result of a first call its caller made already, with :func:`first_look`'s
    wait (a fast path that found the lock stuck): it counts as this loop's first.
    """
    rt = lock.recovery_timeout
    period = min(rt, FIRST_LOOK_S)  # the first look comes soon (see FIRST_LOOK_S)
    out = first
    while True:
        if out is _NOT_YET:
            wait = period if limit is None else max(0.0, min(period, limit - time.monotonic()))
            out = call(wait)
        period = rt
        if not is_stuck(out):
            return out
        out = _NOT_YET
        # Recover before giving up: a caller whose timeout is shorter than the
        # recovery timeout would otherwise never break a dead holder's lock.
        if lock.recover_if_dead():
            continue
        if limit is not None and time.monotonic() >= limit:
            on_timeout()
