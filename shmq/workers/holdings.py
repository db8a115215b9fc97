"""At-least-once bookkeeping: what each worker holds, on its board row, and who puts
back what a dead worker held.

A worker writes into its row, *before* it acts on anything it took, what it
holds, and drops it *after* the result is out (the reply written, the
message settled).  So at any instant a piece of work is in exactly one of
these states, all readable from any process: still queued (past the
group's position in the ring), in a live worker's hands (its row; its
holder word names a live process), answered, or **lost** with a dead
worker.  Words 1 to 15 of every row (:mod:`shmq.workers.board`) are the
holding:

* ``SINCE``: wall-clock ns when the first thing in hand was taken (0: idle);
  ``LEASE``: how long (ns) a caller trusts the worker with it;
* ``N``, ``LO``, ``HI``: how many ring frames' calls it holds, all with
  seqs in ``[LO, HI)`` (:class:`Hands`; written ``HI`` first, so a reader
  may see the range widened, never one that misses a seq in hand);
* ``FRAME``, ``RUNNING``: the frame (seq + 1) being decoded, run or
  answered, and the task (id + 1) running now: what a death is charged to;
* ``SLOT``, ``TOKEN``, ``ATTEMPT``, ``MSG``: a work-queue lease in hand
  (:func:`hold_lease`).

Who puts back what a dead worker held is whoever keeps the work:

* a service's **callers** keep each call until it is answered; a
  :class:`Lookout` finds the calls that are neither queued, nor in a live
  worker's hands, nor answered, and the caller sends them again;
* a dispatcher's **supervisor** gives a dead worker's lease back to its work
  queue, which keeps the message (:func:`reclaim`, then
  ``WorkQueue.release``);
* a pool's **parent** keeps each task until answered and sees its workers
  die: it puts back at once what the dead worker's row held
  (:func:`reclaim`) and charges the attempt to the task that was running;
  a :class:`Lookout` covers the rest (a worker killed between a take and its
  row's update).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, NamedTuple

from .board import ROW_COMMON, Row, live_rows

__all__ = ["Hands", "Held", "Lookout", "hold_range", "hold_lease", "drop_lease", "peek", "reclaim",
           "held_ranges", "set_lease", "set_since", "working_on"]

(R_SINCE_NS, R_LEASE_NS, R_HELD_N, R_HELD_LO, R_HELD_HI, R_FRAME, R_RUNNING, R_SLOT, R_TOKEN,
 R_ATTEMPT, R_MSG) = range(1, 12)
assert R_MSG < ROW_COMMON


def hold_range(row: Row, lo: int, hi: int, n: int) -> None:
    """Publish the frames in hand: every one of them has a seq in ``[lo, hi)`` (``n``
    calls in them).  Called right after a take and after each answer."""
    w, b = row.w, row.base
    # hi first: a reader may see the old range widened, never one that misses a seq in
    # hand (callers also look twice before they send a call again)
    w[b + R_HELD_HI] = hi
    w[b + R_HELD_LO] = lo
    w[b + R_HELD_N] = n


def set_since(row: Row, ns: int) -> None:
    """The first thing in hand was taken at ``ns`` (wall clock; 0: idle)."""
    row.w[row.base + R_SINCE_NS] = ns


def set_lease(row: Row, seconds: float) -> None:
    row.w[row.base + R_LEASE_NS] = round(seconds * 1e9)


def working_on(row: Row, frame_seq: int, task_id: int | None) -> None:
    """What a death now is charged to: frame ``frame_seq`` (-1: none) and, while a task
    runs, that task's id (None: decoding or answering the frame)."""
    w, b = row.w, row.base
    w[b + R_RUNNING] = 0 if task_id is None else task_id + 1
    w[b + R_FRAME] = frame_seq + 1


def hold_lease(row: Row, msg_id: int, slot: int, token: int, attempt: int, since_ns: int) -> None:
    """A work-queue message is in hand under the lease ``(slot, token)``: what the
    owner releases if this worker dies (``N`` last: the row shows it once complete)."""
    w, b = row.w, row.base
    w[b + R_MSG] = msg_id
    w[b + R_SLOT] = slot
    w[b + R_TOKEN] = token
    w[b + R_ATTEMPT] = attempt
    w[b + R_SINCE_NS] = since_ns
    w[b + R_HELD_N] = 1


def drop_lease(row: Row) -> None:
    """The message in hand was settled (acked or nacked): nothing to release any more."""
    row.w[row.base + R_HELD_N] = 0


class Held(NamedTuple):
    """What a row held (read by :func:`reclaim`): ``n`` things, frames with seqs in
    ``[lo, hi)``, ``frame``/``running`` the frame seq and task id being worked on (-1:
    none), a work-queue lease ``(slot, token)`` of message ``msg`` at ``attempt``, all
    taken at ``since_ns``."""

    n: int
    lo: int
    hi: int
    frame: int
    running: int
    slot: int
    token: int
    attempt: int
    msg: int
    since_ns: int


def peek(row: Row) -> Held:
    """What ``row`` holds now (a snapshot, not atomic: its holder may be changing it)."""
    w, b = row.w, row.base
    return Held(w[b + R_HELD_N], w[b + R_HELD_LO], w[b + R_HELD_HI], w[b + R_FRAME] - 1,
                w[b + R_RUNNING] - 1, w[b + R_SLOT], w[b + R_TOKEN], w[b + R_ATTEMPT], w[b + R_MSG],
                w[b + R_SINCE_NS])


def reclaim(row: Row) -> Held | None:
    """What the dead holder of ``row`` held (None: nothing), and empty the holding: the
    owner of the work puts it back.  Only for a row whose holder is known dead (its
    single writer is gone: the caller writes it now)."""
    held = peek(row)
    row.clear_holding()
    return held if held.n or held.frame >= 0 else None


def held_ranges(w: memoryview) -> list[tuple[int, int, int, int]]:
    """``(lo, hi, since_ns, lease_ns)`` of every live row holding frames, from board words
    read with :func:`shmq.workers.board.read_words`."""
    out = []
    for _r, b, _h in live_rows(w):
        if w[b + R_HELD_N]:
            out.append((w[b + R_HELD_LO], w[b + R_HELD_HI], w[b + R_SINCE_NS], w[b + R_LEASE_NS]))
    return out


class Hands:
    """The ring frames one worker took and has not finished, published on its row
    (``row`` None: a worker without a row works unrecorded).

    :meth:`took` right after a take (published at once: callers must see them
    in our hands), :meth:`count` when a frame turns out to hold several calls,
    :meth:`answered` as calls are answered, :meth:`publish` after the answers
    are out (reply first: a caller never finds a call neither in our hands nor
    answered).
    """

    __slots__ = ("row", "open", "hi")

    def __init__(self, row: Row | None = None) -> None:
        self.row = row
        self.open: dict[int, int] = {}  # seq in hand -> its calls not answered yet
        self.hi = 0  # one past the last seq taken

    def took(self, seqs: Iterable[int]) -> None:
        last = -1
        for last in seqs:
            self.open[last] = 1  # a bundle's count is set once it is decoded (count)
        if last >= 0:
            self.hi = last + 1
        self.publish()

    def count(self, seq: int, n: int) -> None:
        self.open[seq] = n
        self.publish()

    def answered(self, seq: int, k: int = 1) -> None:
        """``k`` calls of frame ``seq`` were answered (it is settled when all of its are);
        not published until :meth:`publish`."""
        left = self.open.get(seq, 0) - k
        if left > 0:
            self.open[seq] = left
        else:
            self.open.pop(seq, None)

    def settle(self, seq: int) -> None:
        """Frame ``seq`` is done with (answered whole, or dropped), published at once."""
        self.open.pop(seq, None)
        self.publish()

    def publish(self) -> None:
        if self.row is not None:
            o = self.open
            hold_range(self.row, min(o) if o else self.hi, self.hi, sum(o.values()))

    def clear(self) -> None:
        self.open.clear()
        self.publish()


class Lookout:
    """Finds, among work its caller keeps until answered, what a dead worker took with
    it: a *look* (:meth:`lost`) counts, for each item, how many looks in a row found
    it nowhere; an item found nowhere ``strikes`` looks in a row (``again`` after it
    was sent again) is lost.

    An item is *found* when its seq is at or past the group's position (still
    queued) or inside a live worker's held range whose lease has not run out.
    Looking twice covers the microseconds between a worker's take and its row's
    update; ``again`` (larger) keeps a call whose holder cannot be seen (a
    worker without a row) from being sent more than once a few looks.  The
    caller reads, in this order, the group's position, the held ranges, then its
    replies (a worker replies before it drops a call from its range, so a call
    answered in between is found answered), and calls :meth:`lost` last.

    Items have ``seq`` (-1: not in the ring yet), ``strikes``, ``attempt`` and
    ``done``.
    """

    def __init__(self, strikes: int = 2, again: int = 4) -> None:
        self.strikes = strikes
        self.again = again

    @staticmethod
    def finder(taken: int, held: list[tuple[int, int, int, int]], now_ns: int | None = None):
        """``found(seq)`` for this look: queued, or in a live worker's unexpired range."""
        now = time.time_ns() if now_ns is None else now_ns
        live = [(lo, hi) for lo, hi, since, lease in held
                if not (since and lease and now - since > lease)]

        def found(seq: int) -> bool:
            return seq >= taken or any(lo <= seq < hi for lo, hi in live)
        return found

    def lost(self, items: Iterable[Any], found) -> list[Any]:
        """The items lost with a dead worker, as of this look (``found``: :meth:`finder`)."""
        out = []
        for p in items:
            if p.done or p.seq < 0:
                continue
            if found(p.seq):
                p.strikes = 0
                continue
            p.strikes += 1
            if p.strikes >= (self.strikes if p.attempt == 1 else self.again):
                out.append(p)
        return out
