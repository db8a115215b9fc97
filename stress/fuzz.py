#!/usr/bin/env python3
"""Corrupt-file fuzzing: flip bits, overwrite and truncate spool files, then use them.

Each case starts from a template spool (wrapped frames, a named reader, a
group, a work queue's lease records), damages it at random (bit flips,
random words, zeroed runs, truncation; in the control block, the reader
table, the lease region or the ring), then opens it, reads every frame
through every kind of reader, runs ``shmq.verify`` and puts a frame.  The
only outcomes allowed are correct data or a ``shmq`` error: anything else
(an IndexError, a struct.error, a crash, a hang past --case-timeout) is a
violation.  The tests run a short hypothesis version of the same thing
(tests/test_corrupt.py); this is the long mode.

    python stress/fuzz.py --iterations 2000 --seed 3 --json fuzz.json
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback

import shmq
from shmq import _format as F


class Hang(Exception):
    pass


def template(tmp):
    path = os.path.join(tmp, "template")
    sp = shmq.Spool.create(path, capacity=8192, readers=4, leases=8, checksum=True)
    r, g = sp.reader("named"), sp.reader("grp", group=True)
    for i in range(150):
        sp.put(bytes([i % 256]) * (i % 97))
        if i % 3 == 0:
            r.get()
            g.get()
    r.close()
    g.close()
    sp.close()
    with open(path, "rb") as f:
        raw = f.read()
    shmq.Spool.destroy(path)
    return raw


def mutate(raw, rng):
    buf = bytearray(raw)
    ring_off = len(raw) - 8192
    regions = {"ctl": (128, 2048), "slots": (F.SLOT_OFFSET, F.SLOT_OFFSET + 4 * 256),
               "leases": (F.SLOT_OFFSET + 4 * 256, ring_off), "ring": (ring_off, len(raw)),
               "any": (128, len(raw))}
    what = []
    for _ in range(rng.randint(1, 8)):
        region = rng.choice(list(regions))
        lo, hi = regions[region]
        at = rng.randrange(lo, hi - 8)
        how = rng.choice(["flip", "word", "zero", "ones"])
        if how == "flip":
            buf[at] ^= 1 << rng.randrange(8)
        elif how == "word":
            buf[at:at + 8] = rng.randbytes(8)
        elif how == "zero":
            n = rng.randint(1, 64)
            buf[at:at + n] = bytes(len(buf[at:at + n]))
        else:
            buf[at:at + 8] = b"\xff" * 8
        what.append(f"{how}@{region}+{at - lo}")
    truncate = rng.random() < 0.05
    if truncate:
        buf = buf[:rng.randrange(F.HEADER_BYTES, len(buf))]
        what.append(f"truncate to {len(buf)}")
    return bytes(buf), what, truncate


def exercise(path):
    from shmq.verify import verify

    verify(path)  # must not raise anything but shmq errors either
    sp = shmq.Spool.open(path, recovery_timeout=0.05)
    try:
        sp.stats()
        for name, group in ((None, False), ("named", False), ("grp", True)):
            try:
                r = sp.reader(name, group=group)
                while True:
                    for f in r.get_many(64, block=False):
                        assert isinstance(f.data, (bytes, bytearray))  # bytearray: numpy/oob codecs
            except shmq.Empty:
                pass
        for seq in (sp.first_seq, sp.next_seq - 1):
            if seq < 0:  # nothing committed yet (NEXT_SEQ 0): no last frame to read
                continue
            try:
                sp.read_at(seq)
            except shmq.FrameLost:
                pass
        sp.put(b"after corruption", block=False)
    finally:
        sp.close()


def run(iterations, seed, case_timeout, out=sys.stdout):
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="shmq-fuzz-", dir="/dev/shm")
    outcomes = {"ok": 0, "shmq_error": 0, "violation": 0}
    examples = []
    old = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(Hang()))
    t0 = time.monotonic()
    try:
        raw = template(tmp)
        for i in range(iterations):
            data, what, truncated = mutate(raw, rng)
            path = os.path.join(tmp, f"case{i}")
            # fresh semaphores from a real create; the damaged body copied over it,
            # keeping the new file's CRC-protected geometry (and so its semaphores)
            shmq.Spool.create(path, capacity=8192, readers=4, leases=8).close()
            prefix = shmq._mapping.read_geometry(path)["sem_prefix"]
            with open(path, "r+b") as f:
                head = f.read(128)  # this case's geometry: its own semaphore names
                f.seek(0)
                f.write(head + data[128:])
                f.truncate(len(data))
            signal.setitimer(signal.ITIMER_REAL, case_timeout)
            # SIGALRM's handler runs only between bytecodes: a loop in the
            # compiled core holding the GIL would never see it.  faulthandler's
            # watchdog thread needs no GIL: it prints where we are and exits.
            faulthandler.dump_traceback_later(case_timeout + 5, exit=True)
            try:
                exercise(path)
                outcomes["ok"] += 1
            except shmq.ShmqError:
                outcomes["shmq_error"] += 1
            except Hang:
                outcomes["violation"] += 1
                examples.append(f"case {i} ({', '.join(what)}): hung > {case_timeout} s")
            except Exception:
                outcomes["violation"] += 1
                examples.append(f"case {i} ({', '.join(what)}): {traceback.format_exc(limit=3)}")
            finally:
                faulthandler.cancel_dump_traceback_later()
                signal.setitimer(signal.ITIMER_REAL, 0)
                shmq._mapping.unlink_semaphores(prefix, 4)
                os.unlink(path)
    finally:
        signal.signal(signal.SIGALRM, old)
        shutil.rmtree(tmp, ignore_errors=True)
    report = {"seed": seed, "cases": iterations, "outcomes": outcomes, "examples": examples[:10],
              "seconds": round(time.monotonic() - t0, 1)}
    print(f"fuzz: {iterations} cases: {outcomes['ok']} read fine, {outcomes['shmq_error']} refused "
          f"with a shmq error, {outcomes['violation']} violations ({report['seconds']} s)", file=out)
    for ex in examples[:5]:
        print("   ", ex, file=out)
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--case-timeout", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="200 cases")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    report = run(200 if args.quick else args.iterations, args.seed, args.case_timeout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if report["outcomes"]["violation"] else 0


if __name__ == "__main__":
    sys.exit(main())
