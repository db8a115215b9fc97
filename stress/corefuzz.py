#!/usr/bin/env python3
"""Coverage-guided fuzzing of the compiled core's frame decoder and reader (atheris).

The compiled core (the engine ``shmq/engine/*.c`` and its binding ``shmq/core/*.c``, the sources ``pyproject.toml`` lists) reads words and frame headers that
other processes write.  This program drives ``shmq._core.Ring`` and
``shmq._core.Cursor`` over a mapping whose control words, reader/group
slot table and ring bytes all come from the fuzzer's input, and requires
that every call either succeeds or raises ``shmq.SpoolFormatError``:
no other exception, no crash, no sanitizer report, no lock left held, and
no input that takes more than ``--timeout`` seconds (libFuzzer's hang
detector).

The mapping is a heap buffer (numpy) of exactly one spool's size, with the
ring at its end: AddressSanitizer flags any read or write outside it.  The
seed corpus is made by the real API (fresh, wrapped with padding, full
under ``block``, batches, checksums, numpy/out-of-band codecs, named
readers and groups at various positions), so the fuzzer starts from valid
spools and mutates control words, slot words and ring bytes from there.
Each input also chooses the policy and checksum setting of the ring, the
slots used by a named reader and a group, a (seq, pos) for ``read`` and an
anonymous cursor, and the sizes of a ``put`` and a ``put_many``.

With clang, the core is built with ``-fsanitize=address,undefined,
fuzzer-no-link`` (edge and comparison coverage of the C code feeds
libFuzzer; atheris's ``asan_with_fuzzer.so`` is preloaded).  Without clang
it is built by gcc with ``-fsanitize=address,undefined`` and only the
harness's Python is coverage-instrumented: still a sanitized random
mutation run, but blind to the C code's branches (the report says which).

    python stress/corefuzz.py --seconds 240 --json corefuzz.json
    python stress/corefuzz.py --quick                  # CI: 20 s
    python stress/corefuzz.py --reproduce build/corefuzz/artifacts/crash-...

Needs ``pip install atheris`` (wheels for CPython 3.11 on x86-64 Linux)
and a C compiler with its ASan runtime; when either is missing it says
which and exits with status 2.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sanitize  # noqa: E402  (stress/sanitize.py: toolchain discovery and the sanitized build)

ROOT = sanitize.ROOT
OUT_DIR = os.path.join(ROOT, "build", "corefuzz")
MISSING_TOOLCHAIN = sanitize.MISSING_TOOLCHAIN

# ---- the mapping: one small spool's layout (checked against the template) ----
CAPACITY = 4096
SLOTS = 4
OPS = struct.Struct("<BBBBHHQQQQ")  # ring, mask, named slot, group slot, put size, batch, seq, pos, backlog, spare
CTL_LO, CTL_HI = 16, 32  # control words the core reads: NEXT_*/FIRST_*, holder, stats, SLOT_HWM
# Known bugs (docs/guarantees.md), kept out of the run with --skip-known so
# that it goes on looking for new ones; delete each filter with its fix.
#: Overwrite-policy puts are skipped when NEXT_POS - FIRST_POS exceeds this:
#: make_room() walks that span frame by frame and a self-repeating PAD header
#: makes the walk unbounded (tests/test_sanitize.py::test_make_room_pad_walk_is_bounded).
KNOWN_HANG_SPAN = 1 << 24
#: Inputs are skipped whose FIRST_POS or NEXT_POS (which a put turns into
#: FIRST_POS) is this close to 2**64: the reader's position wraps to 0 and
#: read_one() resyncs forever (test_reader_resync_near_position_limit_is_bounded).
KNOWN_WRAP_MARGIN = 1 << 20


# ---------------------------------------------------------------- the child

def _child(args):
    """Runs under the sanitizer's LD_PRELOAD: build seeds, then fuzz (or replay one input)."""
    import atheris
    import numpy as np
    import posix_ipc

    import shmq
    from shmq import _core, _format as F
    from shmq.errors import SpoolFormatError

    if not _core.__file__.startswith(args.build_dir):
        raise SystemExit(f"corefuzz: imported {_core.__file__}, not the fuzz build in {args.build_dir}")
    tmpl = _templates(shmq, F)
    slot_off, _, ring_off, ring_bytes, file_bytes = F.ring_geometry(CAPACITY, SLOTS, 0)
    base = tmpl[0][1]
    assert len(base) == file_bytes and ring_bytes == CAPACITY
    ring_lo, slot_lo, slot_hi = ring_off, slot_off, slot_off + SLOTS * F.SLOT_BYTES

    def encode(ops, raw):
        return ops + raw[CTL_LO * 8:CTL_HI * 8] + raw[slot_lo:slot_hi] + raw[ring_lo:]

    regions = [(CTL_LO * 8, CTL_HI * 8), (slot_lo, slot_hi), (ring_lo, file_bytes)]
    base_arr = np.frombuffer(base, dtype=np.uint8)

    if args.corpus and not os.listdir(args.corpus):
        for i, (ops, raw) in enumerate(tmpl):
            with open(os.path.join(args.corpus, f"seed-{i:02d}"), "wb") as f:
                f.write(encode(ops, raw))

    # Shared objects, made once: named semaphores (unlinked at once, so an
    # exit from libFuzzer leaves nothing behind), the buffer, the rings.
    tag = f"/shmq.fz{os.getpid()}"
    sems = {k: posix_ipc.Semaphore(f"{tag}.{k}", posix_ipc.O_CREX, 0o600, 1 if k in ("w", "g") else 0)
            for k in ("w", "r", "f", "g")}
    buf = np.zeros(file_bytes, dtype=np.uint8)  # heap: ASan catches any access outside it
    words = buf.view("<u8")
    null_fd = os.open(os.devnull, os.O_RDWR)
    try:
        rings, groups = [], []
        for policy in range(3):
            for checksum in (0, 1):
                ring = _core.Ring(buf, "corefuzz", ring_off, ring_bytes, slot_off, SLOTS, policy, checksum,
                                  f"{tag}.w", f"{tag}.r", f"{tag}.f", null_fd, 1, 0.0)
                rings.append(ring)
                groups.append([_core.Cursor(ring, 2, s, 0, 0, True, bool(s & 1), f"{tag}.g")
                               for s in range(SLOTS)])
    finally:
        for s in sems.values():
            s.unlink()

    def frames_ok(res):
        if isinstance(res, _core.Frame):
            assert isinstance(res.data, (bytes, bytearray)) and len(res.data) <= ring_bytes - F.FRAME_BYTES
            assert isinstance(res.seq, int)
        elif isinstance(res, (list, tuple)):  # get_many's list; read()'s (frame, seq, pos, lost, codec)
            for f in res:
                frames_ok(f)

    def call(fn, *a):
        try:
            res = fn(*a)
        except SpoolFormatError:
            return None
        frames_ok(res)
        return res

    def one_input(data):
        ops = OPS.unpack_from(data.ljust(OPS.size, b"\0"))
        ri, mask, nslot, gslot, put_n, batch, rseq, rpos, backlog, _ = ops
        # the input's bytes over the template: control words, slot table, ring
        # (a short input leaves the template's bytes in place past its end)
        body = np.frombuffer(data, dtype=np.uint8, offset=min(len(data), OPS.size))
        buf[:] = base_arr
        at = 0
        for lo, hi in regions:
            n = max(0, min(hi - lo, len(body) - at))
            buf[lo:lo + n] = body[at:at + n]
            at += n
        if args.skip_known and max(int(words[F.W_FIRST_POS]), int(words[F.W_NEXT_POS])) > (1 << 64) - \
                KNOWN_WRAP_MARGIN:
            return
        ring = rings[ri % len(rings)]
        policy = (ri % len(rings)) // 2
        verify = bool(mask & 0x80)
        call(ring.first_cursor)
        res = call(ring.read, rseq, rpos, verify)
        if res is not None:
            call(ring.read, res[1], res[2], not verify)  # and the frame after it
        if mask & 1:
            fc = call(ring.first_cursor)
            s, p = fc if fc else (rseq, rpos)
            anon = _core.Cursor(ring, 0, -1, s, p, True, verify, None)
            call(anon.get_many, 1 + (batch & 31))
            anon.seq, anon.pos = rseq, rpos
            call(anon.get)
        if mask & 2:
            sl = nslot % SLOTS
            sw = words[(slot_lo // 8) + sl * F.SLOT_WORDS:]
            named = _core.Cursor(ring, 1, sl, int(sw[1]), int(sw[2]), bool(mask & 0x40), verify, None)
            call(named.get)
            call(named.get_many, 1 + (batch & 15))
            call(named.commit)
            call(named.flush)
        if mask & 4:
            g = groups[ri % len(rings)][gslot % SLOTS]
            call(g.get_many, 1 + (batch & 15), 0.0)
            call(g.get, 0.0)
            call(g.flush, 0.0)
        if mask & 8:
            span = (int(words[F.W_NEXT_POS]) - int(words[F.W_FIRST_POS])) % (1 << 64)
            if not (policy == 0 and args.skip_known and span > KNOWN_HANG_SPAN):
                bl = -1 if backlog >> 63 else backlog % 256
                codec = (mask >> 4) & 7
                call(ring.put, b"p" * (put_n % (ring_bytes + 64)), codec, bl, 0.0)
                items = [b"b" * ((put_n >> (k % 8)) % 300) for k in range(1 + batch % 40)]
                call(ring.put_many, items, codec, bl, 0.0)
                call(ring.read, rseq, rpos, verify)
        if mask & 16:
            call(ring.latest, 0.0)
        # no call may leave a shared lock held
        assert sems["w"].value == 1, "writer lock left held"
        assert sems["g"].value == 1, "group lock left held"

    if args.bench:  # time the harness itself on the seeds, without libFuzzer
        seeds = [encode(o, r) for o, r in tmpl]
        t = time.perf_counter()
        for _ in range(args.bench):
            for sd in seeds:
                one_input(sd)
        print(f"{(time.perf_counter() - t) / args.bench / len(seeds) * 1e6:.0f} us per input")
        return 0
    one_input = atheris.instrument_func(one_input)

    def checked(data):
        # A violation is a Python exception, which atheris turns into a C++ throw; under
        # gcc's ASan runtime that can die in an ASan CHECK (no real __cxa_throw) before
        # anything is printed, so the traceback goes to the log first.
        try:
            one_input(data)
        except BaseException:
            import traceback
            traceback.print_exc()
            sys.stderr.flush()
            raise

    atheris.Setup([sys.argv[0], *args.libfuzzer], checked)
    atheris.Fuzz()


def _templates(shmq, F):
    """Valid spool states made by the real API: [(ops bytes, file bytes)]."""
    d = tempfile.mkdtemp(prefix="shmq-corefuzz-", dir="/dev/shm")
    out = []

    def snap(sp, ops, keep=False):
        sp.close()
        with open(sp.path, "rb") as f:
            out.append((ops, f.read()))
        if not keep:
            shmq.Spool.destroy(sp.path)

    def take(rd, n):
        try:
            rd.get_many(n, block=False)
        except shmq.Empty:
            pass

    def ops(ri, mask, nslot=0, gslot=1, put_n=100, batch=5, seq=0, pos=0, backlog=1 << 63):
        return OPS.pack(ri, mask, nslot, gslot, put_n, batch, seq, pos, backlog, 0)

    try:
        for i, (policy, checksum) in enumerate([("overwrite", False), ("overwrite", True), ("block", False),
                                                ("error", True)]):
            ri = 2 * ("overwrite", "block", "error").index(policy) + checksum
            p = os.path.join(d, f"s{i}")
            sp = shmq.Spool.create(p, capacity=CAPACITY, on_full=policy, readers=SLOTS, leases=0,
                                   checksum=checksum)
            snap(sp, ops(ri, 0x1f))  # fresh
            sp = shmq.Spool.create(p, capacity=CAPACITY, on_full=policy, readers=SLOTS, leases=0,
                                   checksum=checksum)
            r, g = sp.reader("named"), sp.reader("grp", group=True)
            nslot, gslot = r.slot, g.slot
            for k in range(200):
                try:
                    if k % 7 == 0:
                        sp.put_many([bytes([k % 256]) * (k % 13)] * 3, block=False)
                    else:
                        sp.put(bytes([k % 256]) * (k * 37 % 300), block=False)
                except shmq.Full:  # block/error: the readers make room
                    take(r, 5)
                    take(g, 3)
                if k % 3 == 0:
                    take(r, 1)
                    take(g, 1)
                if k in (40, 199):
                    seq, pos = sp.core.first_cursor()
                    r.close()
                    g.close()
                    snap(sp, ops(ri, 0xcf if checksum else 0x4f, nslot, gslot, k * 11, k % 70, seq, pos), keep=k < 199)
                    if k == 199:
                        break
                    sp = shmq.Spool.open(p)
                    r, g = sp.reader("named"), sp.reader("grp", group=True)
        # codecs that decode to bytearray (numpy, out-of-band pickle), with checksums
        p = os.path.join(d, "codecs")
        sp = shmq.Spool.create(p, capacity=CAPACITY, readers=SLOTS, leases=0, checksum=True)
        for k in range(60):
            sp.core.put(bytes(range(k % 200)), (3, 6, 0, 1)[k % 4])
        seq, pos = sp.core.first_cursor()
        snap(sp, ops(1, 0x9f, 0, 1, 300, 9, seq, pos))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


# ---------------------------------------------------------------- the driver

def find_atheris():
    try:
        import atheris
    except ImportError:
        raise sanitize.ToolchainMissing("atheris is not installed (pip install atheris)") from None
    return os.path.dirname(os.path.dirname(atheris.__file__))


def build_fuzz_core(out_dir, cc=None):
    """Build the instrumented core into out_dir: returns (LD_PRELOAD, mode)."""
    site = find_atheris()
    clang = shutil.which(cc) if cc and "clang" in cc else (shutil.which("clang") or shutil.which("clang-14"))
    if clang and os.path.exists(os.path.join(site, "asan_with_fuzzer.so")) and not (cc and "clang" not in cc):
        # atheris's runtime carries ASan, UBSan and libFuzzer, which collects
        # the C code's coverage counters when the module is loaded
        sanitize.build(out_dir, clang, ["-fsanitize=fuzzer-no-link", "-fno-sanitize-recover=undefined"])
        return os.path.join(site, "asan_with_fuzzer.so"), "native coverage (clang " \
            + subprocess.run([clang, "-dumpversion"], capture_output=True, text=True).stdout.strip() + ")"
    gcc, preload = sanitize.find_toolchain(cc or "gcc")
    sanitize.build(out_dir, gcc, ["-fno-sanitize-recover=undefined"])
    return preload, "python coverage only (no clang: the C code is sanitized, not coverage-guided)"


_STAT = re.compile(r"stat::(\w+):\s+(\d+)")


def parse_log(text):
    stats = {k: int(v) for k, v in _STAT.findall(text)}
    done = re.search(r"Done (\d+) runs in (\d+) second", text)
    crash_kinds = {
        "sanitizer": len(re.findall(r"ERROR: AddressSanitizer|runtime error:|ERROR: UndefinedBehaviorSanitizer",
                                    text)),
        "python_exception": text.count("Uncaught Python exception"),
        "timeout": text.count("ERROR: libFuzzer: timeout"),
        "deadly_signal": text.count("ERROR: libFuzzer: deadly signal"),
        "oom": text.count("ERROR: libFuzzer: out-of-memory"),
    }
    cov = re.findall(r"\bcov: (\d+)", text)
    return {"executions": int(done.group(1)) if done else stats.get("number_of_executed_units", 0),
            "edges": int(cov[-1]) if cov else None,
            "corpus_features": stats.get("new_units_added"), "peak_rss_mb": stats.get("peak_rss_mb"),
            "kinds": crash_kinds}


def run(seconds, timeout, skip_known=False, cc=None, corpus=None, reproduce=None, out_dir=None, out=sys.stdout):
    build_dir = os.path.abspath(out_dir or OUT_DIR)
    preload, mode = build_fuzz_core(build_dir, cc)
    art = os.path.join(build_dir, "artifacts") + "/"
    if not reproduce:
        shutil.rmtree(art, ignore_errors=True)  # only this run's findings count
    os.makedirs(art, exist_ok=True)
    if corpus is None:
        corpus = os.path.join(build_dir, "corpus")
        shutil.rmtree(corpus, ignore_errors=True)  # each run starts from the seeds: comparable figures
    os.makedirs(corpus, exist_ok=True)
    env = dict(os.environ, LD_PRELOAD=preload, PYTHONPATH=build_dir, PYTHONDONTWRITEBYTECODE="1",
               ASAN_OPTIONS="detect_leaks=0:print_stacktrace=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    if reproduce:
        lf = [f"-timeout={int(timeout)}", os.path.abspath(reproduce)]
        seconds = timeout
    else:
        lf = [f"-max_total_time={int(seconds)}", f"-timeout={int(timeout)}", "-rss_limit_mb=4096",
              "-print_final_stats=1", "-use_value_profile=1", f"-artifact_prefix={art}", corpus]
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--build-dir", build_dir,
           "--corpus-dir", "" if reproduce else corpus, *(["--skip-known"] if skip_known else []), "--", *lf]
    print(f"corefuzz: {mode}; LD_PRELOAD={preload}; {seconds} s, per-input timeout {timeout} s", file=out,
          flush=True)
    t0 = time.monotonic()
    log_path = os.path.join(build_dir, "fuzz.log")
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, env=env, cwd=build_dir, stdout=log, stderr=subprocess.STDOUT,
                              timeout=seconds + 120)
    elapsed = time.monotonic() - t0
    with open(log_path, errors="replace") as f:
        text = f.read()
    res = parse_log(text)
    artifacts = [] if reproduce else sorted(glob.glob(art + "*"))
    crashes = sum(v for k, v in res["kinds"].items() if k != "timeout")
    report = {"mode": mode, "seconds": round(elapsed, 1), "executions": res["executions"],
              "execs_per_s": round(res["executions"] / elapsed) if elapsed else 0,
              "edges_covered": res["edges"], "corpus_units_added": res["corpus_features"], "crashes": crashes,
              "hangs": res["kinds"]["timeout"], "sanitizer_reports": res["kinds"]["sanitizer"],
              "returncode": proc.returncode, "artifacts": artifacts, "skip_known": skip_known,
              "log": log_path}
    report["ok"] = proc.returncode == 0 and not crashes and not report["hangs"] and not artifacts
    if reproduce:
        print(text[-6000:], file=out)
    elif not report["ok"]:
        print(text[-4000:], file=out)
    print(f"corefuzz: {report['executions']} executions in {report['seconds']} s "
          f"({report['execs_per_s']}/s), {crashes} crashes, {report['hangs']} hangs, "
          f"{report['sanitizer_reports']} sanitizer reports; {'OK' if report['ok'] else 'FAILED'}",
          file=out)
    for a in artifacts:
        print(f"    artifact: {a} (replay: python stress/corefuzz.py --reproduce {a})", file=out)
    return report


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--child" in argv:
        cut = argv.index("--")
        ap = argparse.ArgumentParser()
        ap.add_argument("--child", action="store_true")
        ap.add_argument("--build-dir")
        ap.add_argument("--corpus-dir", dest="corpus")
        ap.add_argument("--skip-known", action="store_true")
        ap.add_argument("--bench", type=int, default=0)
        args = ap.parse_args(argv[:cut])
        args.libfuzzer = argv[cut + 1:]
        return _child(args)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=240)
    ap.add_argument("--quick", action="store_true", help="20 s (CI)")
    ap.add_argument("--timeout", type=float, default=5, help="seconds one input may take before it is a hang")
    ap.add_argument("--no-skip-known", dest="skip_known", action="store_false",
                    help="also run inputs that reach the two known hangs (see KNOWN_* above)")
    ap.add_argument("--cc", help="compiler: clang gives C coverage; gcc gives a sanitized, Python-guided run")
    ap.add_argument("--corpus", help="keep the corpus here (default: fresh from the seeds each run)")
    ap.add_argument("--reproduce", help="replay one input (a crash-/timeout- artifact) and print the log")
    ap.add_argument("--out", help="build directory (default build/corefuzz in the source tree)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    try:
        report = run(20 if args.quick else args.seconds, args.timeout, args.skip_known, args.cc, args.corpus,
                     args.reproduce, args.out)
    except sanitize.ToolchainMissing as e:
        print(f"corefuzz: skipped: {e}", file=sys.stderr)
        return MISSING_TOOLCHAIN
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
