"""shmq.dump: records with codec tags, export/import of the portable dump, and its errors.

The CLI's ``export``/``import`` commands are tested in test_cli.py; this file
tests the layer itself, including every damaged dump we can construct.
"""

import io
import os
import struct
import zlib

import pytest

import shmq
from shmq import _format as F
from shmq import dump as D
from conftest import bound, join_all

PAYLOADS = [(b"raw", F.CODEC_RAW), (b'{"a": 1}', F.CODEC_JSON), (b"\x80\x05K\x01.", F.CODEC_PICKLE),
            (b"", F.CODEC_RAW), (b"x" * 5000, F.CODEC_UTF8)]


@pytest.fixture
def source(make_spool):
    sp = make_spool(capacity="256KiB", name="src")
    for data, codec in PAYLOADS:
        sp.put(data, codec=codec)
    return sp


def _export(sp, spool_dir, name="d.shmqdump"):
    dest = os.path.join(spool_dir, name)
    summary = D.export_spool(sp.path, dest)
    return dest, summary


def _records(sp):
    return [(r.seq, r.timestamp_ns, r.codec, r.data) for r in D.iter_records(sp)]


# --- reading records -----------------------------------------------------------------------


def test_iter_records_carries_codecs_and_stops(source):
    recs = list(D.iter_records(source))
    assert [(r.data, r.codec) for r in recs] == PAYLOADS
    assert [r.seq for r in recs] == list(range(len(PAYLOADS)))
    assert all(r.flags is not None and not r.flags & F.FLAG_PAD for r in recs)
    assert [r.seq for r in D.iter_records(source, 1, 3)] == [1, 2]
    assert list(D.iter_records(source, "latest")) == []


def test_iter_records_follow_times_out(source):
    assert len(list(D.iter_records(source, follow=True, timeout=0.05))) == len(PAYLOADS)


def test_iter_records_counts_overwritten_frames(make_spool):
    sp = make_spool(capacity="4KiB")
    for i in range(200):
        sp.put(b"%03d" % i + b"." * 60)
    with pytest.raises(shmq.FrameLost):
        list(D.iter_records(sp, 0))
    info = {}
    recs = list(D.iter_records(sp, 0, info=info, clamp=True))
    assert recs[0].seq == sp.first_seq and recs[-1].seq == 199
    assert info["lost"] == sp.first_seq  # the frames below the oldest one


def test_record_at(source):
    r = D.record_at(source, 1)
    assert (r.seq, r.data, r.codec) == (1, b'{"a": 1}', F.CODEC_JSON)
    with pytest.raises(shmq.FrameLost):
        D.record_at(source, 99)


# --- round trip ----------------------------------------------------------------------------


def test_export_import_round_trip(source, spool_dir):
    named = source.reader("indexer")
    named.get()
    named.get()
    named.commit()
    named.close()
    source.reader("workers", group=True).close()
    dest, summary = _export(source, spool_dir)
    assert summary["frames"] == len(PAYLOADS) and summary["lost"] == 0
    assert summary["bytes"] == sum(len(d) for d, _ in PAYLOADS)
    assert os.stat(dest).st_mode & 0o777 == 0o600
    target = os.path.join(spool_dir, "copy")
    res = D.import_dump(dest, target)
    assert res["frames"] == len(PAYLOADS) and not res["appended"]
    with shmq.Spool.open(target) as sp:
        assert _records(sp) == _records(source)  # seqs, timestamps, codecs, bytes
        assert (sp.capacity, sp.on_full) == (source.capacity, source.on_full)
        pos = {r.name: (r.kind, r.position) for r in sp.readers()}
        assert pos == {"indexer": ("reader", 2), "workers": ("group", 0)}
    shmq.Spool.destroy(target)


def test_import_new_timestamps_and_append(source, spool_dir, make_spool):
    dest, _ = _export(source, spool_dir)
    old = [r.timestamp_ns for r in D.iter_records(source)]
    target = make_spool(name="target")
    target.put(b"already here")
    target.reader("indexer").close()  # exists: kept as it is
    res = D.import_dump(dest, target.path, append=True, keep_timestamps=False)
    assert res["appended"] and res["first_seq"] == 1 and res["next_seq"] == 1 + len(PAYLOADS)
    recs = list(D.iter_records(target))
    assert [r.data for r in recs[1:]] == [d for d, _ in PAYLOADS]
    assert all(r.timestamp_ns > max(old) for r in recs[1:])


def test_export_never_overwrites(source, spool_dir):
    dest = os.path.join(spool_dir, "exists")
    with open(dest, "wb") as f:
        f.write(b"precious")
    with pytest.raises(FileExistsError):
        D.export_spool(source.path, dest)
    with open(dest, "rb") as f:
        assert f.read() == b"precious"


def test_import_refuses_an_existing_spool(source, spool_dir):
    dest, _ = _export(source, spool_dir)
    with pytest.raises(FileExistsError):
        D.import_dump(dest, source.path)
    assert len(_records(source)) == len(PAYLOADS)


def test_import_into_a_full_spool_says_what_to_do(make_spool, spool_dir):
    big = make_spool(capacity="256KiB", name="big")
    for _ in range(40):
        big.put(b"z" * 4000)
    dest, _ = _export(big, spool_dir)
    with pytest.raises(shmq.Full, match="larger --capacity or --on-full overwrite"):
        D.import_dump(dest, os.path.join(spool_dir, "small"), capacity="64KiB", on_full="error",
                      timeout=0)
    assert not os.path.lexists(os.path.join(spool_dir, "small"))  # a failed import leaves nothing


def test_progress_is_drawn_when_enabled(source, spool_dir):
    out = io.StringIO()
    D.export_spool(source.path, os.path.join(spool_dir, "p"), progress=True, progress_stream=out)
    assert out.getvalue().startswith("\rexporting ") and f"{len(PAYLOADS)}/{len(PAYLOADS)} frames" \
        in out.getvalue() and out.getvalue().endswith("\n")


# --- damaged dumps -------------------------------------------------------------------------


def _dump_bytes(source, spool_dir):
    dest, _ = _export(source, spool_dir)
    with open(dest, "rb") as f:
        return f.read()


def _header_end(raw):
    _m, _v, hlen = struct.unpack_from("<8sII", raw)
    return 16 + hlen


def _load_bytes(raw, spool_dir):
    src = os.path.join(spool_dir, "damaged")
    with open(src, "wb") as f:
        f.write(raw)
    return D.import_dump(src, os.path.join(spool_dir, "out"))


def _damage(raw, what):
    h = _header_end(raw)
    rec = struct.calcsize("<QQIIHB")
    if what == "bad magic":
        return b"NOTADUMP" + raw[8:]
    if what == "newer version":
        return raw[:8] + struct.pack("<I", D.DUMP_VERSION + 1) + raw[12:]
    if what == "implausible header length":
        return raw[:12] + struct.pack("<I", 65 << 20) + raw[16:]
    if what == "header not json":
        return raw[:16] + b"{" * (h - 16) + raw[h:]
    if what == "header wrong format":
        body = b'{"format": "other"}'
        return raw[:12] + struct.pack("<I", len(body)) + body + raw[h:]
    if what == "truncated header":
        return raw[:h - 3]
    if what == "payload checksum":
        b = bytearray(raw)
        b[h + 1 + rec] ^= 0xFF  # first byte of the first payload
        return bytes(b)
    if what == "trailer count":
        b = bytearray(raw)
        struct.pack_into("<Q", b, len(raw) - 24, 99)
        return bytes(b)
    if what == "no trailer":
        return raw[:-25]
    if what == "truncated record":
        return raw[:h + 1 + rec - 2]
    if what == "unknown tag":
        return raw[:h] + b"X" + raw[h + 1:]
    raise AssertionError(what)


DAMAGE = {
    "bad magic": "not a shmq dump",
    "newer version": "newer than this shmq supports",
    "implausible header length": "implausible",
    "header not json": "header is damaged",
    "header wrong format": "header is damaged",
    "truncated header": "truncated .in the header",
    "payload checksum": "frame 0 fails its checksum",
    "trailer count": "the trailer counts 99 frames",
    "no trailer": "truncated after 5 frames",
    "truncated record": "truncated .in the record after 0 frames",
    "unknown tag": "unknown record tag b'X'",
}


@pytest.mark.parametrize("what", sorted(DAMAGE))
def test_damaged_dumps_are_refused(source, spool_dir, what):
    raw = _damage(_dump_bytes(source, spool_dir), what)
    with pytest.raises(D.DumpError, match=DAMAGE[what]):
        _load_bytes(raw, spool_dir)
    # whatever import created before it met the damage holds only good frames, never
    # a damaged one (import streams: frames before the damage are already in)
    out = os.path.join(spool_dir, "out")
    if os.path.exists(out):
        with shmq.Spool.open(out) as sp:
            assert all((r.data, r.codec) in PAYLOADS for r in D.iter_records(sp))
        shmq.Spool.destroy(out)


def test_dump_error_is_a_value_error_and_picklable():
    import pickle

    e = pickle.loads(pickle.dumps(D.DumpError("x")))
    assert isinstance(e, ValueError) and isinstance(e, shmq.ShmqError) and str(e) == "x"


def test_crc_of_every_record_is_checked(source, spool_dir):
    raw = _dump_bytes(source, spool_dir)
    h, rec = _header_end(raw), struct.calcsize("<QQIIHB")
    off, seen = h, 0
    while raw[off:off + 1] == b"F":
        _s, _t, length, crc, _f, _c = struct.unpack_from("<QQIIHB", raw, off + 1)
        assert crc == zlib.crc32(raw[off + 1 + rec:off + 1 + rec + length])
        off += 1 + rec + length
        seen += 1
    assert seen == len(PAYLOADS) and raw[off:off + 1] == b"E"


# --- export under a live writer ------------------------------------------------------------


def _writer(path, started, stop, n):
    sp = shmq.Spool.open(path)
    try:
        for i in range(n):
            sp.put(b"%06d" % i + b"w" * 200)
            if i == 50:
                started.set()
            if stop.is_set():
                break
    finally:
        started.set()
        sp.close()


def test_export_while_a_process_overwrites(ctx, make_spool, spool_dir):
    sp = make_spool(capacity="16KiB", name="live")
    for i in range(60):
        sp.put(b"%06d" % i + b"s" * 200)
    started, stop = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_writer, args=(sp.path, started, stop, 5000))
    p.start()
    try:
        assert started.wait(bound(60))
        dest, summary = _export(sp, spool_dir)
    finally:
        stop.set()
        assert join_all([p]) == [0]
    # every frame in the export range was either exported or counted lost, never torn
    assert summary["frames"] + summary["lost"] == summary["next_seq"] - summary["first_seq"]
    res = D.import_dump(dest, os.path.join(spool_dir, "copy"), capacity="1MiB")
    with shmq.Spool.open(os.path.join(spool_dir, "copy")) as cp:
        datas = [r.data for r in D.iter_records(cp)]
    shmq.Spool.destroy(os.path.join(spool_dir, "copy"))
    assert res["frames"] == summary["frames"] == len(datas)
    assert res["source_lost"] == summary["lost"]
    assert all(len(d) == 206 and d[6:7] in (b"s", b"w") for d in datas)


def test_export_counts_frames_evicted_before_its_reader_exists(make_spool, spool_dir, monkeypatch):
    """Regression: export read first_seq, then a live writer evicted frames before the
    export's reader was created; those frames were neither exported nor counted lost."""
    sp = make_spool(capacity="8KiB", name="evicting")
    for i in range(20):
        sp.put(b"%06d" % i + b"a" * 200)
    real_reader = shmq.Spool.reader
    done = []

    def reader_after_a_burst(self, *a, **kw):
        if not done:  # another writer runs between `first = sp.first_seq` and the reader
            done.append(True)
            for i in range(15):
                sp.put(b"%06d" % (100 + i) + b"b" * 200)
        return real_reader(self, *a, **kw)

    monkeypatch.setattr(shmq.Spool, "reader", reader_after_a_burst)
    dest, summary = _export(sp, spool_dir)
    assert done and summary["lost"] > 0
    assert summary["frames"] + summary["lost"] == summary["next_seq"] - summary["first_seq"]
    with open(dest, "rb") as f:
        D.read_dump_header(f)
        gen = D.iter_dump(f)
        try:
            while True:
                next(gen)
        except StopIteration as stop:
            assert stop.value[2] == summary["lost"]  # the trailer says the same


def test_a_growable_spool_round_trips_as_growable(make_spool, spool_dir):
    src = make_spool(capacity="64KiB", max_capacity="64MiB", on_full="block", name="grows")
    g = src.reader("g", group=True)
    src.put_many([bytes([i % 251]) * 3000 for i in range(3000)])  # ~9 MB: it grew
    g.get_many(1000)
    g.close()
    dest = os.path.join(spool_dir, "grows.shmqdump")
    D.export_spool(src.path, dest)
    target = os.path.join(spool_dir, "copy")
    D.import_dump(dest, target)
    with shmq.Spool.open(target) as sp:
        assert sp.growable and sp.capacity == src.capacity  # the same ceiling
        assert _records(sp) == _records(src)
        assert sp.allocated < src.capacity // 4  # not the ceiling's worth of /dev/shm
        assert {r.name: r.position for r in sp.readers()} == {"g": 1000}
    shmq.Spool.destroy(target)
