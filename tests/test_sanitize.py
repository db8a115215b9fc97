"""The compiled core under AddressSanitizer/UBSan and a coverage-guided fuzzer, in their quick modes.

``stress/sanitize.py`` needs a C compiler with its ASan runtime and
``stress/corefuzz.py`` also needs atheris (``pip install atheris``): where
either is missing these tests skip and say which.  The long runs and their
figures are in docs/guarantees.md ("The engine under sanitizers and a fuzzer").
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import shmq
from shmq import _format as F
from shmq._mapping import read_geometry

from conftest import SOURCE_ROOT, bound

STRESS = os.path.join(SOURCE_ROOT, "stress")
sys.path.insert(0, STRESS)
import sanitize  # noqa: E402


def _toolchain_or_skip():
    try:
        return sanitize.find_toolchain()
    except sanitize.ToolchainMissing as e:
        pytest.skip(str(e))


def test_sanitizer_quick(tmp_path):
    """Core tests and corrupt-file fuzz cases against the ASan+UBSan build: no failure, no report."""
    _toolchain_or_skip()
    out = tmp_path / "sanitize.json"
    proc = subprocess.run([sys.executable, os.path.join(STRESS, "sanitize.py"), "--quick", "--out",
                           str(tmp_path / "build"), "--json", str(out)], capture_output=True, text=True, timeout=bound(600))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["sanitizer_reports"] == 0
    assert rep["steps"]["tests"]["tests"] > 10 and rep["steps"]["tests"]["failures"] == 0
    assert rep["steps"]["fuzz"]["returncode"] == 0 and "0 violations" in rep["steps"]["fuzz"]["result"]
    print(proc.stdout)


def test_corefuzz_quick(tmp_path):
    """20 s of atheris over Ring/Cursor with fuzzer-written mappings: no crash, hang or report."""
    pytest.importorskip("atheris", reason="atheris is not installed (pip install atheris: wheels exist "
                                          "for CPython 3.11 on x86-64 Linux)")
    _toolchain_or_skip()
    out = tmp_path / "corefuzz.json"
    proc = subprocess.run([sys.executable, os.path.join(STRESS, "corefuzz.py"), "--quick", "--out",
                           str(tmp_path / "build"), "--json", str(out)], capture_output=True, text=True, timeout=bound(600))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["crashes"] == rep["hangs"] == rep["sanitizer_reports"] == 0 and not rep["artifacts"]
    assert rep["executions"] > 500  # it really ran
    print(proc.stdout)


# A process that opened a spool (and a reader), then finds the spool rewritten
# under it by a buggy or hostile process that can write the file, puts or gets.
_USE_AFTER_DAMAGE = textwrap.dedent("""
    import sys, shmq
    sp = shmq.Spool.open(sys.argv[1], sync=sys.argv[2] == "sync")
    r = sp.reader()  # anonymous, at the oldest frame
    print("open", flush=True)
    sys.stdin.readline()  # the test damages the spool now
    try:
        sp.put(b"x") if sys.argv[3] == "put" else r.get(block=False)
        print("ok", flush=True)
    except shmq.ShmqError as e:
        print("refused", type(e).__name__, flush=True)
""")


def _damage_then(path, path_kind, action, writes):
    """Run _USE_AFTER_DAMAGE; apply ``writes`` [(file offset, bytes)] once it has opened; return its output.

    The writes land after the open-time control checks, as another process's would.
    """
    proc = subprocess.Popen([sys.executable, "-c", _USE_AFTER_DAMAGE, path, path_kind, action],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "open"
        fd = os.open(path, os.O_RDWR)
        try:
            for off, data in writes:
                os.pwrite(fd, data, off)
        finally:
            os.close(fd)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        try:
            return proc.communicate(timeout=bound(5))[0]
        except subprocess.TimeoutExpired:
            pytest.fail(f"{action}() spun for more than 5 s on a damaged spool")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _word(index, value):
    return index * 8, value.to_bytes(8, "little")


_PAD_WALK_BUG = (
    "regression (fixed): make_room(), shmq/core/write.c (fast path) and Spool._make_room, shmq/spool.py (general "
    "path, taken by sync spools and pinned views): the overwrite-policy eviction walk follows PAD headers "
    "without bounding them (read_one() does), so a PAD at ring offset 0 spanning the whole ring makes "
    "put() spin while holding the writer lock; see docs/guarantees.md")


@pytest.mark.parametrize("path_kind", ["fast", "sync"])
def test_make_room_pad_walk_is_bounded(spool_dir, path_kind):
    """put() on a ring whose oldest frame is a self-repeating PAD refuses within seconds instead of spinning."""
    path = os.path.join(spool_dir, "s")
    with shmq.Spool.create(path, capacity=4096, on_full="overwrite") as sp:
        sp.put(b"a")  # seq 0 at position 0: FIRST_SEQ 0, NEXT_SEQ 1
    ring_off = read_geometry(path)["ring_offset"]
    out = _damage_then(path, path_kind, "put", [
        (ring_off, F.FRAME.pack(0, 4096, 0, 0, 0, F.FLAG_PAD, 0, 0)),  # a PAD that leads back to itself
        _word(F.W_NEXT_POS, 1 << 50)])  # ... and a long way to walk
    assert out.split()[:2] == ["refused", "SpoolFormatError"], out


_WRAPPED_POS_BUG = (
    "regression (fixed): first_cursor()/read_loop(), shmq/core/read.c (found by stress/corefuzz.py): with FIRST_POS "
    "within 32 bytes of 2**64, the cursor position wraps to 0 when it skips the ring's tail, is then "
    "always below FIRST_POS, and read_one() resyncs to FIRST_POS forever; see docs/guarantees.md")


def test_reader_resync_near_position_limit_is_bounded(spool_dir):
    """A FIRST_POS no writer can reach (2**64 - 1) makes get() refuse, not spin."""
    path = os.path.join(spool_dir, "s")
    with shmq.Spool.create(path, capacity=4096, on_full="overwrite") as sp:
        sp.put(b"a")
    out = _damage_then(path, "fast", "get", [_word(F.W_FIRST_POS, (1 << 64) - 1)])
    assert out.split()[:2] == ["refused", "SpoolFormatError"], out
