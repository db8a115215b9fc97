"""Shared fixtures: a private spool directory on /dev/shm, start methods, leak checks."""

import faulthandler
import fcntl
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
import warnings

import psutil
import pytest

import shmq

# Third-party libraries the tests import start idle thread pools at import time:
# OpenBLAS (numpy) one worker per extra core, pyarrow's jemalloc a background
# purging thread.  Either makes this process multi-threaded, and every fork-start
# test after it would fork a multi-threaded process (what CPython 3.12+ warns
# about, and what the fork check below refuses).  The tests use neither BLAS nor
# jemalloc's background purging; set before any test module imports numpy or
# pyarrow (children inherit the settings, harmlessly).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")

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


#: Tests that each take tens of seconds (a sanitizer build, a chaos run, a Spark
#: job in a subprocess).  They run first, so xdist spreads them over its workers at
#: the start instead of leaving one worker with a long tail after the quick tests.
SLOW_FIRST = ("tests/test_examples.py::test_example_runs[spark_pipeline",
              "tests/test_examples.py::test_example_runs[spark_sidecar",
              "tests/test_sanitize.py::", "tests/test_stress.py::")
#: Tests that start a SparkSession in this process: its py4j threads (gateway,
#: callback and accumulator servers) live on until the session ends, and a later
#: fork in this process would fork them too (the fork check below refuses).  They
#: run last: xdist hands items out in this order, so once a worker got one of them
#: it gets nothing else after it.
IN_PROCESS_JVM = ("tests/test_spark.py::",)


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        if item.nodeid.startswith(IN_PROCESS_JVM):
            return 2
        return 0 if item.nodeid.startswith(SLOW_FIRST) else 1

    items.sort(key=rank)  # stable


# -- fork with threads -------------------------------------------------------------
#
# CPython 3.12+ warns "This process (pid=N) is multi-threaded, use of fork() may lead
# to deadlocks in the child" (a DeprecationWarning, raised in the parent *after* the
# fork), and pyproject's filterwarnings turns it into an error.  But the harness has
# threads of its own that would trip CPython's count on every fork: in a pytest-xdist
# worker execnet's IO thread (started before pytest), and in every run the watchdog
# thread of pytest's faulthandler_timeout (one per test, started before the test's
# setup).  So os.fork is checked here instead, on every Python: before forking it
# counts the process's threads (/proc/self/task, as CPython does) other than the
# caller, execnet's (those present when pytest configured; none in a plain run) and
# the current faulthandler watchdog, and raises that same DeprecationWarning (the
# filter makes it an error) before any child exists.  CPython's own warning is then
# silenced for that fork: it would only repeat the check with the harness counted.

_FORK_TOLERATED = frozenset()  # thread ids present before any test ran
_WATCHDOG = set()  # the faulthandler_timeout thread of the running test
_real_fork = os.fork
_real_dump_later = faulthandler.dump_traceback_later
_FORK_MSG = ("This process (pid={pid}) is multi-threaded, use of fork() may lead to "
             "deadlocks in the child (threads other than the caller: {names})")


def _tids():
    return {int(t) for t in os.listdir("/proc/self/task")}


def _emulated():
    """True under qemu-user: the kernel's own /proc/self/exe (reached through "//proc",
    a path qemu does not intercept) is the emulator, not the interpreter it runs."""
    try:
        return os.path.basename(os.readlink("//proc/self/exe")).startswith("qemu-")
    except OSError:
        return False


EMULATED = _emulated()


def _qemu_thread():
    """The one thread of qemu-user's own in this process, or None.

    qemu-user runs each emulated process with one host thread of its own (its RCU
    thread, ``call_rcu``), started before any guest code runs: at the emulator's
    start, or by its fork handler in a forked child before fork() returns.  It
    never runs guest code, so it is harmless to fork, but it is in /proc/self/task
    like any thread.  Two facts single it out, read from the kernel's real procfs:
    it is the first thread created after the main one (every guest thread starts
    later), and qemu creates it with every signal blocked (qemu_thread_create),
    where a guest thread's host mask is empty (qemu keeps guest masks virtual).
    Only one thread is ever discounted, so a real second thread is still refused.
    """
    main = os.getpid()
    starts = {}
    for tid in _tids() - {main}:
        try:
            with open(f"//proc/{main}/task/{tid}/stat") as f:
                # field 22 (starttime), counted after the ")" that ends comm
                starts[tid] = int(f.read().rsplit(")", 1)[1].split()[19])
        except (OSError, IndexError, ValueError):
            continue
    if not starts:
        return None
    first = min(starts, key=lambda t: (starts[t], t))
    try:
        with open(f"//proc/{main}/task/{first}/status") as f:
            blocked = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    except (OSError, StopIteration, ValueError):
        return None
    must = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGUSR1 - 1)) \
        | (1 << (signal.SIGCHLD - 1)) | (1 << (signal.SIGALRM - 1))
    return first if blocked & must == must else None


def _other_threads():
    others = _tids() - {threading.get_native_id()} - _FORK_TOLERATED - _WATCHDOG
    if EMULATED and others:
        others.discard(_qemu_thread())
    return others


def _thread_names(tids):
    names = []
    for tid in sorted(tids):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f"{tid} {f.read().strip()}")
        except OSError:
            names.append(str(tid))
    return ", ".join(names)


def _checked_fork():
    others = _other_threads()
    if others:
        # A thread that Thread.join() has just returned for may still be leaving the
        # kernel for a few microseconds (3.12's join waits on a lock released before the
        # OS thread exits), and so may a cancelled faulthandler watchdog: give exiting
        # threads a bounded moment before blaming them.
        deadline = time.monotonic() + 1.0
        while others and time.monotonic() < deadline:
            time.sleep(0.001)
            others = _other_threads()
    if others:
        warnings.warn(_FORK_MSG.format(pid=os.getpid(), names=_thread_names(others)),
                      DeprecationWarning, stacklevel=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"This process .* is multi-threaded",
                                category=DeprecationWarning)
        return _real_fork()


def _dump_later(timeout, *args, **kwargs):
    """faulthandler.dump_traceback_later, noting the watchdog thread it starts, and
    ending the process after the dump: a test still running at pyproject's
    faulthandler_timeout (times TIMEOUT_SCALE, as every bound) is hung, and a hung
    test must fail its run (under xdist, a crashed worker, replaced) rather than
    keep it going until the CI job's limit."""
    kwargs["exit"] = True
    before = _tids()
    _real_dump_later(timeout * TIMEOUT_SCALE, *args, **kwargs)
    _WATCHDOG.clear()
    _WATCHDOG.update(_tids() - before)


def pytest_configure(config):
    global _FORK_TOLERATED
    _FORK_TOLERATED = frozenset(_tids() - {threading.get_native_id()})
    os.fork = _checked_fork
    faulthandler.dump_traceback_later = _dump_later
    # A shell script's background job (`pytest ... &`) starts with SIGINT ignored, and
    # every process a test starts would inherit that: the Ctrl-C tests would wait out
    # their bounds and fail.  They simulate a terminal's Ctrl-C, so they need Python's
    # own disposition (a handler here; SIG_DFL, hence Python's handler, after exec).
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config):
    os.fork = _real_fork
    faulthandler.dump_traceback_later = _real_dump_later


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or a plain run)
        session.config._shmq_before = _our_leftovers()
        session.config._shmq_private_dir_existed = os.path.lexists(_private_dir())


def _private_dir():
    from shmq._mapping import default_dir

    return default_dir()


def _remove_private_dir(private):
    """Remove the private directory this run created, with shmq gc's registry in it
    (the library's bookkeeping: empty once every registered spool is destroyed);
    return what is still in them, [] once removed."""
    from shmq._mapping import registry_dir

    registry = registry_dir()
    try:
        if os.path.isdir(registry):
            os.rmdir(registry)
        os.rmdir(private)  # created by bare-name tests; empty when they cleaned up
        return []
    except OSError:
        return [f"{d}/{n}" for d in (private, registry) if os.path.isdir(d)
                for n in sorted(os.listdir(d))]


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
    if leaked:
        # xdist reports a worker finished before the worker's interpreter shuts
        # down, and its last handles are closed (semaphores unmapped, then
        # unlinked) during that shutdown.  Natively that is over before this
        # check; under emulation (.ci/aarch64) it is not.  So before blaming
        # the suite, wait for our child processes to exit, and look again.
        psutil.wait_procs(psutil.Process().children(recursive=True), timeout=bound(10))
        leaked = sorted(_our_leftovers() - before - _mapped_by_live_processes())
    private = _private_dir()
    if not session.config._shmq_private_dir_existed and os.path.isdir(private):
        left = _remove_private_dir(private)
        if left:  # as above: a worker's last handles may still be closing
            psutil.wait_procs(psutil.Process().children(recursive=True), timeout=bound(10))
            left = _remove_private_dir(private)
        leaked += left
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


#: The source tree that tests reading sources (C files, stress/ programs that
#: build or analyse the package, pyproject.toml) use: the checkout these tests
#: belong to, or SHMQ_SOURCE_ROOT when the tests run against an installed build
#: from a tree without shmq/ (.ci/aarch64 does, so that every import finds the
#: installed package).  Never put on sys.path: its shmq/ may have no built core.
SOURCE_ROOT = os.environ.get("SHMQ_SOURCE_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The compiled core's C sources.
CORE_SOURCES = os.path.join(SOURCE_ROOT, "shmq", "core")

#: Multiplies the bounds tests put on waits that only a bug should exhaust
#: (``bound(30)``), never a timeout a test expects to run out.  1 natively;
#: .ci/aarch64 sets SHMQ_TEST_TIMEOUT_SCALE for qemu-user, where a spawned
#: child alone takes ~15 s to start (CPython's test.support scales its
#: SHORT_TIMEOUT/LONG_TIMEOUT for slow buildbots the same way).
TIMEOUT_SCALE = float(os.environ.get("SHMQ_TEST_TIMEOUT_SCALE") or 1)


def pyspark_unsupported():
    """Why the installed pyspark is not run on this CPython, or None (also when it is not
    installed: the tests' importorskip says that).  pyspark must list this version in its
    "Programming Language :: Python :: X.Y" classifiers: pip installs it anywhere its
    requires-python allows (>=3.11), including versions it was never released for."""
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        md = metadata("pyspark")
    except PackageNotFoundError:
        return None
    prefix = "Programming Language :: Python :: "
    claimed = [c[len(prefix):] for c in md.get_all("Classifier") or [] if c.startswith(prefix + "3.")]
    here = "%d.%d" % sys.version_info[:2]
    if here in claimed:
        return None
    return (f"pyspark {md['Version']} does not support CPython {here} "
            f"(its classifiers list {', '.join(claimed) or 'no 3.x version'})")


def bound(seconds):
    """``seconds`` scaled by :data:`TIMEOUT_SCALE`: the bound on a wait that should never run out."""
    return seconds * TIMEOUT_SCALE


@pytest.fixture
def safety_net():
    """``safety_net(seconds)`` raises the cap on every parked sleep (so that a missed
    wake-up would cost visibly); the previous cap is restored after the test."""
    from shmq import _notify

    olds = []
    yield lambda seconds: olds.append(_notify.set_safety_net(seconds))
    if olds:
        _notify.set_safety_net(olds[0])


def join_all(procs, timeout=60):
    """Join processes with a bound (scaled by :data:`TIMEOUT_SCALE`); kill and fail on a hang."""
    timeout = bound(timeout)
    for p in procs:
        p.join(timeout)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(5)
    assert not hung, f"{len(hung)} process(es) hung"
    return [p.exitcode for p in procs]


def sem_files(prefix):
    """The named semaphores of the spool with this semaphore prefix, as /dev/shm file names."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"sem.shmq.{prefix}.")}


def assert_nothing_written_into(freed, action):
    """Give the closed descriptor number ``freed`` to a new pipe's write end, run
    ``action`` (code that must no longer write to that number) and assert that the
    pipe stayed empty: a late write would have corrupted whatever file took the number."""
    r0, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    r = fcntl.fcntl(r0, fcntl.F_DUPFD_CLOEXEC, freed + 1)  # the read end never on the number
    os.close(r0)
    try:
        if w != freed:
            os.dup2(w, freed, inheritable=False)
            os.close(w)
        action()
        with pytest.raises(BlockingIOError):
            os.read(r, 16)
    finally:
        os.close(r)
        os.close(freed)


def run_gc(*args):
    """``shmq gc --json ARGS`` in a child interpreter: its JSON report (asserting exit 0)."""
    proc = subprocess.run([sys.executable, "-m", "shmq", "gc", "--json", *args],
                          capture_output=True, text=True, timeout=bound(120))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)
