"""The spool: a shared-memory ring of frames with many writers and many readers.

Writers serialize on one recoverable semaphore lock, append frames and
publish them with a release store of ``NEXT_SEQ`` (the commit point).
Readers never take the writer lock: they acquire-load ``NEXT_SEQ``, read the
frame at their cursor, check its seq, copy it, and re-check ``FIRST_POS`` to
detect an overwrite that raced with the copy (seqlock style).  See
docs/format.md.

:class:`Spool` is the public facade, assembled from parts that each own one
thing and are reachable as attributes for the layers above (queue, work
queue, columnar, dump, CLI):

* ``sp.mapping`` - the open, validated file (:class:`shmq._mapping.Mapping`);
* ``sp.ring`` - ring I/O: headers, cursors, lock-free reads (:mod:`shmq.ring`);
* ``sp.slots`` - the reader table (:mod:`shmq.slots`);
* ``sp.pins`` - frames pinned by zero-copy views (:mod:`shmq.pins`);
* ``sp.writer`` - the write path: append, room, eviction (:mod:`shmq.writer`);
* ``sp.core`` - the compiled core (:mod:`shmq._core`), the hot path of all of them;
* ``sp.writer_lock``, ``sp.data_bell``, ``sp.space_bell`` - the writer lock
  and the doorbells readers and blocked writers sleep on.

This module keeps the lifecycle: create, open, close, destroy, fork and
pickling, and the statistics snapshot.
"""

from __future__ import annotations

import errno
import os
import time
import weakref
from collections.abc import Callable, Iterable

from . import _core
from . import _format as F
from ._format import (
    RING_ADVICE, RATE_SECONDS, RATE_WORDS, W_EVICTED, W_FIRST_POS, W_FIRST_SEQ, W_HIGH_BYTES, W_HIGH_FRAMES,
    W_LAST_PUT_NS,
    W_NEXT_POS, W_NEXT_SEQ, W_PUT_BYTES, W_RATE,
)
from ._lock import FIRST_LOOK_S, LOCK_RECOVERY_TIMEOUT_S, RecoverableLock, holder_pid, holder_word
from ._lazy import TYPE_CHECKING, columnar, logger, overload
from ._mapping import (
    SEM_READ_WAITERS, SEM_SPACE_WAITERS, SEM_WRITER, Mapping, create_file, open_semaphore,
    destroy_file, resolve_path, sem_name,
)
from ._notify import Doorbell
from .errors import Empty, ShmqError, SpoolFormatError
from .pins import Pins
from .ring import Ring
from .slots import SlotTable
from .waiting import check_block_timeout
from .writer import Deferred, Writer
from . import writer as _writer

if TYPE_CHECKING:
    from typing import Any, Literal, NoReturn, Self

    from _typeshed import ReadableBuffer, StrPath
    from numpy.typing import NDArray

    from .group import GroupReader
    from .reader import NamedReader, Reader
    from .stats import ReaderStats, SpoolStats

# The engine's errors as this package's exceptions (shmq.Queue hands the binding its
# pickling: the spool carries bytes).
_core.setup(SpoolFormatError, Empty, ShmqError)

__all__ = ["Spool", "Frame", "Deferred", "check_block_timeout", "RING_ADVICE"]

_open_spools: "weakref.WeakSet[Spool]" = weakref.WeakSet()


def set_crash_hook(hook: Callable[..., Any] | None) -> None:
    """Install the fault-injection hook in the core, every write path's writer (tests
    only; see :func:`shmq.writer.set_crash_hook`)."""
    _writer.set_crash_hook(hook, _core)


#: One message: ``(seq, timestamp_ns, data)``, a tuple with named fields
#: (built by the core); ``frame.codec`` is the payload's codec tag.
Frame = _core.Frame
#: An open reservation (see :meth:`Spool.reserve`).
Reservation = _core.Reservation


class Spool:
    """A fixed-capacity, memory-mapped message ring shared by processes.

    Create with :meth:`create`, attach with :meth:`open`.  Handles are
    cheap, pickle to their path (``pickle.loads`` reattaches), and are safe
    across ``fork`` (the child gets its own file description).  One handle
    should not be used by several threads at once.
    """

    def __init__(self, path: StrPath, *, sync: bool = False,
                 recovery_timeout: float = LOCK_RECOVERY_TIMEOUT_S) -> None:
        """Attach to an existing spool: prefer :meth:`open`."""
        path = resolve_path(path)
        self.mapping = Mapping(path)
        try:
            self._setup(sync, recovery_timeout)
        except BaseException:
            self.mapping.close()
            raise
        _open_spools.add(self)

    def _setup(self, sync: bool, recovery_timeout: float) -> None:
        m = self.mapping
        geo = m.geo
        self.path = m.path
        seg = m.ctl[F.W_SEGMENT]
        if seg % F.PAGE or seg > geo["ring_bytes"]:  # the core would refuse it less clearly
            raise SpoolFormatError(f"{m.path}: control word SEGMENT = {seg} is not a whole number "
                                   f"of pages within the ring; {RING_ADVICE}")
        self._sync = bool(sync)
        self.recovery_timeout = recovery_timeout
        self._policy = geo["policy"]
        self.checksum = geo["checksum"]
        prefix = self.sem_prefix = geo["sem_prefix"]
        self._sem_mode = m.st_mode & 0o666
        self._writer_sem = self.open_semaphore(sem_name(prefix, SEM_WRITER), 1)
        read_waiters = self.open_semaphore(sem_name(prefix, SEM_READ_WAITERS), 0)
        space_waiters = self.open_semaphore(sem_name(prefix, SEM_SPACE_WAITERS), 0)
        sems = (self._writer_sem, read_waiters, space_waiters)
        # The lock and the core open the same three names, which open_semaphore has
        # just checked.  destroy() may unlink them meanwhile (after the file).
        try:
            self.writer_lock = RecoverableLock(
                self._writer_sem, m.ctl, F.W_LOCK_HOLDER, F.W_LOCK_TOKEN, m,
                F.RECOVERY_LOCK_BYTE, breaks_word=F.W_LOCK_BREAKS, recovery_timeout=recovery_timeout)
            self.core = _core.Ring(
                m.mm, m.path, geo["ring_offset"], geo["ring_bytes"], geo["slot_offset"],
                geo["slot_count"], F.POLICIES.index(self._policy), self.checksum,
                sem_name(prefix, SEM_WRITER), sem_name(prefix, SEM_READ_WAITERS),
                sem_name(prefix, SEM_SPACE_WAITERS), m.fd, holder_word(),
                # how long the core waits for a lock before handing it to the
                # Python paths that look at its holder (retry_stuck): FIRST_LOOK_S
                float(min(recovery_timeout, FIRST_LOOK_S)))
        except OSError as exc:
            if isinstance(exc, ValueError) or not self.mapping.unlinked():
                raise
            self._destroyed_while_opening(sems)  # the names went before the core's opens
        except ValueError as exc:
            if isinstance(exc, SpoolFormatError):
                raise
            # The core re-reads words another writer may have changed since the
            # checks above (W_SEGMENT): a refusal of the file, said as one.
            raise SpoolFormatError(f"{m.path}: refused by the ring core: {exc} (control word "
                                   f"SEGMENT = {m.ctl[F.W_SEGMENT]}); {RING_ADVICE}") from None
        # One-way: the core hands what its put leaves over to this class's
        # _put_slow (a subclass's override included), never looks it up by name.
        self.core.bind(self, type(self)._put_slow, not self._sync, type(self)._reserve_slow)
        self.data_bell = Doorbell(m, read_waiters, self.core, space=False)
        self.space_bell = Doorbell(m, space_waiters, self.core, space=True)
        if type(self).put is Spool.put:
            # Spool.put's own code, bound per handle: the call goes straight
            # to C (no Python frame).  A subclass that overrides put keeps it.
            self.put = self.core.put_api
        if type(self).reserve is Spool.reserve:
            self.reserve = self.core.reserve_api
        if self.mapping.unlinked():
            self._destroyed_while_opening(sems)
        self.ring = Ring(m, self.core, self.writer_lock, recovery_timeout)
        self.writer_lock.on_recover = self.ring.repair_after_writer_death
        self.ring.check_control()
        self.slots = SlotTable(m, self.ring)
        self.pins = Pins(m, self.ring, self.slots, self.writer_lock, self.notify_space)
        self.writer = Writer(self, self.ring, self.pins, self.writer_lock,
                             self.data_bell, self.space_bell, policy=self._policy,
                             checksum=self.checksum, sync=self._sync)
        self._readers: weakref.WeakSet[Reader] = weakref.WeakSet()
        self.holder = holder_word()

    def _destroyed_while_opening(self, sems: tuple[_core.Semaphore, ...]) -> NoReturn:
        # Our O_CREAT may have re-created semaphores destroy() had unlinked, and
        # a handle on a file already gone is of no use to the caller: refuse it
        # as the path's absence would have, with no name left behind.
        for opened in (getattr(self, "core", None), getattr(self, "writer_lock", None), *sems):
            if opened is not None:
                opened.close()
        self.mapping.forget_semaphores_if_unlinked(self.sem_prefix)
        raise FileNotFoundError(errno.ENOENT, "the spool was destroyed while being opened",
                                self.mapping.path)

    def open_semaphore(self, name: str, initial: int) -> _core.Semaphore:
        """Open (or create) named semaphore ``name`` with this spool's mode, refusing one
        that another user squatted (see :func:`shmq._mapping.open_semaphore`).

        A name created here after the spool was destroyed would outlive it: once the
        core has opened it too, call ``mapping.forget_semaphores_if_unlinked``."""
        m = self.mapping
        return open_semaphore(name, initial, self._sem_mode, owner=m.st_uid, group=m.st.st_gid)

    @property
    def geometry(self) -> dict[str, Any]:
        """The file's immutable geometry (ring/slot/lease offsets and counts, policy,
        checksum, creation time...), as decoded when it was opened."""
        return self.mapping.geo

    def lease_region(self) -> memoryview:
        """The lease region (the work queue's table) as u64 words: a memoryview the
        caller releases when done."""
        geo = self.mapping.geo
        lo = geo["lease_offset"]
        return self.mapping.view[lo:lo + geo["lease_count"] * F.LEASE_BYTES].cast("Q")

    def identity(self) -> list[int]:
        """``[st_dev, st_ino, created_ns]``: tells this spool from another at the same path."""
        st = os.fstat(self.mapping.fd)
        return [st.st_dev, st.st_ino, self.mapping.geo["created_ns"]]

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, path: StrPath, capacity: int | str = "64MiB", on_full: str = "overwrite",
               mode: int = 0o600, *, readers: int = F.DEFAULT_SLOTS,
               leases: int = F.DEFAULT_LEASES, checksum: bool = False, exist_ok: bool = False, sync: bool = False,
               recovery_timeout: float = LOCK_RECOVERY_TIMEOUT_S, max_capacity: int | str | None = None) -> Self:
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

        ``max_capacity`` (larger than ``capacity``) makes the spool growable:
        the ring is ``max_capacity`` bytes of address space, but only
        ``capacity`` bytes of it are allocated at first; the writer allocates
        further segments as data accumulates and releases the segments every
        named reader and group has consumed (block/error policies), so the
        file's real size follows the backlog, up to ``max_capacity``, the
        ceiling where the policy applies (see docs/guide.md, "Growable
        spools").  A full filesystem while growing raises ``OSError(ENOSPC)``
        naming it; nothing is written then.

        :raises FileExistsError: ``path`` exists and ``exist_ok`` is false.
        :raises OSError: ``ENAMETOOLONG``: the file name leaves no room for the temporary
            name a spool is created under (at most 232 bytes where names have 255).
        :raises ValueError: bad capacity, policy, or slot counts, or ``max_capacity``
            smaller than ``capacity``.
        """
        if on_full not in F.POLICIES:
            raise ValueError(f"on_full must be one of {F.POLICIES}, not {on_full!r}")
        ring = F.parse_size(capacity)
        start = None
        if max_capacity is not None:
            ceiling = F.parse_size(max_capacity)
            if ceiling < ring:
                raise ValueError(f"max_capacity ({ceiling} bytes) is smaller than capacity "
                                 f"({ring} bytes)")
            ring, start = ceiling, ring
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
                        leases=leases, checksum=checksum, start_bytes=start)
        except FileExistsError:
            if not exist_ok:
                raise
        return cls(resolved, sync=sync, recovery_timeout=recovery_timeout)

    @classmethod
    def open(cls, path: StrPath, *, sync: bool = False,
             recovery_timeout: float = LOCK_RECOVERY_TIMEOUT_S) -> Self:
        """Attach to an existing spool.

        ``sync=True`` makes every put ``msync`` the pages it wrote (for spools
        on a disk path: durable across a machine crash, at a large cost).

        :raises FileNotFoundError: nothing at ``path``.
        :raises shmq.SpoolFormatError: not a spool, corrupt, truncated, or a newer format.
        """
        return cls(path, sync=sync, recovery_timeout=recovery_timeout)

    @staticmethod
    def destroy(path: StrPath) -> None:
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
        if getattr(self, "mapping", None) is None or self.mapping.mm is None:
            return
        for r in list(self._readers):
            r.close()
        self.pins.close()
        self.data_bell.close()
        self.space_bell.close()
        for sem in (self._writer_sem, self.data_bell.sem, self.space_bell.sem):
            sem.close()
        self.core.close()  # drops its export of the mapping: unmapping can proceed
        self.writer_lock.close()
        self.mapping.close()
        _open_spools.discard(self)

    @property
    def closed(self) -> bool:
        return self.mapping.mm is None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Callable[..., Spool], tuple[Any, ...]]:
        return (_reopen, (self.path, self._sync, self.recovery_timeout))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"seq {self.first_seq}..{self.next_seq}"
        return f"<shmq.Spool {self.path!r} {self._policy} {self.capacity} B {state}>"

    def _after_fork_in_child(self) -> None:
        # The inherited descriptor shares the parent's OFD locks and inotify
        # instance; take private ones so liveness and wake-ups stay per process.
        self.mapping.reopen_fd()
        self.data_bell.forget_after_fork()
        self.space_bell.forget_after_fork()
        self.holder = holder_word()
        self.core.set_fd(self.mapping.fd, self.holder)
        self.writer_lock.set_holder(self.holder)
        self.pins.forget_after_fork()
        for r in list(self._readers):
            r.after_fork_in_child()

    def add_reader(self, reader: Reader) -> None:
        """Track ``reader`` as opened through this handle (closed with it, told of forks)."""
        self._readers.add(reader)

    def discard_reader(self, reader: Reader) -> None:
        """Stop tracking ``reader`` (it closed)."""
        self._readers.discard(reader)

    # ------------------------------------------------------------ properties

    @property
    def capacity(self) -> int:
        """Size of the data ring in bytes (a growable spool's ceiling)."""
        return self.ring.size

    @property
    def growable(self) -> bool:
        """True if the ring allocates its pages a segment at a time (``max_capacity``)."""
        return bool(self.mapping.ctl[F.W_SEGMENT])

    @property
    def allocated(self) -> int:
        """Bytes of the file's filesystem (``/dev/shm``) in use now: header, tables
        and the ring's allocated pages (all of them unless :attr:`growable`)."""
        self.check_open()
        return os.fstat(self.mapping.fd).st_blocks * 512

    @property
    def on_full(self) -> str:
        return self._policy

    @property
    def first_seq(self) -> int:
        """Seq of the oldest frame still in the ring."""
        return self.mapping.ctl[W_FIRST_SEQ]

    @property
    def next_seq(self) -> int:
        """Seq the next committed frame will get (all below it are readable)."""
        return self.mapping.ctl[W_NEXT_SEQ]

    @property
    def max_frame_bytes(self) -> int:
        """Largest payload one frame can carry in this spool."""
        return self.writer.max_payload

    def check_open(self) -> None:
        """:raises ValueError: this handle is closed."""
        if self.mapping.mm is None:
            raise ValueError("spool handle is closed")

    # ------------------------------------------------------------ writing

    def put(self, data: ReadableBuffer, *, block: bool = True, timeout: float | None = None,
            codec: int = F.CODEC_RAW) -> int:
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
        # The whole uncontended put in C (handles of this class bind it
        # directly); the core hands anything else to type(self)._put_slow.
        return self.core.put_api(data, block, timeout, codec)

    def _put_slow(self, data: ReadableBuffer | tuple[ReadableBuffer, ...], block: bool, timeout: float | None,
                  codec: int) -> int:
        """Everything the core's put could not finish: validation, waits, recovery
        (``data``: one bytes-like, or a tuple of segments, as put_array passes)."""
        timeout = None if block and timeout is None else check_block_timeout(block, timeout)
        self.check_open()
        return self.writer.append((data,), timeout, codec)

    def put_many(self, items: Iterable[ReadableBuffer], *, block: bool = True,
                 timeout: float | None = None, codec: int = F.CODEC_RAW) -> int:
        """Append several frames as one atomic, contiguous batch; return the first seq.

        Readers see all of the batch or none of it, with consecutive seqs and
        no other writer's frame in between.  An item is bytes-like, a tuple of
        bytes-likes (segments written one after the other) or a
        :class:`Deferred` (written in place by its ``fill`` under the writer
        lock; if ``fill`` raises, nothing of the batch is published).  A 1-d numpy array (e.g. of a
        structured dtype) is written in record-stream mode: whole records in
        as few numpy frames as fit (see :mod:`shmq.columnar`).  A batch of one
        ``bytes`` item is this class's :meth:`put` (the core's whole put, one
        call; a subclass's ``put`` override is not called, so it may itself
        call ``put_many``).

        :raises shmq.TooLarge: the batch can never fit in this ring.
        """
        if type(items).__module__ == "numpy" and getattr(items, "ndim", 0) == 1:
            timeout = check_block_timeout(block, timeout)
            self.check_open()
            return columnar().put_records(self.writer, items, timeout)
        if type(items) is not list and type(items) is not tuple:
            items = list(items)
        if not items:
            raise ValueError("put_many() needs at least one item")
        if len(items) == 1 and type(items[0]) is bytes:
            return Spool.put(self, items[0], block=block, timeout=timeout, codec=codec)  # one core call
        timeout = check_block_timeout(block, timeout)
        self.check_open()
        return self.writer.append(items, timeout, codec)

    def reserve(self, nbytes: int, *, codec: int = F.CODEC_RAW,
                timeout: float | None = None) -> Reservation:
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

        Blocks like :meth:`put` for room (``on_full="block"``) or a stuck lock; with
        ``sync=True`` the commit msyncs the frame, then the header page, as a put does.

        :raises shmq.TooLarge: ``nbytes`` can never fit.
        :raises shmq.Full: no room in time (or policy "error").
        :raises shmq.Timeout: the lock's live holder did not release it in time.
        :raises OSError: at the commit, ``sync=True`` and an msync failed (of the
            frame: nothing published; of the header page: published, not known durable).
        """
        # Bound per handle to the core (as put is), which hands waits to _reserve_slow.
        return self.core.reserve_api(nbytes, codec=codec, timeout=timeout)

    def _reserve_slow(self, nbytes: int, codec: int, timeout: float | None) -> Reservation:
        """Everything the core's reserve could not finish: validation, waits, recovery."""
        self.check_open()
        return self.writer.reserve(nbytes, codec, timeout)

    def put_array(self, arr: NDArray[Any], *, block: bool = True, timeout: float | None = None) -> int:
        """Append a numpy array as one frame (dtype and shape travel in a descriptor).

        The data is copied once, into the ring; a non-contiguous array is made
        contiguous first (an extra copy).

        :raises TypeError: not an array, or an object dtype.
        :raises shmq.TooLarge: it can never fit.
        """
        # The core's put of one frame of two segments (descriptor, data): the
        # uncontended put in C; waits and recovery in _put_slow, as for put().
        return self.core.put_api(columnar().encode_array(arr), block, timeout, F.CODEC_NUMPY)

    def put_arrow(self, data: Any, *, block: bool = True, timeout: float | None = None) -> int:
        """Append a pyarrow RecordBatch or Table as one frame (an Arrow IPC stream).

        :raises ImportError: pyarrow is not installed.
        :raises TypeError: not a RecordBatch or Table.
        """
        timeout = check_block_timeout(block, timeout)
        self.check_open()
        return columnar().put_arrow(self.writer, data, timeout)

    def notify_space(self) -> None:
        """Wake writers blocked on a full spool (call after a consumer advances)."""
        if self.space_bell.has_waiters():
            self.space_bell.ring()

    # ------------------------------------------------------------ reading

    def read_at(self, seq: int, *, verify: bool = False) -> Frame:
        """Read frame ``seq`` without a lock and without moving any cursor.

        Cost grows with the distance from the oldest frame (or from the
        previous ``read_at``), as frames are variable-sized.

        :raises shmq.FrameLost: ``seq`` was overwritten or is not written yet.
        """
        self.check_open()
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise TypeError(f"seq must be an int, not {type(seq).__name__}")
        if seq < 0:
            raise ValueError(f"seq must be non-negative, not {seq}")
        return self.ring.read_at(seq, verify)

    # ------------------------------------------------------------ readers

    @overload
    def reader(self, name: None = None, *, group: Literal[False] = False, start: str | int = "earliest",
               auto_commit: bool = True, verify: bool = False) -> Reader: ...
    @overload
    def reader(self, name: str, *, group: Literal[False] = False, start: str | int = "earliest",
               auto_commit: bool = True, verify: bool = False) -> NamedReader: ...
    @overload
    def reader(self, name: str, *, group: Literal[True], start: str | int = "earliest",
               auto_commit: bool = True, verify: bool = False) -> GroupReader: ...
    @overload
    def reader(self, name: str | None = None, *, group: bool = False, start: str | int = "earliest",
               auto_commit: bool = True, verify: bool = False) -> Reader: ...

    def reader(self, name: str | None = None, *, group: bool = False, start: str | int = "earliest",
               auto_commit: bool = True, verify: bool = False) -> Reader:
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
        from .group import GroupReader
        from .reader import NamedReader, Reader

        self.check_open()
        if name is None:
            if group:
                raise ValueError("a group needs a name")
            return Reader(self, start=start, verify=verify)
        if group:
            return GroupReader(self, name, start=start, verify=verify)
        return NamedReader(self, name, start=start, auto_commit=auto_commit, verify=verify)

    def remove_reader(self, name: str) -> None:
        """Forget a named reader or group (its cursor stops holding writers back).

        :raises KeyError: no such reader.
        :raises shmq.ReaderBusy: it is attached by a live process.
        """
        self.check_open()
        self.slots.remove(name)
        self.notify_space()

    # ------------------------------------------------------------ stats

    def readers(self) -> list[ReaderStats]:
        """Named readers and groups with their position, lag, loss and liveness."""
        self.check_open()
        return self.slots.stats()

    def stats(self) -> SpoolStats:
        """A snapshot of the control block's statistics (see :class:`shmq.SpoolStats`)."""
        self.check_open()
        for r in list(self._readers):
            r.flush_stats()
        ctl = self.mapping.ctl
        readers = self.readers()
        first, nxt = ctl[W_FIRST_SEQ], ctl[W_NEXT_SEQ]
        used = max(0, ctl[W_NEXT_POS] - ctl[W_FIRST_POS])
        if ctl[F.W_SEGMENT]:  # an early wrap's padding spans the rest of the ring: not data
            used = min(used, ctl[F.W_ALLOC])
        gets = sum(r.gets for r in readers)
        # Delays are sampled (one single get in 8, every frame of a batch): weigh each
        # reader's mean by its measured count, not by its gets.
        samples = [self.slots.word(r.slot, F.S_DELAY_COUNT) for r in readers]
        delay_sum = sum(r.avg_delay_ns * n for r, n in zip(readers, samples))
        now = time.time() // 1
        series = []
        for k in range(RATE_SECONDS):
            b = W_RATE + k * RATE_WORDS
            if ctl[b] and now - ctl[b] < RATE_SECONDS:
                series.append((ctl[b], ctl[b + 1], ctl[b + 2]))
        series.sort()
        from .stats import SpoolStats  # (on first use: dataclasses is a fifth of ``import shmq``)

        return SpoolStats(
            path=self.path, capacity=self.capacity, on_full=self._policy, checksum=self.checksum,
            first_seq=first, next_seq=nxt, frames=max(0, nxt - first), used_bytes=used,
            fill=used / self.capacity, puts=nxt, put_bytes=ctl[W_PUT_BYTES],
            last_put_ns=ctl[W_LAST_PUT_NS], gets=gets, get_bytes=sum(r.get_bytes for r in readers),
            last_get_ns=max((r.last_get_ns for r in readers), default=0),
            avg_delay_ns=delay_sum // sum(samples) if sum(samples) else 0,
            max_delay_ns=max((r.max_delay_ns for r in readers), default=0),
            lost=sum(r.lost for r in readers), evicted=ctl[W_EVICTED],
            high_water=max((r.high_water for r in readers), default=0),
            low_water=min((r.low_water for r in readers if r.gets), default=0),
            high_water_frames=max(ctl[W_HIGH_FRAMES], nxt - first),
            high_water_bytes=max(ctl[W_HIGH_BYTES], used),
            lock_pid=holder_pid(ctl[F.W_LOCK_HOLDER]), lock_token=ctl[F.W_LOCK_TOKEN],
            lock_breaks=ctl[F.W_LOCK_BREAKS], allocated=self.allocated,
            growable=bool(ctl[F.W_SEGMENT]), growths=ctl[F.W_GROWTHS],
            write_rate=tuple((s, p) for s, p, _g in series),
            read_rate=tuple((s, g) for s, _p, g in series), readers=tuple(readers))

    def trim(self, lock_wait: float = 0.0) -> int | None:
        """Give back a drained growable spool's memory now; return the bytes released.

        Frames every named reader and group has consumed are evicted; if
        nothing is left, every segment but the writer's current one and the
        start allocation (where the writer wraps early next) is punched out
        of the file.  The writer gives memory back by itself
        when it wraps early (every consumer caught up), and a reader that
        finds nothing to read for 10 ms calls this; call it after draining a large
        backlog while no one writes.  A fixed spool releases nothing (0).
        None: the writer lock stayed busy for ``lock_wait`` seconds.
        """
        self.check_open()
        before = self.allocated
        if self.core.trim(lock_wait) is None:
            return None
        return max(0, before - self.allocated)

    def trim_due(self) -> bool:
        """True if this is a growable spool whose zone spans more than four segments
        (a reader that stays idle then calls :meth:`trim_idle`; a blocking get waiting
        in the core leaves such a wait to Python for that).  Lock-free, two loads."""
        return self.core.trim_due()

    def trim_idle(self) -> None:
        """:meth:`trim` without waiting, if :meth:`trim_due` (called by a reader that
        found nothing to read for ``reader.TRIM_IDLE_S``)."""
        if self.trim_due():
            self.core.trim(0.0)

    def sync(self) -> None:
        """``msync`` the whole file: on a disk path, durable once this returns.

        On ``/dev/shm`` (tmpfs) it is a no-op in effect: such a spool
        survives process crashes but not a reboot.
        """
        self.check_open()
        self.mapping.mm.flush()  # type: ignore[union-attr]  # check_open: mapped


def _reopen(path: str, sync: bool, recovery_timeout: float) -> Spool:
    return Spool(path, sync=sync, recovery_timeout=recovery_timeout)


def _after_fork_in_child() -> None:
    for sp in list(_open_spools):
        if not sp.closed:
            try:
                sp._after_fork_in_child()
            except Exception:  # a fork hook must never raise
                logger().exception("shmq: could not re-open %s after fork", sp.path)


os.register_at_fork(after_in_child=_after_fork_in_child)
