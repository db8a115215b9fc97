"""Growable spools and queues: small at first, growing with the backlog, shrinking
once it is consumed, with readers following exactly (docs/guide.md, "Growable spools").

A growable ring is a sparse file: only ring offsets below W_ALLOC have pages
(the writer's hot zone).  What the tests measure is the file's real
size (``Spool.allocated``, from st_blocks), the frames every kind of reader
gets, and the errors at the ceiling and on a full filesystem.  The small-tmpfs
tests run in a private mount namespace with its own 64 MiB /dev/shm (root only).
"""

import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import shmq
from shmq import _format as F
from shmq.verify import verify

from conftest import bound, join_all

MiB = 1 << 20
SEG = 1 * MiB  # the segment of a 1 MiB start


def _drain(reader, into):
    while True:
        try:
            f = reader.get(block=False)
        except shmq.Empty:
            return
        into.append(f)


def _frame(seq):
    return seq.to_bytes(8, "little") * 25  # 200 bytes naming their own seq


def _check_exact(frames, first, last):
    seqs = [f.seq for f in frames]
    assert seqs == list(range(first, last)), (seqs[:3], seqs[-3:], first, last)
    assert all(f.data == _frame(f.seq) for f in frames)


def test_a_growable_spool_starts_with_its_capacity_allocated(make_spool):
    sp = make_spool(capacity="1MiB", max_capacity="256MiB", on_full="block")
    assert sp.growable and sp.capacity == 256 * MiB
    head = sp.ring.base
    assert sp.allocated <= head + SEG + 64 * 1024
    assert os.fstat(sp.mapping.fd).st_size == head + 256 * MiB  # sparse: the ceiling's size
    st = sp.stats()
    assert st.growable and st.allocated == sp.allocated and st.growths == 0
    fixed = make_spool(capacity="4MiB", on_full="block")
    assert not fixed.growable and fixed.allocated >= fixed.ring.base + 4 * MiB
    assert fixed.trim() == 0


def test_max_capacity_below_capacity_is_refused(spool_dir):
    with pytest.raises(ValueError, match="max_capacity"):
        shmq.Spool.create(os.path.join(spool_dir, "s"), capacity="2MiB", max_capacity="1MiB")
    assert os.listdir(spool_dir) == []


def test_grows_and_shrinks_back_with_every_kind_of_reader_following(make_spool):
    """Bursts grow the spool to several segments; once consumed it shrinks back.
    A named reader, a group and an anonymous reader see every frame, in order."""
    sp = make_spool(capacity="1MiB", max_capacity="64MiB", on_full="block")
    named, group = sp.reader("named"), sp.reader("grp", group=True)
    anon = sp.reader()
    got = {"named": [], "group": [], "anon": []}
    seq = 0
    for burst in (20_000, 60_000, 5_000, 90_000):
        for _ in range(burst):
            sp.put(_frame(seq))
            seq += 1
        grown = sp.allocated
        assert grown > (burst * 232) // 2  # the backlog is in the file ...
        _drain(anon, got["anon"])  # the anonymous reader first: nothing is evicted under it
        _drain(named, got["named"])
        _drain(group, got["group"])
        assert sp.trim(5.0) > 0 or burst * 232 < 4 * SEG
        assert sp.allocated <= sp.ring.base + 4 * SEG  # ... and gone once consumed
        assert sp.allocated < grown or burst * 232 < 4 * SEG
    for frames in got.values():
        _check_exact(frames, 0, seq)
    assert named.lost == group.lost == anon.lost == 0
    st = sp.stats()
    assert st.growths >= 10 and st.evicted <= seq
    report = verify(sp.path)
    assert report.ok, report.problems
    assert any("growable" in n for n in report.notes)


def test_a_reader_left_idle_gives_back_what_was_consumed_but_not_between_frames(make_spool):
    """A reader that finds nothing to read for TRIM_IDLE_S trims the spool down to
    its start allocation and the writer's segment; one whose wait is shorter (a
    consumer faster than its producer, caught up between frames) never does:
    each trim takes the writer lock and frees pages the writer needs again."""
    from shmq.reader import TRIM_IDLE_S

    sp = make_spool(capacity="1MiB", max_capacity="64MiB", on_full="block")
    r = sp.reader("r")
    got = []
    for seq in range(40_000):  # 8 MiB of backlog: eight segments and more
        sp.put(_frame(seq))
    grown = sp.allocated
    assert grown > sp.ring.base + 6 * SEG
    _drain(r, got)
    with pytest.raises(shmq.Empty):
        r.get(timeout=TRIM_IDLE_S / 2)  # a short wait: nothing given back
    assert sp.allocated == grown
    with pytest.raises(shmq.Empty):
        r.get(timeout=TRIM_IDLE_S * 5)  # idle long enough: trimmed
    assert sp.allocated <= sp.ring.base + 2 * SEG + 64 * 1024  # start allocation + writer's segment
    for seq in range(40_000, 45_000):  # the writer goes on where it was, then wraps into kept pages
        sp.put(_frame(seq))
    _drain(r, got)
    _check_exact(got, 0, 45_000)
    assert r.lost == 0 and verify(sp.path).ok


BIG = 512 * 1024  # half a segment: a new segment every other put


@pytest.mark.parametrize("reads", [True, False], ids=["consumer-catches-up", "consumer-stalls"])
def test_a_consumer_finishing_the_last_batch_is_waited_for_instead_of_growing(make_spool, reads):
    """When a consumer is still copying the batch just committed as the writer
    enters a fresh segment, the writer waits (briefly) for it and wraps early
    instead of allocating.  The hook runs right before that wait: a consumer
    that finishes there keeps the zone at its first segments; one that never
    does costs a bounded wait, then growth as before."""
    sp = make_spool(capacity="1MiB", max_capacity="64MiB", on_full="block")
    r = sp.reader("r")
    waits = []

    def hook(where, _sp):
        if where == "catching-up":
            waits.append(sp.next_seq)
            if reads:
                r.get(timeout=0)  # the in-flight batch: now everything is consumed

    shmq.spool.set_crash_hook(hook)
    try:
        for i in range(200):  # 100 MiB through a spool that starts at 1 MiB
            sp.put(bytes([i % 256]) * BIG, timeout=bound(5))
            while r.position < i:  # the consumer keeps up, but for the frame just put
                assert r.get(timeout=0).data[0] == r.position - 1 & 255
    finally:
        shmq.spool.set_crash_hook(None)
    assert len(waits) >= 50  # one per segment entered while the consumer was one frame behind
    if reads:
        assert sp.allocated <= sp.ring.base + 4 * SEG and sp.stats().growths <= 4
    else:  # never caught up at the moment the writer looked: it climbed to the ceiling
        assert sp.allocated == sp.ring.base + 64 * SEG and sp.stats().growths >= 60
    r.get_many(10, timeout=0)
    assert r.position == sp.next_seq == 200 and r.lost == 0
    assert verify(sp.path).ok


@pytest.mark.parametrize("lag", [0, 2 * MiB])
def test_a_writer_that_bounds_its_lead_wraps_early_with_its_reader_behind(make_spool, lag):
    """``Ring.wrap_lag`` (the pools' request ring): a writer that stays at most that many
    bytes ahead of its consumer wraps early with the consumer behind, and its laps reuse
    the same pages; without it (0) a consumer that is never caught up makes the ring climb
    into fresh segments to its ceiling.  Either way the consumer reads every frame, and
    a consumer that stops makes a put find the ring full (before the ceiling, with
    wrap_lag: its writer then retries after replies): nothing unread is evicted, and puts
    go on once it reads."""
    sp = make_spool(capacity="1MiB", max_capacity="64MiB", on_full="block")
    sp.core.wrap_lag = lag
    r = sp.reader("r")
    size, got = 64 * 1024, []

    def frame(i):
        return i.to_bytes(8, "little") * (size // 8)

    def check(frames):
        for f in frames:
            assert f.seq == len(got) and f.data == frame(f.seq)
            got.append(f.seq)

    ring, lagged_wraps, was = sp.ring.size, 0, 0
    for i in range(1600):  # 100 MiB through a ring that starts at 1 MiB
        sp.put(frame(i), timeout=0)
        at = sp.ring.ctl[F.W_NEXT_POS] % ring
        lagged_wraps += at < was and r.position < i  # wrapped, with frames unread behind
        was = at
        while sp.next_seq - r.position > 24:  # the lead: 24 frames, 1.5 MiB
            check([r.get(timeout=0)])
    if lag:
        assert lagged_wraps >= 20
        assert sp.stats().growths <= 4 and sp.allocated <= sp.ring.base + 8 * SEG
    else:
        assert lagged_wraps <= 1 and sp.stats().growths >= 60  # (1: at the ceiling, 64 MiB)
    n = 1600
    if lag:  # the consumer stops right after a wrap: the next lap meets its unread frames
        while not (sp.ring.ctl[F.W_NEXT_POS] % ring < was and r.position < n - 1):
            was = sp.ring.ctl[F.W_NEXT_POS] % ring
            sp.put(frame(n), timeout=0)
            n += 1
            while sp.next_seq - r.position > 24:
                check([r.get(timeout=0)])
        with pytest.raises(shmq.Full):
            for _ in range(64):  # the zone is a few segments: one lap at most
                sp.put(frame(n), timeout=0)
                n += 1
        assert sp.allocated <= sp.ring.base + 8 * SEG  # full before the ceiling, not grown
    check(r.get_many(10_000, timeout=0))
    sp.put(frame(n), timeout=0)  # room again
    check([r.get(timeout=0)])
    assert len(got) == n + 1 and r.lost == 0
    assert verify(sp.path).ok


def test_block_policy_never_evicts_what_a_named_reader_has_not_read(make_spool):
    sp = make_spool(capacity="1MiB", max_capacity="8MiB", on_full="block")
    slow, fast = sp.reader("slow"), sp.reader("fast")
    frames = []
    seq = 0
    with pytest.raises(shmq.Full):
        while True:
            sp.put(_frame(seq), timeout=0)
            seq += 1
            if seq % 1000 == 0:
                _drain(fast, [])
    assert seq > 8 * MiB // 232 - 100  # it grew to the ceiling before refusing
    _drain(slow, frames)
    _check_exact(frames, 0, seq)


def test_overwrite_policy_grows_to_the_ceiling_then_counts_loss_exactly(make_spool):
    sp = make_spool(capacity="256KiB", max_capacity="4MiB", on_full="overwrite")
    anon, named = sp.reader(), sp.reader("n")
    n = 60_000  # ~14 MiB: the ring wraps several times
    for seq in range(n):
        sp.put(_frame(seq))
    assert sp.allocated >= 4 * MiB  # overwrite keeps the whole ceiling: anonymous readers may read it
    for r in (anon, named):
        frames = []
        _drain(r, frames)
        first = frames[0].seq
        _check_exact(frames, first, n)
        assert r.lost == first > 0


def test_a_pinned_view_survives_growth_and_release(make_spool):
    """A zero-copy view pins its frame: the segment under it is never released."""
    sp = make_spool(capacity="256KiB", max_capacity="16MiB", on_full="block")
    r = sp.reader("r", group=True)
    sp.put_array(np.full(12_500, 7, dtype=np.int64))  # 100,000 bytes
    with r.get_array(copy=False) as view:
        seqs = []
        for seq in range(40_000):  # grows through many segments while the view is held
            sp.put(_frame(seq))
            if seq % 500 == 0:
                _drain(r, seqs)
        sp.trim(5.0)
        arr = view.array
        assert int(arr.min()) == int(arr.max()) == 7 and len(arr) == 12_500
        del arr
    _drain(r, seqs)
    assert [f.seq for f in seqs] == list(range(1, 40_001))
    sp.trim(5.0)
    assert sp.allocated <= sp.ring.base + 8 * (256 << 10)  # released once the view is


def test_a_reservation_grows_the_spool(make_spool):
    sp = make_spool(capacity="256KiB", max_capacity="64MiB", on_full="block")
    r = sp.reader("r")
    with sp.reserve(20 * MiB) as buf:
        buf[:4] = b"head"
        buf[-4:] = b"tail"
    assert sp.allocated > 20 * MiB
    f = r.get()
    assert f.data[:4] == b"head" and f.data[-4:] == b"tail" and len(f.data) == 20 * MiB


def _grow_writer(path, n, ready):
    sp = shmq.Spool.open(path)
    ready.wait(bound(30))
    for seq in range(n):
        sp.put(_frame(seq), timeout=bound(30))
    sp.close()


def test_a_writer_in_another_process_grows_it_while_readers_follow(spool_path, ctx):
    sp = shmq.Spool.create(spool_path, capacity="256KiB", max_capacity="32MiB", on_full="block")
    group = sp.reader("g", group=True)
    ready = ctx.Event()
    n = 50_000
    p = ctx.Process(target=_grow_writer, args=(spool_path, n, ready))
    p.start()
    frames = []
    try:
        ready.set()
        while len(frames) < n:
            if len(frames) < n // 2 and sp.next_seq < n // 2:
                continue  # let the backlog build first: the spool must grow
            frames.append(group.get(timeout=bound(30)))
        join_all([p])
        assert p.exitcode == 0
        _check_exact(frames, 0, n)
        assert sp.stats().growths > 0
    finally:
        if p.is_alive():
            p.kill()
        sp.close()


def test_corrupt_allocation_words_are_reported_and_harmless(make_spool):
    """W_ALLOC is a bound, never trusted for safety: the writer allocates each segment
    it enters whatever the word says.  fsck reports a damaged one."""
    sp = make_spool(capacity="256KiB", max_capacity="4MiB", on_full="block")
    r = sp.reader("r")
    sp.put(b"ok")
    ctl = sp.ring.ctl
    ctl[F.W_ALLOC] = ctl[F.W_ALLOC] + 1  # not whole segments
    report = verify(sp.path)
    assert not report.ok and any("allocated zone top" in p for p in report.problems)
    ctl[F.W_ALLOC] = 0  # claims nothing is allocated: the writer still allocates what it enters
    for seq in range(1, 3000):
        sp.put(_frame(seq))
    got = [r.get()]
    _drain(r, got)
    assert got[0].data == b"ok" and [f.seq for f in got] == list(range(3000))
    assert all(f.data == _frame(f.seq) for f in got[1:])
    assert verify(sp.path).ok


def test_queue_defaults_start_at_one_mib_and_never_block_put(spool_dir):
    q = shmq.Queue()
    try:
        sp = q._spool
        assert sp.growable and sp.allocated <= sp.ring.base + 1 * MiB + 64 * 1024
        for i in range(40_000):  # mp.Queue takes all of these before any consumer
            q.put_nowait(b"k" * 1000)
        assert sp.allocated > 40 * MiB
        assert [len(q.get(timeout=bound(5))) for _ in range(40_000)] == [1000] * 40_000
    finally:
        q.close()


def test_a_queue_full_to_its_ceiling_raises_full_at_once():
    q = shmq.Queue(max_capacity="2MiB")
    try:
        t0 = time.monotonic()
        with pytest.raises(shmq.Full, match=r"ceiling of 2097152 bytes.*max_capacity"):
            for _ in range(10_000):
                q.put(b"c" * 1000)  # block=True, timeout=None: never blocks forever
        assert time.monotonic() - t0 < 30
        assert q.get(timeout=bound(5)) == b"c" * 1000  # nothing lost
    finally:
        q.close()


def test_a_bounded_queue_still_blocks_at_maxsize():
    q = shmq.Queue(3)
    try:
        for i in range(3):
            q.put(i)
        with pytest.raises(shmq.Full, match="still full"):
            q.put(3, timeout=0.05)
        assert q.get(timeout=bound(5)) == 0
    finally:
        q.close()


# --- a 64 MiB /dev/shm of our own (Docker's default size) --------------------


def _private_tmpfs_available():
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


needs_private_tmpfs = pytest.mark.skipif(not _private_tmpfs_available(),
                                         reason="needs root and unshare -m for a private tmpfs")


def _in_small_shm(script, timeout=bound(240)):
    """Run ``script`` with a private 64 MiB tmpfs on /dev/shm; return its stdout lines."""
    code = textwrap.dedent(script)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" -c "$1"', sys.executable, code],
        capture_output=True, text=True, timeout=timeout, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.split("\n")


@needs_private_tmpfs
def test_in_a_64_mib_dev_shm_twenty_queues_and_a_100k_backlog():
    out = _in_small_shm("""
        import shmq
        queues = [shmq.Queue() for _ in range(20)]
        q = queues[0]
        for i in range(100_000):  # before any consumer starts
            q.put({"i": i, "pad": b"p" * 150})
        for i in range(100_000):
            assert q.get(timeout=10)["i"] == i
        print("ok", q._spool.allocated)
        for x in queues:
            x.close()
    """)
    assert out[0].startswith("ok")


@needs_private_tmpfs
def test_in_a_64_mib_dev_shm_the_ceiling_and_a_full_filesystem_are_clear_errors():
    out = _in_small_shm("""
        import errno, time, shmq
        q = shmq.Queue()  # default ceiling: half of 64 MiB
        assert q._spool.capacity == 32 << 20, q._spool.capacity
        t0 = time.monotonic()
        try:
            while True:
                q.put(b"c" * 10_000)
        except shmq.Full as e:
            assert "ceiling" in str(e) and "max_capacity" in str(e)
            print("full", round(time.monotonic() - t0, 1))
        other = shmq.Queue()
        try:  # the first queue holds ~32 MiB: a second one hits the filesystem's end
            while True:
                other.put(b"d" * 10_000)
        except OSError as e:
            assert e.errno == errno.ENOSPC and "/dev/shm" in str(e) and "64.0 MiB" in str(e), e
            print("enospc")
        n = 0
        while True:  # nothing was lost on either error
            try:
                other.get(timeout=0.5)
            except shmq.Empty:
                break
            n += 1
        print("kept", n)
        q.close(); other.close()
    """)
    assert out[0].startswith("full") and out[1] == "enospc" and int(out[2].split()[1]) > 100


def test_a_growable_spool_on_a_disk_path_spills_and_survives_reopening(tmp_path):
    """Spill to disk: the same growable ring on a disk filesystem, with sync."""
    path = str(tmp_path / "spill")
    sp = shmq.Spool.create(path, capacity="256KiB", max_capacity="256MiB", on_full="block",
                           sync=True)
    try:
        r = sp.reader("c", group=True)
        sp.put_many([_frame(s) for s in range(20_000)])  # ~4.6 MB: grows on disk
        assert sp.allocated > 4 * MiB
        sp.sync()
        sp.close()
        with shmq.Spool.open(path) as again:  # durable: everything is there after reopening
            frames = again.reader("c", group=True).get_many(20_000)
            _check_exact(frames, 0, 20_000)
            again.trim(5.0)
            assert again.allocated < 2 * MiB  # and the disk space came back
    finally:
        shmq.Spool.destroy(path)


def test_fixed_and_growable_spools_are_both_this_format_version(make_spool):
    fixed = make_spool(capacity="64KiB")
    grows = make_spool(capacity="64KiB", max_capacity="1MiB")
    assert fixed.geometry["version"] == grows.geometry["version"] == F.FORMAT_VERSION == 4
    assert not fixed.ring.ctl[F.W_SEGMENT] and grows.ring.ctl[F.W_SEGMENT]


@pytest.mark.parametrize("segment", [(1 << 16) + 8, 1 << 20])  # not whole pages; past the ring
def test_a_segment_word_that_cannot_be_right_is_refused(make_spool, segment):
    sp = make_spool(capacity="64KiB")
    path = sp.path
    sp.ring.ctl[F.W_SEGMENT] = segment
    with pytest.raises(shmq.SpoolFormatError, match="SEGMENT"):
        shmq.Spool.open(path)


def _wchan(tid):
    try:
        with open(f"/proc/self/task/{tid}/wchan") as f:
            return f.read()
    except OSError:
        return ""


def test_closing_a_handle_while_another_thread_waits_in_it_fails_that_thread_cleanly(make_spool):
    """close() from one thread while another is inside the core with the GIL released
    (waiting for the writer lock, or allocating a segment) is deferred: the waiter
    gets ValueError, the lock is not left held, nothing touches an unmapped file."""
    import threading

    owner = make_spool(capacity="64KiB", max_capacity="64MiB", on_full="block", name="shared")
    other = shmq.Spool.open(owner.path)
    result = {}
    rv = owner.reserve(16)  # holds the writer lock
    rv.__enter__()[:] = b"r" * 16

    def put():
        try:
            result["seq"] = other.put(b"x" * 100, timeout=bound(10))
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            result["error"] = e

    t = threading.Thread(target=put)
    t.start()
    deadline = time.monotonic() + bound(10)
    while "futex" not in _wchan(t.native_id) and time.monotonic() < deadline:
        time.sleep(0.001)  # poll until the thread sleeps in sem_clockwait (no fixed delay)
    other.close()  # while it waits, GIL released, for the lock we hold
    rv.__exit__(None, None, None)  # commit: the waiter wakes up on a closed handle
    t.join(bound(10))
    assert not t.is_alive()
    assert isinstance(result.get("error"), ValueError), result
    t0 = time.monotonic()
    assert owner.put(b"after", timeout=bound(5)) == 1  # the lock was given back, not left held
    assert time.monotonic() - t0 < 1
    assert verify(owner.path).ok


def test_closing_a_handle_during_segment_allocation_never_crashes(spool_dir):
    """Many rounds of a thread writing 1 MiB frames into a growable spool (each
    allocating a segment with the GIL released) while the main thread closes the
    handle: every put either succeeds or raises ValueError; the process survives."""
    script = textwrap.dedent(f"""
        import os, threading, shmq
        path = os.path.join({spool_dir!r}, "race")
        outcomes = set()
        for i in range(150):
            sp = shmq.Spool.create(path, capacity="64KiB", max_capacity="64MiB",
                                   on_full="overwrite")
            started = threading.Event()
            def writer():
                started.set()
                try:
                    for _ in range(40):
                        sp.put(b"w" * (1 << 20))
                    outcomes.add("done")
                except ValueError as e:
                    outcomes.add("closed")
            t = threading.Thread(target=writer)
            t.start()
            started.wait({bound(10)})
            sp.close()
            t.join({bound(30)})
            assert not t.is_alive()
            shmq.Spool.destroy(path)
        print(sorted(outcomes))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=bound(240), env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert res.returncode == 0, res.stdout + res.stderr  # a crash would be a signal here
    assert "closed" in res.stdout, res.stdout


def test_closing_the_spool_while_a_thread_waits_for_its_group_lock(make_spool):
    import threading

    import posix_ipc

    from shmq._mapping import group_sem_name

    sp = make_spool(capacity="64KiB", on_full="block", name="grouped")
    r = sp.reader("g", group=True)
    sp.put(b"one")
    slot = next(x.slot for x in sp.readers() if x.name == "g")
    held = posix_ipc.Semaphore(group_sem_name(sp.sem_prefix, slot))
    held.acquire()  # as if another member were inside a take
    result = {}

    def take():
        try:
            result["frame"] = r.get(timeout=bound(10))
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            result["error"] = e

    t = threading.Thread(target=take)
    t.start()
    deadline = time.monotonic() + bound(10)
    while "futex" not in _wchan(t.native_id) and time.monotonic() < deadline:
        time.sleep(0.001)  # poll until it sleeps on the group lock (no fixed delay)
    sp.close()  # closes the reader and the handle while the thread waits
    held.release()
    held.close()
    t.join(bound(10))
    assert not t.is_alive()
    assert isinstance(result.get("error"), ValueError), result
    with shmq.Spool.open(sp.path) as again:  # the group lock was given back
        assert again.reader("g", group=True).get(timeout=bound(5)).data == b"one"


def _bounded_producer(q, tag, n, errors):
    try:
        for i in range(n):
            q.put((tag, i), timeout=bound(30))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        errors.put(repr(e))


def test_a_bounded_queue_at_maxsize_waits_and_never_mistakes_it_for_the_ceiling(ctx):
    """maxsize items waiting is decided under the writer lock and waits; only a ring
    full in bytes is the ceiling.  (A consumer taking items between the core's answer
    and a re-check in Python once made a blocking put raise Full.)"""
    q = shmq.Queue(20)
    errors = ctx.Queue()
    n = 20_000
    procs = [ctx.Process(target=_bounded_producer, args=(q, t, n, errors)) for t in range(2)]
    try:
        for p in procs:
            p.start()
        got = [q.get(timeout=bound(30)) for _ in range(2 * n)]
        join_all(procs)
        assert errors.empty(), errors.get()
        assert sorted(got) == sorted((t, i) for t in range(2) for i in range(n))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        q.close()
