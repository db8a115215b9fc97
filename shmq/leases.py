"""The work queue's lease region: lease records, the key index, and statistics over them.

Layout (docs/format.md, "Lease region"): ``W_WQ_LEASE_SLOTS`` lease records
of ``LEASE_WORDS`` u64 words (state, seq, position, due time, attempts,
token, holder, enqueue time), then ``W_WQ_KEY_SLOTS`` key-index entries of
``KEY_WORDS`` words (key hash, newest seq, its position), open addressing
by hash.  Every write happens under the work queue's lock; readers of the
statistics read without it (a snapshot).
"""

from __future__ import annotations

import dataclasses
import time

from . import _format as F
from ._format import KEY_WORDS, L_DUE_NS, L_ENQ_NS, L_STATE, LEASE_DELAYED, LEASE_LEASED, LEASE_RETRY, LEASE_WORDS
from .errors import ShmqError

__all__ = ["KeyIndex", "WorkQueueStats", "lease_stats"]

_NS = 1_000_000_000


class KeyIndex:
    """The key index of a lease region ``reg`` (u64 words): key hash -> newest message.

    ``n`` entries start at word ``base``; a hash of 0 means "no key".
    """

    def __init__(self, reg, base, n):
        self._reg, self._base, self._n = reg, base, n

    def point(self, seq0, placed, hashes, first_seq, path) -> None:
        """Point the entries of ``hashes`` at messages ``seq0 + k`` at ``placed[k]``
        (work-queue lock and writer lock held, before the commit).  An entry whose
        frame left the ring (below ``first_seq``) is reused.

        :raises shmq.ShmqError: the index is full (the batch is then not written).
        """
        reg, base, n = self._reg, self._base, self._n
        for k, h in enumerate(hashes):
            if not h:
                continue
            i = h % n
            reuse = None
            for _ in range(n):
                w = base + i * KEY_WORDS
                eh = reg[w]
                if eh == h:
                    reuse = w
                    break
                if eh == 0:
                    reuse = w if reuse is None else reuse
                    break
                if reuse is None and reg[w + 1] < first_seq:  # its frame left the ring: reusable
                    reuse = w
                i = (i + 1) % n
            if reuse is None:
                raise ShmqError(f"{path}: key index full ({n} live keys); create the work "
                                "queue with more keys=")
            reg[reuse + 2] = placed[k]
            reg[reuse + 1] = seq0 + k
            reg[reuse] = h  # published last

    def newest(self, h):
        """``(seq, pos)`` of the newest message indexed under key hash ``h``, or None.

        The entry may be torn or stale: check the frame's header before trusting it.
        """
        if not h:
            return None
        reg, base, n = self._reg, self._base, self._n
        i = h % n
        for _ in range(n):
            w = base + i * KEY_WORDS
            eh = reg[w]
            if eh == 0:
                return None
            if eh == h:
                return reg[w + 1], reg[w + 2]
            i = (i + 1) % n
        return None


@dataclasses.dataclass(frozen=True)
class WorkQueueStats:
    """Counts from the lease table and the control block (a snapshot)."""

    ready: int  # committed, not yet handed out (superseded ones included until skipped)
    in_flight: int  # leased
    delayed: int  # waiting for their not-before time (delay= or nack(delay=))
    dead: int  # in the dead-letter spool, not replayed or purged
    redeliveries: int
    acked: int
    superseded: int
    oldest_age_s: float  # age of the oldest message not yet acked (0: none)
    lease_slots: int
    lease_slots_used: int


def lease_stats(spool, reg, take_seq, dead) -> WorkQueueStats:
    """Statistics of the work queue on ``spool``: lease region ``reg``, take cursor at
    ``take_seq``, ``dead`` live dead letters.  Lock-free (a snapshot)."""
    ctl = spool.ring.ctl
    nleases = ctl[F.W_WQ_LEASE_SLOTS]
    counts = {LEASE_LEASED: 0, LEASE_DELAYED: 0, LEASE_RETRY: 0}
    oldest = None
    now_ns = time.time_ns()
    retry_due = 0
    for i in range(min(ctl[F.W_WQ_LEASE_HWM], nleases)):
        lw = i * LEASE_WORDS
        st = reg[lw + L_STATE]
        if st in counts:
            counts[st] += 1
            if st == LEASE_RETRY and reg[lw + L_DUE_NS] <= now_ns:
                retry_due += 1
            enq = reg[lw + L_ENQ_NS]
            oldest = enq if oldest is None else min(oldest, enq)
    ready = max(0, ctl[F.W_NEXT_SEQ] - take_seq)
    if ready:
        try:
            head = spool.read_at(take_seq)
            oldest = head.timestamp_ns if oldest is None else min(oldest, head.timestamp_ns)
        except ShmqError:
            pass
    return WorkQueueStats(
        ready=ready + retry_due, in_flight=counts[LEASE_LEASED],
        delayed=counts[LEASE_DELAYED] + counts[LEASE_RETRY] - retry_due, dead=dead,
        redeliveries=ctl[F.W_WQ_REDELIVERED], acked=ctl[F.W_WQ_ACKED],
        superseded=ctl[F.W_WQ_SUPERSEDED],
        oldest_age_s=0.0 if oldest is None else max(0.0, (now_ns - oldest) / _NS),
        lease_slots=nleases, lease_slots_used=sum(counts.values()))
