#!/usr/bin/env python3
"""Flip every control word and every reader-slot word through hostile values.

Each case copies a template spool (wrapped frames, a named reader, a group,
a pinned-free slot table), stores one hostile value in one u64 word of the
header page (geometry and control words) or of the reader table, then runs
the victims on it: ``Spool.open``, ``stats()``, ``put``, an anonymous
reader's ``get`` and ``get_many``, the named reader's ``get``, the group's
``get_many`` (a group take) and ``shmq.verify``.  Each must succeed or raise
a ``shmq.ShmqError``; anything else is a violation: another exception, a
crash (the cases run in a child process, so a SIGSEGV/SIGBUS is seen and
the run goes on after the case), or a hang past ``--case-timeout``.

    python stress/flipwords.py                      # the full sweep (~5600 cases)
    python stress/flipwords.py --sample 300 --seed 1  # a random subset (the tests)

Prints a summary and writes ``--json`` (outcome counts, violations with
tracebacks).  Exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HEADER_WORDS = 512
SLOT_WORDS = 32
SLOTS = 4


def hostile_values(file_size):
    return [0, 1, 2**31 - 1, 2**32 - 1, 2**62, 2**63 - 1, 2**64 - 1, file_size, 2 * file_size]


def make_template(path):
    import shmq

    sp = shmq.Spool.create(path, capacity=8192, readers=SLOTS, leases=0, on_full="overwrite")
    r, g = sp.reader("named"), sp.reader("grp", group=True)
    for i in range(150):
        sp.put(bytes([i % 256]) * (i % 97))
        if i % 3 == 0:
            r.get(timeout=0)
            g.get(timeout=0)
    r.close()
    g.close()
    sp.close()


def all_cases(file_size, slot_offset):
    cases = []
    for v in hostile_values(file_size):
        for w in range(HEADER_WORDS):
            cases.append(("header", w, v, w * 8))
        for s in range(SLOTS):
            for w in range(SLOT_WORDS):
                cases.append((f"slot{s}", w, v, slot_offset + s * 256 + w * 8))
    return cases


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang("case took too long")


def run_victims(path, shmq):
    """Every victim on the damaged file at ``path``: {victim: outcome}."""
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "ok"
        except shmq.ShmqError as exc:
            out[name] = "shmq:" + type(exc).__name__
        except Hang:
            raise
        except Exception as exc:
            out[name] = "VIOLATION:" + "".join(traceback.format_exception(exc))[-1500:]

    sp = None

    def do_open():
        nonlocal sp
        sp = shmq.Spool.open(path, recovery_timeout=0.05)

    attempt("open", do_open)
    if sp is not None:
        try:
            attempt("stats", lambda: (sp.stats(), sp.readers()))
            attempt("put", lambda: sp.put(b"y" * 10, timeout=0))

            def anon():
                r = sp.reader()
                try:
                    try:
                        r.get(timeout=0)
                    except shmq.Empty:
                        pass
                    try:
                        r.get_many(20, timeout=0)
                    except shmq.Empty:
                        pass
                finally:
                    r.close()

            def named():
                r = sp.reader("named")
                try:
                    r.get_many(20, timeout=0)
                except shmq.Empty:
                    pass
                finally:
                    r.close()

            def group():
                g = sp.reader("grp", group=True)
                try:
                    g.get_many(20, timeout=0)
                    g.get(timeout=0)
                except shmq.Empty:
                    pass
                finally:
                    g.close()

            attempt("get", anon)
            attempt("named", named)
            attempt("group", group)
        finally:
            try:
                sp.close()
            except shmq.ShmqError:
                pass
    from shmq.verify import verify

    attempt("verify", lambda: verify(path))
    return out


def child(args):
    """Run the cases listed on stdin (one JSON per line); print one line per case."""
    import faulthandler

    import shmq
    from shmq._mapping import sem_prefix_of, unlink_semaphores

    faulthandler.enable(sys.stderr)
    signal.signal(signal.SIGALRM, _alarm)
    template, work = args.template, args.workdir
    data = open(template, "rb").read()
    for line in sys.stdin:
        region, w, v, off = json.loads(line)
        print(json.dumps({"start": [region, w, v]}), flush=True)
        path = os.path.join(work, "case")
        buf = bytearray(data)
        if off + 8 <= len(buf):
            buf[off:off + 8] = (v & (2**64 - 1)).to_bytes(8, "little")
        with open(path, "wb") as f:
            f.write(buf)
        os.chmod(path, 0o600)
        signal.setitimer(signal.ITIMER_REAL, args.case_timeout)
        try:
            out = run_victims(path, shmq)
        except Hang:
            out = {"case": "VIOLATION:hang past --case-timeout"}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        prefix = sem_prefix_of(os.stat(path))
        try:
            shmq.Spool.destroy(path)
        except Exception:
            pass
        if os.path.lexists(path):
            os.unlink(path)
        unlink_semaphores(prefix, SLOTS)  # whatever destroy could not read
        print(json.dumps({"done": [region, w, v], "out": out}), flush=True)


def sweep(cases, case_timeout, workdir, template):
    """Run ``cases`` in child processes, restarting after a crash; return results."""
    results, violations = {}, []
    todo = list(cases)
    while todo:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", "--template", template, "--workdir", workdir,
             "--case-timeout", str(case_timeout)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        feed = "".join(json.dumps(c) + "\n" for c in todo)
        try:
            out, err = proc.communicate(feed, timeout=case_timeout * 10 * len(todo) + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += "\n(the child hung past every case's bound)"
        started, done = None, 0
        for line in out.splitlines():
            rec = json.loads(line)
            if "start" in rec:
                started = tuple(rec["start"])
            else:
                key = tuple(rec["done"])
                results[key] = rec["out"]
                for victim, o in rec["out"].items():
                    if o.startswith("VIOLATION"):
                        violations.append({"case": list(key), "victim": victim, "what": o})
                done += 1
                started = None
        todo = todo[done:]
        if proc.returncode != 0:
            if started is None:  # died between cases
                violations.append({"case": None, "victim": "child", "what":
                                   f"child exited {proc.returncode}: {err[-2000:]}"})
                break
            violations.append({"case": list(started), "victim": "crash", "what":
                               f"child died with {proc.returncode}: {err[-3000:]}"})
            results[started] = {"case": "crash"}
            todo = todo[1:]
        elif todo:
            violations.append({"case": None, "victim": "child", "what": "stopped early"})
            break
    return results, violations


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sample", type=int, default=0, help="run this many random cases (0: all)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--case-timeout", type=float, default=10.0)
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--template", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a)
        return 0
    import shmq

    t0 = time.monotonic()
    work = tempfile.mkdtemp(prefix="shmq-flip-", dir="/dev/shm")
    try:
        template = os.path.join(work, "template")
        make_template(template)
        size = os.path.getsize(template)
        geo = shmq.Spool.open(template)
        slot_offset = geo.geometry["slot_offset"]
        geo.close()
        cases = all_cases(size, slot_offset)
        if a.sample:
            cases = random.Random(a.seed).sample(cases, min(a.sample, len(cases)))
        results, violations = sweep(cases, a.case_timeout, work, template)
        shmq.Spool.destroy(template)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    counts = {}
    for out in results.values():
        for victim, o in out.items():
            kind = "ok" if o == "ok" else ("shmq_error" if o.startswith("shmq:") else "violation")
            counts[kind] = counts.get(kind, 0) + 1
    rep = {"cases": len(cases), "ran": len(results), "outcomes": counts, "violations": violations,
           "seconds": round(time.monotonic() - t0, 1)}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
    print(f"flipwords: {len(results)}/{len(cases)} cases, outcomes {counts}, "
          f"{len(violations)} violations, {rep['seconds']} s")
    for v in violations[:20]:
        print(f"  {v['case']} {v['victim']}: {v['what'][-600:]}")
    return 1 if violations or len(results) != len(cases) else 0


if __name__ == "__main__":
    sys.exit(main())
