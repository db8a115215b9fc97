"""The boundary between the Python layers and the compiled core is narrow and one-way.

* A subclass of ``Spool`` that overrides ``put``, of ``Reader`` that
  overrides ``get``, and of ``Queue`` that overrides ``put`` and ``get``
  has its overrides called (handles bind the core's entry points per
  instance only for the class itself), and ``super()`` reaches the core.
* The slow paths are handed to the core when a handle is bound, as the
  class's function: a subclass's ``_put_slow`` / ``_get_slow`` is the one the
  core calls; nothing is looked up by name on the handle at call time.
* The C sources call no Python method by a name string of the layers
  above (``_put_slow``, ``_get_slow``, ``SAFETY_NET_S``), and the Queue's
  state is not in the ``Ring``.
"""

import os
import re
import threading

import pytest

import shmq
from shmq import _core, _notify
from shmq.reader import Reader
from conftest import CORE_SOURCES, bound

CORE_DIR = CORE_SOURCES


class LoggingSpool(shmq.Spool):
    calls = []

    def put(self, data, *, block=True, timeout=None, codec=0):
        LoggingSpool.calls.append(("put", bytes(data)))
        return super().put(data, block=block, timeout=timeout, codec=codec)


class PutViaBatchSpool(shmq.Spool):
    """A subclass whose put is a batch of one: put_many must not call it back."""

    def put(self, data, *, block=True, timeout=None, codec=0):
        return self.put_many([bytes(data)], block=block, timeout=timeout, codec=codec)


class SlowLoggingSpool(shmq.Spool):
    slow = []

    def _put_slow(self, data, block, timeout, codec):
        SlowLoggingSpool.slow.append((bytes(data), timeout))
        return super()._put_slow(data, block, timeout, codec)


def test_spool_subclass_put_override_is_called(spool_dir):
    LoggingSpool.calls.clear()
    sp = LoggingSpool.create(os.path.join(spool_dir, "s"), capacity="1MiB")
    try:
        assert "put" not in vars(sp)  # not shadowed by a per-instance binding
        assert sp.put(b"one") == 0
        assert sp.put(b"two", timeout=1.0) == 1  # through super() to the core's slow path
        assert LoggingSpool.calls == [("put", b"one"), ("put", b"two")]
        r = sp.reader(start="earliest")
        assert [r.get(timeout=bound(5)).data for _ in range(2)] == [b"one", b"two"]
    finally:
        sp.close()


def test_put_many_of_one_is_the_core_put_not_a_subclass_override(spool_dir):
    """``put_many`` of one ``bytes`` item is Spool.put itself (the core's call): a
    subclass's ``put`` is not called, so one built on ``put_many`` does not recurse."""
    LoggingSpool.calls.clear()
    sp = LoggingSpool.create(os.path.join(spool_dir, "s"), capacity="1MiB")
    via = PutViaBatchSpool.create(os.path.join(spool_dir, "v"), capacity="1MiB")
    try:
        assert sp.put_many([b"one"], timeout=1.0) == 0
        assert LoggingSpool.calls == []  # the override was not called by put_many
        assert via.put(b"a") == 0 and via.put(b"b", timeout=1.0) == 1
        r = via.reader(start="earliest")
        assert [r.get(timeout=bound(5)).data for _ in range(2)] == [b"a", b"b"]
    finally:
        sp.close()
        via.close()


def test_plain_spool_binds_the_core_directly(spool_dir):
    sp = shmq.Spool.create(os.path.join(spool_dir, "s"), capacity="1MiB")
    try:
        assert vars(sp)["put"] == sp.core.put_api  # no Python frame on the hot path
        assert shmq.Spool.put(sp, b"unbound") == 0  # the class method reaches the core too
        assert sp.reader(start="earliest").get(timeout=bound(5)).data == b"unbound"
    finally:
        sp.close()


def test_subclass_slow_path_is_the_one_the_core_calls(spool_dir):
    SlowLoggingSpool.slow.clear()
    sp = SlowLoggingSpool.create(os.path.join(spool_dir, "s"), capacity="1MiB")
    try:
        assert sp.put(b"fast") == 0  # the core's fast path: no slow call
        assert sp.put(b"timed", timeout=2.5) == 1  # with a timeout too (it bounds waits only)
        assert SlowLoggingSpool.slow == []
        assert sp.put(b"slow", block=False) == 2  # a put that must not wait is the slow path's
        assert SlowLoggingSpool.slow == [(b"slow", None)]
        # An instance attribute of that name is not looked up: the class's function was bound.
        sp._put_slow = lambda *a: pytest.fail("looked up by name on the instance")
        assert sp.put(b"again", block=False) == 3
        assert SlowLoggingSpool.slow[-1] == (b"again", None)
    finally:
        sp.close()


def _hold_writer_lock(sp):
    """A thread holding ``sp``'s writer lock (an open reservation) until released."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with sp.reserve(1) as buf:
            buf[:] = b"r"
            held.set()
            release.wait(bound(30))

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(bound(10))
    return t, release


@pytest.mark.parametrize("kind", ["spool", "queue"])
def test_a_put_with_a_timeout_is_the_cores_while_the_lock_is_free(spool_dir, kind):
    """A put with a timeout is the core's (no Python frame) while the writer lock is
    free; a busy lock goes to the slow path at once, with the whole timeout (its
    rules for a busy or stuck lock, and its messages, unchanged); invalid timeouts
    still get the slow path's clear errors."""
    if kind == "spool":
        SlowLoggingSpool.slow.clear()
        h = SlowLoggingSpool.create(os.path.join(spool_dir, "s"), capacity="1MiB")
        sp, put, slow = h, h.put, SlowLoggingSpool.slow
    else:
        h = SlowLoggingQueue()
        sp, put, slow = h._spool, h.put, h.slow
    try:
        put(b"free", timeout=bound(5))
        assert slow == []
        for bad, err in ((-1, ValueError), (float("nan"), ValueError), ("1", TypeError), (True, TypeError)):
            with pytest.raises(err):
                put(b"bad", timeout=bad)
        slow.clear()
        t, release = _hold_writer_lock(sp)
        try:
            # a live holder: Timeout (Full from a Queue, as the stdlib says)
            with pytest.raises((shmq.Timeout, shmq.Full), match="writer lock"):
                put(b"late", timeout=0.2)
        finally:
            release.set()
            t.join(bound(10))
        assert slow == [(b"late", 0.2)]  # nothing of it spent waiting in C
        put(b"after", timeout=bound(5))  # the lock is free again: nothing was left behind
        assert len(slow) == 1
    finally:
        h.close()


class SlowLoggingQueue(shmq.Queue):
    def __init__(self, *a, **kw):
        self.slow = []
        super().__init__(*a, **kw)

    def _put_slow(self, obj, block, timeout):
        self.slow.append((obj, timeout))
        return super()._put_slow(obj, block, timeout)


class CountingReader(Reader):
    got = 0

    def get(self, block=True, timeout=None):
        CountingReader.got += 1
        return super().get(block, timeout)


def test_reader_subclass_get_override_is_called(spool_dir):
    CountingReader.got = 0
    sp = shmq.Spool.create(os.path.join(spool_dir, "s"), capacity="1MiB")
    try:
        sp.put(b"x")
        r = CountingReader(sp, start="earliest")
        try:
            assert "get" not in vars(r)
            assert r.get(timeout=bound(5)).data == b"x"
            with pytest.raises(shmq.Empty):
                r.get(timeout=0.05)  # the core parks, then raises
            assert CountingReader.got == 2
        finally:
            r.close()
        plain = sp.reader(start="earliest")
        assert vars(plain)["get"] == plain._cur.get_api
    finally:
        sp.close()


class AuditQueue(shmq.Queue):
    def __init__(self, *a, **kw):
        self.log = []
        super().__init__(*a, **kw)

    def put(self, obj, block=True, timeout=None):
        self.log.append(("put", obj))
        return super().put(obj, block, timeout)

    def get(self, block=True, timeout=None):
        obj = super().get(block, timeout)
        self.log.append(("get", obj))
        return obj


def test_queue_subclass_put_and_get_overrides_are_called():
    q = AuditQueue()
    try:
        assert "put" not in vars(q) and "get" not in vars(q)
        q.put({"a": 1})
        q.put(b"raw", timeout=1.0)
        assert q.get(timeout=bound(5)) == {"a": 1}
        assert q.get(timeout=bound(5)) == b"raw"
        with pytest.raises(shmq.Empty):
            q.get(timeout=0.05)
        assert q.log == [("put", {"a": 1}), ("put", b"raw"), ("get", {"a": 1}), ("get", b"raw")]
    finally:
        q.close()


def test_plain_queue_binds_its_port():
    q = shmq.Queue()
    try:
        assert vars(q)["put"] == q._port.put and vars(q)["get"] == q._port.get
        q.put([1, 2])
        assert shmq.Queue.get(q, timeout=bound(5)) == [1, 2]  # the class method: the same port
    finally:
        q.close()


def test_safety_net_is_handed_to_the_core_as_a_value(safety_net):
    safety_net(0.25)  # _notify.set_safety_net: the module hands the value to the core
    with pytest.raises(ValueError):
        _core.set_safety_net(0)  # out of range: refused, not silently clamped
    with pytest.raises(ValueError):
        _notify.set_safety_net(-1.0)
    assert _notify.SAFETY_NET_S == 0.25  # a refused value changes nothing


def _c_sources():
    for f in sorted(os.listdir(CORE_DIR)):
        if f.endswith((".c", ".h")):
            with open(os.path.join(CORE_DIR, f)) as fh:
                yield f, fh.read()


def test_core_calls_no_python_layer_by_name():
    for f, src in _c_sources():
        code = re.sub(r"/\*.*?\*/", "", src, flags=re.S)  # comments may name them
        for name in ("_put_slow", "_get_slow", "SAFETY_NET_S", "set_notify", "qowner", "q_backlog"):
            assert name not in code, (f, name)
        # Attribute lookups by name: only the module's own function at init.
        lookups = re.findall(r"PyObject_GetAttrString\([^;]*;", code)
        assert all('"_inband"' in x for x in lookups), (f, lookups)


def _put_then_signal(put, done):
    put("from the child")
    done.set()


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_bound_fast_methods_pickle_as_their_handles_methods(spool_dir, method):
    """q.put and q.get are C methods bound per queue; pickled (as a Process
    target is under spawn) they become the unpickled queue's own methods, as
    multiprocessing.Queue's do (regression: "cannot pickle 'shmq._core.Ring'").
    sp.put and r.get refuse with a clear error."""
    import multiprocessing as mp
    import pickle

    q = shmq.Queue()
    sp = shmq.Spool.create(os.path.join(spool_dir, "p"), capacity="64KiB")
    try:
        r = sp.reader("workers", group=True)
        # a spool's and a reader's core are per process: a clear error says what to pickle
        for fn in (sp.put, r.get):
            with pytest.raises(TypeError, match="pickle the (Spool|reader)"):
                pickle.dumps(fn)
        get2 = pickle.loads(pickle.dumps(q.get))
        put2 = pickle.loads(pickle.dumps(q.put))
        put2("via an unpickled put")
        assert get2(timeout=bound(10)) == "via an unpickled put"
        del put2, get2
        ctx = mp.get_context(method)
        done = ctx.Event()
        p = ctx.Process(target=_put_then_signal, args=(q.put, done))
        p.start()
        assert done.wait(bound(60)), "child never put"
        p.join(bound(60))
        assert p.exitcode == 0
        assert q.get(timeout=bound(10)) == "from the child"
        r.close()
    finally:
        q.close()
        sp.close()
