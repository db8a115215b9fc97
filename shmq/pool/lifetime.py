"""What becomes of live pools at the interpreter's exit, and in a forked child.

Executors finish their submitted work at exit, as the stdlib's do; pools
(``shmq.Pool``) are terminated; after an uncaught KeyboardInterrupt nothing waits.  A forked child
inherits the hook but none of the pools' threads, so it forgets them.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .engine import Engine


_live: weakref.WeakSet[Engine] = weakref.WeakSet()
_hooked = False
#: Set at the interpreter's exit: pools refuse new work from then on.
exiting = False


def _forget_after_fork() -> None:
    # A forked child (a worker, a zygote, a user's fork) inherits our exit hook and this
    # set, but none of these pools' threads: at its exit it must not wait for them.
    _live.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def watch(engine: Engine) -> None:
    """Have :func:`_at_exit` see ``engine``; hooked at the first pool, like the stdlib's
    executor: before ``atexit``'s callbacks (threading's own exit hooks), so that an
    ``atexit`` callback that submits finds the pools shut."""
    global _hooked
    _live.add(engine)
    if not _hooked:
        _hooked = True
        hook = getattr(threading, "_register_atexit", None)
        try:
            if hook is None:
                raise RuntimeError
            hook(_at_exit)
        except RuntimeError:
            atexit.register(_at_exit)


def _at_exit() -> None:
    """Executors finish their work, as the stdlib's do; pools are terminated.  After an
    uncaught KeyboardInterrupt (Ctrl-C), nothing waits: every pool is terminated."""
    global exiting
    exiting = True
    interrupted = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
    engines = list(_live)
    try:
        for e in engines:
            if interrupted or e.at_exit == "terminate":
                e.terminate()
            else:
                e.close()
        for e in engines:
            e.join()
    finally:  # a second Ctrl-C while waiting: kill them all
        for e in engines:
            if not e.finished.is_set():
                e.terminate()
                e.join(10.0)


def forget(engine: Engine) -> None:
    """``engine`` is finished: nothing to do for it at exit."""
    _live.discard(engine)
