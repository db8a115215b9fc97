"""The wake-up layer (shmq/_notify.py): futex doorbells for blocking calls, one inotify
instance per process for asyncio.

The per-user inotify instance limit (fs.inotify.max_user_instances, 128 by
default) once made the 129th blocking handle fail with EMFILE.  Blocking
calls now sleep on the doorbell's futex word and take no instance at all;
coroutines share the process's one instance.  These tests hold hundreds of
blocked handles in one process and check they all wake, that blocking
waits open no instance and coroutines one, and that asyncio waits still
work when no instance can be had.
"""

import asyncio
import errno
import logging
import os
import threading
import time

import inotify_simple
import pytest

import shmq
from shmq import _notify

from conftest import bound, join_all

SPOOLS = 10
PER_SPOOL = 30  # 300 blocked handles and threads in all


def _inotify_fds():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify"
        except OSError:
            pass
    return n


def _waiters(spools):
    return sum(sp.data_bell.sem.value for sp in spools)


def _wait_until(cond, timeout=bound(60.0)):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _block_then_put(make_spool, ctx, per_spool):
    """300 threads, each with its own reader handle, blocked in get; then one frame per spool.

    Every other thread blocks with no timeout (the wait in C) and the rest
    with one (the wait in Python): both sleep on the futex word."""
    spools = [make_spool(capacity="256KiB") for _ in range(SPOOLS)]
    readers = [sp.reader() for sp in spools for _ in range(per_spool)]  # anonymous: from the end
    got = [None] * len(readers)
    errors = []

    def take(i, r):
        try:
            got[i] = (r.get() if i % 2 else r.get(timeout=bound(120))).data
        except BaseException as exc:  # reported below, never lost in a thread
            errors.append(repr(exc))

    # The putter starts before the threads (forking a multi-threaded process is
    # refused, see conftest) and puts once told to.
    go = ctx.Event()
    p = ctx.Process(target=_put_one_each, args=([sp.path for sp in spools], go))
    p.start()
    threads = [threading.Thread(target=take, args=(i, r), daemon=True) for i, r in enumerate(readers)]
    for t in threads:
        t.start()
    try:
        # Every thread registered as a waiter (it re-checked and found nothing):
        # they are all blocked before anything is put.
        assert _wait_until(lambda: _waiters(spools) == len(readers)), _waiters(spools)
        go.set()
        assert join_all([p], 60) == [0]
    finally:
        go.set()
        if p.is_alive():
            p.kill()
        deadline = time.monotonic() + 120  # one bound for all of them, not 120 s each
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, t in zip(readers, threads) if t.is_alive()]
        for r in stuck:
            r.close()  # a thread blocked forever by a bug raises ValueError within 0.1 s
    assert not stuck, f"{len(stuck)} blocked readers never woke"
    assert errors == []
    assert got == [f"frame for {sp.path}".encode() for sp in spools for _ in range(per_spool)]
    assert _waiters(spools) == 0
    for r in readers:
        r.close()
    return spools


def _put_one_each(paths, go=None):
    if go is not None and not go.wait(bound(120)):
        raise SystemExit("never told to put")
    for path in paths:
        with shmq.Spool.open(path) as sp:
            sp.put(f"frame for {path}".encode())


def test_300_blocked_handles_all_wake_without_an_inotify_instance(make_spool, ctx):
    before = _inotify_fds()
    _block_then_put(make_spool, ctx, PER_SPOOL)
    assert _inotify_fds() == before  # blocking waits sleep on futexes


async def _get_all(readers, timeout):
    return [f.data for f in await asyncio.gather(*(r.get_async(timeout=timeout) for r in readers))]


def _async_block_then_put(make_spool, ctx, per_spool):
    """SPOOLS x per_spool coroutines of one event loop blocked in get_async; then one frame
    per spool from another process."""
    spools = [make_spool(capacity="256KiB") for _ in range(SPOOLS)]
    readers = [sp.reader() for sp in spools for _ in range(per_spool)]
    p = ctx.Process(target=_put_one_each, args=([sp.path for sp in spools],))

    async def main():
        task = asyncio.ensure_future(_get_all(readers, 60))
        deadline = time.monotonic() + 60
        while _waiters(spools) < len(readers) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        assert _waiters(spools) == len(readers)
        p.start()
        return await task, _inotify_fds()

    got, fds_while_waiting = asyncio.run(main())
    assert join_all([p], 60) == [0]
    assert got == [f"frame for {sp.path}".encode() for sp in spools for _ in range(per_spool)]
    assert _waiters(spools) == 0
    for r in readers:
        r.close()
    return fds_while_waiting


def test_300_coroutines_share_one_inotify_instance_and_all_wake(make_spool, ctx, monkeypatch):
    monkeypatch.setattr(_notify, "_watcher", _notify.Watcher())  # a fresh one, that has to ask
    before = _inotify_fds()
    assert _async_block_then_put(make_spool, ctx, PER_SPOOL) == before + 1
    _notify.watcher()._ino.close()


def test_async_waits_fall_back_to_polling_when_inotify_is_refused(make_spool, ctx, monkeypatch, caplog):
    def refuse(*a, **k):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(inotify_simple, "INotify", refuse)
    monkeypatch.setattr(_notify, "_watcher", _notify.Watcher())  # a fresh one, that has to ask
    caplog.set_level(logging.WARNING, logger="shmq")
    _async_block_then_put(make_spool, ctx, 3)
    refused = [r for r in caplog.records if "no inotify instance" in r.getMessage()]
    assert len(refused) == 1  # said once, with the sysctl to raise
    assert "max_user_instances" in refused[0].getMessage()


@pytest.mark.parametrize("timeout", [0, 0.05])
def test_wait_returns_false_at_its_timeout_without_a_ring(make_spool, timeout):
    sp = make_spool(capacity="256KiB")
    r = sp.reader()
    with pytest.raises(shmq.Empty):
        r.get(timeout=timeout)
    assert sp.data_bell.sem.value == 0  # the registration was undone
    r.close()


def test_the_spin_before_parking_yields_the_cpu_between_looks(make_spool, monkeypatch):
    """Doorbell.wait spins before it parks, and gives up the CPU between two looks: a
    waiter whose frame another process is about to write lets that process (or any
    other runnable one) have its CPU, instead of holding it for SPIN_S.  A frame that
    comes during the spin is returned without registering as a waiter."""
    sp = make_spool(capacity="256KiB")
    yields = []
    looks = iter([False, False, False, True])  # the first look, then the spin's: ready on its third
    monkeypatch.setattr(_notify._core, "yield_cpu", lambda: yields.append(1))
    # The spin cannot run out before the frame.  The doorbell's own spin: it reads
    # SPIN_S when the spool is opened, so patching SPIN_S here would change nothing.
    monkeypatch.setattr(sp.data_bell, "spin", 60.0)
    assert sp.data_bell.wait(lambda: next(looks), 5)
    assert len(yields) == 3  # one between every two looks
    assert sp.data_bell.sem.value == 0  # never registered: it did not park


def test_the_spin_never_outlasts_the_timeout(make_spool, monkeypatch):
    """A waiter whose spin is longer than its timeout (a zero-copy reader's spin grows
    with its last frame) gives up when the timeout is spent, not when the spin is."""
    import time

    sp = make_spool(capacity="256KiB")
    looks = []
    monkeypatch.setattr(sp.data_bell, "spin", 60.0)
    t0 = time.monotonic()
    assert not sp.data_bell.wait(lambda: looks.append(1), 0.05)
    assert time.monotonic() - t0 < 30  # the whole spin would take 60 s
    assert len(looks) >= 2  # it did spin, and looked once more at the end
    r = sp.reader()
    t0 = time.monotonic()
    with pytest.raises(shmq.Empty):
        r.wait(0.05, None, spin=60.0)  # a zero-copy read's spin: the engine's
    assert time.monotonic() - t0 < 30
    r.close()


def test_a_zero_copy_readers_spin_lets_the_processes_other_threads_run(make_spool):
    """A zero-copy read (its frames do not pass the engine's take) spins as the engine
    does for a copying one, with the GIL released: a thread of the same process can put
    the awaited frame during the spin, which catches it without registering as a
    waiter.  No forced GIL switch here (a 100 s switch interval): only a released GIL
    lets the writer thread run before the reader parks."""
    import sys

    sp = make_spool(capacity="256KiB")
    r = sp.reader()
    go, registered = threading.Event(), []

    def writer():
        go.wait(30)
        registered.append(sp.data_bell.has_waiters())
        sp.put(b"x")

    t = threading.Thread(target=writer)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100)
    try:
        t.start()
        go.set()
        r.wait(60, None, spin=20.0)
    finally:
        sys.setswitchinterval(interval)
        t.join(30)
    assert registered == [False]  # the writer ran during the spin, not once the reader had parked
    assert r.get(timeout=0).data == b"x"
    r.close()


def test_the_spin_looks_after_its_last_yield(make_spool, monkeypatch):
    """A spin that runs out during a yield looks once more before it parks: the process
    it yielded to may have written the frame (a pipelining caller's reply is there after
    its one yield in most waits), and registering then would cost the waiter and every
    writer that sees it registered."""
    sp = make_spool(capacity="256KiB")
    frame = []
    monkeypatch.setattr(_notify._core, "yield_cpu", lambda: frame.append(1))  # "the writer ran"
    monkeypatch.setattr(sp.data_bell, "spin", 1e-9)  # out of spin after the first yield
    registered = []
    real = type(sp.data_bell._waiting)
    sp.data_bell._waiting = _Recording(sp.data_bell._waiting, registered)
    try:
        assert sp.data_bell.wait(lambda: bool(frame), 5, lambda: pytest.fail("published"))
    finally:
        sp.data_bell._waiting = sp.data_bell._waiting.inner
    assert frame == [1] and registered == []  # found after the yield, never registered
    assert isinstance(sp.data_bell._waiting, real)


class _Recording:
    """A waiter registration that records being entered (Doorbell._waiting's stand-in)."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def __enter__(self):
        self.log.append(1)
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


def test_before_park_runs_only_when_the_waiter_stays_asleep(make_spool, monkeypatch):
    """Doorbell.wait calls ``before_park`` once it has waited PUBLISH_AFTER_S after its
    spin, and not at all when the spin, or a frame within that time, ends the wait;
    a wake-up with nothing to read does not cut that time short."""
    sp = make_spool(capacity="256KiB")
    bell = sp.data_bell
    monkeypatch.setattr(_notify._core, "yield_cpu", lambda: None)
    parks = []
    monkeypatch.setattr(bell, "spin", 60.0)  # the doorbell's own (SPIN_S is read when it is made)
    looks = iter([False, False, True])
    assert bell.wait(lambda: next(looks), 5, lambda: parks.append(1))
    assert parks == []  # caught in the spin
    monkeypatch.setattr(bell, "spin", 0.0)
    # A frame within the first sleep (the bell rung once the waiter is registered).
    monkeypatch.setattr(_notify, "PUBLISH_AFTER_S", 30.0)
    came = threading.Event()

    def ring_when_parked():
        deadline = time.monotonic() + 10
        while bell.sem.value < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        came.set()
        bell.ring()

    t = threading.Thread(target=ring_when_parked)
    t.start()
    assert bell.wait(came.is_set, 20, lambda: parks.append(1))
    t.join(bound(10))
    assert parks == []  # ended by the frame within PUBLISH_AFTER_S: nothing published
    # A wake for a frame someone else took (the bell rung, nothing to read) is not
    # PUBLISH_AFTER_S of waiting: the waiter sleeps on and publishes no earlier.
    monkeypatch.setattr(_notify, "PUBLISH_AFTER_S", 0.05)
    came.clear()
    published = []
    t = threading.Thread(target=ring_when_parked)
    t.start()
    t0 = time.monotonic()
    assert not bell.wait(lambda: False, 0.3, lambda: published.append(time.monotonic() - t0))
    t.join(bound(10))
    assert came.is_set() and len(published) == 1 and published[0] >= 0.05
    monkeypatch.setattr(_notify, "PUBLISH_AFTER_S", 0.001)
    assert not bell.wait(lambda: False, 0.05, lambda: parks.append(1))
    assert parks == [1]  # slept on (and timed out): published once
    assert not bell.wait(lambda: False, 0.0005, lambda: parks.append(1))
    assert parks == [1]  # less time left than PUBLISH_AFTER_S: never published
    assert bell.sem.value == 0


def test_a_group_member_publishes_its_counters_when_it_stays_asleep(make_spool):
    """A group member's counters (kept per handle) reach the reader table once its get has
    slept PUBLISH_AFTER_S: ``shmq stat`` shows what an idle consumer read, without waiting
    for 64 frames."""
    sp = make_spool(capacity="256KiB")
    g = sp.reader("workers", group=True)
    other = shmq.Spool.open(sp.path)  # another handle: it flushes nothing of g's
    try:
        sp.put(b"x" * 10)
        assert g.get(timeout=bound(5)).data == b"x" * 10

        def gets():
            return next(r.gets for r in other.readers() if r.name == "workers")

        assert gets() == 0  # counted in the handle only
        got = []
        t = threading.Thread(target=lambda: got.append(g.get_many(4, timeout=bound(10))))
        t.start()
        deadline = time.monotonic() + 10
        while gets() < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert gets() == 1  # published while it waits
        assert t.is_alive() and not got and sp.data_bell.sem.value == 1  # still parked
        sp.put(b"y")
        t.join(bound(10))
        assert [f.data for f in got[0]] == [b"y"]
    finally:
        g.close()
        other.close()


@pytest.mark.parametrize("timeout", [0.05, 1])
@pytest.mark.parametrize("kind", ["reader", "named", "queue"])
def test_a_get_with_a_timeout_waits_in_c_and_keeps_it(make_spool, kind, timeout):
    """get(timeout=t) with a positive int or float waits in the core: it raises shmq.Empty
    (a queue.Empty) no earlier than t with the stdlib-style message, unregistered; and a put
    made while it waits is returned at once."""
    import queue as stdlib_queue

    if kind == "queue":
        q = shmq.Queue(capacity="256KiB")
        sp, get = q._spool, q.get
    else:
        sp = make_spool(capacity="256KiB")
        r = sp.reader("n") if kind == "named" else sp.reader()
        get = r.get
    try:
        t = time.monotonic()
        with pytest.raises(stdlib_queue.Empty, match=f"no frame within {timeout} s"):
            get(timeout=timeout)
        took = time.monotonic() - t
        assert timeout <= took < timeout + 5, took
        assert sp.data_bell.sem.value == 0

        def put_when_parked():
            deadline = time.monotonic() + 10
            while sp.data_bell.sem.value < 1 and time.monotonic() < deadline:
                time.sleep(0.001)
            sp.put(b"in time")

        th = threading.Thread(target=put_when_parked)
        th.start()
        try:
            got = get(timeout=bound(30))
        finally:
            th.join(bound(15))
        assert (got if kind == "queue" else got.data) == b"in time"
        assert sp.data_bell.sem.value == 0
    finally:
        if kind == "queue":
            q.close()


def test_a_coroutine_cancelled_as_its_doorbell_rings_is_cancelled(make_spool):
    """A waiting coroutine cancelled in the loop turn that its wake-up resolved its
    future in raises CancelledError.  With asyncio.wait_for around that future,
    CPython 3.11 returned the future's result instead and the wait went on:
    the cancellation was lost (a client's reading coroutine then finished its
    call as if never cancelled)."""
    sp = make_spool(capacity="64KiB")
    ready = [False]

    async def main():
        waiting = asyncio.create_task(sp.data_bell.wait_async(lambda: ready[0], 30))
        for _ in range(3):  # it parks on its future
            await asyncio.sleep(0)
        assert not waiting.done()
        ready[0] = True
        _notify.watcher()._bump()  # what an inotify event does: resolve parked futures
        await asyncio.sleep(0)  # ... in this turn, before the waiting task runs
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())
