"""The suite's fork check (tests/conftest.py): it refuses to fork a process that runs
a second thread, natively and under qemu-user emulation (.ci/aarch64), where every
emulated process also carries one thread of the emulator's own that it must not
count.  Each case runs in a forked child, which is where emulation adds a new
emulator thread that the harness did not see at start-up."""

import contextlib
import os
import threading
import warnings

import pytest

import conftest
from conftest import bound


def _in_child(body):
    """Run ``body()`` in a forked child; return what it wrote to the pipe (or its error)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report, never return into pytest
        code = 0
        try:
            msg = body()
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
            msg, code = f"error {type(e).__name__}: {e}", 1
        os.write(w, msg.encode())
        os._exit(code)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as f:
        chunks.append(f.read())
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode()


def _fork_and_reap():
    """Fork a grandchild that exits at once; "forked" once it has been reaped."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return "forked" if os.waitstatus_to_exitcode(status) == 0 else f"grandchild {status}"


def test_a_single_threaded_child_may_fork():
    # Under qemu-user the child has a new emulator thread of its own, which the
    # check must recognise; natively it has none.
    code, out = _in_child(_fork_and_reap)
    assert (code, out) == (0, "forked")


@contextlib.contextmanager
def _second_thread():
    """A real second thread of this process, waiting until the block ends."""
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, args=(bound(30),), name="second")
    t.start()
    try:
        yield t
    finally:
        stop.set()
        t.join(bound(30))


def test_a_child_running_a_second_thread_is_refused():
    def body():
        with _second_thread():
            try:
                return _fork_and_reap()
            except DeprecationWarning as e:
                return f"refused: {e}"

    code, out = _in_child(body)
    assert code == 0, out
    assert out.startswith("refused: This process"), out


def test_the_test_process_running_a_second_thread_is_refused():
    with _second_thread(), pytest.raises(DeprecationWarning, match="is multi-threaded"):
        os.fork()


def test_the_emulator_thread_is_found_only_under_emulation():
    def body():
        with _second_thread() as t:
            qemu = conftest._qemu_thread()
            return f"{conftest.EMULATED} {qemu} {t.native_id} {sorted(conftest._tids())}"

    code, out = _in_child(body)
    assert code == 0, out
    emulated, qemu, real, tids = out.split(" ", 3)
    assert emulated == str(conftest.EMULATED)
    if conftest.EMULATED:
        # one thread of the emulator's, and never the guest's own second thread
        assert qemu not in ("None", real), out
    else:
        assert qemu == "None", out
