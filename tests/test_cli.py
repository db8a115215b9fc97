"""The shmq command line: every subcommand against real spools, JSON fields, errors, exit codes."""

import fcntl
import io
import json
import re
import os
import pickle
import select
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

import shmq
from shmq import _format as F
from shmq import cli
from shmq.cli import main
from shmq.metrics import prometheus_text

from conftest import bound


def run(capsys, *args):
    """``main(args)`` -> (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def shmq_cmd(*args, timeout=bound(60), **kw):
    return subprocess.run([sys.executable, "-m", "shmq", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, **kw)


def _stdin(monkeypatch, data: bytes):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


def _one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# --- help and usage -----------------------------------------------------------------

SUBCOMMANDS = ["create", "rm", "ls", "stat", "top", "tail", "put", "cat", "readers", "fsck",
               "export", "import", "demo", "bench", "metrics", "tee", "pub", "sub"]


@pytest.mark.parametrize("argv", [[c] for c in SUBCOMMANDS]
                         + [["readers", v] for v in ("rm", "seek", "list")] + [[]])
def test_every_subcommand_has_help(capsys, argv):
    code, out, _err = run(capsys, *argv, "--help")
    assert code == 0
    assert out.startswith("usage: shmq")


def test_no_command_prints_usage_and_exits_2(capsys):
    code, _out, err = run(capsys)
    assert code == 2 and "usage: shmq" in err


def test_bad_option_is_a_usage_error(capsys, spool_path):
    assert run(capsys, "stat", spool_path, "--bogus")[0] == 2
    assert run(capsys, "tail", spool_path, "--from", "-3")[0] == 2
    assert run(capsys, "create", spool_path, "--mode", "999")[0] == 2
    assert run(capsys, "create", spool_path, "--on-full", "sometimes")[0] == 2


# --- create / rm / ls ------------------------------------------------------------------


def test_create_growable_and_ls_shows_use_and_ceiling(capsys, spool_dir):
    path = os.path.join(spool_dir, "grows")
    code, out, _ = run(capsys, "create", path, "--capacity", "256KiB", "--max-capacity", "64MiB",
                       "--on-full", "block", "--json")
    assert code == 0
    info = json.loads(out)
    assert info["growable"] and info["capacity"] == 64 << 20
    assert info["allocated"] < 1 << 20 < info["file_bytes"]
    with shmq.Spool.open(path) as sp:
        sp.reader("g", group=True)
        sp.put_many([b"x" * 1000] * 5000)
    code, out, _ = run(capsys, "ls", spool_dir)
    assert code == 0 and re.search(r"grows\s+block\s+[56]\.\d MiB of 64\.\d MiB", out), out
    code, out, _ = run(capsys, "stat", path)
    assert code == 0 and "growable:" in out and "segments grown" in out


def test_create_with_options(capsys, spool_dir):
    path = os.path.join(spool_dir, "orders")
    code, out, _ = run(capsys, "create", path, "--capacity", "64KiB", "--on-full", "block",
                       "--mode", "0660", "--readers", "8", "--json")
    assert code == 0
    info = json.loads(out)
    allocated = info.pop("allocated")
    assert info == {"path": path, "capacity": 65536, "on_full": "block", "mode": "0660",
                    "readers": 8, "leases": F.DEFAULT_LEASES, "checksum": False,
                    "file_bytes": os.path.getsize(path), "growable": False}
    assert allocated == os.stat(path).st_blocks * 512 >= os.path.getsize(path)
    assert os.stat(path).st_mode & 0o7777 == 0o660
    with shmq.Spool.open(path) as sp:
        assert sp.on_full == "block" and sp.capacity == 65536
    code, out, _ = run(capsys, "create", os.path.join(spool_dir, "b"), "--capacity", "4096",
                       "--checksum")
    assert code == 0 and "CRC on" in out and "on_full=overwrite" in out


def test_create_errors(capsys, spool_dir, make_spool):
    sp = make_spool(name="taken")
    code, _, err = run(capsys, "create", sp.path)
    assert code == cli.EXIT_EXISTS and "already exists" in _one_error_line(err)
    code, _, err = run(capsys, "create", os.path.join(spool_dir, "x"), "--capacity", "lots")
    assert code == cli.EXIT_USAGE and "cannot parse size" in _one_error_line(err)
    assert not os.path.exists(os.path.join(spool_dir, "x"))
    code, _, err = run(capsys, "create", os.path.join(spool_dir, "no", "dir"))
    assert code == cli.EXIT_NOT_FOUND and "no such directory" in _one_error_line(err)
    code, _, err = run(capsys, "export", sp.path, os.path.join(spool_dir, "no", "f"))
    assert code == cli.EXIT_NOT_FOUND and "no such file or directory" in _one_error_line(err)


def _sems(prefix):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"sem.shmq.{prefix}."))


def test_rm_removes_file_and_semaphores(capsys, spool_dir):
    path = os.path.join(spool_dir, "gone")
    assert run(capsys, "create", path, "--capacity", "64KiB")[0] == 0
    with shmq.Spool.open(path) as sp:
        prefix = sp.sem_prefix
        sp.reader("g", group=True).close()
    assert _sems(prefix)
    code, out, _ = run(capsys, "rm", path)
    assert code == 0 and out.strip() == f"removed {path}"
    assert not os.path.exists(path) and _sems(prefix) == []
    code, _, err = run(capsys, "rm", path)
    assert code == cli.EXIT_NOT_FOUND and "no such spool" in _one_error_line(err)
    assert run(capsys, "rm", "-f", path)[0] == 0


def test_rm_refuses_a_foreign_file(capsys, spool_dir):
    path = os.path.join(spool_dir, "notes.txt")
    with open(path, "w") as f:
        f.write("keep me\n" * 1000)
    code, _, err = run(capsys, "rm", path)
    assert code == cli.EXIT_NOT_SPOOL and "not a shmq spool" in _one_error_line(err)
    assert os.path.getsize(path) == 8000


def test_ls_lists_spools_only(capsys, spool_dir, make_spool):
    a = make_spool(name="alpha", capacity="64KiB")
    make_spool(name="beta", capacity="128KiB", on_full="block")
    for i in range(20):
        a.put(b"x" * 100)
    with open(os.path.join(spool_dir, "junk"), "wb") as f:
        f.write(os.urandom(5000))
    os.mkdir(os.path.join(spool_dir, "sub"))
    os.symlink(a.path, os.path.join(spool_dir, "link"))
    code, out, _ = run(capsys, "ls", spool_dir, "--json")
    assert code == 0
    rows = json.loads(out)
    assert [r["name"] for r in rows] == ["alpha", "beta"]
    alpha = rows[0]
    assert alpha["frames"] == 20 and alpha["next_seq"] == 20 and alpha["on_full"] == "overwrite"
    assert alpha["capacity"] == 65536 and 0 < alpha["fill"] < 1
    assert alpha["write_rate_per_s"] >= 0 and alpha["put_bytes"] == 2000
    assert rows[1]["on_full"] == "block" and rows[1]["frames"] == 0
    code, out, _ = run(capsys, "ls", spool_dir)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["SPOOL", "POLICY", "SIZE"]
    assert [ln.split()[0] for ln in lines[1:]] == ["alpha", "beta"]
    os.unlink(os.path.join(spool_dir, "link"))
    os.rmdir(os.path.join(spool_dir, "sub"))


def test_ls_empty_and_missing_dir(capsys, spool_dir):
    code, out, err = run(capsys, "ls", spool_dir)
    assert code == 0 and out == "" and "no spools" in err
    code, _, err = run(capsys, "ls", os.path.join(spool_dir, "nope"))
    assert code == cli.EXIT_NOT_FOUND and "no such directory" in _one_error_line(err)


# --- stat -----------------------------------------------------------------------------


@pytest.fixture
def busy_spool(make_spool):
    """A spool with frames, a named reader that read some, and a group."""
    sp = make_spool(name="busy", capacity="64KiB", checksum=True)
    r = sp.reader("indexer")
    g = sp.reader("workers", group=True)
    for i in range(10):
        sp.put(f"frame {i}".encode())
    for _ in range(4):
        r.get()
    g.get()
    r.close()
    g.close()
    return sp


STAT_FIELDS = {
    "path", "capacity", "on_full", "checksum", "first_seq", "next_seq", "frames", "used_bytes",
    "fill", "puts", "put_bytes", "last_put_ns", "gets", "get_bytes", "last_get_ns",
    "avg_delay_ns", "max_delay_ns", "lost", "evicted", "high_water", "low_water",
    "high_water_frames", "high_water_bytes", "lock_pid", "lock_token", "lock_breaks",
    "allocated", "growable", "growths", "write_rate", "read_rate", "readers", "time_ns", "lock_alive", "last_put_age_s",
    "last_get_age_s", "write_rate_per_s", "read_rate_per_s"}
READER_FIELDS = {"name", "kind", "position", "lag", "lag_bytes", "lost", "gets", "get_bytes",
                 "last_get_ns", "avg_delay_ns", "max_delay_ns", "high_water", "low_water",
                 "pid", "alive", "slot", "last_get_age_s"}


def test_stat_json_fields(capsys, busy_spool):
    code, out, _ = run(capsys, "stat", busy_spool.path, "--json")
    assert code == 0
    d = json.loads(out)
    assert set(d) == STAT_FIELDS
    assert (d["first_seq"], d["next_seq"], d["frames"], d["puts"]) == (0, 10, 10, 10)
    assert d["put_bytes"] == sum(len(f"frame {i}") for i in range(10))
    assert d["gets"] == 5 and d["lock_pid"] == 0 and d["lock_alive"] is False
    assert 0 <= d["last_put_age_s"] < 60
    assert sum(n for _s, n in d["write_rate"]) == 10
    readers = {r["name"]: r for r in d["readers"]}
    assert set(readers) == {"indexer", "workers"}
    for r in readers.values():
        assert set(r) == READER_FIELDS
    assert readers["indexer"]["kind"] == "reader" and readers["indexer"]["position"] == 4
    assert readers["indexer"]["lag"] == 6 and readers["indexer"]["alive"] is False
    assert readers["workers"]["kind"] == "group" and readers["workers"]["position"] == 1
    assert readers["workers"]["pid"] == os.getpid()


def test_stat_text(capsys, busy_spool):
    code, out, _ = run(capsys, "stat", busy_spool.path)
    assert code == 0
    for word in ("frames      10 resident", "puts        10 frames", "lock        free",
                 "evicted 0", "NAME", "indexer", "workers", "group"):
        assert word in out, word


def test_stat_shows_a_dead_lock_holder(capsys, make_spool):
    sp = make_spool()
    sp.writer_lock.sem.acquire()
    pid = os.fork()  # a bare fork: only a pid that was alive and is gone is wanted
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    sp.ring.ctl[F.W_LOCK_HOLDER] = pid
    code, out, _ = run(capsys, "stat", sp.path, "--json")
    d = json.loads(out)
    assert d["lock_pid"] == pid and d["lock_alive"] is False
    assert f"held by pid {pid} (DEAD" in run(capsys, "stat", sp.path)[1]
    sp.ring.ctl[F.W_LOCK_HOLDER] = 0
    sp.writer_lock.sem.release()


def test_stat_watch_count(capsys, busy_spool):
    code, out, _ = run(capsys, "stat", busy_spool.path, "--json", "--watch", "0.05", "--count", "3")
    assert code == 0
    docs = [json.loads(line) for line in out.splitlines()]
    assert len(docs) == 3 and all(d["next_seq"] == 10 for d in docs)
    code, out, _ = run(capsys, "stat", busy_spool.path, "--watch", "0.05", "--count", "2")
    assert code == 0 and out.count("spool       ") == 2


def test_stat_prometheus(capsys, busy_spool):
    code, out, _ = run(capsys, "stat", busy_spool.path, "--format", "prometheus")
    assert code == 0
    p = busy_spool.path
    assert "# HELP shmq_puts_total " in out and "# TYPE shmq_puts_total counter" in out
    assert f'shmq_puts_total{{spool="{p}"}} 10' in out
    assert f'shmq_frames{{spool="{p}"}} 10' in out
    assert f'shmq_reader_lag{{spool="{p}",reader="indexer",kind="reader"}} 6' in out
    assert f'shmq_reader_position{{spool="{p}",reader="workers",kind="group"}} 1' in out
    assert "# TYPE shmq_reader_lag gauge" in out
    # every sample line belongs to a declared metric
    declared = {ln.split()[2] for ln in out.splitlines() if ln.startswith("# TYPE")}
    for ln in out.splitlines():
        if ln and not ln.startswith("#"):
            assert ln.split("{")[0] in declared


def test_prometheus_label_escaping(make_spool):
    sp = make_spool(name="esc")
    sp.reader('we"ird\\name').close()
    text = prometheus_text([sp.stats()])
    assert 'reader="we\\"ird\\\\name"' in text


def test_prometheus_client_collector(busy_spool, spool_dir):
    prometheus_client = pytest.importorskip("prometheus_client")
    from shmq.metrics import ShmqCollector

    registry = prometheus_client.CollectorRegistry()
    registry.register(ShmqCollector([spool_dir]))
    text = prometheus_client.generate_latest(registry).decode()
    assert f'shmq_puts_total{{spool="{busy_spool.path}"}} 10.0' in text
    assert f'shmq_up{{spool="{busy_spool.path}"}} 1.0' in text
    assert 'reader="indexer"' in text


# --- put / tail / cat -----------------------------------------------------------------


def test_put_arguments_stdin_and_files(capsys, monkeypatch, make_spool, tmp_path):
    sp = make_spool(name="p")
    code, out, _ = run(capsys, "put", sp.path, "hello", "world")
    assert code == 0 and "put 2 frames" in out and "(seq 0..1)" in out
    _stdin(monkeypatch, b"line one\nline two\n")
    code, out, _ = run(capsys, "put", sp.path, "--codec", "utf8", "--json")
    assert json.loads(out) == {"path": sp.path, "count": 2, "bytes": 16, "first_seq": 2,
                               "last_seq": 3}
    blob = tmp_path / "blob.bin"
    blob.write_bytes(bytes(range(256)))
    assert run(capsys, "put", sp.path, "--file", blob, "-q")[0] == 0
    code, _, _ = run(capsys, "put", sp.path, "--codec", "json", '{"a": [1, 2]}')
    assert code == 0
    assert [sp.read_at(s).data for s in range(6)] == [
        b"hello", b"world", b"line one", b"line two", bytes(range(256)), b'{"a": [1, 2]}']


def test_put_rejects_bad_json_and_full_spool(capsys, make_spool):
    sp = make_spool(name="p", capacity=4096, on_full="error")
    code, _, err = run(capsys, "put", sp.path, "--codec", "json", "{nope")
    assert code == cli.EXIT_USAGE and "not valid JSON" in _one_error_line(err)
    assert sp.next_seq == 0
    sp.reader("keep").close()  # error policy: unconsumed frames are never overwritten
    code, _, err = run(capsys, "put", sp.path, *(["x" * 500] * 20))
    assert code == cli.EXIT_FULL and "is full" in _one_error_line(err)
    assert 0 < sp.next_seq < 20


@pytest.fixture
def codec_spool(make_spool):
    sp = make_spool(name="codecs", capacity="64KiB")
    sp.put(b"plain text")
    sp.put("ünïcode".encode(), codec=F.CODEC_UTF8)
    sp.put(b'{"k": [1, 2]}', codec=F.CODEC_JSON)
    sp.put(pickle.dumps({"secret": 42}), codec=F.CODEC_PICKLE)
    sp.put(bytes([0, 1, 2, 255]))
    sp.put(b"\x93NUMPY...", codec=F.CODEC_NUMPY)
    return sp


def test_tail_auto_decodes_by_codec(capsys, codec_spool):
    code, out, _ = run(capsys, "tail", codec_spool.path)
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 6
    assert [ln.split("  ")[0] for ln in lines] == ["0", "1", "2", "3", "4", "5"]
    assert lines[0].endswith("raw  10 B  plain text")
    assert lines[1].endswith("utf8  9 B  ünïcode")
    assert lines[2].endswith('json  13 B  {"k":[1,2]}')
    assert "<pickle:" in lines[3] and "--unsafe-pickle" in lines[3] and "secret" not in lines[3]
    assert lines[4].endswith("b'\\x00\\x01\\x02\\xff'")
    assert "<numpy: 9 bytes; undecodable" in lines[5]  # not a real numpy payload
    code, out, _ = run(capsys, "tail", codec_spool.path, "--unsafe-pickle", "--from", "3", "-n", "1")
    assert out.rstrip().endswith("{'secret': 42}")


def test_tail_formats(capsys, codec_spool):
    code, out, _ = run(capsys, "tail", codec_spool.path, "--format", "json")
    docs = [json.loads(ln) for ln in out.splitlines()]
    assert [d["seq"] for d in docs] == list(range(6))
    assert set(docs[0]) == {"seq", "timestamp_ns", "time", "codec", "length", "data"}
    assert docs[0]["data"] == "plain text" and docs[1]["data"] == "ünïcode"
    assert docs[2]["data"] == {"k": [1, 2]} and docs[2]["codec"] == "json"
    assert docs[3]["data"] is None and "repr" not in docs[3]
    assert pickle.loads(__import__("base64").b64decode(docs[3]["base64"])) == {"secret": 42}
    assert docs[4]["base64"] == "AAEC/w==" and docs[4]["data"] is None
    assert docs[0]["time"].endswith("Z")
    code, out, _ = run(capsys, "tail", codec_spool.path, "--format", "hex", "--from", "4", "-n", "1")
    assert "00000000  00 01 02 ff" in out
    code, out, _ = run(capsys, "tail", codec_spool.path, "--format", "repr", "--from", "0", "-n", "1")
    assert out.rstrip().endswith("b'plain text'")


def test_tail_raw_writes_payload_bytes(make_spool):
    sp = make_spool(name="raw")
    sp.put(b"\x00\xffbinary")
    sp.put(b"two")
    res = subprocess.run([sys.executable, "-m", "shmq", "tail", sp.path, "--format", "raw"],
                         capture_output=True, timeout=bound(60))
    assert res.returncode == 0 and res.stdout == b"\x00\xffbinary\ntwo\n"


def test_tail_last_n_and_from(capsys, make_spool):
    sp = make_spool(name="t")
    for i in range(30):
        sp.put(f"m{i}".encode())
    seqs = lambda out: [int(ln.split()[0]) for ln in out.splitlines()]  # noqa: E731
    assert seqs(run(capsys, "tail", sp.path)[1]) == list(range(20, 30))
    assert seqs(run(capsys, "tail", sp.path, "-n", "3")[1]) == [27, 28, 29]
    assert seqs(run(capsys, "tail", sp.path, "--from", "earliest", "-n", "2")[1]) == [0, 1]
    assert seqs(run(capsys, "tail", sp.path, "--from", "25")[1]) == [25, 26, 27, 28, 29]
    assert run(capsys, "tail", sp.path, "--from", "latest")[1] == ""
    assert run(capsys, "tail", sp.path, "-n", "0")[1] == ""
    code, _, err = run(capsys, "tail", sp.path, "--from", "99")
    assert code == cli.EXIT_USAGE and "beyond the next seq" in _one_error_line(err)
    assert sp.readers() == []  # tail reads anonymously: no trace in the reader table


def test_tail_without_follow_ends_despite_busy_writers(capsys, make_spool):
    sp = make_spool(name="busy", capacity="256KiB")
    sp.put_many([b"seed"] * 100)
    stop = threading.Event()

    def writer():
        with shmq.Spool.open(sp.path) as w:
            while not stop.is_set():
                w.put_many([b"more"] * 50)

    t = threading.Thread(target=writer)
    t.start()
    try:
        code, out, _ = run(capsys, "tail", sp.path, "-n", "3")
        code2, out2, _ = run(capsys, "tail", sp.path, "--from", "earliest")
    finally:
        stop.set()
        t.join(bound(10))
    assert code == code2 == 0 and len(out.splitlines()) == 3
    assert len(out2.splitlines()) > 0


def test_tail_counts_overwritten_frames(capsys, make_spool):
    sp = make_spool(name="t", capacity=4096)
    for i in range(200):
        sp.put(b"z" * 50)
    code, out, err = run(capsys, "tail", sp.path, "-n", "5")
    assert code == 0 and len(out.splitlines()) == 5
    code, out, err = run(capsys, "tail", sp.path, "--from", "0", "-n", "2")
    assert code == 0 and [int(ln.split()[0]) for ln in out.splitlines()] == [
        sp.first_seq, sp.first_seq + 1]
    assert "seq 0 was overwritten; starting at the oldest frame" in err


def test_tail_follow_sees_new_frames(capsys, make_spool):
    sp = make_spool(name="f")
    sp.put(b"old")

    def writer():
        time.sleep(0.3)
        with shmq.Spool.open(sp.path) as w:
            for i in range(3):
                w.put(f"new {i}".encode())

    t = threading.Thread(target=writer)
    t.start()
    try:
        code, out, _ = run(capsys, "tail", sp.path, "-f", "--timeout", "1.5", "-n", "1")
    finally:
        t.join(bound(10))
    assert code == 0
    assert [ln.split("  ")[-1] for ln in out.splitlines()] == ["old", "new 0", "new 1", "new 2"]


def test_tail_follow_subprocess(make_spool):
    """`tail -f --from latest` prints frames put after it started, flushed one by one.

    Synchronized through the spool itself: pings are put until the tail echoes
    one (it has attached and is following), then the live frames follow.
    """
    sp = make_spool(name="f")
    proc = subprocess.Popen([sys.executable, "-m", "shmq", "tail", sp.path, "-f", "--from",
                             "latest", "--format", "raw", "--timeout", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:  # until the tail shows it is attached by echoing a ping
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "tail never echoed a ping"
            sp.put(b"ping")
            ready, _, _ = select.select([proc.stdout], [], [], 0.2)
            if ready:
                break
        assert proc.stdout.readline() == b"ping\n"
        for i in range(3):
            sp.put(f"live {i}".encode())
        live = []
        while len(live) < 3:  # bounded: the tail exits after --timeout idle seconds (EOF)
            line = proc.stdout.readline()
            if not line:
                break
            if line != b"ping\n":  # pings put before the first echo may still be in flight
                live.append(line)
    finally:
        proc.kill()
        proc.wait(bound(10))
    assert live == [b"live 0\n", b"live 1\n", b"live 2\n"]


def test_cat_range_and_lost_frames(capsys, make_spool):
    sp = make_spool(name="c")
    for i in range(10):
        sp.put(f"f{i}".encode())
    code, out, _ = run(capsys, "cat", sp.path, "--from", "2", "--to", "4")
    assert code == 0 and [ln.split("  ")[-1] for ln in out.splitlines()] == ["f2", "f3", "f4"]
    code, out, _ = run(capsys, "cat", sp.path, "--from", "8", "--format", "json")
    assert [json.loads(ln)["data"] for ln in out.splitlines()] == ["f8", "f9"]
    code, _, err = run(capsys, "cat", sp.path, "--from", "5", "--to", "10")
    assert code == cli.EXIT_LOST and "not been written yet" in _one_error_line(err)

    small = make_spool(name="small", capacity=4096)
    for i in range(200):
        small.put(b"q" * 50)
    first = small.first_seq
    code, _, err = run(capsys, "cat", small.path, "--from", "0", "--to", first)
    assert code == cli.EXIT_LOST and "overwritten" in _one_error_line(err)
    code, out, err = run(capsys, "cat", small.path, "--from", first - 2, "--to", first,
                         "--skip-lost")
    assert code == 0 and len(out.splitlines()) == 1 and "skipped 2" in err


# --- readers --------------------------------------------------------------------------


def test_readers_list_seek_rm(capsys, make_spool):
    sp = make_spool(name="r")
    for i in range(10):
        sp.put(b"%d" % i)
    r = sp.reader("idx")
    for _ in range(6):
        r.get()
    r.close()
    sp.reader("grp", group=True).close()
    code, out, _ = run(capsys, "readers", sp.path, "--json")
    rows = {d["name"]: d for d in json.loads(out)}
    assert rows["idx"]["position"] == 6 and rows["idx"]["lag"] == 4
    assert rows["grp"]["kind"] == "group" and rows["grp"]["position"] == 0
    code, out, _ = run(capsys, "readers", sp.path)
    assert code == 0 and "idx" in out and "grp" in out and out.startswith("NAME")
    assert run(capsys, "readers", "list", sp.path)[0] == 0

    def pos(name):
        return {x.name: x.position for x in sp.readers()}[name]

    code, out, _ = run(capsys, "readers", "seek", sp.path, "idx", "earliest")
    assert code == 0 and "seq 6 -> 0" in out and pos("idx") == 0
    assert run(capsys, "readers", "seek", sp.path, "idx", "latest")[0] == 0 and pos("idx") == 10
    code, out, _ = run(capsys, "readers", "seek", sp.path, "idx", "3", "--json")
    assert json.loads(out)["old_position"] == 10 and pos("idx") == 3
    assert run(capsys, "readers", "seek", sp.path, "grp", "7")[0] == 0 and pos("grp") == 7
    code, _, err = run(capsys, "readers", "seek", sp.path, "nobody", "0")
    assert code == cli.EXIT_NOT_FOUND and "--create" in _one_error_line(err)
    assert all(x.name != "nobody" for x in sp.readers())
    code, out, _ = run(capsys, "readers", "seek", sp.path, "newbie", "5", "--create")
    assert code == 0 and pos("newbie") == 5
    code, _, err = run(capsys, "readers", "seek", sp.path, "idx", "50")
    assert code == cli.EXIT_USAGE and "beyond" in _one_error_line(err)
    # the reader resumes where it was moved
    r = sp.reader("idx")
    assert r.get(timeout=1).data == b"3"
    r.close()
    code, out, _ = run(capsys, "readers", "rm", sp.path, "idx", "newbie")
    assert code == 0 and {x.name for x in sp.readers()} == {"grp"}
    code, _, err = run(capsys, "readers", "rm", sp.path, "idx")
    assert code == cli.EXIT_NOT_FOUND and "no reader or group named 'idx'" in err


def test_readers_seek_and_rm_refuse_an_attached_reader(capsys, make_spool):
    sp = make_spool(name="busy")
    sp.put(b"x")
    other = shmq.Spool.open(sp.path)  # another open file description: like another process
    r = other.reader("held")
    try:
        code, _, err = run(capsys, "readers", "seek", sp.path, "held", "earliest")
        assert code == cli.EXIT_BUSY and "attached by another process" in _one_error_line(err)
        code, _, err = run(capsys, "readers", "rm", sp.path, "held")
        assert code == cli.EXIT_BUSY and "attached" in _one_error_line(err)
    finally:
        r.close()
        other.close()
    assert run(capsys, "readers", "seek", sp.path, "held", "earliest")[0] == 0


# --- fsck (CLI side; shmq.verify has its own tests) ---------------------------------------


def test_fsck_clean_json(capsys, busy_spool):
    code, out, _ = run(capsys, "fsck", busy_spool.path, "--json")
    assert code == 0
    d = json.loads(out)
    assert d["ok"] is True and d["problems"] == [] and d["exit_code"] == 0
    assert d["frames_checked"] == 10 and d["crc_verified"] == 10 and d["readers_checked"] == 2
    code, out, _ = run(capsys, "fsck", busy_spool.path)
    assert code == 0 and out.splitlines()[-1] == "clean"


def test_fsck_corrupt_frame_and_repair_leaves_it(capsys, make_spool):
    sp = make_spool(name="bad")
    for i in range(5):
        sp.put(b"x" * 40)
    o = sp.ring.base + sp.ring.locate(2) % sp.ring.size
    sp.mapping.mm[o] ^= 0x55
    code, out, _ = run(capsys, "fsck", sp.path)
    assert code == 1 and "PROBLEM: ring: expected frame 2" in out
    code, out, _ = run(capsys, "fsck", sp.path, "--repair", "--json")
    assert code == 1 and json.loads(out)["ok"] is False
    sp.mapping.mm[o] ^= 0x55


def test_fsck_stale_lock_repair_lets_puts_through(capsys, make_spool):
    sp = make_spool(name="locked")
    sp.put(b"before")
    sp.writer_lock.sem.acquire()
    pid = os.fork()  # a bare fork: only a pid that was alive and is gone is wanted
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    sp.ring.ctl[F.W_LOCK_HOLDER] = pid
    code, out, _ = run(capsys, "fsck", sp.path)
    assert code == 1 and f"held by pid {pid}, which is dead" in out
    code, out, _ = run(capsys, "fsck", sp.path, "--repair")
    assert code == 0 and "repaired: broke the writer lock" in out
    assert "clean after repair" in out
    assert sp.put(b"after", timeout=0.5) == 1
    assert json.loads(run(capsys, "stat", sp.path, "--json")[1])["lock_token"] == 1


# --- export / import -------------------------------------------------------------------


def _frames(sp):
    from shmq.dump import iter_records

    return [(r.seq, r.timestamp_ns, r.codec, r.data) for r in iter_records(sp)]


def test_export_import_roundtrip(capsys, codec_spool, spool_dir):
    sp = codec_spool
    r = sp.reader("idx")
    r.get()
    r.get()
    r.close()
    sp.reader("grp", group=True).close()
    dump = os.path.join(spool_dir, "dump.shmq")
    code, out, _ = run(capsys, "export", sp.path, dump, "--json")
    assert code == 0
    s = json.loads(out)
    assert s["frames"] == 6 and s["readers"] == 2 and s["lost"] == 0
    copy = os.path.join(spool_dir, "copy")
    code, out, err = run(capsys, "import", dump, copy, "--progress", "--json")
    assert code == 0 and "importing into" in err
    s = json.loads(out)
    assert s["frames"] == 6 and {x["name"]: x["position"] for x in s["readers"]} == {
        "idx": 2, "grp": 0}
    with shmq.Spool.open(copy) as cp:
        assert _frames(cp) == _frames(sp)  # seqs, timestamps, codecs, payloads
        assert cp.capacity == sp.capacity and cp.on_full == sp.on_full
        assert {x.name: (x.kind, x.position) for x in cp.readers()} == {
            "idx": ("reader", 2), "grp": ("group", 0)}
    assert oct(os.stat(copy).st_mode & 0o777) == "0o600"
    code, _, err = run(capsys, "import", dump, copy)
    assert code == cli.EXIT_EXISTS
    code, _, err = run(capsys, "export", sp.path, dump)
    assert code == cli.EXIT_EXISTS and "refusing to overwrite" in err


def test_import_append_and_new_geometry(capsys, make_spool, spool_dir):
    src = make_spool(name="src")
    for i in range(5):
        src.put(b"s%d" % i)
    src.reader("r").close()
    dump = os.path.join(spool_dir, "d")
    assert run(capsys, "export", src.path, dump, "-q")[0] == 0
    dst = make_spool(name="dst", capacity="64KiB")
    for i in range(3):
        dst.put(b"d%d" % i)
    code, out, _ = run(capsys, "import", dump, dst.path, "--append", "--new-timestamps", "--json")
    s = json.loads(out)
    assert code == 0 and (s["first_seq"], s["next_seq"]) == (3, 8)
    assert [dst.read_at(i).data for i in range(8)] == [b"d0", b"d1", b"d2"] + [
        b"s%d" % i for i in range(5)]
    assert {x.name: x.position for x in dst.readers()} == {"r": 3}  # mapped to the new seq
    assert run(capsys, "import", dump, dst.path, "--append", "-q")[0] == 0
    assert {x.name: x.position for x in dst.readers()} == {"r": 3}  # existing reader kept
    other = os.path.join(spool_dir, "resized")
    code, _, _ = run(capsys, "import", dump, other, "--capacity", "8KiB", "--on-full", "block",
                     "--mode", "0640")
    assert code == 0
    with shmq.Spool.open(other) as sp:
        assert sp.capacity == 8192 and sp.on_full == "block" and sp.next_seq == 5
    assert os.stat(other).st_mode & 0o777 == 0o640


def test_import_into_too_small_block_spool_fails_clearly(capsys, make_spool, spool_dir):
    src = make_spool(name="src", capacity="64KiB")
    for i in range(100):
        src.put(b"p" * 200)
    dump = os.path.join(spool_dir, "d")
    assert run(capsys, "export", src.path, dump, "-q")[0] == 0
    code, _, err = run(capsys, "import", dump, os.path.join(spool_dir, "tiny"), "--capacity",
                       "4KiB", "--on-full", "error", "--timeout", "0.5")
    assert code == cli.EXIT_FULL and "larger --capacity" in _one_error_line(err)


def test_import_rejects_bad_dumps(capsys, make_spool, spool_dir):
    src = make_spool(name="src")
    for i in range(20):
        src.put(b"v" * 100)
    dump = os.path.join(spool_dir, "d")
    assert run(capsys, "export", src.path, dump, "-q")[0] == 0
    with open(dump, "rb") as f:
        raw = f.read()
    bad = os.path.join(spool_dir, "bad")
    for content, code, message in [
            (b"definitely not a dump", cli.EXIT_NOT_SPOOL, "not a shmq dump"),
            (raw[:len(raw) // 2], cli.EXIT_CORRUPT, "truncated"),
            (raw[:-30] + bytes([raw[-30] ^ 1]) + raw[-29:], cli.EXIT_CORRUPT, "damaged"),
            (raw[:8] + struct.pack("<I", 99) + raw[12:], cli.EXIT_CORRUPT, "newer")]:
        with open(bad, "wb") as f:
            f.write(content)
        target = os.path.join(spool_dir, "t")
        got, _, err = run(capsys, "import", bad, target)
        assert got == code and message in _one_error_line(err), err
        if os.path.exists(target):
            shmq.Spool.destroy(target)
    code, _, err = run(capsys, "import", os.path.join(spool_dir, "none"), os.path.join(spool_dir, "t"))
    assert code == cli.EXIT_NOT_FOUND


def test_export_import_through_a_pipe(make_spool, spool_dir):
    src = make_spool(name="src")
    for i in range(50):
        src.put(b"piped %d" % i, codec=F.CODEC_UTF8)
    dst = os.path.join(spool_dir, "dst")
    exp = subprocess.Popen([sys.executable, "-m", "shmq", "export", src.path, "-"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    imp = subprocess.run([sys.executable, "-m", "shmq", "import", "-", dst, "--json"],
                         stdin=exp.stdout, capture_output=True, timeout=bound(60))
    exp.stdout.close()
    assert exp.wait(bound(30)) == 0 and imp.returncode == 0, imp.stderr
    assert json.loads(imp.stdout)["frames"] == 50
    with shmq.Spool.open(dst) as sp:
        assert _frames(sp) == _frames(src)


# --- top ---------------------------------------------------------------------------------


def test_top_once(capsys, spool_dir, busy_spool, make_spool):
    other = make_spool(name="other", on_full="block")
    for _ in range(5):
        other.put(b"y")
    code, out, _ = run(capsys, "top", spool_dir, "--once")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("shmq top - ") and "2 spools" in lines[0]
    assert lines[1].split()[:2] == ["SPOOL", "POLICY"]
    body = "\n".join(lines[2:])
    assert "busy" in body and "other" in body and "block" in body
    assert any(ch in body for ch in cli.SPARK)
    readers = {ln.split()[1]: ln.split() for ln in lines if ln.startswith("busy ")
               and ln.split()[1] in ("indexer", "workers")}
    assert readers["indexer"][2:6] == ["reader", "4", "6", "0"]  # kind, position, lag, lost
    assert readers["workers"][2:6] == ["group", "1", "9", "0"]
    assert "\x1b" not in out  # no escape codes without a terminal


def test_top_without_a_terminal_prints_whole_lines(capsys, spool_dir, busy_spool, make_spool):
    # a long name widens the SPOOL column past any fixed width: no column may be cut
    # (another user's anonymous queues on the host widen it the same way)
    make_spool(name="n" * 200)
    code, out, _ = run(capsys, "top", spool_dir, "--count", "1")
    assert code == 0
    lines = out.splitlines()
    assert lines[1].split()[-1] == "LOCK" and len(lines[1]) > 200
    assert any(ln.startswith("n" * 200) and ln.split()[-1] in ("free", "held") for ln in lines)


def test_top_count_and_errors(capsys, spool_dir, busy_spool):
    code, out, _ = run(capsys, "top", busy_spool.path, "--count", "2", "--interval", "0.05")
    assert code == 0 and out.count("shmq top - ") == 2
    code, _, err = run(capsys, "top", os.path.join(spool_dir, "nope"), "--once")
    assert code == cli.EXIT_NOT_FOUND


def _read_until(fd, needle, timeout):
    buf = b""
    deadline = time.monotonic() + timeout
    while needle not in buf and time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
    return buf


def _drain_until_exit(fd, proc, timeout):
    """Read ``fd`` until ``proc`` exits (bounded), and return what was read.

    top keeps redrawing until it sees the key; a pty nobody reads fills up and
    blocks its writes (and then it cannot read the key, or restore the
    terminal on the way out): keep draining while waiting for it to exit.
    """
    buf = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child closed its side
                chunk = b""
            buf += chunk
            if chunk:
                continue
        if proc.poll() is not None:
            return buf
    raise AssertionError("top did not exit after the key")


def _pty_top(spool_dir, controlling):
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))

    def setup():
        if controlling:  # make the pty our controlling terminal, so ^C raises SIGINT
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen([sys.executable, "-m", "shmq", "top", spool_dir, "--interval", "0.2"],
                            stdin=slave, stdout=slave, stderr=slave, preexec_fn=setup,
                            close_fds=True)
    os.close(slave)
    return master, proc


@pytest.mark.parametrize("key,controlling", [(b"q", False), (b"\x03", True)])
def test_top_interactive_quits_on_key(spool_dir, busy_spool, key, controlling):
    master, proc = _pty_top(spool_dir, controlling)
    try:
        screen = _read_until(master, b"indexer", 30)
        assert b"shmq top - " in screen and b"q: quit" in screen
        assert b"\x1b[?1049h" in screen  # alternate screen
        os.write(master, key)
        rest = _drain_until_exit(master, proc, 60)
        assert proc.returncode == 0
        assert b"\x1b[?1049l" in screen + rest  # terminal restored
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(bound(10))
        os.close(master)


# --- errors through a real process ------------------------------------------------------


def test_error_exit_codes_subprocess(spool_dir, make_spool):
    missing = os.path.join(spool_dir, "missing")
    res = shmq_cmd("stat", missing)
    assert res.returncode == cli.EXIT_NOT_FOUND
    assert _one_error_line(res.stderr) == (f"shmq stat: {missing}: no such spool (create it with "
                                          "'shmq create')")
    foreign = os.path.join(spool_dir, "foreign")
    with open(foreign, "wb") as f:
        f.write(b"#!/bin/sh\necho hi\n" * 400)
    for cmd in (["stat", foreign], ["tail", foreign], ["fsck", foreign], ["readers", foreign]):
        res = shmq_cmd(*cmd)
        assert res.returncode == cli.EXIT_NOT_SPOOL, (cmd, res.stderr)
        assert "not a shmq spool" in _one_error_line(res.stderr)
    res = shmq_cmd("tail", spool_dir)  # (stat takes a directory: the spools in it)
    assert res.returncode == cli.EXIT_NOT_SPOOL and "directory" in _one_error_line(res.stderr)
    res = shmq_cmd("stat", spool_dir)  # only a foreign file in it
    assert res.returncode == cli.EXIT_NOT_FOUND and "no spools" in _one_error_line(res.stderr)
    sp = make_spool(name="corrupt")
    sp.put(b"x")
    sp.ring.ctl[F.W_FIRST_SEQ] = 99
    res = shmq_cmd("stat", sp.path)
    assert res.returncode == cli.EXIT_CORRUPT
    assert "control block is corrupt" in _one_error_line(res.stderr)
    res = shmq_cmd("fsck", sp.path)
    assert res.returncode == cli.EXIT_PROBLEMS and "FIRST_SEQ 99" in res.stdout
    sp.ring.ctl[F.W_FIRST_SEQ] = 0


def _main_as_nobody(argv):
    """Run ``main(argv)`` in a forked child as an unprivileged user; (exit code, stderr)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 99
        try:
            os.close(r)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            sys.stderr = os.fdopen(w, "w")
            code = main(argv)
            sys.stderr.flush()
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        err = f.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), err


def test_permission_denied(spool_dir, make_spool):
    sp = make_spool(name="private")  # mode 0600, owned by us
    sp.put(b"secret")
    if os.geteuid() == 0:
        os.chmod(spool_dir, 0o755)  # the directory is searchable, the file is not readable
    else:
        os.chmod(sp.path, 0)
    try:
        for cmd in (["stat", sp.path], ["tail", sp.path], ["fsck", sp.path],
                    ["readers", "seek", sp.path, "x", "0"], ["put", sp.path, "x"]):
            code, err = _main_as_nobody(cmd)
            assert code == cli.EXIT_PERMISSION, (cmd, err)
            assert "permission denied" in _one_error_line(err)
    finally:
        os.chmod(sp.path, 0o600)
        os.chmod(spool_dir, 0o700)


def test_python_m_shmq_end_to_end(spool_dir):
    path = os.path.join(spool_dir, "e2e")
    assert shmq_cmd("create", path, "--capacity", "64KiB").returncode == 0
    res = subprocess.run([sys.executable, "-m", "shmq", "put", path, "--codec", "utf8"],
                         input="a\nb\nc\n", capture_output=True, text=True, timeout=bound(60))
    assert res.returncode == 0 and "put 3 frames" in res.stdout
    res = shmq_cmd("tail", path, "--format", "json")
    assert [json.loads(ln)["data"] for ln in res.stdout.splitlines()] == ["a", "b", "c"]
    res = shmq_cmd("stat", path, "--json")
    assert json.loads(res.stdout)["next_seq"] == 3
    assert shmq_cmd("fsck", path).returncode == 0
    assert shmq_cmd("rm", path).returncode == 0
    assert not os.path.exists(path)


def test_broken_pipe_is_quiet(make_spool):
    sp = make_spool(name="many", capacity="4MiB")
    sp.put_many([b"line %d" % i for i in range(20000)])
    cmd = f"{sys.executable} -m shmq tail {sp.path} --from earliest | head -1"
    res = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True,
                         timeout=bound(60))
    assert res.stdout.startswith("0  ")
    assert "Traceback" not in res.stderr and res.returncode in (0, cli.EXIT_PIPE)


def test_tail_shows_numpy_and_arrow_frames(capsys, make_spool):
    import numpy as np

    sp = make_spool()
    sp.put_array(np.arange(10.0))
    sp.put_many(np.zeros(5, dtype=[("a", "<i4"), ("b", "S3")]))
    rc, out, _err = run(capsys, "tail", sp.path, "-n", "5")
    assert rc == 0
    lines = out.splitlines()
    assert "numpy float64 shape (10,): [0. 1. 2.] ..." in lines[0]
    assert "shape (5,)" in lines[1] and "('a', '<i4')" in lines[1]
    pa = pytest.importorskip("pyarrow")
    sp.put_arrow(pa.table({"x": [1, 2, 3], "y": ["a", None, "c"]}))
    rc, out, _err = run(capsys, "tail", sp.path, "--from", "2")
    assert "arrow 3 rows [x: int64, y: string]" in out


def test_stat_shows_work_queue(capsys, spool_dir):
    path = os.path.join(spool_dir, "wq")
    wq = shmq.WorkQueue(path, capacity="1MiB")
    wq.put_many(range(5))
    wq.get(timeout=1)
    try:
        rc, out, _err = run(capsys, "stat", path)
        assert rc == 0 and "work queue: ready 4, in flight 1" in out
        rc, out, _err = run(capsys, "stat", "--json", path)
        assert json.loads(out)["workqueue"]["in_flight"] == 1
        rc, out, _err = run(capsys, "stat", "--format", "prometheus", path)
        assert f'shmq_workqueue_in_flight{{spool="{path}"}} 1' in out
    finally:
        wq.close()
        shmq.WorkQueue.destroy(path)


def _hold_queue(q, ready, done):
    q.put("held")  # attaches: this process now has the queue mapped
    ready.set()
    done.wait(bound(60))


def test_ls_anonymous_lists_queues_with_who_has_them_open(capsys, ctx):
    q = shmq.Queue(capacity="64KiB")
    ready, done = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold_queue, args=(q, ready, done))
    p.start()
    planted = []
    try:
        assert ready.wait(bound(60))
        # look-alikes that are not ours are never listed: a link, another user's file
        base = os.path.join(shmq.queue.ANONYMOUS_DIR, shmq.queue.ANONYMOUS_PREFIX + "test" + os.urandom(4).hex())
        os.symlink(q.path, base + "-link")
        planted.append(base + "-link")
        with open(base + "-theirs", "wb") as f:
            f.write(open(q.path, "rb").read(F.HEADER_BYTES))
        planted.append(base + "-theirs")
        os.chown(base + "-theirs", 54321, 54321)
        code, out, _ = run(capsys, "ls", "--anonymous", "--json")
        assert code == 0
        rows = {r["path"]: r for r in json.loads(out) if r.get("anonymous")}
        assert q.path in rows and not any(path.startswith(base) for path in rows)
        assert rows[q.path]["frames"] == 1 and p.pid in rows[q.path]["open_by"]
        code, out, _ = run(capsys, "ls", "-a")
        assert code == 0 and "OPEN BY" in out.splitlines()[0]
        line = next(ln for ln in out.splitlines() if ln.startswith(q.path))
        assert str(p.pid) in line.split()[-1].split(",")
        code, out, _ = run(capsys, "ls", "--json")  # without the flag: not listed
        assert all(r["path"] != q.path for r in json.loads(out))
    finally:
        done.set()
        p.join(bound(30))
        for path in planted:
            os.unlink(path)
        q.close()


def test_top_anonymous_shows_queues_with_who_has_them_open(capsys, ctx, spool_dir, busy_spool):
    q = shmq.Queue(capacity="64KiB")
    ready, done = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold_queue, args=(q, ready, done))
    p.start()
    try:
        assert ready.wait(bound(60))
        code, out, _ = run(capsys, "top", spool_dir, "-a", "--count", "1")
        assert code == 0
        lines = out.splitlines()
        assert "anonymous" in lines[0] and lines[1].split()[-2:] == ["OPEN", "BY"]
        line = next(ln for ln in lines if ln.startswith(os.path.basename(q.path)))
        assert line.split()[1] == "block" and str(p.pid) in line.split()[-1].split(",")
        assert any(ln.startswith("busy ") for ln in lines)  # the directory's spools still shown
        code, out, _ = run(capsys, "top", spool_dir, "--count", "1")  # without the flag: not shown
        assert code == 0 and os.path.basename(q.path) not in out and "OPEN BY" not in out
    finally:
        done.set()
        p.join(bound(30))
        q.close()
