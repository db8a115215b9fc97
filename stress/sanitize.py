#!/usr/bin/env python3
"""Run the compiled core under AddressSanitizer + UndefinedBehaviorSanitizer.

Builds the compiled core (the sources ``pyproject.toml``'s
``[[tool.setuptools.ext-modules]]`` lists: the engine, ``shmq/engine/*.c``,
and its binding, ``shmq/core/*.c``) with ``-fsanitize=address,undefined
-fno-omit-frame-pointer -g`` into ``build/sanitize/`` (a package of
symlinks to the worktree's ``shmq/*.py`` beside the sanitized
``_core`` module: the normal in-place ``.so`` is never touched), then runs,
against that build, with the compiler's ASan runtime in ``LD_PRELOAD``:

1. the core's tests (``tests/test_spool.py``, ``test_corrupt.py``,
   ``test_verify.py``, ``test_regressions.py``, ``test_queue.py``,
   ``test_notify.py``, ``test_threads_signals.py``, ``test_values.py``);
2. the corrupt-file fuzz harness ``stress/fuzz.py`` (``--quick``: 200
   damaged spools opened, read through every kind of reader, verified and
   written to).

Every process (pytest's workers, spawned and forked children, subprocesses)
inherits the sanitizer environment and writes any report to its own file
under ``build/sanitize/logs/``.  The run fails if a step fails or if any
report was written.  ``ASAN_OPTIONS=detect_leaks=0`` because CPython keeps
interned objects alive at exit by design (LeakSanitizer would report them).

    python stress/sanitize.py              # both steps (a few minutes)
    python stress/sanitize.py --quick      # CI: test_corrupt, test_regressions, test_values + 60 fuzz cases
    python stress/sanitize.py --build-only # just the sanitized build; prints its environment

Needs a C compiler (gcc or clang; ``CC`` picks one) with its ASan/UBSan
runtime (gcc: the ``libasan``/``libubsan`` packages its ``libgcc-dev``
depends on; clang: ``libclang-rt-dev``) and the Python headers.  When one
is missing the program says which and exits with status 2 (the test that
runs it skips on that status).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# test_notify / test_threads_signals: waits in C, closes under parked threads, signals
CORE_TESTS = ["test_spool.py", "test_corrupt.py", "test_verify.py", "test_regressions.py", "test_queue.py",
              "test_notify.py", "test_threads_signals.py", "test_values.py"]
# test_values: the values codec's decoder fed forged, damaged and random payloads
QUICK_TESTS = ["test_corrupt.py", "test_regressions.py", "test_values.py"]
TESTS_TIMEOUT_S = 1200  # the core tests take about 90 s under the sanitizers here


def _text(b):
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
SAN_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g", "-O1"]
#: Exit status when the toolchain is missing (not a failure of the code).
MISSING_TOOLCHAIN = 2


class ToolchainMissing(Exception):
    """No usable compiler, sanitizer runtime or Python headers."""


def _run_quiet(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolchainMissing(f"cannot run {cmd[0]}: {e}") from None


def _junit_counts(path):
    import xml.etree.ElementTree as ET

    try:
        suite = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {"tests": 0, "failures": 0, "errors": 1, "skipped": 0}
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def find_toolchain(cc=None, runtime="asan"):
    """Return ``(cc, preload)``: a compiler and the ASan runtime its objects need first.

    :raises ToolchainMissing: with a message saying what to install.
    """
    candidates = [cc] if cc else [os.environ.get("CC")] if os.environ.get("CC") else ["gcc", "clang",
                                                                                    "clang-14"]
    problems = []
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise ToolchainMissing(f"no Python.h under {include}: install the Python development headers "
                               "(e.g. apt-get install python3-dev)")
    for c in candidates:
        path = shutil.which(c)
        if not path:
            problems.append(f"{c}: not found")
            continue
        out = _run_quiet([path, "--version"]).stdout
        name = "libclang_rt.asan-x86_64.so" if "clang" in out else "libasan.so"
        lib = _run_quiet([path, f"-print-file-name={name}"]).stdout.strip()
        # the compiler echoes the bare name back when it has no such runtime
        if not lib or not os.path.isabs(lib) or not os.path.exists(lib):
            problems.append(f"{c}: no {name} (install libasan/libubsan for gcc, libclang-rt-dev for clang)")
            continue
        return path, os.path.realpath(lib)
    raise ToolchainMissing("no C compiler with an AddressSanitizer runtime: " + "; ".join(problems))


def core_sources(root=ROOT):
    """``(sources, include_dirs)`` of ``shmq._core``, absolute, as ``pyproject.toml`` builds it."""
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        exts = tomllib.load(f)["tool"]["setuptools"]["ext-modules"]
    (core,) = [e for e in exts if e["name"] == "shmq._core"]
    return ([os.path.join(root, p) for p in core["sources"]],
            [os.path.join(root, p) for p in core.get("include-dirs", [])])


def build(out_dir, cc, extra_flags=(), sources=None):
    """Compile the core with the sanitizers into ``out_dir/shmq`` beside symlinks to the Python modules.

    ``sources``: the C files (default: :func:`core_sources`, with its include dirs).

    ``out_dir`` is emptied first (so a module removed from ``shmq/`` is not
    imported from a stale link).  Returns the path of the built module.

    :raises subprocess.CalledProcessError: the compiler failed.
    """
    pkg = os.path.join(out_dir, "shmq")
    shutil.rmtree(pkg, ignore_errors=True)
    os.makedirs(pkg)
    for py in glob.glob(os.path.join(ROOT, "shmq", "*.py")):
        os.symlink(py, os.path.join(pkg, os.path.basename(py)))
    # The subpackages too: an editable install's finder would supply them, but an
    # installed build (.ci/aarch64's) has none pointing here
    for init in glob.glob(os.path.join(ROOT, "shmq", "*", "__init__.py")):
        sub = os.path.dirname(init)
        os.symlink(sub, os.path.join(pkg, os.path.basename(sub)))
    target = os.path.join(pkg, "_core" + sysconfig.get_config_var("EXT_SUFFIX"))
    srcs, incs = core_sources() if sources is None else (list(sources), [])
    cmd = [cc, "-shared", "-fPIC", "-std=gnu11", "-Wall", *SAN_FLAGS, *extra_flags,
           "-I" + sysconfig.get_paths()["include"], *("-I" + d for d in incs), *srcs, "-o", target]
    subprocess.run(cmd, check=True)
    return target


def sanitizer_env(out_dir, preload, log_dir):
    """The environment that runs Python against the sanitized build and logs every report."""
    env = dict(os.environ)
    env["LD_PRELOAD"] = preload  # the ASan runtime must be the first library loaded
    env["ASAN_OPTIONS"] = f"detect_leaks=0:log_path={log_dir}/asan:print_stacktrace=1"
    env["UBSAN_OPTIONS"] = f"print_stacktrace=1:log_path={log_dir}/ubsan"
    env["PYTHONPATH"] = out_dir
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("SHMQ_TEST_SESSION", None)  # a nested test run gets its own /dev/shm tag (tests/conftest.py)
    return env


def check_build(out_dir, env):
    """Prove that ``import shmq`` picks the sanitized module and that ASan is loaded."""
    probe = ("import shmq, shmq._core as c; "
             "print(c.__file__); "
             "print(any('libasan' in l or 'clang_rt.asan' in l for l in open('/proc/self/maps')))")
    res = subprocess.run([sys.executable, "-c", probe], env=env, cwd=out_dir, capture_output=True,
                         text=True, timeout=120)
    lines = res.stdout.split()
    if res.returncode != 0 or len(lines) != 2 or not lines[0].startswith(out_dir) or lines[1] != "True":
        raise RuntimeError(f"the sanitized build is not the one imported: {res.stdout!r} {res.stderr[-2000:]}")
    return lines[0]


_SELF_TEST_C = r"""
#include <stdlib.h>
int overflow(int i) { volatile char *p = malloc(8); int v = p[i]; free((void *)p); return v; }
int shift(int i) { return 1 << i; }
"""


def self_test(cc, env, work_dir):
    """Prove the pipeline reports: a heap overflow and an undefined shift must each leave a report.

    :raises RuntimeError: a sanitizer stayed silent (the run's "0 reports" would mean nothing).
    """
    src = os.path.join(work_dir, "selftest.c")
    lib = os.path.join(work_dir, "selftest.so")
    with open(src, "w") as f:
        f.write(_SELF_TEST_C)
    subprocess.run([cc, "-shared", "-fPIC", *SAN_FLAGS, src, "-o", lib], check=True)
    logs = os.path.join(work_dir, "selftest-logs")
    shutil.rmtree(logs, ignore_errors=True)
    os.makedirs(logs)
    env = dict(env, ASAN_OPTIONS=f"detect_leaks=0:log_path={logs}/asan",
               UBSAN_OPTIONS=f"print_stacktrace=1:log_path={logs}/ubsan")
    for call, word in (("shift(40)", "runtime error"), ("overflow(8)", "heap-buffer-overflow")):
        before = set(reports(logs))
        res = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({lib!r}).{call}"], env=env,
                             capture_output=True, text=True, timeout=120)
        new = [t for p, t in reports(logs).items() if p not in before] + scan(res.stdout + res.stderr)
        if not any(word in t for t in new):
            raise RuntimeError(f"sanitizer self-test: {call} left no '{word}' report")


_REPORT = re.compile(r"^.*(?:runtime error:|ERROR: AddressSanitizer|ERROR: LeakSanitizer|"
                     r"SUMMARY: UndefinedBehaviorSanitizer).*$", re.M)


def scan(text):
    """Sanitizer reports printed on a captured stream (with a few lines after each)."""
    return [text[m.start():m.start() + 1500] for m in _REPORT.finditer(text)]


def reports(log_dir):
    """Sanitizer report files written so far: {path: first lines}."""
    found = {}
    for p in sorted(glob.glob(os.path.join(log_dir, "*"))):
        with open(p, errors="replace") as f:
            found[p] = f.read(4000)
    return found


def run(quick=False, cc=None, fuzz_cases=None, out_dir=None, out=sys.stdout):
    cc, preload = find_toolchain(cc)
    out_dir = os.path.abspath(out_dir or os.path.join(ROOT, "build", "sanitize"))
    log_dir = os.path.join(out_dir, "logs")
    shutil.rmtree(log_dir, ignore_errors=True)
    os.makedirs(log_dir)
    t0 = time.monotonic()
    module = build(out_dir, cc)
    env = sanitizer_env(out_dir, preload, log_dir)
    check_build(out_dir, env)
    self_test(cc, env, out_dir)
    print(f"sanitize: {os.path.basename(cc)} {' '.join(SAN_FLAGS)} -> {os.path.relpath(module, ROOT)}; "
          f"LD_PRELOAD={preload}; "
          "self-test: a heap overflow and an undefined shift were both reported", file=out, flush=True)
    steps = {}
    tests = [os.path.join(ROOT, "tests", t) for t in (QUICK_TESTS if quick else CORE_TESTS)]
    t = time.monotonic()
    # cwd is the build directory: "python -m" puts the cwd first on sys.path,
    # which must be the sanitized package, never the worktree's own.
    junit = os.path.join(out_dir, "tests.xml")
    # -s: every process's stderr reaches this pipe, where UBSan reports are
    # looked for (gcc's libubsan ignores log_path when ASan is loaded)
    # Bounded: a test hung under the sanitizers dumps its tracebacks (faulthandler)
    # and the run reports FAILED with them instead of waiting forever (a rare,
    # unreproduced hang in a parked Reader.get has been seen here).
    if os.path.exists(junit):
        os.remove(junit)  # a run killed at the timeout writes none: never count an old one
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=120",
           f"--junitxml={junit}", *tests]
    try:
        res = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        res = subprocess.CompletedProcess(cmd, -1, _text(e.stdout) + f"\ntimed out after {TESTS_TIMEOUT_S} s",
                                          _text(e.stderr))
    printed = scan(res.stdout + res.stderr)
    tail = (res.stdout.strip().splitlines() or [""])[-1]
    counts = _junit_counts(junit)
    # The suite's /dev/shm leak check (conftest) can blame another test run
    # on this machine for a semaphore it had not yet removed: a sanitizer
    # run fails on failed tests and on sanitizer reports; leaks are the
    # normal suite's business, so a leak-only exit status is shown, not fatal.
    leak_only = res.returncode == 1 and counts["failures"] == counts["errors"] == 0 and "tests left" in res.stdout
    steps["tests"] = {"files": [os.path.basename(x) for x in tests], **counts,
                      "returncode": 0 if leak_only else res.returncode, "result": tail,
                      "seconds": round(time.monotonic() - t, 1)}
    print(f"  tests ({', '.join(steps['tests']['files'])}): {tail}", file=out, flush=True)
    if leak_only:
        left = [ln for ln in res.stdout.splitlines() if "tests left" in ln]
        print(f"  (not fatal here, see the comment above: {left[0] if left else 'leak check'})", file=out)
    elif res.returncode != 0:
        print(res.stdout[-6000:], res.stderr[-3000:], file=out)
    cases = fuzz_cases or (60 if quick else 200)
    t = time.monotonic()
    res = subprocess.run([sys.executable, os.path.join(ROOT, "stress", "fuzz.py"), "--iterations", str(cases),
                          "--seed", "5"], env=env, cwd=out_dir, capture_output=True, text=True)
    printed += scan(res.stdout + res.stderr)
    line = (res.stdout.strip().splitlines() or [""])[0]
    steps["fuzz"] = {"cases": cases, "returncode": res.returncode, "result": line,
                     "seconds": round(time.monotonic() - t, 1)}
    print(f"  {line}", file=out, flush=True)
    if res.returncode != 0:
        print(res.stdout[-3000:], res.stderr[-3000:], file=out)
    found = list(reports(log_dir).values()) + printed
    for text in found[:5]:
        print(f"  sanitizer report:\n{text}", file=out)
    ok = not found and all(s["returncode"] == 0 for s in steps.values())
    report = {"compiler": cc, "flags": SAN_FLAGS, "preload": preload, "quick": quick, "steps": steps,
              "sanitizer_reports": len(found), "seconds": round(time.monotonic() - t0, 1), "ok": ok}
    print(f"sanitize: {len(found)} sanitizer reports, "
          f"{'OK' if ok else 'FAILED'} ({report['seconds']} s)", file=out)
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two test files and 60 fuzz cases (CI)")
    ap.add_argument("--cc", help="compiler (default: $CC, else gcc, else clang)")
    ap.add_argument("--fuzz-cases", type=int, help="cases for stress/fuzz.py (default 200; quick 60)")
    ap.add_argument("--out", help="build directory (default build/sanitize in the source tree)")
    ap.add_argument("--build-only", action="store_true", help="build, check, print the environment to use")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    try:
        if args.build_only:
            cc, preload = find_toolchain(args.cc)
            out_dir = os.path.abspath(args.out or os.path.join(ROOT, "build", "sanitize"))
            os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
            build(out_dir, cc)
            env = sanitizer_env(out_dir, preload, os.path.join(out_dir, "logs"))
            print(check_build(out_dir, env))
            for k in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS", "PYTHONPATH"):
                print(f"{k}={env[k]}")
            return 0
        report = run(args.quick, args.cc, args.fuzz_cases, args.out)
    except ToolchainMissing as e:
        print(f"sanitize: skipped: {e}", file=sys.stderr)
        return MISSING_TOOLCHAIN
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
