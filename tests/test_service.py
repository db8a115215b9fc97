"""shmq.Service / shmq.Client: request/reply across processes, crashes, timeouts, cleanup.

Services run in their own processes (``Service.serve`` in a forked child);
clients run in this process, in threads, and in child processes.  Waits are
bounded and synchronized on events and replies, never on sleeps.
"""

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import pickle
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import shmq
from conftest import bound, join_all
from shmq.rpc.board import service_status

FORK = mp.get_context("fork")
T = bound(30)  # bound for any single wait in these tests


def handler(req):
    """The test service: echoes, fails, crashes once, or blocks until told, by request."""
    if isinstance(req, dict):
        op = req.get("op")
        if op == "fail":
            raise KeyError(req.get("msg", "nope"))
        if op == "crash_once":  # the first delivery takes its worker down
            try:
                fd = os.open(req["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                return {"survived": req["n"], "pid": os.getpid()}
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)
        if op == "block":  # tell the test we started, wait until it lets us go
            with open(req["started"], "w") as f:  # a FIFO the test reads
                f.write(f"{os.getpid()}\n")
            with open(req["go"], "rb") as f:  # a FIFO: opens once the test opens it for writing
                f.read()
            return {"released": req["n"]}
        if op == "unpicklable":
            return lambda: None
        if op == "crash":  # every delivery takes its worker down
            os.kill(os.getpid(), signal.SIGKILL)
        if op == "sleep":  # a slow handler
            time.sleep(req["s"])
            return {"slept": req["s"]}
        if op == "until_file":  # as "block", but every delivery is let go by one file
            with open(req["started"], "w") as f:
                f.write(f"{os.getpid()}\n")
            deadline = time.monotonic() + 60
            while not os.path.exists(req["go"]) and time.monotonic() < deadline:
                time.sleep(0.01)
            return {"released": req["n"]}
    return {"echo": req, "pid": os.getpid()}


def _serve(path, workers, opts):
    shmq.Service(path, **opts).serve(handler, workers=workers)


def start_service(path, workers=1, **opts):
    p = FORK.Process(target=_serve, args=(path, workers, opts))
    p.start()
    return p


def stop_service(p):
    if p.is_alive():
        os.kill(p.pid, signal.SIGTERM)
    join_all([p], timeout=T)


@pytest.fixture
def svc_path(spool_dir):
    path = os.path.join(spool_dir, "svc")
    yield path
    try:
        shmq.Service.destroy(path)
    except FileNotFoundError:
        pass


@pytest.fixture
def service(svc_path):
    procs = []

    def run(workers=1, **opts):
        p = start_service(svc_path, workers, **opts)
        procs.append(p)
        return p

    yield run
    for p in procs:
        stop_service(p)


def test_round_trip_order_and_many(service, svc_path):
    service(workers=2)
    with shmq.Client(svc_path) as cl:
        assert cl.call({"a": 1}, timeout=T)["echo"] == {"a": 1}
        out = cl.call_many(range(500), timeout=T)
        assert [r["echo"] for r in out] == list(range(500))
        big = bytes(range(256)) * 4096  # 1 MiB each way
        assert cl.call(big, timeout=T)["echo"] == big
        assert cl.call_many([], timeout=T) == []


def test_window_smaller_than_batch(service, svc_path):
    service(workers=2)
    with shmq.Client(svc_path, window=7) as cl:
        assert [r["echo"] for r in cl.call_many(range(50), timeout=T)] == list(range(50))


def _frames(path):
    """Frames ever put into the service's request ring."""
    with shmq.Spool.open(path) as sp:
        return sp.next_seq


def test_call_many_sends_bundles_sized_by_the_handlers_speed(service, svc_path):
    """call_many puts several calls in one frame; a bundle's reply says how long the
    handler took, and later bundles hold about BATCH_S of it (fast: up to
    BUNDLE_MAX calls; slow: 2, so that other workers can take the rest)."""
    from shmq.rpc.client import BUNDLE_START

    shmq.Service(svc_path).close()  # the ring exists before we count its frames
    service(workers=2)
    with shmq.Client(svc_path) as cl:
        before = _frames(svc_path)
        assert [r["echo"] for r in cl.call_many(range(BUNDLE_START), timeout=T)] == \
            list(range(BUNDLE_START))
        assert _frames(svc_path) - before == 1  # one bundle
        before = _frames(svc_path)
        out = cl.call_many(range(1000), timeout=T)
        assert [r["echo"] for r in out] == list(range(1000))
        # the echo handler answers 64 calls within BATCH_S, but a loaded machine may
        # stretch a bundle's measured time: at least BUNDLE_START/2 calls a frame
        assert _frames(svc_path) - before <= 1000 // (BUNDLE_START // 2)
        slow = [{"op": "sleep", "s": 0.002}] * 6
        assert cl.call_many(slow, timeout=T) == [{"slept": 0.002}] * 6
        assert cl._bundle == 2  # 2 ms a call: far more than BATCH_S per bundle
        assert cl.duplicates == 0


def test_a_worker_takes_about_batch_s_of_calls_several_bundles_when_fast():
    from shmq.rpc.service import _take_size
    from shmq.rpc.wire import BATCH_S, BUNDLE_MAX, TAKE_MAX

    assert TAKE_MAX >= 4 * BUNDLE_MAX  # a fast handler's worker takes several bundles
    assert _take_size(1e-7) == TAKE_MAX  # 10 000 calls in BATCH_S: capped
    assert _take_size(BATCH_S / 100) == 100
    assert _take_size(BATCH_S) == 1 and _take_size(1.0) == 1  # slow: one call (or bundle)


def test_a_bundle_runs_every_request_and_keeps_errors_in_place():
    from shmq.rpc.service import _run_bundle
    from shmq.rpc.wire import ERR, OK

    def h(x):
        if x % 3 == 0:
            raise ValueError(f"bad {x}")
        return x * 10

    statuses, values = _run_bundle(h, list(range(8)))
    assert list(statuses) == [ERR if x % 3 == 0 else OK for x in range(8)]
    assert [v[:2] if s else v for s, v in zip(statuses, values)] == \
        [("ValueError", f"bad {x}") if x % 3 == 0 else x * 10 for x in range(8)]
    assert _run_bundle(h, [1, 2]) == (bytearray(2), [10, 20])


def test_bundle_size_follows_the_service_time_per_call():
    """What a client learns from a bundle's reply (its service time per call, smoothed)."""
    from shmq.rpc.client import BUNDLE_START
    from shmq.rpc.wire import BATCH_S, BUNDLE_MAX, NS

    cl = shmq.Client("nobody-learns")
    cl._check()
    try:
        assert cl._bundle == BUNDLE_START
        cl._learn(1_000)  # 1 us a call: as many as a bundle may hold
        assert cl._bundle == BUNDLE_MAX
        for _ in range(30):
            cl._learn(BATCH_S * NS / 10)  # 100 us a call: about 10 a bundle
        assert cl._bundle in (9, 10)
        cl._learn(10 * NS)  # one very slow call: never fewer than 2 (replies keep telling)
        assert cl._bundle == 2
    finally:
        cl.close()


def test_bundle_lost_with_its_worker_is_split_and_each_call_answered_once(service, svc_path,
                                                                          spool_dir):
    """A worker killed holding a bundle: its calls are sent again one by one (each
    answered once, the crashing one on its second delivery)."""
    shmq.Service(svc_path).close()  # the ring exists before we count its frames
    service(workers=2)
    marker = os.path.join(spool_dir, "crashed")
    with shmq.Client(svc_path) as cl:
        before = _frames(svc_path)
        reqs = ["a", {"op": "crash_once", "marker": marker, "n": 3}, "b", "c"]
        out = cl.call_many(reqs, timeout=T)
        assert [out[0]["echo"], out[1]["survived"], out[2]["echo"], out[3]["echo"]] == \
            ["a", 3, "b", "c"]
        assert _frames(svc_path) - before == 1 + 4  # the bundle, then its 4 calls alone
        assert cl.duplicates == 0
        assert not cl._groups and not cl._pending  # nothing left waiting
        st = shmq.Service(svc_path)
        try:
            assert st.stats().redeliveries == 4
        finally:
            st.close()


def test_bundle_with_a_call_that_kills_every_worker(service, svc_path):
    """The killer call of a bundle ends as WorkerCrashed; the others are answered
    (call_many raises the first error only once every call has its answer)."""
    service(workers=1, max_attempts=2)
    with shmq.Client(svc_path) as cl:
        with pytest.raises(shmq.RemoteError) as ei:
            cl.call_many(["a", {"op": "crash"}, "b"], timeout=T)
        assert ei.value.type_name == "WorkerCrashed"
        assert cl.call("after", timeout=T)["echo"] == "after"
        assert not cl._groups and not cl._pending


def test_bundle_reply_that_cannot_be_sent_goes_call_by_call(service, svc_path):
    service()
    with shmq.Client(svc_path) as cl:
        with pytest.raises(shmq.RemoteError, match="could not be sent") as ei:
            cl.call_many([1, {"op": "unpicklable"}, 3], timeout=T)
        assert ei.value.type_name == "ReplyError"
        assert cl.call_many([4, 5], timeout=T)[1]["echo"] == 5


def test_call_many_with_out_of_band_buffers_goes_call_by_call(service, svc_path):
    """numpy arrays travel out of band, straight into the ring: never in a bundle."""
    np = pytest.importorskip("numpy")
    shmq.Service(svc_path).close()  # the ring exists before we count its frames
    service()
    arrs = [np.arange(1000, dtype=np.float64) * k for k in range(3)]
    with shmq.Client(svc_path) as cl:
        before = _frames(svc_path)
        out = cl.call_many(arrs, timeout=T)
        assert all(np.array_equal(o["echo"], a) for o, a in zip(out, arrs))
        assert _frames(svc_path) - before == 3


def test_numpy_and_arrow_payloads(service, svc_path):
    np = pytest.importorskip("numpy")
    pa = pytest.importorskip("pyarrow")
    service()
    with shmq.Client(svc_path) as cl:
        arr = np.arange(100_000, dtype=np.float64)
        assert np.array_equal(cl.call(arr, timeout=T)["echo"], arr)
        batch = pa.record_batch({"x": pa.array(range(1000)), "y": pa.array(["s"] * 1000)})
        assert cl.call(batch, timeout=T)["echo"].equals(batch)


def test_remote_error_carries_type_message_traceback(service, svc_path):
    service()
    with shmq.Client(svc_path) as cl:
        with pytest.raises(shmq.RemoteError) as ei:
            cl.call({"op": "fail", "msg": "no such row"}, timeout=T)
        e = ei.value
        assert isinstance(e, shmq.ShmqError)
        assert (e.type_name, e.message) == ("KeyError", "'no such row'")
        assert "raise KeyError" in e.remote_traceback and "svc" in str(e)
        again = pickle.loads(pickle.dumps(e))
        assert (type(again), again.type_name, again.remote_traceback) == (
            shmq.RemoteError, "KeyError", e.remote_traceback)
        # one failing call among many: the others are answered, the error raised
        with pytest.raises(shmq.RemoteError):
            cl.call_many([1, {"op": "fail"}, 3], timeout=T)
        assert cl.call(4, timeout=T)["echo"] == 4  # the client is still usable
        with pytest.raises(shmq.RemoteError, match="could not be sent"):
            cl.call({"op": "unpicklable"}, timeout=T)


def test_timeout_without_service_names_it(spool_dir):
    path = os.path.join(spool_dir, "nobody")
    with shmq.Client(path) as cl:
        with pytest.raises(shmq.Timeout, match="nobody.*is not running"):
            cl.call(1, timeout=0.2)
    assert not os.path.exists(path)  # a client creates nothing at the service's path


def test_timeout_with_stopped_service_and_expired_calls_dropped(svc_path, service):
    shmq.Service(svc_path).close()  # the queue exists, no worker runs
    with shmq.Client(svc_path) as cl:
        with pytest.raises(shmq.Timeout, match="svc.*queued, no worker serving"):
            cl.call("late", timeout=0.2)
        with pytest.raises(shmq.Timeout, match="did not answer 3 calls"):
            cl.call_many(["l1", "l2", "l3"], timeout=0.2)  # a bundle
        assert not cl._groups and not cl._pending
        service()  # the late calls are dropped (their caller gave up), never answered
        # one worker, FIFO: an answer to "late" would have arrived first, as a duplicate
        assert cl.call("now", timeout=T)["echo"] == "now"
        assert cl.duplicates == 0
        st = shmq.Service(svc_path)
        try:
            assert st.stats().expired == 4
        finally:
            st.close()


def test_drive_it_yourself(svc_path):
    svc = shmq.Service(svc_path)
    cl = shmq.Client(svc_path)
    try:
        res = {}
        def caller():
            try:
                cl.call_many(["x", "y"], timeout=T)
            except shmq.RemoteError as e:
                res["e"] = e

        t = threading.Thread(target=caller)
        t.start()
        got = []
        for call in svc:
            got.append(call)
            if call.request == "x":
                call.reply("X")
            else:
                call.fail(ValueError("bad y"))
            if len(got) == 2:
                break
        t.join(T)
        assert res["e"].type_name == "ValueError"  # the whole batch raised
        with pytest.raises(ValueError, match="answered already"):
            got[0].reply("again")
        assert got[0].attempt == 1 and got[0].done
    finally:
        cl.close()
        svc.close()


def test_worker_killed_mid_call_redelivered_once(service, svc_path, spool_dir):
    service(workers=2)
    marker = os.path.join(spool_dir, "crashed")
    with shmq.Client(svc_path) as cl:
        r = cl.call({"op": "crash_once", "marker": marker, "n": 7}, timeout=T)
        assert r["survived"] == 7
        assert cl.call_many(range(20), timeout=T)[-1]["echo"] == 19  # restarted, still serving
        assert cl.duplicates == 0
        st = shmq.Service(svc_path)
        try:
            assert st.stats().redeliveries >= 1
        finally:
            st.close()


def _blocking_call(spool_dir, n):
    started = os.path.join(spool_dir, f"started{n}")
    go = os.path.join(spool_dir, f"go{n}")
    os.mkfifo(go)
    os.mkfifo(started)
    return {"op": "block", "started": started, "go": go, "n": n}, started, go


class Started:
    """Reads the pids handlers write to the FIFO ``path`` when they start (bounded waits).

    Holding a write end too keeps the FIFO from reporting end-of-file between
    handlers (a killed handler, then its redelivery).
    """

    def __init__(self, path):
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self.keep = os.open(path, os.O_WRONLY)
        self.buf = b""

    def next(self):
        while b"\n" not in self.buf:
            ready, _w, _x = select.select([self.fd], [], [], T)
            assert ready, "the handler did not start in time"
            self.buf += os.read(self.fd, 64)
        line, self.buf = self.buf.split(b"\n", 1)
        return int(line)

    def close(self):
        os.close(self.fd)
        os.close(self.keep)


def wait_started(fifo):
    s = Started(fifo)
    try:
        return s.next()
    finally:
        s.close()


def release(go):
    fd = os.open(go, os.O_WRONLY)  # the handler opens it for reading right after starting
    os.close(fd)


def test_ctrl_c_while_waiting_forgets_the_calls_and_the_client_goes_on(service, svc_path,
                                                                       spool_dir):
    """SIGINT while call_many waits (its bundle held by a blocked handler): the
    KeyboardInterrupt propagates, nothing is left waiting, the bundle's late reply is
    dropped, and the client's next call works."""
    service()  # one worker, FIFO: the bundle is answered before the next call
    req, started, go = _blocking_call(spool_dir, 8)
    st = Started(started)
    main = threading.main_thread().ident
    th = threading.Thread(target=lambda: (st.next(), signal.pthread_kill(main, signal.SIGINT)))
    try:
        with shmq.Client(svc_path) as cl:
            th.start()
            with pytest.raises(KeyboardInterrupt):
                cl.call_many([req, "a", "b"], timeout=T)
            th.join(T)
            assert not cl._groups and not cl._pending
            release(go)
            assert cl.call("after", timeout=T)["echo"] == "after"
            assert cl.duplicates == 3  # the abandoned bundle's replies
    finally:
        th.join(T)
        st.close()


def test_whole_service_killed_and_restarted_mid_call(svc_path, spool_dir):
    req, started, go = _blocking_call(spool_dir, 1)
    st = Started(started)
    # the service in its own process group: kill it all at once, workers too
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_service import handler
        import shmq
        shmq.Service({svc_path!r}).serve(handler, workers=2)
    """)], start_new_session=True)
    res = {}
    try:
        with shmq.Client(svc_path) as cl:
            t = threading.Thread(target=lambda: res.update(r=cl.call(req, timeout=T)))
            t.start()
            first = st.next()
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(T)
            # a fresh interpreter, not a fork: thread t is running in this process
            proc2 = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
                import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})
                from test_service import handler
                import shmq
                shmq.Service({svc_path!r}).serve(handler, workers=1)
            """)], start_new_session=True)
            try:
                second = st.next()  # delivered again to the new service
                assert second != first
                release(go)
                t.join(T)
                assert res["r"] == {"released": 1}  # handled twice, answered once
                assert cl.call("after", timeout=T)["echo"] == "after"
                assert cl.duplicates == 0
            finally:
                proc2.terminate()  # SIGTERM: the service shuts down cleanly
                try:
                    proc2.wait(T)
                except subprocess.TimeoutExpired:
                    os.killpg(proc2.pid, signal.SIGKILL)
                    proc2.wait(T)
    finally:
        st.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(T)


CLIENT = """
import os, sys, shmq
cl = shmq.Client({path!r})
cl._check()
print(cl._reply_path, flush=True)
cl.call({req!r}, timeout=60)
"""


def test_call_that_kills_every_worker_gets_worker_crashed_and_others_are_answered(service, svc_path):
    """A call sent again after its worker died may be what kills workers: after
    ``max_attempts`` deliveries it is answered with WorkerCrashed, and the calls
    pipelined around it still get their own answers."""
    service(workers=1, max_attempts=2)
    with shmq.Client(svc_path) as cl:
        res = {}

        def call(key, req):
            try:
                res[key] = cl.call(req, timeout=T)
            except shmq.RemoteError as exc:
                res[key] = exc

        ts = [threading.Thread(target=call, args=(k, r)) for k, r in
              (("a", "a"), ("crash", {"op": "crash"}), ("b", "b"))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(T)
        assert res["a"]["echo"] == "a" and res["b"]["echo"] == "b"
        assert isinstance(res["crash"], shmq.RemoteError)
        assert res["crash"].type_name == "WorkerCrashed"
        assert "max_attempts=2" in str(res["crash"])
        assert cl.call("after", timeout=T)["echo"] == "after"


@contextlib.contextmanager
def _one_blocking_call(service, svc_path, spool_dir, n, op="block", **opts):
    """A service of 2 workers (``opts``) and a thread calling it with a call that
    blocks in its handler (``op`` "block": until the go FIFO is opened for writing;
    "until_file": until ``go + ".file"`` exists): yields ``(client, started FIFO
    reader, go FIFO, result, thread)``; the call's first start has not been read yet."""
    service(workers=2, **opts)
    req, started, go = _blocking_call(spool_dir, n)
    if op == "until_file":
        req = dict(req, op=op, go=go + ".file")
    st = Started(started)
    try:
        with shmq.Client(svc_path) as cl:
            res = {}
            t = threading.Thread(target=lambda: res.update(r=cl.call(req, timeout=T)))
            t.start()
            yield cl, st, go, res, t
    finally:
        st.close()


def test_call_held_past_its_lease_is_sent_to_another_worker(service, svc_path, spool_dir):
    """A live worker that holds a call longer than its lease: the caller sends it
    again, another worker answers, and the late first answer is dropped."""
    with _one_blocking_call(service, svc_path, spool_dir, 5, lease=0.5, op="until_file") \
            as (cl, st, go, res, t):
        first = st.next()
        second = st.next()  # sent again past the lease: the other worker took it
        assert second != first
        with open(go + ".file", "w"):  # both deliveries go on (the file lets every one go)
            pass
        t.join(T)
        assert res["r"] == {"released": 5}
        assert cl.call("after", timeout=T)["echo"] == "after"  # the late answer: dropped


def test_call_in_a_live_workers_hands_is_not_sent_again(service, svc_path, spool_dir):
    """The caller looks for lost calls every RECHECK_S while it waits: a call a live
    worker holds (within its lease) is found on the board and left alone."""
    from shmq.rpc.client import RECHECK_S

    with _one_blocking_call(service, svc_path, spool_dir, 6) as (cl, st, go, res, t):
        st.next()
        # four looks' time: a second delivery would start on the idle worker
        ready, _w, _x = select.select([st.fd], [], [], 4 * RECHECK_S)
        assert not ready, "the call was delivered again while a live worker held it"
        release(go)
        t.join(T)
        assert res["r"] == {"released": 6}
        assert cl.duplicates == 0


def test_get_many_takes_what_is_waiting(svc_path):
    svc = shmq.Service(svc_path)
    cl = shmq.Client(svc_path)
    try:
        res = {}
        t = threading.Thread(target=lambda: res.update(r=cl.call_many(range(5), timeout=T)))
        t.start()
        got = []
        while len(got) < 5:
            calls = svc.get_many(3, timeout=T)
            assert 1 <= len(calls) <= 3
            got += calls
        assert sorted(c.request for c in got) == list(range(5))
        st = svc.stats()
        assert (st.in_flight, st.queued) == (5, 0)
        for c in got:
            c.reply(c.request * 10)
        t.join(T)
        assert res["r"] == [0, 10, 20, 30, 40]
        assert svc.stats().in_flight == 0
        with pytest.raises(shmq.Empty):
            svc.get_many(3, timeout=0.05)
    finally:
        cl.close()
        svc.close()


def test_client_killed_mid_call_leaves_nothing(service, svc_path, spool_dir):
    service(workers=1)
    req, started, go = _blocking_call(spool_dir, 2)
    # its own interpreter, so its own resource tracker (as a real client has)
    proc = subprocess.Popen([sys.executable, "-c", CLIENT.format(path=svc_path, req=req)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        reply_path = proc.stdout.readline().strip()
        assert reply_path.startswith("/dev/shm/shmq-q-") and os.path.exists(reply_path)
        with shmq.Spool.open(reply_path) as sp:
            sems = f"sem.shmq.{sp.sem_prefix}."
        assert any(n.startswith(sems) for n in os.listdir("/dev/shm"))
        wait_started(started)
        proc.kill()
        proc.wait(T)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(T)
    release(go)  # let the handler answer the dead client
    with shmq.Client(svc_path) as cl:  # one worker: this call is handled after that one
        assert cl.call("next", timeout=T)["echo"] == "next"
        assert cl.duplicates == 0
    assert not os.path.exists(reply_path)
    assert [n for n in os.listdir("/dev/shm") if n.startswith(sems)] == []


def test_a_reply_queue_of_a_caller_dead_since_admission_is_removed_by_the_sweep(spool_dir):
    """A bundle answered moments after its caller was found alive does not look the
    caller up again (``send_bundle(check=False)``): the reply goes in, and if the caller
    has died meanwhile, the worker's next sweep removes its reply queue."""
    from shmq.rpc.replies import Replies

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(T)  # reaped: its pid names no process
    q = shmq.Queue()
    replies = Replies("test", trusted=False)
    try:
        assert replies.send_bundle(q.path, dead.pid, 7, bytearray(2), ["a", "b"], 1000, False) == 0
        assert os.path.exists(q.path)  # not looked up at the reply
        assert q.get(timeout=T) == (7, bytes(2), ["a", "b"], 1000)
        replies.sweep_due()  # the first sweep is due at once
        assert not os.path.exists(q.path)
    finally:
        replies.close()
        q.close()


def _client_proc(path, n, seed, out):
    with shmq.Client(path) as cl:
        reqs = [(seed, i) for i in range(n)]
        got = [cl.call(r, timeout=T)["echo"] for r in reqs[: n // 2]]
        got += [r["echo"] for r in cl.call_many(reqs[n // 2:], timeout=T)]
        out.put((seed, got == reqs, cl.duplicates))


def test_32_clients_processes_and_threads(service, svc_path):
    service(workers=2)
    out = FORK.Queue()
    procs = [FORK.Process(target=_client_proc, args=(svc_path, 40, s, out)) for s in range(16)]
    for p in procs:
        p.start()
    shared = shmq.Client(svc_path)
    results = {}

    def thread(seed):
        reqs = [(seed, i) for i in range(40)]
        if seed % 2:  # bundles of several threads, whichever thread reads for them all
            got = [r["echo"] for k in range(0, 40, 10) for r in shared.call_many(reqs[k:k + 10],
                                                                                  timeout=T)]
        else:
            got = [shared.call(r, timeout=T)["echo"] for r in reqs]
        results[seed] = got == reqs

    threads = [threading.Thread(target=thread, args=(100 + s,)) for s in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    got = [out.get(timeout=T) for _ in procs]
    assert join_all(procs) == [0] * 16
    assert sorted(s for s, ok, _d in got if ok) == list(range(16))
    assert results == {100 + s: True for s in range(16)}
    shared.close()


def _call_with(cl, out):
    out.put(cl.call("from child", timeout=T)["echo"])


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_client_handed_to_child_process(service, svc_path, method):
    service()
    ctx = mp.get_context(method)
    with shmq.Client(svc_path) as cl:
        assert cl.call("parent", timeout=T)["echo"] == "parent"
        out = ctx.Queue()
        p = ctx.Process(target=_call_with, args=(cl, out))
        p.start()
        assert out.get(timeout=T) == "from child"
        assert join_all([p]) == [0]
        assert cl.call("parent again", timeout=T)["echo"] == "parent again"


def test_call_async(service, svc_path):
    service(workers=2)

    async def main(cl):
        many = await asyncio.gather(*[cl.call_async(i, timeout=T) for i in range(100)])
        with pytest.raises(shmq.RemoteError):
            await cl.call_async({"op": "fail"}, timeout=T)
        return [r["echo"] for r in many]

    with shmq.Client(svc_path) as cl:
        # a thread calls at the same time: both kinds of waiter share the reply queue
        res = {}
        t = threading.Thread(target=lambda: res.update(r=cl.call_many(range(200), timeout=T)))
        t.start()
        assert asyncio.run(main(cl)) == list(range(100))
        t.join(T)
        assert [r["echo"] for r in res["r"]] == list(range(200))


def test_async_timeout_without_service(spool_dir):
    with shmq.Client(os.path.join(spool_dir, "none")) as cl:
        with pytest.raises(shmq.Timeout):
            asyncio.run(cl.call_async(1, timeout=0.1))


def test_backpressure_slow_service_makes_callers_wait(service, svc_path, spool_dir):
    service(workers=1, capacity="256KiB")
    req, started, go = _blocking_call(spool_dir, 3)
    with shmq.Client(svc_path) as cl:
        res = {}
        t = threading.Thread(target=lambda: res.update(r=cl.call(req, timeout=T)))
        t.start()
        wait_started(started)  # the only worker is busy
        blobs = [bytes([i]) * (60 << 10) for i in range(10)]  # distinct: a bundle's pickle
        with pytest.raises(shmq.Timeout, match="request queue is full"):  # shares equal objects
            cl.call_many(blobs, timeout=0.5)  # 600 KiB cannot queue behind a stuck worker
        release(go)
        t.join(T)
        assert res["r"] == {"released": 3}
        assert cl.call("ok", timeout=T)["echo"] == "ok"


def test_untrusted_request_queue_refused(svc_path):
    shmq.Service(svc_path).close()
    os.chmod(svc_path, 0o660)
    with pytest.raises(shmq.UntrustedSpool):
        shmq.Service(svc_path)
    with pytest.raises(shmq.UntrustedSpool):
        shmq.Client(svc_path).call(1, timeout=1)


def test_bad_arguments(svc_path):
    with pytest.raises(ValueError):
        shmq.Service(svc_path, max_attempts=0)
    with pytest.raises(ValueError):
        shmq.Client(svc_path, window=0)
    svc = shmq.Service(svc_path)
    try:
        with pytest.raises(TypeError):
            svc.serve(42)
        with pytest.raises(ValueError):
            svc.serve(handler, workers=0)
    finally:
        svc.close()
    with shmq.Client(svc_path) as cl:
        with pytest.raises(ValueError):
            cl.call(1, timeout=-1)
    cl.close()
    with pytest.raises(ValueError, match="closed"):
        cl.call(1)


def test_chaos_quick(tmp_path):
    out = tmp_path / "chaos.json"
    stress = os.path.join(os.path.dirname(__file__), "..", "stress", "service_chaos.py")
    proc = subprocess.run([sys.executable, stress, "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=bound(300))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["violations"] == 0 and res["kills"] > 0
    assert res["replies"] == res["calls"] > 0
    print(proc.stdout)


def test_something_else_at_the_path_is_refused_not_taken_over(spool_dir):
    """A work queue (what an older shmq's service left) or an overwrite spool at the
    service's path: a clear error, and the file is left as it was."""
    wq_path = os.path.join(spool_dir, "old")
    shmq.WorkQueue(wq_path).close()
    with pytest.raises(shmq.ShmqError, match="work queue.*not a service's request ring"):
        shmq.Service(wq_path)
    with pytest.raises(shmq.Timeout, match="not a service's request ring"):
        shmq.Client(wq_path).call(1, timeout=0.1)
    shmq.WorkQueue.destroy(wq_path)
    sp_path = os.path.join(spool_dir, "sp")
    shmq.Spool.create(sp_path, capacity=65536).close()
    with pytest.raises(shmq.ShmqError, match="'overwrite' spool is there"):
        shmq.Service(sp_path)
    with shmq.Spool.open(sp_path) as sp:
        assert sp.readers() == []  # no group was added


def test_a_stop_racing_the_end_of_serve_never_writes_into_a_reused_descriptor(svc_path, monkeypatch):
    """stop() from another thread reads the wake pipe's descriptor and writes a byte to
    it; serve() closes the pipe when it ends.  A stop() paused between the two while
    serve() ends (here: a worker killed after the stop flag is set, so serve() ends
    without the byte) must still write into the wake pipe, not into the file that took
    the descriptor's number after the close (a byte there corrupts it)."""
    svc = shmq.Service(svc_path)
    served = threading.Event()
    # spawn: serve() runs in a thread here, and this process forks only without threads
    server = threading.Thread(target=lambda: (svc.serve(handler, workers=1, mp_context="spawn"), served.set()))
    real_write = os.write
    inside, may_go, seen = threading.Event(), threading.Event(), {}

    def write(fd, data):
        if threading.current_thread().name == "late-stop":
            seen["before"] = os.fstat(fd).st_ino
            inside.set()
            may_go.wait(T)
            try:
                seen["at_write"] = os.fstat(fd).st_ino
            except OSError as exc:
                seen["at_write"] = exc
        return real_write(fd, data)

    late = threading.Thread(target=svc.stop, name="late-stop")
    reused = []
    server.start()
    try:
        with shmq.Client(svc_path) as cl:
            assert cl.call("up", timeout=T)["echo"] == "up"  # serve() runs, its pipe exists
        pid = service_status(svc_path)["pids"][0]
        monkeypatch.setattr(os, "write", write)
        late.start()
        assert inside.wait(T)  # stop() has set the flag and holds the descriptor
        os.kill(pid, signal.SIGKILL)  # serve() wakes for the death, sees the flag, ends
        # Without the lock serve() closes the pipe now; give it the time to, then
        # take the freed numbers (a file opened meanwhile would get them).
        served.wait(2.0)
        for _ in range(4):
            reused.extend(os.pipe())
        may_go.set()
        late.join(T)
        server.join(T)
        assert not late.is_alive() and not server.is_alive() and served.is_set()
        assert seen["at_write"] == seen["before"], "stop() wrote to a descriptor serve() had closed"
        for fd in reused[::2]:  # nothing arrived in the files that took the numbers
            os.set_blocking(fd, False)
            with pytest.raises(BlockingIOError):
                os.read(fd, 1)
    finally:
        may_go.set()
        if late.ident:
            late.join(T)
        svc.stop()
        server.join(T)
        for fd in reused:
            os.close(fd)
        svc.close()
