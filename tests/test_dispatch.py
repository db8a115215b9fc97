"""Dispatcher: parallelism, timeouts, crashes, chaining, scaling, shutdown, metrics, CLI.

Handlers are module-level (worker processes import them by name) and report
what they did as pickled records in a results spool; the tests block on that
spool (or on dead-letter spools), never on sleeps.
"""

import ctypes
import json
import logging
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

import shmq
from shmq.dispatch import Dispatcher, HandlerTimeout, main as dispatch_main, status

from conftest import bound

# --- reporting from worker processes --------------------------------------------------

_OUT = {}


def report(out, **rec):
    sp = _OUT.get(out)
    if sp is None:
        sp = _OUT[out] = shmq.Spool.open(out)
    rec.setdefault("pid", os.getpid())
    sp.put(pickle.dumps(rec))


class Records:
    """Everything the handlers reported, read with bounded blocking waits."""

    def __init__(self, path):
        self.sp = shmq.Spool.create(path, capacity="4MiB", on_full="error")
        self.reader = self.sp.reader()
        self.all = []

    def until(self, cond, timeout=bound(20.0), what="condition"):
        deadline = time.monotonic() + timeout
        while not cond(self.all):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {what}; got {self.all[-20:]}")
            try:
                f = self.reader.get(timeout=left)
            except shmq.Empty:
                continue
            self.all.append(pickle.loads(f.data))
        return self.all

    def of(self, **match):
        return [r for r in self.all if all(r.get(k) == v for k, v in match.items())]

    def count(self, **match):
        return lambda rs: sum(1 for r in rs if all(r.get(k) == v for k, v in match.items()))


# --- handlers (module level: importable by the workers) ---------------------------------


def h_sleep(ctx, body):
    t0 = time.monotonic()
    report(body["out"], ev="start", type=ctx.type, n=body.get("n"))
    time.sleep(body["sleep"])
    report(body["out"], ev="end", type=ctx.type, n=body.get("n"), t0=t0, t1=time.monotonic())


def h_coop(ctx, body):
    report(body["out"], ev="start", type=ctx.type, attempt=ctx.attempt)
    if ctx.cancelled.wait(bound(30)):
        report(body["out"], ev="cancelled", type=ctx.type, attempt=ctx.attempt,
               left=ctx.time_left())


def h_stubborn(ctx, body):
    report(body["out"], ev="start", type=ctx.type, attempt=ctx.attempt)
    time.sleep(30)  # ignores ctx.cancelled
    report(body["out"], ev="end", type=ctx.type)


def h_gil(ctx, body):
    report(body["out"], ev="start", type=ctx.type, attempt=ctx.attempt)
    ctypes.PyDLL(None).sleep(30)  # libc sleep() holding the GIL: the watchdog cannot run


def h_crash(ctx, body):
    report(body["out"], ev="start", attempt=ctx.attempt)
    if ctx.attempt == 1:
        if body["how"] == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    report(body["out"], ev="done", attempt=ctx.attempt)


def h_fail(ctx, body):
    report(body["out"], ev="fail", attempt=ctx.attempt)
    raise ValueError(f"boom {body['n']}")


def h_fetch(ctx, body):
    report(body["out"], ev="fetch", n=body["n"], message_id=ctx.message_id,
           correlation_id=ctx.correlation_id, parent_id=ctx.parent_id)
    for part in ("a", "b"):
        ctx.publish("resize", {"out": body["out"], "n": body["n"], "part": part})


class _Capture(logging.Handler):
    last = None

    def emit(self, record):
        _Capture.last = record


_capture = _Capture()


def h_resize(ctx, body):
    if _capture not in ctx.logger.handlers:
        ctx.logger.addHandler(_capture)
    ctx.logger.warning("resizing part %s", body["part"])
    rec = _Capture.last
    report(body["out"], ev="resize", n=body["n"], part=body["part"], message_id=ctx.message_id,
           correlation_id=ctx.correlation_id, parent_id=ctx.parent_id,
           log=(rec.msg_type, rec.message_id, rec.correlation_id, rec.attempt, rec.getMessage()))


def h_work(ctx, body):
    time.sleep(body.get("sleep", 0.0))
    report(body["out"], ev="done", n=body["n"])


def h_long(ctx, body):
    report(body["out"], ev="start", type=ctx.type, attempt=ctx.attempt)
    for _ in range(body["steps"]):
        time.sleep(body["step"])
        if body.get("heartbeat"):
            ctx.heartbeat(extend=body["extend"])
    report(body["out"], ev="end", type=ctx.type, cancelled=ctx.cancelled.is_set())


class Broken:
    def __init__(self):
        raise RuntimeError("cannot connect to the image store")

    def handle(self, ctx, body):
        pass


class WorkerScoped:
    def __init__(self):
        self.n = 0

    def handle(self, ctx, body):
        self.n += 1
        report(body["out"], ev="scoped", type=ctx.type, inst=id(self), n=self.n)


class MessageScoped(WorkerScoped):
    def __call__(self, ctx, body):
        self.handle(ctx, body)


# --- fixtures -------------------------------------------------------------------------


@pytest.fixture
def rec(spool_dir):
    r = Records(os.path.join(spool_dir, "records"))
    yield r
    r.sp.close()


@pytest.fixture
def make(spool_dir):
    made = []

    def make(**kw):
        for k, v in (("capacity", "1MiB"), ("dead_capacity", "256KiB"), ("grace", 5.0),
                     ("leases", 256), ("keys", 64), ("max_workers", 16), ("reservoir", 64)):
            kw.setdefault(k, v)
        d = Dispatcher(os.path.join(spool_dir, "q"), **kw)
        made.append(d)
        return d

    yield make
    pids = []
    for d in made:
        pids += [p for ps in d.workers().values() for p in ps] if d._state != "new" else []
        d.close()
    for d in made:
        Dispatcher.destroy(d.path)
    # no orphans: every worker was joined
    assert not mp.active_children()
    assert not [p for p in pids if psutil.pid_exists(p) and
                psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def max_overlap(intervals):
    events = sorted([(t0, 1) for t0, _ in intervals] + [(t1, -1) for _, t1 in intervals])
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def body(rec, **kw):
    return dict(out=rec.sp.path, **kw)


# --- tests ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_handlers_run_with_configured_parallelism(make, rec, method):
    d = make(start_method=method)
    d.register("sleepy", h_sleep, parallelism=3)
    d.register("single", h_sleep, parallelism=1)
    d.start()
    assert {t: len(p) for t, p in d.workers().items()} == {"sleepy": 3, "single": 1}
    for i in range(9):
        d.publish("sleepy", body(rec, sleep=0.25, n=i))
    for i in range(3):
        d.publish("single", body(rec, sleep=0.1, n=i))
    rec.until(lambda rs: rec.count(ev="end")(rs) == 12, what="12 handler runs")
    sleepy = rec.of(ev="end", type="sleepy")
    single = rec.of(ev="end", type="single")
    assert sorted(r["n"] for r in sleepy) == list(range(9))
    assert max_overlap([(r["t0"], r["t1"]) for r in sleepy]) == 3
    assert max_overlap([(r["t0"], r["t1"]) for r in single]) == 1
    assert len({r["pid"] for r in sleepy}) == 3
    d.stop()  # every worker has exited: the counters are final
    m = d.metrics()
    assert (m["sleepy"]["processed"], m["single"]["processed"]) == (9, 3)
    assert m["sleepy"]["in_progress"] == 0 and m["sleepy"]["failed"] == 0
    lat = m["sleepy"]["latency"]
    assert lat["count"] == 9 and 0.25 <= lat["p50"] <= lat["p90"] <= lat["p99"] < 5
    assert m["sleepy"]["queue"]["ready"] == 0 and m["sleepy"]["queue"]["in_flight"] == 0


def _wait_replaced(d, type_, pid, timeout=bound(10)):
    """The dead letter can be written before the worker is gone: wait (bounded) for the
    supervisor to see the exit and start a replacement, rather than racing it."""
    deadline = time.monotonic() + timeout
    while pid in d.workers()[type_] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pid not in d.workers()[type_], f"worker {pid} of {type_!r} was not replaced"
    assert d.wait_ready(type_, timeout=timeout)


def test_timeout_cancels_cooperative_and_kills_uncooperative(make, rec):
    d = make()
    d.register("coop", h_coop, timeout=0.3, max_attempts=2, cancel_grace=5.0)
    d.register("stubborn", h_stubborn, timeout=0.3, max_attempts=2, cancel_grace=0.3)
    d.start()
    dead = {t: shmq.Spool.open(d.queue_path(t) + ".dead") for t in ("coop", "stubborn")}
    readers = {t: sp.reader() for t, sp in dead.items()}
    d.publish("coop", body(rec))
    d.publish("stubborn", body(rec))
    for t, r in readers.items():  # wakes when the dead letter is written
        r.get(timeout=bound(20))
    for sp in dead.values():
        sp.close()
    for t, phrase in (("coop", "was cancelled"), ("stubborn", "ignored the cancellation")):
        with d.queue(t) as q:
            (dl,) = q.dead_letters()
            st = q.stats()
        assert dl.attempts == 2 and dl.error["type"] == HandlerTimeout.__name__, dl.error
        assert phrase in dl.error["message"], dl.error
        assert (st.in_flight, st.ready, st.delayed, st.dead) == (0, 0, 0, 1)
    rec.until(lambda rs: rec.count(ev="cancelled")(rs) == 2
              and rec.count(ev="start", type="stubborn")(rs) == 2, what="all four attempts")
    coop = rec.of(ev="cancelled")
    assert [r["attempt"] for r in coop] == [1, 2]
    assert all(-5.0 < r["left"] <= 0 for r in coop)  # woken by the cancellation
    assert len({r["pid"] for r in rec.of(type="coop")}) == 1  # cooperative: the worker survives
    stub = rec.of(ev="start", type="stubborn")
    assert [r["attempt"] for r in stub] == [1, 2]
    assert stub[0]["pid"] != stub[1]["pid"]  # terminated and replaced
    assert not rec.of(ev="end", type="stubborn")
    _wait_replaced(d, "stubborn", stub[1]["pid"])
    d.stop()
    m = d.metrics()
    assert (m["coop"]["timed_out"], m["stubborn"]["timed_out"]) == (2, 2)
    assert m["coop"]["in_progress"] == m["stubborn"]["in_progress"] == 0
    assert m["coop"]["crashed"] == m["stubborn"]["crashed"] == 0


def test_supervisor_kills_a_handler_holding_the_gil(make, rec):
    d = make()
    d.register("hog", h_gil, timeout=0.2, cancel_grace=0.2, max_attempts=1)
    d.start()
    dead = shmq.Spool.open(d.queue_path("hog") + ".dead")
    r = dead.reader()
    d.publish("hog", body(rec))
    r.get(timeout=bound(20))
    dead.close()
    with d.queue("hog") as q:
        (dl,) = q.dead_letters()
    assert dl.error["type"] == "HandlerTimeout" and "killed by the supervisor" in dl.error["message"]
    (start,) = rec.until(lambda rs: len(rs) == 1)
    _wait_replaced(d, "hog", start["pid"])
    d.stop()
    assert d.metrics()["hog"]["timed_out"] == 1


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_crashed_worker_is_replaced_and_message_redelivered(make, rec, how):
    d = make()
    d.register("crashy", h_crash, parallelism=1, max_attempts=3)
    d.start()
    (first_pid,) = d.workers()["crashy"]
    d.publish("crashy", body(rec, how=how))
    rec.until(lambda rs: rec.count(ev="done")(rs) == 1, what="the redelivery")
    starts = rec.of(ev="start")
    assert [r["attempt"] for r in starts] == [1, 2]
    assert starts[0]["pid"] == first_pid and starts[1]["pid"] != first_pid
    assert d.wait_ready("crashy", timeout=bound(10))
    d.stop()
    m = d.metrics()["crashy"]
    assert (m["crashed"], m["processed"], m["in_progress"]) == (1, 1, 0)
    with d.queue("crashy") as q:
        st = q.stats()
        assert q.dead_letters() == []
    assert (st.acked, st.redeliveries, st.in_flight) == (1, 1, 0)


def test_failures_are_retried_then_dead_lettered_and_unknown_types_too(make, rec, spool_dir):
    d = make(max_attempts=2)  # the ingress queue's attempts bound unknown types
    d.register("failing", h_fail, max_attempts=3, retry_delay=0.05)
    d.start()
    ingress_dead = shmq.Spool.open(d.path + ".dead")
    r_in = ingress_dead.reader()
    fail_dead = shmq.Spool.open(d.queue_path("failing") + ".dead")
    r_fail = fail_dead.reader()
    with shmq.WorkQueue.open(d.path) as wq:
        mystery = wq.put("x", headers={"type": "mystery"})
        untyped = wq.put("y")
        d.publish("failing", body(rec, n=7))
        r_fail.get(timeout=bound(20))
        r_in.get(timeout=bound(20))
        r_in.get(timeout=bound(20))
        dls = {dl.message_id: dl for dl in wq.dead_letters()}
    ingress_dead.close()
    fail_dead.close()
    assert set(dls) == {mystery, untyped}
    assert all(dl.error["type"] == "NoHandler" and dl.attempts == 2 for dl in dls.values())
    assert "mystery" in dls[mystery].error["message"]
    assert "no 'type' header" in dls[untyped].error["message"]
    with d.queue("failing") as q:
        (dl,) = q.dead_letters()
    assert dl.attempts == 3 and dl.error["type"] == "ValueError"
    assert "boom 7" in dl.error["message"] and "h_fail" in dl.error["traceback"]
    rec.until(lambda rs: len(rs) == 3)
    assert [r["attempt"] for r in rec.of(ev="fail")] == [1, 2, 3]
    d.stop()
    st = status(d.path)
    assert st["unroutable"] == 4 and st["types"]["failing"]["failed"] == 3


def test_lease_is_renewed_and_heartbeat_extends_the_timeout(make, rec):
    d = make()
    # a 0.3 s lease, a 1.2 s handler and an idle second worker: without the
    # automatic renewal the lease would expire and the other worker take it
    d.register("long", h_long, parallelism=2, lease=0.3)
    d.register("progress", h_long, timeout=0.3, cancel_grace=0.2)
    d.start()
    d.publish("long", body(rec, steps=4, step=0.3))
    d.publish("progress", body(rec, steps=6, step=0.1, heartbeat=True, extend=0.3))
    rec.until(lambda rs: rec.count(ev="end")(rs) == 2, what="both handlers' ends")
    assert [r["attempt"] for r in rec.of(ev="start")] == [1, 1]
    assert not any(r["cancelled"] for r in rec.of(ev="end"))
    d.stop()
    m = d.metrics()
    assert (m["long"]["processed"], m["progress"]["processed"]) == (1, 1)
    assert m["progress"]["timed_out"] == 0 and m["long"]["lease_lost"] == 0
    assert m["long"]["queue"]["redeliveries"] == 0


def test_worker_startup_failure_fails_start(make):
    d = make()
    d.register("broken", Broken, scope="worker")
    with pytest.raises(shmq.ShmqError, match="cannot connect to the image store"):
        d.start()
    assert status(d.path)["state"] == "stopped"


@pytest.mark.parametrize("method", ["forkserver", "spawn"])  # "fork" is refused (threads)
def test_chaining_carries_correlation_ids(make, rec, method):
    d = make(start_method=method)
    d.register("fetch", h_fetch, parallelism=1)
    d.register("resize", h_resize, parallelism=2)
    d.start()
    with pytest.raises(shmq.ShmqError, match="already running"):
        other = Dispatcher(d.path)
        other.register("fetch", h_fetch)
        try:
            other.start()
        finally:
            other.close()
    root = d.publish("fetch", body(rec, n=1))
    with shmq.WorkQueue.open(d.path) as wq:
        raw = wq.put(body(rec, n=2), headers={"type": "fetch", "correlation_id": "order-7"})
    rec.until(lambda rs: rec.count(ev="resize")(rs) == 4, what="four resizes")
    f1, f2 = sorted(rec.of(ev="fetch"), key=lambda r: r["n"])
    assert (f1["message_id"], f1["correlation_id"], f1["parent_id"]) == (root, root, None)
    assert (f2["message_id"], f2["correlation_id"], f2["parent_id"]) == (raw, "order-7", None)
    resizes = rec.of(ev="resize")
    for n, parent, corr in ((1, root, root), (2, raw, "order-7")):
        rs = [r for r in resizes if r["n"] == n]
        assert sorted(r["part"] for r in rs) == ["a", "b"]
        assert all(r["correlation_id"] == corr and r["parent_id"] == parent for r in rs)
        for r in rs:
            assert r["log"][:4] == ("resize", r["message_id"], corr, 1)
            assert r["log"][4] == f"resizing part {r['part']}"
    ids = [r["message_id"] for r in resizes]
    assert len(set(ids)) == 4 and not {root, raw} & set(ids)
    d.stop()
    m = d.metrics()
    assert (m["fetch"]["processed"], m["resize"]["processed"]) == (2, 4)
    # only the plain put on the ingress queue took the router hop: publish() and
    # ctx.publish() of registered types go straight into the type's queue
    assert status(d.path)["routed"] == 1


def test_class_handlers_worker_and_message_scope(make, rec):
    d = make()
    d.register("per_worker", WorkerScoped, scope="worker")
    d.register("per_message", MessageScoped)
    d.start()
    for _ in range(3):
        d.publish("per_worker", body(rec))
        d.publish("per_message", body(rec))
    rec.until(lambda rs: len(rs) == 6)
    pw = rec.of(type="per_worker")
    pm = rec.of(type="per_message")
    assert [r["n"] for r in pw] == [1, 2, 3] and len({r["inst"] for r in pw}) == 1
    assert [r["n"] for r in pm] == [1, 1, 1]


def test_scaling_up_and_down_under_load_loses_nothing(make, rec, capsys):
    d = make()
    d.register("work", h_work, parallelism=1)
    d.start()
    n_msgs = 300
    for i in range(n_msgs):
        d.publish("work", body(rec, n=i, sleep=0.01))
    done = rec.count(ev="done")
    rec.until(lambda rs: done(rs) >= 20, what="20 done")
    assert d.scale("work", 4, wait=10)
    started = set(d.workers()["work"])  # which processes ran, not which got messages (timing)
    assert len(started) == 4
    rec.until(lambda rs: done(rs) >= 100, what="100 done")
    # scale down from the command line, while all four are busy
    assert dispatch_main(["scale", d.path, "work", "1"]) == 0
    assert "work: 4 -> 1 workers" in capsys.readouterr().out
    assert d.wait_ready("work", timeout=bound(10))
    assert len(d.workers()["work"]) == 1
    rec.until(lambda rs: done(rs) >= 160, what="160 done")
    assert d.scale("work", 2, wait=10)
    started |= set(d.workers()["work"])
    rec.until(lambda rs: len({r["n"] for r in rs if r["ev"] == "done"}) == n_msgs, timeout=bound(30),
              what="every message")
    assert sorted({r["n"] for r in rec.of(ev="done")}) == list(range(n_msgs))
    assert len(started) >= 5  # the first + 3 added, then 1 added back after scaling down
    # readable from another process, through the CLI
    out = subprocess.run([sys.executable, "-m", "shmq.dispatch", "status", d.path, "--json"],
                         capture_output=True, text=True, timeout=bound(60))
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert st["state"] == "running" and st["pid"] == os.getpid() and st["alive"]
    w = st["types"]["work"]
    assert (w["workers"], w["target"]) == (2, 2) and w["processed"] >= n_msgs - 2
    assert dispatch_main(["status", d.path]) == 0
    assert "work" in capsys.readouterr().out
    d.stop()
    with d.queue("work") as q:
        st = q.stats()
    assert (st.acked, st.in_flight, st.ready, st.delayed, st.dead) == (n_msgs, 0, 0, 0, 0)
    w = Dispatcher.metrics(d.path)["work"]
    assert (w["processed"], w["failed"], w["crashed"], w["workers"]) == (n_msgs, 0, 0, 0)
    assert w["latency"]["p50"] >= 0.01 and w["queue"]["dead"] == 0


def test_stop_grace_exceeded_kills_and_requeues(make, rec):
    d = make()
    d.register("slow", h_sleep, parallelism=1)
    d.start()
    (pid,) = d.workers()["slow"]
    d.publish("slow", body(rec, sleep=30))
    rec.until(lambda rs: len(rs) == 1)
    t = time.monotonic()
    d.stop(grace=0.3)
    assert time.monotonic() - t < 5
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    st = status(d.path)
    assert st["state"] == "stopped" and not st["alive"]
    assert st["types"]["slow"]["crashed"] == 1 and st["types"]["slow"]["in_progress"] == 0
    q = st["types"]["slow"]["queue"]
    assert q["in_flight"] == 0 and q["ready"] == 1  # nacked: delivered again next run
    assert dispatch_main(["scale", d.path, "slow", "2"]) == 1


def serve_dispatcher(path, out):
    """Child process: a dispatcher in its main thread, stopped by a signal."""
    d = Dispatcher(path, capacity="1MiB", dead_capacity="256KiB", leases=64, keys=64,
                   max_workers=8, reservoir=16, grace=10.0)
    d.register("slow", h_sleep, parallelism=2)
    d.start()
    report(out, ev="serving", workers=d.workers()["slow"])
    d.run()
    d.close()


def wait_catching(pid, sig, timeout=bound(30)):
    """Block until process ``pid`` has a handler installed for ``sig`` (SigCgt in
    /proc/<pid>/status), so a signal sent next reaches the handler."""
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
        if caught >> (sig - 1) & 1:
            return
        assert time.monotonic() < deadline, f"pid {pid} never installed a handler for {sig!r}"
        time.sleep(0.005)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_run_shuts_down_cleanly_on_signal(spool_dir, rec, sig):
    """SIGTERM/SIGINT: a clean stop.  SIGKILL of the dispatcher: its workers see
    their pipe close, finish their message and exit (no orphans)."""
    path = os.path.join(spool_dir, "q")
    # The dispatcher runs as a program would: a fresh interpreter (spawn). Its own
    # workers' start methods are covered by the tests above; what is tested here is
    # how the process that runs it reacts to a signal, whatever started it.
    proc = mp.get_context("spawn").Process(target=serve_dispatcher, args=(path, rec.sp.path))
    proc.start()
    try:
        (serving,) = rec.until(lambda rs: len(rs) == 1, timeout=bound(60))
        tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert set(serving["workers"]) <= set(tree)  # workers (+ the forkserver)
        with shmq.WorkQueue.open(path) as wq:
            for i in range(2):
                wq.put(body(rec, sleep=0.5, n=i), headers={"type": "slow"})
        rec.until(lambda rs: rec.count(ev="start")(rs) == 2, what="both handlers running")
        # "serving" is reported before run() installs its handlers: a SIGTERM sent in
        # between would meet the default action.  Wait until the kernel shows it caught.
        wait_catching(proc.pid, signal.SIGTERM)
        os.kill(proc.pid, sig)
        proc.join(bound(30))
        assert proc.exitcode == (-signal.SIGKILL if sig == signal.SIGKILL else 0)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(bound(5))
    # both running handlers finished within the grace period
    rec.until(lambda rs: rec.count(ev="end")(rs) == 2, timeout=bound(5), what="both handlers' ends")
    assert sorted(r["n"] for r in rec.of(ev="end")) == [0, 1]
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in tree if psutil.pid_exists(p)],
                                    timeout=bound(10))
    assert not alive, f"orphans: {alive}"
    st = status(path)
    assert st["state"] == ("dead" if sig == signal.SIGKILL else "stopped") and not st["alive"]
    assert st["types"]["slow"]["processed"] == 2
    assert st["types"]["slow"]["queue"]["in_flight"] == 0
    Dispatcher.destroy(path)
    assert os.listdir(spool_dir) == ["records"]


def test_registration_errors(spool_dir):
    d = Dispatcher(os.path.join(spool_dir, "q"), capacity="256KiB", dead_capacity="64KiB")
    try:
        with pytest.raises(TypeError, match="importable"):
            d.register("a", lambda ctx, body: None)

        def local(ctx, body):
            pass

        with pytest.raises(TypeError, match="importable"):
            d.register("a", local)
        for bad in ("", "a/b", ".x", "x.dead", "dead", "dispatch", "a b", 3):
            with pytest.raises(ValueError):
                d.register(bad, h_work)
        with pytest.raises(ValueError, match="scope"):
            d.register("a", h_work, scope="worker")
        with pytest.raises(ValueError, match="scope"):
            d.register("a", WorkerScoped, scope="process")
        with pytest.raises(ValueError):
            d.register("a", h_work, timeout=0)
        with pytest.raises(RuntimeError, match="no handlers"):
            d.start()
        d.register("a", h_work)
        with pytest.raises(ValueError, match="already registered"):
            d.register("a", h_work)
        assert d.handler("b", parallelism=2)(h_work) is h_work  # the decorator form
        assert d.types == ["a", "b"]
        with pytest.raises(ValueError, match="fork"):
            Dispatcher(d.path, start_method="fork")
    finally:
        d.close()
        Dispatcher.destroy(d.path)
    assert dispatch_main(["status", d.path]) == 1
    assert dispatch_main(["scale", d.path, "a", "1"]) == 1


def test_publish_goes_straight_to_the_type_queue(make, rec):
    d = make()
    d.register("fetch", h_fetch, parallelism=0)  # paused: the messages stay queued
    d.register("resize", h_resize, parallelism=0)
    with pytest.raises(RuntimeError, match="started dispatcher"):
        d.scale("fetch", 1)
    assert d.wait_ready(timeout=0) is False and d.workers() == {"fetch": [], "resize": []}
    early = d.publish("fetch", body(rec, n=1))  # before start: through the ingress queue
    d.start()
    ids = [d.publish("fetch", body(rec, n=2)), d.publish("resize", body(rec, n=3, part="a"))]
    # direct ids carry the type's number (registration order, from 1) above bit 48
    assert [i >> 48 for i in ids] == [1, 2] and early >> 48 == 0
    with d.queue("fetch") as q:
        st = q.stats()
    assert st.ready + st.in_flight >= 1  # the direct one is already there, no router hop
    assert status(d.path)["routed"] <= 1  # only the early one may have been forwarded
    with d.queue("resize") as q:
        m = q.get(timeout=bound(5))  # the body as published: one pickle, no forwarding headers
    assert m.id == ids[1] & ((1 << 48) - 1) and m.headers == {"type": "resize"}
    assert m.body == body(rec, n=3, part="a")


def test_close_keeps_the_pipes_of_a_supervisor_thread_still_running(tmp_path):
    # stop() closes after joining the supervisor thread for grace + 30 s; a thread still
    # running then still waits on the wake pipe (and run() on the done pipe): closed
    # under the wait, the poll would name a freed number.
    from shmq.dispatch.supervisor import Supervisor
    from shmq.workers import WakePipe

    sup = Supervisor(str(tmp_path / "d"), {}, {}, start_method="fork", grace=1.0, initializer=None,
                     log_level=None, max_workers=1, reservoir=0, start_timeout=1.0, qopts={},
                     unknown_type_delay=0.0)
    sup.wake_pipe, sup.done_pipe = wake, done = WakePipe(), WakePipe()
    fds = (wake.fileno(), wake._w, done.fileno(), done._w)
    go = threading.Event()
    sup.thread = threading.Thread(target=go.wait, args=(bound(30),))
    sup.thread.start()
    try:
        sup.close()
        assert (sup.wake_pipe, sup.done_pipe) == (wake, done) and not wake.closed and not done.closed
        for fd in fds:
            os.fstat(fd)  # still open
    finally:
        go.set()
        sup.thread.join(bound(30))
    sup.close()  # the thread is gone: now they go
    assert (sup.wake_pipe, sup.done_pipe) == (None, None) and wake.closed and done.closed
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
