"""``shmq bench``: how fast a spool moves frames on this host (kvspool's kvsp-speed).

It measures a temporary spool, never an existing one (it would fill it with
junk): a put-only phase in this process, then a pipeline phase with a writer
process and a reader process.  Each phase runs ``--repeat`` times and the
median is reported, with the spread.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time

from .args import positive_arg
from .base import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_OK, CliError
from .fmt import human_bytes, human_rate, print_json

_READY, _DONE = "ready", "done"


def _put_phase(path, size, batch, seconds):
    """Frames/s put into ``path`` by this process for ``seconds`` (nothing reads)."""
    from ..spool import Spool

    payload = b"x" * size
    items = [payload] * batch
    with Spool.open(path) as sp:
        n, t0 = 0, time.perf_counter()
        end = t0 + seconds
        while True:
            for _ in range(64):  # check the clock every 64 puts, not every put
                if batch == 1:
                    sp.put(payload)
                else:
                    sp.put_many(items)
            n += 64 * batch
            now = time.perf_counter()
            if now >= end:
                return n / (now - t0)


def _writer(path, size, batch, seconds, conn):
    """The pipeline's writer process: put until told to stop, report how many."""
    from ..spool import Spool

    payload = b"x" * size
    items = [payload] * batch
    n = 0
    with Spool.open(path) as sp:
        conn.send(_READY)
        conn.recv()  # start
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(16):
                if batch == 1:
                    sp.put(payload, timeout=10)
                else:
                    sp.put_many(items, timeout=10)
            n += 16 * batch
        sp.put(b"", timeout=10)  # the end mark: the reader stops at the empty frame
    conn.send(n)
    conn.close()


def _pipeline_phase(path, size, batch, seconds, ctx):
    """Frames/s from a writer process through the spool into this process's named reader
    (block policy: nothing is lost, the reader sets the pace)."""
    from ..spool import Spool

    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_writer, args=(path, size, batch, seconds, child), daemon=True)
    with Spool.open(path) as sp:
        r = sp.reader("bench", start="latest")
        proc.start()
        try:
            if not parent.poll(60) or parent.recv() != _READY:
                raise CliError("the bench writer process did not start", EXIT_ERROR)
            got, t0 = 0, time.perf_counter()
            parent.send("start")
            done = False
            while not done:
                frames = r.get_many(1024, timeout=30)
                done = not frames[-1].data
                got += len(frames) - done
            elapsed = time.perf_counter() - t0
            if not parent.poll(30) or parent.recv() != got:
                raise CliError("the bench reader did not get every frame", EXIT_ERROR)
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
            r.close()
            sp.remove_reader("bench")
    return got / elapsed


def run_bench(size=100, batch=1, seconds=0.5, repeat=3, capacity="64MiB", checksum=False,
              directory="/dev/shm"):
    """Measure put-only and writer-to-reader throughput of a temporary spool.

    :returns: a dict of medians and spreads (frames/s, bytes/s).
    :raises shmq.TooLarge: a batch of ``batch`` frames of ``size`` bytes cannot fit.
    """
    from ..spool import Spool

    ctx = mp.get_context("fork")  # the writer needs nothing from a fresh interpreter
    tmp = tempfile.mkdtemp(prefix="shmq-bench-", dir=directory)
    path = os.path.join(tmp, "bench")
    try:
        results = {}
        for phase, policy in (("put", "overwrite"), ("pipeline", "block")):
            rates = []
            for _ in range(repeat):
                Spool.create(path, capacity=capacity, on_full=policy, checksum=checksum).close()
                try:
                    if phase == "put":
                        rates.append(_put_phase(path, size, batch, seconds))
                    else:
                        rates.append(_pipeline_phase(path, size, batch, seconds, ctx))
                finally:
                    Spool.destroy(path)
            results[phase] = {"frames_per_s": statistics.median(rates),
                              "bytes_per_s": statistics.median(rates) * size,
                              "min_frames_per_s": min(rates), "max_frames_per_s": max(rates),
                              "runs": len(rates)}
    finally:
        if os.path.exists(path):
            Spool.destroy(path)
        os.rmdir(tmp)
    return {"frame_bytes": size, "batch": batch, "seconds": seconds, "repeat": repeat,
            "capacity": capacity, "checksum": checksum, "cpus": os.cpu_count(), **results}


def cmd_bench(a) -> int:
    if not os.path.isdir(a.dir):
        raise CliError(f"{a.dir}: no such directory", EXIT_NOT_FOUND)
    res = run_bench(size=a.size, batch=a.batch, seconds=a.seconds, repeat=a.repeat,
                    capacity=a.capacity, checksum=a.checksum, directory=a.dir)
    if a.json:
        print_json(res)
        return EXIT_OK
    print(f"shmq bench: {a.size}-byte frames, batch {a.batch}, {a.repeat} x {a.seconds:g} s per "
          f"phase, {a.capacity} ring{' with CRC' if a.checksum else ''}, {res['cpus']} CPUs")
    for phase, label in (("put", "put only (1 process)"),
                         ("pipeline", "writer -> reader (2 processes, block)")):
        r = res[phase]
        print(f"  {label:<40} {human_rate(r['frames_per_s']):>7} frames/s  "
              f"{human_bytes(r['bytes_per_s'])}/s  (median; min {human_rate(r['min_frames_per_s'])},"
              f" max {human_rate(r['max_frames_per_s'])})")
    return EXIT_OK


def register(add):
    """Add ``bench`` to the ``shmq`` parser."""
    p = add("bench", "measure how fast a spool moves frames on this host",
            description="Measure a temporary spool (never an existing one): frames/s put by one "
            "process (overwrite policy, nothing reads), then frames/s from a writer process "
            "to a reader process (block policy, nothing lost).  Each phase runs --repeat times; "
            "the median is shown with min and max.  Short by default (about 3 s).")
    p.add_argument("--size", type=positive_arg(int), default=100, metavar="BYTES",
                   help="payload bytes per frame (default 100)")
    p.add_argument("--batch", type=positive_arg(int), default=1, metavar="N",
                   help="frames per put (put_many) (default 1)")
    p.add_argument("--seconds", type=positive_arg(float), default=0.5, metavar="S",
                   help="length of each run (default 0.5)")
    p.add_argument("--repeat", type=positive_arg(int), default=3, metavar="N",
                   help="runs per phase (default 3)")
    p.add_argument("--capacity", default="64MiB", help="ring size (default 64MiB)")
    p.add_argument("--checksum", action="store_true", help="CRC every payload")
    p.add_argument("--dir", default="/dev/shm", metavar="DIR",
                   help="where the temporary spool lives (default /dev/shm)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=cmd_bench)
