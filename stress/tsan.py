#!/usr/bin/env python3
"""ThreadSanitizer evidence for the engine's C11 memory ordering, through its public API.

Builds ``stress/tsan_harness/harness.c`` and the engine's C files
(``shmq/engine/*.c``, the sources libshmq is made of, each compiled
unchanged: no adapter, no Python) with ``-fsanitize=thread -O1 -g`` (and
``-DSHMQ_TRACE_COPIES``, which makes the C API's sink report its copies to
the harness: see "Classifying reports"), then,
for each iteration and scenario, creates a spool with shmq and runs the
harness on it: writers (batched puts and zero-copy reservations, committed
or abandoned, patient ones waiting on the space doorbell), named readers,
group members and, in the overwrite scenario, anonymous readers, as threads
of one process on ONE handle of the spool (``shmq_open`` once: one
mapping), driving the engine through ``shmq.h`` as any C program does.
Nothing else synchronizes them: TSan checks every access against C11
happens-before: atomics with their orders, fences, the semaphores that are
the writer and group locks, a private cursor's lock.  The harness also
checks what was read (every frame intact and CRC-verified, seq order, none
lost or duplicated), and after each run the spool is verified with
``shmq.verify`` and the readers' committed positions are checked.

Scenarios: ``block`` (fixed 64 KiB ring, block policy: 2 writers, 2 named
readers, a group of 3, readers waiting on the doorbell), ``growable`` (the
same over a growable ring: early wraps, segment allocation and punching,
trims), ``overwrite`` (2 writers lapping 2 anonymous readers: the seqlock
read path; see docs/guarantees.md for what TSan reports there and why).

    python stress/tsan.py                  # 5 iterations of every scenario
    python stress/tsan.py --quick          # the suite's mode: 1 short iteration each (~10-20 s)
    python stress/tsan.py --self-test      # weaken release stores (WEAKENINGS): TSan must report
    python stress/tsan.py -n 20 --seed 7 --ops 5000 --scenario block

Prints the number of TSan reports per run and in total; exits 1 if any run
had a report that ``lapped_reader`` does not explain or broke an invariant,
2 if the toolchain is missing and cannot be installed.

Classifying reports: the harness records what happened at each report
itself (``stress/tsan_harness/reports.h``: TSan's ``__tsan_on_report`` hook
and its report query functions, never the printed stacks) and prints one
``tsan-report`` line per report on its stdout after the joins: each access's
thread role, read or write, atomic or not, spool file offset and size, and
for a reader's read the copy attempt holding it and what the reader did with
that copy.  ``parse_events`` reads those lines and ``lapped_reader`` decides
(docs/guarantees.md, "ThreadSanitizer").  The stderr text is parsed only to
show stacks and to check that the harness recorded every report.  A
retargeted harness keeps this interface: register each thread's role before
the start barrier, log each copy from its sink (begin, dropped, returned):
this harness drives the engine through ``shmq.h``, so the sink is the C
API's own (``shmq/engine/api.c``), which calls the harness's
``eng_trace_copy_*`` functions when built with ``SHMQ_TRACE_COPIES``, and the
harness finds the spool's mapping in ``/proc/self/maps``.

Toolchain: gcc (or ``CC``) with its TSan runtime (Debian/Ubuntu: ``libtsan2``,
pulled in by ``gcc``); no Python headers.  When the runtime is missing and we
run as root with apt-get available, the script installs ``gcc libtsan2``
(``--no-install`` to refuse).  TSan maps its shadow memory at fixed
addresses and aborts ("unexpected memory mapping") on kernels with large
mmap randomization (``vm.mmap_rnd_bits`` > 28 on some): the run is then
retried under ``setarch -R`` (ASLR off for the harness only).
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# This checkout's shmq when its core is built in place (pip install -e, setup.py
# build_ext --inplace); otherwise the installed one: a source tree without a built
# core cannot be imported (.ci/aarch64 runs this from such a copy, against the
# package it built and installed from it).
if glob.glob(os.path.join(ROOT, "shmq", "_core*.so")):
    sys.path.insert(0, ROOT)

HARNESS_DIR = os.path.join(ROOT, "stress", "tsan_harness")
ENGINE_DIR = os.path.join(ROOT, "shmq", "engine")
MISSING_TOOLCHAIN = 2
# SHMQ_SEM_TIMEDWAIT: the engine waits for a contended lock with sem_timedwait, which the
# TSan runtime intercepts (gcc 12's does not intercept sem_clockwait: it would miss the
# acquire, and report the writer's stores under the lock as races).  SHMQ_TRACE_COPIES: the
# C API's sink reports each copy out of the ring to the harness (engine.h), for the classifier.
TSAN_FLAGS = ["-fsanitize=thread", "-O1", "-g", "-fno-omit-frame-pointer", "-std=gnu11", "-DSHMQ_SEM_TIMEDWAIT",
              "-DSHMQ_TRACE_COPIES"]
#: Orderings --self-test weakens, one build each, in a scratch copy of the core: with any
#: of them relaxed, TSan must report a reader's copy racing with a writer's stores.
WEAKENINGS = {
    # the commit point (write.c's commit_batch, the one commit of put, put_many and reserve):
    # readers would copy unpublished bytes
    "commit": (r"st_rel\(&c\[SHMQ_W_NEXT_SEQ\],", "st_rlx(&c[SHMQ_W_NEXT_SEQ],"),
    # a named reader's / group's consumed position (engine.h's named_commit, take.h's group_take_in):
    # the writer would overwrite bytes a reader may still be copying
    "consumed": (r"st_rel\(&s\[SHMQ_S_POS\],", "st_rlx(&s[SHMQ_S_POS],"),
}
#: Where the self-test runs: no lock-free reader there, so no report is explained and none of the
#: weakened build's races can hide behind an explained one with the same stacks (TSan reports each
#: pair of stacks once).
SELF_TEST_SCENARIO = "block"
REPORT_RE = re.compile(r"^WARNING: ThreadSanitizer: (.*?)(?: \(pid=\d+\))?$", re.M)
#: The harness's record of one TSan report (stress/tsan_harness/reports.h), on its stdout.
EVENT_RE = re.compile(r"^tsan-report (\d+) kind=(\S+) cur=(\d+) first=(\d+)((?: access=\S+)*)(?: copy=(\S+))?$", re.M)
RUN_TIMEOUT_S = 600

SCENARIOS = {
    # name: (spool kwargs, harness threads)
    "block": (dict(capacity="64KiB", on_full="block"), dict(writers=2, named=2, group=3, anon=0, waiters=1)),
    "growable": (dict(capacity="64KiB", max_capacity="256KiB", on_full="block"),
                 dict(writers=2, named=1, group=2, anon=0)),
    "overwrite": (dict(capacity="64KiB", on_full="overwrite"), dict(writers=2, named=0, group=0, anon=2)),
}


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------- toolchain

def core_sources():
    """The engine's C sources (what libshmq is built from: shmq/engine/Makefile)."""
    return sorted(os.path.join(ENGINE_DIR, f) for f in os.listdir(ENGINE_DIR) if f.endswith(".c"))


def compiler():
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang") or "cc"


def _probe(cc, workdir):
    src = os.path.join(workdir, "probe.c")
    with open(src, "w") as f:
        f.write("#include <pthread.h>\nint main(void){return 0;}\n")
    r = subprocess.run([cc, "-fsanitize=thread", src, "-o", os.path.join(workdir, "probe")],
                       capture_output=True, text=True)
    return r.returncode == 0, r.stderr.strip()


def ensure_toolchain(workdir, install=True):
    """The C compiler, if it links TSan programs; installs gcc + libtsan2 with apt if allowed."""
    cc = compiler()
    ok, err = _probe(cc, workdir) if shutil.which(cc) else (False, f"{cc}: not found")
    if ok:
        return cc
    if install and os.geteuid() == 0 and shutil.which("apt-get"):
        log(f"tsan: {cc} cannot link -fsanitize=thread ({err.splitlines()[-1] if err else '?'}); "
            "installing gcc libtsan2 with apt-get")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        cmd = ["apt-get", "install", "-y", "-q", "gcc", "libtsan2"]
        for attempt in range(10):  # another apt may hold the dpkg lock
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if r.returncode == 0:
                break
            if "Unable to locate package" in r.stderr:
                subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env)
            else:
                time.sleep(3)
        cc = compiler()
        ok, err = _probe(cc, workdir) if shutil.which(cc) else (False, "no compiler")
        if ok:
            return cc
    raise SystemExit(_missing(f"no C compiler with a ThreadSanitizer runtime ({err}); "
                              "install gcc and libtsan2 (Debian/Ubuntu) or clang with compiler-rt"))


def _missing(msg):
    print(f"tsan: SKIP: {msg}", file=sys.stderr, flush=True)
    return MISSING_TOOLCHAIN


def build(cc, workdir, weaken=None):
    """Compile the harness with the engine; `weaken`: a key of WEAKENINGS, applied to a scratch
    copy of the engine's folder (never the real one).  The engine's files are compiled
    unchanged, with nothing but their own headers: no adapter, no Python."""
    src_dir = ENGINE_DIR
    if weaken:
        pattern, repl = WEAKENINGS[weaken]
        src_dir = os.path.join(workdir, f"weak_{weaken}")
        shutil.rmtree(src_dir, ignore_errors=True)
        shutil.copytree(ENGINE_DIR, src_dir, ignore=shutil.ignore_patterns("build"))
        n = 0
        for name in sorted(os.listdir(src_dir)):
            if not name.endswith((".c", ".h")):
                continue
            f = os.path.join(src_dir, name)
            text, k = re.subn(pattern, repl, open(f).read())
            if k:
                with open(f, "w") as out:
                    out.write(text)
                log(f"tsan: self-test build '{weaken}': {k} release store(s) made relaxed in "
                    f"shmq/engine/{name} (scratch copy)")
            n += k
        if n == 0:
            raise SystemExit(f"tsan: --self-test found nothing to weaken ({pattern!r} in {ENGINE_DIR}): "
                             "update WEAKENINGS in stress/tsan.py")
    sources = [os.path.join(src_dir, os.path.basename(s)) for s in core_sources()]
    tag = f"weak_{weaken}" if weaken else "engine"
    objs, jobs = [], []
    for s in sources + [os.path.join(HARNESS_DIR, "harness.c")]:
        obj = os.path.join(workdir, f"{tag}_{os.path.splitext(os.path.basename(s))[0]}.o")
        objs.append(obj)
        jobs.append([cc, *TSAN_FLAGS, "-Wall", f"-I{src_dir}", "-c", s, "-o", obj])
    out = os.path.join(workdir, f"harness_weak_{weaken}" if weaken else "harness")
    link = [cc, *TSAN_FLAGS, *objs, "-o", out, "-pthread"]
    running = []
    for cmd in jobs + [None]:  # two compilers at a time
        while running and (cmd is None or len(running) >= 2):
            c, p = running.pop(0)
            _, err = p.communicate()
            if p.returncode != 0:
                sys.stderr.write(err)
                raise SystemExit(f"tsan: building the harness failed: {' '.join(c)}")
        if cmd is not None:
            running.append((cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                  text=True)))
    r = subprocess.run(link, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr)
        raise SystemExit(f"tsan: building the harness failed: {' '.join(link)}")
    return out


# --------------------------------------------------------------- one run

def prepare(path, spool_kw, threads):
    """Create the spool (its readers attach in the harness, through shmq.h); the harness's
    arguments and the spool's next seq."""
    import shmq

    sp = shmq.Spool.create(path, checksum=True, readers=8, **spool_kw)
    try:
        args = [f"writers={threads['writers']}", f"named={threads['named']}", f"group={threads['group']}",
                f"anon={threads['anon']}", f"waiters={threads.get('waiters', 0)}"]
        return args, sp.next_seq
    finally:
        sp.close()


def check_after(path, threads, start_seq):
    """The spool verifies clean; every named reader and the group committed the last frame."""
    import shmq
    from shmq.verify import verify

    problems = [f"verify: {p}" for p in verify(path).problems]
    with shmq.Spool.open(path) as sp:
        nxt = sp.ring.next_seq
        ours = [st for st in sp.readers() if st.name.startswith("tsan-")]
        want = threads["named"] + (1 if threads["group"] else 0)
        if len(ours) != want:
            problems.append(f"{len(ours)} tsan readers/groups in the reader table, registered {want}")
        for st in ours:
            if st.position != nxt:
                problems.append(f"{st.kind} {st.name} committed {st.position}, the spool is at {nxt}")
    return problems


def run_harness(binary, path, args, seed, ops, setarch):
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=0 exitcode=66 report_signal_unsafe=0 "
                                        "second_deadlock_stack=1 history_size=7")
    cmd = [binary, path, *args, f"seed={seed}", f"ops={ops}"]
    if setarch:
        cmd = ["setarch", platform.machine(), "-R", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)


def one_run(binary, scenario, seed, ops, state):
    """Run one scenario: (TSan reports, broken invariants, the harness's summary line)."""
    spool_kw, threads = SCENARIOS[scenario]
    d = tempfile.mkdtemp(prefix="shmq-tsan-", dir="/dev/shm")
    path = os.path.join(d, f"{scenario}-{uuid.uuid4().hex[:6]}.spool")
    import shmq
    from shmq._mapping import read_geometry

    try:
        args, start_seq = prepare(path, spool_kw, threads)
        r = run_harness(binary, path, args, seed, ops, state.get("setarch", False))
        if r.returncode != 0 and "unexpected memory mapping" in r.stderr and not state.get("setarch"):
            log("tsan: TSan cannot map its shadow memory with this ASLR (vm.mmap_rnd_bits); "
                "retrying under setarch -R")
            state["setarch"] = True
            shmq.Spool.destroy(path)
            args, start_seq = prepare(path, spool_kw, threads)
            r = run_harness(binary, path, args, seed, ops, True)
        reports = parse_reports(r.stderr)
        events = parse_events(r.stdout)
        geo = read_geometry(path)
        ring = (geo["ring_offset"], geo["ring_offset"] + geo["ring_bytes"])
        problems = [ln for ln in r.stderr.splitlines() if ln.startswith("FAIL")]
        if len(events) != len(reports):  # the hook missed some: none of them can be explained
            problems.append(f"the harness recorded {len(events)} of the {len(reports)} TSan reports "
                            "(is __tsan_on_report still called?)")
            events = []
        for i, rep in enumerate(reports):
            rep["event"] = events[i] if events else None
            rep["why"] = lapped_reader(rep["event"], ring) if events else None
            rep["ring"] = ring
        if r.returncode not in (0, 66, 1) or "harness:" not in r.stdout:
            problems.append(f"harness exited with status {r.returncode}: {r.stderr[-2000:]}")
        if not problems:
            problems += check_after(path, threads, start_seq)
        state.setdefault("logs", []).append(r.stderr)
        state.setdefault("events", []).append(r.stdout)
        summary = [ln for ln in r.stdout.splitlines() if ln.startswith("harness:")]
        return reports, problems, summary[-1] if summary else r.stdout.strip()[-500:]
    finally:
        try:
            shmq.Spool.destroy(path)
        except FileNotFoundError:
            pass
        shutil.rmtree(d, ignore_errors=True)


def parse_reports(stderr):
    """Each TSan report: its kind, the spool file offset raced on (or None) and its accesses,
    each (what, [first frames outside the TSan runtime])."""
    reports = []
    for block in stderr.split("==================")[1:]:
        head = REPORT_RE.search(block)
        if not head:
            continue
        accesses, cur = [], None
        for ln in block.splitlines():
            m = re.match(r"  (\S.*?) (?:at 0x[0-9a-f]+ )?by (?:thread T\d+|main thread)", ln)
            if m and not ln.lstrip().startswith("Thread "):
                cur = [m.group(1), []]
                accesses.append(cur)
            elif cur is not None and re.match(r"\s+#\d+ ", ln):
                if "libsanitizer" not in ln:
                    parts = ln.split()
                    cur[1].append(f"{parts[1]} ({os.path.basename(parts[2]) if len(parts) > 2 else '?'})")
            elif not ln.strip():
                cur = None
        off = re.search(r"\.spool\+0x([0-9a-f]+)\)", block)
        reports.append({"kind": head.group(1), "offset": int(off.group(1), 16) if off else None,
                        "accesses": accesses})
    return reports


def describe(rep, depth=3):
    """One line: what the harness recorded (threads, offsets, the copy), then TSan's stacks (display only)."""
    ev = rep.get("event")
    what = ""
    if ev:
        what = "; ".join(f"{'write' if a['write'] else 'read'}{' (atomic)' if a['atomic'] else ''} by "
                         f"{a['role']} {a['index']} at file offset {a['off']:#x}" for a in ev["accesses"])
        if ev["copy"]:
            c = ev["copy"]
            what += (f"; copy {c['id']} of seq {c['seq']} [{c['lo']:#x}, {c['hi']:#x}) {c['at_report']} "
                     f"at the report (first seq {ev['first_seq']}), then {c['outcome']}")
        what += " | "
    return what + " / ".join(f"{what}: {' < '.join(frames[:depth]) or '(stack not kept)'}"
                             for what, frames in rep["accesses"])


def parse_events(stdout):
    """The harness's record of each TSan report, in report order (stress/tsan_harness/reports.h):
    its kind, the index of the reporting thread's access, the spool's FIRST_SEQ as that thread
    saw it, each access (role and index of the harness thread that made it, write or read,
    atomic, spool file offset, size) and, for a reader's read, the copy attempt holding it
    (id, state when reported, final outcome, the file range [lo, hi) of the frame's header and
    payload, and the frame's seq)."""
    events = []
    for m in EVENT_RE.finditer(stdout):
        accesses = []
        for a in m.group(5).split():
            _, role, index, rw, atomic, off, size = a[len("access="):].split(":")
            accesses.append({"role": role, "index": int(index), "write": rw == "w", "atomic": atomic == "1",
                             "off": int(off), "size": int(size)})
        copy = None
        if m.group(6):
            cid, at_report, outcome, lo, hi, seq = m.group(6).split(":")
            copy = {"id": int(cid), "at_report": at_report, "outcome": outcome, "lo": int(lo), "hi": int(hi),
                    "seq": int(seq)}
        events.append({"kind": m.group(2), "cur": int(m.group(3)), "first_seq": int(m.group(4)),
                       "accesses": accesses, "copy": copy})
    return events


def lapped_reader(ev, ring):
    """Why a report is the documented race of a lapped lock-free reader, or None.

    Decided from what the harness recorded at the report (`parse_events`), never from
    stack text: a data race between two plain accesses on ring bytes (`ring`: the file
    offsets [start, end) of the ring), one a read by an anonymous (lock-free) reader, the
    other a store by a writer, where the read belongs to a copy attempt of that reader
    covering the byte, and either
      - "finished": the writer's store is the later access (it fired the report), it
        overwrote an evicted frame (the copy's seq is below the FIRST_SEQ the writer had
        stored) and the reader was already done with that copy (returned or dropped it)
        before the store: the writer lapped the reader over bytes it had finished with;
      - "read first": as "finished", but the reader had made the whole copy and not yet
        checked it when the lapping store ran: every byte of the copy was read before that
        store, so this store changed nothing the reader holds, whatever its check decides;
      - "discarded": the copy was still being made or checked when the race fired and the
        reader then dropped it as overwritten (the seqlock re-check of FIRST_POS).
    A store to a frame not yet evicted (a reader copying what a writer has not finished:
    a missing release at the commit), a copy being made at a store and then returned, a
    read outside a logged copy (a header the engine read and rejected without copying), a
    control word or slot, or any other thread or report kind is not explained
    (docs/guarantees.md, "ThreadSanitizer")."""
    if not ev or ev["kind"] != "data-race" or len(ev["accesses"]) != 2:
        return None
    acc = ev["accesses"]
    reads = [a for a in acc if not a["write"]]
    writes = [a for a in acc if a["write"]]
    if any(a["atomic"] for a in acc) or len(reads) != 1 or len(writes) != 1:
        return None
    read, write = reads[0], writes[0]
    if read["role"] != "anon" or write["role"] != "writer":
        return None
    if not all(ring[0] <= a["off"] < ring[1] for a in acc):
        return None  # control words and slots are atomics: a race there is never expected
    c = ev["copy"]
    if not c or not c["id"] or not c["lo"] <= read["off"] < c["hi"]:
        return None
    lapped = acc[ev["cur"]] is write and c["seq"] < ev["first_seq"]
    if lapped and c["at_report"] in ("accepted", "dropped"):
        return "finished"
    if lapped and c["at_report"] == "copied":
        return "read first"
    if c["at_report"] in ("copying", "copied") and c["outcome"] == "dropped":
        return "discarded"
    return None


def reader_vs_writer(rep):
    """True if the report is a reader's (any kind) plain read of ring bytes racing a writer's store."""
    ev, ring = rep.get("event"), rep["ring"]
    if not ev or ev["kind"] != "data-race":
        return False
    roles = {(a["role"], a["write"]) for a in ev["accesses"] if ring[0] <= a["off"] < ring[1] and not a["atomic"]}
    return ("writer", True) in roles and any((r, False) in roles for r in ("anon", "named", "group"))


# --------------------------------------------------------------- main

def self_test(cc, workdir, seed, ops, state, which=None):
    """TSan must report once an ordering is weakened: the harness is not vacuous, and the
    classifier does not explain the weakened race away."""
    failed = 0
    for weaken in which or list(WEAKENINGS):
        binary = build(cc, workdir, weaken=weaken)
        reports, problems, out = one_run(binary, SELF_TEST_SCENARIO, seed, ops, state)
        log(f"tsan: self-test '{weaken}': {len(reports)} report(s); {out}")
        racing = [r for r in reports if reader_vs_writer(r) and not r["why"]]
        if not racing:
            log(f"tsan: SELF-TEST FAILED: with '{weaken}' relaxed, no unexplained race between a reader's "
                "copy and a writer's stores: the harness would not catch that missing release")
            failed += 1
            continue
        log(f"tsan: self-test '{weaken}' ok: {len(racing)} unexplained report(s) of a reader's copy racing "
            f"with a writer's stores, e.g.\n    {describe(racing[0])}")
    return 1 if failed else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--iterations", type=int, default=5, help="runs of each scenario (default 5)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the first run (each run adds 1)")
    ap.add_argument("--ops", type=int, default=4000, help="operations per writer and run (default 4000)")
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                    help="scenario(s) to run (default: all)")
    ap.add_argument("--quick", action="store_true", help="1 iteration of each scenario, 600 ops per writer")
    ap.add_argument("--self-test", action="store_true",
                    help="only the self-test: builds with an ordering relaxed (WEAKENINGS) must make TSan report")
    ap.add_argument("--weaken", action="append", choices=sorted(WEAKENINGS),
                    help="with --self-test: only these weakenings (default: all)")
    ap.add_argument("--no-install", action="store_true", help="never apt-get install the TSan runtime")
    ap.add_argument("--keep", metavar="DIR", help="build in DIR and keep the binaries and logs there")
    ap.add_argument("--show", action="store_true", help="print every TSan report in full")
    a = ap.parse_args(argv)
    if a.quick:
        a.iterations, a.ops = 1, 600
    workdir = a.keep or tempfile.mkdtemp(prefix="shmq-tsan-build-")
    os.makedirs(workdir, exist_ok=True)
    state = {}
    try:
        cc = ensure_toolchain(workdir, install=not a.no_install)
        if a.self_test:
            return self_test(cc, workdir, a.seed, a.ops, state, a.weaken)
        t0 = time.monotonic()
        binary = build(cc, workdir)
        log(f"tsan: built {os.path.basename(binary)} with {cc} {' '.join(TSAN_FLAGS)} over "
            f"{', '.join(os.path.relpath(s, ROOT) for s in core_sources())} ({time.monotonic() - t0:.1f} s)")
        total, explained, failed, runs = 0, 0, 0, 0
        for scenario in a.scenario or list(SCENARIOS):
            for i in range(a.iterations):
                seed = a.seed + i
                t = time.monotonic()
                reports, problems, out = one_run(binary, scenario, seed, a.ops, state)
                runs += 1
                lapped = [r for r in reports if r["why"]]
                other = [r for r in reports if not r["why"]]
                total += len(reports)
                explained += len(lapped)
                log(f"tsan: {scenario} seed {seed}: {len(reports)} TSan report(s)"
                    + (f" ({len(lapped)} lapped lock-free reader, explained: " + ", ".join(
                        f"{sum(r['why'] == w for r in lapped)} {w}" for w in ("finished", "read first", "discarded")) + ")"
                       if lapped else "")
                    + f" in {time.monotonic() - t:.1f} s; {out}")
                for r in other:
                    log(f"  UNEXPLAINED {r['kind']}: {describe(r)}")
                if lapped and a.show:
                    for r in lapped:
                        log(f"  lapped reader ({r['why']}): {describe(r)}")
                if a.show and other:
                    log(state["logs"][-1])
                for p in problems:
                    log(f"  INVARIANT: {p}")
                if other or problems:
                    failed += 1
        log(f"tsan: {runs} run(s), {total} TSan report(s): {total - explained} unexplained, {explained} "
            f"reports of lapped lock-free readers (expected: docs/guarantees.md); {failed} failed run(s) "
            f"in {time.monotonic() - t0:.1f} s")
        return 1 if failed else 0
    finally:
        if a.keep:
            with open(os.path.join(workdir, "tsan.log"), "w") as f:
                f.write("\n".join(state.get("logs", [])))
            with open(os.path.join(workdir, "events.log"), "w") as f:
                f.write("\n".join(state.get("events", [])))
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
