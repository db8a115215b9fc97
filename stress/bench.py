#!/usr/bin/env python3
"""shmq benchmarks against named peers and the pure-Python ceiling, in one run.

Each scenario runs every contender in fresh producer/consumer processes
(fork); repeats are interleaved (A, B, C, A, B, C, ...) so the drift of this
shared machine hits every contender alike.  Reported: medians of the
repeats and ratios against each peer measured in the same run (each the
median of the rounds' ratios: bench_targets.speed_ratio), the
wake-up latency, syscalls, memory and ``import shmq`` time, then the
targets (the speed targets first) with where each stands.

    python stress/bench.py --quick            # a short run: well under two minutes
    python stress/bench.py --smoke            # CI: every row and target, tiny counts
    python stress/bench.py --out bench-out    # full run: table, results.json, PNG plots

Contenders (bench_contenders.py, bench_peers.py): ``spool`` (shmq.Spool
put/get: a named reader, or a group when there are several consumers),
``spool-batch`` (put_many/get_many), ``C producer`` (a C program putting
through shmq.h, stress/bench_cproducer.c, a Python named reader getting:
the C API with Python on the other end), ``spool-wrapped`` (a 1 MiB ring in
steady state), ``spool-growable`` (1 MiB of pages growing up to the fixed
spool's 64 MiB, as ``shmq.Queue()``'s rings do; ``spool-grown``: the same
after one untimed pass of the row's workload), ``spool-reserve`` (zero-copy writes with ``Spool.reserve``,
once it exists), ``shmq.Queue`` / ``shmq.Queue-batch``, ``mp.Queue``
(multiprocessing.Queue), and when installed (``pip install 'shmq[bench]'``)
``faster-fifo``, ``pyzmq`` (PUSH/PULL over ipc://), ``iceoryx2`` (loaned
samples), plus ``posix-mq`` (posix_ipc.MessageQueue within the system's
limits), and ``ring``: a minimal single-producer/single-consumer ring written
inline (no locks, no stats, no serialization, a busy-polling reader): the
ceiling of pure Python on this machine.  A contender that cannot run prints
why ("not installed ...", "n/a ...", "failed: ...") in its row.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing.connection as mpc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import psutil

import shmq
from bench_contenders import (
    BIG_CAPACITY, BIG_WRAPS_BEFORE_TIMING, CTX, FasterFifo, FasterFifoRecords, Memcpy, MpQueue, NumpyRing, Ring, ShmqQueue, Spool, SpoolArrow,
    SpoolCProducer,
    SpoolGrowable, SpoolGrown, SpoolRecords, SpoolReserve, SpoolView, SpoolWrapped, Threaded, faster_fifo, nbytes_of, payload,
)
from bench_extras import run_idle_and_memory, run_import, run_latency, run_syscalls
from bench_peers import Iceoryx2, PosixMQ, PyZmq, versions
from bench_targets import measured, print_targets, speed_ratio, targets

#: Items per scenario are its full-mode count divided by this; the floor keeps
#: every process busy for more than its start-up.
SCALE = {"full": (1, 0), "quick": (20, 100), "smoke": (400, 8)}  # (divisor, floor per process pair)
#: A measured run that takes longer than this is killed and reported as failed.
TIMEOUT_S = {"full": 300.0, "quick": 60.0, "smoke": 60.0}


@dataclass
class Scenario:
    kind: str
    size: int
    items: int  # in full mode
    producers: int
    consumers: int
    batch: int
    fanout: bool
    contenders: list = field(default_factory=list)
    timeout_s: float = 60.0
    #: Items each process moves before it reports ready (untimed; 1->1 rows): the
    #: steady state, for a row whose reference is one (memcpy reuses two resident
    #: buffers), rather than the first touch of a fresh channel's pages (about
    #: 1.2 us per 4 KiB page here).
    warm: int = 0

    def __post_init__(self):
        if self.warm and not self.producers == self.consumers == 1:
            raise ValueError("a warm pass is for 1->1 rows (each process moves `warm` items)")


def contenders(*names, batch=False):
    table = {"spool": Spool, "shmq.Queue": ShmqQueue, "faster-fifo": FasterFifo, "pyzmq": PyZmq}
    plain = {"mp.Queue": MpQueue, "ring": Ring, "posix-mq": PosixMQ}
    return [table[n](batch) if n in table else plain[n]() for n in names]


ALL = ("spool", "shmq.Queue", "mp.Queue", "faster-fifo")
PEERS = ("pyzmq", "posix-mq")
S = Scenario
#: A row's contenders run in this order in every round.  The two runs a close speed
#: target compares (bench_targets: grown against fixed, a view against memcpy, ...)
#: are back to back, so a round's ratio pairs runs a fraction of a second apart, not
#: a slow peer's run apart (mp.Queue's takes 2 s in 1->1 100 B).
SCENARIOS = {
    "1->1 100 B": S("bytes", 100, 300_000, 1, 1, 1, False,
                    contenders("spool") + [SpoolGrown(), SpoolGrowable()] + contenders("ring", *ALL[1:], *PEERS)
                    + [SpoolCProducer()]),
    "1->1 100 B wrapped 1 MiB": S("bytes", 100, 300_000, 1, 1, 1, False,
                                  [SpoolWrapped()] + contenders("spool", "mp.Queue", "faster-fifo")),
    "1->1 100 B wrapped 64 MiB": S("bytes", 100, 300_000, 1, 1, 1, False,
                                   [SpoolWrapped(BIG_CAPACITY, BIG_WRAPS_BEFORE_TIMING)] + contenders("spool", "mp.Queue")),
    "1->1 small dict": S("dict", 0, 200_000, 1, 1, 1, False, contenders("shmq.Queue", "mp.Queue", "faster-fifo")),
    "2->2 100 B": S("bytes", 100, 200_000, 2, 2, 1, False, contenders(*ALL)),
    "4->1 100 B": S("bytes", 100, 200_000, 4, 1, 1, False, contenders(*ALL)),
    "8 threads x 2 processes small dict": S("dict", 0, 100_000, 1, 1, 1, False,
                                            [Threaded(ShmqQueue()), Threaded(MpQueue())]),
    "1->1 100 B batch 100": S("bytes", 100, 2_000_000, 1, 1, 100, False,
                              contenders("spool", "shmq.Queue", "faster-fifo", "pyzmq", batch=True)
                              + contenders("mp.Queue") + [SpoolCProducer(batch=True)]),
    "1->1 small dict batch 100": S("dict", 0, 1_000_000, 1, 1, 100, False,
                                   contenders("shmq.Queue", "faster-fifo", batch=True) + contenders("mp.Queue")),
    "1->1 1 KiB": S("bytes", 1024, 200_000, 1, 1, 1, False, contenders(*ALL, *PEERS)),
    "1->1 1 KiB wrapped 1 MiB": S("bytes", 1024, 200_000, 1, 1, 1, False,
                                  [SpoolWrapped()] + contenders("spool", "mp.Queue", "faster-fifo")),
    "1->1 4 KiB": S("bytes", 4096, 100_000, 1, 1, 1, False, contenders(*ALL)),
    "1->1 64 KiB": S("bytes", 65536, 20_000, 1, 1, 1, False, contenders(*ALL)),
    "1->1 1 MiB": S("bytes", 1 << 20, 2_000, 1, 1, 1, False,
                    contenders("spool") + [SpoolGrowable(), SpoolGrown()] + contenders(*ALL[1:], *PEERS)
                    + [SpoolCProducer()]),
    "1->1 1 MiB reserve": S("bytes", 1 << 20, 2_000, 1, 1, 1, False, [SpoolReserve(), Iceoryx2(), Spool()]),
    "1->1 1 MiB numpy": S("numpy", 1 << 20, 2_000, 1, 1, 1, False, contenders("shmq.Queue", "mp.Queue", "faster-fifo")),
    "1->4 fan-out 100 B": S("bytes", 100, 100_000, 1, 4, 1, True, contenders("spool")),
    # columnar (docs/columnar.md)
    "records 100 B x1000": S("records", 100, 5_000_000, 1, 1, 1000, False,
                             [SpoolRecords(), NumpyRing(), FasterFifoRecords()]),
    "1->1 1 MiB numpy array": S("numpy", 1 << 20, 2_000, 1, 1, 1, False,
                                [SpoolView(copy=False), Memcpy(), SpoolView(copy=True)]
                                + contenders("shmq.Queue", "faster-fifo"), warm=32),
    "arrow 64k rows x 10 cols": S("arrow", 0, 400, 1, 1, 1, False, [SpoolArrow(), Memcpy()], warm=8),
}


# --- one measured run ----------------------------------------------------------------


class Failed(Exception):
    """A contender raised, hung or died: its row says so, the run goes on."""


def _child(contender, role, index, chan, args, sc, start, conn):
    try:
        handle = contender.open(chan, role, index, sc)
        if sc.warm:
            if role == "producer":
                contender.producer(handle, args[0], sc.warm, sc)
            else:
                contender.consumer(handle, sc.warm, index, sc)
        conn.send(("ready",))
        start.wait()
        if role == "producer":
            contender.producer(handle, *args)
        else:
            contender.consumer(handle, *args)
        end = time.perf_counter()
        contender.close(handle)
        handle = None
        conn.send(("done", end, psutil.Process().memory_info().rss))
    except BaseException as e:  # reported in the row, never a crash of the run
        conn.send(("error", f"{role} {index}: {type(e).__name__}: {e}"))
    finally:
        conn.close()


def _collect(pipes, names, want, deadline):
    """Wait for one ``want`` message from every pipe; return them in order.

    :raises Failed: a child reported an error, died, or missed the deadline.
    """
    got = {}
    while len(got) < len(pipes):
        ready = mpc.wait([p for p in pipes if p not in got], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = ", ".join(n for p, n in zip(pipes, names) if p not in got)
            raise Failed(f"timed out: {late} not {want}")
        for p in ready:
            try:
                msg = p.recv()
            except EOFError:
                raise Failed(f"{names[pipes.index(p)]} died") from None
            if msg[0] == "error":
                raise Failed(msg[1])
            if msg[0] == want:
                got[p] = msg
    return [got[p] for p in pipes]


def measure(contender, sc, n, tmp):
    """Seconds to move n items from producers to consumers, and peak RSS (bytes).

    :raises Failed: a process raised, died or did not finish within ``sc.timeout_s``.
    """
    try:
        chan = contender.setup(tmp, sc)
    except Exception as e:
        raise Failed(f"setup: {type(e).__name__}: {e}") from None
    item = payload(sc.kind, sc.size)
    start = CTX.Event()
    procs, pipes = [], []
    per_prod = n // sc.producers
    per_cons = n if sc.fanout else n // sc.consumers
    roles = [("producer", i, (item, per_prod, sc)) for i in range(sc.producers)]
    roles += [("consumer", i, (per_cons, i, sc)) for i in range(sc.consumers)]
    try:
        for role, index, args in roles:
            r, w = CTX.Pipe(duplex=False)
            procs.append(CTX.Process(target=_child, args=(contender, role, index, chan, args, sc, start, w)))
            pipes.append(r)
        for p in procs:
            p.start()
        deadline = time.monotonic() + sc.timeout_s
        names = [f"{role} {index}" for role, index, _args in roles]
        _collect(pipes, names, "ready", deadline)  # connected, mapped, subscribed: none of it timed
        t0 = time.perf_counter()
        start.set()
        ends = _collect(pipes, names, "done", deadline)
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        contender.teardown(chan)
    return max(e[1] for e in ends) - t0, max(e[2] for e in ends)


def run_throughput(mode, repeats, only, out):
    tmp = tempfile.mkdtemp(prefix="shmq-bench-", dir="/dev/shm")
    results = {}
    div, floor = SCALE[mode]
    try:
        for name, sc in SCENARIOS.items():
            if only and only not in name:
                continue
            sc.timeout_s = TIMEOUT_S[mode]
            per_batch = sc.producers * sc.consumers * sc.batch
            n = max(sc.items // div, floor * per_batch)
            n -= n % (per_batch * 8)  # whole batches for every process and thread
            row = {}
            for c in sc.contenders:
                why = c.unavailable(sc)
                if why is None and sc.kind == "arrow":
                    try:
                        import pyarrow  # noqa: F401
                    except ImportError:
                        why = "not installed (pip install pyarrow)"
                row[c.name] = {"status": why} if why else None
            runs = {c.name: [] for c in sc.contenders if row[c.name] is None}
            rss = dict.fromkeys(runs, 0)
            retried = dict.fromkeys(runs, 0)
            for _ in range(repeats):
                for c in sc.contenders:  # interleaved
                    while c.name in runs:
                        try:
                            dt, peak = measure(c, sc, n, tmp)
                        except Failed as e:
                            # One failed run per contender is retried (a peer's
                            # rare flake, reported); a second one fails the row.
                            retried[c.name] += 1
                            if retried[c.name] > 1:
                                del runs[c.name]
                                row[c.name] = {"status": f"failed: {e}"}
                            else:
                                print(f"  ({c.name}: a run failed and is retried: {e})", file=out, flush=True)
                            continue
                        runs[c.name].append(dt)
                        rss[c.name] = max(rss[c.name], peak)
                        break
            moved = n * (sc.consumers if sc.fanout else 1)
            for c, ts in runs.items():
                med = statistics.median(ts)
                row[c] = {"items_per_s": moved / med, "gb_per_s": moved * nbytes_of(sc.kind, sc.size) / med / 1e9,
                          "median_s": med, "runs_s": ts, "items": n, "warm_items": sc.warm, "peak_rss_mb": rss[c] / 2**20,
                          "failed_runs_retried": retried[c]}
            results[name] = row
            print_row(name, row, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def print_row(name, row, out):
    print(f"\n{name}", file=out)
    for c, r in row.items():
        if not measured(r):
            print(f"  {c:<22} {r['status']}", file=out, flush=True)
            continue
        ratios = "  ".join(f"{speed_ratio(r, o):6.2f}x {oc}"
                           for oc, o in row.items() if oc != c and measured(o))
        v = r["items_per_s"]
        speed = f"{v / 1e6:8.3f} M/s" if v >= 1e5 else f"{v / 1e3:8.2f} k/s"
        gb = f"{r['gb_per_s']:6.2f} GB/s" if r["gb_per_s"] else " " * 11
        print(f"  {c:<22} {speed} {gb}  rss {r['peak_rss_mb']:5.0f} MB  {ratios}", file=out, flush=True)


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
    conts = sorted({c for row in results.values() for c, r in row.items() if measured(r)})
    fig, ax = plt.subplots(figsize=(14, 6))
    width = 0.8 / max(1, len(conts))
    for k, c in enumerate(conts):
        xs = [i + k * width for i, n in enumerate(names) if measured(results[n].get(c))]
        ys = [results[n][c]["items_per_s"] for n in names if measured(results[n].get(c))]
        ax.bar(xs, ys, width, label=c)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))])
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("items / s (log)")
    ax.set_title("throughput by scenario (median of interleaved runs)")
    ax.legend(fontsize=7, ncol=2)
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
            "cpu": cpu, "shmq": shmq.__version__, "reserve_api": hasattr(shmq.Spool, "reserve"),
            "faster_fifo": getattr(faster_fifo, "__version__", "installed") if faster_fifo else None,
            **versions(), "date": time.strftime("%Y-%m-%d %H:%M"), "load_avg": [os.getloadavg()[0]]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs: well under two minutes")
    ap.add_argument("--smoke", action="store_true", help="tiny runs of every row and target (CI; figures meaningless)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per contender (default 1 smoke, 3 quick, 5 full)")
    ap.add_argument("--only", help="only throughput scenarios whose name contains this")
    ap.add_argument("--skip-extras", action="store_true", help="throughput only (no latency/syscalls/memory)")
    ap.add_argument("--out", help="directory for results.json and PNG plots")
    args = ap.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    repeats = args.repeats or {"smoke": 1, "quick": 3, "full": 5}[mode]
    info = machine()
    out = sys.stdout
    print(f"shmq {info['shmq']} on {info['cpu']} x{info['cpus']}, Python {info['python']}, "
          f"{info['date']}; {mode} run, median of {repeats} interleaved runs\n"
          f"peers: faster-fifo {info['faster_fifo'] or 'not installed'}, pyzmq {info['pyzmq']}, "
          f"posix_ipc {info['posix_ipc']} (mqueue limits {info['mqueue_limits']}), iceoryx2 {info['iceoryx2']}; "
          f"Spool.reserve: {'yes' if info['reserve_api'] else 'not yet'}", flush=True)
    t_start = time.monotonic()
    results = run_throughput(mode, repeats, args.only, out)
    lat = sys_ = misc = imp = None
    if not args.skip_extras:
        lat = run_latency(mode, out)
        sys_ = run_syscalls(mode, out)
        misc = run_idle_and_memory(mode, out)
        imp = run_import(mode, out)
    rows = targets(results, lat, sys_, misc, imp)
    print_targets(rows, out)
    info["load_avg"].append(os.getloadavg()[0])
    print(f"\n({mode} run: {time.monotonic() - t_start:.0f} s, load average {info['load_avg'][0]:.1f} "
          f"at the start, {info['load_avg'][-1]:.1f} at the end)", file=out)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        plots = plot(results, lat, args.out)
        if lat:
            for r in lat.values():
                r["samples_us"] = r["samples_us"][:: max(1, len(r["samples_us"]) // 200)]
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"machine": info, "quick": mode != "full", "mode": mode, "repeats": repeats,
                       "throughput": results, "latency": lat, "syscalls": sys_, "misc": misc, "import": imp,
                       "targets": rows,
                       "plots": plots}, f, indent=1)
        print(f"\nwrote {args.out}/results.json" + (f" and {len(plots)} plots" if plots else ""), file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
