"""A writer blocked on a full ``block`` spool (or a bounded Queue) is woken for a burst of
room, not for every frame freed (shmq/core/wait.c, "room for a writer blocked on a full
block spool"; docs/format.md, "Room for a blocked writer").

The writer publishes how much room it waits for (control words ``W_ROOM_WANT_POS`` /
``W_ROOM_WANT_SEQ``); a consumer rings the space doorbell once the slowest cursor
reaches it, and not at its other commits.  A consumer that stops short of it costs the
writer at most ``ROOM_BURST_WAIT_S``, never a hang.  The doorbell's futex word
(``W_SPACE_BELL``) counts the rings.
"""

import functools
import os
import threading
import time

import pytest

import shmq
from shmq import _core, writer
from shmq import _format as F

from conftest import bound

FRAME = b"x" * 100
STORED = F.FRAME_BYTES + 104  # 100 B payload, 8-aligned


def _bell(sp):
    return sp.mapping.ctl[F.W_SPACE_BELL] & 0xFFFFFFFF


def _fill(sp):
    n = 0
    while True:
        try:
            sp.put(FRAME, block=False)
        except shmq.Full:
            return n
        n += 1


class _BlockedPut(threading.Thread):
    """put(frame) on a handle of its own, in a thread (the wait releases the GIL)."""

    def __init__(self, put, *args):
        super().__init__(daemon=True)
        self.put, self.args, self.error = put, args, None
        self.start()

    def run(self):
        try:
            self.put(*self.args)
        except BaseException as exc:  # reported by the test
            self.error = exc


def _wait_for(cond):
    deadline = time.monotonic() + bound(30)
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


@pytest.fixture
def full_spool(make_spool):
    sp = make_spool(capacity="256KiB", on_full="block")
    r = sp.reader("r")
    _fill(sp)
    yield sp, r
    r.close()


def test_a_blocked_writer_is_rung_once_for_a_burst_not_per_frame(full_spool, monkeypatch):
    sp, r = full_spool
    monkeypatch.setattr(writer, "ROOM_BURST_WAIT_S", 60.0)  # only the consumer's ring ends its wait
    other = shmq.Spool.open(sp.path)
    try:
        t = _BlockedPut(other.put, b"y" * 100)
        _wait_for(lambda: sp.space_bell.sem.value == 1 and sp.mapping.ctl[F.W_ROOM_WANT_POS])
        want, bell = sp.mapping.ctl[F.W_ROOM_WANT_POS], _bell(sp)
        gets = 0
        while _bell(sp) == bell:
            r.get(timeout=bound(10))
            gets += 1
            assert gets * STORED <= 256 * 1024, "no ring after the whole ring was consumed"
        # An eighth of the ring (32 KiB) freed before the one ring, not a ring per frame.
        assert gets >= (32 * 1024) // STORED - 1
        assert _bell(sp) == bell + 1 and sp.mapping.ctl[F.W_ROOM_WANT_POS] in (want, F.ROOM_RANG)
        t.join(bound(30))
        assert not t.is_alive() and t.error is None
        assert sp.mapping.ctl[F.W_ROOM_WANT_POS] == 0  # taken back by the writer
        for _ in range(5):  # nobody waits: commits ring nothing
            r.get(timeout=bound(10))
        assert _bell(sp) == bell + 1
    finally:
        other.close()


def test_a_writer_takes_the_room_there_is_when_the_consumer_stops_short(full_spool):
    sp, r = full_spool
    other = shmq.Spool.open(sp.path)
    try:
        t = _BlockedPut(other.put, b"y" * 100)
        _wait_for(lambda: sp.space_bell.sem.value == 1)
        r.get(timeout=bound(10))  # room for that one frame, far short of a burst: no ring
        t.join(bound(30))  # within ROOM_BURST_WAIT_S (1 ms) of its want, not the safety net
        assert not t.is_alive() and t.error is None
        assert sp.mapping.ctl[F.W_ROOM_WANT_POS] == 0
    finally:
        other.close()


def test_a_bounded_queue_producer_is_rung_once_per_burst(spool_dir, monkeypatch):
    monkeypatch.setattr(writer, "ROOM_BURST_WAIT_S", 60.0)
    path = os.path.join(spool_dir, "q")
    q = shmq.Queue(64, path=path)
    producer = shmq.Queue(path=path)
    try:
        for i in range(64):
            q.put(i)
        sp = q._spool
        t = _BlockedPut(producer.put, "last")  # maxsize items wait: ST_BACKLOG
        _wait_for(lambda: sp.space_bell.sem.value == 1 and sp.mapping.ctl[F.W_ROOM_WANT_SEQ])
        bell = _bell(sp)
        got = []
        while _bell(sp) == bell:
            got.append(q.get(timeout=bound(10)))
        assert len(got) == 64 // 8  # an eighth of maxsize, then one ring
        t.join(bound(30))
        assert not t.is_alive() and t.error is None
        rest = [q.get(timeout=bound(10)) for _ in range(64 - len(got) + 1)]
        assert got + rest == list(range(64)) + ["last"]
        assert sp.mapping.ctl[F.W_ROOM_WANT_SEQ] == 0
    finally:
        producer.close()
        q.close()
        shmq.Spool.destroy(path)


def test_a_writer_blocked_with_no_consumer_sleeps_until_one_reads(make_spool, monkeypatch):
    # A block spool with no named reader or group keeps every frame: only a
    # consumer that appears and reads makes room.  The blocked put must see "no
    # room" and sleep, not "room" and a write that finds none, in a loop at full
    # CPU (it then never registers as a waiter: the _wait_for below times out).
    sp = make_spool(capacity="64KiB", on_full="block")
    n = _fill(sp)
    assert sp.core.room_state(False) == 0  # this thread's failed write: no room for it
    looks = []
    retry = writer.retry_stuck
    monkeypatch.setattr(writer, "retry_stuck", lambda *a: looks.append(1) or retry(*a))
    other = shmq.Spool.open(sp.path)
    try:
        t = _BlockedPut(functools.partial(other.put, timeout=bound(60)), b"y" * 100)
        _wait_for(lambda: sp.space_bell.sem.value == 1)
        asleep = len(looks)
        r = sp.reader("late")  # from the oldest frame: room only once it reads
        got = [f.seq for f in r.get_many(n // 2, timeout=bound(10))]
        assert got == list(range(len(got))) and len(got) > 0
        r.commit()
        t.join(bound(30))
        assert not t.is_alive() and t.error is None
        assert asleep <= 2 and len(looks) <= asleep + 2, looks
        frames = r.get_many(2 * n, timeout=bound(10))
        assert frames[-1].data == b"y" * 100 and r.lost == 0
        r.close()
    finally:
        other.close()


def _put_all(path, n, done):
    with shmq.Spool.open(path) as sp:
        for i in range(n):
            sp.put(i.to_bytes(8, "little") * 12)
    done.set()


def test_a_writer_process_blocked_on_a_full_spool_loses_and_repeats_nothing(make_spool, ctx):
    sp = make_spool(capacity="64KiB", on_full="block")
    r = sp.reader("r")
    n = 20000  # about 40 laps of the ring: the writer blocks again and again
    done = ctx.Event()
    p = ctx.Process(target=_put_all, args=(sp.path, n, done))
    p.start()
    try:
        for i in range(n):
            assert r.get(timeout=bound(30)).data == i.to_bytes(8, "little") * 12
        assert done.wait(bound(30))
    finally:
        p.join(bound(30))
        if p.is_alive():
            p.kill()
        r.close()
    assert p.exitcode == 0 and sp.mapping.ctl[F.W_ROOM_WANT_POS] == 0


# -- the consumer's rule, word by word ----------------------------------------------------


def test_consumers_ring_at_every_commit_when_no_want_is_published(full_spool):
    # A writer of an older shmq (or an asyncio put) publishes nothing: every commit rings.
    sp, r = full_spool
    with _core.Waiting(sp.space_bell.sem.name):  # a registered writer that published nothing
        bell = _bell(sp)
        for k in range(1, 4):
            r.get(timeout=bound(10))
            assert _bell(sp) == bell + k


def test_consumers_ring_once_at_a_published_want_then_not_for_it_again(full_spool):
    sp, r = full_spool
    ctl = sp.mapping.ctl
    with _core.Waiting(sp.space_bell.sem.name):
        pos = sp.slots.word(sp.slots.find("r"), F.S_POS)
        ctl[F.W_ROOM_WANT_POS] = pos + 3 * STORED  # "ring me once three frames are free"
        bell = _bell(sp)
        r.get(timeout=bound(10))
        r.get(timeout=bound(10))
        assert _bell(sp) == bell  # short of the want
        r.get(timeout=bound(10))
        assert _bell(sp) == bell + 1 and ctl[F.W_ROOM_WANT_POS] == F.ROOM_RANG
        r.get(timeout=bound(10))
        assert _bell(sp) == bell + 1  # rung: no more until a writer publishes again
    ctl[F.W_ROOM_WANT_POS] = 0


def test_a_stale_want_is_replaced_by_a_blocked_writers_own(full_spool, monkeypatch):
    # A want left by a writer that died while waiting (at or below the cursors):
    # the next blocked writer publishes its own and is rung as usual.
    monkeypatch.setattr(writer, "ROOM_BURST_WAIT_S", 60.0)
    sp, r = full_spool
    for _ in range(10):
        r.get(timeout=bound(10))
    _fill(sp)
    ctl = sp.mapping.ctl
    ctl[F.W_ROOM_WANT_POS] = 1  # met long ago: the reader is past it
    other = shmq.Spool.open(sp.path)
    try:
        t = _BlockedPut(other.put, b"y" * 100)
        _wait_for(lambda: ctl[F.W_ROOM_WANT_POS] > 1)
        # Read up to the blocked writer's frame (not "while the thread lives": its put
        # can commit while the thread still runs, and a get past it would wait for good).
        while r.get(timeout=bound(10)).data != b"y" * 100:
            pass
        t.join(bound(30))
        assert t.error is None and ctl[F.W_ROOM_WANT_POS] == 0
    finally:
        other.close()
