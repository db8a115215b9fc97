"""Drop-in replacements for multiprocessing.Queue, JoinableQueue and SimpleQueue.

A queue is a spool with ``on_full="block"`` and one group named "queue":
``put`` encodes the item outside any lock (exact builtin values in the
values codec, anything else pickled with protocol 5: shmq.codec) and
appends one frame; ``get`` takes the next frame under the group's lock and
decodes it after releasing it.  Out-of-band pickle buffers (numpy arrays, PickleBuffer) are written
straight into the ring and read back with one copy.  There is no feeder
thread: ``put`` returns once the item is in shared memory, so a producer
killed after ``put`` returned loses nothing, and one killed inside ``put``
exposes nothing.

Lifetime: a queue created without ``path`` lives in ``/dev/shm`` under a
name carrying its creator, and is removed when its creator closes it, is
garbage collected or exits; processes that have it open keep working until
they close it.  If the creator is killed, it is removed once no handle to it
is left (:mod:`shmq.anonymous`).  A queue created with ``path`` is persistent
until ``shmq.Spool.destroy``.
"""

from __future__ import annotations

import os
import pickle
import weakref
from collections.abc import Callable, Iterable

from . import _core
from . import _format as F
from . import codec as _codec
from ._lazy import TYPE_CHECKING, LazyModule
from .anonymous import (  # noqa: F401  (anonymous_paths, queue_creator, is_orphan: shmq.queue's API)
    ANONYMOUS_DIR, ANONYMOUS_PREFIX, anonymous_path, anonymous_paths, destroy_owned, is_orphan,
    queue_creator, reclaim, reclaim_orphans, track,
)
from ._mapping import SEM_UNFINISHED, sem_name
from .errors import Empty, Full, ShmqError, Timeout
from .spool import Spool
from .waiting import check_block_timeout, retry_async

if TYPE_CHECKING:
    from typing import Any

__all__ = ["Queue", "JoinableQueue", "SimpleQueue", "anonymous_paths"]

# Loaded by the first Queue() (or unpickled queue), not by ``import shmq``.
_mp_util = LazyModule("multiprocessing.util")

_EMPTY, _STUCK, _UNDECODED = _core.EMPTY, _core.STUCK, _core.UNDECODED

GROUP = "queue"
#: What a queue allocates at first; it grows a segment at a time up to its ceiling.
DEFAULT_CAPACITY = "1MiB"
#: The default ceiling: half the filesystem holding the queue (``/dev/shm``), at most this.
MAX_DEFAULT_CEILING = 4 << 30


# The codec layer (shmq.codec) owns pickling and the trust decision; the Queue port in
# the binding pickles with its protocol (items in one C call: shmq/core/api.c).
_core.setup_pickle(pickle.loads, pickle.dumps, _codec.PROTOCOL)
_encode = _codec.encode
_decode = _codec.decode_item  # only after _codec.require_trust() at attach


def default_ceiling(directory: str, capacity: int | str) -> int:
    """A queue's default ``max_capacity``: half of ``directory``'s filesystem, at most
    4 GiB, never below ``capacity``."""
    vfs = os.statvfs(directory)
    half = vfs.f_blocks * vfs.f_frsize // 2 // F.PAGE * F.PAGE
    return max(F.parse_size(capacity), min(half, MAX_DEFAULT_CEILING))


class Queue:
    """A process- and crash-safe FIFO queue with the ``multiprocessing.Queue`` API.

    ``maxsize`` bounds the items in the queue (0: unbounded, as in
    ``multiprocessing``: ``put`` never blocks).  The queue starts small
    (``capacity``, 1 MiB of ``/dev/shm``) and grows a segment at a time as
    items accumulate, giving segments back once they are consumed, up to
    ``max_capacity`` (default: half of ``/dev/shm``, at most 4 GiB).  That
    ceiling is a hard limit: a ``put`` that would pass it raises
    :class:`shmq.Full` at once, naming it, instead of blocking; one object
    larger than it raises :class:`shmq.TooLarge`.  ``path`` makes a named,
    persistent queue (created if missing, attached otherwise).  ``trusted``
    allows unpickling from a spool other users can write.

    Guarantees: items from one producer are received in the order put;
    each item is received by exactly one consumer; a consumer killed in
    ``get`` loses at most the item it was taking and never blocks others
    beyond the lock-recovery timeout; handles pickle by path and work under
    fork, spawn and forkserver.
    """

    _unfinished: Any = None  # JoinableQueue: the unfinished-items semaphore
    _counts_items = False  # JoinableQueue: put counts the item first, in Python

    def __init__(self, maxsize: int = 0, *, capacity: int | str = DEFAULT_CAPACITY,
                 max_capacity: int | str | None = None, path: str | None = None,
                 trusted: bool = False, ctx: Any = None) -> None:
        if isinstance(maxsize, bool) or not isinstance(maxsize, int):
            raise TypeError(f"maxsize must be an int, not {type(maxsize).__name__}")
        self._owner = None
        if max_capacity is None:
            max_capacity = default_ceiling(ANONYMOUS_DIR if path is None
                                           else os.path.dirname(os.path.abspath(path)) or ".",
                                           capacity)
        if path is None:
            reclaim_orphans()  # bounded: an fcntl per candidate, no /proc scan (shmq.anonymous)
            spool = Spool.create(anonymous_path(), capacity=capacity, max_capacity=max_capacity,
                                 on_full="block", readers=1, leases=0)
            spool.ring.ctl[F.W_QUEUE_MAXSIZE] = max(0, maxsize)
            self._owner = os.getpid()
        else:
            spool = Spool.create(path, capacity=capacity, max_capacity=max_capacity,
                                 on_full="block", exist_ok=True)
            if maxsize > 0 and not spool.ring.ctl[F.W_QUEUE_MAXSIZE] and spool.next_seq == 0:
                spool.ring.ctl[F.W_QUEUE_MAXSIZE] = maxsize
        try:
            self._attach(spool, trusted)
        except BaseException:
            if self._owner is not None:
                destroy_owned(spool.path, spool.sem_prefix, self._owner)
            raise
        if self._owner is not None:
            # after _attach: the group's (and a JoinableQueue's count's) semaphores exist
            track(spool.path, spool.sem_prefix)
            _mp_util.register_after_fork(self, Queue._watch_creator)
            # Removes the file and semaphores when the creator is done with it.
            self._finalizer = weakref.finalize(self, destroy_owned, spool.path, spool.sem_prefix,
                                               self._owner)

    def _attach(self, spool: Spool, trusted: bool) -> None:
        if spool.on_full != "block":
            spool.close()
            raise ShmqError(f"{spool.path} is a '{spool.on_full}' spool; a queue needs on_full='block'")
        try:
            _codec.require_trust(spool, trusted)  # fstat of the mapped fd: ours and private?
        except BaseException:
            spool.close()
            raise
        self._spool = spool
        self._reader = spool.reader(GROUP, group=True)
        self._maxsize = spool.ring.ctl[F.W_QUEUE_MAXSIZE]
        self._backlog = self._maxsize or None
        self._backlog_word = self._maxsize or -1  # the core's "no bound"
        self._core = spool.core
        spool.writer.full_is_ceiling = True  # maxsize=0 never blocks: the ceiling raises Full
        # The queue's put and get in C, over the spool's ring and the group's
        # cursor; the queue's own state (maxsize) lives on this port, and what
        # the port leaves over goes to this class's _put_slow / _get_slow.  A
        # JoinableQueue counts its items in Python first: every put is slow.
        cls = type(self)
        self._port = _core.QueuePort(self._core, self._reader.core_cursor, self, cls._put_slow, cls._get_slow,
                                     self._backlog_word, not self._counts_items, _port_of)
        if cls.get is Queue.get:
            self.get = self._port.get  # Queue.get's own code, bound per queue: straight to C
        if cls.put is Queue.put and not self._counts_items:
            self.put = self._port.put
        self._trusted = trusted
        self._closed = False

    # -- pickling: by path, reattach ------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        return {"path": self._spool.path, "trusted": self._trusted}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._owner = None
        self._attach(Spool.open(state["path"]), state["trusted"])
        _mp_util.register_after_fork(self, Queue._watch_creator)
        self._watch_creator()

    def _watch_creator(self) -> None:
        """In a process other than the creator: the last handle to close after the
        creator died removes the queue (:func:`shmq.anonymous.reclaim`).  multiprocessing's
        Finalize runs at close, garbage collection, and the exit of a child process
        (which skips atexit); a fork child re-arms it (``register_after_fork``)."""
        if self._closed or self._owner == os.getpid() or queue_creator(self._spool.path) is None:
            return
        self._reclaimer = _mp_util.Finalize(self, reclaim_if_orphan,
                                            args=(self._spool.path, self._spool), exitpriority=0)

    # -- the stdlib surface ---------------------------------------------------

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        """Put ``obj`` into the queue; it is in shared memory when this returns.

        Blocks while the queue holds ``maxsize`` items, for at most
        ``timeout`` seconds; otherwise never (the queue grows).

        :raises queue.Full: (as shmq.Full) ``maxsize`` items and no room in time, or
            ``block=False``; at once if the queue is full to its ``max_capacity``.
        :raises OSError: (ENOSPC) ``/dev/shm`` has no room for the queue to grow; the
            message names its size and what to do.
        :raises shmq.TooLarge: the pickled object can never fit in ``max_capacity``.
        :raises ValueError: the queue is closed.
        :raises pickle.PicklingError: (or the error ``__reduce__`` raised) at once.
        """
        # Encoded and written in one C call when there is room; the port
        # hands the rest to type(self)._put_slow.
        return self._port.put(obj, block, timeout)

    def _put_general(self, obj: Any, block: bool, timeout: float | None) -> None:
        """The whole put in Python: encode, count (JoinableQueue), wait as asked."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        item, codec = _encode(obj)
        if self._unfinished is not None:
            self._unfinished.release()  # counted first: a crash leaves it high, never low
        try:
            if timeout is not None:
                check_block_timeout(block, timeout)  # bad timeouts fail even if there is room
            # The core either writes it (seq >= 0) or says why not: room,
            # a stuck lock, a pin; the general path then waits as asked.
            if self._core.put(item, codec, self._backlog_word) < 0:
                self._spool.writer.append((item,), check_block_timeout(block, timeout), codec,
                                    self._backlog)
        except Timeout as exc:  # a stuck live lock holder: the stdlib would say Full
            if self._unfinished is not None:
                self._unfinished.acquire(0)
            raise Full(str(exc)) from None
        except BaseException:
            if self._unfinished is not None:
                self._unfinished.acquire(0)
            raise

    def _put_slow(self, obj: Any, block: bool, timeout: float | None) -> None:
        """What the core's put leaves to Python: waiting (a full queue, a busy writer lock
        when a timeout is given), timeouts to validate, ``block=False``, out-of-band buffers."""
        return Queue._put_general(self, obj, block, timeout)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Remove and return the next item (FIFO across producers, by commit order).

        :raises queue.Empty: (as shmq.Empty) nothing arrived in time.
        :raises ValueError: the queue is closed.
        """
        # The item in one C call when there is one (take, release the group
        # lock, unpickle); the port hands the rest to type(self)._get_slow.
        return self._port.get(block, timeout)

    def _get_slow(self, block: bool, timeout: float | None, got: object) -> Any:
        """Waiting, other codecs, a stuck group lock: what the core's get leaves to Python."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if got is _UNDECODED:
            f = self._reader.core_cursor.last
        else:
            f = self._reader.get(block, timeout)
        return _decode(f[2], f.codec)  # type: ignore[index,union-attr]  # last: set by UNDECODED

    def _park_at_once(self) -> None:
        """This handle's blocking gets park without spinning first (for a consumer thread
        beside threads that need the GIL: a spin holds it).  This handle only."""
        self._spool.data_bell.spin = 0.0

    def put_nowait(self, obj: Any) -> None:
        return self.put(obj, False)

    def get_nowait(self) -> Any:
        return self.get(False)

    def qsize(self) -> int:
        """Items in the queue now (exact at the instant it is read)."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        return self._reader.lag

    def empty(self) -> bool:
        return self.qsize() == 0

    def full(self) -> bool:
        return bool(self._maxsize) and self.qsize() >= self._maxsize

    def close(self) -> None:
        """Detach this process's handle; the creator's close also removes the queue's file.

        Other processes that have the queue open keep working until they close.
        """
        if self._closed:
            return
        self._closed = True
        self._reader.close()
        if self._unfinished is not None:
            self._unfinished.close()
        self._spool.close()
        fin = getattr(self, "_finalizer", None)
        if fin is not None and self._owner == os.getpid():
            fin()
        rec = getattr(self, "_reclaimer", None)
        if rec is not None:
            rec()

    def join_thread(self) -> None:
        """No feeder thread exists: items are in shared memory when put() returns."""
        assert self._closed, f"Queue {self!r} not closed"

    def cancel_join_thread(self) -> None:
        """No-op: there is no feeder thread to wait for."""

    # -- beyond the stdlib -----------------------------------------------------

    def put_many(self, items: Iterable[Any], block: bool = True, timeout: float | None = None) -> None:
        """Put several objects as one batch: atomic (consumers see all or none) when
        the items are of one kind (all ``bytes``, or all objects without
        out-of-band buffers, or all with them); a mixed batch is put item by item."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if not isinstance(items, (list, tuple)):
            items = list(items)  # an iterator is read once: by whichever encoder takes it
        batch = _core.encode_batch(items, True)  # all bytes, or all values or in-band pickles, in one call
        if batch is not None:
            parts, codec = batch
            appends = [(parts, codec)] if parts else []
        else:
            # A frame header has one codec: a batch of one kind (all pickles, all
            # bytes, all out-of-band) is one atomic append; a mixed one goes item by item.
            encoded = _codec.encode_many(items)
            codec = encoded[0][1] if encoded else None  # type: ignore[assignment]
            if all(c == codec for _i, c in encoded):
                appends = [(tuple([i for i, _c in encoded]), codec)] if encoded else []
            else:
                appends = [((item,), c) for item, c in encoded]
        n = sum(len(parts) for parts, _c in appends)
        if self._unfinished is not None:
            for _ in range(n):
                self._unfinished.release()
        try:
            for parts, codec in appends:
                self._spool.writer.append(parts, check_block_timeout(block, timeout), codec,
                                          self._backlog)
        except BaseException:
            if self._unfinished is not None:
                for _ in range(n):
                    self._unfinished.acquire(0)
            raise

    def get_many(self, max_items: int = 100, block: bool = True,
                 timeout: float | None = None) -> list[Any]:
        """Remove and return 1..``max_items`` items, blocking only for the first."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        # one core call; the trust check at attach is what allows unpickling
        out = self._reader.get_objects(max_items, block, timeout, unpickle=True)
        if type(out) is tuple:  # frames of codecs the core does not decode: Python's decoder
            out, undecoded = out
            for i in undecoded:
                out[i] = _decode(out[i][2], out[i].codec)
        return out  # type: ignore[return-value]  # a list either way

    async def get_async(self, timeout: float | None = None) -> Any:
        """``await`` the next item; the event loop parks on the spool's inotify fd."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        timeout = check_block_timeout(True, timeout)
        return await retry_async(lambda: self.get(block=False), Empty, self._spool.data_bell,
                                 lambda: self._reader.available, timeout)

    async def put_async(self, obj: Any, timeout: float | None = None) -> None:
        """``await`` room, then put ``obj``."""
        writer = self._spool.writer

        def room_moved() -> Callable[[], bool]:
            marker = writer.room_marker()
            return lambda: writer.room_marker() != marker

        return await retry_async(lambda: self.put(obj, block=False), Full, self._spool.space_bell,
                                 room_moved, timeout)

    @property
    def path(self) -> str:
        """The spool file behind this queue."""
        return self._spool.path

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.path}"
        return f"<shmq.{type(self).__name__} {state}>"


def _port_of(queue: Queue) -> Any:
    """The port of an unpickled ``queue``, holding it: what a pickled ``q.put`` or
    ``q.get`` (bound per queue to the port's C methods) unpickles to, so that
    ``Process(target=q.put)`` works under spawn as with multiprocessing.Queue."""
    port = queue._port
    port._hold(queue)
    return port


def reclaim_if_orphan(path: str, spool: Spool | None = None) -> bool:
    """Close ``spool`` (this process's handle of the anonymous queue at ``path``), then
    remove the queue if that was the last handle anywhere and its creator is dead
    (:func:`shmq.anonymous.reclaim`); return True if removed.  What a non-creator
    handle runs when it is closed, collected, or its process exits."""
    if spool is not None:
        try:
            spool.close()
        except Exception:
            pass
    return reclaim(path)


class JoinableQueue(Queue):
    """:class:`Queue` plus ``task_done()`` and ``join()`` (``multiprocessing.JoinableQueue``).

    The count of unfinished items is a named semaphore shared by every
    process; it is raised before an item is committed, so a producer killed
    mid-put can only make ``join()`` wait longer, never return early.
    """

    _counts_items = True

    def _attach(self, spool: Spool, trusted: bool) -> None:
        super()._attach(spool, trusted)
        self._unfinished = spool.open_semaphore(sem_name(spool.sem_prefix, SEM_UNFINISHED), 0)
        # the count's name, if created on a destroyed spool, must not outlive it
        spool.mapping.forget_semaphores_if_unlinked(spool.sem_prefix)

    def task_done(self) -> None:
        """Mark one item as processed.

        :raises ValueError: called more times than there were items.
        """
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if not self._unfinished.acquire(0):
            raise ValueError("task_done() called too many times")
        sp = self._spool
        if not self._unfinished.value and sp.space_bell.has_waiters():
            sp.space_bell.ring()

    def join(self, timeout: float | None = None) -> bool:
        """Block until every item put has been marked ``task_done()``.

        ``timeout`` (an extension) bounds the wait; returns True when done.
        """
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        sem = self._unfinished
        return self._spool.space_bell.wait(lambda: sem.value == 0, timeout)


class SimpleQueue(Queue):
    """An unbounded :class:`Queue` with the ``multiprocessing.SimpleQueue`` surface."""

    def __init__(self, *, capacity: int | str = DEFAULT_CAPACITY, max_capacity: int | str | None = None,
                 path: str | None = None, trusted: bool = False, ctx: Any = None) -> None:
        super().__init__(0, capacity=capacity, max_capacity=max_capacity, path=path,
                         trusted=trusted)

    def get(self) -> Any:  # type: ignore[override]  # as multiprocessing's SimpleQueue
        return super().get()

    def put(self, obj: Any) -> None:  # type: ignore[override]
        return super().put(obj)
