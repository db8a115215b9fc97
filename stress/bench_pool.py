#!/usr/bin/env python3
"""Process pools: ``shmq.ProcessPoolExecutor`` and ``shmq.Pool`` against named peers, in one run.

Three measurements (interleaved repeats, the order of the contenders rotated
each repeat; medians and ratios printed at the end, each target met or not
with its figure):

* ``submit``: ``--submits`` (20,000) trivial ``submit()`` calls, then every
  result: tasks/s.  Peers: ``concurrent.futures.ProcessPoolExecutor``,
  loky's executor.  Target: shmq >= 10x the stdlib's.
* ``map``: ``Pool.map(f, range(--maps), chunksize=1)`` over 50,000 trivial
  tasks: tasks/s.  Peer: ``multiprocessing.Pool``; loky's executor
  ``map(chunksize=1)`` for scale.  Target: shmq >= 3x the stdlib's.
* ``numpy``: ``map`` over ``--arrays`` (32) numpy arrays of ``--mib`` (8)
  MiB each, ``a * 2`` each (so 8 MiB back too): seconds.  Peers:
  ``concurrent.futures.ProcessPoolExecutor.map``, loky's; ``shmq.Pool`` and
  ``multiprocessing.Pool`` for scale.  Target: shmq >= 2x the stdlib's
  executor.

Every pool has ``--workers`` (2) processes, started (and given one task)
before its clock starts; fork for shmq and the stdlib, loky's own start
method for loky (it does not fork).  A peer that cannot run here (loky not
installed) is named as such.  The load average is printed with the figures:
on a shared machine it moves them.

    python stress/bench_pool.py --quick
    python stress/bench_pool.py --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# This checkout's shmq when its core is built in place; otherwise the installed one
# (a source tree without a built core cannot be imported: .ci/aarch64 installs it).
if glob.glob(os.path.join(ROOT, "shmq", "_core*.so")):
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import shmq  # noqa: E402

FORK = mp.get_context("fork")
TARGETS = {"submit": ("shmq", "ProcessPoolExecutor", 10.0),
           "map": ("shmq", "multiprocessing.Pool", 3.0),
           "numpy": ("shmq", "ProcessPoolExecutor", 2.0)}


def noop(x):
    return x


def double(a):
    return a * 2


def _loky():
    try:
        import loky
    except ImportError:
        return None
    return loky


def executors(workers):
    """``{name: factory}`` of the executors measured (a factory makes a started pool)."""
    out = {"shmq": lambda: shmq.ProcessPoolExecutor(workers, mp_context="fork"),
           "ProcessPoolExecutor": lambda: cf.ProcessPoolExecutor(workers, mp_context=FORK)}
    loky = _loky()
    if loky is not None:
        out["loky"] = lambda: loky.ProcessPoolExecutor(workers)
    return out


def pools(workers):
    return {"shmq": lambda: shmq.Pool(workers, context="fork"),
            "multiprocessing.Pool": lambda: FORK.Pool(workers)}


def _started(pool):
    """A pool whose workers are up: one task through each face of it."""
    if hasattr(pool, "submit"):
        list(pool.map(noop, range(4)))
    else:
        pool.map(noop, range(4))
    return pool


def _close(pool):
    if hasattr(pool, "shutdown"):
        pool.shutdown(wait=True)
    else:
        pool.close()
        pool.join()


def run_submit(pool, n):
    t = time.perf_counter()
    fs = [pool.submit(noop, i) for i in range(n)]
    for f in fs:
        f.result()
    return n / (time.perf_counter() - t)


def run_map(pool, n):
    t = time.perf_counter()
    if hasattr(pool, "submit"):
        out = list(pool.map(noop, range(n), chunksize=1))
    else:
        out = pool.map(noop, range(n), chunksize=1)
    dt = time.perf_counter() - t
    assert len(out) == n and out[-1] == n - 1
    return n / dt


def run_numpy(pool, arrays):
    t = time.perf_counter()
    out = list(pool.map(double, arrays))
    dt = time.perf_counter() - t
    assert len(out) == len(arrays) and float(out[-1][-1]) == 2 * float(arrays[-1][-1])
    return dt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run (the test suite's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--submits", type=int, default=20_000)
    ap.add_argument("--maps", type=int, default=50_000)
    ap.add_argument("--arrays", type=int, default=32)
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--only", choices=list(TARGETS), action="append")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.quick:
        a.repeats, a.submits, a.maps, a.arrays, a.mib = 1, 2000, 5000, 4, 1
    only = a.only or list(TARGETS)
    arrays = [np.full((a.mib << 20) // 8, float(i)) for i in range(a.arrays)] if "numpy" in only else []
    load = [os.getloadavg()[0]]
    runs: dict[tuple[str, str], list[float]] = {}
    missing = {} if _loky() else {"loky": "not installed (pip install 'shmq[bench]')"}

    def measure(scen, name, factory, fn, *args):
        pool = _started(factory())
        try:
            v = fn(pool, *args)
        finally:
            _close(pool)
        runs.setdefault((scen, name), []).append(v)
        unit = "s" if scen == "numpy" else "tasks/s"
        print(f"  [{r}] {scen:6s} {name:22s} {v:12,.3f} {unit}" if unit == "s" else
              f"  [{r}] {scen:6s} {name:22s} {v:12,.0f} {unit}", flush=True)

    for r in range(a.repeats):
        for scen in only:
            if scen == "submit":
                cands = [(n, f, run_submit, a.submits) for n, f in executors(a.workers).items()]
            elif scen == "map":
                cands = [(n, f, run_map, a.maps) for n, f in pools(a.workers).items()]
                if "loky" in executors(a.workers):
                    cands.append(("loky (executor map)", executors(a.workers)["loky"], run_map, a.maps))
            else:
                cands = [(n, f, run_numpy, arrays) for n, f in executors(a.workers).items()]
                cands += [(f"{n} (Pool.map)", f, run_numpy, arrays) for n, f in pools(a.workers).items()]
            k = r % len(cands)  # rotate who goes first
            for name, factory, fn, arg in cands[k:] + cands[:k]:
                measure(scen, name, factory, fn, arg)
    load.append(os.getloadavg()[0])
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"\nmedians of {a.repeats} interleaved run(s), {a.workers} workers each; machine: "
          f"{platform.processor() or platform.machine()} x{os.cpu_count()}, Python "
          f"{platform.python_version()}, load average {load[0]:.1f} at the start, {load[1]:.1f} at the end")
    for name, why in missing.items():
        print(f"  {name}: {why}")
    targets, lines = [], []
    for scen in only:
        ours, peer, goal = TARGETS[scen]
        row = {n: v for (s, n), v in med.items() if s == scen}
        if scen == "numpy":  # seconds: less is better
            ratio = row[peer] / row[ours]
            desc = (f"map over {a.arrays} numpy arrays of {a.mib} MiB: shmq {row[ours]:.3f} s, "
                    f"{peer} {row[peer]:.3f} s")
            others = ", ".join(f"{n} {v:.3f} s" for n, v in row.items() if n not in (ours, peer))
        else:
            ratio = row[ours] / row[peer]
            what = (f"{a.submits:,} trivial submit()" if scen == "submit"
                    else f"Pool.map(chunksize=1) over {a.maps:,} trivial tasks")
            desc = f"{what}: shmq {row[ours]:,.0f} tasks/s, {peer} {row[peer]:,.0f} tasks/s"
            others = ", ".join(f"{n} {v:,.0f} tasks/s" for n, v in row.items() if n not in (ours, peer))
        met = ratio >= goal
        targets.append({"scenario": scen, "peer": peer, "ratio": ratio, "goal": goal, "met": met})
        verdict = ("sizes below the target's: no verdict" if a.quick
                   else ('met' if met else 'NOT met'))
        lines.append(f"{desc}: {ratio:.2f}x (target >= {goal:g}x: {verdict})"
                     + (f"; {others}" if others else ""))
    print("\n".join(lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"medians": {"/".join(k): v for k, v in med.items()},
                       "runs": {"/".join(k): v for k, v in runs.items()}, "targets": targets,
                       "missing": missing, "load": load, "summary": lines, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
