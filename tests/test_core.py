"""The compiled core (shmq/core/*.c) agrees with the format spec (shmq/_format.py).

``_format`` is the readable spec of the ring; the core is the one writer
(every write path: put, put_many with its options, reserve) and the one
reader on the hot path.  These tests check, byte for byte:

* frames the core writes decode with a pure-Python walker built only from
  ``_format`` (FRAME, FLAG_PAD pads, the short-tail
  rule, zeroed alignment padding) to exactly the frames put, and land at
  the same positions with the same control words as the same operations
  through ``SpecWriter``, the placement, eviction and commit of
  docs/format.md written out in this file over plain file I/O (overwrite
  policy, fixed rings);
* frames ``SpecWriter`` writes are read back exactly by the core (readers
  and ``Ring.read``);
* every write option (``Deferred`` payloads, ``before_commit``, imported
  ``timestamps``, ``sync=True``, segment tuples) and a zero-copy pin writes
  the same ring as plain puts, under all three policies, on fixed and
  growable rings, through wrap-around;
* ``_core.crc32`` is zlib's CRC-32.

The walker and ``SpecWriter`` read and write the spool file with plain file
I/O, not through any shmq object, so they share no code with the
implementation under test.
"""

import mmap
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
from shmq.spool import Deferred
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
    Asserts every rule of the spec on the way, the alignment padding after
    each payload zeroed included.
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
        # inside the ring: the lengths docs/format.md allows
        assert stored >= F.FRAME_BYTES + length and stored % F.ALIGN == 0 and off + stored <= ring, (pos, stored)
        assert hseq == seq, f"header at {pos} says seq {hseq}, expected {seq}"
        if flags & F.FLAG_PAD:
            # filler to the ring's end, carrying the seq of the frame after it
            assert off != 0 and stored == ring - off and length == 0 and flags == F.FLAG_PAD
            assert crc == 0 and codec == 0 and ext == 0
            records.append(("pad", pos, hseq, stored, length, ts, crc, flags, codec, ext))
        else:
            assert stored == F.frame_stored_bytes(length)
            body = base + off + F.FRAME_BYTES
            payload = raw[body:body + length]
            assert raw[body + length:base + off + stored] == bytes(stored - F.FRAME_BYTES - length), (
                f"alignment padding of seq {hseq} is not zeroed")
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


class SpecWriter:
    """docs/format.md's placement, eviction and commit, over plain file I/O.

    The reference the core's writer is held to (overwrite policy, fixed
    rings; no readers' cursors, pins or pages to allocate): a frame that does
    not fit before the ring's end is preceded by padding to the end (a PAD
    header carrying the next frame's seq if 32+ bytes remain, else nothing);
    a batch that would then span more than the ring starts at the ring's
    start instead; room is made by walking the oldest headers forward (the
    position first, then the seq; when everything goes, the ring restarts
    at the batch); alignment padding is zeroed; NEXT_SEQ is the commit.
    """

    def __init__(self, path):
        self._f = open(path, "r+b")
        self.mm = mmap.mmap(self._f.fileno(), 0)
        geo = F.unpack_geometry(self.mm[:F.GEOMETRY.size], len(self.mm), path)
        self.base, self.ring, self.checksum = geo["ring_offset"], geo["ring_bytes"], geo["checksum"]

    def close(self):
        self.mm.close()
        self._f.close()

    def __getitem__(self, name):
        return CTL.unpack_from(self.mm, 8 * getattr(F, name))[0]

    def __setitem__(self, name, value):
        CTL.pack_into(self.mm, 8 * getattr(F, name), value)

    def place(self, start, needs):
        """``(positions, pads)`` of a batch written at ``start``; pads are (pos, bytes, index)."""
        ring = self.ring
        pos, placed, pads = start, [], []
        for k, need in enumerate(needs):
            off = pos % ring
            if ring - off < need:
                if ring - off >= F.FRAME_BYTES:
                    pads.append((pos, ring - off, k))
                pos += ring - off
            placed.append(pos)
            pos += need
        if pos - placed[0] > ring:  # it would wrap onto itself: start at the ring's start
            off = start % ring
            pads = [(start, ring - off, 0)] if off and ring - off >= F.FRAME_BYTES else []
            pos = start + (ring - off if off else 0)
            placed = []
            for need in needs:
                placed.append(pos)
                pos += need
        return placed, pads

    def evict(self, limit, next_seq, batch_pos):
        ring, base = self.ring, self.base
        seq = first = self["W_FIRST_SEQ"]
        pos = self["W_FIRST_POS"]
        while pos < limit and seq < next_seq:
            off = pos % ring
            if ring - off < F.FRAME_BYTES:
                pos += ring - off
                continue
            _s, stored, _n, _t, _c, flags, _cd, _x = F.FRAME.unpack_from(self.mm, base + off)
            pos += stored
            if not flags & F.FLAG_PAD:
                seq += 1
        if seq >= next_seq:
            self["W_FIRST_SEQ"], self["W_FIRST_POS"] = seq, batch_pos
        else:
            self["W_FIRST_POS"], self["W_FIRST_SEQ"] = pos, seq
        self["W_EVICTED"] += seq - first

    def write(self, items, codec, ts):
        """Write a batch; return its first seq.  :raises shmq.TooLarge: it can never fit."""
        ring, base = self.ring, self.base
        needs = [F.frame_stored_bytes(len(p)) for p in items]
        if sum(needs) > ring:
            raise shmq.TooLarge("batch larger than the ring")
        seq0, start = self["W_NEXT_SEQ"], self["W_NEXT_POS"]
        placed, pads = self.place(start, needs)
        end = placed[-1] + needs[-1]
        if end - self["W_FIRST_POS"] > ring:
            self.evict(end - ring, seq0, placed[0])
        for pos, gap, k in pads:
            F.FRAME.pack_into(self.mm, base + pos % ring, seq0 + k, gap, 0, ts, 0, F.FLAG_PAD, 0, 0)
        for k, (data, need, pos) in enumerate(zip(items, needs, placed)):
            o = base + pos % ring
            crc, flags = (zlib.crc32(data), F.FLAG_CRC) if self.checksum else (0, 0)
            F.FRAME.pack_into(self.mm, o, seq0 + k, need, len(data), ts, crc, flags, codec, 0)
            self.mm[o + F.FRAME_BYTES:o + need] = data + bytes(need - F.FRAME_BYTES - len(data))
        self["W_NEXT_SEQ"] = seq0 + len(items)  # the commit
        self["W_NEXT_POS"] = end
        self["W_PUT_BYTES"] += sum(map(len, items))
        return seq0


# A batch: payload sizes (mostly small, some up to ~3000, odd sizes included),
# one codec, and whether a one-frame batch goes through put() or put_many().
sizes = st.one_of(st.integers(0, 40), st.integers(0, 3000), st.sampled_from([1, 7, 9, 4039, 4040]))
batches = st.tuples(st.lists(sizes, min_size=1, max_size=20), st.integers(0, 7), st.booleans(),
                    st.integers(0, 2**32))


def _fresh(spool_dir, capacity, checksum, on_full="overwrite", **kw):
    path = os.path.join(spool_dir, uuid.uuid4().hex[:8])
    return shmq.Spool.create(path, capacity=capacity, on_full=on_full, checksum=checksum, **kw)


def _drop(*spools):
    for sp in spools:
        path = sp.path
        sp.close()
        shmq.Spool.destroy(path)


def _check_records_match_model(records, model, checksum):
    """The spec-decoded frames are exactly the newest frames written, in order."""
    got = frames_of(records)
    expect = model[len(model) - len(got):] if got else []
    assert len(expect) == len(got)
    for rec, (seq, data, codec) in zip(got, expect):
        _kind, _pos, hseq, stored, length, _ts, crc, flags, hcodec, ext, payload = rec
        assert (hseq, payload, hcodec, length) == (seq, data, codec, len(data))
        assert ext == 0
        if checksum:
            assert flags == F.FLAG_CRC and crc == zlib.crc32(data)
        else:
            assert flags == 0 and crc == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(batches, min_size=1, max_size=14), capacity=st.sampled_from([4096, 8192]),
       checksum=st.booleans())
def test_core_writer_and_spec_writer_agree_byte_for_byte(spool_dir, ops, capacity, checksum):
    """C writer -> spec decoder, spec writer -> C reader, and both writers -> identical rings.

    The same operations go through the core (``put``/``put_many``) on spool
    ``c`` and through :class:`SpecWriter` on spool ``p``; after each one both
    files decode with the spec to the frames written, at the same positions
    with the same headers (timestamps aside) and control words, and the
    core's readers read ``p`` back exactly.
    """
    c = _fresh(spool_dir, capacity, checksum)
    p = _fresh(spool_dir, capacity, checksum)
    spec = SpecWriter(p.path)
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
                    spec.write(data, codec, t0)
                continue
            if len(data) == 1 and single:
                s1 = c.put(data[0], codec=codec)
            else:
                s1 = c.put_many(data, codec=codec)
            t1 = time.time_ns()
            s2 = spec.write(data, codec, t1)
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

            # the core reads the spec writer's frames: anonymous reader, group, Ring.read
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
        spec.close()
        _drop(c, p)


def _ring_bytes(path, lo, hi):
    with open(path, "rb") as f:
        raw = f.read()
    base = F.unpack_geometry(raw[:F.GEOMETRY.size], len(raw), path)["ring_offset"]
    return raw[base + lo:base + hi]


def _deferred(data):
    """``data`` as a Deferred payload: written by fill() into the ring."""
    def fill(view):
        view[:] = data
    return Deferred(len(data), fill)


@pytest.mark.parametrize("writer", ["core", "spec", "deferred", "sync"])
def test_short_tail_has_no_header_and_pads_carry_the_next_seq(spool_dir, writer):
    """The two edge cases of placement, written deterministically by each writer."""
    sp = _fresh(spool_dir, 8192, True, sync=writer == "sync")
    spec = SpecWriter(sp.path) if writer == "spec" else None
    if writer in ("core", "sync"):
        def w(items):
            return sp.put_many(items) if len(items) > 1 else sp.put(items[0])
    elif writer == "deferred":
        def w(items):
            return sp.put_many([_deferred(x) for x in items])
    else:
        def w(items):
            return spec.write(items, F.CODEC_RAW, time.time_ns())

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
        if spec is not None:
            spec.close()
        _drop(sp)


def test_a_caught_up_readers_spin_grows_with_its_last_frame_up_to_a_cap():
    # One rule for the engine's takes and Python's zero-copy reads (reader.py).
    spin = _core.spin_for_frame
    assert spin(0) == pytest.approx(2e-6)
    assert spin(0) < spin(64 << 10) < spin(1 << 20) < spin(5 << 20) < spin(16 << 20) == pytest.approx(1e-3)
    assert spin(5 << 20) == pytest.approx(2e-6 + (5 << 20) / 16e9)  # a 5 MiB frame's: not capped
    assert spin(1 << 62) == pytest.approx(1e-3)
    with pytest.raises(OverflowError):
        spin(-1)


def test_short_tail_cursor_is_read_by_the_core(spool_dir):
    sp = _fresh(spool_dir, 4096, False)
    spec = SpecWriter(sp.path)
    try:
        spec.write([b"a" * 4040], F.CODEC_RAW, 1)
        spec.write([b"next"], F.CODEC_RAW, 2)
        frame, seq, pos, lost, _codec = sp.ring.read(1, 4072)  # a cursor left in the tail
        assert (frame.seq, frame.data, seq, pos, lost) == (1, b"next", 2, 4096 + 40, 0)
        assert sp.ring.read(2, pos)[0] is None  # caught up
    finally:
        spec.close()
        _drop(sp)


# --- every write option writes what a plain put writes ------------------------------

#: How twin B writes a batch that twin A writes with a plain put / put_many.
OPTIONS = ("deferred", "before_commit", "timestamps", "segments", "mixed")
twin_sizes = st.one_of(st.integers(0, 64), st.integers(100, 2500), st.integers(100, 2500),
                       st.sampled_from([1, 7, 1000, 2000, 4039, 4040]))
twin_batch = st.tuples(st.just("batch"), st.lists(twin_sizes, min_size=1, max_size=8),
                       st.integers(0, 7), st.sampled_from(OPTIONS), st.integers(0, 2**32))
twin_ops = st.one_of(twin_batch, twin_batch, twin_batch, twin_batch,
                     st.tuples(st.just("consume"), st.integers(1, 12)),
                     st.tuples(st.just("consume"), st.just(1000)), st.tuples(st.just("pin")))


class Twin:
    """One of the two spools of the differential test, with its named reader and pin."""

    def __init__(self, sp):
        self.sp = sp
        self.reader = sp.reader("r")
        self.pin = None  # (header pos, view) of the frame this handle pins

    def pin_oldest(self, records):
        first = frames_of(records)[0]
        got = self.sp.pins.read(first[2], first[1])
        assert got is not None
        self.pin = (got[2], got[0])
        return first[2]

    def unpin(self):
        pos, view = self.pin
        view.release()
        self.sp.pins.unpin(pos)
        self.pin = None


def _plain_put(a, data, codec, fast):
    if fast:  # the C entry point put_api (block=True, no timeout): never waits on overwrite
        return a.sp.put(data[0], codec=codec) if len(data) == 1 else a.sp.put_many(data, codec=codec)
    if len(data) == 1:
        return a.sp.put(data[0], block=False, codec=codec)
    return a.sp.put_many(data, block=False, codec=codec)


def _option_put(b, data, codec, option, stamps, hooked):
    """The same batch through put_many's options (Writer.append, timeout 0)."""
    kw = {}
    if option == "deferred":
        items = [_deferred(d) for d in data]
    elif option == "segments":
        items = [(d[:len(d) // 3], d[len(d) // 3:]) for d in data]
    elif option == "mixed":
        items = [_deferred(d) if k % 3 == 0 else (d,) if k % 3 == 1 else memoryview(d)
                 for k, d in enumerate(data)]
    else:
        items = list(data)
    if option == "before_commit":
        kw["before_commit"] = lambda seq0, positions: hooked.append((seq0, list(positions)))
    if option == "timestamps":
        kw["timestamps"] = stamps
    return b.sp.writer.append(items, 0, codec, **kw)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(twin_ops, min_size=8, max_size=30),
       policy=st.sampled_from(["overwrite", "block", "error"]),
       growable=st.booleans(), checksum=st.booleans(), sync=st.booleans())
def test_every_write_option_writes_what_plain_puts_write(spool_dir, ops, policy, growable, checksum,
                                                         sync):
    """Twin spools get the same operations: A through plain puts (the core's put_api,
    put and put_many), B through put_many's options (Deferred payloads, before_commit,
    imported timestamps, segment tuples, a mix), on a ``sync=True`` handle or not.
    Both hold a named reader that consumes the same frames, and pin their oldest
    frame over a batch now and then.  After each operation both files decode with the spec to the
    newest frames put, with the same eviction, wrap and (zeroed) padding: the same
    bytes but for the timestamps B imported; a refused batch (Full, TooLarge) is
    refused by both and leaves nothing; block/error never evict an unconsumed frame.
    """
    scale = 12 if growable else 1  # a growable ring spans 2 segments of 64 KiB: bigger frames
    capacity = 8192 if not growable else 64 * 1024
    kw = dict(max_capacity=2 * 64 * 1024) if growable else {}
    a = Twin(_fresh(spool_dir, capacity, checksum, policy, **kw))
    b = Twin(_fresh(spool_dir, capacity, checksum, policy, sync=sync, **kw))
    ring = a.sp.ring.size
    try:
        model = []  # (seq, payload, codec) of every frame put
        imported = {}  # seq -> timestamp B's header must carry
        for op in ops:
            if op[0] == "consume":
                got_a = a.reader.get_many(op[1], block=False) if a.sp.next_seq > a.reader.position else []
                got_b = b.reader.get_many(op[1], block=False) if b.sp.next_seq > b.reader.position else []
                assert [(f.seq, bytes(f.data)) for f in got_a] == [(f.seq, bytes(f.data)) for f in got_b]
                assert [(f.seq, bytes(f.data), f.codec) for f in got_b] == [
                    m for m in model if got_b and got_b[0].seq <= m[0] <= got_b[-1].seq]
                event("consumed")
            elif op[0] == "pin":  # held over the next batch
                records = spec_walk(a.sp.path)[1]
                if a.pin is None and frames_of(records):
                    assert a.pin_oldest(records) == b.pin_oldest(spec_walk(b.sp.path)[1])
                    event("pinned")
            else:
                _k, sizes_, codec, option, seed = op
                data = payloads(seed, [n * scale for n in sizes_])
                stamps = [(seed + k) % (1 << 64) for k in range(len(data))]
                hooked = []
                fast = policy == "overwrite" and a.pin is None and seed % 2 == 0
                try:
                    s1 = _plain_put(a, data, codec, fast)
                except (shmq.Full, shmq.TooLarge) as exc:
                    with pytest.raises(type(exc)):
                        _option_put(b, data, codec, option, stamps, hooked)
                    assert hooked == []
                    event(f"refused: {type(exc).__name__}" + (" (pinned)" if a.pin else ""))
                else:
                    s2 = _option_put(b, data, codec, option, stamps, hooked)
                    assert s1 == s2 == len(model)
                    model += [(s1 + k, d, codec) for k, d in enumerate(data)]
                    if option == "timestamps":
                        imported.update((s1 + k, t) for k, t in enumerate(stamps))
                    if option == "before_commit":
                        placed = [r[1] for r in frames_of(spec_walk(a.sp.path)[1]) if r[2] >= s1]
                        assert hooked == [(s1, placed)]
                    event(f"written: {option}" + (" past a pin" if a.pin else ""))
                if a.pin is not None:
                    a.unpin()
                    b.unpin()
            wa, ra = spec_walk(a.sp.path)
            wb, rb = spec_walk(b.sp.path)
            assert wa == wb
            for kind in {r[0] for r in ra} | ({"evicted"} if wa["W_EVICTED"] else set()):
                event(kind)
            if wa["W_NEXT_POS"] >= ring:  # coverage: every policy wraps, fixed and growable
                event(f"wrapped: {policy}, {'growable' if growable else 'fixed'}")
            assert without_ts(ra) == without_ts(rb)
            _check_records_match_model(ra, model, checksum)
            for r in frames_of(rb):
                if r[2] in imported:
                    assert r[5] == imported[r[2]]
            if policy != "overwrite":  # nothing the reader has not consumed was evicted
                assert wa["W_FIRST_SEQ"] <= a.reader.position
    finally:
        for t in (a, b):
            if t.pin is not None:
                t.unpin()
        _drop(a.sp, b.sp)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=5000), start=st.integers(0, 2**32 - 1))
def test_core_crc32_is_zlib_crc32(data, start):
    assert _core.crc32(data) == zlib.crc32(data)
    assert _core.crc32(data, start) == zlib.crc32(data, start)
    assert _core.crc32(memoryview(data)[1::1]) == zlib.crc32(data[1:])


def test_payloads_copied_at_every_distance_from_their_ring_position_round_trip(make_spool):
    # The engine copies a payload whose ring destination sits 1 to 63 bytes past its
    # source (mod 4096) with a loop of its own (shmq/engine/copy.c), not memcpy: put
    # payloads from sources at each distance 0..80 (and a few far ones), for sizes
    # around the loop's bounds; each must come back exactly, with its CRC.
    np = pytest.importorskip("numpy")
    import ctypes
    sp = make_spool(capacity="1MiB", on_full="block", checksum=True)
    r = sp.reader("r", verify=True)
    from shmq._mapping import read_geometry
    geo = read_geometry(sp.path)
    ring_off, ring_bytes = geo["ring_offset"], geo["ring_bytes"]
    base = ctypes.addressof(ctypes.c_char.from_buffer(sp.mapping.mm))
    ctl = np.frombuffer(sp.mapping.mm, dtype=np.uint64, count=F.W_NEXT_POS + 1)
    source = np.frombuffer(random.Random(3).randbytes(70000 + 8192), dtype=np.uint8)
    src_addr = source.ctypes.data
    try:
        for size in (2047, 2048, 4096 + 13, 65536 + 5):
            need = F.FRAME_BYTES + (size + 7) // 8 * 8
            for k in [*range(81), 1000, 4095]:
                off = int(ctl[F.W_NEXT_POS]) % ring_bytes
                if ring_bytes - off < need:
                    off = 0
                s = (base + ring_off + off + F.FRAME_BYTES - k - src_addr) % 4096
                payload = memoryview(source)[s:s + size]
                seq = sp.put(payload)
                assert (int(ctl[F.W_NEXT_POS]) - need) % ring_bytes == off  # it went where we aimed
                got = r.get(timeout=1)
                assert got.seq == seq and bytes(got.data) == bytes(payload), (size, k)
    finally:
        del ctl
