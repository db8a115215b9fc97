"""fsck for spools: :func:`verify` checks a spool, :func:`shmq.repair.repair` fixes what it
safely can.

:func:`verify` maps the file read-only and never writes: it checks the
geometry, the control words, the writer lock (a holder word naming a dead
process is a stale lock), every frame header from ``FIRST_POS``/``FIRST_SEQ``
to ``NEXT_POS``/``NEXT_SEQ`` (seq continuity, lengths within the ring,
padding rules, the CRC-32 of every payload whose frame has ``FLAG_CRC``),
and the reader/group table (state values, decodable unique names, cursors
within the ring and pointing at the frame they name, stale group locks).

:func:`shmq.repair.repair` breaks a lock held by a dead process (as the engine's own
lock recovery would: under the recovery region lock, bumping the fencing
token, then posting the semaphore), finishes a commit a dead writer left
half-done, and resets damaged reader slots to the earliest frame (or frees
slots that are not readers at all).  It never rewrites a frame: damaged
frames are reported and left for ``shmq export`` + recreate.

Checking a live spool is safe; a walk overtaken by writers that evict
frames is restarted a few times and then reported as a warning, never as a
problem.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import asdict, dataclass, field

from . import _core
from . import _format as F
from ._format import (
    FLAG_CRC, FLAG_EXT, FLAG_PAD, FLAG_SUPERSEDED, FRAME_BYTES, MAX_COUNTER, W_FIRST_POS,
    W_FIRST_SEQ, W_LOCK_HOLDER, W_LOCK_TOKEN, W_NEXT_POS, W_NEXT_SEQ,
)
from ._lock import holder_alive, holder_pid, ofd_locked_by_other
from ._mapping import SEM_WRITER, Mapping, resolve_path, sem_name
from .errors import NotASpool, SpoolFormatError
from .ring import header_at, raw_header_at

__all__ = ["Report", "verify"]

_KNOWN_FLAGS = FLAG_PAD | FLAG_SUPERSEDED | FLAG_CRC | FLAG_EXT
#: A walk overtaken by eviction this many times is abandoned (with a warning).
WALK_ATTEMPTS = 5
#: How long "writer semaphore taken, no holder recorded" must persist to be reported.
ORPHAN_LOCK_CHECK_S = 0.25


@dataclass
class Report:
    """What :func:`verify` (or :func:`repair`) found.

    ``problems`` are precise, one line each; ``ok`` is true when there are
    none.  ``warnings`` and ``notes`` never make a spool "not ok".
    ``repaired`` lists what :func:`repair` did.
    """

    path: str
    problems: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    repaired: list = field(default_factory=list)
    frames_checked: int = 0
    crc_verified: int = 0
    pads_checked: int = 0
    bytes_checked: int = 0
    readers_checked: int = 0
    first_seq: int | None = None
    next_seq: int | None = None
    capacity: int | None = None
    on_full: str | None = None
    lock_pid: int = 0
    lock_token: int = 0
    readers: list = field(default_factory=list)
    #: slot index -> "reset" (bad cursor) | "free" (not a reader) | "hwm" (beyond the scan bound)
    damaged_slots: dict = field(default_factory=dict)
    stale_writer_lock: bool = False
    stale_group_locks: list = field(default_factory=list)
    orphan_writer_lock: bool = False
    #: the control words need the engine's post-crash re-derivation (repair does it)
    control_fix: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["damaged_slots"] = {str(k): v for k, v in self.damaged_slots.items()}
        return d


def _open_geometry(view, rep):
    """Decode the geometry; foreign files raise, damaged spools become problems."""
    try:
        return F.unpack_geometry(view.head, view.size, view.path)
    except SpoolFormatError as exc:
        if isinstance(exc, NotASpool):
            raise  # a foreign file: not ours to judge (or to touch)
        rep.problems.append(f"geometry: {exc}".replace(f"{view.path}: ", ""))
        return None


def existing_semaphore(name):
    """Named semaphore ``name`` if it exists and we may open it, else None (creates nothing)."""
    try:
        return _core.Semaphore(name, existing=True)
    except OSError:  # missing, or not ours to open (read-only fsck by another user)
        return None


def first_cursor(v):
    """``(FIRST_SEQ, FIRST_POS)`` of mapping ``v`` as a consistent pair, the engine's
    (an evicting writer stores POS then SEQ: the header at POS names the frame); the
    words as they are when no consistent pair can be read (a damaged ring, reported
    by the walk)."""
    got = _core.first_cursor(v.mm, v.geo["ring_offset"], v.geo["ring_bytes"])
    return got if got is not None else (v.ctl[W_FIRST_SEQ], v.ctl[W_FIRST_POS])


def verify(path) -> Report:
    """Check a spool without modifying it; return a :class:`Report`.

    :raises FileNotFoundError: nothing at ``path``.
    :raises PermissionError: the file cannot be read.
    :raises shmq.SpoolFormatError: the file is not a spool at all (foreign
        magic, too small, not a regular file); a spool whose header is
        damaged is reported as a problem instead.
    :raises shmq.NotASpool: ``path`` is a symbolic link, FIFO, socket, device or directory.
    """
    path = resolve_path(path)
    rep = Report(path)
    with Mapping(path, write=False, geometry=False) as v:
        geo = _open_geometry(v, rep)
        if geo is None:
            return rep
        v.map(geo)
        rep.capacity, rep.on_full = geo["ring_bytes"], geo["policy"]
        control_ok = _check_control(v, rep)
        _check_writer_lock(v, rep)
        cursors = _check_table(v, rep, control_ok)
        if control_ok:
            _walk_ring(v, rep, cursors)
    return rep


# --- control words and locks ----------------------------------------------


def _check_control(v, rep) -> bool:
    ctl = v.ctl
    for attempt in range(3):
        # the engine's checks (what opening a spool refuses), read lock-free
        fseq, nseq = ctl[W_FIRST_SEQ], ctl[W_NEXT_SEQ]
        bad = _core.control_problems(v.mm, v.geo["ring_bytes"])
        if not bad:
            break
        time.sleep(0.01)  # a live writer between two stores: a damaged word stays damaged
    rep.first_seq, rep.next_seq = fseq, nseq
    hwm = ctl[F.W_SLOT_HWM]
    rep.problems.extend(bad)
    window = F.check_window(ctl, v.geo["ring_bytes"])
    rep.problems.extend(f"control words: {w}" for w in window)
    if ctl[F.W_SEGMENT] and not window:
        rep.notes.append(f"growable: ring offsets below {ctl[F.W_ALLOC]} may have pages, "
                         f"allocated in segments of {ctl[F.W_SEGMENT]} bytes; ceiling "
                         f"{v.geo['ring_bytes']} bytes")
    if hwm > v.geo["slot_count"]:
        rep.problems.append(f"control word SLOT_HWM = {hwm} exceeds the table's "
                            f"{v.geo['slot_count']} slots")
    return not bad


def _check_writer_lock(v, rep):
    ctl = v.ctl
    prefix = v.geo["sem_prefix"]
    sem = existing_semaphore(sem_name(prefix, SEM_WRITER))
    word = ctl[W_LOCK_HOLDER]
    rep.lock_pid, rep.lock_token = holder_pid(word), ctl[W_LOCK_TOKEN]
    try:
        if sem is None:
            rep.notes.append("writer semaphore is missing or not accessible (the next open "
                             "of the spool re-creates a missing one)")
        value = sem.value if sem is not None else None
        if word:
            if holder_alive(word):
                rep.notes.append(f"writer lock held by live pid {holder_pid(word)}")
            elif ctl[W_LOCK_HOLDER] == word:  # still the same (dead) holder
                rep.stale_writer_lock = True
                rep.problems.append(
                    f"writer lock: held by pid {holder_pid(word)}, which is dead (stale lock; "
                    f"writers stall until it is broken; token {ctl[W_LOCK_TOKEN]})")
        elif value == 0:
            # Held with no holder recorded: normal for nanoseconds (between
            # sem_wait and recording the holder); a problem if it persists.
            deadline = time.monotonic() + ORPHAN_LOCK_CHECK_S
            while time.monotonic() < deadline:
                if ctl[W_LOCK_HOLDER] or sem.value:
                    break
                time.sleep(0.02)
            else:
                rep.orphan_writer_lock = True
                rep.problems.append("writer lock: taken but no holder recorded for "
                                    f"{ORPHAN_LOCK_CHECK_S} s (a writer died between taking it "
                                    "and recording itself)")
        if value is not None and value > 1:
            rep.problems.append(f"writer lock: semaphore value is {value} (> 1): writers are "
                                "not mutually excluded")
        if not word and ctl[W_FIRST_SEQ] == ctl[W_NEXT_SEQ]:
            fpos, npos = ctl[W_FIRST_POS], ctl[W_NEXT_POS]
            if fpos != npos and fpos < MAX_COUNTER and not ctl[W_LOCK_HOLDER]:
                rep.control_fix = True
                rep.problems.append(f"control words: the ring is empty but FIRST_POS {fpos} != "
                                    f"NEXT_POS {npos}")
    finally:
        if sem is not None:
            sem.close()


# --- reader table ---------------------------------------------------------


def _check_table(v, rep, control_ok):
    """Check every slot; return ``{seq: [(slot, name, pos)]}`` of cursors for the walk."""
    ctl, slots = v.ctl, v.slots
    n = v.geo["slot_count"]
    hwm = min(ctl[F.W_SLOT_HWM], n)
    nseq, npos = ctl[W_NEXT_SEQ], ctl[W_NEXT_POS]
    fseq, fpos = first_cursor(v) if control_ok else (ctl[W_FIRST_SEQ], ctl[W_FIRST_POS])
    seen = {}
    cursors = {}
    for i in range(n):
        w = i * F.SLOT_WORDS
        state = slots[w + F.S_STATE]
        if state == F.SLOT_FREE:
            continue
        rep.readers_checked += 1
        if state not in (F.SLOT_READER, F.SLOT_GROUP):
            rep.problems.append(f"reader table: slot {i} has invalid state {state}")
            rep.damaged_slots[i] = "free"
            continue
        kind = "group" if state == F.SLOT_GROUP else "reader"
        name = v.slot_name(i)
        if name is None:
            rep.problems.append(f"reader table: slot {i} ({kind}) has an undecodable name")
            rep.damaged_slots[i] = "free"
            continue
        if name in seen:
            rep.problems.append(f"reader table: {kind} {name!r} appears in slots {seen[name]} "
                                f"and {i}")
            rep.damaged_slots[i] = "free"
            continue
        seen[name] = i
        label = f"{kind} {name!r} (slot {i})"
        if i >= hwm:
            rep.problems.append(f"reader table: {label} lies beyond the scan bound SLOT_HWM "
                                f"{hwm}: writers ignore it")
            rep.damaged_slots[i] = "hwm"
        seq, pos = slots[w + F.S_SEQ], slots[w + F.S_POS]
        alive = ofd_locked_by_other(v.fd, v.slot_byte(i, F.SLOT_LIVE_BYTE))
        rep.readers.append({"slot": i, "name": name, "kind": kind, "position": seq,
                            "byte_position": pos, "pid": slots[w + F.S_PID], "alive": alive})
        if kind == "group":
            hw = slots[w + F.S_LOCK_HOLDER]
            if hw and not holder_alive(hw) and slots[w + F.S_LOCK_HOLDER] == hw:
                rep.stale_group_locks.append(i)
                rep.problems.append(f"reader table: {label}: group lock held by pid "
                                    f"{holder_pid(hw)}, which is dead (stale lock)")
        if not control_ok:
            continue
        nseq, npos = ctl[W_NEXT_SEQ], ctl[W_NEXT_POS]  # fresh: the cursor was read first
        if seq > nseq or pos > npos or seq >= MAX_COUNTER or pos >= MAX_COUNTER:
            rep.problems.append(f"reader table: {label}: cursor (seq {seq}, position {pos}) is "
                                f"beyond the ring's end (next seq {nseq}, position {npos})")
            rep.damaged_slots[i] = "reset"
        elif seq < fseq:
            behind = fseq - seq
            if pos > fpos and fseq != nseq:
                rep.warnings.append(f"{label}: cursor position {pos} is ahead of its seq {seq} "
                                    "(a reader stopped between its two stores; it self-heals)")
            msg = (f"{label} is {behind} frame(s) behind the oldest frame {fseq}; it will "
                   "count them as lost")
            (rep.notes if v.geo["policy"] == "overwrite" else rep.warnings).append(msg)
        elif pos < fpos and seq == fseq:
            pass  # in the padding the writer evicted before the oldest frame: harmless
        elif pos < fpos:
            rep.problems.append(f"reader table: {label}: cursor position {pos} lies before the "
                                f"oldest frame (position {fpos}) but its seq {seq} does not")
            rep.damaged_slots[i] = "reset"
        else:
            cursors.setdefault(seq, []).append((i, label, pos))
    return cursors


# --- the ring ---------------------------------------------------------------


class _Overtaken(Exception):
    pass


def _walk_ring(v, rep, cursors):
    ctl = v.ctl
    for _attempt in range(WALK_ATTEMPTS):
        # The writer stores NEXT_SEQ (the commit) then NEXT_POS: the pair read
        # here may be mid-update, so NEXT_POS is only compared at the end.
        nseq = ctl[W_NEXT_SEQ]
        npos = ctl[W_NEXT_POS]
        fseq, fpos = first_cursor(v)
        local = Report(rep.path)
        try:
            _walk(v, local, cursors, fseq, fpos, nseq, npos)
        except _Overtaken:
            continue
        if local.problems and ctl[W_FIRST_POS] != fpos:
            continue  # the damage may be eviction racing the walk: look again
        rep.problems.extend(local.problems)
        rep.warnings.extend(local.warnings)
        for k in ("frames_checked", "crc_verified", "pads_checked", "bytes_checked"):
            setattr(rep, k, getattr(local, k))
        rep.damaged_slots.update(local.damaged_slots)
        rep.control_fix = rep.control_fix or local.control_fix
        rep.first_seq, rep.next_seq = fseq, nseq
        return
    rep.warnings.append(f"the ring was overwritten faster than it could be checked "
                        f"({WALK_ATTEMPTS} attempts); stop the writers for a full check")


def _walk(v, rep, cursors, fseq, fpos, nseq, npos):
    ctl, mm, ring, base = v.ctl, v.mm, v.geo["ring_bytes"], v.geo["ring_offset"]
    seq, pos = fseq, fpos
    gap_start = pos
    wanted = {p for entries in cursors.values() for _i, _l, p in entries}
    at = {}  # cursor position -> seq of the frame that starts (or whose gap starts) there
    suspects = []

    def check_cursors(s, lo, hi):
        for i, label, p in cursors.get(s, ()):
            if not lo <= p <= hi:
                suspects.append((i, label, s, p, lo, hi))

    limit = fpos + ring
    while seq < nseq:
        if pos >= limit:
            rep.problems.append(f"ring: frames {seq}..{nseq - 1} are missing: the walk went "
                                "round the whole ring")
            return
        # Unchecked (raw_header_at): a header whose lengths point outside the
        # ring is reported with those lengths, not just found unreadable.
        hit = raw_header_at(mm, base, ring, pos)
        sane = header_at(mm, base, ring, pos) is not None
        if hit.pos != pos:
            pos = hit.pos  # short tail: skipped without a header (then the checks above again)
            continue
        hseq, stored, length, crc, flags, codec = (hit.seq, hit.stored, hit.length, hit.crc,
                                                   hit.flags, hit.codec)
        off = pos % ring
        if ctl[W_FIRST_POS] > pos:
            raise _Overtaken
        where = f"ring offset {off}, position {pos}"
        if not sane:
            rep.problems.append(
                f"ring: frame {seq} ({where}): header lengths out of bounds (stored {stored}, "
                f"length {length}, {ring - off} bytes to the ring's end); frames {seq}.."
                f"{nseq - 1} cannot be reached")
            return
        if flags & FLAG_PAD:
            if off + stored != ring:
                rep.problems.append(f"ring: padding before frame {seq} ({where}) ends at offset "
                                    f"{off + stored}, not at the ring's end {ring}")
            if hseq != seq:
                rep.problems.append(f"ring: padding before frame {seq} ({where}) says seq {hseq}")
            if length:
                rep.problems.append(f"ring: padding before frame {seq} ({where}) has length "
                                    f"{length} (must be 0)")
            rep.pads_checked += 1
            pos += stored
            continue
        if hseq != seq:
            rep.problems.append(f"ring: expected frame {seq} at {where}, the header says seq "
                                f"{hseq}; frames {seq}..{nseq - 1} cannot be reached")
            return
        if flags & ~_KNOWN_FLAGS:
            rep.problems.append(f"ring: frame {seq} ({where}) has unknown flag bits "
                                f"0x{flags & ~_KNOWN_FLAGS:x}")
        if codec not in F.CODEC_NAMES:
            rep.warnings.append(f"frame {seq} has codec tag {codec}, unknown to this shmq")
        for p in (gap_start, pos):
            if p in wanted:
                at[p] = seq
        check_cursors(seq, gap_start, pos)
        if flags & FLAG_CRC:
            o = base + off + FRAME_BYTES
            actual = zlib.crc32(mm[o:o + length])
            if ctl[W_FIRST_POS] > pos:
                raise _Overtaken
            if actual != crc:
                rep.problems.append(f"ring: frame {seq} ({where}, {length} bytes): CRC mismatch "
                                    f"(header 0x{crc:08x}, payload 0x{actual:08x}): its payload "
                                    "is damaged")
            else:
                rep.crc_verified += 1
        rep.frames_checked += 1
        rep.bytes_checked += stored
        seq += 1
        pos += stored
        gap_start = pos
    if nseq > fseq and pos != npos:
        npos = _settled_next_pos(ctl, nseq, pos)
        if npos is not None and pos > npos:
            rep.control_fix = True
            rep.problems.append(f"ring: the frames up to {nseq - 1} end at position {pos}, past "
                                f"NEXT_POS {npos} (a writer died between committing and storing "
                                "NEXT_POS)")
        elif npos is not None:
            rep.control_fix = True
            rep.problems.append(f"ring: the last frame ends at position {pos}, NEXT_POS is "
                                f"{npos}")
        else:
            npos = pos  # a writer committed meanwhile: our snapshot is simply older
    check_cursors(nseq, min(gap_start, npos), npos)
    for i, label, s, p, lo, hi in suspects:
        if s < at.get(p, -1) < nseq:
            rep.warnings.append(f"{label}: cursor position {p} is that of frame {at[p]}, ahead of "
                                f"its seq {s} (a reader stopped between its two stores; it "
                                "self-heals)")
        else:
            rep.problems.append(f"reader table: {label}: cursor position {p} does not point at "
                                f"frame {s} (expected a position in {lo}..{hi})")
            rep.damaged_slots[i] = "reset"


def _settled_next_pos(ctl, nseq, end):
    """NEXT_POS if it stays different from ``end`` while NEXT_SEQ stays ``nseq`` and no live
    writer holds the lock (one stores NEXT_POS right after NEXT_SEQ, lock held); else None."""
    for _ in range(5):
        word = ctl[W_LOCK_HOLDER]
        if ctl[W_NEXT_SEQ] != nseq or ctl[W_NEXT_POS] == end or word and holder_alive(word):
            return None
        time.sleep(0.002)
    npos = ctl[W_NEXT_POS]
    return None if ctl[W_NEXT_SEQ] != nseq or npos == end else npos
