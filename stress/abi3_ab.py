"""Interleaved A/B of the compiled core: full C API against the stable ABI (issue 27).

Builds shmq twice from this checkout with the running interpreter (CPython >= 3.12,
with shmq's dependencies installed, e.g. a checkout's ``.venv``): once as the
released wheels are built (``_core.cpython-3XX-*.so``) and once with
``SHMQ_LIMITED_API=1`` (``-DPy_LIMITED_API=0x030c0000``, ``_core.abi3.so``; see
``setup.py`` and ``shmq/core/abi.h``).  Then it alternates the two builds run
after run (the order flips every repetition) over bench.py's rows

    1->1 100 B                 spool
    1->1 100 B wrapped 1 MiB   spool-wrapped
    1->1 small dict            shmq.Queue
    1->1 small dict batch 100  shmq.Queue-batch

each run a fresh process tree of bench.py's own ``measure`` (producer and consumer
processes), and prints every run's figure, the medians, the ratio of medians
(abi3 / full), and the median of the per-repetition ratios (the two builds of one
repetition ran back to back, so a slow phase of a shared machine hits both).

A second, single-process table times the calls themselves (ns per ``Spool.put``,
``Reader.get``, ``Queue.put``, ``Queue.get`` of 100 B / a small dict; the best of 5
loops of CPU time), also interleaved: less exposed to scheduling noise than the
two-process rows, and not a bench row.

A third table counts the instructions each of those calls executes inside the core's
C entry point (inclusive of what it calls: libpython's API functions too), with
valgrind's callgrind (skipped without valgrind): independent of the machine's load,
so it shows the limited API's cost where the timings cannot.

Decision rule (docs/install.md, "Stable ABI (abi3)"): keep the abi3 build only if
the bench rows stay within noise.  A row is printed "within noise" when the
abi3 median lies inside the range of the full build's runs and vice versa.

    .venv/bin/python stress/abi3_ab.py               # 7 repetitions, quick scale
    .venv/bin/python stress/abi3_ab.py --runs 9 --mode full

Needs a C compiler and the interpreter's headers (pip builds both variants; with
build isolation it fetches setuptools).  Builds and results go to ``--out``
(default: a new directory under /tmp); results.json holds every figure.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BUILDS = ("full", "abi3")
ROWS = [("1->1 100 B", "spool"), ("1->1 100 B wrapped 1 MiB", "spool-wrapped"),
        ("1->1 small dict", "shmq.Queue"), ("1->1 small dict batch 100", "shmq.Queue-batch")]
MICRO = ("put", "get", "qput", "qget")


def build(variant: str, out: str) -> str:
    """Install shmq built as ``variant`` into out/variant (pip --target); returns that directory."""
    src, target = os.path.join(out, "src-" + variant), os.path.join(out, variant)
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(src)
    # A fresh copy of the checkout per variant: no object file or .so of the other build.
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
    tar = os.path.join(out, "src.tar")
    with tarfile.open(tar, "w") as t:
        for f in files:
            if f and os.path.exists(os.path.join(ROOT, f.decode())):
                t.add(os.path.join(ROOT, f.decode()), arcname=f.decode())
    with tarfile.open(tar) as t:
        t.extractall(src, filter="data")
    env = {k: v for k, v in os.environ.items() if k != "SHMQ_LIMITED_API"}
    if variant == "abi3":
        env["SHMQ_LIMITED_API"] = "1"
    log = os.path.join(out, f"build-{variant}.log")
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", target, src],
                           env=env, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        sys.exit(f"building the {variant} variant failed; see {log}")
    sos = sorted(os.path.basename(p) for p in glob.glob(os.path.join(target, "shmq", "_core*.so")))
    want_abi3 = variant == "abi3"
    if len(sos) != 1 or sos[0].endswith(".abi3.so") != want_abi3:
        sys.exit(f"the {variant} build holds {sos}, not one {'abi3' if want_abi3 else 'version-specific'} core")
    return target


def child(target: str, args: list[str]) -> dict:
    """Run this file's --one/--micro mode for the build in target; its JSON line."""
    env = dict(os.environ, PYTHONPATH=target)
    env.pop("SHMQ_LIMITED_API", None)
    r = subprocess.run([sys.executable, __file__, *args], env=env, cwd=target, capture_output=True,
                       text=True, timeout=900)
    if r.returncode:
        raise RuntimeError(f"{args} failed:\n{r.stderr[-1500:]}")
    d = json.loads(r.stdout.strip().splitlines()[-1])
    if not d["core"].startswith(target):
        raise RuntimeError(f"the run imported {d['core']}, not the build in {target}")
    return d


def one(row: str, cname: str, mode: str) -> None:
    """One measured run of one contender of one bench.py row (bench.measure, as bench.py scales it)."""
    sys.path.insert(0, HERE)
    import bench
    import shmq._core
    sc = bench.SCENARIOS[row]
    (c,) = [x for x in sc.contenders if x.name == cname]
    div, floor = bench.SCALE[mode]
    per_batch = sc.producers * sc.consumers * sc.batch
    n = max(sc.items // div, floor * per_batch)
    n -= n % (per_batch * 8)
    sc.timeout_s = bench.TIMEOUT_S[mode]
    tmp = tempfile.mkdtemp(dir="/dev/shm", prefix="shmq-abi3ab-")
    try:
        dt, _peak = bench.measure(c, sc, n, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    moved = n * (sc.consumers if sc.fanout else 1)
    print(json.dumps({"items_per_s": moved / dt, "n": n, "core": shmq._core.__file__}))


def micro(n: int = 40_000, loops: int = 5) -> None:
    """ns per call of the four hot entry points, single process: the best of ``loops`` CPU times."""
    import shmq
    import shmq._core
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="shmq-abi3ab-")
    path = os.path.join(d, "s")
    sp = shmq.Spool.create(path, capacity="64MiB", on_full="block", checksum=False)
    r = sp.reader("r0")
    q = shmq.Queue()
    x, obj = b"x" * 100, {"id": 1, "name": "item", "values": [1, 2, 3]}
    put, get, qput, qget = sp.put, r.get, q.put, q.get

    def timed(fn, arg=None) -> float:
        t = time.process_time()
        if arg is None:
            for _ in range(n):
                fn()
        else:
            for _ in range(n):
                fn(arg)
        return time.process_time() - t

    best = dict.fromkeys(MICRO, float("inf"))
    try:
        for _ in range(loops):  # put then get, so the ring never fills
            best["put"] = min(best["put"], timed(put, x))
            best["get"] = min(best["get"], timed(get))
            best["qput"] = min(best["qput"], timed(qput, obj))
            best["qget"] = min(best["qget"], timed(qget))
    finally:
        q.close()
        r.close()
        sp.close()
        shmq.Spool.destroy(path)
        os.rmdir(d)
    print(json.dumps({**{k: v / n * 1e9 for k, v in best.items()}, "core": shmq._core.__file__}))


IR_FUNCS = {"Ring_put_api": "Spool.put 100 B", "Cursor_get_api": "Reader.get 100 B",
            "QueuePort_put": "Queue.put dict", "QueuePort_get": "Queue.get dict",
            "queue_encode_batch": "Queue.put_many 100: encode", "Ring_put_many": "Queue.put_many 100: write",
            "Cursor_get_obj_many": "Queue.get_many 100"}
#: Earlier names of IR_FUNCS entry points (stress/engine_ab.py counts a base revision too).
IR_ALIASES = {"core_encode_batch": "queue_encode_batch"}
IR_CALLS = 2000  # calls of each single entry point; IR_CALLS // 100 batches of 100


def ir_loops() -> None:
    """The calls IR_FUNCS names, IR_CALLS times each (batches: IR_CALLS // 100), for callgrind."""
    import shmq
    import shmq._core
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="shmq-abi3ab-")
    path = os.path.join(d, "s")
    sp = shmq.Spool.create(path, capacity="64MiB", on_full="block", checksum=False)
    r = sp.reader("r0")
    q = shmq.Queue()
    x, obj = b"x" * 100, {"id": 1, "name": "item", "values": [1, 2, 3]}
    batch = [obj] * 100
    try:
        for _ in range(IR_CALLS):
            sp.put(x)
        for _ in range(IR_CALLS):
            r.get()
        for _ in range(IR_CALLS):
            q.put(obj)
        for _ in range(IR_CALLS):
            q.get()
        for _ in range(IR_CALLS // 100):
            q.put_many(batch)
        for _ in range(IR_CALLS // 100):
            assert len(q.get_many(100)) == 100
    finally:
        q.close()
        r.close()
        sp.close()
        shmq.Spool.destroy(path)
        os.rmdir(d)
    print(json.dumps({"core": shmq._core.__file__}))


def instructions(target: str, out: str, variant: str) -> dict[str, float]:
    """Instructions per call inside each IR_FUNCS entry point (inclusive of what it calls), counted by
    valgrind's callgrind with collection on only inside those functions: the same figure every run."""
    cg = os.path.join(out, f"callgrind-{variant}.out")
    env = dict(os.environ, PYTHONPATH=target, PYTHONHASHSEED="0")
    env.pop("SHMQ_LIMITED_API", None)
    cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--callgrind-out-file={cg}",
           *(f"--toggle-collect={f}" for f in [*IR_FUNCS, *IR_ALIASES]), sys.executable, __file__, "--ir"]
    r = subprocess.run(cmd, env=env, cwd=target, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise RuntimeError(f"callgrind failed:\n{r.stderr[-1500:]}")
    if not json.loads(r.stdout.strip().splitlines()[-1])["core"].startswith(target):
        raise RuntimeError(f"the callgrind run did not import the build in {target}")
    ann = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", cg],
                         capture_output=True, text=True, check=True).stdout
    per_call = {}
    for line in ann.splitlines():  # "  1,808,076 ( 2.76%)  .../api.c:Ring_put_api [.../_core...so]"
        m = re.match(r"\s*([\d,]+) .*?:(\w+) \[", line)
        if not m:
            continue
        name = IR_ALIASES.get(m.group(2), m.group(2))
        if name in IR_FUNCS and name not in per_call:
            calls = IR_CALLS if name in ("Ring_put_api", "Cursor_get_api", "QueuePort_put", "QueuePort_get") \
                else IR_CALLS // 100
            per_call[name] = int(m.group(1).replace(",", "")) / calls
    missing = set(IR_FUNCS) - set(per_call)
    if missing:
        raise RuntimeError(f"callgrind_annotate shows no {sorted(missing)}; see {cg}")
    return per_call


def print_micro(mic: dict, a: str, b: str) -> None:
    """The single-process table: ns per call of build ``b`` against build ``a``, every run."""
    print(f"\n{'single process':26s} {'':17s} {a + ' ns':>9s} {b + ' ns':>9s} {b + '/' + a:>9s} {'pair med':>8s}"
          f"  runs {a} | {b}")
    names = {"put": "Spool.put 100 B", "get": "Reader.get 100 B", "qput": "Queue.put dict", "qget": "Queue.get dict"}
    for k in MICRO:
        f, s = mic[k][a], mic[k][b]
        mf, ms = statistics.median(f), statistics.median(s)
        pair = statistics.median(y / x for x, y in zip(f, s))
        print(f"{names[k]:26s} {'':17s} {mf:9.0f} {ms:9.0f} {ms / mf:9.3f} {pair:8.3f}  "
              + " ".join(f"{x:.0f}" for x in f) + " | " + " ".join(f"{x:.0f}" for x in s))


def spread(xs: list[float]) -> str:
    return f"{min(xs):.3f}..{max(xs):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7, help="repetitions per build and row (default 7)")
    ap.add_argument("--mode", default="quick", choices=("quick", "full", "smoke"), help="bench.py's scale")
    ap.add_argument("--out", help="directory for the builds and results.json (default: a new one in /tmp)")
    ap.add_argument("--no-micro", action="store_true", help="skip the single-process table")
    ap.add_argument("--no-callgrind", action="store_true", help="skip the instruction counts (valgrind)")
    a = ap.parse_args()
    if sys.version_info < (3, 12):
        sys.exit("the limited-API core needs CPython >= 3.12 (shmq/core/abi.h)")
    out = a.out or tempfile.mkdtemp(prefix="shmq-abi3ab-")
    os.makedirs(out, exist_ok=True)
    print(f"# {sys.executable} {sys.version.split()[0]}; {os.cpu_count()} CPUs; load {os.getloadavg()}; "
          f"mode {a.mode}, {a.runs} runs per build; builds in {out}", flush=True)
    targets = {b: build(b, out) for b in BUILDS}
    for b in BUILDS:
        print(f"# {b}: {glob.glob(os.path.join(targets[b], 'shmq', '_core*.so'))[0]}", flush=True)
    res: dict = {f"{r}|{c}": {b: [] for b in BUILDS} for r, c in ROWS}
    mic: dict = {k: {b: [] for b in BUILDS} for k in MICRO}
    for i in range(a.runs):
        order = BUILDS if i % 2 == 0 else BUILDS[::-1]
        for r, c in ROWS:
            for b in order:
                d = child(targets[b], ["--one", r, c, a.mode])
                res[f"{r}|{c}"][b].append(d["items_per_s"] / 1e6)
                print(f"run {i} {b:4s} {r:26s} {c:17s} {d['items_per_s'] / 1e6:7.3f} M/s", flush=True)
        if not a.no_micro:
            for b in order:
                d = child(targets[b], ["--micro"])
                for k in MICRO:
                    mic[k][b].append(d[k])
                print(f"run {i} {b:4s} micro ns/call " + " ".join(f"{k} {d[k]:.0f}" for k in MICRO), flush=True)
    print(f"\n{'row':26s} {'contender':17s} {'full M/s':>9s} {'abi3 M/s':>9s} {'abi3/full':>9s} "
          f"{'pair med':>8s}  verdict          runs full | abi3")
    for r, c in ROWS:
        f, s = res[f"{r}|{c}"]["full"], res[f"{r}|{c}"]["abi3"]
        mf, ms = statistics.median(f), statistics.median(s)
        pair = statistics.median(y / x for x, y in zip(f, s))
        inside = min(f) <= ms <= max(f) and min(s) <= mf <= max(s)
        print(f"{r:26s} {c:17s} {mf:9.3f} {ms:9.3f} {ms / mf:9.3f} {pair:8.3f}  "
              f"{'within noise' if inside else 'OUTSIDE noise':15s}  "
              + " ".join(f"{x:.2f}" for x in f) + " | " + " ".join(f"{x:.2f}" for x in s))
        print(f"{'':26s} {'':17s} spread full {spread(f)}, abi3 {spread(s)}")
    if not a.no_micro:
        print_micro(mic, "full", "abi3")
    irs: dict = {}
    if not a.no_callgrind:
        if not (shutil.which("valgrind") and shutil.which("callgrind_annotate")):
            print("\n# no valgrind: instruction counts skipped (apt-get install valgrind)")
        else:
            irs = {b: instructions(targets[b], out, b) for b in BUILDS}
            print(f"\n{'instructions per call (callgrind)':34s} {'C function':20s} {'full':>10s} {'abi3':>10s} "
                  f"{'abi3/full':>9s}")
            for fn, label in IR_FUNCS.items():
                f, s = irs["full"][fn], irs["abi3"][fn]
                print(f"{label:34s} {fn:20s} {f:10.0f} {s:10.0f} {s / f:9.3f}")
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump({"python": sys.version, "mode": a.mode, "runs": a.runs, "rows": res, "micro": mic,
                   "instructions_per_call": irs}, fh, indent=1)
    print(f"\n# every figure: {os.path.join(out, 'results.json')}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        one(*sys.argv[2:5])
    elif sys.argv[1:2] == ["--micro"]:
        micro()
    elif sys.argv[1:2] == ["--ir"]:
        ir_loops()
    else:
        main()
