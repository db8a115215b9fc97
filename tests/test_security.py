"""Other users are untrusted (docs/security.md): planted files never hang us and are never
followed, pickles load only from trusted spools (one codec layer), bare names live in a
private directory, squatted semaphore names are refused.

The tests that need a second, real user are in test_attacker.py.
"""

import collections
import os
import pickle
import socket
import stat
import threading

import pytest

import shmq
from shmq import _format as F
from shmq import _mapping, codec
from shmq.cli import EXIT_NOT_SPOOL, EXIT_PERMISSION, main
from conftest import bound, join_all
from helpers import squatted_group_member

PROMPT_S = 5.0  # "at once": a planted FIFO used to block forever


def prompt(fn, *args, **kw):
    """Run ``fn`` in a daemon thread; fail if it does not return within PROMPT_S.

    Returns ``(result, exception)``.  A hung call would be stuck in open(2);
    the daemon thread cannot keep the test process alive.
    """
    out = {}

    def run():
        try:
            out["result"] = fn(*args, **kw)
        except BaseException as exc:  # noqa: B902 - reported to the test
            out["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(PROMPT_S)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)}{args} blocked for {PROMPT_S} s"
    return out.get("result"), out.get("exc")


@pytest.fixture
def plant(spool_dir):
    """``plant(kind, path)``: put a FIFO, a socket or a symlink (to a real spool) at ``path``."""
    socks = []

    def make(kind, path):
        if kind == "fifo":
            os.mkfifo(path, 0o666)
        elif kind == "socket":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)
            s.listen(1)
            socks.append(s)
        elif kind == "symlink":
            target = os.path.join(spool_dir, "real-target")
            if not os.path.exists(target):
                shmq.Spool.create(target, capacity=4096).close()
            os.symlink(target, path)
        elif kind == "directory":
            os.mkdir(path)
        else:
            raise AssertionError(kind)
        return path

    yield make
    for s in socks:
        s.close()


KINDS = ["fifo", "socket", "symlink", "directory"]


# --- opening never blocks and never follows -------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_spool_open_and_create_refuse_a_planted_file_at_once(plant, spool_dir, kind):
    path = plant(kind, os.path.join(spool_dir, "s"))
    for call in (lambda: shmq.Spool.open(path),
                 lambda: shmq.Spool.create(path, capacity=4096, exist_ok=True),
                 lambda: shmq.Queue(path=path)):
        _r, exc = prompt(call)
        assert isinstance(exc, shmq.NotASpool), exc
        assert path in str(exc) and "not a shmq spool" in str(exc)
    _r, exc = prompt(shmq.Spool.create, path, capacity=4096)
    assert isinstance(exc, FileExistsError)
    assert os.path.lexists(path)


@pytest.mark.parametrize("kind", KINDS)
def test_destroy_refuses_a_planted_file_and_removes_nothing(plant, spool_dir, kind):
    path = plant(kind, os.path.join(spool_dir, "s"))
    _r, exc = prompt(shmq.Spool.destroy, path)
    assert isinstance(exc, shmq.NotASpool), exc
    assert os.path.lexists(path)
    if kind == "symlink":  # neither the link nor what it points to
        assert os.path.exists(os.path.join(spool_dir, "real-target"))


@pytest.mark.parametrize("kind", KINDS)
def test_verify_and_listing_skip_or_refuse_a_planted_file(plant, spool_dir, kind):
    from shmq.metrics import peek, spool_paths
    from shmq.verify import verify

    path = plant(kind, os.path.join(spool_dir, "s"))
    _r, exc = prompt(verify, path)
    assert isinstance(exc, shmq.NotASpool), exc
    _r, exc = prompt(peek, path)
    assert isinstance(exc, shmq.NotASpool), exc
    paths, exc = prompt(spool_paths, [spool_dir])
    assert exc is None and path not in paths


@pytest.mark.parametrize("kind", KINDS)
def test_workqueue_refuses_a_planted_main_or_side_file(plant, spool_dir, kind):
    path = os.path.join(spool_dir, "jobs")
    plant(kind, path)
    _r, exc = prompt(shmq.WorkQueue, path, capacity=65536, dead_capacity=8192)
    assert isinstance(exc, shmq.NotASpool), exc
    _r, exc = prompt(shmq.WorkQueue.destroy, path)
    assert isinstance(exc, shmq.NotASpool), exc
    assert os.path.lexists(path)


@pytest.mark.parametrize("kind", KINDS)
def test_workqueue_side_file_planted(plant, spool_dir, kind):
    path = os.path.join(spool_dir, "jobs")
    shmq.WorkQueue(path, capacity=65536, dead_capacity=8192).close()
    shmq.Spool.destroy(path + ".dead")
    plant(kind, path + ".dead")
    _r, exc = prompt(shmq.WorkQueue, path, capacity=65536, dead_capacity=8192)
    assert isinstance(exc, shmq.NotASpool) and path + ".dead" in str(exc), exc
    # destroy checks every side file first: nothing is removed, nothing blocks
    _r, exc = prompt(shmq.WorkQueue.destroy, path)
    assert isinstance(exc, shmq.NotASpool), exc
    assert os.path.exists(path) and os.path.lexists(path + ".dead")
    (os.rmdir if kind == "directory" else os.unlink)(path + ".dead")
    shmq.WorkQueue.destroy(path)
    assert not os.path.exists(path)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("argv", [["stat", "P"], ["rm", "P"], ["fsck", "P"], ["fsck", "--repair", "P"],
                                  ["tail", "-n", "1", "P"], ["cat", "P", "--from", "0"],
                                  ["readers", "P"], ["put", "P", "x"]])
def test_cli_on_a_planted_file_exits_not_a_spool(capsys, plant, spool_dir, kind, argv):
    path = plant(kind, os.path.join(spool_dir, "s"))
    code, exc = prompt(main, [path if a == "P" else a for a in argv])
    assert exc is None, exc
    err = capsys.readouterr().err
    if argv[0] == "stat" and kind == "directory":
        # stat takes directories too (it reports the spools in them): none here
        assert code == 3 and "no spools in this directory" in err, err
        return
    assert code == EXIT_NOT_SPOOL, err
    assert "not a shmq spool" in err and len(err.strip().splitlines()) == 1
    assert os.path.lexists(path)


@pytest.mark.parametrize("kind", KINDS)
def test_cli_export_ls_top_on_a_planted_file_return_promptly(capsys, plant, spool_dir, kind):
    path = plant(kind, os.path.join(spool_dir, "s"))
    code, exc = prompt(main, ["export", path, os.path.join(spool_dir, "out.dump")])
    assert (code, exc) == (EXIT_NOT_SPOOL, None)
    code, exc = prompt(main, ["ls", spool_dir, "--json"])
    assert (code, exc) == (0, None)
    assert path not in capsys.readouterr().out
    code, exc = prompt(main, ["top", "--once", "--interval", "0.01", path])
    assert (code, exc) == (0, None)
    out = capsys.readouterr().out
    assert ("no spools in" if kind == "directory" else "not a shmq spool") in out


@pytest.mark.parametrize("kind", KINDS)
def test_cli_stat_ignores_a_planted_dispatcher_board(capsys, plant, spool_dir, kind):
    path = os.path.join(spool_dir, "jobs")
    shmq.Spool.create(path, capacity=4096).close()
    plant(kind, path + ".dispatch")
    for argv in (["stat", path], ["stat", path, "--json"]):
        code, exc = prompt(main, argv)
        assert (code, exc) == (0, None), capsys.readouterr().err
    assert "dispatcher" not in capsys.readouterr().out


def test_open_file_refuses_a_device():
    with pytest.raises(shmq.NotASpool, match="character device"):
        shmq.Spool.open("/dev/null")


# --- one trust check, in the codec layer ----------------------------------------------


def _world_writable_queue(path, mode=0o666):
    sp = shmq.Spool.create(path, capacity=65536, on_full="block", mode=mode)
    sp.close()
    q = shmq.Queue(path=path, trusted=True)
    q.put({"x": 1})
    q.close()


@pytest.mark.parametrize("mode,who", [(0o666, "group and others"), (0o660, "group"),
                                      (0o602, "others")])
def test_queue_refuses_a_spool_others_can_write(spool_dir, mode, who):
    path = os.path.join(spool_dir, "q")
    _world_writable_queue(path, mode)
    for cls in (shmq.Queue, shmq.JoinableQueue, shmq.SimpleQueue):
        with pytest.raises(shmq.UntrustedSpool) as ei:
            cls(path=path)
        msg = str(ei.value)
        assert path in msg and f"writable by {who}" in msg and f"mode {mode:04o}" in msg
        assert "owner root" in msg or "owner " in msg
        assert "trusted=True" in msg
    q = shmq.Queue(path=path, trusted=True)
    assert q.get(timeout=bound(5)) == {"x": 1}
    q.close()
    assert isinstance(ei.value, PermissionError) and isinstance(ei.value, shmq.ShmqError)
    e2 = pickle.loads(pickle.dumps(ei.value))
    assert type(e2) is shmq.UntrustedSpool and str(e2) == msg


def test_unpickled_queue_handle_keeps_the_trust_decision(spool_dir):
    path = os.path.join(spool_dir, "q")
    _world_writable_queue(path)
    q = shmq.Queue(path=path, trusted=True)
    q2 = pickle.loads(pickle.dumps(q))  # reattaches with trusted=True, as opted in
    assert q2.get(timeout=bound(5)) == {"x": 1}
    q2.close()
    q.close()
    q3 = shmq.Queue(path=path, trusted=True)
    state = q3.__getstate__()
    q3.close()
    state["trusted"] = False
    with pytest.raises(shmq.UntrustedSpool):
        shmq.Queue.__new__(shmq.Queue).__setstate__(state)


def test_trust_comes_from_the_mapped_descriptor_not_the_path(spool_dir):
    mine = os.path.join(spool_dir, "mine")
    shared = os.path.join(spool_dir, "shared")
    shmq.Spool.create(mine, capacity=4096).close()
    shmq.Spool.create(shared, capacity=4096, mode=0o666).close()
    a = shmq.Spool.open(shared)
    b = shmq.Spool.open(mine)
    try:
        os.rename(mine, shared)  # the path now names a private file of ours
        assert not codec.trust_of(a).ok  # still the world-writable inode we mapped
        assert codec.trust_of(b).ok
        with pytest.raises(shmq.UntrustedSpool, match="writable by group and others"):
            codec.require_trust(a)
        assert codec.require_trust(a, trusted=True).ok
    finally:
        a.close()
        b.close()
        shmq.Spool.destroy(shared)
        # `a`'s inode is unlinked: only its semaphores remain
        _mapping.unlink_semaphores(a.sem_prefix, 0)


def test_codec_decodes_every_tag_and_pickles_only_when_trusted(spool_dir):
    import numpy as np

    sp = shmq.Spool.create(os.path.join(spool_dir, "s"), capacity=4096, mode=0o666)
    try:
        untrusted = codec.trust_of(sp)
    finally:
        sp.close()
    assert not untrusted.ok
    assert codec.decode(b"ab", F.CODEC_RAW, untrusted) == b"ab"
    assert codec.decode("é".encode(), F.CODEC_UTF8, untrusted) == "é"
    assert codec.decode(b'{"a": [1]}', F.CODEC_JSON, untrusted) == {"a": [1]}
    from shmq.columnar import encode_array

    head, data = encode_array(np.arange(3, dtype=np.int32))
    arr = codec.decode(bytes(head) + bytes(data), F.CODEC_NUMPY, untrusted)
    assert arr.tolist() == [0, 1, 2]
    for obj in ({"k": 1}, np.arange(4)):
        item, tag = codec.encode(obj)
        payload = b"".join(bytes(p) for p in item) if isinstance(item, tuple) else item
        with pytest.raises(shmq.UntrustedSpool):
            codec.decode(payload, tag, untrusted)
        got = codec.decode(payload, tag, codec.TRUSTED)
        assert got == obj if isinstance(obj, dict) else got.tolist() == obj.tolist()
    head = F.WQ_HEADER.pack(0, 0, 0, 0)
    payload = b"".join(codec.encode_workq("body", {"h": 1}, "k", head))
    with pytest.raises(shmq.UntrustedSpool):
        codec.decode(payload, F.CODEC_WORKQ, untrusted)
    assert codec.decode(payload, F.CODEC_WORKQ, codec.TRUSTED) == ("body", {"h": 1}, "k")
    with pytest.raises(shmq.UntrustedSpool):
        codec.decode_dead(codec.encode_dead({"payload": b""}), untrusted)
    with pytest.raises(shmq.ShmqError, match="unknown codec"):
        codec.decode(b"", 99, codec.TRUSTED)


def test_numpy_object_dtype_is_refused():
    import json
    import struct

    desc = json.dumps({"descr": "|O", "shape": [1]}).encode()
    head = struct.pack("<II", len(desc), 0) + desc
    head += bytes(-len(head) % 8)
    with pytest.raises(shmq.ShmqError, match="object dtype"):
        codec.decode(head + bytes(8), F.CODEC_NUMPY, codec.TRUSTED)


@pytest.mark.parametrize("shape", [[-1, -2], [-4], [2, -1]])
def test_numpy_negative_dimension_is_refused(shape):
    # Two negative dimensions multiply to a size that matches the payload: the
    # size check alone lets numpy's reshape raise a ValueError instead.
    import json
    import struct

    desc = json.dumps({"descr": "<i8", "shape": shape}).encode()
    head = struct.pack("<II", len(desc), 0) + desc
    head += bytes(-len(head) % 8)
    with pytest.raises(shmq.ShmqError, match="negative dimension"):
        codec.decode(head + bytes(16), F.CODEC_NUMPY, codec.TRUSTED)


def test_workqueue_refuses_a_dead_letter_spool_others_can_write(spool_dir):
    path = os.path.join(spool_dir, "jobs")
    shmq.WorkQueue(path, capacity=65536, dead_capacity=8192).close()
    os.chmod(path + ".dead", 0o646)
    with pytest.raises(shmq.UntrustedSpool, match=r"jobs\.dead is writable by others"):
        shmq.WorkQueue(path, capacity=65536, dead_capacity=8192)
    wq = shmq.WorkQueue(path, capacity=65536, dead_capacity=8192, trusted=True)
    wq.close()
    os.chmod(path + ".dead", 0o600)
    os.chmod(path, 0o660)
    with pytest.raises(shmq.UntrustedSpool, match=r"jobs is writable by group"):
        shmq.WorkQueue(path, capacity=65536, dead_capacity=8192)
    shmq.WorkQueue.destroy(path)


def test_cli_unpickles_only_with_unsafe_pickle(capsys, spool_dir):
    path = os.path.join(spool_dir, "q")
    _world_writable_queue(path)  # {"x": 1}: a values frame
    q = shmq.Queue(path=path, trusted=True)
    q.put(collections.OrderedDict(y=2))  # a pickle
    q.close()
    main(["tail", path, "-n", "2"])
    out = capsys.readouterr().out
    assert "pass --unsafe-pickle to decode" in out and "{'x': 1}" not in out
    assert "pass --unsafe-pickle to unpickle" in out and "OrderedDict" not in out
    assert main(["tail", path, "-n", "2", "--unsafe-pickle"]) == 0
    out = capsys.readouterr().out
    assert "{'x': 1}" in out and repr(collections.OrderedDict(y=2)) in out


def test_cli_maps_untrusted_to_permission_exit_code():
    from shmq.cli import classify as _classify

    code, msg = _classify(shmq.UntrustedSpool("/x is owned by uid 5 (owner uid 5, mode 0644)"))
    assert code == EXIT_PERMISSION and "owned by uid 5" in msg
    code, _msg = _classify(shmq.NotASpool("/x: is a FIFO"))
    assert code == EXIT_NOT_SPOOL


# --- the private default directory -----------------------------------------------------


@pytest.fixture
def private_dir(monkeypatch, spool_dir):
    """Point the per-user default directory into this test's spool directory."""
    d = os.path.join(spool_dir, "private")
    monkeypatch.setattr(_mapping, "default_dir", lambda: d)
    return d


def test_private_dir_is_created_0700_whatever_the_umask(private_dir, capsys):
    old = os.umask(0)
    try:
        sp = shmq.Spool.create("events", capacity=4096)
    finally:
        os.umask(old)
    assert sp.path == os.path.join(private_dir, "events")
    sp.close()
    st = os.lstat(private_dir)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.geteuid()
    assert main(["ls", "--json"]) == 0  # ls without a directory looks there
    assert '"name": "events"' in capsys.readouterr().out
    shmq.Spool.destroy("events")


@pytest.mark.parametrize("planted", ["symlink", "mode 0777", "mode 0750 group-writable",
                                     "a file", "another owner"])
def test_a_planted_private_dir_is_refused(private_dir, spool_dir, capsys, planted):
    if planted == "symlink":
        os.mkdir(os.path.join(spool_dir, "elsewhere"), 0o700)
        os.symlink(os.path.join(spool_dir, "elsewhere"), private_dir)
        why = "is a symbolic link"
    elif planted == "mode 0777":
        os.mkdir(private_dir)
        os.chmod(private_dir, 0o777)
        why = "writable by group or others"
    elif planted == "mode 0750 group-writable":
        os.mkdir(private_dir)
        os.chmod(private_dir, 0o770)
        why = "writable by group or others"
    elif planted == "a file":
        open(private_dir, "w").close()
        why = "is not a directory"
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another owner needs root (chown)")
        os.mkdir(private_dir, 0o700)
        os.chown(private_dir, 65534, 65534)
        why = "is owned by uid 65534"
    for call in (lambda: shmq.Spool.create("events", capacity=4096),
                 lambda: shmq.Spool.open("events"),
                 lambda: shmq.Queue(path="events"),
                 lambda: shmq.Spool.destroy("events")):
        with pytest.raises(shmq.ShmqError, match=f"{why}.*not a safe directory"):
            call()
    assert main(["ls"]) != 0
    assert "not a safe directory" in capsys.readouterr().err
    assert main(["create", "events"]) != 0
    assert not os.path.exists(os.path.join(private_dir, "events"))


def test_explicit_paths_in_the_old_shared_directory_still_work():
    import uuid

    had = os.path.isdir(_mapping.SHARED_DIR)
    path = os.path.join(_mapping.SHARED_DIR, f"t-{uuid.uuid4().hex[:10]}")
    sp = shmq.Spool.create(path, capacity=4096)
    try:
        assert sp.path == path
        assert os.stat(_mapping.SHARED_DIR).st_mode & 0o1777 == 0o1777  # shared, sticky
    finally:
        sp.close()
        shmq.Spool.destroy(path)
        if not had:
            try:
                os.rmdir(_mapping.SHARED_DIR)
            except OSError:
                pass  # someone else's spool arrived meanwhile


# --- squatted semaphore names --------------------------------------------------------


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="squatting a semaphore as another "
                                "user needs root here (chown of /dev/shm/sem.*)")


def _squat(name, uid=65534):
    """Create semaphore ``name`` as if user ``uid`` had: owned by it, mode 0666."""
    import posix_ipc

    posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o666, initial_value=5).close()
    f = _mapping.semaphore_file(name)
    os.chown(f, uid, uid)
    os.chmod(f, 0o666)


def _unlink(name):
    import posix_ipc

    try:
        posix_ipc.unlink_semaphore(name)
    except posix_ipc.ExistentialError:
        pass


@needs_root
def test_squatted_writer_semaphore_is_refused(spool_dir):
    path = os.path.join(spool_dir, "s")
    sp = shmq.Spool.create(path, capacity=4096)
    prefix = sp.sem_prefix
    sp.close()
    name = _mapping.sem_name(prefix, _mapping.SEM_WRITER)
    _unlink(name)  # e.g. after a reboot kept a disk spool: the name is free to squat
    _squat(name)
    try:
        with pytest.raises(shmq.ShmqError, match="belongs to uid 65534.*squatted"):
            shmq.Spool.open(path)
        shmq.Spool.destroy(path)
        assert os.path.exists(_mapping.semaphore_file(name))  # not ours: left to its owner
    finally:
        _unlink(name)


@needs_root
def test_squatted_group_semaphore_all_members_refuse(spool_dir, ctx):
    path = os.path.join(spool_dir, "s")
    sp = shmq.Spool.create(path, capacity=65536)
    for i in range(6):
        sp.put(b"x%d" % i)
    name = _mapping.group_sem_name(sp.sem_prefix, 0)  # the first group's slot
    _squat(name)
    try:
        with pytest.raises(shmq.ShmqError, match="squatted"):
            sp.reader("workers", group=True)
        q = ctx.Queue()
        procs = [ctx.Process(target=squatted_group_member, args=(path, q)) for _ in range(3)]
        for p in procs:
            p.start()
        assert join_all(procs) == [0, 0, 0]
        results = [q.get(timeout=bound(10)) for _ in procs]
        assert results == ["refused"] * 3  # nobody delivers through a semaphore they do not own
    finally:
        sp.close()
        _unlink(name)


def test_our_own_semaphores_are_accepted_and_get_the_spool_mode(spool_dir):
    old = os.umask(0o077)
    try:
        sp = shmq.Spool.create(os.path.join(spool_dir, "s"), capacity=4096, mode=0o660)
        r = sp.reader("g", group=True)
    finally:
        os.umask(old)
    try:
        for which in ("w", "r", "f", "g0"):
            st = os.stat(_mapping.semaphore_file(_mapping.sem_name(sp.sem_prefix, which)))
            assert stat.S_IMODE(st.st_mode) == 0o660, which
    finally:
        r.close()
        sp.close()


@needs_root
def test_squatted_joinable_queue_counter_is_refused(spool_dir):
    path = os.path.join(spool_dir, "jq")
    sp = shmq.Spool.create(path, capacity=65536, on_full="block")
    name = _mapping.sem_name(sp.sem_prefix, _mapping.SEM_UNFINISHED)
    sp.close()
    _squat(name)  # would let its owner make join() return early, or never
    try:
        with pytest.raises(shmq.ShmqError, match="squatted"):
            shmq.JoinableQueue(path=path)
        shmq.Queue(path=path).close()  # a plain Queue does not use that semaphore
    finally:
        _unlink(name)


@needs_root
def test_fsck_repair_refuses_a_squatted_writer_semaphore(spool_dir, capsys):
    import posix_ipc

    path = os.path.join(spool_dir, "s")
    sp = shmq.Spool.create(path, capacity=4096)
    name = _mapping.sem_name(sp.sem_prefix, _mapping.SEM_WRITER)
    sp.close()
    _unlink(name)
    posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o666, initial_value=0).close()  # "held"
    os.chown(_mapping.semaphore_file(name), 65534, 65534)
    try:
        code = main(["fsck", "--repair", path])
        err = capsys.readouterr().err
        assert code != 0 and "squatted" in err, err
        assert posix_ipc.Semaphore(name).value == 0  # not posted by the repair
    finally:
        _unlink(name)


@pytest.mark.parametrize("kind", ["fifo", "socket", "directory"])
def test_dispatcher_board_planted_at_path_dispatch_is_refused_promptly(plant, spool_dir, kind):
    """A FIFO (socket, directory) planted at PATH.dispatch: the dispatcher's status and
    destroy return at once with a clear error instead of blocking in open(2)."""
    from shmq.dispatch import Dispatcher, board_path, status

    path = os.path.join(spool_dir, "jobs")
    bp = plant(kind, board_path(path))
    _r, exc = prompt(status, path)
    assert isinstance(exc, shmq.NotASpool), exc
    _r, exc = prompt(Dispatcher.destroy, path)
    assert isinstance(exc, shmq.NotASpool), exc
    assert os.path.lexists(bp)  # someone else's file is left alone
