#!/usr/bin/env python3
"""Fault injection: SIGKILL processes at random points, then check invariants.

Scenarios (``--scenario all`` runs them in turn):

fanout   overwrite spool; writers (killed and respawned at random) and named
         readers that verify every frame (CRC, record layout) and per-writer
         order; at the end each reader's received + lost must equal the frames
         committed, and puts must never wait much longer than the
         lock-recovery timeout (recovery times reported as p50/p99/max).
queue    shmq.Queue; producers and consumers killed at random: every put that
         returned is received at most once; in a second phase only producers
         are killed and every put that returned is received exactly once; no
         survivor hangs.
lock     a writer paused inside the critical section (a test hook) at
         different points is killed: the lock is recovered, the fencing token
         advances, and shmq.verify finds the whole ring consistent.
workqueue shmq.WorkQueue consumers killed at random while holding leases: at the
         end every message is acked exactly once (the queue's own count), none is
         lost, none acked twice.
restart  writers and named readers killed all at once mid-run, then restarted
         on the same spool: named readers resume from their persisted
         positions; no frame is delivered twice; what a reader never logged
         is at most the frame it was taking when killed, or counted as lost.
soak     a writer and a reader for --duration seconds: RSS and open file
         descriptors per process must stay flat (no leaks).
segments a growable block spool (64 KiB segments, 8 MiB ceiling) that grows in
         bursts and shrinks back (early wraps) while writers, named readers and
         group members are killed at random, writers also exactly at segment
         allocation and release: every committed frame is read by every
         named reader and once by the group, intact (CRC) and in per-writer
         order; nothing is lost; fsck is clean.

Every scenario reports kills performed, frames checked and violations; a
run that killed nothing or checked nothing fails.  ``--json`` writes the
report, ``--plot`` PNGs of throughput and RSS over time (matplotlib).

    python stress/kill9.py --quick                  # CI: all scenarios, < 2 minutes
    python stress/kill9.py --scenario fanout --duration 60 --seed 7 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
import zlib

import psutil

import shmq
from stopflag import StopFlag
from shmq import spool as _spool_mod

CTX = mp.get_context("fork")
# Every child is a daemon: if the harness itself fails, exiting kills them instead of
# waiting forever for producers that never stop.
_Process = CTX.Process


class _DaemonProcess(_Process):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("daemon", True)
        super().__init__(*args, **kwargs)


CTX.Process = _DaemonProcess
REC = struct.Struct("<IIQ")  # writer id, crc32 of the rest, counter
RECOVERY_S = 0.3


def record(wid, counter, size):
    body = counter.to_bytes(8, "little") + bytes((wid + counter + i) % 251 for i in range(size - REC.size))
    return struct.pack("<II", wid, zlib.crc32(body)) + body


def check_record(data):
    """(writer id, counter) of a well-formed record, or None if it is torn/corrupt."""
    if len(data) < REC.size:
        return None
    wid, crc = struct.unpack_from("<II", data)
    if zlib.crc32(data[8:]) != crc:
        return None
    return wid, int.from_bytes(data[8:16], "little")


def pct(xs, q):
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# --- fanout ------------------------------------------------------------------------


def _fanout_writer(path, wid, size, conn_fd):
    sp = shmq.Spool.open(path, recovery_timeout=RECOVERY_S)
    i = 0
    worst = 0.0
    waits = []
    while True:
        t = time.monotonic()
        sp.put_many([record(wid, i + k, size) for k in range(4)])  # batches: the general path
        dt = time.monotonic() - t
        i += 4
        if dt > 0.01:
            waits.append(dt)
        if dt > worst or i % 1024 == 0:
            worst = max(worst, dt)
            os.write(conn_fd, struct.pack("<Id", wid, worst))  # reported while alive


def _fanout_reader(path, name, stop, out):
    sp = shmq.Spool.open(path)
    r = sp.reader(name, verify=True)
    last = {}
    got = violations = 0
    examples = []
    while True:
        try:
            frames = r.get_many(512, timeout=0.2)
        except shmq.Empty:
            if stop.is_set() and r.lag == 0:
                break
            continue
        except shmq.SpoolFormatError as exc:  # a CRC failure: a torn or corrupt frame
            violations += 1
            examples.append(str(exc))
            r.seek(r.position + 1)
            continue
        for f in frames:
            rec = check_record(f.data)
            if rec is None:
                violations += 1
                examples.append(f"seq {f.seq}: malformed record")
                continue
            wid, c = rec
            if c <= last.get(wid, -1):
                violations += 1
                examples.append(f"seq {f.seq}: writer {wid} counter {c} after {last[wid]}")
            last[wid] = c
        got += len(frames)
    out.put({"name": name, "received": got, "lost": r.lost, "violations": violations,
             "examples": examples[:5], "position": r.position})
    sp.close()


def scenario_fanout(tmp, rng, duration, quick):
    path = os.path.join(tmp, "fanout")
    sp = shmq.Spool.create(path, capacity="256KiB", on_full="overwrite", checksum=True,
                           recovery_timeout=RECOVERY_S)
    readers = ["r0", "r1", "r2"]
    for name in readers:
        sp.reader(name).close()
    stop, out = StopFlag(CTX), CTX.Queue()
    rprocs = [CTX.Process(target=_fanout_reader, args=(path, n, stop, out)) for n in readers]
    for p in rprocs:
        p.start()
    rfd, wfd = os.pipe()
    os.set_blocking(rfd, False)
    writers, next_wid, kills, timeline = {}, 0, 0, []

    def spawn():
        nonlocal next_wid
        p = CTX.Process(target=_fanout_writer, args=(path, next_wid, rng.choice([40, 200, 1000]), wfd))
        p.start()
        writers[next_wid] = p
        next_wid += 1

    for _ in range(3):
        spawn()
    t0 = time.monotonic()
    last_seq, last_t = 0, t0
    while time.monotonic() - t0 < duration:
        time.sleep(rng.uniform(0.02, 0.15))
        wid = rng.choice(list(writers))
        os.kill(writers[wid].pid, signal.SIGKILL)
        writers.pop(wid).join(10)
        kills += 1
        spawn()
        now = time.monotonic()
        seq = sp.next_seq
        timeline.append((now - t0, (seq - last_seq) / (now - last_t), psutil.Process().memory_info().rss))
        last_seq, last_t = seq, now
    for p in writers.values():
        p.kill()
        p.join(10)
    worst_waits = {}
    try:
        while True:
            raw = os.read(rfd, 12 * 1024)
            for k in range(0, len(raw) - len(raw) % 12, 12):
                wid, w = struct.unpack_from("<Id", raw, k)
                worst_waits[wid] = max(w, worst_waits.get(wid, 0))
    except BlockingIOError:
        pass
    os.close(rfd)
    os.close(wfd)
    # The last kill may have hit a lock holder: take and release the lock, which
    # recovers it (no frame is written), so verify sees a settled spool.
    sp.writer_lock.acquire(10)
    sp.writer_lock.release()
    stop.set()
    results = [out.get(timeout=120) for _ in rprocs]
    for p in rprocs:
        p.join(30)
    committed = sp.next_seq
    st = sp.stats()
    violations, examples = 0, []
    for res in results:
        violations += res["violations"]
        examples += res["examples"]
        if res["received"] + res["lost"] != committed:
            violations += 1
            examples.append(f"{res['name']}: received {res['received']} + lost {res['lost']} "
                            f"!= committed {committed}")
    waits = sorted(worst_waits.values())
    bound = 2 * RECOVERY_S + 1.0  # two recovery periods (unknown-holder case) + scheduling
    if waits and waits[-1] > bound:
        violations += 1
        examples.append(f"a put waited {waits[-1]:.2f} s > {bound:.2f} s after a holder died")
    rep = verify_report(path)
    if not rep["ok"]:
        violations += 1
        examples += rep["problems"][:3]
    sp.close()
    return {"kills": kills, "frames_checked": sum(r["received"] for r in results),
            "frames_committed": committed, "lost_per_reader": [r["lost"] for r in results],
            "lock_breaks": st.lock_breaks, "lock_token": st.lock_token,
            "worst_put_wait_s": {"p50": pct(waits, 0.5), "p99": pct(waits, 0.99),
                                 "max": waits[-1] if waits else 0.0},
            "violations": violations, "examples": examples[:10], "timeline": timeline}


def verify_report(path):
    from shmq.verify import verify

    rep = verify(path)
    return {"ok": rep.ok, "problems": list(rep.problems)}


# --- queue ---------------------------------------------------------------------------


def _producer(path, pid_tag, logdir):
    q = shmq.Queue(path=path)
    fd = os.open(os.path.join(logdir, f"put-{pid_tag}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    i = 0
    while True:
        q.put((pid_tag, i), timeout=30)
        os.write(fd, struct.pack("<II", pid_tag, i))  # logged only after put returned
        i += 1


def _consumer(path, tag, logdir, idle, stop):
    q = shmq.Queue(path=path)
    fd = os.open(os.path.join(logdir, f"get-{tag}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    while True:
        try:
            items = q.get_many(64, timeout=idle)
        except shmq.Empty:
            if stop.is_set():
                break
            continue
        os.write(fd, b"".join(struct.pack("<II", *it) for it in items))
    os._exit(0)


def _read_log(path):
    with open(path, "rb") as f:
        raw = f.read()
    raw = raw[:len(raw) - len(raw) % 8]
    return [struct.unpack_from("<II", raw, k) for k in range(0, len(raw), 8)]


def _queue_phase(tmp, rng, duration, kill_consumers, phase):
    path = os.path.join(tmp, f"queue{phase}")
    logdir = os.path.join(tmp, f"logs{phase}")
    os.mkdir(logdir)
    shmq.Queue(path=path, capacity="1MiB", maxsize=2000).close()
    stop = StopFlag(CTX)
    prods, cons, tag, kills = {}, {}, 0, 0

    def spawn(kind):
        nonlocal tag
        tag += 1
        if kind == "p":
            p = CTX.Process(target=_producer, args=(path, tag, logdir))
            prods[tag] = p
        else:
            p = CTX.Process(target=_consumer, args=(path, tag, logdir, 0.2, stop))
            cons[tag] = p
        p.start()

    for _ in range(2):
        spawn("p")
        spawn("c")
    t0 = time.monotonic()
    while time.monotonic() - t0 < duration:
        time.sleep(rng.uniform(0.03, 0.15))
        kind = rng.choice("pc") if kill_consumers else "p"
        pool = prods if kind == "p" else cons
        victim = rng.choice(list(pool))
        os.kill(pool[victim].pid, signal.SIGKILL)
        pool.pop(victim).join(10)
        kills += 1
        spawn(kind)
    for p in prods.values():
        p.kill()
        p.join(10)
    stop.set()
    hung = 0
    for p in cons.values():
        p.join(60)
        if p.is_alive():
            hung += 1
            p.kill()
            p.join(5)
    puts, gets = set(), []
    for name in os.listdir(logdir):
        entries = _read_log(os.path.join(logdir, name))
        if name.startswith("put-"):
            puts.update(entries)
        else:
            gets.extend(entries)
    counts = {}
    for g in gets:
        counts[g] = counts.get(g, 0) + 1
    dupes = [g for g, c in counts.items() if c > 1]
    missing = [p for p in puts if p not in counts] if not kill_consumers else []
    violations = len(dupes) + len(missing) + hung
    examples = [f"received twice: {d}" for d in dupes[:3]] + [f"never received: {m}" for m in missing[:3]]
    if hung:
        examples.append(f"{hung} consumer(s) hung")
    shmq.Spool.destroy(path)
    return {"kills": kills, "puts_returned": len(puts), "received": len(gets),
            "violations": violations, "examples": examples}


def scenario_queue(tmp, rng, duration, quick):
    a = _queue_phase(tmp, rng, duration / 2, True, "a")
    b = _queue_phase(tmp, rng, duration / 2, False, "b")
    return {"kills": a["kills"] + b["kills"], "frames_checked": a["received"] + b["received"],
            "violations": a["violations"] + b["violations"], "examples": a["examples"] + b["examples"],
            "at_most_once_phase": a, "exactly_once_phase": b}


# --- lock holder killed inside the critical section -----------------------------------


def _paused_writer(path, point, ready):
    def hook(where, sp):
        if where == point:
            ready.set()
            time.sleep(600)  # killed here, inside the critical section

    _spool_mod.set_crash_hook(hook)
    sp = shmq.Spool.open(path, recovery_timeout=RECOVERY_S)
    sp.put_many([b"p" * 700, b"q" * 700, b"r" * 700])


def scenario_lock(tmp, rng, duration, quick):
    path = os.path.join(tmp, "lock")
    sp = shmq.Spool.create(path, capacity=8192, on_full="overwrite", checksum=True,
                           recovery_timeout=RECOVERY_S)
    points = ["evicting", "frame-written", "committed"]
    rounds = 6 if quick else max(6, int(duration * 3))
    kills = violations = 0
    examples, recovery = [], []
    for k in range(rounds):
        for _ in range(rng.randint(12, 20)):  # a full ring (so the batch must evict), varied offsets
            sp.put(os.urandom(rng.randint(400, 900)))
        point = points[k % len(points)]
        token = sp.stats().lock_token
        ready = CTX.Event()
        p = CTX.Process(target=_paused_writer, args=(path, point, ready))
        p.start()
        if not ready.wait(10):
            p.kill()
            violations += 1
            examples.append(f"{point}: the hook was never reached")
            continue
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        kills += 1
        t = time.monotonic()
        try:
            sp.put(b"after", timeout=10)
        except Exception as exc:
            violations += 1
            examples.append(f"{point}: put after the kill failed: {exc!r}")
            continue
        recovery.append(time.monotonic() - t)
        st = sp.stats()
        if st.lock_token != token + 1:
            violations += 1
            examples.append(f"{point}: token {token} -> {st.lock_token}")
        rep = verify_report(path)
        if not rep["ok"]:
            violations += 1
            examples += [f"{point}: {x}" for x in rep["problems"][:3]]
        r = sp.reader(start="earliest", verify=True)
        try:
            frames = r.get_many(10_000, block=False)
            if frames[-1].data != b"after":
                violations += 1
                examples.append(f"{point}: last frame is not the one put after recovery")
        except shmq.ShmqError as exc:
            violations += 1
            examples.append(f"{point}: reading the ring failed: {exc}")
        r.close()
    sp.close()
    return {"kills": kills, "frames_checked": rounds, "violations": violations, "examples": examples,
            "recovery_s": {"p50": pct(recovery, 0.5), "p99": pct(recovery, 0.99),
                           "max": max(recovery, default=0.0)}}


# --- restart ------------------------------------------------------------------------------


def _restart_writer(path, wid):
    sp = shmq.Spool.open(path)
    i = 0
    while True:
        sp.put(record(wid, i, 64), timeout=30)
        i += 1


def _restart_reader(path, name, logdir, generation):
    sp = shmq.Spool.open(path)
    r = sp.reader(name)
    fd = os.open(os.path.join(logdir, f"{name}-{generation}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(fd, struct.pack("<QQ", r.position, 1 << 63))  # where it resumed, and a marker
    while True:
        f = r.get(timeout=30)
        os.write(fd, struct.pack("<QQ", f.seq, r.lost))


def scenario_restart(tmp, rng, duration, quick):
    path = os.path.join(tmp, "restart")
    logdir = os.path.join(tmp, "restart-logs")
    os.mkdir(logdir)
    sp = shmq.Spool.create(path, capacity="512KiB", on_full="block")
    names = ["a", "b"]
    for n in names:
        sp.reader(n).close()
    generations = 3 if quick else max(3, int(duration / 3))
    kills = 0
    for gen in range(generations):
        procs = [CTX.Process(target=_restart_writer, args=(path, gen * 10 + w)) for w in range(2)]
        procs += [CTX.Process(target=_restart_reader, args=(path, n, logdir, gen)) for n in names]
        for p in procs:
            p.start()
        start = sp.next_seq
        deadline = time.monotonic() + 20
        logs = [os.path.join(logdir, f"{n}-{gen}") for n in names]
        # until the writers have put 2000 frames and every reader has resumed (its log has its
        # first record: a loaded machine may start a reader late), bounded by the deadline
        while ((sp.next_seq - start < 2000 or not all(os.path.exists(f) and os.path.getsize(f) >= 16
                                                      for f in logs))
               and time.monotonic() < deadline):
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.2))
        for p in procs:  # everything at once
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(10)
        kills += len(procs)
    violations, examples, checked = 0, [], 0
    for n in names:
        seen = {}
        for gen in range(generations):
            entries = []
            fname = os.path.join(logdir, f"{n}-{gen}")
            with open(fname, "rb") as f:
                raw = f.read()
            raw = raw[:len(raw) - len(raw) % 16]
            entries = [struct.unpack_from("<QQ", raw, k) for k in range(0, len(raw), 16)]
            resumed = entries[0][0]
            prev_last = max(seen) if seen else -1
            # the frame in flight when killed may be committed but unlogged: at most one
            if resumed > prev_last + 2:
                violations += 1
                examples.append(f"{n} gen {gen}: resumed at {resumed}, last logged {prev_last}")
            for seq, _lost in entries[1:]:
                checked += 1
                if seq in seen:
                    violations += 1
                    examples.append(f"{n}: seq {seq} delivered twice (gens {seen[seq]} and {gen})")
                seen[seq] = gen
    sp.close()
    return {"kills": kills, "generations": generations, "frames_checked": checked,
            "violations": violations, "examples": examples[:10]}


# --- work queue -----------------------------------------------------------------------------


def _wq_consumer(path, tag, logdir):
    wq = shmq.WorkQueue(path, liveness_interval=0.05)
    fd = os.open(os.path.join(logdir, f"ack-{tag}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    while True:
        try:
            msgs = wq.get_many(16, timeout=0.5, lease=5.0)
        except shmq.Empty:
            continue
        for m in msgs:
            m.ack()  # a stale ack raises LeaseLost: it is never logged
            os.write(fd, struct.pack("<Q", m.body))


def scenario_workqueue(tmp, rng, duration, quick):
    """Consumers killed at random: every message is acked exactly once, none lost."""
    path = os.path.join(tmp, "wq")
    logdir = os.path.join(tmp, "wq-logs")
    os.mkdir(logdir)
    n = 3000 if quick else int(1000 * duration)
    wq = shmq.WorkQueue(path, capacity="4MiB", max_attempts=1000, leases=256)
    procs, tag, kills = {}, 0, 0

    def spawn():
        nonlocal tag
        tag += 1
        p = CTX.Process(target=_wq_consumer, args=(path, tag, logdir))
        p.start()
        procs[tag] = p

    for _ in range(3):
        spawn()
    t0 = time.monotonic()
    put = 0
    deadline = t0 + max(duration, 5) + 60
    while time.monotonic() < deadline:
        if put < n:
            k = min(100, n - put)
            wq.put_many(list(range(put, put + k)))
            put += k
        if time.monotonic() - t0 < duration and rng.random() < 0.3:
            victim = rng.choice(list(procs))
            os.kill(procs[victim].pid, signal.SIGKILL)
            procs.pop(victim).join(10)
            kills += 1
            spawn()
        st = wq.stats()
        if put >= n and st.acked >= n and st.in_flight == 0 and st.ready == 0:
            break
        time.sleep(rng.uniform(0.01, 0.05))
    for p in procs.values():
        p.kill()
        p.join(10)
    st = wq.stats()
    acked = []
    for name in os.listdir(logdir):
        with open(os.path.join(logdir, name), "rb") as f:
            raw = f.read()
        raw = raw[:len(raw) - len(raw) % 8]
        acked += [struct.unpack_from("<Q", raw, k)[0] for k in range(0, len(raw), 8)]
    counts = {}
    for a in acked:
        counts[a] = counts.get(a, 0) + 1
    twice = [a for a, c in counts.items() if c > 1]
    # a consumer killed between ack() and its log write leaves an acked but unlogged
    # message; the queue's own counter is the authority that none was lost
    violations, examples = 0, []
    if twice:
        violations += len(twice)
        examples.append(f"acked twice: {twice[:5]}")
    if st.acked != n or st.ready or st.in_flight or st.dead:
        violations += 1
        examples.append(f"at the end: acked {st.acked} of {n}, ready {st.ready}, "
                        f"in flight {st.in_flight}, dead {st.dead}")
    unlogged = n - len(counts)
    if unlogged > kills:
        violations += 1
        examples.append(f"{unlogged} messages never logged as acked, more than the {kills} kills")
    wq.close()
    shmq.WorkQueue.destroy(path)
    return {"kills": kills, "frames_checked": n, "acked": st.acked, "redeliveries": st.redeliveries,
            "violations": violations, "examples": examples}


# --- soak ----------------------------------------------------------------------------------


def _soak_writer(path, stop):
    sp = shmq.Spool.open(path)
    while not stop.is_set():
        sp.put_many([b"s" * 200] * 32, timeout=5)
        time.sleep(0)


def _soak_reader(path, stop):
    sp = shmq.Spool.open(path)
    r = sp.reader("soak")
    while not stop.is_set():
        try:
            r.get_many(256, timeout=0.1)
        except shmq.Empty:
            pass


def _fds_but_the_waiter(pid):
    """Open fds of ``pid``, not counting one inotify instance.

    A process opens its one shared waiter (an inotify instance) the first time
    it blocks, which on a loaded host can come late in the run: that one-time
    fd is not a leak.  A second inotify instance would be, and is counted.
    """
    fds = inotify = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed between listdir and readlink
            continue
        fds += 1
        inotify += target == "anon_inode:inotify"
    return fds - min(inotify, 1)


def scenario_soak(tmp, rng, duration, quick):
    path = os.path.join(tmp, "soak")
    sp = shmq.Spool.create(path, capacity="1MiB", on_full="block")
    sp.reader("soak").close()
    stop = StopFlag(CTX)
    procs = [CTX.Process(target=_soak_writer, args=(path, stop)),
             CTX.Process(target=_soak_reader, args=(path, stop))]
    for p in procs:
        p.start()
    samples = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < duration:
        time.sleep(max(0.2, duration / 40))
        ps = [psutil.Process(p.pid) for p in procs]
        samples.append((time.monotonic() - t0, sp.next_seq, [x.memory_info().rss for x in ps],
                        [_fds_but_the_waiter(p.pid) for p in procs]))
    stop.set()
    for p in procs:
        p.join(30)
    violations, examples = 0, []
    half = samples[len(samples) // 2:]
    for k, who in enumerate(("writer", "reader")):
        rss = [s[2][k] for s in half]
        fds = [s[3][k] for s in half]
        if max(fds) != min(fds):
            violations += 1
            examples.append(f"{who}: open fds varied {min(fds)}..{max(fds)} in steady state")
        if max(rss) - min(rss) > 8 * 2**20:
            violations += 1
            examples.append(f"{who}: RSS grew {(max(rss) - min(rss)) / 2**20:.1f} MB in steady state")
    sp.close()
    return {"kills": 0, "frames_checked": samples[-1][1] if samples else 0,
            "violations": violations, "examples": examples, "samples": samples}


# --- segments (growable spool) ---------------------------------------------------------


def _seg_writer(path, wid, seed, conn_fd):
    rng = random.Random(seed)

    def hook(where, sp):  # killed exactly at segment switches, now and then
        if where in ("allocating", "releasing", "evicting", "catching-up") and rng.random() < 0.02:
            os.kill(os.getpid(), signal.SIGKILL)

    _spool_mod.set_crash_hook(hook)
    sp = shmq.Spool.open(path, recovery_timeout=RECOVERY_S)
    i = 0
    while True:
        burst = rng.choice([1, 1, 1, 8, 64, 400])  # quiet spells let the readers catch up
        for _ in range(burst):
            size = rng.choice([40, 300, 3000, 20000])
            n = rng.choice([1, 4])
            sp.put_many([record(wid, i + k, size) for k in range(n)], timeout=30)
            i += n
            os.write(conn_fd, struct.pack("<II", wid, i))  # committed up to i
        time.sleep(rng.uniform(0, 0.004))


def _seg_reader(path, name, group, stop, logdir, gen):
    sp = shmq.Spool.open(path, recovery_timeout=RECOVERY_S)
    r = sp.reader(name, group=group, verify=True)
    fd = os.open(os.path.join(logdir, f"{name}-{gen}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    while True:
        try:
            frames = r.get_many(256, timeout=0.2)
        except shmq.Empty:
            if stop.is_set():
                break
            continue
        except shmq.SpoolFormatError as exc:  # a CRC failure: a torn or corrupt frame
            os.write(fd, struct.pack("<QII", 2**64 - 1, 0, 0))
            sys.stderr.write(f"{name}: {exc}\n")
            break
        out = []
        for f in frames:
            rec = check_record(f.data)
            out.append(struct.pack("<QII", f.seq, *(rec or (2**32 - 1, 0))))
        os.write(fd, b"".join(out))
    os._exit(0)


def scenario_segments(tmp, rng, duration, quick):
    path = os.path.join(tmp, "segments")
    logdir = os.path.join(tmp, "segment-logs")
    os.mkdir(logdir)
    sp = shmq.Spool.create(path, capacity="64KiB", max_capacity="8MiB", on_full="block",
                           checksum=True, recovery_timeout=RECOVERY_S)
    named = ["n0", "n1"]
    for name in named:
        sp.reader(name).close()
    sp.reader("grp", group=True).close()
    stop = StopFlag(CTX)
    rfd, wfd = os.pipe()
    os.set_blocking(rfd, False)
    writers, readers, kills, gens = {}, {}, 0, {}
    wids = iter(range(10**6))

    def spawn_writer():
        wid = next(wids)
        p = CTX.Process(target=_seg_writer, args=(path, wid, rng.randrange(2**32), wfd))
        p.start()
        writers[wid] = p

    def spawn_reader(key):
        name, group, _member = key
        gens[key] = gens.get(key, 0) + 1
        p = CTX.Process(target=_seg_reader,
                        args=(path, name, group, stop, logdir, f"{key[2]}-{gens[key]}"))
        p.start()
        readers[key] = p

    for _ in range(2):
        spawn_writer()
    keys = [(n, False, 0) for n in named] + [("grp", True, 0), ("grp", True, 1)]
    for key in keys:
        spawn_reader(key)
    t0 = time.monotonic()
    max_alloc = 0
    while time.monotonic() - t0 < duration:
        time.sleep(rng.uniform(0.02, 0.12))
        max_alloc = max(max_alloc, sp.allocated)
        for wid, p in list(writers.items()):  # died at a crash point: replace it
            if not p.is_alive():
                p.join(1)
                writers.pop(wid)
                kills += 1
                spawn_writer()
        if rng.random() < 0.5:
            wid = rng.choice(list(writers))
            os.kill(writers[wid].pid, signal.SIGKILL)
            writers.pop(wid).join(10)
            spawn_writer()
        else:
            key = rng.choice(keys)
            try:
                os.kill(readers[key].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it already exited (a reader stops at a corrupt frame, which the check reports)
            readers.pop(key).join(10)
            spawn_reader(key)
        kills += 1
    for p in writers.values():
        p.kill()
        p.join(10)
    sp.writer_lock.acquire(10)  # recovers a lock the last kill may have left
    sp.writer_lock.release()
    committed = sp.next_seq
    stop.set()
    hung = 0
    for p in readers.values():
        p.join(120)
        if p.is_alive():
            hung += 1
            p.kill()
            p.join(5)
    violations, examples = hung, [f"{hung} reader(s) hung"] if hung else []
    # What each reader (all its generations) logged: seq, writer, counter.
    logs = {}
    for fname in os.listdir(logdir):
        name = fname.split("-")[0]
        with open(os.path.join(logdir, fname), "rb") as f:
            raw = f.read()
        recs = [struct.unpack_from("<QII", raw, k) for k in range(0, len(raw) - len(raw) % 16, 16)]
        logs.setdefault(name, []).extend(recs)
    checked = 0
    for name, recs in logs.items():
        checked += len(recs)
        bad = [r for r in recs if r[0] == 2**64 - 1 or r[1] == 2**32 - 1]
        if bad:
            violations += len(bad)
            examples.append(f"{name}: {len(bad)} torn or corrupt frame(s)")
        seqs = [r[0] for r in recs if r[0] != 2**64 - 1]
        dup = len(seqs) - len(set(seqs))
        if name == "grp" and dup:  # a member killed after taking, before logging: at most lost,
            violations += dup        # never delivered twice
            examples.append(f"grp: {dup} frame(s) delivered twice")
        if any(s >= committed for s in seqs):
            violations += 1
            examples.append(f"{name}: a frame at or past the commit point {committed} (phantom)")
    per = {r.name: r for r in sp.readers()}
    for name in named + ["grp"]:
        r = per[name]
        if r.lost or r.position != committed:
            violations += 1
            examples.append(f"{name}: position {r.position} of {committed}, lost {r.lost} "
                            "(block policy: nothing may be lost)")
    rep = verify_report(path)
    if not rep["ok"]:
        violations += 1
        examples += rep["problems"][:3]
    st = sp.stats()
    os.close(rfd)
    os.close(wfd)
    sp.close()
    return {"kills": kills, "frames_checked": checked, "frames_committed": committed,
            "growths": st.growths, "max_allocated_bytes": max_alloc,
            "violations": violations, "examples": examples[:10]}


# --- driver ----------------------------------------------------------------------------------

SCENARIOS = {"fanout": scenario_fanout, "queue": scenario_queue, "lock": scenario_lock,
             "restart": scenario_restart, "workqueue": scenario_workqueue, "soak": scenario_soak,
             "segments": scenario_segments}
QUICK_S = {"fanout": 8, "queue": 10, "lock": 3, "restart": 6, "workqueue": 6, "soak": 6,
           "segments": 8}


def plot(report, outdir):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    fan = report.get("fanout", {}).get("timeline")
    soak = report.get("soak", {}).get("samples")
    if fan or soak:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        if fan:
            axes[0].plot([t for t, _r, _m in fan], [r / 1e3 for _t, r, _m in fan])
            axes[0].set_title("fanout: commit rate with writers being killed")
            axes[0].set_xlabel("s")
            axes[0].set_ylabel("k frames/s")
        if soak:
            axes[1].plot([s[0] for s in soak], [s[2][0] / 2**20 for s in soak], label="writer RSS")
            axes[1].plot([s[0] for s in soak], [s[2][1] / 2**20 for s in soak], label="reader RSS")
            axes[1].set_title("soak: RSS over time")
            axes[1].set_xlabel("s")
            axes[1].set_ylabel("MB")
            axes[1].legend()
        fig.tight_layout()
        files.append(os.path.join(outdir, "stress.png"))
        fig.savefig(files[-1], dpi=100)
    return files


def run(names, seed, duration, quick, out=sys.stdout):
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="shmq-stress-", dir="/dev/shm")
    report = {"seed": seed, "quick": quick}
    try:
        for name in names:
            d = QUICK_S[name] if quick else (duration or 60)
            t = time.monotonic()
            res = SCENARIOS[name](tmp, rng, d, quick)
            res["seconds"] = round(time.monotonic() - t, 1)
            report[name] = res
            extra = ""
            if "worst_put_wait_s" in res:
                w = res["worst_put_wait_s"]
                extra = f", worst put wait p50 {w['p50']:.3f} p99 {w['p99']:.3f} max {w['max']:.3f} s"
            if "recovery_s" in res:
                w = res["recovery_s"]
                extra = f", lock recovery p50 {w['p50']:.3f} p99 {w['p99']:.3f} max {w['max']:.3f} s"
            print(f"{name:>8}: {res['kills']} kills, {res['frames_checked']} frames checked, "
                  f"{res['violations']} violations{extra} ({res['seconds']} s)", file=out, flush=True)
            for ex in res.get("examples", [])[:5]:
                print(f"          {ex}", file=out)
    finally:
        for name in os.listdir(tmp):
            p = os.path.join(tmp, name)
            if os.path.isfile(p):
                try:
                    shmq.Spool.destroy(p)
                except Exception:
                    os.unlink(p)
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def markdown(report, fuzz=None):
    """A table of the figures of a run (docs/guarantees.md)."""
    rows = ["| scenario | processes killed | frames checked | violations | notes |", "|---|---|---|---|---|"]
    for name in SCENARIOS:
        res = report.get(name)
        if not res:
            continue
        notes = ""
        if name == "fanout":
            w = res["worst_put_wait_s"]
            notes = (f"{res['frames_committed']} frames committed; lost per reader {res['lost_per_reader']} "
                     f"(exact); {res['lock_breaks']} lock recoveries; slowest put after a kill: "
                     f"p50 {w['p50']:.3f} s, p99 {w['p99']:.3f} s, max {w['max']:.3f} s")
        elif name == "queue":
            a, b = res["at_most_once_phase"], res["exactly_once_phase"]
            notes = (f"at most once: {a['puts_returned']} puts returned, {a['received']} received; "
                     f"exactly once: {b['puts_returned']} puts returned, {b['received']} received")
        elif name == "lock":
            w = res["recovery_s"]
            notes = (f"lock recovery (timeout 0.3 s): p50 {w['p50']:.3f} s, p99 {w['p99']:.3f} s, "
                     f"max {w['max']:.3f} s; token advanced and verify passed every time")
        elif name == "restart":
            notes = f"{res['generations']} generations killed at once and restarted"
        elif name == "workqueue":
            notes = (f"consumers killed while holding leases: all {res['acked']} messages acked "
                     f"exactly once, {res['redeliveries']} redeliveries")
        elif name == "soak":
            notes = f"{res['seconds']} s; RSS and fds flat in steady state"
        elif name == "segments":
            notes = (f"{res['frames_committed']} frames committed; {res['growths']} segments allocated, "
                     f"up to {res['max_allocated_bytes'] // 1024} KiB at once (ceiling 8 MiB); "
                     "every named reader and the group at the commit point, nothing lost, fsck clean")
        rows.append(f"| {name} | {res['kills']} | {res['frames_checked']} | {res['violations']} | {notes} |")
    if fuzz:
        o = fuzz["outcomes"]
        rows.append(f"| fuzz | - | {fuzz['cases']} damaged files | {o['violation']} | {o['ok']} read "
                    f"correctly, {o['shmq_error']} refused with a shmq error |")
    return "\n".join(rows)


def failures(report):
    bad = []
    for name, res in report.items():
        if not isinstance(res, dict):
            continue
        if res["violations"]:
            bad.append(f"{name}: {res['violations']} violations")
        if name != "soak" and not res["kills"]:
            bad.append(f"{name}: killed nothing")
        if not res["frames_checked"]:
            bad.append(f"{name}: checked nothing")
    return bad


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="all", choices=["all", *SCENARIOS])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--duration", type=float, default=None, help="seconds per scenario (full mode)")
    ap.add_argument("--quick", action="store_true", help="short runs for CI (< 2 minutes in all)")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--plot", help="directory for PNG plots")
    args = ap.parse_args(argv)
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    report = run(names, args.seed, args.duration, args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if args.plot:
        os.makedirs(args.plot, exist_ok=True)
        plot(report, args.plot)
    bad = failures(report)
    for b in bad:
        print(f"FAIL {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
