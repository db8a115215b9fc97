"""Figures for an installed wheel, against named peers, in one run (docs/install.md).

Usage: ``python .ci/wheelbench.py WHEELDIR PYTHON VENVDIR [--source-python PY] [--rounds N]``
(``.ci/wheels`` runs it last, with ``--source-python`` when the worktree has a
``.venv`` built from source).  Makes a fresh venv at VENVDIR with PYTHON and
installs the x86_64 wheel of WHEELDIR for that CPython (binary dependencies
only), then, every row interleaved round by round so that the drift of a shared
machine hits each alike:

1. import time in fresh interpreters: ``pass`` (the interpreter's own start,
   the floor of every row), ``import multiprocessing`` (the standard
   library's peer) and ``import shmq`` (which imports multiprocessing,
   asyncio and inotify_simple; not numpy, posix_ipc or psutil): median wall
   time, and the median ``-X importtime`` cumulative figure of the top-level
   module;
2. with ``--source-python``: the hot path of the wheel's core (built by zig's
   clang against glibc 2.17) against a core built from source by the host's
   compiler (``pip install -e .``): one process puts 200,000 100-byte frames
   with ``Spool.put`` and reads them back with a named reader's ``get``; the
   median frames/s of each and the ratio.

The cwd is an empty directory, so ``shmq`` comes from the venv (or the
source-python's install), never from a stray source tree.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

IMPORT_ROWS = [("pass", "pass", None), ("import multiprocessing", "import multiprocessing", "multiprocessing"),
               ("import shmq", "import shmq", "shmq")]

HOT_PATH = r"""
import os, shutil, sys, tempfile, time
import shmq
n, payload = 200_000, b"x" * 100
d = tempfile.mkdtemp(prefix="shmq-wheelbench-", dir="/dev/shm")
try:
    sp = shmq.Spool.create(os.path.join(d, "b"), capacity="64MiB", on_full="block")
    r = sp.reader("b")
    put, get = sp.put, r.get
    t = time.perf_counter()
    for _ in range(n):
        put(payload)
    t_put = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(n):
        get(timeout=1)
    t_get = time.perf_counter() - t
    r.close(); sp.close(); shmq.Spool.destroy(os.path.join(d, "b"))
finally:
    shutil.rmtree(d, ignore_errors=True)
print(n / t_put, n / t_get, shmq._core.__file__)
"""


def cumulative_us(python: str, code: str, module: str, cwd: str) -> int:
    """The ``-X importtime`` cumulative microseconds of the top-level ``module``."""
    err = subprocess.run([python, "-X", "importtime", "-c", code], cwd=cwd, check=True,
                         capture_output=True, text=True).stderr
    for line in err.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 3 and parts[2] == module:  # the top-level line, no indent
            return int(parts[1])
    raise SystemExit(f"no -X importtime line for {module!r}")


def install(wheeldir: str, python: str, venv: str) -> tuple[str, str]:
    tag = subprocess.run([python, "-c", "import sys; print('cp%d%d' % sys.version_info[:2])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    wheels = glob.glob(os.path.join(wheeldir, f"shmq-*-{tag}-{tag}-*x86_64*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"expected one {tag} x86_64 wheel in {wheeldir}, found {wheels}")
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([python, "-m", "venv", venv], check=True)
    vpy = os.path.join(venv, "bin", "python")
    subprocess.run([vpy, "-m", "pip", "install", "-q", "--only-binary=:all:", wheels[0]], check=True)
    return vpy, os.path.basename(wheels[0])


def import_times(vpy: str, wheel: str, rounds: int, cwd: str) -> None:
    wall = {name: [] for name, _, _ in IMPORT_ROWS}
    cum = {name: [] for name, _, mod in IMPORT_ROWS if mod}
    for _ in range(rounds):
        for name, code, mod in IMPORT_ROWS:
            t = time.perf_counter()
            subprocess.run([vpy, "-c", code], cwd=cwd, check=True)
            wall[name].append(time.perf_counter() - t)
            if mod:
                cum[name].append(cumulative_us(vpy, code, mod, cwd))
    version = subprocess.run([vpy, "-c", "import sys; print(sys.version.split()[0])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    print(f"import time, {wheel} on CPython {version}, median of {rounds} interleaved rounds "
          "of fresh interpreters:")
    for name, _, mod in IMPORT_ROWS:
        extra = f", -X importtime cumulative {statistics.median(cum[name]) / 1000:.1f} ms" if mod else ""
        print(f"  {name:24s} wall {statistics.median(wall[name]) * 1000:6.1f} ms{extra}")
    floor = statistics.median(wall["pass"])
    ours = statistics.median(wall["import shmq"]) - floor
    peer = statistics.median(wall["import multiprocessing"]) - floor
    print(f"  over the interpreter's start: shmq {ours * 1000:.1f} ms, multiprocessing "
          f"{peer * 1000:.1f} ms (shmq {ours / peer:.1f}x); -X importtime: shmq "
          f"{statistics.median(cum['import shmq']) / statistics.median(cum['import multiprocessing']):.1f}x")


def hot_path(vpy: str, source_py: str, rounds: int, cwd: str) -> None:
    rows = {"wheel (zig clang, glibc 2.17)": vpy, "source build (host compiler)": source_py}
    puts = {k: [] for k in rows}
    gets = {k: [] for k in rows}
    where = {}
    for _ in range(rounds):
        for name, py in rows.items():
            out = subprocess.run([py, "-c", HOT_PATH], cwd=cwd, check=True, capture_output=True,
                                 text=True).stdout.split()
            puts[name].append(float(out[0]))
            gets[name].append(float(out[1]))
            where[name] = out[2]
    print(f"hot path, one process, 200,000 100-byte frames, median of {rounds} interleaved rounds:")
    for name in rows:
        print(f"  {name:30s} put {statistics.median(puts[name]) / 1e6:.2f} M/s, get "
              f"{statistics.median(gets[name]) / 1e6:.2f} M/s  ({where[name]})")
    w, s = list(rows)
    print(f"  wheel / source: put {statistics.median(puts[w]) / statistics.median(puts[s]):.2f}x, "
          f"get {statistics.median(gets[w]) / statistics.median(gets[s]):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("wheeldir")
    ap.add_argument("python")
    ap.add_argument("venv")
    ap.add_argument("--source-python", help="a python whose shmq was built from source")
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()
    vpy, wheel = install(args.wheeldir, args.python, args.venv)
    with tempfile.TemporaryDirectory() as cwd:
        import_times(vpy, wheel, args.rounds, cwd)
        if args.source_python:
            hot_path(vpy, args.source_python, max(5, args.rounds // 4), cwd)


if __name__ == "__main__":
    main()
