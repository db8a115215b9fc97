"""A second, unprivileged local user plays the attacker (docs/security.md).

The suite runs as root in CI: a user is created with ``useradd`` for this
module and removed afterwards.  Attacker actions run in a forked child that
drops to that user with setgid/setuid (the interpreter lives under a
directory other users cannot enter, so ``runuser ... python`` is not an
option here).  That child is test scaffolding, not a feature under test,
so it is a plain ``os.fork`` rather than each multiprocessing start method.

Every planted pickle's ``__reduce__`` would create a marker file as the
victim; each test asserts that the marker never appears.
"""

import os
import pickle
import pwd
import select
import shutil
import subprocess
import traceback
import uuid

import pytest

import shmq
from shmq import _format as F
from shmq import _mapping, codec
from shmq.cli import EXIT_PERMISSION, main

from conftest import bound

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("useradd"),
    reason="needs root and useradd to create the attacker user")

CHILD_TIMEOUT_S = bound(30)


class Evil:
    """Unpickling this creates ``marker`` (as whoever unpickles it)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def attacker():
    name = f"shmqatk{uuid.uuid4().hex[:6]}"
    r = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                       capture_output=True, text=True, timeout=bound(60))
    if r.returncode != 0:
        pytest.skip(f"useradd failed: {r.stderr.strip()}")
    pw = pwd.getpwnam(name)
    try:
        yield pw
    finally:
        shutil.rmtree(f"/dev/shm/shmq-{pw.pw_uid}", ignore_errors=True)
        subprocess.run(["userdel", name], capture_output=True, timeout=bound(60))


def as_user(pw, fn, *args):
    """Run ``fn(*args)`` in a forked child as user ``pw``; raise if it failed or hung."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the attacker
        code = 1
        try:
            os.close(rfd)
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            fn(*args)
            code = 0
        except BaseException:
            os.write(wfd, traceback.format_exc().encode()[-4000:])
        finally:
            os._exit(code)
    os.close(wfd)
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], CHILD_TIMEOUT_S)
        if not ready:
            os.kill(pid, 9)
        _, status = os.waitpid(pid, 0)
        err = os.read(rfd, 8192).decode(errors="replace")
    finally:
        os.close(pidfd)
        os.close(rfd)
    assert ready, "the attacker's child hung"
    assert os.waitstatus_to_exitcode(status) == 0, f"attacker action failed:\n{err}"


@pytest.fixture
def shared(spool_dir):
    """The spool directory made shared like /tmp (mode 1777), plus the marker path."""
    os.chmod(spool_dir, 0o1777)
    marker = os.path.join(spool_dir, "PWNED")
    yield spool_dir, marker
    assert not os.path.exists(marker), "a planted pickle ran as the victim"


def _destroy(*paths):
    for p in paths:
        try:
            shmq.Spool.destroy(p)
        except FileNotFoundError:
            pass


def _semaphores_of(path):
    """Unlink every semaphore of spool ``path``, whoever owns it, and forget the spool in
    shmq gc's registry, as ``Spool.destroy`` would (test cleanup, before unlinking it)."""
    import posix_ipc

    prefix = _mapping.read_geometry(path)["sem_prefix"]
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"sem.shmq.{prefix}."):
            try:
                posix_ipc.unlink_semaphore("/" + name[len("sem."):])
            except posix_ipc.ExistentialError:
                pass
    _mapping.unregister_spool(prefix)


# --- attacker actions (run in the child, as the attacker) -------------------------------


def _plant_queue(path, marker, mode):
    q = shmq.Queue(path=path)  # its own spool: its own trust check passes
    q.put(Evil(marker))
    q.put([Evil(marker)])
    q.close()
    os.chmod(path, mode)


def _plant_workqueue(path, marker):
    wq = shmq.WorkQueue(path, capacity=65536, dead_capacity=8192)
    wq.put(Evil(marker), key="k", headers={"h": Evil(marker)})
    wq.close()
    os.chmod(path, 0o666)
    os.chmod(path + ".dead", 0o644)


def _dead_record(marker):
    return {"message_id": 1, "payload": pickle.dumps((Evil(marker), {}, None)), "attempts": 5,
            "error": {"type": "x", "message": "x", "traceback": None}, "last_holder_pid": 1,
            "enqueued_ns": 0, "failed_ns": 0}


def _plant_dead_letters(path, marker, mode):
    sp = shmq.Spool.create(path, capacity=8192, on_full="overwrite", mode=mode)
    sp.put(codec.encode_dead(_dead_record(marker)), codec=F.CODEC_PICKLE)
    sp.put(pickle.dumps(Evil(marker)), codec=F.CODEC_PICKLE)  # the record itself
    sp.put(pickle.dumps(Evil(marker)), codec=F.CODEC_PICKLE)
    sp.close()


def _write_into(path, marker, as_queue):
    if as_queue:  # the attacker opts in: the spool is not its own
        q = shmq.Queue(path=path, trusted=True)
        q.put(Evil(marker))
        q.close()
    else:
        sp = shmq.Spool.open(path)
        sp.put(codec.encode_dead(_dead_record(marker)), codec=F.CODEC_PICKLE)
        sp.close()


def _squat_semaphore(name):
    import posix_ipc

    posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o666, initial_value=9).close()
    os.chmod(_mapping.semaphore_file(name), 0o666)


def _plant_dir(path, how, elsewhere):
    if how == "symlink":
        os.mkdir(elsewhere, 0o777)
        os.chmod(elsewhere, 0o777)
        os.symlink(elsewhere, path)
    else:
        os.mkdir(path)
        os.chmod(path, 0o777 if how == "mode 0777" else 0o700)


# --- the tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o644, 0o666])
def test_planted_queue_pickles_never_run(attacker, shared, capsys, mode):
    d, marker = shared
    path = os.path.join(d, "jobs")
    as_user(attacker, _plant_queue, path, marker, mode)
    try:
        for cls in (shmq.Queue, shmq.JoinableQueue, shmq.SimpleQueue):
            with pytest.raises(shmq.UntrustedSpool) as ei:
                cls(path=path)
            msg = str(ei.value)
            assert path in msg and attacker.pw_name in msg and f"mode {mode:04o}" in msg
        for argv in (["tail", path], ["cat", path], ["tail", path, "--format", "json"]):
            assert main(argv) == 0
            assert "Evil" not in capsys.readouterr().out
        assert main(["export", path, os.path.join(d, "out.dump")]) == 0  # bytes, never objects
        os.unlink(os.path.join(d, "out.dump"))
    finally:
        _destroy(path)


def test_planted_workqueue_main_spool_never_runs(attacker, shared, capsys):
    d, marker = shared
    path = os.path.join(d, "jobs")
    as_user(attacker, _plant_workqueue, path, marker)
    try:
        with pytest.raises(shmq.UntrustedSpool,
                           match=f"jobs is owned by another user \\(owner {attacker.pw_name} "):
            shmq.WorkQueue(path, capacity=65536, dead_capacity=8192)
        assert main(["stat", path]) == 0  # statistics read counters, never bodies
        capsys.readouterr()
    finally:
        _destroy(path, path + ".dead")


@pytest.mark.parametrize("mode", [0o644, 0o666])
def test_planted_dead_letter_spool_never_runs(attacker, shared, capsys, mode):
    """The issue's first finding: a planted ``jobs.dead`` beside the victim's future queue."""
    d, marker = shared
    path = os.path.join(d, "jobs")
    as_user(attacker, _plant_dead_letters, path + ".dead", marker, mode)
    try:
        with pytest.raises(shmq.UntrustedSpool,
                           match=rf"jobs\.dead is owned by another user \(owner {attacker.pw_name} "):
            shmq.WorkQueue(path, capacity=65536, dead_capacity=8192)
        assert os.path.exists(path)  # the victim's own main spool was created, then closed
        assert main(["stat", path]) == 0  # counts the dead letters without unpickling them
        assert "dead" in capsys.readouterr().out
        code = main(["tail", path + ".dead", "--format", "json"])
        assert code == 0 and "Evil" not in capsys.readouterr().out
    finally:
        _destroy(path, path + ".dead")


def test_victims_own_world_writable_spools_never_run_planted_pickles(attacker, shared):
    d, marker = shared
    qpath = os.path.join(d, "q")
    shmq.Spool.create(qpath, capacity=65536, on_full="block", mode=0o666).close()
    wpath = os.path.join(d, "jobs")
    wq = shmq.WorkQueue(wpath, capacity=65536, dead_capacity=8192)
    os.chmod(wpath + ".dead", 0o666)  # the victim's mistake, after attaching
    for which in "wrf":  # (and its semaphores, so others can use it)
        os.chmod(_mapping.semaphore_file(_mapping.sem_name(wq._dead.spool.sem_prefix, which)), 0o666)
    try:
        as_user(attacker, _write_into, qpath, marker, True)
        as_user(attacker, _write_into, wpath + ".dead", marker, False)
        with pytest.raises(shmq.UntrustedSpool, match="writable by group and others"):
            shmq.Queue(path=qpath)
        # the open handle decides again before reading dead letters
        for call in (wq.dead_letters, wq.replay_dead, wq.purge_dead):
            with pytest.raises(shmq.UntrustedSpool, match=r"jobs\.dead is writable"):
                call()
        with pytest.raises(shmq.UntrustedSpool):
            shmq.WorkQueue(wpath, capacity=65536, dead_capacity=8192)
    finally:
        wq.close()
        _destroy(qpath, wpath, wpath + ".dead")


@pytest.mark.parametrize("how", ["mode 0777", "mode 0700", "symlink"])
def test_planted_private_directory_is_refused(attacker, shared, monkeypatch, capsys, how):
    d, _marker = shared
    private = os.path.join(d, "private")
    monkeypatch.setattr(_mapping, "default_dir", lambda: private)
    as_user(attacker, _plant_dir, private, how, os.path.join(d, "elsewhere"))
    for call in (lambda: shmq.Spool.create("events", capacity=4096),
                 lambda: shmq.Queue(path="events"),
                 lambda: shmq.WorkQueue("events")):
        with pytest.raises(shmq.ShmqError, match="not a safe directory"):
            call()
    assert main(["ls"]) != 0 and "not a safe directory" in capsys.readouterr().err
    assert not os.listdir(private)


def test_squatted_semaphores_are_refused(attacker, shared):
    d, _marker = shared
    path = os.path.join(d, "s")
    sp = shmq.Spool.create(path, capacity=65536)
    prefix = sp.sem_prefix
    sp.put(b"x")
    try:
        # the names are visible in /dev/shm once the spool exists: squat a group's
        as_user(attacker, _squat_semaphore, _mapping.group_sem_name(prefix, 0))
        with pytest.raises(shmq.ShmqError, match=f"belongs to uid {attacker.pw_uid}.*squatted"):
            sp.reader("workers", group=True)
        # and the writer lock's, after it was gone (a disk spool after a reboot)
        sp.close()
        import posix_ipc

        posix_ipc.unlink_semaphore(_mapping.sem_name(prefix, _mapping.SEM_WRITER))
        as_user(attacker, _squat_semaphore, _mapping.sem_name(prefix, _mapping.SEM_WRITER))
        with pytest.raises(shmq.ShmqError, match="squatted"):
            shmq.Spool.open(path)
        assert main(["put", path, "x"]) != 0
    finally:
        sp.close()
        _semaphores_of(path)
        os.unlink(path)


def test_attackers_semaphores_on_its_own_spool_are_its_to_use(attacker, shared):
    """The owner of a spool made its semaphores: using its spool (trusted) is not squatting."""
    d, marker = shared
    path = os.path.join(d, "theirs")
    as_user(attacker, _plant_queue, path, marker, 0o666)
    try:
        sp = shmq.Spool.open(path)  # sem owner == spool owner: accepted
        assert sp.stats().frames == 2
        sp.close()
        with pytest.raises(shmq.UntrustedSpool):
            shmq.Queue(path=path)
    finally:
        _destroy(path)  # unlinks the owner's semaphores too
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"sem.shmq.{attacker.pw_uid}")]


def test_cli_reports_untrusted_as_permission(attacker, shared, capsys):
    d, marker = shared
    path = os.path.join(d, "jobs")
    as_user(attacker, _plant_queue, path, marker, 0o666)
    try:
        from shmq.cli import classify as _classify

        with pytest.raises(shmq.UntrustedSpool) as ei:
            shmq.Queue(path=path)
        code, msg = _classify(ei.value)
        assert code == EXIT_PERMISSION and attacker.pw_name in msg
    finally:
        _destroy(path)


def _plant_file_with_prefix(path, prefix):
    sp = shmq.Spool.create(path, capacity=4096, mode=0o666)
    sp.close()
    geo = _mapping.read_geometry(path)
    _mapping.unlink_semaphores(geo["sem_prefix"], 0)  # its own: only the file is needed
    fields = {k: geo[k] for k in ("file_bytes", "ring_offset", "ring_bytes", "slot_offset",
                                  "slot_count", "lease_offset", "lease_count", "policy",
                                  "checksum", "created_ns")}
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, F.pack_geometry(sem_prefix=prefix, **fields), 0)  # now naming the victim's
    os.close(fd)


def test_destroying_a_planted_file_never_unlinks_our_semaphores(attacker, shared):
    d, _marker = shared
    mine = shmq.Spool.create(os.path.join(d, "mine"), capacity=4096)
    planted = os.path.join(d, "planted")
    try:
        own_prefix = mine.sem_prefix
        as_user(attacker, _plant_file_with_prefix, planted, own_prefix)
        shmq.Spool.destroy(planted)  # removes the attacker's file ...
        assert not os.path.exists(planted)
        for which in "wrf":  # ... but not our live semaphores
            assert os.path.exists(_mapping.semaphore_file(_mapping.sem_name(own_prefix, which)))
        mine.put(b"still works")
        assert mine.reader().get(timeout=bound(5)).data == b"still works"
    finally:
        mine.close()
        shmq.Spool.destroy(mine.path)


def test_group_writable_spool_accepts_members_semaphores_only(attacker, shared):
    """Sharing with a group: a member may create a group's semaphore; a non-member may not."""
    d, _marker = shared
    path = os.path.join(d, "shared")
    sp = shmq.Spool.create(path, capacity=65536, mode=0o660)
    sp.put(b"x")
    name = _mapping.group_sem_name(sp.sem_prefix, 0)
    sp.close()
    try:
        os.chown(path, 0, 0)  # group root: the attacker is not a member
        as_user(attacker, _squat_semaphore, name)
        sp = shmq.Spool.open(path)
        try:
            with pytest.raises(shmq.ShmqError, match=f"belongs to uid {attacker.pw_uid}, who cannot "
                               "write the spool"):
                sp.reader("workers", group=True)
        finally:
            sp.close()
        os.chown(path, 0, attacker.pw_gid)  # now its group: the same semaphore is a member's
        sp = shmq.Spool.open(path)
        try:
            assert sp.reader("workers", group=True).get(timeout=bound(5)).data == b"x"
        finally:
            sp.close()
    finally:
        _semaphores_of(path)
        os.unlink(path)
