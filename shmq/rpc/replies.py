"""A serving process's side of its callers' reply queues: attach, put, forget.

Each caller process has one reply queue (an anonymous :class:`shmq.Queue`,
see :mod:`shmq.rpc.client`); a worker attaches to it on the first reply
(never creating one: a queue that is gone means a caller that is gone),
keeps up to :data:`HANDLES` of them open (least recently used closed
first), and answers a batch of calls with one put per caller (one wake-up).
A reply that cannot be sent (unpicklable, beyond the queue's ceiling) is
answered with a ``ReplyError`` instead, so that the caller never waits for
it.  A caller whose process is gone has its queue removed here too (its
resource tracker normally does; this covers a tracker killed with it):
right after a reply, unless the caller was found alive moments before
(``check=False``), and for every open queue once per :data:`SWEEP_S`.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Any

from ..errors import ShmqError
from ..queue import Queue
from ..spool import Spool
from .wire import ERR, OK, error_tuple

__all__ = ["Replies", "caller_alive"]

log = logging.getLogger("shmq.service")

#: Reply queues a worker keeps open.
HANDLES = 256
#: Removed queues (their caller exited) are closed this often.
SWEEP_S = 1.0


def caller_alive(word: int) -> bool:
    """False if the caller's process is gone (the pid in its identity word); True if
    unsure.  0.5 us: ``kill(pid, 0)``."""
    try:
        os.kill(word & 0xFFFFFFFF, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, TypeError, ValueError):
        pass
    return True


class Replies:
    """The reply queues one serving process writes to (``trusted``: the trust rule of
    docs/security.md for queues another user owns; ``where`` names the service in logs)."""

    def __init__(self, where: str, trusted: bool) -> None:
        self.where = where
        self.trusted = trusted
        self._queues: OrderedDict[str, Queue] = OrderedDict()  # path -> attached queue, LRU
        self._callers: dict[str, int] = {}  # path -> the identity word of its caller
        self._next_sweep = 0.0

    def send(self, path: Any, caller: int, items: list[tuple[int, int, Any]]) -> set[int]:
        """Put the ``(call id, status, value)`` replies into the queue at ``path`` in one
        batch; return the indices of those answered with an error the handler did not
        raise (a ``ReplyError``: they could not be sent as they were).  Nothing is sent
        if the queue is gone (its caller is)."""
        q = self._queue(path, caller)
        failed: set[int] = set()
        if q is None:
            return failed
        try:
            if len(items) == 1:
                q.put(items[0])  # the core's whole put
            else:
                q.put_many(items)
        except Exception:  # noqa: BLE001  (unpicklable, or too large: say so, one by one)
            failed = {i for i, item in enumerate(items) if not self._put_one(q, *item)}
        self._check(path, caller)
        return failed

    def send_bundle(self, path: Any, caller: int, first: int, statuses: bytearray,
                    values: list[Any], service_ns: int, check: bool = True) -> int:
        """Put a bundle's replies (call ids ``first`` onwards) as one item (see
        :mod:`shmq.rpc.wire`), or one by one if they cannot go together; return how
        many calls were answered with an error.  ``check=False``: the caller was
        found alive moments ago, do not look it up again now (the sweep will)."""
        q = self._queue(path, caller)
        failed = statuses.count(ERR)
        if q is None:
            return failed
        try:
            q.put((first, bytes(statuses), values, service_ns))
        except Exception:  # noqa: BLE001  (unpicklable, or too large: say so, one by one)
            failed = 0
            for cid, st, v in zip(range(first, first + len(values)), statuses, values):
                failed += not self._put_one(q, cid, st, v) or st != OK
        if check:
            self._check(path, caller)
        return failed

    def _put_one(self, q, cid, status, value):
        """One reply; one that cannot be sent is answered with a ``ReplyError``.
        Returns False if what was sent is an error the handler did not raise."""
        try:
            q.put((cid, status, value))
            return True
        except Exception as exc:  # noqa: BLE001  unpicklable, or beyond the reply queue's ceiling
            if status == OK:
                err = error_tuple(exc)
                msg = f"the reply could not be sent: {err[0]}: {err[1]}"
                try:
                    q.put((cid, ERR, ("ReplyError", msg, err[2])))
                except Exception:  # noqa: BLE001
                    log.exception("%s: reply to call %d lost", self.where, cid)
            else:
                log.exception("%s: error reply to call %d lost", self.where, cid)
            return False

    def _queue(self, path, caller):
        q = self._queues.get(path)
        if q is not None:
            self._queues.move_to_end(path)
            return q
        if not isinstance(path, str):
            return None
        try:
            q = _attach_queue(path, self.trusted)
        except FileNotFoundError:
            return None  # the caller is gone and its queue removed: nobody to answer
        self._queues[path] = q
        self._callers[path] = caller
        if len(self._queues) > HANDLES:
            p, old = self._queues.popitem(last=False)
            self._callers.pop(p, None)
            old.close()
        return q

    def _check(self, path, caller):
        """A caller whose pid is gone: remove its reply queue."""
        if not caller_alive(caller):
            self._forget(path, destroy=True)

    def _forget(self, path, destroy):
        self._callers.pop(path, None)
        q = self._queues.pop(path, None)
        if q is not None:
            q.close()
        if destroy:
            try:
                Spool.destroy(path)
            except (FileNotFoundError, ShmqError):
                pass

    def sweep_due(self) -> None:
        """Once per :data:`SWEEP_S`: close queues that were removed (their caller
        exited), and remove those whose caller's process is gone."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_S
        for path in list(self._queues):
            if not os.path.lexists(path):
                self._forget(path, destroy=False)
            elif not caller_alive(self._callers[path]):
                self._forget(path, destroy=True)

    def close(self) -> None:
        for q in self._queues.values():
            q.close()
        self._queues.clear()
        self._callers.clear()


def _attach_queue(path, trusted):
    """Attach to an existing reply queue (never create one).

    :raises FileNotFoundError: it is gone.
    """
    q = Queue.__new__(Queue)
    q.__setstate__({"path": path, "trusted": trusted})  # what unpickling a Queue does
    return q
