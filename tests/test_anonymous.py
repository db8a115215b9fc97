"""Anonymous queues whose creator was SIGKILLed (shmq.anonymous): kept while any
process has a handle to them, whatever way it got the handle; removed by the last
handle's exit, by the next Queue() (bounded work, no /proc scan, backing off what it
found in use), or by shmq gc; and the resource tracker stays silent about them.

Other processes of this user (other xdist workers, other test runs) create queues
and run ``shmq gc --yes`` meanwhile: they may remove an *unheld* orphan of these
tests first, which is by design, so assertions about removal accept "gone"."""

import mmap
import multiprocessing as mp
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from multiprocessing import resource_tracker

import pytest

import shmq
from shmq import _format as F
from shmq import _lock, anonymous
from shmq._mapping import Mapping
from shmq.anonymous import queue_creator

from conftest import START_METHODS, bound, run_gc, sem_files

HERE = os.path.dirname(os.path.abspath(__file__))
DEADLINE_S = 10.0  # the guarantee's bound: gone this soon after the last holder exits


def _wait_gone(path, prefix, timeout):
    """Wait until the queue's file *and* its semaphores are gone: a remover unlinks the
    file first and the semaphores after it (shmq._mapping.destroy_file)."""
    deadline = time.monotonic() + timeout
    while os.path.exists(path) or sem_files(prefix):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _reap_killed(proc):
    # No timeout: a timed join waits on the process's sentinel pipe, which a
    # grandchild forked from it inherited and keeps open; the process itself was
    # SIGKILLed, so the untimed join (a waitpid) returns at once.
    proc.join()


# -- a creator SIGKILLed while another process has its queue ------------------------


def _hold(q, report, go):
    """The holder: uses the queue after its creator died, then exits normally."""
    report.send(("holding", q.path, os.getpid()))
    if not go.poll(bound(60)):
        return
    go.recv()
    q.put("after the creator died")
    report.send(("got", q.get(timeout=bound(10))))
    # exits normally: its handle's finalizer runs (the last handle: removes the queue)


def _hold_from(carrier, report, go):
    q = carrier.get(timeout=bound(60))  # the handle arrives through another queue
    carrier.close()
    _hold(q, report, go)


def _create(method, how, report, go):
    q = shmq.Queue()
    q.put("left behind")
    ctx = mp.get_context(method)
    if how == "argument":
        holder = ctx.Process(target=_hold, args=(q, report, go))
        holder.start()
    else:
        carrier = shmq.Queue()
        holder = ctx.Process(target=_hold_from, args=(carrier, report, go))
        holder.start()
        carrier.put(q)
    time.sleep(bound(600))  # until SIGKILLed


@pytest.mark.parametrize("how", ["argument", "queue"])
@pytest.mark.parametrize("method", START_METHODS)
def test_killed_creators_queue_is_kept_while_held_and_gone_after_the_holder_exits(method, how):
    """Kept while the holder lives (through a new Queue() and shmq gc), usable there,
    and gone (file and semaphores) within 10 s of its exit; the holder got its handle
    as a Process argument (inherited under fork, pickled otherwise) or through another
    queue (pickled)."""
    # The creator starts the same way as its holder: a fork child of this process
    # cannot use forkserver once this process has started a fork server.
    ctx = mp.get_context(method)
    mine, report = ctx.Pipe(duplex=False)
    go_recv, go = ctx.Pipe(duplex=False)
    creator = ctx.Process(target=_create, args=(method, how, report, go_recv))
    creator.start()
    try:
        assert mine.poll(bound(60)), "the holder did not report"
        what, path, holder_pid = mine.recv()
        assert what == "holding" and queue_creator(path)[0] == creator.pid
        with shmq.Spool.open(path) as sp:
            prefix = sp.sem_prefix
        os.kill(creator.pid, signal.SIGKILL)
        _reap_killed(creator)

        shmq.Queue().close()  # a creation probes it: in use, kept
        assert anonymous.reclaim(path) is False  # nor does an explicit reclaim take it
        assert path not in run_gc("--min-age", "0")["queues"]
        assert os.path.exists(path) and sem_files(prefix)

        go.send("go")
        assert mine.poll(bound(30)) and mine.recv() == ("got", "left behind")
        assert _wait_gone(path, prefix, DEADLINE_S), \
            f"{path} or its semaphores still there {DEADLINE_S} s after the last holder exited"
    finally:
        if creator.is_alive():
            creator.kill()
            _reap_killed(creator)


def _make_then_wait(conn):
    q = shmq.Queue()
    q.put(1)
    conn.send((q.path, q._spool.sem_prefix))
    conn.recv()  # until SIGKILLed


@pytest.fixture
def dead_creators_queue():
    """``(path, prefix, creator)``: a queue whose creator (a fork child) is alive until
    ``creator`` is SIGKILLed by the test; removed afterwards if still there."""
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    c = ctx.Process(target=_make_then_wait, args=(b,))
    c.start()
    assert a.poll(bound(30))
    path, prefix = a.recv()
    yield path, prefix, c
    if c.is_alive():
        c.kill()
    _reap_killed(c)
    if os.path.exists(path):
        shmq.Spool.destroy(path)


def test_the_next_queue_removes_a_dead_creators_queue_nobody_holds(dead_creators_queue):
    path, prefix, creator = dead_creators_queue
    alive_one = shmq.Queue()  # probes the creator's queue while its creator lives: in use
    try:
        os.kill(creator.pid, signal.SIGKILL)
        _reap_killed(creator)
        # The creator's death ends the back-off at once: the next creation probes it.
        shmq.Queue().close()
        assert not os.path.exists(path) and not sem_files(prefix)
        assert os.path.exists(alive_one.path)  # a live creator's queue: never taken
    finally:
        alive_one.close()


def _named_after_a_dead_creator():
    """An anonymous queue path whose creator (a fork child that has exited) is dead, and
    which names this process's resource tracker (the child's: a fork shares it)."""
    resource_tracker.ensure_running()
    dead = mp.get_context("fork").Process(target=lambda: None)
    dead.start()
    dead.join(bound(30))
    return os.path.join(anonymous.ANONYMOUS_DIR, f"{anonymous.ANONYMOUS_PREFIX}{dead.pid}-0-"
                        f"{anonymous.tracker_tag()}-{os.urandom(8).hex()}")


def _count_probes(monkeypatch, path):
    """A list that gets ``path`` each time the orphan sweep probes it (behaviour unchanged)."""
    probes = []
    real = anonymous._reclaim_one
    monkeypatch.setattr(anonymous, "_reclaim_one",
                        lambda p, c: probes.append(p) or real(p, c) if p == path else real(p, c))
    return probes


class _Clock:
    """The back-off's clock, moved by the test."""

    def __init__(self):
        self.now = time.monotonic()

    def monotonic(self):
        return self.now


def test_a_held_orphan_is_probed_with_back_off_then_removed(dead_creators_queue, monkeypatch):
    path, prefix, creator = dead_creators_queue
    hold = shmq.Spool.open(path)  # another handle: keeps it after its creator dies
    os.kill(creator.pid, signal.SIGKILL)
    _reap_killed(creator)
    clock = _Clock()
    monkeypatch.setattr(anonymous, "time", clock)
    # other queues on the host (other test runs') must not use up a call's budget
    monkeypatch.setattr(anonymous, "PROBE_BATCH", 1 << 20)
    monkeypatch.setattr(anonymous, "RECLAIM_BATCH", 1 << 20)
    probes = _count_probes(monkeypatch, path)
    anonymous._backoff.pop(path, None)

    assert path not in _removed_by(anonymous.reclaim_orphans)
    assert probes == [path]
    for _ in range(3):
        anonymous.reclaim_orphans()  # within the back-off: not probed again
    assert probes == [path]
    clock.now += anonymous.BACKOFF_FIRST_S + 0.01
    anonymous.reclaim_orphans()
    assert probes == [path] * 2  # probed again, still in use: the interval doubles
    clock.now += anonymous.BACKOFF_FIRST_S + 0.01
    anonymous.reclaim_orphans()
    assert probes == [path] * 2
    clock.now += anonymous.BACKOFF_FIRST_S
    anonymous.reclaim_orphans()
    assert probes == [path] * 3
    assert os.path.exists(path)

    hold.close()  # the last handle (a plain Spool: no reclaim of its own)
    clock.now += anonymous.BACKOFF_MAX_S + 0.01
    anonymous.reclaim_orphans()
    assert not os.path.exists(path) and not sem_files(prefix)
    assert path not in anonymous._backoff


def test_a_queue_of_another_resource_tracker_is_left_to_it_then_removed_after_the_grace(
        monkeypatch):
    """A dead creator's queue registered with another process's resource tracker is that
    tracker's to remove (it unlinks it, quietly, once its processes are gone; removing
    it first would make it warn): neither the last handle closing nor the next Queue()
    takes it within TRACKER_GRACE_S; after that the sweep does (that tracker is gone)."""
    name = os.path.basename(_named_after_a_dead_creator()).split("-")
    name[4] = "1" if name[4] != "1" else "2"  # another tracker's tag
    path = os.path.join(anonymous.ANONYMOUS_DIR, "-".join(name))
    assert not anonymous.shares_tracker(path)
    sp = shmq.Spool.create(path, capacity="64KiB", on_full="block", readers=1, leases=0)
    prefix = sp.sem_prefix
    sp.close()
    clock = _Clock()
    monkeypatch.setattr(anonymous, "time", clock)
    monkeypatch.setattr(anonymous, "PROBE_BATCH", 1 << 20)
    monkeypatch.setattr(anonymous, "RECLAIM_BATCH", 1 << 20)
    try:
        assert anonymous.reclaim(path) is False  # the last handle's close leaves it
        assert path not in _removed_by(anonymous.reclaim_orphans)
        clock.now += anonymous.TRACKER_GRACE_S - 0.01
        assert path not in _removed_by(anonymous.reclaim_orphans)
        clock.now += 0.02
        assert path in _removed_by(anonymous.reclaim_orphans)
        assert not sem_files(prefix) and path not in anonymous._dead_since
    finally:
        if os.path.exists(path):
            shmq.Spool.destroy(path)


def _removed_by(fn):
    before = set(anonymous.anonymous_paths())
    fn()
    return before - set(anonymous.anonymous_paths())


def test_creation_probes_are_bounded(monkeypatch):
    """Queue() probes at most PROBE_BATCH candidates and removes at most RECLAIM_BATCH
    (three live creators' queues here, and whatever other runs have)."""
    outcome = [anonymous.IN_USE]
    calls = []
    monkeypatch.setattr(anonymous, "_reclaim_one",
                        lambda p, c: calls.append(p) or (outcome[0], "000000000000"))
    monkeypatch.setattr(anonymous, "forget_in_tracker", lambda p, prefix: None)
    monkeypatch.setattr(anonymous, "_backoff", {})
    monkeypatch.setattr(anonymous, "PROBE_BATCH", 2)
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    kids = [ctx.Process(target=_make_then_wait, args=(b,)) for _ in range(3)]
    for k in kids:
        k.start()
    paths = [a.recv()[0] for _ in kids]
    try:
        assert anonymous.reclaim_orphans() == 0
        assert len(calls) == 2  # in use: backed off
        anonymous.reclaim_orphans()  # two others: the first two are backed off
        assert len(calls) in (3, 4) and len(set(calls)) == len(calls)
        outcome[0] = anonymous.REMOVED  # (pretended)
        monkeypatch.setattr(anonymous, "_backoff", {})
        monkeypatch.setattr(anonymous, "PROBE_BATCH", 100)
        monkeypatch.setattr(anonymous, "RECLAIM_BATCH", 1)
        calls.clear()
        assert anonymous.reclaim_orphans() == 1 and len(calls) == 1
    finally:
        for k in kids:
            k.kill()
            _reap_killed(k)
        for p in paths:
            if os.path.exists(p):
                shmq.Spool.destroy(p)


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's file needs root")
def test_another_users_queue_file_is_never_taken_and_costs_one_probe(monkeypatch):
    path = _named_after_a_dead_creator()
    sp = shmq.Spool.create(path, capacity="64KiB", on_full="block", readers=1, leases=0)
    sp.close()
    os.chown(path, 65534, 65534)  # nobody's, as if planted by another user
    probes = _count_probes(monkeypatch, path)
    monkeypatch.setattr(anonymous, "PROBE_BATCH", 1 << 20)
    anonymous._backoff.pop(path, None)
    try:
        anonymous.reclaim_orphans()
        anonymous.reclaim_orphans()
        assert probes == [path]  # not ours: left alone, and not probed at every creation
        assert os.path.exists(path) and anonymous.probe(path) == anonymous.FOREIGN
        assert anonymous.reclaim(path) is False and not anonymous.is_orphan(path)
        assert path not in run_gc("--min-age", "0")["queues"]
    finally:
        os.chown(path, 0, 0)
        shmq.Spool.destroy(path)


# -- the handle lock ----------------------------------------------------------------


def test_every_handle_holds_the_handle_lock_until_closed(spool_path):
    sp = shmq.Spool.create(spool_path, capacity="64KiB")
    assert F.handles_lock(sp.geometry)
    fd = os.open(spool_path, os.O_RDWR)
    try:
        assert not _lock.ofd_lock(fd, F.HANDLE_LOCK_BYTE)  # exclusive: the handle holds it shared
        other = shmq.Spool.open(spool_path)
        sp.close()
        assert not _lock.ofd_lock(fd, F.HANDLE_LOCK_BYTE)  # the other handle still does
        other.close()
        assert _lock.ofd_lock(fd, F.HANDLE_LOCK_BYTE)  # no handle anywhere
    finally:
        os.close(fd)


def _report_lock(path, conn):
    fd = os.open(path, os.O_RDWR)
    conn.send(_lock.ofd_lock(fd, F.HANDLE_LOCK_BYTE))
    os.close(fd)


def test_a_fork_child_keeps_the_lock_after_the_parent_closes(spool_path):
    """The child shares the parent's open file description at first and takes its own
    lock after the fork (Mapping.reopen_fd): either way the file stays held."""
    sp = shmq.Spool.create(spool_path, capacity="64KiB")
    ctx = mp.get_context("fork")
    child_go, go = ctx.Pipe(duplex=False)
    mine, theirs = ctx.Pipe(duplex=False)

    def child():
        child_go.recv()  # the parent has closed its handle
        fd = os.open(spool_path, os.O_RDWR)
        theirs.send(_lock.ofd_lock(fd, F.HANDLE_LOCK_BYTE))
        os.close(fd)

    p = ctx.Process(target=child)
    p.start()
    sp.close()
    go.send("closed")
    assert mine.poll(bound(30)) and mine.recv() is False  # the child's handle still holds it
    p.join(bound(30))
    r, w = ctx.Pipe(duplex=False)
    q = ctx.Process(target=_report_lock, args=(spool_path, w))
    q.start()
    assert r.poll(bound(30)) and r.recv() is True  # the child exited: none left
    q.join(bound(30))


def test_a_mapping_kept_by_a_view_keeps_the_lock(spool_path):
    shmq.Spool.create(spool_path, capacity="64KiB").close()
    m = Mapping(spool_path)
    view = memoryview(m.mm)  # an export: the mapping cannot be unmapped at close
    m.close()
    fd = os.open(spool_path, os.O_RDWR)
    try:
        assert not _lock.ofd_lock(fd, F.HANDLE_LOCK_BYTE)  # still mapped: still held
        view.release()
        del view, m
        import gc

        gc.collect()
        assert _lock.ofd_lock(fd, F.HANDLE_LOCK_BYTE)
    finally:
        os.close(fd)


def test_opening_waits_for_a_removal_in_progress_then_finds_it_gone(spool_path, monkeypatch):
    shmq.Spool.create(spool_path, capacity="64KiB").close()
    remover = os.open(spool_path, os.O_RDWR)
    assert _lock.ofd_lock(remover, F.HANDLE_LOCK_BYTE)  # as shmq.anonymous does before removing
    refused = threading.Event()
    monkeypatch.setattr(_lock, "_core", _RefusalWatcher(_lock._core, refused))
    got = []
    t = threading.Thread(target=lambda: got.append(_open_or_error(spool_path)))
    t.start()
    try:
        assert refused.wait(bound(10))  # the opener waits for the removal ...
        shmq.Spool.destroy(spool_path)
    finally:
        os.close(remover)  # ... which ends here
    t.join(bound(10))
    assert isinstance(got[0], FileNotFoundError), got


class _RefusalWatcher:
    """shmq._core, but its handle-lock wait first tries once without waiting (the engine's
    call with no wait) and sets `refused` if that attempt was refused: the opener has met
    the remover's lock, and the real wait that follows is still in progress."""

    def __init__(self, core, refused):
        self._core, self._refused = core, refused

    def __getattr__(self, name):
        return getattr(self._core, name)

    def hold_handle_lock(self, fd, wait_s):
        if not self._core.hold_handle_lock(fd, 0.0):
            self._refused.set()
        return self._core.hold_handle_lock(fd, wait_s)


def _open_or_error(path):
    try:
        return shmq.Spool.open(path)
    except Exception as exc:
        return exc


def test_a_handle_lock_held_exclusively_too_long_is_a_clear_error(spool_path, monkeypatch):
    shmq.Spool.create(spool_path, capacity="64KiB").close()
    monkeypatch.setattr(_lock, "HANDLE_LOCK_WAIT_S", 0.05)
    squatter = os.open(spool_path, os.O_RDWR)
    try:
        assert _lock.ofd_lock(squatter, F.HANDLE_LOCK_BYTE)
        with pytest.raises(shmq.ShmqError, match="handle lock"):
            shmq.Spool.open(spool_path)
    finally:
        os.close(squatter)
    shmq.Spool.open(spool_path).close()  # and nothing was lost


# -- files an older shmq created (no handle lock): the /proc scan, in gc only ------


def _without_handle_locks_flag(path):
    fd = os.open(path, os.O_RDWR)
    try:
        fields = list(F.GEOMETRY.unpack_from(os.pread(fd, F.GEOMETRY.size, 0)))
        fields[15] &= ~F.GEO_FLAG_HANDLE_LOCKS
        body = F.GEOMETRY.pack(*fields)[:F.GEOMETRY_CRC_SPAN]
        os.pwrite(fd, body + struct.pack("<I", zlib.crc32(body)), 0)
    finally:
        os.close(fd)


def test_an_older_shmqs_queue_is_left_to_gc_which_scans_for_users():
    """A file without the handle-lock flag: its handles (an older shmq's) take no lock,
    so neither Queue() nor a closing handle removes it; shmq gc scans /proc for it."""
    path = _named_after_a_dead_creator()
    sp = shmq.Spool.create(path, capacity="64KiB", on_full="block", readers=1, leases=0)
    prefix = sp.sem_prefix
    try:
        _without_handle_locks_flag(path)
        fd = os.open(path, os.O_RDWR)
        old_handle = mmap.mmap(fd, 4096)  # an older shmq's handle: mapped, no handle lock
        os.close(fd)
        sp.close()  # (held until now: an older shmq's Queue() elsewhere scans for mappings)
        anonymous._backoff.pop(path, None)
        anonymous.reclaim_orphans()
        assert anonymous.probe(path) == anonymous.UNKNOWN and not anonymous.is_orphan(path)
        assert anonymous.reclaim(path) is False and os.path.exists(path)
        assert path not in run_gc("--min-age", "0")["queues"]  # the scan finds the mapping
        old_handle.close()
        anonymous._backoff.pop(path, None)
        anonymous.reclaim_orphans()
        assert anonymous.reclaim(path) is False and os.path.exists(path)  # still the lock's silence
        assert path in run_gc("--min-age", "0")["queues"] or not os.path.exists(path)
        run_gc("--yes", "--min-age", "3600")
        assert _wait_gone(path, prefix, bound(10))
    finally:
        if os.path.exists(path):
            shmq.Spool.destroy(path)


# -- a quiet exit ---------------------------------------------------------------------


@pytest.mark.parametrize("method", START_METHODS)
def test_a_killed_creators_queue_reclaimed_by_a_new_queue_leaves_a_quiet_exit(method):
    """tests/killed_creator_exit.py under ``python -W error``: the creator is SIGKILLed,
    a new Queue() removes its queue, and the interpreter (with its resource tracker,
    which writes to the same stderr) exits 0 saying nothing."""
    for _attempt in range(3):
        proc = subprocess.run([sys.executable, "-W", "error", os.path.join(HERE, "killed_creator_exit.py"),
                               method], capture_output=True, text=True, timeout=bound(120), cwd=HERE)
        if proc.returncode != 3:  # 3: another process of this user removed it first
            break
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and proc.stdout == ""
