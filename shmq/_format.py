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

import re
import struct
import zlib

from .errors import NotASpool, SpoolFormatError

# The layout itself is written once, in shmq/engine/shmq_layout.h; shmq/_layout.py is
# generated from it at build time (setup.py) and re-exported here: word offsets
# (W_*, S_*, L_*), sizes, flags (FLAG_*), codec tags (CODEC_*), limits
# (MAX_COUNTER, NO_PIN), RING_ADVICE, and the struct formats of the geometry
# block, the frame header and a work queue message's header.
from ._layout import *  # noqa: F401,F403
from ._layout import (
    CODEC_ARROW, CODEC_JSON, CODEC_NUMPY, CODEC_PICKLE, CODEC_PICKLE_OOB, CODEC_RAW, CODEC_UTF8, CODEC_VALUES, CODEC_WORKQ,
    FRAME_FORMAT, GEOMETRY_FORMAT, MAGIC_STRING, POLICY_BLOCK, POLICY_ERROR, POLICY_OVERWRITE,
    WQ_HEADER_FORMAT,
)

MAGIC = MAGIC_STRING.encode("ascii") + b"\x00"
#: The versions an older shmq wrote (FORMAT_VERSION is this one's), refused with the way
#: out (migrate them with ``shmq export`` / ``import``).  Version 4 stamps lock and lease
#: holders with their start time since boot (version 3 and older: since the epoch, which
#: moves when the wall clock is stepped), so a process of either would take the other's
#: live holders for dead.  Version 3 moved the oldest-frame words (FIRST_SEQ, FIRST_POS)
#: off the cache line the writer stores to on every put; versions 1 (fixed) and 2
#: (growable) keep them at 18/19.
OLD_FORMAT_VERSIONS = (1, 2, 3)

#: Immutable geometry at the start of the header page (bytes 0..128).
GEOMETRY = struct.Struct(GEOMETRY_FORMAT)
#: seq, stored_len, length, timestamp_ns, crc32, flags, codec, ext_words
FRAME = struct.Struct(FRAME_FORMAT)

#: The codec tags' names (``shmq dump``, fsck), each tag from the layout.
CODEC_NAMES = {
    CODEC_RAW: "raw",
    CODEC_PICKLE: "pickle",
    CODEC_JSON: "json",
    CODEC_NUMPY: "numpy",
    CODEC_ARROW: "arrow",
    CODEC_UTF8: "utf8",
    CODEC_PICKLE_OOB: "pickle-oob",
    CODEC_WORKQ: "workqueue",
    CODEC_VALUES: "values",
}

#: on_full policies, each at its code's index (the geometry's policy byte)
POLICIES = tuple(name for _code, name in sorted(
    {POLICY_OVERWRITE: "overwrite", POLICY_BLOCK: "block", POLICY_ERROR: "error"}.items()))

_SIZE_RE = r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$"  # (compiled on first use, by re's cache)
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
        m = re.match(_SIZE_RE, value)
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
            f"version {FORMAT_VERSION} only (its lock holders and control words differ): drain it "
            "with the older shmq, or 'shmq export' it there and 'shmq import' the dump into a "
            "spool created by this one")
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

#: key_hash, not_before_ns, max_attempts (0: queue default), flags
WQ_HEADER = struct.Struct(WQ_HEADER_FORMAT)


def wq_region_records(lease_slots: int, key_slots: int) -> int:
    """Lease-region size in 64-byte records for a work queue's leases and key index."""
    return lease_slots + (key_slots * KEY_WORDS * 8 + LEASE_BYTES - 1) // LEASE_BYTES


def key_hash(key) -> int:
    """Stable 64-bit hash of a str/bytes key (never 0: 0 marks an empty entry)."""
    from hashlib import blake2b  # (on first use: hashlib loads OpenSSL)

    raw = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    h = int.from_bytes(blake2b(raw, digest_size=8).digest(), "little")
    return h or 1
