"""shmq.pool.futures.PoolFuture: a ``concurrent.futures.Future`` whose condition is made on
first use must behave as the stdlib's in every state, with stdlib functions that take the
condition (wait, as_completed), across threads, and in a forked child.

The pools' own use of it is tested in test_pool.py and by CPython's tests
(test_cpython_pool.py)."""

import concurrent.futures as cf
import os
import pickle
import select
import signal
import threading
import traceback
import warnings

import pytest

from shmq.pool import futures as pf
from shmq.pool.futures import PoolFuture

import conftest
from conftest import bound


def test_it_has_the_stdlib_futures_attributes_the_condition_and_lists_once_used():
    # If a Python version adds one to Future.__init__, PoolFuture must too.
    made_on_use = {"_condition", "_waiters", "_done_callbacks"}
    stdlib = set(vars(cf.Future()))
    assert made_on_use <= stdlib
    f = PoolFuture()
    assert set(vars(f)) == stdlib - made_on_use
    assert isinstance(f, cf.Future) and not f._has_condition
    assert not f.done() and not f.running() and not f.cancelled()
    assert f._waiters == [] and f._has_condition  # reading one makes all three
    assert set(vars(f)) == stdlib | {"_has_condition"}
    assert isinstance(f._condition, threading.Condition) and f._done_callbacks == []
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        f.nope  # noqa: B018


def test_the_fast_path_makes_no_condition():
    f = PoolFuture()
    assert f.set_running_or_notify_cancel() is True and f.running()
    f.set_result(42)
    assert f.result() == 42 and f.result(timeout=0) == 42 and f.exception() is None
    assert f.done() and not f.cancelled()
    assert not f._has_condition


def test_an_exception_is_raised_with_its_traceback():
    def boom():
        raise KeyError("k")

    try:
        boom()
    except KeyError as exc:
        err = exc
    f = PoolFuture()
    f.set_running_or_notify_cancel()
    f.set_exception(err)
    assert f.exception() is err
    with pytest.raises(KeyError) as info:
        f.result()
    assert "boom" in "".join(traceback.format_exception(info.value))


@pytest.mark.parametrize("first", ["result", "exception"])
def test_setting_a_finished_future_again_is_refused(first):
    for f in (PoolFuture(), cf.Future()):  # the same error as the stdlib's
        (f.set_result(1) if first == "result" else f.set_exception(ValueError()))
        with pytest.raises(cf.InvalidStateError):
            f.set_result(2)
        with pytest.raises(cf.InvalidStateError):
            f.set_exception(ValueError())
        with pytest.raises(RuntimeError, match="unexpected state"):
            f.set_running_or_notify_cancel()


def test_cancel_before_running_is_noticed_by_the_runner():
    f = PoolFuture()
    calls = []
    f.add_done_callback(calls.append)
    assert f.cancel() and f.cancelled() and f.done()
    assert f.set_running_or_notify_cancel() is False
    assert calls == [f]
    with pytest.raises(cf.CancelledError):
        f.result(timeout=0)
    with pytest.raises(cf.InvalidStateError):
        f.set_result(1)


def test_a_running_future_cannot_be_cancelled():
    f = PoolFuture()
    f.set_running_or_notify_cancel()
    assert f.cancel() is False and f.running()


def test_a_pending_result_times_out():
    f = PoolFuture()
    with pytest.raises(cf.TimeoutError):
        f.result(timeout=0.01)
    with pytest.raises(cf.TimeoutError):
        f.exception(timeout=0.01)


def test_callbacks_run_once_in_order_before_and_after_the_result():
    f = PoolFuture()
    seen = []
    f.add_done_callback(lambda g: seen.append(("a", g.result())))
    f.add_done_callback(lambda g: seen.append(("b", g.result())))
    f.set_running_or_notify_cancel()
    f.set_result(7)
    f.add_done_callback(lambda g: seen.append(("c", g.result())))
    assert seen == [("a", 7), ("b", 7), ("c", 7)]


def test_a_thread_waiting_in_result_is_woken():
    f = PoolFuture()
    got = []
    t = threading.Thread(target=lambda: got.append(f.result(timeout=bound(30))))
    t.start()
    # the waiter made the condition before it slept: the setter takes the stdlib path
    while not f._has_condition:
        t.join(0.001)
        assert t.is_alive() or got, "the waiter ended without a result"
    f.set_running_or_notify_cancel()
    f.set_result("x")
    t.join(bound(30))
    assert got == ["x"]


def test_wait_and_as_completed_see_futures_set_with_or_without_a_condition():
    done_before = [PoolFuture() for _ in range(3)]
    for i, f in enumerate(done_before):
        f.set_running_or_notify_cancel()
        f.set_result(i)
    later = [PoolFuture() for _ in range(3)]

    def finish():
        for i, f in enumerate(later):
            f.set_running_or_notify_cancel()
            f.set_result(10 + i)

    t = threading.Timer(0.05, finish)
    t.start()
    try:
        done, not_done = cf.wait(done_before + later, timeout=bound(30))
        assert not not_done and len(done) == 6
        assert sorted(f.result() for f in cf.as_completed(done_before + later, timeout=bound(30))) \
            == [0, 1, 2, 10, 11, 12]
        first = cf.wait([PoolFuture(), done_before[0]], return_when=cf.FIRST_COMPLETED, timeout=bound(30))
        assert first.done == {done_before[0]}
    finally:
        t.join()


def test_racing_waiters_and_setters_never_lose_a_wake_up():
    # Each round: a waiter in result() and a setter start together; whichever order the
    # condition's making and the fast path take, the waiter gets the value in time.
    for i in range(300):
        f = PoolFuture()
        go = threading.Barrier(2)
        got = []

        def waiter():
            go.wait(bound(30))
            got.append(f.result(timeout=bound(30)))

        t = threading.Thread(target=waiter)
        t.start()
        go.wait(bound(30))
        f.set_running_or_notify_cancel()
        f.set_result(i)
        t.join(bound(30))
        assert got == [i]


def test_it_refuses_to_pickle_as_the_stdlib_future_does():
    with pytest.raises(TypeError):
        pickle.dumps(cf.Future())
    with pytest.raises(TypeError, match="PoolFuture"):
        pickle.dumps(PoolFuture())


def test_a_child_forked_while_another_thread_holds_the_lock_can_use_futures():
    # The one fork in the suite made on purpose with a second thread alive (the thread
    # holds the lock): conftest's fork check and CPython's warning are set aside for it.
    held, release = threading.Event(), threading.Event()

    def holder():
        with pf._lock:
            held.set()
            release.wait(bound(30))

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(bound(30))
        r, w = os.pipe()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"This process .* is multi-threaded",
                                    category=DeprecationWarning)
            pid = conftest._real_fork()
        if pid == 0:  # pragma: no cover  (the child)
            try:
                f = PoolFuture()
                f.set_running_or_notify_cancel()
                f.set_result(5)
                os.write(w, b"ok" if f.result() == 5 else b"no")
            finally:
                os._exit(0)
        os.close(w)
        try:
            ready, _, _ = select.select([r], [], [], bound(30))
            if not ready:
                os.kill(pid, signal.SIGKILL)
            assert ready, "the child hung on the lock it inherited"
            assert os.read(r, 2) == b"ok"
        finally:
            os.close(r)
            os.waitpid(pid, 0)
    finally:
        release.set()
        t.join(bound(30))
