"""On-disk format of a spool file: layouts, constants and pure (de)serializers.

Everything here is a pure function of bytes; no I/O happens in this module.
The same layout is described in prose in ``docs/format.md``; keep both in
step.  All integers are little-endian; shared counters are aligned 8-byte
words, published with single stores through a ``'Q'`` memoryview (see
``docs/format.md`` "Commit point": ``struct.pack_into`` is not atomic).

File layout::

    [0, 4096)                      header page: immutable geometry (128 B),
                                   control words, rate series, lock bytes
    [SLOT_OFFSET, +slots*256)      named reader / group table
    [lease_offset, +leases*64)     lease table (reserved for the work queue)
    [ring_offset, +ring_bytes)     the data ring (4 KiB aligned)
"""

from __future__ import annotations

import hashlib
import re
import struct
import zlib

from .errors import NotASpool, SpoolFormatError

MAGIC = b"SHMQSPL\x00"
#: The format this shmq reads and writes.  Version 3 moved the oldest-frame
#: words (FIRST_SEQ, FIRST_POS) off the cache line the writer stores to on every
#: put, so that a reader's per-frame overwrite check stops missing its cache;
#: fixed and growable rings (W_SEGMENT != 0) are both version 3.  Versions 1
#: (fixed) and 2 (growable) keep those words at 18/19: refused, with the way out.
FORMAT_VERSION = 3
#: The versions an older shmq wrote; migrate them with ``shmq export`` / ``import``.
OLD_FORMAT_VERSIONS = (1, 2)

# --- limits and texts (the compiled core's layout.h repeats them: check_core) --

#: Positions, seqs and counters never get near 2**62 (centuries at memory
#: bandwidth): a value is valid iff it is *below* MAX_COUNTER (compare with
#: ``>=`` to reject).  A larger one comes from a corrupt or hostile file, and
#: arithmetic on it (a position plus a frame, a seq plus a batch) could wrap.
MAX_COUNTER = 1 << 62
#: What to do about a damaged ring (fsck --repair never rewrites frames, so it
#: cannot fix one): the end of every "the ring is corrupt" error.
RING_ADVICE = ("see 'shmq fsck'; to keep what is readable: 'shmq export --skip-corrupt', "
               "'shmq rm', 'shmq import'")

# --- header page ----------------------------------------------------------

HEADER_BYTES = 4096
#: Immutable geometry at the start of the header page (bytes 0..128).
GEOMETRY = struct.Struct("<8sIIQQQQIIQIIBBHI16sQ20sI")
assert GEOMETRY.size == 128
GEOMETRY_CRC_SPAN = 124  # CRC covers bytes [0, 124); the CRC sits at 124

# Control words: u64 indexes into the header page viewed as 'Q'.
W_NEXT_SEQ = 16  # commit point: frames with seq < NEXT_SEQ are readable
W_NEXT_POS = 17  # byte position where the next frame goes (writer-private)
# 18, 19: reserved (FIRST_SEQ / FIRST_POS in versions 1 and 2)
W_ALLOC_MIN = 20  # growable rings: the writer wraps early (reuses its pages) only past this offset
W_ALLOC = 21  # growable rings: ring offsets at or above it have no pages (0 on fixed spools)
W_LOCK_HOLDER = 22  # writer lock holder: pid | start time low bits << 32 (_lock.py)
W_LOCK_TOKEN = 24  # fencing token, bumped whenever a dead holder's lock is broken
W_PUT_BYTES = 26  # (puts need no counter: every put takes the next seq)
W_LAST_PUT_NS = 27
W_EVICTED = 28  # frames pushed out of the ring to make room
W_HIGH_FRAMES = 29  # most frames resident, recorded before evicting
W_HIGH_BYTES = 30  # most ring bytes in use, recorded before evicting
W_SLOT_HWM = 31  # 1 + highest slot index ever used (bounds table scans)
W_LOCK_BREAKS = 32  # how many times a dead writer's lock was recovered
W_QUEUE_MAXSIZE = 33  # shmq.Queue's maxsize in items (0: unbounded), set at creation
W_SEGMENT = 34  # growable spools: bytes allocated / released at a time (0: fixed, all allocated)
W_GROWTHS = 35  # segments allocated since creation (a growable spool's statistics)
W_HOLE_LO = 36  # growable rings: [HOLE_LO, HOLE_HI) below W_ALLOC may lack pages (Spool.trim)
W_HOLE_HI = 37
W_DATA_BELL = 38  # doorbell futex words (low 32 bits), bumped on every ring: blocked
W_SPACE_BELL = 39  # readers / writers sleep on them (shmq/_notify.py)
# 40..47: their own cache line, stored to only when the writer evicts, so the
# check every reader makes after copying a frame hits its cache (see FORMAT_VERSION)
W_FIRST_SEQ = 40  # oldest frame still in the ring
W_FIRST_POS = 41  # its byte position (stored before FIRST_SEQ)
# 42..47 reserved
# 48..63: shmq.WorkQueue (see the work queue section below)
W_WQ_LEASE_SLOTS = 48  # lease records at the start of the lease region (0: not a work queue)
W_WQ_KEY_SLOTS = 49  # key-index entries after them
W_WQ_TOKEN = 50  # last fencing token granted
W_WQ_MAX_ATTEMPTS = 51  # default attempts before dead-lettering
W_WQ_LEASE_HWM = 52  # 1 + highest lease record index in use (bounds scans)
W_WQ_REDELIVERED = 53
W_WQ_ACKED = 54
W_WQ_SUPERSEDED = 55
W_WQ_DEAD = 56  # messages moved to the dead-letter spool
W_RATE = 64  # per-second series: RATE_SECONDS x (second, puts, gets)
RATE_SECONDS = 60
RATE_WORDS = 3
CTL_WORDS = HEADER_BYTES // 8

DOORBELL_BYTE = 4000  # pwrite target: mmap stores raise no inotify event
RECOVERY_LOCK_BYTE = 4064  # fcntl region lock: one process recovers the writer lock
TABLE_LOCK_BYTE = 4065  # fcntl region lock: reader table allocation
REPLAY_LOCK_BYTE = 4066  # fcntl region lock: one replayer of a dead-letter spool
#: fcntl OFD region lock held *shared* by every open handle while it has the file
#: mapped (taken at open, dropped by the kernel when the last descriptor of the
#: handle's open file description closes, at the latest when its process dies).
#: An exclusive non-blocking attempt that succeeds proves that no handle exists
#: anywhere: how an anonymous queue's orphan check costs one fcntl (shmq.anonymous).
HANDLE_LOCK_BYTE = 4067

# --- reader / group table ------------------------------------------------

SLOT_OFFSET = HEADER_BYTES
SLOT_BYTES = 256
SLOT_WORDS = SLOT_BYTES // 8
DEFAULT_SLOTS = 64
MAX_SLOTS = 4096
NAME_OFFSET = 192  # name bytes within a slot
NAME_MAX_BYTES = SLOT_BYTES - NAME_OFFSET - 1

SLOT_FREE, SLOT_READER, SLOT_GROUP, SLOT_PIN = 0, 1, 2, 3
#: S_POS of a pin slot that pins nothing (a pin slot holds one handle's
#: zero-copy views: S_POS is the oldest frame position they reference).  Not a
#: valid position (MAX_COUNTER), so it is above every frame and never in the way.
NO_PIN = MAX_COUNTER
S_STATE = 0
S_SEQ = 1  # committed cursor (stored after S_POS)
S_POS = 2
S_PID = 3  # last attaching process
S_LOST = 5
S_GETS = 6
S_GET_BYTES = 7
S_LAST_GET_NS = 8
S_DELAY_SUM_NS = 9
S_DELAY_MAX_NS = 10
S_LAG_HIGH = 11
S_LAG_LOW = 12
S_LOCK_HOLDER = 13  # group lock holder (same encoding as W_LOCK_HOLDER)
S_LOCK_TOKEN = 15
S_CREATED_NS = 16
S_DELAY_COUNT = 18  # gets whose delay was measured: the divisor of S_DELAY_SUM_NS (sampled)
# liveness lock on the slot's first byte, group-lock recovery on its second
SLOT_LIVE_BYTE = 0
SLOT_RECOVERY_BYTE = 1

# --- lease table (reserved for the work queue) ---------------------------

LEASE_BYTES = 64
DEFAULT_LEASES = 1024

# --- frames --------------------------------------------------------------

#: seq, stored_len, length, timestamp_ns, crc32, flags, codec, ext_words
FRAME = struct.Struct("<QIIQIHBB")
FRAME_BYTES = FRAME.size
assert FRAME_BYTES == 32
ALIGN = 8
MAX_FRAME_PAYLOAD = 0xFFFFFFFF - FRAME_BYTES - ALIGN

#: Byte offset of the u16 flags field within a frame header (FRAME's sixth field).
FRAME_FLAGS_OFFSET = 28
assert FRAME_FLAGS_OFFSET == struct.calcsize(FRAME.format[:6])
FLAG_PAD = 0x1  # filler to the ring's end; seq is that of the frame after it
FLAG_SUPERSEDED = 0x2  # reserved for the work queue (dedup by key)
FLAG_CRC = 0x4  # crc32 field is valid
FLAG_EXT = 0x8  # reserved: extension header (key hash, not-before, attempts)

CODEC_RAW = 0
CODEC_PICKLE = 1
CODEC_JSON = 2
CODEC_NUMPY = 3
CODEC_ARROW = 4
CODEC_UTF8 = 5
CODEC_PICKLE_OOB = 6  # pickle protocol 5 with out-of-band buffers (see pack_oob_header)
CODEC_WORKQ = 7  # a work queue message: WQ_HEADER, then pickle (body, headers, key)
CODEC_NAMES = {
    CODEC_RAW: "raw",
    CODEC_PICKLE: "pickle",
    CODEC_JSON: "json",
    CODEC_NUMPY: "numpy",
    CODEC_ARROW: "arrow",
    CODEC_UTF8: "utf8",
    CODEC_PICKLE_OOB: "pickle-oob",
    CODEC_WORKQ: "workqueue",
}

POLICIES = ("overwrite", "block", "error")

MIN_RING_BYTES = 4096
PAGE = 4096

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}


def parse_size(value) -> int:
    """Return a byte count from an int or a string such as ``"64MiB"``.

    Binary units (KiB, MiB, GiB, TiB, and bare K/M/G/T) and decimal units
    (KB, MB, GB, TB) are accepted, case-insensitively.

    :raises TypeError: not an int or str.
    :raises ValueError: unparsable or not positive.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"capacity must be an int or a string like '64MiB', not {type(value).__name__}")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ValueError(f"cannot parse size {value!r}: use e.g. 65536, '64KiB', '64MiB', '1GiB'")
        size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def frame_stored_bytes(length: int) -> int:
    """Bytes a frame of ``length`` payload bytes occupies in the ring."""
    return FRAME_BYTES + align(length)


def ring_geometry(capacity: int, slots: int, leases: int):
    """Return ``(slot_offset, lease_offset, ring_offset, ring_bytes, file_bytes)``."""
    ring_bytes = max(align(capacity, PAGE), MIN_RING_BYTES)
    lease_offset = SLOT_OFFSET + slots * SLOT_BYTES
    ring_offset = align(lease_offset + leases * LEASE_BYTES, PAGE)
    return SLOT_OFFSET, lease_offset, ring_offset, ring_bytes, ring_offset + ring_bytes


def pack_geometry(*, file_bytes, ring_offset, ring_bytes, slot_offset, slot_count,
                  lease_offset, lease_count, policy, checksum, sem_prefix, created_ns,
                  flags=0) -> bytes:
    body = GEOMETRY.pack(
        MAGIC, FORMAT_VERSION, HEADER_BYTES, file_bytes, ring_offset, ring_bytes,
        slot_offset, slot_count, SLOT_BYTES, lease_offset, lease_count, LEASE_BYTES,
        POLICIES.index(policy), int(bool(checksum)), 0, flags,
        sem_prefix.encode("ascii"), created_ns, b"", 0,
    )
    crc = zlib.crc32(body[:GEOMETRY_CRC_SPAN])
    return body[:GEOMETRY_CRC_SPAN] + struct.pack("<I", crc)


#: Geometry ``flags`` bit: the spool is fed from the network (``shmq sub``): its payloads
#: came from another host, so nothing in it is unpickled unless the caller opts in.
GEO_FLAG_NETWORK = 0x1
#: Geometry ``flags`` bit: the spool was created by a shmq whose handles hold
#: :data:`HANDLE_LOCK_BYTE` while open, so an exclusive attempt on it tells whether any
#: handle exists.  Without it (a file an older shmq created) the lock proves nothing.
GEO_FLAG_HANDLE_LOCKS = 0x2


def with_geometry_flags(raw: bytes, flags: int) -> bytes:
    """The geometry block ``raw`` with ``flags`` OR-ed into its flags field, CRC renewed."""
    fields = list(GEOMETRY.unpack_from(raw))
    fields[15] |= flags  # magic, version, ..., policy, checksum, reserved, flags
    body = GEOMETRY.pack(*fields)
    return body[:GEOMETRY_CRC_SPAN] + struct.pack("<I", zlib.crc32(body[:GEOMETRY_CRC_SPAN]))


def handles_lock(geo: dict) -> bool:
    """True if every handle of the spool with this decoded geometry holds
    :data:`HANDLE_LOCK_BYTE` (it was created by a shmq that takes it)."""
    return bool(geo.get("flags", 0) & GEO_FLAG_HANDLE_LOCKS)


def from_network(geo: dict) -> bool:
    """True if the spool with this decoded geometry is fed from the network (untrusted)."""
    return bool(geo.get("flags", 0) & GEO_FLAG_NETWORK)


def unpack_geometry(raw: bytes, file_size: int, where: str) -> dict:
    """Validate and decode the geometry block of a spool file.

    Every offset is checked against ``file_size`` so a corrupt header can
    never make later code read outside the mapping.

    :raises SpoolFormatError: with a message saying what is wrong and what to do.
    """
    if len(raw) < GEOMETRY.size or file_size < HEADER_BYTES:
        if raw[:len(MAGIC)] == MAGIC[:len(raw)] and raw:
            raise SpoolFormatError(
                f"{where}: truncated spool ({file_size} bytes, header alone needs {HEADER_BYTES}); "
                "it cannot be repaired: remove it ('shmq rm', or Spool.destroy) and create it again")
        raise NotASpool(f"{where}: not a shmq spool (file too small: {file_size} bytes)")
    (magic, version, header_bytes, file_bytes, ring_offset, ring_bytes, slot_offset, slot_count,
     slot_bytes, lease_offset, lease_count, lease_bytes, policy, checksum, _r0, flags,
     sem_prefix, created_ns, _r1, crc) = GEOMETRY.unpack_from(raw)
    if magic != MAGIC:
        raise NotASpool(
            f"{where}: not a shmq spool (bad magic {magic!r}); refusing to touch a foreign file")
    if version > FORMAT_VERSION:
        raise SpoolFormatError(
            f"{where}: spool format version {version} is newer than this shmq supports "
            f"({FORMAT_VERSION}); upgrade shmq, or export with the newer version and import here")
    if version in OLD_FORMAT_VERSIONS:
        raise SpoolFormatError(
            f"{where}: spool format version {version} was written by an older shmq; this one reads "
            f"version {FORMAT_VERSION} only (the control words moved): drain it with the older shmq, or "
            "'shmq export' it there and 'shmq import' the dump into a spool created by this one")
    if version != FORMAT_VERSION:
        raise SpoolFormatError(f"{where}: invalid spool format version {version}")
    if zlib.crc32(raw[:GEOMETRY_CRC_SPAN]) != crc:
        raise SpoolFormatError(
            f"{where}: spool header is corrupt (checksum mismatch); it cannot be repaired: "
            "remove it ('shmq rm') and create it again")
    problems = []
    if header_bytes != HEADER_BYTES:
        problems.append(f"header size {header_bytes}")
    if slot_bytes != SLOT_BYTES or lease_bytes != LEASE_BYTES:
        problems.append("slot/lease record size")
    if slot_offset != SLOT_OFFSET or not (0 < slot_count <= MAX_SLOTS):
        problems.append(f"reader table ({slot_count} slots at {slot_offset})")
    if lease_offset != slot_offset + slot_count * slot_bytes:
        problems.append(f"lease table offset {lease_offset}")
    if ring_offset < lease_offset + lease_count * lease_bytes or ring_offset % PAGE:
        problems.append(f"ring offset {ring_offset}")
    if ring_bytes < MIN_RING_BYTES or ring_bytes % PAGE:
        problems.append(f"ring size {ring_bytes}")
    if file_bytes != ring_offset + ring_bytes:
        problems.append(f"file size field {file_bytes}")
    if policy >= len(POLICIES):
        problems.append(f"on_full policy code {policy}")
    try:
        prefix = sem_prefix.rstrip(b"\x00").decode("ascii")
    except UnicodeDecodeError:
        prefix = ""
    if not re.fullmatch(r"[0-9a-f]{12}", prefix):
        problems.append("semaphore name")
    if problems:
        raise SpoolFormatError(f"{where}: spool header is inconsistent ({', '.join(problems)}); "
                               "recreate the spool")
    if file_size < file_bytes:
        raise SpoolFormatError(
            f"{where}: truncated spool: the file has {file_size} bytes, its header says "
            f"{file_bytes}; remove it ('shmq rm', or Spool.destroy) and create it again")
    return {
        "version": version, "file_bytes": file_bytes, "ring_offset": ring_offset,
        "ring_bytes": ring_bytes, "slot_offset": slot_offset, "slot_count": slot_count,
        "lease_offset": lease_offset, "lease_count": lease_count,
        "policy": POLICIES[policy], "checksum": bool(checksum), "flags": flags,
        "sem_prefix": prefix, "created_ns": created_ns,
    }


MIN_SEGMENT = 64 << 10
MAX_SEGMENT = 4 << 20


def growth_plan(start: int, ceiling: int):
    """``(segment, allocated)`` for a growable ring of ``ceiling`` bytes that starts with
    ``start`` bytes allocated: whole segments, between 64 KiB and 4 MiB each, about the
    start size (so a small queue stays small and a big one does few syscalls)."""
    seg = min(max(align(start, PAGE), MIN_SEGMENT), MAX_SEGMENT, align(ceiling, PAGE))
    return seg, min(-(-start // seg) * seg, ceiling)


def check_window(ctl, ring_bytes: int) -> list:
    """Problems with a growable ring's allocation words (empty if fine or fixed)."""
    seg, low, top = ctl[W_SEGMENT], ctl[W_ALLOC_MIN], ctl[W_ALLOC]
    if not seg:
        return [] if not low and not top else [f"allocation words {low}, {top} on a fixed spool"]
    if seg % PAGE or seg > ring_bytes:
        return [f"segment size {seg} (ring {ring_bytes})"]
    problems = []
    if top > ring_bytes or top % seg and top != ring_bytes:
        problems.append(f"allocated zone top {top} is not whole segments of {seg} bytes within "
                        f"the ring")
    elif low > ring_bytes:
        problems.append(f"early-wrap threshold {low} is past the ring's end")
    elif ctl[W_NEXT_SEQ] > ctl[W_FIRST_SEQ] and ctl[W_NEXT_POS] % ring_bytes > top:
        problems.append(f"the write position (ring offset {ctl[W_NEXT_POS] % ring_bytes}) is "
                        f"past the allocated zone's top {top}")
    return problems


def frame_crc(data) -> int:
    return zlib.crc32(data)


def valid_frame_header(stored: int, length: int, offset: int, ring_bytes: int) -> bool:
    """True when a decoded frame header's lengths keep it inside the ring."""
    return (stored >= FRAME_BYTES + length and stored % ALIGN == 0
            and offset + stored <= ring_bytes)


def or_frame_flags(buf, offset: int, flags: int) -> None:
    """OR ``flags`` into the flags field of the frame header at ``offset`` in ``buf``
    (one 2-byte store; the rest of the header is untouched)."""
    o = offset + FRAME_FLAGS_OFFSET
    buf[o:o + 2] = (int.from_bytes(buf[o:o + 2], "little") | flags).to_bytes(2, "little")


def pack_name(name: str) -> bytes:
    raw = name.encode("utf-8")
    return bytes([len(raw)]) + raw


def unpack_name(raw: bytes) -> str | None:
    n = raw[0]
    if n == 0 or n > NAME_MAX_BYTES:
        return None
    try:
        return raw[1:1 + n].decode("utf-8")
    except UnicodeDecodeError:
        return None


# struct flock for fcntl(F_OFD_SETLK): short type, short whence, off_t start,
# off_t len, pid_t pid (must be 0 for OFD locks), padded to 32 bytes on LP64.
FLOCK = struct.Struct("hhqqi4x")


def pack_flock(kind: int, start: int, length: int = 1) -> bytes:
    return FLOCK.pack(kind, 0, start, length, 0)


def unpack_flock(raw: bytes):
    """Return ``(type, start, length, pid)``."""
    kind, _whence, start, length, pid = FLOCK.unpack(raw)
    return kind, start, length, pid


# --- pickle with out-of-band buffers (shmq.Queue) -------------------------
#
# payload = u32 nbuf, u32 reserved, u64 pickle_len, u64 buffer_len[nbuf],
#           pickle bytes, zero pad to 8, then each buffer, zero padded to 8.
# Buffers start 8-byte aligned (payloads themselves start 8-byte aligned in
# the ring), so numpy arrays rebuilt over them are aligned.

_OOB_HEAD = struct.Struct("<IIQ")


def pack_oob_header(pickle_len: int, buffer_lens) -> bytes:
    n = len(buffer_lens)
    return _OOB_HEAD.pack(n, 0, pickle_len) + struct.pack(f"<{n}Q", *buffer_lens)


def oob_padding(n: int) -> bytes:
    return bytes(align(n) - n)


def unpack_oob(view):
    """Return ``(pickle_view, [buffer views])`` from an out-of-band payload.

    :raises ValueError: lengths that do not fit the payload (corruption).
    """
    if len(view) < _OOB_HEAD.size:
        raise ValueError("out-of-band payload too short")
    n, _r, pickle_len = _OOB_HEAD.unpack_from(view)
    off = _OOB_HEAD.size + 8 * n
    if off > len(view):
        raise ValueError("out-of-band payload: bad buffer count")
    lens = struct.unpack_from(f"<{n}Q", view, _OOB_HEAD.size)
    end = off + pickle_len
    if end > len(view):
        raise ValueError("out-of-band payload: bad pickle length")
    pickled = view[off:end]
    off = align(end)
    buffers = []
    for length in lens:
        if off + length > len(view):
            raise ValueError("out-of-band payload: bad buffer length")
        buffers.append(view[off:off + length])
        off = align(off + length)
    return pickled, buffers


# --- work queue ------------------------------------------------------------
#
# The lease region holds W_WQ_LEASE_SLOTS lease records of 8 words, then
# W_WQ_KEY_SLOTS key-index entries of 3 words (key hash, seq, position),
# open addressing with linear probing; hash 0 marks an empty entry.

L_STATE, L_SEQ, L_POS, L_TOKEN, L_HOLDER, L_DUE_NS, L_ATTEMPTS, L_ENQ_NS = range(8)
LEASE_WORDS = 8
LEASE_FREE, LEASE_LEASED, LEASE_DELAYED, LEASE_RETRY = 0, 1, 2, 3
KEY_WORDS = 3

#: key_hash, not_before_ns, max_attempts (0: queue default), flags
WQ_HEADER = struct.Struct("<QQII")
WQ_HAS_KEY = 0x1


def wq_region_records(lease_slots: int, key_slots: int) -> int:
    """Lease-region size in 64-byte records for a work queue's leases and key index."""
    return lease_slots + (key_slots * KEY_WORDS * 8 + LEASE_BYTES - 1) // LEASE_BYTES


def key_hash(key) -> int:
    """Stable 64-bit hash of a str/bytes key (never 0: 0 marks an empty entry)."""
    raw = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    h = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
    return h or 1


# --- the compiled core's copy of this spec ----------------------------------

#: What the compiled core (shmq/core/layout.h) exports besides its ``LAYOUT``
#: table of word offsets, under the same names as here.
CORE_CONSTANTS = ("MAX_COUNTER", "NO_PIN", "RING_ADVICE")


def core_mismatches(core) -> dict:
    """``{name: (core's value, this module's value)}`` for every constant the compiled
    core ``core`` (``shmq._core``, passed in: this module stays pure) states differently
    from this spec: its ``LAYOUT`` table and :data:`CORE_CONSTANTS`.  A name missing on
    either side is a mismatch (its value shows as ``None``)."""
    spec = globals()
    theirs = dict(core.LAYOUT)
    theirs.update((name, getattr(core, name, None)) for name in CORE_CONSTANTS)
    return {name: (value, spec.get(name)) for name, value in theirs.items()
            if value is None or spec.get(name) != value}


def check_core(core) -> None:
    """Refuse a compiled core that disagrees with this spec (run when shmq is imported).

    :raises ImportError: naming every constant that differs, with both values.
    """
    bad = core_mismatches(core)
    if bad:
        detail = "; ".join(f"{name}: core {c!r}, _format {f!r}" for name, (c, f) in sorted(bad.items()))
        raise ImportError(f"shmq._core does not match shmq._format (a core built from another "
                          f"shmq version? reinstall shmq): {detail}")
