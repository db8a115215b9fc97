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
from ._format import (
    KEY_WORDS, L_ATTEMPTS, L_DUE_NS, L_ENQ_NS, L_HOLDER, L_POS, L_SEQ, L_STATE, L_TOKEN,
    LEASE_DELAYED, LEASE_FREE, LEASE_LEASED, LEASE_RETRY, LEASE_WORDS,
)
from ._lock import holder_alive
from .errors import LeaseLost, ShmqError

__all__ = ["LeaseTable", "KeyIndex", "WorkQueueStats", "lease_stats"]

_NS = 1_000_000_000


class LeaseTable:
    """The lease records of lease region ``reg`` (u64 words), ``n`` of them; ``ctl`` is the
    control block (``W_WQ_LEASE_HWM``, ``W_WQ_TOKEN``).

    Every method that writes is called with the work queue's lock held.  A
    record's ``L_ATTEMPTS`` word holds the attempts allowed (high 32 bits)
    and made (low 32 bits).
    """

    def __init__(self, reg, ctl, n):
        self._reg, self._ctl, self.n = reg, ctl, n

    def word(self, i, k):
        """Word ``k`` (``L_*``) of record ``i``."""
        return self._reg[i * LEASE_WORDS + k]

    def set_word(self, i, k, value) -> None:
        self._reg[i * LEASE_WORDS + k] = value

    def in_use(self):
        """Indices of the records that may be in use (below the high-water mark)."""
        return range(min(self._ctl[F.W_WQ_LEASE_HWM], self.n))

    def due(self, now_ns, check_live, take_seq):
        """Records due again at ``now_ns`` (retry or delay elapsed, lease expired, or
        with ``check_live`` a dead holder) as ``[(seq, i)]`` oldest first, the
        earliest due time among the others (None: none), and whether a record holds
        a message at or after ``take_seq`` (the take cursor: a taker died between
        granting it and moving the cursor, see ``WorkQueue._recover``)."""
        reg = self._reg
        due, next_due_ns, ahead = [], None, False
        for i in self.in_use():
            w = i * LEASE_WORDS
            state = reg[w + L_STATE]
            if state == LEASE_FREE:
                continue
            if reg[w + L_SEQ] >= take_seq:
                ahead = True
            t = reg[w + L_DUE_NS]
            if state == LEASE_LEASED:
                if t > now_ns and not (check_live and not holder_alive(reg[w + L_HOLDER])):
                    next_due_ns = t if next_due_ns is None else min(next_due_ns, t)
                    continue
            elif t > now_ns:
                next_due_ns = t if next_due_ns is None else min(next_due_ns, t)
                continue
            due.append((reg[w + L_SEQ], i))
        return sorted(due), next_due_ns, ahead

    def take_free(self):
        """Index of a free record (raising the high-water mark to cover it), or None."""
        reg, ctl = self._reg, self._ctl
        for i in range(self.n):
            if reg[i * LEASE_WORDS + L_STATE] == LEASE_FREE:
                if i + 1 > ctl[F.W_WQ_LEASE_HWM]:
                    ctl[F.W_WQ_LEASE_HWM] = i + 1
                return i
        return None

    def fill(self, i, seq, pos, enq_ns, max_attempts) -> None:
        """Describe message ``seq`` at ``pos`` in free record ``i`` (its state is set by
        :meth:`delay` or :meth:`grant`, which publish it)."""
        w, reg = i * LEASE_WORDS, self._reg
        reg[w + L_SEQ] = seq
        reg[w + L_POS] = pos
        reg[w + L_ENQ_NS] = enq_ns
        reg[w + L_ATTEMPTS] = max_attempts << 32

    def delay(self, i, due_ns, state=LEASE_DELAYED) -> None:
        """Make record ``i`` due at ``due_ns`` in ``state`` (delayed, or retrying after a nack)."""
        w = i * LEASE_WORDS
        self._reg[w + L_DUE_NS] = due_ns
        self._reg[w + L_STATE] = state

    def grant(self, i, now_ns, lease, holder):
        """Lease record ``i`` to ``holder`` (a holder word) for ``lease`` seconds under a new
        fencing token; return ``(i, seq, attempt, enqueued_ns, token, deadline_ns)``."""
        reg, ctl, lw = self._reg, self._ctl, i * LEASE_WORDS
        token = ctl[F.W_WQ_TOKEN] + 1
        ctl[F.W_WQ_TOKEN] = token
        attempts = reg[lw + L_ATTEMPTS]
        attempt = (attempts & 0xFFFFFFFF) + 1
        reg[lw + L_ATTEMPTS] = (attempts & ~0xFFFFFFFF) | attempt
        reg[lw + L_TOKEN] = token
        reg[lw + L_HOLDER] = holder
        deadline = now_ns + int(lease * _NS)
        reg[lw + L_DUE_NS] = deadline
        reg[lw + L_STATE] = LEASE_LEASED
        return (i, reg[lw + L_SEQ], attempt, reg[lw + L_ENQ_NS], token, deadline)

    def out_of_attempts(self, i) -> bool:
        """True when record ``i`` has made all the attempts it is allowed."""
        attempts = self._reg[i * LEASE_WORDS + L_ATTEMPTS]
        return (attempts & 0xFFFFFFFF) >= attempts >> 32

    def owned(self, i, token, msg_id=None) -> None:
        """Check that record ``i`` is leased under ``token`` (and holds ``msg_id``).

        :raises shmq.LeaseLost: it is not (settled, or re-granted after expiring).
        """
        reg, lw = self._reg, i * LEASE_WORDS
        if (reg[lw + L_STATE] != LEASE_LEASED or reg[lw + L_TOKEN] != token
                or (msg_id is not None and reg[lw + L_SEQ] != msg_id)):
            what = f"message {msg_id}" if msg_id is not None else f"lease slot {i}"
            raise LeaseLost(f"{what}: lease token {token} is stale (the lease expired "
                            "and was re-granted, or the message was already settled)")

    def free(self, i) -> None:
        self._reg[i * LEASE_WORDS + L_STATE] = LEASE_FREE

    def oldest(self, seq, pos):
        """The oldest ``(seq, pos)`` among ``(seq, pos)`` and the records in use."""
        reg = self._reg
        for i in self.in_use():
            lw = i * LEASE_WORDS
            if reg[lw + L_STATE] != LEASE_FREE and reg[lw + L_SEQ] < seq:
                seq, pos = reg[lw + L_SEQ], reg[lw + L_POS]
        return seq, pos

    def at_or_after(self, seq):
        """``(seq, pos)`` of the records in use for messages ``seq`` or later."""
        reg = self._reg
        out = []
        for i in self.in_use():
            lw = i * LEASE_WORDS
            if reg[lw + L_STATE] != LEASE_FREE and reg[lw + L_SEQ] >= seq:
                out.append((reg[lw + L_SEQ], reg[lw + L_POS]))
        return out


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
