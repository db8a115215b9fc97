"""stress/bench.py's measurements beyond throughput: wake-up latency of a blocked
reader (against a pipe and multiprocessing.Queue), syscalls on the uncontended
fast path (strace -c), CPU of an idle blocked reader, reader memory, the
per-frame overhead, and ``import shmq`` against ``import multiprocessing``
(stress/import_time.py).  Public shmq API only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil

import shmq
from bench_contenders import CTX

# Sizes per mode: (latency samples, put+get pairs under strace, idle seconds)
EXTRAS = {"full": (3000, 20000, 2.0), "quick": (300, 20000, 2.0), "smoke": (40, 2000, 0.5)}


# --- wake-up latency ------------------------------------------------------------------

def _latency_sender(kind, chan, count, gap_s, ready):
    ready.wait()
    if kind == "spool":
        sp = shmq.Spool.open(chan)
        send = sp.put
    elif kind == "pipe":
        send = chan.send_bytes
    else:
        send = chan.put
    for _ in range(count):
        time.sleep(gap_s)  # the receiver is parked when the frame arrives
        send(time.perf_counter_ns().to_bytes(8, "little"))


def latency(kind, count, tmp):
    gap = 0.002
    ready = CTX.Event()
    if kind == "spool":
        path = os.path.join(tmp, "lat")
        sp = shmq.Spool.create(path, capacity="1MiB")
        r = sp.reader()
        recv, chan = (lambda: r.get()[2]), path
    elif kind == "pipe":
        a, b = CTX.Pipe(duplex=False)
        recv, chan = a.recv_bytes, b
    else:
        q = CTX.Queue()
        recv, chan = q.get, q
    p = CTX.Process(target=_latency_sender, args=(kind, chan, count, gap, ready))
    p.start()
    ready.set()
    lat = []
    for _ in range(count):
        data = recv()
        lat.append(time.perf_counter_ns() - int.from_bytes(data, "little"))
    p.join(30)
    if kind == "spool":
        sp.close()
        shmq.Spool.destroy(path)
    return [x / 1e3 for x in lat]


def run_latency(mode, out):
    tmp = tempfile.mkdtemp(prefix="shmq-lat-", dir="/dev/shm")
    count = EXTRAS[mode][0]
    res = {}
    try:
        for _ in range(2):  # interleaved halves
            for kind in ("spool", "pipe", "mp.Queue"):
                samples = res.get(kind, {"samples_us": []})["samples_us"] + latency(kind, count // 2, tmp)
                res[kind] = {"samples_us": sorted(samples)}
        for r in res.values():
            s = r["samples_us"]
            for q in (50, 90, 99):
                r[f"p{q}_us"] = s[min(len(s) - 1, len(s) * q // 100)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\nwake-up latency of a blocked reader (one way, us)", file=out)
    for kind, r in res.items():
        print(f"  {kind:<10} p50 {r['p50_us']:7.1f}  p90 {r['p90_us']:7.1f}  p99 {r['p99_us']:8.1f}", file=out)
    return res


# --- syscalls on the fast path, idle CPU, reader memory ------------------------------

SYSCALL_PROBE = textwrap.dedent("""
    import shmq, sys
    path, n = sys.argv[1], int(sys.argv[2])
    sp = shmq.Spool.open(path)
    r = sp.reader()
    for _ in range(n):
        sp.put(b"x" * 100)
        r.get()
""")


def run_syscalls(mode, out):
    if not shutil.which("strace"):
        print("\nsyscalls: strace not installed, skipped", file=out)
        return None
    ops = EXTRAS[mode][1]
    tmp = tempfile.mkdtemp(prefix="shmq-sys-", dir="/dev/shm")
    path = os.path.join(tmp, "s")
    shmq.Spool.create(path, capacity="16MiB").close()
    counts = {}
    try:
        for n in (0, ops):
            log = os.path.join(tmp, f"strace{n}")
            subprocess.run(["strace", "-f", "-c", "-o", log, sys.executable, "-c", SYSCALL_PROBE, path, str(n)],
                           check=True, capture_output=True)
            total = 0
            for line in open(log):
                parts = line.split()
                if parts and parts[-1] == "total":
                    total = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else int(parts[2])
            counts[n] = total
    finally:
        shmq.Spool.destroy(path)
        shutil.rmtree(tmp, ignore_errors=True)
    per_op = (counts[ops] - counts[0]) / ops
    print(f"\nsyscalls per put+get, uncontended, nobody waiting: {per_op:.4f} "
          f"(strace -c: {counts[0]} for startup, {counts[ops]} with {ops} put+get)", file=out)
    return {"per_put_get": per_op, "baseline": counts[0], "ops": ops, "with_ops": counts[ops]}


def _blocked_reader(path, ready, seconds):
    sp = shmq.Spool.open(path)
    r = sp.reader()
    ready.set()
    try:
        r.get(timeout=seconds + 1.0)
    except shmq.Empty:
        pass


def frame_overhead(tmp, size, frames=64):
    """Ring bytes per frame beyond the payload (header + alignment), from stats()."""
    path = os.path.join(tmp, f"overhead-{size}")
    sp = shmq.Spool.create(path, capacity="1MiB")
    try:
        sp.put_many([b"o" * size] * frames)
        return sp.stats().used_bytes // frames - size
    finally:
        sp.close()
        shmq.Spool.destroy(path)


def run_idle_and_memory(mode, out):
    seconds = EXTRAS[mode][2]
    tmp = tempfile.mkdtemp(prefix="shmq-idle-", dir="/dev/shm")
    res = {}
    try:
        path = os.path.join(tmp, "idle")
        shmq.Spool.create(path, capacity="1MiB").close()
        ready = CTX.Event()
        p = CTX.Process(target=_blocked_reader, args=(path, ready, seconds))
        p.start()
        ready.wait(10)
        time.sleep(0.2)  # let it park
        proc = psutil.Process(p.pid)
        c0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
        time.sleep(seconds)
        c1, t1 = sum(proc.cpu_times()[:2]), time.monotonic()
        p.join(10)
        shmq.Spool.destroy(path)
        res["idle_reader_cpu_pct"] = 100 * (c1 - c0) / (t1 - t0)
        big = os.path.join(tmp, "big")
        sp = shmq.Spool.create(big, capacity="1GiB")
        for _ in range(1000):
            sp.put(b"y" * 1000)
        sp.close()
        r0 = psutil.Process().memory_info().rss
        sp = shmq.Spool.open(big)
        sp.reader().get_many(1000)
        r1 = psutil.Process().memory_info().rss
        sp.close()
        shmq.Spool.destroy(big)
        res["reader_rss_growth_mb_1gib_spool"] = (r1 - r0) / 2**20
        res["frame_overhead_bytes"] = {n: frame_overhead(tmp, n) for n in (1, 100, 4096)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nidle blocked reader CPU: {res['idle_reader_cpu_pct']:.2f} %", file=out)
    print(f"reader RSS growth opening a 1 GiB spool and reading 1 MB: "
          f"{res['reader_rss_growth_mb_1gib_spool']:.1f} MB", file=out)
    print(f"per-frame overhead (header + alignment): {res['frame_overhead_bytes']}", file=out)
    return res


# --- import time ------------------------------------------------------------------------

#: Fresh interpreters per contender: the issue's "median of 10" (3 in a smoke run).
IMPORT_RUNS = {"full": 10, "quick": 10, "smoke": 3}


def run_import(mode, out):
    """``import shmq`` against ``import multiprocessing`` (stress/import_time.py)."""
    import import_time

    runs = IMPORT_RUNS[mode]
    print("", file=out)
    return import_time.report(import_time.measure(runs, list(import_time.CONTENDERS)), runs, out)
