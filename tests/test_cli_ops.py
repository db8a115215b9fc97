"""Operating spools from the command line: the CLI package's error mapping, damaged spools,
recovery without debris, and the operator commands (driven as a user would, via
``python -m shmq``)."""

import os
import pickle
import subprocess
import sys

import pytest

import shmq
from shmq import cli
from shmq.dump import DumpError, NotADump
from shmq.errors import (
    Empty, FrameLost, Full, LeaseLost, NotASpool, ReaderBusy, ShmqError, SpoolFormatError, Timeout,
    TooLarge,
)

from conftest import bound


def shmq_cmd(*args, timeout=bound(60), **kw):
    return subprocess.run([sys.executable, "-m", "shmq", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, **kw)


def one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# --- errors carry their kind ------------------------------------------------------------

@pytest.mark.parametrize("cls, code", [
    (Full, cli.EXIT_FULL), (Timeout, cli.EXIT_FULL), (TooLarge, cli.EXIT_FULL),
    (FrameLost, cli.EXIT_LOST), (SpoolFormatError, cli.EXIT_CORRUPT),
    (NotASpool, cli.EXIT_NOT_SPOOL), (ReaderBusy, cli.EXIT_BUSY), (DumpError, cli.EXIT_CORRUPT),
    (NotADump, cli.EXIT_NOT_SPOOL), (ShmqError, cli.EXIT_ERROR), (Empty, cli.EXIT_ERROR),
    (LeaseLost, cli.EXIT_ERROR)])
def test_exit_code_follows_the_error_kind_not_its_message(cls, code):
    # the message says something misleading on purpose: only the kind may decide
    exc = cls("not a shmq spool; symbolic link; is full")
    assert cli.classify(exc)[0] == code
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls and back.kind == exc.kind


def test_symlink_is_not_a_spool(spool_dir, make_spool):
    sp = make_spool(name="real")
    link = os.path.join(spool_dir, "link")
    os.symlink(sp.path, link)
    with pytest.raises(NotASpool, match="symbolic link"):
        shmq.Spool.open(link)
    res = shmq_cmd("stat", link)
    assert res.returncode == cli.EXIT_NOT_SPOOL and "symbolic link" in one_error_line(res.stderr)


def test_version():
    res = shmq_cmd("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"shmq {shmq.__version__}"


def test_dispatch_help_names_shmq_dispatch():
    res = shmq_cmd("dispatch", "--help")
    assert res.returncode == 0 and res.stdout.startswith("usage: shmq dispatch")


# --- rm: damaged spools, spools in use ---------------------------------------------------

def _sems(prefix):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"sem.shmq.{prefix}."))


def _damage(path, how):
    if how == "truncated":
        os.truncate(path, 5000)
    elif how == "empty":
        os.truncate(path, 0)
    elif how == "header":
        with open(path, "r+b") as f:
            f.seek(40)
            f.write(b"\xff\xff")


@pytest.mark.parametrize("how", ["truncated", "empty", "header"])
def test_rm_removes_a_damaged_spool_and_its_semaphores(spool_dir, how):
    path = os.path.join(spool_dir, "damaged")
    with shmq.Spool.create(path, capacity="64KiB") as sp:
        prefix = sp.sem_prefix
        sp.reader("g", group=True).close()  # a group semaphore too: found without the header
    assert len(_sems(prefix)) == 4
    _damage(path, how)
    res = shmq_cmd("stat", path)
    assert res.returncode in (cli.EXIT_CORRUPT, cli.EXIT_NOT_SPOOL)
    if how != "empty":  # the advice given must be one that works
        assert "'shmq rm'" in one_error_line(res.stderr)
    res = shmq_cmd("rm", path)
    assert res.returncode == 0, res.stderr
    assert not os.path.exists(path) and _sems(prefix) == []


def test_rm_leaves_an_empty_foreign_file_alone(spool_dir):
    path = os.path.join(spool_dir, "empty.txt")
    open(path, "w").close()
    res = shmq_cmd("rm", path)
    assert res.returncode == cli.EXIT_NOT_SPOOL and "not a shmq spool" in one_error_line(res.stderr)
    assert os.path.exists(path)


def test_rm_refuses_a_spool_in_use_unless_forced(spool_dir):
    path = os.path.join(spool_dir, "busy")
    shmq.Spool.create(path, capacity="64KiB").close()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import shmq, sys; sp = shmq.Spool.open(sys.argv[1]); "
         "print('open', flush=True); sys.stdin.read()", path],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        res = shmq_cmd("rm", path)
        assert res.returncode == cli.EXIT_BUSY
        assert f"in use by pid {holder.pid}" in one_error_line(res.stderr)
        assert os.path.exists(path)
        res = shmq_cmd("rm", "--force", path)
        assert res.returncode == 0 and not os.path.exists(path)
    finally:
        holder.stdin.close()
        assert holder.wait(bound(30)) == 0


# --- export --skip-corrupt, import without debris ----------------------------------------

def _corrupt_frames(path, n, which):
    from shmq import _format as F

    sp = shmq.Spool.create(path, capacity="64KiB")
    for i in range(n):
        sp.put(b"frame-%d" % i)
    for k in which:  # the seq word of frame k (all frames have the same stored size)
        sp.mapping.mm[sp.ring.base + k * F.frame_stored_bytes(7)] ^= 0x55
    sp.close()


def test_export_stops_at_a_damaged_frame_and_leaves_no_partial_dump(spool_dir):
    src, dump = os.path.join(spool_dir, "src"), os.path.join(spool_dir, "dump")
    _corrupt_frames(src, 10, [3])
    res = shmq_cmd("export", src, dump)
    assert res.returncode == cli.EXIT_CORRUPT
    assert "--skip-corrupt" in one_error_line(res.stderr)
    assert not os.path.exists(dump)


def test_export_skip_corrupt_reports_and_keeps_the_rest(spool_dir):
    src, dump, dst = (os.path.join(spool_dir, n) for n in ("src", "dump", "dst"))
    _corrupt_frames(src, 10, [3, 4])
    res = shmq_cmd("export", "--skip-corrupt", src, dump)
    assert res.returncode == 0, res.stderr
    assert one_error_line(res.stderr) == "shmq export: skipped 2 damaged frame(s) (seq 3..4)"
    assert shmq_cmd("import", dump, dst, "-q").returncode == 0
    with shmq.Spool.open(dst) as sp:
        assert [sp.read_at(s).data for s in range(sp.first_seq, sp.next_seq)] == [
            b"frame-%d" % i for i in (0, 1, 2, 5, 6, 7, 8, 9)]


def test_export_skip_corrupt_when_the_oldest_frame_is_damaged(spool_dir):
    src, dump = os.path.join(spool_dir, "src"), os.path.join(spool_dir, "dump")
    _corrupt_frames(src, 5, [0])
    res = shmq_cmd("export", "--skip-corrupt", "--json", src, dump)
    assert res.returncode == 0, res.stderr
    import json
    s = json.loads(res.stdout)
    assert (s["frames"], s["corrupt"], s["corrupt_ranges"]) == (4, 1, [[0, 0]])


def _debris(d):
    return sorted(n for n in os.listdir(d) if n not in ("dump", "src"))


def test_failed_import_leaves_nothing_and_a_retry_works(spool_dir, monkeypatch, capsys):
    src, dump, dst = (os.path.join(spool_dir, n) for n in ("src", "dump", "dst"))
    with shmq.Spool.create(src, capacity="64KiB") as sp:
        sp.put_many([b"x" * 1000] * 20)
    assert shmq_cmd("export", "-q", src, dump).returncode == 0
    made = []  # the semaphore prefixes of the spools the import creates
    create = shmq.Spool.create.__func__

    def recording_create(cls, *args, **kw):
        sp = create(cls, *args, **kw)
        made.append(sp.sem_prefix)
        return sp

    monkeypatch.setattr(shmq.Spool, "create", classmethod(recording_create))
    code = cli.main(["import", dump, dst, "--capacity", "8KiB", "--on-full", "block",
                     "--timeout", "0.1"])
    msg = one_error_line(capsys.readouterr().err)
    assert code == cli.EXIT_FULL
    assert "nothing was created" in msg and ".importing" not in msg
    assert _debris(spool_dir) == []
    assert made and all(_sems(p) == [] for p in made)
    monkeypatch.undo()
    res = shmq_cmd("import", dump, dst, "-q")
    assert res.returncode == 0 and _debris(spool_dir) == ["dst"]


def test_import_of_a_damaged_dump_leaves_nothing(spool_dir):
    src, dump, dst = (os.path.join(spool_dir, n) for n in ("src", "dump", "dst"))
    with shmq.Spool.create(src, capacity="64KiB") as sp:
        sp.put_many([b"y" * 100] * 50)
    assert shmq_cmd("export", "-q", src, dump).returncode == 0
    with open(dump, "r+b") as f:
        f.truncate(os.path.getsize(dump) // 2)
    res = shmq_cmd("import", dump, dst)
    assert res.returncode == cli.EXIT_CORRUPT and "truncated" in one_error_line(res.stderr)
    assert _debris(spool_dir) == []


# --- small CLI fixes ---------------------------------------------------------------------

def test_put_json_validates_every_frame_before_storing_any(make_spool):
    sp = make_spool(name="j")
    res = shmq_cmd("put", "--codec", "json", sp.path, '{"a": 1}', "{bad", "3")
    assert res.returncode == cli.EXIT_USAGE
    assert "frame 2 is not valid JSON" in one_error_line(res.stderr)
    assert "nothing was put" in res.stderr and sp.next_seq == 0


def test_put_json_from_stdin_says_how_many_were_put(make_spool):
    sp = make_spool(name="j")
    res = shmq_cmd("put", "--codec", "json", sp.path, input='{"a": 1}\n[2]\n{bad\n4\n')
    assert res.returncode == cli.EXIT_USAGE
    assert "the 2 frame(s) before it were put (seq 0..1)" in one_error_line(res.stderr)
    assert sp.next_seq == 2


def test_ls_of_a_file_that_is_not_a_directory():
    res = shmq_cmd("ls", "/etc/passwd")
    assert res.returncode == cli.EXIT_NOT_SPOOL
    assert "not a directory" in one_error_line(res.stderr) and res.stdout == ""


def test_ls_of_a_spool_file_lists_it(make_spool):
    sp = make_spool(name="one")
    res = shmq_cmd("ls", sp.path)
    assert res.returncode == 0 and sp.path in res.stdout


def test_create_beyond_the_filesystem_says_where_and_what_to_do(spool_dir):
    vfs = os.statvfs(spool_dir)
    # more than the whole tmpfs: refused at once, before any page is allocated
    too_big = 2 * vfs.f_blocks * vfs.f_frsize
    path = os.path.join(spool_dir, "huge")
    res = shmq_cmd("create", path, "--capacity", str(too_big))
    assert res.returncode == cli.EXIT_FULL
    msg = one_error_line(res.stderr)
    assert "/dev/shm" in msg and "GiB free of" in msg and "smaller --capacity" in msg
    assert os.listdir(spool_dir) == []


def test_top_follows_the_bare_name_convention():
    import uuid

    name = f"shmq-ops-top-{uuid.uuid4().hex[:8]}"
    sp = shmq.Spool.create(name, capacity="64KiB")
    try:
        sp.put(b"x")
        res = shmq_cmd("top", name, "--once", "--interval", "0.01")
        assert res.returncode == 0, res.stderr
        assert "1 spool " in res.stdout.splitlines()[0] and name in res.stdout
    finally:
        sp.close()
        shmq.Spool.destroy(name)


# --- tail: filters, following a removed and re-created spool ----------------------------

def _lines_until(stream, needle, timeout=bound(30)):
    """Read lines from a pipe until one contains ``needle`` (bounded)."""
    import select
    import time

    got, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], deadline - time.monotonic())
        if not ready:
            break
        line = stream.readline()
        if not line:
            break
        got.append(line)
        if needle in line:
            return got
    raise AssertionError(f"{needle!r} not seen in {got}")


def test_tail_follows_a_removed_and_recreated_spool(spool_dir):
    import signal

    path = os.path.join(spool_dir, "t")
    with shmq.Spool.create(path, capacity="64KiB") as sp:
        sp.put(b"old-1")
    tail = subprocess.Popen([sys.executable, "-m", "shmq", "tail", "-f", path, "--timeout", "60",
                             "--format", "raw"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _lines_until(tail.stdout, "old-1")
        assert shmq_cmd("rm", "--force", path).returncode == 0
        _lines_until(tail.stderr, "was removed; waiting")
        with shmq.Spool.create(path, capacity="64KiB") as sp:
            sp.put(b"new-1")
        _lines_until(tail.stderr, "was created again")
        _lines_until(tail.stdout, "new-1")
    finally:
        tail.send_signal(signal.SIGINT)
        assert tail.wait(bound(30)) == 0


def test_tail_grep_and_exclude(make_spool):
    sp = make_spool(name="g")
    for doc in ('{"k": "a", "n": 1}', '{"k": "b", "n": 2}', '{"k": "a", "n": 3, "x": {"y": 5}}'):
        sp.put(doc.encode(), codec=shmq._format.CODEC_JSON)
    sp.put(b"plain text line")

    def seqs(*args):
        res = shmq_cmd("tail", sp.path, "--format", "json", *args)
        assert res.returncode == 0, res.stderr
        import json
        return [json.loads(ln)["seq"] for ln in res.stdout.splitlines()]

    assert seqs("--grep", "k=a") == [0, 2]
    assert seqs("--grep", "n=2") == [1]
    assert seqs("--grep", "x.y=5") == [2]
    assert seqs("--grep", "plain") == [3]
    assert seqs("--grep", "k=a", "--grep", "plain") == [0, 2, 3]
    assert seqs("--exclude", "k=a") == [1, 3]
    assert seqs("--exclude", '"n": [13]') == [1, 3]
    res = shmq_cmd("tail", sp.path, "--grep", "(unclosed")
    assert res.returncode == cli.EXIT_USAGE and "bad pattern" in one_error_line(res.stderr)


def test_fsck_recommends_only_what_helps(spool_dir):
    from shmq import _format as F

    ring = os.path.join(spool_dir, "ring")
    _corrupt_frames(ring, 5, [2])
    res = shmq_cmd("fsck", ring)
    assert res.returncode == cli.EXIT_PROBLEMS
    last = res.stdout.splitlines()[-1]
    assert "--repair" not in last and "export --skip-corrupt" in last
    ctl = os.path.join(spool_dir, "ctl")
    with shmq.Spool.create(ctl, capacity="64KiB") as sp:
        sp.ring.ctl[F.W_FIRST_SEQ] = 1 << 63
    res = shmq_cmd("fsck", ctl)
    last = res.stdout.splitlines()[-1]
    assert "--repair" not in last and "'shmq rm PATH'" in last
    res = shmq_cmd("stat", ctl)
    assert res.returncode == cli.EXIT_CORRUPT and "'shmq rm'" in one_error_line(res.stderr)
    assert shmq_cmd("rm", ctl).returncode == 0


# --- readers seek by time and by shift ---------------------------------------------------

def test_readers_seek_to_time_shift_and_dry_run(make_spool):
    import datetime
    import json

    sp = make_spool(name="seek")
    sp.put_many([b"early"] * 10)
    # the mark: the next whole microsecond (ISO 8601 has µs) after every early frame
    mark = (sp.read_at(9).timestamp_ns // 1000 + 1) * 1000
    while __import__("time").time_ns() <= mark:
        pass  # the late frames must be stamped after the mark (a microsecond at most)
    sp.put_many([b"late"] * 10)
    r = sp.reader("idx")
    r.get_many(15)
    r.commit()
    r.close()
    iso = (datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
           + datetime.timedelta(microseconds=mark // 1000)).isoformat()

    res = shmq_cmd("readers", "seek", sp.path, "idx", "--to-time", iso, "--dry-run", "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert (d["old_position"], d["position"], d["dry_run"], d["lag_after"]) == (15, 10, True, 10)
    assert {x.name: x.position for x in sp.readers()}["idx"] == 15  # nothing changed

    res = shmq_cmd("readers", "seek", sp.path, "idx", "--to-time", iso)
    assert res.returncode == 0 and "seq 15 -> 10" in res.stdout
    res = shmq_cmd("readers", "seek", sp.path, "idx", "--shift-by", "-3")
    assert res.returncode == 0 and "seq 10 -> 7 (shift by -3)" in res.stdout
    res = shmq_cmd("readers", "seek", sp.path, "idx", "--shift-by", "100")
    assert res.returncode == 0 and "seq 7 -> 20" in res.stdout and "clamped" in res.stdout
    future = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)
    res = shmq_cmd("readers", "seek", sp.path, "idx", "--to-time", future.isoformat())
    assert res.returncode == 0 and "-> 20" in res.stdout and "the end" in res.stdout


@pytest.mark.parametrize("args, code, text", [
    (["--to-time", "yesterday"], cli.EXIT_USAGE, "ISO 8601"),
    (["--shift-by", "1", "--to-time", "2026-01-01"], cli.EXIT_USAGE, "give one of"),
    ([], cli.EXIT_USAGE, "say where"),
])
def test_readers_seek_bad_input_changes_nothing(make_spool, args, code, text):
    sp = make_spool(name="seek")
    sp.put_many([b"x"] * 5)
    sp.reader("idx", start=2).close()
    res = shmq_cmd("readers", "seek", sp.path, "idx", *args)
    assert res.returncode == code and text in one_error_line(res.stderr)
    assert {x.name: x.position for x in sp.readers()}["idx"] == 2


def test_readers_seek_shift_by_needs_an_existing_reader(make_spool):
    sp = make_spool(name="seek")
    res = shmq_cmd("readers", "seek", sp.path, "nobody", "--shift-by", "1", "--create")
    assert res.returncode == cli.EXIT_NOT_FOUND and "does not exist" in one_error_line(res.stderr)
    assert sp.readers() == []


# --- stat and top over several spools ----------------------------------------------------

def test_stat_over_several_paths_and_a_directory(spool_dir, make_spool):
    import json

    a, b = make_spool(name="a"), make_spool(name="b")
    a.put(b"1")
    res = shmq_cmd("stat", a.path, b.path)
    assert res.returncode == 0
    assert [ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("spool ")] == [
        a.path, b.path]
    res = shmq_cmd("stat", spool_dir, "--json")
    assert res.returncode == 0
    assert [d["path"] for d in json.loads(res.stdout)] == [a.path, b.path]
    res = shmq_cmd("stat", a.path, "--json")  # one spool file: one object, as before
    assert json.loads(res.stdout)["path"] == a.path
    res = shmq_cmd("stat", spool_dir, "--format", "prometheus")
    assert res.stdout.count("# HELP shmq_puts_total") == 2


def test_stat_of_an_empty_directory_or_a_missing_spool(spool_dir, make_spool):
    sub = os.path.join(spool_dir, "empty")
    os.mkdir(sub)
    res = shmq_cmd("stat", sub)
    assert res.returncode == cli.EXIT_NOT_FOUND and "no spools" in one_error_line(res.stderr)
    os.rmdir(sub)
    a = make_spool(name="a")
    res = shmq_cmd("stat", a.path, os.path.join(spool_dir, "nope"))
    assert res.returncode == cli.EXIT_NOT_FOUND and "no such spool" in one_error_line(res.stderr)
    assert res.stdout == ""  # nothing printed before the error


def test_top_over_several_paths(make_spool):
    a, _b, c = make_spool(name="a"), make_spool(name="b"), make_spool(name="c")  # b: not shown
    res = shmq_cmd("top", a.path, c.path, "--once", "--interval", "0.01")
    assert res.returncode == 0 and "2 spools" in res.stdout.splitlines()[0]
    names = [ln.split()[0] for ln in res.stdout.splitlines()[2:] if ln.strip()]
    assert names == ["a", "c"]


# --- bench ----------------------------------------------------------------------------------

def _bench_dirs():
    return {n for n in os.listdir("/dev/shm") if n.startswith("shmq-bench-")}


def test_bench_reports_both_phases_and_leaves_nothing(spool_dir):
    import json

    res = shmq_cmd("bench", "--seconds", "0.05", "--repeat", "1", "--json", "--dir", spool_dir)
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["put"]["frames_per_s"] > 0 and d["pipeline"]["frames_per_s"] > 0
    assert d["put"]["runs"] == 1 and d["frame_bytes"] == 100
    assert os.listdir(spool_dir) == []


@pytest.mark.parametrize("args, code, text", [
    (["--size", "0"], cli.EXIT_USAGE, "positive"),
    (["--size", "2000000", "--capacity", "1MiB"], cli.EXIT_FULL, "can never fit"),
    (["--dir", "/nonexistent-dir"], cli.EXIT_NOT_FOUND, "no such directory"),
])
def test_bench_bad_input(spool_dir, args, code, text):
    extra = [] if "--dir" in args else ["--dir", spool_dir]
    res = shmq_cmd("bench", "--seconds", "0.05", "--repeat", "1", *args, *extra)
    assert res.returncode == code and text in res.stderr.strip().splitlines()[-1]
    assert os.listdir(spool_dir) == []


# --- metrics --serve -------------------------------------------------------------------------

def test_metrics_serve_on_loopback(spool_dir, make_spool):
    import re
    import signal
    import urllib.request

    pytest.importorskip("prometheus_client")
    sp = make_spool(name="m")
    sp.put(b"x")
    srv = subprocess.Popen([sys.executable, "-m", "shmq", "metrics", spool_dir, "--serve",
                            "127.0.0.1:0"], stderr=subprocess.PIPE, text=True)
    try:
        line = _lines_until(srv.stderr, "/metrics")[-1]
        url = re.search(r"http://\S+/metrics", line).group(0)
        assert url.startswith("http://127.0.0.1:")
        body = urllib.request.urlopen(url, timeout=bound(30)).read().decode()
        assert f'shmq_up{{spool="{sp.path}"}} 1.0' in body
        assert f'shmq_puts_total{{spool="{sp.path}"}} 1.0' in body
    finally:
        srv.send_signal(signal.SIGTERM)
        assert srv.wait(bound(30)) == 0


def test_metrics_once_and_bad_input(spool_dir, make_spool):
    pytest.importorskip("prometheus_client")
    sp = make_spool(name="m")
    res = shmq_cmd("metrics", sp.path)
    assert res.returncode == 0 and f'shmq_up{{spool="{sp.path}"}} 1.0' in res.stdout
    res = shmq_cmd("metrics", "--serve", "localhost:http")
    assert res.returncode == cli.EXIT_USAGE and "HOST:PORT" in one_error_line(res.stderr)
    res = shmq_cmd("metrics", os.path.join(spool_dir, "nope"))
    assert res.returncode == cli.EXIT_NOT_FOUND


# --- tee --------------------------------------------------------------------------------------

def _all(path):
    with shmq.Spool.open(path) as sp:
        from shmq.dump import record_at
        return [(r.data, r.codec) for r in (record_at(sp, s) for s in range(sp.first_seq,
                                                                              sp.next_seq))]


def _tee(src, dst, *args, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "shmq", "tee", src, dst, "--timeout", "0.3",
                           *args], capture_output=True, text=True, timeout=bound(120), env=e)


def test_tee_copies_with_codecs_and_resumes(spool_dir):
    src, dst = os.path.join(spool_dir, "src"), os.path.join(spool_dir, "dst")
    with shmq.Spool.create(src, capacity="1MiB") as a, shmq.Spool.create(dst, capacity="1MiB"):
        a.put_many([b"a", b"b"])
        a.put(b'{"k": 1}', codec=shmq._format.CODEC_JSON)
        res = _tee(src, dst)
        assert res.returncode == 0 and "copied 3 frame(s)" in res.stdout, res.stderr
        a.put(b"c")
        res = _tee(src, dst, "--json")
        import json
        assert json.loads(res.stdout)["copied"] == 1
    assert _all(dst) == _all(src)
    assert shmq_cmd("rm", dst, "-q").returncode == 0
    assert os.listdir(spool_dir) == ["src"]  # the tee's record went with DST


@pytest.mark.parametrize("point", ["before-put:2", "after-put:2", "after-state:2",
                                   "after-put:1"])
def test_tee_killed_in_the_crash_window_copies_exactly_once(spool_dir, point):
    src, dst = os.path.join(spool_dir, "src"), os.path.join(spool_dir, "dst")
    with shmq.Spool.create(src, capacity="1MiB") as a:
        for i in range(30):  # codec changes make several appends per batch
            a.put(b"%d" % i, codec=shmq._format.CODEC_UTF8 if i % 10 < 5 else shmq._format.CODEC_RAW)
    shmq.Spool.create(dst, capacity="1MiB").close()
    res = _tee(src, dst, env={"SHMQ_TEST_TEE_CRASH": point})
    assert res.returncode == -9  # SIGKILLed at that point
    res = _tee(src, dst)
    assert res.returncode == 0, res.stderr
    assert _all(dst) == _all(src)


def test_tee_sigkilled_while_copying_a_live_stream(spool_dir):
    import signal

    src, dst = os.path.join(spool_dir, "src"), os.path.join(spool_dir, "dst")
    a = shmq.Spool.create(src, capacity="4MiB", on_full="block")
    shmq.Spool.create(dst, capacity="4MiB").close()
    a.put_many([b"frame %d" % i for i in range(200)])
    tee = subprocess.Popen([sys.executable, "-m", "shmq", "tee", src, dst, "--batch", "7",
                            "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with shmq.Spool.open(dst) as d:
            r = d.reader()
            for i in range(200, 2000):
                a.put(b"frame %d" % i)
                if i == 600:  # the tee is copying: kill it mid-stream
                    r.get(timeout=bound(30))
                    tee.send_signal(signal.SIGKILL)
            r.close()
    finally:
        tee.wait(bound(30))
        a.close()
    res = _tee(src, dst)
    assert res.returncode == 0, res.stderr
    assert [d for d, _c in _all(dst)] == [b"frame %d" % i for i in range(2000)]


def test_tee_bad_input_leaves_nothing(spool_dir):
    src, dst = os.path.join(spool_dir, "src"), os.path.join(spool_dir, "dst")
    shmq.Spool.create(src, capacity="64KiB").close()
    res = _tee(src, src)
    assert res.returncode == cli.EXIT_USAGE and "same spool" in one_error_line(res.stderr)
    res = _tee(src, dst)
    assert res.returncode == cli.EXIT_NOT_FOUND
    with shmq.Spool.open(src) as sp:
        assert sp.readers() == []  # no reader registered on SRC
    assert sorted(os.listdir(spool_dir)) == ["src"]


def test_tee_refuses_a_dst_another_process_writes(spool_dir):
    src, dst = os.path.join(spool_dir, "src"), os.path.join(spool_dir, "dst")
    with shmq.Spool.create(src, capacity="64KiB") as a, shmq.Spool.create(dst, capacity="64KiB") as b:
        a.put(b"one")
        assert _tee(src, dst).returncode == 0
        a.put(b"two")
        b.put(b"intruder")
        res = _tee(src, dst)
        assert res.returncode == cli.EXIT_BUSY
        assert "another process wrote into it" in one_error_line(res.stderr)


def test_ls_reports_damaged_spools_on_stderr(spool_dir, make_spool):
    import json

    good = make_spool(name="good")
    bad = os.path.join(spool_dir, "bad")
    shmq.Spool.create(bad, capacity="64KiB").close()
    os.truncate(bad, 5000)
    with open(os.path.join(spool_dir, "notes.txt"), "w") as f:
        f.write("not a spool")
    res = shmq_cmd("ls", spool_dir)
    assert res.returncode == 0 and "good" in res.stdout and "bad" not in res.stdout
    msg = one_error_line(res.stderr)
    assert msg.startswith(f"shmq ls: damaged: {bad}: truncated") and "'shmq rm'" in msg
    res = shmq_cmd("ls", spool_dir, "--json")
    assert [p["path"] for p in json.loads(res.stdout)] == [good.path]
    assert shmq_cmd("rm", bad).returncode == 0
