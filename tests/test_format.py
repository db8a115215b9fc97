"""shmq._format: the pure functions of the on-disk format (no I/O, no mapping).

Round trips are property tests (hypothesis); every malformed geometry header
we can construct is rejected with a SpoolFormatError that says what is wrong.
"""

import os
import pickle
import runpy
import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmq import _format as F
from shmq.errors import SpoolFormatError

from conftest import SOURCE_ROOT

PREFIX = "0123456789ab"
prefixes = st.text(alphabet="0123456789abcdef", min_size=12, max_size=12)


# --- fixed layout ---------------------------------------------------------------------


def test_struct_sizes_are_the_documented_ones():
    # docs/format.md: a 128-byte geometry block (CRC at 124), 32-byte frame headers
    assert F.GEOMETRY.size == 128 and F.GEOMETRY_CRC_SPAN == 124
    assert F.FRAME.size == F.FRAME_BYTES == 32
    assert F.FLOCK.size == 32
    assert F.WQ_HEADER.size == 24
    assert F.SLOT_WORDS * 8 == F.SLOT_BYTES and F.CTL_WORDS * 8 == F.HEADER_BYTES
    assert F.W_RATE + F.RATE_SECONDS * F.RATE_WORDS <= F.DOORBELL_BYTE // 8


# --- sizes -------------------------------------------------------------------------------


UNITS = {"": 1, "b": 1, "k": 1024, "KiB": 1024, "kb": 1000, "M": 1024**2, "MiB": 1024**2,
         "MB": 1000**2, "g": 1024**3, "GiB": 1024**3, "GB": 1000**3, "TiB": 1024**4,
         "tb": 1000**4}


@given(st.integers(1, 10**6), st.sampled_from(sorted(UNITS)), st.sampled_from(["", " "]))
def test_parse_size_round_trips_units(n, unit, space):
    assert F.parse_size(f"{n}{space}{unit}") == n * UNITS[unit]
    assert F.parse_size(f"  {n}{unit.upper()}  ") == n * UNITS[unit]


@given(st.integers(1, 1 << 62))
def test_parse_size_keeps_ints(n):
    assert F.parse_size(n) == n


@pytest.mark.parametrize("bad", ["", "abc", "12 parsecs", "-5MiB", "1e3", "MiB", "1.2.3K"])
def test_parse_size_rejects_unparsable_strings(bad):
    with pytest.raises(ValueError, match="cannot parse size"):
        F.parse_size(bad)


@pytest.mark.parametrize("bad", [0, -1, "0", "0KiB", "0.0001"])
def test_parse_size_rejects_non_positive(bad):
    with pytest.raises(ValueError, match="positive"):
        F.parse_size(bad)


@pytest.mark.parametrize("bad", [True, 1.5, None, b"64MiB", [64]])
def test_parse_size_rejects_other_types(bad):
    with pytest.raises(TypeError, match="capacity must be an int or a string"):
        F.parse_size(bad)


@given(st.integers(0, 1 << 40), st.sampled_from([1, 8, 64, 4096]))
def test_align(n, to):
    a = F.align(n, to)
    assert a % to == 0 and n <= a < n + to


@given(st.integers(0, F.MAX_FRAME_PAYLOAD))
def test_frame_stored_bytes(length):
    stored = F.frame_stored_bytes(length)
    assert stored % F.ALIGN == 0 and F.FRAME_BYTES + length <= stored < F.FRAME_BYTES + length + F.ALIGN


@given(st.integers(0, 1 << 12), st.integers(0, 1 << 13), st.integers(-16, 16), st.integers(0, 1 << 40))
def test_the_engines_header_decoder_keeps_frames_inside_the_ring(length, slot, delta, seq):
    """_core.header_at (the engine's one decoder: ring.py, fsck and the engine's reads)
    decodes a header at a ring position, follows the short tail, and refuses (checked)
    lengths that leave the ring: too short, misaligned, or past the ring's end."""
    from shmq import _core

    ring = 1 << 14
    off = slot * F.ALIGN % ring
    stored = max(0, F.frame_stored_bytes(length) + delta)
    buf = bytearray(8 + ring)
    head = off if ring - off >= F.FRAME_BYTES else 0  # a short tail: the header is at offset 0
    F.FRAME.pack_into(buf, 8 + head, seq, stored, length, 7, 9, F.FLAG_CRC, F.CODEC_UTF8, 0)
    pos = 3 * ring + off
    raw = _core.header_at(buf, 8, ring, pos, False)
    assert raw == (seq, pos if head == off else pos + ring - off, stored, length, 7, 9, F.FLAG_CRC, F.CODEC_UTF8)
    inside = stored >= F.FRAME_BYTES + length and stored % F.ALIGN == 0 and head + stored <= ring
    assert (_core.header_at(buf, 8, ring, pos) is not None) == inside


# --- geometry ----------------------------------------------------------------------------


def _geometry(capacity=1 << 16, slots=F.DEFAULT_SLOTS, leases=0, policy="overwrite",
              checksum=False, prefix=PREFIX, created_ns=1):
    slot_off, lease_off, ring_off, ring_bytes, file_bytes = F.ring_geometry(capacity, slots, leases)
    raw = F.pack_geometry(file_bytes=file_bytes, ring_offset=ring_off, ring_bytes=ring_bytes,
                          slot_offset=slot_off, slot_count=slots, lease_offset=lease_off,
                          lease_count=leases, policy=policy, checksum=checksum,
                          sem_prefix=prefix, created_ns=created_ns)
    return raw, file_bytes


@settings(max_examples=200)
@given(st.integers(1, 1 << 34), st.integers(1, F.MAX_SLOTS), st.integers(0, 1 << 16),
       st.sampled_from(F.POLICIES), st.booleans(), prefixes, st.integers(0, (1 << 64) - 1))
def test_geometry_round_trip(capacity, slots, leases, policy, checksum, prefix, created_ns):
    raw, file_bytes = _geometry(capacity, slots, leases, policy, checksum, prefix, created_ns)
    assert len(raw) == F.GEOMETRY.size
    g = F.unpack_geometry(raw, file_bytes, "x")
    assert g["file_bytes"] == file_bytes and g["slot_count"] == slots
    assert g["lease_count"] == leases and g["policy"] == policy
    assert g["checksum"] is checksum and g["sem_prefix"] == prefix
    assert g["created_ns"] == created_ns
    assert g["version"] == F.FORMAT_VERSION == 4
    assert g["ring_bytes"] >= max(capacity, F.MIN_RING_BYTES) and g["ring_bytes"] % F.PAGE == 0
    assert g["ring_offset"] % F.PAGE == 0
    assert g["ring_offset"] >= g["lease_offset"] + leases * F.LEASE_BYTES
    # a bigger file is fine (e.g. a disk file grown by someone else): only shorter is truncation
    assert F.unpack_geometry(raw, file_bytes + 4096, "x") == g


FIELDS = ("magic", "version", "header_bytes", "file_bytes", "ring_offset", "ring_bytes",
          "slot_offset", "slot_count", "slot_bytes", "lease_offset", "lease_count",
          "lease_bytes", "policy", "checksum", "r0", "flags", "sem_prefix", "created_ns", "r1",
          "crc")


def _with(**changes):
    """A valid geometry block with ``changes`` applied and the CRC recomputed."""
    raw, file_bytes = _geometry(leases=16)
    vals = dict(zip(FIELDS, F.GEOMETRY.unpack(raw)))
    vals.update(changes)
    body = F.GEOMETRY.pack(*(vals[k] for k in FIELDS))
    return body[:F.GEOMETRY_CRC_SPAN] + struct.pack("<I", zlib.crc32(body[:F.GEOMETRY_CRC_SPAN])), \
        vals["file_bytes"]


def _valid():
    return dict(zip(FIELDS, F.GEOMETRY.unpack(_geometry(leases=16)[0])))


V = _valid()

MALFORMED = {
    "header size": dict(header_bytes=F.HEADER_BYTES * 2),
    "slot record size": dict(slot_bytes=F.SLOT_BYTES + 8),
    "lease record size": dict(lease_bytes=F.LEASE_BYTES // 2),
    "slot offset": dict(slot_offset=F.SLOT_OFFSET + 8),
    "no slots": dict(slot_count=0),
    "too many slots": dict(slot_count=F.MAX_SLOTS + 1),
    "lease table offset": dict(lease_offset=V["lease_offset"] + 8),
    "ring offset unaligned": dict(ring_offset=V["ring_offset"] + 8),
    "ring overlaps the lease table": dict(ring_offset=0),
    "ring too small": dict(ring_bytes=F.MIN_RING_BYTES - F.PAGE,
                           file_bytes=V["ring_offset"] + F.MIN_RING_BYTES - F.PAGE),
    "ring size unaligned": dict(ring_bytes=V["ring_bytes"] + 8, file_bytes=V["file_bytes"] + 8),
    "file size field": dict(file_bytes=V["file_bytes"] - F.PAGE),
    "policy code": dict(policy=len(F.POLICIES)),
    "semaphore name not hex": dict(sem_prefix=b"0123456789xz"),
    "semaphore name too short": dict(sem_prefix=b"0123"),
    "semaphore name not ascii": dict(sem_prefix=b"\xff" * 12),
}


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_inconsistent_geometry_is_rejected(what):
    raw, _ = _with(**MALFORMED[what])
    with pytest.raises(SpoolFormatError, match="spool header is inconsistent.*recreate the spool"):
        F.unpack_geometry(raw, 1 << 40, "p")


def test_bad_magic_is_a_foreign_file():
    raw, fb = _with(magic=b"NOTASPOOL"[:8])
    with pytest.raises(SpoolFormatError, match="not a shmq spool .bad magic.*foreign file"):
        F.unpack_geometry(raw, fb, "p")


def test_newer_version_says_upgrade():
    raw, fb = _with(version=F.FORMAT_VERSION + 1)
    with pytest.raises(SpoolFormatError, match="newer than this shmq supports.*upgrade shmq"):
        F.unpack_geometry(raw, fb, "p")


@pytest.mark.parametrize("version", F.OLD_FORMAT_VERSIONS)
def test_older_versions_say_how_to_migrate(version):
    # versions 1 and 2 keep FIRST_SEQ/FIRST_POS in words 18/19: read with this
    # layout they would look empty, so they are refused before anything is mapped
    raw, fb = _with(version=version)
    with pytest.raises(SpoolFormatError, match=f"version {version} was written by an older shmq.*"
                       "'shmq export' it there and 'shmq import'"):
        F.unpack_geometry(raw, fb, "p")


def test_version_zero_is_invalid():
    raw, fb = _with(version=0)
    with pytest.raises(SpoolFormatError, match="invalid spool format version 0"):
        F.unpack_geometry(raw, fb, "p")


@given(st.integers(8, F.GEOMETRY_CRC_SPAN - 1), st.integers(1, 255))
def test_any_flipped_byte_fails_the_checksum(pos, xor):
    raw, fb = _geometry()
    bad = bytearray(raw)
    bad[pos] ^= xor
    with pytest.raises(SpoolFormatError):
        F.unpack_geometry(bytes(bad), fb, "p")
    if pos >= 12:  # past magic and version: only the CRC can notice
        with pytest.raises(SpoolFormatError, match="checksum mismatch"):
            F.unpack_geometry(bytes(bad), fb, "p")


def test_wrong_crc_field():
    raw, fb = _geometry()
    with pytest.raises(SpoolFormatError, match="checksum mismatch.*shmq rm"):
        F.unpack_geometry(raw[:-4] + bytes(4), fb, "p")


def test_truncated_file_with_our_magic():
    raw, fb = _geometry()
    with pytest.raises(SpoolFormatError, match="truncated spool.*shmq rm"):
        F.unpack_geometry(raw[:40], 40, "p")
    with pytest.raises(SpoolFormatError, match="truncated spool.*header alone"):
        F.unpack_geometry(raw, F.HEADER_BYTES - 1, "p")
    with pytest.raises(SpoolFormatError, match=f"the file has {fb - 1} bytes.*says {fb}"):
        F.unpack_geometry(raw, fb - 1, "p")


@pytest.mark.parametrize("raw", [b"", b"hello", bytes(200)])
def test_small_or_empty_foreign_files(raw):
    with pytest.raises(SpoolFormatError, match="not a shmq spool"):
        F.unpack_geometry(raw, len(raw), "p")


@settings(max_examples=300)
@given(st.binary(min_size=0, max_size=F.GEOMETRY.size + 8), st.integers(0, 1 << 40))
def test_random_headers_never_raise_anything_else(raw, size):
    try:
        F.unpack_geometry(raw, size, "p")
    except SpoolFormatError:
        pass


@settings(max_examples=300)
@given(st.data())
def test_random_fields_with_a_valid_crc_are_decoded_or_rejected(data):
    raw, _ = _geometry()
    vals = dict(zip(FIELDS, F.GEOMETRY.unpack(raw)))
    field = data.draw(st.sampled_from(["file_bytes", "ring_offset", "ring_bytes", "slot_offset",
                                       "slot_count", "lease_offset", "lease_count"]))
    fmt = dict(zip(FIELDS, "8s I I Q Q Q Q I I Q I I B B H I 16s Q 20s I".split()))[field]
    vals[field] = data.draw(st.integers(0, (1 << (64 if fmt == "Q" else 32)) - 1))
    raw2, _ = _with(**{field: vals[field]})
    size = data.draw(st.integers(0, 1 << 45))
    try:
        g = F.unpack_geometry(raw2, size, "p")
    except SpoolFormatError:
        return
    # accepted: every region lies inside the file
    assert g["ring_offset"] + g["ring_bytes"] == g["file_bytes"] <= size
    assert g["lease_offset"] + g["lease_count"] * F.LEASE_BYTES <= g["ring_offset"]


# --- names, locks, out-of-band pickles, work queue -----------------------------------------


@given(st.text(min_size=1).filter(lambda s: len(s.encode("utf-8")) <= F.NAME_MAX_BYTES))
def test_name_round_trip(name):
    raw = F.pack_name(name)
    assert F.unpack_name(raw + bytes(F.NAME_MAX_BYTES)) == name


def test_name_rejections():
    assert F.unpack_name(bytes(8)) is None  # empty
    assert F.unpack_name(bytes([F.NAME_MAX_BYTES + 1]) + b"x" * 80) is None  # length too big
    assert F.unpack_name(b"\x02\xff\xfe") is None  # not UTF-8


@given(st.sampled_from([0, 1, 2]), st.integers(0, 1 << 40), st.integers(0, 1 << 20))
def test_flock_round_trip(kind, start, length):
    raw = F.pack_flock(kind, start, length)
    assert len(raw) == F.FLOCK.size
    assert F.unpack_flock(raw) == (kind, start, length, 0)


def _oob_payload(pickled, buffers):
    head = F.pack_oob_header(len(pickled), [len(b) for b in buffers])
    out = head + pickled + F.oob_padding(len(head) + len(pickled))
    for b in buffers:
        out += b + F.oob_padding(len(b))
    return out


@given(st.binary(max_size=200), st.lists(st.binary(max_size=100), max_size=6))
def test_oob_round_trip(pickled, buffers):
    payload = _oob_payload(pickled, buffers)
    p, bufs = F.unpack_oob(memoryview(payload))
    assert bytes(p) == pickled and [bytes(b) for b in bufs] == buffers


def test_oob_with_a_real_pickle():
    data = bytearray(b"x" * 1000)
    bufs = []
    pickled = pickle.dumps(pickle.PickleBuffer(data), protocol=5, buffer_callback=bufs.append)
    p, views = F.unpack_oob(memoryview(_oob_payload(pickled, [bytes(b.raw()) for b in bufs])))
    assert pickle.loads(p, buffers=views) == data


@given(st.binary(max_size=64), st.lists(st.binary(max_size=32), min_size=1, max_size=4),
       st.data())
def test_oob_truncated_or_corrupt_raises_value_error(pickled, buffers, data):
    payload = _oob_payload(pickled, buffers)
    cut = data.draw(st.integers(0, len(payload) - 1))
    try:
        F.unpack_oob(memoryview(payload[:cut]))
    except ValueError:
        pass
    bad = bytearray(payload)
    struct.pack_into("<I", bad, 0, 1 << 30)  # an absurd buffer count
    with pytest.raises(ValueError, match="bad buffer count"):
        F.unpack_oob(memoryview(bytes(bad)))


@given(st.integers(1, 1 << 20), st.integers(1, 1 << 20))
def test_wq_region_records_cover_leases_and_keys(leases, keys):
    n = F.wq_region_records(leases, keys)
    assert n * F.LEASE_BYTES >= leases * F.LEASE_WORDS * 8 + keys * F.KEY_WORDS * 8
    assert (n - 1) * F.LEASE_BYTES < leases * F.LEASE_WORDS * 8 + keys * F.KEY_WORDS * 8


@given(st.text())
def test_key_hash_is_stable_and_never_zero(key):
    h = F.key_hash(key)
    assert 0 < h < 1 << 64
    assert h == F.key_hash(key.encode("utf-8")) == F.key_hash(bytearray(key.encode("utf-8")))


# --- the one layout source ------------------------------------------------------------


ROOT = SOURCE_ROOT
LAYOUT_H = os.path.join(ROOT, "shmq", "engine", "shmq_layout.h")


def _generator():
    return runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="shmq-layout")["layout_module"]


def test_the_layout_module_is_generated_from_the_engine_header():
    """shmq/_layout.py is what setup.py makes of shmq/engine/shmq_layout.h now: the layout
    is written once, in the header (a build from another header fails here)."""
    import shmq._layout as L

    with open(LAYOUT_H) as f:
        assert open(L.__file__).read() == _generator()(f.read())
    assert F.W_NEXT_SEQ == L.W_NEXT_SEQ == 16 and F.RING_ADVICE == L.RING_ADVICE
    assert F.GEOMETRY.size == F.GEOMETRY_BYTES == 128 and F.FRAME.size == F.FRAME_BYTES == 32
    assert F.MAGIC == b"SHMQSPL\x00" and F.POLICIES == ("overwrite", "block", "error")


@pytest.mark.parametrize("line", ["#define SHMQ_X foo(1)", "#define SHMQ_Y SHMQ_UNKNOWN + 1"])
def test_the_layout_generator_refuses_what_it_cannot_read(line):
    with pytest.raises(ValueError, match="SHMQ_"):
        _generator()(line + "\n")


def test_the_layout_generator_evaluates_expressions_and_field_lists():
    text = ("#define SHMQ_A 8\n#define SHMQ_B (SHMQ_A / 2) /* half */\n#define SHMQ_C (1ull << 62)\n"
            "#define SHMQ_S \"text\"\n#define SHMQ_T_FIELDS(X) X(uint64_t, seq, Q) X(char, tag[4], 4s)\n")
    ns = {}
    exec(_generator()(text), ns)
    assert (ns["A"], ns["B"], ns["C"], ns["S"]) == (8, 4, 1 << 62, "text")
    assert ns["T_FORMAT"] == "<Q4s" and ns["T_FIELD_NAMES"] == ("seq", "tag")
