"""The lock layer (shmq/_lock.py) on its own: the recoverable semaphore lock and OFD locks.

No spool here: a shared file of three u64 words (holder, fencing token, breaks)
and a named semaphore are all RecoverableLock needs, which is what these tests
give it, so a failure points at the lock and not at the spool around it.
"""

import mmap
import os
import time
import signal
import subprocess
import sys
import threading
import uuid

import posix_ipc
import pytest

import shmq
from shmq import _lock
from shmq._lock import RecoverableLock, holder_pid, holder_word, ofd_lock, ofd_locked_by_other, ofd_unlock

from conftest import bound, join_all

HOLDER, TOKEN, BREAKS = 0, 1, 2
RECOVERY_S = 0.2


class _Shared:
    """Three shared words in a file, a named semaphore and a RecoverableLock over them."""

    def __init__(self, path, sem_name, *, on_recover=None, create=False):
        if create:
            with open(path, "wb") as f:
                f.write(bytes(mmap.PAGESIZE))
        self.file = open(path, "r+b")
        self.mm = mmap.mmap(self.file.fileno(), mmap.PAGESIZE)
        self.words = memoryview(self.mm).cast("Q")
        flags = posix_ipc.O_CREX if create else 0
        self.sem = posix_ipc.Semaphore(sem_name, flags, initial_value=1)
        self.file.fd = self.file.fileno()  # RecoverableLock reads file.fd (it changes after fork)
        self.lock = RecoverableLock(self.sem, self.words, HOLDER, TOKEN, self.file, 0,
                                    breaks_word=BREAKS, recovery_timeout=RECOVERY_S,
                                    on_recover=on_recover)

    def close(self):
        self.lock.close()
        self.words.release()
        self.mm.close()
        self.sem.close()
        self.file.close()


@pytest.fixture
def shared(spool_dir):
    path = os.path.join(spool_dir, "lockwords")
    name = f"/shmq.test-lock-{uuid.uuid4().hex[:12]}"
    recovered = []
    s = _Shared(path, name, on_recover=recovered.append, create=True)
    s.path, s.name, s.recovered = path, name, recovered
    try:
        yield s
    finally:
        s.close()
        posix_ipc.unlink_semaphore(name)


def _hold_then_wait(path, sem_name, ready, release):
    """Child: take the lock, say so, then hold it until told to release (or killed)."""
    s = _Shared(path, sem_name)
    s.lock.acquire(timeout=bound(10))
    ready.send(os.getpid())
    release.recv()  # blocks until the parent writes or closes (or SIGKILLs us)
    s.lock.release()
    s.close()


def _start_holder(ctx, shared):
    ready_r, ready_w = ctx.Pipe(duplex=False)
    rel_r, rel_w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_hold_then_wait, args=(shared.path, shared.name, ready_w, rel_r))
    p.start()
    assert ready_r.poll(bound(60)), "the holder did not take the lock"
    assert ready_r.recv() == p.pid
    return p, rel_w


def test_threads_exclude_each_other_and_the_record_is_cleared(shared):
    count = [0]
    inside = [0]
    worst = [0]

    def work():
        for _ in range(2000):
            with shared.lock:
                inside[0] += 1
                worst[0] = max(worst[0], inside[0])
                count[0] += 1
                inside[0] -= 1

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(bound(60))
    assert not any(t.is_alive() for t in ts)
    assert count[0] == 8000 and worst[0] == 1
    assert shared.words[HOLDER] == 0 and shared.sem.value == 1
    assert shared.words[TOKEN] == 0 and shared.words[BREAKS] == 0  # nothing was broken


def test_with_waits_out_another_process_and_records_itself(ctx, shared):
    # `with lock:` on a lock another process holds spins, then sleeps on the
    # semaphore; either way it enters only after the release, and the holder
    # word names this process from the moment it holds the lock.
    p, release = _start_holder(ctx, shared)
    inside, seen, done = threading.Event(), [], threading.Event()

    def enter():
        with shared.lock:
            seen.append(shared.words[HOLDER])
            inside.set()
        done.set()

    t = threading.Thread(target=enter)
    t.start()
    try:
        assert not inside.wait(0.2), "entered while another process held the lock"
        assert holder_pid(shared.words[HOLDER]) == p.pid
    finally:
        release.send(b"go")
    assert inside.wait(bound(10)) and done.wait(bound(10))
    t.join(bound(10))
    p.join(bound(10))
    assert seen == [holder_word()] and shared.words[HOLDER] == 0 and shared.sem.value == 1


def test_holder_word_names_this_process():
    assert holder_pid(holder_word()) == os.getpid()
    assert _lock.holder_alive(holder_word())


def _stamp(pid):
    """Process ``pid``'s start stamp from /proc, as docs/format.md defines it."""
    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22
    with open("/proc/sys/kernel/random/boot_id") as f:
        salt = int(f.read()[:8], 16)
    return salt + ticks * 100 // os.sysconf("SC_CLK_TCK")


def test_a_process_stamp_is_its_start_since_boot_never_the_wall_clock():
    # /proc/stat's btime is the wall clock minus the time since boot, and a VM restored
    # from a snapshot steps the wall clock: a spawned worker that read btime after the
    # step computed another start time for its live parent and took it for dead.  The
    # stamp is made of what no clock step moves; a fresh interpreter (which caches
    # nothing of ours) computes the same one for itself as we do for it.
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, shmq._lock as L; print(L.holder_word(), flush=True); "
         "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        word = int(child.stdout.readline())
        stamp = _stamp(child.pid)
        assert word == child.pid | (stamp & 0xFFFFFFFF) << 32
        assert _lock.process_start(child.pid) == stamp
        assert _lock.holder_alive(word)
    finally:
        child.communicate("", timeout=bound(30))


def test_sigkilled_holder_is_broken_once_with_a_token_bump(ctx, shared):
    p, _rel = _start_holder(ctx, shared)
    assert holder_pid(shared.words[HOLDER]) == p.pid
    os.kill(p.pid, signal.SIGKILL)
    p.join(bound(30))
    shared.lock.acquire(timeout=bound(30))  # breaks it after about RECOVERY_S
    try:
        assert shared.recovered == [p.pid]  # on_recover ran, told whose lock it was
        assert shared.words[TOKEN] == 1 and shared.words[BREAKS] == 1
        assert holder_pid(shared.words[HOLDER]) == os.getpid()
    finally:
        shared.lock.release()
    assert shared.sem.value == 1 and shared.words[HOLDER] == 0
    shared.lock.acquire(timeout=bound(5))  # and it is an ordinary lock again
    shared.lock.release()
    assert shared.words[BREAKS] == 1


def test_live_but_stopped_holder_is_never_broken(ctx, shared):
    p, rel = _start_holder(ctx, shared)
    os.kill(p.pid, signal.SIGSTOP)
    try:
        with pytest.raises(shmq.Timeout, match=f"held by pid {p.pid}"):
            shared.lock.acquire(timeout=3 * RECOVERY_S)
        assert shared.words[TOKEN] == 0 and shared.recovered == []
    finally:
        os.kill(p.pid, signal.SIGCONT)
        rel.send(b"go")
    assert join_all([p], 30) == [0]
    shared.lock.acquire(timeout=bound(5))
    shared.lock.release()
    assert shared.words[TOKEN] == 0 and shared.words[BREAKS] == 0


def test_recycled_pid_is_treated_as_dead(shared):
    # The semaphore is taken and the record names a live pid (ours) with another
    # start time: the holder that took it is gone and its pid now belongs to
    # someone else, so the lock is broken.
    shared.sem.acquire(0)
    mine = holder_word()
    shared.words[HOLDER] = (mine & 0xFFFFFFFF) | (((mine >> 32) ^ 1) << 32)
    shared.lock.acquire(timeout=bound(10))
    try:
        assert shared.words[TOKEN] == 1 and shared.recovered == [os.getpid()]
    finally:
        shared.lock.release()


def test_unrecorded_holder_is_broken_only_when_it_persists(shared):
    # Held with no holder recorded: a live holder may be between sem_wait and
    # recording itself, so looks within one recovery period never break it
    # (however many: the first look comes after FIRST_LOOK_S); one a whole
    # period after the first such look does.
    shared.sem.acquire(0)
    t0 = time.monotonic()
    assert shared.lock.recover_if_dead() is False
    assert shared.lock.recover_if_dead() is False or time.monotonic() - t0 >= RECOVERY_S
    assert shared.words[TOKEN] == 0
    while time.monotonic() - t0 < RECOVERY_S:  # a lower bound being checked, not a sync
        time.sleep(RECOVERY_S / 4)
    assert shared.lock.recover_if_dead() is True  # broken, and released for the caller to retry
    assert shared.words[TOKEN] == 1 and shared.recovered == [0]
    assert shared.sem.value == 1 and shared.words[HOLDER] == 0


def test_an_old_look_without_holder_does_not_count(shared):
    # A look that caught a holder in its instant before recording itself, in an
    # earlier wait, must not count: only consecutive looks (at most a period
    # apart) of one wait add up to the whole period that breaks an unrecorded lock.
    shared.sem.acquire(0)
    assert shared.lock.recover_if_dead() is False  # an earlier wait's look
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5 * RECOVERY_S + _lock.FIRST_LOOK_S + 0.05:
        time.sleep(RECOVERY_S / 4)  # a lower bound being checked, not a sync
    assert shared.lock.recover_if_dead() is False  # a new wait: starts counting again
    assert shared.words[TOKEN] == 0
    shared.sem.release()


def test_released_lock_is_not_broken_by_a_stale_look(shared):
    # A waiter that saw a dead holder's word re-checks under the recovery lock:
    # if the lock was released meanwhile (the semaphore is up), nothing is broken.
    shared.words[HOLDER] = 1 | (12345 << 32)  # pid 1 with a start time it never had: "dead"
    assert shared.sem.value == 1
    assert shared.lock.recover_if_dead() is False
    assert shared.words[TOKEN] == 0 and shared.recovered == []
    shared.words[HOLDER] = 0


@pytest.mark.parametrize("pid", [0, -1, _lock.PID_MAX_LIMIT + 1, 2**32 - 1])
def test_impossible_pids_are_not_alive(pid):
    assert _lock.process_alive(pid) is False


def test_zombie_is_not_alive():
    # Not parametrized over start methods: only a process's own child can be held
    # as a zombie (a forkserver's children are the server's), so a plain child.
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    # Wait for it to exit without reaping it: WNOWAIT leaves it a zombie.
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
    try:
        assert _lock.process_alive(p.pid) is False
    finally:
        p.wait(bound(30))


def test_ofd_locks_conflict_between_open_file_descriptions(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 16)
    a, b = open(path, "r+b"), open(path, "r+b")
    try:
        assert ofd_lock(a.fileno(), 3)
        assert not ofd_lock(b.fileno(), 3)  # same process, other description: conflicts
        assert ofd_locked_by_other(b.fileno(), 3)
        assert ofd_lock(b.fileno(), 4)  # other bytes are free
        assert ofd_lock(a.fileno(), 5, exclusive=False) and ofd_lock(b.fileno(), 5, exclusive=False)
        ofd_unlock(a.fileno(), 3)
        assert ofd_lock(b.fileno(), 3)
        ofd_unlock(b.fileno(), 3)
        b.close()  # closing drops its locks (4 and 5), a's stay
        c = open(path, "r+b")
        try:
            assert ofd_lock(c.fileno(), 4)
            assert not ofd_lock(c.fileno(), 5)  # a still holds a shared lock on byte 5
        finally:
            c.close()
    finally:
        a.close()
        b.close()
