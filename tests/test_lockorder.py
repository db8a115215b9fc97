"""Lock order: no call waits on one spool while holding a lock another process needs.

Each test parks a producer on a full work queue (a dead-letter replay, a
keyed put, a delayed put), then makes a consumer dead-letter a message while
another consumer takes and acks: every process must finish within seconds
(docs/guarantees.md, "Lock order").  Separate processes, every wait bounded.
"""

import os
import time

import pytest

import shmq
from conftest import bound, join_all

BODY = b"x" * 1024


@pytest.fixture
def wq_path(spool_dir):
    path = os.path.join(spool_dir, "wq")
    yield path
    try:
        shmq.WorkQueue.destroy(path)
    except FileNotFoundError:
        pass


def _open(path):
    return shmq.WorkQueue(path, capacity="64KiB", max_attempts=1, leases=128, keys=64,
                          dead_capacity="64KiB", liveness_interval=0.05)


def _holder(path, conn, go):
    """A: lease one message, then (on ``go``) nack it: it dead-letters (max_attempts=1)."""
    wq = _open(path)
    m = wq.get(timeout=bound(10), lease=60)
    conn.send(("leased", m.id))
    if not go.wait(bound(20)):
        conn.send(("no go", None))
        return
    m.nack(error="boom")
    conn.send(("nacked", m.id))
    wq.close()


def _producer(path, kind, conn, go):
    """B: a call that waits for room in the full queue."""
    wq = _open(path)
    if not go.wait(bound(20)):
        conn.send(("no go", None))
        return
    if kind == "replay":
        conn.send(("replayed", wq.replay_dead()))
    elif kind == "keyed":
        conn.send(("put", wq.put("new", key="k1")))
    else:
        conn.send(("put", wq.put("later", delay=0.01)))
    wq.close()


def _taker(path, conn, go):
    """C: take one message and ack it (this makes room)."""
    wq = _open(path)
    if not go.wait(bound(20)):
        conn.send(("no go", None))
        return
    m = wq.get(timeout=bound(10), lease=60)
    m.ack()
    conn.send(("acked", m.id))
    wq.close()


def _recv(conn, timeout=bound(20)):
    assert conn.poll(timeout), "no report from the child within the bound"
    return conn.recv()


def _wait_until(cond, timeout, what):
    """Poll a condition another process brings about (bounded)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.002)


def _scenario(ctx, path, kind):
    wq = _open(path)
    try:
        if kind == "replay":
            wq.put("poison")
            wq.get(timeout=1).nack(error="first failure")  # dead-lettered at once
            assert len(wq.dead_letters()) == 1
        elif kind == "keyed":
            wq.put("old", key="k1")
        filled = 0
        for body in (BODY, b"", None):  # to the last byte: B's small put must not fit
            while True:
                try:
                    wq.put(body, timeout=0)
                except shmq.Full:
                    break
                filled += 1
        assert filled > 4
        pipes = [ctx.Pipe(duplex=False) for _ in range(3)]
        go = [ctx.Event() for _ in range(3)]
        procs = [ctx.Process(target=_holder, args=(path, pipes[0][1], go[0])),
                 ctx.Process(target=_producer, args=(path, kind, pipes[1][1], go[1])),
                 ctx.Process(target=_taker, args=(path, pipes[2][1], go[2]))]
        for p in procs:
            p.start()
        try:
            what, held = _recv(pipes[0][0])
            assert what == "leased"
            go[1].set()  # B: park on the full queue
            space = wq._spool.space_bell
            _wait_until(space.has_waiters, 20, "the producer parked on the full queue")
            t0 = time.monotonic()
            go[0].set()  # A: dead-letter its message (the dead-letter spool's writer lock)
            go[2].set()  # C: take and ack (the work queue's lock), which makes room
            assert _recv(pipes[0][0]) == ("nacked", held)
            assert _recv(pipes[2][0])[0] == "acked"
            got = _recv(pipes[1][0])
            took = time.monotonic() - t0
        finally:
            codes = join_all(procs, timeout=20)
        assert codes == [0, 0, 0]
        assert took < 10, f"the three calls took {took:.1f} s"
        dead = [d.message_id for d in wq.dead_letters()]
        assert dead == [held]
        if kind == "replay":
            assert got == ("replayed", 1)
            bodies = []
            while True:
                try:
                    m = wq.get(timeout=0, lease=60)
                except shmq.Empty:
                    break
                bodies.append(m.body)
                m.ack()
            assert bodies.count("poison") == 1
        else:
            assert got[0] == "put" and got[1] > held
    finally:
        wq.close()


@pytest.mark.parametrize("kind", ["replay"])
def test_replay_blocked_on_full_queue_does_not_deadlock(ctx, wq_path, kind):
    """The issue's three processes: A holds a lease, B replays into the full queue,
    A nacks (dead-letters), C gets: all return once C's ack makes room."""
    _scenario(ctx, wq_path, kind)


@pytest.mark.parametrize("kind", ["keyed", "delayed"])
def test_blocked_keyed_or_delayed_put_does_not_hold_consumers(wq_path, kind):
    """A keyed (supersede) or delayed put waiting for room holds no lock that a
    dead-lettering nack or a get needs."""
    import multiprocessing as mp

    _scenario(mp.get_context("fork"), wq_path, kind)


def test_concurrent_replays_put_each_letter_once(wq_path):
    """Replayers take turns (the replay lock): two replays never put a letter twice."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    wq = shmq.WorkQueue(wq_path, capacity="1MiB", max_attempts=1, leases=128, keys=64,
                        dead_capacity="256KiB")
    try:
        for i in range(50):
            wq.put(i)
        for _ in range(50):
            wq.get(timeout=1).nack(error="x")
        assert len(wq.dead_letters()) == 50
        pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
        go = ctx.Event()
        procs = [ctx.Process(target=_replayer, args=(wq_path, w, go)) for _r, w in pipes]
        for p in procs:
            p.start()
        go.set()
        counts = [_recv(r) for r, _w in pipes]
        assert join_all(procs, timeout=20) == [0, 0]
        assert sum(counts) == 50
        got = []
        while True:
            try:
                m = wq.get(timeout=0)
            except shmq.Empty:
                break
            got.append(m.body)
            m.ack()
        assert sorted(got) == list(range(50))
        assert wq.dead_letters() == []
    finally:
        wq.close()


def _replayer(path, conn, go):
    wq = shmq.WorkQueue(path, capacity="1MiB", max_attempts=1, leases=128, keys=64,
                        dead_capacity="256KiB")
    go.wait(bound(20))
    conn.send(wq.replay_dead())
    wq.close()


def test_replay_with_a_timeout_stops_at_a_full_queue_and_loses_nothing(wq_path):
    """replay_dead(timeout=) on a full queue returns at its deadline with the letters
    still dead; once room appears the same call replays them."""
    wq = _open(wq_path)
    try:
        wq.put("doomed")
        m = wq.get(timeout=bound(10))
        m.nack(error="boom")  # max_attempts=1: dead-lettered
        assert wq.stats().dead == 1
        filled = 0
        for item in ("x" * 200, "d"):  # large items, then as small as the letter: no room left
            while True:
                try:
                    wq.put(item, timeout=0)
                except shmq.Full:
                    break
                filled += 1
        assert filled > 0
        t0 = time.monotonic()
        assert wq.replay_dead(timeout=0.3) == 0
        assert time.monotonic() - t0 < 10  # returned at its deadline, not when room appeared
        assert wq.stats().dead == 1  # nothing lost
        for _ in range(filled):  # make room
            wq.get(timeout=bound(10)).ack()
        assert wq.replay_dead(timeout=bound(10)) == 1
        assert wq.stats().dead == 0
        assert wq.get(timeout=bound(10)).body == "doomed"
    finally:
        wq.close()
