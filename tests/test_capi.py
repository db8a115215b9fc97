"""The C API (shmq/engine/shmq.h, libshmq) with Python on the other end.

The engine builds without Python (its sources with -std=c11 -Wall -Wextra
-Werror and no Python include path; no Py symbol in libshmq), and C
programs share spools with Python processes: a C producer's 1,000,000
frames read by a Python named reader exactly once and in order; a Python
writer lapping a slow C reader of an overwrite spool with the loss counted
exactly; a C writer SIGKILLed holding the writer lock recovered by a Python
writer within the recovery timeout, and a Python writer's by a C writer; C
and Python members of one group sharing a stream; many threads of one C
process putting and getting on one handle with no loss or duplicate; a C
handle holding the handle lock (shmq.anonymous's orphan check) until its
process dies, and a C open waiting out a removal in progress; the examples
in examples/c (a spool shmq_create made carries the handle-lock flag);
shmq_set_sync's msyncs; the failure codes.

The C side is tests/capi_driver.c and examples/c/*.c, compiled here with
the engine's sources.  Skipped where there is no C compiler.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

import shmq
from shmq import _format as F
from shmq import _lock
from shmq.verify import verify

from conftest import SOURCE_ROOT, bound

ROOT = SOURCE_ROOT
ENGINE = os.path.join(ROOT, "shmq", "engine")
CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")

pytestmark = pytest.mark.skipif(not CC, reason="no C compiler (cc)")


def _engine_sources():
    return sorted(os.path.join(ENGINE, f) for f in os.listdir(ENGINE) if f.endswith(".c"))


def _compile(out, *sources):
    proc = subprocess.run([CC, "-std=c11", "-O2", "-g", "-Wall", "-I", ENGINE, "-o", out, *sources,
                           *_engine_sources(), "-pthread"], capture_output=True, text=True, timeout=bound(300))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """The driver and the examples, built once per module (worker)."""
    d = tmp_path_factory.mktemp("capi")
    return {
        "driver": _compile(str(d / "driver"), os.path.join(ROOT, "tests", "capi_driver.c")),
        "producer": _compile(str(d / "producer"), os.path.join(ROOT, "examples", "c", "producer.c")),
        "consumer": _compile(str(d / "consumer"), os.path.join(ROOT, "examples", "c", "consumer.c")),
    }


def _fields(line):
    return dict(re.findall(r"(\w+)=(\S*)", line))


def _run(*cmd, timeout=120):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=bound(timeout))
    assert proc.returncode == 0 and "error=" not in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


# --- the engine builds without Python ---------------------------------------------


def test_the_engine_builds_without_python(tmp_path):
    """Every engine file compiles with -std=c11 -Wall -Wextra -Werror and no Python include
    path (none includes Python.h), and libshmq.so, built by the documented command,
    defines and imports no Py symbol and exports exactly shmq.h's functions."""
    for src in _engine_sources():
        assert "Python.h" not in open(src).read(), src
    build = tmp_path / "build"
    proc = subprocess.run(["make", "-s", "-C", ENGINE, f"BUILD={build}", "all", "check"], capture_output=True,
                          text=True, timeout=bound(300), env=dict(os.environ, CC=CC))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-Werror" in proc.stdout and "no Python include path" in proc.stdout
    lib = build / "libshmq.so"
    nm = subprocess.run(["nm", str(lib)], capture_output=True, text=True, check=True).stdout
    assert not [ln for ln in nm.splitlines() if re.search(r"\bU?\s*_?Py", ln.split()[-1])]
    exported = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                              check=True).stdout.split()
    declared = set(re.findall(r"SHMQ_API [\w *]*?\b(shmq_\w+)\(", open(os.path.join(ENGINE, "shmq.h")).read()))
    assert {s for s in exported if s.startswith("shmq_")} == declared
    assert not [s for s in exported if s.startswith("eng_")]


COPY_CHECK = r"""
#include "engine.h"
/* eng_copy against memcpy at every distance (dst - src) mod 4096 in [0, 130] and
 * around 4096, sizes around the special path's bounds, both alignments of the source:
 * the bytes copied, nothing written before or after the destination. */
int main(void) {
    static const size_t sizes[] = {0, 1, 63, 64, 2047, 2048, 2049, 2111, 4096 + 13, 65536 + 5, 300001};
    size_t cap = 300001 + 3 * 4096;
    unsigned char *src = aligned_alloc(4096, cap), *dst = aligned_alloc(4096, cap), *want = malloc(cap);
    for (size_t i = 0; i < cap; i++) src[i] = (unsigned char)(i * 131 + (i >> 9));
    long checked = 0;
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++)
        for (int d = 0; d < 4096; d += d < 130 || d > 4090 ? 1 : 977)
            for (size_t s0 = 0; s0 < 2; s0++) {
                size_t n = sizes[si], so = 64 + s0 * 8 + (s0 ? 3 : 0), doff = 4096 + so + (size_t)d;
                memset(dst, 0xA5, cap);
                memcpy(want, dst, cap);
                memcpy(want + doff, src + so, n);
                eng_copy(dst + doff, src + so, n);
                if (memcmp(dst, want, cap)) {
                    printf("FAIL n=%zu distance=%d source offset %zu\n", n, d, so);
                    return 1;
                }
                checked++;
            }
    printf("ok %ld copies, special path %s\n", checked, ENG_COPY_APART ? "built" : "not built");
    return 0;
}
"""


def test_payload_copies_are_memcpy_at_every_distance(tmp_path):
    """eng_copy (engine.h, copy.c) sends copies whose destination is 1 to 63 bytes past
    their source modulo a page to a loop of its own: at every distance, size and source
    alignment, the bytes are memcpy's and nothing around the destination is touched."""
    src = tmp_path / "copy_check.c"
    src.write_text(COPY_CHECK)
    out = _compile(str(tmp_path / "copy_check"), str(src))
    proc = subprocess.run([out], capture_output=True, text=True, timeout=bound(120))
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr
    import platform
    if platform.machine() == "x86_64":
        assert "special path built" in proc.stdout


# --- interop ----------------------------------------------------------------------


def test_a_c_producers_million_frames_reach_a_python_named_reader_once_in_order(programs, spool_dir):
    path = os.path.join(spool_dir, "million")
    total = 1_000_000
    sp = shmq.Spool.create(path, capacity="4MiB", on_full="block")
    r = sp.reader("python")  # registered first: a block spool keeps what it has not read
    producer = subprocess.Popen([programs["producer"], path, str(total), "24"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        expect = 0
        while expect < total:
            for f in r.get_many(4096, timeout=bound(30)):
                assert f.seq == expect, (f.seq, expect)
                assert f.data.startswith(b"i=%d;" % expect), f.data
                expect += 1
        out, err = producer.communicate(timeout=bound(30))
        assert producer.returncode == 0, err
        assert f"put {total} frames" in out
        with pytest.raises(shmq.Empty):
            r.get(timeout=0.05)  # nothing more: each frame once
        assert r.lost == 0 and sp.stats().next_seq == total
        # the C writer, blocked again and again on the 4 MiB ring, took back every want of
        # room it published (docs/format.md, "Room for a blocked writer")
        assert sp.mapping.ctl[F.W_ROOM_WANT_POS] == 0
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()
        r.close()
        sp.close()
    assert verify(path).ok


def test_a_slow_c_reader_counts_what_a_python_writer_overwrote_exactly(programs, spool_dir):
    path = os.path.join(spool_dir, "lapped")
    total = 20_000
    sp = shmq.Spool.create(path, capacity="64KiB", on_full="overwrite")
    reader = subprocess.Popen([programs["driver"], "slowread", path, str(total), "200"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "ready"  # its cursor is at seq 0: every loss counts
        pad = b"." * 200
        for start in range(0, total, 100):  # in bursts: the reader is lapped many times
            sp.put_many([b"i=%d;%s" % (i, pad) for i in range(start, start + 100)])
        out, err = reader.communicate(timeout=bound(60))
        assert reader.returncode == 0, out + err
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
        sp.close()
    got = _fields(out)
    assert int(got["bad"]) == 0  # intact, in seq order, seq == the payload's index
    assert int(got["lost"]) > 0  # it was lapped ...
    assert int(got["lost"]) == int(got["gaps"])  # ... and counted exactly what it skipped
    assert int(got["got"]) + int(got["lost"]) == total


def test_a_sigkilled_c_writers_lock_is_recovered_by_a_python_writer(programs, spool_dir):
    path = os.path.join(spool_dir, "ckilled")
    recovery = 1.0
    shmq.Spool.create(path, capacity="64KiB").close()
    holder = subprocess.Popen([programs["driver"], "holdlock", path], stdout=subprocess.PIPE, text=True)
    line = holder.stdout.readline()
    assert line.startswith("held"), line
    with shmq.Spool.open(path, recovery_timeout=recovery) as sp:
        assert sp.stats().lock_pid == holder.pid
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        t0 = time.monotonic()
        seq = sp.put(b"after the C writer died")
        took = time.monotonic() - t0
        assert took < bound(recovery), took  # the dead holder is seen at the first look (50 ms)
        st = sp.stats()
        assert st.lock_breaks == 1 and st.lock_pid == 0
        assert seq == 0  # the dead writer's reservation published nothing
        assert sp.reader().get(timeout=bound(5)).data == b"after the C writer died"
    assert verify(path).ok


def test_a_c_handle_holds_the_handle_lock_while_open(programs, spool_dir):
    """A C handle (shmq_open) holds the handle lock, as every Python handle does, so an
    anonymous queue's orphan check sees it; the kernel drops it when its process dies."""
    path = os.path.join(spool_dir, "chandle")
    shmq.Spool.create(path, capacity="64KiB").close()
    holder = subprocess.Popen([programs["driver"], "holdlock", path], stdout=subprocess.PIPE, text=True)
    fd = os.open(path, os.O_RDWR)
    try:
        assert holder.stdout.readline().startswith("held")
        assert not _lock.ofd_lock(fd, F.HANDLE_LOCK_BYTE)  # exclusive, no wait: a handle exists
        holder.kill()
        holder.wait()
        assert _lock.ofd_lock(fd, F.HANDLE_LOCK_BYTE)  # its process died: no handle is left
    finally:
        os.close(fd)
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def _has_open(pid, path):
    st = os.stat(path)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:  # it exited meanwhile
        return False
    for fd in fds:
        try:
            fst = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (fst.st_dev, fst.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def test_a_c_open_waits_for_a_removal_in_progress_then_finds_it_gone(programs, spool_dir):
    """shmq_open meets the handle lock held exclusively (shmq.anonymous removing an orphan),
    waits, and once the removal is done reports the spool gone (-ENOENT), not a lock error."""
    path = os.path.join(spool_dir, "cremoved")
    shmq.Spool.create(path, capacity="64KiB").close()
    remover = os.open(path, os.O_RDWR)
    opener = None
    try:
        assert _lock.ofd_lock(remover, F.HANDLE_LOCK_BYTE)
        opener = subprocess.Popen([programs["driver"], "open", path], stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + bound(10)
        # Nothing the C side could signal while it waits inside shmq_open: watch /proc
        # until it has the file open (then it is at or in the wait for the lock).
        while not _has_open(opener.pid, path):
            assert opener.poll() is None and time.monotonic() < deadline, "the C open did not wait"
            time.sleep(0.001)
        shmq.Spool.destroy(path)
    finally:
        os.close(remover)  # the removal ends
    out, _ = opener.communicate(timeout=bound(10))
    got = _fields(out)
    assert got["code"] == "-2", out  # -ENOENT
    assert "removed while being opened" in out, out


def _hold_the_writer_lock(path, ready):
    sp = shmq.Spool.open(path)
    rv = sp.reserve(64)  # holds the writer lock until committed
    ready.send(os.getpid())
    ready.recv()  # killed before this returns
    rv.commit()


def test_a_sigkilled_python_writers_lock_is_recovered_by_a_c_writer(programs, spool_dir, ctx):
    path = os.path.join(spool_dir, "pykilled")
    shmq.Spool.create(path, capacity="64KiB").close()
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_hold_the_writer_lock, args=(path, child))
    p.start()
    try:
        assert parent.poll(bound(30))
        assert parent.recv() == p.pid
        with shmq.Spool.open(path) as sp:
            assert sp.stats().lock_pid == p.pid
        os.kill(p.pid, signal.SIGKILL)
        p.join(bound(10))
        t0 = time.monotonic()
        out = _run(programs["driver"], "put", path, 10, 5.0)
        took = time.monotonic() - t0
    finally:
        if p.is_alive():
            p.kill()
            p.join()
    assert _fields(out) == {"first": "0", "last": "9"}  # nothing of the dead reservation
    assert took < bound(1.0), took  # the process start included: recovered at the first look
    with shmq.Spool.open(path) as sp:
        st = sp.stats()
        assert st.lock_breaks == 1 and st.next_seq == 10
        assert [f.data for f in sp.reader().get_many(20)] == [b"i=%d;" % i for i in range(10)]
    assert verify(path).ok


def _python_member(path, total, out):
    with shmq.Spool.open(path) as sp, sp.reader("workers", group=True) as g:
        out.send("ready")
        seqs = []
        while True:
            try:
                seqs.extend(f.seq for f in g.get_many(1 + len(seqs) % 7, timeout=0.05))
            except shmq.Empty:
                if g.position >= total:
                    break
        out.send(seqs)


def test_c_and_python_members_of_one_group_share_a_stream(programs, spool_dir, ctx):
    path = os.path.join(spool_dir, "mixed")
    total = 5000
    sp = shmq.Spool.create(path, capacity="256KiB", on_full="block")
    sp.reader("workers", group=True).close()  # the group exists: no frame is before its cursor
    parent, child = ctx.Pipe()
    py = ctx.Process(target=_python_member, args=(path, total, child))
    py.start()
    c = subprocess.Popen([programs["driver"], "group", path, "workers", str(total)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert c.stdout.readline().strip() == "ready"
        assert parent.poll(bound(30)) and parent.recv() == "ready"
        for start in range(0, total, 50):
            sp.put_many([b"i=%d;" % i for i in range(start, start + 50)])
        assert parent.poll(bound(60))
        py_seqs = parent.recv()
        out, err = c.communicate(timeout=bound(60))
        assert c.returncode == 0, out + err
        py.join(bound(30))
    finally:
        for proc in (c,):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if py.is_alive():
            py.kill()
            py.join()
        sp.close()
    c_seqs = [int(s) for s in _fields(out)["seqs"].split(",") if s]
    assert len(set(c_seqs)) == len(c_seqs) and len(set(py_seqs)) == len(py_seqs)
    assert not set(c_seqs) & set(py_seqs)  # no frame to two members
    assert sorted(c_seqs + py_seqs) == list(range(total))  # every frame to one
    assert verify(path).ok


def test_many_threads_of_one_c_process_put_and_get_on_one_handle(programs, spool_dir):
    path = os.path.join(spool_dir, "threads")
    shmq.Spool.create(path, capacity="64KiB", on_full="block").close()
    got = _fields(_run(programs["driver"], "threads", path, 4, 4, 20_000))
    assert got == {"frames": "80000", "taken": "80000", "missing": "0", "dup": "0", "disorder": "0",
                   "lost": "0"}
    assert verify(path).ok


@pytest.mark.parametrize("on", [1, 0])
def test_a_c_handle_set_to_sync_msyncs_each_write_as_pythons_does(programs, spool_dir, on):
    """shmq_set_sync(sp, 1) is Spool.open(sync=True): a put, a put_many and a
    committed reservation each msync their frames before the commit and the header
    page after (counted from outside, with strace); off, none does."""
    strace = shutil.which("strace")
    if not strace:
        pytest.skip("no strace")
    path = os.path.join(spool_dir, "durable")
    shmq.Spool.create(path, capacity=8192).close()
    log = os.path.join(spool_dir, "strace.log")
    out = _run(strace, "-f", "-e", "trace=msync", "-o", log, programs["driver"], "sync", path, on)
    with open(log) as f:
        calls = [ln for ln in f if "msync(" in ln]
    os.unlink(log)
    assert _fields(out) == {"last": "3"}
    assert len(calls) == (6 if on else 0), calls
    with shmq.Spool.open(path) as sp:
        assert [bytes(f.data) for f in sp.reader().get_many(10)] == [b"s0", b"s1", b"s2", b"s3"]
    shmq.Spool.destroy(path)


def test_a_c_put_blocked_on_a_spool_with_no_reader_sleeps_until_its_timeout(programs, spool_dir):
    # A block spool with no named reader keeps every frame: the waiting put
    # must sleep, not retry a write that cannot succeed in a loop at full CPU.
    path = os.path.join(spool_dir, "noreader")
    with shmq.Spool.create(path, capacity="64KiB", on_full="block") as sp:
        with pytest.raises(shmq.Full):
            for _ in range(10_000):
                sp.put(bytes(100), block=False)
    got = _fields(_run(programs["driver"], "blocked", path, "0.5"))
    assert int(got["code"]) == -2002  # SHMQ_EFULL
    wall, cpu = float(got["wall_ms"]), float(got["cpu_ms"])
    assert wall >= 450 and cpu < wall / 2, got
    shmq.Spool.destroy(path)


def test_the_c_apis_failures_are_codes(programs, spool_dir):
    got = _fields(_run(programs["driver"], "errors", spool_dir))
    codes = {k: int(v) for k, v in got.items()}
    assert codes == {
        "missing": -2, "foreign": -2009, "exists": -17, "longname": -36, "toolarge": -2004, "busy": -2011, "kind": -2014,
        "empty": -2007, "size": -2013, "need": 100, "after": 0, "full": -2002, "reservefull": -2002,
        "reserve": 0, "second": -2016, "inside": -2016, "commit": 0, "again": -2016, "nothing": 0, "read": 0,
        "destroy": 0, "gone": -2,
    }


# --- the examples -------------------------------------------------------------------


def test_the_c_examples_build_with_only_cc_and_work_with_python(spool_dir, tmp_path):
    """examples/c's Makefile builds both programs with nothing but cc; the producer's
    frames reach a Python reader, a Python writer's frames reach the consumer."""
    work = tmp_path / "c"
    shutil.copytree(os.path.join(ROOT, "examples", "c"), work)
    proc = subprocess.run(["make", "-s", "-C", str(work), f"ENGINE={ENGINE}"], capture_output=True, text=True,
                          timeout=bound(300), env=dict(os.environ, CC=CC))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    path = os.path.join(spool_dir, "demo")
    out = _run(work / "producer", path, 1000)
    assert "put 1000 frames" in out
    with shmq.Spool.open(path) as sp:
        assert sp.on_full == "block"  # the producer created it ...
        assert F.handles_lock(sp.geometry)  # ... with the flag that its handles hold the handle lock
        with sp.reader("python") as r:
            frames = r.get_many(2000, timeout=bound(5))
        assert [f.seq for f in frames] == list(range(1000))
        assert all(f.data.startswith(b"i=%d;" % f.seq) for f in frames)
        consumer = subprocess.Popen([work / "consumer", path, "c-reader", "500", "--timeout", "10"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            for i in range(500):
                sp.put(b"i=%d;" % i)
            out, err = consumer.communicate(timeout=bound(60))
        finally:
            if consumer.poll() is None:
                consumer.kill()
                consumer.wait()
    assert consumer.returncode == 0, out + err
    assert "got 500 frames, lost 0, in order" in out, out
