"""Single-process behaviour of the spool: writing, reading, policies, readers, stats."""

import asyncio
import os
import pickle
import shutil
import stat
import sys
import textwrap

import numpy as np
import pytest

import shmq
from shmq import _format as F
from conftest import bound


def payloads(n, size=100):
    return [i.to_bytes(4, "little") * (size // 4) for i in range(n)]


def test_put_get_roundtrip(make_spool):
    sp = make_spool()
    seqs = [sp.put(p) for p in payloads(10)]
    assert seqs == list(range(10))
    r = sp.reader()
    got = [r.get(timeout=1) for _ in range(10)]
    assert [f.data for f in got] == payloads(10)
    assert [f.seq for f in got] == seqs
    assert all(isinstance(f, shmq.Frame) and f.timestamp_ns > 0 for f in got)
    with pytest.raises(shmq.Empty):
        r.get(block=False)


def test_put_accepts_bytes_like(make_spool):
    sp = make_spool()
    sp.put(bytearray(b"abc"))
    sp.put(memoryview(b"defg"))
    sp.put(np.arange(3, dtype=np.int32))
    sp.put(b"")
    r = sp.reader()
    assert [f.data for f in r.get_many(10)] == [
        b"abc", b"defg", np.arange(3, dtype=np.int32).tobytes(), b""]


def test_put_keeps_no_reference_and_takes_bytes_subclasses(make_spool):
    """An exact bytes object is written from its own storage (no buffer view): the
    reference held during the write is dropped after it, on success and on refusal."""
    class B(bytes):
        pass
    sp = make_spool(capacity=4096, on_full="error")
    x, big = b"payload-" + bytes(range(50)), b"z" * 10000
    before = (sys.getrefcount(x), sys.getrefcount(big))
    for _ in range(5):
        sp.put(x)
        sp.put_many([x, B(b"sub"), (x, b"-", bytearray(b"ba"))])
        with pytest.raises(ValueError):
            sp.put(big)  # larger than the ring
    assert (sys.getrefcount(x), sys.getrefcount(big)) == before
    r = sp.reader(start="earliest")
    assert [f.data for f in r.get_many(4)] == [x, x, b"sub", x + b"-ba"]


@pytest.mark.parametrize("bad", ["text", 12, None, 1.5, [b"a"]])
def test_put_rejects_non_bytes(make_spool, bad):
    sp = make_spool()
    with pytest.raises(TypeError):
        sp.put(bad)
    assert sp.next_seq == 0  # nothing written


def test_put_rejects_non_contiguous(make_spool):
    sp = make_spool()
    with pytest.raises(ValueError, match="contiguous"):
        sp.put(np.arange(10)[::2])


def test_too_large_raised_at_once(make_spool):
    sp = make_spool(capacity=8192, on_full="block")
    with pytest.raises(shmq.TooLarge):
        sp.put(b"x" * 8192)
    with pytest.raises(shmq.TooLarge):
        sp.put_many([b"x" * 3000] * 3)
    sp.put(b"x" * sp.max_frame_bytes)  # the largest frame does fit
    assert sp.next_seq == 1


def test_put_many_is_contiguous_and_returns_first_seq(make_spool):
    sp = make_spool()
    sp.put(b"before")
    first = sp.put_many([b"a", b"b", b"c"])
    assert first == 1
    r = sp.reader()
    assert [f.data for f in r.get_many(10)] == [b"before", b"a", b"b", b"c"]
    with pytest.raises(ValueError):
        sp.put_many([])


def test_wraparound_keeps_every_frame_intact(make_spool):
    sp = make_spool(capacity=4096)
    r = sp.reader("r")
    sizes = [1, 7, 8, 100, 333, 500, 1000, 24, 0, 3000, 17]
    expect = []
    for rnd in range(60):
        for k, n in enumerate(sizes):
            data = bytes([(rnd + k) % 256]) * n
            sp.put(data)
            expect.append(data)
            f = r.get(timeout=1)
            assert f.data == data
    assert r.lost == 0
    assert sp.stats().evicted > 0  # it really wrapped many times


def test_overwrite_loss_counted_exactly(make_spool):
    sp = make_spool(capacity=4096)
    named = sp.reader("slow")
    anon = sp.reader()
    n = 500
    for i in range(n):
        sp.put(i.to_bytes(4, "little") * 10)
    got_named = [int.from_bytes(f.data[:4], "little") for f in named.get_many(n)]
    got_anon = [int.from_bytes(f.data[:4], "little") for f in anon.get_many(n)]
    for got, r in ((got_named, named), (got_anon, anon)):
        assert got == list(range(got[0], n))  # a suffix, in order
        assert r.lost == n - len(got)  # exactly the frames it never saw
        assert r.lost > 0
    assert sp.first_seq == got_named[0]
    assert sp.stats().lost == named.lost


def test_error_policy_raises_full_and_keeps_data(make_spool):
    sp = make_spool(capacity=4096, on_full="error")
    r = sp.reader("r")
    written = 0
    with pytest.raises(shmq.Full):
        for i in range(1000):
            sp.put(bytes(100))
            written += 1
    assert 0 < written < 1000
    assert [f.seq for f in r.get_many(1000)] == list(range(written))
    assert r.lost == 0
    sp.put(bytes(100))  # room again after the reader consumed


def test_block_policy_without_readers_keeps_everything(make_spool):
    sp = make_spool(capacity=4096, on_full="block")
    with pytest.raises(shmq.Full):
        for _ in range(1000):
            sp.put(bytes(100), timeout=0.05)
    r = sp.reader("late")  # a reader created later still sees frame 0
    assert r.get(timeout=1).seq == 0


@pytest.mark.parametrize("group", [False, True])
def test_blocking_put_uses_room_a_stopped_reader_freed(make_spool, group):
    # A blocking put on a full ring waits a moment for consumers to free some
    # headroom before evicting (the core's wait_for_headroom); a consumer that
    # stops after freeing one frame's worth must still let the put through.
    sp = make_spool(capacity="64KiB", on_full="block")
    r = sp.reader("r", group=group)
    with pytest.raises(shmq.Full):
        for _ in range(10_000):
            sp.put(bytes(100), block=False)
    full_at = sp.next_seq
    for _ in range(3):
        assert r.get(timeout=1) is not None  # three frames' worth of room, far less than the headroom
        assert sp.put(b"y" * 100) == full_at  # blocking, no timeout: must not wait for more
        full_at += 1
    with pytest.raises(shmq.Full):
        sp.put(bytes(100), block=False)  # and full again
    frames = r.get_many(10_000)
    assert [f.data for f in frames[-3:]] == [b"y" * 100] * 3 and r.lost == 0


def test_group_get_objects_unpickles_only_when_asked(make_spool):
    # get_objects is shmq.Queue's get_many; on a plain spool (no trust check) a
    # pickled frame must come back as a Frame, not as what unpickling would run.
    import pickle

    sp = make_spool(capacity="64KiB")
    g = sp.reader("g", group=True)
    sp.put(b"raw")
    sp.put(pickle.dumps({"a": 1}), codec=F.CODEC_PICKLE)
    out, undecoded = g.get_objects(10, timeout=1)
    assert out[0] == b"raw" and undecoded == [1]
    assert out[1].codec == F.CODEC_PICKLE and pickle.loads(out[1].data) == {"a": 1}
    sp.put(pickle.dumps({"b": 2}), codec=F.CODEC_PICKLE)
    assert g.get_objects(10, timeout=1, unpickle=True) == [{"b": 2}]


def test_block_policy_nonblocking_put(make_spool):
    sp = make_spool(capacity=4096, on_full="block")
    sp.reader("r")
    with pytest.raises(shmq.Full):
        for _ in range(1000):
            sp.put(bytes(100), block=False)


def test_anonymous_reader_does_not_hold_writers(make_spool):
    sp = make_spool(capacity=4096, on_full="block")
    named = sp.reader("n")
    anon = sp.reader()
    for i in range(300):
        sp.put(bytes(100))
        named.get(timeout=1)
    frames = anon.get_many(1000)
    assert anon.lost + len(frames) == 300
    assert anon.lost > 0


def test_named_reader_resumes_after_reopen(spool_path):
    sp = shmq.Spool.create(spool_path, capacity="64KiB")
    for p in payloads(10):
        sp.put(p)
    r = sp.reader("idx")
    assert [r.get().seq for _ in range(4)] == [0, 1, 2, 3]
    sp.close()
    sp = shmq.Spool.open(spool_path)
    r = sp.reader("idx")
    assert r.position == 4
    assert r.get().seq == 4
    sp.close()


def test_reserve_commits_a_clean_block_and_abandons_a_raising_one(make_spool):
    # Spool.reserve is the core's reserve_api bound per handle (the uncontended case in
    # one C call); each outcome is checked by what a reader sees.
    sp = make_spool(capacity="64KiB")
    r = sp.reader("z")
    assert sp.reserve.__name__ == "reserve_api"
    with sp.reserve(5) as buf:
        buf[:] = b"hello"
    with pytest.raises(KeyError):
        with sp.reserve(3) as buf:
            buf[:] = b"bad"
            raise KeyError("the block failed")
    rv = sp.reserve(4, codec=F.CODEC_UTF8)
    with rv as buf:
        buf[:] = b"text"
    assert rv.seq == 1 and not rv.open
    with pytest.raises(ValueError):
        buf[:1] = b"x"  # the view is released at the commit: nothing writes a published frame
    dropped = sp.reserve(8)  # dropped open: abandoned at once, the writer lock released
    del dropped
    assert sp.put(b"after", timeout=bound(5)) == 2
    got = r.get_many(10, timeout=1)
    assert [(f.seq, bytes(f.data), f.codec) for f in got] == [
        (0, b"hello", F.CODEC_RAW), (1, b"text", F.CODEC_UTF8), (2, b"after", F.CODEC_RAW)]


def test_reserve_refuses_bad_arguments_as_the_slow_path_does(make_spool):
    sp = make_spool(capacity="64KiB", on_full="error")
    for bad, exc in ((True, TypeError), (1.5, TypeError), ("8", TypeError), (-1, ValueError)):
        with pytest.raises(exc):
            sp.reserve(bad)
    with pytest.raises(TypeError):
        sp.reserve(8, F.CODEC_UTF8)  # codec and timeout are keyword-only
    with pytest.raises(TypeError):
        sp.reserve(nbytes=8, size=9)
    with pytest.raises(TypeError):
        sp.reserve()
    with pytest.raises(ValueError):
        sp.reserve(8, timeout=-1)
    with pytest.raises(shmq.TooLarge):
        sp.reserve(1 << 20)
    while True:  # fill the "error" ring: the core's no-room status goes to the slow path
        try:
            sp.put(b"x" * 1000)
        except shmq.Full:
            break
    with pytest.raises(shmq.Full):
        sp.reserve(1000)
    with pytest.raises(shmq.Full):
        sp.reserve(1000, timeout=0.01)
    assert sp.stats().puts == sp.next_seq  # nothing was published by the refusals
    sp.close()
    with pytest.raises(ValueError, match="closed"):
        sp.reserve(8)


def test_threads_reserving_on_one_handle_each_commit_every_frame_once(make_spool):
    # The fast path takes the writer lock in C for up to the first look; a thread that
    # finds another's reservation open waits there or in the slow path's retries.
    import threading

    sp = make_spool(capacity="1MiB")
    r = sp.reader("all")
    per, errors = 500, []

    def produce(t):
        try:
            for k in range(per):
                with sp.reserve(8, timeout=bound(10)) as buf:
                    buf[:] = bytes([t]) + k.to_bytes(7, "little")
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(bound(60))
    assert not errors and not any(t.is_alive() for t in threads)
    seen = {t: [] for t in range(4)}
    for f in r.get_many(4 * per + 1, timeout=1):
        seen[f.data[0]].append(int.from_bytes(f.data[1:], "little"))
    assert all(ks == list(range(per)) for ks in seen.values())


def test_a_subclass_that_overrides_reserve_keeps_its_override(spool_path):
    class Counting(shmq.Spool):
        calls = 0

        def reserve(self, nbytes, **kw):
            Counting.calls += 1
            return super().reserve(nbytes, **kw)

    sp = Counting.create(spool_path, capacity="64KiB")
    try:
        with sp.reserve(2) as buf:
            buf[:] = b"ok"
        assert Counting.calls == 1 and sp.read_at(0).data == b"ok"
    finally:
        sp.close()
        shmq.Spool.destroy(spool_path)


def test_manual_commit(make_spool):
    sp = make_spool()
    for p in payloads(5):
        sp.put(p)
    r = sp.reader("m", auto_commit=False)
    r.get_many(3)
    assert r.position == 3 and r.committed == 0
    r.commit()
    assert r.committed == 3
    r.get()
    r.close()
    r = sp.reader("m", auto_commit=False)
    assert r.get().seq == 3  # uncommitted progress is redelivered


def test_new_named_reader_start_latest(make_spool):
    sp = make_spool()
    for p in payloads(5):
        sp.put(p)
    r = sp.reader("tail", start="latest")
    assert r.position == 5
    sp.put(b"new")
    assert r.get(timeout=1).data == b"new"


def test_second_live_attach_refused(make_spool):
    sp = make_spool()
    r = sp.reader("one")
    with pytest.raises(shmq.ReaderBusy):
        sp.reader("one")
    other = shmq.Spool.open(sp.path)
    with pytest.raises(shmq.ReaderBusy, match="another process"):
        other.reader("one")
    r.close()
    other.reader("one")  # free again after close
    other.close()


def test_reader_kind_mismatch(make_spool):
    sp = make_spool()
    sp.reader("x")
    with pytest.raises(shmq.ShmqError, match="named reader"):
        sp.reader("x", group=True)


@pytest.mark.parametrize("name", ["", "a" * 64, "nul\x00", 5])
def test_invalid_reader_names(make_spool, name):
    sp = make_spool()
    with pytest.raises((ValueError, TypeError)):
        sp.reader(name)


def test_reader_table_full(make_spool):
    sp = make_spool(readers=2)
    sp.reader("a")
    sp.reader("b")
    with pytest.raises(shmq.ShmqError, match="table is full"):
        sp.reader("c")


def test_seek(make_spool):
    sp = make_spool()
    for p in payloads(20):
        sp.put(p)
    r = sp.reader("s")
    r.seek(15)
    assert r.get().seq == 15
    r.seek("earliest")
    assert r.get().seq == 0
    r.seek("latest")
    with pytest.raises(shmq.Empty):
        r.get(block=False)
    with pytest.raises(ValueError):
        r.seek(21)
    with pytest.raises(ValueError):
        r.seek("middle")


def test_seek_to_overwritten_seq(make_spool):
    sp = make_spool(capacity=4096)
    for p in payloads(200):
        sp.put(p)
    with pytest.raises(shmq.FrameLost):
        sp.reader().seek(0)


def test_read_at(make_spool):
    sp = make_spool(capacity=4096)
    for i in range(60):
        sp.put(bytes([i]) * 100)
    assert sp.read_at(59).data == bytes([59]) * 100
    assert sp.read_at(58).data == bytes([58]) * 100
    assert sp.read_at(sp.first_seq).seq == sp.first_seq
    with pytest.raises(shmq.FrameLost):
        sp.read_at(0)
    with pytest.raises(shmq.FrameLost):
        sp.read_at(60)
    with pytest.raises(TypeError):
        sp.read_at("3")


def test_group_members_split_frames(make_spool):
    sp = make_spool()
    a = sp.reader("workers", group=True)
    other = shmq.Spool.open(sp.path)
    b = other.reader("workers", group=True)
    for p in payloads(100):
        sp.put(p)
    seen = []
    for i in range(50):
        seen.append(a.get(timeout=1).seq)
        seen.append(b.get(timeout=1).seq)
    assert sorted(seen) == list(range(100))
    assert a.position == b.position == 100
    other.close()


@pytest.mark.parametrize("group", [False, True])
def test_delay_is_measured_on_every_batch_and_sampled_on_single_gets(make_spool, group):
    # The clock read costs 3-5% of a Queue.get: single gets measure one in 8
    # (at random), takes of several frames measure all of them with one read.
    sp = make_spool(capacity="4MiB")
    r = sp.reader("d", group=group)
    words = sp.slots.words

    def slot(word):
        return words[r.slot * F.SLOT_WORDS + word]

    for p in payloads(400):
        sp.put(p)
    assert len(r.get_many(400)) == 400
    n = 4000
    for p in payloads(n):
        sp.put(p)
    for _ in range(n):
        r.get()
    r.flush_stats()
    (rs,) = sp.stats().readers
    assert rs.gets == 400 + n
    count = slot(F.S_DELAY_COUNT)
    # 400 from the batch, Binomial(4000, 1/8) = 500 +- 21 from the single gets
    assert 400 + 350 < count < 400 + 650, count
    assert rs.avg_delay_ns == slot(F.S_DELAY_SUM_NS) // count
    assert 0 < rs.avg_delay_ns <= rs.max_delay_ns


def test_group_get_many_and_lost(make_spool):
    sp = make_spool(capacity=4096)
    g = sp.reader("g", group=True)
    for p in payloads(300):
        sp.put(p)
    got = g.get_many(1000)
    assert g.lost + len(got) == 300 and g.lost > 0


def test_stats(make_spool):
    sp = make_spool(capacity="64KiB")
    r = sp.reader("stats")
    for p in payloads(10):
        sp.put(p)
    r.get_many(4)
    st = sp.stats()
    assert (st.first_seq, st.next_seq, st.frames, st.puts) == (0, 10, 10, 10)
    assert st.put_bytes == 1000 and st.gets == 4 and st.get_bytes == 400
    assert st.used_bytes == 10 * F.frame_stored_bytes(100)
    assert 0 < st.fill < 1
    assert st.last_put_ns > 0 and st.last_get_ns >= st.last_put_ns
    assert st.max_delay_ns >= st.avg_delay_ns > 0
    assert st.high_water == 10 and st.high_water_frames == 10
    assert sum(n for _s, n in st.write_rate) == 10
    assert sum(n for _s, n in st.read_rate) == 4
    (rs,) = st.readers
    assert (rs.name, rs.kind, rs.position, rs.lag, rs.pid, rs.alive) == (
        "stats", "reader", 4, 6, os.getpid(), True)
    assert rs.lag_bytes == 6 * F.frame_stored_bytes(100)
    assert st.as_dict()["readers"][0]["name"] == "stats"


def test_readers_listing_and_remove(make_spool):
    sp = make_spool()
    r = sp.reader("gone")
    sp.reader("grp", group=True)
    assert {x.name: x.kind for x in sp.readers()} == {"gone": "reader", "grp": "group"}
    with pytest.raises(shmq.ReaderBusy):
        sp.remove_reader("gone")
    r.close()
    assert [x.alive for x in sp.readers() if x.name == "gone"] == [False]
    sp.remove_reader("gone")
    assert [x.name for x in sp.readers()] == ["grp"]
    with pytest.raises(KeyError):
        sp.remove_reader("gone")


def test_removed_reader_releases_block(make_spool):
    sp = make_spool(capacity=4096, on_full="block")
    r = sp.reader("stuck")
    r.close()
    with pytest.raises(shmq.Full):
        for _ in range(100):
            sp.put(bytes(200), block=False)
    sp.remove_reader("stuck")
    sp.reader("fresh", start="latest")
    sp.put(bytes(200), block=False)


def test_iteration_and_timeouts(make_spool):
    sp = make_spool()
    for p in payloads(3):
        sp.put(p)
    r = sp.reader()
    it = iter(r)
    assert [next(it).seq for _ in range(3)] == [0, 1, 2]
    with pytest.raises(shmq.Empty):
        r.get(timeout=0.01)
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError):
            r.get(timeout=bad)
    with pytest.raises(TypeError):
        r.get(timeout="1")
    with pytest.raises(ValueError):
        r.get_many(0)


def test_get_async(make_spool):
    sp = make_spool()
    r = sp.reader()

    async def main():
        task = asyncio.ensure_future(r.get_async(timeout=bound(5)))
        await asyncio.sleep(0)
        sp.put(b"async")
        frame = await task
        with pytest.raises(shmq.Empty):
            await r.get_async(timeout=0.05)
        return frame

    assert asyncio.run(main()).data == b"async"


def test_use_after_close(make_spool):
    sp = make_spool()
    r = sp.reader("x")
    r.close()
    with pytest.raises(ValueError):
        r.get()
    sp.close()
    sp.close()  # idempotent
    with pytest.raises(ValueError):
        sp.put(b"x")
    with pytest.raises(ValueError):
        sp.reader()


def test_pickle_handles(make_spool):
    sp = make_spool()
    sp.put(b"one")
    sp2 = pickle.loads(pickle.dumps(sp))
    assert sp2.path == sp.path and sp2.read_at(0).data == b"one"
    g = sp.reader("g", group=True)
    g2 = pickle.loads(pickle.dumps(g))
    assert g2.get(timeout=1).data == b"one"
    with pytest.raises(shmq.Empty):
        g.get(block=False)  # the group cursor is shared
    sp2.close()


def test_checksum_verify(make_spool):
    sp = make_spool(checksum=True)
    sp.put(b"payload")
    off = sp.ring.base + F.FRAME_BYTES
    sp.mapping.mm[off] ^= 0xFF  # flip a payload bit behind the writer's back
    assert sp.reader().get().data != b"payload"  # default: seq checks only
    with pytest.raises(shmq.SpoolFormatError, match="CRC"):
        sp.reader(verify=True).get()


def test_create_mode_and_preallocation(spool_dir):
    path = os.path.join(spool_dir, "m")
    old = os.umask(0o077)
    try:
        sp = shmq.Spool.create(path, capacity="1MiB", mode=0o660)
    finally:
        os.umask(old)
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o660  # exact, not masked by the umask
    assert st.st_blocks * 512 >= st.st_size  # not sparse
    sp.close()
    sp = shmq.Spool.create(os.path.join(spool_dir, "d"))
    assert stat.S_IMODE(os.stat(sp.path).st_mode) == 0o600
    sp.close()


def test_create_existing(make_spool):
    sp = make_spool()
    with pytest.raises(FileExistsError):
        shmq.Spool.create(sp.path)
    again = shmq.Spool.create(sp.path, exist_ok=True)
    again.close()


@pytest.mark.parametrize("kw,exc", [
    ({"capacity": "lots"}, ValueError), ({"capacity": -1}, ValueError),
    ({"capacity": 1.5}, TypeError), ({"on_full": "drop"}, ValueError),
    ({"mode": "0600"}, ValueError), ({"readers": 0}, ValueError),
])
def test_create_bad_arguments(spool_path, kw, exc):
    with pytest.raises(exc):
        shmq.Spool.create(spool_path, **kw)
    assert not os.path.exists(spool_path)


def test_a_name_too_long_for_its_temporary_name_is_a_clear_error(spool_dir):
    # A spool is created as ".NAME.<12 hex>.creating" and linked to NAME: a NAME of
    # 233..255 bytes is a valid file name but not a creatable spool.  The error names
    # the path given (not the temporary one) and the longest that works; nothing stays.
    import errno

    fits = os.path.join(spool_dir, "f" * 232)
    shmq.Spool.create(fits, capacity="64KiB").close()
    shmq.Spool.destroy(fits)
    for n in (233, 255):
        path = os.path.join(spool_dir, "x" * n)
        with pytest.raises(OSError) as info:
            shmq.Spool.create(path, capacity="64KiB")
        assert info.value.errno == errno.ENAMETOOLONG and info.value.filename == path
        assert f"{n} bytes, at most 232" in info.value.strerror
    assert os.listdir(spool_dir) == []


def test_parse_size():
    assert F.parse_size("64MiB") == 64 << 20
    assert F.parse_size("1 GiB") == 1 << 30
    assert F.parse_size("10kb") == 10000
    assert F.parse_size("4k") == 4096
    assert F.parse_size(100) == 100


def test_bare_name_lives_in_the_private_directory():
    from shmq._mapping import default_dir, resolve_path

    assert default_dir() == f"/dev/shm/shmq-{os.geteuid()}"
    assert resolve_path("jobs") == f"{default_dir()}/jobs"
    assert resolve_path("./jobs") == os.path.abspath("jobs")
    assert resolve_path("/dev/shm/shmq/jobs") == "/dev/shm/shmq/jobs"  # the old shared dir, explicit
    for bad in ("", "..", "a\x00b"):
        with pytest.raises(ValueError):
            resolve_path(bad)
    with pytest.raises(TypeError):
        resolve_path(3)


def test_bare_name_create_and_destroy():
    import stat
    import uuid

    from shmq._mapping import default_dir

    name = f"t-{uuid.uuid4().hex[:10]}"
    d = default_dir()
    had_dir = os.path.isdir(d)
    sp = shmq.Spool.create(name, capacity=4096)
    try:
        assert sp.path == f"{d}/{name}"
        assert os.path.exists(sp.path)
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
        assert stat.S_IMODE(st.st_mode) == 0o700  # private, whatever the umask
    finally:
        sp.close()
        shmq.Spool.destroy(name)
        if not had_dir:
            try:
                os.rmdir(d)  # leave /dev/shm as we found it
            except OSError:
                pass  # another process put a spool there meanwhile
    assert not os.path.exists(f"{d}/{name}")


def test_sync_policy(spool_dir):
    sp = shmq.Spool.create(os.path.join(spool_dir, "durable"), capacity=8192, sync=True)
    for _ in range(10):
        sp.put(b"x" * 700)  # crosses the ring end: msync of two spans
    sp.sync()
    assert sp.reader().get_many(100)[-1].seq == 9
    sp.close()


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace counts the msync calls")
@pytest.mark.parametrize("sync", [False, True])
def test_a_sync_handles_reservations_are_msynced_as_its_puts(spool_dir, sync):
    # sync=True promises every put durable when it returns: a reservation's commit is a
    # put.  Counted from outside (strace): the frame's pages before the commit and the
    # header page after, for reservations through the core's fast path and the slow one.
    import subprocess

    path = os.path.join(spool_dir, "durable")
    shmq.Spool.create(path, capacity=8192).close()
    code = textwrap.dedent(f"""
        import shmq
        sp = shmq.Spool.open({path!r}, sync={sync})
        for n in (700, 300):
            with sp.reserve(n, timeout=0 if n == 300 else None) as buf:  # C; then Python (timeout=0)
                buf[:] = b"r" * n
        assert [bytes(f.data) for f in sp.reader().get_many(5)] == [b"r" * 700, b"r" * 300]
        print("OK")
    """)
    log = os.path.join(spool_dir, "strace.log")
    proc = subprocess.run(["strace", "-f", "-e", "trace=msync", "-o", log, sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=bound(60))
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr
    with open(log) as f:
        calls = [ln for ln in f if "msync(" in ln]
    os.unlink(log)
    assert len(calls) == (4 if sync else 0), calls
    shmq.Spool.destroy(path)


def _names_of(prefix):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"sem.shmq.{prefix}."))


@pytest.mark.parametrize("at", ["w", "r", "f", "core"])
def test_a_spool_destroyed_while_it_is_opened_leaves_no_semaphore(spool_dir, monkeypatch, at):
    """A handle being opened (it creates its semaphores with O_CREAT) while the spool
    is destroyed.  Destroy is stopped between its two steps (the file, the semaphores)
    and the opener's semaphore opens, from ``at`` on, run in that gap.  The opener is
    refused (FileNotFoundError, as if the path had gone) and no name is left behind:
    with the semaphores unlinked first, the opener re-created them and they outlived
    the spool (CI saw a lone ``.f`` left)."""
    import threading

    import shmq._mapping as M
    import shmq.spool as S

    path = os.path.join(spool_dir, "racy")
    shmq.Spool.create(path, capacity=8192).close()
    prefix = M.sem_prefix_of(os.stat(path))
    between, resume = threading.Event(), threading.Event()
    steps, errors = [], []

    def after_step(what):
        steps.append(what)
        if len(steps) == 1:  # destroy's first step is done: let the opener run
            between.set()
            assert resume.wait(bound(10))

    real_unlink, real_unlink_sems = os.unlink, M.unlink_semaphores

    def unlink(p, *a, **kw):
        real_unlink(p, *a, **kw)
        if p == path:
            after_step("file")

    def unlink_sems(*a, **kw):
        real_unlink_sems(*a, **kw)
        after_step("semaphores")

    def destroy():
        try:
            shmq.Spool.destroy(path)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    destroyer = threading.Thread(target=destroy)

    def start_destroy_and_wait():
        destroyer.start()
        assert between.wait(bound(10)), "destroy never reached its second step"

    real_open_sem, real_ring = S.open_semaphore, S._core.Ring

    def open_sem(name, *a, **kw):
        if name.endswith("." + at) and not destroyer.is_alive() and not between.is_set():
            start_destroy_and_wait()
        return real_open_sem(name, *a, **kw)

    def ring(*a, **kw):
        if at == "core":
            start_destroy_and_wait()
        return real_ring(*a, **kw)

    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(M, "unlink_semaphores", unlink_sems)
    monkeypatch.setattr(S, "open_semaphore", open_sem)
    monkeypatch.setattr(S._core, "Ring", ring)
    try:
        with pytest.raises(FileNotFoundError, match="destroyed while being opened"):
            shmq.Spool.open(path)
    finally:
        resume.set()
        destroyer.join(bound(10))
    assert not destroyer.is_alive() and errors == []
    assert steps[0] == "file"  # the file first, its semaphores after
    assert not os.path.exists(path)
    assert _names_of(prefix) == []


def test_a_semaphore_first_opened_on_a_destroyed_spool_does_not_outlive_it(spool_dir, monkeypatch):
    """A group's semaphore is created on the group's first use, a JoinableQueue's
    count when it attaches: when that is after the spool was destroyed (handles keep
    working on the unlinked file), the name is unlinked again at once, and the
    handle keeps working with its semaphore."""
    path = os.path.join(spool_dir, "gone")
    with shmq.Spool.create(path, capacity=8192) as sp:
        sp.put(b"one")
        shmq.Spool.destroy(path)
        assert _names_of(sp.sem_prefix) == []
        r = sp.reader("workers", group=True)
        assert r.get(timeout=bound(5)).data == b"one"
        assert _names_of(sp.sem_prefix) == []
        r.close()

    # A JoinableQueue's count is opened once the spool is: destroyed in between
    qpath = os.path.join(spool_dir, "joinable")
    real_open_sem = shmq.Spool.open_semaphore
    prefixes = []

    def open_sem(self, name, initial):
        prefixes.append(self.sem_prefix)
        if name.endswith(".u") and os.path.exists(qpath):
            shmq.Spool.destroy(qpath)
        return real_open_sem(self, name, initial)

    monkeypatch.setattr(shmq.Spool, "open_semaphore", open_sem)
    q = shmq.JoinableQueue(path=qpath, capacity=8192)
    monkeypatch.undo()
    assert not os.path.exists(qpath)
    assert _names_of(prefixes[0]) == []
    q.put("item")
    assert q.get(timeout=bound(5)) == "item"
    q.task_done()
    q.join()
    assert _names_of(prefixes[0]) == []
    q.close()


def test_a_header_naming_another_spools_prefix_never_unlinks_its_names(spool_dir, monkeypatch):
    """Found destroyed, a handle unlinks only names derived from its own file's inode.
    A file whose header names another spool's prefix (a copy; or a file another user
    planted) is refused when it goes during the open, but the other spool's
    semaphores are kept, the group's too."""
    import shutil

    import shmq.spool as S

    ours = os.path.join(spool_dir, "ours")
    copy = os.path.join(spool_dir, "copy")
    with shmq.Spool.create(ours, capacity=8192) as sp:
        group = sp.reader("workers", group=True)
        names = _names_of(sp.sem_prefix)
        assert len(names) == 4  # w, r, f and the group's g0
        shutil.copyfile(ours, copy)  # the same header, so the same sem_prefix; another inode
        with shmq.Spool.open(copy) as other:
            assert other.sem_prefix == sp.sem_prefix
            os.unlink(copy)
            other.reader("workers", group=True).close()  # opens g0, on a file now gone
        assert _names_of(sp.sem_prefix) == names
        shutil.copyfile(ours, copy)
        real_open_sem = S.open_semaphore

        def open_sem(name, *a, **kw):
            if os.path.exists(copy):
                os.unlink(copy)  # gone while being opened
            return real_open_sem(name, *a, **kw)

        monkeypatch.setattr(S, "open_semaphore", open_sem)
        with pytest.raises(FileNotFoundError, match="destroyed while being opened"):
            shmq.Spool.open(copy)
        monkeypatch.undo()
        assert _names_of(sp.sem_prefix) == names
        sp.put(b"still works")
        assert group.get(timeout=bound(5)).data == b"still works"
        group.close()
