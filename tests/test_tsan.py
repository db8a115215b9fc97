"""ThreadSanitizer over the engine, through shmq.h (stress/tsan.py; docs/guarantees.md,
"ThreadSanitizer").

Writers, named readers, group members and reservations run as threads of one C
process on one spool handle, driving the engine through its public API (no
interpreter, no stand-in); TSan must report nothing outside the documented
seqlock reports of lapped anonymous readers, and must report once the self-test
relaxes a release store of the engine (so the first check is not vacuous).
Skipped, with the reason, where no compiler with a TSan runtime can be found or
installed (the script exits 2 then).
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "stress", "tsan.py")
MISSING_TOOLCHAIN = 2


def _run(*args, timeout=300):
    r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode == MISSING_TOOLCHAIN:
        pytest.skip(f"no ThreadSanitizer toolchain: {r.stderr.strip()[-300:]}")
    return r


def test_core_threads_have_no_unexplained_tsan_report():
    r = _run("--quick")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "0 unexplained" in out, out
    # every scenario ran and its invariants held (frames intact, none lost or duplicated)
    for scenario in ("block", "growable", "overwrite"):
        assert f"tsan: {scenario} seed 1:" in out, out
    assert out.count("invariants ok") == 3, out
    assert "UNEXPLAINED" not in out and "INVARIANT" not in out, out


def test_self_test_weakened_orderings_are_reported():
    r = _run("--self-test", "--quick")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "self-test 'commit' ok" in out and "self-test 'consumed' ok" in out, out
