"""The service board ``PATH.svc``: who serves a service, what it answered, how long calls took.

A status board of the worker platform (:mod:`shmq.workers.board`: the
file, its opening, the claims and the holder rows) of kind ``service``,
next to the request ring, written by the service's workers and read by
``shmq stat``/``top``/``metrics`` (and :func:`service_status`) from any
process:

* the platform's header (:data:`HDR_WORDS` words; its magic, version, kind
  and geometry);
* :data:`ROWS` rows of :data:`ROW_WORDS` words, one per serving process
  (claimed on its first ``Service.get``): its holder word, its holding (the
  request-ring seqs in its hands, ``[lo, hi)`` and how many, the time the
  first was taken and its lease: what callers read to tell a call in a live
  worker's hands from one lost with a dead worker, see
  :mod:`shmq.workers.holdings`), then calls answered, answered with an
  error, dropped because the caller had given up, redelivered calls taken,
  and two histograms of :data:`BUCKETS` counters: call **latency** (the
  request's enqueue by the caller to the reply written into the caller's
  reply queue: queueing, redelivery after a crash, the handler and the
  reply) and **service time** (the call handed to the handler to its
  answer).

Buckets are logarithmic, four per power of two of microseconds
(:func:`bucket_of`); a quantile is reported as the midpoint of its bucket,
within 12.5% of the true value (sub-4 µs values are exact to 1 µs; the
last bucket holds everything from 2^35 µs, about 9.5 hours).

A row whose holder died is taken over with its counters (the totals are
the service's since the board was made).  The board is best effort for
the service: a worker that cannot open or claim it serves calls anyway and
records nothing.  A board of an older shmq (``SHMQSVC1``) is rewritten by
the next worker that claims a row; until then readers refuse it, saying so.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from .._lock import holder_pid
from .._mapping import resolve_path
from ..workers import board as _board
from ..workers import holdings as _holdings
from ..workers.board import HDR_COMMON, R_HOLDER, ROW_COMMON, Layout, Row, live_rows, read_words

if TYPE_CHECKING:
    from _typeshed import StrPath

__all__ = ["board_path", "Board", "service_status", "held_ranges", "bucket_of", "bucket_mid_s", "quantile",
           "ROWS", "BUCKETS", "LAYOUT"]

log = logging.getLogger("shmq.service")

HDR_WORDS = HDR_COMMON
#: Serving processes recorded at once (more serve unrecorded: logged once each).
ROWS = 64
#: Histogram buckets: [0, 1 µs), then four per power of two of µs up to 2^35 µs.
SUB = 4
MAX_EXP = 35
BUCKETS = 1 + SUB * (MAX_EXP + 1)
# row words after the platform's (holder, holding)
(R_CALLS, R_FAILED, R_EXPIRED, R_REDELIVERED) = range(ROW_COMMON, ROW_COMMON + 4)
ROW_HDR = ROW_COMMON + 16
R_LATENCY = ROW_HDR
R_SERVICE = ROW_HDR + BUCKETS
ROW_WORDS = ROW_HDR + 2 * BUCKETS
LAYOUT = Layout("service", HDR_WORDS, ROWS, ROW_WORDS, what="service board",
                legacy=((b"SHMQSVC1", "start the service with this shmq (its first worker "
                         "rewrites the board), or remove the file"),))
FILE_BYTES = LAYOUT.file_bytes()
assert R_HOLDER == 0


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
    """This process's row of a service's board.

    Make it with :meth:`claim`; :meth:`record` after each answer,
    :meth:`busy` when a call is taken, :meth:`release` when done serving.
    """

    def __init__(self, row: Row) -> None:
        self._r: Row | None = row
        self._w = row.w
        self._base = row.base
        self.row = row.index

    @property
    def words(self) -> Row:
        """The platform's handle on this row (its holding is :mod:`shmq.workers.holdings`')."""
        assert self._r is not None
        return self._r

    @classmethod
    def create(cls, path: str) -> None:
        """Make the board file at ``path`` if it is missing or not a valid board (zeroed).

        :raises shmq.ShmqError: something other than a regular file of ours is there.
        :raises OSError: it cannot be created.
        """
        _board.Board.create(path, LAYOUT)

    @classmethod
    def claim(cls, path: str) -> Board | None:
        """Claim a row for this process (one whose holder is this process, free, or dead).

        Returns None when every row is held by a live process.

        :raises shmq.ShmqError: something other than a regular file of ours is there.
        :raises OSError: the file cannot be created or mapped.
        """
        row = _board.Board.claim_row(path, LAYOUT)
        return None if row is None else cls(row)

    def busy(self) -> None:
        """A call was taken: the row shows it in hand since now."""
        _holdings.set_since(self.words, time.time_ns())

    def hold(self, lo: int, hi: int, n: int) -> None:
        """Publish the request seqs in hand: every one of them lies in ``[lo, hi)``
        (``n`` of them).  Called right after a take and after each answer."""
        _holdings.hold_range(self.words, lo, hi, n)

    def set_lease(self, seconds: float) -> None:
        _holdings.set_lease(self.words, seconds)

    def redelivered(self) -> None:
        """Count a call taken again (a caller sent it again after its worker died)."""
        w, b = self._w, self._base
        w[b + R_REDELIVERED] = w[b + R_REDELIVERED] + 1

    def idle(self) -> None:
        _holdings.set_since(self.words, 0)

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
        _holdings.set_since(self.words, 0)
        w[b + R_CALLS] += len(answers)  # last: a reader sees the buckets first

    def record_bulk(self, n: int, latency_ns: int, service_ns: int, failed: int) -> None:
        """``n`` calls answered together (a bundle): each with ``latency_ns`` and
        ``service_ns``, ``failed`` of them with an error; the calls count last."""
        w, b = self._w, self._base
        w[b + R_LATENCY + bucket_of(latency_ns if latency_ns > 0 else 0)] += n
        w[b + R_SERVICE + bucket_of(service_ns if service_ns > 0 else 0)] += n
        if failed:
            w[b + R_FAILED] += failed
        _holdings.set_since(self.words, 0)
        w[b + R_CALLS] += n  # last: a reader sees the buckets first

    def expired(self, n: int = 1) -> None:
        """Count ``n`` calls dropped because their caller had given up."""
        w, b = self._w, self._base
        w[b + R_EXPIRED] = w[b + R_EXPIRED] + n

    def release(self) -> None:
        """Give the row up (its counters stay in the totals) and unmap."""
        r = self._r
        if r is None:
            return
        _holdings.set_since(r, 0)
        _holdings.hold_range(r, 0, 0, 0)
        r.clear_holder()
        r.board.close()
        self._r = None


def _read_board(path: StrPath) -> memoryview:
    """The board of the service at ``path`` as u64 words (a copy, read with ``pread``).

    :raises FileNotFoundError: no board (no service ever ran at ``path``).
    :raises shmq.ShmqError: ``PATH.svc`` is not a regular file, or not a board (an older
        shmq's board is named as such, with what to do).
    """
    return read_words(board_path(path), LAYOUT)


def held_ranges(path: StrPath) -> list[tuple[int, int, int, int]]:
    """``(lo, hi, since_ns, lease_ns)`` of every live serving process holding calls: the
    request seqs in its hands lie in ``[lo, hi)``, the first was taken at ``since_ns``
    (wall clock), and it may keep a call ``lease_ns`` before callers send it again.

    :raises FileNotFoundError: no board.
    :raises shmq.ShmqError: not a board.
    """
    return _holdings.held_ranges(_read_board(path))


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
    live = {r for r, _b, _h in live_rows(w)}
    for r, b, h in live_rows(w, holders=False):
        calls += w[b + R_CALLS]
        failed += w[b + R_FAILED]
        expired += w[b + R_EXPIRED]
        again += w[b + R_REDELIVERED]
        for i in range(BUCKETS):
            lat[i] += w[b + R_LATENCY + i]
            svc[i] += w[b + R_SERVICE + i]
        if r in live:
            pids.append(holder_pid(h))
            busy += bool(w[b + _holdings.R_SINCE_NS])
            in_flight += w[b + _holdings.R_HELD_N]
    return {"board": board_path(path), "created_ns": w[_board.H_CREATED_NS], "workers": len(pids),
            "pids": sorted(pids), "busy": busy, "in_flight": in_flight, "calls": calls,
            "failed": failed, "expired": expired, "redeliveries": again,
            "latency": _summary(lat), "service_time": _summary(svc)}


def _summary(counts):
    n = sum(counts)
    top = max((i for i, c in enumerate(counts) if c), default=None)
    return {"count": n, "p50": quantile(counts, 0.5), "p99": quantile(counts, 0.99),
            "max": None if top is None else bucket_mid_s(top)}
