"""shmq pub / shmq sub over ZeroMQ on loopback (127.0.0.1 only): exactly once across a killed
subscriber and a killed publisher, exact loss reports, CURVE refusing strangers."""

import os
import re
import signal
import socket
import subprocess
import sys

import pytest

import shmq
from shmq import _format as F
from shmq import cli
from shmq._mapping import read_geometry
from shmq.dump import record_at

from conftest import bound

zmq = pytest.importorskip("zmq")


def _frames(path):
    with shmq.Spool.open(path) as sp:
        return [(r.data, r.codec) for r in (record_at(sp, s) for s in range(sp.first_seq,
                                                                              sp.next_seq))]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pub(src, endpoint, *args):
    """Start ``shmq pub``; return (process, the endpoint it bound)."""
    proc = subprocess.Popen([sys.executable, "-m", "shmq", "pub", src, endpoint, *args],
                            stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()  # "shmq pub: PATH on tcp://127.0.0.1:PORT" once bound
    m = re.search(r"on (tcp://\S+)", line)
    if not m:
        proc.kill()
        proc.wait(bound(10))
        raise AssertionError(f"pub did not start: {line}{proc.stderr.read()}")
    return proc, m.group(1)


def _stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(bound(30))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(bound(10))


def _sub(endpoint, dst, *args, env=None, timeout="1.5"):
    return subprocess.run([sys.executable, "-m", "shmq", "sub", endpoint, dst, "--timeout",
                           timeout, "--silence", "0.5", *args], capture_output=True, text=True,
                          timeout=bound(120), env=dict(os.environ, **(env or {})))


@pytest.fixture
def pair(spool_dir):
    src, dst = os.path.join(spool_dir, "src"), os.path.join(spool_dir, "dst")
    a = shmq.Spool.create(src, capacity="1MiB", on_full="block")
    shmq.Spool.create(dst, capacity="1MiB", on_full="block").close()
    yield a, src, dst
    a.close()


def test_pub_sub_copies_frames_and_marks_the_spool_untrusted(pair):
    a, src, dst = pair
    a.put_many([b"a", b"b"])
    a.put(b'{"k": 1}', codec=F.CODEC_JSON)
    a.put(b"\x80\x04K\x01.", codec=F.CODEC_PICKLE)  # never unpickled by sub
    pub, ep = _pub(src, "tcp://127.0.0.1:*")
    try:
        assert ep.startswith("tcp://127.0.0.1:")
        res = _sub(ep, dst)
        assert res.returncode == 0, res.stderr
        assert "received 4 frame(s)" in res.stdout
    finally:
        assert _stop(pub) == 0
    assert _frames(dst) == _frames(src)
    assert F.from_network(read_geometry(dst)) and not F.from_network(read_geometry(src))
    with pytest.raises(shmq.ShmqError, match="fed from the network"):
        shmq.Queue(path=dst)


@pytest.mark.parametrize("point", ["before-put:1", "after-put:1", "after-state:1"])
def test_killed_subscriber_resumes_exactly_once(pair, point):
    a, src, dst = pair
    a.put_many([b"%d" % i for i in range(50)])
    pub, ep = _pub(src, "tcp://127.0.0.1:*", "--batch", "20")
    try:
        res = _sub(ep, dst, env={"SHMQ_TEST_TEE_CRASH": point})
        assert res.returncode == -9  # SIGKILLed in the crash window
        a.put_many([b"%d" % i for i in range(50, 80)])
        res = _sub(ep, dst)
        assert res.returncode == 0, res.stderr
    finally:
        _stop(pub)
    assert [d for d, _ in _frames(dst)] == [b"%d" % i for i in range(80)]


def test_killed_publisher_resumes_without_loss(pair):
    a, src, dst = pair
    port = _free_port()
    ep = f"tcp://127.0.0.1:{port}"
    a.put_many([b"%d" % i for i in range(30)])
    pub, _ = _pub(src, ep, "--batch", "10")
    sub = subprocess.Popen([sys.executable, "-m", "shmq", "sub", ep, dst, "--timeout", "20",
                            "--silence", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        with shmq.Spool.open(dst) as d:
            r = d.reader()
            assert r.get(timeout=bound(30)).data == b"0"  # the subscriber is receiving
            pub.kill()  # SIGKILL: no goodbye
            pub.wait(bound(10))
            a.put_many([b"%d" % i for i in range(30, 60)])
            pub, _ = _pub(src, ep, "--batch", "10")
            got = [b"0"]
            while len(got) < 60:
                got.append(r.get(timeout=bound(30)).data)
            r.close()
        assert got == [b"%d" % i for i in range(60)]
    finally:
        _stop(pub)
        sub.send_signal(signal.SIGTERM)
        sub.wait(bound(30))
    assert [d for d, _ in _frames(dst)] == [b"%d" % i for i in range(60)]


def test_frames_gone_from_the_publisher_are_reported_exactly(spool_dir):
    src, dst = os.path.join(spool_dir, "src"), os.path.join(spool_dir, "dst")
    a = shmq.Spool.create(src, capacity="4KiB")  # overwrite: a slow subscriber loses frames
    shmq.Spool.create(dst, capacity="1MiB").close()
    try:
        a.put_many([b"x%03d" % i for i in range(10)])
        pub, ep = _pub(src, "tcp://127.0.0.1:*")
        try:
            assert _sub(ep, dst).returncode == 0
        finally:
            _stop(pub)
        for i in range(10, 400):  # the publisher's reader pub-sub is not attached: overwritten
            a.put(b"x%03d" % i)
        first = a.first_seq
        pub, ep = _pub(src, "tcp://127.0.0.1:*")
        try:
            res = _sub(ep, dst)
        finally:
            _stop(pub)
        assert res.returncode == 0, res.stderr
        assert f"lost {first - 10} frame(s) (seq 10..{first - 1})" in res.stderr
        assert f"; {first - 10:,} lost" in res.stdout
        assert [d for d, _ in _frames(dst)] == [b"x%03d" % i for i in
                                                list(range(10)) + list(range(first, 400))]
    finally:
        a.close()


def test_curve_refuses_an_unauthenticated_subscriber(pair, tmp_path):
    import zmq.auth

    a, src, dst = pair
    a.put(b"secret")
    keys, clients = tmp_path / "keys", tmp_path / "clients"
    keys.mkdir()
    clients.mkdir()
    server_pub, server_sec = zmq.auth.create_certificates(str(keys), "server")
    client_pub, client_sec = zmq.auth.create_certificates(str(keys), "client")
    _stranger_pub, stranger_sec = zmq.auth.create_certificates(str(keys), "stranger")
    os.rename(client_pub, clients / "client.key")
    pub, ep = _pub(src, "tcp://127.0.0.1:*", "--curve-secret", server_sec,
                   "--curve-clients", str(clients))
    try:
        res = _sub(ep, dst, timeout="1")  # no CURVE at all
        assert res.returncode == cli.EXIT_ERROR and "no answer" in res.stderr
        res = _sub(ep, dst, "--curve-secret", stranger_sec, "--curve-server", server_pub,
                   timeout="1")  # a key the publisher does not know
        assert res.returncode == cli.EXIT_ERROR and "no answer" in res.stderr
        with shmq.Spool.open(dst) as d:
            assert d.next_seq == 0
        res = _sub(ep, dst, "--curve-secret", client_sec, "--curve-server", server_pub)
        assert res.returncode == 0 and "received 1 frame(s)" in res.stdout, res.stderr
    finally:
        _stop(pub)
    assert _frames(dst) == [(b"secret", F.CODEC_RAW)]


@pytest.mark.parametrize("cmd", [["pub", "{src}", "127.0.0.1:5555"],
                                 ["sub", "http://127.0.0.1:5555", "{dst}"],
                                 ["pub", "{src}", "tcp://127.0.0.1:*", "--curve-secret", "x"]])
def test_pub_sub_bad_input(pair, cmd):
    _a, src, dst = pair
    args = [c.format(src=src, dst=dst) for c in cmd]
    res = subprocess.run([sys.executable, "-m", "shmq", *args], capture_output=True, text=True,
                         timeout=bound(60))
    assert res.returncode == cli.EXIT_USAGE, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
