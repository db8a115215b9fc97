#!/usr/bin/env python3
"""shmq benchmarks against named peers and the pure-Python ceiling, in one run.

Each scenario runs every contender in fresh producer/consumer processes
(fork); repeats are interleaved (A, B, C, A, B, C, ...) so the drift of this
shared machine hits every contender alike.  Reported: medians of the
repeats and ratios against each peer measured in the same run, then the
targets of docs/benchmarks.md with where each stands.

    python stress/bench.py --quick            # CI / smoke: well under a minute
    python stress/bench.py --out bench-out    # full run: table, results.json, PNG plots

Contenders: ``spool`` (shmq.Spool put/get: a named reader, or a group when
there are several consumers), ``spool-batch`` (put_many/get_many),
``shmq.Queue`` / ``shmq.Queue-batch``, ``mp.Queue`` (multiprocessing.Queue),
``faster-fifo`` / ``faster-fifo-batch`` (when installed: ``pip install
'shmq[bench]'``), and ``ring``: a minimal single-producer/single-consumer
ring written inline below (no locks, no stats, no serialization, a busy-
polling reader): the ceiling of pure Python on this machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import psutil

import shmq

try:
    import faster_fifo
except ImportError:  # optional peer
    faster_fifo = None

CTX = mp.get_context("fork")  # closures as process targets; no pickling of channels
BIG_CAPACITY = "64MiB"


# --- payloads -------------------------------------------------------------------

def payload(kind, size):
    if kind == "bytes":
        return b"x" * size
    if kind == "dict":
        return {"id": 12345, "name": "sensor-7", "value": 3.25, "ok": True, "tags": ["a", "b"]}
    if kind == "numpy":
        return np.ones(size // 8, dtype=np.float64)
    if kind == "records":  # a batch of 1000 100-byte records
        recs = np.zeros(1000, dtype=RECORD)
        recs["id"] = np.arange(1000)
        return recs
    if kind == "arrow":  # 64k rows x 10 columns
        import pyarrow as pa

        return pa.record_batch({f"c{i}": (np.arange(65536, dtype=np.int64) if i % 2 else
                                          np.random.default_rng(i).random(65536)) for i in range(10)})
    raise ValueError(kind)


RECORD = np.dtype([("id", "<i8"), ("ts", "<i8"), ("value", "<f8"), ("name", "S76")])
assert RECORD.itemsize == 100


def nbytes_of(kind, size):
    if kind == "records":
        return 100
    if kind == "arrow":
        return 65536 * 10 * 8
    return size if kind in ("bytes", "numpy") else 0


# --- contenders: each returns (setup, put_side, get_side, teardown) ---------------
# put_side(channel, item, n, batch) and get_side(channel, n, batch, index) run in
# child processes; the channel is created once per run in the parent (fork).


class Spool:
    name = "spool"

    def __init__(self, batch=False):
        self.batch = batch
        self.name = "spool-batch" if batch else "spool"

    def setup(self, tmp, consumers, fanout):
        path = os.path.join(tmp, f"spool-{time.monotonic_ns()}")
        sp = shmq.Spool.create(path, capacity=BIG_CAPACITY, on_full="block", checksum=False)
        if fanout:
            for i in range(consumers):
                sp.reader(f"r{i}").close()
        else:
            sp.reader("g", group=True).close() if consumers > 1 else sp.reader("r0").close()
        sp.close()
        return path

    def producer(self, path, item, n, batch):
        sp = shmq.Spool.open(path)
        if self.batch:
            items = [item] * batch
            for _ in range(n // batch):
                sp.put_many(items)
        else:
            put = sp.put
            for _ in range(n):
                put(item)
        sp.close()

    def consumer(self, path, n, batch, index, consumers, fanout):
        sp = shmq.Spool.open(path)
        r = sp.reader(f"r{index}") if fanout or consumers == 1 else sp.reader("g", group=True)
        got = 0
        if self.batch:
            while got < n:
                got += len(r.get_many(batch))
        else:
            get = r.get
            for _ in range(n):
                get()
        sp.close()

    def teardown(self, path):
        shmq.Spool.destroy(path)


class ShmqQueue:
    def __init__(self, batch=False):
        self.batch = batch
        self.name = "shmq.Queue-batch" if batch else "shmq.Queue"

    def setup(self, tmp, consumers, fanout):
        return shmq.Queue(capacity=BIG_CAPACITY)

    def producer(self, q, item, n, batch):
        if self.batch:
            items = [item] * batch
            for _ in range(n // batch):
                q.put_many(items)
        else:
            put = q.put
            for _ in range(n):
                put(item)

    def consumer(self, q, n, batch, index, consumers, fanout):
        got = 0
        if self.batch:
            while got < n:
                got += len(q.get_many(batch))
        else:
            get = q.get
            for _ in range(n):
                get()

    def teardown(self, q):
        q.close()


class MpQueue:
    name = "mp.Queue"
    batch = False

    def setup(self, tmp, consumers, fanout):
        return CTX.Queue()

    def producer(self, q, item, n, batch):
        put = q.put
        for _ in range(n):
            put(item)
        q.close()
        q.join_thread()

    def consumer(self, q, n, batch, index, consumers, fanout):
        get = q.get
        for _ in range(n):
            get()

    def teardown(self, q):
        q.close()


class FasterFifo:
    def __init__(self, batch=False):
        self.batch = batch
        self.name = "faster-fifo-batch" if batch else "faster-fifo"

    def setup(self, tmp, consumers, fanout):
        return faster_fifo.Queue(max_size_bytes=64 * 1024 * 1024)

    def producer(self, q, item, n, batch):
        if self.batch:
            items = [item] * batch
            for _ in range(n // batch):
                q.put_many(items, timeout=1e9)
        else:
            put = q.put
            for _ in range(n):
                put(item, True, 1e9)

    def consumer(self, q, n, batch, index, consumers, fanout):
        got = 0
        if self.batch:
            while got < n:
                got += len(q.get_many(timeout=1e9, max_messages_to_get=batch))
        else:
            get = q.get
            for _ in range(n):
                get(True, 1e9)

    def teardown(self, q):
        q.close()


class Ring:
    """The ceiling: one producer, one consumer, bytes only, nothing but copies."""

    name = "ring"
    batch = False

    def setup(self, tmp, consumers, fanout):
        path = os.path.join(tmp, f"ring-{time.monotonic_ns()}")
        with open(path, "wb") as f:
            f.truncate(4096 + 16 * 1024 * 1024)
        return path

    def producer(self, path, item, n, batch):
        import mmap

        with open(path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), 0)
        ctl = memoryview(mm)[:64].cast("Q")  # [0] bytes written, [1] bytes read
        cap = len(mm) - 4096
        size = len(item)
        rec = (8 + size + 7) & ~7
        head = 0
        for _ in range(n):
            while head + rec - ctl[1] > cap:
                pass
            off = 4096 + head % cap
            if off + rec > len(mm):  # a record never straddles the end: skip the tail
                head += len(mm) - off
                off = 4096
                while head + rec - ctl[1] > cap:
                    pass
            mm[off:off + 8] = size.to_bytes(8, "little")
            mm[off + 8:off + 8 + size] = item
            head += rec
            ctl[0] = head
        ctl.release()

    def consumer(self, path, n, batch, index, consumers, fanout):
        import mmap

        with open(path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), 0)
        ctl = memoryview(mm)[:64].cast("Q")
        cap = len(mm) - 4096
        tail = 0
        for _ in range(n):
            while ctl[0] <= tail:
                pass
            off = 4096 + tail % cap
            length = int.from_bytes(mm[off:off + 8], "little")
            if length == 0 or off + 8 + length > len(mm):  # skipped tail (zeroed or stale)
                tail += len(mm) - off
                while ctl[0] <= tail:
                    pass
                off = 4096
                length = int.from_bytes(mm[off:off + 8], "little")
            mm[off + 8:off + 8 + length]
            tail += (8 + length + 7) & ~7
            ctl[1] = tail
        ctl.release()

    def teardown(self, path):
        os.unlink(path)


class SpoolRecords(Spool):
    """Record-stream mode: put_many(structured array) / get_many(as_array=True)."""

    name = "spool-records"

    def __init__(self):
        super().__init__()
        self.name = "spool-records"

    def producer(self, path, item, n, batch):
        sp = shmq.Spool.open(path)
        for _ in range(n // len(item)):
            sp.put_many(item)
        sp.close()

    def consumer(self, path, n, batch, index, consumers, fanout):
        sp = shmq.Spool.open(path)
        r = sp.reader(f"r{index}")
        got = 0
        while got < n:
            got += len(r.get_many(64, as_array=True))
        sp.close()


class FasterFifoRecords(FasterFifo):
    """The same records as 100-byte bytes objects, 1000 per put_many."""

    def __init__(self):
        super().__init__(batch=True)
        self.name = "faster-fifo-batch"

    def producer(self, q, item, n, batch):
        items = [r.tobytes() for r in item]
        for _ in range(n // len(items)):
            q.put_many(items, timeout=1e9)

    def consumer(self, q, n, batch, index, consumers, fanout):
        got = 0
        while got < n:
            got += len(q.get_many(timeout=1e9, max_messages_to_get=1000))


class NumpyRing(Ring):
    """The ceiling for batches: the inline ring moving each batch as one array copy."""

    name = "numpy-ring"

    def producer(self, path, item, n, batch):
        raw = item.view(np.uint8)
        super().producer(path, raw.data, n // len(item), 1)

    def consumer(self, path, n, batch, index, consumers, fanout):
        import mmap

        with open(path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), 0)
        ctl = memoryview(mm)[:64].cast("Q")
        cap = len(mm) - 4096
        tail = 0
        batches = n // 1000
        for _ in range(batches):
            while ctl[0] <= tail:
                pass
            off = 4096 + tail % cap
            length = int.from_bytes(mm[off:off + 8], "little")
            if length == 0 or off + 8 + length > len(mm):
                tail += len(mm) - off
                while ctl[0] <= tail:
                    pass
                off = 4096
                length = int.from_bytes(mm[off:off + 8], "little")
            np.frombuffer(mm, dtype=RECORD, count=length // 100, offset=off + 8).copy()
            tail += (8 + length + 7) & ~7
            ctl[1] = tail
        ctl.release()


class SpoolView(Spool):
    """put_array / get_array(copy=False): the reader maps the frame, no copy."""

    def __init__(self, copy=False):
        super().__init__()
        self.copy = copy
        self.name = "spool-array" if copy else "spool-array-view"

    def producer(self, path, item, n, batch):
        sp = shmq.Spool.open(path)
        for _ in range(n):
            sp.put_array(item)
        sp.close()

    def consumer(self, path, n, batch, index, consumers, fanout):
        sp = shmq.Spool.open(path)
        r = sp.reader(f"r{index}")
        for _ in range(n):
            if self.copy:
                r.get_array()
            else:
                with r.get_array(copy=False) as v:
                    v.array[0]  # touch it
        sp.close()


class SpoolArrow(Spool):
    def __init__(self):
        super().__init__()
        self.name = "spool-arrow-view"

    def producer(self, path, item, n, batch):
        sp = shmq.Spool.open(path)
        for _ in range(n):
            sp.put_arrow(item)
        sp.close()

    def consumer(self, path, n, batch, index, consumers, fanout):
        sp = shmq.Spool.open(path)
        r = sp.reader(f"r{index}")
        for _ in range(n):
            with r.get_arrow(copy=False) as v:
                v.batch.num_rows
        sp.close()


class Memcpy:
    """Not a channel: one process copying the same bytes, for the bandwidth ceiling."""

    name = "memcpy"
    batch = False

    def setup(self, tmp, consumers, fanout):
        return None

    def producer(self, chan, item, n, batch):
        pass

    def consumer(self, chan, n, batch, index, consumers, fanout):
        src = np.ones(65536 * 10, dtype=np.int64)
        dst = np.empty_like(src)
        for _ in range(n):
            np.copyto(dst, src)

    def teardown(self, chan):
        pass


# --- one measured run ----------------------------------------------------------------


def _child(fn, args, start, conn):
    start.wait()
    fn(*args)
    conn.send((time.perf_counter(), psutil.Process().memory_info().rss))
    conn.close()


def measure(contender, kind, size, n, producers, consumers, batch, fanout, tmp):
    """Seconds to move n items from producers to consumers, and peak RSS (bytes)."""
    channel = contender.setup(tmp, consumers, fanout)
    item = payload(kind, size)
    start = CTX.Event()
    procs, pipes = [], []
    per_prod = n // producers
    per_cons = n if fanout else n // consumers
    for _ in range(producers):
        r, w = CTX.Pipe(duplex=False)
        procs.append(CTX.Process(target=_child, args=(contender.producer, (channel, item, per_prod, batch), start, w)))
        pipes.append(r)
    for i in range(consumers):
        r, w = CTX.Pipe(duplex=False)
        args = (channel, per_cons, batch, i, consumers, fanout)
        procs.append(CTX.Process(target=_child, args=(contender.consumer, args, start, w)))
        pipes.append(r)
    for p in procs:
        p.start()
    time.sleep(0.05)  # let every process reach the start line (not a measurement sync)
    t0 = time.perf_counter()
    start.set()
    ends = []
    for r in pipes:
        if not r.poll(600):
            raise RuntimeError(f"{contender.name}: a process did not finish")
        ends.append(r.recv())
    for p in procs:
        p.join(60)
    contender.teardown(channel)
    return max(t for t, _rss in ends) - t0, max(rss for _t, rss in ends)


# --- scenarios ----------------------------------------------------------------------

def contenders(*names, batch=False):
    table = {
        "spool": Spool(batch), "shmq.Queue": ShmqQueue(batch), "mp.Queue": MpQueue(),
        "faster-fifo": FasterFifo(batch) if faster_fifo else None, "ring": Ring(),
    }
    return [table[n] for n in names if table[n] is not None]


ALL = ("spool", "shmq.Queue", "mp.Queue", "faster-fifo")
# name: (kind, payload bytes, items (full mode), producers, consumers, batch, fanout, contenders)
SCENARIOS = {
    "1->1 100 B": ("bytes", 100, 300_000, 1, 1, 1, False, contenders(*ALL, "ring")),
    "1->1 small dict": ("dict", 0, 200_000, 1, 1, 1, False, contenders("shmq.Queue", "mp.Queue", "faster-fifo")),
    "2->2 100 B": ("bytes", 100, 200_000, 2, 2, 1, False, contenders(*ALL)),
    "4->1 100 B": ("bytes", 100, 200_000, 4, 1, 1, False, contenders(*ALL)),
    "1->1 100 B batch 100": ("bytes", 100, 2_000_000, 1, 1, 100, False,
                             contenders("spool", "shmq.Queue", "faster-fifo", batch=True) + contenders("mp.Queue")),
    "1->1 small dict batch 100": ("dict", 0, 1_000_000, 1, 1, 100, False,
                                  contenders("shmq.Queue", "faster-fifo", batch=True) + contenders("mp.Queue")),
    "1->1 4 KiB": ("bytes", 4096, 100_000, 1, 1, 1, False, contenders(*ALL)),
    "1->1 64 KiB": ("bytes", 65536, 20_000, 1, 1, 1, False, contenders(*ALL)),
    "1->1 1 MiB": ("bytes", 1 << 20, 2_000, 1, 1, 1, False, contenders(*ALL)),
    "1->1 1 MiB numpy": ("numpy", 1 << 20, 2_000, 1, 1, 1, False, contenders("shmq.Queue", "mp.Queue", "faster-fifo")),
    "1->4 fan-out 100 B": ("bytes", 100, 100_000, 1, 4, 1, True, contenders("spool")),
    # columnar (docs/columnar.md)
    "records 100 B x1000": ("records", 100, 5_000_000, 1, 1, 1000, False,
                            [SpoolRecords(), NumpyRing()] + ([FasterFifoRecords()] if faster_fifo else [])),
    "1->1 1 MiB numpy array": ("numpy", 1 << 20, 2_000, 1, 1, 1, False,
                               [SpoolView(copy=False), SpoolView(copy=True)] +
                               contenders("shmq.Queue", "faster-fifo")),
    "arrow 64k rows x 10 cols": ("arrow", 0, 400, 1, 1, 1, False, [SpoolArrow(), Memcpy()]),
}


def run_throughput(quick, repeats, only, out):
    tmp = tempfile.mkdtemp(prefix="shmq-bench-", dir="/dev/shm")
    results = {}
    try:
        for name, (kind, size, n, prods, cons, batch, fanout, cands) in SCENARIOS.items():
            if only and only not in name:
                continue
            if kind == "arrow":
                try:
                    import pyarrow  # noqa: F401
                except ImportError:
                    continue
            if quick:
                n = max(n // 20, 100 * prods * cons * batch)
            n -= n % (prods * cons * batch)
            runs = {c.name: [] for c in cands}
            rss = {c.name: 0 for c in cands}
            for _ in range(repeats):
                for c in cands:  # interleaved
                    dt, peak = measure(c, kind, size, n, prods, cons, batch, fanout, tmp)
                    runs[c.name].append(dt)
                    rss[c.name] = max(rss[c.name], peak)
            row = {}
            for c, ts in runs.items():
                med = statistics.median(ts)
                moved = n * (cons if fanout else 1)
                row[c] = {"items_per_s": moved / med, "gb_per_s": moved * nbytes_of(kind, size) / med / 1e9,
                          "median_s": med, "runs_s": ts, "items": n, "peak_rss_mb": rss[c] / 2**20}
            results[name] = row
            print_row(name, row, out)
    finally:
        remove_dir(tmp)
    return results


def print_row(name, row, out):
    print(f"\n{name}", file=out)
    for c, r in row.items():
        ratios = "  ".join(f"{r['items_per_s'] / o['items_per_s']:6.2f}x {oc}" for oc, o in row.items() if oc != c)
        gb = f"{r['gb_per_s']:6.2f} GB/s" if r["gb_per_s"] else " " * 11
        print(f"  {c:<18} {r['items_per_s'] / 1e6:8.3f} M/s {gb}  rss {r['peak_rss_mb']:5.0f} MB  {ratios}",
              file=out, flush=True)


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
    lat.sort()
    pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] / 1e3  # noqa: E731
    return {"p50_us": pick(0.5), "p90_us": pick(0.9), "p99_us": pick(0.99), "samples_us": [x / 1e3 for x in lat]}


def run_latency(quick, out):
    tmp = tempfile.mkdtemp(prefix="shmq-lat-", dir="/dev/shm")
    count = 300 if quick else 3000
    res = {}
    try:
        for rnd in range(2):  # interleaved halves
            for kind in ("spool", "pipe", "mp.Queue"):
                r = latency(kind, count // 2, tmp)
                prev = res.get(kind, {"samples_us": []})
                samples = sorted(prev["samples_us"] + r["samples_us"])
                res[kind] = {"samples_us": samples}
        for kind, r in res.items():
            s = r["samples_us"]
            for q in (50, 90, 99):
                r[f"p{q}_us"] = s[min(len(s) - 1, len(s) * q // 100)]
    finally:
        remove_dir(tmp)
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


def run_syscalls(out):
    if not shutil.which("strace"):
        print("\nsyscalls: strace not installed, skipped", file=out)
        return None
    tmp = tempfile.mkdtemp(prefix="shmq-sys-", dir="/dev/shm")
    path = os.path.join(tmp, "s")
    shmq.Spool.create(path, capacity="16MiB").close()
    counts = {}
    try:
        for n in (0, 20000):
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
        remove_dir(tmp)
    per_op = (counts[20000] - counts[0]) / 20000
    print(f"\nsyscalls per put+get, uncontended, nobody waiting: {per_op:.4f} "
          f"(strace -c: {counts[0]} for startup, {counts[20000]} with 20000 put+get)", file=out)
    return {"per_put_get": per_op, "baseline": counts[0], "with_20000": counts[20000]}


def _blocked_reader(path, ready):
    sp = shmq.Spool.open(path)
    r = sp.reader()
    ready.set()
    try:
        r.get(timeout=3.0)
    except shmq.Empty:
        pass


def remove_dir(tmp):
    """Remove a scenario's directory: its spools with Spool.destroy first, so their
    semaphores go too (rmtree alone leaves three or more per spool in /dev/shm)."""
    for name in os.listdir(tmp) if os.path.isdir(tmp) else ():
        try:
            shmq.Spool.destroy(os.path.join(tmp, name))
        except (OSError, shmq.ShmqError):
            pass  # not a spool (strace logs), or already gone
    shutil.rmtree(tmp, ignore_errors=True)


def run_idle_and_memory(out):
    tmp = tempfile.mkdtemp(prefix="shmq-idle-", dir="/dev/shm")
    res = {}
    try:
        path = os.path.join(tmp, "idle")
        shmq.Spool.create(path, capacity="1MiB").close()
        ready = CTX.Event()
        p = CTX.Process(target=_blocked_reader, args=(path, ready))
        p.start()
        ready.wait(10)
        time.sleep(0.2)
        proc = psutil.Process(p.pid)
        c0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
        time.sleep(2.0)
        c1, t1 = sum(proc.cpu_times()[:2]), time.monotonic()
        p.join(10)
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
        res["frame_overhead_bytes"] = {n: shmq._format.frame_stored_bytes(n) - n for n in (1, 100, 4096)}
    finally:
        remove_dir(tmp)
    print(f"\nidle blocked reader CPU: {res['idle_reader_cpu_pct']:.2f} %", file=out)
    print(f"reader RSS growth opening a 1 GiB spool and reading 1 MB: "
          f"{res['reader_rss_growth_mb_1gib_spool']:.1f} MB", file=out)
    print(f"per-frame overhead (header + alignment): {res['frame_overhead_bytes']}", file=out)
    return res


# --- targets --------------------------------------------------------------------------

def ratio(results, scen, a, b):
    row = results.get(scen, {})
    if a in row and b in row:
        return row[a]["items_per_s"] / row[b]["items_per_s"]
    return None


def targets(results, lat, sys_, misc):
    """(target, achieved, met?) per issue-4 target, from this run's numbers."""
    rows = []

    def add(label, value, goal, fmt="{:.2f}x"):
        rows.append({"target": label, "value": value, "goal": goal,
                     "met": None if value is None else value >= goal,
                     "shown": "n/a" if value is None else fmt.format(value)})

    r = ratio(results, "1->1 100 B", "spool", "ring")
    add("Spool 1->1 100 B >= 50% of the inline ring", r, 0.5, "{:.0%}")
    add("Spool 1->1 100 B >= 10x mp.Queue", ratio(results, "1->1 100 B", "spool", "mp.Queue"), 10)
    add("shmq.Queue small dict >= 5x mp.Queue", ratio(results, "1->1 small dict", "shmq.Queue", "mp.Queue"), 5)
    add("shmq.Queue batches of 100 >= 4x faster-fifo batches",
        ratio(results, "1->1 small dict batch 100", "shmq.Queue-batch", "faster-fifo-batch"), 4)
    add("1 MiB bytes >= 1.5x faster-fifo GB/s", ratio(results, "1->1 1 MiB", "spool", "faster-fifo"), 1.5)
    add("records 100 B x1000 >= 10 M records/s",
        (results.get("records 100 B x1000", {}).get("spool-records", {}).get("items_per_s", 0) / 1e6) or None,
        10, "{:.2f} M/s")
    add("records >= 40% of the inline numpy ring",
        ratio(results, "records 100 B x1000", "spool-records", "numpy-ring"), 0.4, "{:.0%}")
    add("records >= 50x faster-fifo put_many/get_many",
        ratio(results, "records 100 B x1000", "spool-records", "faster-fifo-batch"), 50)
    add("1 MiB numpy copy=False >= 3x faster-fifo",
        ratio(results, "1->1 1 MiB numpy array", "spool-array-view", "faster-fifo"), 3)
    add("Arrow 64k x 10 >= 50% of memcpy bandwidth",
        ratio(results, "arrow 64k rows x 10 cols", "spool-arrow-view", "memcpy"), 0.5, "{:.0%}")
    if sys_:
        rows.append({"target": "zero syscalls per put+get with nobody waiting", "value": sys_["per_put_get"],
                     "goal": 0, "met": sys_["per_put_get"] < 0.01, "shown": f"{sys_['per_put_get']:.4f}/op"})
    if lat:
        v = lat["spool"]["p50_us"] / lat["pipe"]["p50_us"]
        rows.append({"target": "wake-up p50 <= 1.5x a pipe's", "value": v, "goal": 1.5, "met": v <= 1.5,
                     "shown": f"{v:.2f}x ({lat['spool']['p50_us']:.0f} vs {lat['pipe']['p50_us']:.0f} us)"})
    if misc:
        v = misc["idle_reader_cpu_pct"]
        rows.append({"target": "idle blocked reader CPU < 1%", "value": v, "goal": 1, "met": v < 1,
                     "shown": f"{v:.2f}%"})
        v = misc["reader_rss_growth_mb_1gib_spool"]
        rows.append({"target": "reader RSS independent of capacity", "value": v, "goal": 16, "met": v < 16,
                     "shown": f"+{v:.1f} MB for a 1 GiB spool"})
    return rows


# --- plots ------------------------------------------------------------------------------

def plot(results, lat, outdir):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    names = list(results)
    conts = sorted({c for row in results.values() for c in row})
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / max(1, len(conts))
    for k, c in enumerate(conts):
        xs = [i + k * width for i, n in enumerate(names) if c in results[n]]
        ys = [results[n][c]["items_per_s"] for n in names if c in results[n]]
        ax.bar(xs, ys, width, label=c)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))])
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("items / s (log)")
    ax.set_title("throughput by scenario (median of interleaved runs)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(os.path.join(outdir, "throughput.png"))
    fig.savefig(files[-1], dpi=110)
    if lat:
        fig, ax = plt.subplots(figsize=(7, 4))
        for kind, r in lat.items():
            s = r["samples_us"]
            ax.plot(s, [i / len(s) for i in range(len(s))], label=kind)
        ax.set_xscale("log")
        ax.set_xlabel("one-way wake-up latency (us, log)")
        ax.set_ylabel("fraction")
        ax.set_title("latency CDF of a blocked reader")
        ax.legend()
        fig.tight_layout()
        files.append(os.path.join(outdir, "latency_cdf.png"))
        fig.savefig(files[-1], dpi=110)
    return files


def machine():
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
            "cpu": cpu, "shmq": shmq.__version__,
            "faster_fifo": getattr(faster_fifo, "__version__", "installed") if faster_fifo else None,
            "date": time.strftime("%Y-%m-%d %H:%M")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small runs (CI): well under a minute")
    ap.add_argument("--repeats", type=int, default=None, help="runs per contender (default 3 quick, 5 full)")
    ap.add_argument("--only", help="only throughput scenarios whose name contains this")
    ap.add_argument("--skip-extras", action="store_true", help="throughput only (no latency/syscalls/memory)")
    ap.add_argument("--out", help="directory for results.json and PNG plots")
    args = ap.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 5)
    info = machine()
    out = sys.stdout
    print(f"shmq {info['shmq']} on {info['cpu']} x{info['cpus']}, Python {info['python']}, "
          f"{info['date']}; median of {repeats} interleaved runs"
          + ("" if faster_fifo else "; faster-fifo not installed (pip install 'shmq[bench]')"), flush=True)
    results = run_throughput(args.quick, repeats, args.only, out)
    lat = sys_ = misc = None
    if not args.skip_extras:
        lat = run_latency(args.quick, out)
        sys_ = run_syscalls(out)
        misc = run_idle_and_memory(out)
    rows = targets(results, lat, sys_, misc)
    print("\ntargets (docs/benchmarks.md)", file=out)
    for r in rows:
        mark = {True: "met", False: "NOT MET", None: "not measured"}[r["met"]]
        print(f"  [{mark:>12}] {r['target']}: {r['shown']}", file=out)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        plots = plot(results, lat, args.out)
        if lat:
            for r in lat.values():
                r["samples_us"] = r["samples_us"][:: max(1, len(r["samples_us"]) // 200)]
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"machine": info, "quick": args.quick, "repeats": repeats, "throughput": results,
                       "latency": lat, "syscalls": sys_, "misc": misc, "targets": rows, "plots": plots}, f, indent=1)
        print(f"\nwrote {args.out}/results.json" + (f" and {len(plots)} plots" if plots else ""), file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
