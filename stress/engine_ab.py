"""Interleaved A/B of this checkout against a base revision: the speed of the engine split.

Builds shmq twice with the running interpreter (shmq's dependencies installed, e.g. a
checkout's ``.venv``), each with ``pip install --no-deps --target``: the base revision
(``--base``, default ``main``: ``git archive`` of it) and this checkout (its tracked
and untracked files, as they are).  Then it alternates the two builds run after run
(the order flips every repetition) over bench.py's rows

    1->1 100 B                 spool             (Spool.put / Reader.get)
    1->1 100 B batch 100       spool-batch       (put_many / get_many)
    1->1 100 B wrapped 1 MiB   spool-wrapped
    1->1 1 MiB                 spool
    1->1 small dict            shmq.Queue
    1->1 small dict batch 100  shmq.Queue-batch

each run a fresh process tree of bench.py's own ``measure``, and prints every run's
figure, the medians, the ratio of medians (head / base) and the median of the
per-repetition ratios (the two builds of one repetition ran back to back, so a slow
phase of a shared machine hits both), then the single-process table of
stress/abi3_ab.py (ns per Spool.put, Reader.get, Queue.put, Queue.get), and last, where
valgrind is installed, abi3_ab.py's callgrind count of instructions per call inside each
entry point, which the machine's load does not change.

    .venv/bin/python stress/engine_ab.py                    # 5 repetitions, quick scale
    .venv/bin/python stress/engine_ab.py --base 56384b5 --runs 9

Builds and results go to ``--out`` (default: a new directory under /tmp).
"""
from __future__ import annotations

import argparse
import glob
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import abi3_ab  # noqa: E402  (its --one / --micro modes run a row or the micro table in a build)

BUILDS = ("base", "head")
ROWS = [("1->1 100 B", "spool"), ("1->1 100 B batch 100", "spool-batch"),
        ("1->1 100 B wrapped 1 MiB", "spool-wrapped"), ("1->1 1 MiB", "spool"),
        ("1->1 small dict", "shmq.Queue"), ("1->1 small dict batch 100", "shmq.Queue-batch")]


def sources(which: str, rev: str, dst: str) -> None:
    """The sources of ``which`` (the base revision, or this checkout as it is) in ``dst``."""
    os.makedirs(dst)
    if which == "base":
        tar = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            t.extractall(dst, filter="data")
        return
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
    for f in files:
        src = os.path.join(ROOT, f.decode())
        if f and os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dst, f.decode())), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, f.decode()))


def build(which: str, rev: str, out: str) -> str:
    src, target = os.path.join(out, "src-" + which), os.path.join(out, which)
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    sources(which, rev, src)
    log = os.path.join(out, f"build-{which}.log")
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", target, src],
                           stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        sys.exit(f"building {which} failed; see {log}")
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="main", help="the base revision (default main)")
    ap.add_argument("--runs", type=int, default=5, help="repetitions per build and row (default 5)")
    ap.add_argument("--mode", default="quick", choices=("quick", "full", "smoke"), help="bench.py's scale")
    ap.add_argument("--out", help="directory for the builds and results.json (default: a new one in /tmp)")
    ap.add_argument("--no-micro", action="store_true", help="skip the single-process table")
    ap.add_argument("--micro-only", action="store_true", help="only the single-process table (no bench rows)")
    ap.add_argument("--reuse-base", action="store_true", help="reuse the base build already in --out")
    ap.add_argument("--no-callgrind", action="store_true", help="skip the instruction counts (valgrind)")
    ap.add_argument("--row", action="append", metavar="ROW|CONTENDER",
                    help="a bench.py row and contender instead of the default rows (repeatable); a peer "
                         "(e.g. '1->1 1 MiB reserve|iceoryx2') runs once per build, a same-phase reference")
    a = ap.parse_args()
    rows = [tuple(x.split("|", 1)) for x in a.row] if a.row else ROWS
    if any(len(x) != 2 for x in rows):
        ap.error("--row takes 'ROW|CONTENDER'")
    out = a.out or tempfile.mkdtemp(prefix="shmq-engineab-")
    os.makedirs(out, exist_ok=True)
    rev = subprocess.run(["git", "rev-parse", "--short", a.base], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()
    print(f"# {sys.executable} {sys.version.split()[0]}; {os.cpu_count()} CPUs; load {os.getloadavg()}; "
          f"mode {a.mode}, {a.runs} runs per build; base {a.base} ({rev}), head {head} + working tree; "
          f"builds in {out}", flush=True)
    targets = {b: os.path.join(out, b) if b == "base" and a.reuse_base and os.path.isdir(os.path.join(out, b))
               else build(b, a.base, out) for b in BUILDS}
    for b in BUILDS:
        print(f"# {b}: {glob.glob(os.path.join(targets[b], 'shmq', '_core*.so'))[0]}", flush=True)
    res: dict = {f"{r}|{c}": {b: [] for b in BUILDS} for r, c in rows}
    mic: dict = {k: {b: [] for b in BUILDS} for k in abi3_ab.MICRO}
    for i in range(a.runs):
        order = BUILDS if i % 2 == 0 else BUILDS[::-1]
        for r, c in [] if a.micro_only else rows:
            for b in order:
                d = abi3_ab.child(targets[b], ["--one", r, c, a.mode])
                res[f"{r}|{c}"][b].append(d["items_per_s"] / 1e6)
                print(f"run {i} {b:4s} {r:26s} {c:17s} {d['items_per_s'] / 1e6:7.3f} M/s", flush=True)
        if not a.no_micro:
            for b in order:
                d = abi3_ab.child(targets[b], ["--micro"])
                for k in abi3_ab.MICRO:
                    mic[k][b].append(d[k])
                print(f"run {i} {b:4s} micro ns/call " + " ".join(f"{k} {d[k]:.0f}" for k in abi3_ab.MICRO),
                      flush=True)
    print(f"\n# load {os.getloadavg()}")
    print(f"{'row':26s} {'contender':17s} {'base M/s':>9s} {'head M/s':>9s} {'head/base':>9s} {'pair med':>8s}"
          "  runs base | head")
    for r, c in [] if a.micro_only else rows:
        f, s = res[f"{r}|{c}"]["base"], res[f"{r}|{c}"]["head"]
        mf, ms = statistics.median(f), statistics.median(s)
        pair = statistics.median(y / x for x, y in zip(f, s))
        print(f"{r:26s} {c:17s} {mf:9.3f} {ms:9.3f} {ms / mf:9.3f} {pair:8.3f}  "
              + " ".join(f"{x:.2f}" for x in f) + " | " + " ".join(f"{x:.2f}" for x in s))
    if not a.no_micro:
        abi3_ab.print_micro(mic, "base", "head")
    ir: dict = {}
    if not a.no_callgrind and shutil.which("valgrind"):
        ir = {b: abi3_ab.instructions(targets[b], out, b) for b in BUILDS}
        print(f"\n{'instructions per call':44s} {'base':>9s} {'head':>9s} {'head/base':>9s}  (callgrind, "
              "inclusive, the same every run)")
        for f, label in abi3_ab.IR_FUNCS.items():
            x, y = ir["base"][f], ir["head"][f]
            print(f"{label:44s} {x:9.0f} {y:9.0f} {y / x:9.3f}")
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump({"python": sys.version, "base": a.base, "base_rev": rev, "head": head, "mode": a.mode,
                   "runs": a.runs, "rows": res, "micro": mic, "instructions": ir}, fh, indent=1)
    print(f"\n# every figure: {os.path.join(out, 'results.json')}")


if __name__ == "__main__":
    main()
