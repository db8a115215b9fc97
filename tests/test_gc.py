"""shmq gc: orphaned semaphores are found (and removed with --yes); semaphores of
spools that exist, open or not, on /dev/shm or on disk, are never touched.  (Anonymous
queues whose creator was SIGKILLed: tests/test_anonymous.py.)"""

import os
import shutil

import pytest

import shmq
from shmq._mapping import registry_dir

from conftest import run_gc, sem_files

DEADLINE_S = 10.0


@pytest.fixture(autouse=True)
def _one_gc_test_at_a_time():
    """These tests orphan semaphores on purpose and run ``gc --yes``, which removes
    every orphan of this user: two of them at once (xdist workers) would sweep
    each other's.  An flock serializes them across workers (the kernel drops it
    if a worker dies)."""
    import fcntl

    with open(os.path.join("/tmp", f"shmq-test-gc-{os.getuid()}.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _make(path, **kw):
    sp = shmq.Spool.create(path, capacity="64KiB", **kw)
    g = sp.reader("grp", group=True)  # a group semaphore too
    sp.put(b"hello")
    g.close()
    prefix = sp.sem_prefix
    sp.close()
    assert len(sem_files(prefix)) >= 4
    return prefix


@pytest.fixture
def disk_dir(tmp_path):
    d = tmp_path / "spools"
    d.mkdir()
    yield str(d)
    for n in os.listdir(d):
        try:
            shmq.Spool.destroy(os.path.join(d, n))
        except Exception:
            pass


def test_gc_removes_exactly_the_removed_spools_semaphores(spool_dir, disk_dir):
    doomed = os.path.join(spool_dir, "doomed")
    os.mkdir(doomed)
    gone = [_make(os.path.join(doomed, f"s{i}")) for i in range(3)]
    shm_keep = _make(os.path.join(spool_dir, "keep"))  # /dev/shm, not open
    disk_path = os.path.join(disk_dir, "keep")
    disk_keep = _make(disk_path)  # a disk path, not open: known from the registry only
    assert os.stat(disk_dir).st_dev != os.stat("/dev/shm").st_dev or True
    kept_before = {p: sem_files(p) for p in (shm_keep, disk_keep)}
    shutil.rmtree(doomed)  # the files go, their semaphores stay
    gone_sems = {p: sem_files(p) for p in gone}
    assert all(gone_sems.values())

    dry = run_gc("--min-age", "0")  # the default: a dry run
    assert not dry["removed"]
    for p in gone:
        assert set(dry["semaphores"][p]) == gone_sems[p]
    assert shm_keep not in dry["semaphores"] and disk_keep not in dry["semaphores"]
    assert {p: sem_files(p) for p in gone} == gone_sems  # nothing changed

    done = run_gc("--yes", "--min-age", "0")
    assert done["removed"] and all(p in done["semaphores"] for p in gone)
    assert all(not sem_files(p) for p in gone)
    assert {p: sem_files(p) for p in (shm_keep, disk_keep)} == kept_before
    for path in (os.path.join(spool_dir, "keep"), disk_path):  # still work
        with shmq.Spool.open(path) as sp:
            g = sp.reader("grp", group=True)
            assert g.get(timeout=1).data == b"hello"
            sp.put(b"again")
            assert g.get(timeout=1).data == b"again"
            g.close()


def test_min_age_and_in_use_semaphores_are_kept(spool_dir):
    path = os.path.join(spool_dir, "open")
    sp = shmq.Spool.create(path, capacity="64KiB")
    os.unlink(path)  # removed while open: its semaphores are in use
    try:
        assert sp.sem_prefix not in run_gc("--min-age", "0")["semaphores"]
    finally:
        sp.close()
    assert sp.sem_prefix in run_gc("--min-age", "0")["semaphores"]  # now an orphan
    assert sp.sem_prefix not in run_gc("--min-age", "3600")["semaphores"]  # too young
    run_gc("--yes", "--min-age", "0")
    assert not sem_files(sp.sem_prefix)


def test_registry_is_untrusted_and_cleaned(spool_dir, disk_dir):
    """A registry entry protects only the spool it names (by inode): junk there
    changes nothing, and entries of removed spools go with --yes."""
    path = os.path.join(disk_dir, "s")
    prefix = _make(path)
    entry = os.path.join(registry_dir(), prefix)
    assert open(entry).read().split("\n")[0] == path
    os.unlink(path)  # removed with rm: the entry and the semaphores stay
    junk = os.path.join(registry_dir(), "0123456789ab")
    with open(junk, "w") as f:
        f.write("/etc/passwd\n\x00garbage\n")
    try:
        found = run_gc("--min-age", "0")
        assert prefix in found["semaphores"] and prefix in found["stale_registry_entries"]
        run_gc("--yes", "--min-age", "0")
        assert not sem_files(prefix) and not os.path.exists(entry)
    finally:
        for p in (junk, entry):
            if os.path.exists(p):
                os.unlink(p)
        try:
            os.rmdir(registry_dir())
        except OSError:
            pass


def test_destroy_forgets_the_registry_entry(disk_dir):
    path = os.path.join(disk_dir, "s")
    prefix = _make(path)
    assert os.path.exists(os.path.join(registry_dir(), prefix))
    shmq.Spool.destroy(path)
    assert not os.path.exists(os.path.join(registry_dir(), prefix))
    assert not sem_files(prefix)
