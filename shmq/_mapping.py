"""Creating, opening, validating and mapping spool files, and naming their semaphores.

A spool is created under a temporary name, fully initialized, then
``link()``-ed into place: the path either does not exist or names a complete
spool, even if the creator is killed midway.  Files are opened with
``O_NOFOLLOW`` and created with an explicit ``fchmod`` (the mode is not
subject to the umask, so ``mode=0o660`` means 0660).
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import stat
import time

import posix_ipc

from . import _format as F
from .errors import ShmqError, SpoolFormatError

DEFAULT_DIR = "/dev/shm/shmq"

SEM_WRITER = "w"  # writer lock
SEM_READ_WAITERS = "r"  # readers waiting for frames
SEM_SPACE_WAITERS = "f"  # writers waiting for room (block policy)
SEM_UNFINISHED = "u"  # JoinableQueue: items put and not yet task_done()


def resolve_path(path) -> str:
    """A bare name (no slash) lives under ``/dev/shm/shmq/``; paths are kept as given.

    :raises TypeError: not a str or os.PathLike.
    :raises ValueError: empty, NUL byte, or a bare name that is '.' or '..'.
    """
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str):
        raise TypeError(f"spool path must be a str or os.PathLike, not {type(path).__name__}")
    if not path or "\x00" in path:
        raise ValueError(f"invalid spool path {path!r}")
    if "/" not in path:
        if path in (".", ".."):
            raise ValueError(f"invalid spool name {path!r}")
        return os.path.join(DEFAULT_DIR, path)
    return os.path.abspath(path)


def sem_name(prefix: str, which: str) -> str:
    return f"/shmq.{prefix}.{which}"


def group_sem_name(prefix: str, slot: int) -> str:
    return sem_name(prefix, f"g{slot}")


def open_semaphore(name: str, initial: int, mode: int = 0o600):
    """Open (or create: a group's on first use, or after a reboot kept a disk
    spool) a named semaphore, readable and writable by whoever may use the spool."""
    sem = posix_ipc.Semaphore(name, posix_ipc.O_CREAT, mode=mode, initial_value=initial)
    _chmod_semaphore(name, mode)
    return sem


def _chmod_semaphore(name: str, mode: int) -> None:
    # sem_open() applies the umask; glibc keeps named semaphores in /dev/shm.
    try:
        path = "/dev/shm/sem." + name.lstrip("/")
        if os.stat(path).st_uid == os.geteuid():
            os.chmod(path, mode)
    except OSError:
        pass


def unlink_semaphores(prefix: str, slot_count: int) -> None:
    names = [sem_name(prefix, w) for w in
             (SEM_WRITER, SEM_READ_WAITERS, SEM_SPACE_WAITERS, SEM_UNFINISHED)]
    names += [group_sem_name(prefix, i) for i in range(slot_count)]
    for name in names:
        try:
            posix_ipc.unlink_semaphore(name)
        except posix_ipc.ExistentialError:
            pass


def _ensure_default_dir(path: str) -> None:
    parent = os.path.dirname(path)
    if parent != DEFAULT_DIR:
        return
    try:
        os.mkdir(parent, 0o1777)
        os.chmod(parent, 0o1777)  # shared by users like /tmp: sticky, umask-proof
    except FileExistsError:
        pass
    st = os.lstat(parent)
    # Another user could have planted it: it must be a real directory, ours or
    # root's, and not writable by others unless sticky (as /tmp is).
    if (not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, os.geteuid())
            or (st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX)):
        raise ShmqError(f"{parent} is not a safe directory (a symlink, someone else's, or "
                        "world-writable without the sticky bit); remove it or use a full path")


def create_file(path: str, *, ring_bytes: int, policy: str, mode: int, slots: int,
                leases: int, checksum: bool) -> None:
    """Create a fully initialized, pre-allocated spool file at ``path``.

    :raises FileExistsError: something already exists at ``path``.
    """
    _ensure_default_dir(path)
    slot_offset, lease_offset, ring_offset, ring_bytes, file_bytes = F.ring_geometry(
        ring_bytes, slots, leases)
    prefix = secrets.token_hex(6)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise FileNotFoundError(errno.ENOENT, "no such directory for the spool", parent)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.{prefix}.creating")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    linked = False
    try:
        os.fchmod(fd, mode)
        # Not sparse: reserve every page now, so a full tmpfs fails here and
        # not as SIGBUS in the middle of a put.
        try:
            os.posix_fallocate(fd, 0, file_bytes)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, file_bytes)
        geometry = F.pack_geometry(
            file_bytes=file_bytes, ring_offset=ring_offset, ring_bytes=ring_bytes,
            slot_offset=slot_offset, slot_count=slots, lease_offset=lease_offset,
            lease_count=leases, policy=policy, checksum=checksum, sem_prefix=prefix,
            created_ns=time.time_ns())
        sem_mode = mode & 0o666  # whoever may open the spool must be able to lock it
        for which, initial in ((SEM_WRITER, 1), (SEM_READ_WAITERS, 0), (SEM_SPACE_WAITERS, 0)):
            posix_ipc.Semaphore(sem_name(prefix, which), posix_ipc.O_CREX, mode=sem_mode,
                                initial_value=initial).close()
            _chmod_semaphore(sem_name(prefix, which), sem_mode)
        os.pwrite(fd, geometry, 0)  # control words are all zero: seq 0, empty ring
        try:
            os.link(tmp, path)  # atomic publish; never replaces an existing file
            linked = True
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, "a file already exists there "
                                  "(use Spool.open, or Spool.destroy it first)", path) from None
    finally:
        os.close(fd)
        os.unlink(tmp)
        if not linked:
            unlink_semaphores(prefix, 0)


class Mapping:
    """An open, validated, memory-mapped spool file.

    Attributes: ``path``, ``fd``, ``mm``, ``geo`` (decoded geometry),
    ``ctl`` (header page as u64 words), ``slots`` (reader table as u64 words).
    """

    def __init__(self, path: str):
        self.path = path
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ShmqError(f"{path}: is a symbolic link; refusing to follow it") from None
            if exc.errno == errno.ENOENT:
                raise FileNotFoundError(errno.ENOENT, "no spool at this path "
                                        "(create it with shmq.Spool.create)", path) from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SpoolFormatError(f"{path}: not a regular file")
            head = os.pread(fd, F.GEOMETRY.size, 0)
            self.geo = F.unpack_geometry(head, st.st_size, path)
            self.mm = mmap.mmap(fd, self.geo["file_bytes"], mmap.MAP_SHARED,
                                mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.st_uid = st.st_uid
        self.st_mode = st.st_mode
        self._view = memoryview(self.mm)
        self.ctl = self._view[:F.HEADER_BYTES].cast("Q")
        so, n = self.geo["slot_offset"], self.geo["slot_count"]
        self.slots = self._view[so:so + n * F.SLOT_BYTES].cast("Q")

    def reopen_fd(self) -> None:
        """After fork: get a private open file description for the same inode.

        The inherited descriptor shares the parent's OFD locks; keeping it
        would keep the parent's named readers marked alive after it dies.
        """
        new = os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_CLOEXEC)
        os.close(self.fd)
        self.fd = new

    def close(self) -> None:
        if self.mm is None:
            return
        self.slots.release()
        self.ctl.release()
        self._view.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a view; the kernel unmaps at exit
        os.close(self.fd)
        self.mm = None


def read_geometry(path: str) -> dict:
    """Decode a spool's geometry without mapping it (for destroy and listings).

    :raises SpoolFormatError: not a regular file, or not a valid spool.
    """
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpoolFormatError(f"{path}: not a regular file")
        return F.unpack_geometry(os.pread(fd, F.GEOMETRY.size, 0), st.st_size, path)
    finally:
        os.close(fd)
