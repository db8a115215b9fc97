"""The write path: appending frames, waiting for room, eviction and writer statistics.

Every write is one call into the compiled core (:class:`shmq._core.Ring`:
``put``/``put_many``/``reserve``), whose placement, eviction and commit are
the only ones; its options (``Deferred`` payloads, ``before_commit`` hooks,
``sync=True``, imported ``timestamps``) go to ``put_many`` as keywords.
:class:`Writer` handles what the core hands back: a stuck writer lock
(recovered when its holder died), a full ring (waiting on the space
doorbell), a zero-copy pin in the way (dead holders' pins reclaimed, then a
wait), and frames too large to ever fit.

Commit point: a batch is visible once ``NEXT_SEQ`` is stored (one aligned
8-byte release store, after every byte of the batch); ``NEXT_POS`` follows
and is re-derived on recovery (:meth:`shmq.ring.Ring.repair_after_writer_death`).
"""

from __future__ import annotations

import time

from . import _core
from . import _format as F
from ._format import FRAME_BYTES
from ._lock import holder_pid
from ._space import no_space_to_grow
from .errors import Full, Timeout, TooLarge
from .waiting import _NOT_YET, check_block_timeout, first_look, retry_stuck

__all__ = ["Writer", "Deferred", "set_crash_hook"]

_LOCK_STUCK, _SLOW, _TOO_LARGE = _core.LOCK_STUCK, _core.SLOW, _core.TOO_LARGE
_NO_SPACE, _BACKLOG = _core.NO_SPACE, _core.BACKLOG

#: How long a writer blocked on a full spool waits for room for a burst (the
#: engine's "want": an eighth of the ring, at most 64 KiB, or of a queue's
#: maxsize; consumers ring it once that is free) before it takes whatever room
#: there is.  Waking for every frame freed made the writer and its consumer
#: wake each other once per frame (docs/format.md, "Room for a blocked writer").
ROOM_BURST_WAIT_S = 0.001

#: A frame payload of known size written by ``fill(memoryview)`` under the
#: writer lock (the core's type: ``put_many`` recognizes it).  Lets a
#: serializer (Arrow IPC) write straight into the ring instead of into a
#: buffer that is then copied.  ``fill`` must write exactly ``nbytes``, must
#: not keep the view and must not touch the spool; if it raises, the batch is
#: aborted (nothing published) and the exception propagates.
Deferred = _core.Deferred


def set_crash_hook(hook, core) -> None:
    """Install the fault-injection hook (stress/kill9.py; tests only) in ``core``, the
    :mod:`shmq._core` module, whose writer is every write path.

    The core calls it as ``hook(point, None)`` inside the writer's critical
    section, at points "evicting" (between the FIRST_POS and FIRST_SEQ
    stores), "frame-written" (after each frame of a batch of 2+),
    "committed" (between the NEXT_SEQ and NEXT_POS stores of a batch of 2+),
    "allocating" and "releasing" (a growable ring's segment switches) and
    "catching-up" (before waiting for consumers to finish a lap instead of
    growing).  ``None`` removes it.  Never set in production.
    """
    core.set_crash_hook(hook)


class Writer:
    """The write path of one spool handle (see the module docstring).

    ``owner`` is the :class:`shmq.Spool` facade (its ``allocated``, for the no-space error).
    """

    def __init__(self, owner, ring, pins, lock, data_bell, space_bell, *, policy, checksum,
                 sync):
        self._owner = owner
        self.path = ring.path
        self._ring = ring
        self._core = ring.core
        self._pins = pins
        self._lock = lock
        self._data_bell = data_bell
        self._space_bell = space_bell
        self.policy = policy
        self.checksum = checksum
        self.sync = sync
        self.ring_bytes = ring.size
        self.max_payload = min(ring.size - FRAME_BYTES, F.MAX_FRAME_PAYLOAD)
        #: shmq.Queue's rule: a ring full to its ceiling raises Full at once
        #: (``multiprocessing.Queue(maxsize=0)`` never blocks a put)
        self.full_is_ceiling = False

    # -- public entry points ----------------------------------------------------

    def append(self, views, timeout, codec, max_backlog=None, before_commit=None,
               timestamps=None) -> int:
        """Write a batch atomically; return its first seq.  Waits for room and for a stuck lock.

        ``views`` is a list or tuple of frames, each bytes-like, a tuple of
        bytes-likes (segments written one after the other, no concatenation)
        or a :class:`Deferred`.  ``timeout`` is seconds (None: forever, 0:
        never wait for room; a stuck lock is waited for up to the recovery
        timeout even then).  ``max_backlog`` bounds the frames not yet
        consumed by the slowest named reader/group (shmq.Queue's
        ``maxsize``); exceeding it waits like a full ring.
        ``before_commit(first_seq, positions)`` runs under the writer lock
        once the batch is placed (room made: eviction has happened), before
        anything is written; raising aborts the batch (shmq.WorkQueue's key
        index).  ``timestamps`` (one per frame, ns) replaces the frames' put
        time, e.g. when importing a dump; the statistics still count the put
        at the current time.  A spool opened with ``sync=True`` msyncs the
        batch's pages before the commit and the header page after it.

        All of it is the core's one writer (``put_many``): the same placement,
        eviction, wrap and zeroed padding as a plain put.  A ``fill`` or
        ``before_commit`` that raises aborts the batch: nothing is published,
        the lock is released and the exception propagates; frames evicted to
        make room for it stay evicted.

        :raises shmq.TooLarge: can never fit.
        :raises shmq.Full: no room in time (or policy "error").
        :raises shmq.Timeout: the lock's live holder did not release it in time.
        :raises ValueError: ``timestamps`` is not one u64 per frame.
        :raises OSError: ``sync=True`` and an msync failed (before the commit:
            nothing published; of the header page after it: published, not
            known durable).
        """
        backlog = -1 if max_backlog is None else max_backlog
        deadline, lock_deadline = self._deadlines(timeout)
        put_many = self._core.put_many
        if before_commit is None and timestamps is None and not self.sync:
            first = put_many(views, codec, backlog, first_look(self._lock))  # uncontended: one core call
            if first >= 0:
                return first

            def put(wait):
                return put_many(views, codec, backlog, wait)
        else:  # the core parses its options only when given
            sync = self.sync
            first = _NOT_YET

            def put(wait):
                return put_many(views, codec, backlog, wait, before_commit=before_commit,
                                timestamps=timestamps, sync=sync)
        while True:
            st = retry_stuck(put, self._lock, lock_deadline, _is_lock_stuck,
                             lambda: self._lock_timeout(timeout), first)
            first = _NOT_YET
            if st >= 0:
                return st
            if st == _TOO_LARGE:
                self._raise_too_large(views, max_backlog)
            if st == _NO_SPACE:
                raise self.no_space()
            marker = self._core.full_marker()  # taken under the lock
            if st == _SLOW:  # a zero-copy pin is in the way (policy "error" included: Full)
                if self._reclaim_pins(marker):
                    continue  # a dead holder's pin was in the way (or it moved meanwhile)
                self._wait_for_room(marker, deadline, timeout, poll=True)
                continue
            # _NO_ROOM (bytes: consumers' cursors in the way) or _BACKLOG (maxsize items)
            if st != _BACKLOG:
                self._check_ceiling()
            self._wait_for_room(marker, deadline, timeout, error=max_backlog is None)

    def reserve(self, nbytes, codec, timeout):
        """An open :class:`shmq._core.Reservation` of ``nbytes`` (see :meth:`shmq.Spool.reserve`).

        :raises TypeError: ``nbytes`` is not an int.
        :raises ValueError: ``nbytes`` is negative.
        :raises shmq.TooLarge: ``nbytes`` can never fit.
        :raises shmq.Full: no room in time (or policy "error").
        :raises shmq.Timeout: the lock's live holder did not release it in time.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"nbytes must be an int, not {type(nbytes).__name__}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be non-negative, not {nbytes}")
        if nbytes > self.max_payload:
            raise TooLarge(f"frame of {nbytes} bytes can never fit: this spool's largest "
                           f"frame is {self.max_payload} bytes (capacity {self._ring.size})")
        timeout = check_block_timeout(True, timeout)
        deadline, lock_deadline = self._deadlines(timeout)
        reserve, sync = self._core.reserve, self.sync
        got = reserve(nbytes, codec, first_look(self._lock), sync)  # the uncontended case: one core call
        if type(got) is not int:
            return got
        first = got  # retry_stuck's first look, taken
        while True:
            got = retry_stuck(lambda wait: reserve(nbytes, codec, wait, sync), self._lock, lock_deadline,
                              _is_lock_stuck, lambda: self._lock_timeout(timeout, holder=False), first)
            first = _NOT_YET
            if type(got) is not int:
                return got
            if got == _NO_SPACE:
                raise self.no_space()
            marker = self._core.full_marker()
            if got == _SLOW and self._reclaim_pins(marker):
                continue
            self._wait_for_room(marker, deadline, timeout, error=got != _SLOW, poll=got == _SLOW)

    def room_marker(self):
        """What must change before a writer blocked on a full spool retries: the
        slowest named cursor (or FIRST_POS) and the oldest pin, now, computed by the
        core as its ``full_marker()`` (taken under the lock when it found no room)."""
        return self._core.room_marker()

    def _reclaim_pins(self, marker) -> bool:
        """After the core found a zero-copy pin in the way (ST_SLOW, ``marker`` taken
        then): release the pins of dead holders (under the writer lock, as the core
        checks pins); True if the room marker has moved since (retry at once)."""
        with self._lock:
            self._pins.floor(F.NO_PIN)  # every pin is below NO_PIN: check each holder's liveness
        return self.room_marker() != marker

    def notify_space(self) -> None:
        """Wake writers blocked on a full spool (call after a consumer advances)."""
        if self._space_bell.has_waiters():
            self._space_bell.ring()

    # -- waiting ------------------------------------------------------------

    def _deadlines(self, timeout):
        # The lock is held for a copy; only a live holder that is stuck (or a
        # dead one not yet recovered) delays us, so even a non-blocking put
        # waits for it, up to the recovery timeout.
        if timeout is None:
            return None, None
        now = time.monotonic()
        return now + timeout, now + max(self._lock.recovery_timeout, timeout)

    def _lock_timeout(self, timeout, holder=True):
        why = (f" (held by pid {holder_pid(self._ring.ctl[F.W_LOCK_HOLDER])})" if holder else "")
        raise Timeout(f"writer lock of {self.path} not acquired within "
                      f"{max(self._lock.recovery_timeout, timeout)} s{why}")

    def _wait_for_room(self, marker, deadline, timeout, error=True, poll=False):
        """Raise Full (policy "error", or ``deadline`` passed), else park until there is
        room: first, up to :data:`ROOM_BURST_WAIT_S`, for room for a burst (consumers
        ring once it is free: the engine's room_state); then for any room for this write;
        then, if a consumer stopped short of even that, until the room marker moves from
        ``marker`` (taken under the lock: no change is missed).  A zero-copy pin in the
        way (``poll``) is waited for by the marker alone."""
        if error and self.policy == "error":
            raise Full(f"spool {self.path} is full (on_full='error')")
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise Full(f"spool {self.path} is still full after {timeout} s")
        if poll:  # a pin's holder may die without a word: re-check its liveness now and then
            left = 0.1 if left is None else min(left, 0.1)
        else:
            core, burst = self._core, ROOM_BURST_WAIT_S if left is None else min(left, ROOM_BURST_WAIT_S)
            try:
                if self._space_bell.wait(lambda: core.room_state(True) == 2, burst) or core.room_state(False):
                    return
            finally:
                core.room_unwant()  # consumers ring at every commit again while this waits on
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise Full(f"spool {self.path} is still full after {timeout} s")
        self._space_bell.wait(lambda: self.room_marker() != marker, left)

    def no_space(self) -> OSError:
        """The error for a growable spool whose filesystem has no room for its next segment."""
        return no_space_to_grow(self.path, self._ring.ctl[F.W_SEGMENT], self._owner.allocated,
                                self._ring.size)

    def _check_ceiling(self):
        """After the writer found the ring full in bytes (decided under the lock: the
        slowest consumer's cursor is in the way; never merely ``maxsize`` items, which
        waits): raise Full at once if that is a queue's rule (:attr:`full_is_ceiling`)."""
        if self.full_is_ceiling:
            raise Full(f"queue {self.path} is full to its ceiling of {self._ring.size} bytes "
                       "(unconsumed items): consume faster, or create the queue with a larger "
                       "max_capacity= (the default is half of /dev/shm, at most 4 GiB)")

    def _raise_too_large(self, views, max_backlog):
        sizes = [_payload_size(v) for v in views]
        big = max(sizes)
        if big > self.max_payload:
            raise TooLarge(f"frame of {big} bytes can never fit: this spool's largest "
                           f"frame is {self.max_payload} bytes (capacity {self._ring.size})")
        if max_backlog is not None and len(views) > max_backlog:
            raise TooLarge(f"batch of {len(views)} items can never fit under maxsize {max_backlog}")
        raise TooLarge(f"batch of {len(views)} frames needs more than the ring's {self._ring.size} "
                       "bytes; split it")


def _payload_size(v):
    tv = type(v)
    if tv is tuple:
        return sum(memoryview(x).nbytes for x in v)
    if tv is Deferred:
        return v.nbytes
    return memoryview(v).nbytes


def _is_lock_stuck(status):
    return type(status) is int and status == _LOCK_STUCK

