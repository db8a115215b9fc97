"""CPython's own multiprocessing queue tests, run against shmq's queues.

``_TestQueue`` from this interpreter's ``test/_test_multiprocessing.py`` is
mixed with a mixin whose ``Queue``/``JoinableQueue`` are shmq's, under the
fork and spawn start methods.  Tests that call ``multiprocessing.Queue``
directly run with ``multiprocessing.Queue`` patched to shmq's for their
duration.  Skipped, with reasons:

* ``test_queue_feeder_donot_stop_onexc`` and
  ``test_queue_feeder_on_queue_feeder_error``: they test the stdlib's feeder
  thread, which swallows pickling errors after ``put`` returned.  shmq has
  no feeder thread and raises the pickling error from ``put`` itself
  (deliberately: the caller learns at once, nothing is lost silently).
"""

import multiprocessing
import unittest
from unittest import mock

import pytest

import shmq

tm = pytest.importorskip("test._test_multiprocessing")

FEEDER_ONLY = {
    "test_queue_feeder_donot_stop_onexc": "tests the stdlib feeder thread; shmq raises at put()",
    "test_queue_feeder_on_queue_feeder_error": "tests the stdlib feeder thread's error hook",
}
PATCH_GLOBAL = {"test_no_import_lock_contention", "test_timeout", "test_closed_queue_put_get_exceptions"}


def _make(start_method):
    ctx = multiprocessing.get_context(start_method)

    class Mixin(tm.ProcessesMixin):
        Process = ctx.Process
        Event = staticmethod(ctx.Event)
        Queue = staticmethod(shmq.Queue)
        JoinableQueue = staticmethod(shmq.JoinableQueue)

    # The same base order CPython's install_tests_in_module_dict() uses.
    class TestShmqQueue(tm._TestQueue, Mixin, unittest.TestCase):
        def setUp(self):
            name = self._testMethodName
            if name in FEEDER_ONLY:
                self.skipTest(FEEDER_ONLY[name])
            if name in PATCH_GLOBAL:
                for target, repl in (("Queue", shmq.Queue), ("JoinableQueue", shmq.JoinableQueue)):
                    patcher = mock.patch.object(multiprocessing, target, repl)
                    patcher.start()
                    self.addCleanup(patcher.stop)
            super().setUp()

    return TestShmqQueue


# Module-level names, so spawned children can unpickle the classmethod targets.
TestShmqQueueFork = _make("fork")
TestShmqQueueFork.__name__ = TestShmqQueueFork.__qualname__ = "TestShmqQueueFork"
TestShmqQueueSpawn = _make("spawn")
TestShmqQueueSpawn.__name__ = TestShmqQueueSpawn.__qualname__ = "TestShmqQueueSpawn"
