"""shmq._mapping: path resolution, creating spool files, opening and validating them."""

import errno
import os
import pathlib
import stat

import zlib

import posix_ipc
import pytest

from shmq import _format as F
from shmq import _mapping as M
from shmq.errors import ShmqError, SpoolFormatError

from conftest import bound

GEOMETRY = dict(ring_bytes=1 << 16, policy="block", slots=8, leases=4, checksum=True)


def _sems(prefix):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"sem.shmq.{prefix}."))


@pytest.fixture
def created(spool_path):
    """A spool file made by create_file (semaphores removed afterwards)."""
    M.create_file(spool_path, mode=0o600, **GEOMETRY)
    geo = M.read_geometry(spool_path)
    yield spool_path, geo
    M.unlink_semaphores(geo["sem_prefix"], geo["slot_count"])


# --- resolve_path ------------------------------------------------------------------------


def test_resolve_path():
    assert M.resolve_path("jobs") == os.path.join(M.default_dir(), "jobs")
    assert M.resolve_path("/x/y") == "/x/y"
    assert M.resolve_path("./a/../b") == os.path.abspath("b")
    assert M.resolve_path(pathlib.Path("/x/y")) == "/x/y"
    assert M.resolve_path(b"/x/y") == "/x/y"


@pytest.mark.parametrize("bad", ["", "a\x00b", ".", ".."])
def test_resolve_path_rejects_bad_names(bad):
    with pytest.raises(ValueError, match="invalid spool"):
        M.resolve_path(bad)


@pytest.mark.parametrize("bad", [None, 3, ["a"]])
def test_resolve_path_rejects_other_types(bad):
    with pytest.raises(TypeError, match="spool path must be a str or os.PathLike"):
        M.resolve_path(bad)


# --- create_file -------------------------------------------------------------------------


def test_create_file_writes_a_complete_preallocated_spool(created):
    path, geo = created
    st = os.stat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == geo["file_bytes"]
    assert st.st_blocks * 512 >= geo["file_bytes"]  # not sparse: every page reserved
    assert geo["policy"] == "block" and geo["slot_count"] == 8 and geo["lease_count"] == 4
    assert geo["checksum"] is True and geo["ring_bytes"] == 1 << 16
    assert _sems(geo["sem_prefix"]) == [f"sem.shmq.{geo['sem_prefix']}.{w}" for w in "frw"]
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.endswith(".creating")]


def test_create_file_mode_ignores_the_umask(spool_path):
    old = os.umask(0o077)
    try:
        M.create_file(spool_path, mode=0o660, **GEOMETRY)
    finally:
        os.umask(old)
    geo = M.read_geometry(spool_path)
    try:
        assert stat.S_IMODE(os.stat(spool_path).st_mode) == 0o660
        sem = f"/dev/shm/sem.shmq.{geo['sem_prefix']}.w"
        assert stat.S_IMODE(os.stat(sem).st_mode) == 0o660  # writers of the spool can lock it
    finally:
        M.unlink_semaphores(geo["sem_prefix"], geo["slot_count"])


def test_create_file_never_replaces_and_leaves_nothing_behind(created):
    path, geo = created
    before = os.stat(path)
    with pytest.raises(FileExistsError, match="already exists"):
        M.create_file(path, mode=0o600, **GEOMETRY)
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert M.read_geometry(path) == geo
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.endswith(".creating")]
    assert _sems(geo["sem_prefix"])  # the existing spool's semaphores untouched


def test_create_file_into_a_missing_directory(spool_dir):
    path = os.path.join(spool_dir, "no", "such")
    with pytest.raises(FileNotFoundError) as ei:
        M.create_file(path, mode=0o600, **GEOMETRY)
    assert ei.value.errno == errno.ENOENT and ei.value.filename == os.path.dirname(path)


def test_create_file_over_a_symlink_does_not_follow_it(spool_dir, tmp_path):
    target = tmp_path / "target"
    link = os.path.join(spool_dir, "link")
    os.symlink(target, link)
    with pytest.raises(FileExistsError):
        M.create_file(link, mode=0o600, **GEOMETRY)
    assert not target.exists()


# --- Mapping -----------------------------------------------------------------------------


def test_mapping_opens_and_maps_the_regions(created):
    path, geo = created
    m = M.Mapping(path)
    try:
        assert m.geo == geo and m.path == path
        assert len(m.mm) == geo["file_bytes"]
        assert len(m.ctl) == F.CTL_WORDS
        assert len(m.slots) == geo["slot_count"] * F.SLOT_WORDS
        assert m.ctl[F.W_NEXT_SEQ] == 0 and m.ctl[F.W_FIRST_SEQ] == 0  # an empty ring
        assert m.st_uid == os.geteuid() and stat.S_IMODE(m.st_mode) == 0o600
        fd = m.fd
        m.reopen_fd()  # after fork: a private open file description, same inode
        assert os.fstat(m.fd).st_ino == os.stat(path).st_ino
        assert m.fd != fd
    finally:
        m.close()
    m.close()  # idempotent
    assert m.mm is None


def test_mapping_refuses_symlinks(created, spool_dir):
    path, _ = created
    link = os.path.join(spool_dir, "link")
    os.symlink(path, link)
    with pytest.raises(ShmqError, match="symbolic link.*refusing to follow it"):
        M.Mapping(link)


def test_mapping_missing_file(spool_path):
    with pytest.raises(FileNotFoundError, match="no spool at this path") as ei:
        M.Mapping(spool_path)
    assert ei.value.filename == spool_path


def test_mapping_refuses_a_fifo(spool_path):
    os.mkfifo(spool_path, 0o600)
    try:
        with pytest.raises(SpoolFormatError):  # (main: NotASpool, a subclass)
            M.Mapping(spool_path)
    finally:
        os.unlink(spool_path)


def test_read_geometry_of_a_fifo_does_not_hang(spool_path):
    """Regression: read_geometry opened a FIFO for reading without O_NONBLOCK and waited
    for a writer forever (Spool.destroy of a FIFO at a spool path hung)."""
    os.mkfifo(spool_path, 0o600)
    try:
        with pytest.raises(SpoolFormatError):
            M.read_geometry(spool_path)
    finally:
        os.unlink(spool_path)


def test_mapping_refuses_a_foreign_file(spool_path):
    with open(spool_path, "wb") as f:
        f.write(b"#!/bin/sh\necho hello\n" + bytes(8192))
    with pytest.raises(SpoolFormatError, match="not a shmq spool .bad magic"):
        M.Mapping(spool_path)
    with pytest.raises(SpoolFormatError, match="bad magic"):
        M.read_geometry(spool_path)


def test_mapping_refuses_a_truncated_spool(created):
    path, geo = created
    os.truncate(path, geo["file_bytes"] - F.PAGE)
    with pytest.raises(SpoolFormatError, match="truncated spool"):
        M.Mapping(path)


def test_mapping_refuses_a_corrupt_header(created):
    path, _ = created
    with open(path, "r+b") as f:
        f.seek(40)
        b = f.read(1)
        f.seek(40)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(SpoolFormatError, match="checksum mismatch"):
        M.Mapping(path)


def test_mapping_refuses_a_newer_format(created):
    path, _ = created
    with open(path, "rb") as f:
        raw = bytearray(f.read(F.GEOMETRY.size))
    raw[8:12] = (F.FORMAT_VERSION + 1).to_bytes(4, "little")
    raw[124:128] = zlib.crc32(bytes(raw[:124])).to_bytes(4, "little")
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(raw), 0)
    finally:
        os.close(fd)
    with pytest.raises(SpoolFormatError, match="newer than this shmq supports"):
        M.Mapping(path)


@pytest.mark.parametrize("version", F.OLD_FORMAT_VERSIONS)
def test_an_older_format_is_refused_untouched_and_can_be_removed(created, version):
    # A version-1/2 file keeps FIRST_SEQ/FIRST_POS where this shmq keeps reserved
    # zeros: opening it is refused (with the migration path), nothing is written,
    # and destroy still removes it together with its semaphores.
    import shmq

    path, geo = created
    fd = os.open(path, os.O_RDWR)
    try:
        raw = bytearray(os.pread(fd, F.GEOMETRY.size, 0))
        raw[8:12] = version.to_bytes(4, "little")
        raw[124:128] = zlib.crc32(bytes(raw[:124])).to_bytes(4, "little")
        os.pwrite(fd, bytes(raw), 0)
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        before = f.read()
    with pytest.raises(SpoolFormatError, match=f"version {version} was written by an older shmq.*shmq export"):
        shmq.Spool.open(path)
    with pytest.raises(SpoolFormatError, match="older shmq"):
        M.Mapping(path)
    with open(path, "rb") as f:
        assert f.read() == before
    assert _sems(geo["sem_prefix"])
    shmq.Spool.destroy(path)
    assert not os.path.exists(path) and not _sems(geo["sem_prefix"])


def test_open_semaphore_creates_with_the_mode(spool_dir):
    name = M.group_sem_name("fedcba987654", 3)
    assert name == "/shmq.fedcba987654.g3"
    sem = M.open_semaphore(name, 1, mode=0o640)
    try:
        assert stat.S_IMODE(os.stat("/dev/shm/sem.shmq.fedcba987654.g3").st_mode) == 0o640
        assert sem.value == 1
    finally:
        sem.close()
        M.unlink_semaphores("fedcba987654", 4)
    with pytest.raises(posix_ipc.ExistentialError):
        posix_ipc.Semaphore(name)


# --- the engine's semaphores are plain POSIX named semaphores ------------------------
#
# The engine creates, opens and unlinks a spool's semaphores itself (sem_open:
# shmq/engine/sem.c); posix_ipc is only in the test extra, to show that what the
# engine makes is what any other sem_open user sees and operates.


def test_a_spools_semaphores_are_posix_named_semaphores(spool_dir):
    import shmq

    sp = shmq.Spool.create(os.path.join(spool_dir, "posix"), capacity="64KiB", mode=0o640)
    try:
        names = [M.sem_name(sp.sem_prefix, w) for w in (M.SEM_WRITER, M.SEM_READ_WAITERS,
                                                          M.SEM_SPACE_WAITERS)]
        for name, value in zip(names, (1, 0, 0)):
            sem = posix_ipc.Semaphore(name)  # opens what the engine created ...
            try:
                assert sem.value == value
                assert stat.S_IMODE(os.stat(M.semaphore_file(name)).st_mode) == 0o640
            finally:
                sem.close()
        writer = posix_ipc.Semaphore(names[0])
        try:
            writer.acquire(0)  # ... and takes the writer lock the engine's writers take
            assert sp.core.put(b"x", 0, -1, 0.0) == shmq._core.LOCK_STUCK
            writer.release()
            assert sp.put(b"y") == 0
        finally:
            writer.close()
        r = sp.reader("workers", group=True)  # a group's semaphore, made on first use
        g = posix_ipc.Semaphore(M.group_sem_name(sp.sem_prefix, r.slot))
        try:
            assert g.value == 1
            g.acquire(0)
            assert r.core_cursor.get(0.0) == shmq._core.LOCK_STUCK
            g.release()
            assert r.get(timeout=bound(10)).data == b"y"
        finally:
            g.close()
            r.close()
    finally:
        sp.close()
        shmq.Spool.destroy(os.path.join(spool_dir, "posix"))
    for name in names:
        with pytest.raises(posix_ipc.ExistentialError):  # destroy unlinked them
            posix_ipc.Semaphore(name)


def test_the_engine_opens_a_semaphore_posix_ipc_created(spool_dir):
    from shmq import _core

    name = f"/shmq.test-posix-{os.getpid()}"
    posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=2).close()
    try:
        sem = _core.Semaphore(name, 0, 0o600)  # exists: opened, not re-initialized
        try:
            assert sem.value == 2 and sem.acquire(0) and sem.value == 1
        finally:
            sem.close()
        with pytest.raises(FileExistsError):
            _core.Semaphore(name, 0, 0o600, create=True)
    finally:
        M.unlink_semaphore(name)
    with pytest.raises(FileNotFoundError):
        _core.Semaphore(name, existing=True)
    M.unlink_semaphore(name)  # a missing one is fine
