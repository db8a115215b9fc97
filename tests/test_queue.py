"""shmq.Queue beyond the stdlib tests: batches, numpy, async, handles, lifetime, kills, bad input."""

import asyncio
import concurrent.futures
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import shmq
from conftest import bound, join_all


def _queue_files():
    return {n for n in os.listdir("/dev/shm") if n.startswith("shmq-q-")}


@pytest.fixture
def q():
    queue = shmq.Queue()
    yield queue
    queue.close()


def test_fifo_and_types(q):
    items = [1, "two", {"three": 3}, [4.0], None, b"six", (7,)]
    for it in items:
        q.put(it)
    assert [q.get(timeout=1) for _ in items] == items
    assert q.empty() and q.qsize() == 0


def test_put_many_get_many(q):
    q.put_many(range(250))
    got = []
    while len(got) < 250:
        got += q.get_many(100, timeout=1)
    assert got == list(range(250))
    with pytest.raises(shmq.Empty):
        q.get_many(10, block=False)
    with pytest.raises(ValueError):
        q.get_many(0)


def test_batches_of_every_kind_of_item_round_trip(q):
    """put_many encodes a batch with one buffer list (an array's out-of-band
    buffers must not leak into the next item); get_many decodes raw and pickled
    frames in one core call and falls back to Python for the rest."""
    a, b = np.arange(1000, dtype=np.int64), np.full(7, 2.5)
    batches = [
        [{"k": i} for i in range(50)],                     # all pickles: one atomic frame run
        [b"raw-%d" % i for i in range(20)],                # all bytes
        [{"x": 1}, a, "s", b, b"r", (a, b), None],         # mixed: item by item
        [a, b],                                           # all out-of-band
    ]
    for batch in batches:
        q.put_many(batch)
    want = [x for batch in batches for x in batch]
    got = []
    while len(got) < len(want):
        got += q.get_many(64, timeout=bound(5))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, np.ndarray):
            assert isinstance(g, np.ndarray) and g.dtype == w.dtype and np.array_equal(g, w)
        elif isinstance(w, tuple) and w and isinstance(w[0], np.ndarray):
            assert all(np.array_equal(x, y) for x, y in zip(g, w))
        else:
            assert g == w and type(g) is type(w)
    with pytest.raises(ValueError):
        q.get_many(0)


def test_get_many_takes_what_is_there_whatever_max_says(q):
    # the core grows its per-item codec buffer as frames come: a huge max
    # allocates nothing up front (it used to size a buffer by max)
    items = [{"i": i} for i in range(300)] + [b"raw"] * 5
    q.put_many(items[:300])
    q.put_many(items[300:])
    got = []
    while len(got) < len(items):
        got += q.get_many(10**12, timeout=bound(5))
    assert got == items


class _Yielding:
    """Unpickles through a function that gives up the GIL: another thread's
    get_many runs in the middle of this one's decoding."""

    def __init__(self, i):
        self.i = i

    def __reduce__(self):
        return _yielding, (self.i,)


def _yielding(i):
    time.sleep(0)
    return i


def test_threads_sharing_get_many_while_items_unpickle_take_each_item_once(q):
    import threading

    n, threads = 4000, 4
    for start in range(0, n, 100):
        q.put_many([_Yielding(i) for i in range(start, start + 100)])
    got = [[] for _ in range(threads)]
    errors = []

    def take(mine):
        try:
            while True:
                try:
                    mine += q.get_many(7, timeout=0.5)
                except shmq.Empty:
                    return
        except BaseException as e:  # reported below, never lost in a thread
            errors.append(e)

    ts = [threading.Thread(target=take, args=(got[k],)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(bound(60))
    assert not errors and not any(t.is_alive() for t in ts)
    everything = sorted(x for mine in got for x in mine)
    assert everything == list(range(n))
    assert sum(1 for mine in got if mine) > 1  # the threads really interleaved


def test_numpy_out_of_band_roundtrip(q):
    arrays = [np.arange(1 << 17, dtype=np.float64), np.zeros((3, 5), dtype=np.int16),
              np.array([(1, 2.5)], dtype=[("a", "i4"), ("b", "f8")])]
    q.put(arrays)
    q.put({"x": np.ones(1000, dtype=np.uint8)})
    got = q.get(timeout=1)
    for a, b in zip(arrays, got):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        assert b.flags.writeable  # one copy out, into a writable buffer
        assert b.ctypes.data % 8 == 0  # aligned in the ring and in the copy
    assert np.array_equal(q.get(timeout=1)["x"], np.ones(1000, dtype=np.uint8))


def test_large_out_of_band_arrays_are_writable_private_copies(q):
    """An out-of-band payload of 4 MiB or more is copied into a mapping of its own
    (shmq._core.LargeCopy): the arrays are equal, writable and independent."""
    arrays = [np.arange(1 << 20, dtype=np.float64), np.full(3 << 20, 7, dtype=np.uint8)]
    q.put(arrays)
    got = q.get(timeout=1)
    for a, b in zip(arrays, got):
        assert a.dtype == b.dtype and np.array_equal(a, b) and b.flags.writeable
    got[0][:] = 0
    assert np.array_equal(got[1], arrays[1]) and arrays[0][1] == 1.0


def test_put_keeps_buffers_out_of_band_and_the_rest_in_one_frame_kind(q):
    """The C put path writes exact builtin values in the values codec and pickles the rest
    in-band; an object with out-of-band buffers (numpy) goes to the Python encoder, which
    keeps them uncopied; batches of one kind are one frame kind."""
    from shmq import _format as F

    q.put({"a": 1})
    q.put(np.arange(4))
    q.put(b"raw")
    q.put(bytearray(b"ba"))  # a value (only PickleBuffers and arrays would go out of band)
    q.put_many([{"b": 2}, {"c": 3}])
    q.put_many([np.ones(3), np.zeros(2)])
    q.put_many([b"x", {"d": 4}])  # mixed: item by item
    q.put_many([b"y", b"z"])
    with shmq.Spool.open(q.path) as sp:
        r = sp.reader()  # anonymous, from the earliest: sees what the queue's group will get
        codecs = [f.codec for f in r.get_many(100, block=False)]
        r.close()
    V, O, R = F.CODEC_VALUES, F.CODEC_PICKLE_OOB, F.CODEC_RAW
    assert codecs == [V, O, R, V, V, V, O, O, R, V, R, R]
    got = [q.get(timeout=bound(5)) for _ in range(12)]
    assert got[0] == {"a": 1} and np.array_equal(got[1], np.arange(4)) and got[2] == b"raw"
    assert got[3] == bytearray(b"ba") and got[4:6] == [{"b": 2}, {"c": 3}]
    assert np.array_equal(got[6], np.ones(3)) and np.array_equal(got[7], np.zeros(2))
    assert got[8:] == [b"x", {"d": 4}, b"y", b"z"]


@pytest.mark.parametrize("items", [
    [b"a", {"b": 1}, np.arange(3)],  # mixed: the core's encoder declines, Python's takes it
    [{"c": 1}, {"d": 2}],            # one kind: the core's encoder
    [np.ones(2), np.zeros(2)],       # out-of-band buffers: Python's encoder
], ids=["mixed", "pickles", "arrays"])
def test_put_many_of_an_iterator_loses_nothing(q, items):
    q.put_many(iter(items))
    got = q.get_many(10, timeout=bound(5))
    assert len(got) == len(items)
    for g, w in zip(got, items):
        assert np.array_equal(g, w) if isinstance(w, np.ndarray) else g == w


def test_maxsize_counts_items():
    q = shmq.Queue(maxsize=3)
    try:
        for i in range(3):
            q.put(i, block=False)
        assert q.full()
        with pytest.raises(shmq.Full):
            q.put(3, block=False)
        with pytest.raises(shmq.Full):
            q.put(3, timeout=0.05)
        with pytest.raises(shmq.TooLarge):
            q.put_many(range(4))
        assert q.get() == 0
        q.put(3, block=False)
        assert [q.get() for _ in range(3)] == [1, 2, 3]
    finally:
        q.close()


def test_too_large_at_once():
    q = shmq.Queue(capacity="64KiB", max_capacity="64KiB")  # larger than the ceiling
    try:
        t = time.monotonic()
        with pytest.raises(shmq.TooLarge):
            q.put(b"x" * (1 << 20))
        assert time.monotonic() - t < 5
        q.put(b"fits")
        assert q.get() == b"fits"
    finally:
        q.close()


class Unpicklable:
    def __reduce__(self):
        raise AttributeError("not today")


def test_unpicklable_raises_at_put(q):
    with pytest.raises(AttributeError, match="not today"):
        q.put(Unpicklable())
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        q.put(lambda: 0)
    assert q.empty()  # nothing half-written
    q.put("ok")
    assert q.get() == "ok"


@pytest.mark.parametrize("bad", [-1, float("nan"), "1"])
def test_bad_timeouts(q, bad):
    with pytest.raises((ValueError, TypeError)):
        q.get(timeout=bad)
    with pytest.raises((ValueError, TypeError)):
        q.put(1, timeout=bad)


def test_bad_maxsize():
    with pytest.raises(TypeError):
        shmq.Queue(maxsize="3")


def test_closed_queue():
    q = shmq.Queue()
    q.close()
    for call in (lambda: q.put(1), q.get, q.qsize, lambda: q.put_many([1]), q.get_many):
        with pytest.raises(ValueError, match="is closed"):
            call()
    q.join_thread()
    q.cancel_join_thread()
    q.close()  # idempotent


def test_join_thread_requires_close(q):
    with pytest.raises(AssertionError):
        q.join_thread()


def test_joinable_queue():
    q = shmq.JoinableQueue()
    try:
        q.put_many([1, 2])
        q.get()
        q.get()
        assert not q.join(timeout=0.05)
        q.task_done()
        q.task_done()
        assert q.join(timeout=bound(5))
        with pytest.raises(ValueError, match="too many"):
            q.task_done()
    finally:
        q.close()


def test_simple_queue():
    q = shmq.SimpleQueue()
    try:
        assert q.empty()
        q.put({"k": 1})
        assert not q.empty()
        assert q.get() == {"k": 1}
    finally:
        q.close()


def test_async(q):
    async def main():
        getter = asyncio.ensure_future(q.get_async(timeout=bound(5)))
        await asyncio.sleep(0)
        await q.put_async("hi")
        return await getter

    assert asyncio.run(main()) == "hi"


def test_put_async_waits_for_room():
    q = shmq.Queue(maxsize=1)
    try:
        async def main():
            await q.put_async(1)
            putter = asyncio.ensure_future(q.put_async(2, timeout=bound(5)))
            await asyncio.sleep(0.01)
            assert not putter.done()
            assert q.get() == 1
            await putter
            return q.get(timeout=1)

        assert asyncio.run(main()) == 2
    finally:
        q.close()


def test_pickled_handle_reattaches(q):
    other = pickle.loads(pickle.dumps(q))
    other.put("through a pickle")
    assert q.get(timeout=1) == "through a pickle"
    other.close()
    q.put("still open")  # closing a reattached handle does not destroy the queue
    assert q.get(timeout=1) == "still open"


def test_named_persistent_queue(spool_dir):
    path = os.path.join(spool_dir, "jobs")
    a = shmq.Queue(path=path, maxsize=5)
    a.put("persisted")
    a.close()
    assert os.path.exists(path)
    b = shmq.Queue(path=path)
    assert b.get(timeout=1) == "persisted"
    assert b._maxsize == 5  # stored in the spool at creation
    b.close()


def test_untrusted_spool_refused(spool_dir):
    path = os.path.join(spool_dir, "shared")
    shmq.Queue(path=path).close()
    os.chmod(path, 0o666)
    with pytest.raises(shmq.ShmqError, match="trusted=True"):
        shmq.Queue(path=path)
    shmq.Queue(path=path, trusted=True).close()


def test_queue_refuses_overwrite_spool(spool_dir):
    path = os.path.join(spool_dir, "ring")
    shmq.Spool.create(path, capacity="64KiB").close()
    with pytest.raises(shmq.ShmqError, match="on_full='block'"):
        shmq.Queue(path=path)


def _sems(prefix):
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"sem.shmq.{prefix}.")]


def test_anonymous_queue_removed_on_close():
    # Only this queue's own file and semaphores are checked: tests running in
    # parallel create and remove other queues in /dev/shm meanwhile.
    q = shmq.Queue()
    path, prefix = q.path, q._spool.sem_prefix
    assert os.path.basename(path) in _queue_files() and _sems(prefix)
    q.close()
    assert not os.path.exists(path)
    assert _sems(prefix) == []


# --- across processes -----------------------------------------------------------


def _producer(q, start, n):
    for i in range(n):
        q.put((start, i))


def _consumer(q, n, out):
    got = [q.get(timeout=bound(30)) for _ in range(n)]
    out.put(got)


def test_two_by_two_each_item_once_in_producer_order(ctx):
    q = shmq.Queue()
    out = shmq.Queue()
    n = 2000
    procs = [ctx.Process(target=_producer, args=(q, w, n)) for w in range(2)]
    procs += [ctx.Process(target=_consumer, args=(q, n, out)) for _ in range(2)]
    for p in procs:
        p.start()
    parts = [out.get(timeout=bound(60)) for _ in range(2)]
    assert join_all(procs) == [0] * 4
    everything = sorted(x for part in parts for x in part)
    assert everything == sorted((w, i) for w in range(2) for i in range(n))
    for part in parts:
        for w in range(2):
            mine = [i for ww, i in part if ww == w]
            assert mine == sorted(mine)  # producer order preserved per consumer
    q.close()
    out.close()


def _echo_through(q_in, q_out):
    inner = q_in.get(timeout=bound(30))  # a queue handed over through another queue
    inner.put("hello via a queue in a queue")
    inner.close()


def test_queue_passed_through_a_queue(ctx):
    carrier, inner, done = shmq.Queue(), shmq.Queue(), shmq.Queue()
    p = ctx.Process(target=_echo_through, args=(carrier, done))
    p.start()
    carrier.put(inner)
    assert inner.get(timeout=bound(30)) == "hello via a queue in a queue"
    join_all([p])
    for x in (carrier, inner, done):
        x.close()


_worker_q = None


def _init(q):
    global _worker_q
    _worker_q = q


def _square_to_queue(x):
    _worker_q.put(x * x)
    return x


def _put_arg(q, x):
    q.put(x + 1)
    return x


def test_pool_initargs(ctx):
    q = shmq.Queue()
    with ctx.Pool(2, initializer=_init, initargs=(q,)) as pool:
        assert sorted(pool.map(_square_to_queue, range(10))) == list(range(10))
    assert sorted(q.get(timeout=bound(10)) for _ in range(10)) == [x * x for x in range(10)]
    q.close()


def test_process_pool_executor_submit_args(ctx):
    q = shmq.Queue()
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as ex:
        futs = [ex.submit(_put_arg, q, i) for i in range(6)]
        assert sorted(f.result(timeout=bound(60)) for f in futs) == list(range(6))
    assert sorted(q.get(timeout=bound(10)) for _ in range(6)) == list(range(1, 7))
    q.close()


def _take_one_then_hang(q, ready):
    q._reader._lock.acquire()  # killed while holding the group lock inside get()
    ready.set()
    time.sleep(600)


def test_consumer_killed_in_get_does_not_block_others(ctx):
    q = shmq.Queue()
    q._reader._lock.recovery_timeout = 0.3
    for i in range(5):
        q.put(i)
    ready = ctx.Event()
    p = ctx.Process(target=_take_one_then_hang, args=(q, ready))
    p.start()
    assert ready.wait(bound(30))
    os.kill(p.pid, signal.SIGKILL)
    p.join(bound(10))
    assert [q.get(timeout=bound(10)) for _ in range(5)] == list(range(5))
    q.put("producers unaffected")
    assert q.get(timeout=bound(5)) == "producers unaffected"
    q.close()


CREATOR = textwrap.dedent("""
    import os, sys, time, shmq
    q = shmq.Queue()
    q.put("left behind")
    print(q.path, flush=True)
    time.sleep(600)
""")


def test_creator_sigkill_removes_queue_files():
    """The killed creator's resource tracker removes its queue, and finds every name it
    was given (its stderr is the creator's, piped here): no "No such file" warning,
    as when a name was registered that never existed or that shmq had removed first.
    (Its notice that it cleaned up after a killed process is the stdlib's own.)"""
    proc = subprocess.Popen([sys.executable, "-c", CREATOR], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        path = proc.stdout.readline().strip()
        assert path.startswith("/dev/shm/shmq-q-")
        other = shmq.Queue.__new__(shmq.Queue)
        other.__setstate__({"path": path, "trusted": False})  # a process still holding it
        proc.kill()
        proc.wait(bound(10))
        assert other.get(timeout=bound(5)) == "left behind"  # keeps working after the creator died
        other.put("still works")
        assert other.get(timeout=bound(5)) == "still works"
        other.close()
        deadline = time.monotonic() + bound(20)  # the resource tracker notices the death
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(path)
        # EOF once the creator's tracker (which inherited its stderr) has exited
        _, err = proc.communicate(timeout=bound(20))
        assert "No such file" not in err and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(bound(10))
