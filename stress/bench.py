#!/usr/bin/env python3
"""shmq benchmarks against named peers, measured in one run.

Every scenario runs each contender in fresh producer/consumer processes;
repeats are interleaved (contender A, B, C, A, B, C, ...) so drift of this
shared machine hits every contender alike.  Reported: the median of the
repeats, and ratios against each peer measured in the same run.

    python stress/bench.py --quick          # < 1 minute
    python stress/bench.py --out bench-out  # full run: table, JSON (and PNG if matplotlib)

Contenders (when applicable): ``spool`` (shmq.Spool put/get with a named
reader), ``spool-batch`` (put_many/get_many), ``mp.Queue``
(multiprocessing.Queue), ``ring`` (a minimal single-producer/single-consumer
ring written inline below: no locks, no stats, no serialization, a busy
polling reader: the pure-Python ceiling on this machine).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time

import shmq

CTX = mp.get_context("fork")


# --- the inline ring: the ceiling -------------------------------------------


def _ring_producer(path, n, size, start):
    import mmap

    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, 0)
    ctl = memoryview(mm)[:64].cast("Q")  # [0] head (bytes written), [1] tail (bytes read)
    cap = len(mm) - 4096
    data = b"x" * size
    rec = 8 + size
    head = 0
    start.wait()
    for _ in range(n):
        while head + rec - ctl[1] > cap:
            pass
        off = 4096 + head % cap
        if off + rec > len(mm):  # no wrap logic: records never straddle (cap % rec == 0)
            off = 4096
        mm[off:off + 8] = size.to_bytes(8, "little")
        mm[off + 8:off + rec] = data
        head += rec
        ctl[0] = head
    ctl.release()


def _ring_consume(path, n, size):
    import mmap

    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, 0)
    ctl = memoryview(mm)[:64].cast("Q")
    cap = len(mm) - 4096
    rec = 8 + size
    tail = 0
    for _ in range(n):
        while ctl[0] <= tail:
            pass
        off = 4096 + tail % cap
        length = int.from_bytes(mm[off:off + 8], "little")
        mm[off + 8:off + 8 + length]
        tail += rec
        ctl[1] = tail
    ctl.release()


def run_ring(n, size, tmp):
    path = os.path.join(tmp, "ring")
    rec = 8 + size
    with open(path, "wb") as f:
        f.truncate(4096 + rec * (4 * 1024 * 1024 // rec))
    start = CTX.Event()
    prod = CTX.Process(target=_ring_producer, args=(path, n, size, start))
    prod.start()
    t0 = time.perf_counter()
    start.set()
    _ring_consume(path, n, size)
    dt = time.perf_counter() - t0
    prod.join()
    os.unlink(path)
    return dt


# --- shmq.Spool ---------------------------------------------------------------


def _spool_producer(path, n, size, batch, start):
    sp = shmq.Spool.open(path)
    data = b"x" * size
    start.wait()
    if batch == 1:
        put = sp.put
        for _ in range(n):
            put(data)
    else:
        items = [data] * batch
        for _ in range(n // batch):
            sp.put_many(items)
    sp.close()


def run_spool(n, size, tmp, batch=1):
    path = os.path.join(tmp, "spool")
    sp = shmq.Spool.create(path, capacity="64MiB", on_full="block")
    r = sp.reader("bench")
    start = CTX.Event()
    prod = CTX.Process(target=_spool_producer, args=(path, n, size, batch, start))
    prod.start()
    t0 = time.perf_counter()
    start.set()
    got = 0
    if batch == 1:
        get = r.get
        for _ in range(n):
            get()
        got = n
    else:
        while got < n:
            got += len(r.get_many(batch))
    dt = time.perf_counter() - t0
    prod.join()
    sp.close()
    shmq.Spool.destroy(path)
    return dt


# --- multiprocessing.Queue ----------------------------------------------------


def _mpq_producer(q, n, size, start):
    data = b"x" * size
    start.wait()
    put = q.put
    for _ in range(n):
        put(data)
    q.close()
    q.join_thread()


def run_mpqueue(n, size, tmp):
    q = CTX.Queue()
    start = CTX.Event()
    prod = CTX.Process(target=_mpq_producer, args=(q, n, size, start))
    prod.start()
    t0 = time.perf_counter()
    start.set()
    get = q.get
    for _ in range(n):
        get()
    dt = time.perf_counter() - t0
    prod.join()
    return dt


# --- the harness ----------------------------------------------------------------

SCENARIOS = {
    # name: (frames per run in full mode, payload bytes, {contender: runner})
    "1->1 100 B single": (400_000, 100, {
        "spool": lambda n, s, t: run_spool(n, s, t),
        "mp.Queue": run_mpqueue,
        "ring": run_ring,
    }),
    "1->1 100 B batch 100": (2_000_000, 100, {
        "spool-batch": lambda n, s, t: run_spool(n, s, t, batch=100),
        "mp.Queue": run_mpqueue,
    }),
}


def machine():
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                     if line.startswith("model name")), platform.processor()),
        "shmq": shmq.__version__,
    }


def run(quick: bool, repeats: int, only: str | None, out=sys.stdout) -> dict:
    tmp = tempfile.mkdtemp(prefix="shmq-bench-", dir="/dev/shm")
    results = {}
    try:
        for name, (n, size, contenders) in SCENARIOS.items():
            if only and only not in name:
                continue
            if quick:
                n = max(n // 10, 1000)
            times = {c: [] for c in contenders}
            for _ in range(repeats):
                for c, fn in contenders.items():  # interleaved repeats
                    times[c].append(fn(n, size, tmp))
            row = {}
            for c, ts in times.items():
                med = statistics.median(ts)
                row[c] = {"frames_per_s": n / med, "gb_per_s": n * size / med / 1e9,
                          "median_s": med, "runs_s": ts, "frames": n}
            results[name] = row
            report_row(name, row, out)
    finally:
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)
    return results


def report_row(name, row, out):
    print(f"\n{name}", file=out)
    for c, r in row.items():
        ratios = "  ".join(f"{r['frames_per_s'] / o['frames_per_s']:6.2f}x {oc}"
                           for oc, o in row.items() if oc != c)
        print(f"  {c:<12} {r['frames_per_s'] / 1e6:8.3f} M frames/s  {r['gb_per_s']:7.3f} GB/s"
              f"   {ratios}", file=out, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small runs (CI): under a minute")
    ap.add_argument("--repeats", type=int, default=None, help="runs per contender (default 3 quick, 5 full)")
    ap.add_argument("--only", help="run scenarios whose name contains this")
    ap.add_argument("--out", help="directory for results.json")
    args = ap.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 5)
    info = machine()
    print(f"shmq {info['shmq']} on {info['cpu']} x{info['cpus']}, Python {info['python']}; "
          f"median of {repeats} interleaved runs", flush=True)
    results = run(args.quick, repeats, args.only)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"machine": info, "quick": args.quick, "repeats": repeats,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
