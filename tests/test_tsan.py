"""ThreadSanitizer over the engine, through shmq.h (stress/tsan.py; docs/guarantees.md,
"ThreadSanitizer").

Writers, named readers, group members and reservations run as threads of one C
process on one spool handle, driving the engine through its public API (no
interpreter, no stand-in); TSan must report nothing outside the documented
reports of lapped anonymous readers (classified from what the harness recorded
at each report, not from stack text), and must report, unexplained, once the
self-test relaxes a release store of the engine (so the first check is not
vacuous).
Skipped, with the reason, where no compiler with a TSan runtime can be found or
installed (the script exits 2 then).
"""

import os
import subprocess
import sys

import pytest

from conftest import SOURCE_ROOT, bound

SCRIPT = os.path.join(SOURCE_ROOT, "stress", "tsan.py")
MISSING_TOOLCHAIN = 2


def _run(*args, timeout=bound(300)):
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


def _classify(line, ring=(0x1000, 0x11000)):
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import tsan
    finally:
        sys.path.pop(0)
    (ev,) = tsan.parse_events(line)
    return tsan.lapped_reader(ev, ring)


WRITER_STORE = "access=0:writer:1:w:0:8200:8"
ANON_READ = "access=1:anon:0:r:0:8200:8"


@pytest.mark.parametrize("line,why", [
    # the writer's later store over bytes an anonymous reader had already returned
    (f"tsan-report 0 kind=data-race cur=0 first=5 {WRITER_STORE} {ANON_READ} copy=7:accepted:accepted:8192:8400:3",
     "finished"),
    # ... over a frame not evicted yet (the copy's seq 5 is FIRST_SEQ): the writer was still writing
    # the frame the reader had copied and returned (a missing release at the commit)
    (f"tsan-report 0 kind=data-race cur=0 first=5 {WRITER_STORE} {ANON_READ} copy=7:accepted:accepted:8192:8400:5",
     None),
    # the whole copy made before the lapping store, checked after it and returned
    (f"tsan-report 0 kind=data-race cur=0 first=5 {WRITER_STORE} {ANON_READ} copy=7:copied:accepted:8192:8400:3",
     "read first"),
    # ... but of a frame not evicted yet
    (f"tsan-report 0 kind=data-race cur=0 first=5 {WRITER_STORE} {ANON_READ} copy=7:copied:accepted:8192:8400:5",
     None),
    # ... or still being made at the store and then returned: later bytes may hold the store's values
    (f"tsan-report 0 kind=data-race cur=0 first=5 {WRITER_STORE} {ANON_READ} copy=7:copying:accepted:8192:8400:3",
     None),
    # a copy raced while being made, then discarded by the seqlock re-check
    (f"tsan-report 0 kind=data-race cur=1 first=5 {WRITER_STORE} {ANON_READ} copy=7:copying:dropped:8192:8400:3",
     "discarded"),
    # ... but returned: a torn copy delivered
    (f"tsan-report 0 kind=data-race cur=1 first=5 {WRITER_STORE} {ANON_READ} copy=7:copying:accepted:8192:8400:3", None),
    # the reader's read came last (it fired the report) yet its copy was already finished: not a copy's read
    (f"tsan-report 0 kind=data-race cur=1 first=5 {WRITER_STORE} {ANON_READ} copy=7:accepted:accepted:8192:8400:3", None),
    # no copy of that reader covers the byte (a header read and rejected, or a log overflow)
    (f"tsan-report 0 kind=data-race cur=0 first=5 {WRITER_STORE} {ANON_READ} copy=0:none:open:0:0:3", None),
    # a named reader holds writers back: any such race is a bug
    (f"tsan-report 0 kind=data-race cur=0 first=5 {WRITER_STORE} access=1:named:0:r:0:8200:8 "
     "copy=7:accepted:accepted:8192:8400:3", None),
    # a control word (below the ring), an atomic access, another kind
    ("tsan-report 0 kind=data-race cur=0 first=5 access=0:writer:1:w:0:64:8 access=1:anon:0:r:0:64:8 "
     "copy=7:accepted:accepted:0:100:3", None),
    (f"tsan-report 0 kind=data-race cur=0 first=5 access=0:writer:1:w:1:8200:8 {ANON_READ} "
     "copy=7:accepted:accepted:8192:8400:3", None),
    (f"tsan-report 0 kind=heap-use-after-free cur=0 first=5 {WRITER_STORE} {ANON_READ} "
     "copy=7:accepted:accepted:8192:8400:3", None),
])
def test_classifier_decides_from_what_happened(line, why):
    assert _classify(line) == why
