"""CPython's own tests of its process pools, run against shmq's.

* ``test.test_concurrent_futures`` (a package on 3.12+, one module on 3.11):
  every test class CPython makes for its ``ProcessPoolExecutor``
  (``ProcessPool{Fork,Forkserver,Spawn}...``: the executor, wait,
  as_completed, initializer, shutdown, deadlock and process-pool tests) is
  subclassed here with ``executor_type = shmq.ProcessPoolExecutor``.
* ``test._test_multiprocessing``'s ``_TestPool``, ``_TestPoolWorkerErrors``
  and ``_TestPoolWorkerLifetime``, mixed as CPython mixes them, with
  ``Pool`` (and ``multiprocessing.Pool``, which some call directly) bound to
  ``shmq.Pool`` and a start method.

Tests that start a Python subprocess importing the stdlib's class by name
(``from concurrent.futures import ProcessPoolExecutor``) run with a first
line that binds that name to shmq's.  Nothing of CPython's test code is
copied here; :data:`EXCLUDED` lists, with its reason, every test that does
not run.  Where the interpreter lacks the ``test`` package, the module is
skipped with the reason.

Which start methods run in the suite (its cost; docs/pool.md has the
figures): every start method runs the multiprocessing classes and the
executor classes under fork and forkserver; the executor classes under
spawn (each test starts five interpreters) run with
``SHMQ_CPYTHON_SPAWN=1`` (CI does; ``.ci/run``), else a sample of them.

Under fork, some of CPython's tests make a pool while another pool of the
test still runs: that pool's threads run while the new pool forks its
zygote, as the stdlib's pools fork while their threads run.  The suite's
fork check (conftest.py) tolerates exactly those threads here (named
``shmq-pool-*``); shmq itself never forks a process it runs threads in.
"""

import importlib
import multiprocessing
import os
import sys
import threading
import unittest
from functools import partial
from unittest import mock

import pytest

import shmq

EXCLUDED = {
    # -- concurrent.futures --------------------------------------------------------------
    "test_killed_child": "asserts that one killed worker breaks the whole pool: the "
                         "behaviour shmq's replaces (the task runs again, then fails alone)",
    "test_saturation": "reads the private _processes and _max_workers",
    "test_idle_process_reuse_one": "reads the private _processes",
    "test_idle_process_reuse_multiple": "reads the private _processes",
    "test_max_tasks_per_child": "reads the private _processes",
    "test_max_tasks_per_child_defaults_to_spawn_context": "reads the private _mp_context",
    "test_python_finalization_error": "patches the private threading._start_joinable_thread "
                                      "to fail the stdlib executor's second thread",
    "test_processes_terminate": "reads the private _processes",
    "test_context_manager_shutdown": "reads the private _processes",
    "test_del_shutdown": "reads the private _executor_manager_thread, _processes, _call_queue",
    "test_shutdown_no_wait": "reads the private _executor_manager_thread, _processes, "
                             "_call_queue",
    "test_shutdown_deadlock_pickle": "reads the private _executor_manager_thread",
    "test_gh105829_should_not_deadlock_if_wakeup_pipe_full": "patches the private "
                                                             "_ExecutorManagerThread and _ThreadWakeup",
    "FailingInitializer.test_initializer": "reads the private _broken (tests/test_pool.py "
                                           "tests a failing initializer)",
    "FailingInitializerResourcesTest": "runs the stdlib's own executor classes, by name",
    # -- multiprocessing.Pool --------------------------------------------------------------
    "test_make_pool": "reads the private _pool (tests/test_pool.py checks the errors)",
    "test_resource_warning": "sets the private _state",
    "test_pool_worker_lifetime": "reads the private _pool and calls _repopulate_pool",
}


def _excluded(case):
    name = case._testMethodName
    for key in (f"{type(case).__name__}.{name}", name):
        if key in EXCLUDED:
            return EXCLUDED[key]
    for key, why in EXCLUDED.items():
        if "." in key:
            cls, meth = key.split(".", 1)
            if meth == name and cls in type(case).__name__:
                return why
    return None


def _with_first_line(real, line):
    """``assert_python_ok`` whose ``-c`` program starts with ``line``."""
    def run(*args, **kw):
        args = list(args)
        if "-c" in args:
            i = args.index("-c") + 1
            args[i] = line + "\n" + args[i]
        return real(*args, **kw)
    return run


#: ``multiprocessing`` too: CPython skips test_hang_gh83386 for its own executor (it hangs
#: there), and its program uses ``multiprocessing`` without importing it.
EXECUTOR_LINE = ("import concurrent.futures, multiprocessing, shmq; "
                 "concurrent.futures.ProcessPoolExecutor = shmq.ProcessPoolExecutor")
POOL_LINE = "import multiprocessing, shmq; multiprocessing.Pool = shmq.Pool"


@pytest.fixture(scope="module", autouse=True)
def _pool_threads_are_the_tests():
    """The fork check tolerates the threads of pools the test made (see the docstring)."""
    import conftest

    real = conftest._other_threads

    def others():
        return real() - {t.native_id for t in threading.enumerate() if t.name.startswith("shmq-pool")}

    with pytest.MonkeyPatch.context() as m:
        m.setattr(conftest, "_other_threads", others)
        yield


# -- concurrent.futures --------------------------------------------------------------------

def _cf_modules():
    try:
        pkg = importlib.import_module("test.test_concurrent_futures")
    except ImportError:
        return None
    if not hasattr(pkg, "__path__"):  # 3.11: one module
        return [pkg]
    names = ("executor", "test_process_pool", "test_shutdown", "test_wait", "test_as_completed",
             "test_init", "test_deadlock")
    return [importlib.import_module(f"test.test_concurrent_futures.{n}") for n in names]


CF_MODULES = _cf_modules()
SPAWN_ALL = os.environ.get("SHMQ_CPYTHON_SPAWN") == "1"
#: Without SHMQ_CPYTHON_SPAWN=1, the spawn classes run only these methods (their
#: executor's start is what spawn changes; the rest is the same code as fork's).
SPAWN_SAMPLE = {"test_submit", "test_map", "test_traceback", "test_initializer",
                "test_crash_during_func_exec_on_worker", "test_error_at_task_pickle",
                "test_exit_at_task_unpickle", "test_interpreter_shutdown",
                "test_cancel_futures", "test_first_completed", "test_no_timeout"}


def _executor_case(base):
    class Case(base):
        executor_type = shmq.ProcessPoolExecutor

        def setUp(self):
            why = _excluded(self)
            if why:
                self.skipTest(why)
            if "Spawn" in type(self).__name__ and not SPAWN_ALL and self._testMethodName not in SPAWN_SAMPLE:
                self.skipTest("spawn: a sample runs in the suite; SHMQ_CPYTHON_SPAWN=1 runs all")
            mod = sys.modules[base.__module__]
            if hasattr(mod, "assert_python_ok"):  # its subprocesses import ours by the stdlib's name
                p = mock.patch.object(mod, "assert_python_ok",
                                      _with_first_line(mod.assert_python_ok, EXECUTOR_LINE))
                p.start()
                self.addCleanup(p.stop)
            super().setUp()

    name = "Shmq" + base.__name__
    Case.__name__ = Case.__qualname__ = name
    Case.__module__ = __name__
    return name, Case


if CF_MODULES is None:
    class TestConcurrentFuturesSuite(unittest.TestCase):
        @unittest.skip("this interpreter has no test.test_concurrent_futures (a build without "
                       "the test package): CPython's executor tests cannot run here")
        def test_missing(self):
            pass
else:
    for _mod in CF_MODULES:
        for _n, _cls in sorted(vars(_mod).items()):
            if (_n.startswith("ProcessPool") and isinstance(_cls, type)
                    and issubclass(_cls, unittest.TestCase) and _cls.__module__ == _mod.__name__):
                _name, _case = _executor_case(_cls)
                globals()[_name] = _case
    del _mod, _n, _cls


# -- multiprocessing.Pool -------------------------------------------------------------------

try:
    tm = importlib.import_module("test._test_multiprocessing")
except ImportError:
    tm = None

POOL_METHODS = ["fork", "forkserver", "spawn"]


def _pool_cases(method):
    ctx = multiprocessing.get_context(method)
    pool = partial(shmq.Pool, context=ctx)

    class Mixin(tm.ProcessesMixin):
        Process = ctx.Process
        Pool = staticmethod(pool)

    def setUp(self):
        why = _excluded(self)
        if why:
            self.skipTest(why)
        for target, attr, repl in ((multiprocessing, "Pool", pool),
                                   (tm.test.support.script_helper, "assert_python_ok",
                                    _with_first_line(tm.test.support.script_helper.assert_python_ok,
                                                     POOL_LINE))):
            p = mock.patch.object(target, attr, repl)
            p.start()
            self.addCleanup(p.stop)

    out = {}
    for base in (tm._TestPool, tm._TestPoolWorkerErrors, tm._TestPoolWorkerLifetime):
        name = f"TestShmq{base.__name__.lstrip('_')}{method.capitalize()}"
        # the base order CPython's install_tests_in_module_dict() uses
        out[name] = type(name, (base, Mixin, unittest.TestCase), {"setUp": setUp, "__module__": __name__})
    return out


if tm is None:
    class TestMultiprocessingPoolSuite(unittest.TestCase):
        @unittest.skip("this interpreter has no test._test_multiprocessing (a build without "
                       "the test package): CPython's Pool tests cannot run here")
        def test_missing(self):
            pass
else:
    for _m in POOL_METHODS:
        globals().update(_pool_cases(_m))
    del _m
