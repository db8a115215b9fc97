#!/usr/bin/env python3
"""How long ``import shmq`` takes in a fresh interpreter, against ``import multiprocessing``.

Every process that uses shmq pays for the import once, and a pool spawns many
processes.  Each measurement is a fresh interpreter timing one ``import``
statement (``time.perf_counter`` around it: interpreter start-up is the same
for both and not counted); the contenders alternate, and the medians and their
ratio are printed.  Bytecode is compiled once, in a private cache directory
(``PYTHONPYCACHEPREFIX``), before anything is timed, for both alike: installed
packages ship or write their ``.pyc`` files, so compiling the sources on every
start (as with ``PYTHONDONTWRITEBYTECODE=1``) would measure the compiler.

    python stress/import_time.py                 # 10 interpreters each, the ratio
    python stress/import_time.py --runs 30 --json out.json
    python stress/import_time.py --tree          # -X importtime of `import shmq`, slowest first

Also checked in each shmq interpreter: which of the modules shmq loads only on
first use (asyncio, numpy, psutil, multiprocessing, logging, ...) the import
loaded anyway; a non-empty list is printed and counted as a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

#: Modules ``import shmq`` must not load (each loads on first use, where needed).
LAZY = ("asyncio", "numpy", "psutil", "multiprocessing", "inotify_simple", "logging", "dataclasses",
        "shmq.workqueue", "shmq.stats", "shmq.dispatch", "shmq.rpc", "shmq.spark", "shmq.columnar", "shmq.cli")

#: What each contender's interpreter runs: the import timed, then a report on stdout.
PROBE = """\
import sys, time
before = set(sys.modules)  # what the interpreter's start loaded (a site .pth may import psutil)
t0 = time.perf_counter()
import {module}
t1 = time.perf_counter()
lazy = {lazy!r}
print(repr((t1 - t0, [m for m in lazy if m in sys.modules and m not in before])))
"""

CONTENDERS = {
    "multiprocessing": "multiprocessing",
    "shmq": "shmq",
}


def child_env(cache: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = cache
    return env


def one(module: str, env: dict[str, str]) -> tuple[float, list[str]]:
    """(seconds, lazy modules loaded) of one fresh interpreter importing ``module``."""
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module, lazy=LAZY)], env=env,
                         capture_output=True, text=True, check=True, timeout=120).stdout
    seconds, loaded = eval(out.strip().splitlines()[-1], {})  # our own probe's repr
    return seconds, loaded


def measure(runs: int, names: list[str]) -> dict[str, dict]:
    with tempfile.TemporaryDirectory(prefix="shmq-import-") as cache:
        env = child_env(cache)
        for name in names:  # compile every module into the cache, untimed
            one(CONTENDERS[name], env)
        times: dict[str, list[float]] = {n: [] for n in names}
        loaded: dict[str, set[str]] = {n: set() for n in names}
        for k in range(runs):
            for name in names if k % 2 == 0 else reversed(names):  # interleaved, order flipped
                t, lazy = one(CONTENDERS[name], env)
                times[name].append(t)
                loaded[name].update(lazy)
    return {n: {"median_ms": statistics.median(ts) * 1e3, "runs_ms": [t * 1e3 for t in ts],
                "lazy_loaded": sorted(loaded[n])} for n, ts in times.items()}


def tree(limit: int = 25) -> None:
    with tempfile.TemporaryDirectory(prefix="shmq-import-") as cache:
        env = child_env(cache)
        cmd = [sys.executable, "-X", "importtime", "-c", "import shmq"]
        subprocess.run(cmd, env=env, capture_output=True, check=True)
        err = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stderr
    rows = []
    for line in err.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[0].strip().isdigit():
            rows.append((int(parts[0]), int(parts[1]), parts[2].rstrip()))
    print("self us  cumulative us  module (-X importtime of `import shmq`, slowest self first)")
    for s, c, name in sorted(rows, reverse=True)[:limit]:
        print(f"{s:7d}  {c:13d}  {name}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="fresh interpreters per contender (default 10)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--tree", action="store_true", help="print -X importtime of `import shmq` instead")
    args = ap.parse_args(argv)
    if args.tree:
        tree()
        return 0
    res = report(measure(args.runs, list(CONTENDERS)), args.runs, sys.stdout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["met"] and not res["contenders"]["shmq"]["lazy_loaded"] else 1


def report(res: dict[str, dict], runs: int, out) -> dict:
    """Print the medians and the ratio; return ``{"contenders": res, "ratio", "met", "runs", "load"}``."""
    base = res["multiprocessing"]["median_ms"]
    load = os.getloadavg()[0]
    print(f"import time in a fresh interpreter, median of {runs} each (load average {load:.2f})", file=out)
    for name, r in res.items():
        print(f"  {name:<16} {r['median_ms']:7.2f} ms  {r['median_ms'] / base:5.2f}x multiprocessing"
              + (f"  loaded: {', '.join(r['lazy_loaded'])}" if r["lazy_loaded"] and name == "shmq" else ""),
              file=out)
    ratio = res["shmq"]["median_ms"] / base
    return {"contenders": res, "ratio": ratio, "met": ratio <= 2.0, "runs": runs, "load": load}


if __name__ == "__main__":
    sys.exit(main())
