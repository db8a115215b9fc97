"""The compiled core (shmq/core/*.c) agrees with the format spec (shmq/_format.py).

``_format`` is the readable spec of the ring; the core is the one place that
writes and reads frames on the hot path.  These tests check, byte for byte:

* frames the core writes (``Spool.put``/``put_many``) decode with a
  pure-Python walker built only from ``_format`` (FRAME, valid_frame_header,
  FLAG_PAD pads, the short-tail rule) to exactly what was written, and land
  at the same positions with the same control words as the same operations
  through the spec's own writer (``Spool.writer.append_general``);
* frames the spec's writer writes are read back exactly by the core
  (readers and ``Spool._read``);
* ``_core.crc32`` is zlib's CRC-32 and the core's layout constants are
  ``_format``'s.

The walker reads the spool file with plain file I/O, not through any shmq
object, so it shares no code with the implementation under test.
"""

import os
import random
import re
import struct
import time
import uuid
import zlib

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import shmq
from shmq import _core
from shmq import _format as F
from conftest import CORE_SOURCES

CTL = struct.Struct("<Q")
CHECKED_WORDS = ("W_NEXT_SEQ", "W_NEXT_POS", "W_FIRST_SEQ", "W_FIRST_POS", "W_EVICTED",
                 "W_PUT_BYTES")


def ctl_word(raw, name):
    return CTL.unpack_from(raw, 8 * getattr(F, name))[0]


def spec_walk(path):
    """Decode a spool file with ``_format`` only.

    Returns ``(words, records)``: the control words in CHECKED_WORDS and, in
    ring order from FIRST_POS to NEXT_POS, one record per element met:
    ``("frame", pos, seq, stored, length, ts, crc, flags, codec, ext, payload)``,
    ``("pad", pos, seq, stored, length, ts, crc, flags, codec, ext)`` or
    ``("tail", pos, nbytes)`` (a tail shorter than a header: no header there).
    Asserts every rule of the spec on the way.
    """
    with open(path, "rb") as f:
        raw = f.read()
    geo = F.unpack_geometry(raw[:F.GEOMETRY.size], len(raw), path)
    base, ring = geo["ring_offset"], geo["ring_bytes"]
    words = {name: ctl_word(raw, name) for name in CHECKED_WORDS}
    seq, pos = words["W_FIRST_SEQ"], words["W_FIRST_POS"]
    next_seq, next_pos = words["W_NEXT_SEQ"], words["W_NEXT_POS"]
    assert seq <= next_seq and pos <= next_pos and next_pos - pos <= ring
    records = []
    while pos < next_pos:
        off = pos % ring
        if ring - off < F.FRAME_BYTES:  # the short-tail rule: skipped, no header written
            records.append(("tail", pos, ring - off))
            pos += ring - off
            continue
        hseq, stored, length, ts, crc, flags, codec, ext = F.FRAME.unpack_from(raw, base + off)
        assert F.valid_frame_header(stored, length, off, ring), (pos, stored, length)
        assert hseq == seq, f"header at {pos} says seq {hseq}, expected {seq}"
        if flags & F.FLAG_PAD:
            # filler to the ring's end, carrying the seq of the frame after it
            assert off != 0 and stored == ring - off and length == 0 and flags == F.FLAG_PAD
            assert crc == 0 and codec == 0 and ext == 0
            records.append(("pad", pos, hseq, stored, length, ts, crc, flags, codec, ext))
        else:
            assert stored == F.frame_stored_bytes(length)
            payload = raw[base + off + F.FRAME_BYTES:base + off + F.FRAME_BYTES + length]
            records.append(("frame", pos, hseq, stored, length, ts, crc, flags, codec, ext, payload))
            seq += 1
        pos += stored
    assert pos == next_pos and seq == next_seq, (pos, next_pos, seq, next_seq)
    return words, records


def frames_of(records):
    return [r for r in records if r[0] == "frame"]


def without_ts(records):
    """Records with the timestamp masked (the only field two writers may differ in)."""
    return [r if r[0] == "tail" else r[:5] + (None,) + r[6:] for r in records]


def payloads(seed, sizes):
    rnd = random.Random(seed)
    return [rnd.randbytes(n) for n in sizes]


# A batch: payload sizes (mostly small, some up to ~3000, odd sizes included),
# one codec, and whether a one-frame batch goes through put() or put_many().
sizes = st.one_of(st.integers(0, 40), st.integers(0, 3000), st.sampled_from([1, 7, 9, 4039, 4040]))
batches = st.tuples(st.lists(sizes, min_size=1, max_size=20), st.integers(0, 7), st.booleans(),
                    st.integers(0, 2**32))


def _fresh(spool_dir, capacity, checksum, on_full="overwrite"):
    path = os.path.join(spool_dir, uuid.uuid4().hex[:8])
    return shmq.Spool.create(path, capacity=capacity, on_full=on_full, checksum=checksum)


def _drop(*spools):
    for sp in spools:
        path = sp.path
        sp.close()
        shmq.Spool.destroy(path)


def _check_records_match_model(records, model, checksum):
    """The spec-decoded frames are exactly the newest frames written, in order."""
    got = frames_of(records)
    expect = model[len(model) - len(got):] if got else []
    for rec, (seq, data, codec) in zip(got, expect):
        _kind, _pos, hseq, stored, length, _ts, crc, flags, hcodec, ext, payload = rec
        assert (hseq, payload, hcodec, length) == (seq, data, codec, len(data))
        assert ext == 0
        if checksum:
            assert flags == F.FLAG_CRC and crc == zlib.crc32(data)
        else:
            assert flags == 0 and crc == 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(batches, min_size=1, max_size=14), capacity=st.sampled_from([4096, 8192]),
       checksum=st.booleans())
def test_core_writer_and_spec_writer_agree_byte_for_byte(spool_dir, ops, capacity, checksum):
    """C writer -> spec decoder, spec writer -> C reader, and both writers -> identical rings.

    The same operations go through the core (``put``/``put_many``) on spool
    ``c`` and through the spec's writer (``_append_general``) on spool ``p``;
    after each one both files decode with the spec to the frames written, at
    the same positions with the same headers (timestamps aside) and control
    words, and the core's readers read ``p`` back exactly.
    """
    c = _fresh(spool_dir, capacity, checksum)
    p = _fresh(spool_dir, capacity, checksum)
    try:
        anon = p.reader(verify=checksum)
        group = p.reader("g", group=True, verify=checksum)
        model = []  # (seq, payload, codec) of every frame written
        for sizes_, codec, single, seed in ops:
            data = payloads(seed, sizes_)
            t0 = time.time_ns()
            if sum(F.frame_stored_bytes(n) for n in sizes_) > capacity:
                with pytest.raises(shmq.TooLarge):
                    c.put(data[0], codec=codec) if len(data) == 1 else c.put_many(data, codec=codec)
                with pytest.raises(shmq.TooLarge):
                    p.writer.append_general(data, None, codec)
                continue
            if len(data) == 1 and single:
                s1 = c.put(data[0], codec=codec)
            else:
                s1 = c.put_many(data, codec=codec)
            s2 = p.writer.append_general(data, None, codec)
            t1 = time.time_ns()
            assert s1 == s2 == len(model)
            model += [(s1 + k, d, codec) for k, d in enumerate(data)]

            wc, rc = spec_walk(c.path)
            wp, rp = spec_walk(p.path)
            assert wc == wp
            for kind in {r[0] for r in rc} | ({"evicted"} if wc["W_EVICTED"] else set()):
                event(kind)  # coverage: pads, short tails and eviction all occur
            assert without_ts(rc) == without_ts(rp)
            _check_records_match_model(rc, model, checksum)
            # this batch (and its pads) carries one timestamp, taken during the call
            batch_ts = {r[5] for r in rc if r[0] != "tail" and r[2] >= s1}
            assert len(batch_ts) == 1 and t0 <= batch_ts.pop() <= t1

            # the core reads the spec writer's frames: anonymous reader, group, _read
            got = []
            while len(got) < len(data):
                got += anon.get_many(25, block=False)
            assert anon.lost == 0 and anon.position == s1 + len(data)
            ts_of = {r[2]: r[5] for r in frames_of(rp)}
            assert [(f.seq, bytes(f.data), f.codec, f.timestamp_ns) for f in got] == [
                (s, d, cd, ts_of[s]) for s, d, cd in model[s1:]]
            assert [(f.seq, bytes(f.data)) for f in group.get_many(len(data), block=False)] == [
                (s, d) for s, d, _cd in model[s1:]]
            for rec in rp:  # a cursor at a tail, a pad or a frame reads the next frame
                if rec[0] == "tail":
                    continue
                frame, seq, pos, lost, fcodec = p.ring.read(rec[2], rec[1], checksum)
                s, d, cd = model[rec[2]]
                assert (frame.seq, bytes(frame.data), fcodec, lost) == (s, d, cd, 0)
                assert seq == s + 1
        with pytest.raises(shmq.Empty):
            anon.get(block=False)
    finally:
        _drop(c, p)


def _ring_bytes(path, lo, hi):
    with open(path, "rb") as f:
        raw = f.read()
    base = F.unpack_geometry(raw[:F.GEOMETRY.size], len(raw), path)["ring_offset"]
    return raw[base + lo:base + hi]


@pytest.mark.parametrize("writer", ["core", "spec"])
def test_short_tail_has_no_header_and_pads_carry_the_next_seq(spool_dir, writer):
    """The two edge cases of placement, written deterministically by each writer."""
    sp = _fresh(spool_dir, 8192, True)
    if writer == "core":
        def w(items):
            return sp.put_many(items) if len(items) > 1 else sp.put(items[0])
    else:
        def w(items):
            return sp.writer.append_general(items, None, F.CODEC_RAW)

    def layout():
        return [(r[0], r[1] % 8192) + ((r[2],) if r[0] != "tail" else (r[2],)) for r in
                spec_walk(sp.path)[1]]

    try:
        w([b"w" * 4064])  # seq 0 at 0..4096
        w([b"a" * 4040])  # seq 1 at 4096; 4096 + 32 + 4040 = 8168: 24 bytes left, no header fits
        w([b"b" * 9])  # seq 2 wraps to 0 (evicting seq 0): no pad header in the tail
        assert layout() == [("frame", 4096, 1), ("tail", 8168, 24), ("frame", 0, 2)]
        assert _ring_bytes(sp.path, 8168, 8192) == bytes(24)  # the tail was never written
        w([b"c" * 3976])  # seq 3 at 48..4056
        w([b"d" * 16])  # seq 4 at 4056..4104 evicts seq 1: FIRST_POS is left at the tail
        assert layout() == [("tail", 8168, 24), ("frame", 0, 2), ("frame", 48, 3),
                            ("frame", 4056, 4)]
        assert [bytes(f.data) for f in sp.reader().get_many(10, block=False)] == [
            b"b" * 9, b"c" * 3976, b"d" * 16]
        # a batch with a pad inside: x fits before the end, y (4072 > 4048 left) wraps
        assert w([b"x" * 8, b"y" * 4040]) == 5
        assert layout() == [("frame", 4104, 5), ("pad", 4144, 6), ("frame", 0, 6)]  # 4 evicted
        pad = spec_walk(sp.path)[1][1]
        assert pad[3] == 8192 - 4144 and pad[7] == F.FLAG_PAD
        assert sp.stats().evicted == 5
        assert [f.seq for f in sp.reader().get_many(10, block=False)] == [5, 6]
    finally:
        _drop(sp)


def test_short_tail_cursor_is_read_by_the_core(spool_dir):
    sp = _fresh(spool_dir, 4096, False)
    try:
        sp.writer.append_general([b"a" * 4040], None, F.CODEC_RAW)
        sp.writer.append_general([b"next"], None, F.CODEC_RAW)
        frame, seq, pos, lost, _codec = sp.ring.read(1, 4072)  # a cursor left in the tail
        assert (frame.seq, frame.data, seq, pos, lost) == (1, b"next", 2, 4096 + 40, 0)
        assert sp.ring.read(2, pos)[0] is None  # caught up
    finally:
        _drop(sp)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=5000), start=st.integers(0, 2**32 - 1))
def test_core_crc32_is_zlib_crc32(data, start):
    assert _core.crc32(data) == zlib.crc32(data)
    assert _core.crc32(data, start) == zlib.crc32(data, start)
    assert _core.crc32(memoryview(data)[1::1]) == zlib.crc32(data[1:])


def test_core_layout_matches_format_spec():
    """The import-time LAYOUT table and the C source's constants are _format's."""
    assert _core.LAYOUT, "the core exports its layout"
    assert {k: v for k, v in _core.LAYOUT.items() if getattr(F, k) != v} == {}
    for name in ("FRAME_BYTES", "W_NEXT_SEQ", "W_NEXT_POS", "W_FIRST_SEQ", "W_FIRST_POS",
                 "W_LOCK_HOLDER", "SLOT_BYTES", "S_SEQ", "S_POS", "S_LOCK_HOLDER"):
        assert name in _core.LAYOUT
    # Every constant the C source #defines under a _format name has _format's
    # value (also those LAYOUT does not list, e.g. flags and codec tags).
    src = "\n".join(open(os.path.join(CORE_SOURCES, f)).read() for f in sorted(os.listdir(CORE_SOURCES))
                    if f.endswith((".c", ".h")))
    defines = dict(re.findall(r"^#define\s+([A-Z][A-Z0-9_]*)\s+(0x[0-9A-Fa-f]+|\d+)\s*(?:/\*.*)?$",
                              src, re.M))
    shared = {k: int(v, 0) for k, v in defines.items() if hasattr(F, k)}
    assert {"FRAME_BYTES", "FLAG_PAD", "FLAG_CRC", "CODEC_PICKLE_OOB", "W_NEXT_SEQ"} <= set(shared)
    assert {k: v for k, v in shared.items() if getattr(F, k) != v} == {}
    assert F.FRAME.size == F.FRAME_BYTES == 32
