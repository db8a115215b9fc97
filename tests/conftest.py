"""Shared fixtures: a private spool directory on /dev/shm, start methods, leak checks."""

import multiprocessing as mp
import os
import shutil
import uuid

import pytest

import shmq

START_METHODS = ["fork", "spawn", "forkserver"]


#: Tags this run's test directories, so the leak check never blames this run
#: for another test run's directories on the same machine (xdist workers
#: inherit it from the controller's environment).
SESSION_TAG = os.environ.setdefault("SHMQ_TEST_SESSION", uuid.uuid4().hex[:4])


def _mapped_by_live_processes():
    """/dev/shm files some live process has mapped (another run's semaphores in use)."""
    mapped = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if "/dev/shm/sem.shmq." in line:
                        mapped.add(os.path.basename(line.split()[-1]))
        except OSError:
            continue
    return mapped


def _our_leftovers():
    """shmq semaphores and this run's test directories currently in /dev/shm."""
    return {n for n in os.listdir("/dev/shm")
            if n.startswith(("sem.shmq.", f"shmq-test-{SESSION_TAG}-"))}


#: Tests that each take tens of seconds (a JVM, a sanitizer build, a chaos run).
#: They run first, so xdist spreads them over its workers at the start instead
#: of leaving one worker with a long tail after the quick tests are done.
SLOW_FIRST = ("tests/test_examples.py::test_example_runs[spark_pipeline",
              "tests/test_examples.py::test_example_runs[spark_sidecar",
              "tests/test_spark.py::", "tests/test_sanitize.py::", "tests/test_stress.py::")


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(SLOW_FIRST))  # stable


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or a plain run)
        session.config._shmq_before = _our_leftovers()
        session.config._shmq_private_dir_existed = os.path.lexists(_private_dir())


def _private_dir():
    from shmq._mapping import default_dir

    return default_dir()


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if the suite left semaphores or spool directories in /dev/shm.

    Checked once, in the controller, after every xdist worker has finished:
    a per-worker check would see other workers' live semaphores.
    """
    before = getattr(session.config, "_shmq_before", None)
    if before is None:
        return
    # A semaphore still mapped by a live process belongs to something running
    # (another test run on this machine): only unmapped ones are debris.
    leaked = sorted(_our_leftovers() - before - _mapped_by_live_processes())
    private = _private_dir()
    if not session.config._shmq_private_dir_existed and os.path.isdir(private):
        try:
            os.rmdir(private)  # created by bare-name tests; empty when they cleaned up
        except OSError:
            leaked += [f"{private}/{n}" for n in sorted(os.listdir(private))]
    if leaked:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        msg = f"tests left {len(leaked)} item(s) in /dev/shm: {leaked[:10]}"
        if tr:
            tr.write_line(msg, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def spool_dir():
    """A fresh directory under /dev/shm, removed (with any spool in it) afterwards."""
    d = f"/dev/shm/shmq-test-{SESSION_TAG}-{uuid.uuid4().hex[:8]}"
    os.mkdir(d, 0o700)
    yield d
    for name in os.listdir(d):
        p = os.path.join(d, name)
        try:
            shmq.Spool.destroy(p)
        except Exception:
            pass
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def spool_path(spool_dir):
    return os.path.join(spool_dir, "spool")


@pytest.fixture
def make_spool(spool_dir):
    """Factory: ``make_spool(capacity=..., on_full=..., name=...)``; closed and destroyed after."""
    made = []

    def make(capacity="1MiB", on_full="overwrite", name=None, **kw):
        path = os.path.join(spool_dir, name or f"s{len(made)}")
        sp = shmq.Spool.create(path, capacity=capacity, on_full=on_full, **kw)
        made.append(sp)
        return sp

    yield make
    for sp in made:
        sp.close()


@pytest.fixture(params=START_METHODS)
def ctx(request):
    """A multiprocessing context for each start method."""
    return mp.get_context(request.param)


def join_all(procs, timeout=60):
    """Join processes with a bound; kill and fail on a hang."""
    for p in procs:
        p.join(timeout)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(5)
    assert not hung, f"{len(hung)} process(es) hung"
    return [p.exitcode for p in procs]
