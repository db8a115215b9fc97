#!/usr/bin/env python3
"""A Spark job calling a sidecar that is SIGKILLed and restarted mid-job: every row answered once?

The sidecar is examples/spark_sidecar.py's (``shmq.Service`` with 2 workers
scoring Arrow batches with the example's numpy model), in its own process
group.  A Spark job (``local[2]``) scores ``--rows`` rows through
``shmq.spark.call_sidecar`` (``--batch-rows`` rows per call).  When the
service has answered about a third of the calls *and* holds at least one
call (in a worker's hands; each call sleeps ``--handler-delay`` in the
handler so that the kill lands mid-call), the whole sidecar (supervisor
and workers) is SIGKILLed at once (``killpg``); a new sidecar is started
on the same service path.  The tasks' clients find their calls in no live
worker's hands and send them again; the job's output is then checked:

* every id of ``0 .. rows-1`` exactly once (no row missing, none twice);
* every score equal to the example's formula, computed here with numpy;
* both incarnations of the sidecar answered (their pids are in the output).

Prints the result and exits 1 if a check fails.

    python stress/sidecar_restart.py              # 1M rows
    python stress/sidecar_restart.py --quick      # 100k rows
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time

import shmq

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples")
CTX = mp.get_context("spawn")
FEATURES = 4


class _Slowed:
    """The example's scorer, plus ``delay`` seconds per call: the example scores a
    batch in about a millisecond, so without it the kill lands between calls."""

    def __init__(self, delay):
        self.delay = delay

    def __call__(self, batch):
        import spark_sidecar as ex

        time.sleep(self.delay)
        return ex.score(batch)


def sidecar(path, ready, delay):
    os.setpgrp()  # its own group: one killpg takes the supervisor and its workers at once
    svc = shmq.Service(path)
    ready.set()
    svc.serve(_Slowed(delay), workers=2)


def start_sidecar(path, delay):
    ready = CTX.Event()
    p = CTX.Process(target=sidecar, args=(path, ready, delay))
    p.start()
    if not ready.wait(60):
        raise RuntimeError("the sidecar did not start")
    return p


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch-rows", type=int, default=10_000)
    ap.add_argument("--quick", action="store_true", help="100k rows")
    ap.add_argument("--handler-delay", type=float, default=0.05,
                    help="seconds each call sleeps in the sidecar (the kill then lands mid-call)")
    args = ap.parse_args()
    if args.quick:
        args.rows = 100_000
    n, calls = args.rows, -(-args.rows // args.batch_rows)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.abspath(EXAMPLES), os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, os.path.abspath(EXAMPLES))
    import threading

    import numpy as np
    from pyspark.sql import SparkSession

    import shmq.spark

    d = tempfile.mkdtemp(prefix="shmq-sidecar-restart-", dir="/dev/shm")
    path = os.path.join(d, "scorer")
    svc = shmq.Service(path)  # this process only reads the request queue's statistics
    side = [start_sidecar(path, args.handler_delay)]
    spark = (SparkSession.builder.master("local[2]").appName("shmq-sidecar-restart")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    killed = {}
    stop = threading.Event()

    def killer():
        """SIGKILL the sidecar once a third of the calls are answered and one is held."""
        while not stop.wait(0.01):
            st = svc.stats()
            if st.calls >= calls // 3 and st.in_flight >= 1:
                p = side[0]
                os.killpg(p.pid, signal.SIGKILL)
                p.join(30)
                killed.update(at=time.monotonic(), answered=st.calls, in_flight=st.in_flight,
                              queued=st.queued, pid=p.pid)
                side[0] = start_sidecar(path, args.handler_delay)  # the same service path: its calls are still there
                killed["restarted"] = time.monotonic()
                return

    try:
        df = spark.range(0, n, numPartitions=4).selectExpr(
            "id", *[f"cast(id % {7 + i} as double) as f{i}" for i in range(FEATURES)])
        out = shmq.spark.call_sidecar(df, path, "id long, score double, sidecar_pid long",
                                      batch_rows=args.batch_rows)
        t = threading.Thread(target=killer, daemon=True)
        t0 = time.monotonic()
        t.start()
        table = out.toArrow()
        elapsed = time.monotonic() - t0
        stop.set()
        t.join()
        redeliveries = svc.stats().redeliveries
    finally:
        stop.set()
        spark.stop()
        os.killpg(side[0].pid, signal.SIGTERM)
        side[0].join(60)
        svc.close()
        shmq.Service.destroy(path)
        shutil.rmtree(d, ignore_errors=True)

    ids = table.column("id").to_numpy()
    scores = table.column("score").to_numpy()
    pids = sorted(set(table.column("sidecar_pid").to_numpy().tolist()))
    counts = np.bincount(ids, minlength=n) if len(ids) else np.zeros(n, dtype=np.int64)
    missing = int((counts[:n] == 0).sum())
    twice = int((counts > 1).sum())
    w = np.array([0.5, -1.0, 2.0, 0.25])
    x = np.column_stack([(ids % (7 + i)).astype(float) for i in range(FEATURES)])
    wrong = int((np.abs(scores - (x @ w + 1.0)) > 1e-9).sum())
    print(f"sidecar kill-and-restart: {n:,} rows in {calls} calls of {args.batch_rows:,} rows, "
          f"Spark local[2], {elapsed:.1f} s")
    if killed:
        print(f"  sidecar (pid {killed['pid']}, 2 workers) SIGKILLed at {killed['at'] - t0:.1f} s "
              f"with {killed['answered']} calls answered, {killed['in_flight']} held by its "
              f"workers, {killed['queued']} queued; restarted in "
              f"{killed['restarted'] - killed['at']:.2f} s")
    else:
        print("  the sidecar was NOT killed (the job finished before a third of its calls "
              "were answered with one held)")
    print(f"  rows out {len(ids):,}; ids missing {missing}, answered more than once {twice}, "
          f"wrong scores {wrong}; redeliveries {redeliveries}; sidecar worker pids {pids}")
    ok = bool(killed) and len(ids) == n and missing == 0 and twice == 0 and wrong == 0
    print("  every row answered exactly once, correctly: " + ("YES" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
