"""The wake-up layer (shmq/_notify.py): one inotify instance per process, many waiters.

The per-user inotify instance limit (fs.inotify.max_user_instances, 128 by
default) once made the 129th blocking handle fail with EMFILE; these tests
hold hundreds of blocked handles in one process and check they share one
instance, all wake, and that waits still work when no instance can be had.
"""

import errno
import logging
import os
import threading
import time

import inotify_simple
import pytest

import shmq
from shmq import _notify

from conftest import join_all

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


def _wait_until(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _block_then_put(make_spool, ctx, per_spool):
    """300 threads, each with its own reader handle, blocked in get; then one frame per spool."""
    spools = [make_spool(capacity="256KiB") for _ in range(SPOOLS)]
    readers = [sp.reader() for sp in spools for _ in range(per_spool)]  # anonymous: from the end
    got = [None] * len(readers)
    errors = []

    def take(i, r):
        try:
            got[i] = r.get(timeout=120).data
        except BaseException as exc:  # reported below, never lost in a thread
            errors.append(repr(exc))

    threads = [threading.Thread(target=take, args=(i, r)) for i, r in enumerate(readers)]
    for t in threads:
        t.start()
    try:
        # Every thread registered as a waiter (it re-checked and found nothing):
        # they are all blocked before anything is put.
        assert _wait_until(lambda: _waiters(spools) == len(readers)), _waiters(spools)
        p = ctx.Process(target=_put_one_each, args=([sp.path for sp in spools],))
        p.start()
        assert join_all([p], 60) == [0]
    finally:
        for t in threads:
            t.join(120)
    assert not any(t.is_alive() for t in threads), "a blocked reader never woke"
    assert errors == []
    assert got == [f"frame for {sp.path}".encode() for sp in spools for _ in range(per_spool)]
    for r in readers:
        r.close()
    return spools


def _put_one_each(paths):
    for path in paths:
        with shmq.Spool.open(path) as sp:
            sp.put(f"frame for {path}".encode())


def test_300_blocked_handles_share_one_instance_and_all_wake(make_spool, ctx):
    before = _inotify_fds()
    assert before <= 1
    seen = []
    real_sleep = _notify.Watcher.sleep

    def counting_sleep(self, seconds):  # samples the instance count while all are parked
        seen.append(_inotify_fds())
        return real_sleep(self, seconds)

    _notify.Watcher.sleep = counting_sleep
    try:
        _block_then_put(make_spool, ctx, PER_SPOOL)
    finally:
        _notify.Watcher.sleep = real_sleep
    assert seen and max(seen) == 1  # one instance for 300 waiting handles, never more
    assert _inotify_fds() == 1


def test_waits_fall_back_to_polling_when_inotify_is_refused(make_spool, ctx, monkeypatch, caplog):
    def refuse(*a, **k):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(inotify_simple, "INotify", refuse)
    monkeypatch.setattr(_notify, "_watcher", _notify.Watcher())  # a fresh one, that has to ask
    caplog.set_level(logging.WARNING, logger="shmq")
    _block_then_put(make_spool, ctx, 3)
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
