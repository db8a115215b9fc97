"""The reader table: named readers', groups' and pin holders' slots in a spool.

A slot is ``SLOT_BYTES`` of the file (see :mod:`shmq._format`): a state
word (free, reader, group, pin), a committed cursor (``S_POS`` then
``S_SEQ``), counters, a group lock's holder words and a NUL-terminated name.
Liveness is an fcntl OFD lock on the slot's first byte, held by the
attached handle: the kernel drops it when the process dies, so "attached"
needs no heartbeat.  Creating and removing slots take a table lock (another
OFD lock); reading the table is lock-free (the state word is published
last).
"""

from __future__ import annotations

import time

from . import _format as F
from ._lock import ofd_lock, ofd_locked_by_other, ofd_unlock
from .errors import ReaderBusy, ShmqError

__all__ = ["SlotTable"]

_NO_LOW_WATER = (1 << 64) - 1
_KIND_NAMES = {F.SLOT_READER: "a named reader", F.SLOT_GROUP: "a group", F.SLOT_PIN: "a pin slot"}


def _mean(total, count):
    return total // count if count else 0


class SlotTable:
    """The reader table of one open spool handle.

    ``words`` is the table as u64 words: slot ``i``'s word ``k`` (an
    ``_format.S_*`` index) is ``words[i * SLOT_WORDS + k]``.  This handle's
    attachments (liveness locks) are reference-counted here, so several
    group members in one handle share one lock.
    """

    def __init__(self, mapping, ring):
        geo = mapping.geo
        self.path = mapping.path
        self._mapping = mapping
        self._ring = ring
        self.words = mapping.slots
        self.count = geo["slot_count"]
        self.offset = geo["slot_offset"]
        self._refs = {}  # slot -> attachments of this handle

    # -- reading ----------------------------------------------------------

    def hwm(self) -> int:
        """Slots in use are below this index (clamped: a corrupt word must not index past
        the table)."""
        return min(self._ring.ctl[F.W_SLOT_HWM], self.count)

    def word(self, i, k) -> int:
        """Word ``k`` (``_format.S_*``) of slot ``i``."""
        return self.words[i * F.SLOT_WORDS + k]

    def set_word(self, i, k, value) -> None:
        """Store word ``k`` of slot ``i`` (one aligned 8-byte store)."""
        self.words[i * F.SLOT_WORDS + k] = value

    def cursor(self, i):
        """Slot ``i``'s committed cursor ``(seq, pos)``."""
        w = i * F.SLOT_WORDS
        return self.words[w + F.S_SEQ], self.words[w + F.S_POS]

    def set_cursor(self, i, seq, pos) -> None:
        """Store slot ``i``'s cursor: position first, then seq (a crash between the two is
        repaired on the next read).  Serialize with the slot's owner (group lock)."""
        w = i * F.SLOT_WORDS
        self.words[w + F.S_POS] = pos
        self.words[w + F.S_SEQ] = seq

    def name(self, i):
        """Name stored in slot ``i`` (None if unreadable)."""
        return self._mapping.slot_name(i)

    def byte(self, i, which) -> int:
        """File offset of byte ``which`` (``SLOT_LIVE_BYTE``, ``SLOT_RECOVERY_BYTE``) of slot ``i``:
        what its fcntl locks cover."""
        return self._mapping.slot_byte(i, which)

    def find(self, name):
        """Index of the slot named ``name`` (any kind), or None."""
        words = self.words
        for i in range(self.hwm()):
            if words[i * F.SLOT_WORDS + F.S_STATE] != F.SLOT_FREE and self.name(i) == name:
                return i
        return None

    def floor(self, k):
        """Minimum of word ``k`` (S_POS or S_SEQ) over named readers and groups; None if none."""
        words = self.words
        floor = None
        for i in range(self.hwm()):
            w = i * F.SLOT_WORDS
            if F.SLOT_FREE < words[w + F.S_STATE] < F.SLOT_PIN:
                v = words[w + k]
                if floor is None or v < floor:
                    floor = v
        return floor

    def alive(self, i) -> bool:
        """True if slot ``i`` is attached by this handle or by a live process."""
        if self._refs.get(i):
            return True
        return ofd_locked_by_other(self._mapping.fd, self.byte(i, F.SLOT_LIVE_BYTE))

    # -- creating and removing -----------------------------------------------

    def attach(self, name, kind, start) -> int:
        """Find or create the slot for ``name`` of ``kind``; return its index.

        A new slot starts at ``start`` ("earliest", "latest" or a seq).  The
        table lock is held for the lookup and the creation only.

        :raises TypeError: ``name`` is not a str.
        :raises ValueError: an empty, too long or NUL-containing name.
        :raises shmq.ShmqError: the name is a slot of another kind, or the table is full.
        """
        if not isinstance(name, str):
            raise TypeError(f"reader name must be a str, not {type(name).__name__}")
        raw = name.encode("utf-8")
        if not raw or len(raw) > F.NAME_MAX_BYTES or "\x00" in name:
            raise ValueError(f"reader name must be 1..{F.NAME_MAX_BYTES} UTF-8 bytes without NUL: {name!r}")
        fd = self._mapping.fd
        ofd_lock(fd, F.TABLE_LOCK_BYTE, wait=True)
        try:
            i = self.find(name)
            if i is not None:
                have = self.words[i * F.SLOT_WORDS + F.S_STATE]
                if have != kind:
                    raise ShmqError(f"{name!r} is {_KIND_NAMES.get(have, 'in use')} in {self.path}, "
                                    f"not {_KIND_NAMES[kind]}")
                return i
            seq, pos = self._ring.cursor_for(start)
            words = self.words
            for i in range(self.count):
                w = i * F.SLOT_WORDS
                if words[w + F.S_STATE] == F.SLOT_FREE:
                    break
            else:
                raise ShmqError(f"{self.path}: reader table is full ({self.count} "
                                "slots); remove unused readers or create the spool with more")
            for k in range(1, F.NAME_OFFSET // 8):
                words[w + k] = 0
            off = self.offset + i * F.SLOT_BYTES + F.NAME_OFFSET
            packed = F.pack_name(name)
            self._mapping.mm[off:off + F.NAME_MAX_BYTES + 1] = packed.ljust(F.NAME_MAX_BYTES + 1, b"\0")
            words[w + F.S_POS] = pos
            words[w + F.S_SEQ] = seq
            words[w + F.S_LAG_LOW] = _NO_LOW_WATER
            words[w + F.S_CREATED_NS] = time.time_ns()
            words[w + F.S_STATE] = kind  # published last: the slot is complete
            ctl = self._ring.ctl
            if i + 1 > ctl[F.W_SLOT_HWM]:
                ctl[F.W_SLOT_HWM] = i + 1
            return i
        finally:
            ofd_unlock(fd, F.TABLE_LOCK_BYTE)

    def remove(self, name) -> None:
        """Free the slot named ``name`` (table lock held).

        :raises KeyError: no such slot.
        :raises shmq.ReaderBusy: it is attached by a live process (or this handle).
        """
        fd = self._mapping.fd
        ofd_lock(fd, F.TABLE_LOCK_BYTE, wait=True)
        try:
            i = self.find(name)
            if i is None:
                raise KeyError(f"no reader or group named {name!r} in {self.path}")
            if self.alive(i):
                raise ReaderBusy(f"reader {name!r} is attached (pid {self.word(i, F.S_PID)}); "
                                 "close it first")
            self.set_word(i, F.S_STATE, F.SLOT_FREE)
            self._mapping.mm[self.offset + i * F.SLOT_BYTES + F.NAME_OFFSET] = 0
        finally:
            ofd_unlock(fd, F.TABLE_LOCK_BYTE)

    # -- this handle's attachments ---------------------------------------------

    def hold(self, i, exclusive) -> bool:
        """Mark slot ``i`` attached by this handle (its liveness lock); False if another
        process holds it (exclusively, or at all when ``exclusive``).

        Reference-counted: OFD locks are per open file description, so one
        lock serves every attachment of this handle.
        """
        if not self._refs.get(i):
            if not ofd_lock(self._mapping.fd, self.byte(i, F.SLOT_LIVE_BYTE), exclusive=exclusive):
                return False
        self._refs[i] = self._refs.get(i, 0) + 1
        return True

    def holds(self, i) -> int:
        """How many attachments of this handle hold slot ``i``."""
        return self._refs.get(i, 0)

    def let_go(self, i) -> None:
        """Drop one attachment of slot ``i``; the last one releases the liveness lock."""
        if not self._refs.get(i):
            return
        self._refs[i] -= 1
        if not self._refs[i]:
            del self._refs[i]
            if self._mapping.mm is not None:
                ofd_unlock(self._mapping.fd, self.byte(i, F.SLOT_LIVE_BYTE))

    def relock(self, i) -> bool:
        """After fork: take slot ``i``'s liveness lock (shared) for this process's new file
        description, keeping the reference counts; False if another process holds it
        exclusively."""
        return ofd_lock(self._mapping.fd, self.byte(i, F.SLOT_LIVE_BYTE), exclusive=False)

    def forget(self, i) -> None:
        """Drop this handle's attachments of slot ``i`` without unlocking (after fork: the
        lock belonged to the parent's file description)."""
        self._refs.pop(i, None)

    # -- statistics ----------------------------------------------------------

    def stats(self) -> list:
        """:class:`shmq.ReaderStats` of every named reader and group (pins excluded)."""
        from .stats import ReaderStats  # (on first use: dataclasses is a fifth of ``import shmq``)

        ctl, words = self._ring.ctl, self.words
        nxt, next_pos = ctl[F.W_NEXT_SEQ], ctl[F.W_NEXT_POS]
        out = []
        for i in range(self.hwm()):
            w = i * F.SLOT_WORDS
            state = words[w + F.S_STATE]
            if state == F.SLOT_FREE or state == F.SLOT_PIN:
                continue
            name = self.name(i)
            if name is None:
                continue
            seq, pos, gets = words[w + F.S_SEQ], words[w + F.S_POS], words[w + F.S_GETS]
            low = words[w + F.S_LAG_LOW]
            out.append(ReaderStats(
                name=name, kind="group" if state == F.SLOT_GROUP else "reader",
                position=seq, lag=max(0, nxt - seq), lag_bytes=max(0, next_pos - pos),
                lost=words[w + F.S_LOST], gets=gets, get_bytes=words[w + F.S_GET_BYTES],
                last_get_ns=words[w + F.S_LAST_GET_NS],
                avg_delay_ns=_mean(words[w + F.S_DELAY_SUM_NS], words[w + F.S_DELAY_COUNT]),
                max_delay_ns=words[w + F.S_DELAY_MAX_NS], high_water=words[w + F.S_LAG_HIGH],
                low_water=0 if low == _NO_LOW_WATER else low, pid=words[w + F.S_PID],
                alive=self.alive(i), slot=i))
        return out
