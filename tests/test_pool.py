"""shmq.ProcessPoolExecutor and shmq.Pool: errors at the stdlib's points, crashes cost a
retry (never the pool), data through shared memory, the parent's death and Ctrl-C.

CPython's own tests of its pools run against these in tests/test_cpython_pool.py;
what is here is what they do not cover: killed workers, shmq's additions, and
the failure paths of our own parts.
"""

import concurrent.futures as cf
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import psutil
import pytest

import pool_tasks as T
import shmq
from conftest import EMULATED, START_METHODS, assert_nothing_written_into, bound

HERE = os.path.dirname(os.path.abspath(__file__))


def executor(method="fork", **kw):
    return shmq.ProcessPoolExecutor(2, mp_context=method, **kw)


# -- errors at the stdlib's points -----------------------------------------------------

def test_executor_refuses_what_the_stdlibs_refuses():
    for n in (0, -1):
        with pytest.raises(ValueError, match="max_workers must be greater than 0"):
            shmq.ProcessPoolExecutor(n)
    with pytest.raises(TypeError, match="initializer must be a callable"):
        shmq.ProcessPoolExecutor(1, initializer=3)
    with pytest.raises(ValueError, match="incompatible with the 'fork'"):
        shmq.ProcessPoolExecutor(1, mp_context="fork", max_tasks_per_child=2)
    with pytest.raises(ValueError, match="max_tasks_per_child must be >= 1"):
        shmq.ProcessPoolExecutor(1, mp_context="spawn", max_tasks_per_child=0)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="max_attempts"):
            shmq.ProcessPoolExecutor(1, max_attempts=bad)
    ex = executor()
    try:
        with pytest.raises(TypeError):
            ex.submit(fn=T.square, x=1)  # fn is positional-only, as the stdlib's
        with pytest.raises(ValueError, match="chunksize must be >= 1"):
            ex.map(T.square, [1], chunksize=0)
        f = ex.submit(T.returns, T.FailsToPickle())  # fails its future, as the stdlib's
        others = [ex.submit(T.square, i) for i in range(10)]
        with pytest.raises(pickle.PicklingError, match="refuses to be pickled"):
            f.result(timeout=bound(30))
        assert type(f.exception().__cause__).__name__ == "_RemoteTraceback"
        assert [o.result(timeout=bound(30)) for o in others] == [i * i for i in range(10)]
    finally:
        ex.shutdown()
    with pytest.raises(RuntimeError, match="cannot schedule new futures after shutdown"):
        ex.submit(T.square, 2)


def test_pool_refuses_what_the_stdlibs_refuses():
    for n in (0, -1):
        with pytest.raises(ValueError, match="Number of processes must be at least 1"):
            shmq.Pool(n)
    for bad in (0, -1, 0.5, "12"):
        with pytest.raises(ValueError, match="maxtasksperchild"):
            shmq.Pool(1, maxtasksperchild=bad)
    with pytest.raises(TypeError, match="initializer must be a callable"):
        shmq.Pool(1, initializer=3)
    p = shmq.Pool(2, context="fork")
    try:
        with pytest.raises(ValueError, match="Pool is still running"):
            p.join()
        with pytest.raises(NotImplementedError):
            pickle.dumps(p)
        with pytest.raises(pickle.PicklingError, match="refuses to be pickled"):
            p.map(T.returns, [1, T.FailsToPickle(), 3])
        assert p.map(T.square, range(5)) == [0, 1, 4, 9, 16]  # and the pool goes on
        p.close()
        with pytest.raises(ValueError, match="Pool not running"):
            p.apply_async(T.square, (1,))
        p.join()
    finally:
        p.terminate()


def test_more_unpicklable_calls_than_the_window_all_fail_on_a_fresh_pool():
    """Calls that fail to pickle leave the window at once: those queued behind them
    are sent (and fail) too, rather than waiting for replies that never come (a
    hang CPython's own test_map_unplicklable found on a pool made just before)."""
    p = shmq.Pool(2, context="fork")  # a window of a few calls: 20 fill it several times
    try:
        res = p.map_async(T.returns, [T.FailsToPickle()] * 20)
        with pytest.raises(pickle.PicklingError, match="refuses to be pickled"):
            res.get(timeout=bound(30))
        assert p.map(T.square, range(5)) == [0, 1, 4, 9, 16]
    finally:
        p.terminate()
        p.join()
    with shmq.ProcessPoolExecutor(2) as ex:
        fs = [ex.submit(T.returns, T.FailsToPickle()) for _ in range(20)]
        for f in fs:
            with pytest.raises(pickle.PicklingError):
                f.result(timeout=bound(30))
        assert ex.submit(T.square, 3).result(timeout=bound(30)) == 9


@pytest.mark.parametrize("face", ["executor", "pool"])
def test_an_exception_comes_back_as_itself_with_the_workers_traceback(face):
    if face == "executor":
        with executor() as ex:
            exc = ex.submit(T.raise_value_error, 7).exception(timeout=bound(30))
    else:
        with shmq.Pool(1, context="fork") as p:
            with pytest.raises(ValueError) as ei:
                p.apply(T.raise_value_error, (7,))
            exc = ei.value
    assert type(exc) is ValueError and exc.args == ("bad", 7)
    text = "".join(traceback.format_exception(exc))
    assert 'raise ValueError("bad", x)' in text and "pool_tasks.py" in text  # the worker's frames


def test_a_result_that_cannot_be_unpickled_fails_alone():
    with executor() as ex:
        fs = [ex.submit(T.square, i) for i in range(20)]
        bad = ex.submit(T.fails_to_unpickle)
        fs += [ex.submit(T.square, i) for i in range(20, 40)]
        with pytest.raises(BrokenProcessPool, match="result could not be unpickled") as ei:
            bad.result(timeout=bound(30))
        assert "refuses to be loaded" in str(ei.value.__cause__)  # its traceback, as the stdlib's
        assert [f.result(timeout=bound(30)) for f in fs] == [i * i for i in range(40)]


def test_arguments_that_cannot_be_unpickled_in_the_worker_fail_alone():
    with shmq.Pool(2, context="fork") as p:
        res = p.map_async(T.returns, [1, T.FailsToUnpickle(), 3])
        with pytest.raises(BrokenProcessPool, match="could not be unpickled in its worker"):
            res.get(timeout=bound(30))
        assert p.map(T.square, range(6)) == [0, 1, 4, 9, 16, 25]


# -- a killed worker costs a retry -------------------------------------------------------

@pytest.mark.parametrize("method", START_METHODS)
def test_a_task_that_kills_its_worker_once_succeeds_on_its_retry(method, tmp_path):
    marker = str(tmp_path / "killed")
    with executor(method) as ex:
        before = [ex.submit(T.square, i) for i in range(30)]
        once = ex.submit(T.kill_once, marker, "second time lucky")
        after = [ex.submit(T.square, i) for i in range(30, 60)]
        assert once.result(timeout=bound(60)) == "second time lucky"
        assert os.path.exists(marker)  # it did kill a worker
        assert [f.result(timeout=bound(60)) for f in before + after] == [i * i for i in range(60)]
        assert list(ex.map(T.square, range(5))) == [0, 1, 4, 9, 16]  # the pool goes on


@pytest.mark.parametrize("method", START_METHODS)
def test_a_task_that_kills_every_worker_fails_alone_with_worker_crashed(method):
    with executor(method) as ex:
        t = time.monotonic()
        killer = ex.submit(T.kill_self)
        others = [ex.submit(T.square, i) for i in range(50)]
        with pytest.raises(shmq.WorkerCrashed) as ei:
            killer.result(timeout=bound(120))
        took = time.monotonic() - t
        assert [f.result(timeout=bound(60)) for f in others] == [i * i for i in range(50)]
        assert ex.submit(T.square, 9).result(timeout=bound(60)) == 81
    err = ei.value
    assert isinstance(err, BrokenProcessPool) and isinstance(err, shmq.ShmqError)
    assert "SIGKILL" in str(err) and "3 attempts" in str(err), str(err)
    assert err.exitcodes == (-signal.SIGKILL,) * 3 and err.attempts == 3
    assert took < bound(30), took  # seconds, not a hang


@pytest.mark.parametrize("how, text", [((T.segfault, ()), "SIGSEGV"),
                                       ((T.exit_with, (3,)), "exit code 3")])
def test_worker_crashed_names_how_the_worker_died(how, text):
    fn, args = how
    with executor(max_attempts=2) as ex:
        with pytest.raises(shmq.WorkerCrashed, match=f"{text}.*2 attempts|2 attempts.*{text}"):
            ex.submit(fn, *args).result(timeout=bound(60))


def test_pool_map_over_a_killer_returns():
    """multiprocessing.Pool.map waits for good when a worker is SIGKILLed (CPython
    gh-96062); ours raises WorkerCrashed for that task once its attempts are spent."""
    with shmq.Pool(2, context="fork") as p:
        res = p.map_async(T.kill_self, [signal.SIGKILL])
        with pytest.raises(shmq.WorkerCrashed):
            res.get(timeout=bound(60))
        res = p.map_async(T.square, range(100))
        assert res.get(timeout=bound(60)) == [i * i for i in range(100)]


# -- workers' lives ----------------------------------------------------------------------

def _assert_broken(face, method, why, **init):
    """A pool made so breaks: its first call fails with BrokenProcessPool matching
    ``why``, and (executor) so does every later submit."""
    if face == "executor":
        ex = shmq.ProcessPoolExecutor(2, mp_context=method, **init)
        try:
            f = ex.submit(T.square, 2)
            with pytest.raises(BrokenProcessPool, match=why):
                f.result(timeout=bound(60))
            with pytest.raises(BrokenProcessPool):
                ex.submit(T.square, 3)
        finally:
            ex.shutdown()
    else:
        p = shmq.Pool(2, context=method, **init)
        try:
            with pytest.raises(BrokenProcessPool, match=why):
                p.apply_async(T.square, (2,)).get(timeout=bound(60))
        finally:
            p.terminate()
            p.join()


@pytest.mark.parametrize("face", ["executor", "pool"])
def test_a_failing_initializer_breaks_the_pool_and_says_why(face):
    _assert_broken(face, "fork", "initializer says no", initializer=T.init_fails)


@pytest.mark.parametrize("face", ["executor", "pool"])
def test_workers_that_die_before_they_start_break_the_pool_and_say_why(face):
    # spawn pickles the initializer's arguments to each worker, which exits as it loads
    # them: before the pool's rings are open, so no call is ever taken.  The pool must
    # break, as the stdlib's executor does, not restart them forever with every call
    # (and the shutdown) waiting.
    _assert_broken(face, "spawn", r"died before they started 3 times in a row \(the last: exit code 3",
                   initializer=T.takes, initargs=(T.ExitsWhenUnpickled(),))


def test_initializer_runs_in_each_worker_and_max_tasks_per_child_replaces_them():
    with shmq.ProcessPoolExecutor(2, mp_context="forkserver", initializer=T.init_global,
                                  initargs=("ready",), max_tasks_per_child=3) as ex:
        assert {ex.submit(T.get_global).result(timeout=bound(60)) for _ in range(4)} == {"ready"}
        pids = [ex.submit(T.pid_of).result(timeout=bound(60)) for _ in range(12)]
    assert len(set(pids)) >= 4, pids  # each worker ran at most 3 tasks
    with shmq.Pool(1, maxtasksperchild=2, context="fork") as p:
        pids = [p.apply(T.pid_of) for _ in range(6)]
    assert len(set(pids)) == 3, pids


def test_shutdown_cancels_what_no_worker_was_given_and_wait_false_returns_at_once():
    ex = executor()
    fs = [ex.submit(time.sleep, 0.2) for _ in range(40)]
    t = time.monotonic()
    ex.shutdown(wait=False, cancel_futures=True)
    assert time.monotonic() - t < bound(2)
    cancelled = [f for f in fs if f.cancelled()]
    # a few ahead of the workers only, and those few run even when the burst had not
    # reached the window yet (the stdlib's call queue; CPython's test_cancel_futures)
    assert 30 <= len(cancelled) < 40, len(cancelled)
    for f in fs:
        if not f.cancelled():
            assert f.result(timeout=bound(60)) is None


def test_shutdown_leaves_no_thread_behind(monkeypatch):
    # a fork right after a shutdown must not copy a pool thread on its way out (the
    # suite's fork check refused the next pool's zygote so, under emulation, where a
    # thread takes long to leave after its last work: made slow here the same way)
    from shmq.pool import engine

    real_cleanup = engine.Engine._cleanup

    def slow_cleanup(self):
        real_cleanup(self)  # sets finished: what a shutdown used to wait for only
        time.sleep(0.3)

    monkeypatch.setattr(engine.Engine, "_cleanup", slow_cleanup)
    before = set(threading.enumerate())
    for method in ("fork", "spawn"):
        with executor(method) as ex:
            assert ex.submit(T.square, 3).result(timeout=bound(60)) == 9
        assert not set(threading.enumerate()) - before  # (an earlier test's may end meanwhile)
    p = shmq.Pool(2, context="fork")
    assert p.apply(T.square, (4,)) == 16
    p.close()
    p.join()
    assert not set(threading.enumerate()) - before
    p = shmq.Pool(2, context="fork")
    p.terminate()
    p.join()
    assert not set(threading.enumerate()) - before


def _blocked(status_path):
    with open(status_path) as f:
        mask = int(next(ln for ln in f if ln.startswith("SigBlk:")).split()[1], 16)
    return {sig for sig in (signal.SIGINT, signal.SIGTERM) if mask >> (sig - 1) & 1}


@pytest.mark.parametrize("how", ["terminate", "collected"])
def test_a_finished_pool_never_writes_to_its_closed_wake_pipe(how):
    # A Pool terminated (or collected, which terminates it) after its join used to wake
    # its supervisor through the pipe the join had closed: "x" went to whatever reused
    # the number (a newer pool's ring file lost its magic; a zygote's pipe announced a
    # message of gigabytes).  The number is given to a pipe of ours here: nothing may come.
    import gc

    p = shmq.Pool(2, context="fork")
    assert p.map(T.square, range(4)) == [0, 1, 4, 9]
    wake_w = p._engine._wake._w
    p.close()
    p.join()
    with pytest.raises(OSError):
        os.fstat(wake_w)  # closed by the join, free for anyone

    def finish():
        nonlocal p
        if how == "terminate":
            p.terminate()
        else:
            del p
            gc.collect()

    assert_nothing_written_into(wake_w, finish)


def _wait_idle(engine):
    deadline = time.monotonic() + bound(30)
    while not engine._idle and time.monotonic() < deadline:
        time.sleep(0.001)
    assert engine._idle, "the pool's result thread never went idle"


def test_a_wake_up_that_cannot_be_sent_delays_the_pool_never_hangs_it():
    # The result thread, idle, waits on the result queue for a reply or a WAKE.  A WAKE
    # whose put fails (the host out of descriptors or memory) is neither the submitting
    # caller's error nor a lost call, and the idle wait is bounded: the call still
    # runs and the shutdown still ends (the idle wait had no timeout: it waited forever).
    import errno

    from shmq.pool.wire import WAKE

    ex = executor()
    eng = ex._engine
    try:
        assert ex.submit(T.square, 3).result(timeout=bound(30)) == 9
        refused = []
        real_put = eng._results.put

        def put(item, *args, **kwargs):
            if item == (WAKE,):
                refused.append(item)
                raise OSError(errno.EMFILE, "Too many open files")
            return real_put(item, *args, **kwargs)

        eng._results.put = put
        _wait_idle(eng)
        assert ex.submit(T.square, 4).result(timeout=bound(30)) == 16
        _wait_idle(eng)
    finally:
        ex.shutdown(wait=False)
    assert eng.join(timeout=bound(30)), "the pool did not finish"
    assert refused  # the path under test ran: a wake-up was refused


@pytest.mark.skipif(EMULATED, reason="qemu-user keeps a guest's signal masks virtual: "
                                     "/proc shows the host thread's")
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pool_threads_leave_ctrl_c_to_the_main_thread(method):
    # A process-directed SIGINT goes to a thread that does not block it; had a pool
    # thread taken it, a main thread asleep in result() would sleep through Ctrl-C
    # (seen: test_ctrl_c_leaves_no_orphan_and_no_file hung so, now and then).
    with executor(method) as ex:
        pids = {ex.submit(T.pid_of).result(timeout=bound(60)) for _ in range(8)}
        ours = [t for t in threading.enumerate() if t.name in ("shmq-pool-supervisor", "shmq-pool-results")]
        assert len(ours) == 2
        for t in ours:  # (the supervisor opens them while it makes a worker: wait that out)
            path, deadline = f"/proc/self/task/{t.native_id}/status", time.monotonic() + bound(30)
            while _blocked(path) != {signal.SIGINT, signal.SIGTERM} and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _blocked(path) == {signal.SIGINT, signal.SIGTERM}, t.name
        assert not _blocked(f"/proc/self/task/{threading.get_native_id()}/status")
        for pid in pids:  # the workers, made by the supervisor: with the signals open
            assert not _blocked(f"/proc/{pid}/status"), pid


def test_threads_submit_at_once():
    with executor() as ex:
        out = {}

        def run(k):
            out[k] = [f.result(timeout=bound(60)) for f in [ex.submit(T.add, i, k) for i in range(300)]]

        threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(bound(60))
    assert out == {k: [i + k for i in range(300)] for k in range(4)}


# -- data --------------------------------------------------------------------------------

def test_numpy_and_arrow_travel_through_shared_memory():
    pa = pytest.importorskip("pyarrow")
    arrays = [np.arange(n, dtype=np.float64) for n in (0, 10, 1 << 20)]
    batch = pa.record_batch([pa.array(np.arange(100_000))], names=["x"])
    with executor() as ex:
        out = list(ex.map(T.double, arrays))
        for a, b in zip(arrays, out):
            assert b.dtype == a.dtype and np.array_equal(b, a * 2)
            assert b.flags.writeable  # the caller's own copy, as with the stdlib
        big = np.ones(1 << 20)
        assert np.array_equal(ex.submit(T.double_in_place, big).result(timeout=bound(60)), big * 2)
        assert ex.submit(T.arrow_sum, batch).result(timeout=bound(60)) == sum(range(100_000))
        got = ex.submit(T.returns, batch).result(timeout=bound(60))
        assert got.equals(batch)


def test_large_arguments_are_sent_a_few_at_a_time(monkeypatch):
    """A map over large arrays puts them into the request ring as workers can take them
    (at most the byte window ahead of the replies, one frame a put), not all at once."""
    from shmq.pool import engine

    monkeypatch.setattr(engine, "WINDOW_BYTES", 2 << 20)  # 4 MiB ahead for 2 workers
    puts = []  # (frames in the put, ring bytes in flight after it)
    real_send = engine.Engine._send

    def send(self, frames):
        real_send(self, frames)
        puts.append((len(frames), self._inflight_bytes))

    monkeypatch.setattr(engine.Engine, "_send", send)
    arrays = [np.full(1 << 17, float(i)) for i in range(24)]  # 1 MiB each, 24 MiB in all
    with executor() as ex:
        assert ex.submit(T.square, 3).result(timeout=bound(60)) == 9  # small ones first
        out = list(ex.map(T.double, arrays, timeout=bound(60)))
    assert [float(b[0]) for b in out] == [2.0 * i for i in range(24)]
    big = puts[1:]  # the map's
    assert sum(n for n, _ in big) == 24 and all(n == 1 for n, _ in big), big
    # in flight: the window, plus the one put that crossed it (a frame is 1 MiB and a header)
    assert max(b for _, b in big) < (4 << 20) + (1 << 20) + 4096, big


# -- the parent's end --------------------------------------------------------------------

def _tree(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _gone(procs, limit):
    def dead(p):
        try:
            return p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    end = time.monotonic() + limit
    while time.monotonic() < end and not all(dead(p) for p in procs):
        time.sleep(0.02)
    alive = [p.pid for p in procs if not dead(p)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive


def _start(scenario, method, directory, *extra):
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "pool_tasks.py"), scenario, method,
                          str(directory), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    line = p.stdout.readline()
    if not line.startswith("ready"):
        p.kill()
        raise AssertionError(f"the parent program did not start: {line!r} {p.communicate()[1]}")
    return p


@pytest.mark.parametrize("method", START_METHODS)
def test_a_sigkilled_parent_leaves_no_workers_and_its_files_are_reclaimed(method, tmp_path):
    p = _start("wait", method, tmp_path)
    try:
        tree = [x for x in _tree(p.pid) if "resource_tracker" not in " ".join(x.cmdline())]
        files = T.queues_of(p.pid)
        assert len(files) == 2 and tree
        for x in _tree(p.pid):  # the parent and its resource tracker with it: the worst case
            if "resource_tracker" in " ".join(x.cmdline()):
                x.kill()
        p.kill()
        p.wait(bound(30))
    finally:
        p.stdout.close()
        p.stderr.close()
    assert not _gone(tree, bound(10))  # the parent-death signal: every worker, the zygote
    # The last process to close a queue whose creator is dead removes it (a worker, the
    # zygote); whatever is left, shmq gc (or the next anonymous queue made) reclaims.
    from shmq import gc

    # Swept until none is left, within a bound: a file any live process holds a handle
    # to is no orphan at that moment, and another test of the run (an `shmq top -a`, a
    # sweep: each opens every anonymous queue for a moment, for seconds under emulation)
    # may hold one just then.  What is checked is that gc reclaims them all.
    left = [f for f in files if os.path.exists(f)]
    deadline = time.monotonic() + bound(10)
    while True:
        reclaimed = set(gc.sweep(remove=True).queues)
        left = [f for f in left if f not in reclaimed and os.path.exists(f)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"not reclaimed by shmq gc within {bound(10)} s: {left}"
    assert not any(os.path.exists(f) for f in files)


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("face", ["executor", "pool"])
def test_ctrl_c_leaves_no_orphan_and_no_file(method, face, tmp_path):
    """SIGINT to the process group (a terminal's Ctrl-C) while the parent waits for a
    600 s task: the parent exits with the KeyboardInterrupt at once, its workers and
    files go with it."""
    p = _start("ctrl-c", method, tmp_path, face)
    try:
        tree = _tree(p.pid)
        files = T.queues_of(p.pid)
        assert len(files) == 2
        os.killpg(p.pid, signal.SIGINT)
        _out, err = p.communicate(timeout=bound(30))
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0 and "KeyboardInterrupt" in err, err
    assert not _gone(tree, bound(10))
    assert not any(os.path.exists(f) for f in files)


def test_import_shmq_loads_the_pools_only_on_use():
    """``import shmq`` loads neither the pools nor the worker platform nor
    ``concurrent.futures.process``; the first use of a name loads them."""
    code = ("import sys, shmq\n"
            "early = sorted(m for m in sys.modules if m.startswith(('shmq.pool', 'shmq.workers'))"
            " or m == 'concurrent.futures.process')\n"
            "assert not early, early\n"
            "from concurrent.futures.process import BrokenProcessPool\n"
            "assert issubclass(shmq.WorkerCrashed, BrokenProcessPool)\n"
            "assert issubclass(shmq.WorkerCrashed, shmq.ShmqError)\n"
            "assert shmq.Pool.__module__ == 'shmq.pool.pool' and 'shmq.pool' in sys.modules\n"
            "assert shmq.ProcessPoolExecutor.__module__ == 'shmq.pool.executor'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=bound(60))
    assert proc.returncode == 0, proc.stderr[-3000:]
