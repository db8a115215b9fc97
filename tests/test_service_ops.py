"""Operating a shmq.Service: its board PATH.svc and what shmq stat / top / metrics show of it.

The service runs in a forked child with handlers that block until the
test lets them go, so exactly N calls are in flight when the CLI looks.
"""

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import shmq
from shmq.rpc import board as B

from conftest import bound

FORK = mp.get_context("fork")
T = bound(30)  # bound for any single wait


def shmq_cmd(*args, timeout=bound(60)):
    return subprocess.run([sys.executable, "-m", "shmq", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def _serve_blocking(path, workers, started, go):
    def handle(req):
        started.put(os.getpid())
        if not go.wait(T):
            raise TimeoutError("the test never let the handler go")
        if req == "fail":
            raise ValueError("as asked")
        return req * 2
    shmq.Service(path).serve(handle, workers=workers)


def _wait_for(cond, what):
    """Until ``cond()`` holds (the spool's own counters), at most T seconds."""
    end = time.monotonic() + T
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def blocked_service(spool_dir):
    """A 2-worker service with 5 calls made: 2 in flight (handlers blocked), 3 queued."""
    path = os.path.join(spool_dir, "scorer")
    svc = shmq.Service(path)
    started, go = FORK.Queue(), FORK.Event()
    proc = FORK.Process(target=_serve_blocking, args=(path, 2, started, go))
    proc.start()
    cl = shmq.Client(path)
    out = {}
    # four calls of their own (threads), not one call_many: that would send them as
    # one bundle, all in one worker's hands
    callers = [threading.Thread(target=lambda i=i: out.update({i: cl.call(i + 1, timeout=T)}))
               for i in range(4)]
    caller = _Joined(callers)
    pids = set()
    try:
        for c in callers:
            c.start()
        pids = {started.get(timeout=T), started.get(timeout=T)}  # both handlers hold a call
        _wait_for(lambda: (svc.stats().in_flight, svc.stats().queued) == (2, 2), "2 + 2 calls")
        t_blocked = time.monotonic()
        yield {"path": path, "svc": svc, "pids": pids, "go": go, "t_blocked": t_blocked,
               "caller": caller, "out": out, "proc": proc}
    finally:
        go.set()
        caller.join(T)
        cl.close()
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(T)
        svc.close()
        shmq.Service.destroy(path)


class _Joined:
    def __init__(self, threads):
        self.threads = threads

    def join(self, timeout):
        for t in self.threads:
            t.join(timeout)


def _safe(cl, r):
    try:
        return cl.call(r, timeout=T)
    except shmq.RemoteError as exc:
        return exc


def test_board_buckets_resolve_within_an_eighth():
    for ns in [1, 999, 1000, 1500, 3999, 4000, 4999, 10_000, 123_456, 7_654_321,
               999_999_999, 3_600 * 10**9]:
        i = B.bucket_of(ns)
        assert 0 <= i < B.BUCKETS
        mid = B.bucket_mid_s(i)
        if ns >= 4000:
            assert abs(mid - ns * 1e-9) <= 0.125 * ns * 1e-9, (ns, i, mid)
    assert B.bucket_of(10**20) == B.BUCKETS - 1  # beyond 2^35 µs: the last bucket
    assert [B.bucket_of(ns) for ns in (10_000, 10_001, 20_000)] == sorted(
        B.bucket_of(ns) for ns in (10_000, 10_001, 20_000))
    counts = [0] * B.BUCKETS
    for ns in [100_000] * 98 + [50_000_000] * 2:
        counts[B.bucket_of(ns)] += 1
    assert abs(B.quantile(counts, 0.5) - 1e-4) <= 0.125e-4
    assert abs(B.quantile(counts, 0.99) - 5e-2) <= 0.125 * 5e-2  # rank 99 of 100: the slow two
    assert B.quantile([0] * B.BUCKETS, 0.5) is None


def test_stat_shows_queued_in_flight_workers_and_latency(blocked_service):
    s = blocked_service
    res = shmq_cmd("stat", s["path"], "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)["service"]
    assert (d["queued"], d["in_flight"], d["busy"]) == (2, 2, 2)
    assert d["workers"] == 2 and set(d["pids"]) == s["pids"]
    assert d["calls"] == 0 and d["latency"]["p50"] is None

    text = shmq_cmd("stat", s["path"])
    assert text.returncode == 0, text.stderr
    assert "service: 2 workers (pids " in text.stdout
    assert "2 busy; calls queued 2, in flight 2; answered 0" in text.stdout

    time.sleep(0.3)  # the blocked calls' service time: at least this (a lower bound to check)
    blocked = time.monotonic() - s["t_blocked"]
    s["go"].set()
    s["caller"].join(T)
    assert [s["out"][i] for i in range(4)] == [2, 4, 6, 8]
    d = json.loads(shmq_cmd("stat", s["path"], "--json").stdout)["service"]
    assert (d["queued"], d["in_flight"], d["busy"], d["calls"], d["failed"]) == (0, 0, 0, 4, 0)
    lat, svc_t = d["latency"], d["service_time"]
    assert lat["count"] == svc_t["count"] == 4
    # the two calls held while the test slept took at least that long, within a bucket
    assert svc_t["p99"] >= 0.875 * blocked and lat["p99"] >= 0.875 * blocked
    assert lat["p99"] < T and lat["p50"] <= lat["p99"] and svc_t["p50"] <= svc_t["p99"]
    # latency (from the caller's put) is never below the service time of the same calls
    assert lat["p99"] >= svc_t["p99"] * 0.875 / 1.125

    prom = shmq_cmd("stat", s["path"], "--format", "prometheus").stdout
    assert f'shmq_service_calls_total{{service="{s["path"]}"}} 4' in prom
    assert f'shmq_service_workers{{service="{s["path"]}"}} 2' in prom
    assert f'shmq_service_latency_seconds{{service="{s["path"]}",quantile="0.99"}}' in prom


def test_top_and_metrics_show_the_service(blocked_service):
    s = blocked_service
    top = shmq_cmd("top", "--once", "--interval", "0.1", os.path.dirname(s["path"]))
    assert top.returncode == 0, top.stderr
    lines = top.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("SERVICE"))
    row = lines[head + 1].split()
    assert row[0] == "scorer" and row[1] == "2" and row[3:7] == ["2", "2", "2", "0"]
    pytest.importorskip("prometheus_client")
    m = shmq_cmd("metrics", s["path"])
    assert m.returncode == 0, m.stderr
    assert f'shmq_service_in_flight{{service="{s["path"]}"}} 2.0' in m.stdout
    assert f'shmq_service_queued{{service="{s["path"]}"}} 2.0' in m.stdout


def test_errors_and_dropped_calls_are_counted(spool_dir):
    path = os.path.join(spool_dir, "svc")
    svc, cl = shmq.Service(path), shmq.Client(path)
    try:
        cl_t = threading.Thread(target=lambda: pytest.raises(shmq.Timeout, cl.call, "late",
                                                              timeout=0.05))
        cl_t.start()
        cl_t.join(T)  # its deadline passes before anyone takes it: dropped, counted
        out = {}
        t = threading.Thread(target=lambda: out.update(
            ok=cl.call("x", timeout=T), err=_safe(cl, "boom")))
        t.start()
        answered = 0
        for call in svc:  # the late call is dropped inside get(); two answered here
            if call.request == "boom":
                call.fail(ValueError("no"))
            else:
                call.reply(call.request.upper())
            answered += 1
            if answered == 2:
                break
        t.join(T)
        assert out["ok"] == "X" and isinstance(out["err"], shmq.RemoteError)
        d = B.service_status(path)
        assert (d["calls"], d["failed"], d["expired"]) == (2, 1, 1)
        assert d["workers"] == 1 and d["pids"] == [os.getpid()] and d["busy"] == 0
    finally:
        cl.close()
        svc.close()
    assert B.service_status(path)["workers"] == 0  # closed: the row is released
    shmq.Service.destroy(path)
    assert not os.path.lexists(path + ".svc")


def _claim_record_and_die(path, ready):
    b = B.Board.claim(path + ".svc")
    b.record(2_000_000, 1_000_000, failed=False)
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_dead_workers_row_keeps_its_counts_and_is_taken_over(spool_dir):
    import mmap

    from shmq._lock import process_start

    path = os.path.join(spool_dir, "svc")
    shmq.Service(path).close()
    ready = FORK.Event()
    p = FORK.Process(target=_claim_record_and_die, args=(path, ready))
    p.start()
    assert ready.wait(T)
    p.join(T)
    d = B.service_status(path)
    assert d["workers"] == 0 and d["calls"] == 1  # its holder is dead; its counts stay
    assert abs(d["latency"]["p50"] - 2e-3) <= 0.125 * 2e-3
    live = 1 | (process_start(1) & 0xFFFFFFFF) << 32  # pid 1: alive for as long as we run
    with open(path + ".svc", "r+b") as f:
        mm = mmap.mmap(f.fileno(), B.FILE_BYTES)
        w = memoryview(mm).cast("Q")
        dead_row = next(r for r in range(B.ROWS)
                        if w[B.HDR_WORDS + r * B.ROW_WORDS + B.R_HOLDER] == p.pid
                        | (w[B.HDR_WORDS + r * B.ROW_WORDS + B.R_HOLDER] >> 32) << 32)
        for r in range(B.ROWS):  # every other row held by a live process
            if r != dead_row:
                w[B.HDR_WORDS + r * B.ROW_WORDS + B.R_HOLDER] = live
        b = B.Board.claim(path + ".svc")
        assert b is not None and b.row == dead_row  # the dead one's row, taken over
        b.record(3_000_000, 1_000_000, failed=True)
        d = B.service_status(path)
        assert (d["calls"], d["failed"], d["pids"]) == (2, 1, sorted([1] * (B.ROWS - 1)
                                                                     + [os.getpid()]))
        b.release()
        w[B.HDR_WORDS + dead_row * B.ROW_WORDS + B.R_HOLDER] = live
        assert B.Board.claim(path + ".svc") is None  # all held by live processes
        w.release()
        mm.close()
    shmq.Service.destroy(path)


@pytest.mark.parametrize("plant", ["fifo", "symlink", "garbage", "short"])
def test_a_hostile_board_never_blocks_and_is_never_trusted(spool_dir, plant, caplog):
    path = os.path.join(spool_dir, "svc")
    bp = path + ".svc"
    target = os.path.join(spool_dir, "elsewhere")
    with open(target, "wb") as f:
        f.write(b"precious")
    if plant == "fifo":
        os.mkfifo(bp, 0o600)
    elif plant == "symlink":
        os.symlink(target, bp)
    elif plant == "garbage":
        with open(bp, "wb") as f:
            f.write(os.urandom(B.FILE_BYTES))
    else:
        with open(bp, "wb") as f:
            f.write(b"SHMQSVC1")
    if plant in ("garbage", "short"):  # a valid board must not be assumed
        with pytest.raises(shmq.ShmqError, match="not a service board"):
            B.service_status(path)
    svc, cl = shmq.Service(path), shmq.Client(path)  # serving goes on, whatever is there
    try:
        t = threading.Thread(target=lambda: next(iter(svc)).reply("ok"))
        t.start()
        assert cl.call("hi", timeout=T) == "ok"
        t.join(T)
        res = shmq_cmd("stat", path, timeout=T)  # never blocks on a FIFO, never follows
        assert res.returncode == 0, res.stderr
        if plant in ("fifo", "symlink"):
            assert "service: board unreadable" in res.stdout
            assert "not a regular file" in res.stdout
        else:  # ours but not a board: the service made it a valid one again
            assert "service: 1 worker" in res.stdout
    finally:
        cl.close()
        svc.close()
    with open(target, "rb") as f:
        assert f.read() == b"precious"  # the link's target was never written
    if plant in ("fifo", "symlink"):
        with pytest.raises(shmq.NotASpool):
            shmq.Service.destroy(path)  # refuses, removes nothing
        assert os.path.lexists(path)
        os.unlink(bp)
    shmq.Service.destroy(path)


def test_a_board_locked_for_ever_costs_its_rows_not_the_calls(spool_dir, monkeypatch, caplog):
    import fcntl

    path = os.path.join(spool_dir, "svc")
    svc, cl = shmq.Service(path), shmq.Client(path)
    from shmq.workers import board as platform_board

    monkeypatch.setattr(platform_board, "LOCK_WAIT_S", 0.1)  # the board's flock: the platform's
    fd = os.open(path + ".svc", os.O_RDWR)  # as a process forked while a claimer held it would
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        t = threading.Thread(target=lambda: next(iter(svc)).reply("served"))
        t.start()
        assert cl.call("hi", timeout=T) == "served"
        t.join(T)
        assert "served unrecorded" in caplog.text or "not recorded" in caplog.text
        assert "stayed locked" in caplog.text
        assert B.service_status(path)["calls"] == 0  # readers never need the lock
    finally:
        os.close(fd)
        cl.close()
        svc.close()
    shmq.Service.destroy(path)


def _hold_and_die(path, ready):
    b = B.Board.claim(path + ".svc")
    b.set_lease(7.0)
    b.busy()
    b.hold(10, 13, 3)
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)


def test_held_ranges_are_what_callers_trust_and_only_live_ones(spool_dir):
    """The board's held seqs: a live row's range and lease are read back; a dead
    row's are not (its calls must be sent again); in_flight counts live ones."""
    path = os.path.join(spool_dir, "svc")
    shmq.Service(path).close()
    b = B.Board.claim(path + ".svc")
    try:
        b.set_lease(2.5)
        b.busy()
        b.hold(4, 9, 2)
        [(lo, hi, since, lease)] = B.held_ranges(path)
        assert (lo, hi, lease) == (4, 9, 2_500_000_000) and since > 0
        assert B.service_status(path)["in_flight"] == 2
        b.record_many([(1_000, 2_000, False), (3_000, 4_000, True)])
        d = B.service_status(path)
        assert (d["calls"], d["failed"]) == (2, 1)
        b.hold(9, 9, 0)  # answered both
        assert B.held_ranges(path) == [] and B.service_status(path)["in_flight"] == 0
        ready = FORK.Event()
        p = FORK.Process(target=_hold_and_die, args=(path, ready))
        p.start()
        assert ready.wait(T)
        p.join(T)
        assert B.held_ranges(path) == []  # its holder is dead: nobody holds 10..12
        assert B.service_status(path)["in_flight"] == 0
    finally:
        b.release()
    shmq.Service.destroy(path)
