"""Pins: frames referenced by zero-copy views, kept from being overwritten.

A handle that pins frames owns one slot of the reader table (kind
``SLOT_PIN``) whose ``S_POS`` word is its oldest pinned position, and holds
that slot's liveness lock.  Writers that need room below a pin wait (or
raise ``Full``); the pins of a process that died are reclaimed by the first
writer they are in the way of (its liveness lock is gone).
"""

from __future__ import annotations

import os
import threading

from . import _format as F
from ._lock import ofd_lock, ofd_locked_by_other, ofd_unlock
from .errors import ShmqError

__all__ = ["Pins"]


class Pins:
    """This handle's pins (see the module docstring).

    ``held`` maps each pinned position to its number of views; empty when
    nothing is pinned.
    """

    def __init__(self, mapping, ring, slots, lock, on_release):
        self.path = mapping.path
        self._mapping = mapping
        self._ring = ring
        self._slots = slots
        self._lock = lock
        self._on_release = on_release  # wakes writers waiting for room
        self.slot = None  # this handle's pin slot, taken on the first pin
        self.held = {}
        # Guards ``held`` and the slot word computed from it: views are released by
        # finalizers, in whatever thread drops the last reference, while another
        # thread pins.  Reentrant: a finalizer may run inside pin() in this thread.
        self._held_lock = threading.RLock()

    def floor(self, limit):
        """Oldest pinned position of any handle (below ``limit``, if given), reclaiming
        dead holders' pins.

        Liveness (an fcntl lock per pin slot) is checked only for pins that
        are in the way, so the common case costs a scan of the table.
        """
        slots, words, floor = self._slots, self._slots.words, None
        for i in range(slots.hwm()):
            w = i * F.SLOT_WORDS
            if words[w + F.S_STATE] != F.SLOT_PIN:
                continue
            p = words[w + F.S_POS]
            if limit is not None:
                if p >= limit:
                    continue
                if i != self.slot and not ofd_locked_by_other(
                        self._mapping.fd, slots.byte(i, F.SLOT_LIVE_BYTE)):
                    words[w + F.S_STATE] = F.SLOT_FREE  # its process died: release its pins
                    continue
            if floor is None or p < floor:
                floor = p
        return floor

    def pin(self, pos, held=False) -> bool:
        """Pin the frame at ``pos`` against eviction; False if it is already gone.

        Done under the writer lock, so no writer can be between checking the
        pins and evicting (no store/load reordering window), unless ``held``:
        the caller's named cursor, published in a block/error ring, still holds
        the frame, and moves on only after this returns (a release store).
        Writers read the named cursors before the pins (the engine's
        make_room): one that sees the cursor moved sees this pin, so no lock
        is needed (the reader of a fast producer's frames would wait for each
        write's lock).

        :raises shmq.ShmqError: this handle's pin slot is locked by another process.
        """
        slots = self._slots
        if self.slot is None:
            name = f"pin.{os.getpid()}.{id(self):x}"
            i = slots.attach(name, F.SLOT_PIN, "latest")
            if not ofd_lock(self._mapping.fd, slots.byte(i, F.SLOT_LIVE_BYTE)):
                raise ShmqError(f"{self.path}: pin slot {name} is in use")
            slots.set_word(i, F.S_POS, F.NO_PIN)
            self.slot = i
        if held:
            self._hold(pos)
            return True
        with self._lock:
            if not self._ring.still_there(pos):
                return False
            self._hold(pos)
            return True

    def _hold(self, pos) -> None:
        with self._held_lock:
            self.held[pos] = self.held.get(pos, 0) + 1
            if pos < self._slots.word(self.slot, F.S_POS):
                self._slots.set_word(self.slot, F.S_POS, pos)

    def unpin(self, pos) -> None:
        """Drop one pin of ``pos`` and wake writers waiting for room (not under the writer
        lock: raising the floor only frees room).  Safe from any thread, and from a
        finalizer.  A no-op once the handle is closed."""
        with self._held_lock:
            if self._mapping.mm is None or self.slot is None:
                return
            left = self.held.get(pos, 0) - 1
            if left > 0:
                self.held[pos] = left
            else:
                self.held.pop(pos, None)
            self._slots.set_word(self.slot, F.S_POS, min(self.held, default=F.NO_PIN))
        self._on_release()

    def read(self, seq, pos, held=False):
        """Pin and map data frame ``seq`` at cursor ``pos``: ``(payload view, codec,
        header pos, next pos)``, or None if it is gone, a pad, or another frame.
        ``held``: the caller's published cursor holds the frame (see :meth:`pin`).

        Unless ``held``, the header is re-read under the pin, when it can no
        longer change; the caller unpins the header position when done with
        the view.
        """
        ring = self._ring
        hit = ring.frame_at(seq, pos)
        if hit is None:
            return None
        fpos = hit.pos
        if not self.pin(fpos, held):
            return None
        # Re-read under the pin, unless the cursor held the frame before it was
        # read: then nothing could overwrite it in between.
        if not held and ring.header_at(fpos) != hit:
            self.unpin(fpos)
            return None
        return ring.payload(hit), hit.codec, fpos, fpos + hit.stored

    def close(self) -> None:
        """Free the pin slot (views still alive keep their mapping, not their pins)."""
        with self._held_lock:
            if self.slot is not None:
                self._slots.set_word(self.slot, F.S_STATE, F.SLOT_FREE)
                ofd_unlock(self._mapping.fd, self._slots.byte(self.slot, F.SLOT_LIVE_BYTE))
                self.slot = None

    def forget_after_fork(self) -> None:
        """In a fork child: the parent's pins stay the parent's."""
        self.slot = None
        self.held = {}
        self._held_lock = threading.RLock()  # another thread may have held it at the fork
