"""A live demo: writer and reader processes over one spool, with a running report.

``python -m shmq demo`` starts ``--writers`` processes putting 100-byte
frames as fast as they can, one fast named reader, and one deliberately
slow named reader, over an ``overwrite`` spool small enough that the slow
reader falls behind.  Every half second it prints throughput, lag and loss
from the spool's own statistics, then stops, checks what the readers saw,
and removes the spool.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import struct
import sys
import tempfile
import time

from .errors import Empty
from .spool import Spool

_REC = struct.Struct("<IQ")  # writer id, counter


def _writer(path, wid, stop):
    sp = Spool.open(path)
    pad = bytes(100 - _REC.size)
    i = 0
    while not stop.is_set():
        for _ in range(256):
            sp.put(_REC.pack(wid, i) + pad)
            i += 1
    sp.close()


def _reader(path, name, stop, delay_s, result):
    sp = Spool.open(path)
    r = sp.reader(name)
    last = {}
    got = out_of_order = 0
    while True:
        try:
            frames = r.get_many(256, timeout=0.2)
        except Empty:
            if stop.is_set():
                break
            continue
        for f in frames:
            wid, i = _REC.unpack_from(f.data)
            if i <= last.get(wid, -1):
                out_of_order += 1
            last[wid] = i
        got += len(frames)
        if delay_s:
            time.sleep(delay_s)  # the slow consumer: falls behind, counts its loss
    result.put((name, got, r.lost, out_of_order))
    r.close()
    sp.close()


def run(seconds: float = 5.0, writers: int = 2, capacity: str = "4MiB", out=sys.stdout) -> int:
    """Run the demo; return 0 if every reader saw its frames in per-writer order
    and received + lost adds up to every frame put."""
    ctx = mp.get_context("spawn" if sys.platform != "linux" else "fork")
    tmpdir = tempfile.mkdtemp(prefix="shmq-demo-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path = os.path.join(tmpdir, "demo")
    sp = Spool.create(path, capacity=capacity, on_full="overwrite")
    print(f"spool {path}: {sp.capacity // 1024} KiB ring, on_full=overwrite; "
          f"{writers} writers, readers 'fast' and 'slow' (sleeps 2 ms per 256 frames)", file=out)
    stop = ctx.Event()  # writers stop
    done = ctx.Event()  # writers have exited: readers stop once drained
    results = ctx.Queue()
    # Readers register before the writers start, so neither misses frame 0.
    for name in ("fast", "slow"):
        sp.reader(name).close()
    readers = [ctx.Process(target=_reader, args=(path, "fast", done, 0, results)),
               ctx.Process(target=_reader, args=(path, "slow", done, 0.002, results))]
    procs = readers + [ctx.Process(target=_writer, args=(path, w, stop)) for w in range(writers)]
    for p in procs:
        p.start()
    try:
        t0 = last_t = time.monotonic()
        last_puts = 0
        last_gets = {}
        while time.monotonic() - t0 < seconds:
            time.sleep(0.5)
            st = sp.stats()
            now = time.monotonic()
            dt = now - last_t
            line = [f"{now - t0:4.1f}s  put {(st.puts - last_puts) / dt / 1e6:5.2f} M/s"]
            for rs in st.readers:
                rate = (rs.gets - last_gets.get(rs.name, 0)) / dt / 1e6
                line.append(f"{rs.name}: {rate:5.2f} M/s lag {rs.lag:>7} lost {rs.lost:>9}")
                last_gets[rs.name] = rs.gets
            print("  |  ".join(line), file=out, flush=True)
            last_t, last_puts = now, st.puts
    finally:
        stop.set()
        for p in procs[len(readers):]:  # writers first: then readers drain the rest
            p.join(30)
        done.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    ok = True
    st = sp.stats()
    print(f"done: {st.puts} frames put ({st.put_bytes / 1e6:.0f} MB), "
          f"{st.evicted} overwritten in the ring", file=out)
    for _ in readers:
        try:
            name, got, lost, disorder = results.get(timeout=10)
        except Exception:
            print("a reader did not report", file=out)
            ok = False
            continue
        exact = got + lost == st.puts
        print(f"reader {name}: received {got} + lost {lost} = {got + lost} "
              f"({'exactly every frame' if exact else 'MISMATCH'}), out of order {disorder}",
              file=out)
        ok = ok and disorder == 0 and exact
    sp.close()
    Spool.destroy(path)
    os.rmdir(tmpdir)
    print("spool removed", file=out)
    return 0 if ok else 1
