"""Ring I/O: frame headers, cursors and lock-free reads over a spool's data ring.

A *cursor* is a pair ``(seq, pos)``: ``pos`` is a byte position that only
grows (the ring offset is ``pos % size``) and ``seq`` the frame expected
there.  A *header hit* is the :class:`HeaderHit` :meth:`Ring.header_at` returns,
``(seq, pos, stored, length, ts, crc, flags, codec)``: a decoded frame header
whose lengths are known to keep it inside the ring.  Read its fields by name.

Everything here is safe to call without the writer lock: reads either see a
committed frame or report that it is gone (the seqlock check against
``FIRST_POS``), and never read outside the mapping, whatever the bytes say.
Decoding a header, the oldest frame, the control-word checks and the
repair after a writer died are the engine's (shmq/engine/inspect.c, through
:mod:`shmq._core`), written once for the engine, fsck (:mod:`shmq.verify`)
and repair; so are the hot reads.
"""

from __future__ import annotations

import time
from collections import namedtuple

from . import _core
from . import _format as F
from ._format import FLAG_PAD, FRAME_BYTES, W_FIRST_POS, W_FIRST_SEQ, W_NEXT_POS, W_NEXT_SEQ
from ._lazy import TYPE_CHECKING, logger
from .errors import FrameLost, SpoolFormatError

__all__ = ["Ring", "HeaderHit", "header_at", "raw_header_at"]

_decode = _core.header_at
_frame_at = _core.frame_at


if TYPE_CHECKING:
    from typing import NamedTuple

    class HeaderHit(NamedTuple):
        """A frame header decoded at a ring position (see the module docstring)."""

        seq: int  #: the frame's seq (a pad's: the seq of the frame after it)
        pos: int  #: byte position of the header (past the short-tail skip)
        stored: int  #: bytes the frame takes in the ring: header, payload, alignment padding
        length: int  #: payload bytes
        ts: int  #: put time, ns since the epoch
        crc: int  #: CRC-32 of the payload (valid when ``flags & FLAG_CRC``)
        flags: int  #: ``_format.FLAG_*``
        codec: int  #: ``_format.CODEC_*``
else:  # the same tuple, without importing typing at run time
    HeaderHit = namedtuple("HeaderHit", "seq pos stored length ts crc flags codec", module=__name__)
    HeaderHit.__doc__ = "A frame header decoded at a ring position (see the module docstring)."


# A hit is built per frame on the export and columnar paths: tuple.__new__
# skips the Python-level HeaderHit.__new__ (its per-field arguments), so a hit
# costs what the plain tuple it replaced did.
_hit = tuple.__new__


def raw_header_at(buf, base, size, pos) -> HeaderHit:
    """The header at/after ring position ``pos`` of the ring of ``size`` bytes at offset
    ``base`` of ``buf``, *unchecked*: its lengths may point outside the ring.

    Only for reporting bad headers (fsck); everything else uses :func:`header_at`.
    Follows the short-tail skip (``hit.pos`` is then past it); never reads outside the ring.
    """
    return _hit(HeaderHit, _decode(buf, base, size, pos, False))


def header_at(buf, base, size, pos) -> HeaderHit | None:
    """The header hit at/after ring position ``pos`` of the ring of ``size`` bytes at
    offset ``base`` of ``buf``, or None if its lengths are out of bounds.

    Follows the short-tail skip; never reads outside the ring.  The engine's one
    decoder of frame headers (``eng_header_at``), which its own reads check the same
    way: :class:`Ring`, fsck and the tools use it.
    """
    t = _decode(buf, base, size, pos)
    return None if t is None else _hit(HeaderHit, t)


class Ring:
    """The data ring of one open spool handle (see the module docstring).

    Attributes: ``size`` (ring bytes), ``base`` (file offset of the ring),
    ``ctl`` (the control block as u64 words, indexed by ``_format.W_*``;
    shared counters are published with one aligned 8-byte store), ``mm`` and
    ``view`` (the whole mapping).
    """

    def __init__(self, mapping, core, lock, recovery_timeout):
        geo = mapping.geo
        self.path = mapping.path
        self.mm = mapping.mm
        self.view = mapping.view
        self.ctl = mapping.ctl
        self.size = geo["ring_bytes"]
        self.base = geo["ring_offset"]
        self.core = core
        self._lock = lock
        self._recovery_timeout = recovery_timeout
        self.locate_hint = None  # (seq, pos) of the last frame located: where the next walk starts

    # -- control words ------------------------------------------------------

    @property
    def first_seq(self) -> int:
        """Seq of the oldest frame still in the ring."""
        return self.ctl[W_FIRST_SEQ]

    @property
    def next_seq(self) -> int:
        """Seq the next committed frame will get (every frame below it is readable)."""
        return self.ctl[W_NEXT_SEQ]

    @property
    def first_pos(self) -> int:
        """Byte position of the oldest frame; a frame below it may be overwritten."""
        return self.ctl[W_FIRST_POS]

    @property
    def next_pos(self) -> int:
        """Byte position right after the last committed frame."""
        return self.ctl[W_NEXT_POS]

    def still_there(self, pos) -> bool:
        """True while the bytes at ``pos`` cannot have been overwritten.

        Writers advance ``FIRST_POS`` before they overwrite anything, so a
        copy taken from ``pos`` is intact iff this holds *after* the copy.
        """
        return self.ctl[W_FIRST_POS] <= pos

    # -- headers ------------------------------------------------------------

    def header_at(self, pos) -> HeaderHit | None:
        """The :class:`HeaderHit` at/after ``pos``, or None if its lengths are out of bounds.

        Follows the short-tail skip (fewer than a header's bytes before the
        ring's end).  Never reads outside the ring; the hit says nothing
        about whether the frame is still there (see :meth:`still_there`).
        """
        return header_at(self.mm, self.base, self.size, pos)

    def frame_pos(self, pos) -> int:
        """Header position of the frame at cursor position ``pos`` (past any pad)."""
        for _ in range(3):
            hit = self.header_at(pos)
            if hit is None or not hit.flags & FLAG_PAD:
                return pos if hit is None else hit.pos
            pos = hit.pos + hit.stored
        return pos

    def frame_at(self, seq, pos) -> HeaderHit | None:
        """The header hit of data frame ``seq`` at cursor ``pos`` (past up to three pads);
        None if the header there is invalid, a fourth pad, or another frame's."""
        # One engine call for the walk (_core.frame_at): the per-frame paths
        # (pinned reads, export, columnar runs) decode each header once, in C.
        t = _frame_at(self.mm, self.base, self.size, seq, pos)
        return None if t is None else _hit(HeaderHit, t)

    def payload(self, hit):
        """A memoryview of the payload of header hit ``hit`` (no copy: valid while the frame is)."""
        o = self.base + hit.pos % self.size + FRAME_BYTES
        return self.view[o:o + hit.length]

    def set_flags(self, hit, flags) -> None:
        """OR ``flags`` into the header of ``hit`` (e.g. FLAG_SUPERSEDED: a tombstone).

        Only flags readers treat as advisory may be set after the commit;
        the caller holds the lock that serializes such writers.
        """
        F.or_frame_flags(self.mm, self.base + hit.pos % self.size, flags)

    def repair_after_writer_death(self, dead_pid) -> None:
        """Repair the control words after breaking a dead writer's lock (lock held).

        The engine's re-derivation (``eng_repair_control``, what a C writer's
        recovery runs too): FIRST_SEQ re-read from the header at FIRST_POS,
        NEXT_POS from the headers up to NEXT_SEQ, walking the ring once
        (O(frames resident), recovery only).  An unreadable ring is dropped
        whole (readers count the frames lost).
        """
        logger().warning("shmq: recovered the writer lock of %s from dead pid %s (token now %s)",
                         self.path, dead_pid, self.ctl[F.W_LOCK_TOKEN])
        done = self.core.repair_after_writer_death()
        if "unreadable" in done:
            logger().error("shmq: %s: %s", self.path, done)

    # -- cursors ------------------------------------------------------------

    def first_cursor(self):
        """A consistent ``(seq, pos)`` of the oldest frame, read lock-free (in the core)."""
        return self.core.first_cursor()

    def latest_cursor(self):
        """``(NEXT_SEQ, NEXT_POS)`` as a consistent pair (takes the writer lock briefly,
        recovering it from a dead holder)."""
        while True:
            cur = self.core.latest(self._recovery_timeout)
            if cur is not None:
                return cur
            self._lock.recover_if_dead()

    def locate(self, seq) -> int:
        """Header position of frame ``seq`` (the core walks from the oldest frame or the hint).

        :raises shmq.FrameLost: ``seq`` is overwritten, not written yet, or the
            ring moved under the walk.
        """
        ctl = self.ctl
        if seq >= ctl[W_NEXT_SEQ]:
            raise FrameLost(f"seq {seq} has not been written yet (next is {ctl[W_NEXT_SEQ]})")
        hint = self.locate_hint or (F.MAX_COUNTER, 0)  # no hint: a seq no frame has
        pos = self.core.locate(seq, hint[0], hint[1])
        if pos == -1:
            raise FrameLost(f"seq {seq} was overwritten (oldest is {ctl[W_FIRST_SEQ]})")
        if pos == -2:
            raise FrameLost(f"seq {seq} could not be located while the ring was being rewritten")
        self.locate_hint = (seq, pos)
        return pos

    def cursor_for(self, start):
        """The cursor for ``start``: "earliest", "latest" or a seq (the next frame to read).

        :raises ValueError: not one of those, negative, or beyond the next seq.
        :raises shmq.FrameLost: that seq was already overwritten.
        """
        if start == "earliest":
            return self.first_cursor()
        if start == "latest":
            return self.latest_cursor()
        if isinstance(start, bool) or not isinstance(start, int):
            raise ValueError(f"start must be 'earliest', 'latest' or a seq, not {start!r}")
        if start < 0:
            raise ValueError(f"seq must be non-negative, not {start}")
        nxt = self.ctl[W_NEXT_SEQ]
        if start >= nxt:
            if start > nxt:
                raise ValueError(f"seq {start} is beyond the next seq {nxt}")
            return self.latest_cursor()
        return start, self.locate(start)

    def check_cursor(self, name, seq, pos) -> None:
        """Refuse a stored cursor no reader could have left (beyond the ring's end).

        :raises shmq.SpoolFormatError: it is, with what to do about it.
        """
        ctl = self.ctl
        if seq > ctl[W_NEXT_SEQ] or pos > ctl[W_NEXT_POS] + self.size:
            raise SpoolFormatError(
                f"{self.path}: the stored cursor of {name!r} (seq {seq}, position {pos}) is "
                f"beyond the ring's end; reset it with 'shmq readers seek' or fsck --repair")

    def read(self, seq, pos, verify=False):
        """Read the frame at cursor ``(seq, pos)``; return ``(frame, seq', pos', lost, codec)``.

        ``frame`` is None when the cursor caught up (after counting a loss).
        Lock-free, seqlock style (in the core): a frame overwritten during
        the copy is counted in ``lost``, never returned torn.
        """
        return self.core.read(seq, pos, verify)

    def read_at(self, seq, verify=False):
        """Frame ``seq`` (a ``shmq.Frame``), without a lock and without moving any cursor.

        :raises shmq.FrameLost: ``seq`` was overwritten or is not written yet.
        """
        pos = self.locate(seq)
        frame, _s, _p, lost, _c = self.core.read(seq, pos, verify)
        if frame is None or lost or frame[0] != seq:
            raise FrameLost(f"seq {seq} was overwritten while being read")
        return frame

    def check_control(self) -> None:
        """Refuse control words no writer could have left (bit rot, foreign writes).

        Read lock-free while writers may be running (the engine's checks,
        ``eng_control_problems``, which fsck reports too); a suspicious reading
        is re-read a few times before it is believed, so a live spool is never
        called corrupt.

        :raises shmq.SpoolFormatError: the control block is corrupt.
        """
        for attempt in range(5):
            problems = _core.control_problems(self.mm, self.size)
            if not problems:
                return
            time.sleep(0.001 * attempt)  # a writer between two stores
        raise SpoolFormatError(f"{self.path}: control block is corrupt ({problems[0]}); "
                               "it cannot be repaired: remove it ('shmq rm') and create it again")
