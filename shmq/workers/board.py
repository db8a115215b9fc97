"""Status boards: a small file of u64 words where each worker process has a row.

One implementation for every owner of worker processes: a service
(``PATH.svc``, :mod:`shmq.rpc.board`), a dispatcher (``PATH.dispatch``,
:mod:`shmq.dispatch.board`) and a process pool (an anonymous board, a
``memfd`` no path names).  What a board is for differs only in its
*layout* (:class:`Layout`: its kind, its geometry, the words after the
common ones); the file, the opening, the claims and the holder rows are
here.

Format (little-endian u64 words; ``docs/workers.md``, "Board format"):

* a header of ``hdr_words`` words: :data:`MAGIC`, :data:`VERSION`, the
  kind (eight ASCII bytes), the geometry (header words, rows, words per
  row), the creation time, the *owner* (the holder word of the process
  that owns the board exclusively, 0 for a board whose rows are claimed
  freely), the owner's state and start/stop times; the kind's own words
  from :data:`HDR_COMMON` on;
* ``rows`` rows of ``row_words`` words: the *holder* word (the pid and
  start time of the process writing the row, as lock holders', 0: free),
  the row's holding (words 1 to 15, :mod:`shmq.workers.holdings`), the
  kind's own words from :data:`ROW_COMMON` on.

Every word is published with one aligned 8-byte store and a row has one
writer (its holder), so counters are never torn; a snapshot of several
words is not atomic.  Rows are claimed under an ``flock`` of the file
held for microseconds; an exclusive owner holds the flock for as long as
it runs.

Hostile files (docs/security.md): a board is opened without following
links or blocking, only as a regular file owned by this user when
written; readers ``pread`` it (no mapping: a truncated file cannot raise
SIGBUS) and check its magic, version, kind and geometry; nothing in it is
ever unpickled.  A board of an older shmq (the per-kind formats before
this one) is refused by readers with a message saying what to do, and
rewritten by the next owner or claimer.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat as _stat
import time
from collections.abc import Iterator
from typing import NamedTuple

from .._lock import holder_alive, holder_pid, holder_word
from .._mapping import open_file
from ..errors import ShmqError

__all__ = ["Layout", "Board", "Row", "BoardBusy", "read_words", "live_rows", "MAGIC", "VERSION",
           "HDR_COMMON", "ROW_COMMON", "LOCK_WAIT_S"]

MAGIC = int.from_bytes(b"SHMQBRD1", "little")
VERSION = 1
# header words
(H_MAGIC, H_VERSION, H_KIND, H_HDR_WORDS, H_ROWS, H_ROW_WORDS, H_CREATED_NS, H_OWNER, H_STATE,
 H_STARTED_NS, H_STOPPED_NS) = range(11)
#: The kind's own header words start here.
HDR_COMMON = 16
#: Row words: the holder, then the holding (:mod:`shmq.workers.holdings`) ...
R_HOLDER = 0
#: ... and the kind's own row words from here on.
ROW_COMMON = 16
#: Sanity bounds on a board's geometry (a corrupt header must not make a reader
#: allocate or loop without bound).
MAX_HDR_WORDS = 1 << 16
MAX_ROWS = 4096
MAX_ROW_WORDS = 1 << 16
#: A claimer waits this long for the board's flock, then gives up (the caller
#: serves unrecorded): bounded, because a process forked by another thread while
#: a claimer held the flock would hold it for as long as it lives.
LOCK_WAIT_S = 2.0


class BoardBusy(ShmqError):
    """Another live process owns the board exclusively (``owner``: its pid, or None)."""

    kind = "busy"

    def __init__(self, text: str = "", owner: int | None = None) -> None:
        super().__init__(text, owner)
        self.owner = owner

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Layout(NamedTuple):
    """What kind of board a file is, and its geometry.

    ``kind``: up to eight ASCII characters, stored in the header.  ``rows``
    and ``row_words``: 0 when the owner chooses them when it creates the
    board (a dispatcher: one row per worker slot); readers then take them
    from the header.  ``what`` names the board in messages; ``legacy`` maps
    the magic of a board this kind replaced to the advice given for it.
    """

    kind: str
    hdr_words: int
    rows: int = 0
    row_words: int = 0
    what: str = "board"
    legacy: tuple[tuple[bytes, str], ...] = ()

    def kind_word(self) -> int:
        return int.from_bytes(self.kind.encode("ascii").ljust(8, b"\0"), "little")

    def file_bytes(self, rows: int | None = None, row_words: int | None = None) -> int:
        return 8 * (self.hdr_words + (rows or self.rows) * (row_words or self.row_words))


class Row:
    """One row of a mapped board, written by its one process (or by the board's owner
    once that process is dead).  ``w`` are the board's words, ``base`` the row's first."""

    def __init__(self, board: Board, index: int) -> None:
        self.board = board
        self.w = board.w
        self.index = index
        self.base = board.row_base(index)

    def get(self, field: int) -> int:
        return self.w[self.base + field]

    def set(self, field: int, value: int) -> None:
        self.w[self.base + field] = value

    def add(self, field: int, n: int = 1) -> None:
        """Add ``n`` to a word of the row (its single writer only)."""
        i = self.base + field
        self.w[i] = self.w[i] + n

    def hold(self) -> None:
        """This process writes the row from now on."""
        self.w[self.base + R_HOLDER] = holder_word()

    @property
    def holder(self) -> int:
        return self.w[self.base + R_HOLDER]

    def clear_holding(self) -> None:
        """Empty the holding words (1 to ROW_COMMON - 1; :mod:`shmq.workers.holdings`
        says what they mean): a row taken over from a dead holder starts empty-handed."""
        w, b = self.w, self.base
        for i in range(R_HOLDER + 1, ROW_COMMON):
            w[b + i] = 0

    def clear_holder(self) -> None:
        """Give the row up (if it is still ours): its counters stay."""
        if self.w[self.base + R_HOLDER] == holder_word():
            self.w[self.base + R_HOLDER] = 0


class Board:
    """A writable mapping of a board.

    Make it with :meth:`create` (make sure a valid board is at a path),
    :meth:`claim_row` (a row for this process, under the flock),
    :meth:`own` (the whole board, exclusively), :meth:`attach` (an existing
    board, for a worker whose row was assigned) or :meth:`anonymous` (a
    ``memfd``, for an owner that keeps its workers' rows to itself).
    """

    def __init__(self, mm: mmap.mmap, layout: Layout, fd: int | None = None) -> None:
        self.mm: mmap.mmap | None = mm
        self.w = memoryview(mm).cast("Q")
        self.layout = layout
        self.fd = fd  # held by an exclusive owner (its flock) or an anonymous board (its memfd)
        self.hdr_words = self.w[H_HDR_WORDS] or layout.hdr_words
        self.row_words = self.w[H_ROW_WORDS] or layout.row_words
        self.rows = self.w[H_ROWS] or layout.rows

    def row_base(self, index: int) -> int:
        return self.hdr_words + index * self.row_words

    def row(self, index: int) -> Row:
        """A handle on row ``index`` (assigned by the board's owner).

        :raises IndexError: no such row.
        """
        if not 0 <= index < self.rows:
            raise IndexError(f"row {index} of a board of {self.rows}")
        return Row(self, index)

    def close(self) -> None:
        """Unmap (and, for an owner, drop the flock; for an anonymous board, its fd)."""
        if self.mm is not None:
            self.w.release()
            self.mm.close()
            self.mm = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    # -- making and opening ---------------------------------------------------------

    @classmethod
    def create(cls, path: str, layout: Layout) -> None:
        """Make sure a valid board of ``layout`` (fixed geometry) is at ``path``: made
        if missing, zeroed and rewritten if it is not one (another kind, an older
        format, a wrong size).

        :raises shmq.ShmqError: something other than a regular file of ours is there,
            or its flock stayed held for :data:`LOCK_WAIT_S`.
        :raises OSError: it cannot be created.
        """
        fd = _open_for_writing(path, layout)
        try:
            _lock(fd, path, layout)
            _map_fixed(fd, layout).close()
        finally:
            os.close(fd)  # (no mapping kept: closing releases the flock)

    @classmethod
    def claim_row(cls, path: str, layout: Layout) -> Row | None:
        """Claim a row of the board at ``path`` for this process: one it holds already, a
        free one, or one whose holder is dead (its counters are kept, its holding
        cleared).  None when every row is held by a live process.

        :raises shmq.ShmqError: not a regular file of ours, or the flock stayed held.
        :raises OSError: the file cannot be created or mapped.
        """
        me = holder_word()
        fd = _open_for_writing(path, layout)
        try:
            _lock(fd, path, layout)  # one claimer at a time (held for microseconds)
            board = cls(_map_fixed(fd, layout), layout)
        except BaseException:
            os.close(fd)
            raise
        try:
            w, bases = board.w, [board.row_base(r) for r in range(board.rows)]
            holders = [w[b + R_HOLDER] for b in bases]
            pick = next((r for r, h in enumerate(holders) if h == me), None)
            if pick is None:
                pick = next((r for r, h in enumerate(holders) if h == 0), None)
            if pick is None:
                pick = next((r for r, h in enumerate(holders) if not holder_alive(h)), None)
            if pick is None:
                board.close()
                return None
            row = board.row(pick)
            row.clear_holding()
            row.hold()
        finally:
            # unlock explicitly: the mapping keeps a dup of fd (the same open file
            # description), so closing fd alone would leave the flock held
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        return row

    @classmethod
    def own(cls, path: str, layout: Layout, rows: int, row_words: int) -> tuple[Board, bytes | None]:
        """Take the board at ``path`` exclusively (its flock, held until :meth:`close`),
        sized for ``rows`` rows of ``row_words`` words, zeroed, its state "starting";
        :meth:`publish` makes it valid for readers.  Also returns what was there
        before, if it was a valid board of ``layout`` (its words as bytes), else None.

        :raises BoardBusy: another process owns it (the message names its pid).
        :raises shmq.ShmqError: not a regular file of ours.
        """
        fd = _open_for_writing(path, layout)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = None
                try:
                    owner = holder_pid(read_words(path, layout)[H_OWNER]) or None
                except (OSError, ShmqError):
                    pass
                raise BoardBusy(f"{path}: owned by another process (pid {owner})", owner) from None
            size = os.fstat(fd).st_size
            before = None
            try:
                before = bytes(_validate(os.pread(fd, size, 0), path, layout))
            except ShmqError:
                pass
            need = layout.file_bytes(rows, row_words)
            if size < need:
                os.ftruncate(fd, need)  # grows only: a worker mapping the old size stays valid
            size = max(size, need)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        w = memoryview(mm).cast("Q")
        w[H_STATE] = STATE_STARTING  # readers stop at the state word from here on
        mm[8 * (H_STATE + 1):] = bytes(size - 8 * (H_STATE + 1))
        _write_geometry(w, layout, rows, row_words)
        w[H_STARTED_NS] = time.time_ns()
        w.release()
        return cls(mm, layout, fd), before

    @classmethod
    def anonymous(cls, layout: Layout, rows: int, row_words: int | None = None) -> Board:
        """A board in a ``memfd`` (no path: nothing to clean up), owned by this process;
        its workers :meth:`attach_fd` to :attr:`fd` (inherited or passed to them)."""
        fd = os.memfd_create(f"shmq-{layout.kind}-board", os.MFD_CLOEXEC)
        try:
            size = layout.file_bytes(rows, row_words)
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        w = memoryview(mm).cast("Q")
        _write_geometry(w, layout, rows, row_words or layout.row_words)
        w[H_STARTED_NS] = time.time_ns()
        w.release()
        board = cls(mm, layout, fd)
        board.publish()
        return board

    @classmethod
    def attach(cls, path: str, layout: Layout) -> Board:
        """Map the valid board at ``path`` for writing (a worker whose row its owner
        assigned).

        :raises FileNotFoundError: no board.
        :raises shmq.ShmqError: not a valid board of ``layout``.
        """
        fd, st = open_file(path, write=True)  # never follows, never blocks, regular files only
        try:
            _validate(os.pread(fd, st.st_size, 0), path, layout)
            return cls(mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE),
                       layout)
        finally:
            os.close(fd)

    @classmethod
    def attach_fd(cls, fd: int, layout: Layout) -> Board:
        """Map the anonymous board behind ``fd`` (this process's copy; the caller keeps it).

        :raises shmq.ShmqError: not a valid board of ``layout``.
        """
        size = os.fstat(fd).st_size
        _validate(os.pread(fd, size, 0), "<anonymous board>", layout)
        return cls(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), layout)

    # -- an owner's header -------------------------------------------------------------

    def publish(self) -> None:
        """Make the board valid for readers: its owner (this process), version, magic last."""
        w = self.w
        w[H_OWNER] = holder_word()
        w[H_KIND] = self.layout.kind_word()
        w[H_VERSION] = VERSION
        w[H_MAGIC] = MAGIC

    def set_state(self, state: int) -> None:
        self.w[H_STATE] = state
        if state == STATE_STOPPED:
            self.w[H_STOPPED_NS] = time.time_ns()
            self.w[H_OWNER] = 0


#: The owner's state (``H_STATE``), for boards with an owner.
STATE_STOPPED, STATE_STARTING, STATE_RUNNING, STATE_STOPPING = 0, 1, 2, 3
STATE_NAMES = {STATE_STOPPED: "stopped", STATE_STARTING: "starting", STATE_RUNNING: "running",
               STATE_STOPPING: "stopping"}


def _write_geometry(w: memoryview, layout: Layout, rows: int, row_words: int) -> None:
    w[H_HDR_WORDS], w[H_ROWS], w[H_ROW_WORDS] = layout.hdr_words, rows, row_words
    w[H_KIND] = layout.kind_word()
    w[H_CREATED_NS] = time.time_ns()


def _open_for_writing(path: str, layout: Layout) -> int:
    # O_NONBLOCK + O_NOFOLLOW: a FIFO or link planted at the path neither blocks nor is followed
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    st = os.fstat(fd)
    if not _stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise ShmqError(f"{path}: not a regular file owned by this user; not a {layout.what}")
    return fd


def _lock(fd: int, path: str, layout: Layout) -> None:
    """The board's flock, waited for at most :data:`LOCK_WAIT_S`.

    :raises shmq.ShmqError: not obtained in time.
    """
    end = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > end:
                raise ShmqError(f"{path}: the {layout.what} stayed locked for "
                                f"{LOCK_WAIT_S:g} s") from None
            time.sleep(0.001)


def _map_fixed(fd: int, layout: Layout) -> mmap.mmap:
    """Map a fixed-geometry board under the caller's flock, (re)initializing it if it is
    not a valid board of ``layout``."""
    need = layout.file_bytes()
    size = os.fstat(fd).st_size
    if size != need:
        if size > need:  # not ours (another version?): start over at our size
            os.ftruncate(fd, 0)
        os.ftruncate(fd, need)
    mm = mmap.mmap(fd, need, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    w = memoryview(mm).cast("Q")
    try:
        if (w[H_MAGIC], w[H_VERSION], w[H_KIND], w[H_HDR_WORDS], w[H_ROWS], w[H_ROW_WORDS]) != (
                MAGIC, VERSION, layout.kind_word(), layout.hdr_words, layout.rows, layout.row_words):
            w[H_MAGIC] = 0  # readers refuse it from here on
            mm[8:] = bytes(need - 8)
            _write_geometry(w, layout, layout.rows, layout.row_words)
            w[H_VERSION] = VERSION
            w[H_MAGIC] = MAGIC  # last: valid from here on
    finally:
        w.release()
    return mm


def _validate(raw: bytes, path: str, layout: Layout) -> memoryview:
    """``raw`` (a whole board file) as u64 words, checked.

    :raises shmq.ShmqError: not a valid board of ``layout``; an older shmq's board of
        this kind gets its own message, saying what to do.
    """
    what = layout.what
    if len(raw) < 8 * HDR_COMMON:
        raise ShmqError(f"{path}: not a {what} (size {len(raw)})")
    for magic, advice in layout.legacy:
        if raw[:8] == magic:
            raise ShmqError(f"{path}: a {what} written by an older shmq (format "
                            f"{magic.decode('ascii', 'replace')}); {advice}")
    w = memoryview(raw[:len(raw) - len(raw) % 8]).cast("Q")
    if w[H_MAGIC] != MAGIC or w[H_VERSION] != VERSION or w[H_KIND] != layout.kind_word():
        raise ShmqError(f"{path}: not a {what} (bad magic, version or kind)")
    hdr, rows, rw = w[H_HDR_WORDS], w[H_ROWS], w[H_ROW_WORDS]
    if not (layout.hdr_words == hdr and 0 < rows <= MAX_ROWS and ROW_COMMON <= rw <= MAX_ROW_WORDS
            and (not layout.rows or (rows, rw) == (layout.rows, layout.row_words))):
        raise ShmqError(f"{path}: not a {what} (bad geometry)")
    need = layout.file_bytes(rows, rw)
    if len(raw) < need or (layout.rows and len(raw) != need):
        raise ShmqError(f"{path}: not a {what} (size {len(raw)}, expected {need})")
    return w


def read_words(path: str, layout: Layout) -> memoryview:
    """The board at ``path`` as u64 words: a copy, read with ``pread``, checked.

    :raises FileNotFoundError: no board.
    :raises shmq.NotASpool: not a regular file (nothing is followed or blocked on).
    :raises shmq.ShmqError: not a valid board of ``layout``.
    """
    fd, st = open_file(path, write=False)  # never follows, never blocks, regular files only
    try:
        raw = os.pread(fd, max(st.st_size, 8 * HDR_COMMON) + 8, 0)
    finally:
        os.close(fd)
    return _validate(raw, path, layout)


def live_rows(w: memoryview, holders: bool = True) -> Iterator[tuple[int, int, int]]:
    """``(index, base, holder)`` of every row of the board words ``w`` (read with
    :func:`read_words`); with ``holders``, only rows whose holder is a live process."""
    hdr, rows, rw = w[H_HDR_WORDS], w[H_ROWS], w[H_ROW_WORDS]
    for r in range(rows):
        base = hdr + r * rw
        h = w[base + R_HOLDER]
        if not holders or (h and holder_alive(h)):
            yield r, base, h
