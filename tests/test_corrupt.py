"""Bad files: foreign, truncated, newer, corrupt, symlinked; fuzzed bytes never crash or hang."""

import faulthandler
import os
import signal
import struct
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmq
from shmq import _format as F


@pytest.fixture
def doomed(spool_path):
    """A spool whose header the test will damage; its semaphores are removed after."""
    sp = shmq.Spool.create(spool_path, capacity="64KiB")
    prefix, slots = sp.sem_prefix, sp.geometry["slot_count"]
    sp.close()
    yield spool_path
    from shmq._mapping import unlink_semaphores

    unlink_semaphores(prefix, slots)


def test_missing_spool(spool_dir):
    with pytest.raises(FileNotFoundError, match="create it"):
        shmq.Spool.open(os.path.join(spool_dir, "nope"))


def test_foreign_file_refused_and_kept(spool_path):
    with open(spool_path, "wb") as f:
        f.write(b"hello world, I am not a spool" * 1000)
    with pytest.raises(shmq.SpoolFormatError, match="not a shmq spool"):
        shmq.Spool.open(spool_path)
    with pytest.raises(shmq.SpoolFormatError):
        shmq.Spool.destroy(spool_path)
    assert os.path.getsize(spool_path) == 29000  # untouched


def test_empty_file(spool_path):
    open(spool_path, "wb").close()
    with pytest.raises(shmq.SpoolFormatError, match="too small"):
        shmq.Spool.open(spool_path)


def test_truncated_spool(doomed):
    spool_path = doomed
    with open(spool_path, "r+b") as f:
        f.truncate(F.HEADER_BYTES + 100)
    with pytest.raises(shmq.SpoolFormatError, match="truncated"):
        shmq.Spool.open(spool_path)


def test_newer_format_version(doomed):
    spool_path = doomed
    with open(spool_path, "r+b") as f:
        raw = bytearray(f.read(F.GEOMETRY.size))
        struct.pack_into("<I", raw, 8, F.FORMAT_VERSION + 1)
        struct.pack_into("<I", raw, 124, __import__("zlib").crc32(bytes(raw[:124])))
        f.seek(0)
        f.write(raw)
    with pytest.raises(shmq.SpoolFormatError, match="newer than this shmq"):
        shmq.Spool.open(spool_path)


def test_corrupt_header_checksum(doomed):
    spool_path = doomed
    with open(spool_path, "r+b") as f:
        f.seek(40)
        f.write(b"\xff")
    with pytest.raises(shmq.SpoolFormatError, match="corrupt"):
        shmq.Spool.open(spool_path)


def test_corrupt_control_words(spool_path):
    sp = shmq.Spool.create(spool_path, capacity="64KiB")
    sp.put(b"x")
    sp.ring.ctl[F.W_FIRST_SEQ] = 99  # first beyond next
    sp.close()
    with pytest.raises(shmq.SpoolFormatError, match="control block"):
        shmq.Spool.open(spool_path)


def test_symlink_refused(spool_dir, spool_path):
    shmq.Spool.create(spool_path, capacity="64KiB").close()
    link = os.path.join(spool_dir, "link")
    os.symlink(spool_path, link)
    with pytest.raises(shmq.ShmqError, match="symbolic link"):
        shmq.Spool.open(link)
    with pytest.raises(FileExistsError):
        shmq.Spool.create(link)  # never written through


def test_directory_refused(spool_dir):
    with pytest.raises(shmq.NotASpool, match="is a directory"):
        shmq.Spool.open(spool_dir)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_permission_denied(spool_path):
    shmq.Spool.create(spool_path, capacity="64KiB", mode=0o400).close()
    with pytest.raises(PermissionError):
        shmq.Spool.open(spool_path)


def test_permission_denied_as_other_user(spool_path):
    """Run the open in a child that drops to an unprivileged uid."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch user")
    shmq.Spool.create(spool_path, capacity="64KiB").close()
    os.chmod(os.path.dirname(spool_path), 0o755)
    pid = os.fork()  # a bare fork: the child only drops privileges and opens (no start method)
    if pid == 0:  # child
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            shmq.Spool.open(spool_path)
            code = 1
        except PermissionError:
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_corrupt_frame_header_reported(spool_path):
    sp = shmq.Spool.create(spool_path, capacity="64KiB")
    for i in range(5):
        sp.put(bytes([i]) * 40)
    sp.mapping.mm[sp.ring.base + 2 * F.frame_stored_bytes(40)] ^= 0x55  # seq field of frame 2
    r = sp.reader()
    assert [r.get().seq for _ in range(2)] == [0, 1]
    with pytest.raises(shmq.SpoolFormatError, match="seq 2"):
        r.get()
    sp.close()


# --- fuzzing -----------------------------------------------------------------

_TEMPLATE = {}
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "stress"))
from fuzz import exercise as _exercise, template as _template  # noqa: E402  (the long mode's own code)


class _Hang(Exception):
    pass


def _alarm(_sig, _frame):
    raise _Hang()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_spool_never_crashes_or_hangs(spool_dir, data):
    if "raw" not in _TEMPLATE:
        _TEMPLATE["raw"] = _template(spool_dir)
    raw = _TEMPLATE["raw"]
    buf = bytearray(raw)
    ring_off = len(raw) - 8192
    for _ in range(data.draw(st.integers(1, 8))):
        region = data.draw(st.sampled_from(["ctl", "slots", "ring", "any"]))
        lo, hi = {"ctl": (128, 2048), "slots": (F.SLOT_OFFSET, F.SLOT_OFFSET + 4 * 256),
                  "ring": (ring_off, len(raw)), "any": (128, len(raw))}[region]
        at = data.draw(st.integers(lo, hi - 8))
        how = data.draw(st.sampled_from(["flip", "word", "zero"]))
        if how == "flip":
            buf[at] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "word":
            buf[at:at + 8] = data.draw(st.binary(min_size=8, max_size=8))
        else:
            n = data.draw(st.integers(1, 64))
            buf[at:at + n] = bytes(len(buf[at:at + n]))
    path = os.path.join(spool_dir, "fuzz")
    # Geometry is CRC-protected, so keep the original header: fresh semaphores
    # come from a new create, the fuzzed body is copied over it.
    shmq.Spool.create(path, capacity=8192, readers=4, leases=8).close()
    with open(path, "r+b") as f:
        head = f.read(128)
        f.seek(0)
        f.write(head + bytes(buf[128:]))
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    # SIGALRM cannot interrupt a loop in the compiled core (it holds the GIL):
    # faulthandler's watchdog thread prints the stack and ends the process.
    faulthandler.dump_traceback_later(30, exit=True)
    try:
        _exercise(path)
    except shmq.ShmqError:
        pass
    except _Hang:
        pytest.fail("reading a corrupt spool hung")
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        shmq.Spool.destroy(path)


def test_fuzz_exercise_accepts_an_empty_spool(spool_dir):
    """Regression: the fuzz harness read seq next_seq - 1 = -1 on an empty ring (found under the sanitizer run)."""
    path = os.path.join(spool_dir, "empty")
    shmq.Spool.create(path, capacity=8192).close()
    _exercise(path)  # raised ValueError("seq must be non-negative, not -1")
    with shmq.Spool.open(path) as sp:
        assert sp.next_seq == 1 and sp.read_at(0).data == b"after corruption"
