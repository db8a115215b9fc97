"""Group members: competing consumers of one named cursor (see :class:`GroupReader`).

A group's cursor lives in its slot of the spool's reader table and is
advanced under the group's recoverable lock (a named semaphore; the engine's
takes hold it for the copy only), so each frame goes to exactly one member,
also across threads of one process.  The reader machinery itself (waiting,
the columnar reads, the slot's liveness lock) is :mod:`shmq.reader`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from . import _format as F
from ._lock import RecoverableLock
from ._mapping import group_sem_name
from .errors import Empty
from .reader import K_GROUP, Frame, Reader, SlotReader, check_max_frames, reattach
from .waiting import check_block_timeout, first_look, retry_stuck

if TYPE_CHECKING:
    from .spool import Spool

__all__ = ["GroupReader"]


class GroupReader(SlotReader):
    """A competing consumer in a named group; see :meth:`shmq.Spool.reader`.

    The group's cursor is advanced under a recoverable lock held (in C) for
    the copy only; each frame goes to exactly one member, also across
    threads of one process.  A member killed while holding the lock loses at
    most the frames it was taking (one for ``get``, up to ``max_frames``
    for ``get_many``), and the others resume within the lock-recovery
    timeout.
    """

    _slot_state = F.SLOT_GROUP
    _kind = K_GROUP
    shared = True

    def __init__(self, spool: Spool, name: str, *, start: str | int = "earliest",
                 verify: bool = False) -> None:
        super().__init__(spool, name, start=start, verify=verify)
        try:
            spool.ring.check_cursor(name, *spool.slots.cursor(self._slot))
            self._lock = self._make_lock()
            # the group's name, if created on a destroyed spool, must not outlive it
            spool.mapping.forget_semaphores_if_unlinked(spool.sem_prefix)
        except BaseException:
            self.close()
            raise

    def _lock_name(self) -> str:
        name = group_sem_name(self._spool.sem_prefix, self._slot)
        # create it on the group's first use; one another user squatted is refused
        self._spool.open_semaphore(name, 1).close()
        return name

    def _make_lock(self) -> RecoverableLock:
        sp = self._spool
        sem = sp.open_semaphore(group_sem_name(sp.sem_prefix, self._slot), 1)
        w = self._slot * F.SLOT_WORDS
        return RecoverableLock(sem, sp.slots.words, w + F.S_LOCK_HOLDER, w + F.S_LOCK_TOKEN,
                               sp.mapping, sp.slots.byte(self._slot, F.SLOT_RECOVERY_BYTE),
                               recovery_timeout=sp.recovery_timeout)

    def _initial_cursor(self, start: str | int) -> tuple[int, int]:
        return 0, 0  # the cursor lives in the slot

    @property
    def position(self) -> int:
        return self._spool.slots.word(self._slot, F.S_SEQ)

    @property
    def lock(self) -> RecoverableLock:
        """The group's :class:`shmq._lock.RecoverableLock` (the work queue runs its
        state changes under it)."""
        return self._lock

    def _locked(self, call: Callable[[float], Any], timeout: float | None, first: Any = None) -> Any:
        """Run a core call that takes the group lock; recover a dead holder's lock.

        Even a non-blocking get waits for a member that is copying
        (microseconds), up to the recovery timeout; a stuck live holder
        surfaces as Empty, as multiprocessing.Queue's busy read lock does.
        ``first``: the stuck status a first call (waiting ``first_look``) returned.
        """
        limit = None if timeout is None else time.monotonic() + max(timeout, self._lock.recovery_timeout)
        if first is None:
            return retry_stuck(call, self._lock, limit, _is_int, _group_stuck)
        return retry_stuck(call, self._lock, limit, _is_int, _group_stuck, first)

    def take(self, copy: bool, timeout: float | None) -> tuple[int, Any, int, int | None] | None:
        """See :meth:`Reader.take`: here under the group's lock, which is held for the copy
        (or the pin) only."""
        if copy:
            f = self._locked(self._cur.get, timeout)
            return (f[0], f[2], f.codec, None) if f is not None else None
        sp, slots, i = self._spool, self._spool.slots, self._slot
        lock = self._lock
        try:  # the try covers the acquire: no signal can land between the two
            lock.acquire(None if timeout is None else max(timeout, lock.recovery_timeout))
            seq, pos = slots.cursor(i)
            if seq >= sp.ring.next_seq:
                return None
            got = sp.pins.read(seq, pos)
            if got is None:
                frame, nseq, npos, lost, codec = sp.ring.read(seq, pos)
                slots.set_cursor(i, nseq, npos)
                if lost:
                    slots.set_word(i, F.S_LOST, slots.word(i, F.S_LOST) + lost)
                return None if frame is None else (frame[0], frame[2], codec, None)
            view, codec, fpos, npos = got
            slots.set_cursor(i, seq + 1, npos)
            return seq, view, codec, fpos
        finally:
            lock.release_if_held()

    def _get_frames(self, max_frames: int, block: bool, timeout: float | None) -> list[Frame]:
        return self._take_many(self._cur.get_many, max_frames, block, timeout)

    def get_objects(self, max_items: int = 100, block: bool = True, timeout: float | None = None, *,
                    unpickle: bool = False) -> list[Any] | tuple[list[Any], list[int]]:
        """:meth:`get_many` for ``shmq.Queue``: the payloads themselves, in one core call
        and without a :class:`Frame` per item: raw payloads as they are and, with
        ``unpickle=True``, in-band pickles unpickled after the group lock is released.
        Pass ``unpickle=True`` only for a spool whose trust was checked (``shmq.Queue``
        checks at attach): unpickling what another user wrote runs their code.
        Returns a list, or ``(list, indices)`` when other frames were taken (other
        codecs, or pickles without ``unpickle``): those entries are Frames, for the
        caller's decoder.  What is returned is taken (committed), as with get_many.

        :raises shmq.Empty: nothing arrived in time.
        """
        return self._take_many(lambda n, wait: self._cur.get_obj_many(n, wait, unpickle),
                               max_items, block, timeout)

    def _take_many(self, take: Callable[[int, float], Any], max_frames: int, block: bool,
                   timeout: float | None) -> Any:
        check_max_frames(max_frames)
        if timeout is not None or not block:
            timeout = check_block_timeout(block, timeout)
        deadline = None
        while True:
            # One core call in the common case (the lock free, or freed within the
            # first look); only a stuck lock goes through the recovery loop.
            out = take(max_frames, first_look(self._lock))
            if type(out) is int:
                out = self._locked(lambda wait: take(max_frames, wait), timeout, out)
            if out:
                return out
            deadline = self.wait(timeout, deadline)

    @property
    def lost(self) -> int:
        """Frames the group skipped because they were overwritten (shared by all members)."""
        return self._spool.slots.word(self._slot, F.S_LOST)

    def flush_stats(self) -> None:
        if not self._closed and not self._spool.closed and self._cur.pending:
            self._locked(lambda wait: None if self._cur.flush(wait) else 0, None)

    def seek(self, where: str | int) -> None:
        """Move the group's shared cursor (affects every member)."""
        self.check()
        seq, pos = self._spool.ring.cursor_for(where)
        with self._lock:
            self._spool.slots.set_cursor(self._slot, seq, pos)

    def _set_cursor(self, seq: int, pos: int) -> NoReturn:
        raise NotImplementedError  # the cursor lives in the slot: use seek()

    def cursor(self) -> tuple[int, int]:
        """The group's shared cursor ``(seq, pos)`` (another member may move it at once)."""
        return self._spool.slots.cursor(self._slot)

    def close(self) -> None:
        if not self._closed and getattr(self, "_lock", None) is not None:
            self.flush_stats()
            self._lock.close()
            self._lock.sem.close()
        super().close()

    def after_fork_in_child(self) -> None:
        # Group members may be shared with fork children: the cursor is in
        # the spool, so the child only needs its own liveness lock.  The
        # parent's unflushed counters stay the parent's.
        self._cur.reset_stats()
        sp = self._spool
        if getattr(self, "_lock", None) is not None:
            self._lock.set_holder(sp.holder)
        if not sp.slots.relock(self._slot):
            self._closed = True
            self._cur.close("could not re-attach group member after fork")

    def __reduce__(self) -> tuple[Callable[..., Reader], tuple[Any, ...]]:
        return (reattach, (self._spool, self.name, True, None, self._verify))


def _is_int(out: object) -> bool:
    return type(out) is int


def _group_stuck() -> NoReturn:
    raise Empty("the group's lock is held by a live member that does not release it")
