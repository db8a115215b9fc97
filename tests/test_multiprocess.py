"""Multi-process behaviour, parametrized over fork, spawn and forkserver.

Synchronization is by events, pipes and the spool itself; every wait is
bounded so a bug fails the test instead of hanging CI.
"""

import os
import signal
import time

import pytest

import shmq
from shmq.verify import verify
from helpers import (
    REC, attach_named, die_holding_reader, group_drain, hold_group_lock_forever,
    hold_writer_lock_forever, put_after_event, put_and_report, read_records, write_records,
)
from conftest import bound, join_all

RECOVERY_S = 0.5  # lock-recovery timeout used by these tests


def test_two_writers_two_named_readers_see_everything_in_order(ctx, spool_path):
    per_writer = 10_000
    sp = shmq.Spool.create(spool_path, capacity="4MiB", on_full="block")
    sp.reader("a")  # register both before writing: block mode keeps frames for them
    sp.reader("b")
    sp.close()
    pipes, procs = [], []
    for name in ("a", "b"):
        recv, send = ctx.Pipe(duplex=False)
        pipes.append(recv)
        procs.append(ctx.Process(target=read_records, args=(spool_path, name, 2 * per_writer, send)))
    # the parent's readers above were closed, so the children can attach
    procs += [ctx.Process(target=write_records, args=(spool_path, w, per_writer, 100, 1 + w * 9))
              for w in range(2)]
    for p in procs:
        p.start()
    results = [r.recv() if r.poll(bound(120)) else None for r in pipes]
    assert join_all(procs, 60) == [0, 0, 0, 0]
    for res in results:
        assert res is not None, "a reader did not report"
        got, lost = res
        assert lost == 0 and len(got) == 2 * per_writer
        assert [s for _w, _c, s in got] == list(range(2 * per_writer))  # seq order
        for w in range(2):
            assert [c for ww, c, _s in got if ww == w] == list(range(per_writer))  # per-writer order


def test_blocked_reader_woken_by_put_from_another_process(ctx, spool_path):
    sp = shmq.Spool.create(spool_path, capacity="64KiB")
    r = sp.reader()
    go = ctx.Event()
    p = ctx.Process(target=put_after_event, args=(spool_path, go, b"wake"))
    p.start()
    go.set()
    t = time.monotonic()
    frame = r.get(timeout=bound(30))
    assert frame.data == b"wake"
    assert time.monotonic() - t < 30
    join_all([p])
    sp.close()


def _put_when_parked(path, data):
    """Put once a reader has registered as a waiter (it is parked, or about to sleep)."""
    sp = shmq.Spool.open(path)
    deadline = time.monotonic() + 30
    while sp.data_bell.sem.value < 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    sp.put(data)
    sp.close()


@pytest.mark.parametrize("how", ["timeout", "forever", "named-forever"])
def test_wakeup_uses_doorbell_not_safety_net(spool_path, safety_net, how):
    """A parked reader is woken by the doorbell, well before the safety net fires: a get
    with a timeout waits in Python, one without in C (both on the futex word)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    sp = shmq.Spool.create(spool_path, capacity="64KiB")
    r = sp.reader("named") if how.startswith("named") else sp.reader()
    safety_net(30.0)  # a missed doorbell would now cost 30 s
    try:
        p = ctx.Process(target=_put_when_parked, args=(spool_path, b"x"))
        p.start()
        t0 = time.monotonic()
        got = r.get(timeout=bound(20)) if how == "timeout" else r.get()
        assert got.data == b"x"
        assert time.monotonic() - t0 < 10
        assert sp.data_bell.sem.value == 0
        join_all([p])
    finally:
        r.close()
        sp.close()


@pytest.mark.parametrize("how", ["put", "put_many"])
def test_killed_lock_holder_is_recovered(ctx, spool_path, how):
    # put_many's first try is one core call too, which finds the lock stuck: the
    # recovery loop goes on from there.
    sp = shmq.Spool.create(spool_path, capacity="64KiB", recovery_timeout=RECOVERY_S)
    sp.put(b"before")
    ready = ctx.Event()
    holder = ctx.Process(target=hold_writer_lock_forever, args=(spool_path, ready))
    holder.start()
    assert ready.wait(bound(30))
    token = sp.stats().lock_token
    assert sp.stats().lock_pid == holder.pid
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(bound(10))
    t = time.monotonic()
    seq = (sp.put(b"after", timeout=bound(10)) if how == "put"
           else sp.put_many([b"after"], timeout=bound(10)))
    waited = time.monotonic() - t
    assert seq == 1
    assert waited < 3 * RECOVERY_S + 1  # within the recovery timeout (+ the zombie check)
    st = sp.stats()
    assert st.lock_token == token + 1 and st.lock_breaks == 1 and st.lock_pid == 0
    assert [f.data for f in sp.reader().get_many(5)] == [b"before", b"after"]
    sp.close()


def test_live_lock_holder_is_not_broken(spool_path):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    sp = shmq.Spool.create(spool_path, capacity="64KiB", recovery_timeout=0.1)
    ready = ctx.Event()
    holder = ctx.Process(target=hold_writer_lock_forever, args=(spool_path, ready))
    holder.start()
    try:
        assert ready.wait(bound(30))
        with pytest.raises(shmq.Timeout):
            sp.put(b"x", timeout=0.5)
        assert sp.stats().lock_breaks == 0
    finally:
        holder.kill()
        holder.join(bound(10))
    sp.put(b"x", timeout=bound(10))  # and recovered once it is dead
    sp.close()


def test_writers_race_to_recover_only_one_breaks(spool_path):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    sp = shmq.Spool.create(spool_path, capacity="1MiB", recovery_timeout=RECOVERY_S)
    ready = ctx.Event()
    holder = ctx.Process(target=hold_writer_lock_forever, args=(spool_path, ready))
    holder.start()
    assert ready.wait(bound(30))
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(bound(10))
    writers = [ctx.Process(target=write_records, args=(spool_path, w, 200)) for w in range(3)]
    for p in writers:
        p.start()
    assert join_all(writers, 60) == [0, 0, 0]
    st = sp.stats()
    assert st.lock_breaks == 1 and st.next_seq == 600
    sp.close()


def test_killed_group_lock_holder_is_recovered(ctx, spool_path):
    sp = shmq.Spool.create(spool_path, capacity="64KiB", recovery_timeout=RECOVERY_S)
    for i in range(3):
        sp.put(bytes([i]))
    ready = ctx.Event()
    p = ctx.Process(target=hold_group_lock_forever, args=(spool_path, "g", ready))
    p.start()
    assert ready.wait(bound(30))
    os.kill(p.pid, signal.SIGKILL)
    p.join(bound(10))
    g = sp.reader("g", group=True)
    assert [f.seq for f in g.get_many(10, timeout=bound(10))] == [0, 1, 2]
    sp.close()


@pytest.mark.parametrize("how", ["get_many timeout<recovery", "get non-blocking",
                                 "put timeout<recovery", "put_many timeout<recovery"])
def test_a_dead_holders_lock_is_recovered_even_by_a_short_timeout(ctx, spool_path, how):
    """A wait shorter than the recovery timeout still ends in recovery, not in Empty
    or Timeout forever (a group member polling with get_many(timeout=0.2) never
    recovered a killed member's lock; the kill -9 'segments' scenario found it)."""
    sp = shmq.Spool.create(spool_path, capacity="64KiB", recovery_timeout=RECOVERY_S)
    for i in range(3):
        sp.put(bytes([i]))
    ready = ctx.Event()
    target, args = ((hold_writer_lock_forever, (spool_path, ready)) if how.startswith("put")
                    else (hold_group_lock_forever, (spool_path, "g", ready)))
    p = ctx.Process(target=target, args=args)
    p.start()
    assert ready.wait(bound(30))
    os.kill(p.pid, signal.SIGKILL)
    p.join(bound(10))
    short = RECOVERY_S / 4
    if how.startswith("put_many"):
        assert sp.put_many([b"after"], timeout=short) == 3
    elif how.startswith("put"):
        assert sp.put(b"after", timeout=short) == 3
    else:
        g = sp.reader("g", group=True)
        if how.startswith("get_many"):
            assert [f.seq for f in g.get_many(10, timeout=short)] == [0, 1, 2]
        else:
            assert g.get(block=False).seq == 0
    sp.close()


def test_group_each_frame_exactly_once_across_processes(ctx, spool_path):
    n = 3000
    sp = shmq.Spool.create(spool_path, capacity="1MiB", on_full="block")
    sp.reader("workers", group=True).close()
    pipes, procs = [], []
    for _ in range(3):
        recv, send = ctx.Pipe(duplex=False)
        pipes.append(recv)
        procs.append(ctx.Process(target=group_drain, args=(spool_path, "workers", send, 3.0)))
    for p in procs:
        p.start()
    for i in range(n):
        sp.put(i.to_bytes(4, "little"))
    results = [r.recv() if r.poll(bound(60)) else [] for r in pipes]
    join_all(procs)
    seen = sorted(s for part in results for s in part)
    assert seen == list(range(n))  # every frame to exactly one member
    sp.close()


def test_block_policy_backpressure_across_processes(ctx, spool_path):
    sp = shmq.Spool.create(spool_path, capacity=8192, on_full="block")
    r = sp.reader("slow")
    while True:
        try:
            sp.put(bytes(1000), block=False)
        except shmq.Full:
            break
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=put_and_report, args=(spool_path, b"z" * 1000, send, 30))
    p.start()
    # the child is blocked: nothing new is committed until we consume
    assert not recv.poll(0.3)
    before = sp.next_seq
    r.get_many(3)
    assert recv.poll(bound(30))
    status, seq, _waited = recv.recv()
    assert status == "ok" and seq == before
    join_all([p])
    frames = r.get_many(100)
    assert frames[-1].data == b"z" * 1000 and r.lost == 0
    sp.close()


def test_block_policy_put_times_out_with_full(spool_path):
    sp = shmq.Spool.create(spool_path, capacity=4096, on_full="block")
    sp.reader("r")
    with pytest.raises(shmq.Full):
        for _ in range(100):
            sp.put(bytes(500), timeout=0.05)
    sp.close()


def test_named_reader_attach_refused_in_other_process(ctx, spool_path):
    sp = shmq.Spool.create(spool_path, capacity="64KiB")
    r = sp.reader("solo")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=attach_named, args=(spool_path, "solo", send))
    p.start()
    assert recv.poll(bound(30))
    assert recv.recv().startswith("busy")
    join_all([p])
    r.close()
    sp.close()


def test_dead_reader_slot_is_released_by_kernel(ctx, spool_path):
    sp = shmq.Spool.create(spool_path, capacity="64KiB")
    ready = ctx.Event()
    p = ctx.Process(target=die_holding_reader, args=(spool_path, "crashy", ready))
    p.start()
    assert ready.wait(bound(30))
    join_all([p])
    (rs,) = sp.readers()
    assert rs.name == "crashy" and not rs.alive and rs.pid == p.pid
    sp.reader("crashy")  # a restarted consumer re-attaches
    sp.close()


def test_fork_child_gets_its_own_handle(spool_path):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    sp = shmq.Spool.create(spool_path, capacity="64KiB")
    named = sp.reader("parent-owned")
    recv, send = ctx.Pipe(duplex=False)

    def child(conn):
        try:
            named.get(block=False)
            conn.send("used parent's reader")
        except ValueError:
            conn.send(sp.put(b"from child"))

    p = ctx.Process(target=child, args=(send,))
    p.start()
    assert recv.poll(bound(30)) and recv.recv() == 0
    join_all([p])
    # the parent's reader is still attached and alive
    assert [x.alive for x in sp.readers()] == [True]
    assert named.get(timeout=bound(5)).data == b"from child"
    sp.close()


def test_spool_handle_pickles_into_children(ctx, spool_path):
    sp = shmq.Spool.create(spool_path, capacity="64KiB")
    go = ctx.Event()
    p = ctx.Process(target=_put_via_handle, args=(sp, go))
    p.start()
    go.set()
    assert sp.reader().get(timeout=bound(30)).data == b"via pickle"
    join_all([p])
    sp.close()


def _put_via_handle(sp, go):
    go.wait(bound(30))
    sp.put(b"via pickle")
    sp.close()


def test_killed_writer_never_exposes_partial_frames(spool_path):
    """SIGKILL writers at random points; every committed frame stays whole."""
    import multiprocessing as mp
    import random

    ctx = mp.get_context("fork")
    sp = shmq.Spool.create(spool_path, capacity="256KiB", recovery_timeout=0.3)
    r = sp.reader("check")
    rng = random.Random(7)
    kills = 0
    for rnd in range(6):
        procs = [ctx.Process(target=write_records, args=(spool_path, rnd * 10 + w, 50_000, 300, 4))
                 for w in range(2)]
        for p in procs:
            p.start()
        # let them get going (observed through the spool), then kill one mid-flight
        deadline = time.monotonic() + 20
        while sp.next_seq < (rnd + 1) * 200 and time.monotonic() < deadline:
            time.sleep(0.001)
        victim = rng.choice(procs)
        os.kill(victim.pid, signal.SIGKILL)
        kills += 1
        for p in procs:
            if p is not victim:
                p.kill()  # bound the round
        join_all(procs)
    sp.put(b"final", timeout=bound(10))  # the lock is usable after the kills
    last = {}
    count = 0
    for f in r.get_many(10**6, timeout=1):
        if f.data == b"final":
            continue
        w, c = REC.unpack_from(f.data)
        assert f.data[REC.size:] == b"p" * (300 - REC.size)  # whole
        assert c > last.get(w, -1)  # per-writer order (gaps only from overwrite loss)
        last[w] = c
        count += 1
    assert kills == 6 and count > 0
    sp.close()


def _die_while_evicting(path, policy_growable):
    """Put a frame that must evict everything already consumed, and SIGKILL this
    process between the two words that record the new oldest frame."""
    def hook(where, _sp):
        if where == "evicting":
            os.kill(os.getpid(), signal.SIGKILL)

    shmq.spool.set_crash_hook(hook)
    sp = shmq.Spool.open(path, recovery_timeout=0.2)
    sp.put(b"w" * 3000, timeout=bound(10))
    os._exit(3)  # not reached: the hook kills it


@pytest.mark.parametrize("growable", [False, True], ids=["fixed", "growable"])
def test_a_writer_killed_while_evicting_everything_leaves_a_readable_ring(spool_path, ctx, growable):
    """The next batch goes where an older lap's frame may still look valid: a writer
    killed after recording the new oldest position but before its seq made lock
    recovery trust that stale header, and every reader then failed with "cursor
    ahead of the oldest frame yet unreadable".  The seq is now recorded first."""
    kw = dict(capacity="64KiB", max_capacity="8MiB") if growable else dict(capacity="64KiB")
    sp = shmq.Spool.create(spool_path, on_full="block", recovery_timeout=0.2, **kw)
    r = sp.reader("r")
    n = 0
    # Up to the point where the next 3000-byte frame wraps: the ring's end, or for a
    # growable ring its second segment's end (it wraps early on entering the third).
    end = 128 * 1024 if growable else sp.capacity
    while sp.ring.next_pos + 3032 <= end:
        sp.put(b"%06d" % n + b"x" * 2994)
        n += 1
    assert [f.seq for f in r.get_many(10_000, timeout=1)] == list(range(n))  # all consumed
    p = ctx.Process(target=_die_while_evicting, args=(spool_path, growable))
    p.start()
    join_all([p])
    assert p.exitcode == -signal.SIGKILL  # it died at the hook, holding the writer lock
    sp.put(b"after", timeout=bound(10))  # recovers the lock, then writes
    got = r.get_many(100, timeout=bound(5))
    assert got[-1].data == b"after" and got[0].seq == n and r.lost == 0
    report = verify(sp.path)
    assert report.ok, report.problems
