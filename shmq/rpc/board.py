"""The service board ``PATH.svc``: who serves a service, what it answered, how long calls took.

A small file of u64 words next to the request queue, written by the
service's workers and read by ``shmq stat``/``top``/``metrics`` (and
:func:`service_status`) from any process:

* a header of :data:`HDR_WORDS` words: magic ``SHMQSVC1``, version, the
  number of rows and of histogram buckets, the creation time;
* :data:`ROWS` rows of :data:`ROW_WORDS` words, one per serving process
  (claimed on its first ``Service.get``): its holder word (pid and start
  time, as lock holders'; 0 once released), calls answered, answered with
  an error, dropped because the caller had given up, the wall-clock time
  the call in hand was taken (0: idle), the request-ring seqs it holds
  (``[lo, hi)`` and how many: what callers read to tell a call in a live
  worker's hands from one lost with a dead worker, see :mod:`shmq.rpc`),
  redelivered calls taken, and its lease (seconds a call may stay in its
  hands before callers send it again), then two histograms of
  :data:`BUCKETS` counters: call **latency** (the request's enqueue by the
  caller to the reply written into the caller's reply queue: queueing,
  redelivery after a crash, the handler and the reply) and **service
  time** (the call handed to the handler to its answer).

Buckets are logarithmic, four per power of two of microseconds
(:func:`bucket_of`); a quantile is reported as the midpoint of its bucket,
within 12.5% of the true value (sub-4 µs values are exact to 1 µs; the
last bucket holds everything from 2^35 µs, about 9.5 hours).

Every word is published with one aligned 8-byte store, and a row has one
writer (the process named by its holder word), so counters are never
torn; a reader's snapshot of several words is not atomic (a call may be
counted in ``calls`` and not yet in its bucket).  Rows are claimed under
an ``flock`` of the file; a row whose holder died is taken over with its
counters (the totals are the service's since the board was made).

Hostile files (docs/security.md): the board is opened without following
links or blocking, only as a regular file (and owned by this user when
written); readers ``pread`` it (no mapping: a truncated file cannot
raise SIGBUS) and check its magic, version and geometry; nothing in it
is ever unpickled.  The board is best effort for the service: a worker
that cannot open or claim it serves calls anyway and records nothing.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat as _stat
import time
from typing import TYPE_CHECKING, Any

from .._lock import holder_alive, holder_pid, holder_word
from .._mapping import open_file, resolve_path
from ..errors import ShmqError

if TYPE_CHECKING:
    from _typeshed import StrPath

__all__ = ["board_path", "Board", "service_status", "held_ranges", "bucket_of", "bucket_mid_s", "quantile",
           "ROWS", "BUCKETS"]

log = logging.getLogger("shmq.service")

MAGIC = int.from_bytes(b"SHMQSVC1", "little")
VERSION = 2  # 2: rows hold the request seqs in hand, redeliveries and the lease
HDR_WORDS = 16
(H_MAGIC, H_VERSION, H_ROWS, H_BUCKETS, H_CREATED_NS) = range(5)
#: Serving processes recorded at once (more serve unrecorded: logged once each).
ROWS = 64
#: Histogram buckets: [0, 1 µs), then four per power of two of µs up to 2^35 µs.
SUB = 4
MAX_EXP = 35
BUCKETS = 1 + SUB * (MAX_EXP + 1)
# row words
(R_HOLDER, R_CALLS, R_FAILED, R_EXPIRED, R_BUSY_NS, R_HELD_LO, R_HELD_HI, R_HELD_N,
 R_REDELIVERED, R_LEASE_NS) = range(10)
ROW_HDR = 16
R_LATENCY = ROW_HDR
R_SERVICE = ROW_HDR + BUCKETS
ROW_WORDS = ROW_HDR + 2 * BUCKETS
FILE_BYTES = 8 * (HDR_WORDS + ROWS * ROW_WORDS)


def board_path(path: StrPath) -> str:
    """The board file of the service whose request queue is at ``path``."""
    return resolve_path(path) + ".svc"


def bucket_of(ns: int) -> int:
    """The histogram bucket of a duration of ``ns`` nanoseconds."""
    us = ns // 1000
    if us < 1:
        return 0
    e = us.bit_length() - 1
    if e > MAX_EXP:
        return BUCKETS - 1
    sub = (us >> (e - 2)) & 3 if e >= 2 else (us << (2 - e)) & 3
    return 1 + SUB * e + sub


def bucket_mid_s(i: int) -> float:
    """The value (seconds) reported for bucket ``i``: the middle of its range."""
    if i <= 0:
        return 0.5e-6
    e, sub = divmod(i - 1, SUB)
    lo = (1 << e) * (SUB + sub) / SUB
    hi = (1 << e) * (SUB + sub + 1) / SUB
    if e < 2:  # whole microseconds: the bucket holds one value
        return lo * 1e-6
    return (lo + hi) / 2 * 1e-6


def quantile(counts: list[int], q: float) -> float | None:
    """The ``q`` quantile (nearest rank, 0 < q <= 1) of a histogram, in seconds; None if empty."""
    total = sum(counts)
    if not total:
        return None
    rank = max(1, -(-round(q * 1_000_000) * total // 1_000_000))  # ceil(q * total), in integers
    seen = 0
    for i, c in enumerate(counts):
        seen += c
        if seen >= rank:
            return bucket_mid_s(i)
    return bucket_mid_s(len(counts) - 1)


class Board:
    """This process's row of a service's board (writable mapping).

    Make it with :meth:`claim`; :meth:`record` after each answer,
    :meth:`busy` when a call is taken, :meth:`release` when done serving.
    """

    def __init__(self, mm: mmap.mmap, row: int) -> None:
        self._mm: mmap.mmap | None = mm
        self._w = memoryview(mm).cast("Q")
        self._base = HDR_WORDS + row * ROW_WORDS
        self.row = row

    @classmethod
    def create(cls, path: str) -> None:
        """Make the board file at ``path`` if it is missing or not a valid board (zeroed).

        :raises shmq.ShmqError: something other than a regular file of ours is there.
        :raises OSError: it cannot be created.
        """
        fd = _open_for_writing(path)
        try:
            _lock(fd, path)
            _map(fd).close()
        finally:
            os.close(fd)  # (no mapping kept: closing releases the flock)

    @classmethod
    def claim(cls, path: str) -> Board | None:
        """Claim a row for this process (one whose holder is this process, free, or dead).

        Returns None when every row is held by a live process.

        :raises shmq.ShmqError: something other than a regular file of ours is there.
        :raises OSError: the file cannot be created or mapped.
        """
        me = holder_word()
        fd = _open_for_writing(path)
        try:
            _lock(fd, path)  # one claimer at a time (held for microseconds)
            mm = _map(fd)
            w = memoryview(mm).cast("Q")
        except BaseException:
            os.close(fd)
            raise
        try:
            holders = [w[HDR_WORDS + r * ROW_WORDS + R_HOLDER] for r in range(ROWS)]
            pick = next((r for r, h in enumerate(holders) if h == me), None)
            if pick is None:
                pick = next((r for r, h in enumerate(holders) if h == 0), None)
            if pick is None:
                pick = next((r for r, h in enumerate(holders) if not holder_alive(h)), None)
            if pick is None:
                w.release()
                mm.close()
                return None
            base = HDR_WORDS + pick * ROW_WORDS
            w[base + R_BUSY_NS] = 0
            w[base + R_HELD_N] = w[base + R_HELD_LO] = w[base + R_HELD_HI] = 0
            w[base + R_LEASE_NS] = 0
            w[base + R_HOLDER] = me
        finally:
            w.release()
            # unlock explicitly: the mapping keeps a dup of fd (the same open file
            # description), so closing fd alone would leave the flock held
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        return cls(mm, pick)

    def busy(self) -> None:
        """A call was taken: the row shows it in hand since now."""
        self._w[self._base + R_BUSY_NS] = time.time_ns()

    def hold(self, lo: int, hi: int, n: int) -> None:
        """Publish the request seqs in hand: every one of them lies in ``[lo, hi)``
        (``n`` of them).  Called right after a take and after each answer."""
        w, b = self._w, self._base
        # hi first: a reader may see the old range widened, never one that misses
        # a seq in hand (callers also look twice before they send a call again)
        w[b + R_HELD_HI] = hi
        w[b + R_HELD_LO] = lo
        w[b + R_HELD_N] = n

    def set_lease(self, seconds: float) -> None:
        w = self._w
        w[self._base + R_LEASE_NS] = round(seconds * 1e9)

    def redelivered(self) -> None:
        """Count a call taken again (a caller sent it again after its worker died)."""
        w, b = self._w, self._base
        w[b + R_REDELIVERED] = w[b + R_REDELIVERED] + 1

    def idle(self) -> None:
        self._w[self._base + R_BUSY_NS] = 0

    def record(self, latency_ns: int, service_ns: int, failed: bool) -> None:
        """Count one answered call: its latency and service time, and whether it was an error."""
        self.record_many([(latency_ns, service_ns, failed)])

    def record_many(self, answers: list[tuple[int, int, bool]]) -> None:
        """:meth:`record` of each ``(latency_ns, service_ns, failed)``, the calls count last."""
        w, b = self._w, self._base
        lat, svc = b + R_LATENCY, b + R_SERVICE
        failed = 0
        for latency_ns, service_ns, bad in answers:
            i = lat + bucket_of(latency_ns if latency_ns > 0 else 0)
            w[i] += 1
            i = svc + bucket_of(service_ns if service_ns > 0 else 0)
            w[i] += 1
            failed += bad
        if failed:
            w[b + R_FAILED] += failed
        w[b + R_BUSY_NS] = 0
        w[b + R_CALLS] += len(answers)  # last: a reader sees the buckets first

    def record_bulk(self, n: int, latency_ns: int, service_ns: int, failed: int) -> None:
        """``n`` calls answered together (a bundle): each with ``latency_ns`` and
        ``service_ns``, ``failed`` of them with an error; the calls count last."""
        w, b = self._w, self._base
        w[b + R_LATENCY + bucket_of(latency_ns if latency_ns > 0 else 0)] += n
        w[b + R_SERVICE + bucket_of(service_ns if service_ns > 0 else 0)] += n
        if failed:
            w[b + R_FAILED] += failed
        w[b + R_BUSY_NS] = 0
        w[b + R_CALLS] += n  # last: a reader sees the buckets first

    def expired(self, n: int = 1) -> None:
        """Count ``n`` calls dropped because their caller had given up."""
        w, b = self._w, self._base
        w[b + R_EXPIRED] = w[b + R_EXPIRED] + n

    def release(self) -> None:
        """Give the row up (its counters stay in the totals) and unmap."""
        if self._mm is None:
            return
        self._w[self._base + R_BUSY_NS] = 0
        self._w[self._base + R_HELD_N] = 0
        if self._w[self._base + R_HOLDER] == holder_word():
            self._w[self._base + R_HOLDER] = 0
        self._w.release()
        self._mm.close()
        self._mm = None


def _open_for_writing(path):
    # O_NONBLOCK + O_NOFOLLOW: a FIFO or link planted at the path neither blocks nor is followed
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    st = os.fstat(fd)
    if not _stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise ShmqError(f"{path}: not a regular file owned by this user; not a service board")
    return fd


#: A claimer waits this long for the board's flock, then serves unrecorded.
LOCK_WAIT_S = 2.0


def _lock(fd, path):
    """The board's flock, waited for at most :data:`LOCK_WAIT_S` (bounded: a process forked
    by another thread while a claimer held it would hold it for as long as it lives).

    :raises shmq.ShmqError: not obtained in time.
    """
    end = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > end:
                raise ShmqError(f"{path}: the service board stayed locked for "
                                f"{LOCK_WAIT_S:g} s") from None
            time.sleep(0.001)


def _map(fd):
    """Map the board under the caller's flock, (re)initializing it if it is not a valid board."""
    size = os.fstat(fd).st_size
    if size != FILE_BYTES:
        if size > FILE_BYTES:  # not ours (another version?): start over at our size
            os.ftruncate(fd, 0)
        os.ftruncate(fd, FILE_BYTES)
    mm = mmap.mmap(fd, FILE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    w = memoryview(mm).cast("Q")
    try:
        if (w[H_MAGIC], w[H_VERSION], w[H_ROWS], w[H_BUCKETS]) != (MAGIC, VERSION, ROWS, BUCKETS):
            w[H_MAGIC] = 0  # readers refuse it from here on
            mm[8:] = bytes(FILE_BYTES - 8)
            w[H_ROWS], w[H_BUCKETS], w[H_CREATED_NS] = ROWS, BUCKETS, time.time_ns()
            w[H_VERSION] = VERSION
            w[H_MAGIC] = MAGIC  # last: valid from here on
    finally:
        w.release()
    return mm


def _read_board(path: StrPath) -> memoryview:
    """The board of the service at ``path`` as u64 words (a copy, read with ``pread``).

    :raises FileNotFoundError: no board (no service ever ran at ``path``).
    :raises shmq.ShmqError: ``PATH.svc`` is not a regular file, or not a board.
    """
    bp = board_path(path)
    fd, st = open_file(bp, write=False)  # never follows, never blocks, regular files only
    try:
        raw = os.pread(fd, FILE_BYTES + 8, 0)
    finally:
        os.close(fd)
    if len(raw) != FILE_BYTES:
        raise ShmqError(f"{bp}: not a service board (size {len(raw)}, expected {FILE_BYTES})")
    w = memoryview(raw).cast("Q")
    if (w[H_MAGIC], w[H_VERSION], w[H_ROWS], w[H_BUCKETS]) != (MAGIC, VERSION, ROWS, BUCKETS):
        raise ShmqError(f"{bp}: not a service board (bad magic, version or geometry)")
    return w


def held_ranges(path: StrPath) -> list[tuple[int, int, int, int]]:
    """``(lo, hi, since_ns, lease_ns)`` of every live serving process holding calls: the
    request seqs in its hands lie in ``[lo, hi)``, the first was taken at ``since_ns``
    (wall clock), and it may keep a call ``lease_ns`` before callers send it again.

    :raises FileNotFoundError: no board.
    :raises shmq.ShmqError: not a board.
    """
    w = _read_board(path)
    out = []
    for r in range(ROWS):
        b = HDR_WORDS + r * ROW_WORDS
        h = w[b + R_HOLDER]
        if h and w[b + R_HELD_N] and holder_alive(h):
            out.append((w[b + R_HELD_LO], w[b + R_HELD_HI], w[b + R_BUSY_NS], w[b + R_LEASE_NS]))
    return out


def service_status(path: StrPath) -> dict[str, Any]:
    """What the board of the service at ``path`` says, from any process (reads only).

    Returns ``{"board", "created_ns", "workers", "pids", "busy", "in_flight",
    "calls", "failed", "expired", "redeliveries", "latency", "service_time"}``:
    ``workers`` and ``pids`` are the live processes holding a row (serving),
    ``busy`` how many of them hold a call now, ``in_flight`` the calls they
    hold (taken, not answered yet), ``calls`` the calls answered (``failed``
    of them with an error), ``expired`` the calls dropped because their
    caller had given up, ``redeliveries`` the calls taken again after a
    worker died with them; ``latency`` and ``service_time`` are
    ``{"count", "p50", "p99", "max"}`` in seconds (None when no
    call was recorded).  Totals count every process that ever held a row.

    :raises FileNotFoundError: no board (no service ever ran at ``path``).
    :raises shmq.ShmqError: ``PATH.svc`` is not a regular file, or not a board.
    """
    w = _read_board(path)
    pids, busy, in_flight, calls, failed, expired, again = [], 0, 0, 0, 0, 0, 0
    lat, svc = [0] * BUCKETS, [0] * BUCKETS
    for r in range(ROWS):
        b = HDR_WORDS + r * ROW_WORDS
        calls += w[b + R_CALLS]
        failed += w[b + R_FAILED]
        expired += w[b + R_EXPIRED]
        again += w[b + R_REDELIVERED]
        for i in range(BUCKETS):
            lat[i] += w[b + R_LATENCY + i]
            svc[i] += w[b + R_SERVICE + i]
        h = w[b + R_HOLDER]
        if h and holder_alive(h):
            pids.append(holder_pid(h))
            busy += bool(w[b + R_BUSY_NS])
            in_flight += w[b + R_HELD_N]
    return {"board": board_path(path), "created_ns": w[H_CREATED_NS], "workers": len(pids),
            "pids": sorted(pids), "busy": busy, "in_flight": in_flight, "calls": calls,
            "failed": failed, "expired": expired, "redeliveries": again,
            "latency": _summary(lat), "service_time": _summary(svc)}


def _summary(counts):
    n = sum(counts)
    top = max((i for i, c in enumerate(counts) if c), default=None)
    return {"count": n, "p50": quantile(counts, 0.5), "p99": quantile(counts, 0.99),
            "max": None if top is None else bucket_mid_s(top)}
