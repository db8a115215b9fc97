"""Readers: cursors over a spool's ring.

* :class:`Reader` - anonymous: a private cursor, lock-free, never holds writers back.
* :class:`NamedReader` - durable: its committed cursor lives in the spool's
  reader table, survives restarts, and (``on_full="block"``/``"error"``)
  keeps writers from overwriting what it has not consumed.
* :class:`GroupReader` - a member of a named group: the cursor is shared and
  advanced under the group's recoverable lock, so each frame goes to exactly
  one member (at most once if a member dies holding it).

The cursor itself is a :class:`shmq._core.Cursor`: reading, the seqlock
check, loss counting, commits and statistics run in C in one call, which is
atomic for other threads and for signal handlers.  This module keeps
blocking (the spool's doorbells), validation and lifecycle.
"""

from __future__ import annotations

import os
import time

from . import _core
from . import _format as F
from ._format import W_NEXT_SEQ
from ._lock import RecoverableLock, ofd_lock, ofd_unlock
from ._mapping import group_sem_name, open_semaphore
from .errors import Empty, ReaderBusy
from .spool import Frame, check_block_timeout

__all__ = ["Reader", "NamedReader", "GroupReader"]

#: A named reader publishes its counters to the reader table this often
#: (frames, in the core), and whenever it blocks, commits explicitly or closes.
STATS_FLUSH_FRAMES = 64
_K_ANON, _K_NAMED, _K_GROUP = 0, 1, 2


def _check_max_frames(max_frames):
    if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 1:
        raise ValueError(f"max_frames must be a positive int, not {max_frames!r}")


class Reader:
    """An anonymous reader: a private cursor; see :meth:`shmq.Spool.reader`.

    Thread-safe: each ``get``/``get_many`` is one atomic step, so threads
    sharing a reader never receive the same frame twice.
    """

    name = None
    _slot = None
    _kind = _K_ANON

    def __init__(self, spool, *, start="earliest", verify=False):
        self._spool = spool
        self._verify = verify
        self._closed = False
        seq, pos = self._initial_cursor(start)
        self._cur = _core.Cursor(spool._core, self._kind, -1 if self._slot is None else self._slot,
                                 seq, pos, self._auto_commit(), bool(verify), self._lock_name())
        self._cur.bind(self)
        # A frame in one C call; it hands waiting and recovery to _get_slow.
        self.get = self._cur.get_api
        spool._readers.add(self)

    def _initial_cursor(self, start):
        return self._spool._cursor_for(start)

    def _auto_commit(self):
        return False

    def _lock_name(self):
        return None

    # -- state ----------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def position(self) -> int:
        """Seq of the next frame this reader will return."""
        return self._cur.seq

    @property
    def lost(self) -> int:
        """Frames this reader skipped because they were overwritten first (exact)."""
        return self._cur.lost

    @property
    def lag(self) -> int:
        """Committed frames not yet read by this reader."""
        self._check()
        return max(0, self._spool._ctl[W_NEXT_SEQ] - self.position)

    def _check(self):
        if self._closed:
            self._cur.get()  # raises ValueError with the reason it was closed
            raise ValueError("reader is closed")

    def _available(self):
        return self._cur.available()

    # -- reading --------------------------------------------------------

    def get(self, block=True, timeout=None):
        """Return the next frame as ``shmq.Frame(seq, timestamp_ns, data)``.

        Blocks (without spinning, beyond a few microseconds) until a frame is
        committed, for at most ``timeout`` seconds (None: forever).  Frames
        overwritten before this reader got to them are skipped and counted
        in :attr:`lost`.

        :raises shmq.Empty: nothing arrived in time (or ``block=False``).
        :raises ValueError: the reader is closed.
        """
        f = self._cur.get()  # the whole read, in C
        if type(f) is Frame:
            return f
        return self._get_slow(block, timeout, f)

    def _get_slow(self, block, timeout, f):
        if timeout is not None or not block:
            timeout = check_block_timeout(block, timeout)
        deadline = None
        while True:
            if type(f) is Frame:
                return f
            deadline = self._wait(timeout, deadline)
            f = self._cur.get()

    def _wait(self, timeout, deadline):
        """Park until the cursor has something to read; return the deadline; raise Empty."""
        if timeout == 0:
            raise Empty("no frame available")
        now = time.monotonic()
        if deadline is None and timeout is not None:
            deadline = now + timeout
        self._before_wait()
        left = None if deadline is None else deadline - now
        if left is not None and left <= 0 or not self._spool._data_bell.wait(self._cur.available, left):
            raise Empty(f"no frame within {timeout} s")
        return deadline

    def get_many(self, max_frames=100, block=True, timeout=None, as_array=False):
        """Return a list of 1..``max_frames`` frames, blocking only for the first.

        ``as_array=True`` (record-stream mode): concatenate up to
        ``max_frames`` consecutive numpy frames of one dtype into one array.

        :raises shmq.Empty: nothing arrived in time.
        """
        if as_array:
            from .columnar import get_records

            return get_records(self, max_frames, block, timeout)
        _check_max_frames(max_frames)
        out = self._cur.get_many(max_frames)
        if type(out) is list and out:
            return out
        if timeout is not None or not block:
            timeout = check_block_timeout(block, timeout)
        deadline = None
        while True:
            deadline = self._wait(timeout, deadline)
            out = self._cur.get_many(max_frames)
            if type(out) is list and out:
                return out

    async def get_async(self, timeout=None):
        """``await`` the next frame: the event loop watches the same inotify fd.

        :raises shmq.Empty: nothing arrived within ``timeout``.
        """
        self._check()
        timeout = check_block_timeout(True, timeout)
        loop_deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self.get(block=False)
            except Empty:
                pass
            left = None if loop_deadline is None else loop_deadline - time.monotonic()
            if left is not None and left <= 0:
                raise Empty(f"no frame within {timeout} s")
            self._before_wait()
            if not await self._spool._data_bell.wait_async(self._cur.available, left):
                raise Empty(f"no frame within {timeout} s")

    def __iter__(self):
        """Blocking iteration: yields frames forever (until the reader is closed)."""
        while not self._closed:
            yield self.get()

    def get_array(self, block=True, timeout=None, copy=True):
        """The next frame as a numpy array (it must be a numpy frame).

        ``copy=True``: a writable array over one private copy.  ``copy=False``:
        a :class:`shmq.columnar.PinnedView` whose ``.array`` is a read-only
        view into the spool; the frame is not overwritten until it is
        released (``with r.get_array(copy=False) as v: ...``).

        :raises shmq.Empty: nothing arrived in time.
        :raises shmq.ShmqError: the frame is not a numpy frame (it is consumed).
        """
        from .columnar import get_array

        return get_array(self, block, timeout, copy)

    def get_arrow(self, block=True, timeout=None, copy=True):
        """The next frame as a pyarrow Table (zero-copy over the mapping with ``copy=False``,
        as a PinnedView); see :meth:`get_array`."""
        from .columnar import get_arrow

        return get_arrow(self, block, timeout, copy)

    def seek(self, where) -> None:
        """Move the cursor to "earliest", "latest" or a seq (the next frame returned).

        :raises shmq.FrameLost: that seq was already overwritten.
        :raises ValueError: a seq beyond the next one to be written.
        """
        self._check()
        self._set_cursor(*self._spool._cursor_for(where))

    def _set_cursor(self, seq, pos):
        self._cur.pos = pos
        self._cur.seq = seq

    def _get_cursor(self):
        return self._cur.seq, self._cur.pos

    def _advanced(self, seq, pos):
        """The cursor moved past frames read outside the core (zero-copy columnar reads)."""
        self._set_cursor(seq, pos)

    def commit(self) -> None:
        """Persist the position (anonymous readers have nothing to persist)."""
        self._check()

    # -- hooks for subclasses --------------------------------------------

    def _count_lost(self, n):
        self._cur.add_lost(n)

    def _before_wait(self):
        pass

    def _flush_stats(self):
        pass

    def _after_fork_in_child(self):
        pass

    # -- lifecycle --------------------------------------------------------

    def close(self) -> None:
        """Detach the reader. Idempotent."""
        if not self._closed:
            self._closed = True
            self._cur.close()
            self._spool._readers.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        return (_reattach, (self._spool, None, False, self._cur.seq, self._verify))

    def __repr__(self):
        return f"<shmq.{type(self).__name__} {self.name!r} at seq {self.position}>"


class _SlotReader(Reader):
    """A reader bound to a slot of the spool's reader table."""

    _kind = _K_NAMED
    _slot_state = F.SLOT_READER

    def __init__(self, spool, name, *, start="earliest", verify=False):
        self.name = name
        self._slot = None
        slot = spool._attach_slot(name, self._slot_state, start)
        self._attach(spool, slot)
        self._slot = slot
        self._w = slot * F.SLOT_WORDS
        try:
            super().__init__(spool, start=start, verify=verify)
        except BaseException:
            self._detach(spool)
            raise

    def _attach(self, spool, slot):
        refs = spool._slot_refs
        exclusive = self._slot_state == F.SLOT_READER
        w = slot * F.SLOT_WORDS
        if exclusive and refs.get(slot):
            raise ReaderBusy(f"reader {self.name!r} is already attached through this handle")
        if not refs.get(slot):
            # OFD locks are per open file description: one lock per handle,
            # reference-counted for several group members in one handle.
            if not ofd_lock(spool._map.fd, spool._slot_byte(slot, F.SLOT_LIVE_BYTE), exclusive=exclusive):
                raise ReaderBusy(f"reader {self.name!r} of {spool.path} is attached by another "
                                 f"process (pid {spool._slots[w + F.S_PID]})")
        refs[slot] = refs.get(slot, 0) + 1
        spool._slots[w + F.S_PID] = os.getpid()

    def _detach(self, spool):
        refs = spool._slot_refs
        slot = self._slot
        if slot is None or not refs.get(slot):
            return
        refs[slot] -= 1
        if not refs[slot]:
            del refs[slot]
            if spool._map.mm is not None:
                ofd_unlock(spool._map.fd, spool._slot_byte(slot, F.SLOT_LIVE_BYTE))

    @property
    def lost(self) -> int:
        """Frames skipped because they were overwritten before being read.

        While attached: the name's cumulative count stored in the spool.
        After close: the count of this attachment only.
        """
        if self._closed:
            return self._cur.lost
        self._flush_stats()
        return self._spool._slots[self._w + F.S_LOST]

    def _before_wait(self):
        self._flush_stats()

    def close(self) -> None:
        if self._closed:
            return
        self._flush_stats()
        self._detach(self._spool)
        super().close()

    def _after_fork_in_child(self):
        # Only the attaching process owns the cursor; the fork child's copy
        # of this object is closed (open a new reader in the child).
        self._closed = True
        self._cur.close(f"reader {self.name!r} belongs to the process that created it "
                        "(pid before fork); open a new reader in this process")
        self._spool._slot_refs.pop(self._slot, None)


class NamedReader(_SlotReader):
    """A durable named reader; see :meth:`shmq.Spool.reader`.

    With ``auto_commit=True`` (default) every returned frame is committed
    at once (a crash loses nothing and repeats nothing).  With
    ``auto_commit=False`` the position is persisted only by :meth:`commit`:
    after a crash, frames read since the last commit are delivered again.
    """

    def __init__(self, spool, name, *, start="earliest", auto_commit=True, verify=False):
        self._auto = auto_commit
        super().__init__(spool, name, start=start, verify=verify)

    def _auto_commit(self):
        return bool(self._auto)

    def _initial_cursor(self, start):
        sp = self._spool
        seq, pos = sp._slots[self._w + F.S_SEQ], sp._slots[self._w + F.S_POS]
        sp._check_cursor(self.name, seq, pos)
        return seq, pos

    @property
    def committed(self) -> int:
        """The position stored in the spool (where a restart resumes)."""
        return self._spool._slots[self._w + F.S_SEQ]

    def _flush_stats(self):
        if not self._closed:
            self._cur.flush()

    def _advanced(self, seq, pos):
        self._set_cursor(seq, pos)
        if self._auto:
            self._cur.commit()

    def commit(self) -> None:
        """Persist the current position in the spool (two aligned stores: position,
        then seq; a crash between them is repaired on the next read)."""
        self._check()
        self._cur.commit()

    def seek(self, where) -> None:
        super().seek(where)
        if self._auto:
            self.commit()

    def __reduce__(self):
        return (_reattach, (self._spool, self.name, False, None, self._verify, self._auto))


class GroupReader(_SlotReader):
    """A competing consumer in a named group; see :meth:`shmq.Spool.reader`.

    The group's cursor is advanced under a recoverable lock held (in C) for
    the copy only; each frame goes to exactly one member, also across
    threads of one process.  A member killed while holding the lock loses at
    most the frames it was taking (one for ``get``, up to ``max_frames``
    for ``get_many``), and the others resume within the lock-recovery
    timeout.
    """

    _slot_state = F.SLOT_GROUP
    _kind = _K_GROUP

    def __init__(self, spool, name, *, start="earliest", verify=False):
        super().__init__(spool, name, start=start, verify=verify)
        w = self._w
        try:
            spool._check_cursor(name, spool._slots[w + F.S_SEQ], spool._slots[w + F.S_POS])
            self._lock = self._make_lock()
        except BaseException:
            self.close()
            raise

    def _lock_name(self):
        sp = self._spool
        name = group_sem_name(sp._sem_prefix, self._slot)
        # create it on the group's first use; one another user squatted is refused
        open_semaphore(name, 1, sp._sem_mode, owner=sp._map.st_uid, group=sp._map.st.st_gid).close()
        return name

    def _make_lock(self):
        sp = self._spool
        sem = open_semaphore(group_sem_name(sp._sem_prefix, self._slot), 1, sp._sem_mode,
                             owner=sp._map.st_uid, group=sp._map.st.st_gid)
        w = self._w
        return RecoverableLock(sem, sp._slots, w + F.S_LOCK_HOLDER, w + F.S_LOCK_TOKEN, sp._map,
                               sp._slot_byte(self._slot, F.SLOT_RECOVERY_BYTE),
                               recovery_timeout=sp._recovery_timeout)

    def _initial_cursor(self, start):
        return 0, 0  # the cursor lives in the slot

    @property
    def position(self) -> int:
        return self._spool._slots[self._w + F.S_SEQ]

    def _locked(self, call, timeout):
        """Run a core call that takes the group lock; recover a dead holder's lock.

        Even a non-blocking get waits for a member that is copying
        (microseconds), up to the recovery timeout; a stuck live holder
        surfaces as Empty, as multiprocessing.Queue's busy read lock does.
        """
        rt = self._spool._recovery_timeout
        limit = None if timeout is None else time.monotonic() + max(timeout, rt)
        while True:
            wait = rt if limit is None else max(0.0, min(rt, limit - time.monotonic()))
            out = call(wait)
            if type(out) is not int:
                return out
            if limit is not None and time.monotonic() >= limit:
                raise Empty("the group's lock is held by a live member that does not release it")
            self._lock.recover_if_dead()

    def get(self, block=True, timeout=None):
        f = self._cur.get()
        if type(f) is Frame:
            return f
        return self._get_slow(block, timeout, f)

    def _get_slow(self, block, timeout, f):
        if timeout is not None or not block:
            timeout = check_block_timeout(block, timeout)
        deadline = None
        while True:
            if type(f) is int:
                f = self._locked(self._cur.get, timeout)
                if f is not None:
                    return f
            elif f is not None:
                return f
            deadline = self._wait(timeout, deadline)
            f = self._cur.get()

    def get_many(self, max_frames=100, block=True, timeout=None, as_array=False):
        if as_array:
            from .columnar import get_records

            return get_records(self, max_frames, block, timeout)
        _check_max_frames(max_frames)
        if timeout is not None or not block:
            timeout = check_block_timeout(block, timeout)
        deadline = None
        while True:
            out = self._locked(lambda wait: self._cur.get_many(max_frames, wait), timeout)
            if out:
                return out
            deadline = self._wait(timeout, deadline)

    @property
    def lost(self) -> int:
        """Frames the group skipped because they were overwritten (shared by all members)."""
        return self._spool._slots[self._w + F.S_LOST]

    def _flush_stats(self):
        if not self._closed and self._spool._mm is not None and self._cur.pending:
            self._locked(lambda wait: None if self._cur.flush(wait) else 0, None)

    def seek(self, where) -> None:
        """Move the group's shared cursor (affects every member)."""
        self._check()
        seq, pos = self._spool._cursor_for(where)
        with self._lock:
            self._spool._slots[self._w + F.S_POS] = pos
            self._spool._slots[self._w + F.S_SEQ] = seq

    def _set_cursor(self, seq, pos):
        raise NotImplementedError  # the cursor lives in the slot: use seek()

    def _get_cursor(self):
        return self._spool._slots[self._w + F.S_SEQ], self._spool._slots[self._w + F.S_POS]

    def close(self) -> None:
        if not self._closed and getattr(self, "_lock", None) is not None:
            self._flush_stats()
            self._lock.close()
            self._lock.sem.close()
        super().close()

    def _after_fork_in_child(self):
        # Group members may be shared with fork children: the cursor is in
        # the spool, so the child only needs its own liveness lock.  The
        # parent's unflushed counters stay the parent's.
        self._cur.reset_stats()
        sp = self._spool
        if getattr(self, "_lock", None) is not None:
            self._lock.set_holder(sp._holder)
        if not ofd_lock(sp._map.fd, sp._slot_byte(self._slot, F.SLOT_LIVE_BYTE), exclusive=False):
            self._closed = True
            self._cur.close("could not re-attach group member after fork")

    def __reduce__(self):
        return (_reattach, (self._spool, self.name, True, None, self._verify))


def _reattach(spool, name, group, seq, verify, auto_commit=True):
    if name is None:
        return spool.reader(start=seq, verify=verify)
    if group:
        return spool.reader(name, group=True, verify=verify)
    return spool.reader(name, auto_commit=auto_commit, verify=verify)
