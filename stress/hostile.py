#!/usr/bin/env python3
"""A hostile co-writer: flips words in a shared spool while its users keep going.

A process that can write the spool file (a group member, say) maps it and
stores hostile values (0, 1, 2**31-1, 2**32-1, 2**62, 2**63-1, 2**64-1,
the file size, twice it, random words) into control words, reader-table
words and frame headers (found by walking the ring from ``FIRST_POS``),
usually putting the old value back a moment later; every ``--epoch``
seconds the file is replaced by a fresh one (victims and the co-writer
reopen it), so damage that lasts does not mask the rest of the run.  Meanwhile the victims
run: two writers (``put``, ``put_many``), a named reader, two group members,
an anonymous reader, a process calling ``stats()``/``readers()`` and one
running ``shmq.verify``.

Every victim must stay alive (no SIGSEGV/SIGBUS: exit codes are checked),
keep responding (each call is timed against its timeout plus the lock
recovery time and a slack; a victim whose call counter stops for
``--stall`` seconds is a hang, and its stack is dumped with faulthandler),
and raise only ``shmq.ShmqError`` (anything else is counted, with its
traceback).  Exits 1 on any crash, hang or non-shmq exception.

    python stress/hostile.py --duration 300 --json hostile.json
    python stress/hostile.py --quick            # CI: 10 s
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import mmap
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback

from stopflag import StopFlag

RECOVERY_S = 0.1
OP_TIMEOUT_S = 0.2
SLACK_S = 3.0  # a loaded 2-vCPU machine: scheduling, not hangs


def _victim(role, path, stop, counter, conn, seed):
    import shmq
    from shmq.verify import verify

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rnd = random.Random(seed)
    stats = {"role": role, "ops": 0, "ok": 0, "shmq_errors": {}, "non_shmq": [], "slow": [],
             "replaced": 0}
    sp = reader = None

    def ensure():
        nonlocal sp, reader
        if sp is None:
            sp = shmq.Spool.open(path, recovery_timeout=RECOVERY_S)
        if reader is None and role in ("named", "group", "group2", "anon"):
            if role == "named":
                reader = sp.reader("named")
            elif role.startswith("group"):
                reader = sp.reader("grp", group=True)
            else:
                reader = sp.reader()

    def drop():
        nonlocal sp, reader
        for h in (reader, sp):
            try:
                if h is not None:
                    h.close()
            except Exception:
                pass
        sp = reader = None

    ino = None
    while not stop.is_set():
        if stats["ops"] % 50 == 0:  # a new epoch's file: reopen
            try:
                now_ino = os.stat(path).st_ino
            except OSError:
                now_ino = None
            if now_ino != ino:
                drop()
                ino = now_ino
        t0 = time.monotonic()
        try:
            if role == "verify":
                verify(path)
            else:
                ensure()
                if role == "writer":
                    sp.put(os.urandom(rnd.randrange(1, 200)), timeout=OP_TIMEOUT_S)
                elif role == "writer_many":
                    sp.put_many([b"m" * rnd.randrange(1, 100)] * rnd.randrange(1, 20),
                                timeout=OP_TIMEOUT_S)
                elif role == "stats":
                    sp.stats()
                    sp.readers()
                else:
                    try:
                        if rnd.random() < 0.5:
                            reader.get(timeout=OP_TIMEOUT_S)
                        else:
                            reader.get_many(50, timeout=OP_TIMEOUT_S)
                    except shmq.Empty:
                        pass
            stats["ok"] += 1
        except shmq.ShmqError as exc:
            name = type(exc).__name__
            stats["shmq_errors"][name] = stats["shmq_errors"].get(name, 0) + 1
            drop()  # reopen: a fresh handle re-reads everything
        except FileNotFoundError:
            stats["replaced"] += 1  # opened the old file as a new epoch replaced it
            drop()
        except Exception as exc:
            if len(stats["non_shmq"]) < 5:
                stats["non_shmq"].append("".join(traceback.format_exception(exc))[-2000:])
            else:
                stats["non_shmq"].append(type(exc).__name__)
            drop()
        took = time.monotonic() - t0
        if took > OP_TIMEOUT_S + RECOVERY_S + SLACK_S and len(stats["slow"]) < 20:
            stats["slow"].append(round(took, 3))
        stats["ops"] += 1
        counter.value += 1
    drop()
    conn.send(stats)


HOSTILE = [0, 1, 2**31 - 1, 2**32 - 1, 2**62, 2**63 - 1, 2**64 - 1]


def _hostile(path, stop, conn, seed, rate):
    """Map the file as a co-writer would and store hostile words, usually restoring them."""
    from shmq import _format as F

    rnd = random.Random(seed)
    flips = {"control": 0, "slot": 0, "header": 0}
    fd = mm = words = None
    n = 0
    while not stop.is_set():
        if n % 100 == 0 and (fd is None or os.stat(path).st_ino != os.fstat(fd).st_ino):
            if words is not None:  # the file was replaced (a new epoch): map the new one
                words.release()
                mm.close()
                os.close(fd)
            fd = os.open(path, os.O_RDWR)
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
            words = memoryview(mm).cast("Q")
            geo = F.unpack_geometry(bytes(mm[:F.GEOMETRY.size]), size, path)
            ring_off, ring_bytes = geo["ring_offset"], geo["ring_bytes"]
            slot_off, slots = geo["slot_offset"], geo["slot_count"]
            values = HOSTILE + [size, 2 * size]
        n += 1
        where = rnd.choice(("control", "slot", "header"))
        if where == "control":
            w = rnd.randrange(16, 512)
        elif where == "slot":
            w = (slot_off + rnd.randrange(slots) * 256) // 8 + rnd.randrange(32)
        else:  # a frame header: walk a few frames from FIRST_POS
            pos = words[F.W_FIRST_POS]
            for _ in range(rnd.randrange(0, 40)):
                off = pos % ring_bytes
                if ring_bytes - off < F.FRAME_BYTES:
                    pos += ring_bytes - off
                    continue
                stored = int.from_bytes(mm[ring_off + off + 8:ring_off + off + 12], "little")
                if not 0 < stored <= ring_bytes:
                    break
                pos += stored
            off = pos % ring_bytes
            if ring_bytes - off < F.FRAME_BYTES:
                continue
            w = (ring_off + off) // 8 + rnd.randrange(F.FRAME_BYTES // 8)
        old = words[w]
        words[w] = rnd.choice(values) if rnd.random() < 0.8 else rnd.getrandbits(64)
        flips[where] += 1
        if rate:
            time.sleep(rnd.random() * 2 / rate)
        if rnd.random() < 0.97:
            words[w] = old  # mostly a transient flip: the victims keep being exercised
    words.release()
    mm.close()
    os.close(fd)
    conn.send(flips)


old_prefixes = []


def _new_epoch(path):
    """Replace the spool at ``path`` by a fresh one (atomically); its old semaphores go
    once the run ends (handles still open on the old file keep using them)."""
    import shmq
    from shmq._mapping import sem_prefix_of

    old_prefixes.append(sem_prefix_of(os.stat(path)))
    tmp = path + ".next"
    shmq.Spool.create(tmp, capacity="256KiB", on_full="overwrite", readers=8).close()
    os.replace(tmp, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--quick", action="store_true", help="10 s (CI)")
    ap.add_argument("--rate", type=float, default=500.0, help="flips per second (about)")
    ap.add_argument("--stall", type=float, default=15.0,
                    help="a victim whose call counter stops this long is a hang")
    ap.add_argument("--epoch", type=float, default=5.0,
                    help="seconds between fresh files (lasting damage stops masking the rest)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the report here")
    a = ap.parse_args(argv)
    if a.quick:
        a.duration = 10.0
    import shmq
    from shmq._mapping import unlink_semaphores

    ctx = mp.get_context("fork")
    work = tempfile.mkdtemp(prefix="shmq-hostile-", dir="/dev/shm")
    path = os.path.join(work, "spool")
    shmq.Spool.create(path, capacity="256KiB", on_full="overwrite", readers=8).close()
    roles = ["writer", "writer_many", "named", "group", "group2", "anon", "stats", "verify"]
    stop = StopFlag(ctx)
    procs, pipes, counters = {}, {}, {}
    for i, role in enumerate(roles):
        r, w = ctx.Pipe(duplex=False)
        counters[role] = ctx.Value("Q", 0, lock=False)
        p = ctx.Process(target=_victim, args=(role, path, stop, counters[role], w, a.seed + i),
                        name=f"victim-{role}")
        p.start()
        procs[role], pipes[role] = p, r
    hr, hw = ctx.Pipe(duplex=False)
    hostile = ctx.Process(target=_hostile, args=(path, stop, hw, a.seed + 100, a.rate))
    hostile.start()
    hangs, crashes = [], []
    t0 = time.monotonic()
    last = {r: (0, t0) for r in roles}
    next_epoch, epochs = t0 + a.epoch, 1
    try:
        while time.monotonic() - t0 < a.duration:
            time.sleep(0.5)
            now = time.monotonic()
            if now >= next_epoch:  # a fresh file: damage done so far stops masking the rest
                _new_epoch(path)
                epochs += 1
                next_epoch = now + a.epoch
            for role in roles:
                p = procs[role]
                if not p.is_alive():
                    if role not in [c["role"] for c in crashes]:
                        crashes.append({"role": role, "exitcode": p.exitcode})
                    continue
                v = counters[role].value
                if v != last[role][0]:
                    last[role] = (v, now)
                elif now - last[role][1] > a.stall and role not in [h["role"] for h in hangs]:
                    hangs.append({"role": role, "stalled_s": round(now - last[role][1], 1)})
                    os.kill(p.pid, signal.SIGUSR1)  # its stack, on stderr
    finally:
        stop.set()
    results = {}
    for role in roles:
        p = procs[role]
        if pipes[role].poll(a.stall + 10):
            results[role] = pipes[role].recv()
        elif p.is_alive() and role not in [h["role"] for h in hangs]:
            hangs.append({"role": role, "stalled_s": "did not stop"})
            os.kill(p.pid, signal.SIGUSR1)
            time.sleep(0.5)
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
        if p.exitcode not in (0, None) and role not in [c["role"] for c in crashes]:
            crashes.append({"role": role, "exitcode": p.exitcode})
    flips = hr.recv() if hr.poll(10) else {}
    hostile.join(5)
    if hostile.is_alive():
        hostile.kill()
        hostile.join(5)
    shmq.Spool.destroy(path)
    for prefix in old_prefixes:
        unlink_semaphores(prefix, 8)
    shutil.rmtree(work, ignore_errors=True)
    non_shmq = sum(len(r["non_shmq"]) for r in results.values())
    slow = {r: v["slow"] for r, v in results.items() if v["slow"]}
    rep = {"duration_s": a.duration, "epochs": epochs, "flips": flips, "crashes": crashes, "hangs": hangs,
           "non_shmq_exceptions": non_shmq, "slow_calls": slow,
           "victims": {r: {k: v for k, v in res.items() if k != "slow"} for r, res in results.items()}}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
    ops = sum(r["ops"] for r in results.values())
    errs = sum(sum(r["shmq_errors"].values()) for r in results.values())
    print(f"hostile: {a.duration:.0f} s, {epochs} files, {sum(flips.values())} flips {flips}, {ops} victim calls "
          f"({errs} shmq errors), {len(crashes)} crashes, {len(hangs)} hangs, "
          f"{non_shmq} non-shmq exceptions, slow calls {slow or 'none'}")
    for role, res in results.items():
        print(f"  {role}: {res['ops']} calls, {res['ok']} ok, shmq errors {res['shmq_errors']}")
        for tb in res["non_shmq"][:2]:
            print("    NON-SHMQ:", tb[-1500:])
    for c in crashes:
        print("  CRASH:", c)
    for h in hangs:
        print("  HANG:", h)
    bad = crashes or hangs or non_shmq or len(results) != len(roles) or not sum(flips.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
