#!/usr/bin/env python3
"""Payload copies by distance: Spool.put against memcpy where the destination sits
``k`` bytes past the source modulo a 4 KiB page.

glibc's memcpy moves 2 KiB to L2-sized blocks with ``rep movsb`` on x86-64 CPUs
with ERMS/FSRM, which some CPUs (an AMD EPYC VM here) run 15 to 30 times slower
when (dst - src) mod 4096 is 1 to 63.  Frames sit at every offset of a ring, so
a steady stream of such payloads hits it now and then; the engine copies those
with a loop of its own (shmq/engine/copy.c).  For each distance and size this
prints the median GB/s of

  memcpy     numpy.copyto between two resident buffers at that distance
  put        Spool.put of a memoryview placed at that distance from the frame's
             payload in the ring (a 1 MiB overwrite ring with no reader: the ring
             stays in cache, as memcpy's buffers do)

and put / memcpy.  Where the CPU has no such slow case, both columns are flat.
Then a steady stream: a put and a get per frame through a 1 MiB block ring,
each source at a random 8-byte offset (the distances as a user's buffers
give them), with the mean GB/s and a frame's median and 99th percentile.

    python stress/copy_bench.py            # 4 KiB, 64 KiB, 256 KiB; 9 batches of 200
    python stress/copy_bench.py --quick    # 64 KiB only, 3 batches of 50

Reads the ring's NEXT_POS control word to place each source: a benchmark's
reach into the layout (shmq._layout), not an API.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shmq  # noqa: E402
from shmq import _layout as L  # noqa: E402
from shmq._mapping import read_geometry  # noqa: E402

DISTANCES = (0, 8, 16, 24, 32, 48, 64, 512)
PAGE = 4096


def _address(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def bench_memcpy(size: int, k: int, batches: int, per: int) -> float:
    """Median GB/s of numpy.copyto of ``size`` bytes, dst - src = k (mod 4096)."""
    src_buf = np.ones(size + 2 * PAGE, dtype=np.uint8)
    dst_buf = np.zeros(size + 2 * PAGE, dtype=np.uint8)
    d = (-_address(dst_buf)) % PAGE + PAGE  # the destination page-aligned
    s = (_address(dst_buf) + d - k - _address(src_buf)) % PAGE
    dst, src = dst_buf[d:d + size], src_buf[s:s + size]
    assert (dst.ctypes.data - src.ctypes.data) % PAGE == k
    times = []
    for _ in range(batches):
        t = time.perf_counter_ns()
        for _ in range(per):
            np.copyto(dst, src)
        times.append((time.perf_counter_ns() - t) / per)
    return size / statistics.median(times)


def bench_put(size: int, k: int, batches: int, per: int) -> float:
    """Median GB/s of Spool.put of ``size`` bytes whose payload lands k bytes past its source (mod 4096)."""
    path = os.path.join(tempfile.mkdtemp(prefix="shmq-copy-", dir="/dev/shm"), "copy.spool")
    sp = shmq.Spool.create(path, capacity="1MiB", on_full="overwrite")
    try:
        geo = read_geometry(path)
        ring_off, ring_bytes = geo["ring_offset"], geo["ring_bytes"]
        mm = sp.mapping.mm
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        ctl = np.frombuffer(mm, dtype=np.uint64, count=L.W_NEXT_POS + 1)
        need = L.FRAME_BYTES + (size + 7) // 8 * 8
        src_buf = np.ones(size + 2 * PAGE, dtype=np.uint8)
        src_addr = _address(src_buf)
        view = memoryview(src_buf)

        def source():
            off = int(ctl[L.W_NEXT_POS]) % ring_bytes
            if ring_bytes - off < need:
                off = 0  # the frame goes to the ring's start, after a pad
            dst = base + ring_off + off + L.FRAME_BYTES
            s = (dst - k - src_addr) % PAGE
            return view[s:s + size]

        for _ in range(2 * ring_bytes // need + 1):  # every page of the ring touched once
            sp.put(source())
        times = []
        for _ in range(batches):
            total = 0
            for _ in range(per):
                src = source()
                t = time.perf_counter_ns()
                sp.put(src)
                total += time.perf_counter_ns() - t
            times.append(total / per)
        del ctl
        return size / statistics.median(times)
    finally:
        sp.close()
        shmq.Spool.destroy(path)
        os.rmdir(os.path.dirname(path))


def bench_stream(size: int, frames: int, seed: int = 1) -> tuple[float, float, float]:
    """A put and a get per frame, each source at a random 8-byte offset (as a user's buffers
    are): (mean GB/s over all frames, median and 99th percentile of a frame's microseconds).
    The slow distances are rare, so they show in the mean and the tail, not the median."""
    import random
    path = os.path.join(tempfile.mkdtemp(prefix="shmq-copy-", dir="/dev/shm"), "stream.spool")
    sp = shmq.Spool.create(path, capacity="1MiB", on_full="block")
    try:
        r = sp.reader("r")
        view = memoryview(np.ones(size + 2 * PAGE, dtype=np.uint8))
        rnd = random.Random(seed)
        offsets = [8 * rnd.randrange(PAGE // 8) for _ in range(frames)]
        for o in offsets[:1000]:  # warm: every page of the ring touched
            sp.put(view[o:o + size])
            r.get()
        times = []
        for o in offsets:
            src = view[o:o + size]
            t = time.perf_counter_ns()
            sp.put(src)
            r.get()
            times.append(time.perf_counter_ns() - t)
        times.sort()
        return size * frames / sum(times), times[len(times) // 2] / 1e3, times[len(times) * 99 // 100] / 1e3
    finally:
        sp.close()
        shmq.Spool.destroy(path)
        os.rmdir(os.path.dirname(path))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 KiB only, 3 batches of 50")
    a = ap.parse_args(argv)
    sizes = (64 << 10,) if a.quick else (4 << 10, 64 << 10, 256 << 10)
    batches, per = (3, 50) if a.quick else (9, 200)
    print(f"{'size':>8} {'dst-src':>8} {'memcpy GB/s':>12} {'put GB/s':>9} {'put/memcpy':>10}")
    for size in sizes:
        for k in DISTANCES:
            m = bench_memcpy(size, k, batches, per)
            p = bench_put(size, k, batches, per)
            print(f"{size >> 10:>6}Ki {k:>8} {m:>12.1f} {p:>9.1f} {p / m:>10.2f}")
    frames = 2000 if a.quick else 20000
    print(f"\nput + get, {frames} frames from sources at random 8-byte offsets: "
          "mean GB/s, a frame's median and p99 us")
    for size in sizes:
        gbs, p50, p99 = bench_stream(size, frames)
        print(f"{size >> 10:>6}Ki {gbs:>8.1f} GB/s {p50:>8.2f} us {p99:>8.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
