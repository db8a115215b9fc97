"""One regression test per bug found in review, named after it."""

import asyncio
import multiprocessing as mp
import os
import stat
import time

import pytest

import shmq
from shmq import _format as F
from helpers import hold_group_lock_forever, hold_writer_lock_forever, put_after_event
from conftest import bound, join_all


def test_pad_covering_the_whole_ring_does_not_hang(make_spool):
    sp = make_spool(capacity=4096)
    sp.put(b"x")
    # forge: frame 0 becomes a pad that spans the whole ring, pointing at itself
    F.FRAME.pack_into(sp.mapping.mm, sp.ring.base, 0, 4096, 0, 0, 0, F.FLAG_PAD, 0, 0)
    for call in (lambda: sp.reader().get(block=False), lambda: sp.reader().get_many(5, block=False),
                 lambda: sp.read_at(0)):
        with pytest.raises(shmq.SpoolFormatError):
            call()


def test_semaphores_follow_the_spool_mode(spool_dir):
    sp = shmq.Spool.create(os.path.join(spool_dir, "shared"), capacity=4096, mode=0o666)
    sp.reader("g", group=True)  # group semaphore created lazily
    names = [n for n in os.listdir("/dev/shm") if n.startswith(f"sem.shmq.{sp.sem_prefix}.")]
    assert len(names) >= 4
    for n in names:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{n}").st_mode) == 0o666
    sp.close()


def test_group_get_nowait_with_busy_lock_raises_empty_not_timeout(make_spool):
    sp = make_spool(capacity=4096, recovery_timeout=0.2)
    sp.put(b"x")
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=hold_group_lock_forever, args=(sp.path, "g", ready))
    p.start()
    try:
        assert ready.wait(bound(30))
        g = sp.reader("g", group=True)
        with pytest.raises(shmq.Empty):
            g.get(block=False)  # waits for the (live, stuck) holder, then Empty
    finally:
        p.kill()
        p.join(bound(10))


def test_queue_put_nowait_with_stuck_writer_lock_raises_full(spool_dir):
    q = shmq.Queue(path=os.path.join(spool_dir, "q"))
    q._spool.recovery_timeout = 0.2
    q._spool.writer_lock.recovery_timeout = 0.2
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=hold_writer_lock_forever, args=(q.path, ready))
    p.start()
    try:
        assert ready.wait(bound(30))
        with pytest.raises(shmq.Full):
            q.put_nowait(1)
    finally:
        p.kill()
        p.join(bound(10))
        q.close()


def test_fork_child_does_not_unregister_parents_async_reader(make_spool, safety_net):
    sp = make_spool(capacity=4096)
    r = sp.reader()
    ctx = mp.get_context("fork")
    safety_net(30.0)  # a lost registration would now cost 30 s

    async def main():
        assert sp.data_bell.sem.value == 0  # nobody waits yet
        first = asyncio.ensure_future(r.get_async(timeout=bound(20)))
        end = time.monotonic() + 10
        while sp.data_bell.sem.value == 0:  # until it is parked: registered as a waiter
            assert time.monotonic() < end, "get_async never parked"
            await asyncio.sleep(0)
        child = ctx.Process(target=os._exit, args=(0,))
        child.start()  # the fork hook runs in the child
        child.join(bound(10))
        go = ctx.Event()
        writer = ctx.Process(target=put_after_event, args=(sp.path, go, b"wake"))
        writer.start()
        t = time.monotonic()
        go.set()
        frame = await first
        join_all([writer])
        return frame, time.monotonic() - t

    frame, waited = asyncio.run(main())
    assert frame.data == b"wake" and waited < 10


def test_writer_killed_between_first_pos_and_first_seq_still_opens(spool_path):
    sp = shmq.Spool.create(spool_path, capacity=4096)
    for i in range(40):
        sp.put(bytes([i]) * 100)
    first_seq, first_pos = sp.ring.first_cursor()
    sp.ring.ctl[F.W_FIRST_POS] = first_pos + F.frame_stored_bytes(100)  # killed before FIRST_SEQ
    sp.close()
    sp = shmq.Spool.open(spool_path)  # not refused as corrupt
    frames = sp.reader().get_many(100, block=False)
    assert [f.seq for f in frames] == list(range(first_seq + 1, 40))
    sp.close()


@pytest.mark.parametrize("word,value", [("W_NEXT_SEQ", 1 << 63), ("W_NEXT_SEQ", (1 << 64) - 1),
                                        ("W_NEXT_SEQ", 0xFEFEFEFEFEFEFEFE), ("W_NEXT_SEQ", 1 << 62),
                                        ("W_NEXT_POS", 1 << 62), ("W_NEXT_POS", (1 << 64) - 8)])
def test_write_counters_no_writer_reaches_are_refused_as_corrupt(make_spool, word, value):
    """stress/corefuzz.py found it: a write's seq is a signed 64-bit result, so a NEXT_SEQ
    of 2**63 or more came back from the engine as a negative "code" (SystemError).  The
    writer refuses NEXT_SEQ / NEXT_POS at or past 2**62 (F.MAX_COUNTER, as the readers and
    the open-time checks do) as a corrupt header, before placing anything."""
    sp = make_spool(capacity=4096)
    sp.put(b"x")
    good = int(sp.ring.ctl[getattr(F, word)])
    sp.ring.ctl[getattr(F, word)] = value
    for call in (lambda: sp.put(b"y"), lambda: sp.put_many([b"a", b"b"]), lambda: sp.reserve(8)):
        with pytest.raises(shmq.SpoolFormatError, match="out of range"):
            call()
    sp.ring.ctl[getattr(F, word)] = good
    assert sp.put(b"z") == 1  # nothing was placed or left locked


def test_read_at_negative_seq_is_value_error(make_spool):
    with pytest.raises(ValueError):
        make_spool().read_at(-1)


def test_default_dir_must_be_safe(monkeypatch, spool_dir):
    from shmq import _mapping

    bad = os.path.join(spool_dir, "planted")
    os.symlink("/tmp", bad)
    monkeypatch.setattr(_mapping, "default_dir", lambda: bad)
    with pytest.raises(shmq.ShmqError, match="symbolic link: not a safe directory"):
        shmq.Spool.create("x", capacity=4096)


def test_corrupt_holder_word_with_huge_pid_is_not_alive():
    from shmq._lock import holder_alive, process_alive

    assert not process_alive(1 << 40)
    assert not holder_alive((1 << 64) - 1)


def test_block_writer_never_jumps_past_a_pinned_frame(make_spool):
    # The core's block-mode eviction jumped FIRST_POS straight to the slowest
    # reader's cursor, checking pins only below the room it needed: a reader
    # that had moved on past a zero-copy view (as get_array(copy=False) does)
    # had that frame overwritten under the view within one lap.
    import numpy as np

    sp = make_spool(capacity="1MiB", on_full="block")
    r = sp.reader("r")
    per = 16 * 1024 // 8
    n = 0
    with pytest.raises(shmq.Full):
        while True:
            sp.put_array(np.full(per, n, dtype=np.int64), block=False)
            n += 1
    k = n // 2
    for _ in range(k):
        r.get_array()
    view = r.get_array(copy=False)  # frame k, pinned; the cursor moves on to k + 1
    for _ in range(n - k - 1):
        r.get_array()  # everything else consumed: only the pin holds room back
    puts = 0
    with pytest.raises(shmq.Full):  # the writer stops at the pinned frame ...
        for puts in range(n):
            sp.put_array(np.full(per, 10_000 + puts, dtype=np.int64), block=False)
    assert 0 < puts < n
    assert (view.array == k).all()  # ... which still holds its data
    view.release()
    sp.put_array(np.full(per, -1, dtype=np.int64), block=False)  # released: room again
    r.close()


def test_forking_a_multi_threaded_process_fails_the_suite():
    """The harness's fork check (tests/conftest.py, pyproject filterwarnings): a fork
    while another thread of ours runs raises, before any child exists; once the
    thread has ended, fork works again."""
    import threading

    release = threading.Event()
    th = threading.Thread(target=release.wait, args=(30,), name="blocker")
    th.start()
    try:
        with pytest.raises(DeprecationWarning, match="multi-threaded, use of fork"):
            pid = os.fork()
            if pid == 0:  # only reached if the check failed to raise
                os._exit(0)
            os.waitpid(pid, 0)
    finally:
        release.set()
        th.join(bound(30))
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 7
