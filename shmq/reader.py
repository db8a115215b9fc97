"""Readers: cursors over a spool's ring.

* :class:`Reader` - anonymous: a private cursor, lock-free, never holds writers back.
* :class:`NamedReader` - durable: its committed cursor lives in the spool's
  reader table, survives restarts, and (``on_full="block"``/``"error"``)
  keeps writers from overwriting what it has not consumed.
* :class:`GroupReader` - a member of a named group: the cursor is shared and
  advanced under the group's recoverable lock, so each frame goes to exactly
  one member (at most once if a member dies holding it).
"""

from __future__ import annotations

import operator
import os
import time

from . import _format as F
from ._format import FLAG_PAD, FRAME, FRAME_BYTES, W_FIRST_POS, W_NEXT_SEQ
from posix_ipc import BusyError

from ._lock import RecoverableLock, ofd_lock, ofd_unlock
from ._mapping import group_sem_name, open_semaphore
from .errors import Empty, ReaderBusy, Timeout
from .spool import Frame, _check_block_timeout

_unpack_frame = FRAME.unpack_from
_second, _third = operator.itemgetter(1), operator.itemgetter(2)
_new_frame = tuple.__new__
_WRITABLE = (F.CODEC_PICKLE_OOB, F.CODEC_NUMPY)  # read into bytearrays by Spool._read

__all__ = ["Reader", "NamedReader", "GroupReader"]

_time_ns = time.time_ns
_LAG_NONE = (1 << 64) - 1
#: A named reader publishes its counters to the reader table this often
#: (frames), and whenever it blocks, commits explicitly or closes.
STATS_FLUSH_FRAMES = 64


def _check_max_frames(max_frames):
    if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 1:
        raise ValueError(f"max_frames must be a positive int, not {max_frames!r}")


def _add(words, i, n):
    """Add to a shared statistics counter, wrapping at 2**64 like a C counter."""
    words[i] = (words[i] + n) & 0xFFFFFFFFFFFFFFFF


class Reader:
    """An anonymous reader: a private cursor; see :meth:`shmq.Spool.reader`.

    Not thread-safe: use one reader per thread.
    """

    name = None
    _slot = None

    def __init__(self, spool, *, start="earliest", verify=False):
        self._spool = spool
        self._verify = verify
        self._closed = False
        self._closed_why = "reader is closed"
        self._lost = 0
        self._seq, self._pos = self._initial_cursor(start)
        spool._readers.add(self)

    def _initial_cursor(self, start):
        return self._spool._cursor_for(start)

    # -- state ----------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def position(self) -> int:
        """Seq of the next frame this reader will return."""
        return self._seq

    @property
    def lost(self) -> int:
        """Frames this reader skipped because they were overwritten first (exact)."""
        return self._lost

    @property
    def lag(self) -> int:
        """Committed frames not yet read by this reader."""
        self._check()
        return max(0, self._spool._ctl[W_NEXT_SEQ] - self._seq)

    def _check(self):
        if self._closed:
            raise ValueError(self._closed_why)

    def _available(self):
        return self._seq < self._spool._ctl[W_NEXT_SEQ]

    # -- reading --------------------------------------------------------

    def get(self, block=True, timeout=None):
        """Return the next frame as ``shmq.Frame(seq, timestamp_ns, data)``.

        Blocks (without spinning, beyond a few microseconds) until a frame is
        committed, for at most ``timeout`` seconds (None: forever).  Frames
        overwritten before this reader got to them are skipped and counted
        in :attr:`lost`.

        :raises shmq.Empty: nothing arrived in time (or ``block=False``).
        """
        if self._closed:
            self._check()
        sp = self._spool
        if block and timeout is None and not self._verify:
            # Fast path, inlined from Spool._read: the frame at the cursor is
            # committed, whole, not a pad, and still not evicted after the copy.
            seq = self._seq
            ctl = sp._ctl
            if seq < ctl[W_NEXT_SEQ]:
                pos = self._pos
                ring = sp._ring
                off = pos % ring
                if ring - off >= FRAME_BYTES:
                    o = sp._base + off
                    mm = sp._mm
                    hseq, stored, length, ts, _crc, flags, _codec, _x = _unpack_frame(mm, o)
                    if (hseq == seq and not flags & FLAG_PAD and off + stored <= ring
                            and stored >= FRAME_BYTES + length):
                        data = mm[o + FRAME_BYTES:o + FRAME_BYTES + length]
                        if ctl[W_FIRST_POS] <= pos:
                            self._seq = seq + 1
                            self._pos = pos + stored
                            frame = _new_frame(Frame, (seq, ts, data))
                            self._consumed(frame)
                            return frame
        elif timeout is not None or not block:
            timeout = _check_block_timeout(block, timeout)
        deadline = None
        while True:
            frame, self._seq, self._pos, lost, _codec = sp._read(self._seq, self._pos, self._verify)
            if lost:
                self._count_lost(lost)
            if frame is not None:
                self._consumed(frame)
                return frame
            deadline = self._wait(timeout, deadline)

    def _wait(self, timeout, deadline):
        """Park until the cursor has something to read; return the deadline; raise Empty."""
        if timeout == 0:
            raise Empty("no frame available")
        now = time.monotonic()
        if deadline is None and timeout is not None:
            deadline = now + timeout
        self._before_wait()
        left = None if deadline is None else deadline - now
        if left is not None and left <= 0 or not self._spool._data_bell.wait(self._available, left):
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
        if self._closed:
            self._check()
        _check_max_frames(max_frames)
        out = [self.get(block, timeout)]
        sp = self._spool
        verify = self._verify
        while len(out) < max_frames:
            n0 = len(out)
            if not verify:
                cur = sp._read_run(self._seq, self._pos, max_frames - n0, out)
                if cur is not None:
                    self._seq, self._pos = cur
                    if len(out) > n0:
                        self._consumed_many(out, n0)
                        continue
            frame, self._seq, self._pos, lost, _codec = sp._read(self._seq, self._pos, verify)
            if lost:
                self._count_lost(lost)
            if frame is None:
                break
            self._consumed(frame)
            out.append(frame)
        return out

    async def get_async(self, timeout=None):
        """``await`` the next frame: the event loop watches the same inotify fd.

        :raises shmq.Empty: nothing arrived within ``timeout``.
        """
        self._check()
        timeout = _check_block_timeout(True, timeout)
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
            if not await self._spool._data_bell.wait_async(self._available, left):
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
        self._seq, self._pos = self._spool._cursor_for(where)

    def commit(self) -> None:
        """Persist the position (anonymous readers have nothing to persist)."""
        self._check()

    # -- hooks for subclasses --------------------------------------------

    def _consumed(self, frame):
        pass

    def _consumed_many(self, frames, start):
        for f in frames[start:]:
            self._consumed(f)

    def _count_lost(self, n):
        self._lost += n

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
            self._spool._readers.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        return (_reattach, (self._spool, None, False, self._seq, self._verify))

    def __repr__(self):
        return f"<shmq.{type(self).__name__} {self.name!r} at seq {self._seq}>"


class _SlotReader(Reader):
    """A reader bound to a slot of the spool's reader table."""

    _kind = F.SLOT_READER

    def __init__(self, spool, name, *, start="earliest", verify=False):
        self.name = name
        self._slot = None
        slot = spool._attach_slot(name, self._kind, start)
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
        exclusive = self._kind == F.SLOT_READER
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
        self._flush_stats()
        return self._spool._slots[self._w + F.S_LOST] if not self._closed else self._lost

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
        self._closed_why = (f"reader {self.name!r} belongs to the process that created it "
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
        self._n = self._bytes = self._dsum = self._dmax = 0
        self._lost_pending = self._lag_peak = 0
        super().__init__(spool, name, start=start, verify=verify)

    def _initial_cursor(self, start):
        sp = self._spool
        seq, pos = sp._slots[self._w + F.S_SEQ], sp._slots[self._w + F.S_POS]
        sp._check_cursor(self.name, seq, pos)
        return seq, pos

    @property
    def committed(self) -> int:
        """The position stored in the spool (where a restart resumes)."""
        return self._spool._slots[self._w + F.S_SEQ]

    def _consumed(self, frame):
        if not self._n:  # first frame since the last flush: sample the backlog
            self._lag_peak = self._spool._ctl[W_NEXT_SEQ] - frame[0]
        self._n += 1
        self._bytes += len(frame[2])
        d = _time_ns() - frame[1]
        if d > 0:  # clocks can step backwards; never count a negative delay
            self._dsum += d
            if d > self._dmax:
                self._dmax = d
        if self._auto:
            slots = self._spool._slots
            slots[self._w + F.S_POS] = self._pos  # position first: see spool._resync
            slots[self._w + F.S_SEQ] = self._seq
            if not self._spool._overwrite:
                self._spool._notify_space()
        if self._n >= STATS_FLUSH_FRAMES:
            self._flush_stats()

    def _consumed_many(self, frames, start):
        """Account frames[start:] at once: one clock read, one commit."""
        if not self._n:
            self._lag_peak = self._spool._ctl[W_NEXT_SEQ] - frames[start][0]
        now = _time_ns()
        k = len(frames) - start
        self._n += k
        run = frames[start:] if start else frames
        ts_sum = sum(map(_second, run))  # C-level loops: this runs per batch of frames
        self._bytes += sum(map(len, map(_third, run)))
        d = now * k - ts_sum
        if d > 0:
            self._dsum += d
        d = now - frames[start][1]  # the oldest frame waited longest
        if d > self._dmax:
            self._dmax = d
        if self._auto:
            slots = self._spool._slots
            slots[self._w + F.S_POS] = self._pos
            slots[self._w + F.S_SEQ] = self._seq
            if not self._spool._overwrite:
                self._spool._notify_space()
        if self._n >= STATS_FLUSH_FRAMES:
            self._flush_stats()

    def _count_lost(self, n):
        self._lost += n
        self._lost_pending += n

    def _before_wait(self):
        self._flush_stats()

    def _flush_stats(self):
        if not (self._n or self._lost_pending) or self._closed:
            return
        sp = self._spool
        slots, w, ctl = sp._slots, self._w, sp._ctl
        _add(slots, w + F.S_GETS, self._n)
        _add(slots, w + F.S_GET_BYTES, self._bytes)
        _add(slots, w + F.S_DELAY_SUM_NS, self._dsum)
        if self._dmax > slots[w + F.S_DELAY_MAX_NS]:
            slots[w + F.S_DELAY_MAX_NS] = self._dmax
        _add(slots, w + F.S_LOST, self._lost_pending)
        now = _time_ns()
        if self._n:
            slots[w + F.S_LAST_GET_NS] = now
        lag = max(0, ctl[W_NEXT_SEQ] - self._seq)
        if self._n and self._lag_peak > slots[w + F.S_LAG_HIGH]:
            slots[w + F.S_LAG_HIGH] = self._lag_peak
        if lag < slots[w + F.S_LAG_LOW]:
            slots[w + F.S_LAG_LOW] = lag
        sp._count_read_rate(self._n, now)
        self._n = self._bytes = self._dsum = self._dmax = self._lost_pending = 0

    def commit(self) -> None:
        """Persist the current position in the spool (two aligned stores: position,
        then seq; a crash between them is repaired on the next read)."""
        self._check()
        slots = self._spool._slots
        slots[self._w + F.S_POS] = self._pos
        slots[self._w + F.S_SEQ] = self._seq
        self._flush_stats()
        if not self._spool._overwrite:
            self._spool._notify_space()

    def seek(self, where) -> None:
        super().seek(where)
        if self._auto:
            self.commit()

    def __reduce__(self):
        return (_reattach, (self._spool, self.name, False, None, self._verify, self._auto))


class GroupReader(_SlotReader):
    """A competing consumer in a named group; see :meth:`shmq.Spool.reader`.

    The group's cursor is advanced under a recoverable lock held for the
    copy only; each frame goes to exactly one member.  A member killed
    while holding the lock loses at most the frames it was taking (one for
    ``get``, up to ``max_frames`` for ``get_many``), and the others resume
    within the lock-recovery timeout.
    """

    _kind = F.SLOT_GROUP

    def __init__(self, spool, name, *, start="earliest", verify=False):
        self._n = self._bytes = self._dsum = self._dmax = self._lag_peak = 0
        super().__init__(spool, name, start=start, verify=verify)
        w = self._w
        try:
            spool._check_cursor(name, spool._slots[w + F.S_SEQ], spool._slots[w + F.S_POS])
        except BaseException:
            self.close()
            raise
        self._lock = self._make_lock()
        self._sem = self._lock.sem

    def _make_lock(self):
        sp = self._spool
        sem = open_semaphore(group_sem_name(sp._sem_prefix, self._slot), 1, sp._sem_mode,
                             owner=sp._map.st_uid, group=sp._map.st.st_gid)
        w = self._w
        return RecoverableLock(sem, sp._slots, w + F.S_LOCK_HOLDER, w + F.S_LOCK_TOKEN, sp._map, sp._slot_byte(self._slot, F.SLOT_RECOVERY_BYTE),
                               recovery_timeout=sp._recovery_timeout)

    def _initial_cursor(self, start):
        return 0, 0  # the cursor lives in the slot

    @property
    def position(self) -> int:
        return self._spool._slots[self._w + F.S_SEQ]

    @property
    def lag(self) -> int:
        self._check()
        return max(0, self._spool._ctl[W_NEXT_SEQ] - self.position)

    def _available(self):
        return self._spool._slots[self._w + F.S_SEQ] < self._spool._ctl[W_NEXT_SEQ]

    def _take(self, max_frames, codecs=None, timeout=None):
        """Take up to ``max_frames`` frames under the group lock (may be empty).

        Frames are copied under the lock and the cursor advanced before it
        is released; statistics accumulate per handle and are flushed to
        the slot under the lock every STATS_FLUSH_FRAMES frames.  With
        ``codecs`` (a list), each frame's codec tag is appended to it.
        """
        sp = self._spool
        slots, w = sp._slots, self._w
        out = []
        sem = self._sem
        try:
            sem.acquire(0)  # inlined RecoverableLock.acquire (uncontended fast path)
        except BusyError:
            # Another member is copying (microseconds): even a non-blocking get
            # waits for it, up to the recovery timeout; a stuck live holder
            # surfaces as Empty, as multiprocessing.Queue's busy read lock does.
            wait = None if timeout is None else max(timeout, self._lock.recovery_timeout)
            try:
                self._lock._acquire_slow(wait)
            except Timeout:
                raise Empty("the group's lock is held by a live member that does not "
                            "release it") from None
        slots[w + F.S_LOCK_HOLDER] = sp._holder
        try:
            seq, pos = slots[w + F.S_SEQ], slots[w + F.S_POS]
            if max_frames == 1 and not self._verify:
                # Fast path (one plain frame), inlined from Spool._read as in Reader.get.
                ctl = sp._ctl
                if seq >= ctl[W_NEXT_SEQ]:
                    return out
                ring = sp._ring
                off = pos % ring
                if ring - off >= FRAME_BYTES:
                    o = sp._base + off
                    hseq, stored, length, ts, _crc, flags, codec, _x = _unpack_frame(sp._mm, o)
                    if (hseq == seq and not flags & FLAG_PAD and off + stored <= ring
                            and stored >= FRAME_BYTES + length and codec not in _WRITABLE):
                        data = sp._mm[o + FRAME_BYTES:o + FRAME_BYTES + length]
                        if ctl[W_FIRST_POS] <= pos:
                            slots[w + F.S_POS] = pos + stored
                            slots[w + F.S_SEQ] = seq + 1
                            if codecs is not None:
                                codecs.append(codec)
                            d = _time_ns() - ts
                            if d > 0:
                                self._dsum += d
                                if d > self._dmax:
                                    self._dmax = d
                            if not self._n:
                                self._lag_peak = ctl[W_NEXT_SEQ] - seq
                            self._bytes += length
                            self._n += 1
                            if self._n >= STATS_FLUSH_FRAMES:
                                self._flush_locked()
                            out.append(_new_frame(Frame, (seq, ts, data)))
                            return out
            lost_total = 0
            read = sp._read
            verify = self._verify
            while len(out) < max_frames:
                if codecs is None and not verify and max_frames > 1:
                    cur = sp._read_run(seq, pos, max_frames - len(out), out)
                    if cur is not None and cur[0] != seq:
                        seq, pos = cur
                        continue
                frame, seq, pos, lost, codec = read(seq, pos, verify)
                lost_total += lost
                if frame is None:
                    break
                out.append(frame)
                if codecs is not None:
                    codecs.append(codec)
            if out or lost_total:
                slots[w + F.S_POS] = pos  # position first: see Spool._resync
                slots[w + F.S_SEQ] = seq
                if lost_total:
                    _add(slots, w + F.S_LOST, lost_total)
                if out:
                    self._account(out)
                    if self._n >= STATS_FLUSH_FRAMES:
                        self._flush_locked()
            return out
        finally:
            slots[w + F.S_LOCK_HOLDER] = 0
            sem.release()
            # Outside the lock: wake writers blocked on a full spool.
            if out and not sp._overwrite and sp._space_waiters.value:
                sp._space_bell.ring()

    def _account(self, frames):
        now = _time_ns()
        for f in frames:
            self._bytes += len(f[2])
            d = now - f[1]
            if d > 0:
                self._dsum += d
                if d > self._dmax:
                    self._dmax = d
        if not self._n:
            self._lag_peak = self._spool._ctl[W_NEXT_SEQ] - frames[0][0]
        self._n += len(frames)

    def _flush_locked(self):
        """Publish this handle's counters to the group's slot (group lock held)."""
        sp = self._spool
        slots, w = sp._slots, self._w
        _add(slots, w + F.S_GETS, self._n)
        _add(slots, w + F.S_GET_BYTES, self._bytes)
        _add(slots, w + F.S_DELAY_SUM_NS, self._dsum)
        if self._dmax > slots[w + F.S_DELAY_MAX_NS]:
            slots[w + F.S_DELAY_MAX_NS] = self._dmax
        now = _time_ns()
        slots[w + F.S_LAST_GET_NS] = now
        if self._lag_peak > slots[w + F.S_LAG_HIGH]:
            slots[w + F.S_LAG_HIGH] = self._lag_peak
        lag = max(0, sp._ctl[W_NEXT_SEQ] - slots[w + F.S_SEQ])
        if lag < slots[w + F.S_LAG_LOW]:
            slots[w + F.S_LAG_LOW] = lag
        sp._count_read_rate(self._n, now)
        self._n = self._bytes = self._dsum = self._dmax = 0

    def _flush_stats(self):
        if self._n and not self._closed and self._spool._mm is not None:
            self._lock.acquire()
            try:
                self._flush_locked()
            finally:
                self._lock.release()

    def _before_wait(self):
        self._flush_stats()

    def get(self, block=True, timeout=None, _codecs=None):
        if self._closed:
            self._check()
        if timeout is not None or not block:
            timeout = _check_block_timeout(block, timeout)
        out = self._take(1, _codecs, timeout)
        if out:
            return out[0]
        deadline = None
        while True:
            deadline = self._wait(timeout, deadline)
            out = self._take(1, _codecs, timeout)
            if out:
                return out[0]

    def get_many(self, max_frames=100, block=True, timeout=None, _codecs=None, as_array=False):
        if as_array:
            from .columnar import get_records

            return get_records(self, max_frames, block, timeout)
        if self._closed:
            self._check()
        _check_max_frames(max_frames)
        if timeout is not None or not block:
            timeout = _check_block_timeout(block, timeout)
        deadline = None
        while True:
            out = self._take(max_frames, _codecs, timeout)
            if out:
                return out
            deadline = self._wait(timeout, deadline)

    @property
    def lost(self) -> int:
        """Frames the group skipped because they were overwritten (shared by all members)."""
        return self._spool._slots[self._w + F.S_LOST]

    def seek(self, where) -> None:
        """Move the group's shared cursor (affects every member)."""
        self._check()
        seq, pos = self._spool._cursor_for(where)
        self._lock.acquire()
        try:
            self._spool._slots[self._w + F.S_POS] = pos
            self._spool._slots[self._w + F.S_SEQ] = seq
        finally:
            self._lock.release()

    def close(self) -> None:
        if not self._closed and getattr(self, "_lock", None) is not None:
            self._flush_stats()
            self._lock.sem.close()
        super().close()

    def _after_fork_in_child(self):
        # Group members may be shared with fork children: the cursor is in
        # the spool, so the child only needs its own liveness lock.  The
        # parent's unflushed counters stay the parent's.
        self._n = self._bytes = self._dsum = self._dmax = 0
        sp = self._spool
        if not ofd_lock(sp._map.fd, sp._slot_byte(self._slot, F.SLOT_LIVE_BYTE), exclusive=False):
            self._closed = True
            self._closed_why = "could not re-attach group member after fork"

    def __reduce__(self):
        return (_reattach, (self._spool, self.name, True, None, self._verify))


def _reattach(spool, name, group, seq, verify, auto_commit=True):
    if name is None:
        return spool.reader(start=seq, verify=verify)
    if group:
        return spool.reader(name, group=True, verify=verify)
    return spool.reader(name, auto_commit=auto_commit, verify=verify)
