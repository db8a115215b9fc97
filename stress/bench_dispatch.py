#!/usr/bin/env python3
"""Messages/s through ``shmq.Dispatcher`` with handlers that do nothing.

Two ways in, measured in the same run (interleaved repeats, median reported):

* ``publish``: ``Dispatcher.publish(type, body)``: the message goes straight
  into the type's work queue ``PATH.<type>``; the worker that runs the
  handler holds the only lease (one pickle, one spool, one lease);
* ``ingress``: a plain ``WorkQueue.put(body, headers={"type": ...})`` on the
  ingress queue ``PATH`` (what a producer that does not hold the Dispatcher
  does): the router thread moves it to ``PATH.<type>`` (two pickles, two
  spools, two leases).

Before the direct path existed, ``publish`` went through the router too, so
``publish / ingress`` is the gain of removing the hop.  One run: a fresh
dispatcher, ``--workers`` workers of one no-op type; the clock runs from the
first put until the board counts every message processed (polled every
2 ms).  Besides messages/s it reports the CPU time every process of the
dispatcher (producer + supervisor + router, and the workers) spent per
message, which a busy shared machine disturbs far less than wall time.
Numbers depend on the machine (2 vCPUs here): compare ratios.

    python stress/bench_dispatch.py --quick            # ~20 s
    python stress/bench_dispatch.py --messages 20000 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):
    # handlers travel to worker processes by module name: import this file as a module
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shmq


def noop(ctx, body):
    """The handler: does nothing."""


def _cpu(pids):
    """CPU seconds (user + system) used so far by this process and ``pids``."""
    import psutil

    total = time.process_time()
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def one_run(mode, n, workers, start_method):
    """Return ``(messages/s, CPU microseconds per message over every process)``."""
    import bench_dispatch as me
    from shmq.dispatch import Dispatcher

    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="shmq-bench-dispatch-") as tmp:
        path = os.path.join(tmp, "jobs")
        d = Dispatcher(path, start_method=start_method, capacity="16MiB", dead_capacity="1MiB",
                       grace=5.0)
        d.register("noop", me.noop, parallelism=workers)
        try:
            d.start()
            raw = shmq.WorkQueue.open(path, capacity=4096, dead_capacity=4096, leases=1, keys=1)
            try:
                pids = [p for ps in d.workers().values() for p in ps]
                c0 = _cpu(pids)
                t0 = time.perf_counter()
                for i in range(n):
                    if mode == "publish":
                        d.publish("noop", i)
                    else:
                        raw.put(i, headers={"type": "noop"})
                deadline = time.monotonic() + 120
                while d.metrics(queues=False)["noop"]["processed"] < n:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{mode}: not all {n} messages processed in 120 s")
                    time.sleep(0.002)
                dt = time.perf_counter() - t0
                cpu = _cpu(pids) - c0
            finally:
                raw.close()
        finally:
            d.close()
            Dispatcher.destroy(path, types=["noop"])
    return n / dt, cpu / n * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2000 messages, 3 repeats")
    ap.add_argument("--messages", type=int, default=10000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--start-method", default="forkserver", choices=("forkserver", "spawn"))
    ap.add_argument("--modes", default="publish,ingress")
    ap.add_argument("--json", help="write the figures to this file")
    a = ap.parse_args(argv)
    if a.quick:
        a.messages, a.repeats = 2000, 3
    modes = a.modes.split(",")
    runs = {m: [] for m in modes}
    cpus = {m: [] for m in modes}
    for _ in range(a.repeats):
        for m in modes:  # interleaved: drift on a shared machine hits both alike
            rate, cpu = one_run(m, a.messages, a.workers, a.start_method)
            runs[m].append(rate)
            cpus[m].append(cpu)
    med = {m: statistics.median(v) for m, v in runs.items()}
    med_cpu = {m: statistics.median(v) for m, v in cpus.items()}
    print(f"# {platform.machine()} {os.cpu_count()} CPUs, python {platform.python_version()}, "
          f"load {os.getloadavg()[0]:.1f}, {a.messages} messages x {a.repeats} runs, "
          f"{a.workers} worker(s), {a.start_method}")
    for m in modes:
        print(f"{m:8s} median {med[m]:9.0f} msg/s  {med_cpu[m]:6.1f} CPU us/msg   runs: "
              + " ".join(f"{x:.0f}" for x in runs[m]))
    if "publish" in med and "ingress" in med:
        print(f"ratio publish/ingress: {med['publish'] / med['ingress']:.2f} msg/s, "
              f"{med_cpu['publish'] / med_cpu['ingress']:.2f} CPU per message")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"messages": a.messages, "repeats": a.repeats, "workers": a.workers,
                       "runs": runs, "median": med, "cpu_us_per_msg": cpus,
                       "median_cpu_us_per_msg": med_cpu}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
