"""Chaos run of shmq.Service: clients call while workers are SIGKILLed on a timer.

Every call must get exactly one correct reply (no Timeout, no RemoteError, no
wrong reply); duplicates from redelivered calls must be dropped by the
clients.  Full run: 32 client processes x 1,000
calls against 4 workers, a worker SIGKILLed every 100 ms::

    python stress/service_chaos.py                 # full run
    python stress/service_chaos.py --quick         # the test suite's run
    python stress/service_chaos.py --json out.json

Prints a summary; exits 1 on any violation, or if nothing was killed.
"""

import argparse
import glob
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# This checkout's shmq when its core is built in place; otherwise the installed one
# (a source tree without a built core cannot be imported: .ci/aarch64 installs it).
if glob.glob(os.path.join(ROOT, "shmq", "_core*.so")):
    sys.path.insert(0, ROOT)

import psutil  # noqa: E402

import shmq  # noqa: E402

CALL_TIMEOUT = 120.0


def handler(req):
    seed, i, payload = req
    # a little work, so that kills land inside handlers too, not only between calls
    acc = 0
    for k in range(200):
        acc += k * i
    return (seed, i, len(payload), acc)


def expected(seed, i, payload):
    return (seed, i, len(payload), sum(k * i for k in range(200)))


def serve(path, workers):
    shmq.Service(path).serve(handler, workers=workers)


def client(path, seed, calls, batch, out):
    rng = random.Random(seed)
    bad = 0
    done = 0
    errors = []
    with shmq.Client(path) as cl:
        i = 0
        while i < calls:
            n = min(calls - i, rng.choice([1, 1, batch]))
            reqs = [(seed, j, b"p" * rng.randrange(0, 2048)) for j in range(i, i + n)]
            try:
                if n == 1:
                    got = [cl.call(reqs[0], timeout=CALL_TIMEOUT)]
                else:
                    got = cl.call_many(reqs, timeout=CALL_TIMEOUT)
            except Exception as exc:  # Timeout, RemoteError: each is a violation
                errors.append(f"{type(exc).__name__}: {exc}")
                bad += n
                i += n
                continue
            for r, g in zip(reqs, got):
                if g != expected(*r):
                    bad += 1
                    errors.append(f"wrong reply to {r[:2]}: {g!r}"[:200])
            done += len(got)
            i += n
        out.put({"seed": seed, "replies": done, "bad": bad, "dups": cl.duplicates,
                 "errors": errors[:5]})


def workers_of(supervisor_pid):
    """The serving processes under the supervisor: the leaves of its tree (under fork, the
    workers are the children of a zygote; tests/test_workers.py kills zygotes)."""
    try:
        return [c.pid for c in psutil.Process(supervisor_pid).children(recursive=True)
                if not c.children()]
    except psutil.NoSuchProcess:
        return []


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--kill-every", type=float, default=0.1)
    ap.add_argument("--batch", type=int, default=16, help="call_many size some calls use")
    ap.add_argument("--quick", action="store_true", help="8 clients x 150 calls")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.quick:
        a.clients, a.calls = 8, 150
    ctx = mp.get_context("fork")
    d = tempfile.mkdtemp(prefix="shmq-chaos-", dir="/dev/shm")
    path = os.path.join(d, "svc")
    shmq.Service(path).close()
    sup = ctx.Process(target=serve, args=(path, a.workers))
    sup.start()
    out = ctx.Queue()
    t0 = time.monotonic()
    clients = [ctx.Process(target=client, args=(path, a.seed * 1000 + s, a.calls, a.batch, out))
               for s in range(a.clients)]
    for c in clients:
        c.start()
    kills = 0
    stop = threading.Event()

    def killer():
        nonlocal kills
        rng = random.Random(a.seed)
        while not stop.wait(a.kill_every):
            pids = workers_of(sup.pid)
            if pids:
                try:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                    kills += 1
                except ProcessLookupError:
                    pass

    kt = threading.Thread(target=killer, daemon=True)
    kt.start()
    results = []
    try:
        for _ in clients:
            results.append(out.get(timeout=CALL_TIMEOUT * 3))
    finally:
        stop.set()
        kt.join()
        elapsed = time.monotonic() - t0
        for c in clients:
            c.join(30)
            if c.is_alive():
                c.kill()
        svc = shmq.Service(path)
        st = svc.stats()
        svc.close()
        os.kill(sup.pid, signal.SIGTERM)
        sup.join(30)
        if sup.is_alive():
            sup.kill()
        shmq.Service.destroy(path)
        shutil.rmtree(d, ignore_errors=True)
    calls = a.clients * a.calls
    replies = sum(r["replies"] for r in results)
    bad = sum(r["bad"] for r in results) + (calls - replies - sum(r["bad"] for r in results))
    res = {"clients": a.clients, "calls_per_client": a.calls, "workers": a.workers,
           "kill_every_s": a.kill_every, "calls": calls, "replies": replies,
           "violations": bad, "kills": kills, "redeliveries": st.redeliveries,
           "duplicates_dropped": sum(r["dups"] for r in results), "seconds": round(elapsed, 2),
           "calls_per_s": round(calls / elapsed, 1),
           "errors": [e for r in results for e in r["errors"]][:10]}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)
    return 1 if bad or not kills else 0


if __name__ == "__main__":
    sys.exit(main())
