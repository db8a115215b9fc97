"""Reader memory: a reader's RSS stays bounded whatever it has read.

Every tmpfs page a process touches stays in its RSS while mapped; the compiled
core drops the pages behind a reader's cursor (MADV_DONTNEED on the shared
mapping, which never discards the data itself).  Measured in fresh child
processes from /proc/self/status, the writer's growth is checked too, to show
the measurement sees mapped pages at all.
"""

import mmap
import os
import types

import numpy as np
import pytest

import shmq

from conftest import bound, join_all

MiB = 1 << 20
FRAME = 64 * 1024


def _rss_shmem():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssShmem in /proc/self/status")


def _stamp(buf, seq):
    buf[:8] = buf[-8:] = seq.to_bytes(8, "little")
    return buf


def _writer(path, total, conn, arrays=False):
    sp = shmq.Spool.open(path)
    before = _rss_shmem()
    buf = bytearray(FRAME)
    for seq in range(total // FRAME):
        if arrays:
            sp.put_array(np.frombuffer(_stamp(buf, seq), dtype=np.uint8), timeout=bound(60))
        else:
            sp.put(_stamp(buf, seq), timeout=bound(60))
    conn.send(_rss_shmem() - before)
    sp.close()


def _pinned_arrays(r):
    # zero-copy reads: the cursor is moved from Python, past a pinned view
    with r.get_array(copy=False, timeout=bound(60)) as v:
        yield types.SimpleNamespace(data=v.array.tobytes())


def _reader(path, name, group, total, conn, arrays=False, lead=0):
    sp = shmq.Spool.open(path)
    r = sp.reader(name, group=group)
    before = peak = _rss_shmem()
    # Start reading once the writer is `lead` bytes ahead (it then strides
    # through the ring instead of reusing the hot region at its start).
    assert sp.data_bell.wait(lambda: sp.ring.next_seq * FRAME >= lead, bound(60)), "the writer did not lead"
    got = bad = nbytes = 0
    while nbytes < total:
        for f in (_pinned_arrays(r) if arrays else r.get_many(64, timeout=bound(60))):
            seq = int.from_bytes(f.data[:8], "little")
            bad += seq != got or f.data[-8:] != f.data[:8] or len(f.data) != FRAME
            got += 1
            nbytes += len(f.data)
        peak = max(peak, _rss_shmem())
    conn.send((nbytes, bad, peak - before))
    r.close()
    sp.close()


def _run(ctx, path, ring, total, group=False, arrays=False, lead=0):
    shmq.Spool.create(path, capacity=ring, on_full="block").reader("r", group=group).close()
    wr, ww = ctx.Pipe(duplex=False)
    rr, rw = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_reader, args=(path, "r", group, total, rw, arrays, lead)),
             ctx.Process(target=_writer, args=(path, total, ww, arrays))]
    for p in procs:
        p.start()
    try:
        assert rr.poll(bound(120)) and wr.poll(bound(120)), "reader or writer did not finish"
        res = rr.recv(), wr.recv()
    finally:
        assert join_all(procs, 60) == [0, 0]
        shmq.Spool.destroy(path)
    return res


def test_reading_1gib_through_a_1gib_spool_keeps_reader_rss_under_64mib(spool_dir):
    # The size, in spawned children only (a fresh interpreter: nothing
    # inherited is mapped, so RssShmem growth is the reader's own).
    import multiprocessing as mp

    (nbytes, bad, reader_growth), writer_growth = _run(
        mp.get_context("spawn"), os.path.join(spool_dir, "big"), "1GiB", 1024 * MiB)
    assert nbytes == 1024 * MiB and bad == 0
    assert writer_growth > 512 * MiB  # the measurement sees mapped pages: the writer keeps its
    assert reader_growth < 64 * MiB, f"reader RSS grew {reader_growth / MiB:.0f} MiB"


@pytest.mark.parametrize("group", [False, True], ids=["named", "group"])
def test_reader_rss_stays_bounded_on_a_smaller_ring(spool_dir, ctx, group):
    # 192 MiB through a 96 MiB ring: it wraps, and the bound holds across the wrap.
    (nbytes, bad, reader_growth), writer_growth = _run(
        ctx, os.path.join(spool_dir, "mid"), "96MiB", 192 * MiB, group=group)
    assert nbytes == 192 * MiB and bad == 0
    # the last 32 MiB behind the cursor stay mapped (KEEP_BEHIND); without the
    # release it would be the whole 96 MiB
    assert reader_growth < 48 * MiB, f"reader RSS grew {reader_growth / MiB:.0f} MiB"


def test_a_ring_of_64_mib_or_less_stays_mapped(spool_dir, ctx):
    # KEEP_WHOLE: releasing a lap behind the reader of a ring this small would
    # refault every page each lap; its RSS is bounded by the ring anyway.  The
    # reader starts 56 MiB behind, so that the writer goes through the whole
    # ring (a reader keeping up would hold it to the hot region's 8 MiB).
    (nbytes, bad, reader_growth), _ = _run(
        ctx, os.path.join(spool_dir, "small"), "64MiB", 128 * MiB, lead=56 * MiB)
    assert nbytes == 128 * MiB and bad == 0
    assert 48 * MiB < reader_growth < 72 * MiB, f"reader RSS grew {reader_growth / MiB:.0f} MiB"


def test_zero_copy_array_reads_release_too(spool_dir, ctx):
    # get_array(copy=False) reads outside the core and moves the cursor from
    # Python (Cursor.pos): the release happens there as well.
    (nbytes, bad, reader_growth), _ = _run(
        ctx, os.path.join(spool_dir, "arr"), "96MiB", 192 * MiB, arrays=True)
    assert nbytes == 192 * MiB and bad == 0
    # the last 32 MiB behind the cursor stay mapped (KEEP_BEHIND); without the
    # release it would be the whole 96 MiB
    assert reader_growth < 48 * MiB, f"reader RSS grew {reader_growth / MiB:.0f} MiB"


def test_pinned_view_stays_valid_after_its_pages_are_released(make_spool):
    # A zero-copy view taken before the reader moves chunks ahead still reads its
    # data: releasing drops page-table entries only, and the page faults back in.
    sp = make_spool(capacity="96MiB", on_full="block")  # larger than KEEP_WHOLE: released
    r = sp.reader("pin")
    first = np.arange(FRAME // 8, dtype=np.int64)
    sp.put_array(first)
    view = r.get_array(copy=False)
    filler = bytes(FRAME)
    for _ in range(52 * MiB // FRAME):  # the 32 MiB kept mapped and > 4 release chunks more
        sp.put(filler)
        r.get(timeout=bound(5))
    try:
        assert np.array_equal(view.array, first)
    finally:
        view.release()
    r.close()


def test_madv_dontneed_on_a_shared_tmpfs_mapping_drops_only_this_mappings_pages(spool_dir):
    # The kernel behaviour the core relies on (madvise(2): on shared file and
    # shmem mappings a later access repopulates "from the up-to-date contents of
    # the underlying mapped file", and the caller's RSS drops at once), checked
    # here on this kernel: two MAP_SHARED views of one /dev/shm file stand for a
    # reader and the writer.
    size = 16 * MiB
    path = os.path.join(spool_dir, "raw")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        reader, writer = mmap.mmap(fd, size), mmap.mmap(fd, size)
        data = np.frombuffer(writer, dtype=np.uint8)
        data[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)  # dirty, never written back anywhere
        want = data.copy()
        assert reader[:] == want.tobytes()  # the reader has touched (mapped) every page too
        before = _rss_shmem()
        reader.madvise(mmap.MADV_DONTNEED)
        dropped = before - _rss_shmem()
        assert dropped >= size * 3 // 4, f"RssShmem fell by {dropped / MiB:.1f} MiB only"
        assert np.array_equal(data, want)  # the other mapping keeps its pages and data
        assert os.pread(fd, size, 0) == want.tobytes()  # the file keeps its data
        data[:4] = 7  # a write through the other mapping after the release ...
        assert reader[:4] == bytes([7] * 4) and reader[:] == data.tobytes()  # ... is seen: still shared
        del data
        reader.close()
        writer.close()
    finally:
        os.close(fd)
        os.unlink(path)


def test_reserve_buffer_stays_valid_while_a_reader_in_the_process_releases_its_pages(make_spool):
    # Behind the reader's cursor, in ring offsets, is where the writer writes
    # next: a reservation held there while the same process's reader moves on
    # has its pages released under it (one mapping serves both).  Its bytes,
    # written before and after the release, must all arrive.
    sp = make_spool(capacity="96MiB", on_full="block")  # larger than KEEP_WHOLE: released
    ring = sp.ring.size
    r = sp.reader("mine")
    filler = bytes(FRAME)
    n = 0
    try:
        while True:  # fill the ring: the next frame no longer fits before its end
            sp.put(filler, block=False)
            n += 1
    except shmq.Full:
        pass
    for _ in range(40):  # room for one more frame, which wraps to offset 0
        r.get(timeout=bound(5))
    want = np.random.default_rng(7).integers(0, 256, FRAME, dtype=np.uint8).tobytes()
    with sp.reserve(FRAME, timeout=bound(5)) as buf:
        buf[: FRAME // 2] = want[: FRAME // 2]
        for _ in range(n - 40):  # ~90 MiB read: the chunks from offset 0 on are released
            r.get(block=False)
        buf[FRAME // 2:] = want[FRAME // 2:]  # written after the release: faults back in
    assert ring <= sp.ring.next_pos - FRAME < ring + 4096  # it did sit in the first released chunk
    got = r.get(timeout=bound(5))
    assert got.seq == n and got.data == want
    r.close()
