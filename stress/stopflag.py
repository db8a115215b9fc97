"""A stop flag that processes the harness SIGKILLs can poll.

``multiprocessing.Event.is_set()`` takes the event's condition lock (a
semaphore).  A process killed while inside it leaves that lock taken for good;
every later ``is_set()`` and the parent's ``set()`` then block forever, which
hung ``soak.py --quick`` in CI.  This flag is one shared byte, read and written
without a lock, so a kill at any instruction leaves it usable.
"""

from __future__ import annotations

import ctypes


class StopFlag:
    """``is_set()``/``set()`` like an Event's, for fork or spawn children; no ``wait``."""

    def __init__(self, ctx) -> None:
        self._v = ctx.RawValue(ctypes.c_ubyte, 0)

    def is_set(self) -> bool:
        return bool(self._v.value)

    def set(self) -> None:
        self._v.value = 1
