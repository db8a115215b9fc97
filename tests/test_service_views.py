"""``Service(copy=False)``: requests with out-of-band buffers reach the handler as
read-only views of the request ring, pinned while anything references them."""

import gc
import logging
import multiprocessing as mp
import os
import signal
import threading

import pytest

import shmq
from conftest import bound, join_all
from shmq.rpc.requests import PIN_MIN_BYTES

np = pytest.importorskip("numpy")

FORK = mp.get_context("fork")
T = bound(30)  # bound for any single wait in these tests
RING = "8MiB"
ELEMS = 64 * 1024  # 512 KiB of float64 per request: pinned (>= PIN_MIN_BYTES), 15 per lap


def request(k):
    return {"k": k, "x": np.full(ELEMS, float(k))}


_kept = []


def handler(req):
    """Sums the request's array; says whether it was a view; keeps it when told."""
    x = req["x"]
    if req.get("op") == "keep":
        _kept[:] = [x]  # the last one only: the pattern a copy from then on heals
    if req.get("op") == "crash_once":
        try:
            fd = os.open(req["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            pass
        else:
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)
    return {"k": req["k"], "sum": float(x.sum()), "view": not x.flags.writeable}


def _serve(path):
    shmq.Service(path, copy=False).serve(handler, workers=1)


@pytest.fixture
def svc_path(spool_dir):
    path = os.path.join(spool_dir, "svc")
    shmq.Service(path, capacity=RING, copy=False).close()
    yield path
    shmq.Service.destroy(path)


@pytest.fixture
def served(svc_path):
    p = FORK.Process(target=_serve, args=(svc_path,))
    p.start()
    yield p
    if p.is_alive():
        os.kill(p.pid, signal.SIGTERM)
    join_all([p], timeout=T)


def test_copy_must_be_a_bool(svc_path):
    with pytest.raises(TypeError, match="copy must be a bool"):
        shmq.Service(svc_path, copy="no")


def test_requests_are_read_only_views_and_released_after_each_call(svc_path, served):
    """Three laps of the ring: each call's pin ends with its call (else the ring
    would stall after one lap and these calls time out)."""
    assert ELEMS * 8 >= PIN_MIN_BYTES
    with shmq.Client(svc_path) as cl:
        for k in range(48):
            rep = cl.call(request(k), timeout=T)
            assert rep == {"k": k, "sum": float(k) * ELEMS, "view": True}


def test_small_out_of_band_requests_are_copied(svc_path, served):
    with shmq.Client(svc_path) as cl:
        rep = cl.call({"k": 1, "x": np.ones(16)}, timeout=T)
    assert rep == {"k": 1, "sum": 16.0, "view": False}


def test_a_kept_request_is_never_overwritten_and_holds_the_ring(svc_path):
    """Driven by hand: a request kept past its call stays intact while later calls
    fill the rest of the ring; the ring waits for it (a put times out) instead of
    overwriting it, and runs again once it is dropped."""
    svc = shmq.Service(svc_path, copy=False)
    cl = shmq.Client(svc_path)
    out = {}

    def caller(ks, timeout):
        try:
            out[ks[0]] = [cl.call(request(k), timeout=timeout) for k in ks]
        except shmq.Timeout as exc:
            out[ks[0]] = exc

    try:
        t = threading.Thread(target=caller, args=([0], T))
        t.start()
        call = svc.get(timeout=T)
        kept = call.request["x"]
        assert not kept.flags.writeable
        with pytest.raises(ValueError):
            kept[0] = 1.0  # read-only: nobody writes into the ring through a request
        call.reply("ok")
        del call
        t.join(T)
        assert out[0] == ["ok"]
        # The rest of the lap fits; the call after it cannot be put while `kept` lives.
        t = threading.Thread(target=caller, args=(list(range(1, 40)), 2.0))
        t.start()
        answered = 0
        while t.is_alive():
            try:
                c = svc.get(timeout=0.2)
            except shmq.Empty:
                continue
            assert c.request["x"][0] == c.request["k"]
            c.reply(c.request["k"])
            answered += 1
            del c
        t.join(T)
        assert isinstance(out[1], shmq.Timeout), out[1]
        assert 10 <= answered < 16, answered  # about one lap: then the pin holds the writer
        assert np.all(kept == 0.0)  # intact, though the ring went round past it
        del kept
        gc.collect()
        t = threading.Thread(target=caller, args=(list(range(100, 140)), T))
        t.start()
        for _ in range(40):
            c = svc.get(timeout=T)
            c.reply(c.request["k"])
            del c
        t.join(T)
        assert out[100] == list(range(100, 140))  # two more laps: the pin is gone
    finally:
        cl.close()
        svc.close()


def test_serve_notices_a_handler_that_keeps_requests_and_copies_from_then_on(svc_path, served):
    with shmq.Client(svc_path) as cl:
        first = cl.call(dict(request(0), op="keep"), timeout=T)
        assert first["view"] is True
        # Later requests are copied (writable), so the kept view is let go the next
        # time the handler keeps one, and the ring goes round: three laps.
        for k in range(1, 48):
            rep = cl.call(dict(request(k), op="keep"), timeout=T)
            assert rep == {"k": k, "sum": float(k) * ELEMS, "view": False}


def test_worker_killed_holding_a_pinned_request(svc_path, served, spool_dir):
    """The dead worker's pin is reclaimed: the call is answered by its successor and
    the ring goes round again."""
    marker = os.path.join(spool_dir, "crashed")
    with shmq.Client(svc_path) as cl:
        rep = cl.call(dict(request(7), op="crash_once", marker=marker), timeout=T)
        assert rep["k"] == 7 and rep["sum"] == 7.0 * ELEMS and os.path.exists(marker)
        for k in range(32):
            assert cl.call(request(k), timeout=T)["sum"] == float(k) * ELEMS


def test_closing_with_a_pinned_request_outstanding(svc_path, caplog):
    """A request still referenced after its service handle closed keeps its bytes
    (the view keeps the mapping); dropping it later is harmless."""
    svc = shmq.Service(svc_path, copy=False)
    cl = shmq.Client(svc_path)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("r", cl.call(request(5), timeout=T)))
    try:
        t.start()
        call = svc.get(timeout=T)
        x = call.request["x"]
        call.reply("done")
        t.join(T)
        assert got["r"] == "done"
    finally:
        cl.close()
        svc.close()
    with caplog.at_level(logging.ERROR):
        assert float(x.sum()) == 5.0 * ELEMS
        del x, call
        gc.collect()
    assert not caplog.records


def test_a_call_arriving_while_the_worker_looks_is_pinned(svc_path, monkeypatch):
    """The worker looks at the headers without the group's lock; a call that arrives
    right after a look that found none must still be taken pinned, not copied by a
    take that was meant for small calls (seen once on CI, under load)."""
    from shmq.rpc import requests as R

    sp = R.create_or_open(svc_path, RING)
    reader = sp.reader(R.GROUP, group=True)
    sent = []

    def arrive():
        if not sent:
            sent.append(R.send(sp, [(1, "/nowhere", 0, 0, 1, request(3))], T))

    real_get_many, real_wait = reader.get_many, reader.wait
    monkeypatch.setattr(reader, "get_many", lambda *a, **k: (arrive(), real_get_many(*a, **k))[1])
    monkeypatch.setattr(reader, "wait", lambda *a, **k: (arrive(), real_wait(*a, **k))[1])
    try:
        [frame] = R.take_views(sp, reader, 8, True, T)
        assert isinstance(frame, R.PinnedFrame) and frame.pin is not None and len(frame.data) >= ELEMS * 8
        assert sp.pins.held
        call = R.decode(frame)
        assert call[0] == 1 and not call[5]["x"].flags.writeable
        del frame, call
        gc.collect()
        assert not sp.pins.held
    finally:
        reader.close()
        sp.close()


@pytest.mark.parametrize("first", ["small", "pinned"])
def test_a_non_blocking_take_that_loses_the_race_raises_empty(svc_path, monkeypatch, first):
    """take_views(block=False) (a worker topping up its batch) looks at the headers
    without the lock; when another worker takes the frames it saw first, it raises
    shmq.Empty at once instead of waiting for the next call."""
    from shmq.rpc import requests as R

    sp = R.create_or_open(svc_path, RING)
    mine, other = sp.reader(R.GROUP, group=True), sp.reader(R.GROUP, group=True)
    R.send(sp, [(1, "/nowhere", 0, 0, 1, {"x": 1} if first == "small" else request(1))], T)

    def other_first(real):
        def take(*a, **k):
            other.get_many(8, block=False)  # the other worker wins the race
            return real(*a, **k)
        return take

    monkeypatch.setattr(mine, "get_many", other_first(mine.get_many))
    monkeypatch.setattr(mine, "take", other_first(mine.take))
    real_wait = mine.wait

    def wait(timeout, deadline):  # get_many(block=False) itself "waits" 0 s: it raises Empty
        if timeout != 0:
            pytest.fail(f"a non-blocking take waited (timeout={timeout})")
        return real_wait(timeout, deadline)

    monkeypatch.setattr(mine, "wait", wait)
    try:
        with pytest.raises(shmq.Empty):
            R.take_views(sp, mine, 8, False, None)
    finally:
        mine.close()
        other.close()
        sp.close()
