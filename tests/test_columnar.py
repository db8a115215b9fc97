"""numpy frames, zero-copy pinned views (numpy and Arrow), record-stream mode, bad input."""

import multiprocessing as mp
import os
import signal
import threading

import numpy as np
import pytest

import shmq
from conftest import EMULATED, bound, join_all
from shmq.columnar import PinnedView

DTYPES = [np.int8, np.uint16, np.float32, np.complex128, np.bool_, ">f8", "<M8[ns]", "S5", "U3",
          np.dtype([("id", "<i8"), ("v", "<f8"), ("tag", "S4")]),
          np.dtype([("xy", "<f4", (2,)), ("n", ">i4")])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 4), (2, 3, 2)])
def test_array_fidelity(make_spool, dtype, shape):
    sp = make_spool()
    arr = np.zeros(shape, dtype=dtype)
    if arr.size:  # deterministic, non-zero bytes in every field
        raw = (np.arange(arr.nbytes) % 251).astype(np.uint8).tobytes()
        arr = np.frombuffer(raw, dtype=arr.dtype).reshape(shape)
    sp.put_array(arr)
    got = sp.reader().get_array(timeout=1)
    assert got.dtype == arr.dtype and got.shape == arr.shape
    assert got.tobytes() == arr.tobytes()
    assert got.flags.writeable  # one private copy


def test_a_large_copy_gets_a_mapping_of_its_own(make_spool):
    """From 4 MiB a numpy payload is copied into a private mapping aligned to a huge page
    and advised MADV_HUGEPAGE over its whole huge pages, behind a writable memoryview;
    smaller ones stay bytearrays.  A released mapping is kept for the next copy, at most
    256 MiB a process, the rest unmapped."""
    sp = make_spool(capacity="32MiB")
    small = np.arange((4 << 20) // 8 - 64, dtype=np.float64)  # under 4 MiB with its header
    large = np.arange((8 << 20) // 8, dtype=np.float64)  # 8 MiB and a header
    r = sp.reader()
    sp.put_array(small)
    assert type(r.get(timeout=1).data) is bytearray
    sp.put_array(large)
    data = r.get(timeout=1).data
    assert type(data) is memoryview and not data.readonly and type(data.obj) is shmq._core.LargeCopy
    addr = np.frombuffer(data, np.uint8).ctypes.data
    assert addr % (2 << 20) == 0  # its advice: test_a_large_copy_is_asked_to_live_on_huge_pages
    kept = shmq._core.copy_cache()
    del data
    assert _vma_flags(addr) is not None  # kept for the next copy ...
    assert shmq._core.copy_cache()[0] == kept[0] + 1
    sp.put_array(large)
    got = r.get_array(timeout=1)  # ... which writes over it: the new frame's bytes, nothing of the old
    assert np.array_equal(got, large) and got.flags.writeable
    assert shmq._core.copy_cache()[0] == kept[0]
    got[0] = -1.0  # the copy is the caller's own
    assert got[0] == -1.0 and large[0] == 0.0
    del got

    # 40 copies of 8 MiB alive at once, then released: 256 MiB of them kept, the rest unmapped
    copies, addrs = [], []
    for i in range(40):
        sp.put_array(np.full((8 << 20) // 8, float(i)))
        copies.append(r.get_array(timeout=1))
        addrs.append(copies[-1].ctypes.data & ~((2 << 20) - 1))
    assert [float(c[-1]) for c in copies] == [float(i) for i in range(40)]
    del copies
    assert shmq._core.copy_cache()[1] <= 256 << 20
    mapped = sum(_vma_flags(a) is not None for a in addrs)
    assert 0 < mapped <= (256 << 20) // (8 << 20)


def _forked_child_of_large_copies(path, conn, expect):
    """In a forked child: the parent's live copy is there, its kept ones are not, and
    the child's own large copies work."""
    live = _forked_child_of_large_copies.live
    with shmq.Spool.open(path) as sp:
        sp.put_array(np.full((6 << 20) // 8, 3.0))
        r = sp.reader(start=sp.next_seq - 1)
        mine = r.get_array(timeout=bound(5))
        conn.send((float(live[-1]) == expect, shmq._core.copy_cache(), float(mine[0]), mine.flags.writeable))


def test_large_copies_across_fork(make_spool):
    """A forked child inherits the copies in use (as any memory) but not the mappings
    kept for reuse (MADV_DONTFORK: it would share their pages copy-on-write, and the
    parent's next copy into one would fault every page), and starts with none kept."""
    sp = make_spool(capacity="32MiB")
    r = sp.reader()
    sp.put_array(np.full((8 << 20) // 8, 7.0))
    sp.put_array(np.full((8 << 20) // 8, 9.0))
    live = r.get_array(timeout=1)
    released = r.get_array(timeout=1)
    addr = released.ctypes.data & ~((2 << 20) - 1)
    del released
    assert shmq._core.copy_cache()[0] >= 1
    if not EMULATED:  # qemu-user takes madvise's advice without passing it on
        assert "dc" in _vma_flags(addr)  # VM_DONTCOPY
    _forked_child_of_large_copies.live = live
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_forked_child_of_large_copies, args=(sp.path, child, 7.0))
    p.start()
    try:
        assert parent.poll(bound(30)), "the child sent nothing"
        inherited, kept, first, writable = parent.recv()
    finally:
        join_all([p])
    assert p.exitcode == 0
    assert inherited and kept == (0, 0) and first == 3.0 and writable


def test_non_contiguous_is_made_contiguous(make_spool):
    sp = make_spool()
    base = np.arange(100, dtype=np.int64).reshape(10, 10)
    for view in (base[:, 3], base.T, base[::2, ::3]):
        sp.put_array(view)
        assert np.array_equal(sp.reader(start=sp.next_seq - 1).get_array(timeout=1), view)


@pytest.mark.parametrize("bad", [np.array([object(), 1]), [1, 2, 3], b"bytes"])
def test_bad_arrays_refused(make_spool, bad):
    sp = make_spool()
    with pytest.raises(TypeError):
        sp.put_array(bad)
    assert sp.next_seq == 0


def test_wrong_codec(make_spool):
    sp = make_spool()
    sp.put(b"not an array")
    with pytest.raises(shmq.ShmqError, match="raw frame, not numpy"):
        sp.reader().get_array(timeout=1)


def test_record_stream_mode(make_spool):
    sp = make_spool(capacity="1MiB")
    dt = np.dtype([("id", "<i8"), ("value", "<f8"), ("name", "S84")])  # 100-byte records
    recs = np.zeros(5000, dtype=dt)
    recs["id"] = np.arange(5000)
    first = sp.put_many(recs)  # whole records, in frames of at most a quarter ring
    frames = sp.next_seq - first
    assert frames == -(-recs.nbytes // (sp.capacity // 4))
    sp.put_many(np.arange(3, dtype=np.int32))  # another dtype: a separate run
    r = sp.reader()
    got = r.get_many(1000, as_array=True, timeout=1)
    assert got.dtype == dt and np.array_equal(got["id"], np.arange(5000))
    assert np.array_equal(r.get_many(10, as_array=True, timeout=1), np.arange(3, dtype=np.int32))


def test_pinned_view_blocks_overwrite_until_released(make_spool):
    sp = make_spool(capacity=64 * 1024, on_full="overwrite")
    big = np.arange(4096, dtype=np.float64)  # 32 KiB: half the ring
    sp.put_array(big)
    r = sp.reader()
    view = r.get_array(copy=False)
    assert not view.array.flags.writeable
    assert np.shares_memory(view.array, np.frombuffer(sp.mapping.view, dtype=np.uint8))  # truly zero-copy
    with pytest.raises(shmq.Full):  # even in overwrite mode, the pinned frame is kept
        for _ in range(4):
            sp.put(bytes(20000), timeout=0.1)
    assert np.array_equal(view.array, big)
    view.release()
    sp.put(bytes(20000), timeout=1)
    sp.put(bytes(20000), timeout=1)  # now it may be overwritten


def _view_while_the_writer_lock_is_held(sp, r):
    """r.get_array(copy=False) in a thread while this thread holds the writer lock:
    (the view, or None if it did not return while the lock was held)."""
    got, done = [], threading.Event()

    def view():
        got.append(r.get_array(copy=False, timeout=bound(10)))
        done.set()

    t = threading.Thread(target=view)
    with sp.writer_lock:
        t.start()
        in_time = done.wait(0.5)
    t.join(bound(10))
    assert got, "the view did not come"
    return got[0] if in_time else None


@pytest.mark.parametrize("on_full", ["block", "error"])
def test_a_named_readers_view_pins_without_the_writer_lock_and_still_protects(make_spool, on_full):
    # The named cursor, published, holds the frame until the reader moves it
    # on, after the pin: no lock is needed, and the frame is kept all the same.
    sp = make_spool(capacity=64 * 1024, on_full=on_full)
    r = sp.reader("n")
    sp.put_array(np.arange(10))
    r.get_array(copy=False).release()  # the handle's pin slot is taken (under the lock) once
    big = np.arange(4096, dtype=np.float64)  # 32 KiB: half the ring
    sp.put_array(big)
    view = _view_while_the_writer_lock_is_held(sp, r)
    assert view is not None, "the named reader's view waited for the writer lock"
    assert sp.pins.held and r.committed == 2  # pinned, and the cursor moved past it
    with pytest.raises(shmq.Full):
        for _ in range(4):
            sp.put(bytes(20000), timeout=0.1)
    assert np.array_equal(view.array, big)
    view.release()
    r.get_many(10, timeout=0)  # what went in before Full: the reader's, not the pin's, to keep
    for _ in range(3):
        sp.put(bytes(20000), timeout=1)
        assert len(r.get(timeout=1).data) == 20000


def _put_numbered_frames(path, n):
    sp = shmq.Spool.open(path)
    for i in range(n):
        sp.put_array(np.full(8192, i, dtype=np.int64), timeout=bound(30))  # 64 KiB
    sp.close()


def test_lock_free_pins_hold_under_a_writer_that_wants_the_room(make_spool):
    # A producer process fills a ring of 4 frames as fast as it can while the
    # named reader keeps its last two views alive: every frame is wanted by the
    # writer while it is viewed, after the cursor moved past it.  A view that
    # a write overwrote would show another frame's number.
    n = 1500 if not EMULATED else 300
    sp = make_spool(capacity=4 * 65600, on_full="block")
    r = sp.reader("n")
    p = mp.get_context("fork").Process(target=_put_numbered_frames, args=(sp.path, n))
    p.start()
    try:
        kept = []
        for i in range(n):
            v = r.get_array(copy=False, timeout=bound(30))
            assert v.array[0] == i and v.array[-1] == i
            kept.append((i, v))
            if len(kept) > 2:
                j, old = kept.pop(0)
                assert (old.array == j).all(), f"frame {j} changed while viewed"
                old.release()
        for j, old in kept:
            assert (old.array == j).all()
            old.release()
    finally:
        p.join(bound(30))
    assert p.exitcode == 0


@pytest.mark.parametrize("case", ["overwrite", "seek back without commit", "anonymous"])
def test_a_view_the_cursor_does_not_hold_is_pinned_under_the_writer_lock(make_spool, case):
    # An overwrite ring evicts what named cursors have not read; a seek back
    # without a commit leaves the published position ahead of the frame; an
    # anonymous cursor holds nothing.  These pin under the writer lock.
    sp = make_spool(capacity=64 * 1024, on_full="overwrite" if case == "overwrite" else "block")
    r = sp.reader() if case == "anonymous" else sp.reader("n", auto_commit=case != "seek back without commit")
    sp.put_array(np.arange(10))
    sp.put_array(np.arange(10))
    r.get_array(copy=False).release()  # the handle's pin slot is taken (under the lock) once
    if case == "seek back without commit":
        r.get_array()
        r.commit()
        r.seek(1)
        assert r.committed == 2 and r.cursor()[0] == 1
    view = _view_while_the_writer_lock_is_held(sp, r)
    assert view is None, "the view was pinned while another thread held the writer lock"


def test_pinned_view_context_manager_and_group(make_spool):
    sp = make_spool(capacity="1MiB")
    g = sp.reader("g", group=True)
    sp.put_array(np.ones(1000))
    sp.put_array(np.zeros(10))
    with g.get_array(copy=False) as v:
        assert v.array.sum() == 1000 and v.seq == 0
        assert sp.pins.held
    assert not sp.pins.held
    assert np.array_equal(g.get_array(), np.zeros(10))


@pytest.mark.parametrize("kind", ["anonymous", "named"])
def test_a_frame_committed_while_a_caught_up_reader_looks_is_pinned_not_copied(make_spool,
                                                                                monkeypatch, kind):
    """``get_array(copy=False)`` of a reader that has caught up with the writer: a frame
    committed between its look at NEXT_SEQ and its read came back copied, a plain
    ndarray, and ``with r.get_array(copy=False) as v`` failed (CI, test_memory's
    zero-copy run).  It is now read pinned, on the next look."""
    from shmq.ring import Ring

    sp = make_spool()
    r = sp.reader() if kind == "anonymous" else sp.reader("r")
    real = Ring.next_seq.fget
    looks = []

    def next_seq(ring):
        seq = real(ring)
        looks.append(seq)
        if len(looks) == 1:  # the reader's first look: nothing yet, then a commit
            sp.put_array(np.arange(5))
        return seq

    monkeypatch.setattr(Ring, "next_seq", property(next_seq))
    with r.get_array(copy=False, timeout=bound(5)) as v:
        assert isinstance(v, PinnedView) and v.seq == 0
        assert np.array_equal(v.array, np.arange(5)) and not v.array.flags.writeable
        assert sp.pins.held
    assert looks[0] == 0 and not sp.pins.held


def test_a_lapped_readers_zero_copy_read_is_a_view_all_the_same(make_spool):
    """A reader lapped in overwrite mode: the frame at its cursor is gone, so the next
    one comes from the core's get (which counts the loss), copied.  ``copy=False``
    still returns a :class:`shmq.PinnedView` (over that copy, nothing pinned), so the
    caller's ``with`` holds."""
    sp = make_spool(capacity=64 * 1024, on_full="overwrite")
    r = sp.reader()
    for i in range(40):
        sp.put_array(np.full(1000, i, dtype=np.int64))  # 8 KB each: the ring wraps
    with r.get_array(copy=False, timeout=bound(5)) as v:
        assert isinstance(v, PinnedView) and v.seq > 0
        assert np.array_equal(v.array, np.full(1000, v.seq, dtype=np.int64))
        assert not sp.pins.held
    assert r.lost == v.seq
    with r.get_array(copy=False, timeout=bound(5)) as w:  # the next one is there: pinned
        assert w.seq == v.seq + 1 and sp.pins.held
    assert not sp.pins.held


def _pin_and_die(path, ready):
    sp = shmq.Spool.open(path)
    r = sp.reader()
    v = r.get_array(copy=False)  # noqa: F841 (held until death)
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)


def test_crashed_readers_pin_is_released(make_spool):
    sp = make_spool(capacity=64 * 1024, on_full="overwrite")
    sp.put_array(np.arange(4096, dtype=np.float64))
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_pin_and_die, args=(sp.path, ready))
    p.start()
    assert ready.wait(bound(30))
    join_all([p])
    for _ in range(6):  # the dead process's pin does not hold the writer
        sp.put(bytes(20000), timeout=bound(5))


def test_an_unaligned_array_round_trips(make_spool):
    sp = make_spool()
    raw = np.arange(8 * 5 + 1, dtype=np.uint8)
    arr = raw[1:].view("<i8")  # C-contiguous, not aligned
    assert arr.flags.c_contiguous and not arr.flags.aligned
    sp.put_array(arr)
    got = sp.reader().get_array(timeout=1)
    assert got.dtype == arr.dtype and got.tobytes() == arr.tobytes()


def test_queue_carries_arrays_out_of_band():
    q = shmq.Queue()
    try:
        a = np.arange(1 << 16, dtype=np.int32)
        q.put(a)
        b = q.get(timeout=1)
        assert np.array_equal(a, b) and b.flags.writeable
    finally:
        q.close()


def test_release_while_arrow_arrays_are_still_referenced(make_spool):
    pa = pytest.importorskip("pyarrow")
    sp = make_spool()
    sp.put_arrow(pa.table({"x": [1, 2, 3]}))
    view = sp.reader().get_arrow(copy=False, timeout=1)
    kept = view.batch["x"]  # a column that still points into the spool
    view.release()  # must not raise BufferError; the pin is gone
    assert not sp.pins.held and len(kept) == 3


def test_unpin_from_another_thread_cannot_unprotect_a_new_pin(make_spool, monkeypatch):
    """A view's finalizer may release its pin in any thread (``Service(copy=False)``):
    a release that has computed the new floor must not overwrite it after another
    thread's pin, or the new pin's frame is unprotected.  The release is held inside
    its word store until the other thread's pin has had its chance to run."""
    import threading

    sp = make_spool(capacity="1MiB")
    r = sp.reader()
    sp.put(b"a" * 1000)
    sp.put(b"b" * 1000)
    old = r.take(False, 1)  # pinned: (seq, view, codec, pos)
    slots, pins = sp.slots, sp.pins
    inside, pinned = threading.Event(), threading.Event()
    real = slots.set_word

    def slow_set_word(i, word, value):
        if threading.current_thread().name == "releaser":
            inside.set()
            pinned.wait(0.5)  # with the lock, the pin waits for us: this times out
        real(i, word, value)

    monkeypatch.setattr(slots, "set_word", slow_set_word)
    t = threading.Thread(target=pins.unpin, args=(old[3],), name="releaser")
    t.start()
    assert inside.wait(bound(10))
    new = r.take(False, 1)
    pinned.set()
    t.join(bound(10))
    monkeypatch.undo()
    assert pins.held == {new[3]: 1}
    assert slots.word(pins.slot, shmq._format.S_POS) == new[3]  # the new frame is protected
    pins.unpin(new[3])


def _vma_flags(addr):
    """The VmFlags of the mapping of this process holding ``addr`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    return None


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") or EMULATED,
                    reason="no transparent huge pages (or an emulator's own madvise)")
@pytest.mark.parametrize("how", ["get_array", "queue"])
def test_a_large_copy_is_asked_to_live_on_huge_pages(make_spool, how):
    # shmq/core/frame.c: copies of 4 MiB or more (arrays, out-of-band buffers) get a
    # mapping of their own advised MADV_HUGEPAGE before they are written, as numpy
    # advises its own arrays: on 4 KiB pages every fresh 8 MiB copy cost 2,048 faults.
    a = np.arange(1 << 20, dtype=np.float64)  # 8 MiB
    if how == "get_array":
        sp = make_spool(capacity="32MiB")
        r = sp.reader("r")
        sp.put_array(a)
        got = r.get_array(timeout=bound(10))
        r.close()
    else:
        q = shmq.Queue(capacity="32MiB")
        try:
            q.put(a)
            got = q.get(timeout=bound(10))
        finally:
            q.close()
    assert np.array_equal(got, a) and got.flags.writeable
    middle = got.ctypes.data + (got.nbytes // 2 & ~((2 << 20) - 1))
    assert "hg" in (_vma_flags(middle) or []), "the copy's pages were not advised huge"
