"""Readers: cursors over a spool's ring.

* :class:`Reader` - anonymous: a private cursor, lock-free, never holds writers back.
* :class:`NamedReader` - durable: its committed cursor lives in the spool's
  reader table, survives restarts, and (``on_full="block"``/``"error"``)
  keeps writers from overwriting what it has not consumed.
* :class:`shmq.group.GroupReader` - a member of a named group: the cursor is
  shared and advanced under the group's recoverable lock, so each frame goes
  to exactly one member (at most once if a member dies holding it).

The cursor itself is a :class:`shmq._core.Cursor`: reading, the seqlock
check, loss counting, commits and statistics run in C in one call, which is
atomic for other threads and for signal handlers.  This module keeps
blocking (the spool's doorbells), validation and lifecycle, and the
cursor operations the columnar layer builds zero-copy reads from
(:meth:`Reader.cursor`, :meth:`Reader.take`, :meth:`Reader.advance`).
"""

from __future__ import annotations

import os
import time

from . import _core
from . import _format as F
from ._lazy import TYPE_CHECKING, columnar, overload
from .errors import Empty, ReaderBusy
from .waiting import check_block_timeout, retry_async

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any, Literal, NoReturn, Self
    from numpy.typing import NDArray
    from .columnar import PinnedView
    from .spool import Spool

Frame = _core.Frame

__all__ = ["Reader", "SlotReader", "NamedReader", "reattach"]

#: A named reader publishes its counters to the reader table this often
#: (frames, in the core), and whenever its wait has slept for
#: shmq._notify.PUBLISH_AFTER_S (not in the short spin before, nor a wait a
#: frame ends sooner), commits explicitly or closes.
STATS_FLUSH_FRAMES = 64
#: A reader that has found nothing to read for this long trims a growable spool
#: (gives back the segments every consumer is done with; Spool.trim_idle).
TRIM_IDLE_S = 0.01
#: The engine's cursor kinds (its K_ANON, K_NAMED, K_GROUP).
K_ANON, K_NAMED, K_GROUP = 0, 1, 2


def check_max_frames(max_frames: int) -> None:
    if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 1:
        raise ValueError(f"max_frames must be a positive int, not {max_frames!r}")


class Reader:
    """An anonymous reader: a private cursor; see :meth:`shmq.Spool.reader`.

    Thread-safe: each ``get``/``get_many`` is one atomic step, so threads
    sharing a reader never receive the same frame twice.
    """

    name: str | None = None
    _slot: Any = None  # int once attached (named readers and groups)
    _kind = K_ANON

    #: True for a group member: the cursor is shared (lives in the reader table).
    shared = False

    def __init__(self, spool: Spool, *, start: str | int = "earliest", verify: bool = False) -> None:
        self._spool = spool
        self._verify = verify
        self._closed = False
        self._last_len = 0  # the payload length of the last zero-copy read (its spin)
        seq, pos = self._initial_cursor(start)
        self._cur = _core.Cursor(spool.core, self._kind, -1 if self._slot is None else self._slot,
                                 seq, pos, self._auto_commit(), bool(verify), self._lock_name())
        # One-way: the core hands what its get leaves over (waiting, a busy
        # group lock) to this class's _get_slow, never looks it up by name.
        self._cur.bind(self, type(self)._get_slow)
        if type(self).get is Reader.get:
            # Reader.get's own code, bound per handle: straight to C (no
            # Python frame).  A subclass that overrides get keeps it.
            self.get = self._cur.get_api
        spool.add_reader(self)

    def _initial_cursor(self, start: str | int) -> tuple[int, int]:
        return self._spool.ring.cursor_for(start)

    def _auto_commit(self) -> bool:
        return False

    def _lock_name(self) -> str | None:
        return None

    # -- state ----------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def spool(self) -> Spool:
        """The :class:`shmq.Spool` handle this reader reads."""
        return self._spool

    @property
    def core_cursor(self) -> _core.Cursor:
        """The compiled cursor (:class:`shmq._core.Cursor`) doing this reader's reads."""
        return self._cur

    @property
    def slot(self) -> int | None:
        """Index of this reader's slot in the reader table (None: anonymous)."""
        return self._slot

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
        self.check()
        return max(0, self._spool.ring.next_seq - self.position)

    def check(self) -> None:
        """:raises ValueError: the reader is closed (with the reason)."""
        if self._closed:
            self._cur.get()  # raises ValueError with the reason it was closed
            raise ValueError("reader is closed")

    def available(self) -> bool:
        """True when a frame is committed past this reader's cursor (lock-free)."""
        return self._cur.available()

    # -- reading --------------------------------------------------------

    def get(self, block: bool = True, timeout: float | None = None) -> Frame:
        """Return the next frame as ``shmq.Frame(seq, timestamp_ns, data)``.

        Blocks (without spinning, beyond a few microseconds) until a frame is
        committed, for at most ``timeout`` seconds (None: forever).  Frames
        overwritten before this reader got to them are skipped and counted
        in :attr:`lost`.

        :raises shmq.Empty: nothing arrived in time (or ``block=False``).
        :raises ValueError: the reader is closed.
        """
        # A frame in one C call; the core hands waiting and recovery to
        # type(self)._get_slow.
        return self._cur.get_api(block, timeout)

    def _get_slow(self, block: bool, timeout: float | None, f: Any) -> Frame:
        """What the core's get could not finish: wait for a frame, recover a group's lock."""
        if timeout is not None or not block:
            timeout = check_block_timeout(block, timeout)
        deadline = None
        while True:
            if type(f) is int:  # a group's lock is busy
                f = self._locked(self._cur.get, timeout)
            if f is not None:
                return f
            deadline = self.wait(timeout, deadline)
            f = self._cur.get()

    def wait(self, timeout: float | None, deadline: float | None, spin: float = 0.0) -> float | None:
        """Park until the cursor has something to read (or was told to re-check).

        ``timeout`` is the caller's whole budget (0: do not wait, None:
        forever); ``deadline`` is None on the first call and what the
        previous call returned afterwards, so loops keep one budget.
        ``spin``: seconds to spin first (the engine's spin, the GIL released),
        before the doorbell's own short spin and park.

        :returns: the deadline to pass next time.
        :raises shmq.Empty: the budget is spent.
        """
        if timeout == 0:
            raise Empty("no frame available")
        now = time.monotonic()
        first = deadline is None
        if deadline is None and timeout is not None:
            deadline = now + timeout
        # A slot reader's counters are published once a wait has slept for
        # PUBLISH_AFTER_S, not when the spin or a short sleep ends it (the
        # core publishes every STATS_FLUSH_FRAMES).
        bell, ready, flush = self._spool.data_bell, self._cur.available, self._before_wait
        left = None if deadline is None else deadline - now
        if first and (left is None or left > TRIM_IDLE_S) and self._spool.trim_due():
            # Idle for TRIM_IDLE_S: a growable spool gives back the segments its
            # consumers are done with.  Not at once: a consumer faster than its
            # producer is "caught up" between most frames, and each trim takes
            # the writer lock and frees pages the writer would allocate again.
            if bell.wait(ready, TRIM_IDLE_S, flush):
                return deadline
            self._spool.trim_idle()
            left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise Empty(f"no frame within {timeout} s")
        if spin > 0:
            # The engine's spin (no syscall), with the GIL released as a copying
            # read's is: the process's other threads run meanwhile.
            if self._cur.spin(spin if left is None else min(spin, left)):
                return deadline
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise Empty(f"no frame within {timeout} s")
        if not bell.wait(ready, left, flush):
            raise Empty(f"no frame within {timeout} s")
        return deadline

    @overload
    def get_many(self, max_frames: int = 100, block: bool = True, timeout: float | None = None,
                 as_array: Literal[False] = False) -> list[Frame]: ...
    @overload
    def get_many(self, max_frames: int = 100, block: bool = True, timeout: float | None = None, *,
                 as_array: Literal[True]) -> NDArray[Any]: ...
    @overload
    def get_many(self, max_frames: int, block: bool, timeout: float | None,
                 as_array: Literal[True]) -> NDArray[Any]: ...

    def get_many(self, max_frames: int = 100, block: bool = True, timeout: float | None = None,
                 as_array: bool = False) -> list[Frame] | NDArray[Any]:
        """Return a list of 1..``max_frames`` frames, blocking only for the first.

        ``as_array=True`` (record-stream mode): concatenate up to
        ``max_frames`` consecutive numpy frames of one dtype into one array.

        :raises shmq.Empty: nothing arrived in time.
        """
        if as_array:
            return self._get_records(max_frames, block, timeout)
        return self._get_frames(max_frames, block, timeout)

    def _get_frames(self, max_frames: int, block: bool, timeout: float | None) -> list[Frame]:
        """get_many's frames (a group member takes them under its lock instead)."""
        check_max_frames(max_frames)
        out = self._cur.get_many(max_frames)
        if type(out) is list and out:
            return out
        if timeout is not None or not block:
            timeout = check_block_timeout(block, timeout)
        deadline = None
        while True:
            deadline = self.wait(timeout, deadline)
            out = self._cur.get_many(max_frames)
            if type(out) is list and out:
                return out

    async def get_async(self, timeout: float | None = None) -> Frame:
        """``await`` the next frame: the event loop watches the same inotify fd.

        :raises shmq.Empty: nothing arrived within ``timeout``.
        """
        self.check()
        timeout = check_block_timeout(True, timeout)
        try:
            return await retry_async(lambda: self.get(block=False), Empty, self._spool.data_bell,
                                     lambda: self._cur.available, timeout, self._before_wait)
        except Empty:
            raise Empty(f"no frame within {timeout} s") from None

    def __iter__(self) -> Iterator[Frame]:
        """Blocking iteration: yields frames forever (until the reader is closed)."""
        while not self._closed:
            yield self.get()

    @overload
    def get_array(self, block: bool = True, timeout: float | None = None,
                  copy: Literal[True] = True) -> NDArray[Any]: ...
    @overload
    def get_array(self, block: bool = True, timeout: float | None = None, *,
                  copy: Literal[False]) -> PinnedView: ...
    @overload
    def get_array(self, block: bool, timeout: float | None, copy: Literal[False]) -> PinnedView: ...

    def get_array(self, block: bool = True, timeout: float | None = None,
                  copy: bool = True) -> NDArray[Any] | PinnedView:
        """The next frame as a numpy array (it must be a numpy frame).

        ``copy=True``: a writable array over one private copy.  ``copy=False``:
        always a :class:`shmq.columnar.PinnedView`, whose ``.array`` is a
        read-only view into the spool; the frame is not overwritten until it
        is released (``with r.get_array(copy=False) as v: ...``).  (A reader
        lapped in overwrite mode gets the frame after its loss copied, in a
        PinnedView that pins nothing.)

        :raises shmq.Empty: nothing arrived in time.
        :raises shmq.ShmqError: the frame is not a numpy frame (it is consumed).
        """
        return self._get_decoded(block, timeout, copy, F.CODEC_NUMPY, columnar().decode_numpy)

    def get_arrow(self, block: bool = True, timeout: float | None = None, copy: bool = True) -> Any:
        """The next frame as a pyarrow Table (zero-copy over the mapping with ``copy=False``,
        as a PinnedView); see :meth:`get_array`."""
        return self._get_decoded(block, timeout, copy, F.CODEC_ARROW, columnar().decode_arrow)

    def _get_decoded(self, block: bool, timeout: float | None, copy: bool, codec: int,
                     decode: Callable[[Any], Any]) -> Any:
        """The next frame (pinned if not ``copy``) decoded by shmq.columnar, which gets the
        bytes taken here: the wait, the cursor and the locks stay this reader's."""
        if timeout is not None or not block:
            timeout = check_block_timeout(block, timeout)
        deadline = None
        while True:
            self.check()
            got = self.take(copy, timeout)
            if got is not None:
                seq, payload, frame_codec, pos = got
                self._last_len = len(payload)
                return columnar().view_of(self._spool.pins, seq, payload, frame_codec, pos, copy, codec, decode)
            # Zero-copy reads do not go through the engine's take: the engine's
            # spin rule and spin all the same (a reader of 5 MiB Arrow frames that
            # parks between them wakes late, and a writer wrapping its hot region
            # early waits for it; docs/format.md).
            deadline = self.wait(timeout, deadline, _core.spin_for_frame(self._last_len))

    def _get_records(self, max_frames: int, block: bool, timeout: float | None) -> NDArray[Any]:
        """get_many(as_array=True): up to ``max_frames`` consecutive numpy frames of one dtype
        as one array, blocking only for the first, stopping at another dtype or codec.  For
        anonymous and named readers runs are copied once, straight from the mapping."""
        col = columnar()
        ring = self._spool.ring
        run = None if self.shared or self._closed else col.records_run(ring, *self.cursor(), max_frames, None)
        if run is not None:
            self.advance(run[1], run[2])
            return run[0]
        parts = [self.get_array(block, timeout).reshape(-1)]
        if not self.shared and max_frames > 1:
            run = col.records_run(ring, *self.cursor(), max_frames - 1, parts[0].dtype)
            if run is not None:
                self.advance(run[1], run[2])
                parts.append(run[0])
        while self.shared and len(parts) < max_frames:
            try:
                if col.peek_dtype(ring, *self.cursor()) != parts[0].dtype:
                    break
            except Empty:
                break
            parts.append(self.get_array(block=False).reshape(-1))
        return col.join_records(parts)

    def seek(self, where: str | int) -> None:
        """Move the cursor to "earliest", "latest" or a seq (the next frame returned).

        :raises shmq.FrameLost: that seq was already overwritten.
        :raises ValueError: a seq beyond the next one to be written.
        """
        self.check()
        self._set_cursor(*self._spool.ring.cursor_for(where))

    def _set_cursor(self, seq: int, pos: int) -> None:
        self._cur.pos = pos
        self._cur.seq = seq

    def cursor(self) -> tuple[int, int]:
        """This reader's cursor ``(seq, pos)``: the next frame it will return."""
        return self._cur.seq, self._cur.pos

    def advance(self, seq: int, pos: int) -> None:
        """Move the cursor to ``(seq, pos)`` past frames read outside the core (zero-copy
        columnar reads); a named reader with auto-commit commits it."""
        self._set_cursor(seq, pos)

    def take(self, copy: bool, timeout: float | None) -> tuple[int, Any, int, int | None] | None:
        """The next frame as ``(seq, payload, codec, pos)``, or None if there is none yet.

        With ``copy=False`` a plain frame is pinned and ``payload`` is a
        memoryview into the mapping: the caller unpins ``pos`` when done
        (``spool.pins.unpin(pos)``); otherwise (or when the frame at the
        cursor was overwritten: the next one, its loss counted) ``payload``
        is a private copy and ``pos`` None.  Never blocks (``timeout``
        bounds a group's lock wait).
        """
        sp = self._spool
        seq, pos = self.cursor()
        if not copy:
            if seq >= sp.ring.next_seq:
                # Nothing yet.  Not the core's get: a frame committed meanwhile
                # would come back copied, where the caller asked for a pin.
                return None
            got = sp.pins.read(seq, pos, self._cursor_holds(pos))
            if got is not None:
                view, codec, fpos, npos = got
                self.advance(seq + 1, npos)
                return seq, view, codec, fpos
            # gone (overwritten): the core's get counts the loss, and copies the next
        frame = self._cur.get()
        if type(frame) is not Frame:
            return None
        return frame[0], frame[2], frame.codec, None

    def commit(self) -> None:
        """Persist the position (anonymous readers have nothing to persist)."""
        self.check()

    def _cursor_holds(self, pos: int) -> bool:
        """True if this reader's published cursor keeps the frame at ``pos`` from
        being evicted until the reader moves it (a zero-copy read may then pin
        it without the writer lock: :meth:`shmq.pins.Pins.pin`)."""
        return False

    # -- hooks for subclasses --------------------------------------------

    def count_lost(self, n: int) -> None:
        """Add ``n`` frames skipped outside this reader (e.g. by a Spark source that
        jumped over overwritten offsets) to its loss counter."""
        self._cur.add_lost(n)

    def _before_wait(self) -> None:
        pass

    def flush_stats(self) -> None:
        """Publish this reader's pending counters to the reader table (named readers)."""

    def after_fork_in_child(self) -> None:
        """Called by the spool in a fork child.  An anonymous reader needs nothing: its
        cursor is private memory, copied with the process."""

    def _locked(self, call: Callable[[float], Any], timeout: float | None) -> Any:
        raise NotImplementedError  # only a group's cursor has a lock

    # -- lifecycle --------------------------------------------------------

    def close(self) -> None:
        """Detach the reader. Idempotent."""
        if not self._closed:
            self._closed = True
            self._cur.close()
            self._spool.discard_reader(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Callable[..., Reader], tuple[Any, ...]]:
        return (reattach, (self._spool, None, False, self._cur.seq, self._verify))

    def __repr__(self) -> str:
        return f"<shmq.{type(self).__name__} {self.name!r} at seq {self.position}>"


class SlotReader(Reader):
    """A reader bound to a slot of the spool's reader table."""

    _kind = K_NAMED
    _slot_state = F.SLOT_READER

    def __init__(self, spool: Spool, name: str, *, start: str | int = "earliest",
                 verify: bool = False) -> None:
        self.name = name
        self._slot = None
        slot = spool.slots.attach(name, self._slot_state, start)
        self._attach(spool, slot)
        self._slot = slot
        try:
            super().__init__(spool, start=start, verify=verify)
        except BaseException:
            self._detach(spool)
            raise

    def _attach(self, spool: Spool, slot: int) -> None:
        slots = spool.slots
        exclusive = self._slot_state == F.SLOT_READER
        if exclusive and slots.holds(slot):
            raise ReaderBusy(f"reader {self.name!r} is already attached through this handle")
        if not slots.hold(slot, exclusive):
            raise ReaderBusy(f"reader {self.name!r} of {spool.path} is attached by another "
                             f"process (pid {slots.word(slot, F.S_PID)})")
        slots.set_word(slot, F.S_PID, os.getpid())

    def _detach(self, spool: Spool) -> None:
        if self._slot is not None:
            spool.slots.let_go(self._slot)

    @property
    def lost(self) -> int:
        """Frames skipped because they were overwritten before being read.

        While attached: the name's cumulative count stored in the spool.
        After close: the count of this attachment only.
        """
        if self._closed:
            return self._cur.lost
        self.flush_stats()
        return self._spool.slots.word(self._slot, F.S_LOST)

    def _before_wait(self) -> None:
        self.flush_stats()

    def close(self) -> None:
        if self._closed:
            return
        self.flush_stats()
        self._detach(self._spool)
        super().close()

    def after_fork_in_child(self) -> None:
        # Only the attaching process owns the cursor; the fork child's copy
        # of this object is closed (open a new reader in the child).
        self._closed = True
        self._cur.close(f"reader {self.name!r} belongs to the process that created it "
                        "(pid before fork); open a new reader in this process")
        self._spool.slots.forget(self._slot)


class NamedReader(SlotReader):
    """A durable named reader; see :meth:`shmq.Spool.reader`.

    With ``auto_commit=True`` (default) every returned frame is committed
    at once (a crash loses nothing and repeats nothing).  With
    ``auto_commit=False`` the position is persisted only by :meth:`commit`:
    after a crash, frames read since the last commit are delivered again.
    """

    def __init__(self, spool: Spool, name: str, *, start: str | int = "earliest", auto_commit: bool = True,
                 verify: bool = False) -> None:
        self._auto = auto_commit
        super().__init__(spool, name, start=start, verify=verify)

    def _auto_commit(self) -> bool:
        return bool(self._auto)

    def _initial_cursor(self, start: str | int) -> tuple[int, int]:
        seq, pos = self._spool.slots.cursor(self._slot)
        self._spool.ring.check_cursor(self.name, seq, pos)
        return seq, pos

    @property
    def committed(self) -> int:
        """The position stored in the spool (where a restart resumes)."""
        return self._spool.slots.word(self._slot, F.S_SEQ)

    def flush_stats(self) -> None:
        if not self._closed:
            self._cur.flush()

    def _cursor_holds(self, pos: int) -> bool:
        # Block and error rings never evict what a named cursor has not passed;
        # overwrite rings do.  The published position, not the private one: a
        # seek back without auto-commit leaves it ahead of the cursor.
        return (self._spool.on_full != "overwrite"
                and self._spool.slots.word(self._slot, F.S_POS) <= pos)

    def advance(self, seq: int, pos: int) -> None:
        self._set_cursor(seq, pos)
        if self._auto:
            self._cur.commit()

    def commit(self) -> None:
        """Persist the current position in the spool (two aligned stores: position,
        then seq; a crash between them is repaired on the next read)."""
        self.check()
        self._cur.commit()

    def seek(self, where: str | int) -> None:
        super().seek(where)
        if self._auto:
            self.commit()

    def __reduce__(self) -> tuple[Callable[..., Reader], tuple[Any, ...]]:
        return (reattach, (self._spool, self.name, False, None, self._verify, self._auto))


def reattach(spool: Spool, name: str | None, group: bool, seq: Any, verify: bool,
              auto_commit: bool = True) -> Reader:
    if name is None:
        return spool.reader(start=seq, verify=verify)
    if group:
        return spool.reader(name, group=True, verify=verify)
    return spool.reader(name, auto_commit=auto_commit, verify=verify)
