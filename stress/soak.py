"""Soak: a mixed shmq load for a given time, sampling what could leak.

    python stress/soak.py --duration 1800 --out build/soak     # the long run
    python stress/soak.py --quick                              # CI: 30 s

Runs at once, under one directory on /dev/shm: a spool with a steady writer,
a killable writer and readers that join and leave (named, group and
anonymous); an anonymous ``shmq.Queue`` with a producer and a consumer plus a
process that creates and closes queues; a ``WorkQueue`` with a producer and
consumers (some nack, some dead-letter); a ``Dispatcher`` with two handler
workers and a publisher.  Every ``--kill-every`` seconds one killable
process (churning readers, the second writer, a work-queue consumer) is
SIGKILLed at random and restarted.

Every ``--sample`` seconds, for every process of the run: RSS, open file
descriptors, mappings, mapped shmq semaphores and mapped /dev/shm bytes;
and in total: those sums, the ``sem.shmq.*`` files of this run's spools and
queues, and the bytes of this run's /dev/shm files.  Writes ``soak.json``
(every sample, and per metric the growth after warm-up as % per 10 minutes:
between the medians of the first and last thirds of the samples, which a
queue's transient backlog does not move, and the least-squares slope, which
it does) and ``soak.png`` (if matplotlib is installed).
Exits 1 if a process of the load failed, if the run left files behind, or
(not with ``--quick``, too short to judge a slope) if a long-lived metric,
the semaphore files or the /dev/shm bytes grew more than ``--max-growth`` %
per 10 minutes after warm-up.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import statistics
import sys
import time

import shmq
from stopflag import StopFlag
from shmq._mapping import sem_prefix_of

ROLES_KILLABLE = ("churn", "writer2", "wq_consumer2")


# -- the load ------------------------------------------------------------------


def _writer(path, stop):
    sp = shmq.Spool.open(path)
    n = 0
    while not stop.is_set():
        sp.put_many([os.urandom(64) + n.to_bytes(8, "little")] * 16)
        n += 1
        if n % 64 == 0:
            time.sleep(0.005)  # leave the CPU to the rest of the load
    sp.close()


def _churn(path, stop, seed):
    """Readers join and leave: named, group and anonymous, with their own handles."""
    rnd = random.Random(seed)
    while not stop.is_set():
        sp = shmq.Spool.open(path)
        kind = rnd.choice(("named", "group", "anon"))
        name = f"r{rnd.randrange(8)}"
        try:
            if kind == "named":
                r = sp.reader(name, start="latest")
            elif kind == "group":
                r = sp.reader("grp", group=True)
            else:
                r = sp.reader()
            for _ in range(rnd.randrange(1, 20)):
                try:
                    r.get_many(64, timeout=0.05)
                except shmq.Empty:
                    pass
            r.close()
        except shmq.ShmqError:
            pass  # a slot held by a killed churner until the kernel drops its lock
        sp.close()


def _queue_producer(q, stop):
    n = 0
    while not stop.is_set():
        try:
            q.put(("item", n, b"z" * 200), timeout=0.2)
            n += 1
        except shmq.Full:
            pass


def _queue_consumer(q, stop):
    while not stop.is_set():
        try:
            q.get(timeout=0.2)
        except shmq.Empty:
            pass


def _queue_churn(stop):
    """Anonymous queues created, used and closed (by their creator, never killed)."""
    while not stop.is_set():
        q = shmq.Queue(capacity="64KiB")
        q.put("x")
        q.get(timeout=1)
        q.close()
        time.sleep(0.05)


def _wq_producer(path, stop):
    wq = shmq.WorkQueue(path)
    n = 0
    while not stop.is_set():
        try:
            wq.put({"n": n}, key=f"k{n % 50}" if n % 3 == 0 else None, timeout=0.2,
                   delay=0.01 if n % 7 == 0 else None)
            n += 1
        except shmq.Full:
            pass
    wq.close()


def _wq_consumer(path, stop, seed):
    rnd = random.Random(seed)
    wq = shmq.WorkQueue(path)
    while not stop.is_set():
        try:
            m = wq.get(timeout=0.2, lease=5)
        except shmq.Empty:
            continue
        if rnd.random() < 0.05:
            m.nack(error="soak failure")  # dead-lettered after max_attempts
        else:
            m.ack()
        if rnd.random() < 0.01:
            wq.replay_dead(timeout=0.5)  # a consumer replaying must not wait forever for room
        if rnd.random() < 0.01:
            wq.purge_dead()
    wq.close()


def soak_handler(ctx, body):
    return None


def _dispatcher(path, stop):
    from shmq.dispatch import Dispatcher

    d = Dispatcher(path, start_method="forkserver", capacity="4MiB", grace=2.0)
    d.register("soak", soak_handler, parallelism=2, timeout=10.0)
    d.start()
    n = 0
    while not stop.is_set():
        try:
            d.publish("soak", {"n": n})
            n += 1
        except shmq.Full:
            pass
        time.sleep(0.002)
    d.stop(grace=2.0)
    d.close()


# -- sampling ------------------------------------------------------------------


def _proc_sample(pid):
    """(rss bytes, fds, mappings, shmq semaphores mapped, /dev/shm bytes mapped) or None."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        maps = sems = shm = 0
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                maps += 1
                if "/dev/shm/" in line:
                    if "/dev/shm/sem.shmq." in line:
                        sems += 1
                    lo, hi = line.split()[0].split("-")
                    shm += int(hi, 16) - int(lo, 16)
        return rss, fds, maps, sems, shm
    except (OSError, ValueError, IndexError):
        return None


def _descendants(root):
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def _our_files(run_dir, queue_paths, seen):
    """(bytes on /dev/shm, shmq semaphore files) of this run's spools and queues; adds
    their semaphore prefixes to ``seen``."""
    nbytes, prefixes = 0, set()
    paths = [os.path.join(run_dir, n) for n in os.listdir(run_dir)] + list(queue_paths())
    for p in paths:
        try:
            st = os.lstat(p)
        except OSError:
            continue
        nbytes += st.st_blocks * 512
        prefixes.add(sem_prefix_of(st))
    seen |= prefixes
    sems = 0
    for n in os.listdir("/dev/shm"):
        if n.startswith("sem.shmq.") and n.split(".")[2] in prefixes:
            sems += 1
            try:
                nbytes += os.lstat("/dev/shm/" + n).st_blocks * 512
            except OSError:
                pass
    return nbytes, sems


def _queue_paths_of(pids):
    """Anonymous queue files (this user's) mapped by the run's processes."""
    def paths():
        found = set()
        for pid in pids():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    for line in f:
                        if shmq.queue.ANONYMOUS_PREFIX in line:
                            found.add(line.split()[-1])
            except OSError:
                continue
        return found
    return paths


def growth_per_10min(ts, ys, warmup):
    """Least-squares slope of ``ys`` after ``warmup`` s, as % of their mean per 10 minutes."""
    pts = [(t, y) for t, y in zip(ts, ys) if t >= warmup]
    if len(pts) < 3:
        return None
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    my = sum(y for _, y in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    if not var or not my:
        return 0.0
    slope = sum((t - mt) * (y - my) for t, y in pts) / var
    return 100.0 * slope * 600 / my


def median_drift_per_10min(ts, ys, warmup):
    """Change between the medians of the first and last thirds of the samples after
    ``warmup`` s, as % of the first per 10 minutes: transient spikes (a queue's
    backlog growing and draining) move a least-squares line, not a median."""
    pts = [(t, y) for t, y in zip(ts, ys) if t >= warmup]
    if len(pts) < 6:
        return None
    k = len(pts) // 3
    a, b = pts[:k], pts[-k:]
    ma = statistics.median(y for _, y in a)
    mb = statistics.median(y for _, y in b)
    dt = statistics.median(t for t, _ in b) - statistics.median(t for t, _ in a)
    if not ma or dt <= 0:
        return 0.0
    return 100.0 * (mb - ma) / ma * 600 / dt


# -- the run ---------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds (default 1800)")
    ap.add_argument("--quick", action="store_true", help="30 s, sampling every 2 s (CI)")
    ap.add_argument("--sample", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--kill-every", type=float, default=3.0, help="seconds between SIGKILLs")
    ap.add_argument("--warmup", type=float, default=None, help="seconds ignored for growth "
                    "(default: a fifth of the run, at most 300)")
    ap.add_argument("--max-growth", type=float, default=1.0,
                    help="allowed growth of each watched metric, %% per 10 minutes (default 1)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="build/soak", help="directory for soak.json, soak.png")
    a = ap.parse_args(argv)
    if a.quick:
        a.duration, a.sample, a.kill_every = 30.0, 2.0, 2.0
    warmup = a.warmup if a.warmup is not None else min(300.0, a.duration / 5)
    os.makedirs(a.out, exist_ok=True)
    rnd = random.Random(a.seed)
    ctx = mp.get_context("fork")
    run_dir = f"/dev/shm/shmq-soak-{os.getpid()}"
    os.mkdir(run_dir, 0o700)
    spool = os.path.join(run_dir, "spool")
    wqp = os.path.join(run_dir, "wq")
    disp = os.path.join(run_dir, "disp")
    shmq.Spool.create(spool, capacity="4MiB", on_full="overwrite").close()
    shmq.WorkQueue(wqp, capacity="4MiB", max_attempts=2, dead_capacity="1MiB").close()
    q = shmq.Queue(capacity="1MiB")
    stop = StopFlag(ctx)
    targets = {
        "writer": (_writer, (spool, stop)),
        "writer2": (_writer, (spool, stop)),
        "churn": (_churn, (spool, stop, a.seed)),
        "queue_producer": (_queue_producer, (q, stop)),
        "queue_consumer": (_queue_consumer, (q, stop)),
        "queue_churn": (_queue_churn, (stop,)),
        "wq_producer": (_wq_producer, (wqp, stop)),
        "wq_consumer": (_wq_consumer, (wqp, stop, a.seed + 1)),
        "wq_consumer2": (_wq_consumer, (wqp, stop, a.seed + 2)),
        "dispatcher": (_dispatcher, (disp, stop)),
    }
    procs, kills, restarts, failures = {}, 0, 0, []

    def start(role):
        fn, args = targets[role]
        if role == "churn":
            args = (spool, stop, rnd.randrange(1 << 30))
        p = ctx.Process(target=fn, args=args, name=f"soak-{role}")
        p.start()
        procs[role] = p

    for role in targets:
        start(role)
    me = os.getpid()
    pids = lambda: _descendants(me)  # noqa: E731
    queue_paths = _queue_paths_of(pids)
    samples, seen_prefixes = [], set()
    t0 = time.monotonic()
    next_sample = t0
    next_kill = t0 + a.kill_every
    try:
        while True:
            now = time.monotonic()
            if now - t0 >= a.duration:
                break
            for role, p in list(procs.items()):
                if not p.is_alive() and p.exitcode not in (0, -signal.SIGKILL):
                    failures.append(f"{role} exited with {p.exitcode}")
                    if len(failures) > 20:
                        raise SystemExit("soak: too many failures: " + "; ".join(failures[-3:]))
                    start(role)
            if now >= next_kill:
                role = rnd.choice(ROLES_KILLABLE)
                p = procs[role]
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                    kills += 1
                p.join(10)
                start(role)
                restarts += 1
                next_kill = now + a.kill_every
            if now >= next_sample:
                per = {}
                for pid in pids():
                    s = _proc_sample(pid)
                    if s is not None:
                        per[pid] = s
                shm_bytes, sem_files = _our_files(run_dir, queue_paths, seen_prefixes)
                tot = [sum(v[k] for v in per.values()) for k in range(5)]
                long_lived = [me] + [procs[r].pid for r in procs if r not in ROLES_KILLABLE]
                ll = [sum(per[p][k] for p in long_lived if p in per) for k in range(5)]
                samples.append({
                    "t": round(now - t0, 2), "processes": len(per),
                    "rss": tot[0], "fds": tot[1], "maps": tot[2], "sems_mapped": tot[3],
                    "shm_mapped": tot[4], "sem_files": sem_files, "shm_bytes": shm_bytes,
                    "long_lived": {"rss": ll[0], "fds": ll[1], "maps": ll[2], "sems_mapped": ll[3],
                                   "shm_mapped": ll[4]},
                    "per_process": {str(p): list(v) for p, v in per.items()},
                })
                next_sample = now + a.sample
            time.sleep(0.05)
    finally:
        stop.set()
        for p in procs.values():
            p.join(15)
            if p.is_alive():
                failures.append(f"{p.name} did not stop within 15 s")
                p.kill()
                p.join(5)
        q.close()
        work = {}
        try:
            with shmq.Spool.open(spool) as sp:
                work["spool_frames"] = sp.next_seq
            wq = shmq.WorkQueue.open(wqp)
            st = wq.stats()
            work.update(wq_acked=st.acked, wq_dead=st.dead, wq_redeliveries=st.redeliveries)
            wq.close()
            wq = shmq.WorkQueue.open(disp + ".soak")
            work["dispatcher_acked"] = wq.stats().acked
            wq.close()
        except Exception as exc:
            failures.append(f"reading the work done: {exc!r}")
        for path in (spool,):
            shmq.Spool.destroy(path)
        shmq.WorkQueue.destroy(wqp)
        try:
            from shmq.dispatch import Dispatcher

            Dispatcher.destroy(disp, types=("soak",))
        except Exception as exc:
            failures.append(f"Dispatcher.destroy: {exc!r}")
        leftovers = os.listdir(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        leftovers += [n for n in os.listdir("/dev/shm")
                      if n.startswith("sem.shmq.") and n.split(".")[2] in seen_prefixes]
    ts = [s["t"] for s in samples]
    metrics, slopes = {}, {}
    series = {f"long_lived.{k}": [s["long_lived"][k] for s in samples]
              for k in ("rss", "fds", "maps", "sems_mapped", "shm_mapped")}
    series.update({f"total.{k}": [s[k] for s in samples]
                   for k in ("rss", "fds", "maps", "sem_files", "shm_bytes")})
    for name, ys in series.items():
        metrics[name] = median_drift_per_10min(ts, ys, warmup)
        slopes[name] = growth_per_10min(ts, ys, warmup)
    last = samples[-1] if samples else {}
    report = {"duration_s": a.duration, "warmup_s": warmup, "sample_s": a.sample, "kills": kills,
              "restarts": restarts, "failures": failures, "work": work, "leftover_files": leftovers,
              "growth_pct_per_10min": metrics, "slope_pct_per_10min": slopes,
              "samples": samples}
    with open(os.path.join(a.out, "soak.json"), "w") as f:
        json.dump(report, f)
    _plot(samples, warmup, os.path.join(a.out, "soak.png"))
    print(f"soak: {a.duration:.0f} s, {len(samples)} samples, {kills} SIGKILLs, "
          f"{len(failures)} failures, leftover files {leftovers}; work done {work}")
    if last:
        print(f"last sample: {last['processes']} processes, RSS {last['rss'] / 2**20:.1f} MiB, "
              f"{last['fds']} fds, {last['maps']} mappings, {last['sem_files']} semaphore files, "
              f"{last['shm_bytes'] / 2**20:.1f} MiB on /dev/shm")
    bad = []
    for k, v in metrics.items():
        sl = slopes[k]
        print(f"  growth after warm-up {k}: "
              + ("n/a" if v is None else f"{v:+.3f} % per 10 min (medians)")
              + ("" if sl is None else f"; least-squares slope {sl:+.3f} %"))
        if v is not None and v > a.max_growth and k.startswith("long_lived") or (
                v is not None and v > a.max_growth and k in ("total.sem_files", "total.shm_bytes")):
            bad.append(k)
    for f_ in failures:
        print("  failure:", f_)
    if bad and a.quick:
        print("soak: (quick: too short to judge growth; not failing on)", bad)
        bad = []
    if bad:
        print("soak: growth above", a.max_growth, "% per 10 min in", bad)
    return 1 if failures or bad or leftovers else 0


def _plot(samples, warmup, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("soak: matplotlib not installed: no plot (pip install -e .[bench])")
        return
    ts = [s["t"] / 60 for s in samples]
    series = [("RSS, long-lived (MiB)", [s["long_lived"]["rss"] / 2**20 for s in samples]),
              ("RSS, all (MiB)", [s["rss"] / 2**20 for s in samples]),
              ("open fds, all", [s["fds"] for s in samples]),
              ("mappings, all", [s["maps"] for s in samples]),
              ("sem.shmq.* files", [s["sem_files"] for s in samples]),
              ("/dev/shm bytes (MiB)", [s["shm_bytes"] / 2**20 for s in samples])]
    fig, axes = plt.subplots(len(series), 1, figsize=(8, 2 * len(series)), sharex=True)
    for ax, (label, ys) in zip(axes, series):
        ax.plot(ts, ys)
        ax.axvline(warmup / 60, color="grey", linestyle=":")
        ax.set_ylabel(label, fontsize=8)
        ax.set_ylim(bottom=0)
    axes[-1].set_xlabel("minutes (dotted: end of warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"soak: plot in {path}")


if __name__ == "__main__":
    sys.exit(main())
