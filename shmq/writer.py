"""The write path: appending frames, waiting for room, eviction and writer statistics.

The uncontended put is one call into the compiled core
(:class:`shmq._core.Ring`); :class:`Writer` handles what the core hands
back: a stuck writer lock (recovered when its holder died), a full ring
(waiting on the space doorbell), frames too large to ever fit, and the
general path in Python for what the core does not do (deferred payloads,
``before_commit`` hooks, ``sync=True``, zero-copy pins in the way).

Commit point: a batch is visible once ``NEXT_SEQ`` is stored (one aligned
8-byte store, after every byte of the batch); ``NEXT_POS`` follows and is
re-derived on recovery (:meth:`shmq.ring.Ring.repair_after_writer_death`).
"""

from __future__ import annotations

import time
import zlib

from . import _core
from . import _format as F
from ._format import (
    FLAG_CRC, FLAG_PAD, FRAME_BYTES, RATE_SECONDS, RATE_WORDS, W_EVICTED, W_FIRST_POS, W_FIRST_SEQ,
    W_HIGH_BYTES, W_HIGH_FRAMES, W_LAST_PUT_NS, W_NEXT_POS, W_NEXT_SEQ, W_PUT_BYTES, W_RATE,
)
from ._lock import holder_pid
from ._mapping import no_space_to_grow
from .errors import Full, SpoolFormatError, Timeout, TooLarge
from .waiting import check_block_timeout, retry_stuck

__all__ = ["Writer", "Deferred", "set_crash_hook", "RING_ADVICE"]

_unpack_frame = F.FRAME.unpack_from
_pack_frame = F.FRAME.pack_into
_time_ns = time.time_ns
_crc = F.frame_crc
_MASK64 = (1 << 64) - 1
_ZEROS = (0,)
_NO_PIN_MARK = (1 << 64) - 1
_LOCK_STUCK, _SLOW, _TOO_LARGE = _core.LOCK_STUCK, _core.SLOW, _core.TOO_LARGE
_NO_SPACE, _BACKLOG = _core.NO_SPACE, _core.BACKLOG

#: What to do about a damaged ring (fsck --repair never rewrites frames, so it cannot fix one).
RING_ADVICE = ("see 'shmq fsck'; to keep what is readable: 'shmq export --skip-corrupt', "
               "'shmq rm', 'shmq import'")

#: Test hook for the fault-injection harness (stress/kill9.py), set with
#: :func:`set_crash_hook`: called as hook(point, spool) inside the writer's
#: critical section, on batch writes, at points "evicting" (between the
#: FIRST_POS and FIRST_SEQ stores), "frame-written" (after each frame of a
#: batch) and "committed" (between the NEXT_SEQ and NEXT_POS stores); the core
#: also calls it at "allocating" and "releasing" (a growable ring's segment
#: switches) and "catching-up" (before waiting for consumers to finish a batch
#: instead of growing).  Never set in production.
crash_hook = None


def set_crash_hook(hook, core=None) -> None:
    """Install the fault-injection hook in the general path (and ``core``'s; tests only)."""
    global crash_hook
    crash_hook = hook
    if core is not None:
        core.set_crash_hook(hook)


class Deferred:
    """A frame payload of known size written by ``fill(memoryview)`` under the writer lock.

    Lets a serializer (Arrow IPC) write straight into the ring instead of
    into a buffer that is then copied.  ``fill`` must write exactly ``nbytes``
    and must not touch the spool.
    """

    __slots__ = ("nbytes", "fill")

    def __init__(self, nbytes, fill):
        self.nbytes, self.fill = nbytes, fill


def as_view(data):
    """``data`` as bytes, bytearray or a flat byte memoryview.

    :raises TypeError: not bytes-like (or a str).
    :raises ValueError: not C-contiguous.
    """
    if isinstance(data, (bytes, bytearray)):
        return data
    if isinstance(data, str):
        raise TypeError("frames are bytes-like objects, not str: encode it first (e.g. s.encode())")
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"frames are bytes-like objects, not {type(data).__name__}") from None
    if not view.c_contiguous:
        raise ValueError("frame buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class Writer:
    """The write path of one spool handle (see the module docstring).

    ``owner`` is the :class:`shmq.Spool` facade (handed to the crash hook).
    """

    def __init__(self, owner, ring, slots, pins, lock, data_bell, space_bell, *, policy, checksum,
                 sync):
        self._owner = owner
        self.path = ring.path
        self._ring = ring
        self._core = ring.core
        self._slots = slots
        self._pins = pins
        self._lock = lock
        self._data_bell = data_bell
        self._space_bell = space_bell
        self.policy = policy
        self._overwrite = policy == "overwrite"
        self.checksum = checksum
        self._crc_flag = FLAG_CRC if checksum else 0
        self.sync = sync
        self.max_payload = min(ring.size - FRAME_BYTES, F.MAX_FRAME_PAYLOAD)
        #: shmq.Queue's rule: a ring full to its ceiling raises Full at once
        #: (``multiprocessing.Queue(maxsize=0)`` never blocks a put)
        self.full_is_ceiling = False
        self._full_marker = None  # room marker of the Python general path
        self._full_reason = None  # and why it found no room: "bytes", "backlog" or "pin"
        self._rate_until = 0  # end of the second self._rate_word counts (general path)
        self._rate_word = W_RATE + 1

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
        once the batch is placed, before anything is written; raising aborts
        the batch (shmq.WorkQueue's key index).  ``timestamps`` (one per frame,
        ns) replaces the frames' put time, e.g. when importing a dump; the
        statistics still count the put at the current time.

        :raises shmq.TooLarge: can never fit.
        :raises shmq.Full: no room in time (or policy "error").
        :raises shmq.Timeout: the lock's live holder did not release it in time.
        :raises ValueError: ``timestamps`` is not one int per frame.
        """
        if (before_commit is not None or timestamps is not None or self.sync
                or any(type(v) is Deferred for v in views)):
            return self.append_general(views, timeout, codec, max_backlog, before_commit,
                                       timestamps)
        backlog = -1 if max_backlog is None else max_backlog
        deadline, lock_deadline = self._deadlines(timeout)
        put_many = self._core.put_many
        while True:
            st = retry_stuck(lambda wait: put_many(views, codec, backlog, wait), self._lock,
                             lock_deadline, _is_lock_stuck, lambda: self._lock_timeout(timeout))
            if st >= 0:
                return st
            if st == _TOO_LARGE:
                self._raise_too_large(views, max_backlog)
            if st == _SLOW:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                return self.append_general(views, left, codec, max_backlog, before_commit)
            if st == _NO_SPACE:
                raise self.no_space()
            # _NO_ROOM (bytes: consumers' cursors in the way) or _BACKLOG (maxsize items)
            marker = self._core.full_marker()  # taken under the lock
            if st != _BACKLOG:
                self._check_ceiling()
            self._wait_for_room(marker, deadline, timeout, error=max_backlog is None)

    def reserve(self, nbytes, codec, timeout):
        """An open :class:`shmq._core.Reservation` of ``nbytes`` (see :meth:`shmq.Spool.reserve`).

        :raises shmq.TooLarge: ``nbytes`` can never fit.
        :raises shmq.Full: no room in time (or policy "error").
        :raises shmq.Timeout: the lock's live holder did not release it in time.
        """
        if nbytes > self.max_payload:
            raise TooLarge(f"frame of {nbytes} bytes can never fit: this spool's largest "
                           f"frame is {self.max_payload} bytes (capacity {self._ring.size})")
        timeout = check_block_timeout(True, timeout)
        deadline, lock_deadline = self._deadlines(timeout)
        reserve = self._core.reserve
        while True:
            got = retry_stuck(lambda wait: reserve(nbytes, codec, wait), self._lock, lock_deadline,
                              _is_lock_stuck, lambda: self._lock_timeout(timeout, holder=False))
            if type(got) is not int:
                return got
            if got == _NO_SPACE:
                raise self.no_space()
            if got == _SLOW:  # a zero-copy pin is in the way: reclaim dead holders' pins
                with self._lock:
                    self._pins.floor(1 << 62)
            self._wait_for_room(self._core.full_marker(), deadline, timeout,
                                error=got != _SLOW, poll=got == _SLOW)

    def room_marker(self):
        """What must change before a writer blocked on a full spool retries
        (the same pair as the core's ``full_marker()``): the slowest named
        cursor (or FIRST_POS) and the oldest pin."""
        floor = self._slots.floor(F.S_POS)
        pin = self._pins.floor(None)
        return (self._ring.ctl[W_FIRST_POS] if floor is None else floor,
                _NO_PIN_MARK if pin is None else pin)

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
        """Raise Full (policy "error", or ``deadline`` passed), else park until the room
        marker moves from ``marker`` (taken under the lock: no change is missed)."""
        if error and self.policy == "error":
            raise Full(f"spool {self.path} is full (on_full='error')")
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise Full(f"spool {self.path} is still full after {timeout} s")
        self._space_bell.wait(lambda: self.room_marker() != marker,
                              0.1 if poll and left is None else left)

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

    # -- the general path -------------------------------------------------------

    def append_general(self, views, timeout, codec, max_backlog=None, before_commit=None,
                       timestamps=None) -> int:
        """:meth:`append` in Python: the reference write path, and the one for what the
        core does not do (deferred payloads, ``before_commit``, ``sync``, pins).

        Same arguments, guarantees and errors as :meth:`append`.
        """
        views = tuple(v if type(v) in (bytes, tuple, Deferred) else as_view(v) for v in views)
        if timestamps is not None:
            timestamps = [int(t) for t in timestamps]
            if len(timestamps) != len(views) or not all(0 <= t < 1 << 64 for t in timestamps):
                raise ValueError("timestamps must be one u64 (ns) per frame")
        ring = self._ring.size
        needs = []
        total = 0
        max_payload = self.max_payload
        for v in views:
            tv = type(v)
            if tv is bytes or tv is bytearray:
                n = len(v)
            elif tv is tuple:
                n = sum(len(x) if type(x) is not memoryview else x.nbytes for x in v)
            elif tv is Deferred:
                n = v.nbytes
            else:
                n = v.nbytes if tv is memoryview else len(v)
            if n > max_payload:
                raise TooLarge(f"frame of {n} bytes can never fit: this spool's largest "
                               f"frame is {self.max_payload} bytes (capacity {ring})")
            need = FRAME_BYTES + ((n + 7) & ~7)
            needs.append((n, need))
            total += need
        if total > ring:
            raise TooLarge(f"batch of {len(views)} frames needs {total} bytes, more than the "
                           f"ring's {ring}; split it")
        if max_backlog is not None and len(views) > max_backlog:
            raise TooLarge(f"batch of {len(views)} items can never fit under maxsize {max_backlog}")
        # Checksums are computed before taking the lock (slow work outside locks).
        crcs = [_crc_parts(v) for v in views] if self.checksum else None
        flags = self._crc_flag
        deadline = None if timeout is None else time.monotonic() + timeout
        rt = self._lock.recovery_timeout
        while True:
            # The lock is held for a copy; only a live holder that is stuck (or
            # a dead one not yet recovered) delays us, so even a non-blocking
            # put waits for it, up to the recovery timeout.
            lock_wait = None if deadline is None else max(rt, deadline - time.monotonic())
            try:  # the try covers the acquire: no signal can land between the two
                self._lock.acquire(lock_wait)
                seq = self._write_locked(views, needs, total, crcs, flags, codec, max_backlog,
                                         before_commit, timestamps)
            finally:
                self._lock.release_if_held()  # sem_post: also the fence before reading waiters
            if seq is not None:
                if self._data_bell.has_waiters():
                    self._data_bell.ring()
                return seq
            if self._full_reason == "bytes":
                self._check_ceiling()
            self._wait_for_room(self._full_marker, deadline, timeout)

    def _write_locked(self, views, needs, total, crcs, flags, codec, max_backlog=None,
                      before_commit=None, timestamps=None):
        """Place, write and publish a batch; None if there is no room (not block-able here)."""
        r = self._ring
        ctl, mm, ring, base = r.ctl, r.mm, r.size, r.base
        seq0 = seq = ctl[W_NEXT_SEQ]
        pos = ctl[W_NEXT_POS]
        if max_backlog is not None:
            floor_seq = self._slots.floor(F.S_SEQ)
            if floor_seq is not None and seq0 - floor_seq + len(views) > max_backlog:
                self._full_marker = self.room_marker()
                self._full_reason = "backlog"
                return None
        # Placement: a frame that does not fit before the ring's end is
        # preceded by padding to the end (a PAD header if 32+ bytes remain).
        placed = []
        pads = []  # (ring offset, bytes, index of the frame that follows)
        for k, (n, need) in enumerate(needs):
            off = pos % ring
            if ring - off < need:
                if ring - off >= FRAME_BYTES:
                    pads.append((off, ring - off, k))
                pos += ring - off
            placed.append(pos)
            pos += need
        end = pos
        if end - placed[0] > ring:
            # The batch would wrap onto itself: start it at the ring's start.
            pos = ctl[W_NEXT_POS]
            off = pos % ring
            pads = [(off, ring - off, 0)] if off and ring - off >= FRAME_BYTES else []
            pos += (ring - off) if off else 0
            placed = []
            for n, need in needs:
                placed.append(pos)
                pos += need
            end = pos
        if ctl[F.W_SEGMENT]:  # a growable ring: the pages first, before anything is evicted
            self._allocate(ctl[W_NEXT_POS], placed, needs, pads)
        if end - ctl[W_FIRST_POS] > ring:
            if not self._make_room(end - ring, seq0, placed[0]):
                return None
        if before_commit is not None:
            before_commit(seq0, placed)
        ts = _time_ns()
        for off, gap, k in pads:
            _pack_frame(mm, base + off, seq0 + k, gap, 0, ts, 0, FLAG_PAD, 0, 0)
        nbytes = 0
        crash = crash_hook
        view = r.view
        stamps = timestamps or (ts,) * len(views)
        for v, (n, need), p, crc, fts in zip(views, needs, placed, crcs or _ZEROS * len(views),
                                             stamps):
            o = base + p % ring
            _pack_frame(mm, o, seq, need, n, fts, crc, flags, codec, 0)
            o += FRAME_BYTES
            tv = type(v)
            if tv is tuple:
                for part in v:
                    k = len(part) if type(part) is not memoryview else part.nbytes
                    mm[o:o + k] = part
                    o += k
            elif tv is Deferred:
                v.fill(view[o:o + n])  # e.g. Arrow IPC written straight into the ring
                if crcs:
                    _pack_frame(mm, o - FRAME_BYTES, seq, need, n, fts, _crc(view[o:o + n]),
                                flags, codec, 0)
            else:
                mm[o:o + n] = v
            seq += 1
            nbytes += n
            if crash is not None:
                crash("frame-written", self._owner)
        if self.sync:
            self._msync(placed[0], end)  # frames durable before they are published
        # The commit point (NEXT_POS is re-derived on recovery): a release store in
        # the core, so on aarch64 no reader sees NEXT_SEQ before the frames' bytes.
        self._core.store_release(W_NEXT_SEQ, seq)
        if crash_hook is not None:
            crash_hook("committed", self._owner)
        ctl[W_NEXT_POS] = end
        if self.sync:
            mm.flush(0, F.HEADER_BYTES)  # ... and the commit itself
        self._account_put(ctl, seq - seq0, nbytes, ts)
        return seq0

    def _allocate(self, start, placed, needs, pads):
        """Allocate the ring offsets a placed batch touches (growable rings; the core's
        own write path also wraps early, this reference path only grows)."""
        ring = self._ring.size
        n_off = start % ring
        lap = start - n_off
        top, low = n_off, 0
        for p, (_n, need) in zip(placed, needs):
            if p < lap + ring:
                top = max(top, p - lap + need)
            else:
                low = max(low, p - lap - ring + need)
        for off, _gap, _k in pads:
            top = max(top, off + FRAME_BYTES)
        for lo, hi in ((n_off, top), (0, low)):
            if hi > lo and self._core.zone_alloc(lo, hi) == _NO_SPACE:
                raise self.no_space()

    def _account_put(self, ctl, count, nbytes, ts):
        """Writer statistics (exact: called under the writer lock).

        Kept to three shared stores: puts are ``next_seq`` itself, and the
        high-water marks are recorded just before evicting (_make_room) and
        completed with the current fill when stats are read.
        """
        ctl[W_PUT_BYTES] = (ctl[W_PUT_BYTES] + nbytes) & _MASK64
        ctl[W_LAST_PUT_NS] = ts
        if ts >= self._rate_until:
            self._roll_rate(ts)
        ctl[self._rate_word] = (ctl[self._rate_word] + count) & _MASK64

    def _roll_rate(self, ts):
        """Point ``_rate_word`` at the puts counter of second ``ts`` (resetting a stale bucket)."""
        ctl = self._ring.ctl
        sec = ts // 1_000_000_000
        b = W_RATE + (sec % RATE_SECONDS) * RATE_WORDS
        self._rate_word = b + 1
        self._rate_until = (sec + 1) * 1_000_000_000
        if ctl[b] != sec:
            ctl[b] = sec
            ctl[b + 1] = 0
            ctl[b + 2] = 0

    def _msync(self, start, end):
        ring, base = self._ring.size, self._ring.base
        a, b = start % ring, end % ring or ring
        spans = [(a, b)] if a < b else [(a, ring), (0, b)]
        for lo, hi in spans:
            lo_page = (base + lo) // F.PAGE * F.PAGE
            self._ring.mm.flush(lo_page, base + hi - lo_page)

    def _record_high_water(self, ctl):
        """Fold the current fill into the high-water marks (fill only shrinks by eviction)."""
        frames = ctl[W_NEXT_SEQ] - ctl[W_FIRST_SEQ]
        used = ctl[W_NEXT_POS] - ctl[W_FIRST_POS]
        if frames > ctl[W_HIGH_FRAMES]:
            ctl[W_HIGH_FRAMES] = frames
        if used > ctl[W_HIGH_BYTES]:
            ctl[W_HIGH_BYTES] = used

    def _make_room(self, limit, next_seq, batch_pos):
        """Evict frames below byte position ``limit`` (writer lock held).

        In block/error mode nothing a named reader or group has not
        consumed is evicted; returns False if that leaves too little room.
        """
        r = self._ring
        ctl = r.ctl
        if self._pins.floor(limit) is not None:  # a zero-copy view still reads that frame
            self._full_marker = self.room_marker()
            self._full_reason = "pin"
            return False
        if not self._overwrite:
            floor = self._slots.floor(F.S_POS)
            if floor is None:
                floor = ctl[W_FIRST_POS]  # no consumers registered: keep everything
            if floor < limit and floor < ctl[W_NEXT_POS]:
                self._full_marker = self.room_marker()
                self._full_reason = "bytes"
                return False  # unconsumed frames in the way (all consumed: evict all)
        mm, ring, base = r.mm, r.size, r.base
        seq, pos = ctl[W_FIRST_SEQ], ctl[W_FIRST_POS]
        start_seq = seq
        self._record_high_water(ctl)
        walk_start = pos
        while pos < limit and seq < next_seq:
            off = pos % ring
            if ring - off < FRAME_BYTES:
                pos += ring - off
                continue
            hseq, stored, length, _ts, _crc32, flags, _c, _x = _unpack_frame(mm, base + off)
            # As in the core: a PAD fills the ring's tail exactly and never
            # starts it; no walk of resident frames spans more than the ring.
            if (hseq != seq or not F.valid_frame_header(stored, length, off, ring)
                    or flags & FLAG_PAD and (off == 0 or off + stored != ring)
                    or pos + stored - walk_start > ring):
                raise SpoolFormatError(
                    f"{self.path}: ring is corrupt at seq {seq} (offset {off}: header says seq "
                    f"{hseq}, {stored} bytes); {RING_ADVICE}")
            pos += stored
            if not flags & FLAG_PAD:
                seq += 1
        if seq >= next_seq:
            # Everything evicted: the ring restarts at this batch, where an older
            # lap's header may still look valid, so the seq goes first (a writer
            # killed in between leaves an empty ring for recovery; as in the core).
            # Release stores (in the core), as publish_first's: readers load them with acquire.
            self._core.store_release(W_FIRST_SEQ, seq)
            if crash_hook is not None:
                crash_hook("evicting", self._owner)
            self._core.store_release(W_FIRST_POS, batch_pos)
        else:
            self._core.store_release(W_FIRST_POS, pos)  # position first: readers re-derive seq from its header
            if crash_hook is not None:
                crash_hook("evicting", self._owner)
            self._core.store_release(W_FIRST_SEQ, seq)
        ctl[W_EVICTED] = (ctl[W_EVICTED] + seq - start_seq) & _MASK64
        return True


def _payload_size(v):
    tv = type(v)
    if tv is tuple:
        return sum(memoryview(x).nbytes for x in v)
    if tv is Deferred:
        return v.nbytes
    return memoryview(v).nbytes


def _crc_parts(v):
    if type(v) is Deferred:
        return 0  # computed after fill(), under the lock
    if type(v) is not tuple:
        return _crc(v)
    crc = 0
    for part in v:
        crc = zlib.crc32(part, crc)
    return crc


def _is_lock_stuck(status):
    return type(status) is int and status == _LOCK_STUCK

