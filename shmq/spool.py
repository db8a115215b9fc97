"""The spool: a shared-memory ring of frames with many writers and many readers.

Writers serialize on one recoverable semaphore lock, append frames and
publish them with a release store of ``NEXT_SEQ`` (the commit point).
Readers never take the writer lock: they acquire-load ``NEXT_SEQ``, read the
frame at their cursor, check its seq, copy it, and re-check ``FIRST_POS`` to
detect an overwrite that raced with the copy (seqlock style).  See
docs/format.md.

The hot path (put, put_many, reads, eviction, the lock's fast path) is the
compiled core :mod:`shmq._core`; this module keeps the lifecycle, the
general write path for what the core hands back (zero-copy pins in the way,
deferred payloads, ``sync=True``), lock recovery and statistics shaping.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import time
import weakref
import zlib

from . import _core
from . import _format as F
from ._format import (
    FLAG_CRC, FLAG_PAD, FRAME, FRAME_BYTES, W_EVICTED, W_FIRST_POS, W_FIRST_SEQ, W_HIGH_BYTES,
    W_HIGH_FRAMES, W_LAST_PUT_NS, W_NEXT_POS, W_NEXT_SEQ, W_PUT_BYTES,
    CODEC_PICKLE_OOB, W_LOCK_HOLDER, W_RATE, RATE_SECONDS, RATE_WORDS,
)
from ._lock import (
    LOCK_RECOVERY_TIMEOUT_S, RecoverableLock, holder_pid, holder_word, ofd_lock, ofd_locked_by_other,
    ofd_unlock,
)
from ._mapping import (
    SEM_READ_WAITERS, SEM_SPACE_WAITERS, SEM_WRITER, Mapping, create_file, open_semaphore,
    destroy_file, resolve_path, sem_name, unlink_semaphores,
)
from ._notify import Doorbell
from posix_ipc import BusyError
from .errors import FrameLost, Full, ShmqError, SpoolFormatError, Timeout, TooLarge
from .stats import ReaderStats, SpoolStats

_core.setup(SpoolFormatError, pickle.loads)
# The core mirrors the layout of _format: refuse to run if they ever disagree.
_mismatch = {k: v for k, v in _core.LAYOUT.items() if getattr(F, k) != v}
if _mismatch:  # pragma: no cover - a build of the core from another version
    raise ImportError(f"shmq._core does not match shmq._format: {_mismatch}")

log = logging.getLogger("shmq")

__all__ = ["Spool", "Frame"]

_unpack_frame = FRAME.unpack_from
_pack_frame = FRAME.pack_into
_time_ns = time.time_ns
_crc = F.frame_crc

#: What to do about a damaged ring (fsck --repair never rewrites frames, so it cannot fix one).
RING_ADVICE = ("see 'shmq fsck'; to keep what is readable: 'shmq export --skip-corrupt', "
               "'shmq rm', 'shmq import'")

_open_spools: "weakref.WeakSet[Spool]" = weakref.WeakSet()
#: Positions and seqs never get near 2**62 (centuries at memory bandwidth);
#: larger values can only come from corruption.
_MAX_COUNTER = 1 << 62
_MASK64 = (1 << 64) - 1
_ZEROS = (0,)

#: Test hook for the fault-injection harness (stress/kill9.py), set with
#: :func:`set_crash_hook`: called as hook(point, spool) inside the writer's
#: critical section, on batch writes, at points "evicting" (between the
#: FIRST_POS and FIRST_SEQ stores), "frame-written" (after each frame of a
#: batch) and "committed" (between the NEXT_SEQ and NEXT_POS stores).  Never
#: set in production.
_crash_hook = None


def set_crash_hook(hook) -> None:
    """Install the fault-injection hook in the core and the general path (tests only)."""
    global _crash_hook
    _crash_hook = hook
    _core.set_crash_hook(hook)


#: One message: ``(seq, timestamp_ns, data)``, a tuple with named fields
#: (built by the core); ``frame.codec`` is the payload's codec tag.
Frame = _core.Frame
#: An open reservation (see :meth:`Spool.reserve`).
Reservation = _core.Reservation
_LOCK_STUCK, _NO_ROOM, _SLOW, _TOO_LARGE = _core.LOCK_STUCK, _core.NO_ROOM, _core.SLOW, _core.TOO_LARGE
_NO_PIN_MARK = (1 << 64) - 1


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


def _as_view(data):
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


class Spool:
    """A fixed-capacity, memory-mapped message ring shared by processes.

    Create with :meth:`create`, attach with :meth:`open`.  Handles are
    cheap, pickle to their path (``pickle.loads`` reattaches), and are safe
    across ``fork`` (the child gets its own file description).  One handle
    should not be used by several threads at once.
    """

    def __init__(self, path, *, sync=False, recovery_timeout=LOCK_RECOVERY_TIMEOUT_S):
        """Attach to an existing spool: prefer :meth:`open`."""
        path = resolve_path(path)
        self._map = Mapping(path)
        try:
            self._setup(sync, recovery_timeout)
        except BaseException:
            self._map.close()
            raise
        _open_spools.add(self)

    def _setup(self, sync, recovery_timeout):
        m = self._map
        geo = m.geo
        self.path = m.path
        self._geo = geo
        self._sync = bool(sync)
        self._recovery_timeout = recovery_timeout
        self._mm = m.mm
        self._view = m._view
        self._ctl = m.ctl
        self._slots = m.slots
        self._ring = geo["ring_bytes"]
        self._base = geo["ring_offset"]
        self._policy = geo["policy"]
        self._overwrite = self._policy == "overwrite"
        self._checksum = geo["checksum"]
        self._crc_flag = FLAG_CRC if self._checksum else 0
        self._max_payload = min(self._ring - FRAME_BYTES, F.MAX_FRAME_PAYLOAD)
        prefix = geo["sem_prefix"]
        self._sem_prefix = prefix
        self._sem_mode = mode = m.st_mode & 0o666
        own = {"owner": m.st_uid, "group": m.st.st_gid}  # squatted semaphores are refused
        self._writer_sem = open_semaphore(sem_name(prefix, SEM_WRITER), 1, mode, **own)
        self._wlock = RecoverableLock(
            self._writer_sem, self._ctl, F.W_LOCK_HOLDER, F.W_LOCK_TOKEN, m,
            F.RECOVERY_LOCK_BYTE, breaks_word=F.W_LOCK_BREAKS, recovery_timeout=recovery_timeout,
            on_recover=self._recover_writer)
        self._data_bell = Doorbell(m, F.DOORBELL_BYTE, open_semaphore(
            sem_name(prefix, SEM_READ_WAITERS), 0, mode, **own))
        self._space_bell = Doorbell(m, F.DOORBELL_BYTE, open_semaphore(
            sem_name(prefix, SEM_SPACE_WAITERS), 0, mode, **own))
        # the core opens the same three names, which open_semaphore has just checked
        self._core = _core.Ring(
            m.mm, m.path, geo["ring_offset"], geo["ring_bytes"], geo["slot_offset"],
            geo["slot_count"], F.POLICIES.index(self._policy), self._checksum,
            sem_name(prefix, SEM_WRITER), sem_name(prefix, SEM_READ_WAITERS),
            sem_name(prefix, SEM_SPACE_WAITERS), m.fd, holder_word(), float(recovery_timeout))
        self._core.bind(self, not self._sync)
        # The uncontended put in one C call; it hands anything else to _put_slow.
        self.put = self._core.put_api
        if os.fstat(m.fd).st_nlink == 0:
            # Destroyed while we opened it: our O_CREAT may have re-created
            # semaphores that destroy() had just unlinked; do not leak them.
            for sem in (self._writer_sem, self._data_bell.sem, self._space_bell.sem):
                sem.close()
            self._core.close()
            unlink_semaphores(prefix, 0)
            raise FileNotFoundError(errno.ENOENT, "the spool was destroyed while being opened",
                                    m.path)
        self._check_control()
        self._readers = weakref.WeakSet()
        self._slot_refs = {}  # slot -> readers of this handle attached to it
        self._locate_hint = None
        self._full_marker = None  # room marker of the Python general path
        self._pin_slot = None  # this handle's slot in the table for zero-copy pins
        self._pins = {}  # pinned position -> views referencing it
        self._rate_until = 0  # end of the second self._rate_word counts (general path)
        self._rate_word = W_RATE + 1
        self._holder = holder_word()

    def _check_control(self):
        """Refuse control words no writer could have left (bit rot, foreign writes).

        Read lock-free while writers may be running: FIRST_* before NEXT_*
        (both only grow), and a suspicious reading is re-read a few times
        before it is believed, so a live spool is never called corrupt.
        """
        ctl, ring = self._ctl, self._ring
        for attempt in range(5):
            fseq, fpos = ctl[W_FIRST_SEQ], ctl[W_FIRST_POS]
            nseq, npos = ctl[W_NEXT_SEQ], ctl[W_NEXT_POS]
            if max(nseq, npos, fseq, fpos) >= _MAX_COUNTER:
                problem = "counter out of range"
            elif fseq > nseq:
                problem = f"first seq {fseq} > next seq {nseq}"
            elif npos - fpos > ring if npos >= fpos else fpos - npos > ring:
                problem = f"positions {fpos}..{npos} span more than the ring"
            else:
                return
            # (finer consistency, e.g. frames vs bytes, is fsck's job: a writer
            # killed between two control stores leaves them briefly out of step)
            time.sleep(0.001 * attempt)
        raise SpoolFormatError(f"{self.path}: control block is corrupt ({problem}); "
                               "it cannot be repaired: remove it ('shmq rm') and create it again")

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, path, capacity="64MiB", on_full="overwrite", mode=0o600, *, readers=F.DEFAULT_SLOTS,
               leases=F.DEFAULT_LEASES, checksum=False, exist_ok=False, sync=False,
               recovery_timeout=LOCK_RECOVERY_TIMEOUT_S) -> "Spool":
        """Create a spool file and return a handle to it.

        ``capacity`` is the data ring's size in bytes (int or "64MiB"; rounded
        up to 4 KiB); the file also holds a 4 KiB header, a table of
        ``readers`` named reader/group slots and ``leases`` lease slots.  The
        file is pre-allocated (never sparse), created with ``mode`` exactly
        (not masked by the umask), without following symlinks, and appears
        at ``path`` only once complete.  ``checksum=True`` stores a CRC-32 of
        each payload, verified by ``fsck`` and by readers with ``verify=True``
        (off by default: it costs writers ~0.2 us per 100-byte frame and
        ~0.3 ms per MiB, while torn reads are already ruled out by the seq
        and FIRST_POS checks).

        :raises FileExistsError: ``path`` exists and ``exist_ok`` is false.
        :raises ValueError: bad capacity, policy, or slot counts.
        """
        if on_full not in F.POLICIES:
            raise ValueError(f"on_full must be one of {F.POLICIES}, not {on_full!r}")
        ring = F.parse_size(capacity)
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise ValueError(f"mode must be a permission int like 0o600, not {mode!r}")
        if isinstance(readers, bool) or not isinstance(readers, int) or not 1 <= readers <= F.MAX_SLOTS:
            raise ValueError(f"readers must be an int in 1..{F.MAX_SLOTS}")
        if isinstance(leases, bool) or not isinstance(leases, int) or not 0 <= leases <= 1 << 20:
            raise ValueError("leases must be an int in 0..1048576")
        resolved = resolve_path(path)
        if exist_ok and os.path.lexists(resolved):
            try:  # attach without first allocating (and discarding) a full-size file
                return cls(resolved, sync=sync, recovery_timeout=recovery_timeout)
            except FileNotFoundError:
                pass  # removed meanwhile: create it
        try:
            create_file(resolved, ring_bytes=ring, policy=on_full, mode=mode, slots=readers,
                        leases=leases, checksum=checksum)
        except FileExistsError:
            if not exist_ok:
                raise
        return cls(resolved, sync=sync, recovery_timeout=recovery_timeout)

    @classmethod
    def open(cls, path, *, sync=False, recovery_timeout=LOCK_RECOVERY_TIMEOUT_S) -> "Spool":
        """Attach to an existing spool.

        ``sync=True`` makes every put ``msync`` the pages it wrote (for spools
        on a disk path: durable across a machine crash, at a large cost).

        :raises FileNotFoundError: nothing at ``path``.
        :raises shmq.SpoolFormatError: not a spool, corrupt, truncated, or a newer format.
        """
        return cls(path, sync=sync, recovery_timeout=recovery_timeout)

    @staticmethod
    def destroy(path) -> None:
        """Remove a spool file and its semaphores, whatever state the file is in
        (truncated or header-corrupt spools too).

        Processes that still have it open keep working on the unlinked
        file until they close it.  A file that is not a spool is left alone.

        :raises FileNotFoundError: nothing at ``path``.
        :raises shmq.NotASpool: not a spool, or a symbolic link, FIFO, socket, device or
            directory (left alone).
        """
        destroy_file(resolve_path(path))

    def close(self) -> None:
        """Detach: close this handle's readers, release their slots, unmap. Idempotent."""
        if getattr(self, "_map", None) is None or self._map.mm is None:
            return
        for r in list(self._readers):
            r.close()
        if self._pin_slot is not None:  # views still alive keep their mapping, not their pins
            self._slots[self._pin_slot * F.SLOT_WORDS + F.S_STATE] = F.SLOT_FREE
            ofd_unlock(self._map.fd, self._slot_byte(self._pin_slot, F.SLOT_LIVE_BYTE))
            self._pin_slot = None
        self._data_bell.close()
        self._space_bell.close()
        for sem in (self._writer_sem, self._data_bell.sem, self._space_bell.sem):
            sem.close()
        self._core.close()  # drops its export of the mapping: unmapping can proceed
        self._wlock.close()
        self._ctl = self._slots = self._mm = self._view = None
        self._map.close()
        _open_spools.discard(self)

    @property
    def closed(self) -> bool:
        return self._mm is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        return (_reopen, (self.path, self._sync, self._recovery_timeout))

    def __repr__(self):
        state = "closed" if self.closed else f"seq {self.first_seq}..{self.next_seq}"
        return f"<shmq.Spool {self.path!r} {self._policy} {self._ring} B {state}>"

    def _after_fork_in_child(self):
        # The inherited descriptor shares the parent's OFD locks and inotify
        # instance; take private ones so liveness and wake-ups stay per process.
        self._map.reopen_fd()
        self._data_bell.forget_after_fork()
        self._space_bell.forget_after_fork()
        self._holder = holder_word()
        self._core.set_fd(self._map.fd, self._holder)
        self._wlock.set_holder(self._holder)
        self._pin_slot = None  # the parent's pins stay the parent's
        self._pins = {}
        for r in list(self._readers):
            r._after_fork_in_child()

    # ------------------------------------------------------------ properties

    @property
    def capacity(self) -> int:
        """Size of the data ring in bytes."""
        return self._ring

    @property
    def on_full(self) -> str:
        return self._policy

    @property
    def first_seq(self) -> int:
        """Seq of the oldest frame still in the ring."""
        return self._ctl[W_FIRST_SEQ]

    @property
    def next_seq(self) -> int:
        """Seq the next committed frame will get (all below it are readable)."""
        return self._ctl[W_NEXT_SEQ]

    @property
    def max_frame_bytes(self) -> int:
        """Largest payload one frame can carry in this spool."""
        return self._max_payload

    def _check_open(self):
        if self._mm is None:
            raise ValueError("spool handle is closed")

    # ------------------------------------------------------------ writing

    def put(self, data, *, block=True, timeout=None, codec=F.CODEC_RAW) -> int:
        """Append one frame; return its seq.

        Atomic: readers see the whole frame or nothing, also if this process
        is killed at any point.  Blocks only to take the writer lock and, for
        ``on_full="block"``, until the slowest named reader/group frees room
        (``block=False`` or ``timeout`` bound the wait).

        :raises TypeError: ``data`` is not bytes-like.
        :raises shmq.TooLarge: the frame can never fit in this ring.
        :raises shmq.Full: no room (policy "error", or block policy timed out).
        :raises shmq.Timeout: the writer lock's (live) holder did not release in time.
        """
        # (Handles bind this name to the core's put_api, which does exactly
        # this in C; this body is the reference and the unbound entry point.)
        if block and timeout is None and not self._sync:
            seq = self._core.put(data, codec)  # the whole uncontended put, in C
            if seq >= 0:
                return seq
        return self._put_slow(data, block, timeout, codec)

    def _put_slow(self, data, block, timeout, codec):
        """Everything the core's put could not finish: validation, waits, recovery."""
        timeout = None if block and timeout is None else check_block_timeout(block, timeout)
        return self._append((data,), timeout, codec)

    def put_many(self, items, *, block=True, timeout=None, codec=F.CODEC_RAW) -> int:
        """Append several frames as one atomic, contiguous batch; return the first seq.

        Readers see all of the batch or none of it, with consecutive seqs and
        no other writer's frame in between.  A 1-d numpy array (e.g. of a
        structured dtype) is written in record-stream mode: whole records in
        as few numpy frames as fit (see :mod:`shmq.columnar`).

        :raises shmq.TooLarge: the batch can never fit in this ring.
        """
        if type(items).__module__ == "numpy" and getattr(items, "ndim", 0) == 1:
            from .columnar import put_records

            return put_records(self, items, block=block, timeout=timeout)
        if type(items) is not list and type(items) is not tuple:
            items = list(items)
        if not items:
            raise ValueError("put_many() needs at least one item")
        return self._append(items, check_block_timeout(block, timeout), codec)

    def _append(self, views, timeout, codec, max_backlog=None, before_commit=None):
        """Write a batch through the core; wait for the lock's recovery or for room.

        ``views`` is a list or tuple of frames, each bytes-like or a tuple of
        bytes-likes (segments written one after the other, no concatenation).
        ``max_backlog`` bounds the frames not yet consumed by the slowest
        named reader/group (shmq.Queue's ``maxsize``); exceeding it waits
        like a full ring.  Deferred payloads, ``before_commit`` hooks,
        ``sync=True`` and zero-copy pins in the way take the general path
        (:meth:`_append_general`).

        :raises shmq.TooLarge: can never fit.
        :raises shmq.Full: no room in time (or policy "error").
        :raises shmq.Timeout: the lock's live holder did not release it in time.
        """
        if self._mm is None:
            self._check_open()
        if before_commit is not None or self._sync or any(type(v) is Deferred for v in views):
            return self._append_general(views, timeout, codec, max_backlog, before_commit)
        backlog = -1 if max_backlog is None else max_backlog
        rt = self._recovery_timeout
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        # The lock is held for a copy; only a live holder that is stuck (or a
        # dead one not yet recovered) delays us, so even a non-blocking put
        # waits for it, up to the recovery timeout.
        lock_deadline = None if timeout is None else now + max(rt, timeout)
        while True:
            lock_wait = rt if lock_deadline is None else max(0.0, min(rt, lock_deadline - time.monotonic()))
            st = self._core.put_many(views, codec, backlog, lock_wait)
            if st >= 0:
                return st
            if st == _LOCK_STUCK:
                if lock_deadline is not None and time.monotonic() >= lock_deadline:
                    raise Timeout(f"writer lock of {self.path} not acquired within "
                                  f"{max(rt, timeout)} s (held by pid "
                                  f"{holder_pid(self._ctl[F.W_LOCK_HOLDER])})")
                self._wlock.recover_if_dead()
                continue
            if st == _TOO_LARGE:
                self._raise_too_large(views, max_backlog)
            if st == _SLOW:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                return self._append_general(views, left, codec, max_backlog, before_commit)
            # _NO_ROOM
            if self._policy == "error" and max_backlog is None:
                raise Full(f"spool {self.path} is full (on_full='error')")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise Full(f"spool {self.path} is still full after {timeout} s")
            marker = self._core.full_marker()  # taken under the lock: no change is missed
            self._space_bell.wait(lambda: self._room_marker() != marker, left)

    def reserve(self, nbytes, *, codec=F.CODEC_RAW, timeout=None) -> "Reservation":
        """Room for one frame of exactly ``nbytes``, written in place (zero-copy)::

            with sp.reserve(len(payload)) as buf:   # a writable memoryview
                buf[:] = payload                    # or np.frombuffer(buf, ...)[:] = ...

        The frame is committed (gets ``reservation.seq``) when the block exits
        cleanly and abandoned when it raises; a process killed inside the
        block exposes nothing (its lock is recovered like any writer's).
        While a reservation is open it holds the writer lock: other writers
        wait, so keep the block short, and do not put to the same spool from
        the same thread inside it (that raises RuntimeError).  The buffer is
        valid only inside the block.

        Blocks like :meth:`put` for room (``on_full="block"``) or a stuck lock.

        :raises shmq.TooLarge: ``nbytes`` can never fit.
        :raises shmq.Full: no room in time (or policy "error").
        :raises shmq.Timeout: the lock's live holder did not release it in time.
        """
        self._check_open()
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"nbytes must be an int, not {type(nbytes).__name__}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be non-negative, not {nbytes}")
        if nbytes > self._max_payload:
            raise TooLarge(f"frame of {nbytes} bytes can never fit: this spool's largest "
                           f"frame is {self._max_payload} bytes (capacity {self._ring})")
        timeout = check_block_timeout(True, timeout)
        rt = self._recovery_timeout
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        lock_deadline = None if timeout is None else now + max(rt, timeout)
        while True:
            lock_wait = rt if lock_deadline is None else max(0.0, min(rt, lock_deadline - time.monotonic()))
            got = self._core.reserve(nbytes, codec, lock_wait)
            if type(got) is not int:
                return got
            if got == _LOCK_STUCK:
                if lock_deadline is not None and time.monotonic() >= lock_deadline:
                    raise Timeout(f"writer lock of {self.path} not acquired within "
                                  f"{max(rt, timeout)} s")
                self._wlock.recover_if_dead()
                continue
            if got == _SLOW:  # a zero-copy pin is in the way: reclaim dead holders' pins
                with self._wlock:
                    self._pin_floor(1 << 62)
            elif self._policy == "error":
                raise Full(f"spool {self.path} is full (on_full='error')")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise Full(f"spool {self.path} is still full after {timeout} s")
            marker = self._core.full_marker()
            self._space_bell.wait(lambda: self._room_marker() != marker,
                                  0.1 if got == _SLOW and left is None else left)

    def _raise_too_large(self, views, max_backlog):
        sizes = [_payload_size(v) for v in views]
        big = max(sizes)
        if big > self._max_payload:
            raise TooLarge(f"frame of {big} bytes can never fit: this spool's largest "
                           f"frame is {self._max_payload} bytes (capacity {self._ring})")
        if max_backlog is not None and len(views) > max_backlog:
            raise TooLarge(f"batch of {len(views)} items can never fit under maxsize {max_backlog}")
        raise TooLarge(f"batch of {len(views)} frames needs more than the ring's {self._ring} "
                       "bytes; split it")

    def _append_general(self, views, timeout, codec, max_backlog=None, before_commit=None):
        """General write path, in Python: a batch of frames, each a bytes-like or a tuple of them.

        A tuple is written as one frame, its segments copied one after the
        other straight into the ring (no concatenation copy).
        ``max_backlog`` bounds the frames not yet consumed by the slowest
        named reader/group (shmq.Queue's ``maxsize``); exceeding it waits
        like a full ring.  ``before_commit(first_seq, positions)`` runs under
        the writer lock once the batch is placed, before anything is
        written; raising aborts the batch (shmq.WorkQueue's key index).
        """
        if self._mm is None:
            self._check_open()
        views = tuple(v if type(v) in (bytes, tuple, Deferred) else _as_view(v) for v in views)
        ring = self._ring
        needs = []
        total = 0
        max_payload = self._max_payload
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
                               f"frame is {self._max_payload} bytes (capacity {ring})")
            need = FRAME_BYTES + ((n + 7) & ~7)
            needs.append((n, need))
            total += need
        if total > ring:
            raise TooLarge(f"batch of {len(views)} frames needs {total} bytes, more than the "
                           f"ring's {ring}; split it")
        if max_backlog is not None and len(views) > max_backlog:
            raise TooLarge(f"batch of {len(views)} items can never fit under maxsize {max_backlog}")
        # Checksums are computed before taking the lock (slow work outside locks).
        crcs = [_crc_parts(v) for v in views] if self._checksum else None
        flags = self._crc_flag
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # The lock is held for a copy; only a live holder that is stuck (or
            # a dead one not yet recovered) delays us, so even a non-blocking
            # put waits for it, up to the recovery timeout.
            lock_wait = None if deadline is None else max(self._recovery_timeout,
                                                          deadline - time.monotonic())
            try:  # the try covers the acquire: no signal can land between the two
                self._wlock.acquire(lock_wait)
                seq = self._write_locked(views, needs, total, crcs, flags, codec, max_backlog,
                                         before_commit)
            finally:
                self._wlock.release_if_held()  # sem_post: also the fence before reading waiters
            if seq is not None:
                if self._data_bell.has_waiters():
                    self._data_bell.ring()
                return seq
            if self._policy == "error":
                raise Full(f"spool {self.path} is full (on_full='error')")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise Full(f"spool {self.path} is still full after {timeout} s")
            marker = self._full_marker  # taken under the lock: no change is missed
            self._space_bell.wait(lambda: self._room_marker() != marker, left)

    def _write_locked(self, views, needs, total, crcs, flags, codec, max_backlog=None,
                      before_commit=None):
        """Place, write and publish a batch; None if there is no room (not block-able here)."""
        ctl = self._ctl
        mm = self._mm
        ring = self._ring
        base = self._base
        seq0 = seq = ctl[W_NEXT_SEQ]
        pos = ctl[W_NEXT_POS]
        if max_backlog is not None:
            floor_seq = self._floor_seq()
            if floor_seq is not None and seq0 - floor_seq + len(views) > max_backlog:
                self._full_marker = self._room_marker()
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
        first_pos = ctl[W_FIRST_POS]
        if end - first_pos > ring:
            if not self._make_room(end - ring, seq0, placed[0]):
                return None
            first_pos = ctl[W_FIRST_POS]
        if before_commit is not None:
            before_commit(seq0, placed)
        ts = _time_ns()
        for off, gap, k in pads:
            _pack_frame(mm, base + off, seq0 + k, gap, 0, ts, 0, FLAG_PAD, 0, 0)
        nbytes = 0
        crash = _crash_hook
        for v, (n, need), p, crc in zip(views, needs, placed, crcs or _ZEROS * len(views)):
            o = base + p % ring
            _pack_frame(mm, o, seq, need, n, ts, crc, flags, codec, 0)
            o += FRAME_BYTES
            tv = type(v)
            if tv is tuple:
                for part in v:
                    k = len(part) if type(part) is not memoryview else part.nbytes
                    mm[o:o + k] = part
                    o += k
            elif tv is Deferred:
                v.fill(self._view[o:o + n])  # e.g. Arrow IPC written straight into the ring
                if crcs:
                    _pack_frame(mm, o - FRAME_BYTES, seq, need, n, ts, _crc(self._view[o:o + n]),
                                flags, codec, 0)
            else:
                mm[o:o + n] = v
            seq += 1
            nbytes += n
            if crash is not None:
                crash("frame-written", self)
        if self._sync:
            self._msync(placed[0], end)  # frames durable before they are published
        ctl[W_NEXT_SEQ] = seq  # <- the commit point (NEXT_POS is re-derived on recovery)
        if _crash_hook is not None:
            _crash_hook("committed", self)
        ctl[W_NEXT_POS] = end
        if self._sync:
            self._mm.flush(0, F.HEADER_BYTES)  # ... and the commit itself
        self._account_put(ctl, seq - seq0, nbytes, ts)
        return seq0

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
        ctl = self._ctl
        sec = ts // 1_000_000_000
        b = W_RATE + (sec % RATE_SECONDS) * RATE_WORDS
        self._rate_word = b + 1
        self._rate_until = (sec + 1) * 1_000_000_000
        if ctl[b] != sec:
            ctl[b] = sec
            ctl[b + 1] = 0
            ctl[b + 2] = 0

    def put_array(self, arr, *, block=True, timeout=None) -> int:
        """Append a numpy array as one frame (dtype and shape travel in a descriptor).

        The data is copied once, into the ring; a non-contiguous array is made
        contiguous first (an extra copy).

        :raises TypeError: not an array, or an object dtype.
        :raises shmq.TooLarge: it can never fit.
        """
        from .columnar import put_array

        return put_array(self, arr, block=block, timeout=timeout)

    def put_arrow(self, data, *, block=True, timeout=None) -> int:
        """Append a pyarrow RecordBatch or Table as one frame (an Arrow IPC stream).

        :raises ImportError: pyarrow is not installed.
        :raises TypeError: not a RecordBatch or Table.
        """
        from .columnar import put_arrow

        return put_arrow(self, data, block=block, timeout=timeout)

    def _msync(self, start, end):
        ring, base = self._ring, self._base
        a, b = start % ring, end % ring or ring
        spans = [(a, b)] if a < b else [(a, ring), (0, b)]
        for lo, hi in spans:
            lo_page = (base + lo) // F.PAGE * F.PAGE
            self._mm.flush(lo_page, base + hi - lo_page)

    def _floor(self, word):
        """Minimum of slot ``word`` (S_POS or S_SEQ) over named readers and groups; None if none."""
        slots = self._slots
        floor = None
        for i in range(self._slot_hwm()):
            w = i * F.SLOT_WORDS
            if F.SLOT_FREE < slots[w + F.S_STATE] < F.SLOT_PIN:
                v = slots[w + word]
                if floor is None or v < floor:
                    floor = v
        return floor

    def _floor_pos(self):
        """Oldest committed position any named reader or group still needs (None: no slots)."""
        return self._floor(F.S_POS)

    def _floor_seq(self):
        """Oldest committed seq any named reader or group still needs (None: no slots)."""
        return self._floor(F.S_SEQ)

    def _room_marker(self):
        """What must change before a writer blocked on a full spool retries
        (the same pair as the core's ``full_marker()``)."""
        floor = self._floor_pos()
        pin = self._pin_floor(None)
        return (self._ctl[W_FIRST_POS] if floor is None else floor,
                _NO_PIN_MARK if pin is None else pin)

    # -- pins: frames referenced by zero-copy views (shmq.columnar) ----------------

    def _pin_floor(self, limit):
        """Oldest pinned position (below ``limit``, if given), reclaiming dead holders' pins.

        Liveness (an fcntl lock per pin slot) is checked only for pins that
        are in the way, so the common case costs a scan of the table.
        """
        slots, floor = self._slots, None
        for i in range(self._slot_hwm()):
            w = i * F.SLOT_WORDS
            if slots[w + F.S_STATE] != F.SLOT_PIN:
                continue
            p = slots[w + F.S_POS]
            if limit is not None:
                if p >= limit:
                    continue
                if i != self._pin_slot and not ofd_locked_by_other(
                        self._map.fd, self._slot_byte(i, F.SLOT_LIVE_BYTE)):
                    slots[w + F.S_STATE] = F.SLOT_FREE  # its process died: release its pins
                    continue
            if floor is None or p < floor:
                floor = p
        return floor

    def _pin(self, pos) -> bool:
        """Pin the frame at ``pos`` against eviction; False if it is already gone.

        Done under the writer lock, so no writer can be between checking the
        pins and evicting (no store/load reordering window).
        """
        if self._pin_slot is None:
            name = f"pin.{os.getpid()}.{id(self):x}"
            i = self._attach_slot(name, F.SLOT_PIN, "latest")
            if not ofd_lock(self._map.fd, self._slot_byte(i, F.SLOT_LIVE_BYTE)):
                raise ShmqError(f"{self.path}: pin slot {name} is in use")
            self._slots[i * F.SLOT_WORDS + F.S_POS] = F.NO_PIN
            self._pin_slot = i
        with self._wlock:
            if self._ctl[W_FIRST_POS] > pos:
                return False
            self._pins[pos] = self._pins.get(pos, 0) + 1
            w = self._pin_slot * F.SLOT_WORDS
            if pos < self._slots[w + F.S_POS]:
                self._slots[w + F.S_POS] = pos
            return True

    def _unpin(self, pos) -> None:
        if self._mm is None or self._pin_slot is None:
            return
        left = self._pins.get(pos, 0) - 1
        if left > 0:
            self._pins[pos] = left
        else:
            self._pins.pop(pos, None)
        # raising the floor needs no lock: it only frees room
        self._slots[self._pin_slot * F.SLOT_WORDS + F.S_POS] = min(self._pins, default=F.NO_PIN)
        self._notify_space()

    def _record_high_water(self):
        """Fold the current fill into the high-water marks (fill only shrinks by eviction)."""
        ctl = self._ctl
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
        ctl = self._ctl
        if self._pin_floor(limit) is not None:  # a zero-copy view still reads that frame
            self._full_marker = self._room_marker()
            return False
        if not self._overwrite:
            floor = self._floor_pos()
            if floor is None:
                floor = ctl[W_FIRST_POS]  # no consumers registered: keep everything
            if floor < limit and floor < ctl[W_NEXT_POS]:
                self._full_marker = self._room_marker()
                return False  # unconsumed frames in the way (all consumed: evict all)
        mm, ring, base = self._mm, self._ring, self._base
        seq, pos = ctl[W_FIRST_SEQ], ctl[W_FIRST_POS]
        start_seq = seq
        self._record_high_water()
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
            pos = batch_pos  # everything evicted: the ring restarts at this batch
        ctl[W_FIRST_POS] = pos  # position first: readers re-derive seq from its header
        if _crash_hook is not None:
            _crash_hook("evicting", self)
        ctl[W_FIRST_SEQ] = seq
        ctl[W_EVICTED] = (ctl[W_EVICTED] + seq - start_seq) & _MASK64
        return True

    def _recover_writer(self, dead_pid):
        """Repair the control words after breaking a dead writer's lock (lock held).

        A writer stores, in order: FIRST_POS, FIRST_SEQ (eviction), frame
        bytes, NEXT_SEQ (the commit), NEXT_POS.  Killed anywhere in that
        sequence, at most FIRST_SEQ lags its position's header and NEXT_POS
        lags the committed frames; both are re-derived from the frame
        headers, walking the ring once (O(frames resident), recovery only).
        """
        ctl = self._ctl
        log.warning("shmq: recovered the writer lock of %s from dead pid %s (token now %s)",
                    self.path, dead_pid, ctl[F.W_LOCK_TOKEN])
        next_seq = ctl[W_NEXT_SEQ]
        if ctl[W_FIRST_SEQ] >= next_seq:  # empty: nothing committed since any eviction
            ctl[W_FIRST_POS] = ctl[W_NEXT_POS]
            ctl[W_FIRST_SEQ] = next_seq
            return
        pos = ctl[W_FIRST_POS]
        hit = self._header_at(pos)
        end = None
        if hit is not None and ctl[W_FIRST_SEQ] <= hit[0] < next_seq:
            ctl[W_FIRST_SEQ] = hit[0]  # it died between FIRST_POS and FIRST_SEQ
            end = self._walk_end(hit[0], pos, next_seq)
        if end is None:
            log.error("shmq: %s: ring unreadable after writer death; dropping its contents "
                      "(readers will count them lost)", self.path)
            end = max(ctl[W_NEXT_POS], ctl[W_FIRST_POS])
            ctl[W_NEXT_POS] = end
            ctl[W_FIRST_POS] = end
            ctl[W_FIRST_SEQ] = next_seq
            return
        ctl[W_NEXT_POS] = end  # it may have died between NEXT_SEQ and NEXT_POS

    def _walk_end(self, seq, pos, next_seq):
        """Position right after frame ``next_seq - 1``, walking from frame ``seq`` at ``pos``."""
        limit = pos + self._ring
        while seq < next_seq:
            hit = self._header_at(pos)
            if hit is None or hit[0] != seq or hit[1] + hit[2] > limit:
                return None
            pos = hit[1] + hit[2]
            if not hit[6] & FLAG_PAD:
                seq += 1
        return pos

    # ------------------------------------------------------------ reading

    def _header_at(self, pos):
        """``(seq, pos, stored, length, ts, crc, flags, codec)`` of a valid header at/after ``pos``.

        Follows the short-tail skip; returns None if the header's lengths are
        out of bounds.  Never reads outside the ring.
        """
        ring = self._ring
        off = pos % ring
        if ring - off < FRAME_BYTES:
            pos += ring - off
            off = 0
        hseq, stored, length, ts, crc, flags, codec, _x = _unpack_frame(self._mm, self._base + off)
        if not F.valid_frame_header(stored, length, off, ring):
            return None
        return hseq, pos, stored, length, ts, crc, flags, codec

    def _frame_pos(self, pos):
        """Header position of the frame at cursor position ``pos`` (past any pad)."""
        for _ in range(3):
            hit = self._header_at(pos)
            if hit is None or not hit[6] & FLAG_PAD:
                return pos if hit is None else hit[1]
            pos = hit[1] + hit[2]
        return pos

    def _first_cursor(self):
        """A consistent ``(seq, pos)`` of the oldest frame, read lock-free (in the core)."""
        return self._core.first_cursor()

    def _latest_cursor(self):
        """``(NEXT_SEQ, NEXT_POS)`` as a consistent pair (takes the writer lock briefly)."""
        while True:
            cur = self._core.latest(self._recovery_timeout)
            if cur is not None:
                return cur
            self._wlock.recover_if_dead()

    def _read(self, seq, pos, verify=False):
        """Read the frame at cursor ``(seq, pos)``; return ``(frame, seq', pos', lost, codec)``.

        ``frame`` is None when the cursor caught up (after counting a loss).
        Lock-free, seqlock style (in the core): writers advance ``FIRST_POS``
        before they overwrite anything, so a frame is intact iff
        ``FIRST_POS <= pos`` still holds after the copy; otherwise it is
        counted as lost.
        """
        return self._core.read(seq, pos, verify)

    def _locate(self, seq):
        """Header position of frame ``seq`` (the core walks from the oldest frame or a hint)."""
        ctl = self._ctl
        if seq >= ctl[W_NEXT_SEQ]:
            raise FrameLost(f"seq {seq} has not been written yet (next is {ctl[W_NEXT_SEQ]})")
        hint = self._locate_hint or (1 << 63, 0)
        pos = self._core.locate(seq, hint[0], hint[1])
        if pos == -1:
            raise FrameLost(f"seq {seq} was overwritten (oldest is {ctl[W_FIRST_SEQ]})")
        if pos == -2:
            raise FrameLost(f"seq {seq} could not be located while the ring was being rewritten")
        self._locate_hint = (seq, pos)
        return pos

    def read_at(self, seq, *, verify=False) -> Frame:
        """Read frame ``seq`` without a lock and without moving any cursor.

        Cost grows with the distance from the oldest frame (or from the
        previous ``read_at``), as frames are variable-sized.

        :raises shmq.FrameLost: ``seq`` was overwritten or is not written yet.
        """
        self._check_open()
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise TypeError(f"seq must be an int, not {type(seq).__name__}")
        if seq < 0:
            raise ValueError(f"seq must be non-negative, not {seq}")
        pos = self._locate(seq)
        frame, _s, _p, lost, _c = self._read(seq, pos, verify)
        if frame is None or lost or frame[0] != seq:
            raise FrameLost(f"seq {seq} was overwritten while being read")
        return frame

    # ------------------------------------------------------------ readers

    def reader(self, name=None, *, group=False, start="earliest", auto_commit=True, verify=False):
        """Return a reader: anonymous (``name=None``), named and durable, or a group member.

        * anonymous: a private cursor, never holds writers back, forgotten on close;
        * named: its committed position lives in the spool and survives
          restarts; one live attachment at a time (fcntl lock on its slot);
        * ``group=True``: a member of the named group; each frame goes to
          exactly one member.

        ``start`` ("earliest", "latest" or a seq) applies to an anonymous
        reader and to a name seen for the first time; an existing named
        reader resumes from its committed position.

        :raises shmq.ReaderBusy: the named reader is attached elsewhere.
        :raises shmq.ShmqError: the reader table is full, or the name is a
            group/reader of the other kind.
        """
        from .reader import GroupReader, NamedReader, Reader

        self._check_open()
        if name is None:
            if group:
                raise ValueError("a group needs a name")
            return Reader(self, start=start, verify=verify)
        if group:
            return GroupReader(self, name, start=start, verify=verify)
        return NamedReader(self, name, start=start, auto_commit=auto_commit, verify=verify)

    def _cursor_for(self, start):
        if start == "earliest":
            return self._first_cursor()
        if start == "latest":
            return self._latest_cursor()
        if isinstance(start, bool) or not isinstance(start, int):
            raise ValueError(f"start must be 'earliest', 'latest' or a seq, not {start!r}")
        if start < 0:
            raise ValueError(f"seq must be non-negative, not {start}")
        nxt = self._ctl[W_NEXT_SEQ]
        if start >= nxt:
            if start > nxt:
                raise ValueError(f"seq {start} is beyond the next seq {nxt}")
            return self._latest_cursor()
        return start, self._locate(start)

    def _check_cursor(self, name, seq, pos):
        ctl = self._ctl
        if seq > ctl[W_NEXT_SEQ] or pos > ctl[W_NEXT_POS] + self._ring:
            raise SpoolFormatError(
                f"{self.path}: the stored cursor of {name!r} (seq {seq}, position {pos}) is "
                f"beyond the ring's end; reset it with 'shmq readers seek' or fsck --repair")

    def _slot_hwm(self):
        # Clamped: a corrupt word must not index past the table.
        return min(self._ctl[F.W_SLOT_HWM], self._geo["slot_count"])

    def _find_slot(self, name):
        slots = self._slots
        for i in range(self._slot_hwm()):
            if slots[i * F.SLOT_WORDS + F.S_STATE] != F.SLOT_FREE and self._slot_name(i) == name:
                return i
        return None

    def _slot_name(self, i):
        off = self._geo["slot_offset"] + i * F.SLOT_BYTES + F.NAME_OFFSET
        return F.unpack_name(self._mm[off:off + F.NAME_MAX_BYTES + 1])

    def _slot_byte(self, i, which):
        return self._geo["slot_offset"] + i * F.SLOT_BYTES + which

    def _attach_slot(self, name, kind, start):
        """Find or create the slot for ``name``; return its index (table lock held briefly)."""
        if not isinstance(name, str):
            raise TypeError(f"reader name must be a str, not {type(name).__name__}")
        raw = name.encode("utf-8")
        if not raw or len(raw) > F.NAME_MAX_BYTES or "\x00" in name:
            raise ValueError(f"reader name must be 1..{F.NAME_MAX_BYTES} UTF-8 bytes without NUL: {name!r}")
        fd = self._map.fd
        ofd_lock(fd, F.TABLE_LOCK_BYTE, wait=True)
        try:
            i = self._find_slot(name)
            if i is not None:
                have = self._slots[i * F.SLOT_WORDS + F.S_STATE]
                if have != kind:
                    what = {F.SLOT_READER: "a named reader", F.SLOT_GROUP: "a group",
                            F.SLOT_PIN: "a pin slot"}
                    raise ShmqError(f"{name!r} is {what.get(have, 'in use')} in {self.path}, "
                                    f"not {what[kind]}")
                return i
            seq, pos = self._cursor_for(start)
            slots = self._slots
            for i in range(self._geo["slot_count"]):
                w = i * F.SLOT_WORDS
                if slots[w + F.S_STATE] == F.SLOT_FREE:
                    break
            else:
                raise ShmqError(f"{self.path}: reader table is full ({self._geo['slot_count']} "
                                "slots); remove unused readers or create the spool with more")
            for k in range(1, F.SLOT_WORDS):
                if k < F.NAME_OFFSET // 8:
                    slots[w + k] = 0
            off = self._geo["slot_offset"] + i * F.SLOT_BYTES + F.NAME_OFFSET
            packed = F.pack_name(name)
            self._mm[off:off + F.NAME_MAX_BYTES + 1] = packed.ljust(F.NAME_MAX_BYTES + 1, b"\0")
            slots[w + F.S_POS] = pos
            slots[w + F.S_SEQ] = seq
            slots[w + F.S_LAG_LOW] = (1 << 64) - 1
            slots[w + F.S_CREATED_NS] = time.time_ns()
            slots[w + F.S_STATE] = kind  # published last: the slot is complete
            if i + 1 > self._ctl[F.W_SLOT_HWM]:
                self._ctl[F.W_SLOT_HWM] = i + 1
            return i
        finally:
            ofd_unlock(fd, F.TABLE_LOCK_BYTE)

    def _slot_alive(self, i):
        if self._slot_refs.get(i):
            return True
        return ofd_locked_by_other(self._map.fd, self._slot_byte(i, F.SLOT_LIVE_BYTE))

    def remove_reader(self, name) -> None:
        """Forget a named reader or group (its cursor stops holding writers back).

        :raises KeyError: no such reader.
        :raises shmq.ReaderBusy: it is attached by a live process.
        """
        from .errors import ReaderBusy

        self._check_open()
        fd = self._map.fd
        ofd_lock(fd, F.TABLE_LOCK_BYTE, wait=True)
        try:
            i = self._find_slot(name)
            if i is None:
                raise KeyError(f"no reader or group named {name!r} in {self.path}")
            w = i * F.SLOT_WORDS
            if self._slot_alive(i):
                raise ReaderBusy(f"reader {name!r} is attached (pid {self._slots[w + F.S_PID]}); "
                                 "close it first")
            self._slots[w + F.S_STATE] = F.SLOT_FREE
            off = self._geo["slot_offset"] + i * F.SLOT_BYTES + F.NAME_OFFSET
            self._mm[off] = 0
        finally:
            ofd_unlock(fd, F.TABLE_LOCK_BYTE)
        self._notify_space()

    # ------------------------------------------------------------ stats

    def _notify_space(self):
        """Wake writers blocked on a full spool (called after a consumer advances)."""
        if self._space_bell.has_waiters():
            self._space_bell.ring()

    def _count_read_rate(self, n, now_ns):
        # Unlocked read-modify-write: concurrent readers may lose an update
        # (documented as approximate); the per-reader counters are exact.
        ctl = self._ctl
        sec = now_ns // 1_000_000_000
        b = W_RATE + (sec % RATE_SECONDS) * RATE_WORDS
        if ctl[b] != sec:
            ctl[b] = sec
            ctl[b + 1] = 0
            ctl[b + 2] = 0
        ctl[b + 2] = (ctl[b + 2] + n) & _MASK64

    def readers(self) -> list[ReaderStats]:
        """Named readers and groups with their position, lag, loss and liveness."""
        self._check_open()
        ctl, slots = self._ctl, self._slots
        nxt, next_pos = ctl[W_NEXT_SEQ], ctl[W_NEXT_POS]
        out = []
        for i in range(self._slot_hwm()):
            w = i * F.SLOT_WORDS
            state = slots[w + F.S_STATE]
            if state == F.SLOT_FREE or state == F.SLOT_PIN:
                continue
            name = self._slot_name(i)
            if name is None:
                continue
            seq, pos, gets = slots[w + F.S_SEQ], slots[w + F.S_POS], slots[w + F.S_GETS]
            low = slots[w + F.S_LAG_LOW]
            out.append(ReaderStats(
                name=name, kind="group" if state == F.SLOT_GROUP else "reader",
                position=seq, lag=max(0, nxt - seq), lag_bytes=max(0, next_pos - pos),
                lost=slots[w + F.S_LOST], gets=gets, get_bytes=slots[w + F.S_GET_BYTES],
                last_get_ns=slots[w + F.S_LAST_GET_NS],
                avg_delay_ns=slots[w + F.S_DELAY_SUM_NS] // gets if gets else 0,
                max_delay_ns=slots[w + F.S_DELAY_MAX_NS], high_water=slots[w + F.S_LAG_HIGH],
                low_water=0 if low == (1 << 64) - 1 else low, pid=slots[w + F.S_PID],
                alive=self._slot_alive(i), slot=i))
        return out

    def stats(self) -> SpoolStats:
        """A snapshot of the control block's statistics (see :class:`shmq.SpoolStats`)."""
        self._check_open()
        for r in list(self._readers):
            r._flush_stats()
        ctl = self._ctl
        readers = self.readers()
        first, nxt = ctl[W_FIRST_SEQ], ctl[W_NEXT_SEQ]
        used = max(0, ctl[W_NEXT_POS] - ctl[W_FIRST_POS])
        gets = sum(r.gets for r in readers)
        delay_sum = sum(r.avg_delay_ns * r.gets for r in readers)
        now = time.time() // 1
        series = []
        for k in range(RATE_SECONDS):
            b = W_RATE + k * RATE_WORDS
            if ctl[b] and now - ctl[b] < RATE_SECONDS:
                series.append((ctl[b], ctl[b + 1], ctl[b + 2]))
        series.sort()
        return SpoolStats(
            path=self.path, capacity=self._ring, on_full=self._policy, checksum=self._checksum,
            first_seq=first, next_seq=nxt, frames=max(0, nxt - first), used_bytes=used,
            fill=used / self._ring, puts=nxt, put_bytes=ctl[W_PUT_BYTES],
            last_put_ns=ctl[W_LAST_PUT_NS], gets=gets, get_bytes=sum(r.get_bytes for r in readers),
            last_get_ns=max((r.last_get_ns for r in readers), default=0),
            avg_delay_ns=delay_sum // gets if gets else 0,
            max_delay_ns=max((r.max_delay_ns for r in readers), default=0),
            lost=sum(r.lost for r in readers), evicted=ctl[W_EVICTED],
            high_water=max((r.high_water for r in readers), default=0),
            low_water=min((r.low_water for r in readers if r.gets), default=0),
            high_water_frames=max(ctl[W_HIGH_FRAMES], nxt - first),
            high_water_bytes=max(ctl[W_HIGH_BYTES], used),
            lock_pid=holder_pid(ctl[F.W_LOCK_HOLDER]), lock_token=ctl[F.W_LOCK_TOKEN],
            lock_breaks=ctl[F.W_LOCK_BREAKS],
            write_rate=tuple((s, p) for s, p, _g in series),
            read_rate=tuple((s, g) for s, _p, g in series), readers=tuple(readers))

    def sync(self) -> None:
        """``msync`` the whole file: on a disk path, durable once this returns.

        On ``/dev/shm`` (tmpfs) it is a no-op in effect: such a spool
        survives process crashes but not a reboot.
        """
        self._check_open()
        self._mm.flush()


class Deferred:
    """A frame payload of known size written by ``fill(memoryview)`` under the writer lock.

    Lets a serializer (Arrow IPC) write straight into the ring instead of
    into a buffer that is then copied.  ``fill`` must write exactly ``nbytes``
    and must not touch the spool.
    """

    __slots__ = ("nbytes", "fill")

    def __init__(self, nbytes, fill):
        self.nbytes, self.fill = nbytes, fill


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


def _reopen(path, sync, recovery_timeout):
    return Spool(path, sync=sync, recovery_timeout=recovery_timeout)


def _after_fork_in_child():
    for sp in list(_open_spools):
        if not sp.closed:
            try:
                sp._after_fork_in_child()
            except Exception:  # a fork hook must never raise
                log.exception("shmq: could not re-open %s after fork", sp.path)


os.register_at_fork(after_in_child=_after_fork_in_child)
